//! The machine as Tyche sees it: NUMA nodes and network interfaces.
//!
//! [`Topology`] is plain data, built once from hwloc (for the running machine, or from an hwloc
//! XML file) and then read by the pure placement and scheduling code. Nothing here keeps an
//! hwloc handle, so the data can be cloned, compared and serialised freely.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{OSDeviceType, ObjectType};
use hwlocality::object::TopologyObject;
use hwlocality::topology::builder::TypeFilter;
use serde::Serialize;

use crate::NumaError;

/// Where the kernel lists network interfaces.
pub const SYSFS_NET: &str = "/sys/class/net";

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Node {
    /// The OS index of the node (the `N` of `/sys/devices/system/node/nodeN`).
    pub id: u32,
    /// OS indexes of the node's processing units (hardware threads), ascending.
    pub cpus: Vec<u32>,
    /// The node's physical cores, each as the OS indexes of its processing units, ordered by
    /// their first processing unit. Every entry of `cpus` is in exactly one core.
    pub cores: Vec<Vec<u32>>,
    /// Memory local to this node, in bytes (0 when hwloc does not know).
    pub memory_bytes: u64,
    /// Relative distance (10 = local) from this node to each node of [`Topology::nodes`], in the
    /// same order; empty when the topology has no distance matrix.
    pub distances: Vec<u64>,
}

/// How the node of a NIC was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NicNodeSource {
    /// hwloc placed the NIC's PCI device under an object of exactly one NUMA node.
    Hwloc,
    /// `/sys/class/net/<if>/device/numa_node` (or its PCI parent) named a node.
    Sysfs,
    /// Nobody knows: sysfs said -1, the interface is virtual, or hwloc attached it to the whole
    /// machine. The NIC's node is `None`.
    Unknown,
}

/// One network interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Nic {
    /// The interface name (`ens1f0`).
    pub name: String,
    /// The NUMA node the NIC hangs off; `None` when unknown (never guessed as node 0).
    pub node: Option<u32>,
    /// How `node` was found.
    pub node_source: NicNodeSource,
}

/// Where a [`Topology`] came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TopologySource {
    /// The running machine: memory and threads can be bound according to it.
    ThisSystem,
    /// An hwloc XML file describing some machine, possibly not this one.
    Xml(PathBuf),
    /// An hwloc XML document given as a string.
    XmlString,
}

/// NUMA nodes and network interfaces of one machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// The NUMA nodes, ascending by id.
    pub nodes: Vec<Node>,
    /// The network interfaces, ascending by name.
    pub nics: Vec<Nic>,
    /// Where this description came from.
    pub source: TopologySource,
}

impl Topology {
    /// Discovers the running machine with hwloc, falling back to sysfs for the node of NICs that
    /// hwloc cannot place, and adding the interfaces that hwloc does not list (virtual ones,
    /// whose node is unknown). The loopback interface is left out.
    pub fn this_system() -> Result<Self, NumaError> {
        let builder = hwlocality::Topology::builder();
        let topo = builder
            .with_io_type_filter(TypeFilter::KeepImportant)
            .map_err(|e| NumaError::Topology(e.to_string()))?
            .build()
            .map_err(|e| NumaError::Topology(e.to_string()))?;
        Ok(Self::from_hwloc(&topo, TopologySource::ThisSystem, Some(Path::new(SYSFS_NET))))
    }

    /// Loads the topology of some machine from an hwloc XML file (as written by
    /// `lstopo-no-graphics --of xml`). Sysfs is not consulted: the file describes another
    /// machine.
    pub fn from_xml_file(path: impl AsRef<Path>) -> Result<Self, NumaError> {
        let path = path.as_ref();
        let topo = hwlocality::Topology::builder()
            .from_xml_file(path)
            .map_err(|e| NumaError::Topology(format!("{}: {e}", path.display())))?
            .with_io_type_filter(TypeFilter::KeepImportant)
            .map_err(|e| NumaError::Topology(e.to_string()))?
            .build()
            .map_err(|e| NumaError::Topology(format!("{}: {e}", path.display())))?;
        Ok(Self::from_hwloc(&topo, TopologySource::Xml(path.to_owned()), None))
    }

    /// Loads the topology of some machine from an hwloc XML document.
    pub fn from_xml_str(xml: &str) -> Result<Self, NumaError> {
        let topo = hwlocality::Topology::builder()
            .from_xml(xml)
            .map_err(|e| NumaError::Topology(e.to_string()))?
            .with_io_type_filter(TypeFilter::KeepImportant)
            .map_err(|e| NumaError::Topology(e.to_string()))?
            .build()
            .map_err(|e| NumaError::Topology(e.to_string()))?;
        Ok(Self::from_hwloc(&topo, TopologySource::XmlString, None))
    }

    /// Converts an hwloc topology. When `sysfs_net` is given (the running machine), NICs that
    /// hwloc cannot place get their node from `<sysfs_net>/<if>/device/numa_node`, and the
    /// interfaces listed there but not by hwloc are added.
    pub fn from_hwloc(topo: &hwlocality::Topology, source: TopologySource, sysfs_net: Option<&Path>) -> Self {
        let mut nodes: BTreeMap<u32, Node> = BTreeMap::new();
        for numa in topo.objects_with_type(ObjectType::NUMANode) {
            let Some(id) = os_index(numa) else { continue };
            let memory_bytes = match numa.attributes() {
                Some(ObjectAttributes::NUMANode(attr)) => attr.local_memory().map_or(0, |m| m.get()),
                _ => 0,
            };
            nodes.insert(id, Node { id, cpus: Vec::new(), cores: Vec::new(), memory_bytes, distances: Vec::new() });
        }

        // Processing units, grouped by node and by core.
        let mut cores: BTreeMap<u32, BTreeMap<(u8, u32), Vec<u32>>> = BTreeMap::new();
        for pu in topo.objects_with_type(ObjectType::PU) {
            let Some(cpu) = os_index(pu) else { continue };
            let node = pu.nodeset().and_then(|set| set.first_set()).map(|i| usize::from(i) as u32);
            let Some(node) = node.filter(|n| nodes.contains_key(n)) else {
                continue;
            };
            // A PU without a Core ancestor is its own core.
            let core_key = ancestor_of_type(pu, ObjectType::Core)
                .map(|core| (0u8, core.logical_index() as u32))
                .unwrap_or((1u8, cpu));
            cores.entry(node).or_default().entry(core_key).or_default().push(cpu);
        }
        for (node, by_core) in cores {
            let entry = nodes.get_mut(&node).expect("node was inserted above");
            let mut node_cores: Vec<Vec<u32>> = by_core
                .into_values()
                .map(|mut pus| {
                    pus.sort_unstable();
                    pus
                })
                .collect();
            node_cores.sort();
            entry.cpus = node_cores.iter().flatten().copied().collect();
            entry.cpus.sort_unstable();
            entry.cores = node_cores;
        }

        let mut nodes: Vec<Node> = nodes.into_values().collect();
        if let Some(matrix) = distance_matrix(topo, &nodes) {
            for (node, row) in nodes.iter_mut().zip(matrix) {
                node.distances = row;
            }
        }

        let mut nics: BTreeMap<String, Nic> = BTreeMap::new();
        for dev in topo.os_devices() {
            let is_net = matches!(
                dev.attributes(),
                Some(ObjectAttributes::OSDevice(attr)) if attr.device_type() == OSDeviceType::Network
            );
            if !is_net {
                continue;
            }
            let Some(name) = dev.name().and_then(|n| n.to_str().ok()) else {
                continue;
            };
            let node = hwloc_nic_node(dev);
            let nic = match (node, sysfs_net) {
                (Some(node), _) => Nic { name: name.to_owned(), node: Some(node), node_source: NicNodeSource::Hwloc },
                (None, Some(root)) => sysfs_nic(root, name),
                (None, None) => Nic { name: name.to_owned(), node: None, node_source: NicNodeSource::Unknown },
            };
            nics.insert(name.to_owned(), nic);
        }
        if let Some(root) = sysfs_net {
            for name in sysfs_interfaces(root) {
                if name != "lo" && !nics.contains_key(&name) {
                    let nic = sysfs_nic(root, &name);
                    nics.insert(name, nic);
                }
            }
        }
        // Only nodes that exist count: a stale sysfs value must not invent a node.
        for nic in nics.values_mut() {
            if let Some(node) = nic.node {
                if !nodes.iter().any(|n| n.id == node) {
                    nic.node = None;
                    nic.node_source = NicNodeSource::Unknown;
                }
            }
        }

        Topology { nodes, nics: nics.into_values().collect(), source }
    }

    /// Whether this topology describes the running machine (so binding by it makes sense).
    pub fn is_this_system(&self) -> bool {
        self.source == TopologySource::ThisSystem
    }

    /// The node with this id.
    pub fn node(&self, id: u32) -> Option<&Node> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The node a CPU belongs to.
    pub fn node_of_cpu(&self, cpu: u32) -> Option<u32> {
        self.nodes.iter().find(|n| n.cpus.contains(&cpu)).map(|n| n.id)
    }

    /// The NIC with this interface name.
    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|n| n.name == name)
    }

    /// The hwloc distance from node `from` to node `to`, when the topology has a matrix.
    pub fn distance(&self, from: u32, to: u32) -> Option<u64> {
        let to_idx = self.nodes.iter().position(|n| n.id == to)?;
        self.node(from)?.distances.get(to_idx).copied()
    }

    /// Total number of processing units.
    pub fn cpu_count(&self) -> usize {
        self.nodes.iter().map(|n| n.cpus.len()).sum()
    }
}

fn os_index(obj: &TopologyObject) -> Option<u32> {
    obj.os_index().and_then(|i| u32::try_from(i).ok())
}

fn ancestor_of_type(obj: &TopologyObject, ty: ObjectType) -> Option<&TopologyObject> {
    let mut cur = obj.parent();
    while let Some(o) = cur {
        if o.object_type() == ty {
            return Some(o);
        }
        cur = o.parent();
    }
    None
}

/// The node of a network OS device according to hwloc: the nodeset of its first non-I/O
/// ancestor, if that is exactly one node and the ancestor is not the machine root (hwloc hangs
/// devices of unknown locality, sysfs `numa_node` = -1, off the root).
fn hwloc_nic_node(dev: &TopologyObject) -> Option<u32> {
    let anc = dev.first_non_io_ancestor()?;
    anc.parent()?;
    let set = anc.nodeset()?;
    if set.weight() != Some(1) {
        return None;
    }
    set.first_set().map(|i| usize::from(i) as u32)
}

/// The distance matrix between NUMA nodes, rows and columns in the order of `nodes`.
fn distance_matrix(topo: &hwlocality::Topology, nodes: &[Node]) -> Option<Vec<Vec<u64>>> {
    let all = topo.distances(None).ok()?;
    for dist in all {
        let ids: Vec<Option<u32>> =
            dist.objects().map(|o| o.filter(|o| o.object_type() == ObjectType::NUMANode).and_then(os_index)).collect();
        if ids.len() != nodes.len() || ids.iter().any(Option::is_none) {
            continue;
        }
        let ids: Vec<u32> = ids.into_iter().flatten().collect();
        // Column/row of each of `nodes` in this matrix.
        let pos: Option<Vec<usize>> = nodes.iter().map(|n| ids.iter().position(|&id| id == n.id)).collect();
        let pos = pos?;
        let values = dist.distances();
        let n = ids.len();
        return Some(pos.iter().map(|&r| pos.iter().map(|&c| values[r * n + c]).collect()).collect());
    }
    None
}

/// The interface names listed under a sysfs `class/net` directory, ascending.
pub fn sysfs_interfaces(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(root)
        .map(|dir| dir.filter_map(Result::ok).filter_map(|e| e.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// The node of an interface according to sysfs: `<root>/<if>/device/numa_node`, or the
/// `numa_node` of the device's parent (a virtio NIC's `device` is the virtio device, whose PCI
/// parent has the attribute). -1, a missing file (virtual interfaces have no `device`) or
/// garbage all mean unknown.
pub fn sysfs_nic(root: &Path, name: &str) -> Nic {
    let device = root.join(name).join("device");
    let mut candidates = vec![device.join("numa_node")];
    if let Ok(real) = fs::canonicalize(&device) {
        if let Some(parent) = real.parent() {
            candidates.push(parent.join("numa_node"));
        }
    }
    for file in candidates {
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        return match parse_numa_node(&text) {
            Some(node) => Nic { name: name.to_owned(), node: Some(node), node_source: NicNodeSource::Sysfs },
            None => Nic { name: name.to_owned(), node: None, node_source: NicNodeSource::Unknown },
        };
    }
    Nic { name: name.to_owned(), node: None, node_source: NicNodeSource::Unknown }
}

/// The NUMA node of network interface `ifname` on the running machine ([`sysfs_nic`] under
/// `/sys/class/net`), or `None` when unknown (veth, loopback, no NUMA information).
pub fn nic_node(ifname: &str) -> Option<u32> {
    sysfs_nic(Path::new("/sys/class/net"), ifname).node
}

/// Parses the content of a sysfs `numa_node` file: a node number, or -1 for "unknown".
pub fn parse_numa_node(text: &str) -> Option<u32> {
    let value: i64 = text.trim().parse().ok()?;
    u32::try_from(value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_interfaces_have_no_node() {
        assert_eq!(nic_node("lo"), None, "loopback has no device node");
        assert_eq!(nic_node("no-such-nic"), None);
    }

    fn fixture(name: &str) -> Topology {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name);
        Topology::from_xml_file(&path).unwrap_or_else(|e| panic!("fixture {} should load: {e}", path.display()))
    }

    #[test]
    fn paper_server_has_two_nodes_and_three_nics_per_node() {
        let t = fixture("paper-2s4c2t-6nic.xml");
        assert!(!t.is_this_system(), "an XML topology is not this system");
        assert_eq!(t.nodes.len(), 2, "two NUMA nodes");
        for node in &t.nodes {
            assert_eq!(node.cpus.len(), 8, "node {} has 4 cores x 2 PUs", node.id);
            assert_eq!(node.cores.len(), 4, "node {} has 4 cores", node.id);
            assert!(node.cores.iter().all(|c| c.len() == 2), "2 PUs per core");
            assert_eq!(node.memory_bytes, 64 << 30, "64 GiB per node");
        }
        assert_eq!(t.nodes[0].cpus, (0..8).collect::<Vec<_>>());
        assert_eq!(t.nodes[1].cpus, (8..16).collect::<Vec<_>>());
        assert_eq!(t.nodes[0].cores[1], vec![2, 3], "siblings share a core");
        assert_eq!(t.nics.len(), 6, "six NICs");
        for (name, node) in [("ens1f0", 0), ("ens1f1", 0), ("ens2f0", 0), ("ens3f0", 1), ("ens3f1", 1), ("ens4f0", 1)] {
            let nic = t.nic(name).unwrap_or_else(|| panic!("{name} is listed"));
            assert_eq!(nic.node, Some(node), "{name} hangs off node {node}");
            assert_eq!(nic.node_source, NicNodeSource::Hwloc);
        }
        assert_eq!(t.distance(0, 1), Some(21), "distance matrix is read");
        assert_eq!(t.distance(1, 1), Some(10));
        assert_eq!(t.node_of_cpu(9), Some(1));
    }

    #[test]
    fn four_node_server_has_nics_on_nodes_zero_and_two() {
        let t = fixture("four-node.xml");
        assert_eq!(t.nodes.len(), 4, "four nodes");
        assert_eq!(t.cpu_count(), 32);
        let on = |node| t.nics.iter().filter(|n| n.node == Some(node)).count();
        assert_eq!((on(0), on(1), on(2), on(3)), (2, 0, 1, 0), "NICs per node");
        assert_eq!(t.distance(0, 1), Some(16));
        assert_eq!(t.distance(0, 2), Some(22));
        assert_eq!(t.distance(3, 2), Some(16));
    }

    #[test]
    fn laptop_has_one_node_and_one_nic() {
        let t = fixture("laptop-1node.xml");
        assert_eq!(t.nodes.len(), 1);
        assert_eq!(t.nodes[0].cpus, vec![0, 1, 2, 3]);
        assert_eq!(t.nodes[0].cores, vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(t.nics.len(), 1);
        assert_eq!(t.nics[0].node, Some(0));
        assert!(t.nodes[0].distances.is_empty(), "the laptop fixture has no matrix");
        assert_eq!(t.distance(0, 0), None);
    }

    #[test]
    fn sysfs_minus_one_is_unknown_not_node_zero() {
        assert_eq!(parse_numa_node("-1\n"), None, "-1 means unknown");
        assert_eq!(parse_numa_node("1\n"), Some(1));
        assert_eq!(parse_numa_node("0"), Some(0));
        assert_eq!(parse_numa_node("garbage"), None);

        let root = std::env::temp_dir().join(format!("tyche-numa-sysfs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        for (name, value) in [("ens1f0", Some("1\n")), ("ens2f0", Some("-1\n")), ("veth0", None)] {
            let dir = root.join(name);
            fs::create_dir_all(&dir).expect("create fake sysfs dir");
            if let Some(value) = value {
                fs::create_dir_all(dir.join("device")).expect("create device dir");
                fs::write(dir.join("device/numa_node"), value).expect("write numa_node");
            }
        }
        assert_eq!(sysfs_interfaces(&root), vec!["ens1f0", "ens2f0", "veth0"]);
        let a = sysfs_nic(&root, "ens1f0");
        assert_eq!((a.node, a.node_source), (Some(1), NicNodeSource::Sysfs));
        let b = sysfs_nic(&root, "ens2f0");
        assert_eq!((b.node, b.node_source), (None, NicNodeSource::Unknown));
        let c = sysfs_nic(&root, "veth0");
        assert_eq!((c.node, c.node_source), (None, NicNodeSource::Unknown));
        fs::remove_dir_all(&root).expect("clean fake sysfs");
    }

    #[test]
    fn this_machine_has_at_least_one_node() {
        let t = Topology::this_system().expect("hwloc discovers this machine");
        assert!(t.is_this_system());
        assert!(!t.nodes.is_empty(), "at least one NUMA node");
        assert!(t.cpu_count() >= 1, "at least one cpu");
        assert!(t.nics.iter().all(|n| n.name != "lo"), "loopback is left out");
        for nic in &t.nics {
            if let Some(node) = nic.node {
                assert!(t.node(node).is_some(), "{} is on an existing node", nic.name);
            }
        }
    }

    #[test]
    fn bad_xml_is_an_error() {
        let err = Topology::from_xml_str("<nonsense/>").expect_err("not a topology");
        assert!(matches!(err, NumaError::Topology(_)), "{err}");
    }
}
