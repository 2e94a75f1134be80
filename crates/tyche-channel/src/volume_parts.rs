//! An initiator volume's parts held together by one owner: tyche-init's engine threads while they
//! still share one lock, or the simulator. Each part is a [`Volume`] ([`Volume::part`]) holding
//! some channels and the requests submitted to it; [`VolumeParts`] gives a request to a part, a
//! part without a live channel's queue to one that has one ([`Volume::take_stranded`]), and every
//! hand-off and hand-back to a [`HandCourier`], which decides when [`VolumeParts::deliver`] hands
//! it over ([`AtOnce`]: at once; the simulator: after seeded delays). The messages carry their
//! data (a written part's to the adopter, a read part's back): the request buffers stay their
//! owner's, which hands [`exchange_part`] the buffer of each request it asks for.

use std::collections::VecDeque;
use std::sync::Arc;

use tyche_wire::DurabilityEpoch;

use crate::board::VolumeBoard;
use crate::channel::Channel;
use crate::initiator::{DurabilityDebt, Handback, Handoff, ReadBack, Volume, VolumeConfig, VolumeEvent};
use crate::scheduler::Scheduler;
use crate::time::Instant;

/// What travels between the parts of a volume, with its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandMessage {
    /// Part `from` hands a part of a request over ([`Volume::adopt`]).
    Handoff {
        /// The origin part.
        from: usize,
        /// What it hands over.
        handoff: Handoff,
    },
    /// What became of an adopted part ([`Volume::handed_back`]).
    Handback(Handback),
}

/// Carries the messages between the parts of a volume ([`VolumeParts`]).
pub trait HandCourier {
    /// A message from part `from` to part `to`, sent at `now`. Messages between the same two
    /// parts must be delivered in the order posted.
    fn post(&mut self, now: Instant, from: usize, to: usize, msg: HandMessage);
}

/// Part `p`'s (of `n`) side of the exchange between a volume's parts, the same wherever the
/// parts live (the simulator's [`VolumeParts`], tyche-init's engine threads): while the part has
/// no live channel, its queued requests go to the next part in ring order that has one
/// ([`Volume::take_stranded`], as [`HandMessage::Handoff`]); what it adopted and is done with
/// goes back to its origin ([`Volume::poll_handback`], as [`HandMessage::Handback`]).
/// `live(q)`: whether part `q` has a live channel, as the caller knows it; `request(id)`: the
/// buffer of this part's request `id`, which a written part's data is copied from. Returns the
/// handoffs posted.
pub fn exchange_part<'r>(
    volume: &mut Volume,
    p: usize,
    n: usize,
    live: impl Fn(usize) -> bool,
    request: impl Fn(u64) -> Option<&'r [u8]>,
    now: Instant,
    courier: &mut impl HandCourier,
) -> u64 {
    if n <= 1 {
        return 0;
    }
    let mut handoffs = 0;
    if volume.live_channels() == 0 && volume.queued_parts() > 0 {
        if let Some(to) = (1..n).map(|i| (p + i) % n).find(|&q| live(q)) {
            for mut handoff in volume.take_stranded() {
                handoff.carry_from(request(handoff.id()));
                handoffs += 1;
                courier.post(now, p, to, HandMessage::Handoff { from: p, handoff });
            }
        }
    }
    while let Some((to, back)) = volume.poll_handback() {
        courier.post(now, p, to, HandMessage::Handback(back));
    }
    handoffs
}

/// Delivers every message at the owner's next [`VolumeParts::exchange`].
#[derive(Debug, Default)]
pub struct AtOnce(VecDeque<(usize, HandMessage)>);

impl HandCourier for AtOnce {
    fn post(&mut self, _now: Instant, _from: usize, to: usize, msg: HandMessage) {
        self.0.push_back((to, msg));
    }
}

/// A volume's parts and the courier between them (see the module docs).
#[derive(Debug)]
pub struct VolumeParts<C> {
    parts: Vec<Volume>,
    /// The part the next event is taken from first.
    next_events: usize,
    handoffs: u64,
    /// Hand-offs an adopter refused ([`Volume::adopt`]).
    refused: u64,
    courier: C,
}

impl<C: HandCourier> VolumeParts<C> {
    /// A volume of `parts` parts (at least one) on `session`, each with a scheduler of its own.
    pub fn new(
        config: VolumeConfig,
        session: u64,
        ethertype: u16,
        now: Instant,
        parts: usize,
        mut scheduler: impl FnMut() -> Box<dyn Scheduler>,
        courier: C,
    ) -> Self {
        let board = VolumeBoard::new(parts, session);
        let parts = (0..board.parts())
            .map(|p| Volume::part(config, session, ethertype, scheduler(), now, Arc::clone(&board), p))
            .collect();
        VolumeParts { parts, next_events: 0, handoffs: 0, refused: 0, courier }
    }

    /// Part `p`.
    pub fn part(&mut self, p: usize) -> &mut Volume {
        &mut self.parts[p]
    }
    /// Every part.
    pub fn parts(&self) -> &[Volume] {
        &self.parts
    }
    /// The courier.
    pub fn courier(&self) -> &C {
        &self.courier
    }
    /// The courier, to take messages out of it for [`VolumeParts::deliver`].
    pub fn courier_mut(&mut self) -> &mut C {
        &mut self.courier
    }
    /// Parts of requests handed from one part to another so far.
    pub fn handoffs(&self) -> u64 {
        self.handoffs
    }
    /// Hand-offs refused on arrival so far (of a session the adopter had left, or of a part it
    /// already held).
    pub fn refused_handoffs(&self) -> u64 {
        self.refused
    }
    /// Channel `i` of whichever part holds it.
    pub fn channel(&self, i: u16) -> Option<&Channel> {
        self.parts.iter().find_map(|v| v.channel(i))
    }
    /// Channel indices of every part, dead ones included.
    pub fn channel_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.parts.iter().flat_map(Volume::channel_indices)
    }
    /// Live channels, all parts.
    pub fn live_channels(&self) -> usize {
        self.parts.iter().map(Volume::live_channels).sum()
    }
    /// Requests outstanding, all parts.
    pub fn outstanding(&self) -> usize {
        self.parts.iter().map(Volume::outstanding).sum()
    }
    /// The session (every part's once each has moved).
    pub fn session(&self) -> u64 {
        self.parts[0].session()
    }
    /// Sessions moved to ([`Volume::resumes`]; every part moves once per session).
    pub fn resumes(&self) -> u64 {
        self.parts[0].resumes()
    }
    /// FLUSHes failed for a possible loss, all parts.
    pub fn durability_errors(&self) -> u64 {
        self.parts.iter().map(Volume::durability_errors).sum()
    }

    /// The part a request should go to when `preferred` (its buffers' node's) is meant: that one
    /// while it has a live channel, else the next that has one, else `preferred` (it waits
    /// there for a path).
    pub fn submit_part(&self, preferred: usize) -> usize {
        let n = self.parts.len();
        if n == 1 {
            return 0;
        }
        let preferred = preferred % n;
        (0..n).map(|i| (preferred + i) % n).find(|&p| self.parts[p].live_channels() > 0).unwrap_or(preferred)
    }

    /// The durability epoch of the current session, once a channel of it joined.
    pub fn durability_epoch(&self) -> Option<DurabilityEpoch> {
        self.parts[0].durability_epoch()
    }
    /// [`Volume::unflushed_writes`], all parts.
    pub fn unflushed_writes(&self) -> bool {
        self.parts.iter().any(Volume::unflushed_writes)
    }
    /// [`Volume::durability_debt`], all parts together.
    pub fn durability_debt(&self) -> DurabilityDebt {
        self.parts.iter().map(Volume::durability_debt).fold(DurabilityDebt::Clear, DurabilityDebt::merge)
    }
    /// [`Volume::inherit_debt`] (on the board the parts share).
    pub fn inherit_debt(&mut self, debt: DurabilityDebt) {
        self.parts[0].inherit_debt(debt);
    }

    /// Closes every channel.
    pub fn close(&mut self) {
        for v in &mut self.parts {
            v.close();
        }
    }

    /// The next event of any part, the parts taken in turn.
    pub fn poll_event(&mut self) -> Option<VolumeEvent> {
        let n = self.parts.len();
        for i in 0..n {
            let p = (self.next_events + i) % n;
            if let Some(ev) = self.parts[p].poll_event() {
                self.next_events = (p + 1) % n;
                return Some(ev);
            }
        }
        None
    }

    /// Whether some part has requests outstanding (only then do the parts need to read the
    /// board: an idle volume's floors may lag as they like).
    pub fn busy(&self) -> bool {
        self.parts.iter().any(|v| v.outstanding() > 0)
    }

    /// The next time a part's timers are due ([`VolumeParts::handle_timeout`]).
    pub fn poll_timers(&self) -> Option<Instant> {
        self.parts.iter().filter_map(Volume::poll_timeout).min()
    }

    /// The next time a part should read the board ([`VolumeParts::refresh_due`]), while busy.
    pub fn refresh_at(&self) -> Option<Instant> {
        if !self.busy() {
            return None;
        }
        self.parts.iter().filter_map(Volume::refresh_at).min()
    }

    /// Runs every part's timers; [`VolumeParts::exchange`] follows.
    pub fn handle_timeout(&mut self, now: Instant) {
        for v in &mut self.parts {
            v.handle_timeout(now);
        }
    }

    /// While busy, lets each part whose refresh is due read the board ([`Volume::refresh`]).
    pub fn refresh_due(&mut self, now: Instant) {
        if !self.busy() {
            return;
        }
        for v in &mut self.parts {
            if v.refresh_at().is_some_and(|t| t <= now) {
                v.refresh(now);
            }
        }
    }

    /// Posts the queued requests of parts without a live channel to the next part that has one,
    /// and what adopters report back to the origins ([`exchange_part`] for each part);
    /// `request(p, id)`: the buffer of part `p`'s request `id`.
    pub fn exchange<'r>(&mut self, now: Instant, request: impl Fn(usize, u64) -> Option<&'r [u8]>) {
        let n = self.parts.len();
        if n == 1 {
            return;
        }
        let live: Vec<bool> = self.parts.iter().map(|v| v.live_channels() > 0).collect();
        for p in 0..n {
            // Checks the part's count of adopted parts against its parts (debug builds: the
            // simulator and the fuzz targets).
            let _ = self.parts[p].adopted_parts();
            let request = |id| request(p, id);
            self.handoffs += exchange_part(&mut self.parts[p], p, n, |q| live[q], request, now, &mut self.courier);
        }
    }

    /// Hands `msg` to part `to`; returns the read data a hand-back carries for its request
    /// ([`Volume::handed_back`]).
    pub fn deliver(&mut self, now: Instant, to: usize, msg: HandMessage) -> Option<ReadBack> {
        match msg {
            HandMessage::Handoff { from, handoff } => {
                self.refused += u64::from(!self.parts[to].adopt(now, from, handoff));
                None
            }
            HandMessage::Handback(back) => self.parts[to].handed_back(now, back),
        }
    }
}

impl VolumeParts<AtOnce> {
    /// [`VolumeParts::exchange`], delivering what it posts at once (and what that causes), for
    /// an owner that keeps no request buffers (written parts go over without data; read data
    /// carried back is dropped).
    pub fn settle(&mut self, now: Instant) {
        for _ in 0..4 {
            self.exchange(now, |_, _| None);
            if self.courier.0.is_empty() {
                return;
            }
            while let Some((to, msg)) = self.courier.0.pop_front() {
                self.deliver(now, to, msg);
            }
        }
    }
}
