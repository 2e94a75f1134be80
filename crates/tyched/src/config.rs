//! The daemon's configuration: a TOML file (`tyched serve --config FILE`), flag overrides, and
//! validation that names the bad field (`export[1].size: ...`).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;
use tyche_runtime::poll::{PollConfig, PollMode};
use tyche_wire::{MacAddr, DEFAULT_ETHERTYPE, SECTOR_SIZE};

/// A configuration error: the field and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file is not valid TOML or does not match the format.
    #[error("config: {0}")]
    Parse(String),
    /// A field has a bad value.
    #[error("{field}: {message}")]
    Invalid {
        /// Path of the field, e.g. `export[1].size`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

/// Most exports one target serves (the configuration's, and those reloads add: an export
/// removed from the file keeps its place until the next start).
pub const MAX_EXPORTS: usize = 256;

/// Highest CPU number (exclusive) a CPU list in the configuration may name: the kernel's
/// largest `NR_CPUS`.
pub const MAX_CPU: u32 = 8192;

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}

/// Which transport carries the frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// AF_XDP (the `tyche-xdp` crate).
    #[default]
    Xdp,
    /// Frames over TCP (the `tyche-tcp` crate), for comparison.
    Tcp,
    /// AF_PACKET raw sockets (built in; works on any interface, copies every frame).
    Packet,
}

/// How many network threads serve the NICs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, clap::ValueEnum)]
pub enum NetworkThreads {
    /// One thread per NIC (per transport: per AF_XDP queue with `channels_per_nic` > 1), pinned
    /// to the NIC's node.
    #[default]
    #[serde(rename = "per-nic")]
    PerNic,
    /// One thread for every NIC.
    #[serde(rename = "one")]
    One,
}

/// The whole configuration (the TOML file's top level).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Network interfaces to serve on.
    #[serde(default)]
    pub ifaces: Vec<String>,
    /// Channels (queues) per NIC.
    #[serde(default = "default_channels_per_nic")]
    pub channels_per_nic: u16,
    /// Which transport.
    #[serde(default)]
    pub transport: TransportKind,
    /// TCP transport: address to listen on (`host:port`).
    #[serde(default)]
    pub tcp_listen: Option<String>,
    /// EtherType (default 0x88B5).
    #[serde(default = "default_ethertype")]
    pub ethertype: u16,
    /// Storage worker threads (0: one per core of the serving node, at most 8).
    #[serde(default)]
    pub workers: usize,
    /// Network threads: one per NIC (default) or one for all.
    #[serde(default)]
    pub network_threads: NetworkThreads,
    /// AF_XDP sockets in zero-copy mode where the driver offers it (`auto`), never (`copy`), or
    /// zero copy or refuse to start (`zero-copy`).
    #[serde(default)]
    pub xdp_copy: tyche_xdp::CopyMode,
    /// File and block exports use io_uring where the kernel allows it (else, and when false,
    /// the worker threads).
    #[serde(default = "default_true")]
    pub io_uring: bool,
    /// How network threads wait between turns that found nothing: `adaptive` (poll for up to
    /// `poll_budget_us` after work, then sleep), `sleep` (at once) or `spin` (never sleep).
    #[serde(default)]
    pub poll: PollMode,
    /// Adaptive polling: the longest a network thread polls after work before it sleeps
    /// (microseconds, at most 10000).
    #[serde(default = "default_poll_budget_us")]
    pub poll_budget_us: u64,
    /// Unix socket serving `tyched stats` (JSON).
    #[serde(default = "default_stats_socket")]
    pub stats_socket: PathBuf,
    /// Serve Prometheus text on `GET /metrics` here: `IP:PORT` (loopback unless
    /// `prometheus_allow_remote`), `localhost:PORT`, or a Unix socket path. None: no endpoint.
    #[serde(default)]
    pub prometheus_listen: Option<String>,
    /// Allow `prometheus_listen` on a non-loopback address (the endpoint has no authentication).
    #[serde(default)]
    pub prometheus_allow_remote: bool,
    /// Channel limits granted to initiators.
    #[serde(default)]
    pub limits: Limits,
    /// A channel that hears nothing for this long is dead and its slots reclaimed (ms).
    #[serde(default = "default_dead_after_ms")]
    pub dead_after_ms: u64,
    /// A session whose channels are all dead is kept this long (ms) before it is reclaimed, so
    /// an initiator back within it resumes the same session with its at-most-once ledger. A
    /// session that never carried a frame after its handshake goes after `dead_after_ms`.
    #[serde(default = "default_reclaim_after_ms")]
    pub reclaim_after_ms: u64,
    /// A storage request that has not finished after this long (ms) is answered with an I/O
    /// error (counted in `storage_timeouts`) so a hung backend never wedges a channel; 0: none.
    #[serde(default = "default_storage_deadline_ms")]
    pub storage_deadline_ms: u64,
    /// The NICs' interrupts: `keep` them where they are (default; reported and warned about)
    /// or `auto`: each NIC's IRQs on cores of its node that run no network thread (root).
    #[serde(default)]
    pub irq_affinity: tyche_numa::irq::IrqPolicy,
    /// For placement experiments only (the NESUS paper's *Worst* case): every AF_XDP channel's
    /// memory (UMEM, rings, slot memory) on this node instead of its NIC's. None: the NIC's.
    #[serde(default)]
    pub channel_memory_node: Option<u32>,
    /// For placement experiments only (the NESUS paper's misplaced threads): every network
    /// thread, and the completion workers of its channels, on this node's CPUs instead of its
    /// NIC's (memory stays where `channel_memory_node` says). None: the NIC's node.
    #[serde(default)]
    pub network_thread_node: Option<u32>,
    /// Where the measured I/O bandwidth model is kept (machines with several NUMA nodes; none:
    /// `/var/lib/tyche/bandwidth-model.json`).
    #[serde(default)]
    pub model_cache: Option<PathBuf>,
    /// CPUs where the storage's consumers run on this host (a converged node's applications,
    /// as a list such as `"0-3,8"`): network threads keep off their cores, no completion worker
    /// goes there, and where that leaves a NIC's node no free core, the I/O bandwidth model
    /// decides where its channels' threads go. None: no consumer.
    #[serde(default)]
    pub consumer_cpus: Option<String>,
    /// How channels get NIC queues of their own (`crate::steer`): `none`, `queue-mac` (an
    /// address and an ntuple rule per queue, installed on the NIC at start) or
    /// `queue-mac-no-rules` (the addresses alone, for links that keep frames on their sender's
    /// queue: veth).
    #[serde(default)]
    pub steer: crate::steer::Steer,
    /// With `steer`: the queue addresses of an interface, one per queue (`channels_per_nic`),
    /// locally administered unicast. An interface not listed derives them from its own address
    /// (`crate::steer::derive_queue_mac`).
    #[serde(default)]
    pub queue_macs: std::collections::BTreeMap<String, Vec<String>>,
    /// The exports.
    #[serde(default, rename = "export")]
    pub exports: Vec<ExportConfig>,
}

/// What the target grants at most: per channel (ring, slots, sizes) and in all (sessions,
/// channels, challenges, memory, queues). Every field is optional in the file; docs/tyched.md
/// ("Limits") lists each with its default and the counter that says it was hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Ring positions per direction.
    pub ring: u16,
    /// `remq` slots.
    pub remq_slots: u16,
    /// `damq` slots.
    pub damq_slots: u16,
    /// Largest request in bytes (the `damq` slot size).
    pub max_io: u32,
    /// Largest segment (payload bytes per DATA frame).
    pub segment: u16,
    /// Live sessions on the target (more: REJECT BUSY).
    pub sessions: usize,
    /// Live sessions of one export.
    pub sessions_per_export: usize,
    /// Live sessions created from one initiator MAC.
    pub sessions_per_mac: usize,
    /// Channel indices of one session.
    pub channels_per_session: usize,
    /// Channels on the target, all sessions together.
    pub channels: usize,
    /// Pending key challenges remembered (the oldest is forgotten first).
    pub challenges: usize,
    /// Pending key challenges per initiator MAC (its oldest is forgotten first).
    pub challenges_per_mac: usize,
    /// `damq` slot memory held at once, all channels together (bytes, or "256M"). Only copied
    /// payloads use it (TCP and AF_PACKET transports, exhausted AF_XDP chunk pools).
    pub slot_memory: Size,
    /// Control replies queued per NIC (more are dropped; initiators retry).
    pub control_queue: usize,
}

impl Default for Limits {
    fn default() -> Self {
        let acceptor = tyche_channel::AcceptorLimits::default();
        Limits {
            ring: 1024,
            remq_slots: 64,
            damq_slots: 64,
            max_io: 1 << 20,
            segment: 8192,
            sessions: acceptor.sessions,
            sessions_per_export: acceptor.sessions_per_export,
            sessions_per_mac: acceptor.sessions_per_mac,
            channels_per_session: acceptor.channels_per_session,
            channels: acceptor.channels,
            challenges: 4096,
            challenges_per_mac: 8,
            slot_memory: Size(1 << 30),
            control_queue: 256,
        }
    }
}

impl Limits {
    /// The session and channel limits, as the acceptor takes them.
    pub fn acceptor(&self) -> tyche_channel::AcceptorLimits {
        tyche_channel::AcceptorLimits {
            sessions: self.sessions,
            sessions_per_export: self.sessions_per_export,
            sessions_per_mac: self.sessions_per_mac,
            channels_per_session: self.channels_per_session,
            channels: self.channels,
        }
    }
}

/// One export (`[[export]]` in the file).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportConfig {
    /// Name initiators attach by.
    pub name: String,
    /// Backing file or block device; absent for a RAM export.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Size: required for RAM, creates or grows a regular file to this size when given, and
    /// must not exceed a block device. Bytes, or with a suffix K, M, G, T (powers of 1024).
    #[serde(default)]
    pub size: Option<Size>,
    /// Refuse WRITE, DISCARD and WRITE_ZEROES.
    #[serde(default)]
    pub read_only: bool,
    /// Initiator MAC addresses allowed to attach; empty: any.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Pre-shared key (at least 16 bytes) written in the file: deprecated, use `key_file`.
    #[serde(default)]
    pub key: Option<Secret>,
    /// File holding the pre-shared key (at least 16 bytes; one final line break is not part of
    /// it). Refused when its group or others may read it.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Use O_DIRECT on a block device when requests are aligned (default true).
    #[serde(default = "default_true")]
    pub direct: bool,
    /// Let several initiators attach at once (cluster filesystems). Default false: one
    /// initiator (host) at a time; another gets REJECT IN_USE naming the holder.
    #[serde(default)]
    pub shared: bool,
    /// Encrypt every frame of the export's channels after the common header (AES-256-GCM, the
    /// key's channel keys). Needs `key_file` (or `key`). Frames of a keyed export are always
    /// authenticated; this also hides data, offsets and lengths from the wire.
    #[serde(default)]
    pub encrypt: bool,
}

/// A byte size, written as a number or a string with a K/M/G/T suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (digits, mult) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
            None => (s, 1u64),
            Some((i, _)) => {
                let m = match s[i..].trim().to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
                    "" => 1,
                    "K" => 1 << 10,
                    "M" => 1 << 20,
                    "G" => 1 << 30,
                    "T" => 1 << 40,
                    other => return Err(format!("unknown size suffix {other:?}")),
                };
                (&s[..i], m)
            }
        };
        let n: u64 = digits.parse().map_err(|_| format!("not a size: {s:?}"))?;
        n.checked_mul(mult).map(Size).ok_or_else(|| format!("size too large: {s:?}"))
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Size(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

fn default_channels_per_nic() -> u16 {
    1
}
fn default_ethertype() -> u16 {
    DEFAULT_ETHERTYPE
}
fn default_stats_socket() -> PathBuf {
    PathBuf::from("/run/tyched/stats.sock")
}
fn default_dead_after_ms() -> u64 {
    3000
}
fn default_reclaim_after_ms() -> u64 {
    // At least the initiator's default no-path timeout (30 s).
    35_000
}
fn default_storage_deadline_ms() -> u64 {
    30_000
}
fn default_true() -> bool {
    true
}
fn default_poll_budget_us() -> u64 {
    tyche_runtime::poll::DEFAULT_BUDGET.as_micros() as u64
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ifaces: Vec::new(),
            channels_per_nic: default_channels_per_nic(),
            transport: TransportKind::default(),
            tcp_listen: None,
            ethertype: default_ethertype(),
            workers: 0,
            network_threads: NetworkThreads::default(),
            xdp_copy: tyche_xdp::CopyMode::Auto,
            io_uring: true,
            poll: PollMode::default(),
            poll_budget_us: default_poll_budget_us(),
            stats_socket: default_stats_socket(),
            prometheus_listen: None,
            prometheus_allow_remote: false,
            limits: Limits::default(),
            dead_after_ms: default_dead_after_ms(),
            reclaim_after_ms: default_reclaim_after_ms(),
            storage_deadline_ms: default_storage_deadline_ms(),
            irq_affinity: tyche_numa::irq::IrqPolicy::default(),
            channel_memory_node: None,
            network_thread_node: None,
            model_cache: None,
            consumer_cpus: None,
            steer: crate::steer::Steer::None,
            queue_macs: Default::default(),
            exports: Vec::new(),
        }
    }
}

/// A secret from the configuration: never shown by `Debug`, wiped from memory when dropped.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "String")]
pub struct Secret(zeroize::Zeroizing<String>);

impl Secret {
    /// The secret's bytes.
    pub fn expose(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret(zeroize::Zeroizing::new(s))
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Secret {
        Secret::from(s.to_owned())
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(redacted)")
    }
}

impl Config {
    /// What the machine must hold for `serve` to start with this configuration, checked without
    /// opening or creating anything (what `serve --check` reports, and `serve` checks first):
    /// at least one interface and each one present, and each file export's file present or, with
    /// a size, its directory present (`serve` creates the file). Key files are read by
    /// [`Config::validate`]. The error names the field.
    pub fn preflight(&self) -> Result<(), ConfigError> {
        if self.ifaces.is_empty() {
            return Err(invalid("ifaces", "no interface to serve on (--iface IF)"));
        }
        for (i, name) in self.ifaces.iter().enumerate() {
            // The interface in this process's network namespace (sysfs may show another's).
            let ok = std::ffi::CString::new(name.as_str()).is_ok_and(|c| {
                // SAFETY: `c` is a NUL-terminated string that outlives the call.
                unsafe { libc::if_nametoindex(c.as_ptr()) != 0 }
            });
            if !ok {
                return Err(invalid(format!("ifaces[{i}]"), format!("no network interface {name:?} on this host")));
            }
        }
        for (i, e) in self.exports.iter().enumerate() {
            let field = |f: &str| format!("export[{i}].{f}");
            if let Some(path) = &e.path {
                match std::fs::metadata(path) {
                    Ok(_) => {}
                    Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                        return Err(invalid(field("path"), format!("{}: {err}", path.display())))
                    }
                    Err(_) if e.size.is_none() || e.read_only => {
                        return Err(invalid(
                            field("path"),
                            format!("{}: no such file, and no size to create it with", path.display()),
                        ))
                    }
                    Err(_) => {
                        let dir =
                            path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
                        if !dir.is_dir() {
                            return Err(invalid(
                                field("path"),
                                format!("{}: its directory {} does not exist", path.display(), dir.display()),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl ExportConfig {
    /// The export's pre-shared key, if it has one: from `key_file`, or the deprecated inline
    /// `key`.
    /// A key file is read by `tyche_channel::auth::read_key_file`, the rule both daemons share.
    pub fn key_bytes(&self) -> Result<Option<tyche_channel::auth::Psk>, String> {
        match (&self.key_file, &self.key) {
            (Some(path), _) => tyche_channel::auth::read_key_file(path).map(Some).map_err(|e| e.to_string()),
            (None, Some(k)) => Ok(Some(tyche_channel::auth::Psk::new(k.expose()))),
            (None, None) => Ok(None),
        }
    }

    /// Whether the export needs a key.
    pub fn keyed(&self) -> bool {
        self.key.is_some() || self.key_file.is_some()
    }

    /// A RAM export of `size` bytes.
    pub fn ram(name: &str, size: u64) -> Self {
        ExportConfig {
            name: name.into(),
            path: None,
            size: Some(Size(size)),
            read_only: false,
            allow: Vec::new(),
            key: None,
            key_file: None,
            direct: true,
            shared: false,
            encrypt: false,
        }
    }

    /// An export backed by the file or block device at `path`.
    pub fn file(name: &str, path: impl Into<PathBuf>, size: Option<u64>) -> Self {
        ExportConfig { path: Some(path.into()), size: size.map(Size), ..ExportConfig::ram(name, 0) }
    }

    /// Parses a `--export NAME=PATH`, `--export NAME=PATH:SIZE` (the file created, mode 0600, or
    /// grown to SIZE) or `--export NAME=ram:SIZE` flag. A PATH ending in `:` and something that is
    /// not a size is a path.
    pub fn from_flag(s: &str) -> Result<Self, ConfigError> {
        let (name, what) = s
            .split_once('=')
            .ok_or_else(|| invalid("--export", "expected NAME=PATH, NAME=PATH:SIZE or NAME=ram:SIZE"))?;
        if let Some(size) = what.strip_prefix("ram:") {
            let size: Size = size.parse().map_err(|e: String| invalid("--export", e))?;
            return Ok(ExportConfig::ram(name, size.0));
        }
        match what.rsplit_once(':').map(|(p, z)| (p, z.parse::<Size>())) {
            Some((path, Ok(size))) if !path.is_empty() => Ok(ExportConfig::file(name, path, Some(size.0))),
            _ => Ok(ExportConfig::file(name, what, None)),
        }
    }

    /// The allow-list, parsed (validated by [`Config::validate`]).
    pub fn allowed_macs(&self) -> Vec<MacAddr> {
        self.allow.iter().filter_map(|m| m.parse().ok()).collect()
    }
}

impl Config {
    /// Parses and validates a TOML document.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// The channel dead-after bound.
    pub fn dead_after(&self) -> Duration {
        Duration::from_millis(self.dead_after_ms)
    }

    /// The target's channel timers: defaults, with the dead-after bound from the config (and the
    /// keepalive and retransmission ceiling scaled down to fit under a short one).
    pub fn timers(&self) -> tyche_channel::Timers {
        let d = tyche_channel::Timers::default();
        let dead_after = self.dead_after();
        let quarter = dead_after / 4;
        let max_rto = d.max_rto.min(quarter);
        tyche_channel::Timers {
            dead_after,
            keepalive: d.keepalive.min(quarter),
            max_rto,
            initial_rto: d.initial_rto.min(max_rto),
            min_rto: d.min_rto.min(max_rto),
            ..d
        }
    }

    /// How the network threads poll (`poll`, `poll_budget_us`), checked.
    pub fn poll_config(&self) -> Result<PollConfig, ConfigError> {
        PollConfig::new(self.poll, self.poll_budget_us).map_err(|e| invalid("poll_budget_us", e.to_string()))
    }

    /// The Prometheus endpoint's address, checked (`prometheus_listen`).
    pub fn prometheus_addr(&self) -> Result<Option<tyche_metrics::MetricsAddr>, ConfigError> {
        let Some(s) = &self.prometheus_listen else { return Ok(None) };
        let a = tyche_metrics::MetricsAddr::parse_local(s, self.prometheus_allow_remote)
            .map_err(|e| invalid("prometheus_listen", e.to_string()))?;
        if let tyche_metrics::MetricsAddr::Unix(p) = &a {
            if *p == self.stats_socket {
                return Err(invalid("prometheus_listen", "the same path as stats_socket"));
            }
        }
        Ok(Some(a))
    }

    /// The CPUs of `consumer_cpus` (empty when none are given).
    pub fn consumer_cpus(&self) -> Result<Vec<u32>, ConfigError> {
        let Some(list) = &self.consumer_cpus else { return Ok(Vec::new()) };
        let cpus = tyche_numa::parse_cpu_list(list)
            .map_err(|e| invalid("consumer_cpus", format!("not a CPU list such as \"0-3,8\": {e}")))?;
        if cpus.iter().any(|&c| c >= MAX_CPU) {
            return Err(invalid("consumer_cpus", format!("CPU numbers must be below {MAX_CPU}")));
        }
        Ok(cpus)
    }

    /// The queue addresses of interface `iface`, whose own address is `nic`, with `steer`: the
    /// configured ones, or derived from `nic`. Empty without `steer`.
    pub fn queue_macs_for(&self, iface: &str, nic: MacAddr) -> Result<Vec<MacAddr>, ConfigError> {
        if !self.steer.addresses() {
            return Ok(Vec::new());
        }
        let field = format!("queue_macs.{iface}");
        let macs = match self.queue_macs.get(iface) {
            Some(list) => list
                .iter()
                .map(|m| m.parse::<MacAddr>().map_err(|_| invalid(&field, format!("{m:?} is not a MAC address"))))
                .collect::<Result<Vec<_>, _>>()?,
            None => (0..self.channels_per_nic)
                .map(|q| crate::steer::derive_queue_mac(nic, q))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    invalid(
                        &field,
                        format!(
                            "derived addresses cover {} queues; list the {} queue addresses",
                            crate::steer::MAX_DERIVED_QUEUES,
                            self.channels_per_nic
                        ),
                    )
                })?,
        };
        if macs.contains(&nic) {
            return Err(invalid(&field, format!("{nic} is the interface's own address, not a queue's")));
        }
        Ok(macs)
    }

    /// The `steer` and `queue_macs` fields.
    fn validate_steer(&self) -> Result<(), ConfigError> {
        if !self.steer.addresses() {
            if !self.queue_macs.is_empty() {
                return Err(invalid("queue_macs", "given without steer (set steer = \"queue-mac\")"));
            }
            return Ok(());
        }
        if self.transport != TransportKind::Xdp {
            return Err(invalid("steer", "steers AF_XDP queues: needs transport = \"xdp\""));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (iface, list) in &self.queue_macs {
            let field = format!("queue_macs.{iface}");
            if !self.ifaces.is_empty() && !self.ifaces.contains(iface) {
                return Err(invalid(field, "not one of ifaces"));
            }
            if list.len() != self.channels_per_nic as usize {
                return Err(invalid(
                    field,
                    format!("{} addresses for {} queues (channels_per_nic)", list.len(), self.channels_per_nic),
                ));
            }
            for m in list {
                let mac: MacAddr = m.parse().map_err(|_| invalid(&field, format!("{m:?} is not a MAC address")))?;
                crate::steer::check_queue_mac(mac).map_err(|e| invalid(&field, e.to_string()))?;
                if !seen.insert(mac) {
                    return Err(invalid(&field, format!("{mac} is given twice")));
                }
            }
        }
        if self.queue_macs.len() < self.ifaces.len() && self.channels_per_nic > crate::steer::MAX_DERIVED_QUEUES {
            return Err(invalid(
                "queue_macs",
                format!(
                    "derived queue addresses cover {} queues: list them for every interface",
                    crate::steer::MAX_DERIVED_QUEUES
                ),
            ));
        }
        Ok(())
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.exports.is_empty() {
            return Err(invalid("export", "at least one export is needed"));
        }
        if self.exports.len() > MAX_EXPORTS {
            return Err(invalid("export", format!("{} exports; at most {MAX_EXPORTS}", self.exports.len())));
        }
        if self.channel_memory_node.is_some_and(|n| n >= 1024) {
            return Err(invalid("channel_memory_node", "a NUMA node number (below 1024)"));
        }
        if self.network_thread_node.is_some_and(|n| n >= 1024) {
            return Err(invalid("network_thread_node", "a NUMA node number (below 1024)"));
        }
        self.consumer_cpus()?;
        if self.channels_per_nic == 0 || self.channels_per_nic > 64 {
            return Err(invalid("channels_per_nic", "must be 1 to 64"));
        }
        self.validate_steer()?;
        if self.xdp_copy != tyche_xdp::CopyMode::Auto && self.transport != TransportKind::Xdp {
            return Err(invalid("xdp_copy", "applies to AF_XDP sockets: needs transport = \"xdp\""));
        }
        if self.ethertype < 0x0600 {
            return Err(invalid("ethertype", "must be at least 0x0600 (an EtherType, not a length)"));
        }
        if self.workers > 256 {
            return Err(invalid("workers", "at most 256"));
        }
        if self.dead_after_ms < 100 || self.dead_after_ms > 3_600_000 {
            return Err(invalid("dead_after_ms", "100 to 3600000"));
        }
        self.timers().validate().map_err(|e| invalid("dead_after_ms", e))?;
        if self.reclaim_after_ms > 86_400_000 {
            return Err(invalid("reclaim_after_ms", "at most 86400000 (a day)"));
        }
        if self.storage_deadline_ms != 0 && !(100..=3_600_000).contains(&self.storage_deadline_ms) {
            return Err(invalid("storage_deadline_ms", "0 (none) or 100 to 3600000"));
        }
        self.prometheus_addr()?;
        self.poll_config()?;
        for (i, name) in self.ifaces.iter().enumerate() {
            if name.is_empty() || name.len() > 15 {
                return Err(invalid(format!("ifaces[{i}]"), "interface names are 1 to 15 bytes"));
            }
        }
        self.validate_limits()?;
        for (i, e) in self.exports.iter().enumerate() {
            if self.exports[..i].iter().any(|o| o.name == e.name) {
                return Err(invalid(format!("export[{i}].name"), format!("duplicate export name {:?}", e.name)));
            }
            e.validate(i)?;
        }
        Ok(())
    }

    /// The `[limits]` fields.
    fn validate_limits(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        let p = tyche_wire::ChannelParams {
            ring: l.ring,
            remq_slots: l.remq_slots,
            damq_slots: l.damq_slots,
            segment: l.segment,
            max_io: l.max_io,
            features: 0,
        };
        if !tyche_channel::config::params_supported(&p) {
            return Err(invalid("limits", format!("unsupported channel limits {p:?}")));
        }
        let counts = [
            ("sessions", l.sessions),
            ("sessions_per_export", l.sessions_per_export),
            ("sessions_per_mac", l.sessions_per_mac),
            ("channels_per_session", l.channels_per_session),
            ("channels", l.channels),
            ("challenges", l.challenges),
            ("challenges_per_mac", l.challenges_per_mac),
            ("control_queue", l.control_queue),
        ];
        for (name, n) in counts {
            if !(1..=1 << 20).contains(&n) {
                return Err(invalid(format!("limits.{name}"), format!("{n} is not between 1 and 1048576")));
            }
        }
        if l.channels_per_session > 1 << 16 {
            return Err(invalid("limits.channels_per_session", "at most 65536 (channel indices are 16 bits)"));
        }
        if l.slot_memory.0 < l.max_io as u64 {
            return Err(invalid(
                "limits.slot_memory",
                format!("{} is less than one slot (max_io {})", l.slot_memory.0, l.max_io),
            ));
        }
        Ok(())
    }
}

impl ExportConfig {
    /// Checks export `i`'s fields (its name against the others' is the config's check).
    fn validate(&self, i: usize) -> Result<(), ConfigError> {
        let e = self;
        let f = |name: &str| format!("export[{i}].{name}");
        if e.name.is_empty() || e.name.len() > tyche_wire::MAX_EXPORT_NAME || e.name.chars().any(char::is_control) {
            return Err(invalid(f("name"), "1 to 64 bytes of UTF-8 without control characters"));
        }
        match (&e.path, e.size) {
            (None, None) => return Err(invalid(f("size"), "a RAM export (no path) needs a size")),
            (_, Some(Size(s))) if s == 0 || s % SECTOR_SIZE as u64 != 0 => {
                return Err(invalid(f("size"), format!("{s} is not a positive multiple of {SECTOR_SIZE}")));
            }
            (Some(p), _) if p.as_os_str().is_empty() => return Err(invalid(f("path"), "empty path")),
            _ => {}
        }
        for (j, m) in e.allow.iter().enumerate() {
            if m.parse::<MacAddr>().is_err() {
                return Err(invalid(format!("export[{i}].allow[{j}]"), format!("not a MAC address: {m:?}")));
            }
        }
        if e.key.is_some() && e.key_file.is_some() {
            return Err(invalid(f("key_file"), "give key or key_file, not both"));
        }
        if let Some(k) = &e.key {
            if k.expose().len() < 16 {
                return Err(invalid(f("key"), "a pre-shared key has at least 16 bytes"));
            }
        }
        if e.key_file.is_some() {
            e.key_bytes().map_err(|m| invalid(f("key_file"), m))?;
        }
        if e.encrypt && !e.keyed() {
            return Err(invalid(f("encrypt"), "encryption needs a key: give key_file"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_memory_node_parses_and_is_bounded() {
        let export = "[[export]]\nname = \"a\"\nsize = \"1M\"\n";
        assert_eq!(Config::from_toml(export).unwrap().channel_memory_node, None, "default: the NIC's node");
        let c = Config::from_toml(&format!("channel_memory_node = 1\n{export}")).unwrap();
        assert_eq!(c.channel_memory_node, Some(1));
        let err = Config::from_toml(&format!("channel_memory_node = 5000\n{export}")).expect_err("too big").to_string();
        assert!(err.contains("channel_memory_node"), "{err}");
        let c = Config::from_toml(&format!("network_thread_node = 1\n{export}")).unwrap();
        assert_eq!((c.network_thread_node, c.channel_memory_node), (Some(1), None));
        let err = Config::from_toml(&format!("network_thread_node = 5000\n{export}")).expect_err("too big").to_string();
        assert!(err.contains("network_thread_node"), "{err}");
    }

    #[test]
    fn consumer_cpus_parse_and_bad_lists_are_named() {
        let export = "[[export]]\nname = \"a\"\nsize = \"1M\"\n";
        assert_eq!(Config::from_toml(export).unwrap().consumer_cpus().unwrap(), Vec::<u32>::new());
        let c = Config::from_toml(&format!("consumer_cpus = \"0-2,5\"\n{export}")).unwrap();
        assert_eq!(c.consumer_cpus().unwrap(), vec![0, 1, 2, 5]);
        for bad in ["3-1", "x", "9000"] {
            let err = Config::from_toml(&format!("consumer_cpus = \"{bad}\"\n{export}")).expect_err(bad).to_string();
            assert!(err.contains("consumer_cpus"), "{bad}: {err}");
        }
    }

    #[test]
    fn irq_affinity_and_model_cache_parse() {
        use tyche_numa::irq::IrqPolicy;
        let export = "[[export]]\nname = \"a\"\nsize = \"1M\"";
        assert_eq!(Config::from_toml(export).unwrap().irq_affinity, IrqPolicy::Keep, "default keep");
        let c =
            Config::from_toml(&format!("irq_affinity = \"auto\"\nmodel_cache = \"/tmp/m.json\"\n{export}")).unwrap();
        assert_eq!(c.irq_affinity, IrqPolicy::Auto);
        assert_eq!(c.model_cache.as_deref(), Some(std::path::Path::new("/tmp/m.json")));
        let err = Config::from_toml(&format!("irq_affinity = \"spread\"\n{export}")).expect_err("unknown").to_string();
        assert!(err.contains("irq_affinity") || err.contains("unknown variant"), "{err}");
    }

    #[test]
    fn key_files_must_be_private_and_keys_never_show() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        std::fs::write(&path, "a key of at least sixteen bytes\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let text = format!("[[export]]\nname = \"a\"\nsize = \"1M\"\nkey_file = {:?}", path.display().to_string());
        let err = Config::from_toml(&text).expect_err("a key file others can read").to_string();
        assert!(err.starts_with("export[0].key_file:") && err.contains("chmod 600"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let c = Config::from_toml(&text).expect("a private key file");
        assert_eq!(&c.exports[0].key_bytes().unwrap().unwrap()[..], b"a key of at least sixteen bytes");
        let inline =
            Config::from_toml("[[export]]\nname = \"a\"\nsize = \"1M\"\nkey = \"another key, sixteen+\"").unwrap();
        let shown = format!("{inline:?}");
        assert!(!shown.contains("another key") && shown.contains("redacted"), "{shown}");
        let both = format!("{text}\nkey = \"another key, sixteen+\"");
        assert!(Config::from_toml(&both).expect_err("both").to_string().contains("not both"));
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!("512".parse::<Size>().unwrap(), Size(512));
        assert_eq!("64M".parse::<Size>().unwrap(), Size(64 << 20));
        assert_eq!("2GiB".parse::<Size>().unwrap(), Size(2 << 30));
        assert!("12Q".parse::<Size>().is_err(), "unknown suffix");
    }

    #[test]
    fn errors_name_the_field() {
        let text = r#"
            [[export]]
            name = "a"
            size = "1M"
            [[export]]
            name = "b"
            size = 1000
        "#;
        let e = Config::from_toml(text).expect_err("size 1000 is not a multiple of 512");
        assert!(e.to_string().starts_with("export[1].size:"), "{e}");
        let e = Config::from_toml("bogus = 1\n[[export]]\nname=\"a\"\nsize=512").expect_err("unknown field");
        assert!(e.to_string().contains("bogus"), "{e}");
        let text = "[[export]]\nname = \"a\"\nsize = \"1M\"\nallow = [\"nope\"]";
        let e = Config::from_toml(text).expect_err("bad MAC");
        assert!(e.to_string().starts_with("export[0].allow[0]:"), "{e}");
        let text = "[[export]]\nname = \"a\"\nsize = \"1M\"\nkey = \"short\"";
        assert!(Config::from_toml(text).expect_err("short key").to_string().starts_with("export[0].key:"));
    }

    #[test]
    fn xdp_copy_reads_each_mode_and_is_refused_off_af_xdp() {
        let base = "[[export]]\nname = \"a\"\nsize = \"1M\"\n";
        let with = |extra: &str| Config::from_toml(&format!("{extra}\n{base}"));
        use tyche_xdp::CopyMode;
        assert_eq!(with("").unwrap().xdp_copy, CopyMode::Auto);
        assert_eq!(with("xdp_copy = \"copy\"").unwrap().xdp_copy, CopyMode::Copy);
        assert_eq!(with("xdp_copy = \"zero-copy\"").unwrap().xdp_copy, CopyMode::ZeroCopy);
        let e = with("xdp_copy = \"zerocopy\"").expect_err("unknown mode");
        assert!(e.to_string().contains("xdp_copy"), "{e}");
        let e = with("xdp_copy = \"zero-copy\"\ntransport = \"tcp\"").expect_err("not AF_XDP");
        assert!(e.to_string().starts_with("xdp_copy:"), "{e}");
    }

    #[test]
    fn steering_is_checked_so_that_nothing_is_half_configured() {
        let base = "[[export]]\nname = \"a\"\nsize = \"1M\"\n";
        let with = |extra: &str| Config::from_toml(&format!("{extra}\n{base}"));
        use crate::steer::Steer;
        assert_eq!(with("").unwrap().steer, Steer::None);
        assert_eq!(with("steer = \"queue-mac\"").unwrap().steer, Steer::QueueMac);
        assert_eq!(with("steer = \"queue-mac-no-rules\"").unwrap().steer, Steer::QueueMacNoRules);
        let e = with("steer = \"queue-mac-rules\"").expect_err("unknown mode");
        assert!(e.to_string().contains("steer"), "{e}");
        // Queue addresses without steering would do nothing: refused.
        let e = with("channels_per_nic = 2\n[queue_macs]\neth1 = [\"06:00:00:00:00:01\", \"0a:00:00:00:00:01\"]")
            .expect_err("queue_macs without steer");
        assert!(e.to_string().starts_with("queue_macs: given without steer"), "{e}");
        let e = with("steer = \"queue-mac\"\ntransport = \"tcp\"").expect_err("not AF_XDP");
        assert!(e.to_string().starts_with("steer:"), "{e}");
        let ok = "steer = \"queue-mac\"\nchannels_per_nic = 2\nifaces = [\"eth1\"]\n[queue_macs]\n";
        let c = with(&format!("{ok}eth1 = [\"06:00:00:00:00:01\", \"0a:00:00:00:00:01\"]")).expect("two addresses");
        let nic = MacAddr([0x3c, 0xec, 0xef, 1, 2, 3]);
        assert_eq!(
            c.queue_macs_for("eth1", nic).unwrap(),
            ["06:00:00:00:00:01".parse::<MacAddr>().unwrap(), "0a:00:00:00:00:01".parse().unwrap()]
        );
        // Derived for an interface not listed.
        let derived = c.queue_macs_for("eth2", nic).unwrap();
        assert_eq!(derived, (0..2).map(|q| crate::steer::derive_queue_mac(nic, q).unwrap()).collect::<Vec<_>>());
        for (list, why) in [
            ("[\"06:00:00:00:00:01\"]", "1 addresses for 2 queues"),
            ("[\"06:00:00:00:00:01\", \"06:00:00:00:00:01\"]", "given twice"),
            ("[\"06:00:00:00:00:01\", \"07:00:00:00:00:01\"]", "group"),
            ("[\"06:00:00:00:00:01\", \"3c:00:00:00:00:01\"]", "not locally administered"),
            ("[\"06:00:00:00:00:01\", \"00:00:00:00:00:00\"]", "all-zero"),
            ("[\"06:00:00:00:00:01\", \"nope\"]", "not a MAC address"),
        ] {
            let e = with(&format!("{ok}eth1 = {list}")).expect_err(why);
            assert!(e.to_string().starts_with("queue_macs.eth1:") && e.to_string().contains(why), "{e}");
        }
        let e = with(&format!("{ok}eth9 = [\"06:00:00:00:00:01\", \"0a:00:00:00:00:01\"]")).expect_err("no such iface");
        assert!(e.to_string().starts_with("queue_macs.eth9: not one of ifaces"), "{e}");
        // The interface's own address is no queue's.
        let e = c.queue_macs_for("eth1", "06:00:00:00:00:01".parse().unwrap()).expect_err("own address");
        assert!(e.to_string().contains("the interface's own address"), "{e}");
        // 64 queues are more than derived addresses cover.
        let e = with("steer = \"queue-mac\"\nchannels_per_nic = 64\nifaces = [\"eth1\"]").expect_err("64 queues");
        assert!(e.to_string().starts_with("queue_macs: derived queue addresses cover 63 queues"), "{e}");
    }

    #[test]
    fn prometheus_listen_is_checked() {
        let base = "[[export]]\nname = \"a\"\nsize = \"1M\"\n";
        let with = |extra: &str| Config::from_toml(&format!("{extra}\n{base}"));
        let c = with("prometheus_listen = \"127.0.0.1:9464\"").expect("loopback");
        assert_eq!(c.prometheus_addr().unwrap(), Some("127.0.0.1:9464".parse().unwrap()));
        with("prometheus_listen = \"/run/tyched/metrics.sock\"").expect("a Unix socket");
        assert_eq!(with("").expect("none").prometheus_addr().unwrap(), None);
        let e = with("prometheus_listen = \"0.0.0.0:9464\"").expect_err("not loopback");
        assert!(e.to_string().starts_with("prometheus_listen: 0.0.0.0:9464 is not a loopback address"), "{e}");
        with("prometheus_listen = \"0.0.0.0:9464\"\nprometheus_allow_remote = true").expect("allowed");
        let e = with("prometheus_listen = \"nowhere\"").expect_err("not an address");
        assert!(e.to_string().starts_with("prometheus_listen:"), "{e}");
        let e = with("prometheus_listen = 9464").expect_err("not a string");
        assert!(e.to_string().contains("prometheus_listen"), "{e}");
        let e = with("stats_socket = \"/tmp/s.sock\"\nprometheus_listen = \"/tmp/s.sock\"").expect_err("clash");
        assert!(e.to_string().starts_with("prometheus_listen:"), "{e}");
    }

    #[test]
    fn poll_mode_and_budget_are_checked() {
        let base = "[[export]]\nname = \"a\"\nsize = \"1M\"\n";
        let with = |extra: &str| Config::from_toml(&format!("{extra}\n{base}"));
        let c = with("").expect("defaults");
        assert_eq!(c.poll_config().unwrap(), PollConfig::default());
        let c = with("poll = \"spin\"\npoll_budget_us = 20").expect("spin");
        assert_eq!(c.poll_config().unwrap(), PollConfig::new(PollMode::Spin, 20).unwrap());
        with("poll = \"sleep\"").expect("sleep");
        let e = with("poll = \"busy\"").expect_err("unknown mode");
        assert!(e.to_string().contains("poll"), "{e}");
        let e = with("poll_budget_us = 20000").expect_err("budget too large");
        assert!(e.to_string().starts_with("poll_budget_us: poll budget 20000"), "{e}");
    }

    #[test]
    fn example_config_parses() {
        let c =
            Config::from_toml(include_str!("../../../examples/tyched.toml")).expect("examples/tyched.toml is valid");
        assert_eq!(c.exports.len(), 3);
        assert_eq!(c.exports[0].size, Some(Size(256 << 20)));
        assert!(c.exports[2].read_only && c.exports[2].key.is_some());
        assert_eq!(c.exports[2].allowed_macs().len(), 2);
        assert_eq!(c.transport, TransportKind::Xdp);
        assert_eq!(c.ifaces.len(), 2);
    }

    #[test]
    fn export_flags_parse() {
        let e = ExportConfig::from_flag("disk0=/var/lib/tyched/disk0.img:8G").expect("file flag with a size");
        assert_eq!(
            (e.path.as_deref(), e.size.map(|s| s.0)),
            (Some(std::path::Path::new("/var/lib/tyched/disk0.img")), Some(8 << 30))
        );
        let e = ExportConfig::from_flag("disk0=/srv/a:b.img").expect("a colon in the path");
        assert_eq!((e.path.as_deref(), e.size), (Some(std::path::Path::new("/srv/a:b.img")), None));
        let e = ExportConfig::from_flag("disk=ram:16M").expect("ram flag");
        assert_eq!(e.size, Some(Size(16 << 20)));
        assert!(e.path.is_none());
        let e = ExportConfig::from_flag("disk=/tmp/x.img").expect("file flag");
        assert_eq!(e.path.as_deref(), Some(std::path::Path::new("/tmp/x.img")));
        assert!(ExportConfig::from_flag("nothing").is_err());
    }
}
