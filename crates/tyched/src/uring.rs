//! The io_uring storage engine for file and block-device exports.
//!
//! One thread owns one ring and keeps up to [`DEPTH`] requests in flight: the network thread
//! hands it `Job`s (`crate::job`) through a channel and an eventfd (which the ring itself polls, so new work
//! wakes a thread that is waiting for completions), it submits READ / WRITE straight from and
//! into the request's slot memory (the O_DIRECT descriptor when buffer, length and offset are
//! aligned), FUA as a WRITE with `RWF_DSYNC`, FLUSH as `IORING_OP_FSYNC` with `DATASYNC`, and on
//! regular files DISCARD / WRITE_ZEROES as `IORING_OP_FALLOCATE` (punch hole / zero range).
//! Block-device DISCARD / WRITE_ZEROES (ioctls, which io_uring has no op for on the kernels we
//! target), and a FALLOCATE the file system refuses, go to the thread pool's existing path. Short
//! transfers are resubmitted for the rest. Completions go back as `Done`, as from the pool, to
//! the done queue of the network thread that serves the job's NIC (`DoneRoute`).
//!
//! The target starts one engine (one ring, one thread) per storage queue: per NUMA node with
//! channels when the placement plan is used (`crate::workers`), pinned to the first completion
//! worker CPU of that node, so the submissions and completions of a channel's storage requests
//! happen on its NIC's node.
//!
//! [`open`] says whether the kernel allows io_uring here (setup, and a probe for every op this
//! engine uses); where it does not, the target uses the thread pool and logs why.

use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring, Probe};
use tyche_wire::{Op, Status};

use crate::backend::{Backend, BackendTable, FileBackend};
use crate::job::{Done, Job};
use crate::workers::{DoneRoute, ThreadStat};
use tyche_runtime::wake::WakeFd;

/// Requests in flight at most (one submission queue entry each; one more entry is the poll on
/// the job eventfd).
pub const DEPTH: u32 = 128;
const WAKE: u64 = u64::MAX;

/// A ring that passed the probe.
pub struct Ring {
    ring: IoUring,
    fallocate: bool,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("fallocate", &self.fallocate).finish_non_exhaustive()
    }
}

/// Why no ring could be used ([`open`]): the reason tyched falls back to its thread pool.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// `io_uring_setup` failed (no kernel support, or refused by policy: seccomp, sysctl).
    #[error("io_uring_setup: {0}")]
    Setup(#[source] io::Error),
    /// Registering the probe of supported ops failed.
    #[error("io_uring probe: {0}")]
    Probe(#[source] io::Error),
    /// The kernel's io_uring lacks an op the engine needs.
    #[error("the kernel's io_uring has no IORING_OP_{0}")]
    Unsupported(&'static str),
    /// `io_uring = false` in the configuration.
    #[error("disabled (io_uring = false)")]
    Disabled,
}

/// Sets up a ring and checks the ops this engine needs; the error is the reason to fall back.
pub fn open() -> Result<Ring, RingError> {
    open_with(|| IoUring::new(DEPTH + 1))
}

/// As [`open`], with the ring's setup given (tests inject failures).
pub fn open_with(setup: impl FnOnce() -> io::Result<IoUring>) -> Result<Ring, RingError> {
    let ring = setup().map_err(RingError::Setup)?;
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(RingError::Probe)?;
    for (code, name) in [
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::Writev::CODE, "WRITEV"),
        (opcode::Readv::CODE, "READV"),
        (opcode::Fsync::CODE, "FSYNC"),
        (opcode::PollAdd::CODE, "POLL_ADD"),
    ] {
        if !probe.is_supported(code) {
            return Err(RingError::Unsupported(name));
        }
    }
    Ok(Ring { fallocate: probe.is_supported(opcode::Fallocate::CODE), ring })
}

/// Whether `op` on `backend` goes to the ring (else to the thread pool).
pub fn handles(ring_has_fallocate: bool, backend: &dyn Backend, op: Op) -> bool {
    match (backend.as_file(), op) {
        (None, _) => false,
        (Some(_), Op::Read | Op::Write | Op::Flush) => true,
        (Some(f), Op::Discard | Op::WriteZeroes) => ring_has_fallocate && !f.is_block(),
        // lseek(SEEK_DATA/SEEK_HOLE) has no io_uring op: the pool.
        (Some(_), Op::BlockStatus) => false,
    }
}

/// The network thread's end of the engine: dropping it lets the thread finish what is in flight
/// and exit.
#[derive(Debug)]
pub(crate) struct UringQueue {
    tx: Option<mpsc::Sender<Job>>,
    wake: Arc<WakeFd>,
    /// Whether the ring does FALLOCATE.
    pub(crate) fallocate: bool,
}

impl UringQueue {
    /// Another network thread's end of the same ring (the ring's thread exits once every end
    /// is dropped).
    pub(crate) fn share(&self) -> UringQueue {
        UringQueue { tx: self.tx.clone(), wake: Arc::clone(&self.wake), fallocate: self.fallocate }
    }

    /// Queues a job (never blocks; the engine bounds what it submits, not what it holds).
    /// Gives the job back if the engine's thread is gone (it panicked).
    #[allow(clippy::result_large_err)] // the job goes back whole, rarely: no box per request
    pub(crate) fn submit(&self, job: Job) -> Result<(), Job> {
        let Some(tx) = &self.tx else { return Err(job) };
        tx.send(job).map_err(|mpsc::SendError(job)| job)?;
        self.wake.wake();
        Ok(())
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        self.tx.take();
        self.wake.wake();
    }
}

/// Starts the engine's thread (named, pinned and counted as `stat` says). `done` takes every
/// finished job to its network thread and wakes that thread once per batch; `pool` takes the
/// jobs the ring cannot do.
pub(crate) fn start(
    ring: Ring,
    backends: Arc<BackendTable>,
    done: DoneRoute,
    pool: mpsc::SyncSender<Job>,
    stat: Arc<ThreadStat>,
) -> io::Result<(UringQueue, JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel::<Job>();
    let wake = Arc::new(WakeFd::new()?);
    let fallocate = ring.fallocate;
    let engine = Engine {
        ring: ring.ring,
        rx,
        wake: Arc::clone(&wake),
        backends,
        done,
        woken: Vec::new(),
        stat: Arc::clone(&stat),
        pool,
        fallocate,
        slots: (0..DEPTH).map(|_| None).collect(),
        free: (0..DEPTH as usize).rev().collect(),
        pending: VecDeque::new(),
    };
    let thread = std::thread::Builder::new().name(stat.name.clone()).spawn(move || {
        // Its memory policy stays the default: the ring's memory is the kernel's.
        stat.place(None);
        engine.run();
    })?;
    Ok((UringQueue { tx: Some(tx), wake, fallocate }, thread))
}

/// A job in flight and how much of its transfer is done.
struct InFlight {
    job: Job,
    done: usize,
    /// The iovecs of its WRITEV in flight (write data kept in frames).
    iov: IoVecs,
}

/// iovecs the ring reads while a WRITEV is in flight.
struct IoVecs(Vec<libc::iovec>);

// SAFETY: the iovecs point into memory their job owns or holds leases on (slot memory, kept
// frames), which moves with the job; the engine thread is the only one that builds or reads them.
unsafe impl Send for IoVecs {}

struct Engine {
    ring: IoUring,
    rx: mpsc::Receiver<Job>,
    wake: Arc<WakeFd>,
    backends: Arc<BackendTable>,
    done: DoneRoute,
    /// Network threads with completions queued since they were last woken.
    woken: Vec<usize>,
    stat: Arc<ThreadStat>,
    pool: mpsc::SyncSender<Job>,
    fallocate: bool,
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    pending: VecDeque<Job>,
}

/// What to do with a completion.
enum Next {
    /// Submit the rest of a short transfer (or retry after EAGAIN/EINTR).
    Again,
    /// Finished with this status.
    Finish(Status),
    /// The storage refused the op: hand the job to the thread pool's path.
    ToPool,
}

fn errno_status(errno: i32) -> Status {
    if errno == libc::ENOSPC {
        Status::NoSpace
    } else {
        Status::IoError
    }
}

impl Engine {
    fn run(mut self) {
        let mut closed = false;
        let mut poll_armed = false;
        loop {
            while !closed {
                match self.rx.try_recv() {
                    Ok(job) => self.pending.push_back(job),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => closed = true,
                }
            }
            let mut finished = false;
            while !self.free.is_empty() {
                let Some(job) = self.pending.pop_front() else { break };
                finished |= self.start(job);
            }
            if finished {
                self.notify();
            }
            let inflight = DEPTH as usize - self.free.len();
            if closed && inflight == 0 && self.pending.is_empty() {
                return;
            }
            if !closed && !poll_armed {
                let e =
                    opcode::PollAdd::new(types::Fd(self.wake.as_raw_fd()), libc::POLLIN as u32).build().user_data(WAKE);
                self.push(&e);
                poll_armed = true;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)) => {}
                Err(e) => {
                    tracing::error!("io_uring_enter: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
            let cqes: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            let mut finished = false;
            for (data, res) in cqes {
                if data == WAKE {
                    self.wake.drain();
                    poll_armed = false;
                    continue;
                }
                finished |= self.complete(data as usize, res);
            }
            if finished {
                self.notify();
            }
        }
    }

    fn push(&mut self, e: &io_uring::squeue::Entry) {
        // SAFETY: every buffer an entry names lives in a job held in `self.slots` until its
        // completion is reaped (slot memory is heap or mmap memory that does not move when the
        // job does), and every descriptor belongs to a backend in `self.backends`, a table
        // whose slots, once set, keep their backend for as long as the ring exists. Entries never outnumber the queue: DEPTH jobs plus one poll, DEPTH + 1 slots.
        unsafe { self.ring.submission().push(e) }.expect("the submission queue has room for every job");
    }

    /// Takes a slot and submits the job's first entry; true if it finished at once.
    fn start(&mut self, job: Job) -> bool {
        if job.aborted() {
            self.finish(job, Status::Aborted);
            return true;
        }
        if !job.places_ok() {
            self.finish(job, Status::Invalid);
            return true;
        }
        let Some(backend) = self.backends.get(job.export) else {
            // A bug: exports are in the table before any session can use them.
            tracing::error!(export = job.export, "a job for an export with no backend; failed");
            self.finish(job, Status::IoError);
            return true;
        };
        if !handles(self.fallocate, backend, job.request.op) {
            return self.hand_to_pool(job);
        }
        let slot = self.free.pop().expect("a free slot");
        self.slots[slot] = Some(InFlight { job, done: 0, iov: IoVecs(Vec::new()) });
        self.submit(slot);
        false
    }

    /// Submits what is left of the job in `slot`.
    fn submit(&mut self, slot: usize) {
        let f = self.slots[slot].as_mut().expect("slot in use");
        let backend = self.backends.get_arc(f.job.export).expect("checked when the job started; a set slot stays");
        let file: &FileBackend = backend.as_file().expect("only file and block exports use the ring");
        let r = f.job.request;
        let off = r.offset + f.done as u64;
        let left = r.length as usize - f.done;
        let e = match r.op {
            Op::Read if f.job.region.is_some() => {
                // Straight into the transmit chunks the data is sent from, resuming after `done`
                // bytes.
                // The kernel writes the chunks after the writers are gone: the job holds the
                // region until it completes, and only a region in the slot table is sent from.
                let mut skip = f.done;
                let iov = &mut f.iov.0;
                iov.clear();
                let built = f.job.with_read_places(|places| {
                    for p in places.iter_mut() {
                        if skip >= p.len() {
                            skip -= p.len();
                            continue;
                        }
                        let p = &mut p[skip..];
                        skip = 0;
                        iov.push(libc::iovec { iov_base: p.as_mut_ptr().cast(), iov_len: p.len() });
                        if iov.len() == crate::backend::IOV_MAX {
                            break;
                        }
                    }
                });
                match built {
                    Ok(()) => {
                        let fd = file.fd_for_iov(&f.iov.0, off);
                        opcode::Readv::new(types::Fd(fd), f.iov.0.as_ptr(), f.iov.0.len() as u32).offset(off).build()
                    }
                    Err(busy) => {
                        // Never (regions are handed out idle): a no-op, whose completion of no
                        // bytes fails the read.
                        tracing::error!(%busy, "a read region's chunk is being sent: the read is not run");
                        opcode::Nop::new().build()
                    }
                }
            }
            Op::Read => {
                let buf = f.job.buf.as_mut().expect("read slot").as_mut_slice();
                let p = buf[f.done..].as_mut_ptr();
                opcode::Read::new(types::Fd(file.fd_for(p, left, off)), p, left as u32).offset(off).build()
            }
            Op::Write if !f.job.lent.is_empty() => {
                // Straight from the frames the data arrived in (and slot memory for any part that
                // was copied), resuming after `done` bytes.
                let mut skip = f.done;
                f.iov.0.clear();
                for p in f.job.write_pieces().unwrap_or_default() {
                    if skip >= p.len() {
                        skip -= p.len();
                        continue;
                    }
                    let p = &p[skip..];
                    skip = 0;
                    f.iov.0.push(libc::iovec { iov_base: p.as_ptr() as *mut libc::c_void, iov_len: p.len() });
                    if f.iov.0.len() == crate::backend::IOV_MAX {
                        break;
                    }
                }
                let flags = if r.fua { libc::RWF_DSYNC } else { 0 };
                opcode::Writev::new(types::Fd(file.fd_for_iov(&f.iov.0, off)), f.iov.0.as_ptr(), f.iov.0.len() as u32)
                    .offset(off)
                    .rw_flags(flags)
                    .build()
            }
            Op::Write => {
                let buf = f.job.buf.as_ref().expect("write slot").as_slice();
                let p = buf[f.done..].as_ptr();
                let flags = if r.fua { libc::RWF_DSYNC } else { 0 };
                opcode::Write::new(types::Fd(file.fd_for(p, left, off)), p, left as u32)
                    .offset(off)
                    .rw_flags(flags)
                    .build()
            }
            Op::Flush => opcode::Fsync::new(types::Fd(file.fd())).flags(types::FsyncFlags::DATASYNC).build(),
            // Never sent here (`handles`); should it be, a no-op whose completion hands the job
            // to the pool.
            Op::BlockStatus => opcode::Nop::new().build(),
            Op::Discard | Op::WriteZeroes => {
                let mode = if r.op == Op::Discard {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                };
                opcode::Fallocate::new(types::Fd(file.fd()), r.length as u64).offset(r.offset).mode(mode).build()
            }
        };
        self.push(&e.user_data(slot as u64));
    }

    /// Handles the completion of `slot`'s entry; true if the job finished.
    fn complete(&mut self, slot: usize, res: i32) -> bool {
        let f = self.slots[slot].as_mut().expect("completion of a slot in use");
        let r = f.job.request;
        let next = if res < 0 {
            match -res {
                libc::EAGAIN | libc::EINTR => Next::Again,
                e if matches!(r.op, Op::Discard | Op::WriteZeroes)
                    && crate::backend::unsupported(&io::Error::from_raw_os_error(e)) =>
                {
                    Next::ToPool
                }
                e => {
                    tracing::warn!(op = ?r.op, offset = r.offset, length = r.length, "storage error (io_uring): {}",
                        io::Error::from_raw_os_error(e));
                    Next::Finish(errno_status(e))
                }
            }
        } else {
            match r.op {
                Op::Read | Op::Write => {
                    f.done += res as usize;
                    if f.done >= r.length as usize {
                        Next::Finish(Status::Ok)
                    } else if res == 0 {
                        tracing::warn!(op = ?r.op, offset = r.offset + f.done as u64, "storage error (io_uring): no progress");
                        Next::Finish(Status::IoError)
                    } else {
                        Next::Again
                    }
                }
                Op::BlockStatus => Next::ToPool,
                _ => Next::Finish(Status::Ok),
            }
        };
        match next {
            Next::Again => {
                self.submit(slot);
                false
            }
            Next::Finish(status) => {
                let f = self.slots[slot].take().expect("slot in use");
                self.free.push(slot);
                self.finish(f.job, status);
                true
            }
            Next::ToPool => {
                let f = self.slots[slot].take().expect("slot in use");
                self.free.push(slot);
                self.hand_to_pool(f.job)
            }
        }
    }

    /// Hands a job to the thread pool (which answers it itself); true if it finished here.
    fn hand_to_pool(&mut self, job: Job) -> bool {
        match self.pool.send(job) {
            Ok(()) => false,
            Err(mpsc::SendError(job)) => {
                self.finish(job, Status::IoError);
                true
            }
        }
    }

    fn finish(&mut self, job: Job, status: Status) {
        self.stat.executed();
        if let Some(g) = self.done.send(Done { job, status }) {
            if !self.woken.contains(&g) {
                self.woken.push(g);
            }
        }
    }

    /// Wakes the network threads that got completions.
    fn notify(&mut self) {
        for g in self.woken.drain(..) {
            self.done.wake(g);
        }
    }
}

impl Drop for Engine {
    /// A panic on the engine's thread unwinds through here. The kernel may still read or write
    /// the buffers of the jobs in flight, so they are not freed before it has finished with
    /// them: wait for every entry in flight, then fail those jobs (and the queued ones) with an
    /// I/O error. If the kernel does not finish within [`DRAIN_ON_PANIC`], abort the process
    /// rather than free memory under I/O.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        tracing::error!("the io_uring thread panicked: waiting for its I/O in flight, then failing those requests");
        let deadline = std::time::Instant::now() + DRAIN_ON_PANIC;
        while self.slots.iter().any(Option::is_some) {
            if std::time::Instant::now() > deadline {
                tracing::error!("io_uring I/O still in flight; aborting rather than freeing its buffers");
                std::process::abort();
            }
            let _ = self.ring.submit();
            let cqes: Vec<u64> = self.ring.completion().map(|c| c.user_data()).collect();
            for data in cqes {
                if let Some(f) = self.slots.get_mut(data as usize).and_then(Option::take) {
                    let _ = self.done.send(Done { job: f.job, status: Status::IoError });
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for job in self.pending.drain(..) {
            let _ = self.done.send(Done { job, status: Status::IoError });
        }
        self.done.wake_all();
    }
}

/// Longest the engine's thread waits for its I/O in flight after a panic before aborting.
const DRAIN_ON_PANIC: std::time::Duration = std::time::Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Memory, RamBackend};
    use std::path::Path;
    use std::time::Duration;
    use tyche_wire::{Request, Seq, NO_SLOT};

    fn request(op: Op, offset: u64, length: u32, fua: bool) -> Request {
        let damq = if op.uses_damq() { 0 } else { NO_SLOT };
        Request { seq: Seq::default(), op, fua, remq: 0, damq, home: 0, tag: 1, floor: 0, offset, length }
    }

    struct Harness {
        queue: Option<UringQueue>,
        thread: Option<JoinHandle<()>>,
        done: mpsc::Receiver<Done>,
        pool: mpsc::Receiver<Job>,
        pooled: std::cell::Cell<usize>,
        backend: Arc<dyn Backend>,
    }

    impl Harness {
        fn new(backend: Arc<dyn Backend>) -> Harness {
            let ring = open().expect("io_uring works on this machine");
            let (done_tx, done) = mpsc::channel();
            let (pool_tx, pool) = mpsc::sync_channel(16);
            let route = DoneRoute::new(vec![done_tx], vec![Arc::new(WakeFd::new().expect("eventfd"))], vec![0]);
            let stat = ThreadStat::new("tyched-uring0".into(), "io_uring", None, Vec::new(), 0);
            let table = Arc::new(BackendTable::new(1));
            assert!(table.set(0, Arc::clone(&backend)));
            let (queue, thread) = start(ring, table, route, pool_tx, stat).expect("start");
            Harness { queue: Some(queue), thread: Some(thread), done, pool, pooled: Default::default(), backend }
        }

        /// Runs one job through the ring (or, where it hands it on, through the pool's path).
        fn run(&self, op: Op, offset: u64, length: u32, fua: bool, buf: Option<Memory>) -> (Status, Option<Memory>) {
            let job = Job {
                session: 1,
                channel: 0,
                epoch: 0,
                export: 0,
                request: request(op, offset, length, fua),
                buf,
                lent: Vec::new(),
                region: None,
                abort: false,
                id: 0,
                fence: None,
                nic: None,
            };
            self.queue.as_ref().unwrap().submit(job).expect("the engine runs");
            loop {
                if let Ok(d) = self.done.recv_timeout(Duration::from_millis(5)) {
                    return (d.status, d.job.buf);
                }
                if let Ok(mut job) = self.pool.try_recv() {
                    self.pooled.set(self.pooled.get() + 1);
                    let st = crate::job::execute(&*self.backend, &mut job);
                    return (st, job.buf);
                }
            }
        }

        fn write(&self, offset: u64, data: &[u8], fua: bool) -> Status {
            let mut m = Memory::new(data.len(), None);
            m.as_mut_slice()[..data.len()].copy_from_slice(data);
            self.run(Op::Write, offset, data.len() as u32, fua, Some(m)).0
        }

        fn read(&self, offset: u64, len: usize) -> Vec<u8> {
            let (st, m) = self.run(Op::Read, offset, len as u32, false, Some(Memory::new(len, None)));
            assert_eq!(st, Status::Ok, "read {len} at {offset}");
            m.expect("buffer back").as_slice()[..len].to_vec()
        }
    }

    impl Drop for Harness {
        fn drop(&mut self) {
            self.queue.take();
            if let Some(t) = self.thread.take() {
                t.join().expect("the io_uring thread exits cleanly");
            }
        }
    }

    fn exercise(h: &Harness) {
        let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8 + 1).collect();
        assert_eq!(h.write(4096, &data, false), Status::Ok);
        assert_eq!(h.write(0, &data[..512], true), Status::Ok, "FUA write (RWF_DSYNC)");
        assert_eq!(h.run(Op::Flush, 0, 0, false, None).0, Status::Ok, "FLUSH (fdatasync)");
        assert!(h.read(4096, data.len()) == data, "read returns what was written");
        assert!(h.read(0, 512) == data[..512], "the FUA write is there");
        assert_eq!(h.run(Op::Discard, 4096, 4096, false, None).0, Status::Ok, "DISCARD");
        let back = h.read(4096, 8192);
        assert!(back[..4096].iter().all(|&x| x == 0), "discarded range reads as zeroes");
        assert!(back[4096..] == data[4096..8192], "discard stays in its range");
        assert_eq!(h.run(Op::WriteZeroes, 10240, 512, false, None).0, Status::Ok, "WRITE_ZEROES");
        let back = h.read(9728, 1024);
        assert!(back[..512] == data[5632..6144], "before the zeroed range");
        assert!(back[512..].iter().all(|&x| x == 0), "zeroed range");
        // Many jobs in flight at once, more than the ring holds.
        let q = h.queue.as_ref().unwrap();
        let n = DEPTH as usize * 2 + 7;
        for i in 0..n {
            let mut m = Memory::new(4096, None);
            m.as_mut_slice()[..4096].fill(i as u8);
            let r = request(Op::Write, (i * 4096) as u64, 4096, i % 3 == 0);
            q.submit(Job {
                session: 1,
                channel: 0,
                epoch: 0,
                export: 0,
                request: r,
                buf: Some(m),
                lent: Vec::new(),
                region: None,
                abort: false,
                id: 0,
                fence: None,
                nic: None,
            })
            .expect("the engine runs");
        }
        for _ in 0..n {
            let d = h.done.recv_timeout(Duration::from_secs(10)).expect("every write completes");
            assert_eq!(d.status, Status::Ok);
        }
        for i in [0, 1, DEPTH as usize, n - 1] {
            assert!(h.read((i * 4096) as u64, 4096).iter().all(|&x| x == i as u8), "write {i} landed");
        }
        // An aborted job completes without I/O.
        let j = Job {
            session: 1,
            channel: 0,
            epoch: 0,
            export: 0,
            request: request(Op::Flush, 0, 0, false),
            buf: None,
            lent: Vec::new(),
            region: None,
            abort: true,
            id: 0,
            fence: None,
            nic: None,
        };
        q.submit(j).expect("the engine runs");
        assert_eq!(h.done.recv_timeout(Duration::from_secs(5)).expect("aborted").status, Status::Aborted);
    }

    #[test]
    fn every_op_on_a_file_through_the_ring() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("export.img");
        let b: Arc<dyn Backend> = Arc::new(FileBackend::open(&path, Some(4 << 20), false, true).expect("open"));
        let h = Harness::new(Arc::clone(&b));
        exercise(&h);
        assert!(h.pool.try_recv().is_err(), "nothing went to the pool");
        assert!(h.pooled.get() == 0, "every op ran on the ring");
        // Reads past the end of the file come back short: an error, not stale bytes.
        let (st, _) = h.run(Op::Read, 4 << 20, 4096, false, Some(Memory::new(4096, None)));
        assert_eq!(st, Status::IoError, "a read past the end of the file");
        drop(h);
        let data = std::fs::read(&path).expect("read the file");
        assert_eq!(data[5 * 4096], 5, "written through the ring");
    }

    #[test]
    fn only_file_exports_use_the_ring_and_block_discard_goes_to_the_pool() {
        let ram = RamBackend::new(1 << 20, None).expect("RAM");
        assert!(!handles(true, &ram, Op::Read), "RAM runs inline");
        let dir = tempfile::tempdir().expect("tempdir");
        let file = FileBackend::open(&dir.path().join("f"), Some(1 << 20), false, true).expect("file");
        for op in [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::WriteZeroes] {
            assert!(handles(true, &file, op), "{op:?} on a file");
        }
        assert!(!handles(false, &file, Op::Discard), "no FALLOCATE op: the pool");
    }

    #[test]
    fn a_kernel_that_refuses_io_uring_gives_the_reason() {
        let e = open_with(|| Err(io::Error::from_raw_os_error(libc::EPERM))).expect_err("refused");
        assert!(matches!(&e, RingError::Setup(s) if s.raw_os_error() == Some(libc::EPERM)), "{e}");
        let e = e.to_string();
        assert!(e.contains("io_uring_setup") && e.contains("not permitted"), "{e}");
        let e = open_with(|| Err(io::Error::from_raw_os_error(libc::ENOSYS))).expect_err("no syscall");
        assert!(e.to_string().contains("io_uring_setup"), "{e}");
    }

    /// O_DIRECT through the ring on a loop device (root only; where losetup fails it cannot run:
    /// skipped, or failed under `cargo xtask test`).
    #[test]
    fn block_device_with_o_direct_through_the_ring() {
        let Some(lo) = crate::backend::test_support::LoopDevice::new(8 << 20) else { return };
        let dev = lo.dev.clone();
        let file = FileBackend::open(Path::new(&dev), None, false, true).expect("open the loop device");
        assert!(file.is_block());
        let m = Memory::new(8192, None);
        assert!(file.is_direct(m.as_slice().as_ptr(), 8192, 1 << 20), "slot memory is aligned: O_DIRECT");
        let b: Arc<dyn Backend> = Arc::new(file);
        let h = Harness::new(Arc::clone(&b));
        exercise(&h);
        assert!(!handles(true, &*b, Op::Discard), "block DISCARD goes to the pool (BLKDISCARD)");
    }
}
