//! The engine thread: owns the [`Volume`], the transports and the request buffers, and loops
//! receive → handle → events → transmit → timers → reconnects.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;

use tokio::sync::oneshot;
use tracing::{debug, error, info, warn};
use tyche_channel::{
    ConnectError as ChannelConnectError, Connected, Connector, Inbound, Instant, IoError, IoRequest, Scheduler,
    SubmitError, Volume, VolumeConfig, VolumeEvent,
};
use tyche_transport::SplitMix64;
use tyche_wire::{flags, ChannelParams, Envelope, Frame, Kind, Op, RejectReason, DATA_FRAME_OVERHEAD};

use crate::client::{Client, ExportInfo, Stats};
use crate::config::{InitiatorConfig, Link};
use crate::error::{ConnectError, Error};
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
/// Idle iterations spent yielding before sleeping.
const SPIN_ROUNDS: u32 = 8;
/// Longest a closing engine waits for requests in flight.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Wakes the engine thread when it sleeps: clients ring it after queueing a command.
#[derive(Debug)]
pub(crate) struct Bell {
    efd: EventFd,
    sleeping: AtomicBool,
}

impl Bell {
    fn new() -> std::io::Result<Self> {
        let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        Ok(Bell { efd, sleeping: AtomicBool::new(false) })
    }

    /// Wakes the engine if it sleeps (one syscall only then).
    pub(crate) fn ring(&self) {
        if self.sleeping.swap(false, Ordering::AcqRel) {
            let _ = self.efd.write(1);
        }
    }
}

/// A request as the client hands it to the engine.
#[derive(Debug)]
pub(crate) struct IoCmd {
    pub op: Op,
    pub fua: bool,
    pub offset: u64,
    pub length: u64,
    /// Write data (empty for other ops).
    pub data: Vec<u8>,
    pub node: Option<u32>,
    pub reply: oneshot::Sender<Result<Vec<u8>, Error>>,
}

/// What the client sends the engine.
#[derive(Debug)]
pub(crate) enum Cmd {
    Io(IoCmd),
    Batch(Vec<IoCmd>),
    Stats(oneshot::Sender<Stats>),
    Report(oneshot::Sender<crate::report::Report>),
    Close(oneshot::Sender<()>),
}

#[derive(Debug)]
struct InFlight {
    op: Op,
    buf: Vec<u8>,
    reply: oneshot::Sender<Result<Vec<u8>, Error>>,
}

/// One logical channel of a link: reopened under a new channel index when it dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// A connector is running for this channel index.
    Connecting { channel: u16, attempt: u32 },
    /// The channel is open in the volume.
    Up { channel: u16 },
    /// Waiting to start reconnection attempt `attempt` at `at`.
    Waiting { attempt: u32, at: Instant },
    /// Every attempt failed.
    GivenUp,
}

#[derive(Debug)]
struct Slot {
    link: usize,
    state: SlotState,
}

#[derive(Debug)]
struct Pending {
    slot: usize,
    connector: Connector,
}

pub(crate) struct Engine {
    cfg: InitiatorConfig,
    clock: std::time::Instant,
    links: Vec<Link>,
    slots: Vec<Slot>,
    connectors: HashMap<u16, Pending>,
    volume: Option<Volume>,
    connected: Option<Connected>,
    next_channel: u16,
    next_id: u64,
    inflight: HashMap<u64, InFlight>,
    backlog: VecDeque<IoCmd>,
    rng: SplitMix64,
    last_timeout_run: Instant,
    stats: Stats,
    closing: Option<(Instant, Vec<oneshot::Sender<()>>)>,
    /// The first fatal connection error (initial phase only).
    fatal: Option<ConnectError>,
    /// Links on which the initial channel timed out.
    initial_timeouts: usize,
    bell: Arc<Bell>,
    /// The link of every channel index ever opened.
    channel_link: HashMap<u16, usize>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("links", &self.links).field("slots", &self.slots).finish_non_exhaustive()
    }
}

fn seed() -> SplitMix64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let mut s = SplitMix64::new(t.as_nanos() as u64 ^ ((std::process::id() as u64) << 32));
    // Mix in an address from this process's address space (ASLR) for a bit more entropy.
    let here = &s as *const _ as u64;
    s = SplitMix64::new(s.next_u64() ^ here);
    s
}

/// Opens the session and starts the engine thread (blocking version of [`crate::connect`]).
pub fn connect_blocking(cfg: InitiatorConfig, links: Vec<Link>) -> Result<Client, ConnectError> {
    cfg.validate().map_err(ConnectError::Config)?;
    if links.is_empty() {
        return Err(ConnectError::NoLinks);
    }
    let bell = Arc::new(Bell::new().map_err(|e| ConnectError::Config(format!("cannot create an eventfd: {e}")))?);
    let mut engine = Engine::new(cfg, links, Arc::clone(&bell));
    let now = engine.now();
    engine.start_initial(0, now);
    // Bounded: every connector gives up after `connect_attempts * connect_retry`.
    loop {
        engine.step();
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
        channels = engine.volume.as_ref().map_or(0, Volume::live_channels),
        "session open"
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let send_mode = engine.cfg.send_mode;
    let nodes: Vec<Option<u32>> = engine.links.iter().map(|l| l.node).collect();
    // With every link on one node, the engine thread runs on that node's CPUs (as tyched's
    // network thread does); links on several nodes leave it unpinned, with its memory policy
    // bound to their nodes so that NUMA balancing does not drag the request buffers it copies
    // to whichever node it runs on.
    let home = match nodes.first() {
        Some(Some(n)) if nodes.iter().all(|x| *x == Some(*n)) => Some(*n),
        _ => None,
    };
    let mut spread: Vec<u32> = nodes.iter().flatten().copied().collect();
    spread.sort_unstable();
    spread.dedup();
    std::thread::Builder::new()
        .name("tyche-engine".into())
        .spawn(move || {
            if let Some(cpus) = home.and_then(crate::sched::node_cpus) {
                if let Err(e) = tyche_numa::pin_current_thread(&cpus) {
                    warn!(node = home, "cannot pin the engine thread: {e}");
                }
            } else if spread.len() > 1 {
                if let Err(e) = tyche_numa::alloc::bind_thread_memory_to(&spread) {
                    warn!(nodes = ?spread, "cannot bind the engine thread's memory policy: {e}");
                }
            }
            engine.run(rx)
        })
        .map_err(|e| ConnectError::Config(format!("cannot start the engine thread: {e}")))?;
    Ok(Client::new(tx, bell, info, send_mode, &nodes))
}

impl Engine {
    fn new(cfg: InitiatorConfig, links: Vec<Link>, bell: Arc<Bell>) -> Self {
        let per = cfg.channels_per_link;
        let slots = (0..links.len() * per)
            .map(|i| Slot { link: i / per, state: SlotState::Waiting { attempt: 0, at: Instant::ZERO } })
            .collect();
        Engine {
            cfg,
            clock: std::time::Instant::now(),
            links,
            slots,
            connectors: HashMap::new(),
            volume: None,
            connected: None,
            next_channel: 0,
            next_id: 1,
            inflight: HashMap::new(),
            backlog: VecDeque::new(),
            rng: seed(),
            last_timeout_run: Instant::ZERO,
            stats: Stats::default(),
            closing: None,
            fatal: None,
            initial_timeouts: 0,
            bell,
            channel_link: HashMap::new(),
        }
    }

    fn now(&self) -> Instant {
        Instant(self.clock.elapsed().as_nanos() as u64 + 1)
    }

    fn want(&self, link: usize) -> ChannelParams {
        let t = &self.links[link].transport;
        let segment = tyche_wire::segment_size_for(t.mtu(), t.frame_capacity()).unwrap_or(512);
        ChannelParams {
            ring: self.cfg.ring,
            remq_slots: self.cfg.slots,
            damq_slots: self.cfg.slots,
            segment: segment.min(u16::MAX as u32 / 2 + 1) as u16,
            max_io: self.cfg.max_io,
            features: 0,
        }
    }

    /// Starts a connector for `slot` with a fresh channel index.
    fn start_connector(&mut self, slot: usize, attempt: u32, now: Instant) {
        let link = self.slots[slot].link;
        let channel = self.next_channel;
        self.next_channel = self.next_channel.wrapping_add(1);
        let session = self.connected.map_or(0, |c| c.session);
        let env = Envelope {
            dst: self.links[link].target,
            src: self.links[link].transport.local_mac(),
            ethertype: self.cfg.ethertype,
            channel,
            session,
        };
        let want = self.want(link);
        let nonce = self.rng.next_u64();
        let mut connector =
            Connector::new(env, &self.cfg.export, want, nonce, self.cfg.connect_retry, self.cfg.connect_attempts, now);
        if let Some(key) = &self.cfg.key {
            connector = connector.with_key(key);
        }
        self.connectors.insert(channel, Pending { slot, connector });
        self.slots[slot].state = SlotState::Connecting { channel, attempt };
    }

    /// The first channel of the session, on the first slot of `link`.
    fn start_initial(&mut self, link: usize, now: Instant) {
        let slot = link * self.cfg.channels_per_link;
        debug!(link = %self.links[link].name, "opening session");
        self.start_connector(slot, 0, now);
    }

    /// One pass of the loop. Returns whether anything happened.
    fn step(&mut self) -> bool {
        let now = self.now();
        let mut work = self.receive(now);
        work |= self.events(now);
        work |= self.transmit(now);
        work |= self.timers(now);
        work |= self.events(now);
        work
    }

    fn receive(&mut self, now: Instant) -> bool {
        let mut outcomes = Vec::new();
        let mut n = 0;
        let ethertype = self.cfg.ethertype;
        for k in 0..self.links.len() {
            let Engine { links, connectors, volume, inflight, stats, .. } = self;
            let link = &mut links[k];
            let res = link.transport.recv(RX_BUDGET, &mut |bytes| {
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
                let Some(v) = volume.as_mut() else { return };
                if let Inbound::Read { id, offset, payload } = v.handle_frame(now, bytes) {
                    let at = offset as usize;
                    // The volume only places data inside the request; a range outside it would be
                    // an engine bug, and is dropped rather than trusted.
                    if let Some(dst) = inflight.get_mut(&id).and_then(|r| r.buf.get_mut(at..at + payload.len())) {
                        dst.copy_from_slice(payload);
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
        let link = self.slots[slot].link;
        let SlotState::Connecting { attempt, .. } = self.slots[slot].state else { return };
        let name = self.links[link].name.clone();
        let target = self.links[link].target.to_string();
        match outcome {
            Ok(c) => {
                let channel = p.connector.channel(&c, self.cfg.timers, now);
                if self.volume.is_none() {
                    let cfg = VolumeConfig {
                        export_size: c.export_size,
                        read_only: c.export_flags & flags::EXPORT_READ_ONLY != 0,
                        no_path_timeout: self.cfg.no_path_timeout,
                        max_requests: self.cfg.max_requests,
                    };
                    let nodes: Vec<u32> = self.links.iter().filter_map(|l| l.node).collect();
                    let scheduler: Box<dyn Scheduler> = Box::new(NumaScheduler::new(self.cfg.scheduler, &nodes));
                    self.volume = Some(Volume::new(cfg, c.session, self.cfg.ethertype, scheduler, now));
                    self.connected = Some(c);
                    // The other channels join the session.
                    for s in 0..self.slots.len() {
                        if s != slot {
                            self.start_connector(s, 0, now);
                        }
                    }
                }
                let vol = self.volume.as_mut().expect("created");
                vol.add_channel(channel, self.links[link].node, now);
                self.channel_link.insert(ch, link);
                if attempt > 0 {
                    self.stats.reconnects += 1;
                    info!(link = %name, channel = ch, "channel reconnected after {attempt} attempt(s)");
                } else {
                    debug!(link = %name, channel = ch, segment = c.params.segment, max_io = c.params.max_io, "channel open");
                }
                self.slots[slot].state = SlotState::Up { channel: ch };
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
                        ) => Some(ConnectError::Auth { export: self.cfg.export.clone(), reason }),
                        ChannelConnectError::ChallengeUnsupported => Some(ConnectError::Auth {
                            export: self.cfg.export.clone(),
                            reason: RejectReason::AuthRequired,
                        }),
                        ChannelConnectError::Rejected(reason) => {
                            Some(ConnectError::Refused { target, link: name, reason })
                        }
                        ChannelConnectError::Timeout => {
                            warn!(link = %name, "no answer from target {target}");
                            self.initial_timeouts += 1;
                            self.slots[slot].state = SlotState::GivenUp;
                            if link + 1 < self.links.len() {
                                self.start_initial(link + 1, now);
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
                        other => Some(ConnectError::Handshake { link: name, detail: format!("{other:?}") }),
                    };
                    return;
                }
                warn!(link = %name, channel = ch, "channel could not be opened: {e:?}");
                self.schedule_reconnect(slot, attempt + 1, now);
            }
        }
    }

    fn schedule_reconnect(&mut self, slot: usize, attempt: u32, now: Instant) {
        let name = &self.links[self.slots[slot].link].name;
        if attempt > self.cfg.reconnect_attempts || self.closing.is_some() {
            if self.cfg.reconnect_attempts > 0 {
                error!(link = %name, "giving up on a channel after {} reconnect attempts", self.cfg.reconnect_attempts);
            }
            self.slots[slot].state = SlotState::GivenUp;
            return;
        }
        self.slots[slot].state = SlotState::Waiting { attempt, at: now + self.cfg.reconnect_delay };
    }

    /// Completions and channel deaths.
    fn events(&mut self, now: Instant) -> bool {
        let Some(vol) = self.volume.as_mut() else { return false };
        let mut work = false;
        let mut dead = Vec::new();
        let mut no_path = 0usize;
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
                            Ok(if r.op == Op::Read { r.buf } else { Vec::new() })
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
                    let _ = r.reply.send(result);
                }
                VolumeEvent::ChannelDead { channel, reason, reissued } => {
                    dead.push(channel);
                    let link = self.slots.iter().find(|s| s.state == SlotState::Up { channel }).map(|s| s.link);
                    let name = link.map_or("?", |l| self.links[l].name.as_str());
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
        for channel in dead {
            if let Some(slot) = self.slots.iter().position(|s| s.state == SlotState::Up { channel }) {
                self.schedule_reconnect(slot, 1, now);
            }
        }
        work
    }

    fn transmit(&mut self, now: Instant) -> bool {
        let mut sent = 0;
        let Engine { links, connectors, volume, inflight, slots, .. } = self;
        for (k, link) in links.iter_mut().enumerate() {
            let t = &mut link.transport;
            for p in connectors.values_mut().filter(|p| slots[p.slot].link == k) {
                let r = t.send(1, &mut |buf| p.connector.poll_transmit(now, buf));
                sent += r.unwrap_or(0);
            }
            if let Some(vol) = volume.as_mut() {
                let channels: Vec<u16> = slots
                    .iter()
                    .filter(|s| s.link == k)
                    .filter_map(|s| match s.state {
                        SlotState::Up { channel } => Some(channel),
                        _ => None,
                    })
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
                                        .copy_from_slice(&r.buf[at..at + len]);
                                }
                            }
                            Some(out.len)
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
            let due = vol.poll_timeout().is_some_and(|t| t <= now);
            // The no-path clock starts inside handle_timeout: run it regularly too.
            if due || now.since(self.last_timeout_run) >= Duration::from_millis(1) {
                vol.handle_timeout(now);
                self.last_timeout_run = now;
                work |= due;
            }
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
        // Reconnection attempts that are due.
        if self.volume.is_some() && self.closing.is_none() {
            for s in 0..self.slots.len() {
                if let SlotState::Waiting { attempt, at } = self.slots[s].state {
                    if at <= now {
                        if attempt > 0 {
                            info!(
                                link = %self.links[self.slots[s].link].name,
                                "reconnect attempt {attempt} of {} on {}",
                                self.cfg.reconnect_attempts, self.links[self.slots[s].link].name
                            );
                        }
                        self.start_connector(s, attempt, now);
                        work = true;
                    }
                }
            }
        }
        work
    }

    fn command(&mut self, cmd: Cmd, now: Instant) {
        match cmd {
            Cmd::Io(io) => self.submit(io, now),
            Cmd::Batch(ios) => {
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
            Cmd::Close(done) => {
                info!("closing the session");
                for io in self.backlog.drain(..) {
                    let _ = io.reply.send(Err(Error::Closed));
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
            let _ = io.reply.send(Err(Error::Closed));
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
    fn try_submit(&mut self, io: IoCmd, now: Instant) -> Result<(), IoCmd> {
        let vol = self.volume.as_mut().expect("engine runs with a volume");
        let id = self.next_id;
        let req = IoRequest { id, op: io.op, fua: io.fua, offset: io.offset, length: io.length, node: io.node };
        match vol.submit(now, req) {
            Ok(()) => {
                self.next_id += 1;
                // Read data lands in the buffer the caller allocated (on its thread's node),
                // when it gave one.
                let buf = if io.op == Op::Read && io.data.len() != io.length as usize {
                    vec![0; io.length as usize]
                } else {
                    io.data
                };
                self.inflight.insert(id, InFlight { op: io.op, buf, reply: io.reply });
                Ok(())
            }
            Err(SubmitError::Busy) => Err(io),
            Err(e) => {
                let _ = io.reply.send(Err(e.into()));
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
            s.channels = self.slots.len();
            s.outstanding = self.inflight.len();
            s.queued = self.backlog.len();
            s.retransmits = v.channel_indices().filter_map(|i| v.channel(i)).map(|c| c.stats().retransmits).sum();
        }
        s
    }

    /// Counters and placement, measured on this (the engine) thread.
    fn report(&self) -> crate::report::Report {
        use crate::report::{ChannelReport, LinkReport, Report};
        let s = self.snapshot();
        let thread = tyche_numa::report::this_thread();
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
                    node: link.and_then(|k| self.links[k].node),
                    live: c.dead().is_none(),
                    payload_tx: cs.payload_tx,
                    payload_rx: cs.payload_rx,
                    frames_tx: cs.frames_tx,
                    frames_rx: cs.frames_rx,
                    retransmits: cs.retransmits,
                    thread: thread.clone(),
                });
            }
        }
        for l in &self.links {
            let node = l.transport.numa_node().or(l.node);
            let empty = tyche_numa::PageCounts { expected_node: node, ..Default::default() };
            let mut lr =
                LinkReport { name: l.name.clone(), node, umem: empty.clone(), rings: empty, thread: thread.clone() };
            for a in l.transport.memory_areas() {
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

    /// The engine thread's loop; returns when every client is gone or the session is closed.
    fn run(mut self, rx: Receiver<Cmd>) {
        let mut idle = 0u32;
        let mut disconnected = false;
        loop {
            let now = self.now();
            let mut work = false;
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        self.command(cmd, now);
                        work = true;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if !disconnected {
                            disconnected = true;
                            let (tx, _rx) = oneshot::channel();
                            self.command(Cmd::Close(tx), now);
                        }
                        break;
                    }
                }
            }
            work |= self.drain_backlog(now);
            work |= self.step();
            if let Some((deadline, _)) = &self.closing {
                if self.inflight.is_empty() || now >= *deadline {
                    self.finish(now);
                    return;
                }
            }
            idle = if work { 0 } else { idle.saturating_add(1) };
            if idle < SPIN_ROUNDS {
                std::thread::yield_now();
                continue;
            }
            let busy = !self.inflight.is_empty() || !self.connectors.is_empty();
            // Links without a readiness descriptor (in-memory ones) are polled: sleep briefly.
            let all_fds = self.links.iter().all(|l| l.transport.readiness_fd().is_some());
            let mut wait = match (busy, all_fds) {
                (true, false) => BUSY_SLEEP,
                (true, true) => BUSY_SLEEP_FD,
                (false, _) => IDLE_SLEEP,
            };
            if let Some(t) = self.volume.as_ref().and_then(Volume::poll_timeout) {
                wait = wait.min(t.since(now));
            }
            if disconnected {
                std::thread::sleep(wait);
                continue;
            }
            self.bell.sleeping.store(true, Ordering::Release);
            match rx.try_recv() {
                Ok(cmd) => {
                    self.bell.sleeping.store(false, Ordering::Release);
                    idle = 0;
                    let now = self.now();
                    self.command(cmd, now);
                    continue;
                }
                Err(TryRecvError::Empty) => {}
                // Every client is gone: the top of the loop starts closing.
                Err(TryRecvError::Disconnected) => {
                    self.bell.sleeping.store(false, Ordering::Release);
                    continue;
                }
            }
            self.sleep(wait);
            self.bell.sleeping.store(false, Ordering::Release);
            let _ = self.bell.efd.read();
        }
    }

    /// Sleeps until a client rings, a transport becomes readable, or `wait` passes.
    fn sleep(&self, wait: Duration) {
        let mut fds = vec![PollFd::new(self.bell.efd.as_fd(), PollFlags::POLLIN)];
        fds.extend(
            self.links.iter().filter_map(|l| l.transport.readiness_fd()).map(|fd| PollFd::new(fd, PollFlags::POLLIN)),
        );
        let _ = nix::poll::ppoll(&mut fds, Some(TimeSpec::from_duration(wait)), None);
    }

    /// Fails what is left, sends DISCONNECT on every channel and wakes the closers.
    fn finish(&mut self, now: Instant) {
        for (_, r) in self.inflight.drain() {
            let _ = r.reply.send(Err(Error::Closed));
        }
        if let Some(v) = self.volume.as_mut() {
            v.close();
        }
        self.transmit(now);
        let (_, waiters) = self.closing.take().expect("closing");
        for w in waiters {
            let _ = w.send(());
        }
        info!("session closed");
    }
}
