//! The kernel's NUMA memory calls that nix does not wrap: `mbind(2)`, `set_mempolicy(2)`,
//! `get_mempolicy(2)` and `move_pages(2)`. This is the one place in the workspace that issues
//! them, each behind a safe function; everything else (`tyche-xdp`, `tyched`, `tyche-init`)
//! calls these or the functions of [`crate::alloc`] and [`crate::report`] built on them. CPU
//! affinity goes through nix (`sched_setaffinity`, `sched_getaffinity`; [`crate::placement`]).

use std::io;

use libc::{c_int, c_ulong, c_void};

/// `MPOL_DEFAULT` from `<linux/mempolicy.h>`: allocate on the local node.
pub const MPOL_DEFAULT: c_int = 0;
/// `MPOL_BIND` from `<linux/mempolicy.h>`: allocate only on the nodes of the mask.
pub const MPOL_BIND: c_int = 2;
/// Nodes a mask read back by [`thread_policy`] can hold (as libnuma sizes it).
pub const MAX_NODES: usize = 1024;
/// Pages asked about per `move_pages(2)` call.
const QUERY_BATCH: usize = 4096;

const BITS: usize = c_ulong::BITS as usize;

/// A set of NUMA nodes in the kernel's layout (an array of `unsigned long` bits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMask(Vec<c_ulong>);

impl NodeMask {
    /// The mask holding `nodes` (and room up to the largest).
    pub fn of(nodes: &[u32]) -> NodeMask {
        let max = nodes.iter().copied().max().unwrap_or(0) as usize;
        let mut words = vec![0 as c_ulong; max / BITS + 1];
        for &n in nodes {
            words[n as usize / BITS] |= 1 << (n as usize % BITS);
        }
        NodeMask(words)
    }

    /// Whether `node` is in the set.
    pub fn contains(&self, node: u32) -> bool {
        let n = node as usize;
        self.0.get(n / BITS).is_some_and(|w| w & (1 << (n % BITS)) != 0)
    }

    /// The `maxnode` argument that goes with the mask: the kernel reads `maxnode - 1` bits.
    fn maxnode(&self) -> c_ulong {
        (self.0.len() * BITS + 1) as c_ulong
    }
}

fn check(rc: libc::c_long) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Sets the memory policy of `memory` (which must start on a page boundary; `EINVAL`
/// otherwise) to `mode` over `nodes` (`mbind(2)`, no flags: pages already present stay where
/// they are). The exclusive borrow is what makes this safe: only the caller's own memory's
/// policy changes.
pub fn mbind(memory: &mut [u8], mode: c_int, nodes: &NodeMask) -> io::Result<()> {
    // SAFETY: the range is memory the caller holds exclusively; `nodes` holds `maxnode - 1`
    // bits and outlives the call; mbind with no flags only changes the policy of the range.
    check(unsafe {
        libc::syscall(
            libc::SYS_mbind,
            memory.as_mut_ptr().cast::<c_void>(),
            memory.len() as c_ulong,
            mode,
            nodes.0.as_ptr(),
            nodes.maxnode(),
            0 as c_ulong,
        )
    })
}

/// Sets the calling thread's memory policy (`set_mempolicy(2)`): `mode` over `nodes`, or with
/// `nodes` `None` (as `MPOL_DEFAULT` needs) no mask.
pub fn set_thread_policy(mode: c_int, nodes: Option<&NodeMask>) -> io::Result<()> {
    let (ptr, maxnode) = nodes.map_or((std::ptr::null(), 0), |m| (m.0.as_ptr(), m.maxnode()));
    // SAFETY: `ptr` is null with `maxnode` 0, or a mask of `maxnode - 1` bits that outlives the
    // call; set_mempolicy only changes the calling thread's policy.
    check(unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, ptr, maxnode) })
}

/// The calling thread's memory policy (`get_mempolicy(2)` with no address): its mode and node
/// mask (of [`MAX_NODES`] bits).
pub fn thread_policy() -> io::Result<(c_int, NodeMask)> {
    let mut mode: c_int = 0;
    let mut mask = NodeMask(vec![0; MAX_NODES / BITS]);
    // SAFETY: `mode` and the mask (MAX_NODES bits) are valid for writes; a null `addr` with
    // flags 0 asks for the thread's policy and reads no memory.
    check(unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut c_int,
            mask.0.as_mut_ptr(),
            MAX_NODES as c_ulong,
            std::ptr::null_mut::<c_void>(),
            0 as c_ulong,
        )
    })?;
    Ok((mode, mask))
}

/// The node of the page at each address of `pages` (`None`: not present, or not a mapping of
/// this process): `move_pages(2)` of this process with no target nodes, which only reports.
/// The addresses are looked up, never dereferenced, so any address is safe to ask about.
pub fn page_nodes(pages: &[usize]) -> io::Result<Vec<Option<u32>>> {
    let mut out = Vec::with_capacity(pages.len());
    for batch in pages.chunks(QUERY_BATCH) {
        let addrs: Vec<*const c_void> = batch.iter().map(|&a| a as *const c_void).collect();
        let mut status: Vec<c_int> = vec![0; batch.len()];
        // SAFETY: `addrs` and `status` hold `batch.len()` entries each and outlive the call; a
        // NULL `nodes` array makes move_pages a query that moves nothing and reads no memory at
        // the addresses; pid 0 is this process.
        check(unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0 as libc::pid_t,
                batch.len() as c_ulong,
                addrs.as_ptr(),
                std::ptr::null::<c_int>(),
                status.as_mut_ptr(),
                0 as c_int,
            )
        })?;
        out.extend(status.into_iter().map(|s| u32::try_from(s).ok()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_hold_their_nodes() {
        let m = NodeMask::of(&[0, 3, 64, 130]);
        assert_eq!(m.0.len(), 130 / BITS + 1);
        for n in [0, 3, 64, 130] {
            assert!(m.contains(n), "{n}");
        }
        assert!(!m.contains(1) && !m.contains(129) && !m.contains(5000));
        assert_eq!(m.maxnode(), (m.0.len() * BITS + 1) as c_ulong);
        assert_eq!(NodeMask::of(&[]), NodeMask(vec![0]));
        let one = NodeMask::of(&[0]);
        assert_eq!((one.0.clone(), one.maxnode()), (vec![1], 65));
        let one = NodeMask::of(&[65]);
        assert_eq!((one.0.clone(), one.maxnode()), (vec![0, 2], 129));
    }

    #[test]
    fn page_queries_report_present_and_absent_pages() {
        let page = crate::alloc::system_page_size();
        let present = vec![1u8; 4 * page];
        let addrs: Vec<usize> = (0..3).map(|i| (present.as_ptr() as usize / page + i) * page).collect();
        let nodes = page_nodes(&addrs).expect("move_pages");
        assert_eq!(nodes.len(), 3);
        assert!(nodes.iter().all(Option::is_some), "touched heap pages are present: {nodes:?}");
        // The zero page and an address far outside any mapping are not present, not an error.
        assert_eq!(page_nodes(&[0, usize::MAX & !(page - 1)]).expect("move_pages"), vec![None, None]);
        assert_eq!(page_nodes(&[]).expect("nothing to ask"), vec![]);
    }

    #[test]
    fn thread_policy_round_trips() {
        let (mode, _) = thread_policy().expect("get_mempolicy");
        std::thread::spawn(|| {
            set_thread_policy(MPOL_BIND, Some(&NodeMask::of(&[0]))).expect("bind to node 0");
            let (mode, mask) = thread_policy().expect("get_mempolicy");
            assert_eq!(mode, MPOL_BIND);
            assert!(mask.contains(0) && !mask.contains(1));
            set_thread_policy(MPOL_DEFAULT, None).expect("reset");
            assert_eq!(thread_policy().expect("get_mempolicy").0, MPOL_DEFAULT);
        })
        .join()
        .expect("policy thread");
        assert_eq!(thread_policy().expect("get_mempolicy").0, mode, "other threads keep theirs");
    }
}
