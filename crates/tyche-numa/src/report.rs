//! Where things really are: page-by-page location of memory areas (`move_pages(2)`) and the
//! CPU affinity of the calling thread, in a form the daemons put in their stats.
//!
//! These are measurements, not plans: [`count_area`] asks the kernel for the node of every page
//! of an address range, and [`this_thread`] asks for the calling thread's affinity. A daemon
//! calls [`this_thread`] *on the thread that serves a channel*, so the answer is that thread's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::alloc::system_page_size;
use crate::placement::current_thread_cpus;
use crate::NumaError;

/// Where the pages of some memory are, against the node they should be on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageCounts {
    /// The node the memory should be on (`None`: no particular node).
    pub expected_node: Option<u32>,
    /// Bytes of memory asked about.
    pub bytes: u64,
    /// Pages asked about.
    pub pages: u64,
    /// Pages on `expected_node` (0 when no node is expected).
    pub on_expected: u64,
    /// Pages present on another node (every present page when no node is expected).
    pub elsewhere: u64,
    /// Pages not present (never touched, or not backed by ordinary pages).
    pub not_present: u64,
    /// Present pages per node.
    pub by_node: BTreeMap<u32, u64>,
}

impl PageCounts {
    /// Counts the answers of a page query against `expected`.
    pub fn of_nodes(nodes: &[Option<u32>], expected: Option<u32>, bytes: u64) -> PageCounts {
        let mut c = PageCounts { expected_node: expected, bytes, pages: nodes.len() as u64, ..PageCounts::default() };
        for n in nodes {
            match n {
                None => c.not_present += 1,
                Some(n) => {
                    *c.by_node.entry(*n).or_default() += 1;
                    if Some(*n) == expected {
                        c.on_expected += 1;
                    } else {
                        c.elsewhere += 1;
                    }
                }
            }
        }
        c
    }

    /// Adds the counts of `other` (which must expect the same node).
    pub fn add(&mut self, other: &PageCounts) {
        debug_assert!(self.pages == 0 || self.expected_node == other.expected_node);
        if self.pages == 0 {
            self.expected_node = other.expected_node;
        }
        self.bytes += other.bytes;
        self.pages += other.pages;
        self.on_expected += other.on_expected;
        self.elsewhere += other.elsewhere;
        self.not_present += other.not_present;
        for (n, v) in &other.by_node {
            *self.by_node.entry(*n).or_default() += v;
        }
    }

    /// Whether there are pages and every one of them is on the expected node.
    pub fn all_on_expected(&self) -> bool {
        self.expected_node.is_some() && self.pages > 0 && self.on_expected == self.pages
    }
}

/// Asks the kernel which node each page overlapping `[addr, addr + len)` is on (`None`: not
/// present). The addresses are only looked up, never dereferenced: any range is safe to ask
/// about, and pages outside this process's mappings come back as not present.
pub fn area_page_nodes(addr: usize, len: usize) -> Result<Vec<Option<u32>>, NumaError> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let page = system_page_size();
    let first = addr / page;
    let last = (addr + len - 1) / page;
    let all: Vec<usize> = (first..=last).map(|p| p * page).collect();
    crate::sys::page_nodes(&all).map_err(|source| NumaError::Sys { call: "move_pages", source })
}

/// [`area_page_nodes`] counted against `expected`.
pub fn count_area(addr: usize, len: usize, expected: Option<u32>) -> Result<PageCounts, NumaError> {
    Ok(PageCounts::of_nodes(&area_page_nodes(addr, len)?, expected, len as u64))
}

/// [`count_area`] for a slice.
pub fn count_slice(bytes: &[u8], expected: Option<u32>) -> Result<PageCounts, NumaError> {
    count_area(bytes.as_ptr() as usize, bytes.len(), expected)
}

/// The node that holds most of the pages of `bytes` (ties: the lowest node), or `None` when no
/// page is present.
pub fn majority_node(bytes: &[u8]) -> Option<u32> {
    let c = count_slice(bytes, None).ok()?;
    c.by_node.iter().max_by_key(|(n, v)| (**v, std::cmp::Reverse(**n))).map(|(n, _)| *n)
}

/// A thread and the CPUs it may run on, as the thread itself sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadPlacement {
    /// Thread name (`/proc/thread-self/comm`).
    pub name: String,
    /// Kernel thread id.
    pub tid: u32,
    /// CPUs of its affinity mask (`sched_getaffinity`).
    pub cpus: Vec<u32>,
    /// NUMA nodes those CPUs belong to (from sysfs; empty when unknown).
    pub nodes: Vec<u32>,
}

/// The calling thread's placement. Call it on the thread in question.
pub fn this_thread() -> ThreadPlacement {
    let name = std::fs::read_to_string("/proc/thread-self/comm").map(|s| s.trim().to_owned()).unwrap_or_default();
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
    let cpus = current_thread_cpus().unwrap_or_default();
    let nodes = nodes_of_cpus(&cpus);
    ThreadPlacement { name, tid, cpus, nodes }
}

/// The NUMA nodes (from `/sys/devices/system/node`) that own any of `cpus`.
pub fn nodes_of_cpus(cpus: &[u32]) -> Vec<u32> {
    let mut nodes: Vec<u32> = node_cpus_from_sysfs()
        .into_iter()
        .filter(|(_, list)| list.iter().any(|c| cpus.contains(c)))
        .map(|(n, _)| n)
        .collect();
    nodes.sort_unstable();
    nodes
}

pub use crate::placement::SYSFS_NODES;

/// Every node in sysfs with its CPU list.
pub fn node_cpus_from_sysfs() -> Vec<(u32, Vec<u32>)> {
    let Ok(dir) = std::fs::read_dir(SYSFS_NODES) else { return Vec::new() };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str().and_then(|s| s.strip_prefix("node")).and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let list = std::fs::read_to_string(e.path().join("cpulist")).unwrap_or_default();
        out.push((n, crate::parse_cpu_list(list.trim()).unwrap_or_default()));
    }
    out.sort_unstable_by_key(|(n, _)| *n);
    out
}

/// A NIC's interrupts as the daemons' stats show them: which IRQs, where they land, and how
/// many land on the core of the NIC's network thread (Hanford et al.: the worst place).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct IrqReport {
    /// Interface name.
    pub nic: String,
    /// A virtual NIC (veth, bridge): no IRQs.
    pub virtual_nic: bool,
    /// Its IRQs and their CPUs.
    pub irqs: Vec<crate::irq::IrqAffinity>,
    /// The CPUs its network thread may run on (as that thread reported itself).
    pub network_cpus: Vec<u32>,
    /// IRQs whose CPUs share a physical core with the network thread's CPUs.
    pub sharing_network_core: u64,
    /// Why the IRQs could not be read (empty when they were).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub error: String,
}

impl IrqReport {
    /// Reads `nic`'s interrupts under `roots` and compares them with `network_cpus`; cores come
    /// from `topo` (without one, only equal CPUs count as the same core). A read error is kept
    /// in `error`, not returned: the stats still show the rest.
    pub fn read(roots: &crate::irq::Roots, nic: &str, topo: Option<&crate::Topology>, network_cpus: &[u32]) -> Self {
        let mut r = IrqReport { nic: nic.to_owned(), network_cpus: network_cpus.to_vec(), ..IrqReport::default() };
        match crate::irq::nic_irqs(roots, nic) {
            Ok(n) => {
                r.virtual_nic = n.virtual_nic;
                r.irqs = n.irqs;
            }
            Err(e) => r.error = e.to_string(),
        }
        let shares = |cpus: &[u32]| match topo {
            Some(t) => crate::irq::share_a_core(t, network_cpus, cpus),
            None => cpus.iter().any(|c| network_cpus.contains(c)),
        };
        r.sharing_network_core = r.irqs.iter().filter(|i| shares(i.cpus())).count() as u64;
        r
    }

    /// One line: `none (virtual NIC)`, `unreadable: ...`, or the IRQs and their CPUs.
    pub fn describe(&self) -> String {
        if !self.error.is_empty() {
            return format!("unreadable: {}", self.error);
        }
        let n = crate::irq::NicIrqs { nic: self.nic.clone(), virtual_nic: self.virtual_nic, irqs: self.irqs.clone() };
        let mut s = n.describe();
        if self.sharing_network_core > 0 {
            s.push_str(&format!(
                "; {} on the network thread's core (cpus {})",
                self.sharing_network_core,
                crate::format_cpu_list(&self.network_cpus)
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HugePages, NodeRegion};

    #[test]
    fn irq_report_of_a_virtual_and_a_missing_nic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let roots = crate::irq::Roots { sys: dir.path().join("sys"), proc: dir.path().join("proc") };
        std::fs::create_dir_all(roots.sys.join("class/net/veth0")).unwrap();
        let r = IrqReport::read(&roots, "veth0", None, &[1]);
        assert!(r.virtual_nic && r.error.is_empty());
        assert_eq!(r.describe(), "none (virtual NIC)");
        let r = IrqReport::read(&roots, "gone0", None, &[1]);
        assert!(r.describe().starts_with("unreadable: no network interface"), "{}", r.describe());
        // Shared core: IRQ 5 on CPU 1, the network thread on CPU 1.
        std::fs::create_dir_all(roots.sys.join("class/net/eth9/device/msi_irqs/5")).unwrap();
        std::fs::create_dir_all(roots.proc.join("irq/5")).unwrap();
        std::fs::write(roots.proc.join("irq/5/smp_affinity_list"), "1\n").unwrap();
        let r = IrqReport::read(&roots, "eth9", None, &[1]);
        assert_eq!(r.sharing_network_core, 1);
        assert_eq!(r.describe(), "5 -> 1; 1 on the network thread's core (cpus 1)");
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<IrqReport>(&json).unwrap(), r);
    }

    #[test]
    fn counts_against_the_expected_node() {
        let c = PageCounts::of_nodes(&[Some(1), Some(1), Some(0), None], Some(1), 16384);
        assert_eq!((c.pages, c.on_expected, c.elsewhere, c.not_present), (4, 2, 1, 1));
        assert_eq!(c.by_node, BTreeMap::from([(0, 1), (1, 2)]));
        assert!(!c.all_on_expected());
        let none = PageCounts::of_nodes(&[Some(0), Some(0)], None, 8192);
        assert_eq!((none.on_expected, none.elsewhere), (0, 2), "no node expected: present pages are elsewhere");
        assert!(!none.all_on_expected());
        let mut sum = PageCounts::default();
        sum.add(&PageCounts::of_nodes(&[Some(1)], Some(1), 4096));
        sum.add(&PageCounts::of_nodes(&[Some(1), Some(1)], Some(1), 8192));
        assert_eq!((sum.pages, sum.on_expected, sum.bytes), (3, 3, 12288));
        assert!(sum.all_on_expected());
    }

    #[test]
    fn a_node_zero_region_counts_on_node_zero_page_by_page() {
        let page = system_page_size();
        let r = NodeRegion::new(33 * page, 0, HugePages::No).expect("region on node 0");
        let c = count_slice(r.as_slice(), Some(0)).expect("query");
        assert_eq!(c.pages, 33);
        assert!(c.all_on_expected(), "{c:?}");
        // An unaligned sub-range covers the pages it overlaps.
        let c = count_area(r.as_ptr() as usize + 100, page, Some(0)).expect("query");
        assert_eq!(c.pages, 2);
        assert_eq!(majority_node(r.as_slice()), Some(0));
    }

    #[test]
    fn untouched_and_unmapped_pages_are_not_present() {
        let v: Vec<u8> = Vec::with_capacity(1 << 24);
        // A fresh 16 MiB allocation is an untouched mapping: nothing is present yet.
        let c = count_area(v.as_ptr() as usize, 1 << 24, Some(0)).expect("query");
        assert!(c.not_present > c.pages / 2, "{c:?}");
        let c = count_area(4096, 4096, Some(0)).expect("query of an unmapped page");
        assert_eq!((c.pages, c.not_present), (1, 1));
        assert_eq!(count_area(0, 0, None).expect("empty").pages, 0);
    }

    #[test]
    fn this_thread_reports_its_own_affinity() {
        let cpus = current_thread_cpus().expect("affinity");
        let one = cpus[0];
        let t = std::thread::Builder::new()
            .name("numa-probe".into())
            .spawn(move || {
                crate::pin_current_thread(&[one]).expect("pin");
                this_thread()
            })
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(t.name, "numa-probe");
        assert_eq!(t.cpus, vec![one]);
        assert!(t.tid > 0);
        if std::path::Path::new("/sys/devices/system/node/node0").exists() {
            assert_eq!(t.nodes.len(), 1, "one cpu is on one node: {t:?}");
        }
    }
}
