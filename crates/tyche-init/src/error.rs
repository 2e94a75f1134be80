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
    /// The target answered with data that breaks the protocol (a malformed block status list).
    #[error("malformed answer from the target")]
    BadReply,
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
            Error::Target(Status::Ok | Status::IoError | Status::Aborted) | Error::NoPath | Error::BadReply => {
                libc::EIO
            }
        }
    }
}

/// Why a session could not be opened.
#[derive(Debug, thiserror::Error)]
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
    #[error("target {target} refused export {export:?} on {link}: {} (give the export's pre-shared key with --key FILE, or check it)", describe(*reason))]
    Auth {
        /// Target MAC.
        target: String,
        /// Export asked for.
        export: String,
        /// Link name.
        link: String,
        /// Target's reason.
        reason: RejectReason,
    },
    /// Another initiator has the export attached.
    #[error("target {target} refused export {export:?} on {link}: it is attached by the initiator with MAC {holder} (detach it there, or make the export shared)")]
    InUse {
        /// Target MAC.
        target: String,
        /// Export asked for.
        export: String,
        /// Link name.
        link: String,
        /// MAC of the initiator holding it.
        holder: String,
    },
    /// The target refused for another reason.
    #[error("target {target} refused export {export:?} on {link}: {}", describe(*reason))]
    Refused {
        /// Target MAC.
        target: String,
        /// Export asked for.
        export: String,
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
    #[error("handshake with target {target} for export {export:?} failed on {link}: {detail}")]
    Handshake {
        /// Target MAC.
        target: String,
        /// Export asked for.
        export: String,
        /// Link name.
        link: String,
        /// What went wrong.
        detail: String,
    },
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The operating system refused what the engine needs to start (an eventfd, a descriptor,
    /// a thread).
    #[error("cannot {what}: {source}")]
    Os {
        /// What the engine was doing: "create an eventfd", "start an engine thread".
        what: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The engine thread stopped before the session opened.
    #[error("initiator engine stopped")]
    EngineGone,
}

/// What a target's reason for refusing a CONNECT means, in words (and its protocol name).
pub fn describe(reason: RejectReason) -> String {
    let what = match reason {
        RejectReason::UnknownExport => "it has no export of that name",
        RejectReason::NotAllowed => "this initiator's MAC (or host) is not allowed to attach it",
        RejectReason::AuthFailed => "the proof of the pre-shared key was wrong",
        RejectReason::AuthRequired => "the export needs a pre-shared key",
        RejectReason::BadParameters => "it cannot grant usable channel parameters",
        RejectReason::Busy => "it has no room for another session or channel (a limit is full)",
        RejectReason::UnknownSession => "the session no longer exists there",
        RejectReason::InUse => "another initiator has the export attached",
    };
    let name = match reason {
        RejectReason::UnknownExport => "UNKNOWN_EXPORT",
        RejectReason::NotAllowed => "NOT_ALLOWED",
        RejectReason::AuthFailed => "AUTH_FAILED",
        RejectReason::AuthRequired => "AUTH_REQUIRED",
        RejectReason::BadParameters => "BAD_PARAMETERS",
        RejectReason::Busy => "BUSY",
        RejectReason::UnknownSession => "UNKNOWN_SESSION",
        RejectReason::InUse => "IN_USE",
    };
    format!("{what} ({name})")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every refusal names the target, the export, the link and the reason in words.
    #[test]
    fn refusals_name_target_export_link_and_reason() {
        let (t, e, l) = ("02:54:00:00:02:00".to_string(), "keyed".to_string(), "veth0".to_string());
        let all = [
            ConnectError::Auth {
                target: t.clone(),
                export: e.clone(),
                link: l.clone(),
                reason: RejectReason::AuthFailed,
            },
            ConnectError::InUse {
                target: t.clone(),
                export: e.clone(),
                link: l.clone(),
                holder: "02:54:00:00:01:07".into(),
            },
            ConnectError::Refused { target: t.clone(), export: e.clone(), link: l.clone(), reason: RejectReason::Busy },
            ConnectError::Handshake { target: t.clone(), export: e.clone(), link: l.clone(), detail: "why".into() },
        ];
        for err in all {
            let m = err.to_string();
            assert!(m.contains(&t) && m.contains("\"keyed\"") && m.contains(&l), "{m}");
            assert!(!m.contains("  ") && !m.contains(" : ") && !m.contains("of :"), "an empty field in {m:?}");
        }
        for r in RejectReason::ALL {
            assert!(describe(*r).len() > 12, "{r:?}");
        }
    }
}
