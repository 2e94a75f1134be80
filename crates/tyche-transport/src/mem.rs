use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use nix::sys::eventfd::{EfdFlags, EventFd};

use tyche_wire::MacAddr;

use std::sync::atomic::{AtomicU8, Ordering};

use crate::{Capabilities, ChunkState, FrameTransport, Lease, OnLentFrame, Rx, Sent, TxChunk, TxPiece, MAX_PIECES};

/// Bytes of filler between the pieces of a frame a [`MemPort`] splits ([`MemPort::set_pieces`]),
/// so that a receiver reading past a piece's end reads filler, not the next piece.
const PIECE_GAP: usize = 64;
/// The filler's byte.
const FILLER: u8 = 0xEE;

/// Memory of one transmit chunk a [`MemPort`] lends: bytes a holder may write through raw
/// pointers (atomic bytes, so a write from another thread is never a data race on our side).
type ChunkMemory = Arc<Box<[AtomicU8]>>;

/// One direction of an in-memory link: a bounded queue of frames with a pool of spare buffers so
/// that steady-state traffic allocates nothing. Buffers keep their full capacity (a frame's length
/// travels beside it), so they are zeroed once, when first allocated, never per frame.
///
/// A lane also has an eventfd that is readable whenever frames wait in it (the receiving port's
/// [`FrameTransport::readiness_fd`]), so a runtime sleeps in `poll(2)` on an in-memory link as
/// on a NIC's socket instead of waking every millisecond to look.
#[derive(Debug, Default)]
struct Lane {
    frames: VecDeque<(Vec<u8>, usize)>,
    spare: Vec<Vec<u8>>,
    /// Readable while `frames` is not empty: written when the first frame arrives in an empty
    /// lane, read (reset) when a receiver finds the lane empty, both under the lane's lock, so
    /// a frame is never waiting behind a reset descriptor. `None` when the process could not
    /// create one (out of descriptors): the port then has no readiness descriptor, and runtimes
    /// poll it on a short timer as they do any transport without one.
    ready: Option<Arc<EventFd>>,
    /// Whether `ready` was written and not reset since: a system call only when it changes,
    /// not on every frame or every look at an empty lane.
    signalled: bool,
}

impl Lane {
    fn new() -> Lane {
        let ready = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK).ok().map(Arc::new);
        Lane { ready, ..Lane::default() }
    }

    /// Queues a frame, signalling the descriptor when the lane was empty.
    fn push(&mut self, frame: Vec<u8>, len: usize) {
        if !self.signalled {
            if let Some(ready) = &self.ready {
                // Non-blocking; fails only once the counter is saturated, readable all the same.
                let _ = ready.write(1);
                self.signalled = true;
            }
        }
        self.frames.push_back((frame, len));
    }

    /// The oldest frame; when there is none, resets the descriptor.
    fn pop(&mut self) -> Option<(Vec<u8>, usize)> {
        let frame = self.frames.pop_front();
        if frame.is_none() && self.signalled {
            if let Some(ready) = &self.ready {
                // Non-blocking; the counter is not 0, as `signalled` says.
                let _ = ready.read();
                self.signalled = false;
            }
        }
        frame
    }
}

/// An in-memory point-to-point Ethernet link between two [`MemPort`]s, for examples, benches
/// and tests that need no privileges. It never loses or reorders frames; wrap a port in a
/// [`crate::FaultInjector`] for that. A full queue drops the frame, as a NIC ring would.
#[derive(Debug)]
pub struct MemLink;

impl MemLink {
    /// Two connected ports with the given MTU, per-buffer capacity and queue depth (frames per
    /// direction).
    pub fn pair(macs: (MacAddr, MacAddr), mtu: usize, frame_capacity: usize, depth: usize) -> (MemPort, MemPort) {
        assert!(depth > 0 && frame_capacity >= tyche_wire::ETH_MIN_FRAME_LEN);
        let ab = Arc::new(Mutex::new(Lane::new()));
        let ba = Arc::new(Mutex::new(Lane::new()));
        let port = |mac, tx: &Arc<Mutex<Lane>>, rx: &Arc<Mutex<Lane>>| MemPort {
            ready: rx.lock().expect("a new lane").ready.clone(),
            mac,
            mtu,
            frame_capacity,
            depth,
            tx: Arc::clone(tx),
            rx: Arc::clone(rx),
            dropped: 0,
            lend_limit: 0,
            lent: HashMap::new(),
            next_lease: 0,
            tx_lend_limit: 0,
            tx_lent: HashMap::new(),
            piece: None,
            too_many_pieces: 0,
        };
        (port(macs.0, &ab, &ba), port(macs.1, &ba, &ab))
    }
}

/// One end of a [`MemLink`].
#[derive(Debug)]
pub struct MemPort {
    /// The receive lane's descriptor ([`Lane::ready`]).
    ready: Option<Arc<EventFd>>,
    mac: MacAddr,
    mtu: usize,
    frame_capacity: usize,
    depth: usize,
    tx: Arc<Mutex<Lane>>,
    rx: Arc<Mutex<Lane>>,
    dropped: u64,
    /// Frames that may be lent at once ([`FrameTransportExt::recv_lend`](crate::FrameTransportExt::recv_lend)); 0: none.
    lend_limit: usize,
    /// Frames lent and not yet released, by lease id.
    lent: HashMap<u64, Arc<Vec<u8>>>,
    next_lease: u64,
    /// Transmit chunks that may be lent for good ([`FrameTransport::lend_tx_chunks`]).
    tx_lend_limit: usize,
    /// Transmit chunks lent, by id.
    tx_lent: HashMap<u64, (ChunkMemory, Arc<ChunkState>)>,
    /// Simulated multi-buffer frames ([`MemPort::set_pieces`]): bytes per piece.
    piece: Option<usize>,
    /// Frames dropped on receipt for needing more than [`MAX_PIECES`] pieces.
    too_many_pieces: u64,
}

impl MemPort {
    /// Frames this port could not queue because the peer's queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Lets [`FrameTransportExt::recv_lend`](crate::FrameTransportExt::recv_lend) lend up to `frames` received frames at once (none by
    /// default: a receiver then copies, as over TCP).
    pub fn set_lending(&mut self, frames: usize) {
        self.lend_limit = frames;
    }

    /// Lets [`FrameTransport::lend_tx_chunks`] lend up to `chunks` transmit chunks for good
    /// (none by default). A frame sent from a chunk is copied out of it when sent, so no chunk
    /// is ever in flight.
    pub fn set_tx_lending(&mut self, chunks: usize) {
        self.tx_lend_limit = chunks;
    }

    /// Simulates a multi-buffer link whose buffers hold `piece` bytes of frame (a test option):
    /// [`FrameTransportExt::recv_lend`](crate::FrameTransportExt::recv_lend) hands over a longer frame in pieces of `piece` bytes, laid
    /// out apart from each other with filler between them (so a receiver that reads one piece
    /// past its end reads filler), under one lease over all of them; a frame that needs more
    /// than [`MAX_PIECES`] pieces is dropped and counted ([`MemPort::too_many_pieces`]). Transmit
    /// chunks lent afterwards are groups of pieces of `piece` bytes, apart from each other, that
    /// a frame fills in order. `recv` still hands over whole frames.
    pub fn set_pieces(&mut self, piece: usize) {
        assert!(piece >= crate::MIN_FIRST_PIECE, "the first piece holds the headers");
        self.piece = Some(piece);
    }

    /// Frames dropped on receipt because they would need more than [`MAX_PIECES`] pieces.
    pub fn too_many_pieces(&self) -> u64 {
        self.too_many_pieces
    }
}

impl FrameTransport for MemPort {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(self.frame_capacity, self.mtu, self.mac)
    }

    fn receive(&mut self, budget: usize, rx: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        match rx {
            Rx::Whole => self.recv_whole(budget, on_frame),
            // The pieces as lent (when [`MemPort::set_pieces`] cuts frames), every lease given back.
            Rx::Pieces => self.recv_lent(budget, &mut |pieces, lease| {
                on_frame(pieces, None);
                lease
            }),
            Rx::Lend => self.recv_lent(budget, on_frame),
        }
    }

    fn release(&mut self, lease: Lease) {
        let frame = self.lent.remove(&lease.id()).expect("a lease this port lent");
        assert!(Arc::ptr_eq(&(Arc::clone(&frame) as Arc<dyn std::any::Any + Send + Sync>), lease.memory()));
        drop(lease);
        self.recycle(frame);
    }

    fn leases_out(&self) -> usize {
        self.lent.len()
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.ready.as_deref().map(AsFd::as_fd)
    }

    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        let chunks = std::mem::take(&mut self.tx_lent);
        let (piece, capacity) = (self.piece, self.frame_capacity);
        let r = self.send_here(budget, &mut |buf| match fill(buf)? {
            Sent::Here(len) => Some(len),
            Sent::Chunk { id, header, len } => {
                let (chunk, state) = chunks.get(&id).expect("a chunk this port lent");
                assert!(state.begin_send(), "chunk {id} is sent while its sender writes it");
                // Where each piece of the chunk starts, and how much it holds.
                let (cap, stride) = match piece {
                    Some(p) => (p, p + PIECE_GAP),
                    None => (chunk.len(), chunk.len()),
                };
                assert!(header <= len && header <= cap && len <= capacity, "a frame within its chunk");
                for (c, b) in chunk[..header].iter().zip(&buf[..header]) {
                    c.store(*b, Ordering::Relaxed);
                }
                for (i, out) in buf[..len].chunks_mut(cap).enumerate() {
                    let at = i * stride;
                    let n = out.len();
                    for (b, c) in out.iter_mut().zip(&chunk[at..at + n]) {
                        *b = c.load(Ordering::Relaxed);
                    }
                }
                // Copied out: the frame is sent, the chunk is its sender's again.
                state.end_send();
                Some(len)
            }
        });
        self.tx_lent = chunks;
        r
    }

    fn lend_tx_chunks(&mut self, max: usize) -> Vec<TxChunk> {
        let n = max.min(self.tx_lend_limit.saturating_sub(self.tx_lent.len()));
        let (cap, count) = match self.piece {
            Some(p) if p < self.frame_capacity => (p, self.frame_capacity.div_ceil(p)),
            _ => (self.frame_capacity, 1),
        };
        if count > MAX_PIECES {
            return Vec::new();
        }
        (0..n)
            .map(|_| {
                let id = self.next_lease;
                self.next_lease += 1;
                let stride = if count > 1 { cap + PIECE_GAP } else { cap };
                let mem: ChunkMemory = Arc::new((0..count * stride).map(|_| AtomicU8::new(FILLER)).collect());
                let addr = mem.as_ptr() as usize;
                let pieces: Vec<TxPiece> =
                    (0..count).map(|i| TxPiece { addr: addr + i * stride, capacity: cap }).collect();
                // SAFETY: the Arc keeps the chunk's bytes (atomics: this port reads and writes
                // them through shared references, while it sends); the pieces lie apart within
                // this chunk's own allocation; this port touches them only in `transmit`,
                // between begin_send and end_send on the chunk's state.
                #[allow(unsafe_code)]
                let chunk =
                    unsafe { TxChunk::new_pieces(id, &pieces, Arc::clone(&mem) as _) }.expect("1 to MAX_PIECES pieces");
                self.tx_lent.insert(id, (mem, Arc::clone(chunk.state())));
                chunk
            })
            .collect()
    }
}

impl MemPort {
    fn recv_whole(&mut self, budget: usize, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        let mut n = 0;
        while n < budget {
            // Take one frame out under the lock, hand it over outside it.
            let Some((frame, len)) = self.rx().pop() else {
                break;
            };
            on_frame(&[&frame[..len]], None);
            self.rx.lock().expect("lane poisoned").spare.push(frame);
            n += 1;
        }
        Ok(n)
    }

    fn recv_lent(&mut self, budget: usize, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        let mut n = 0;
        while n < budget {
            let Some((frame, len)) = self.rx().pop() else {
                break;
            };
            n += 1;
            let (frame, cuts) = match self.piece {
                Some(piece) if len > piece => {
                    let count = len.div_ceil(piece);
                    if count > MAX_PIECES {
                        self.too_many_pieces += 1;
                        self.rx.lock().expect("lane poisoned").spare.push(frame);
                        continue;
                    }
                    // Lay the pieces apart, filler between them (a simulation: the copy is the
                    // link's, not the receiver's).
                    let mut apart = self.rx.lock().expect("lane poisoned").spare.pop().unwrap_or_default();
                    apart.clear();
                    apart.resize(count * (piece + PIECE_GAP), FILLER);
                    let mut cuts = [(0usize, 0usize); MAX_PIECES];
                    for (i, part) in frame[..len].chunks(piece).enumerate() {
                        let at = i * (piece + PIECE_GAP);
                        apart[at..at + part.len()].copy_from_slice(part);
                        cuts[i] = (at, part.len());
                    }
                    self.rx.lock().expect("lane poisoned").spare.push(frame);
                    (apart, (cuts, count))
                }
                _ => {
                    let mut cuts = [(0usize, 0usize); MAX_PIECES];
                    cuts[0] = (0, len);
                    (frame, (cuts, 1))
                }
            };
            let (cuts, count) = cuts;
            let mut parts: [&[u8]; MAX_PIECES] = [&[]; MAX_PIECES];
            if self.lent.len() >= self.lend_limit {
                for (p, &(at, l)) in parts.iter_mut().zip(&cuts[..count]) {
                    *p = &frame[at..at + l];
                }
                on_frame(&parts[..count], None);
                self.rx.lock().expect("lane poisoned").spare.push(frame);
                continue;
            }
            // The buffer moves into an Arc the lease shares: its bytes stay put however long
            // the receiver keeps them, even past this port.
            let frame = Arc::new(frame);
            let id = self.next_lease;
            self.next_lease += 1;
            for (p, &(at, l)) in parts.iter_mut().zip(&cuts[..count]) {
                *p = &frame[at..at + l];
            }
            // SAFETY: the Arc keeps the frame's bytes; nothing writes them until the lease
            // comes back (`release` recycles the buffer only then) or is dropped unkept below.
            #[allow(unsafe_code)]
            let lease = unsafe { Lease::new_pieces(parts[..count].iter().map(|p| (id, *p)), Arc::clone(&frame) as _) }
                .expect("1 to MAX_PIECES pieces");
            match on_frame(&parts[..count], Some(lease)) {
                None => {
                    self.lent.insert(id, frame);
                }
                Some(lease) => {
                    drop(lease);
                    self.recycle(frame);
                }
            }
        }
        Ok(n)
    }

    fn send_here(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> io::Result<usize> {
        let mut n = 0;
        while n < budget {
            let mut buf = {
                let mut lane = self.tx.lock().expect("lane poisoned");
                if lane.frames.len() >= self.depth {
                    break;
                }
                lane.spare.pop().unwrap_or_default()
            };
            if buf.len() != self.frame_capacity {
                buf.resize(self.frame_capacity, 0);
            }
            let Some(len) = fill(&mut buf) else {
                self.tx.lock().expect("lane poisoned").spare.push(buf);
                break;
            };
            assert!(len <= self.frame_capacity, "frame of {len} bytes overran its buffer");
            let mut lane = self.tx.lock().expect("lane poisoned");
            if len == 0 {
                lane.spare.push(buf);
                continue;
            }
            if lane.frames.len() >= self.depth {
                self.dropped += 1;
                lane.spare.push(buf);
            } else {
                lane.push(buf, len);
            }
            n += 1;
        }
        Ok(n)
    }

    fn rx(&self) -> MutexGuard<'_, Lane> {
        self.rx.lock().expect("lane poisoned")
    }

    /// Puts a buffer back in the spare pool once no lease shares it.
    fn recycle(&mut self, frame: Arc<Vec<u8>>) {
        if let Ok(frame) = Arc::try_unwrap(frame) {
            self.rx.lock().expect("lane poisoned").spare.push(frame);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FrameTransportExt;

    #[test]
    fn frames_cross_in_order_and_full_queue_stops_send() {
        let (mut a, mut b) = MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 1500, 1514, 4);
        let mut next = 0u8;
        let sent = a
            .send(10, &mut |buf| {
                next += 1;
                buf[..60].fill(next);
                Some(60)
            })
            .unwrap();
        assert_eq!(sent, 4, "depth bounds the queue");
        let mut seen = vec![];
        assert_eq!(b.recv(10, &mut |f| seen.push(f[0])).unwrap(), 4);
        assert_eq!(seen, [1, 2, 3, 4]);
        assert_eq!(b.recv(10, &mut |_| panic!("queue is empty")).unwrap(), 0);
        assert_eq!(a.send(10, &mut |_| None).unwrap(), 0);
    }

    /// Whether `port`'s readiness descriptor is readable now.
    fn readable(port: &MemPort) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(port.readiness_fd().expect("a descriptor"), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).expect("poll") == 1
    }

    #[test]
    fn the_readiness_descriptor_is_readable_exactly_while_frames_wait() {
        let (mut a, mut b) = MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 1500, 1514, 8);
        assert!(!readable(&b) && !readable(&a));
        a.send(3, &mut |_| Some(60)).unwrap();
        assert!(readable(&b), "frames wait");
        assert!(!readable(&a), "the other direction is empty");
        // A receiver that stops before the lane is empty leaves it readable.
        assert_eq!(b.recv(2, &mut |_| {}).unwrap(), 2);
        assert!(readable(&b), "a frame still waits");
        assert_eq!(b.recv(8, &mut |_| {}).unwrap(), 1);
        assert!(!readable(&b), "drained");
        a.send(1, &mut |_| Some(60)).unwrap();
        assert!(readable(&b), "a new frame after a drain");
        assert_eq!(b.recv_lend(8, &mut |_, lease| lease).unwrap(), 1);
        assert!(!readable(&b));
    }

    #[test]
    fn lent_frames_stay_put_until_released_and_the_limit_holds() {
        let (mut a, mut b) = MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 1500, 1514, 16);
        b.set_lending(2);
        let mut next = 0u8;
        a.send(4, &mut |buf| {
            next += 1;
            buf[..60].fill(next);
            Some(60)
        })
        .unwrap();
        let mut kept = Vec::new();
        let mut offered = 0;
        b.recv_lend(10, &mut |f, lease| {
            let f = f[0];
            offered += usize::from(lease.is_some());
            match lease {
                Some(l) if f[0] != 2 => {
                    assert!(l.covers(f));
                    kept.push(l);
                    None
                }
                other => other,
            }
        })
        .unwrap();
        // Frame 1 kept, frame 2 given back, frame 3 kept, frame 4 offered none (limit 2).
        assert_eq!((offered, kept.len(), b.leases_out()), (3, 2, 2));
        assert_eq!(kept.iter().map(|l| l.len()).collect::<Vec<_>>(), [60, 60]);
        for l in kept {
            b.release(l);
        }
        assert_eq!(b.leases_out(), 0);
    }

    #[test]
    fn split_frames_come_in_pieces_apart_under_one_lease_and_too_many_are_dropped() {
        let (mut a, mut b) = MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 9000, 9014, 16);
        b.set_lending(4);
        b.set_pieces(3646);
        for len in [100usize, 9014, 8254] {
            a.send(1, &mut |buf| {
                for (i, x) in buf[..len].iter_mut().enumerate() {
                    *x = (i % 251) as u8;
                }
                Some(len)
            })
            .unwrap();
        }
        let mut kept = Vec::new();
        let mut seen = Vec::new();
        b.recv_lend(10, &mut |pieces, lease| {
            let lease = lease.expect("lending");
            assert_eq!(lease.pieces().len(), pieces.len());
            assert_eq!(lease.len(), crate::pieces_len(pieces));
            let buf = lease.memory().downcast_ref::<Vec<u8>>().expect("a MemPort buffer");
            for p in pieces {
                assert!(lease.covers(p));
                // Past a piece's end lies filler, never the next piece.
                let end = p.as_ptr() as usize + p.len() - buf.as_ptr() as usize;
                if pieces.len() > 1 {
                    assert_eq!(buf[end], FILLER);
                }
            }
            let mut whole = Vec::new();
            crate::gather(pieces, &mut whole);
            assert!(whole.iter().enumerate().all(|(i, x)| *x == (i % 251) as u8), "content in order");
            seen.push(pieces.iter().map(|p| p.len()).collect::<Vec<_>>());
            kept.push(lease);
            None
        })
        .unwrap();
        assert_eq!(seen, [vec![100], vec![3646, 3646, 1722], vec![3646, 3646, 962]]);
        assert_eq!(b.leases_out(), 3);
        for l in kept {
            b.release(l);
        }
        assert_eq!(b.leases_out(), 0);
        // A link whose pieces are too small for a frame in MAX_PIECES drops it and counts it.
        b.set_pieces(2048);
        a.send(1, &mut |_| Some(9014)).unwrap();
        assert_eq!(b.recv_lend(10, &mut |_, _| panic!("dropped")).unwrap(), 1);
        assert_eq!(b.too_many_pieces(), 1);
    }

    #[test]
    fn chunk_groups_send_one_frame_from_their_pieces() {
        let (mut a, mut b) = MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 9000, 9014, 16);
        a.set_pieces(3646);
        a.set_tx_lending(2);
        let mut chunks = a.lend_tx_chunks(8);
        assert_eq!(chunks.len(), 2);
        let c = &mut chunks[0];
        assert_eq!(c.pieces().len(), 3);
        assert!(c.capacity() >= 9014);
        // Fill a payload after 62 header bytes across the pieces, as a storage read would.
        let len = 62 + 8192;
        let mut at = 0usize;
        for p in c.write().expect("not being sent").pieces() {
            for (i, byte) in p.iter_mut().enumerate() {
                let pos = at + i;
                if (62..len).contains(&pos) {
                    *byte = (pos % 253) as u8;
                }
            }
            at += p.len();
        }
        let id = c.id();
        let mut once = false;
        a.transmit(4, &mut |buf| {
            if once {
                return None;
            }
            once = true;
            buf[..62].fill(0xAB);
            Some(Sent::Chunk { id, header: 62, len })
        })
        .unwrap();
        let mut got = Vec::new();
        b.recv(4, &mut |f| got = f.to_vec()).unwrap();
        assert_eq!(got.len(), len);
        assert!(got[..62].iter().all(|&x| x == 0xAB));
        assert!(got[62..].iter().enumerate().all(|(i, &x)| x == ((i + 62) % 253) as u8));
    }
}
