//! Where each thread runs: a pure plan from a [`Topology`], then pinning.
//!
//! The rules come from the papers: a channel's network thread runs on a core of its NIC's node
//! (NESUS 2015), on the same node as the consumers of its data but not on their core (Hanford et
//! al.: same core is worst, other socket is bad, same socket / other core is best). Every core
//! of a node that runs no network thread and no outside consumer gets one completion worker.
//!
//! [`plan`] is a pure function, so it is tested on XML topologies; [`pin_current_thread`] applies
//! one assignment to the calling thread on the real machine.
//!
//! # How a node's cores are shared out
//! Let `n` be the channels placed on a node and `free` its cores that run no outside consumer.
//! - `free > n`: each network thread gets a core of its own (the highest-numbered free cores,
//!   leaving core 0, where the kernel and interrupts tend to run, to completion workers); the
//!   other free cores get one completion worker each.
//! - `2 <= free <= n`: one free core is kept for a completion worker; the network threads share
//!   the hardware threads of the others, round robin (warning).
//! - `free == 1`: everything shares that core (warning).
//! - `free == 0`: consumers run on every core; network threads share their cores (warning).
//!
//! A channel whose NIC node is unknown goes to the node with the fewest channels so far; one
//! whose node has no CPUs goes to the nearest node that has some. Both are warnings: each is
//! logged with `tracing::warn!` and listed in [`Plan::warnings`].
//!
//! # With the I/O bandwidth model ([`plan_with_model`])
//! The model of Li et al. ("Characterization of I/O bandwidth performance models in NUMA architecture", [`crate::model`]) groups nodes into bandwidth classes for
//! the NICs of each node. With it, two decisions follow the measured classes instead of the
//! distance matrix alone:
//! - **A NIC on a node without CPUs**: its channels' threads go to the node with CPUs in the
//!   best class for that NIC's node (ties: nearest, then lowest id).
//! - **A NIC whose node has no free core for all of its channels** (consumers on its cores, or
//!   more channels than free cores): a channel that would share a core moves its thread to
//!   another node in class 1 for the NIC's node (same bandwidth, by the model) that has a spare
//!   core, nearest first. A channel never moves to a worse class for want of a core: there it
//!   shares, as without a model (warning). Without a model nothing moves, since distance alone
//!   does not say the bandwidth is the same.
//!
//! A channel's memory (UMEM, rings, slots) stays on its NIC's node whenever that node has memory
//! ([`ChannelPlacement::memory_node`]): the device's own node is class 1 by definition, so only
//! the thread moves.

use std::collections::BTreeSet;

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use serde::Serialize;

use crate::{BandwidthModel, NumaError, Topology};

/// Where the running kernel lists NUMA nodes and their CPUs.
pub const SYSFS_NODES: &str = "/sys/devices/system/node";

/// One channel to place: which NIC it uses, its index on that NIC, and the NIC's node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChannelSpec {
    /// The NIC's interface name.
    pub nic: String,
    /// The channel's index among the channels of this NIC.
    pub channel: u32,
    /// The NIC's node (`None` when unknown).
    pub nic_node: Option<u32>,
}

/// What to place.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementRequest {
    /// The channels, each of which gets one network thread.
    pub channels: Vec<ChannelSpec>,
    /// CPUs where consumers run outside the plan (application or ublk queue threads): network
    /// threads stay off their cores, and no completion worker is put there.
    pub consumer_cpus: Vec<u32>,
}

impl PlacementRequest {
    /// `per_nic` channels on each of `nics` (all NICs of the topology when `nics` is empty).
    /// Names that the topology does not know are returned as the error value.
    pub fn channels_per_nic(topo: &Topology, nics: &[String], per_nic: u32) -> Result<Self, Vec<String>> {
        let unknown: Vec<String> = nics.iter().filter(|n| topo.nic(n).is_none()).cloned().collect();
        if !unknown.is_empty() {
            return Err(unknown);
        }
        let channels = topo
            .nics
            .iter()
            .filter(|nic| nics.is_empty() || nics.contains(&nic.name))
            .flat_map(|nic| {
                (0..per_nic).map(|channel| ChannelSpec { nic: nic.name.clone(), channel, nic_node: nic.node })
            })
            .collect();
        Ok(PlacementRequest { channels, consumer_cpus: Vec::new() })
    }
}

/// Where one channel's network thread runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChannelPlacement {
    /// The NIC's interface name.
    pub nic: String,
    /// The channel's index on its NIC.
    pub channel: u32,
    /// The NIC's node (`None` when unknown).
    pub nic_node: Option<u32>,
    /// The node the channel's network thread runs on (its NIC's node unless that node has no
    /// CPUs or no free core; see the module documentation).
    pub node: u32,
    /// The node the channel's memory is placed on: the NIC's node when that node has memory,
    /// else `node`.
    pub memory_node: u32,
    /// The CPU (processing unit) its network thread is pinned to.
    pub network_cpu: u32,
    /// Whether the network thread has a physical core to itself.
    pub exclusive_core: bool,
}

impl ChannelPlacement {
    /// Makes the calling thread this channel's network thread: pins it to `network_cpu` and
    /// binds its memory policy to the channel's memory node (so the UMEM and rings it allocates
    /// next are beside the NIC). Only meaningful for a plan of [`Topology::this_system`].
    pub fn apply(&self) -> Result<(), NumaError> {
        pin_current_thread(&[self.network_cpu])?;
        crate::alloc::bind_thread_memory(self.memory_node)
    }

    /// Whether the plan moved this channel's thread off its NIC's node (a node without CPUs, or
    /// without a free core).
    pub fn moved(&self) -> bool {
        self.nic_node.is_some_and(|k| k != self.node)
    }
}

/// Where one completion worker runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CompletionWorker {
    /// The worker's node.
    pub node: u32,
    /// The CPU it is pinned to.
    pub cpu: u32,
}

impl CompletionWorker {
    /// Pins the calling thread to the worker's CPU. Only meaningful for a plan of
    /// [`Topology::this_system`].
    pub fn apply(&self) -> Result<(), NumaError> {
        pin_current_thread(&[self.cpu])
    }
}

/// The thread placement for a whole process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// One entry per requested channel, in request order.
    pub channels: Vec<ChannelPlacement>,
    /// One completion worker per core that runs no network thread and no outside consumer.
    pub completion_workers: Vec<CompletionWorker>,
    /// Everything that is worse than the ideal placement, in words (also logged).
    pub warnings: Vec<String>,
}

impl Plan {
    /// The completion workers on `node`.
    pub fn workers_on(&self, node: u32) -> impl Iterator<Item = &CompletionWorker> {
        self.completion_workers.iter().filter(move |w| w.node == node)
    }
}

/// Places the network thread of every channel and the completion workers. Pure and
/// deterministic. Without a bandwidth model: [`plan_with_model`] with `None`.
pub fn plan(topo: &Topology, req: &PlacementRequest) -> Plan {
    plan_with_model(topo, req, None)
}

/// [`plan`], with the I/O bandwidth model deciding where a channel goes when its NIC's node
/// has no CPUs or no free core for it (module documentation). Pure and deterministic.
pub fn plan_with_model(topo: &Topology, req: &PlacementRequest, model: Option<&BandwidthModel>) -> Plan {
    let mut out = Plan::default();
    let with_cpus: Vec<u32> = topo.nodes.iter().filter(|n| !n.cpus.is_empty()).map(|n| n.id).collect();
    if with_cpus.is_empty() {
        warn(&mut out, "the topology has no CPUs: nothing can be placed".into());
        return out;
    }

    // 1. The node of each channel.
    let mut channel_node = channel_nodes(topo, req, &with_cpus, model, &mut out);

    // 2. With a model: channels that would share a core move to a class-1 node with a spare one.
    let consumers: BTreeSet<u32> = req.consumer_cpus.iter().copied().collect();
    if let Some(model) = model {
        spill(topo, req, model, &consumers, &mut channel_node, &mut out);
    }

    // 3. Per node: cores for network threads and for completion workers.
    let mut network_cpu: Vec<(u32, bool)> = vec![(0, false); req.channels.len()];
    for node in topo.nodes.iter().filter(|n| !n.cpus.is_empty()) {
        let mine: Vec<usize> = (0..req.channels.len()).filter(|&i| channel_node[i] == node.id).collect();
        place_on_node(node, &mine, &consumers, &mut network_cpu, &mut out);
    }

    out.channels = req
        .channels
        .iter()
        .zip(channel_node)
        .zip(network_cpu)
        .map(|((spec, node), (cpu, exclusive))| ChannelPlacement {
            nic: spec.nic.clone(),
            channel: spec.channel,
            nic_node: spec.nic_node,
            node,
            memory_node: spec.nic_node.filter(|&k| topo.node(k).is_some_and(|n| n.memory_bytes > 0)).unwrap_or(node),
            network_cpu: cpu,
            exclusive_core: exclusive,
        })
        .collect();
    out
}

/// Step 1 of [`plan_with_model`]: the node of each channel (its NIC's; the nearest with CPUs,
/// by the model where there is one, for a NIC on a node without; for a NIC of unknown node the
/// node with CPUs that has the fewest channels so far).
fn channel_nodes(
    topo: &Topology,
    req: &PlacementRequest,
    with_cpus: &[u32],
    model: Option<&BandwidthModel>,
    out: &mut Plan,
) -> Vec<u32> {
    let mut per_node: Vec<usize> = vec![0; topo.nodes.len()];
    let idx_of = |id: u32| topo.nodes.iter().position(|n| n.id == id);
    let mut channel_node: Vec<u32> = Vec::with_capacity(req.channels.len());
    let mut warned_nics = BTreeSet::new();
    // Known nodes first, so that unknown ones fill the gaps.
    let mut resolved: Vec<Option<u32>> = req
        .channels
        .iter()
        .map(|c| {
            let node = c.nic_node?;
            if with_cpus.contains(&node) {
                return Some(node);
            }
            let (near, class) = nearest_with_cpus(topo, node, with_cpus, model);
            if warned_nics.insert(c.nic.clone()) {
                let why = match class {
                    Some(class) => format!("bandwidth class {class} for NICs on node {node}, the best with CPUs"),
                    None => "the nearest with CPUs".to_string(),
                };
                warn(
                    out,
                    format!(
                        "NIC {} is on node {node}, which has no CPUs: its channels run on node {near} ({why})",
                        c.nic
                    ),
                );
            }
            Some(near)
        })
        .collect();
    for node in resolved.iter().flatten() {
        per_node[idx_of(*node).expect("resolved nodes exist")] += 1;
    }
    for (spec, node) in req.channels.iter().zip(resolved.iter_mut()) {
        if node.is_none() {
            let least = *with_cpus
                .iter()
                .min_by_key(|&&id| (per_node[idx_of(id).expect("node exists")], id))
                .expect("at least one node has CPUs");
            per_node[idx_of(least).expect("node exists")] += 1;
            *node = Some(least);
            if warned_nics.insert(spec.nic.clone()) {
                warn(
                    out,
                    format!(
                        "NIC {} has no known NUMA node: its channels are spread over the nodes \
                         with the fewest channels, starting on node {least}",
                        spec.nic
                    ),
                );
            }
        }
        channel_node.push(node.expect("every channel has a node now"));
    }
    channel_node
}

/// Step 3 of [`plan_with_model`] for one node with CPUs: cores for the network threads of its
/// channels `mine` (into `network_cpu`) and for completion workers (into `out`).
fn place_on_node(
    node: &crate::Node,
    mine: &[usize],
    consumers: &BTreeSet<u32>,
    network_cpu: &mut [(u32, bool)],
    out: &mut Plan,
) {
    let n = mine.len();
    let mut free: Vec<&Vec<u32>> =
        node.cores.iter().filter(|core| !core.iter().any(|c| consumers.contains(c))).collect();
    let mut worker_cores: Vec<&Vec<u32>> = Vec::new();
    if n == 0 {
        worker_cores = free;
    } else {
        let all_busy = free.is_empty();
        if all_busy {
            warn(
                out,
                format!(
                    "node {}: consumers run on all {} cores, so its {n} network threads share \
                     their cores",
                    node.id,
                    node.cores.len()
                ),
            );
            free = node.cores.iter().collect();
        }
        let net_cores: Vec<&Vec<u32>>;
        if free.len() > n {
            net_cores = free[free.len() - n..].to_vec();
            worker_cores = free[..free.len() - n].to_vec();
        } else if free.len() >= 2 {
            net_cores = free[1..].to_vec();
            worker_cores = free[..1].to_vec();
            warn(
                out,
                format!(
                    "node {}: {n} network threads but only {} free cores: they share the \
                     hardware threads of {} core(s), one core is kept for completion workers",
                    node.id,
                    free.len(),
                    net_cores.len()
                ),
            );
        } else {
            net_cores = free.clone();
            if consumers.is_empty() {
                worker_cores = free.clone();
            }
            warn(
                out,
                format!(
                    "node {}: a single free core: {n} network threads{} share it",
                    node.id,
                    if consumers.is_empty() { " and the completion worker" } else { "" }
                ),
            );
        }
        if all_busy {
            // Those cores already run consumers: no completion worker goes there.
            worker_cores.clear();
        }
        let exclusive = free.len() > n && !all_busy;
        // Hardware threads in PU-major order: first PU of every core, then the second...
        let max_pus = net_cores.iter().map(|c| c.len()).max().unwrap_or(0);
        let slots: Vec<u32> =
            (0..max_pus).flat_map(|k| net_cores.iter().filter_map(move |c| c.get(k).copied())).collect();
        for (j, &ch) in mine.iter().enumerate() {
            network_cpu[ch] = (slots[j % slots.len()], exclusive);
        }
    }
    for core in worker_cores {
        out.completion_workers.push(CompletionWorker { node: node.id, cpu: core[0] });
    }
}

/// Free cores of `node`: those that run no consumer.
fn free_cores(node: &crate::Node, consumers: &BTreeSet<u32>) -> usize {
    node.cores.iter().filter(|core| !core.iter().any(|c| consumers.contains(c))).count()
}

/// Network threads a node can give a core of their own while keeping one core for completion
/// workers (step 3's `free > n` case).
fn exclusive_capacity(node: &crate::Node, consumers: &BTreeSet<u32>) -> usize {
    free_cores(node, consumers).saturating_sub(1)
}

/// Moves the channels a node cannot give a core of their own to other nodes in bandwidth class
/// 1 for their NIC's node that can, nearest first (then the one with most spare cores, then the
/// lowest id). The last channels of a node move first; a channel whose NIC's node is unknown or
/// not modelled stays.
fn spill(
    topo: &Topology,
    req: &PlacementRequest,
    model: &BandwidthModel,
    consumers: &BTreeSet<u32>,
    channel_node: &mut [u32],
    out: &mut Plan,
) {
    let capacity: Vec<(u32, usize)> =
        topo.nodes.iter().filter(|n| !n.cpus.is_empty()).map(|n| (n.id, exclusive_capacity(n, consumers))).collect();
    let count = |id: u32, nodes: &[u32]| nodes.iter().filter(|&&n| n == id).count();
    // (NIC, from, to) → channels moved, for one warning per NIC and destination.
    let mut moved: Vec<(String, u32, u32, usize)> = Vec::new();
    for &(k, cap_k) in &capacity {
        let mut over = count(k, channel_node).saturating_sub(cap_k);
        for i in (0..req.channels.len()).rev() {
            if over == 0 {
                break;
            }
            if channel_node[i] != k {
                continue;
            }
            let io_node = req.channels[i].nic_node.unwrap_or(k);
            let Some(&(m, _)) = capacity
                .iter()
                .filter(|&&(m, cap_m)| {
                    m != k && model.class_between(m, io_node) == Some(1) && count(m, channel_node) < cap_m
                })
                .min_by_key(|&&(m, cap_m)| {
                    (topo.distance(k, m).unwrap_or(u64::MAX), std::cmp::Reverse(cap_m - count(m, channel_node)), m)
                })
            else {
                continue;
            };
            channel_node[i] = m;
            over -= 1;
            let nic = &req.channels[i].nic;
            match moved.iter_mut().find(|e| &e.0 == nic && e.1 == k && e.2 == m) {
                Some(e) => e.3 += 1,
                None => moved.push((nic.clone(), k, m, 1)),
            }
        }
    }
    for (nic, k, m, n) in moved {
        warn(
            out,
            format!(
                "NIC {nic}: node {k} has no free core for {n} of its channel(s): their threads run on node {m}, \
                 in bandwidth class 1 for NICs on node {k} by the I/O bandwidth model (memory stays on node {k})"
            ),
        );
    }
}

fn warn(plan: &mut Plan, message: String) {
    tracing::warn!(target: "tyche_numa::placement", "{message}");
    plan.warnings.push(message);
}

/// The node with CPUs for the NICs of `node`, which has none: with a model that covers `node`,
/// the best bandwidth class first (returned with the node); then nearest by the distance
/// matrix, else by id difference.
fn nearest_with_cpus(
    topo: &Topology,
    node: u32,
    with_cpus: &[u32],
    model: Option<&BandwidthModel>,
) -> (u32, Option<u32>) {
    let class = |other: u32| model.and_then(|m| m.class_between(other, node));
    let near = *with_cpus
        .iter()
        .min_by_key(|&&other| {
            (
                class(other).unwrap_or(u32::MAX),
                topo.distance(node, other).unwrap_or(u64::MAX),
                other.abs_diff(node),
                other,
            )
        })
        .expect("with_cpus is not empty");
    (near, class(near))
}

/// Pins the calling thread to `cpus` with `sched_setaffinity(2)` (nix).
pub fn pin_current_thread(cpus: &[u32]) -> Result<(), NumaError> {
    if cpus.is_empty() {
        return Err(NumaError::NoCpus);
    }
    let mut set = CpuSet::new();
    for &cpu in cpus {
        set.set(cpu as usize).map_err(|_| NumaError::InvalidCpu(cpu))?;
    }
    sched_setaffinity(Pid::from_raw(0), &set)
        .map_err(|e| NumaError::Sys { call: "sched_setaffinity", source: e.into() })
}

/// The CPUs of NUMA node `node` as the running kernel lists them
/// (`/sys/devices/system/node/node<N>/cpulist`). A node without that file is
/// [`NumaError::NoSuchNode`]; a list that does not parse, or an empty one, is an error too.
pub fn node_cpus(node: u32) -> Result<Vec<u32>, NumaError> {
    node_cpus_in(std::path::Path::new(SYSFS_NODES), node)
}

/// [`node_cpus`] under another sysfs `devices/system/node` directory (tests).
pub fn node_cpus_in(root: &std::path::Path, node: u32) -> Result<Vec<u32>, NumaError> {
    let path = root.join(format!("node{node}")).join("cpulist");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(NumaError::NoSuchNode(node)),
        Err(source) => return Err(NumaError::Sys { call: "reading a node's cpulist", source }),
    };
    let cpus = crate::parse_cpu_list(text.trim()).map_err(|e| NumaError::Sys {
        call: "parsing a node's cpulist",
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", path.display())),
    })?;
    if cpus.is_empty() {
        return Err(NumaError::NoCpus);
    }
    Ok(cpus)
}

/// Pins the calling thread to the CPUs of `node` ([`node_cpus`]), so a thread serving a NIC
/// queue runs beside the NIC and its memory.
pub fn pin_current_thread_to_node(node: u32) -> Result<(), NumaError> {
    pin_current_thread(&node_cpus(node)?)
}

/// The CPUs the calling thread may run on (`sched_getaffinity(2)`).
pub fn current_thread_cpus() -> Result<Vec<u32>, NumaError> {
    let set = sched_getaffinity(Pid::from_raw(0))
        .map_err(|e| NumaError::Sys { call: "sched_getaffinity", source: e.into() })?;
    Ok((0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).map(|c| c as u32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Nic, NicNodeSource, Node, TopologySource};
    use std::path::Path;

    fn fixture(name: &str) -> Topology {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name);
        Topology::from_xml_file(&path).unwrap_or_else(|e| panic!("{name} should load: {e}"))
    }

    #[test]
    fn node_cpus_read_sysfs_and_refuse_what_is_wrong() {
        let root = std::env::temp_dir().join(format!("tyche-numa-nodes-{}", std::process::id()));
        for (node, list) in [(0, "0-1,4\n"), (1, "three"), (2, "\n")] {
            std::fs::create_dir_all(root.join(format!("node{node}"))).unwrap();
            std::fs::write(root.join(format!("node{node}")).join("cpulist"), list).unwrap();
        }
        assert_eq!(node_cpus_in(&root, 0).unwrap(), vec![0, 1, 4]);
        let bad = node_cpus_in(&root, 1).unwrap_err().to_string();
        assert!(bad.contains("three") && bad.contains("node1"), "names the file and the entry: {bad}");
        assert!(matches!(node_cpus_in(&root, 2), Err(NumaError::NoCpus)));
        assert!(matches!(node_cpus_in(&root, 7), Err(NumaError::NoSuchNode(7))));
        std::fs::remove_dir_all(&root).unwrap();
        // The running machine has a node 0 with CPUs, and pinning to it works.
        assert!(!node_cpus(0).expect("node 0").is_empty());
        let before = current_thread_cpus().unwrap();
        pin_current_thread_to_node(0).expect("pin to node 0");
        pin_current_thread(&before).unwrap();
    }

    fn request(topo: &Topology, per_nic: u32) -> PlacementRequest {
        PlacementRequest::channels_per_nic(topo, &[], per_nic).expect("all NICs are known")
    }

    fn core_of(topo: &Topology, cpu: u32) -> &Vec<u32> {
        topo.nodes
            .iter()
            .flat_map(|n| &n.cores)
            .find(|c| c.contains(&cpu))
            .unwrap_or_else(|| panic!("cpu {cpu} is in some core"))
    }

    /// Every network thread is on its NIC's node, and on no core that runs a worker.
    fn assert_sound(topo: &Topology, plan: &Plan) {
        for ch in &plan.channels {
            if let Some(nic_node) = ch.nic_node {
                assert_eq!(ch.node, nic_node, "{}#{} is on its NIC's node", ch.nic, ch.channel);
            }
            let node = topo.node(ch.node).expect("placed on an existing node");
            assert!(
                node.cpus.contains(&ch.network_cpu),
                "{}#{}: cpu {} is on node {}",
                ch.nic,
                ch.channel,
                ch.network_cpu,
                ch.node
            );
        }
        for w in &plan.completion_workers {
            assert_eq!(topo.node_of_cpu(w.cpu), Some(w.node), "worker cpu on its node");
        }
    }

    #[test]
    fn paper_server_gives_each_network_thread_its_own_core_on_its_nics_node() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let plan = plan(&topo, &request(&topo, 1));
        assert!(plan.warnings.is_empty(), "ideal placement: {:?}", plan.warnings);
        assert_eq!(plan.channels.len(), 6);
        assert_sound(&topo, &plan);
        // Node 0: cores [0,1] [2,3] [4,5] [6,7]; three network cores, one worker core.
        let node0: Vec<u32> = plan.channels.iter().filter(|c| c.node == 0).map(|c| c.network_cpu).collect();
        assert_eq!(node0, vec![2, 4, 6], "network threads on cores 1-3 of node 0");
        assert!(plan.channels.iter().all(|c| c.exclusive_core));
        let workers: Vec<(u32, u32)> = plan.completion_workers.iter().map(|w| (w.node, w.cpu)).collect();
        assert_eq!(workers, vec![(0, 0), (1, 8)], "one worker per remaining core");
        // Same node, different core: no worker shares a core with a network thread.
        for ch in &plan.channels {
            let core = core_of(&topo, ch.network_cpu);
            assert!(
                plan.completion_workers.iter().all(|w| !core.contains(&w.cpu)),
                "{} shares a core with a worker",
                ch.nic
            );
        }
    }

    #[test]
    fn consumer_cores_are_avoided_by_network_threads() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let mut req = request(&topo, 1);
        req.consumer_cpus = vec![7, 9]; // cores [6,7] and [8,9]
        let plan = plan(&topo, &req);
        assert_sound(&topo, &plan);
        for ch in &plan.channels {
            let core = core_of(&topo, ch.network_cpu);
            assert!(
                !core.contains(&7) && !core.contains(&9),
                "{} runs on a consumer's core (cpu {})",
                ch.nic,
                ch.network_cpu
            );
        }
        assert!(plan.completion_workers.iter().all(|w| w.cpu != 6 && w.cpu != 8), "no worker on consumer cores");
        // Node 0 has 3 free cores for 3 channels: they share, and the plan says so.
        assert!(plan.warnings.iter().any(|w| w.contains("node 0")), "degraded node 0 is reported: {:?}", plan.warnings);
    }

    #[test]
    fn four_node_server_places_channels_on_nodes_zero_and_two_only() {
        let topo = fixture("four-node.xml");
        let plan = plan(&topo, &request(&topo, 1));
        assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
        assert_sound(&topo, &plan);
        let nodes: Vec<u32> = plan.channels.iter().map(|c| c.node).collect();
        assert_eq!(nodes, vec![0, 0, 2], "enp1s0f0, enp1s0f1 on 0; enp65s0f0 on 2");
        // Nodes 1 and 3 have no channels: both their cores run completion workers.
        assert_eq!(plan.workers_on(1).count(), 4);
        assert_eq!(plan.workers_on(3).count(), 4);
        // Two channels per NIC: node 0 has 4 channels for 4 cores, one core is kept for a worker.
        let two_per_nic = plan_two(&topo);
        assert!(two_per_nic.warnings.iter().any(|w| w.contains("node 0")), "{:?}", two_per_nic.warnings);
        assert_sound(&topo, &two_per_nic);
    }

    fn plan_two(topo: &Topology) -> Plan {
        plan(topo, &request(topo, 2))
    }

    #[test]
    fn laptop_degrades_and_says_so() {
        let topo = fixture("laptop-1node.xml");
        let one = plan(&topo, &request(&topo, 1));
        assert!(one.warnings.is_empty(), "1 channel fits: {:?}", one.warnings);
        assert_eq!(one.channels[0].network_cpu, 2, "network thread on core 1");
        assert_eq!(one.completion_workers, vec![CompletionWorker { node: 0, cpu: 0 }]);

        let four = plan(&topo, &request(&topo, 4));
        assert_sound(&topo, &four);
        let cpus: Vec<u32> = four.channels.iter().map(|c| c.network_cpu).collect();
        assert_eq!(cpus, vec![2, 3, 2, 3], "network threads share core 1's hardware threads");
        assert!(four.channels.iter().all(|c| !c.exclusive_core));
        assert_eq!(four.completion_workers, vec![CompletionWorker { node: 0, cpu: 0 }]);
        assert_eq!(four.warnings.len(), 1, "one warning: {:?}", four.warnings);
        assert!(four.warnings[0].contains("only 2 free cores"), "{}", four.warnings[0]);

        // Consumers on both cores: nothing free, threads share consumer cores, no worker.
        let mut req = request(&topo, 1);
        req.consumer_cpus = vec![0, 2];
        let busy = plan(&topo, &req);
        assert_sound(&topo, &busy);
        assert!(busy.completion_workers.is_empty());
        assert!(!busy.warnings.is_empty(), "sharing consumer cores is reported");
    }

    #[test]
    fn unknown_nic_node_is_spread_and_reported_never_silently_node_zero() {
        let mut topo = fixture("paper-2s4c2t-6nic.xml");
        topo.nics.push(Nic { name: "veth0".into(), node: None, node_source: NicNodeSource::Unknown });
        let req = PlacementRequest::channels_per_nic(&topo, &["veth0".into()], 2).expect("veth0 is known");
        let plan = plan(&topo, &req);
        let nodes: Vec<u32> = plan.channels.iter().map(|c| c.node).collect();
        assert_eq!(nodes, vec![0, 1], "spread over both nodes");
        assert!(plan.channels.iter().all(|c| c.nic_node.is_none()));
        assert!(plan.warnings[0].contains("no known NUMA node"), "{:?}", plan.warnings);
    }

    #[test]
    fn nic_on_a_cpuless_node_runs_on_the_nearest_node() {
        let topo = Topology {
            nodes: vec![
                Node {
                    id: 0,
                    cpus: vec![0, 1, 2],
                    cores: vec![vec![0], vec![1], vec![2]],
                    memory_bytes: 1 << 30,
                    distances: vec![10, 30, 20],
                },
                Node {
                    id: 1,
                    cpus: vec![3, 4, 5],
                    cores: vec![vec![3], vec![4], vec![5]],
                    memory_bytes: 1 << 30,
                    distances: vec![30, 10, 20],
                },
                Node { id: 2, cpus: vec![], cores: vec![], memory_bytes: 1 << 30, distances: vec![30, 15, 10] },
            ],
            nics: vec![Nic { name: "cxl0".into(), node: Some(2), node_source: NicNodeSource::Hwloc }],
            source: TopologySource::XmlString,
        };
        let plan = plan(&topo, &request(&topo, 1));
        assert_eq!(plan.channels[0].node, 1, "node 1 is nearest to node 2");
        assert!(plan.warnings[0].contains("no CPUs"), "{:?}", plan.warnings);
    }

    /// Li et al.'s machine: 8 nodes (two per Opteron 6136 package) of 4 cores, 16 GiB each;
    /// distance 16 within a package, 22 across; the NIC on node 7 (the paper's Tables IV and V
    /// were measured with the devices there).
    fn opteron_8node() -> Topology {
        let nodes = (0..8u32)
            .map(|i| Node {
                id: i,
                cpus: (4 * i..4 * i + 4).collect(),
                cores: (4 * i..4 * i + 4).map(|c| vec![c]).collect(),
                memory_bytes: 16 << 30,
                distances: (0..8u32)
                    .map(|j| {
                        if i == j {
                            10
                        } else if i / 2 == j / 2 {
                            16
                        } else {
                            22
                        }
                    })
                    .collect(),
            })
            .collect();
        Topology {
            nodes,
            nics: vec![Nic { name: "eth7".into(), node: Some(7), node_source: NicNodeSource::Hwloc }],
            source: TopologySource::XmlString,
        }
    }

    fn cpus_of(topo: &Topology, nodes: &[u32]) -> Vec<u32> {
        nodes.iter().flat_map(|&n| topo.node(n).expect("node").cpus.clone()).collect()
    }

    #[test]
    fn paper_machine_with_its_nics_node_busy_moves_the_thread_to_the_class_one_neighbour() {
        let topo = opteron_8node();
        let model = crate::model::tests::paper_model();
        assert!(crate::model::first_class_nodes(&topo, 7) == vec![6, 7], "node 6 is node 7's neighbour");
        let mut req = request(&topo, 1);
        req.consumer_cpus = cpus_of(&topo, &[7]);
        let with = plan_with_model(&topo, &req, Some(&model));
        let ch = &with.channels[0];
        assert_eq!(
            (ch.node, ch.memory_node, ch.nic_node),
            (6, 7, Some(7)),
            "thread on node 6, memory on the NIC's node"
        );
        assert!(ch.moved() && ch.exclusive_core, "{ch:?}");
        assert!(topo.node(6).unwrap().cpus.contains(&ch.network_cpu));
        assert!(with.warnings.iter().any(|w| w.contains("class 1") && w.contains("node 6")), "{:?}", with.warnings);
        // Without the model, distance alone does not say node 6 is as good: the thread shares
        // a consumer's core on the NIC's node, and says so.
        let without = plan(&topo, &req);
        assert_eq!(without.channels[0].node, 7);
        assert!(!without.channels[0].exclusive_core);
        assert!(without.warnings.iter().any(|w| w.contains("consumers run on all")), "{:?}", without.warnings);
    }

    #[test]
    fn paper_machine_never_trades_a_bandwidth_class_for_a_core() {
        // Nodes 6 and 7 both busy: the next nodes with free cores are in class 2 or worse
        // (Table V: {2, 3} class 2 for reads; Table IV: class 3 for writes), so the channel stays.
        let topo = opteron_8node();
        let model = crate::model::tests::paper_model();
        let mut req = request(&topo, 1);
        req.consumer_cpus = cpus_of(&topo, &[6, 7]);
        let p = plan_with_model(&topo, &req, Some(&model));
        assert_eq!(p.channels[0].node, 7, "{:?}", p.warnings);
        assert!(!p.channels[0].moved());
        assert!(!p.warnings.iter().any(|w| w.contains("class 1 for NICs")), "{:?}", p.warnings);
    }

    #[test]
    fn paper_machine_spreads_more_channels_than_free_cores_over_class_one() {
        // Six channels, four cores on node 7: three keep a core each there (one stays for the
        // completion worker), three go to node 6; none shares.
        let topo = opteron_8node();
        let model = crate::model::tests::paper_model();
        let p = plan_with_model(&topo, &request(&topo, 6), Some(&model));
        let on = |n: u32| p.channels.iter().filter(|c| c.node == n).count();
        assert_eq!((on(7), on(6)), (3, 3), "{:?}", p.channels);
        assert!(p.channels.iter().all(|c| c.exclusive_core && c.memory_node == 7), "{:?}", p.channels);
        assert!(p.channels[..3].iter().all(|c| c.node == 7), "the first channels stay on the NIC's node");
        assert_sound_with_model(&topo, &model, &p);
        // Without the model they share node 7's cores.
        let without = plan(&topo, &request(&topo, 6));
        assert!(without.channels.iter().all(|c| c.node == 7 && !c.exclusive_core));
    }

    #[test]
    fn nic_on_a_cpuless_node_goes_to_the_best_class_before_the_nearest_node() {
        let mut topo = opteron_8node();
        // Node 7 becomes memory only (as a CXL expander would be), nearest to node 6 by
        // distance; the model says node 2 moves data to and from it best.
        let seven = topo.nodes.iter_mut().find(|n| n.id == 7).unwrap();
        seven.cpus.clear();
        seven.cores.clear();
        let samples: Vec<(u32, f64)> = (0..8)
            .map(|n| {
                (
                    n,
                    if n == 2 {
                        50.0
                    } else if n == 7 {
                        52.0
                    } else {
                        30.0
                    },
                )
            })
            .collect();
        let model = BandwidthModel::from_measurements(
            vec![crate::IoMeasurement { io_node: 7, first_class: vec![7], write: samples.clone(), read: samples }],
            0.10,
        );
        let p = plan_with_model(&topo, &request(&topo, 1), Some(&model));
        assert_eq!((p.channels[0].node, p.channels[0].memory_node), (2, 7), "{:?}", p.warnings);
        assert!(p.warnings[0].contains("bandwidth class 2 for NICs on node 7, the best"), "{:?}", p.warnings);
        assert_eq!(plan(&topo, &request(&topo, 1)).channels[0].node, 6, "without the model: the nearest");
    }

    /// A plan with a model: every channel is on a node with CPUs, and one that left its NIC's
    /// node (which has CPUs) went to a class-1 node and has a core of its own there.
    fn assert_sound_with_model(topo: &Topology, model: &BandwidthModel, plan: &Plan) {
        for ch in &plan.channels {
            let node = topo.node(ch.node).expect("placed on an existing node");
            assert!(node.cpus.contains(&ch.network_cpu), "{ch:?}");
            let Some(k) = ch.nic_node else { continue };
            assert_eq!(ch.memory_node, k, "memory stays on the NIC's node: {ch:?}");
            if ch.moved() && topo.node(k).is_some_and(|n| !n.cpus.is_empty()) {
                assert_eq!(model.class_between(ch.node, k), Some(1), "{ch:?}");
                assert!(ch.exclusive_core, "a moved thread has a core of its own: {ch:?}");
            }
        }
        for w in &plan.completion_workers {
            assert_eq!(topo.node_of_cpu(w.cpu), Some(w.node), "worker cpu on its node");
        }
    }

    #[test]
    fn unknown_interface_names_are_returned() {
        let topo = fixture("laptop-1node.xml");
        let err = PlacementRequest::channels_per_nic(&topo, &["wlan9".into()], 1).expect_err("wlan9 does not exist");
        assert_eq!(err, vec!["wlan9".to_string()]);
    }

    proptest::proptest! {
        /// On every fixture, for any channel count and consumer set: threads stay on their
        /// node, workers stay off consumer cores, an "exclusive" core is shared with nobody,
        /// and a plan without warnings gives every network thread its own core.
        #[test]
        fn plans_are_sound_on_every_fixture(
            which in 0usize..3,
            per_nic in 1u32..7,
            consumers in proptest::collection::vec(0u32..32, 0..6),
        ) {
            let name = ["paper-2s4c2t-6nic.xml", "four-node.xml", "laptop-1node.xml"][which];
            let topo = fixture(name);
            let mut req = request(&topo, per_nic);
            req.consumer_cpus = consumers.clone();
            let plan = plan(&topo, &req);
            assert_sound(&topo, &plan);
            proptest::prop_assert_eq!(plan.channels.len(), req.channels.len());
            let consumer_core = |cpu: u32| {
                core_of(&topo, cpu).iter().any(|c| consumers.contains(c))
            };
            for w in &plan.completion_workers {
                proptest::prop_assert!(!consumer_core(w.cpu), "worker on consumer core {}", w.cpu);
            }
            for ch in plan.channels.iter().filter(|c| c.exclusive_core) {
                let core = core_of(&topo, ch.network_cpu);
                let sharers = plan.channels.iter().filter(|o| core.contains(&o.network_cpu)).count()
                    + plan.completion_workers.iter().filter(|w| core.contains(&w.cpu)).count();
                proptest::prop_assert_eq!(sharers, 1, "{}#{} is not alone", &ch.nic, ch.channel);
                proptest::prop_assert!(!consumer_core(ch.network_cpu));
            }
            if plan.warnings.is_empty() {
                proptest::prop_assert!(plan.channels.iter().all(|c| c.exclusive_core));
            }
        }

        /// On the paper's machine with its model, for any channel count and consumer set: the
        /// model moves threads only to class-1 nodes with a core to spare, memory stays beside
        /// the NIC, and no channel is lost.
        #[test]
        fn model_guided_plans_are_sound(
            per_nic in 1u32..12,
            consumers in proptest::collection::vec(0u32..32, 0..12),
        ) {
            let topo = opteron_8node();
            let model = crate::model::tests::paper_model();
            let mut req = request(&topo, per_nic);
            req.consumer_cpus = consumers;
            let plan = plan_with_model(&topo, &req, Some(&model));
            proptest::prop_assert_eq!(plan.channels.len(), req.channels.len());
            assert_sound_with_model(&topo, &model, &plan);
            proptest::prop_assert!(plan.channels.iter().all(|c| c.node == 6 || c.node == 7));
        }
    }

    #[test]
    fn pinning_the_current_thread_restricts_its_cpus() {
        let topo = Topology::this_system().expect("this machine");
        let allowed = current_thread_cpus().expect("getaffinity");
        let cpu = *topo
            .nodes
            .iter()
            .flat_map(|n| &n.cpus)
            .find(|c| allowed.contains(c))
            .expect("some cpu of the topology is allowed");
        std::thread::spawn(move || {
            pin_current_thread(&[cpu]).expect("pin to an allowed cpu");
            assert_eq!(current_thread_cpus().expect("getaffinity"), vec![cpu]);
        })
        .join()
        .expect("pinned thread ran");
        assert!(matches!(pin_current_thread(&[]), Err(NumaError::NoCpus)));

        // A plan of this machine applies: each thread ends up where the plan says.
        let req = PlacementRequest::channels_per_nic(&topo, &[], 1).expect("known NICs");
        let plan = plan(&topo, &req);
        for ch in plan.channels.iter().filter(|c| allowed.contains(&c.network_cpu)) {
            let ch = ch.clone();
            std::thread::spawn(move || {
                ch.apply().expect("apply a channel placement");
                assert_eq!(current_thread_cpus().expect("getaffinity"), vec![ch.network_cpu]);
                crate::alloc::reset_thread_memory().expect("reset policy");
            })
            .join()
            .expect("network thread ran");
        }
        for w in plan.completion_workers.iter().filter(|w| allowed.contains(&w.cpu)) {
            let w = w.clone();
            std::thread::spawn(move || {
                w.apply().expect("apply a worker placement");
                assert_eq!(current_thread_cpus().expect("getaffinity"), vec![w.cpu]);
            })
            .join()
            .expect("worker thread ran");
        }
        assert!(matches!(pin_current_thread(&[1 << 20]), Err(NumaError::InvalidCpu(_))));
    }
}
