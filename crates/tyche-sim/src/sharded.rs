//! A target session held in parts, as tyched's network threads would hold it: each part owns the
//! channels of some paths (path `k` goes to part `k % parts`), and the messages the parts send
//! each other ([`PartMessage`]: a copy of a modifying request forwarded to its home's part for
//! the at-most-once decision, the decision, the record of its status) travel with seeded delays,
//! in order between any two parts, as over the bounded queues between threads. With one part no
//! message is ever sent and the session is exactly a [`TargetSession`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tyche_channel::{
    Channel, Directory, ExportGeometry, Instant, PartMessage, TargetEvent, TargetInbound, TargetSession, Transmit,
};
use tyche_transport::SplitMix64;
use tyche_wire::{DisconnectReason, Request, Status};

/// One session of the simulated target, in `parts` parts.
#[derive(Debug)]
pub(crate) struct ShardedSession {
    parts: Vec<TargetSession>,
    /// The part holding each channel index now.
    part_of: BTreeMap<u16, usize>,
    /// Messages between parts, by (due time, order sent): (to which part, the message).
    in_flight: BTreeMap<(Instant, u64), (usize, PartMessage)>,
    /// Due time of the last message from one part to another: later ones are not due earlier.
    last_due: HashMap<(usize, usize), Instant>,
    sent: u64,
    rng: SplitMix64,
}

impl ShardedSession {
    pub(crate) fn new(id: u64, ethertype: u16, geometry: ExportGeometry, parts: usize, seed: u64) -> Self {
        let directory: Arc<Directory> = Directory::new();
        let parts = (0..parts.max(1))
            .map(|p| TargetSession::part(id, ethertype, geometry, p as u32, Arc::clone(&directory)))
            .collect();
        ShardedSession {
            parts,
            part_of: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            last_due: HashMap::new(),
            sent: 0,
            rng: SplitMix64::new(seed ^ id.rotate_left(17)),
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.parts[0].id()
    }

    pub(crate) fn duplicates_suppressed(&self) -> u64 {
        self.parts.iter().map(TargetSession::duplicates_suppressed).sum()
    }

    /// Copies forwarded to their home's part, and messages sent between parts.
    pub(crate) fn forwarding(&self) -> (u64, u64) {
        (self.parts.iter().map(TargetSession::forwarded).sum(), self.sent)
    }

    /// Messages that named no copy of their part (a bug).
    pub(crate) fn stray_messages(&self) -> u64 {
        self.parts.iter().map(TargetSession::stray_messages).sum()
    }

    pub(crate) fn channel(&self, i: u16) -> Option<&Channel> {
        self.parts[*self.part_of.get(&i)?].channel(i)
    }

    pub(crate) fn channel_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.part_of.keys().copied()
    }

    pub(crate) fn all_dead(&self) -> bool {
        self.parts.iter().all(TargetSession::all_dead)
    }

    fn part_of_path(&self, path: usize) -> usize {
        path % self.parts.len()
    }

    /// Adds a channel that joined on `path` to that path's part. A channel index that joined
    /// before on another part leaves it (its ledger stays where the index first joined).
    pub(crate) fn add_channel(&mut self, now: Instant, path: usize, channel: Channel) {
        let idx = channel.envelope().channel;
        let p = self.part_of_path(path);
        if let Some(old) = self.part_of.insert(idx, p).filter(|&old| old != p) {
            // Its old channel is aborted there as a replaced one would be.
            self.parts[old].abort_channel(idx);
        }
        self.parts[p].add_channel(channel);
        self.pump(now);
    }

    /// A frame that arrived on `path`: the part of that path takes it.
    pub(crate) fn handle_frame<'a>(
        &mut self,
        now: Instant,
        path: usize,
        bytes: &'a [u8],
        scratch: &'a mut Vec<u8>,
    ) -> TargetInbound<'a> {
        let p = self.part_of_path(path);
        let r = self.parts[p].handle_frame(now, bytes, scratch);
        self.pump(now);
        r
    }

    pub(crate) fn complete(&mut self, now: Instant, channel: u16, request: &Request, status: Status) -> bool {
        // A copy executed on a part it has since left (its index joined elsewhere) completes
        // there: try its current part first, then the others.
        let first = self.part_of.get(&channel).copied().unwrap_or(0);
        let order = std::iter::once(first).chain((0..self.parts.len()).filter(|&p| p != first));
        let mut done = false;
        for p in order {
            if self.parts[p].complete(channel, request, status) {
                done = true;
                break;
            }
        }
        self.pump(now);
        done
    }

    pub(crate) fn close(&mut self, reason: DisconnectReason) {
        for p in &mut self.parts {
            p.close(reason);
        }
    }

    pub(crate) fn poll_transmit(&mut self, now: Instant, channel: u16, buf: &mut [u8]) -> Option<Transmit> {
        let p = *self.part_of.get(&channel)?;
        let t = self.parts[p].poll_transmit(now, channel, buf);
        self.pump(now);
        t
    }

    pub(crate) fn seal(&mut self, channel: u16, buf: &mut [u8], len: usize) -> usize {
        match self.part_of.get(&channel) {
            Some(&p) => self.parts[p].seal(channel, buf, len),
            None => len,
        }
    }

    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let parts = self.parts.iter().filter_map(TargetSession::poll_timeout);
        parts.chain(self.in_flight.keys().next().map(|k| k.0)).min()
    }

    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        for p in &mut self.parts {
            if p.poll_timeout().is_some_and(|t| t <= now) {
                p.handle_timeout(now);
            }
        }
        self.pump(now);
        self.deliver_due(now);
    }

    /// Delivers the messages due by `now` (and those they cause that are due too).
    pub(crate) fn deliver_due(&mut self, now: Instant) {
        while let Some(entry) = self.in_flight.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (to, msg) = entry.remove();
            self.parts[to].handle_message(msg);
            self.pump(now);
        }
    }

    /// When the next message between parts is due.
    pub(crate) fn next_message(&self) -> Option<Instant> {
        self.in_flight.keys().next().map(|k| k.0)
    }

    pub(crate) fn poll_event(&mut self) -> Option<TargetEvent> {
        self.parts.iter_mut().find_map(TargetSession::poll_event)
    }

    /// Takes every part's outgoing messages into flight, each with a seeded delay: mostly a
    /// few microseconds (a busy thread's next turn), sometimes up to a millisecond (a thread
    /// that slept or was preempted).
    fn pump(&mut self, now: Instant) {
        for from in 0..self.parts.len() {
            while let Some((to, msg)) = self.parts[from].poll_message() {
                let to = to as usize;
                let delay = if self.rng.chance(0.9) {
                    self.rng.range(1_000, 20_000)
                } else {
                    self.rng.range(50_000, 1_000_000)
                };
                let last = self.last_due.entry((from, to)).or_insert(now);
                let due = (now + Duration::from_nanos(delay)).max(*last);
                *last = due;
                self.sent += 1;
                self.in_flight.insert((due, self.sent), (to, msg));
            }
        }
    }
}
