//! A simulated multi-path Ethernet: per-path, per-direction serialization, delay, jitter, loss,
//! reordering, duplication, and path failure. Every choice comes from the world's seed.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Duration;

use tyche_channel::Instant;
use tyche_transport::SplitMix64;

/// Direction of travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Initiator to target.
    ToTarget,
    /// Target to initiator.
    ToInitiator,
}

/// Fault and timing settings of every path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetConfig {
    /// Probability a frame is lost.
    pub loss: f64,
    /// Probability a frame is delayed past later ones.
    pub reorder: f64,
    /// Probability a frame is delivered twice.
    pub dup: f64,
    /// Propagation delay.
    pub delay: Duration,
    /// Uniform extra delay up to this.
    pub jitter: Duration,
    /// Link rate in bytes per microsecond (1250 = 10 Gbit/s).
    pub bytes_per_us: u64,
}

/// How a failed path misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Every frame is lost, both ways, from now on.
    Down,
    /// Frames to the initiator are lost; frames to the target are held and all delivered at
    /// `release` (late duplicates arriving after the initiator gave the path up), then lost.
    HoldThenRelease {
        /// When the held frames arrive.
        release: Instant,
    },
}

#[derive(Debug)]
struct InFlight {
    at: Instant,
    order: u64,
    path: usize,
    dir: Dir,
    frame: Vec<u8>,
}

impl PartialEq for InFlight {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.order) == (o.at, o.order)
    }
}
impl Eq for InFlight {}
impl PartialOrd for InFlight {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for InFlight {
    fn cmp(&self, o: &Self) -> Ordering {
        // Min-heap on (time, send order).
        (o.at, o.order).cmp(&(self.at, self.order))
    }
}

/// A frame arriving.
#[derive(Debug)]
pub struct Delivery {
    /// Path (channel) index.
    pub path: usize,
    /// Direction.
    pub dir: Dir,
    /// The bytes (return with [`Network::recycle`]).
    pub frame: Vec<u8>,
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Frames handed to the network.
    pub sent: u64,
    /// Frames lost (randomly or on a failed path).
    pub lost: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Frames delayed past later ones.
    pub reordered: u64,
    /// Frames held by a failing path and delivered late.
    pub held: u64,
}

/// The simulated network.
#[derive(Debug)]
pub struct Network {
    cfg: NetConfig,
    rng: SplitMix64,
    heap: BinaryHeap<InFlight>,
    order: u64,
    free_at: Vec<[Instant; 2]>,
    failed: Vec<Option<Failure>>,
    /// Every path loses every frame, both ways, until then.
    partitioned_until: Instant,
    pool: Vec<Vec<u8>>,
    stats: NetStats,
}

impl Network {
    /// A network of `paths` paths.
    pub fn new(cfg: NetConfig, paths: usize, seed: u64) -> Self {
        Network {
            cfg,
            rng: SplitMix64::new(seed),
            heap: BinaryHeap::new(),
            order: 0,
            free_at: vec![[Instant::ZERO; 2]; paths],
            failed: vec![None; paths],
            partitioned_until: Instant::ZERO,
            pool: Vec::new(),
            stats: NetStats::default(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// Fails a path from now on.
    pub fn fail(&mut self, path: usize, how: Failure) {
        self.failed[path] = Some(how);
    }

    /// Cuts every path, both ways, until `until` (a partition between initiator and target).
    pub fn partition(&mut self, until: Instant) {
        self.partitioned_until = self.partitioned_until.max(until);
    }

    /// Delays every frame in flight towards `dir` by `extra` (frames an endpoint sent just
    /// before it went away, sitting in a queue on the way).
    pub fn delay_in_flight(&mut self, dir: Dir, extra: Duration) {
        let mut frames = std::mem::take(&mut self.heap).into_vec();
        for f in frames.iter_mut().filter(|f| f.dir == dir) {
            f.at = f.at + extra;
        }
        self.heap = frames.into();
    }

    /// Whether a path has failed.
    pub fn is_failed(&self, path: usize) -> bool {
        self.failed[path].is_some()
    }

    /// A buffer for a frame to send.
    pub fn buffer(&mut self, len: usize) -> Vec<u8> {
        let mut b = self.pool.pop().unwrap_or_default();
        b.clear();
        b.resize(len, 0);
        b
    }

    /// Returns a delivered frame's buffer.
    pub fn recycle(&mut self, b: Vec<u8>) {
        self.pool.push(b);
    }

    fn push(&mut self, at: Instant, path: usize, dir: Dir, frame: Vec<u8>) {
        self.order += 1;
        self.heap.push(InFlight { at, order: self.order, path, dir, frame });
    }

    /// Sends a frame on `path` in direction `dir` at `now`.
    pub fn send(&mut self, now: Instant, path: usize, dir: Dir, frame: Vec<u8>) {
        self.stats.sent += 1;
        let d = dir as usize;
        // Serialization on the link.
        let tx = Duration::from_nanos(frame.len() as u64 * 1000 / self.cfg.bytes_per_us.max(1));
        let start = now.max(self.free_at[path][d]);
        self.free_at[path][d] = start + tx;
        if now < self.partitioned_until {
            return self.lose(frame);
        }
        match self.failed[path] {
            Some(Failure::Down) => return self.lose(frame),
            Some(Failure::HoldThenRelease { release }) => {
                if dir == Dir::ToInitiator || now >= release {
                    return self.lose(frame);
                }
                self.stats.held += 1;
                let at = release + Duration::from_nanos(self.rng.range(0, 1000));
                return self.push(at, path, dir, frame);
            }
            None => {}
        }
        if self.rng.chance(self.cfg.loss) {
            return self.lose(frame);
        }
        let jitter = self.rng.range(0, self.cfg.jitter.as_nanos() as u64);
        let mut at = start + tx + self.cfg.delay + Duration::from_nanos(jitter);
        if self.rng.chance(self.cfg.reorder) {
            self.stats.reordered += 1;
            at = at + Duration::from_nanos(self.rng.range(1, 10 * self.cfg.delay.as_nanos() as u64));
        }
        if self.rng.chance(self.cfg.dup) {
            self.stats.duplicated += 1;
            let mut copy = self.buffer(frame.len());
            copy.copy_from_slice(&frame);
            let later = at + Duration::from_nanos(self.rng.range(0, 5 * self.cfg.delay.as_nanos() as u64));
            self.push(later, path, dir, copy);
        }
        self.push(at, path, dir, frame);
    }

    fn lose(&mut self, frame: Vec<u8>) {
        self.stats.lost += 1;
        self.recycle(frame);
    }

    /// When the next frame arrives.
    pub fn next_at(&self) -> Option<Instant> {
        self.heap.peek().map(|f| f.at)
    }

    /// The next frame due at or before `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<Delivery> {
        if self.heap.peek()?.at > now {
            return None;
        }
        let f = self.heap.pop().expect("peeked");
        Some(Delivery { path: f.path, dir: f.dir, frame: f.frame })
    }

    /// Whether any frame is in flight.
    pub fn is_idle(&self) -> bool {
        self.heap.is_empty()
    }
}
