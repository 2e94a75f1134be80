//! The target's view of one initiator's session: its channels and the executed-tag ledger.

use std::collections::{BTreeMap, VecDeque};

use tyche_wire::{Op, Request, Status};

use crate::channel::{
    deliver, deliver_pieces, Channel, ChannelEvent, DeadReason, FrameDrop, Pieces, Received, Role, Transmit,
};
use crate::config::TAG_WINDOW;
use crate::ledger::{Admission, Ledger};
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

/// Bound on the records of a session's ledger, all home shards together: the initiator keeps
/// its tags within [`TAG_WINDOW`] of its floor.
const LEDGER_LIMIT: usize = TAG_WINDOW as usize;

/// One initiator's session on the target.
///
/// Executes each modifying request (WRITE, DISCARD, WRITE_ZEROES) at most once per tag, however
/// many copies arrive on however many channels: a copy of an executed tag gets the recorded
/// status, and a copy below the initiator's floor is refused, so a late duplicate of an old write
/// is never applied over a newer one.
#[derive(Debug)]
pub struct TargetSession {
    id: u64,
    ethertype: u16,
    geometry: ExportGeometry,
    /// By the index the initiator chose (any `u16`: a map, never a vector sized by the peer).
    channels: BTreeMap<u16, Channel>,
    /// Replaced channels (reconnects on the same index) with requests still executing: their
    /// completions must reach them, not the new channel that reuses their slot numbers.
    retired: Vec<Channel>,
    /// The largest `FLOOR` any request carried.
    floor: u64,
    /// The at-most-once records, in shards by the tags' home channels.
    ledger: Ledger,
    events: VecDeque<TargetEvent>,
    duplicates_suppressed: u64,
    /// Requests refused because their `HOME` names no channel of the session.
    bad_home: u64,
}

impl TargetSession {
    /// A session with no channels yet.
    pub fn new(id: u64, ethertype: u16, geometry: ExportGeometry) -> Self {
        TargetSession {
            id,
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
    /// At-most-once records held, all home shards together (at most the tag window).
    pub fn ledger_records(&self) -> usize {
        self.ledger.records()
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
        if let Some(mut old) = self.channels.insert(idx, channel) {
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
        let out = match received {
            Received::Consumed => TargetInbound::Consumed,
            Received::Dropped(r) => TargetInbound::Dropped(FrameDrop::Channel(r)),
            Received::Placed(p) => TargetInbound::Write {
                channel: idx,
                damq: p.damq,
                offset: p.offset,
                payload: p.payload,
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
        let (idx, received, payload) =
            match deliver_pieces(now, pieces, scratch, gather, self.ethertype, self.id, lookup) {
                Ok(r) => r,
                Err(d) => return TargetInbound::Dropped(d),
            };
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

    /// A request is ready on channel `idx`: check it, deduplicate it in its home channel's
    /// ledger shard, hand it to the caller.
    fn admit(&mut self, idx: u16, r: Request, generation: u32) {
        // The home must be a channel of this session (a reconnect keeps the index): a made-up
        // one would open shards without bound.
        if !self.channels.contains_key(&r.home) {
            self.bad_home += 1;
            return self.reply(idx, &r, Status::Invalid);
        }
        self.floor = self.floor.max(r.floor);
        let floor = self.floor;
        let stale = self.ledger.with(r.home, |shard, _| {
            shard.raise_floor(floor);
            shard.stale(r.tag)
        });
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
            if self.ledger.records() >= LEDGER_LIMIT {
                // Records of homes that have sent nothing lately may lie below the floor.
                self.ledger.raise_all(floor);
            }
            let admitted =
                self.ledger.with(r.home, |shard, records| shard.admit((idx, r.remq, r.tag), records < LEDGER_LIMIT));
            match admitted {
                None => return self.reply(idx, &r, Status::Invalid),
                Some(Admission::Execute) => {}
                Some(Admission::Wait) => {
                    self.duplicates_suppressed += 1;
                    return;
                }
                Some(Admission::Recorded(status)) => {
                    self.duplicates_suppressed += 1;
                    return self.reply(idx, &r, status);
                }
            }
        }
        self.events.push_back(TargetEvent::Execute { channel: idx, request: r, generation });
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
            // session runs.)
            let floor = self.floor;
            let waiters = self.ledger.with(req.home, |shard, _| {
                shard.raise_floor(floor);
                shard.record(req.tag, status)
            });
            for (c, remq, tag) in waiters {
                self.complete_in(c, remq, tag, status);
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
