//! The bell an engine thread sleeps by: an eventfd rung only when the thread said it sleeps.

use std::sync::atomic::{AtomicBool, Ordering};

use tyche_runtime::wake::WakeFd;

/// Wakes an engine thread when it sleeps: clients ring it after queueing a command, other engine
/// threads after leaving it frames to send.
#[derive(Debug)]
pub(crate) struct Bell {
    pub(crate) efd: WakeFd,
    pub(crate) sleeping: AtomicBool,
}

impl Bell {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Bell { efd: WakeFd::new()?, sleeping: AtomicBool::new(false) })
    }

    /// Wakes the engine if it sleeps (one syscall only then).
    pub(crate) fn ring(&self) {
        if self.sleeping.swap(false, Ordering::AcqRel) {
            self.efd.wake();
        }
    }

    /// Wakes the engine whether or not it has said it sleeps.
    pub(crate) fn force(&self) {
        self.sleeping.store(false, Ordering::Release);
        self.efd.wake();
    }
}
