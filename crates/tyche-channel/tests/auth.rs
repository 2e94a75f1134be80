//! Sealed channels of a keyed export (docs/protocol.md §7): data moves under loss, duplication
//! and reordering; a forged, altered, unsealed or replayed frame is dropped and counted, and
//! changes nothing.

mod util;

use std::time::Duration;

use tyche_channel::auth::{self, Grant, ProofInput, Psk, Sealer};
use tyche_channel::{
    Accepted, Acceptor, Connector, DropReason, ExportSpec, HandshakeFrame, Instant, KeyedConnect, Role, Timers,
};
use tyche_wire::{
    flags, layout, ChannelParams, Disconnect, DisconnectReason, Envelope, Frame, Kind, Message, Op, Request, Seq,
    DEFAULT_ETHERTYPE, SECTOR_SIZE,
};
use util::{initiator_env, pattern, Dir, Fate, Pair, PairConfig, KEY};

fn keyed(encrypt: bool) -> Pair {
    Pair::with(PairConfig { seal: Some(encrypt), ..PairConfig::default() })
}

/// Every frame on the wire carries the flag and the trailer, and an encrypting pair shows no
/// plaintext of the data it moves.
fn check_sealed(pair: &Pair, data: &[u8], encrypt: bool) {
    assert!(!pair.sent.is_empty());
    for p in &pair.sent {
        let f = Frame::new_checked(&p.bytes[..], DEFAULT_ETHERTYPE).expect("valid frame");
        assert!(f.flags() & flags::SEALED != 0, "unsealed {:?}", f.kind());
        let end = 14 + f.length() as usize;
        assert!(p.bytes.len() >= end + layout::trailer::END, "no trailer");
    }
    let marker = &data[..64];
    let shows = pair.sent.iter().any(|p| p.bytes.windows(marker.len()).any(|w| w == marker));
    assert_eq!(shows, !encrypt, "plaintext data on the wire: {shows}, encrypting: {encrypt}");
}

#[test]
fn keyed_pairs_move_data_under_loss_duplication_and_reordering() {
    for encrypt in [false, true] {
        let mut pair = keyed(encrypt);
        let mut n = 0u64;
        pair.fault = Box::new(move |_| {
            n += 1;
            match n % 7 {
                0 => Fate::Drop,
                3 => Fate::Duplicate,
                5 => Fate::Delay(Duration::from_micros(300)),
                _ => Fate::Deliver,
            }
        });
        let data = pattern(7, 64 * 1024);
        for i in 0..8u64 {
            pair.write(1 + i, i * 8192, &data[(i * 8192) as usize..((i + 1) * 8192) as usize]);
        }
        pair.drive_until("the writes end", |p| (1..=8).all(|id| p.result(id).is_some()));
        for id in 1..=8 {
            pair.expect_ok(id);
        }
        assert_eq!(&pair.storage[..data.len()], &data[..], "encrypt={encrypt}");
        pair.read(20, 0, data.len() as u64);
        pair.drive_until("the read ends", |p| p.result(20).is_some());
        pair.expect_ok(20);
        assert_eq!(pair.bufs[&20], data, "read back, encrypt={encrypt}");
        check_sealed(&pair, &data, encrypt);
        // Duplicated frames were refused as replays, not processed twice.
        let replays = pair.target_dropped(DropReason::Replayed) + pair.initiator_dropped(DropReason::Replayed);
        assert!(replays > 0, "duplicates were not counted as replays (encrypt={encrypt})");
        assert_eq!(pair.target_dropped(DropReason::Unauthenticated), 0);
        assert_eq!(pair.initiator_dropped(DropReason::Unauthenticated), 0);
    }
}

/// Replays every frame the pair sent so far, to both ends, after the pair is done: each is
/// refused as a replay and nothing runs again.
#[test]
fn replayed_frames_change_nothing() {
    for encrypt in [false, true] {
        let mut pair = keyed(encrypt);
        let data = pattern(3, 8192);
        pair.write(1, 0, &data);
        pair.drive_until("the write ends", |p| p.result(1).is_some());
        pair.expect_ok(1);
        pair.run_for(Duration::from_millis(5));
        let executed = pair.executed.len();
        let before = pair.target_dropped(DropReason::Replayed) + pair.initiator_dropped(DropReason::Replayed);
        let captured = pair.sent.clone();
        for p in &captured {
            pair.inject(p.dir, p.bytes.clone());
        }
        pair.run_for(Duration::from_millis(5));
        let after = pair.target_dropped(DropReason::Replayed) + pair.initiator_dropped(DropReason::Replayed);
        assert_eq!(after - before, captured.len(), "every replayed frame is counted (encrypt={encrypt})");
        assert_eq!(pair.executed.len(), executed, "a replayed REQUEST ran again");
        assert!(pair.ich(0).dead().is_none() && pair.tch(0).dead().is_none(), "a replayed DISCONNECT or the like");
    }
}

/// Frames an attacker who saw the session can make: a fresh REQUEST (a WRITE), a forged
/// DISCONNECT, a REQUEST with a huge FLOOR, each unsealed, with a copied trailer, and as a
/// sealed frame with one byte changed. All are dropped as unauthenticated, and the session
/// goes on.
#[test]
fn forged_and_altered_frames_are_dropped_before_anything_changes() {
    for encrypt in [false, true] {
        let mut pair = keyed(encrypt);
        let data = pattern(5, 4096);
        pair.write(1, 0, &data);
        pair.drive_until("the write ends", |p| p.result(1).is_some());
        pair.run_for(Duration::from_millis(2));
        let env = initiator_env(0);
        let t_env = env.reply();
        let req = |floor| Request {
            seq: Seq { seq: 3, ack: 0 },
            op: Op::Write,
            fua: false,
            remq: 5,
            damq: 5,
            home: 0,
            tag: 1000,
            floor,
            offset: 0,
            length: 512,
        };
        let sample = pair.sent.iter().find(|p| p.dir == Dir::ToTarget).expect("a frame").bytes.clone();
        // A real frame's trailer with a counter never used (so the tag is what refuses it).
        let fresh = std::cell::Cell::new(u64::MAX);
        let trailer_of = |b: &[u8]| {
            let f = Frame::new_checked(b, DEFAULT_ETHERTYPE).unwrap();
            let mut t = b[14 + f.length() as usize..14 + f.length() as usize + 24].to_vec();
            fresh.set(fresh.get() - 1);
            t[..8].copy_from_slice(&fresh.get().to_be_bytes());
            t
        };
        let mut forged: Vec<(Dir, Vec<u8>)> = Vec::new();
        for (dir, e, msg) in [
            (Dir::ToTarget, env, Message::Request(req(0))),
            (Dir::ToTarget, env, Message::Request(req(u64::MAX))),
            (Dir::ToTarget, env, Message::Disconnect(Disconnect { reason: DisconnectReason::Shutdown })),
            (Dir::ToInitiator, t_env, Message::Disconnect(Disconnect { reason: DisconnectReason::ProtocolError })),
        ] {
            let mut b = vec![0u8; 256];
            let len = msg.emit(&e, &mut b);
            b.truncate(len);
            forged.push((dir, b.clone()));
            // The same with the flag and a trailer copied from a real frame.
            let f = Frame::new_checked(&b[..], DEFAULT_ETHERTYPE).unwrap();
            let end = 14 + f.length() as usize;
            let mut c = b[..end].to_vec();
            c[16] |= (flags::SEALED >> 8) as u8;
            c.extend_from_slice(&trailer_of(&sample));
            c.resize(c.len().max(60), 0);
            forged.push((dir, c));
        }
        // Real frames with one byte changed (the sequence number, the body, the payload, the
        // tag), given a counter never used; and one with only the counter changed.
        for p in pair.sent.iter().filter(|p| p.kind() == Kind::Data).take(1) {
            let f = Frame::new_checked(&p.bytes[..], DEFAULT_ETHERTYPE).unwrap();
            let end = 14 + f.length() as usize;
            for at in [Some(31), Some(47), Some(100), Some(end + 12), None] {
                let mut c = p.bytes.clone();
                if let Some(at) = at {
                    c[at] ^= 0x01;
                }
                let t = trailer_of(&p.bytes);
                c[end..end + 8].copy_from_slice(&t[..8]);
                forged.push((p.dir, c));
            }
        }
        let executed = pair.executed.len();
        let before =
            pair.target_dropped(DropReason::Unauthenticated) + pair.initiator_dropped(DropReason::Unauthenticated);
        let n = forged.len();
        for (dir, b) in forged {
            pair.inject(dir, b);
        }
        pair.run_for(Duration::from_millis(5));
        let after =
            pair.target_dropped(DropReason::Unauthenticated) + pair.initiator_dropped(DropReason::Unauthenticated);
        assert_eq!(after - before, n, "every forged frame is dropped as unauthenticated (encrypt={encrypt})");
        assert_eq!(pair.executed.len(), executed, "a forged request ran");
        assert!(pair.ich(0).dead().is_none() && pair.tch(0).dead().is_none(), "a forged DISCONNECT closed a channel");
        // And the session still works, with requests after the huge FLOOR.
        pair.read(2, 0, 4096);
        pair.drive_until("a read after the attack", |p| p.result(2).is_some());
        pair.expect_ok(2);
        assert_eq!(pair.bufs[&2], data);
    }
}

/// Channels sealed with keys of another handshake (another channel, or a reconnect) do not
/// accept each other's frames.
#[test]
fn keys_differ_per_handshake_and_direction() {
    let mut b_other = Sealer::derive(KEY, &[2; 32], Role::Target, false);
    let mut b_same = Sealer::derive(KEY, &[1; 32], Role::Target, false);
    let mut a_twin = Sealer::derive(KEY, &[1; 32], Role::Initiator, false);
    let mut buf = vec![0u8; 256];
    let len = Message::Disconnect(Disconnect { reason: DisconnectReason::Normal }).emit(&initiator_env(0), &mut buf);
    let mut s = Sealer::derive(KEY, &[1; 32], Role::Initiator, false);
    let len = s.seal(&mut buf[..]).max(len);
    let frame = buf[..len].to_vec();
    let mut scratch = Vec::new();
    assert!(b_same.open(&frame, &mut scratch).is_ok(), "the peer of the same handshake accepts it");
    assert_eq!(b_other.open(&frame, &mut scratch), Err(DropReason::Unauthenticated), "another handshake's key");
    assert_eq!(a_twin.open(&frame, &mut scratch), Err(DropReason::Unauthenticated), "its own direction's key");
}

/// The whole keyed handshake, Connector against Acceptor, gives both ends the same keys: the
/// channels they build talk; and the target's proof covers the grant.
#[test]
fn handshake_channels_share_keys() {
    let params = ChannelParams { ring: 64, remq_slots: 8, damq_slots: 8, segment: 1024, max_io: 8192, features: 0 };
    for encrypt in [false, true] {
        let mut fl = flags::EXPORT_NEEDS_KEY;
        if encrypt {
            fl |= flags::EXPORT_ENCRYPTED;
        }
        let spec = ExportSpec {
            name: "k".into(),
            size: 1 << 20,
            block_size: SECTOR_SIZE,
            flags: fl,
            durability_epoch: tyche_wire::DurabilityEpoch([5; 16]),
        };
        let mut acc = Acceptor::new(DEFAULT_ETHERTYPE, vec![spec], params, Timers::default());
        let env = Envelope { session: 0, ..initiator_env(0) };
        let now = Instant(1);
        let mut c = Connector::new(env, "k", params, 77, Duration::from_millis(5), 3, now).with_key(KEY);
        let mut buf = [0u8; 512];
        let mut out = [0u8; 512];
        // CONNECT, then a CHALLENGE (as the target daemon sends it), then CONNECT + PROOF.
        c.poll_transmit(now, &mut buf).expect("CONNECT");
        let challenge = tyche_wire::Challenge { nonce: 77, target_nonce: 0x5151 };
        assert!(c.handle(env.dst, 0, &Message::Challenge(challenge)).is_none());
        let len = c.poll_transmit(now, &mut buf).expect("CONNECT + PROOF");
        let connect = buf[..len].to_vec();
        let f = Frame::new_checked(&connect[..], DEFAULT_ETHERTYPE).unwrap();
        let cenv = Envelope::of(&f);
        let Ok(Message::Connect(m)) = f.parse() else { panic!("CONNECT") };
        let input = ProofInput {
            nonce: 77,
            target_nonce: 0x5151,
            session: 0,
            channel: 0,
            export: "k",
            initiator: env.src,
            target: env.dst,
            host: None,
            asked: params,
        };
        assert!(auth::verify_initiator(KEY, &input, &m.proof.expect("a proof")));
        let psk = Psk::new(KEY);
        let keyed = Some(KeyedConnect { key: &psk, target_nonce: 0x5151 });
        let msg = Message::Connect(m);
        let Some(Accepted::Channel { session, channel: mut tch, len, .. }) = acc.handle_keyed(
            now,
            HandshakeFrame { local: env.dst, src: env.src, env: &cenv, msg: &msg },
            &mut || 9,
            &mut out,
            keyed,
        ) else {
            panic!("a channel")
        };
        let af = Frame::new_checked(&out[..len], DEFAULT_ETHERTYPE).unwrap();
        let Ok(Message::Accept(a)) = af.parse() else { panic!("ACCEPT") };
        let grant = Grant {
            session,
            params: a.params,
            export_size: 1 << 20,
            block_size: SECTOR_SIZE,
            export_flags: fl,
            durability_epoch: a.durability_epoch,
            channel_mac: a.channel_mac,
        };
        assert!(auth::verify_target(KEY, &input, &grant, &a.proof.expect("target proof")));
        let outcome = c.handle(env.dst, session, &Message::Accept(a)).expect("outcome").expect("connected");
        let mut ich = c.channel(&outcome, Timers::default(), now);
        assert!(ich.sealed() && tch.sealed());
        // A DISCONNECT from the initiator's channel reaches the target's and closes it.
        ich.close(DisconnectReason::Normal);
        let t = ich.poll_transmit(now, &mut buf).expect("DISCONNECT");
        let len = ich.seal(&mut buf, t.len);
        let mut scratch = Vec::new();
        let opened = tch.open(&buf[..len], &mut scratch).expect("authentic");
        let f = Frame::new_checked(opened, DEFAULT_ETHERTYPE).unwrap();
        assert!(matches!(f.parse(), Ok(Message::Disconnect(_))), "encrypt={encrypt}");
        // A retry of the same CONNECT + PROOF (its ACCEPT lost) gets the same ACCEPT again and
        // no second channel, without a challenge to check it against.
        assert!(acc.is_retry(env.src, &cenv, &m));
        let mut again = [0u8; 512];
        match acc.handle_keyed(
            now,
            HandshakeFrame { local: env.dst, src: env.src, env: &cenv, msg: &msg },
            &mut || 10,
            &mut again,
            None,
        ) {
            Some(Accepted::Reply(n)) => assert_eq!(&again[..n], &out[..n], "the same ACCEPT"),
            other => panic!("a retry got {other:?}"),
        }
        // The proof with another channel index is no retry, and without a checked proof no
        // channel is granted.
        let moved = Envelope { channel: 9, ..cenv };
        assert!(!acc.is_retry(env.src, &moved, &m));
        match acc.handle_keyed(
            now,
            HandshakeFrame { local: env.dst, src: env.src, env: &moved, msg: &msg },
            &mut || 11,
            &mut again,
            None,
        ) {
            Some(Accepted::Reply(n)) => {
                let f = Frame::new_checked(&again[..n], DEFAULT_ETHERTYPE).unwrap();
                assert!(matches!(f.parse(), Ok(Message::Reject(_))), "refused");
            }
            other => panic!("a moved proof got {other:?}"),
        }
    }
}

/// Byte fixtures of docs/protocol.md §7, computed independently (Python's `cryptography`:
/// HKDF-SHA256 and AES-256-GCM) from key `a key of at least sixteen bytes`, a target proof of
/// bytes 0..=31 and Appendix A's ACK, sealed with counter 0 by the initiator.
#[test]
fn sealed_frame_fixtures() {
    const AUTH: &str = "02540000000202540000000188b5032080000020000301020304050607080000002200000000800000000000000500000000000000006b87c33d4a17230b16fa4f85c34cff11";
    const ENCRYPTED: &str = "02540000000202540000000188b5032080000020000301020304050607088bbb1ad3d4ebf45a2636dc7d33486ba10000000000000000e2106fb5ef9ff9e3b78434438a325ff7";
    let proof: [u8; 32] = std::array::from_fn(|i| i as u8);
    let env = Envelope {
        dst: tyche_wire::MacAddr::local(2),
        src: tyche_wire::MacAddr::local(1),
        ethertype: DEFAULT_ETHERTYPE,
        channel: 3,
        session: 0x0102_0304_0506_0708,
    };
    let ack = Message::Ack(tyche_wire::Ack { cumulative: 34, sack: 0x8000_0000_0000_0005, duplicate: false });
    for (encrypt, want) in [(false, AUTH), (true, ENCRYPTED)] {
        let mut buf = vec![0u8; 128];
        ack.emit(&env, &mut buf);
        let mut s = Sealer::derive(KEY, &proof, Role::Initiator, encrypt);
        let len = s.seal(&mut buf);
        let hex: String = buf[..len].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, want, "encrypt={encrypt}");
        let mut peer = Sealer::derive(KEY, &proof, Role::Target, encrypt);
        let mut scratch = Vec::new();
        let plain = peer.open(&buf[..len], &mut scratch).expect("the target opens it").to_vec();
        let f = Frame::new_checked(&plain[..], DEFAULT_ETHERTYPE).unwrap();
        assert_eq!(f.parse().unwrap(), ack);
    }
}

/// Feature DIGEST: payloads corrupted on the way (after the Ethernet FCS) are caught by their
/// CRC32C, counted and sent again; what lands is what was sent. Without the feature the same
/// corruption lands in storage, which is what the digest is for.
#[test]
fn digest_catches_corrupted_payloads() {
    for digest in [true, false] {
        let mut cfg = PairConfig::default();
        if digest {
            cfg.params.features = flags::FEATURE_DIGEST;
        }
        let mut pair = Pair::with(cfg);
        let mut n = 0u64;
        pair.fault = Box::new(move |p| {
            n += 1;
            // Every third DATA frame, once each way: a payload byte flipped.
            if p.kind() == Kind::Data && n % 3 == 0 && n < 200 {
                Fate::Corrupt(tyche_wire::DATA_FRAME_OVERHEAD + 100)
            } else {
                Fate::Deliver
            }
        });
        let data = pattern(11, 32 * 1024);
        pair.write(1, 0, &data);
        pair.drive_until("the write ends", |p| p.result(1).is_some());
        pair.expect_ok(1);
        pair.read(2, 0, data.len() as u64);
        pair.drive_until("the read ends", |p| p.result(2).is_some());
        pair.expect_ok(2);
        let caught = pair.target_dropped(DropReason::BadDigest) + pair.initiator_dropped(DropReason::BadDigest);
        if digest {
            assert!(caught > 0, "no corruption was caught");
            assert_eq!(&pair.storage[..data.len()], &data[..], "corrupted data was written");
            assert_eq!(pair.bufs[&2], data, "corrupted data was returned");
        } else {
            assert_eq!(caught, 0);
            assert_ne!(&pair.storage[..data.len()], &data[..], "the corruption should have landed without a digest");
        }
    }
}
