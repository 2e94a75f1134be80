//! NUMA topology and placement for Tyche's target and initiator.
//!
//! Tyche places its work by *channel*: each channel belongs to one NIC, and its memory (UMEM,
//! rings, queues) and its network thread live on that NIC's NUMA node. This crate provides:
//!
//! - [`topology`]: a plain data model of the machine (NUMA nodes with their CPUs, cores, memory
//!   and distances; network interfaces with the node they hang off), built from hwloc for the
//!   running machine or from an hwloc XML file for machines we do not have.
//! - [`alloc`]: node-bound, page-aligned memory regions ([`NodeRegion`]) with optional huge pages
//!   and a way to ask the kernel where the pages really are.
//! - [`placement`]: a pure plan that puts each channel's network thread on a core of its NIC's
//!   node, off the cores of its consumers, and one completion worker per remaining core; plus
//!   [`pin_current_thread`] to apply it.
//! - [`scheduler`]: the affinity-aware channel scheduler (equal bytes per channel on the
//!   buffer's node, nearest node when those are down or full) and the round-robin baseline.
//! - [`model`]: the I/O bandwidth model (node-bound copy tests grouped into bandwidth classes).
//! - [`report`]: where memory really is (page by page, `move_pages(2)`) and where a thread may
//!   run, for the daemons' stats.
//! - [`sys`]: the memory-policy system calls nix does not wrap (`mbind`, `set_mempolicy`,
//!   `get_mempolicy`, `move_pages`), behind safe functions; the workspace's only copy of them.
//!
//! # Promises
//! - Everything except [`Topology::this_system`], [`alloc`], [`pin_current_thread`] and
//!   [`model::measure`] is a pure, deterministic function of its inputs: placement and
//!   scheduling decisions are tested on XML topologies of machines we do not have.
//! - A NIC whose node is unknown (sysfs `numa_node` is -1, a virtual interface, or hwloc attached
//!   it to the whole machine) has node `None`; it is never silently treated as node 0.
//! - [`NodeRegion`] owns its mapping and unmaps it on drop; the only `unsafe` code is the
//!   system calls in [`sys`] and the mapping in [`alloc`], each justified in place (affinity
//!   goes through nix).

pub mod alloc;
pub use tyche_cpulist as cpulist;
mod error;
pub mod irq;
pub mod model;
pub mod placement;
pub mod report;
pub mod scheduler;
pub mod sys;
pub mod topology;

pub use alloc::{HugePages, NodeRegion};
pub use cpulist::{format_cpu_list, parse_cpu_list};
pub use error::NumaError;
pub use model::{BandwidthModel, IoMeasurement, ModelConfig, ModelFileError};
pub use placement::{
    current_thread_cpus, node_cpus, pin_current_thread, pin_current_thread_to_node, ChannelSpec, PlacementRequest, Plan,
};
pub use report::{IrqReport, PageCounts, ThreadPlacement};
pub use scheduler::{ChannelId, ChannelScheduler, NodeOrder, Policy, IDLE_RUN_BYTES};
pub use topology::{nic_node, Nic, NicNodeSource, Node, Topology, TopologySource};
