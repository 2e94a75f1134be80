//! Session resumption: the target forgot the session (restart, reclaim), the volume moves to a
//! new one and re-issues what it had not completed; ABORTED completions are retried.

mod util;

use std::time::Duration;

use tyche_channel::{FrameDrop, IoError};
use tyche_wire::{DisconnectReason, Kind, Status};
use util::{pattern, Dir, Fate, Pair, PairConfig, SESSION};

const NEW: u64 = 0x0e55_2022;

#[test]
fn restart_resumes_on_a_new_session_and_reissues_what_was_outstanding() {
    let mut pair = Pair::with(PairConfig { paths: 2, ..PairConfig::default() });
    pair.auto_execute = false;
    let mut expect = Vec::new();
    for id in 1..=6u64 {
        let data = pattern(id, 3072);
        pair.write(id, id * 8192, &data);
        expect.push((id, data));
    }
    pair.run_for(Duration::from_millis(1));
    assert_eq!(pair.to_execute.len(), 6, "every write reached the target");
    // Two writes execute, and their completions are lost with the process.
    pair.fault = Box::new(|p| if p.kind() == Kind::Completion { Fate::Drop } else { Fate::Deliver });
    pair.execute_one();
    pair.execute_one();
    pair.run_for(Duration::from_millis(1));
    pair.restart_target(NEW);
    pair.fault = Box::new(|_| Fate::Deliver);
    pair.auto_execute = true;
    pair.volume.resume(NEW, pair.now);
    assert_eq!(pair.volume.session(), NEW);
    assert_eq!(pair.volume.live_channels(), 0);
    assert_eq!(pair.volume.queued_parts(), 6, "every outstanding part waits for the new session");
    pair.open_session_channel(0, NEW);
    pair.open_session_channel(1, NEW);
    pair.drive();
    for (id, data) in &expect {
        pair.expect_ok(*id);
        let at = (*id * 8192) as usize;
        assert!(pair.storage[at..at + 3072] == data[..], "write {id}");
    }
    assert_eq!(pair.volume.resumes(), 1);
}

#[test]
fn nothing_completes_from_the_abandoned_session() {
    let mut pair = Pair::new();
    // The old session's completions are held in the network.
    pair.fault =
        Box::new(
            |p| {
                if p.dir == Dir::ToInitiator && p.kind() == Kind::Completion {
                    Fate::Hold
                } else {
                    Fate::Deliver
                }
            },
        );
    pair.write(1, 0, &pattern(1, 1024));
    pair.run_for(Duration::from_millis(1));
    assert!(!pair.held.is_empty(), "the completion was held");
    pair.restart_target(NEW);
    pair.volume.resume(NEW, pair.now);
    // The held completion of the old session arrives after the move: it is not the volume's.
    pair.release_held(None);
    pair.fault = Box::new(|_| Fate::Deliver);
    let drops = pair.initiator_drops.len();
    pair.run_for(Duration::from_micros(50));
    assert_eq!(pair.result(1), None, "completed from the abandoned session");
    assert!(pair.initiator_drops[drops..].contains(&FrameDrop::NotOurs), "{:?}", pair.initiator_drops);
    pair.open_session_channel(0, NEW);
    pair.drive();
    pair.expect_ok(1);
    assert!(pair.storage[..1024] == pattern(1, 1024)[..]);
}

#[test]
fn aborted_completion_is_retried_not_reported() {
    let mut pair = Pair::with(PairConfig { no_path_timeout: Duration::from_secs(1), ..PairConfig::default() });
    pair.auto_execute = false;
    let data = pattern(7, 2048);
    pair.write(7, 4096, &data);
    pair.run_for(Duration::from_millis(1));
    let (ch, req) = pair.to_execute.pop_front().expect("handed over");
    // The target shuts down: the request is given up without executing, ABORTED.
    assert!(pair.target.complete(ch, &req, Status::Aborted));
    pair.collect();
    pair.run_for(Duration::from_millis(2));
    assert_eq!(pair.result(7), None, "ABORTED was reported to the caller");
    assert_eq!(pair.volume_aborted.len(), 1);
    assert_eq!(pair.volume.live_channels(), 0, "the channel that answered ABORTED gets no more parts");
    // The target stops: DISCONNECT SHUTDOWN, heard on the retiring channel.
    pair.target.close(DisconnectReason::Shutdown);
    pair.run_for(Duration::from_millis(1));
    assert!(pair.ich(ch).dead().is_some(), "the channel heard the target's DISCONNECT");
    assert_eq!(pair.volume.aborted_parts(), 1);
    assert_eq!(pair.volume.queued_parts(), 1, "the part waits for a channel");
    // The target comes back without the session: the part is issued on the new one.
    pair.restart_target(NEW);
    pair.auto_execute = true;
    pair.volume.resume(NEW, pair.now);
    pair.open_session_channel(0, NEW);
    pair.drive();
    pair.expect_ok(7);
    assert!(pair.storage[4096..4096 + 2048] == data[..]);
}

#[test]
fn an_aborted_write_reissued_in_the_same_session_runs_again() {
    // ABORTED means "not executed": the target does not record it in its at-most-once ledger, so
    // the copy the initiator re-issues on a new channel of the same session executes.
    let mut pair = Pair::with(PairConfig { no_path_timeout: Duration::from_secs(600), ..PairConfig::default() });
    pair.auto_execute = false;
    let data = pattern(9, 512);
    pair.write(9, 0, &data);
    pair.run_for(Duration::from_millis(1));
    let (ch, req) = pair.to_execute.pop_front().expect("handed over");
    assert!(pair.target.complete(ch, &req, Status::Aborted));
    // A target that aborts without stopping: the retiring channel is closed after the grace,
    // and a reconnect re-issues the part.
    pair.run_for(Duration::from_secs(6));
    assert!(pair.ich(0).dead().is_some(), "a retiring channel is closed after the grace");
    assert!(pair.sent.iter().any(|p| p.kind() == Kind::Disconnect && p.channel() == 0));
    pair.auto_execute = true;
    let params = pair.cfg.params;
    pair.open_channel(1, params);
    pair.drive();
    pair.expect_ok(9);
    assert_eq!(pair.volume.aborted_parts(), 1);
    assert!(pair.storage[..512] == data[..]);
}

#[test]
fn a_flush_across_a_lost_session_fails_unless_the_target_said_it_stopped() {
    for graceful in [false, true] {
        let mut pair = Pair::with(PairConfig { no_path_timeout: Duration::from_secs(1), ..PairConfig::default() });
        pair.write(1, 0, &pattern(1, 4096));
        pair.drive();
        pair.expect_ok(1);
        // A FLUSH is outstanding when the target goes away.
        pair.auto_execute = false;
        pair.flush(2);
        pair.run_for(Duration::from_millis(1));
        if graceful {
            pair.target.close(DisconnectReason::Shutdown);
            pair.run_for(Duration::from_millis(1));
        }
        pair.restart_target(NEW);
        pair.auto_execute = true;
        pair.volume.resume(NEW, pair.now);
        pair.open_session_channel(0, NEW);
        pair.flush(3);
        pair.drive();
        if graceful {
            pair.expect_ok(2);
            pair.expect_ok(3);
            assert_eq!(pair.volume.durability_errors(), 0);
        } else {
            // Write 1 was never flushed and the target may have lost it with its cache.
            assert_eq!(pair.result(2), Some(Err(IoError::Target(Status::IoError))));
            assert_eq!(pair.volume.durability_errors(), 1 + u64::from(pair.result(3) != Some(Ok(()))));
        }
    }
}

#[test]
fn no_path_timeout_runs_from_the_last_path_across_a_resume() {
    let mut pair = Pair::new();
    let no_path = pair.cfg.no_path_timeout;
    pair.cut = vec![0];
    pair.write(1, 0, &pattern(1, 1024));
    pair.drive_until("channel 0 dies", |p| !p.volume_dead.is_empty());
    let died = pair.volume_dead[0].3;
    pair.run_for(no_path / 2);
    pair.restart_target(NEW);
    pair.volume.resume(NEW, pair.now);
    pair.drive_until("write 1 fails", |p| p.result(1).is_some());
    assert_eq!(pair.result(1), Some(Err(IoError::NoPath)));
    let failed = pair.completed[0].2;
    assert!(failed >= died + no_path && failed < died + no_path + no_path / 2, "failed at {failed:?}, died {died:?}");
    let _ = SESSION;
}

#[test]
fn a_volume_that_owes_a_durability_report_says_so_until_a_flush_fails() {
    // Found by the simulator (seed 2838, two engine restarts): a volume that took the report
    // over (`assume_writes_lost`) or owes it after a lost session, with no write of its own,
    // said it had nothing unflushed, so a second replacement forgot the report and a FLUSH
    // succeeded after acknowledged writes were lost.
    let mut pair = Pair::new();
    assert!(!pair.volume.unflushed_writes());
    pair.volume.assume_writes_lost();
    assert!(pair.volume.unflushed_writes(), "a report handed on is still owed");
    pair.flush(1);
    pair.drive_until("the flush ends", |p| p.result(1).is_some());
    assert_eq!(pair.result(1), Some(Err(IoError::Target(Status::IoError))));
    assert!(!pair.volume.unflushed_writes(), "reported: nothing owed any more");
    // A write, then the session is lost without a shutdown: owed across the resume.
    pair.write(2, 0, &pattern(2, 512));
    pair.drive_until("the write ends", |p| p.result(2).is_some());
    pair.expect_ok(2);
    pair.restart_target(NEW);
    pair.volume.resume(NEW, pair.now);
    assert!(pair.volume.unflushed_writes(), "owed after a lost session");
}
