//! Durability epochs: a lost session costs a FLUSH error only when the new session's ACCEPT
//! names another cache domain than the one the lost session's unflushed writes were
//! acknowledged under; a report owed stays owed; the debt a volume hands to its replacement.

mod util;

use std::time::Duration;

use tyche_channel::{DeadReason, DurabilityDebt, IoError};
use tyche_wire::{DisconnectReason, DurabilityEpoch, Kind, Message, Status};
use util::{pattern, Pair, PairConfig};

const NEW: u64 = 0x0e55_2022;
const NEWER: u64 = 0x0e55_2023;
const E1: DurabilityEpoch = DurabilityEpoch([0x11; 16]);
const E2: DurabilityEpoch = DurabilityEpoch([0x22; 16]);
const EIO: Option<Result<(), IoError>> = Some(Err(IoError::Target(Status::IoError)));

fn pair(epoch: DurabilityEpoch) -> Pair {
    Pair::with(PairConfig { epoch, no_path_timeout: Duration::from_secs(1), ..PairConfig::default() })
}

/// A write completed and not flushed, then a FLUSH outstanding when the target forgets the
/// session without DISCONNECT SHUTDOWN; the volume resumes on a target presenting `after`.
fn lose_session_with_unflushed_write(pair: &mut Pair, after: DurabilityEpoch) {
    pair.write(1, 0, &pattern(1, 4096));
    pair.drive();
    pair.expect_ok(1);
    pair.auto_execute = false;
    pair.flush(2);
    pair.run_for(Duration::from_millis(1));
    pair.restart_target(NEW);
    pair.auto_execute = true;
    pair.cfg.epoch = after;
    pair.volume.resume(NEW, pair.now);
    assert!(pair.volume.unflushed_writes(), "undecided until the new session's epoch is known");
    pair.open_session_channel(0, NEW);
}

#[test]
fn the_same_epoch_after_a_lost_session_keeps_its_unflushed_writes() {
    let mut pair = pair(E1);
    assert_eq!(pair.volume.durability_epoch(), Some(E1));
    lose_session_with_unflushed_write(&mut pair, E1);
    assert_eq!(pair.volume.durability_epoch(), Some(E1));
    pair.flush(3);
    pair.drive();
    pair.expect_ok(2);
    pair.expect_ok(3);
    assert_eq!(pair.volume.durability_errors(), 0);
    assert!(!pair.volume.unflushed_writes());
    assert_eq!(pair.volume.durability_debt(), DurabilityDebt::Clear);
    assert!(pair.storage[..4096] == pattern(1, 4096)[..]);
}

#[test]
fn another_epoch_after_a_lost_session_fails_the_flushes_as_before() {
    let mut pair = pair(E1);
    lose_session_with_unflushed_write(&mut pair, E2);
    assert_eq!(pair.volume.durability_debt(), DurabilityDebt::Owed, "decided when the channel joined");
    pair.flush(3);
    pair.drive();
    // FLUSH 2 was outstanding at the loss; FLUSH 3 is the first to complete after it, or the
    // report went to FLUSH 2 and 3 succeeds: either way the loss is reported, once or twice.
    assert_eq!(pair.result(2), EIO);
    assert_eq!(pair.volume.durability_errors(), 1 + u64::from(pair.result(3) != Some(Ok(()))));
    assert!(!pair.volume.unflushed_writes(), "reported");
    // The next FLUSH succeeds.
    pair.flush(4);
    pair.drive();
    pair.expect_ok(4);
}

#[test]
fn an_epoch_that_promises_nothing_never_keeps_writes() {
    // A target that sends the all-zero epoch (no promise) every time: today's pessimism.
    let mut pair = pair(DurabilityEpoch::NONE);
    lose_session_with_unflushed_write(&mut pair, DurabilityEpoch::NONE);
    pair.drive();
    assert_eq!(pair.result(2), EIO);
    assert_eq!(pair.volume.durability_errors(), 1);
}

#[test]
fn nothing_unflushed_means_nothing_owed_whatever_the_epoch() {
    let mut pair = pair(E1);
    pair.write(1, 0, &pattern(1, 512));
    pair.drive();
    pair.flush(2);
    pair.drive();
    pair.expect_ok(1);
    pair.expect_ok(2);
    pair.restart_target(NEW);
    pair.cfg.epoch = E2;
    pair.volume.resume(NEW, pair.now);
    assert!(!pair.volume.unflushed_writes());
    pair.open_session_channel(0, NEW);
    pair.flush(3);
    pair.drive();
    pair.expect_ok(3);
    assert_eq!(pair.volume.durability_errors(), 0);
}

#[test]
fn a_report_owed_before_the_resume_stays_owed_under_the_same_epoch() {
    let mut pair = pair(E1);
    pair.volume.assume_writes_lost();
    pair.write(1, 0, &pattern(1, 512));
    pair.drive();
    pair.expect_ok(1);
    pair.restart_target(NEW);
    pair.volume.resume(NEW, pair.now);
    pair.open_session_channel(0, NEW);
    assert_eq!(pair.volume.durability_debt(), DurabilityDebt::Owed, "the same epoch does not pay a report");
    pair.flush(2);
    pair.drive();
    assert_eq!(pair.result(2), EIO);
    pair.flush(3);
    pair.drive();
    pair.expect_ok(3);
    assert_eq!(pair.volume.durability_errors(), 1);
}

#[test]
fn a_loss_decided_in_one_resume_is_not_undone_by_the_next() {
    // Target rebooted (E1 → E2): owed. It then restarts its process and comes back with E2
    // again before any FLUSH: the report is still owed.
    let mut pair = pair(E1);
    lose_session_with_unflushed_write(&mut pair, E2);
    pair.auto_execute = false;
    pair.run_for(Duration::from_millis(1));
    pair.restart_target(NEWER);
    pair.auto_execute = true;
    pair.volume.resume(NEWER, pair.now);
    pair.open_session_channel(0, NEWER);
    pair.drive();
    assert_eq!(pair.result(2), EIO);
}

#[test]
fn sessions_that_never_had_a_channel_carry_the_question_to_the_next() {
    for (last, lost) in [(E1, false), (E2, true)] {
        let mut pair = pair(E1);
        pair.write(1, 0, &pattern(1, 512));
        pair.drive();
        pair.expect_ok(1);
        // Lost; a first new session is lost too before any channel of it joined.
        pair.restart_target(NEW);
        pair.volume.resume(NEW, pair.now);
        pair.restart_target(NEWER);
        pair.volume.resume(NEWER, pair.now);
        assert_eq!(pair.volume.durability_debt(), DurabilityDebt::AtRisk(E1));
        pair.cfg.epoch = last;
        pair.open_session_channel(0, NEWER);
        pair.flush(2);
        pair.drive();
        assert_eq!(pair.result(2), if lost { EIO } else { Some(Ok(())) }, "last epoch {last}");
    }
}

#[test]
fn assume_writes_lost_still_fails_the_next_flush_whatever_the_epoch() {
    let mut pair = pair(E1);
    pair.volume.assume_writes_lost();
    pair.flush(1);
    pair.drive();
    assert_eq!(pair.result(1), EIO);
    pair.flush(2);
    pair.drive();
    pair.expect_ok(2);
}

#[test]
fn a_channel_whose_accept_names_another_epoch_is_a_protocol_error() {
    let mut pair = pair(E1);
    let params = pair.cfg.params;
    // Channel 1 of the same session, opened by an ACCEPT with another epoch: one target
    // cannot present two, so it is closed and never carries a request.
    pair.cfg.epoch = E2;
    pair.open_channel(1, params);
    assert_eq!(pair.volume.epoch_conflicts(), 1);
    assert_eq!(pair.volume.durability_epoch(), Some(E1), "the session keeps its first channel's epoch");
    assert_eq!(pair.volume.live_channels(), 1);
    for id in 1..=8 {
        pair.write(id, id * 4096, &pattern(id, 4096));
    }
    pair.drive();
    for id in 1..=8 {
        pair.expect_ok(id);
    }
    assert!(pair.executed.iter().all(|(ch, _)| *ch == 0), "a request went to the conflicting channel");
    let bye = pair.sent.iter().find(|p| p.kind() == Kind::Disconnect && p.channel() == 1).expect("DISCONNECT sent");
    assert!(matches!(bye.msg(), Message::Disconnect(d) if d.reason == DisconnectReason::ProtocolError));
    assert!(
        pair.volume_dead.iter().any(|&(ch, reason, _, _)| ch == 1 && reason == DeadReason::Closed),
        "{:?}",
        pair.volume_dead
    );
    // A reconnect presenting the session's epoch is used.
    pair.cfg.epoch = E1;
    pair.open_channel(1, params);
    assert_eq!(pair.volume.live_channels(), 2);
    assert_eq!(pair.volume.epoch_conflicts(), 1);
}

#[test]
fn the_only_channel_of_a_session_conflicting_leaves_no_path() {
    // Channel 0 of the new session fixes its epoch; channel 1, a conflict, gives no path.
    let mut pair = pair(E1);
    pair.restart_target(NEW);
    pair.volume.resume(NEW, pair.now);
    pair.open_session_channel(0, NEW);
    pair.cfg.epoch = E2;
    pair.open_session_channel(1, NEW);
    assert_eq!(pair.volume.live_channels(), 1);
    assert_eq!(pair.volume.epoch_conflicts(), 1);
}

#[test]
fn the_debt_follows_writes_flushes_and_losses() {
    let mut pair = pair(E1);
    assert_eq!(pair.volume.durability_debt(), DurabilityDebt::Clear);
    pair.write(1, 0, &pattern(1, 512));
    pair.drive();
    assert_eq!(pair.volume.durability_debt(), DurabilityDebt::AtRisk(E1));
    pair.flush(2);
    pair.drive();
    assert_eq!(pair.volume.durability_debt(), DurabilityDebt::Clear);
    // Unflushed writes under an epoch that promises nothing are as good as lost.
    let mut none = self::pair(DurabilityEpoch::NONE);
    none.write(1, 0, &pattern(1, 512));
    none.drive();
    assert_eq!(none.volume.durability_debt(), DurabilityDebt::Owed);
}

#[test]
fn a_replacement_volume_inherits_the_debt() {
    use DurabilityDebt::*;
    // (debt handed on, the replacement's epoch, whether its first FLUSH fails)
    for (debt, epoch, fails) in [
        (Clear, E2, false),
        (AtRisk(E1), E1, false),
        (AtRisk(E1), E2, true),
        (AtRisk(E1), DurabilityEpoch::NONE, true),
        (Owed, E1, true),
    ] {
        // Inherited before the first channel joins (a fresh volume), and after.
        for before in [true, false] {
            let mut pair = pair(epoch);
            pair.restart_target(NEW);
            pair.volume.resume(NEW, pair.now);
            if before {
                pair.volume.inherit_debt(debt);
                pair.open_session_channel(0, NEW);
            } else {
                pair.open_session_channel(0, NEW);
                pair.volume.inherit_debt(debt);
            }
            pair.flush(1);
            pair.drive();
            assert_eq!(pair.result(1), if fails { EIO } else { Some(Ok(())) }, "{debt:?} then {epoch}, {before}");
        }
    }
}

#[test]
fn inherited_unflushed_writes_stay_at_risk_until_a_flush_covers_them() {
    // Found by the simulator (seed 231, two engine restarts then a target crash): a volume
    // that inherited writes kept under the same epoch said it had nothing unflushed, and a
    // crash before the next FLUSH went unreported.
    let mut pair = pair(E1);
    pair.volume.inherit_debt(DurabilityDebt::AtRisk(E1));
    assert!(pair.volume.unflushed_writes());
    assert_eq!(pair.volume.durability_debt(), DurabilityDebt::AtRisk(E1), "handed on again as it came");
    pair.restart_target(NEW);
    pair.cfg.epoch = E2;
    pair.volume.resume(NEW, pair.now);
    pair.open_session_channel(0, NEW);
    pair.flush(1);
    pair.drive();
    assert_eq!(pair.result(1), EIO, "the inherited writes were lost with the target's host");
    // Covered by a FLUSH, they are no longer at risk.
    let mut pair = self::pair(E1);
    pair.volume.inherit_debt(DurabilityDebt::AtRisk(E1));
    pair.flush(1);
    pair.drive();
    pair.expect_ok(1);
    assert_eq!(pair.volume.durability_debt(), DurabilityDebt::Clear);
}

#[test]
fn debts_merge_to_the_worst() {
    use DurabilityDebt::*;
    assert_eq!(Clear.merge(Clear), Clear);
    assert_eq!(Clear.merge(AtRisk(E1)), AtRisk(E1));
    assert_eq!(AtRisk(E1).merge(AtRisk(E1)), AtRisk(E1));
    assert_eq!(AtRisk(E1).merge(AtRisk(E2)), Owed);
    assert_eq!(AtRisk(E1).merge(Owed), Owed);
    assert_eq!(Owed.merge(Clear), Owed);
}
