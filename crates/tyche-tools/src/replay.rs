//! [`ReplayPort`]: an in-memory port that stands in for one daemon's peer with frames built in
//! advance, so that a benchmark measures one side's frame handling alone (`cargo xtask bench
//! scale`, docs/benchmarks.md, "Channel scaling").
//!
//! A replay port wraps one end of a [`MemLink`](tyche_transport::MemLink) and goes through three phases
//! ([`ReplayControl`]):
//!
//! 1. **Live**: a plain in-memory port between the daemon under test and a real peer. The
//!    handshake and a warm-up of real reads run here; the port records what the peer sends (its
//!    last READ request, or the DATA segments and COMPLETION of a read) and follows the sequence
//!    numbers of both directions.
//! 2. **Hold**: the peer is cut off (nothing more is received from it, nothing sent reaches it).
//!    A port standing in for the target notes the requests the initiator sends.
//! 3. **Replay**: the port plays the peer from templates built out of the recorded frames. Only
//!    the fields that change from one request to the next are patched in place (sequence number,
//!    piggybacked ack, tag, slots, offset), the rest of each frame (payloads included) was built
//!    once; what the daemon sends is looked at (its headers only) and dropped.
//!
//! Standing in for the **initiator** ([`ReplayPort::initiator`], in front of a target): the
//! port keeps `window` READ requests in flight, each in its own `remq`/`damq` slot pair; a
//! COMPLETION from the target frees its pair and the next request goes out with the next
//! sequence number, the next tag (`first_tag + k × tag_stride`, so several ports of one session
//! never share a tag) and the next offset, acknowledging every frame the target has sent. The
//! floor stays where the real initiator left it (reads are not recorded in the target's ledger,
//! so an advancing floor would change nothing but could abort another port's reads).
//!
//! Standing in for the **target** ([`ReplayPort::target`], in front of an initiator): every new
//! REQUEST the initiator sends is answered, in order, with the recorded read response (its DATA
//! segments, then its COMPLETION with status OK) patched to the request's slots and tag. Only
//! READs of the recorded length can be answered; anything else is counted in
//! [`ReplayControl::failed`].
//!
//! The port's own work per frame is a few stores into a buffer it already holds, as a NIC's
//! DMA would leave it; no thread but the daemon's runs while it replays.

use std::io;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tyche_wire::{layout, Envelope, Frame, Kind, Message, Op, Request, Seq, Status, ETH_HEADER_LEN};

use tyche_transport::{Capabilities, FrameTransport, Lease, MemPort, OnLentFrame, Rx, Sent, TxChunk};

const LIVE: u8 = 0;
const HOLD: u8 = 1;
const REPLAY: u8 = 2;

/// Largest number of requests a port standing in for the initiator keeps in flight.
pub const MAX_WINDOW: u16 = 1024;
/// Most requests a port standing in for the target holds unanswered (more are counted in
/// [`ReplayControl::failed`]); an initiator's slots keep it far below.
pub const MAX_ASKED: usize = 1 << 16;
/// Most segments of the read response a port standing in for the target records.
pub const MAX_SEGMENTS: u16 = 1024;

/// What a port replays, set before [`ReplayControl::replay`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayPlan {
    /// Requests to send and see completed (standing in for the initiator; a port standing in
    /// for the target answers whatever the initiator asks).
    pub requests: u64,
    /// Requests in flight at once (standing in for the initiator), at most [`MAX_WINDOW`] and
    /// the slots the channel was granted.
    pub window: u16,
    /// Tag of the first replayed request (standing in for the initiator).
    pub first_tag: u64,
    /// Distance between this port's tags (the number of ports of the session).
    pub tag_stride: u64,
    /// Offsets cycle through `[0, span)` in steps of the request length.
    pub span: u64,
}

/// The handle a benchmark keeps on a [`ReplayPort`] that a daemon's thread owns: phase changes,
/// the plan, and what the port counted (atomics, written by the daemon's thread).
#[derive(Debug)]
pub struct ReplayControl {
    phase: AtomicU8,
    plan: Mutex<Option<ReplayPlan>>,
    epoch: Instant,
    delivered: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    /// Nanoseconds after `epoch` when the plan's last request was done (0: not yet).
    finished: AtomicU64,
    recorded_tag: AtomicU64,
    recorded: AtomicU64,
    error: Mutex<Option<String>>,
}

impl ReplayControl {
    fn new() -> Arc<ReplayControl> {
        Arc::new(ReplayControl {
            phase: AtomicU8::new(LIVE),
            plan: Mutex::new(None),
            epoch: Instant::now(),
            delivered: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            recorded_tag: AtomicU64::new(0),
            recorded: AtomicU64::new(0),
            error: Mutex::new(None),
        })
    }

    /// Cuts the real peer off (phase 2).
    pub fn hold(&self) {
        self.phase.store(HOLD, Ordering::Release);
    }

    /// Starts replaying `plan` (phase 3); the port builds its templates on its next call.
    pub fn replay(&self, plan: ReplayPlan) {
        *self.plan.lock().expect("plan lock") = Some(plan);
        self.phase.store(REPLAY, Ordering::Release);
    }

    /// Requests handed to the daemon (for the initiator) or responses delivered (for the target).
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Acquire)
    }

    /// Requests the daemon completed: COMPLETIONs with status OK it sent (for the initiator), or
    /// responses it took in and then came back for more, so handled (for the target).
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    /// Completions with another status than OK (for the initiator), or requests that could not
    /// be answered (for the target).
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Acquire)
    }

    /// When the plan's last request was done (for the initiator), or when the daemon last came
    /// back after taking every response delivered (for the target; see [`Self::completed`]).
    pub fn finished_at(&self) -> Option<Instant> {
        match self.finished.load(Ordering::Acquire) {
            0 => None,
            ns => Some(self.epoch + std::time::Duration::from_nanos(ns)),
        }
    }

    /// The highest tag seen in the live phase (in requests from or to the peer).
    pub fn recorded_tag(&self) -> u64 {
        self.recorded_tag.load(Ordering::Acquire)
    }

    /// Frames of the kind the port needs for its templates recorded in the live phase.
    pub fn recorded(&self) -> u64 {
        self.recorded.load(Ordering::Acquire)
    }

    /// Why the port could not start replaying, if it could not.
    pub fn error(&self) -> Option<String> {
        self.error.lock().expect("error lock").clone()
    }

    /// Standing in for the target: the daemon has handled the first `answered` responses, now.
    fn stamp(&self, answered: u64) {
        let ns = (self.epoch.elapsed().as_nanos() as u64).max(1);
        self.finished.store(ns, Ordering::Release);
        self.completed.store(answered, Ordering::Release);
    }

    fn finish(&self) {
        let ns = (self.epoch.elapsed().as_nanos() as u64).max(1);
        let _ = self.finished.compare_exchange(0, ns, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// Which peer a [`ReplayPort`] stands in for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stand {
    Initiator,
    Target,
}

/// Serial-number comparison: whether `a` comes at or after `b`.
fn at_or_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

fn put_u16(frame: &mut [u8], f: std::ops::Range<usize>, v: u16) {
    frame[ETH_HEADER_LEN + f.start..ETH_HEADER_LEN + f.end].copy_from_slice(&v.to_be_bytes());
}
fn put_u32(frame: &mut [u8], f: std::ops::Range<usize>, v: u32) {
    frame[ETH_HEADER_LEN + f.start..ETH_HEADER_LEN + f.end].copy_from_slice(&v.to_be_bytes());
}
fn put_u64(frame: &mut [u8], f: std::ops::Range<usize>, v: u64) {
    frame[ETH_HEADER_LEN + f.start..ETH_HEADER_LEN + f.end].copy_from_slice(&v.to_be_bytes());
}

/// A request the initiator sent that a port standing in for the target answers.
#[derive(Debug, Clone, Copy)]
struct Asked {
    remq: u16,
    damq: u16,
    tag: u64,
    /// Frames of its response already delivered.
    sent: usize,
}

/// Templates and progress of the replay phase.
#[derive(Debug)]
enum Replay {
    /// Standing in for the initiator: one READ REQUEST per slot pair.
    Requests {
        templates: Vec<Vec<u8>>,
        /// Slot pairs free to send a request in.
        free: std::collections::VecDeque<u16>,
        next_tag: u64,
        stride: u64,
        length: u64,
        span: u64,
        next_offset: u64,
        plan: ReplayPlan,
    },
    /// Standing in for the target: the DATA segments and the COMPLETION of a read.
    Responses { data: Vec<Vec<u8>>, completion: Vec<u8>, done_pending: bool },
    /// The templates could not be built ([`ReplayControl::error`]).
    Broken,
}

/// One end of an in-memory link that records its peer and then replays it ([the module
/// documentation](self)).
#[derive(Debug)]
pub struct ReplayPort {
    inner: MemPort,
    ctl: Arc<ReplayControl>,
    stand: Stand,
    ethertype: u16,
    /// One past the highest sequence number the daemon sent (what the peer acknowledges).
    daemon_next: Option<u32>,
    /// One past the highest sequence number the peer sent.
    peer_next: Option<u32>,
    /// The last READ REQUEST the live initiator sent.
    rec_request: Option<Vec<u8>>,
    /// Floor of the recorded requests.
    rec_floor: u64,
    /// The segments of the last read response the live target sent, by index, and its count.
    rec_data: Vec<Option<Vec<u8>>>,
    /// Tag of the segments in `rec_data`.
    rec_data_tag: u64,
    /// The last COMPLETION (status OK) of a READ whose segments are all in `rec_data`.
    rec_completion: Option<Vec<u8>>,
    /// Requests waiting for their response (standing in for the target).
    asked: std::collections::VecDeque<Asked>,
    replay: Option<Replay>,
    /// Where the daemon's frames are written in the replay phase.
    scratch: Vec<u8>,
}

impl ReplayPort {
    /// A port in front of a target, standing in for the initiator (it replays READ requests).
    pub fn initiator(inner: MemPort, ethertype: u16) -> (ReplayPort, Arc<ReplayControl>) {
        ReplayPort::new(inner, ethertype, Stand::Initiator)
    }

    /// A port in front of an initiator, standing in for the target (it answers READ requests).
    pub fn target(inner: MemPort, ethertype: u16) -> (ReplayPort, Arc<ReplayControl>) {
        ReplayPort::new(inner, ethertype, Stand::Target)
    }

    fn new(inner: MemPort, ethertype: u16, stand: Stand) -> (ReplayPort, Arc<ReplayControl>) {
        let ctl = ReplayControl::new();
        let scratch = vec![0; inner.capabilities().frame_capacity];
        let port = ReplayPort {
            inner,
            ctl: Arc::clone(&ctl),
            stand,
            ethertype,
            daemon_next: None,
            peer_next: None,
            rec_request: None,
            rec_floor: 0,
            rec_data: Vec::new(),
            rec_data_tag: 0,
            rec_completion: None,
            asked: std::collections::VecDeque::new(),
            replay: None,
            scratch,
        };
        (port, ctl)
    }

    fn phase(&self) -> u8 {
        self.ctl.phase.load(Ordering::Acquire)
    }

    /// A frame the live peer sent: follow its sequence numbers, keep what the templates need.
    fn record_peer(&mut self, bytes: &[u8]) {
        let Ok(frame) = Frame::new_checked(bytes, self.ethertype) else { return };
        if let Some(s) = frame.seq() {
            if self.peer_next.is_none_or(|n| at_or_after(s, n)) {
                self.peer_next = Some(s.wrapping_add(1));
            }
        }
        let Ok(msg) = frame.parse() else { return };
        match (self.stand, msg) {
            (Stand::Initiator, Message::Request(r)) => {
                self.ctl.recorded_tag.fetch_max(r.tag, Ordering::AcqRel);
                self.rec_floor = self.rec_floor.max(r.floor);
                if r.op == Op::Read {
                    self.rec_request = Some(bytes.to_vec());
                    self.ctl.recorded.fetch_add(1, Ordering::AcqRel);
                }
            }
            (Stand::Target, Message::Data(d)) if d.header.seg_count <= MAX_SEGMENTS => {
                let h = d.header;
                if h.tag != self.rec_data_tag || self.rec_data.len() != h.seg_count as usize {
                    self.rec_data = vec![None; h.seg_count as usize];
                    self.rec_data_tag = h.tag;
                }
                if let Some(slot) = self.rec_data.get_mut(h.seg_index as usize) {
                    *slot = Some(bytes.to_vec());
                }
            }
            (Stand::Target, Message::Completion(c)) => {
                let whole = !self.rec_data.is_empty() && self.rec_data.iter().all(Option::is_some);
                if c.status == Status::Ok && c.tag == self.rec_data_tag && whole {
                    self.rec_completion = Some(bytes.to_vec());
                    self.ctl.recorded.fetch_add(1, Ordering::AcqRel);
                }
            }
            _ => {}
        }
    }

    /// A frame the daemon sent (headers at least): follow its sequence numbers; in the replay
    /// phase, count its completions or note its requests.
    fn observe_daemon(&mut self, bytes: &[u8], replaying: bool) {
        if bytes.len() < ETH_HEADER_LEN + layout::seq::END {
            return;
        }
        let m = &bytes[ETH_HEADER_LEN..];
        let kind = m[layout::common::KIND];
        let sequenced = [Kind::Request, Kind::Completion, Kind::Data].iter().any(|k| *k as u8 == kind);
        if !sequenced {
            return;
        }
        let be32 = |f: std::ops::Range<usize>| u32::from_be_bytes(m[f].try_into().expect("4 bytes"));
        let s = be32(layout::seq::SEQ);
        let new = self.daemon_next.is_none_or(|n| at_or_after(s, n));
        if new {
            self.daemon_next = Some(s.wrapping_add(1));
        }
        match self.stand {
            Stand::Initiator if kind == Kind::Completion as u8 && m.len() >= layout::completion::END => {
                let tag = u64::from_be_bytes(m[layout::completion::TAG].try_into().expect("8 bytes"));
                if !replaying {
                    self.ctl.recorded_tag.fetch_max(tag, Ordering::AcqRel);
                    return;
                }
                if !new {
                    return; // a retransmission
                }
                let status = u16::from_be_bytes(m[layout::completion::STATUS].try_into().expect("2 bytes"));
                let remq = u16::from_be_bytes(m[layout::completion::REMQ].try_into().expect("2 bytes"));
                if let Some(Replay::Requests { free, plan, .. }) = &mut self.replay {
                    if (remq as usize) < plan.window as usize {
                        free.push_back(remq);
                    }
                    if status == Status::Ok as u16 {
                        let done = self.ctl.completed.fetch_add(1, Ordering::AcqRel) + 1;
                        if done == plan.requests {
                            self.ctl.finish();
                        }
                    } else {
                        self.ctl.failed.fetch_add(1, Ordering::AcqRel);
                    }
                }
            }
            Stand::Target if kind == Kind::Request as u8 && replaying && new => {
                let Ok(frame) = Frame::new_checked(bytes, self.ethertype) else { return };
                match frame.parse() {
                    Ok(Message::Request(r)) if self.answers(&r) && self.asked.len() < MAX_ASKED => {
                        self.asked.push_back(Asked { remq: r.remq, damq: r.damq, tag: r.tag, sent: 0 })
                    }
                    _ => {
                        self.ctl.failed.fetch_add(1, Ordering::AcqRel);
                    }
                }
            }
            _ => {}
        }
    }

    /// Whether the recorded response fits request `r` (a READ of the recorded length).
    fn answers(&self, r: &Request) -> bool {
        let length: usize = self.rec_data.iter().flatten().map(|d| d.len() - tyche_wire::DATA_FRAME_OVERHEAD).sum();
        r.op == Op::Read && r.length as usize == length
    }

    /// Builds the templates from what was recorded, once the plan is there.
    fn arm(&mut self) {
        if self.replay.is_some() {
            return;
        }
        let Some(plan) = *self.ctl.plan.lock().expect("plan lock") else { return };
        let built = match self.stand {
            Stand::Initiator => self.request_templates(plan),
            Stand::Target => self.response_templates(plan),
        };
        self.replay = Some(built.unwrap_or_else(|e| {
            *self.ctl.error.lock().expect("error lock") = Some(e);
            Replay::Broken
        }));
    }

    fn request_templates(&self, plan: ReplayPlan) -> Result<Replay, String> {
        let rec = self.rec_request.as_ref().ok_or("no READ request was recorded in the live phase")?;
        let frame = Frame::new_checked(&rec[..], self.ethertype).map_err(|e| format!("recorded request: {e}"))?;
        let Ok(Message::Request(r)) = frame.parse() else { return Err("the recorded frame is no request".into()) };
        if plan.window == 0 || plan.window > MAX_WINDOW || plan.tag_stride == 0 || plan.span < r.length as u64 {
            return Err(format!("bad plan {plan:?}"));
        }
        if self.peer_next.is_none() {
            return Err("no sequence number recorded".into());
        }
        let env = Envelope::of(&frame);
        let templates = (0..plan.window)
            .map(|i| {
                let mut buf = vec![0; self.inner.capabilities().frame_capacity];
                let q = Request { seq: Seq { seq: 0, ack: 0 }, remq: i, damq: i, tag: r.floor, fua: false, ..r };
                let len = Message::Request(q).emit(&env, &mut buf);
                buf.truncate(len);
                buf
            })
            .collect();
        Ok(Replay::Requests {
            templates,
            free: (0..plan.window).collect(),
            next_tag: plan.first_tag,
            stride: plan.tag_stride,
            length: r.length as u64,
            span: plan.span - plan.span % r.length as u64,
            next_offset: 0,
            plan,
        })
    }

    fn response_templates(&self, plan: ReplayPlan) -> Result<Replay, String> {
        let completion = self.rec_completion.clone().ok_or("no whole read response was recorded in the live phase")?;
        let data: Vec<Vec<u8>> = self.rec_data.iter().flatten().cloned().collect();
        if self.peer_next.is_none() {
            return Err("no sequence number recorded".into());
        }
        let _ = plan;
        Ok(Replay::Responses { data, completion, done_pending: false })
    }

    /// Replay phase: hands the daemon up to `budget` frames.
    fn deliver(&mut self, budget: usize, on_frame: &mut dyn FnMut(&[u8])) -> usize {
        self.arm();
        let ack = self.daemon_next.unwrap_or(0);
        let mut n = 0;
        let (Some(peer_next), Some(replay)) = (self.peer_next.as_mut(), self.replay.as_mut()) else { return 0 };
        match replay {
            Replay::Requests { templates, free, next_tag, stride, length, span, next_offset, plan } => {
                while n < budget && self.ctl.delivered.load(Ordering::Relaxed) < plan.requests {
                    let Some(i) = free.pop_front() else { break };
                    let t = &mut templates[i as usize];
                    put_u32(t, layout::seq::SEQ, *peer_next);
                    put_u32(t, layout::seq::ACK, ack);
                    put_u64(t, layout::request::TAG, *next_tag);
                    put_u64(t, layout::request::OFFSET, *next_offset);
                    *peer_next = peer_next.wrapping_add(1);
                    *next_tag += *stride;
                    *next_offset = (*next_offset + *length) % *span;
                    self.ctl.delivered.fetch_add(1, Ordering::Relaxed);
                    on_frame(t);
                    n += 1;
                }
            }
            Replay::Responses { data, completion, done_pending } => {
                if *done_pending && self.asked.is_empty() {
                    // The daemon came back for more after the responses delivered so far: it
                    // handled them all.
                    *done_pending = false;
                    self.ctl.stamp(self.ctl.delivered.load(Ordering::Relaxed));
                }
                while n < budget {
                    let Some(a) = self.asked.front_mut() else { break };
                    let t = match data.get_mut(a.sent) {
                        Some(d) => {
                            put_u16(d, layout::data::DAMQ, a.damq);
                            put_u64(d, layout::data::TAG, a.tag);
                            d
                        }
                        None => {
                            put_u16(completion, layout::completion::REMQ, a.remq);
                            put_u16(completion, layout::completion::DAMQ, a.damq);
                            put_u64(completion, layout::completion::TAG, a.tag);
                            &mut *completion
                        }
                    };
                    put_u32(t, layout::seq::SEQ, *peer_next);
                    put_u32(t, layout::seq::ACK, ack);
                    *peer_next = peer_next.wrapping_add(1);
                    on_frame(t);
                    n += 1;
                    a.sent += 1;
                    if a.sent > data.len() {
                        self.asked.pop_front();
                        self.ctl.delivered.fetch_add(1, Ordering::Release);
                        *done_pending = true;
                    }
                }
            }
            Replay::Broken => {}
        }
        n
    }

    /// Hold and replay phases: takes what the daemon sends (written into a scratch buffer,
    /// looked at, dropped).
    fn swallow(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> usize {
        let replaying = self.phase() == REPLAY || self.stand == Stand::Target;
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut n = 0;
        while n < budget {
            let len = match fill(&mut scratch) {
                None => break,
                Some(Sent::Here(0)) => continue,
                Some(Sent::Here(len)) => len,
                Some(Sent::Chunk { header, .. }) => header,
            };
            self.observe_daemon(&scratch[..len], replaying);
            n += 1;
        }
        self.scratch = scratch;
        n
    }
}

impl FrameTransport for ReplayPort {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn receive(&mut self, budget: usize, rx: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        match self.phase() {
            LIVE => {
                let mut seen = Vec::new();
                let n = self.inner.receive(budget, rx, &mut |pieces, lease| {
                    let mut copy = Vec::new();
                    tyche_transport::gather(pieces, &mut copy);
                    seen.push(copy);
                    on_frame(pieces, lease)
                })?;
                for f in seen {
                    self.record_peer(&f);
                }
                Ok(n)
            }
            HOLD => Ok(0),
            // Replayed frames are never lent: they are rewritten for the next request.
            _ => Ok(self.deliver(budget, &mut |bytes| {
                on_frame(&[bytes], None);
            })),
        }
    }

    fn release(&mut self, lease: Lease) {
        self.inner.release(lease)
    }

    fn leases_out(&self) -> usize {
        self.inner.leases_out()
    }

    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        if self.phase() != LIVE {
            return Ok(self.swallow(budget, fill));
        }
        let mut seen = Vec::new();
        let n = self.inner.transmit(budget, &mut |buf| {
            let sent = fill(buf)?;
            let len = match sent {
                Sent::Here(len) => len,
                Sent::Chunk { header, .. } => header,
            };
            seen.push(buf[..len].to_vec());
            Some(sent)
        })?;
        for f in seen {
            self.observe_daemon(&f, false);
        }
        Ok(n)
    }

    fn lend_tx_chunks(&mut self, max: usize) -> Vec<TxChunk> {
        self.inner.lend_tx_chunks(max)
    }

    fn tx_chunks_in_flight(&mut self) -> Vec<u64> {
        self.inner.tx_chunks_in_flight()
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tyche_transport::{FrameTransportExt, MemLink};
    use tyche_wire::{Completion, MacAddr, DEFAULT_ETHERTYPE};

    fn env(src: MacAddr, dst: MacAddr) -> Envelope {
        Envelope { dst, src, ethertype: DEFAULT_ETHERTYPE, channel: 3, session: 0x77 }
    }

    fn frame(msg: Message<'_>, env: &Envelope) -> Vec<u8> {
        let mut buf = vec![0; 4096];
        let len = msg.emit(env, &mut buf);
        buf.truncate(len);
        buf
    }

    fn send(port: &mut dyn FrameTransport, f: &[u8]) {
        let mut once = Some(f);
        port.send(1, &mut |buf| {
            let f = once.take()?;
            buf[..f.len()].copy_from_slice(f);
            Some(f.len())
        })
        .unwrap();
    }

    fn received(port: &mut ReplayPort, budget: usize) -> Vec<Message<'static>> {
        let mut out = Vec::new();
        port.recv(budget, &mut |b| {
            let f = Frame::new_checked(b, DEFAULT_ETHERTYPE).unwrap();
            let m = f.parse().unwrap();
            // Only fixed-size kinds are compared here: keep them by value.
            out.push(match m {
                Message::Request(r) => Message::Request(r),
                Message::Completion(c) => Message::Completion(c),
                other => panic!("unexpected {other:?}"),
            });
        })
        .unwrap();
        out
    }

    #[test]
    fn standing_in_for_the_initiator_it_replays_requests_as_completions_free_their_slots() {
        let (ini, tgt) = (MacAddr::local(1), MacAddr::local(2));
        let (mut live, daemon_end) = MemLink::pair((ini, tgt), 1500, 1514, 16);
        let (mut port, ctl) = ReplayPort::initiator(daemon_end, DEFAULT_ETHERTYPE);
        // Live: the real initiator's READ (seq 4, tag 9), the target's completion (seq 6).
        let req = Request {
            seq: Seq { seq: 4, ack: 0 },
            op: Op::Read,
            fua: false,
            remq: 5,
            damq: 7,
            home: 0,
            tag: 9,
            floor: 8,
            offset: 512,
            length: 1024,
        };
        send(&mut live, &frame(Message::Request(req), &env(ini, tgt)));
        assert_eq!(received(&mut port, 8).len(), 1);
        let done = Completion { seq: Seq { seq: 6, ack: 5 }, status: Status::Ok, remq: 5, damq: 7, tag: 9 };
        send(&mut port, &frame(Message::Completion(done), &env(tgt, ini)));
        assert_eq!((ctl.recorded(), ctl.recorded_tag()), (1, 9));

        ctl.hold();
        assert!(received(&mut port, 8).is_empty(), "held: nothing from the live peer");
        ctl.replay(ReplayPlan { requests: 3, window: 2, first_tag: 20, tag_stride: 2, span: 2048 });
        let got = received(&mut port, 8);
        let reqs: Vec<Request> = got
            .iter()
            .map(|m| match m {
                Message::Request(r) => *r,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(reqs.len(), 2, "the window holds two");
        assert_eq!(reqs.iter().map(|r| (r.seq.seq, r.seq.ack)).collect::<Vec<_>>(), [(5, 7), (6, 7)]);
        assert_eq!(reqs.iter().map(|r| (r.remq, r.damq, r.tag)).collect::<Vec<_>>(), [(0, 0, 20), (1, 1, 22)]);
        assert_eq!(
            reqs.iter().map(|r| (r.offset, r.floor, r.length)).collect::<Vec<_>>(),
            [(0, 8, 1024), (1024, 8, 1024)]
        );
        assert!(received(&mut port, 8).is_empty(), "no slot free");
        // The target completes slot 1: the third request goes out in it, acknowledging seq 7.
        let c = Completion { seq: Seq { seq: 7, ack: 7 }, status: Status::Ok, remq: 1, damq: 1, tag: 22 };
        send(&mut port, &frame(Message::Completion(c), &env(tgt, ini)));
        let got = received(&mut port, 8);
        let Message::Request(r) = got[0] else { panic!() };
        assert_eq!((r.seq.seq, r.seq.ack, r.remq, r.tag, r.offset), (7, 8, 1, 24, 0));
        assert_eq!((ctl.delivered(), ctl.completed(), ctl.failed()), (3, 1, 0));
        // A retransmitted completion counts nothing; a refusal is a failure; the last one ends it.
        send(&mut port, &frame(Message::Completion(c), &env(tgt, ini)));
        let refused = Completion { seq: Seq { seq: 8, ack: 8 }, status: Status::Invalid, remq: 0, damq: 0, tag: 20 };
        send(&mut port, &frame(Message::Completion(refused), &env(tgt, ini)));
        assert_eq!((ctl.completed(), ctl.failed()), (1, 1));
        assert!(ctl.finished_at().is_none());
        let last = Completion { seq: Seq { seq: 9, ack: 8 }, status: Status::Ok, remq: 1, damq: 1, tag: 24 };
        send(&mut port, &frame(Message::Completion(last), &env(tgt, ini)));
        assert_eq!(ctl.completed(), 2);
        assert!(received(&mut port, 8).is_empty(), "the plan's requests are all sent");
    }

    #[test]
    fn a_plan_without_a_recording_is_an_error_not_a_panic() {
        let (_live, daemon_end) = MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 1500, 1514, 16);
        let (mut port, ctl) = ReplayPort::initiator(daemon_end, DEFAULT_ETHERTYPE);
        ctl.replay(ReplayPlan { requests: 3, window: 2, first_tag: 1, tag_stride: 1, span: 4096 });
        assert!(received(&mut port, 8).is_empty());
        assert!(ctl.error().is_some_and(|e| e.contains("no READ request")), "{:?}", ctl.error());
    }

    #[test]
    fn standing_in_for_the_target_it_answers_each_new_read_with_the_recorded_response() {
        let (ini, tgt) = (MacAddr::local(1), MacAddr::local(2));
        let (daemon_end, mut live) = MemLink::pair((ini, tgt), 9000, 9014, 16);
        let (mut port, ctl) = ReplayPort::target(daemon_end, DEFAULT_ETHERTYPE);
        // Live: a read of 1024 bytes answered in two segments and a completion (seq 0..=2).
        let e = env(tgt, ini);
        for i in 0..2u16 {
            let h = tyche_wire::DataHeader {
                seq: Seq { seq: i as u32, ack: 1 },
                damq: 4,
                seg_index: i,
                seg_count: 2,
                tag: 11,
                offset: 512 * i as u32,
            };
            let mut buf = vec![0xab; 4096];
            let len = h.emit_in_place(&e, 512, &mut buf);
            buf.truncate(len);
            send(&mut live, &buf);
        }
        let c = Completion { seq: Seq { seq: 2, ack: 1 }, status: Status::Ok, remq: 3, damq: 4, tag: 11 };
        send(&mut live, &frame(Message::Completion(c), &e));
        let mut n = 0;
        port.recv(8, &mut |_| n += 1).unwrap();
        assert_eq!((n, ctl.recorded()), (3, 1));
        ctl.hold();
        // The initiator asks (seq 1) in the hold; a retransmission of it is not asked again.
        let ask = |seq, tag, op, length| Request {
            seq: Seq { seq, ack: 3 },
            op,
            fua: false,
            remq: 9,
            damq: 8,
            home: 0,
            tag,
            floor: 1,
            offset: 0,
            length,
        };
        let ie = env(ini, tgt);
        send(&mut port, &frame(Message::Request(ask(1, 40, Op::Read, 1024)), &ie));
        send(&mut port, &frame(Message::Request(ask(1, 40, Op::Read, 1024)), &ie));
        let mut n = 0;
        port.recv(8, &mut |_| n += 1).unwrap();
        assert_eq!(n, 0, "held");
        ctl.replay(ReplayPlan { requests: 1, window: 1, first_tag: 0, tag_stride: 1, span: 1 << 20 });
        let mut got = Vec::new();
        port.recv(8, &mut |b| {
            let f = Frame::new_checked(b, DEFAULT_ETHERTYPE).unwrap();
            got.push(match f.parse().unwrap() {
                Message::Data(d) => (d.header.seq.seq, d.header.seq.ack, d.header.damq, d.header.tag, d.payload[0]),
                Message::Completion(c) => (c.seq.seq, c.seq.ack, c.remq, c.tag, c.status as u8),
                other => panic!("unexpected {other:?}"),
            });
        })
        .unwrap();
        assert_eq!(got, [(3, 2, 8, 40, 0xab), (4, 2, 8, 40, 0xab), (5, 2, 9, 40, 0)]);
        assert_eq!((ctl.delivered(), ctl.completed()), (1, 0));
        // The next call finds nothing left: the initiator handled the response.
        port.recv(8, &mut |_| panic!("nothing asked")).unwrap();
        assert_eq!(ctl.completed(), 1);
        assert!(ctl.finished_at().is_some());
        // A write cannot be answered: counted, not answered.
        send(&mut port, &frame(Message::Request(ask(2, 41, Op::Write, 1024)), &ie));
        assert_eq!(ctl.failed(), 1);
    }
}
