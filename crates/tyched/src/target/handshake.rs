//! The handshake: DISCOVER and CONNECT frames, answered on the NIC they came in on.
//!
//! In front of the channel engine's [`tyche_channel::Acceptor`] the target checks a CONNECT
//! itself ([`Network::on_handshake`]): the export's MAC allow-list, its key (a CHALLENGE round,
//! the initiator's proof checked against a pending challenge, [`Challenges`]), who may join an
//! existing session, and who holds an export that is not `shared`. A CONNECT that creates a
//! session fences the older sessions of the same initiator ([`Network::fence`]). Replies wait
//! in their NIC's control queue (`limits.control_queue`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tyche_channel::auth::{self, ProofInput, Psk};
use tyche_channel::{Accepted, Channel, ExportGeometry, Instant, KeyedConnect};
use tyche_wire::{Challenge, Connect, Envelope, Frame, MacAddr, Message, Reject, RejectReason, Status};

use super::sessions::{new_parts, SessionState};
use super::{Network, PEER_LOGS};

/// How long a CHALLENGE may be answered.
const CHALLENGE_LIFETIME: Duration = Duration::from_secs(5);

/// Room for the largest reply: a DISCOVER_REPLY of 8 exports with 64-byte names (672 bytes).
const REPLY_BUF: usize = 2048;

/// A CHALLENGE sent and not yet answered.
#[derive(Debug, Clone, Copy)]
struct PendingChallenge {
    target_nonce: u64,
    sent: Instant,
}

/// The CHALLENGEs sent and not yet answered, bounded in all (`limits.challenges`) and per
/// initiator MAC (`limits.challenges_per_mac`).
#[derive(Debug)]
pub(super) struct Challenges {
    pending: HashMap<(MacAddr, u64), PendingChallenge>,
    /// Pending challenges in the order sent (entries already forgotten are skipped).
    order: VecDeque<(MacAddr, u64)>,
    /// Pending challenges per initiator MAC, oldest first.
    by_mac: HashMap<MacAddr, VecDeque<u64>>,
    /// At most this many pending.
    limit: usize,
    /// At most this many pending per MAC.
    per_mac: usize,
    /// A MAC's oldest forgotten for its newer one (`limits.challenges_evicted`).
    pub(super) evicted: u64,
    /// Not issued: the table was full of live ones (`limits.challenges_refused`).
    pub(super) refused: u64,
}

impl Challenges {
    pub(super) fn new(limit: usize, per_mac: usize) -> Challenges {
        Challenges {
            pending: HashMap::new(),
            order: VecDeque::new(),
            by_mac: HashMap::new(),
            limit,
            per_mac,
            evicted: 0,
            refused: 0,
        }
    }

    /// The target nonce of the challenge pending for `src`'s CONNECT `nonce`, if still live.
    fn live(&self, now: Instant, src: MacAddr, nonce: u64) -> Option<u64> {
        self.pending.get(&(src, nonce)).filter(|p| now.since(p.sent) < CHALLENGE_LIFETIME).map(|p| p.target_nonce)
    }

    /// Remembers a CHALLENGE sent to `src`. At most `per_mac` per MAC: that MAC's oldest is
    /// forgotten (`evicted`). At most `limit` in all: expired ones are forgotten first, and when
    /// every one is still live no challenge is issued (`refused`), so that a flood from many
    /// MACs cannot push out the pending challenges of honest initiators. Returns whether it
    /// was remembered.
    fn remember(&mut self, now: Instant, src: MacAddr, nonce: u64, tn: u64) -> bool {
        let per_mac = self.by_mac.entry(src).or_default();
        if per_mac.len() >= self.per_mac {
            if let Some(old) = per_mac.pop_front() {
                self.pending.remove(&(src, old));
                self.evicted += 1;
            }
        }
        // Challenges expire in the order they were sent.
        while let Some(&(mac, old)) = self.order.front() {
            match self.pending.get(&(mac, old)) {
                Some(p) if now.since(p.sent) < CHALLENGE_LIFETIME => break,
                Some(_) => {
                    self.forget(mac, old);
                }
                None => {}
            }
            self.order.pop_front();
        }
        if self.pending.len() >= self.limit {
            self.refused += 1;
            if self.by_mac.get(&src).is_some_and(VecDeque::is_empty) {
                self.by_mac.remove(&src);
            }
            return false;
        }
        self.by_mac.entry(src).or_default().push_back(nonce);
        self.pending.insert((src, nonce), PendingChallenge { target_nonce: tn, sent: now });
        self.order.push_back((src, nonce));
        // Entries answered or forgotten per MAC stay in the order until popped: keep it bounded.
        if self.order.len() > 2 * self.limit {
            let pending = &self.pending;
            self.order.retain(|key| pending.contains_key(key));
        }
        true
    }

    /// Forgets the CHALLENGE sent to `src` for CONNECT nonce `nonce` (answered, or expired),
    /// returning it if it was pending.
    fn forget(&mut self, src: MacAddr, nonce: u64) -> Option<PendingChallenge> {
        let p = self.pending.remove(&(src, nonce))?;
        if let Some(q) = self.by_mac.get_mut(&src) {
            q.retain(|&n| n != nonce);
            if q.is_empty() {
                self.by_mac.remove(&src);
            }
        }
        Some(p)
    }

    /// Spends the challenge pending for `src`'s CONNECT `nonce`: its target nonce if it was
    /// still live. A challenge is answered once.
    fn spend(&mut self, now: Instant, src: MacAddr, nonce: u64) -> Option<u64> {
        self.forget(src, nonce).filter(|p| now.since(p.sent) < CHALLENGE_LIFETIME).map(|p| p.target_nonce)
    }
}

/// The identity of an initiator that sent no host id: its MAC, marked as such.
fn mac_identity(mac: MacAddr) -> [u8; 16] {
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(b"mac:");
    id[4..10].copy_from_slice(&mac.octets());
    id
}

/// Where a handshake frame came from and where its replies go.
struct Peer {
    /// The NIC it came in on.
    k: usize,
    /// That NIC's MAC.
    local: MacAddr,
    /// The initiator's MAC.
    src: MacAddr,
    /// The frame's addressing.
    env_in: Envelope,
    /// The replies' addressing (session 0).
    reply: Envelope,
}

/// What the target's own checks of a CONNECT let through to the acceptor.
#[derive(Default)]
struct Admission {
    /// A keyed export's CONNECT whose proof checked out: the key and the challenge's nonce.
    keyed: Option<(Psk, u64)>,
    /// The initiator's identity (a CONNECT of a known export).
    identity: Option<[u8; 16]>,
    /// The sessions of the same initiator that a new session fences.
    fence: Vec<u64>,
}

impl Network {
    /// Handles a DISCOVER or CONNECT (`msg`, parsed from `frame`) received on NIC `k`, whose
    /// MAC is `local`.
    pub(super) fn on_handshake(
        &mut self,
        now: Instant,
        k: usize,
        local: MacAddr,
        frame: &Frame<&[u8]>,
        msg: &Message<'_>,
    ) {
        let src = frame.src();
        let env_in = Envelope::of(frame);
        let reply = Envelope { dst: src, src: local, ethertype: self.ethertype, channel: env_in.channel, session: 0 };
        let peer = Peer { k, local, src, env_in, reply };
        let admission = match msg {
            Message::Connect(c) => match self.admit(now, &peer, c, msg) {
                Some(a) => a,
                None => return, // answered, or dropped
            },
            _ => Admission::default(),
        };
        self.accept(now, &peer, msg, admission);
    }

    /// The target's checks of a CONNECT before the acceptor sees it. `None` when it was
    /// answered here (a REJECT, a CHALLENGE, the ACCEPT of a granted retry) or dropped.
    fn admit(&mut self, now: Instant, peer: &Peer, c: &Connect<'_>, msg: &Message<'_>) -> Option<Admission> {
        let (k, src) = (peer.k, peer.src);
        if self.stopping.is_some() {
            self.nics[k].stats.drops.shutting_down += 1;
            return None;
        }
        let Some(i) = self.exports.iter().position(|e| e.spec.name == c.export) else {
            return Some(Admission::default()); // the acceptor refuses it
        };
        let e = &self.exports[i];
        if !e.allow.is_empty() && !e.allow.contains(&src) {
            if PEER_LOGS.allow() {
                tracing::warn!(%src, export = %c.export, nic = %self.nics[k].stats.name, "refused: MAC not allowed");
            }
            self.nics[k].stats.drops.denied_mac += 1;
            self.refuse(peer, i, c.nonce, RejectReason::NotAllowed, None);
            return None;
        }
        let keyed = match e.key.clone() {
            Some(key) => Some((self.check_key(now, peer, c, msg, i, &key)?, key)),
            None => None,
        };
        // One initiator at a time (unless shared); the same initiator again fences its old
        // sessions. Only for a CONNECT that creates a session (not a retransmitted one), and
        // only once it passed the MAC and key checks.
        let identity = c.host.unwrap_or_else(|| mac_identity(src));
        if !self.may_join(peer, c, i) {
            return None;
        }
        let fence = if peer.env_in.session == 0 && self.acceptor.created_by(src, c.nonce).is_none() {
            self.exclusive(peer, c, i, identity)?
        } else {
            Vec::new()
        };
        Some(Admission { keyed: keyed.map(|(tn, key)| (key, tn)), identity: Some(identity), fence })
    }

    /// The key check of a CONNECT of keyed export `i`: without a proof it gets a CHALLENGE; a
    /// retry of a granted CONNECT gets the same ACCEPT again; else its proof must answer a live
    /// challenge. Returns the challenge's target nonce when the proof checked out, `None` when
    /// the CONNECT was answered here.
    fn check_key(
        &mut self,
        now: Instant,
        peer: &Peer,
        c: &Connect<'_>,
        msg: &Message<'_>,
        i: usize,
        key: &Psk,
    ) -> Option<u64> {
        let (k, src, env_in) = (peer.k, peer.src, &peer.env_in);
        let Some(proof) = c.proof else {
            let tn = match self.challenges.live(now, src, c.nonce) {
                Some(tn) => tn,
                None => {
                    let tn = auth::random_u64();
                    if !self.challenges.remember(now, src, c.nonce, tn) {
                        return None; // the table is full of live challenges: no answer
                    }
                    tn
                }
            };
            let env = Envelope { session: env_in.session, ..peer.reply };
            self.reply(k, &env, &Message::Challenge(Challenge { nonce: c.nonce, target_nonce: tn }));
            return None;
        };
        // A retry of a CONNECT that was granted (its ACCEPT lost): the same ACCEPT, nothing
        // else. Its challenge is spent.
        if self.acceptor.is_retry(src, env_in, c) {
            let mut ids = auth::random_u64;
            let mut buf = vec![0u8; REPLY_BUF];
            if let Some(Accepted::Reply(len)) =
                self.acceptor.handle_keyed(now, peer.local, src, env_in, msg, &mut ids, &mut buf, None)
            {
                buf.truncate(len);
                self.queue_control(k, buf);
            }
            return None;
        }
        // A challenge is answered once, within its lifetime: a replayed proof finds none. The
        // proof covers the session and channel the CONNECT names, its parameters and host id,
        // so it is good for nothing else either.
        let pending = self.challenges.spend(now, src, c.nonce);
        let input = |tn| ProofInput {
            nonce: c.nonce,
            target_nonce: tn,
            session: env_in.session,
            channel: env_in.channel,
            export: c.export,
            initiator: src,
            target: peer.local,
            host: c.host,
            asked: c.params,
        };
        let ok = pending.filter(|&tn| auth::verify_initiator(key, &input(tn), &proof));
        if ok.is_none() {
            if PEER_LOGS.allow() {
                tracing::warn!(%src, export = %c.export, "refused: wrong or replayed key proof");
            }
            self.nics[k].stats.drops.denied_key += 1;
            self.refuse(peer, i, c.nonce, RejectReason::AuthFailed, None);
        }
        ok
    }

    /// Whether a CONNECT may join the session it names (if that exists): a session created
    /// with a host id takes channels only from that host, and a live channel is replaced only
    /// from its own MAC (a reconnect); another peer that read the session id off the wire
    /// cannot take it over. Refused here otherwise.
    fn may_join(&mut self, peer: &Peer, c: &Connect<'_>, i: usize) -> bool {
        let (src, env_in) = (peer.src, &peer.env_in);
        let Some(s) = self.sessions.get(&env_in.session) else { return true };
        let wrong_host = !s.identity.starts_with(b"mac:") && c.host != Some(s.identity);
        let live_elsewhere =
            s.session.channel(env_in.channel).is_some_and(|ch| ch.dead().is_none() && ch.envelope().dst != src);
        if !(wrong_host || live_elsewhere) {
            return true;
        }
        if PEER_LOGS.allow() {
            tracing::warn!(%src, export = %c.export, session = format_args!("{:016x}", env_in.session),
                channel = env_in.channel, "refused: a join from another host, or a takeover of a live channel");
        }
        self.nics[peer.k].stats.drops.denied_mac += 1;
        self.refuse(peer, i, c.nonce, RejectReason::NotAllowed, None);
        false
    }

    /// A CONNECT creating a session of export `i` for initiator `identity`: refused IN_USE
    /// (`None`) when another initiator holds the export and it is not `shared`; else the
    /// sessions of the same initiator it fences.
    fn exclusive(&mut self, peer: &Peer, c: &Connect<'_>, i: usize, identity: [u8; 16]) -> Option<Vec<u64>> {
        let holder = self
            .sessions
            .values()
            .find(|s| s.export == i && s.identity != identity && !s.fenced.load(Ordering::Relaxed))
            .map(|s| s.mac);
        if let (false, Some(holder)) = (self.exports[i].shared, holder) {
            if PEER_LOGS.allow() {
                tracing::warn!(src = %peer.src, export = %c.export, %holder, "refused: the export is attached by another initiator");
            }
            self.refuse(peer, i, c.nonce, RejectReason::InUse, Some(holder));
            return None;
        }
        Some(
            self.sessions
                .iter()
                .filter(|(_, s)| s.export == i && s.identity == identity && !s.fenced.load(Ordering::Relaxed))
                .map(|(&sid, _)| sid)
                .collect(),
        )
    }

    /// The acceptor's answer to a DISCOVER or an admitted CONNECT: a reply, or a new channel
    /// (and perhaps session) and its ACCEPT.
    fn accept(&mut self, now: Instant, peer: &Peer, msg: &Message<'_>, admission: Admission) {
        let mut ids = auth::random_u64;
        let busy_before = self.acceptor.busy();
        let mut buf = vec![0u8; REPLY_BUF];
        let keyed = admission.keyed.as_ref().map(|(key, tn)| KeyedConnect { key, target_nonce: *tn });
        // With queue addresses, the channel goes to a transport (NIC queue) of the interface
        // and is named by its address; the ACCEPT still goes out where the CONNECT came in.
        let (serve_on, channel_addr) = match msg {
            Message::Connect(_) => self.queue_addresses.assign(peer.k, |j| self.channels_on(j)),
            _ => (peer.k, None),
        };
        let channel_addr = channel_addr.unwrap_or(peer.local);
        match self.acceptor.handle_steered(
            now,
            peer.local,
            channel_addr,
            peer.src,
            &peer.env_in,
            msg,
            &mut ids,
            &mut buf,
            keyed,
        ) {
            Some(Accepted::Reply(len)) => {
                if self.acceptor.busy() != busy_before && PEER_LOGS.allow() {
                    tracing::warn!(src = %peer.src, busy = ?self.acceptor.busy(), "refused a CONNECT: a session or channel limit is full");
                }
                buf.truncate(len);
                self.queue_control(peer.k, buf);
            }
            Some(Accepted::Channel { session, export, channel, len }) => {
                self.open_channel(peer, serve_on, session, export, channel, admission);
                buf.truncate(len);
                self.queue_control(peer.k, buf);
            }
            None => {}
        }
    }

    /// Adds an accepted channel to its session, creating the session (and fencing the older
    /// sessions of the same initiator) if it is new. A reconnect on the same index replaces the
    /// channel, and its slots go with it.
    fn open_channel(
        &mut self,
        peer: &Peer,
        k: usize,
        session: u64,
        export: usize,
        channel: Box<Channel>,
        admission: Admission,
    ) {
        let src = peer.src;
        let e = &self.exports[export];
        let geometry = ExportGeometry { size: e.spec.size, read_only: e.read_only, discard: true };
        let Admission { identity, fence, .. } = admission;
        let idx = channel.envelope().channel;
        let ethertype = self.ethertype;
        let log = PEER_LOGS.allow();
        let created = !self.sessions.contains_key(&session);
        let (mail, group) = (Arc::clone(&self.mail), self.nics[k].group);
        if created {
            for &old in &fence {
                self.fence(old, session);
            }
        }
        let e = &self.exports[export];
        let st = self.sessions.entry(session).or_insert_with(|| {
            if log {
                tracing::info!(%src, export = %e.spec.name, session = format_args!("{session:016x}"), "new session");
            }
            SessionState {
                session: new_parts(session, ethertype, geometry, &mail),
                export,
                nic_of: BTreeMap::new(),
                executing: BTreeMap::new(),
                epochs: BTreeMap::new(),
                all_dead_since: None,
                established: false,
                identity: identity.unwrap_or_else(|| mac_identity(src)),
                mac: src,
                fenced: Arc::new(AtomicBool::new(false)),
                waits_for: fence,
            }
        });
        if log {
            tracing::info!(%src, session = format_args!("{session:016x}"), channel = idx, params = ?channel.params(),
                nic = %self.nics[k].stats.name, addr = %channel.envelope().src, "channel open");
        }
        st.session.add_channel(group, *channel);
        st.all_dead_since = None;
        if st.nic_of.insert(idx, k).is_some() {
            // A reconnect replaced the channel: its slot memory (and the frames it kept) goes
            // with it.
            let epoch = st.epochs.entry(idx).or_default();
            let old = *epoch;
            *epoch += 1;
            self.slots.drop_where(|key| key.0 == session && key.1 == idx && key.2 == old);
        }
    }

    /// Live channels served on transport `k`.
    fn channels_on(&self, k: usize) -> usize {
        self.sessions
            .values()
            .map(|s| {
                s.nic_of
                    .iter()
                    .filter(|&(&c, &on)| on == k && s.session.channel(c).is_some_and(|ch| ch.dead().is_none()))
                    .count()
            })
            .sum()
    }

    /// Fences session `old` for the new session `by` of the same initiator: its channels close,
    /// its storage requests not started are not run (ABORTED), its reads waiting for memory are
    /// answered ABORTED, and `by` runs nothing until every request of `old` already in storage
    /// has ended, so no write of the old session lands after one of the new.
    pub(super) fn fence(&mut self, old: u64, by: u64) {
        let Some(s) = self.sessions.get_mut(&old) else { return };
        s.fenced.store(true, Ordering::Release);
        s.session.close(tyche_wire::DisconnectReason::Normal);
        self.counters.fenced += 1;
        if PEER_LOGS.allow() {
            tracing::warn!(
                session = format_args!("{old:016x}"),
                by = format_args!("{by:016x}"),
                "session fenced: the same initiator attached again"
            );
        }
        self.storage.abort_queued(old);
        for (_, channel, request, _) in self.storage.take_waiting(old) {
            s.session.complete(channel, &request, Status::Aborted);
        }
    }

    /// Refuses a CONNECT of export `i` with `reason` (counted as denied).
    fn refuse(&mut self, peer: &Peer, i: usize, nonce: u64, reason: RejectReason, holder: Option<MacAddr>) {
        self.counters.exports[i].denied += 1;
        self.reply(peer.k, &peer.reply, &Message::Reject(Reject { nonce, reason, holder }));
    }

    /// Queues `msg` on NIC `k`, addressed by `env`.
    fn reply(&mut self, k: usize, env: &Envelope, msg: &Message<'_>) {
        let mut buf = vec![0u8; REPLY_BUF];
        let len = msg.emit(env, &mut buf);
        buf.truncate(len);
        self.queue_control(k, buf);
    }

    /// Queues a control reply on NIC `k`, or drops it when `limits.control_queue` are waiting
    /// (the initiator retries its CONNECT or DISCOVER).
    fn queue_control(&mut self, k: usize, frame: Vec<u8>) {
        if self.nics[k].control.len() >= self.limits.control_queue {
            self.counters.limits.control_dropped += 1;
            return;
        }
        self.nics[k].control.push_back(frame);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac(n: u32) -> MacAddr {
        MacAddr::local(n)
    }

    #[test]
    fn challenges_stay_bounded_and_are_spent_once() {
        let mut c = Challenges::new(4, 2);
        let t0 = Instant(1);
        // A MAC's third challenge forgets its first.
        for nonce in 0..3 {
            assert!(c.remember(t0, mac(1), nonce, 100 + nonce));
        }
        assert_eq!(c.evicted, 1);
        assert_eq!(c.live(t0, mac(1), 0), None);
        assert_eq!(c.live(t0, mac(1), 2), Some(102));
        // The table full of live challenges refuses new ones and keeps the pending.
        assert!(c.remember(t0, mac(2), 0, 200));
        assert!(c.remember(t0, mac(3), 0, 300));
        assert!(!c.remember(t0, mac(4), 0, 400));
        assert_eq!(c.refused, 1);
        assert!(!c.by_mac.contains_key(&mac(4)));
        // Answered once: a replay finds nothing.
        assert_eq!(c.spend(t0, mac(2), 0), Some(200));
        assert_eq!(c.spend(t0, mac(2), 0), None);
        // Expired ones make room, and are not answered.
        let later = Instant(t0.0 + CHALLENGE_LIFETIME.as_nanos() as u64 + 1);
        assert_eq!(c.spend(later, mac(3), 0), None);
        assert!(c.remember(later, mac(5), 0, 500));
        assert!(c.pending.len() <= 4 && c.order.len() <= 8);
    }
}
