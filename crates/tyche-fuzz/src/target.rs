//! The target side: tyched's network loop with RAM exports, an honest session and a hostile one.
//!
//! One input is a fresh [`Harness`] (two in-memory NICs, two small RAM exports, small limits;
//! for half the inputs, by the first byte's top bit, a network thread per NIC, turned in order):
//!
//! 1. the honest initiator (a [`Volume`] on NIC 0, export `honest`) attaches and writes a
//!    pattern;
//! 2. the hostile peer (NIC 1, export `fuzz`, its received frames lent to the target so write
//!    data is kept in frames) opens a session with parameters of the input's choosing;
//! 3. the input's actions run: well-formed and malformed frames of every kind on the hostile's
//!    session (or another: the honest one, none, any), replays and corruptions of what it sent,
//!    turns of the target's loop, clock jumps, honest I/O in between;
//! 4. the honest session reads its pattern back and writes and reads once more: its data must
//!    be intact and it must still be served;
//! 5. the hostile goes quiet and time passes: its session must be reclaimed and every frame the
//!    target kept given back.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use tyche_channel::{
    Channel, Connected, Connector, Inbound, Instant, IoError, IoRequest, LeastBytes, Timers, Volume, VolumeConfig,
    VolumeEvent,
};
use tyche_transport::FrameTransportExt;
use tyche_transport::{FrameTransport, MemLink, MemPort};
use tyche_wire::{
    Ack, ChannelParams, Completion, Connect, Data, DataHeader, Disconnect, DisconnectReason, Envelope, Frame,
    Keepalive, Kind, MacAddr, Message, Nack, Op, Request, Seq, Status, DATA_FRAME_OVERHEAD, DEFAULT_ETHERTYPE, NO_SLOT,
};
use tyched::config::{Limits, NetworkThreads};
use tyched::runtime::Harness;
use tyched::{Config, ExportConfig, Nic};

/// MTU and frame capacity of the in-memory links.
const MTU: usize = 9000;
const FRAME: usize = 9014;

/// A frame from `env` of kind `kind` (its length valid) whose body is `body` (the harnesses'
/// raw frames).
pub(crate) fn raw_frame(env: &Envelope, kind: u8, flags: u16, body: &[u8]) -> Vec<u8> {
    let kind = Kind::ALL[kind as usize % Kind::ALL.len()];
    let len = (kind.fixed_len().max(16) + body.len()).min(FRAME - 14);
    let mut buf = vec![0u8; 14 + len.max(46)];
    env.emit_headers(kind, flags, len, &mut buf);
    let n = body.len().min(len - 16);
    buf[14 + 16..14 + 16 + n].copy_from_slice(&body[..n]);
    buf
}

/// An ACCEPT a hostile peer sends mid-session, made of its two numbers `a` and `b`.
pub(crate) fn accept(a: u64, b: u64, params: tyche_wire::ChannelParams) -> tyche_wire::Accept {
    tyche_wire::Accept {
        nonce: a,
        params,
        export_size: b,
        block_size: 512,
        export_flags: 0,
        proof: None,
        durability_epoch: tyche_wire::DurabilityEpoch([a as u8; 16]),
        channel_mac: tyche_wire::MacAddr([(b as u8) & 0xfe, 0x54, 0, 0, 0, a as u8]),
    }
}

/// The frame `back` from the last of `sent` (counted around), if any was sent.
pub(crate) fn earlier(sent: &VecDeque<Vec<u8>>, back: u8) -> Option<Vec<u8>> {
    let n = sent.len();
    (n > 0).then(|| sent[n - 1 - back as usize % n].clone())
}

/// Frame `f` with byte `at` (counted around) xored with `xor`, and cut short when `cut` says.
pub(crate) fn corrupted(mut f: Vec<u8>, at: u16, xor: u8, cut: Option<u16>) -> Vec<u8> {
    let i = at as usize % f.len();
    f[i] ^= xor;
    if let Some(c) = cut {
        f.truncate(c as usize % (f.len() + 1));
    }
    f
}
/// Frames the target may hold lent from the hostile's link at once.
const LEND: usize = 64;
/// Transmit chunks the target may take for good on each link: its reads go straight into them
/// and stay there until the peer acknowledges them (a hostile that never does holds them).
const TX_LEND: usize = 64;
/// Size of each RAM export.
const EXPORT: u64 = 1 << 20;
/// Bytes of the honest pattern.
const PATTERN: usize = 16 << 10;
/// Offset of the honest pattern.
const PATTERN_AT: u64 = 64 << 10;
/// The honest initiator's host id.
const HONEST_HOST: [u8; 16] = [0x11; 16];
/// Most actions one input runs.
const MAX_ACTIONS: usize = 384;
/// Longest single clock jump.
const MAX_JUMP_MS: u64 = 1000;

fn init_mac(k: usize) -> MacAddr {
    MacAddr::local(0x100 + k as u32)
}
fn target_mac(k: usize) -> MacAddr {
    MacAddr::local(0x200 + k as u32)
}

/// The limits the target grants (small: construction is per input).
fn limits() -> Limits {
    Limits {
        ring: 64,
        remq_slots: 8,
        damq_slots: 8,
        max_io: 64 << 10,
        segment: 4096,
        sessions: 8,
        sessions_per_export: 4,
        sessions_per_mac: 4,
        channels_per_session: 8,
        channels: 32,
        challenges: 64,
        challenges_per_mac: 8,
        slot_memory: tyched::config::Size(8 << 20),
        control_queue: 64,
    }
}

/// What the honest initiator asks for.
fn honest_want() -> ChannelParams {
    ChannelParams { ring: 64, remq_slots: 8, damq_slots: 8, segment: 4096, max_io: 64 << 10, features: 0 }
}

/// Whether the exports have a key (the honest and the hostile initiators both hold it: the
/// hostile breaks the protocol inside sealed frames, and its frames into the honest session
/// are unsealed or sealed with its own keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Arbitrary)]
pub enum Keyed {
    No,
    Auth,
    Encrypt,
}

/// The pre-shared key of keyed inputs.
const KEY: &str = "the fuzzer's pre-shared key";

/// A fuzz input for the target.
#[derive(Debug, Arbitrary)]
pub struct Input {
    /// Keyed exports, maybe encrypted.
    keyed: Keyed,
    /// Parameters the hostile asks for in its first CONNECT.
    want: Want,
    /// Open a second hostile channel (index 1) in the same session.
    second_channel: bool,
    /// What the hostile does.
    actions: Vec<Action>,
}

/// Channel parameters as asked (any values; the target validates).
#[derive(Debug, Clone, Copy, Arbitrary)]
pub struct Want {
    pub(crate) ring: u16,
    pub(crate) remq_slots: u16,
    pub(crate) damq_slots: u16,
    pub(crate) segment: u16,
    pub(crate) max_io: u32,
    /// Use the values as given rather than a sane version of them.
    pub(crate) raw: bool,
}

impl Want {
    pub(crate) fn params(&self) -> ChannelParams {
        if self.raw {
            return ChannelParams {
                ring: self.ring,
                remq_slots: self.remq_slots,
                damq_slots: self.damq_slots,
                segment: self.segment,
                max_io: self.max_io,
                features: 0,
            };
        }
        ChannelParams {
            ring: 1 << (1 + self.ring % 12),
            remq_slots: 1 + self.remq_slots % 64,
            damq_slots: 1 + self.damq_slots % 64,
            segment: 512 << (self.segment % 5),
            max_io: 512 * (1 + self.max_io % 512),
            features: 0,
        }
    }
}

/// Which channel (and session) a frame claims.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Ch {
    /// One of the hostile's open channels.
    Own(u8),
    /// The hostile's session, any channel index.
    Index(u16),
    /// The honest session's channel 0 (from the hostile's MAC).
    Honest,
    /// Any session, any channel.
    Any(u64, u16),
}

/// A sequence number.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum SeqSel {
    /// The next one in order.
    Next,
    /// The one sent last (a reused position).
    Last,
    /// An old one.
    Back(u8),
    /// A future one.
    Ahead(u16),
    /// Any.
    Raw(u32),
}

/// A piggybacked or standalone acknowledgement value.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum AckSel {
    /// What the hostile has received in order.
    Honest,
    /// Less than that (stale).
    Behind(u8),
    /// More than that (forged).
    Ahead(u16),
    /// Any.
    Raw(u32),
}

/// A tag.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum TagSel {
    /// A fresh, increasing one.
    Next,
    /// The last one used.
    Last,
    /// An earlier one.
    Back(u8),
    /// Any.
    Raw(u64),
}

/// A FLOOR value.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum FloorSel {
    Zero,
    /// The tag itself (everything before it finished).
    Tag,
    /// Just below the tag.
    Below(u8),
    /// Huge (above the tag: malformed).
    Huge,
    Raw(u64),
}

impl FloorSel {
    /// The FLOOR value this selects for a request tagged `tag`.
    fn value(self, tag: u64) -> u64 {
        match self {
            FloorSel::Zero => 0,
            FloorSel::Tag => tag,
            FloorSel::Below(n) => tag.saturating_sub(n as u64),
            FloorSel::Huge => u64::MAX,
            FloorSel::Raw(v) => v,
        }
    }
}

/// The `HOME` of a hostile REQUEST.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum HomeSel {
    /// The channel it is sent on (an honest first issue).
    Own,
    /// Any index: another channel of the session, or one it does not have.
    Raw(u16),
}

impl HomeSel {
    /// The channel index this selects for a request sent on channel `own`.
    fn index(self, own: u16) -> u16 {
        match self {
            HomeSel::Own => own,
            HomeSel::Raw(h) => h,
        }
    }
}

/// One thing the hostile does.
#[derive(Debug, Clone, Arbitrary)]
pub enum Action {
    /// A REQUEST with every field chosen.
    Request {
        ch: Ch,
        seq: SeqSel,
        ack: AckSel,
        op: u8,
        fua: bool,
        remq: u16,
        damq: u16,
        tag: TagSel,
        home: HomeSel,
        floor: FloorSel,
        /// In sectors (or raw bytes when `odd`).
        offset: u32,
        /// In sectors (or raw bytes when `odd`).
        length: u32,
        odd: bool,
    },
    /// A DATA segment with every field chosen.
    Data {
        ch: Ch,
        seq: SeqSel,
        ack: AckSel,
        damq: u16,
        seg_index: u16,
        seg_count: u16,
        tag: TagSel,
        offset: u32,
        len: u16,
        fill: u8,
    },
    /// A well-formed WRITE: REQUEST then the segments `mask` selects (all when zero), in order
    /// or reversed, before or after the REQUEST.
    Write {
        ch: Ch,
        remq: u8,
        damq: u8,
        sectors: u16,
        offset: u16,
        mask: u16,
        reverse: bool,
        data_first: bool,
        fua: bool,
    },
    /// A well-formed READ.
    Read { ch: Ch, remq: u8, damq: u8, sectors: u16, offset: u16 },
    /// A well-formed FLUSH, DISCARD or WRITE_ZEROES.
    Range { ch: Ch, remq: u8, op: u8, sectors: u16, offset: u16 },
    /// A standalone ACK (with or without flag DUPLICATE).
    Ack { ch: Ch, cumulative: AckSel, sack: u64, duplicate: bool },
    /// A NACK.
    Nack { ch: Ch, base: AckSel, missing: u64 },
    /// A KEEPALIVE (probe or echo).
    Keepalive { ch: Ch, nonce: u64, timestamp: u64, reply: bool },
    /// A DISCONNECT.
    Disconnect { ch: Ch, reason: u8 },
    /// A CONNECT mid-session (new channel, reconnect, other session, other export).
    Connect { index: u16, session: u8, want: Want, nonce: u64, proof: bool, export: u8 },
    /// Frames only a target sends (COMPLETION, ACCEPT, ...), or DISCOVER.
    Wrong { ch: Ch, kind: u8, a: u64, b: u64, seq: SeqSel },
    /// A frame of a valid kind and length whose body is arbitrary.
    Raw { ch: Ch, kind: u8, flags: u16, body: Vec<u8> },
    /// Arbitrary bytes as a frame (Ethernet header included).
    Bytes(Vec<u8>),
    /// A frame sent earlier, again (stale).
    Replay { back: u8 },
    /// A frame sent earlier with a byte changed and maybe cut short.
    Corrupt { back: u8, at: u16, xor: u8, cut: Option<u16> },
    /// Turns of the target's loop (0: until idle).
    Turn(u8),
    /// The clock jumps (milliseconds, at most [`MAX_JUMP_MS`]).
    Advance(u16),
    /// The honest session writes its pattern again (a new version).
    HonestWrite,
    /// The honest session reads its pattern and checks it.
    HonestRead,
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let u = Unstructured::new(data);
    let Ok(input) = Input::arbitrary_take_rest(u) else { return };
    crate::count_input();
    // Half the inputs run a network thread per NIC (the honest and the hostile session on
    // different threads, each handshake through the shared control), turned in order here.
    let per_nic = data.first().is_some_and(|b| b & 0x80 != 0);
    let mut w = World::new(input.keyed, per_nic);
    w.honest_attach();
    w.honest_write();
    w.hostile_attach(input.want, 0);
    if input.second_channel {
        w.hostile_attach(input.want, 1);
    }
    for a in input.actions.iter().take(MAX_ACTIONS) {
        w.act(a);
    }
    w.settle();
    w.honest_read();
    w.honest_write();
    w.honest_read();
    w.hostile_gone();
}

/// A clock the target and the initiators share: real time plus the jumps.
struct Clock {
    base: std::time::Instant,
    skew: Duration,
}

impl Clock {
    fn now(&self) -> Instant {
        Instant((self.base.elapsed() + self.skew).as_nanos() as u64 + 1)
    }
}

fn send(port: &mut MemPort, frame: &[u8]) {
    let mut once = Some(frame);
    port.send(1, &mut |buf| {
        let f = once.take()?;
        let n = f.len().min(buf.len());
        buf[..n].copy_from_slice(&f[..n]);
        Some(n)
    })
    .expect("in-memory send");
    port.flush().expect("in-memory flush");
    crate::count_frames(1);
}

/// The honest initiator.
struct Honest {
    port: MemPort,
    vol: Option<Volume>,
    bufs: HashMap<u64, Vec<u8>>,
    done: HashMap<u64, Result<(), IoError>>,
    next_id: u64,
    /// Version of the pattern last written (0: none yet).
    version: u8,
    buf: Vec<u8>,
}

/// A hostile channel.
#[derive(Debug, Clone, Copy)]
struct HostileChannel {
    index: u16,
    params: ChannelParams,
    /// Next sequence number to send.
    next_seq: u32,
    /// Every target frame below this was received.
    rx_next: u32,
}

struct Hostile {
    port: MemPort,
    /// Its channels' ends on a keyed export, which seal what it sends on its own channels and
    /// open what the target sends it (nothing else of them is used).
    sealers: HashMap<u16, Channel>,
    scratch: Vec<u8>,
    session: u64,
    channels: Vec<HostileChannel>,
    tags: u64,
    last_tag: u64,
    sent: VecDeque<Vec<u8>>,
    buf: Vec<u8>,
}

/// A well-formed write as [`World::write`] sends it: `sectors` at byte `offset` on slots `remq`
/// and `damq`, its DATA segments those `mask` names (all when 0), in reverse order or not,
/// before or after the request.
#[derive(Debug, Clone, Copy)]
struct WellFormedWrite {
    remq: u16,
    damq: u16,
    sectors: u32,
    offset: u64,
    mask: u16,
    reverse: bool,
    data_first: bool,
    fua: bool,
}

struct World {
    h: Harness,
    clock: Clock,
    honest: Honest,
    hostile: Hostile,
    honest_session: u64,
    keyed: Keyed,
}

impl World {
    fn new(keyed: Keyed, per_nic: bool) -> World {
        let (a0, mut b0) = MemLink::pair((init_mac(0), target_mac(0)), MTU, FRAME, 4096);
        let (a1, mut b1) = MemLink::pair((init_mac(1), target_mac(1)), MTU, FRAME, 4096);
        b1.set_lending(LEND);
        b0.set_tx_lending(TX_LEND);
        b1.set_tx_lending(TX_LEND);
        let config = Config {
            workers: 1,
            io_uring: false,
            limits: limits(),
            exports: ["honest", "fuzz"]
                .iter()
                .map(|name| ExportConfig {
                    key: (keyed != Keyed::No).then(|| KEY.into()),
                    encrypt: keyed == Keyed::Encrypt,
                    ..ExportConfig::ram(name, EXPORT)
                })
                .collect(),
            // The hostile's session must be gone within the 10 s `hostile_gone` waits.
            reclaim_after_ms: 1000,
            network_threads: if per_nic { NetworkThreads::PerNic } else { NetworkThreads::One },
            ..Config::default()
        };
        let nics = vec![
            Nic { name: "mem0".into(), transport: Box::new(b0) },
            Nic { name: "mem1".into(), transport: Box::new(b1) },
        ];
        let h = Harness::with_threads(config, nics).expect("the harness starts");
        World {
            h,
            clock: Clock { base: std::time::Instant::now(), skew: Duration::ZERO },
            honest: Honest {
                port: a0,
                vol: None,
                bufs: HashMap::new(),
                done: HashMap::new(),
                next_id: 1,
                version: 0,
                buf: vec![0; FRAME],
            },
            hostile: Hostile {
                port: a1,
                session: 0,
                channels: Vec::new(),
                tags: 1,
                last_tag: 0,
                sent: VecDeque::new(),
                sealers: HashMap::new(),
                scratch: Vec::new(),
                buf: vec![0; 65536 + 64],
            },
            honest_session: 0,
            keyed,
        }
    }

    fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Moves every clock forward.
    fn advance(&mut self, by: Duration) {
        self.clock.skew += by;
        self.h.advance(by);
    }

    /// Runs one handshake on `port` (the target turning in between).
    fn handshake(
        &mut self,
        hostile: bool,
        env: Envelope,
        export: &str,
        want: ChannelParams,
    ) -> Option<(Connector, Connected)> {
        let mut c =
            Connector::new(env, export, want, 0x5eed ^ env.channel as u64, Duration::from_millis(5), 3, self.now());
        if !hostile {
            // As tyche-init does: its session takes channels only from its host.
            c = c.with_host(HONEST_HOST);
        }
        if self.keyed != Keyed::No {
            c = c.with_key(KEY.as_bytes());
        }
        let mut buf = vec![0u8; FRAME];
        for _ in 0..64 {
            let now = self.now();
            if let Some(len) = c.poll_transmit(now, &mut buf) {
                let port = if hostile { &mut self.hostile.port } else { &mut self.honest.port };
                send(port, &buf[..len]);
            }
            self.h.turn();
            let mut out = None;
            let port = if hostile { &mut self.hostile.port } else { &mut self.honest.port };
            port.recv(64, &mut |bytes| {
                let Ok(f) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
                let Ok(m) = f.parse() else { return };
                if let Some(r) = c.handle(f.src(), f.session(), &m) {
                    out = Some(r);
                }
            })
            .expect("in-memory recv");
            if let Some(r) = out.or(c.outcome()) {
                return r.ok().map(|conn| (c, conn));
            }
            // Handshake retries are on the clock.
            self.advance(Duration::from_millis(5));
            c.handle_timeout(self.now());
        }
        None
    }

    fn honest_attach(&mut self) {
        let env =
            Envelope { dst: target_mac(0), src: init_mac(0), ethertype: DEFAULT_ETHERTYPE, channel: 0, session: 0 };
        let (c, conn) = self.handshake(false, env, "honest", honest_want()).expect("the honest session attaches");
        let now = self.now();
        let cfg = VolumeConfig {
            export_size: conn.export_size,
            read_only: false,
            no_path_timeout: Duration::from_secs(3600),
            io_timeout: None,
            max_requests: 16,
        };
        let mut vol = Volume::new(cfg, conn.session, DEFAULT_ETHERTYPE, Box::<LeastBytes>::default(), now);
        vol.add_channel(c.channel(&conn, Timers::default(), now), None, now);
        self.honest.vol = Some(vol);
        self.honest_session = conn.session;
    }

    /// One round of the honest initiator: receive, timers, events, transmit.
    fn honest_pump(&mut self) -> bool {
        let now = self.now();
        let Honest { port, vol, bufs, done, buf, .. } = &mut self.honest;
        let vol = vol.as_mut().expect("attached");
        let mut scratch = Vec::new();
        let mut moved = port
            .recv(256, &mut |bytes| {
                if let Inbound::Read { id, offset, payload } = vol.handle_frame(now, bytes, &mut scratch) {
                    let b = bufs.get_mut(&id).expect("read data for an outstanding request");
                    b[offset as usize..offset as usize + payload.len()].copy_from_slice(payload);
                }
            })
            .expect("in-memory recv")
            > 0;
        if vol.poll_timeout().is_some_and(|t| t <= now) {
            vol.handle_timeout(now);
        }
        while let Some(ev) = vol.poll_event() {
            if let VolumeEvent::Completed { id, result } = ev {
                assert!(done.insert(id, result).is_none(), "honest request {id} completed twice");
                moved = true;
            }
        }
        let mut frames = 0;
        while let Some(out) = vol.poll_transmit(now, 0, buf) {
            if let Some((id, off, len)) = out.payload {
                buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len as usize]
                    .copy_from_slice(&bufs[&id][off as usize..off as usize + len as usize]);
            }
            let len = vol.seal(0, buf, out.len);
            send(port, &buf[..len]);
            frames += 1;
        }
        moved || frames > 0
    }

    /// Submits an honest request and drives everything until it completes.
    fn honest_io(&mut self, op: Op, offset: u64, data: Vec<u8>) -> (Result<(), IoError>, Vec<u8>) {
        let id = self.honest.next_id;
        self.honest.next_id += 1;
        let req = IoRequest { id, op, fua: false, offset, length: data.len() as u64, node: None };
        let now = self.now();
        self.honest.vol.as_mut().expect("attached").submit(now, req).expect("the honest volume takes a request");
        self.honest.bufs.insert(id, data);
        let mut rounds = 0u32;
        while !self.honest.done.contains_key(&id) {
            rounds += 1;
            assert!(rounds < 4000, "honest request {id} ({op:?}) never completed");
            let busy = self.honest_pump() | self.h.turn();
            self.drain_hostile();
            if !busy && rounds > 50 {
                // Lost or held frames, or memory the hostile holds: let the timers run.
                self.advance(Duration::from_millis(5));
            }
        }
        (self.honest.done.remove(&id).expect("done"), self.honest.bufs.remove(&id).expect("buffer"))
    }

    fn pattern(v: u8) -> Vec<u8> {
        (0..PATTERN).map(|i| (i as u8).wrapping_mul(31).wrapping_add(v) | 1).collect()
    }

    fn honest_write(&mut self) {
        let v = self.honest.version.wrapping_add(1).max(1);
        let (r, _) = self.honest_io(Op::Write, PATTERN_AT, World::pattern(v));
        r.unwrap_or_else(|e| panic!("honest write failed: {e:?}"));
        self.honest.version = v;
    }

    fn honest_read(&mut self) {
        let (r, data) = self.honest_io(Op::Read, PATTERN_AT, vec![0; PATTERN]);
        r.unwrap_or_else(|e| panic!("honest read failed: {e:?}"));
        let want = World::pattern(self.honest.version);
        if data != want {
            let at = data.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            panic!("the honest session's data changed at byte {at} of its pattern");
        }
    }

    /// Opens hostile channel `index` (in the hostile's session once it has one).
    fn hostile_attach(&mut self, want: Want, index: u16) {
        let params = want.params();
        if params.validate().is_err() {
            // The connector refuses to ask for what is malformed; send it raw instead.
            self.connect_raw(index, self.hostile.session, params, 1, false, "fuzz");
            return;
        }
        let env = Envelope {
            dst: target_mac(1),
            src: init_mac(1),
            ethertype: DEFAULT_ETHERTYPE,
            channel: index,
            session: self.hostile.session,
        };
        if let Some((c, conn)) = self.handshake(true, env, "fuzz", params) {
            if self.keyed != Keyed::No {
                let ch = c.channel(&conn, Timers::default(), self.now());
                self.hostile.sealers.insert(index, ch);
            }
            self.hostile.session = conn.session;
            self.hostile.channels.retain(|c| c.index != index);
            self.hostile.channels.push(HostileChannel { index, params: conn.params, next_seq: 0, rx_next: 0 });
        }
    }

    fn connect_raw(&mut self, index: u16, session: u64, params: ChannelParams, nonce: u64, proof: bool, export: &str) {
        let env = self.env(Ch::Any(session, index));
        // No host id: the peer is known by its MAC, another initiator than the honest one.
        let m = Message::Connect(Connect { nonce, params, proof: proof.then_some([7; 32]), export, host: None });
        self.emit(env, &m);
    }

    /// Receives what the target sent the hostile; notes the sequence numbers.
    fn drain_hostile(&mut self) {
        let Hostile { port, channels, session, sealers, scratch, .. } = &mut self.hostile;
        let session = *session;
        port.recv(4096, &mut |bytes| {
            let Ok(f) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
            if f.session() != session {
                return;
            }
            let bytes = match sealers.get_mut(&f.channel()) {
                Some(s) => match s.open(bytes, scratch) {
                    Ok(b) => b,
                    Err(_) => return,
                },
                None => bytes,
            };
            let Ok(f) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
            let (Some(seq), Some(c)) = (f.seq(), channels.iter_mut().find(|c| c.index == f.channel())) else {
                return;
            };
            if seq.wrapping_sub(c.rx_next) < (1 << 31) {
                c.rx_next = seq.wrapping_add(1);
            }
        })
        .expect("in-memory recv");
    }

    fn env(&self, ch: Ch) -> Envelope {
        let (session, channel) = match ch {
            Ch::Own(k) => match self.hostile.channels.get(k as usize % self.hostile.channels.len().max(1)) {
                Some(c) => (self.hostile.session, c.index),
                None => (self.hostile.session, k as u16),
            },
            Ch::Index(i) => (self.hostile.session, i),
            Ch::Honest => (self.honest_session, 0),
            Ch::Any(s, i) => (s, i),
        };
        Envelope { dst: target_mac(1), src: init_mac(1), ethertype: DEFAULT_ETHERTYPE, channel, session }
    }

    /// The hostile channel an envelope names, if it is one of its own.
    fn channel_of(&mut self, env: &Envelope) -> Option<&mut HostileChannel> {
        if env.session != self.hostile.session {
            return None;
        }
        self.hostile.channels.iter_mut().find(|c| c.index == env.channel)
    }

    fn params_of(&mut self, env: &Envelope) -> ChannelParams {
        self.channel_of(env).map_or(limits_params(), |c| c.params)
    }

    fn seq(&mut self, env: &Envelope, s: SeqSel, a: AckSel) -> Seq {
        let (next, rx) = self.channel_of(env).map_or((0, 0), |c| (c.next_seq, c.rx_next));
        let seq = match s {
            SeqSel::Next => next,
            SeqSel::Last => next.wrapping_sub(1),
            SeqSel::Back(n) => next.wrapping_sub(n as u32 + 1),
            SeqSel::Ahead(n) => next.wrapping_add(n as u32 + 1),
            SeqSel::Raw(v) => v,
        };
        if let (SeqSel::Next, Some(c)) = (s, self.channel_of(env)) {
            c.next_seq = c.next_seq.wrapping_add(1);
        }
        let ack = match a {
            AckSel::Honest => rx,
            AckSel::Behind(n) => rx.wrapping_sub(n as u32 + 1),
            AckSel::Ahead(n) => rx.wrapping_add(n as u32 + 1),
            AckSel::Raw(v) => v,
        };
        Seq { seq, ack }
    }

    fn tag(&mut self, t: TagSel) -> u64 {
        let tag = match t {
            TagSel::Next => {
                self.hostile.tags += 1;
                self.hostile.tags
            }
            TagSel::Last => self.hostile.last_tag,
            TagSel::Back(n) => self.hostile.tags.saturating_sub(n as u64 + 1),
            TagSel::Raw(v) => v,
        };
        self.hostile.last_tag = tag;
        tag
    }

    fn emit(&mut self, env: Envelope, m: &Message<'_>) {
        let mut buf = std::mem::take(&mut self.hostile.buf);
        let mut len = m.emit(&env, &mut buf);
        // On its own channels of a keyed export, sealed with its keys (CONNECTs never are).
        if env.session == self.hostile.session && !matches!(m, Message::Connect(_) | Message::Discover(_)) {
            if let Some(ch) = self.hostile.sealers.get_mut(&env.channel) {
                len = ch.seal(&mut buf, len);
            }
        }
        self.hostile_send(&buf[..len]);
        self.hostile.buf = buf;
    }

    fn hostile_send(&mut self, frame: &[u8]) {
        if frame.is_empty() {
            return;
        }
        send(&mut self.hostile.port, frame);
        if self.hostile.sent.len() == 32 {
            self.hostile.sent.pop_front();
        }
        self.hostile.sent.push_back(frame.to_vec());
    }

    fn data_frame(&mut self, env: Envelope, header: DataHeader, payload: &[u8]) {
        let payload = &payload[..payload.len().min(FRAME - DATA_FRAME_OVERHEAD)];
        self.emit(env, &Message::Data(Data { header, payload }));
    }

    /// The well-formed write `w` on `env`.
    fn write(&mut self, env: Envelope, w: WellFormedWrite) {
        let WellFormedWrite { remq, damq, sectors, offset, mask, reverse, data_first, fua } = w;
        let p = self.params_of(&env);
        let length = (sectors * 512).min(p.max_io).max(512);
        let seg = p.segment as u32;
        let count = length.div_ceil(seg);
        let tag = self.tag(TagSel::Next);
        let req_seq = if data_first { None } else { Some(self.seq(&env, SeqSel::Next, AckSel::Honest)) };
        if let Some(seq) = req_seq {
            let r = Request { seq, op: Op::Write, fua, remq, damq, home: env.channel, tag, floor: tag, offset, length };
            self.emit(env, &Message::Request(r));
        }
        let mut order: Vec<u32> = (0..count).filter(|i| mask == 0 || mask & (1 << (i % 16)) != 0).collect();
        if reverse {
            order.reverse();
        }
        let payload = vec![tag as u8 | 1; seg as usize];
        for i in order {
            let seq = self.seq(&env, SeqSel::Next, AckSel::Honest);
            let len = seg.min(length - i * seg) as usize;
            let header = DataHeader { seq, damq, seg_index: i as u16, seg_count: count as u16, tag, offset: i * seg };
            self.data_frame(env, header, &payload[..len]);
        }
        if req_seq.is_none() {
            let seq = self.seq(&env, SeqSel::Next, AckSel::Honest);
            let r = Request { seq, op: Op::Write, fua, remq, damq, home: env.channel, tag, floor: tag, offset, length };
            self.emit(env, &Message::Request(r));
        }
    }

    /// Plays one hostile action.
    fn act(&mut self, a: &Action) {
        match *a {
            Action::Request { ch, seq, ack, op, fua, remq, damq, tag, home, floor, offset, length, odd } => {
                let env = self.env(ch);
                let seq = self.seq(&env, seq, ack);
                let tag = self.tag(tag);
                let floor = floor.value(tag);
                let (offset, length) =
                    if odd { (offset as u64, length) } else { (offset as u64 * 512, length.wrapping_mul(512)) };
                let op = Op::ALL[op as usize % Op::ALL.len()];
                let home = home.index(env.channel);
                let r = Request { seq, op, fua, remq, damq, home, tag, floor, offset, length };
                self.emit(env, &Message::Request(r));
            }
            Action::Data { ch, seq, ack, damq, seg_index, seg_count, tag, offset, len, fill } => {
                let env = self.env(ch);
                let seq = self.seq(&env, seq, ack);
                let tag = self.tag(tag);
                let header = DataHeader { seq, damq, seg_index, seg_count, tag, offset };
                let payload = vec![fill; len as usize % (FRAME - DATA_FRAME_OVERHEAD + 1)];
                self.data_frame(env, header, &payload);
            }
            Action::Write { ch, remq, damq, sectors, offset, mask, reverse, data_first, fua } => {
                let env = self.env(ch);
                let p = self.params_of(&env);
                let (remq, damq) = (remq as u16 % p.remq_slots.max(1), damq as u16 % p.damq_slots.max(1));
                let (sectors, offset) = (u32::from(sectors) % 257, u64::from(offset) * 512);
                self.write(env, WellFormedWrite { remq, damq, sectors, offset, mask, reverse, data_first, fua });
            }
            Action::Read { ch, remq, damq, sectors, offset } => self.read(ch, remq, damq, sectors, offset),
            Action::Range { ch, remq, op, sectors, offset } => self.range(ch, remq, op, sectors, offset),
            Action::Ack { ch, cumulative, sack, duplicate } => {
                let env = self.env(ch);
                let s = self.seq(&env, SeqSel::Raw(0), cumulative);
                self.emit(env, &Message::Ack(Ack { cumulative: s.ack, sack, duplicate }));
            }
            Action::Nack { ch, base, missing } => {
                let env = self.env(ch);
                let s = self.seq(&env, SeqSel::Raw(0), base);
                self.emit(env, &Message::Nack(Nack { base: s.ack, missing }));
            }
            Action::Keepalive { ch, nonce, timestamp, reply } => {
                let env = self.env(ch);
                self.emit(env, &Message::Keepalive(Keepalive { nonce, timestamp, reply }));
            }
            Action::Disconnect { ch, reason } => {
                let env = self.env(ch);
                let reason = DisconnectReason::ALL[reason as usize % DisconnectReason::ALL.len()];
                self.emit(env, &Message::Disconnect(Disconnect { reason }));
            }
            Action::Connect { index, session, want, nonce, proof, export } => {
                self.connect(index, session, want, nonce, proof, export)
            }
            Action::Wrong { ch, kind, a, b, seq } => self.wrong(ch, kind, a, b, seq),
            Action::Raw { ch, kind, flags, ref body } => self.raw(ch, kind, flags, body),
            Action::Bytes(ref b) => {
                let b = &b[..b.len().min(FRAME)];
                self.hostile_send(b);
            }
            Action::Replay { back } => self.replay(back),
            Action::Corrupt { back, at, xor, cut } => self.corrupt(back, at, xor, cut),
            Action::Turn(n) => self.turns(n),
            Action::Advance(ms) => self.jump(ms),
            Action::HonestWrite => self.honest_write(),
            Action::HonestRead => self.honest_read(),
        }
    }

    /// [`Action::Read`]: a well-formed READ (one in three a BLOCK_STATUS) on `ch`.
    fn read(&mut self, ch: Ch, remq: u8, damq: u8, sectors: u16, offset: u16) {
        let env = self.env(ch);
        let p = self.params_of(&env);
        let seq = self.seq(&env, SeqSel::Next, AckSel::Honest);
        let tag = self.tag(TagSel::Next);
        let length = ((sectors as u32 % 257) * 512).clamp(512, p.max_io.max(512));
        // One in three asks for block status instead (the list comes back like read data).
        let op = if sectors % 3 == 0 { Op::BlockStatus } else { Op::Read };
        let r = Request {
            seq,
            op,
            fua: false,
            remq: remq as u16 % p.remq_slots.max(1),
            damq: damq as u16 % p.damq_slots.max(1),
            home: env.channel,
            tag,
            floor: tag,
            offset: offset as u64 * 512,
            length,
        };
        self.emit(env, &Message::Request(r));
    }

    /// [`Action::Range`]: a well-formed FLUSH, DISCARD or WRITE_ZEROES on `ch`.
    fn range(&mut self, ch: Ch, remq: u8, op: u8, sectors: u16, offset: u16) {
        let env = self.env(ch);
        let p = self.params_of(&env);
        let seq = self.seq(&env, SeqSel::Next, AckSel::Honest);
        let tag = self.tag(TagSel::Next);
        let op = [Op::Flush, Op::Discard, Op::WriteZeroes][op as usize % 3];
        let (offset, length) = if op == Op::Flush { (0, 0) } else { (offset as u64 * 512, (sectors as u32 + 1) * 512) };
        let remq = remq as u16 % p.remq_slots.max(1);
        let r =
            Request { seq, op, fua: false, remq, damq: NO_SLOT, home: env.channel, tag, floor: tag, offset, length };
        self.emit(env, &Message::Request(r));
    }

    /// [`Action::Connect`]: a proper handshake where the CONNECT is one, else a raw CONNECT.
    fn connect(&mut self, index: u16, session: u8, want: Want, nonce: u64, proof: bool, export: u8) {
        let session = match session % 4 {
            0 => 0,
            1 => self.hostile.session,
            2 => self.honest_session,
            _ => u64::from(session) << 40 | 0xabcd,
        };
        let export = ["fuzz", "honest", "nope"][export as usize % 3];
        let params = want.params();
        if session == self.hostile.session && !proof && export == "fuzz" && params.validate().is_ok() && index < 4 {
            // A proper handshake (a reconnect of an open channel, or a new one).
            self.hostile_attach(want, index);
        } else {
            self.connect_raw(index, session, params, nonce, proof, export);
        }
    }

    /// [`Action::Wrong`]: a frame only a target sends (or a DISCOVER) on `ch`.
    fn wrong(&mut self, ch: Ch, kind: u8, a: u64, b: u64, seq: SeqSel) {
        let env = self.env(ch);
        let seq = self.seq(&env, seq, AckSel::Honest);
        let p = limits_params();
        let m = match kind % 6 {
            0 => Message::Completion(Completion {
                seq,
                status: Status::ALL[a as usize % Status::ALL.len()],
                remq: a as u16,
                damq: (a >> 16) as u16,
                tag: b,
            }),
            1 => Message::Accept(accept(a, b, p)),
            2 => Message::Challenge(tyche_wire::Challenge { nonce: a, target_nonce: b }),
            3 => Message::Reject(tyche_wire::Reject {
                nonce: a,
                reason: tyche_wire::RejectReason::ALL[b as usize % tyche_wire::RejectReason::ALL.len()],
                holder: None,
            }),
            4 => Message::Discover(tyche_wire::Discover { nonce: a as u32, start: b as u16 }),
            _ => Message::Keepalive(Keepalive { nonce: a, timestamp: b, reply: true }),
        };
        self.emit(env, &m);
    }

    /// [`Action::Raw`]: a frame of kind `kind` (its length valid) whose body is `body`.
    fn raw(&mut self, ch: Ch, kind: u8, flags: u16, body: &[u8]) {
        let buf = raw_frame(&self.env(ch), kind, flags, body);
        self.hostile_send(&buf);
    }

    /// [`Action::Replay`]: a frame sent earlier (`back` from the last), again.
    fn replay(&mut self, back: u8) {
        if let Some(f) = earlier(&self.hostile.sent, back) {
            self.hostile_send(&f);
        }
    }

    /// [`Action::Corrupt`]: a frame sent earlier with byte `at` xored and maybe cut short.
    fn corrupt(&mut self, back: u8, at: u16, xor: u8, cut: Option<u16>) {
        if let Some(f) = earlier(&self.hostile.sent, back) {
            self.hostile_send(&corrupted(f, at, xor, cut));
        }
    }

    /// [`Action::Turn`]: `n` turns of the target's loop (at most 16), or until idle when 0.
    fn turns(&mut self, n: u8) {
        if n == 0 {
            self.settle();
        } else {
            for _ in 0..n.min(16) {
                self.h.turn();
                self.drain_hostile();
            }
        }
    }

    /// [`Action::Advance`]: the clock jumps `ms` (mod [`MAX_JUMP_MS`] + 1) in settled steps.
    fn jump(&mut self, ms: u16) {
        // In steps the honest session keeps its channel alive through (keepalives).
        let mut left = ms as u64 % (MAX_JUMP_MS + 1);
        while left > 0 {
            let step = left.min(200);
            left -= step;
            self.advance(Duration::from_millis(step));
            self.settle();
        }
    }

    /// Turns until nothing moves (bounded).
    fn settle(&mut self) {
        for _ in 0..64 {
            let busy = self.h.turn() | self.honest_pump();
            self.drain_hostile();
            if !busy {
                break;
            }
        }
    }

    /// The hostile goes quiet: time passes (the honest session alive), its session must go and
    /// everything it made the target keep come back.
    fn hostile_gone(&mut self) {
        for _ in 0..40 {
            self.advance(Duration::from_millis(250));
            self.settle();
            let s = self.h.snapshot();
            if s.sessions <= 1 && s.leases_held == 0 && s.nics[1].leases_out == 0 {
                return;
            }
        }
        let s = self.h.snapshot();
        panic!(
            "10 s after the hostile went quiet the target still holds {} sessions, {} kept frames, {} lent on its link",
            s.sessions, s.leases_held, s.nics[1].leases_out
        );
    }
}

/// The target's limits as channel parameters (for frames on channels the hostile does not own).
fn limits_params() -> ChannelParams {
    let l = limits();
    ChannelParams {
        ring: l.ring,
        remq_slots: l.remq_slots,
        damq_slots: l.damq_slots,
        segment: l.segment,
        max_io: l.max_io,
        features: 0,
    }
}
