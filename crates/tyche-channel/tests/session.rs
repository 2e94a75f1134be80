//! The target session's executed-tag ledger (docs/protocol.md §4.4) and the handshake (§4.2).

mod util;

use std::time::Duration;

use tyche_channel::{Accepted, Acceptor, ConnectError, Connector, ExportSpec, HandshakeFrame, Instant, IoError};
use tyche_wire::{Accept, ChannelParams, Envelope, Frame, Kind, Message, RejectReason, Status, DEFAULT_ETHERTYPE};
use util::{pattern, test_timers, Dir, Fate, Pair, PairConfig};

// ----------------------------------------------------------------------------------------------
// Exactly-once.

#[test]
fn reissued_write_with_lost_completion_is_not_executed_again() {
    let mut pair = Pair::with(PairConfig { paths: 2, ..PairConfig::default() });
    pair.auto_execute = false;
    // Everything the target sends on channel 0 is lost: the write's completion never arrives.
    pair.fault = Box::new(|p| if p.dir == Dir::ToInitiator && p.channel() == 0 { Fate::Drop } else { Fate::Deliver });
    let data = pattern(1, 2048);
    pair.write(1, 0, &data);
    pair.drive_until("the write reaches the target", |p| !p.to_execute.is_empty());
    let (ch, r) = pair.to_execute.pop_front().unwrap();
    assert_eq!(ch, 0, "round robin puts the first request on channel 0");
    pair.storage[..2048].copy_from_slice(&data);
    // Record a distinctive status, so the answer to the copy is recognisably the recorded one.
    assert!(pair.target.complete(ch, &r, Status::NoSpace));
    pair.collect();
    pair.drive_until("write 1 ends", |p| p.result(1).is_some());
    let dead: Vec<_> = pair.volume_dead.iter().filter(|d| d.0 == 0).collect();
    assert!(dead.len() == 1 && dead[0].2 == 1, "channel 0 died and re-issued the write: {dead:?}");
    assert_eq!(pair.executions(r.tag), 1, "the re-issued copy was executed again");
    assert!(pair.to_execute.is_empty(), "the re-issued copy was handed over for execution");
    assert_eq!(pair.result(1), Some(Err(IoError::Target(Status::NoSpace))), "not the recorded status");
    assert!(pair.target.duplicates_suppressed() >= 1);
    // The copy really went over channel 1 with the same tag.
    assert!(pair
        .sent
        .iter()
        .any(|p| p.dir == Dir::ToTarget && p.channel() == 1 && p.kind() == Kind::Request && p.tag() == Some(r.tag)));
}

#[test]
fn copy_arriving_while_original_executes_waits_for_its_status() {
    let mut pair = Pair::with(PairConfig { paths: 2, ..PairConfig::default() });
    pair.auto_execute = false;
    pair.fault = Box::new(|p| if p.dir == Dir::ToInitiator && p.channel() == 0 { Fate::Drop } else { Fate::Deliver });
    let data = pattern(2, 1024);
    pair.write(1, 0, &data);
    pair.drive_until("the write reaches the target", |p| !p.to_execute.is_empty());
    // The original is still executing when channel 0 dies and the copy arrives on channel 1.
    pair.drive_until("the copy reaches the target", |p| p.target.duplicates_suppressed() == 1);
    assert_eq!(pair.result(1), None, "the copy must wait for the original's status");
    assert_eq!(pair.to_execute.len(), 1, "the copy was handed over for execution");
    pair.execute_one();
    pair.drive_until("write 1 ends", |p| p.result(1).is_some());
    pair.expect_ok(1);
    assert_eq!(pair.executed.len(), 1);
}

#[test]
fn late_copy_below_floor_is_refused() {
    let mut pair = Pair::with(PairConfig { paths: 2, ..PairConfig::default() });
    // Channel 0's sequenced frames to the target are delayed in the network until released.
    pair.fault = Box::new(|p| {
        if p.dir == Dir::ToTarget && p.channel() == 0 && p.seq().is_some() {
            Fate::Hold
        } else {
            Fate::Deliver
        }
    });
    let old = pattern(1, 2048);
    pair.write(1, 0, &old);
    pair.drive_until("write 1 ends", |p| p.result(1).is_some());
    pair.expect_ok(1);
    assert!(pair.volume_dead.iter().any(|d| d.0 == 0 && d.2 == 1), "write 1 re-issued from channel 0");
    // A newer write of the same blocks moves the floor past tag 1.
    let new = pattern(2, 2048);
    pair.write(2, 0, &new);
    pair.drive_until("write 2 ends", |p| p.result(2).is_some());
    pair.expect_ok(2);
    assert_eq!(pair.executed.len(), 2);
    let tag1 = pair.executed[0].1.tag;
    // The old copies now reach the target's channel 0, which is still alive.
    assert!(pair.tch(0).dead().is_none(), "target channel 0 should still be listening");
    let suppressed = pair.target.duplicates_suppressed();
    pair.fault = Box::new(|_| Fate::Deliver);
    pair.release_held(None);
    pair.run_for(Duration::from_millis(5));
    assert_eq!(pair.executions(tag1), 1, "a late copy below the floor was executed");
    assert!(pair.storage[..2048] == new[..], "an old write was applied over a newer one");
    assert!(pair.target.duplicates_suppressed() > suppressed, "the refused copy was not counted");
    let aborted = pair.sent.iter().any(|p| {
        p.dir == Dir::ToInitiator
            && p.channel() == 0
            && matches!(p.msg(), Message::Completion(c) if c.tag == tag1 && c.status == Status::Aborted)
    });
    assert!(aborted, "the late copy was not answered ABORTED");
}

#[test]
fn request_naming_no_channel_as_home_is_refused_and_counted() {
    // HOME picks the home ledger: a made-up one must not open home ledgers, nor run the request.
    let mut pair = Pair::new();
    let first = std::rc::Rc::new(std::cell::Cell::new(true));
    let f = std::rc::Rc::clone(&first);
    pair.fault = Box::new(move |p| {
        if p.dir == Dir::ToTarget && p.kind() == Kind::Request && f.replace(false) {
            Fate::Drop
        } else {
            Fate::Deliver
        }
    });
    pair.write(1, 0, &pattern(3, 512));
    pair.drive_until("the request is sent", |p| !p.sent.is_empty() && !first.get());
    let sent = pair.sent.iter().find(|p| p.dir == Dir::ToTarget && p.kind() == Kind::Request).unwrap();
    let Message::Request(r) = sent.msg() else { unreachable!() };
    assert_eq!(r.home, sent.channel(), "a first issue names its own channel");
    let env = Envelope::of(&sent.frame());
    let forged = util::frame_of(&env, &Message::Request(tyche_wire::Request { home: 7, ..r }));
    pair.inject(Dir::ToTarget, forged);
    pair.drive_until("write 1 ends", |p| p.result(1).is_some());
    assert_eq!(pair.result(1), Some(Err(IoError::Target(Status::Invalid))));
    assert_eq!(pair.target.bad_home(), 1);
    assert!(pair.executed.is_empty(), "the request ran");
    assert_eq!(pair.target.ledger_records(), 0, "a record was kept for a refused request");
}

#[test]
fn reissued_copy_keeps_its_home() {
    let mut pair = Pair::with(PairConfig { paths: 2, ..PairConfig::default() });
    pair.fault = Box::new(|p| if p.dir == Dir::ToInitiator && p.channel() == 0 { Fate::Drop } else { Fate::Deliver });
    pair.write(1, 0, &pattern(4, 1024));
    pair.drive_until("write 1 ends", |p| p.result(1).is_some());
    pair.expect_ok(1);
    let homes: Vec<(u16, u16)> = pair
        .sent
        .iter()
        .filter(|p| p.dir == Dir::ToTarget && p.kind() == Kind::Request)
        .map(|p| match p.msg() {
            Message::Request(r) => (p.channel(), r.home),
            _ => unreachable!(),
        })
        .collect();
    assert!(homes.contains(&(0, 0)) && homes.contains(&(1, 0)), "first on 0, re-issued on 1 with home 0: {homes:?}");
    assert_eq!(pair.executed.len(), 1);
}

// ----------------------------------------------------------------------------------------------
// Handshake.

const EXPORT: &str = "vol0";

fn acceptor() -> Acceptor {
    let limit =
        ChannelParams { ring: 256, remq_slots: 32, damq_slots: 32, segment: 1024, max_io: 64 << 10, features: 0 };
    let export = ExportSpec {
        name: EXPORT.into(),
        size: 1 << 20,
        block_size: 512,
        flags: 0,
        durability_epoch: tyche_wire::DurabilityEpoch([7; 16]),
    };
    Acceptor::new(DEFAULT_ETHERTYPE, vec![export], limit, test_timers())
}

fn want() -> ChannelParams {
    ChannelParams { ring: 1024, remq_slots: 64, damq_slots: 64, segment: 2048, max_io: 1 << 20, features: 0 }
}

fn connector(channel: u16, session: u64, export: &str, nonce: u64, now: Instant) -> Connector {
    let env = Envelope { channel, session, ..util::initiator_env(channel) };
    Connector::new(env, export, want(), nonce, Duration::from_millis(5), 3, now)
}

/// Hands `bytes` (a CONNECT) to the acceptor; returns its decision and the reply frame.
fn to_acceptor(acc: &mut Acceptor, now: Instant, k: u16, bytes: &[u8], ids: &mut u64) -> (Accepted, Vec<u8>) {
    let f = Frame::new_checked(bytes, DEFAULT_ETHERTYPE).unwrap();
    let msg = f.parse().unwrap();
    let env = Envelope::of(&f);
    let mut out = vec![0; 2048];
    let mut next = || {
        *ids += 1;
        0x5000 + *ids
    };
    let a = acc
        .handle(
            now,
            HandshakeFrame { local: util::target_mac(k), src: f.src(), env: &env, msg: &msg },
            &mut next,
            &mut out,
        )
        .expect("a CONNECT is handled");
    let len = match &a {
        Accepted::Reply(len) | Accepted::Channel { len, .. } => *len,
    };
    out.truncate(len);
    (a, out)
}

fn to_connector(c: &mut Connector, bytes: &[u8]) -> Option<Result<tyche_channel::Connected, ConnectError>> {
    let f = Frame::new_checked(bytes, DEFAULT_ETHERTYPE).unwrap();
    c.handle(f.src(), f.session(), &f.parse().unwrap())
}

fn connect_frame(c: &mut Connector, now: Instant) -> Vec<u8> {
    let mut buf = vec![0; 2048];
    let n = c.poll_transmit(now, &mut buf).expect("a CONNECT is due");
    buf.truncate(n);
    buf
}

#[test]
fn lost_accept_gets_the_same_accept_and_session() {
    let mut now = Instant(1_000);
    let mut acc = acceptor();
    let mut ids = 0;
    let mut c = connector(0, 0, EXPORT, 0xC0FFEE, now);
    let connect = connect_frame(&mut c, now);
    let (first, accept1) = to_acceptor(&mut acc, now, 0, &connect, &mut ids);
    let Accepted::Channel { session, channel, .. } = first else { panic!("first CONNECT opens a channel") };
    assert_eq!(channel.envelope().session, session);
    // ACCEPT lost. No retry before the retry interval.
    assert!(c.poll_transmit(now + Duration::from_millis(1), &mut [0; 2048]).is_none());
    now = now + Duration::from_millis(5);
    c.handle_timeout(now);
    let again = connect_frame(&mut c, now);
    let (second, accept2) = to_acceptor(&mut acc, now, 0, &again, &mut ids);
    assert!(matches!(second, Accepted::Reply(_)), "a retransmitted CONNECT must not open a second channel");
    assert_eq!(accept1, accept2, "the retransmitted CONNECT got a different ACCEPT");
    assert_eq!(ids, 1, "a second session id was drawn");
    let got = to_connector(&mut c, &accept2).expect("outcome").expect("accepted");
    assert_eq!(got.session, session);
    assert_eq!(got.params.ring, 256, "granted the smaller of asked and limit");
    assert_eq!(got.params.segment, 1024);
    assert!(c.poll_transmit(now + Duration::from_secs(1), &mut [0; 2048]).is_none(), "CONNECT after ACCEPT");

    // A second channel joins the session.
    let mut c1 = connector(1, session, EXPORT, 0xBEEF, now);
    let connect = connect_frame(&mut c1, now);
    let (joined, accept) = to_acceptor(&mut acc, now, 1, &connect, &mut ids);
    let Accepted::Channel { session: s1, channel, .. } = joined else { panic!("join opens a channel") };
    assert_eq!(s1, session);
    assert_eq!(channel.envelope().channel, 1);
    let got = to_connector(&mut c1, &accept).unwrap().unwrap();
    assert_eq!(got.session, session);
    assert_eq!(c1.channel(&got, test_timers(), now).envelope().session, session);
    // Every ACCEPT carries the export's durability epoch, and the channel built from it too.
    assert_eq!(got.durability_epoch, tyche_wire::DurabilityEpoch([7; 16]));
    assert_eq!(c1.channel(&got, test_timers(), now).durability_epoch(), got.durability_epoch);
}

#[test]
fn unknown_export_and_unknown_session_are_rejected() {
    let now = Instant(0);
    let mut acc = acceptor();
    let mut ids = 0;
    let mut c = connector(0, 0, "nope", 1, now);
    let (a, reply) = to_acceptor(&mut acc, now, 0, &connect_frame(&mut c, now), &mut ids);
    assert!(matches!(a, Accepted::Reply(_)));
    assert_eq!(to_connector(&mut c, &reply), Some(Err(ConnectError::Rejected(RejectReason::UnknownExport))));
    let mut c = connector(1, 0xDEAD, EXPORT, 2, now);
    let (_, reply) = to_acceptor(&mut acc, now, 1, &connect_frame(&mut c, now), &mut ids);
    assert_eq!(to_connector(&mut c, &reply), Some(Err(ConnectError::Rejected(RejectReason::UnknownSession))));
    assert_eq!(ids, 0, "no session created");
}

#[test]
fn grant_beyond_what_was_asked_is_bad_grant() {
    let now = Instant(0);
    let accept = |params: ChannelParams, session: u64| {
        let env = Envelope { session, ..util::initiator_env(0).reply() };
        let a = Accept {
            nonce: 7,
            params,
            export_size: 1 << 20,
            block_size: 512,
            export_flags: 0,
            proof: None,
            durability_epoch: tyche_wire::DurabilityEpoch([7; 16]),
            channel_mac: tyche_wire::MacAddr::ZERO,
        };
        util::frame_of(&env, &Message::Accept(a))
    };
    let more = [
        ChannelParams { ring: 2048, ..want() },
        ChannelParams { remq_slots: 65, ..want() },
        ChannelParams { damq_slots: 65, ..want() },
        ChannelParams { segment: 4096, ..want() },
        ChannelParams { max_io: 2 << 20, ..want() },
        ChannelParams { features: 1, ..want() },
    ];
    for p in more {
        let mut c = connector(0, 0, EXPORT, 7, now);
        assert_eq!(to_connector(&mut c, &accept(p, 9)), Some(Err(ConnectError::BadGrant)), "{p:?}");
    }
    // Session zero in an ACCEPT is no session.
    let mut c = connector(0, 0, EXPORT, 7, now);
    assert_eq!(to_connector(&mut c, &accept(want(), 0)), Some(Err(ConnectError::BadGrant)));
    // A join answered with another session.
    let mut c = connector(0, 5, EXPORT, 7, now);
    assert_eq!(to_connector(&mut c, &accept(want(), 6)), Some(Err(ConnectError::BadGrant)));
    // An ACCEPT for another nonce is ignored; exactly what was asked is fine.
    let mut c = connector(0, 0, EXPORT, 8, now);
    assert_eq!(to_connector(&mut c, &accept(want(), 9)), None);
    let mut c = connector(0, 0, EXPORT, 7, now);
    assert!(matches!(to_connector(&mut c, &accept(want(), 9)), Some(Ok(_))));
}

#[test]
fn unanswered_connect_times_out() {
    let mut now = Instant(0);
    let mut c = connector(0, 0, EXPORT, 1, now);
    let mut sent = 0;
    for _ in 0..10 {
        if c.poll_transmit(now, &mut [0; 2048]).is_some() {
            sent += 1;
        }
        now = now + Duration::from_millis(5);
        c.handle_timeout(now);
    }
    assert_eq!(sent, 3, "one CONNECT per attempt");
    assert_eq!(c.outcome(), Some(Err(ConnectError::Timeout)));
}

#[test]
fn completing_a_replaced_channels_request_leaves_the_new_channel_alone() {
    let mut pair = Pair::new();
    pair.auto_execute = false;
    let data = pattern(2, 1024);
    pair.storage[65536..65536 + 1024].copy_from_slice(&pattern(3, 1024));
    pair.read(1, 0, 512); // remq 0
    pair.write(2, 0, &data); // remq 1
    pair.drive_until("both reach the target", |p| p.to_execute.len() == 2);
    pair.execute_one(); // the read
    pair.drive_until("the read ends", |p| p.result(1).is_some());
    let (_, old_write) = pair.to_execute.pop_front().unwrap();
    assert_eq!(old_write.remq, 1);
    // The initiator reconnects channel 0; the target's acceptor hands out a fresh end for it.
    let params = pair.cfg.params;
    pair.open_channel(0, params);
    pair.read(3, 65536, 1024); // the re-issued write takes remq 0 on the new channel, this read remq 1
    pair.drive_until("the read reaches the new channel", |p| !p.to_execute.is_empty());
    // The old write finishes on storage; the caller reports it as (channel 0, remq 1).
    pair.storage[..1024].copy_from_slice(&data);
    assert!(pair.target.complete(0, &old_write, Status::Ok));
    pair.collect();
    pair.run_for(Duration::from_millis(1));
    assert_eq!(pair.result(3), None, "read 3 completed without being executed");
    pair.auto_execute = true;
    pair.execute_one();
    pair.drive_until("everything ends", |p| p.volume.outstanding() == 0);
    pair.expect_ok(2);
    pair.expect_ok(3);
    assert!(pair.bufs[&3] == pattern(3, 1024));
}

// ----------------------------------------------------------------------------------------------
// Fencing (the storage side: `tyche_channel::fence`).

#[test]
fn a_fenced_session_answers_what_waits_before_storage_aborted_and_says_goodbye() {
    let mut pair = Pair::with(PairConfig { paths: 1, ..PairConfig::default() });
    pair.auto_execute = false;
    pair.write(1, 0, &pattern(3, 1024));
    pair.drive_until("the write reaches the target", |p| !p.to_execute.is_empty());
    let (ch, r) = pair.to_execute.pop_front().unwrap();
    // A newer attachment of the same initiator fenced the session while the write waited
    // before storage: it is answered ABORTED (not executed), and nothing else is.
    assert_eq!(pair.target.fence([(ch, r)]), 1);
    assert!(!pair.target.complete(ch, &r, tyche_wire::Status::Ok), "answered once, by the fence");
    assert_eq!(pair.target.fence([(ch, r)]), 0, "a request no longer handed out is not answered again");
    pair.collect();
    pair.run_for(Duration::from_millis(50));
    let goodbye = pair.sent.iter().any(|p| {
        p.dir == Dir::ToInitiator
            && matches!(p.msg(), Message::Disconnect(d) if d.reason == tyche_wire::DisconnectReason::Normal)
    });
    assert!(goodbye, "the fenced session's channel closes with DISCONNECT NORMAL");
    assert_eq!(pair.executions(r.tag), 1, "the fenced session hands out nothing more");
    assert!(pair.to_execute.is_empty());
}
