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

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::alloc::{HugePages, NodeRegion};
use crate::placement::pin_current_thread;
use crate::{NumaError, Topology};

/// Which way the data moves relative to the device's node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeBandwidth {
    /// The node whose memory is the source (write) or sink (read).
    pub node: u32,
    /// Copy bandwidth in gigabytes (10^9 bytes) per second, all threads together.
    pub gbytes_per_s: f64,
    /// The bandwidth class, 1 = best.
    pub class: u32,
}

/// The model of one device node: every node's bandwidth to it and from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandwidthModel {
    /// The relative drop that separated the classes.
    pub tolerance: f64,
    /// One model per device node, ascending by node.
    pub io_nodes: Vec<IoNodeModel>,
}

impl BandwidthModel {
    /// Builds the model from measured bandwidths, per device node. Pure.
    pub fn from_measurements(measurements: Vec<IoMeasurement>, tolerance: f64) -> Self {
        let mut io_nodes: Vec<IoNodeModel> = measurements
            .into_iter()
            .map(|m| IoNodeModel {
                io_node: m.io_node,
                write: classify(&m.write, tolerance, &m.first_class),
                read: classify(&m.read, tolerance, &m.first_class),
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

/// What was measured for one device node.
#[derive(Debug, Clone, PartialEq)]
pub struct IoMeasurement {
    /// The node the NICs hang off.
    pub io_node: u32,
    /// The nodes that are class 1 whatever they measured: the device node and its neighbours
    /// (Li et al.: "the local and neighboring nodes are always assigned to the first class";
    /// [`first_class_nodes`]).
    pub first_class: Vec<u32>,
    /// `(node, GB/s)` from each node's memory to the device node.
    pub write: Samples,
    /// `(node, GB/s)` from the device node to each node's memory.
    pub read: Samples,
}

/// Groups nodes into bandwidth classes (1 = best); the result is ascending by node. Pure.
///
/// The nodes of `first_class` (the device node and its neighbours) are class 1. The others,
/// sorted by bandwidth, open class 2 (class 1 when `first_class` is empty); a node joins the
/// current class when it is within `tolerance` of the class's first (best) node and opens the
/// next class otherwise. With Table V of Li et al. (device read on node 7 of an 8-node
/// Opteron), first class {6, 7} and a 10 % tolerance give exactly the paper's classes
/// {6, 7}, {2, 3}, {0, 1, 5}, {4}; by bandwidth alone nodes 2 and 3 would join class 1.
pub fn classify(samples: &[(u32, f64)], tolerance: f64, first_class: &[u32]) -> Vec<NodeBandwidth> {
    let mut out: Vec<NodeBandwidth> = samples
        .iter()
        .filter(|(n, _)| first_class.contains(n))
        .map(|&(node, bw)| NodeBandwidth { node, gbytes_per_s: bw, class: 1 })
        .collect();
    let mut sorted: Vec<(u32, f64)> = samples.iter().filter(|(n, _)| !first_class.contains(n)).copied().collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut class = u32::from(!out.is_empty());
    let mut leader = f64::INFINITY;
    let mut opened = false;
    for (node, bw) in sorted {
        if !opened || bw < leader * (1.0 - tolerance) {
            class += 1;
            leader = bw;
            opened = true;
        }
        out.push(NodeBandwidth { node, gbytes_per_s: bw, class });
    }
    out.sort_by_key(|b| b.node);
    out
}

/// The device node `k` and its neighbours: the nodes at the smallest distance from `k` other
/// than itself, when the distance matrix has more than one remote distance from `k` (an
/// 8-node Opteron's same-package node; a two-socket machine, with one remote distance, has no
/// neighbour, so its other socket is classified by what it measures). Pure.
pub fn first_class_nodes(topo: &Topology, k: u32) -> Vec<u32> {
    let Some(node) = topo.node(k) else { return vec![k] };
    if node.distances.len() != topo.nodes.len() {
        return vec![k];
    }
    let remote: Vec<(u64, u32)> =
        topo.nodes.iter().zip(&node.distances).filter(|(n, _)| n.id != k).map(|(n, &d)| (d, n.id)).collect();
    let min = remote.iter().map(|r| r.0).min();
    let distinct: BTreeSet<u64> = remote.iter().map(|r| r.0).collect();
    let mut out = vec![k];
    if distinct.len() > 1 {
        out.extend(remote.iter().filter(|r| Some(r.0) == min).map(|r| r.1));
    }
    out.sort_unstable();
    out
}

/// Measures the model on this machine for the given device nodes (Algorithm 1).
pub fn measure(topo: &Topology, io_nodes: &[u32], cfg: &ModelConfig) -> Result<BandwidthModel, NumaError> {
    if !topo.is_this_system() {
        return Err(NumaError::NotThisSystem("the bandwidth model"));
    }
    let mut measurements = Vec::new();
    for &k in io_nodes {
        let mut device = topo.node(k).ok_or(NumaError::NoSuchNode(k))?;
        if device.cpus.is_empty() {
            // No CPU on the device's node to simulate its DMA engine with: the threads run on
            // the nearest node that has CPUs, still copying to and from buffers on `k`, so the
            // classes say how well each node's memory and `k`'s memory exchange data.
            let Some(near) = topo
                .nodes
                .iter()
                .filter(|n| !n.cpus.is_empty())
                .min_by_key(|n| (topo.distance(k, n.id).unwrap_or(u64::MAX), n.id.abs_diff(k), n.id))
            else {
                tracing::warn!("bandwidth model: no node has CPUs, node {k} not modelled");
                continue;
            };
            tracing::info!("bandwidth model: node {k} has no CPUs; its copy threads run on node {}", near.id);
            device = near;
        }
        let threads = cfg.threads.unwrap_or(device.cores.len()).max(1);
        let mut write = Vec::new();
        let mut read = Vec::new();
        for node in topo.nodes.iter().filter(|n| n.memory_bytes > 0 || n.id == k) {
            let i = node.id;
            write.push((i, copy_bandwidth(&device.cpus, i, k, threads, cfg)?));
            read.push((i, copy_bandwidth(&device.cpus, k, i, threads, cfg)?));
        }
        measurements.push(IoMeasurement { io_node: k, first_class: first_class_nodes(topo, k), write, read });
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

/// Version of the cache file's layout.
pub const CACHE_VERSION: u32 = 1;

/// Largest cache file read (a model of a few nodes is a few kilobytes).
pub const MAX_CACHE_BYTES: u64 = 1 << 20;

/// Where the daemons keep the measured model unless told otherwise (`--model-cache`).
pub const DEFAULT_CACHE: &str = "/var/lib/tyche/bandwidth-model.json";

/// The cache file: the model and the machine layout it was measured on.
#[derive(Debug, Serialize, Deserialize)]
struct CacheFile {
    version: u32,
    machine: String,
    model: BandwidthModel,
}

/// What the machine's NUMA layout looks like, as a string that changes when the layout does
/// (nodes, their CPUs, memory and distances). A cached model of another layout is measured
/// again.
pub fn machine_fingerprint(topo: &Topology) -> String {
    topo.nodes
        .iter()
        .map(|n| {
            format!(
                "{}:{}:{}:{}",
                n.id,
                crate::format_cpu_list(&n.cpus),
                n.memory_bytes >> 20,
                n.distances.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
            )
        })
        .collect::<Vec<_>>()
        .join(";")
}

/// How [`cached`] got its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheUse {
    /// Read from the cache file.
    Loaded,
    /// Measured (no usable cache, or a refresh was asked for) and stored.
    Measured,
    /// Measured, but the cache file could not be written (a warning was logged).
    MeasuredNotStored,
}

/// The model of this machine for `io_nodes`: read from `path` when it holds one measured on
/// this layout that covers every node of `io_nodes`, else measured ([`measure`]) and written
/// there. `refresh` measures again whatever the file holds. A cache file that cannot be read or
/// parsed is a warning and a new measurement, never an error; a file that cannot be written is
/// a warning.
pub fn cached(
    path: &Path,
    topo: &Topology,
    io_nodes: &[u32],
    cfg: &ModelConfig,
    refresh: bool,
) -> Result<(BandwidthModel, CacheUse), NumaError> {
    if !refresh {
        match read_cache(path) {
            Ok(Some(file)) => {
                let covers = io_nodes.iter().all(|k| file.model.io_node(*k).is_some());
                if file.version == CACHE_VERSION && file.machine == machine_fingerprint(topo) && covers {
                    return Ok((file.model, CacheUse::Loaded));
                }
                tracing::info!(
                    path = %path.display(),
                    "the cached bandwidth model is of another machine layout or lacks a NIC node: measuring again"
                );
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(path = %path.display(), "bandwidth model cache unusable ({e}): measuring again"),
        }
    }
    let model = measure(topo, io_nodes, cfg)?;
    let file = CacheFile { version: CACHE_VERSION, machine: machine_fingerprint(topo), model };
    let stored = write_cache(path, &file);
    if let Err(e) = &stored {
        tracing::warn!(path = %path.display(), "cannot store the bandwidth model: {e} (it is measured again next start)");
    }
    let how = if stored.is_ok() { CacheUse::Measured } else { CacheUse::MeasuredNotStored };
    Ok((file.model, how))
}

/// What is wrong with a model file ([`load_file`]) or the daemons' model cache.
#[derive(Debug, thiserror::Error)]
pub enum ModelFileError {
    /// The file does not exist.
    #[error("no such file")]
    Missing,
    /// It could not be opened or read.
    #[error("cannot read it: {0}")]
    Os(#[from] std::io::Error),
    /// It is larger than any model file ([`MAX_CACHE_BYTES`]).
    #[error("larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: u64,
    },
    /// It is JSON of another shape, or not JSON.
    #[error("neither a model cache file nor a model: {0}")]
    NotAModel(serde_json::Error),
    /// A bandwidth, class or tolerance out of range.
    #[error("not a model file: a bandwidth, class or tolerance out of range")]
    OutOfRange,
}

/// The cache file, `None` when there is none; an error says what is wrong with it.
fn read_cache(path: &Path) -> Result<Option<CacheFile>, ModelFileError> {
    let Some(bytes) = read_bounded(path)? else { return Ok(None) };
    let file: CacheFile = serde_json::from_slice(&bytes).map_err(ModelFileError::NotAModel)?;
    check_model(&file.model)?;
    Ok(Some(file))
}

/// A model from a file, whatever machine it was measured on: a cache file (as the daemons
/// write) or the bare model (as `tyched topology --json` prints under `model`). For placing on
/// another machine's topology (`tyched topology --xml FILE --model-file FILE`), or for
/// repeating a placement with given classes; an error says what is wrong with the file.
pub fn load_file(path: &Path) -> Result<BandwidthModel, ModelFileError> {
    let bytes = read_bounded(path)?.ok_or(ModelFileError::Missing)?;
    let model = match serde_json::from_slice::<CacheFile>(&bytes) {
        Ok(file) => file.model,
        Err(_) => serde_json::from_slice::<BandwidthModel>(&bytes).map_err(ModelFileError::NotAModel)?,
    };
    check_model(&model)?;
    Ok(model)
}

/// At most [`MAX_CACHE_BYTES`] of a file; `None` when it does not exist.
fn read_bounded(path: &Path) -> Result<Option<Vec<u8>>, ModelFileError> {
    use std::io::Read;
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mut bytes = Vec::new();
    f.take(MAX_CACHE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CACHE_BYTES {
        return Err(ModelFileError::TooLarge { limit: MAX_CACHE_BYTES });
    }
    Ok(Some(bytes))
}

/// A model read from a file has finite, non-negative bandwidths, classes from 1 and a
/// tolerance in [0, 1).
fn check_model(model: &BandwidthModel) -> Result<(), ModelFileError> {
    let finite = model
        .io_nodes
        .iter()
        .flat_map(|m| m.write.iter().chain(&m.read))
        .all(|b| b.gbytes_per_s.is_finite() && b.gbytes_per_s >= 0.0 && b.class >= 1);
    if !finite || !(0.0..1.0).contains(&model.tolerance) {
        return Err(ModelFileError::OutOfRange);
    }
    Ok(())
}

fn write_cache(path: &Path, file: &CacheFile) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(file).map_err(std::io::Error::other)?;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A warning when `what` (a channel's memory or thread, requests' buffers) on `node` is in a
/// bandwidth class worse than 1 for a device on `io_node`; `None` when class 1 or not
/// modelled. Pure.
pub fn low_class(model: &BandwidthModel, what: &str, node: u32, io_node: u32) -> Option<String> {
    let class = model.class_between(node, io_node)?;
    let worst =
        model.io_node(io_node).map(|m| m.write.iter().chain(&m.read).map(|b| b.class).max().unwrap_or(1)).unwrap_or(1);
    (class > 1).then(|| {
        format!(
            "{what} on node {node}: bandwidth class {class} of {worst} for NICs on node {io_node} \
             (class 1 is best: the NIC's node and its neighbours)"
        )
    })
}

/// [`low_class`] for every channel of a plan whose NIC's node is known: for its thread's node,
/// and for its memory's node where that is another one. Pure.
pub fn plan_warnings(model: &BandwidthModel, plan: &crate::Plan) -> Vec<String> {
    plan.channels
        .iter()
        .filter_map(|c| {
            let k = c.nic_node?;
            let what = format!("{} channel {}", c.nic, c.channel);
            if c.memory_node == c.node {
                return low_class(model, &format!("{what}: memory and thread"), c.node, k);
            }
            let memory = low_class(model, &format!("{what}: memory"), c.memory_node, k);
            let thread = low_class(model, &format!("{what}: network thread"), c.node, k);
            memory.or(thread)
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::scheduler::{ChannelScheduler, NodeOrder, Policy};

    /// Li et al., Table V (device read, NICs on node 7 of an 8-node Opteron 6136): the
    /// memcpy method's range per class is 47.1-51.2 GB/s for {6, 7}, 46.9-50.3 for {2, 3},
    /// 39.9-40.9 for {0, 1, 5} and 27.9 for {4}; each class's mean is the table's Avg row
    /// (49.1, 48.6, 40.4, 27.9). The per-node values are the ranges' ends (the paper gives no
    /// more); nodes 6 and 7 share a package, so node 6 is node 7's neighbour.
    fn table_v_read() -> Samples {
        vec![(0, 40.9), (1, 40.4), (2, 50.3), (3, 46.9), (4, 27.9), (5, 39.9), (6, 47.1), (7, 51.2)]
    }

    /// Table IV (device write, node 7): {6, 7} 46.5-55.9 (Avg 51.2), {0, 1, 4, 5} 42.9-46.9
    /// (Avg 44.5), {2, 3} 26.0-27.3 (Avg 26.6).
    fn table_iv_write() -> Samples {
        vec![(0, 42.9), (1, 44.1), (2, 26.0), (3, 27.3), (4, 44.1), (5, 46.9), (6, 46.5), (7, 55.9)]
    }

    pub(crate) fn paper_model() -> BandwidthModel {
        BandwidthModel::from_measurements(
            vec![IoMeasurement { io_node: 7, first_class: vec![6, 7], write: table_iv_write(), read: table_v_read() }],
            0.10,
        )
    }

    fn classes(v: &[NodeBandwidth]) -> Vec<Vec<u32>> {
        let max = v.iter().map(|b| b.class).max().unwrap_or(0);
        (1..=max).map(|c| v.iter().filter(|b| b.class == c).map(|b| b.node).collect()).collect()
    }

    #[test]
    fn classify_groups_by_relative_bandwidth() {
        let classes = classify(&[(0, 10.0), (1, 9.5), (2, 6.0), (3, 5.8), (4, 3.0)], 0.10, &[]);
        let got: Vec<(u32, u32)> = classes.iter().map(|b| (b.node, b.class)).collect();
        assert_eq!(got, vec![(0, 1), (1, 1), (2, 2), (3, 2), (4, 3)]);
        assert_eq!(classify(&[(0, 5.0)], 0.1, &[])[0].class, 1, "one node is one class");
        assert!(classify(&[], 0.1, &[]).is_empty());
        let c = classify(&[(0, 10.0), (1, 5.0)], 0.1, &[1]);
        assert_eq!((c[0].class, c[1].class), (2, 1), "the device node is class 1 even when slower");
    }

    #[test]
    fn the_papers_tables_iv_and_v_come_out_as_published() {
        let m = paper_model();
        let io = m.io_node(7).expect("node 7");
        assert_eq!(classes(&io.read), vec![vec![6, 7], vec![2, 3], vec![0, 1, 5], vec![4]], "Table V");
        assert_eq!(classes(&io.write), vec![vec![6, 7], vec![0, 1, 4, 5], vec![2, 3]], "Table IV");
        // By bandwidth alone, nodes 2 and 3 (50.3, 46.9) would join 7 (51.2) in class 1.
        let blind = classify(&table_v_read(), 0.10, &[]);
        assert_eq!(blind.iter().find(|b| b.node == 2).map(|b| b.class), Some(1));
        // Class means are the tables' Avg rows.
        let mean = |v: &[NodeBandwidth], c: u32| {
            let x: Vec<f64> = v.iter().filter(|b| b.class == c).map(|b| b.gbytes_per_s).collect();
            x.iter().sum::<f64>() / x.len() as f64
        };
        for (c, avg) in [(1, 49.1), (2, 48.6), (3, 40.4), (4, 27.9)] {
            assert!((mean(&io.read, c) - avg).abs() < 0.06, "read class {c}: {} vs {avg}", mean(&io.read, c));
        }
        for (c, avg) in [(1, 51.2), (2, 44.5), (3, 26.6)] {
            assert!((mean(&io.write, c) - avg).abs() < 0.06, "write class {c}: {} vs {avg}", mean(&io.write, c));
        }
        // class_between is the worse of write and read: node 4 is write class 2, read class 4.
        assert_eq!(m.class_between(6, 7), Some(1), "the neighbour is class 1");
        assert_eq!(m.class_between(4, 7), Some(4));
        assert_eq!(m.class_between(2, 7), Some(3), "read class 2, write class 3");
        assert_eq!(m.class_between(0, 3), None, "node 3 has no NIC in this model");
        // The paper's prediction example has the shape: half class 2, half class 3.
        let p = m.predict(7, Direction::Read, &[(2, 0.5), (0, 0.5)]).expect("modelled nodes");
        assert!((p - (48.6 + 40.4) / 2.0).abs() < 0.01, "{p}");
    }

    #[test]
    fn fallback_order_follows_the_papers_classes() {
        let m = paper_model();
        let nodes: Vec<u32> = (0..8).collect();
        let order = NodeOrder::from_model(&m, &nodes);
        // From a buffer on node 4 (class 4), node 7's NICs are the only modelled ones.
        assert_eq!(order.fallback(4).first(), Some(&vec![7]));
        let w = low_class(&m, "ens7 channel 0", 4, 7).expect("class 4 warns");
        assert!(w.contains("bandwidth class 4 of 4 for NICs on node 7"), "{w}");
        assert!(low_class(&m, "x", 6, 7).is_none(), "class 1: no warning");
        assert!(low_class(&m, "x", 6, 3).is_none(), "not modelled: no warning");
    }

    #[test]
    fn neighbours_come_from_a_layered_distance_matrix() {
        let xml = |name: &str| {
            Topology::from_xml_file(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name))
                .expect("fixture")
        };
        assert_eq!(first_class_nodes(&xml("paper-2s4c2t-6nic.xml"), 1), vec![1], "two sockets: no neighbour");
        assert_eq!(first_class_nodes(&xml("four-node.xml"), 0), vec![0, 1], "16 before 22");
        assert_eq!(first_class_nodes(&xml("laptop-1node.xml"), 0), vec![0]);
    }

    #[test]
    fn the_cache_is_reused_refreshed_and_survives_corruption() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state/model.json");
        let topo = Topology::this_system().expect("this machine");
        let k = topo.nodes[0].id;
        let cfg =
            ModelConfig { buffer_bytes: 1 << 16, duration: Duration::from_millis(1), threads: Some(1), tolerance: 0.1 };
        let (m1, how) = cached(&path, &topo, &[k], &cfg, false).expect("measured");
        assert_eq!(how, CacheUse::Measured);
        let (m2, how) = cached(&path, &topo, &[k], &cfg, false).expect("loaded");
        assert_eq!(how, CacheUse::Loaded);
        // The same model, not measured again (JSON keeps bandwidths to the last bit or so).
        let bw = |m: &BandwidthModel| m.io_nodes[0].write[0].gbytes_per_s;
        assert!((bw(&m1) - bw(&m2)).abs() < 1e-9 * bw(&m1), "{m1:?} {m2:?}");
        let (_, how) = cached(&path, &topo, &[k], &cfg, true).expect("refreshed");
        assert_eq!(how, CacheUse::Measured);
        for junk in ["{", "", "null", "{\"version\":1,\"machine\":\"x\",\"model\":{\"tolerance\":-1,\"io_nodes\":[]}}"]
        {
            std::fs::write(&path, junk).unwrap();
            let (_, how) = cached(&path, &topo, &[k], &cfg, false).expect("a corrupt cache is measured again");
            assert_eq!(how, CacheUse::Measured, "{junk:?}");
        }
        // Another machine's layout: measured again.
        let mut text = std::fs::read_to_string(&path).unwrap();
        text = text.replace(&machine_fingerprint(&topo), "0:0-63:1:10");
        std::fs::write(&path, text).unwrap();
        assert_eq!(cached(&path, &topo, &[k], &cfg, false).expect("measured").1, CacheUse::Measured);
        // A cache that cannot be written is a warning, the model is still used.
        let blocked = dir.path().join("file");
        std::fs::write(&blocked, "").unwrap();
        let (_, how) = cached(&blocked.join("model.json"), &topo, &[k], &cfg, false).expect("measured");
        assert_eq!(how, CacheUse::MeasuredNotStored);
    }

    #[test]
    fn model_files_load_bare_or_cached_and_junk_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = paper_model();
        let bare = dir.path().join("bare.json");
        std::fs::write(&bare, serde_json::to_string(&model).unwrap()).unwrap();
        assert_eq!(load_file(&bare).expect("a bare model"), model);
        let cache = dir.path().join("cache.json");
        let file = CacheFile { version: CACHE_VERSION, machine: "another machine".into(), model: model.clone() };
        std::fs::write(&cache, serde_json::to_string(&file).unwrap()).unwrap();
        assert_eq!(load_file(&cache).expect("a cache file of any machine"), model);
        let missing = load_file(&dir.path().join("missing.json")).unwrap_err();
        assert!(matches!(missing, ModelFileError::Missing) && missing.to_string() == "no such file");
        let junk = dir.path().join("junk.json");
        std::fs::write(&junk, "{\"tolerance\": 0.1}").unwrap();
        let e = load_file(&junk).unwrap_err();
        assert!(matches!(e, ModelFileError::NotAModel(_)) && e.to_string().contains("neither"), "junk is named");
        let mut bad = model;
        bad.io_nodes[0].read[0].gbytes_per_s = -1.0;
        std::fs::write(&junk, serde_json::to_string(&bad).unwrap()).unwrap();
        assert!(load_file(&junk).unwrap_err().to_string().contains("out of range"));
    }

    #[test]
    fn scheduler_uses_classes_when_it_must_go_remote() {
        // NICs on nodes 0, 1 and 2; node 3's buffers: class 1 to node 2, class 2 to node 0,
        // class 3 to node 1.
        let mk = |io: u32, bw: [f64; 4]| {
            let v: Vec<(u32, f64)> = bw.iter().enumerate().map(|(n, &b)| (n as u32, b)).collect();
            IoMeasurement { io_node: io, first_class: Vec::new(), write: v.clone(), read: v }
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
