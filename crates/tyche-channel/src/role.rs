//! Which end of a channel this is (a leaf: the channel and the frame authentication both ask).

/// Which end of the channel this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Submits requests, sends write data, receives read data and completions.
    Initiator,
    /// Executes requests, receives write data, sends read data and completions.
    Target,
}
