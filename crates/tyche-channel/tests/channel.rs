//! Scenario tests of the channel engine: one test per protocol rule (docs/protocol.md §4, §5).

mod util;

use std::time::Duration;

use tyche_channel::{DeadReason, DropReason, Instant, IoError, IoRequest, SubmitError};
use tyche_wire::{ChannelParams, DisconnectReason, Kind, Message, Op, Status};
use util::{pattern, Dir, Fate, Pair, PairConfig};

fn round_trip(pair: &mut Pair, id: u64, offset: u64, len: usize) {
    let data = pattern(id, len);
    pair.write(id, offset, &data);
    pair.drive();
    pair.expect_ok(id);
    pair.read(id + 1000, offset, len as u64);
    pair.drive();
    pair.expect_ok(id + 1000);
    assert!(pair.bufs[&(id + 1000)] == data, "read {len} bytes at {offset}: data differs from what was written");
    assert!(pair.storage[offset as usize..offset as usize + len] == data[..], "export differs after write");
}

#[test]
fn write_then_read_round_trip_sizes() {
    let mut pair = Pair::new();
    let seg = pair.cfg.params.segment as usize;
    // 512 B, one segment, many segments, many segments with the last one partial.
    for (i, len) in [512, seg, 8 * seg, 5 * seg + 512].into_iter().enumerate() {
        round_trip(&mut pair, i as u64 + 1, (i as u64) << 16, len);
    }
}

/// Jumbo frames that arrive in pieces (a multi-buffer link: 8254-byte DATA frames over buffers
/// of 3646 bytes) are placed from their pieces, without a copy on a plain channel, and gathered
/// on a sealed one; the data is the same either way.
#[test]
fn frames_in_pieces_place_their_payload_from_the_pieces() {
    for seal in [None, Some(false), Some(true)] {
        let params =
            ChannelParams { ring: 64, remq_slots: 16, damq_slots: 16, segment: 8192, max_io: 128 << 10, features: 0 };
        let mut pair = Pair::with(PairConfig { params, pieces: Some(3646), seal, ..PairConfig::default() });
        for (i, len) in [8192usize, 128 << 10, 5 * 8192 + 512].into_iter().enumerate() {
            round_trip(&mut pair, i as u64 + 1, (i as u64) << 17, len);
        }
        assert!(pair.multi_piece_frames > 0, "{seal:?}: frames arrived in pieces");
        if seal.is_none() {
            assert!(pair.multi_piece_payloads > 0, "plain channels place payloads in pieces");
        } else {
            assert_eq!(pair.multi_piece_payloads, 0, "sealed channels gather first");
        }
        assert!(pair.target_drops.is_empty(), "{seal:?}: {:?}", pair.target_drops);
    }
}

/// A frame in more pieces than the limit, or whose LENGTH runs past its pieces, or whose
/// payload is not whole sectors, is dropped as malformed: never placed, never a panic.
#[test]
fn bad_frames_in_pieces_are_dropped() {
    use tyche_channel::{FrameDrop, TargetInbound};
    use tyche_wire::{DataHeader, Seq, WireError};
    let params =
        ChannelParams { ring: 64, remq_slots: 16, damq_slots: 16, segment: 8192, max_io: 128 << 10, features: 0 };
    let mut pair = Pair::with(PairConfig { params, pieces: Some(3646), ..PairConfig::default() });
    round_trip(&mut pair, 1, 0, 8192);
    let payload = vec![7u8; 8192];
    let h = DataHeader { seq: Seq { seq: 100, ack: 0 }, damq: 0, seg_index: 0, seg_count: 1, tag: 99, offset: 0 };
    let good =
        util::frame_of(&util::initiator_env(0), &Message::Data(tyche_wire::Data { header: h, payload: &payload }));
    let (mut scratch, mut gather) = (Vec::new(), Vec::new());
    // Five pieces: more than MAX_PIECES.
    let five: Vec<&[u8]> = good.chunks(good.len().div_ceil(5)).collect();
    assert_eq!(five.len(), 5);
    let got = pair.target.handle_frame_pieces(pair.now, &five, &mut scratch, &mut gather);
    assert_eq!(got, TargetInbound::Dropped(FrameDrop::Wire(WireError::BadLength)));
    // LENGTH says more than the pieces hold: the last piece cut short.
    let cut: Vec<&[u8]> = vec![&good[..3646], &good[3646..7292], &good[7292..good.len() - 512]];
    let got = pair.target.handle_frame_pieces(pair.now, &cut, &mut scratch, &mut gather);
    assert_eq!(got, TargetInbound::Dropped(FrameDrop::Wire(WireError::Truncated)));
    // A payload that is not whole sectors (LENGTH lowered by 100 bytes).
    let mut odd = good.clone();
    let at = tyche_wire::ETH_HEADER_LEN + tyche_wire::layout::common::LENGTH.start;
    let l = u16::from_be_bytes([odd[at], odd[at + 1]]) - 100;
    odd[at..at + 2].copy_from_slice(&l.to_be_bytes());
    let pieces: Vec<&[u8]> = odd.chunks(3646).collect();
    let got = pair.target.handle_frame_pieces(pair.now, &pieces, &mut scratch, &mut gather);
    assert_eq!(got, TargetInbound::Dropped(FrameDrop::Wire(WireError::Malformed)));
    // A first piece shorter than the headers is gathered and handled whole.
    let pieces: Vec<&[u8]> = vec![&good[..40], &good[40..]];
    let got = pair.target.handle_frame_pieces(pair.now, &pieces, &mut scratch, &mut gather);
    assert!(matches!(got, TargetInbound::Write { .. } | TargetInbound::Dropped(_)), "{got:?}");
}

#[test]
fn credit_flow_control_bounds_unacked_frames() {
    let params =
        ChannelParams { ring: 8, remq_slots: 32, damq_slots: 32, segment: 1024, max_io: 16 << 10, features: 0 };
    let mut pair = Pair::with(PairConfig { params, ..PairConfig::default() });
    let mut expect = Vec::new();
    for id in 1..=24u64 {
        let data = pattern(id, 4096);
        pair.write(id, id * 8192, &data);
        expect.push((id, data));
    }
    // The harness asserts, for every frame sent, that its seq is within the peer's window.
    pair.drive();
    assert!(pair.max_unacked <= 8, "a sender had {} unacknowledged frames on a ring of 8", pair.max_unacked);
    assert!(
        pair.max_unacked == 8,
        "the ring was never filled ({}): the test did not exercise credit",
        pair.max_unacked
    );
    for (id, _) in &expect {
        pair.expect_ok(*id);
        pair.read(id + 100, id * 8192, 4096);
    }
    pair.drive();
    for (id, data) in &expect {
        assert!(pair.bufs[&(id + 100)] == *data, "read back of write {id} differs");
    }
    assert!(pair.max_unacked <= 8);
}

#[test]
fn duplicated_frames_are_dropped_and_write_executes_once() {
    let mut pair = Pair::new();
    pair.fault =
        Box::new(|p| if p.dir == Dir::ToTarget && p.seq().is_some() { Fate::Duplicate } else { Fate::Deliver });
    let data = pattern(1, 4096);
    pair.write(1, 0, &data);
    pair.drive();
    pair.expect_ok(1);
    // REQUEST + 4 DATA, each delivered twice.
    assert_eq!(pair.target_dropped(DropReason::Duplicate), 5, "every second copy is a duplicate");
    assert_eq!(pair.executions(1), 1, "a duplicated WRITE was executed more than once");
    assert_eq!(pair.tch(0).stats().dropped[DropReason::Duplicate as usize], 5);
    assert!(pair.storage[..4096] == data[..]);
}

#[test]
fn frame_far_ahead_is_out_of_window() {
    let mut pair = Pair::new();
    pair.write(1, 0, &pattern(1, 1024));
    // Hold the request, then send a copy with its seq moved a ring ahead.
    pair.drive();
    let mut p = pair.sent.clone();
    p.retain(|p| p.kind() == Kind::Request);
    let Message::Request(mut r) = p[0].msg() else { unreachable!() };
    r.seq.seq += pair.cfg.params.ring as u32 + 3;
    let bytes = util::frame_of(&util::initiator_env(0), &Message::Request(r));
    let mut scratch = Vec::new();
    let got = pair.target.handle_frame(pair.now, &bytes, &mut scratch);
    assert_eq!(
        got,
        tyche_channel::TargetInbound::Dropped(tyche_channel::FrameDrop::Channel(DropReason::OutOfWindow)),
        "a frame a ring ahead must be out of window"
    );
    // And a far-behind copy (already received) is a duplicate, not executed again.
    let Message::Request(mut r) = p[0].msg() else { unreachable!() };
    r.seq.seq = 0;
    let bytes = util::frame_of(&util::initiator_env(0), &Message::Request(r));
    let mut scratch = Vec::new();
    let got = pair.target.handle_frame(pair.now, &bytes, &mut scratch);
    assert_eq!(got, tyche_channel::TargetInbound::Dropped(tyche_channel::FrameDrop::Channel(DropReason::Duplicate)));
    pair.collect();
    assert_eq!(pair.executions(r.tag), 1);
}

#[test]
fn lost_data_segment_recovered_by_nack_before_rto() {
    let mut pair = Pair::new();
    // Warm up so the channel has an RTT estimate.
    round_trip(&mut pair, 1, 0, 512);
    let mut data_frames = 0;
    pair.fault = Box::new(move |p| {
        if p.dir == Dir::ToTarget && p.kind() == Kind::Data {
            data_frames += 1;
            if data_frames == 2 {
                return Fate::Drop;
            }
        }
        Fate::Deliver
    });
    let data = pattern(7, 4096);
    let start = pair.now;
    pair.write(7, 65536, &data);
    pair.drive_until("write 7 completes", |p| p.result(7).is_some());
    pair.expect_ok(7);
    let took = pair.completed.iter().find(|c| c.0 == 7).unwrap().2 - start;
    let initial_rto = pair.cfg.timers.initial_rto;
    assert!(took < initial_rto, "recovery took {took:?}, not below the initial RTO {initial_rto:?}");
    assert!(pair.tch(0).stats().nacks_tx > 0, "target sent no NACK");
    assert!(pair.ich(0).stats().nacks_rx > 0, "initiator received no NACK");
    assert!(pair.ich(0).stats().retransmits > 0, "nothing retransmitted");
    assert_eq!(pair.ich(0).stats().timeouts, 0, "recovered by timeout, not by NACK");
    pair.drive();
    assert!(pair.storage[65536..65536 + 4096] == data[..]);
}

/// Holds back every frame to the initiator sent within the next `rto` by twice that (a
/// target thread descheduled on a busy core): its acknowledgements come after the timer fires.
fn hold_acknowledgements(pair: &mut Pair, rto: Duration) {
    let until = pair.now + rto;
    pair.fault =
        Box::new(
            move |p| {
                if p.dir == Dir::ToInitiator && p.at <= until {
                    Fate::Delay(rto * 2)
                } else {
                    Fate::Deliver
                }
            },
        );
}

/// F-RTO: acknowledgements held back past the retransmission timer (a peer's thread
/// descheduled on a busy core) cost one frame sent again, not the whole window.
#[test]
fn a_delayed_acknowledgement_costs_one_retransmission_not_the_window() {
    let mut pair = Pair::new();
    round_trip(&mut pair, 1, 0, 512);
    let rto = pair.ich(0).rto();
    hold_acknowledgements(&mut pair, rto);
    let data = pattern(7, 16384);
    pair.write(7, 0, &data);
    pair.drive_until("write 7 completes", |p| p.result(7).is_some());
    pair.expect_ok(7);
    let s = *pair.ich(0).stats();
    assert_eq!((s.timeouts, s.spurious_timeouts), (1, 1), "{s:?}");
    assert_eq!(s.retransmits, 1, "only the oldest frame was sent again: {s:?}");
    pair.drive();
    assert!(pair.target_dropped(DropReason::Duplicate) <= 1);
    assert!(pair.storage[..16384] == data[..]);
}

/// F-RTO: an expiry with one frame outstanding (a lone READ request) proves nothing about loss
/// when its acknowledgement comes; it must not turn F-RTO off, or the next delayed
/// acknowledgement would cost the whole window. (The target's ACK flagged DUPLICATE finds it
/// spurious instead: see the next test.)
#[test]
fn a_lone_frames_delayed_acknowledgement_leaves_frto_on() {
    let mut pair = Pair::new();
    round_trip(&mut pair, 1, 0, 512);
    let rto = pair.ich(0).rto();
    hold_acknowledgements(&mut pair, rto);
    pair.read(2, 0, 512);
    pair.drive_until("read 2 completes", |p| p.result(2).is_some());
    pair.expect_ok(2);
    pair.drive();
    let lone = *pair.ich(0).stats();
    assert_eq!((lone.timeouts, lone.retransmits, lone.spurious_timeouts), (1, 1, 1), "{lone:?}");
    // The next delayed acknowledgement, of a window of frames: F-RTO still resends one.
    let rto = pair.ich(0).rto();
    hold_acknowledgements(&mut pair, rto);
    let data = pattern(9, 16384);
    pair.write(9, 0, &data);
    pair.drive_until("write 9 completes", |p| p.result(9).is_some());
    pair.expect_ok(9);
    let s = *pair.ich(0).stats();
    assert_eq!((s.timeouts - lone.timeouts, s.spurious_timeouts - lone.spurious_timeouts), (1, 1), "{s:?}");
    assert_eq!(s.retransmits - lone.retransmits, 1, "only the oldest frame was sent again: {s:?}");
    pair.drive();
    assert!(pair.storage[..16384] == data[..]);
}

/// A pause of the target's threads found by one channel of a volume (a spurious expiry) is one
/// its other channels would find too, each with a resend of its own: they take its raised floor.
#[test]
fn a_spurious_expiry_raises_the_floor_of_the_volumes_other_channels() {
    let cfg = PairConfig { paths: 2, ..PairConfig::default() };
    let min_rto = cfg.timers.min_rto;
    let mut pair = Pair::with(cfg);
    round_trip(&mut pair, 1, 0, 512);
    let base = pair.ich(0).rto().max(pair.ich(1).rto());
    hold_acknowledgements(&mut pair, base);
    pair.read(2, 0, 512);
    pair.drive_until("read 2 completes", |p| p.result(2).is_some());
    pair.expect_ok(2);
    pair.drive();
    let (found, other) = if pair.ich(0).stats().spurious_timeouts > 0 { (0, 1) } else { (1, 0) };
    assert_eq!(pair.ich(found).stats().spurious_timeouts, 1, "{:?}", pair.ich(found).stats());
    assert_eq!(pair.ich(other).stats().spurious_timeouts, 0, "{:?}", pair.ich(other).stats());
    let floor = pair.ich(found).rto_floor();
    assert!(floor >= min_rto * 2, "floor {floor:?} after a spurious expiry");
    assert_eq!(pair.ich(other).rto_floor(), floor, "the other channel took the raised floor");
    assert!(pair.ich(other).rto() >= floor);
}

/// D-SACK: the target receives the lone READ twice (the original was only delayed) and flags
/// its ACK DUPLICATE; the initiator counts the expiry spurious and doubles its RTO's floor, so
/// the same pause does not cost another resend; the floor decays after `FLOOR_DECAY`, and a
/// halving that the pauses prove too soon makes the next one wait twice as long.
#[test]
fn a_duplicate_report_raises_the_rto_floor_until_it_decays() {
    let mut pair = Pair::new();
    round_trip(&mut pair, 1, 0, 512);
    let base = pair.ich(0).rto();
    hold_acknowledgements(&mut pair, base);
    pair.read(2, 0, 512);
    pair.drive_until("read 2 completes", |p| p.result(2).is_some());
    pair.expect_ok(2);
    pair.drive();
    let s = *pair.ich(0).stats();
    assert_eq!((s.timeouts, s.retransmits, s.spurious_timeouts), (1, 1, 1), "{s:?}");
    assert_eq!(pair.target_dropped(DropReason::Duplicate), 1);
    let raised = pair.ich(0).rto();
    assert!(raised >= base * 2, "RTO {raised:?} after a spurious expiry (was {base:?})");
    // A pause that cost an expiry before (acknowledgements held 1.5 old RTOs): none now.
    hold_acknowledgements(&mut pair, base * 3 / 4);
    pair.read(3, 0, 512);
    pair.drive_until("read 3 completes", |p| p.result(3).is_some());
    pair.expect_ok(3);
    assert_eq!(pair.ich(0).stats().timeouts, 1, "{:?}", pair.ich(0).stats());
    // A quiet FLOOR_DECAY later, the next acknowledgement halves the floor back.
    pair.run_for(tyche_channel::FLOOR_DECAY);
    round_trip(&mut pair, 4, 0, 512);
    assert!(pair.ich(0).rto() < raised, "RTO {:?} still at the raised floor {raised:?}", pair.ich(0).rto());
    // The same pause right after that halving: another spurious expiry, the floor doubled again,
    // and the halving too soon, so the next one waits twice as long.
    let lowered = pair.ich(0).rto();
    hold_acknowledgements(&mut pair, lowered);
    pair.read(5, 0, 512);
    pair.drive_until("read 5 completes", |p| p.result(5).is_some());
    pair.expect_ok(5);
    pair.drive();
    assert_eq!(pair.ich(0).stats().spurious_timeouts, 2, "{:?}", pair.ich(0).stats());
    let raised_again = pair.ich(0).rto();
    assert!(raised_again > lowered, "RTO {raised_again:?} after the second spurious expiry");
    pair.run_for(tyche_channel::FLOOR_DECAY);
    round_trip(&mut pair, 6, 0, 512);
    assert!(pair.ich(0).rto() >= raised_again, "halved after one FLOOR_DECAY: {:?}", pair.ich(0).rto());
    pair.run_for(tyche_channel::FLOOR_DECAY);
    round_trip(&mut pair, 7, 0, 512);
    assert!(pair.ich(0).rto() < raised_again, "not halved after two: {:?}", pair.ich(0).rto());
}

/// F-RTO: when the frames were lost (a tail loss: nothing after them for the receiver to
/// NACK), the acknowledgement of the one frame the timer resent says so, and the rest is
/// resent at once.
#[test]
fn a_lost_window_is_resent_after_the_first_acknowledgement() {
    let mut pair = Pair::new();
    round_trip(&mut pair, 1, 0, 512);
    let rto = pair.ich(0).rto();
    let until = pair.now + rto / 2;
    pair.fault =
        Box::new(
            move |p| {
                if p.dir == Dir::ToTarget && p.seq().is_some() && p.at <= until {
                    Fate::Drop
                } else {
                    Fate::Deliver
                }
            },
        );
    let data = pattern(8, 16384);
    let start = pair.now;
    pair.write(8, 0, &data);
    pair.drive_until("write 8 completes", |p| p.result(8).is_some());
    pair.expect_ok(8);
    let took = pair.completed.iter().find(|c| c.0 == 8).unwrap().2 - start;
    let s = *pair.ich(0).stats();
    assert_eq!((s.timeouts, s.spurious_timeouts), (1, 0), "{s:?}");
    assert!(took < rto * 3, "recovery took {took:?} with an RTO of {rto:?}: {s:?}");
    pair.drive();
    assert!(pair.storage[..16384] == data[..]);
}

#[test]
fn blackout_recovered_by_rto_with_exponential_backoff() {
    let mut pair = Pair::new();
    let timers = pair.cfg.timers;
    pair.cut = vec![0];
    let data = pattern(3, 2048);
    pair.write(3, 0, &data);
    let mut rtos = vec![pair.ich(0).rto()];
    let mut last_timeouts = 0;
    // A blackout shorter than dead_after.
    let end = pair.now + Duration::from_millis(60);
    while pair.now < end {
        pair.run_for(Duration::from_micros(100));
        let t = pair.ich(0).stats().timeouts;
        if t != last_timeouts {
            last_timeouts = t;
            rtos.push(pair.ich(0).rto());
        }
    }
    assert!(last_timeouts >= 4, "only {last_timeouts} timeouts in a 60 ms blackout");
    for w in rtos.windows(2) {
        assert_eq!(w[1], (w[0] * 2).min(timers.max_rto), "RTO did not double up to max_rto: {rtos:?}");
    }
    assert_eq!(*rtos.last().unwrap(), timers.max_rto, "RTO never reached max_rto: {rtos:?}");
    pair.cut.clear();
    pair.drive();
    pair.expect_ok(3);
    assert!(pair.ich(0).dead().is_none());
    assert!(pair.ich(0).rto() < timers.max_rto, "RTO not reset after acknowledgement progress");
    assert!(pair.storage[..2048] == data[..]);
}

#[test]
fn reversed_segments_reassemble() {
    let mut pair = Pair::new();
    pair.fault = Box::new(|p| if p.dir == Dir::ToTarget && p.seq().is_some() { Fate::Hold } else { Fate::Deliver });
    let seg = pair.cfg.params.segment as usize;
    let data = pattern(11, 6 * seg + 512);
    pair.write(11, 4096, &data);
    pair.run_for(Duration::from_micros(1)); // transmit into the hold
    pair.fault = Box::new(|_| Fate::Deliver);
    let n = pair.held.len();
    assert_eq!(n, 8, "request and seven segments held");
    let reverse: Vec<usize> = (0..n).rev().collect();
    pair.release_held(Some(&reverse));
    pair.drive();
    pair.expect_ok(11);
    assert_eq!(pair.executed.len(), 1, "the write was executed more than once");
    assert!(pair.storage[4096..4096 + data.len()] == data[..], "reversed segments reassembled wrongly");
}

#[test]
fn completion_overtaking_read_data() {
    let mut pair = Pair::new();
    let seg = pair.cfg.params.segment as usize;
    let data = pattern(5, 4 * seg);
    pair.storage[..data.len()].copy_from_slice(&data);
    pair.fault =
        Box::new(|p| if p.dir == Dir::ToInitiator && p.kind() == Kind::Data { Fate::Hold } else { Fate::Deliver });
    pair.read(1, 0, data.len() as u64);
    pair.drive_until("the completion arrives and the data is held", |p| {
        p.held.len() == 4 && p.sent.iter().any(|s| s.kind() == Kind::Completion) && p.wire.is_empty()
    });
    assert_eq!(pair.result(1), None, "read completed before its data arrived");
    pair.fault = Box::new(|_| Fate::Deliver);
    pair.release_held(Some(&[3, 1, 2, 0]));
    pair.drive();
    pair.expect_ok(1); // panics on a second completion
    assert!(pair.bufs[&1] == data, "read data differs when the completion overtook it");
}

#[test]
fn silent_peer_declared_dead_after_dead_after_not_before() {
    let mut pair = Pair::new();
    round_trip(&mut pair, 1, 0, 512);
    let dead_after = pair.cfg.timers.dead_after;
    pair.cut = vec![0];
    let last = pair.last_rx[&Dir::ToInitiator];
    pair.drive_until("initiator channel dies", |p| !p.volume_dead.is_empty());
    let (ch, reason, _, at) = pair.volume_dead[0];
    assert_eq!((ch, reason), (0, DeadReason::Timeout));
    assert!(at >= last + dead_after, "declared dead at {at:?}, before {last:?} + {dead_after:?}");
    assert!(at <= last + dead_after + Duration::from_millis(1), "declared dead late: {at:?}");
    assert!(pair.ich(0).stats().keepalives_tx > 0, "no probe sent while the peer was silent");
}

#[test]
fn idle_channel_stays_alive_through_keepalives() {
    let mut pair = Pair::new();
    round_trip(&mut pair, 1, 0, 512);
    let dead_after = pair.cfg.timers.dead_after;
    pair.run_for(dead_after * 20);
    assert!(pair.ich(0).dead().is_none() && pair.tch(0).dead().is_none(), "an idle live channel died");
    assert!(pair.volume_dead.is_empty() && pair.target_dead.is_empty());
    assert!(pair.ich(0).stats().keepalives_tx > 0 || pair.tch(0).stats().keepalives_tx > 0, "no keepalives");
    round_trip(&mut pair, 2, 4096, 1024);
}

#[test]
fn close_sends_disconnect_and_peer_sees_it() {
    let mut pair = Pair::new();
    round_trip(&mut pair, 1, 0, 512);
    pair.volume.close();
    pair.drive();
    assert!(pair.sent.iter().any(|p| p.dir == Dir::ToTarget && p.kind() == Kind::Disconnect), "no DISCONNECT sent");
    assert_eq!(pair.ich(0).dead(), Some(DeadReason::Closed));
    assert_eq!(pair.tch(0).dead(), Some(DeadReason::PeerClosed(DisconnectReason::Normal)));
    assert_eq!(pair.target_dead.len(), 1);
    assert_eq!(pair.target_dead[0].1, DeadReason::PeerClosed(DisconnectReason::Normal));
}

#[test]
fn failover_reissues_on_surviving_channel() {
    let mut pair = Pair::with(PairConfig { paths: 2, ..PairConfig::default() });
    let mut expect = Vec::new();
    for id in 1..=6u64 {
        let data = pattern(id, 3072);
        pair.write(id, id * 4096, &data);
        expect.push((id, data));
    }
    // Path 0 goes dark before anything it carries arrives.
    pair.cut = vec![0];
    pair.drive();
    let dead: Vec<_> = pair.volume_dead.iter().filter(|d| d.0 == 0).collect();
    assert_eq!(dead.len(), 1, "channel 0 should die once");
    assert!(dead[0].2 > 0, "nothing re-issued from the dead channel");
    for (id, data) in &expect {
        pair.expect_ok(*id);
        assert!(pair.storage[(*id * 4096) as usize..(*id * 4096) as usize + 3072] == data[..], "write {id}");
        pair.read(id + 100, id * 4096, 3072);
    }
    pair.drive();
    for (id, data) in &expect {
        pair.expect_ok(id + 100);
        assert!(pair.bufs[&(id + 100)] == *data, "read {id} after failover");
    }
    assert_eq!(pair.volume.live_channels(), 1);
}

#[test]
fn no_path_fails_requests_after_timeout() {
    let mut pair = Pair::new();
    let no_path = pair.cfg.no_path_timeout;
    pair.cut = vec![0];
    pair.write(1, 0, &pattern(1, 1024));
    pair.drive();
    let died = pair.volume_dead[0].3;
    assert_eq!(pair.result(1), Some(Err(IoError::NoPath)));
    let failed = pair.completed[0].2;
    assert!(failed >= died + no_path, "failed at {failed:?}, before {died:?} + no_path_timeout");
    // With no live channel at all, a new request fails too, after the timeout.
    let start = pair.now;
    pair.read(2, 0, 512);
    pair.drive();
    assert_eq!(pair.result(2), Some(Err(IoError::NoPath)));
    assert!(pair.completed[1].2 >= start, "failed in the past");
    assert!(pair.completed[1].2 <= start + no_path, "waited longer than no_path_timeout");
}

#[test]
fn io_timeout_bounds_a_requests_wait_for_a_path_and_the_volume_serves_again() {
    let io = Duration::from_millis(300);
    let cfg = PairConfig { no_path_timeout: Duration::from_secs(10), io_timeout: Some(io), ..PairConfig::default() };
    let mut pair = Pair::with(cfg);
    let close = |t: Instant, want: Instant| t >= want && t <= want + Duration::from_millis(5);
    // In flight when its only path dies: it fails io_timeout after its submission, long
    // before no_path_timeout.
    let start = pair.now;
    pair.cut = vec![0];
    pair.write(1, 0, &pattern(1, 1024));
    pair.drive();
    assert_eq!(pair.result(1), Some(Err(IoError::NoPath)));
    assert!(pair.volume_dead[0].3 < start + io, "the channel died before the deadline");
    assert!(close(pair.completed[0].2, start + io), "failed at {:?}, not at {start:?} + {io:?}", pair.completed[0].2);
    // Submitted with no path: it waits, then fails io_timeout after its submission.
    let again = pair.now;
    pair.read(2, 0, 512);
    assert_eq!(pair.result(2), None, "it waits for a path");
    pair.drive();
    assert_eq!(pair.result(2), Some(Err(IoError::NoPath)));
    assert!(close(pair.completed[1].2, again + io), "failed at {:?}, not at {again:?} + {io:?}", pair.completed[1].2);
    // A path comes back: the same volume serves again (nothing to re-attach).
    let params = pair.cfg.params;
    pair.open_channel(1, params);
    let data = pattern(3, 8192);
    pair.write(3, 65536, &data);
    pair.drive();
    pair.expect_ok(3);
    assert!(pair.storage[65536..65536 + 8192] == data[..]);
}

#[test]
fn no_path_with_zero_timeout_fails_at_once() {
    let mut pair = Pair::with(PairConfig { no_path_timeout: Duration::ZERO, ..PairConfig::default() });
    pair.cut = vec![0];
    pair.write(1, 0, &pattern(1, 1024));
    pair.drive();
    assert_eq!(pair.result(1), Some(Err(IoError::NoPath)));
    pair.read(2, 0, 512);
    assert_eq!(pair.result(2), Some(Err(IoError::NoPath)), "submit with no live channel must fail at once");
}

#[test]
fn submit_validation() {
    let mut pair = Pair::with(PairConfig { max_requests: 2, ..PairConfig::default() });
    let size = pair.cfg.export_size;
    let req = |id, op, offset, length| IoRequest { id, op, fua: false, offset, length, node: None };
    let now = pair.now;
    let v = &mut pair.volume;
    assert_eq!(v.submit(now, req(1, Op::Read, 100, 512)), Err(SubmitError::Unaligned));
    assert_eq!(v.submit(now, req(1, Op::Read, 0, 100)), Err(SubmitError::Unaligned));
    assert_eq!(v.submit(now, req(1, Op::Write, 0, 0)), Err(SubmitError::Unaligned));
    assert_eq!(v.submit(now, req(1, Op::Flush, 0, 512)), Err(SubmitError::Unaligned));
    assert_eq!(v.submit(now, req(1, Op::Read, size - 512, 1024)), Err(SubmitError::OutOfRange));
    assert_eq!(v.submit(now, req(1, Op::Read, u64::MAX - 511, 512)), Err(SubmitError::OutOfRange));
    pair.bufs.insert(1, vec![0; 512]);
    pair.bufs.insert(2, vec![0; 512]);
    let v = &mut pair.volume;
    assert_eq!(v.submit(now, req(1, Op::Read, 0, 512)), Ok(()));
    assert_eq!(v.submit(now, req(1, Op::Read, 512, 512)), Err(SubmitError::DuplicateId));
    assert_eq!(v.submit(now, req(2, Op::Read, 512, 512)), Ok(()));
    assert_eq!(v.submit(now, req(3, Op::Read, 1024, 512)), Err(SubmitError::Busy));
    pair.drive();
    pair.expect_ok(1);
    pair.expect_ok(2);
    pair.bufs.insert(3, vec![0; 512]);
    assert_eq!(pair.volume.submit(now, req(3, Op::Read, 1024, 512)), Ok(()), "room again after completions");
    pair.drive();

    let mut ro = Pair::with(PairConfig { read_only: true, ..PairConfig::default() });
    let now = ro.now;
    for op in [Op::Write, Op::Discard, Op::WriteZeroes] {
        assert_eq!(ro.volume.submit(now, req(1, op, 0, 512)), Err(SubmitError::ReadOnly), "{op:?}");
    }
    ro.bufs.insert(1, vec![0; 512]);
    assert_eq!(ro.volume.submit(now, req(1, Op::Read, 0, 512)), Ok(()));
    ro.volume.submit(now, req(2, Op::Flush, 0, 0)).expect("flush on a read-only export");
    ro.drive();
    ro.expect_ok(1);
    ro.expect_ok(2);
}

#[test]
fn large_request_split_into_parts() {
    let mut pair = Pair::new();
    let max_io = pair.cfg.params.max_io as usize;
    let len = 3 * max_io + 1536;
    let data = pattern(9, len);
    pair.write(9, 8192, &data);
    pair.drive();
    pair.expect_ok(9);
    let parts: Vec<_> = pair.executed.iter().filter(|(_, r)| r.op == Op::Write).collect();
    assert_eq!(parts.len(), 4, "a write of 3 max_io + 1536 bytes travels as 4 parts");
    assert!(parts.iter().all(|(_, r)| r.length as usize <= max_io));
    assert!(pair.storage[8192..8192 + len] == data[..]);
    pair.read(10, 8192, len as u64);
    pair.drive();
    pair.expect_ok(10);
    assert!(pair.bufs[&10] == data, "split read differs");
}

#[test]
fn target_status_is_reported() {
    // A request the target cannot serve ends with the target's status, once.
    let mut pair = Pair::with(PairConfig { paths: 1, ..PairConfig::default() });
    pair.auto_execute = false;
    pair.write(1, 0, &pattern(1, 512));
    pair.drive_until("the write reaches the target", |p| !p.to_execute.is_empty());
    let (ch, r) = pair.to_execute.pop_front().unwrap();
    assert!(pair.target.complete(ch, &r, Status::NoSpace));
    assert!(!pair.target.complete(ch, &r, Status::Ok), "completing twice must be refused");
    pair.collect();
    pair.drive();
    assert_eq!(pair.result(1), Some(Err(IoError::Target(Status::NoSpace))));
}

// ----------------------------------------------------------------------------------------------
// Protocol hygiene (docs/protocol.md §3, channel checks), on raw channel ends.

mod hygiene {
    use tyche_channel::{DropReason, Instant, Received};
    use tyche_wire::{ChannelParams, Completion, Data, DataHeader, Message, Op, Request, Seq, Status, NO_SLOT};

    use crate::util::raw_channels;

    fn params() -> ChannelParams {
        ChannelParams { ring: 64, remq_slots: 8, damq_slots: 4, segment: 1024, max_io: 8192, features: 0 }
    }

    fn request(seq: u32, remq: u16, damq: u16, op: Op, length: u32) -> Request {
        Request { seq: Seq { seq, ack: 0 }, op, fua: false, remq, damq, home: 0, tag: 1, floor: 1, offset: 0, length }
    }

    fn data(seq: u32, damq: u16, seg_index: u16, seg_count: u16, offset: u32) -> DataHeader {
        DataHeader { seq: Seq { seq, ack: 0 }, damq, seg_index, seg_count, tag: 1, offset }
    }

    #[test]
    fn request_at_initiator_and_completion_at_target_are_wrong_role() {
        let now = Instant(0);
        let (mut ini, mut tgt) = raw_channels(params(), now);
        let r = Message::Request(request(0, 0, 0, Op::Read, 512));
        assert_eq!(ini.handle(now, &r), Received::Dropped(DropReason::WrongRole));
        let c = Message::Completion(Completion { seq: Seq::default(), status: Status::Ok, remq: 0, damq: 0, tag: 1 });
        assert_eq!(tgt.handle(now, &c), Received::Dropped(DropReason::WrongRole));
        assert_eq!(ini.stats().dropped[DropReason::WrongRole as usize], 1);
        // A refused frame takes no ring position: the real seq 0 still arrives.
        assert_eq!(tgt.handle(now, &r), Received::Consumed);
        assert!(matches!(tgt.poll_event(), Some(tyche_channel::ChannelEvent::Request(_))));
    }

    #[test]
    fn target_counts_requests_being_handled() {
        let now = Instant(0);
        let (_, mut tgt) = raw_channels(params(), now);
        assert_eq!(tgt.busy_remq(), 0);
        let r = Message::Request(request(0, 3, 0, Op::Read, 512));
        assert_eq!(tgt.handle(now, &r), Received::Consumed);
        assert_eq!(tgt.busy_remq(), 1, "a request being handled occupies its remq slot");
        assert!(tgt.complete(3, Status::Ok).is_some());
        assert_eq!(tgt.busy_remq(), 1, "the slot is held until its completion is sent");
        let mut buf = vec![0u8; 4096];
        while tgt.poll_transmit(now, &mut buf).is_some() {}
        assert_eq!(tgt.busy_remq(), 0);
    }

    #[test]
    fn read_data_past_the_end_of_the_request_is_inconsistent() {
        // A hostile target sends a full last segment for a shorter read: the initiator must not
        // hand its caller bytes past the request's buffer.
        let now = Instant(0);
        let (mut ini, _) = raw_channels(params(), now);
        let sub = tyche_channel::Submission { tag: 9, op: Op::Read, fua: false, offset: 0, length: 1000, home: 0 };
        assert!(ini.submit(sub, 0));
        let payload = vec![7u8; 1024];
        let h = DataHeader { seq: Seq { seq: 0, ack: 0 }, damq: 0, seg_index: 0, seg_count: 1, tag: 9, offset: 0 };
        let d = Message::Data(tyche_wire::Data { header: h, payload: &payload });
        assert_eq!(ini.handle(now, &d), Received::Dropped(DropReason::Inconsistent));
        let h = DataHeader { seq: Seq { seq: 1, ack: 0 }, ..h };
        let d = Message::Data(tyche_wire::Data { header: h, payload: &payload[..1000] });
        assert!(matches!(ini.handle(now, &d), Received::Placed(_)));
    }

    #[test]
    fn completions_before_the_data_is_sent_do_not_grow_the_initiators_queue() {
        // A hostile target completes each write before it could have its request or data (no
        // credit: ring 4, nothing acknowledged), guessing the slot and the next tag: the freed
        // slots are reused at once, and what each early completion left queued must go, or the
        // send queue grows with every reuse.
        let now = Instant(0);
        let mut p = params();
        p.ring = 4;
        let (mut ini, _) = raw_channels(p, now);
        let mut buf = vec![0u8; 4096];
        let sub = |tag| tyche_channel::Submission { tag, op: Op::Write, fua: false, offset: 0, length: 8192, home: 0 };
        assert!(ini.submit(sub(1), 0));
        let mut first = None;
        while let Some(t) = ini.poll_transmit(now, &mut buf) {
            let Ok(f) = tyche_wire::Frame::new_checked(&buf[..t.len], tyche_wire::DEFAULT_ETHERTYPE) else { continue };
            if let Ok(Message::Request(r)) = f.parse() {
                first = Some((r.remq, r.damq));
            }
        }
        let (remq, damq) = first.expect("the first request went out");
        for (seq, tag) in (1..=2000u64).enumerate() {
            if tag > 1 {
                assert!(ini.submit(sub(tag), 0), "the slot is free again for write {tag}");
            }
            while ini.poll_transmit(now, &mut buf).is_some() {}
            let c = Completion { seq: Seq { seq: seq as u32, ack: 0 }, status: Status::Ok, remq, damq, tag };
            assert_eq!(ini.handle(now, &Message::Completion(c)), Received::Consumed, "completion of {tag}");
            while ini.poll_event().is_some() {}
        }
        assert!(ini.dead().is_none(), "the channel never overflowed its queue");
    }

    #[test]
    fn a_slot_is_not_reused_before_its_completion_is_sent() {
        // A peer that never acknowledges cannot queue more than one completion per slot: a
        // request on a slot whose completion waits for a ring position is dropped, not queued.
        let now = Instant(0);
        let mut p = params();
        p.ring = 4;
        let (_, mut tgt) = raw_channels(p, now);
        let mut buf = vec![0u8; 4096];
        for seq in 0..200u32 {
            let mut r = request(seq, 0, 0, Op::Discard, 512);
            r.damq = tyche_wire::NO_SLOT;
            r.tag = seq as u64;
            let _ = tgt.handle(now, &Message::Request(r));
            while let Some(tyche_channel::ChannelEvent::Request(req)) = tgt.poll_event() {
                tgt.complete(req.remq, Status::Ok);
            }
            while tgt.poll_transmit(now, &mut buf).is_some() {}
        }
        assert!(tgt.dead().is_none(), "the channel stays up");
        assert!(tgt.stats().dropped[DropReason::BadSlot as usize] > 0, "reuses of a completing slot are dropped");
    }

    #[test]
    fn data_for_out_of_range_damq_slot_is_bad_slot() {
        let now = Instant(0);
        let (_, mut tgt) = raw_channels(params(), now);
        let payload = [0u8; 512];
        let d = Message::Data(Data { header: data(0, 4, 0, 1, 0), payload: &payload });
        assert_eq!(tgt.handle(now, &d), Received::Dropped(DropReason::BadSlot));
    }

    #[test]
    fn inconsistent_segment_fields_are_dropped() {
        let now = Instant(0);
        let (_, mut tgt) = raw_channels(params(), now);
        let payload = [0u8; 1024];
        // Segment 1 must start at 1 × segment.
        let d = Message::Data(Data { header: data(0, 0, 1, 2, 0), payload: &payload });
        assert_eq!(tgt.handle(now, &d), Received::Dropped(DropReason::Inconsistent));
        // A non-last segment shorter than a segment.
        let d = Message::Data(Data { header: data(1, 0, 0, 2, 0), payload: &payload[..512] });
        assert_eq!(tgt.handle(now, &d), Received::Dropped(DropReason::Inconsistent));
        // More segments than max_io allows.
        let d = Message::Data(Data { header: data(2, 0, 0, 9, 0), payload: &payload });
        assert_eq!(tgt.handle(now, &d), Received::Dropped(DropReason::Inconsistent));
        // A segment whose count disagrees with earlier segments of the same slot.
        let d = Message::Data(Data { header: data(3, 1, 0, 2, 0), payload: &payload });
        assert!(matches!(tgt.handle(now, &d), Received::Placed(_)));
        let d = Message::Data(Data { header: data(4, 1, 1, 3, 1024), payload: &payload });
        assert_eq!(tgt.handle(now, &d), Received::Dropped(DropReason::Inconsistent));
    }

    fn completion_sent(tgt: &mut tyche_channel::Channel, now: Instant) -> Completion {
        let mut buf = vec![0; 4096];
        while let Some(t) = tgt.poll_transmit(now, &mut buf) {
            let f = tyche_wire::Frame::new_checked(&buf[..t.len], tyche_wire::DEFAULT_ETHERTYPE).unwrap();
            if let Ok(Message::Completion(c)) = f.parse() {
                return c;
            }
        }
        panic!("the target sent no completion");
    }

    #[test]
    fn request_longer_than_max_io_completes_invalid() {
        let now = Instant(0);
        let (_, mut tgt) = raw_channels(params(), now);
        let r = Message::Request(request(0, 2, 0, Op::Read, 8192 + 512));
        assert_eq!(tgt.handle(now, &r), Received::Consumed);
        assert_eq!(tgt.poll_event(), None, "an oversized request must not be executed");
        let c = completion_sent(&mut tgt, now);
        assert_eq!((c.status, c.remq, c.tag), (Status::Invalid, 2, 1));
    }

    #[test]
    fn flood_of_refused_requests_from_a_peer_that_never_acks_is_not_a_panic() {
        // Each refused request queues an INVALID completion without occupying a slot; a peer that
        // keeps sending them and never acknowledges must not overflow the send queue's bound.
        let now = Instant(0);
        let (_, mut tgt) = raw_channels(params(), now);
        let mut buf = vec![0; 4096];
        for seq in 0..1000u32 {
            let r = Message::Request(request(seq, 0, 0, Op::Read, 8192 + 512));
            let _ = tgt.handle(now, &r);
            while tgt.poll_transmit(now, &mut buf).is_some() {}
        }
        assert!(tgt.dead().is_none());
        assert!(tgt.unacked_frames() <= 64, "credit exceeded");
        assert!(tgt.stats().dropped[DropReason::BadSlot as usize] > 0, "the flood was never refused");
    }

    #[test]
    fn request_naming_out_of_range_damq_completes_invalid() {
        let now = Instant(0);
        let (_, mut tgt) = raw_channels(params(), now);
        let r = Message::Request(request(0, 1, 4, Op::Write, 512));
        assert_eq!(tgt.handle(now, &r), Received::Consumed);
        assert_eq!(tgt.poll_event(), None);
        assert_eq!(completion_sent(&mut tgt, now).status, Status::Invalid);
    }

    #[test]
    fn request_naming_out_of_range_remq_is_refused() {
        // docs/protocol.md §3 says such a REQUEST "is completed with INVALID"; the engine drops
        // it as BadSlot (a completion naming that slot would be dropped by the initiator anyway).
        let now = Instant(0);
        let (_, mut tgt) = raw_channels(params(), now);
        let r = Message::Request(request(0, 8, NO_SLOT, Op::Flush, 0));
        let r = match r {
            Message::Request(r) => Message::Request(Request { offset: 0, ..r }),
            _ => unreachable!(),
        };
        assert_eq!(tgt.handle(now, &r), Received::Dropped(DropReason::BadSlot));
        assert_eq!(tgt.poll_event(), None);
    }
}

#[test]
fn failover_to_a_channel_with_smaller_max_io_does_not_panic() {
    // A part sized for channel 0's max_io must not be forced onto a channel that granted less
    // (the grant is the peer's choice: a smaller one is valid, so this must not be a panic).
    let mut pair = Pair::new();
    let big = pair.cfg.params.max_io as usize;
    let data = pattern(1, big);
    pair.cut = vec![0];
    pair.write(1, 0, &data);
    pair.run_for(Duration::from_micros(50));
    let small = ChannelParams { max_io: 16 << 10, ..pair.cfg.params };
    pair.open_channel(1, small);
    pair.drive();
    assert!(pair.volume_dead.iter().any(|d| d.0 == 0), "channel 0 died");
    assert_eq!(pair.result(1), Some(Err(IoError::NoPath)), "a part no survivor can carry fails");
    // Requests submitted now are split for the surviving channel and succeed.
    pair.write(2, 0, &data);
    pair.drive();
    pair.expect_ok(2);
    assert!(pair.storage[..big] == data[..]);
}

#[test]
fn path_that_loses_only_data_frames_fails_over() {
    // An MTU black hole: small frames (acks, probes, echoes) pass, DATA frames do not. Echoes are
    // not acknowledgement progress, so the channel must still be declared dead.
    let mut pair = Pair::with(PairConfig { paths: 2, ..PairConfig::default() });
    pair.fault = Box::new(|p| if p.channel() == 0 && p.kind() == Kind::Data { Fate::Drop } else { Fate::Deliver });
    let data = pattern(4, 4096);
    pair.write(1, 0, &data);
    pair.drive();
    pair.expect_ok(1);
    assert!(pair.volume_dead.iter().any(|d| d.0 == 0 && d.1 == DeadReason::Timeout && d.2 == 1));
    assert!(pair.storage[..4096] == data[..]);
}

#[test]
fn flush_discard_and_write_zeroes() {
    let mut pair = Pair::new();
    let data = pattern(1, 8192);
    pair.write(1, 0, &data);
    pair.drive();
    let req = |id, op, offset, length| IoRequest { id, op, fua: false, offset, length, node: None };
    let now = pair.now;
    pair.volume.submit(now, req(2, Op::Flush, 0, 0)).unwrap();
    pair.volume.submit(now, req(3, Op::Discard, 0, 2048)).unwrap();
    pair.volume.submit(now, req(4, Op::WriteZeroes, 4096, 1024)).unwrap();
    pair.drive();
    for id in 2..=4 {
        pair.expect_ok(id);
    }
    pair.read(5, 0, 8192);
    pair.drive();
    let mut expect = data.clone();
    expect[..2048].fill(0);
    expect[4096..5120].fill(0);
    assert!(pair.bufs[&5] == expect, "discard / write-zeroes not reflected in a read");
    // None of them carried data.
    let data_frames = pair.sent.iter().filter(|p| p.dir == Dir::ToTarget && p.kind() == Kind::Data).count();
    assert_eq!(data_frames, 8, "only the write's 8 segments carry data");
}

#[test]
fn lost_completion_is_retransmitted_and_completes_once() {
    let mut pair = Pair::new();
    let mut dropped = false;
    pair.fault = Box::new(move |p| {
        if !dropped && p.kind() == Kind::Completion {
            dropped = true;
            return Fate::Drop;
        }
        Fate::Deliver
    });
    let data = pattern(1, 1024);
    pair.write(1, 0, &data);
    pair.drive();
    pair.expect_ok(1);
    assert_eq!(pair.executed.len(), 1, "a lost completion made the write run twice");
    assert!(pair.tch(0).stats().retransmits > 0, "the target did not retransmit its completion");
    let completions = pair.sent.iter().filter(|p| p.kind() == Kind::Completion).count();
    assert!(completions >= 2);
}

#[test]
fn lost_acks_cause_duplicates_that_are_dropped() {
    let mut pair = Pair::new();
    // Every standalone ACK from the target is lost: the initiator retransmits by RTO and the
    // target drops the copies as duplicates (and re-acknowledges).
    pair.fault =
        Box::new(|p| if p.dir == Dir::ToInitiator && p.kind() == Kind::Ack { Fate::Drop } else { Fate::Deliver });
    pair.auto_execute = false;
    let data = pattern(1, 2048);
    pair.write(1, 0, &data);
    pair.run_for(Duration::from_millis(3));
    assert!(pair.ich(0).stats().timeouts > 0, "no RTO without acks");
    assert!(pair.target_dropped(DropReason::Duplicate) > 0, "retransmissions were not dropped as duplicates");
    assert_eq!(pair.to_execute.len(), 1, "the write was handed over once");
    pair.execute_one();
    pair.drive();
    pair.expect_ok(1);
    assert_eq!(pair.executed.len(), 1);
}

#[test]
fn requests_queued_during_an_outage_complete_after_reconnect() {
    let mut pair = Pair::new();
    pair.cut = vec![0];
    pair.write(1, 0, &pattern(1, 512));
    pair.drive_until("channel 0 dies", |p| !p.volume_dead.is_empty());
    assert_eq!(pair.volume.live_channels(), 0);
    // Submitted with no live channel, within no_path_timeout: it waits for a path.
    let data = pattern(2, 8192);
    pair.write(2, 65536, &data);
    let params = pair.cfg.params;
    pair.open_channel(1, params);
    pair.drive();
    pair.expect_ok(1);
    pair.expect_ok(2);
    assert!(pair.storage[65536..65536 + 8192] == data[..]);
    assert!(pair.storage[..512] == pattern(1, 512)[..]);
}
