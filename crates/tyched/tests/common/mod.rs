//! An initiator driver for tests: tyche-channel's `Connector` and `Volume` over in-memory links
//! to an in-process `tyched` target.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use tyche_channel::{
    ConnectError, Connected, Connector, Inbound, Instant, IoError, IoRequest, LeastBytes, Timers, Volume, VolumeConfig,
    VolumeEvent,
};
use tyche_transport::FrameTransportExt;
use tyche_transport::{FrameTransport, MemLink};
use tyche_wire::{ChannelParams, Envelope, Frame, MacAddr, Op, DATA_FRAME_OVERHEAD, DEFAULT_ETHERTYPE};
use tyched::{Config, Nic, Target, TargetHandle};

/// Longest any test waits for one exchange.
pub const LIMIT: Duration = Duration::from_secs(20);

pub fn init_mac(k: usize) -> MacAddr {
    MacAddr::local(0x100 + k as u32)
}
pub fn target_mac(k: usize) -> MacAddr {
    MacAddr::local(0x200 + k as u32)
}

/// Starts a target serving `config` on `paths` in-memory NICs; returns the initiator's ports.
pub fn start(config: Config, paths: usize) -> (TargetHandle, Vec<Port>) {
    start_links(config, paths, |_| {})
}

/// As [`start`], with `setup` applied to the target's end of each link (lending, pieces).
pub fn start_links(
    config: Config,
    paths: usize,
    setup: impl Fn(&mut tyche_transport::MemPort),
) -> (TargetHandle, Vec<Port>) {
    let mut ports = Vec::new();
    let mut nics = Vec::new();
    for k in 0..paths {
        let (a, mut b) = MemLink::pair((init_mac(k), target_mac(k)), 9000, 9014, 8192);
        setup(&mut b);
        ports.push(Box::new(a) as Port);
        nics.push(Nic { name: format!("mem{k}"), transport: Box::new(b) });
    }
    let handle = Target::start(config, nics).expect("target starts");
    (handle, ports)
}

/// As [`start`], with the target's ends lending received frames (up to `lend` at once each) and
/// wrapped in a fault injector that applies `rx` to what the target receives.
pub fn start_lending(
    config: Config,
    paths: usize,
    lend: usize,
    rx: tyche_transport::FaultConfig,
) -> (TargetHandle, Vec<Port>) {
    let mut ports = Vec::new();
    let mut nics = Vec::new();
    for k in 0..paths {
        let (a, mut b) = MemLink::pair((init_mac(k), target_mac(k)), 9000, 9014, 8192);
        b.set_lending(lend);
        let b = tyche_transport::FaultInjector::new(b, Default::default(), rx, 0x5eed + k as u64);
        ports.push(Box::new(a) as Port);
        nics.push(Nic { name: format!("mem{k}"), transport: Box::new(b) });
    }
    let handle = Target::start(config, nics).expect("target starts");
    (handle, ports)
}

/// As [`start`], with the target's ends lending received frames and transmit chunks (up to
/// `lend` of each): the zero-copy paths AF_XDP takes.
pub fn start_lending_tx(config: Config, paths: usize, lend: usize) -> (TargetHandle, Vec<Port>) {
    start_links(config, paths, |b| {
        b.set_lending(lend);
        b.set_tx_lending(lend);
    })
}

/// As [`start_lending_tx`], over links that behave as AF_XDP multi-buffer links at MTU 9000
/// (`MemPort::set_pieces(3646)`): every DATA frame the target receives comes in three pieces,
/// each in a buffer of its own, and each transmit chunk it is lent is a group of three.
pub fn start_lending_pieces(config: Config, paths: usize, lend: usize) -> (TargetHandle, Vec<Port>) {
    start_links(config, paths, |b| {
        b.set_lending(lend);
        b.set_tx_lending(lend);
        b.set_pieces(3646);
    })
}

/// Waits until the target holds no kept frame and every transport has all its frames back.
pub fn wait_leases_back(target: &TargetHandle) -> tyched::Snapshot {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let s = target.stats();
        if s.leases_held == 0 && s.nics.iter().all(|n| n.leases_out == 0) {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "kept frames never went back: {} held, {:?}",
            s.leases_held,
            s.nics.iter().map(|n| n.leases_out).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An initiator's end of one link.
pub type Port = Box<dyn FrameTransport + Send>;

/// The initiator side of one attachment.
pub struct Initiator {
    pub ports: Vec<Port>,
    clock: std::time::Instant,
    pub volume: Option<Volume>,
    pub connected: Option<Connected>,
    bufs: HashMap<u64, Vec<u8>>,
    done: HashMap<u64, Result<(), IoError>>,
    next_id: u64,
    buf: Vec<u8>,
    /// When set, the volume believes the export has this size (so the target does the checking).
    pub pretend_size: Option<u64>,
    /// The target's MAC on each path.
    pub target_macs: Vec<MacAddr>,
    /// The initiator's MAC on each path (its port's end of the link).
    pub init_macs: Vec<MacAddr>,
    /// When set, every frame sent is followed by a corrupted copy.
    pub mutate: Option<tyche_transport::SplitMix64>,
    /// The host id sent in CONNECT (none: the target identifies this initiator by its MAC).
    pub host: Option<[u8; 16]>,
    /// Every frame sent, with its path, as an eavesdropper on the links records them.
    pub captured: Vec<(usize, Vec<u8>)>,
    /// Feature bits asked for in CONNECT.
    pub features: u32,
    /// When set, whatever arrives on this path is lost (the target's answers on it never come).
    pub deaf: Option<usize>,
}

pub fn want() -> ChannelParams {
    ChannelParams { ring: 1024, remq_slots: 64, damq_slots: 64, segment: 8192, max_io: 1 << 20, features: 0 }
}

impl std::fmt::Debug for Initiator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Initiator").field("connected", &self.connected).finish_non_exhaustive()
    }
}

impl Initiator {
    pub fn new(ports: Vec<Port>) -> Self {
        Initiator {
            ports,
            clock: std::time::Instant::now(),
            volume: None,
            connected: None,
            bufs: HashMap::new(),
            done: HashMap::new(),
            next_id: 1,
            buf: vec![0; 65536],
            pretend_size: None,
            target_macs: (0..8).map(target_mac).collect(),
            init_macs: (0..8).map(init_mac).collect(),
            mutate: None,
            host: None,
            captured: Vec::new(),
            features: 0,
            deaf: None,
        }
    }

    pub fn now(&self) -> Instant {
        Instant(self.clock.elapsed().as_nanos() as u64 + 1)
    }

    /// Runs one handshake on path `k`.
    pub fn handshake(
        &mut self,
        k: usize,
        session: u64,
        export: &str,
        key: Option<&[u8]>,
    ) -> (Connector, Result<Connected, ConnectError>) {
        let env = Envelope {
            dst: self.target_macs[k],
            src: self.init_macs[k],
            ethertype: DEFAULT_ETHERTYPE,
            channel: k as u16,
            session,
        };
        let nonce = 0x1234_5678_0000 + k as u64 + (self.clock.elapsed().as_nanos() as u64) * 7;
        let asked = ChannelParams { features: self.features, ..want() };
        let mut c = Connector::new(env, export, asked, nonce, Duration::from_millis(100), 20, self.now());
        if let Some(key) = key {
            c = c.with_key(key);
        }
        if let Some(host) = self.host {
            c = c.with_host(host);
        }
        let deadline = std::time::Instant::now() + LIMIT;
        loop {
            assert!(std::time::Instant::now() < deadline, "handshake on path {k} took too long");
            let now = self.now();
            let mut buf = std::mem::take(&mut self.buf);
            if let Some(len) = c.poll_transmit(now, &mut buf) {
                send(&mut self.ports[k], &buf[..len]);
                self.captured.push((k, buf[..len].to_vec()));
            }
            self.buf = buf;
            let mut out = None;
            self.ports[k]
                .recv(64, &mut |bytes| {
                    let Ok(f) = Frame::new_checked(bytes, DEFAULT_ETHERTYPE) else { return };
                    let Ok(m) = f.parse() else { return };
                    if let Some(r) = c.handle(f.src(), f.session(), &m) {
                        out = Some(r);
                    }
                })
                .expect("recv");
            c.handle_timeout(now);
            if let Some(r) = out.or(c.outcome()) {
                return (c, r);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Attaches `export` over every port.
    pub fn attach(&mut self, export: &str, key: Option<&[u8]>) -> Result<Connected, ConnectError> {
        let (c, r) = self.handshake(0, 0, export, key);
        let connected = r?;
        let cfg = VolumeConfig {
            export_size: self.pretend_size.unwrap_or(connected.export_size),
            read_only: false,
            no_path_timeout: Duration::from_secs(2),
            io_timeout: None,
            max_requests: 64,
        };
        let now = self.now();
        let mut vol = Volume::new(cfg, connected.session, DEFAULT_ETHERTYPE, Box::<LeastBytes>::default(), now);
        vol.add_channel(c.channel(&connected, Timers::default(), now), None, now);
        for k in 1..self.ports.len() {
            let (c, r) = self.handshake(k, connected.session, export, key);
            let more = r.unwrap_or_else(|e| panic!("path {k} could not join: {e:?}"));
            vol.add_channel(c.channel(&more, Timers::default(), self.now()), None, self.now());
        }
        self.volume = Some(vol);
        self.connected = Some(connected);
        Ok(connected)
    }

    /// Submits a request; returns its id.
    pub fn submit(&mut self, op: Op, offset: u64, data: Vec<u8>, length: u64, fua: bool) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let req = IoRequest { id, op, fua, offset, length, node: None };
        let now = self.now();
        self.volume.as_mut().expect("attached").submit(now, req).unwrap_or_else(|e| panic!("submit {req:?}: {e:?}"));
        self.bufs.insert(id, data);
        id
    }

    /// Drives the volume until request `id` completes; returns its result and buffer.
    pub fn wait(&mut self, id: u64) -> (Result<(), IoError>, Vec<u8>) {
        let deadline = std::time::Instant::now() + LIMIT;
        while !self.done.contains_key(&id) {
            assert!(std::time::Instant::now() < deadline, "request {id} did not complete");
            if !self.pump() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        (self.done.remove(&id).expect("done"), self.bufs.remove(&id).expect("buffer"))
    }

    /// One round of receive, timers, events, transmit. Returns whether anything moved.
    pub fn pump(&mut self) -> bool {
        let now = self.now();
        let mut moved = false;
        let vol = self.volume.as_mut().expect("attached");
        for (k, port) in self.ports.iter_mut().enumerate() {
            let bufs = &mut self.bufs;
            let mut scratch = Vec::new();
            let deaf = self.deaf == Some(k);
            let n = port
                .recv(256, &mut |bytes| {
                    if deaf {
                        return;
                    }
                    if let Inbound::Read { id, offset, payload } = vol.handle_frame(now, bytes, &mut scratch) {
                        let b = bufs.get_mut(&id).expect("read for an outstanding request");
                        b[offset as usize..offset as usize + payload.len()].copy_from_slice(payload);
                    }
                })
                .expect("recv");
            moved |= n > 0;
        }
        if vol.poll_timeout().is_some_and(|t| t <= now) {
            vol.handle_timeout(now);
        }
        while let Some(ev) = vol.poll_event() {
            if let VolumeEvent::Completed { id, result } = ev {
                self.done.insert(id, result);
                moved = true;
            }
        }
        let indices: Vec<u16> = vol.channel_indices().collect();
        for ch in indices {
            let port = &mut self.ports[ch as usize];
            let bufs = &self.bufs;
            let mut copies = Vec::new();
            let mutate = &mut self.mutate;
            let captured = &mut self.captured;
            let n = port
                .send(256, &mut |buf| {
                    let out = vol.poll_transmit(now, ch, buf)?;
                    if let Some((id, off, len)) = out.payload {
                        buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len as usize]
                            .copy_from_slice(&bufs[&id][off as usize..off as usize + len as usize]);
                    }
                    let len = vol.seal(ch, buf, out.len);
                    captured.push((ch as usize, buf[..len].to_vec()));
                    if let Some(rng) = mutate.as_mut() {
                        // A corrupted copy after the original: a few random bytes past the
                        // Ethernet header changed.
                        let mut c = buf[..len].to_vec();
                        for _ in 0..rng.range(1, 4) {
                            let i = rng.range(14, c.len() as u64 - 1) as usize;
                            c[i] = rng.next_u64() as u8;
                        }
                        if rng.chance(0.2) {
                            c.truncate(rng.range(14, c.len() as u64) as usize);
                        }
                        copies.push(c);
                    }
                    Some(len)
                })
                .expect("send");
            port.flush().expect("flush");
            for c in copies {
                send(port, &c);
            }
            moved |= n > 0;
        }
        moved
    }

    /// Submits and waits.
    pub fn io(&mut self, op: Op, offset: u64, data: Vec<u8>, fua: bool) -> Result<Vec<u8>, IoError> {
        let length = data.len() as u64;
        let id = self.submit(op, offset, data, length, fua);
        let (r, buf) = self.wait(id);
        r.map(|()| buf)
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        self.io(Op::Write, offset, data.to_vec(), false).unwrap_or_else(|e| panic!("write at {offset}: {e:?}"));
    }

    pub fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        self.io(Op::Read, offset, vec![0; len], false).unwrap_or_else(|e| panic!("read at {offset}+{len}: {e:?}"))
    }

    /// A request without data (FLUSH, DISCARD, WRITE_ZEROES).
    pub fn range_op(&mut self, op: Op, offset: u64, length: u64) -> Result<(), IoError> {
        let id = self.submit(op, offset, Vec::new(), length, false);
        self.wait(id).0
    }
}

pub fn send(port: &mut Port, frame: &[u8]) {
    let mut once = Some(frame);
    port.send(1, &mut |buf| {
        let f = once.take()?;
        buf[..f.len()].copy_from_slice(f);
        Some(f.len())
    })
    .expect("send");
    port.flush().expect("flush");
}

/// A recognisable pattern for a write of `len` bytes at `offset`, version `v`.
pub fn pattern(offset: u64, len: usize, v: u8) -> Vec<u8> {
    (0..len).map(|i| ((offset as usize + i) as u8).wrapping_mul(31).wrapping_add(v) | 1).collect()
}
