//! ACCEPT's `CHANNEL_MAC`: a target that steers each channel to a NIC queue of its own names the
//! queue's address, the initiator's channel uses it for its frames in both directions, a group
//! address is refused, and with a key the target's proof covers it.

use std::time::Duration;

use tyche_channel::auth::{self, ProofInput, Psk};
use tyche_channel::{
    Accepted, Acceptor, ConnectError, Connector, ExportSpec, HandshakeFrame, Instant, KeyedConnect, Timers,
};
use tyche_wire::{
    flags, layout, Accept, Challenge, ChannelParams, DurabilityEpoch, Envelope, Frame, MacAddr, Message,
    DEFAULT_ETHERTYPE, SECTOR_SIZE,
};

const KEY: &[u8] = b"sixteen or more bytes of key";

fn params() -> ChannelParams {
    ChannelParams { ring: 256, remq_slots: 32, damq_slots: 32, segment: 1024, max_io: 65536, features: 0 }
}

fn acceptor(keyed: bool) -> Acceptor {
    let fl = if keyed { flags::EXPORT_NEEDS_KEY } else { 0 } | flags::EXPORT_DISCARD;
    let e = ExportSpec {
        name: "e".into(),
        size: 1 << 20,
        block_size: SECTOR_SIZE,
        flags: fl,
        durability_epoch: DurabilityEpoch([5; 16]),
    };
    Acceptor::new(DEFAULT_ETHERTYPE, vec![e], params(), Timers::default())
}

fn init() -> MacAddr {
    MacAddr::local(1)
}
/// The address the initiator connects to (the NIC's own).
fn target() -> MacAddr {
    MacAddr::local(2)
}
/// The address of the target's queue that serves the channel.
fn queue_mac() -> MacAddr {
    MacAddr([0x06, 0x54, 0, 0, 0, 2])
}

fn connector() -> Connector {
    let env = Envelope { dst: target(), src: init(), ethertype: DEFAULT_ETHERTYPE, channel: 0, session: 0 };
    Connector::new(env, "e", params(), 99, Duration::from_millis(10), 5, Instant(1))
}

/// One CONNECT from `c` through `handle_steered` naming `channel_addr`; the ACCEPT (bytes
/// `tamper`ed, an offset in the Tyche message, if asked) back to the connector.
fn steered(
    c: &mut Connector,
    channel_addr: MacAddr,
    tamper: Option<usize>,
) -> (Result<tyche_channel::Connected, ConnectError>, Option<Box<tyche_channel::Channel>>) {
    let now = Instant(1);
    let mut a = acceptor(false);
    let mut buf = [0u8; 512];
    let mut out = [0u8; 512];
    let len = c.poll_transmit(now, &mut buf).expect("a CONNECT");
    let frame = Frame::new_checked(&buf[..len], DEFAULT_ETHERTYPE).unwrap();
    let msg = frame.parse().unwrap();
    let env = Envelope::of(&frame);
    let Some(Accepted::Channel { len, channel, .. }) = a.handle_steered(
        now,
        HandshakeFrame { local: target(), src: init(), env: &env, msg: &msg },
        channel_addr,
        &mut || 42,
        &mut out,
        None,
    ) else {
        panic!("a channel")
    };
    if let Some(at) = tamper {
        out[14 + at] ^= 1;
    }
    let f = Frame::new_checked(&out[..len], DEFAULT_ETHERTYPE).unwrap();
    // The ACCEPT comes from the address the CONNECT went to, whatever it names.
    assert_eq!(f.src(), target());
    let r = c.handle(f.src(), f.session(), &f.parse().unwrap()).expect("an outcome");
    (r, Some(channel))
}

#[test]
fn the_named_address_carries_the_channel_both_ways() {
    let mut c = connector();
    let (r, tch) = steered(&mut c, queue_mac(), None);
    let conn = r.expect("connected");
    assert_eq!(conn.channel_addr, queue_mac());
    // The initiator's channel sends to the queue's address and takes frames only from it.
    let mut ich = c.channel(&conn, Timers::default(), Instant(1));
    assert_eq!(ich.envelope().dst, queue_mac());
    assert_eq!(ich.envelope().src, init());
    // The target's channel sends from it.
    let tch = tch.unwrap();
    assert_eq!(tch.envelope().src, queue_mac());
    assert_eq!(tch.envelope().dst, init());
    // A frame the initiator's channel sends is addressed to the queue.
    ich.close(tyche_wire::DisconnectReason::Normal);
    let mut buf = [0u8; 256];
    let n = ich.poll_transmit(Instant(1), &mut buf).expect("DISCONNECT").len;
    let f = Frame::new_checked(&buf[..n], DEFAULT_ETHERTYPE).unwrap();
    assert_eq!((f.dst(), f.src()), (queue_mac(), init()));
}

#[test]
fn without_steering_the_channel_stays_on_the_connected_address() {
    let mut c = connector();
    let (r, tch) = steered(&mut c, target(), None);
    let conn = r.expect("connected");
    assert_eq!(conn.channel_addr, target());
    assert_eq!(c.channel(&conn, Timers::default(), Instant(1)).envelope().dst, target());
    assert_eq!(tch.unwrap().envelope().src, target());
}

/// An ACCEPT as a target would send it from the connected address, naming `channel_mac`.
fn accept_naming(channel_mac: MacAddr) -> Vec<u8> {
    let a = Accept {
        nonce: 99,
        params: params(),
        export_size: 1 << 20,
        block_size: 512,
        export_flags: 0,
        proof: None,
        durability_epoch: DurabilityEpoch::NONE,
        channel_mac,
    };
    let env = Envelope { dst: init(), src: target(), ethertype: DEFAULT_ETHERTYPE, channel: 0, session: 7 };
    let mut out = vec![0u8; 256];
    let n = Message::Accept(a).emit(&env, &mut out);
    out.truncate(n);
    out
}

fn deliver(c: &mut Connector, bytes: &[u8]) -> Option<Result<tyche_channel::Connected, ConnectError>> {
    let f = Frame::new_checked(bytes, DEFAULT_ETHERTYPE).unwrap();
    c.handle(f.src(), f.session(), &f.parse().unwrap())
}

#[test]
fn a_group_address_is_a_protocol_error_of_the_channel() {
    for bad in [MacAddr::BROADCAST, MacAddr([0x01, 0x00, 0x5e, 0, 0, 1]), MacAddr([0x33, 0x33, 0, 0, 0, 1])] {
        let mut c = connector();
        c.poll_transmit(Instant(1), &mut [0u8; 512]).expect("a CONNECT");
        assert_eq!(deliver(&mut c, &accept_naming(bad)), Some(Err(ConnectError::BadChannelAddress(bad))), "{bad}");
    }
    // All zero and the connected address itself mean "the address connected to".
    for same in [MacAddr::ZERO, target()] {
        let mut c = connector();
        c.poll_transmit(Instant(1), &mut [0u8; 512]).expect("a CONNECT");
        let conn = deliver(&mut c, &accept_naming(same)).expect("outcome").expect("connected");
        assert_eq!(conn.channel_addr, target());
    }
}

#[test]
fn an_accept_from_the_named_address_instead_of_the_connected_one_is_ignored() {
    let mut c = connector();
    c.poll_transmit(Instant(1), &mut [0u8; 512]).expect("a CONNECT");
    let mut b = accept_naming(queue_mac());
    b[6..12].copy_from_slice(&queue_mac().octets());
    assert_eq!(deliver(&mut c, &b), None);
    assert_eq!(deliver(&mut c, &accept_naming(queue_mac())).unwrap().unwrap().channel_addr, queue_mac());
}

/// The keyed round: CHALLENGE, the proof checked, then `handle_steered` with the key.
fn keyed(tamper: Option<usize>) -> Result<MacAddr, ConnectError> {
    let mut c = connector().with_key(KEY);
    let mut a = acceptor(true);
    let now = Instant(1);
    let tn = 0x5151;
    let mut buf = [0u8; 512];
    let mut out = [0u8; 512];
    for _ in 0..3 {
        let len = c.poll_transmit(now, &mut buf).expect("a CONNECT");
        let frame = Frame::new_checked(&buf[..len], DEFAULT_ETHERTYPE).unwrap();
        let Ok(Message::Connect(m)) = frame.parse() else { panic!("CONNECT") };
        let env = Envelope::of(&frame);
        let reply_env = Envelope { dst: init(), src: target(), ..env };
        let reply = match m.proof {
            None => {
                let n = Message::Challenge(Challenge { nonce: m.nonce, target_nonce: tn }).emit(&reply_env, &mut out);
                out[..n].to_vec()
            }
            Some(p) => {
                let input = ProofInput {
                    nonce: m.nonce,
                    target_nonce: tn,
                    session: env.session,
                    channel: env.channel,
                    export: m.export,
                    initiator: init(),
                    target: target(),
                    host: m.host,
                    asked: m.params,
                };
                assert!(auth::verify_initiator(KEY, &input, &p));
                let key = Psk::new(KEY);
                let k = Some(KeyedConnect { key: &key, target_nonce: tn });
                let msg = Message::Connect(m);
                let Some(Accepted::Channel { len, channel, .. }) = a.handle_steered(
                    now,
                    HandshakeFrame { local: target(), src: init(), env: &env, msg: &msg },
                    queue_mac(),
                    &mut || 42,
                    &mut out,
                    k,
                ) else {
                    panic!("a channel")
                };
                assert!(channel.sealed());
                if let Some(at) = tamper {
                    out[14 + at] ^= 0x02;
                }
                out[..len].to_vec()
            }
        };
        if let Some(r) = deliver(&mut c, &reply) {
            return r.map(|conn| conn.channel_addr);
        }
    }
    panic!("no outcome")
}

#[test]
fn the_keyed_proof_covers_the_named_address() {
    assert_eq!(keyed(None), Ok(queue_mac()));
    // Moved to another unicast address on the way: the target's proof no longer verifies.
    let at = layout::accept::CHANNEL_MAC.start + 5;
    assert_eq!(keyed(Some(at)), Err(ConnectError::BadProof));
}

#[test]
fn a_retried_connect_gets_the_same_named_address() {
    let now = Instant(1);
    let mut a = acceptor(false);
    let mut c = connector();
    let mut buf = [0u8; 512];
    let len = c.poll_transmit(now, &mut buf).expect("a CONNECT");
    let frame = Frame::new_checked(&buf[..len], DEFAULT_ETHERTYPE).unwrap();
    let msg = frame.parse().unwrap();
    let env = Envelope::of(&frame);
    let mut first = [0u8; 512];
    let Some(Accepted::Channel { len: n1, .. }) = a.handle_steered(
        now,
        HandshakeFrame { local: target(), src: init(), env: &env, msg: &msg },
        queue_mac(),
        &mut || 42,
        &mut first,
        None,
    ) else {
        panic!("a channel")
    };
    // The ACCEPT was lost; the retry is answered with the same one, whichever queue it reached.
    let mut again = [0u8; 512];
    let other = MacAddr([0x0a, 0x54, 0, 0, 0, 2]);
    let Some(Accepted::Reply(n2)) = a.handle_steered(
        now,
        HandshakeFrame { local: target(), src: init(), env: &env, msg: &msg },
        other,
        &mut || 43,
        &mut again,
        None,
    ) else {
        panic!("the same ACCEPT")
    };
    assert_eq!(first[..n1], again[..n2]);
}
