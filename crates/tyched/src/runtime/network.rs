//! The per-thread loop: each network thread serves its NICs ([`serve`]) with
//! turns ([`Network::turn`]: its queue, receive, completions, deadlines, timers, events,
//! transmit, messages to other threads, reclaim reports), flushes its transports, and sleeps in
//! `poll(2)` when its [`Poller`] says so. Receiving checks each frame once and hands the
//! checked view on: handshake frames are parsed once and go to the control, the others to
//! their session's part, whose write data the slot table places. Transmitting fills the frames
//! the channels write with read data from transmit chunks or slot memory. Shutdown: each thread
//! says when it is quiet, and once all are, each DISCONNECTs its channels and exits.
//!
//! Per NIC this module owns [`NicState`] (counters, control queue, link state, memory
//! placement), kept by the thread serving the NIC.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rustc_hash::FxHashSet;
use tyche_channel::{DropReason, FrameDrop, Instant, PayloadRef, TargetInbound};
use tyche_runtime::poll::{Next, Poller, SchedStat};
use tyche_runtime::wake::WakeFd;
use tyche_transport::{Lease, Sent};
use tyche_wire::{Frame, Kind, MacAddr, Message, DATA_FRAME_OVERHEAD};

use crate::stats::NicStats;

use super::control::lock;
use super::handshake::Arrival;
use super::sessions::{slot_acked, slot_idle};
use super::slots::{Placed, SlotKey, SlotTable, WriteSegment};
use super::{Network, Nic, RxBuffers};
use tyche_transport::FrameTransportExt;

/// Frames received per transport per loop turn.
const RX_BUDGET: usize = 64;
/// Frames sent per transport per loop turn.
const TX_BUDGET: usize = 256;
/// Longest sleep when some transport has no readiness descriptor (in-memory links).
const POLL_CAP_NO_FD: Duration = Duration::from_millis(1);
/// Longest sleep otherwise (the stop flag and stats requests are also signalled on the eventfd).
const POLL_CAP: Duration = Duration::from_millis(100);
/// How long shutdown waits for storage and for the last completions to be acknowledged.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// What the engine keeps of one NIC.
#[derive(Debug)]
pub(super) struct NicState {
    /// Its counters.
    pub(super) stats: NicStats,
    /// Control replies (ACCEPT, REJECT, CHALLENGE, DISCOVER_REPLY) waiting to be sent.
    pub(super) control: VecDeque<Vec<u8>>,
    /// Its transport failed for good (a closed TCP connection).
    pub(super) down: bool,
    /// NUMA node of its memory (slot memory of its channels goes there).
    pub(super) node: Option<u32>,
    /// Its transport's memory (UMEM, rings), for the placement report.
    pub(super) areas: Vec<tyche_transport::MemoryArea>,
    /// Its serving thread, as it saw itself when it started.
    pub(super) thread: Option<tyche_numa::report::ThreadPlacement>,
    /// The network thread that serves it.
    pub(super) served_by: usize,
    /// Its transport's MAC address (read once, from its capabilities).
    pub(super) local_mac: MacAddr,
    /// Scratch of each transmit turn: its transmit chunks the kernel still holds, and those
    /// the turn has used.
    pub(super) tx_busy: FxHashSet<u64>,
    pub(super) tx_used: FxHashSet<u64>,
}

/// What one turn of a network thread left to do.
pub(super) struct Turn {
    /// Something happened: go round again without sleeping.
    pub(super) busy: bool,
    /// How long to sleep at most when not busy.
    timeout: Duration,
    /// The target has stopped: exit.
    exit: bool,
    /// Per NIC of the thread: whether to poll it (false once its transport failed for good).
    live: Vec<bool>,
}

impl Turn {
    fn exit() -> Turn {
        Turn { busy: false, timeout: Duration::ZERO, exit: true, live: Vec::new() }
    }
}

/// The loop of network thread `net.g`, serving the NICs `nics` with what it owns (`net`): a
/// turn, then the transports' flush (the AF_XDP kick) and, when the poller says so
/// ([`Poller`]: after a while without work), the sleep. No lock is taken for a frame of an
/// established channel.
pub(super) fn serve(mut net: Network, mut nics: Vec<(usize, Nic)>) {
    let mut poller = Poller::new(net.poll);
    let run_queue = SchedStat::of_this_thread();
    let wake = Arc::clone(&net.post.wakes()[net.g]);
    loop {
        net.poll_stats = poller.stats();
        let turn = net.turn(&mut nics);
        for (_, nic) in nics.iter_mut() {
            if let Err(e) = nic.transport.flush() {
                tracing::warn!(nic = %nic.name, "flush failed: {e}");
            }
        }
        if turn.exit {
            return;
        }
        let now = std::time::Instant::now();
        run_queue.feed(&mut poller, now);
        match poller.turn(now, turn.busy) {
            // Polling with nothing to do: let a thread that shares the core run.
            Next::Poll if !turn.busy => std::thread::yield_now(),
            Next::Poll => {}
            Next::Sleep => sleep(&nics, &turn.live, turn.timeout, &wake),
        }
    }
}

/// Sleeps in `poll(2)` on the transports' descriptors and this thread's eventfd (messages,
/// storage completions, stats requests, stop), at most `timeout`.
fn sleep(nics: &[(usize, Nic)], live: &[bool], timeout: Duration, wake: &WakeFd) {
    use nix::poll::{PollFd, PollFlags, PollTimeout};
    let mut fds: Vec<PollFd<'_>> = nics
        .iter()
        .zip(live)
        .filter(|(_, live)| **live)
        .filter_map(|((_, n), _)| n.transport.readiness_fd())
        .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
        .collect();
    fds.push(PollFd::new(wake.as_fd(), PollFlags::POLLIN));
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128);
    if ms > 0 {
        let _ = nix::poll::poll(&mut fds, PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX));
    }
    wake.drain();
}

/// Whether a transport error means the link is gone for good.
fn permanent(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected)
}

impl Network {
    /// One turn of this network thread over its NICs.
    pub(super) fn turn(&mut self, nics: &mut [(usize, Nic)]) -> Turn {
        let now = self.now();
        let stop = self.shared.stop.load(Ordering::SeqCst);
        if stop && self.stopping.is_none() {
            tracing::info!(
                thread = self.g,
                inflight = self.storage.inflight,
                "stopping: no new channels, finishing in-flight requests"
            );
            self.stopping = Some(now);
        }
        if self.shared.closing.load(Ordering::SeqCst) {
            return self.close(now, nics);
        }
        let mut busy = self.deliver_mail();
        let mail = busy;
        for (k, nic) in nics.iter_mut() {
            self.give_back(*k, nic);
            busy |= self.receive_on(now, *k, nic);
        }
        busy |= self.completions();
        self.storage_deadlines(now);
        self.timers(now);
        self.collect_events();
        self.submit_overflow();
        for (k, nic) in nics.iter_mut() {
            busy |= self.transmit_on(now, *k, nic);
        }
        self.post_part_messages(now);
        self.reclaim(now);
        for (k, nic) in nics.iter_mut() {
            self.give_back(*k, nic);
        }
        self.publish_if_requested(now);
        if let Some(since) = self.stopping {
            // Each thread says when it is quiet; once all are (or the drain limit passed), every
            // thread DISCONNECTs its channels and exits.
            let quiet = self.storage.drained()
                && !mail
                && !self.any_wants_transmit()
                && now.since(since) > Duration::from_millis(50);
            self.shared.quiet[self.g].store(quiet, Ordering::SeqCst);
            let all = self.shared.quiet.iter().all(|q| q.load(Ordering::SeqCst));
            if all || now.since(since) > DRAIN_LIMIT {
                self.shared.closing.store(true, Ordering::SeqCst);
                for w in self.post.wakes() {
                    w.wake();
                }
                return Turn { busy: true, timeout: Duration::ZERO, exit: false, live: Vec::new() };
            }
        }
        let timeout = self.sleep_limit(nics, now);
        let live = nics.iter().map(|(k, _)| !self.nics[*k].down).collect();
        Turn { busy, timeout, exit: false, live }
    }

    /// The end of this thread, once every thread is quiet: its channels DISCONNECT, it sends
    /// what they have, publishes its last piece of the counters, and the last thread to end
    /// flushes every export and publishes the last snapshot.
    fn close(&mut self, now: Instant, nics: &mut [(usize, Nic)]) -> Turn {
        for s in self.sessions.values_mut() {
            s.session.close(tyche_wire::DisconnectReason::Shutdown);
        }
        for (k, nic) in nics.iter_mut() {
            self.transmit_on(now, *k, nic);
            self.give_back(*k, nic);
        }
        self.publish(now, u64::MAX);
        let exited = self.shared.exited.fetch_add(1, Ordering::SeqCst) + 1;
        if exited == self.shared.quiet.len() {
            self.finish(now);
        }
        Turn::exit()
    }

    /// How long this thread may sleep: until its sessions' next timer, the next storage
    /// deadline, a short while when stopping, and never long on transports it cannot wait on.
    fn sleep_limit(&self, nics: &[(usize, Nic)], now: Instant) -> Duration {
        let mut timeout =
            if nics.iter().all(|(_, n)| n.transport.readiness_fd().is_some()) { POLL_CAP } else { POLL_CAP_NO_FD };
        if let Some(t) = self.sessions.values().filter_map(|s| s.session.poll_timeout()).min() {
            timeout = timeout.min(t.since(now));
        }
        if self.stopping.is_some() {
            timeout = timeout.min(Duration::from_millis(5));
        }
        if let Some(t) = self.storage.next_deadline() {
            timeout = timeout.min(t.since(now));
        }
        timeout
    }

    fn any_wants_transmit(&self) -> bool {
        self.nics.iter().any(|n| !n.control.is_empty())
            || self.sessions.values().any(|s| s.nic_of.keys().any(|&c| s.session.wants_transmit(c)))
    }

    /// The orderly end, once every thread has sent its DISCONNECTs and published its last
    /// piece: flush every export, publish the last snapshot.
    fn finish(&mut self, now: Instant) {
        // The control's list: it has the exports reloads added, which this thread may not.
        let exports = Arc::clone(&lock(&self.control).exports);
        for e in exports.iter() {
            if let Err(err) = e.backend.flush() {
                tracing::error!(export = %e.spec.name, "flush at shutdown failed: {err}");
            }
        }
        let snap = self.shared.merged(now);
        *self.shared.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(snap);
        self.shared.published.notify_all();
        tracing::info!("stopped");
    }

    // ---------------------------------------------------------------------------------------
    // Receive.

    fn receive_on(&mut self, now: Instant, k: usize, nic: &mut Nic) -> bool {
        if self.nics[k].down {
            return false;
        }
        let local = self.nics[k].local_mac;
        match nic.transport.recv_lend(RX_BUDGET, &mut |pieces, lease| self.on_frame(now, k, local, pieces, lease)) {
            Ok(n) => n > 0,
            Err(e) => {
                let n = &mut self.nics[k];
                n.stats.rx_errors += 1;
                if permanent(&e) {
                    // A closed TCP connection, say: stop polling it (its channels die by timeout).
                    tracing::warn!(nic = %nic.name, "link down: {e}");
                    n.down = true;
                } else if n.stats.rx_errors.is_power_of_two() {
                    tracing::warn!(nic = %nic.name, errors = n.stats.rx_errors, "receive failed: {e}");
                }
                false
            }
        }
    }

    /// A DISCOVER or CONNECT received on NIC `k` (whose MAC is `local`): handled by the control,
    /// under its lock; its replies go out on `k`, and a channel it accepted for one of this
    /// thread's NICs is installed here.
    fn on_handshake(&mut self, now: Instant, k: usize, local: MacAddr, frame: &Frame<&[u8]>, msg: &Message<'_>) {
        let control = Arc::clone(&self.control);
        let at = Arrival { thread: self.g, stopping: self.stopping.is_some(), nic: k, local };
        let answer = lock(&control).on_handshake(now, at, frame, msg);
        self.nics[k].stats.drops.add(&answer.drops);
        for r in answer.replies {
            self.queue_control(k, r);
        }
        if let Some(o) = answer.open {
            self.install(*o);
        }
    }

    /// Queues a control reply on NIC `k`, or drops it when `limits.control_queue` are waiting
    /// (the initiator retries its CONNECT or DISCOVER).
    fn queue_control(&mut self, k: usize, frame: Vec<u8>) {
        if self.nics[k].control.len() >= self.limits.control_queue {
            self.counters.limits.control_dropped += 1;
            return;
        }
        self.nics[k].control.push_back(frame);
    }

    /// Handles one received frame, in one piece or several (a multi-buffer frame: a DATA frame
    /// whose headers are all in the first). Its header is checked here, once, and the checked
    /// view goes on. Write data is kept in the frame (all its pieces) when the transport lends
    /// it (`lease`) and the export writes from frames; else it is copied into slot memory.
    /// Returns the lease when the frame is not kept. A panic while handling it (a bug a peer's
    /// frame reached) ends that frame's session alone ([`Network::fail_session`]).
    fn on_frame(
        &mut self,
        now: Instant,
        k: usize,
        local: MacAddr,
        pieces: &[&[u8]],
        lease: Option<Lease>,
    ) -> Option<Lease> {
        let st = &mut self.nics[k].stats;
        st.frames_rx += 1;
        st.bytes_rx += tyche_transport::pieces_len(pieces) as u64;
        let (sid, src) = match pieces {
            [bytes] => {
                let Ok(frame) = Frame::new_checked(*bytes, self.ethertype) else {
                    st.drops.malformed += 1;
                    return lease;
                };
                if matches!(frame.kind(), Kind::Connect | Kind::Discover) {
                    let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        // The one parse of a handshake frame's message; the handshake gets both views.
                        match frame.parse() {
                            Ok(msg) => self.on_handshake(now, k, local, &frame, &msg),
                            Err(_) => self.nics[k].stats.drops.malformed += 1,
                        }
                    }));
                    if handled.is_err() {
                        self.fail_session(frame.session(), "handling a frame");
                    }
                    return lease;
                }
                (frame.session(), frame.src())
            }
            // Only DATA frames are longer than one buffer; more pieces than a lease holds are
            // refused too (the transports drop such frames before they get here).
            [first, ..] if pieces.len() <= tyche_channel::MAX_PIECES => {
                match tyche_channel::data_head(first, self.ethertype) {
                    Ok((frame, _)) => (frame.session(), frame.src()),
                    Err(_) => {
                        st.drops.malformed += 1;
                        return lease;
                    }
                }
            }
            _ => {
                st.drops.malformed += 1;
                return lease;
            }
        };
        let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // The plaintext of an encrypting channel's frame goes here (kept, not reallocated),
            // and a frame in pieces that must be whole (sealed, DIGEST) is gathered there.
            let mut buffers = std::mem::take(&mut self.rx_buffers);
            let kept = self.on_session_frame(now, k, (sid, src), pieces, lease, &mut buffers);
            self.rx_buffers = buffers;
            kept
        }));
        handled.unwrap_or_else(|_| {
            self.fail_session(sid, "handling a frame");
            None
        })
    }

    /// A frame of session `sid` from `src`: this thread's part of the session takes it, and the
    /// payload of a DATA frame it places goes into the slot table.
    fn on_session_frame(
        &mut self,
        now: Instant,
        k: usize,
        (sid, src): (u64, MacAddr),
        pieces: &[&[u8]],
        lease: Option<Lease>,
        buffers: &mut RxBuffers,
    ) -> Option<Lease> {
        let st = &mut self.nics[k].stats;
        let Some(s) = self.sessions.get_mut(&sid) else {
            st.drops.unknown_session += 1;
            tracing::trace!(%src, session = sid, "frame for an unknown session");
            return lease;
        };
        let (channel, damq, offset, payload, generation, tag) =
            match s.session.handle_frame_pieces(now, pieces, &mut buffers.scratch, &mut buffers.gather) {
                TargetInbound::Consumed => {
                    s.established = true;
                    return lease;
                }
                TargetInbound::Dropped(d) => {
                    match d {
                        FrameDrop::Wire(_) => st.drops.malformed += 1,
                        FrameDrop::NotOurs => st.drops.not_ours += 1,
                        FrameDrop::Channel(r) => *st.drops.channel.entry(drop_name(r)).or_default() += 1,
                    }
                    return lease;
                }
                TargetInbound::Write { channel, damq, offset, payload, generation, tag } => {
                    s.established = true;
                    (channel, damq, offset, payload, generation, tag)
                }
            };
        let key = (s.session.id(), channel, s.epoch(channel), damq);
        let lend = self.exports[s.meta.export].lend;
        let node = self.nics[k].node;
        let sessions = &self.sessions;
        let (placed, lease) = self.slots.place_write(
            WriteSegment { key, tag, generation, offset, payload: &payload },
            k,
            lease,
            (lend, node),
            |key| slot_idle(sessions, key),
        );
        let st = &mut self.nics[k].stats;
        match placed {
            Placed::Kept => st.frames_kept += 1,
            Placed::Copied(n) => {
                self.counters.payload_copied += n as u64;
                self.counters.payload_copied_write += n as u64;
            }
            Placed::SlotBusy => st.drops.slot_busy += 1,
            Placed::Short => {}
        }
        lease
    }

    /// Gives NIC `k`'s transport back the frames it lent that are no longer needed, and notes
    /// how many it still has out.
    fn give_back(&mut self, k: usize, nic: &mut Nic) {
        let sessions = &self.sessions;
        let free = self.slots.give_back(k, &mut *nic.transport, |key| slot_acked(sessions, key));
        let st = &mut self.nics[k].stats;
        st.leases_out = nic.transport.leases_out() as u64;
        st.tx_chunks_free = free as u64;
    }

    // ---------------------------------------------------------------------------------------
    // Transmit.

    /// Sends what NIC `k` has to send (the caller flushes the transport, outside the lock):
    /// its control replies, then what its channels have, in session and channel order.
    fn transmit_on(&mut self, now: Instant, k: usize, nic: &mut Nic) -> bool {
        if self.nics[k].down {
            self.nics[k].control.clear();
            return false;
        }
        let mut order: Vec<(u64, u16)> = Vec::new();
        for (&sid, s) in &self.sessions {
            order.extend(s.nic_of.iter().filter(|&(_, &n)| n == k).map(|(&c, _)| (sid, c)));
        }
        let mut cursor = 0;
        // Chunks the kernel still sends cannot be rewritten or sent again yet. (The two sets are
        // kept per NIC between turns, so a turn allocates and rehashes nothing; their keys are
        // the transport's own chunk ids, never a peer's.)
        let mut turn = TxTurn {
            busy: std::mem::take(&mut self.nics[k].tx_busy),
            used: std::mem::take(&mut self.nics[k].tx_used),
            count: TxCount::default(),
        };
        turn.busy.clear();
        turn.used.clear();
        if self.slots.has_regions(k) {
            turn.busy.extend(nic.transport.tx_chunks_in_flight());
        }
        let control = &mut self.nics[k].control;
        let sessions = &mut self.sessions;
        let slots = &self.slots;
        let r = nic.transport.transmit(TX_BUDGET, &mut |buf| {
            if let Some(f) = control.pop_front() {
                buf[..f.len()].copy_from_slice(&f);
                turn.count.frames += 1;
                turn.count.bytes += f.len() as u64;
                return Some(Sent::Here(f.len()));
            }
            while cursor < order.len() {
                let (sid, ch) = order[cursor];
                let s = sessions.get_mut(&sid).expect("listed");
                let epoch = s.epoch(ch);
                if let Some(t) = s.session.poll_transmit(now, ch, buf) {
                    let sent = match t.payload {
                        None => Sent::Here(t.len),
                        Some(p) => {
                            let key = (sid, ch, epoch, p.damq);
                            fill_payload(slots, key, &p, t.len, buf, &mut turn)
                        }
                    };
                    let sent = match sent {
                        Sent::Here(len) if len > 0 => Sent::Here(s.session.seal(ch, buf, len)),
                        other => other,
                    };
                    if sent != Sent::Here(0) {
                        turn.count.frames += 1;
                        turn.count.bytes += t.len as u64;
                    }
                    return Some(sent);
                }
                cursor += 1;
            }
            None
        });
        let TxTurn { busy, used, count: tx } = turn;
        let n = &mut self.nics[k];
        (n.tx_busy, n.tx_used) = (busy, used);
        n.stats.frames_sent_in_place += tx.in_place;
        n.stats.resends_deferred += tx.deferred;
        if let Err(e) = r {
            n.stats.tx_errors += 1;
            if permanent(&e) {
                tracing::warn!(nic = %nic.name, "link down: {e}");
                n.down = true;
            } else if n.stats.tx_errors.is_power_of_two() {
                tracing::warn!(nic = %nic.name, errors = n.stats.tx_errors, "send failed: {e}");
            }
        }
        n.stats.frames_tx += tx.frames;
        n.stats.bytes_tx += tx.bytes;
        self.counters.payload_copied += tx.copied;
        tx.frames > 0
    }
}

// A frame's pieces: what a transport lends at most is what the engine takes.
const _: () = assert!(tyche_channel::MAX_PIECES == tyche_transport::MAX_PIECES);

/// One [`Network::transmit_on`]'s transmit chunks and counts.
struct TxTurn {
    /// Chunks the kernel still sends: not rewritten or sent again yet.
    busy: FxHashSet<u64>,
    /// Chunks sent earlier in this turn.
    used: FxHashSet<u64>,
    /// What the turn sent.
    count: TxCount,
}

/// What one [`Network::transmit_on`] sent.
#[derive(Default)]
struct TxCount {
    frames: u64,
    bytes: u64,
    /// Payload bytes copied from slot memory.
    copied: u64,
    /// Frames sent from the transmit chunk holding their payload.
    in_place: u64,
    /// Resends skipped because the kernel still holds their chunk.
    deferred: u64,
}

/// The payload `p` of a DATA frame of slot `key` that a channel wrote into `buf` (`len` bytes
/// in all): sent from the transmit chunk that holds it when its read data went into one (unless
/// the kernel still has that chunk, `busy`, or it goes out earlier in this batch, `used`), else
/// copied from slot memory behind the headers. Read data always lies in its slot (or region)
/// until the completion is sent: a payload found in neither is not sent, never stale bytes.
fn fill_payload(
    slots: &SlotTable,
    key: SlotKey,
    p: &PayloadRef,
    len: usize,
    buf: &mut [u8],
    turn: &mut TxTurn,
) -> Sent {
    let TxTurn { busy, used, count: tx } = turn;
    if let Some(region) = slots.region(&key, p.tag) {
        let at = (p.offset % region.seg == 0).then(|| region.chunks.get((p.offset / region.seg) as usize));
        let Some(Some(c)) = at else { return Sent::Here(0) };
        if !busy.contains(&c.id()) && used.insert(c.id()) {
            // The payload is in the chunk already: only the headers go there.
            tx.in_place += 1;
            return Sent::Chunk { id: c.id(), header: DATA_FRAME_OVERHEAD, len };
        }
        // The kernel still holds this chunk from an earlier send of the same segment (or it
        // goes out earlier in this batch): that send carries these bytes, so this resend is
        // skipped, not copied. If it is lost, the retransmission timer sends the chunk again
        // once it is back.
        tx.deferred += 1;
        return Sent::Here(0);
    }
    let dst = &mut buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + p.len as usize];
    let o = p.offset as usize;
    match slots.data(&key).and_then(|mem| mem.get(o..o + p.len as usize)) {
        Some(src) => {
            dst.copy_from_slice(src);
            tx.copied += p.len as u64;
            Sent::Here(len)
        }
        None => Sent::Here(0),
    }
}

/// A drop reason as the counters name it.
pub(super) fn drop_name(r: DropReason) -> String {
    r.as_str().to_owned()
}
