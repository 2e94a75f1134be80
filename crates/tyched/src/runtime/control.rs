//! The control: what the network threads share, reached off the per-frame path.
//!
//! Each network thread owns its NICs and everything of the channels they serve (its
//! [`super::Network`]: session parts, slot table, storage jobs, counters), and takes no lock
//! for a frame of an established channel. What belongs to no one thread is here, behind one
//! mutex that a thread takes only for a DISCOVER or CONNECT frame, for a session it decides to
//! reclaim (at most every [`RECLAIM_CHECK`]), and for a session that hit a bug:
//! - the [`Admission`] (the acceptor, the key challenges, and the sessions: each session's
//!   export, initiator identity, fencing and channels), with what the daemon keeps beside each
//!   session ([`SessionEntry`]: the [`SessionMeta`] its parts share, which threads were sent
//!   its channels) and each channel ([`ChannelEntry`]: which thread and NIC serve it, and
//!   whether it died);
//! - the exports (their allow-lists, keys and sharing, which the admission checks).
//!
//! Everything that crosses threads goes as a [`ThreadMsg`] in the destination thread's queue,
//! with a ring of its doorbell ([`Postal`]): a channel accepted on another thread's NIC, a
//! channel index that moved to another thread, a fence, a reclaimed session, and the messages
//! between the parts of a session ([`PartMessage`]). The queues are unbounded channels whose
//! contents are bounded by what sends them: at most one part message per request slot of a
//! session's channels, one opening per channel the acceptor admits (`limits.channels`), one
//! fence or forget per session (`limits.sessions`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::time::Duration;

use tyche_channel::{Admission, Channel, Directory, ExportGeometry, FenceWait, Fenceable, Instant, PartMessage};
use tyche_runtime::wake::WakeFd;

use super::{Export, PEER_LOGS};

/// A session whose channels are all dead is dropped after this grace period when it never
/// carried a frame after its handshake (`reclaim_after_ms` otherwise).
pub(super) const RECLAIM_GRACE: Duration = Duration::from_millis(500);

/// How often at most a network thread asks the control to reclaim sessions whose part it holds
/// has been dead for [`RECLAIM_GRACE`].
pub(super) const RECLAIM_CHECK: Duration = Duration::from_millis(50);

/// Locks the control. A panic under it (a bug) is contained like one on a network thread: the
/// state is still consistent for every other session.
pub(super) fn lock(control: &Mutex<Control>) -> std::sync::MutexGuard<'_, Control> {
    control.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A value on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded(AtomicU64);

/// One value per network thread, each on its own cache line, written by that thread alone and
/// read by the control.
#[derive(Debug)]
pub(super) struct PerThread(Box<[Padded]>);

impl PerThread {
    fn new(threads: usize) -> PerThread {
        PerThread((0..threads.max(1)).map(|_| Padded::default()).collect())
    }

    /// Thread `g`'s value.
    pub(super) fn get(&self, g: usize) -> u64 {
        self.0.get(g).map_or(0, |p| p.0.load(Ordering::SeqCst))
    }

    /// Sets thread `g`'s value.
    pub(super) fn set(&self, g: usize, v: u64) {
        if let Some(p) = self.0.get(g) {
            p.0.store(v, Ordering::SeqCst);
        }
    }

    /// The sum over the threads.
    pub(super) fn sum(&self) -> u64 {
        self.0.iter().map(|p| p.0.load(Ordering::SeqCst)).sum()
    }
}

/// A thread's reclaim report for its part of a session ([`SessionMeta::report`]): 0 while the
/// part has a live channel, storage jobs, or copies awaiting a decision; else the instant since
/// when it has had none, with these flags.
pub(super) mod report {
    /// The instant's bits.
    pub(in super::super) const SINCE: u64 = (1 << 61) - 1;
    /// A channel of the part carried a frame after its handshake.
    pub(in super::super) const ESTABLISHED: u64 = 1 << 61;
    /// Every channel of the part ended with a DISCONNECT NORMAL from the initiator (a detach).
    pub(in super::super) const DETACHED: u64 = 1 << 62;
}

/// What every part of a session shares: made by the control with the session, handed to each
/// thread that holds a part.
#[derive(Debug)]
pub(super) struct SessionMeta {
    /// Session id.
    pub(super) id: u64,
    /// The export.
    pub(super) export: usize,
    /// Its geometry as the parts check requests against it.
    pub(super) geometry: ExportGeometry,
    /// Per thread, set (all together) when a new attachment of the same initiator fenced this
    /// session: storage jobs not started by then are not run. One flag per thread, so that the
    /// reference each job holds counts on a cache line of its thread's own.
    fences: Box<[Arc<AtomicBool>]>,
    /// Which part holds each home channel's at-most-once records.
    pub(super) directory: Arc<Directory>,
    /// Per thread: its part's storage jobs outstanding (a new session of the same initiator
    /// runs nothing while any is).
    pub(super) executing: PerThread,
    /// Per thread: its part's reclaim report ([`report`]).
    pub(super) report: PerThread,
    /// Per thread: channels it installed (against [`SessionEntry::posted`]: none still on its way).
    pub(super) installed: PerThread,
}

/// The session's storage work as a fence sees it (`tyche_channel::fence`): the fence flags,
/// and the jobs every part counts from before they are handed to storage until they finished.
impl Fenceable for SessionMeta {
    /// From now on no storage job of the session starts (each job checks its thread's flag).
    fn fence(&self) {
        for f in self.fences.iter() {
            f.store(true, Ordering::SeqCst);
        }
    }

    fn is_fenced(&self) -> bool {
        self.fences.first().is_some_and(|f| f.load(Ordering::SeqCst))
    }

    fn busy(&self) -> bool {
        self.executing.sum() > 0
    }
}

impl SessionMeta {
    /// The fence flag thread `g`'s storage jobs check ([`Fenceable::is_fenced`], on a cache
    /// line of that thread's own).
    pub(super) fn fence_of(&self, g: usize) -> &Arc<AtomicBool> {
        &self.fences[g.min(self.fences.len() - 1)]
    }
}

/// A channel accepted for a thread's NIC, to be installed in that thread's part of its session.
#[derive(Debug)]
pub(super) struct Opening {
    pub(super) meta: Arc<SessionMeta>,
    /// The NIC (transport) serving it.
    pub(super) nic: usize,
    pub(super) channel: Box<Channel>,
    /// Set by the serving thread when the channel dies (the control reads it).
    pub(super) dead: Arc<AtomicBool>,
    /// The fenced sessions whose storage jobs must all end before this session's first runs.
    pub(super) waits_for: FenceWait<Weak<SessionMeta>>,
    /// The exports when it was accepted: a thread that has fewer (a reload added some since it
    /// last took the list) takes this list before it installs the channel.
    pub(super) exports: Arc<[Export]>,
}

/// A message to a network thread.
#[derive(Debug)]
pub(super) enum ThreadMsg {
    /// Install a channel.
    Open(Box<Opening>),
    /// Channel index `channel` of session `sid` joined again on another thread: abort it here,
    /// if it is still the instance whose flag `dead` is (not one that joined here since).
    Leave { sid: u64, channel: u16, dead: Arc<AtomicBool> },
    /// Session `old` was fenced: close its channels, abort what it has not started.
    Fence { old: u64 },
    /// Session `sid` is gone (reclaimed, or failed): drop the part.
    Forget { sid: u64 },
    /// A message from another part of session `sid`.
    Part { sid: u64, msg: PartMessage },
}

/// Every network thread's queue and doorbell.
#[derive(Debug, Clone)]
pub(super) struct Postal {
    tx: Vec<mpsc::Sender<ThreadMsg>>,
    wakes: Vec<Arc<WakeFd>>,
}

impl Postal {
    /// The queues of `wakes.len()` threads, and each thread's receiving end.
    pub(super) fn new(wakes: Vec<Arc<WakeFd>>) -> (Postal, Vec<mpsc::Receiver<ThreadMsg>>) {
        let (tx, rx) = wakes.iter().map(|_| mpsc::channel()).unzip();
        (Postal { tx, wakes }, rx)
    }

    /// Sends thread `h` a message and rings its doorbell. (A thread that has exited, at
    /// shutdown, takes nothing more: the message goes with it.)
    pub(super) fn send(&self, h: usize, msg: ThreadMsg) {
        if let Some(tx) = self.tx.get(h) {
            let _ = tx.send(msg);
            self.wakes[h].wake();
        }
    }

    /// Every thread's doorbell.
    pub(super) fn wakes(&self) -> &[Arc<WakeFd>] {
        &self.wakes
    }
}

/// One channel of a session as the control knows it.
#[derive(Debug)]
pub(super) struct ChannelEntry {
    /// The thread serving it.
    pub(super) thread: usize,
    /// Its NIC (transport).
    pub(super) nic: usize,
    /// Set when it died.
    pub(super) dead: Arc<AtomicBool>,
}

/// What the control keeps beside a session of the admission's.
#[derive(Debug)]
pub(super) struct SessionEntry {
    pub(super) meta: Arc<SessionMeta>,
    /// The sessions it fenced (their jobs end before its first runs).
    pub(super) waits_for: FenceWait<Weak<SessionMeta>>,
    /// Per thread: channels sent to it to install.
    pub(super) posted: Vec<u64>,
    /// When a channel last joined.
    pub(super) last_join: Instant,
}

impl SessionEntry {
    /// Session `id` of export `export`, for `threads` network threads, made at `now`.
    pub(super) fn new(id: u64, export: usize, geometry: ExportGeometry, threads: usize, now: Instant) -> SessionEntry {
        SessionEntry {
            meta: SessionMeta::new(id, export, geometry, threads),
            waits_for: FenceWait::default(),
            posted: vec![0; threads],
            last_join: now,
        }
    }

    /// Whether every part of the session is dead (no live channel, storage job or undecided
    /// copy) and no channel is on its way to a thread: since when (the latest of the parts'
    /// reports and the last join), whether any part carried traffic, and whether every part
    /// was detached.
    fn parts_dead(&self) -> Option<(Instant, bool, bool)> {
        let m = &self.meta;
        let (mut since, mut established, mut detached) = (self.last_join, false, true);
        for (h, &posted) in self.posted.iter().enumerate().filter(|(_, &n)| n > 0) {
            // Installed first: a report read after it is no older than the install.
            let installed = m.installed.get(h);
            let r = m.report.get(h);
            if installed != posted || r == 0 {
                return None;
            }
            since = since.max(Instant(r & report::SINCE));
            established |= r & report::ESTABLISHED != 0;
            detached &= r & report::DETACHED != 0;
        }
        Some((since, established, detached))
    }
}

/// The control (see the module documentation).
#[derive(Debug)]
pub(super) struct Control {
    pub(super) exports: Arc<[Export]>,
    /// The handshake's checks and decisions, and the sessions they made.
    pub(super) admission: Admission<SessionEntry, ChannelEntry>,
    /// Queue addresses: which transport serves a new channel and the address ACCEPT names.
    pub(super) queue_addresses: crate::steer::QueueAddresses,
    /// The network thread serving each NIC.
    pub(super) thread_of: Vec<usize>,
    /// Each NIC's name (for log lines).
    pub(super) nic_names: Vec<String>,
    pub(super) post: Postal,
    /// CONNECTs refused, per export.
    pub(super) denied: Vec<u64>,
    /// Sessions fenced by a new attachment of the same initiator.
    pub(super) fenced: u64,
    /// Sessions reclaimed.
    pub(super) reclaimed: u64,
    /// How long a session whose channels are all dead is kept (`reclaim_after_ms`).
    pub(super) reclaim_after: Duration,
    /// Configuration reloads.
    pub(super) reload: crate::stats::ReloadStats,
}

impl Control {
    /// Network threads.
    pub(super) fn threads(&self) -> usize {
        self.post.wakes.len()
    }

    /// Session `sid` is gone: the acceptor forgets it, and every thread holding a part drops
    /// it.
    pub(super) fn forget(&mut self, sid: u64) {
        let Some(e) = self.admission.forget(sid) else { return };
        for (h, _) in e.data.posted.iter().enumerate().filter(|(_, &n)| n > 0) {
            self.post.send(h, ThreadMsg::Forget { sid });
        }
    }

    /// Reclaims those of `candidates` (sessions a thread found its part of dead) whose every
    /// part has had no live channel, storage job or undecided copy for their grace period, and
    /// to which no channel is on its way.
    pub(super) fn reclaim(&mut self, now: Instant, candidates: &[u64]) {
        for &sid in candidates {
            let Some(e) = self.admission.session(sid) else { continue };
            let Some((since, established, detached)) = e.data.parts_dead() else { continue };
            let m = &e.data.meta;
            // A session that carried traffic is kept `reclaim_after_ms` so an initiator back in
            // time resumes it (its ledger too); one that never did (a CONNECT and nothing else,
            // as in a flood) goes at once. An initiator that said goodbye on every channel
            // (DISCONNECT NORMAL: a detach) does not come back for this session.
            let grace = if established && !detached && !m.is_fenced() {
                self.reclaim_after.max(RECLAIM_GRACE)
            } else {
                RECLAIM_GRACE
            };
            if now.since(since) >= grace {
                self.forget(sid);
                self.reclaimed += 1;
                if PEER_LOGS.allow() {
                    tracing::info!(session = format_args!("{sid:016x}"), "session reclaimed");
                }
            }
        }
    }

    /// Live channels served on transport `k`.
    pub(super) fn channels_on(&self, k: usize) -> usize {
        self.admission
            .sessions()
            .values()
            .flat_map(|e| e.channels.values())
            .filter(|c| c.data.nic == k && !c.data.dead.load(Ordering::Relaxed))
            .count()
    }
}

impl SessionMeta {
    /// Session `id` of export `export`, for `threads` network threads.
    fn new(id: u64, export: usize, geometry: ExportGeometry, threads: usize) -> Arc<SessionMeta> {
        Arc::new(SessionMeta {
            id,
            export,
            geometry,
            fences: (0..threads.max(1)).map(|_| Arc::new(AtomicBool::new(false))).collect(),
            directory: Directory::new(),
            executing: PerThread::new(threads),
            report: PerThread::new(threads),
            installed: PerThread::new(threads),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_thread_values_sit_on_their_own_cache_lines() {
        assert!(std::mem::align_of::<Padded>() >= 64);
        let p = PerThread::new(3);
        p.set(1, 5);
        p.set(2, 7);
        p.set(9, 1); // no such thread: ignored
        assert_eq!((p.get(0), p.get(1), p.sum()), (0, 5, 12));
    }

    #[test]
    fn a_session_is_dead_only_when_every_part_is_and_no_channel_is_on_its_way() {
        let geometry = ExportGeometry { size: 1 << 20, read_only: false, discard: true };
        let mut e = SessionEntry::new(1, 0, geometry, 3, Instant(50));
        // Threads 0 and 1 were each sent a channel; thread 2 holds no part.
        e.posted = vec![1, 1, 0];
        let m = Arc::clone(&e.meta);
        m.installed.set(0, 1);
        m.report.set(0, 100 | report::ESTABLISHED);
        assert_eq!(e.parts_dead(), None, "thread 1 has not installed its channel yet");
        m.report.set(1, 300 | report::DETACHED);
        assert_eq!(e.parts_dead(), None, "a report from before thread 1's install does not count");
        m.installed.set(1, 1);
        m.report.set(1, 0);
        assert_eq!(e.parts_dead(), None, "thread 1's part is live");
        m.report.set(1, 200 | report::DETACHED);
        assert_eq!(e.parts_dead(), Some((Instant(200), true, false)), "since the later part died");
        // Another channel on its way to thread 1: not dead until it is installed and dies.
        e.posted[1] = 2;
        assert_eq!(e.parts_dead(), None);
        m.installed.set(1, 2);
        e.last_join = Instant(400);
        assert_eq!(e.parts_dead(), Some((Instant(400), true, false)), "not before its last join");
    }
}
