//! How Tyche channels move frames, independent of what moves them.
//!
//! [`FrameTransport`] is the boundary between the sans-IO channel engine and the world: AF_XDP
//! sockets (`tyche-xdp`), the TCP baseline, and the in-memory [`MemPort`] used by examples,
//! benches and tests all implement it, so the engine runs unchanged on each. [`FaultInjector`]
//! wraps any transport and drops, duplicates or delays frames from a seeded generator. What the
//! daemons' threads share around their frame loops (the adaptive poller, the wake eventfd, the
//! stats socket) is in `tyche-runtime`; the benches' replay peer is in `tyche-tools`.
//!
//! # Contract
//! - Frames are whole Ethernet frames (header included, FCS excluded). A transport delivers a
//!   frame intact or not at all; it may lose, reorder or duplicate frames.
//! - `receive` and `transmit` never block. A transport that can sleep exposes a file descriptor
//!   through [`FrameTransport::readiness_fd`] for the runtime to wait on.
//! - Buffers handed to the callbacks live in the transport's own memory (a UMEM chunk for
//!   AF_XDP): reading or writing them in place is the zero-copy path.
//! - A receiver may *keep* a received frame instead of copying its bytes out ([`Rx::Lend`]): the
//!   frame's buffer is then lent to it as a [`Lease`] and stays where it is, unchanged, until
//!   [`FrameTransport::release`] gives it back. A transport that cannot lend (or has no buffer to
//!   spare right now) offers no lease, and the receiver copies.
//! - A frame may come in several pieces (a multi-buffer AF_XDP frame over several UMEM chunks,
//!   at most [`MAX_PIECES`]): [`FrameTransport::receive`] hands the receiver the pieces in
//!   order, the first holding at least the Ethernet header and the Tyche headers whenever the
//!   frame is longer than [`MIN_FIRST_PIECE`]; its lease covers every piece. With [`Rx::Whole`]
//!   it hands over one contiguous frame (a transport gathers the pieces for it).
//! - A sender may prepare frames in transmit memory the transport lends it for good
//!   ([`FrameTransport::lend_tx_chunks`]): it writes payloads there ahead of time (a storage read
//!   straight into them), and [`FrameTransport::transmit`] then sends such a chunk after writing
//!   only the headers in front of its payload ([`Sent::Chunk`]). A chunk the kernel still
//!   transmits ([`FrameTransport::tx_chunks_in_flight`]) must be neither rewritten nor sent again:
//!   its [`ChunkState`], shared by the chunk and the transport, refuses a writer
//!   ([`TxChunk::write`]) while it is sent, and a send while a writer holds it.
//! - Lent memory is reached only through borrows: [`Lease::bytes`] and [`Lease::slice`] while the
//!   lease lives, a [`ChunkWriter`]'s pieces while it lives. Only a transport makes a lease or a
//!   chunk, with an `unsafe` constructor whose contract says what it guarantees of the memory
//!   (module `lent`, which holds this crate's unsafe code but for `MemPort`'s calls of those
//!   constructors).
// Unsafe code: `lent` (the lent memory's contracts) and, marked one by one, `MemPort`'s calls of
// its constructors.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod fault;
mod lent;
mod mem;

use std::io;
use std::os::fd::BorrowedFd;

pub use fault::{FaultConfig, FaultInjector, FaultStats};
pub use lent::{ChunkBusy, ChunkState, ChunkWriter, Lease, LeasePiece, TxChunk, TxPiece};
pub use mem::{MemLink, MemPort};
use tyche_wire::MacAddr;

/// A link that moves whole Ethernet frames.
///
/// Nine methods, after smoltcp's `Device` (receive, transmit, capabilities): what the transport
/// is ([`FrameTransport::capabilities`]), receiving ([`FrameTransport::receive`], with the lent
/// receive buffers given back by [`FrameTransport::release`]), transmitting
/// ([`FrameTransport::transmit`], with the transmit memory lent for good by
/// [`FrameTransport::lend_tx_chunks`]), pushing out and sleeping. The shorthands callers use
/// ([`FrameTransportExt::recv`], [`FrameTransportExt::recv_pieces`],
/// [`FrameTransportExt::recv_lend`], [`FrameTransportExt::send`]) are built on them, for every
/// transport alike.
pub trait FrameTransport {
    /// What this transport is: frame size, MTU, address, the memory it owns. For setting up
    /// and for reports, not per frame (a transport may look its memory areas up in the system).
    fn capabilities(&self) -> Capabilities;

    /// Receives up to `budget` frames, calling `on_frame` on each, in place, in arrival order.
    /// Returns how many frames were delivered; zero when none is waiting.
    ///
    /// `rx` says how the receiver takes them: [`Rx::Whole`], each frame in one piece (a
    /// transport gathers a multi-buffer frame for it); [`Rx::Pieces`], a frame that arrived in
    /// several buffers in its pieces (at most [`MAX_PIECES`], in order), sparing the gather's
    /// copy; [`Rx::Lend`], in its pieces and, when the transport can spare the buffers, with a
    /// [`Lease`] on them. `on_frame` keeps a lent frame by keeping the lease (the bytes then stay
    /// at the same address, unchanged, until the lease goes back through
    /// [`FrameTransport::release`]) and returns `None`; it gives the lease back (returns it) to
    /// let the buffers be reused at once. Frames offered without a lease must be copied to be
    /// kept. A transport whose frames are copies anyway (TCP, AF_PACKET) hands every frame
    /// whole, without a lease, whatever `rx` asks.
    fn receive(&mut self, budget: usize, rx: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize>;

    /// Gives back the buffers of a frame kept from [`FrameTransport::receive`] of this
    /// transport, to be reused for receiving.
    fn release(&mut self, lease: Lease) {
        drop(lease);
    }

    /// Frames kept by the receiver and not yet released.
    fn leases_out(&self) -> usize {
        0
    }

    /// Transmits up to `budget` frames. For each free transmit buffer, `fill` writes one frame
    /// at the start of the buffer it is given and answers [`Sent::Here`] with its length (0:
    /// skip this buffer and go on, nothing is sent for it), [`Sent::Chunk`] to send one of the
    /// chunks this transport lent ([`FrameTransport::lend_tx_chunks`]) instead, after copying
    /// the first `header` bytes of that buffer to the start of the chunk's frame, or `None`
    /// when it has nothing more to send (the buffer is then not used). Returns how many frames
    /// were queued; fewer than asked when the transmit ring is full. A transport that lent no
    /// chunk ends the batch at a [`Sent::Chunk`] with an `InvalidInput` error (the frames filled
    /// before it were queued; [`transmit_here`] does that for it).
    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize>;

    /// Hands the caller up to `max` transmit chunks for good (none by default): memory it
    /// prepares frames in ahead of time and sends with [`Sent::Chunk`]. Where frames span
    /// several buffers, each chunk is a group of them ([`TxChunk::pieces`]).
    fn lend_tx_chunks(&mut self, max: usize) -> Vec<TxChunk> {
        let _ = max;
        Vec::new()
    }

    /// Ids of the lent transmit chunks the kernel has not finished sending (after taking in
    /// what it finished).
    fn tx_chunks_in_flight(&mut self) -> Vec<u64> {
        Vec::new()
    }

    /// Pushes queued frames out (a kernel wake-up where the transport needs one) and reclaims
    /// buffers of frames already sent.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// A descriptor that becomes readable when frames arrive, for transports that can sleep.
    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

/// What a transport is, for setting up channels over it and for placement reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The largest frame one transmit or receive buffer holds, Ethernet header included.
    pub frame_capacity: usize,
    /// The link MTU (bytes after the Ethernet header).
    pub mtu: usize,
    /// This end's MAC address.
    pub local_mac: MacAddr,
    /// The NUMA node the transport placed its memory on (`None`: none in particular).
    pub numa_node: Option<u32>,
    /// The memory the transport owns for frames (UMEM, rings), for placement reports. The
    /// areas are only described, never to be dereferenced through this.
    pub memory_areas: Vec<MemoryArea>,
}

impl Capabilities {
    /// A transport of `frame_capacity`-byte frames on a link of `mtu` at `local_mac`, with no
    /// memory of its own to report.
    pub fn new(frame_capacity: usize, mtu: usize, local_mac: MacAddr) -> Self {
        Capabilities { frame_capacity, mtu, local_mac, numa_node: None, memory_areas: Vec::new() }
    }
}

/// How a receiver takes frames from [`FrameTransport::receive`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rx {
    /// Each frame in one piece (a multi-buffer frame gathered), never lent.
    Whole,
    /// In its pieces, never lent.
    Pieces,
    /// In its pieces, lent when a spare buffer can take the frame's place.
    Lend,
}

/// The shorthands over [`FrameTransport`], the same for every transport.
pub trait FrameTransportExt: FrameTransport {
    /// Receives up to `budget` frames, each whole, calling `on_frame` on each in place
    /// ([`Rx::Whole`]).
    fn recv(&mut self, budget: usize, on_frame: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        self.receive(budget, Rx::Whole, &mut |pieces, lease| {
            match pieces {
                [bytes] => on_frame(bytes),
                // A transport that gathered nothing (it owes a whole frame): gather here.
                _ => {
                    let mut whole = Vec::new();
                    gather(pieces, &mut whole);
                    on_frame(&whole)
                }
            }
            lease
        })
    }

    /// Receives up to `budget` frames in their pieces, without a lease ([`Rx::Pieces`]).
    fn recv_pieces(&mut self, budget: usize, on_frame: &mut dyn FnMut(&[&[u8]])) -> io::Result<usize> {
        self.receive(budget, Rx::Pieces, &mut |pieces, lease| {
            on_frame(pieces);
            lease
        })
    }

    /// Receives up to `budget` frames in their pieces, with a lease where the transport can
    /// spare the buffers ([`Rx::Lend`]).
    fn recv_lend(&mut self, budget: usize, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        self.receive(budget, Rx::Lend, on_frame)
    }

    /// Transmits up to `budget` frames written in the buffers the transport gives `fill`
    /// ([`FrameTransport::transmit`] with [`Sent::Here`] only): `fill` returns a frame's length,
    /// `Some(0)` to skip the buffer, `None` when it has nothing more to send.
    fn send(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> io::Result<usize> {
        self.transmit(budget, &mut |buf| fill(buf).map(Sent::Here))
    }
}

impl<T: FrameTransport + ?Sized> FrameTransportExt for T {}

/// [`FrameTransport::transmit`] for a transport that lends no transmit chunk: `send` transmits
/// frames from its own buffers (a frame's length from its callback, `None` to stop), and a
/// [`Sent::Chunk`] ends the batch with an `InvalidInput` error naming the chunk (the frames
/// filled before it were queued).
pub fn transmit_here(
    budget: usize,
    fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>,
    send: impl FnOnce(usize, &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> io::Result<usize>,
) -> io::Result<usize> {
    let mut chunk = None;
    let queued = send(budget, &mut |buf| match fill(buf)? {
        Sent::Here(len) => Some(len),
        Sent::Chunk { id, .. } => {
            chunk = Some(id);
            None
        }
    })?;
    match chunk {
        None => Ok(queued),
        Some(id) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("transmit chunk {id}: this transport lent no transmit chunk"),
        )),
    }
}

/// What [`FrameTransport::receive`] calls with each frame: its pieces (one for a frame in one
/// buffer; at most [`MAX_PIECES`], in order) and, when the transport can lend the buffers, a
/// lease on them; returns the lease unless it keeps the frame.
pub type OnLentFrame<'a> = dyn FnMut(&[&[u8]], Option<Lease>) -> Option<Lease> + 'a;

/// Most pieces one frame comes in or goes out in. A 9216-byte MTU frame (9230 bytes with its
/// Ethernet header) over AF_XDP chunks that carry 3646 bytes each is 3 pieces; 4 leaves room for
/// a smaller chunk payload. A transport drops (and counts) a frame in more pieces.
pub const MAX_PIECES: usize = 4;

/// Bytes the first piece of a multi-piece frame holds at least: the Ethernet header and the
/// largest Tyche header in front of a payload (a DATA frame's, 62 bytes), rounded up.
pub const MIN_FIRST_PIECE: usize = 256;

/// The bytes of a frame given in pieces, as one buffer (for receivers that must have the frame
/// in one piece: a sealed channel, a copy kept for later).
pub fn gather(pieces: &[&[u8]], out: &mut Vec<u8>) {
    out.clear();
    for p in pieces {
        out.extend_from_slice(p);
    }
}

/// Total length of a frame given in pieces.
pub fn pieces_len(pieces: &[&[u8]]) -> usize {
    pieces.iter().map(|p| p.len()).sum()
}

/// What a [`FrameTransport::transmit`] callback did with the buffer it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// Send `len` bytes of the buffer (0: skip it, send nothing).
    Here(usize),
    /// Send lent chunk `id` instead: its frame is `len` bytes, of which the first `header` are
    /// to be copied from the buffer (the rest, the payload, is already in the chunk). A chunk
    /// of several pieces ([`TxChunk::pieces`]) is sent as one multi-buffer frame: the frame
    /// fills its pieces in order, each up to its capacity.
    Chunk {
        /// [`TxChunk::id`].
        id: u64,
        /// Bytes of headers to copy from the buffer.
        header: usize,
        /// Frame length.
        len: usize,
    },
}

/// A range of this process's address space that a transport owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryArea {
    /// What it is: `umem`, `rings`, ...
    pub what: &'static str,
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
}

impl<T: FrameTransport + ?Sized> FrameTransport for Box<T> {
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    fn receive(&mut self, budget: usize, rx: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        (**self).receive(budget, rx, on_frame)
    }
    fn release(&mut self, lease: Lease) {
        (**self).release(lease)
    }
    fn leases_out(&self) -> usize {
        (**self).leases_out()
    }
    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        (**self).transmit(budget, fill)
    }
    fn lend_tx_chunks(&mut self, max: usize) -> Vec<TxChunk> {
        (**self).lend_tx_chunks(max)
    }
    fn tx_chunks_in_flight(&mut self) -> Vec<u64> {
        (**self).tx_chunks_in_flight()
    }
    fn flush(&mut self) -> io::Result<()> {
        (**self).flush()
    }
    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        (**self).readiness_fd()
    }
}

/// A small deterministic generator (SplitMix64) for fault injection and simulations, so that a
/// seed replays the same choices on every platform and every version of this crate.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A uniform float in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.next_f64() < p
    }
    /// A uniform integer in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi);
        let span = hi - lo;
        if span == u64::MAX {
            return self.next_u64();
        }
        lo + self.next_u64() % (span + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transport with only the required methods: every default in use.
    struct Plain(Vec<Vec<u8>>);

    impl FrameTransport for Plain {
        fn capabilities(&self) -> Capabilities {
            Capabilities::new(64, 50, MacAddr::local(1))
        }
        fn receive(&mut self, _budget: usize, _rx: Rx, _on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
            Ok(0)
        }
        fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
            transmit_here(budget, fill, |budget, fill| {
                let mut n = 0;
                while n < budget {
                    let mut buf = vec![0; 64];
                    let Some(len) = fill(&mut buf) else { break };
                    buf.truncate(len);
                    self.0.push(buf);
                    n += 1;
                }
                Ok(n)
            })
        }
    }

    #[test]
    fn a_chunk_on_a_transport_that_lent_none_is_an_error() {
        let mut t = Plain(Vec::new());
        let mut k = 0;
        let e = t
            .transmit(4, &mut |buf| {
                k += 1;
                buf[0] = k;
                Some(if k == 2 { Sent::Chunk { id: 7, header: 14, len: 60 } } else { Sent::Here(20) })
            })
            .expect_err("no chunk was lent");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("transmit chunk 7"), "{e}");
        assert_eq!(t.0.len(), 1, "the frame before the chunk was queued");
        assert_eq!(t.transmit(2, &mut |_| Some(Sent::Here(20))).expect("plain frames"), 2);
    }
}
