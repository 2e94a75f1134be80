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

/// Equal bytes per channel among the live channels on the buffers' node, any live channel when
/// none of those has room (the affinity-aware scheduler of the NUMA paper, without distances;
/// `tyche-numa` provides the distance-aware one).
#[derive(Debug, Default, Clone)]
pub struct LeastBytes {
    bytes: Vec<u64>,
}

impl Scheduler for LeastBytes {
    fn pick(&mut self, bytes: u64, node: Option<u32>, channels: &[ChannelView]) -> Option<usize> {
        self.bytes.resize(channels.len(), 0);
        let usable = |i: &usize| channels[*i].live && channels[*i].has_room;
        let least = |it: &mut dyn Iterator<Item = usize>| it.min_by_key(|&i| (self.bytes[i], i));
        let local =
            least(&mut (0..channels.len()).filter(usable).filter(|&i| node.is_none() || channels[i].node == node));
        let pick = local.or_else(|| least(&mut (0..channels.len()).filter(usable)))?;
        self.bytes[pick] += bytes;
        Some(pick)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn views(n: usize) -> Vec<ChannelView> {
        (0..n).map(|i| ChannelView { live: true, has_room: true, node: Some((i % 2) as u32) }).collect()
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
        let v = views(4); // nodes 0,1,0,1
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
}
