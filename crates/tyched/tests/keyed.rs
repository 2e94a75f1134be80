//! Keyed exports against an attacker who sees every frame, in-process: each case
//! here once worked against tyched. A captured CONNECT + PROOF replayed after its session was
//! reclaimed, or re-addressed to the live session's id and a new channel index, opens nothing;
//! forged, altered and replayed channel frames change nothing; the honest session goes on.

mod common;

use std::time::Duration;

use common::*;
use tyche_transport::FrameTransportExt;
use tyche_wire::{
    flags, layout, Disconnect, DisconnectReason, Envelope, Frame, Kind, Message, Op, RejectReason, Request, Seq,
    DEFAULT_ETHERTYPE,
};
use tyched::{Config, ExportConfig, TargetHandle};

const KEY: &str = "correct horse battery staple";

fn config(encrypt: bool) -> Config {
    Config {
        exports: vec![ExportConfig { key: Some(KEY.into()), encrypt, ..ExportConfig::ram("secret", 16 << 20) }],
        network_threads: tyched::config::NetworkThreads::One,
        reclaim_after_ms: 300,
        ..Config::default()
    }
}

/// Replies the target sends to what `frames` puts on path 0 (collected for a while).
fn answers(ini: &mut Initiator, frames: &[Vec<u8>]) -> Vec<Vec<u8>> {
    for f in frames {
        send(&mut ini.ports[0], f);
    }
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_millis(300);
    while std::time::Instant::now() < deadline {
        ini.ports[0].recv(64, &mut |b| got.push(b.to_vec())).expect("recv");
        std::thread::sleep(Duration::from_millis(2));
    }
    got
}

fn kinds(frames: &[Vec<u8>]) -> Vec<(Kind, Option<RejectReason>)> {
    frames
        .iter()
        .filter_map(|b| {
            let f = Frame::new_checked(&b[..], DEFAULT_ETHERTYPE).ok()?;
            let reason = match f.parse() {
                Ok(Message::Reject(r)) => Some(r.reason),
                _ => None,
            };
            matches!(f.kind(), Kind::Accept | Kind::Reject | Kind::Challenge).then_some((f.kind(), reason))
        })
        .collect()
}

/// The CONNECT + PROOF frames an initiator sent.
fn proofs(ini: &Initiator) -> Vec<Vec<u8>> {
    ini.captured
        .iter()
        .filter(|(_, b)| {
            let f = Frame::new_checked(&b[..], DEFAULT_ETHERTYPE).expect("valid");
            f.kind() == Kind::Connect && f.flags() & flags::PROOF != 0
        })
        .map(|(_, b)| b.clone())
        .collect()
}

fn wait_sessions(t: &TargetHandle, n: u64) {
    let deadline = std::time::Instant::now() + LIMIT;
    while t.stats().sessions != n {
        assert!(std::time::Instant::now() < deadline, "sessions never reached {n}: {}", t.stats().sessions);
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_connect_and_proof_replayed_after_reclaim_opens_nothing() {
    let (t, ports) = start(config(false), 1);
    let mut owner = Initiator::new(ports);
    owner.attach("secret", Some(KEY.as_bytes())).expect("the owner attaches");
    owner.write(0, &pattern(0, 4096, 1));
    let captured = proofs(&owner);
    assert!(!captured.is_empty(), "the owner's CONNECT + PROOF was seen");
    // While the owner's session lives, the replay is a retry: the same ACCEPT, nothing new.
    let got = answers(&mut owner, &captured);
    assert!(kinds(&got).iter().all(|k| k.0 == Kind::Accept), "{:?}", kinds(&got));
    assert_eq!(t.stats().sessions, 1, "a replay while live made a session");
    // The owner goes away; its session is reclaimed.
    owner.volume = None;
    wait_sessions(&t, 0);
    let got = answers(&mut owner, &captured);
    assert_eq!(
        kinds(&got),
        vec![(Kind::Reject, Some(RejectReason::AuthFailed)); captured.len()],
        "replay after reclaim"
    );
    assert_eq!(t.stats().sessions, 0, "the replay opened a session");
    t.shutdown();
}

#[test]
fn a_proof_readdressed_to_the_live_session_is_refused() {
    let (t, ports) = start(config(false), 1);
    let mut owner = Initiator::new(ports);
    let c = owner.attach("secret", Some(KEY.as_bytes())).expect("the owner attaches");
    let data = pattern(8192, 8192, 2);
    owner.write(8192, &data);
    let captured = proofs(&owner);
    // The same CONNECT + PROOF, naming the live session and an unused channel index.
    let moved: Vec<Vec<u8>> = captured
        .iter()
        .map(|b| {
            let mut b = b.clone();
            b[14 + layout::common::SESSION.start..14 + layout::common::SESSION.end]
                .copy_from_slice(&c.session.to_be_bytes());
            b[14 + layout::common::CHANNEL.start..14 + layout::common::CHANNEL.end]
                .copy_from_slice(&9u16.to_be_bytes());
            b
        })
        .collect();
    let got = answers(&mut owner, &moved);
    assert_eq!(kinds(&got), vec![(Kind::Reject, Some(RejectReason::AuthFailed)); moved.len()]);
    let s = t.stats();
    assert!(s.channels.iter().all(|ch| ch.channel != 9), "channel 9 was opened: {:?}", s.channels);
    assert_eq!(owner.read(8192, 8192), data, "the owner's session goes on");
    t.shutdown();
}

#[test]
fn forged_altered_and_replayed_frames_change_nothing() {
    for encrypt in [false, true] {
        let (t, ports) = start(config(encrypt), 1);
        let mut owner = Initiator::new(ports);
        let c = owner.attach("secret", Some(KEY.as_bytes())).expect("the owner attaches");
        let data = pattern(0, 16384, 3);
        owner.write(0, &data);
        assert_eq!(owner.read(0, 16384), data);
        let env = Envelope {
            dst: target_mac(0),
            src: init_mac(0),
            ethertype: DEFAULT_ETHERTYPE,
            channel: 0,
            session: c.session,
        };
        let mut attack: Vec<Vec<u8>> = Vec::new();
        // Forged frames: a WRITE over the owner's data, a REQUEST with a huge FLOOR, a
        // DISCONNECT; unsealed and with a trailer taken from a real frame.
        let real = owner
            .captured
            .iter()
            .rev()
            .find(|(_, b)| Frame::new_checked(&b[..], DEFAULT_ETHERTYPE).is_ok_and(|f| f.kind() == Kind::Request))
            .expect("a request on the wire")
            .1
            .clone();
        let real_f = Frame::new_checked(&real[..], DEFAULT_ETHERTYPE).unwrap();
        let real_trailer = real[14 + real_f.length() as usize..14 + real_f.length() as usize + 24].to_vec();
        for (k, msg) in [
            Message::Request(Request {
                seq: Seq { seq: 40, ack: 0 },
                op: Op::WriteZeroes,
                fua: false,
                remq: 3,
                damq: tyche_wire::NO_SLOT,
                home: 0,
                tag: 1 << 40,
                floor: 0,
                offset: 0,
                length: 16384,
            }),
            Message::Request(Request {
                seq: Seq { seq: 41, ack: 0 },
                op: Op::Flush,
                fua: false,
                remq: 4,
                damq: tyche_wire::NO_SLOT,
                home: 0,
                tag: u64::MAX,
                floor: u64::MAX,
                offset: 0,
                length: 0,
            }),
            Message::Disconnect(Disconnect { reason: DisconnectReason::Normal }),
        ]
        .into_iter()
        .enumerate()
        {
            let mut b = vec![0u8; 256];
            let len = msg.emit(&env, &mut b);
            b.truncate(len);
            attack.push(b.clone());
            let end = 14 + Frame::new_checked(&b[..], DEFAULT_ETHERTYPE).unwrap().length() as usize;
            let mut s = b[..end].to_vec();
            s[16] |= (flags::SEALED >> 8) as u8;
            s.extend_from_slice(&real_trailer);
            s[end..end + 8].copy_from_slice(&(u64::MAX - k as u64).to_be_bytes());
            s.resize(s.len().max(60), 0);
            attack.push(s);
        }
        // Every channel frame the owner sent, replayed; and each with a byte changed.
        let channel_frames: Vec<Vec<u8>> = owner
            .captured
            .iter()
            .filter(|(_, b)| {
                Frame::new_checked(&b[..], DEFAULT_ETHERTYPE)
                    .is_ok_and(|f| f.session() == c.session && f.kind() != Kind::Connect)
            })
            .map(|(_, b)| b.clone())
            .collect();
        assert!(channel_frames.len() >= 4, "{} frames of {} captured", channel_frames.len(), owner.captured.len());
        for b in &channel_frames {
            attack.push(b.clone());
            let mut m = b.clone();
            m[40] ^= 0x10;
            attack.push(m);
        }
        let want = if encrypt { "encrypted" } else { "authenticated" };
        assert!(t.stats().channels.iter().all(|c| c.protection == want), "{:?}", t.stats().channels);
        let before = t.stats();
        let executed_before: u64 = before
            .exports
            .iter()
            .map(|e| {
                let r = &e.requests;
                r.read + r.write + r.flush + r.discard + r.write_zeroes
            })
            .sum();
        for f in &attack {
            send(&mut owner.ports[0], f);
        }
        std::thread::sleep(Duration::from_millis(200));
        let after = t.stats();
        let executed_after: u64 = after
            .exports
            .iter()
            .map(|e| {
                let r = &e.requests;
                r.read + r.write + r.flush + r.discard + r.write_zeroes
            })
            .sum();
        assert_eq!(executed_after, executed_before, "an attack frame ran a request (encrypt={encrypt})");
        let drops = |s: &tyched::Snapshot, r: &str| {
            s.nics.iter().map(|n| n.drops.channel.get(r).copied().unwrap_or(0)).sum::<u64>()
        };
        let refused = drops(&after, "unauthenticated") + drops(&after, "replayed")
            - drops(&before, "unauthenticated")
            - drops(&before, "replayed");
        assert_eq!(refused, attack.len() as u64, "every attack frame is refused and counted (encrypt={encrypt})");
        // The owner's data is intact and the session alive (no DISCONNECT, no FLOOR took).
        assert_eq!(owner.read(0, 16384), data, "encrypt={encrypt}");
        owner.write(16384, &data);
        assert_eq!(owner.read(16384, 16384), data);
        assert_eq!(t.stats().sessions, 1);
        t.shutdown();
    }
}

/// Feature DIGEST end to end through tyched, over links whose target ends lend received frames
/// and transmit chunks (AF_XDP's zero-copy paths): reads and writes of every size come back
/// intact. Once read data went out of transmit chunks filled before the frame's CRC32C was
/// computed over the (empty) payload in the send buffer: every read DATA frame failed its
/// digest, the channel died and reconnected until the session's channel limit was reached
/// (found by `cargo xtask bench e2e`'s digest row).
#[test]
fn digest_sessions_move_data_over_lent_frames() {
    for keyed in [false, true] {
        let mut cfg = config(false);
        if !keyed {
            cfg.exports[0].key = None;
        }
        let (t, ports) = start_lending_tx(cfg, 1, 256);
        let mut ini = Initiator::new(ports);
        ini.features = flags::FEATURE_DIGEST;
        let key = keyed.then_some(KEY.as_bytes());
        ini.attach("secret", key).expect("attaches");
        let want = if keyed { "authenticated" } else { "digest" };
        assert!(t.stats().channels.iter().all(|c| c.protection == want), "{:?}", t.stats().channels);
        for (i, len) in [4096usize, 8192, 65536, 1 << 20].into_iter().enumerate() {
            let at = (i as u64) << 21;
            let data = pattern(at, len, 7);
            ini.write(at, &data);
            assert_eq!(ini.read(at, len), data, "{len} bytes at {at}, keyed={keyed}");
        }
        let s = t.stats();
        let bad: u64 = s.nics.iter().map(|n| n.drops.channel.get("bad_digest").copied().unwrap_or(0)).sum();
        assert_eq!(bad, 0, "the target refused digests");
        assert_eq!(s.channels.len(), 1, "channels died and were replaced: {:?}", s.channels);
        t.shutdown();
    }
}
