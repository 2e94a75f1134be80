//! Storage jobs on the network side, from the moment one is prepared until its completion goes
//! back to its channel.
//!
//! A [`Job`] (module `crate::job`) is what a storage worker or the io_uring thread gets
//! ([`crate::job::execute`] runs it; RAM exports run it inline on the network thread).
//! [`Storage`] owns the network side of storage:
//! the per-node job queues, the io_uring queues, the done queues of the network threads, the
//! jobs running and their deadlines (`storage_deadline_ms`), and the requests deferred until
//! slot memory is free or a fenced session's requests have ended. The `Network` methods here
//! turn session events into jobs ([`Network::prepare_job`]: slot memory, kept frames, transmit
//! chunks from the slot table) and finish them.

use std::collections::{BTreeSet, VecDeque};

use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use tyche_channel::{Instant, TargetEvent};
use tyche_wire::{flags, Op, Request, Status};

use crate::backend::{Backend, Memory};
use crate::job::{execute_contained, Done, Job, LentSegment, Region};
use crate::stats::StorageQueueStats;
use crate::workers::{JobQueues, ThreadStat};

use super::sessions::slot_idle;
use super::slots::SlotKey;
use super::{Network, PEER_LOGS};

/// A request deferred until slot memory is free (or the sessions it fenced have no request in
/// storage): (session, channel, request, slot generation).
pub(super) type Deferred = (u64, u16, Request, u32);

/// A job handed out and not finished: (session, channel, request, export, start).
type Running = (u64, u16, Request, usize, Instant);

/// The network side of storage (see the module documentation).
pub(super) struct Storage {
    /// The storage queue of each node, and the jobs waiting for room in them.
    queues: JobQueues,
    /// The io_uring engine of each storage queue, when file and block exports use it (empty:
    /// they use the workers).
    uring: Vec<crate::uring::UringQueue>,
    /// This network thread's finished jobs (those of its NICs' channels).
    done_rx: mpsc::Receiver<Done>,
    /// The storage threads (workers, io_uring threads) and what they did.
    pub(super) threads: Vec<Arc<ThreadStat>>,
    /// Each storage queue's node and NICs (jobs filled in by the snapshot).
    pub(super) queue_stats: Vec<StorageQueueStats>,
    /// Jobs handed out and not finished.
    pub(super) inflight: u64,
    /// Requests waiting for slot memory, or for the sessions they fenced.
    pub(super) waiting: VecDeque<Deferred>,
    /// Storage requests handed out and not finished, by job id.
    running: FxHashMap<u64, Running>,
    /// Running jobs by start time (`storage_deadline_ms`): (start, job id).
    deadlines: BTreeSet<(Instant, u64)>,
    /// `storage_deadline_ms` (zero: none).
    pub(super) deadline: Duration,
    /// Jobs answered with an I/O error at their deadline; their late end is not answered again.
    timed_out: FxHashSet<u64>,
    /// Requests answered at their deadline.
    pub(super) timeouts: u64,
    next_job: u64,
}

impl Storage {
    pub(super) fn new(
        queues: JobQueues,
        uring: Vec<crate::uring::UringQueue>,
        done_rx: mpsc::Receiver<Done>,
        threads: Vec<Arc<ThreadStat>>,
        queue_stats: Vec<StorageQueueStats>,
        deadline: Duration,
    ) -> Storage {
        Storage {
            queues,
            uring,
            done_rx,
            threads,
            queue_stats,
            inflight: 0,
            waiting: VecDeque::new(),
            running: FxHashMap::default(),
            deadlines: BTreeSet::new(),
            deadline,
            timed_out: FxHashSet::default(),
            timeouts: 0,
            next_job: 0,
        }
    }

    /// Names a new job of `request` and starts its deadline.
    fn start(&mut self, sid: u64, channel: u16, request: Request, export: usize, now: Instant) -> u64 {
        self.next_job += 1;
        let id = self.next_job;
        self.running.insert(id, (sid, channel, request, export, now));
        if !self.deadline.is_zero() {
            self.deadlines.insert((now, id));
        }
        id
    }

    /// Job `id` ended; whether it was answered at its deadline already.
    fn end(&mut self, id: u64) -> bool {
        self.inflight -= 1;
        if let Some((.., started)) = self.running.remove(&id) {
            self.deadlines.remove(&(started, id));
        }
        self.timed_out.remove(&id)
    }

    /// The next running job past its deadline at `now`, marked answered: (session, channel,
    /// request, export).
    fn overdue(&mut self, now: Instant) -> Option<(u64, u16, Request, usize)> {
        while let Some(&(started, id)) = self.deadlines.first() {
            if now.since(started) < self.deadline {
                return None;
            }
            self.deadlines.pop_first();
            let Some(&(sid, channel, request, export, _)) = self.running.get(&id) else { continue };
            self.timed_out.insert(id);
            self.timeouts += 1;
            return Some((sid, channel, request, export));
        }
        None
    }

    /// When the oldest running job reaches its deadline.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|&(started, _)| started + self.deadline)
    }

    /// Whether nothing is in storage or waiting for room in its queues.
    pub(super) fn drained(&self) -> bool {
        self.inflight == 0 && self.queues.is_empty()
    }

    /// Hands a file or block export's job to storage: the io_uring ring of its channel's node
    /// when the export uses io_uring (`uring`) and the ring does the operation, else the node's
    /// queue. The job comes back when its ring's thread is gone (as from the ring's `submit`:
    /// moved back, not boxed, on a path that only a dead thread takes).
    #[allow(clippy::result_large_err)]
    fn hand_out(&mut self, j: Job, uring: bool, backend: &dyn Backend) -> Result<(), Job> {
        match self
            .uring
            .get(self.queues.queue_of(j.nic))
            .filter(|q| uring && crate::uring::handles(q.fallocate, backend, j.request.op))
        {
            Some(q) => q.submit(j),
            None => {
                self.queues.push(j);
                Ok(())
            }
        }
    }

    /// Marks every queued job of session `sid` not to run.
    pub(super) fn abort_queued(&mut self, sid: u64) {
        for j in self.queues.waiting_mut().filter(|j| j.session == sid) {
            j.abort = true;
        }
    }

    /// Takes the deferred requests of session `sid` out.
    pub(super) fn take_waiting(&mut self, sid: u64) -> Vec<Deferred> {
        let of: Vec<Deferred> = self.waiting.iter().filter(|d| d.0 == sid).copied().collect();
        self.waiting.retain(|d| d.0 != sid);
        of
    }
}

/// Where a job's data comes from or goes: write data kept in frames, read data in transmit
/// chunks, slot memory.
#[derive(Default)]
struct Places {
    lent: Vec<LentSegment>,
    region: Option<Region>,
    buf: Option<Memory>,
}

impl Network {
    /// Takes the sessions' events: dead channels, and requests to execute (with those
    /// deferred), which become jobs and go to storage (RAM exports execute here).
    pub(super) fn collect_events(&mut self) {
        let mut execute = std::mem::take(&mut self.storage.waiting);
        let mut dead = Vec::new();
        for (&sid, s) in self.sessions.iter_mut() {
            while let Some(ev) = s.session.poll_event() {
                match ev {
                    TargetEvent::Execute { channel, request, generation } => {
                        execute.push_back((sid, channel, request, generation))
                    }
                    TargetEvent::ChannelDead { channel, reason } => dead.push((sid, channel, reason)),
                }
            }
        }
        for (sid, channel, reason) in dead {
            self.channel_dead(sid, channel, reason);
        }
        let mut jobs = Vec::new();
        while let Some(d) = execute.pop_front() {
            if let Some(j) = self.prepare_job(d) {
                jobs.push(j);
            }
        }
        // The exports, for this batch: one count (of this thread's own table) written per turn
        // with jobs, not one per job.
        let exports = Arc::clone(&self.exports);
        for mut j in jobs {
            self.storage.inflight += 1;
            // A RAM operation is a memcpy of about a microsecond: handing it to a worker thread
            // and back costs more than doing it here (two context switches per request).
            let e = &exports[j.export];
            if e.backend.kind() == "ram" {
                let status = execute_contained(&*e.backend, &mut j);
                self.finish_job(Done { job: j, status });
            } else if let Err(j) = self.storage.hand_out(j, e.uring, &*e.backend) {
                tracing::error!("the io_uring thread is gone; request failed");
                self.finish_job(Done { job: j, status: Status::IoError });
            }
        }
        self.submit_overflow();
    }

    /// Whether session `sid` must wait before anything of it runs: not before every request
    /// of the sessions it fenced has ended.
    fn waits_on_fenced(&mut self, sid: u64) -> bool {
        // A fenced session's jobs may run on any thread: each publishes its count.
        self.sessions.get_mut(&sid).is_some_and(|s| s.waits_for.holds())
    }

    /// The storage job of a request the session hands out, with its data's places: write data
    /// kept in frames (of this slot generation) and copied into slot memory, read data going
    /// into lent transmit chunks or slot memory. `None` when the session is gone, when the
    /// request was completed here (its copied write data is incomplete), or when it waits (for
    /// slot memory, or for the sessions it fenced; kept in `storage.waiting`).
    pub(super) fn prepare_job(&mut self, deferred: Deferred) -> Option<Job> {
        let (sid, channel, request, _) = deferred;
        let stopping = self.stopping.is_some();
        self.sessions.get(&sid)?;
        if self.waits_on_fenced(sid) {
            self.storage.waiting.push_back(deferred);
            return None;
        }
        let s = self.sessions.get(&sid)?;
        let fence = Some(Arc::clone(s.meta.fence_of(self.g)));
        let epoch = s.epoch(channel);
        let ch = s.session.channel(channel);
        let dead = ch.is_none_or(|c| c.dead().is_some());
        let seg = ch.map_or(0, |c| c.params().segment as u32);
        // Frames of a keyed export are sealed, and those of a DIGEST channel carry the payload's
        // CRC32C, as each goes out: their read data is sent from slot memory, never from
        // transmit chunks that hold it once (the frame's checks need the payload in hand).
        let protected = ch.is_some_and(|c| c.sealed() || c.params().features & flags::FEATURE_DIGEST != 0);
        let (export, nic) = (s.meta.export, s.nic_of.get(&channel).copied());
        let key = (sid, channel, epoch, request.damq);
        let places = if request.op.uses_damq() && !dead && !stopping {
            self.data_places(deferred, key, export, nic, seg, protected)?
        } else {
            Places::default()
        };
        *self.sessions.get_mut(&sid)?.executing.entry(channel).or_default() += 1;
        self.executing_changed(sid);
        let now = self.now();
        let id = self.storage.start(sid, channel, request, export, now);
        Some(Job {
            session: sid,
            channel,
            epoch,
            export,
            request,
            buf: places.buf,
            lent: places.lent,
            region: places.region,
            abort: stopping || dead,
            id,
            fence,
            nic,
        })
    }

    /// The places of the data of a request using `damq` slot `key` (its channel on NIC `nic`,
    /// segments of `seg` bytes, `protected` frames never sent from transmit chunks). `None`
    /// when it does not run now: a read waits for slot memory, or a write whose copied data is
    /// incomplete was completed with an I/O error.
    fn data_places(
        &mut self,
        deferred: Deferred,
        key: SlotKey,
        export: usize,
        nic: Option<usize>,
        seg: u32,
        protected: bool,
    ) -> Option<Places> {
        let (sid, channel, request, generation) = deferred;
        // The slot is reused: read data of its previous request is not needed.
        let (lent, short) = self.slots.reuse(key, &request, generation);
        let node = nic.map_or(self.node, |k| self.nics[k].node);
        let mut places = Places { lent, ..Places::default() };
        match request.op {
            // A BLOCK_STATUS list is made in slot memory (never in transmit chunks).
            Op::Read | Op::BlockStatus => {
                if let (Some(k), Op::Read) = (nic, request.op) {
                    let need = (request.length as usize).div_ceil(seg.max(1) as usize);
                    if self.exports[export].lend && !protected && seg > 0 && need > 0 {
                        places.region = self.slots.take_region(key, k, need, seg, request.tag);
                    }
                }
                if places.region.is_none() {
                    match self.slots.take_for_job(key, node, |key| slot_idle(&self.sessions, key)) {
                        Some(mem) => places.buf = Some(mem),
                        None => {
                            // Wait for memory: nothing of the read has happened yet.
                            self.storage.waiting.push_back(deferred);
                            return None;
                        }
                    }
                }
            }
            _ => {
                let kept: u64 = places.lent.iter().map(|l| l.len as u64).sum();
                if kept < request.length as u64 {
                    places.buf = self.slots.take_memory(&key);
                }
                if short || (kept < request.length as u64 && places.buf.is_none()) {
                    // Copied data of this write could not be kept: fail it, never write holes.
                    self.slots.cancel(key, places.lent, places.buf);
                    self.counters.exports[export].errors += 1;
                    self.sessions.get_mut(&sid)?.session.complete(channel, &request, Status::IoError);
                    return None;
                }
            }
        }
        Some(places)
    }

    /// Moves jobs into their node's queue while it has room (the rest wait, in order).
    pub(super) fn submit_overflow(&mut self) {
        for j in self.storage.queues.submit() {
            // No worker is left (they only exit when the target stops): fail the request.
            tracing::error!("storage workers are gone; request failed");
            self.finish_job(Done { job: j, status: Status::IoError });
        }
    }

    /// Finishes the jobs storage handed back to this network thread (its NICs' channels').
    pub(super) fn completions(&mut self) -> bool {
        let mut any = false;
        while let Ok(d) = self.storage.done_rx.try_recv() {
            any = true;
            self.finish_job(d);
        }
        any
    }

    /// Accounts a finished storage operation and completes its request on its channel.
    pub(super) fn finish_job(&mut self, done: Done) {
        let (mut d, status) = (done.job, done.status);
        let lent = std::mem::take(&mut d.lent);
        if self.storage.end(d.id) {
            // Answered at its deadline already: what it held goes back, nothing is sent.
            self.slots.job_dropped(lent, d.region.take(), d.buf.take());
            if let Some(n) = self.sessions.get_mut(&d.session).and_then(|s| s.executing.get_mut(&d.channel)) {
                *n -= 1;
            }
            self.executing_changed(d.session);
            if PEER_LOGS.allow() {
                tracing::warn!(op = ?d.request.op, offset = d.request.offset, ?status, "a storage request ended after its deadline");
            }
            return;
        }
        let r = d.request;
        let key = (d.session, d.channel, d.epoch, r.damq);
        // Whether the request's channel (this instance of it) still lives to send its data.
        let live = self.sessions.get(&d.session).is_some_and(|s| {
            s.epoch(d.channel) == d.epoch && s.session.channel(d.channel).is_some_and(|c| c.dead().is_none())
        });
        self.slots.job_ended(key, lent, d.region.take(), d.buf.take(), live, status == Status::Ok);
        let es = &mut self.counters.exports[d.export];
        es.requests.bump(r.op);
        es.fua_writes += u64::from(r.op == Op::Write && r.fua);
        if status == Status::Ok {
            match r.op {
                Op::Read => es.bytes_read += r.length as u64,
                Op::Write => es.bytes_written += r.length as u64,
                _ => {}
            }
        } else {
            es.errors += 1;
        }
        let Some(s) = self.sessions.get_mut(&d.session) else { return };
        if let Some(n) = s.executing.get_mut(&d.channel) {
            *n -= 1;
        }
        s.meta.executing.set(self.g, s.executing.values().sum());
        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.session.complete(d.channel, &r, status)));
        if done.is_err() {
            self.fail_session(d.session, "completing a request");
        }
    }

    /// Answers with an I/O error every storage request running longer than
    /// `storage_deadline_ms`: a hung backend never wedges a channel. The request's memory stays
    /// with the storage job until it really ends (the kernel may still use it), and its session
    /// is not reclaimed before that.
    pub(super) fn storage_deadlines(&mut self, now: Instant) {
        while let Some((sid, channel, request, export)) = self.storage.overdue(now) {
            self.counters.exports[export].errors += 1;
            if PEER_LOGS.allow() {
                tracing::error!(op = ?request.op, offset = request.offset, length = request.length,
                    deadline = ?self.storage.deadline, "storage request past its deadline: answered with an I/O error");
            }
            if let Some(s) = self.sessions.get_mut(&sid) {
                let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    s.session.complete(channel, &request, Status::IoError)
                }));
                if done.is_err() {
                    self.fail_session(sid, "answering a request past its deadline");
                }
            }
        }
    }
}
