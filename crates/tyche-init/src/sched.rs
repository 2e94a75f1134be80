//! tyche-numa's [`ChannelScheduler`] behind tyche-channel's [`Scheduler`] trait.
//!
//! The volume shows the scheduler every channel (by index) with its liveness, room and node on
//! each pick; the adapter registers new indices with the NUMA scheduler as they appear (an index
//! is never reused for another NIC: a reconnected channel gets a fresh one) and pushes liveness
//! and fullness before asking it.

use std::sync::RwLock;

use tyche_channel::{ChannelView, Scheduler};
use tyche_numa::{BandwidthModel, ChannelId, ChannelScheduler, NodeOrder, Policy, Topology};

use crate::config::SchedulerKind;

/// The NUMA-aware channel scheduler (affinity with nearest-node fallback, or round robin).
#[derive(Debug)]
pub struct NumaScheduler {
    inner: ChannelScheduler,
}

impl NumaScheduler {
    /// A scheduler for channels on `nodes` (the NICs' nodes; falls back by node id).
    pub fn new(kind: SchedulerKind, nodes: &[u32]) -> Self {
        Self::with_order(kind, nodes, None)
    }

    /// A scheduler for channels on `nodes` that falls back along `order` when a node has no
    /// usable channel ([`fallback_order`]: bandwidth classes, else distances); by node id
    /// without one.
    pub fn with_order(kind: SchedulerKind, nodes: &[u32], order: Option<&NodeOrder>) -> Self {
        let policy = match kind {
            SchedulerKind::Affinity => Policy::Affinity,
            SchedulerKind::RoundRobin => Policy::RoundRobin,
        };
        let mut nodes = nodes.to_vec();
        nodes.sort_unstable();
        nodes.dedup();
        let order = order.cloned().unwrap_or_else(|| NodeOrder::by_id(&nodes));
        NumaScheduler { inner: ChannelScheduler::new(policy, order) }
    }
}

impl Scheduler for NumaScheduler {
    fn pick(&mut self, bytes: u64, node: Option<u32>, channels: &[ChannelView]) -> Option<usize> {
        while self.inner.len() < channels.len() {
            // A new index (a channel opened late, or reopened after dying) starts level with the
            // least loaded live channel of its node, so it does not take every request until it
            // has caught up with the bytes the others carried.
            let id = self.inner.add_channel(channels[self.inner.len()].node);
            self.inner.set_live(id, false);
            self.inner.set_live(id, true);
        }
        for (i, v) in channels.iter().enumerate() {
            self.inner.set_live(ChannelId(i), v.live);
            self.inner.set_full(ChannelId(i), !v.has_room);
            self.inner.set_idle(ChannelId(i), v.in_flight == 0);
        }
        self.inner.pick(node, bytes).map(|id| id.0).filter(|&i| i < channels.len())
    }
}

/// Where the fallback order came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderSource {
    /// The I/O bandwidth model's classes (Li et al.).
    Model,
    /// The topology's distance matrix.
    Distances,
    /// Node ids (nothing better known).
    Id,
}

/// The order the affinity scheduler falls back along when a buffer's node has no usable
/// channel: by the bandwidth model's classes when there is a model, else by the topology's
/// distance matrix when it has one, else by node id. Pure.
pub fn fallback_order(
    topo: Option<&Topology>,
    model: Option<&BandwidthModel>,
    nodes: &[u32],
) -> (NodeOrder, OrderSource) {
    let mut all: Vec<u32> = nodes.to_vec();
    if let Some(t) = topo {
        all.extend(t.nodes.iter().map(|n| n.id));
    }
    all.sort_unstable();
    all.dedup();
    if let Some(m) = model {
        return (NodeOrder::from_model(m, &all), OrderSource::Model);
    }
    match topo {
        Some(t) if t.nodes.len() > 1 && t.nodes.iter().all(|n| n.distances.len() == t.nodes.len()) => {
            (NodeOrder::from_topology(t), OrderSource::Distances)
        }
        _ => (NodeOrder::by_id(&all), OrderSource::Id),
    }
}

/// CPUs kept for the NICs' interrupts (`--irq-affinity auto`): this process's own threads stay
/// off them where their node has other CPUs.
static RESERVED: RwLock<Vec<u32>> = RwLock::new(Vec::new());

/// Keeps this process's engine, NBD and ublk threads off `cpus` from now on (threads pinned by
/// [`node_cpus`] after the call), wherever their node has other CPUs.
pub fn reserve_cpus(cpus: &[u32]) {
    let mut r = RESERVED.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    r.extend_from_slice(cpus);
    r.sort_unstable();
    r.dedup();
}

/// The CPUs of NUMA node `node`, from sysfs (`None` when unknown), without the CPUs reserved
/// for interrupts ([`reserve_cpus`]) unless those are all it has.
pub fn node_cpus(node: u32) -> Option<Vec<u32>> {
    let cpus = tyche_numa::node_cpus(node).ok()?;
    Some(without_reserved(cpus, &RESERVED.read().unwrap_or_else(std::sync::PoisonError::into_inner)))
}

fn without_reserved(cpus: Vec<u32>, reserved: &[u32]) -> Vec<u32> {
    let rest: Vec<u32> = cpus.iter().copied().filter(|c| !reserved.contains(c)).collect();
    if rest.is_empty() {
        cpus
    } else {
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(live: bool, node: u32) -> ChannelView {
        ChannelView { live, has_room: true, node: Some(node), in_flight: 1 }
    }

    #[test]
    fn affinity_keeps_requests_on_their_node_and_falls_back() {
        let mut s = NumaScheduler::new(SchedulerKind::Affinity, &[0, 1]);
        let mut v = vec![view(true, 0), view(true, 1), view(true, 0), view(true, 1)];
        let mut per = [0u64; 4];
        for _ in 0..100 {
            per[s.pick(4096, Some(1), &v).unwrap()] += 4096;
        }
        assert_eq!(per[0] + per[2], 0, "node-1 buffers stay on node-1 channels: {per:?}");
        assert_eq!(per[1], per[3], "equal bytes per channel: {per:?}");
        v[1].live = false;
        v[3].live = false;
        assert!(matches!(s.pick(4096, Some(1), &v), Some(0 | 2)), "falls back to node 0");
        // A channel index appearing later (a reconnect) is registered on its node.
        v.push(view(true, 1));
        assert_eq!(s.pick(4096, Some(1), &v), Some(4));
        let dead: Vec<_> = v.iter().map(|c| ChannelView { live: false, ..*c }).collect();
        assert_eq!(s.pick(4096, Some(1), &dead), None);
    }

    #[test]
    fn lone_requests_stay_on_the_channel_still_polling() {
        let mut s = NumaScheduler::new(SchedulerKind::Affinity, &[0]);
        let idle = ChannelView { in_flight: 0, ..view(true, 0) };
        let mut v = vec![idle, idle];
        let mut per = [0u32; 2];
        let first = s.pick(4096, Some(0), &v).unwrap();
        per[first] += 1;
        for _ in 0..50 {
            assert_eq!(s.pick(4096, Some(0), &v), Some(first), "idle channels: the last one again");
            per[first] += 1;
        }
        // Under load the bytes balance, the lone requests above counted.
        v[first].in_flight = 1;
        for _ in 0..100 {
            per[s.pick(4096, Some(0), &v).unwrap()] += 1;
        }
        assert!(per[0].abs_diff(per[1]) <= 1, "loaded channels share bytes: {per:?}");
    }

    #[test]
    fn a_reopened_channel_starts_level_with_the_others() {
        let mut s = NumaScheduler::new(SchedulerKind::Affinity, &[0]);
        let mut v = vec![view(true, 0), view(true, 0)];
        for _ in 0..1000 {
            s.pick(65536, Some(0), &v).unwrap();
        }
        v[1].live = false;
        v.push(view(true, 0)); // channel 1 reopened as index 2
        let mut per = [0u32; 3];
        for _ in 0..100 {
            per[s.pick(65536, Some(0), &v).unwrap()] += 1;
        }
        assert!(per[0] >= 45 && per[2] >= 45, "the new channel shares, not hogs: {per:?}");
    }

    fn fixture(name: &str) -> Topology {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tyche-numa/fixtures").join(name);
        Topology::from_xml_file(path).expect("fixture")
    }

    #[test]
    fn fallback_uses_the_model_then_distances_then_ids() {
        // four-node.xml: NICs on nodes 0 and 2; 1 is near 0 (16), 3 near 2.
        let topo = fixture("four-node.xml");
        let (order, src) = fallback_order(Some(&topo), None, &[0, 2]);
        assert_eq!(src, OrderSource::Distances);
        assert_eq!(order.fallback(3)[0], vec![2], "by distance node 3 goes to node 2");
        // A model in which node 3's buffers are class 1 for node 0's NICs and class 3 for node 2's.
        let bw = |v: [f64; 4]| v.iter().enumerate().map(|(n, &b)| (n as u32, b)).collect::<Vec<_>>();
        let model = BandwidthModel::from_measurements(
            vec![
                tyche_numa::IoMeasurement {
                    io_node: 0,
                    first_class: vec![0, 3],
                    write: bw([10.0, 9.0, 9.0, 10.0]),
                    read: bw([10.0, 9.0, 9.0, 10.0]),
                },
                tyche_numa::IoMeasurement {
                    io_node: 2,
                    first_class: vec![2],
                    write: bw([9.0, 9.0, 10.0, 4.0]),
                    read: bw([9.0, 9.0, 10.0, 4.0]),
                },
            ],
            0.10,
        );
        let (order, src) = fallback_order(Some(&topo), Some(&model), &[0, 2]);
        assert_eq!(src, OrderSource::Model);
        assert_eq!(order.fallback(3)[0], vec![0], "the model overrides the distances");
        let mut s = NumaScheduler::with_order(SchedulerKind::Affinity, &[0, 2], Some(&order));
        let v = vec![view(true, 0), view(true, 2)];
        assert_eq!(s.pick(4096, Some(3), &v), Some(0), "node-3 buffers to the class-1 NIC");
        let (order, src) = fallback_order(None, None, &[0, 2]);
        assert_eq!(src, OrderSource::Id);
        assert_eq!(order.fallback(2), &[vec![0]]);
        let one = fixture("laptop-1node.xml");
        assert_eq!(fallback_order(Some(&one), None, &[0]).1, OrderSource::Id, "one node: nothing to order");
    }

    #[test]
    fn reserved_cpus_are_left_out_unless_they_are_all() {
        assert_eq!(without_reserved(vec![0, 1, 2, 3], &[0]), vec![1, 2, 3]);
        assert_eq!(without_reserved(vec![4], &[4]), vec![4], "a node's only CPU stays usable");
    }

    #[test]
    fn round_robin_ignores_nodes() {
        let mut s = NumaScheduler::new(SchedulerKind::RoundRobin, &[0, 1]);
        let v = vec![view(true, 0), view(true, 1), view(true, 0)];
        let picks: Vec<_> = (0..6).map(|_| s.pick(512, Some(1), &v).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }
}
