use std::io;

/// Everything that can fail in `tyche-numa`.
#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    /// hwloc could not load, filter or build the topology.
    #[error("hwloc topology: {0}")]
    Topology(String),
    /// A NUMA node that the topology does not have.
    #[error("NUMA node {0} does not exist")]
    NoSuchNode(u32),
    /// A CPU that cannot be put in an affinity mask.
    #[error("cpu {0} is out of range for an affinity mask")]
    InvalidCpu(u32),
    /// An empty CPU list was given to pin a thread to.
    #[error("no cpu to pin the thread to")]
    NoCpus,
    /// A region length of zero.
    #[error("a node-bound region cannot be empty")]
    EmptyRegion,
    /// Huge pages were asked for, but the kernel has none free for this size.
    #[error(
        "no huge pages available for {len} bytes ({source}); reserve some with \
         `echo N > /proc/sys/vm/nr_hugepages` or allocate without huge pages"
    )]
    HugePagesUnavailable {
        /// The requested length in bytes.
        len: usize,
        /// What mmap said.
        source: io::Error,
    },
    /// A system call failed.
    #[error("{call} failed: {source}")]
    Sys {
        /// The system call.
        call: &'static str,
        /// The error it returned.
        source: io::Error,
    },
    /// The operation needs the topology of the running machine, not one loaded from XML.
    #[error("{0} needs the topology of this machine, not one loaded from an XML file")]
    NotThisSystem(&'static str),
    /// A measurement thread of the bandwidth model panicked.
    #[error("a bandwidth measurement thread panicked")]
    MeasurementPanicked,
}
