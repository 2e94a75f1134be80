//! Why a received frame was not used (a leaf: the channel and the frame authentication both
//! report drops).

/// Why a frame was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Already received (a retransmission whose original arrived).
    Duplicate,
    /// Ring position outside the receive window.
    OutOfWindow,
    /// A message this end's role never receives (e.g. a REQUEST at the initiator).
    WrongRole,
    /// A slot index out of range or in the wrong state.
    BadSlot,
    /// Data or a completion for a request the slot no longer holds.
    Stale,
    /// Segment fields that disagree with each other or with the negotiated parameters.
    Inconsistent,
    /// The channel is dead.
    Dead,
    /// A message that does not belong on an established channel (CONNECT, DISCOVER, ...).
    Unexpected,
    /// On a keyed channel: no authentication trailer, or a tag that does not verify (a forged
    /// or altered frame).
    Unauthenticated,
    /// On a keyed channel: an authentic frame whose counter was already accepted, or is older
    /// than the replay window (a replayed frame).
    Replayed,
    /// On a channel with feature DIGEST: a DATA frame whose payload does not match its CRC32C
    /// (corrupted on the way; it is sent again).
    BadDigest,
}

impl DropReason {
    /// Every reason, for counters.
    pub const ALL: [DropReason; 11] = [
        DropReason::Duplicate,
        DropReason::OutOfWindow,
        DropReason::WrongRole,
        DropReason::BadSlot,
        DropReason::Stale,
        DropReason::Inconsistent,
        DropReason::Dead,
        DropReason::Unexpected,
        DropReason::Unauthenticated,
        DropReason::Replayed,
        DropReason::BadDigest,
    ];
    /// A short stable name for counters and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Duplicate => "duplicate",
            DropReason::OutOfWindow => "out_of_window",
            DropReason::WrongRole => "wrong_role",
            DropReason::BadSlot => "bad_slot",
            DropReason::Stale => "stale",
            DropReason::Inconsistent => "inconsistent",
            DropReason::Dead => "dead",
            DropReason::Unexpected => "unexpected",
            DropReason::Unauthenticated => "unauthenticated",
            DropReason::Replayed => "replayed",
            DropReason::BadDigest => "bad_digest",
        }
    }
}
