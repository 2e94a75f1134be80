//! The initiator's volume in parts, as tyche-init's engine threads would hold it: each part is a
//! [`Volume`] ([`Volume::part`]) owning the channels of some paths (path `k` goes to part
//! `k % parts`) and the requests submitted to it, allocating tags from its own residue class and
//! sharing the floor and the durability state through a [`VolumeBoard`]. Each part reads the
//! others' floors on its own timer, late by a seeded 0.2 to 3 ms (a thread that was busy or
//! asleep), so the REQUESTs carry floors that lag as they would between threads. A part left
//! without a live channel hands its queued requests to the next part that has one, and the
//! adopter reports each back when done, both with seeded delays (in order between any two parts),
//! as over the bounded queues between engine threads. With one part it is exactly a [`Volume`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tyche_channel::{
    Channel, DurabilityDebt, Handback, Handoff, Inbound, Instant, IoRequest, LeastBytes, OutFrame, SubmitError, Volume,
    VolumeBoard, VolumeConfig, VolumeEvent,
};
use tyche_transport::SplitMix64;
use tyche_wire::Frame;

/// A volume in parts (see the module docs).
#[derive(Debug)]
pub(crate) struct PartedVolume {
    parts: Vec<Volume>,
    /// The part holding each channel index.
    part_of: HashMap<u16, usize>,
    /// When each part next reads the board.
    refresh: Vec<Instant>,
    /// The part the next event is taken from first.
    next_events: usize,
    ethertype: u16,
    rng: SplitMix64,
    /// Hand-offs and hand-backs on their way, by (due time, order sent): (to which part, what).
    in_flight: BTreeMap<(Instant, u64), (usize, Message)>,
    /// Due time of the last message from one part to another: later ones are not due earlier.
    last_due: HashMap<(usize, usize), Instant>,
    sent: u64,
    /// Parts of requests handed from one part to another so far.
    pub(crate) handoffs: u64,
}

/// What travels between the parts.
#[derive(Debug)]
enum Message {
    Handoff { from: usize, h: Handoff },
    Handback(Handback),
}

impl PartedVolume {
    /// A volume of `parts` parts on `session`, the refresh delays drawn from `seed`.
    pub(crate) fn new(
        config: VolumeConfig,
        session: u64,
        ethertype: u16,
        now: Instant,
        parts: usize,
        seed: u64,
    ) -> Self {
        let board = VolumeBoard::new(parts, session);
        let parts: Vec<Volume> = (0..parts.max(1))
            .map(|p| Volume::part(config, session, ethertype, Box::<LeastBytes>::default(), now, Arc::clone(&board), p))
            .collect();
        let refresh = vec![now; parts.len()];
        PartedVolume {
            parts,
            part_of: HashMap::new(),
            refresh,
            next_events: 0,
            ethertype,
            rng: SplitMix64::new(seed ^ session.rotate_left(29) ^ 0x5041_5254),
            in_flight: BTreeMap::new(),
            last_due: HashMap::new(),
            sent: 0,
            handoffs: 0,
        }
    }

    /// Posts `msg` from part `from` to part `to`, delayed as the target's part messages are
    /// ([`crate::sharded::due`]).
    fn post(&mut self, now: Instant, from: usize, to: usize, msg: Message) {
        let due = crate::sharded::due(&mut self.rng, &mut self.last_due, now, from, to);
        self.sent += 1;
        self.in_flight.insert((due, self.sent), (to, msg));
    }

    /// Hands the queued requests of parts without a live channel to the next part that has
    /// one, and posts what adopters report back.
    fn exchange(&mut self, now: Instant) {
        let n = self.parts.len();
        if n == 1 {
            return;
        }
        for p in 0..n {
            while let Some((to, back)) = self.parts[p].poll_handback() {
                self.post(now, p, to, Message::Handback(back));
            }
            if self.parts[p].live_channels() > 0 || self.parts[p].queued_parts() == 0 {
                continue;
            }
            let Some(to) = (1..n).map(|i| (p + i) % n).find(|&q| self.parts[q].live_channels() > 0) else { continue };
            for h in self.parts[p].take_stranded() {
                self.handoffs += 1;
                self.post(now, p, to, Message::Handoff { from: p, h });
            }
            while let Some((to, back)) = self.parts[p].poll_handback() {
                self.post(now, p, to, Message::Handback(back));
            }
        }
    }

    /// Delivers the messages due by `now`.
    fn deliver_due(&mut self, now: Instant) {
        while let Some(entry) = self.in_flight.first_entry() {
            if entry.key().0 > now {
                break;
            }
            match entry.remove() {
                (to, Message::Handoff { from, h }) => self.parts[to].adopt(now, from, h),
                (to, Message::Handback(back)) => self.parts[to].handed_back(now, back),
            }
        }
        self.exchange(now);
    }

    /// Each part, for counters.
    pub(crate) fn parts(&self) -> &[Volume] {
        &self.parts
    }

    fn part_of(&self, channel: u16) -> usize {
        self.part_of.get(&channel).copied().unwrap_or(0)
    }

    /// Adds a channel opened on `path` to that path's part.
    pub(crate) fn add_channel(&mut self, path: usize, channel: Channel, now: Instant) {
        let p = path % self.parts.len();
        self.part_of.insert(channel.envelope().channel, p);
        self.parts[p].add_channel(channel, None, now);
    }

    /// Submits to part `id % parts`, or to the next part after it with a live channel while
    /// that one has none (the application's threads on a node whose paths are down hand their
    /// requests to another node's engine).
    pub(crate) fn submit(&mut self, now: Instant, req: IoRequest) -> Result<(), SubmitError> {
        let n = self.parts.len();
        let first = (req.id % n as u64) as usize;
        let p = (0..n).map(|i| (first + i) % n).find(|&p| self.parts[p].live_channels() > 0).unwrap_or(first);
        let r = self.parts[p].submit(now, req);
        self.exchange(now);
        r
    }

    /// A frame from the target, to the part holding its channel.
    pub(crate) fn handle_frame<'a>(&mut self, now: Instant, bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> Inbound<'a> {
        let p = Frame::new_checked(bytes, self.ethertype).map_or(0, |f| self.part_of(f.channel()));
        let out = self.parts[p].handle_frame(now, bytes, scratch);
        if !matches!(out, Inbound::Read { .. }) {
            self.exchange(now);
        }
        out
    }

    /// Channel indices with the part holding each.
    pub(crate) fn channels(&self) -> Vec<(usize, u16)> {
        let mut v = Vec::new();
        for (p, part) in self.parts.iter().enumerate() {
            v.extend(part.channel_indices().map(|c| (p, c)));
        }
        v
    }

    /// [`Volume::poll_transmit`] of part `p`.
    pub(crate) fn poll_transmit(&mut self, p: usize, now: Instant, channel: u16, buf: &mut [u8]) -> Option<OutFrame> {
        self.parts[p].poll_transmit(now, channel, buf)
    }

    /// [`Volume::seal`] of part `p`.
    pub(crate) fn seal(&mut self, p: usize, channel: u16, buf: &mut [u8], len: usize) -> usize {
        self.parts[p].seal(channel, buf, len)
    }

    /// Whether any part has requests outstanding (only then do the parts read the board).
    fn busy(&self) -> bool {
        self.parts.iter().any(|v| v.outstanding() > 0)
    }

    /// The next time [`PartedVolume::handle_timeout`] must run.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let mut t = self.parts.iter().filter_map(Volume::poll_timeout).min();
        if self.parts.len() > 1 && self.busy() {
            t = t.into_iter().chain(self.refresh.iter().copied()).min();
        }
        t.into_iter().chain(self.in_flight.keys().next().map(|k| k.0)).min()
    }

    /// Runs the timers due at `now`, and the board reads due.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        for v in &mut self.parts {
            if v.poll_timeout().is_some_and(|t| t <= now) {
                v.handle_timeout(now);
            }
        }
        if self.parts.len() > 1 && self.busy() {
            for p in 0..self.parts.len() {
                if self.refresh[p] <= now {
                    self.parts[p].refresh(now);
                    self.refresh[p] = now + Duration::from_micros(self.rng.range(200, 3_000));
                }
            }
        }
        self.deliver_due(now);
    }

    /// The next event of any part, the parts taken in turn.
    pub(crate) fn poll_event(&mut self) -> Option<VolumeEvent> {
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

    /// Moves every part to `session`.
    pub(crate) fn resume(&mut self, session: u64, now: Instant) {
        for v in &mut self.parts {
            v.resume(session, now);
        }
        // What was on its way belongs to the old session (each side ignores it).
        self.exchange(now);
    }

    /// The session.
    pub(crate) fn session(&self) -> u64 {
        self.parts[0].session()
    }

    /// Sessions moved to (each part moves once per session).
    pub(crate) fn resumes(&self) -> u64 {
        self.parts[0].resumes()
    }

    /// FLUSHes failed for a possible loss, all parts.
    pub(crate) fn durability_errors(&self) -> u64 {
        self.parts.iter().map(Volume::durability_errors).sum()
    }

    /// What the volume owes, all parts together.
    pub(crate) fn durability_debt(&self) -> DurabilityDebt {
        self.parts.iter().map(Volume::durability_debt).fold(DurabilityDebt::Clear, DurabilityDebt::merge)
    }

    /// [`Volume::inherit_debt`] (the board is shared: any part takes it for all).
    pub(crate) fn inherit_debt(&mut self, debt: DurabilityDebt) {
        self.parts[0].inherit_debt(debt);
    }
}
