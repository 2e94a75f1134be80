//! Storage workers on their NUMA node: where they run, and where each job and each completion
//! goes.
//!
//! The NESUS 2015 paper's target has a NUMA-aware work queue: one thread per core, pinned there,
//! and each completion submitted to the queue of its channel's node. `tyched` does the same with
//! its storage workers (`tyched-io{w}`), which are the completion workers of the placement plan
//! (`tyche_numa::placement::plan`):
//!
//! - [`StoragePlan::from_plan`]: one queue per node that has channels, each with one worker per
//!   completion worker the plan put on that node (pinned to its CPU, memory policy bound to the
//!   node), and at least [`FALLBACK_WORKERS`] (extra ones on the same CPUs). A node with channels but no planned worker (its cores all run network threads or
//!   consumers) gets [`FALLBACK_WORKERS`] workers allowed on all of that node's CPUs: its jobs
//!   still run on its node. The plan's workers on nodes without channels are not started: no job
//!   would reach them.
//! - [`StoragePlan::pool`]: without a topology, or with `workers = N` given, the old pool: one
//!   queue, `N` workers on the CPUs the placement names (or anywhere).
//! - `JobQueues`: one bounded queue ([`JOB_QUEUE`] jobs) per node; a job goes to the queue of
//!   its channel's NIC's node; what does not fit waits, in order, until the queue has room.
//! - `DoneRoute`: a finished job goes back to the done queue of the network thread that
//!   serves its channel's NIC, and that thread's eventfd is signalled.
//!
//! The io_uring engine follows the same plan: one ring thread per queue, pinned to the first
//! worker's CPU of that node (see [`crate::uring`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use tyche_numa::{Plan, ThreadPlacement, Topology};
use tyche_runtime::wake::WakeFd;
use tyche_wire::Status;

use crate::backend::BackendTable;
use crate::job::{execute_contained, Done, Job};
use crate::stats::StorageThreadStats;

/// Pins the calling thread (the `what`, for the warning when it cannot) to `cpus`; none: not
/// pinned.
pub(crate) fn pin(cpus: &[u32], what: &str) {
    if !cpus.is_empty() {
        if let Err(e) = tyche_numa::pin_current_thread(cpus) {
            tracing::warn!(?cpus, "could not pin the {what}: {e}");
        }
    }
}

/// Storage jobs queued at most per node's queue (beyond it, jobs wait on the network thread in
/// their node's overflow list, whose length the sessions' `damq` slots bound).
pub const JOB_QUEUE: usize = 4096;
/// Storage workers per node at least. Storage calls block (the pool serves what io_uring does
/// not), so a node with one planned completion worker gets a second one on the same CPU: one
/// hung request does not hold up every other job of the node. Also the number of workers of a
/// node that has channels but no completion worker in the plan (every core of it runs a network
/// thread or a consumer), allowed on all of the node's CPUs.
pub const FALLBACK_WORKERS: usize = 2;

/// One storage worker to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The CPUs it is pinned to (empty: not pinned).
    pub cpus: Vec<u32>,
    /// Whether it is a completion worker of the plan (else a fallback or pool worker).
    pub planned: bool,
}

/// One node's storage queue and its workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageNode {
    /// The node (`None`: no particular node, the pool).
    pub node: Option<u32>,
    /// Its workers.
    pub workers: Vec<WorkerSpec>,
    /// Where the node's io_uring thread runs (empty: not pinned).
    pub ring_cpus: Vec<u32>,
    /// Whether the node had no planned completion worker (its workers are [`FALLBACK_WORKERS`]
    /// allowed on all of its CPUs).
    pub fallback: bool,
}

/// Where storage jobs run: a queue per node, and each NIC's queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoragePlan {
    /// The queues.
    pub nodes: Vec<StorageNode>,
    /// Per NIC (in the order given to the target): the index in `nodes` of the queue that takes
    /// its channels' jobs.
    pub nic_queue: Vec<usize>,
}

impl StoragePlan {
    /// The plan's completion workers as storage workers, for the NICs labelled `nic_labels`
    /// (`IF`, or `IF/QUEUE` for the AF_XDP queue `QUEUE` of `IF`): a queue per node the plan
    /// puts their channels on. A NIC the plan does not place shares an unpinned queue with no
    /// node ([`FALLBACK_WORKERS`] workers).
    pub fn from_plan(topo: &Topology, plan: &Plan, nic_labels: &[String]) -> StoragePlan {
        let node_of = |label: &String| {
            let (name, queue) = match label.split_once('/') {
                Some((n, q)) => (n, q.parse().unwrap_or(0)),
                None => (label.as_str(), 0),
            };
            plan.channels.iter().find(|c| c.nic == name && c.channel == queue).map(|c| c.node)
        };
        let nic_nodes: Vec<Option<u32>> = nic_labels.iter().map(node_of).collect();
        let mut nodes: Vec<Option<u32>> = nic_nodes.clone();
        nodes.sort_unstable();
        nodes.dedup();
        let mut out = StoragePlan::default();
        for node in &nodes {
            let entry = match node {
                Some(n) => {
                    let planned: Vec<WorkerSpec> =
                        plan.workers_on(*n).map(|w| WorkerSpec { cpus: vec![w.cpu], planned: true }).collect();
                    if planned.is_empty() {
                        let cpus = topo.node(*n).map(|x| x.cpus.clone()).unwrap_or_default();
                        tracing::warn!(
                            node = n,
                            ?cpus,
                            "no completion worker planned on node {n} (every core runs a network thread or a \
                             consumer): {FALLBACK_WORKERS} storage workers share its CPUs"
                        );
                        StorageNode {
                            node: Some(*n),
                            workers: vec![WorkerSpec { cpus: cpus.clone(), planned: false }; FALLBACK_WORKERS],
                            ring_cpus: cpus,
                            fallback: true,
                        }
                    } else {
                        let mut planned = planned;
                        let have = planned.len();
                        for i in have..FALLBACK_WORKERS {
                            planned.push(planned[i % have].clone());
                        }
                        let ring_cpus = planned[0].cpus.clone();
                        StorageNode { node: Some(*n), workers: planned, ring_cpus, fallback: false }
                    }
                }
                None => StorageNode {
                    node: None,
                    workers: vec![WorkerSpec { cpus: Vec::new(), planned: false }; FALLBACK_WORKERS],
                    ring_cpus: Vec::new(),
                    fallback: true,
                },
            };
            out.nodes.push(entry);
        }
        out.nic_queue = nic_nodes
            .iter()
            .map(|n| nodes.iter().position(|x| x == n).expect("every NIC's node has a queue"))
            .collect();
        out
    }

    /// The pool without a plan: one queue on `node`, `workers` workers on `cpus` (empty: not
    /// pinned), serving `nics` NICs.
    pub fn pool(workers: usize, cpus: &[u32], node: Option<u32>, nics: usize) -> StoragePlan {
        StoragePlan {
            nodes: vec![StorageNode {
                node,
                workers: vec![WorkerSpec { cpus: cpus.to_vec(), planned: false }; workers],
                ring_cpus: cpus.to_vec(),
                fallback: false,
            }],
            nic_queue: vec![0; nics],
        }
    }
}

/// What one storage thread (a worker or an io_uring thread) has done, shared with the stats.
#[derive(Debug)]
pub(crate) struct ThreadStat {
    pub(crate) name: String,
    pub(crate) kind: &'static str,
    pub(crate) node: Option<u32>,
    pub(crate) cpus: Vec<u32>,
    pub(crate) queue: usize,
    pub(crate) jobs: AtomicU64,
    /// The thread as it saw itself once placed.
    pub(crate) thread: OnceLock<ThreadPlacement>,
}

impl ThreadStat {
    pub(crate) fn new(name: String, kind: &'static str, node: Option<u32>, cpus: Vec<u32>, queue: usize) -> Arc<Self> {
        Arc::new(ThreadStat { name, kind, node, cpus, queue, jobs: AtomicU64::new(0), thread: OnceLock::new() })
    }

    pub(crate) fn executed(&self) {
        self.jobs.fetch_add(1, Ordering::Relaxed);
    }

    /// Jobs executed so far.
    pub(crate) fn jobs(&self) -> u64 {
        self.jobs.load(Ordering::Relaxed)
    }

    /// The thread's row in the stats.
    pub(crate) fn snapshot(&self) -> StorageThreadStats {
        StorageThreadStats {
            name: self.name.clone(),
            kind: self.kind.to_owned(),
            node: self.node,
            planned_cpus: self.cpus.clone(),
            thread: self.thread.get().cloned().unwrap_or_default(),
            jobs: self.jobs(),
        }
    }

    /// Pins the calling thread as planned, binds its memory policy to `bind` (planned workers
    /// only) and records where it runs.
    pub(crate) fn place(&self, bind: Option<u32>) {
        pin(&self.cpus, &self.name);
        if let Some(node) = bind {
            if let Err(e) = tyche_numa::alloc::bind_thread_memory(node) {
                tracing::warn!(thread = %self.name, node, "cannot bind the storage thread's memory policy: {e}");
            }
        }
        let _ = self.thread.set(tyche_numa::report::this_thread());
    }
}

/// Finished jobs back to the network thread serving their channel's NIC.
#[derive(Clone, Debug)]
pub(crate) struct DoneRoute {
    txs: Vec<mpsc::Sender<Done>>,
    wakes: Vec<Arc<WakeFd>>,
    /// NIC → network thread.
    thread_of: Arc<[usize]>,
}

impl DoneRoute {
    pub(crate) fn new(txs: Vec<mpsc::Sender<Done>>, wakes: Vec<Arc<WakeFd>>, thread_of: Vec<usize>) -> Self {
        assert_eq!(txs.len(), wakes.len(), "one done queue and eventfd per network thread");
        DoneRoute { txs, wakes, thread_of: thread_of.into() }
    }

    /// The network thread a job's completion goes to: its NIC's (thread 0 when it has none).
    pub(crate) fn thread_of(&self, job: &Job) -> usize {
        job.nic.and_then(|k| self.thread_of.get(k).copied()).filter(|&g| g < self.txs.len()).unwrap_or(0)
    }

    /// Queues `done` for its network thread; the thread to wake, or `None` if that thread is gone.
    pub(crate) fn send(&self, done: Done) -> Option<usize> {
        let g = self.thread_of(&done.job);
        self.txs[g].send(done).ok().map(|()| g)
    }

    /// Signals thread `g`'s network thread.
    pub(crate) fn wake(&self, g: usize) {
        if let Some(w) = self.wakes.get(g) {
            w.wake();
        }
    }

    /// Signals every network thread.
    pub(crate) fn wake_all(&self) {
        for w in &self.wakes {
            w.wake();
        }
    }
}

/// The network side of the per-node job queues: each queue's sender, the jobs waiting for room
/// in it, and each NIC's queue.
#[derive(Debug)]
pub(crate) struct JobQueues {
    tx: Vec<mpsc::SyncSender<Job>>,
    overflow: Vec<VecDeque<Job>>,
    nic_queue: Vec<usize>,
}

impl JobQueues {
    /// Queues of `capacity` jobs each, one per entry of `nic_queue`'s targets; returns the
    /// receivers, in queue order.
    pub(crate) fn new(queues: usize, capacity: usize, nic_queue: Vec<usize>) -> (Self, Vec<mpsc::Receiver<Job>>) {
        let queues = queues.max(1);
        let (tx, rx): (Vec<_>, Vec<_>) = (0..queues).map(|_| mpsc::sync_channel::<Job>(capacity)).unzip();
        let q = JobQueues { tx, overflow: (0..queues).map(|_| VecDeque::new()).collect(), nic_queue };
        (q, rx)
    }

    /// Another network thread's end of the same queues (its own jobs waiting for room).
    pub(crate) fn share(&self) -> JobQueues {
        JobQueues {
            tx: self.tx.clone(),
            overflow: self.tx.iter().map(|_| VecDeque::new()).collect(),
            nic_queue: self.nic_queue.clone(),
        }
    }

    /// The queue of a job's channel's NIC (queue 0 for a job with no NIC).
    pub(crate) fn queue_of(&self, nic: Option<usize>) -> usize {
        nic.and_then(|k| self.nic_queue.get(k).copied()).filter(|&q| q < self.tx.len()).unwrap_or(0)
    }

    /// The sender of queue `q` (the io_uring thread of that node hands it what it cannot do).
    pub(crate) fn sender(&self, q: usize) -> mpsc::SyncSender<Job> {
        self.tx[q].clone()
    }

    /// Adds `job` behind the jobs waiting for its queue.
    pub(crate) fn push(&mut self, job: Job) {
        let q = self.queue_of(job.nic);
        self.overflow[q].push_back(job);
    }

    /// Moves waiting jobs into their queues while they have room; returns the jobs whose
    /// queue has no worker left (to be failed).
    pub(crate) fn submit(&mut self) -> Vec<Job> {
        let mut orphans = Vec::new();
        for (tx, waiting) in self.tx.iter().zip(self.overflow.iter_mut()) {
            while let Some(j) = waiting.pop_front() {
                match tx.try_send(j) {
                    Ok(()) => {}
                    Err(mpsc::TrySendError::Full(j)) => {
                        waiting.push_front(j);
                        break;
                    }
                    Err(mpsc::TrySendError::Disconnected(j)) => orphans.push(j),
                }
            }
        }
        orphans
    }

    /// Whether no job waits for room.
    pub(crate) fn is_empty(&self) -> bool {
        self.overflow.iter().all(VecDeque::is_empty)
    }

    /// Every job waiting for room.
    pub(crate) fn waiting_mut(&mut self) -> impl Iterator<Item = &mut Job> {
        self.overflow.iter_mut().flatten()
    }
}

/// Starts the storage workers of queue `q` of `plan`, each taking jobs from `rx`.
pub(crate) fn start_workers(
    plan: &StorageNode,
    q: usize,
    first: usize,
    rx: mpsc::Receiver<Job>,
    backends: &Arc<BackendTable>,
    route: &DoneRoute,
    stats: &mut Vec<Arc<ThreadStat>>,
) -> std::io::Result<Vec<JoinHandle<()>>> {
    let rx = Arc::new(Mutex::new(rx));
    let mut threads = Vec::new();
    for (i, spec) in plan.workers.iter().enumerate() {
        let name = format!("tyched-io{}", first + i);
        let stat = ThreadStat::new(name.clone(), "worker", plan.node, spec.cpus.clone(), q);
        stats.push(Arc::clone(&stat));
        let bind = plan.node.filter(|_| spec.planned || plan.fallback);
        let (rx, backends, route) = (Arc::clone(&rx), Arc::clone(backends), route.clone());
        threads.push(std::thread::Builder::new().name(name).spawn(move || {
            stat.place(bind);
            loop {
                let job = rx.lock().unwrap_or_else(std::sync::PoisonError::into_inner).recv();
                let Ok(mut job) = job else { return };
                let status = match backends.get(job.export) {
                    Some(b) => execute_contained(b, &mut job),
                    None => {
                        // A bug: exports are in the table before any session can use them.
                        tracing::error!(export = job.export, "a job for an export with no backend; failed");
                        Status::IoError
                    }
                };
                stat.executed();
                let Some(g) = route.send(Done { job, status }) else { return };
                route.wake(g);
            }
        })?);
    }
    Ok(threads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use tyche_numa::placement::{plan, PlacementRequest};
    use tyche_wire::{Op, Request, Seq, Status, NO_SLOT};

    fn fixture(name: &str) -> Topology {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tyche-numa/fixtures").join(name);
        Topology::from_xml_file(&path).expect("fixture loads")
    }

    fn job(nic: Option<usize>, id: u64) -> Job {
        let request = Request {
            seq: Seq::default(),
            op: Op::Flush,
            fua: false,
            remq: 0,
            damq: NO_SLOT,
            home: 0,
            tag: id,
            floor: 0,
            offset: 0,
            length: 0,
        };
        Job {
            session: 1,
            channel: 0,
            epoch: 0,
            export: 0,
            request,
            buf: None,
            lent: Vec::new(),
            region: None,
            abort: false,
            id,
            fence: None,
            nic,
        }
    }

    /// The paper's server: 2 sockets x 4 cores, NICs ens1f0 (node 0) and ens3f0 (node 1).
    fn paper(nics: &[&str]) -> (Topology, Plan, Vec<String>) {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let labels: Vec<String> = nics.iter().map(|s| s.to_string()).collect();
        let req = PlacementRequest::channels_per_nic(&topo, &labels, 1).expect("known NICs");
        let p = plan(&topo, &req);
        (topo, p, labels)
    }

    #[test]
    fn a_queue_per_node_with_the_planned_workers() {
        let (topo, p, labels) = paper(&["ens1f0", "ens3f0"]);
        let s = StoragePlan::from_plan(&topo, &p, &labels);
        assert_eq!(s.nodes.len(), 2, "{s:?}");
        assert_eq!((s.nodes[0].node, s.nodes[1].node), (Some(0), Some(1)));
        // Node 0: cores 0-3 (CPUs 0,1 / 2,3 / ...), the network thread on the highest core, a
        // worker on the first CPU of each other core.
        let cpus = |n: &StorageNode| n.workers.iter().map(|w| w.cpus.clone()).collect::<Vec<_>>();
        assert_eq!(cpus(&s.nodes[0]), vec![vec![0], vec![2], vec![4]]);
        assert_eq!(cpus(&s.nodes[1]), vec![vec![8], vec![10], vec![12]]);
        assert!(s.nodes.iter().all(|n| !n.fallback && n.workers.iter().all(|w| w.planned)));
        assert_eq!(s.nodes[1].ring_cpus, vec![8], "the ring on the node's first worker CPU");
        assert_eq!(s.nic_queue, vec![0, 1], "each NIC's jobs to its node's queue");
        // Every planned worker on a node with channels is started, and only those.
        let planned: Vec<u32> = p.completion_workers.iter().map(|w| w.cpu).collect();
        let started: Vec<u32> = s.nodes.iter().flat_map(|n| n.workers.iter().map(|w| w.cpus[0])).collect();
        assert_eq!(planned, started);
    }

    #[test]
    fn a_node_with_one_planned_worker_gets_a_second_on_its_cpu() {
        // The two-node VM of `cargo xtask vm-test`: 2 cores per node, one NIC per node.
        let (topo, mut p, labels) = paper(&["ens1f0", "ens3f0"]);
        p.completion_workers.retain(|w| w.cpu == 0 || w.cpu == 8);
        let s = StoragePlan::from_plan(&topo, &p, &labels);
        let cpus = |n: &StorageNode| n.workers.iter().map(|w| w.cpus.clone()).collect::<Vec<_>>();
        assert_eq!(cpus(&s.nodes[0]), vec![vec![0], vec![0]]);
        assert_eq!(cpus(&s.nodes[1]), vec![vec![8], vec![8]]);
        assert!(s.nodes.iter().all(|n| !n.fallback));
    }

    #[test]
    fn nodes_without_channels_start_no_workers() {
        let (topo, p, labels) = paper(&["ens3f0"]);
        assert!(p.workers_on(0).count() > 0, "the plan has node-0 workers");
        let s = StoragePlan::from_plan(&topo, &p, &labels);
        assert_eq!(s.nodes.len(), 1);
        assert_eq!(s.nodes[0].node, Some(1));
        assert_eq!(s.nic_queue, vec![0]);
    }

    #[test]
    fn a_node_without_planned_workers_falls_back_to_its_cpus() {
        let (topo, mut p, labels) = paper(&["ens1f0", "ens3f0"]);
        // As when consumers or network threads take every core of node 1.
        p.completion_workers.retain(|w| w.node != 1);
        let s = StoragePlan::from_plan(&topo, &p, &labels);
        let n1 = &s.nodes[1];
        assert_eq!(n1.node, Some(1));
        assert!(n1.fallback);
        assert_eq!(n1.workers.len(), FALLBACK_WORKERS);
        let node1: Vec<u32> = (8..16).collect();
        assert!(n1.workers.iter().all(|w| !w.planned && w.cpus == node1), "{n1:?}");
        assert_eq!(n1.ring_cpus, node1);
        assert!(!s.nodes[0].fallback);
    }

    #[test]
    fn queues_of_several_channels_per_nic_and_unplaced_nics() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let names = vec!["ens1f0".to_string(), "ens3f0".to_string()];
        let req = PlacementRequest::channels_per_nic(&topo, &names, 2).expect("known");
        let p = plan(&topo, &req);
        let labels: Vec<String> =
            ["ens1f0/0", "ens1f0/1", "ens3f0/0", "ens3f0/1", "veth9"].iter().map(|s| s.to_string()).collect();
        let s = StoragePlan::from_plan(&topo, &p, &labels);
        let nodes: Vec<Option<u32>> = s.nodes.iter().map(|n| n.node).collect();
        assert_eq!(nodes, vec![None, Some(0), Some(1)]);
        assert_eq!(s.nic_queue, vec![1, 1, 2, 2, 0]);
        assert!(s.nodes[0].workers.iter().all(|w| w.cpus.is_empty()), "the unplaced NIC's queue is not pinned");
    }

    #[test]
    fn a_job_goes_to_its_nics_node_queue() {
        let (topo, p, labels) = paper(&["ens1f0", "ens3f0"]);
        let s = StoragePlan::from_plan(&topo, &p, &labels);
        let (mut q, rx) = JobQueues::new(s.nodes.len(), 8, s.nic_queue.clone());
        q.push(job(Some(1), 1));
        q.push(job(Some(0), 2));
        q.push(job(Some(1), 3));
        q.push(job(None, 4));
        assert!(q.submit().is_empty());
        assert!(q.is_empty());
        let ids = |r: &mpsc::Receiver<Job>| r.try_iter().map(|j| j.id).collect::<Vec<_>>();
        assert_eq!(ids(&rx[1]), vec![1, 3], "node 1's queue has the jobs of the node-1 NIC, in order");
        assert_eq!(ids(&rx[0]), vec![2, 4], "node 0's, and a job without a NIC");
        assert_eq!(q.queue_of(Some(99)), 0, "a NIC index out of range goes to queue 0");
    }

    #[test]
    fn a_full_queue_keeps_jobs_waiting_in_order_and_a_gone_worker_returns_them() {
        let (mut q, rx) = JobQueues::new(2, 1, vec![0, 1]);
        for id in 1..=3 {
            q.push(job(Some(1), id));
        }
        q.push(job(Some(0), 9));
        assert!(q.submit().is_empty(), "a full queue is no error");
        assert!(!q.is_empty(), "two jobs wait for room");
        assert_eq!(q.waiting_mut().map(|j| j.id).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(rx[1].try_recv().map(|j| j.id).ok(), Some(1));
        assert_eq!(rx[0].try_recv().map(|j| j.id).ok(), Some(9), "another node's queue is not held up");
        assert!(q.submit().is_empty());
        assert_eq!(rx[1].try_recv().map(|j| j.id).ok(), Some(2), "room again: the next in order");
        let [r0, r1]: [mpsc::Receiver<Job>; 2] = rx.try_into().expect("two queues");
        drop(r1);
        let gone = q.submit();
        assert_eq!(gone.iter().map(|j| j.id).collect::<Vec<_>>(), vec![3], "no worker left: handed back to fail");
        assert!(q.is_empty());
        drop(r0);
    }

    #[test]
    fn completions_go_to_the_nics_network_thread() {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..2).map(|_| mpsc::channel::<Done>()).unzip();
        let wakes: Vec<Arc<WakeFd>> = (0..2).map(|_| Arc::new(WakeFd::new().expect("eventfd"))).collect();
        // NICs 0 and 2 on thread 0, NIC 1 on thread 1.
        let route = DoneRoute::new(txs, wakes, vec![0, 1, 0]);
        for (nic, id) in [(Some(1), 1), (Some(0), 2), (Some(2), 3), (None, 4), (Some(7), 5)] {
            let g = route.send(Done { job: job(nic, id), status: Status::Ok }).expect("the thread is there");
            route.wake(g);
        }
        let ids = |r: &mpsc::Receiver<Done>| r.try_iter().map(|d| d.job.id).collect::<Vec<_>>();
        assert_eq!(ids(&rxs[1]), vec![1]);
        assert_eq!(ids(&rxs[0]), vec![2, 3, 4, 5]);
        drop(rxs);
        assert!(route.send(Done { job: job(Some(1), 6), status: Status::Ok }).is_none(), "thread gone");
    }

    #[test]
    fn workers_run_jobs_and_count_them() {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..1).map(|_| mpsc::channel::<Done>()).unzip();
        let wakes = vec![Arc::new(WakeFd::new().expect("eventfd"))];
        let route = DoneRoute::new(txs, wakes, vec![0]);
        let backends = Arc::new(BackendTable::new(1));
        assert!(backends.set(0, Arc::new(crate::backend::RamBackend::new(1 << 20, None).expect("RAM"))));
        let plan = StoragePlan::pool(2, &[], None, 1);
        let (mut q, mut rx) = JobQueues::new(1, 4, plan.nic_queue.clone());
        let mut stats = Vec::new();
        let threads = start_workers(&plan.nodes[0], 0, 0, rx.remove(0), &backends, &route, &mut stats).expect("spawn");
        for id in 1..=10 {
            q.push(job(Some(0), id));
        }
        let mut got = 0;
        while got < 10 {
            assert!(q.submit().is_empty());
            if let Ok(d) = rxs[0].recv_timeout(std::time::Duration::from_secs(10)) {
                assert_eq!(d.status, Status::Ok, "a FLUSH of RAM");
                got += 1;
            }
        }
        assert_eq!(stats.iter().map(|s| s.jobs.load(Ordering::Relaxed)).sum::<u64>(), 10);
        drop(q);
        for t in threads {
            t.join().expect("a worker exits when its queue closes");
        }
        assert!(stats.iter().all(|s| s.thread.get().is_some_and(|t| t.name.starts_with("tyched-io"))));
    }
}
