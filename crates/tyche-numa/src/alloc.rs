//! Node-bound, page-aligned memory: UMEM areas, rings, queues and RAM exports.
//!
//! [`NodeRegion::new`] maps anonymous memory, binds it to one NUMA node with
//! `mbind(MPOL_BIND)` and touches every page, so that the pages exist, on that node, before the
//! region is handed out (the kernel pins UMEM pages when they are registered, so they must be in
//! the right place from the start). [`NodeRegion::page_nodes`] asks the kernel where each page
//! really is (`move_pages(2)` with no target nodes is a pure query).
//!
//! For memory that another library allocates (xsk-rs's `Umem::new`), bind the allocating
//! thread's policy instead with [`bind_thread_memory`] before the call.

use std::io;
use std::ptr::NonNull;

use libc::c_void;

use crate::sys::{self, NodeMask, MPOL_BIND, MPOL_DEFAULT};
use crate::NumaError;
/// The huge page size assumed for `MAP_HUGETLB` without a size flag (x86-64 and arm64 default).
pub const HUGE_PAGE_SIZE: usize = 2 << 20;

/// Whether a region is backed by huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Ordinary pages of the system page size.
    #[default]
    No,
    /// Default-size huge pages (`MAP_HUGETLB`, 2 MiB); the length is rounded up to a multiple
    /// of [`HUGE_PAGE_SIZE`]. Fails with [`NumaError::HugePagesUnavailable`] when the kernel has
    /// none reserved.
    Yes,
}

/// An anonymous memory mapping whose pages are bound to one NUMA node.
///
/// The region owns its mapping: it is unmapped on drop. It starts zeroed, page-aligned, and
/// fully populated on its node.
#[derive(Debug)]
pub struct NodeRegion {
    ptr: NonNull<u8>,
    len: usize,
    node: u32,
    page_size: usize,
}

// SAFETY: the region exclusively owns its mapping (nothing else holds the pointer), so moving it
// to another thread moves that ownership; the kernel mapping is not tied to a thread.
unsafe impl Send for NodeRegion {}
// SAFETY: shared references only give out `&[u8]`; mutation needs `&mut NodeRegion`.
unsafe impl Sync for NodeRegion {}

impl NodeRegion {
    /// Maps `len` bytes (rounded up to whole pages) bound to `node`, and populates them.
    pub fn new(len: usize, node: u32, huge: HugePages) -> Result<Self, NumaError> {
        if len == 0 {
            return Err(NumaError::EmptyRegion);
        }
        let page_size = match huge {
            HugePages::No => system_page_size(),
            HugePages::Yes => HUGE_PAGE_SIZE,
        };
        let len = len.checked_next_multiple_of(page_size).ok_or(NumaError::EmptyRegion)?;
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        if huge == HugePages::Yes {
            flags |= libc::MAP_HUGETLB;
        }
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
        // existing memory; the result is checked against MAP_FAILED before use.
        let addr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
        if addr == libc::MAP_FAILED {
            let source = io::Error::last_os_error();
            return Err(if huge == HugePages::Yes {
                NumaError::HugePagesUnavailable { len, source }
            } else {
                NumaError::Sys { call: "mmap", source }
            });
        }
        let ptr = NonNull::new(addr.cast::<u8>()).expect("mmap never returns NULL on success");
        // From here on, dropping `region` unmaps the memory, including on the error paths.
        let mut region = NodeRegion { ptr, len, node, page_size };
        region.bind(node)?;
        region.populate();
        Ok(region)
    }

    fn bind(&mut self, node: u32) -> Result<(), NumaError> {
        sys::mbind(self.as_mut_slice(), MPOL_BIND, &NodeMask::of(&[node])).map_err(|source| {
            if source.raw_os_error() == Some(libc::EINVAL) {
                NumaError::NoSuchNode(node)
            } else {
                NumaError::Sys { call: "mbind", source }
            }
        })
    }

    /// Faults every page in, so that it is allocated now, under the region's policy.
    fn populate(&mut self) {
        let base = self.ptr.as_ptr();
        for offset in (0..self.len).step_by(self.page_size) {
            // SAFETY: `offset < len`, so the byte is inside this region's writable mapping, and
            // `&mut self` means nobody else accesses it. A volatile write makes sure the page
            // fault happens.
            unsafe { base.add(offset).write_volatile(0) };
        }
    }

    /// The region's length in bytes (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a region has at least one page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The node the region is bound to.
    pub fn node(&self) -> u32 {
        self.node
    }

    /// The size of the pages backing the region.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The start of the region (page-aligned).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The start of the region, for writing (page-aligned).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The region's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes, initialised (anonymous memory is
        // zero-filled), and lives as long as `self`; `&self` rules out a concurrent `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The region's bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Asks the kernel which node each page of the region is on (`move_pages(2)` with no
    /// target nodes only reports). `None` for a page that is not present.
    pub fn page_nodes(&self) -> Result<Vec<Option<u32>>, NumaError> {
        // `i * page_size < len`: every address is inside this region.
        let pages: Vec<usize> =
            (0..self.len / self.page_size).map(|i| self.as_ptr() as usize + i * self.page_size).collect();
        sys::page_nodes(&pages).map_err(|source| NumaError::Sys { call: "move_pages", source })
    }
}

impl Drop for NodeRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `new` with exactly this address and length, is
        // owned by `self`, and no borrow of it can outlive `self`.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
        debug_assert_eq!(rc, 0, "munmap of an owned region failed");
    }
}

/// Binds the memory policy of the calling thread to `node` (`set_mempolicy(MPOL_BIND)`): pages
/// it faults in from now on come from that node. Use it around allocations made by other
/// libraries (xsk-rs `Umem::new`); undo it with [`reset_thread_memory`].
pub fn bind_thread_memory(node: u32) -> Result<(), NumaError> {
    sys::set_thread_policy(MPOL_BIND, Some(&NodeMask::of(&[node]))).map_err(|source| {
        if source.raw_os_error() == Some(libc::EINVAL) {
            NumaError::NoSuchNode(node)
        } else {
            NumaError::Sys { call: "set_mempolicy", source }
        }
    })
}

/// Binds the memory policy of the calling thread to the set `nodes` (`MPOL_BIND`, no
/// `MPOL_F_NUMA_BALANCING`). For a thread that serves several nodes (a network thread with NICs
/// on each): its allocations still come from the nearest node of the set, and automatic NUMA
/// balancing no longer migrates pages *it* touches towards the CPU it happens to run on, so
/// buffers that consumers placed on their node stay there. (The kernel asks the faulting
/// thread's policy whether a page without a VMA policy is misplaced; a bound policy without
/// `MPOL_F_NUMA_BALANCING` says never.)
pub fn bind_thread_memory_to(nodes: &[u32]) -> Result<(), NumaError> {
    if nodes.is_empty() {
        return Err(NumaError::EmptyRegion);
    }
    sys::set_thread_policy(MPOL_BIND, Some(&NodeMask::of(nodes)))
        .map_err(|source| NumaError::Sys { call: "set_mempolicy", source })
}

/// Returns the calling thread to the default memory policy (allocate on the local node).
pub fn reset_thread_memory() -> Result<(), NumaError> {
    sys::set_thread_policy(MPOL_DEFAULT, None).map_err(|source| NumaError::Sys { call: "set_mempolicy", source })
}

/// Runs `f` with the calling thread's memory policy bound to `node` (so pages it faults in,
/// such as a UMEM that another library maps with `MAP_POPULATE`, land there), then restores the
/// policy the thread had. With `node == None`, just runs `f`.
pub fn with_thread_memory_on<R>(node: Option<u32>, f: impl FnOnce() -> R) -> Result<R, NumaError> {
    let Some(node) = node else {
        return Ok(f());
    };
    if node as usize >= sys::MAX_NODES {
        return Err(NumaError::NoSuchNode(node));
    }
    let (old_mode, old_mask) =
        sys::thread_policy().map_err(|source| NumaError::Sys { call: "get_mempolicy", source })?;
    sys::set_thread_policy(MPOL_BIND, Some(&NodeMask::of(&[node])))
        .map_err(|source| NumaError::Sys { call: "set_mempolicy", source })?;
    let r = f();
    let old = if old_mode == MPOL_DEFAULT { None } else { Some(&old_mask) };
    sys::set_thread_policy(old_mode, old).map_err(|source| NumaError::Sys { call: "set_mempolicy", source })?;
    Ok(r)
}

/// The system page size.
pub fn system_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_bound_to_node_zero_reports_node_zero_for_every_page() {
        let page = system_page_size();
        let mut region = NodeRegion::new(64 * page + 1, 0, HugePages::No).expect("bind 65 pages to node 0");
        assert_eq!(region.len(), 65 * page, "length rounds up to whole pages");
        assert_eq!(region.as_ptr() as usize % page, 0, "page-aligned");
        assert!(region.as_slice().iter().all(|&b| b == 0), "starts zeroed");
        region.as_mut_slice().fill(0xa5);
        let nodes = region.page_nodes().expect("move_pages query works here");
        assert_eq!(nodes.len(), 65, "one answer per page");
        for (i, node) in nodes.iter().enumerate() {
            assert_eq!(*node, Some(0), "page {i} of a node-0 region is on node 0");
        }
    }

    #[test]
    fn region_on_a_missing_node_is_an_error() {
        let err = NodeRegion::new(4096, 1000, HugePages::No).expect_err("node 1000 does not exist");
        assert!(matches!(err, NumaError::NoSuchNode(1000) | NumaError::Sys { .. }), "unexpected error {err}");
    }

    #[test]
    fn empty_region_is_refused() {
        let err = NodeRegion::new(0, 0, HugePages::No).expect_err("empty");
        assert!(matches!(err, NumaError::EmptyRegion), "{err}");
    }

    #[test]
    fn huge_pages_either_work_or_say_why() {
        match NodeRegion::new(1, 0, HugePages::Yes) {
            Ok(region) => {
                assert_eq!(region.len(), HUGE_PAGE_SIZE);
                assert_eq!(region.page_nodes().expect("query"), vec![Some(0)]);
            }
            Err(e) => {
                assert!(
                    matches!(e, NumaError::HugePagesUnavailable { .. }),
                    "no huge pages must be reported as such, got {e}"
                );
                assert!(e.to_string().contains("nr_hugepages"), "hint in {e}");
            }
        }
    }

    #[test]
    fn thread_memory_policy_can_be_bound_and_reset() {
        std::thread::spawn(|| {
            bind_thread_memory(0).expect("bind this thread's memory to node 0");
            let v = vec![1u8; 1 << 20];
            assert_eq!(v.iter().map(|&b| b as usize).sum::<usize>(), 1 << 20);
            reset_thread_memory().expect("reset policy");
        })
        .join()
        .expect("thread ran");
    }

    #[test]
    fn a_thread_can_be_bound_to_a_set_of_nodes() {
        std::thread::spawn(|| {
            bind_thread_memory_to(&[0]).expect("bind this thread's memory to {0}");
            let v = vec![1u8; 1 << 20];
            let c = crate::report::count_slice(&v, Some(0)).expect("query");
            assert!(c.all_on_expected(), "{c:?}");
            assert!(bind_thread_memory_to(&[]).is_err(), "an empty set is refused");
            reset_thread_memory().expect("reset policy");
        })
        .join()
        .expect("thread ran");
    }
}
