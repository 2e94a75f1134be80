//! The initiator's view of an attached export: a volume bundling every channel of a session.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use tyche_wire::flags::FEATURE_BLOCK_STATUS;
use tyche_wire::{DisconnectReason, DurabilityEpoch, Op, Status, SECTOR_SIZE};

use crate::channel::{
    deliver, deliver_pieces, Channel, ChannelEvent, DeadReason, DropReason, FrameDrop, Pieces, Received, Role,
    Submission, Transmit,
};
use crate::config::TAG_WINDOW;
use crate::scheduler::{ChannelView, Scheduler};
use crate::time::{earliest, Instant};

/// Largest DISCARD or WRITE_ZEROES part (the wire length is a `u32`).
const MAX_RANGE_PART: u64 = (u32::MAX / SECTOR_SIZE * SECTOR_SIZE) as u64;

/// ABORTED answers to one part within one session before it fails with that status (a new
/// session starts the count again): a target going away answers ABORTED and then disconnects,
/// so a part rarely sees more than one per channel.
const MAX_ABORTS: u8 = 8;

/// Settings of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeConfig {
    /// Export size in bytes.
    pub export_size: u64,
    /// Whether the export is read-only.
    pub read_only: bool,
    /// How long requests wait while no channel is alive before they fail (NVMe's
    /// `ctrl_loss_tmo`); zero fails them as soon as the last channel dies.
    pub no_path_timeout: Duration,
    /// Most requests outstanding at once (the caller's queue depth bound).
    pub max_requests: usize,
}

/// One block request from the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoRequest {
    /// Caller's id, unique among its outstanding requests; names its buffer in payload refs.
    pub id: u64,
    /// Operation.
    pub op: Op,
    /// Force unit access.
    pub fua: bool,
    /// Byte offset (multiple of 512).
    pub offset: u64,
    /// Bytes (multiple of 512; zero for FLUSH).
    pub length: u64,
    /// NUMA node of the request's buffers, for channel choice.
    pub node: Option<u32>,
}

/// Why [`Volume::submit`] refused a request (nothing was queued).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubmitError {
    /// Offset or length not a multiple of 512, or a zero-length read/write.
    Unaligned,
    /// The range runs past the end of the export.
    OutOfRange,
    /// A modifying request on a read-only export.
    ReadOnly,
    /// `max_requests` are outstanding, or the tag window is exhausted; retry after a completion.
    Busy,
    /// The id is already in use by an outstanding request.
    DuplicateId,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoError {
    /// The target reported this status.
    Target(Status),
    /// No channel was alive for `no_path_timeout`.
    NoPath,
}

/// Something the caller must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeEvent {
    /// A request finished. For a successful read every byte has been placed.
    Completed {
        /// Caller's id.
        id: u64,
        /// Outcome.
        result: Result<(), IoError>,
    },
    /// The target answered ABORTED on a channel (it is stopping, or dropped the session): the
    /// part goes back to the queue and the channel gets no more parts. It waits for the
    /// target's DISCONNECT, and is closed after a grace (5 s) without one; a
    /// [`VolumeEvent::ChannelDead`] follows either way.
    ChannelAborted {
        /// Channel index.
        channel: u16,
    },
    /// A channel died; `reissued` parts in flight on it went back to the queue.
    ChannelDead {
        /// Channel index.
        channel: u16,
        /// Why.
        reason: DeadReason,
        /// Parts re-queued for other channels.
        reissued: usize,
    },
}

/// What a volume owes its user about the writes it completed: what a volume that replaces it
/// (a restarted engine, a restarted initiator process) takes over with
/// [`Volume::inherit_debt`], so that a lost write is reported by a FLUSH even across the
/// replacement ([`Volume::durability_debt`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DurabilityDebt {
    /// Every write completed is covered by a completed FLUSH: nothing can be lost.
    #[default]
    Clear,
    /// Writes no FLUSH covered were acknowledged under this durability epoch: they are still
    /// there if the target presents it again, lost (and owed to the user) if it presents
    /// another.
    AtRisk(DurabilityEpoch),
    /// Writes may have been lost and no FLUSH has said so yet: the next FLUSH to complete fails.
    Owed,
}

impl DurabilityDebt {
    /// Both debts together: what a volume inheriting both owes.
    pub fn merge(self, other: DurabilityDebt) -> DurabilityDebt {
        use DurabilityDebt::*;
        match (self, other) {
            (Owed, _) | (_, Owed) => Owed,
            (Clear, d) | (d, Clear) => d,
            (AtRisk(a), AtRisk(b)) if a.keeps(&b) => AtRisk(a),
            (AtRisk(_), AtRisk(_)) => Owed,
        }
    }
}

/// What [`Volume::handle_frame`] did with a frame: [`InboundOf`] with read data in a slice, or,
/// from [`Volume::handle_frame_pieces`], in [`Pieces`] (`P`).
pub type Inbound<'a, P = &'a [u8]> = InboundOf<P>;

/// What the volume did with a frame, read data's payload being a `P` ([`Inbound`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboundOf<P> {
    /// Used; nothing more to do.
    Consumed,
    /// Read data: copy `payload` into request `id`'s buffer at byte `offset`.
    Read {
        /// Caller's id.
        id: u64,
        /// Byte offset within the request.
        offset: u64,
        /// The bytes, borrowed from the frame.
        payload: P,
    },
    /// Not used.
    Dropped(FrameDrop),
}

/// A frame written by [`Volume::poll_transmit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutFrame {
    /// Frame length.
    pub len: usize,
    /// For write data: copy `len` bytes of request `id`'s buffer from byte `offset` to
    /// `buf[DATA_FRAME_OVERHEAD..]` before sending. `None` for other frames, and for late
    /// retransmissions of data the target already has (their payload is already zeroed).
    pub payload: Option<(u64, u64, u32)>,
}

#[derive(Debug, Clone, Copy)]
struct Part {
    id: u64,
    op: Op,
    fua: bool,
    offset: u64,
    length: u32,
    req_offset: u64,
    node: Option<u32>,
    channel: Option<u16>,
    /// The channel the part was first issued on in the current session (its REQUEST's `HOME`,
    /// kept when it is re-issued elsewhere).
    home: Option<u16>,
    /// ABORTED answers in the current session.
    aborts: u8,
}

#[derive(Debug)]
struct Outstanding {
    parts_left: u32,
    error: Option<IoError>,
    op: Op,
    fua: bool,
    /// For a FLUSH: the modifications completed before it was submitted ([`Volume::done_writes`]).
    covers: u64,
    /// A FLUSH outstanding when the session was lost with writes no FLUSH had covered, and
    /// the new session's durability epoch differed: it fails whatever the new session answers.
    doubtful: bool,
    /// A FLUSH outstanding when the session was lost with writes no FLUSH had covered, while
    /// the new session's epoch is not known yet ([`Volume::resume`]): doubtful if it differs.
    undecided: bool,
}

#[derive(Debug)]
struct Member {
    channel: Channel,
    node: Option<u32>,
    /// When the target answered ABORTED on it (it is stopping, or dropped the session): no
    /// part goes to it any more. It stays open for the target's DISCONNECT SHUTDOWN (which says
    /// the target flushed before it stopped), and is closed after [`RETIRE_GRACE`] without one.
    retiring: Option<Instant>,
}

impl Member {
    fn usable(&self) -> bool {
        self.channel.dead().is_none() && self.retiring.is_none()
    }
}

/// How long a channel the target answered ABORTED on waits for the target's DISCONNECT before
/// this end closes it (a target that stops drains its storage first).
const RETIRE_GRACE: Duration = Duration::from_secs(5);

/// A session's channels bundled into one block device.
///
/// Sans-IO like [`Channel`]: frames in through [`Volume::handle_frame`], out through
/// [`Volume::poll_transmit`] per channel, timers through [`Volume::poll_timeout`] and
/// [`Volume::handle_timeout`], results through [`Volume::poll_event`].
#[derive(Debug)]
pub struct Volume {
    config: VolumeConfig,
    session: u64,
    ethertype: u16,
    members: Vec<Option<Member>>,
    scheduler: Box<dyn Scheduler>,
    next_tag: u64,
    parts: BTreeMap<u64, Part>,
    pending: VecDeque<u64>,
    requests: HashMap<u64, Outstanding>,
    events: VecDeque<VolumeEvent>,
    no_path_since: Option<Instant>,
    views: Vec<ChannelView>,
    /// The part size of the channels of an abandoned session, until the new one has channels.
    last_max_io: u32,
    /// Parts the target answered ABORTED (re-queued).
    aborted: u64,
    /// Sessions this volume moved to after the first ([`Volume::resume`]).
    resumes: u64,
    /// Modifications (without FUA) completed successfully so far.
    done_writes: u64,
    /// Of which a completed FLUSH covered the first `flushed`.
    flushed: u64,
    /// A channel of the current session heard DISCONNECT SHUTDOWN: the target flushed
    /// everything before it stopped.
    shutdown_seen: bool,
    /// The next FLUSH to complete fails: a session was lost with unflushed writes, and no FLUSH
    /// has reported it yet.
    owed_flush_error: bool,
    /// FLUSHes failed because a lost session may have lost unflushed writes.
    durability_errors: u64,
    /// The durability epoch of the current session, once a channel of it joined the volume.
    epoch: Option<DurabilityEpoch>,
    /// Writes no FLUSH covered were acknowledged under this epoch by a session (or an earlier
    /// volume) since lost, and the current session's epoch is not known yet: when its first
    /// channel joins, they are kept (same epoch) or owed (another, or this is
    /// [`DurabilityEpoch::NONE`]).
    undecided: Option<DurabilityEpoch>,
    /// Channels refused because their ACCEPT carried another epoch than the session's first.
    epoch_conflicts: u64,
}

impl Volume {
    /// An empty volume for `session`; add channels with [`Volume::add_channel`].
    pub fn new(
        config: VolumeConfig,
        session: u64,
        ethertype: u16,
        scheduler: Box<dyn Scheduler>,
        now: Instant,
    ) -> Self {
        Volume {
            config,
            session,
            ethertype,
            members: Vec::new(),
            scheduler,
            next_tag: 1,
            parts: BTreeMap::new(),
            pending: VecDeque::new(),
            requests: HashMap::new(),
            events: VecDeque::new(),
            no_path_since: Some(now),
            views: Vec::new(),
            last_max_io: SECTOR_SIZE,
            aborted: 0,
            resumes: 0,
            done_writes: 0,
            flushed: 0,
            shutdown_seen: false,
            owed_flush_error: false,
            durability_errors: 0,
            epoch: None,
            undecided: None,
            epoch_conflicts: 0,
        }
    }

    /// Adds (or replaces, after a reconnect) the channel with index `channel.envelope().channel`.
    ///
    /// The first channel of a session fixes the session's durability epoch
    /// ([`Channel::durability_epoch`]) and settles what an earlier, lost session left undecided
    /// ([`Volume::resume`]). A later channel of the same session whose ACCEPT carried another
    /// epoch cannot come from one target: it is closed at once with a protocol error (a
    /// [`VolumeEvent::ChannelDead`] follows) and never used.
    pub fn add_channel(&mut self, mut channel: Channel, node: Option<u32>, now: Instant) {
        assert_eq!(channel.role(), Role::Initiator);
        assert_eq!(channel.envelope().session, self.session, "channel of another session");
        let idx = channel.envelope().channel as usize;
        if self.members.len() <= idx {
            self.members.resize_with(idx + 1, || None);
        }
        if let Some(old) = self.members[idx].as_mut() {
            old.channel.abort();
            self.fail_over(idx as u16, DeadReason::Closed, now);
        }
        let epoch = channel.durability_epoch();
        let conflict = match self.epoch {
            Some(e) => e != epoch,
            None => {
                self.epoch = Some(epoch);
                self.settle(epoch);
                false
            }
        };
        if conflict {
            self.epoch_conflicts += 1;
            channel.close(DisconnectReason::ProtocolError);
            self.members[idx] = Some(Member { channel, node, retiring: Some(now) });
            if self.live_channels() == 0 && self.no_path_since.is_none() {
                self.no_path_since = Some(now);
            }
        } else {
            self.members[idx] = Some(Member { channel, node, retiring: None });
            self.no_path_since = None;
        }
        self.pump(now);
    }

    /// The current session's epoch is now known: what a lost session left undecided is kept
    /// or owed.
    fn settle(&mut self, epoch: DurabilityEpoch) {
        let Some(old) = self.undecided.take() else { return };
        let kept = old.keeps(&epoch);
        if !kept {
            // Gone: the FLUSHes outstanding at the loss, and the first to complete whenever it
            // was submitted, report it (as Linux reports a lost write-back at the next fsync).
            self.flushed = self.done_writes;
            self.owed_flush_error = true;
        }
        for r in self.requests.values_mut().filter(|r| r.undecided) {
            r.undecided = false;
            r.doubtful |= !kept;
        }
    }

    /// The durability epoch of the current session, once one of its channels joined.
    pub fn durability_epoch(&self) -> Option<DurabilityEpoch> {
        self.epoch
    }

    /// Channels closed because their ACCEPT carried another durability epoch than their
    /// session's first channel.
    pub fn epoch_conflicts(&self) -> u64 {
        self.epoch_conflicts
    }

    /// The session id.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Moves the volume to session `session`, after the target said it no longer knows the
    /// current one (REJECT UNKNOWN_SESSION: it restarted, or reclaimed the session once none
    /// of its requests executed). Every channel of the old session is dropped without a word
    /// (nothing it would still receive is used: frames of the old session are no longer the
    /// volume's, so no request completes from a session the volume abandoned), and every part
    /// not yet completed to the caller goes back to the queue in tag order, to be issued on the
    /// new session's channels ([`Volume::add_channel`]) under its tag: the new session's
    /// ledger has seen no tag. Requests keep waiting at most `no_path_timeout` from when the
    /// last path went away, whichever session it belonged to.
    ///
    /// Why re-issuing is safe although the old session's at-most-once ledger is gone: see
    /// `docs/tyche-init.md`, "Session resumption".
    pub fn resume(&mut self, session: u64, now: Instant) {
        // The connector never yields session 0. A target that hands out the old id again for a
        // new session (hostile, or a restart reusing ids) only hurts this volume's filtering of
        // the old session's late frames: not a reason to stop the initiator.
        assert!(session != 0, "resume onto session 0");
        self.last_max_io = self.max_io();
        let had_path = self.live_channels() > 0;
        for m in self.members.iter_mut().flatten() {
            m.channel.abort();
        }
        self.members.clear();
        self.session = session;
        self.resumes += 1;
        // Writes the old session completed and no FLUSH covered are kept if the target said it
        // was shutting down (it flushes before it stops), or if the new session presents the
        // durability epoch they were acknowledged under; else they may be gone. The new
        // session's epoch comes with its first channel ([`Volume::add_channel`] settles it):
        // until then the FLUSHes outstanding now are undecided. An earlier loss still
        // undecided (the session being left never had a channel, so it acknowledged nothing)
        // stays as it was; a report already owed stays owed.
        if !std::mem::take(&mut self.shutdown_seen) && self.done_writes > self.flushed && self.undecided.is_none() {
            self.undecided = Some(self.epoch.unwrap_or(DurabilityEpoch::NONE));
            for r in self.requests.values_mut().filter(|r| r.op == Op::Flush) {
                r.undecided = true;
            }
        }
        self.epoch = None;
        self.pending.clear();
        for (&tag, part) in self.parts.iter_mut() {
            part.channel = None;
            // The new session's ledger has seen no tag: its first issue there names its home.
            part.home = None;
            part.aborts = 0;
            self.pending.push_back(tag);
        }
        if had_path || self.no_path_since.is_none() {
            self.no_path_since = Some(now);
        }
    }

    /// Sessions the volume moved to by [`Volume::resume`].
    pub fn resumes(&self) -> u64 {
        self.resumes
    }
    /// The channel with index `i`, if any.
    pub fn channel(&self, i: u16) -> Option<&Channel> {
        self.members.get(i as usize)?.as_ref().map(|m| &m.channel)
    }
    /// Indices of the channels, dead ones included.
    pub fn channel_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.members.iter().enumerate().filter(|(_, m)| m.is_some()).map(|(i, _)| i as u16)
    }
    /// Number of live channels (a channel being closed because the target answered ABORTED
    /// on it does not count).
    pub fn live_channels(&self) -> usize {
        self.members.iter().flatten().filter(|m| m.usable()).count()
    }
    /// Requests outstanding.
    pub fn outstanding(&self) -> usize {
        self.requests.len()
    }
    /// Parts waiting for a channel.
    pub fn queued_parts(&self) -> usize {
        self.pending.len()
    }

    /// The part size: the smallest `max_io` of the live channels, or of every channel the volume
    /// has had while none is alive (parts queued during an outage then fit the reconnected ones).
    fn max_io(&self) -> u32 {
        let all = self.members.iter().flatten();
        let live = all.clone().filter(|m| m.usable()).map(|m| m.channel.params().max_io).min();
        live.or_else(|| all.map(|m| m.channel.params().max_io).min()).unwrap_or(self.last_max_io)
    }

    fn floor(&self) -> u64 {
        self.parts.keys().next().copied().unwrap_or(self.next_tag)
    }

    /// Queues a request. Large requests are split into parts no larger than the channels'
    /// `max_io`; each part travels on its own and the request completes when all have.
    pub fn submit(&mut self, now: Instant, req: IoRequest) -> Result<(), SubmitError> {
        let sector = SECTOR_SIZE as u64;
        if req.offset % sector != 0 || req.length % sector != 0 || (req.op != Op::Flush && req.length == 0) {
            return Err(SubmitError::Unaligned);
        }
        if req.op == Op::Flush && req.length != 0 {
            return Err(SubmitError::Unaligned);
        }
        if req.offset.checked_add(req.length).is_none_or(|end| end > self.config.export_size) {
            return Err(SubmitError::OutOfRange);
        }
        if self.config.read_only && req.op.modifies() {
            return Err(SubmitError::ReadOnly);
        }
        if self.requests.contains_key(&req.id) {
            return Err(SubmitError::DuplicateId);
        }
        // A BLOCK_STATUS is one part whatever its range (its answer may cover less).
        let chunk = if matches!(req.op, Op::Read | Op::Write) { self.max_io() as u64 } else { MAX_RANGE_PART };
        if req.op == Op::BlockStatus && req.length > MAX_RANGE_PART {
            return Err(SubmitError::Unaligned);
        }
        let nparts = if req.op == Op::Flush { 1 } else { req.length.div_ceil(chunk) };
        if self.requests.len() >= self.config.max_requests || self.next_tag + nparts > self.floor() + TAG_WINDOW {
            return Err(SubmitError::Busy);
        }
        let doubtful = false;
        let out = Outstanding {
            parts_left: nparts as u32,
            error: None,
            op: req.op,
            fua: req.fua,
            covers: self.done_writes,
            doubtful,
            undecided: false,
        };
        self.requests.insert(req.id, out);
        for i in 0..nparts {
            let req_offset = i * chunk;
            let length = if req.op == Op::Flush { 0 } else { chunk.min(req.length - req_offset) as u32 };
            let tag = self.next_tag;
            self.next_tag += 1;
            let part = Part {
                id: req.id,
                op: req.op,
                fua: req.fua,
                offset: req.offset + req_offset,
                length,
                req_offset,
                node: req.node,
                channel: None,
                home: None,
                aborts: 0,
            };
            self.parts.insert(tag, part);
            self.pending.push_back(tag);
        }
        self.pump(now);
        if self.live_channels() == 0 && self.config.no_path_timeout.is_zero() {
            self.fail_pending();
        }
        Ok(())
    }

    /// Hands queued parts to channels while the scheduler finds room.
    fn pump(&mut self, _now: Instant) {
        let floor = self.floor();
        while let Some(&tag) = self.pending.front() {
            let part = self.parts[&tag];
            // A part sized for a channel that has died may be larger than every survivor's
            // `max_io` (each channel's grant is the target's choice): it can go nowhere, so it
            // fails rather than wait for ever or trip `Channel::submit`'s assertion.
            // BLOCK_STATUS goes only to channels granted the feature.
            let fits = |c: &Channel| {
                (!part.op.uses_damq() || part.op.data_len(part.length) <= c.params().max_io)
                    && (part.op != Op::BlockStatus || c.params().features & FEATURE_BLOCK_STATUS != 0)
            };
            let live = self.members.iter().flatten().filter(|m| m.usable());
            let (mut any_live, mut any_fits) = (false, false);
            for m in live {
                any_live = true;
                any_fits |= fits(&m.channel);
            }
            if any_live && !any_fits {
                self.pending.pop_front();
                // A target without BLOCK_STATUS: the caller treats the range as data.
                let err =
                    if part.op == Op::BlockStatus { IoError::Target(Status::Unsupported) } else { IoError::NoPath };
                self.part_done(tag, None, Err(err));
                continue;
            }
            self.views.clear();
            self.views.extend(self.members.iter().map(|m| match m {
                Some(m) => ChannelView {
                    live: m.usable(),
                    has_room: m.usable() && m.channel.can_submit(part.op) && fits(&m.channel),
                    node: m.node,
                },
                None => ChannelView { live: false, has_room: false, node: None },
            }));
            // Schedulers balance the bytes that cross the link: a DISCARD or WRITE_ZEROES of a
            // whole export moves none, and must not make its channel look loaded.
            let moved = if part.op.uses_damq() { part.op.data_len(part.length) as u64 } else { 0 };
            let Some(i) = self.scheduler.pick(moved, part.node, &self.views) else { break };
            assert!(self.views[i].live && self.views[i].has_room, "scheduler picked an unusable channel");
            let member = self.members[i].as_mut().expect("picked a present channel");
            let home = part.home.unwrap_or(member.channel.envelope().channel);
            let sub = Submission { tag, op: part.op, fua: part.fua, offset: part.offset, length: part.length, home };
            assert!(member.channel.submit(sub, floor), "channel refused a part it had room for");
            let part = self.parts.get_mut(&tag).expect("pending part");
            part.channel = Some(i as u16);
            part.home = Some(home);
            self.pending.pop_front();
        }
    }

    /// Hands the volume a received frame.
    ///
    /// `scratch` holds the plaintext of a frame of an encrypting channel (a buffer the caller
    /// keeps, so that it is allocated once).
    pub fn handle_frame<'a>(&mut self, now: Instant, bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> Inbound<'a> {
        // A keyed volume believes only authentic frames (below); an unkeyed one takes a
        // DISCONNECT even for a channel it already dropped.
        let sealed = self.members.iter().flatten().any(|m| m.channel.sealed());
        if !sealed {
            self.note_shutdown(bytes);
        }
        let members = &mut self.members;
        let lookup = move |i: u16| {
            let members = members; // moved in: the closure is FnOnce and may return a borrow of it
            members.get_mut(i as usize)?.as_mut().map(|m| &mut m.channel)
        };
        let (idx, received) = match deliver(now, bytes, scratch, self.ethertype, self.session, lookup) {
            Ok((idx, received, authentic)) => {
                if sealed && !matches!(received, Received::Dropped(DropReason::Unauthenticated | DropReason::Replayed))
                {
                    self.note_shutdown(authentic);
                }
                (idx, received)
            }
            Err(d) => return Inbound::Dropped(d),
        };
        let out = match received {
            Received::Placed(p) => self.read_data(idx, p.tag, p.offset, p.payload.len(), p.payload),
            other => self.not_data(other),
        };
        self.drain(idx, now);
        out
    }

    /// [`Volume::handle_frame`] for a frame in pieces (a multi-buffer frame, at most
    /// [`crate::MAX_PIECES`], the headers in the first): read data comes back as the pieces it
    /// lies in, never gathered, unless the channel seals its frames or carries digests (their
    /// checks need the whole frame: it is gathered into `gather` first). Only DATA frames are
    /// longer than one buffer, so a frame in pieces is never the DISCONNECT a target sends at
    /// shutdown.
    pub fn handle_frame_pieces<'a>(
        &mut self,
        now: Instant,
        pieces: &[&'a [u8]],
        scratch: &'a mut Vec<u8>,
        gather: &'a mut Vec<u8>,
    ) -> Inbound<'a, Pieces<'a>> {
        if let [bytes] = pieces {
            return match self.handle_frame(now, bytes, scratch) {
                InboundOf::Consumed => InboundOf::Consumed,
                InboundOf::Dropped(d) => InboundOf::Dropped(d),
                InboundOf::Read { id, offset, payload } => {
                    InboundOf::Read { id, offset, payload: Pieces::one(payload) }
                }
            };
        }
        let members = &mut self.members;
        let lookup = move |i: u16| {
            let members = members; // moved in: the closure is FnOnce and may return a borrow of it
            members.get_mut(i as usize)?.as_mut().map(|m| &mut m.channel)
        };
        let (idx, received, payload) =
            match deliver_pieces(now, pieces, scratch, gather, self.ethertype, self.session, lookup) {
                Ok(r) => r,
                Err(d) => return InboundOf::Dropped(d),
            };
        let out = match received {
            Received::Placed(p) => self.read_data(idx, p.tag, p.offset, payload.len(), payload),
            other => self.not_data(other),
        };
        self.drain(idx, now);
        out
    }

    /// A DATA payload of `len` bytes placed at `offset` of the part `tag` on channel `idx`: read
    /// data goes into a read, inside it; a target's DATA for a write (whose buffer is the
    /// caller's data) or past the part's length is dropped.
    fn read_data<P>(&self, idx: u16, tag: u64, offset: u32, len: usize, payload: P) -> InboundOf<P> {
        match self.parts.get(&tag) {
            Some(part) if part.channel == Some(idx) && part.op.has_read_data() => {
                if offset as u64 + len as u64 <= part.op.data_len(part.length) as u64 {
                    InboundOf::Read { id: part.id, offset: part.req_offset + offset as u64, payload }
                } else {
                    InboundOf::Dropped(FrameDrop::Channel(DropReason::Inconsistent))
                }
            }
            _ => InboundOf::Dropped(FrameDrop::Channel(DropReason::Stale)),
        }
    }

    /// What a frame that placed no data came to.
    fn not_data<P>(&self, received: Received<'_>) -> InboundOf<P> {
        match received {
            Received::Dropped(r) => InboundOf::Dropped(FrameDrop::Channel(r)),
            _ => InboundOf::Consumed,
        }
    }

    /// A DISCONNECT SHUTDOWN of this session, on any channel (one this end already closed
    /// included: it may have closed it on an ABORTED answer of the same stopping target),
    /// says the target flushed what it had before it stopped.
    fn note_shutdown(&mut self, bytes: &[u8]) {
        let Ok(frame) = tyche_wire::Frame::new_checked(bytes, self.ethertype) else { return };
        if frame.kind() != tyche_wire::Kind::Disconnect || frame.session() != self.session {
            return;
        }
        if let Ok(tyche_wire::Message::Disconnect(d)) = frame.parse() {
            if d.reason == DisconnectReason::Shutdown {
                self.shutdown_seen = true;
            }
        }
    }

    fn drain(&mut self, idx: u16, now: Instant) {
        let mut dead = None;
        while let Some(ev) = self.members[idx as usize].as_mut().and_then(|m| m.channel.poll_event()) {
            match ev {
                // The target gave the request up without executing it (shutdown, or dropping the
                // session): not the caller's error. The part waits for another channel, and this
                // one is closed, since the target is going away; reconnecting finds out whether
                // it still knows the session.
                ChannelEvent::Completed { tag, status: Status::Aborted } => self.aborted(tag, idx, now),
                ChannelEvent::Completed { tag, status } => self.part_done(
                    tag,
                    Some(idx),
                    if status == Status::Ok { Ok(()) } else { Err(IoError::Target(status)) },
                ),
                ChannelEvent::Dead(reason) => dead = Some(reason),
                ChannelEvent::Request(_) => unreachable!("initiator channels emit no requests"),
            }
        }
        if let Some(reason) = dead {
            self.fail_over(idx, reason, now);
        }
        self.pump(now);
    }

    fn aborted(&mut self, tag: u64, idx: u16, now: Instant) {
        let Some(part) = self.parts.get_mut(&tag) else { return };
        if part.channel != Some(idx) {
            return; // a completion from a channel the part has since left
        }
        part.channel = None;
        part.aborts += 1;
        if part.aborts >= MAX_ABORTS {
            // The session lives on and keeps refusing it (a target that records ABORTED for
            // the tag): the caller gets the status rather than a retry loop.
            return self.part_done(tag, None, Err(IoError::Target(Status::Aborted)));
        }
        // Back in tag order, so the floor and the order of re-issue stay those of submission.
        let at = self.pending.partition_point(|&t| t < tag);
        self.pending.insert(at, tag);
        self.aborted += 1;
        let member = self.members[idx as usize].as_mut().expect("completion from a present channel");
        if member.retiring.is_none() {
            member.retiring = Some(now);
            self.events.push_back(VolumeEvent::ChannelAborted { channel: idx });
        }
    }

    /// Completions the target answered ABORTED, re-queued rather than reported.
    pub fn aborted_parts(&self) -> u64 {
        self.aborted
    }

    fn part_done(&mut self, tag: u64, from: Option<u16>, result: Result<(), IoError>) {
        let Some(part) = self.parts.get(&tag) else { return };
        if from.is_some() && part.channel != from {
            return; // a completion from a channel the part has since left
        }
        let part = self.parts.remove(&tag).expect("present");
        let req = self.requests.get_mut(&part.id).expect("part of an outstanding request");
        if let Err(e) = result {
            req.error.get_or_insert(e);
        }
        req.parts_left -= 1;
        if req.parts_left == 0 {
            let req = self.requests.remove(&part.id).expect("present");
            let mut result = req.error.map_or(Ok(()), Err);
            match req.op {
                // Undecided: it completes without a channel of the new session (no path), so
                // it fails anyway; say why as for a loss.
                Op::Flush if req.doubtful || req.undecided || std::mem::take(&mut self.owed_flush_error) => {
                    self.durability_errors += 1;
                    result = Err(IoError::Target(Status::IoError));
                }
                Op::Flush if result.is_ok() => self.flushed = self.flushed.max(req.covers),
                op if op.modifies() && result.is_ok() && !req.fua => self.done_writes += 1,
                _ => {}
            }
            self.events.push_back(VolumeEvent::Completed { id: part.id, result });
        }
    }

    /// Whether this volume owes its user a durability report: modifications completed that no
    /// completed FLUSH covered, or a lost session (or an earlier volume, through
    /// [`Volume::assume_writes_lost`]) may have lost some and no FLUSH has failed to say so yet.
    /// A caller that replaces this volume, e.g. a restarted engine, hands that on with
    /// [`Volume::assume_writes_lost`]; otherwise a second replacement before the next FLUSH
    /// would forget the report, and a FLUSH would succeed after acknowledged writes were lost.
    pub fn unflushed_writes(&self) -> bool {
        self.done_writes > self.flushed
            || self.owed_flush_error
            || self.undecided.is_some()
            || self.requests.values().any(|r| r.op == Op::Flush && (r.doubtful || r.undecided))
    }

    /// What this volume owes its user about the writes it completed, for a volume that
    /// replaces it ([`Volume::inherit_debt`]): [`DurabilityDebt::Owed`] when a loss has not
    /// been reported yet (or writes no FLUSH covered were acknowledged under an unknown or
    /// [`DurabilityEpoch::NONE`] epoch), [`DurabilityDebt::AtRisk`] with the epoch unflushed
    /// writes were acknowledged under, else [`DurabilityDebt::Clear`].
    pub fn durability_debt(&self) -> DurabilityDebt {
        let at_risk = |e: DurabilityEpoch| if e.is_none() { DurabilityDebt::Owed } else { DurabilityDebt::AtRisk(e) };
        if self.owed_flush_error || self.requests.values().any(|r| r.op == Op::Flush && r.doubtful) {
            DurabilityDebt::Owed
        } else if let Some(e) = self.undecided {
            at_risk(e)
        } else if self.done_writes > self.flushed {
            at_risk(self.epoch.unwrap_or(DurabilityEpoch::NONE))
        } else {
            DurabilityDebt::Clear
        }
    }

    /// Takes over what an earlier volume of this device owed ([`Volume::durability_debt`]):
    /// [`DurabilityDebt::Owed`] makes the next FLUSH to complete fail with an I/O error;
    /// [`DurabilityDebt::AtRisk`] does the same unless this volume's session presents that
    /// durability epoch (compared when its first channel joins, or now if one has). Kept, the
    /// earlier volume's unflushed writes count as this volume's own until a FLUSH submitted
    /// from now on covers them: a loss before that is reported like a loss of its own.
    pub fn inherit_debt(&mut self, debt: DurabilityDebt) {
        match debt {
            DurabilityDebt::Clear => {}
            DurabilityDebt::Owed => self.owed_flush_error = true,
            DurabilityDebt::AtRisk(e) => {
                // The earlier volume's unflushed writes, as one write done before any FLUSH
                // submitted from now on.
                self.done_writes += 1;
                match self.epoch {
                    Some(current) if e.keeps(&current) => {}
                    Some(_) => {
                        self.flushed = self.done_writes;
                        self.owed_flush_error = true;
                    }
                    None => {
                        self.undecided = Some(match self.undecided {
                            Some(u) if !u.keeps(&e) => DurabilityEpoch::NONE,
                            _ => e,
                        });
                    }
                }
            }
        }
    }

    /// Makes the next FLUSH to complete fail with an I/O error: writes an earlier volume of
    /// this device completed may have been lost (its engine restarted while some were not
    /// flushed, and this volume cannot tell whether the target kept them).
    /// [`Volume::inherit_debt`] says more when the earlier volume's debt is known.
    pub fn assume_writes_lost(&mut self) {
        self.owed_flush_error = true;
    }

    /// FLUSHes failed with an I/O error because the target forgot the session without saying
    /// it was shutting down, while writes no FLUSH had covered were done: they may be lost.
    pub fn durability_errors(&self) -> u64 {
        self.durability_errors
    }

    fn fail_over(&mut self, idx: u16, reason: DeadReason, now: Instant) {
        if reason == DeadReason::PeerClosed(DisconnectReason::Shutdown) {
            self.shutdown_seen = true;
        }
        let Some(member) = self.members[idx as usize].as_mut() else { return };
        let subs = if member.channel.dead().is_some() { member.channel.take_in_flight() } else { Vec::new() };
        let mut tags: Vec<u64> =
            subs.iter().map(|s| s.tag).filter(|t| self.parts.get(t).is_some_and(|p| p.channel == Some(idx))).collect();
        tags.sort_unstable();
        for &t in tags.iter().rev() {
            self.parts.get_mut(&t).expect("checked").channel = None;
            self.pending.push_front(t);
        }
        self.events.push_back(VolumeEvent::ChannelDead { channel: idx, reason, reissued: tags.len() });
        if self.live_channels() == 0 && self.no_path_since.is_none() {
            self.no_path_since = Some(now);
        }
    }

    fn fail_pending(&mut self) {
        while let Some(tag) = self.pending.pop_front() {
            self.part_done(tag, None, Err(IoError::NoPath));
        }
    }

    /// Seals the frame of `len` bytes that [`Volume::poll_transmit`] wrote for `channel`, its
    /// payload in place ([`Channel::seal`]): the length to send.
    pub fn seal(&mut self, channel: u16, buf: &mut [u8], len: usize) -> usize {
        match self.members.get_mut(channel as usize).and_then(Option::as_mut) {
            Some(m) => m.channel.seal(buf, len),
            None => len,
        }
    }

    /// Writes the next frame channel `channel` wants to send into `buf`. Once its payload (if
    /// any) is in place, the caller passes it to [`Volume::seal`] and sends the length that
    /// returns.
    pub fn poll_transmit(&mut self, now: Instant, channel: u16, buf: &mut [u8]) -> Option<OutFrame> {
        let member = self.members.get_mut(channel as usize)?.as_mut()?;
        let Transmit { len, payload } = member.channel.poll_transmit(now, buf)?;
        let dead = member.channel.dead().is_some();
        let payload = payload.and_then(|p| match self.parts.get(&p.tag) {
            Some(part) => Some((part.id, part.req_offset + p.offset as u64, p.len)),
            None => {
                // A retransmission of data whose request already completed: the target had every
                // segment, so it drops this copy by ring position. Its content does not matter;
                // send zeroes rather than whatever the buffer held.
                let at = tyche_wire::DATA_FRAME_OVERHEAD;
                buf[at..at + p.len as usize].fill(0);
                None
            }
        });
        if dead {
            self.drain(channel, now); // closing sends DISCONNECT and dies
        }
        Some(OutFrame { len, payload })
    }

    /// Whether channel `channel` has a frame to send now.
    pub fn wants_transmit(&self, channel: u16) -> bool {
        self.channel(channel).is_some_and(Channel::wants_transmit)
    }

    /// The next time [`Volume::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t = None;
        for m in self.members.iter().flatten() {
            t = earliest(t, m.channel.poll_timeout());
            if let Some(since) = m.retiring.filter(|_| m.channel.dead().is_none()) {
                t = earliest(t, Some(since + RETIRE_GRACE));
            }
        }
        if let Some(since) = self.no_path_since.filter(|_| !self.pending.is_empty()) {
            t = earliest(t, Some(since + self.config.no_path_timeout));
        }
        t
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        for i in 0..self.members.len() {
            if let Some(m) = self.members[i].as_mut() {
                if m.retiring.is_some_and(|since| now.since(since) >= RETIRE_GRACE) {
                    m.channel.close(DisconnectReason::Normal);
                }
                m.channel.handle_timeout(now);
                self.drain(i as u16, now);
            }
        }
        if self.live_channels() == 0 {
            let since = *self.no_path_since.get_or_insert(now);
            if now.since(since) >= self.config.no_path_timeout {
                self.fail_pending();
            }
        } else {
            self.no_path_since = None;
        }
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<VolumeEvent> {
        self.events.pop_front()
    }

    /// Closes every channel (DISCONNECT is sent by the next [`Volume::poll_transmit`] of each).
    pub fn close(&mut self) {
        for m in self.members.iter_mut().flatten() {
            m.channel.close(tyche_wire::DisconnectReason::Normal);
        }
    }
}
