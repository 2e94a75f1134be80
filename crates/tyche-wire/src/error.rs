use core::fmt;

/// Why a frame was rejected.
///
/// A small `Copy` value rather than a zero-sized one, so that receivers can count drops by reason
/// without allocating. It carries no offsets: a bad peer gets no more than a counter and a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum WireError {
    /// The buffer ends before a header or body that its fields say is there.
    Truncated = 1,
    /// The EtherType is not the configured Tyche EtherType.
    NotTyche = 2,
    /// The version field is not [`crate::VERSION`].
    Version = 3,
    /// The message kind is not one this version defines.
    UnknownKind = 4,
    /// The length field disagrees with the message kind or with the bytes received.
    BadLength = 5,
    /// A field holds a value the protocol does not allow (an unknown opcode, an unaligned
    /// offset, an over-long name, an inconsistent segment index, ...).
    Malformed = 6,
}

impl WireError {
    /// Every variant, for counters indexed by reason.
    pub const ALL: [WireError; 6] = [
        WireError::Truncated,
        WireError::NotTyche,
        WireError::Version,
        WireError::UnknownKind,
        WireError::BadLength,
        WireError::Malformed,
    ];

    /// A short stable name, for counters and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            WireError::Truncated => "truncated",
            WireError::NotTyche => "not_tyche",
            WireError::Version => "version",
            WireError::UnknownKind => "unknown_kind",
            WireError::BadLength => "bad_length",
            WireError::Malformed => "malformed",
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self {
            WireError::Truncated => "frame truncated",
            WireError::NotTyche => "not a Tyche frame (EtherType)",
            WireError::Version => "unsupported Tyche version",
            WireError::UnknownKind => "unknown Tyche message kind",
            WireError::BadLength => "Tyche length field inconsistent",
            WireError::Malformed => "malformed Tyche message field",
        };
        f.write_str(what)
    }
}

impl std::error::Error for WireError {}
