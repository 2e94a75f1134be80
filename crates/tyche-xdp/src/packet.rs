//! A [`FrameTransport`] over an AF_PACKET raw socket bound to one interface and one EtherType.
//!
//! Built in so that `tyched serve --transport packet` works on any interface (a veth pair in a
//! lab, say) without AF_XDP, and so that `tyche-init discover` reads beside a live AF_XDP socket
//! (with a [`crate::DiscoveryTap`]). Every frame is copied between the kernel and user space: it is the
//! slow path, not the one Tyche is designed around.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use tyche_transport::{transmit_here, Capabilities, FrameTransport, OnLentFrame, Rx, Sent};
use tyche_wire::MacAddr;

/// `PACKET_IGNORE_OUTGOING` from `<linux/if_packet.h>`.
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;

/// An AF_PACKET socket on one interface.
#[derive(Debug)]
pub struct PacketTransport {
    fd: OwnedFd,
    mac: MacAddr,
    mtu: usize,
    rx: Vec<u8>,
    tx: Vec<u8>,
}

fn sys(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `SIOCGIFHWADDR` from `<linux/sockios.h>`.
const SIOCGIFHWADDR: libc::c_ulong = 0x8927;
/// `SIOCGIFMTU` from `<linux/sockios.h>`.
const SIOCGIFMTU: libc::c_ulong = 0x8921;

/// A `struct ifreq` (40 bytes on 64-bit Linux) naming `iface`.
fn ifreq(iface: &str) -> [u8; 40] {
    let mut r = [0u8; 40];
    r[..iface.len()].copy_from_slice(iface.as_bytes());
    r
}

fn ioctl(fd: &OwnedFd, req: libc::c_ulong, ifr: &mut [u8; 40]) -> io::Result<()> {
    // SAFETY: both requests read the name from and write at most 24 bytes into a live 40-byte
    // buffer laid out as `struct ifreq`.
    sys(unsafe { libc::ioctl(fd.as_raw_fd(), req, ifr.as_mut_ptr()) }).map(|_| ())
}

/// A raw AF_PACKET socket bound to `iface` and frames of `ethertype` (needs CAP_NET_RAW),
/// non-blocking if asked, and the interface's index.
pub fn packet_socket(iface: &str, ethertype: u16, nonblocking: bool) -> io::Result<(OwnedFd, u32)> {
    let name = std::ffi::CString::new(iface).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    if iface.len() >= 16 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{iface}: name too long")));
    }
    // SAFETY: `name` is a NUL-terminated string that lives across the call.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("{iface}: no such interface")));
    }
    let proto = ethertype.to_be();
    let flags = libc::SOCK_RAW | libc::SOCK_CLOEXEC | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: socket takes integers and returns a new descriptor or -1.
    let raw = sys(unsafe { libc::socket(libc::AF_PACKET, flags, proto as i32) })?;
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: an all-zero sockaddr_ll is a valid value of the plain C struct.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: `sll` is a live sockaddr_ll and the length passed is its size.
    sys(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    })?;
    Ok((fd, ifindex))
}

impl PacketTransport {
    /// Opens a raw socket on `iface` receiving frames of `ethertype` (needs CAP_NET_RAW).
    pub fn open(iface: &str, ethertype: u16) -> io::Result<Self> {
        let (fd, _) = packet_socket(iface, ethertype, true)?;
        let one: libc::c_int = 1;
        // SAFETY: the option value is a live c_int and the length is its size.
        let _ = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_IGNORE_OUTGOING,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        // Ask the socket (so the answer is from this network namespace, whatever /sys shows).
        let mac = {
            let mut req = ifreq(iface);
            ioctl(&fd, SIOCGIFHWADDR, &mut req)?;
            let mut o = [0u8; 6];
            o.copy_from_slice(&req[18..24]);
            MacAddr(o)
        };
        let mtu = {
            let mut req = ifreq(iface);
            ioctl(&fd, SIOCGIFMTU, &mut req)?;
            i32::from_ne_bytes(req[16..20].try_into().expect("4 bytes")) as usize
        };
        let cap = mtu + tyche_wire::ETH_HEADER_LEN;
        Ok(PacketTransport { fd, mac, mtu, rx: vec![0; cap], tx: vec![0; cap] })
    }

    /// Sends one whole frame as it is, source MAC included (the kernel sends what it is given),
    /// without waiting. Unlike [`FrameTransport::transmit`], which counts a frame the kernel could
    /// not take as lost, this says why: `WouldBlock` when the socket's buffer is full, `ENOBUFS`
    /// when the device dropped it (a veth whose peer's ring is full), so that a caller (the flood
    /// test's sender, `tyche-flood`) can retry it.
    pub fn send_frame(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: reads `frame.len()` bytes from the live slice.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), libc::MSG_DONTWAIT) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl FrameTransport for PacketTransport {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(self.mtu + tyche_wire::ETH_HEADER_LEN, self.mtu, self.mac)
    }

    fn receive(&mut self, budget: usize, _rx: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        let mut n = 0;
        while n < budget {
            // SAFETY: writes at most `self.rx.len()` bytes into the live buffer.
            let got = unsafe {
                libc::recv(self.fd.as_raw_fd(), self.rx.as_mut_ptr().cast(), self.rx.len(), libc::MSG_DONTWAIT)
            };
            if got < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(n),
                    _ => Err(e),
                };
            }
            on_frame(&[&self.rx[..got as usize]], None);
            n += 1;
        }
        Ok(n)
    }

    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        transmit_here(budget, fill, |budget, fill| self.send_here(budget, fill))
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd.as_fd())
    }
}

impl PacketTransport {
    fn send_here(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> io::Result<usize> {
        let mut n = 0;
        while n < budget {
            let Some(len) = fill(&mut self.tx) else { break };
            if len == 0 {
                continue;
            }
            // SAFETY: reads `len` bytes (checked against the buffer) from the live buffer.
            let sent = unsafe {
                libc::send(self.fd.as_raw_fd(), self.tx.as_ptr().cast(), len.min(self.tx.len()), libc::MSG_DONTWAIT)
            };
            if sent < 0 {
                let e = io::Error::last_os_error();
                // A full socket buffer loses the frame, as a full NIC ring would: the channel
                // retransmits.
                if e.kind() != io::ErrorKind::WouldBlock {
                    return Err(e);
                }
            }
            n += 1;
        }
        Ok(n)
    }
}
