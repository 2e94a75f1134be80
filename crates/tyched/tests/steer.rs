//! Queue addresses as a NIC with flow rules would see them, over in-memory links: two links are
//! two queues of one interface (one MAC). Every CONNECT lands on queue 0 (what RSS does with a
//! Tyche frame); the target spreads the channels over the queues, naming each queue's address
//! in ACCEPT; the test's "NIC" then delivers each frame by its destination MAC, as the
//! `ethtool -N IF flow-type ether dst MAC_q action q` rules would, and checks that each
//! channel's frames travel on its queue with its queue's address.

mod common;

use std::time::Duration;

use tyche_channel::{
    Connected, Connector, Inbound, Instant, IoRequest, LeastBytes, Timers, Volume, VolumeConfig, VolumeEvent,
};
use tyche_transport::{FrameTransportExt, MemLink};
use tyche_wire::{Envelope, Frame, Kind, MacAddr, Op, DATA_FRAME_OVERHEAD, DEFAULT_ETHERTYPE};
use tyched::steer::QueueAddresses;
use tyched::{Config, ExportConfig, Nic, Placement, Target};

use common::{send, want, Port, LIMIT};

const INIT: MacAddr = MacAddr([0x02, 0x54, 0, 0, 0x01, 0x01]);
const NIC: MacAddr = MacAddr([0x02, 0x54, 0, 0, 0x02, 0x01]);

fn queue(q: u16) -> MacAddr {
    tyched::steer::derive_queue_mac(NIC, q).unwrap()
}

/// The queue a frame to `dst` is steered to: the rule for a queue address, else RSS (queue 0).
fn steer(dst: MacAddr) -> usize {
    (0..2).find(|&q| queue(q) == dst).map_or(0, |q| q as usize)
}

fn clock() -> Instant {
    use std::sync::OnceLock;
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    Instant(START.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64 + 1)
}

/// One handshake for channel `ch`, its CONNECT sent to the interface's address (so queue 0).
fn handshake(ports: &mut [Port], ch: u16, session: u64) -> (Connector, Connected) {
    let env = Envelope { dst: NIC, src: INIT, ethertype: DEFAULT_ETHERTYPE, channel: ch, session };
    // A fresh nonce per handshake: the same one again is a retransmission of the first.
    static NONCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x5157_0000);
    let nonce = NONCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut c = Connector::new(env, "disk", want(), nonce, Duration::from_millis(100), 20, clock());
    let deadline = std::time::Instant::now() + LIMIT;
    let mut buf = vec![0u8; 9014];
    loop {
        assert!(std::time::Instant::now() < deadline, "handshake of channel {ch} took too long");
        if let Some(len) = c.poll_transmit(clock(), &mut buf) {
            send(&mut ports[steer(NIC)], &buf[..len]);
        }
        let mut out = None;
        for (q, port) in ports.iter_mut().enumerate() {
            port.recv(16, &mut |bytes| {
                let f = Frame::new_checked(bytes, DEFAULT_ETHERTYPE).unwrap();
                if !matches!(f.kind(), Kind::Accept | Kind::Reject | Kind::Challenge) {
                    return; // a frame of a channel already open
                }
                // The ACCEPT comes from the interface's address, on the queue the CONNECT took.
                assert_eq!((q, f.src()), (0, NIC), "ACCEPT on queue {q} from {}", f.src());
                if let Some(r) = c.handle(f.src(), f.session(), &f.parse().unwrap()) {
                    out = Some(r);
                }
            })
            .unwrap();
        }
        c.handle_timeout(clock());
        if let Some(r) = out.or(c.outcome()) {
            return (c, r.expect("connected"));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn channels_are_spread_over_queue_addresses_and_stay_on_their_queue() {
    let mut ports: Vec<Port> = Vec::new();
    let mut nics = Vec::new();
    for q in 0..2 {
        let (a, b) = MemLink::pair((INIT, NIC), 9000, 9014, 8192);
        ports.push(Box::new(a));
        nics.push(Nic { name: format!("mem/{q}"), transport: Box::new(b) });
    }
    let placement = Placement {
        queue_addresses: QueueAddresses {
            of_nic: vec![Some(queue(0)), Some(queue(1))],
            iface_of: vec![0, 0],
            spread: true,
        },
        ..Placement::default()
    };
    let config = Config { exports: vec![ExportConfig::ram("disk", 4 << 20)], workers: 2, ..Config::default() };
    let target = Target::start_placed(config, nics, placement).expect("target starts");

    // Both CONNECTs land on queue 0; the second channel goes to the emptier queue 1.
    let (c0, a0) = handshake(&mut ports, 0, 0);
    assert_eq!(a0.channel_addr, queue(0));
    let (c1, a1) = handshake(&mut ports, 1, a0.session);
    assert_eq!(a1.channel_addr, queue(1));

    let cfg = VolumeConfig {
        export_size: a0.export_size,
        read_only: false,
        no_path_timeout: Duration::from_secs(2),
        io_timeout: None,
        max_requests: 64,
    };
    let mut vol = Volume::new(cfg, a0.session, DEFAULT_ETHERTYPE, Box::<LeastBytes>::default(), clock());
    vol.add_channel(c0.channel(&a0, Timers::default(), clock()), None, clock());
    vol.add_channel(c1.channel(&a1, Timers::default(), clock()), None, clock());

    // Writes and reads spread over both channels; the "NIC" delivers by destination MAC.
    let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
    let mut bufs: std::collections::HashMap<u64, Vec<u8>> = Default::default();
    let mut done = std::collections::HashMap::new();
    let mut seen = [[0u64; 2]; 2]; // [queue][channel]: frames the target sent, by queue received on
    let mut next = 1u64;
    for op in [Op::Write, Op::Read] {
        let mut ids = Vec::new();
        for k in 0..16u64 {
            let id = next;
            next += 1;
            let chunk = data[(k as usize) << 16..((k as usize) + 1) << 16].to_vec();
            bufs.insert(id, if op == Op::Write { chunk } else { vec![0; 1 << 16] });
            vol.submit(clock(), IoRequest { id, op, fua: false, offset: k << 16, length: 1 << 16, node: None })
                .unwrap();
            ids.push(id);
        }
        let deadline = std::time::Instant::now() + LIMIT;
        while !ids.iter().all(|id| done.contains_key(id)) {
            assert!(std::time::Instant::now() < deadline, "requests did not complete");
            let now = clock();
            for (q, port) in ports.iter_mut().enumerate() {
                let mut scratch = Vec::new();
                port.recv(256, &mut |bytes| {
                    let f = Frame::new_checked(bytes, DEFAULT_ETHERTYPE).unwrap();
                    // Each channel's frames come from its queue's address, on its queue.
                    assert_eq!(f.src(), queue(q as u16), "a frame on queue {q} from {}", f.src());
                    seen[q][f.channel() as usize] += 1;
                    if let Inbound::Read { id, offset, payload } = vol.handle_frame(now, bytes, &mut scratch) {
                        bufs.get_mut(&id).unwrap()[offset as usize..offset as usize + payload.len()]
                            .copy_from_slice(payload);
                    }
                })
                .unwrap();
            }
            if vol.poll_timeout().is_some_and(|t| t <= now) {
                vol.handle_timeout(now);
            }
            while let Some(ev) = vol.poll_event() {
                if let VolumeEvent::Completed { id, result } = ev {
                    result.unwrap_or_else(|e| panic!("request {id}: {e:?}"));
                    done.insert(id, ());
                }
            }
            for ch in 0..2u16 {
                let mut frames = Vec::new();
                let mut buf = vec![0u8; 9014];
                while let Some(out) = vol.poll_transmit(now, ch, &mut buf) {
                    if let Some((id, off, len)) = out.payload {
                        buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len as usize]
                            .copy_from_slice(&bufs[&id][off as usize..off as usize + len as usize]);
                    }
                    let len = vol.seal(ch, &mut buf, out.len);
                    frames.push(buf[..len].to_vec());
                }
                for f in frames {
                    let dst = Frame::new_checked(&f[..], DEFAULT_ETHERTYPE).unwrap().dst();
                    assert_eq!(dst, queue(ch), "channel {ch} addressed to {dst}");
                    send(&mut ports[steer(dst)], &f);
                }
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    for (k, id) in (17..33u64).enumerate() {
        assert_eq!(bufs[&id], data[k << 16..(k + 1) << 16], "read {k} differs");
    }
    assert_eq!((seen[0][1], seen[1][0]), (0, 0), "a channel's frames on another queue: {seen:?}");
    assert!(seen[0][0] > 0 && seen[1][1] > 0, "both channels carried frames: {seen:?}");
    // The target serves channel q on transport q.
    let s = target.stats();
    let on: Vec<(u16, String, String)> =
        s.channels.iter().map(|c| (c.channel, c.nic.clone(), c.addr.clone())).collect();
    assert!(on.contains(&(0, "mem/0".into(), queue(0).to_string())), "{on:?}");
    assert!(on.contains(&(1, "mem/1".into(), queue(1).to_string())), "{on:?}");
    assert!(s.nics.iter().all(|n| n.frames_rx > 0), "{:?}", s.nics.iter().map(|n| n.frames_rx).collect::<Vec<_>>());
    // Channel index 1 joins again (a reconnect from the same initiator): with one channel on
    // each queue it goes to queue 0, the CONNECT's own, so the index moves from the network
    // thread of queue 1 to that of queue 0. The old channel leaves its part on queue 1's thread
    // (aborted there, its slots gone), and the target shows the index once, live, on queue 0.
    let (_c1, a1) = handshake(&mut ports, 1, a0.session);
    assert_eq!((a1.session, a1.channel_addr), (a0.session, queue(0)));
    let q = 0;
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let s = target.stats();
        let ones: Vec<(String, String, bool)> =
            s.channels.iter().filter(|c| c.channel == 1).map(|c| (c.nic.clone(), c.addr.clone(), c.dead)).collect();
        if ones == [(format!("mem/{q}"), queue(q as u16).to_string(), false)] {
            assert_eq!(s.sessions, 1);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "channel 1 after its move: {ones:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    target.shutdown();
}
