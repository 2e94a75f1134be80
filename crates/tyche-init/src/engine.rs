//! The engine threads: one per NUMA node of the links (see [`EngineThreads`]), each serving the
//! transports of its node's links and pinned to that node's CPUs. Each thread owns its part of
//! the session's volume ([`Volume::part`]: the channels of its links and the requests submitted
//! to it, with their buffers), its transports, its connectors and its front ends, in a
//! [`Part`] behind a lock that only it takes on its frame path (an inline submitter of its
//! node takes it too: [`Shared::submit_inline`]). No lock another engine thread takes per frame:
//!
//! - what threads hand each other goes by [`Mail`] into the receiver's mailbox, with its bell
//!   rung: a request for another thread's part (round-robin, buffers of no link's node), the
//!   outcome of one for a front end of another thread, and the failover hand-offs of a part
//!   whose channels are all down (with a write's data) and their hand-backs (with a read's);
//! - the session's identity and its reconnection policy sit in [`Control`] under a mutex taken
//!   on handshake frames, channel deaths, reconnect timers and stats, never per frame; what it
//!   has for a thread (its part of a new volume, a new session to move to, a connector) the
//!   thread takes when the control's generation moves;
//! - the floors and durability state the parts share are the volume's board (atomics on lines
//!   of their own, and a mutex taken only on FLUSH and session moves).

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags};
use nix::sys::time::TimeSpec;

use tokio::sync::oneshot;
use tracing::{debug, error, info, warn};
use tyche_channel::{
    exchange_part, ConnectError as ChannelConnectError, ConnectPlan, Connected, Connector, DeadReason, DurabilityDebt,
    Failed, FirstOpen, HandCourier, HandMessage, InboundOf, InitiatorSession, Instant, IoError, IoRequest, Opening,
    ReadBack, ReconnectPolicy, Refusal, Scheduler, Setup, SubmitError, Volume, VolumeBoard, VolumeConfig, VolumeEvent,
};
use tyche_runtime::poll::{Next, PollStats, Poller, SchedStat};
use tyche_transport::{FrameTransport, MemoryArea};
use tyche_wire::{flags, ChannelParams, DisconnectReason, Envelope, Frame, Kind, Op, DATA_FRAME_OVERHEAD};

use crate::bell::Bell;
use crate::buf::{Buf, Outcome};
use crate::config::{EngineThreads, InitiatorConfig, Link, SchedulerKind, SendMode};
use crate::engine_front::{Front, FrontIo, Token, WaitFd};
use crate::error::{ConnectError, Error};
use crate::export_info::ExportInfo;
use crate::sched::NumaScheduler;
use crate::stats::Stats;
use tyche_transport::FrameTransportExt;

/// Frames handled per transport per loop iteration.
const RX_BUDGET: usize = 64;
/// Frames sent per `send` call.
const TX_BUDGET: usize = 64;
/// Longest the engine sleeps while requests are in flight and nothing happens.
const BUSY_SLEEP: Duration = Duration::from_micros(100);
/// Longest the engine sleeps while requests are in flight when every link wakes it on arrival.
const BUSY_SLEEP_FD: Duration = Duration::from_millis(1);
/// Longest the engine sleeps while idle with links it must poll (no readiness descriptor).
const IDLE_SLEEP: Duration = Duration::from_millis(2);
/// Longest the engine sleeps while idle when every link, the doorbell and the front ends' sockets
/// wake it and its timers bound the sleep: only a safety net, as tyched's network threads have
/// (an idle engine woken every 2 ms cost an attached, idle tyche-init about 2% of a core: 470
/// `ppoll` calls a second over two links).
const IDLE_SLEEP_FD: Duration = Duration::from_millis(100);
/// Longest a closing engine waits for requests in flight.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

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

/// Where a request's outcome goes.
#[derive(Debug)]
pub(crate) enum Completion {
    /// A [`Client`] call waits for it.
    Client(oneshot::Sender<Result<Vec<u8>, Error>>),
    /// A front end served by engine thread `part` (its key) turns it into a reply.
    Front { part: usize, key: u64, token: Token },
}

/// What the client sends an engine thread.
#[derive(Debug)]
pub(crate) enum Cmd {
    /// Requests a queue-mode submitter thread hands over.
    Batch(Vec<IoCmd>),
    Stats(oneshot::Sender<Stats>),
    Report(oneshot::Sender<crate::report::Report>),
    Close(oneshot::Sender<()>),
    /// A front end for the engine thread that receives it to serve.
    Front(Box<dyn Front>),
}

#[derive(Debug)]
struct InFlight {
    op: Op,
    buf: Buf,
    reply: Completion,
}

/// A link's transport, owned by the engine thread that serves the link.
type Transport = Box<dyn FrameTransport + Send>;

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
    part: usize,
}

/// What one engine thread hands another (see the module docs). A mailbox holds at most what
/// the volume's limits allow to be in flight: requests (`max_requests` per part, and each
/// front end's own bound), their parts, and one outcome per request.
#[derive(Debug)]
enum Mail {
    /// A request for the receiver's part.
    Submit(IoCmd),
    /// The outcome of a request of one of the receiver's front ends.
    Complete(Completion, Outcome),
    /// A part of a request handed from part `from`, whose channels are all down, with its
    /// write data; or what became of a part the receiver handed over, with its read data.
    Hand(HandMessage),
}

/// The engine's courier for the hand-offs between parts: each message goes out as mail.
struct MailOut(Vec<(usize, Mail)>);

impl HandCourier for MailOut {
    fn post(&mut self, _now: Instant, _from: usize, to: usize, msg: HandMessage) {
        self.0.push((to, Mail::Hand(msg)));
    }
}

/// An engine thread's mailbox: a flag read on every pass (an atomic on a line of its own,
/// written only when mail comes), the mail under a lock taken only to post and to take it. Once
/// its thread has finished, the mailbox refuses mail (the sender deals with it).
#[derive(Debug, Default)]
#[repr(align(64))]
struct Mailbox {
    full: AtomicBool,
    /// The mail, and whether the thread has finished.
    mail: Mutex<(VecDeque<Mail>, bool)>,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, (VecDeque<Mail>, bool)> {
        self.mail.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn post(&self, m: Mail) -> Result<(), Mail> {
        let mut mail = self.lock();
        if mail.1 {
            return Err(m);
        }
        mail.0.push_back(m);
        self.full.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn has_mail(&self) -> bool {
        self.full.load(Ordering::SeqCst)
    }

    fn take(&self) -> VecDeque<Mail> {
        if !self.full.swap(false, Ordering::SeqCst) {
            return VecDeque::new();
        }
        std::mem::take(&mut self.lock().0)
    }

    /// Refuses mail from now on; what came before is returned.
    fn close(&self) -> VecDeque<Mail> {
        let mut mail = self.lock();
        mail.1 = true;
        self.full.store(false, Ordering::SeqCst);
        std::mem::take(&mut mail.0)
    }
}

/// A counter an engine thread publishes for the others, on a line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Published(AtomicUsize);

/// The session as a whole: its identity, the reconnection policy, what opening it found. Taken
/// on handshake outcomes, channel deaths, reconnect timers, stats and reports; never per frame.
#[derive(Debug)]
struct Control {
    /// Which channel each slot (link × channels per link) should have, in which session, and
    /// when to try again (never giving up once open); what each finished handshake means.
    session: InitiatorSession,
    /// The volume's parts not yet taken by their threads (made when the first session opened).
    parts: Vec<Option<Volume>>,
    /// Connectors started for each thread's links, not yet taken by it.
    connects: Vec<Vec<(u16, Opening)>>,
    /// The first fatal connection error (initial phase only).
    fatal: Option<ConnectError>,
    /// Who waits for the last engine thread to exit.
    closers: Vec<oneshot::Sender<()>>,
    /// The link of every channel index ever opened.
    channel_link: HashMap<u16, usize>,
}

/// One engine thread's part of the session: its part of the volume (`volume`), its transports,
/// its connectors, the requests submitted to it and their buffers, its front ends.
pub(crate) struct Part {
    g: usize,
    io: Vec<(usize, Transport)>,
    volume: Option<Volume>,
    /// The control's resumes this part has followed.
    resumes: u64,
    /// The control's generation last synced with.
    seen: u64,
    connectors: HashMap<u16, Opening>,
    /// The link of each channel of this part.
    channel_link: HashMap<u16, usize>,
    /// Request ids of this thread: `g + 1`, then steps of the number of threads (so an id
    /// names its request across threads).
    next_id: u64,
    inflight: HashMap<u64, InFlight>,
    backlog: VecDeque<IoCmd>,
    /// The plaintext of the last frame of an encrypting channel.
    rx_scratch: Vec<u8>,
    /// The last frame that arrived in pieces and had to be whole (a sealed or DIGEST channel's).
    rx_gather: Vec<u8>,
    last_timeout_run: Instant,
    /// This thread's counters (summed over the threads for [`Stats`]).
    stats: Stats,
    /// Front ends this thread serves, by key.
    fronts: HashMap<u64, Box<dyn Front>>,
    /// Requests the front ends handed over in a pass (kept to spare an allocation per pass).
    front_ios: Vec<FrontIo>,
    /// For `front_ios`, in order: each front end's key, node, whether it is queued, and how many
    /// requests it handed over.
    front_runs: Vec<(u64, Option<u32>, bool, usize)>,
    /// The thread as it saw itself once placed (for reports).
    thread: Option<tyche_numa::report::ThreadPlacement>,
    /// Its polling counters, as of its last turn.
    poll: PollStats,
    /// It saw the session close: its backlog failed, nothing new is taken.
    closing: bool,
    /// It sent its DISCONNECTs and is gone.
    finished: bool,
}

impl std::fmt::Debug for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Part").field("g", &self.g).field("inflight", &self.inflight.len()).finish_non_exhaustive()
    }
}

/// What the engine threads (and, in inline send mode, the submitting threads) share.
///
/// Lock order: a part, then the control (or the control alone); never two parts at once,
/// and never a part while holding the control. Mailboxes and the volume's board are leaves.
pub(crate) struct Shared {
    cfg: InitiatorConfig,
    clock: std::time::Instant,
    links: Vec<LinkMeta>,
    slot_count: usize,
    control: Mutex<Control>,
    /// Moves when the control has something for the threads (parts, a session, connectors).
    generation: AtomicU64,
    /// When the control's reconnect timer is next due (nanoseconds of the clock; `u64::MAX`:
    /// never).
    control_due: AtomicU64,
    parts: Vec<Mutex<Part>>,
    mail: Vec<Mailbox>,
    bells: Vec<Arc<Bell>>,
    /// Whether every transport of a part wakes its thread on arrival (a readiness descriptor).
    wakes: Vec<bool>,
    /// Live channels of each thread's part, as of its last pass.
    live: Vec<Published>,
    /// Requests and adopted parts each thread holds, as of its last pass (closing waits for all
    /// to be done).
    busy: Vec<Published>,
    /// When closing gives up on requests in flight (nanoseconds of the clock; 0: not closing).
    closing_at: AtomicU64,
    /// Engine threads that have exited.
    exited: AtomicUsize,
    /// The next thread for requests spread over the threads in turn.
    turn: AtomicUsize,
    /// Payload bytes front ends copied on their own threads (ublk without user copy, the
    /// library's `write(&[u8])`), and of them write data: added to the engine threads' counts.
    front_copied: AtomicU64,
    front_copied_write: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("parts", &self.parts.len()).finish_non_exhaustive()
    }
}

/// Logs a failed connect the session will try again.
fn retried(
    sh: &Shared,
    session: &InitiatorSession,
    link: usize,
    ch: u16,
    failures: u32,
    failed: Failed,
    e: ChannelConnectError,
) {
    let name = &sh.links[link].name;
    let target = sh.links[link].target;
    let export = &sh.cfg.export;
    if !session.opened() {
        if e == ChannelConnectError::Timeout {
            warn!(link = %name, "no answer from target {target}");
        }
        return;
    }
    match failed {
        Failed::SessionLost => warn!(
            link = %name,
            "target {target} no longer knows session {:#x} (it restarted, or reclaimed the session): \
             opening a new session on export {export}",
            session.connected().map_or(0, |c| c.session)
        ),
        Failed::Retry if failures < sh.cfg.reconnect_warnings => {
            warn!(link = %name, channel = ch, "channel could not be opened: {e:?}; trying again")
        }
        Failed::Retry => debug!(link = %name, channel = ch, "channel could not be opened: {e:?}"),
        Failed::Stale => {}
    }
}

/// The error the session's opening fails with, naming the target, export and link.
fn refused(sh: &Shared, link: usize, refusal: Refusal) -> ConnectError {
    let target = sh.links[link].target.to_string();
    let export = sh.cfg.export.clone();
    let name = sh.links[link].name.clone();
    match refusal {
        Refusal::UnknownExport => ConnectError::UnknownExport { target, export },
        Refusal::Auth(reason) => ConnectError::Auth { target, export, link: name, reason },
        Refusal::InUse(holder) => ConnectError::InUse { target, export, link: name, holder: holder.to_string() },
        Refusal::Refused(reason) => ConnectError::Refused { target, export, link: name, reason },
        Refusal::NoAnswer => ConnectError::Timeout {
            target,
            export,
            links: sh.links.iter().map(|l| l.name.as_str()).collect::<Vec<_>>().join(", "),
        },
        Refusal::Handshake(e) => ConnectError::Handshake {
            target,
            export,
            link: name,
            detail: match e {
                ChannelConnectError::BadProof => "the target did not prove the pre-shared key in its ACCEPT (a target without this export's key, or not the real target)".to_string(),
                ChannelConnectError::BadGrant => "the target granted channel parameters this initiator cannot use".to_string(),
                ChannelConnectError::BadChannelAddress(m) => format!("the target named a group address ({m}) as the channel's address in its ACCEPT"),
                other => format!("{other:?}"),
            },
        },
    }
}

fn nanos(t: Instant) -> u64 {
    t.0
}

impl Shared {
    fn now(&self) -> Instant {
        Instant(self.clock.elapsed().as_nanos() as u64 + 1)
    }

    /// Part `g`, also when a thread panicked while holding it (its state is still consistent
    /// enough to fail requests and close).
    fn part(&self, g: usize) -> MutexGuard<'_, Part> {
        self.parts[g].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The control; its reconnect timer is published again when it is let go of.
    fn control(&self) -> ControlGuard<'_> {
        ControlGuard { guard: self.control.lock().unwrap_or_else(|p| p.into_inner()), shared: self }
    }

    /// Mails `m` to thread `to` and rings it; gives `m` back if that thread has finished.
    fn post(&self, to: usize, m: Mail) -> Result<(), Mail> {
        self.mail[to].post(m)?;
        self.bells[to].ring();
        Ok(())
    }

    /// Tells every thread that the control has something for it.
    fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        for b in &self.bells {
            b.ring();
        }
    }

    fn closing(&self) -> bool {
        self.closing_at.load(Ordering::Acquire) != 0
    }

    /// Starts closing the session (`done` is told when every engine thread has exited).
    fn close(&self, done: Option<oneshot::Sender<()>>, now: Instant) {
        let mut c = self.control();
        if let Some(d) = done {
            c.closers.push(d);
        }
        if self.closing_at.compare_exchange(0, nanos(now + CLOSE_GRACE), Ordering::AcqRel, Ordering::Acquire).is_ok() {
            info!("closing the session");
        }
        drop(c);
        for b in &self.bells {
            b.force();
        }
    }

    /// The thread whose part a request goes to: with the affinity scheduler, the one serving
    /// its buffers' node (its first link there); with round-robin, or for buffers on no link's
    /// node, the threads in turn (each part's scheduler then picks among its own channels).
    fn part_for(&self, node: Option<u32>) -> usize {
        let n = self.parts.len();
        if n == 1 {
            return 0;
        }
        if self.cfg.scheduler == SchedulerKind::Affinity && node.is_some() {
            if let Some(l) = self.links.iter().find(|l| l.node == node) {
                return l.part;
            }
        }
        self.turn.fetch_add(1, Ordering::Relaxed) % n
    }

    /// Inline send mode (the papers' "inline" path): the calling thread takes the part of its
    /// buffers' node (that engine thread's lock, contended by no other engine thread), submits
    /// `io` into it, and sends the frames it put on the channels itself; no hand-off to an
    /// engine thread and no wake-up. The engine threads keep receiving, timers,
    /// retransmissions and completions.
    ///
    /// Falls back to leaving the frames to the engine thread (its bell rung, the request
    /// counted in [`Stats::inline_fallbacks`]) when the request has to wait in the backlog (the
    /// part is full). A thread whose transports cannot wake it on arrival (in-memory links) is
    /// rung after an inline send all the same, so that it looks for the reply (counted in
    /// [`Stats::inline_wakes`]).
    pub(crate) fn submit_inline(&self, io: IoCmd) {
        let g = self.part_for(io.node);
        let mut part = self.part(g);
        let now = self.now();
        if part.finished || part.closing || self.closing() || part.volume.is_none() {
            part.complete(self, io.reply, Err(Error::Closed));
            return;
        }
        let waits = !part.backlog.is_empty();
        part.submit_here(self, io, now);
        if waits || !part.backlog.is_empty() {
            part.stats.inline_fallbacks += 1;
            self.bells[g].ring();
            return;
        }
        part.transmit(self, now);
        part.stats.sent_inline += 1;
        if !self.wakes[g] && self.bells[g].sleeping.load(Ordering::Acquire) {
            part.stats.inline_wakes += 1;
            self.bells[g].ring();
        }
    }

    /// Counts `bytes` of payload a front end copied on its own thread (`write`: write data).
    pub(crate) fn count_front_copy(&self, bytes: u64, write: bool) {
        self.front_copied.fetch_add(bytes, Ordering::Relaxed);
        if write {
            self.front_copied_write.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// The session's counters: every thread's, then the control's.
    fn snapshot(&self) -> Stats {
        let mut s = Stats::default();
        let mut debt = DurabilityDebt::Clear;
        for g in 0..self.parts.len() {
            let part = self.part(g);
            let p = &part.stats;
            s.completed += p.completed;
            s.failed += p.failed;
            s.bytes_read += p.bytes_read;
            s.bytes_written += p.bytes_written;
            s.payload_copied_bytes += p.payload_copied_bytes;
            s.payload_copied_write_bytes += p.payload_copied_write_bytes;
            s.sent_inline += p.sent_inline;
            s.handed_over += p.handed_over;
            s.inline_fallbacks += p.inline_fallbacks;
            s.inline_wakes += p.inline_wakes;
            s.handoffs += p.handoffs;
            s.outstanding += part.inflight.len();
            s.queued += part.backlog.len();
            if let Some(v) = &part.volume {
                s.live_channels += v.live_channels();
                let channels = || v.channel_indices().filter_map(|i| v.channel(i));
                s.retransmits += channels().map(|c| c.stats().retransmits).sum::<u64>();
                let dropped =
                    |r: tyche_channel::DropReason| -> u64 { channels().map(|c| c.stats().dropped[r as usize]).sum() };
                s.unauthenticated += dropped(tyche_channel::DropReason::Unauthenticated);
                s.replayed += dropped(tyche_channel::DropReason::Replayed);
                s.bad_digest += dropped(tyche_channel::DropReason::BadDigest);
                s.durability_epoch = s.durability_epoch.or(v.durability_epoch());
                debt = debt.merge(v.durability_debt());
            }
        }
        s.durability_debt = debt;
        s.payload_copied_bytes += self.front_copied.load(Ordering::Relaxed);
        s.payload_copied_write_bytes += self.front_copied_write.load(Ordering::Relaxed);
        s.channels = self.slot_count;
        s.reconnects = self.control().session.reconnects();
        s
    }

    /// Counters and placement; each link's thread as that engine thread saw itself once placed.
    fn report(&self) -> crate::report::Report {
        use crate::report::{ChannelReport, LinkReport, Report};
        let s = self.snapshot();
        let here = tyche_numa::report::this_thread();
        let mut threads = Vec::with_capacity(self.parts.len());
        let mut poll = Vec::with_capacity(self.parts.len());
        let mut channels = Vec::new();
        let (session, channel_link) = {
            let c = self.control();
            (c.session.connected().map_or(0, |c| c.session), c.channel_link.clone())
        };
        for g in 0..self.parts.len() {
            let part = self.part(g);
            let thread = part.thread.clone().unwrap_or_else(|| here.clone());
            threads.push(part.thread.clone());
            poll.push(part.poll);
            let Some(v) = &part.volume else { continue };
            for ch in v.channel_indices() {
                let Some(c) = v.channel(ch) else { continue };
                let link = channel_link.get(&ch).copied();
                let cs = c.stats();
                channels.push(ChannelReport {
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
                    timeouts: cs.timeouts,
                    spurious_timeouts: cs.spurious_timeouts,
                    thread: thread.clone(),
                });
            }
        }
        channels.sort_by_key(|c| c.channel);
        let thread_of = |k: usize| threads[self.links[k].part].clone().unwrap_or_else(|| here.clone());
        let mut r = Report {
            export: self.cfg.export.clone(),
            session,
            scheduler: self.cfg.scheduler.to_string(),
            live_channels: s.live_channels,
            completed: s.completed,
            failed: s.failed,
            bytes_read: s.bytes_read,
            bytes_written: s.bytes_written,
            payload_copied_bytes: s.payload_copied_bytes,
            payload_copied_write_bytes: s.payload_copied_write_bytes,
            reconnects: s.reconnects,
            refused: crate::report::Refused {
                unauthenticated: s.unauthenticated,
                replayed: s.replayed,
                bad_digest: s.bad_digest,
            },
            poll_mode: self.cfg.poll.mode,
            poll_budget_us: self.cfg.poll.budget.as_micros() as u64,
            poll,
            send: crate::report::SendCounters {
                mode: self.cfg.send_mode.to_string(),
                inline: s.sent_inline,
                handed_over: s.handed_over,
                inline_fallbacks: s.inline_fallbacks,
                inline_wakes: s.inline_wakes,
            },
            channels,
            ..Report::default()
        };
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

    /// Runs the reconnect timer when it is due: connection attempts (the first ones,
    /// reconnections, a new session) go to the threads of their links.
    fn control_timers(&self, now: Instant) -> bool {
        if now.0 < self.control_due.load(Ordering::Acquire) {
            return false;
        }
        let mut c = self.control();
        let mut started = false;
        if !c.session.refused() && !self.closing() {
            while let Some(plan) = c.session.poll_connect(now) {
                self.start_connector(&mut c, plan, now);
                started = true;
            }
            drop(c);
        } else {
            // Nothing will be started (closing, or opening failed): no thread needs to look.
            drop(c);
            self.control_due.store(u64::MAX, Ordering::Release);
        }
        if started {
            self.bump();
        }
        started
    }

    /// Makes the connector `plan` asks for, for its link's thread to take.
    fn start_connector(&self, c: &mut Control, plan: ConnectPlan, now: Instant) {
        let link = c.session.link(plan.slot);
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
        if plan.session == 0 && c.session.opened() {
            info!(link = %name, "opening a new session on export {}", self.cfg.export);
        } else if plan.session == 0 {
            debug!(link = %name, "opening session");
        } else if plan.failures > 0 && plan.failures <= self.cfg.reconnect_warnings {
            info!(link = %name, "reconnect attempt {} on {name}", plan.failures + 1);
        } else if plan.failures > 0 {
            debug!(link = %name, "reconnect attempt {} on {name}", plan.failures + 1);
        }
        let opening = InitiatorSession::opening(&plan, connector);
        c.connects[self.links[link].part].push((plan.channel, opening));
    }

    /// An engine thread is done; the last one wakes the closers.
    fn exit_thread(&self) {
        if self.exited.fetch_add(1, Ordering::AcqRel) + 1 == self.parts.len() {
            for w in self.control().closers.drain(..) {
                let _ = w.send(());
            }
            info!("session closed");
        }
    }
}

/// The control, held; its reconnect timer is published again when it is let go of.
struct ControlGuard<'a> {
    guard: MutexGuard<'a, Control>,
    shared: &'a Shared,
}

impl std::ops::Deref for ControlGuard<'_> {
    type Target = Control;
    fn deref(&self) -> &Control {
        &self.guard
    }
}

impl std::ops::DerefMut for ControlGuard<'_> {
    fn deref_mut(&mut self) -> &mut Control {
        &mut self.guard
    }
}

impl Drop for ControlGuard<'_> {
    fn drop(&mut self) {
        let due = self.guard.session.poll_timeout().map_or(u64::MAX, nanos);
        self.shared.control_due.store(due, Ordering::Release);
    }
}

impl Part {
    fn new(g: usize, io: Vec<(usize, Transport)>) -> Self {
        Part {
            g,
            io,
            volume: None,
            resumes: 0,
            seen: 0,
            connectors: HashMap::new(),
            channel_link: HashMap::new(),
            next_id: g as u64 + 1,
            inflight: HashMap::new(),
            backlog: VecDeque::new(),
            rx_scratch: Vec::new(),
            rx_gather: Vec::new(),
            last_timeout_run: Instant::ZERO,
            stats: Stats::default(),
            fronts: HashMap::new(),
            front_ios: Vec::new(),
            front_runs: Vec::new(),
            thread: None,
            poll: PollStats::default(),
            closing: false,
            finished: false,
        }
    }

    /// One pass over this thread's share: mail, what the control has for it, front ends'
    /// requests, the backlog, receive → events → transmit → timers → events, front ends'
    /// replies. Returns whether anything happened.
    fn pass(&mut self, sh: &Shared, now: Instant) -> bool {
        if sh.closing() && !self.closing {
            self.closing = true;
            for io in std::mem::take(&mut self.backlog) {
                self.complete(sh, io.reply, Err(Error::Closed));
            }
        }
        let mut work = self.sync(sh, now);
        work |= self.take_mail(sh, now);
        work |= self.fronts_receive(sh, now);
        work |= self.drain_backlog(sh, now);
        work |= self.receive(sh, now);
        work |= self.events(sh, now);
        work |= self.transmit(sh, now);
        work |= self.timers(sh, now);
        work |= self.events(sh, now);
        work |= self.fronts_send();
        self.publish(sh);
        work
    }

    /// Takes what the control has for this thread once its generation moved: its part of a new
    /// volume, a new session to move to, connectors for its links.
    fn sync(&mut self, sh: &Shared, now: Instant) -> bool {
        let generation = sh.generation.load(Ordering::Acquire);
        if generation == self.seen {
            return false;
        }
        self.seen = generation;
        let mut c = sh.control();
        self.take_part(&mut c);
        self.follow(&c, now);
        let connects = std::mem::take(&mut c.connects[self.g]);
        drop(c);
        self.connectors.extend(connects);
        self.exchange(sh, now);
        true
    }

    fn take_part(&mut self, c: &mut Control) {
        if self.volume.is_none() {
            self.volume = c.parts.get_mut(self.g).and_then(Option::take);
        }
    }

    /// Moves this thread's part to the control's session if the session moved since.
    fn follow(&mut self, c: &Control, now: Instant) {
        if self.resumes >= c.session.resumes() {
            return;
        }
        let (Some(v), Some(conn)) = (self.volume.as_mut(), c.session.connected()) else { return };
        self.resumes = c.session.resumes();
        // Parts adopted in the old session go, their data with them (their origins issue them
        // again).
        if v.session() != conn.session {
            v.resume(conn.session, now);
        }
        self.channel_link.retain(|&ch, _| v.channel(ch).is_some());
    }

    /// Publishes what the other threads read of this one: its live channels (where hand-offs
    /// go) and what it holds (what closing waits for).
    fn publish(&self, sh: &Shared) {
        let live = self.volume.as_ref().map_or(0, Volume::live_channels);
        let busy =
            if self.finished { 0 } else { self.inflight.len() + self.volume.as_ref().map_or(0, Volume::adopted_parts) };
        for (slot, v) in [(&sh.live[self.g], live), (&sh.busy[self.g], busy)] {
            if slot.0.load(Ordering::Relaxed) != v {
                slot.0.store(v, Ordering::Release);
            }
        }
    }

    fn take_mail(&mut self, sh: &Shared, now: Instant) -> bool {
        if !sh.mail[self.g].has_mail() {
            return false;
        }
        for m in sh.mail[self.g].take() {
            match m {
                Mail::Submit(io) => self.submit_here(sh, io, now),
                Mail::Complete(c, outcome) => self.complete(sh, c, outcome),
                Mail::Hand(HandMessage::Handoff { from, handoff }) => {
                    let Some(v) = self.volume.as_mut() else { continue };
                    // The write data was copied out of the origin's buffer.
                    let copied = handoff.data_len() as u64;
                    self.stats.payload_copied_bytes += copied;
                    self.stats.payload_copied_write_bytes += copied;
                    v.adopt(now, from, handoff);
                }
                Mail::Hand(HandMessage::Handback(back)) => {
                    let Some(v) = self.volume.as_mut() else { continue };
                    let Some(ReadBack { id, offset, data }) = v.handed_back(now, back) else { continue };
                    let at = offset as usize;
                    if let Some(dst) =
                        self.inflight.get_mut(&id).and_then(|r| r.buf.as_mut_slice().get_mut(at..at + data.len()))
                    {
                        dst.copy_from_slice(&data);
                        self.stats.payload_copied_bytes += data.len() as u64;
                    }
                }
            }
        }
        self.exchange(sh, now);
        true
    }

    /// Hands the queued parts of this thread's part, while it has no live channel, to the next
    /// thread whose part has one (with their write data), and what this part adopted and is
    /// done with (or cannot do) back to their origins (with read data): the decisions and the
    /// data they carry are `tyche_channel::exchange_part`'s, as in the simulator.
    fn exchange(&mut self, sh: &Shared, now: Instant) {
        let n = sh.parts.len();
        let Part { g, volume, inflight, stats, .. } = self;
        let Some(v) = volume.as_mut() else { return };
        let mut mail = MailOut(Vec::new());
        let live = |q: usize| sh.live[q].0.load(Ordering::Acquire) > 0;
        let request = |id| inflight.get(&id).map(|r: &InFlight| r.buf.as_slice());
        stats.handoffs += exchange_part(v, *g, n, live, request, now, &mut mail);
        for (to, m) in mail.0 {
            self.post(sh, to, m);
        }
    }

    /// Mails `m` to thread `to`. A thread that has finished (the session is closing) takes no
    /// more: a request is failed here, anything else is dropped (its request is failed by the
    /// thread that holds it, and a front end's outcome has no front end left to go to).
    fn post(&mut self, sh: &Shared, to: usize, m: Mail) {
        if let Err(m) = sh.post(to, m) {
            self.refused(sh, m);
        }
    }

    fn refused(&mut self, sh: &Shared, m: Mail) {
        if let Mail::Submit(io) = m {
            self.complete(sh, io.reply, Err(Error::Closed));
        }
    }

    /// Routes a request to the part it belongs in ([`Shared::part_for`]).
    fn submit(&mut self, sh: &Shared, io: IoCmd, now: Instant) {
        let to = sh.part_for(io.node);
        if to == self.g || self.closing {
            self.submit_here(sh, io, now);
        } else {
            self.post(sh, to, Mail::Submit(io));
        }
    }

    /// Submits a request into this thread's part (or its backlog while the part is full).
    fn submit_here(&mut self, sh: &Shared, io: IoCmd, now: Instant) {
        if self.closing || self.finished || self.volume.is_none() {
            self.complete(sh, io.reply, Err(Error::Closed));
            return;
        }
        if !self.backlog.is_empty() {
            self.backlog.push_back(io);
            return;
        }
        if let Err(io) = self.try_submit(sh, io, now) {
            self.backlog.push_back(io);
        }
    }

    /// Submits `io`, or gives it back when the part is busy.
    // The request itself comes back when the part is full: it goes to the backlog as it is
    // (boxing it would cost an allocation per request).
    #[allow(clippy::result_large_err)]
    fn try_submit(&mut self, sh: &Shared, io: IoCmd, now: Instant) -> Result<(), IoCmd> {
        let id = self.next_id;
        let Some(vol) = self.volume.as_mut() else {
            self.complete(sh, io.reply, Err(Error::Closed));
            return Ok(());
        };
        let req = IoRequest { id, op: io.op, fua: io.fua, offset: io.offset, length: io.length, node: io.node };
        match vol.submit(now, req) {
            Ok(()) => {
                self.next_id += sh.parts.len() as u64;
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
                self.complete(sh, io.reply, Err(e.into()));
                Ok(())
            }
        }
    }

    fn drain_backlog(&mut self, sh: &Shared, now: Instant) -> bool {
        let mut work = false;
        while let Some(io) = self.backlog.pop_front() {
            match self.try_submit(sh, io, now) {
                Ok(()) => work = true,
                Err(io) => {
                    self.backlog.push_front(io);
                    break;
                }
            }
        }
        work
    }

    fn receive(&mut self, sh: &Shared, now: Instant) -> bool {
        let mut outcomes = Vec::new();
        let mut n = 0;
        let ethertype = sh.cfg.ethertype;
        let Part { io, connectors, volume, inflight, stats, rx_scratch, rx_gather, .. } = self;
        for (k, transport) in io.iter_mut() {
            let link = &sh.links[*k];
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
                    v.handle_frame_pieces(now, pieces, rx_scratch, rx_gather)
                {
                    let len = payload.len();
                    // The volume only places data inside the request; a range outside it would be
                    // an engine bug, and is dropped rather than trusted.
                    let own = inflight.get_mut(&id).map(|r| r.buf.as_mut_slice());
                    if let Some(dst) = v.request_data(own, id, offset, len) {
                        let mut o = 0;
                        for piece in payload.parts() {
                            dst[o..o + piece.len()].copy_from_slice(piece);
                            o += piece.len();
                        }
                        stats.bytes_read += len as u64;
                        stats.payload_copied_bytes += len as u64;
                    }
                }
            });
            match res {
                Ok(got) => n += got,
                Err(e) => warn!(link = %link.name, "receive failed: {e}"),
            }
        }
        for (ch, outcome) in outcomes {
            self.connector_done(sh, ch, outcome, now);
        }
        n > 0
    }

    /// A handshake finished: the session says what it means; this thread acts on it.
    fn connector_done(&mut self, sh: &Shared, ch: u16, outcome: Result<Connected, ChannelConnectError>, now: Instant) {
        let Some(p) = self.connectors.remove(&ch) else { return };
        let mut c = sh.control();
        let link = c.session.link(p.slot);
        let name = &sh.links[link].name;
        let (channel, moved) = match c.session.finished(&p, ch, outcome, sh.cfg.timers, now) {
            Setup::Create { channel, connected } => {
                self.create_volume(sh, &mut c, &connected, now);
                let params = connected.params;
                debug!(link = %name, channel = ch, segment = params.segment, max_io = params.max_io, "channel open");
                (channel, true)
            }
            Setup::Resume { channel, connected, previous } => {
                if !self.resume_volume(sh, &mut c, link, &connected, &previous, now) {
                    return;
                }
                (channel, true)
            }
            Setup::Join { channel, reopened } => {
                if reopened {
                    info!(link = %name, channel = ch, "channel reconnected after {} attempt(s)", p.failures + 1);
                } else {
                    let params = channel.params();
                    debug!(link = %name, channel = ch, segment = params.segment, max_io = params.max_io, "channel open");
                }
                self.take_part(&mut c);
                self.follow(&c, now);
                (channel, false)
            }
            Setup::Abandon { mut channel } => {
                // Opened for a session since abandoned, or a probe of a fenced one: not used,
                // and closed with a DISCONNECT so the target lets it go at once.
                debug!(link = %name, channel = ch, "closing a channel of an abandoned session");
                if let Some((_, t)) = self.io.iter_mut().find(|(k, _)| *k == link) {
                    if let Err(e) = t.send(1, &mut |buf| channel.abandon(now, buf)) {
                        debug!(link = %name, "sending DISCONNECT failed: {e}");
                    }
                }
                return;
            }
            Setup::Retry { failed, error } => {
                retried(sh, &c.session, link, ch, p.failures, failed, error);
                return;
            }
            Setup::Fatal(refusal) => {
                c.fatal = Some(refused(sh, link, refusal));
                return;
            }
        };
        let Some(vol) = self.volume.as_mut() else { return };
        vol.add_channel(channel, sh.links[link].node, now);
        c.channel_link.insert(ch, link);
        self.channel_link.insert(ch, link);
        drop(c);
        if moved {
            sh.bump();
        }
        self.publish(sh);
        self.exchange(sh, now);
    }

    /// The session's first channel opened: the volume is made, a part per engine thread; this
    /// thread takes its own, the others theirs when they next look.
    fn create_volume(&mut self, sh: &Shared, c: &mut Control, conn: &Connected, now: Instant) {
        let cfg = VolumeConfig {
            export_size: conn.export_size,
            read_only: conn.export_flags & flags::EXPORT_READ_ONLY != 0,
            no_path_timeout: sh.cfg.no_path_timeout,
            io_timeout: sh.cfg.io_timeout,
            max_requests: sh.cfg.max_requests,
        };
        let nodes: Vec<u32> = sh.links.iter().filter_map(|l| l.node).collect();
        let board = VolumeBoard::new(sh.parts.len(), conn.session);
        let mut parts: Vec<Option<Volume>> = (0..sh.parts.len())
            .map(|q| {
                let scheduler: Box<dyn Scheduler> =
                    Box::new(NumaScheduler::with_order(sh.cfg.scheduler, &nodes, sh.cfg.node_order.as_ref()));
                let board = Arc::clone(&board);
                Some(Volume::part(cfg, conn.session, sh.cfg.ethertype, scheduler, now, board, q))
            })
            .collect();
        let mut mine = parts[self.g].take().expect("made");
        // An earlier process's unflushed writes: kept if this session presents the epoch they
        // were acknowledged under, else the next FLUSH fails.
        mine.inherit_debt(sh.cfg.prior_writes);
        self.volume = Some(mine);
        c.parts = parts;
    }

    /// A new session replaced one the target forgot: this thread's part moves to it (the
    /// others follow). False when this thread has no part to add the channel to.
    fn resume_volume(
        &mut self,
        sh: &Shared,
        c: &mut Control,
        link: usize,
        conn: &Connected,
        old: &Connected,
        now: Instant,
    ) -> bool {
        let name = &sh.links[link].name;
        if conn.export_size != old.export_size || conn.export_flags != old.export_flags {
            warn!(
                link = %name,
                "export {} changed across the target's restart (size {} -> {}, flags {:#x} -> {:#x}); \
                 the device keeps its size",
                sh.cfg.export, old.export_size, conn.export_size, old.export_flags, conn.export_flags
            );
        }
        self.take_part(c);
        let Some(vol) = self.volume.as_ref() else { return false };
        let waiting = vol.outstanding();
        let (was, unflushed) = (vol.durability_epoch(), vol.unflushed_writes());
        self.follow(c, now);
        match was {
            Some(e) if unflushed && !e.keeps(&conn.durability_epoch) => warn!(
                link = %name, "the target's durability epoch changed ({e} -> {}): writes not flushed \
                 may be lost, and the next FLUSH fails", conn.durability_epoch
            ),
            Some(_) if unflushed => {
                info!(link = %name, "same durability epoch: the writes not flushed are still there")
            }
            _ => {}
        }
        info!(
            link = %name, session = format_args!("{:#x}", conn.session), reissued = waiting,
            "new session open; requests not completed are issued again"
        );
        true
    }

    /// Completions and channel deaths of this thread's part.
    fn events(&mut self, sh: &Shared, now: Instant) -> bool {
        // A part whose channels all died hands its queue over; adopters report back.
        self.exchange(sh, now);
        let Some(vol) = self.volume.as_mut() else { return false };
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
                    let name = self.channel_link.get(&channel).map_or("?", |&l| sh.links[l].name.as_str());
                    warn!(
                        link = %name, channel, ?reason, reissued,
                        live = vol.live_channels(),
                        "channel dead; its requests go to the other channels"
                    );
                    if vol.live_channels() == 0
                        && sh.live.iter().enumerate().all(|(q, l)| q == self.g || l.0.load(Ordering::Acquire) == 0)
                    {
                        warn!(
                            "every channel is down: requests wait up to {:?} for a reconnect, then fail",
                            sh.cfg.no_path_timeout
                        );
                    }
                }
            }
        }
        if no_path > 0 {
            error!(
                "{no_path} request(s) failed with an I/O error: no channel for {:?} (no-path timeout)",
                sh.cfg.no_path_timeout
            );
        }
        if !dead.is_empty() {
            self.publish(sh);
            let mut c = sh.control();
            for (channel, reason) in dead {
                if reason == DeadReason::PeerClosed(DisconnectReason::Shutdown) {
                    info!(channel, "the target is shutting down: reconnecting at once");
                }
                c.session.channel_dead(channel, reason, now);
            }
        }
        for (c, result) in completed {
            self.complete(sh, c, result);
        }
        work
    }

    /// Hands a request's outcome to whoever waits for it (a front end of another thread by
    /// that thread's mailbox).
    fn complete(&mut self, sh: &Shared, c: Completion, result: Outcome) {
        match c {
            Completion::Client(reply) => {
                let _ =
                    reply.send(result.map(|(op, buf)| if op.has_read_data() { buf.into_vec() } else { Vec::new() }));
            }
            Completion::Front { part, key, token } if part == self.g => {
                if let Some(f) = self.fronts.get_mut(&key) {
                    f.complete(token, result);
                }
            }
            c @ Completion::Front { part, .. } => self.post(sh, part, Mail::Complete(c, result)),
        }
    }

    fn transmit(&mut self, sh: &Shared, now: Instant) -> bool {
        let mut sent = 0;
        let per = sh.cfg.channels_per_link.max(1);
        let Part { io, connectors, volume, inflight, channel_link, stats, .. } = self;
        for (k, t) in io.iter_mut() {
            let (k, link) = (*k, &sh.links[*k]);
            for p in connectors.values_mut().filter(|p| p.slot / per == k) {
                let r = t.send(1, &mut |buf| p.connector.poll_transmit(now, buf));
                sent += r.unwrap_or(0);
            }
            if let Some(vol) = volume.as_mut() {
                for (&ch, _) in channel_link.iter().filter(|(_, &l)| l == k) {
                    if !vol.wants_transmit(ch) {
                        continue;
                    }
                    loop {
                        let r = t.send(TX_BUDGET, &mut |buf| {
                            let out = vol.poll_transmit(now, ch, buf)?;
                            if let Some((id, offset, len)) = out.payload {
                                let (at, len) = (offset as usize, len as usize);
                                let own = inflight.get_mut(&id).map(|r| r.buf.as_mut_slice());
                                let Some(src) = vol.request_data(own, id, offset, len) else {
                                    // The part's data is not here (an engine bug): the frame
                                    // would carry whatever the buffer held before, so it is not
                                    // sent; the segment is resent later or its request fails.
                                    error!(id, offset = at, len, "write data of a segment to send is missing");
                                    return Some(0);
                                };
                                buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len].copy_from_slice(src);
                                stats.payload_copied_bytes += len as u64;
                                stats.payload_copied_write_bytes += len as u64;
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

    fn timers(&mut self, sh: &Shared, now: Instant) -> bool {
        let mut work = false;
        let reads_board = self.reads_board();
        if let Some(vol) = self.volume.as_mut() {
            let due = vol.poll_timeout().is_some_and(|t| t <= now);
            // The no-path clock starts inside handle_timeout: run it regularly too.
            if due || now.since(self.last_timeout_run) >= Duration::from_millis(1) {
                vol.handle_timeout(now);
                self.last_timeout_run = now;
                work |= due;
            }
            // The floors: each part reads the others' on its own timer while the volume is busy.
            if reads_board && vol.refresh_at().is_some_and(|t| t <= now) {
                vol.refresh(now);
            }
        }
        self.exchange(sh, now);
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
            self.connector_done(sh, ch, outcome, now);
            work = true;
        }
        work |= sh.control_timers(now);
        work
    }

    /// Whether this thread's part must keep reading the board: it holds requests, or another
    /// part does (an idle part's next tag would hold the session's floor down).
    fn reads_board(&self) -> bool {
        self.volume.as_ref().is_some_and(|v| v.outstanding() > 0 || v.adopted_parts() > 0 || v.volume_busy())
    }

    /// Takes and submits the requests of this thread's front ends.
    fn fronts_receive(&mut self, sh: &Shared, now: Instant) -> bool {
        if self.fronts.is_empty() {
            return false;
        }
        let mut ios = std::mem::take(&mut self.front_ios);
        let mut runs = std::mem::take(&mut self.front_runs);
        for (&key, f) in self.fronts.iter_mut() {
            let before = ios.len();
            f.receive(&mut ios);
            if ios.len() > before {
                runs.push((key, f.node(), f.queued(), ios.len() - before));
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
                let reply = Completion::Front { part: self.g, key, token: io.token };
                let FrontIo { op, fua, offset, length, data, .. } = io;
                self.submit(sh, IoCmd { op, fua, offset, length, data, node, reply }, now);
            }
        }
        drop(drain);
        runs.clear();
        self.front_ios = ios;
        self.front_runs = runs;
        work
    }

    /// Lets this thread's front ends write their replies, and ends those that are over.
    fn fronts_send(&mut self) -> bool {
        if self.fronts.is_empty() {
            return false;
        }
        let mut work = false;
        let mut over = false;
        for f in self.fronts.values_mut() {
            work |= f.send();
            over |= f.finished();
        }
        if over {
            let done: Vec<u64> = self.fronts.iter().filter(|(_, f)| f.finished()).map(|(&k, _)| k).collect();
            for key in done {
                if let Some(f) = self.fronts.remove(&key) {
                    f.close(false);
                }
            }
        }
        work
    }

    /// Whether a front end has requests its reader thread handed over.
    fn fronts_handed_waiting(&self) -> bool {
        self.fronts.values().any(|f| f.handed_waiting())
    }

    /// What this thread polls its front ends for while it sleeps.
    fn fronts_poll_set(&self) -> Vec<(WaitFd, PollFlags)> {
        self.fronts.values().filter_map(|f| f.wait_for()).collect()
    }

    /// Whether a closing thread may finish: no thread holds requests or adopted parts any
    /// more, or the grace is over.
    fn may_finish(&self, sh: &Shared, now: Instant) -> bool {
        self.closing
            && (sh.busy.iter().all(|b| b.0.load(Ordering::Acquire) == 0)
                || now.0 >= sh.closing_at.load(Ordering::Acquire))
    }

    /// Fails what is left, closes the front ends, and sends DISCONNECT on every channel of
    /// this thread's part.
    fn finish(&mut self, sh: &Shared, now: Instant) {
        let inflight: Vec<InFlight> = self.inflight.drain().map(|(_, r)| r).collect();
        for r in inflight {
            self.complete(sh, r.reply, Err(Error::Closed));
        }
        for io in std::mem::take(&mut self.backlog) {
            self.complete(sh, io.reply, Err(Error::Closed));
        }
        for (_, mut f) in self.fronts.drain() {
            f.send();
            f.close(true);
        }
        // Mail from now on goes back to its sender; what came before is failed or dropped.
        for m in sh.mail[self.g].close() {
            self.refused(sh, m);
        }
        if let Some(v) = self.volume.as_mut() {
            v.close();
        }
        self.transmit(sh, now);
        self.finished = true;
        self.publish(sh);
    }
}

/// Which engine thread serves each link: one per distinct node (in order of first appearance)
/// with [`EngineThreads::PerNode`], else all on one.
fn parts_of(layout: EngineThreads, nodes: &[Option<u32>]) -> Vec<usize> {
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

/// A session opened and its engine threads running: what a [`Client`](crate::Client) is made of.
#[derive(Debug)]
pub(crate) struct Started {
    /// Each engine thread's command queue and bell.
    pub(crate) engines: Vec<(Sender<Cmd>, Arc<Bell>)>,
    /// The engine thread serving each node's links.
    pub(crate) node_engine: Vec<(Option<u32>, usize)>,
    pub(crate) info: ExportInfo,
    pub(crate) mode: SendMode,
    /// The NUMA node of each link's NIC.
    pub(crate) nodes: Vec<Option<u32>>,
    pub(crate) shared: Arc<Shared>,
}

/// Opens the session and starts the engine threads (`crate::connect_blocking`).
pub(crate) fn start(cfg: InitiatorConfig, links: Vec<Link>) -> Result<Started, ConnectError> {
    cfg.validate().map_err(ConnectError::Config)?;
    if links.is_empty() {
        return Err(ConnectError::NoLinks);
    }
    let nodes: Vec<Option<u32>> = links.iter().map(|l| l.node).collect();
    let part_of = parts_of(cfg.engine_threads, &nodes);
    let parts = part_of.iter().max().map_or(1, |g| g + 1);
    let bells = (0..parts)
        .map(|_| Bell::new().map(Arc::new))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| ConnectError::Os { what: "create an eventfd", source: e })?;
    let (metas, by_part) = link_parts(links, &part_of, parts);
    let (sleep_fds, wakes) = sleep_descriptors(&by_part)?;
    let mine: Vec<Vec<usize>> = by_part.iter().map(|m| m.iter().map(|(k, _)| *k).collect()).collect();
    let per = cfg.channels_per_link;
    let slot_count = metas.len() * per;
    let slot_links: Vec<usize> = (0..slot_count).map(|i| i / per).collect();
    let policy = ReconnectPolicy { min: cfg.reconnect_delay, max: cfg.reconnect_max_delay.max(cfg.reconnect_delay) };
    // The first attempt (on the first link) is due at once.
    let control = Control {
        session: InitiatorSession::new(slot_links, policy, FirstOpen::GiveUp, Instant::ZERO),
        parts: Vec::new(),
        connects: (0..parts).map(|_| Vec::new()).collect(),
        fatal: None,
        closers: Vec::new(),
        channel_link: HashMap::new(),
    };
    let shared = Arc::new(Shared {
        cfg,
        clock: std::time::Instant::now(),
        links: metas,
        slot_count,
        control: Mutex::new(control),
        generation: AtomicU64::new(0),
        control_due: AtomicU64::new(0),
        parts: by_part.into_iter().enumerate().map(|(g, io)| Mutex::new(Part::new(g, io))).collect(),
        mail: (0..parts).map(|_| Mailbox::default()).collect(),
        bells: bells.clone(),
        wakes,
        live: (0..parts).map(|_| Published::default()).collect(),
        busy: (0..parts).map(|_| Published::default()).collect(),
        closing_at: AtomicU64::new(0),
        exited: AtomicUsize::new(0),
        turn: AtomicUsize::new(0),
        front_copied: AtomicU64::new(0),
        front_copied_write: AtomicU64::new(0),
    });
    let info = open_session(&shared, parts)?;
    let mode = shared.cfg.send_mode;
    let (engines, node_engine) = spawn_engines(&shared, mine, sleep_fds, &bells, &nodes)?;
    Ok(Started { engines, node_engine, info, mode, nodes, shared })
}

/// Each link's description, and its transport in the list of its engine thread's part
/// (`part_of[k]` of `parts`), with its index.
fn link_parts(links: Vec<Link>, part_of: &[usize], parts: usize) -> (Vec<LinkMeta>, Vec<Vec<(usize, Transport)>>) {
    let mut by_part: Vec<Vec<(usize, Transport)>> = (0..parts).map(|_| Vec::new()).collect();
    let mut metas = Vec::with_capacity(links.len());
    for (k, l) in links.into_iter().enumerate() {
        let caps = l.transport.capabilities();
        metas.push(LinkMeta {
            name: l.name,
            target: l.target,
            node: l.node,
            local_mac: caps.local_mac,
            mtu: caps.mtu,
            frame_capacity: caps.frame_capacity,
            memory_node: caps.numa_node,
            areas: caps.memory_areas,
            part: part_of[k],
        });
        by_part[part_of[k]].push((k, l.transport));
    }
    (metas, by_part)
}

/// What each engine thread sleeps on besides its bell: duplicates of its transports' readiness
/// descriptors, so that it sleeps without holding its part; and whether every one of its
/// transports has one (else it must wake up to poll).
type SleepFds = (Vec<Vec<std::os::fd::OwnedFd>>, Vec<bool>);

fn sleep_descriptors(by_part: &[Vec<(usize, Transport)>]) -> Result<SleepFds, ConnectError> {
    let mut sleep_fds = Vec::with_capacity(by_part.len());
    let mut wakes = Vec::with_capacity(by_part.len());
    for mine in by_part {
        let mut fds = Vec::new();
        for (_, t) in mine {
            if let Some(fd) = t.readiness_fd() {
                let fd = fd
                    .try_clone_to_owned()
                    .map_err(|e| ConnectError::Os { what: "duplicate a readiness descriptor", source: e })?;
                fds.push(fd);
            }
        }
        wakes.push(fds.len() == mine.len());
        sleep_fds.push(fds);
    }
    Ok((sleep_fds, wakes))
}

/// Opens the session on the calling thread, over every link, turning each part in turn until
/// every channel is placed. Bounded: every connector gives up after `connect_attempts *
/// connect_retry`.
fn open_session(shared: &Arc<Shared>, parts: usize) -> Result<ExportInfo, ConnectError> {
    loop {
        let now = shared.now();
        for g in 0..parts {
            shared.part(g).pass(shared, now);
        }
        let mut c = shared.control();
        if let Some(e) = c.fatal.take() {
            return Err(e);
        }
        let placed = c.session.opened() && c.parts.iter().all(Option::is_none) && c.connects.iter().all(Vec::is_empty);
        drop(c);
        if placed && (0..parts).all(|g| shared.part(g).connectors.is_empty()) {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let c = *shared.control().session.connected().expect("volume exists");
    let info = ExportInfo {
        export: shared.cfg.export.clone(),
        size: c.export_size,
        block_size: c.block_size,
        read_only: c.export_flags & flags::EXPORT_READ_ONLY != 0,
        discard: c.export_flags & flags::EXPORT_DISCARD != 0,
        session: c.session,
        max_io: c.params.max_io,
    };
    info!(
        export = %info.export, session = format_args!("{:#x}", info.session), size = info.size,
        channels = (0..parts).map(|g| shared.part(g).volume.as_ref().map_or(0, Volume::live_channels)).sum::<usize>(),
        engine_threads = parts,
        "session open"
    );
    Ok(info)
}

/// An engine thread's command queue and bell, and the engine thread serving each node's links.
type Engines = (Vec<(Sender<Cmd>, Arc<Bell>)>, Vec<(Option<u32>, usize)>);

/// Starts an engine thread per part (`mine[g]`: the indices of its links, whose NICs are on
/// `nodes[k]`), each sleeping on its `sleep_fds[g]` and `bells[g]`.
fn spawn_engines(
    shared: &Arc<Shared>,
    mine: Vec<Vec<usize>>,
    sleep_fds: Vec<Vec<std::os::fd::OwnedFd>>,
    bells: &[Arc<Bell>],
    nodes: &[Option<u32>],
) -> Result<Engines, ConnectError> {
    let parts = mine.len();
    // The placement experiment: every engine thread on one given node.
    let thread_node = shared.cfg.engine_thread_node;
    let mut queues: Vec<(Sender<Cmd>, Arc<Bell>)> = Vec::with_capacity(parts);
    let mut node_part: Vec<(Option<u32>, usize)> = Vec::new();
    let mut all_nodes: Vec<u32> = nodes.iter().flatten().copied().collect();
    all_nodes.sort_unstable();
    all_nodes.dedup();
    for (g, ((mine, fds), bell)) in mine.into_iter().zip(sleep_fds).zip(bells).enumerate() {
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
            if !node_part.iter().any(|(n, _)| *n == nodes[*k]) {
                node_part.push((nodes[*k], g));
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        queues.push((tx, Arc::clone(bell)));
        let name = match (parts, home) {
            (1, _) | (_, None) => "tyche-engine".to_owned(),
            (_, Some(n)) => format!("tyche-engine{n}"),
        };
        let shared = Arc::clone(shared);
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
            .map_err(|e| ConnectError::Os { what: "start an engine thread", source: e })?;
    }
    Ok((queues, node_part))
}

/// An engine thread's loop over its part (`shared.parts[g]`); `fds` are duplicates of its
/// transports' readiness descriptors. Returns when the session is closed (after every client is
/// gone or one asked) and this thread has sent its DISCONNECTs.
fn serve(sh: &Shared, g: usize, fds: Vec<std::os::fd::OwnedFd>, rx: Receiver<Cmd>) {
    let bell = Arc::clone(&sh.bells[g]);
    let placed = tyche_numa::report::this_thread();
    sh.part(g).thread = Some(placed.clone());
    // Links without a readiness descriptor (in-memory ones) are polled: sleep briefly.
    let all_fds = sh.wakes[g];
    let mut poller = Poller::new(sh.cfg.poll);
    let run_queue = SchedStat::of_this_thread();
    let mut disconnected = false;
    let mut next: Option<Cmd> = None;
    // Stats and reports read every thread's part: answered without holding this one's.
    let mut asked: Vec<Cmd> = Vec::new();
    let answer = |asked: &mut Vec<Cmd>| answer(sh, asked);
    loop {
        let mut part = sh.part(g);
        let now = sh.now();
        let mut work = false;
        let mut command = |part: &mut Part, cmd: Cmd| command(sh, part, cmd, now, &placed, &mut asked);
        if let Some(cmd) = next.take() {
            command(&mut part, cmd);
            work = true;
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => {
                    command(&mut part, cmd);
                    work = true;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    if !disconnected {
                        disconnected = true;
                        sh.close(None, now);
                    }
                    break;
                }
            }
        }
        work |= part.pass(sh, now);
        if part.may_finish(sh, now) {
            part.finish(sh, now);
            // The transports go with the thread.
            drop(std::mem::take(&mut part.io));
            drop(part);
            answer(&mut asked);
            sh.exit_thread();
            return;
        }
        part.poll = poller.stats();
        let at = std::time::Instant::now();
        run_queue.feed(&mut poller, at);
        if poller.turn(at, work) == Next::Poll {
            drop(part);
            answer(&mut asked);
            if !work {
                // Polling with nothing to do: let a thread that shares the core run.
                std::thread::yield_now();
            }
            continue;
        }
        let wait = sleep_time(sh, &part, now, all_fds);
        let sockets = part.fronts_poll_set();
        // Say so before letting go of the part: a thread that then leaves work for this one
        // (a command, mail, frames on its links, an inline request it must receive the reply
        // of, a front end's reader thread's request) rings, and the sleep below returns at once.
        bell.sleeping.store(!disconnected, Ordering::SeqCst);
        if part.fronts_handed_waiting() || sh.mail[g].has_mail() || sh.generation.load(Ordering::Acquire) != part.seen {
            // Requests a reader thread handed over, or mail, before it could see this thread
            // sleep.
            bell.sleeping.store(false, Ordering::Release);
            drop(part);
            answer(&mut asked);
            continue;
        }
        drop(part);
        answer(&mut asked);
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

/// Answers the stats and report requests in `asked` (read from every thread's part, so never
/// while holding one).
fn answer(sh: &Shared, asked: &mut Vec<Cmd>) {
    for cmd in asked.drain(..) {
        match cmd {
            Cmd::Stats(reply) => {
                let _ = reply.send(sh.snapshot());
            }
            Cmd::Report(reply) => {
                let _ = reply.send(sh.report());
            }
            _ => {}
        }
    }
}

/// A command from a client (or the engine's control) to thread `part`; stats and reports are
/// put in `asked`, to be answered once the part is let go.
fn command(
    sh: &Shared,
    part: &mut Part,
    cmd: Cmd,
    now: Instant,
    placed: &tyche_numa::report::ThreadPlacement,
    asked: &mut Vec<Cmd>,
) {
    match cmd {
        Cmd::Batch(ios) => {
            part.stats.handed_over += ios.len() as u64;
            for io in ios {
                part.submit(sh, io, now);
            }
        }
        Cmd::Stats(_) | Cmd::Report(_) => asked.push(cmd),
        Cmd::Close(done) => sh.close(Some(done), now),
        Cmd::Front(front) => {
            front.placed(Some(placed.clone()));
            if part.closing || sh.closing() {
                front.close(true);
            } else {
                part.fronts.insert(front.key(), front);
            }
        }
    }
}

/// How long an engine thread with nothing to do now may sleep: briefly while requests,
/// connections or adopted parts wait (polling links that have no readiness descriptor), long
/// when idle, and never past its timers (the volume's, the board's refresh, the control's).
fn sleep_time(sh: &Shared, part: &Part, now: Instant, all_fds: bool) -> Duration {
    let busy = !part.inflight.is_empty()
        || !part.connectors.is_empty()
        || part.volume.as_ref().is_some_and(|v| v.adopted_parts() > 0);
    let mut wait = match (busy, all_fds) {
        (true, false) => BUSY_SLEEP,
        (true, true) => BUSY_SLEEP_FD,
        (false, false) => IDLE_SLEEP,
        (false, true) => IDLE_SLEEP_FD,
    };
    if let Some(v) = &part.volume {
        if let Some(t) = v.poll_timeout() {
            wait = wait.min(t.since(now));
        }
        if let Some(t) = v.refresh_at().filter(|_| part.reads_board()) {
            wait = wait.min(t.since(now));
        }
    }
    if !sh.closing() {
        let due = sh.control_due.load(Ordering::Acquire);
        if due != u64::MAX {
            wait = wait.min(Instant(due).since(now));
        }
    } else if part.closing {
        // Closing waits for the other threads' requests too: look again soon.
        wait = wait.min(BUSY_SLEEP_FD);
    }
    wait
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
        assert_eq!(parts_of(EngineThreads::PerNode, &nodes), [0, 1, 0, 2, 1]);
        assert_eq!(parts_of(EngineThreads::One, &nodes), [0; 5]);
        assert_eq!(parts_of(EngineThreads::PerNode, &[None, None]), [0, 0]);
        assert_eq!(parts_of(EngineThreads::PerNode, &[Some(3)]), [0]);
    }

    fn request() -> (Mail, oneshot::Receiver<Result<Vec<u8>, Error>>) {
        let (tx, rx) = oneshot::channel();
        let io = IoCmd {
            op: Op::Read,
            fua: false,
            offset: 0,
            length: 512,
            data: Buf::Heap(Vec::new()),
            node: None,
            reply: Completion::Client(tx),
        };
        (Mail::Submit(io), rx)
    }

    #[test]
    fn a_finished_threads_mailbox_gives_mail_back() {
        let m = Mailbox::default();
        assert!(!m.has_mail() && m.take().is_empty());
        let (first, _rx1) = request();
        assert!(m.post(first).is_ok());
        assert!(m.has_mail());
        // Closing hands back what came before, and refuses what comes after (the sender fails
        // a request itself rather than leave it where no thread will look).
        assert_eq!(m.close().len(), 1);
        assert!(!m.has_mail());
        let (second, _rx2) = request();
        assert!(matches!(m.post(second), Err(Mail::Submit(_))));
        assert!(m.take().is_empty());
    }

    #[test]
    fn engine_thread_layout_parses_and_prints() {
        for t in [EngineThreads::PerNode, EngineThreads::One] {
            assert_eq!(<EngineThreads as clap::ValueEnum>::from_str(&t.to_string(), false), Ok(t));
        }
        assert!(<EngineThreads as clap::ValueEnum>::from_str("two", false).is_err());
    }
}
