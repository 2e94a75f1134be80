use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Mutex};

use tyche_wire::MacAddr;

use std::sync::atomic::{AtomicU8, Ordering};

use crate::{FrameTransport, Lease, OnLentFrame, Sent, TxChunk};

/// Memory of one transmit chunk a [`MemPort`] lends: bytes a holder may write through raw
/// pointers (atomic bytes, so a write from another thread is never a data race on our side).
type ChunkMemory = Arc<Box<[AtomicU8]>>;

/// One direction of an in-memory link: a bounded queue of frames with a pool of spare buffers so
/// that steady-state traffic allocates nothing. Buffers keep their full capacity (a frame's length
/// travels beside it), so they are zeroed once, when first allocated, never per frame.
#[derive(Debug, Default)]
struct Lane {
    frames: VecDeque<(Vec<u8>, usize)>,
    spare: Vec<Vec<u8>>,
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
        let ab = Arc::new(Mutex::new(Lane::default()));
        let ba = Arc::new(Mutex::new(Lane::default()));
        let port = |mac, tx: &Arc<Mutex<Lane>>, rx: &Arc<Mutex<Lane>>| MemPort {
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
        };
        (port(macs.0, &ab, &ba), port(macs.1, &ba, &ab))
    }
}

/// One end of a [`MemLink`].
#[derive(Debug)]
pub struct MemPort {
    mac: MacAddr,
    mtu: usize,
    frame_capacity: usize,
    depth: usize,
    tx: Arc<Mutex<Lane>>,
    rx: Arc<Mutex<Lane>>,
    dropped: u64,
    /// Frames that may be lent at once ([`FrameTransport::recv_lend`]); 0: none.
    lend_limit: usize,
    /// Frames lent and not yet released, by lease id.
    lent: HashMap<u64, Arc<Vec<u8>>>,
    next_lease: u64,
    /// Transmit chunks that may be lent for good ([`FrameTransport::lend_tx_chunks`]).
    tx_lend_limit: usize,
    /// Transmit chunks lent, by id.
    tx_lent: HashMap<u64, ChunkMemory>,
}

impl MemPort {
    /// Frames this port could not queue because the peer's queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Lets [`FrameTransport::recv_lend`] lend up to `frames` received frames at once (none by
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
}

impl FrameTransport for MemPort {
    fn frame_capacity(&self) -> usize {
        self.frame_capacity
    }
    fn mtu(&self) -> usize {
        self.mtu
    }
    fn local_mac(&self) -> MacAddr {
        self.mac
    }

    fn recv(&mut self, budget: usize, on_frame: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        let mut n = 0;
        while n < budget {
            // Take one frame out under the lock, hand it over outside it.
            let Some((frame, len)) = self.rx.lock().expect("lane poisoned").frames.pop_front() else {
                break;
            };
            on_frame(&frame[..len]);
            self.rx.lock().expect("lane poisoned").spare.push(frame);
            n += 1;
        }
        Ok(n)
    }

    fn recv_lend(&mut self, budget: usize, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        let mut n = 0;
        while n < budget {
            let Some((frame, len)) = self.rx.lock().expect("lane poisoned").frames.pop_front() else {
                break;
            };
            n += 1;
            if self.lent.len() >= self.lend_limit {
                on_frame(&frame[..len], None);
                self.rx.lock().expect("lane poisoned").spare.push(frame);
                continue;
            }
            // The buffer moves into an Arc the lease shares: its bytes stay put however long
            // the receiver keeps them, even past this port.
            let frame = Arc::new(frame);
            let id = self.next_lease;
            self.next_lease += 1;
            let lease = Lease::new(id, &frame[..len], Arc::clone(&frame) as _);
            match on_frame(&frame[..len], Some(lease)) {
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

    fn release(&mut self, lease: Lease) {
        let frame = self.lent.remove(&lease.id()).expect("a lease this port lent");
        assert!(Arc::ptr_eq(&(Arc::clone(&frame) as Arc<dyn std::any::Any + Send + Sync>), lease.memory()));
        drop(lease);
        self.recycle(frame);
    }

    fn leases_out(&self) -> usize {
        self.lent.len()
    }

    fn send_with(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        let chunks = std::mem::take(&mut self.tx_lent);
        let r = self.send(budget, &mut |buf| match fill(buf)? {
            Sent::Here(len) => Some(len),
            Sent::Chunk { id, header, len } => {
                let chunk = chunks.get(&id).expect("a chunk this port lent");
                assert!(header <= len && len <= chunk.len(), "a frame within its chunk");
                for (c, b) in chunk[..header].iter().zip(&buf[..header]) {
                    c.store(*b, Ordering::Relaxed);
                }
                for (b, c) in buf[..len].iter_mut().zip(chunk.iter()) {
                    *b = c.load(Ordering::Relaxed);
                }
                Some(len)
            }
        });
        self.tx_lent = chunks;
        r
    }

    fn lend_tx_chunks(&mut self, max: usize) -> Vec<TxChunk> {
        let n = max.min(self.tx_lend_limit.saturating_sub(self.tx_lent.len()));
        (0..n)
            .map(|_| {
                let id = self.next_lease;
                self.next_lease += 1;
                let mem: ChunkMemory = Arc::new((0..self.frame_capacity).map(|_| AtomicU8::new(0)).collect());
                let addr = mem.as_ptr() as usize;
                self.tx_lent.insert(id, Arc::clone(&mem));
                TxChunk::new(id, addr, self.frame_capacity, mem as _)
            })
            .collect()
    }

    fn send(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> io::Result<usize> {
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
                lane.frames.push_back((buf, len));
            }
            n += 1;
        }
        Ok(n)
    }
}

impl MemPort {
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
}
