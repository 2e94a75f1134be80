//! The target's side of the handshake, sans-IO: what a DISCOVER or CONNECT gets, and the
//! sessions it made, as tyched's control and the simulator run it.
//!
//! In front of the [`Acceptor`] (the limits, the grants, the ACCEPT), [`Admission::admit`] checks
//! a CONNECT against its export's access rules ([`ExportAccess`]):
//! - the export's MAC allow-list;
//! - its key: a CHALLENGE round ([`Challenges`]), the initiator's proof checked against the
//!   challenge it answers, a retry of a granted CONNECT answered with its ACCEPT again;
//! - who may join an existing session: one created with a host id takes channels only from
//!   that host, and a live channel is replaced only from its own MAC (a reconnect), so a peer
//!   that read a session id off the wire cannot take it over;
//! - who holds an export that is not `shared`: another initiator's new session is refused
//!   IN_USE; the same initiator's new session fences its older ones.
//!
//! [`Admission::accept`] runs the acceptor on what was admitted, and [`Admission::join`] records
//! the channel it granted in its session (made, and the older sessions fenced, when it is new).
//! The caller keeps what only it has with each session (`S`) and channel (`C`): tyched its
//! threads' shared state, the simulator nothing.

use std::collections::BTreeMap;

use tyche_wire::{Challenge, Envelope, MacAddr, Message, Reject, RejectReason};

use crate::auth::Psk;
use crate::{Accepted, Acceptor, Challenges, HandshakeFrame, Instant, KeyCheck, KeyedConnect};

/// Who may use an export ([`Admission::admit`]).
#[derive(Debug, Clone, Copy)]
pub struct ExportAccess<'a> {
    /// Its index among the acceptor's exports.
    pub index: usize,
    /// The initiator MACs allowed (empty: any).
    pub allow: &'a [MacAddr],
    /// Its pre-shared key, if keyed.
    pub key: Option<&'a Psk>,
    /// Whether several initiators may attach it at once.
    pub shared: bool,
}

/// Why a CONNECT was refused by [`Admission::admit`] (the REJECT is in the buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The initiator's MAC is not on the export's allow-list (NOT_ALLOWED).
    MacNotAllowed,
    /// A wrong or replayed key proof (AUTH_FAILED).
    KeyFailed,
    /// A join of a session from another host, or a takeover of a live channel from another MAC
    /// (NOT_ALLOWED).
    NotJoinable,
    /// Another initiator (this MAC) holds the export, which is not shared (IN_USE).
    InUse(MacAddr),
}

/// What the checks of [`Admission::admit`] let through to the acceptor.
#[derive(Debug, Clone, Default)]
pub struct Admitted {
    /// A keyed export's CONNECT whose proof checked out: the key and the challenge's nonce.
    keyed: Option<(Psk, u64)>,
    /// The initiator's identity (a CONNECT of a known export).
    identity: Option<[u8; 16]>,
    /// The sessions of the same initiator that a new session fences.
    fence: Vec<u64>,
}

/// What [`Admission::admit`] decided about a handshake frame.
#[derive(Debug)]
pub enum Verdict {
    /// Go on to the acceptor ([`Admission::accept`]).
    Admit(Admitted),
    /// Answered here: send the `len` bytes written into the buffer (a CHALLENGE, a REJECT, or
    /// the ACCEPT of a granted CONNECT's retry). `refused` says why a REJECT was sent.
    Answer {
        /// Bytes in the buffer.
        len: usize,
        /// The refusal, for a REJECT.
        refused: Option<Refused>,
    },
    /// No answer: the challenge table is full of live challenges ([`Challenges::refused`]).
    Quiet,
}

/// One channel of a session as the admission knows it.
#[derive(Debug)]
pub struct HeldChannel<C> {
    /// The initiator's MAC.
    pub peer: MacAddr,
    /// What the caller keeps with it.
    pub data: C,
}

/// A session as the admission knows it.
#[derive(Debug)]
pub struct Holder<S, C> {
    /// Its export (index).
    pub export: usize,
    /// Who attached: the host id the initiator sent, else one made from its MAC
    /// ([`mac_identity`]).
    pub identity: [u8; 16],
    /// The MAC that created it (named to another initiator refused IN_USE).
    pub mac: MacAddr,
    /// Fenced by a newer session of the same initiator.
    fenced: bool,
    /// By channel index.
    pub channels: BTreeMap<u16, HeldChannel<C>>,
    /// What the caller keeps with it.
    pub data: S,
}

impl<S, C> Holder<S, C> {
    /// Whether a newer session of the same initiator fenced it.
    pub fn is_fenced(&self) -> bool {
        self.fenced
    }
}

/// A channel the acceptor granted ([`Accepted::Channel`]), for [`Admission::join`].
#[derive(Debug, Clone, Copy)]
pub struct Grant {
    /// Its session.
    pub session: u64,
    /// The session's export (index).
    pub export: usize,
    /// Its index.
    pub channel: u16,
    /// The initiator's MAC.
    pub peer: MacAddr,
}

/// What [`Admission::join`] did.
#[derive(Debug)]
pub struct Joined<C> {
    /// The session is new.
    pub created: bool,
    /// The older sessions of the same initiator it fenced (new sessions only). The caller stops
    /// their storage jobs and runs none of the new session's until theirs have ended.
    pub fenced: Vec<u64>,
    /// The channel the new one replaced on its index (a reconnect).
    pub replaced: Option<C>,
}

/// The identity of an initiator that sent no host id: its MAC, marked as such.
pub fn mac_identity(mac: MacAddr) -> [u8; 16] {
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(b"mac:");
    id[4..10].copy_from_slice(&mac.octets());
    id
}

/// The target's handshake: the acceptor, the key challenges, and the sessions it made (see the
/// module documentation).
#[derive(Debug)]
pub struct Admission<S, C> {
    /// The acceptor (limits, grants, ACCEPTs).
    pub acceptor: Acceptor,
    /// Key challenges pending.
    pub challenges: Challenges,
    sessions: BTreeMap<u64, Holder<S, C>>,
}

impl<S, C> Admission<S, C> {
    /// An admission in front of `acceptor`, with `challenges` for keyed exports.
    pub fn new(acceptor: Acceptor, challenges: Challenges) -> Self {
        Admission { acceptor, challenges, sessions: BTreeMap::new() }
    }

    /// The sessions, by id.
    pub fn sessions(&self) -> &BTreeMap<u64, Holder<S, C>> {
        &self.sessions
    }

    /// Session `sid`.
    pub fn session(&self, sid: u64) -> Option<&Holder<S, C>> {
        self.sessions.get(&sid)
    }

    /// Session `sid`, to change what the caller keeps with it.
    pub fn session_mut(&mut self, sid: u64) -> Option<&mut Holder<S, C>> {
        self.sessions.get_mut(&sid)
    }

    /// Forgets session `sid` (reclaimed, or failed): the acceptor too.
    pub fn forget(&mut self, sid: u64) -> Option<Holder<S, C>> {
        self.acceptor.forget_session(sid);
        self.sessions.remove(&sid)
    }

    /// The checks of a handshake frame before the acceptor sees it. A DISCOVER, and a CONNECT
    /// of an export the target does not have (`access` is `None`), go through (the acceptor
    /// answers them). Replies are written into `buf`; `random` makes target nonces; `live`
    /// says whether a channel of a session is alive.
    pub fn admit(
        &mut self,
        now: Instant,
        frame: HandshakeFrame<'_>,
        access: Option<ExportAccess<'_>>,
        mut random: impl FnMut() -> u64,
        live: impl Fn(&C) -> bool,
        buf: &mut [u8],
    ) -> Verdict {
        let (Message::Connect(c), Some(access)) = (frame.msg, access) else {
            return Verdict::Admit(Admitted::default());
        };
        let src = frame.src;
        if !access.allow.is_empty() && !access.allow.contains(&src) {
            return self.refuse(frame, RejectReason::NotAllowed, Refused::MacNotAllowed, buf);
        }
        let mut keyed = None;
        if let Some(key) = access.key {
            let retry = c.proof.is_some() && self.acceptor.is_retry(src, frame.env, c);
            match self.challenges.check(now, key, frame, retry, &mut random) {
                KeyCheck::Challenge(tn) => {
                    let env = self.reply_env(frame, frame.env.session);
                    let len = Message::Challenge(Challenge { nonce: c.nonce, target_nonce: tn }).emit(&env, buf);
                    return Verdict::Answer { len, refused: None };
                }
                KeyCheck::NoRoom => return Verdict::Quiet,
                KeyCheck::Retry => {
                    // A retry of a CONNECT that was granted (its ACCEPT lost): the same ACCEPT,
                    // nothing else.
                    let len = match self.acceptor.handle_keyed(now, frame, &mut random, buf, None) {
                        Some(Accepted::Reply(len)) => len,
                        _ => return Verdict::Quiet,
                    };
                    return Verdict::Answer { len, refused: None };
                }
                KeyCheck::Proven(tn) => keyed = Some((key.clone(), tn)),
                KeyCheck::Failed => return self.refuse(frame, RejectReason::AuthFailed, Refused::KeyFailed, buf),
            }
        }
        let identity = c.host.unwrap_or_else(|| mac_identity(src));
        if !self.may_join(frame, c.host, live) {
            return self.refuse(frame, RejectReason::NotAllowed, Refused::NotJoinable, buf);
        }
        // One initiator at a time (unless shared); the same initiator again fences its old
        // sessions. Only for a CONNECT that creates a session (not a retransmitted one), and
        // only once it passed the MAC and key checks.
        let mut fence = Vec::new();
        if frame.env.session == 0 && self.acceptor.created_by(src, c.nonce).is_none() {
            let others = self.sessions.iter().filter(|(_, s)| s.export == access.index && !s.fenced);
            if let (false, Some((_, holder))) = (access.shared, others.clone().find(|(_, s)| s.identity != identity)) {
                let holder = holder.mac;
                let env = self.reply_env(frame, 0);
                let len = Message::Reject(Reject { nonce: c.nonce, reason: RejectReason::InUse, holder: Some(holder) })
                    .emit(&env, buf);
                return Verdict::Answer { len, refused: Some(Refused::InUse(holder)) };
            }
            fence = others.filter(|(_, s)| s.identity == identity).map(|(&sid, _)| sid).collect();
        }
        Verdict::Admit(Admitted { keyed, identity: Some(identity), fence })
    }

    /// Whether a CONNECT (from `frame.src`, with host id `host`) may join the session it names,
    /// if that exists.
    fn may_join(&self, frame: HandshakeFrame<'_>, host: Option<[u8; 16]>, live: impl Fn(&C) -> bool) -> bool {
        let Some(s) = self.sessions.get(&frame.env.session) else { return true };
        let wrong_host = !s.identity.starts_with(b"mac:") && host != Some(s.identity);
        let live_elsewhere =
            s.channels.get(&frame.env.channel).is_some_and(|ch| ch.peer != frame.src && live(&ch.data));
        !(wrong_host || live_elsewhere)
    }

    /// The addressing of a reply to `frame` naming session `session`.
    fn reply_env(&self, frame: HandshakeFrame<'_>, session: u64) -> Envelope {
        Envelope {
            dst: frame.src,
            src: frame.local,
            ethertype: self.acceptor.ethertype(),
            channel: frame.env.channel,
            session,
        }
    }

    /// A REJECT of the CONNECT in `frame` for `reason`.
    fn refuse(&self, frame: HandshakeFrame<'_>, reason: RejectReason, why: Refused, buf: &mut [u8]) -> Verdict {
        let Message::Connect(c) = frame.msg else { unreachable!("refuse is called for CONNECTs") };
        let env = self.reply_env(frame, 0);
        let len = Message::Reject(Reject { nonce: c.nonce, reason, holder: None }).emit(&env, buf);
        Verdict::Answer { len, refused: Some(why) }
    }

    /// The acceptor's answer to a DISCOVER or an admitted CONNECT (`admitted`): a reply, or a
    /// new channel (and perhaps session) and its ACCEPT, whose channel is addressed
    /// `channel_addr` ([`Acceptor::handle_steered`]). A keyed grant spends its challenge.
    pub fn accept(
        &mut self,
        now: Instant,
        frame: HandshakeFrame<'_>,
        admitted: &Admitted,
        channel_addr: MacAddr,
        new_session_id: &mut dyn FnMut() -> u64,
        buf: &mut [u8],
    ) -> Option<Accepted> {
        let keyed = admitted.keyed.as_ref().map(|(key, tn)| KeyedConnect { key, target_nonce: *tn });
        let accepted = self.acceptor.handle_steered(now, frame, channel_addr, new_session_id, buf, keyed);
        if let (Some(Accepted::Channel { .. }), Some(_), Message::Connect(c)) = (&accepted, keyed, frame.msg) {
            self.challenges.granted(frame.src, c.nonce); // spent by its grant
        }
        accepted
    }

    /// Records the channel `grant` names, granted by [`Admission::accept`] on what `admitted`
    /// let through, in its session: when the session is new it is made with `new_session()`
    /// and fences the older sessions of the same initiator. `data` is kept with the channel.
    pub fn join(&mut self, grant: Grant, admitted: Admitted, new_session: impl FnOnce() -> S, data: C) -> Joined<C> {
        let Grant { session, export, channel, peer } = grant;
        let created = !self.sessions.contains_key(&session);
        let mut fenced = Vec::new();
        if created {
            for old in admitted.fence {
                if let Some(o) = self.sessions.get_mut(&old).filter(|o| !o.fenced) {
                    o.fenced = true;
                    fenced.push(old);
                }
            }
            let holder = Holder {
                export,
                identity: admitted.identity.unwrap_or_else(|| mac_identity(peer)),
                mac: peer,
                fenced: false,
                channels: BTreeMap::new(),
                data: new_session(),
            };
            self.sessions.insert(session, holder);
        }
        let s = self.sessions.get_mut(&session).expect("made above");
        let replaced = s.channels.insert(channel, HeldChannel { peer, data }).map(|old| old.data);
        Joined { created, fenced, replaced }
    }
}
