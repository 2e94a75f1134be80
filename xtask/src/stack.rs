//! What the demo, the end-to-end test and the end-to-end benchmark share: preparing the machine
//! (packages, release build of the daemons), guarded child processes, and starting `tyched` and
//! `tyche-init serve-nbd` in a lab's namespaces.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::disk::run;
use crate::lab::Lab;

/// Set by the Ctrl-C handler; long steps check it and unwind, so every guard tears down.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Checks for root, installs missing packages (unless `no_install`) and builds the workspace's
/// release binaries (`tyched`, `tyche-init`, the lab tools of `tyche-tools`). `what` names the command in the error for non-root users.
pub fn prepare(root: &Path, what: &str, no_install: bool) -> Result<()> {
    ensure!(tyche_testkit::is_root(), "{what} needs root (network namespaces, AF_XDP, loop devices)");
    if !no_install {
        ensure_packages(root)?;
    }
    // The suite's one release build (`xdp::build`, the whole workspace's features): building
    // `-p tyched -p tyche-init` alone unified features differently and rebuilt half the
    // dependency graph (2.5 min of the suite's nbd-clients step on a clean clone).
    crate::xdp::build(root)?;
    Ok(())
}

/// A release binary of the workspace.
pub fn bin(root: &Path, name: &str) -> PathBuf {
    crate::xdp::target_dir(root).join("release").join(name)
}

/// How the initiator reaches the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// AF_XDP on every veth pair of the lab.
    Xdp,
    /// Tyche's TCP transport over the first veth pair.
    Tcp,
}

fn tcp_addr(lab: &Lab) -> String {
    format!("{}:7788", lab.pairs[0].target_ip)
}

/// A started daemon and its log.
pub struct Running {
    /// The process.
    pub daemon: Daemon,
    /// Its stdout and stderr.
    pub log: PathBuf,
}

impl Running {
    /// Fails with the log's tail if the daemon has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        self.daemon.check_alive(&self.log)
    }
}

/// Starts `tyched serve --export EXPORT` (e.g. `demo=ram:1G`) in the target namespace, with its
/// stats socket at `stats`, and waits until it serves.
pub fn start_tyched(root: &Path, lab: &Lab, link: Link, export: &str, stats: &Path, log: PathBuf) -> Result<Running> {
    start_tyched_with(root, lab, link, &["--export".to_string(), export.to_string()], stats, log)
}

/// As [`start_tyched`], with `serve_args` (`--export ...`, `--config FILE`) naming the exports.
pub fn start_tyched_with(
    root: &Path,
    lab: &Lab,
    link: Link,
    serve_args: &[String],
    stats: &Path,
    log: PathBuf,
) -> Result<Running> {
    let _ = fs::remove_file(stats);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.target_ns]).arg(bin(root, "tyched")).arg("serve").args(serve_args);
    cmd.arg("--stats-socket").arg(stats);
    match link {
        Link::Tcp => {
            cmd.args(["--transport", "tcp", "--tcp-listen", &tcp_addr(lab), "--iface", &lab.pairs[0].target_if]);
        }
        Link::Xdp => {
            for p in &lab.pairs {
                cmd.arg("--iface").arg(&p.target_if);
            }
        }
    }
    let mut t = Running { daemon: Daemon::spawn("tyched", &mut cmd, &log)?, log };
    wait_for("tyched", Duration::from_secs(30), || {
        t.check_alive()?;
        // Over TCP, tyched takes its initiator's connection before it opens the stats socket.
        let waiting = || fs::read_to_string(&t.log).is_ok_and(|l| l.contains("waiting for initiators"));
        Ok(stats.exists() || (link == Link::Tcp && waiting()))
    })?;
    Ok(t)
}

/// Starts `tyche-init serve-nbd` for export `export` in the initiator namespace, serving NBD on
/// `socket` (`extra` arguments appended), and waits for the socket. Logs at `info`.
pub fn start_initiator(
    root: &Path,
    lab: &Lab,
    link: Link,
    export: &str,
    socket: &Path,
    log: PathBuf,
    extra: &[String],
) -> Result<Running> {
    let _ = fs::remove_file(socket);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.initiator_ns]).arg(bin(root, "tyche-init")).arg("serve-nbd");
    cmd.arg("--socket").arg(socket).args(["--export", export]);
    match link {
        Link::Tcp => {
            cmd.args(["--tcp", &tcp_addr(lab)]);
        }
        Link::Xdp => {
            for p in &lab.pairs {
                cmd.arg("--iface").arg(&p.initiator_if).arg("--target").arg(p.target_mac.to_string());
            }
        }
    }
    cmd.args(extra).env("TYCHE_LOG", "info");
    let mut i = Running { daemon: Daemon::spawn("tyche-init", &mut cmd, &log)?, log };
    wait_for("tyche-init's NBD socket", Duration::from_secs(60), || {
        i.check_alive()?;
        Ok(socket.exists())
    })?;
    Ok(i)
}

/// Starts `tyche-init serve-nbd --loopback-mib MIB --export EXPORT --nbd-io IO` (its in-process
/// RAM target: no lab, no `tyched`) on `socket`, and waits for the socket.
pub fn start_loopback_initiator(
    root: &Path,
    export: &str,
    mib: u64,
    io: &str,
    socket: &Path,
    log: &Path,
) -> Result<Daemon> {
    let _ = fs::remove_file(socket);
    let mut cmd = Command::new(bin(root, "tyche-init"));
    cmd.args(["serve-nbd", "--loopback-mib", &mib.to_string(), "--export", export, "--nbd-io", io]);
    cmd.arg("--socket").arg(socket).env("TYCHE_LOG", "info");
    let mut d = Daemon::spawn("tyche-init serve-nbd --loopback-mib", &mut cmd, log)?;
    wait_for("tyche-init's NBD socket", Duration::from_secs(60), || {
        d.check_alive(log)?;
        Ok(socket.exists())
    })?;
    Ok(d)
}

/// A child process killed (and reaped) when dropped.
pub struct Daemon {
    name: &'static str,
    child: Child,
}

impl Daemon {
    pub fn spawn(name: &'static str, cmd: &mut Command, log: &Path) -> Result<Daemon> {
        let out = fs::File::create(log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Daemon { name, child })
    }

    pub fn check_alive(&mut self, log: &Path) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let tail = fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(15).collect();
            bail!(
                "{} exited ({status}); its log ends:\n{}",
                self.name,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit on its own, up to `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            ensure!(Instant::now() < deadline, "{} still runs after {timeout:?}", self.name);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL (`kill -9`), and reaps it.
    pub fn kill(&mut self) -> Result<std::process::ExitStatus> {
        self.child.kill().with_context(|| format!("killing {}", self.name))?;
        Ok(self.child.wait()?)
    }

    /// SIGTERM, then SIGKILL after a grace period.
    pub fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Installs the packages in `.ci/packages` that are missing (root only).
pub fn ensure_packages(root: &Path) -> Result<()> {
    let list = fs::read_to_string(root.join(".ci/packages")).context("reading .ci/packages")?;
    let wanted: Vec<&str> = list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let missing: Vec<&str> = wanted
        .into_iter()
        .filter(|p| {
            let q = Command::new("dpkg-query").args(["-W", "-f=${Status}", p]).output();
            !q.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    Ok(())
}

/// Fails once Ctrl-C was pressed.
pub fn interrupted() -> Result<()> {
    ensure!(!INTERRUPTED.load(Ordering::Relaxed), "interrupted");
    Ok(())
}

pub fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !ready()? {
        interrupted()?;
        ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// fio job `name` with `job`'s options and crc32c verify through NBD socket `socket` (export
/// `export`), in the lab's initiator namespace and in `work`; JSON output in `work/<name>.json`
/// (returned), its log in `work/<name>.log`.
pub fn fio_nbd(
    lab: &Lab,
    work: &Path,
    export: &str,
    socket: &Path,
    name: &str,
    job: &[String],
) -> Result<(Guard, PathBuf)> {
    let out = work.join(format!("{name}.json"));
    let log = fs::File::create(work.join(format!("{name}.log")))?;
    let uri = format!("nbd+unix:///{export}?socket={}", socket.display());
    let child = Command::new("ip")
        .args(["netns", "exec", &lab.initiator_ns, "fio", "--name", name, "--ioengine=nbd"])
        .arg(format!("--uri={uri}"))
        .args(job)
        .args(["--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json"])
        .arg(format!("--output={}", out.display()))
        .current_dir(work)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting fio")?;
    Ok((Guard(child), out))
}

/// fio's JSON: the job's error, bytes written and bytes read (verify reads).
pub fn fio_result(out: &Path) -> Result<(i64, u64, u64)> {
    let text = fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?;
    let json = &text[text.find('{').context("fio wrote no JSON")?..];
    let v: serde_json::Value = serde_json::from_str(json).context("fio's JSON")?;
    let j = &v["jobs"][0];
    let bytes = |d: &str| j[d]["io_bytes"].as_u64().unwrap_or(0);
    Ok((j["error"].as_i64().unwrap_or(-1), bytes("write"), bytes("read")))
}

/// A child killed (and reaped) when dropped.
pub struct Guard(pub Child);

impl Guard {
    /// Waits for the child, up to `timeout`; kills it past that.
    pub fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.0.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                let _ = self.0.kill();
                let _ = self.0.wait();
                bail!("still running after {timeout:?}; killed");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
