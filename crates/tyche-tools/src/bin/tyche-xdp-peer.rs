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
    let prepared = prepare(ifname, args, &config)?;
    println!(
        "READY link={ifname} mode={} segment={} frame={} multi_buffer={}",
        prepared.mode,
        prepared.segment,
        prepared.segment + DATA_FRAME_OVERHEAD,
        prepared.multi_buffer,
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
    let (segment, window) = (prepared.segment, prepared.window);
    let mut port = connect(ifname, args, prepared, start_wait)?;
    let env = Envelope {
        dst: peer,
        src: port.t().capabilities().local_mac,
        ethertype: DEFAULT_ETHERTYPE,
        channel: 0,
        session: 1,
    };
    let o = Flow::new(args, env, segment, window).run(ifname, &mut port)?;
    report(ifname, &port, &o);
    Ok(())
}

/// A link as opened before READY: its AF_XDP port, or (over TCP, listening) its listener, and
/// what its frames carry.
struct Prepared {
    xdp: Option<XdpPort>,
    listener: Option<TcpListener>,
    /// DATA payload bytes per frame.
    segment: usize,
    /// DATA frames sent and not yet acknowledged, at most.
    window: u64,
    mode: String,
    multi_buffer: bool,
}

/// Opens `ifname`'s AF_XDP port (or, over TCP, binds the listener) before READY.
fn prepare(ifname: &str, args: &Args, config: &PortConfig) -> Result<Prepared, String> {
    match &args.tcp {
        None => {
            let port = XdpPort::open(ifname, config).map_err(|e| format!("{ifname}: {e}"))?;
            let plan = port.plan();
            // Keep the window within the peer's receive buffers (same configuration on both
            // sides): a multi-buffer frame takes several chunks.
            let chunks_per_frame = plan.frame_capacity.div_ceil(tyche_xdp::BUFFER_CAPACITY) as u64;
            let rx_chunks = u64::from(config.frame_count / 2);
            let window = args.window.min(rx_chunks * 3 / 4 / chunks_per_frame).max(1);
            let mode = port.mode().to_string();
            let (segment, multi_buffer) = (plan.segment_size as usize, plan.multi_buffer);
            Ok(Prepared { xdp: Some(port), listener: None, segment, window, mode, multi_buffer })
        }
        Some(tcp) => {
            let info = InterfaceInfo::query(ifname).map_err(|e| format!("{ifname}: {e}"))?;
            let segment = tyche_wire::segment_size_for(info.mtu, info.mtu + 14)
                .ok_or(format!("{ifname}: MTU {} too small", info.mtu))?;
            let mut listener = None;
            if let Tcp::Listen(addr) = tcp {
                let l = TcpListener::bind(addr).map_err(|e| format!("listen {addr}: {e}"))?;
                l.set_nonblocking(true).map_err(|e| format!("listener: {e}"))?;
                listener = Some(l);
            }
            let (segment, window) = (segment as usize, args.window);
            Ok(Prepared { xdp: None, listener, segment, window, mode: "tcp".into(), multi_buffer: false })
        }
    }
}

/// The port the link runs on after GO: the AF_XDP port, or a TCP connection made (or accepted
/// within the timeout, counted from `start_wait`).
fn connect(ifname: &str, args: &Args, prepared: Prepared, start_wait: Instant) -> Result<Port, String> {
    let tcp = match (prepared.xdp, &args.tcp) {
        (Some(p), _) => return Ok(Port::Xdp(Box::new(p))),
        (None, Some(tcp)) => tcp,
        (None, None) => unreachable!("an XDP port or a TCP role"),
    };
    let info = InterfaceInfo::query(ifname).map_err(|e| format!("{ifname}: {e}"))?;
    let stream = match tcp {
        Tcp::Connect(addr) => {
            TcpStream::connect_timeout(addr, Duration::from_secs(10)).map_err(|e| format!("connect {addr}: {e}"))?
        }
        Tcp::Listen(_) => {
            let l = prepared.listener.as_ref().expect("bound before READY");
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
    Ok(Port::Tcp(t))
}

/// Both directions of a link: DATA out within the window, DATA in counted in place and
/// acknowledged.
struct Flow<'a> {
    args: &'a Args,
    env: Envelope,
    segment: usize,
    window: u64,
    o: Outcome,
    /// The peer's cumulative acknowledgement.
    acked: u64,
    /// The count of DATA received last acknowledged.
    ack_sent: u64,
    last_ack_progress: Instant,
    done_at: Option<Instant>,
    last_final_ack: Instant,
    last_ack_at: Instant,
    /// Turns in a row without traffic.
    idle: u32,
}

impl<'a> Flow<'a> {
    fn new(args: &'a Args, env: Envelope, segment: usize, window: u64) -> Flow<'a> {
        let now = Instant::now();
        Flow {
            args,
            env,
            segment,
            window,
            o: Outcome::default(),
            acked: 0,
            ack_sent: 0,
            last_ack_progress: now,
            done_at: None,
            last_final_ack: now,
            last_ack_at: now,
            idle: 0,
        }
    }

    /// Runs both directions until both are done (and the peer had time for the final ACKs),
    /// or the timeout.
    fn run(mut self, ifname: &str, port: &mut Port) -> Result<Outcome, String> {
        let deadline = Instant::now() + self.args.timeout;
        loop {
            let now = Instant::now();
            if now > deadline {
                self.o.timed_out = true;
                break;
            }
            let got_data = match self.receive(port) {
                Ok(n) => n,
                // A TCP peer that finished first closes its end: fine once we are done too.
                Err(_) if self.done_at.is_some() => break,
                Err(e) => return Err(format!("{ifname}: recv: {e}")),
            };
            if got_data > 0 {
                // One clock read per batch, not per frame.
                let t = Instant::now();
                self.o.first_rx.get_or_insert(now);
                self.o.last_rx = Some(t);
            }
            self.acknowledge(port, now, got_data).map_err(|e| format!("{ifname}: send ack: {e}"))?;
            let sent_now = self.send(port).map_err(|e| format!("{ifname}: send: {e}"))?;
            port.t().flush().map_err(|e| format!("{ifname}: flush: {e}"))?;
            // Busy: poll again at once. Idle for a while: sleep until a frame (DATA or the ACK
            // that reopens the window) arrives, so a waiting side yields its CPU to the one
            // working.
            if got_data > 0 || sent_now > 0 {
                self.idle = 0;
            } else {
                self.idle += 1;
                if self.idle > self.args.spins {
                    port.wait(Duration::from_millis(1)).map_err(|e| format!("{ifname}: poll: {e}"))?;
                }
            }
            // A window that stops moving for a second means frames were lost: give up on them
            // (the receiver's count shows the loss) rather than wait forever.
            if self.acked < self.o.sent && now.duration_since(self.last_ack_progress) > Duration::from_secs(1) {
                self.acked = self.o.sent;
                self.last_ack_progress = now;
            }
            let send_done = self.o.sent >= self.args.frames && self.acked >= self.o.sent;
            if send_done && self.o.received >= self.args.expect {
                let t = *self.done_at.get_or_insert(now);
                // Linger so the peer gets our final ACKs and finishes too.
                if now.duration_since(t) > Duration::from_millis(300) {
                    break;
                }
            }
        }
        Ok(self.o)
    }

    /// Receives a batch: DATA counted (and checked) in place, ACKs taken. The DATA frames.
    fn receive(&mut self, port: &mut Port) -> std::io::Result<u64> {
        let segment = self.segment;
        let (o, acked, progress) = (&mut self.o, &mut self.acked, &mut self.last_ack_progress);
        let mut got_data = 0u64;
        port.t().recv(self.args.batch * 2, &mut |buf| {
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
                    if c > *acked {
                        *acked = c;
                        *progress = Instant::now();
                    }
                }
                _ => o.corrupt += 1,
            }
        })?;
        Ok(got_data)
    }

    /// Acknowledges what was received: often enough to keep the peer's window open, never per
    /// frame; again every 5 ms once done, so that the peer finishes too.
    fn acknowledge(&mut self, port: &mut Port, now: Instant, got_data: u64) -> std::io::Result<()> {
        let o = &self.o;
        let recv_done = o.received >= self.args.expect;
        let idle_ack = got_data == 0 && now.duration_since(self.last_ack_at) > Duration::from_micros(50);
        let want_ack =
            o.received > self.ack_sent && (o.received - self.ack_sent >= self.window / 8 || idle_ack || recv_done);
        let final_ack = self.done_at.is_some() && now.duration_since(self.last_final_ack) > Duration::from_millis(5);
        if !(want_ack || final_ack) {
            return Ok(());
        }
        let cumulative = o.received as u32;
        let env = &self.env;
        let ack = Message::Ack(Ack { cumulative, sack: 0, duplicate: false });
        if port.t().send(1, &mut |buf| Some(ack.emit(env, buf)))? == 1 {
            self.ack_sent = self.o.received;
            self.last_final_ack = now;
            self.last_ack_at = now;
        }
        Ok(())
    }

    /// Sends the DATA frames the window has room for (at most a batch). How many went.
    fn send(&mut self, port: &mut Port) -> std::io::Result<usize> {
        let (frames, sent) = (self.args.frames, self.o.sent);
        if sent >= frames {
            return Ok(0);
        }
        let room = (self.acked + self.window).saturating_sub(sent).min(frames - sent);
        if room == 0 {
            return Ok(0);
        }
        let (env, segment) = (&self.env, self.segment);
        let mut next = sent;
        let n = port.t().send((room as usize).min(self.args.batch), &mut |buf| {
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
            Some(h.emit_in_place(env, segment, buf))
        })?;
        self.o.sent += n as u64;
        Ok(n)
    }
}

/// The RESULT line.
fn report(ifname: &str, port: &Port, o: &Outcome) {
    let (stats, steer) = match port {
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
