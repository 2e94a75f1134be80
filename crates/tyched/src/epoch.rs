//! Durability epochs of exports (ACCEPT `DURABILITY_EPOCH`, docs/protocol.md §2.4): the name
//! of the cache domain that holds the writes an export acknowledged. An initiator whose session
//! was lost without DISCONNECT SHUTDOWN treats its unflushed writes as kept when the new
//! session presents the same epoch, and as lost otherwise.
//!
//! - A **file or block export**'s completed writes are in the host's page cache or the device's
//!   cache: they outlive a `tyched` process (a crash, SIGKILL, a restart) and die with the host.
//!   Its epoch is a hash of the host's boot id and the opened file's identity, so a restarted
//!   `tyched` on the same boot presents the same epoch and a reboot changes it.
//! - A **RAM export**'s contents die with the process: its epoch is random, new at every start.
//!
//! The boot id is hashed (with a label) rather than sent: the epoch tells a peer nothing about
//! the host beyond "the same boot and file as before", and nothing it could compute from
//! another host's epoch.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;

use sha2::{Digest, Sha256};
use tyche_wire::DurabilityEpoch;

/// Where the kernel keeps this boot's random id (a UUID, new at every boot).
pub const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// Label of the epoch hash (so the value is never a hash some other protocol also computes).
const LABEL: &[u8] = b"tyched durability epoch v1";

/// A fresh random epoch (RAM exports; a file export on a host without a readable boot id).
pub fn random() -> DurabilityEpoch {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&tyche_channel::auth::random_u64().to_ne_bytes());
    b[8..].copy_from_slice(&tyche_channel::auth::random_u64().to_ne_bytes());
    // All zero means "no promise"; 2^-128 away, but never send it by accident.
    if b == [0; 16] {
        b[0] = 1;
    }
    DurabilityEpoch(b)
}

/// The identity of an opened file or block device that the epoch covers: the device and inode
/// of a regular file (and its birth time where the filesystem records one, so that a file
/// deleted and created again is another file), the device number of a block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
    /// `st_rdev` (block devices; 0 for regular files).
    pub rdev: u64,
    /// Birth time in nanoseconds since the epoch (0 where the filesystem has none).
    pub born_ns: u128,
}

impl FileIdentity {
    /// The identity of `file`.
    pub fn of(file: &File) -> io::Result<FileIdentity> {
        let m = file.metadata()?;
        let born_ns =
            m.created().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        Ok(FileIdentity { dev: m.dev(), ino: m.ino(), rdev: m.rdev(), born_ns })
    }
}

/// The epoch of a file or block export on the boot named by `boot_id` (the contents of
/// [`BOOT_ID`]).
pub fn derive(boot_id: &str, id: &FileIdentity) -> DurabilityEpoch {
    let mut h = Sha256::new();
    h.update(LABEL);
    h.update([0]);
    h.update(boot_id.trim().as_bytes());
    h.update([0]);
    h.update(id.dev.to_be_bytes());
    h.update(id.ino.to_be_bytes());
    h.update(id.rdev.to_be_bytes());
    h.update(id.born_ns.to_be_bytes());
    let digest = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    if b == [0; 16] {
        b[0] = 1;
    }
    DurabilityEpoch(b)
}

/// The epoch of the file or block device `file` on this boot. Without a readable boot id (no
/// procfs) it is random: every restart of `tyched` then counts as a loss of unflushed writes,
/// which is safe and only pessimistic.
pub fn of_file(file: &File) -> io::Result<DurabilityEpoch> {
    let id = FileIdentity::of(file)?;
    match std::fs::read_to_string(BOOT_ID) {
        Ok(boot) if !boot.trim().is_empty() => Ok(derive(&boot, &id)),
        r => {
            let why = r.err().map_or_else(|| "empty".to_owned(), |e| e.to_string());
            tracing::warn!("cannot read {BOOT_ID} ({why}): file exports get a new durability epoch at every start");
            Ok(random())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOT: &str = "0f6c2a8e-6d1b-4f7e-9a3c-2b1d5e8f7a60\n";

    fn id() -> FileIdentity {
        FileIdentity { dev: 0x803, ino: 1234, rdev: 0, born_ns: 1_700_000_000_000_000_000 }
    }

    #[test]
    fn the_same_boot_and_file_give_the_same_epoch_anything_else_another() {
        let e = derive(BOOT, &id());
        assert_eq!(e, derive(BOOT.trim(), &id()), "the newline of the proc file does not count");
        assert!(!e.is_none());
        let other_boot = "0f6c2a8e-6d1b-4f7e-9a3c-2b1d5e8f7a61";
        for (what, other) in [
            ("boot", derive(other_boot, &id())),
            ("dev", derive(BOOT, &FileIdentity { dev: 0x804, ..id() })),
            ("ino", derive(BOOT, &FileIdentity { ino: 1235, ..id() })),
            ("rdev", derive(BOOT, &FileIdentity { rdev: 1, ..id() })),
            ("birth", derive(BOOT, &FileIdentity { born_ns: 1, ..id() })),
        ] {
            assert_ne!(e, other, "another {what}, the same epoch");
        }
        // The boot id is not in the epoch.
        let hex = e.to_hex();
        assert!(!hex.contains("0f6c2a8e"), "{hex}");
    }

    #[test]
    fn a_reopened_file_keeps_its_epoch_a_new_file_does_not() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("export");
        let a = of_file(&File::create(&p).unwrap()).unwrap();
        assert_eq!(a, of_file(&File::open(&p).unwrap()).unwrap(), "a restarted tyched reopens it");
        let q = d.path().join("other");
        assert_ne!(a, of_file(&File::create(&q).unwrap()).unwrap());
    }

    #[test]
    fn ram_epochs_are_new_every_time() {
        assert_ne!(random(), random());
        assert!(!random().is_none());
    }
}
