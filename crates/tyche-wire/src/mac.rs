use core::fmt;
use core::str::FromStr;

use crate::WireError;

/// A 48-bit Ethernet (MAC) address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The broadcast address, used for discovery.
    pub const BROADCAST: MacAddr = MacAddr([0xff; 6]);
    /// The all-zero address (no address).
    pub const ZERO: MacAddr = MacAddr([0; 6]);

    /// The six bytes in wire order.
    pub fn octets(self) -> [u8; 6] {
        self.0
    }

    /// Whether this is a group (multicast or broadcast) address.
    pub fn is_multicast(self) -> bool {
        self.0[0] & 1 == 1
    }

    /// A locally administered unicast address derived from `n`, for labs and tests.
    pub fn local(n: u32) -> MacAddr {
        let b = n.to_be_bytes();
        MacAddr([0x02, 0x54, b[0], b[1], b[2], b[3]])
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(f, "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3], b[4], b[5])
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for MacAddr {
    type Err = WireError;

    /// Parses `aa:bb:cc:dd:ee:ff` (or with `-` separators), case-insensitive.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 6];
        let mut parts = s.split([':', '-']);
        for byte in &mut out {
            let part = parts.next().ok_or(WireError::Malformed)?;
            // Two hex digits exactly (`from_str_radix` alone would also take a sign: "+f").
            if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(WireError::Malformed);
            }
            *byte = u8::from_str_radix(part, 16).map_err(|_| WireError::Malformed)?;
        }
        if parts.next().is_some() {
            return Err(WireError::Malformed);
        }
        Ok(MacAddr(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_print() {
        let m: MacAddr = "02:54:0A:0b:0c:0d".parse().unwrap();
        assert_eq!(m.0, [0x02, 0x54, 0x0a, 0x0b, 0x0c, 0x0d]);
        assert_eq!(m.to_string(), "02:54:0a:0b:0c:0d");
        assert_eq!("02-54-0a-0b-0c-0d".parse::<MacAddr>().unwrap(), m);
        for bad in [
            "",
            "02:54",
            "02:54:0a:0b:0c:0d:0e",
            "2:54:0a:0b:0c:0d",
            "zz:54:0a:0b:0c:0d",
            "+2:54:0a:0b:0c:0d",
            "02:54:0a:0b:0c:+d",
        ] {
            assert_eq!(bad.parse::<MacAddr>(), Err(WireError::Malformed), "{bad}");
        }
        assert!(MacAddr::BROADCAST.is_multicast());
        assert!(!MacAddr::local(7).is_multicast());
    }
}
