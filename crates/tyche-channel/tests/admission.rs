//! The target's admission ([`Admission`]): the checks in front of the acceptor and the sessions
//! they made, as tyched's control and the simulator run them. Each case drives real
//! connectors' CONNECTs through `admit`, `accept` and `join`, and the answers back.

use std::time::Duration;

use tyche_channel::{
    Accepted, Acceptor, Admission, Challenges, ConnectError, Connected, Connector, ExportAccess, ExportSpec, Grant,
    HandshakeFrame, Instant, Joined, Refused, Timers, Verdict,
};
use tyche_wire::{
    flags, ChannelParams, DurabilityEpoch, Envelope, Frame, MacAddr, RejectReason, DEFAULT_ETHERTYPE, SECTOR_SIZE,
};

const KEY: &[u8] = b"sixteen or more bytes of key";

fn params() -> ChannelParams {
    ChannelParams { ring: 256, remq_slots: 32, damq_slots: 32, segment: 1024, max_io: 65536, features: 0 }
}

/// The target's NIC.
fn target() -> MacAddr {
    MacAddr::local(0x200)
}

/// An admission for one export, `e`, keyed or not.
fn admission(keyed: bool) -> Admission<(), bool> {
    let fl = if keyed { flags::EXPORT_NEEDS_KEY } else { 0 } | flags::EXPORT_DISCARD;
    let e = ExportSpec {
        name: "e".into(),
        size: 1 << 20,
        block_size: SECTOR_SIZE,
        flags: fl,
        durability_epoch: DurabilityEpoch([5; 16]),
    };
    Admission::new(Acceptor::new(DEFAULT_ETHERTYPE, vec![e], params(), Timers::default()), Challenges::new(16, 4))
}

/// Who may use the export.
struct Rules {
    allow: Vec<MacAddr>,
    key: Option<tyche_channel::auth::Psk>,
    shared: bool,
}

impl Rules {
    fn open() -> Rules {
        Rules { allow: Vec::new(), key: None, shared: false }
    }
    fn access(&self) -> ExportAccess<'_> {
        ExportAccess { index: 0, allow: &self.allow, key: self.key.as_ref(), shared: self.shared }
    }
}

/// A connector from `mac` (host id `host`) for channel `channel` of session `session`.
fn connector(mac: MacAddr, host: Option<u8>, session: u64, channel: u16, nonce: u64) -> Connector {
    let env = Envelope { dst: target(), src: mac, ethertype: DEFAULT_ETHERTYPE, channel, session };
    let mut c = Connector::new(env, "e", params(), nonce, Duration::from_millis(10), 5, Instant(1));
    if let Some(h) = host {
        c = c.with_host([h; 16]);
    }
    c
}

/// What one CONNECT (and a CHALLENGE round, for a keyed export) came to.
#[derive(Debug)]
struct Outcome {
    /// The connector's result.
    result: Option<Result<Connected, ConnectError>>,
    /// The refusal the admission reported.
    refused: Option<Refused>,
    /// What the join did, when a channel was granted.
    joined: Option<Joined<bool>>,
}

/// Runs `c`'s handshake against `a` until it has an outcome (at most a few rounds).
fn handshake(a: &mut Admission<(), bool>, rules: &Rules, c: &mut Connector) -> Outcome {
    let now = Instant(1_000);
    let mut ids = 0x5e55_0000u64;
    let mut out = Outcome { result: None, refused: None, joined: None };
    for _ in 0..4 {
        let mut frame = [0u8; 512];
        let Some(len) = c.poll_transmit(now, &mut frame) else { break };
        let f = Frame::new_checked(&frame[..len], DEFAULT_ETHERTYPE).expect("a frame");
        let msg = f.parse().expect("a CONNECT");
        let env = Envelope::of(&f);
        let hf = HandshakeFrame { local: target(), src: f.src(), env: &env, msg: &msg };
        let mut buf = [0u8; 512];
        let mut random = || {
            ids += 1;
            ids
        };
        let reply = match a.admit(now, hf, Some(rules.access()), &mut random, |live: &bool| *live, &mut buf) {
            Verdict::Admit(admitted) => match a.accept(now, hf, &admitted, target(), &mut random, &mut buf) {
                Some(Accepted::Reply(len)) => len,
                Some(Accepted::Channel { session, export, channel, len }) => {
                    let grant = Grant { session, export, channel: channel.envelope().channel, peer: f.src() };
                    out.joined = Some(a.join(grant, admitted, || (), true));
                    len
                }
                None => break,
            },
            Verdict::Answer { len, refused } => {
                out.refused = refused;
                len
            }
            Verdict::Quiet => break,
        };
        let r = Frame::new_checked(&buf[..reply], DEFAULT_ETHERTYPE).expect("a reply");
        out.result = c.handle(r.src(), r.session(), &r.parse().expect("a reply message"));
        if out.result.is_some() {
            break;
        }
    }
    out
}

fn session_of(o: &Outcome) -> u64 {
    match &o.result {
        Some(Ok(c)) => c.session,
        other => panic!("not connected: {other:?}"),
    }
}

#[test]
fn a_mac_off_the_allow_list_is_refused_and_nothing_is_made() {
    let mut a = admission(false);
    let rules = Rules { allow: vec![MacAddr::local(1)], ..Rules::open() };
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(2), None, 0, 0, 7));
    assert_eq!(o.refused, Some(Refused::MacNotAllowed));
    assert_eq!(o.result, Some(Err(ConnectError::Rejected(RejectReason::NotAllowed))));
    assert!(a.sessions().is_empty() && a.acceptor.session_count() == 0);
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(1), None, 0, 0, 8));
    assert!(o.joined.is_some_and(|j| j.created));
}

#[test]
fn an_export_held_by_one_initiator_is_refused_to_another_and_fenced_by_the_same() {
    let mut a = admission(false);
    let rules = Rules::open();
    let first = handshake(&mut a, &rules, &mut connector(MacAddr::local(1), Some(1), 0, 0, 1));
    let old = session_of(&first);
    // Another host: IN_USE, naming the MAC that holds it.
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(3), Some(2), 0, 0, 2));
    assert_eq!(o.refused, Some(Refused::InUse(MacAddr::local(1))));
    assert_eq!(o.result, Some(Err(ConnectError::InUse(MacAddr::local(1)))));
    // The same host again, from its other NIC (a restart that lost its session): a new session
    // that fences the old one.
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(2), Some(1), 0, 0, 3));
    let new = session_of(&o);
    let joined = o.joined.expect("joined");
    assert!(joined.created && joined.fenced == vec![old], "{joined:?}");
    assert!(a.session(old).expect("kept until reclaimed").is_fenced());
    assert!(!a.session(new).expect("made").is_fenced());
    // A fenced session no longer holds the export: the other host is refused by the new one.
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(3), Some(2), 0, 0, 4));
    assert_eq!(o.refused, Some(Refused::InUse(MacAddr::local(2))));
    // Shared, the other host gets a session of its own and fences nothing.
    let shared = Rules { shared: true, ..Rules::open() };
    let o = handshake(&mut a, &shared, &mut connector(MacAddr::local(3), Some(2), 0, 0, 5));
    assert!(o.joined.is_some_and(|j| j.created && j.fenced.is_empty()));
    // Forgotten, a session is gone from the acceptor too.
    assert!(a.forget(old).is_some());
    assert!(a.session(old).is_none() && a.acceptor.session_count() == 2);
}

#[test]
fn a_session_takes_channels_only_from_its_host_and_a_live_channel_only_from_its_mac() {
    let mut a = admission(false);
    let rules = Rules::open();
    let sid = session_of(&handshake(&mut a, &rules, &mut connector(MacAddr::local(1), Some(1), 0, 0, 1)));
    // Another host naming the session (read off the wire): refused.
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(9), Some(2), sid, 1, 2));
    assert_eq!(o.refused, Some(Refused::NotJoinable));
    // The same host on a second NIC joins a new index.
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(2), Some(1), sid, 1, 3));
    assert!(o.joined.is_some_and(|j| !j.created && j.replaced.is_none()));
    // Index 0 is live from MAC 1: a takeover from MAC 2 is refused, a reconnect from MAC 1
    // replaces it.
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(2), Some(1), sid, 0, 4));
    assert_eq!(o.refused, Some(Refused::NotJoinable));
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(1), Some(1), sid, 0, 5));
    assert!(o.joined.is_some_and(|j| j.replaced == Some(true)));
    // Once it died, another NIC of the host may take the index over (a failover).
    a.session_mut(sid).expect("session").channels.get_mut(&0).expect("channel 0").data = false;
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(2), Some(1), sid, 0, 6));
    assert!(o.joined.is_some_and(|j| j.replaced == Some(false)));
    assert_eq!(a.session(sid).expect("session").channels[&0].peer, MacAddr::local(2));
}

#[test]
fn a_keyed_export_admits_only_a_proof_of_its_key() {
    let mut a = admission(true);
    let rules = Rules { key: Some(tyche_channel::auth::Psk::new(KEY)), ..Rules::open() };
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(1), None, 0, 0, 1).with_key(b"not the key at all"));
    assert_eq!(o.refused, Some(Refused::KeyFailed));
    assert!(a.sessions().is_empty());
    let o = handshake(&mut a, &rules, &mut connector(MacAddr::local(1), None, 0, 0, 2).with_key(KEY));
    assert!(o.joined.is_some_and(|j| j.created), "{:?}", o.result);
    assert!(o.result.is_some_and(|r| r.is_ok()));
}
