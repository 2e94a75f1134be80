//! A peer that holds a valid session and breaks the rules, in-process: each frame sequence here
//! once took the whole target down (a panic under the shared engine lock). Each test runs an
//! honest session on another link throughout and checks its data, and that the target still
//! serves afterwards.

mod common;

use std::time::Duration;

use common::*;
use tyche_transport::{FrameTransport, MemLink};
use tyche_wire::{Data, DataHeader, Envelope, Frame, Kind, Message, Op, Request, Seq, DEFAULT_ETHERTYPE, NO_SLOT};
use tyched::{Config, ExportConfig, Nic, Target, TargetHandle};

/// Segment size on these links (MTU 9000).
const SEG: u32 = 8192;

fn config() -> Config {
    Config {
        // Two initiators (hosts) share the export: the honest one and the peer.
        exports: vec![ExportConfig { shared: true, ..ExportConfig::ram("ram", 64 << 20) }],
        network_threads: tyched::config::NetworkThreads::One,
        reclaim_after_ms: 1000,
        ..Config::default()
    }
}

/// A target on two in-memory links whose target ends lend received frames and transmit chunks
/// (the zero-copy paths AF_XDP takes): link 0 for the honest initiator, link 1 for the peer.
fn start_two() -> (TargetHandle, Port, Port) {
    let mut ports = Vec::new();
    let mut nics = Vec::new();
    for k in 0..2 {
        let (a, mut b) = MemLink::pair((init_mac(k), target_mac(k)), 9000, 9014, 8192);
        b.set_lending(1024);
        b.set_tx_lending(1024);
        ports.push(Box::new(a) as Port);
        nics.push(Nic { name: format!("mem{k}"), transport: Box::new(b) });
    }
    let handle = Target::start(config(), nics).expect("target starts");
    let hostile = ports.pop().expect("two ports");
    let honest = ports.pop().expect("two ports");
    (handle, honest, hostile)
}

/// The rule-breaking peer: a valid session on its link, then frames written by hand. It never
/// acknowledges anything unless told to.
struct Peer {
    port: Port,
    env: Envelope,
    next: u32,
    buf: Vec<u8>,
}

impl Peer {
    fn connect(port: Port) -> Peer {
        let mut ini = Initiator::new(vec![port]);
        ini.target_macs = vec![target_mac(1)];
        ini.host = Some([0xbb; 16]);
        let (_, r) = ini.handshake(0, 0, "ram", None);
        let c = r.expect("the peer gets a session");
        let env = Envelope {
            dst: target_mac(1),
            src: init_mac(0),
            ethertype: DEFAULT_ETHERTYPE,
            channel: 0,
            session: c.session,
        };
        Peer { port: ini.ports.pop().expect("its port"), env, next: 0, buf: vec![0; 9014] }
    }

    fn seq(&mut self) -> Seq {
        self.next += 1;
        Seq { seq: self.next - 1, ack: 0 }
    }

    fn send(&mut self, msg: Message<'_>) {
        let len = msg.emit(&self.env, &mut self.buf);
        let frame = self.buf[..len].to_vec();
        send(&mut self.port, &frame);
    }

    fn request(&mut self, op: Op, remq: u16, damq: u16, tag: u64, offset: u64, length: u32) {
        let seq = self.seq();
        let home = self.env.channel;
        self.send(Message::Request(Request { seq, op, fua: false, remq, damq, home, tag, floor: 0, offset, length }));
    }

    fn data(&mut self, damq: u16, seg_index: u16, seg_count: u16, tag: u64, payload: &[u8]) {
        let seq = self.seq();
        let header = DataHeader { seq, damq, seg_index, seg_count, tag, offset: seg_index as u32 * SEG };
        self.send(Message::Data(Data { header, payload }));
    }

    /// Frames received so far: (kind, tag of a completion or data frame).
    fn drain(&mut self) -> Vec<(Kind, u64)> {
        let mut out = Vec::new();
        self.port
            .recv(4096, &mut |bytes| {
                let Ok(f) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
                let tag = match f.parse() {
                    Ok(Message::Completion(c)) => c.tag,
                    Ok(Message::Data(d)) => d.header.tag,
                    _ => 0,
                };
                out.push((f.kind(), tag));
            })
            .expect("recv");
        out
    }

    /// Waits until a frame of `kind` for `tag` arrives.
    fn wait_for(&mut self, kind: Kind, tag: u64) {
        let deadline = std::time::Instant::now() + LIMIT;
        loop {
            if self.drain().contains(&(kind, tag)) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "no {kind:?} for tag {tag}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The honest session: writes a pattern, and checks it (and a fresh write) after the peer's
/// frames.
struct Honest(Initiator);

impl Honest {
    fn attach(port: Port) -> Honest {
        let mut ini = Initiator::new(vec![port]);
        ini.attach("ram", None).expect("the honest initiator attaches");
        for i in 0..16u64 {
            ini.write(i * 65536, &pattern(i * 65536, 65536, 1));
        }
        Honest(ini)
    }

    fn check(&mut self, round: u8) {
        for i in 0..16u64 {
            assert_eq!(self.0.read(i * 65536, 65536), pattern(i * 65536, 65536, 1), "honest data at {i}");
        }
        let at = (32 + round as u64) << 20;
        self.0.write(at, &pattern(at, 131072, round));
        assert_eq!(self.0.read(at, 131072), pattern(at, 131072, round));
    }
}

fn assert_serving(target: &TargetHandle) {
    assert!(!target.is_finished(), "the target's network thread is gone");
    let s = target.stats();
    assert_eq!(s.limits.sessions_failed, 0, "no session hit a bug");
}

#[test]
fn out_of_range_requests_on_one_slot_never_acknowledged_stay_bounded() {
    // Once: about 1,160 out-of-range DISCARDs on remq slot 0 with nothing acknowledged grew the
    // send queue past its bound (`channel send queue over its bound`).
    let (target, honest, hostile) = start_two();
    let mut honest = Honest::attach(honest);
    let mut peer = Peer::connect(hostile);
    for tag in 0..3000u64 {
        peer.request(Op::Discard, 0, NO_SLOT, tag, 1 << 40, 4096);
        if tag == 1500 {
            honest.check(1);
        }
    }
    honest.check(2);
    assert_serving(&target);
    // Once the ring is full, requests on the slot whose completion waits are dropped (or, if the
    // channel died of no acknowledgement meanwhile, dropped as for a dead channel or a reclaimed
    // session): counted either way, never queued.
    let s = target.stats();
    assert_eq!(s.drops(|d| d.malformed), 0, "the requests are well-formed: {s:#?}");
    let dropped = s.drops(|d| d.channel_total() + d.unknown_session);
    assert!(dropped > 0, "the requests were dropped and counted: {s:#?}");
}

#[test]
fn early_data_of_a_refused_request_is_not_written_with_a_later_one() {
    // Once: segment 3 of 4 kept, the request refused (1 segment), sent again, then segment 0 of
    // 1: the kept segment of the refused request was handed to storage (`kept segments lie in
    // order within the request`).
    let (target, honest, hostile) = start_two();
    let mut honest = Honest::attach(honest);
    let mut peer = Peer::connect(hostile);
    let tag = 7;
    let at = 40u64 << 20;
    peer.data(0, 3, 4, tag, &vec![0xEE; SEG as usize]);
    peer.request(Op::Write, 0, 0, tag, at, SEG);
    peer.wait_for(Kind::Completion, tag); // refused (INVALID)
    peer.request(Op::Write, 1, 0, tag, at, SEG);
    let good = vec![0x5A; SEG as usize];
    peer.data(0, 0, 1, tag, &good);
    peer.wait_for(Kind::Completion, tag);
    honest.check(1);
    // What was written is the last request's data, nothing of the refused one's.
    assert_eq!(honest.0.read(at, SEG as usize), good);
    assert_eq!(honest.0.read(at + 3 * SEG as u64, SEG as usize), vec![0; SEG as usize]);
    assert_serving(&target);
    wait_leases_back_of(&target, 1);
}

#[test]
fn read_data_resent_after_its_slot_is_reused_stays_within_the_new_read() {
    // Once: a 4-segment READ into damq 0 completed, then a 1-segment READ into damq 0 from
    // another remq slot, nothing acknowledged: the first read's DATA was resent against the
    // shorter read's chunks (`index out of bounds: the len is 1 but the index is 1`).
    let (target, honest, hostile) = start_two();
    let mut honest = Honest::attach(honest);
    let mut peer = Peer::connect(hostile);
    peer.request(Op::Read, 0, 0, 100, 0, 4 * SEG);
    peer.wait_for(Kind::Completion, 100);
    peer.request(Op::Read, 1, 0, 101, 0, SEG);
    // Long enough for several retransmission timeouts of the first read's data.
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(25));
        peer.drain();
    }
    honest.check(1);
    assert_serving(&target);
}

#[test]
fn a_hostile_peer_that_goes_silent_is_reclaimed_and_frees_its_memory() {
    let (target, honest, hostile) = start_two();
    let mut honest = Honest::attach(honest);
    let mut peer = Peer::connect(hostile);
    for tag in 0..64u64 {
        peer.request(Op::Read, tag as u16, tag as u16, tag, tag * 65536, 65536);
    }
    peer.wait_for(Kind::Completion, 63);
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        honest.check(1);
        let s = target.stats();
        if s.sessions == 1 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the silent session was never reclaimed: {} live", s.sessions);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(target.stats().limits.slot_memory_bytes, 0, "no slot memory left behind");
    assert_serving(&target);
}

/// Waits until link `k`'s transport has every kept frame back.
fn wait_leases_back_of(target: &TargetHandle, k: usize) {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let s = target.stats();
        if s.nics[k].leases_out == 0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "kept frames never went back: {}", s.nics[k].leases_out);
        std::thread::sleep(Duration::from_millis(20));
    }
}
