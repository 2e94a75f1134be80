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
