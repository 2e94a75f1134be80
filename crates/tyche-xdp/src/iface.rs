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
