//! [`WakeFd`]: the eventfd a sleeping thread is woken through, shared by the target's network
//! and io_uring threads, the initiator's engine threads and its ublk queues.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use nix::sys::eventfd::{EfdFlags, EventFd};

/// An eventfd (nix's [`EventFd`]) used as a doorbell: [`WakeFd::wake`] makes it readable,
/// [`WakeFd::drain`] resets it. Close-on-exec.
#[derive(Debug)]
pub struct WakeFd(EventFd);

impl WakeFd {
    /// A non-blocking one, for threads that wait in `poll(2)` on it beside other descriptors.
    pub fn new() -> io::Result<WakeFd> {
        Self::with_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
    }

    /// A blocking one, for a reader that must wait in the read itself: an io_uring READ of a
    /// non-blocking eventfd completes at once with `EAGAIN` instead of waiting for a wake.
    pub fn blocking() -> io::Result<WakeFd> {
        Self::with_flags(EfdFlags::EFD_CLOEXEC)
    }

    fn with_flags(flags: EfdFlags) -> io::Result<WakeFd> {
        Ok(WakeFd(EventFd::from_value_and_flags(0, flags).map_err(io::Error::from)?))
    }

    /// Makes it readable. Never fails in practice: the counter saturates only after 2^64 - 2
    /// wakes nobody read (then the non-blocking write fails and the descriptor stays readable,
    /// which is all a wake needs), and the descriptor is ours.
    pub fn wake(&self) {
        let _ = self.0.write(1);
    }

    /// Resets it, returning how many wakes it held (0 when none, without blocking on a
    /// non-blocking one). On a [`WakeFd::blocking`] one this waits for a wake.
    pub fn drain(&self) -> u64 {
        self.0.read().unwrap_or_default()
    }
}

impl AsFd for WakeFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for WakeFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

    fn readable(w: &WakeFd) -> bool {
        let mut fds = [PollFd::new(w.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).expect("poll") == 1
    }

    #[test]
    fn wakes_count_until_drained() {
        let w = WakeFd::new().expect("eventfd");
        assert!(!readable(&w));
        assert_eq!(w.drain(), 0, "nothing to drain, and no blocking");
        w.wake();
        w.wake();
        assert!(readable(&w));
        assert_eq!(w.drain(), 2);
        assert!(!readable(&w));
    }

    #[test]
    fn a_blocking_one_waits_for_a_wake() {
        let w = std::sync::Arc::new(WakeFd::blocking().expect("eventfd"));
        let w2 = std::sync::Arc::clone(&w);
        let t = std::thread::spawn(move || w2.drain());
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!t.is_finished(), "the read waits");
        w.wake();
        assert_eq!(t.join().expect("reader"), 1);
    }
}
