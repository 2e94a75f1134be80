//! Who uses a NIC's steering program, and which process holds which of its queues: lock files
//! that the kernel releases when their holder dies, so a killed process never leaves a NIC
//! looking busy.
//!
//! One directory per interface, `/run/tyche/xdp/<netns inode>-<ifindex>/` (indexes are per
//! network namespace, the lock directory is not), holding:
//! - `attach.lock`: taken exclusively while a process decides to attach, share or detach the
//!   program, so those decisions never interleave;
//! - `users.lock`: held shared by every process that uses the program; whoever can take it
//!   exclusively (under `attach.lock`) is alone, and the last user detaches;
//! - `queue-<q>.lock`: held exclusively by the process whose AF_XDP socket is bound to queue
//!   `q`, with its pid inside, so that a second one is refused naming it.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::Error;

/// Where the per-interface lock directories live.
pub const RUN_DIR: &str = "/run/tyche/xdp";

/// The lock directory of one interface.
#[derive(Debug, Clone)]
pub(crate) struct NicDir {
    path: PathBuf,
}

fn flock(file: &File, op: libc::c_int) -> io::Result<bool> {
    loop {
        // SAFETY: flock(2) on a descriptor this `File` owns.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

fn open_lock(path: &Path) -> Result<File, Error> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))
}

impl NicDir {
    /// The directory of interface `ifindex` in the calling thread's network namespace, created
    /// if needed.
    pub(crate) fn of(ifindex: u32) -> Result<Self, Error> {
        let ns = std::fs::metadata("/proc/thread-self/ns/net")
            .map_err(|e| Error::io("reading the network namespace of this thread", e))?
            .ino();
        Self::at(Path::new(RUN_DIR), ns, ifindex)
    }

    pub(crate) fn at(root: &Path, netns: u64, ifindex: u32) -> Result<Self, Error> {
        let path = root.join(format!("{netns}-{ifindex}"));
        std::fs::create_dir_all(&path).map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        Ok(NicDir { path })
    }

    /// Waits for the right to attach, share or detach (released when the guard drops).
    pub(crate) fn decide(&self) -> Result<File, Error> {
        let path = self.path.join("attach.lock");
        let f = open_lock(&path)?;
        flock(&f, libc::LOCK_EX).map_err(|e| Error::io(format!("locking {}", path.display()), e))?;
        Ok(f)
    }

    /// Whether no live process uses the program. Call it holding [`NicDir::decide`]'s lock and
    /// not holding [`NicDir::join`]'s (a process's own shared lock counts as a user).
    pub(crate) fn unused(&self) -> Result<bool, Error> {
        let path = self.path.join("users.lock");
        let f = open_lock(&path)?;
        flock(&f, libc::LOCK_EX | libc::LOCK_NB).map_err(|e| Error::io(format!("locking {}", path.display()), e))
    }

    /// Counts this process as a user of the program until the returned file is closed.
    pub(crate) fn join(&self) -> Result<File, Error> {
        let path = self.path.join("users.lock");
        let f = open_lock(&path)?;
        flock(&f, libc::LOCK_SH).map_err(|e| Error::io(format!("locking {}", path.display()), e))?;
        Ok(f)
    }

    /// Takes queue `queue` for this process (until the returned file is closed), or says which
    /// process holds it: `Err(Some(pid))`, `Err(None)` when its pid could not be read.
    pub(crate) fn take_queue(&self, queue: u32) -> Result<Result<File, Option<u32>>, Error> {
        let path = self.path.join(format!("queue-{queue}.lock"));
        let mut f = open_lock(&path)?;
        let taken = flock(&f, libc::LOCK_EX | libc::LOCK_NB)
            .map_err(|e| Error::io(format!("locking {}", path.display()), e))?;
        if !taken {
            let mut s = String::new();
            let _ = f.read_to_string(&mut s);
            return Ok(Err(s.trim().parse().ok()));
        }
        let write = |f: &mut File| -> io::Result<()> {
            f.set_len(0)?;
            f.rewind()?;
            writeln!(f, "{}", std::process::id())
        };
        write(&mut f).map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        Ok(Ok(f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_queues_are_counted_by_open_locks() {
        let root = tempfile::tempdir().expect("temp dir");
        let nic = NicDir::at(root.path(), 4026531840, 7).expect("nic dir");
        assert!(nic.unused().expect("unused"), "nobody uses a fresh NIC");
        let user = nic.join().expect("join");
        assert!(!nic.unused().expect("unused"), "a shared lock holder is a user");
        let other = nic.join().expect("a second user shares");
        drop(user);
        assert!(!nic.unused().expect("unused"), "the other user is left");
        drop(other);
        assert!(nic.unused().expect("unused"), "the last user left");

        let q0 = nic.take_queue(0).expect("lock").expect("queue 0 is free");
        assert_eq!(nic.take_queue(0).expect("lock").expect_err("queue 0 is held"), Some(std::process::id()));
        let q1 = nic.take_queue(1).expect("lock").expect("queue 1 is free");
        drop(q0);
        let again = nic.take_queue(0).expect("lock").expect("queue 0 is free again");
        drop((again, q1));
        let _guard = nic.decide().expect("decide");
    }
}
