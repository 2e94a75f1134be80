//! The target runtime: network threads that share the channel engine and own the transports,
//! and storage workers in a bounded queue per NUMA node.
//!
//! ```text
//!  transports ──recv──▶ network thread ──jobs (bounded, per node)──▶ node's storage workers ──▶ backend
//!      ▲                 (Acceptor, TargetSessions,                        │
//!      └────send──────── slot memory, timers)  ◀──completions (per network thread)+wake──┘
//! ```
//!
//! A network thread polls the transports it was given, answers DISCOVER/CONNECT (with the
//! MAC allow-list and the key proof in front of the [`Acceptor`]), places write data into the
//! request's `damq` slot memory, hands executable requests to the workers of its channel's
//! node (`crate::workers`) together with that slot memory, and sends completions and read data
//! when the workers hand them back to it (each network thread has its own done queue). When
//! nothing is due it sleeps in `poll(2)` on the transports' readiness descriptors and an eventfd
//! the workers signal, until the engine's next timer.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tyche_channel::auth::{self, ProofInput, Psk};
use tyche_channel::{
    Accepted, Acceptor, DropReason, ExportGeometry, ExportSpec, FrameDrop, Instant, KeyedConnect, TargetEvent,
    TargetInbound, TargetSession,
};
use tyche_transport::poll::{Next, PollConfig, PollStats, Poller, SchedStat};
use tyche_transport::wake::WakeFd;
use tyche_transport::{FrameTransport, Lease, Sent, TxChunk};
use tyche_wire::{
    flags, layout, Challenge, ChannelParams, Envelope, Frame, Kind, MacAddr, Message, Op, Reject, RejectReason,
    Request, Status, DATA_FRAME_OVERHEAD, SECTOR_SIZE,
};

use crate::backend::{Backend, BackendError, FileBackend, Memory, RamBackend};
use crate::config::{Config, NetworkThreads};
use crate::stats::{
    ChannelSnapshot, Drops, ExportStats, LimitStats, NicPlacement, NicStats, PollReport, Snapshot, StorageQueueStats,
};
use crate::workers::{DoneRoute, JobQueues, StoragePlan, ThreadStat};

/// Frames received per transport per loop turn.
const RX_BUDGET: usize = 64;
/// Frames sent per transport per loop turn.
const TX_BUDGET: usize = 256;
use crate::workers::JOB_QUEUE;
/// How long a CHALLENGE may be answered.
const CHALLENGE_LIFETIME: Duration = Duration::from_secs(5);
/// Longest sleep when some transport has no readiness descriptor (in-memory links).
const POLL_CAP_NO_FD: Duration = Duration::from_millis(1);
/// Longest sleep otherwise (the stop flag and stats requests are also signalled on the eventfd).
const POLL_CAP: Duration = Duration::from_millis(100);
/// How long shutdown waits for storage and for the last completions to be acknowledged.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// A session whose channels are all dead is dropped after this grace period when it never
/// carried a frame after its handshake (`reclaim_after_ms` otherwise).
const RECLAIM_GRACE: Duration = Duration::from_millis(500);

/// Errors starting a target.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// An export could not be opened.
    #[error("export[{index}] ({name}): {source}")]
    Backend {
        /// Index in the config.
        index: usize,
        /// Name.
        name: String,
        /// Why.
        source: BackendError,
    },
    /// No transport to serve on.
    #[error("no transport to serve on")]
    NoTransport,
    /// A thread or descriptor could not be created.
    #[error("{0}")]
    Os(#[from] std::io::Error),
}

/// Placement of the target's threads and memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// NUMA node of the serving NICs: RAM exports and slot memory are bound to it.
    pub node: Option<u32>,
    /// CPUs for the network thread (or, with one thread per NIC, for those NICs that have no
    /// entry in `nic_cpus`).
    pub network_cpus: Vec<u32>,
    /// CPUs for the network thread of each NIC, in the order of the `nics` given to
    /// [`Target::start_placed`] (with `network_threads = "per-nic"`); missing or empty entries
    /// use `network_cpus`.
    pub nic_cpus: Vec<Vec<u32>>,
    /// CPUs for the storage workers of the pool (without `storage`).
    pub worker_cpus: Vec<u32>,
    /// The storage workers per node (the placement plan's completion workers) and each NIC's
    /// queue; `None`: one pool of `config.workers` workers on `worker_cpus`.
    pub storage: Option<StoragePlan>,
    /// NICs on several nodes: the network thread's memory policy is bound to these nodes, so
    /// that automatic NUMA balancing does not move the pages it touches towards the CPU it
    /// happens to run on (`tyche_numa::alloc::bind_thread_memory_to`).
    pub memory_nodes: Vec<u32>,
}

/// A transport with the name it is shown under.
pub struct Nic {
    /// Interface name (or any label).
    pub name: String,
    /// The transport.
    pub transport: Box<dyn FrameTransport + Send>,
}

impl std::fmt::Debug for Nic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nic").field("name", &self.name).finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Export {
    spec: ExportSpec,
    backend: Arc<dyn Backend>,
    /// Whether its storage requests go to the io_uring engine (else the pool, or inline for RAM).
    uring: bool,
    /// Whether write data may stay in the received frames ([`Backend::writes_from_frames`]).
    lend: bool,
    allow: Vec<MacAddr>,
    key: Option<Psk>,
    read_only: bool,
    /// Several initiators may attach at once.
    shared: bool,
}

#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    wake: WakeFd,
    stats_requested: AtomicU64,
    snapshot: Mutex<(u64, Snapshot)>,
    published: Condvar,
}

impl Shared {
    fn wake(&self) {
        self.wake.wake();
    }
}

/// A rate limit for log lines a peer can cause (refusals, sessions and channels opening and
/// dying, storage errors): at most [`RateLimit::PER_SECOND`] lines a second pass, the rest are
/// counted (`limits.warnings_suppressed`). Lock-free: storage threads use it too.
#[derive(Debug)]
pub(crate) struct RateLimit {
    second: AtomicU64,
    used: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimit {
    const PER_SECOND: u64 = 20;

    const fn new() -> Self {
        RateLimit { second: AtomicU64::new(0), used: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// Whether a line may be logged now.
    pub(crate) fn allow(&self) -> bool {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let now = START.get_or_init(std::time::Instant::now).elapsed().as_secs() + 1;
        if self.second.swap(now, Ordering::Relaxed) != now {
            self.used.store(0, Ordering::Relaxed);
        }
        if self.used.fetch_add(1, Ordering::Relaxed) < Self::PER_SECOND {
            return true;
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        false
    }

    fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

/// The log rate limit of this process's targets.
pub(crate) static PEER_LOGS: RateLimit = RateLimit::new();

/// A storage request for a worker.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) session: u64,
    pub(crate) channel: u16,
    /// Which instance of channel `channel` (a reconnect on the same index is a new one).
    pub(crate) epoch: u64,
    pub(crate) export: usize,
    pub(crate) request: Request,
    pub(crate) buf: Option<Memory>,
    /// Write data kept in the frames it arrived in, by offset (the rest is in `buf`).
    pub(crate) lent: Vec<LentSegment>,
    /// Read data goes straight into these transmit chunks (one per segment), not `buf`.
    pub(crate) region: Option<Region>,
    pub(crate) abort: bool,
    /// Names the job while storage has it (0 in tests that build jobs by hand).
    pub(crate) id: u64,
    /// Set when the job's session is fenced: a job not started by then is not run.
    pub(crate) fence: Option<Arc<AtomicBool>>,
    /// The NIC of its channel: its node's queue runs it, and its network thread completes it.
    pub(crate) nic: Option<usize>,
}

/// Transmit chunks a NIC's transport lent for good, holding one request's read data: segment
/// `i` (of `seg` bytes) lies right after the room for a DATA frame's headers in chunk `i`, so
/// the frame is sent from there once the headers are written in front.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) chunks: Vec<TxChunk>,
    pub(crate) seg: u32,
    pub(crate) nic: usize,
    /// The read whose data it holds.
    pub(crate) tag: u64,
}

/// Write data left in the received frame it arrived in: the `len` bytes at `addr` are bytes
/// `offset..offset + len` of the request's data. The lease keeps them there, unchanged.
#[derive(Debug)]
pub(crate) struct LentSegment {
    pub(crate) offset: u32,
    pub(crate) len: u32,
    pub(crate) addr: usize,
    /// The NIC whose transport lent the frame (it gets the lease back).
    pub(crate) nic: usize,
    pub(crate) lease: Lease,
}

impl Job {
    /// The request's write data in order: the payloads of the kept frames, and slot memory
    /// for the parts that were copied there. `None` if they do not add up (kept segments out of
    /// order or past the end, or copied parts with no slot memory): the write must not run.
    pub(crate) fn write_pieces(&self) -> Option<Vec<&[u8]>> {
        let len = self.request.length as usize;
        let mem = self.buf.as_ref().map(Memory::as_slice);
        let mut out = Vec::with_capacity(self.lent.len() + 1);
        let mut at = 0usize;
        for seg in &self.lent {
            let (o, l) = (seg.offset as usize, seg.len as usize);
            if o < at || o + l > len {
                return None;
            }
            if o > at {
                out.push(mem?.get(at..o)?);
            }
            // SAFETY: `addr..addr + len` lies within the frame the lease names (checked with
            // `Lease::covers` when the frame was kept), and while the lease lives the transport
            // neither reuses nor unmaps that memory; `self` holds the lease for the borrow.
            out.push(unsafe { std::slice::from_raw_parts(seg.addr as *const u8, l) });
            at = o + l;
        }
        if at < len {
            out.push(mem?.get(at..len)?);
        }
        Some(out)
    }

    /// Whether the job is not to run: the target stops, its channel died, or its session was
    /// fenced by a new attachment of the same initiator.
    pub(crate) fn aborted(&self) -> bool {
        self.abort || self.fence.as_ref().is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// Whether the job's data has a place to come from or go to (checked before storage runs).
    pub(crate) fn places_ok(&self) -> bool {
        let len = self.request.length as usize;
        match self.request.op {
            Op::Read if self.region.is_some() => true,
            Op::Read => self.buf.as_ref().is_some_and(|b| b.as_slice().len() >= len),
            Op::BlockStatus => self.buf.as_ref().is_some_and(|b| b.as_slice().len() >= layout::block_status::LEN),
            Op::Write => self.write_pieces().is_some(),
            _ => true,
        }
    }

    /// Where the read data goes when it goes straight into transmit chunks: one place per
    /// segment, right after the room for the DATA frame's headers.
    pub(crate) fn read_places(&mut self) -> Vec<&mut [u8]> {
        let len = self.request.length as usize;
        let region = self.region.as_ref().expect("a read region");
        let seg = region.seg as usize;
        assert_eq!(region.chunks.len(), len.div_ceil(seg), "one chunk per segment");
        region
            .chunks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let n = seg.min(len - i * seg);
                assert!(DATA_FRAME_OVERHEAD + n <= c.capacity(), "a segment and its headers fit a chunk");
                // SAFETY: the chunk was lent to this target for good and lies in memory it keeps
                // mapped; while this job holds the region no frame is sent from it and the kernel
                // has none of it in flight (regions are handed out only when idle), so this is
                // the only reference to these bytes, and the places of distinct chunks are
                // disjoint.
                unsafe { std::slice::from_raw_parts_mut((c.frame_addr() + DATA_FRAME_OVERHEAD) as *mut u8, n) }
            })
            .collect()
    }
}

/// A finished storage request: the job, with its buffers, and how it went.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) job: Job,
    pub(crate) status: Status,
}

pub(crate) fn execute(backend: &dyn Backend, job: &mut Job) -> Status {
    if job.aborted() {
        return Status::Aborted;
    }
    let r = job.request;
    let len = r.length as usize;
    let res = match r.op {
        Op::Read if job.region.is_some() => backend.read_vectored_at(&mut job.read_places(), r.offset),
        Op::Read => match job.buf.as_mut().and_then(|b| b.as_mut_slice().get_mut(..len)) {
            Some(place) => backend.read_at(place, r.offset),
            None => return Status::Invalid,
        },
        Op::Write => match job.write_pieces() {
            Some(pieces) if !job.lent.is_empty() => backend.write_vectored_at(&pieces, r.offset, r.fua),
            Some(pieces) => backend.write_at(pieces.first().copied().unwrap_or_default(), r.offset, r.fua),
            None => return Status::Invalid,
        },
        Op::Flush => backend.flush(),
        Op::Discard => backend.discard(r.offset, r.length as u64),
        Op::WriteZeroes => backend.write_zeroes(r.offset, r.length as u64),
        Op::BlockStatus => {
            let Some(place) = job.buf.as_mut().and_then(|b| b.as_mut_slice().get_mut(..layout::block_status::LEN))
            else {
                return Status::Invalid;
            };
            match backend.block_status(r.offset, r.length as u64, layout::block_status::MAX_EXTENTS) {
                Ok(Some(extents)) if !extents.is_empty() => {
                    tyche_wire::emit_block_status(extents, place);
                    Ok(())
                }
                Ok(_) => return Status::Unsupported,
                Err(e) => Err(e),
            }
        }
    };
    match res {
        Ok(()) => Status::Ok,
        Err(e) => {
            if PEER_LOGS.allow() {
                tracing::warn!(op = ?r.op, offset = r.offset, length = r.length, "storage error: {e}");
            }
            if e.raw_os_error() == Some(libc::ENOSPC) {
                Status::NoSpace
            } else {
                Status::IoError
            }
        }
    }
}

/// [`execute`], with a panic (a bug) turned into an I/O error for that request alone.
pub(crate) fn execute_contained(backend: &dyn Backend, job: &mut Job) -> Status {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| execute(backend, job))).unwrap_or_else(|_| {
        tracing::error!(op = ?job.request.op, "storage request panicked; failed with an I/O error");
        Status::IoError
    })
}

/// Starts targets.
#[derive(Debug)]
pub struct Target;

/// A running target.
#[derive(Debug)]
pub struct TargetHandle {
    shared: Arc<Shared>,
    /// The network threads (one per NIC, or one for all).
    network: Vec<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
}

impl Target {
    /// Opens the exports of `config` and serves them on `nics`, with RAM and slot memory on no
    /// particular node.
    pub fn start(config: Config, nics: Vec<Nic>) -> Result<TargetHandle, StartError> {
        Target::start_placed(config, nics, Placement::default())
    }

    /// As [`Target::start`], placing memory and threads as `placement` says.
    pub fn start_placed(config: Config, nics: Vec<Nic>, placement: Placement) -> Result<TargetHandle, StartError> {
        let Built { net, nics, groups, shared, workers } = build(config, nics, &placement)?;
        let engine = Arc::new(Mutex::new(net));
        let mut slots: Vec<Option<Nic>> = nics.into_iter().map(Some).collect();
        let mut network = Vec::new();
        for (g, members) in groups.iter().enumerate() {
            let mine: Vec<(usize, Nic)> =
                members.iter().map(|&k| (k, slots[k].take().expect("each NIC in one group"))).collect();
            let cpus = match members[..] {
                [k] => placement.nic_cpus.get(k).filter(|c| !c.is_empty()).unwrap_or(&placement.network_cpus).clone(),
                _ => placement.network_cpus.clone(),
            };
            // A thread serving NICs on several nodes binds its memory policy to them.
            let memory_nodes = if members.len() > 1 { placement.memory_nodes.clone() } else { Vec::new() };
            let name = if groups.len() == 1 { "tyched-net".to_owned() } else { format!("tyched-net{g}") };
            let engine = Arc::clone(&engine);
            let shared = Arc::clone(&shared);
            network.push(std::thread::Builder::new().name(name).spawn(move || {
                pin(&cpus, "network thread");
                if !memory_nodes.is_empty() {
                    if let Err(e) = tyche_numa::alloc::bind_thread_memory_to(&memory_nodes) {
                        tracing::warn!(nodes = ?memory_nodes, "cannot bind the network thread's memory policy: {e}");
                    }
                }
                {
                    // The placement report shows each NIC's serving thread as it sees itself.
                    let me = tyche_numa::report::this_thread();
                    let mut net = lock_engine(&engine);
                    for (k, _) in &mine {
                        net.nic_thread[*k] = Some(me.clone());
                    }
                }
                let wakes = lock_engine(&engine).group_wakes.clone();
                serve_group(g, mine, &engine, &wakes, &shared);
            })?);
        }
        Ok(TargetHandle { shared, network, workers })
    }
}

/// A target's engine, its NICs and its storage threads, before any network thread runs.
struct Built {
    net: Network,
    nics: Vec<Nic>,
    /// NIC indices served by each network thread.
    groups: Vec<Vec<usize>>,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

/// Locks the engine. A panic on a network thread is contained per session (see
/// [`Network::guarded`]), so the lock is taken even if an earlier holder panicked: the state is
/// still consistent for every other session.
fn lock_engine(engine: &Mutex<Network>) -> std::sync::MutexGuard<'_, Network> {
    engine.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Opens the exports, starts the storage threads and builds the engine state.
fn build(config: Config, mut nics: Vec<Nic>, placement: &Placement) -> Result<Built, StartError> {
    config.validate()?;
    if nics.is_empty() {
        return Err(StartError::NoTransport);
    }
    let mut exports = Vec::new();
    for (index, e) in config.exports.iter().enumerate() {
        let backend: Arc<dyn Backend> = match &e.path {
            None => Arc::new(
                RamBackend::new(e.size.expect("validated").0, placement.node)
                    .map_err(|source| StartError::Backend { index, name: e.name.clone(), source })?,
            ),
            Some(p) => Arc::new(
                FileBackend::open(p, e.size.map(|s| s.0), e.read_only, e.direct)
                    .map_err(|source| StartError::Backend { index, name: e.name.clone(), source })?,
            ),
        };
        let mut f = flags::EXPORT_DISCARD;
        if e.read_only {
            f |= flags::EXPORT_READ_ONLY;
        }
        if e.keyed() {
            f |= flags::EXPORT_NEEDS_KEY;
        }
        if e.encrypt {
            f |= flags::EXPORT_ENCRYPTED;
        }
        tracing::info!(export = %e.name, backend = backend.kind(), size = backend.size(), read_only = e.read_only,
                keyed = e.keyed(), encrypted = e.encrypt, "export ready");
        if e.key.is_some() {
            tracing::warn!(export = %e.name, "an inline key in the configuration is deprecated: put it in a file only its owner can read and name it in key_file");
        }
        exports.push(Export {
            spec: ExportSpec {
                name: e.name.clone(),
                size: backend.size(),
                block_size: SECTOR_SIZE,
                flags: f,
                durability_epoch: backend.durability_epoch(),
            },
            lend: backend.writes_from_frames(),
            backend,
            uring: false,
            allow: e.allowed_macs(),
            key: e
                .key_bytes()
                .map_err(|m| crate::config::ConfigError::Invalid {
                    field: format!("export[{index}].key_file"),
                    message: m,
                })?
                .map(|k| Psk::new(&k)),
            read_only: e.read_only,
            shared: e.shared,
        });
    }
    // The segment must fit every NIC's MTU and buffers.
    let segment = nics
        .iter()
        .filter_map(|n| tyche_wire::segment_size_for(n.transport.mtu(), n.transport.frame_capacity()))
        .min()
        .unwrap_or(SECTOR_SIZE)
        .min(config.limits.segment as u32) as u16;
    let l = config.limits;
    let limit = ChannelParams {
        ring: l.ring,
        remq_slots: l.remq_slots,
        damq_slots: l.damq_slots,
        segment,
        max_io: l.max_io,
        // Granted to initiators that ask: a CRC32C of every DATA payload.
        features: flags::FEATURE_DIGEST | flags::FEATURE_BLOCK_STATUS,
    };
    let timers = config.timers();
    let acceptor = Acceptor::new(config.ethertype, exports.iter().map(|e| e.spec.clone()).collect(), limit, timers)
        .with_limits(config.limits.acceptor());

    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        wake: WakeFd::new()?,
        stats_requested: AtomicU64::new(0),
        snapshot: Mutex::new((0, Snapshot::default())),
        published: Condvar::new(),
    });
    let backends: Vec<Arc<dyn Backend>> = exports.iter().map(|e| Arc::clone(&e.backend)).collect();
    let n_nics = nics.len();
    let groups: Vec<Vec<usize>> = match config.network_threads {
        NetworkThreads::One => vec![(0..n_nics).collect()],
        NetworkThreads::PerNic => (0..n_nics).map(|k| vec![k]).collect(),
    };
    let mut group_of = vec![0; n_nics];
    for (g, members) in groups.iter().enumerate() {
        for &k in members {
            group_of[k] = g;
        }
    }
    let group_wakes = groups.iter().map(|_| WakeFd::new().map(Arc::new)).collect::<std::io::Result<Vec<_>>>()?;
    // Completions go back to the network thread of their channel's NIC.
    let (done_txs, done_rx): (Vec<_>, Vec<_>) = groups.iter().map(|_| mpsc::channel::<Done>()).unzip();
    let route = DoneRoute::new(done_txs, group_wakes.clone(), group_of.clone());
    // RAM exports execute on the network thread: the workers serve file and block exports
    // (where io_uring is not used).
    let files = exports.iter().any(|e| e.backend.as_file().is_some());
    let storage = match &placement.storage {
        Some(plan) if config.workers == 0 && plan.nic_queue.len() == n_nics => plan.clone(),
        _ => {
            let n = match config.workers {
                0 => std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8),
                n => n,
            };
            StoragePlan::pool(n, &placement.worker_cpus, placement.node, n_nics)
        }
    };
    let (jobs, job_rx) = JobQueues::new(storage.nodes.len(), JOB_QUEUE, storage.nic_queue.clone());
    let mut workers = Vec::new();
    let mut threads = Vec::new();
    let mut n_workers = 0;
    if files {
        for (q, (node, rx)) in storage.nodes.iter().zip(job_rx).enumerate() {
            workers.extend(crate::workers::start_workers(node, q, n_workers, rx, &backends, &route, &mut threads)?);
            n_workers += node.workers.len();
            tracing::info!(node = ?node.node, workers = node.workers.len(), cpus = ?node.workers.iter().map(|w| w.cpus.clone()).collect::<Vec<_>>(),
                fallback = node.fallback, "storage workers");
        }
    }
    // File and block exports use io_uring where the kernel allows it (a ring per storage
    // queue, on that queue's node), else the pool.
    let mut uring = Vec::new();
    if files {
        let rings: Result<Vec<_>, String> = if config.io_uring {
            storage.nodes.iter().map(|_| crate::uring::open()).collect()
        } else {
            Err("disabled (io_uring = false)".into())
        };
        match rings {
            Ok(rings) => {
                let mut fallocate = true;
                for (q, (ring, node)) in rings.into_iter().zip(&storage.nodes).enumerate() {
                    let stat =
                        ThreadStat::new(format!("tyched-uring{q}"), "io_uring", node.node, node.ring_cpus.clone(), q);
                    threads.push(Arc::clone(&stat));
                    let (queue, thread) =
                        crate::uring::start(ring, backends.clone(), route.clone(), jobs.sender(q), stat)?;
                    fallocate &= queue.fallocate;
                    workers.push(thread);
                    uring.push(queue);
                }
                tracing::info!(depth = crate::uring::DEPTH, rings = uring.len(), fallocate, "io_uring storage engine");
                for e in exports.iter_mut().filter(|e| e.backend.as_file().is_some()) {
                    e.uring = true;
                }
            }
            Err(reason) if config.io_uring => {
                tracing::warn!(
                    workers = n_workers,
                    "io_uring unavailable ({reason}): file and block exports use the thread pool"
                );
            }
            Err(reason) => {
                tracing::info!(workers = n_workers, "io_uring {reason}: file and block exports use the thread pool")
            }
        }
    }
    drop(route);
    let storage_queues = storage
        .nodes
        .iter()
        .enumerate()
        .map(|(q, n)| StorageQueueStats {
            node: n.node,
            nics: (0..n_nics).filter(|&k| storage.nic_queue[k] == q).map(|k| nics[k].name.clone()).collect(),
            fallback: n.fallback,
            ..StorageQueueStats::default()
        })
        .collect();
    let nic_stats = nics
        .iter()
        .map(|n| NicStats { name: n.name.clone(), mac: n.transport.local_mac().to_string(), ..NicStats::default() })
        .collect();
    let export_stats = exports
        .iter()
        .map(|e| ExportStats {
            name: e.spec.name.clone(),
            backend: e.backend.kind().into(),
            size: e.spec.size,
            read_only: e.read_only,
            keyed: e.key.is_some(),
            io: if e.uring {
                "io_uring"
            } else if e.backend.kind() == "ram" {
                "inline"
            } else {
                "threads"
            }
            .into(),
            ..ExportStats::default()
        })
        .collect();
    let mut net = Network {
        ethertype: config.ethertype,
        nic_stats,
        exports,
        export_stats,
        acceptor,
        sessions: BTreeMap::new(),
        slots: HashMap::new(),
        lent: HashMap::new(),
        release: (0..n_nics).map(|_| Vec::new()).collect(),
        tx_free: Vec::new(),
        tx_draining: (0..n_nics).map(|_| Vec::new()).collect(),
        regions: HashMap::new(),
        in_region: HashSet::new(),
        leases_held: 0,
        slot_len: l.max_io as usize,
        node: placement.node,
        nic_node: Vec::new(),
        nic_areas: Vec::new(),
        nic_thread: Vec::new(),
        jobs,
        uring,
        done_rx,
        storage_threads: threads,
        storage_queues,
        inflight: 0,
        control: Vec::new(),
        challenges: HashMap::new(),
        rx_scratch: Vec::new(),
        challenge_order: VecDeque::new(),
        challenges_by_mac: HashMap::new(),
        limits: config.limits,
        limit_stats: LimitStats::default(),
        slot_bytes: 0,
        short: HashMap::new(),
        waiting_memory: VecDeque::new(),
        reclaim_after: Duration::from_millis(config.reclaim_after_ms),
        running: HashMap::new(),
        deadlines: std::collections::BTreeSet::new(),
        storage_deadline: Duration::from_millis(config.storage_deadline_ms),
        timed_out: HashSet::new(),
        storage_timeouts: 0,
        next_job: 0,
        fenced: 0,
        clock: std::time::Instant::now(),
        skew: Duration::ZERO,
        shared: Arc::clone(&shared),
        payload_copied: 0,
        payload_copied_write: 0,
        reclaimed: 0,
        duplicates_from_reclaimed: 0,
        stopping: None,
        nic_down: vec![false; n_nics],
        group_of,
        group_wakes: group_wakes.clone(),
        sleeping: vec![false; groups.len()],
        poll: config.poll_config()?,
        poll_stats: vec![PollStats::default(); groups.len()],
        closing: false,
        exited: 0,
    };
    // Slot memory of a channel goes on its NIC's node (where the transport put its UMEM),
    // else where the placement says. The transports' memory does not move: where it is is
    // read once here, for the placement report.
    net.nic_node = nics.iter().map(|n| n.transport.numa_node().or(placement.node)).collect();
    net.nic_areas = nics.iter().map(|n| n.transport.memory_areas()).collect();
    // Read data goes straight into transmit chunks the transports lend, where the exports
    // can read into them.
    let in_place = net.exports.iter().any(|e| e.lend);
    net.tx_free =
        nics.iter_mut().map(|n| if in_place { n.transport.lend_tx_chunks(usize::MAX) } else { Vec::new() }).collect();
    net.nic_thread = vec![None; n_nics];
    net.control = (0..n_nics).map(|_| VecDeque::new()).collect();
    tracing::info!(nics = n_nics, threads = groups.len(), "serving");
    Ok(Built { net, nics, groups, shared, workers })
}

/// What one turn of a network thread left to do.
struct Turn {
    /// Something happened: go round again without sleeping.
    busy: bool,
    /// How long to sleep at most when not busy.
    timeout: Duration,
    /// Other network threads (groups) that now have frames to send.
    wake: Vec<usize>,
    /// The target has stopped: exit.
    exit: bool,
    /// Per NIC of the thread: whether to poll it (false once its transport failed for good).
    live: Vec<bool>,
}

/// The loop of the network thread serving the NICs `nics` (group `g`): a turn of the engine
/// under its lock, then, outside it, the transports' flush (the AF_XDP kick) and, when the
/// poller says so ([`Poller`]: after a while without work), the sleep.
fn serve_group(g: usize, mut nics: Vec<(usize, Nic)>, engine: &Mutex<Network>, wakes: &[Arc<WakeFd>], shared: &Shared) {
    let mut poller = Poller::new(lock_engine(engine).poll);
    let run_queue = SchedStat::of_this_thread();
    loop {
        let turn = {
            let mut net = lock_engine(engine);
            net.poll_stats[g] = poller.stats();
            net.turn(g, &mut nics)
        };
        for (_, nic) in nics.iter_mut() {
            if let Err(e) = nic.transport.flush() {
                tracing::warn!(nic = %nic.name, "flush failed: {e}");
            }
        }
        for &h in &turn.wake {
            wakes[h].wake();
        }
        if turn.exit {
            return;
        }
        let now = std::time::Instant::now();
        run_queue.feed(&mut poller, now);
        match poller.turn(now, turn.busy) {
            // Polling with nothing to do: let a thread that shares the core run.
            Next::Poll if !turn.busy => std::thread::yield_now(),
            Next::Poll => {}
            Next::Sleep => sleep(&nics, &turn.live, turn.timeout, &wakes[g], shared),
        }
    }
}

/// Sleeps in `poll(2)` on the transports' descriptors, this thread's eventfd and the shared one
/// (storage completions, stats requests, stop), at most `timeout`.
fn sleep(nics: &[(usize, Nic)], live: &[bool], timeout: Duration, wake: &WakeFd, shared: &Shared) {
    use nix::poll::{PollFd, PollFlags, PollTimeout};
    let mut fds: Vec<PollFd<'_>> = nics
        .iter()
        .zip(live)
        .filter(|(_, live)| **live)
        .filter_map(|((_, n), _)| n.transport.readiness_fd())
        .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
        .collect();
    fds.push(PollFd::new(wake.as_fd(), PollFlags::POLLIN));
    fds.push(PollFd::new(shared.wake.as_fd(), PollFlags::POLLIN));
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128);
    if ms > 0 {
        let _ = nix::poll::poll(&mut fds, PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX));
    }
    wake.drain();
    shared.wake.drain();
}

pub(crate) fn pin(cpus: &[u32], what: &str) {
    if !cpus.is_empty() {
        if let Err(e) = tyche_numa::pin_current_thread(cpus) {
            tracing::warn!(?cpus, "could not pin the {what}: {e}");
        }
    }
}

impl TargetHandle {
    /// A fresh snapshot of the counters (waits up to a second for the network thread).
    pub fn stats(&self) -> Snapshot {
        let want = self.shared.stats_requested.fetch_add(1, Ordering::SeqCst) + 1;
        self.shared.wake();
        let guard = self.shared.snapshot.lock().expect("snapshot lock");
        let (guard, _) = self
            .shared
            .published
            .wait_timeout_while(guard, Duration::from_secs(1), |(gen, _)| {
                *gen < want && self.network.iter().any(|h| !h.is_finished())
            })
            .expect("snapshot lock");
        guard.1.clone()
    }

    /// A function that returns a fresh snapshot, for a stats server thread.
    pub fn stats_source(&self) -> impl Fn() -> Snapshot + Send + Sync + 'static {
        let shared = Arc::clone(&self.shared);
        move || {
            let want = shared.stats_requested.fetch_add(1, Ordering::SeqCst) + 1;
            shared.wake();
            let guard = shared.snapshot.lock().expect("snapshot lock");
            let (guard, _) = shared
                .published
                .wait_timeout_while(guard, Duration::from_secs(1), |(gen, _)| *gen < want)
                .expect("snapshot lock");
            guard.1.clone()
        }
    }

    /// Asks the target to stop (from a signal handler thread, say); [`TargetHandle::join`] waits.
    pub fn request_stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake();
    }

    /// How many network threads serve the NICs.
    pub fn network_threads(&self) -> usize {
        self.network.len()
    }

    /// Whether a network thread has exited (they exit together, after a stop or a panic).
    pub fn is_finished(&self) -> bool {
        self.network.is_empty() || self.network.iter().any(|h| h.is_finished())
    }

    /// Stops accepting, finishes (or aborts) in-flight requests, flushes every export and
    /// returns the final counters.
    pub fn shutdown(mut self) -> Snapshot {
        self.request_stop();
        self.join_inner()
    }

    /// Waits for the target to stop (after [`TargetHandle::request_stop`]).
    pub fn join(mut self) -> Snapshot {
        self.join_inner()
    }

    fn join_inner(&mut self) -> Snapshot {
        for h in self.network.drain(..) {
            if h.join().is_err() {
                tracing::error!("a network thread panicked");
            }
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        self.shared.snapshot.lock().expect("snapshot lock").1.clone()
    }
}

impl Drop for TargetHandle {
    fn drop(&mut self) {
        if !self.network.is_empty() {
            self.request_stop();
            self.join_inner();
        }
    }
}

/// A target driven on the caller's thread, for fuzzing and deterministic tests: every NIC is
/// served by [`Harness::turn`], no network thread runs, and the clock is real time plus whatever
/// [`Harness::advance`] added. RAM exports execute inside the turn; file exports use the storage
/// threads as in a daemon.
#[doc(hidden)]
pub struct Harness {
    net: Network,
    nics: Vec<(usize, Nic)>,
    _workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness").field("nics", &self.nics.len()).finish_non_exhaustive()
    }
}

impl Harness {
    /// Opens the exports of `config` and serves them on `nics` (one group, on this thread).
    pub fn new(mut config: Config, nics: Vec<Nic>) -> Result<Harness, StartError> {
        config.network_threads = NetworkThreads::One;
        let Built { net, nics, workers, .. } = build(config, nics, &Placement::default())?;
        Ok(Harness { net, nics: nics.into_iter().enumerate().collect(), _workers: workers })
    }

    /// One turn of the network loop over every NIC; whether anything happened.
    pub fn turn(&mut self) -> bool {
        let t = self.net.turn(0, &mut self.nics);
        for (_, nic) in self.nics.iter_mut() {
            let _ = nic.transport.flush();
        }
        t.busy
    }

    /// Moves the target's clock forward (timers, dead channels, reclaim).
    pub fn advance(&mut self, by: Duration) {
        self.net.skew += by;
    }

    /// The counters now.
    pub fn snapshot(&self) -> Snapshot {
        self.net.snapshot(self.net.now())
    }
}

#[derive(Debug)]
struct SessionState {
    session: TargetSession,
    export: usize,
    /// Channel index → NIC index.
    nic_of: BTreeMap<u16, usize>,
    /// Storage jobs outstanding per channel.
    executing: BTreeMap<u16, u64>,
    /// Instance of each channel index (bumped when a reconnect replaces a channel), so that slot
    /// memory of a replaced channel's requests still executing is never mixed with the new one's.
    epochs: BTreeMap<u16, u64>,
    all_dead_since: Option<Instant>,
    /// Whether any channel of it carried a frame after its handshake (reclaim grace).
    established: bool,
    /// Who attached: the host id the initiator sent, else one made from its MAC.
    identity: [u8; 16],
    /// The MAC that created it (named to another initiator refused IN_USE).
    mac: MacAddr,
    /// Set when a new attachment of the same initiator fenced this session.
    fenced: Arc<AtomicBool>,
    /// Fenced sessions whose storage requests must all end before this one's first runs.
    waits_for: Vec<u64>,
}

/// The identity of an initiator that sent no host id: its MAC, marked as such.
fn mac_identity(mac: MacAddr) -> [u8; 16] {
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(b"mac:");
    id[4..10].copy_from_slice(&mac.octets());
    id
}

/// Slot memory of one `damq` slot: `None` while a worker holds it.
type Slot = Option<Memory>;
/// (session, channel, channel epoch, `damq` slot).
type SlotKey = (u64, u16, u64, u16);

/// Write data of one `damq` slot kept in received frames (for request `tag`), by offset.
#[derive(Debug)]
struct LentSlot {
    tag: u64,
    /// The slot generation the segments were placed in ([`TargetInbound::Write`]).
    generation: u32,
    segs: BTreeMap<u32, LentSegment>,
}

/// A CHALLENGE sent and not yet answered.
#[derive(Debug, Clone, Copy)]
struct PendingChallenge {
    target_nonce: u64,
    sent: Instant,
}

/// Requests deferred until slot memory is free: (session, channel, request, slot generation).
type Deferred = (u64, u16, Request, u32);

/// The engine state every network thread works on, under one lock (see docs/architecture.md,
/// "Network threads").
struct Network {
    ethertype: u16,
    nic_stats: Vec<NicStats>,
    exports: Vec<Export>,
    export_stats: Vec<ExportStats>,
    acceptor: Acceptor,
    sessions: BTreeMap<u64, SessionState>,
    slots: HashMap<SlotKey, Slot>,
    /// Write data kept in frames, per slot (beside or instead of the slot memory).
    lent: HashMap<SlotKey, LentSlot>,
    /// Leases to give back, per NIC (by the thread serving it).
    release: Vec<Vec<Lease>>,
    /// Write segments kept in frames: in `lent` or in storage jobs.
    leases_held: u64,
    /// Per NIC: transmit chunks its transport lent, free for read data.
    tx_free: Vec<Vec<TxChunk>>,
    /// Per NIC: chunks given up that the kernel may still be sending (checked by the NIC's
    /// thread before they are free again).
    tx_draining: Vec<Vec<TxChunk>>,
    /// Read data held in transmit chunks, per slot, until all of it is acknowledged.
    regions: HashMap<SlotKey, Region>,
    /// Slots whose current read data went into a region (never sent from stale slot memory).
    in_region: HashSet<SlotKey>,
    slot_len: usize,
    node: Option<u32>,
    /// NUMA node of each NIC's memory (slot memory of its channels goes there).
    nic_node: Vec<Option<u32>>,
    /// Each NIC's transport memory (UMEM, rings), for the placement report.
    nic_areas: Vec<Vec<tyche_transport::MemoryArea>>,
    /// Each NIC's serving thread, as it saw itself when it started.
    nic_thread: Vec<Option<tyche_numa::report::ThreadPlacement>>,
    /// The storage queue of each node, and the jobs waiting for room in them.
    jobs: JobQueues,
    /// The io_uring engine of each storage queue, when file and block exports use it (empty:
    /// they use the workers).
    uring: Vec<crate::uring::UringQueue>,
    /// Each network thread's finished jobs (those of its NICs' channels).
    done_rx: Vec<mpsc::Receiver<Done>>,
    /// The storage threads (workers, io_uring threads) and what they did.
    storage_threads: Vec<Arc<ThreadStat>>,
    /// Each storage queue's node and NICs (jobs filled in by the snapshot).
    storage_queues: Vec<StorageQueueStats>,
    inflight: u64,
    /// Control replies (ACCEPT, REJECT, CHALLENGE, DISCOVER_REPLY) waiting per NIC.
    control: Vec<VecDeque<Vec<u8>>>,
    challenges: HashMap<(MacAddr, u64), PendingChallenge>,
    /// Pending challenges in the order sent (entries already forgotten are skipped).
    challenge_order: VecDeque<(MacAddr, u64)>,
    /// Pending challenges per initiator MAC, oldest first.
    challenges_by_mac: HashMap<MacAddr, VecDeque<u64>>,
    /// The plaintext of the last frame of an encrypting channel.
    rx_scratch: Vec<u8>,
    /// The limits in force.
    limits: crate::config::Limits,
    /// What they refused or held back.
    limit_stats: LimitStats,
    /// Slot memory allocated (at most `limits.slot_memory`).
    slot_bytes: u64,
    /// Slots whose copied write data of this generation could not be kept (no slot memory):
    /// that write fails instead of running with holes.
    short: HashMap<SlotKey, u32>,
    /// Reads waiting for slot memory.
    waiting_memory: VecDeque<Deferred>,
    /// How long a session whose channels are all dead is kept (`reclaim_after_ms`).
    reclaim_after: Duration,
    /// Storage requests handed out and not finished: job id → (session, channel, request,
    /// export).
    running: HashMap<u64, (u64, u16, Request, usize, Instant)>,
    /// Running jobs by start time (`storage_deadline_ms`): (start, job id).
    deadlines: std::collections::BTreeSet<(Instant, u64)>,
    storage_deadline: Duration,
    /// Jobs answered with an I/O error at their deadline; their late end is not answered again.
    timed_out: HashSet<u64>,
    storage_timeouts: u64,
    next_job: u64,
    /// Sessions fenced by a new attachment of the same initiator.
    fenced: u64,
    clock: std::time::Instant,
    /// Added to the clock ([`Harness::advance`]; zero in a daemon).
    skew: Duration,
    shared: Arc<Shared>,
    payload_copied: u64,
    /// The part of `payload_copied` on the write path.
    payload_copied_write: u64,
    reclaimed: u64,
    duplicates_from_reclaimed: u64,
    stopping: Option<Instant>,
    /// NICs whose transport failed for good (a closed TCP connection).
    nic_down: Vec<bool>,
    /// NIC → the network thread (group) that serves it.
    group_of: Vec<usize>,
    /// Each network thread's eventfd.
    group_wakes: Vec<Arc<WakeFd>>,
    /// Network threads that ended their last turn with nothing to do (and sleep or will).
    sleeping: Vec<bool>,
    /// How the network threads wait for work.
    poll: PollConfig,
    /// Each network thread's polling counters, as of its last turn.
    poll_stats: Vec<PollStats>,
    /// Shutdown: every channel was told DISCONNECT; each thread sends its NICs' and exits.
    closing: bool,
    /// Network threads that have exited; the last one flushes and publishes the final counters.
    exited: usize,
}

/// Whether a transport error means the link is gone for good.
fn permanent(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected)
}

fn drop_name(r: DropReason) -> String {
    r.as_str().to_owned()
}

impl Network {
    fn now(&self) -> Instant {
        Instant((self.clock.elapsed() + self.skew).as_nanos() as u64 + 1)
    }

    /// One turn of network thread `g` over its NICs.
    fn turn(&mut self, g: usize, nics: &mut [(usize, Nic)]) -> Turn {
        self.sleeping[g] = false;
        let now = self.now();
        let stop = self.shared.stop.load(Ordering::SeqCst);
        if stop && self.stopping.is_none() {
            tracing::info!(inflight = self.inflight, "stopping: no new channels, finishing in-flight requests");
            self.stopping = Some(now);
        }
        if self.closing {
            for (k, nic) in nics.iter_mut() {
                self.transmit_on(now, *k, nic);
                self.give_back(*k, nic);
            }
            self.exited += 1;
            if self.exited == self.group_wakes.len() {
                self.finish(now);
            }
            return Turn { busy: false, timeout: Duration::ZERO, wake: Vec::new(), exit: true, live: Vec::new() };
        }
        let mut busy = false;
        for (k, nic) in nics.iter_mut() {
            self.give_back(*k, nic);
            busy |= self.receive_on(now, *k, nic);
        }
        busy |= self.completions(g);
        self.storage_deadlines(now);
        self.timers(now);
        self.collect_events();
        self.submit_overflow();
        for (k, nic) in nics.iter_mut() {
            busy |= self.transmit_on(now, *k, nic);
        }
        self.reclaim(now);
        for (k, nic) in nics.iter_mut() {
            self.give_back(*k, nic);
        }
        self.publish_if_requested(now);
        if let Some(since) = self.stopping {
            let drained = self.inflight == 0 && self.jobs.is_empty();
            let quiet = drained && !self.any_wants_transmit() && now.since(since) > Duration::from_millis(50);
            if quiet || now.since(since) > DRAIN_LIMIT {
                // DISCONNECT every channel; each thread sends its own NICs' and exits.
                for s in self.sessions.values_mut() {
                    s.session.close(tyche_wire::DisconnectReason::Shutdown);
                }
                self.closing = true;
                let wake = (0..self.group_wakes.len()).filter(|&h| h != g).collect();
                return Turn { busy: true, timeout: Duration::ZERO, wake, exit: false, live: Vec::new() };
            }
        }
        // Work this turn made for the NICs of other threads (completions, a copy of a request
        // that waited on another channel's execution, timers): wake them if they sleep.
        let mut wake = Vec::new();
        for k in 0..self.nic_stats.len() {
            let h = self.group_of[k];
            if h == g || !self.sleeping[h] || wake.contains(&h) {
                continue;
            }
            let wants = !self.control[k].is_empty()
                || self
                    .sessions
                    .values()
                    .any(|s| s.nic_of.iter().any(|(&c, &on)| on == k && s.session.wants_transmit(c)));
            if wants {
                wake.push(h);
            }
        }
        let mine = |k: &usize| self.group_of[*k] == g;
        let mut timeout =
            if nics.iter().all(|(_, n)| n.transport.readiness_fd().is_some()) { POLL_CAP } else { POLL_CAP_NO_FD };
        let next = self
            .sessions
            .values()
            .filter(|s| s.nic_of.values().any(mine))
            .filter_map(|s| s.session.poll_timeout())
            .min();
        if let Some(t) = next {
            timeout = timeout.min(t.since(now));
        }
        if self.stopping.is_some() {
            timeout = timeout.min(Duration::from_millis(5));
        }
        if let Some(&(started, _)) = self.deadlines.first() {
            timeout = timeout.min((started + self.storage_deadline).since(now));
        }
        if !busy {
            self.sleeping[g] = true;
        }
        let live = nics.iter().map(|(k, _)| !self.nic_down[*k]).collect();
        Turn { busy, timeout, wake, exit: false, live }
    }

    fn any_wants_transmit(&self) -> bool {
        self.control.iter().any(|q| !q.is_empty())
            || self.sessions.values().any(|s| s.nic_of.keys().any(|&c| s.session.wants_transmit(c)))
    }

    /// The orderly end, once every channel was told DISCONNECT: flush every export, publish the
    /// last counters.
    fn finish(&mut self, now: Instant) {
        for e in &self.exports {
            if let Err(err) = e.backend.flush() {
                tracing::error!(export = %e.spec.name, "flush at shutdown failed: {err}");
            }
        }
        let snap = self.snapshot(now);
        let mut g = self.shared.snapshot.lock().expect("snapshot lock");
        g.0 = u64::MAX;
        g.1 = snap;
        self.shared.published.notify_all();
        tracing::info!("stopped");
    }

    // ---------------------------------------------------------------------------------------
    // Receive.

    fn receive_on(&mut self, now: Instant, k: usize, nic: &mut Nic) -> bool {
        if self.nic_down[k] {
            return false;
        }
        let local = nic.transport.local_mac();
        match nic.transport.recv_lend(RX_BUDGET, &mut |bytes, lease| self.on_frame(now, k, local, bytes, lease)) {
            Ok(n) => n > 0,
            Err(e) => {
                self.nic_stats[k].rx_errors += 1;
                if permanent(&e) {
                    // A closed TCP connection, say: stop polling it (its channels die by timeout).
                    tracing::warn!(nic = %nic.name, "link down: {e}");
                    self.nic_down[k] = true;
                } else if self.nic_stats[k].rx_errors.is_power_of_two() {
                    tracing::warn!(nic = %nic.name, errors = self.nic_stats[k].rx_errors, "receive failed: {e}");
                }
                false
            }
        }
    }

    /// Handles one received frame. Write data is kept in the frame when the transport lends it
    /// (`lease`) and the export writes from frames; else it is copied into slot memory. Returns
    /// the lease when the frame is not kept. A panic while handling it (a bug a peer's frame
    /// reached) ends that frame's session alone ([`Network::fail_session`]).
    fn on_frame(
        &mut self,
        now: Instant,
        k: usize,
        local: MacAddr,
        bytes: &[u8],
        lease: Option<Lease>,
    ) -> Option<Lease> {
        let st = &mut self.nic_stats[k];
        st.frames_rx += 1;
        st.bytes_rx += bytes.len() as u64;
        let Ok(frame) = Frame::new_checked(bytes, self.ethertype) else {
            st.drops.malformed += 1;
            return lease;
        };
        let sid = frame.session();
        let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // The plaintext of an encrypting channel's frame goes here (kept, not reallocated).
            let mut scratch = std::mem::take(&mut self.rx_scratch);
            let kept = self.on_tyche_frame(now, k, local, &frame, bytes, lease, &mut scratch);
            self.rx_scratch = scratch;
            kept
        }));
        handled.unwrap_or_else(|_| {
            self.fail_session(sid, "handling a frame");
            None
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn on_tyche_frame(
        &mut self,
        now: Instant,
        k: usize,
        local: MacAddr,
        frame: &Frame<&[u8]>,
        bytes: &[u8],
        lease: Option<Lease>,
        scratch: &mut Vec<u8>,
    ) -> Option<Lease> {
        let st = &mut self.nic_stats[k];
        if matches!(frame.kind(), Kind::Connect | Kind::Discover) {
            let Ok(msg) = frame.parse() else {
                st.drops.malformed += 1;
                return lease;
            };
            self.on_handshake(now, k, local, frame, &msg);
            return lease;
        }
        let Some(s) = self.sessions.get_mut(&frame.session()) else {
            st.drops.unknown_session += 1;
            tracing::trace!(src = %frame.src(), session = frame.session(), "frame for an unknown session");
            return lease;
        };
        let (channel, damq, offset, payload, generation, tag) = match s.session.handle_frame(now, bytes, scratch) {
            TargetInbound::Consumed => {
                s.established = true;
                return lease;
            }
            TargetInbound::Dropped(d) => {
                match d {
                    FrameDrop::Wire(_) => st.drops.malformed += 1,
                    FrameDrop::NotOurs => st.drops.not_ours += 1,
                    FrameDrop::Channel(r) => *st.drops.channel.entry(drop_name(r)).or_default() += 1,
                }
                return lease;
            }
            TargetInbound::Write { channel, damq, offset, payload, generation, tag } => {
                s.established = true;
                (channel, damq, offset, payload, generation, tag)
            }
        };
        let epoch = s.epochs.get(&channel).copied().unwrap_or(0);
        let key = (s.session.id(), channel, epoch, damq);
        let lend = self.exports[s.export].lend;
        let node = self.nic_node[k];
        // Segments kept for another tag or slot generation (a write that never executed, early
        // data of a refused request) or at this offset (never: the channel drops duplicates) go
        // back first.
        let mut stale = Vec::new();
        if let Some(ls) = self.lent.get_mut(&key) {
            if ls.tag != tag || ls.generation != generation {
                ls.tag = tag;
                ls.generation = generation;
                stale.extend(std::mem::take(&mut ls.segs).into_values());
            } else {
                stale.extend(ls.segs.remove(&offset));
            }
        }
        for seg in stale {
            self.release[seg.nic].push(seg.lease);
            self.leases_held -= 1;
        }
        match lease {
            Some(lease) if lend && lease.covers(payload) => {
                let ls = self.lent.entry(key).or_insert_with(|| LentSlot { tag, generation, segs: BTreeMap::new() });
                let seg =
                    LentSegment { offset, len: payload.len() as u32, addr: payload.as_ptr() as usize, nic: k, lease };
                ls.segs.insert(offset, seg);
                self.leases_held += 1;
                self.nic_stats[k].frames_kept += 1;
                None
            }
            lease => {
                if !matches!(self.slots.get(&key), Some(Some(_))) {
                    if matches!(self.slots.get(&key), Some(None)) {
                        // Held by a storage job (cannot happen: the channel refuses data for a
                        // slot whose request executes); never write under it.
                        self.nic_stats[k].drops.slot_busy += 1;
                        self.short.insert(key, generation);
                        return lease;
                    }
                    match self.alloc_slot(node) {
                        Some(mem) => {
                            self.slots.insert(key, Some(mem));
                        }
                        None => {
                            // No memory to copy into: the write of this slot generation fails
                            // with an I/O error when it executes (its data is incomplete).
                            self.short.insert(key, generation);
                            return lease;
                        }
                    }
                }
                let Some(Some(mem)) = self.slots.get_mut(&key) else { return lease };
                let o = offset as usize;
                match mem.as_mut_slice().get_mut(o..o + payload.len()) {
                    Some(place) => place.copy_from_slice(payload),
                    None => {
                        self.short.insert(key, generation);
                        return lease;
                    }
                }
                self.payload_copied += payload.len() as u64;
                self.payload_copied_write += payload.len() as u64;
                lease
            }
        }
    }

    /// Gives NIC `k`'s transport back the frames it lent that are no longer needed, and notes
    /// how many it still has out.
    fn give_back(&mut self, k: usize, nic: &mut Nic) {
        for lease in self.release[k].drain(..) {
            nic.transport.release(lease);
        }
        self.nic_stats[k].leases_out = nic.transport.leases_out() as u64;
        // Read data every frame of which is acknowledged (nothing left to send or resend on its
        // channel) gives its chunks up.
        let sessions = &self.sessions;
        let done: Vec<SlotKey> = self
            .regions
            .iter()
            .filter(|(key, r)| {
                r.nic == k
                    && sessions
                        .get(&key.0)
                        .and_then(|s| s.session.channel(key.1))
                        .is_none_or(|c| c.dead().is_some() || (c.unacked_frames() == 0 && !c.wants_transmit()))
            })
            .map(|(key, _)| *key)
            .collect();
        for key in done {
            let region = self.regions.remove(&key).expect("listed");
            self.tx_draining[k].extend(region.chunks);
        }
        if !self.tx_draining[k].is_empty() {
            let busy: HashSet<u64> = nic.transport.tx_chunks_in_flight().into_iter().collect();
            let (idle, busy): (Vec<TxChunk>, Vec<TxChunk>) =
                self.tx_draining[k].drain(..).partition(|c| !busy.contains(&c.id()));
            self.tx_free[k].extend(idle);
            self.tx_draining[k] = busy;
        }
        self.nic_stats[k].tx_chunks_free = self.tx_free[k].len() as u64;
    }

    /// Releases the kept write data of the slots `gone` names (their channel or session went).
    fn release_lent_where(&mut self, gone: impl Fn(&SlotKey) -> bool) {
        let keys: Vec<SlotKey> = self.regions.keys().filter(|key| gone(key)).copied().collect();
        for key in keys {
            let region = self.regions.remove(&key).expect("listed");
            self.tx_draining[region.nic].extend(region.chunks);
        }
        self.in_region.retain(|key| !gone(key));
        let keys: Vec<SlotKey> = self.lent.keys().filter(|key| gone(key)).copied().collect();
        for key in keys {
            let ls = self.lent.remove(&key).expect("listed");
            for seg in ls.segs.into_values() {
                self.release[seg.nic].push(seg.lease);
                self.leases_held -= 1;
            }
        }
    }

    fn on_handshake(&mut self, now: Instant, k: usize, local: MacAddr, frame: &Frame<&[u8]>, msg: &Message<'_>) {
        let src = frame.src();
        let env_in = Envelope::of(frame);
        let reply_env =
            Envelope { dst: src, src: local, ethertype: self.ethertype, channel: env_in.channel, session: 0 };
        // Largest reply: a DISCOVER_REPLY of 8 exports with 64-byte names (672 bytes).
        let mut buf = vec![0u8; 2048];
        // A keyed export's CONNECT whose proof checked out: the key and the challenge's nonce.
        let mut keyed: Option<(Psk, u64)> = None;
        // The initiator's identity (for a CONNECT of a known export), and the sessions of it
        // that a new session fences.
        let mut new_session = None;
        let mut fence: Vec<u64> = Vec::new();
        if let Message::Connect(c) = msg {
            if self.stopping.is_some() {
                self.nic_stats[k].drops.shutting_down += 1;
                return;
            }
            if let Some(i) = self.exports.iter().position(|e| e.spec.name == c.export) {
                let e = &self.exports[i];
                let reject = |reason, buf: &mut Vec<u8>| {
                    let len = Message::Reject(Reject { nonce: c.nonce, reason, holder: None }).emit(&reply_env, buf);
                    buf.truncate(len);
                };
                if !e.allow.is_empty() && !e.allow.contains(&src) {
                    if PEER_LOGS.allow() {
                        tracing::warn!(%src, export = %c.export, nic = %self.nics_name(k), "refused: MAC not allowed");
                    }
                    self.nic_stats[k].drops.denied_mac += 1;
                    self.export_stats[i].denied += 1;
                    reject(RejectReason::NotAllowed, &mut buf);
                    self.queue_control(k, buf);
                    return;
                }
                if let Some(key) = e.key.clone() {
                    let Some(proof) = c.proof else {
                        let pending = self
                            .challenges
                            .get(&(src, c.nonce))
                            .filter(|p| now.since(p.sent) < CHALLENGE_LIFETIME)
                            .map(|p| p.target_nonce);
                        let tn = match pending {
                            Some(tn) => tn,
                            None => {
                                let tn = auth::random_u64();
                                if !self.remember_challenge(now, src, c.nonce, tn) {
                                    return; // the table is full of live challenges: no answer
                                }
                                tn
                            }
                        };
                        let env = Envelope { session: env_in.session, ..reply_env };
                        let len =
                            Message::Challenge(Challenge { nonce: c.nonce, target_nonce: tn }).emit(&env, &mut buf);
                        buf.truncate(len);
                        self.queue_control(k, buf);
                        return;
                    };
                    // A retry of a CONNECT that was granted (its ACCEPT lost): the same ACCEPT,
                    // nothing else. Its challenge is spent.
                    if self.acceptor.is_retry(src, &env_in, c) {
                        let mut ids = auth::random_u64;
                        if let Some(Accepted::Reply(len)) =
                            self.acceptor.handle_keyed(now, local, src, &env_in, msg, &mut ids, &mut buf, None)
                        {
                            buf.truncate(len);
                            self.queue_control(k, buf);
                        }
                        return;
                    }
                    // A challenge is answered once, within its lifetime: a replayed proof finds
                    // none. The proof covers the session and channel the CONNECT names, its
                    // parameters and host id, so it is good for nothing else either.
                    let pending = self
                        .forget_challenge(src, c.nonce)
                        .filter(|p| now.since(p.sent) < CHALLENGE_LIFETIME)
                        .map(|p| p.target_nonce);
                    let input = |tn| ProofInput {
                        nonce: c.nonce,
                        target_nonce: tn,
                        session: env_in.session,
                        channel: env_in.channel,
                        export: c.export,
                        initiator: src,
                        target: local,
                        host: c.host,
                        asked: c.params,
                    };
                    let ok = pending.filter(|&tn| auth::verify_initiator(&key, &input(tn), &proof));
                    let Some(tn) = ok else {
                        if PEER_LOGS.allow() {
                            tracing::warn!(%src, export = %c.export, "refused: wrong or replayed key proof");
                        }
                        self.nic_stats[k].drops.denied_key += 1;
                        self.export_stats[i].denied += 1;
                        let len =
                            Message::Reject(Reject { nonce: c.nonce, reason: RejectReason::AuthFailed, holder: None })
                                .emit(&reply_env, &mut buf);
                        buf.truncate(len);
                        self.queue_control(k, buf);
                        return;
                    };
                    keyed = Some((key, tn));
                }
                // One initiator at a time (unless shared); the same initiator again fences its
                // old sessions. Only for a CONNECT that creates a session (not a retransmitted
                // one), and only once it passed the MAC and key checks.
                let identity = c.host.unwrap_or_else(|| mac_identity(src));
                new_session = Some(identity);
                // Joining a session: a session created with a host id takes channels only from
                // that host, and a live channel is replaced only from its own MAC (a reconnect);
                // another peer that read the session id off the wire cannot take it over.
                if let Some(s) = self.sessions.get(&env_in.session) {
                    let wrong_host = !s.identity.starts_with(b"mac:") && c.host != Some(s.identity);
                    let live_elsewhere = s
                        .session
                        .channel(env_in.channel)
                        .is_some_and(|ch| ch.dead().is_none() && ch.envelope().dst != src);
                    if wrong_host || live_elsewhere {
                        if PEER_LOGS.allow() {
                            tracing::warn!(%src, export = %c.export, session = format_args!("{:016x}", env_in.session),
                                channel = env_in.channel, "refused: a join from another host, or a takeover of a live channel");
                        }
                        self.nic_stats[k].drops.denied_mac += 1;
                        self.export_stats[i].denied += 1;
                        reject(RejectReason::NotAllowed, &mut buf);
                        self.queue_control(k, buf);
                        return;
                    }
                }
                if env_in.session == 0 && self.acceptor.created_by(src, c.nonce).is_none() {
                    let holder = self
                        .sessions
                        .values()
                        .find(|s| s.export == i && s.identity != identity && !s.fenced.load(Ordering::Relaxed));
                    if let (false, Some(holder)) = (self.exports[i].shared, holder) {
                        if PEER_LOGS.allow() {
                            tracing::warn!(%src, export = %c.export, holder = %holder.mac, "refused: the export is attached by another initiator");
                        }
                        self.export_stats[i].denied += 1;
                        let len = Message::Reject(Reject {
                            nonce: c.nonce,
                            reason: RejectReason::InUse,
                            holder: Some(holder.mac),
                        })
                        .emit(&reply_env, &mut buf);
                        buf.truncate(len);
                        self.queue_control(k, buf);
                        return;
                    }
                    fence = self
                        .sessions
                        .iter()
                        .filter(|(_, s)| s.export == i && s.identity == identity && !s.fenced.load(Ordering::Relaxed))
                        .map(|(&sid, _)| sid)
                        .collect();
                }
            }
        }
        let mut ids = auth::random_u64;
        let busy_before = self.acceptor.busy();
        let keyed = keyed.as_ref().map(|(key, tn)| KeyedConnect { key, target_nonce: *tn });
        match self.acceptor.handle_keyed(now, local, src, &env_in, msg, &mut ids, &mut buf, keyed) {
            Some(Accepted::Reply(len)) => {
                if self.acceptor.busy() != busy_before && PEER_LOGS.allow() {
                    tracing::warn!(%src, busy = ?self.acceptor.busy(), "refused a CONNECT: a session or channel limit is full");
                }
                buf.truncate(len);
                self.queue_control(k, buf);
            }
            Some(Accepted::Channel { session, export, channel, len }) => {
                let e = &self.exports[export];
                let geometry = ExportGeometry { size: e.spec.size, read_only: e.read_only, discard: true };
                let fence = std::mem::take(&mut fence);
                let idx = channel.envelope().channel;
                let ethertype = self.ethertype;
                let log = PEER_LOGS.allow();
                let created = !self.sessions.contains_key(&session);
                if created {
                    for &old in &fence {
                        self.fence(old, session);
                    }
                }
                let e = &self.exports[export];
                let st = self.sessions.entry(session).or_insert_with(|| {
                    if log {
                        tracing::info!(%src, export = %e.spec.name, session = format_args!("{session:016x}"), "new session");
                    }
                    SessionState {
                        session: TargetSession::new(session, ethertype, geometry),
                        export,
                        nic_of: BTreeMap::new(),
                        executing: BTreeMap::new(),
                        epochs: BTreeMap::new(),
                        all_dead_since: None,
                        established: false,
                        identity: new_session.unwrap_or_else(|| mac_identity(src)),
                        mac: src,
                        fenced: Arc::new(AtomicBool::new(false)),
                        waits_for: fence,
                    }
                });
                if log {
                    tracing::info!(%src, session = format_args!("{session:016x}"), channel = idx, params = ?channel.params(), "channel open");
                }
                st.session.add_channel(*channel);
                st.all_dead_since = None;
                if st.nic_of.insert(idx, k).is_some() {
                    // A reconnect replaced the channel: its slot memory (and the frames it kept)
                    // goes with it.
                    let epoch = st.epochs.entry(idx).or_default();
                    let old = *epoch;
                    *epoch += 1;
                    self.drop_slots_where(|key| key.0 == session && key.1 == idx && key.2 == old);
                }
                buf.truncate(len);
                self.queue_control(k, buf);
            }
            None => {}
        }
    }

    /// Fences session `old` for the new session `by` of the same initiator: its channels close,
    /// its storage requests not started are not run (ABORTED), its reads waiting for memory are
    /// answered ABORTED, and `by` runs nothing until every request of `old` already in storage
    /// has ended, so no write of the old session lands after one of the new.
    fn fence(&mut self, old: u64, by: u64) {
        let Some(s) = self.sessions.get_mut(&old) else { return };
        s.fenced.store(true, Ordering::Release);
        s.session.close(tyche_wire::DisconnectReason::Normal);
        self.fenced += 1;
        if PEER_LOGS.allow() {
            tracing::warn!(
                session = format_args!("{old:016x}"),
                by = format_args!("{by:016x}"),
                "session fenced: the same initiator attached again"
            );
        }
        for j in self.jobs.waiting_mut().filter(|j| j.session == old) {
            j.abort = true;
        }
        let waiting: Vec<Deferred> = self.waiting_memory.iter().filter(|d| d.0 == old).copied().collect();
        self.waiting_memory.retain(|d| d.0 != old);
        for (_, channel, request, _) in waiting {
            s.session.complete(channel, &request, Status::Aborted);
        }
    }

    /// Queues a control reply on NIC `k`, or drops it when `limits.control_queue` are waiting
    /// (the initiator retries its CONNECT or DISCOVER).
    fn queue_control(&mut self, k: usize, frame: Vec<u8>) {
        if self.control[k].len() >= self.limits.control_queue {
            self.limit_stats.control_dropped += 1;
            return;
        }
        self.control[k].push_back(frame);
    }

    fn nics_name(&self, k: usize) -> &str {
        &self.nic_stats[k].name
    }

    /// Remembers a CHALLENGE sent to `src`. At most `limits.challenges_per_mac` per MAC: that
    /// MAC's oldest is forgotten (`limits.challenges_evicted`). At most `limits.challenges` in
    /// all: expired ones are forgotten first, and when every one is still live no challenge is
    /// issued (`limits.challenges_refused`), so that a flood from many MACs cannot push out the
    /// pending challenges of honest initiators. Returns whether it was remembered.
    fn remember_challenge(&mut self, now: Instant, src: MacAddr, nonce: u64, tn: u64) -> bool {
        let per_mac = self.challenges_by_mac.entry(src).or_default();
        if per_mac.len() >= self.limits.challenges_per_mac {
            if let Some(old) = per_mac.pop_front() {
                self.challenges.remove(&(src, old));
                self.limit_stats.challenges_evicted += 1;
            }
        }
        // Challenges expire in the order they were sent.
        while let Some(&(mac, old)) = self.challenge_order.front() {
            match self.challenges.get(&(mac, old)) {
                Some(p) if now.since(p.sent) < CHALLENGE_LIFETIME => break,
                Some(_) => {
                    self.forget_challenge(mac, old);
                }
                None => {}
            }
            self.challenge_order.pop_front();
        }
        if self.challenges.len() >= self.limits.challenges {
            self.limit_stats.challenges_refused += 1;
            if self.challenges_by_mac.get(&src).is_some_and(VecDeque::is_empty) {
                self.challenges_by_mac.remove(&src);
            }
            return false;
        }
        self.challenges_by_mac.entry(src).or_default().push_back(nonce);
        self.challenges.insert((src, nonce), PendingChallenge { target_nonce: tn, sent: now });
        self.challenge_order.push_back((src, nonce));
        // Entries answered or forgotten per MAC stay in the order until popped: keep it bounded.
        if self.challenge_order.len() > 2 * self.limits.challenges {
            let challenges = &self.challenges;
            self.challenge_order.retain(|key| challenges.contains_key(key));
        }
        true
    }

    /// Forgets the CHALLENGE sent to `src` for CONNECT nonce `nonce` (answered, or expired),
    /// returning it if it was pending.
    fn forget_challenge(&mut self, src: MacAddr, nonce: u64) -> Option<PendingChallenge> {
        let p = self.challenges.remove(&(src, nonce))?;
        if let Some(q) = self.challenges_by_mac.get_mut(&src) {
            q.retain(|&n| n != nonce);
            if q.is_empty() {
                self.challenges_by_mac.remove(&src);
            }
        }
        Some(p)
    }

    // ---------------------------------------------------------------------------------------
    // Storage.

    fn collect_events(&mut self) {
        let mut execute = std::mem::take(&mut self.waiting_memory);
        let mut dead = Vec::new();
        for (&sid, s) in self.sessions.iter_mut() {
            while let Some(ev) = s.session.poll_event() {
                match ev {
                    TargetEvent::Execute { channel, request, generation } => {
                        execute.push_back((sid, channel, request, generation))
                    }
                    TargetEvent::ChannelDead { channel, reason } => dead.push((sid, channel, reason)),
                }
            }
        }
        for (sid, channel, reason) in dead {
            self.channel_dead(sid, channel, reason);
        }
        let mut jobs = Vec::new();
        while let Some(d) = execute.pop_front() {
            if let Some(j) = self.prepare_job(d) {
                jobs.push(j);
            }
        }
        for mut j in jobs {
            self.inflight += 1;
            // A RAM operation is a memcpy of about a microsecond: handing it to a worker thread
            // and back costs more than doing it here (two context switches per request).
            let backend = Arc::clone(&self.exports[j.export].backend);
            if backend.kind() == "ram" {
                let status = execute_contained(&*backend, &mut j);
                self.finish_job(Done { job: j, status });
            } else if let Some(q) = self
                .uring
                .get(self.jobs.queue_of(j.nic))
                .filter(|q| self.exports[j.export].uring && crate::uring::handles(q.fallocate, &*backend, j.request.op))
            {
                // The ring of the channel's node.
                if let Err(j) = q.submit(j) {
                    tracing::error!("the io_uring thread is gone; request failed");
                    self.finish_job(Done { job: j, status: Status::IoError });
                }
            } else {
                // The queue of the channel's node.
                self.jobs.push(j);
            }
        }
        self.submit_overflow();
    }

    /// The storage job of a request the session hands out, with its data's places: write data
    /// kept in frames (of this slot generation) and copied into slot memory, read data going
    /// into lent transmit chunks or slot memory. `None` when the session is gone, when the
    /// request was completed here (its copied write data is incomplete), or when a read waits
    /// for slot memory (it is kept in `waiting_memory`).
    fn prepare_job(&mut self, deferred: Deferred) -> Option<Job> {
        let (sid, channel, request, generation) = deferred;
        let stopping = self.stopping.is_some();
        let s = self.sessions.get(&sid)?;
        if !s.waits_for.is_empty() {
            // Nothing of this session runs before every request of the sessions it fenced ended.
            let busy = |old: &u64| self.sessions.get(old).is_some_and(|o| o.executing.values().any(|&n| n > 0));
            if s.waits_for.iter().any(busy) {
                self.waiting_memory.push_back(deferred);
                return None;
            }
            let s = self.sessions.get_mut(&sid)?;
            s.waits_for.clear();
        }
        let s = self.sessions.get(&sid)?;
        let fence = Some(Arc::clone(&s.fenced));
        let epoch = s.epochs.get(&channel).copied().unwrap_or(0);
        let ch = s.session.channel(channel);
        let dead = ch.is_none_or(|c| c.dead().is_some());
        let seg = ch.map_or(0, |c| c.params().segment as u32);
        // Frames of a keyed export are sealed, and those of a DIGEST channel carry the payload's
        // CRC32C, as each goes out: their read data is sent from slot memory, never from
        // transmit chunks that hold it once (the frame's checks need the payload in hand).
        let protected = ch.is_some_and(|c| c.sealed() || c.params().features & flags::FEATURE_DIGEST != 0);
        let (export, nic) = (s.export, s.nic_of.get(&channel).copied());
        let key = (sid, channel, epoch, request.damq);
        let (mut lent, mut region, mut buf) = (Vec::new(), None, None);
        if request.op.uses_damq() && !dead && !stopping {
            // The slot is reused: read data of its previous request is not needed.
            if let Some(old) = self.regions.remove(&key) {
                self.tx_draining[old.nic].extend(old.chunks);
            }
            self.in_region.remove(&key);
            if let Some(ls) = self.lent.remove(&key) {
                if request.op == Op::Write && ls.tag == request.tag && ls.generation == generation {
                    lent = ls.segs.into_values().collect();
                } else {
                    for seg in ls.segs.into_values() {
                        self.release[seg.nic].push(seg.lease);
                        self.leases_held -= 1;
                    }
                }
            }
            let short = self.short.remove(&key) == Some(generation);
            let node = nic.map_or(self.node, |k| self.nic_node[k]);
            match request.op {
                // A BLOCK_STATUS list is made in slot memory (never in transmit chunks).
                Op::Read | Op::BlockStatus => {
                    if let (Some(k), Op::Read) = (nic, request.op) {
                        let need = (request.length as usize).div_ceil(seg.max(1) as usize);
                        let free = &mut self.tx_free[k];
                        if self.exports[export].lend && !protected && seg > 0 && need > 0 && free.len() >= need {
                            let chunks = free.split_off(free.len() - need);
                            region = Some(Region { chunks, seg, nic: k, tag: request.tag });
                            self.in_region.insert(key);
                        }
                    }
                    if region.is_none() {
                        buf = match self.slots.get_mut(&key).and_then(Option::take) {
                            Some(mem) => Some(mem),
                            None => match self.alloc_slot(node) {
                                Some(mem) => Some(mem),
                                None => {
                                    // Wait for memory: nothing of the read has happened yet.
                                    self.waiting_memory.push_back(deferred);
                                    return None;
                                }
                            },
                        };
                        self.slots.entry(key).or_insert(None);
                    }
                }
                _ => {
                    let kept: u64 = lent.iter().map(|l| l.len as u64).sum();
                    if kept < request.length as u64 {
                        buf = self.slots.get_mut(&key).and_then(Option::take);
                    }
                    if short || (kept < request.length as u64 && buf.is_none()) {
                        // Copied data of this write could not be kept: fail it, never write holes.
                        for seg in lent {
                            self.release[seg.nic].push(seg.lease);
                            self.leases_held -= 1;
                        }
                        if let Some(mem) = buf {
                            self.slots.insert(key, Some(mem));
                        }
                        self.export_stats[export].errors += 1;
                        self.sessions.get_mut(&sid)?.session.complete(channel, &request, Status::IoError);
                        return None;
                    }
                }
            }
        }
        *self.sessions.get_mut(&sid)?.executing.entry(channel).or_default() += 1;
        self.next_job += 1;
        let id = self.next_job;
        let now = self.now();
        self.running.insert(id, (sid, channel, request, export, now));
        if !self.storage_deadline.is_zero() {
            self.deadlines.insert((now, id));
        }
        Some(Job {
            session: sid,
            channel,
            epoch,
            export,
            request,
            buf,
            lent,
            region,
            abort: stopping || dead,
            id,
            fence,
            nic,
        })
    }

    /// `limits.slot_memory` permitting, one slot's memory (on `node`). When the budget is spent,
    /// memory that idle slots hold is taken back first.
    fn alloc_slot(&mut self, node: Option<u32>) -> Option<Memory> {
        let len = self.slot_len as u64;
        if self.slot_bytes + len > self.limits.slot_memory.0 {
            if let Some(mem) = self.take_idle_slot() {
                return Some(mem);
            }
            self.limit_stats.slot_memory_waits += 1;
            return None;
        }
        self.slot_bytes += len;
        Some(Memory::new(self.slot_len, node))
    }

    /// Slot memory that no request uses and no frame will be sent from: its channel has every
    /// frame acknowledged and nothing to send, and the slot is not receiving write data.
    fn take_idle_slot(&mut self) -> Option<Memory> {
        let sessions = &self.sessions;
        let key = *self.slots.iter().find_map(|(key, slot)| {
            let s = sessions.get(&key.0)?;
            let idle = s.epochs.get(&key.1).copied().unwrap_or(0) != key.2
                || s.session.channel(key.1).is_none_or(|c| {
                    c.dead().is_some() || (c.unacked_frames() == 0 && !c.wants_transmit() && !c.damq_active(key.3))
                });
            (slot.is_some() && idle).then_some(key)
        })?;
        self.slots.remove(&key).flatten()
    }

    /// Gives slot memory back to the budget.
    fn free_slot(&mut self, mem: Memory) {
        self.slot_bytes -= self.slot_len as u64;
        drop(mem);
    }

    /// Drops the slots `gone` names (their channel or session went): slot memory (memory a job
    /// holds goes when the job finishes), kept write data, read data in transmit chunks.
    fn drop_slots_where(&mut self, gone: impl Fn(&SlotKey) -> bool) {
        let keys: Vec<SlotKey> = self.slots.keys().filter(|key| gone(key)).copied().collect();
        for key in keys {
            if let Some(Some(mem)) = self.slots.remove(&key) {
                self.free_slot(mem);
            }
        }
        self.short.retain(|key, _| !gone(key));
        self.release_lent_where(gone);
    }

    /// A channel died: what only its slots need goes now (not when the session ends).
    fn channel_dead(&mut self, sid: u64, channel: u16, reason: tyche_channel::DeadReason) {
        if PEER_LOGS.allow() {
            tracing::info!(session = format_args!("{sid:016x}"), channel, ?reason, "channel dead");
        }
        let Some(s) = self.sessions.get(&sid) else { return };
        let epoch = s.epochs.get(&channel).copied().unwrap_or(0);
        self.drop_slots_where(|key| key.0 == sid && key.1 == channel && key.2 == epoch);
    }

    /// Ends session `sid` at once because handling it hit a bug (a panic): every other session
    /// goes on. Its channels send nothing more (the initiator finds them dead and reconnects).
    fn fail_session(&mut self, sid: u64, doing: &str) {
        self.limit_stats.sessions_failed += 1;
        if PEER_LOGS.allow() {
            tracing::error!(session = format_args!("{sid:016x}"), "session ended: a bug was hit while {doing}");
        }
        if let Some(s) = self.sessions.remove(&sid) {
            self.duplicates_from_reclaimed += s.session.duplicates_suppressed();
            self.acceptor.forget_session(sid);
            self.waiting_memory.retain(|d| d.0 != sid);
            self.drop_slots_where(|key| key.0 == sid);
        }
    }

    /// Moves jobs into their node's queue while it has room (the rest wait, in order).
    fn submit_overflow(&mut self) {
        for j in self.jobs.submit() {
            // No worker is left (they only exit when the target stops): fail the request.
            tracing::error!("storage workers are gone; request failed");
            self.finish_job(Done { job: j, status: Status::IoError });
        }
    }

    /// Finishes the jobs storage handed back to network thread `g` (its NICs' channels').
    fn completions(&mut self, g: usize) -> bool {
        let mut any = false;
        while let Some(d) = self.done_rx.get(g).and_then(|rx| rx.try_recv().ok()) {
            any = true;
            self.finish_job(d);
        }
        any
    }

    /// Accounts a finished storage operation and completes its request on its channel.
    fn finish_job(&mut self, done: Done) {
        let (mut d, status) = (done.job, done.status);
        self.inflight -= 1;
        if let Some((.., started)) = self.running.remove(&d.id) {
            self.deadlines.remove(&(started, d.id));
        }
        for seg in d.lent.drain(..) {
            self.release[seg.nic].push(seg.lease);
            self.leases_held -= 1;
        }
        if self.timed_out.remove(&d.id) {
            // Answered at its deadline already: what it held goes back, nothing is sent.
            if let Some(region) = d.region.take() {
                self.tx_draining[region.nic].extend(region.chunks);
            }
            if let Some(buf) = d.buf.take() {
                self.free_slot(buf);
            }
            if let Some(n) = self.sessions.get_mut(&d.session).and_then(|s| s.executing.get_mut(&d.channel)) {
                *n -= 1;
            }
            if PEER_LOGS.allow() {
                tracing::warn!(op = ?d.request.op, offset = d.request.offset, ?status, "a storage request ended after its deadline");
            }
            return;
        }
        let r = d.request;
        let key = (d.session, d.channel, d.epoch, r.damq);
        // Whether the request's channel (this instance of it) still lives to send its data.
        let live = self.sessions.get(&d.session).is_some_and(|s| {
            s.epochs.get(&d.channel).copied().unwrap_or(0) == d.epoch
                && s.session.channel(d.channel).is_some_and(|c| c.dead().is_none())
        });
        if let Some(region) = d.region.take() {
            if live && status == Status::Ok {
                if let Some(old) = self.regions.insert(key, region) {
                    self.tx_draining[old.nic].extend(old.chunks);
                }
            } else {
                self.tx_draining[region.nic].extend(region.chunks);
            }
        }
        if let Some(buf) = d.buf.take() {
            match self.slots.get_mut(&key) {
                Some(slot @ None) if live => *slot = Some(buf),
                _ => {
                    if self.slots.get(&key).is_some_and(Option::is_none) {
                        self.slots.remove(&key);
                    }
                    self.free_slot(buf);
                }
            }
        }
        let es = &mut self.export_stats[d.export];
        es.requests.bump(r.op);
        if status == Status::Ok {
            match r.op {
                Op::Read => es.bytes_read += r.length as u64,
                Op::Write => es.bytes_written += r.length as u64,
                _ => {}
            }
        } else {
            es.errors += 1;
        }
        let Some(s) = self.sessions.get_mut(&d.session) else { return };
        if let Some(n) = s.executing.get_mut(&d.channel) {
            *n -= 1;
        }
        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.session.complete(d.channel, &r, status)));
        if done.is_err() {
            self.fail_session(d.session, "completing a request");
        }
    }

    /// Answers with an I/O error every storage request running longer than
    /// `storage_deadline_ms`: a hung backend never wedges a channel. The request's memory stays
    /// with the storage job until it really ends (the kernel may still use it), and its session
    /// is not reclaimed before that.
    fn storage_deadlines(&mut self, now: Instant) {
        while let Some(&(started, id)) = self.deadlines.first() {
            if now.since(started) < self.storage_deadline {
                return;
            }
            self.deadlines.pop_first();
            let Some(&(sid, channel, request, export, _)) = self.running.get(&id) else { continue };
            self.timed_out.insert(id);
            self.storage_timeouts += 1;
            self.export_stats[export].errors += 1;
            if PEER_LOGS.allow() {
                tracing::error!(op = ?request.op, offset = request.offset, length = request.length,
                    deadline = ?self.storage_deadline, "storage request past its deadline: answered with an I/O error");
            }
            if let Some(s) = self.sessions.get_mut(&sid) {
                let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    s.session.complete(channel, &request, Status::IoError)
                }));
                if done.is_err() {
                    self.fail_session(sid, "answering a request past its deadline");
                }
            }
        }
    }

    fn timers(&mut self, now: Instant) {
        let mut failed = Vec::new();
        for (&sid, s) in self.sessions.iter_mut() {
            if s.session.poll_timeout().is_some_and(|t| t <= now) {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.session.handle_timeout(now)));
                if run.is_err() {
                    failed.push(sid);
                }
            }
        }
        for sid in failed {
            self.fail_session(sid, "running its timers");
        }
    }

    /// Drops sessions whose channels are all dead once nothing of theirs executes.
    fn reclaim(&mut self, now: Instant) {
        let mut gone = Vec::new();
        for (&sid, s) in self.sessions.iter_mut() {
            if !s.session.all_dead() {
                s.all_dead_since = None;
                continue;
            }
            let since = *s.all_dead_since.get_or_insert(now);
            let busy = s.executing.values().any(|&n| n > 0);
            // A session that carried traffic is kept `reclaim_after_ms` so an initiator back in
            // time resumes it (its ledger too); one that never did (a CONNECT and nothing else,
            // as in a flood) goes at once.
            // An initiator that said goodbye on every channel (DISCONNECT NORMAL: a detach) does
            // not come back for this session.
            let detached = s.session.channel_indices().all(|c| {
                matches!(
                    s.session.channel(c).and_then(|c| c.dead()),
                    Some(tyche_channel::DeadReason::PeerClosed(tyche_wire::DisconnectReason::Normal))
                )
            });
            let grace = if s.established && !detached && !s.fenced.load(Ordering::Relaxed) {
                self.reclaim_after.max(RECLAIM_GRACE)
            } else {
                RECLAIM_GRACE
            };
            if !busy && now.since(since) >= grace {
                gone.push(sid);
            }
        }
        for sid in gone {
            let s = self.sessions.remove(&sid).expect("listed");
            self.duplicates_from_reclaimed += s.session.duplicates_suppressed();
            self.acceptor.forget_session(sid);
            self.waiting_memory.retain(|d| d.0 != sid);
            self.drop_slots_where(|k| k.0 == sid);
            self.reclaimed += 1;
            if PEER_LOGS.allow() {
                tracing::info!(session = format_args!("{sid:016x}"), "session reclaimed");
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Transmit.

    /// Sends what NIC `k` has to send (the caller flushes the transport, outside the lock).
    fn transmit_on(&mut self, now: Instant, k: usize, nic: &mut Nic) -> bool {
        {
            if self.nic_down[k] {
                self.control[k].clear();
                return false;
            }
            let mut order: Vec<(u64, u16)> = Vec::new();
            for (&sid, s) in &self.sessions {
                order.extend(s.nic_of.iter().filter(|&(_, &n)| n == k).map(|(&c, _)| (sid, c)));
            }
            let mut cursor = 0;
            let (mut frames, mut bytes, mut copied, mut in_place, mut deferred) = (0u64, 0u64, 0u64, 0u64, 0u64);
            // Chunks the kernel still sends cannot be rewritten or sent again yet.
            let busy: HashSet<u64> = if self.regions.values().any(|r| r.nic == k) {
                nic.transport.tx_chunks_in_flight().into_iter().collect()
            } else {
                HashSet::new()
            };
            let mut used = HashSet::new();
            let control = &mut self.control[k];
            let sessions = &mut self.sessions;
            let slots = &self.slots;
            let regions = &self.regions;
            let in_region = &self.in_region;
            let r = nic.transport.send_with(TX_BUDGET, &mut |buf| {
                if let Some(f) = control.pop_front() {
                    buf[..f.len()].copy_from_slice(&f);
                    frames += 1;
                    bytes += f.len() as u64;
                    return Some(Sent::Here(f.len()));
                }
                while cursor < order.len() {
                    let (sid, ch) = order[cursor];
                    let s = sessions.get_mut(&sid).expect("listed");
                    let epoch = s.epochs.get(&ch).copied().unwrap_or(0);
                    if let Some(t) = s.session.poll_transmit(now, ch, buf) {
                        let sent = 'frame: {
                            let Some(p) = t.payload else { break 'frame Sent::Here(t.len) };
                            let key = (sid, ch, epoch, p.damq);
                            let dst = &mut buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + p.len as usize];
                            if let Some(region) = regions.get(&key).filter(|r| r.tag == p.tag) {
                                let at = (p.offset % region.seg == 0)
                                    .then(|| region.chunks.get((p.offset / region.seg) as usize));
                                let Some(Some(c)) = at else { break 'frame Sent::Here(0) };
                                if !busy.contains(&c.id()) && used.insert(c.id()) {
                                    // The payload is in the chunk already: only the headers go there.
                                    in_place += 1;
                                    break 'frame Sent::Chunk { id: c.id(), header: DATA_FRAME_OVERHEAD, len: t.len };
                                }
                                // The kernel still holds this chunk from an earlier send of the
                                // same segment (or it goes out earlier in this batch): that send
                                // carries these bytes, so this resend is skipped, not copied. If
                                // it is lost, the retransmission timer sends the chunk again once
                                // it is back.
                                deferred += 1;
                                break 'frame Sent::Here(0);
                            }
                            match slots.get(&key) {
                                Some(Some(mem)) if !in_region.contains(&key) => {
                                    let o = p.offset as usize;
                                    let Some(src) = mem.as_slice().get(o..o + p.len as usize) else {
                                        break 'frame Sent::Here(0);
                                    };
                                    dst.copy_from_slice(src);
                                    copied += p.len as u64;
                                    Sent::Here(t.len)
                                }
                                // Read data always lies in its slot (or region) until the
                                // completion is sent; never send stale bytes.
                                _ => Sent::Here(0),
                            }
                        };
                        let sent = match sent {
                            Sent::Here(len) if len > 0 => Sent::Here(s.session.seal(ch, buf, len)),
                            other => other,
                        };
                        if sent != Sent::Here(0) {
                            frames += 1;
                            bytes += t.len as u64;
                        }
                        return Some(sent);
                    }
                    cursor += 1;
                }
                None
            });
            self.nic_stats[k].frames_sent_in_place += in_place;
            self.nic_stats[k].resends_deferred += deferred;
            if let Err(e) = r {
                self.nic_stats[k].tx_errors += 1;
                if permanent(&e) {
                    tracing::warn!(nic = %nic.name, "link down: {e}");
                    self.nic_down[k] = true;
                } else if self.nic_stats[k].tx_errors.is_power_of_two() {
                    tracing::warn!(nic = %nic.name, errors = self.nic_stats[k].tx_errors, "send failed: {e}");
                }
            }
            self.nic_stats[k].frames_tx += frames;
            self.nic_stats[k].bytes_tx += bytes;
            self.payload_copied += copied;
            frames > 0
        }
    }

    // ---------------------------------------------------------------------------------------
    // Counters.

    fn publish_if_requested(&mut self, now: Instant) {
        let want = self.shared.stats_requested.load(Ordering::SeqCst);
        if self.shared.snapshot.lock().expect("snapshot lock").0 >= want {
            return;
        }
        let snap = self.snapshot(now);
        let mut g = self.shared.snapshot.lock().expect("snapshot lock");
        g.0 = want;
        g.1 = snap;
        self.shared.published.notify_all();
    }

    /// Where the slot memory of channel `ch` of session `sid` is, against `node`.
    fn slot_pages(&self, sid: u64, ch: u16, epoch: u64, node: Option<u32>) -> tyche_numa::PageCounts {
        let mut c = tyche_numa::PageCounts { expected_node: node, ..Default::default() };
        for (key, slot) in &self.slots {
            if key.0 == sid && key.1 == ch && key.2 == epoch {
                if let Some(mem) = slot {
                    if let Ok(p) = tyche_numa::report::count_slice(mem.as_slice(), node) {
                        c.add(&p);
                    }
                }
            }
        }
        c
    }

    /// Where each NIC's memory is and which CPUs this (the serving) thread may use.
    fn placement(&self, channels: &[ChannelSnapshot]) -> Vec<NicPlacement> {
        self.nic_areas
            .iter()
            .enumerate()
            .map(|(k, areas)| {
                let node = self.nic_node[k];
                let mut p = NicPlacement {
                    nic: self.nic_stats[k].name.clone(),
                    node,
                    thread: self.thread_of(k),
                    umem: tyche_numa::PageCounts { expected_node: node, ..Default::default() },
                    rings: tyche_numa::PageCounts { expected_node: node, ..Default::default() },
                    slots: tyche_numa::PageCounts { expected_node: node, ..Default::default() },
                };
                for a in areas {
                    let Ok(c) = tyche_numa::report::count_area(a.addr, a.len, node) else { continue };
                    match a.what {
                        "umem" => p.umem.add(&c),
                        _ => p.rings.add(&c),
                    }
                }
                for c in channels.iter().filter(|c| c.nic == p.nic) {
                    p.slots.add(&c.slots);
                }
                p
            })
            .collect()
    }

    /// The thread serving NIC `k` (the calling thread until that one has reported itself).
    fn thread_of(&self, k: usize) -> tyche_numa::report::ThreadPlacement {
        self.nic_thread.get(k).cloned().flatten().unwrap_or_else(tyche_numa::report::this_thread)
    }

    fn snapshot(&self, now: Instant) -> Snapshot {
        let mut exports = self.export_stats.clone();
        for (es, e) in exports.iter_mut().zip(&self.exports) {
            es.direct_bytes = e.backend.as_file().map_or(0, FileBackend::direct_bytes);
        }
        let mut channels = Vec::new();
        let mut dups = self.duplicates_from_reclaimed;
        for (&sid, s) in &self.sessions {
            exports[s.export].sessions += 1;
            dups += s.session.duplicates_suppressed();
            for (&ch, &k) in &s.nic_of {
                let Some(c) = s.session.channel(ch) else { continue };
                let cs = c.stats();
                let drops = DropReason::ALL
                    .iter()
                    .zip(cs.dropped)
                    .filter(|(_, n)| *n > 0)
                    .map(|(r, n)| (drop_name(*r), n))
                    .collect();
                channels.push(ChannelSnapshot {
                    session: sid,
                    channel: ch,
                    export: self.exports[s.export].spec.name.clone(),
                    nic: self.nic_stats[k].name.clone(),
                    peer: c.envelope().dst.to_string(),
                    dead: c.dead().is_some(),
                    frames_tx: cs.frames_tx,
                    frames_rx: cs.frames_rx,
                    payload_tx: cs.payload_tx,
                    payload_rx: cs.payload_rx,
                    retransmits: cs.retransmits,
                    drops,
                    executing: s.executing.get(&ch).copied().unwrap_or(0),
                    node: self.nic_node[k],
                    slots: self.slot_pages(sid, ch, s.epochs.get(&ch).copied().unwrap_or(0), self.nic_node[k]),
                    thread: self.thread_of(k),
                    protection: c.protection().to_owned(),
                });
            }
        }
        let placement = self.placement(&channels);
        Snapshot {
            uptime_ms: now.as_nanos() / 1_000_000,
            stopping: self.stopping.is_some(),
            sessions: self.sessions.len() as u64,
            sessions_reclaimed: self.reclaimed,
            payload_copied_bytes: self.payload_copied,
            storage_timeouts: self.storage_timeouts,
            sessions_fenced: self.fenced,
            payload_copied_write_bytes: self.payload_copied_write,
            leases_held: self.leases_held,
            storage_inflight: self.inflight,
            duplicates_suppressed: dups,
            nics: self.nic_stats.clone(),
            exports,
            channels,
            placement,
            // Read by the daemon's stats source (tyched's main), not the engine.
            irqs: Vec::new(),
            limits: self.limit_snapshot(),
            storage_threads: self.storage_threads.iter().map(|t| t.snapshot()).collect(),
            storage_queues: self
                .storage_queues
                .iter()
                .enumerate()
                .map(|(q, sq)| StorageQueueStats {
                    workers: self.storage_threads.iter().filter(|t| t.queue == q && t.kind == "worker").count() as u64,
                    jobs: self.storage_threads.iter().filter(|t| t.queue == q).map(|t| t.jobs()).sum(),
                    ..sq.clone()
                })
                .collect(),
            poll: PollReport {
                mode: self.poll.mode,
                budget_us: self.poll.budget.as_micros() as u64,
                threads: self.poll_stats.clone(),
            },
        }
    }

    fn limit_snapshot(&self) -> LimitStats {
        let busy = self.acceptor.busy();
        LimitStats {
            busy_sessions: busy.sessions,
            busy_sessions_per_export: busy.sessions_per_export,
            busy_sessions_per_mac: busy.sessions_per_mac,
            busy_channels_per_session: busy.channels_per_session,
            busy_channels: busy.channels,
            slot_memory_bytes: self.slot_bytes,
            warnings_suppressed: PEER_LOGS.suppressed(),
            ..self.limit_stats
        }
    }
}

impl Drops {
    /// Sum of the channel drop counters.
    pub fn channel_total(&self) -> u64 {
        self.channel.values().sum()
    }
}
