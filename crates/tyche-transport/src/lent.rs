//! Memory a transport lends: received frames kept in place ([`Lease`]) and transmit memory
//! lent for good ([`TxChunk`]).
//!
//! Only a transport makes these, through `unsafe` constructors whose contracts say what it
//! guarantees about the memory; everyone else reaches the bytes through borrows of the lease or
//! the chunk (`&[u8]` while the lease lives, `&mut [u8]` through a [`ChunkWriter`] while no frame
//! is sent from the chunk), never through addresses. So safe code cannot make a slice of memory
//! that was freed, reused or is being sent. This module holds the crate's unsafe code, apart
//! from `MemPort`'s (and other transports') calls of the constructors.
#![allow(unsafe_code)]

use std::any::Any;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::MAX_PIECES;

/// One buffer of a lent frame ([`Lease::pieces`]): `len` bytes at `addr`, named `id` by the
/// transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LeasePiece {
    /// The transport's name for the buffer.
    pub id: u64,
    /// Address of the piece's first byte.
    pub addr: usize,
    /// Bytes of the frame in it.
    pub len: usize,
}

/// A received frame's buffer, lent by the transport to the receiver that keeps the frame
/// ([`crate::FrameTransport::receive`] with [`crate::Rx::Lend`]).
///
/// While the lease lives, the frame's bytes stay where they are and nothing writes them: the
/// transport does not reuse the buffer until the lease comes back through
/// [`crate::FrameTransport::release`], and the lease holds a reference on the memory the buffer
/// lies in, so the bytes stay mapped even if the transport is dropped first (a storage write
/// still reading them, say). The receiver reads them through [`Lease::bytes`] and
/// [`Lease::slice`], borrows of the lease. A lease is not `Clone`: it goes back once.
///
/// A frame in several pieces (a multi-buffer frame) is lent as one lease over all of them
/// ([`Lease::pieces`], at most [`MAX_PIECES`], held inline: no allocation per frame).
pub struct Lease {
    pieces: [LeasePiece; MAX_PIECES],
    count: u8,
    memory: Arc<dyn Any + Send + Sync>,
}

impl Lease {
    /// For transports: a lease named `id` (the transport's own name for the buffer) on `frame`,
    /// whose memory `memory` keeps alive.
    ///
    /// # Safety
    /// As long as `memory` (any clone of it) lives, `frame`'s bytes stay mapped, and until the
    /// lease is dropped nothing writes them: the transport does not reuse the buffer before the
    /// lease comes back, and hands no `&mut` to those bytes out meanwhile.
    pub unsafe fn new(id: u64, frame: &[u8], memory: Arc<dyn Any + Send + Sync>) -> Lease {
        let mut pieces = [LeasePiece::default(); MAX_PIECES];
        pieces[0] = LeasePiece { id, addr: frame.as_ptr() as usize, len: frame.len() };
        Lease { pieces, count: 1, memory }
    }

    /// For transports: a lease on a frame in several buffers, `(id, bytes)` for each in order,
    /// whose memory `memory` keeps alive. `None` when there are none or more than
    /// [`MAX_PIECES`].
    ///
    /// # Safety
    /// As [`Lease::new`], for every piece.
    pub unsafe fn new_pieces<'b>(
        parts: impl IntoIterator<Item = (u64, &'b [u8])>,
        memory: Arc<dyn Any + Send + Sync>,
    ) -> Option<Lease> {
        let mut pieces = [LeasePiece::default(); MAX_PIECES];
        let mut count = 0;
        for (id, bytes) in parts {
            *pieces.get_mut(count)? = LeasePiece { id, addr: bytes.as_ptr() as usize, len: bytes.len() };
            count += 1;
        }
        (count > 0).then_some(Lease { pieces, count: count as u8, memory })
    }

    /// The transport's name for the (first) buffer.
    pub fn id(&self) -> u64 {
        self.pieces[0].id
    }

    /// Address of the frame's first byte.
    pub fn addr(&self) -> usize {
        self.pieces[0].addr
    }

    /// Length of the frame, all pieces together.
    pub fn len(&self) -> usize {
        self.pieces().iter().map(|p| p.len).sum()
    }

    /// Whether the frame is empty (never, for a frame a transport delivered).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffers of the frame, in order (one unless it is a multi-buffer frame).
    pub fn pieces(&self) -> &[LeasePiece] {
        &self.pieces[..self.count as usize]
    }

    /// The bytes of each piece, in order.
    pub fn bytes(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.pieces().iter().map(|p| {
            // SAFETY: the constructor's contract: the piece's bytes stay mapped and unwritten
            // while the lease lives, and the borrow of `self` keeps it alive.
            unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len) }
        })
    }

    /// The `len` bytes at `addr`, where they lie within one piece of the frame (a payload the
    /// receiver found in it); `None` elsewhere.
    pub fn slice(&self, addr: usize, len: usize) -> Option<&[u8]> {
        let end = addr.checked_add(len)?;
        self.pieces().iter().any(|p| addr >= p.addr && end <= p.addr + p.len).then(|| {
            // SAFETY: within one piece (checked above), whose bytes stay mapped and unwritten
            // while the lease lives (the constructor's contract); the borrow keeps it alive.
            unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
        })
    }

    /// Whether `bytes` lies within one piece of the lent frame.
    pub fn covers(&self, bytes: &[u8]) -> bool {
        self.slice(bytes.as_ptr() as usize, bytes.len()).is_some()
    }

    /// The memory the frame lies in (for transports: to check a lease is theirs).
    pub fn memory(&self) -> &Arc<dyn Any + Send + Sync> {
        &self.memory
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("pieces", &self.pieces()).finish()
    }
}

/// One buffer of a [`TxChunk`]: room for `capacity` bytes of frame at `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TxPiece {
    /// Address of the piece's first byte.
    pub addr: usize,
    /// Bytes of frame it holds.
    pub capacity: usize,
}

/// Whether a lent transmit chunk is with its sender or being sent, shared by the chunk and the
/// transport that lent it: a chunk is written ([`TxChunk::write`]) only while no frame is sent
/// from it, and sent only while nobody writes it, each side checking the other.
#[derive(Debug, Default)]
pub struct ChunkState(AtomicU8);

const IDLE: u8 = 0;
const WRITING: u8 = 1;
const SENDING: u8 = 2;

impl ChunkState {
    /// For transports: a frame goes out from the chunk. `false`, and the state is unchanged,
    /// while its sender writes it (the frame must not be sent) or it is being sent already.
    pub fn begin_send(&self) -> bool {
        self.0.compare_exchange(IDLE, SENDING, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// For transports: the chunk's frame is sent, and the transport (and the kernel) no longer
    /// reads or writes its memory.
    pub fn end_send(&self) {
        self.0.store(IDLE, Ordering::Release);
    }

    /// Whether a frame is being sent from the chunk.
    pub fn sending(&self) -> bool {
        self.0.load(Ordering::Acquire) == SENDING
    }
}

/// [`TxChunk::write`] refused: a frame is being sent from the chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("transmit chunk {0} is being sent and cannot be written")]
pub struct ChunkBusy(pub u64);

/// Transmit memory lent for good to the sender ([`crate::FrameTransport::lend_tx_chunks`]): a
/// frame of up to [`TxChunk::capacity`] bytes. Where one buffer cannot hold a whole frame (a
/// multi-buffer link), a chunk is a group of buffers ([`TxChunk::pieces`], at most
/// [`MAX_PIECES`]) that the frame fills in order and that goes out as one multi-buffer frame.
/// The sender writes it through a [`ChunkWriter`] ([`TxChunk::write`]), which it gets only while
/// no frame is sent from the chunk; the chunk holds a reference on its memory, so it stays
/// mapped while the chunk lives.
pub struct TxChunk {
    id: u64,
    pieces: [TxPiece; MAX_PIECES],
    count: u8,
    memory: Arc<dyn Any + Send + Sync>,
    state: Arc<ChunkState>,
}

impl TxChunk {
    /// For transports: chunk `id` whose frame starts at `frame_addr` and holds `capacity`
    /// bytes, in memory `memory` keeps alive.
    ///
    /// # Safety
    /// As [`TxChunk::new_pieces`], for one piece.
    pub unsafe fn new(id: u64, frame_addr: usize, capacity: usize, memory: Arc<dyn Any + Send + Sync>) -> TxChunk {
        // SAFETY: the caller's promises are those of new_pieces for this one piece.
        unsafe { Self::new_pieces(id, &[TxPiece { addr: frame_addr, capacity }], memory) }.expect("one piece")
    }

    /// For transports: chunk `id` made of several buffers, in frame order. `None` when there
    /// are none or more than [`MAX_PIECES`].
    ///
    /// # Safety
    /// As long as `memory` (any clone of it) lives, each piece's `capacity` bytes at `addr` stay
    /// mapped and writable; the pieces do not overlap each other or any other memory lent or
    /// handed out; and the transport reads or writes them (or lets the kernel do so) only
    /// between [`ChunkState::begin_send`] succeeding on [`TxChunk::state`] and its
    /// [`ChunkState::end_send`].
    pub unsafe fn new_pieces(id: u64, parts: &[TxPiece], memory: Arc<dyn Any + Send + Sync>) -> Option<TxChunk> {
        if parts.is_empty() || parts.len() > MAX_PIECES {
            return None;
        }
        let mut pieces = [TxPiece::default(); MAX_PIECES];
        pieces[..parts.len()].copy_from_slice(parts);
        Some(TxChunk { id, pieces, count: parts.len() as u8, memory, state: Arc::default() })
    }

    /// The transport's name for the chunk.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Address of the frame's first byte.
    pub fn frame_addr(&self) -> usize {
        self.pieces[0].addr
    }

    /// Largest frame the chunk holds (all pieces together).
    pub fn capacity(&self) -> usize {
        self.pieces().iter().map(|p| p.capacity).sum()
    }

    /// The buffers the frame fills, in order (one unless frames span several).
    pub fn pieces(&self) -> &[TxPiece] {
        &self.pieces[..self.count as usize]
    }

    /// The memory the chunk lies in.
    pub fn memory(&self) -> &Arc<dyn Any + Send + Sync> {
        &self.memory
    }

    /// Whether the chunk is with its sender or being sent (for transports: keep a clone).
    pub fn state(&self) -> &Arc<ChunkState> {
        &self.state
    }

    /// Writes the chunk (a storage read straight into it, say): refused while a frame is being
    /// sent from it. While the writer lives, the transport sends nothing from the chunk.
    pub fn write(&mut self) -> Result<ChunkWriter<'_>, ChunkBusy> {
        self.state
            .0
            .compare_exchange(IDLE, WRITING, Ordering::Acquire, Ordering::Relaxed)
            .map_err(|_| ChunkBusy(self.id))?;
        Ok(ChunkWriter { chunk: self })
    }
}

impl std::fmt::Debug for TxChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxChunk").field("id", &self.id).field("pieces", &self.pieces()).finish()
    }
}

/// The sender's hold on a transmit chunk's memory ([`TxChunk::write`]); the transport may send
/// from the chunk again once it is dropped.
#[derive(Debug)]
pub struct ChunkWriter<'a> {
    chunk: &'a mut TxChunk,
}

impl ChunkWriter<'_> {
    /// Each buffer of the chunk, whole and in frame order.
    pub fn pieces(&mut self) -> impl Iterator<Item = &mut [u8]> + '_ {
        self.chunk.pieces[..self.chunk.count as usize].iter().map(|p| {
            // SAFETY: the constructor's contract: the piece is mapped and writable while the
            // chunk lives (borrowed here), overlaps nothing else, and nobody else touches it
            // unless a send began, which the WRITING state held by this writer excludes. The
            // writer is borrowed mutably for the slices' lifetime, so they are the only ones.
            unsafe { std::slice::from_raw_parts_mut(p.addr as *mut u8, p.capacity) }
        })
    }
}

impl Drop for ChunkWriter<'_> {
    fn drop(&mut self) {
        self.chunk.state.0.store(IDLE, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_slices_only_within_its_pieces() {
        let mem = Arc::new(vec![7u8; 64]);
        // SAFETY: the Arc keeps the bytes, and nothing writes them.
        let lease = unsafe { Lease::new_pieces([(1, &mem[..16]), (2, &mem[32..48])], Arc::clone(&mem) as _) }.unwrap();
        let base = mem.as_ptr() as usize;
        assert_eq!(lease.slice(base + 4, 8), Some(&[7u8; 8][..]));
        assert_eq!(lease.slice(base + 12, 8), None, "runs past a piece");
        assert_eq!(lease.slice(base + 20, 4), None, "between pieces");
        assert_eq!(lease.slice(usize::MAX, 2), None, "overflows");
        assert_eq!(lease.bytes().map(<[u8]>::len).collect::<Vec<_>>(), [16, 16]);
        assert_eq!(lease.len(), 32);
    }

    #[test]
    fn a_chunk_is_written_or_sent_never_both() {
        let mem: Arc<Vec<AtomicU8>> = Arc::new((0..32).map(|_| AtomicU8::new(0)).collect());
        let addr = mem.as_ptr() as usize;
        // SAFETY: the Arc keeps the 32 bytes; nothing else hands them out, and this test, the
        // "transport", reads them only between begin_send and end_send.
        let mut c = unsafe {
            TxChunk::new_pieces(
                9,
                &[TxPiece { addr, capacity: 16 }, TxPiece { addr: addr + 16, capacity: 16 }],
                Arc::clone(&mem) as _,
            )
        }
        .unwrap();
        let state = Arc::clone(c.state());
        {
            let mut w = c.write().unwrap();
            assert!(!state.begin_send(), "not sent while written");
            for (i, p) in w.pieces().enumerate() {
                p.fill(i as u8 + 1);
            }
        }
        assert!(state.begin_send());
        assert!(state.sending());
        assert_eq!(c.write().unwrap_err(), ChunkBusy(9));
        assert!(!state.begin_send(), "one send at a time");
        assert_eq!(mem[3].load(Ordering::Relaxed), 1);
        assert_eq!(mem[20].load(Ordering::Relaxed), 2);
        state.end_send();
        assert!(c.write().is_ok());
    }
}
