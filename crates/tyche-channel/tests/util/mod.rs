//! A `Pair` harness in the style of quinn-proto's `tests/util.rs`: an initiator [`Volume`] and a
//! target [`TargetSession`] joined by one frame queue per direction, on a virtual clock.
//!
//! Every frame either end sends goes through [`Pair::fault`], which decides its fate (deliver,
//! drop, duplicate, hold, delay); held frames wait in [`Pair::held`] until the test releases them.
//! Payloads are real bytes: the initiator's request buffers live in [`Pair::bufs`] (by request
//! id), the target's `damq` slots in [`Pair::damq_mem`], the export in [`Pair::storage`].
#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tyche_channel::auth::Sealer;
use tyche_channel::{Channel, DropReason, FrameDrop, Role};
use tyche_channel::{
    ExportGeometry, Inbound, Instant, IoError, IoRequest, RoundRobin, TargetEvent, TargetInbound, TargetSession,
    Timers, Volume, VolumeConfig, VolumeEvent,
};
use tyche_wire::{
    ChannelParams, DurabilityEpoch, Envelope, Frame, Kind, MacAddr, Message, Op, Request, Status, DATA_FRAME_OVERHEAD,
    DEFAULT_ETHERTYPE,
};

/// Session id used by every pair.
pub const SESSION: u64 = 0x5e55_1011;
/// Most steps a drive may take before the harness declares it stuck.
const MAX_STEPS: usize = 200_000;

/// Direction of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    /// Initiator to target.
    ToTarget,
    /// Target to initiator.
    ToInitiator,
}

/// A frame on the wire.
#[derive(Debug, Clone)]
pub struct Packet {
    /// When it arrives.
    pub at: Instant,
    /// Which way it goes.
    pub dir: Dir,
    /// The Ethernet frame.
    pub bytes: Vec<u8>,
}

impl Packet {
    /// The checked frame.
    pub fn frame(&self) -> Frame<&[u8]> {
        Frame::new_checked(&self.bytes[..], DEFAULT_ETHERTYPE).expect("harness frames are valid")
    }
    /// Message kind.
    pub fn kind(&self) -> Kind {
        self.frame().kind()
    }
    /// Channel index.
    pub fn channel(&self) -> u16 {
        self.frame().channel()
    }
    /// Parsed message.
    pub fn msg(&self) -> Message<'_> {
        let f = Frame::new_checked(&self.bytes[..], DEFAULT_ETHERTYPE).expect("valid");
        f.parse_borrowed().expect("harness frames parse")
    }
    /// Ring position of a sequenced frame.
    pub fn seq(&self) -> Option<u32> {
        self.frame().seq()
    }
    /// The tag of a REQUEST, COMPLETION or DATA frame.
    pub fn tag(&self) -> Option<u64> {
        match self.msg() {
            Message::Request(r) => Some(r.tag),
            Message::Completion(c) => Some(c.tag),
            Message::Data(d) => Some(d.header.tag),
            _ => None,
        }
    }
}

/// What happens to a frame just sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Arrives after the link latency.
    Deliver,
    /// Lost.
    Drop,
    /// Arrives twice.
    Duplicate,
    /// Kept in [`Pair::held`] until released.
    Hold,
    /// Arrives this much later than usual (reordering).
    Delay(Duration),
    /// Arrives with the byte at this offset flipped (corruption the Ethernet FCS missed).
    Corrupt(usize),
}

/// Decides each frame's fate.
pub type Fault = Box<dyn FnMut(&Packet) -> Fate>;

/// Settings of a pair.
#[derive(Debug, Clone, Copy)]
pub struct PairConfig {
    /// Channels (paths).
    pub paths: u16,
    /// Parameters of every channel.
    pub params: ChannelParams,
    /// Initiator timers.
    pub timers: Timers,
    /// Target timers.
    pub target_timers: Timers,
    /// One-way latency.
    pub latency: Duration,
    /// Export size.
    pub export_size: u64,
    /// Read-only export.
    pub read_only: bool,
    /// Volume's `no_path_timeout`.
    pub no_path_timeout: Duration,
    /// Volume's `io_timeout`.
    pub io_timeout: Option<Duration>,
    /// Volume's `max_requests`.
    pub max_requests: usize,
    /// Channels of a keyed export: `Some(encrypt)` seals every frame ([`Sealer`]).
    pub seal: Option<bool>,
    /// The durability epoch the target's ACCEPTs carry: initiator channels opened from now on
    /// get it ([`Channel::with_durability_epoch`]).
    pub epoch: DurabilityEpoch,
    /// Frames to the target longer than this many bytes arrive in pieces of it, each in a
    /// buffer of its own (a multi-buffer link), through `TargetSession::handle_frame_pieces`.
    pub pieces: Option<usize>,
}

/// Timers scaled to a 10 µs link.
pub fn test_timers() -> Timers {
    Timers {
        initial_rto: Duration::from_millis(1),
        min_rto: Duration::from_micros(200),
        max_rto: Duration::from_millis(8),
        ack_delay: Duration::from_micros(20),
        ack_every: 4,
        nack_delay: Duration::from_micros(100),
        keepalive: Duration::from_millis(20),
        dead_after: Duration::from_millis(100),
    }
}

impl Default for PairConfig {
    fn default() -> Self {
        PairConfig {
            paths: 1,
            params: ChannelParams {
                ring: 64,
                remq_slots: 16,
                damq_slots: 16,
                segment: 1024,
                max_io: 64 << 10,
                features: 0,
            },
            timers: test_timers(),
            // The target waits longer before reclaiming a channel than the initiator waits
            // before failing over, so late copies can still reach a live target channel.
            target_timers: Timers { dead_after: Duration::from_secs(1), ..test_timers() },
            latency: Duration::from_micros(10),
            export_size: 4 << 20,
            read_only: false,
            no_path_timeout: Duration::from_millis(50),
            io_timeout: None,
            max_requests: 64,
            seal: None,
            epoch: DurabilityEpoch::NONE,
            pieces: None,
        }
    }
}

/// MAC of the initiator NIC of path `k`.
pub fn initiator_mac(k: u16) -> MacAddr {
    MacAddr::local(0x100 + k as u32)
}
/// MAC of the target NIC of path `k`.
pub fn target_mac(k: u16) -> MacAddr {
    MacAddr::local(0x200 + k as u32)
}

/// Initiator envelope of path `k`.
pub fn initiator_env(k: u16) -> Envelope {
    Envelope { dst: target_mac(k), src: initiator_mac(k), ethertype: DEFAULT_ETHERTYPE, channel: k, session: SESSION }
}

/// A raw channel pair (initiator end, target end) for path 0, for tests that feed messages by
/// hand.
pub fn raw_channels(params: ChannelParams, now: Instant) -> (Channel, Channel) {
    let env = initiator_env(0);
    (
        Channel::new(Role::Initiator, env, params, test_timers(), now),
        Channel::new(Role::Target, env.reply(), params, test_timers(), now),
    )
}

/// An initiator and a target on a virtual network.
pub struct Pair {
    /// Settings.
    pub cfg: PairConfig,
    /// Virtual clock.
    pub now: Instant,
    /// The initiator.
    pub volume: Volume,
    /// The target.
    pub target: TargetSession,
    /// Frames in flight, in send order.
    pub wire: VecDeque<Packet>,
    /// Frames held by [`Fate::Hold`].
    pub held: Vec<Packet>,
    /// Every frame sent, in order (before its fate).
    pub sent: Vec<Packet>,
    /// The fate of each frame sent.
    pub fault: Fault,
    /// Paths whose frames are all lost (both directions).
    pub cut: Vec<u16>,
    /// Initiator request buffers by id.
    pub bufs: HashMap<u64, Vec<u8>>,
    /// Target `damq` slot memory by (channel, slot).
    pub damq_mem: HashMap<(u16, u16), Vec<u8>>,
    /// The export.
    pub storage: Vec<u8>,
    /// Whether the target executes requests as soon as they are handed over.
    pub auto_execute: bool,
    /// Requests handed over and not yet executed (when `auto_execute` is off).
    pub to_execute: VecDeque<(u16, Request)>,
    /// Every request the target handed over for execution, in order.
    pub executed: Vec<(u16, Request)>,
    /// Completed requests, in order, with the time they completed.
    pub completed: Vec<(u64, Result<(), IoError>, Instant)>,
    /// Channel deaths seen by the volume: (channel, reissued, time).
    pub volume_dead: Vec<(u16, tyche_channel::DeadReason, usize, Instant)>,
    /// Channels the volume closed because the target answered ABORTED on them.
    pub volume_aborted: Vec<(u16, Instant)>,
    /// Channel deaths seen by the target.
    pub target_dead: Vec<(u16, tyche_channel::DeadReason, Instant)>,
    /// Frames dropped by the initiator's channels.
    pub initiator_drops: Vec<FrameDrop>,
    /// Frames dropped by the target's channels.
    pub target_drops: Vec<FrameDrop>,
    /// Highest cumulative ack each side has received, per (direction of the acked data, channel).
    acked: HashMap<(Dir, u16), u32>,
    /// Most unacknowledged frames seen on any channel of either end after a poll.
    pub max_unacked: u32,
    /// Last time a frame reached the initiator, and the target.
    pub last_rx: HashMap<Dir, Instant>,
    buf: Vec<u8>,
    scratch: Vec<u8>,
    gather: Vec<u8>,
    /// Frames the target got in more than one piece, and write payloads it got in more than one.
    pub multi_piece_frames: u64,
    pub multi_piece_payloads: u64,
    /// Channels opened so far (each keyed one gets keys of its own).
    opened: u8,
}

/// Both ends of a channel: sealed with keys of their own (as a new handshake gives) when the
/// pair is keyed.
fn channel_pair(
    cfg: &PairConfig,
    env: Envelope,
    params: ChannelParams,
    now: Instant,
    opened: &mut u8,
) -> (Channel, Channel) {
    let i = Channel::new(Role::Initiator, env, params, cfg.timers, now).with_durability_epoch(cfg.epoch);
    let t = Channel::new(Role::Target, env.reply(), params, cfg.target_timers, now);
    *opened = opened.wrapping_add(1);
    match cfg.seal {
        None => (i, t),
        Some(encrypt) => {
            let proof = [*opened; 32];
            (
                i.with_sealer(Sealer::derive(KEY, &proof, Role::Initiator, encrypt)),
                t.with_sealer(Sealer::derive(KEY, &proof, Role::Target, encrypt)),
            )
        }
    }
}

/// The pre-shared key of a keyed pair.
pub const KEY: &[u8] = b"a key of at least sixteen bytes";

impl Pair {
    /// A pair with the default settings.
    pub fn new() -> Self {
        Pair::with(PairConfig::default())
    }

    /// A pair with `cfg`, channels open.
    pub fn with(cfg: PairConfig) -> Self {
        let now = Instant(1_000_000);
        let vcfg = VolumeConfig {
            export_size: cfg.export_size,
            read_only: cfg.read_only,
            no_path_timeout: cfg.no_path_timeout,
            io_timeout: cfg.io_timeout,
            max_requests: cfg.max_requests,
        };
        let mut volume = Volume::new(vcfg, SESSION, DEFAULT_ETHERTYPE, Box::<RoundRobin>::default(), now);
        let geometry = ExportGeometry { size: cfg.export_size, read_only: cfg.read_only, discard: true };
        let mut target = TargetSession::new(SESSION, DEFAULT_ETHERTYPE, geometry);
        let mut opened = 0;
        for k in 0..cfg.paths {
            let env = initiator_env(k);
            let (i, t) = channel_pair(&cfg, env, cfg.params, now, &mut opened);
            volume.add_channel(i, None, now);
            target.add_channel(t);
        }
        Pair {
            opened,
            cfg,
            now,
            volume,
            target,
            wire: VecDeque::new(),
            held: Vec::new(),
            sent: Vec::new(),
            fault: Box::new(|_| Fate::Deliver),
            cut: Vec::new(),
            bufs: HashMap::new(),
            damq_mem: HashMap::new(),
            storage: vec![0; cfg.export_size as usize],
            auto_execute: true,
            to_execute: VecDeque::new(),
            executed: Vec::new(),
            completed: Vec::new(),
            volume_dead: Vec::new(),
            volume_aborted: Vec::new(),
            target_dead: Vec::new(),
            initiator_drops: Vec::new(),
            target_drops: Vec::new(),
            acked: HashMap::new(),
            max_unacked: 0,
            last_rx: HashMap::new(),
            buf: vec![0; 16384],
            scratch: Vec::new(),
            gather: Vec::new(),
            multi_piece_frames: 0,
            multi_piece_payloads: 0,
        }
    }

    /// Opens (or reopens, replacing both ends) channel `k` with `params`, as a reconnect would.
    pub fn open_channel(&mut self, k: u16, params: ChannelParams) {
        let env = initiator_env(k);
        let now = self.now;
        let (i, t) = channel_pair(&self.cfg, env, params, now, &mut self.opened);
        self.volume.add_channel(i, None, now);
        self.target.add_channel(t);
        // Fresh sequence spaces.
        self.acked.remove(&(Dir::ToTarget, k));
        self.acked.remove(&(Dir::ToInitiator, k));
        self.collect();
    }

    /// Replaces the target by a fresh process that knows session `session` only (a restart:
    /// every session and ledger is lost, the export's contents stay). Frames still on the wire
    /// reach the new target.
    pub fn restart_target(&mut self, session: u64) {
        let geometry = ExportGeometry { size: self.cfg.export_size, read_only: self.cfg.read_only, discard: true };
        self.target = TargetSession::new(session, DEFAULT_ETHERTYPE, geometry);
        self.damq_mem.clear();
        self.to_execute.clear();
        self.acked.clear();
    }

    /// Opens channel `k` of session `session` on both ends (after [`Volume::resume`]).
    pub fn open_session_channel(&mut self, k: u16, session: u64) {
        let env = Envelope { session, ..initiator_env(k) };
        let (now, params) = (self.now, self.cfg.params);
        let (i, t) = channel_pair(&self.cfg, env, params, now, &mut self.opened);
        self.volume.add_channel(i, None, now);
        self.target.add_channel(t);
        self.acked.remove(&(Dir::ToTarget, k));
        self.acked.remove(&(Dir::ToInitiator, k));
        self.collect();
    }

    /// The initiator's channel `k`.
    pub fn ich(&self, k: u16) -> &Channel {
        self.volume.channel(k).expect("initiator channel exists")
    }
    /// The target's channel `k`.
    pub fn tch(&self, k: u16) -> &Channel {
        self.target.channel(k).expect("target channel exists")
    }

    // ------------------------------------------------------------------------------------------
    // Requests.

    /// Submits a write of `data` at `offset` as request `id`.
    pub fn write(&mut self, id: u64, offset: u64, data: &[u8]) {
        self.bufs.insert(id, data.to_vec());
        let req = IoRequest { id, op: Op::Write, fua: false, offset, length: data.len() as u64, node: None };
        self.volume.submit(self.now, req).unwrap_or_else(|e| panic!("write {id} refused: {e:?}"));
        self.collect();
    }

    /// Submits a read of `len` bytes at `offset` as request `id`.
    pub fn read(&mut self, id: u64, offset: u64, len: u64) {
        self.bufs.insert(id, vec![0xEE; len as usize]);
        let req = IoRequest { id, op: Op::Read, fua: false, offset, length: len, node: None };
        self.volume.submit(self.now, req).unwrap_or_else(|e| panic!("read {id} refused: {e:?}"));
        self.collect();
    }

    /// Submits a FLUSH as request `id`.
    pub fn flush(&mut self, id: u64) {
        let req = IoRequest { id, op: Op::Flush, fua: false, offset: 0, length: 0, node: None };
        self.volume.submit(self.now, req).unwrap_or_else(|e| panic!("flush {id} refused: {e:?}"));
        self.collect();
    }

    /// The outcome of request `id`, if it completed.
    pub fn result(&self, id: u64) -> Option<Result<(), IoError>> {
        let mut it = self.completed.iter().filter(|c| c.0 == id);
        let first = it.next().map(|c| c.1);
        assert!(it.next().is_none(), "request {id} completed more than once");
        first
    }

    /// Panics unless request `id` completed successfully.
    pub fn expect_ok(&self, id: u64) {
        assert_eq!(self.result(id), Some(Ok(())), "request {id}");
    }

    /// How many times the target was asked to execute `tag`.
    pub fn executions(&self, tag: u64) -> usize {
        self.executed.iter().filter(|(_, r)| r.tag == tag).count()
    }

    // ------------------------------------------------------------------------------------------
    // Driving.

    /// One round at the current time: timers, transmissions, deliveries. Returns whether
    /// anything happened.
    pub fn step(&mut self) -> bool {
        let mut busy = false;
        let now = self.now;
        if self.volume.poll_timeout().is_some_and(|t| t <= now) {
            self.volume.handle_timeout(now);
            busy = true;
        }
        if self.target.poll_timeout().is_some_and(|t| t <= now) {
            self.target.handle_timeout(now);
            busy = true;
        }
        self.collect();
        busy |= self.transmit();
        busy |= self.deliver();
        busy
    }

    /// Time of the next thing that will happen on its own.
    pub fn next_event(&self) -> Option<Instant> {
        [self.wire.iter().map(|p| p.at).min(), self.volume.poll_timeout(), self.target.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Steps, advancing the clock from event to event, until `done` holds. Panics (naming
    /// `what`) if it does not within the step bound.
    pub fn drive_until(&mut self, what: &str, mut done: impl FnMut(&Pair) -> bool) {
        for _ in 0..MAX_STEPS {
            if done(self) {
                return;
            }
            if !self.step() {
                if done(self) {
                    return;
                }
                match self.next_event() {
                    Some(t) => self.now = self.now.max(t),
                    None => panic!("nothing left to happen at {:?} and still not {what}", self.now),
                }
            }
        }
        panic!("did not settle ({what}) within {MAX_STEPS} steps; now {:?}", self.now);
    }

    /// Drives until quiet: nothing on the wire, nothing outstanding, every live channel has all
    /// its frames acknowledged and nothing to send.
    pub fn drive(&mut self) {
        self.drive_until("quiet", Pair::quiet);
    }

    /// Whether nothing is left to do.
    pub fn quiet(&self) -> bool {
        let idle = |c: &Channel| c.dead().is_some() || (c.unacked_frames() == 0 && !c.wants_transmit());
        self.wire.is_empty()
            && self.volume.outstanding() == 0
            && self.to_execute.is_empty()
            && self.volume.channel_indices().all(|i| idle(self.ich(i)))
            && self.target.channel_indices().all(|i| idle(self.tch(i)))
    }

    /// Drives for `d` of virtual time (never panics for lack of progress).
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        for _ in 0..MAX_STEPS {
            if !self.step() {
                match self.next_event() {
                    Some(t) if t <= end => self.now = self.now.max(t),
                    _ => {
                        self.now = end;
                        self.step();
                        return;
                    }
                }
            }
        }
        panic!("run_for({d:?}) did not finish within {MAX_STEPS} steps");
    }

    /// Puts every held frame back on the wire, arriving now, in the order given by `order`
    /// (indices into [`Pair::held`]); `None` keeps the order they were held in.
    pub fn release_held(&mut self, order: Option<&[usize]>) {
        let held = std::mem::take(&mut self.held);
        let idx: Vec<usize> = order.map_or_else(|| (0..held.len()).collect(), <[usize]>::to_vec);
        for i in idx {
            let mut p = held[i].clone();
            p.at = self.now;
            self.wire.push_back(p);
        }
    }

    /// Executes the target's oldest pending request now.
    pub fn execute_one(&mut self) {
        let (ch, r) = self.to_execute.pop_front().expect("a request to execute");
        self.execute(ch, r);
    }

    fn execute(&mut self, ch: u16, r: Request) {
        let (start, len) = (r.offset as usize, r.length as usize);
        let max_io = self.cfg.params.max_io as usize;
        match r.op {
            Op::Write => {
                let mem = self.damq_mem.get(&(ch, r.damq)).expect("write data placed");
                self.storage[start..start + len].copy_from_slice(&mem[..len]);
            }
            Op::Read => {
                let mem = self.damq_mem.entry((ch, r.damq)).or_insert_with(|| vec![0; max_io]);
                mem[..len].copy_from_slice(&self.storage[start..start + len]);
            }
            Op::Discard | Op::WriteZeroes => self.storage[start..start + len].fill(0),
            Op::Flush => {}
            Op::BlockStatus => {
                // Sectors of zeroes are holes.
                let mem = self.damq_mem.entry((ch, r.damq)).or_insert_with(|| vec![0; max_io]);
                let extents = self.storage[start..start + len].chunks(512).map(|c| tyche_wire::Extent {
                    length: c.len() as u64,
                    flags: if c.iter().all(|&b| b == 0) { 3 } else { 0 },
                });
                tyche_wire::emit_block_status(extents, mem);
            }
        }
        assert!(self.target.complete(ch, &r, Status::Ok), "target completed a request it did not hand out");
        self.collect();
    }

    /// Moves events out of both ends into the harness's records (and executes, if automatic).
    pub fn collect(&mut self) {
        while let Some(ev) = self.volume.poll_event() {
            match ev {
                VolumeEvent::Completed { id, result } => self.completed.push((id, result, self.now)),
                VolumeEvent::ChannelDead { channel, reason, reissued } => {
                    self.volume_dead.push((channel, reason, reissued, self.now))
                }
                VolumeEvent::ChannelAborted { channel } => self.volume_aborted.push((channel, self.now)),
            }
        }
        while let Some(ev) = self.target.poll_event() {
            match ev {
                TargetEvent::Execute { channel, request, .. } => {
                    self.executed.push((channel, request));
                    if self.auto_execute {
                        self.execute(channel, request);
                    } else {
                        self.to_execute.push_back((channel, request));
                    }
                }
                TargetEvent::ChannelDead { channel, reason } => self.target_dead.push((channel, reason, self.now)),
            }
        }
    }

    /// Puts a frame on the wire as an attacker would: not recorded as sent, no fault applied.
    pub fn inject(&mut self, dir: Dir, bytes: Vec<u8>) {
        self.wire.push_back(Packet { at: self.now + self.cfg.latency, dir, bytes });
    }

    fn send(&mut self, dir: Dir, bytes: Vec<u8>) {
        let p = Packet { at: self.now + self.cfg.latency, dir, bytes };
        // Credit flow control: a sequenced frame never names a position beyond the receiver's
        // window as far as the sender knows it (not checked through encryption).
        let encrypted = self.cfg.seal == Some(true);
        if let Some(seq) = p.seq().filter(|_| !encrypted) {
            let cum = self.acked.get(&(dir, p.channel())).copied().unwrap_or(0);
            assert!(
                seq.wrapping_sub(cum) < self.cfg.params.ring as u32,
                "{dir:?} channel {} sent seq {seq} with the peer's cumulative ack at {cum}",
                p.channel()
            );
        }
        self.sent.push(p.clone());
        if self.cut.contains(&p.channel()) {
            return;
        }
        match (self.fault)(&p) {
            Fate::Deliver => self.wire.push_back(p),
            Fate::Drop => {}
            Fate::Duplicate => {
                self.wire.push_back(p.clone());
                self.wire.push_back(p);
            }
            Fate::Hold => self.held.push(p),
            Fate::Delay(d) => self.wire.push_back(Packet { at: p.at + d, ..p }),
            Fate::Corrupt(at) => {
                let mut p = p;
                if let Some(b) = p.bytes.get_mut(at) {
                    *b ^= 0x40;
                }
                self.wire.push_back(p);
            }
        }
    }

    fn transmit(&mut self) -> bool {
        let now = self.now;
        let mut any = false;
        let mut buf = std::mem::take(&mut self.buf);
        let indices: Vec<u16> = self.volume.channel_indices().collect();
        for ch in indices.iter().copied() {
            while let Some(out) = self.volume.poll_transmit(now, ch, &mut buf) {
                any = true;
                self.max_unacked = self.max_unacked.max(self.ich(ch).unacked_frames());
                if let Some((id, offset, len)) = out.payload {
                    let b = &self.bufs[&id];
                    buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len as usize]
                        .copy_from_slice(&b[offset as usize..offset as usize + len as usize]);
                }
                let len = self.volume.seal(ch, &mut buf, out.len);
                self.send(Dir::ToTarget, buf[..len].to_vec());
            }
            self.collect();
        }
        let indices: Vec<u16> = self.target.channel_indices().collect();
        for ch in indices {
            while let Some(t) = self.target.poll_transmit(now, ch, &mut buf) {
                any = true;
                self.max_unacked = self.max_unacked.max(self.tch(ch).unacked_frames());
                if let Some(p) = t.payload {
                    let mem = &self.damq_mem[&(ch, p.damq)];
                    buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + p.len as usize]
                        .copy_from_slice(&mem[p.offset as usize..(p.offset + p.len) as usize]);
                }
                let len = self.target.seal(ch, &mut buf, t.len);
                self.send(Dir::ToInitiator, buf[..len].to_vec());
            }
            self.collect();
        }
        self.buf = buf;
        any
    }

    /// Delivers every frame due now, in wire order.
    pub fn deliver(&mut self) -> bool {
        let mut any = false;
        let max_io = self.cfg.params.max_io as usize;
        while let Some(i) = self.wire.iter().position(|p| p.at <= self.now) {
            let p = self.wire.remove(i).expect("found");
            any = true;
            self.note_ack(&p);
            self.last_rx.insert(p.dir, self.now);
            match p.dir {
                Dir::ToTarget if self.cfg.pieces.is_some_and(|n| p.bytes.len() > n) => {
                    let n = self.cfg.pieces.expect("checked");
                    // Each piece in a buffer of its own.
                    let owned: Vec<Vec<u8>> = p.bytes.chunks(n).map(<[u8]>::to_vec).collect();
                    let pieces: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
                    self.multi_piece_frames += 1;
                    match self.target.handle_frame_pieces(self.now, &pieces, &mut self.scratch, &mut self.gather) {
                        TargetInbound::Write { channel, damq, offset, payload, .. } => {
                            self.multi_piece_payloads += u64::from(payload.parts().len() > 1);
                            let mem = self.damq_mem.entry((channel, damq)).or_insert_with(|| vec![0; max_io]);
                            let mut at = offset as usize;
                            for part in payload.parts() {
                                mem[at..at + part.len()].copy_from_slice(part);
                                at += part.len();
                            }
                        }
                        TargetInbound::Dropped(d) => self.target_drops.push(d),
                        TargetInbound::Consumed => {}
                    }
                }
                Dir::ToTarget => match self.target.handle_frame(self.now, &p.bytes, &mut self.scratch) {
                    TargetInbound::Write { channel, damq, offset, payload, .. } => {
                        let mem = self.damq_mem.entry((channel, damq)).or_insert_with(|| vec![0; max_io]);
                        mem[offset as usize..offset as usize + payload.len()].copy_from_slice(payload);
                    }
                    TargetInbound::Dropped(d) => self.target_drops.push(d),
                    TargetInbound::Consumed => {}
                },
                Dir::ToInitiator => match self.volume.handle_frame(self.now, &p.bytes, &mut self.scratch) {
                    Inbound::Read { id, offset, payload } => {
                        let b = self.bufs.get_mut(&id).expect("read data for a known request");
                        b[offset as usize..offset as usize + payload.len()].copy_from_slice(payload);
                    }
                    Inbound::Dropped(d) => self.initiator_drops.push(d),
                    Inbound::Consumed => {}
                },
            }
            self.collect();
        }
        any
    }

    fn note_ack(&mut self, p: &Packet) {
        if self.cfg.seal == Some(true) {
            return; // encrypted: not readable here
        }
        // A frame going one way acknowledges the data that went the other way.
        let acked_dir = match p.dir {
            Dir::ToTarget => Dir::ToInitiator,
            Dir::ToInitiator => Dir::ToTarget,
        };
        // Injected frames may not parse.
        let Ok(f) = Frame::new_checked(&p.bytes[..], DEFAULT_ETHERTYPE) else { return };
        let cum = match f.parse_borrowed() {
            Ok(Message::Request(r)) => r.seq.ack,
            Ok(Message::Completion(c)) => c.seq.ack,
            Ok(Message::Data(d)) => d.header.seq.ack,
            Ok(Message::Ack(a)) => a.cumulative,
            _ => return,
        };
        let e = self.acked.entry((acked_dir, p.channel())).or_insert(0);
        *e = (*e).max(cum);
    }

    /// Counts drops of `reason` by the target.
    pub fn target_dropped(&self, reason: DropReason) -> usize {
        self.target_drops.iter().filter(|d| **d == FrameDrop::Channel(reason)).count()
    }
    /// Counts drops of `reason` by the initiator.
    pub fn initiator_dropped(&self, reason: DropReason) -> usize {
        self.initiator_drops.iter().filter(|d| **d == FrameDrop::Channel(reason)).count()
    }
}

impl Default for Pair {
    fn default() -> Self {
        Pair::new()
    }
}

/// Deterministic test data: byte `i` of request `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Emits `msg` with `env` into a fresh frame.
pub fn frame_of(env: &Envelope, msg: &Message<'_>) -> Vec<u8> {
    let mut buf = vec![0; msg.frame_len()];
    let n = msg.emit(env, &mut buf);
    buf.truncate(n);
    buf
}
