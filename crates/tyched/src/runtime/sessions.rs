//! A network thread's parts of sessions: what it keeps per session beside the channel engine's
//! [`TargetSession`] part ([`SessionState`]), the messages it takes from other threads and the
//! control ([`ThreadMsg`]), timers, channels dying, and parts ending (reclaimed once every part
//! of the session has been dead long enough, which the control decides from each thread's
//! report, or failed at once when handling them hit a bug).
//!
//! A session is held in one part per network thread that serves one of its channels
//! (docs/architecture.md, "The session in parts"): each part holds its thread's channels and the
//! at-most-once records of the homes that first joined there; a re-issued copy arriving on
//! another thread's channel is decided by its home's part, by messages between the threads.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use tyche_channel::{post_messages, Courier, DeadReason, FenceWait, Instant, PartMessage, TargetSession};
use tyche_wire::DisconnectReason;

use super::control::{lock, report, Opening, Postal, SessionMeta, ThreadMsg, RECLAIM_CHECK, RECLAIM_GRACE};
use super::slots::SlotKey;
use super::{Network, PEER_LOGS};

/// A network thread's part of one session.
#[derive(Debug)]
pub(super) struct SessionState {
    pub(super) session: TargetSession,
    /// What the parts share.
    pub(super) meta: Arc<SessionMeta>,
    /// Channel index → NIC index.
    pub(super) nic_of: BTreeMap<u16, usize>,
    /// Storage jobs outstanding per channel.
    pub(super) executing: BTreeMap<u16, u64>,
    /// Instance of each channel index (bumped when a reconnect replaces a channel), so that slot
    /// memory of a replaced channel's requests still executing is never mixed with the new one's.
    pub(super) epochs: BTreeMap<u16, u64>,
    /// Each channel's flag the control reads (set when it dies).
    dead_flags: BTreeMap<u16, Arc<AtomicBool>>,
    /// Since when the part has had no live channel, storage job or undecided copy.
    all_dead_since: Option<Instant>,
    /// Whether any channel of it carried a frame after its handshake (reclaim grace).
    pub(super) established: bool,
    /// Fenced sessions whose storage jobs must all end before this one's first runs.
    pub(super) waits_for: FenceWait<Weak<SessionMeta>>,
    /// The reclaim report last given the control.
    reported: u64,
}

impl SessionState {
    /// The instance of channel index `channel` now.
    pub(super) fn epoch(&self, channel: u16) -> u64 {
        self.epochs.get(&channel).copied().unwrap_or(0)
    }

    /// Storage jobs outstanding in this part.
    fn executing_total(&self) -> u64 {
        self.executing.values().sum()
    }
}

/// Whether the memory of slot `key` may be taken back: no request uses it and no frame will
/// be sent from it (its channel was replaced or is dead, or has every frame acknowledged,
/// nothing to send, and the slot is not receiving write data).
pub(super) fn slot_idle(sessions: &BTreeMap<u64, SessionState>, key: &SlotKey) -> bool {
    let Some(s) = sessions.get(&key.0) else { return false };
    s.epoch(key.1) != key.2
        || s.session.channel(key.1).is_none_or(|c| {
            c.dead().is_some() || (c.unacked_frames() == 0 && !c.wants_transmit() && !c.damq_active(key.3))
        })
}

/// Whether every frame of the read data in slot `key` is acknowledged (nothing left to send or
/// resend on its channel), or its channel or session is gone.
pub(super) fn slot_acked(sessions: &BTreeMap<u64, SessionState>, key: &SlotKey) -> bool {
    sessions
        .get(&key.0)
        .and_then(|s| s.session.channel(key.1))
        .is_none_or(|c| c.dead().is_some() || (c.unacked_frames() == 0 && !c.wants_transmit()))
}

impl Network {
    /// Takes the messages other threads and the control sent this one; whether there were any.
    pub(super) fn deliver_mail(&mut self) -> bool {
        let mut any = false;
        while let Ok(msg) = self.inbox.try_recv() {
            any = true;
            match msg {
                ThreadMsg::Open(o) => self.install(*o),
                ThreadMsg::Leave { sid, channel, dead } => self.leave(sid, channel, &dead),
                ThreadMsg::Fence { old } => self.fence_local(old),
                ThreadMsg::Forget { sid } => self.forget_local(sid),
                ThreadMsg::Part { sid, msg } => {
                    // A part that is gone (the session failed, or was reclaimed) takes nothing.
                    let Some(s) = self.sessions.get_mut(&sid) else { continue };
                    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.session.handle_message(msg)));
                    if run.is_err() {
                        self.fail_session(sid, "taking a message between its parts");
                    }
                }
            }
        }
        any
    }

    /// Installs a channel accepted for one of this thread's NICs in its part of the session
    /// (made now if this is the part's first channel). A reconnect on the same index replaces
    /// the channel, and its slots go with it.
    pub(super) fn install(&mut self, o: Opening) {
        let Opening { meta, nic, channel, dead, waits_for, exports } = o;
        if exports.len() > self.exports.len() {
            // A reload added exports since this thread last took the list.
            // Its own copy, as at start (the backends stay shared).
            self.counters.exports.resize(exports.len(), crate::stats::ExportStats::default());
            self.exports = exports.iter().cloned().collect();
        }
        let (sid, g) = (meta.id, self.g);
        let idx = channel.envelope().channel;
        let ethertype = self.ethertype;
        let st = self.sessions.entry(sid).or_insert_with(|| SessionState {
            session: TargetSession::part(sid, ethertype, meta.geometry, g as u32, Arc::clone(&meta.directory)),
            meta: Arc::clone(&meta),
            nic_of: BTreeMap::new(),
            executing: BTreeMap::new(),
            epochs: BTreeMap::new(),
            dead_flags: BTreeMap::new(),
            all_dead_since: None,
            established: false,
            waits_for,
            reported: 0,
        });
        st.session.add_channel(*channel);
        st.dead_flags.insert(idx, dead);
        st.all_dead_since = None;
        // Live again before the control counts the install (it reads them in that order).
        st.reported = 0;
        meta.report.set(g, 0);
        meta.installed.set(g, meta.installed.get(g) + 1);
        if st.nic_of.insert(idx, nic).is_some() {
            let old = bump_epoch(st, idx);
            self.slots.drop_where(|key| key.0 == sid && key.1 == idx && key.2 == old);
        }
    }

    /// Channel index `channel` of session `sid` joined again on another thread: the channel
    /// here is aborted (requests it still executes complete into nothing), and its slots go;
    /// unless the channel here is not the instance that left (`dead` is the flag of that one):
    /// the index came back here meanwhile.
    fn leave(&mut self, sid: u64, channel: u16, dead: &Arc<AtomicBool>) {
        let Some(st) = self.sessions.get_mut(&sid) else { return };
        if !st.dead_flags.get(&channel).is_some_and(|f| Arc::ptr_eq(f, dead)) {
            return;
        }
        st.session.abort_channel(channel);
        st.dead_flags.remove(&channel);
        if st.nic_of.remove(&channel).is_some() {
            let old = bump_epoch(st, channel);
            self.slots.drop_where(|key| key.0 == sid && key.1 == channel && key.2 == old);
        }
    }

    /// Session `old` was fenced (`tyche_channel::fence`): its part here closes its channels and
    /// answers ABORTED the requests that wait here before storage (for slot memory, or for
    /// sessions it fenced itself), and its queued storage jobs are marked not to run (the
    /// shared flag stops them anyway when storage comes to them).
    fn fence_local(&mut self, old: u64) {
        let Some(s) = self.sessions.get_mut(&old) else { return };
        let waiting = self.storage.take_waiting(old);
        s.session.fence(waiting.into_iter().map(|(_, channel, request, _)| (channel, request)));
        self.storage.abort_queued(old);
    }

    /// Hands the messages this thread's parts wrote for other threads' parts to those threads
    /// (`tyche_channel::post_messages`, as in the simulator, with the threads' queues for courier).
    pub(super) fn post_part_messages(&mut self, now: Instant) {
        for (&sid, s) in self.sessions.iter_mut() {
            let mut mail = PartMail { post: &self.post, sid };
            self.counters.part_messages += post_messages(&mut s.session, self.g, now, &mut mail);
        }
    }

    /// Runs the sessions' due timers.
    pub(super) fn timers(&mut self, now: Instant) {
        let mut failed = Vec::new();
        for (&sid, s) in self.sessions.iter_mut() {
            if s.session.poll_timeout().is_some_and(|t| t <= now) {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.session.handle_timeout(now)));
                if run.is_err() {
                    failed.push(sid);
                }
            }
        }
        for sid in failed {
            self.fail_session(sid, "running its timers");
        }
    }

    /// A channel died: what only its slots need goes now (not when the session ends), and the
    /// control learns it.
    pub(super) fn channel_dead(&mut self, sid: u64, channel: u16, reason: DeadReason) {
        if PEER_LOGS.allow() {
            tracing::info!(session = format_args!("{sid:016x}"), channel, ?reason, "channel dead");
        }
        let Some(s) = self.sessions.get(&sid) else { return };
        if let Some(f) = s.dead_flags.get(&channel) {
            f.store(true, Ordering::Relaxed);
        }
        let epoch = s.epoch(channel);
        self.slots.drop_where(|key| key.0 == sid && key.1 == channel && key.2 == epoch);
    }

    /// Ends session `sid` at once because handling it hit a bug (a panic): every other session
    /// goes on. Its part here goes now, and the control drops the session and tells the other
    /// parts' threads; its channels send nothing more (the initiator finds them dead and
    /// reconnects).
    pub(super) fn fail_session(&mut self, sid: u64, doing: &str) {
        self.counters.limits.sessions_failed += 1;
        if PEER_LOGS.allow() {
            tracing::error!(session = format_args!("{sid:016x}"), "session ended: a bug was hit while {doing}");
        }
        if self.sessions.contains_key(&sid) {
            self.forget_local(sid);
            let control = Arc::clone(&self.control);
            lock(&control).forget(sid);
        }
    }

    /// Drops this thread's part of session `sid` and everything kept for it.
    fn forget_local(&mut self, sid: u64) {
        let Some(mut s) = self.sessions.remove(&sid) else { return };
        while s.session.poll_message().is_some() {}
        s.meta.executing.set(self.g, 0);
        self.counters.duplicates_from_reclaimed += s.session.duplicates_suppressed();
        self.counters.decided_from_reclaimed += s.session.forwarded();
        self.storage.waiting.retain(|d| d.0 != sid);
        self.slots.drop_where(|key| key.0 == sid);
    }

    /// Tells the control how this thread's parts stand for reclaim (only what changed), and
    /// asks it, at most every [`RECLAIM_CHECK`], to reclaim the sessions whose part here has
    /// been dead for [`RECLAIM_GRACE`]: the control drops a session once every part of it has
    /// been dead its grace period ([`super::control::Control::reclaim`]).
    pub(super) fn reclaim(&mut self, now: Instant) {
        let g = self.g;
        let mut candidates = Vec::new();
        for (&sid, s) in self.sessions.iter_mut() {
            let dead = s.session.all_dead() && s.executing_total() == 0 && s.session.awaiting_decision() == 0;
            if !dead {
                s.all_dead_since = None;
                if s.reported != 0 {
                    s.reported = 0;
                    s.meta.report.set(g, 0);
                }
                continue;
            }
            let since = *s.all_dead_since.get_or_insert(now);
            let detached = s.session.channel_indices().all(|c| {
                matches!(
                    s.session.channel(c).and_then(|c| c.dead()),
                    Some(DeadReason::PeerClosed(DisconnectReason::Normal))
                )
            });
            let mut r = since.0.max(1) & report::SINCE;
            if s.established {
                r |= report::ESTABLISHED;
            }
            if detached {
                r |= report::DETACHED;
            }
            if r != s.reported {
                s.reported = r;
                s.meta.report.set(g, r);
            }
            if now.since(since) >= RECLAIM_GRACE {
                candidates.push(sid);
            }
        }
        if candidates.is_empty() || now < self.next_reclaim_check {
            return;
        }
        self.next_reclaim_check = now + RECLAIM_CHECK;
        let control = Arc::clone(&self.control);
        lock(&control).reclaim(now, &candidates);
    }

    /// Publishes this part's storage jobs outstanding of session `sid` (a new session of the
    /// same initiator waits for them all to end).
    pub(super) fn executing_changed(&mut self, sid: u64) {
        if let Some(s) = self.sessions.get(&sid) {
            s.meta.executing.set(self.g, s.executing_total());
        }
    }
}

/// Moves channel index `idx` of `st` to its next instance; the old one.
fn bump_epoch(st: &mut SessionState, idx: u16) -> u64 {
    let epoch = st.epochs.entry(idx).or_default();
    let old = *epoch;
    *epoch += 1;
    old
}

/// The network threads' courier for the messages between a session's parts: each goes on the
/// receiving thread's queue, its doorbell rung.
struct PartMail<'a> {
    post: &'a Postal,
    sid: u64,
}

impl Courier for PartMail<'_> {
    fn post(&mut self, _now: Instant, _from: usize, to: usize, msg: PartMessage) {
        self.post.send(to, ThreadMsg::Part { sid: self.sid, msg });
    }
}
