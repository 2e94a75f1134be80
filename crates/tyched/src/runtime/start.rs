//! Start-up: opening the exports, sizing the channels, starting the storage threads (workers
//! per node, io_uring rings), building the engine state ([`build`]), and starting one network
//! thread per set of NICs ([`spawn_network`]). [`super::Harness`] uses [`build`] alone and
//! turns the engine on its caller's thread.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tyche_channel::{Acceptor, Admission, ExportSpec, Instant};
use tyche_runtime::poll::{PollConfig, PollStats};
use tyche_runtime::wake::WakeFd;
use tyche_wire::{flags, ChannelParams, SECTOR_SIZE};

use crate::backend::{Backend, BackendTable, FileBackend, RamBackend};
use crate::config::{Config, ExportConfig, NetworkThreads, MAX_EXPORTS};
use crate::stats::{ExportStats, NicStats, StorageQueueStats};
use crate::workers::{DoneRoute, JobQueues, StoragePlan, ThreadStat, JOB_QUEUE};

use super::control::{Control, Postal};
use super::jobs::Storage;
use super::network::{serve, NicState};
use super::slots::SlotTable;
use super::snapshot::Counters;
use super::{Clock, Export, Network, Nic, Placement, RxBuffers, Shared, StartError, StorageKinds};
use crate::job::Done;
use crate::workers::pin;
use tyche_channel::Challenges;

/// A target's network threads' state, its NICs and its storage threads, before any network
/// thread runs.
pub(super) struct Built {
    /// What each network thread owns, in order.
    pub(super) networks: Vec<Network>,
    pub(super) nics: Vec<Nic>,
    /// NIC indices served by each network thread.
    pub(super) nics_of: Vec<Vec<usize>>,
    pub(super) shared: Arc<Shared>,
    pub(super) workers: Vec<JoinHandle<()>>,
    /// What a reload needs of the storage threads.
    pub(super) storage_kinds: StorageKinds,
    /// The configuration it serves.
    pub(super) config: Config,
}

/// Opens the exports, starts the storage threads and builds the control and each network
/// thread's state.
pub(super) fn build(config: Config, mut nics: Vec<Nic>, placement: &Placement) -> Result<Built, StartError> {
    config.validate()?;
    if nics.is_empty() {
        return Err(StartError::NoTransport);
    }
    let mut exports = open_exports(&config, placement.node)?;
    let acceptor = Acceptor::new(
        config.ethertype,
        exports.iter().map(|e| e.spec.clone()).collect(),
        channel_limits(&config, &nics),
        config.timers(),
    )
    .with_limits(config.limits.acceptor());
    let n_nics = nics.len();
    let (nics_of, thread_of) = assign_threads(config.network_threads, n_nics);
    let thread_wakes = nics_of.iter().map(|_| WakeFd::new().map(Arc::new)).collect::<std::io::Result<Vec<_>>>()?;
    let (storage, workers, storage_kinds) =
        start_storage(&config, placement, &mut exports, &nics, &thread_of, &thread_wakes)?;
    let l = config.limits;
    // The slot memory budget is shared out between the threads (each has at least one slot).
    let budget = (l.slot_memory.0 / nics_of.len() as u64).max(l.max_io as u64);
    let mut slots: Vec<SlotTable> = nics_of.iter().map(|_| SlotTable::new(n_nics, l.max_io as usize, budget)).collect();
    // Read data goes straight into transmit chunks the transports lend, where the exports
    // can read into them.
    if exports.iter().any(|e| e.lend) {
        for (k, n) in nics.iter_mut().enumerate() {
            slots[thread_of[k]].lend_tx(k, n.transport.lend_tx_chunks(usize::MAX));
        }
    }
    let exports: Arc<[Export]> = exports.into();
    let (post, inboxes) = Postal::new(thread_wakes.clone());
    let control = Arc::new(Mutex::new(Control {
        exports: Arc::clone(&exports),
        admission: Admission::new(acceptor, Challenges::new(l.challenges, l.challenges_per_mac)),
        queue_addresses: queue_addresses(&placement.queue_addresses, n_nics)?,
        thread_of: thread_of.clone(),
        nic_names: nics.iter().map(|n| n.name.clone()).collect(),
        post: post.clone(),
        denied: vec![0; exports.len()],
        fenced: 0,
        reclaimed: 0,
        reload: crate::stats::ReloadStats::default(),
        reclaim_after: Duration::from_millis(config.reclaim_after_ms),
    }));
    let poll = config.poll_config()?;
    let clock = Clock::default();
    let shared = Arc::new(Shared::new(thread_wakes.clone(), Arc::clone(&control), poll, clock.start));
    let export_counters: Vec<ExportStats> = exports.iter().map(|_| ExportStats::default()).collect();
    let networks = storage
        .into_iter()
        .zip(slots)
        .zip(inboxes)
        .enumerate()
        .map(|(g, ((storage, slots), inbox))| Network {
            g,
            ethertype: config.ethertype,
            // Each thread its own copy of the table (the backends stay shared): the count a
            // thread writes when it holds the table for a batch of jobs is on its own line.
            exports: exports.iter().cloned().collect(),
            sessions: BTreeMap::new(),
            slots,
            storage,
            nics: nic_states(&nics, placement, &thread_of),
            control: Arc::clone(&control),
            post: post.clone(),
            inbox,
            poll,
            poll_stats: PollStats::default(),
            counters: Counters { exports: export_counters.clone(), ..Counters::default() },
            node: placement.node,
            limits: l,
            clock: Clock { start: clock.start, skew: Duration::ZERO },
            shared: Arc::clone(&shared),
            stopping: None,
            published: 0,
            next_reclaim_check: Instant(0),
            rx_buffers: RxBuffers::default(),
        })
        .collect();
    tracing::info!(nics = n_nics, threads = nics_of.len(), "serving");
    Ok(Built { networks, nics, nics_of, shared, workers, storage_kinds, config })
}

/// Which NICs each network thread serves, and which thread serves each NIC.
fn assign_threads(threads: NetworkThreads, n_nics: usize) -> (Vec<Vec<usize>>, Vec<usize>) {
    let nics_of: Vec<Vec<usize>> = match threads {
        NetworkThreads::One => vec![(0..n_nics).collect()],
        NetworkThreads::PerNic => (0..n_nics).map(|k| vec![k]).collect(),
    };
    let mut thread_of = vec![0; n_nics];
    for (g, members) in nics_of.iter().enumerate() {
        for &k in members {
            thread_of[k] = g;
        }
    }
    (nics_of, thread_of)
}

/// A network thread's view of every NIC. Slot memory of a channel goes on its NIC's node
/// (where the transport put its UMEM), else where the placement says. The transports' memory
/// does not move: where it is is read once here, for the placement report.
fn nic_states(nics: &[Nic], placement: &Placement, thread_of: &[usize]) -> Vec<NicState> {
    nics.iter()
        .enumerate()
        .map(|(k, n)| {
            let caps = n.transport.capabilities();
            NicState {
                stats: NicStats { name: n.name.clone(), mac: caps.local_mac.to_string(), ..NicStats::default() },
                control: Default::default(),
                down: false,
                node: caps.numa_node.or(placement.node),
                areas: caps.memory_areas,
                thread: None,
                served_by: thread_of[k],
                local_mac: caps.local_mac,
                tx_busy: Default::default(),
                tx_used: Default::default(),
            }
        })
        .collect()
}

impl Shared {
    /// What the network threads (one per doorbell in `wakes`) and the daemon share.
    fn new(
        wakes: Vec<Arc<WakeFd>>,
        control: Arc<Mutex<Control>>,
        poll: PollConfig,
        start: std::time::Instant,
    ) -> Shared {
        let threads = wakes.len();
        Shared {
            stop: AtomicBool::new(false),
            wakes,
            stats_requested: AtomicU64::new(0),
            pieces: Mutex::new(vec![None; threads]),
            published: Condvar::new(),
            last: Mutex::new(None),
            quiet: (0..threads).map(|_| AtomicBool::new(false)).collect(),
            closing: AtomicBool::new(false),
            exited: AtomicUsize::new(0),
            control,
            poll,
            start,
        }
    }
}

/// The queue addresses of the placement, checked against the NICs given.
fn queue_addresses(
    q: &crate::steer::QueueAddresses,
    n_nics: usize,
) -> Result<crate::steer::QueueAddresses, StartError> {
    if q.of_nic.is_empty() {
        return Ok(crate::steer::QueueAddresses::default());
    }
    if q.of_nic.len() != n_nics || q.iface_of.len() != n_nics {
        return Err(crate::config::ConfigError::Invalid {
            field: "steer".into(),
            message: format!("queue addresses for {} transports, {n_nics} given", q.of_nic.len()),
        }
        .into());
    }
    for m in q.of_nic.iter().flatten() {
        crate::steer::check_queue_mac(*m)
            .map_err(|e| crate::config::ConfigError::Invalid { field: "queue_macs".into(), message: e.to_string() })?;
    }
    Ok(q.clone())
}

/// Opens every export of `config` (RAM exports on `node`).
fn open_exports(config: &Config, node: Option<u32>) -> Result<Vec<Export>, StartError> {
    config.exports.iter().enumerate().map(|(index, e)| open_export(e, index, node)).collect()
}

/// Opens export `e` (number `index` in its configuration; a RAM export on `node`).
pub(super) fn open_export(e: &ExportConfig, index: usize, node: Option<u32>) -> Result<Export, StartError> {
    let backend: Arc<dyn Backend> =
        match &e.path {
            None => {
                Arc::new(RamBackend::new(e.size.expect("validated").0, node).map_err(|source| StartError::Backend {
                    index,
                    name: e.name.clone(),
                    source,
                })?)
            }
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
    Ok(Export {
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
        key: e.key_bytes().map_err(|m| crate::config::ConfigError::Invalid {
            field: format!("export[{index}].key_file"),
            message: m,
        })?,
        read_only: e.read_only,
        shared: e.shared,
    })
}

/// The most a channel may have: the configured limits, with a segment that fits every NIC's
/// MTU and buffers.
fn channel_limits(config: &Config, nics: &[Nic]) -> ChannelParams {
    let segment = nics
        .iter()
        .map(|n| n.transport.capabilities())
        .filter_map(|c| tyche_wire::segment_size_for(c.mtu, c.frame_capacity))
        .min()
        .unwrap_or(SECTOR_SIZE)
        .min(config.limits.segment as u32) as u16;
    let l = config.limits;
    ChannelParams {
        ring: l.ring,
        remq_slots: l.remq_slots,
        damq_slots: l.damq_slots,
        segment,
        max_io: l.max_io,
        // Granted to initiators that ask: a CRC32C of every DATA payload.
        features: flags::FEATURE_DIGEST | flags::FEATURE_BLOCK_STATUS,
    }
}

/// What [`start_storage`] started: each network thread's side of storage, the storage threads,
/// and what a reload needs to know of them.
type StorageStarted = (Vec<Storage>, Vec<JoinHandle<()>>, StorageKinds);

/// Starts the storage threads of file and block exports (RAM exports execute on the network
/// thread): the workers of each node's queue, and the io_uring rings where the kernel allows
/// them (marking the exports that use them). Completions go back to the network thread
/// (`thread_of`) of their channel's NIC, woken on its eventfd.
fn start_storage(
    config: &Config,
    placement: &Placement,
    exports: &mut [Export],
    nics: &[Nic],
    thread_of: &[usize],
    thread_wakes: &[Arc<WakeFd>],
) -> Result<StorageStarted, StartError> {
    let n_nics = nics.len();
    let nics_of = thread_wakes.len();
    let backends = Arc::new(BackendTable::new(MAX_EXPORTS));
    for (i, e) in exports.iter().enumerate() {
        assert!(backends.set(i, Arc::clone(&e.backend)), "validated: at most MAX_EXPORTS exports");
    }
    let (done_txs, done_rx): (Vec<_>, Vec<_>) = (0..nics_of).map(|_| mpsc::channel::<Done>()).unzip();
    let route = DoneRoute::new(done_txs, thread_wakes.to_vec(), thread_of.to_vec());
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
    let uring = if files {
        let (queues, started) = start_uring(config, &storage, exports, &backends, &route, &jobs)?;
        for (stat, handle) in started {
            threads.push(stat);
            workers.push(handle);
        }
        queues
    } else {
        Vec::new()
    };
    drop(route);
    let queue_stats: Vec<StorageQueueStats> = storage
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
    let deadline = Duration::from_millis(config.storage_deadline_ms);
    // Each network thread hands out its own jobs and gets its own completions back.
    let per_thread = done_rx
        .into_iter()
        .map(|rx| {
            let uring = uring.iter().map(crate::uring::UringQueue::share).collect();
            Storage::new(jobs.share(), uring, rx, threads.clone(), queue_stats.clone(), deadline)
        })
        .collect();
    let kinds = StorageKinds { backends, threads: files, uring: !uring.is_empty(), node: placement.node };
    Ok((per_thread, workers, kinds))
}

/// The io_uring rings started, and each ring's thread with its stats.
type UringStarted = (Vec<crate::uring::UringQueue>, Vec<(Arc<ThreadStat>, JoinHandle<()>)>);

/// File and block exports use io_uring where the kernel allows it (a ring per storage queue,
/// on that queue's node), else the pool of storage workers: the rings, none if not.
fn start_uring(
    config: &Config,
    storage: &StoragePlan,
    exports: &mut [Export],
    backends: &Arc<BackendTable>,
    route: &DoneRoute,
    jobs: &JobQueues,
) -> Result<UringStarted, StartError> {
    let n_workers: usize = storage.nodes.iter().map(|n| n.workers.len()).sum();
    let mut uring = Vec::new();
    let mut started = Vec::new();
    let rings: Result<Vec<_>, crate::uring::RingError> = if config.io_uring {
        storage.nodes.iter().map(|_| crate::uring::open()).collect()
    } else {
        Err(crate::uring::RingError::Disabled)
    };
    match rings {
        Ok(rings) => {
            let mut fallocate = true;
            for (q, (ring, node)) in rings.into_iter().zip(&storage.nodes).enumerate() {
                let stat =
                    ThreadStat::new(format!("tyched-uring{q}"), "io_uring", node.node, node.ring_cpus.clone(), q);
                let (queue, thread) =
                    crate::uring::start(ring, Arc::clone(backends), route.clone(), jobs.sender(q), Arc::clone(&stat))?;
                fallocate &= queue.fallocate;
                started.push((stat, thread));
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
    Ok((uring, started))
}

/// Starts network thread `net.g` (of `nics_of`), serving `mine` (NIC index and NIC) on `cpus`,
/// with its memory policy bound to `memory_nodes` if any.
pub(super) fn spawn_network(
    mut net: Network,
    nics_of: usize,
    mine: Vec<(usize, Nic)>,
    cpus: Vec<u32>,
    memory_nodes: Vec<u32>,
) -> std::io::Result<JoinHandle<()>> {
    let g = net.g;
    let name = if nics_of == 1 { "tyched-net".to_owned() } else { format!("tyched-net{g}") };
    std::thread::Builder::new().name(name).spawn(move || {
        pin(&cpus, "network thread");
        if !memory_nodes.is_empty() {
            if let Err(e) = tyche_numa::alloc::bind_thread_memory_to(&memory_nodes) {
                tracing::warn!(nodes = ?memory_nodes, "cannot bind the network thread's memory policy: {e}");
            }
        }
        // The placement report shows each NIC's serving thread as it sees itself.
        let me = tyche_numa::report::this_thread();
        for (k, _) in &mine {
            net.nics[*k].thread = Some(me.clone());
        }
        serve(net, mine);
    })
}
