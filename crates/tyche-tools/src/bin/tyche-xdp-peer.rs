//! One side of the veth lab's AF_XDP traffic, run inside a network namespace by
//! `cargo xtask xdp-smoke` and `cargo xtask bench xdp`.
//!
//! For every `--link IFACE=PEER_MAC` it opens an [`XdpPort`] on queue 0 in its own thread and
//! prints `READY link=IFACE mode=.. segment=..`; after a `GO` line on stdin each thread sends
//! `--frames` DATA frames (incrementing sequence numbers, payload of the link's segment size,
//! written in place in the UMEM) and counts the DATA frames it receives, acknowledging them
//! with cumulative ACK frames. The sender keeps at most `--window` frames unacknowledged, so a
//! receiver is never overrun. Every loop is bounded by `--timeout` seconds. At the end each
//! thread prints `RESULT link=.. sent=.. received=.. ...`.

use std::io::BufRead;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use std::net::{SocketAddr, TcpListener, TcpStream};
use tyche_transport::FrameTransport;
use tyche_wire::{Ack, DataHeader, Envelope, Frame, MacAddr, Message, Seq, DATA_FRAME_OVERHEAD, DEFAULT_ETHERTYPE};

use tyche_tcp::TcpTransport;
use tyche_transport::FrameTransportExt;
use tyche_xdp::{AttachMode, InterfaceInfo, PortConfig, XdpPort};

/// `--tcp-listen` / `--tcp-connect`: carry the same frames over TCP (the TSockets baseline)
/// between the two ends of the link instead of AF_XDP.
#[derive(Debug, Clone)]
enum Tcp {
    Listen(SocketAddr),
    Connect(SocketAddr),
}

/// The transport a link runs over.
enum Port {
    Xdp(Box<XdpPort>),
    Tcp(TcpTransport),
}

impl Port {
    fn t(&mut self) -> &mut dyn FrameTransport {
        match self {
            Port::Xdp(p) => p,
            Port::Tcp(p) => p,
        }
    }
    fn mode(&self) -> String {
        match self {
            Port::Xdp(p) => p.mode().to_string(),
            Port::Tcp(_) => "tcp".into(),
        }
    }
    /// Sleeps until the transport has input or `timeout` passes.
    fn wait(&mut self, timeout: Duration) -> std::io::Result<()> {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let Some(fd) = self.t().readiness_fd() else {
            return Ok(());
        };
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        let ms = PollTimeout::try_from(timeout.as_millis()).unwrap_or(PollTimeout::MAX);
        match nix::poll::poll(&mut fds, ms) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[derive(Debug, Clone)]
struct Args {
    links: Vec<(String, MacAddr)>,
    frames: u64,
    expect: u64,
    window: u64,
    mode: AttachMode,
    timeout: Duration,
    batch: usize,
    umem_frames: u32,
    spins: u32,
    tcp: Option<Tcp>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        links: Vec::new(),
        frames: 0,
        expect: 0,
        window: 1536,
        mode: AttachMode::Auto,
        timeout: Duration::from_secs(60),
        batch: 64,
        umem_frames: 4096,
        spins: 64,
        tcp: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--link" => {
                let v = val()?;
                let (i, m) = v.split_once('=').ok_or("--link IFACE=PEER_MAC")?;
                let mac = m.parse().map_err(|_| format!("bad MAC {m}"))?;
                a.links.push((i.to_string(), mac));
            }
            "--frames" => a.frames = val()?.parse().map_err(|_| "bad --frames")?,
            "--expect" => a.expect = val()?.parse().map_err(|_| "bad --expect")?,
            "--window" => a.window = val()?.parse().map_err(|_| "bad --window")?,
            "--umem-frames" => a.umem_frames = val()?.parse().map_err(|_| "bad --umem-frames")?,
            "--tcp-listen" => a.tcp = Some(Tcp::Listen(val()?.parse().map_err(|_| "bad --tcp-listen")?)),
            "--tcp-connect" => a.tcp = Some(Tcp::Connect(val()?.parse().map_err(|_| "bad --tcp-connect")?)),
            "--spins" => a.spins = val()?.parse().map_err(|_| "bad --spins")?,
            "--batch" => a.batch = val()?.parse().map_err(|_| "bad --batch")?,
            "--timeout" => a.timeout = Duration::from_secs(val()?.parse().map_err(|_| "bad --timeout")?),
            "--mode" => {
                a.mode = match val()?.as_str() {
                    "auto" => AttachMode::Auto,
                    "native" => AttachMode::Native,
                    "skb" => AttachMode::Skb,
                    m => return Err(format!("bad --mode {m}")),
                }
            }
            f => return Err(format!("unknown flag {f}")),
        }
    }
    if a.links.is_empty() {
        return Err("at least one --link".into());
    }
    Ok(a)
}

#[derive(Debug, Default)]
struct Outcome {
    sent: u64,
    received: u64,
    out_of_order: u64,
    corrupt: u64,
    first_rx: Option<Instant>,
    last_rx: Option<Instant>,
    rx_bytes: u64,
    timed_out: bool,
}

fn run_link(
    ifname: &str,
    peer: MacAddr,
    args: &Args,
    ready: &Barrier,
    go: &AtomicBool,
    passed_barrier: &mut bool,
) -> Result<(), String> {
    let config =
        PortConfig { mode: args.mode, frame_count: args.umem_frames, batch: args.batch, ..PortConfig::default() };
    let mut xdp = None;
    let mut listener = None;
    let (segment, window, mode, multi_buffer) = match &args.tcp {
        None => {
            let port = XdpPort::open(ifname, &config).map_err(|e| format!("{ifname}: {e}"))?;
            let plan = port.plan();
            // Keep the window within the peer's receive buffers (same configuration on both
            // sides): a multi-buffer frame takes several chunks.
            let chunks_per_frame = plan.frame_capacity.div_ceil(tyche_xdp::BUFFER_CAPACITY) as u64;
            let rx_chunks = u64::from(config.frame_count / 2);
            let window = args.window.min(rx_chunks * 3 / 4 / chunks_per_frame).max(1);
            let mode = port.mode().to_string();
            xdp = Some(port);
            (plan.segment_size as usize, window, mode, plan.multi_buffer)
        }
        Some(tcp) => {
            let info = InterfaceInfo::query(ifname).map_err(|e| format!("{ifname}: {e}"))?;
            let segment = tyche_wire::segment_size_for(info.mtu, info.mtu + 14)
                .ok_or(format!("{ifname}: MTU {} too small", info.mtu))?;
            if let Tcp::Listen(addr) = tcp {
                let l = TcpListener::bind(addr).map_err(|e| format!("listen {addr}: {e}"))?;
                l.set_nonblocking(true).map_err(|e| format!("listener: {e}"))?;
                listener = Some((l, info));
            }
            (segment as usize, args.window, "tcp".to_string(), false)
        }
    };
    println!(
        "READY link={ifname} mode={mode} segment={segment} frame={} multi_buffer={multi_buffer}",
        segment + DATA_FRAME_OVERHEAD,
    );
    ready.wait();
    *passed_barrier = true;
    let start_wait = Instant::now();
    while !go.load(Ordering::Acquire) {
        if start_wait.elapsed() > args.timeout {
            return Err(format!("{ifname}: no GO within the timeout"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut port = match (xdp, &args.tcp) {
        (Some(p), _) => Port::Xdp(Box::new(p)),
        (None, Some(tcp)) => {
            let info = InterfaceInfo::query(ifname).map_err(|e| format!("{ifname}: {e}"))?;
            let stream = match tcp {
                Tcp::Connect(addr) => TcpStream::connect_timeout(addr, Duration::from_secs(10))
                    .map_err(|e| format!("connect {addr}: {e}"))?,
                Tcp::Listen(_) => {
                    let (l, _) = listener.as_ref().expect("bound before READY");
                    loop {
                        match l.accept() {
                            Ok((s, _)) => break s,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                if start_wait.elapsed() > args.timeout {
                                    return Err(format!("{ifname}: no TCP peer"));
                                }
                                std::thread::sleep(Duration::from_millis(1));
                            }
                            Err(e) => return Err(format!("accept: {e}")),
                        }
                    }
                }
            };
            let t = TcpTransport::new(stream, info.mtu, info.mac).map_err(|e| format!("{ifname}: tcp: {e}"))?;
            Port::Tcp(t)
        }
        (None, None) => unreachable!("an XDP port or a TCP role"),
    };
    let env = Envelope {
        dst: peer,
        src: port.t().capabilities().local_mac,
        ethertype: DEFAULT_ETHERTYPE,
        channel: 0,
        session: 1,
    };
    let mut o = Outcome::default();
    let mut acked: u64 = 0;
    let mut ack_sent: u64 = 0;
    let mut last_ack_progress = Instant::now();
    let deadline = Instant::now() + args.timeout;
    let mut done_at: Option<Instant> = None;
    let mut last_final_ack = Instant::now();
    let mut last_ack_at = Instant::now();
    let mut idle = 0u32;
    loop {
        let now = Instant::now();
        if now > deadline {
            o.timed_out = true;
            break;
        }
        // Receive: count DATA in place, take ACKs.
        let mut got_data = 0u64;
        let rx_result = port.t().recv(args.batch * 2, &mut |buf| {
            let Ok(frame) = Frame::new_checked(buf, DEFAULT_ETHERTYPE) else {
                o.corrupt += 1;
                return;
            };
            match frame.parse() {
                Ok(Message::Data(d)) => {
                    let seq = u64::from(d.header.seq.seq);
                    let ok = d.payload.len() == segment
                        && d.payload[..8] == seq.to_be_bytes()
                        && d.payload[segment - 8..] == seq.to_be_bytes();
                    if !ok {
                        o.corrupt += 1;
                        return;
                    }
                    if seq != o.received & 0xffff_ffff {
                        o.out_of_order += 1;
                    }
                    o.received += 1;
                    o.rx_bytes += buf.len() as u64;
                    got_data += 1;
                }
                Ok(Message::Ack(a)) => {
                    let c = u64::from(a.cumulative);
                    if c > acked {
                        acked = c;
                        last_ack_progress = Instant::now();
                    }
                }
                _ => o.corrupt += 1,
            }
        });
        if let Err(e) = rx_result {
            // A TCP peer that finished first closes its end: fine once we are done too.
            if done_at.is_some() {
                break;
            }
            return Err(format!("{ifname}: recv: {e}"));
        }
        if got_data > 0 {
            // One clock read per batch, not per frame.
            let t = Instant::now();
            o.first_rx.get_or_insert(now);
            o.last_rx = Some(t);
        }

        // Acknowledge: often enough to keep the peer's window open, never per frame.
        let recv_done = o.received >= args.expect;
        let idle_ack = got_data == 0 && now.duration_since(last_ack_at) > Duration::from_micros(50);
        let want_ack = o.received > ack_sent && (o.received - ack_sent >= window / 8 || idle_ack || recv_done);
        let final_ack = done_at.is_some() && now.duration_since(last_final_ack) > Duration::from_millis(5);
        if want_ack || final_ack {
            let cumulative = o.received as u32;
            let sent = port
                .t()
                .send(1, &mut |buf| Some(Message::Ack(Ack { cumulative, sack: 0, duplicate: false }).emit(&env, buf)))
                .map_err(|e| format!("{ifname}: send ack: {e}"))?;
            if sent == 1 {
                ack_sent = o.received;
                last_final_ack = now;
                last_ack_at = now;
            }
        }

        // Send DATA within the window.
        let mut sent_now = 0;
        if o.sent < args.frames {
            let room = (acked + window).saturating_sub(o.sent).min(args.frames - o.sent);
            if room > 0 {
                let mut next = o.sent;
                let n = port
                    .t()
                    .send((room as usize).min(args.batch), &mut |buf| {
                        let seq = next;
                        let payload = &mut buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + segment];
                        payload[..8].copy_from_slice(&seq.to_be_bytes());
                        payload[segment - 8..].copy_from_slice(&seq.to_be_bytes());
                        next += 1;
                        let h = DataHeader {
                            seq: Seq { seq: seq as u32, ack: 0 },
                            damq: 0,
                            seg_index: 0,
                            seg_count: 1,
                            tag: seq,
                            offset: 0,
                        };
                        Some(h.emit_in_place(&env, segment, buf))
                    })
                    .map_err(|e| format!("{ifname}: send: {e}"))?;
                o.sent += n as u64;
                sent_now = n;
            }
        }
        port.t().flush().map_err(|e| format!("{ifname}: flush: {e}"))?;
        // Busy: poll again at once. Idle for a while: sleep until a frame (DATA or the ACK that
        // reopens the window) arrives, so a waiting side yields its CPU to the one working.
        if got_data > 0 || sent_now > 0 {
            idle = 0;
        } else {
            idle += 1;
            if idle > args.spins {
                port.wait(Duration::from_millis(1)).map_err(|e| format!("{ifname}: poll: {e}"))?;
            }
        }

        // A window that stops moving for a second means frames were lost: give up on them
        // (the receiver's count shows the loss) rather than wait forever.
        if acked < o.sent && now.duration_since(last_ack_progress) > Duration::from_secs(1) {
            acked = o.sent;
            last_ack_progress = now;
        }
        let send_done = o.sent >= args.frames && acked >= o.sent;
        if send_done && recv_done {
            let t = *done_at.get_or_insert(now);
            // Linger so the peer gets our final ACKs and finishes too.
            if now.duration_since(t) > Duration::from_millis(300) {
                break;
            }
        }
    }
    let (stats, steer) = match &port {
        Port::Xdp(p) => (p.stats(), p.program().stats().unwrap_or_default()),
        Port::Tcp(_) => Default::default(),
    };
    let secs = match (o.first_rx, o.last_rx) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    println!(
        "RESULT link={ifname} mode={} sent={} received={} out_of_order={} corrupt={} rx_bytes={} rx_secs={secs:.6} timed_out={} kernel_rx_dropped={} kernel_ring_full={} steered={} passed={}",
        port.mode(),
        o.sent,
        o.received,
        o.out_of_order,
        o.corrupt,
        o.rx_bytes,
        o.timed_out,
        stats.kernel_rx_dropped,
        stats.kernel_rx_ring_full,
        steer.steered,
        steer.passed,
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tyche-xdp-peer: {e}");
            return ExitCode::from(2);
        }
    };
    let ready = Arc::new(Barrier::new(args.links.len() + 1));
    let go = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for (ifname, peer) in args.links.clone() {
        let (args, ready, go, failed) = (args.clone(), ready.clone(), go.clone(), failed.clone());
        threads.push(std::thread::spawn(move || {
            let mut passed = false;
            if let Err(e) = run_link(&ifname, peer, &args, &ready, &go, &mut passed) {
                eprintln!("tyche-xdp-peer: {e}");
                failed.store(true, Ordering::Release);
                if !passed {
                    // Let the other threads and main get past the barrier.
                    ready.wait();
                }
            }
        }));
    }
    ready.wait();
    if !failed.load(Ordering::Acquire) {
        println!("ALL-READY");
    }
    // Wait for GO (or end of input) from the driver.
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    go.store(true, Ordering::Release);
    for t in threads {
        let _ = t.join();
    }
    if failed.load(Ordering::Acquire) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
