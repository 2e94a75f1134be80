//! The engine threads: one per NUMA node of the links (see [`EngineThreads`]), each serving the
//! transports of its node's links and pinned to that node's CPUs. They share the session (the
//! [`Volume`], the request buffers, the connectors) under one lock, and each loops receive →
//! handle → events → transmit → timers → reconnects over its own links. A thread that leaves
//! work for another one's links (a request scheduled on a channel of another node, a
//! retransmission, a reconnect) rings that thread's bell.
//!
//! Each engine group's transports sit behind a lock of their own in [`Shared`] (lock order: the
//! engine, then one group's transports; never the reverse), so that in inline send mode the
//! thread that submits a request sends its frames itself ([`Shared::submit_inline`]).

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags};
use nix::sys::time::TimeSpec;

use tokio::sync::oneshot;
use tracing::{debug, error, info, warn};
use tyche_channel::{
    ConnectError as ChannelConnectError, ConnectPlan, Connected, Connector, DeadReason, Failed, InboundOf, Instant,
    IoError, IoRequest, Opened, ReconnectPolicy, Reconnector, Scheduler, SubmitError, VolumeConfig, VolumeEvent,
};

/// The session's volume: one part per engine thread, its hand-offs delivered under the lock.
type VolumeParts = tyche_channel::VolumeParts<tyche_channel::AtOnce>;
use tyche_transport::poll::{Next, PollStats, Poller, SchedStat};
use tyche_transport::wake::WakeFd;
use tyche_transport::{FrameTransport, MemoryArea};
use tyche_wire::{
    flags, ChannelParams, DisconnectReason, Envelope, Frame, Kind, Op, RejectReason, DATA_FRAME_OVERHEAD,
};

use crate::client::{Client, ExportInfo, Stats};
use crate::config::{EngineThreads, InitiatorConfig, Link, SchedulerKind};
use crate::error::{ConnectError, Error};
use crate::front::{Front, FrontIo, Token, WaitFd};
use crate::sched::NumaScheduler;

/// Frames handled per transport per loop iteration.
const RX_BUDGET: usize = 64;
/// Frames sent per `send` call.
const TX_BUDGET: usize = 64;
/// Longest the engine sleeps while requests are in flight and nothing happens.
const BUSY_SLEEP: Duration = Duration::from_micros(100);
/// Longest the engine sleeps while requests are in flight when every link wakes it on arrival.
const BUSY_SLEEP_FD: Duration = Duration::from_millis(1);
/// Longest the engine sleeps while idle.
const IDLE_SLEEP: Duration = Duration::from_millis(2);
/// Longest a closing engine waits for requests in flight.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Wakes an engine thread when it sleeps: clients ring it after queueing a command, other engine
/// threads after leaving it frames to send.
#[derive(Debug)]
pub(crate) struct Bell {
    efd: WakeFd,
    sleeping: AtomicBool,
}

impl Bell {
    fn new() -> std::io::Result<Self> {
        Ok(Bell { efd: WakeFd::new()?, sleeping: AtomicBool::new(false) })
    }

    /// Wakes the engine if it sleeps (one syscall only then).
    pub(crate) fn ring(&self) {
        if self.sleeping.swap(false, Ordering::AcqRel) {
            self.efd.wake();
        }
    }

    /// Wakes the engine whether or not it has said it sleeps.
    fn force(&self) {
        self.sleeping.store(false, Ordering::Release);
        self.efd.wake();
    }
}

/// A request as the client hands it to the engine.
#[derive(Debug)]
pub(crate) struct IoCmd {
    pub op: Op,
    pub fua: bool,
    pub offset: u64,
    pub length: u64,
    /// Write data, or the buffer read data goes into (empty: the engine allocates one).
    pub data: Buf,
    pub node: Option<u32>,
    pub reply: Completion,
}

/// A request's data: a heap buffer (the [`Client`] API's `Vec`), or pages bound to a NUMA node
/// (front ends served by the engine, see [`crate::front`]).
#[derive(Debug)]
pub(crate) enum Buf {
    Heap(Vec<u8>),
    /// The first `len` bytes of a region bound to its node.
    Node(tyche_numa::alloc::NodeRegion, usize),
}

impl Buf {
    pub(crate) fn len(&self) -> usize {
        match self {
            Buf::Heap(v) => v.len(),
            Buf::Node(_, len) => *len,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Buf::Heap(v) => v,
            Buf::Node(r, len) => &r.as_slice()[..*len],
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Buf::Heap(v) => v,
            Buf::Node(r, len) => &mut r.as_mut_slice()[..*len],
        }
    }

    /// The data as a `Vec` (a copy only for node-bound buffers, which `Client` never makes).
    pub(crate) fn into_vec(self) -> Vec<u8> {
        match self {
            Buf::Heap(v) => v,
            Buf::Node(..) => self.as_slice().to_vec(),
        }
    }
}

/// What a request gives back: its op and its buffer (read data for a read).
pub(crate) type Outcome = Result<(Op, Buf), Error>;

/// Where a request's outcome goes.
#[derive(Debug)]
pub(crate) enum Completion {
    /// A [`Client`] call waits for it.
    Client(oneshot::Sender<Result<Vec<u8>, Error>>),
    /// A front end served by the engine (its key) turns it into a reply.
    Front(u64, Token),
}

/// What the client sends the engine.
#[derive(Debug)]
pub(crate) enum Cmd {
    /// Requests a queue-mode submitter thread hands over.
    Batch(Vec<IoCmd>),
    Stats(oneshot::Sender<Stats>),
    Report(oneshot::Sender<crate::report::Report>),
    Close(oneshot::Sender<()>),
    /// A front end for engine thread `.0` (the one that receives it) to serve.
    Front(usize, Box<dyn Front>),
}

#[derive(Debug)]
struct InFlight {
    op: Op,
    buf: Buf,
    reply: Completion,
}

/// A front end and the engine thread that serves it.
#[derive(Debug)]
struct Served {
    group: usize,
    front: Box<dyn Front>,
}

#[derive(Debug)]
struct Pending {
    /// The slot (link × channels per link) it opens a channel for.
    slot: usize,
    connector: Connector,
    /// Failed attempts on the slot before this one.
    failures: u32,
}

/// A link's transport, owned by the engine thread that serves the link.
type Transport = Box<dyn FrameTransport + Send>;

/// The transports one engine thread serves, with their link indices.
type Io = [(usize, Transport)];

/// What the engine keeps of a link once its transport has moved to the thread that serves it.
#[derive(Debug)]
struct LinkMeta {
    name: String,
    target: tyche_wire::MacAddr,
    /// NUMA node of the NIC, as configured.
    node: Option<u32>,
    local_mac: tyche_wire::MacAddr,
    mtu: usize,
    frame_capacity: usize,
    /// The node the transport placed its memory on.
    memory_node: Option<u32>,
    /// The transport's memory (UMEM, rings), for placement reports.
    areas: Vec<MemoryArea>,
    /// The engine thread serving the link.
    group: usize,
}

pub(crate) struct Engine {
    cfg: InitiatorConfig,
    clock: std::time::Instant,
    links: Vec<LinkMeta>,
    /// Which channel each slot (link × channels per link) should have, in which session, and
    /// when to try again (never giving up).
    reconnector: Reconnector,
    slot_count: usize,
    connectors: HashMap<u16, Pending>,
    /// The session's volume, in one part per engine thread (part `g` holds the channels of
    /// thread `g`'s links).
    volume: Option<VolumeParts>,
    connected: Option<Connected>,
    next_id: u64,
    inflight: HashMap<u64, InFlight>,
    backlog: VecDeque<IoCmd>,
    /// The plaintext of the last frame of an encrypting channel.
    rx_scratch: Vec<u8>,
    /// The last frame that arrived in pieces and had to be whole (a sealed or DIGEST channel's).
    rx_gather: Vec<u8>,
    last_timeout_run: Instant,
    stats: Stats,
    closing: Option<(Instant, Vec<oneshot::Sender<()>>)>,
    /// The first fatal connection error (initial phase only).
    fatal: Option<ConnectError>,
    /// Links on which the initial channel timed out.
    initial_timeouts: usize,
    /// One bell per engine thread.
    bells: Vec<Arc<Bell>>,
    /// Each engine thread as it sees itself once placed (for reports).
    threads: Vec<Option<tyche_numa::report::ThreadPlacement>>,
    /// Each engine thread's polling counters, as of its last turn.
    poll_stats: Vec<PollStats>,
    /// The session is over: every engine thread sends what is left on its links and exits.
    finished: bool,
    /// Engine threads that have exited.
    exited: usize,
    /// Who waits for the last engine thread to exit.
    closers: Vec<oneshot::Sender<()>>,
    /// Front ends the engine threads serve, by key.
    fronts: HashMap<u64, Served>,
    /// Requests the front ends handed over in a pass (kept to spare an allocation per pass).
    front_ios: Vec<FrontIo>,
    /// For `front_ios`, in order: each front end's key, node, whether it is queued, and how many
    /// requests it handed over.
    front_runs: Vec<(u64, Option<u32>, bool, usize)>,
    /// The link of every channel index ever opened.
    channel_link: HashMap<u16, usize>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("links", &self.links)
            .field("reconnector", &self.reconnector)
            .finish_non_exhaustive()
    }
}

/// What the engine threads (and, in inline send mode, the submitting threads) share.
///
/// Lock order: `engine` first, then one group's `io`; never `io` and then `engine`, and never
/// two groups' `io` at once. An engine thread holds both for its turn and neither while it
/// sleeps, so a submitting thread that holds `engine` normally finds every `io` free.
pub(crate) struct Shared {
    engine: Mutex<Engine>,
    /// Each engine group's transports (the links that group's thread receives on).
    io: Vec<Mutex<Vec<(usize, Transport)>>>,
    /// Whether every transport of a group wakes its thread on arrival (a readiness descriptor).
    wakes: Vec<bool>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("groups", &self.io.len()).finish_non_exhaustive()
    }
}

impl Shared {
    /// The engine, also when another thread panicked while holding it (its state is still
    /// consistent enough to fail requests and close).
    fn lock(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Group `g`'s transports (the caller holds the engine lock: see the lock order above).
    fn io(&self, g: usize) -> MutexGuard<'_, Vec<(usize, Transport)>> {
        self.io[g].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Inline send mode (the papers' "inline" path): the calling thread serialises on the
    /// session (the engine lock), submits `io` into the volume, and sends the frames it put on
    /// the channels itself, on each link's transport under its group's lock; no hand-off to an
    /// engine thread and no wake-up. The engine threads keep receiving, timers,
    /// retransmissions and completions.
    ///
    /// Falls back to leaving the frames to the engine thread (its bell rung, the request
    /// counted in [`Stats::inline_fallbacks`]) when the request has to wait in the backlog (the
    /// volume is full) or a group's transports are busy. A group whose transports cannot wake
    /// its thread on arrival (in-memory links) is rung after an inline send all the same, so
    /// that it looks for the reply (counted in [`Stats::inline_wakes`]).
    pub(crate) fn submit_inline(&self, io: IoCmd) {
        let mut e = self.lock();
        let now = e.now();
        if e.finished || e.closing.is_some() || e.volume.is_none() {
            e.complete(io.reply, Err(Error::Closed), now);
            return;
        }
        let waits = !e.backlog.is_empty();
        e.submit(io, now);
        if waits || !e.backlog.is_empty() {
            e.stats.inline_fallbacks += 1;
            for bell in &e.bells {
                bell.ring();
            }
            return;
        }
        let mut all_sent = true;
        for g in 0..self.io.len() {
            if !e.group_wants_transmit(g) {
                continue;
            }
            match self.io[g].try_lock() {
                Ok(mut io) => {
                    e.transmit(now, &mut io);
                }
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    e.transmit(now, &mut p.into_inner());
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    all_sent = false;
                    e.bells[g].ring();
                    continue;
                }
            }
            if !self.wakes[g] && e.bells[g].sleeping.load(Ordering::Acquire) {
                e.stats.inline_wakes += 1;
                e.bells[g].ring();
            }
        }
        if all_sent {
            e.stats.sent_inline += 1;
        } else {
            e.stats.inline_fallbacks += 1;
        }
    }
}

/// Which engine thread serves each link: one per distinct node (in order of first appearance)
/// with [`EngineThreads::PerNode`], else all on one.
fn groups_of(layout: EngineThreads, nodes: &[Option<u32>]) -> Vec<usize> {
    match layout {
        EngineThreads::One => vec![0; nodes.len()],
        EngineThreads::PerNode => {
            let mut seen: Vec<Option<u32>> = Vec::new();
            nodes
                .iter()
                .map(|n| match seen.iter().position(|s| s == n) {
                    Some(g) => g,
                    None => {
                        seen.push(*n);
                        seen.len() - 1
                    }
                })
                .collect()
        }
    }
}

/// Opens the session and starts the engine threads (blocking version of [`crate::connect`]).
pub fn connect_blocking(cfg: InitiatorConfig, links: Vec<Link>) -> Result<Client, ConnectError> {
    cfg.validate().map_err(ConnectError::Config)?;
    if links.is_empty() {
        return Err(ConnectError::NoLinks);
    }
    let nodes: Vec<Option<u32>> = links.iter().map(|l| l.node).collect();
    let group = groups_of(cfg.engine_threads, &nodes);
    let groups = group.iter().max().map_or(1, |g| g + 1);
    let bells = (0..groups)
        .map(|_| Bell::new().map(Arc::new))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| ConnectError::Config(format!("cannot create an eventfd: {e}")))?;
    let mut io: Vec<(usize, Transport)> = Vec::with_capacity(links.len());
    let mut metas = Vec::with_capacity(links.len());
    for (k, l) in links.into_iter().enumerate() {
        let t = &l.transport;
        metas.push(LinkMeta {
            name: l.name,
            target: l.target,
            node: l.node,
            local_mac: t.local_mac(),
            mtu: t.mtu(),
            frame_capacity: t.frame_capacity(),
            memory_node: t.numa_node(),
            areas: t.memory_areas(),
            group: group[k],
        });
        io.push((k, l.transport));
    }
    let mut engine = Engine::new(cfg, metas, bells.clone());
    // The session opens on this thread, over every link. Bounded: every connector gives up
    // after `connect_attempts * connect_retry`.
    loop {
        engine.step(&mut io);
        if let Some(e) = engine.fatal.take() {
            return Err(e);
        }
        if engine.volume.is_some() && engine.connectors.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let c = engine.connected.expect("volume exists");
    let info = ExportInfo {
        export: engine.cfg.export.clone(),
        size: c.export_size,
        block_size: c.block_size,
        read_only: c.export_flags & flags::EXPORT_READ_ONLY != 0,
        discard: c.export_flags & flags::EXPORT_DISCARD != 0,
        session: c.session,
        max_io: c.params.max_io,
    };
    info!(
        export = %info.export, session = format_args!("{:#x}", info.session), size = info.size,
        channels = engine.volume.as_ref().map_or(0, VolumeParts::live_channels),
        engine_threads = groups,
        "session open"
    );
    let send_mode = engine.cfg.send_mode;
    // The placement experiment: every engine thread on one given node.
    let thread_node = engine.cfg.engine_thread_node;
    let mut by_group: Vec<Vec<(usize, Transport)>> = (0..groups).map(|_| Vec::new()).collect();
    for (k, t) in io {
        by_group[group[k]].push((k, t));
    }
    // What each engine thread sleeps on besides its bell: duplicates of its transports'
    // readiness descriptors, so that it sleeps without holding its group's transports.
    let mut sleep_fds: Vec<Vec<std::os::fd::OwnedFd>> = Vec::with_capacity(groups);
    let mut wakes = Vec::with_capacity(groups);
    for mine in &by_group {
        let mut fds = Vec::new();
        for (_, t) in mine {
            if let Some(fd) = t.readiness_fd() {
                let fd = fd
                    .try_clone_to_owned()
                    .map_err(|e| ConnectError::Config(format!("cannot duplicate a readiness descriptor: {e}")))?;
                fds.push(fd);
            }
        }
        wakes.push(fds.len() == mine.len());
        sleep_fds.push(fds);
    }
    let metas: Vec<Vec<usize>> = by_group.iter().map(|m| m.iter().map(|(k, _)| *k).collect()).collect();
    let shared =
        Arc::new(Shared { engine: Mutex::new(engine), io: by_group.into_iter().map(Mutex::new).collect(), wakes });
    let mut queues: Vec<(Sender<Cmd>, Arc<Bell>)> = Vec::with_capacity(groups);
    let mut node_group: Vec<(Option<u32>, usize)> = Vec::new();
    let mut all_nodes: Vec<u32> = nodes.iter().flatten().copied().collect();
    all_nodes.sort_unstable();
    all_nodes.dedup();
    for (g, ((mine, fds), bell)) in metas.into_iter().zip(sleep_fds).zip(&bells).enumerate() {
        let mut spread: Vec<u32> = mine.iter().filter_map(|k| nodes[*k]).collect();
        spread.sort_unstable();
        spread.dedup();
        // A thread whose links are all on one node runs on that node's CPUs (as tyched's
        // network threads do); one thread for links on several nodes stays unpinned. With links
        // on several nodes, every engine thread's memory policy is bound to their nodes: a
        // thread also copies data of requests whose buffers are on another node (round robin, a
        // dead channel's requests), and automatic NUMA balancing must not drag those buffers to
        // the node it runs on.
        let home = match (spread.as_slice(), mine.iter().all(|k| nodes[*k].is_some())) {
            ([n], true) => Some(*n),
            _ => None,
        };
        for k in &mine {
            if !node_group.iter().any(|(n, _)| *n == nodes[*k]) {
                node_group.push((nodes[*k], g));
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        queues.push((tx, Arc::clone(bell)));
        let name = match (groups, home) {
            (1, _) | (_, None) => "tyche-engine".to_owned(),
            (_, Some(n)) => format!("tyche-engine{n}"),
        };
        let shared = Arc::clone(&shared);
        let all_nodes = all_nodes.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                if let Some(cpus) = thread_node.or(home).and_then(crate::sched::node_cpus) {
                    if let Err(e) = tyche_numa::pin_current_thread(&cpus) {
                        warn!(node = home, "cannot pin an engine thread: {e}");
                    }
                }
                if all_nodes.len() > 1 {
                    if let Err(e) = tyche_numa::alloc::bind_thread_memory_to(&all_nodes) {
                        warn!(nodes = ?all_nodes, "cannot bind an engine thread's memory policy: {e}");
                    }
                }
                serve(&shared, g, fds, rx)
            })
            .map_err(|e| ConnectError::Config(format!("cannot start an engine thread: {e}")))?;
    }
    Ok(Client::new(queues, node_group, info, send_mode, &nodes, shared))
}

impl Engine {
    fn new(cfg: InitiatorConfig, links: Vec<LinkMeta>, bells: Vec<Arc<Bell>>) -> Self {
        let per = cfg.channels_per_link;
        let links_len = links.len();
        let slot_links: Vec<usize> = (0..links.len() * per).map(|i| i / per).collect();
        let policy =
            ReconnectPolicy { min: cfg.reconnect_delay, max: cfg.reconnect_max_delay.max(cfg.reconnect_delay) };
        // The first attempt (on the first link) is due at once.
        let reconnector = Reconnector::new(slot_links, policy, Instant::ZERO);
        let threads = vec![None; bells.len()];
        let poll_stats = vec![PollStats::default(); bells.len()];
        Engine {
            cfg,
            clock: std::time::Instant::now(),
            links,
            slot_count: links_len * per,
            reconnector,
            connectors: HashMap::new(),
            volume: None,
            connected: None,
            next_id: 1,
            inflight: HashMap::new(),
            backlog: VecDeque::new(),
            rx_scratch: Vec::new(),
            rx_gather: Vec::new(),
            last_timeout_run: Instant::ZERO,
            stats: Stats::default(),
            closing: None,
            fatal: None,
            initial_timeouts: 0,
            bells,
            threads,
            poll_stats,
            finished: false,
            exited: 0,
            closers: Vec::new(),
            fronts: HashMap::new(),
            front_ios: Vec::new(),
            front_runs: Vec::new(),
            channel_link: HashMap::new(),
        }
    }

    fn now(&self) -> Instant {
        Instant(self.clock.elapsed().as_nanos() as u64 + 1)
    }

    fn want(&self, link: usize) -> ChannelParams {
        let l = &self.links[link];
        let segment = tyche_wire::segment_size_for(l.mtu, l.frame_capacity).unwrap_or(512);
        ChannelParams {
            ring: self.cfg.ring,
            remq_slots: self.cfg.slots,
            damq_slots: self.cfg.slots,
            segment: segment.min(u16::MAX as u32 / 2 + 1) as u16,
            max_io: self.cfg.max_io,
            features: tyche_wire::flags::FEATURE_BLOCK_STATUS
                | if self.cfg.digest { tyche_wire::flags::FEATURE_DIGEST } else { 0 },
        }
    }

    /// Starts the connector `plan` asks for.
    fn start_connector(&mut self, plan: ConnectPlan, now: Instant) {
        let link = self.reconnector.link(plan.slot);
        let env = Envelope {
            dst: self.links[link].target,
            src: self.links[link].local_mac,
            ethertype: self.cfg.ethertype,
            channel: plan.channel,
            session: plan.session,
        };
        let want = self.want(link);
        let nonce = tyche_channel::auth::random_u64();
        let mut connector =
            Connector::new(env, &self.cfg.export, want, nonce, self.cfg.connect_retry, self.cfg.connect_attempts, now);
        if let Some(key) = &self.cfg.key {
            connector = connector.with_key(key);
        }
        if let Some(host) = self.cfg.host_id {
            connector = connector.with_host(host);
        }
        let name = &self.links[link].name;
        if plan.session == 0 && self.volume.is_some() {
            info!(link = %name, "opening a new session on export {}", self.cfg.export);
        } else if plan.session == 0 {
            debug!(link = %name, "opening session");
        } else if plan.failures > 0 && plan.failures <= self.cfg.reconnect_attempts {
            info!(link = %name, "reconnect attempt {} on {name}", plan.failures + 1);
        } else if plan.failures > 0 {
            debug!(link = %name, "reconnect attempt {} on {name}", plan.failures + 1);
        }
        self.connectors.insert(plan.channel, Pending { slot: plan.slot, connector, failures: plan.failures });
    }

    /// One pass of the loop over the links in `io`. Returns whether anything happened.
    fn step(&mut self, io: &mut Io) -> bool {
        let now = self.now();
        let mut work = self.receive(now, io);
        work |= self.events(now);
        work |= self.transmit(now, io);
        work |= self.timers(now);
        work |= self.events(now);
        work
    }

    fn receive(&mut self, now: Instant, io: &mut Io) -> bool {
        let mut outcomes = Vec::new();
        let mut n = 0;
        let ethertype = self.cfg.ethertype;
        for (k, transport) in io.iter_mut() {
            let Engine { links, connectors, volume, inflight, stats, rx_scratch, rx_gather, .. } = self;
            let link = &links[*k];
            let group = link.group;
            // A multi-buffer DATA frame (a jumbo link) comes in its pieces: its read data is
            // copied from them straight into the request's buffer, never gathered first.
            let res = transport.recv_pieces(RX_BUDGET, &mut |pieces| {
                if let [bytes] = pieces {
                    if let Ok(frame) = Frame::new_checked(bytes, ethertype) {
                        if matches!(frame.kind(), Kind::Accept | Kind::Reject | Kind::Challenge) {
                            let ch = frame.channel();
                            if let (Some(p), Ok(msg)) = (connectors.get_mut(&ch), frame.parse()) {
                                if let Some(outcome) = p.connector.handle(frame.src(), frame.session(), &msg) {
                                    outcomes.push((ch, outcome));
                                }
                            }
                            return;
                        }
                    }
                }
                let Some(v) = volume.as_mut() else { return };
                if let InboundOf::Read { id, offset, payload } =
                    v.part(group).handle_frame_pieces(now, pieces, rx_scratch, rx_gather)
                {
                    let at = offset as usize;
                    // The volume only places data inside the request; a range outside it would be
                    // an engine bug, and is dropped rather than trusted.
                    if let Some(dst) =
                        inflight.get_mut(&id).and_then(|r| r.buf.as_mut_slice().get_mut(at..at + payload.len()))
                    {
                        let mut o = 0;
                        for part in payload.parts() {
                            dst[o..o + part.len()].copy_from_slice(part);
                            o += part.len();
                        }
                        stats.bytes_read += payload.len() as u64;
                    }
                }
            });
            match res {
                Ok(got) => n += got,
                Err(e) => warn!(link = %link.name, "receive failed: {e}"),
            }
        }
        for (ch, outcome) in outcomes {
            self.connector_done(ch, outcome, now);
        }
        n > 0
    }

    fn connector_done(&mut self, ch: u16, outcome: Result<Connected, ChannelConnectError>, now: Instant) {
        let Some(p) = self.connectors.remove(&ch) else { return };
        let slot = p.slot;
        let link = self.reconnector.link(slot);
        let name = self.links[link].name.clone();
        let target = self.links[link].target.to_string();
        match outcome {
            Ok(c) => {
                let channel = p.connector.channel(&c, self.cfg.timers, now);
                match self.reconnector.connected(slot, ch, c.session, now) {
                    Opened::First => {
                        let cfg = VolumeConfig {
                            export_size: c.export_size,
                            read_only: c.export_flags & flags::EXPORT_READ_ONLY != 0,
                            no_path_timeout: self.cfg.no_path_timeout,
                            max_requests: self.cfg.max_requests,
                        };
                        let nodes: Vec<u32> = self.links.iter().filter_map(|l| l.node).collect();
                        let scheduler = || -> Box<dyn Scheduler> {
                            Box::new(NumaScheduler::with_order(
                                self.cfg.scheduler,
                                &nodes,
                                self.cfg.node_order.as_ref(),
                            ))
                        };
                        let mut vol = VolumeParts::new(
                            cfg,
                            c.session,
                            self.cfg.ethertype,
                            now,
                            self.bells.len(),
                            scheduler,
                            tyche_channel::AtOnce::default(),
                        );
                        // An earlier process's unflushed writes: kept if this session presents
                        // the epoch they were acknowledged under, else the next FLUSH fails.
                        vol.inherit_debt(self.cfg.prior_writes);
                        self.volume = Some(vol);
                        self.connected = Some(c);
                        debug!(link = %name, channel = ch, segment = c.params.segment, max_io = c.params.max_io, "channel open");
                    }
                    Opened::Resumed => {
                        let old = self.connected.expect("a session was open");
                        if c.export_size != old.export_size || c.export_flags != old.export_flags {
                            warn!(
                                link = %name,
                                "export {} changed across the target's restart (size {} -> {}, flags {:#x} -> {:#x}); \
                                 the device keeps its size",
                                self.cfg.export, old.export_size, c.export_size, old.export_flags, c.export_flags
                            );
                        }
                        let vol = self.volume.as_mut().expect("a session was open");
                        let waiting = vol.outstanding();
                        let (was, unflushed) = (vol.durability_epoch(), vol.unflushed_writes());
                        vol.resume(c.session, now);
                        match was {
                            Some(e) if unflushed && !e.keeps(&c.durability_epoch) => warn!(
                                link = %name, "the target's durability epoch changed ({e} -> {}): writes not flushed \
                                 may be lost, and the next FLUSH fails", c.durability_epoch
                            ),
                            Some(_) if unflushed => {
                                info!(link = %name, "same durability epoch: the writes not flushed are still there")
                            }
                            _ => {}
                        }
                        self.connected = Some(Connected { session: c.session, ..old });
                        self.stats.reconnects += 1;
                        info!(
                            link = %name, session = format_args!("{:#x}", c.session), reissued = waiting,
                            "new session open; requests not completed are issued again"
                        );
                    }
                    Opened::Joined => {
                        if p.failures > 0 || self.channel_link.values().any(|&l| l == link) {
                            self.stats.reconnects += 1;
                            info!(link = %name, channel = ch, "channel reconnected after {} attempt(s)", p.failures + 1);
                        } else {
                            debug!(link = %name, channel = ch, segment = c.params.segment, max_io = c.params.max_io, "channel open");
                        }
                    }
                    Opened::Stale | Opened::Probe => {
                        // Opened for a session since abandoned: not used (the target reclaims it).
                        debug!(link = %name, channel = ch, "dropping a channel of an abandoned session");
                        return;
                    }
                }
                let vol = self.volume.as_mut().expect("created");
                vol.part(self.links[link].group).add_channel(channel, self.links[link].node, now);
                vol.settle(now);
                self.channel_link.insert(ch, link);
            }
            Err(e) => {
                if self.volume.is_none() {
                    // The initial channel: a refusal is final, a timeout tries the next link.
                    self.fatal = match e {
                        ChannelConnectError::Rejected(RejectReason::UnknownExport) => {
                            Some(ConnectError::UnknownExport { target, export: self.cfg.export.clone() })
                        }
                        ChannelConnectError::Rejected(
                            reason @ (RejectReason::AuthRequired | RejectReason::AuthFailed),
                        ) => Some(ConnectError::Auth { target, export: self.cfg.export.clone(), link: name, reason }),
                        ChannelConnectError::ChallengeUnsupported => Some(ConnectError::Auth {
                            target,
                            export: self.cfg.export.clone(),
                            link: name,
                            reason: RejectReason::AuthRequired,
                        }),
                        ChannelConnectError::InUse(holder) => Some(ConnectError::InUse {
                            target,
                            export: self.cfg.export.clone(),
                            link: name,
                            holder: holder.to_string(),
                        }),
                        ChannelConnectError::Rejected(reason) => {
                            Some(ConnectError::Refused { target, export: self.cfg.export.clone(), link: name, reason })
                        }
                        ChannelConnectError::Timeout => {
                            warn!(link = %name, "no answer from target {target}");
                            self.initial_timeouts += 1;
                            // The policy tries the next link at once.
                            self.reconnector.failed(slot, ch, e, now);
                            if self.initial_timeouts < self.links.len() {
                                None
                            } else {
                                Some(ConnectError::Timeout {
                                    target,
                                    export: self.cfg.export.clone(),
                                    links: self.links.iter().map(|l| l.name.as_str()).collect::<Vec<_>>().join(", "),
                                })
                            }
                        }
                        // BadGrant, and whatever else a newer handshake may report.
                        other => Some(ConnectError::Handshake {
                            target,
                            export: self.cfg.export.clone(),
                            link: name,
                            detail: match other {
                                ChannelConnectError::BadProof => "the target did not prove the pre-shared key in its ACCEPT (a target without this export's key, or not the real target)".to_string(),
                                ChannelConnectError::BadGrant => "the target granted channel parameters this initiator cannot use".to_string(),
                                ChannelConnectError::BadChannelAddress(m) => format!("the target named a group address ({m}) as the channel's address in its ACCEPT"),
                                other => format!("{other:?}"),
                            },
                        }),
                    };
                    return;
                }
                match self.reconnector.failed(slot, ch, e, now) {
                    Failed::SessionLost => warn!(
                        link = %name,
                        "target {target} no longer knows session {:#x} (it restarted, or reclaimed the session): \
                         opening a new session on export {}",
                        self.connected.map_or(0, |c| c.session), self.cfg.export
                    ),
                    Failed::Retry if p.failures < self.cfg.reconnect_attempts => {
                        warn!(link = %name, channel = ch, "channel could not be opened: {e:?}; trying again")
                    }
                    Failed::Retry => debug!(link = %name, channel = ch, "channel could not be opened: {e:?}"),
                    Failed::Stale => {}
                }
            }
        }
    }

    /// Completions and channel deaths.
    fn events(&mut self, now: Instant) -> bool {
        let Some(vol) = self.volume.as_mut() else { return false };
        // Parts whose channels all died hand their queues over; adopters report back.
        vol.settle(now);
        let mut work = false;
        let mut dead = Vec::new();
        let mut no_path = 0usize;
        let mut completed = Vec::new();
        while let Some(ev) = vol.poll_event() {
            work = true;
            match ev {
                VolumeEvent::Completed { id, result } => {
                    let Some(r) = self.inflight.remove(&id) else { continue };
                    let result = match result {
                        Ok(()) => {
                            self.stats.completed += 1;
                            if r.op == Op::Write {
                                self.stats.bytes_written += r.buf.len() as u64;
                            }
                            Ok((r.op, r.buf))
                        }
                        Err(e) => {
                            self.stats.failed += 1;
                            no_path += usize::from(e == IoError::NoPath);
                            Err(match e {
                                IoError::NoPath => Error::NoPath,
                                IoError::Target(s) => Error::Target(s),
                            })
                        }
                    };
                    completed.push((r.reply, result));
                }
                VolumeEvent::ChannelAborted { channel } => {
                    info!(
                        channel,
                        "the target aborted a request (it is stopping): the request waits for another channel"
                    );
                }
                VolumeEvent::ChannelDead { channel, reason, reissued } => {
                    dead.push((channel, reason));
                    let name = self.channel_link.get(&channel).map_or("?", |&l| self.links[l].name.as_str());
                    warn!(
                        link = %name, channel, ?reason, reissued,
                        live = vol.live_channels(),
                        "channel dead; its requests go to the other channels"
                    );
                    if vol.live_channels() == 0 {
                        warn!(
                            "every channel is down: requests wait up to {:?} for a reconnect, then fail",
                            self.cfg.no_path_timeout
                        );
                    }
                }
            }
        }
        if no_path > 0 {
            error!(
                "{no_path} request(s) failed with an I/O error: no channel for {:?} (no-path timeout)",
                self.cfg.no_path_timeout
            );
        }
        for (channel, reason) in dead {
            if reason == DeadReason::PeerClosed(DisconnectReason::Shutdown) {
                info!(channel, "the target is shutting down: reconnecting at once");
            }
            self.reconnector.channel_dead(channel, reason, now);
        }
        for (c, result) in completed {
            self.complete(c, result, now);
        }
        work
    }

    /// Hands a request's outcome to whoever waits for it. (`_now`: the callers' clock, kept in
    /// the signature they share; a completion starts no request since front ends make their own
    /// follow-ups.)
    fn complete(&mut self, c: Completion, result: Outcome, _now: Instant) {
        match c {
            Completion::Client(reply) => {
                let _ =
                    reply.send(result.map(|(op, buf)| if op.has_read_data() { buf.into_vec() } else { Vec::new() }));
            }
            Completion::Front(key, token) => {
                if let Some(s) = self.fronts.get_mut(&key) {
                    s.front.complete(token, result);
                }
            }
        }
    }

    fn transmit(&mut self, now: Instant, io: &mut Io) -> bool {
        let mut sent = 0;
        let Engine { links, connectors, volume, inflight, reconnector, slot_count, .. } = self;
        for (k, t) in io.iter_mut() {
            let (k, link) = (*k, &links[*k]);
            for p in connectors.values_mut().filter(|p| reconnector.link(p.slot) == k) {
                let r = t.send(1, &mut |buf| p.connector.poll_transmit(now, buf));
                sent += r.unwrap_or(0);
            }
            if let Some(vol) = volume.as_mut().map(|v| v.part(link.group)) {
                let channels: Vec<u16> = (0..*slot_count)
                    .filter(|&s| reconnector.link(s) == k)
                    .filter_map(|s| reconnector.channel(s))
                    .collect();
                for ch in channels {
                    if !vol.wants_transmit(ch) {
                        continue;
                    }
                    loop {
                        let r = t.send(TX_BUDGET, &mut |buf| {
                            let out = vol.poll_transmit(now, ch, buf)?;
                            if let Some((id, offset, len)) = out.payload {
                                if let Some(r) = inflight.get(&id) {
                                    let (at, len) = (offset as usize, len as usize);
                                    buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len]
                                        .copy_from_slice(&r.buf.as_slice()[at..at + len]);
                                }
                            }
                            Some(vol.seal(ch, buf, out.len))
                        });
                        match r {
                            Ok(n) => {
                                sent += n;
                                if n < TX_BUDGET {
                                    break;
                                }
                            }
                            Err(e) => {
                                warn!(link = %link.name, "send failed: {e}");
                                break;
                            }
                        }
                    }
                }
            }
            if let Err(e) = t.flush() {
                warn!(link = %link.name, "flush failed: {e}");
            }
        }
        sent > 0
    }

    fn timers(&mut self, now: Instant) -> bool {
        let mut work = false;
        if let Some(vol) = self.volume.as_mut() {
            let due = vol.poll_timers().is_some_and(|t| t <= now);
            // The no-path clock starts inside handle_timeout: run it regularly too.
            if due || now.since(self.last_timeout_run) >= Duration::from_millis(1) {
                vol.handle_timeout(now);
                vol.settle(now);
                self.last_timeout_run = now;
                work |= due;
            }
            // The parts' floors (each reads the others' on its own timer while busy).
            vol.refresh_due(now);
        }
        // Connectors that ran out of attempts.
        let timed_out: Vec<u16> = self
            .connectors
            .iter_mut()
            .filter_map(|(&ch, p)| {
                p.connector.handle_timeout(now);
                matches!(p.connector.outcome(), Some(Err(_))).then_some(ch)
            })
            .collect();
        for ch in timed_out {
            let outcome = self.connectors[&ch].connector.outcome().expect("checked");
            self.connector_done(ch, outcome, now);
            work = true;
        }
        // Connection attempts that are due (the first ones, reconnections, a new session).
        let opening = self.volume.is_none() && self.fatal.is_none();
        if (self.volume.is_some() || opening) && self.closing.is_none() {
            while let Some(plan) = self.reconnector.poll_connect(now) {
                self.start_connector(plan, now);
                work = true;
            }
        }
        work
    }

    fn command(&mut self, cmd: Cmd, now: Instant) {
        match cmd {
            Cmd::Batch(ios) => {
                self.stats.handed_over += ios.len() as u64;
                for io in ios {
                    self.submit(io, now);
                }
            }
            Cmd::Stats(reply) => {
                let _ = reply.send(self.snapshot());
            }
            Cmd::Report(reply) => {
                let _ = reply.send(self.report());
            }
            Cmd::Front(group, front) => {
                front.placed(self.threads.get(group).cloned().flatten());
                if self.closing.is_some() {
                    front.close(true);
                } else {
                    self.fronts.insert(front.key(), Served { group, front });
                }
            }
            Cmd::Close(done) => {
                if self.closing.is_none() {
                    info!("closing the session");
                }
                for io in std::mem::take(&mut self.backlog) {
                    self.complete(io.reply, Err(Error::Closed), now);
                }
                match &mut self.closing {
                    Some((_, waiters)) => waiters.push(done),
                    None => self.closing = Some((now + CLOSE_GRACE, vec![done])),
                }
            }
        }
    }

    fn submit(&mut self, io: IoCmd, now: Instant) {
        if self.closing.is_some() {
            self.complete(io.reply, Err(Error::Closed), now);
            return;
        }
        if !self.backlog.is_empty() {
            self.backlog.push_back(io);
            return;
        }
        if let Err(io) = self.try_submit(io, now) {
            self.backlog.push_back(io);
        }
    }

    /// Submits `io`, or gives it back when the volume is busy.
    // The request itself comes back when the volume is full: it goes to the backlog as it is
    // (boxing it would cost an allocation per request).
    #[allow(clippy::result_large_err)]
    fn try_submit(&mut self, io: IoCmd, now: Instant) -> Result<(), IoCmd> {
        // With the affinity scheduler, the part of the engine thread serving the buffers' node
        // (its first link there); with round-robin, or for buffers on no link's node, the parts
        // in turn (each part's scheduler then picks among its own channels).
        let id = self.next_id;
        let groups = self.bells.len();
        let by_node = groups > 1 && io.node.is_some() && self.cfg.scheduler == SchedulerKind::Affinity;
        let preferred = match self.links.iter().find(|l| by_node && l.node == io.node) {
            Some(l) => l.group,
            None => (id % groups as u64) as usize,
        };
        let vol = self.volume.as_mut().expect("engine runs with a volume");
        let req = IoRequest { id, op: io.op, fua: io.fua, offset: io.offset, length: io.length, node: io.node };
        let part = vol.submit_part(preferred);
        match vol.part(part).submit(now, req) {
            Ok(()) => {
                self.next_id += 1;
                // Read data lands in the buffer the caller allocated (on its thread's node),
                // when it gave one.
                let buf = if io.op == Op::Read && io.data.len() != io.length as usize {
                    // Touched here, on the submitting thread (a front end's node), not
                    // first by whichever thread receives the data.
                    let mut buf = vec![0; io.length as usize];
                    for i in (0..buf.len()).step_by(4096) {
                        buf[i] = std::hint::black_box(0);
                    }
                    Buf::Heap(buf)
                } else {
                    io.data
                };
                self.inflight.insert(id, InFlight { op: io.op, buf, reply: io.reply });
                Ok(())
            }
            Err(SubmitError::Busy) => Err(io),
            Err(e) => {
                self.complete(io.reply, Err(e.into()), now);
                Ok(())
            }
        }
    }

    fn drain_backlog(&mut self, now: Instant) -> bool {
        let mut work = false;
        while let Some(io) = self.backlog.pop_front() {
            match self.try_submit(io, now) {
                Ok(()) => work = true,
                Err(io) => {
                    self.backlog.push_front(io);
                    break;
                }
            }
        }
        work
    }

    fn snapshot(&self) -> Stats {
        let mut s = self.stats;
        if let Some(v) = &self.volume {
            s.live_channels = v.live_channels();
            s.channels = self.slot_count;
            s.outstanding = self.inflight.len();
            s.queued = self.backlog.len();
            s.retransmits = v.channel_indices().filter_map(|i| v.channel(i)).map(|c| c.stats().retransmits).sum();
            let dropped = |r: tyche_channel::DropReason| -> u64 {
                v.channel_indices().filter_map(|i| v.channel(i)).map(|c| c.stats().dropped[r as usize]).sum()
            };
            s.unauthenticated = dropped(tyche_channel::DropReason::Unauthenticated);
            s.replayed = dropped(tyche_channel::DropReason::Replayed);
            s.bad_digest = dropped(tyche_channel::DropReason::BadDigest);
            s.handoffs = v.handoffs();
            s.durability_epoch = v.durability_epoch();
            s.durability_debt = v.durability_debt();
        }
        s
    }

    /// Counters and placement; each link's thread as that engine thread saw itself once placed.
    fn report(&self) -> crate::report::Report {
        use crate::report::{ChannelReport, LinkReport, Report};
        let s = self.snapshot();
        let here = tyche_numa::report::this_thread();
        let thread_of = |k: usize| self.threads[self.links[k].group].clone().unwrap_or_else(|| here.clone());
        let mut r = Report {
            export: self.cfg.export.clone(),
            session: self.connected.as_ref().map_or(0, |c| c.session),
            scheduler: self.cfg.scheduler.to_string(),
            live_channels: s.live_channels,
            completed: s.completed,
            failed: s.failed,
            bytes_read: s.bytes_read,
            bytes_written: s.bytes_written,
            reconnects: s.reconnects,
            refused: crate::report::Refused {
                unauthenticated: s.unauthenticated,
                replayed: s.replayed,
                bad_digest: s.bad_digest,
            },
            poll_mode: self.cfg.poll.mode,
            poll_budget_us: self.cfg.poll.budget.as_micros() as u64,
            poll: self.poll_stats.clone(),
            send: crate::report::SendCounters {
                mode: self.cfg.send_mode.to_string(),
                inline: s.sent_inline,
                handed_over: s.handed_over,
                inline_fallbacks: s.inline_fallbacks,
                inline_wakes: s.inline_wakes,
            },
            ..Report::default()
        };
        if let Some(v) = &self.volume {
            for ch in v.channel_indices() {
                let Some(c) = v.channel(ch) else { continue };
                let link = self.channel_link.get(&ch).copied();
                let cs = c.stats();
                r.channels.push(ChannelReport {
                    channel: ch,
                    link: link.map_or_else(String::new, |k| self.links[k].name.clone()),
                    target: c.envelope().dst.to_string(),
                    node: link.and_then(|k| self.links[k].node),
                    live: c.dead().is_none(),
                    payload_tx: cs.payload_tx,
                    payload_rx: cs.payload_rx,
                    frames_tx: cs.frames_tx,
                    frames_rx: cs.frames_rx,
                    retransmits: cs.retransmits,
                    thread: link.map_or_else(|| here.clone(), thread_of),
                });
            }
        }
        for (k, l) in self.links.iter().enumerate() {
            let node = l.memory_node.or(l.node);
            let empty = tyche_numa::PageCounts { expected_node: node, ..Default::default() };
            let mut lr =
                LinkReport { name: l.name.clone(), node, umem: empty.clone(), rings: empty, thread: thread_of(k) };
            for a in &l.areas {
                let Ok(c) = tyche_numa::report::count_area(a.addr, a.len, node) else { continue };
                match a.what {
                    "umem" => lr.umem.add(&c),
                    _ => lr.rings.add(&c),
                }
            }
            r.links.push(lr);
        }
        r
    }

    /// Whether engine thread `g` has frames to send on its links (a request scheduled on one of
    /// its channels, a retransmission, a connector).
    fn group_wants_transmit(&self, g: usize) -> bool {
        let r = &self.reconnector;
        if self.connectors.values().any(|p| self.links[r.link(p.slot)].group == g) {
            return true;
        }
        let Some(vol) = &self.volume else { return false };
        let vol = &vol.parts()[g];
        (0..self.slot_count).any(|s| {
            self.links[r.link(s)].group == g && r.channel(s).is_some_and(|channel| vol.wants_transmit(channel))
        })
    }

    /// Rings the other engine threads that have something to send (frames, or front ends'
    /// replies) or requests handed over to take.
    fn wake_others(&self, me: usize) {
        if self.bells.len() < 2 {
            return;
        }
        for (g, bell) in self.bells.iter().enumerate() {
            if g != me
                && (self.group_wants_transmit(g)
                    || self.fronts.values().any(|s| s.group == g && (s.front.wants_send() || s.front.handed_waiting())))
            {
                bell.ring();
            }
        }
    }

    /// Whether a front end of engine thread `g` has requests its reader thread handed over.
    fn fronts_handed_waiting(&self, g: usize) -> bool {
        self.fronts.values().any(|s| s.group == g && s.front.handed_waiting())
    }

    /// Takes and submits the requests of engine thread `g`'s front ends.
    fn fronts_receive(&mut self, g: usize, now: Instant) -> bool {
        if self.fronts.is_empty() {
            return false;
        }
        let mut ios = std::mem::take(&mut self.front_ios);
        let mut runs = std::mem::take(&mut self.front_runs);
        for (&key, s) in self.fronts.iter_mut().filter(|(_, s)| s.group == g) {
            let before = ios.len();
            s.front.receive(&mut ios);
            if ios.len() > before {
                runs.push((key, s.front.node(), s.front.queued(), ios.len() - before));
            }
        }
        let work = !ios.is_empty();
        let mut drain = ios.drain(..);
        for &(key, node, queued, n) in &runs {
            if queued {
                self.stats.handed_over += n as u64;
            } else {
                self.stats.sent_inline += n as u64;
            }
            for io in drain.by_ref().take(n) {
                let reply = Completion::Front(key, io.token);
                let FrontIo { op, fua, offset, length, data, .. } = io;
                self.submit(IoCmd { op, fua, offset, length, data, node, reply }, now);
            }
        }
        drop(drain);
        runs.clear();
        self.front_ios = ios;
        self.front_runs = runs;
        work
    }

    /// Lets engine thread `g`'s front ends write their replies, and ends those that are over.
    fn fronts_send(&mut self, g: usize) -> bool {
        if self.fronts.is_empty() {
            return false;
        }
        let mut work = false;
        let mut over = false;
        for s in self.fronts.values_mut().filter(|s| s.group == g) {
            work |= s.front.send();
            over |= s.front.finished();
        }
        if over {
            let done: Vec<u64> =
                self.fronts.iter().filter(|(_, s)| s.group == g && s.front.finished()).map(|(&k, _)| k).collect();
            for key in done {
                if let Some(s) = self.fronts.remove(&key) {
                    s.front.close(false);
                }
            }
        }
        work
    }

    /// What engine thread `g` polls its front ends for while it sleeps.
    fn fronts_poll_set(&self, g: usize) -> Vec<(WaitFd, PollFlags)> {
        self.fronts.values().filter(|s| s.group == g).filter_map(|s| s.front.wait_for()).collect()
    }

    /// Fails what is left, sends DISCONNECT on every channel of `io`'s links, and tells the
    /// other engine threads to send theirs and exit.
    fn finish(&mut self, now: Instant, io: &mut Io) {
        let inflight: Vec<InFlight> = self.inflight.drain().map(|(_, r)| r).collect();
        for r in inflight {
            self.complete(r.reply, Err(Error::Closed), now);
        }
        for io in std::mem::take(&mut self.backlog) {
            self.complete(io.reply, Err(Error::Closed), now);
        }
        for (_, mut s) in self.fronts.drain() {
            s.front.send();
            s.front.close(true);
        }
        if let Some(v) = self.volume.as_mut() {
            v.close();
        }
        self.transmit(now, io);
        if let Some((_, waiters)) = self.closing.take() {
            self.closers.extend(waiters);
        }
        self.finished = true;
        for bell in &self.bells {
            bell.force();
        }
    }

    /// An engine thread is done; the last one wakes the closers.
    fn exit_thread(&mut self) {
        self.exited += 1;
        if self.exited == self.bells.len() {
            for w in self.closers.drain(..) {
                let _ = w.send(());
            }
            info!("session closed");
        }
    }
}

/// An engine thread's loop over its group's links (`shared.io[g]`); `fds` are duplicates of
/// their readiness descriptors. Returns when the session is closed (after every client is gone
/// or one asked).
fn serve(shared: &Shared, g: usize, fds: Vec<std::os::fd::OwnedFd>, rx: Receiver<Cmd>) {
    let bell = Arc::clone(&shared.lock().bells[g]);
    shared.lock().threads[g] = Some(tyche_numa::report::this_thread());
    // Links without a readiness descriptor (in-memory ones) are polled: sleep briefly.
    let all_fds = shared.wakes[g];
    let mut poller = Poller::new(shared.lock().cfg.poll);
    let run_queue = SchedStat::of_this_thread();
    let mut disconnected = false;
    let mut next: Option<Cmd> = None;
    loop {
        // Lock order: the engine, then this group's transports.
        let mut e = shared.lock();
        let mut io = shared.io(g);
        let now = e.now();
        if e.finished {
            // Another thread closed the session: DISCONNECT on this thread's channels.
            e.transmit(now, &mut io);
            e.exit_thread();
            drop(e);
            // The transports go with the thread, as they did when they lived on its stack.
            drop(std::mem::take(&mut *io));
            return;
        }
        let mut work = false;
        if let Some(cmd) = next.take() {
            e.command(cmd, now);
            work = true;
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => {
                    e.command(cmd, now);
                    work = true;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    if !disconnected {
                        disconnected = true;
                        let (tx, _rx) = oneshot::channel();
                        e.command(Cmd::Close(tx), now);
                    }
                    break;
                }
            }
        }
        work |= e.fronts_receive(g, now);
        work |= e.drain_backlog(now);
        work |= e.step(&mut io);
        work |= e.fronts_send(g);
        if let Some((deadline, _)) = &e.closing {
            if e.inflight.is_empty() || now >= *deadline {
                e.finish(now, &mut io);
                e.exit_thread();
                drop(e);
                drop(std::mem::take(&mut *io));
                return;
            }
        }
        e.wake_others(g);
        e.poll_stats[g] = poller.stats();
        let at = std::time::Instant::now();
        run_queue.feed(&mut poller, at);
        if poller.turn(at, work) == Next::Poll {
            drop(io);
            drop(e);
            if !work {
                // Polling with nothing to do: let a thread that shares the core run.
                std::thread::yield_now();
            }
            continue;
        }
        let busy = !e.inflight.is_empty() || !e.connectors.is_empty();
        let mut wait = match (busy, all_fds) {
            (true, false) => BUSY_SLEEP,
            (true, true) => BUSY_SLEEP_FD,
            (false, _) => IDLE_SLEEP,
        };
        if let Some(t) = e.volume.as_ref().and_then(|v| v.poll_timers().into_iter().chain(v.refresh_at()).min()) {
            wait = wait.min(t.since(now));
        }
        if let Some(t) = e.reconnector.poll_timeout().filter(|_| e.closing.is_none()) {
            wait = wait.min(t.since(now));
        }
        let sockets = e.fronts_poll_set(g);
        // Say so before letting go of the lock: a thread that then leaves work for this one
        // (a command, frames on its links, an inline request it must receive the reply of, a
        // front end's reader thread's request) rings, and the sleep below returns at once.
        bell.sleeping.store(!disconnected, Ordering::Release);
        if e.fronts_handed_waiting(g) {
            // Requests a reader thread handed over before it could see this thread sleep.
            bell.sleeping.store(false, Ordering::Release);
            drop(io);
            drop(e);
            continue;
        }
        drop(io);
        drop(e);
        if disconnected {
            std::thread::sleep(wait);
            continue;
        }
        match rx.try_recv() {
            Ok(cmd) => {
                bell.sleeping.store(false, Ordering::Release);
                next = Some(cmd);
                continue;
            }
            Err(TryRecvError::Empty) => {}
            // Every client is gone: the top of the loop starts closing.
            Err(TryRecvError::Disconnected) => {
                bell.sleeping.store(false, Ordering::Release);
                continue;
            }
        }
        sleep(&bell, &fds, &sockets, wait);
        bell.sleeping.store(false, Ordering::Release);
        bell.efd.drain();
    }
}

/// Sleeps until a client or another engine thread rings, a transport becomes readable (`fds`),
/// a front end's descriptor readable or writable as asked, or `wait` passes.
fn sleep(bell: &Bell, fds: &[std::os::fd::OwnedFd], sockets: &[(WaitFd, PollFlags)], wait: Duration) {
    let mut polled = vec![PollFd::new(bell.efd.as_fd(), PollFlags::POLLIN)];
    polled.extend(fds.iter().map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN)));
    polled.extend(sockets.iter().map(|(s, f)| PollFd::new(s.as_fd(), *f)));
    let _ = nix::poll::ppoll(&mut polled, Some(TimeSpec::from_duration(wait)), None);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_grouped_by_node_in_order_of_first_appearance() {
        let nodes = [Some(1), Some(0), Some(1), None, Some(0)];
        assert_eq!(groups_of(EngineThreads::PerNode, &nodes), [0, 1, 0, 2, 1]);
        assert_eq!(groups_of(EngineThreads::One, &nodes), [0; 5]);
        assert_eq!(groups_of(EngineThreads::PerNode, &[None, None]), [0, 0]);
        assert_eq!(groups_of(EngineThreads::PerNode, &[Some(3)]), [0]);
    }

    #[test]
    fn engine_thread_layout_parses_and_prints() {
        for t in [EngineThreads::PerNode, EngineThreads::One] {
            assert_eq!(t.to_string().parse::<EngineThreads>(), Ok(t));
        }
        assert!("two".parse::<EngineThreads>().unwrap_err().contains("per-node or one"));
    }
}
