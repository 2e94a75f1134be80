//! An in-process RAM target over in-memory links, for tests, examples and benches.
//!
//! [`RamTarget`] is a minimal target built from tyche-channel's [`Acceptor`] and
//! [`TargetSession`]s, serving one RAM-backed export on its own thread; [`mem_links`] joins it
//! to an initiator with [`MemLink`]s, optionally through [`FaultInjector`]s the caller can switch
//! (a link that goes down, a lossy link). The real target daemon is `tyched`; this one needs no
//! privileges and no network.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tyche_channel::{
    Accepted, Acceptor, ExportGeometry, ExportSpec, HandshakeFrame, Instant, TargetEvent, TargetInbound, TargetSession,
    Timers,
};
use tyche_transport::{FaultConfig, FaultInjector, FrameTransport, MemLink, MemPort, SplitMix64};
use tyche_wire::{
    flags, ChannelParams, Envelope, Frame, Kind, MacAddr, Op, Status, DATA_FRAME_OVERHEAD, DEFAULT_ETHERTYPE,
    SECTOR_SIZE,
};

use crate::config::Link;

/// MTU of the in-memory links (jumbo: 8 KiB segments).
pub const MEM_MTU: usize = 9000;
/// Frame capacity of the in-memory links.
pub const MEM_FRAME: usize = 9014;
/// Frames queued per direction of an in-memory link.
pub const MEM_DEPTH: usize = 4096;

/// A transport shared between the engine and a test that changes it while it runs.
#[derive(Debug)]
pub struct Shared<T>(pub Arc<Mutex<T>>);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(Arc::clone(&self.0))
    }
}

impl<T: FrameTransport> FrameTransport for Shared<T> {
    fn frame_capacity(&self) -> usize {
        self.0.lock().expect("transport lock").frame_capacity()
    }
    fn mtu(&self) -> usize {
        self.0.lock().expect("transport lock").mtu()
    }
    fn local_mac(&self) -> MacAddr {
        self.0.lock().expect("transport lock").local_mac()
    }
    fn recv(&mut self, budget: usize, on_frame: &mut dyn FnMut(&[u8])) -> std::io::Result<usize> {
        self.0.lock().expect("transport lock").recv(budget, on_frame)
    }
    fn send(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> std::io::Result<usize> {
        self.0.lock().expect("transport lock").send(budget, fill)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.lock().expect("transport lock").flush()
    }
}

/// A switchable in-memory link as the initiator sees it.
pub type FaultyPort = Shared<FaultInjector<MemPort>>;

/// Sets a link up or down (every frame dropped both ways while down).
pub fn set_link_down(port: &FaultyPort, down: bool) {
    let f = FaultConfig { down, ..FaultConfig::default() };
    port.0.lock().expect("transport lock").set_faults(f, f);
}

/// The RAM export a [`RamTarget`] serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamExport {
    /// Export name.
    pub name: String,
    /// Size in bytes (multiple of 512).
    pub size: u64,
    /// Whether the export refuses modifications.
    pub read_only: bool,
    /// The durability epoch its ACCEPTs carry; `None`: random, one for the target's life (its
    /// RAM outlives [`RamTarget::restart`]).
    pub durability_epoch: Option<tyche_wire::DurabilityEpoch>,
}

impl RamExport {
    /// A writable export.
    pub fn new(name: &str, size: u64) -> Self {
        RamExport { name: name.to_owned(), size, read_only: false, durability_epoch: None }
    }
}

/// Counters of a [`RamTarget`].
#[derive(Debug, Default)]
pub struct TargetCounters {
    /// Requests executed.
    pub executed: AtomicU64,
    /// FLUSH requests executed.
    pub flushes: AtomicU64,
    /// FUA writes executed.
    pub fua_writes: AtomicU64,
}

/// How [`RamTarget::restart`] restarts the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// The process dies: every session is forgotten at once, nothing is said to initiators.
    Crash,
    /// SIGTERM: DISCONNECT SHUTDOWN on every channel, then every session is forgotten.
    Graceful,
}

/// An in-process target serving one RAM export on its own thread; stops when dropped.
#[derive(Debug)]
pub struct RamTarget {
    stop: Arc<AtomicBool>,
    /// A restart asked for: 0 none, 1 crash, 2 graceful.
    restart: Arc<AtomicU8>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<TargetCounters>,
    storage: Arc<Mutex<Vec<u8>>>,
}

/// Timers for in-process targets: quicker than the LAN defaults so tests fail over fast, and
/// the target reclaims later than the initiator gives up.
pub fn target_timers() -> Timers {
    Timers { dead_after: Duration::from_secs(2), keepalive: Duration::from_millis(100), ..Timers::default() }
}

/// Initiator timers matching [`target_timers`].
pub fn initiator_timers() -> Timers {
    Timers { dead_after: Duration::from_millis(600), keepalive: Duration::from_millis(100), ..Timers::default() }
}

impl RamTarget {
    /// Starts a target for `export` on `ports` (one per NIC).
    pub fn spawn(export: RamExport, ports: Vec<Box<dyn FrameTransport + Send>>, timers: Timers) -> RamTarget {
        assert!(export.size % SECTOR_SIZE as u64 == 0, "export size must be a multiple of 512");
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(TargetCounters::default());
        let storage = Arc::new(Mutex::new(vec![0u8; export.size as usize]));
        let restart = Arc::new(AtomicU8::new(0));
        let mut t = TargetLoop::new(export, ports, timers, Arc::clone(&storage), Arc::clone(&counters));
        let (s, r) = (Arc::clone(&stop), Arc::clone(&restart));
        let thread = std::thread::Builder::new()
            .name("tyche-ram-target".into())
            .spawn(move || t.run(&s, &r))
            .expect("cannot start the target thread");
        RamTarget { stop, restart, thread: Some(thread), counters, storage }
    }

    /// Restarts the target as a new process would start on the same storage (the RAM stays,
    /// as a file export's contents would): every session and ledger is forgotten, so initiators
    /// get UNKNOWN_SESSION when they reconnect. Returns at once; the target thread restarts at
    /// its next turn.
    pub fn restart(&self, how: Restart) {
        let code = match how {
            Restart::Crash => 1,
            Restart::Graceful => 2,
        };
        self.restart.store(code, Ordering::Release);
    }

    /// The target's counters.
    pub fn counters(&self) -> &TargetCounters {
        &self.counters
    }

    /// A copy of `len` bytes of the export at `offset` (for checks).
    pub fn snapshot(&self, offset: u64, len: usize) -> Vec<u8> {
        let s = self.storage.lock().expect("storage lock");
        s[offset as usize..offset as usize + len].to_vec()
    }
}

impl Drop for RamTarget {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Joins a new [`RamTarget`] for `export` to `n` initiator links over [`MemLink`]s, each behind
/// a switchable [`FaultInjector`] (see [`set_link_down`]).
pub fn mem_links(export: RamExport, n: usize) -> (Vec<Link>, Vec<FaultyPort>, RamTarget) {
    let mut links = Vec::new();
    let mut switches = Vec::new();
    let mut target_ports: Vec<Box<dyn FrameTransport + Send>> = Vec::new();
    for k in 0..n {
        let (imac, tmac) = (MacAddr::local(0x100 + k as u32), MacAddr::local(0x200 + k as u32));
        let (i, t) = MemLink::pair((imac, tmac), MEM_MTU, MEM_FRAME, MEM_DEPTH);
        let f = FaultInjector::new(i, FaultConfig::default(), FaultConfig::default(), 0x5eed + k as u64);
        let shared = Shared(Arc::new(Mutex::new(f)));
        switches.push(shared.clone());
        links.push(Link { name: format!("mem{k}"), transport: Box::new(shared), target: tmac, node: None });
        target_ports.push(Box::new(t));
    }
    let target = RamTarget::spawn(export, target_ports, target_timers());
    (links, switches, target)
}

struct TargetLoop {
    export: RamExport,
    ports: Vec<Box<dyn FrameTransport + Send>>,
    macs: Vec<MacAddr>,
    acceptor: Acceptor,
    /// What a restarted acceptor is built from.
    spec: ExportSpec,
    limit: ChannelParams,
    timers: Timers,
    sessions: HashMap<u64, TargetSession>,
    /// (session, channel) → port.
    route: HashMap<(u64, u16), usize>,
    damq: HashMap<(u64, u16, u16), Vec<u8>>,
    storage: Arc<Mutex<Vec<u8>>>,
    counters: Arc<TargetCounters>,
    clock: std::time::Instant,
    rng: SplitMix64,
    max_io: u32,
}

impl TargetLoop {
    fn new(
        export: RamExport,
        ports: Vec<Box<dyn FrameTransport + Send>>,
        timers: Timers,
        storage: Arc<Mutex<Vec<u8>>>,
        counters: Arc<TargetCounters>,
    ) -> Self {
        let max_io = 1 << 20;
        let segment = ports
            .iter()
            .filter_map(|p| tyche_wire::segment_size_for(p.mtu(), p.frame_capacity()))
            .max()
            .unwrap_or(1024);
        let limit = ChannelParams {
            ring: 1024,
            remq_slots: 128,
            damq_slots: 128,
            segment: segment as u16,
            max_io,
            features: flags::FEATURE_BLOCK_STATUS,
        };
        let mut f = flags::EXPORT_DISCARD;
        if export.read_only {
            f |= flags::EXPORT_READ_ONLY;
        }
        // The RAM outlives the target's restarts (`RamTarget::restart`), as a file export's
        // page cache outlives a tyched process: one epoch for the loopback target's life.
        let durability_epoch = export.durability_epoch.unwrap_or_else(|| {
            tyche_wire::DurabilityEpoch(std::array::from_fn(|i| {
                (tyche_channel::auth::random_u64() >> (8 * (i % 8))) as u8 | u8::from(i == 0)
            }))
        });
        let spec = ExportSpec {
            name: export.name.clone(),
            size: export.size,
            block_size: SECTOR_SIZE,
            flags: f,
            durability_epoch,
        };
        let acceptor = Acceptor::new(DEFAULT_ETHERTYPE, vec![spec.clone()], limit, timers);
        let macs = ports.iter().map(|p| p.local_mac()).collect();
        TargetLoop {
            export,
            ports,
            macs,
            acceptor,
            spec,
            limit,
            timers,
            sessions: HashMap::new(),
            route: HashMap::new(),
            damq: HashMap::new(),
            storage,
            counters,
            clock: std::time::Instant::now(),
            rng: SplitMix64::new(0x7a96e7),
            max_io,
        }
    }

    fn now(&self) -> Instant {
        Instant(self.clock.elapsed().as_nanos() as u64 + 1)
    }

    fn run(&mut self, stop: &AtomicBool, restart: &AtomicU8) {
        let mut idle = 0u32;
        while !stop.load(Ordering::Relaxed) {
            let now = self.now();
            match restart.swap(0, Ordering::AcqRel) {
                0 => {}
                how => {
                    if how == 2 {
                        for s in self.sessions.values_mut() {
                            s.close(tyche_wire::DisconnectReason::Shutdown);
                        }
                        self.transmit(now);
                    }
                    self.sessions.clear();
                    self.route.clear();
                    self.damq.clear();
                    self.acceptor = Acceptor::new(DEFAULT_ETHERTYPE, vec![self.spec.clone()], self.limit, self.timers);
                }
            }
            let mut work = self.receive(now);
            work |= self.execute();
            for s in self.sessions.values_mut() {
                if s.poll_timeout().is_some_and(|t| t <= now) {
                    s.handle_timeout(now);
                }
            }
            work |= self.execute();
            work |= self.transmit(now);
            idle = if work { 0 } else { idle.saturating_add(1) };
            if idle > 64 {
                std::thread::sleep(Duration::from_micros(if idle > 10_000 { 1000 } else { 100 }));
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn receive(&mut self, now: Instant) -> bool {
        let mut n = 0;
        for k in 0..self.ports.len() {
            let TargetLoop { ports, macs, acceptor, sessions, route, damq, rng, export, max_io, .. } = self;
            let port = &mut ports[k];
            let mut replies: Vec<Vec<u8>> = Vec::new();
            let mut scratch = Vec::new();
            n += port
                .recv(64, &mut |bytes| {
                    let Ok(frame) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
                    if matches!(frame.kind(), Kind::Connect | Kind::Discover) {
                        let Ok(msg) = frame.parse() else { return };
                        let env = Envelope::of(&frame);
                        let mut ids = || rng.next_u64();
                        let mut out = vec![0u8; 1600];
                        match acceptor.handle(
                            now,
                            HandshakeFrame { local: macs[k], src: frame.src(), env: &env, msg: &msg },
                            &mut ids,
                            &mut out,
                        ) {
                            Some(Accepted::Reply(len)) => replies.push(out[..len].to_vec()),
                            Some(Accepted::Channel { session, channel, len, .. }) => {
                                let g =
                                    ExportGeometry { size: export.size, read_only: export.read_only, discard: true };
                                route.insert((session, channel.envelope().channel), k);
                                sessions
                                    .entry(session)
                                    .or_insert_with(|| TargetSession::new(session, DEFAULT_ETHERTYPE, g))
                                    .add_channel(*channel);
                                replies.push(out[..len].to_vec());
                            }
                            None => {}
                        }
                        return;
                    }
                    let Some(s) = sessions.get_mut(&frame.session()) else { return };
                    if let TargetInbound::Write { channel, damq: slot, offset, payload, .. } =
                        s.handle_frame(now, bytes, &mut scratch)
                    {
                        let mem = damq.entry((s.id(), channel, slot)).or_insert_with(|| vec![0; *max_io as usize]);
                        mem[offset as usize..offset as usize + payload.len()].copy_from_slice(payload);
                    }
                })
                .unwrap_or(0);
            for r in replies {
                let _ = port.send(1, &mut |buf| {
                    buf[..r.len()].copy_from_slice(&r);
                    Some(r.len())
                });
            }
        }
        n > 0
    }

    /// Runs every request handed out, at once, against the RAM.
    fn execute(&mut self) -> bool {
        let mut work = false;
        let mut storage = self.storage.lock().expect("storage lock");
        for (&sid, s) in self.sessions.iter_mut() {
            while let Some(ev) = s.poll_event() {
                work = true;
                let TargetEvent::Execute { channel, request: r, .. } = ev else { continue };
                let (start, len) = (r.offset as usize, r.length as usize);
                let key = (sid, channel, r.damq);
                match r.op {
                    Op::Write => {
                        if let Some(mem) = self.damq.get(&key) {
                            storage[start..start + len].copy_from_slice(&mem[..len]);
                        }
                        if r.fua {
                            self.counters.fua_writes.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Op::Read => {
                        let mem = self.damq.entry(key).or_insert_with(|| vec![0; self.max_io as usize]);
                        mem[..len].copy_from_slice(&storage[start..start + len]);
                    }
                    Op::Discard | Op::WriteZeroes => storage[start..start + len].fill(0),
                    Op::Flush => {
                        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
                    }
                    Op::BlockStatus => {
                        // Pages of the export holding only zeroes are holes; at most 4 MiB
                        // looked at.
                        let mem = self.damq.entry(key).or_insert_with(|| vec![0; self.max_io as usize]);
                        let end = start + len.min(4 << 20);
                        let mut extents = Vec::new();
                        let mut at = start;
                        while at < end {
                            let next = ((at / 4096 + 1) * 4096).min(end);
                            let zero = storage[at..next].iter().all(|&b| b == 0);
                            let flags = if zero { flags::EXTENT_HOLE | flags::EXTENT_ZERO } else { 0 };
                            extents.push(tyche_wire::Extent { length: (next - at) as u64, flags });
                            at = next;
                        }
                        tyche_wire::emit_block_status(extents, &mut mem[..]);
                    }
                }
                self.counters.executed.fetch_add(1, Ordering::Relaxed);
                s.complete(channel, &r, Status::Ok);
            }
        }
        work
    }

    fn transmit(&mut self, now: Instant) -> bool {
        let mut sent = 0;
        let TargetLoop { ports, sessions, route, damq, .. } = self;
        for (&sid, s) in sessions.iter_mut() {
            let channels: Vec<u16> = s.channel_indices().collect();
            for ch in channels {
                if !s.wants_transmit(ch) {
                    continue;
                }
                let Some(&k) = route.get(&(sid, ch)) else { continue };
                loop {
                    let n = ports[k]
                        .send(64, &mut |buf| {
                            let t = s.poll_transmit(now, ch, buf)?;
                            if let Some(p) = t.payload {
                                if let Some(mem) = damq.get(&(sid, ch, p.damq)) {
                                    let (at, len) = (p.offset as usize, p.len as usize);
                                    buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len]
                                        .copy_from_slice(&mem[at..at + len]);
                                }
                            }
                            Some(s.seal(ch, buf, t.len))
                        })
                        .unwrap_or(0);
                    sent += n;
                    if n < 64 {
                        break;
                    }
                }
            }
        }
        sent > 0
    }
}
