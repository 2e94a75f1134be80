//! The initiator's reconnection policy, sans-IO: which channel to open next, in which session,
//! and when. The caller runs the [`Connector`](crate::Connector)s and the [`Volume`]; this
//! decides.
//!
//! - A volume wants a fixed set of channels (*slots*), each on one link. A slot is waiting, has
//!   a connector running (under a channel index this module hands out), or is up.
//! - While there is no session (at the start, or after the target answered UNKNOWN_SESSION:
//!   it restarted, or reclaimed the session), one connector at a time opens a new session
//!   (session 0 in CONNECT), trying the links in turn: the next link at once, and after every
//!   link has failed once, after a backoff. The other slots join once it is open.
//! - A dead channel's slot reconnects after [`ReconnectPolicy::min`], at once when the target
//!   said it is shutting down (DISCONNECT SHUTDOWN); a failed attempt waits twice as long as
//!   the one before, up to [`ReconnectPolicy::max`]. There is no attempt limit: a link that
//!   comes back after any time is used again.
//!
//! [`Volume`]: crate::Volume

use std::time::Duration;

use tyche_wire::{DisconnectReason, RejectReason};

use crate::channel::DeadReason;
use crate::handshake::ConnectError;
use crate::time::{earliest, Instant};

/// Backoff between attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Wait before the first reconnection attempt, and after the first failure.
    pub min: Duration,
    /// Longest wait between attempts (the doubling stops here).
    pub max: Duration,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy { min: Duration::from_millis(50), max: Duration::from_secs(2) }
    }
}

impl ReconnectPolicy {
    /// The wait after `failures` failed attempts in a row (0: the first attempt).
    pub fn backoff(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(30);
        if failures == 0 {
            return self.min;
        }
        self.min.saturating_mul(1 << shift).min(self.max).max(self.min)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// Start a connector at `at`; `failures` attempts have failed in a row.
    Waiting { failures: u32, at: Instant },
    /// A connector runs under channel index `channel` for session `session` (0: a new one).
    Connecting { channel: u16, session: u64, failures: u32 },
    /// The channel is open.
    Up { channel: u16 },
}

/// A connector to start: open channel `channel` on slot `slot`'s link, in session `session`
/// (0: create a new session).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectPlan {
    /// Slot (the caller's index: link × channels per link).
    pub slot: usize,
    /// Channel index for the CONNECT.
    pub channel: u16,
    /// Session to join; 0 creates one.
    pub session: u64,
    /// Attempts on this slot that failed in a row before this one (0: the first).
    pub failures: u32,
}

/// What an ACCEPT means for the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// The first session: create the volume, then add the channel.
    First,
    /// A new session after the target forgot the old one: call
    /// [`Volume::resume`](crate::Volume::resume), then add the channel.
    Resumed,
    /// A channel of the current session: add it.
    Joined,
    /// A connector the policy no longer waits for (a session since abandoned, a slot since
    /// restarted): do not use the channel.
    Stale,
    /// The fenced session ([`Reconnector::fenced`]) still exists on the target: close the
    /// channel at once (DISCONNECT) and do not use it; the policy asks again later.
    Probe,
}

/// What a failed connector means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failed {
    /// The slot tries again later.
    Retry,
    /// The target no longer knows the session: every slot waits for a new session, which the
    /// next [`Reconnector::poll_connect`] starts opening. The volume's channels of the old
    /// session are of no use any more.
    SessionLost,
    /// A connector the policy no longer waits for.
    Stale,
}

/// The reconnection policy of one volume (see the module doc).
#[derive(Debug)]
pub struct Reconnector {
    policy: ReconnectPolicy,
    /// The link of each slot.
    links: Vec<usize>,
    link_count: usize,
    slots: Vec<SlotState>,
    /// The current session; 0 while none is open.
    session: u64,
    /// Whether a session was ever open.
    opened: bool,
    /// The slot whose connector is creating a session.
    creator: Option<usize>,
    /// Failed attempts to create a session since the last one opened.
    create_failures: u32,
    /// The link the next attempt to create a session uses.
    create_link: usize,
    /// When the next attempt to create a session may start.
    create_at: Instant,
    next_channel: u16,
    /// Per slot, the index of its last attempt that opened nothing the volume uses: the next
    /// attempt on the slot takes it again (a target that granted it replaces that channel),
    /// so a link that stays down for days does not use up the index space.
    spare: Vec<Option<u16>>,
    /// Sessions lost (UNKNOWN_SESSION answers that started a new session).
    sessions_lost: u64,
    /// A session of an earlier run that must be gone before a new one is created.
    fence: Option<u64>,
}

impl Reconnector {
    /// A policy for one slot per entry of `links` (each naming the slot's link, `0..n`); no
    /// session is open yet, and the first attempt (on the first slot of link 0) is due now.
    pub fn new(links: Vec<usize>, policy: ReconnectPolicy, now: Instant) -> Self {
        assert!(!links.is_empty(), "a volume wants at least one channel");
        let link_count = links.iter().max().map_or(0, |m| m + 1);
        let slots_len = links.len();
        let slots = vec![SlotState::Waiting { failures: 0, at: now }; slots_len];
        Reconnector {
            policy,
            links,
            link_count,
            slots,
            session: 0,
            opened: false,
            creator: None,
            create_failures: 0,
            create_link: 0,
            create_at: now,
            next_channel: 0,
            spare: vec![None; slots_len],
            sessions_lost: 0,
            fence: None,
        }
    }

    /// The same policy for an initiator that replaces an earlier run of itself (a restarted
    /// engine) whose session `previous` may still have requests in the network or executing
    /// on the target: before it creates a session, it asks to join `previous` until the target
    /// answers UNKNOWN_SESSION. A target forgets a session only once none of its requests
    /// executes (and a restarted target has none), so from then on no write of the earlier
    /// run can land after one of this run. A join that is accepted is [`Opened::Probe`].
    pub fn fenced(mut self, previous: u64) -> Self {
        if previous != 0 {
            self.fence = Some(previous);
        }
        self
    }

    /// Whether the policy still waits for the target to forget a fenced session.
    pub fn fencing(&self) -> bool {
        self.fence.is_some()
    }

    /// The session open now (0: none).
    pub fn session(&self) -> u64 {
        self.session
    }
    /// Times the target forgot the session and a new one was started.
    pub fn sessions_lost(&self) -> u64 {
        self.sessions_lost
    }
    /// The channel open on `slot`, if any.
    pub fn channel(&self, slot: usize) -> Option<u16> {
        match self.slots[slot] {
            SlotState::Up { channel } => Some(channel),
            _ => None,
        }
    }
    /// The slot whose open channel is `channel`.
    pub fn slot_of(&self, channel: u16) -> Option<usize> {
        self.slots.iter().position(|s| *s == SlotState::Up { channel })
    }
    /// The slot whose connector runs under `channel`.
    pub fn connecting_slot(&self, channel: u16) -> Option<usize> {
        self.slots.iter().position(|s| matches!(*s, SlotState::Connecting { channel: c, .. } if c == channel))
    }
    /// The link of `slot`.
    pub fn link(&self, slot: usize) -> usize {
        self.links[slot]
    }
    /// Whether a session is being created (no session is open).
    pub fn creating(&self) -> bool {
        self.session == 0
    }

    fn alloc_channel(&mut self, slot: usize) -> u16 {
        if let Some(c) = self.spare[slot].take() {
            return c;
        }
        let c = self.next_channel;
        self.next_channel = self.next_channel.wrapping_add(1);
        c
    }

    /// The next connector to start, if one is due at `now`.
    pub fn poll_connect(&mut self, now: Instant) -> Option<ConnectPlan> {
        if self.session == 0 {
            if self.creator.is_some() || now < self.create_at {
                return None;
            }
            let link = self.create_link;
            let slot = (0..self.slots.len()).find(|&s| self.links[s] == link).unwrap_or(0);
            let channel = self.alloc_channel(slot);
            let failures = self.create_failures;
            let session = self.fence.unwrap_or(0);
            self.slots[slot] = SlotState::Connecting { channel, session, failures };
            self.creator = Some(slot);
            return Some(ConnectPlan { slot, channel, session, failures });
        }
        let slot =
            (0..self.slots.len()).find(|&s| matches!(self.slots[s], SlotState::Waiting { at, .. } if at <= now))?;
        let SlotState::Waiting { failures, .. } = self.slots[slot] else { unreachable!("found waiting") };
        let channel = self.alloc_channel(slot);
        self.slots[slot] = SlotState::Connecting { channel, session: self.session, failures };
        Some(ConnectPlan { slot, channel, session: self.session, failures })
    }

    /// When [`Reconnector::poll_connect`] next has something.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.session == 0 {
            return self.creator.is_none().then_some(self.create_at);
        }
        self.slots.iter().fold(None, |t, s| match *s {
            SlotState::Waiting { at, .. } => earliest(t, Some(at)),
            _ => t,
        })
    }

    fn connecting(&self, slot: usize, channel: u16) -> Option<(u64, u32)> {
        match self.slots.get(slot).copied() {
            Some(SlotState::Connecting { channel: c, session, failures }) if c == channel => Some((session, failures)),
            _ => None,
        }
    }

    /// Channel `channel` of `slot` was accepted in session `session`.
    pub fn connected(&mut self, slot: usize, channel: u16, session: u64, now: Instant) -> Opened {
        let Some((asked, _)) = self.connecting(slot, channel) else { return Opened::Stale };
        if self.creator == Some(slot) && self.fence.is_some_and(|f| f == asked) {
            // The earlier run's session is still there: ask again after a while.
            self.spare[slot] = Some(channel);
            self.creator = None;
            self.create_failures += 1;
            self.create_at = now + self.policy.backoff(self.create_failures);
            self.slots[slot] = SlotState::Waiting { failures: 0, at: now };
            return Opened::Probe;
        }
        if self.creator != Some(slot) {
            if asked != self.session || session != asked {
                self.slots[slot] = SlotState::Waiting { failures: 0, at: now };
                return Opened::Stale;
            }
            self.slots[slot] = SlotState::Up { channel };
            return Opened::Joined;
        }
        // A new session: every other slot joins it now.
        self.creator = None;
        self.create_failures = 0;
        self.session = session;
        for (s, state) in self.slots.iter_mut().enumerate() {
            *state = if s == slot { SlotState::Up { channel } } else { SlotState::Waiting { failures: 0, at: now } };
        }
        if std::mem::replace(&mut self.opened, true) {
            Opened::Resumed
        } else {
            Opened::First
        }
    }

    /// The connector of channel `channel` on `slot` failed with `error`.
    pub fn failed(&mut self, slot: usize, channel: u16, error: ConnectError, now: Instant) -> Failed {
        let Some((asked, failures)) = self.connecting(slot, channel) else { return Failed::Stale };
        self.spare[slot] = Some(channel);
        if self.creator == Some(slot)
            && self.fence == Some(asked)
            && error == ConnectError::Rejected(RejectReason::UnknownSession)
        {
            // The earlier run's session is gone: create ours, here and now.
            self.fence = None;
            self.creator = None;
            self.create_failures = 0;
            self.create_link = self.links[slot];
            self.create_at = now;
            self.slots[slot] = SlotState::Waiting { failures: 0, at: now };
            return Failed::Retry;
        }
        if self.creator == Some(slot) {
            // Creating a session failed: the next link at once, and after every link has been
            // tried, after a backoff.
            self.creator = None;
            self.create_failures += 1;
            self.create_link = (self.links[slot] + 1) % self.link_count.max(1);
            let wait = if self.create_failures % self.link_count.max(1) as u32 != 0 {
                Duration::ZERO
            } else {
                self.policy.backoff(self.create_failures / self.link_count.max(1) as u32)
            };
            self.create_at = now + wait;
            self.slots[slot] = SlotState::Waiting { failures: failures + 1, at: now };
            return Failed::Retry;
        }
        if asked != self.session {
            self.slots[slot] = SlotState::Waiting { failures: 0, at: now };
            return Failed::Stale;
        }
        if error == ConnectError::Rejected(RejectReason::UnknownSession) {
            // The target restarted or reclaimed the session. This link reached it: the new
            // session is created here, at once.
            self.session = 0;
            self.sessions_lost += 1;
            self.creator = None;
            self.create_failures = 0;
            self.create_link = self.links[slot];
            self.create_at = now;
            for s in self.slots.iter_mut() {
                *s = SlotState::Waiting { failures: 0, at: now };
            }
            return Failed::SessionLost;
        }
        let failures = failures + 1;
        self.slots[slot] = SlotState::Waiting { failures, at: now + self.policy.backoff(failures) };
        Failed::Retry
    }

    /// Channel `channel` died; its slot reconnects (at once after a target's SHUTDOWN).
    /// Returns the slot, if the channel was one of the open ones.
    pub fn channel_dead(&mut self, channel: u16, reason: DeadReason, now: Instant) -> Option<usize> {
        let slot = self.slot_of(channel)?;
        let wait = match reason {
            DeadReason::PeerClosed(DisconnectReason::Shutdown) => Duration::ZERO,
            _ => self.policy.min,
        };
        self.slots[slot] = SlotState::Waiting { failures: 0, at: now + wait };
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Instant = Instant(1_000_000);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn backoff_doubles_to_its_cap() {
        let p = ReconnectPolicy::default();
        let waits: Vec<_> = (0..9).map(|f| p.backoff(f)).collect();
        assert_eq!(waits[..7], [ms(50), ms(50), ms(100), ms(200), ms(400), ms(800), ms(1600)]);
        assert_eq!(waits[7], ms(2000));
        assert_eq!(p.backoff(u32::MAX), ms(2000));
    }

    #[test]
    fn one_creator_then_every_slot_joins() {
        let mut r = Reconnector::new(vec![0, 0, 1, 1], ReconnectPolicy::default(), T0);
        let c = r.poll_connect(T0).expect("creator");
        assert_eq!((c.slot, c.session), (0, 0));
        assert_eq!(r.poll_connect(T0), None, "one session is created at a time");
        assert_eq!(r.connected(c.slot, c.channel, 77, T0), Opened::First);
        let mut joined = Vec::new();
        while let Some(p) = r.poll_connect(T0) {
            assert_eq!(p.session, 77);
            joined.push(p);
        }
        assert_eq!(joined.iter().map(|p| p.slot).collect::<Vec<_>>(), [1, 2, 3]);
        for p in joined {
            assert_eq!(r.connected(p.slot, p.channel, 77, T0), Opened::Joined);
        }
        assert!((0..4).all(|s| r.channel(s).is_some()));
    }

    #[test]
    fn creating_tries_each_link_then_backs_off() {
        let mut r = Reconnector::new(vec![0, 1], ReconnectPolicy::default(), T0);
        let a = r.poll_connect(T0).expect("link 0");
        r.failed(a.slot, a.channel, ConnectError::Timeout, T0);
        let b = r.poll_connect(T0).expect("link 1 at once");
        assert_eq!(r.link(b.slot), 1);
        r.failed(b.slot, b.channel, ConnectError::Timeout, T0);
        assert_eq!(r.poll_connect(T0), None, "every link failed: back off");
        assert_eq!(r.poll_timeout(), Some(T0 + ms(50)));
        let c = r.poll_connect(T0 + ms(50)).expect("link 0 again");
        assert_eq!(r.link(c.slot), 0);
    }

    #[test]
    fn unknown_session_starts_a_new_one_and_abandons_the_old() {
        let mut r = Reconnector::new(vec![0, 1], ReconnectPolicy::default(), T0);
        let a = r.poll_connect(T0).expect("creator");
        r.connected(a.slot, a.channel, 5, T0);
        let b = r.poll_connect(T0).expect("join");
        r.connected(b.slot, b.channel, 5, T0);
        // Target restarts: both channels die; link 1 reconnects first and learns the news.
        let shut = DeadReason::PeerClosed(DisconnectReason::Shutdown);
        assert_eq!(r.channel_dead(r.channel(0).expect("up"), shut, T0), Some(0));
        assert_eq!(r.channel_dead(r.channel(1).expect("up"), DeadReason::Timeout, T0), Some(1));
        let x = r.poll_connect(T0).expect("slot 0 at once after SHUTDOWN");
        assert_eq!((x.slot, x.session), (0, 5));
        assert_eq!(r.poll_connect(T0), None);
        let y = r.poll_connect(T0 + ms(50)).expect("slot 1 after the minimum wait");
        assert_eq!(
            r.failed(y.slot, y.channel, ConnectError::Rejected(RejectReason::UnknownSession), T0),
            Failed::SessionLost
        );
        let n = r.poll_connect(T0).expect("a new session, on the link that reached the target");
        assert_eq!((n.slot, n.session), (1, 0));
        // The old session's connector answers late: not used.
        assert_eq!(r.connected(x.slot, x.channel, 5, T0), Opened::Stale);
        assert_eq!(r.connected(n.slot, n.channel, 9, T0), Opened::Resumed);
        let j = r.poll_connect(T0).expect("slot 0 joins the new session");
        assert_eq!((j.slot, j.session), (0, 9));
        assert_eq!(r.sessions_lost(), 1);
    }

    #[test]
    fn a_fenced_session_must_be_gone_before_a_new_one_is_created() {
        let mut r = Reconnector::new(vec![0, 1], ReconnectPolicy::default(), T0).fenced(5);
        assert!(r.fencing());
        let p = r.poll_connect(T0).expect("probe");
        assert_eq!(p.session, 5);
        assert_eq!(r.connected(p.slot, p.channel, 5, T0), Opened::Probe);
        assert_eq!(r.poll_connect(T0), None, "asks again after a backoff");
        let t = r.poll_timeout().expect("again");
        let q = r.poll_connect(t).expect("second probe");
        assert_eq!(q.session, 5);
        let unknown = ConnectError::Rejected(RejectReason::UnknownSession);
        assert_eq!(r.failed(q.slot, q.channel, unknown, t), Failed::Retry);
        assert!(!r.fencing());
        let c = r.poll_connect(t).expect("create now");
        assert_eq!(c.session, 0);
        assert_eq!(r.connected(c.slot, c.channel, 8, t), Opened::First);
    }

    #[test]
    fn failed_joins_back_off_without_limit() {
        let mut r = Reconnector::new(vec![0], ReconnectPolicy::default(), T0);
        let a = r.poll_connect(T0).expect("creator");
        r.connected(a.slot, a.channel, 5, T0);
        r.channel_dead(a.channel, DeadReason::Timeout, T0);
        let mut now = T0;
        let mut index = None;
        for i in 0..100u32 {
            now = r.poll_timeout().expect("always another attempt");
            let p = r.poll_connect(now).expect("due");
            assert_eq!(p.failures, i);
            assert_eq!(*index.get_or_insert(p.channel), p.channel, "failed attempts reuse their index");
            assert_eq!(r.failed(p.slot, p.channel, ConnectError::Timeout, now), Failed::Retry);
        }
        assert_eq!(r.poll_timeout(), Some(now + ms(2000)));
    }
}
