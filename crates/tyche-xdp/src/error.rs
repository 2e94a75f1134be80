use std::io;

/// Everything that can go wrong setting up or running an AF_XDP port.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Placing the UMEM, its rings or the calling thread on the NIC's NUMA node failed.
    #[error("{what}: {source}")]
    Numa {
        /// What was being placed.
        what: String,
        /// What tyche-numa said.
        #[source]
        source: tyche_numa::NumaError,
    },
    /// The network interface does not exist (in this network namespace).
    #[error("no network interface named {0:?}")]
    NoInterface(String),
    /// The interface MTU and the UMEM frame size cannot carry Tyche frames together. Raised at
    /// setup so that frames are never dropped silently for being too long.
    #[error(
        "interface {ifname}: MTU {mtu} needs frames of {needed} bytes but a UMEM chunk holds {per_buffer}: {hint}"
    )]
    FrameSize {
        /// Interface.
        ifname: String,
        /// Its MTU.
        mtu: usize,
        /// Largest frame on the link (MTU plus Ethernet header).
        needed: usize,
        /// Bytes one UMEM chunk holds after the XDP headroom.
        per_buffer: usize,
        /// What to change.
        hint: &'static str,
    },
    /// libbpf failed to open, load, attach or update the XDP program or its maps.
    #[error("{what}: {source}")]
    Bpf {
        /// What was being done.
        what: String,
        /// The libbpf error.
        #[source]
        source: libbpf_rs::Error,
    },
    /// The XDP program could not be attached in any allowed mode.
    #[error("attaching XDP to {ifname} failed in every allowed mode: {detail}")]
    Attach {
        /// Interface.
        ifname: String,
        /// The errors, mode by mode.
        detail: String,
    },
    /// Another (not Tyche's) XDP program is attached to the interface: Tyche never replaces it.
    #[error(
        "{ifname} carries a foreign XDP program (id {id}, name {name:?}); Tyche does not replace it: \
         remove it (ip link set dev {ifname} xdp off) or use another interface"
    )]
    ForeignProgram {
        /// Interface.
        ifname: String,
        /// The program's id (`bpftool prog show id ID`).
        id: u32,
        /// Its name as the kernel keeps it.
        name: String,
    },
    /// The Tyche program another live process attached does not fit this port, and is left
    /// as it is.
    #[error("{ifname}: the Tyche XDP program (id {id}) another Tyche process uses does not fit: {detail}")]
    Incompatible {
        /// Interface.
        ifname: String,
        /// The program's id.
        id: u32,
        /// What does not fit.
        detail: String,
    },
    /// Another live Tyche process holds this NIC queue (one AF_XDP socket per queue).
    #[error("{ifname} queue {queue} is served by another Tyche process ({}); one process per NIC queue", match pid { Some(p) => format!("pid {p}"), None => "pid unknown".to_string() })]
    QueueBusy {
        /// Interface.
        ifname: String,
        /// The queue.
        queue: u32,
        /// The process holding it, if its lock file says.
        pid: Option<u32>,
    },
    /// xsk-rs could not create the UMEM or the socket.
    #[error("{what}: {detail}")]
    Xsk {
        /// What was being done.
        what: String,
        /// xsk-rs's error, rendered.
        detail: String,
    },
}

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }
    pub(crate) fn numa(what: impl Into<String>, source: tyche_numa::NumaError) -> Self {
        Error::Numa { what: what.into(), source }
    }
    pub(crate) fn bpf(what: impl Into<String>, source: libbpf_rs::Error) -> Self {
        Error::Bpf { what: what.into(), source }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Io { source, .. } => source,
            other => io::Error::other(other),
        }
    }
}
