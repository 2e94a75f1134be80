//! Opening channels: CONNECT with retries on the initiator, ACCEPT/REJECT and discovery on the
//! target. Key proofs (CHALLENGE) belong to the target daemon; an export that needs a key is
//! refused here with `AuthRequired`.

use std::collections::HashMap;
use std::time::Duration;

use tyche_wire::{
    flags, Accept, ChannelParams, Connect, DiscoverReply, DurabilityEpoch, Envelope, ExportInfo, ExportList, MacAddr,
    Message, Reject, RejectReason,
};

use crate::channel::{Channel, Role};
use crate::config::{negotiate, params_supported, Timers};
use crate::time::Instant;

/// What the initiator learned from ACCEPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connected {
    /// Session id (new or joined).
    pub session: u64,
    /// Granted parameters.
    pub params: ChannelParams,
    /// Export size in bytes.
    pub export_size: u64,
    /// Export logical block size.
    pub block_size: u32,
    /// `flags::EXPORT_*`.
    pub export_flags: u16,
    /// The export's durability epoch: writes acknowledged on this session survive as long as
    /// the target presents it again ([`DurabilityEpoch`]).
    pub durability_epoch: DurabilityEpoch,
    /// The channel's target address: where its frames go and whom they are accepted from. The
    /// address the CONNECT went to unless the ACCEPT named another (`CHANNEL_MAC`: a target
    /// that steers each channel to a NIC queue of its own by destination MAC).
    pub channel_addr: MacAddr,
}

/// Why a channel could not be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectError {
    /// The target refused.
    Rejected(RejectReason),
    /// No answer after every attempt.
    Timeout,
    /// The target granted parameters this implementation cannot use, or more than asked.
    BadGrant,
    /// The target asked for a key proof and this connector has no key.
    ChallengeUnsupported,
    /// The target's proof of the key in ACCEPT was missing or wrong (see [`Connector::with_key`]).
    BadProof,
    /// Another initiator, with this MAC, has the export attached (REJECT IN_USE).
    InUse(MacAddr),
    /// The ACCEPT named a group (multicast or broadcast) address as the channel's target
    /// address (`CHANNEL_MAC`): a protocol error of this channel, which is not opened.
    BadChannelAddress(MacAddr),
}

/// Fresh key rounds a [`Connector`] starts after an AUTH_FAILED answer to its proof. The target
/// spends a challenge when it grants the proof and forgets its challenges when it restarts, so a
/// retransmitted proof (its ACCEPT lost) can find no challenge after a restart: AUTH_FAILED
/// although the key is right. The connector then asks again under a new nonce and proves the
/// key against a new challenge; a wrong key fails that round too, and is final.
pub const FRESH_KEY_ROUNDS: u32 = 1;

/// Opens one channel (initiator side): sends CONNECT until ACCEPT or REJECT arrives.
#[derive(Debug)]
pub struct Connector {
    env: Envelope,
    export: String,
    want: ChannelParams,
    nonce: u64,
    retry: Duration,
    attempts_left: u32,
    next_send: Instant,
    outcome: Option<Result<Connected, ConnectError>>,
    key: Option<crate::auth::Psk>,
    /// The target nonce of the CHALLENGE answered, once one arrived.
    challenge: Option<u64>,
    /// This initiator's host id, sent in CONNECT.
    host: Option<[u8; 16]>,
    /// The target's proof in the ACCEPT, once verified: the salt of the channel's keys.
    target_proof: Option<[u8; 32]>,
    /// Key rounds left to start again ([`FRESH_KEY_ROUNDS`]).
    fresh_rounds: u32,
}

impl Connector {
    /// A connector for channel `env.channel` of session `env.session` (zero: a new session) to
    /// the target at `env.dst`. `nonce` must be unpredictable (the caller's random source).
    pub fn new(
        env: Envelope,
        export: &str,
        want: ChannelParams,
        nonce: u64,
        retry: Duration,
        attempts: u32,
        now: Instant,
    ) -> Self {
        assert!(attempts > 0 && !retry.is_zero());
        assert!(!export.is_empty() && export.len() <= tyche_wire::MAX_EXPORT_NAME, "export name length");
        Connector {
            env,
            export: export.to_owned(),
            want,
            nonce,
            retry,
            attempts_left: attempts,
            next_send: now,
            outcome: None,
            key: None,
            challenge: None,
            host: None,
            target_proof: None,
            fresh_rounds: FRESH_KEY_ROUNDS,
        }
    }

    /// Sends this initiator's stable host id in CONNECT: the target tells initiators apart by
    /// it (one attachment of an export per host unless the export is shared; a new attachment
    /// from the same host fences the old one).
    pub fn with_host(mut self, host: [u8; 16]) -> Self {
        self.host = Some(host);
        self
    }

    /// Gives the connector the export's pre-shared key: a CHALLENGE is answered with a CONNECT
    /// carrying the proof ([`crate::auth`]), and ACCEPT must carry the target's proof.
    pub fn with_key(mut self, key: &[u8]) -> Self {
        self.key = Some(crate::auth::Psk::new(key));
        self
    }

    fn proof_input(&self, target_nonce: u64) -> crate::auth::ProofInput<'_> {
        crate::auth::ProofInput {
            nonce: self.nonce,
            target_nonce,
            session: self.env.session,
            channel: self.env.channel,
            export: &self.export,
            initiator: self.env.src,
            target: self.env.dst,
            host: self.host,
            asked: self.want,
        }
    }

    /// Writes a CONNECT into `buf` when one is due.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        if self.outcome.is_some() || now < self.next_send || self.attempts_left == 0 {
            return None;
        }
        self.attempts_left -= 1;
        self.next_send = now + self.retry;
        let proof = match (&self.key, self.challenge) {
            (Some(key), Some(tn)) => Some(crate::auth::initiator_proof(key, &self.proof_input(tn))),
            _ => None,
        };
        let c = Connect { nonce: self.nonce, params: self.want, proof, export: &self.export, host: self.host };
        Some(Message::Connect(c).emit(&self.env, buf))
    }

    /// When [`Connector::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.outcome.is_none().then_some(self.next_send)
    }

    /// Gives up once every attempt has gone unanswered.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.outcome.is_none() && self.attempts_left == 0 && now >= self.next_send {
            self.outcome = Some(Err(ConnectError::Timeout));
        }
    }

    /// Hands the connector a message from the target; returns the outcome once known.
    pub fn handle(&mut self, src: MacAddr, session: u64, msg: &Message<'_>) -> Option<Result<Connected, ConnectError>> {
        if self.outcome.is_some() || src != self.env.dst {
            return self.outcome;
        }
        self.outcome = match msg {
            Message::Accept(a) if a.nonce == self.nonce => {
                let p = a.params;
                let within = p.ring <= self.want.ring
                    && p.remq_slots <= self.want.remq_slots
                    && p.damq_slots <= self.want.damq_slots
                    && p.segment <= self.want.segment
                    && p.max_io <= self.want.max_io
                    && p.features & !self.want.features == 0;
                let same_session = self.env.session == 0 || self.env.session == session;
                if let Some(key) = &self.key {
                    // An initiator given a key attaches only where the target proves it: an
                    // ACCEPT without the target's proof (an export without a key, or a rogue
                    // target) is refused, so the key never goes unused.
                    let grant = crate::auth::Grant {
                        session,
                        params: p,
                        export_size: a.export_size,
                        block_size: a.block_size,
                        export_flags: a.export_flags,
                        durability_epoch: a.durability_epoch,
                        channel_mac: a.channel_mac,
                    };
                    let ok = match (self.challenge, a.proof) {
                        (Some(tn), Some(proof)) => {
                            crate::auth::verify_target(key, &self.proof_input(tn), &grant, &proof).then_some(proof)
                        }
                        _ => None,
                    };
                    let Some(proof) = ok else {
                        self.outcome = Some(Err(ConnectError::BadProof));
                        return self.outcome;
                    };
                    self.target_proof = Some(proof);
                }
                // The ACCEPT came from the address the CONNECT went to (checked above); the
                // channel's frames go to the address it names, which must be one station's.
                let channel_addr = match a.channel_addr(self.env.dst) {
                    Ok(addr) => addr,
                    Err(bad) => {
                        self.outcome = Some(Err(ConnectError::BadChannelAddress(bad)));
                        return self.outcome;
                    }
                };
                if within && params_supported(&p) && session != 0 && same_session {
                    Some(Ok(Connected {
                        session,
                        params: p,
                        export_size: a.export_size,
                        block_size: a.block_size,
                        export_flags: a.export_flags,
                        durability_epoch: a.durability_epoch,
                        channel_addr,
                    }))
                } else {
                    Some(Err(ConnectError::BadGrant))
                }
            }
            Message::Reject(r)
                if r.nonce == self.nonce
                    && r.reason == RejectReason::AuthFailed
                    && self.challenge.is_some()
                    && self.fresh_rounds > 0 =>
            {
                // The proof found no challenge, or failed: a new round under a new nonce (the
                // next one: an off-path peer that could not see this one cannot guess it either),
                // so that late answers of this round match nothing.
                self.fresh_rounds -= 1;
                self.nonce = self.nonce.wrapping_add(1);
                self.challenge = None;
                self.next_send = Instant::ZERO;
                self.attempts_left += 1;
                None
            }
            Message::Reject(r) if r.nonce == self.nonce => Some(Err(match (r.reason, r.holder) {
                (RejectReason::InUse, Some(holder)) => ConnectError::InUse(holder),
                (reason, _) => ConnectError::Rejected(reason),
            })),
            Message::Challenge(c) if c.nonce == self.nonce && self.key.is_some() => {
                // Answer at once with the proof; the answer gets a fresh attempt of its own.
                if self.challenge.is_none() {
                    self.challenge = Some(c.target_nonce);
                    self.next_send = Instant::ZERO;
                    self.attempts_left += 1;
                }
                None
            }
            Message::Challenge(c) if c.nonce == self.nonce => Some(Err(ConnectError::ChallengeUnsupported)),
            _ => None,
        };
        self.outcome
    }

    /// The outcome, once known.
    pub fn outcome(&self) -> Option<Result<Connected, ConnectError>> {
        self.outcome
    }

    /// Builds the initiator's channel from an ACCEPT: addressed to the channel's target address
    /// ([`Connected::channel_addr`]), for a keyed export with its keys
    /// ([`crate::auth::Sealer`]), and with the export's durability epoch (which the
    /// [`crate::Volume`] it joins compares across sessions).
    pub fn channel(&self, c: &Connected, timers: Timers, now: Instant) -> Channel {
        let env = Envelope { session: c.session, dst: c.channel_addr, ..self.env };
        let ch = Channel::new(Role::Initiator, env, c.params, timers, now).with_durability_epoch(c.durability_epoch);
        match (&self.key, &self.target_proof) {
            (Some(key), Some(proof)) => {
                let encrypt = c.export_flags & flags::EXPORT_ENCRYPTED != 0;
                ch.with_sealer(crate::auth::Sealer::derive(key, proof, Role::Initiator, encrypt))
            }
            _ => ch,
        }
    }
}

/// An export as the acceptor offers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSpec {
    /// Name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Logical block size.
    pub block_size: u32,
    /// `flags::EXPORT_*`.
    pub flags: u16,
    /// Durability epoch presented in every ACCEPT ([`DurabilityEpoch`]): the same for as long
    /// as the writes the target acknowledged on the export are kept, flushed or not.
    pub durability_epoch: DurabilityEpoch,
}

/// What the acceptor decided about a frame.
#[derive(Debug)]
pub enum Accepted {
    /// Send the reply written into the buffer (`len` bytes); nothing else changes.
    Reply(usize),
    /// A new channel: add it to session `session` (creating the session for export `export`
    /// if it is new), then send the ACCEPT written into the buffer (`len` bytes).
    Channel {
        /// Session id.
        session: u64,
        /// Index into the acceptor's exports.
        export: usize,
        /// The target end of the channel.
        channel: Box<Channel>,
        /// Bytes of ACCEPT in the buffer.
        len: usize,
    },
}

#[derive(Debug)]
struct Granted {
    nonce: u64,
    accept: Accept,
    /// The initiator's proof in the CONNECT it answers (a retry must carry the same one).
    proof: Option<[u8; 32]>,
}

/// A CONNECT to a keyed export whose initiator proof the caller (the target daemon) checked
/// against the CHALLENGE it sent: the acceptor proves the key back over the grant and gives the
/// channel its keys.
#[derive(Debug, Clone, Copy)]
pub struct KeyedConnect<'k> {
    /// The export's pre-shared key.
    pub key: &'k crate::auth::Psk,
    /// The nonce of the CHALLENGE the proof answered.
    pub target_nonce: u64,
}

#[derive(Debug)]
struct SessionRecord {
    export: usize,
    /// MAC of the NIC that created the session ([`AcceptorLimits::sessions_per_mac`]).
    initiator: MacAddr,
    /// Nonce of the CONNECT that created it (its key in `created`).
    nonce: u64,
    channels: HashMap<u16, Granted>,
}

/// A handshake frame (DISCOVER or CONNECT) as the target received it.
#[derive(Debug, Clone, Copy)]
pub struct HandshakeFrame<'a> {
    /// The MAC of the NIC it arrived on (where it was sent).
    pub local: MacAddr,
    /// Its sender.
    pub src: MacAddr,
    /// Its envelope (session and channel it names).
    pub env: &'a Envelope,
    /// The message.
    pub msg: &'a Message<'a>,
}

/// A CONNECT being decided, and where its answer goes.
struct Asked<'a> {
    src: MacAddr,
    env_in: &'a Envelope,
    c: &'a Connect<'a>,
    reply_env: Envelope,
    /// The channel's own address named in the ACCEPT (zero: the NIC's).
    channel_mac: MacAddr,
    keyed: Option<KeyedConnect<'a>>,
}

/// How many sessions and channels an [`Acceptor`] grants at most. A CONNECT that would exceed
/// one is refused with REJECT BUSY and counted in [`BusyCounts`]. The session limits apply to
/// new sessions, the channel limits to channels on a new index (a reconnect on an index the
/// session has is never refused for room).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptorLimits {
    /// Sessions on the target.
    pub sessions: usize,
    /// Sessions of one export.
    pub sessions_per_export: usize,
    /// Sessions created from one initiator MAC.
    pub sessions_per_mac: usize,
    /// Channel indices of one session.
    pub channels_per_session: usize,
    /// Channels on the target, every session's together.
    pub channels: usize,
}

impl Default for AcceptorLimits {
    fn default() -> Self {
        AcceptorLimits {
            sessions: 256,
            sessions_per_export: 256,
            sessions_per_mac: 8,
            channels_per_session: 64,
            channels: 1024,
        }
    }
}

/// CONNECTs refused with REJECT BUSY, by the limit ([`AcceptorLimits`]) that was full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BusyCounts {
    /// [`AcceptorLimits::sessions`].
    pub sessions: u64,
    /// [`AcceptorLimits::sessions_per_export`].
    pub sessions_per_export: u64,
    /// [`AcceptorLimits::sessions_per_mac`].
    pub sessions_per_mac: u64,
    /// [`AcceptorLimits::channels_per_session`].
    pub channels_per_session: u64,
    /// [`AcceptorLimits::channels`].
    pub channels: u64,
}

/// Answers DISCOVER and CONNECT on the target.
#[derive(Debug)]
pub struct Acceptor {
    ethertype: u16,
    exports: Vec<ExportSpec>,
    limit: ChannelParams,
    timers: Timers,
    limits: AcceptorLimits,
    busy: BusyCounts,
    /// Channel indices granted, every session's together.
    channel_count: usize,
    sessions: HashMap<u64, SessionRecord>,
    /// (initiator MAC, nonce) of CONNECTs that created a session, so a retransmitted CONNECT
    /// gets the same ACCEPT instead of a second session.
    created: HashMap<(MacAddr, u64), u64>,
}

/// Exports listed per DISCOVER_REPLY frame.
const EXPORTS_PER_REPLY: usize = 8;

impl Acceptor {
    /// An acceptor for every NIC of a target, granting at most `limit`.
    pub fn new(ethertype: u16, exports: Vec<ExportSpec>, limit: ChannelParams, timers: Timers) -> Self {
        assert!(params_supported(&limit), "unsupported limits {limit:?}");
        Acceptor {
            ethertype,
            exports,
            limit,
            timers,
            limits: AcceptorLimits::default(),
            busy: BusyCounts::default(),
            channel_count: 0,
            sessions: HashMap::new(),
            created: HashMap::new(),
        }
    }

    /// The EtherType of its replies.
    pub fn ethertype(&self) -> u16 {
        self.ethertype
    }

    /// The same acceptor granting at most `limits`.
    pub fn with_limits(mut self, limits: AcceptorLimits) -> Self {
        self.limits = limits;
        self
    }

    /// CONNECTs refused with BUSY so far.
    pub fn busy(&self) -> BusyCounts {
        self.busy
    }

    /// Sessions the acceptor knows.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Whether a CONNECT from `src` with `nonce` already created a session (a retransmission,
    /// answered with the same ACCEPT).
    pub fn created_by(&self, src: MacAddr, nonce: u64) -> Option<u64> {
        self.created.get(&(src, nonce)).copied()
    }

    /// The exports offered.
    pub fn exports(&self) -> &[ExportSpec] {
        &self.exports
    }

    /// Offers one more export (a target's configuration reloaded), after those offered so far,
    /// so the index of every export offered before stays the same. Its index; `None` (and
    /// nothing changes) when an export of that name is offered already or the list is full
    /// (DISCOVER counts exports in 16 bits).
    pub fn add_export(&mut self, spec: ExportSpec) -> Option<usize> {
        if self.exports.len() >= usize::from(u16::MAX) || self.exports.iter().any(|e| e.name == spec.name) {
            return None;
        }
        self.exports.push(spec);
        Some(self.exports.len() - 1)
    }

    /// Forgets a session (after all its channels died).
    pub fn forget_session(&mut self, session: u64) {
        if let Some(record) = self.sessions.remove(&session) {
            self.channel_count -= record.channels.len();
            self.created.remove(&(record.initiator, record.nonce));
        }
    }

    /// Handles a DISCOVER or CONNECT (other messages give `None`). `new_session_id` supplies
    /// unpredictable nonzero ids. Replies are written into `buf`.
    pub fn handle(
        &mut self,
        now: Instant,
        frame: HandshakeFrame<'_>,
        new_session_id: &mut dyn FnMut() -> u64,
        buf: &mut [u8],
    ) -> Option<Accepted> {
        self.handle_keyed(now, frame, new_session_id, buf, None)
    }

    /// As [`Acceptor::handle_keyed`] for a target that gives the channel a target address of its
    /// own, `channel_addr` (a unicast address the NIC steers to the queue that serves the
    /// channel): the ACCEPT still comes from `frame.local` (where the CONNECT went) and names
    /// `channel_addr` in `CHANNEL_MAC` (all zero when it is `frame.local`), and the new channel
    /// sends from `channel_addr`. Discovery and refusals are answered from `frame.local`.
    pub fn handle_steered(
        &mut self,
        now: Instant,
        frame: HandshakeFrame<'_>,
        channel_addr: MacAddr,
        new_session_id: &mut dyn FnMut() -> u64,
        buf: &mut [u8],
        keyed: Option<KeyedConnect<'_>>,
    ) -> Option<Accepted> {
        debug_assert!(!channel_addr.is_multicast() && channel_addr != MacAddr::ZERO, "{channel_addr}");
        self.dispatch(now, frame, channel_addr, new_session_id, buf, keyed)
    }

    /// Whether `c` from `src` repeats a CONNECT that was granted a channel which still exists:
    /// the same nonce, session, channel and proof. It gets the same ACCEPT again and nothing
    /// else changes; for a keyed export that is how a retry whose ACCEPT was lost is answered
    /// after its (single-use) CHALLENGE was spent.
    pub fn is_retry(&self, src: MacAddr, env_in: &Envelope, c: &Connect<'_>) -> bool {
        self.granted(src, env_in, c).is_some()
    }

    fn granted(&self, src: MacAddr, env_in: &Envelope, c: &Connect<'_>) -> Option<(u64, &Granted)> {
        let sid = if env_in.session == 0 { self.created.get(&(src, c.nonce)).copied()? } else { env_in.session };
        let g = self.sessions.get(&sid)?.channels.get(&env_in.channel)?;
        (g.nonce == c.nonce && g.proof == c.proof).then_some((sid, g))
    }

    /// As [`Acceptor::handle`], for a caller (the target daemon) that has checked the CONNECT's
    /// proof of the export's key itself against its CHALLENGE: with `keyed`, the ACCEPT carries
    /// the target's proof over the grant and the channel seals its frames with keys derived
    /// from it. An export with flag `EXPORT_NEEDS_KEY` is refused with `AuthRequired` without
    /// `keyed` (unless the CONNECT is a retry, [`Acceptor::is_retry`]).
    pub fn handle_keyed(
        &mut self,
        now: Instant,
        frame: HandshakeFrame<'_>,
        new_session_id: &mut dyn FnMut() -> u64,
        buf: &mut [u8],
        keyed: Option<KeyedConnect<'_>>,
    ) -> Option<Accepted> {
        self.dispatch(now, frame, frame.local, new_session_id, buf, keyed)
    }

    fn dispatch(
        &mut self,
        now: Instant,
        frame: HandshakeFrame<'_>,
        channel_addr: MacAddr,
        new_session_id: &mut dyn FnMut() -> u64,
        buf: &mut [u8],
        keyed: Option<KeyedConnect<'_>>,
    ) -> Option<Accepted> {
        let HandshakeFrame { local, src, env, msg } = frame;
        let reply_env = Envelope { dst: src, src: local, ethertype: self.ethertype, channel: env.channel, session: 0 };
        match msg {
            Message::Discover(d) => {
                let start = (d.start as usize).min(self.exports.len());
                let infos: Vec<ExportInfo<'_>> = self.exports[start..]
                    .iter()
                    .take(EXPORTS_PER_REPLY)
                    .map(|e| ExportInfo { name: &e.name, size: e.size, block_size: e.block_size, flags: e.flags })
                    .collect();
                let r = DiscoverReply {
                    nonce: d.nonce,
                    total: self.exports.len() as u16,
                    start: start as u16,
                    exports: ExportList::Slice(&infos),
                };
                Some(Accepted::Reply(Message::DiscoverReply(r).emit(&reply_env, buf)))
            }
            Message::Connect(c) => {
                let channel_mac = if channel_addr == local { MacAddr::ZERO } else { channel_addr };
                let asked = Asked { src, env_in: env, c, reply_env, channel_mac, keyed };
                Some(self.connect(now, asked, new_session_id, buf))
            }
            _ => None,
        }
    }

    /// The counter of the limit a CONNECT from `src` for `export` would exceed, if any.
    fn full(&mut self, src: MacAddr, export: usize, env_in: &Envelope) -> Option<&mut u64> {
        let l = self.limits;
        let new_channel = match env_in.session {
            0 => true,
            sid => match self.sessions.get(&sid) {
                Some(s) => !s.channels.contains_key(&env_in.channel),
                None => return None, // refused as an unknown session below
            },
        };
        if env_in.session == 0 {
            if self.sessions.len() >= l.sessions {
                return Some(&mut self.busy.sessions);
            }
            if self.sessions.values().filter(|s| s.export == export).count() >= l.sessions_per_export {
                return Some(&mut self.busy.sessions_per_export);
            }
            if self.sessions.values().filter(|s| s.initiator == src).count() >= l.sessions_per_mac {
                return Some(&mut self.busy.sessions_per_mac);
            }
        } else if new_channel && self.sessions[&env_in.session].channels.len() >= l.channels_per_session {
            return Some(&mut self.busy.channels_per_session);
        }
        if new_channel && self.channel_count >= l.channels {
            return Some(&mut self.busy.channels);
        }
        None
    }

    /// The session a granted CONNECT of `export` from `src` (nonce `nonce`) joins: the one it
    /// names (`session`), which must be of the same export, or a new one with an unpredictable
    /// id when it names none. `None`: it names a session the acceptor does not have.
    fn session_for(
        &mut self,
        export: usize,
        src: MacAddr,
        session: u64,
        nonce: u64,
        new_session_id: &mut dyn FnMut() -> u64,
    ) -> Option<u64> {
        match session {
            0 => {
                let mut sid = new_session_id();
                while sid == 0 || self.sessions.contains_key(&sid) {
                    sid = new_session_id();
                }
                self.sessions.insert(sid, SessionRecord { export, initiator: src, nonce, channels: HashMap::new() });
                self.created.insert((src, nonce), sid);
                Some(sid)
            }
            // Each NIC of the initiator has its own MAC: the session id (unpredictable) and the
            // export identify the session. Proof of a key is the target daemon's business.
            sid => self.sessions.get(&sid).filter(|s| s.export == export).map(|_| sid),
        }
    }

    fn connect(
        &mut self,
        now: Instant,
        asked: Asked<'_>,
        new_session_id: &mut dyn FnMut() -> u64,
        buf: &mut [u8],
    ) -> Accepted {
        let Asked { src, env_in, c, reply_env, channel_mac, keyed } = asked;
        let reject = |reason, buf: &mut [u8]| {
            Accepted::Reply(Message::Reject(Reject { nonce: c.nonce, reason, holder: None }).emit(&reply_env, buf))
        };
        let Some(export) = self.exports.iter().position(|e| e.name == c.export) else {
            return reject(RejectReason::UnknownExport, buf);
        };
        // A retransmitted CONNECT: answer with the same ACCEPT, creating nothing (a new channel
        // would reuse the keys' nonces).
        if let Some((sid, g)) = self.granted(src, env_in, c) {
            let env = Envelope { session: sid, ..reply_env };
            return Accepted::Reply(Message::Accept(g.accept).emit(&env, buf));
        }
        let needs_key = self.exports[export].flags & flags::EXPORT_NEEDS_KEY != 0;
        if needs_key && keyed.is_none() {
            return reject(RejectReason::AuthRequired, buf);
        }
        let Some(params) = negotiate(&c.params, &self.limit) else {
            return reject(RejectReason::BadParameters, buf);
        };
        if let Some(full) = self.full(src, export, env_in) {
            *full = full.saturating_add(1);
            return reject(RejectReason::Busy, buf);
        }
        let Some(sid) = self.session_for(export, src, env_in.session, c.nonce, new_session_id) else {
            return reject(RejectReason::UnknownSession, buf);
        };
        let e = &self.exports[export];
        let grant = crate::auth::Grant {
            session: sid,
            params,
            export_size: e.size,
            block_size: e.block_size,
            export_flags: e.flags,
            durability_epoch: e.durability_epoch,
            channel_mac,
        };
        let sealing = keyed.filter(|_| needs_key).map(|k| {
            let input = crate::auth::ProofInput {
                nonce: c.nonce,
                target_nonce: k.target_nonce,
                session: env_in.session,
                channel: env_in.channel,
                export: c.export,
                initiator: src,
                target: reply_env.src,
                host: c.host,
                asked: c.params,
            };
            (k.key, crate::auth::target_proof(k.key, &input, &grant))
        });
        let accept = Accept {
            nonce: c.nonce,
            params,
            export_size: e.size,
            block_size: e.block_size,
            export_flags: e.flags,
            proof: sealing.map(|(_, p)| p),
            durability_epoch: e.durability_epoch,
            channel_mac,
        };
        let record = self.sessions.get_mut(&sid).expect("inserted or checked");
        let granted = Granted { nonce: c.nonce, accept, proof: c.proof };
        if record.channels.insert(env_in.channel, granted).is_none() {
            self.channel_count += 1;
        }
        let env = Envelope { session: sid, ..reply_env };
        let len = Message::Accept(accept).emit(&env, buf);
        // The channel's frames go out from its own address when the ACCEPT named one.
        let channel_env = match channel_mac {
            MacAddr::ZERO => env,
            addr => Envelope { src: addr, ..env },
        };
        let mut channel = Channel::new(Role::Target, channel_env, params, self.timers, now);
        if let Some((key, proof)) = sealing {
            let encrypt = e.flags & flags::EXPORT_ENCRYPTED != 0;
            channel = channel.with_sealer(crate::auth::Sealer::derive(key, &proof, Role::Target, encrypt));
        }
        Accepted::Channel { session: sid, export, channel: Box::new(channel), len }
    }
}
