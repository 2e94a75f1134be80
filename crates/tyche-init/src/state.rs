//! Attachments of this host: one small file per running `tyche-init` front end in a state
//! directory (`/run/tyche-init/` unless `TYCHE_INIT_STATE_DIR` says otherwise), so that
//! `tyche-init list` and `tyche-init detach` can find them.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Default state directory.
pub const DEFAULT_DIR: &str = "/run/tyche-init";

/// One attached export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// Process serving it.
    pub pid: u32,
    /// `nbd` or `ublk`.
    pub kind: String,
    /// Device path or socket path.
    pub path: String,
    /// Export name.
    pub export: String,
    /// Target (MAC, TCP address or `loopback`).
    pub target: String,
    /// Stats socket (`tyche-init stats`); empty when there is none.
    pub stats: String,
}

impl Attachment {
    fn encode(&self) -> String {
        format!(
            "pid={}\nkind={}\npath={}\nexport={}\ntarget={}\nstats={}\n",
            self.pid, self.kind, self.path, self.export, self.target, self.stats
        )
    }

    fn decode(s: &str) -> Option<Attachment> {
        let get = |k: &str| s.lines().find_map(|l| l.strip_prefix(k)?.strip_prefix('=')).map(str::to_owned);
        Some(Attachment {
            pid: get("pid")?.parse().ok()?,
            kind: get("kind")?,
            path: get("path")?,
            export: get("export")?,
            target: get("target")?,
            stats: get("stats").unwrap_or_default(),
        })
    }

    /// Whether the serving process still runs.
    pub fn alive(&self) -> bool {
        Path::new(&format!("/proc/{}", self.pid)).exists()
    }
}

/// The state directory.
pub fn dir() -> PathBuf {
    std::env::var_os("TYCHE_INIT_STATE_DIR").map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from)
}

fn file_of(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.attach"))
}

/// Records an attachment; returns the file written (remove it with [`remove`]).
pub fn record(dir: &Path, a: &Attachment) -> io::Result<PathBuf> {
    fs::create_dir_all(dir)?;
    let f = file_of(dir, a.pid);
    let tmp = f.with_extension("tmp");
    fs::write(&tmp, a.encode())?;
    fs::rename(&tmp, &f)?;
    Ok(f)
}

/// The default stats socket of the front end running as `pid`.
pub fn stats_socket(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.stats.sock"))
}

/// Forgets the attachment of `pid`.
pub fn remove(dir: &Path, pid: u32) {
    let _ = fs::remove_file(file_of(dir, pid));
}

/// Every recorded attachment whose process still runs; records of dead processes are removed.
pub fn list(dir: &Path) -> io::Result<Vec<Attachment>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in entries {
        let p = e?.path();
        if p.extension().is_none_or(|x| x != "attach") {
            continue;
        }
        let Some(a) = fs::read_to_string(&p).ok().as_deref().and_then(Attachment::decode) else { continue };
        if a.alive() {
            out.push(a);
        } else {
            let _ = fs::remove_file(&p);
        }
    }
    out.sort_by_key(|a| a.pid);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_stale_ones_vanish() {
        let d = tempfile::tempdir().unwrap();
        let me = Attachment {
            pid: std::process::id(),
            kind: "nbd".into(),
            path: "/tmp/x.sock".into(),
            export: "ram".into(),
            target: "02:00:00:00:02:00".into(),
            stats: "/tmp/x.stats.sock".into(),
        };
        record(d.path(), &me).unwrap();
        let dead = Attachment { pid: u32::MAX - 1, ..me.clone() };
        record(d.path(), &dead).unwrap();
        assert_eq!(list(d.path()).unwrap(), vec![me.clone()]);
        assert!(!file_of(d.path(), dead.pid).exists(), "stale record removed");
        remove(d.path(), me.pid);
        assert!(list(d.path()).unwrap().is_empty());
        assert!(list(&d.path().join("missing")).unwrap().is_empty());
    }
}
