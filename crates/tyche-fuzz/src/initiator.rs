//! The initiator side: a [`Volume`](tyche_channel::Volume) with requests outstanding, fed by a hostile target.
//!
//! Sans-IO and on a virtual clock, so an input replays exactly. The hostile target sees every
//! frame the volume sends (it learns the requests' slots and tags) and answers with anything:
//! completions and read data for the right request or a stale, unknown or mismatched one, data
//! past the request's length, segments out of range, forged and stale acknowledgements, NACKs,
//! KEEPALIVE, DISCONNECT, handshake replies mid-session, raw, replayed and corrupted frames.
//!
//! Half the two-channel inputs (an odd export size) hold the volume in two parts, a channel each
//! ([`VolumeParts`], hand-offs delivered at once): the hostile target killing one channel makes
//! its part hand its requests to the other, whose answers go back to the origin.
//!
//! Invariants: no panic; read data is placed only inside the buffer of an outstanding read;
//! every request completes at most once; once the target goes quiet every request completes
//! (the channels die and the volume gives up after its no-path timeout).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use tyche_channel::{
    config::params_supported, AtOnce, Connected, Connector, Inbound, Instant, IoRequest, LeastBytes, Timers,
    VolumeConfig, VolumeEvent, VolumeParts,
};
use tyche_wire::{
    Ack, Challenge, ChannelParams, Completion, Data, DataHeader, Disconnect, DisconnectReason, Envelope, Frame,
    Keepalive, MacAddr, Message, Nack, Op, Reject, RejectReason, Request, Seq, Status, DEFAULT_ETHERTYPE,
};

use crate::target::{accept, corrupted, earlier, raw_frame, AckSel, SeqSel, Want};

const FRAME: usize = 9014;
const SESSION: u64 = 0x7e57_0001;
const MAX_ACTIONS: usize = 384;
/// How long the volume waits without a live channel before failing requests.
const NO_PATH: Duration = Duration::from_secs(2);

fn init_mac() -> MacAddr {
    MacAddr::local(0x100)
}
fn target_mac() -> MacAddr {
    MacAddr::local(0x200)
}

/// A fuzz input for the initiator.
#[derive(Debug, Arbitrary)]
pub struct Input {
    want: Want,
    /// Channels of the session (1 or 2).
    two_channels: bool,
    /// Export size in sectors (plus one).
    sectors: u16,
    read_only: bool,
    actions: Vec<Action>,
}

/// Which request the hostile target talks about.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Which {
    /// One the volume sent (by position among those seen, oldest first).
    Seen(u8),
    /// Made up.
    Forged { remq: u16, damq: u16, tag: u64 },
}

/// How a frame about a request is bent.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Bend {
    None,
    Remq(u16),
    Damq(u16),
    Tag(u64),
    /// Another channel than the request's.
    Channel(u16),
}

/// One thing the hostile target (or the application) does.
#[derive(Debug, Clone, Arbitrary)]
pub enum Action {
    /// The application submits a request (validated by the volume).
    Submit {
        op: u8,
        offset: u16,
        sectors: u16,
        fua: bool,
    },
    /// The volume transmits what it has (the target sees it).
    Transmit,
    /// A COMPLETION.
    Complete {
        which: Which,
        bend: Bend,
        status: u8,
        seq: SeqSel,
        ack: AckSel,
    },
    /// One DATA segment of a read.
    Segment {
        which: Which,
        bend: Bend,
        seg_index: u16,
        seg_count: Option<u16>,
        offset: Option<u32>,
        len: Option<u16>,
        seq: SeqSel,
        ack: AckSel,
        fill: u8,
    },
    /// Every segment of a read (as a target should), then its completion.
    Serve {
        which: Which,
        skip: u16,
        complete: bool,
    },
    Ack {
        ch: u16,
        cumulative: AckSel,
        sack: u64,
        duplicate: bool,
    },
    Nack {
        ch: u16,
        base: AckSel,
        missing: u64,
    },
    Keepalive {
        ch: u16,
        nonce: u64,
        timestamp: u64,
        reply: bool,
    },
    Disconnect {
        ch: u16,
        reason: u8,
    },
    /// Handshake replies and other kinds the initiator does not expect mid-session.
    Unexpected {
        ch: u16,
        kind: u8,
        a: u64,
        b: u64,
        seq: SeqSel,
    },
    /// A frame of a valid kind and length whose body is arbitrary.
    Raw {
        ch: u16,
        kind: u8,
        flags: u16,
        session: bool,
        body: Vec<u8>,
    },
    Bytes(Vec<u8>),
    Replay {
        back: u8,
    },
    Corrupt {
        back: u8,
        at: u16,
        xor: u8,
        cut: Option<u16>,
    },
    /// Time passes (milliseconds), timers run.
    Advance(u16),
}

/// A request the volume sent, as the target saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    channel: u16,
    op: Op,
    remq: u16,
    damq: u16,
    tag: u64,
    length: u32,
}

struct Chan {
    next_seq: u32,
    rx_next: u32,
}

struct World {
    /// One part, or two (channel `k` in part `k`).
    vol: VolumeParts<AtOnce>,
    now: Instant,
    params: ChannelParams,
    channels: HashMap<u16, Chan>,
    /// Requests the volume sent, by tag.
    seen: VecDeque<Seen>,
    /// Submitted requests: id → length.
    outstanding: HashMap<u64, (Op, u64)>,
    completed: HashSet<u64>,
    next_id: u64,
    sent: VecDeque<Vec<u8>>,
    buf: Vec<u8>,
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let mut params = input.want.params();
    // An ACCEPT whose parameters the initiator does not support is refused in the handshake
    // (`Connector::receive`), so the channel is only ever built from supported ones.
    if !params_supported(&params) {
        params = Want { raw: false, ..input.want }.params();
    }
    crate::count_input();
    let now = Instant(1_000_000);
    let size = (input.sectors as u64 + 1) * 512;
    let cfg = VolumeConfig {
        export_size: size,
        read_only: input.read_only,
        no_path_timeout: NO_PATH,
        io_timeout: None,
        max_requests: 32,
    };
    let parts = if input.two_channels && input.sectors % 2 == 1 { 2 } else { 1 };
    let scheduler = || -> Box<dyn tyche_channel::Scheduler> { Box::<LeastBytes>::default() };
    let mut vol = VolumeParts::new(cfg, SESSION, DEFAULT_ETHERTYPE, now, parts, scheduler, AtOnce::default());
    let mut channels = HashMap::new();
    for ch in 0..1 + input.two_channels as u16 {
        let env = Envelope {
            dst: target_mac(),
            src: init_mac(),
            ethertype: DEFAULT_ETHERTYPE,
            channel: ch,
            session: SESSION,
        };
        let c = Connector::new(env, "fuzz", params, 1, Duration::from_millis(10), 1, now);
        let conn = Connected {
            session: SESSION,
            params,
            export_size: size,
            block_size: 512,
            export_flags: 0,
            durability_epoch: tyche_wire::DurabilityEpoch::NONE,
            channel_addr: env.dst,
        };
        vol.part(ch as usize % parts).add_channel(c.channel(&conn, Timers::default(), now), None, now);
        channels.insert(ch, Chan { next_seq: 0, rx_next: 0 });
    }
    let mut w = World {
        vol,
        now,
        params,
        channels,
        seen: VecDeque::new(),
        outstanding: HashMap::new(),
        completed: HashSet::new(),
        next_id: 1,
        sent: VecDeque::new(),
        buf: vec![0; 65536 + 64],
    };
    for a in input.actions.iter().take(MAX_ACTIONS) {
        w.act(a);
    }
    w.quiet();
}

impl World {
    fn env(&self, ch: u16) -> Envelope {
        Envelope { dst: init_mac(), src: target_mac(), ethertype: DEFAULT_ETHERTYPE, channel: ch, session: SESSION }
    }

    /// Hands one frame to the volume and checks what it made of it.
    fn deliver(&mut self, frame: &[u8]) {
        if frame.is_empty() {
            return;
        }
        crate::count_frames(1);
        if self.sent.len() == 32 {
            self.sent.pop_front();
        }
        self.sent.push_back(frame.to_vec());
        let mut scratch = Vec::new();
        let part = match Frame::new_checked(frame, DEFAULT_ETHERTYPE) {
            Ok(f) => f.channel() as usize % self.vol.parts().len(),
            Err(_) => 0,
        };
        if let Inbound::Read { id, offset, payload } = self.vol.part(part).handle_frame(self.now, frame, &mut scratch) {
            let Some(&(op, len)) = self.outstanding.get(&id) else {
                panic!("read data placed for request {id}, which is not outstanding");
            };
            assert_eq!(op, Op::Read, "read data placed for request {id}, a {op:?}");
            assert!(
                offset.checked_add(payload.len() as u64).is_some_and(|end| end <= len),
                "read data placed at {offset}+{} in request {id} of {len} bytes",
                payload.len()
            );
        }
        self.events();
    }

    fn events(&mut self) {
        self.vol.settle(self.now);
        while let Some(ev) = self.vol.poll_event() {
            if let VolumeEvent::Completed { id, .. } = ev {
                assert!(self.outstanding.remove(&id).is_some(), "request {id} completed but was not outstanding");
                assert!(self.completed.insert(id), "request {id} completed twice");
            }
        }
    }

    fn emit(&mut self, ch: u16, m: &Message<'_>) {
        let mut buf = std::mem::take(&mut self.buf);
        let len = m.emit(&self.env(ch), &mut buf);
        self.deliver(&buf[..len]);
        self.buf = buf;
    }

    /// The volume sends what it has; the target notes requests and sequence numbers.
    fn transmit(&mut self) {
        let indices: Vec<u16> = self.vol.channel_indices().collect();
        let mut buf = vec![0u8; FRAME];
        for ch in indices {
            for _ in 0..512 {
                let part = ch as usize % self.vol.parts().len();
                let Some(out) = self.vol.part(part).poll_transmit(self.now, ch, &mut buf) else { break };
                let Ok(f) = Frame::new_checked(&buf[..out.len], DEFAULT_ETHERTYPE) else {
                    panic!("the volume sent a malformed frame");
                };
                let Ok(m) = f.parse() else { continue };
                if let (Some(seq), Some(c)) = (f.seq(), self.channels.get_mut(&ch)) {
                    if seq.wrapping_sub(c.rx_next) < (1 << 31) {
                        c.rx_next = seq.wrapping_add(1);
                    }
                }
                if let Message::Request(r) = m {
                    if self.seen.len() == 64 {
                        self.seen.pop_front();
                    }
                    self.seen.push_back(Seen {
                        channel: ch,
                        op: r.op,
                        remq: r.remq,
                        damq: r.damq,
                        tag: r.tag,
                        length: r.length,
                    });
                }
            }
        }
        self.events();
    }

    fn seq(&mut self, ch: u16, s: SeqSel, a: AckSel) -> Seq {
        let c = self.channels.entry(ch).or_insert(Chan { next_seq: 0, rx_next: 0 });
        let next = c.next_seq;
        let seq = match s {
            SeqSel::Next => {
                c.next_seq = next.wrapping_add(1);
                next
            }
            SeqSel::Last => next.wrapping_sub(1),
            SeqSel::Back(n) => next.wrapping_sub(n as u32 + 1),
            SeqSel::Ahead(n) => next.wrapping_add(n as u32 + 1),
            SeqSel::Raw(v) => v,
        };
        let rx = c.rx_next;
        let ack = match a {
            AckSel::Honest => rx,
            AckSel::Behind(n) => rx.wrapping_sub(n as u32 + 1),
            AckSel::Ahead(n) => rx.wrapping_add(n as u32 + 1),
            AckSel::Raw(v) => v,
        };
        Seq { seq, ack }
    }

    /// The request `which` names, bent.
    fn pick(&self, which: Which, bend: Bend) -> Seen {
        let mut s = match which {
            Which::Seen(k) if !self.seen.is_empty() => self.seen[k as usize % self.seen.len()],
            Which::Seen(_) => Seen { channel: 0, op: Op::Read, remq: 0, damq: 0, tag: 1, length: 512 },
            Which::Forged { remq, damq, tag } => Seen { channel: 0, op: Op::Read, remq, damq, tag, length: 512 },
        };
        match bend {
            Bend::None => {}
            Bend::Remq(v) => s.remq = v,
            Bend::Damq(v) => s.damq = v,
            Bend::Tag(v) => s.tag = v,
            Bend::Channel(v) => s.channel = v,
        }
        s
    }

    /// A DATA segment of `header` on `channel`: `len` bytes of `fill`.
    fn segment(&mut self, channel: u16, header: DataHeader, len: usize, fill: u8) {
        let payload = vec![fill; len.min(FRAME - tyche_wire::DATA_FRAME_OVERHEAD)];
        self.emit(channel, &Message::Data(Data { header, payload: &payload }));
    }

    /// Plays one action of the hostile target (or the application).
    fn act(&mut self, a: &Action) {
        match *a {
            Action::Submit { op, offset, sectors, fua } => self.submit(op, offset, sectors, fua),
            Action::Transmit => self.transmit(),
            Action::Complete { which, bend, status, seq, ack } => self.complete(which, bend, status, seq, ack),
            Action::Segment { which, bend, seg_index, seg_count, offset, len, seq, ack, fill } => {
                let s = self.pick(which, bend);
                let seg = self.params.segment as u32;
                let count = seg_count.unwrap_or(s.length.div_ceil(seg).max(1) as u16);
                let offset = offset.unwrap_or((seg_index as u32).wrapping_mul(seg));
                let len = len.map_or(seg.min(s.length.saturating_sub(offset)).max(1) as usize, |l| l as usize);
                let seq = self.seq(s.channel, seq, ack);
                let header = DataHeader { seq, damq: s.damq, seg_index, seg_count: count, tag: s.tag, offset };
                self.segment(s.channel, header, len, fill);
            }
            Action::Serve { which, skip, complete } => self.serve(which, skip, complete),
            Action::Ack { ch, cumulative, sack, duplicate } => {
                let s = self.seq(ch, SeqSel::Raw(0), cumulative);
                self.emit(ch, &Message::Ack(Ack { cumulative: s.ack, sack, duplicate }));
            }
            Action::Nack { ch, base, missing } => {
                let s = self.seq(ch, SeqSel::Raw(0), base);
                self.emit(ch, &Message::Nack(Nack { base: s.ack, missing }));
            }
            Action::Keepalive { ch, nonce, timestamp, reply } => {
                self.emit(ch, &Message::Keepalive(Keepalive { nonce, timestamp, reply }));
            }
            Action::Disconnect { ch, reason } => {
                let reason = DisconnectReason::ALL[reason as usize % DisconnectReason::ALL.len()];
                self.emit(ch, &Message::Disconnect(Disconnect { reason }));
            }
            Action::Unexpected { ch, kind, a, b, seq } => self.unexpected(ch, kind, a, b, seq),
            Action::Raw { ch, kind, flags, session, ref body } => self.raw(ch, kind, flags, session, body),
            Action::Bytes(ref b) => self.deliver(&b[..b.len().min(FRAME)]),
            Action::Replay { back } => self.replay(back),
            Action::Corrupt { back, at, xor, cut } => self.corrupt(back, at, xor, cut),
            Action::Advance(ms) => self.advance(Duration::from_millis(ms as u64 % 5000)),
        }
    }

    /// [`Action::Submit`]: the application submits a request (kept if the volume takes it).
    fn submit(&mut self, op: u8, offset: u16, sectors: u16, fua: bool) {
        let op = Op::ALL[op as usize % Op::ALL.len()];
        let (offset, length) =
            if op == Op::Flush { (0, 0) } else { (offset as u64 * 512, (sectors as u64 % 512 + 1) * 512) };
        let id = self.next_id;
        self.next_id += 1;
        let req = IoRequest { id, op, fua, offset, length, node: None };
        let part = self.vol.submit_part(id as usize);
        if self.vol.part(part).submit(self.now, req).is_ok() {
            self.outstanding.insert(id, (op, length));
        }
        self.events();
    }

    /// [`Action::Complete`]: a COMPLETION for the request `which` names, bent.
    fn complete(&mut self, which: Which, bend: Bend, status: u8, seq: SeqSel, ack: AckSel) {
        let s = self.pick(which, bend);
        let seq = self.seq(s.channel, seq, ack);
        let status = Status::ALL[status as usize % Status::ALL.len()];
        let m = Completion { seq, status, remq: s.remq, damq: s.damq, tag: s.tag };
        self.emit(s.channel, &Message::Completion(m));
    }

    /// [`Action::Serve`]: every segment of a read (but those `skip` names), then maybe its COMPLETION.
    fn serve(&mut self, which: Which, skip: u16, complete: bool) {
        let s = self.pick(which, Bend::None);
        let seg = self.params.segment as u32;
        if s.op == Op::Read {
            let count = s.length.div_ceil(seg).max(1);
            for i in 0..count.min(256) {
                if skip != 0 && i as u16 % 16 == skip % 16 {
                    continue;
                }
                let seq = self.seq(s.channel, SeqSel::Next, AckSel::Honest);
                let len = seg.min(s.length - i * seg) as usize;
                let (seg_index, seg_count, offset) = (i as u16, count as u16, i * seg);
                let header = DataHeader { seq, damq: s.damq, seg_index, seg_count, tag: s.tag, offset };
                self.segment(s.channel, header, len, s.tag as u8);
            }
        }
        if complete {
            let seq = self.seq(s.channel, SeqSel::Next, AckSel::Honest);
            let m = Completion { seq, status: Status::Ok, remq: s.remq, damq: s.damq, tag: s.tag };
            self.emit(s.channel, &Message::Completion(m));
        }
    }

    /// [`Action::Unexpected`]: a handshake reply or another kind the initiator does not expect.
    fn unexpected(&mut self, ch: u16, kind: u8, a: u64, b: u64, seq: SeqSel) {
        let seq = self.seq(ch, seq, AckSel::Honest);
        let p = self.params;
        let m = match kind % 5 {
            0 => Message::Accept(accept(a, b, p)),
            1 => Message::Challenge(Challenge { nonce: a, target_nonce: b }),
            2 => Message::Reject(Reject {
                nonce: a,
                reason: RejectReason::ALL[b as usize % RejectReason::ALL.len()],
                holder: (a & 1 == 1).then(|| tyche_wire::MacAddr::local(b as u32)),
            }),
            3 => Message::Request(Request {
                seq,
                op: Op::Read,
                fua: false,
                remq: a as u16,
                damq: (a >> 16) as u16,
                home: (a >> 32) as u16,
                tag: b,
                floor: 0,
                offset: 0,
                length: 512,
            }),
            _ => Message::Discover(tyche_wire::Discover { nonce: a as u32, start: b as u16 }),
        };
        self.emit(ch, &m);
    }

    /// [`Action::Raw`]: a frame of kind `kind` (its length valid) whose body is `body`, maybe sessionless.
    fn raw(&mut self, ch: u16, kind: u8, flags: u16, session: bool, body: &[u8]) {
        let mut env = self.env(ch);
        if !session {
            env.session = 0;
        }
        let buf = raw_frame(&env, kind, flags, body);
        self.deliver(&buf);
    }

    /// [`Action::Replay`]: a frame delivered earlier (`back` from the last), again.
    fn replay(&mut self, back: u8) {
        if let Some(f) = earlier(&self.sent, back) {
            self.deliver(&f);
        }
    }

    /// [`Action::Corrupt`]: a frame delivered earlier with byte `at` xored and maybe cut short.
    fn corrupt(&mut self, back: u8, at: u16, xor: u8, cut: Option<u16>) {
        if let Some(f) = earlier(&self.sent, back) {
            self.deliver(&corrupted(f, at, xor, cut));
        }
    }

    fn advance(&mut self, by: Duration) {
        self.now = Instant(self.now.0 + by.as_nanos() as u64);
        let due = self.vol.poll_timers().into_iter().chain(self.vol.refresh_at()).min();
        if due.is_some_and(|t| t <= self.now) {
            self.vol.handle_timeout(self.now);
            self.vol.exchange(self.now, |_, _| None);
            self.vol.refresh_due(self.now);
        }
        self.events();
        self.transmit();
    }

    /// The target goes quiet: every request must complete (failed) in bounded time.
    fn quiet(&mut self) {
        self.transmit();
        for _ in 0..400 {
            if self.outstanding.is_empty() {
                break;
            }
            self.advance(Duration::from_millis(50));
        }
        assert!(
            self.outstanding.is_empty(),
            "20 s after the target went quiet, {} requests are still outstanding ({} in the volume)",
            self.outstanding.len(),
            self.vol.outstanding()
        );
    }
}
