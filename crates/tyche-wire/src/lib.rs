//! Tyche's wire format.
//!
//! Every Tyche frame is an Ethernet II frame with Tyche's EtherType ([`DEFAULT_ETHERTYPE`] unless
//! configured otherwise), followed by a 16-byte common [header](layout::common), a message body
//! whose layout depends on the message [`Kind`], and, for data segments only, the payload.
//! All multi-byte integers are big-endian. `docs/protocol.md` describes every byte; the offsets
//! in [`layout`] are the single source of truth from which the XDP program's C header is
//! generated.
//!
//! # Promises
//! - Parsing never panics and never allocates: every malformed, truncated or inconsistent frame
//!   yields a [`WireError`]. [`Frame::new_checked`] validates the lengths once, after which no
//!   accessor of that frame can panic.
//! - Parsing borrows: a data segment's payload is a sub-slice of the received buffer, so a frame
//!   can be parsed in place in a UMEM chunk and its payload placed or retained without copies.
//! - Emitting writes exactly [`Message::frame_len`] bytes and panics only if the caller's buffer is
//!   shorter than that (a programming error, not bad input).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
pub mod layout;
mod mac;
mod message;

pub use error::WireError;
pub use mac::MacAddr;
pub use message::*;

/// Tyche's EtherType when none is configured (IEEE 802 local experimental EtherType 1).
pub const DEFAULT_ETHERTYPE: u16 = 0x88B5;
/// The protocol version this crate speaks. A frame with another version is rejected.
pub const VERSION: u8 = 3;
/// Length of the Ethernet II header (destination, source, EtherType).
pub const ETH_HEADER_LEN: usize = 14;
/// Ethernet's minimum frame length without the FCS; shorter frames are padded with zeros.
pub const ETH_MIN_FRAME_LEN: usize = 60;
/// Logical block size every offset and length in a request is a multiple of.
pub const SECTOR_SIZE: u32 = 512;
/// Longest export name, in bytes of UTF-8.
pub const MAX_EXPORT_NAME: usize = 64;
/// Value of a `damq` slot field that names no slot (requests without data: FLUSH, DISCARD, ...).
pub const NO_SLOT: u16 = u16::MAX;

/// Result of parsing.
pub type Result<T> = core::result::Result<T, WireError>;

/// Bytes of Ethernet and Tyche header in front of a data segment's payload.
pub const DATA_FRAME_OVERHEAD: usize = ETH_HEADER_LEN + layout::data::PAYLOAD;

/// The largest power-of-two segment payload (at least 512 bytes) that fits both the link MTU
/// (bytes after the Ethernet header, as `ip link` reports it) and a transport buffer of
/// `frame_capacity` bytes (Ethernet header included; for AF_XDP, the UMEM chunk minus headroom).
///
/// Returns `None` when not even a 512-byte segment fits, which the caller must report as a
/// configuration error rather than let frames be dropped silently.
///
/// Room for the authentication trailer of a sealed frame ([`layout::trailer`]) is always left,
/// so that a keyed export's segments fit the same links.
pub fn segment_size_for(mtu: usize, frame_capacity: usize) -> Option<u32> {
    let by_mtu = mtu.checked_sub(layout::data::PAYLOAD + layout::trailer::END)?;
    let by_buffer = frame_capacity.checked_sub(DATA_FRAME_OVERHEAD + layout::trailer::END)?;
    let fit = by_mtu.min(by_buffer).min(u16::MAX as usize);
    if fit < SECTOR_SIZE as usize {
        return None;
    }
    // Largest power of two <= fit.
    Some(1u32 << (usize::BITS - 1 - fit.leading_zeros()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_sizes_follow_mtu_and_chunk() {
        // 4 KiB UMEM chunk, 256 B XDP headroom, 194 B frame headroom: 3646 bytes per frame.
        assert_eq!(segment_size_for(1500, 3646), Some(1024));
        assert_eq!(segment_size_for(2200, 3646), Some(2048));
        assert_eq!(segment_size_for(3000, 3646), Some(2048));
        assert_eq!(segment_size_for(3500, 3646), Some(2048));
        // Jumbo multi-buffer links: the frame spans several chunks.
        assert_eq!(segment_size_for(9000, 9014), Some(8192));
        assert_eq!(segment_size_for(4200, 9014), Some(4096));
        // 2 KiB chunk (1792 bytes per frame) caps a 3000 MTU link at 1 KiB.
        assert_eq!(segment_size_for(3000, 1792), Some(1024));
        assert_eq!(segment_size_for(500, 3646), None);
        assert_eq!(segment_size_for(20, 3646), None);
    }
}
