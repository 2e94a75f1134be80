//! The CHALLENGE round with a pre-shared key: `Connector::with_key` against `Acceptor::handle_keyed`.

use std::time::Duration;

use tyche_channel::auth::{self, ProofInput, Psk};
use tyche_channel::{
    Accepted, Acceptor, ConnectError, Connector, ExportSpec, HandshakeFrame, Instant, KeyedConnect, Timers,
};
use tyche_wire::{
    flags, Challenge, ChannelParams, Envelope, Frame, MacAddr, Message, RejectReason, DEFAULT_ETHERTYPE, SECTOR_SIZE,
};

const KEY: &[u8] = b"sixteen or more bytes of key";

fn params() -> ChannelParams {
    ChannelParams { ring: 256, remq_slots: 32, damq_slots: 32, segment: 1024, max_io: 65536, features: 0 }
}

fn acceptor() -> Acceptor {
    let e = ExportSpec {
        name: "k".into(),
        size: 1 << 20,
        block_size: SECTOR_SIZE,
        flags: flags::EXPORT_NEEDS_KEY | flags::EXPORT_DISCARD,
        durability_epoch: tyche_wire::DurabilityEpoch([5; 16]),
    };
    Acceptor::new(DEFAULT_ETHERTYPE, vec![e], params(), Timers::default())
}

fn init() -> MacAddr {
    MacAddr::local(1)
}
fn target() -> MacAddr {
    MacAddr::local(2)
}

/// Runs the exchange the way the target daemon does: CHALLENGE for a CONNECT without proof,
/// verify the proof, then `handle_keyed` with the target's proof. `target_key` is the key the
/// target checks with (it may differ from the initiator's).
/// `tamper`: a byte of the ACCEPT (offset in the Tyche message) flipped on the way.
fn run(c: Connector, target_key: &[u8], tamper: Option<usize>) -> Result<u64, ConnectError> {
    run_forgetting(c, target_key, tamper, 0).0
}

/// [`run`] on a target that forgets the challenges of its first `forgets` proofs (it restarted
/// between its CHALLENGE and the proof): those get AUTH_FAILED. Also returns the nonces of the
/// proofs sent.
fn run_forgetting(
    mut c: Connector,
    target_key: &[u8],
    tamper: Option<usize>,
    mut forgets: usize,
) -> (Result<u64, ConnectError>, Vec<u64>) {
    let mut a = acceptor();
    let mut proofs = Vec::new();
    let now = Instant(1);
    let target_nonce = 0x7777;
    let mut buf = [0u8; 512];
    let mut out = [0u8; 512];
    for _ in 0..8 {
        let Some(len) = c.poll_transmit(now, &mut buf) else { break };
        let frame = Frame::new_checked(&buf[..len], DEFAULT_ETHERTYPE).expect("valid CONNECT");
        let Ok(Message::Connect(m)) = frame.parse() else { panic!("expected CONNECT") };
        let env = Envelope::of(&frame);
        let reply_env = Envelope { dst: init(), src: target(), ..env };
        let reply = match m.proof {
            None => {
                let n = Message::Challenge(Challenge { nonce: m.nonce, target_nonce }).emit(&reply_env, &mut out);
                out[..n].to_vec()
            }
            Some(_) if forgets > 0 => {
                forgets -= 1;
                proofs.push(m.nonce);
                let r = tyche_wire::Reject { nonce: m.nonce, reason: RejectReason::AuthFailed, holder: None };
                let n = Message::Reject(r).emit(&reply_env, &mut out);
                out[..n].to_vec()
            }
            Some(p) => {
                proofs.push(m.nonce);
                let input = ProofInput {
                    nonce: m.nonce,
                    target_nonce,
                    session: env.session,
                    channel: env.channel,
                    export: m.export,
                    initiator: init(),
                    target: target(),
                    host: m.host,
                    asked: m.params,
                };
                if !auth::verify_initiator(target_key, &input, &p) {
                    let r = tyche_wire::Reject { nonce: m.nonce, reason: RejectReason::AuthFailed, holder: None };
                    let n = Message::Reject(r).emit(&reply_env, &mut out);
                    out[..n].to_vec()
                } else {
                    let msg = Message::Connect(m);
                    let key = Psk::new(target_key);
                    let keyed = Some(KeyedConnect { key: &key, target_nonce });
                    match a.handle_keyed(
                        now,
                        HandshakeFrame { local: target(), src: init(), env: &env, msg: &msg },
                        &mut || 42,
                        &mut out,
                        keyed,
                    ) {
                        Some(Accepted::Channel { len, .. }) => {
                            if let Some(at) = tamper {
                                out[14 + at] ^= 1;
                            }
                            out[..len].to_vec()
                        }
                        other => panic!("expected a channel, got {other:?}"),
                    }
                }
            }
        };
        let f = Frame::new_checked(&reply[..], DEFAULT_ETHERTYPE).expect("valid reply");
        if let Some(r) = c.handle(f.src(), f.session(), &f.parse().expect("parses")) {
            return (r.map(|x| x.session), proofs);
        }
    }
    panic!("no outcome")
}

fn connector() -> Connector {
    let env = Envelope { dst: target(), src: init(), ethertype: DEFAULT_ETHERTYPE, channel: 0, session: 0 };
    Connector::new(env, "k", params(), 99, Duration::from_millis(10), 5, Instant(1))
}

#[test]
fn right_key_attaches_and_the_target_proves_it_too() {
    assert_eq!(run(connector().with_key(KEY), KEY, None), Ok(42));
}

#[test]
fn wrong_key_is_refused() {
    assert_eq!(
        run(connector().with_key(b"a different key of length"), KEY, None),
        Err(ConnectError::Rejected(RejectReason::AuthFailed))
    );
}

#[test]
fn a_wrong_key_fails_a_fresh_round_too_and_that_is_final() {
    let (r, proofs) = run_forgetting(connector().with_key(b"a different key of length"), KEY, None, 0);
    assert_eq!(r, Err(ConnectError::Rejected(RejectReason::AuthFailed)));
    assert_eq!(proofs.len() as u32, 1 + tyche_channel::FRESH_KEY_ROUNDS, "{proofs:?}");
}

#[test]
fn a_target_that_lost_the_challenge_gets_a_fresh_round_under_a_new_nonce() {
    // A target restarted between its CHALLENGE and the proof: the right key still attaches.
    let (r, proofs) = run_forgetting(connector().with_key(KEY), KEY, None, 1);
    assert_eq!(r, Ok(42));
    assert_eq!(proofs, [99, 100], "the fresh round asks under the next nonce");
    // Forgotten twice: the limit is reached, and the refusal stands.
    let (r, _) = run_forgetting(connector().with_key(KEY), KEY, None, 2);
    assert_eq!(r, Err(ConnectError::Rejected(RejectReason::AuthFailed)));
}

#[test]
fn no_key_cannot_answer_the_challenge() {
    assert_eq!(run(connector(), KEY, None), Err(ConnectError::ChallengeUnsupported));
}

#[test]
fn a_forged_target_proof_is_caught() {
    let proof = Some(tyche_wire::layout::accept::PROOF.start);
    assert_eq!(run(connector().with_key(KEY), KEY, proof), Err(ConnectError::BadProof));
}

#[test]
fn an_altered_durability_epoch_is_caught() {
    // The target's proof covers the epoch: nobody on the way can make the initiator believe
    // writes survived a target crash that changed it.
    let epoch = Some(tyche_wire::layout::accept::DURABILITY_EPOCH.start + 5);
    assert_eq!(run(connector().with_key(KEY), KEY, epoch), Err(ConnectError::BadProof));
}

#[test]
fn plain_handle_still_refuses_a_keyed_export() {
    let mut a = acceptor();
    let env = Envelope { dst: target(), src: init(), ethertype: DEFAULT_ETHERTYPE, channel: 0, session: 0 };
    let m = Message::Connect(tyche_wire::Connect { nonce: 1, params: params(), proof: None, export: "k", host: None });
    let mut out = [0u8; 512];
    let Some(Accepted::Reply(n)) =
        a.handle(Instant(1), HandshakeFrame { local: target(), src: init(), env: &env, msg: &m }, &mut || 5, &mut out)
    else {
        panic!("expected a reply")
    };
    let f = Frame::new_checked(&out[..n], DEFAULT_ETHERTYPE).expect("valid");
    assert!(matches!(f.parse(), Ok(Message::Reject(r)) if r.reason == RejectReason::AuthRequired));
}
