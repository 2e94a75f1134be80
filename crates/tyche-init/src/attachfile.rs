//! Attachment files: one export to attach per file, `/etc/tyche/attach.d/NAME.toml` (Tyche's
//! `/etc/nbdtab` or `/etc/nvme/discovery.conf`). `tyche-init attach --config FILE` attaches one,
//! `tyche-init attach-all` every one, and `tyche-attach@NAME.service` runs one at boot.
//!
//! ```toml
//! export = "disk0"
//! ifaces = ["ens5", "ens6"]
//! target = "52:54:00:74:00:01"   # one MAC, one per interface, or none: found by discovery
//! target_name = "store1"          # /dev/disk/by-tyche/store1/disk0 (default: the target MAC)
//! key_file = "/etc/tyche/disk0.key"
//! no_path_timeout = 30
//! io_timeout = 5                  # a RAID member: fail a request after 5 s without a path
//! prometheus_listen = "127.0.0.1:9465"   # GET /metrics (loopback or a Unix socket path)
//! ```
//!
//! Unknown fields are errors, so a misspelt setting is never silently ignored.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tyche_wire::{MacAddr, DEFAULT_ETHERTYPE};

use crate::{EngineThreads, SchedulerKind, SendMode};

/// The directory `attach-all` reads and the units name files in.
pub const DEFAULT_DIR: &str = "/etc/tyche/attach.d";
/// Largest attachment file read (a file this big is not an attachment).
pub const MAX_FILE: u64 = 64 * 1024;
/// Longest attachment name (a file name's stem; it names a unit instance too).
pub const MAX_NAME: usize = 64;

/// What is wrong with an attachment file: its path and the reason.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct AttachFileError {
    /// The file.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

/// One MAC address, or one per interface.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
enum Targets {
    One(String),
    PerLink(Vec<String>),
}

/// An attachment file's contents, as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    export: String,
    #[serde(default)]
    ifaces: Vec<String>,
    target: Option<Targets>,
    target_name: Option<String>,
    key_file: Option<PathBuf>,
    host_id: Option<String>,
    #[serde(default)]
    digest: bool,
    channels_per_nic: Option<usize>,
    no_path_timeout: Option<f64>,
    io_timeout: Option<f64>,
    ethertype: Option<u16>,
    queues: Option<u16>,
    depth: Option<u16>,
    dev_id: Option<u32>,
    scheduler: Option<String>,
    send_mode: Option<String>,
    engine_threads: Option<String>,
    prometheus_listen: Option<String>,
    #[serde(default)]
    prometheus_allow_remote: bool,
}

/// A checked attachment file.
#[derive(Debug, Clone, PartialEq)]
pub struct AttachFile {
    /// The attachment's name: the file name without `.toml`.
    pub name: String,
    /// Export to attach.
    pub export: String,
    /// Interfaces (AF_XDP), one channel set each.
    pub ifaces: Vec<String>,
    /// Target MAC: none (discovery), one for every interface, or one per interface.
    pub targets: Vec<MacAddr>,
    /// The `<target>` of `/dev/disk/by-tyche/<target>/<export>`.
    pub target_name: Option<String>,
    /// Pre-shared key file.
    pub key_file: Option<PathBuf>,
    /// This host's id (default: /etc/machine-id).
    pub host_id: Option<[u8; 16]>,
    /// Ask for CRC32C digests of data payloads.
    pub digest: bool,
    /// Channels per NIC.
    pub channels_per_nic: Option<usize>,
    /// Seconds requests wait while every channel is down before failing.
    pub no_path_timeout: Option<f64>,
    /// Seconds a request waits for a path, from its submission, before it fails (RAID members).
    pub io_timeout: Option<f64>,
    /// EtherType of Tyche frames (the target's `ethertype`).
    pub ethertype: u16,
    /// ublk hardware queues.
    pub queues: Option<u16>,
    /// Requests in flight per ublk queue.
    pub depth: Option<u16>,
    /// ublk device number to ask for.
    pub dev_id: Option<u32>,
    /// Channel scheduler.
    pub scheduler: Option<SchedulerKind>,
    /// Send mode.
    pub send_mode: Option<SendMode>,
    /// Engine thread layout.
    pub engine_threads: Option<EngineThreads>,
    /// Where to serve Prometheus metrics (`GET /metrics`), checked: loopback or a Unix socket
    /// unless `prometheus_allow_remote`.
    pub prometheus_listen: Option<tyche_metrics::MetricsAddr>,
}

/// Whether `name` may name an attachment (and a unit instance, and a path component):
/// letters, digits, `.`, `_`, `-`, `:`; not starting with `.` or `-`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with(['.', '-'])
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b))
}

fn value_enum<T: clap::ValueEnum>(field: &str, v: Option<String>) -> Result<Option<T>, String> {
    v.map(|s| {
        T::from_str(&s, false).map_err(|_| {
            let names: Vec<String> = T::value_variants()
                .iter()
                .filter_map(|v| v.to_possible_value())
                .map(|p| p.get_name().to_owned())
                .collect();
            format!("{field}: unknown value {s:?} (expected {})", names.join(", "))
        })
    })
    .transpose()
}

impl AttachFile {
    /// Parses an attachment file's text; `name` is the attachment's name.
    pub fn parse(name: &str, text: &str) -> Result<AttachFile, String> {
        if !valid_name(name) {
            return Err(format!(
                "{name:?} cannot name an attachment (at most {MAX_NAME} of letters, digits, '.', '_', '-', ':')"
            ));
        }
        let r: Raw = toml::from_str(text).map_err(|e| e.message().to_owned() + &span_of(text, e.span()))?;
        if r.export.is_empty() || r.export.len() > tyche_wire::MAX_EXPORT_NAME {
            return Err(format!("export: a name of 1 to {} bytes", tyche_wire::MAX_EXPORT_NAME));
        }
        let macs = match r.target {
            None => Vec::new(),
            Some(Targets::One(m)) => vec![m],
            Some(Targets::PerLink(v)) => v,
        };
        let targets = macs
            .iter()
            .map(|m| m.parse::<MacAddr>().map_err(|_| format!("target: {m:?} is not a MAC address")))
            .collect::<Result<Vec<_>, _>>()?;
        if targets.len() > 1 && targets.len() != r.ifaces.len() {
            return Err(format!(
                "target: {} addresses for {} interfaces (give one, one per interface, or none)",
                targets.len(),
                r.ifaces.len()
            ));
        }
        if r.ifaces.is_empty() {
            return Err("ifaces: give the interfaces to attach over".into());
        }
        if let Some(t) = &r.target_name {
            if !valid_name(t) {
                return Err(format!("target_name: {t:?} is not a name (letters, digits, '.', '_', '-', ':')"));
            }
        }
        if let Some(t) = r.no_path_timeout {
            if !(t.is_finite() && t >= 0.0) {
                return Err("no_path_timeout: a non-negative number of seconds".into());
            }
        }
        if let Some(t) = r.io_timeout {
            if !(t.is_finite() && t > 0.0 && t <= 86_400.0) {
                return Err("io_timeout: a number of seconds above 0 and at most 86400".into());
            }
        }
        if r.ethertype.is_some_and(|e| e < 0x0600) {
            return Err("ethertype: an EtherType is 0x0600 or more".into());
        }
        if r.channels_per_nic == Some(0) || r.queues == Some(0) || r.depth == Some(0) {
            return Err("channels_per_nic, queues and depth are at least 1".into());
        }
        let prometheus_listen = r
            .prometheus_listen
            .as_deref()
            .map(|a| tyche_metrics::MetricsAddr::parse_local(a, r.prometheus_allow_remote))
            .transpose()
            .map_err(|e| format!("prometheus_listen: {e}"))?;
        let host_id =
            r.host_id.as_deref().map(crate::parse_host_id).transpose().map_err(|e| format!("host_id: {e}"))?;
        Ok(AttachFile {
            name: name.to_owned(),
            export: r.export,
            ifaces: r.ifaces,
            targets,
            target_name: r.target_name,
            key_file: r.key_file,
            host_id,
            digest: r.digest,
            channels_per_nic: r.channels_per_nic,
            no_path_timeout: r.no_path_timeout,
            io_timeout: r.io_timeout,
            ethertype: r.ethertype.unwrap_or(DEFAULT_ETHERTYPE),
            queues: r.queues,
            depth: r.depth,
            dev_id: r.dev_id,
            scheduler: value_enum("scheduler", r.scheduler)?,
            send_mode: value_enum("send_mode", r.send_mode)?,
            engine_threads: value_enum("engine_threads", r.engine_threads)?,
            prometheus_listen,
        })
    }

    /// Reads and checks an attachment file (named by its file name without `.toml`).
    pub fn read(path: &Path) -> Result<AttachFile, AttachFileError> {
        let err = |message: String| AttachFileError { path: path.display().to_string(), message };
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".toml"))
            .ok_or_else(|| err("an attachment file's name ends in .toml".into()))?;
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if !meta.is_file() {
            return Err(err("not a regular file".into()));
        }
        if meta.len() > MAX_FILE {
            return Err(err(format!("{} bytes: an attachment file is at most {MAX_FILE}", meta.len())));
        }
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        Self::parse(name, &text).map_err(err)
    }

    /// Every `*.toml` file of `dir`, by name; files that do not parse are returned as errors
    /// beside the others, so one bad file does not stop the rest.
    pub fn read_dir(dir: &Path) -> Result<Vec<Result<AttachFile, AttachFileError>>, AttachFileError> {
        let rd = std::fs::read_dir(dir)
            .map_err(|e| AttachFileError { path: dir.display().to_string(), message: e.to_string() })?;
        let mut paths: Vec<PathBuf> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        paths.sort();
        Ok(paths.iter().map(|p| Self::read(p)).collect())
    }

    /// The `<target>` of `/dev/disk/by-tyche/<target>/<export>`: `target_name`, or else the
    /// target's MAC (the first interface's) when one is given.
    pub fn by_tyche_target(&self) -> Option<String> {
        self.target_name.clone().or_else(|| self.targets.first().map(|m| m.to_string()))
    }
}

/// " at line L" for a parse error's byte span.
fn span_of(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    span.map(|s| format!(" (line {})", text[..s.start.min(text.len())].lines().count().max(1))).unwrap_or_default()
}

/// A path component for `/dev/disk/by-tyche/`: the name with every byte that is not a letter,
/// digit, `.`, `_`, `-` or `:` replaced by `_`, and never `.` or `..`.
pub fn path_component(name: &str) -> String {
    let s: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || "._-:".contains(c) { c } else { '_' }).collect();
    match s.as_str() {
        "" | "." | ".." => "_".repeat(s.len().max(1)),
        _ => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
export = "disk0"
ifaces = ["eth1", "eth2"]
target = ["52:54:00:74:00:01", "52:54:00:74:01:01"]
target_name = "store1"
no_path_timeout = 60
io_timeout = 5
ethertype = 0x88B6
queues = 2
scheduler = "round-robin"
"#;

    #[test]
    fn a_full_file_parses() {
        let a = AttachFile::parse("vol", GOOD).unwrap();
        assert_eq!(a.name, "vol");
        assert_eq!(a.export, "disk0");
        assert_eq!(a.targets.len(), 2);
        assert_eq!(a.ethertype, 0x88B6);
        assert_eq!(a.queues, Some(2));
        assert_eq!((a.no_path_timeout, a.io_timeout), (Some(60.0), Some(5.0)));
        assert_eq!(a.scheduler, Some(SchedulerKind::RoundRobin));
        assert_eq!(a.by_tyche_target().as_deref(), Some("store1"));
        let min =
            AttachFile::parse("v", "export = \"d\"\nifaces = [\"eth0\"]\ntarget = \"52:54:00:74:00:01\"").unwrap();
        assert_eq!(min.ethertype, DEFAULT_ETHERTYPE);
        assert_eq!(min.by_tyche_target().as_deref(), Some("52:54:00:74:00:01"));
        assert_eq!(min.prometheus_listen, None);
        let m = |extra: &str| AttachFile::parse("v", &format!("export = \"d\"\nifaces = [\"e\"]\n{extra}"));
        let local = m("prometheus_listen = \"localhost:9465\"").unwrap();
        assert_eq!(local.prometheus_listen, Some("127.0.0.1:9465".parse().unwrap()));
        let sock = m("prometheus_listen = \"/run/tyche-init/vol.metrics.sock\"").unwrap();
        assert_eq!(sock.prometheus_listen, Some("/run/tyche-init/vol.metrics.sock".parse().unwrap()));
        let remote = m("prometheus_listen = \"0.0.0.0:9465\"\nprometheus_allow_remote = true").unwrap();
        assert_eq!(remote.prometheus_listen, Some("0.0.0.0:9465".parse().unwrap()));
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let cases = [
            ("v", "export = \"d\"\nifaces = [\"e\"]\nno_path_timout = 3", "unknown field `no_path_timout`"),
            ("v", "ifaces = [\"e\"]", "missing field `export`"),
            ("v", "export = \"d\"", "ifaces"),
            ("v", "export = \"d\"\nifaces = [\"e\"]\ntarget = \"nope\"", "not a MAC address"),
            (
                "v",
                "export = \"d\"\nifaces = [\"e\"]\ntarget = [\"52:54:00:74:00:01\", \"52:54:00:74:00:02\"]",
                "2 addresses for 1",
            ),
            ("v", "export = \"d\"\nifaces = [\"e\"]\nscheduler = \"fast\"", "expected affinity, round-robin"),
            ("v", "export = \"d\"\nifaces = [\"e\"]\nno_path_timeout = -1", "non-negative"),
            ("v", "export = \"d\"\nifaces = [\"e\"]\nio_timeout = 0", "io_timeout: a number of seconds above 0"),
            ("v", "export = \"d\"\nifaces = [\"e\"]\nethertype = 5", "0x0600"),
            ("v", "export = \"d\"\nifaces = [\"e\"]\nqueues = 0", "at least 1"),
            ("v", "export = \"d\"\nifaces = [\"e\"]\ntarget_name = \"a/b\"", "not a name"),
            ("v", "export = \"d\"\nifaces = [\"e\"]\nhost_id = \"12\"", "host_id"),
            (
                "v",
                "export = \"d\"\nifaces = [\"e\"]\nprometheus_listen = \"0.0.0.0:9465\"",
                "prometheus_listen: 0.0.0.0:9465 is not a loopback address",
            ),
            (
                "v",
                "export = \"d\"\nifaces = [\"e\"]\nprometheus_listen = \"nowhere\"",
                "prometheus_listen: \"nowhere\"",
            ),
            ("v", "export = \"d\"\nifaces = [\"e\"]\nprometheus_listen = 9465", "expected a string (line 3)"),
            ("v", "export = \"d\"\nifaces = [\"e\"]\nprometheus_allow_remote = \"yes\"", "expected a boolean (line 3)"),
            ("../x", "export = \"d\"\nifaces = [\"e\"]", "cannot name"),
            ("v", "export = \"d\"\n\nifaces = [\"e\"\n", "line"),
        ];
        for (name, text, want) in cases {
            let e = AttachFile::parse(name, text).expect_err(text);
            assert!(e.contains(want), "{text:?}: {e:?} lacks {want:?}");
        }
    }

    #[test]
    fn files_are_read_by_name_and_one_bad_file_spoils_nothing_else() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("b.toml"), "export = \"d\"\nifaces = [\"e\"]").unwrap();
        std::fs::write(d.path().join("a.toml"), "export = ").unwrap();
        std::fs::write(d.path().join("notes.txt"), "ignored").unwrap();
        let all = AttachFile::read_dir(d.path()).unwrap();
        assert_eq!(all.len(), 2);
        assert!(all[0].as_ref().unwrap_err().to_string().contains("a.toml"));
        assert_eq!(all[1].as_ref().unwrap().name, "b");
        let e = AttachFile::read(&d.path().join("notes.txt")).unwrap_err();
        assert!(e.message.contains(".toml"));
        let big = d.path().join("big.toml");
        std::fs::write(&big, vec![b'#'; MAX_FILE as usize + 1]).unwrap();
        assert!(AttachFile::read(&big).unwrap_err().message.contains("at most"));
    }

    #[test]
    fn path_components_are_safe() {
        assert_eq!(path_component("store1"), "store1");
        assert_eq!(path_component("52:54:00:74:00:01"), "52:54:00:74:00:01");
        assert_eq!(path_component("a/b c"), "a_b_c");
        assert_eq!(path_component(".."), "__");
        assert_eq!(path_component(""), "_");
    }
}
