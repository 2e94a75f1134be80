//! A peer that holds a valid session and breaks the rules, in-process: each frame sequence here
//! once took the whole target down (a panic under the shared engine lock). Each test runs an
//! honest session on another link throughout and checks its data, and that the target still
//! serves afterwards.

mod common;

use std::time::Duration;

use common::*;
use tyche_transport::FrameTransportExt;
use tyche_wire::{Data, DataHeader, Envelope, Frame, Kind, Message, Op, Request, Seq, DEFAULT_ETHERTYPE, NO_SLOT};
use tyched::{Config, ExportConfig, TargetHandle};

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
    let (handle, mut ports) = start_links(2, config());
    let hostile = ports.pop().expect("two ports");
    let honest = ports.pop().expect("two ports");
    (handle, honest, hostile)
}

/// A target on `n` such links, and the initiator ends of them.
fn start_links(n: usize, config: Config) -> (TargetHandle, Vec<Port>) {
    common::start_lending_tx(config, n, 1024)
}

/// The rule-breaking peer: a valid session on its link, then frames written by hand. It never
/// acknowledges anything unless told to.
struct Peer {
    port: Port,
    env: Envelope,
    next: u32,
    buf: Vec<u8>,
    /// The `HOME` its requests name (its own channel unless told otherwise).
    home: u16,
    /// The `FLOOR` its requests carry.
    floor: u64,
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
        Peer { port: ini.ports.pop().expect("its port"), env, next: 0, buf: vec![0; 9014], home: 0, floor: 0 }
    }

    /// A session with a channel on each of two links (target links `links`): channel 0 on the
    /// first, channel 1 on the second.
    fn connect_two(ports: Vec<Port>, links: [usize; 2]) -> [Peer; 2] {
        let mut ini = Initiator::new(ports);
        ini.target_macs = links.iter().map(|&k| target_mac(k)).collect();
        ini.host = Some([0xbc; 16]);
        let c = ini.handshake(0, 0, "ram", None).1.expect("the peer gets a session");
        ini.handshake(1, c.session, "ram", None).1.expect("its second channel joins");
        let mut peers = ini.ports.drain(..).enumerate().map(|(k, port)| {
            let env = Envelope {
                dst: target_mac(links[k]),
                src: init_mac(k),
                ethertype: DEFAULT_ETHERTYPE,
                channel: k as u16,
                session: c.session,
            };
            Peer { port, env, next: 0, buf: vec![0; 9014], home: k as u16, floor: 0 }
        });
        [peers.next().expect("two"), peers.next().expect("two")]
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
        let (home, floor) = (self.home, self.floor);
        self.send(Message::Request(Request { seq, op, fua: false, remq, damq, home, tag, floor, offset, length }));
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

    /// Waits until the completion of `tag` in slot `remq` arrives (the target resends earlier
    /// ones, never acknowledged); its status.
    fn status_of(&mut self, remq: u16, tag: u64) -> tyche_wire::Status {
        let deadline = std::time::Instant::now() + LIMIT;
        loop {
            let mut found = None;
            self.port
                .recv(4096, &mut |bytes| {
                    let Ok(f) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
                    if let Ok(Message::Completion(c)) = f.parse() {
                        if c.tag == tag && c.remq == remq {
                            found = Some(c.status);
                        }
                    }
                })
                .expect("recv");
            if let Some(s) = found {
                return s;
            }
            assert!(std::time::Instant::now() < deadline, "no completion for tag {tag}");
            std::thread::sleep(Duration::from_millis(1));
        }
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

/// A peer with a channel on each of two links, so on two network threads, whose requests name
/// the other thread's channel as their home (as a re-issue after a failover does), copies of
/// one tag on both, a home that never joined, and tags below a floor: every copy is decided by
/// the home's thread, each tag's write runs once, nothing is left waiting, and the honest
/// session is served throughout.
#[test]
fn copies_across_two_threads_naming_the_other_home_run_once() {
    let cfg = Config { network_threads: tyched::config::NetworkThreads::PerNic, ..config() };
    let (target, mut ports) = start_links(3, cfg);
    let peer_ports = ports.split_off(1);
    let mut honest = Honest::attach(ports.pop().expect("link 0"));
    let [mut a, mut b] = Peer::connect_two(peer_ports, [1, 2]);
    let writes_before = target.stats().exports[0].requests.write;
    let at = 48u64 << 20;
    let one = vec![0x61; SEG as usize];
    // Tag 10 first on B (link 2) naming A's channel as its home: A's thread decides, B runs it.
    b.home = 0;
    b.request(Op::Write, 0, 0, 10, at, SEG);
    b.data(0, 0, 1, 10, &one);
    assert_eq!(b.status_of(0, 10), tyche_wire::Status::Ok);
    // Its copy on A (its home): the recorded status, not run again (other data, never written).
    a.request(Op::Write, 0, 0, 10, at, SEG);
    a.data(0, 0, 1, 10, &vec![0x62; SEG as usize]);
    assert_eq!(a.status_of(0, 10), tyche_wire::Status::Ok);
    // Tag 11 first on A, then a copy on B naming A's channel: recorded there too.
    a.request(Op::Write, 1, 1, 11, at + SEG as u64, SEG);
    a.data(1, 0, 1, 11, &one);
    assert_eq!(a.status_of(1, 11), tyche_wire::Status::Ok);
    b.request(Op::Write, 1, 1, 11, at + SEG as u64, SEG);
    b.data(1, 0, 1, 11, &vec![0x63; SEG as usize]);
    assert_eq!(b.status_of(1, 11), tyche_wire::Status::Ok);
    // A home that never joined: INVALID, not run.
    b.home = 7;
    b.request(Op::Write, 2, 2, 12, at, SEG);
    b.data(2, 0, 1, 12, &vec![0x64; SEG as usize]);
    assert_eq!(b.status_of(2, 12), tyche_wire::Status::Invalid);
    // A floor past tag 10 (carried by a read of tag 25): a late copy of tag 10 on B (home A) is
    // refused where it arrives.
    b.home = 0;
    b.floor = 20;
    b.request(Op::Read, 4, 4, 25, at, SEG);
    assert_eq!(b.status_of(4, 25), tyche_wire::Status::Ok);
    b.floor = 0;
    b.request(Op::Write, 3, 3, 10, at, SEG);
    b.data(3, 0, 1, 10, &vec![0x65; SEG as usize]);
    assert_eq!(b.status_of(3, 10), tyche_wire::Status::Aborted);
    honest.check(1);
    let held = honest.0.read(at, 2 * SEG as usize);
    assert!(held == [one.clone(), one].concat(), "not each tag's first copy's data: {:x?}", &held[..8]);
    let s = target.stats();
    assert_eq!(s.exports[0].requests.write - writes_before, 2 + 1, "tags 10 and 11 once each, and check(1)'s write");
    assert!(s.decided_by_home >= 2, "B's copies went to A's thread: {}", s.decided_by_home);
    assert_serving(&target);
    // The peer goes silent on both threads: its session goes once both parts are dead (each
    // thread reports its own part, the control decides), and none of its memory stays.
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        honest.check(1);
        let s = target.stats();
        if s.sessions == 1 {
            assert_eq!(s.sessions_reclaimed, 1, "{s:?}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the two-part session was never reclaimed: {} live", s.sessions);
        std::thread::sleep(Duration::from_millis(200));
    }
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
