//! What the parts of one initiator volume share ([`VolumeBoard`]): a volume held in parts, one
//! per engine thread, each owning its channels and the requests submitted to it, shares nothing
//! on the per-frame path but a few atomics, each written by one part only:
//!
//! - **Tags.** Part `p` of `P` allocates tags `p + 1`, `p + 1 + P`, `p + 1 + 2P`, ... (its residue
//!   class): unique in the session without a shared counter.
//! - **The floor** (every tag below it has completed and will never be sent again) must cover the
//!   tags not yet allocated too: a part's *own floor* is the lower of its lowest outstanding tag
//!   and its next tag, and never decreases. Each part publishes its own floor and next tag here
//!   on a timer ([`crate::config::FLOOR_REFRESH`]) and reads the others' then; the floor its
//!   REQUESTs carry is the lowest of its own floor and the others' as last read. A value read
//!   late is lower than the true one, which is still true. On the same timer a part moves its
//!   next tag up to the highest next tag it reads (tags need not be dense), so that a part with
//!   little to do does not hold the floor, and with it the tag window, down.
//! - **The RTO's floor.** A part whose channel found an expiry spurious (a pause of the target's
//!   threads) raises its other channels' floors at once and publishes the floor with a count of
//!   its rises; the other parts read it on the same timer and raise their channels' floors to a
//!   rise they have not seen, so that each channel of the volume does not find the same pause
//!   with a resend of its own.
//! - **Durability.** Each part counts the writes it completed (its own atomic). The rest (what
//!   completed FLUSHes covered, the durability epoch of the current session, a loss not yet
//!   reported, the FLUSHes outstanding at a lost session) changes only on a FLUSH, a new
//!   session, a new session's first channel or a DISCONNECT SHUTDOWN, and sits under a mutex
//!   taken only then, never for a READ or WRITE frame.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tyche_wire::DurabilityEpoch;

/// One part's published values, on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Slot {
    /// The part's own floor as last published.
    floor: AtomicU64,
    /// The part's next tag as last published.
    next: AtomicU64,
    /// Modifications (without FUA) the part completed successfully so far.
    done: AtomicU64,
    /// The part's last RTO floor rise: its count (high 32 bits) and the floor in microseconds
    /// (low 32 bits), in one word so that a reader never pairs a count with another rise's
    /// floor.
    rto_floor: AtomicU64,
}

/// The session's durability state, shared by the parts (see the module docs).
#[derive(Debug)]
pub(crate) struct Durable {
    /// The session the state below belongs to (the newest any part moved to).
    pub session: u64,
    /// Per part: of its completed writes, the first `flushed[p]` are covered by a completed
    /// FLUSH.
    pub flushed: Vec<u64>,
    /// A channel of the current session heard DISCONNECT SHUTDOWN: the target flushed
    /// everything before it stopped.
    pub shutdown_seen: bool,
    /// The next FLUSH to complete fails: a session was lost with unflushed writes, and no FLUSH
    /// has reported it yet.
    pub owed: bool,
    /// The durability epoch of the current session, once a channel of it joined the volume.
    pub epoch: Option<DurabilityEpoch>,
    /// Writes no FLUSH covered were acknowledged under this epoch by a session (or an earlier
    /// volume) since lost, and the current session's epoch is not known yet.
    pub undecided: Option<DurabilityEpoch>,
    /// FLUSHes numbered below this were outstanding when `undecided` was set.
    pub undecided_below: u64,
    /// FLUSHes numbered below this were outstanding at a loss: they fail.
    pub doubtful_below: u64,
    /// FLUSHes submitted so far (each is numbered in submission order).
    pub flushes: u64,
}

impl Durable {
    /// Whether FLUSH number `n`, still outstanding, fails whatever the target answers.
    pub fn doomed(&self, n: u64) -> bool {
        n < self.doubtful_below || (self.undecided.is_some() && n < self.undecided_below)
    }

    /// Whether FLUSH number `n`, still outstanding, was outstanding at a loss.
    pub fn doubtful(&self, n: u64) -> bool {
        n < self.doubtful_below
    }
}

/// What the parts of one volume share: see the module docs. [`crate::Volume::new`] makes a
/// volume of one part with a board of its own; [`crate::Volume::part`] makes part `p` of a board
/// made with [`VolumeBoard::new`].
#[derive(Debug)]
pub struct VolumeBoard {
    slots: Box<[Slot]>,
    durable: Mutex<Durable>,
}

impl VolumeBoard {
    /// A board for a volume of `parts` parts (at least one) on session `session`.
    pub fn new(parts: usize, session: u64) -> std::sync::Arc<Self> {
        let parts = parts.max(1);
        let slots: Box<[Slot]> = (0..parts)
            .map(|p| Slot {
                floor: AtomicU64::new(p as u64 + 1),
                next: AtomicU64::new(p as u64 + 1),
                done: AtomicU64::new(0),
                rto_floor: AtomicU64::new(0),
            })
            .collect();
        let durable = Durable {
            session,
            flushed: vec![0; parts],
            shutdown_seen: false,
            owed: false,
            epoch: None,
            undecided: None,
            undecided_below: 0,
            doubtful_below: 0,
            flushes: 0,
        };
        std::sync::Arc::new(VolumeBoard { slots, durable: Mutex::new(durable) })
    }

    /// How many parts.
    pub fn parts(&self) -> usize {
        self.slots.len()
    }

    /// The durability state (also after a part panicked holding it: each change is made whole
    /// before the next call that could panic).
    pub(crate) fn durable(&self) -> std::sync::MutexGuard<'_, Durable> {
        self.durable.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Part `p` completed a modification without FUA.
    pub(crate) fn write_done(&self, p: usize) {
        self.slots[p].done.fetch_add(1, Ordering::AcqRel);
    }

    /// Every part's completed writes now.
    pub(crate) fn done(&self) -> Vec<u64> {
        self.slots.iter().map(|s| s.done.load(Ordering::Acquire)).collect()
    }

    /// Whether some part completed writes no completed FLUSH covered (`d` held).
    pub(crate) fn unflushed(&self, d: &Durable) -> bool {
        self.slots.iter().zip(&d.flushed).any(|(s, &f)| s.done.load(Ordering::Acquire) > f)
    }

    /// Counts every write completed so far as reported (`d` held): a loss was declared.
    pub(crate) fn all_reported(&self, d: &mut Durable) {
        for (s, f) in self.slots.iter().zip(d.flushed.iter_mut()) {
            *f = (*f).max(s.done.load(Ordering::Acquire));
        }
    }

    /// Publishes part `p`'s own floor and next tag.
    pub(crate) fn publish(&self, p: usize, floor: u64, next: u64) {
        self.slots[p].floor.store(floor, Ordering::Release);
        self.slots[p].next.store(next, Ordering::Release);
    }

    /// Publishes a rise of part `p`'s RTO floor to `floor`.
    pub(crate) fn publish_rto_floor(&self, p: usize, floor: std::time::Duration) {
        let slot = &self.slots[p].rto_floor;
        let count = (slot.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xffff_ffff;
        let micros = u64::try_from(floor.as_micros()).unwrap_or(u64::MAX).min(0xffff_ffff);
        slot.store(count << 32 | micros, Ordering::Release);
    }

    /// Each part's count of RTO floor rises, as published now.
    pub(crate) fn rto_floor_counts(&self) -> Vec<u32> {
        self.slots.iter().map(|s| (s.rto_floor.load(Ordering::Acquire) >> 32) as u32).collect()
    }

    /// The highest RTO floor the parts other than `p` published in a rise not in `seen` (each
    /// part's count as last read, brought up to date).
    pub(crate) fn rto_floor_rises(&self, p: usize, seen: &mut [u32]) -> Option<std::time::Duration> {
        let mut highest = None;
        for (q, (s, seen)) in self.slots.iter().zip(seen.iter_mut()).enumerate() {
            let word = s.rto_floor.load(Ordering::Acquire);
            let count = (word >> 32) as u32;
            if q == p || count == *seen {
                continue;
            }
            *seen = count;
            let floor = std::time::Duration::from_micros(word & 0xffff_ffff);
            highest = highest.max(Some(floor));
        }
        highest
    }

    /// Whether some part published a floor below its next tag (it has requests outstanding).
    pub fn busy(&self) -> bool {
        self.slots.iter().any(|s| s.floor.load(Ordering::Acquire) < s.next.load(Ordering::Acquire))
    }

    /// The lowest published floor of the parts other than `p`, and the highest published next
    /// tag of all (`None` for a volume of one part).
    pub(crate) fn others(&self, p: usize) -> Option<(u64, u64)> {
        if self.slots.len() == 1 {
            return None;
        }
        let mut floor = u64::MAX;
        let mut next = 0;
        for (q, s) in self.slots.iter().enumerate() {
            next = next.max(s.next.load(Ordering::Acquire));
            if q != p {
                floor = floor.min(s.floor.load(Ordering::Acquire));
            }
        }
        Some((floor, next))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_part_reads_each_other_parts_rto_floor_rise_once() {
        let b = VolumeBoard::new(3, 1);
        let mut seen = b.rto_floor_counts();
        assert_eq!(b.rto_floor_rises(0, &mut seen), None);
        b.publish_rto_floor(1, Duration::from_micros(400));
        b.publish_rto_floor(2, Duration::from_micros(800));
        assert_eq!(b.rto_floor_rises(0, &mut seen), Some(Duration::from_micros(800)), "the highest new rise");
        assert_eq!(b.rto_floor_rises(0, &mut seen), None, "each rise is read once");
        b.publish_rto_floor(0, Duration::from_millis(5));
        assert_eq!(b.rto_floor_rises(0, &mut seen), None, "not its own");
        // A later rise to a lower floor (the part's floor decayed since) is still a rise.
        b.publish_rto_floor(1, Duration::from_micros(200));
        assert_eq!(b.rto_floor_rises(0, &mut seen), Some(Duration::from_micros(200)));
        // A part made later starts from the counts there are: old rises are not news to it.
        let mut late = b.rto_floor_counts();
        assert_eq!(b.rto_floor_rises(2, &mut late), None);
    }
}
