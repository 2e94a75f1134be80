//! The I/O bandwidth model of Li et al. (Algorithm 1): node-bound copy tests, bandwidth classes.
//!
//! For a node `k` that has NICs, the device's DMA engine is simulated by threads bound to `k`
//! that copy between a buffer on `k` and a buffer on each node `i`:
//! - *write* (data travelling from node `i` to the device): source on `i`, sink on `k`;
//! - *read* (data travelling from the device to node `i`): source on `k`, sink on `i`.
//!
//! The nodes are then grouped into bandwidth classes per `k` and direction ([`classify`]):
//! sorted by bandwidth, a node joins the current class when it is within `tolerance` of the
//! class's best node, and opens the next class otherwise. Class 1 holds the best (normally the
//! local and neighbouring) nodes. The scheduler uses the classes to choose where to go when it
//! must go remote ([`crate::NodeOrder::from_model`]), and [`BandwidthModel::predict`] gives the
//! paper's aggregate-bandwidth estimate for a mix of nodes.
//!
//! [`measure`] runs on the real machine only. Each (node, direction) pair copies for
//! [`ModelConfig::duration`] (default 60 ms), so a 2-node machine with NICs on both nodes is
//! characterised in about half a second. Algorithm 1 runs one copy thread per core of `k`;
//! [`ModelConfig::threads`] defaults to 1 to keep the run light on a shared machine.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::alloc::{HugePages, NodeRegion};
use crate::placement::pin_current_thread;
use crate::{NumaError, Topology};

/// Which way the data moves relative to the device's node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// From a node's memory to the device (source on the node, sink on the device's node).
    Write,
    /// From the device to a node's memory (source on the device's node, sink on the node).
    Read,
}

/// How long and how wide to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Bytes of each source and sink buffer.
    pub buffer_bytes: usize,
    /// How long each (node, direction) pair copies.
    pub duration: Duration,
    /// Copy threads per pair (`None`: one per core of the device's node, as in Algorithm 1).
    pub threads: Option<usize>,
    /// Relative bandwidth drop that opens a new class (0.10 = 10 % below the class's best).
    pub tolerance: f64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig { buffer_bytes: 8 << 20, duration: Duration::from_millis(60), threads: Some(1), tolerance: 0.10 }
    }
}

/// Measured bandwidths: `(node, GB/s)` per node.
pub type Samples = Vec<(u32, f64)>;

/// The measured bandwidth of one node and its class.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeBandwidth {
    /// The node whose memory is the source (write) or sink (read).
    pub node: u32,
    /// Copy bandwidth in gigabytes (10^9 bytes) per second, all threads together.
    pub gbytes_per_s: f64,
    /// The bandwidth class, 1 = best.
    pub class: u32,
}

/// The model of one device node: every node's bandwidth to it and from it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IoNodeModel {
    /// The node the NICs hang off.
    pub io_node: u32,
    /// Bandwidth from each node's memory to the device node, ascending by node.
    pub write: Vec<NodeBandwidth>,
    /// Bandwidth from the device node to each node's memory, ascending by node.
    pub read: Vec<NodeBandwidth>,
}

impl IoNodeModel {
    fn direction(&self, direction: Direction) -> &[NodeBandwidth] {
        match direction {
            Direction::Write => &self.write,
            Direction::Read => &self.read,
        }
    }
}

/// Bandwidth classes for every node that has NICs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BandwidthModel {
    /// The relative drop that separated the classes.
    pub tolerance: f64,
    /// One model per device node, ascending by node.
    pub io_nodes: Vec<IoNodeModel>,
}

impl BandwidthModel {
    /// Builds the model from measured bandwidths: per device node, `(node, GB/s)` for write and
    /// for read. Pure.
    pub fn from_measurements(measurements: Vec<(u32, Samples, Samples)>, tolerance: f64) -> Self {
        let mut io_nodes: Vec<IoNodeModel> = measurements
            .into_iter()
            .map(|(io_node, write, read)| IoNodeModel {
                io_node,
                write: classify(&write, tolerance),
                read: classify(&read, tolerance),
            })
            .collect();
        io_nodes.sort_by_key(|m| m.io_node);
        BandwidthModel { tolerance, io_nodes }
    }

    /// The model of one device node.
    pub fn io_node(&self, io_node: u32) -> Option<&IoNodeModel> {
        self.io_nodes.iter().find(|m| m.io_node == io_node)
    }

    /// The class of a buffer on `buffer_node` for NICs on `io_node`: the worse of its write and
    /// read classes. `None` when the model does not cover the pair.
    pub fn class_between(&self, buffer_node: u32, io_node: u32) -> Option<u32> {
        let m = self.io_node(io_node)?;
        let class = |v: &[NodeBandwidth]| v.iter().find(|b| b.node == buffer_node).map(|b| b.class);
        Some(class(&m.write)?.max(class(&m.read)?))
    }

    /// The paper's estimate of a device node's aggregate bandwidth when the fraction
    /// `shares[i].1` of the data comes from (or goes to) node `shares[i].0`:
    /// `sum(share * mean bandwidth of the node's class)`. `None` when a node is not modelled.
    pub fn predict(&self, io_node: u32, direction: Direction, shares: &[(u32, f64)]) -> Option<f64> {
        let nodes = self.io_node(io_node)?.direction(direction);
        let class_mean = |class: u32| {
            let members: Vec<f64> = nodes.iter().filter(|b| b.class == class).map(|b| b.gbytes_per_s).collect();
            members.iter().sum::<f64>() / members.len() as f64
        };
        shares.iter().try_fold(0.0, |acc, &(node, share)| {
            let b = nodes.iter().find(|b| b.node == node)?;
            Some(acc + share * class_mean(b.class))
        })
    }
}

/// Groups nodes into bandwidth classes (1 = best); the result is ascending by node. Pure.
pub fn classify(samples: &[(u32, f64)], tolerance: f64) -> Vec<NodeBandwidth> {
    let mut sorted: Vec<(u32, f64)> = samples.to_vec();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut out = Vec::with_capacity(sorted.len());
    let mut class = 0;
    let mut leader = f64::INFINITY;
    for (node, bw) in sorted {
        if class == 0 || bw < leader * (1.0 - tolerance) {
            class += 1;
            leader = bw;
        }
        out.push(NodeBandwidth { node, gbytes_per_s: bw, class });
    }
    out.sort_by_key(|b| b.node);
    out
}

/// Measures the model on this machine for the given device nodes (Algorithm 1).
pub fn measure(topo: &Topology, io_nodes: &[u32], cfg: &ModelConfig) -> Result<BandwidthModel, NumaError> {
    if !topo.is_this_system() {
        return Err(NumaError::NotThisSystem("the bandwidth model"));
    }
    let mut measurements = Vec::new();
    for &k in io_nodes {
        let device = topo.node(k).ok_or(NumaError::NoSuchNode(k))?;
        if device.cpus.is_empty() {
            // No CPU to simulate the DMA engine with; leave the node out of the model.
            tracing::warn!("bandwidth model: node {k} has no CPUs, not modelled");
            continue;
        }
        let threads = cfg.threads.unwrap_or(device.cores.len()).max(1);
        let mut write = Vec::new();
        let mut read = Vec::new();
        for node in topo.nodes.iter().filter(|n| n.memory_bytes > 0 || n.id == k) {
            let i = node.id;
            write.push((i, copy_bandwidth(&device.cpus, i, k, threads, cfg)?));
            read.push((i, copy_bandwidth(&device.cpus, k, i, threads, cfg)?));
        }
        measurements.push((k, write, read));
    }
    Ok(BandwidthModel::from_measurements(measurements, cfg.tolerance))
}

/// GB/s of `threads` threads pinned to `cpus`, each copying its own buffer on `src` to its own
/// buffer on `dst` for `cfg.duration`.
fn copy_bandwidth(cpus: &[u32], src: u32, dst: u32, threads: usize, cfg: &ModelConfig) -> Result<f64, NumaError> {
    let results: Vec<Result<f64, NumaError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(move || -> Result<f64, NumaError> {
                    pin_current_thread(cpus)?;
                    let mut source = NodeRegion::new(cfg.buffer_bytes, src, HugePages::No)?;
                    let mut sink = NodeRegion::new(cfg.buffer_bytes, dst, HugePages::No)?;
                    source.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
                    let start = Instant::now();
                    let mut copied = 0u64;
                    let mut rounds = 0;
                    while rounds < 3 || start.elapsed() < cfg.duration {
                        sink.as_mut_slice().copy_from_slice(source.as_slice());
                        std::hint::black_box(sink.as_slice());
                        copied += source.len() as u64;
                        rounds += 1;
                    }
                    Ok(copied as f64 / start.elapsed().as_secs_f64() / 1e9)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(Err(NumaError::MeasurementPanicked))).collect()
    });
    results.into_iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::{ChannelScheduler, NodeOrder, Policy};

    /// The shape of the paper's Table V (read model of node 7 on an 8-node machine), in GB/s.
    fn eight_node_model() -> BandwidthModel {
        let read = vec![(0, 2.2), (1, 2.2), (2, 2.6), (3, 2.6), (4, 3.1), (5, 3.1), (6, 3.6), (7, 3.6)];
        BandwidthModel::from_measurements(vec![(7, read.clone(), read)], 0.10)
    }

    #[test]
    fn classify_groups_by_relative_bandwidth() {
        let classes = classify(&[(0, 10.0), (1, 9.5), (2, 6.0), (3, 5.8), (4, 3.0)], 0.10);
        let got: Vec<(u32, u32)> = classes.iter().map(|b| (b.node, b.class)).collect();
        assert_eq!(got, vec![(0, 1), (1, 1), (2, 2), (3, 2), (4, 3)]);
        assert_eq!(classify(&[(0, 5.0)], 0.1)[0].class, 1, "one node is one class");
        assert!(classify(&[], 0.1).is_empty());
    }

    #[test]
    fn eight_node_model_has_four_classes_and_predicts_mixes() {
        let m = eight_node_model();
        let classes: Vec<u32> = m.io_nodes[0].read.iter().map(|b| b.class).collect();
        assert_eq!(classes, vec![4, 4, 3, 3, 2, 2, 1, 1]);
        assert_eq!(m.class_between(6, 7), Some(1), "the neighbour is class 1");
        assert_eq!(m.class_between(0, 7), Some(4));
        assert_eq!(m.class_between(0, 3), None, "node 3 has no NIC in this model");
        let p = m.predict(7, Direction::Read, &[(2, 0.5), (0, 0.5)]).expect("modelled nodes");
        assert!((p - 2.4).abs() < 1e-9, "half class 3, half class 4: {p}");
    }

    #[test]
    fn scheduler_uses_classes_when_it_must_go_remote() {
        // NICs on nodes 0, 1 and 2; node 3's buffers: class 1 to node 2, class 2 to node 0,
        // class 3 to node 1.
        let mk = |io: u32, bw: [f64; 4]| {
            let v: Vec<(u32, f64)> = bw.iter().enumerate().map(|(n, &b)| (n as u32, b)).collect();
            (io, v.clone(), v)
        };
        let model = BandwidthModel::from_measurements(
            vec![mk(0, [10.0, 8.0, 8.0, 8.5]), mk(1, [8.0, 10.0, 8.0, 4.0]), mk(2, [8.0, 8.0, 10.0, 10.0])],
            0.10,
        );
        let order = NodeOrder::from_model(&model, &[0, 1, 2, 3]);
        assert_eq!(order.fallback(3), &[vec![2], vec![0], vec![1]]);
        let mut s = ChannelScheduler::new(Policy::Affinity, order);
        let c0 = s.add_channel(Some(0));
        let c1 = s.add_channel(Some(1));
        let c2 = s.add_channel(Some(2));
        assert_eq!(s.pick(Some(3), 1), Some(c2), "best class first");
        s.set_live(c2, false);
        assert_eq!(s.pick(Some(3), 1), Some(c0));
        s.set_full(c0, true);
        assert_eq!(s.pick(Some(3), 1), Some(c1));
    }

    #[test]
    fn measuring_needs_the_real_machine() {
        let xml = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/laptop-1node.xml");
        let topo = Topology::from_xml_file(xml).expect("fixture loads");
        let err = measure(&topo, &[0], &ModelConfig::default()).expect_err("XML is not here");
        assert!(matches!(err, NumaError::NotThisSystem(_)), "{err}");
    }

    #[test]
    fn measuring_this_machine_gives_one_class_per_single_node() {
        let topo = Topology::this_system().expect("this machine");
        let cfg = ModelConfig {
            buffer_bytes: 1 << 20,
            duration: Duration::from_millis(5),
            threads: Some(1),
            tolerance: 0.10,
        };
        let first = topo.nodes[0].id;
        let model = measure(&topo, &[first], &cfg).expect("copy tests run");
        let m = model.io_node(first).expect("modelled");
        assert!(!m.write.is_empty() && !m.read.is_empty());
        assert!(m.write.iter().all(|b| b.gbytes_per_s > 0.0), "{m:?}");
        let local = m.write.iter().find(|b| b.node == first).expect("local node measured");
        if topo.nodes.len() == 1 {
            assert_eq!(local.class, 1, "a single node is class 1");
        }
    }
}
