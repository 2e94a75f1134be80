//! `tyched`: the Tyche target daemon.
//!
//! Subcommands:
//! - `tyched serve [--config FILE] [--export NAME=PATH[:SIZE]|NAME=ram:SIZE]... [--iface IF]... ...`:
//!   serve exports until SIGTERM/SIGINT; SIGHUP reloads the configuration (docs/tyched.md, "Reloading").
//! - `tyched stats [--socket PATH] [--json]`: the counters of a running daemon (also served as
//!   Prometheus text on `GET /metrics` with `tyched serve --prometheus-listen ADDR`).
//! - `tyched topology [--xml FILE] [--json] [--model]`: the NUMA nodes, NICs and their nodes,
//!   and the channel placement plan (and, with `--model`, the I/O bandwidth model).

mod topology;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use tyche_metrics::MetricsListener;
use tyched::config::{Config, ExportConfig, NetworkThreads, TransportKind};
use tyched::stats_server;
use tyched::{Nic, Placement, Target};

/// Tyche target daemon.
#[derive(Debug, Parser)]
#[command(name = "tyched", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve exports until SIGTERM or SIGINT (SIGHUP reads the configuration again).
    Serve(ServeArgs),
    /// Print the counters of a running daemon.
    Stats(StatsArgs),
    /// Make a running daemon read its configuration again (SIGHUP), and wait for the outcome.
    ///
    /// Exit 0 when it was applied (changes that need a restart are listed), 1 when it was
    /// refused (nothing changed).
    Reload(ReloadArgs),
    /// Show NUMA nodes, NICs with their node, and the channel placement plan.
    Topology(topology::TopologyArgs),
    /// Packaging: write the man pages (OUT/man) and shell completions (OUT/completions).
    #[command(hide = true)]
    GenerateDocs {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Configuration file (TOML); flags below override or extend it.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// An export: NAME=PATH (an existing file or block device), NAME=PATH:SIZE (a file, created
    /// with mode 0600 or grown to SIZE, e.g. disk0=/var/lib/tyched/disk0.img:8G) or NAME=ram:SIZE
    /// (e.g. disk=ram:256M).
    #[arg(long = "export", value_name = "NAME=PATH[:SIZE]|NAME=ram:SIZE")]
    exports: Vec<String>,
    /// Interface to serve on (repeat for several NICs).
    #[arg(long = "iface", value_name = "IF")]
    ifaces: Vec<String>,
    /// Channels per NIC.
    #[arg(long)]
    channels_per_nic: Option<u16>,
    /// Channels on NIC queues of their own: none, queue-mac (an address and an ntuple flow
    /// rule per queue, installed on the NIC; fails on a NIC without ntuple filters) or
    /// queue-mac-no-rules (the addresses alone, for veth).
    #[arg(long)]
    steer: Option<tyched::steer::Steer>,
    /// Transport: xdp, tcp or packet.
    #[arg(long)]
    transport: Option<TransportKind>,
    /// TCP transport: address to listen on (host:port; one connection per --iface).
    #[arg(long)]
    tcp_listen: Option<String>,
    /// Storage worker threads (0: automatic).
    #[arg(long)]
    workers: Option<usize>,
    /// Network threads: per-nic (one per NIC, pinned to its node) or one.
    #[arg(long)]
    network_threads: Option<NetworkThreads>,
    /// AF_XDP zero copy: auto (where the driver offers it), copy (never) or zero-copy (or
    /// refuse to start).
    #[arg(long, value_name = "MODE")]
    xdp_copy: Option<tyche_xdp::CopyMode>,
    /// File and block exports use the worker threads, not io_uring.
    #[arg(long)]
    no_io_uring: bool,
    /// How network threads wait when idle: adaptive (poll a while after work, then sleep),
    /// sleep or spin.
    #[arg(long)]
    poll: Option<tyche_runtime::poll::PollMode>,
    /// Adaptive polling: the longest a network thread polls after work before it sleeps (µs).
    #[arg(long, value_name = "US")]
    poll_budget_us: Option<u64>,
    /// Unix socket for `tyched stats`.
    #[arg(long)]
    stats_socket: Option<PathBuf>,
    /// Serve Prometheus text on GET /metrics at IP:PORT (loopback only unless
    /// --prometheus-allow-remote), localhost:PORT, or a Unix socket path.
    #[arg(long, value_name = "ADDR")]
    prometheus_listen: Option<String>,
    /// Allow --prometheus-listen on a non-loopback address (the endpoint has no authentication).
    #[arg(long)]
    prometheus_allow_remote: bool,
    /// The NICs' interrupts: keep (leave them, report and warn) or auto (each NIC's IRQs on
    /// cores of its node that run no network thread; needs root).
    #[arg(long)]
    irq_affinity: Option<tyche_numa::irq::IrqPolicy>,
    /// Placement experiments only: every AF_XDP channel's memory (UMEM, rings, slot memory) on
    /// this NUMA node instead of its NIC's (the NESUS paper's misplaced-memory case).
    #[arg(long, value_name = "NODE")]
    channel_memory_node: Option<u32>,
    /// Placement experiments only: every network thread (and its channels' completion workers)
    /// on this NUMA node's CPUs instead of its NIC's (the NESUS paper's misplaced threads).
    #[arg(long, value_name = "NODE")]
    network_thread_node: Option<u32>,
    /// Where the measured I/O bandwidth model is kept (default
    /// /var/lib/tyche/bandwidth-model.json).
    #[arg(long, value_name = "FILE")]
    model_cache: Option<PathBuf>,
    /// Measure the I/O bandwidth model again instead of using the cached one.
    #[arg(long)]
    model_refresh: bool,
    /// CPUs where this host's applications (the storage's consumers) run, e.g. `0-3,8`:
    /// network threads and completion workers keep off their cores; where that leaves a NIC's
    /// node no free core, the I/O bandwidth model decides where its channels' threads go.
    #[arg(long, value_name = "LIST")]
    consumer_cpus: Option<String>,
    /// Check the configuration and exit.
    #[arg(long)]
    check: bool,
}

#[derive(Debug, Args)]
struct StatsArgs {
    /// The daemon's stats socket.
    #[arg(long, default_value = "/run/tyched/stats.sock")]
    socket: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Print the Prometheus text format.
    #[arg(long, conflicts_with = "json")]
    prometheus: bool,
}

#[derive(Debug, Args)]
struct ReloadArgs {
    /// The daemon's process id (systemd's $MAINPID).
    #[arg(long)]
    pid: i32,
    /// The daemon's stats socket, where the outcome is read (default: the `stats_socket` of
    /// --config, else /run/tyched/stats.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The daemon's configuration file, for its `stats_socket`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Seconds to wait for the outcome.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

/// Exit status of a NIC that another process holds now (sysexits' EX_UNAVAILABLE): a queue
/// another Tyche process serves, or a foreign XDP program. Not a configuration error: it may
/// pass when that process exits, so a unit may restart on it.
const EX_UNAVAILABLE: u8 = 69;

/// Whether `e` is a NIC taken by another process (see [`EX_UNAVAILABLE`]).
fn nic_taken(e: &anyhow::Error) -> bool {
    use tyche_xdp::Error as X;
    e.chain().any(|c| {
        matches!(c.downcast_ref::<X>(), Some(X::QueueBusy { .. } | X::ForeignProgram { .. } | X::Incompatible { .. }))
    })
}

fn main() -> std::process::ExitCode {
    // Log lines go to stderr; stdout stays parseable.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(EnvFilter::try_from_env("TYCHE_LOG").unwrap_or_else(|_| EnvFilter::new("info")))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Stats(args) => stats(&args),
        Command::Reload(args) => reload_command(&args),
        Command::Topology(args) => topology::run(&args),
        Command::GenerateDocs { out } => {
            tyche_cli::generate_docs(<Cli as clap::CommandFactory>::command(), &out).map_err(Into::into)
        }
    };
    if let Err(e) = &result {
        if nic_taken(e) {
            // One line, as for every error (tyche_cli::exit).
            eprintln!("Error: {e:#}");
            return std::process::ExitCode::from(EX_UNAVAILABLE);
        }
    }
    tyche_cli::exit("Error: ", result)
}

fn load_config(args: &ServeArgs) -> Result<Config> {
    let mut config = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let c: Config = toml::from_str(&text).with_context(|| format!("{}", p.display()))?;
            c
        }
        None => Config::default(),
    };
    for e in &args.exports {
        config.exports.push(ExportConfig::from_flag(e)?);
    }
    if !args.ifaces.is_empty() {
        config.ifaces = args.ifaces.clone();
    }
    if let Some(n) = args.channels_per_nic {
        config.channels_per_nic = n;
    }
    if let Some(t) = args.transport {
        config.transport = t;
    }
    if let Some(s) = args.steer {
        config.steer = s;
    }
    if let Some(a) = &args.tcp_listen {
        config.tcp_listen = Some(a.clone());
    }
    if let Some(w) = args.workers {
        config.workers = w;
    }
    if let Some(m) = args.xdp_copy {
        config.xdp_copy = m;
    }
    if let Some(t) = args.network_threads {
        config.network_threads = t;
    }
    if args.no_io_uring {
        config.io_uring = false;
    }
    if let Some(m) = args.poll {
        config.poll = m;
    }
    if let Some(b) = args.poll_budget_us {
        config.poll_budget_us = b;
    }
    if let Some(s) = &args.stats_socket {
        config.stats_socket = s.clone();
    }
    if let Some(a) = &args.prometheus_listen {
        config.prometheus_listen = Some(a.clone());
    }
    if args.prometheus_allow_remote {
        config.prometheus_allow_remote = true;
    }
    if let Some(p) = args.irq_affinity {
        config.irq_affinity = p;
    }
    if let Some(n) = args.channel_memory_node {
        config.channel_memory_node = Some(n);
    }
    if let Some(n) = args.network_thread_node {
        config.network_thread_node = Some(n);
    }
    if let Some(p) = &args.model_cache {
        config.model_cache = Some(p.clone());
    }
    if let Some(l) = &args.consumer_cpus {
        config.consumer_cpus = Some(l.clone());
    }
    config.validate()?;
    Ok(config)
}

fn serve(args: ServeArgs) -> Result<()> {
    let config = load_config(&args)
        .and_then(|c| {
            c.preflight()?;
            Ok(c)
        })
        .map_err(tyche_cli::bad_config)?;
    if args.check {
        println!("configuration ok: {} export(s), {} interface(s)", config.exports.len(), config.ifaces.len());
        return Ok(());
    }
    let term = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&term)).context("installing signal handlers")?;
    }
    // SIGHUP (`systemctl reload tyched`): read the configuration again (docs/tyched.md,
    // "Reloading"). Registered before the NICs open: a SIGHUP during start-up is applied once
    // the target serves, never the default action (exit).
    let hup = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, Arc::clone(&hup)).context("installing signal handlers")?;
    // Bound before the NICs open, so that a taken or bad address fails the start at once.
    let prometheus = match config.prometheus_addr()? {
        Some(addr) => Some(MetricsListener::bind(&addr).with_context(|| format!("prometheus_listen: binding {addr}"))?),
        None => None,
    };
    check_placement_experiments(&config)?;
    let mut steering = Steering::default();
    let nics = open_nics(&config, &term, &mut steering)?;
    if term.load(Ordering::SeqCst) {
        return Ok(());
    }
    let topo = tyche_numa::Topology::this_system().ok();
    let model = topo.as_ref().and_then(|t| bandwidth_model(&config, t, args.model_refresh));
    let (mut placement, plan) = placement_for(&config, &nics, topo.as_ref(), model.as_ref());
    placement.queue_addresses = std::mem::take(&mut steering.addresses);
    if let (Some(model), Some(plan)) = (&model, &plan) {
        for w in tyche_numa::model::plan_warnings(model, plan) {
            tracing::warn!("{w}");
        }
    }
    let roots = tyche_numa::irq::Roots::default();
    interrupts(&config, &nics, &placement, topo.as_ref(), &roots)?;
    let mut handle = Target::start_placed(config.clone(), nics, placement).context("starting the target")?;
    let _stats = match stats_server::start(&config.stats_socket, with_irqs(handle.stats_source(), &config, &topo)) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(socket = %config.stats_socket.display(), "no stats socket: {e}");
            None
        }
    };
    let _prometheus = match prometheus {
        Some(l) => Some(
            tyched::prometheus::serve(l, with_irqs(handle.stats_source(), &config, &topo))
                .context("prometheus_listen: starting the endpoint")?,
        ),
        None => None,
    };
    // systemd (Type=notify): every export and NIC is serving now. Outside systemd this does
    // nothing.
    let status = format!("serving {} export(s) on {}", config.exports.len(), config.ifaces.join(", "));
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)])
    {
        tracing::warn!("cannot tell systemd the daemon is ready: {e}");
    }
    while !term.load(Ordering::SeqCst) && !handle.is_finished() {
        if hup.swap(false, Ordering::SeqCst) {
            reload(&args, &mut handle, &status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let died = !term.load(Ordering::SeqCst);
    if !died {
        tracing::info!("signal received: shutting down");
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    }
    let snap = handle.shutdown();
    // The flow rules and queue addresses go once no channel uses them.
    drop(steering);
    if died {
        bail!("the network thread stopped unexpectedly (see the log above)");
    }
    tracing::info!(sessions = snap.sessions, reclaimed = snap.sessions_reclaimed, "exited cleanly");
    Ok(())
}

/// The placement experiments (`channel_memory_node`, `network_thread_node`): refused on a
/// machine without the node, and warned about when set.
fn check_placement_experiments(config: &Config) -> Result<()> {
    if let Some(n) = config.channel_memory_node {
        if !std::path::Path::new(&format!("/sys/devices/system/node/node{n}")).exists() {
            bail!("channel_memory_node = {n}: this machine has no NUMA node {n}");
        }
        if config.transport != TransportKind::Xdp {
            bail!("channel_memory_node applies to AF_XDP channels (transport = \"xdp\") only");
        }
        tracing::warn!(
            node = n,
            "placement experiment: every channel's memory on node {n}, not on its NIC's (channel_memory_node)"
        );
    }
    if let Some(n) = config.network_thread_node {
        if !std::path::Path::new(&format!("/sys/devices/system/node/node{n}")).exists() {
            bail!("network_thread_node = {n}: this machine has no NUMA node {n}");
        }
        tracing::warn!(
            node = n,
            "placement experiment: every network thread and its completion workers on node {n}, not on its NIC's (network_thread_node)"
        );
    }
    Ok(())
}

/// Reads the configuration again (the file and the same flags) and applies what can change
/// while the target runs; logs what was applied, what needs a restart, or why nothing was.
/// Tells systemd it is reloading, then ready again (`status` its status line before).
fn reload(args: &ServeArgs, handle: &mut tyched::TargetHandle, status: &str) {
    let mut notice = vec![sd_notify::NotifyState::Reloading];
    // systemd 253 and later want the time with RELOADING=1.
    notice.extend(sd_notify::NotifyState::monotonic_usec_now().ok());
    let _ = sd_notify::notify(false, &notice);
    tracing::info!("SIGHUP: reading the configuration again");
    let config = load_config(args).and_then(|c| {
        c.preflight()?;
        Ok(c)
    });
    let line = match config {
        Err(e) => {
            handle.reload_failed(format!("{e:#}"));
            tracing::error!("reload refused, nothing changed: {e:#}");
            format!("{status}; last reload refused: {e:#}")
        }
        Ok(c) => match handle.reload(&c) {
            Err(e) => {
                tracing::error!("reload refused, nothing changed: {e}");
                format!("{status}; last reload refused: {e}")
            }
            Ok(r) => {
                for n in &r.needs_restart {
                    tracing::warn!("reload: {n}: needs a restart (the running value is kept)");
                }
                tracing::info!(added = ?r.added, updated = ?r.updated, needs_restart = r.needs_restart.len(), "reload applied");
                let exports = handle.stats().exports.len();
                match r.needs_restart.len() {
                    0 => format!("serving {exports} export(s); configuration reloaded"),
                    n => format!("serving {exports} export(s); {n} change(s) need a restart"),
                }
            }
        },
    };
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&line)]);
}

/// Queue addresses (`steer`): what is installed on the NICs (removed when dropped) and each
/// transport's address.
#[derive(Debug, Default)]
struct Steering {
    installed: Vec<tyched::steer::Installed>,
    addresses: tyched::steer::QueueAddresses,
}

/// With `steer`, the queue addresses of interface number `i` (`name`) served by `ports` AF_XDP
/// sockets on queues 0..ports: installed on the NIC with `queue-mac`, and recorded per
/// transport.
fn steer_iface(
    config: &Config,
    i: usize,
    name: &str,
    nic: tyche_wire::MacAddr,
    ports: usize,
    steering: &mut Steering,
) -> Result<()> {
    let a = &mut steering.addresses;
    if !config.steer.addresses() {
        a.of_nic.extend((0..ports).map(|_| None));
        a.iface_of.extend((0..ports).map(|_| i));
        return Ok(());
    }
    let mut macs = config.queue_macs_for(name, nic)?;
    if ports < macs.len() {
        tracing::warn!(iface = %name, queues = ports, "fewer queues than channels_per_nic: queue addresses for the queues opened only");
        macs.truncate(ports);
    }
    if config.steer == tyched::steer::Steer::QueueMac {
        let done = tyched::steer::install(name, &macs, Box::new(tyched::steer::SystemTools))?;
        tracing::info!(iface = %name, addresses = ?done.addresses(), rules = ?done.rules(), "queue addresses and flow rules installed");
        steering.installed.push(done);
    } else {
        tracing::info!(iface = %name, addresses = ?macs, "queue addresses (no flow rules: steer = \"queue-mac-no-rules\")");
    }
    let a = &mut steering.addresses;
    a.spread = config.steer == tyched::steer::Steer::QueueMac;
    a.of_nic.extend(macs.iter().map(|&m| Some(m)));
    a.iface_of.extend((0..ports).map(|_| i));
    Ok(())
}

/// One transport per interface (and per channel queue with AF_XDP).
fn open_nics(config: &Config, term: &AtomicBool, steering: &mut Steering) -> Result<Vec<Nic>> {
    let mut nics = Vec::new();
    let listener = match config.transport {
        TransportKind::Tcp => {
            let addr = config.tcp_listen.as_deref().unwrap_or("0.0.0.0:7788");
            let l = std::net::TcpListener::bind(addr).with_context(|| format!("tcp_listen: binding {addr}"))?;
            l.set_nonblocking(true)?;
            // The bound address, so that port 0 (the kernel's pick) is told.
            let addr = l.local_addr().with_context(|| format!("tcp_listen: {addr}"))?;
            tracing::info!(%addr, connections = config.ifaces.len(), "TCP transport: waiting for initiators");
            Some(l)
        }
        _ => None,
    };
    for (i, name) in config.ifaces.iter().enumerate() {
        match config.transport {
            TransportKind::Packet => {
                let t = tyched::packet::PacketTransport::open(name, config.ethertype)
                    .with_context(|| format!("{name}: AF_PACKET socket"))?;
                nics.push(Nic { name: name.clone(), transport: Box::new(t) });
            }
            TransportKind::Xdp => {
                let pc = tyche_xdp::PortConfig {
                    numa: config
                        .channel_memory_node
                        .map_or(tyche_xdp::NumaPlacement::Auto, tyche_xdp::NumaPlacement::Node),
                    ethertype: config.ethertype,
                    lend_frames: tyched::LEND_FRAMES,
                    tx_lend_frames: tyched::TX_LEND_FRAMES,
                    copy: config.xdp_copy,
                    ..Default::default()
                };
                let queues = u32::from(config.channels_per_nic);
                let ports = tyche_xdp::XdpPort::open_queues(name, queues, &pc)
                    .with_context(|| format!("{name} (queues 0..{queues}): AF_XDP"))?;
                if let Some(first) = ports.first() {
                    let nic = tyche_transport::FrameTransport::capabilities(first).local_mac;
                    steer_iface(config, i, name, nic, ports.len(), steering)?;
                }
                for (q, port) in ports.into_iter().enumerate() {
                    tracing::info!(iface = %name, queue = q, mode = %port.mode(), zero_copy = port.zero_copy(), "AF_XDP port open");
                    let label = if config.channels_per_nic > 1 { format!("{name}/{q}") } else { name.clone() };
                    nics.push(Nic { name: label, transport: Box::new(port) });
                }
            }
            TransportKind::Tcp => {
                // One TCP connection stands for each interface, in the order they connect.
                let info = tyche_xdp::InterfaceInfo::query(name).with_context(|| format!("{name}: interface"))?;
                let l = listener.as_ref().expect("bound above");
                let stream = loop {
                    if term.load(Ordering::SeqCst) {
                        return Ok(nics);
                    }
                    match l.accept() {
                        Ok((s, peer)) => {
                            tracing::info!(iface = %name, %peer, "TCP initiator connected");
                            break s;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => return Err(e).context("tcp accept"),
                    }
                };
                // Loopback has no MAC and a 64 KiB MTU: give frames an address and an Ethernet size.
                let mac = if info.mac == tyche_wire::MacAddr::ZERO { tcp_mac(nics.len()) } else { info.mac };
                let t = tyche_tcp::TcpTransport::new(stream, info.mtu.min(9000), mac)?;
                nics.push(Nic { name: name.clone(), transport: Box::new(t) });
            }
        }
    }
    Ok(nics)
}

/// The MAC a TCP "NIC" without an address of its own (loopback) uses: `tyched::tcp_mac`.
fn tcp_mac(k: usize) -> tyche_wire::MacAddr {
    tyched::tcp_mac(k)
}

/// Memory on the serving NICs' node and threads on its CPUs, when the topology says so; with
/// one network thread per NIC, each on the CPU tyche-numa's placement plan gives that NIC's
/// channel (for NICs whose node is known); the storage workers are the plan's completion
/// workers, a queue per node (unless `workers = N` is given: then the pool).
fn placement_for(
    config: &Config,
    nics: &[Nic],
    topo: Option<&tyche_numa::Topology>,
    model: Option<&tyche_numa::BandwidthModel>,
) -> (Placement, Option<tyche_numa::Plan>) {
    let Some(topo) = topo else { return (Placement::default(), None) };
    let mut placement = Placement::default();
    let mut planned = None;
    let nodes: Vec<Option<u32>> =
        config.ifaces.iter().map(|i| topo.nics.iter().find(|n| &n.name == i).and_then(|n| n.node)).collect();
    let node_cpus = |node: u32| topo.node(node).map(|n| n.cpus.clone()).unwrap_or_default();
    match nodes.first() {
        Some(Some(node)) if nodes.iter().all(|x| x == &Some(*node)) => {
            placement.node = Some(*node);
            placement.network_cpus = node_cpus(*node);
            placement.worker_cpus = node_cpus(*node);
        }
        _ => {
            // NICs on several nodes: a network thread that serves several of them is unpinned,
            // with its memory policy bound to their nodes.
            let mut memory_nodes: Vec<u32> = nodes.iter().flatten().copied().collect();
            memory_nodes.sort_unstable();
            memory_nodes.dedup();
            if memory_nodes.len() >= 2 {
                placement.memory_nodes = memory_nodes;
            }
        }
    }
    if let Some(n) = config.network_thread_node {
        // The experiment: threads on node `n`, memory where it would be.
        placement.network_cpus = node_cpus(n);
        placement.worker_cpus = node_cpus(n);
    }
    let per_nic = if config.transport == TransportKind::Xdp { u32::from(config.channels_per_nic) } else { 1 };
    if let Ok(mut req) = tyche_numa::placement::PlacementRequest::channels_per_nic(topo, &config.ifaces, per_nic) {
        // (Validated at load; tyche-numa logs the plan's warnings itself.)
        req.consumer_cpus = config.consumer_cpus().unwrap_or_default();
        if let Some(n) = config.network_thread_node {
            // The experiment: plan every channel as if its NIC were on node `n`.
            for c in &mut req.channels {
                c.nic_node = Some(n);
            }
        }
        let plan = tyche_numa::placement::plan_with_model(topo, &req, model);
        if config.workers == 0 {
            let labels: Vec<String> = nics.iter().map(|n| n.name.clone()).collect();
            placement.storage = Some(tyched::workers::StoragePlan::from_plan(topo, &plan, &labels));
        }
        if config.network_threads == NetworkThreads::PerNic {
            placement.nic_cpus = nics
                .iter()
                .map(|nic| {
                    // Labels are "IF" or, with several AF_XDP queues, "IF/QUEUE".
                    let (name, queue) = match nic.name.split_once('/') {
                        Some((n, q)) => (n, q.parse().unwrap_or(0)),
                        None => (nic.name.as_str(), 0),
                    };
                    let c = plan.channels.iter().find(|c| c.nic == name && c.channel == queue && c.nic_node.is_some());
                    if let Some(c) = c {
                        tracing::info!(nic = %nic.name, node = c.node, cpu = c.network_cpu, "network thread placement");
                    }
                    c.map(|c| vec![c.network_cpu]).unwrap_or_default()
                })
                .collect();
        }
        planned = Some(plan);
    }
    (placement, planned)
}

/// The I/O bandwidth model on a machine with several NUMA nodes (or when `--model-refresh`
/// asks), for the nodes of the serving NICs: read from the cache, else measured and stored.
/// `None` (logged) on one node, when no serving NIC's node is known, or when it cannot be had.
fn bandwidth_model(config: &Config, topo: &tyche_numa::Topology, refresh: bool) -> Option<tyche_numa::BandwidthModel> {
    if topo.nodes.len() < 2 && !refresh {
        return None;
    }
    let mut io_nodes: Vec<u32> = config.ifaces.iter().filter_map(|i| topo.nic(i).and_then(|n| n.node)).collect();
    io_nodes.sort_unstable();
    io_nodes.dedup();
    if io_nodes.is_empty() {
        return None;
    }
    let path = config.model_cache.clone().unwrap_or_else(|| PathBuf::from(tyche_numa::model::DEFAULT_CACHE));
    match tyche_numa::model::cached(&path, topo, &io_nodes, &tyche_numa::ModelConfig::default(), refresh) {
        Ok((model, how)) => {
            tracing::info!(path = %path.display(), ?how, "I/O bandwidth model");
            Some(model)
        }
        Err(e) => {
            tracing::warn!("no I/O bandwidth model: {e}");
            None
        }
    }
}

/// The CPUs each interface's network threads are pinned to (empty: unpinned).
fn network_cpus_of(iface: &str, nics: &[Nic], placement: &Placement) -> Vec<u32> {
    let mut cpus: Vec<u32> = nics
        .iter()
        .enumerate()
        .filter(|(_, n)| n.name == iface || n.name.split_once('/').is_some_and(|(i, _)| i == iface))
        .flat_map(|(k, _)| match placement.nic_cpus.get(k).filter(|c| !c.is_empty()) {
            Some(c) => c.clone(),
            None => placement.network_cpus.clone(),
        })
        .collect();
    cpus.sort_unstable();
    cpus.dedup();
    cpus
}

/// `irq_affinity = "auto"`: each NIC's IRQs onto cores of its node that run no network thread
/// (an error when that cannot be done); then, either way, a warning for each NIC whose
/// interrupts land on its network thread's core.
fn interrupts(
    config: &Config,
    nics: &[Nic],
    placement: &Placement,
    topo: Option<&tyche_numa::Topology>,
    roots: &tyche_numa::irq::Roots,
) -> Result<()> {
    use tyche_numa::irq::{self, IrqPolicy};
    let all_network: Vec<u32> = placement.nic_cpus.iter().flatten().copied().collect();
    for iface in &config.ifaces {
        let own = network_cpus_of(iface, nics, placement);
        let found = match irq::nic_irqs(roots, iface) {
            Ok(n) => n,
            Err(e) if config.irq_affinity == IrqPolicy::Auto => {
                return Err(e).with_context(|| format!("irq_affinity = \"auto\": {iface}"))
            }
            Err(e) => {
                tracing::warn!(iface = %iface, "cannot read the NIC's interrupts: {e}");
                continue;
            }
        };
        if found.virtual_nic {
            tracing::info!(iface = %iface, "no IRQs (virtual NIC)");
            continue;
        }
        let mut now = found;
        if config.irq_affinity == IrqPolicy::Auto && !now.irqs.is_empty() {
            let topo = topo.context("irq_affinity = \"auto\" needs this machine's topology (hwloc)")?;
            let node = topo
                .nic(iface)
                .and_then(|n| n.node)
                .or_else(|| own.first().and_then(|c| topo.nodes.iter().find(|n| n.cpus.contains(c))).map(|n| n.id))
                .or_else(|| (topo.nodes.len() == 1).then(|| topo.nodes[0].id))
                .with_context(|| format!("irq_affinity = \"auto\": {iface}: its NUMA node is unknown"))?;
            let cpus = irq::auto_irq_cpus(topo, node, &own, &all_network)
                .with_context(|| format!("irq_affinity = \"auto\": {iface}"))?;
            now = irq::apply_auto(roots, &now, &cpus).with_context(|| format!("irq_affinity = \"auto\": {iface}"))?;
            tracing::info!(iface = %iface, irqs = %now.describe(), "NIC interrupts moved off the network thread's core");
        }
        if let Some(topo) = topo {
            for w in irq::check(topo, &now, &own, &config.consumer_cpus().unwrap_or_default()) {
                tracing::warn!("{w}");
            }
        }
    }
    Ok(())
}

/// The stats with each interface's interrupts read afresh (and compared with the CPUs its
/// network thread reports for itself).
fn with_irqs(
    source: impl Fn() -> tyched::Snapshot + Send + Sync + 'static,
    config: &Config,
    topo: &Option<tyche_numa::Topology>,
) -> impl Fn() -> tyched::Snapshot + Send + Sync + 'static {
    let ifaces = config.ifaces.clone();
    let topo = topo.clone();
    let roots = tyche_numa::irq::Roots::default();
    move || {
        let mut snap = source();
        snap.irqs = ifaces
            .iter()
            .map(|iface| {
                let mut cpus: Vec<u32> = snap
                    .placement
                    .iter()
                    .filter(|p| p.nic == *iface || p.nic.split_once('/').is_some_and(|(i, _)| i == iface))
                    .flat_map(|p| p.thread.cpus.iter().copied())
                    .collect();
                cpus.sort_unstable();
                cpus.dedup();
                tyche_numa::IrqReport::read(&roots, iface, topo.as_ref(), &cpus)
            })
            .collect();
        snap
    }
}

/// `tyched reload`: SIGHUP to the daemon, then its stats until the reload counters move.
fn reload_command(args: &ReloadArgs) -> Result<()> {
    // The file may be the broken one being reloaded: then its `stats_socket = "..."` line.
    let from_file = || -> Option<PathBuf> {
        let text = std::fs::read_to_string(args.config.as_ref()?).ok()?;
        if let Ok(v) = toml::from_str::<toml::Table>(&text) {
            return v.get("stats_socket")?.as_str().map(PathBuf::from);
        }
        let line = text.lines().find(|l| l.split('=').next().is_some_and(|k| k.trim() == "stats_socket"))?;
        line.split('"').nth(1).map(PathBuf::from)
    };
    let socket = args.socket.clone().or_else(from_file).unwrap_or_else(|| PathBuf::from("/run/tyched/stats.sock"));
    let before = stats_server::query(&socket).ok().map(|s| s.reload);
    // SAFETY: kill takes integers.
    if args.pid <= 0 || unsafe { libc::kill(args.pid, libc::SIGHUP) } != 0 {
        bail!("cannot signal tyched (pid {}): {}", args.pid, std::io::Error::last_os_error());
    }
    let Some(before) = before else {
        eprintln!(
            "tyched: SIGHUP sent; no stats socket at {}, so the outcome is only in the daemon's log",
            socket.display()
        );
        return Ok(());
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(args.timeout);
    loop {
        if let Ok(s) = stats_server::query(&socket) {
            let r = s.reload;
            if r.failed > before.failed {
                bail!("the reload was refused, nothing changed: {}", r.last_error.unwrap_or_default());
            }
            if r.applied > before.applied {
                for n in &r.needs_restart {
                    println!("needs a restart: {n}");
                }
                return Ok(());
            }
        }
        if std::time::Instant::now() > deadline {
            bail!("no outcome of the reload in tyched's stats after {} s", args.timeout);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stats(args: &StatsArgs) -> Result<()> {
    let snap = stats_server::query(&args.socket).with_context(|| format!("reading {}", args.socket.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&snap)?);
    } else if args.prometheus {
        print!("{}", snap.prometheus());
    } else {
        print!("{}", snap.human());
    }
    Ok(())
}
