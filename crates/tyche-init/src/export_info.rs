//! What a session attached: the export as the target granted it.

/// What the session attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Export name.
    pub export: String,
    /// Size in bytes.
    pub size: u64,
    /// Logical block size.
    pub block_size: u32,
    /// Whether the export is read-only.
    pub read_only: bool,
    /// Whether DISCARD is supported.
    pub discard: bool,
    /// Session id.
    pub session: u64,
    /// Largest request part the first channel carries (larger requests are split).
    pub max_io: u32,
}
