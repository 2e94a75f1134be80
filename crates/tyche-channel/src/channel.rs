//! One end of one channel: the paper's rings, queues and reliability, as a state machine.

use std::collections::VecDeque;
use std::time::Duration;

use tyche_wire::{
    layout, Ack, ChannelParams, Completion, DataHeader, Disconnect, DisconnectReason, Envelope, Keepalive, Message,
    Nack, Op, Request, Seq, Status, DATA_FRAME_OVERHEAD, NO_SLOT,
};

use crate::config::{max_queued, Timers};
use crate::seq::{diff, Bitmap};
use crate::time::{earliest, Instant};

pub use crate::drop_reason::DropReason;
pub use crate::role::Role;

/// Copies of DISCONNECT a closing channel sends (it is not sequenced, so not retransmitted).
pub const DISCONNECT_COPIES: u8 = 3;

/// How long the RTO's floor, raised by spurious expiries, stays before each halving back
/// toward `min_rto`, at first: a halving that a spurious expiry follows within the wait doubles
/// the wait (up to [`MAX_FLOOR_DECAY`]), and the floor back at `min_rto` resets it.
pub const FLOOR_DECAY: Duration = Duration::from_secs(1);

/// The longest wait between two halvings of the RTO's floor.
pub const MAX_FLOOR_DECAY: Duration = Duration::from_secs(16);

/// A request as the initiator hands it to a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submission {
    /// Session-unique tag (kept when the request is re-issued on another channel).
    pub tag: u64,
    /// Operation.
    pub op: Op,
    /// Force unit access.
    pub fua: bool,
    /// Byte offset in the export.
    pub offset: u64,
    /// Length in bytes (at most the channel's `max_io` for reads and writes).
    pub length: u32,
    /// Index of the channel the tag was first issued on in this session (this channel's own
    /// index on a first issue): the target keeps the tag's at-most-once record there.
    pub home: u16,
}

/// A request the target should execute now: for a write, every data segment is in `damq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadyRequest {
    /// `remq` slot to pass back to [`Channel::complete`].
    pub remq: u16,
    /// `damq` slot holding the data (or receiving it, for a read), or [`NO_SLOT`].
    pub damq: u16,
    /// The request as received.
    pub request: Request,
    /// Generation of the `damq` slot's contents ([`Placement::generation`]): write data placed
    /// with another generation is not this request's.
    pub generation: u32,
}

/// Why a channel died.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadReason {
    /// Nothing heard, or no acknowledgement progress, for `dead_after`.
    Timeout,
    /// The peer sent DISCONNECT.
    PeerClosed(DisconnectReason),
    /// This end closed it.
    Closed,
}

/// Something the caller must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelEvent {
    /// Initiator: a request finished (for a successful read, all its data has been placed).
    Completed {
        /// Tag of the request.
        tag: u64,
        /// Outcome.
        status: Status,
    },
    /// Target: execute this request, then call [`Channel::complete`].
    Request(ReadyRequest),
    /// The channel is dead; its requests must be re-issued elsewhere (initiator).
    Dead(DeadReason),
}

/// Where a received data payload belongs: `damq` slot `damq`, at byte `offset` of the data
/// message of request `tag`. The caller copies `payload` there or keeps the frame's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement<'a> {
    /// `damq` slot.
    pub damq: u16,
    /// Tag of the request.
    pub tag: u64,
    /// Byte offset within the request's data.
    pub offset: u32,
    /// The bytes, borrowed from the received frame.
    pub payload: &'a [u8],
    /// Generation of the slot's contents: it changes whenever the slot is claimed for a
    /// request or its early data, or released (a refused request's early segments), so a
    /// caller that keeps payloads by slot drops those of an older generation.
    pub generation: u32,
}

/// Why a volume or a target session did not use a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameDrop {
    /// Not a valid Tyche frame.
    Wire(tyche_wire::WireError),
    /// For another session, or a channel or peer the session does not have.
    NotOurs,
    /// The channel refused it.
    Channel(DropReason),
}

/// Checks that a received frame belongs to `session` and comes from the peer of the channel it
/// names (looked up with `channel`), parses it and hands it to that channel. Returns the channel
/// index and what the channel did.
///
/// On a keyed channel the frame is authenticated (and decrypted into `scratch` if the channel
/// encrypts) before anything of it is parsed: a frame that fails is counted and dropped with
/// the channel unchanged. The authentic bytes are returned too.
pub(crate) fn deliver<'a, 'c>(
    now: Instant,
    bytes: &'a [u8],
    scratch: &'a mut Vec<u8>,
    ethertype: u16,
    session: u64,
    channel: impl FnOnce(u16) -> Option<&'c mut Channel>,
) -> Result<(u16, Received<'a>, &'a [u8]), FrameDrop> {
    let frame = tyche_wire::Frame::new_checked(bytes, ethertype).map_err(FrameDrop::Wire)?;
    if frame.session() != session {
        return Err(FrameDrop::NotOurs);
    }
    let idx = frame.channel();
    let ch = channel(idx).filter(|ch| ch.envelope().dst == frame.src()).ok_or(FrameDrop::NotOurs)?;
    deliver_to(ch, idx, now, bytes, scratch, ethertype)
}

/// The part of [`deliver`] after the frame's channel `idx` was found: authentication,
/// parsing, the channel.
fn deliver_to<'a>(
    ch: &mut Channel,
    idx: u16,
    now: Instant,
    bytes: &'a [u8],
    scratch: &'a mut Vec<u8>,
    ethertype: u16,
) -> Result<(u16, Received<'a>, &'a [u8]), FrameDrop> {
    let bytes = match ch.open(bytes, scratch) {
        Ok(b) => b,
        Err(r) => return Ok((idx, ch.drop_frame(r), bytes)),
    };
    let frame = tyche_wire::Frame::new_checked(bytes, ethertype).map_err(FrameDrop::Wire)?;
    let msg = frame.parse_borrowed().map_err(FrameDrop::Wire)?;
    Ok((idx, ch.handle(now, &msg), bytes))
}

/// Most pieces a received frame may come in: a multi-buffer frame of the largest MTU (9216)
/// over AF_XDP chunks that carry 3646 bytes each is 3 (the same limit as
/// `tyche_transport::MAX_PIECES`).
pub const MAX_PIECES: usize = 4;

/// Bytes in one piece or several: the payload of a DATA frame that arrived as a multi-buffer
/// frame lies across its buffers. The pieces are held inline (no allocation per frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pieces<'a> {
    parts: [&'a [u8]; MAX_PIECES],
    count: u8,
}

impl<'a> Pieces<'a> {
    /// Bytes in one piece.
    pub fn one(bytes: &'a [u8]) -> Pieces<'a> {
        let mut parts: [&'a [u8]; MAX_PIECES] = [&[]; MAX_PIECES];
        parts[0] = bytes;
        Pieces { parts, count: 1 }
    }
    /// Bytes `start..start + len` of a frame given in `pieces` (in order), or `None` when they
    /// lie beyond its end or span more than [`MAX_PIECES`] pieces.
    pub fn cut(pieces: &[&'a [u8]], start: usize, len: usize) -> Option<Pieces<'a>> {
        let mut parts: [&'a [u8]; MAX_PIECES] = [&[]; MAX_PIECES];
        let mut count = 0;
        let (mut skip, mut left) = (start, len);
        for p in pieces {
            if left == 0 {
                break;
            }
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            let n = left.min(p.len() - skip);
            *parts.get_mut(count)? = &p[skip..skip + n];
            count += 1;
            skip = 0;
            left -= n;
        }
        (left == 0 && count > 0).then_some(Pieces { parts, count: count as u8 })
    }
    /// The pieces, in order.
    pub fn parts(&self) -> &[&'a [u8]] {
        &self.parts[..self.count as usize]
    }
    /// Bytes in all.
    pub fn len(&self) -> usize {
        self.parts().iter().map(|p| p.len()).sum()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The bytes, when they are in one piece.
    pub fn as_single(&self) -> Option<&'a [u8]> {
        match self.parts() {
            [one] => Some(one),
            _ => None,
        }
    }
}

/// Bytes of the copy [`data_head`] checks: a DATA frame's headers and one sector.
pub const DATA_HEAD_COPY: usize = DATA_FRAME_OVERHEAD + tyche_wire::SECTOR_SIZE as usize;

/// The headers of a DATA frame that arrived in pieces, from its first piece, checked by
/// `tyche_wire`: a checked frame over a copy of the first piece's headers (62 bytes, never the
/// payload) whose `LENGTH` is set to cover them and one sector, and the frame's real `LENGTH`.
/// An error for a first piece too short for the headers, or a frame `tyche_wire` refuses, or
/// one that is not DATA (no other message is ever longer than one buffer).
pub fn data_head(
    first: &[u8],
    ethertype: u16,
) -> Result<(tyche_wire::Frame<[u8; DATA_HEAD_COPY]>, usize), tyche_wire::WireError> {
    use tyche_wire::{WireError, ETH_HEADER_LEN};
    let length_at = ETH_HEADER_LEN + layout::common::LENGTH.start;
    let head = first.get(..DATA_FRAME_OVERHEAD).ok_or(WireError::Truncated)?;
    let mut copy = [0u8; DATA_HEAD_COPY];
    copy[..DATA_FRAME_OVERHEAD].copy_from_slice(head);
    let length = u16::from_be_bytes([copy[length_at], copy[length_at + 1]]) as usize;
    let short = (DATA_HEAD_COPY - ETH_HEADER_LEN) as u16;
    copy[length_at..length_at + 2].copy_from_slice(&short.to_be_bytes());
    let frame = tyche_wire::Frame::new_checked(copy, ethertype)?;
    if frame.kind() != tyche_wire::Kind::Data {
        return Err(WireError::BadLength);
    }
    Ok((frame, length))
}

/// [`deliver`] for a frame that arrived in several pieces (a multi-buffer frame; at most
/// [`MAX_PIECES`]). A DATA frame of a channel that neither seals its frames nor carries
/// digests has its headers, all in the first piece, checked and parsed by `tyche_wire` from a
/// copy of them (62 bytes, never the payload), and its payload is returned as the pieces it
/// lies in. Any other frame (a sealed or DIGEST channel's, whose checks need the whole frame;
/// a message that is not DATA; a first piece too short for the headers) is gathered into
/// `gather` first and delivered as one piece: the one copy there is.
pub(crate) fn deliver_pieces<'a, 'c>(
    now: Instant,
    pieces: &[&'a [u8]],
    scratch: &'a mut Vec<u8>,
    gather: &'a mut Vec<u8>,
    ethertype: u16,
    session: u64,
    channel: impl FnOnce(u16) -> Option<&'c mut Channel>,
) -> Result<(u16, Received<'a>, Pieces<'a>), FrameDrop> {
    use tyche_wire::{WireError, ETH_HEADER_LEN, SECTOR_SIZE};
    if pieces.len() > MAX_PIECES {
        return Err(FrameDrop::Wire(WireError::BadLength));
    }
    let sector = SECTOR_SIZE as usize;
    let head = pieces.first().and_then(|first| data_head(first, ethertype).ok());
    let gathered = |gather: &'a mut Vec<u8>| -> &'a [u8] {
        gather.clear();
        for p in pieces {
            gather.extend_from_slice(p);
        }
        gather
    };
    let Some((frame, length)) = head else {
        let bytes = gathered(gather);
        let (idx, received, bytes) = deliver(now, bytes, scratch, ethertype, session, channel)?;
        let payload = match received {
            Received::Placed(p) => Pieces::one(p.payload),
            _ => Pieces::one(bytes),
        };
        return Ok((idx, received, payload));
    };
    if frame.session() != session {
        return Err(FrameDrop::NotOurs);
    }
    let idx = frame.channel();
    let ch = channel(idx).filter(|ch| ch.envelope().dst == frame.src()).ok_or(FrameDrop::NotOurs)?;
    if ch.sealed() || ch.params.features & tyche_wire::flags::FEATURE_DIGEST != 0 {
        let bytes = gathered(gather);
        let (idx, received, bytes) = deliver_to(ch, idx, now, bytes, scratch, ethertype)?;
        let payload = match received {
            Received::Placed(p) => Pieces::one(p.payload),
            _ => Pieces::one(bytes),
        };
        return Ok((idx, received, payload));
    }
    // The real LENGTH: the payload runs from the headers to its end, across the pieces.
    let end = ETH_HEADER_LEN + length;
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    if end > total || end < DATA_FRAME_OVERHEAD {
        return Err(FrameDrop::Wire(WireError::Truncated));
    }
    let payload_len = end - DATA_FRAME_OVERHEAD;
    // The checks tyche_wire makes of a DATA payload, on the real one.
    if payload_len == 0 || payload_len % sector != 0 {
        return Err(FrameDrop::Wire(WireError::Malformed));
    }
    let payload = Pieces::cut(pieces, DATA_FRAME_OVERHEAD, payload_len).ok_or(FrameDrop::Wire(WireError::Truncated))?;
    let msg = frame.parse().map_err(FrameDrop::Wire)?;
    let received = ch.handle_sized(now, &msg, payload_len);
    Ok((idx, received, payload))
}

/// For a DATA frame: where its `DIGEST` field is, and its payload (up to `LENGTH`).
fn data_payload(frame: &[u8]) -> Option<(usize, &[u8])> {
    let c = tyche_wire::ETH_HEADER_LEN;
    if frame.len() < tyche_wire::DATA_FRAME_OVERHEAD || frame[c + layout::common::KIND] != tyche_wire::Kind::Data as u8
    {
        return None;
    }
    let l = layout::common::LENGTH;
    let end = c + u16::from_be_bytes([frame[c + l.start], frame[c + l.start + 1]]) as usize;
    let payload = frame.get(tyche_wire::DATA_FRAME_OVERHEAD..end)?;
    Some((c + layout::data::DIGEST.start, payload))
}

/// Outcome of [`Channel::handle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received<'a> {
    /// Used; nothing for the caller to do with the frame's bytes.
    Consumed,
    /// A data payload to place.
    Placed(Placement<'a>),
    /// Not used.
    Dropped(DropReason),
}

/// The payload the caller must put after the headers of a DATA frame that
/// [`Channel::poll_transmit`] wrote: `len` bytes of `damq` slot `damq` (request `tag`) starting
/// at `offset`, to go at `buf[DATA_FRAME_OVERHEAD..]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadRef {
    /// `damq` slot.
    pub damq: u16,
    /// Tag of the request.
    pub tag: u64,
    /// Byte offset within the request's data.
    pub offset: u32,
    /// Bytes.
    pub len: u32,
}

/// A frame written by [`Channel::poll_transmit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Frame length (payload included).
    pub len: usize,
    /// For DATA frames, the payload the caller must fill in before sending.
    pub payload: Option<PayloadRef>,
}

/// Counters of one channel end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChannelStats {
    /// Frames sent (all kinds, retransmissions included).
    pub frames_tx: u64,
    /// Frames received and used.
    pub frames_rx: u64,
    /// Payload bytes sent in DATA frames.
    pub payload_tx: u64,
    /// Payload bytes placed from DATA frames.
    pub payload_rx: u64,
    /// Sequenced frames sent again.
    pub retransmits: u64,
    /// Retransmission timer expiries.
    pub timeouts: u64,
    /// Expiries found spurious: after the timer retransmitted only the oldest frame, frames it
    /// did not resend were acknowledged (they had been delayed, not lost), so the rest of the
    /// window was not sent again (F-RTO, RFC 5682); or the frame it resent alone reached the
    /// peer twice (an ACK with flag DUPLICATE covered it). Each raises the RTO's floor.
    pub spurious_timeouts: u64,
    /// Standalone ACKs sent.
    pub acks_tx: u64,
    /// NACKs sent.
    pub nacks_tx: u64,
    /// NACKs received.
    pub nacks_rx: u64,
    /// KEEPALIVE probes sent.
    pub keepalives_tx: u64,
    /// Frames dropped, by [`DropReason`] (indexed as in [`DropReason::ALL`]).
    pub dropped: [u64; 11],
}

#[derive(Debug, Clone, Copy)]
enum TxFrame {
    Request(Request),
    Completion(Completion),
    Data(DataHeader, u32),
}

#[derive(Debug, Clone, Copy)]
struct TxEntry {
    frame: TxFrame,
    first_sent: Instant,
    last_sent: Instant,
    retx: u16,
    sacked: bool,
    queued: bool,
    /// Unacknowledged when the retransmission timer expired and not resent by it: if it is
    /// acknowledged now, it was delayed, not lost ([`Channel::frto`]).
    suspect: bool,
}

#[derive(Debug)]
enum Outgoing {
    Frame(TxFrame),
    DataMessage { damq: u16, tag: u64, length: u32, next: u16, count: u16 },
}

/// Reassembly state of one `damq` slot.
#[derive(Debug)]
struct DamqSlot {
    /// Tag whose data the slot holds (or last held).
    tag: u64,
    /// Whether a request (or its early data) owns the slot.
    active: bool,
    /// Tag of the request that last released the slot: its late segments are stale. (Within a
    /// channel frames arrive at most once, and a released slot's data all arrived before the
    /// release, so this only matters for segments of refused requests.)
    done_tag: Option<u64>,
    count: u16,
    received: u16,
    bytes: u32,
    seen: Bitmap,
    /// The `remq` slot of the request using this slot, once known.
    remq: u16,
    /// Bumped on every claim and release ([`Placement::generation`]).
    generation: u32,
    /// Target: read data of the last request is queued and not yet sent once; the slot cannot
    /// be claimed again until it is (a correct initiator reuses it only after all of it arrived).
    sending: bool,
}

#[derive(Debug, Clone, Copy)]
enum RemqSlot {
    Free,
    /// Initiator: submitted, awaiting completion (and read data).
    InFlight {
        sub: Submission,
        damq: u16,
        status: Option<Status>,
    },
    /// Target: a write whose data is still arriving.
    AwaitingData(Request),
    /// Target: handed to the caller, awaiting [`Channel::complete`].
    Executing(Request),
    /// Target: completed; its COMPLETION (tag) is queued and not yet sent once. The slot is not
    /// free before: a correct initiator reuses it only after that COMPLETION arrived, so the
    /// send queue holds at most one completion per slot.
    Completing(u64),
}

/// One end of a Tyche channel.
///
/// Driven only by its inputs ([`Channel::handle`], [`Channel::handle_timeout`], submissions and
/// completions) and polled for outputs ([`Channel::poll_transmit`], [`Channel::poll_event`],
/// [`Channel::poll_timeout`]). It owns no memory for payloads: it names where payloads go and
/// come from, and the caller moves them (or leaves them in place).
#[derive(Debug)]
pub struct Channel {
    role: Role,
    env: Envelope,
    params: ChannelParams,
    timers: Timers,
    dead: Option<DeadReason>,
    closing: Option<DisconnectReason>,
    /// Copies of the closing DISCONNECT still to send (it is not retransmitted: a few copies
    /// make its loss unlikely, and the peer reads a lost SHUTDOWN as a crash).
    disconnects_left: u8,

    // Transmit ring: positions [tx_base, tx_next) are sent and not yet acknowledged.
    tx_base: u32,
    tx_next: u32,
    tx: Box<[Option<TxEntry>]>,
    retx: VecDeque<u32>,
    queue: VecDeque<Outgoing>,
    rto: Duration,
    srtt: Option<Duration>,
    rttvar: Duration,
    rto_deadline: Option<Instant>,
    /// After a timer expiry that resent only the oldest frame (F-RTO): whether the next
    /// acknowledgement says the others were delayed (spurious expiry: nothing more is resent)
    /// or lost (the rest of the window is resent then).
    frto: bool,
    /// When the channel last saw a frame lost (a NACK received, or an F-RTO expiry found
    /// real): F-RTO runs only on a channel that has seen none for `max_rto`, where an expiry
    /// is more likely a descheduled peer than a loss; on a lossy one an expiry resends the
    /// whole window at once, as it always did.
    loss_seen: Option<Instant>,
    /// The frame an expiry resent alone (nothing else was waiting), when, and when it was sent
    /// before: an ACK with flag DUPLICATE that covers it within `max_rto` says the earlier copy
    /// had arrived too, so the expiry was spurious (F-RTO cannot tell with one frame
    /// outstanding).
    lone_resend: Option<(u32, Instant, Instant)>,
    /// The longest wait for an acknowledgement that turned out delayed, not lost (a frame sent
    /// once and acknowledged after the timer had expired: F-RTO's, or the lone frame's of a
    /// duplicate report), since the last expiry found spurious: how long the peer paused.
    pause_seen: Duration,
    /// The RTO's lower bound: `min_rto`, doubled (up to `max_rto`; at once to the pause seen,
    /// if longer) by each expiry found spurious and halved after each `floor_decay` without one, so that a peer whose thread
    /// is descheduled for longer than `min_rto` stops costing a resend at each pause.
    rto_floor: Duration,
    /// When the floor last rose or decayed (None: it is `min_rto`).
    floor_changed: Option<Instant>,
    /// The floor rose for an expiry found spurious since [`Channel::take_floor_rise`] last
    /// looked.
    floor_rose: bool,
    /// The wait before the floor's next halving: [`FLOOR_DECAY`], doubled (up to
    /// [`MAX_FLOOR_DECAY`]) each time a spurious expiry follows a halving within the wait (the
    /// halving went below what the peer's pauses need), back to [`FLOOR_DECAY`] once the floor
    /// is down to `min_rto`.
    floor_decay: Duration,
    /// When the floor was last halved, until an expiry is found spurious.
    floor_lowered: Option<Instant>,

    // Receive ring: everything below rx_expected arrived; rx_seen marks arrivals above it.
    rx_expected: u32,
    rx_end: u32,
    rx_seen: Bitmap,
    /// A sequenced frame already received arrived again since the last standalone ACK: the
    /// next ACK goes out at once, flagged DUPLICATE.
    dup_seen: bool,
    unacked: u32,
    ack_deadline: Option<Instant>,
    ack_now: bool,
    gap_since: Option<Instant>,
    nack_now: bool,

    // Liveness.
    last_heard: Instant,
    last_progress: Instant,
    last_probe: Instant,
    probe_now: bool,
    probe_nonce: u64,
    echo: Option<Keepalive>,

    remq: Box<[RemqSlot]>,
    damq: Box<[DamqSlot]>,
    free_remq: Vec<u16>,
    free_damq: Vec<u16>,

    events: VecDeque<ChannelEvent>,
    stats: ChannelStats,
    /// Keys and counters of a keyed export's channel: every frame is sealed and checked.
    sealer: Option<Box<crate::auth::Sealer>>,
    /// The export's durability epoch from the ACCEPT that opened it (initiator side).
    durability_epoch: tyche_wire::DurabilityEpoch,
}

impl Channel {
    /// A channel end with negotiated `params`, addressed by `env` (source is this end), opened
    /// at `now`. Panics if `params` or `timers` are invalid (the handshake validated them).
    pub fn new(role: Role, env: Envelope, params: ChannelParams, timers: Timers, now: Instant) -> Self {
        assert!(crate::config::params_supported(&params), "unsupported channel parameters {params:?}");
        timers.validate().expect("invalid timers");
        let ring = params.ring as usize;
        let max_segs = params.max_io.div_ceil(params.segment as u32) as usize;
        let damq = (0..params.damq_slots)
            .map(|_| DamqSlot {
                tag: 0,
                active: false,
                done_tag: None,
                count: 0,
                received: 0,
                bytes: 0,
                seen: Bitmap::new(max_segs),
                remq: NO_SLOT,
                generation: 0,
                sending: false,
            })
            .collect();
        Channel {
            role,
            env,
            params,
            timers,
            dead: None,
            closing: None,
            disconnects_left: 0,
            tx_base: 0,
            tx_next: 0,
            tx: vec![None; ring].into_boxed_slice(),
            retx: VecDeque::new(),
            queue: VecDeque::new(),
            rto: timers.initial_rto,
            srtt: None,
            rttvar: Duration::ZERO,
            rto_deadline: None,
            frto: false,
            loss_seen: None,
            lone_resend: None,
            pause_seen: Duration::ZERO,
            rto_floor: timers.min_rto,
            floor_changed: None,
            floor_rose: false,
            floor_decay: FLOOR_DECAY,
            floor_lowered: None,
            rx_expected: 0,
            rx_end: 0,
            rx_seen: Bitmap::new(ring),
            dup_seen: false,
            unacked: 0,
            ack_deadline: None,
            ack_now: false,
            gap_since: None,
            nack_now: false,
            last_heard: now,
            last_progress: now,
            last_probe: now,
            probe_now: false,
            probe_nonce: 0,
            echo: None,
            remq: vec![RemqSlot::Free; params.remq_slots as usize].into_boxed_slice(),
            damq,
            free_remq: (0..params.remq_slots).rev().collect(),
            free_damq: (0..params.damq_slots).rev().collect(),
            events: VecDeque::new(),
            stats: ChannelStats::default(),
            sealer: None,
            durability_epoch: tyche_wire::DurabilityEpoch::NONE,
        }
    }

    /// The same channel, sealing every frame it sends and accepting only sealed, authentic and
    /// new frames ([`crate::auth`]): the channel of a keyed export.
    pub fn with_sealer(mut self, sealer: crate::auth::Sealer) -> Self {
        self.sealer = Some(Box::new(sealer));
        self
    }

    /// The same channel, opened by an ACCEPT carrying durability epoch `epoch`.
    pub fn with_durability_epoch(mut self, epoch: tyche_wire::DurabilityEpoch) -> Self {
        self.durability_epoch = epoch;
        self
    }

    /// The durability epoch of the ACCEPT that opened the channel
    /// ([`tyche_wire::DurabilityEpoch::NONE`] unless [`Channel::with_durability_epoch`] set one).
    pub fn durability_epoch(&self) -> tyche_wire::DurabilityEpoch {
        self.durability_epoch
    }

    /// Whether the channel seals its frames (a keyed export's).
    pub fn sealed(&self) -> bool {
        self.sealer.is_some()
    }

    /// How the channel protects its frames, for counters and logs: `encrypted`,
    /// `authenticated` (sealed), `digest` (feature DIGEST) or `none`.
    pub fn protection(&self) -> &'static str {
        match &self.sealer {
            Some(s) if s.encrypts() => "encrypted",
            Some(_) => "authenticated",
            None if self.params.features & tyche_wire::flags::FEATURE_DIGEST != 0 => "digest",
            None => "none",
        }
    }

    /// Completes a frame [`Channel::poll_transmit`] wrote into `buf` (its payload filled in):
    /// on a keyed channel seals it and returns the sealed length (`buf` needs
    /// [`crate::auth::SEAL_OVERHEAD`] bytes beyond the message); else returns `len`.
    ///
    /// On a channel with feature DIGEST, a DATA frame gets the CRC32C of its payload first.
    pub fn seal(&mut self, buf: &mut [u8], len: usize) -> usize {
        if len == 0 {
            return len;
        }
        if self.params.features & tyche_wire::flags::FEATURE_DIGEST != 0 {
            if let Some((at, payload)) = data_payload(buf) {
                let crc = crc32c::crc32c(payload);
                buf[at..at + 4].copy_from_slice(&crc.to_be_bytes());
            }
        }
        match &mut self.sealer {
            Some(s) => s.seal(buf),
            None => len,
        }
    }

    /// Checks a received frame of this channel: on a keyed channel its authentic plaintext (in
    /// `scratch` when the channel encrypts), else `bytes`.
    ///
    /// On a channel with feature DIGEST, a DATA frame whose payload does not match its CRC32C
    /// is refused (`BadDigest`), so corrupted data is never placed: the sender sends it again.
    pub fn open<'a>(&mut self, bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> Result<&'a [u8], DropReason> {
        let bytes = match &mut self.sealer {
            Some(s) => s.open(bytes, scratch)?,
            None => bytes,
        };
        if self.params.features & tyche_wire::flags::FEATURE_DIGEST != 0 {
            if let Some((at, payload)) = data_payload(bytes) {
                let want = u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
                if crc32c::crc32c(payload) != want {
                    return Err(DropReason::BadDigest);
                }
            }
        }
        Ok(bytes)
    }

    /// This end's role.
    pub fn role(&self) -> Role {
        self.role
    }
    /// The negotiated parameters.
    pub fn params(&self) -> &ChannelParams {
        &self.params
    }
    /// Addressing of frames this end sends.
    pub fn envelope(&self) -> &Envelope {
        &self.env
    }
    /// Why the channel died, if it has.
    pub fn dead(&self) -> Option<DeadReason> {
        self.dead
    }
    /// Counters.
    pub fn stats(&self) -> &ChannelStats {
        &self.stats
    }
    /// Current retransmission timeout.
    pub fn rto(&self) -> Duration {
        self.rto
    }
    /// The RTO's lower bound now (`min_rto`, raised by expiries found spurious, this channel's
    /// or another of its volume's).
    pub fn rto_floor(&self) -> Duration {
        self.rto_floor
    }
    /// Frames sent and not yet acknowledged.
    pub fn unacked_frames(&self) -> u32 {
        self.tx_next.wrapping_sub(self.tx_base)
    }
    /// Requests in flight (initiator) or being handled (target).
    pub fn busy_remq(&self) -> usize {
        // The free list is the initiator's; a target's slots are named by the peer.
        self.remq.iter().filter(|s| !matches!(s, RemqSlot::Free)).count()
    }

    /// Initiator: requests submitted and not yet finished (their completion and all their data
    /// in). O(1), unlike [`busy_remq`](Self::busy_remq); zero on a target.
    pub fn in_flight(&self) -> usize {
        self.remq.len() - self.free_remq.len()
    }

    /// Target: the tag of the request handed out in `remq` and not yet completed, if any.
    pub fn executing_tag(&self, remq: u16) -> Option<u64> {
        match self.remq.get(remq as usize)? {
            RemqSlot::Executing(r) => Some(r.tag),
            _ => None,
        }
    }

    /// Whether `damq` slot `damq` holds a request's data (being received, executed or sent).
    pub fn damq_active(&self, damq: u16) -> bool {
        self.damq.get(damq as usize).is_some_and(|d| d.active || d.sending)
    }

    /// Target: requests handed out and not yet completed.
    pub fn executing(&self) -> usize {
        self.remq.iter().filter(|s| matches!(s, RemqSlot::Executing(_))).count()
    }

    // ------------------------------------------------------------------------------------------
    // Initiator side.

    /// Whether [`Channel::submit`] would accept a request of `op` now.
    pub fn can_submit(&self, op: Op) -> bool {
        self.dead.is_none()
            && self.closing.is_none()
            && !self.free_remq.is_empty()
            && (!op.uses_damq() || !self.free_damq.is_empty())
    }

    /// Submits a request (initiator). Returns `false`, changing nothing, when the channel is
    /// dead or has no free slot. `floor` is the session's tag floor to advertise.
    pub fn submit(&mut self, sub: Submission, floor: u64) -> bool {
        assert_eq!(self.role, Role::Initiator, "submit on a target channel");
        assert!(
            !sub.op.uses_damq() || (sub.length > 0 && sub.op.data_len(sub.length) <= self.params.max_io),
            "request of {} bytes on a channel with max_io {}",
            sub.op.data_len(sub.length),
            self.params.max_io
        );
        if !self.can_submit(sub.op) {
            return false;
        }
        let remq = self.free_remq.pop().expect("checked");
        let damq = if sub.op.uses_damq() {
            let d = self.free_damq.pop().expect("checked");
            let count = self.segments(sub.op.data_len(sub.length));
            self.damq[d as usize].reset(sub.tag, count, remq);
            d
        } else {
            NO_SLOT
        };
        self.remq[remq as usize] = RemqSlot::InFlight { sub, damq, status: None };
        let request = Request {
            seq: Seq::default(),
            op: sub.op,
            fua: sub.fua,
            remq,
            damq,
            home: sub.home,
            tag: sub.tag,
            floor,
            offset: sub.offset,
            length: sub.length,
        };
        self.enqueue(Outgoing::Frame(TxFrame::Request(request)));
        if sub.op.has_write_data() {
            let count = self.segments(sub.length);
            self.enqueue(Outgoing::DataMessage { damq, tag: sub.tag, length: sub.length, next: 0, count });
        }
        true
    }

    /// Takes the requests in flight on a dead channel (initiator), freeing their slots, so the
    /// caller can re-issue them elsewhere with the same tags.
    pub fn take_in_flight(&mut self) -> Vec<Submission> {
        assert!(self.dead.is_some(), "take_in_flight on a live channel");
        let mut out = Vec::new();
        for slot in self.remq.iter_mut() {
            if let RemqSlot::InFlight { sub, .. } = *slot {
                out.push(sub);
            }
            *slot = RemqSlot::Free;
        }
        self.queue.clear();
        out
    }

    // ------------------------------------------------------------------------------------------
    // Target side.

    /// Reports the outcome of a [`ChannelEvent::Request`] (target). For a successful read the
    /// data must be in the request's `damq` slot: it is sent from there, then the completion.
    /// Returns the request completed, or `None` if `remq` holds no executing request (a caller
    /// bug). On a dead channel the slot is released and nothing is sent.
    pub fn complete(&mut self, remq: u16, status: Status) -> Option<Request> {
        assert_eq!(self.role, Role::Target, "complete on an initiator channel");
        let Some(RemqSlot::Executing(req)) = self.remq.get(remq as usize).copied() else {
            return None;
        };
        self.release_damq(req.damq, req.tag);
        if self.dead.is_some() {
            self.remq[remq as usize] = RemqSlot::Free;
            return Some(req);
        }
        if req.op.has_read_data() && status == Status::Ok {
            // A READ's data, or a BLOCK_STATUS's list.
            let length = req.op.data_len(req.length);
            let count = self.segments(length);
            if let Some(d) = self.damq.get_mut(req.damq as usize) {
                d.sending = true;
            }
            self.enqueue(Outgoing::DataMessage { damq: req.damq, tag: req.tag, length, next: 0, count });
        }
        self.remq[remq as usize] = RemqSlot::Completing(req.tag);
        self.queue_completion(req.remq, req.damq, req.tag, status);
        Some(req)
    }

    fn release_damq(&mut self, damq: u16, tag: u64) {
        if let Some(d) = self.damq.get_mut(damq as usize) {
            if d.tag == tag && d.active {
                d.active = false;
                d.done_tag = Some(tag);
                d.generation = d.generation.wrapping_add(1);
            }
        }
    }

    fn queue_completion(&mut self, remq: u16, damq: u16, tag: u64, status: Status) {
        let c = Completion { seq: Seq::default(), status, remq, damq, tag };
        self.enqueue(Outgoing::Frame(TxFrame::Completion(c)));
    }

    // ------------------------------------------------------------------------------------------
    // Both sides.

    /// Starts an orderly close: a DISCONNECT is sent ([`DISCONNECT_COPIES`] times) and the
    /// channel is dead after it.
    pub fn close(&mut self, reason: DisconnectReason) {
        if self.dead.is_none() && self.closing.is_none() {
            self.closing = Some(reason);
            self.disconnects_left = DISCONNECT_COPIES;
        }
    }

    /// Closes a channel that was opened but will not be used ([`crate::Opened::Stale`],
    /// [`crate::Opened::Probe`]): writes its DISCONNECT into `buf`, sealed, and returns the
    /// frame's length, for the caller to send once on the channel's link (the target reclaims
    /// the channel at once instead of at its timeout). `None` if the channel is dead already.
    pub fn abandon(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.close(DisconnectReason::Normal);
        let t = self.poll_transmit(now, buf)?;
        Some(self.seal(buf, t.len))
    }

    /// Kills the channel at once, sending nothing (the peer finds out by timeout). Used when a
    /// channel is replaced by a reconnect.
    pub fn abort(&mut self) {
        self.die(DeadReason::Closed);
    }

    /// Queues a frame (or a data message) for a ring position. The queue's bound holds by
    /// construction (see [`max_queued`]): a `remq` slot has at most one completion queued, a
    /// `damq` slot at most one data message, and refusals stop at [`max_queued`]. Should it
    /// ever not hold, the channel is closed with a protocol error rather than grow.
    fn enqueue(&mut self, o: Outgoing) {
        if self.queue.len() > 2 * max_queued(&self.params) {
            debug_assert!(false, "channel send queue over its bound");
            self.close(DisconnectReason::ProtocolError);
            return;
        }
        self.queue.push_back(o);
    }

    fn segments(&self, length: u32) -> u16 {
        length.div_ceil(self.params.segment as u32) as u16
    }

    fn die(&mut self, reason: DeadReason) {
        if self.dead.is_none() {
            self.dead = Some(reason);
            self.retx.clear();
            self.rto_deadline = None;
            self.events.push_back(ChannelEvent::Dead(reason));
        }
    }

    fn drop_frame(&mut self, reason: DropReason) -> Received<'static> {
        self.stats.dropped[reason as usize] += 1;
        Received::Dropped(reason)
    }

    /// Hands the channel a message received for it (the caller matched session and channel).
    pub fn handle<'a>(&mut self, now: Instant, msg: &Message<'a>) -> Received<'a> {
        let payload = match msg {
            Message::Data(d) => d.payload,
            _ => &[],
        };
        match self.handle_sized(now, msg, payload.len()) {
            Received::Placed(p) => Received::Placed(Placement { payload, ..p }),
            other => other,
        }
    }

    /// [`Channel::handle`] where a DATA message's payload is `data_len` bytes whatever `msg`
    /// holds (a multi-buffer frame's payload lies across pieces the caller keeps): the channel
    /// looks at its length only, and a placement comes back with an empty `payload` for the
    /// caller to fill in.
    pub(crate) fn handle_sized(&mut self, now: Instant, msg: &Message<'_>, data_len: usize) -> Received<'static> {
        if self.dead.is_some() {
            return self.drop_frame(DropReason::Dead);
        }
        let seq = match msg {
            Message::Request(r) => r.seq,
            Message::Completion(c) => c.seq,
            Message::Data(d) => d.header.seq,
            _ => return self.handle_unsequenced(now, msg),
        };
        let wrong_role = match msg {
            Message::Request(_) => self.role != Role::Target,
            Message::Completion(_) => self.role != Role::Initiator,
            _ => false,
        };
        if wrong_role {
            return self.drop_frame(DropReason::WrongRole);
        }
        self.heard(now);
        if let Some(delayed) = self.on_ack(now, seq.ack) {
            self.frto_decide(now, delayed);
        }
        if let Some(dropped) = self.take_position(now, seq.seq) {
            return dropped;
        }
        self.stats.frames_rx += 1;
        match *msg {
            Message::Request(r) => self.on_request(r),
            Message::Completion(c) => self.on_completion(c),
            Message::Data(d) => self.on_data(d.header, data_len),
            _ => unreachable!("only sequenced messages get here"),
        }
    }

    /// An ACK, NACK, KEEPALIVE or DISCONNECT (messages outside the sequence), or a frame
    /// this channel does not take.
    fn handle_unsequenced(&mut self, now: Instant, msg: &Message<'_>) -> Received<'static> {
        match msg {
            Message::Ack(a) => {
                self.heard(now);
                let cumulative = self.on_ack(now, a.cumulative);
                let selective = self.on_sack(now, a.cumulative, a.sack);
                if cumulative.is_some() || selective.is_some() {
                    self.frto_decide(now, cumulative == Some(true) || selective == Some(true));
                }
                if a.duplicate {
                    self.on_duplicate_report(now, a.cumulative, a.sack);
                }
                self.stats.frames_rx += 1;
                Received::Consumed
            }
            Message::Nack(n) => {
                self.heard(now);
                self.stats.nacks_rx += 1;
                self.on_nack(now, n.base, n.missing);
                self.stats.frames_rx += 1;
                Received::Consumed
            }
            Message::Keepalive(k) => {
                self.heard(now);
                if k.reply {
                    if k.nonce == self.probe_nonce && k.timestamp <= now.0 {
                        self.rtt_sample(now.since(Instant(k.timestamp)));
                    }
                } else {
                    self.echo = Some(Keepalive { reply: true, ..*k });
                }
                self.stats.frames_rx += 1;
                Received::Consumed
            }
            Message::Disconnect(d) => {
                self.stats.frames_rx += 1;
                self.die(DeadReason::PeerClosed(d.reason));
                Received::Consumed
            }
            _ => self.drop_frame(DropReason::Unexpected),
        }
    }

    /// Takes ring position `seq` of the receive window (`[rx_expected, rx_expected + ring)`)
    /// and schedules the acknowledgement; a duplicate or a frame outside the window is dropped
    /// (the drop comes back).
    fn take_position(&mut self, now: Instant, seq: u32) -> Option<Received<'static>> {
        let off = diff(seq, self.rx_expected);
        if off < 0 {
            self.ack_now = true; // the peer missed our ack
            self.dup_seen = true;
            return Some(self.drop_frame(DropReason::Duplicate));
        }
        if off as u32 >= self.params.ring as u32 {
            return Some(self.drop_frame(DropReason::OutOfWindow));
        }
        let pos = (seq % self.params.ring as u32) as usize;
        if self.rx_seen.get(pos) {
            self.ack_now = true;
            self.dup_seen = true;
            return Some(self.drop_frame(DropReason::Duplicate));
        }
        // Accept the ring position first: even a frame whose content we refuse below must not
        // be retransmitted forever.
        self.rx_seen.set(pos);
        if diff(seq.wrapping_add(1), self.rx_end) > 0 {
            self.rx_end = seq.wrapping_add(1);
        }
        let in_order = seq == self.rx_expected;
        while self.rx_seen.get((self.rx_expected % self.params.ring as u32) as usize) && self.rx_expected != self.rx_end
        {
            self.rx_seen.clear((self.rx_expected % self.params.ring as u32) as usize);
            self.rx_expected = self.rx_expected.wrapping_add(1);
        }
        if self.rx_expected == self.rx_end {
            self.gap_since = None;
            self.nack_now = false;
        } else if !in_order && self.gap_since.is_none() {
            self.gap_since = Some(now);
            self.ack_now = true; // tell the sender what we have at once
        }
        self.unacked += 1;
        if self.unacked >= self.timers.ack_every {
            self.ack_now = true;
        }
        if self.ack_deadline.is_none() {
            self.ack_deadline = Some(now + self.timers.ack_delay);
        }
        None
    }

    fn heard(&mut self, now: Instant) {
        self.last_heard = now;
    }

    fn on_request(&mut self, r: Request) -> Received<'static> {
        let slot = r.remq as usize;
        if !matches!(self.remq.get(slot), Some(RemqSlot::Free)) {
            return self.drop_frame(DropReason::BadSlot);
        }
        let fits =
            !r.op.uses_damq() || (r.op.data_len(r.length) <= self.params.max_io && (r.damq as usize) < self.damq.len());
        if !fits {
            return self.refuse(r);
        }
        if r.op.uses_damq() {
            let count = if r.op.has_write_data() { self.segments(r.length) } else { 0 };
            let d = &mut self.damq[r.damq as usize];
            if d.sending {
                // Its read data is still going out: a correct initiator waits for all of it.
                return self.refuse(r);
            }
            let busy = d.active && (d.tag != r.tag || d.remq != NO_SLOT);
            if busy || (d.active && d.count != count) {
                // Another request owns the slot, or the early segments disagree with this one.
                self.release_damq(r.damq, r.tag);
                return self.refuse(r);
            }
            if !d.active {
                d.reset(r.tag, count, r.remq);
            }
            d.remq = r.remq;
        }
        if r.op.has_write_data() {
            let d = &self.damq[r.damq as usize];
            if d.received < d.count {
                self.remq[slot] = RemqSlot::AwaitingData(r);
                return Received::Consumed;
            }
            self.write_data_complete(r);
            return Received::Consumed;
        }
        self.remq[slot] = RemqSlot::Executing(r);
        let generation = self.damq.get(r.damq as usize).map_or(0, |d| d.generation);
        self.events.push_back(ChannelEvent::Request(ReadyRequest {
            remq: r.remq,
            damq: r.damq,
            request: r,
            generation,
        }));
        Received::Consumed
    }

    /// Target: completes `r` with INVALID without giving it a slot. A refused request holds no
    /// slot, so a peer could queue refusals without bound: once the send queue is at its bound
    /// (which a correct peer, holding a `remq` slot per request, never reaches) it is dropped.
    fn refuse(&mut self, r: Request) -> Received<'static> {
        if self.queue.len() >= max_queued(&self.params) {
            return self.drop_frame(DropReason::BadSlot);
        }
        self.queue_completion(r.remq, r.damq, r.tag, Status::Invalid);
        Received::Consumed
    }

    /// Target: all segments of a write are in; check they add up and hand the request over.
    fn write_data_complete(&mut self, r: Request) {
        let d = &self.damq[r.damq as usize];
        if d.bytes != r.length {
            self.remq[r.remq as usize] = RemqSlot::Completing(r.tag);
            self.release_damq(r.damq, r.tag);
            self.queue_completion(r.remq, r.damq, r.tag, Status::Invalid);
            return;
        }
        self.remq[r.remq as usize] = RemqSlot::Executing(r);
        let generation = self.damq[r.damq as usize].generation;
        self.events.push_back(ChannelEvent::Request(ReadyRequest {
            remq: r.remq,
            damq: r.damq,
            request: r,
            generation,
        }));
    }

    fn on_completion(&mut self, c: Completion) -> Received<'static> {
        let Some(RemqSlot::InFlight { sub, damq, status }) = self.remq.get_mut(c.remq as usize) else {
            return self.drop_frame(DropReason::BadSlot);
        };
        if sub.tag != c.tag || status.is_some() {
            return self.drop_frame(DropReason::Stale);
        }
        *status = Some(c.status);
        let (sub, damq) = (*sub, *damq);
        let data_missing = sub.op.has_read_data()
            && c.status == Status::Ok
            && self.damq[damq as usize].received < self.damq[damq as usize].count;
        if !data_missing {
            self.finish(c.remq);
        }
        Received::Consumed
    }

    /// Initiator: the request in `remq` has its completion and all its data.
    fn finish(&mut self, remq: u16) {
        let RemqSlot::InFlight { sub, damq, status: Some(status) } = self.remq[remq as usize] else {
            unreachable!("finish on a slot without a completion");
        };
        self.remq[remq as usize] = RemqSlot::Free;
        self.free_remq.push(remq);
        if damq != NO_SLOT {
            self.release_damq(damq, sub.tag);
            self.free_damq.push(damq);
        }
        // A target completes a request only once it has it and all its data, so nothing of it is
        // queued still; one that completes early (hostile) must not leave its request or data
        // queued behind the freed slots, or the queue would grow with every reuse.
        if !self.queue.is_empty() {
            let tag = sub.tag;
            self.queue.retain(|o| match o {
                Outgoing::Frame(TxFrame::Request(r)) => r.tag != tag,
                Outgoing::DataMessage { tag: t, .. } => *t != tag,
                _ => true,
            });
        }
        self.events.push_back(ChannelEvent::Completed { tag: sub.tag, status });
    }

    fn on_data(&mut self, h: DataHeader, data_len: usize) -> Received<'static> {
        let seg = self.params.segment as u32;
        let Some(d) = self.damq.get_mut(h.damq as usize) else {
            return self.drop_frame(DropReason::BadSlot);
        };
        let Ok(len) = u32::try_from(data_len) else {
            return self.drop_frame(DropReason::Inconsistent);
        };
        let shape_ok = h.offset == h.seg_index as u32 * seg
            && len <= seg
            && h.seg_index < h.seg_count
            && (h.seg_index as u32 + 1 == h.seg_count as u32 || len == seg)
            && h.offset + len <= self.params.max_io
            && h.seg_count as u32 <= self.params.max_io.div_ceil(seg);
        if !shape_ok {
            return self.drop_frame(DropReason::Inconsistent);
        }
        match self.role {
            Role::Initiator => {
                if !d.active || d.tag != h.tag {
                    return self.drop_frame(DropReason::Stale);
                }
                // Read data past the request's end (a full last segment of a shorter read).
                let within = match self.remq.get(d.remq as usize) {
                    Some(RemqSlot::InFlight { sub, .. }) => {
                        h.offset as u64 + len as u64 <= sub.op.data_len(sub.length) as u64
                    }
                    _ => false,
                };
                if !within {
                    return self.drop_frame(DropReason::Inconsistent);
                }
            }
            Role::Target => {
                if d.done_tag == Some(h.tag) && !(d.active && d.tag == h.tag) {
                    return self.drop_frame(DropReason::Stale);
                }
                if !d.active {
                    if d.sending {
                        // Its read data is still going out.
                        return self.drop_frame(DropReason::BadSlot);
                    }
                    // Data may overtake its request: it claims the free slot for its tag.
                    d.reset(h.tag, h.seg_count, NO_SLOT);
                } else if d.tag != h.tag {
                    return self.drop_frame(DropReason::BadSlot);
                }
            }
        }
        if d.count != h.seg_count {
            return self.drop_frame(DropReason::Inconsistent);
        }
        if d.seen.get(h.seg_index as usize) {
            return self.drop_frame(DropReason::Duplicate);
        }
        d.seen.set(h.seg_index as usize);
        d.received += 1;
        d.bytes += len;
        let complete = d.received == d.count;
        let remq = d.remq;
        let generation = d.generation;
        self.stats.payload_rx += len as u64;
        if complete && remq != NO_SLOT {
            match (self.role, self.remq[remq as usize]) {
                (Role::Target, RemqSlot::AwaitingData(r)) if r.tag == h.tag => self.write_data_complete(r),
                (Role::Initiator, RemqSlot::InFlight { status: Some(_), sub, .. }) if sub.tag == h.tag => {
                    self.finish(remq)
                }
                _ => {}
            }
        }
        Received::Placed(Placement { damq: h.damq, tag: h.tag, offset: h.offset, payload: &[], generation })
    }

    // ------------------------------------------------------------------------------------------
    // Acknowledgements and retransmission (sender side).

    /// A cumulative acknowledgement: `None` when it acknowledges nothing new, else whether it
    /// acknowledged a suspect frame that was not resent (an F-RTO expiry was spurious).
    fn on_ack(&mut self, now: Instant, cumulative: u32) -> Option<bool> {
        let advance = diff(cumulative, self.tx_base);
        if advance <= 0 || diff(cumulative, self.tx_next) > 0 {
            return None; // old, or acknowledges positions never sent (ignored)
        }
        let ring = self.params.ring as u32;
        let mut sample = None;
        let mut delayed = false;
        while self.tx_base != cumulative {
            let e = self.tx[(self.tx_base % ring) as usize].take().expect("sent position has an entry");
            if e.retx == 0 {
                sample = Some(now.since(e.first_sent));
            }
            if e.suspect && e.retx == 0 {
                delayed = true;
                self.pause_seen = self.pause_seen.max(now.since(e.first_sent));
            }
            self.tx_base = self.tx_base.wrapping_add(1);
        }
        if let Some(s) = sample {
            self.rtt_sample(s);
        }
        self.decay_floor(now);
        self.rto = self.rto_base();
        self.last_progress = now;
        self.rto_deadline = (self.tx_base != self.tx_next).then(|| now + self.rto);
        Some(delayed)
    }

    /// Selective acknowledgements: as [`Channel::on_ack`], `None` when nothing new.
    fn on_sack(&mut self, now: Instant, cumulative: u32, bits: u64) -> Option<bool> {
        let ring = self.params.ring as u32;
        let mut progress = false;
        let mut delayed = false;
        let mut b = bits;
        while b != 0 {
            let i = b.trailing_zeros();
            b &= b - 1;
            let s = cumulative.wrapping_add(1 + i);
            if diff(s, self.tx_base) >= 0 && diff(s, self.tx_next) < 0 {
                if let Some(e) = self.tx[(s % ring) as usize].as_mut() {
                    progress |= !e.sacked;
                    if !e.sacked && e.suspect && e.retx == 0 {
                        delayed = true;
                        self.pause_seen = self.pause_seen.max(now.since(e.first_sent));
                    }
                    e.sacked = true;
                }
            }
        }
        if progress {
            self.last_progress = now;
        }
        progress.then_some(delayed)
    }

    /// The first acknowledgement after an F-RTO expiry: if a suspect frame (not resent) was
    /// acknowledged, the expiry was spurious and nothing more is resent; else the suspects are
    /// taken for lost and resent now. An expiry that left no suspect (the frame it resent was
    /// the only one waiting) proves nothing either way: the acknowledgement may be the
    /// original's (a descheduled peer) or the resend's, so it neither counts as spurious nor
    /// marks the channel lossy (which would turn F-RTO off for `max_rto`, and every expiry in
    /// that time would resend the whole window).
    fn frto_decide(&mut self, now: Instant, delayed: bool) {
        if !std::mem::take(&mut self.frto) {
            return;
        }
        if delayed {
            self.spurious_expiry(now);
        }
        let ring = self.params.ring as u32;
        let mut s = self.tx_base;
        let mut suspects = false;
        while s != self.tx_next {
            if let Some(e) = self.tx[(s % ring) as usize].as_mut() {
                if std::mem::take(&mut e.suspect) {
                    suspects = true;
                    if !delayed && !e.sacked && !e.queued {
                        e.queued = true;
                        self.retx.push_back(s);
                    }
                }
            }
            s = s.wrapping_add(1);
        }
        if !delayed && suspects {
            self.loss_seen = Some(now);
        }
    }

    /// An ACK flagged DUPLICATE: the peer received some frame twice. If it covers the frame an
    /// expiry resent alone, not long ago, the original had arrived: the expiry was spurious.
    fn on_duplicate_report(&mut self, now: Instant, cumulative: u32, sack: u64) {
        let Some((s, at, sent)) = self.lone_resend else { return };
        let ahead = diff(s, cumulative);
        let covered = ahead < 0 || ((1..=64).contains(&ahead) && sack & (1 << (ahead - 1)) != 0);
        if covered && now.since(at) <= self.timers.max_rto {
            self.lone_resend = None;
            self.pause_seen = self.pause_seen.max(now.since(sent));
            self.spurious_expiry(now);
        }
    }

    /// An expiry found spurious: counted, and the RTO's floor doubled (and raised to the pause
    /// the late acknowledgement took, if longer; up to `max_rto`); if it follows a halving of
    /// the floor within the wait, the next halving waits twice as long.
    fn spurious_expiry(&mut self, now: Instant) {
        self.stats.spurious_timeouts += 1;
        if self.floor_lowered.take().is_some_and(|t| now.since(t) < self.floor_decay) {
            self.floor_decay = (self.floor_decay * 2).min(MAX_FLOOR_DECAY);
        }
        // At least doubled, and at once as long as the pause was (a climb by doublings alone
        // would cost a resend at each).
        let pause = std::mem::take(&mut self.pause_seen);
        self.rto_floor = (self.rto_floor * 2).max(pause).min(self.timers.max_rto);
        self.floor_changed = Some(now);
        self.floor_rose = true;
        self.rto = self.rto.max(self.rto_floor);
    }

    /// The RTO's floor, if it rose for an expiry found spurious since the last call: a volume
    /// hands it to its other channels ([`Channel::share_floor`]), which talk to the same target
    /// and would each find the same pause of its threads with a resend of their own.
    pub fn take_floor_rise(&mut self) -> Option<Duration> {
        std::mem::take(&mut self.floor_rose).then_some(self.rto_floor)
    }

    /// Raises the RTO's floor to `floor` (at most `max_rto`), as a channel to the same target
    /// found it ([`Channel::take_floor_rise`]); it decays as the channel's own does. A lower
    /// floor changes nothing.
    pub fn share_floor(&mut self, floor: Duration, now: Instant) {
        let floor = floor.min(self.timers.max_rto);
        if floor > self.rto_floor {
            self.rto_floor = floor;
            self.floor_changed = Some(now);
            self.rto = self.rto.max(floor);
        }
    }

    /// Halves the RTO's floor (toward `min_rto`) once per `floor_decay` without a spurious
    /// expiry.
    fn decay_floor(&mut self, now: Instant) {
        if self.floor_changed.is_some_and(|t| now.since(t) >= self.floor_decay) {
            self.rto_floor = (self.rto_floor / 2).max(self.timers.min_rto);
            let above = self.rto_floor > self.timers.min_rto;
            self.floor_changed = above.then_some(now);
            self.floor_lowered = Some(now);
            if !above {
                self.floor_decay = FLOOR_DECAY;
            }
        }
    }

    fn on_nack(&mut self, now: Instant, base: u32, missing: u64) {
        if missing != 0 {
            self.loss_seen = Some(now);
        }
        let ring = self.params.ring as u32;
        let gap = self.srtt.unwrap_or(self.timers.min_rto).max(self.timers.min_rto / 2);
        let mut b = missing;
        while b != 0 {
            let i = b.trailing_zeros();
            b &= b - 1;
            let s = base.wrapping_add(i);
            if diff(s, self.tx_base) < 0 || diff(s, self.tx_next) >= 0 {
                continue;
            }
            if let Some(e) = self.tx[(s % ring) as usize].as_mut() {
                if !e.sacked && !e.queued && now.since(e.last_sent) >= gap {
                    e.queued = true;
                    self.retx.push_back(s);
                }
            }
        }
    }

    fn rtt_sample(&mut self, s: Duration) {
        // RFC 6298.
        match self.srtt {
            None => {
                self.srtt = Some(s);
                self.rttvar = s / 2;
            }
            Some(srtt) => {
                let dev = srtt.abs_diff(s);
                self.rttvar = (self.rttvar * 3 + dev) / 4;
                self.srtt = Some((srtt * 7 + s) / 8);
            }
        }
        self.rto = self.rto_base();
    }

    fn rto_base(&self) -> Duration {
        match self.srtt {
            Some(srtt) => (srtt + self.rttvar * 4).clamp(self.rto_floor, self.timers.max_rto),
            None => self.timers.initial_rto.max(self.rto_floor),
        }
    }

    // ------------------------------------------------------------------------------------------
    // Output.

    /// The next time [`Channel::handle_timeout`] must be called, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.dead.is_some() {
            return None;
        }
        let mut t = self.rto_deadline;
        if self.unacked > 0 {
            t = earliest(t, self.ack_deadline);
        }
        if let Some(g) = self.gap_since.filter(|_| !self.nack_now) {
            t = earliest(t, Some(g + self.timers.nack_delay));
        }
        let ka = self.last_heard.max(self.last_probe) + self.timers.keepalive;
        t = earliest(t, Some(ka));
        t = earliest(t, Some(self.last_heard + self.timers.dead_after));
        if self.tx_base != self.tx_next {
            t = earliest(t, Some(self.last_progress + self.timers.dead_after));
        }
        t
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.dead.is_some() {
            return;
        }
        let waiting = self.tx_base != self.tx_next;
        if now.since(self.last_heard) >= self.timers.dead_after
            || (waiting && now.since(self.last_progress) >= self.timers.dead_after)
        {
            self.die(DeadReason::Timeout);
            return;
        }
        if self.rto_deadline.is_some_and(|d| d <= now) {
            self.stats.timeouts += 1;
            // The first expiry resends the oldest frame only and marks the others suspect; a
            // second one before any acknowledgement resends the whole window.
            let lossless = self.loss_seen.is_none_or(|t| now.since(t) >= self.timers.max_rto);
            let first_only = !std::mem::take(&mut self.frto) && lossless;
            let ring = self.params.ring as u32;
            let mut s = self.tx_base;
            let mut resent = 0usize;
            let mut suspects = false;
            let mut first: Option<(u32, Instant)> = None;
            while s != self.tx_next {
                if let Some(e) = self.tx[(s % ring) as usize].as_mut() {
                    e.suspect = false;
                    if !e.sacked && !e.queued && now.since(e.last_sent) >= self.rto {
                        if first_only && resent > 0 {
                            e.suspect = true;
                            suspects = true;
                        } else {
                            e.queued = true;
                            self.retx.push_back(s);
                            resent += 1;
                            first = first.or(Some((s, e.last_sent)));
                        }
                    }
                }
                s = s.wrapping_add(1);
            }
            self.frto = first_only && resent > 0;
            self.lone_resend = first.filter(|_| first_only && resent == 1 && !suspects).map(|(s, sent)| (s, now, sent));
            self.rto = (self.rto * 2).min(self.timers.max_rto);
            self.rto_deadline = Some(now + self.rto);
        }
        if self.unacked > 0 && self.ack_deadline.is_some_and(|d| d <= now) {
            self.ack_now = true;
        }
        if self.gap_since.is_some_and(|g| g + self.timers.nack_delay <= now) && self.rx_expected != self.rx_end {
            self.nack_now = true;
        }
        if self.last_heard.max(self.last_probe) + self.timers.keepalive <= now {
            self.probe_now = true;
            self.last_probe = now;
        }
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<ChannelEvent> {
        self.events.pop_front()
    }

    /// Whether [`Channel::poll_transmit`] has something to send now.
    pub fn wants_transmit(&self) -> bool {
        self.dead.is_none()
            && (self.closing.is_some()
                || self.echo.is_some()
                || self.probe_now
                || self.ack_now
                || self.nack_now
                || !self.retx.is_empty()
                || (!self.queue.is_empty() && self.has_credit()))
    }

    fn has_credit(&self) -> bool {
        self.tx_next.wrapping_sub(self.tx_base) < self.params.ring as u32
    }

    /// Writes the next frame to send into `buf` (at least the transport's frame capacity, which
    /// must hold a full segment plus [`DATA_FRAME_OVERHEAD`]). For DATA frames the caller fills
    /// in the payload named by [`Transmit::payload`].
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        if self.dead.is_some() {
            return None;
        }
        if let Some(reason) = self.closing {
            let len = Message::Disconnect(Disconnect { reason }).emit(&self.env, buf);
            self.stats.frames_tx += 1;
            self.disconnects_left = self.disconnects_left.saturating_sub(1);
            if self.disconnects_left == 0 {
                self.die(DeadReason::Closed);
            }
            return Some(Transmit { len, payload: None });
        }
        if let Some(echo) = self.echo.take() {
            return Some(self.control(Message::Keepalive(echo), buf));
        }
        if self.nack_now {
            self.nack_now = false;
            self.gap_since = Some(now); // NACK again after another delay if holes remain
            let (arrived, covered) = self.received_bits(self.rx_expected);
            let nack = Nack { base: self.rx_expected, missing: covered & !arrived };
            self.stats.nacks_tx += 1;
            return Some(self.control(Message::Nack(nack), buf));
        }
        let holes = self.rx_expected != self.rx_end;
        let have_sequenced = !self.retx.is_empty() || (!self.queue.is_empty() && self.has_credit());
        if self.ack_now && (holes || self.dup_seen || !have_sequenced) {
            let (sack, _) = self.received_bits(self.rx_expected.wrapping_add(1));
            let ack = Ack { cumulative: self.rx_expected, sack, duplicate: std::mem::take(&mut self.dup_seen) };
            self.acked_all();
            self.stats.acks_tx += 1;
            return Some(self.control(Message::Ack(ack), buf));
        }
        if self.probe_now {
            self.probe_now = false;
            self.probe_nonce = self.probe_nonce.wrapping_add(1);
            self.stats.keepalives_tx += 1;
            let k = Keepalive { nonce: self.probe_nonce, timestamp: now.0, reply: false };
            return Some(self.control(Message::Keepalive(k), buf));
        }
        if let Some(t) = self.retransmit(now, buf) {
            return Some(t);
        }
        if !self.has_credit() {
            return None;
        }
        let frame = self.next_frame()?;
        let s = self.tx_next;
        self.tx_next = s.wrapping_add(1);
        if self.tx_base == s {
            // The ring was empty: the wait for acknowledgements starts now.
            self.last_progress = now;
        }
        self.tx[(s % self.params.ring as u32) as usize] = Some(TxEntry {
            frame,
            first_sent: now,
            last_sent: now,
            retx: 0,
            sacked: false,
            queued: false,
            suspect: false,
        });
        if self.rto_deadline.is_none() {
            self.rto_deadline = Some(now + self.rto);
        }
        Some(self.emit_sequenced(now, frame, s, buf))
    }

    /// The 64 receive positions from `from`: bit `i` of the first value set when `from + i`
    /// has arrived, of the second when it is below `rx_end` (positions past the last arrival
    /// are neither arrived nor missing).
    fn received_bits(&self, from: u32) -> (u64, u64) {
        let ring = self.params.ring as u32;
        let (mut arrived, mut covered) = (0u64, 0u64);
        for i in 0..64u32 {
            let s = from.wrapping_add(i);
            if diff(s, self.rx_end) >= 0 {
                break;
            }
            covered |= 1 << i;
            if self.rx_seen.get((s % ring) as usize) {
                arrived |= 1 << i;
            }
        }
        (arrived, covered)
    }

    /// The next frame queued for retransmission that still needs it, emitted into `buf`.
    fn retransmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        let ring = self.params.ring as u32;
        while let Some(s) = self.retx.pop_front() {
            let Some(e) = self.tx[(s % ring) as usize].as_mut() else { continue };
            e.queued = false;
            if e.sacked || diff(s, self.tx_base) < 0 {
                continue;
            }
            if let TxFrame::Data(h, _) = e.frame {
                // The slot holds another request's data now: the peer reused it, so it had all
                // of this message (a correct peer reuses a slot only then). Resending would send
                // the new request's bytes under the old tag.
                let d = &self.damq[h.damq as usize];
                if d.tag != h.tag || (self.role == Role::Initiator && !d.active) {
                    e.sacked = true;
                    continue;
                }
            }
            e.retx = e.retx.saturating_add(1);
            e.last_sent = now;
            let frame = e.frame;
            self.stats.retransmits += 1;
            return Some(self.emit_sequenced(now, frame, s, buf));
        }
        None
    }

    /// Takes the next new frame off the queue (a whole control frame, or the next segment of
    /// a data message).
    fn next_frame(&mut self) -> Option<TxFrame> {
        Some(match self.queue.front_mut()? {
            Outgoing::Frame(_) => {
                let Some(Outgoing::Frame(f)) = self.queue.pop_front() else { unreachable!() };
                if let TxFrame::Completion(c) = f {
                    // Sent: the initiator may reuse the slot once it has this completion.
                    if let Some(slot) = self.remq.get_mut(c.remq as usize) {
                        if matches!(*slot, RemqSlot::Completing(tag) if tag == c.tag) {
                            *slot = RemqSlot::Free;
                        }
                    }
                }
                f
            }
            Outgoing::DataMessage { damq, tag, length, next, count } => {
                let seg = self.params.segment as u32;
                let offset = *next as u32 * seg;
                let len = seg.min(*length - offset);
                let h = DataHeader {
                    seq: Seq::default(),
                    damq: *damq,
                    seg_index: *next,
                    seg_count: *count,
                    tag: *tag,
                    offset,
                };
                *next += 1;
                if *next == *count {
                    self.queue.pop_front();
                    if let Some(d) = self.damq.get_mut(h.damq as usize) {
                        if d.tag == h.tag {
                            d.sending = false;
                        }
                    }
                }
                TxFrame::Data(h, len)
            }
        })
    }

    fn acked_all(&mut self) {
        self.unacked = 0;
        self.ack_deadline = None;
        self.ack_now = false;
    }

    fn control(&mut self, msg: Message<'_>, buf: &mut [u8]) -> Transmit {
        self.stats.frames_tx += 1;
        Transmit { len: msg.emit(&self.env, buf), payload: None }
    }

    fn emit_sequenced(&mut self, _now: Instant, frame: TxFrame, s: u32, buf: &mut [u8]) -> Transmit {
        let seq = Seq { seq: s, ack: self.rx_expected };
        if self.rx_expected == self.rx_end {
            self.acked_all(); // the piggybacked ack says everything
        }
        self.stats.frames_tx += 1;
        match frame {
            TxFrame::Request(r) => {
                Transmit { len: Message::Request(Request { seq, ..r }).emit(&self.env, buf), payload: None }
            }
            TxFrame::Completion(c) => {
                Transmit { len: Message::Completion(Completion { seq, ..c }).emit(&self.env, buf), payload: None }
            }
            TxFrame::Data(h, len) => {
                assert!(
                    buf.len() >= DATA_FRAME_OVERHEAD + len as usize,
                    "transmit buffer too small for a {len}-byte segment"
                );
                let h = DataHeader { seq, ..h };
                self.stats.payload_tx += len as u64;
                let frame_len = h.emit_in_place(&self.env, len as usize, buf);
                Transmit {
                    len: frame_len,
                    payload: Some(PayloadRef { damq: h.damq, tag: h.tag, offset: h.offset, len }),
                }
            }
        }
    }
}

impl DamqSlot {
    fn reset(&mut self, tag: u64, count: u16, remq: u16) {
        self.generation = self.generation.wrapping_add(1);
        self.tag = tag;
        self.active = true;
        self.count = count;
        self.received = 0;
        self.bytes = 0;
        self.seen.clear_all();
        self.remq = remq;
    }
}
