//! The key check of a keyed export's CONNECT, sans-IO, as tyched and the simulator run it: the
//! CHALLENGEs sent and not yet answered (bounded in all and per initiator MAC, each answerable
//! for [`CHALLENGE_LIFETIME`], spent on a grant or a wrong proof only), and what a CONNECT gets
//! ([`Challenges::check`]: a CHALLENGE, its ACCEPT again, a checked proof, or AUTH_FAILED).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tyche_wire::{MacAddr, Message};

use crate::auth::{verify_initiator, ProofInput};
use crate::{HandshakeFrame, Instant};

/// How long a CHALLENGE may be answered.
pub const CHALLENGE_LIFETIME: Duration = Duration::from_secs(5);

/// What a keyed export's CONNECT gets ([`Challenges::check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyCheck {
    /// No proof: send a CHALLENGE with this target nonce (the same again to a retransmission).
    Challenge(u64),
    /// No proof, and the table is full of live challenges: no answer (`refused` counts it).
    NoRoom,
    /// A retry of a CONNECT that was granted (its ACCEPT lost): the same ACCEPT again, nothing
    /// else.
    Retry,
    /// The proof answers a live challenge (this target nonce): go on with the CONNECT; its
    /// grant spends the challenge ([`Challenges::granted`]). A CONNECT refused for another
    /// reason leaves it live, so the initiator's retransmission gets that refusal again.
    Proven(u64),
    /// A wrong or replayed proof, or none pending: refuse with AUTH_FAILED. The challenge is
    /// spent.
    Failed,
}

/// A CHALLENGE sent and not yet answered.
#[derive(Debug, Clone, Copy)]
pub struct PendingChallenge {
    target_nonce: u64,
    sent: Instant,
}

/// The CHALLENGEs sent and not yet answered, bounded in all (`limits.challenges`) and per
/// initiator MAC (`limits.challenges_per_mac`).
#[derive(Debug)]
pub struct Challenges {
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
    pub evicted: u64,
    /// Not issued: the table was full of live ones (`limits.challenges_refused`).
    pub refused: u64,
}

impl Challenges {
    /// An empty table of at most `limit` challenges, `per_mac` per initiator MAC.
    pub fn new(limit: usize, per_mac: usize) -> Challenges {
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
    pub fn live(&self, now: Instant, src: MacAddr, nonce: u64) -> Option<u64> {
        self.pending.get(&(src, nonce)).filter(|p| now.since(p.sent) < CHALLENGE_LIFETIME).map(|p| p.target_nonce)
    }

    /// Remembers a CHALLENGE sent to `src`. At most `per_mac` per MAC: that MAC's oldest is
    /// forgotten (`evicted`). At most `limit` in all: expired ones are forgotten first, and when
    /// every one is still live no challenge is issued (`refused`), so that a flood from many
    /// MACs cannot push out the pending challenges of honest initiators. Returns whether it
    /// was remembered.
    pub fn remember(&mut self, now: Instant, src: MacAddr, nonce: u64, tn: u64) -> bool {
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
    pub fn forget(&mut self, src: MacAddr, nonce: u64) -> Option<PendingChallenge> {
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

impl Challenges {
    /// The key check of CONNECT `from` of an export keyed with `key` (a frame that is no CONNECT
    /// fails: there is nothing to prove). Without a proof it gets a
    /// CHALLENGE (a live one's nonce again, else a new one from `fresh`); with one, a retry of a
    /// granted CONNECT (`retry`, the acceptor knows) gets its ACCEPT again; else the proof must
    /// answer a live challenge. The proof covers the session and channel the CONNECT names,
    /// its parameters and host id, so it is good for nothing else.
    pub fn check(
        &mut self,
        now: Instant,
        key: &[u8],
        from: HandshakeFrame<'_>,
        retry: bool,
        fresh: impl FnOnce() -> u64,
    ) -> KeyCheck {
        let Message::Connect(c) = from.msg else { return KeyCheck::Failed };
        let Some(proof) = c.proof else {
            if let Some(tn) = self.live(now, from.src, c.nonce) {
                return KeyCheck::Challenge(tn);
            }
            let tn = fresh();
            return match self.remember(now, from.src, c.nonce, tn) {
                true => KeyCheck::Challenge(tn),
                false => KeyCheck::NoRoom,
            };
        };
        if retry {
            return KeyCheck::Retry;
        }
        let input = |tn| ProofInput {
            nonce: c.nonce,
            target_nonce: tn,
            session: from.env.session,
            channel: from.env.channel,
            export: c.export,
            initiator: from.src,
            target: from.local,
            host: c.host,
            asked: c.params,
        };
        match self.live(now, from.src, c.nonce).filter(|&tn| verify_initiator(key, &input(tn), &proof)) {
            Some(tn) => KeyCheck::Proven(tn),
            None => {
                self.forget(from.src, c.nonce);
                KeyCheck::Failed
            }
        }
    }

    /// The CONNECT whose proof answered `src`'s challenge for `nonce` was granted: the
    /// challenge is spent (a replayed proof then finds none).
    pub fn granted(&mut self, src: MacAddr, nonce: u64) {
        self.forget(src, nonce);
    }

    /// Forgets every challenge (a target that restarted remembers none).
    pub fn clear(&mut self) {
        self.pending.clear();
        self.order.clear();
        self.by_mac.clear();
    }

    /// Challenges pending.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether none is pending.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::initiator_proof;
    use tyche_wire::{Connect, Envelope};

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

    #[test]
    fn a_challenge_buys_one_grant_and_a_wrong_proof_spends_it() {
        let key = b"a key";
        let mut c = Challenges::new(4, 2);
        let t0 = Instant(1);
        let env = Envelope { dst: mac(9), src: mac(1), ethertype: 0x88b5, channel: 0, session: 0 };
        let params = crate::config::default_params(1024);
        let bare = Connect { nonce: 7, params, proof: None, export: "e", host: None };
        let input = |tn| ProofInput {
            nonce: 7,
            target_nonce: tn,
            session: 0,
            channel: 0,
            export: "e",
            initiator: mac(1),
            target: mac(9),
            host: None,
            asked: params,
        };
        let proven =
            |key: &[u8], tn| Message::Connect(Connect { proof: Some(initiator_proof(key, &input(tn))), ..bare });
        let (bare, wrong, right_42, right_44) =
            (Message::Connect(bare), proven(b"another key", 42), proven(key, 42), proven(key, 44));
        let from = |msg| HandshakeFrame { src: mac(1), local: mac(9), env: &env, msg };
        // No proof: a CHALLENGE, and the same one to a retransmission.
        assert_eq!(c.check(t0, key, from(&bare), false, || 42), KeyCheck::Challenge(42));
        assert_eq!(c.check(t0, key, from(&bare), false, || 43), KeyCheck::Challenge(42));
        // A wrong proof fails and spends the challenge: the right one then finds none.
        assert_eq!(c.check(t0, key, from(&wrong), false, || 0), KeyCheck::Failed);
        assert_eq!(c.check(t0, key, from(&right_42), false, || 0), KeyCheck::Failed);
        // A new challenge, answered: proven; granted, it is spent; a retry gets its ACCEPT.
        assert_eq!(c.check(t0, key, from(&bare), false, || 44), KeyCheck::Challenge(44));
        assert_eq!(c.check(t0, key, from(&right_44), false, || 0), KeyCheck::Proven(44));
        c.granted(mac(1), 7);
        assert!(c.is_empty());
        assert_eq!(c.check(t0, key, from(&right_44), true, || 0), KeyCheck::Retry);
        // A table full of live challenges answers nothing.
        let mut full = Challenges::new(1, 1);
        assert_eq!(full.check(t0, key, from(&bare), false, || 1), KeyCheck::Challenge(1));
        let other = HandshakeFrame { src: mac(2), ..from(&bare) };
        assert_eq!(full.check(t0, key, other, false, || 2), KeyCheck::NoRoom);
        assert_eq!(full.refused, 1);
    }
}
