//! The target's view of one initiator's session: its channels and the executed-tag ledger.

use std::collections::{BTreeMap, VecDeque};

use tyche_wire::{Frame, Op, Request, Status, WireError};

use crate::channel::{Channel, ChannelEvent, DeadReason, DropReason, Received, Role, Transmit};
use crate::config::TAG_WINDOW;
use crate::time::{earliest, Instant};

/// What the target serves in a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportGeometry {
    /// Size in bytes.
    pub size: u64,
    /// Whether writes, discards and write-zeroes are refused.
    pub read_only: bool,
    /// Whether DISCARD is supported.
    pub discard: bool,
}

/// Something the caller must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetEvent {
    /// Execute `request` and call [`TargetSession::complete`]. Write data is in `damq` slot
    /// `request.damq` of channel `channel`; read data goes there.
    Execute {
        /// Channel index.
        channel: u16,
        /// The request (its `remq` names it in [`TargetSession::complete`]).
        request: Request,
    },
    /// A channel died (its slots are reclaimed; requests being executed on it may still be
    /// completed, and nothing is sent).
    ChannelDead {
        /// Channel index.
        channel: u16,
        /// Why.
        reason: DeadReason,
    },
}

/// Why [`TargetSession::handle_frame`] did not use a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TargetDrop {
    /// Not a valid Tyche frame.
    Wire(WireError),
    /// For another session, or a channel or peer this session does not have.
    NotOurs,
    /// The channel refused it.
    Channel(DropReason),
}

/// What [`TargetSession::handle_frame`] did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetInbound<'a> {
    /// Used.
    Consumed,
    /// Write data: it belongs in `damq` slot `damq` of channel `channel` at byte `offset`.
    Write {
        /// Channel index.
        channel: u16,
        /// `damq` slot.
        damq: u16,
        /// Byte offset within the request's data.
        offset: u32,
        /// The bytes, borrowed from the frame.
        payload: &'a [u8],
    },
    /// Not used.
    Dropped(TargetDrop),
}

#[derive(Debug)]
enum Ledger {
    /// Being executed; these copies (channel, remq) wait for its status.
    InProgress(Vec<(u16, u16)>),
    /// Executed with this status.
    Done(Status),
}

/// Bound on the ledger: the initiator keeps its tags within [`TAG_WINDOW`] of its floor.
const LEDGER_LIMIT: usize = TAG_WINDOW as usize;

/// One initiator's session on the target.
///
/// Executes each modifying request (WRITE, DISCARD, WRITE_ZEROES) at most once per tag, however
/// many copies arrive on however many channels: a copy of an executed tag gets the recorded
/// status, and a copy below the initiator's floor is refused, so a late duplicate of an old write
/// is never applied over a newer one.
#[derive(Debug)]
pub struct TargetSession {
    id: u64,
    ethertype: u16,
    geometry: ExportGeometry,
    channels: Vec<Option<Channel>>,
    floor: u64,
    ledger: BTreeMap<u64, Ledger>,
    events: VecDeque<TargetEvent>,
    duplicates_suppressed: u64,
}

impl TargetSession {
    /// A session with no channels yet.
    pub fn new(id: u64, ethertype: u16, geometry: ExportGeometry) -> Self {
        TargetSession {
            id,
            ethertype,
            geometry,
            channels: Vec::new(),
            floor: 0,
            ledger: BTreeMap::new(),
            events: VecDeque::new(),
            duplicates_suppressed: 0,
        }
    }

    /// Session id.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// The export served.
    pub fn geometry(&self) -> &ExportGeometry {
        &self.geometry
    }
    /// Copies of already executed modifying requests that were not executed again.
    pub fn duplicates_suppressed(&self) -> u64 {
        self.duplicates_suppressed
    }
    /// The channel with index `i`, if any.
    pub fn channel(&self, i: u16) -> Option<&Channel> {
        self.channels.get(i as usize)?.as_ref()
    }
    /// Whether every channel is dead (the session can be reclaimed once nothing executes).
    pub fn all_dead(&self) -> bool {
        self.channels.iter().flatten().all(|c| c.dead().is_some())
    }

    /// Adds a channel, replacing (and aborting) any earlier one with the same index.
    pub fn add_channel(&mut self, channel: Channel) {
        assert_eq!(channel.role(), Role::Target);
        assert_eq!(channel.envelope().session, self.id);
        let idx = channel.envelope().channel as usize;
        if self.channels.len() <= idx {
            self.channels.resize_with(idx + 1, || None);
        }
        if let Some(old) = self.channels[idx].as_mut() {
            old.abort();
        }
        self.channels[idx] = Some(channel);
    }

    /// Hands the session a received frame.
    pub fn handle_frame<'a>(&mut self, now: Instant, bytes: &'a [u8]) -> TargetInbound<'a> {
        let frame = match Frame::new_checked(bytes, self.ethertype) {
            Ok(f) => f,
            Err(e) => return TargetInbound::Dropped(TargetDrop::Wire(e)),
        };
        if frame.session() != self.id {
            return TargetInbound::Dropped(TargetDrop::NotOurs);
        }
        let idx = frame.channel();
        let Some(Some(ch)) = self.channels.get_mut(idx as usize) else {
            return TargetInbound::Dropped(TargetDrop::NotOurs);
        };
        if frame.src() != ch.envelope().dst {
            return TargetInbound::Dropped(TargetDrop::NotOurs);
        }
        let msg = match frame.parse_borrowed() {
            Ok(m) => m,
            Err(e) => return TargetInbound::Dropped(TargetDrop::Wire(e)),
        };
        let out = match ch.handle(now, &msg) {
            Received::Consumed => TargetInbound::Consumed,
            Received::Dropped(r) => TargetInbound::Dropped(TargetDrop::Channel(r)),
            Received::Placed(p) => {
                TargetInbound::Write { channel: idx, damq: p.damq, offset: p.offset, payload: p.payload }
            }
        };
        self.drain(idx);
        out
    }

    fn drain(&mut self, idx: u16) {
        while let Some(ev) = self.channels[idx as usize].as_mut().and_then(Channel::poll_event) {
            match ev {
                ChannelEvent::Request(ready) => self.admit(idx, ready.request),
                ChannelEvent::Dead(reason) => self.events.push_back(TargetEvent::ChannelDead { channel: idx, reason }),
                ChannelEvent::Completed { .. } => unreachable!("target channels emit no completions"),
            }
        }
    }

    fn reply(&mut self, idx: u16, remq: u16, status: Status) {
        if let Some(ch) = self.channels[idx as usize].as_mut() {
            ch.complete(remq, status);
        }
    }

    /// A request is ready on channel `idx`: check it, deduplicate it, hand it to the caller.
    fn admit(&mut self, idx: u16, r: Request) {
        if r.floor > self.floor {
            self.floor = r.floor;
            // Executed tags below the floor can never arrive again except as stale copies,
            // which the floor check refuses.
            let keep = self.ledger.split_off(&self.floor);
            let old = std::mem::replace(&mut self.ledger, keep);
            for (tag, entry) in old {
                if let Ledger::InProgress(w) = entry {
                    self.ledger.insert(tag, Ledger::InProgress(w));
                }
            }
        }
        if r.tag < self.floor {
            self.duplicates_suppressed += 1;
            return self.reply(idx, r.remq, Status::Aborted);
        }
        let g = self.geometry;
        if r.offset.saturating_add(r.length as u64) > g.size {
            return self.reply(idx, r.remq, Status::OutOfRange);
        }
        if g.read_only && r.op.modifies() {
            return self.reply(idx, r.remq, Status::ReadOnly);
        }
        if r.op == Op::Discard && !g.discard {
            return self.reply(idx, r.remq, Status::Unsupported);
        }
        if r.op.modifies() {
            let full = self.ledger.len() >= LEDGER_LIMIT;
            match self.ledger.get_mut(&r.tag) {
                None if full => return self.reply(idx, r.remq, Status::Invalid),
                None => {
                    self.ledger.insert(r.tag, Ledger::InProgress(Vec::new()));
                }
                Some(Ledger::InProgress(waiters)) => {
                    self.duplicates_suppressed += 1;
                    waiters.push((idx, r.remq));
                    return;
                }
                Some(Ledger::Done(status)) => {
                    let status = *status;
                    self.duplicates_suppressed += 1;
                    return self.reply(idx, r.remq, status);
                }
            }
        }
        self.events.push_back(TargetEvent::Execute { channel: idx, request: r });
    }

    /// Reports the outcome of an [`TargetEvent::Execute`]. For a successful read, the data must
    /// be in the request's `damq` slot. Returns `false` if no such request was executing.
    pub fn complete(&mut self, channel: u16, remq: u16, status: Status) -> bool {
        let Some(Some(ch)) = self.channels.get_mut(channel as usize) else { return false };
        let Some(req) = ch.complete(remq, status) else { return false };
        if req.op.modifies() {
            let waiters = match self.ledger.insert(req.tag, Ledger::Done(status)) {
                Some(Ledger::InProgress(w)) => w,
                _ => Vec::new(),
            };
            if req.tag < self.floor {
                self.ledger.remove(&req.tag);
            }
            for (c, r) in waiters {
                self.reply(c, r, status);
            }
        }
        true
    }

    /// Starts an orderly close of every channel: each sends DISCONNECT with `reason` and is dead
    /// after it (target shutdown).
    pub fn close(&mut self, reason: tyche_wire::DisconnectReason) {
        for c in self.channels.iter_mut().flatten() {
            c.close(reason);
        }
    }

    /// Writes the next frame channel `channel` wants to send into `buf`.
    pub fn poll_transmit(&mut self, now: Instant, channel: u16, buf: &mut [u8]) -> Option<Transmit> {
        let t = self.channels.get_mut(channel as usize)?.as_mut()?.poll_transmit(now, buf);
        self.drain(channel);
        t
    }

    /// Whether channel `channel` has a frame to send now.
    pub fn wants_transmit(&self, channel: u16) -> bool {
        self.channel(channel).is_some_and(Channel::wants_transmit)
    }

    /// The next time [`TargetSession::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.channels.iter().flatten().fold(None, |t, c| earliest(t, c.poll_timeout()))
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        for i in 0..self.channels.len() {
            if let Some(c) = self.channels[i].as_mut() {
                c.handle_timeout(now);
                self.drain(i as u16);
            }
        }
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<TargetEvent> {
        self.events.pop_front()
    }

    /// Indices of the channels, dead ones included.
    pub fn channel_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.channels.iter().enumerate().filter(|(_, c)| c.is_some()).map(|(i, _)| i as u16)
    }
}
