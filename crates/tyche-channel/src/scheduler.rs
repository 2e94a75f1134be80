//! Choosing a channel for each request part.

/// What a scheduler sees of one channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelView {
    /// Whether the channel is alive.
    pub live: bool,
    /// Whether it has a free slot for this part now.
    pub has_room: bool,
    /// NUMA node of the channel's memory and threads, if known.
    pub node: Option<u32>,
    /// Requests submitted on it and not yet finished.
    pub in_flight: usize,
}

/// Picks a channel for a request part.
pub trait Scheduler: std::fmt::Debug + Send {
    /// Index of a live channel with room for a part moving `bytes` bytes of payload (zero for
    /// FLUSH, DISCARD and WRITE_ZEROES, whatever their range) whose buffers live on `node`, or
    /// `None` to wait.
    fn pick(&mut self, bytes: u64, node: Option<u32>, channels: &[ChannelView]) -> Option<usize>;
}

/// The papers' baseline: live channels in turn, ignoring nodes.
#[derive(Debug, Default, Clone)]
pub struct RoundRobin {
    next: usize,
}

impl Scheduler for RoundRobin {
    fn pick(&mut self, _bytes: u64, _node: Option<u32>, channels: &[ChannelView]) -> Option<usize> {
        let n = channels.len();
        let pick = (0..n).map(|i| (self.next + i) % n).find(|&i| channels[i].live && channels[i].has_room)?;
        self.next = (pick + 1) % n;
        Some(pick)
    }
}

/// How far ahead of the least loaded candidate (in bytes charged) the channel that carried the
/// last request may run while lone requests keep going to it ([`LeastBytes`]; tyche-numa's
/// scheduler has the same rule and bound).
pub const IDLE_RUN_BYTES: u64 = 1 << 20;

/// Equal bytes per channel among the live channels on the buffers' node, any live channel when
/// none of those has room (the affinity-aware scheduler of the NUMA paper, without distances;
/// `tyche-numa` provides the distance-aware one).
///
/// A request that finds every candidate channel idle (nothing in flight on any) goes to the
/// channel that carried the last request while that one is less than [`IDLE_RUN_BYTES`] ahead
/// of the least loaded candidate: its threads (the initiator's and the target's) are still
/// polling, where another channel's would have to be woken. The bound keeps every channel
/// carrying requests, so a path that fails is found by its requests, and the byte totals within
/// that much of equal.
#[derive(Debug, Default, Clone)]
pub struct LeastBytes {
    bytes: Vec<u64>,
    last: Option<usize>,
}

impl Scheduler for LeastBytes {
    fn pick(&mut self, bytes: u64, node: Option<u32>, channels: &[ChannelView]) -> Option<usize> {
        let n = channels.len();
        self.bytes.resize(n, 0);
        let usable = |i: usize| channels[i].live && channels[i].has_room;
        let local = |i: usize| node.is_none() || channels[i].node == node;
        let any_local = (0..n).any(|i| usable(i) && local(i));
        let candidate = |i: usize| usable(i) && (!any_local || local(i));
        let least = (0..n).filter(|&i| candidate(i)).min_by_key(|&i| (self.bytes[i], i))?;
        let idle = (0..n).filter(|&i| candidate(i)).all(|i| channels[i].in_flight == 0);
        let sticky =
            self.last.filter(|&l| idle && l < n && candidate(l) && self.bytes[l] - self.bytes[least] < IDLE_RUN_BYTES);
        let pick = sticky.unwrap_or(least);
        self.bytes[pick] += bytes;
        self.last = Some(pick);
        Some(pick)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn views(n: usize) -> Vec<ChannelView> {
        (0..n).map(|i| ChannelView { live: true, has_room: true, node: Some((i % 2) as u32), in_flight: 0 }).collect()
    }

    #[test]
    fn round_robin_skips_dead_channels() {
        let mut v = views(3);
        v[1].live = false;
        let mut rr = RoundRobin::default();
        let picks: Vec<_> = (0..4).map(|_| rr.pick(4096, None, &v).unwrap()).collect();
        assert_eq!(picks, [0, 2, 0, 2]);
    }

    #[test]
    fn least_bytes_is_fair_and_local() {
        let mut v = views(4); // nodes 0,1,0,1
        v.iter_mut().for_each(|c| c.in_flight = 1); // loaded: bytes are balanced
        let mut s = LeastBytes::default();
        let mut per = [0u64; 4];
        for i in 0..1000u64 {
            let bytes = 512 * (1 + i % 7);
            per[s.pick(bytes, Some(0), &v).unwrap()] += bytes;
        }
        assert_eq!(per[1] + per[3], 0, "node-0 buffers stay on node-0 channels");
        assert!(per[0].abs_diff(per[2]) <= 512 * 7, "{per:?}");
        let mut full = v.clone();
        full[0].has_room = false;
        full[2].has_room = false;
        assert!(matches!(s.pick(512, Some(0), &full), Some(1 | 3)), "falls back to another node");
        let none: Vec<_> = v.iter().map(|c| ChannelView { live: false, ..*c }).collect();
        assert_eq!(s.pick(512, Some(0), &none), None);
    }

    #[test]
    fn least_bytes_keeps_an_idle_set_on_the_last_channel_for_a_bounded_run() {
        let mut v = views(4); // nodes 0,1,0,1
        let mut s = LeastBytes::default();
        let run = IDLE_RUN_BYTES / 4096;
        for _ in 0..run {
            assert_eq!(s.pick(4096, Some(0), &v), Some(0), "idle: the channel still polling");
        }
        // A run ahead: lone requests move to the channel behind, and stay there.
        assert_eq!(s.pick(4096, Some(0), &v), Some(2));
        assert_eq!(s.pick(4096, Some(0), &v), Some(2));
        // Loaded: bytes decide (channel 2 is the one behind, by a run less two requests).
        v.iter_mut().for_each(|c| c.in_flight = 1);
        assert_eq!(s.pick(4096, Some(0), &v), Some(2));
        // Idle again: the last channel stays; one without room is not kept.
        v.iter_mut().for_each(|c| c.in_flight = 0);
        assert_eq!(s.pick(4096, Some(0), &v), Some(2));
        v[2].has_room = false;
        assert_eq!(s.pick(4096, Some(0), &v), Some(0));
    }
}
