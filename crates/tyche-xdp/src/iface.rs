//! What the port needs to know about a network interface, read with ioctls in the calling
//! thread's network namespace (sysfs may show another namespace's view).

use std::ffi::CString;
use std::io;

use tyche_wire::MacAddr;

use crate::Error;

/// Index, MTU and MAC address of an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceInfo {
    /// Name.
    pub name: String,
    /// Index (`if_nametoindex`).
    pub index: u32,
    /// MTU: bytes after the Ethernet header.
    pub mtu: usize,
    /// Hardware address.
    pub mac: MacAddr,
}

impl InterfaceInfo {
    /// Looks `name` up in the calling thread's network namespace.
    pub fn query(name: &str) -> Result<Self, Error> {
        let cname = CString::new(name).map_err(|_| Error::NoInterface(name.to_string()))?;
        if name.len() >= libc::IFNAMSIZ {
            return Err(Error::NoInterface(name.to_string()));
        }
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
        let index = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if index == 0 {
            return Err(Error::NoInterface(name.to_string()));
        }
        // SAFETY: plain socket(2) call; the result is checked and closed below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(Error::io("socket for interface ioctls", io::Error::last_os_error()));
        }
        let result = (|| {
            // SAFETY: `ifreq` is plain old data; all-zero is a valid value.
            let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
            for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
                *dst = src as libc::c_char;
            }
            // SAFETY: `req` is a valid ifreq with the name set; SIOCGIFMTU writes `ifru_mtu`.
            if unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut req) } < 0 {
                return Err(Error::io(format!("SIOCGIFMTU {name}"), io::Error::last_os_error()));
            }
            // SAFETY: the ioctl above succeeded and filled the `ifru_mtu` member.
            let mtu = unsafe { req.ifr_ifru.ifru_mtu } as usize;
            // SAFETY: as above; SIOCGIFHWADDR writes `ifru_hwaddr`.
            if unsafe { libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut req) } < 0 {
                return Err(Error::io(format!("SIOCGIFHWADDR {name}"), io::Error::last_os_error()));
            }
            // SAFETY: the ioctl above succeeded and filled the `ifru_hwaddr` member.
            let sa = unsafe { req.ifr_ifru.ifru_hwaddr };
            let mut mac = [0u8; 6];
            for (d, s) in mac.iter_mut().zip(sa.sa_data.iter()) {
                *d = *s as u8;
            }
            Ok(InterfaceInfo { name: name.to_string(), index, mtu, mac: MacAddr(mac) })
        })();
        // SAFETY: `fd` is the socket opened above, closed exactly once.
        unsafe { libc::close(fd) };
        result
    }
}

/// How many queues `name` has for AF_XDP, one socket each: the smaller of its receive and
/// transmit queue counts (`/sys/class/net/NAME/queues/rx-*` and `tx-*`, as the calling process's
/// network namespace sees them). veth has one unless made with `numrxqueues`/`numtxqueues`.
pub fn queue_count(name: &str) -> Result<u32, Error> {
    queue_count_in(std::path::Path::new("/sys/class/net"), name)
}

fn queue_count_in(root: &std::path::Path, name: &str) -> Result<u32, Error> {
    if name.is_empty() || name.contains('/') || name.len() >= libc::IFNAMSIZ {
        return Err(Error::NoInterface(name.to_string()));
    }
    let dir = root.join(name).join("queues");
    let entries = std::fs::read_dir(&dir).map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
    let (mut rx, mut tx) = (0u32, 0u32);
    for entry in entries.flatten() {
        let file = entry.file_name();
        let n = file.to_string_lossy();
        if n.starts_with("rx-") {
            rx += 1;
        } else if n.starts_with("tx-") {
            tx += 1;
        }
    }
    Ok(rx.min(tx))
}

#[cfg(test)]
mod queue_tests {
    use super::*;

    #[test]
    fn queues_are_the_smaller_of_rx_and_tx() {
        let root = tempfile::tempdir().expect("temp dir");
        for q in ["rx-0", "rx-1", "rx-2", "tx-0", "tx-1", "other"] {
            std::fs::create_dir_all(root.path().join("eth9/queues").join(q)).expect("mkdir");
        }
        assert_eq!(queue_count_in(root.path(), "eth9").expect("counted"), 2);
        assert!(queue_count_in(root.path(), "missing").is_err());
        assert!(queue_count_in(root.path(), "../etc").is_err());
        assert!(queue_count_in(root.path(), "").is_err());
        // Loopback always exists here and has at least one queue of each.
        assert!(queue_count("lo").expect("lo") >= 1);
    }
}
