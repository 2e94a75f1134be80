//! The handshake: DISCOVER and CONNECT frames, answered on the NIC they came in on.
//!
//! In front of the channel engine's [`tyche_channel::Acceptor`] the target checks a CONNECT
//! itself ([`Control::on_handshake`], under the control's lock): the export's MAC allow-list, its key (a CHALLENGE round,
//! the initiator's proof checked against a pending challenge, `tyche_channel::Challenges`), who may join an
//! existing session, and who holds an export that is not `shared`. A CONNECT that creates a
//! session fences the older sessions of the same initiator ([`Control::fence`]). What the
//! handshake gives the thread that received the frame ([`Answer`]: replies for its NIC's
//! control queue, `limits.control_queue`; drop counts; a channel for one of its own NICs) is
//! applied by that thread after the lock; a channel for another thread's NIC goes to that
//! thread as a message.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tyche_channel::PartId;

use tyche_channel::auth::{self, Psk};
use tyche_channel::KeyCheck;
use tyche_channel::{Accepted, Channel, ExportGeometry, HandshakeFrame, Instant, KeyedConnect};
use tyche_wire::{Challenge, Connect, Envelope, Frame, MacAddr, Message, Reject, RejectReason};

use super::control::{ChannelEntry, Control, Entry, Opening, ThreadMsg};
use super::PEER_LOGS;
use crate::stats::Drops;

/// Room for the largest reply: a DISCOVER_REPLY of 8 exports with 64-byte names (672 bytes).
const REPLY_BUF: usize = 2048;

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

impl Peer {
    /// `msg`, as it arrived from this peer, for the acceptor.
    fn frame<'a>(&'a self, msg: &'a Message<'a>) -> HandshakeFrame<'a> {
        HandshakeFrame { local: self.local, src: self.src, env: &self.env_in, msg }
    }
}

/// What a handshake frame gives the thread that received it.
#[derive(Debug, Default)]
pub(super) struct Answer {
    /// Replies to send on the NIC it came in on.
    pub(super) replies: Vec<Vec<u8>>,
    /// Drop counts of that NIC (`denied_mac`, `denied_key`, `shutting_down`).
    pub(super) drops: Drops,
    /// A channel accepted for one of the thread's own NICs, to install.
    pub(super) open: Option<Box<Opening>>,
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

/// Where a handshake frame arrived: the network thread and the NIC.
#[derive(Debug, Clone, Copy)]
pub(super) struct Arrival {
    /// The network thread (`g`).
    pub(super) thread: usize,
    /// Whether that thread is stopping (it no longer takes channels).
    pub(super) stopping: bool,
    /// The NIC (`k`).
    pub(super) nic: usize,
    /// That NIC's MAC.
    pub(super) local: MacAddr,
}

impl Control {
    /// Handles a DISCOVER or CONNECT (`msg`, parsed from `frame`) that arrived as `at` says.
    pub(super) fn on_handshake(
        &mut self,
        now: Instant,
        at: Arrival,
        frame: &Frame<&[u8]>,
        msg: &Message<'_>,
    ) -> Answer {
        let Arrival { thread: g, stopping, nic: k, local } = at;
        let mut out = Answer::default();
        let src = frame.src();
        let env_in = Envelope::of(frame);
        let reply = Envelope { dst: src, src: local, ethertype: self.ethertype, channel: env_in.channel, session: 0 };
        let peer = Peer { k, local, src, env_in, reply };
        let admission = match msg {
            Message::Connect(_) if stopping => {
                out.drops.shutting_down += 1;
                return out;
            }
            Message::Connect(c) => match self.admit(now, &peer, c, msg, &mut out) {
                Some(a) => a,
                None => return out, // answered, or dropped
            },
            _ => Admission::default(),
        };
        self.accept(now, g, &peer, msg, admission, &mut out);
        out
    }

    /// The target's checks of a CONNECT before the acceptor sees it. `None` when it was
    /// answered here (a REJECT, a CHALLENGE, the ACCEPT of a granted retry) or dropped.
    fn admit(
        &mut self,
        now: Instant,
        peer: &Peer,
        c: &Connect<'_>,
        msg: &Message<'_>,
        out: &mut Answer,
    ) -> Option<Admission> {
        let (k, src) = (peer.k, peer.src);
        let Some(i) = self.exports.iter().position(|e| e.spec.name == c.export) else {
            return Some(Admission::default()); // the acceptor refuses it
        };
        let e = &self.exports[i];
        if !e.allow.is_empty() && !e.allow.contains(&src) {
            if PEER_LOGS.allow() {
                tracing::warn!(%src, export = %c.export, nic = %self.nic_names[k], "refused: MAC not allowed");
            }
            out.drops.denied_mac += 1;
            self.refuse(peer, i, c.nonce, RejectReason::NotAllowed, None, out);
            return None;
        }
        let keyed = if e.key.is_some() { Some(self.check_key(now, peer, c, msg, i, out)?) } else { None };
        // One initiator at a time (unless shared); the same initiator again fences its old
        // sessions. Only for a CONNECT that creates a session (not a retransmitted one), and
        // only once it passed the MAC and key checks.
        let identity = c.host.unwrap_or_else(|| mac_identity(src));
        if !self.may_join(peer, c, i, out) {
            return None;
        }
        let fence = if peer.env_in.session == 0 && self.acceptor.created_by(src, c.nonce).is_none() {
            self.exclusive(peer, c, i, identity, out)?
        } else {
            Vec::new()
        };
        Some(Admission { keyed: keyed.map(|(tn, key)| (key, tn)), identity: Some(identity), fence })
    }

    /// The key check of a CONNECT of keyed export `i`: without a proof it gets a CHALLENGE; a
    /// retry of a granted CONNECT gets the same ACCEPT again; else its proof must answer a live
    /// challenge. Returns the challenge's target nonce and the export's key when the proof
    /// checked out, `None` when the CONNECT was answered here.
    fn check_key(
        &mut self,
        now: Instant,
        peer: &Peer,
        c: &Connect<'_>,
        msg: &Message<'_>,
        i: usize,
        out: &mut Answer,
    ) -> Option<(u64, Psk)> {
        let key = self.exports[i].key.clone().expect("check_key is called for keyed exports only");
        let (src, env_in) = (peer.src, &peer.env_in);
        let retry = c.proof.is_some() && self.acceptor.is_retry(src, env_in, c);
        match self.challenges.check(now, &key, peer.frame(msg), retry, auth::random_u64) {
            KeyCheck::Challenge(tn) => {
                let env = Envelope { session: env_in.session, ..peer.reply };
                reply(&env, &Message::Challenge(Challenge { nonce: c.nonce, target_nonce: tn }), out);
                None
            }
            KeyCheck::NoRoom => None, // the table is full of live challenges: no answer
            KeyCheck::Retry => {
                // A retry of a CONNECT that was granted (its ACCEPT lost): the same ACCEPT,
                // nothing else.
                let mut ids = auth::random_u64;
                let mut buf = vec![0u8; REPLY_BUF];
                if let Some(Accepted::Reply(len)) =
                    self.acceptor.handle_keyed(now, peer.frame(msg), &mut ids, &mut buf, None)
                {
                    buf.truncate(len);
                    out.replies.push(buf);
                }
                None
            }
            KeyCheck::Proven(tn) => Some((tn, key)),
            KeyCheck::Failed => {
                if PEER_LOGS.allow() {
                    tracing::warn!(%src, export = %c.export, "refused: wrong or replayed key proof");
                }
                out.drops.denied_key += 1;
                self.refuse(peer, i, c.nonce, RejectReason::AuthFailed, None, out);
                None
            }
        }
    }

    /// Whether a CONNECT may join the session it names (if that exists): a session created
    /// with a host id takes channels only from that host, and a live channel is replaced only
    /// from its own MAC (a reconnect); another peer that read the session id off the wire
    /// cannot take it over. Refused here otherwise.
    fn may_join(&mut self, peer: &Peer, c: &Connect<'_>, i: usize, out: &mut Answer) -> bool {
        let (src, env_in) = (peer.src, &peer.env_in);
        let Some(s) = self.registry.get(&env_in.session) else { return true };
        let wrong_host = !s.identity.starts_with(b"mac:") && c.host != Some(s.identity);
        let live_elsewhere =
            s.channels.get(&env_in.channel).is_some_and(|ch| !ch.dead.load(Ordering::Relaxed) && ch.peer != src);
        if !(wrong_host || live_elsewhere) {
            return true;
        }
        if PEER_LOGS.allow() {
            tracing::warn!(%src, export = %c.export, session = format_args!("{:016x}", env_in.session),
                channel = env_in.channel, "refused: a join from another host, or a takeover of a live channel");
        }
        out.drops.denied_mac += 1;
        self.refuse(peer, i, c.nonce, RejectReason::NotAllowed, None, out);
        false
    }

    /// A CONNECT creating a session of export `i` for initiator `identity`: refused IN_USE
    /// (`None`) when another initiator holds the export and it is not `shared`; else the
    /// sessions of the same initiator it fences.
    fn exclusive(
        &mut self,
        peer: &Peer,
        c: &Connect<'_>,
        i: usize,
        identity: [u8; 16],
        out: &mut Answer,
    ) -> Option<Vec<u64>> {
        let holder = self
            .registry
            .values()
            .find(|s| s.meta.export == i && s.identity != identity && !s.meta.is_fenced())
            .map(|s| s.mac);
        if let (false, Some(holder)) = (self.exports[i].shared, holder) {
            if PEER_LOGS.allow() {
                tracing::warn!(src = %peer.src, export = %c.export, %holder, "refused: the export is attached by another initiator");
            }
            self.refuse(peer, i, c.nonce, RejectReason::InUse, Some(holder), out);
            return None;
        }
        Some(
            self.registry
                .iter()
                .filter(|(_, s)| s.meta.export == i && s.identity == identity && !s.meta.is_fenced())
                .map(|(&sid, _)| sid)
                .collect(),
        )
    }

    /// The acceptor's answer to a DISCOVER or an admitted CONNECT: a reply, or a new channel
    /// (and perhaps session) and its ACCEPT.
    fn accept(
        &mut self,
        now: Instant,
        g: usize,
        peer: &Peer,
        msg: &Message<'_>,
        admission: Admission,
        out: &mut Answer,
    ) {
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
        match self.acceptor.handle_steered(now, peer.frame(msg), channel_addr, &mut ids, &mut buf, keyed) {
            Some(Accepted::Reply(len)) => {
                if self.acceptor.busy() != busy_before && PEER_LOGS.allow() {
                    tracing::warn!(src = %peer.src, busy = ?self.acceptor.busy(), "refused a CONNECT: a session or channel limit is full");
                }
                buf.truncate(len);
                out.replies.push(buf);
            }
            Some(Accepted::Channel { session, export, channel, len }) => {
                if let (Some(_), Message::Connect(c)) = (&admission.keyed, msg) {
                    self.challenges.granted(peer.src, c.nonce); // spent by its grant
                }
                let at = Joining { g, k: serve_on, session, export };
                self.open_channel(now, peer, at, channel, admission, out);
                buf.truncate(len);
                out.replies.push(buf);
            }
            None => {}
        }
    }

    /// Adds an accepted channel to its session, creating the session (and fencing the older
    /// sessions of the same initiator) if it is new: the channel goes to the part held by the
    /// thread serving its NIC (`at.k`), at once when that is the thread handling the CONNECT
    /// (`at.g`, through `out`), else as a message. Its home is recorded in the session's
    /// directory before the ACCEPT goes out. A reconnect on the same index replaces the
    /// channel, and one that moves to another thread leaves its old thread's part.
    fn open_channel(
        &mut self,
        now: Instant,
        peer: &Peer,
        at: Joining,
        channel: Box<Channel>,
        admission: Admission,
        out: &mut Answer,
    ) {
        let Joining { g, k, session, export } = at;
        let src = peer.src;
        let idx = channel.envelope().channel;
        let Admission { identity, fence, .. } = admission;
        let h = self.thread_of.get(k).copied().unwrap_or(g);
        let log = PEER_LOGS.allow();
        if !self.registry.contains_key(&session) {
            for &old in &fence {
                self.fence(old, session);
            }
            let e = &self.exports[export];
            let geometry = ExportGeometry { size: e.spec.size, read_only: e.read_only, discard: true };
            if log {
                tracing::info!(%src, export = %e.spec.name, session = format_args!("{session:016x}"), "new session");
            }
            let waits_for =
                fence.iter().filter_map(|old| self.registry.get(old)).map(|o| Arc::downgrade(&o.meta)).collect();
            let entry = Entry {
                meta: self.new_meta(session, export, geometry),
                identity: identity.unwrap_or_else(|| mac_identity(src)),
                mac: src,
                waits_for,
                channels: BTreeMap::new(),
                posted: vec![0; self.threads()],
                last_join: now,
            };
            self.registry.insert(session, entry);
        }
        let Some(e) = self.registry.get_mut(&session) else { return };
        if log {
            tracing::info!(%src, session = format_args!("{session:016x}"), channel = idx, params = ?channel.params(),
                nic = %self.nic_names[k], addr = %channel.envelope().src, "channel open");
        }
        // The home's records stay with the part where the index first joined.
        e.meta.directory.register(idx, h as PartId);
        let dead = Arc::new(AtomicBool::new(false));
        let entry = ChannelEntry { thread: h, nic: k, peer: src, dead: Arc::clone(&dead) };
        if let Some(old) = e.channels.insert(idx, entry).filter(|old| old.thread != h) {
            self.post.send(old.thread, ThreadMsg::Leave { sid: session, channel: idx, dead: old.dead });
        }
        e.posted[h] += 1;
        e.last_join = now;
        let opening = Box::new(Opening {
            meta: Arc::clone(&e.meta),
            nic: k,
            channel,
            dead,
            waits_for: e.waits_for.clone(),
            exports: Arc::clone(&self.exports),
        });
        if h == g {
            out.open = Some(opening);
        } else {
            self.post.send(h, ThreadMsg::Open(opening));
        }
    }

    /// Fences session `old` for the new session `by` of the same initiator: its storage jobs
    /// not started are not run, and each thread holding a part of it closes its channels,
    /// answers its reads waiting for memory ABORTED and marks its queued jobs not to run; `by`
    /// runs nothing until every storage job of `old` has ended, so no write of the old session
    /// lands after one of the new.
    pub(super) fn fence(&mut self, old: u64, by: u64) {
        let Some(e) = self.registry.get(&old) else { return };
        e.meta.fence();
        self.fenced += 1;
        if PEER_LOGS.allow() {
            tracing::warn!(
                session = format_args!("{old:016x}"),
                by = format_args!("{by:016x}"),
                "session fenced: the same initiator attached again"
            );
        }
        for (h, _) in e.posted.iter().enumerate().filter(|(_, &n)| n > 0) {
            self.post.send(h, ThreadMsg::Fence { old });
        }
    }

    /// Refuses a CONNECT of export `i` with `reason` (counted as denied).
    fn refuse(
        &mut self,
        peer: &Peer,
        i: usize,
        nonce: u64,
        reason: RejectReason,
        holder: Option<MacAddr>,
        out: &mut Answer,
    ) {
        self.denied[i] += 1;
        reply(&peer.reply, &Message::Reject(Reject { nonce, reason, holder }), out);
    }
}

/// Where an accepted channel goes: the thread handling its CONNECT, the NIC that serves it,
/// its session and export.
struct Joining {
    g: usize,
    k: usize,
    session: u64,
    export: usize,
}

/// Queues `msg`, addressed by `env`, as a reply.
fn reply(env: &Envelope, msg: &Message<'_>, out: &mut Answer) {
    let mut buf = vec![0u8; REPLY_BUF];
    let len = msg.emit(env, &mut buf);
    buf.truncate(len);
    out.replies.push(buf);
}
