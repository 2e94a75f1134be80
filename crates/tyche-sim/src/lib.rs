//! A deterministic simulator for Tyche (in the spirit of TigerBeetle's VOPR).
//!
//! One [`run_seed`] builds a world from a single `u64` seed: an initiator [`Volume`] and a target
//! ([`Acceptor`] + [`TargetSession`]s over an in-memory export) joined by N simulated paths with
//! seeded loss, reordering, duplication, delay and jitter, and optionally a path that fails mid-run
//! (either going dark, or holding its frames and delivering them after the initiator has given
//! the path up, so late duplicates reach a target that still listens). Channels are opened with
//! the real handshake over the lossy paths. A randomized workload (reads, writes, flushes,
//! discards, write-zeroes; 512 B to 1 MiB; queue depth up to 64) runs against a reference model
//! that checks every completed read, and after the run every sector of the export.
//!
//! Time is virtual and jumps from event to event, so a run of seconds of simulated time takes
//! milliseconds. Nothing reads a clock or an unseeded random source: the same seed replays the
//! same run, frame for frame.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod model;
pub mod net;

use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::time::Duration;

use tyche_channel::{
    Accepted, Acceptor, ConnectError, Connector, ExportGeometry, ExportSpec, Inbound, Instant, IoError, IoRequest,
    LeastBytes, TargetEvent, TargetInbound, TargetSession, Timers, Volume, VolumeConfig, VolumeEvent,
};
use tyche_transport::SplitMix64;
use tyche_wire::{
    segment_size_for, ChannelParams, Envelope, Frame, Kind, MacAddr, Op, Request, Status, DATA_FRAME_OVERHEAD,
    DEFAULT_ETHERTYPE, SECTOR_SIZE,
};

use model::Model;
use net::{Delivery, Dir, Failure, NetConfig, Network};

/// What to simulate. Everything else derives from the seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// Paths (one channel each).
    pub paths: usize,
    /// Frame loss probability, each way.
    pub loss: f64,
    /// Reordering probability.
    pub reorder: f64,
    /// Duplication probability.
    pub dup: f64,
    /// Whether one path fails mid-run (needs at least two paths).
    pub fail_path: bool,
    /// Requests per seed.
    pub requests: usize,
    /// Export size in bytes.
    pub export_bytes: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            paths: 2,
            loss: 0.0,
            reorder: 0.0,
            dup: 0.0,
            fail_path: false,
            requests: 200,
            export_bytes: 16 << 20,
        }
    }
}

/// What one seed did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeedReport {
    /// The seed.
    pub seed: u64,
    /// Requests that completed successfully.
    pub completed: u64,
    /// Requests that completed with an error (a failed path with no survivor, a storage error).
    pub failed: u64,
    /// Reads (during the run) and sectors (in the final check) that differ from the model.
    pub mismatches: u64,
    /// Requests that never completed.
    pub stuck: u64,
    /// Frames handed to the network.
    pub frames: u64,
    /// Frames lost by the network.
    pub lost: u64,
    /// Retransmissions by both ends.
    pub retransmits: u64,
    /// Modifying requests the target refused to execute twice.
    pub duplicates_suppressed: u64,
    /// Channels that died.
    pub dead_channels: u64,
    /// Virtual time the run took.
    pub virtual_nanos: u64,
}

impl SeedReport {
    /// Whether the seed passed: nothing mismatched, nothing stuck.
    pub fn ok(&self) -> bool {
        self.mismatches == 0 && self.stuck == 0
    }
}

const MAX_IO: u32 = 512 << 10;
const STORAGE_ERROR: f64 = 0.001;
/// Virtual time after which a run that has not finished counts its requests as stuck.
const RUN_LIMIT: Duration = Duration::from_secs(120);

fn initiator_timers() -> Timers {
    Timers {
        initial_rto: Duration::from_millis(1),
        min_rto: Duration::from_micros(200),
        max_rto: Duration::from_millis(10),
        ack_delay: Duration::from_micros(20),
        ack_every: 8,
        nack_delay: Duration::from_micros(100),
        keepalive: Duration::from_millis(20),
        dead_after: Duration::from_millis(200),
    }
}

fn target_timers() -> Timers {
    // The target waits longer before reclaiming a channel than the initiator waits before
    // failing over: that is the window in which late duplicates can reach a live target channel.
    Timers { dead_after: Duration::from_millis(600), ..initiator_timers() }
}

#[derive(Debug)]
struct AppRequest {
    op: Op,
    offset: u64,
    length: u64,
    buf: Vec<u8>,
    version: u64,
}

#[derive(Debug)]
struct StorageOp {
    at: Instant,
    order: u64,
    session: u64,
    channel: u16,
    request: Request,
}

impl PartialEq for StorageOp {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.order) == (o.at, o.order)
    }
}
impl Eq for StorageOp {}
impl PartialOrd for StorageOp {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for StorageOp {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.order).cmp(&(o.at, o.order))
    }
}

struct World {
    cfg: SimConfig,
    rng: SplitMix64,
    now: Instant,
    net: Network,
    init_macs: Vec<MacAddr>,
    target_macs: Vec<MacAddr>,
    // Initiator.
    connectors: Vec<Option<Connector>>,
    volume: Option<Volume>,
    export_size: u64,
    app: BTreeMap<u64, AppRequest>,
    next_id: u64,
    issued: usize,
    depth: usize,
    model: Model,
    // Target.
    acceptor: Acceptor,
    sessions: BTreeMap<u64, TargetSession>,
    storage: Vec<u8>,
    damq_mem: HashMap<(u64, u16, u16), Vec<u8>>,
    io: BinaryHeap<std::cmp::Reverse<StorageOp>>,
    io_order: u64,
    // Failure plan.
    fail_at_issue: Option<usize>,
    report: SeedReport,
    buf: Vec<u8>,
}

/// Runs one seed.
pub fn run_seed(cfg: &SimConfig, seed: u64) -> SeedReport {
    let mut w = World::new(*cfg, seed);
    w.run();
    w.report
}

impl World {
    fn new(cfg: SimConfig, seed: u64) -> Self {
        assert!(cfg.paths >= 1 && cfg.export_bytes % SECTOR_SIZE as u64 == 0);
        let mut rng = SplitMix64::new(seed);
        let net_cfg = NetConfig {
            loss: cfg.loss,
            reorder: cfg.reorder,
            dup: cfg.dup,
            delay: Duration::from_micros(rng.range(5, 20)),
            jitter: Duration::from_micros(rng.range(0, 10)),
            bytes_per_us: 1250,
        };
        let net = Network::new(net_cfg, cfg.paths, rng.next_u64());
        let init_macs: Vec<_> = (0..cfg.paths).map(|k| MacAddr::local(0x100 + k as u32)).collect();
        let target_macs: Vec<_> = (0..cfg.paths).map(|k| MacAddr::local(0x200 + k as u32)).collect();
        let limit =
            ChannelParams { ring: 1024, remq_slots: 64, damq_slots: 64, segment: 8192, max_io: MAX_IO, features: 0 };
        let export = ExportSpec {
            name: "sim".into(),
            size: cfg.export_bytes,
            block_size: SECTOR_SIZE,
            flags: tyche_wire::flags::EXPORT_DISCARD,
        };
        let acceptor = Acceptor::new(DEFAULT_ETHERTYPE, vec![export], limit, target_timers());
        let depth = rng.range(1, 64) as usize;
        let fail_at_issue = (cfg.fail_path && cfg.paths >= 2).then(|| {
            let lo = cfg.requests / 10;
            rng.range(lo as u64, (cfg.requests * 6 / 10).max(lo) as u64) as usize
        });
        let mut w = World {
            cfg,
            rng,
            now: Instant(1_000_000),
            net,
            init_macs,
            target_macs,
            connectors: (0..cfg.paths).map(|_| None).collect(),
            volume: None,
            export_size: 0,
            app: BTreeMap::new(),
            next_id: 1,
            issued: 0,
            depth,
            model: Model::new(cfg.export_bytes),
            acceptor,
            sessions: BTreeMap::new(),
            storage: vec![0; cfg.export_bytes as usize],
            damq_mem: HashMap::new(),
            io: BinaryHeap::new(),
            io_order: 0,
            fail_at_issue,
            report: SeedReport { seed, ..SeedReport::default() },
            buf: vec![0; 9216],
        };
        w.connect(0, 0);
        w
    }

    /// Starts the handshake of channel `k` (session 0: a new session).
    fn connect(&mut self, k: usize, session: u64) {
        // The segment size follows each path's MTU: paths differ, so channels differ.
        let mtu = if self.rng.chance(0.5) { 1500 } else { 3000 };
        let segment = segment_size_for(mtu, 3840).expect("MTU fits a segment") as u16;
        let want = ChannelParams {
            ring: 256 << self.rng.range(0, 2),
            remq_slots: 64,
            damq_slots: 64,
            segment,
            max_io: MAX_IO,
            features: 0,
        };
        let env = Envelope {
            dst: self.target_macs[k],
            src: self.init_macs[k],
            ethertype: DEFAULT_ETHERTYPE,
            channel: k as u16,
            session,
        };
        let nonce = self.rng.next_u64();
        self.connectors[k] = Some(Connector::new(env, "sim", want, nonce, Duration::from_millis(5), 100, self.now));
    }

    fn run(&mut self) {
        let deadline = self.now + RUN_LIMIT;
        loop {
            self.deliver();
            self.storage_done();
            self.timers();
            self.app_step();
            self.transmit();
            let finished = self.issued == self.cfg.requests && self.app.is_empty();
            if finished && self.net.is_idle() && self.io.is_empty() {
                break;
            }
            let Some(next) = self.next_event() else { break };
            if next > deadline {
                break;
            }
            self.now = self.now.max(next);
        }
        // Quiesce: let stray frames (held ones included) arrive and their effects, if any, land.
        let quiesce = self.now + Duration::from_secs(2);
        while let Some(next) = self.net.next_at().into_iter().chain(self.io.peek().map(|o| o.0.at)).min() {
            if next > quiesce {
                break;
            }
            self.now = self.now.max(next);
            self.deliver();
            self.storage_done();
            self.transmit();
        }
        self.report.stuck = self.app.len() as u64 + (self.cfg.requests - self.issued) as u64;
        for (&id, r) in &self.app {
            eprintln!("seed {}: request {id} ({:?} {}+{}) stuck", self.report.seed, r.op, r.offset, r.length);
        }
        // Every sector must match the model.
        let bad = self.model.mismatches(0, &self.storage) as u64;
        if bad > 0 {
            eprintln!("seed {}: {bad} sectors differ from the model after the run", self.report.seed);
        }
        self.report.mismatches += bad;
        let ns = self.net.stats();
        self.report.frames = ns.sent;
        self.report.lost = ns.lost;
        self.report.virtual_nanos = self.now.as_nanos();
        if let Some(v) = &self.volume {
            for i in v.channel_indices() {
                self.report.retransmits += v.channel(i).map_or(0, |c| c.stats().retransmits);
            }
        }
        for s in self.sessions.values() {
            self.report.duplicates_suppressed += s.duplicates_suppressed();
            for i in s.channel_indices() {
                self.report.retransmits += s.channel(i).map_or(0, |c| c.stats().retransmits);
            }
        }
    }

    fn next_event(&self) -> Option<Instant> {
        let mut t = self.net.next_at();
        let mut consider = |x: Option<Instant>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t: Instant| t.min(x)));
            }
        };
        consider(self.io.peek().map(|o| o.0.at));
        consider(self.volume.as_ref().and_then(Volume::poll_timeout));
        for s in self.sessions.values() {
            consider(s.poll_timeout());
        }
        for c in self.connectors.iter().flatten() {
            consider(c.poll_timeout());
        }
        t
    }

    fn deliver(&mut self) {
        while let Some(Delivery { path, dir, frame }) = self.net.pop_due(self.now) {
            match dir {
                Dir::ToTarget => self.target_rx(path, &frame),
                Dir::ToInitiator => self.initiator_rx(path, &frame),
            }
            self.net.recycle(frame);
        }
    }

    fn initiator_rx(&mut self, k: usize, bytes: &[u8]) {
        if let Some(c) = self.connectors[k].as_mut() {
            let Ok(frame) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
            let Ok(msg) = frame.parse() else { return };
            match c.handle(frame.src(), frame.session(), &msg) {
                Some(Ok(connected)) => {
                    let ch = c.channel(&connected, initiator_timers(), self.now);
                    self.connectors[k] = None;
                    if self.volume.is_none() {
                        self.export_size = connected.export_size;
                        let cfg = VolumeConfig {
                            export_size: connected.export_size,
                            read_only: false,
                            no_path_timeout: Duration::from_millis(50),
                            max_requests: 64,
                        };
                        self.volume = Some(Volume::new(
                            cfg,
                            connected.session,
                            DEFAULT_ETHERTYPE,
                            Box::<LeastBytes>::default(),
                            self.now,
                        ));
                        for j in 1..self.cfg.paths {
                            self.connect(j, connected.session);
                        }
                    }
                    self.volume.as_mut().expect("created").add_channel(ch, None, self.now);
                }
                Some(Err(e)) => panic!("seed {}: channel {k} could not connect: {e:?}", self.report.seed),
                None => {}
            }
            return;
        }
        let Some(vol) = self.volume.as_mut() else { return };
        if let Inbound::Read { id, offset, payload } = vol.handle_frame(self.now, bytes) {
            let r = self.app.get_mut(&id).expect("read data for an outstanding request");
            r.buf[offset as usize..offset as usize + payload.len()].copy_from_slice(payload);
        }
    }

    fn target_rx(&mut self, k: usize, bytes: &[u8]) {
        let Ok(frame) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
        if matches!(frame.kind(), Kind::Connect | Kind::Discover) {
            let Ok(msg) = frame.parse() else { return };
            let env = Envelope::of(&frame);
            let rng = &mut self.rng;
            let mut ids = || rng.next_u64();
            let mut out = vec![0u8; 256];
            match self.acceptor.handle(self.now, self.target_macs[k], frame.src(), &env, &msg, &mut ids, &mut out) {
                Some(Accepted::Reply(len)) => self.send(k, Dir::ToInitiator, &out[..len]),
                Some(Accepted::Channel { session, channel, len, .. }) => {
                    let geometry = ExportGeometry { size: self.cfg.export_bytes, read_only: false, discard: true };
                    self.sessions
                        .entry(session)
                        .or_insert_with(|| TargetSession::new(session, DEFAULT_ETHERTYPE, geometry))
                        .add_channel(*channel);
                    self.send(k, Dir::ToInitiator, &out[..len]);
                }
                None => {}
            }
            return;
        }
        let Some(s) = self.sessions.get_mut(&frame.session()) else { return };
        if let TargetInbound::Write { channel, damq, offset, payload, .. } = s.handle_frame(self.now, bytes) {
            let mem = self.damq_mem.entry((s.id(), channel, damq)).or_insert_with(|| vec![0; MAX_IO as usize]);
            mem[offset as usize..offset as usize + payload.len()].copy_from_slice(payload);
        }
        self.collect_target_events();
    }

    fn collect_target_events(&mut self) {
        for (&sid, s) in self.sessions.iter_mut() {
            while let Some(ev) = s.poll_event() {
                match ev {
                    TargetEvent::Execute { channel, request, .. } => {
                        let slow = self.rng.chance(0.01);
                        let latency =
                            if slow { self.rng.range(200_000, 2_000_000) } else { self.rng.range(2_000, 50_000) };
                        self.io_order += 1;
                        let op = StorageOp {
                            at: self.now + Duration::from_nanos(latency),
                            order: self.io_order,
                            session: sid,
                            channel,
                            request,
                        };
                        self.io.push(std::cmp::Reverse(op));
                    }
                    TargetEvent::ChannelDead { .. } => self.report.dead_channels += 1,
                }
            }
        }
    }

    fn storage_done(&mut self) {
        while self.io.peek().is_some_and(|o| o.0.at <= self.now) {
            let std::cmp::Reverse(op) = self.io.pop().expect("peeked");
            let r = op.request;
            let (start, len) = (r.offset as usize, r.length as usize);
            let status = if self.rng.chance(STORAGE_ERROR) {
                Status::IoError
            } else {
                let key = (op.session, op.channel, r.damq);
                match r.op {
                    Op::Write => {
                        let mem = self.damq_mem.get(&key).expect("write data placed");
                        self.storage[start..start + len].copy_from_slice(&mem[..len]);
                    }
                    Op::Read => {
                        let mem = self.damq_mem.entry(key).or_insert_with(|| vec![0; MAX_IO as usize]);
                        mem[..len].copy_from_slice(&self.storage[start..start + len]);
                    }
                    Op::Discard | Op::WriteZeroes => self.storage[start..start + len].fill(0),
                    Op::Flush => {}
                }
                Status::Ok
            };
            if let Some(s) = self.sessions.get_mut(&op.session) {
                assert!(s.complete(op.channel, &r, status), "completing a request the session did not hand out");
            }
            self.collect_target_events();
        }
    }

    fn timers(&mut self) {
        let now = self.now;
        if let Some(v) = self.volume.as_mut() {
            if v.poll_timeout().is_some_and(|t| t <= now) {
                v.handle_timeout(now);
            }
        }
        for s in self.sessions.values_mut() {
            if s.poll_timeout().is_some_and(|t| t <= now) {
                s.handle_timeout(now);
            }
        }
        self.collect_target_events();
        for (k, slot) in self.connectors.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            c.handle_timeout(now);
            if let Some(Err(e)) = c.outcome() {
                assert_eq!(e, ConnectError::Timeout, "seed {}", self.report.seed);
                // A path that failed before its channel opened: the volume runs on the others.
                assert!(
                    k > 0 && self.net.is_failed(k),
                    "seed {}: channel {k} could not connect on a working path",
                    self.report.seed
                );
                *slot = None;
            }
        }
    }

    fn send(&mut self, k: usize, dir: Dir, frame: &[u8]) {
        let mut b = self.net.buffer(frame.len());
        b.copy_from_slice(frame);
        self.net.send(self.now, k, dir, b);
    }

    fn transmit(&mut self) {
        let now = self.now;
        let mut buf = std::mem::take(&mut self.buf);
        for k in 0..self.cfg.paths {
            if let Some(c) = self.connectors[k].as_mut() {
                if let Some(len) = c.poll_transmit(now, &mut buf) {
                    self.send(k, Dir::ToTarget, &buf[..len]);
                }
            }
        }
        if let Some(vol) = self.volume.as_mut() {
            let indices: Vec<u16> = vol.channel_indices().collect();
            for ch in indices {
                while let Some(out) = vol.poll_transmit(now, ch, &mut buf) {
                    if let Some((id, offset, len)) = out.payload {
                        let r = &self.app[&id];
                        buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len as usize]
                            .copy_from_slice(&r.buf[offset as usize..offset as usize + len as usize]);
                    }
                    let mut b = self.net.buffer(out.len);
                    b.copy_from_slice(&buf[..out.len]);
                    self.net.send(now, ch as usize, Dir::ToTarget, b);
                }
            }
        }
        let sids: Vec<u64> = self.sessions.keys().copied().collect();
        for sid in sids {
            let s = self.sessions.get_mut(&sid).expect("listed");
            let indices: Vec<u16> = s.channel_indices().collect();
            for ch in indices {
                let s = self.sessions.get_mut(&sid).expect("listed");
                while let Some(t) = s.poll_transmit(now, ch, &mut buf) {
                    if let Some(p) = t.payload {
                        let mem = &self.damq_mem[&(sid, ch, p.damq)];
                        buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + p.len as usize]
                            .copy_from_slice(&mem[p.offset as usize..(p.offset + p.len) as usize]);
                    }
                    let mut b = self.net.buffer(t.len);
                    b.copy_from_slice(&buf[..t.len]);
                    self.net.send(now, ch as usize, Dir::ToInitiator, b);
                }
            }
        }
        self.buf = buf;
        self.collect_target_events();
    }

    fn app_step(&mut self) {
        let Some(vol) = self.volume.as_mut() else { return };
        while let Some(ev) = vol.poll_event() {
            match ev {
                VolumeEvent::Completed { id, result } => {
                    let r = self.app.remove(&id).expect("completion of an outstanding request");
                    match (r.op, result) {
                        (Op::Read, Ok(())) => {
                            let bad = self.model.mismatches(r.offset, &r.buf);
                            if bad > 0 {
                                eprintln!(
                                    "seed {}: read {id} at {}+{}: {bad} sectors differ",
                                    self.report.seed, r.offset, r.length
                                );
                                self.report.mismatches += 1;
                            }
                        }
                        (Op::Write, Ok(())) => self.model.written(r.offset, r.length, r.version),
                        (Op::Discard | Op::WriteZeroes, Ok(())) => self.model.written(r.offset, r.length, 0),
                        (op, Err(_)) if op.modifies() => self.model.unknown(r.offset, r.length),
                        _ => {}
                    }
                    match result {
                        Ok(()) => self.report.completed += 1,
                        Err(IoError::Target(_) | IoError::NoPath) => self.report.failed += 1,
                    }
                }
                VolumeEvent::ChannelDead { .. } => self.report.dead_channels += 1,
                VolumeEvent::ChannelAborted { .. } => {}
            }
        }
        if self.fail_at_issue == Some(self.issued) {
            self.fail_at_issue = None;
            let path = self.rng.range(0, self.cfg.paths as u64 - 1) as usize;
            let how = if self.rng.chance(0.5) {
                Failure::Down
            } else {
                // Release after the initiator's failover, before the target's reclaim.
                Failure::HoldThenRelease { release: self.now + Duration::from_millis(self.rng.range(250, 450)) }
            };
            self.net.fail(path, how);
        }
        while self.issued < self.cfg.requests && self.app.len() < self.depth {
            let Some(req) = self.generate() else { break };
            let vol = self.volume.as_mut().expect("checked");
            match vol.submit(self.now, req.0) {
                Ok(()) => {
                    self.app.insert(req.0.id, req.1);
                    self.issued += 1;
                    self.next_id += 1;
                }
                Err(tyche_channel::SubmitError::Busy) => break,
                Err(e) => panic!("seed {}: generated an invalid request {:?}: {e:?}", self.report.seed, req.0),
            }
        }
    }

    /// A random request that overlaps no outstanding request in a way that would make its outcome
    /// depend on ordering (a modification overlapping anything in flight).
    fn generate(&mut self) -> Option<(IoRequest, AppRequest)> {
        let sector = SECTOR_SIZE as u64;
        let sectors = self.export_size / sector;
        for _ in 0..8 {
            let pick = self.rng.range(0, 99);
            let op = match pick {
                0..=39 => Op::Read,
                40..=79 => Op::Write,
                80..=84 => Op::Flush,
                85..=91 => Op::Discard,
                _ => Op::WriteZeroes,
            };
            let (offset, length) = if op == Op::Flush {
                (0, 0)
            } else {
                let k = self.rng.range(0, 11);
                let n = self.rng.range(1, 1 << k).min(sectors);
                let first = self.rng.range(0, sectors - n);
                (first * sector, n * sector)
            };
            let clash = self.app.values().any(|r| {
                let overlap =
                    r.op != Op::Flush && op != Op::Flush && offset < r.offset + r.length && r.offset < offset + length;
                overlap && (op.modifies() || r.op.modifies())
            });
            if clash {
                continue;
            }
            let id = self.next_id;
            let mut buf = vec![0u8; if op.uses_damq() { length as usize } else { 0 }];
            if op == Op::Write {
                model::fill(&mut buf, id, offset / sector);
            }
            let fua = op == Op::Write && self.rng.chance(0.1);
            let io = IoRequest { id, op, fua, offset, length, node: None };
            return Some((io, AppRequest { op, offset, length, buf, version: id }));
        }
        None
    }
}

/// Sums of many seeds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Seeds run.
    pub seeds: u64,
    /// Requests completed (successfully or with an error status).
    pub requests: u64,
    /// Of which failed.
    pub failed: u64,
    /// Mismatches.
    pub mismatches: u64,
    /// Stuck requests.
    pub stuck: u64,
    /// Frames sent.
    pub frames: u64,
    /// Retransmissions.
    pub retransmits: u64,
    /// Duplicate modifications suppressed by the target.
    pub duplicates_suppressed: u64,
    /// Channels that died.
    pub dead_channels: u64,
    /// Seeds that failed.
    pub failed_seeds: u64,
}

impl Totals {
    /// Adds one seed's report.
    pub fn add(&mut self, r: &SeedReport) {
        self.seeds += 1;
        self.requests += r.completed + r.failed;
        self.failed += r.failed;
        self.mismatches += r.mismatches;
        self.stuck += r.stuck;
        self.frames += r.frames;
        self.retransmits += r.retransmits;
        self.duplicates_suppressed += r.duplicates_suppressed;
        self.dead_channels += r.dead_channels;
        self.failed_seeds += u64::from(!r.ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_network_completes_everything() {
        let r = run_seed(&SimConfig { requests: 100, ..SimConfig::default() }, 1);
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.completed + r.failed, 100, "{r:?}");
    }

    #[test]
    fn same_seed_same_run() {
        let cfg =
            SimConfig { loss: 0.05, reorder: 0.1, dup: 0.01, fail_path: true, requests: 80, ..SimConfig::default() };
        assert_eq!(run_seed(&cfg, 7), run_seed(&cfg, 7));
    }

    #[test]
    fn lossy_paths_with_failure_stay_correct() {
        let cfg =
            SimConfig { loss: 0.05, reorder: 0.1, dup: 0.01, fail_path: true, requests: 120, ..SimConfig::default() };
        for seed in 0..6 {
            let r = run_seed(&cfg, seed);
            assert!(r.ok(), "seed {seed}: {r:?}");
        }
    }
}
