use tyche_channel::SubmitError;
use tyche_wire::{RejectReason, Status};

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The target completed the request with this status.
    #[error("target reported {0:?}")]
    Target(Status),
    /// No channel was alive for the no-path timeout.
    #[error("no path to the target (every channel down for the no-path timeout)")]
    NoPath,
    /// Offset or length not a multiple of 512 bytes, or a zero-length read or write.
    #[error("offset and length must be multiples of 512 bytes")]
    Unaligned,
    /// The range runs past the end of the export.
    #[error("range past the end of the export")]
    OutOfRange,
    /// A modifying request on a read-only export.
    #[error("export is read-only")]
    ReadOnly,
    /// The export does not support the operation.
    #[error("operation not supported by the export")]
    Unsupported,
    /// The engine thread has stopped (the client was closed).
    #[error("initiator engine stopped")]
    Closed,
}

impl From<SubmitError> for Error {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Unaligned => Error::Unaligned,
            SubmitError::OutOfRange => Error::OutOfRange,
            SubmitError::ReadOnly => Error::ReadOnly,
            // The engine retries Busy and allocates ids itself; these never reach a caller.
            SubmitError::Busy | SubmitError::DuplicateId => Error::Target(Status::Invalid),
        }
    }
}

impl Error {
    /// The errno this error maps to (for NBD replies and ublk completions).
    pub fn errno(self) -> i32 {
        match self {
            Error::Target(Status::ReadOnly) | Error::ReadOnly => libc::EPERM,
            Error::Target(Status::OutOfRange | Status::Invalid) | Error::Unaligned | Error::OutOfRange => libc::EINVAL,
            Error::Target(Status::Unsupported) | Error::Unsupported => libc::EOPNOTSUPP,
            Error::Target(Status::NoSpace) => libc::ENOSPC,
            Error::Closed => libc::ESHUTDOWN,
            Error::Target(Status::Ok | Status::IoError | Status::Aborted) | Error::NoPath => libc::EIO,
        }
    }
}

/// Why a session could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectError {
    /// No links were given.
    #[error("no links to connect over")]
    NoLinks,
    /// The target has no export of that name.
    #[error("target {target} has no export named {export:?}")]
    UnknownExport {
        /// Target MAC.
        target: String,
        /// Export asked for.
        export: String,
    },
    /// The export needs a key and none was given, or the key was wrong.
    #[error("export {export:?}: {reason:?} (give the export's pre-shared key with --key FILE, or check it)")]
    Auth {
        /// Export asked for.
        export: String,
        /// Target's reason.
        reason: RejectReason,
    },
    /// The target refused for another reason.
    #[error("target {target} refused the connection on {link}: {reason:?}")]
    Refused {
        /// Target MAC.
        target: String,
        /// Link name.
        link: String,
        /// Target's reason.
        reason: RejectReason,
    },
    /// No answer on any link.
    #[error("no answer from target {target} for export {export:?} on {links} (timed out)")]
    Timeout {
        /// Target MAC.
        target: String,
        /// Export asked for.
        export: String,
        /// Links tried.
        links: String,
    },
    /// The handshake failed otherwise (unusable parameters granted, a bad key proof).
    #[error("handshake with the target failed on {link}: {detail}")]
    Handshake {
        /// Link name.
        link: String,
        /// What went wrong.
        detail: String,
    },
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A transport failed.
    #[error("transport error on {link}: {message}")]
    Transport {
        /// Link name.
        link: String,
        /// The error.
        message: String,
    },
    /// The engine thread stopped before the session opened.
    #[error("initiator engine stopped")]
    EngineGone,
}
