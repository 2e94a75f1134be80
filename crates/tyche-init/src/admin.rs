//! The operator's subcommands around running attachments: `list`, `detach`, `udev-info` and
//! `attach-all`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tyche_init::attachfile::{path_component, AttachFile};
use tyche_init::frontend::{device_in_use, ublk_id};
use tyche_init::report::Health;
use tyche_init::state::{self, Attachment};
use tyche_init::ublk_frontend::UblkFrontend;

/// How long `detach` waits for the attachment to be gone.
pub const DETACH_WAIT: Duration = Duration::from_secs(30);
/// How long `udev-info` waits for the record of a device that was just created.
pub const UDEV_WAIT: Duration = Duration::from_secs(10);

/// One attachment as `list` shows it.
#[derive(Debug, Serialize)]
pub struct Listed {
    /// Serving process (the dead one's, for a device awaiting recovery).
    pub pid: u32,
    /// `ublk` or `nbd`.
    pub kind: String,
    /// Device or socket path.
    pub path: String,
    /// Export name.
    pub export: String,
    /// Target MAC(s).
    pub target: String,
    /// Attachment file name, when it came from one.
    pub name: Option<String>,
    /// `/dev/disk/by-tyche/<target>/<export>` (ublk devices).
    pub by_tyche: Option<String>,
    /// `live`, `degraded`, `no-path`, `awaiting-recovery` or `unknown` (no stats answer).
    pub state: &'static str,
    /// Links with at least one live channel.
    pub live_links: usize,
    /// Links.
    pub links: usize,
    /// Channels open now.
    pub live_channels: usize,
    /// Channels.
    pub channels: usize,
}

/// The `<target>` of an attachment's `/dev/disk/by-tyche/<target>/<export>`: its target name,
/// else its (first) target MAC, as a path component.
fn target_component(a: &Attachment) -> String {
    path_component(a.target_name.as_deref().unwrap_or_else(|| a.target.split(',').next().unwrap_or("")))
}

/// The stable name udev gives a ublk attachment.
fn by_tyche(a: &Attachment) -> Option<String> {
    (a.kind == "ublk").then(|| format!("/dev/disk/by-tyche/{}/{}", target_component(a), path_component(&a.export)))
}

fn health(a: &Attachment, alive: bool) -> Listed {
    let mut l = Listed {
        pid: a.pid,
        kind: a.kind.clone(),
        path: a.path.clone(),
        export: a.export.clone(),
        target: a.target.clone(),
        name: a.name.clone(),
        by_tyche: by_tyche(a),
        state: Health::AwaitingRecovery.as_str(),
        live_links: 0,
        links: 0,
        live_channels: 0,
        channels: 0,
    };
    if !alive {
        return l;
    }
    let report: Option<tyche_init::Report> =
        (!a.stats.is_empty()).then(|| tyche_runtime::stats_socket::query(Path::new(&a.stats)).ok()).flatten();
    let Some(r) = report else {
        l.state = Health::Unknown.as_str();
        return l;
    };
    let paths = r.paths();
    l.links = paths.links.len();
    l.live_links = paths.live_links();
    l.channels = paths.channels;
    l.live_channels = paths.live_channels;
    l.state = paths.health().as_str();
    l
}

/// `tyche-init list`.
pub fn list(json: bool) -> Result<()> {
    let dir = state::dir();
    let mut all: Vec<Listed> = state::list(&dir)?.iter().map(|a| health(a, true)).collect();
    all.extend(state::awaiting_recovery(&dir)?.iter().map(|a| health(a, false)));
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    if all.is_empty() {
        println!("no attached exports");
    }
    for l in all {
        let links = if l.links > 0 { format!(" ({} of {} links)", l.live_links, l.links) } else { String::new() };
        let name = l.name.map(|n| format!(" name={n}")).unwrap_or_default();
        let by = l.by_tyche.map(|b| format!(" {b}")).unwrap_or_default();
        println!(
            "{:<6} {:<5} {:<28} export={} target={}{name} state={}{links}{by}",
            l.pid, l.kind, l.path, l.export, l.target, l.state
        );
    }
    Ok(())
}

/// `tyche-init udev-info NAME`: prints `KEY=value` lines for udev's `IMPORT{program}`.
pub fn udev_info(device: &str) -> Result<()> {
    let path = if device.starts_with('/') { device.to_owned() } else { format!("/dev/{device}") };
    let dir = state::dir();
    // Another program's ublk device: said at once, not after the wait below (udev runs this for
    // every ublk disk). The kernel knows the serving process from the moment the disk appears.
    if let Some(pid) = ublk_id(&path).and_then(UblkFrontend::server_pid) {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if !comm.is_empty() && comm.trim_end() != "tyche-init" {
            bail!("{path}: served by {} (pid {pid}), not by Tyche", comm.trim_end());
        }
    }
    let t0 = Instant::now();
    // The device exists (udev was told) a moment before its process records it.
    let a = loop {
        let mut all = state::list(&dir)?;
        all.extend(state::awaiting_recovery(&dir)?);
        if let Some(a) = all.into_iter().find(|a| a.path == path) {
            break a;
        }
        if t0.elapsed() > UDEV_WAIT {
            bail!("{path}: no Tyche attachment serves it");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    println!("TYCHE_TARGET={}", target_component(&a));
    println!("TYCHE_EXPORT={}", path_component(&a.export));
    if let Some(n) = &a.name {
        println!("TYCHE_ATTACHMENT={}", path_component(n));
    }
    Ok(())
}

fn wait_gone(pid: u32, device: Option<&str>) -> Result<()> {
    let t0 = Instant::now();
    while state::process_running(pid) || device.is_some_and(|d| Path::new(d).exists()) {
        if t0.elapsed() > DETACH_WAIT {
            bail!("still there after {} s (pid {pid})", DETACH_WAIT.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn refuse_in_use(path: &str) -> Result<()> {
    bail!(
        "{path} is in use (mounted, or held by md or another exclusive opener): unmount or stop it first, \
         or give --force (I/O on it then fails)"
    )
}

/// `tyche-init detach WHAT [--force]`: returns when the attachment is gone.
pub fn detach(what: &str, force: bool) -> Result<()> {
    let dir = state::dir();
    let all = state::list(&dir)?;
    let found: Vec<_> =
        all.iter().filter(|a| a.path == what || a.pid.to_string() == what || a.name.as_deref() == Some(what)).collect();
    if found.is_empty() {
        // A device left by a dead `attach` (created with recovery): nobody serves it, so delete
        // it; I/O waiting on it fails.
        let waiting = state::awaiting_recovery(&dir)?;
        let path = waiting
            .iter()
            .find(|a| a.path == what || a.name.as_deref() == Some(what))
            .map(|a| a.path.clone())
            .unwrap_or_else(|| what.to_owned());
        if let Some(id) = path.starts_with("/dev/ublkb").then(|| ublk_id(&path)).flatten() {
            if Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists() {
                if device_in_use(&path) && !force {
                    refuse_in_use(&path)?;
                }
                UblkFrontend::delete(id)?;
                for a in waiting.iter().filter(|a| a.path == path) {
                    state::remove(&dir, a.pid);
                }
                println!("deleted {path} (no process served it)");
                return Ok(());
            }
        }
        bail!("no attachment {what:?} (see `tyche-init list`)");
    }
    for a in found {
        let pid = nix::unistd::Pid::from_raw(a.pid as i32);
        let ublk = (a.kind == "ublk").then_some(a.path.as_str());
        if ublk.is_some_and(device_in_use) {
            if !force {
                refuse_in_use(&a.path)?;
            }
            // Its process would leave a device in use for recovery: kill it, then delete.
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)
                .with_context(|| format!("killing pid {}", a.pid))?;
            wait_gone(a.pid, None).with_context(|| format!("detaching {}", a.path))?;
            if let Some(id) = ublk_id(&a.path) {
                UblkFrontend::delete(id)?;
            }
            state::remove(&dir, a.pid);
        } else {
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)
                .with_context(|| format!("signalling pid {}", a.pid))?;
        }
        wait_gone(a.pid, ublk).with_context(|| format!("detaching {}", a.path))?;
        println!("detached {} (pid {})", a.path, a.pid);
    }
    Ok(())
}

/// What `attach-all` did with one file.
enum Started {
    Attached(String),
    Waiting(u32),
    Failed(String),
}

/// Starts `tyche-init attach --config FILE` in its own session (its log in the state
/// directory, `NAME.log`), and waits up to `wait` for its record to name the device.
fn start_one(f: &AttachFile, file: &Path, wait: Duration) -> Result<Started> {
    let dir = state::dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let log_path = dir.join(format!("{}.log", f.name));
    let log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let exe = std::env::current_exe().context("finding this program")?;
    let mut cmd = Command::new(exe);
    cmd.arg("attach").arg("--config").arg(file).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
    // SAFETY: setsid is async-signal-safe and touches no memory of this process.
    unsafe {
        cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(std::io::Error::from));
    }
    let mut child = cmd.spawn().context("starting tyche-init attach")?;
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            let last = text.lines().last().unwrap_or("").to_owned();
            return Ok(Started::Failed(format!("exited {status}: {last} (log: {})", log_path.display())));
        }
        if let Some(a) = state::list(&dir)?.into_iter().find(|a| a.name.as_deref() == Some(&f.name)) {
            return Ok(Started::Attached(a.path));
        }
        if t0.elapsed() > wait {
            return Ok(Started::Waiting(child.id()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `tyche-init attach-all`: every attachment file of `dir` not attached yet.
pub fn attach_all(dir: &Path, wait: f64) -> Result<()> {
    let wait = Duration::try_from_secs_f64(wait).context("--wait")?;
    let attached = state::list(&state::dir())?;
    let mut failed = 0;
    let files = AttachFile::read_dir(dir).map_err(|e| anyhow::anyhow!("{e}"))?;
    if files.is_empty() {
        println!("no attachment files in {}", dir.display());
    }
    for f in files {
        let f = match f {
            Ok(f) => f,
            Err(e) => {
                eprintln!("tyche-init: {e}");
                failed += 1;
                continue;
            }
        };
        if let Some(a) = attached.iter().find(|a| a.name.as_deref() == Some(&f.name)) {
            println!("{}: attached already ({}, pid {})", f.name, a.path, a.pid);
            continue;
        }
        let file: PathBuf = dir.join(format!("{}.toml", f.name));
        match start_one(&f, &file, wait)? {
            Started::Attached(path) => println!("{}: {path}", f.name),
            Started::Waiting(pid) => println!("{}: waiting for its target (pid {pid} keeps trying)", f.name),
            Started::Failed(why) => {
                eprintln!("tyche-init: {}: {why}", f.name);
                failed += 1;
            }
        }
    }
    if failed > 0 {
        bail!("{failed} attachment file(s) failed");
    }
    Ok(())
}
