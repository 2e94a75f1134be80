//! tyche-numa's [`ChannelScheduler`] behind tyche-channel's [`Scheduler`] trait.
//!
//! The volume shows the scheduler every channel (by index) with its liveness, room and node on
//! each pick; the adapter registers new indices with the NUMA scheduler as they appear (an index
//! is never reused for another NIC: a reconnected channel gets a fresh one) and pushes liveness
//! and fullness before asking it.

use tyche_channel::{ChannelView, Scheduler};
use tyche_numa::{ChannelId, ChannelScheduler, NodeOrder, Policy};

use crate::config::SchedulerKind;

/// The NUMA-aware channel scheduler (affinity with nearest-node fallback, or round robin).
#[derive(Debug)]
pub struct NumaScheduler {
    inner: ChannelScheduler,
}

impl NumaScheduler {
    /// A scheduler for channels on `nodes` (the NICs' nodes; falls back by node id).
    pub fn new(kind: SchedulerKind, nodes: &[u32]) -> Self {
        let policy = match kind {
            SchedulerKind::Affinity => Policy::Affinity,
            SchedulerKind::RoundRobin => Policy::RoundRobin,
        };
        let mut nodes = nodes.to_vec();
        nodes.sort_unstable();
        nodes.dedup();
        NumaScheduler { inner: ChannelScheduler::new(policy, NodeOrder::by_id(&nodes)) }
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
        }
        self.inner.pick(node, bytes).map(|id| id.0).filter(|&i| i < channels.len())
    }
}

/// The CPUs of NUMA node `node`, from sysfs (`None` when unknown).
pub fn node_cpus(node: u32) -> Option<Vec<u32>> {
    let list = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist")).ok()?;
    tyche_numa::parse_cpu_list(list.trim()).ok().filter(|cpus| !cpus.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(live: bool, node: u32) -> ChannelView {
        ChannelView { live, has_room: true, node: Some(node) }
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

    #[test]
    fn round_robin_ignores_nodes() {
        let mut s = NumaScheduler::new(SchedulerKind::RoundRobin, &[0, 1]);
        let v = vec![view(true, 0), view(true, 1), view(true, 0)];
        let picks: Vec<_> = (0..6).map(|_| s.pick(512, Some(1), &v).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }
}
