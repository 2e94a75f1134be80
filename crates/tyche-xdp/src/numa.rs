//! The NUMA seam: which node a NIC sits on, and placing UMEM memory and threads there.
//!
//! The port code only calls these three functions; the memory policy and affinity calls are
//! `tyche-numa`'s (its `sys` module holds the workspace's only copies of the system calls).
//!
//! Today the node comes from sysfs (`/sys/class/net/<if>/device/numa_node`). A missing file (a
//! virtual device such as veth) or `-1` (a machine without NUMA information) means "unknown",
//! and nothing is bound.

use std::io;

/// The NUMA node of network interface `ifname`, or `None` when unknown: the `numa_node` of its
/// device, else of the device's parent (a virtio NIC's `device` is the virtio device, whose PCI
/// parent has the node), as `tyche-numa`'s topology reads it.
pub fn nic_node(ifname: &str) -> Option<u32> {
    let read = |p: &std::path::Path| -> Option<u32> {
        let text = std::fs::read_to_string(p.join("numa_node")).ok()?;
        let node: i64 = text.trim().parse().ok()?;
        u32::try_from(node).ok()
    };
    let dev = std::fs::canonicalize(format!("/sys/class/net/{ifname}/device")).ok()?;
    read(&dev).or_else(|| read(dev.parent()?))
}

/// Runs `f` with the calling thread's memory policy bound to `node` (so pages it faults in,
/// such as a UMEM mapped with `MAP_POPULATE`, land there), then restores the previous policy.
/// With `node == None`, just runs `f`. (`tyche_numa::alloc::with_thread_memory_on`.)
pub fn with_memory_on<R>(node: Option<u32>, f: impl FnOnce() -> R) -> io::Result<R> {
    tyche_numa::alloc::with_thread_memory_on(node, f).map_err(numa_error)
}

/// Pins the calling thread to the CPUs of `node` (from
/// `/sys/devices/system/node/node<N>/cpulist`), so the thread serving a NIC queue runs beside
/// the NIC and its UMEM (`tyche_numa::pin_current_thread`).
pub fn pin_current_thread_to_node(node: u32) -> io::Result<()> {
    let list = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist"))?;
    let cpus = tyche_numa::parse_cpu_list(list.trim()).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    tyche_numa::pin_current_thread(&cpus).map_err(numa_error)
}

fn numa_error(e: tyche_numa::NumaError) -> io::Error {
    match e {
        tyche_numa::NumaError::Sys { source, .. } => source,
        tyche_numa::NumaError::NoSuchNode(_) => io::Error::new(io::ErrorKind::InvalidInput, e.to_string()),
        other => io::Error::other(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_interfaces_have_no_node() {
        assert_eq!(nic_node("lo"), None, "loopback has no device node");
        assert_eq!(nic_node("no-such-nic"), None);
    }

    #[test]
    fn memory_policy_is_restored() {
        use tyche_numa::sys::{thread_policy, MPOL_BIND};
        let before = thread_policy().expect("get_mempolicy").0;
        let inside = with_memory_on(Some(0), || thread_policy().expect("get_mempolicy").0).expect("bind to node 0");
        assert_eq!(inside, MPOL_BIND, "policy bound inside");
        assert_eq!(thread_policy().expect("get_mempolicy").0, before, "policy restored");
    }
}
