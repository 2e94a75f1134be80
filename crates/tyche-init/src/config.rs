use std::fmt;
use std::time::Duration;

use tyche_channel::Timers;
use tyche_transport::FrameTransport;
use tyche_wire::{MacAddr, DEFAULT_ETHERTYPE};

/// One NIC's way to the target: a transport and the target's MAC address on that link.
pub struct Link {
    /// Name for logs (the interface name, `mem0`, ...).
    pub name: String,
    /// The transport (AF_XDP socket, TCP baseline, in-memory port).
    pub transport: Box<dyn FrameTransport + Send>,
    /// The target's MAC on this link.
    pub target: MacAddr,
    /// NUMA node of the NIC, if known.
    pub node: Option<u32>,
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("name", &self.name)
            .field("local", &self.transport.capabilities().local_mac)
            .field("target", &self.target)
            .field("node", &self.node)
            .finish()
    }
}

/// Which channel each request part goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SchedulerKind {
    /// Channels on the node of the request's buffers, equal bytes each, any channel as fallback.
    #[default]
    Affinity,
    /// Every live channel in turn (the papers' baseline).
    #[value(alias = "rr")]
    RoundRobin,
}

impl fmt::Display for SchedulerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SchedulerKind::Affinity => "affinity",
            SchedulerKind::RoundRobin => "round-robin",
        })
    }
}

/// How requests reach the channels: the two send modes of the Tyche papers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SendMode {
    /// The thread that has the request submits it and sends its frames itself: a [`Client`]
    /// caller (and so a ublk queue thread) takes the session's lock, submits into the volume
    /// and transmits on the links' transports; an NBD connection's engine thread reads the
    /// socket and sends. No hand-off, no wake-up.
    ///
    /// [`Client`]: crate::Client
    #[default]
    Inline,
    /// The thread that has the request queues it and another thread sends: [`Client`] requests
    /// go through a per-node queue drained in batches by a submitter thread, and an NBD
    /// connection's reader thread hands parsed requests to the engine thread over a bounded
    /// queue with a doorbell.
    ///
    /// [`Client`]: crate::Client
    Queue,
}

impl fmt::Display for SendMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SendMode::Inline => "inline",
            SendMode::Queue => "queue",
        })
    }
}

/// How many engine threads serve the links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EngineThreads {
    /// One engine thread per NUMA node of the links' NICs, pinned to that node's CPUs, each
    /// serving the links on its node (one thread when every link is on one node or none is
    /// known). Each thread owns its part of the session's volume (its links' channels and the
    /// requests submitted to it), as each of tyched's per-NIC network threads owns its channels:
    /// no lock another engine thread takes on its frame path.
    #[default]
    PerNode,
    /// One engine thread for every link (unpinned when the links span several nodes).
    One,
}

impl fmt::Display for EngineThreads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineThreads::PerNode => "per-node",
            EngineThreads::One => "one",
        })
    }
}

/// Settings of an initiator session.
#[derive(Debug, Clone)]
pub struct InitiatorConfig {
    /// Export to attach.
    pub export: String,
    /// Channels opened on every link.
    pub channels_per_link: usize,
    /// How long requests wait while no channel is alive before failing with an I/O error
    /// (NVMe's `ctrl_loss_tmo`).
    pub no_path_timeout: Duration,
    /// The longest a request waits for a path, from its submission (`--io-timeout`): then it
    /// fails with an I/O error, the device staying attached. For RAID members (md's failfast).
    /// `None`: only `no_path_timeout` applies.
    pub io_timeout: Option<Duration>,
    /// Interval between CONNECT retransmissions.
    pub connect_retry: Duration,
    /// CONNECTs sent per connection attempt before it times out.
    pub connect_attempts: u32,
    /// Failed reconnection attempts on a channel that are logged as warnings; later ones are
    /// logged at debug level. Reconnection itself never gives up while the process runs (a
    /// link that comes back after any time is used again).
    pub reconnect_warnings: u32,
    /// Wait before reconnecting a dead channel (none after the target's DISCONNECT SHUTDOWN),
    /// and after a failed attempt; it doubles with each failure in a row, up to
    /// `reconnect_max_delay`.
    pub reconnect_delay: Duration,
    /// Longest wait between reconnection attempts.
    pub reconnect_max_delay: Duration,
    /// Channel timers.
    pub timers: Timers,
    /// Largest request part asked for (the target may grant less).
    pub max_io: u32,
    /// Ring positions asked for, per direction.
    pub ring: u16,
    /// `remq`/`damq` slots asked for per channel.
    pub slots: u16,
    /// Requests outstanding in the engine at once; more wait in its backlog.
    pub max_requests: usize,
    /// Channel scheduler.
    pub scheduler: SchedulerKind,
    /// Where the affinity scheduler falls back when a buffer's node has no usable channel
    /// (the scheduler's fallback order: bandwidth classes, else distances); `None`: by node id.
    pub node_order: Option<tyche_numa::NodeOrder>,
    /// Send mode.
    pub send_mode: SendMode,
    /// Engine threads: one per NUMA node of the links (default) or one for all.
    pub engine_threads: EngineThreads,
    /// Placement experiments only (the NESUS paper's misplaced threads): every engine thread
    /// pinned to this NUMA node's CPUs instead of its links' node. `None`: the links' node.
    pub engine_thread_node: Option<u32>,
    /// How engine threads wait between turns that found nothing (adaptive polling by default).
    pub poll: tyche_runtime::poll::PollConfig,
    /// EtherType.
    pub ethertype: u16,
    /// The export's pre-shared key, for exports that need one (CHALLENGE and proofs).
    pub key: Option<tyche_channel::auth::Psk>,
    /// This host's stable id, sent in CONNECT: the target lets one host at a time attach an
    /// export that is not shared, and fences the old session when the same host attaches again
    /// (after a crash). Default: `/etc/machine-id`, where readable; else the target knows this
    /// initiator by its MAC.
    pub host_id: Option<[u8; 16]>,
    /// Ask for feature DIGEST: a CRC32C of every DATA payload, checked by the receiver (a
    /// corrupted one is sent again). Of no use on a keyed export, whose frames are sealed.
    pub digest: bool,
    /// What an earlier process serving the same device owed about the writes it completed
    /// (`tyche-init attach --recover` reads it from the dead process's attachment record):
    /// the session's volume takes it over (`Volume::inherit_debt`), so a FLUSH reports writes
    /// the target lost while no process served the device. `Clear` for a new device.
    pub prior_writes: tyche_channel::DurabilityDebt,
}

/// Parses a host id: 32 hexadecimal digits (the form of `/etc/machine-id`).
pub fn parse_host_id(s: &str) -> Result<[u8; 16], String> {
    let s = s.trim();
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("a host id is 32 hexadecimal digits, not {s:?}"));
    }
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok(id)
}

/// This machine's id (`/etc/machine-id`), if it has a readable one.
pub fn machine_id() -> Option<[u8; 16]> {
    parse_host_id(&std::fs::read_to_string("/etc/machine-id").ok()?).ok()
}

impl InitiatorConfig {
    /// Defaults for `export`: one channel per link, 30 s no-path timeout, reconnection backoff
    /// from 50 ms doubling to 2 s.
    pub fn new(export: &str) -> Self {
        InitiatorConfig {
            export: export.to_owned(),
            channels_per_link: 1,
            no_path_timeout: Duration::from_secs(30),
            io_timeout: None,
            connect_retry: Duration::from_millis(200),
            connect_attempts: 10,
            reconnect_warnings: 10,
            reconnect_delay: Duration::from_millis(50),
            reconnect_max_delay: Duration::from_secs(2),
            timers: Timers::default(),
            max_io: 1 << 20,
            ring: 1024,
            slots: 128,
            max_requests: 512,
            scheduler: SchedulerKind::default(),
            node_order: None,
            send_mode: SendMode::default(),
            engine_threads: EngineThreads::default(),
            engine_thread_node: None,
            poll: tyche_runtime::poll::PollConfig::default(),
            ethertype: DEFAULT_ETHERTYPE,
            key: None,
            host_id: machine_id(),
            digest: false,
            prior_writes: tyche_channel::DurabilityDebt::Clear,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.export.is_empty() || self.export.len() > tyche_wire::MAX_EXPORT_NAME {
            return Err(format!("export name must be 1 to {} bytes", tyche_wire::MAX_EXPORT_NAME));
        }
        if self.channels_per_link == 0 || self.channels_per_link > 64 {
            return Err("channels per link must be 1 to 64".into());
        }
        if self.connect_attempts == 0 || self.connect_retry.is_zero() {
            return Err("connect attempts and retry interval must be positive".into());
        }
        if self.reconnect_delay.is_zero() {
            return Err("the reconnection delay must be positive".into());
        }
        if self.key.as_ref().is_some_and(|k| k.len() < tyche_channel::auth::MIN_KEY_LEN) {
            return Err(format!("a pre-shared key has at least {} bytes", tyche_channel::auth::MIN_KEY_LEN));
        }
        if self.max_requests == 0 {
            return Err("max_requests must be positive".into());
        }
        self.timers.validate().map_err(str::to_owned)
    }
}
