//! Driving any [`FrameTransport`] from tokio: a busy channel polls, an idle one sleeps on the
//! transport's readiness descriptor (`AsyncFd`).

use std::io;
use std::os::fd::OwnedFd;

use tokio::io::unix::AsyncFd;
use tyche_transport::FrameTransport;
use tyche_transport::FrameTransportExt;

/// A transport registered with the tokio reactor.
///
/// [`recv`](Self::recv) first polls the transport `spins` times (so a busy channel never pays
/// for a sleep), then waits for the descriptor to become readable.
#[derive(Debug)]
pub struct AsyncTransport<T: FrameTransport> {
    /// A duplicate of the transport's readiness descriptor (same socket), owned here.
    fd: AsyncFd<OwnedFd>,
    transport: T,
    spins: u32,
}

impl<T: FrameTransport> AsyncTransport<T> {
    /// Registers `transport`, which must expose a readiness descriptor. Needs a tokio runtime
    /// with I/O enabled.
    pub fn new(transport: T, spins: u32) -> io::Result<Self> {
        let owned = transport
            .readiness_fd()
            .ok_or_else(|| io::Error::other("transport has no readiness descriptor"))?
            .try_clone_to_owned()?;
        // SAFETY: `owned` is an open descriptor (a dup of the transport's) owned by the
        // `AsyncFd` itself, so it stays open and unchanged until the `AsyncFd` is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }?;
        Ok(AsyncTransport { fd, transport, spins })
    }

    /// The transport, for sending and for non-waiting receives.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The transport.
    pub fn get_ref(&self) -> &T {
        &self.transport
    }

    /// Receives at least one frame (up to `budget`), sleeping while none arrives.
    pub async fn recv(&mut self, budget: usize, on_frame: &mut (dyn FnMut(&[u8]) + Send)) -> io::Result<usize> {
        loop {
            for _ in 0..=self.spins {
                let n = self.transport.recv(budget, &mut *on_frame)?;
                if n > 0 {
                    return Ok(n);
                }
            }
            let mut guard = self.fd.readable().await?;
            let n = self.transport.recv(budget, &mut *on_frame)?;
            if n > 0 {
                return Ok(n);
            }
            guard.clear_ready();
        }
    }
}
