//! The target's view of one initiator's session: its channels and the executed-tag ledger.
//!
//! A session may be held in **parts**, one per thread that owns some of its channels (tyched's
//! network threads each own their NICs' channels): a [`TargetSession`] is one part. Each part
//! holds its own channels and the home ledgers of the homes that first joined on it; the only
//! session-wide state is the [`Directory`] (which part holds which home's ledger), written when a
//! channel joins and read when a request names a home the part has not seen. A request that
//! arrives on the part of its home (the normal case: a tag is first issued on its home channel)
//! is decided by that part alone. A copy of a modifying request arriving on another part (a
//! re-issue after a path failed) goes to the home's part as a [`PartMessage::Admit`] and waits in
//! its channel's slot for [`PartMessage::Execute`] or [`PartMessage::Settle`]; its completion
//! goes back as [`PartMessage::Record`]. The caller carries the messages between parts
//! ([`TargetSession::poll_message`], [`TargetSession::handle_message`]), in order between any two
//! parts. With one part (the default, [`TargetSession::new`]) no message is ever produced.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use tyche_wire::{Op, Request, Status};

use crate::channel::{
    deliver, deliver_pieces, Channel, ChannelEvent, DeadReason, FrameDrop, Pieces, Received, Role, Transmit,
};
use crate::config::TAG_WINDOW;
use crate::ledger::{Admission, Ledger, Waiter};
use crate::time::{earliest, Instant};

/// What the target serves in a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportGeometry {
    /// Size in bytes.
    pub size: u64,
    /// Whether writes, discards and write-zeroes are refused.
    pub read_only: bool,
    /// Whether DISCARD is supported.
    pub discard: bool,
}

/// Something the caller must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetEvent {
    /// Execute `request` and call [`TargetSession::complete`]. Write data is in `damq` slot
    /// `request.damq` of channel `channel`; read data goes there.
    Execute {
        /// Channel index.
        channel: u16,
        /// The request (its `remq` names it in [`TargetSession::complete`]).
        request: Request,
        /// Generation of its `damq` slot's contents: write data placed
        /// ([`TargetInbound::Write`]) with another generation is not this request's.
        generation: u32,
    },
    /// A channel died (its slots are reclaimed; requests being executed on it may still be
    /// completed, and nothing is sent).
    ChannelDead {
        /// Channel index.
        channel: u16,
        /// Why.
        reason: DeadReason,
    },
}

/// What [`TargetSession::handle_frame`] did with a frame: [`TargetInboundOf`] with write data in a
/// slice, or, from [`TargetSession::handle_frame_pieces`], in [`Pieces`] (`P`).
pub type TargetInbound<'a, P = &'a [u8]> = TargetInboundOf<P>;

/// What the target session did with a frame, write data's payload being a `P`
/// ([`TargetInbound`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetInboundOf<P> {
    /// Used.
    Consumed,
    /// Write data: it belongs in `damq` slot `damq` of channel `channel` at byte `offset`.
    Write {
        /// Channel index.
        channel: u16,
        /// `damq` slot.
        damq: u16,
        /// Byte offset within the request's data.
        offset: u32,
        /// The bytes, borrowed from the frame (or, on an encrypting channel, from the caller's
        /// scratch buffer).
        payload: P,
        /// Generation of the slot's contents (see [`TargetEvent::Execute`]).
        generation: u32,
        /// Tag of the request the data belongs to.
        tag: u64,
    },
    /// Not used.
    Dropped(FrameDrop),
}

/// Bound on the records of a session part's ledger, all its home ledgers together: the initiator
/// keeps its tags within [`TAG_WINDOW`] of its floor.
const LEDGER_LIMIT: usize = TAG_WINDOW as usize;

/// Which part of a session holds a channel (the caller numbers them: tyched, its network
/// threads).
pub type PartId = u32;

/// The session-wide record of which part holds the ledger of each home channel: the part on
/// which a channel index first joined the session. Shared by the parts of one session; written
/// when a channel joins, read only when a part meets a home it has not seen before (each part
/// keeps what it learnt), never on the per-frame path of a request on its home channel.
#[derive(Debug, Default)]
pub struct Directory {
    homes: Mutex<BTreeMap<u16, PartId>>,
}

impl Directory {
    /// A directory with no homes.
    pub fn new() -> Arc<Directory> {
        Arc::new(Directory::default())
    }

    /// Records that `home` joined on `part` unless it joined before; the part holding its ledger.
    /// (A caller that decides where a channel goes before the part adds it, as tyched's control
    /// does, records it here first, so that no part ever meets that home unknown.)
    pub fn register(&self, home: u16, part: PartId) -> PartId {
        *self.homes.lock().unwrap_or_else(PoisonError::into_inner).entry(home).or_insert(part)
    }

    /// The part holding `home`'s ledger, if `home` ever joined.
    fn lookup(&self, home: u16) -> Option<PartId> {
        self.homes.lock().unwrap_or_else(PoisonError::into_inner).get(&home).copied()
    }
}

/// What one part of a session tells another ([`TargetSession::poll_message`]). The caller
/// delivers it with [`TargetSession::handle_message`] to the part it names, in order with the
/// other messages between the same two parts. At most one message is in flight per request
/// slot of a channel, so the number in flight is bounded by the session's `remq` slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartMessage {
    /// To the part of `home`: decide a copy of a modifying request that arrived on channel
    /// `channel` (slot `remq`) of part `from`.
    Admit {
        /// The tag's home channel.
        home: u16,
        /// Tag.
        tag: u64,
        /// The highest `FLOOR` part `from` has seen.
        floor: u64,
        /// The part holding the copy.
        from: PartId,
        /// The copy's channel.
        channel: u16,
        /// The copy's `remq` slot.
        remq: u16,
    },
    /// To the copy's part: execute it (the first copy of its tag).
    Execute {
        /// The copy's channel.
        channel: u16,
        /// The copy's `remq` slot.
        remq: u16,
        /// Tag.
        tag: u64,
    },
    /// To the copy's part: answer it with `status` without executing it (a recorded status, a
    /// stale or refused copy, or the status of the copy it waited for).
    Settle {
        /// The copy's channel.
        channel: u16,
        /// The copy's `remq` slot.
        remq: u16,
        /// Tag.
        tag: u64,
        /// Its answer.
        status: Status,
    },
    /// To the part of `home`: a copy of `tag` executed elsewhere with `status`.
    Record {
        /// The tag's home channel.
        home: u16,
        /// Tag.
        tag: u64,
        /// The highest `FLOOR` the executing part has seen.
        floor: u64,
        /// How it went.
        status: Status,
    },
}

/// One initiator's session on the target, or one part of it (see the module documentation).
///
/// Executes each modifying request (WRITE, DISCARD, WRITE_ZEROES) at most once per tag, however
/// many copies arrive on however many channels and parts: a copy of an executed tag gets the
/// recorded status, and a copy below the initiator's floor is refused, so a late duplicate of an
/// old write is never applied over a newer one.
#[derive(Debug)]
pub struct TargetSession {
    id: u64,
    /// This part.
    part: PartId,
    /// Which part holds which home's ledger (session-wide).
    directory: Arc<Directory>,
    /// What this part learnt from the directory.
    homes: BTreeMap<u16, PartId>,
    /// Copies sent to their home's part for a decision, by (channel, `remq`, tag): the request
    /// and its slot generation. Bounded by the `remq` slots of this part's channels.
    pending: BTreeMap<(u16, u16, u64), (Request, u32)>,
    /// Messages for other parts.
    outbox: VecDeque<(PartId, PartMessage)>,
    /// Copies sent to another part for a decision.
    forwarded: u64,
    /// Messages naming a copy this part does not hold (a bug of the caller: counted, ignored).
    stray_messages: u64,
    ethertype: u16,
    geometry: ExportGeometry,
    /// By the index the initiator chose (any `u16`: a map, never a vector sized by the peer).
    channels: BTreeMap<u16, Channel>,
    /// Replaced channels (reconnects on the same index) with requests still executing: their
    /// completions must reach them, not the new channel that reuses their slot numbers.
    retired: Vec<Channel>,
    /// The largest `FLOOR` any request carried.
    floor: u64,
    /// The at-most-once records, in one home ledger per tag's home channel.
    ledger: Ledger,
    events: VecDeque<TargetEvent>,
    duplicates_suppressed: u64,
    /// Requests refused because their `HOME` names no channel of the session.
    bad_home: u64,
}

impl TargetSession {
    /// A session with no channels yet, in one part.
    pub fn new(id: u64, ethertype: u16, geometry: ExportGeometry) -> Self {
        TargetSession::part(id, ethertype, geometry, 0, Directory::new())
    }

    /// Part `part` of a session whose parts share `directory`, with no channels yet.
    pub fn part(id: u64, ethertype: u16, geometry: ExportGeometry, part: PartId, directory: Arc<Directory>) -> Self {
        TargetSession {
            id,
            part,
            directory,
            homes: BTreeMap::new(),
            pending: BTreeMap::new(),
            outbox: VecDeque::new(),
            forwarded: 0,
            stray_messages: 0,
            ethertype,
            geometry,
            channels: BTreeMap::new(),
            retired: Vec::new(),
            floor: 0,
            ledger: Ledger::default(),
            events: VecDeque::new(),
            duplicates_suppressed: 0,
            bad_home: 0,
        }
    }

    /// Session id.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// The export served.
    pub fn geometry(&self) -> &ExportGeometry {
        &self.geometry
    }
    /// Copies of already executed modifying requests that were not executed again.
    pub fn duplicates_suppressed(&self) -> u64 {
        self.duplicates_suppressed
    }
    /// Requests refused (INVALID) because their `HOME` named no channel of the session.
    pub fn bad_home(&self) -> u64 {
        self.bad_home
    }
    /// At-most-once records held by this part, all its home ledgers together (at most the tag
    /// window).
    pub fn ledger_records(&self) -> usize {
        self.ledger.records()
    }
    /// This part's number.
    pub fn part_id(&self) -> PartId {
        self.part
    }
    /// Copies of modifying requests sent to their home's part for a decision.
    pub fn forwarded(&self) -> u64 {
        self.forwarded
    }
    /// Copies waiting for their home's part to decide.
    pub fn awaiting_decision(&self) -> usize {
        self.pending.len()
    }
    /// Messages from other parts that named no copy of this part (a caller bug).
    pub fn stray_messages(&self) -> u64 {
        self.stray_messages
    }
    /// The channel with index `i`, if any.
    pub fn channel(&self, i: u16) -> Option<&Channel> {
        self.channels.get(&i)
    }
    /// Channels, dead ones included.
    pub fn channel_count(&self) -> usize {
        self.channels.len()
    }
    /// Whether every channel is dead (the session can be reclaimed once nothing executes).
    pub fn all_dead(&self) -> bool {
        self.channels.values().all(|c| c.dead().is_some())
    }

    /// Adds a channel, replacing (and aborting) any earlier one with the same index.
    pub fn add_channel(&mut self, channel: Channel) {
        assert_eq!(channel.role(), Role::Target);
        assert_eq!(channel.envelope().session, self.id);
        let idx = channel.envelope().channel;
        let home = self.directory.register(idx, self.part);
        self.homes.insert(idx, home);
        if let Some(mut old) = self.channels.insert(idx, channel) {
            old.abort();
            if old.executing() > 0 {
                self.retired.push(old);
            }
        }
    }

    /// Aborts channel `idx` of this part and forgets it here (the index joined again on another
    /// part): requests it still executes can be completed, as on a replaced channel.
    pub fn abort_channel(&mut self, idx: u16) {
        if let Some(mut old) = self.channels.remove(&idx) {
            old.abort();
            if old.executing() > 0 {
                self.retired.push(old);
            }
        }
    }

    /// Hands the session a received frame.
    ///
    /// `scratch` holds the plaintext of a frame of an encrypting channel (a buffer the caller
    /// keeps, so that it is allocated once).
    pub fn handle_frame<'a>(&mut self, now: Instant, bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> TargetInbound<'a> {
        let channels = &mut self.channels;
        let lookup = move |i: u16| {
            let channels = channels; // moved in: the closure is FnOnce and may return a borrow of it
            channels.get_mut(&i)
        };
        let (idx, received) = match deliver(now, bytes, scratch, self.ethertype, self.id, lookup) {
            Ok((idx, received, _)) => (idx, received),
            Err(d) => return TargetInbound::Dropped(d),
        };
        let payload = match &received {
            Received::Placed(p) => p.payload,
            _ => &[],
        };
        self.inbound(idx, received, payload)
    }

    /// What a delivered frame of channel `idx` comes to, write data's payload being `payload`;
    /// the requests it made ready are admitted.
    fn inbound<P>(&mut self, idx: u16, received: Received<'_>, payload: P) -> TargetInbound<'static, P> {
        let out = match received {
            Received::Consumed => TargetInbound::Consumed,
            Received::Dropped(r) => TargetInbound::Dropped(FrameDrop::Channel(r)),
            Received::Placed(p) => TargetInbound::Write {
                channel: idx,
                damq: p.damq,
                offset: p.offset,
                payload,
                generation: p.generation,
                tag: p.tag,
            },
        };
        self.drain(idx);
        out
    }

    /// [`TargetSession::handle_frame`] for a frame in pieces (a multi-buffer frame, at most
    /// [`crate::MAX_PIECES`], the headers in the first): the payload of write data comes back
    /// as the pieces it lies in, never copied, unless the channel seals its frames or carries
    /// digests (their checks need the whole frame: it is gathered into `gather` first).
    pub fn handle_frame_pieces<'a>(
        &mut self,
        now: Instant,
        pieces: &[&'a [u8]],
        scratch: &'a mut Vec<u8>,
        gather: &'a mut Vec<u8>,
    ) -> TargetInbound<'a, Pieces<'a>> {
        if let [bytes] = pieces {
            return match self.handle_frame(now, bytes, scratch) {
                TargetInbound::Consumed => TargetInbound::Consumed,
                TargetInbound::Dropped(d) => TargetInbound::Dropped(d),
                TargetInbound::Write { channel, damq, offset, payload, generation, tag } => {
                    TargetInbound::Write { channel, damq, offset, payload: Pieces::one(payload), generation, tag }
                }
            };
        }
        let channels = &mut self.channels;
        let lookup = move |i: u16| {
            let channels = channels; // moved in: the closure is FnOnce and may return a borrow of it
            channels.get_mut(&i)
        };
        match deliver_pieces(now, pieces, scratch, gather, self.ethertype, self.id, lookup) {
            Ok((idx, received, payload)) => self.inbound(idx, received, payload),
            Err(d) => TargetInbound::Dropped(d),
        }
    }

    fn drain(&mut self, idx: u16) {
        while let Some(ev) = self.channels.get_mut(&idx).and_then(Channel::poll_event) {
            match ev {
                ChannelEvent::Request(ready) => self.admit(idx, ready.request, ready.generation),
                ChannelEvent::Dead(reason) => self.events.push_back(TargetEvent::ChannelDead { channel: idx, reason }),
                ChannelEvent::Completed { .. } => unreachable!("target channels emit no completions"),
            }
        }
    }

    /// Completes the request `tag` in slot `remq` of channel `idx`: on the current channel of
    /// that index, or on a replaced one that still has it.
    fn complete_in(&mut self, idx: u16, remq: u16, tag: u64, status: Status) -> Option<Request> {
        let current = self.channels.get_mut(&idx);
        let ch = match current {
            Some(ch) if ch.executing_tag(remq) == Some(tag) => ch,
            _ => {
                let found =
                    self.retired.iter().position(|c| c.envelope().channel == idx && c.executing_tag(remq) == Some(tag));
                &mut self.retired[found?]
            }
        };
        let req = ch.complete(remq, status);
        self.retired.retain(|c| c.executing() > 0);
        req
    }

    fn reply(&mut self, idx: u16, r: &Request, status: Status) {
        self.complete_in(idx, r.remq, r.tag, status);
    }

    /// The part holding `home`'s ledger, if `home` ever joined the session.
    fn home_part(&mut self, home: u16) -> Option<PartId> {
        if let Some(&p) = self.homes.get(&home) {
            return Some(p);
        }
        let p = self.directory.lookup(home)?;
        self.homes.insert(home, p);
        Some(p)
    }

    /// A request is ready on channel `idx`: check it, deduplicate it in its home channel's
    /// home ledger (here, or on the home's part), hand it to the caller.
    fn admit(&mut self, idx: u16, r: Request, generation: u32) {
        // The home must be a channel of this session (a reconnect keeps the index): a made-up
        // one would open home ledgers without bound.
        let Some(home_part) = self.home_part(r.home) else {
            self.bad_home += 1;
            return self.reply(idx, &r, Status::Invalid);
        };
        let local = home_part == self.part;
        self.floor = self.floor.max(r.floor);
        let floor = self.floor;
        let stale = if local { self.stale_at_home(r.home, r.tag) } else { r.tag < floor };
        if stale {
            self.duplicates_suppressed += 1;
            return self.reply(idx, &r, Status::Aborted);
        }
        let g = self.geometry;
        if r.offset.saturating_add(r.length as u64) > g.size {
            return self.reply(idx, &r, Status::OutOfRange);
        }
        if g.read_only && r.op.modifies() {
            return self.reply(idx, &r, Status::ReadOnly);
        }
        if r.op == Op::Discard && !g.discard {
            return self.reply(idx, &r, Status::Unsupported);
        }
        if r.op.modifies() {
            if !local {
                // Its home's part decides; the copy waits in its slot until it does.
                self.forwarded += 1;
                self.pending.insert((idx, r.remq, r.tag), (r, generation));
                let m =
                    PartMessage::Admit { home: r.home, tag: r.tag, floor, from: self.part, channel: idx, remq: r.remq };
                self.outbox.push_back((home_part, m));
                return;
            }
            let w = Waiter { part: self.part, channel: idx, remq: r.remq, tag: r.tag };
            match self.decide(r.home, w) {
                None => return self.reply(idx, &r, Status::Invalid),
                Some(Admission::Execute) => {}
                Some(Admission::Wait) => return,
                Some(Admission::Recorded(status)) => return self.reply(idx, &r, status),
            }
        }
        self.events.push_back(TargetEvent::Execute { channel: idx, request: r, generation });
    }

    /// Whether `tag` lies below the floor of `home`'s home ledger (here), after raising it to ours.
    fn stale_at_home(&mut self, home: u16, tag: u64) -> bool {
        let floor = self.floor;
        self.ledger.with(home, |home_ledger, _| {
            home_ledger.raise_floor(floor);
            home_ledger.stale(tag)
        })
    }

    /// The ledger's decision for copy `w` (not stale) of a modifying request of `home` (whose
    /// home ledger is here); `None`: refuse it (the records are full).
    fn decide(&mut self, home: u16, w: Waiter) -> Option<Admission> {
        if self.ledger.records() >= LEDGER_LIMIT {
            // Records of homes that have sent nothing lately may lie below the floor.
            self.ledger.raise_all(self.floor);
        }
        let admitted = self.ledger.with(home, |home_ledger, records| home_ledger.admit(w, records < LEDGER_LIMIT));
        if matches!(admitted, Some(Admission::Wait | Admission::Recorded(_))) {
            self.duplicates_suppressed += 1;
        }
        admitted
    }

    /// Answers copy `w` with `status` without executing it: here, or on its part.
    fn settle(&mut self, w: Waiter, status: Status) {
        if w.part == self.part {
            self.pending.remove(&(w.channel, w.remq, w.tag));
            self.complete_in(w.channel, w.remq, w.tag, status);
        } else {
            let m = PartMessage::Settle { channel: w.channel, remq: w.remq, tag: w.tag, status };
            self.outbox.push_back((w.part, m));
        }
    }

    /// Records how `tag` of `home` (whose home ledger is here) went, and answers the copies that
    /// waited for it.
    fn record(&mut self, home: u16, tag: u64, status: Status) {
        let floor = self.floor;
        let waiters = self.ledger.with(home, |home_ledger, _| {
            home_ledger.raise_floor(floor);
            home_ledger.record(tag, status)
        });
        for w in waiters {
            self.settle(w, status);
        }
    }

    /// The next message for another part of the session: (to which part, what).
    pub fn poll_message(&mut self) -> Option<(PartId, PartMessage)> {
        self.outbox.pop_front()
    }

    /// Takes a message another part of the session sent this one.
    pub fn handle_message(&mut self, msg: PartMessage) {
        match msg {
            PartMessage::Admit { home, tag, floor, from, channel, remq } => {
                self.floor = self.floor.max(floor);
                let w = Waiter { part: from, channel, remq, tag };
                if self.stale_at_home(home, tag) {
                    self.duplicates_suppressed += 1;
                    return self.settle(w, Status::Aborted);
                }
                match self.decide(home, w) {
                    None => self.settle(w, Status::Invalid),
                    Some(Admission::Execute) if from == self.part => {
                        // (Never sent to oneself; handled all the same.)
                        self.handle_message(PartMessage::Execute { channel, remq, tag })
                    }
                    Some(Admission::Execute) => {
                        self.outbox.push_back((from, PartMessage::Execute { channel, remq, tag }))
                    }
                    Some(Admission::Wait) => {}
                    Some(Admission::Recorded(status)) => self.settle(w, status),
                }
            }
            PartMessage::Execute { channel, remq, tag } => match self.pending.remove(&(channel, remq, tag)) {
                Some((request, generation)) => {
                    self.events.push_back(TargetEvent::Execute { channel, request, generation })
                }
                None => self.stray_messages += 1,
            },
            PartMessage::Settle { channel, remq, tag, status } => {
                if self.pending.remove(&(channel, remq, tag)).is_none() {
                    self.stray_messages += 1;
                }
                self.complete_in(channel, remq, tag, status);
            }
            PartMessage::Record { home, tag, floor, status } => {
                self.floor = self.floor.max(floor);
                self.record(home, tag, status);
            }
        }
    }

    /// Reports the outcome of the [`TargetEvent::Execute`] of `request` on `channel`. For a
    /// successful read, the data must be in the request's `damq` slot. Returns `false` if no such
    /// request was executing (a caller bug: completed twice, or never handed out).
    ///
    /// The request (not just its `remq` slot) names what is completed: if the channel was replaced
    /// by a reconnect meanwhile, the new channel may have reused the slot number.
    pub fn complete(&mut self, channel: u16, request: &Request, status: Status) -> bool {
        let Some(req) = self.complete_in(channel, request.remq, request.tag, status) else { return false };
        if req.op.modifies() {
            // (ABORTED means not executed: the tag is not recorded, so a copy re-issued in this
            // session runs.) Only requests with a known home are executed.
            match self.home_part(req.home) {
                Some(p) if p == self.part => self.record(req.home, req.tag, status),
                Some(p) => {
                    let m = PartMessage::Record { home: req.home, tag: req.tag, floor: self.floor, status };
                    self.outbox.push_back((p, m));
                }
                None => {}
            }
        }
        true
    }

    /// Starts an orderly close of every channel: each sends DISCONNECT with `reason` and is dead
    /// after it (target shutdown).
    pub fn close(&mut self, reason: tyche_wire::DisconnectReason) {
        for c in self.channels.values_mut() {
            c.close(reason);
        }
    }

    /// Fences this session (or this part of it): a newer attachment of the same initiator
    /// fenced it (the storage side: [`crate::fence`]). Every channel closes (DISCONNECT NORMAL),
    /// and each request it handed out that storage has not been given, `not_started` (channel
    /// and request), is answered ABORTED: not executed, so a copy re-issued in the new session
    /// runs. Returns how many were answered.
    pub fn fence(&mut self, not_started: impl IntoIterator<Item = (u16, Request)>) -> usize {
        self.close(tyche_wire::DisconnectReason::Normal);
        not_started.into_iter().filter(|(c, r)| self.complete(*c, r, Status::Aborted)).count()
    }

    /// Writes the next frame channel `channel` wants to send into `buf`. Once its payload (if
    /// any) is in place, the caller passes it to [`TargetSession::seal`] and sends the length
    /// that returns.
    pub fn poll_transmit(&mut self, now: Instant, channel: u16, buf: &mut [u8]) -> Option<Transmit> {
        let t = self.channels.get_mut(&channel)?.poll_transmit(now, buf);
        self.drain(channel);
        t
    }

    /// Seals the frame of `len` bytes that [`TargetSession::poll_transmit`] wrote for `channel`
    /// ([`Channel::seal`]): the length to send.
    pub fn seal(&mut self, channel: u16, buf: &mut [u8], len: usize) -> usize {
        match self.channels.get_mut(&channel) {
            Some(c) => c.seal(buf, len),
            None => len,
        }
    }

    /// Whether the session's channels seal their frames (a keyed export).
    pub fn sealed(&self) -> bool {
        self.channels.values().any(Channel::sealed)
    }

    /// Whether channel `channel` has a frame to send now.
    pub fn wants_transmit(&self, channel: u16) -> bool {
        self.channel(channel).is_some_and(Channel::wants_transmit)
    }

    /// The next time [`TargetSession::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.channels.values().fold(None, |t, c| earliest(t, c.poll_timeout()))
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<u16> =
            self.channels.iter().filter(|(_, c)| c.poll_timeout().is_some_and(|t| t <= now)).map(|(&i, _)| i).collect();
        for i in due {
            if let Some(c) = self.channels.get_mut(&i) {
                c.handle_timeout(now);
            }
            self.drain(i);
        }
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<TargetEvent> {
        self.events.pop_front()
    }

    /// Indices of the channels, dead ones included.
    pub fn channel_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.channels.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(p: PartId, directory: &Arc<Directory>) -> TargetSession {
        let g = ExportGeometry { size: 1 << 20, read_only: false, discard: true };
        TargetSession::part(7, tyche_wire::DEFAULT_ETHERTYPE, g, p, Arc::clone(directory))
    }

    fn admit(tag: u64, floor: u64, from: PartId, remq: u16) -> PartMessage {
        PartMessage::Admit { home: 0, tag, floor, from, channel: from as u16, remq }
    }

    #[test]
    fn the_home_part_decides_forwarded_copies_once_and_answers_the_waiters() {
        let dir = Directory::new();
        let mut home = part(0, &dir);
        // The first copy, from part 1: execute it there.
        home.handle_message(admit(5, 0, 1, 3));
        assert_eq!(home.poll_message(), Some((1, PartMessage::Execute { channel: 1, remq: 3, tag: 5 })));
        // A second copy, from part 2, while the first executes: it waits.
        home.handle_message(admit(5, 0, 2, 4));
        assert_eq!(home.poll_message(), None);
        assert_eq!(home.duplicates_suppressed(), 1);
        // Part 1 reports the status: the waiter on part 2 gets it.
        home.handle_message(PartMessage::Record { home: 0, tag: 5, floor: 0, status: Status::NoSpace });
        let settled = PartMessage::Settle { channel: 2, remq: 4, tag: 5, status: Status::NoSpace };
        assert_eq!(home.poll_message(), Some((2, settled)));
        // A later copy gets the recorded status without executing.
        home.handle_message(admit(5, 0, 3, 1));
        let recorded = PartMessage::Settle { channel: 3, remq: 1, tag: 5, status: Status::NoSpace };
        assert_eq!(home.poll_message(), Some((3, recorded)));
        assert_eq!(home.ledger_records(), 1);
        // A floor past it: the record goes, and a copy below the floor is refused.
        home.handle_message(admit(9, 6, 1, 2));
        assert_eq!(home.poll_message(), Some((1, PartMessage::Execute { channel: 1, remq: 2, tag: 9 })));
        home.handle_message(admit(5, 0, 2, 5));
        let refused = PartMessage::Settle { channel: 2, remq: 5, tag: 5, status: Status::Aborted };
        assert_eq!(home.poll_message(), Some((2, refused)));
        assert_eq!(home.ledger_records(), 1, "only tag 9 (executing) is kept");
    }

    #[test]
    fn an_aborted_execution_is_not_recorded_so_a_later_copy_runs() {
        let dir = Directory::new();
        let mut home = part(0, &dir);
        home.handle_message(admit(3, 0, 1, 0));
        assert!(matches!(home.poll_message(), Some((1, PartMessage::Execute { .. }))));
        home.handle_message(PartMessage::Record { home: 0, tag: 3, floor: 0, status: Status::Aborted });
        home.handle_message(admit(3, 0, 2, 0));
        assert_eq!(home.poll_message(), Some((2, PartMessage::Execute { channel: 2, remq: 0, tag: 3 })));
    }

    #[test]
    fn messages_naming_no_copy_are_counted_not_trusted() {
        let dir = Directory::new();
        let mut p = part(1, &dir);
        p.handle_message(PartMessage::Execute { channel: 4, remq: 1, tag: 2 });
        p.handle_message(PartMessage::Settle { channel: 4, remq: 1, tag: 2, status: Status::Ok });
        assert_eq!(p.stray_messages(), 2);
        assert_eq!(p.poll_event(), None);
    }

    #[test]
    fn the_directory_keeps_the_first_part_of_each_home() {
        let dir = Directory::new();
        assert_eq!(dir.register(3, 1), 1);
        assert_eq!(dir.register(3, 0), 1, "a rejoin elsewhere leaves the ledger where it was");
        assert_eq!((dir.lookup(3), dir.lookup(4)), (Some(1), None));
    }
}
