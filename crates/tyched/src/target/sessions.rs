//! Sessions on the target: what it keeps per session beside the channel engine's
//! [`TargetSession`] ([`SessionState`]), their timers, channels dying, and sessions ending
//! (reclaimed once every channel is dead and nothing of theirs executes, or failed at once when
//! handling them hit a bug).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tyche_channel::{
    Channel, DeadReason, Directory, ExportGeometry, Instant, PartMessage, Pieces, TargetEvent, TargetInbound,
    TargetSession, Transmit,
};
use tyche_wire::{DisconnectReason, MacAddr, Request, Status};

use super::slots::SlotKey;
use super::{Network, PEER_LOGS};

/// A session whose channels are all dead is dropped after this grace period when it never
/// carried a frame after its handshake (`reclaim_after_ms` otherwise).
const RECLAIM_GRACE: Duration = Duration::from_millis(500);

/// A session held in parts, one per network thread (docs/architecture.md, "The session in
/// parts"): each part holds the channels of its thread's NICs and the at-most-once records of
/// the homes that joined there; a re-issued copy arriving on another thread's channel is decided
/// by its home's part. A message between parts waits in its part's inbox until that part's
/// thread delivers it in its turn ([`Parts::deliver`]), as it will when the threads own their
/// parts outright; the target-wide mail counters ([`Mail`]) say which thread has mail, so that a
/// turn looks at the sessions only when there is some, and a sleeping thread is woken for it.
/// With one network thread there is one part and no message.
#[derive(Debug)]
pub(super) struct Parts {
    /// By network thread (group).
    parts: Vec<TargetSession>,
    /// The part holding each channel index now.
    part_of: BTreeMap<u16, usize>,
    /// Messages for each part, in the order sent (so in order between any two parts). At most
    /// one per request slot of the session's channels is in flight.
    inbox: Vec<VecDeque<PartMessage>>,
    /// The target-wide count of undelivered messages per thread.
    mail: Mail,
    /// Messages between parts sent.
    messages: u64,
}

/// Undelivered messages between session parts, per network thread, target-wide.
pub(super) type Mail = Arc<Vec<AtomicUsize>>;

impl Parts {
    pub(super) fn new(id: u64, ethertype: u16, geometry: ExportGeometry, mail: &Mail) -> Parts {
        let directory = Directory::new();
        let groups = mail.len().max(1);
        let parts = (0..groups)
            .map(|g| TargetSession::part(id, ethertype, geometry, g as u32, Arc::clone(&directory)))
            .collect();
        let inbox = (0..groups).map(|_| VecDeque::new()).collect();
        Parts { parts, part_of: BTreeMap::new(), inbox, mail: Arc::clone(mail), messages: 0 }
    }

    /// Delivers part `g`'s messages (network thread `g`'s turn); whether there were any.
    pub(super) fn deliver(&mut self, g: usize) -> bool {
        let Some(q) = self.inbox.get_mut(g) else { return false };
        if q.is_empty() {
            return false;
        }
        let mail = std::mem::take(q);
        self.mail[g].fetch_sub(mail.len(), Ordering::Relaxed);
        for m in mail {
            self.parts[g].handle_message(m);
        }
        self.pump();
        true
    }

    /// Drops the undelivered messages (the session is going), keeping the mail counts true.
    fn drop_mail(&mut self) {
        for (g, q) in self.inbox.iter_mut().enumerate() {
            self.mail[g].fetch_sub(q.len(), Ordering::Relaxed);
            q.clear();
        }
    }

    /// Whether no message is undelivered and no copy waits for its home's decision (the
    /// session may be reclaimed).
    pub(super) fn settled(&self) -> bool {
        self.inbox.iter().all(VecDeque::is_empty) && self.parts.iter().all(|p| p.awaiting_decision() == 0)
    }

    pub(super) fn id(&self) -> u64 {
        self.parts[0].id()
    }

    /// Channel `i`, if any (dead ones included).
    pub(super) fn channel(&self, i: u16) -> Option<&Channel> {
        self.parts[*self.part_of.get(&i)?].channel(i)
    }

    /// Indices of the channels, dead ones included.
    pub(super) fn channel_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.part_of.keys().copied()
    }

    pub(super) fn all_dead(&self) -> bool {
        self.parts.iter().all(TargetSession::all_dead)
    }

    pub(super) fn duplicates_suppressed(&self) -> u64 {
        self.parts.iter().map(TargetSession::duplicates_suppressed).sum()
    }

    /// Copies decided by their home's part, and messages between parts.
    pub(super) fn forwarding(&self) -> (u64, u64) {
        (self.parts.iter().map(TargetSession::forwarded).sum(), self.messages)
    }

    /// Adds a channel accepted on a NIC of network thread `group` to that thread's part. An
    /// index that was held by another part leaves it (its records stay where it first joined).
    pub(super) fn add_channel(&mut self, group: usize, channel: Channel) {
        let g = group.min(self.parts.len() - 1);
        let idx = channel.envelope().channel;
        if let Some(old) = self.part_of.insert(idx, g).filter(|&old| old != g) {
            self.parts[old].abort_channel(idx);
        }
        self.parts[g].add_channel(channel);
        self.pump();
    }

    /// A received frame of channel `channel` (from its checked header), in pieces (one, or the
    /// buffers of a multi-buffer frame, the headers in the first): the channel's part takes it,
    /// whichever thread received it; write data comes back as the pieces it lies in.
    pub(super) fn handle_frame_pieces<'a>(
        &mut self,
        now: Instant,
        channel: u16,
        pieces: &[&'a [u8]],
        scratch: &'a mut Vec<u8>,
        gather: &'a mut Vec<u8>,
    ) -> TargetInbound<'a, Pieces<'a>> {
        let p = self.part_of.get(&channel).copied().unwrap_or(0);
        let r = self.parts[p].handle_frame_pieces(now, pieces, scratch, gather);
        self.pump();
        r
    }

    /// Completes a request handed out on `channel`: on the part holding the index now, or on
    /// the one it left, which still has it.
    pub(super) fn complete(&mut self, channel: u16, request: &Request, status: Status) -> bool {
        let first = self.part_of.get(&channel).copied().unwrap_or(0);
        let order = std::iter::once(first).chain((0..self.parts.len()).filter(|&p| p != first));
        let mut done = false;
        for p in order {
            if self.parts[p].complete(channel, request, status) {
                done = true;
                break;
            }
        }
        self.pump();
        done
    }

    pub(super) fn poll_event(&mut self) -> Option<TargetEvent> {
        self.parts.iter_mut().find_map(TargetSession::poll_event)
    }

    pub(super) fn close(&mut self, reason: DisconnectReason) {
        for p in &mut self.parts {
            p.close(reason);
        }
    }

    pub(super) fn poll_transmit(&mut self, now: Instant, channel: u16, buf: &mut [u8]) -> Option<Transmit> {
        let p = *self.part_of.get(&channel)?;
        let t = self.parts[p].poll_transmit(now, channel, buf);
        self.pump();
        t
    }

    pub(super) fn seal(&mut self, channel: u16, buf: &mut [u8], len: usize) -> usize {
        match self.part_of.get(&channel) {
            Some(&p) => self.parts[p].seal(channel, buf, len),
            None => len,
        }
    }

    pub(super) fn wants_transmit(&self, channel: u16) -> bool {
        self.part_of.get(&channel).is_some_and(|&p| self.parts[p].wants_transmit(channel))
    }

    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        self.parts.iter().filter_map(TargetSession::poll_timeout).min()
    }

    pub(super) fn handle_timeout(&mut self, now: Instant) {
        for p in &mut self.parts {
            if p.poll_timeout().is_some_and(|t| t <= now) {
                p.handle_timeout(now);
            }
        }
        self.pump();
    }

    /// Puts the parts' new messages in their destinations' inboxes.
    fn pump(&mut self) {
        for from in 0..self.parts.len() {
            while let Some((to, msg)) = self.parts[from].poll_message() {
                // A part only names parts of its session (the directory's, all below `groups`).
                let Some(q) = self.inbox.get_mut(to as usize) else { continue };
                q.push_back(msg);
                self.mail[to as usize].fetch_add(1, Ordering::Relaxed);
                self.messages += 1;
            }
        }
    }
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
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.session.deliver(g))) {
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
        s.session.drop_mail();
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
            let busy = s.executing.values().any(|&n| n > 0) || !s.session.settled();
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
