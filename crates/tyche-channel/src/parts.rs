//! A session's parts held together by one owner: the simulator, or a target whose threads still
//! share one lock. Each part is a [`TargetSession`] ([`TargetSession::part`]) holding some
//! channels; [`SessionParts`] routes a call to the part that holds the channel, and hands every
//! message one part sends another to a [`Courier`], which decides when it is delivered (at once,
//! after a delay, or by the destination's own thread) through [`SessionParts::deliver`].

use std::collections::BTreeMap;
use std::sync::Arc;

use tyche_wire::{DisconnectReason, Request, Status};

use crate::channel::{Channel, Pieces, Transmit};
use crate::target::{Directory, ExportGeometry, PartMessage, TargetEvent, TargetInbound, TargetSession};
use crate::time::Instant;

/// Carries the messages between the parts of a session ([`SessionParts`]).
pub trait Courier {
    /// A message from part `from` to part `to`, sent at `now` (the owner's clock at its last
    /// call that carried one). Messages between the same two parts must be delivered in the
    /// order posted.
    fn post(&mut self, now: Instant, from: usize, to: usize, msg: PartMessage);
}

/// A session's parts and who holds which channel.
#[derive(Debug)]
pub struct SessionParts<C> {
    parts: Vec<TargetSession>,
    /// The part holding each channel index now.
    part_of: BTreeMap<u16, usize>,
    courier: C,
    /// The time of the owner's last call that carried one (for messages posted by calls that
    /// do not).
    now: Instant,
    /// Messages posted.
    posted: u64,
}

impl<C: Courier> SessionParts<C> {
    /// Session `id` in `parts` parts (at least one) sharing one [`Directory`].
    pub fn new(id: u64, ethertype: u16, geometry: ExportGeometry, parts: usize, courier: C) -> Self {
        let directory = Directory::new();
        let parts = (0..parts.max(1))
            .map(|p| TargetSession::part(id, ethertype, geometry, p as u32, Arc::clone(&directory)))
            .collect();
        SessionParts { parts, part_of: BTreeMap::new(), courier, now: Instant(0), posted: 0 }
    }

    /// Session id.
    pub fn id(&self) -> u64 {
        self.parts[0].id()
    }
    /// How many parts.
    pub fn part_count(&self) -> usize {
        self.parts.len()
    }
    /// The part holding channel index `channel` now.
    pub fn part_of(&self, channel: u16) -> Option<usize> {
        self.part_of.get(&channel).copied()
    }
    /// The courier.
    pub fn courier(&self) -> &C {
        &self.courier
    }
    /// The courier, to take messages out of it for [`SessionParts::deliver`].
    pub fn courier_mut(&mut self) -> &mut C {
        &mut self.courier
    }
    /// Channel `i`, if any (dead ones included).
    pub fn channel(&self, i: u16) -> Option<&Channel> {
        self.parts[self.part_of(i)?].channel(i)
    }
    /// Indices of the channels, dead ones included.
    pub fn channel_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.part_of.keys().copied()
    }
    /// Whether every channel of every part is dead.
    pub fn all_dead(&self) -> bool {
        self.parts.iter().all(TargetSession::all_dead)
    }
    /// Copies not executed again, all parts together.
    pub fn duplicates_suppressed(&self) -> u64 {
        self.parts.iter().map(TargetSession::duplicates_suppressed).sum()
    }
    /// Copies decided by their home's part, and messages posted between parts.
    pub fn forwarding(&self) -> (u64, u64) {
        (self.parts.iter().map(TargetSession::forwarded).sum(), self.posted)
    }
    /// Messages that named no copy of the part they reached (a bug).
    pub fn stray_messages(&self) -> u64 {
        self.parts.iter().map(TargetSession::stray_messages).sum()
    }
    /// Copies waiting for their home's decision, all parts together.
    pub fn awaiting_decision(&self) -> usize {
        self.parts.iter().map(TargetSession::awaiting_decision).sum()
    }
    /// Whether channel `channel` has a frame to send now.
    pub fn wants_transmit(&self, channel: u16) -> bool {
        self.part_of(channel).is_some_and(|p| self.parts[p].wants_transmit(channel))
    }
    /// The earliest timer of any part.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.parts.iter().filter_map(TargetSession::poll_timeout).min()
    }

    /// Sets the clock for the messages of calls that carry none (a storage completion, say).
    pub fn at(&mut self, now: Instant) {
        self.now = self.now.max(now);
    }

    /// Adds a channel to part `part` (clamped to the parts there are). An index held by another
    /// part leaves it ([`TargetSession::abort_channel`]); its records stay where it first joined.
    pub fn add_channel(&mut self, part: usize, channel: Channel) {
        let p = part.min(self.parts.len() - 1);
        let idx = channel.envelope().channel;
        if let Some(old) = self.part_of.insert(idx, p).filter(|&old| old != p) {
            self.parts[old].abort_channel(idx);
        }
        self.parts[p].add_channel(channel);
        self.post();
    }

    /// A received frame, taken by part `part` (clamped): the part of the link it came on, or of
    /// the channel its header names.
    pub fn handle_frame<'a>(
        &mut self,
        now: Instant,
        part: usize,
        bytes: &'a [u8],
        scratch: &'a mut Vec<u8>,
    ) -> TargetInbound<'a> {
        self.at(now);
        let p = part.min(self.parts.len() - 1);
        let r = self.parts[p].handle_frame(now, bytes, scratch);
        self.post();
        r
    }

    /// [`SessionParts::handle_frame`] for a frame in pieces ([`TargetSession::handle_frame_pieces`]).
    pub fn handle_frame_pieces<'a>(
        &mut self,
        now: Instant,
        part: usize,
        pieces: &[&'a [u8]],
        scratch: &'a mut Vec<u8>,
        gather: &'a mut Vec<u8>,
    ) -> TargetInbound<'a, Pieces<'a>> {
        self.at(now);
        let p = part.min(self.parts.len() - 1);
        let r = self.parts[p].handle_frame_pieces(now, pieces, scratch, gather);
        self.post();
        r
    }

    /// Completes a request handed out on `channel`: on the part holding the index now, or on
    /// the one it left, which still has it. `false`: no part had it.
    pub fn complete(&mut self, channel: u16, request: &Request, status: Status) -> bool {
        let first = self.part_of(channel).unwrap_or(0);
        let order = std::iter::once(first).chain((0..self.parts.len()).filter(|&p| p != first));
        let mut done = false;
        for p in order {
            if self.parts[p].complete(channel, request, status) {
                done = true;
                break;
            }
        }
        self.post();
        done
    }

    /// The next event of any part.
    pub fn poll_event(&mut self) -> Option<TargetEvent> {
        self.parts.iter_mut().find_map(TargetSession::poll_event)
    }

    /// Starts an orderly close of every channel of every part.
    pub fn close(&mut self, reason: DisconnectReason) {
        for p in &mut self.parts {
            p.close(reason);
        }
    }

    /// Fences every part ([`TargetSession::fence`]): each closes its channels, and each request
    /// of `not_started` is answered ABORTED by the part that holds it. Returns how many were.
    pub fn fence(&mut self, not_started: impl IntoIterator<Item = (u16, Request)>) -> usize {
        for p in &mut self.parts {
            p.fence(std::iter::empty());
        }
        not_started.into_iter().filter(|(c, r)| self.complete(*c, r, Status::Aborted)).count()
    }

    /// The next frame channel `channel` wants to send ([`TargetSession::poll_transmit`]).
    pub fn poll_transmit(&mut self, now: Instant, channel: u16, buf: &mut [u8]) -> Option<Transmit> {
        self.at(now);
        let p = self.part_of(channel)?;
        let t = self.parts[p].poll_transmit(now, channel, buf);
        self.post();
        t
    }

    /// Seals a frame of channel `channel` ([`TargetSession::seal`]).
    pub fn seal(&mut self, channel: u16, buf: &mut [u8], len: usize) -> usize {
        match self.part_of(channel) {
            Some(p) => self.parts[p].seal(channel, buf, len),
            None => len,
        }
    }

    /// Runs every part's due timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.at(now);
        for p in &mut self.parts {
            if p.poll_timeout().is_some_and(|t| t <= now) {
                p.handle_timeout(now);
            }
        }
        self.post();
    }

    /// Delivers `msgs` (taken from the courier) to part `to`.
    pub fn deliver(&mut self, to: usize, msgs: impl IntoIterator<Item = PartMessage>) {
        if let Some(part) = self.parts.get_mut(to) {
            for m in msgs {
                part.handle_message(m);
            }
        }
        self.post();
    }

    /// Hands every part's new messages to the courier.
    fn post(&mut self) {
        for from in 0..self.parts.len() {
            self.posted += post_messages(&mut self.parts[from], from, self.now, &mut self.courier);
        }
    }
}

/// Hands the new messages of part `from` of a session to `courier`, in order; how many. The
/// same wherever the parts live: [`SessionParts`] (the simulator) and tyched's network threads
/// (whose courier is their queues to each other).
pub fn post_messages(part: &mut TargetSession, from: usize, now: Instant, courier: &mut impl Courier) -> u64 {
    let mut posted = 0;
    while let Some((to, msg)) = part.poll_message() {
        posted += 1;
        courier.post(now, from, to as usize, msg);
    }
    posted
}
