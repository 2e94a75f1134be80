//! A target session held in parts, as tyched's network threads would hold it: each part owns the
//! channels of some paths (path `k` goes to part `k % parts`), and the messages the parts send
//! each other ([`PartMessage`]: a copy of a modifying request forwarded to its home's part for
//! the at-most-once decision, the decision, the record of its status) travel with seeded delays,
//! in order between any two parts, as over the bounded queues between threads. With one part no
//! message is ever sent and the session is exactly a [`tyche_channel::TargetSession`].

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tyche_channel::{Courier, ExportGeometry, Instant, PartMessage, SessionParts, TargetInbound};
use tyche_transport::SplitMix64;

/// Messages in flight between parts, with seeded delays.
#[derive(Debug)]
pub(crate) struct Delays {
    /// By (due time, order sent): (to which part, the message).
    in_flight: BTreeMap<(Instant, u64), (usize, PartMessage)>,
    /// Due time of the last message from one part to another: later ones are not due earlier.
    last_due: HashMap<(usize, usize), Instant>,
    sent: u64,
    rng: SplitMix64,
}

impl Courier for Delays {
    /// Mostly a few microseconds (a busy thread's next turn), sometimes up to a millisecond (a
    /// thread that slept or was preempted).
    fn post(&mut self, now: Instant, from: usize, to: usize, msg: PartMessage) {
        let due = due(&mut self.rng, &mut self.last_due, now, from, to);
        self.sent += 1;
        self.in_flight.insert((due, self.sent), (to, msg));
    }
}

/// When a message from part `from` to part `to` posted at `now` is due: mostly a few
/// microseconds later (a busy thread's next turn), sometimes up to a millisecond (a thread that
/// slept or was preempted), never before the last one between the same two parts (`last_due`).
pub(crate) fn due(
    rng: &mut SplitMix64,
    last_due: &mut HashMap<(usize, usize), Instant>,
    now: Instant,
    from: usize,
    to: usize,
) -> Instant {
    let delay = if rng.chance(0.9) { rng.range(1_000, 20_000) } else { rng.range(50_000, 1_000_000) };
    let last = last_due.entry((from, to)).or_insert(now);
    let due = (now + Duration::from_nanos(delay)).max(*last);
    *last = due;
    due
}

/// One session of the simulated target, in parts.
pub(crate) type PartedSession = SessionParts<Delays>;

/// A session of `parts` parts whose messages are delayed by a stream of `seed`'s own.
pub(crate) fn new_session(id: u64, ethertype: u16, geometry: ExportGeometry, parts: usize, seed: u64) -> PartedSession {
    let delays = Delays {
        in_flight: BTreeMap::new(),
        last_due: HashMap::new(),
        sent: 0,
        rng: SplitMix64::new(seed ^ id.rotate_left(17)),
    };
    SessionParts::new(id, ethertype, geometry, parts, delays)
}

/// What the simulator needs of a session in parts beyond [`SessionParts`].
pub(crate) trait ByPath {
    /// A frame that arrived on `path`: the part of that path takes it.
    fn frame_on_path<'a>(
        &mut self,
        now: Instant,
        path: usize,
        bytes: &'a [u8],
        scratch: &'a mut Vec<u8>,
    ) -> TargetInbound<'a>;
    /// Adds a channel that joined on `path` to that path's part.
    fn join_on_path(&mut self, now: Instant, path: usize, channel: tyche_channel::Channel);
    /// When the next message between parts is due.
    fn next_message(&self) -> Option<Instant>;
    /// Delivers the messages due by `now` (and those they cause that are due too).
    fn deliver_due(&mut self, now: Instant);
}

impl ByPath for PartedSession {
    fn frame_on_path<'a>(
        &mut self,
        now: Instant,
        path: usize,
        bytes: &'a [u8],
        scratch: &'a mut Vec<u8>,
    ) -> TargetInbound<'a> {
        let part = path % self.part_count();
        self.handle_frame(now, part, bytes, scratch)
    }

    fn join_on_path(&mut self, now: Instant, path: usize, channel: tyche_channel::Channel) {
        self.at(now);
        self.add_channel(path % self.part_count(), channel);
    }

    fn next_message(&self) -> Option<Instant> {
        self.courier().in_flight.keys().next().map(|k| k.0)
    }

    fn deliver_due(&mut self, now: Instant) {
        self.at(now);
        loop {
            let Some(entry) = self.courier_mut().in_flight.first_entry() else { return };
            if entry.key().0 > now {
                return;
            }
            let (to, msg) = entry.remove();
            self.deliver(to, [msg]);
        }
    }
}
