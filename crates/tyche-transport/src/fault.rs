use std::collections::VecDeque;
use std::io;
use std::os::fd::BorrowedFd;

use crate::{Capabilities, FrameTransport, Lease, OnLentFrame, Rx, Sent, SplitMix64, TxChunk};

/// What a [`FaultInjector`] does to frames, in each direction independently.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FaultConfig {
    /// Probability that a frame is dropped.
    pub loss: f64,
    /// Probability that a frame is delivered twice.
    pub duplicate: f64,
    /// Probability that a received frame is held back and delivered after the next one.
    pub reorder: f64,
    /// Whether the link is down: every frame is dropped both ways.
    pub down: bool,
}

/// Counters of what a [`FaultInjector`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultStats {
    /// Frames dropped on transmit.
    pub tx_dropped: u64,
    /// Frames dropped on receive.
    pub rx_dropped: u64,
    /// Frames delivered twice.
    pub duplicated: u64,
    /// Frames held back and delivered late.
    pub reordered: u64,
}

/// Wraps a transport and loses, duplicates and reorders frames from a seeded generator, in the
/// spirit of smoltcp's `FaultInjector`. Used by end-to-end tests to inject loss where the kernel
/// cannot (AF_XDP copy-mode transmit bypasses the qdisc, so `tc netem` never sees the frames).
#[derive(Debug)]
pub struct FaultInjector<T> {
    inner: T,
    tx: FaultConfig,
    rx: FaultConfig,
    rng: SplitMix64,
    held: VecDeque<Vec<u8>>,
    stats: FaultStats,
}

impl<T: FrameTransport> FaultInjector<T> {
    /// Wraps `inner`, applying `tx` to frames it sends and `rx` to frames it receives.
    pub fn new(inner: T, tx: FaultConfig, rx: FaultConfig, seed: u64) -> Self {
        FaultInjector { inner, tx, rx, rng: SplitMix64::new(seed), held: VecDeque::new(), stats: FaultStats::default() }
    }
    /// Changes the faults applied from now on.
    pub fn set_faults(&mut self, tx: FaultConfig, rx: FaultConfig) {
        self.tx = tx;
        self.rx = rx;
    }
    /// What was done so far.
    pub fn stats(&self) -> FaultStats {
        self.stats
    }
    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }
    /// The wrapped transport, mutably.
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: FrameTransport> FrameTransport for FaultInjector<T> {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    /// Frames that pass straight through keep the inner transport's lease (and pieces); a
    /// duplicate is offered again without one, and a frame held back for reordering is a copy
    /// (no lease).
    fn receive(&mut self, budget: usize, mode: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        let (rx, rng, held, stats) = (self.rx, &mut self.rng, &mut self.held, &mut self.stats);
        let mut delivered = 0;
        let n = self.inner.receive(budget, mode, &mut |frame, lease| {
            if rx.down || rng.chance(rx.loss) {
                stats.rx_dropped += 1;
                return lease;
            }
            if rng.chance(rx.reorder) {
                stats.reordered += 1;
                let mut copy = Vec::new();
                crate::gather(frame, &mut copy);
                held.push_back(copy);
                return lease;
            }
            let back = on_frame(frame, lease);
            delivered += 1;
            if rng.chance(rx.duplicate) {
                stats.duplicated += 1;
                on_frame(frame, None);
                delivered += 1;
            }
            if let Some(late) = held.pop_front() {
                on_frame(&[&late], None);
                delivered += 1;
            }
            back
        })?;
        if n == 0 {
            while let Some(late) = self.held.pop_front() {
                on_frame(&[&late], None);
                delivered += 1;
            }
        }
        Ok(delivered)
    }

    fn release(&mut self, lease: Lease) {
        self.inner.release(lease)
    }

    fn leases_out(&self) -> usize {
        self.inner.leases_out()
    }

    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        let (tx, rng, stats) = (self.tx, &mut self.rng, &mut self.stats);
        self.inner.transmit(budget, &mut |buf| {
            let sent = fill(buf)?;
            if tx.down || rng.chance(tx.loss) {
                stats.tx_dropped += 1;
                return Some(Sent::Here(0));
            }
            Some(sent)
        })
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
    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.inner.readiness_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FrameTransportExt, MemLink};
    use tyche_wire::MacAddr;

    #[test]
    fn loss_is_seeded_and_counted() {
        let (a, mut b) = MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 1500, 1514, 1024);
        let lossy = FaultConfig { loss: 0.5, ..Default::default() };
        let mut a = FaultInjector::new(a, lossy, FaultConfig::default(), 42);
        let mut offered = 0;
        a.send(1000, &mut |buf| {
            if offered == 1000 {
                return None;
            }
            offered += 1;
            buf[..60].fill(0);
            buf[12..14].copy_from_slice(&0x88B5u16.to_be_bytes());
            Some(60)
        })
        .unwrap();
        let mut arrived = 0;
        b.recv(1000, &mut |f| arrived += usize::from(f[12..14] == [0x88, 0xB5])).unwrap();
        let dropped = a.stats().tx_dropped as usize;
        assert_eq!(arrived + dropped, 1000);
        assert!((400..600).contains(&dropped), "{dropped} of 1000 dropped at p=0.5");
    }
}
