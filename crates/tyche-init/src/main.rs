//! `tyche-init`: attach a Tyche export as a block device (ublk) or serve it over NBD.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use tracing::{info, warn};
use tyche_channel::DurabilityDebt;
use tyche_cli::bad_config;
use tyche_init::attachfile::AttachFile;
use tyche_init::frontend::UblkOptions;
use tyche_init::loopback::{mem_links, RamExport, RamTarget};
use tyche_init::nbd::NbdOptions;
use tyche_init::ublk_frontend::UblkFrontend;
use tyche_init::{state, Client, EngineThreads, InitiatorConfig, Link, SchedulerKind, SendMode};
use tyche_metrics::{MetricsAddr, MetricsListener, MetricsServer};
use tyche_wire::MacAddr;

mod admin;

#[derive(Debug, Parser)]
#[command(name = "tyche-init", version, about = "Tyche initiator: remote exports as local block devices")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the targets and exports seen on the given links.
    Discover {
        /// Interfaces to ask on.
        #[arg(long = "iface", required = true)]
        ifaces: Vec<String>,
        /// Seconds to listen for answers.
        #[arg(long, default_value_t = 1.0)]
        wait: f64,
        /// EtherType of Tyche frames (the targets' `ethertype`).
        #[arg(long, value_parser = parse_ethertype, default_value = "0x88B5")]
        ethertype: u16,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Attach an export as /dev/ublkbN and serve it until detached.
    ///
    /// SIGTERM or SIGINT detaches: the device is deleted when nothing uses it; a device still
    /// in use (mounted, or held by md) is left for recovery instead (created with user
    /// recovery, the default), and the next `attach --config` of the same file, or
    /// `attach --recover`, resumes it.
    Attach {
        #[command(flatten)]
        conn: ConnArgs,
        /// ublk hardware queues.
        #[arg(long, default_value_t = 1)]
        queues: u16,
        /// Requests in flight per ublk queue.
        #[arg(long, default_value_t = 64)]
        depth: u16,
        /// Take over an existing device whose `tyche-init attach` died (`/dev/ublkbN` or `N`):
        /// the device, and a filesystem mounted on it, stay; its I/O resumes on this process.
        /// Queues and depth are the device's.
        #[arg(long, value_name = "DEVICE", conflicts_with_all = ["dev_id", "no_recovery"])]
        recover: Option<String>,
        /// Ask for this device number (`/dev/ublkbN`) instead of the first free one: a
        /// supervisor then knows which device to `--recover` after a crash.
        #[arg(long, value_name = "N")]
        dev_id: Option<u32>,
        /// Create the device without user recovery: it goes away with this process (and so do
        /// the filesystems on it) instead of waiting for `attach --recover`.
        #[arg(long)]
        no_recovery: bool,
    },
    /// Attach every attachment file of a directory that is not attached yet, each by a
    /// `tyche-init attach --config FILE` of its own in the background.
    AttachAll {
        /// Directory of attachment files (NAME.toml).
        #[arg(long, default_value = tyche_init::attachfile::DEFAULT_DIR)]
        dir: PathBuf,
        /// Seconds to wait for each device before reporting it as still waiting for its target
        /// (it keeps trying in the background).
        #[arg(long, default_value_t = 30.0)]
        wait: f64,
    },
    /// Serve an export over NBD on a Unix socket until detached.
    ServeNbd {
        /// Socket path.
        #[arg(long)]
        socket: PathBuf,
        #[command(flatten)]
        conn: ConnArgs,
        /// NBD requests in flight per connection.
        #[arg(long, default_value_t = 128)]
        max_inflight: usize,
        /// NUMA nodes NBD connections are served for, in turn by accept order (default: the
        /// NICs' nodes). A connection served for a node runs on a thread pinned to that node's
        /// CPUs, its buffers are allocated there, and its requests go to that node's channels.
        #[arg(long, value_delimiter = ',', value_name = "NODE,...")]
        nbd_nodes: Vec<u32>,
        /// Who serves NBD requests after the handshake: `engine` (the engine thread of the
        /// connection's node reads requests and writes replies in its own loop) or `tasks` (a
        /// task per request on the connection's thread, handing each to the engine).
        #[arg(long, value_enum, default_value_t = NbdIo::Engine)]
        nbd_io: NbdIo,
    },
    /// Print the counters, per channel payload bytes and NUMA placement of a running front end.
    Stats {
        /// Device path, socket path or pid of the attachment (see `list`), or a stats socket.
        what: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List attached exports and their health: live, degraded (some links without a live
    /// channel), no-path, or awaiting-recovery (a device whose server died).
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// For udev: the environment that names /dev/disk/by-tyche/<target>/<export> for a device
    /// (`TYCHE_TARGET`, `TYCHE_EXPORT`, `TYCHE_ATTACHMENT`), by its kernel name (`ublkb0`).
    UdevInfo {
        /// Kernel name of the block device.
        device: String,
    },
    /// Packaging: write the man pages (OUT/man) and shell completions (OUT/completions).
    #[command(hide = true)]
    GenerateDocs {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
    },
    /// Testing aid: serve an in-process RAM export on AF_XDP interfaces (tyched's library).
    #[command(hide = true)]
    RamTarget {
        /// Interfaces to serve on.
        #[arg(long = "iface", required = true)]
        ifaces: Vec<String>,
        /// Export name.
        #[arg(long)]
        export: String,
        /// Export size in MiB.
        #[arg(long, default_value_t = 64)]
        mib: u64,
    },
    /// Detach an export (by device or socket path, pid, or attachment name), and wait until it
    /// is gone. A device in use (mounted, or held by md) is refused unless --force.
    Detach {
        /// Device path, socket path, pid or attachment name.
        what: String,
        /// Detach a device in use too: its server is killed and the device deleted, so I/O on
        /// it fails.
        #[arg(long)]
        force: bool,
    },
}

/// Who serves an NBD connection's requests after the handshake (`serve-nbd --nbd-io`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum NbdIo {
    /// The engine thread of the connection's node reads requests and writes replies.
    Engine,
    /// A task per request on the connection's thread hands each to the engine.
    Tasks,
}

#[derive(Debug, Args)]
struct ConnArgs {
    /// Attachment file (`/etc/tyche/attach.d/NAME.toml`): export, target, interfaces, key and
    /// timeouts come from it (the flags that set those are refused beside it), and the first
    /// connect is retried until the target answers.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "ifaces", "targets", "tcp", "loopback_mib", "export", "key", "host_id", "digest",
        "channels_per_nic", "no_path_timeout", "io_timeout", "ethertype", "target_name",
        "prometheus_listen", "prometheus_allow_remote",
    ])]
    config: Option<PathBuf>,
    /// The attachment file's name, once read.
    #[arg(skip)]
    name: Option<String>,
    /// Interfaces (AF_XDP), one channel set each.
    #[arg(long = "iface")]
    ifaces: Vec<String>,
    /// Target MAC address (one for all interfaces, or one per interface in order).
    #[arg(long = "target")]
    targets: Vec<String>,
    /// TCP baseline transport: target addresses instead of interfaces.
    #[arg(long = "tcp", conflicts_with = "ifaces")]
    tcp: Vec<String>,
    /// Serve an in-process RAM target of this many MiB instead of a remote one (testing, demos).
    #[arg(long, conflicts_with_all = ["ifaces", "tcp"])]
    loopback_mib: Option<u64>,
    /// Export name.
    #[arg(long, required_unless_present = "config")]
    export: Option<String>,
    /// The <target> part of the device's /dev/disk/by-tyche/<target>/<export> name (default:
    /// the target's MAC address).
    #[arg(long)]
    target_name: Option<String>,
    /// EtherType of Tyche frames (the target's `ethertype`).
    #[arg(long, value_parser = parse_ethertype, default_value = "0x88B5")]
    ethertype: u16,
    /// Keep trying to attach until the target answers, instead of failing (always with
    /// --config): for units that start before their target is up.
    #[arg(long)]
    retry: bool,
    /// Pre-shared key file.
    #[arg(long)]
    key: Option<PathBuf>,
    /// This host's id, 32 hexadecimal digits (default: /etc/machine-id). The target lets one
    /// host at a time attach an export that is not shared, and a new attachment from the same
    /// host fences the old one.
    #[arg(long, value_parser = tyche_init::parse_host_id)]
    host_id: Option<[u8; 16]>,
    /// Ask for a CRC32C digest of every data payload (feature DIGEST): corruption the Ethernet
    /// checksum misses is caught and the frame sent again. Keyed exports need none.
    #[arg(long)]
    digest: bool,
    /// Channels per NIC.
    #[arg(long, default_value_t = 1)]
    channels_per_nic: usize,
    /// Seconds requests wait while every channel is down before failing (ctrl_loss_tmo).
    #[arg(long, default_value_t = 30.0)]
    no_path_timeout: f64,
    /// Seconds a request waits for a path, from its submission, before it fails with an I/O
    /// error (the device stays attached and serves again when a path returns): a bounded time
    /// to fail for RAID members (md failfast). Default: only --no-path-timeout applies.
    #[arg(long, value_name = "S")]
    io_timeout: Option<f64>,
    /// Failed reconnect attempts per channel logged as warnings (later ones at debug level).
    /// Reconnection never gives up while the process runs. (Was --reconnect-attempts, still
    /// accepted.)
    #[arg(long, alias = "reconnect-attempts", default_value_t = 10, value_name = "N")]
    reconnect_warnings: u32,
    /// Channel scheduler: affinity or round-robin.
    #[arg(long, default_value = "affinity")]
    scheduler: SchedulerKind,
    /// Send mode: inline (the submitting thread, or the engine thread reading an NBD socket,
    /// posts the request's frames itself) or queue (it hands the request to the engine thread
    /// over a bounded queue).
    #[arg(long, default_value = "inline")]
    send_mode: SendMode,
    /// Engine threads: per-node (one per NUMA node of the NICs, pinned there) or one.
    #[arg(long, default_value = "per-node")]
    engine_threads: EngineThreads,
    /// AF_XDP zero copy: auto (where the driver offers it), copy (never) or zero-copy (or
    /// fail to attach).
    #[arg(long, value_name = "MODE", default_value = "auto")]
    xdp_copy: tyche_xdp::CopyMode,
    /// How engine threads wait when idle: adaptive (poll a while after work, then sleep),
    /// sleep or spin.
    #[arg(long, default_value = "adaptive")]
    poll: tyche_runtime::poll::PollMode,
    /// Adaptive polling: the longest an engine thread polls after work before it sleeps (µs).
    #[arg(long, default_value_t = tyche_runtime::poll::DEFAULT_BUDGET.as_micros() as u64, value_name = "US")]
    poll_budget_us: u64,
    /// Unix socket for `tyche-init stats` (default: PID.stats.sock in the state directory).
    #[arg(long)]
    stats_socket: Option<PathBuf>,
    /// The NICs' interrupts: keep (leave them, report and warn) or auto (each NIC's IRQs on one
    /// core of its node that this process's threads then keep off; needs root).
    #[arg(long, default_value = "keep")]
    irq_affinity: tyche_numa::irq::IrqPolicy,
    /// Placement experiment (the NESUS paper's misplaced-memory case): every AF_XDP channel's
    /// UMEM and rings on NUMA node N instead of its NIC's node. Channels are still scheduled by
    /// their NIC's node.
    #[arg(long, value_name = "N")]
    channel_memory_node: Option<u32>,
    /// Placement experiment (the NESUS paper's misplaced threads): every engine thread on NUMA
    /// node N's CPUs instead of its NICs' node.
    #[arg(long, value_name = "N")]
    engine_thread_node: Option<u32>,
    /// Where the measured I/O bandwidth model is kept (machines with several NUMA nodes).
    #[arg(long, value_name = "FILE", default_value = tyche_numa::model::DEFAULT_CACHE)]
    model_cache: PathBuf,
    /// Measure the I/O bandwidth model again instead of using the cached one.
    #[arg(long)]
    model_refresh: bool,
    /// Serve Prometheus metrics on `GET /metrics` at ADDR: IP:PORT (loopback unless
    /// --prometheus-allow-remote), localhost:PORT, or a Unix socket path (attachment file:
    /// `prometheus_listen`).
    #[arg(long, value_name = "ADDR")]
    prometheus_listen: Option<String>,
    /// Allow --prometheus-listen on a non-loopback address (the endpoint has no authentication).
    #[arg(long)]
    prometheus_allow_remote: bool,
    /// The metrics endpoint's address, checked (`--prometheus-listen` or the file's).
    #[arg(skip)]
    metrics: Option<MetricsAddr>,
    /// Testing only: drop this fraction of frames on every link, both ways, with the seeded
    /// fault-injection wrapper (AF_XDP copy-mode transmit bypasses the qdisc, so `tc netem`
    /// cannot drop Tyche frames).
    #[arg(long, hide = true, value_parser = parse_probability)]
    inject_loss: Option<f64>,
}

fn parse_ethertype(s: &str) -> std::result::Result<u16, String> {
    let v = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u16::from_str_radix(hex, 16),
        None => s.parse(),
    }
    .map_err(|_| format!("{s:?} is not an EtherType (e.g. 0x88B5)"))?;
    if v < 0x0600 {
        return Err(format!("{s}: an EtherType is 0x0600 or more"));
    }
    Ok(v)
}

fn parse_probability(s: &str) -> std::result::Result<f64, String> {
    let p: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..1.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{p} is not a probability in [0, 1)"))
    }
}

impl ConnArgs {
    /// Reads `--config`, if given, into these arguments, and checks the metrics endpoint's
    /// address (a configuration error, before anything is opened).
    fn read_config_file(&mut self) -> Result<Option<AttachFile>> {
        if let Some(a) = &self.prometheus_listen {
            let a = MetricsAddr::parse_local(a, self.prometheus_allow_remote)
                .map_err(|e| bad_config(anyhow::anyhow!("--prometheus-listen: {e}")))?;
            self.metrics = Some(a);
        }
        let Some(path) = &self.config else { return Ok(None) };
        let f = AttachFile::read(path).map_err(bad_config)?;
        self.metrics = f.prometheus_listen.clone();
        self.name = Some(f.name.clone());
        self.export = Some(f.export.clone());
        self.ifaces = f.ifaces.clone();
        self.targets = f.targets.iter().map(|m| m.to_string()).collect();
        self.target_name = f.target_name.clone();
        self.key = f.key_file.clone();
        self.host_id = f.host_id;
        self.digest = f.digest;
        self.ethertype = f.ethertype;
        if let Some(n) = f.channels_per_nic {
            self.channels_per_nic = n;
        }
        if let Some(t) = f.no_path_timeout {
            self.no_path_timeout = t;
        }
        if let Some(t) = f.io_timeout {
            self.io_timeout = Some(t);
        }
        if let Some(v) = f.scheduler {
            self.scheduler = v;
        }
        if let Some(v) = f.send_mode {
            self.send_mode = v;
        }
        if let Some(v) = f.engine_threads {
            self.engine_threads = v;
        }
        self.retry = true;
        Ok(Some(f))
    }

    fn export(&self) -> &str {
        self.export.as_deref().unwrap_or_default()
    }

    /// Binds the metrics endpoint, if one is asked for: before connecting, so that a taken
    /// address fails the start at once. It serves once the export is attached.
    fn bind_metrics(&self) -> Result<Option<MetricsListener>> {
        let Some(addr) = &self.metrics else { return Ok(None) };
        let l = MetricsListener::bind(addr).with_context(|| format!("prometheus_listen: binding {addr}"))?;
        Ok(Some(l))
    }

    /// Checks what this host must have before anything is opened: the interfaces exist, the
    /// key file is readable and private. Failures are configuration errors.
    fn preflight(&self) -> Result<InitiatorConfig> {
        for i in &self.ifaces {
            let c = std::ffi::CString::new(i.as_str()).map_err(|_| bad_config(anyhow::anyhow!("--iface {i:?}")))?;
            // SAFETY: `c` is a NUL-terminated string that outlives the call.
            if unsafe { libc::if_nametoindex(c.as_ptr()) } == 0 {
                return Err(bad_config(anyhow::Error::new(NoSuchInterface(i.clone()))));
            }
        }
        if let Some(t) = &self.target_name {
            if !tyche_init::attachfile::valid_name(t) {
                return Err(bad_config(anyhow::anyhow!(
                    "--target-name {t:?}: letters, digits, '.', '_', '-', ':' only"
                )));
            }
        }
        self.config().map_err(bad_config)
    }

    fn config(&self) -> Result<InitiatorConfig> {
        if !(self.no_path_timeout.is_finite() && self.no_path_timeout >= 0.0) {
            bail!("--no-path-timeout must be a non-negative number of seconds");
        }
        if let Some(t) = self.io_timeout {
            if !(t.is_finite() && t > 0.0 && t <= 86_400.0) {
                bail!("--io-timeout must be a number of seconds above 0 and at most 86400");
            }
        }
        let mut c = InitiatorConfig::new(self.export());
        c.ethertype = self.ethertype;
        // One channel per link when each channel has a NIC queue (and a link) of its own.
        c.channels_per_link = if self.queue_per_channel(false) { 1 } else { self.channels_per_nic };
        c.no_path_timeout = Duration::from_secs_f64(self.no_path_timeout);
        c.io_timeout = self.io_timeout.map(Duration::from_secs_f64);
        c.reconnect_warnings = self.reconnect_warnings;
        c.scheduler = self.scheduler;
        c.send_mode = self.send_mode;
        c.engine_threads = self.engine_threads;
        if let Some(n) = self.engine_thread_node {
            tyche_numa::node_cpus(n).with_context(|| format!("--engine-thread-node {n}"))?;
            warn!(node = n, "placement experiment: every engine thread on node {n}, not on its NICs'");
            c.engine_thread_node = Some(n);
        }
        c.poll = tyche_runtime::poll::PollConfig::new(self.poll, self.poll_budget_us).context("--poll-budget-us")?;
        c.digest = self.digest;
        if let Some(id) = self.host_id {
            c.host_id = Some(id);
        }
        if let Some(path) = &self.key {
            let key = tyche_channel::auth::read_key_file(path).map_err(|e| anyhow::anyhow!("--key {e}"))?;
            c.key = Some(key);
        }
        Ok(c)
    }

    /// Whether `--channels-per-nic N` opens N AF_XDP sockets per interface, on queues 0..N-1,
    /// one channel each: when every interface has N receive and transmit queues. Else the N
    /// channels share the interface's queue 0 (logged when `log`: once, where the links open).
    fn queue_per_channel(&self, log: bool) -> bool {
        if self.channels_per_nic < 2 || !self.tcp.is_empty() || self.loopback_mib.is_some() {
            return false;
        }
        let short: Vec<String> = self
            .ifaces
            .iter()
            .filter(|i| (tyche_xdp::queue_count(i).unwrap_or(1) as usize) < self.channels_per_nic)
            .map(|i| format!("{i} ({} queues)", tyche_xdp::queue_count(i).unwrap_or(1)))
            .collect();
        if log && !short.is_empty() {
            info!(
                channels_per_nic = self.channels_per_nic,
                "not every interface has a queue per channel: {}; the channels share queue 0",
                short.join(", ")
            );
        }
        short.is_empty()
    }

    /// The links to the target, and the in-process target when `--loopback-mib` asks for one.
    fn links(&self) -> Result<(Vec<Link>, Option<RamTarget>)> {
        if let Some(mib) = self.loopback_mib {
            let (links, _switches, target) = mem_links(RamExport::new(self.export(), mib << 20), 2)
                .context("starting the in-process target of --loopback-mib")?;
            return Ok((links, Some(target)));
        }
        let targets: Vec<MacAddr> = self
            .targets
            .iter()
            .map(|t| t.parse().map_err(|_| bad_config(anyhow::anyhow!("--target {t:?} is not a MAC address"))))
            .collect::<Result<_>>()?;
        let paths = if self.tcp.is_empty() { self.ifaces.len() } else { self.tcp.len() };
        if paths == 0 {
            return Err(bad_config(anyhow::anyhow!(
                "give --iface IF... or --tcp HOST:PORT... (with --target MAC, or none to discover it), or --loopback-mib N"
            )));
        }
        if targets.len() > 1 && targets.len() != paths {
            return Err(bad_config(anyhow::anyhow!(
                "give one --target MAC, one per --iface/--tcp, or none to find the target by discovery"
            )));
        }
        // Without --target: the link's target is learnt by discovery below.
        let target_of = |k: usize| match targets.len() {
            0 => MacAddr::BROADCAST,
            1 => targets[0],
            _ => targets[k],
        };
        let mut links = Vec::new();
        if !self.tcp.is_empty() {
            for (k, addr) in self.tcp.iter().enumerate() {
                let sa = std::net::ToSocketAddrs::to_socket_addrs(addr.as_str())
                    .with_context(|| format!("--tcp {addr}"))?
                    .next()
                    .with_context(|| format!("--tcp {addr}: no address"))?;
                let stream = std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(10))
                    .with_context(|| format!("connecting to {addr}"))?;
                let mac = MacAddr::local(0x7c00 + k as u32);
                let t = tyche_tcp::TcpTransport::new(stream, 9000, mac).with_context(|| format!("--tcp {addr}"))?;
                links.push(Link {
                    name: format!("tcp{k}:{addr}"),
                    transport: Box::new(t),
                    target: target_of(k),
                    node: None,
                });
            }
        }
        let queues = if self.queue_per_channel(true) { self.channels_per_nic as u32 } else { 1 };
        let numa = match self.channel_memory_node {
            None => tyche_xdp::NumaPlacement::Auto,
            Some(n) => {
                if !self.tcp.is_empty() || self.ifaces.is_empty() {
                    bail!("--channel-memory-node applies to AF_XDP channels (--iface) only");
                }
                tyche_numa::node_cpus(n).with_context(|| format!("--channel-memory-node {n}"))?;
                warn!(node = n, "placement experiment: every channel's memory on node {n}, not on its NIC's");
                tyche_xdp::NumaPlacement::Node(n)
            }
        };
        for (k, ifname) in self.ifaces.iter().enumerate().filter(|_| self.tcp.is_empty()) {
            let cfg =
                tyche_xdp::PortConfig { ethertype: self.ethertype, numa, copy: self.xdp_copy, ..Default::default() };
            let ports = tyche_xdp::XdpPort::open_queues(ifname, queues, &cfg)
                .with_context(|| format!("opening AF_XDP sockets on {ifname} (queues 0..{queues})"))?;
            for (q, port) in ports.into_iter().enumerate() {
                // Scheduled by the NIC's node, wherever the experiment put the memory.
                let node =
                    if self.channel_memory_node.is_some() { tyche_numa::nic_node(ifname) } else { port.numa_node() };
                info!(iface = %ifname, queue = q, ?node, mode = ?port.mode(), zero_copy = port.zero_copy(), "AF_XDP socket open");
                let name = if queues > 1 { format!("{ifname}/{q}") } else { ifname.clone() };
                links.push(Link { name, transport: Box::new(port), target: target_of(k), node });
            }
        }
        if targets.is_empty() {
            self.find_targets(&mut links)?;
        }
        if let Some(loss) = self.inject_loss {
            warn!(loss, "testing: injecting frame loss on every link, both ways");
            let faults = tyche_transport::FaultConfig { loss, ..Default::default() };
            links = links
                .into_iter()
                .enumerate()
                .map(|(k, l)| {
                    let lossy = tyche_transport::FaultInjector::new(l.transport, faults, faults, 0x1055 + k as u64);
                    Link { transport: Box::new(lossy), ..l }
                })
                .collect();
        }
        Ok((links, None))
    }

    /// Sets each link's target to the one that serves the export there (by discovery).
    fn find_targets(&self, links: &mut [Link]) -> Result<()> {
        let found = tyche_init::discover(links, self.ethertype, Duration::from_millis(1000));
        for (k, link) in links.iter_mut().enumerate() {
            let serving: Vec<MacAddr> = found
                .iter()
                .filter(|t| t.link_index == k && t.exports.iter().any(|e| e.name == self.export()))
                .map(|t| t.target)
                .collect();
            match serving[..] {
                [mac] => {
                    info!(link = %link.name, target = %mac, "target found by discovery");
                    link.target = mac;
                }
                [] => bail!("no target answered on {} with export {:?} (give --target MAC?)", link.name, self.export()),
                _ => bail!("several targets serve {:?} on {}; choose one with --target MAC", self.export(), link.name),
            }
        }
        Ok(())
    }
}

/// What the NUMA set-up decided, for the stats.
#[derive(Debug, Clone, Default)]
struct NumaSetup {
    topo: Option<tyche_numa::Topology>,
    /// Interfaces whose interrupts the stats show (AF_XDP links).
    ifaces: Vec<String>,
    /// Where the scheduler falls back: `model`, `distances` or `id`.
    fallback: String,
}

/// An attached export.
struct Opened {
    client: Client,
    /// The in-process target of `--loopback-mib` (served while this lives).
    _target: Option<RamTarget>,
    /// The target's MAC, or MACs, as given or found by discovery.
    target: String,
    /// The `<target>` of `/dev/disk/by-tyche/<target>/<export>`.
    target_name: String,
    numa: NumaSetup,
}

impl Opened {
    /// The attachment's record in the state directory.
    fn record(&self, conn: &ConnArgs, kind: &str, path: String, stats: String) -> state::Attachment {
        state::Attachment {
            pid: std::process::id(),
            kind: kind.into(),
            path,
            export: conn.export().to_owned(),
            target: self.target.clone(),
            stats,
            epoch: None,
            owed: false,
            name: conn.name.clone(),
            target_name: Some(self.target_name.clone()),
        }
    }
}

/// Attaches the export. `prior`: what a dead process serving the same device owed about its
/// writes (`attach --recover`), taken over by the new session's volume.
async fn open(conn: &ConnArgs, prior: DurabilityDebt) -> Result<Opened> {
    let mut cfg = conn.preflight()?;
    cfg.prior_writes = prior;
    let (links, target) = conn.links()?;
    let numa = numa_setup(conn, &links, &mut cfg)?;
    // Named after discovery, so a target found that way is named too.
    let mut macs: Vec<String> = links.iter().map(|l| l.target.to_string()).collect();
    macs.dedup();
    let name = if conn.loopback_mib.is_some() { "the loopback target".to_string() } else { macs.join(",") };
    let target_name = conn.target_name.clone().unwrap_or_else(|| {
        if conn.loopback_mib.is_some() {
            "loopback".into()
        } else {
            macs.first().cloned().unwrap_or_default()
        }
    });
    let client = tyche_init::connect(cfg, links)
        .await
        .with_context(|| format!("attaching export {:?} of target {name}", conn.export()))?;
    Ok(Opened { client, _target: target, target: name, target_name, numa })
}

/// The longest wait between two attempts of `--retry`.
const RETRY_MAX_WAIT: Duration = Duration::from_secs(10);

/// How long `--retry` (and `--config`) waits for an interface that does not exist yet (a NIC
/// whose driver or rename comes late at boot) before it is a configuration error; less than the
/// attachment unit's `TimeoutStartSec` (120 s), so the unit fails with exit 78 and is not
/// restarted over a misspelt name.
const INTERFACE_WAIT: Duration = Duration::from_secs(60);

/// An interface this host does not have (a configuration error, waited for with `--retry`).
#[derive(Debug)]
struct NoSuchInterface(String);

impl std::fmt::Display for NoSuchInterface {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interface {:?}: no such interface on this host", self.0)
    }
}

impl std::error::Error for NoSuchInterface {}

/// [`open`], tried again (with `--retry` or `--config`) until it works or SIGTERM comes:
/// configuration errors are not retried, except a missing interface for [`INTERFACE_WAIT`].
async fn open_retrying(conn: &ConnArgs, prior: DurabilityDebt) -> Result<Opened> {
    let mut wait = Duration::from_secs(1);
    let started = std::time::Instant::now();
    for attempt in 1u64.. {
        let e = match open(conn, prior).await {
            Ok(o) => return Ok(o),
            Err(e)
                if conn.retry
                    && started.elapsed() < INTERFACE_WAIT
                    && e.downcast_ref::<tyche_cli::BadConfig>().is_some_and(|b| b.0.is::<NoSuchInterface>()) =>
            {
                e
            }
            Err(e) if !conn.retry || tyche_cli::is_bad_config(&e) => return Err(e),
            Err(e) => e,
        };
        warn!(attempt, "cannot attach {:?} yet, trying again in {} s: {e:#}", conn.export(), wait.as_secs());
        notify(&[sd_notify::NotifyState::Status(&format!("waiting for the target (attempt {attempt}): {e:#}"))]);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            r = terminated() => {
                r?;
                // A stop while waiting is not a failure (systemctl stop of a unit still
                // waiting for its target).
                info!("stopped before {:?} was attached", conn.export());
                std::process::exit(0);
            }
        }
        wait = (wait * 2).min(RETRY_MAX_WAIT);
    }
    unreachable!("the attempts never run out")
}

/// Tells systemd (`Type=notify` units); does nothing outside systemd.
fn notify(states: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        warn!("cannot notify systemd: {e}");
    }
}

/// Before the engine threads start: the scheduler's fallback order (bandwidth model, cached,
/// on machines with several nodes; else distances; else ids), warnings for links in a low
/// bandwidth class, and the NICs' interrupts (`--irq-affinity`).
fn numa_setup(conn: &ConnArgs, links: &[Link], cfg: &mut InitiatorConfig) -> Result<NumaSetup> {
    use tyche_init::sched;
    use tyche_numa::irq::{self, IrqPolicy};
    let topo = tyche_numa::Topology::this_system().ok();
    let mut nodes: Vec<u32> = links.iter().filter_map(|l| l.node).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let model = match &topo {
        Some(t) if (t.nodes.len() > 1 || conn.model_refresh) && !nodes.is_empty() => {
            match tyche_numa::model::cached(
                &conn.model_cache,
                t,
                &nodes,
                &tyche_numa::ModelConfig::default(),
                conn.model_refresh,
            ) {
                Ok((m, how)) => {
                    info!(path = %conn.model_cache.display(), ?how, "I/O bandwidth model");
                    Some(m)
                }
                Err(e) => {
                    warn!("no I/O bandwidth model: {e}");
                    None
                }
            }
        }
        _ => None,
    };
    let (order, source) = sched::fallback_order(topo.as_ref(), model.as_ref(), &nodes);
    info!(source = ?source, "channel fallback order");
    if let Some(m) = &model {
        // The NICs' nodes with no channel of their own fall back to the first tier: warn when
        // that is a low bandwidth class for them.
        for n in topo.iter().flat_map(|t| t.nodes.iter()).map(|n| n.id).filter(|n| !nodes.contains(n)) {
            if let Some(&first) = order.fallback(n).first().and_then(|t| t.first()) {
                if let Some(w) = tyche_numa::model::low_class(m, "the buffers of requests", n, first) {
                    warn!("{w}");
                }
            }
        }
    }
    cfg.node_order = Some(order);
    let fallback = match source {
        sched::OrderSource::Model => "model",
        sched::OrderSource::Distances => "distances",
        sched::OrderSource::Id => "id",
    };
    let ifaces: Vec<String> =
        if conn.tcp.is_empty() && conn.loopback_mib.is_none() { conn.ifaces.clone() } else { Vec::new() };
    let roots = irq::Roots::default();
    for (iface, link) in ifaces.iter().zip(links) {
        let found = match irq::nic_irqs(&roots, iface) {
            Ok(n) => n,
            Err(e) if conn.irq_affinity == IrqPolicy::Auto => {
                return Err(e).with_context(|| format!("--irq-affinity auto: {iface}"))
            }
            Err(e) => {
                warn!(iface = %iface, "cannot read the NIC's interrupts: {e}");
                continue;
            }
        };
        if found.virtual_nic {
            info!(iface = %iface, "no IRQs (virtual NIC)");
            continue;
        }
        let Some(t) = &topo else { continue };
        let node = link.node.or_else(|| (t.nodes.len() == 1).then(|| t.nodes[0].id));
        let mut now = found;
        if conn.irq_affinity == IrqPolicy::Auto && !now.irqs.is_empty() {
            let node = node.with_context(|| format!("--irq-affinity auto: {iface}: its NUMA node is unknown"))?;
            // One core of the node (its lowest) takes the interrupts; this process's engine,
            // NBD and ublk threads keep off it.
            let cores = t.node(node).map(|n| n.cores.clone()).unwrap_or_default();
            if cores.len() < 2 {
                bail!("--irq-affinity auto: {iface}: node {node} has {} core(s): no core for the interrupts other than the engine thread's", cores.len());
            }
            now = irq::apply_auto(&roots, &now, &[cores[0][0]])
                .with_context(|| format!("--irq-affinity auto: {iface}"))?;
            sched::reserve_cpus(&cores[0]);
            info!(iface = %iface, irqs = %now.describe(), "NIC interrupts moved off the engine threads' cores");
        }
        if let Some(cpus) = node.and_then(sched::node_cpus) {
            for w in irq::check(t, &now, &cpus, &[]) {
                warn!("{w}");
            }
        }
    }
    Ok(NumaSetup { topo, ifaces, fallback: fallback.to_owned() })
}

/// Waits for SIGINT or SIGTERM.
async fn terminated() -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("SIGINT handler")?,
        _ = term.recv() => {}
    }
    Ok(())
}

/// The session's report, as `tyche-init stats` and the metrics endpoint read it: asked of the
/// engine (answered between two rounds of its loop), with the NBD connections' reports when
/// `nbd`. `None` when the session does not answer (it is closing).
fn session_report(client: &Client, nbd: Option<&tyche_init::NbdStats>) -> Option<tyche_init::Report> {
    let mut r = client.report_blocking().ok()?;
    if let Some(n) = nbd {
        r.nbd = n.snapshot();
        let (copied, write) = n.copied();
        r.payload_copied_bytes += copied;
        r.payload_copied_write_bytes += write;
    }
    Some(r)
}

/// Serves the metrics endpoint bound by [`ConnArgs::bind_metrics`], if any, from the report
/// `tyche-init stats` reads (`session_report`), labelled with the attachment. A failure to start
/// it is logged: the attachment goes on without it.
fn serve_metrics(
    listener: Option<MetricsListener>,
    conn: &ConnArgs,
    opened: &Opened,
    (kind, path): (&str, &str),
    nbd: Option<tyche_init::NbdStats>,
) -> Option<MetricsServer> {
    let listener = listener?;
    let id = tyche_init::metrics::Identity {
        attachment: conn.name.clone().unwrap_or_else(|| path.to_owned()),
        export: conn.export().to_owned(),
        target: opened.target_name.clone(),
        kind: kind.to_owned(),
        path: path.to_owned(),
    };
    let client = opened.client.clone();
    match tyche_init::metrics::serve(listener, id, move || session_report(&client, nbd.as_ref())) {
        Ok(s) => Some(s),
        Err(e) => {
            warn!("prometheus_listen: cannot start the endpoint: {e}");
            None
        }
    }
}

/// Starts the stats socket of a front end; `nbd` adds the NBD connections' reports.
fn start_stats(
    conn: &ConnArgs,
    dir: &std::path::Path,
    pid: u32,
    client: &Client,
    nbd: Option<tyche_init::NbdStats>,
    numa: NumaSetup,
) -> (Option<tyche_runtime::stats_socket::StatsServer>, String) {
    let path = conn.stats_socket.clone().unwrap_or_else(|| state::stats_socket(dir, pid));
    let c = client.clone();
    let roots = tyche_numa::irq::Roots::default();
    let source = move || {
        let mut r = session_report(&c, nbd.as_ref()).unwrap_or_default();
        // Read afresh, against the CPUs each link's engine thread reports for itself.
        r.irqs = numa
            .ifaces
            .iter()
            .map(|iface| {
                let cpus = r.links.iter().find(|l| l.name == *iface).map(|l| l.thread.cpus.clone()).unwrap_or_default();
                tyche_numa::IrqReport::read(&roots, iface, numa.topo.as_ref(), &cpus)
            })
            .collect();
        r.fallback = numa.fallback.clone();
        r
    };
    match tyche_runtime::stats_socket::StatsServer::start(&path, "tyche-stats", source) {
        Ok(s) => (Some(s), path.display().to_string()),
        Err(e) => {
            warn!(socket = %path.display(), "no stats socket: {e}");
            (None, String::new())
        }
    }
}

async fn serve_nbd(
    socket: PathBuf,
    conn: ConnArgs,
    max_inflight: usize,
    nbd_nodes: Vec<u32>,
    engine_io: bool,
) -> Result<()> {
    let metrics = conn.bind_metrics()?;
    let opened = open_retrying(&conn, DurabilityDebt::Clear).await?;
    let client = opened.client.clone();
    let i = client.info();
    println!("{}", socket.display());
    info!(export = %i.export, size = i.size, session = format_args!("{:#x}", i.session), "attached");
    let opts = NbdOptions { max_inflight, connection_nodes: nbd_nodes, engine_io, ..NbdOptions::new(conn.export()) };
    let dir = state::dir();
    let pid = std::process::id();
    let (_stats, stats) = start_stats(&conn, &dir, pid, &client, Some(opts.stats.clone()), opened.numa.clone());
    let socket_path = socket.display().to_string();
    let _metrics = serve_metrics(metrics, &conn, &opened, ("nbd", &socket_path), Some(opts.stats.clone()));
    let rec = opened.record(&conn, "nbd", socket_path, stats);
    if let Err(e) = state::record(&dir, &rec) {
        warn!("cannot record the attachment in {}: {e} (list/detach will not see it)", dir.display());
    }
    // Bound before systemd hears READY, so that a client started after the unit finds it.
    if socket.exists() {
        std::fs::remove_file(&socket).with_context(|| format!("removing the old socket {}", socket.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
    info!(socket = %socket.display(), export = %conn.export(), size = client.size(), "serving NBD");
    notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&format!("serving {}", socket.display()))]);
    let server = tyche_init::nbd::serve(listener, client.clone(), opts);
    let result = tokio::select! {
        r = server => r.with_context(|| format!("NBD server on {}", socket.display())),
        r = terminated() => r,
    };
    info!("detaching");
    client.close().await;
    let _ = std::fs::remove_file(&socket);
    state::remove(&dir, pid);
    result
}

/// How often an attachment's record is brought up to date with what its volume owes.
const DURABILITY_RECORD_EVERY: Duration = Duration::from_secs(1);

/// Writes the attachment's record with what the volume owes about its writes (its session's
/// durability epoch, a loss still to report), and keeps it up to date while the process runs.
/// A record out of date errs on the safe side: it names the epoch of an earlier session (a
/// recovering process then finds another epoch and reports a loss that was perhaps reported
/// already), never a newer one. Returns the task that updates it (abort it before removing the
/// record), or `None` when the first record could not be written.
async fn record_durability(
    client: &Client,
    dir: &std::path::Path,
    mut rec: state::Attachment,
) -> Option<tokio::task::JoinHandle<()>> {
    if let Ok(s) = client.stats().await {
        rec.set_durability(s.durability_epoch, s.durability_debt);
    }
    if let Err(e) = state::record(dir, &rec) {
        warn!("cannot record the attachment in {}: {e} (list/detach/--recover will not see it)", dir.display());
        return None;
    }
    let (client, dir) = (client.clone(), dir.to_owned());
    Some(tokio::spawn(async move {
        loop {
            tokio::time::sleep(DURABILITY_RECORD_EVERY).await;
            let Ok(s) = client.stats().await else { return };
            let before = (rec.epoch, rec.owed);
            rec.set_durability(s.durability_epoch, s.durability_debt);
            if (rec.epoch, rec.owed) != before {
                if let Err(e) = state::record(&dir, &rec) {
                    warn!("cannot update the attachment's record in {}: {e}", dir.display());
                }
            }
        }
    }))
}

/// How `attach` gets its device.
enum Device {
    /// A new one.
    Create(UblkOptions),
    /// `--recover N`: the device a dead attach left.
    Recover(u32),
}

async fn attach(conn: ConnArgs, device: Device) -> Result<()> {
    // Fail before connecting when the kernel cannot give us a device.
    UblkFrontend::probe()?;
    let metrics = conn.bind_metrics()?;
    let dir = state::dir();
    let device = resume_own_device(&conn, &dir, device)?;
    let (prior, dead) = recovery_of(&dir, &device)?;
    // Whether a device in use outlives this process (for recovery) when it is told to stop.
    let keeps_device = match device {
        Device::Create(o) => o.recovery,
        Device::Recover(_) => true,
    };
    // A new session from this host fences the dead process's session on the target, so none of
    // its writes lands after ours.
    let opened = open_retrying(&conn, prior).await?;
    let client = opened.client.clone();
    let (server, rx) = spawn_ublk(client.clone(), device)?;
    let (path, stop) = match rx.await {
        Ok(Ok(created)) => created,
        Ok(Err(e)) => {
            client.close().await;
            return Err(e.into());
        }
        Err(_) => bail!("the ublk thread ended before creating the device"),
    };
    println!("{path}");
    let pid = std::process::id();
    let (_stats, stats) = start_stats(&conn, &dir, pid, &client, None, opened.numa.clone());
    let _metrics = serve_metrics(metrics, &conn, &opened, ("ublk", &path), None);
    let rec = opened.record(&conn, "ublk", path.clone(), stats);
    // The record says what this process owes about its writes, for the next `--recover`;
    // once it is written, the dead processes' records are taken over.
    let recorder = record_durability(&client, &dir, rec.clone()).await;
    if recorder.is_some() {
        for d in &dead {
            state::remove(&dir, d.pid);
        }
    }
    notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&format!("serving {path}"))]);
    let (exit_client, exit_dir) = (client.clone(), dir.clone());
    tokio::spawn(async move {
        if terminated().await.is_err() {
            return;
        }
        notify(&[sd_notify::NotifyState::Stopping]);
        if keeps_device && tyche_init::frontend::device_in_use(&path) {
            // A mounted filesystem (or md) stays usable: the device waits for the next
            // process (`systemctl restart`, `attach --config` of the same file, or
            // `attach --recover`), which reads what this one owed from its record.
            let mut rec = rec;
            if let Ok(s) = exit_client.stats().await {
                rec.set_durability(s.durability_epoch, s.durability_debt);
            }
            let _ = state::record(&exit_dir, &rec);
            info!("{path} is in use: left for recovery by the next attach of it; exiting");
            std::process::exit(0);
        }
        info!("detaching");
        stop();
    });
    let result = tokio::task::spawn_blocking(move || {
        server
            .join()
            .unwrap_or_else(|_| Err(tyche_init::frontend::FrontendError::Other("the ublk thread panicked".into())))
    })
    .await;
    if let Some(r) = recorder {
        r.abort();
    }
    client.close().await;
    state::remove(&dir, pid);
    result??;
    Ok(())
}

/// For `--recover`: the device must exist and be served by no live process; what the dead
/// processes that served it owed about their writes, and their records.
fn recovery_of(dir: &std::path::Path, device: &Device) -> Result<(DurabilityDebt, Vec<state::Attachment>)> {
    if let Device::Recover(id) = device {
        if !std::path::Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists() {
            bail!("--recover: there is no ublk device {id} (/dev/ublkc{id})");
        }
        if let Some(a) = state::list(dir)?.into_iter().find(|a| a.path == format!("/dev/ublkb{id}")) {
            bail!("--recover: /dev/ublkb{id} is still served by pid {} (detach it, or kill it first)", a.pid);
        }
    }
    // What the dead process owed about its writes: it may have had writes not flushed,
    // acknowledged under the epoch its record names; the new session's volume compares.
    Ok(match device {
        Device::Recover(id) => {
            let dead = state::dead_records_of(dir, &format!("/dev/ublkb{id}"))?;
            let prior = state::inherited_debt(&dead);
            info!(records = dead.len(), ?prior, "what the process that served /dev/ublkb{id} owed about its writes");
            (prior, dead)
        }
        Device::Create(_) => (DurabilityDebt::Clear, Vec::new()),
    })
}

/// How the ublk thread's serving ended.
type UblkServed = Result<(), tyche_init::frontend::FrontendError>;

/// The ublk thread's word once the device exists (its path and stopper), or why it could not
/// be made.
type UblkMade =
    tokio::sync::oneshot::Receiver<Result<(String, Box<dyn FnOnce() + Send>), tyche_init::frontend::FrontendError>>;

/// Creates (or recovers) the ublk device and serves it on a thread of its own (libublk keeps
/// its control ring per thread: the device is created and served on one thread). The receiver
/// gets the device's path and its stopper once it exists, or why it could not be made.
fn spawn_ublk(client: Client, device: Device) -> Result<(std::thread::JoinHandle<UblkServed>, UblkMade)> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let server = std::thread::Builder::new().name("tyche-ublk".into()).spawn(move || {
        let dev = match device {
            Device::Create(opts) => UblkFrontend::create(client, opts),
            Device::Recover(id) => UblkFrontend::recover(client, id),
        };
        match dev {
            Ok(dev) => {
                let _ = tx.send(Ok((dev.path(), dev.stopper())));
                dev.serve()
            }
            Err(e) => {
                let _ = tx.send(Err(e));
                Ok(())
            }
        }
    })?;
    Ok((server, rx))
}

/// With `--config` (or `--dev-id N`): the device a dead process serving the same attachment
/// left for recovery is resumed rather than a second one created; an attachment another
/// process serves is refused.
fn resume_own_device(conn: &ConnArgs, dir: &std::path::Path, device: Device) -> Result<Device> {
    let Device::Create(opts) = device else { return Ok(device) };
    if let Some(name) = &conn.name {
        if let Some(a) = state::list(dir)?.into_iter().find(|a| a.name.as_deref() == Some(name)) {
            bail!("attachment {name:?} is attached already: {} served by pid {}", a.path, a.pid);
        }
    }
    let mine = |a: &state::Attachment| match (&conn.name, opts.dev_id) {
        (Some(name), _) => a.name.as_deref() == Some(name),
        (None, Some(id)) => a.path == format!("/dev/ublkb{id}"),
        (None, None) => false,
    };
    let waiting: Vec<state::Attachment> = state::awaiting_recovery(dir)?.into_iter().filter(mine).collect();
    match waiting.iter().filter_map(|a| tyche_init::frontend::ublk_id(&a.path)).next() {
        Some(id) => {
            info!(device = %format!("/dev/ublkb{id}"), "resuming the device a previous process left for recovery");
            Ok(Device::Recover(id))
        }
        None => Ok(Device::Create(opts)),
    }
}

async fn ram_target(ifaces: Vec<String>, export: String, mib: u64) -> Result<()> {
    let mut ports: Vec<Box<dyn tyche_transport::FrameTransport + Send>> = Vec::new();
    for ifname in &ifaces {
        let cfg = tyche_xdp::PortConfig::default();
        let port = tyche_xdp::XdpPort::open(ifname, &cfg).with_context(|| format!("AF_XDP socket on {ifname}"))?;
        println!("{ifname} {}", tyche_transport::FrameTransport::capabilities(&port).local_mac);
        ports.push(Box::new(port));
    }
    let target = RamTarget::spawn(RamExport::new(&export, mib << 20), ports).context("starting the RAM target")?;
    info!(export = %export, mib, "RAM target serving");
    terminated().await?;
    drop(target);
    Ok(())
}

/// One export as `discover --json` prints it.
#[derive(serde::Serialize)]
struct DiscoveredJson {
    link: String,
    target: String,
    export: String,
    size: u64,
    block_size: u32,
    read_only: bool,
    needs_key: bool,
    discard: bool,
}

/// Discovery through the kernel (AF_PACKET), so that it works beside a live attachment on the
/// same link, whatever queue that holds: the DISCOVER goes out of a raw socket, and a
/// `DiscoveryTap` has the link's Tyche XDP program (if one is attached) pass the replies to
/// this nonce on to the kernel instead of into the live AF_XDP socket.
fn discover(ifaces: &[String], wait: f64, ethertype: u16, json: bool) -> Result<()> {
    let nonce = tyche_init::new_nonce();
    let mut links = Vec::new();
    let mut taps = Vec::new();
    for ifname in ifaces {
        taps.push(tyche_xdp::DiscoveryTap::open(ifname, nonce).with_context(|| format!("discovering on {ifname}"))?);
        let raw = tyche_xdp::PacketTransport::open(ifname, ethertype)
            .with_context(|| format!("opening an AF_PACKET socket on {ifname}"))?;
        links.push(Link { name: ifname.clone(), transport: Box::new(raw), target: MacAddr::BROADCAST, node: None });
    }
    let wait = Duration::try_from_secs_f64(wait).context("--wait")?;
    let found = tyche_init::discover_with_nonce(&mut links, ethertype, wait, nonce);
    drop(taps);
    use tyche_wire::flags::{EXPORT_DISCARD, EXPORT_NEEDS_KEY, EXPORT_READ_ONLY};
    if json {
        let all: Vec<DiscoveredJson> = found
            .iter()
            .flat_map(|t| {
                t.exports.iter().map(|e| DiscoveredJson {
                    link: t.link.clone(),
                    target: t.target.to_string(),
                    export: e.name.clone(),
                    size: e.size,
                    block_size: e.block_size,
                    read_only: e.flags & EXPORT_READ_ONLY != 0,
                    needs_key: e.flags & EXPORT_NEEDS_KEY != 0,
                    discard: e.flags & EXPORT_DISCARD != 0,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    if found.is_empty() {
        println!("no targets answered on {}", ifaces.join(", "));
    }
    for t in found {
        println!("{} target {}", t.link, t.target);
        for e in t.exports {
            let flags: Vec<&str> =
                [(EXPORT_READ_ONLY, "read-only"), (EXPORT_NEEDS_KEY, "key"), (EXPORT_DISCARD, "discard")]
                    .iter()
                    .filter(|(bit, _)| e.flags & bit != 0)
                    .map(|(_, n)| *n)
                    .collect();
            println!("  {:<20} {:>12} bytes  block {}  {}", e.name, e.size, e.block_size, flags.join(","));
        }
    }
    Ok(())
}

fn stats(what: &str, json: bool) -> Result<()> {
    let p = std::path::Path::new(what);
    let socket = if what.ends_with(".stats.sock") && p.exists() {
        p.to_owned()
    } else {
        let all = state::list(&state::dir())?;
        let a = all
            .iter()
            .find(|a| a.path == what || a.pid.to_string() == what)
            .with_context(|| format!("no attachment {what:?} (see `tyche-init list`)"))?;
        if a.stats.is_empty() {
            bail!("attachment {what:?} has no stats socket");
        }
        PathBuf::from(&a.stats)
    };
    let r: tyche_init::Report = tyche_runtime::stats_socket::query(&socket)
        .with_context(|| format!("reading the stats socket {}", socket.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", r.human());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    tyche_cli::exit("tyche-init: ", run())
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TYCHE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    match cli.command {
        Command::Discover { ifaces, wait, ethertype, json } => discover(&ifaces, wait, ethertype, json),
        Command::Attach { mut conn, mut queues, mut depth, recover, mut dev_id, no_recovery } => {
            if let Some(f) = conn.read_config_file()? {
                queues = f.queues.unwrap_or(queues);
                depth = f.depth.unwrap_or(depth);
                dev_id = f.dev_id.or(dev_id);
            }
            let device = match recover {
                Some(d) => Device::Recover(
                    tyche_init::frontend::ublk_id(&d)
                        .with_context(|| format!("--recover {d:?}: give /dev/ublkbN or N"))?,
                ),
                None => Device::Create(UblkOptions { queues, depth, recovery: !no_recovery, dev_id }),
            };
            rt.block_on(attach(conn, device))
        }
        Command::ServeNbd { socket, mut conn, max_inflight, nbd_nodes, nbd_io } => {
            conn.read_config_file()?;
            rt.block_on(serve_nbd(socket, conn, max_inflight, nbd_nodes, nbd_io == NbdIo::Engine))
        }
        Command::Stats { what, json } => stats(&what, json),
        Command::List { json } => admin::list(json),
        Command::GenerateDocs { out } => {
            tyche_cli::generate_docs(<Cli as clap::CommandFactory>::command(), &out).map_err(Into::into)
        }
        Command::UdevInfo { device } => admin::udev_info(&device),
        Command::AttachAll { dir, wait } => admin::attach_all(&dir, wait),
        Command::Detach { what, force } => admin::detach(&what, force),
        Command::RamTarget { ifaces, export, mib } => rt.block_on(ram_target(ifaces, export, mib)),
    }
}
