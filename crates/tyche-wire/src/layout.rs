//! Byte offsets of every field, relative to the start of the Tyche header (the first byte after
//! the Ethernet header). Each module is one header; `END` (or `PAYLOAD`) is its length.
//!
//! These constants are the single source of truth: `docs/protocol.md` tables and the XDP
//! program's `bpf/tyche_wire.h` are generated from / checked against them.

/// Field `[start, end)` as a range constant.
pub type Field = core::ops::Range<usize>;

/// The common header that starts every Tyche message.
pub mod common {
    use super::Field;
    /// Protocol version, `u8`.
    pub const VERSION: usize = 0;
    /// Message kind, `u8`.
    pub const KIND: usize = 1;
    /// Flags, `u16`: the low byte is kind-specific, the high byte is reserved (sent as zero,
    /// ignored on receipt).
    pub const FLAGS: Field = 2..4;
    /// Bytes of Tyche message (this header, the body and any payload), `u16`; Ethernet padding
    /// after it is ignored.
    pub const LENGTH: Field = 4..6;
    /// Channel index within the session, `u16`.
    pub const CHANNEL: Field = 6..8;
    /// Session id, `u64`; zero before a session exists (discovery, connect).
    pub const SESSION: Field = 8..16;
    /// Length of the common header.
    pub const END: usize = 16;
}

/// Sequencing fields shared by every sequenced message (request, completion, data).
pub mod seq {
    use super::Field;
    /// Ring position of this frame in the receiver's RX ring (a wrapping `u32` sequence number;
    /// the slot is `seq % ring_size`).
    pub const SEQ: Field = 16..20;
    /// Piggybacked cumulative acknowledgement: every frame of the peer with a sequence number
    /// below this one was received, `u32`.
    pub const ACK: Field = 20..24;
    /// End of the sequencing fields.
    pub const END: usize = 24;
}

/// REQUEST: initiator to target, one I/O request.
pub mod request {
    use super::Field;
    /// Operation, `u8` (see `Op`).
    pub const OP: usize = 24;
    /// Request flags, `u8` (bit 0: FUA).
    pub const REQ_FLAGS: usize = 25;
    /// `remq` slot of this request, `u16`.
    pub const REMQ: Field = 26..28;
    /// `damq` slot holding its data, `u16` (`0xffff` for none).
    pub const DAMQ: Field = 28..30;
    /// Home channel, `u16`: the index of the channel the tag was first issued on in this
    /// session, kept when it is re-issued on another; the target keeps the tag's at-most-once
    /// record with that channel.
    pub const HOME: Field = 30..32;
    /// Request tag, `u64`: unique and increasing per session, kept across re-issue on another
    /// channel so the target executes each write at most once.
    pub const TAG: Field = 32..40;
    /// Tag floor, `u64`: every tag below it has completed at the initiator and will never be
    /// sent again.
    pub const FLOOR: Field = 40..48;
    /// Byte offset in the export, `u64`, a multiple of 512.
    pub const OFFSET: Field = 48..56;
    /// Length in bytes, `u32`, a multiple of 512 (zero for FLUSH).
    pub const LENGTH: Field = 56..60;
    /// Reserved, `u32`, zero.
    pub const RESERVED1: Field = 60..64;
    /// End of the request message.
    pub const END: usize = 64;
}

/// COMPLETION: target to initiator, the outcome of one request.
pub mod completion {
    use super::Field;
    /// Status, `u16` (see `Status`).
    pub const STATUS: Field = 24..26;
    /// `remq` slot of the request, `u16`.
    pub const REMQ: Field = 26..28;
    /// `damq` slot of the request, `u16`.
    pub const DAMQ: Field = 28..30;
    /// Reserved, `u16`, zero.
    pub const RESERVED0: Field = 30..32;
    /// Tag of the request, `u64`.
    pub const TAG: Field = 32..40;
    /// End of the completion message.
    pub const END: usize = 40;
}

/// DATA: one segment of a data message (write data to the target, read data to the initiator).
pub mod data {
    use super::Field;
    /// `damq` slot the payload belongs in, `u16`.
    pub const DAMQ: Field = 24..26;
    /// Index of this segment in the message, `u16`.
    pub const SEG_INDEX: Field = 26..28;
    /// Number of segments in the message, `u16`.
    pub const SEG_COUNT: Field = 28..30;
    /// Reserved, `u16`, zero.
    pub const RESERVED0: Field = 30..32;
    /// Tag of the request the data belongs to (the message id), `u64`.
    pub const TAG: Field = 32..40;
    /// Byte offset of this payload within the message, `u32` (`seg_index * segment_size`).
    pub const OFFSET: Field = 40..44;
    /// With feature `DIGEST`: CRC32C (Castagnoli) of the payload, `u32`; else zero (ignored).
    pub const DIGEST: Field = 44..48;
    /// Start of the payload; the payload runs to the end of the Tyche message.
    pub const PAYLOAD: usize = 48;
}

/// The block status list: the read data of a BLOCK_STATUS request, in its `damq` slot. Offsets
/// here are from the start of the list (the data message's first payload byte), not from the
/// Tyche header.
pub mod block_status {
    use super::Field;
    /// Number of extents that follow, `u32`, 1 to [`MAX_EXTENTS`].
    pub const COUNT: Field = 0..4;
    /// Reserved, zero.
    pub const RESERVED0: Field = 4..16;
    /// First extent; extents follow one another, [`EXTENT_LEN`] bytes each.
    pub const EXTENTS: usize = 16;
    /// Within an extent: bytes it covers, `u64`, a positive multiple of 512.
    pub const EXTENT_LENGTH: Field = 0..8;
    /// Within an extent: flags, `u32` (bit 0 HOLE, bit 1 ZERO).
    pub const EXTENT_FLAGS: Field = 8..12;
    /// Within an extent: reserved, `u32`, zero.
    pub const EXTENT_RESERVED: Field = 12..16;
    /// Length of an extent.
    pub const EXTENT_LEN: usize = 16;
    /// Length of the list (zeroes after the last extent): one sector, so it fits one segment.
    pub const LEN: usize = 512;
    /// Most extents in a list.
    pub const MAX_EXTENTS: usize = (LEN - EXTENTS) / EXTENT_LEN;
}

/// ACK and NACK: unsequenced acknowledgements.
pub mod ack {
    use super::Field;
    /// ACK: cumulative acknowledgement (every sequence number below it was received).
    /// NACK: base sequence number of the `BITMAP`.
    pub const SEQ: Field = 16..20;
    /// Reserved, `u32`, zero.
    pub const RESERVED0: Field = 20..24;
    /// ACK: bit `i` set means `SEQ + 1 + i` was received (selective acknowledgement).
    /// NACK: bit `i` set means `SEQ + i` is missing and should be retransmitted now.
    pub const BITMAP: Field = 24..32;
    /// End of the message.
    pub const END: usize = 32;
}

/// KEEPALIVE: liveness probe and its echo (flag `REPLY`).
pub mod keepalive {
    use super::Field;
    /// Nonce chosen by the prober, echoed in the reply, `u64`.
    pub const NONCE: Field = 16..24;
    /// Prober's clock in nanoseconds when sent, echoed in the reply (RTT samples), `u64`.
    pub const TIMESTAMP: Field = 24..32;
    /// End of the message.
    pub const END: usize = 32;
}

/// DISCONNECT: the sender tears the channel down.
pub mod disconnect {
    use super::Field;
    /// Reason, `u16` (see `DisconnectReason`).
    pub const REASON: Field = 16..18;
    /// Reserved, zero.
    pub const RESERVED0: Field = 18..24;
    /// End of the message.
    pub const END: usize = 24;
}

/// DISCOVER: who serves which exports on this link (sent to broadcast or one target).
pub mod discover {
    use super::Field;
    /// Nonce echoed in the replies, `u32`.
    pub const NONCE: Field = 16..20;
    /// Index of the first export wanted (for listings longer than one frame), `u16`.
    pub const START: Field = 20..22;
    /// Reserved, zero.
    pub const RESERVED0: Field = 22..24;
    /// End of the message.
    pub const END: usize = 24;
}

/// DISCOVER_REPLY: a page of the target's export list.
pub mod discover_reply {
    use super::Field;
    /// Nonce of the DISCOVER being answered, `u32`.
    pub const NONCE: Field = 16..20;
    /// Number of exports the target has in all, `u16`.
    pub const TOTAL: Field = 20..22;
    /// Index of the first entry in this frame, `u16`.
    pub const START: Field = 22..24;
    /// Number of entries in this frame, `u16`.
    pub const COUNT: Field = 24..26;
    /// Reserved, zero.
    pub const RESERVED0: Field = 26..32;
    /// First entry. Each entry: size `u64`, block size `u32`, export flags `u16`, name length
    /// `u8`, reserved `u8`, then the name (UTF-8, no terminator).
    pub const ENTRIES: usize = 32;
    /// Bytes of an entry before its name.
    pub const ENTRY_FIXED: usize = 16;
}

/// CONNECT: initiator asks to open a channel (a new session when the session id is zero, or a
/// further channel of an existing session).
pub mod connect {
    use super::Field;
    /// Initiator's nonce, `u64`, echoed by CHALLENGE/ACCEPT/REJECT.
    pub const NONCE: Field = 16..24;
    /// Ring positions wanted per direction (a power of two), `u16`.
    pub const RING: Field = 24..26;
    /// `remq` slots wanted, `u16`.
    pub const REMQ_SLOTS: Field = 26..28;
    /// `damq` slots wanted, `u16`.
    pub const DAMQ_SLOTS: Field = 28..30;
    /// Segment payload bytes wanted (a power of two, at least 512), `u16`.
    pub const SEGMENT: Field = 30..32;
    /// Bytes per `damq` slot wanted (largest request), `u32`.
    pub const MAX_IO: Field = 32..36;
    /// Feature bits wanted, `u32`.
    pub const FEATURES: Field = 36..40;
    /// Proof of the pre-shared key (flag `PROOF`), 32 bytes, else zero.
    pub const PROOF: Field = 40..72;
    /// Export name length, `u8`.
    pub const NAME_LEN: usize = 72;
    /// Reserved, zero.
    pub const RESERVED0: Field = 73..80;
    /// Export name, UTF-8, `NAME_LEN` bytes.
    pub const NAME: usize = 80;
    /// With flag `HOST_ID`: bytes of the initiator's host id right after the name (the message
    /// then ends at `NAME + NAME_LEN + HOST_ID_LEN`).
    pub const HOST_ID_LEN: usize = 16;
}

/// CHALLENGE: target asks the initiator to prove it holds the export's key.
pub mod challenge {
    use super::Field;
    /// The initiator's nonce, echoed, `u64`.
    pub const NONCE: Field = 16..24;
    /// The target's nonce, `u64`.
    pub const TARGET_NONCE: Field = 24..32;
    /// End of the message.
    pub const END: usize = 32;
}

/// ACCEPT: target grants a channel, with the parameters it accepted (never more than asked).
pub mod accept {
    use super::Field;
    /// The initiator's nonce, echoed, `u64`.
    pub const NONCE: Field = 16..24;
    /// Ring positions granted, `u16`.
    pub const RING: Field = 24..26;
    /// `remq` slots granted, `u16`.
    pub const REMQ_SLOTS: Field = 26..28;
    /// `damq` slots granted, `u16`.
    pub const DAMQ_SLOTS: Field = 28..30;
    /// Segment payload bytes granted, `u16`.
    pub const SEGMENT: Field = 30..32;
    /// Bytes per `damq` slot granted, `u32`.
    pub const MAX_IO: Field = 32..36;
    /// Feature bits granted, `u32`.
    pub const FEATURES: Field = 36..40;
    /// Export size in bytes, `u64`.
    pub const EXPORT_SIZE: Field = 40..48;
    /// Export logical block size, `u32`.
    pub const BLOCK_SIZE: Field = 48..52;
    /// Export flags, `u16`.
    pub const EXPORT_FLAGS: Field = 52..54;
    /// Reserved, zero.
    pub const RESERVED0: Field = 54..56;
    /// Target's proof of the pre-shared key (flag `PROOF`), 32 bytes, else zero.
    pub const PROOF: Field = 56..88;
    /// The export's durability epoch, 16 bytes: names the target-side cache domain that
    /// acknowledged writes live in; writes acknowledged under an epoch survive as long as the
    /// target presents the same epoch again. All zero: no promise (never matches).
    pub const DURABILITY_EPOCH: Field = 88..104;
    /// The channel's target address, 6 bytes: the MAC the initiator sends this channel's
    /// frames to and accepts them from (a target that steers each channel to its own NIC queue
    /// by destination MAC names that queue's address). All zero, or the ACCEPT's source: the
    /// address the CONNECT went to.
    pub const CHANNEL_MAC: Field = 104..110;
    /// Reserved, zero.
    pub const RESERVED1: Field = 110..112;
    /// End of the message.
    pub const END: usize = 112;
}

/// REJECT: target refuses a CONNECT.
pub mod reject {
    use super::Field;
    /// The initiator's nonce, echoed, `u64`.
    pub const NONCE: Field = 16..24;
    /// Reason, `u16` (see `RejectReason`).
    pub const REASON: Field = 24..26;
    /// With reason `IN_USE`: MAC of the initiator holding the export, else zero.
    pub const HOLDER: Field = 26..32;
    /// End of the message.
    pub const END: usize = 32;
}

/// The authentication trailer of a sealed frame (common header flag `SEALED`): it follows the
/// message, at `LENGTH` from the start of the Tyche header, outside `LENGTH`.
pub mod trailer {
    use super::Field;
    /// The sender's frame counter for this channel and direction, `u64`: the AEAD nonce.
    pub const COUNTER: Field = 0..8;
    /// The AEAD tag (AES-256-GCM), 16 bytes.
    pub const TAG: Field = 8..24;
    /// Length of the trailer.
    pub const END: usize = 24;
}

/// Where encryption starts in a sealed frame of an encrypting channel: everything after the
/// common header is ciphertext (offset from the start of the Tyche header).
pub const SEALED_PLAINTEXT_START: usize = common::END;
