//! Sessions on the target: what it keeps per session beside the channel engine's
//! [`TargetSession`] ([`SessionState`]), their timers, channels dying, and sessions ending
//! (reclaimed once every channel is dead and nothing of theirs executes, or failed at once when
//! handling them hit a bug).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tyche_channel::{Courier, DeadReason, ExportGeometry, Instant, PartMessage, SessionParts};
use tyche_wire::{DisconnectReason, MacAddr};

use super::slots::SlotKey;
use super::{Network, PEER_LOGS};

/// A session whose channels are all dead is dropped after this grace period when it never
/// carried a frame after its handshake (`reclaim_after_ms` otherwise).
const RECLAIM_GRACE: Duration = Duration::from_millis(500);

/// A session held in parts, one per network thread (docs/architecture.md, "The session in
/// parts"): each part holds the channels of its thread's NICs and the at-most-once records of
/// the homes that joined there; a re-issued copy arriving on another thread's channel is decided
/// by its home's part. A message between parts waits in its part's inbox ([`Inboxes`]) until
/// that part's thread delivers it in its turn ([`deliver`]), as it will when the threads own
/// their parts outright; the target-wide mail counts ([`Mail`]) say which thread has mail, so
/// that a turn looks at the sessions only when there is some, and a sleeping thread is woken
/// for it. With one network thread there is one part and no message.
pub(super) type Parts = SessionParts<Inboxes>;

/// Undelivered messages between session parts, per network thread, target-wide.
pub(super) type Mail = Arc<Vec<AtomicUsize>>;

/// The messages waiting for each part of one session, in the order sent (so in order between
/// any two parts). At most one per request slot of the session's channels is in flight.
#[derive(Debug)]
pub(super) struct Inboxes {
    inbox: Vec<VecDeque<PartMessage>>,
    mail: Mail,
}

impl Courier for Inboxes {
    fn post(&mut self, _now: Instant, _from: usize, to: usize, msg: PartMessage) {
        // A part only names parts of its session (all below the thread count).
        let Some(q) = self.inbox.get_mut(to) else { return };
        q.push_back(msg);
        self.mail[to].fetch_add(1, Ordering::Relaxed);
    }
}

impl Inboxes {
    /// Takes part `g`'s messages.
    fn take(&mut self, g: usize) -> VecDeque<PartMessage> {
        let Some(q) = self.inbox.get_mut(g) else { return VecDeque::new() };
        let mail = std::mem::take(q);
        self.mail[g].fetch_sub(mail.len(), Ordering::Relaxed);
        mail
    }
}

/// Session `id` in one part per network thread (as many as `mail` counts).
pub(super) fn new_parts(id: u64, ethertype: u16, geometry: ExportGeometry, mail: &Mail) -> Parts {
    let groups = mail.len().max(1);
    let inboxes = Inboxes { inbox: (0..groups).map(|_| VecDeque::new()).collect(), mail: Arc::clone(mail) };
    SessionParts::new(id, ethertype, geometry, groups, inboxes)
}

/// Delivers part `g`'s messages (network thread `g`'s turn); whether there were any.
pub(super) fn deliver(parts: &mut Parts, g: usize) -> bool {
    let mail = parts.courier_mut().take(g);
    if mail.is_empty() {
        return false;
    }
    parts.deliver(g, mail);
    true
}

/// Drops the undelivered messages (the session is going), keeping the mail counts true.
fn drop_mail(parts: &mut Parts) {
    for g in 0..parts.part_count() {
        parts.courier_mut().take(g);
    }
}

/// Whether no message is undelivered and no copy waits for its home's decision (the session
/// may be reclaimed).
fn settled(parts: &Parts) -> bool {
    parts.courier().inbox.iter().all(VecDeque::is_empty) && parts.awaiting_decision() == 0
}

#[derive(Debug)]
pub(super) struct SessionState {
    pub(super) session: Parts,
    pub(super) export: usize,
    /// Channel index → NIC index.
    pub(super) nic_of: BTreeMap<u16, usize>,
    /// Storage jobs outstanding per channel.
    pub(super) executing: BTreeMap<u16, u64>,
    /// Instance of each channel index (bumped when a reconnect replaces a channel), so that slot
    /// memory of a replaced channel's requests still executing is never mixed with the new one's.
    pub(super) epochs: BTreeMap<u16, u64>,
    pub(super) all_dead_since: Option<Instant>,
    /// Whether any channel of it carried a frame after its handshake (reclaim grace).
    pub(super) established: bool,
    /// Who attached: the host id the initiator sent, else one made from its MAC.
    pub(super) identity: [u8; 16],
    /// The MAC that created it (named to another initiator refused IN_USE).
    pub(super) mac: MacAddr,
    /// Set when a new attachment of the same initiator fenced this session.
    pub(super) fenced: Arc<AtomicBool>,
    /// Fenced sessions whose storage requests must all end before this one's first runs.
    pub(super) waits_for: Vec<u64>,
}

impl SessionState {
    /// The instance of channel index `channel` now.
    pub(super) fn epoch(&self, channel: u16) -> u64 {
        self.epochs.get(&channel).copied().unwrap_or(0)
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
    /// Delivers the messages other threads' parts sent network thread `g`'s parts; whether
    /// there were any. Looks at the sessions only when the mail count says there is some.
    pub(super) fn deliver_mail(&mut self, g: usize) -> bool {
        if self.mail.get(g).is_none_or(|m| m.load(Ordering::Relaxed) == 0) {
            return false;
        }
        let mut any = false;
        let mut failed = Vec::new();
        for (&sid, s) in self.sessions.iter_mut() {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| deliver(&mut s.session, g))) {
                Ok(d) => any |= d,
                Err(_) => failed.push(sid),
            }
        }
        for sid in failed {
            self.fail_session(sid, "delivering messages between its parts");
        }
        any
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

    /// A channel died: what only its slots need goes now (not when the session ends).
    pub(super) fn channel_dead(&mut self, sid: u64, channel: u16, reason: DeadReason) {
        if PEER_LOGS.allow() {
            tracing::info!(session = format_args!("{sid:016x}"), channel, ?reason, "channel dead");
        }
        let Some(s) = self.sessions.get(&sid) else { return };
        let epoch = s.epoch(channel);
        self.slots.drop_where(|key| key.0 == sid && key.1 == channel && key.2 == epoch);
    }

    /// Ends session `sid` at once because handling it hit a bug (a panic): every other session
    /// goes on. Its channels send nothing more (the initiator finds them dead and reconnects).
    pub(super) fn fail_session(&mut self, sid: u64, doing: &str) {
        self.counters.limits.sessions_failed += 1;
        if PEER_LOGS.allow() {
            tracing::error!(session = format_args!("{sid:016x}"), "session ended: a bug was hit while {doing}");
        }
        if self.sessions.contains_key(&sid) {
            self.forget_session(sid);
        }
    }

    /// Drops session `sid` and everything kept for it.
    fn forget_session(&mut self, sid: u64) {
        let Some(mut s) = self.sessions.remove(&sid) else { return };
        drop_mail(&mut s.session);
        self.counters.duplicates_from_reclaimed += s.session.duplicates_suppressed();
        let (f, m) = s.session.forwarding();
        self.counters.forwarding_from_reclaimed.0 += f;
        self.counters.forwarding_from_reclaimed.1 += m;
        self.acceptor.forget_session(sid);
        self.storage.waiting.retain(|d| d.0 != sid);
        self.slots.drop_where(|key| key.0 == sid);
    }

    /// Drops sessions whose channels are all dead once nothing of theirs executes.
    pub(super) fn reclaim(&mut self, now: Instant) {
        let mut gone = Vec::new();
        for (&sid, s) in self.sessions.iter_mut() {
            if !s.session.all_dead() {
                s.all_dead_since = None;
                continue;
            }
            let since = *s.all_dead_since.get_or_insert(now);
            let busy = s.executing.values().any(|&n| n > 0) || !settled(&s.session);
            // A session that carried traffic is kept `reclaim_after_ms` so an initiator back in
            // time resumes it (its ledger too); one that never did (a CONNECT and nothing else,
            // as in a flood) goes at once.
            // An initiator that said goodbye on every channel (DISCONNECT NORMAL: a detach) does
            // not come back for this session.
            let detached = s.session.channel_indices().all(|c| {
                matches!(
                    s.session.channel(c).and_then(|c| c.dead()),
                    Some(DeadReason::PeerClosed(DisconnectReason::Normal))
                )
            });
            let grace = if s.established && !detached && !s.fenced.load(Ordering::Relaxed) {
                self.reclaim_after.max(RECLAIM_GRACE)
            } else {
                RECLAIM_GRACE
            };
            if !busy && now.since(since) >= grace {
                gone.push(sid);
            }
        }
        for sid in gone {
            self.forget_session(sid);
            self.counters.reclaimed += 1;
            if PEER_LOGS.allow() {
                tracing::info!(session = format_args!("{sid:016x}"), "session reclaimed");
            }
        }
    }
}
