//! Tyche frames over TCP: the "TSockets" baseline the AF_XDP transport is compared against.
//!
//! [`TcpTransport`] implements [`FrameTransport`] over a nonblocking [`TcpStream`]. Each frame
//! travels as a 2-byte big-endian length followed by the frame (Ethernet header included, as
//! on a real link), so the channel engine runs over it unchanged. TCP never loses or reorders
//! frames; the transport still never blocks: `send` queues into a bounded buffer and stops when
//! it is full, `recv` returns what has fully arrived.
//!
//! Frames are written in place into the transmit buffer and handed to `recv`'s callback in
//! place in the receive buffer; the kernel copies, as TCP always does.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};

use tyche_transport::{transmit_here, Capabilities, FrameTransport, OnLentFrame, Rx, Sent};
use tyche_wire::{MacAddr, ETH_HEADER_LEN};

/// Bytes of length prefix in front of each frame.
const PREFIX: usize = 2;

/// A [`FrameTransport`] over one TCP connection.
#[derive(Debug)]
pub struct TcpTransport {
    stream: TcpStream,
    mtu: usize,
    mac: MacAddr,
    rx: Vec<u8>,
    rx_start: usize,
    rx_end: usize,
    tx: Vec<u8>,
    tx_start: usize,
    tx_limit: usize,
}

impl TcpTransport {
    /// Wraps a connected stream (made nonblocking, Nagle off). `mtu` bounds frames as on an
    /// Ethernet link; `mac` is this end's address in the frames it builds.
    pub fn new(stream: TcpStream, mtu: usize, mac: MacAddr) -> io::Result<Self> {
        assert!(mtu + ETH_HEADER_LEN <= u16::MAX as usize, "frames must fit a 16-bit length");
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        let cap = mtu + ETH_HEADER_LEN + PREFIX;
        Ok(TcpTransport {
            stream,
            mtu,
            mac,
            rx: vec![0; (256 * 1024).max(4 * cap)],
            rx_start: 0,
            rx_end: 0,
            tx: Vec::with_capacity(256 * 1024),
            tx_start: 0,
            tx_limit: (256 * 1024).max(4 * cap),
        })
    }

    /// The stream.
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Bytes queued but not yet accepted by the kernel.
    pub fn pending(&self) -> usize {
        self.tx.len() - self.tx_start
    }

    fn write_out(&mut self) -> io::Result<()> {
        while self.tx_start < self.tx.len() {
            match self.stream.write(&self.tx[self.tx_start..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.tx_start += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        if self.tx_start == self.tx.len() {
            self.tx.clear();
            self.tx_start = 0;
        } else if self.tx_start > self.tx.len() / 2 {
            self.tx.drain(..self.tx_start);
            self.tx_start = 0;
        }
        Ok(())
    }

    fn read_in(&mut self) -> io::Result<()> {
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        } else if self.rx_start > 0 && self.rx.len() - self.rx_end < self.frame_capacity() + PREFIX {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        while self.rx_end < self.rx.len() {
            match self.stream.read(&mut self.rx[self.rx_end..]) {
                Ok(0) => {
                    if self.rx_end == self.rx_start {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    break;
                }
                Ok(n) => self.rx_end += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl FrameTransport for TcpTransport {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(self.frame_capacity(), self.mtu, self.mac)
    }

    fn receive(&mut self, budget: usize, _rx: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        let mut n = 0;
        let mut read = false;
        while n < budget {
            let have = self.rx_end - self.rx_start;
            let len = if have >= PREFIX {
                u16::from_be_bytes([self.rx[self.rx_start], self.rx[self.rx_start + 1]]) as usize
            } else {
                usize::MAX
            };
            if len != usize::MAX && len > self.frame_capacity() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("peer sent a {len}-byte frame over MTU {}", self.mtu),
                ));
            }
            if len == usize::MAX || have < PREFIX + len {
                if read {
                    break;
                }
                self.read_in()?;
                read = true;
                continue;
            }
            let at = self.rx_start + PREFIX;
            on_frame(&[&self.rx[at..at + len]], None);
            self.rx_start = at + len;
            n += 1;
        }
        Ok(n)
    }

    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        transmit_here(budget, fill, |budget, fill| self.send_here(budget, fill))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.write_out()
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.stream.as_fd())
    }
}

impl TcpTransport {
    /// The largest frame, Ethernet header included.
    pub fn frame_capacity(&self) -> usize {
        self.mtu + ETH_HEADER_LEN
    }

    fn send_here(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> io::Result<usize> {
        let cap = self.frame_capacity();
        let mut n = 0;
        while n < budget {
            if self.pending() + PREFIX + cap > self.tx_limit {
                self.write_out()?;
                if self.pending() + PREFIX + cap > self.tx_limit {
                    break;
                }
            }
            let base = self.tx.len();
            self.tx.resize(base + PREFIX + cap, 0);
            match fill(&mut self.tx[base + PREFIX..]) {
                Some(len) if len > 0 => {
                    assert!(len <= cap, "frame of {len} bytes overran its buffer");
                    self.tx[base..base + PREFIX].copy_from_slice(&(len as u16).to_be_bytes());
                    self.tx.truncate(base + PREFIX + len);
                    n += 1;
                }
                Some(_) => self.tx.truncate(base),
                None => {
                    self.tx.truncate(base);
                    break;
                }
            }
        }
        self.write_out()?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    use super::*;
    use tyche_transport::FrameTransportExt;

    #[test]
    fn frames_cross_loopback_in_order_and_intact() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let client = TcpStream::connect(addr).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        let mtu = 3000;
        let mut a = TcpTransport::new(client, mtu, MacAddr::local(1)).expect("client transport");
        let mut b = TcpTransport::new(server, mtu, MacAddr::local(2)).expect("server transport");
        assert_eq!(a.frame_capacity(), 3014);

        const N: u32 = 20_000;
        let (mut sent, mut got) = (0u32, 0u32);
        let deadline = Instant::now() + Duration::from_secs(30);
        while got < N {
            assert!(Instant::now() < deadline, "stalled at {got}/{N} frames");
            if sent < N {
                a.send(64, &mut |buf| {
                    if sent >= N {
                        return None;
                    }
                    // Vary the length so frames straddle read boundaries.
                    let len = 60 + (sent as usize * 7) % (buf.len() - 60);
                    buf[..4].copy_from_slice(&sent.to_be_bytes());
                    buf[len - 1] = sent as u8;
                    sent += 1;
                    Some(len)
                })
                .expect("send");
            }
            a.flush().expect("flush");
            b.recv(256, &mut |f| {
                let seq = u32::from_be_bytes(f[..4].try_into().expect("4 bytes"));
                assert_eq!(seq, got, "frames arrive in order");
                assert_eq!(f.len(), 60 + (seq as usize * 7) % (3014 - 60), "length kept");
                assert_eq!(f[f.len() - 1], seq as u8, "last byte intact");
                got += 1;
            })
            .expect("recv");
        }
        assert_eq!(b.recv(10, &mut |_| panic!("no extra frame")).expect("recv"), 0);
        assert!(a.readiness_fd().is_some());
    }

    #[test]
    fn skip_and_done_send_nothing() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        let mut a = TcpTransport::new(client, 1500, MacAddr::local(1)).expect("transport");
        let mut b = TcpTransport::new(server, 1500, MacAddr::local(2)).expect("transport");
        let mut calls = 0;
        let n = a
            .send(4, &mut |_| {
                calls += 1;
                if calls < 3 {
                    Some(0)
                } else {
                    None
                }
            })
            .expect("send");
        assert_eq!((n, calls), (0, 3));
        assert_eq!(a.pending(), 0);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(b.recv(4, &mut |_| panic!("nothing was sent")).expect("recv"), 0);
    }
}
