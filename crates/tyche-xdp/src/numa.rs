//! The NUMA seam: which node a NIC sits on, and placing UMEM memory and threads there.
//!
//! This is deliberately small so that it can later take its answers from the `tyche-numa`
//! topology crate: replace [`nic_node`] with a lookup in that crate's topology and
//! [`with_memory_on`] / [`pin_current_thread_to_node`] with its binding calls; the port code
//! only calls these three functions.
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

const MPOL_DEFAULT: libc::c_int = 0;
const MPOL_BIND: libc::c_int = 2;
/// Bits in the node masks passed to the kernel (1024 nodes, as libnuma uses).
const MAX_NODES: usize = 1024;
const MASK_WORDS: usize = MAX_NODES / 64;

fn get_mempolicy() -> io::Result<(libc::c_int, [u64; MASK_WORDS])> {
    let mut mode: libc::c_int = 0;
    let mut mask = [0u64; MASK_WORDS];
    // SAFETY: `mode` and `mask` are valid for writes; `maxnode` is the mask's size in bits; a
    // null `addr` with flags 0 asks for the thread's policy.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            MAX_NODES as libc::c_ulong,
            std::ptr::null_mut::<libc::c_void>(),
            0 as libc::c_ulong,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((mode, mask))
}

fn set_mempolicy(mode: libc::c_int, mask: Option<&[u64; MASK_WORDS]>) -> io::Result<()> {
    let ptr = mask.map_or(std::ptr::null(), |m| m.as_ptr());
    let maxnode = if mask.is_some() { MAX_NODES + 1 } else { 0 };
    // SAFETY: `ptr` is null or points to a mask of MAX_NODES bits that outlives the call.
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, ptr, maxnode as libc::c_ulong) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` with the calling thread's memory policy bound to `node` (so pages it faults in,
/// such as a UMEM mapped with `MAP_POPULATE`, land there), then restores the previous policy.
/// With `node == None`, just runs `f`.
pub fn with_memory_on<R>(node: Option<u32>, f: impl FnOnce() -> R) -> io::Result<R> {
    let Some(node) = node else {
        return Ok(f());
    };
    let node = node as usize;
    if node >= MAX_NODES {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("NUMA node {node} out of range")));
    }
    let (old_mode, old_mask) = get_mempolicy()?;
    let mut mask = [0u64; MASK_WORDS];
    mask[node / 64] |= 1 << (node % 64);
    set_mempolicy(MPOL_BIND, Some(&mask))?;
    let r = f();
    let restore = if old_mode == MPOL_DEFAULT {
        set_mempolicy(MPOL_DEFAULT, None)
    } else {
        set_mempolicy(old_mode, Some(&old_mask))
    };
    restore?;
    Ok(r)
}

/// Pins the calling thread to the CPUs of `node` (from
/// `/sys/devices/system/node/node<N>/cpulist`), so the thread serving a NIC queue runs beside
/// the NIC and its UMEM.
pub fn pin_current_thread_to_node(node: u32) -> io::Result<()> {
    let list = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist"))?;
    let cpus: Vec<usize> = tyche_numa::parse_cpu_list(list.trim())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?
        .into_iter()
        .map(|c| c as usize)
        .collect();
    // SAFETY: `cpu_set_t` is plain old data; all-zero is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in cpus {
        // SAFETY: CPU_SET only writes inside `set`; cpu indices beyond it are ignored by libc.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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
        let before = get_mempolicy().expect("get_mempolicy").0;
        let inside = with_memory_on(Some(0), || get_mempolicy().expect("get_mempolicy").0).expect("bind to node 0");
        assert_eq!(inside, MPOL_BIND, "policy bound inside");
        assert_eq!(get_mempolicy().expect("get_mempolicy").0, before, "policy restored");
    }
}
