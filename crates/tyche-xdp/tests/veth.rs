//! Privileged tests: AF_XDP on a veth pair between two throw-away network namespaces.
//!
//! Each test creates its own uniquely named namespaces; a guard deletes them on drop, panics
//! included. Threads enter a namespace with `setns(2)`, so every socket they open (netlink for
//! the XDP attach, AF_XDP, ioctl) lives there. Only when not root or when the kernel has no
//! AF_XDP they cannot run: they say why and skip, or fail under `cargo xtask test`
//! (`tyche_testkit::cannot_run`).

use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tyche_transport::FrameTransport;
use tyche_transport::FrameTransportExt;
use tyche_wire::{DataHeader, Envelope, Frame, MacAddr, Message, Seq, DATA_FRAME_OVERHEAD, DEFAULT_ETHERTYPE};
use tyche_xdp::{AsyncTransport, BusyPoll, Error, PortConfig, SteerStats, XdpPort};

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

/// Two namespaces joined by veth `tya` / `tyb`; deleted on drop.
struct Lab {
    a: String,
    b: String,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Why this machine cannot run the test, if it cannot.
fn unsupported() -> Option<&'static str> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root");
    }
    // SAFETY: plain socket(2); closed right away.
    let fd = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Some("kernel has no AF_XDP");
    }
    // SAFETY: `fd` was just opened.
    unsafe { libc::close(fd) };
    None
}

fn lab(tag: &str, mtu: u32) -> Option<Lab> {
    lab_with_queues(tag, mtu, 1)
}

/// As [`lab`], with `queues` receive and transmit queues on each veth.
fn lab_with_queues(tag: &str, mtu: u32, queues: u32) -> Option<Lab> {
    if let Some(why) = unsupported() {
        tyche_testkit::cannot_run(&format!("AF_XDP veth test {tag}"), why);
        return None;
    }
    let id = std::process::id();
    let lab = Lab { a: format!("txt-{tag}-a-{id}"), b: format!("txt-{tag}-b-{id}") };
    ip(&["netns", "add", &lab.a]);
    ip(&["netns", "add", &lab.b]);
    let q = queues.to_string();
    #[rustfmt::skip]
    ip(&[
        "link", "add", "tya", "netns", &lab.a, "numtxqueues", &q, "numrxqueues", &q, "type", "veth",
        "peer", "name", "tyb", "netns", &lab.b, "numtxqueues", &q, "numrxqueues", &q,
    ]);
    let mtu = mtu.to_string();
    for (ns, dev, addr, mac) in
        [(&lab.a, "tya", "10.99.200.1/24", "02:54:00:00:75:01"), (&lab.b, "tyb", "10.99.200.2/24", "02:54:00:00:75:02")]
    {
        ip(&["-n", ns, "link", "set", dev, "address", mac, "mtu", &mtu]);
        ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
        ip(&["-n", ns, "link", "set", dev, "up"]);
        ip(&["-n", ns, "link", "set", "lo", "up"]);
    }
    Some(lab)
}

const MAC_A: MacAddr = MacAddr([0x02, 0x54, 0, 0, 0x75, 0x01]);
const MAC_B: MacAddr = MacAddr([0x02, 0x54, 0, 0, 0x75, 0x02]);

/// Runs `f` on a thread inside namespace `ns`.
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> std::thread::JoinHandle<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("open netns");
        // SAFETY: `file` is an open network namespace descriptor; setns only affects this thread.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
}

fn env(src: MacAddr, dst: MacAddr) -> Envelope {
    Envelope { dst, src, ethertype: DEFAULT_ETHERTYPE, channel: 0, session: 7 }
}

/// Writes DATA frame `seq` with a payload of `segment` bytes marked with `seq`.
fn data_frame(env: &Envelope, seq: u32, segment: usize, buf: &mut [u8]) -> usize {
    let payload = &mut buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + segment];
    payload.fill(seq as u8);
    payload[..4].copy_from_slice(&seq.to_be_bytes());
    DataHeader { seq: Seq { seq, ack: 0 }, damq: 0, seg_index: 0, seg_count: 1, tag: u64::from(seq), offset: 0 }
        .emit_in_place(env, segment, buf)
}

/// Checks a received DATA frame and returns its sequence number.
fn check_data(buf: &[u8], segment: usize) -> u32 {
    let frame = Frame::new_checked(buf, DEFAULT_ETHERTYPE).expect("a valid Tyche frame");
    let Ok(Message::Data(d)) = frame.parse() else {
        panic!("expected DATA");
    };
    let seq = d.header.seq.seq;
    assert_eq!(d.payload.len(), segment, "payload length");
    assert_eq!(d.payload[..4], seq.to_be_bytes(), "payload head");
    assert!(d.payload[4..].iter().all(|&b| b == seq as u8), "payload body of frame {seq}");
    seq
}

/// Sends `n` DATA frames (plus, first, one foreign-EtherType and one bad-version frame) and
/// receives `n` from the peer, in order. Returns the steering counters.
fn exchange(
    ifname: &str,
    me: MacAddr,
    peer: MacAddr,
    n: u32,
    busy_poll: bool,
    mtu_ok: &Barrier,
    done: &Barrier,
) -> SteerStats {
    let config =
        PortConfig { busy_poll: busy_poll.then_some(BusyPoll { usecs: 20, budget: 64 }), ..PortConfig::default() };
    let mut port = XdpPort::open(ifname, &config).expect("open AF_XDP port");
    // veth has no AF_XDP zero-copy support: the kernel binds in copy mode, and says so.
    assert!(!port.zero_copy(), "veth bound in zero-copy mode");
    let segment = port.plan().segment_size as usize;
    let env = env(me, peer);
    mtu_ok.wait();
    // Frames the program must pass to the kernel, not steer.
    let mut k = 0;
    let sent = port
        .send(2, &mut |buf| {
            let len = data_frame(&env, 0, segment, buf);
            k += 1;
            if k == 1 {
                buf[12..14].copy_from_slice(&0x88B6u16.to_be_bytes()); // another EtherType
            } else {
                buf[14] = 99; // another protocol version
            }
            Some(len)
        })
        .expect("send foreign frames");
    assert_eq!(sent, 2);
    let (mut next_tx, mut next_rx) = (0u32, 0u32);
    let deadline = Instant::now() + Duration::from_secs(20);
    while next_rx < n || next_tx < n {
        assert!(Instant::now() < deadline, "{ifname}: stalled: sent {next_tx}, got {next_rx}");
        if next_tx < n {
            port.send(32, &mut |buf| {
                if next_tx == n {
                    return None;
                }
                next_tx += 1;
                Some(data_frame(&env, next_tx - 1, segment, buf))
            })
            .expect("send");
        }
        port.flush().expect("flush");
        port.recv(64, &mut |buf| {
            assert_eq!(check_data(buf, segment), next_rx, "in order, nothing foreign");
            next_rx += 1;
        })
        .expect("recv");
        std::thread::sleep(Duration::from_micros(200));
    }
    // Hold the port (and the program) while the main thread pings across the link.
    done.wait();
    done.wait();
    port.program().stats().expect("steering counters")
}

#[test]
fn tyche_frames_cross_af_xdp_while_ip_passes() {
    // Side a also turns on kernel busy polling of its socket.
    let Some(lab) = lab("x", 3000) else { return };
    let start = Arc::new(Barrier::new(2));
    let done = Arc::new(Barrier::new(3));
    let n = 1500;
    let (s1, d1) = (start.clone(), done.clone());
    let a = in_ns(&lab.a, move || exchange("tya", MAC_A, MAC_B, n, true, &s1, &d1));
    let (s2, d2) = (start.clone(), done.clone());
    let b = in_ns(&lab.b, move || exchange("tyb", MAC_B, MAC_A, n, false, &s2, &d2));
    done.wait();
    // IP on the same link while both programs and sockets are in place.
    let ping = Command::new("ip")
        .args(["netns", "exec", &lab.b, "ping", "-q", "-c", "3", "-i", "0.2", "-W", "2"])
        .arg("10.99.200.1")
        .output()
        .expect("run ping");
    done.wait();
    let sa = a.join().expect("side a");
    let sb = b.join().expect("side b");
    assert!(ping.status.success(), "ping across the steered veth failed");
    for s in [sa, sb] {
        assert!(s.steered >= u64::from(n), "steered {s:?}");
        assert!(s.malformed >= 1, "a bad-version Tyche frame is counted: {s:?}");
        assert!(s.passed >= 3, "IP, ARP and the foreign EtherType go to the kernel: {s:?}");
    }
}

#[test]
fn jumbo_frames_use_multi_buffer_or_fail_clearly() {
    let Some(lab) = lab("j", 9000) else { return };
    // Without multi-buffer, a 9000 MTU is a setup error, not silent drops.
    let err = in_ns(&lab.a, || {
        let cfg = PortConfig { multi_buffer: false, ..PortConfig::default() };
        XdpPort::open("tya", &cfg).map(|_| ()).expect_err("MTU 9000 must not fit one chunk")
    })
    .join()
    .expect("thread");
    assert!(matches!(err, Error::FrameSize { mtu: 9000, .. }), "unexpected error: {err}");
    // With multi-buffer (XDP_USE_SG + xdp.frags), 8 KiB segments cross intact.
    let start = Arc::new(Barrier::new(2));
    let done = Arc::new(Barrier::new(3));
    let (s1, d1) = (start.clone(), done.clone());
    let a = in_ns(&lab.a, move || exchange("tya", MAC_A, MAC_B, 300, false, &s1, &d1));
    let (s2, d2) = (start.clone(), done.clone());
    let b = in_ns(&lab.b, move || exchange("tyb", MAC_B, MAC_A, 300, false, &s2, &d2));
    done.wait();
    done.wait();
    a.join().expect("side a");
    b.join().expect("side b");
}

#[test]
fn async_port_sleeps_until_a_frame_arrives() {
    let Some(lab) = lab("a", 3000) else { return };
    let ready = Arc::new(Barrier::new(2));
    let r1 = ready.clone();
    let receiver = in_ns(&lab.a, move || {
        let port = XdpPort::open("tya", &PortConfig::default()).expect("open port");
        let segment = port.plan().segment_size as usize;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            let mut port = AsyncTransport::new(port, 8).expect("register with tokio");
            r1.wait();
            let t0 = Instant::now();
            let mut seqs = Vec::new();
            let n = tokio::time::timeout(
                Duration::from_secs(10),
                port.recv(16, &mut |buf| seqs.push(check_data(buf, segment))),
            )
            .await
            .expect("a frame within 10 s")
            .expect("recv");
            (n, seqs, t0.elapsed())
        })
    });
    let r2 = ready.clone();
    let sender = in_ns(&lab.b, move || {
        let mut port = XdpPort::open("tyb", &PortConfig::default()).expect("open port");
        let segment = port.plan().segment_size as usize;
        let env = env(MAC_B, MAC_A);
        r2.wait();
        std::thread::sleep(Duration::from_millis(300));
        let n = port.send(1, &mut |buf| Some(data_frame(&env, 42, segment, buf))).expect("send");
        port.flush().expect("flush");
        std::thread::sleep(Duration::from_millis(200));
        n
    });
    assert_eq!(sender.join().expect("sender"), 1);
    let (n, seqs, waited) = receiver.join().expect("receiver");
    assert_eq!((n, seqs), (1, vec![42]));
    assert!(waited >= Duration::from_millis(250), "the receiver slept until the frame came ({waited:?})");
}

#[test]
fn umem_and_rings_are_on_the_asked_node_page_by_page() {
    let Some(lab) = lab("n", 3000) else { return };
    let (areas, node) = in_ns(&lab.a, || {
        let cfg = PortConfig { numa: tyche_xdp::NumaPlacement::Node(0), frame_count: 256, ..PortConfig::default() };
        let port = XdpPort::open("tya", &cfg).expect("open port");
        let areas = port.memory_areas();
        let counts: Vec<_> = areas
            .iter()
            .map(|a| (a.what, tyche_numa::report::count_area(a.addr, a.len, Some(0)).expect("move_pages")))
            .collect();
        (counts, FrameTransport::capabilities(&port).numa_node)
    })
    .join()
    .expect("thread");
    assert_eq!(node, Some(0));
    let umem: Vec<_> = areas.iter().filter(|(w, _)| *w == "umem").collect();
    assert_eq!(umem.len(), 1, "{areas:?}");
    assert_eq!(umem[0].1.pages, 256, "256 chunks of 4 KiB: {areas:?}");
    let rings: Vec<_> = areas.iter().filter(|(w, _)| *w == "rings").collect();
    assert_eq!(rings.len(), 4, "fill, completion, RX and TX rings are mapped: {areas:?}");
    for (what, c) in &areas {
        assert!(c.all_on_expected(), "{what}: every page on node 0: {c:?}");
    }
}

/// Received frames lent to the receiver stay out of the fill ring until released, spare chunks
/// keep the ring full meanwhile, and beyond the spares frames come without a lease; transmit
/// chunks lent for good are sent with only their headers written, and come back idle.
#[test]
fn lent_frames_and_lent_transmit_chunks() {
    lend_on("lend", 1500);
}

/// The same at MTU 9000, where every DATA frame spans three UMEM chunks: received frames come
/// in their pieces under one lease over all of them, and a lent transmit chunk is a group of
/// three buffers sent as one multi-buffer frame (`XDP_PKT_CONTD`), without a copy either way.
#[test]
fn lent_multi_buffer_frames_and_chunk_groups() {
    lend_on("lendj", 9000);
}

/// Copies `src` into the pieces of a lent transmit chunk, starting `at` bytes into its frame.
fn write_into(c: &mut tyche_transport::TxChunk, mut at: usize, mut src: &[u8]) {
    let mut w = c.write().expect("a chunk the kernel is done with");
    for p in w.pieces() {
        if at >= p.len() {
            at -= p.len();
            continue;
        }
        let n = src.len().min(p.len() - at);
        p[at..at + n].copy_from_slice(&src[..n]);
        src = &src[n..];
        at = 0;
        if src.is_empty() {
            break;
        }
    }
    assert!(src.is_empty(), "the frame fits the chunk");
}

fn lend_on(tag: &'static str, mtu: u32) {
    let Some(lab) = lab(tag, mtu) else { return };
    let ready = Arc::new(Barrier::new(2));
    let (ra, rb) = (Arc::clone(&ready), Arc::clone(&ready));
    const LEND: u32 = 8;
    // Chunks a frame spans: 1 at MTU 1500, 3 at MTU 9000.
    let per = (mtu as usize + 14).div_ceil(tyche_xdp::BUFFER_CAPACITY);
    let a = in_ns(&lab.a, move || {
        let config =
            PortConfig { lend_frames: LEND * per as u32, tx_lend_frames: 4 * per as u32, ..PortConfig::default() };
        let mut port = XdpPort::open("tya", &config).expect("open AF_XDP port");
        let segment = port.plan().segment_size as usize;
        ra.wait();
        // B sends 20 DATA frames; keep every one offered with a lease.
        let mut kept = Vec::new();
        let mut got = 0;
        let mut without = 0;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut whole = Vec::new();
        while got < 20 {
            assert!(Instant::now() < deadline, "stalled at {got}");
            port.recv_lend(64, &mut |pieces, lease| {
                assert_eq!(pieces.len(), per, "one piece per chunk the frame spans");
                tyche_transport::gather(pieces, &mut whole);
                assert_eq!(check_data(&whole, segment), got);
                got += 1;
                match lease {
                    Some(l) => {
                        assert_eq!(l.pieces().len(), per);
                        assert!(pieces.iter().all(|p| l.covers(p)));
                        kept.push((got - 1, l));
                        None
                    }
                    None => {
                        without += 1;
                        None
                    }
                }
            })
            .expect("recv");
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!((kept.len(), without), (LEND as usize, 20 - LEND), "the spares bound what is kept");
        assert_eq!(port.leases_out(), LEND as usize, "frames, whatever their pieces");
        assert!(port.stats().lend_exhausted > 0 && port.stats().lent == u64::from(LEND));
        // Kept frames are unchanged while more arrive.
        for (seq, l) in &kept {
            let bytes: Vec<u8> = l.bytes().flatten().copied().collect();
            assert_eq!(check_data(&bytes, segment), *seq);
        }
        for (_, l) in kept {
            port.release(l);
        }
        assert_eq!(port.leases_out(), 0);
        // Transmit chunks: payload written ahead, headers at send time.
        let mut chunks = port.lend_tx_chunks(16);
        assert_eq!(chunks.len(), 4, "as many as configured");
        assert!(chunks.iter().all(|c| c.pieces().len() == per && c.capacity() >= DATA_FRAME_OVERHEAD + segment));
        let env = env(MAC_A, MAC_B);
        // Twice: the chunks go out again once the kernel is done with them, the second time in
        // reverse order (the port's record of which chunks the kernel has follows both).
        for round in 0..2u32 {
            let order: Vec<usize> = if round == 0 { (0..4).collect() } else { (0..4).rev().collect() };
            let seq = |i: usize| 100 + 4 * round + i as u32;
            for (i, c) in chunks.iter_mut().enumerate() {
                let mut frame = vec![0u8; DATA_FRAME_OVERHEAD + segment];
                data_frame(&env, seq(i), segment, &mut frame);
                write_into(c, DATA_FRAME_OVERHEAD, &frame[DATA_FRAME_OVERHEAD..]);
            }
            let mut next = 0;
            let sent = port
                .transmit(8, &mut |buf| {
                    let &i = order.get(next)?;
                    let len = data_frame(&env, seq(i), segment, buf);
                    buf[DATA_FRAME_OVERHEAD..len].fill(0xEE); // must not be what goes out
                    next += 1;
                    Some(tyche_transport::Sent::Chunk { id: chunks[i].id(), header: DATA_FRAME_OVERHEAD, len })
                })
                .expect("send chunks");
            assert_eq!(sent, 4);
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                port.flush().expect("flush");
                if port.tx_chunks_in_flight().is_empty() {
                    break;
                }
                assert!(Instant::now() < deadline, "lent chunks never completed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        ra.wait();
    });
    let b = in_ns(&lab.b, move || {
        let mut port = XdpPort::open("tyb", &PortConfig::default()).expect("open AF_XDP port");
        let segment = port.plan().segment_size as usize;
        rb.wait();
        let env = env(MAC_B, MAC_A);
        let mut next = 0u32;
        while next < 20 {
            port.send(32, &mut |buf| {
                if next == 20 {
                    return None;
                }
                next += 1;
                Some(data_frame(&env, next - 1, segment, buf))
            })
            .expect("send");
            port.flush().expect("flush");
        }
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while got.len() < 8 {
            assert!(Instant::now() < deadline, "chunks never arrived: {got:?}");
            port.recv(64, &mut |buf| got.push(check_data(buf, segment))).expect("recv");
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(got, [100, 101, 102, 103, 107, 106, 105, 104], "payloads from the chunks, headers from send time");
        rb.wait();
    });
    a.join().expect("side a");
    b.join().expect("side b");
}

/// The XDP part of `ip link show DEV` in namespace `ns`: empty when no program is attached.
fn xdp_of(ns: &str, dev: &str) -> String {
    let out = Command::new("ip").args(["-n", ns, "link", "show", dev]).output().expect("run ip");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines().filter(|l| l.contains("xdp")).collect::<Vec<_>>().join("\n")
}

/// Loads a two-instruction XDP program called `name` (returns XDP_PASS, uses no map) and
/// attaches it to `ifname` in generic mode, as a non-Tyche tool would (or, named
/// `tyche_steer`, a Tyche build whose maps differ from this one's).
fn attach_raw(ifname: &str, name: &std::ffi::CStr) -> std::os::fd::OwnedFd {
    use libbpf_rs::libbpf_sys as sys;
    use std::os::fd::{AsFd, FromRawFd};
    // SAFETY: `bpf_insn` is plain data; all-zero registers are r0.
    let mut insns: [sys::bpf_insn; 2] = unsafe { std::mem::zeroed() };
    insns[0].code = 0xb7; // BPF_ALU64 | BPF_MOV | BPF_K: r0 = imm
    insns[0].imm = 2; // XDP_PASS
    insns[1].code = 0x95; // BPF_JMP | BPF_EXIT
                          // SAFETY: the name and license are NUL-terminated; `insns` holds the 2 instructions given.
    let fd = unsafe {
        sys::bpf_prog_load(
            sys::BPF_PROG_TYPE_XDP,
            name.as_ptr(),
            c"GPL".as_ptr(),
            insns.as_ptr(),
            2,
            std::ptr::null_mut(),
        )
    };
    assert!(fd >= 0, "loading the foreign program: {}", std::io::Error::from_raw_os_error(-fd));
    // SAFETY: a fresh descriptor the kernel returned.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let index = tyche_xdp::InterfaceInfo::query(ifname).expect("interface").index as i32;
    libbpf_rs::Xdp::new(fd.as_fd()).attach(index, libbpf_rs::XdpFlags::SKB_MODE).expect("attach foreign");
    fd
}

#[test]
fn tyche_ports_share_one_program_and_refuse_the_rest() {
    let Some(lab) = lab_with_queues("s", 1500, 2) else { return };
    let ns = lab.a.clone();
    in_ns(&lab.a, move || {
        let q = |queue| PortConfig { queue, frame_count: 256, ..PortConfig::default() };
        // Opened apart, as two processes would: the second shares the first's program.
        let first = XdpPort::open("tya", &q(0)).expect("queue 0");
        assert!(!first.program().shared(), "the first port attaches");
        let second = XdpPort::open("tya", &q(1)).expect("queue 1 beside queue 0");
        assert!(second.program().shared(), "the second port shares");
        assert_eq!(first.program().id(), second.program().id(), "one program per NIC");
        // A queue that is taken is refused by name, and the refusal disturbs nothing.
        let err = XdpPort::open("tya", &q(0)).map(|_| ()).expect_err("queue 0 is taken");
        assert!(
            matches!(err, Error::QueueBusy { queue: 0, pid: Some(p), .. } if p == std::process::id()),
            "unexpected error: {err}"
        );
        assert!(err.to_string().contains("served by another Tyche process"), "{err}");
        assert!(!xdp_of(&ns, "tya").is_empty(), "the refused port left the program attached");
        // The first user leaves: the program stays for the second.
        drop(first);
        assert!(!xdp_of(&ns, "tya").is_empty(), "the program stays while a user is left");
        drop(second);
        assert!(xdp_of(&ns, "tya").is_empty(), "the last user detaches: {}", xdp_of(&ns, "tya"));
        // Another Tyche build's program that no live process uses (its user was killed) is
        // replaced, and the replacement goes with its last user.
        let stale = attach_raw("tya", c"tyche_steer");
        let port = XdpPort::open("tya", &q(0)).expect("a stale Tyche program is replaced");
        assert!(!port.program().shared(), "a stale program is not shared");
        drop((port, stale));
        assert!(xdp_of(&ns, "tya").is_empty(), "the replacement is detached: {}", xdp_of(&ns, "tya"));
        // A foreign program is refused by id and name, and left in place.
        let _foreign = attach_raw("tya", c"foreign");
        let err = XdpPort::open("tya", &q(0)).map(|_| ()).expect_err("a foreign program is not replaced");
        assert!(matches!(&err, Error::ForeignProgram { name, .. } if name == "foreign"), "unexpected error: {err}");
        assert!(err.to_string().contains("foreign XDP program"), "{err}");
        assert!(xdp_of(&ns, "tya").contains("xdpgeneric"), "the foreign program stays");
    })
    .join()
    .expect("thread");
}
