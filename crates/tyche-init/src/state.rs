//! Attachments of this host: one small file per running `tyche-init` front end in a state
//! directory (`/run/tyche-init/` unless `TYCHE_INIT_STATE_DIR` says otherwise), so that
//! `tyche-init list` and `tyche-init detach` can find them, and `tyche-init attach --recover`
//! learns what the process it replaces owed about its writes (the export's durability epoch,
//! and whether a loss was still to be reported).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use tyche_channel::DurabilityDebt;
use tyche_wire::DurabilityEpoch;

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
    /// The durability epoch unflushed writes may have been acknowledged under (the session's;
    /// `None` before one is known, and in records of older versions).
    pub epoch: Option<DurabilityEpoch>,
    /// A loss of acknowledged writes is still to be reported by a FLUSH.
    pub owed: bool,
    /// The attachment file's name (`attach --config`), if it came from one.
    pub name: Option<String>,
    /// The `<target>` of its `/dev/disk/by-tyche/<target>/<export>` name.
    pub target_name: Option<String>,
}

impl Attachment {
    fn encode(&self) -> String {
        let mut s = format!(
            "pid={}\nkind={}\npath={}\nexport={}\ntarget={}\nstats={}\nowed={}\n",
            self.pid,
            self.kind,
            self.path,
            self.export,
            self.target,
            self.stats,
            u8::from(self.owed)
        );
        if let Some(e) = self.epoch {
            s.push_str(&format!("epoch={e}\n"));
        }
        if let Some(n) = &self.name {
            s.push_str(&format!("name={n}\n"));
        }
        if let Some(n) = &self.target_name {
            s.push_str(&format!("target_name={n}\n"));
        }
        s
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
            // A value that does not parse counts as unknown (the conservative reading).
            epoch: get("epoch").and_then(|e| DurabilityEpoch::from_hex(&e)),
            owed: get("owed").is_none_or(|o| o != "0"),
            name: get("name"),
            target_name: get("target_name"),
        })
    }

    /// Records what the serving volume owes ([`tyche_channel::Volume::durability_debt`]) and
    /// its session's durability epoch: the epoch unflushed writes may have been acknowledged
    /// under (the session's even when every write is flushed: more may come before the next
    /// update of this record), and whether a loss is still to be reported.
    pub fn set_durability(&mut self, session_epoch: Option<DurabilityEpoch>, debt: DurabilityDebt) {
        (self.epoch, self.owed) = match debt {
            DurabilityDebt::Owed => (session_epoch, true),
            DurabilityDebt::AtRisk(e) => (Some(e), false),
            DurabilityDebt::Clear => (session_epoch, false),
        };
    }

    /// What a process taking the device over inherits from this one, which may have had writes
    /// not flushed (it cannot be asked any more): owed if it said so or named no epoch (a
    /// record of an older version included), else at risk under its epoch.
    pub fn debt(&self) -> DurabilityDebt {
        match self.epoch {
            Some(e) if !self.owed && !e.is_none() => DurabilityDebt::AtRisk(e),
            _ => DurabilityDebt::Owed,
        }
    }

    /// A record of a dead `attach` whose ublk device is still there, waiting for
    /// `attach --recover`: kept (not listed) so that the recovering process can read it.
    fn awaits_recovery(&self) -> bool {
        self.kind == "ublk" && Path::new(&self.path).exists()
    }

    /// Whether the serving process still runs.
    pub fn alive(&self) -> bool {
        process_running(self.pid)
    }
}

/// Whether process `pid` runs: it exists and is not a zombie (one that has exited and waits
/// for its parent to collect its status).
pub fn process_running(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold any byte.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
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

fn records(dir: &Path) -> io::Result<Vec<(PathBuf, Attachment)>> {
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
        if let Some(a) = fs::read_to_string(&p).ok().as_deref().and_then(Attachment::decode) {
            out.push((p, a));
        }
    }
    out.sort_by_key(|(_, a)| a.pid);
    Ok(out)
}

/// Every recorded attachment whose process still runs; records of dead processes are removed,
/// except those of a ublk device still waiting for `attach --recover`.
pub fn list(dir: &Path) -> io::Result<Vec<Attachment>> {
    let mut out = Vec::new();
    for (p, a) in records(dir)? {
        if a.alive() {
            out.push(a);
        } else if !a.awaits_recovery() {
            let _ = fs::remove_file(&p);
        }
    }
    Ok(out)
}

/// The records of dead processes whose ublk device is still there, waiting for a process to
/// resume it (`attach --recover`, or the next `attach --config` of the same file).
pub fn awaiting_recovery(dir: &Path) -> io::Result<Vec<Attachment>> {
    Ok(records(dir)?.into_iter().map(|(_, a)| a).filter(|a| !a.alive() && a.awaits_recovery()).collect())
}

/// The records of dead processes that served the device `path` (what `attach --recover`
/// takes over: [`inherited_debt`]); remove them with [`remove`] once the recovering process
/// has recorded itself.
pub fn dead_records_of(dir: &Path, path: &str) -> io::Result<Vec<Attachment>> {
    Ok(records(dir)?.into_iter().map(|(_, a)| a).filter(|a| a.path == path && !a.alive()).collect())
}

/// What a process taking a device over inherits from the dead ones that served it: every
/// record's debt together; owed when there is no record at all (it may have been lost, or never
/// written by an older version, and the dead process may have had unflushed writes).
pub fn inherited_debt(records: &[Attachment]) -> DurabilityDebt {
    records.iter().map(Attachment::debt).reduce(DurabilityDebt::merge).unwrap_or(DurabilityDebt::Owed)
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
            epoch: Some(DurabilityEpoch([0xab; 16])),
            owed: false,
            name: Some("vol".into()),
            target_name: Some("store1".into()),
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

    const E: DurabilityEpoch = DurabilityEpoch([0xab; 16]);

    fn ublk(pid: u32, path: &str) -> Attachment {
        Attachment {
            pid,
            kind: "ublk".into(),
            path: path.into(),
            export: "vol".into(),
            target: "02:00:00:00:02:00".into(),
            stats: String::new(),
            epoch: Some(E),
            owed: false,
            name: None,
            target_name: None,
        }
    }

    #[test]
    fn a_dead_attach_whose_device_waits_for_recovery_keeps_its_record() {
        let d = tempfile::tempdir().unwrap();
        // The "device" of a dead attach: a path that exists (here, a plain file).
        let dev = d.path().join("ublkb7");
        fs::write(&dev, b"").unwrap();
        let dev = dev.display().to_string();
        let dead = ublk(u32::MAX - 2, &dev);
        record(d.path(), &dead).unwrap();
        let gone = ublk(u32::MAX - 3, "/dev/no-such-ublkb9");
        record(d.path(), &gone).unwrap();
        assert!(list(d.path()).unwrap().is_empty(), "dead records are not listed");
        assert!(file_of(d.path(), dead.pid).exists(), "kept for attach --recover");
        assert!(!file_of(d.path(), gone.pid).exists(), "its device is gone: removed");
        let found = dead_records_of(d.path(), &dev).unwrap();
        assert_eq!(found, vec![dead.clone()]);
        assert_eq!(inherited_debt(&found), DurabilityDebt::AtRisk(E));
        remove(d.path(), dead.pid);
        assert!(dead_records_of(d.path(), &dev).unwrap().is_empty());
    }

    #[test]
    fn what_a_recovering_process_inherits() {
        let at_risk = ublk(1, "/dev/ublkb0");
        assert_eq!(at_risk.debt(), DurabilityDebt::AtRisk(E));
        assert_eq!(Attachment { owed: true, ..at_risk.clone() }.debt(), DurabilityDebt::Owed);
        assert_eq!(Attachment { epoch: None, ..at_risk.clone() }.debt(), DurabilityDebt::Owed, "no epoch known");
        let none = Attachment { epoch: Some(DurabilityEpoch::NONE), ..at_risk.clone() };
        assert_eq!(none.debt(), DurabilityDebt::Owed, "an epoch that promises nothing");
        // No record at all: the dead process may have had unflushed writes.
        assert_eq!(inherited_debt(&[]), DurabilityDebt::Owed);
        let other = Attachment { epoch: Some(DurabilityEpoch([0xcd; 16])), ..at_risk.clone() };
        assert_eq!(inherited_debt(&[at_risk.clone(), other]), DurabilityDebt::Owed, "two epochs");
        // What a serving process records, by what its volume owes.
        let mut a = at_risk.clone();
        a.set_durability(Some(E), DurabilityDebt::Clear);
        assert_eq!((a.epoch, a.owed), (Some(E), false), "more writes may come: the session's epoch");
        a.set_durability(None, DurabilityDebt::Clear);
        assert_eq!(a.debt(), DurabilityDebt::Owed, "no session epoch known yet");
        a.set_durability(Some(DurabilityEpoch([0xcd; 16])), DurabilityDebt::AtRisk(E));
        assert_eq!(a.debt(), DurabilityDebt::AtRisk(E), "writes of the epoch they were acknowledged under");
        a.set_durability(Some(E), DurabilityDebt::Owed);
        assert_eq!(a.debt(), DurabilityDebt::Owed);
    }

    #[test]
    fn records_of_older_versions_and_bad_values_read_as_owed() {
        let old = "pid=5\nkind=ublk\npath=/dev/ublkb0\nexport=v\ntarget=t\nstats=\n";
        let a = Attachment::decode(old).unwrap();
        assert_eq!((a.epoch, a.debt()), (None, DurabilityDebt::Owed));
        let bad = format!("{old}owed=0\nepoch=zz\n");
        assert_eq!(Attachment::decode(&bad).unwrap().debt(), DurabilityDebt::Owed);
        let good = format!("{old}owed=0\nepoch={E}\n");
        assert_eq!(Attachment::decode(&good).unwrap().debt(), DurabilityDebt::AtRisk(E));
        // Round trip.
        let r = ublk(9, "/dev/ublkb3");
        assert_eq!(Attachment::decode(&r.encode()), Some(r));
    }
}
