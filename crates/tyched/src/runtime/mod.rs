//! The target runtime: network threads that each own their NICs and the channels on them, a
//! control they share off the per-frame path, and storage workers in a bounded queue per NUMA
//! node.
//!
//! ```text
//!  transports ──recv──▶ network thread g ──jobs (bounded, per node)──▶ node's storage workers ──▶ backend
//!      ▲                 (its session parts,                                │
//!      └────send──────── slot table, timers)  ◀──completions (thread g's own queue)+wake──┘
//!                          │  ▲
//!      handshakes, reclaim │  │ channels, fences, forgets, messages between session parts
//!                          ▼  │ (each thread's queue + eventfd)
//!                   control (admission: acceptor, challenges, sessions; one mutex)
//! ```
//!
//! A network thread polls the transports it was given, hands DISCOVER/CONNECT to the control
//! (the [`tyche_channel::Admission`]: the MAC allow-list, the key proof, joins and fencing in
//! front of the acceptor, under the control's lock), places write data into the request's `damq` slot memory, hands executable
//! requests to the workers of its channel's node (`crate::workers`) together with that slot
//! memory, and sends completions and read data when the workers hand them back to it (each
//! network thread has its own done queue). When nothing is due it sleeps in `poll(2)` on the
//! transports' readiness descriptors and its eventfd, until its next timer. Nothing a thread
//! touches for a frame of an established channel is touched by another network thread.
//!
//! What a thread owns (`Network`) and the control are grouped by job, one module each:
//! - `start`: opening exports, starting storage threads, building the control and each thread's
//!   state, spawning the network threads.
//! - `control`: the control (exports, admission, reclaim decisions), what
//!   a session's parts share (`SessionMeta`), the threads' queues (`Postal`, `ThreadMsg`).
//! - `network`: the per-thread loop (turns, receive, transmit, sleep, shutdown) and per-NIC
//!   state (`NicState`).
//! - `handshake`: DISCOVER/CONNECT checks in front of the acceptor, key challenges
//!   (`Challenges`), fencing, where a new channel goes.
//! - `sessions`: a thread's part of a session beside the channel engine's, the messages it
//!   takes, timers, dead channels, reclaim reports.
//! - `slots`: the `SlotTable`, the one owner of all per-`damq`-slot state (slot memory, write
//!   data kept in frames, read data in transmit chunks, short writes) and its accounting.
//! - `jobs`: storage jobs (`crate::job::Job`) from preparation to completion, and `Storage` (queues,
//!   io_uring, done queue, deadlines).
//! - `snapshot`: a thread's counters (`Counters`) and its piece of a snapshot, the merge, the
//!   placement report, limit counters.
//! - `reload`: a new configuration applied to the running target (exports added, access rules
//!   changed) under the control's lock; network threads take the new export list with the
//!   first channel of a new export they install.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tyche_channel::auth::Psk;
use tyche_channel::{ExportSpec, Instant};
use tyche_runtime::poll::{PollConfig, PollStats};
use tyche_runtime::wake::WakeFd;
use tyche_transport::FrameTransport;
use tyche_wire::MacAddr;

use crate::backend::{Backend, BackendError};
use crate::config::{Config, NetworkThreads};
use crate::stats::Snapshot;
use crate::workers::StoragePlan;

mod control;
mod handshake;
mod jobs;
mod network;
mod reload;
mod sessions;
mod slots;
mod snapshot;
mod start;

pub(crate) use crate::rate_limit::PEER_LOGS;

use control::{Control, Postal, ThreadMsg};
use jobs::Storage;
use network::NicState;
use sessions::SessionState;
use slots::SlotTable;
use snapshot::{Counters, Piece};
use start::{build, spawn_network, Built};

pub use reload::{ReloadError, Reloaded};

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
    /// Channels on NIC queues of their own (`steer`): each transport's queue address, in the
    /// order of the `nics` given; empty: every channel uses its NIC's address.
    pub queue_addresses: crate::steer::QueueAddresses,
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

#[derive(Debug, Clone)]
pub(super) struct Export {
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

/// What a reload needs to know of the storage threads.
#[derive(Debug)]
struct StorageKinds {
    /// The backends the storage threads find by export index.
    backends: Arc<crate::backend::BackendTable>,
    /// Whether storage threads (workers, and io_uring where the kernel allows it) run: only
    /// when the target started with a file or block export.
    threads: bool,
    /// Whether file and block exports use io_uring.
    uring: bool,
    /// Where RAM exports' memory goes.
    node: Option<u32>,
}

/// What the network threads and the handle share: flags, doorbells, the pieces of snapshots.
#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    /// Each network thread's doorbell.
    wakes: Vec<Arc<WakeFd>>,
    /// Snapshots asked for (a generation number).
    stats_requested: AtomicU64,
    /// Each thread's latest piece of a snapshot and its generation.
    pieces: Mutex<Vec<Option<(u64, Piece)>>>,
    published: Condvar,
    /// The last snapshot, made by the last thread to exit.
    last: Mutex<Option<Snapshot>>,
    /// Per thread: stopping, with nothing left to do.
    quiet: Vec<AtomicBool>,
    /// Every thread is quiet (or the drain limit passed): DISCONNECT and exit.
    closing: AtomicBool,
    /// Threads that have exited.
    exited: AtomicUsize,
    /// For the snapshot: the control, the polling, the clock's start.
    control: Arc<Mutex<Control>>,
    poll: PollConfig,
    start: std::time::Instant,
}

impl Shared {
    /// Rings every network thread's doorbell.
    fn wake(&self) {
        for w in &self.wakes {
            w.wake();
        }
    }

    /// Asks every thread for its piece of a new snapshot and waits (at most a second, and not
    /// for threads that have exited) until they all gave it: the snapshot of those pieces.
    fn stats(&self, alive: impl Fn() -> bool) -> Snapshot {
        let want = self.stats_requested.fetch_add(1, Ordering::SeqCst) + 1;
        self.wake();
        let guard = self.pieces.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let fresh = |p: &Vec<Option<(u64, Piece)>>| p.iter().all(|p| p.as_ref().is_some_and(|(g, _)| *g >= want));
        let (guard, _) = self
            .published
            .wait_timeout_while(guard, Duration::from_secs(1), |p| !fresh(p) && alive())
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        drop(guard);
        if let Some(last) = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone() {
            return last;
        }
        self.merged(self.now())
    }

    /// The snapshot of the pieces the threads last published, at `now`.
    fn merged(&self, now: Instant) -> Snapshot {
        let pieces: Vec<Piece> = self
            .pieces
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter_map(|p| p.as_ref().map(|(_, p)| p.clone()))
            .collect();
        snapshot::merge(&control::lock(&self.control), &pieces, self.poll, now)
    }

    fn now(&self) -> Instant {
        Instant(self.start.elapsed().as_nanos() as u64 + 1)
    }
}

/// Starts targets.
#[derive(Debug)]
pub struct Target;

/// A running target.
#[derive(Debug)]
pub struct TargetHandle {
    shared: Arc<Shared>,
    /// The configuration being served: as started, with what reloads applied.
    config: Config,
    storage_kinds: StorageKinds,
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
        let Built { networks, nics, nics_of, shared, workers, storage_kinds, config } =
            build(config, nics, &placement)?;
        let mut slots: Vec<Option<Nic>> = nics.into_iter().map(Some).collect();
        let mut network = Vec::new();
        for (members, net) in nics_of.iter().zip(networks) {
            let mine: Vec<(usize, Nic)> =
                members.iter().map(|&k| (k, slots[k].take().expect("each NIC on one thread"))).collect();
            let cpus = match members[..] {
                [k] => placement.nic_cpus.get(k).filter(|c| !c.is_empty()).unwrap_or(&placement.network_cpus).clone(),
                _ => placement.network_cpus.clone(),
            };
            // A thread serving NICs on several nodes binds its memory policy to them.
            let memory_nodes = if members.len() > 1 { placement.memory_nodes.clone() } else { Vec::new() };
            network.push(spawn_network(net, nics_of.len(), mine, cpus, memory_nodes)?);
        }
        Ok(TargetHandle { shared, config, storage_kinds, network, workers })
    }
}

impl TargetHandle {
    /// A fresh snapshot of the counters (waits up to a second for the network threads).
    pub fn stats(&self) -> Snapshot {
        self.shared.stats(|| self.network.iter().all(|h| !h.is_finished()))
    }

    /// A function that returns a fresh snapshot, for a stats server thread.
    pub fn stats_source(&self) -> impl Fn() -> Snapshot + Send + Sync + 'static {
        let shared = Arc::clone(&self.shared);
        move || shared.stats(|| shared.exited.load(Ordering::SeqCst) == 0)
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
        let last = self.shared.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        last.unwrap_or_else(|| self.shared.merged(self.shared.now()))
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
/// threads as in a daemon. With [`Harness::with_threads`], what would be each network thread's
/// state is turned in order on the caller's thread, messages between them included.
#[doc(hidden)]
pub struct Harness {
    /// Each network thread's state and its NICs.
    networks: Vec<(Network, Vec<(usize, Nic)>)>,
    _workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness").field("threads", &self.networks.len()).finish_non_exhaustive()
    }
}

impl Harness {
    /// Opens the exports of `config` and serves them on `nics` (one network thread, this one).
    pub fn new(mut config: Config, nics: Vec<Nic>) -> Result<Harness, StartError> {
        config.network_threads = NetworkThreads::One;
        Harness::with_threads(config, nics)
    }

    /// As [`Harness::new`], with the network threads `config` asks for (`per-nic`: one per
    /// NIC), all driven by [`Harness::turn`] on this thread.
    pub fn with_threads(config: Config, nics: Vec<Nic>) -> Result<Harness, StartError> {
        let Built { networks, nics, nics_of, workers, .. } = build(config, nics, &Placement::default())?;
        let mut slots: Vec<Option<Nic>> = nics.into_iter().map(Some).collect();
        let networks = networks
            .into_iter()
            .zip(nics_of)
            .map(|(net, members)| {
                let mine = members.iter().map(|&k| (k, slots[k].take().expect("each NIC on one thread"))).collect();
                (net, mine)
            })
            .collect();
        Ok(Harness { networks, _workers: workers })
    }

    /// One turn of every network thread's loop over its NICs; whether anything happened.
    pub fn turn(&mut self) -> bool {
        let mut busy = false;
        for (net, nics) in self.networks.iter_mut() {
            busy |= net.turn(nics).busy;
            for (_, nic) in nics.iter_mut() {
                let _ = nic.transport.flush();
            }
        }
        busy
    }

    /// Moves the target's clock forward (timers, dead channels, reclaim).
    pub fn advance(&mut self, by: Duration) {
        for (net, _) in self.networks.iter_mut() {
            net.clock.skew += by;
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> Snapshot {
        let net = &self.networks[0].0;
        let now = net.now();
        let pieces: Vec<Piece> = self.networks.iter().map(|(n, _)| n.piece(now)).collect();
        snapshot::merge(&control::lock(&net.control), &pieces, net.poll, now)
    }
}

/// The target's clock: real time since start, plus whatever [`Harness::advance`] added.
#[derive(Debug)]
struct Clock {
    start: std::time::Instant,
    /// Added to the clock (zero in a daemon).
    skew: Duration,
}

impl Default for Clock {
    fn default() -> Clock {
        Clock { start: std::time::Instant::now(), skew: Duration::ZERO }
    }
}

/// What one network thread owns (see docs/architecture.md, "Network threads"): its NICs'
/// state, its parts of sessions, its slot table, its storage jobs, its counters. Nothing here is
/// shared with another network thread: what crosses goes by the control ([`Control`], off the
/// per-frame path) and by messages in each thread's queue. Grouped by job, each part owned by
/// its module (see the module documentation).
struct Network {
    /// This thread's number (its parts of sessions are numbered so).
    g: usize,
    ethertype: u16,
    exports: Arc<[Export]>,
    /// Sessions by id: this thread's part of each.
    sessions: BTreeMap<u64, SessionState>,
    /// Slot memory, kept frames, read data in transmit chunks of this thread's channels.
    slots: SlotTable,
    /// Storage jobs of this thread's channels: queues, io_uring, completions, deadlines,
    /// deferred requests.
    storage: Storage,
    /// Per NIC (all of the target's; those of this thread, `served_by == g`, are used): counters,
    /// control queue, link state, memory placement, serving thread.
    nics: Vec<NicState>,
    /// What the threads share, behind its lock (handshakes, reclaim, failures).
    control: Arc<Mutex<Control>>,
    /// Every thread's queue and doorbell.
    post: Postal,
    /// This thread's queue.
    inbox: mpsc::Receiver<ThreadMsg>,
    /// How the network threads wait for work, and this one's counters.
    poll: PollConfig,
    poll_stats: PollStats,
    /// This thread's counters.
    counters: Counters,
    /// Where RAM and slot memory go when a channel's NIC names no node.
    node: Option<u32>,
    /// The limits in force.
    limits: crate::config::Limits,
    clock: Clock,
    shared: Arc<Shared>,
    stopping: Option<Instant>,
    /// The last snapshot generation this thread published its piece for.
    published: u64,
    /// When this thread next may ask the control to reclaim sessions.
    next_reclaim_check: Instant,
    /// Buffers a received frame may need, kept across frames.
    rx_buffers: RxBuffers,
}

/// A network thread's buffers for received frames, kept so that they are not reallocated.
#[derive(Debug, Default)]
struct RxBuffers {
    /// The plaintext of the last frame of an encrypting channel.
    scratch: Vec<u8>,
    /// The last frame that arrived in pieces and had to be whole (a sealed or DIGEST channel's).
    gather: Vec<u8>,
}

impl Network {
    fn now(&self) -> Instant {
        Instant((self.clock.start.elapsed() + self.clock.skew).as_nanos() as u64 + 1)
    }
}
