//! The initiator's session setup, sans-IO: which channels to open, and what each finished
//! handshake means for the volume.
//!
//! [`InitiatorSession`] wraps the [`Reconnector`] (which slot opens which channel in which
//! session, and when) and decides, for every connector that finishes, one [`Setup`] step: make
//! the volume, resume it on a new session, add a channel, close a channel nobody uses, give up
//! on a session that cannot open, or wait for the next attempt. It moves no bytes and reads no
//! clock: tyche-init's engine and the simulator both call it and act on the steps, so the
//! simulator runs the decisions the daemon runs.

use crate::handshake::{ConnectError, Connected, Connector};
use crate::reconnect::{ConnectPlan, Failed, Opened, ReconnectPolicy, Reconnector};
use crate::{Channel, DeadReason, Instant, Timers};
use tyche_wire::{MacAddr, RejectReason};

/// What to do when the session's first channel cannot be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstOpen {
    /// A refusal is final, and so is no answer on any link (each link tried once): the caller
    /// reports the [`Refusal`] (an operator's command, or a unit that systemd restarts).
    GiveUp,
    /// No answer is retried like any failed attempt (a refusal is still final): an initiator
    /// that must keep trying, such as a restarted engine behind a network partition.
    KeepTrying,
}

/// Why the session could not open (before any channel of it did).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The target has no such export.
    UnknownExport,
    /// The export wants a key this initiator lacks, or the proof failed
    /// (`AuthRequired`/`AuthFailed`; a target's CHALLENGE to a keyless connector is `AuthRequired`).
    Auth(RejectReason),
    /// Another initiator (this MAC) has the export attached.
    InUse(MacAddr),
    /// The target refused for another reason.
    Refused(RejectReason),
    /// No link answered.
    NoAnswer,
    /// The handshake itself failed ([`ConnectError::BadProof`], [`ConnectError::BadGrant`],
    /// [`ConnectError::BadChannelAddress`]).
    Handshake(ConnectError),
}

impl Refusal {
    fn of(e: ConnectError) -> Refusal {
        match e {
            ConnectError::Rejected(RejectReason::UnknownExport) => Refusal::UnknownExport,
            ConnectError::Rejected(r @ (RejectReason::AuthRequired | RejectReason::AuthFailed)) => Refusal::Auth(r),
            ConnectError::ChallengeUnsupported => Refusal::Auth(RejectReason::AuthRequired),
            ConnectError::InUse(holder) => Refusal::InUse(holder),
            ConnectError::Rejected(r) => Refusal::Refused(r),
            ConnectError::Timeout => Refusal::NoAnswer,
            other => Refusal::Handshake(other),
        }
    }
}

/// A connector the session started, while its handshake runs.
#[derive(Debug)]
pub struct Opening {
    /// The slot it opens a channel for.
    pub slot: usize,
    /// Attempts on the slot that failed in a row before this one.
    pub failures: u32,
    /// The handshake.
    pub connector: Connector,
}

/// What a finished handshake means; the caller acts on it and keeps no other setup state.
#[derive(Debug)]
pub enum Setup {
    /// The session's first channel: make the volume for the export `connected` describes, then
    /// add `channel`.
    Create {
        /// The channel opened.
        channel: Channel,
        /// The export and session as granted.
        connected: Connected,
    },
    /// The target forgot the session and a new one opened: resume the volume on
    /// `connected.session` (requests not completed are issued again), then add `channel`.
    Resume {
        /// The channel opened, the new session's first.
        channel: Channel,
        /// The export and the new session as granted now.
        connected: Connected,
        /// The export as the volume knows it (its size does not change) and the session lost.
        previous: Connected,
    },
    /// Another channel of the open session: add it.
    Join {
        /// The channel opened.
        channel: Channel,
        /// Its slot had a channel before, or attempts on it failed since.
        reopened: bool,
    },
    /// A channel nobody uses (a session since abandoned, a probe of a fenced one): close it at
    /// once ([`Channel::abandon`]) so the target lets it go.
    Abandon {
        /// The channel to close.
        channel: Channel,
    },
    /// A connect failed; the policy tries again.
    Retry {
        /// How the policy took it.
        failed: Failed,
        /// What failed.
        error: ConnectError,
    },
    /// The session cannot open: stop, and report why. Nothing is started after this.
    Fatal(Refusal),
}

/// The setup state of one initiator session (see the module doc).
#[derive(Debug)]
pub struct InitiatorSession {
    reconnector: Reconnector,
    first_open: FirstOpen,
    /// The export as the open session (or the last one) granted it.
    connected: Option<Connected>,
    /// Links in all (each tried once before [`FirstOpen::GiveUp`] gives up).
    links: usize,
    /// Links on which the first channel got no answer.
    unanswered: usize,
    refused: bool,
    /// Slots that had a channel at some time.
    ever_up: Vec<bool>,
    resumes: u64,
    reconnects: u64,
}

impl InitiatorSession {
    /// A session over one slot per entry of `slot_links` (each naming its link, `0..n`); the
    /// first attempt is due at `now`.
    pub fn new(slot_links: Vec<usize>, policy: ReconnectPolicy, first_open: FirstOpen, now: Instant) -> Self {
        let links = slot_links.iter().max().map_or(0, |m| m + 1);
        let slots = slot_links.len();
        InitiatorSession {
            reconnector: Reconnector::new(slot_links, policy, now),
            first_open,
            connected: None,
            links,
            unanswered: 0,
            refused: false,
            ever_up: vec![false; slots],
            resumes: 0,
            reconnects: 0,
        }
    }

    /// The same, for an initiator that replaces an earlier run of itself whose session
    /// `previous` must be gone first ([`Reconnector::fenced`]).
    pub fn fenced(mut self, previous: u64) -> Self {
        self.reconnector = self.reconnector.fenced(previous);
        self
    }

    /// The reconnection policy (read-only: decisions go through the session).
    pub fn reconnector(&self) -> &Reconnector {
        &self.reconnector
    }

    /// Whether a session ever opened (the volume exists).
    pub fn opened(&self) -> bool {
        self.connected.is_some()
    }

    /// Whether the session gave up ([`Setup::Fatal`]).
    pub fn refused(&self) -> bool {
        self.refused
    }

    /// The export and session as last granted (the export as first granted: its size stays).
    pub fn connected(&self) -> Option<&Connected> {
        self.connected.as_ref()
    }

    /// Times the session moved to a new one ([`Setup::Resume`]).
    pub fn resumes(&self) -> u64 {
        self.resumes
    }

    /// Channels reopened after one died or failed, and sessions resumed.
    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// The link of `slot`.
    pub fn link(&self, slot: usize) -> usize {
        self.reconnector.link(slot)
    }

    /// The next connection attempt due at `now`: the caller makes its [`Connector`] and keeps
    /// the [`Opening`] from [`InitiatorSession::opening`] until it finishes. None after a refusal.
    pub fn poll_connect(&mut self, now: Instant) -> Option<ConnectPlan> {
        if self.refused {
            return None;
        }
        self.reconnector.poll_connect(now)
    }

    /// When [`InitiatorSession::poll_connect`] next has something.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.refused {
            return None;
        }
        self.reconnector.poll_timeout()
    }

    /// The attempt `plan`, with its handshake.
    pub fn opening(plan: &ConnectPlan, connector: Connector) -> Opening {
        Opening { slot: plan.slot, failures: plan.failures, connector }
    }

    /// An open channel died; its slot reconnects. Returns the slot, if it was one of the open ones.
    pub fn channel_dead(&mut self, channel: u16, reason: DeadReason, now: Instant) -> Option<usize> {
        self.reconnector.channel_dead(channel, reason, now)
    }

    /// The handshake of `opening` (for channel index `channel`) finished with `outcome`.
    pub fn finished(
        &mut self,
        opening: &Opening,
        channel: u16,
        outcome: Result<Connected, ConnectError>,
        timers: Timers,
        now: Instant,
    ) -> Setup {
        let slot = opening.slot;
        let conn = match outcome {
            Ok(conn) => conn,
            Err(error) => return self.failed(opening, channel, error, now),
        };
        let ch = opening.connector.channel(&conn, timers, now);
        match self.reconnector.connected(slot, channel, conn.session, now) {
            Opened::First => {
                self.ever_up[slot] = true;
                self.connected = Some(conn);
                Setup::Create { channel: ch, connected: conn }
            }
            Opened::Resumed => {
                self.ever_up[slot] = true;
                let previous = self.connected.expect("a session resumes only after one opened");
                self.connected = Some(Connected { session: conn.session, ..previous });
                self.resumes += 1;
                self.reconnects += 1;
                Setup::Resume { channel: ch, connected: conn, previous }
            }
            Opened::Joined => {
                let reopened = opening.failures > 0 || std::mem::replace(&mut self.ever_up[slot], true);
                if reopened {
                    self.reconnects += 1;
                }
                Setup::Join { channel: ch, reopened }
            }
            Opened::Stale | Opened::Probe => Setup::Abandon { channel: ch },
        }
    }

    fn failed(&mut self, opening: &Opening, channel: u16, error: ConnectError, now: Instant) -> Setup {
        let fencing = self.reconnector.fencing() && error == ConnectError::Rejected(RejectReason::UnknownSession);
        if !self.opened() && !fencing {
            // The first channel: a refusal is final; no answer tries the next link (and, once
            // every link was tried, gives up if the caller asked for that).
            let answered = error != ConnectError::Timeout;
            if !answered {
                self.unanswered += 1;
            }
            let give_up = answered || (self.first_open == FirstOpen::GiveUp && self.unanswered >= self.links);
            if give_up {
                self.refused = true;
                return Setup::Fatal(Refusal::of(error));
            }
        }
        let failed = self.reconnector.failed(opening.slot, channel, error, now);
        Setup::Retry { failed, error }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::default_params;
    use crate::handshake::Connector;
    use std::time::Duration;
    use tyche_wire::{DurabilityEpoch, Envelope, DEFAULT_ETHERTYPE};

    const T0: Instant = Instant(1_000_000);

    fn connector(plan: &ConnectPlan) -> Opening {
        let env = Envelope {
            dst: MacAddr([2, 0, 0, 0, 0, 1]),
            src: MacAddr([2, 0, 0, 0, 0, 2]),
            ethertype: DEFAULT_ETHERTYPE,
            channel: plan.channel,
            session: plan.session,
        };
        let c = Connector::new(env, "vol", default_params(1024), 7, Duration::from_millis(10), 3, T0);
        InitiatorSession::opening(plan, c)
    }

    fn granted(session: u64) -> Connected {
        Connected {
            session,
            params: default_params(1024),
            export_size: 1 << 20,
            block_size: 512,
            export_flags: 0,
            durability_epoch: DurabilityEpoch::default(),
            channel_addr: MacAddr([2, 0, 0, 0, 0, 1]),
        }
    }

    fn session(links: Vec<usize>, first: FirstOpen) -> InitiatorSession {
        InitiatorSession::new(links, ReconnectPolicy::default(), first, T0)
    }

    #[test]
    fn first_channel_creates_then_the_others_join() {
        let mut s = session(vec![0, 0, 1], FirstOpen::GiveUp);
        let p = s.poll_connect(T0).expect("first");
        let o = connector(&p);
        assert!(matches!(s.finished(&o, p.channel, Ok(granted(9)), Timers::default(), T0), Setup::Create { .. }));
        assert!(s.opened());
        let mut joins = 0;
        while let Some(p) = s.poll_connect(T0) {
            let o = connector(&p);
            match s.finished(&o, p.channel, Ok(granted(9)), Timers::default(), T0) {
                Setup::Join { reopened: false, .. } => joins += 1,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!((joins, s.reconnects()), (2, 0));
    }

    #[test]
    fn a_refusal_of_the_first_channel_is_final_and_stops_every_attempt() {
        let mut s = session(vec![0, 1], FirstOpen::KeepTrying);
        let p = s.poll_connect(T0).expect("first");
        let o = connector(&p);
        let e = ConnectError::Rejected(RejectReason::UnknownExport);
        assert!(matches!(
            s.finished(&o, p.channel, Err(e), Timers::default(), T0),
            Setup::Fatal(Refusal::UnknownExport)
        ));
        assert!(s.refused());
        assert_eq!((s.poll_connect(T0 + Duration::from_secs(60)), s.poll_timeout()), (None, None));
    }

    #[test]
    fn no_answer_tries_every_link_then_gives_up_or_keeps_trying() {
        for (first, fatal_after) in [(FirstOpen::GiveUp, Some(2)), (FirstOpen::KeepTrying, None)] {
            let mut s = session(vec![0, 1], first);
            let mut now = T0;
            let mut fatal = None;
            for attempt in 1..=4 {
                let p = loop {
                    if let Some(p) = s.poll_connect(now) {
                        break p;
                    }
                    now = s.poll_timeout().expect("another attempt");
                };
                let o = connector(&p);
                match s.finished(&o, p.channel, Err(ConnectError::Timeout), Timers::default(), now) {
                    Setup::Fatal(Refusal::NoAnswer) => {
                        fatal = Some(attempt);
                        break;
                    }
                    Setup::Retry { failed: Failed::Retry, .. } => {}
                    other => panic!("{other:?}"),
                }
            }
            assert_eq!(fatal, fatal_after, "{first:?}");
        }
    }

    #[test]
    fn a_lost_session_resumes_on_a_new_one_and_keeps_the_export_size() {
        let mut s = session(vec![0], FirstOpen::GiveUp);
        let p = s.poll_connect(T0).expect("first");
        let o = connector(&p);
        let _ = s.finished(&o, p.channel, Ok(granted(9)), Timers::default(), T0);
        let ch = s.reconnector().channel(0).expect("up");
        assert_eq!(s.channel_dead(ch, DeadReason::Timeout, T0), Some(0));
        let now = s.poll_timeout().expect("reconnect");
        let p = s.poll_connect(now).expect("rejoin");
        let o = connector(&p);
        let lost = ConnectError::Rejected(RejectReason::UnknownSession);
        let setup = s.finished(&o, p.channel, Err(lost), Timers::default(), now);
        assert!(matches!(setup, Setup::Retry { failed: Failed::SessionLost, .. }), "{setup:?}");
        let p = s.poll_connect(now).expect("new session");
        assert_eq!(p.session, 0);
        let o = connector(&p);
        let bigger = Connected { export_size: 2 << 20, ..granted(10) };
        match s.finished(&o, p.channel, Ok(bigger), Timers::default(), now) {
            Setup::Resume { connected, previous, .. } => assert_eq!((connected.session, previous.session), (10, 9)),
            other => panic!("{other:?}"),
        }
        let kept = s.connected().expect("open");
        assert_eq!((kept.session, kept.export_size, s.resumes(), s.reconnects()), (10, 1 << 20, 1, 1));
    }

    #[test]
    fn a_fenced_session_still_there_is_probed_and_abandoned() {
        let mut s = session(vec![0], FirstOpen::GiveUp).fenced(5);
        let p = s.poll_connect(T0).expect("probe");
        assert_eq!(p.session, 5);
        let o = connector(&p);
        assert!(matches!(s.finished(&o, p.channel, Ok(granted(5)), Timers::default(), T0), Setup::Abandon { .. }));
        let now = s.poll_timeout().expect("probe again");
        let p = s.poll_connect(now).expect("probe");
        let o = connector(&p);
        let gone = ConnectError::Rejected(RejectReason::UnknownSession);
        let setup = s.finished(&o, p.channel, Err(gone), Timers::default(), now);
        assert!(matches!(setup, Setup::Retry { failed: Failed::Retry, .. }), "the fence lifts: {setup:?}");
        let p = s.poll_connect(now).expect("create");
        assert_eq!(p.session, 0);
    }
}
