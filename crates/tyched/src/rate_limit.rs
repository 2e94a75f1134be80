//! The rate limit on log lines a peer can cause, shared by the network and storage threads.

use std::sync::atomic::{AtomicU64, Ordering};

/// A rate limit for log lines a peer can cause (refusals, sessions and channels opening and
/// dying, storage errors): at most [`RateLimit::PER_SECOND`] lines a second pass, the rest are
/// counted (`limits.warnings_suppressed`). Lock-free: storage threads use it too.
#[derive(Debug)]
pub(crate) struct RateLimit {
    second: AtomicU64,
    used: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimit {
    const PER_SECOND: u64 = 20;

    pub(crate) const fn new() -> Self {
        RateLimit { second: AtomicU64::new(0), used: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// Whether a line may be logged now.
    pub(crate) fn allow(&self) -> bool {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let now = START.get_or_init(std::time::Instant::now).elapsed().as_secs() + 1;
        if self.second.swap(now, Ordering::Relaxed) != now {
            self.used.store(0, Ordering::Relaxed);
        }
        if self.used.fetch_add(1, Ordering::Relaxed) < Self::PER_SECOND {
            return true;
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Lines not logged since the process started.
    pub(crate) fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

/// The log rate limit of this process's targets.
pub(crate) static PEER_LOGS: RateLimit = RateLimit::new();
