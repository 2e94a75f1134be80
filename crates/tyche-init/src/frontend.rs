//! Block front ends: how an attached export becomes a device.
//!
//! [`BlockFrontend`] is the seam between the initiator library and the kernel interface. The
//! ublk front end (`/dev/ublkbN` through libublk, `UblkFrontend` in `ublk_frontend`) needs
//! `/dev/ublk-control`; where that is missing, its `probe` says so ([`FrontendError::NoUblk`])
//! and points to the NBD mode (`tyche-init serve-nbd`), which needs no kernel driver.

/// The control device of the ublk driver.
pub const UBLK_CONTROL: &str = "/dev/ublk-control";

/// Why a front end could not start.
#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    /// The kernel has no ublk driver loaded.
    #[error(
        "{UBLK_CONTROL} not found: this kernel has no ublk driver (CONFIG_BLK_DEV_UBLK; try `modprobe ublk_drv`). \
         Use the NBD mode instead: `tyche-init serve-nbd --socket PATH ...`, then attach it with \
         nbd-client, nbdfuse or qemu"
    )]
    NoUblk,
    /// ublk support is not compiled into this build.
    #[error(
        "this build of tyche-init has no ublk support (build with `--features ublk`); use `tyche-init serve-nbd --socket PATH ...`"
    )]
    NotBuilt,
    /// Something else failed.
    #[error("{0}")]
    Other(String),
}

/// A kernel-facing block device backed by a [`Client`](crate::Client).
pub trait BlockFrontend {
    /// The device path (`/dev/ublkb0`) or socket path the front end serves.
    fn path(&self) -> String;
    /// Something that stops [`BlockFrontend::serve`] from another thread (on detach).
    fn stopper(&self) -> Box<dyn FnOnce() + Send>;
    /// Serves requests until the device is removed or the session ends.
    fn serve(self: Box<Self>) -> Result<(), FrontendError>;
}

/// Options of the ublk front end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UblkOptions {
    /// Hardware queues (one serving thread each).
    pub queues: u16,
    /// Requests in flight per queue.
    pub depth: u16,
    /// Create the device with `UBLK_F_USER_RECOVERY` (and `UBLK_F_USER_RECOVERY_REISSUE`) where
    /// the driver offers them: when the serving process dies the device stays, its I/O waits,
    /// and `UblkFrontend::recover` in a new process resumes it.
    pub recovery: bool,
    /// The device number to ask for (`/dev/ublkbN`); `None`: the kernel picks one.
    pub dev_id: Option<u32>,
}

/// The device number of `/dev/ublkbN`, `ublkbN` or `N`.
pub fn ublk_id(what: &str) -> Option<u32> {
    let name = what.strip_prefix("/dev/").unwrap_or(what);
    name.strip_prefix("ublkb").unwrap_or(name).parse().ok()
}

/// Whether a block device is in use: mounted, held by md or device-mapper, or opened
/// exclusively by anyone (an `O_EXCL` open of it fails with EBUSY). Plain opens (a `dd` without
/// `O_EXCL`) do not count. A device that cannot be opened at all is not in use.
pub fn device_in_use(path: &str) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    matches!(
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_EXCL).open(path),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY)
    )
}

#[cfg(test)]
mod tests {
    use super::ublk_id;

    #[test]
    fn ublk_ids_from_paths_names_and_numbers() {
        assert_eq!(ublk_id("/dev/ublkb3"), Some(3));
        assert_eq!(ublk_id("ublkb12"), Some(12));
        assert_eq!(ublk_id("0"), Some(0));
        assert_eq!(ublk_id("/dev/ublkc3"), None, "the char device is not the block device");
        assert_eq!(ublk_id("/dev/sda"), None);
        assert_eq!(ublk_id(""), None);
    }
}
