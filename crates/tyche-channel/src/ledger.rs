//! The target's at-most-once ledger, in one home ledger per home channel.
//!
//! Every REQUEST names its tag's home (`HOME`: the channel the initiator first issued the tag on
//! in this session; a re-issue on another channel keeps it). The record of tag *t* lives in the
//! home ledger of channel `HOME(t)`. Normally a tag arrives on its home channel, so the decision needs
//! nothing but that channel's home ledger; a copy re-issued elsewhere after a path failed is decided by
//! the home ledger all the same. This is what lets channels be owned by different threads later:
//! a home ledger moves with its channel, and only the rare re-issued copy must reach another thread.
//!
//! The floor is the session's (the largest `FLOOR` any request carried): a home ledger takes it when
//! one of its tags comes or completes, and every home ledger takes it when the records together reach
//! their bound, so a home ledger whose channel died cannot keep stale records that crowd out the
//! live ones. Forgetting a record only below a floor the initiator sent is what makes it safe:
//! every tag below it has completed at the initiator and is never sent again.

use std::collections::BTreeMap;

use tyche_wire::Status;

/// A copy of a request waiting for another copy's status: the part of the session that holds
/// its channel ([`crate::PartId`]), the channel, its `remq` slot, the tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Waiter {
    pub(crate) part: crate::PartId,
    pub(crate) channel: u16,
    pub(crate) remq: u16,
    pub(crate) tag: u64,
}

#[derive(Debug)]
enum Entry {
    /// Being executed; these copies wait for its status.
    InProgress(Vec<Waiter>),
    /// Executed with this status.
    Done(Status),
}

/// What the home ledger decides for a copy of a modifying request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admission {
    /// First copy: execute it, then [`HomeLedger::record`] its status.
    Execute,
    /// Another copy is executing: this one waits for its status.
    Wait,
    /// Executed already: answer with this status.
    Recorded(Status),
}

/// One home channel's part of the ledger.
#[derive(Debug, Default)]
pub(crate) struct HomeLedger {
    floor: u64,
    entries: BTreeMap<u64, Entry>,
}

impl HomeLedger {
    /// Records in this home ledger.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether `tag` lies below this home ledger's floor (a stale copy: refuse it).
    pub(crate) fn stale(&self, tag: u64) -> bool {
        tag < self.floor
    }

    /// Takes a request's `FLOOR`: executed tags below it can only come again as stale copies,
    /// which [`HomeLedger::stale`] refuses, so their records go (those still executing stay).
    pub(crate) fn raise_floor(&mut self, floor: u64) {
        if floor <= self.floor {
            return;
        }
        self.floor = floor;
        let keep = self.entries.split_off(&floor);
        let old = std::mem::replace(&mut self.entries, keep);
        for (tag, entry) in old {
            if let Entry::InProgress(w) = entry {
                self.entries.insert(tag, Entry::InProgress(w));
            }
        }
    }

    /// Decides a copy of modifying request `waiter.2` (not stale). `room`: whether the session
    /// may hold one more record; without it a new tag is `None` (refuse it).
    pub(crate) fn admit(&mut self, waiter: Waiter, room: bool) -> Option<Admission> {
        let tag = waiter.tag;
        match self.entries.get_mut(&tag) {
            None if !room => None,
            None => {
                self.entries.insert(tag, Entry::InProgress(Vec::new()));
                Some(Admission::Execute)
            }
            Some(Entry::InProgress(waiters)) => {
                waiters.push(waiter);
                Some(Admission::Wait)
            }
            Some(Entry::Done(status)) => Some(Admission::Recorded(*status)),
        }
    }

    /// Records how `tag` went and returns the copies that waited for it. ABORTED means "not
    /// executed": the tag is not recorded, so a copy re-issued in this session runs.
    pub(crate) fn record(&mut self, tag: u64, status: Status) -> Vec<Waiter> {
        let before = if status == Status::Aborted {
            self.entries.remove(&tag)
        } else {
            self.entries.insert(tag, Entry::Done(status))
        };
        if tag < self.floor {
            self.entries.remove(&tag);
        }
        match before {
            Some(Entry::InProgress(w)) => w,
            _ => Vec::new(),
        }
    }
}

/// The home ledgers of one session, by home channel, with a bound on their records together.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    homes: BTreeMap<u16, HomeLedger>,
    records: usize,
}

impl Ledger {
    /// Records in every home ledger.
    pub(crate) fn records(&self) -> usize {
        self.records
    }

    /// Home ledgers (homes that have sent a request).
    #[cfg(test)]
    pub(crate) fn homes(&self) -> usize {
        self.homes.len()
    }

    /// Raises every home ledger's floor to `floor` (when the records reach their bound).
    pub(crate) fn raise_all(&mut self, floor: u64) {
        for home_ledger in self.homes.values_mut() {
            self.records -= home_ledger.len();
            home_ledger.raise_floor(floor);
            self.records += home_ledger.len();
        }
    }

    /// Runs `f` on the home ledger of `home` (created empty on first use), keeping the record count.
    pub(crate) fn with<R>(&mut self, home: u16, f: impl FnOnce(&mut HomeLedger, usize) -> R) -> R {
        let home_ledger = self.homes.entry(home).or_default();
        let before = home_ledger.len();
        let out = f(home_ledger, self.records);
        self.records = self.records - before + home_ledger.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(channel: u16, remq: u16, tag: u64) -> Waiter {
        Waiter { part: 0, channel, remq, tag }
    }

    #[test]
    fn a_tag_executes_once_and_copies_wait_or_get_its_status() {
        let mut l = Ledger::default();
        assert_eq!(l.with(1, |s, _| s.admit(w(1, 0, 10), true)), Some(Admission::Execute));
        assert_eq!(l.with(1, |s, _| s.admit(w(2, 5, 10), true)), Some(Admission::Wait));
        assert_eq!(l.records(), 1);
        assert_eq!(l.with(1, |s, _| s.record(10, Status::Ok)), vec![w(2, 5, 10)]);
        assert_eq!(l.with(1, |s, _| s.admit(w(3, 1, 10), true)), Some(Admission::Recorded(Status::Ok)));
        // Another home knows nothing of it (the initiator names one home per tag and session).
        assert_eq!(l.with(2, |s, _| s.admit(w(2, 1, 10), true)), Some(Admission::Execute));
        assert_eq!((l.records(), l.homes()), (2, 2));
    }

    #[test]
    fn aborted_is_not_recorded_and_a_full_ledger_refuses_new_tags() {
        let mut l = Ledger::default();
        assert_eq!(l.with(0, |s, _| s.admit(w(0, 0, 7), true)), Some(Admission::Execute));
        assert!(l.with(0, |s, _| s.record(7, Status::Aborted)).is_empty());
        assert_eq!(l.records(), 0);
        assert_eq!(l.with(0, |s, _| s.admit(w(0, 0, 7), true)), Some(Admission::Execute), "runs again");
        assert_eq!(l.with(0, |s, _| s.admit(w(0, 1, 8), false)), None, "no room for a new tag");
        assert_eq!(l.with(0, |s, _| s.admit(w(0, 2, 7), false)), Some(Admission::Wait), "a known tag needs none");
    }

    #[test]
    fn the_floor_forgets_done_records_below_it_but_keeps_executing_ones() {
        let mut l = Ledger::default();
        for tag in 1..=4 {
            l.with(0, |s, _| s.admit(w(0, tag as u16, tag), true));
        }
        l.with(0, |s, _| {
            s.record(1, Status::Ok);
            s.record(2, Status::Ok);
        });
        l.with(0, |s, _| s.raise_floor(3));
        assert_eq!(l.records(), 2, "tags 3 and 4 stay");
        assert!(l.with(0, |s, _| s.stale(2)) && !l.with(0, |s, _| s.stale(3)));
        // An executing tag below a later floor is kept until it completes, then forgotten.
        l.with(0, |s, _| s.raise_floor(10));
        assert_eq!(l.records(), 2);
        l.with(0, |s, _| s.record(3, Status::Ok));
        assert_eq!(l.records(), 1);
        // Floors never go down.
        l.with(0, |s, _| s.raise_floor(5));
        assert!(l.with(0, |s, _| s.stale(9)));
    }

    #[test]
    fn raising_every_floor_clears_the_records_of_idle_homes() {
        let mut l = Ledger::default();
        for home in 0..3u16 {
            l.with(home, |s, _| {
                s.admit(w(home, 0, u64::from(home) + 1), true);
                s.record(u64::from(home) + 1, Status::Ok);
            });
        }
        assert_eq!(l.records(), 3);
        l.raise_all(3);
        assert_eq!(l.records(), 1, "only tag 3 (home 2) is not below the floor");
    }
}
