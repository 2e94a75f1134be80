//! Which channel carries a request: the affinity-aware channel scheduler and its baseline.
//!
//! [`Policy::Affinity`] is the scheduler of the NESUS 2015 paper: a request goes to a live
//! channel on the node of its buffers, and the node's channels share the bytes equally (the
//! channel with the fewest bytes assigned so far wins, ties to the lowest id). When all of that
//! node's channels are down or full, it falls back to the nearest node that has a usable
//! channel; nodes at the same distance (or in the same bandwidth class) are one tier and share
//! bytes equally too. [`Policy::RoundRobin`] is the papers' baseline: it ignores nodes and takes
//! the next usable channel in turn.
//!
//! One refinement of the paper's rule: a request that finds every channel it may go to idle
//! (nothing in flight on any, [`ChannelScheduler::set_idle`]) goes to the channel that carried
//! the last request if that one is among them and is less than [`IDLE_RUN_BYTES`] ahead of the
//! least loaded of them; it is charged as usual. The channel that carried the last request is
//! the one whose threads (the initiator's and the target's) are still polling rather than
//! asleep: alternating lone requests across two channels made most of them wake a sleeping
//! target thread (on the project's 2-vCPU bench, queue-depth-1 reads over 2 NICs: 9,445 to
//! 16,815 target wake-ups in a 4 s job, against 1,656 to 4,069 when they stay). The bound keeps
//! every channel carrying requests (a path that carries none would fail unnoticed until its
//! keepalives did) and keeps the byte totals within that much of equal.
//!
//! The scheduler is pure and deterministic: no I/O, no clock, no randomness. Liveness, fullness
//! and idleness are pushed in by the caller ([`ChannelScheduler::set_live`],
//! [`ChannelScheduler::set_full`], [`ChannelScheduler::set_idle`]).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::model::BandwidthModel;
use crate::Topology;

/// How far ahead of the least loaded candidate (in bytes charged) the channel that carried the
/// last request may run while lone requests keep going to it: 256 requests of 4 KiB, 8 of
/// 128 KiB, before they move to the channel that is behind.
pub const IDLE_RUN_BYTES: u64 = 1 << 20;

/// How the scheduler picks a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Channels on the buffer's node, equal bytes each; nearest node as fallback.
    #[default]
    Affinity,
    /// Every usable channel in turn, whatever its node (the papers' baseline).
    #[value(alias = "rr")]
    RoundRobin,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Affinity => "affinity",
            Policy::RoundRobin => "round-robin",
        })
    }
}

/// A channel registered with a [`ChannelScheduler`] (its index in registration order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ChannelId(pub usize);

/// For each node, the other nodes in the order to fall back to, grouped in tiers of equally
/// good nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NodeOrder {
    tiers: BTreeMap<u32, Vec<Vec<u32>>>,
}

impl NodeOrder {
    /// Falls back by node id: every other node is its own tier, ascending by id.
    pub fn by_id(nodes: &[u32]) -> Self {
        let tiers = nodes
            .iter()
            .map(|&n| {
                let others = nodes.iter().filter(|&&o| o != n).map(|&o| vec![o]).collect();
                (n, others)
            })
            .collect();
        NodeOrder { tiers }
    }

    /// Falls back by the topology's distance matrix (nodes at equal distance form a tier), or
    /// by id when the topology has none.
    pub fn from_topology(topo: &Topology) -> Self {
        let ids: Vec<u32> = topo.nodes.iter().map(|n| n.id).collect();
        if topo.nodes.iter().any(|n| n.distances.len() != ids.len()) {
            return Self::by_id(&ids);
        }
        Self::from_costs(&ids, |from, to| topo.distance(from, to).unwrap_or(u64::MAX))
    }

    /// Falls back by bandwidth class: from a buffer on node `b`, a node `k` that has NICs is
    /// ranked by the worse of the write and read classes of `b` in `k`'s model (class 1 first).
    /// Nodes that the model does not cover come last, by id.
    pub fn from_model(model: &BandwidthModel, nodes: &[u32]) -> Self {
        Self::from_costs(nodes, |from, to| model.class_between(from, to).map_or(u64::MAX, u64::from))
    }

    /// Tiers from a cost function (lower is nearer), ties broken into the same tier.
    pub fn from_costs(nodes: &[u32], cost: impl Fn(u32, u32) -> u64) -> Self {
        let mut tiers = BTreeMap::new();
        for &n in nodes {
            let mut others: Vec<(u64, u32)> = nodes.iter().filter(|&&o| o != n).map(|&o| (cost(n, o), o)).collect();
            others.sort_unstable();
            let mut grouped: Vec<Vec<u32>> = Vec::new();
            let mut last_cost = None;
            for (c, o) in others {
                if last_cost == Some(c) {
                    grouped.last_mut().expect("a tier exists").push(o);
                } else {
                    grouped.push(vec![o]);
                    last_cost = Some(c);
                }
            }
            tiers.insert(n, grouped);
        }
        NodeOrder { tiers }
    }

    /// The fallback tiers of `node` (empty for a node this order does not know).
    pub fn fallback(&self, node: u32) -> &[Vec<u32>] {
        self.tiers.get(&node).map_or(&[], Vec::as_slice)
    }
}

#[derive(Debug, Clone)]
struct ChannelState {
    node: Option<u32>,
    live: bool,
    full: bool,
    idle: bool,
    bytes: u64,
}

impl ChannelState {
    fn usable(&self) -> bool {
        self.live && !self.full
    }
}

/// Picks the channel for each request. See the module documentation for the rules.
#[derive(Debug, Clone)]
pub struct ChannelScheduler {
    policy: Policy,
    order: NodeOrder,
    channels: Vec<ChannelState>,
    next_rr: usize,
    last: Option<usize>,
}

impl ChannelScheduler {
    /// A scheduler with no channels yet.
    pub fn new(policy: Policy, order: NodeOrder) -> Self {
        ChannelScheduler { policy, order, channels: Vec::new(), next_rr: 0, last: None }
    }

    /// The policy in use.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Registers a live, empty channel on `node` (`None` if its NIC's node is unknown).
    pub fn add_channel(&mut self, node: Option<u32>) -> ChannelId {
        self.channels.push(ChannelState { node, live: true, full: false, idle: false, bytes: 0 });
        ChannelId(self.channels.len() - 1)
    }

    /// How many channels are registered.
    pub fn len(&self) -> usize {
        self.channels.len()
    }

    /// Whether no channel is registered.
    pub fn is_empty(&self) -> bool {
        self.channels.is_empty()
    }

    /// Marks a channel up or down. A channel coming back up is credited with as many bytes as
    /// the least loaded live channel of its node, so it does not take every request until it
    /// has caught up.
    ///
    /// # Panics
    /// If `id` was not returned by [`add_channel`](Self::add_channel).
    pub fn set_live(&mut self, id: ChannelId, live: bool) {
        let node = self.channels[id.0].node;
        if live && !self.channels[id.0].live {
            let floor = self.channels.iter().filter(|c| c.live && c.node == node).map(|c| c.bytes).min();
            if let Some(floor) = floor {
                let ch = &mut self.channels[id.0];
                ch.bytes = ch.bytes.max(floor);
            }
        }
        self.channels[id.0].live = live;
    }

    /// Marks a channel full (its send window or rings have no room) or not.
    ///
    /// # Panics
    /// If `id` was not returned by [`add_channel`](Self::add_channel).
    pub fn set_full(&mut self, id: ChannelId, full: bool) {
        self.channels[id.0].full = full;
    }

    /// Marks a channel idle (nothing in flight on it) or not. A new channel counts as busy
    /// until told otherwise, so a caller that never says keeps the paper's rule exactly.
    ///
    /// # Panics
    /// If `id` was not returned by [`add_channel`](Self::add_channel).
    pub fn set_idle(&mut self, id: ChannelId, idle: bool) {
        self.channels[id.0].idle = idle;
    }

    /// Bytes assigned to a channel so far.
    ///
    /// # Panics
    /// If `id` was not returned by [`add_channel`](Self::add_channel).
    pub fn bytes_assigned(&self, id: ChannelId) -> u64 {
        self.channels[id.0].bytes
    }

    /// The node a channel was registered on.
    ///
    /// # Panics
    /// If `id` was not returned by [`add_channel`](Self::add_channel).
    pub fn node_of(&self, id: ChannelId) -> Option<u32> {
        self.channels[id.0].node
    }

    /// Picks the channel for a request of `bytes` whose buffers are on `buffer_node` (`None`
    /// when unknown: then every channel is local), and charges the bytes to it. `None` when
    /// no channel is live and not full.
    pub fn pick(&mut self, buffer_node: Option<u32>, bytes: u64) -> Option<ChannelId> {
        let chosen = match self.policy {
            Policy::RoundRobin => self.pick_round_robin(),
            Policy::Affinity => self.pick_affinity(buffer_node),
        }?;
        let ch = &mut self.channels[chosen.0];
        ch.bytes = ch.bytes.saturating_add(bytes);
        self.last = Some(chosen.0);
        Some(chosen)
    }

    fn pick_round_robin(&mut self) -> Option<ChannelId> {
        let n = self.channels.len();
        let found = (0..n).map(|k| (self.next_rr + k) % n).find(|&i| self.channels[i].usable())?;
        self.next_rr = (found + 1) % n;
        Some(ChannelId(found))
    }

    fn pick_affinity(&self, buffer_node: Option<u32>) -> Option<ChannelId> {
        let Some(node) = buffer_node else {
            return self.least_loaded(|_| true);
        };
        if let Some(id) = self.least_loaded(|c| c.node == Some(node)) {
            return Some(id);
        }
        for tier in self.order.fallback(node) {
            if let Some(id) = self.least_loaded(|c| c.node.is_some_and(|n| tier.contains(&n))) {
                return Some(id);
            }
        }
        // Nodes the order does not know, then channels of unknown node.
        let known = |n: u32| n == node || self.order.fallback(node).iter().flatten().any(|&o| o == n);
        if let Some(id) = self.least_loaded(|c| c.node.is_some_and(|n| !known(n))) {
            return Some(id);
        }
        self.least_loaded(|c| c.node.is_none())
    }

    /// Among the usable channels matching `filter`: the last one picked when all of them are
    /// idle and it is less than [`IDLE_RUN_BYTES`] ahead of the least loaded, else the one with
    /// the fewest bytes.
    fn least_loaded(&self, filter: impl Fn(&ChannelState) -> bool) -> Option<ChannelId> {
        let candidates = || self.channels.iter().enumerate().filter(|(_, c)| c.usable() && filter(c));
        let (least, floor) = candidates().map(|(i, c)| (i, c.bytes)).min_by_key(|&(i, b)| (b, i))?;
        let sticky = self.last.filter(|&l| {
            self.channels.get(l).is_some_and(|c| c.usable() && filter(c) && c.bytes - floor < IDLE_RUN_BYTES)
                && candidates().all(|(_, c)| c.idle)
        });
        Some(ChannelId(sticky.unwrap_or(least)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{self, PlacementRequest};
    use std::path::Path;

    fn fixture(name: &str) -> Topology {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name);
        Topology::from_xml_file(&path).unwrap_or_else(|e| panic!("{name} should load: {e}"))
    }

    /// A scheduler with one channel per channel of the topology's placement plan.
    fn scheduler_for(topo: &Topology, per_nic: u32, policy: Policy) -> ChannelScheduler {
        let req = PlacementRequest::channels_per_nic(topo, &[], per_nic).expect("known NICs");
        let plan = placement::plan(topo, &req);
        let mut s = ChannelScheduler::new(policy, NodeOrder::from_topology(topo));
        for ch in &plan.channels {
            s.add_channel(Some(ch.node));
        }
        s
    }

    /// A small deterministic generator (xorshift), so the tests need no clock and no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn an_idle_tier_keeps_the_last_channel_for_a_bounded_run() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let mut s = scheduler_for(&topo, 1, Policy::Affinity);
        let all: Vec<ChannelId> = (0..s.len()).map(ChannelId).collect();
        let node1: Vec<ChannelId> = all.iter().copied().filter(|&id| s.node_of(id) == Some(1)).collect();
        assert!(node1.len() >= 2, "the fixture has several node-1 channels");
        all.iter().for_each(|&id| s.set_idle(id, true));
        let first = s.pick(Some(1), 4096).expect("node 1 has channels");
        let run = (IDLE_RUN_BYTES / 4096) as usize;
        for _ in 1..run {
            assert_eq!(s.pick(Some(1), 4096), Some(first), "idle: the channel still polling");
        }
        assert_eq!(s.bytes_assigned(first), IDLE_RUN_BYTES, "every request is charged");
        // IDLE_RUN_BYTES ahead: the next lone request goes to a channel that is behind, and
        // that one keeps the following ones.
        let second = s.pick(Some(1), 4096).expect("node 1 has channels");
        assert_ne!(second, first);
        assert_eq!(s.pick(Some(1), 4096), Some(second));
        // A buffer on the other node does not follow the last channel off its node.
        let other = s.pick(Some(0), 4096).expect("node 0 has channels");
        assert_eq!(s.node_of(other), Some(0));
        // One channel of the tier busy: bytes decide (the third node-1 channel, never used).
        s.set_idle(second, false);
        let next = s.pick(Some(1), 4096).expect("node 1 has channels");
        assert!(next != first && next != second);
        assert_eq!(s.bytes_assigned(next), 4096, "the least loaded channel of node 1: {next:?}");
    }

    #[test]
    fn picks_a_channel_on_the_buffers_node() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let mut s = scheduler_for(&topo, 1, Policy::Affinity);
        for _ in 0..100 {
            let id = s.pick(Some(1), 4096).expect("node 1 has live channels");
            assert_eq!(s.node_of(id), Some(1), "a node-1 buffer goes to a node-1 channel");
            let id = s.pick(Some(0), 4096).expect("node 0 has live channels");
            assert_eq!(s.node_of(id), Some(0));
        }
    }

    #[test]
    fn node_channels_share_bytes_equally_over_many_mixed_requests() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let mut s = scheduler_for(&topo, 2, Policy::Affinity);
        let max = 128 * 1024;
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..10_000 {
            let bytes = 512 + rng.next() % (max - 512 + 1);
            let node = (rng.next() % 2) as u32;
            let id = s.pick(Some(node), bytes).expect("all channels are live");
            assert_eq!(s.node_of(id), Some(node));
        }
        for node in [0, 1] {
            let totals: Vec<u64> = (0..s.len())
                .map(ChannelId)
                .filter(|&id| s.node_of(id) == Some(node))
                .map(|id| s.bytes_assigned(id))
                .collect();
            assert_eq!(totals.len(), 6, "3 NICs x 2 channels on node {node}");
            let spread = totals.iter().max().unwrap() - totals.iter().min().unwrap();
            assert!(spread <= max, "node {node}: byte totals {totals:?} differ by {spread} > one max request {max}");
        }
    }

    #[test]
    fn falls_back_to_the_nearest_node_when_local_channels_are_down_or_full() {
        let topo = fixture("four-node.xml");
        // Channels: 0,1 on node 0 (enp1s0f0, enp1s0f1), 2 on node 2 (enp65s0f0).
        let mut s = scheduler_for(&topo, 1, Policy::Affinity);
        assert_eq!(s.node_of(ChannelId(2)), Some(2));
        // Node 1 has no channel: its nearest node with channels is node 0 (distance 16).
        let id = s.pick(Some(1), 1).expect("some");
        assert_eq!(s.node_of(id), Some(0));
        // Node 3's nearest is node 2 (distance 16), not node 0 (22).
        assert_eq!(s.pick(Some(3), 1), Some(ChannelId(2)));
        // Node 2's channel down: nodes 0 and 1 are both at 22, one tier: node 0's channels.
        s.set_live(ChannelId(2), false);
        let id = s.pick(Some(2), 1).expect("some");
        assert_eq!(s.node_of(id), Some(0));
        // Node 0 full: node 0's buffers go to node 2 once it is back.
        s.set_live(ChannelId(2), true);
        s.set_full(ChannelId(0), true);
        s.set_full(ChannelId(1), true);
        assert_eq!(s.pick(Some(0), 1), Some(ChannelId(2)));
        // Nothing usable at all: None.
        s.set_live(ChannelId(2), false);
        assert_eq!(s.pick(Some(0), 1), None, "no live, non-full channel");
        assert_eq!(s.pick(None, 1), None);
        s.set_full(ChannelId(1), false);
        assert_eq!(s.pick(Some(2), 1), Some(ChannelId(1)), "the one usable channel");
    }

    #[test]
    fn fallback_without_distances_goes_by_id() {
        let order = NodeOrder::by_id(&[0, 1, 2]);
        assert_eq!(order.fallback(2), &[vec![0], vec![1]]);
        let mut s = ChannelScheduler::new(Policy::Affinity, order);
        let a = s.add_channel(Some(1));
        let b = s.add_channel(Some(0));
        let _c = s.add_channel(Some(2));
        s.set_live(ChannelId(2), false);
        assert_eq!(s.pick(Some(2), 10), Some(b), "node 0 before node 1");
        s.set_live(b, false);
        assert_eq!(s.pick(Some(2), 10), Some(a));
    }

    #[test]
    fn unknown_buffer_node_treats_every_channel_as_local() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let mut s = scheduler_for(&topo, 1, Policy::Affinity);
        let picked: Vec<usize> = (0..6).map(|_| s.pick(None, 100).expect("some").0).collect();
        assert_eq!(picked, vec![0, 1, 2, 3, 4, 5], "equal bytes over all channels");
    }

    #[test]
    fn channels_of_unknown_node_are_the_last_resort() {
        let mut s = ChannelScheduler::new(Policy::Affinity, NodeOrder::by_id(&[0, 1]));
        let unknown = s.add_channel(None);
        let remote = s.add_channel(Some(1));
        assert_eq!(s.pick(Some(0), 1), Some(remote), "a known remote node first");
        s.set_live(remote, false);
        assert_eq!(s.pick(Some(0), 1), Some(unknown));
    }

    #[test]
    fn a_channel_back_up_does_not_take_everything() {
        let mut s = ChannelScheduler::new(Policy::Affinity, NodeOrder::by_id(&[0]));
        let a = s.add_channel(Some(0));
        let b = s.add_channel(Some(0));
        s.set_live(b, false);
        for _ in 0..10 {
            assert_eq!(s.pick(Some(0), 1000), Some(a));
        }
        s.set_live(b, true);
        assert_eq!(s.bytes_assigned(b), 10_000, "credited with the node's floor");
        let picks: Vec<ChannelId> = (0..4).map(|_| s.pick(Some(0), 1000).expect("live")).collect();
        assert_eq!(picks, vec![a, b, a, b], "shared again right away");
    }

    #[test]
    fn round_robin_cycles_through_all_live_channels_ignoring_nodes() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let mut s = scheduler_for(&topo, 1, Policy::RoundRobin);
        let picked: Vec<usize> = (0..12).map(|_| s.pick(Some(0), 4096).expect("live").0).collect();
        assert_eq!(picked, vec![0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5], "node 0 buffers too");
        s.set_live(ChannelId(1), false);
        s.set_full(ChannelId(4), true);
        let picked: Vec<usize> = (0..8).map(|_| s.pick(Some(1), 1).expect("live").0).collect();
        assert_eq!(picked, vec![0, 2, 3, 5, 0, 2, 3, 5], "skips down and full channels");
        for i in 0..6 {
            s.set_live(ChannelId(i), false);
        }
        assert_eq!(s.pick(Some(0), 1), None);
    }

    #[test]
    fn round_robin_sends_half_the_bytes_remote_affinity_none() {
        // The papers' comparison in one number: share of bytes on a channel of another node.
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let remote_share = |policy| {
            let mut s = scheduler_for(&topo, 1, policy);
            let mut rng = Rng(42);
            let mut remote = 0u64;
            for _ in 0..10_000 {
                let node = (rng.next() % 2) as u32;
                let id = s.pick(Some(node), 4096).expect("live");
                if s.node_of(id) != Some(node) {
                    remote += 1;
                }
            }
            remote as f64 / 10_000.0
        };
        assert_eq!(remote_share(Policy::Affinity), 0.0, "affinity never goes remote");
        let rr = remote_share(Policy::RoundRobin);
        assert!((rr - 0.5).abs() < 0.05, "round robin sends about half remote, got {rr}");
    }

    #[test]
    fn policy_parses_from_configuration_text() {
        assert_eq!(<Policy as clap::ValueEnum>::from_str("affinity", false), Ok(Policy::Affinity));
        assert_eq!(<Policy as clap::ValueEnum>::from_str("round-robin", false), Ok(Policy::RoundRobin));
        assert!(<Policy as clap::ValueEnum>::from_str("fastest", false).is_err());
        assert_eq!(Policy::RoundRobin.to_string(), "round-robin");
    }

    proptest::proptest! {
        /// Whatever the mix, a request goes local when its node has a usable channel, and the
        /// channels of a node end within one maximal request of each other.
        #[test]
        fn affinity_is_local_and_fair_for_any_mix(
            per_node in proptest::collection::vec(1usize..4, 1..4),
            requests in proptest::collection::vec((0u32..4, 1u64..=65_536), 1..400),
        ) {
            let nodes: Vec<u32> = (0..per_node.len() as u32).collect();
            let mut s = ChannelScheduler::new(Policy::Affinity, NodeOrder::by_id(&nodes));
            for (node, &count) in per_node.iter().enumerate() {
                for _ in 0..count {
                    s.add_channel(Some(node as u32));
                }
            }
            for &(node, bytes) in &requests {
                let node = node % per_node.len() as u32;
                let id = s.pick(Some(node), bytes).expect("every channel is live");
                proptest::prop_assert_eq!(s.node_of(id), Some(node));
            }
            for &node in &nodes {
                let totals: Vec<u64> = (0..s.len())
                    .map(ChannelId)
                    .filter(|&id| s.node_of(id) == Some(node))
                    .map(|id| s.bytes_assigned(id))
                    .collect();
                let spread = totals.iter().max().unwrap() - totals.iter().min().unwrap();
                proptest::prop_assert!(spread <= 65_536, "node {} totals {:?}", node, totals);
            }
        }
    }

    #[test]
    fn four_node_distance_tiers() {
        let topo = fixture("four-node.xml");
        let order = NodeOrder::from_topology(&topo);
        assert_eq!(order.fallback(0), &[vec![1], vec![2, 3]]);
        assert_eq!(order.fallback(3), &[vec![2], vec![0, 1]]);
    }
}
