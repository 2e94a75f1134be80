//! The storage job: a request the channel engine hands out, with the places of its data (slot
//! memory, write data kept in received frames, transmit chunks read data goes straight into),
//! and how one is run on a backend. A leaf module: the network threads (`runtime`) make jobs and
//! finish them, the storage workers (`workers`) and the io_uring threads (`uring`) run them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tyche_channel::{Pieces, MAX_PIECES};
use tyche_transport::{Lease, TxChunk};
use tyche_wire::{layout, Op, Request, Status, DATA_FRAME_OVERHEAD};

use crate::backend::{Backend, Memory};
use crate::rate_limit::PEER_LOGS;

/// Transmit chunks a NIC's transport lent for good, holding one request's read data: segment
/// `i` (of `seg` bytes) lies right after the room for a DATA frame's headers in chunk `i`, so
/// the frame is sent from there once the headers are written in front.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) chunks: Vec<TxChunk>,
    pub(crate) seg: u32,
    pub(crate) nic: usize,
    /// The read whose data it holds.
    pub(crate) tag: u64,
}

/// Write data left in the received frame it arrived in: its pieces (one, or one per buffer of
/// a multi-buffer frame: `(addr, len)`, in order) are bytes `offset..offset + len` of the
/// request's data. The lease keeps them there, unchanged.
#[derive(Debug)]
pub(crate) struct LentSegment {
    pub(crate) offset: u32,
    pub(crate) len: u32,
    parts: [(usize, u32); MAX_PIECES],
    count: u8,
    /// The NIC whose transport lent the frame (it gets the lease back).
    pub(crate) nic: usize,
    pub(crate) lease: Lease,
}

impl LentSegment {
    /// The payload `payload` (at `offset` of the request's data) kept in the frame `lease`
    /// names, lent by NIC `nic`'s transport. The caller checked that the lease covers it.
    pub(crate) fn new(offset: u32, payload: &Pieces<'_>, nic: usize, lease: Lease) -> LentSegment {
        let mut parts = [(0usize, 0u32); MAX_PIECES];
        for (slot, p) in parts.iter_mut().zip(payload.parts()) {
            *slot = (p.as_ptr() as usize, p.len() as u32);
        }
        LentSegment { offset, len: payload.len() as u32, parts, count: payload.parts().len() as u8, nic, lease }
    }

    /// The pieces of the payload: `(addr, len)`, in order.
    pub(crate) fn parts(&self) -> &[(usize, u32)] {
        &self.parts[..self.count as usize]
    }
}

/// A storage request for a worker.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) session: u64,
    pub(crate) channel: u16,
    /// Which instance of channel `channel` (a reconnect on the same index is a new one).
    pub(crate) epoch: u64,
    pub(crate) export: usize,
    pub(crate) request: Request,
    pub(crate) buf: Option<Memory>,
    /// Write data kept in the frames it arrived in, by offset (the rest is in `buf`).
    pub(crate) lent: Vec<LentSegment>,
    /// Read data goes straight into these transmit chunks (one per segment), not `buf`.
    pub(crate) region: Option<Region>,
    pub(crate) abort: bool,
    /// Names the job while storage has it (0 in tests that build jobs by hand).
    pub(crate) id: u64,
    /// Set when the job's session is fenced: a job not started by then is not run.
    pub(crate) fence: Option<Arc<AtomicBool>>,
    /// The NIC of its channel: its node's queue runs it, and its network thread completes it.
    pub(crate) nic: Option<usize>,
}

impl Job {
    /// The request's write data in order: the payloads of the kept frames, and slot memory
    /// for the parts that were copied there. `None` if they do not add up (kept segments out of
    /// order or past the end, or copied parts with no slot memory): the write must not run.
    pub(crate) fn write_pieces(&self) -> Option<Vec<&[u8]>> {
        let len = self.request.length as usize;
        let mem = self.buf.as_ref().map(Memory::as_slice);
        let mut out = Vec::with_capacity(self.lent.len() + 2);
        let mut at = 0usize;
        for seg in &self.lent {
            let (o, l) = (seg.offset as usize, seg.len as usize);
            if o < at || o + l > len {
                return None;
            }
            if o > at {
                out.push(mem?.get(at..o)?);
            }
            for &(addr, n) in seg.parts() {
                // Within a buffer of the frame the lease names (checked when the frame was kept).
                out.push(seg.lease.slice(addr, n as usize)?);
            }
            at = o + l;
        }
        if at < len {
            out.push(mem?.get(at..len)?);
        }
        Some(out)
    }

    /// Whether the job is not to run: the target stops, its channel died, or its session was
    /// fenced by a new attachment of the same initiator.
    pub(crate) fn aborted(&self) -> bool {
        self.abort || self.fence.as_ref().is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// Whether the job's data has a place to come from or go to (checked before storage runs).
    pub(crate) fn places_ok(&self) -> bool {
        let len = self.request.length as usize;
        match self.request.op {
            Op::Read if self.region.is_some() => true,
            Op::Read => self.buf.as_ref().is_some_and(|b| b.as_slice().len() >= len),
            Op::BlockStatus => self.buf.as_ref().is_some_and(|b| b.as_slice().len() >= layout::block_status::LEN),
            Op::Write => self.write_pieces().is_some(),
            _ => true,
        }
    }

    /// Runs `read` on the places the read data goes to when it goes straight into transmit
    /// chunks: segment `i` in chunk `i`, right after the room for the DATA frame's headers, in
    /// one place, or, where a chunk is a group of buffers (a multi-buffer link), in one place per
    /// buffer it fills. `Err` if a chunk is being sent (regions are handed out only when idle,
    /// so never): the read must not run.
    pub(crate) fn with_read_places<R>(
        &mut self,
        read: impl FnOnce(&mut [&mut [u8]]) -> R,
    ) -> Result<R, tyche_transport::ChunkBusy> {
        let len = self.request.length as usize;
        let region = self.region.as_mut().expect("a read region");
        let seg = region.seg as usize;
        assert_eq!(region.chunks.len(), len.div_ceil(seg), "one chunk per segment");
        let mut writers = region.chunks.iter_mut().map(TxChunk::write).collect::<Result<Vec<_>, _>>()?;
        let mut places = Vec::with_capacity(writers.len());
        for (i, w) in writers.iter_mut().enumerate() {
            let n = seg.min(len - i * seg);
            // The frame fills the chunk's pieces in order; the payload starts after the headers.
            let (mut skip, mut left) = (DATA_FRAME_OVERHEAD, n);
            for p in w.pieces() {
                if left == 0 {
                    break;
                }
                if skip >= p.len() {
                    skip -= p.len();
                    continue;
                }
                let m = left.min(p.len() - skip);
                places.push(&mut p[skip..skip + m]);
                left -= m;
                skip = 0;
            }
            assert_eq!(left, 0, "a segment and its headers fit a chunk");
        }
        Ok(read(&mut places))
    }
}

/// A finished storage request: the job, with its buffers, and how it went.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) job: Job,
    pub(crate) status: Status,
}

pub(crate) fn execute(backend: &dyn Backend, job: &mut Job) -> Status {
    if job.aborted() {
        return Status::Aborted;
    }
    let r = job.request;
    let len = r.length as usize;
    let res = match r.op {
        Op::Read if job.region.is_some() => {
            match job.with_read_places(|places| backend.read_vectored_at(places, r.offset)) {
                Ok(res) => res,
                Err(busy) => {
                    tracing::error!(%busy, "a read region's chunk is being sent: the read is not run");
                    return Status::Invalid;
                }
            }
        }
        Op::Read => match job.buf.as_mut().and_then(|b| b.as_mut_slice().get_mut(..len)) {
            Some(place) => backend.read_at(place, r.offset),
            None => return Status::Invalid,
        },
        Op::Write => match job.write_pieces() {
            Some(pieces) if !job.lent.is_empty() => backend.write_vectored_at(&pieces, r.offset, r.fua),
            Some(pieces) => backend.write_at(pieces.first().copied().unwrap_or_default(), r.offset, r.fua),
            None => return Status::Invalid,
        },
        Op::Flush => backend.flush(),
        Op::Discard => backend.discard(r.offset, r.length as u64),
        Op::WriteZeroes => backend.write_zeroes(r.offset, r.length as u64),
        Op::BlockStatus => {
            let Some(place) = job.buf.as_mut().and_then(|b| b.as_mut_slice().get_mut(..layout::block_status::LEN))
            else {
                return Status::Invalid;
            };
            match backend.block_status(r.offset, r.length as u64, layout::block_status::MAX_EXTENTS) {
                Ok(Some(extents)) if !extents.is_empty() => {
                    tyche_wire::emit_block_status(extents, place);
                    Ok(())
                }
                Ok(_) => return Status::Unsupported,
                Err(e) => Err(e),
            }
        }
    };
    match res {
        Ok(()) => Status::Ok,
        Err(e) => {
            if PEER_LOGS.allow() {
                tracing::warn!(op = ?r.op, offset = r.offset, length = r.length, "storage error: {e}");
            }
            if e.raw_os_error() == Some(libc::ENOSPC) {
                Status::NoSpace
            } else {
                Status::IoError
            }
        }
    }
}

/// [`execute`], with a panic (a bug) turned into an I/O error for that request alone.
pub(crate) fn execute_contained(backend: &dyn Backend, job: &mut Job) -> Status {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| execute(backend, job))).unwrap_or_else(|_| {
        tracing::error!(op = ?job.request.op, "storage request panicked; failed with an I/O error");
        Status::IoError
    })
}
