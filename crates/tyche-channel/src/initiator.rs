//! The initiator's view of an attached export: a volume bundling every channel of a session.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tyche_wire::flags::FEATURE_BLOCK_STATUS;
use tyche_wire::{DisconnectReason, DurabilityEpoch, Op, Status, SECTOR_SIZE};

use crate::board::VolumeBoard;
use crate::channel::{
    deliver, deliver_pieces, Channel, ChannelEvent, DeadReason, DropReason, FrameDrop, Pieces, Received, Role,
    Submission, Transmit,
};
use crate::config::{FLOOR_REFRESH, TAG_WINDOW};
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
    /// The longest a request waits for a path, from its submission: one that has been
    /// outstanding this long while no channel is alive fails with [`IoError::NoPath`], whatever
    /// `no_path_timeout` says (a RAID member's bounded time to fail: md marks a failfast member
    /// faulty on its first error). `None`: only `no_path_timeout` applies.
    pub io_timeout: Option<Duration>,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Adopted from this part of the volume ([`Volume::adopt`]): its request is that part's.
    origin: Option<usize>,
    /// Handed to another part ([`Volume::take_stranded`]), which reports back.
    away: bool,
    /// When its request was submitted (`io_timeout` runs from here, on any part it goes to).
    submitted: Instant,
}

/// The bytes a hand-off or a hand-back carries between the parts of a volume: a written part's
/// data to its adopter, a read part's data back to its origin (its `Debug` shows the length).
#[derive(Clone, Default, PartialEq, Eq)]
struct Carried(Vec<u8>);

impl std::fmt::Debug for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.len())
    }
}

/// A part of a request handed from one part of a volume to another ([`Volume::take_stranded`],
/// [`Volume::adopt`]): it keeps its tag and `HOME`, so the target decides a copy of it as any
/// re-issue. Its request stays the origin's (read data names the origin's id); a written part
/// carries its data ([`exchange_part`](crate::exchange_part) copies it from the request's
/// buffer), which the adopter keeps beside the part until it is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// The session it was handed over in.
    pub session: u64,
    tag: u64,
    /// As the origin holds it (its `channel`, `origin` and `away` are not used).
    part: Part,
    /// A written part's data.
    data: Carried,
}

/// What became of an adopted part, for its origin ([`Volume::poll_handback`],
/// [`Volume::handed_back`]), with a read part's data when it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handback {
    /// The session it was adopted in.
    pub session: u64,
    tag: u64,
    /// `None`: not done (the adopter lost its channels, or moved sessions): the origin takes it
    /// back into its queue.
    result: Option<Result<(), IoError>>,
    /// Its `HOME` and ABORTED count as the adopter left them: a part the adopter issued keeps
    /// the home it was issued under (else a copy under another home would be decided by another
    /// ledger, and could run twice).
    home: Option<u16>,
    aborts: u8,
    /// The part's request and where in it the part starts (the origin's, as in the
    /// [`Handoff`]): where read data an adopter carries back goes.
    id: u64,
    req_offset: u64,
    /// The adopter refused the part ([`Volume::adopt`] returned false): it never held this
    /// copy, and whatever it holds under the same request and offset (an adoption of the same
    /// part in another session) is not this hand-back's to release.
    refused: bool,
    /// A read part's data, once read.
    data: Carried,
}

/// Read data an adopter carried back, for the origin to copy into its request's buffer
/// ([`Volume::handed_back`]): as [`Inbound::Read`], with the bytes owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBack {
    /// The request.
    pub id: u64,
    /// Where in the request the data goes, in bytes.
    pub offset: u64,
    /// The data.
    pub data: Vec<u8>,
}

impl Handoff {
    /// The hand-back of a part refused on arrival.
    fn refuse(&self) -> Handback {
        Handback { refused: true, ..Handback::of(self.session, self.tag, &self.part, None) }
    }
    /// The origin's request the part belongs to.
    pub fn id(&self) -> u64 {
        self.part.id
    }
    /// The request's operation.
    pub fn op(&self) -> Op {
        self.part.op
    }
    /// Where in its request the part starts, in bytes.
    pub fn req_offset(&self) -> u64 {
        self.part.req_offset
    }
    /// The part's length in bytes.
    pub fn length(&self) -> u32 {
        self.part.length
    }
    /// How many bytes of write data it carries.
    pub fn data_len(&self) -> usize {
        self.data.0.len()
    }
    /// Takes a written part's data from `request`, its request's buffer (nothing for a part
    /// that carries no data, or when the buffer does not hold the part: the adopter then has
    /// no data to send, and sends none).
    pub(crate) fn carry_from(&mut self, request: Option<&[u8]>) {
        if !self.part.op.has_write_data() {
            return;
        }
        let at = self.part.req_offset as usize;
        let range = request.and_then(|b| b.get(at..at.checked_add(self.part.length as usize)?));
        self.data = Carried(range.map(<[u8]>::to_vec).unwrap_or_default());
    }
}

impl Handback {
    fn of(session: u64, tag: u64, part: &Part, result: Option<Result<(), IoError>>) -> Handback {
        Handback {
            session,
            tag,
            result,
            home: part.home,
            aborts: part.aborts,
            id: part.id,
            req_offset: part.req_offset,
            refused: false,
            data: Carried::default(),
        }
    }
    /// Whether the adopter refused the part on arrival (see the field).
    pub fn refused(&self) -> bool {
        self.refused
    }
    /// The origin's request the part belongs to.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// Where in its request the part starts, in bytes.
    pub fn req_offset(&self) -> u64 {
        self.req_offset
    }
    /// Whether the part was done successfully (then a read's data is the adopter's to carry
    /// back).
    pub fn succeeded(&self) -> bool {
        matches!(self.result, Some(Ok(())))
    }
}

#[derive(Debug)]
struct Outstanding {
    parts_left: u32,
    error: Option<IoError>,
    op: Op,
    fua: bool,
    /// For a FLUSH: the modifications each part had completed when it was submitted.
    covers: Vec<u64>,
    /// For a FLUSH: its number in the volume's order of FLUSH submissions (what decides
    /// whether it was outstanding when a session was lost: [`crate::board::Durable::doomed`]).
    flush_no: u64,
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
    /// What the parts of this volume share (a board of its own for a volume of one part).
    board: Arc<VolumeBoard>,
    /// Which part this is, of `stride`.
    part: usize,
    stride: u64,
    /// The lowest floor the other parts published, as last read (`u64::MAX` with one part).
    others_floor: u64,
    /// Each part's count of RTO floor rises as last read ([`Volume::refresh`]).
    rto_floors_seen: Vec<u32>,
    /// When this part next publishes its floor and reads the others' ([`Volume::refresh`]).
    next_refresh: Instant,
    next_tag: u64,
    parts: BTreeMap<u64, Part>,
    /// How many of `parts` were adopted from other parts (`origin` set).
    adopted: usize,
    /// The data of adopted parts that have some, by (request, offset of the part in it): write
    /// data to send, or a buffer read data lands in until it goes back. It lives and goes with
    /// its part, so no other part's arrival or refusal can touch it.
    adopted_data: BTreeMap<(u64, u64), Vec<u8>>,
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
    /// FLUSHes this part failed because a lost session may have lost unflushed writes.
    durability_errors: u64,
    /// Channels refused because their ACCEPT carried another epoch than the session's first.
    epoch_conflicts: u64,
    /// What became of adopted parts, by the origin part to tell.
    handbacks: VecDeque<(usize, Handback)>,
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
        Volume::part(config, session, ethertype, scheduler, now, VolumeBoard::new(1, session), 0)
    }

    /// Part `part` of a volume held in parts sharing `board` (made for `session`): it owns the
    /// channels added to it and the requests submitted to it, allocates tags from its own
    /// residue class, and shares the floor and the durability state with the other parts
    /// through the board (see [`VolumeBoard`]). Its holder calls [`Volume::refresh`] at
    /// [`Volume::refresh_at`], and calls [`Volume::resume`] on every part when the session is
    /// resumed.
    pub fn part(
        config: VolumeConfig,
        session: u64,
        ethertype: u16,
        scheduler: Box<dyn Scheduler>,
        now: Instant,
        board: Arc<VolumeBoard>,
        part: usize,
    ) -> Self {
        assert!(part < board.parts(), "part {part} of a board of {}", board.parts());
        let stride = board.parts() as u64;
        let rto_floors_seen = board.rto_floor_counts();
        Volume {
            config,
            session,
            ethertype,
            members: Vec::new(),
            scheduler,
            board,
            part,
            stride,
            // No other part's floor read yet: the lowest there is.
            others_floor: if stride > 1 { 1 } else { u64::MAX },
            rto_floors_seen,
            next_refresh: now,
            next_tag: part as u64 + 1,
            parts: BTreeMap::new(),
            adopted: 0,
            adopted_data: BTreeMap::new(),
            pending: VecDeque::new(),
            requests: HashMap::new(),
            events: VecDeque::new(),
            no_path_since: Some(now),
            views: Vec::new(),
            last_max_io: SECTOR_SIZE,
            aborted: 0,
            resumes: 0,
            durability_errors: 0,
            epoch_conflicts: 0,
            handbacks: VecDeque::new(),
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
        let conflict = {
            let mut d = self.board.durable();
            match d.epoch {
                // A part not yet moved to the session the others are on: its channels are of a
                // lost session, and go when it moves.
                _ if d.session != self.session => false,
                Some(e) => e != epoch,
                None => {
                    d.epoch = Some(epoch);
                    self.settle(&mut d, epoch);
                    false
                }
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

    /// The current session's epoch is now known (`d` held): what a lost session left
    /// undecided is kept or owed.
    fn settle(&self, d: &mut crate::board::Durable, epoch: DurabilityEpoch) {
        let Some(old) = d.undecided.take() else { return };
        if !old.keeps(&epoch) {
            // Gone: the FLUSHes outstanding at the loss, and the first to complete whenever it
            // was submitted, report it (as Linux reports a lost write-back at the next fsync).
            self.board.all_reported(d);
            d.owed = true;
            d.doubtful_below = d.doubtful_below.max(d.undecided_below);
        }
        d.undecided_below = 0;
    }

    /// The durability epoch of the current session, once one of its channels joined.
    pub fn durability_epoch(&self) -> Option<DurabilityEpoch> {
        let d = self.board.durable();
        d.epoch.filter(|_| d.session == self.session)
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
        {
            // The first part to move to the new session moves the shared state.
            let mut d = self.board.durable();
            if d.session != session {
                d.session = session;
                // Writes the old session completed and no FLUSH covered are kept if the target
                // said it was shutting down (it flushes before it stops), or if the new session
                // presents the durability epoch they were acknowledged under; else they may be
                // gone. The new session's epoch comes with its first channel
                // ([`Volume::add_channel`] settles it): until then the FLUSHes outstanding now
                // are undecided. An earlier loss still undecided (the session being left never
                // had a channel, so it acknowledged nothing) stays as it was; a report already
                // owed stays owed.
                if !std::mem::take(&mut d.shutdown_seen) && self.board.unflushed(&d) && d.undecided.is_none() {
                    d.undecided = Some(d.epoch.unwrap_or(DurabilityEpoch::NONE));
                    d.undecided_below = d.flushes;
                }
                d.epoch = None;
            }
        }
        self.pending.clear();
        // Adopted parts go: their origins take them back as they move to the new session too.
        self.parts.retain(|_, p| p.origin.is_none());
        self.adopted = 0;
        self.adopted_data.clear();
        self.handbacks.clear();
        for (&tag, part) in self.parts.iter_mut() {
            part.away = false;
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

    /// For a volume in parts: while this part has no usable channel, the parts of requests
    /// waiting in its queue, to be handed to a part that has one ([`Volume::adopt`]; the holder
    /// chooses which). Its own stay counted here (its floor, its requests) until the adopter
    /// reports back ([`Volume::handed_back`]); parts it had adopted go back to their origins
    /// ([`Volume::poll_handback`]) to be handed on from there.
    pub fn take_stranded(&mut self) -> Vec<Handoff> {
        if self.live_channels() > 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for tag in std::mem::take(&mut self.pending) {
            let part = self.parts.get_mut(&tag).expect("pending part");
            if let Some(origin) = part.origin {
                let back = Handback::of(self.session, tag, part, None);
                self.adopted_data.remove(&(part.id, part.req_offset));
                self.parts.remove(&tag);
                self.adopted -= 1;
                self.handbacks.push_back((origin, back));
                continue;
            }
            part.away = true;
            out.push(Handoff { session: self.session, tag, part: *part, data: Carried::default() });
        }
        out
    }

    /// Takes over a part of a request that part `from` handed over ([`Volume::take_stranded`]):
    /// it is queued here under its tag and `HOME`, and what becomes of it goes back to `from`
    /// ([`Volume::poll_handback`]). A written part's data is kept beside it until it is done
    /// ([`Volume::adopted_data`]), and a read part gets a buffer of its own for its data. One
    /// of another session, or of a part already held here, goes straight back, refused
    /// ([`Handback::refused`]), and its data with it; the return says whether it was adopted.
    pub fn adopt(&mut self, now: Instant, from: usize, h: Handoff) -> bool {
        if h.session != self.session || self.parts.contains_key(&h.tag) {
            self.handbacks.push_back((from, h.refuse()));
            return false;
        }
        let part = Part { channel: None, origin: Some(from), away: false, ..h.part };
        let data = if part.op.has_read_data() { vec![0; part.length as usize] } else { h.data.0 };
        if !data.is_empty() {
            let previous = self.adopted_data.insert((part.id, part.req_offset), data);
            debug_assert!(previous.is_none(), "two adopted parts of request {} at {}", part.id, part.req_offset);
        }
        self.parts.insert(h.tag, part);
        self.adopted += 1;
        let at = self.pending.partition_point(|&t| t < h.tag);
        self.pending.insert(at, h.tag);
        self.pump(now);
        true
    }

    /// What became of a part this part adopted, for the part it came from
    /// ([`Volume::handed_back`]).
    pub fn poll_handback(&mut self) -> Option<(usize, Handback)> {
        self.handbacks.pop_front()
    }

    /// Where bytes `offset..offset + len` of request `id` are, for a DATA frame's write data
    /// ([`OutFrame::payload`]) or read data ([`Inbound::Read`]): in `own`, the caller's buffer
    /// of the request when the request is one it gave this part, else in the data of a part
    /// this part adopted ([`Volume::adopted_data`]). `None` when neither holds that range (the
    /// caller drops the frame rather than trust the range).
    pub fn request_data<'a>(
        &'a mut self,
        own: Option<&'a mut [u8]>,
        id: u64,
        offset: u64,
        len: usize,
    ) -> Option<&'a mut [u8]> {
        match own {
            Some(buf) => buf.get_mut(usize::try_from(offset).ok()?..).and_then(|b| b.get_mut(..len)),
            None => self.adopted_data(id, offset, len),
        }
    }

    /// The data kept beside adopted parts ([`Volume::adopt`]) for bytes `offset..offset + len`
    /// of request `id`: where a DATA frame's write data comes from, or read data goes, when
    /// [`OutFrame::payload`] or [`Inbound::Read`] name a request this part did not take from
    /// its own caller. `None` when no adopted part of the request holds that range.
    ///
    /// A read part whose completion came with its last DATA frame is done before
    /// [`Volume::handle_frame`] returns that frame's data: its data is then in its hand-back,
    /// and found there until the hand-back is taken ([`Volume::poll_handback`]).
    pub fn adopted_data(&mut self, id: u64, offset: u64, len: usize) -> Option<&mut [u8]> {
        // Where in a part's data starting at `base`, `have` bytes long, the range starts.
        let within = |base: u64, have: usize| {
            let at = usize::try_from(offset.checked_sub(base)?).ok()?;
            (at.checked_add(len)? <= have).then_some(at)
        };
        let held = self.adopted_data.range(..=(id, offset)).next_back().filter(|((i, _), _)| *i == id);
        if let Some((key, at)) = held.and_then(|(&key, data)| Some((key, within(key.1, data.len())?))) {
            return self.adopted_data.get_mut(&key).map(|data| &mut data[at..at + len]);
        }
        let (_, back) =
            self.handbacks.iter_mut().find(|(_, b)| b.id == id && within(b.req_offset, b.data.0.len()).is_some())?;
        let at = within(back.req_offset, back.data.0.len())?;
        Some(&mut back.data.0[at..at + len])
    }

    /// What became of a part this part handed over: done (its request completes as if it had
    /// completed here), or back into this part's queue. One of another session, or for a part
    /// no longer away, is ignored (it was queued again when this part moved sessions). Returns
    /// the data of a part read elsewhere, which the caller copies into its request's buffer
    /// before it takes the request's completion ([`Volume::poll_event`]).
    pub fn handed_back(&mut self, now: Instant, back: Handback) -> Option<ReadBack> {
        if back.session != self.session || !self.parts.get(&back.tag).is_some_and(|p| p.away) {
            return None;
        }
        let part = self.parts.get_mut(&back.tag).expect("checked");
        part.away = false;
        if part.home.is_none() {
            part.home = back.home;
        }
        part.aborts = part.aborts.max(back.aborts);
        let (op, length) = (part.op, part.length as usize);
        let mut read = None;
        match back.result {
            Some(result) => {
                if result.is_ok() && op.has_read_data() {
                    debug_assert_eq!(back.data.0.len(), length, "read data of part {} carried back", back.tag);
                    read = Some(ReadBack { id: back.id, offset: back.req_offset, data: back.data.0 });
                }
                self.part_done(back.tag, None, result);
            }
            None => {
                let at = self.pending.partition_point(|&t| t < back.tag);
                self.pending.insert(at, back.tag);
                if self.live_channels() == 0 && self.no_path_since.is_none() {
                    self.no_path_since = Some(now);
                }
            }
        }
        self.pump(now);
        read
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
    /// Parts of other parts' requests this part holds ([`Volume::adopt`]) and has not reported
    /// back yet.
    pub fn adopted_parts(&self) -> usize {
        debug_assert_eq!(self.adopted, self.parts.values().filter(|p| p.origin.is_some()).count());
        debug_assert!(self.adopted_data.len() <= self.adopted);
        self.adopted
    }
    /// For a volume in parts: whether some part has requests outstanding, as the parts last
    /// published on their board (only then must an idle part keep reading the board:
    /// [`Volume::refresh`]).
    pub fn volume_busy(&self) -> bool {
        self.board.busy()
    }

    /// The part size: the smallest `max_io` of the live channels, or of every channel the volume
    /// has had while none is alive (parts queued during an outage then fit the reconnected ones).
    fn max_io(&self) -> u32 {
        let all = self.members.iter().flatten();
        let live = all.clone().filter(|m| m.usable()).map(|m| m.channel.params().max_io).min();
        live.or_else(|| all.map(|m| m.channel.params().max_io).min()).unwrap_or(self.last_max_io)
    }

    /// This part's own floor: every tag of its below it has completed and will never be sent
    /// again, and every tag it allocates from now on is at least this. It never decreases.
    fn own_floor(&self) -> u64 {
        let own = self.parts.iter().find(|(_, p)| p.origin.is_none()).map(|(&t, _)| t);
        own.unwrap_or(self.next_tag).min(self.next_tag)
    }

    /// The floor REQUESTs carry: the lowest of this part's tags (adopted ones included), its
    /// next tag and the other parts' floors as last read ([`Volume::refresh`]).
    fn floor(&self) -> u64 {
        let lowest = self.parts.keys().next().copied().unwrap_or(u64::MAX);
        lowest.min(self.next_tag).min(self.others_floor)
    }

    /// When the holder of a volume in parts should next call [`Volume::refresh`] (never for a
    /// volume of one part).
    pub fn refresh_at(&self) -> Option<Instant> {
        (self.stride > 1).then_some(self.next_refresh)
    }

    /// For a volume in parts: publishes this part's own floor and next tag on the board, reads
    /// the other parts' (the floor its requests carry from now on), and moves its next tag up to
    /// the highest next tag published, so that a part with little to do does not hold the
    /// session's floor down. Cheap (a few atomics on lines of their own); meant for a timer
    /// ([`crate::config::FLOOR_REFRESH`]), never for every frame.
    pub fn refresh(&mut self, now: Instant) {
        self.next_refresh = now + FLOOR_REFRESH;
        let Some((floor, next)) = self.board.others(self.part) else { return };
        if next > self.next_tag {
            // The first tag of this part's residue class at or above `next`.
            let first = self.part as u64 + 1;
            self.next_tag = first + (next - first).div_ceil(self.stride) * self.stride;
        }
        self.board.publish(self.part, self.own_floor(), self.next_tag);
        self.others_floor = floor;
        if let Some(rto_floor) = self.board.rto_floor_rises(self.part, &mut self.rto_floors_seen) {
            for m in self.members.iter_mut().flatten() {
                m.channel.share_floor(rto_floor, now);
            }
        }
        self.pump(now);
    }

    /// Which part of its volume this is, and of how many.
    pub fn part_of(&self) -> (usize, usize) {
        (self.part, self.stride as usize)
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
        if self.requests.len() >= self.config.max_requests
            || self.next_tag + nparts * self.stride > self.floor() + TAG_WINDOW
        {
            return Err(SubmitError::Busy);
        }
        let (covers, flush_no) = if req.op == Op::Flush {
            let mut d = self.board.durable();
            d.flushes += 1;
            (self.board.done(), d.flushes - 1)
        } else {
            (Vec::new(), 0)
        };
        let out = Outstanding { parts_left: nparts as u32, error: None, op: req.op, fua: req.fua, covers, flush_no };
        self.requests.insert(req.id, out);
        for i in 0..nparts {
            let req_offset = i * chunk;
            let length = if req.op == Op::Flush { 0 } else { chunk.min(req.length - req_offset) as u32 };
            let tag = self.next_tag;
            self.next_tag += self.stride;
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
                origin: None,
                away: false,
                submitted: now,
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
                    in_flight: m.channel.in_flight(),
                },
                None => ChannelView { live: false, has_room: false, node: None, in_flight: 0 },
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
                self.shutdown_noted();
            }
        }
    }

    /// The target of the current session said it flushed everything before it stopped.
    fn shutdown_noted(&self) {
        let mut d = self.board.durable();
        if d.session == self.session {
            d.shutdown_seen = true;
        }
    }

    fn drain(&mut self, idx: u16, now: Instant) {
        // A pause of the target's threads that one channel found with a spurious expiry is
        // one the others would find too: they take its floor, the other parts' on their next
        // refresh.
        if let Some(floor) = self.members[idx as usize].as_mut().and_then(|m| m.channel.take_floor_rise()) {
            for (i, m) in self.members.iter_mut().enumerate() {
                if let Some(m) = m.as_mut().filter(|_| i != idx as usize) {
                    m.channel.share_floor(floor, now);
                }
            }
            if self.stride > 1 {
                self.board.publish_rto_floor(self.part, floor);
            }
        }
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
        if let Some(origin) = part.origin {
            self.adopted -= 1;
            let data = self.adopted_data.remove(&(part.id, part.req_offset));
            let mut back = Handback::of(self.session, tag, &part, Some(result));
            if result.is_ok() && part.op.has_read_data() {
                back.data = Carried(data.unwrap_or_default());
            }
            self.handbacks.push_back((origin, back));
            return;
        }
        let req = self.requests.get_mut(&part.id).expect("part of an outstanding request");
        if let Err(e) = result {
            req.error.get_or_insert(e);
        }
        req.parts_left -= 1;
        if req.parts_left == 0 {
            let req = self.requests.remove(&part.id).expect("present");
            let mut result = req.error.map_or(Ok(()), Err);
            match req.op {
                Op::Flush => {
                    let mut d = self.board.durable();
                    // Undecided: it completes without a channel of the new session (no path),
                    // so it fails anyway; say why as for a loss.
                    if d.doomed(req.flush_no) || std::mem::take(&mut d.owed) {
                        self.durability_errors += 1;
                        result = Err(IoError::Target(Status::IoError));
                    } else if result.is_ok() {
                        for (f, &c) in d.flushed.iter_mut().zip(&req.covers) {
                            *f = (*f).max(c);
                        }
                    }
                }
                op if op.modifies() && result.is_ok() && !req.fua => self.board.write_done(self.part),
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
        let d = self.board.durable();
        self.board.unflushed(&d)
            || d.owed
            || d.undecided.is_some()
            || self.requests.values().any(|r| r.op == Op::Flush && d.doomed(r.flush_no))
    }

    /// What this volume owes its user about the writes it completed, for a volume that
    /// replaces it ([`Volume::inherit_debt`]): [`DurabilityDebt::Owed`] when a loss has not
    /// been reported yet (or writes no FLUSH covered were acknowledged under an unknown or
    /// [`DurabilityEpoch::NONE`] epoch), [`DurabilityDebt::AtRisk`] with the epoch unflushed
    /// writes were acknowledged under, else [`DurabilityDebt::Clear`].
    pub fn durability_debt(&self) -> DurabilityDebt {
        let at_risk = |e: DurabilityEpoch| if e.is_none() { DurabilityDebt::Owed } else { DurabilityDebt::AtRisk(e) };
        let d = self.board.durable();
        if d.owed || self.requests.values().any(|r| r.op == Op::Flush && d.doubtful(r.flush_no)) {
            DurabilityDebt::Owed
        } else if let Some(e) = d.undecided {
            at_risk(e)
        } else if self.board.unflushed(&d) {
            at_risk(d.epoch.unwrap_or(DurabilityEpoch::NONE))
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
        let mut d = self.board.durable();
        match debt {
            DurabilityDebt::Clear => {}
            DurabilityDebt::Owed => d.owed = true,
            DurabilityDebt::AtRisk(e) => {
                // The earlier volume's unflushed writes, as one write done before any FLUSH
                // submitted from now on.
                self.board.write_done(self.part);
                match d.epoch {
                    Some(current) if e.keeps(&current) => {}
                    Some(_) => {
                        self.board.all_reported(&mut d);
                        d.owed = true;
                    }
                    None => {
                        d.undecided = Some(match d.undecided {
                            Some(u) if !u.keeps(&e) => DurabilityEpoch::NONE,
                            Some(_) => e,
                            None => {
                                // No FLUSH outstanding now waits for this decision.
                                d.undecided_below = 0;
                                e
                            }
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
        self.board.durable().owed = true;
    }

    /// FLUSHes failed with an I/O error because the target forgot the session without saying
    /// it was shutting down, while writes no FLUSH had covered were done: they may be lost.
    pub fn durability_errors(&self) -> u64 {
        self.durability_errors
    }

    fn fail_over(&mut self, idx: u16, reason: DeadReason, now: Instant) {
        if reason == DeadReason::PeerClosed(DisconnectReason::Shutdown) {
            self.shutdown_noted();
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

    /// Fails the queued parts whose requests have waited `limit` or more (`io_timeout`).
    fn fail_pending_older(&mut self, now: Instant, limit: Duration) {
        let (old, keep): (VecDeque<u64>, VecDeque<u64>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|tag| self.parts.get(tag).is_some_and(|p| now.since(p.submitted) >= limit));
        self.pending = keep;
        for tag in old {
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
        if self.live_channels() == 0 {
            t = earliest(t, self.first_io_deadline());
        }
        t
    }

    /// The earliest `io_timeout` deadline of a queued part, if the volume has one.
    fn first_io_deadline(&self) -> Option<Instant> {
        let limit = self.config.io_timeout?;
        self.pending.iter().filter_map(|tag| self.parts.get(tag)).map(|p| p.submitted + limit).min()
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
            } else if let Some(limit) = self.config.io_timeout {
                self.fail_pending_older(now, limit);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::LeastBytes;

    const CONFIG: VolumeConfig = VolumeConfig {
        export_size: 1 << 20,
        read_only: false,
        no_path_timeout: Duration::from_secs(60),
        io_timeout: None,
        max_requests: 64,
    };

    fn parts(n: usize) -> Vec<Volume> {
        let board = VolumeBoard::new(n, 7);
        (0..n)
            .map(|p| Volume::part(CONFIG, 7, 0x88b5, Box::<LeastBytes>::default(), Instant(1), Arc::clone(&board), p))
            .collect()
    }

    fn read(id: u64) -> IoRequest {
        IoRequest { id, op: Op::Read, fua: false, offset: 0, length: 512, node: None }
    }

    fn write(id: u64) -> IoRequest {
        IoRequest { op: Op::Write, ..read(id) }
    }

    #[test]
    fn parts_allocate_tags_from_their_residue_classes_and_share_the_floor() {
        let mut v = parts(2);
        for id in 0..3 {
            v[0].submit(Instant(1), read(id)).unwrap();
        }
        v[1].submit(Instant(1), read(10)).unwrap();
        assert_eq!(v[0].parts.keys().copied().collect::<Vec<_>>(), [1, 3, 5]);
        assert_eq!(v[1].parts.keys().copied().collect::<Vec<_>>(), [2]);
        // Before any refresh a part assumes the lowest floor there is.
        assert_eq!(v[1].floor(), 1);
        v[0].refresh(Instant(1));
        v[1].refresh(Instant(1));
        assert_eq!(v[1].floor(), 1, "part 0's tag 1 is outstanding");
        assert_eq!(v[0].floor(), 1);
        // Part 0's tags complete: its own floor moves to its next tag once published.
        for tag in [1, 3, 5] {
            v[0].pending.retain(|&t| t != tag);
            v[0].part_done(tag, None, Ok(()));
        }
        v[0].refresh(Instant(2));
        v[1].refresh(Instant(2));
        assert_eq!(v[1].floor(), 2, "part 1's own tag 2 holds it");
        // Each part moved its next tag up to the other's as published (7 -> 8 in part 1's
        // class, 8 -> 9 in part 0's, 9 -> 10 in part 1's): tags need not be dense.
        assert_eq!(v[0].next_tag, 9);
        assert_eq!(v[1].next_tag, 10);
        // An idle part moves its next tag up to the highest published, in its own class.
        for id in 20..40 {
            v[1].submit(Instant(3), read(id)).unwrap();
            if v[1].outstanding() > 30 {
                break;
            }
        }
        v[1].refresh(Instant(3));
        v[0].refresh(Instant(3));
        assert!(v[0].next_tag >= v[1].next_tag && v[0].next_tag % 2 == 1, "{} {}", v[0].next_tag, v[1].next_tag);
        assert!(v[0].own_floor() >= v[1].next_tag);
    }

    #[test]
    fn a_part_without_channels_hands_its_queue_over_and_gets_each_back() {
        let mut v = parts(2);
        v[0].submit(Instant(1), read(1)).unwrap();
        v[0].submit(Instant(1), read(2)).unwrap();
        let handed = v[0].take_stranded();
        assert_eq!(handed.len(), 2);
        assert_eq!(v[0].queued_parts(), 0);
        assert_eq!(v[0].outstanding(), 2, "the requests stay the origin's");
        assert_eq!(v[0].own_floor(), 1, "handed tags still hold the origin's floor");
        for h in handed {
            v[1].adopt(Instant(2), 0, h);
        }
        assert_eq!(v[1].queued_parts(), 2);
        assert_eq!(v[1].own_floor(), 2, "adopted tags are not the adopter's own");
        assert_eq!(v[1].floor(), 1, "but its requests' floor stays below them");
        // The adopter has no channel either: its adopted parts go back to the origin, with the
        // home the adopter issued one under.
        v[1].parts.get_mut(&1).unwrap().home = Some(5);
        assert!(v[1].take_stranded().is_empty());
        let mut backs = Vec::new();
        while let Some((to, b)) = v[1].poll_handback() {
            assert_eq!(to, 0);
            backs.push(b);
        }
        assert_eq!(backs.len(), 2);
        v[0].handed_back(Instant(3), backs[0].clone());
        assert_eq!(v[0].queued_parts(), 1);
        assert_eq!(v[0].parts[&1].home, Some(5), "a copy under another home could run twice");
        // One done elsewhere completes the origin's request.
        let h = v[0].take_stranded().pop().unwrap();
        v[1].adopt(Instant(4), 0, h);
        v[1].pending.clear();
        v[1].part_done(1, None, Ok(()));
        let (to, back) = v[1].poll_handback().unwrap();
        assert_eq!(to, 0);
        v[0].handed_back(Instant(5), back);
        assert_eq!(v[0].poll_event(), Some(VolumeEvent::Completed { id: 1, result: Ok(()) }));
        // A hand-back from another session is ignored (the part was queued again on resume).
        v[0].resume(8, Instant(6));
        v[0].handed_back(Instant(6), backs[1].clone());
        assert_eq!(v[0].outstanding(), 1);
        assert_eq!(v[0].queued_parts(), 1);
    }

    #[test]
    fn a_hand_off_of_a_session_left_is_refused_beside_the_same_part_of_the_new_one() {
        // The origin hands a written part over, moves to a new session and hands the same part
        // over again; the adopter moved first. The old session's hand-off may arrive before or
        // after the new one's: either way it is refused, its refusal says so, and the adopted
        // part keeps its data (the old copy's arrival or refusal must not replace or drop it).
        for old_first in [true, false] {
            let mut v = parts(2);
            v[0].submit(Instant(1), write(1)).unwrap();
            let mut old = v[0].take_stranded().pop().unwrap();
            old.carry_from(Some(&[0xaa; 512]));
            v[0].resume(8, Instant(2));
            v[1].resume(8, Instant(2));
            let mut new = v[0].take_stranded().pop().unwrap();
            new.carry_from(Some(&[0x55; 512]));
            assert_eq!((old.id(), old.req_offset()), (new.id(), new.req_offset()));
            let (first, second) = if old_first { (old, new) } else { (new, old) };
            let accepted = [v[1].adopt(Instant(3), 0, first), v[1].adopt(Instant(3), 0, second)];
            assert_eq!(accepted, if old_first { [false, true] } else { [true, false] });
            assert_eq!(v[1].adopted_parts(), 1);
            let (to, back) = v[1].poll_handback().expect("the refusal goes back");
            assert_eq!(to, 0);
            assert!(back.refused() && back.session == 7, "{back:?}");
            assert!(v[1].poll_handback().is_none());
            assert_eq!(v[1].adopted_data(1, 0, 512).as_deref(), Some(&[0x55; 512][..]), "the new copy's data");
            // The refusal changes nothing at the origin: its part is still with the adopter.
            assert_eq!(v[0].handed_back(Instant(4), back), None);
            assert_eq!(v[0].queued_parts(), 0);
            assert_eq!(v[0].outstanding(), 1);
        }
    }

    #[test]
    fn hand_offs_carry_write_data_over_and_read_data_back() {
        let mut v = parts(2);
        v[0].submit(Instant(1), IoRequest { length: 1024, ..write(1) }).unwrap();
        v[0].submit(Instant(1), IoRequest { id: 2, ..read(2) }).unwrap();
        let request: Vec<u8> = (0..1024).map(|i| i as u8).collect();
        for mut h in v[0].take_stranded() {
            h.carry_from((h.id() == 1).then_some(&request[..]));
            // The write goes in two parts (512 bytes, the smallest part a volume without channels
            // makes), each with its half.
            assert_eq!(h.data_len(), if h.id() == 1 { 512 } else { 0 });
            assert!(v[1].adopt(Instant(2), 0, h));
        }
        // The adopter sends the write's bytes from what it kept, and reads into a buffer of its own.
        assert_eq!(v[1].adopted_data(1, 512, 512).as_deref(), Some(&request[512..]));
        assert_eq!(v[1].adopted_data(1, 1000, 100), None, "past the part");
        assert_eq!(v[1].adopted_data(3, 0, 1), None, "no such request");
        // A request of the caller's own is in its buffer; any other in the adopted data.
        let mut own = [1u8; 16];
        assert_eq!(v[1].request_data(Some(&mut own), 9, 8, 8).as_deref(), Some(&[1u8; 8][..]));
        assert_eq!(v[1].request_data(Some(&mut own), 9, 12, 8), None, "past the caller's buffer");
        assert_eq!(v[1].request_data(Some(&mut own), 9, u64::MAX, 1), None, "past the caller's buffer");
        assert_eq!(v[1].request_data(None, 1, 512, 512).as_deref(), Some(&request[512..]));
        v[1].adopted_data(2, 0, 512).unwrap().fill(7);
        v[1].pending.clear();
        let tags: Vec<u64> = v[1].parts.keys().copied().collect();
        for tag in tags {
            v[1].part_done(tag, None, Ok(()));
        }
        assert_eq!(v[1].adopted_parts(), 0);
        assert_eq!(v[1].adopted_data(1, 0, 1), None, "the data went with its part");
        let mut read_back = Vec::new();
        while let Some((to, back)) = v[1].poll_handback() {
            assert_eq!(to, 0);
            read_back.extend(v[0].handed_back(Instant(3), back));
        }
        assert_eq!(read_back, [ReadBack { id: 2, offset: 0, data: vec![7; 512] }]);
        let mut done: Vec<_> = std::iter::from_fn(|| v[0].poll_event()).collect();
        done.sort_by_key(|e| format!("{e:?}"));
        assert_eq!(
            done,
            [VolumeEvent::Completed { id: 1, result: Ok(()) }, VolumeEvent::Completed { id: 2, result: Ok(()) }]
        );
    }
}
