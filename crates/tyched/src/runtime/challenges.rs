//! The CHALLENGEs a keyed export's target has sent and not yet seen answered: bounded in all and
//! per initiator MAC, each answerable for [`CHALLENGE_LIFETIME`], spent on a grant or a wrong
//! proof only (the handshake, `super::handshake`, asks; the control holds them).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tyche_channel::Instant;
use tyche_wire::MacAddr;

/// How long a CHALLENGE may be answered.
const CHALLENGE_LIFETIME: Duration = Duration::from_secs(5);

/// A CHALLENGE sent and not yet answered.
#[derive(Debug, Clone, Copy)]
pub(super) struct PendingChallenge {
    target_nonce: u64,
    sent: Instant,
}

/// The CHALLENGEs sent and not yet answered, bounded in all (`limits.challenges`) and per
/// initiator MAC (`limits.challenges_per_mac`).
#[derive(Debug)]
pub(super) struct Challenges {
    pending: HashMap<(MacAddr, u64), PendingChallenge>,
    /// Pending challenges in the order sent (entries already forgotten are skipped).
    order: VecDeque<(MacAddr, u64)>,
    /// Pending challenges per initiator MAC, oldest first.
    by_mac: HashMap<MacAddr, VecDeque<u64>>,
    /// At most this many pending.
    limit: usize,
    /// At most this many pending per MAC.
    per_mac: usize,
    /// A MAC's oldest forgotten for its newer one (`limits.challenges_evicted`).
    pub(super) evicted: u64,
    /// Not issued: the table was full of live ones (`limits.challenges_refused`).
    pub(super) refused: u64,
}

impl Challenges {
    pub(super) fn new(limit: usize, per_mac: usize) -> Challenges {
        Challenges {
            pending: HashMap::new(),
            order: VecDeque::new(),
            by_mac: HashMap::new(),
            limit,
            per_mac,
            evicted: 0,
            refused: 0,
        }
    }

    /// The target nonce of the challenge pending for `src`'s CONNECT `nonce`, if still live.
    pub(super) fn live(&self, now: Instant, src: MacAddr, nonce: u64) -> Option<u64> {
        self.pending.get(&(src, nonce)).filter(|p| now.since(p.sent) < CHALLENGE_LIFETIME).map(|p| p.target_nonce)
    }

    /// Remembers a CHALLENGE sent to `src`. At most `per_mac` per MAC: that MAC's oldest is
    /// forgotten (`evicted`). At most `limit` in all: expired ones are forgotten first, and when
    /// every one is still live no challenge is issued (`refused`), so that a flood from many
    /// MACs cannot push out the pending challenges of honest initiators. Returns whether it
    /// was remembered.
    pub(super) fn remember(&mut self, now: Instant, src: MacAddr, nonce: u64, tn: u64) -> bool {
        let per_mac = self.by_mac.entry(src).or_default();
        if per_mac.len() >= self.per_mac {
            if let Some(old) = per_mac.pop_front() {
                self.pending.remove(&(src, old));
                self.evicted += 1;
            }
        }
        // Challenges expire in the order they were sent.
        while let Some(&(mac, old)) = self.order.front() {
            match self.pending.get(&(mac, old)) {
                Some(p) if now.since(p.sent) < CHALLENGE_LIFETIME => break,
                Some(_) => {
                    self.forget(mac, old);
                }
                None => {}
            }
            self.order.pop_front();
        }
        if self.pending.len() >= self.limit {
            self.refused += 1;
            if self.by_mac.get(&src).is_some_and(VecDeque::is_empty) {
                self.by_mac.remove(&src);
            }
            return false;
        }
        self.by_mac.entry(src).or_default().push_back(nonce);
        self.pending.insert((src, nonce), PendingChallenge { target_nonce: tn, sent: now });
        self.order.push_back((src, nonce));
        // Entries answered or forgotten per MAC stay in the order until popped: keep it bounded.
        if self.order.len() > 2 * self.limit {
            let pending = &self.pending;
            self.order.retain(|key| pending.contains_key(key));
        }
        true
    }

    /// Forgets the CHALLENGE sent to `src` for CONNECT nonce `nonce` (answered, or expired),
    /// returning it if it was pending.
    pub(super) fn forget(&mut self, src: MacAddr, nonce: u64) -> Option<PendingChallenge> {
        let p = self.pending.remove(&(src, nonce))?;
        if let Some(q) = self.by_mac.get_mut(&src) {
            q.retain(|&n| n != nonce);
            if q.is_empty() {
                self.by_mac.remove(&src);
            }
        }
        Some(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac(n: u32) -> MacAddr {
        MacAddr::local(n)
    }

    #[test]
    fn challenges_stay_bounded_and_are_spent_once() {
        let mut c = Challenges::new(4, 2);
        let t0 = Instant(1);
        // A MAC's third challenge forgets its first.
        for nonce in 0..3 {
            assert!(c.remember(t0, mac(1), nonce, 100 + nonce));
        }
        assert_eq!(c.evicted, 1);
        assert_eq!(c.live(t0, mac(1), 0), None);
        assert_eq!(c.live(t0, mac(1), 2), Some(102));
        // The table full of live challenges refuses new ones and keeps the pending.
        assert!(c.remember(t0, mac(2), 0, 200));
        assert!(c.remember(t0, mac(3), 0, 300));
        assert!(!c.remember(t0, mac(4), 0, 400));
        assert_eq!(c.refused, 1);
        assert!(!c.by_mac.contains_key(&mac(4)));
        // Spent (by a grant or a wrong proof): a replay finds nothing.
        assert!(c.forget(mac(2), 0).is_some());
        assert_eq!(c.live(t0, mac(2), 0), None);
        // Expired ones make room, and are not answered.
        let later = Instant(t0.0 + CHALLENGE_LIFETIME.as_nanos() as u64 + 1);
        assert_eq!(c.live(later, mac(3), 0), None);
        assert!(c.remember(later, mac(5), 0, 500));
        assert!(c.pending.len() <= 4 && c.order.len() <= 8);
    }
}
