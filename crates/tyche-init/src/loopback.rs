//! An in-process target over in-memory links, for tests, examples, benches and
//! `serve-nbd --loopback-mib`.
//!
//! [`RamTarget`] is `tyched` itself ([`tyched::Target`], the daemon's library) serving one export
//! whose bytes live in RAM: a memfd the target opens as a file export, so that the bytes, and
//! the durability epoch the target derives from the file, outlive [`RamTarget::restart`] as a
//! file's page cache outlives a restarted `tyched`. [`mem_links`] joins it to an initiator with
//! [`MemLink`]s, the initiator's ends behind [`FaultInjector`]s the caller can switch (a link
//! that goes down, a lossy link). It needs no privileges and no network.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tyche_channel::Timers;
use tyche_transport::{
    Capabilities, FaultConfig, FaultInjector, FrameTransport, MemLink, MemPort, OnLentFrame, Rx, Sent,
};
use tyche_wire::{MacAddr, SECTOR_SIZE};
use tyched::{Config, ExportConfig, Nic, Snapshot, Target, TargetHandle};

use crate::config::Link;

/// MTU of the in-memory links (jumbo: 8 KiB segments).
pub const MEM_MTU: usize = 9000;
/// Frame capacity of the in-memory links.
pub const MEM_FRAME: usize = 9014;
/// Frames queued per direction of an in-memory link.
pub const MEM_DEPTH: usize = 4096;
/// How long the in-process target keeps a channel that hears nothing (its `dead_after_ms`):
/// shorter than the LAN default so tests fail over fast, and longer than
/// [`initiator_timers`]' so the initiator gives a path up first.
pub const TARGET_DEAD_AFTER: Duration = Duration::from_secs(2);

/// A transport shared between its user and a test (or a restarted target) that holds it too.
/// It keeps a duplicate of the transport's readiness descriptor, so its user sleeps on it as on
/// the transport's own (a descriptor cannot be borrowed through the lock).
#[derive(Debug)]
pub struct Shared<T> {
    inner: Arc<Mutex<T>>,
    ready: Option<Arc<OwnedFd>>,
}

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared { inner: Arc::clone(&self.inner), ready: self.ready.clone() }
    }
}

impl<T: FrameTransport> Shared<T> {
    /// Shares `transport`. Fails when its readiness descriptor cannot be duplicated (the
    /// process is out of descriptors).
    pub fn new(transport: T) -> io::Result<Shared<T>> {
        let ready = transport.readiness_fd().map(|fd| fd.try_clone_to_owned()).transpose()?.map(Arc::new);
        Ok(Shared { inner: Arc::new(Mutex::new(transport)), ready })
    }
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, T> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: FrameTransport> FrameTransport for Shared<T> {
    fn capabilities(&self) -> Capabilities {
        self.lock().capabilities()
    }
    /// Whole frames, never lent (a lease would have to come back through the lock).
    fn receive(&mut self, budget: usize, _rx: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        self.lock().receive(budget, Rx::Whole, &mut |pieces, lease| {
            on_frame(pieces, None);
            lease
        })
    }
    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        self.lock().transmit(budget, fill)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.lock().flush()
    }
    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.ready.as_deref().map(AsFd::as_fd)
    }
}

/// A switchable in-memory link as the initiator sees it.
pub type FaultyPort = Shared<FaultInjector<MemPort>>;

/// Sets a link up or down (every frame dropped both ways while down).
pub fn set_link_down(port: &FaultyPort, down: bool) {
    let f = FaultConfig { down, ..FaultConfig::default() };
    port.lock().set_faults(f, f);
}

/// The export a [`RamTarget`] serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamExport {
    /// Export name.
    pub name: String,
    /// Size in bytes (multiple of 512).
    pub size: u64,
    /// Whether the export refuses modifications.
    pub read_only: bool,
}

impl RamExport {
    /// A writable export.
    pub fn new(name: &str, size: u64) -> Self {
        RamExport { name: name.to_owned(), size, read_only: false }
    }
}

/// Requests a [`RamTarget`] executed, over all its restarts (from `tyched`'s counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TargetCounters {
    /// Requests executed.
    pub executed: u64,
    /// FLUSH requests executed.
    pub flushes: u64,
    /// WRITEs with FUA executed.
    pub fua_writes: u64,
}

impl TargetCounters {
    fn add(&mut self, s: &Snapshot) {
        for e in &s.exports {
            let r = &e.requests;
            self.executed += r.read + r.write + r.flush + r.discard + r.write_zeroes + r.block_status;
            self.flushes += r.flush;
            self.fua_writes += e.fua_writes;
        }
    }
}

/// How [`RamTarget::restart`] restarts the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// The process dies: its links go silent at once (nothing more is sent or received, no
    /// DISCONNECT), then a new process starts on the same storage.
    Crash,
    /// SIGTERM: `tyched` finishes what is in flight, flushes, says DISCONNECT SHUTDOWN on every
    /// channel and exits; a new process starts on the same storage.
    Graceful,
}

/// A target's end of a link: shared with every process of a restarted target (a NIC outlives
/// its daemon), and silenced while one crashes.
type TargetPort = Shared<FaultInjector<Box<dyn FrameTransport + Send>>>;

/// `tyched` serving one in-RAM export in-process; stops when dropped.
pub struct RamTarget {
    /// The export's bytes (a memfd).
    storage: File,
    config: Config,
    ports: Vec<TargetPort>,
    running: Mutex<Running>,
}

struct Running {
    handle: Option<TargetHandle>,
    /// Counters of the processes before this one.
    before: TargetCounters,
}

impl std::fmt::Debug for RamTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RamTarget").field("config", &self.config).finish_non_exhaustive()
    }
}

/// Timers for the initiator of an in-process target: quicker than the LAN defaults so tests
/// fail over fast, and shorter-lived than the target's channels ([`TARGET_DEAD_AFTER`]).
pub fn initiator_timers() -> Timers {
    Timers { dead_after: Duration::from_millis(600), keepalive: Duration::from_millis(100), ..Timers::default() }
}

impl RamTarget {
    /// Starts `tyched` for `export` on `ports` (one per NIC).
    pub fn spawn(export: RamExport, ports: Vec<Box<dyn FrameTransport + Send>>) -> io::Result<RamTarget> {
        if export.size == 0 || export.size % SECTOR_SIZE as u64 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("export size {} is not a positive multiple of {SECTOR_SIZE}", export.size),
            ));
        }
        let storage = memfd(&export.name)?;
        storage.set_len(export.size)?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", storage.as_raw_fd()));
        let config = Config {
            exports: vec![ExportConfig { read_only: export.read_only, ..ExportConfig::file(&export.name, path, None) }],
            workers: 2,
            dead_after_ms: TARGET_DEAD_AFTER.as_millis() as u64,
            ..Config::default()
        };
        let ports: Vec<TargetPort> = ports
            .into_iter()
            .enumerate()
            .map(|(k, p)| {
                let seed = 0x7a26_0000 + k as u64;
                Shared::new(FaultInjector::new(p, FaultConfig::default(), FaultConfig::default(), seed))
            })
            .collect::<io::Result<_>>()?;
        let handle = start(&config, &ports)?;
        let running = Mutex::new(Running { handle: Some(handle), before: TargetCounters::default() });
        Ok(RamTarget { storage, config, ports, running })
    }

    /// Restarts the target as a new process would start on the same storage (the bytes stay,
    /// as a file export's would): every session and ledger is forgotten, so initiators get
    /// UNKNOWN_SESSION when they reconnect. Returns once the new process serves.
    pub fn restart(&self, how: Restart) -> io::Result<()> {
        let mut r = self.lock();
        if let Some(old) = r.handle.take() {
            if how == Restart::Crash {
                self.silence(true);
            }
            let last = old.shutdown();
            r.before.add(&last);
            self.silence(false);
        }
        r.handle = Some(start(&self.config, &self.ports)?);
        Ok(())
    }

    /// Requests executed so far, over every restart.
    pub fn counters(&self) -> TargetCounters {
        let r = self.lock();
        let mut c = r.before;
        if let Some(h) = &r.handle {
            c.add(&h.stats());
        }
        c
    }

    /// `tyched`'s counters now (of the running process).
    pub fn stats(&self) -> Option<Snapshot> {
        self.lock().handle.as_ref().map(TargetHandle::stats)
    }

    /// The durability epoch the target presents (derived from the export's file, so the same
    /// across restarts).
    pub fn durability_epoch(&self) -> io::Result<tyche_wire::DurabilityEpoch> {
        tyched::epoch::of_file(&self.storage)
    }

    /// A copy of `len` bytes of the export at `offset` (for checks).
    pub fn snapshot(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.storage.read_exact_at(&mut v, offset).expect("reading the export's memfd");
        v
    }

    fn lock(&self) -> MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drops every frame both ways on every port (a crashed process sends and hears nothing).
    fn silence(&self, down: bool) {
        let f = FaultConfig { down, ..FaultConfig::default() };
        for p in &self.ports {
            p.lock().set_faults(f, f);
        }
    }
}

impl Drop for RamTarget {
    fn drop(&mut self) {
        if let Some(h) = self.lock().handle.take() {
            h.shutdown();
        }
    }
}

/// A process of the target on `ports`.
fn start(config: &Config, ports: &[TargetPort]) -> io::Result<TargetHandle> {
    let nics = ports
        .iter()
        .enumerate()
        .map(|(k, p)| Nic { name: format!("mem{k}"), transport: Box::new(p.clone()) })
        .collect();
    Target::start(config.clone(), nics).map_err(|e| io::Error::other(format!("starting the in-process tyched: {e}")))
}

/// An anonymous RAM file (`memfd_create`).
fn memfd(name: &str) -> io::Result<File> {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(format!("tyche-loopback-{name}").as_str(), MFdFlags::MFD_CLOEXEC).map_err(io::Error::from)?;
    Ok(File::from(fd))
}

/// Joins a new [`RamTarget`] for `export` to `n` initiator links over [`MemLink`]s, each behind
/// a switchable [`FaultInjector`] (see [`set_link_down`]).
pub fn mem_links(export: RamExport, n: usize) -> io::Result<(Vec<Link>, Vec<FaultyPort>, RamTarget)> {
    let mut links = Vec::new();
    let mut switches = Vec::new();
    let mut target_ports: Vec<Box<dyn FrameTransport + Send>> = Vec::new();
    for k in 0..n {
        let (imac, tmac) = (MacAddr::local(0x100 + k as u32), MacAddr::local(0x200 + k as u32));
        let (i, t) = MemLink::pair((imac, tmac), MEM_MTU, MEM_FRAME, MEM_DEPTH);
        let f = FaultInjector::new(i, FaultConfig::default(), FaultConfig::default(), 0x5eed + k as u64);
        let shared = Shared::new(f)?;
        switches.push(shared.clone());
        links.push(Link { name: format!("mem{k}"), transport: Box::new(shared), target: tmac, node: None });
        target_ports.push(Box::new(t));
    }
    let target = RamTarget::spawn(export, target_ports)?;
    Ok((links, switches, target))
}
