//! The handshake: DISCOVER and CONNECT frames, answered on the NIC they came in on.
//!
//! The checks and decisions are `tyche_channel::Admission`'s (the simulator runs the same):
//! the export's MAC allow-list, its key (a CHALLENGE round), who may join an existing session,
//! who holds an export that is not `shared`, the acceptor's limits and grants, and which older
//! sessions of the same initiator a new session fences. Around them the control
//! ([`Control::on_handshake`], under its lock) does what needs the daemon: which NIC queue
//! serves a new channel, counters and log lines, the session's shared state for its parts,
//! and the messages to the threads ([`Control::fence`]). What the handshake gives the thread
//! that received the frame ([`Answer`]: replies for its NIC's control queue,
//! `limits.control_queue`; drop counts; a channel for one of its own NICs) is applied by that
//! thread after the lock; a channel for another thread's NIC goes to that thread as a message.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tyche_channel::auth;
use tyche_channel::{
    Accepted, Admitted, Channel, ExportAccess, ExportGeometry, FenceWait, Grant, HandshakeFrame, Instant, PartId,
    Refused, Verdict,
};
use tyche_wire::{Envelope, Frame, MacAddr, Message};

use super::control::Opening;
use super::control::{ChannelEntry, Control, SessionEntry, ThreadMsg};
use super::PEER_LOGS;
use crate::stats::Drops;

/// Room for the largest reply: a DISCOVER_REPLY of 8 exports with 64-byte names (672 bytes).
const REPLY_BUF: usize = 2048;

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
        let mut out = Answer::default();
        if at.stopping && matches!(msg, Message::Connect(_)) {
            out.drops.shutting_down += 1;
            return out;
        }
        let env_in = Envelope::of(frame);
        let hf = HandshakeFrame { local: at.local, src: frame.src(), env: &env_in, msg };
        let exports = Arc::clone(&self.exports);
        let access = match msg {
            Message::Connect(c) => exports.iter().position(|e| e.spec.name == c.export).map(|index| {
                let e = &exports[index];
                ExportAccess { index, allow: &e.allow, key: e.key.as_ref(), shared: e.shared }
            }),
            _ => None,
        };
        let mut buf = vec![0u8; REPLY_BUF];
        let live = |c: &ChannelEntry| !c.dead.load(Ordering::Relaxed);
        match self.admission.admit(now, hf, access, auth::random_u64, live, &mut buf) {
            Verdict::Admit(admitted) => self.accept(now, at, hf, admitted, &mut out),
            Verdict::Answer { len, refused } => {
                if let (Some(why), Some(a), Message::Connect(c)) = (refused, access, msg) {
                    self.refused(at, hf, c.export, a.index, why, &mut out);
                }
                buf.truncate(len);
                out.replies.push(buf);
            }
            Verdict::Quiet => {}
        }
        out
    }

    /// Counts and logs a CONNECT of export `i` (`name`) that the admission refused.
    fn refused(&mut self, at: Arrival, hf: HandshakeFrame<'_>, name: &str, i: usize, why: Refused, out: &mut Answer) {
        self.denied[i] += 1;
        let (src, log) = (hf.src, PEER_LOGS.allow());
        match why {
            Refused::MacNotAllowed => {
                out.drops.denied_mac += 1;
                if log {
                    tracing::warn!(%src, export = %name, nic = %self.nic_names[at.nic], "refused: MAC not allowed");
                }
            }
            Refused::KeyFailed => {
                out.drops.denied_key += 1;
                if log {
                    tracing::warn!(%src, export = %name, "refused: wrong or replayed key proof");
                }
            }
            Refused::NotJoinable => {
                out.drops.denied_mac += 1;
                if log {
                    tracing::warn!(%src, export = %name, session = format_args!("{:016x}", hf.env.session),
                        channel = hf.env.channel, "refused: a join from another host, or a takeover of a live channel");
                }
            }
            Refused::InUse(holder) => {
                if log {
                    tracing::warn!(%src, export = %name, %holder, "refused: the export is attached by another initiator");
                }
            }
        }
    }

    /// The acceptor's answer to a DISCOVER or an admitted CONNECT: a reply, or a new channel
    /// (and perhaps session) and its ACCEPT.
    fn accept(&mut self, now: Instant, at: Arrival, hf: HandshakeFrame<'_>, admitted: Admitted, out: &mut Answer) {
        let mut ids = auth::random_u64;
        let busy_before = self.admission.acceptor.busy();
        let mut buf = vec![0u8; REPLY_BUF];
        // With queue addresses, the channel goes to a transport (NIC queue) of the interface
        // and is named by its address; the ACCEPT still goes out where the CONNECT came in.
        let (serve_on, channel_addr) = match hf.msg {
            Message::Connect(_) => self.queue_addresses.assign(at.nic, |j| self.channels_on(j)),
            _ => (at.nic, None),
        };
        let channel_addr = channel_addr.unwrap_or(at.local);
        match self.admission.accept(now, hf, &admitted, channel_addr, &mut ids, &mut buf) {
            Some(Accepted::Reply(len)) => {
                let busy = self.admission.acceptor.busy();
                if busy != busy_before && PEER_LOGS.allow() {
                    tracing::warn!(src = %hf.src, ?busy, "refused a CONNECT: a session or channel limit is full");
                }
                buf.truncate(len);
                out.replies.push(buf);
            }
            Some(Accepted::Channel { session, export, channel, len }) => {
                let grant = Grant { session, export, channel: channel.envelope().channel, peer: hf.src };
                let to = Joining { g: at.thread, k: serve_on, grant };
                self.open_channel(now, to, channel, admitted, out);
                buf.truncate(len);
                out.replies.push(buf);
            }
            None => {}
        }
    }

    /// Adds an accepted channel to its session (the admission makes the session, fencing the
    /// older sessions of the same initiator, when it is new): the channel goes to the part
    /// held by the thread serving its NIC (`at.k`), at once when that is the thread handling
    /// the CONNECT (`at.g`, through `out`), else as a message. Its home is recorded in the
    /// session's directory before the ACCEPT goes out. A reconnect on the same index replaces
    /// the channel, and one that moves to another thread leaves its old thread's part.
    fn open_channel(&mut self, now: Instant, at: Joining, channel: Box<Channel>, admitted: Admitted, out: &mut Answer) {
        let Joining { g, k, grant } = at;
        let Grant { session, export, channel: idx, peer: src } = grant;
        let h = self.thread_of.get(k).copied().unwrap_or(g);
        let log = PEER_LOGS.allow();
        let threads = self.threads();
        let e = &self.exports[export];
        let geometry = ExportGeometry { size: e.spec.size, read_only: e.read_only, discard: true };
        let new_session = || SessionEntry::new(session, export, geometry, threads, now);
        let dead = Arc::new(AtomicBool::new(false));
        let entry = ChannelEntry { thread: h, nic: k, dead: Arc::clone(&dead) };
        let joined = self.admission.join(grant, admitted, new_session, entry);
        if joined.created {
            if log {
                tracing::info!(%src, export = %e.spec.name, session = format_args!("{session:016x}"), "new session");
            }
            let old = joined.fenced.iter().filter_map(|&old| self.admission.session(old));
            let waits_for = FenceWait::fencing(old.map(|o| Arc::downgrade(&o.data.meta)).collect::<Vec<_>>());
            for &old in &joined.fenced {
                self.fence(old, session);
            }
            if let Some(s) = self.admission.session_mut(session) {
                s.data.waits_for = waits_for;
            }
        }
        if let Some(old) = joined.replaced.filter(|old| old.thread != h) {
            self.post.send(old.thread, ThreadMsg::Leave { sid: session, channel: idx, dead: old.dead });
        }
        let Some(s) = self.admission.session_mut(session) else { return };
        if log {
            tracing::info!(%src, session = format_args!("{session:016x}"), channel = idx, params = ?channel.params(),
                nic = %self.nic_names[k], addr = %channel.envelope().src, "channel open");
        }
        // The home's records stay with the part where the index first joined.
        let e = &mut s.data;
        e.meta.directory.register(idx, h as PartId);
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

    /// Tells the threads holding parts of session `old` that the new session `by` of the same
    /// initiator fenced it (`FenceWait::fencing` marked it: its storage jobs not started are
    /// not run): each closes its channels, answers ABORTED the requests waiting before storage
    /// and marks its queued jobs not to run; `by` runs nothing until every storage job of `old`
    /// has ended, so no write of the old session lands after one of the new.
    pub(super) fn fence(&mut self, old: u64, by: u64) {
        let Some(e) = self.admission.session(old) else { return };
        self.fenced += 1;
        if PEER_LOGS.allow() {
            tracing::warn!(
                session = format_args!("{old:016x}"),
                by = format_args!("{by:016x}"),
                "session fenced: the same initiator attached again"
            );
        }
        for (h, _) in e.data.posted.iter().enumerate().filter(|(_, &n)| n > 0) {
            self.post.send(h, ThreadMsg::Fence { old });
        }
    }
}

/// Where an accepted channel goes: the thread handling its CONNECT (`g`), the NIC that serves
/// it (`k`), and what the acceptor granted.
struct Joining {
    g: usize,
    k: usize,
    grant: Grant,
}
