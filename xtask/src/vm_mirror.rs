//! `vm-test`'s mirror test: Tyche volumes as members of Linux md arrays, in the VM.
//!
//! Three `tyched` targets in the guest's target namespace, each on veth links of its own (target
//! 0 on `tyt0` and `tyt2`, target 1 on `tyt1` and `tyt3`, target 2 on `tyt4`: one AF_XDP socket
//! per queue, so each attachment of a target needs a link of its own), each exporting files on
//! the guest's tmpfs (kept across a SIGKILL, so a restarted target serves the same data).
//! `tyche-init attach` makes a ublk device of each export, over that target's link only; md
//! mirrors across the targets.
//!
//! - **raid1**: `mdadm --create /dev/md0 --level=1 --raid-devices=2 --bitmap=internal
//!   --failfast` over one export of targets 0 and 1, the initial sync waited for, ext4, a tree of
//!   files, then fio (`--verify=crc32c`, direct I/O) in passes for the whole scenario, every pass
//!   must exit 0. Round 1: target 0 SIGKILLed and restarted at once. Round 2: target 0 SIGKILLed
//!   and kept down past the members' I/O deadline ([`IO_DEADLINE`]), then restarted. Rounds 3
//!   and 4: the member's link down ([`LINK_OUTAGES`]: 11 s, and 30 s, past the initiator's
//!   no-path timeout and the target's session reclaim, both shortened from their defaults by
//!   [`NO_PATH`] and [`RECLAIM_MS`] so that the long outage lasts 30 s, not the 120 s the
//!   defaults would need). In each round, if md marked the member
//!   faulty, the time from the fault is measured (rounds 2 to 4 must see it within the deadline
//!   and 5 s), the member is removed and re-added (`mdadm --re-add`) once it serves again, and
//!   the resync is measured against the array (the bitmap's dirty chunks on the surviving member
//!   just before the re-add, and the time to a clean array). Then: `tyche-init` of a member
//!   killed under the array and recovered (`attach --recover`), md must keep both members with
//!   no resync; a second host (its own host id, over the targets' other links) attaching the
//!   members must be refused naming the holder; the member of target 0 moved to target 2 with no
//!   downtime (added, array grown to 3 and synced, the old one failed and removed, shrunk to 2).
//!   Then `mdadm --detail` must show both members active and none failed, fio stops, unmount,
//!   `e2fsck -fn` clean, the tree and fio's file verified, and md's own `check` must find
//!   `mismatch_cnt` 0 (both legs equal, byte for byte).
//! - **raid10**: `--level=10` over four devices (two exports per target, mirrored pairs across
//!   the targets), ext4, tree and fio verified, fsck clean, `mismatch_cnt` 0.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::disk::{run, BlockFs, Tree};
use crate::lab::Lab;
use crate::stack::{self, Daemon};

/// The members' I/O deadline: the initiator option and its seconds. `--io-timeout`: a request
/// that has waited that long from its submission with no live path fails with EIO, while the
/// device stays attached and serves again when a path returns (`--no-path-timeout 5`, counted
/// from the last path's loss, was the stand-in before it landed).
const IO_DEADLINE: (&str, u64) = ("--io-timeout", 5);
/// How long round 2 keeps the target down: past the deadline, so md must fail the member.
const DOWN: Duration = Duration::from_secs(3 * IO_DEADLINE.1);
/// The members' `--no-path-timeout`, seconds (default 30): with no path for this long the
/// initiator gives its session up and opens a new one when a path returns.
const NO_PATH: (&str, u64) = ("--no-path-timeout", 15);
/// The targets' `reclaim_after_ms` (default 35 000): a session whose channels are all dead
/// (`dead_after_ms`, 3 s) is kept this much longer before it is reclaimed.
const RECLAIM_MS: u64 = 15_000;
/// Rounds 3 and 4 take the member's link down this long, seconds: shorter than the initiator's
/// no-path timeout ([`NO_PATH`]) and the target's session reclaim (3 s + [`RECLAIM_MS`]) but past
/// the I/O deadline (md fails the member about 5 s in), and past both (the initiator opens a
/// new session when the link is back, the target has reclaimed the old one).
const LINK_OUTAGES: [u64; 2] = [11, 30];
/// Each RAID1 member (an export of each target), MiB.
const R1_MIB: u64 = 64;
/// Each RAID10 member (two exports of each target), MiB.
const R10_MIB: u64 = 32;
/// md's bitmap chunk: the resync granularity of a re-added member.
const BITMAP_CHUNK: &str = "1M";
/// fio's file, written and verified in each pass.
const FIO_MIB: u64 = 16;

/// A `tyched` serving its exports on one link of the lab; restarted after a kill.
struct Target {
    k: usize,
    ifaces: Vec<String>,
    exports: Vec<String>,
    stats: PathBuf,
    work: PathBuf,
    starts: usize,
    daemon: Option<(Daemon, PathBuf)>,
}

impl Target {
    /// Target `k` on the lab's `pairs`.
    fn new(lab: &Lab, k: usize, pairs: &[usize], work: &Path) -> Target {
        let img = |name: &str, mib: u64| format!("{name}={}:{mib}M", work.join(format!("t{k}-{name}.img")).display());
        Target {
            k,
            ifaces: pairs.iter().map(|&p| lab.pairs[p].target_if.clone()).collect(),
            exports: vec![img("r1", R1_MIB), img("r10a", R10_MIB), img("r10b", R10_MIB)],
            stats: work.join(format!("tyched{k}.sock")),
            work: work.to_path_buf(),
            starts: 0,
            daemon: None,
        }
    }

    /// Starts `tyched serve` in the lab's target namespace; returns once its stats socket is up.
    fn start(&mut self, lab: &Lab) -> Result<()> {
        self.starts += 1;
        let log = self.work.join(format!("tyched{}-{}.log", self.k, self.starts));
        let _ = fs::remove_file(&self.stats);
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &lab.target_ns]).arg(stack::bin(Path::new("/"), "tyched")).arg("serve");
        for e in &self.exports {
            cmd.arg("--export").arg(e);
        }
        for i in &self.ifaces {
            cmd.arg("--iface").arg(i);
        }
        let config = self.work.join(format!("tyched{}.toml", self.k));
        fs::write(&config, format!("reclaim_after_ms = {RECLAIM_MS}\n"))
            .with_context(|| format!("writing {}", config.display()))?;
        cmd.arg("--config").arg(&config);
        cmd.arg("--stats-socket").arg(&self.stats).env("TYCHE_LOG", "info");
        let mut d = Daemon::spawn("tyched", &mut cmd, &log)?;
        stack::wait_for("tyched", Duration::from_secs(30), || {
            d.check_alive(&log)?;
            Ok(self.stats.exists())
        })?;
        self.daemon = Some((d, log));
        Ok(())
    }

    fn kill(&mut self) -> Result<()> {
        let (mut d, _) = self.daemon.take().context("the target is not running")?;
        d.kill()?;
        Ok(())
    }

    fn check_alive(&mut self) -> Result<()> {
        match &mut self.daemon {
            Some((d, log)) => d.check_alive(log),
            None => bail!("target {} is not running", self.k),
        }
    }
}

/// A `tyche-init attach` of one export over one link, and its `/dev/ublkbN`.
struct Member {
    daemon: Daemon,
    log: PathBuf,
    dev: String,
    /// The lab's pair it attached over, and the export.
    k: usize,
    export: String,
}

/// `tyche-init attach` of `export` over the lab's pair `k`, with `extra` arguments.
fn attach_cmd(lab: &Lab, k: usize, export: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.initiator_ns]).arg(stack::bin(Path::new("/"), "tyche-init")).arg("attach");
    cmd.arg("--iface").arg(&lab.pairs[k].initiator_if).arg("--target").arg(lab.pairs[k].target_mac.to_string());
    cmd.args(["--export", export, "--queues", "1", "--depth", "32"]).args(extra).env("TYCHE_LOG", "info");
    cmd
}

impl Member {
    /// Attaches `export` over the lab's pair `k` (target `k % 2`).
    fn attach(lab: &Lab, k: usize, export: &str, work: &Path) -> Result<Member> {
        let log = work.join(format!("attach-{k}-{export}.log"));
        // --retry: under TCG a target's first answer came after the attach's own timeout.
        let (deadline, no_path) = (IO_DEADLINE.1.to_string(), NO_PATH.1.to_string());
        let mut cmd = attach_cmd(lab, k, export, &["--retry", IO_DEADLINE.0, &deadline, NO_PATH.0, &no_path]);
        let mut daemon = Daemon::spawn("tyche-init attach", &mut cmd, &log)?;
        let dev = crate::vm_ublk::wait_started(&mut daemon, &log, "ublk device started")?;
        Ok(Member { daemon, log, dev, k, export: export.to_string() })
    }

    /// Kills the serving `tyche-init attach` (SIGKILL) and takes the device over with `attach
    /// --recover`, as its unit's restart does; returns the time from the kill to the device
    /// serving again.
    fn kill_and_recover(&mut self, lab: &Lab, work: &Path) -> Result<Duration> {
        let killed = Instant::now();
        self.daemon.kill()?;
        ensure!(Path::new(&self.dev).exists(), "{} went away with its server", self.dev);
        let log = work.join(format!("attach-{}-{}-recover.log", self.k, self.export));
        let (deadline, no_path) = (IO_DEADLINE.1.to_string(), NO_PATH.1.to_string());
        let args = ["--retry", IO_DEADLINE.0, &deadline, NO_PATH.0, &no_path, "--recover", &self.dev];
        let mut cmd = attach_cmd(lab, self.k, &self.export, &args);
        let mut daemon = Daemon::spawn("tyche-init attach --recover", &mut cmd, &log)?;
        let dev = crate::vm_ublk::wait_started(&mut daemon, &log, "ublk device recovered")?;
        ensure!(dev == self.dev, "--recover {} printed {dev}", self.dev);
        self.daemon = daemon;
        self.log = log;
        Ok(killed.elapsed())
    }

    /// `ublkbN`, md's name for the member in sysfs (`dev-ublkbN`).
    fn name(&self) -> &str {
        self.dev.trim_start_matches("/dev/")
    }

    fn detach(mut self) -> Result<()> {
        run(Command::new(stack::bin(Path::new("/"), "tyche-init")).args(["detach", &self.dev]))?;
        let status =
            self.daemon.wait(Duration::from_secs(30)).context("tyche-init attach did not exit after detach")?;
        if !status.success() {
            let tail = fs::read_to_string(&self.log).unwrap_or_default();
            bail!("tyche-init attach of {} exited with {status} after detach:\n{tail}", self.dev);
        }
        Ok(())
    }
}

/// An md array's sysfs attribute (`/sys/block/mdN/md/ATTR`), trimmed.
fn md_attr(md: &str, attr: &str) -> Result<String> {
    let name = md.trim_start_matches("/dev/");
    let p = format!("/sys/block/{name}/md/{attr}");
    Ok(fs::read_to_string(&p).with_context(|| p.clone())?.trim().to_string())
}

/// Waits until `md` has no sync or recovery running and is not degraded; returns how long.
fn wait_in_sync(md: &str, limit: Duration) -> Result<Duration> {
    let start = Instant::now();
    // md may start the resync a moment after the array (or the re-added member) appears.
    std::thread::sleep(Duration::from_millis(500));
    stack::wait_for(&format!("{md} in sync"), limit, || {
        Ok(md_attr(md, "sync_action")? == "idle" && md_attr(md, "degraded")? == "0")
    })
    .with_context(|| format!("/proc/mdstat:\n{}", fs::read_to_string("/proc/mdstat").unwrap_or_default()))?;
    Ok(start.elapsed())
}

/// `mdadm --create` of a level `level` array over `devs` (a bitmap, failfast members, the
/// initial sync run, not skipped); returns the time the initial sync took.
fn create(md: &str, level: &str, devs: &[&str]) -> Result<Duration> {
    let mut cmd = Command::new("mdadm");
    cmd.args(["--create", md, "--run", "--metadata=1.2", &format!("--level={level}")]);
    cmd.arg(format!("--raid-devices={}", devs.len()));
    cmd.args(["--bitmap=internal", &format!("--bitmap-chunk={BITMAP_CHUNK}"), "--failfast"]);
    cmd.args(devs);
    run(&mut cmd).with_context(|| format!("mdadm --create {md} --level={level}"))?;
    let took = wait_in_sync(md, Duration::from_secs(180)).context("the initial sync")?;
    let detail = run(Command::new("mdadm").args(["--detail", md]))?;
    ensure!(detail.contains("failfast"), "mdadm --detail {md} shows no failfast member:\n{detail}");
    Ok(took)
}

/// md's own `check` of every stripe: both legs must hold the same bytes.
fn check_mirrors(md: &str) -> Result<()> {
    let name = md.trim_start_matches("/dev/");
    fs::write(format!("/sys/block/{name}/md/sync_action"), "check")?;
    wait_in_sync(md, Duration::from_secs(180)).context("md's check")?;
    let mismatch = md_attr(md, "mismatch_cnt")?;
    ensure!(mismatch == "0", "md's check of {md} found mismatch_cnt {mismatch}");
    Ok(())
}

/// fio in passes on one file until stopped; each pass writes it (direct I/O, CRC32C headers in
/// every block) and reads it back, and must exit 0.
struct FioLoop {
    stop: Arc<AtomicBool>,
    passes: Arc<AtomicU64>,
    /// The failed pass's error, for [`FioLoop::check`].
    error: Arc<Mutex<Option<String>>>,
    handle: JoinHandle<Result<u64>>,
}

impl FioLoop {
    fn start(file: PathBuf) -> FioLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let passes = Arc::new(AtomicU64::new(0));
        let error = Arc::new(Mutex::new(None));
        let (s, p, e) = (Arc::clone(&stop), Arc::clone(&passes), Arc::clone(&error));
        let handle = std::thread::spawn(move || -> Result<u64> {
            while !s.load(Ordering::Relaxed) {
                let n = p.load(Ordering::Relaxed) + 1;
                if let Err(err) = fio(&file, false).with_context(|| format!("fio pass {n}")) {
                    *e.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("{err:#}"));
                    return Err(err);
                }
                p.store(n, Ordering::Relaxed);
            }
            Ok(p.load(Ordering::Relaxed))
        });
        FioLoop { stop, passes, error, handle }
    }

    fn passes(&self) -> u64 {
        self.passes.load(Ordering::Relaxed)
    }

    /// Fails at once if a pass failed.
    fn check(&self) -> Result<()> {
        if let Some(e) = self.error.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bail!("{e}");
        }
        ensure!(!self.handle.is_finished(), "fio stopped early");
        Ok(())
    }

    /// Waits for `n` more passes to complete.
    fn wait_passes(&self, n: u64, limit: Duration) -> Result<()> {
        let want = self.passes() + n;
        stack::wait_for(&format!("{n} fio pass(es)"), limit, || {
            self.check()?;
            Ok(self.passes() >= want)
        })
    }

    fn finish(self) -> Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        match self.handle.join() {
            Ok(r) => r,
            Err(_) => bail!("the fio thread panicked"),
        }
    }
}

/// `fio --verify=crc32c` on `file`: written and read back, or (`verify_only`) only read back.
fn fio(file: &Path, verify_only: bool) -> Result<()> {
    let mut cmd = Command::new("fio");
    cmd.args(["--name=mirror", "--thread", "--ioengine=psync", "--direct=1", "--rw=write", "--bs=64k"]);
    cmd.arg(format!("--size={FIO_MIB}M"));
    cmd.args(["--verify=crc32c", "--verify_fatal=1", "--do_verify=1"]).arg(format!("--filename={}", file.display()));
    if verify_only {
        cmd.arg("--verify_only=1");
    }
    run(&mut cmd)?;
    Ok(())
}

/// What a fault round does to the victim member's target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL to the target's `tyched`, started again after the outage.
    Kill,
    /// The victim's link taken down at both ends, brought up again after the outage (the
    /// target host unreachable; the target keeps running).
    LinkDown,
}

/// What one fault round of the raid1 scenario saw.
struct Round {
    fault: Fault,
    /// From the fault to md marking the member faulty, if it did.
    failed_after: Option<Duration>,
    /// Bitmap chunks dirty on the surviving member at the re-add, of all, and the chunk's bytes.
    dirty: Option<(u64, u64, u64)>,
    /// From the re-add to a clean array.
    resync: Option<Duration>,
    /// From the fault to the target serving (or its link up) again.
    back_after: Duration,
}

/// `mdadm -X` (`--examine-bitmap`) of `dev`: (dirty chunks, chunks).
fn bitmap_dirty(dev: &str) -> Result<(u64, u64)> {
    let out = run(Command::new("mdadm").args(["--examine-bitmap", dev]))?;
    // "          Bitmap : 64 bits (chunks), 3 dirty (4.7%)"
    let line = out.lines().find(|l| l.trim_start().starts_with("Bitmap :")).context("mdadm -X: no Bitmap line")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let bits = words.get(2).and_then(|w| w.parse().ok()).with_context(|| format!("mdadm -X: {line}"))?;
    let dirty = words.iter().position(|w| *w == "dirty").and_then(|i| words[i - 1].parse().ok());
    Ok((dirty.with_context(|| format!("mdadm -X: {line}"))?, bits))
}

/// Sets the lab's pair `k` down or up, at both ends.
fn set_link(lab: &Lab, k: usize, up: bool) -> Result<()> {
    let state = if up { "up" } else { "down" };
    let p = &lab.pairs[k];
    crate::lab::ip(&["-n", &lab.target_ns, "link", "set", "dev", &p.target_if, state])?;
    crate::lab::ip(&["-n", &lab.initiator_ns, "link", "set", "dev", &p.initiator_if, state])
}

/// Does `fault` to `target` (or to the victim's link), undoes it after `down`, and watches `md`
/// through it: a member md failed is removed and re-added once its device serves again, and the
/// resync waited for.
fn fault_round(
    md: &str,
    lab: &Lab,
    target: &mut Target,
    victim: &Member,
    survivor: &Member,
    fio: &FioLoop,
    (fault, down): (Fault, Duration),
) -> Result<Round> {
    let state = format!("dev-{}/state", victim.name());
    let killed = Instant::now();
    match fault {
        Fault::Kill => target.kill()?,
        Fault::LinkDown => set_link(lab, victim.k, false)?,
    }
    let mut failed_after = None;
    let watch = |failed_after: &mut Option<Duration>| -> Result<()> {
        if failed_after.is_none() && md_attr(md, &state).unwrap_or_default().contains("faulty") {
            *failed_after = Some(killed.elapsed());
        }
        fio.check()
    };
    while killed.elapsed() < down {
        watch(&mut failed_after)?;
        std::thread::sleep(Duration::from_millis(100));
    }
    match fault {
        Fault::Kill => target.start(lab)?,
        Fault::LinkDown => set_link(lab, victim.k, true)?,
    }
    let back_after = killed.elapsed();
    // The initiator reconnects; requests that waited are re-issued. Watch a while longer: a
    // member whose requests failed meanwhile is marked faulty now.
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(IO_DEADLINE.1 + 3) {
        watch(&mut failed_after)?;
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut round = Round { fault, failed_after, dirty: None, resync: None, back_after };
    if round.failed_after.is_some() {
        let mdstat = fs::read_to_string("/proc/mdstat").unwrap_or_default();
        println!("mirror: {} faulty, /proc/mdstat:\n{}", victim.dev, mdstat.trim_end());
        stack::wait_for(&format!("mdadm --remove {}", victim.dev), Duration::from_secs(60), || {
            fio.check()?;
            Ok(Command::new("mdadm").args([md, "--remove", &victim.dev]).output()?.status.success())
        })?;
        let (dirty, bits) = bitmap_dirty(&survivor.dev)?;
        let chunk = md_attr(md, "bitmap/chunksize")?.parse().context("md's bitmap/chunksize")?;
        round.dirty = Some((dirty, bits, chunk));
        // The device serves again once its link has a channel: until then the re-add's reads fail.
        let mut last = String::new();
        stack::wait_for(&format!("mdadm --re-add {}", victim.dev), Duration::from_secs(60), || {
            fio.check()?;
            let out = Command::new("mdadm").args([md, "--re-add", &victim.dev]).output()?;
            last = String::from_utf8_lossy(&out.stderr).trim().to_string();
            Ok(out.status.success())
        })
        .with_context(|| format!("mdadm said: {last}"))?;
        round.resync = Some(wait_in_sync(md, Duration::from_secs(120)).context("the re-added member's resync")?);
    }
    let detail = run(Command::new("mdadm").args(["--detail", md]))?;
    let field = |k: &str| {
        detail.lines().find_map(|l| l.trim().strip_prefix(k).map(|v| v.trim_start_matches([' ', ':']).to_string()))
    };
    ensure!(
        field("Active Devices").as_deref() == Some("2") && field("Failed Devices").as_deref() == Some("0"),
        "after the round, mdadm --detail {md}:\n{detail}"
    );
    let mdstat = fs::read_to_string("/proc/mdstat")?;
    ensure!(mdstat.contains("[UU]"), "after the round, /proc/mdstat:\n{mdstat}");
    Ok(round)
}

/// Scenario 3: the serving `tyche-init` of `member` killed under the assembled array and its
/// device recovered: md must keep both members (nothing failed, no resync). Returns the time to
/// recovery.
fn recover_under_array(md: &str, lab: &Lab, member: &mut Member, fio: &FioLoop, work: &Path) -> Result<Duration> {
    let state = format!("dev-{}/state", member.name());
    let took = member.kill_and_recover(lab, work)?;
    // Watch past the I/O deadline: a request that failed meanwhile shows as a faulty member.
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(IO_DEADLINE.1 + 3) {
        fio.check()?;
        let st = md_attr(md, &state)?;
        ensure!(
            !st.contains("faulty"),
            "md failed {} after its tyche-init was killed and recovered ({st})",
            member.dev
        );
        ensure!(md_attr(md, "degraded")? == "0", "{md} degraded after the recovery");
        ensure!(md_attr(md, "sync_action")? == "idle", "{md} resyncs after the recovery");
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(took)
}

/// Scenario 4: a second initiator host attaching the array's members (over the targets' other
/// links, with a host id of its own) is refused, naming the holder; the array goes on.
fn second_host(lab: &Lab, members: [&Member; 2], fio: &FioLoop, work: &Path) -> Result<String> {
    let before: Vec<String> = ublk_devices();
    let mut said = Vec::new();
    for m in members {
        let k = m.k + 2;
        let log = work.join(format!("attach-host-b-{k}.log"));
        let mut cmd = attach_cmd(lab, k, &m.export, &["--host-id", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"]);
        let mut b = Daemon::spawn("host B's tyche-init attach", &mut cmd, &log)?;
        let status = b.wait(Duration::from_secs(60)).context("host B's attach should give up")?;
        let text = fs::read_to_string(&log).unwrap_or_default();
        let holder = lab.pairs[m.k].initiator_mac.to_string();
        ensure!(
            !status.success() && text.contains(&holder),
            "host B's attach of {} on target {} was not refused naming {holder} ({status}):\n{text}",
            m.export,
            m.k % 2
        );
        said.push(holder);
        fio.check()?;
    }
    ensure!(ublk_devices() == before, "host B's refused attaches left devices: {:?} (was {before:?})", ublk_devices());
    Ok(format!("both members refused to host B, naming {}", said.join(" and ")))
}

/// Scenario 6: the member `old` moved to `target` (not serving yet) with no downtime, as an
/// operator retires a host: the new target's export attached, added, the array grown to three
/// members and synced, then the old member failed, removed and the array shrunk back to two.
/// Returns the new member and the verdict's words.
fn move_member(
    md: &str,
    lab: &Lab,
    target: &mut Target,
    old: &Member,
    fio: &FioLoop,
    work: &Path,
) -> Result<(Member, String)> {
    target.start(lab)?;
    let pair = lab.pairs.iter().position(|p| target.ifaces.contains(&p.target_if)).context("target 2's link")?;
    let new = Member::attach(lab, pair, "r1", work)?;
    run(Command::new("mdadm").args([md, "--add", &new.dev]))?;
    run(Command::new("mdadm").args(["--grow", md, "--raid-devices=3"]))?;
    let synced = wait_in_sync(md, Duration::from_secs(180)).context("the new member's sync")?;
    fio.check()?;
    run(Command::new("mdadm").args([md, "--fail", &old.dev]))?;
    run(Command::new("mdadm").args([md, "--remove", &old.dev]))?;
    run(Command::new("mdadm").args(["--grow", md, "--raid-devices=2"]))?;
    wait_in_sync(md, Duration::from_secs(60)).context("the array shrunk back to two members")?;
    fio.check()?;
    let detail = run(Command::new("mdadm").args(["--detail", md]))?;
    ensure!(detail.contains(&new.dev) && !detail.contains(&old.dev), "after the move, mdadm --detail {md}:\n{detail}");
    let mdstat = fs::read_to_string("/proc/mdstat")?;
    ensure!(mdstat.contains("[UU]"), "after the move, /proc/mdstat:\n{mdstat}");
    let words = format!(
        "moved from target {} to target {} ({} added, synced in {:.1} s, {} failed and removed, back to 2 members) \
         under fio without an error",
        old.k % 2,
        target.k,
        new.dev,
        synced.as_secs_f64(),
        old.dev
    );
    Ok((new, words))
}

/// The `/dev/ublkbN` devices present, sorted.
fn ublk_devices() -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir("/dev")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("ublkb"))
        .collect();
    v.sort();
    v
}

fn describe(round: &Round, array: u64) -> String {
    let what = match round.fault {
        Fault::Kill => "the kill",
        Fault::LinkDown => "the link went down",
    };
    let mut s = match round.fault {
        Fault::Kill => format!("target serving again {:.1} s after the kill, ", round.back_after.as_secs_f64()),
        Fault::LinkDown => format!("link up again {:.1} s after it went down, ", round.back_after.as_secs_f64()),
    };
    match round.failed_after {
        None => s.push_str("md kept the member (no request failed)"),
        Some(t) => {
            s.push_str(&format!("md failed the member {:.1} s after {what}", t.as_secs_f64()));
            if let (Some((dirty, bits, chunk)), Some(resync)) = (round.dirty, round.resync) {
                s.push_str(&format!(
                    ", re-added: {} MiB resynced ({dirty} of {bits} bitmap chunks dirty) of {} MiB in {:.1} s",
                    (dirty * chunk) >> 20,
                    array >> 20,
                    resync.as_secs_f64()
                ));
            }
        }
    }
    s
}

/// The raid1 array's filesystem with fio running in passes, checked between scenarios.
struct Checked {
    disk: BlockFs,
    tree: Tree,
    fio: Option<FioLoop>,
    /// fio passes of the loops stopped so far.
    passes: u64,
    /// Checkpoints passed.
    checks: u64,
}

impl Checked {
    fn running(&self) -> Result<&FioLoop> {
        self.fio.as_ref().context("fio is not running")
    }

    /// After a scenario: fio stopped once its pass ends (at least one pass ran since the last
    /// check), unmount, caches dropped, `e2fsck -fn` clean, mounted again, the tree and fio's
    /// file verified, fio started again.
    fn checkpoint(&mut self) -> Result<()> {
        let running = self.fio.take().context("fio is not running")?;
        if running.passes() == 0 {
            running.wait_passes(1, Duration::from_secs(120))?;
        }
        self.passes += running.finish()?;
        self.disk.umount()?;
        self.disk.drop_caches()?;
        self.disk.fsck().with_context(|| format!("after scenario {}", self.checks + 1))?;
        let mnt = self.disk.mount()?;
        self.tree.verify(&mnt.join("tree"), &mut |_| {})?;
        fio(&mnt.join("fio.dat"), true).context("fio --verify_only")?;
        self.fio = Some(FioLoop::start(mnt.join("fio.dat")));
        // Let the next pass begin writing before the next fault.
        std::thread::sleep(Duration::from_secs(2));
        self.running()?.check()?;
        self.checks += 1;
        Ok(())
    }
}

/// Unmounts, drops caches, `e2fsck -fn`, mounts again and verifies the tree and fio's file,
/// unmounts; then md's `check`.
fn verify_all(md: &str, disk: &mut BlockFs, tree: &Tree) -> Result<()> {
    disk.umount()?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    tree.verify(&mnt.join("tree"), &mut |_| {})?;
    fio(&mnt.join("fio.dat"), true).context("fio --verify_only")?;
    disk.umount()?;
    check_mirrors(md)
}

fn raid1(lab: &Lab, targets: &mut [Target; 2], third: &mut Target, work: &Path) -> Result<String> {
    let md = "/dev/md0";
    let mut m0 = Member::attach(lab, 0, "r1", work)?;
    let m1 = Member::attach(lab, 1, "r1", work)?;
    let sync = create(md, "1", &[&m0.dev, &m1.dev])?;
    let mut disk = BlockFs::new(md, work);
    let array = disk.size()?;
    println!(
        "mirror: {md} raid1 over {} (target 0) and {} (target 1), {} MiB, initial sync {:.1} s",
        m0.dev,
        m1.dev,
        array >> 20,
        sync.as_secs_f64()
    );
    disk.mkfs()?;
    let mnt = disk.mount()?;
    let tree = Tree::new(0x0d1e_a5e1, 24, 8 << 20);
    fs::create_dir_all(mnt.join("tree"))?;
    tree.write(&mnt.join("tree"), &mut |_| {})?;
    let mut w = Checked { disk, tree, fio: Some(FioLoop::start(mnt.join("fio.dat"))), passes: 0, checks: 0 };
    w.running()?.wait_passes(1, Duration::from_secs(120))?;

    let quick = fault_round(md, lab, &mut targets[0], &m0, &m1, w.running()?, (Fault::Kill, Duration::ZERO))
        .context("round 1")?;
    println!("mirror: round 1 (kill -9, restart at once): {}", describe(&quick, array));
    w.checkpoint()?;
    let long = fault_round(md, lab, &mut targets[0], &m0, &m1, w.running()?, (Fault::Kill, DOWN)).context("round 2")?;
    println!("mirror: round 2 (kill -9, down {} s): {}", DOWN.as_secs(), describe(&long, array));
    let mut outages = Vec::new();
    for (i, secs) in LINK_OUTAGES.into_iter().enumerate() {
        w.checkpoint()?;
        let down = Duration::from_secs(secs);
        let r = fault_round(md, lab, &mut targets[0], &m0, &m1, w.running()?, (Fault::LinkDown, down))
            .with_context(|| format!("round {} (link down {secs} s)", i + 3))?;
        println!("mirror: round {} (link down {secs} s): {}", i + 3, describe(&r, array));
        outages.push((secs, r));
    }
    for (what, r) in [(format!("target down {} s", DOWN.as_secs()), &long)]
        .into_iter()
        .chain(outages.iter().map(|(secs, r)| (format!("link down {secs} s"), r)))
    {
        ensure!(
            r.failed_after.is_some_and(|t| t < Duration::from_secs(IO_DEADLINE.1 + 5)),
            "md did not fail the member within {} s of the fault ({what}, I/O deadline {} s): {}",
            IO_DEADLINE.1 + 5,
            IO_DEADLINE.1,
            describe(r, array)
        );
    }
    w.checkpoint()?;
    let recovered = recover_under_array(md, lab, &mut m0, w.running()?, work).context("scenario 3")?;
    println!(
        "mirror: tyche-init of {} killed (-9) and recovered in {:.1} s under the array: md kept both members, no resync",
        m0.dev,
        recovered.as_secs_f64()
    );
    w.checkpoint()?;
    let refused = second_host(lab, [&m0, &m1], w.running()?, work).context("scenario 4")?;
    println!("mirror: a second host assembling the array: {refused}");
    w.checkpoint()?;
    let (m2, moved) = move_member(md, lab, third, &m0, w.running()?, work).context("scenario 6")?;
    println!("mirror: {moved}");
    let fio = w.fio.take().context("fio is not running")?;
    fio.wait_passes(1, Duration::from_secs(120))?;
    let passes = w.passes + fio.finish()?;
    third.check_alive()?;
    targets.iter_mut().try_for_each(Target::check_alive)?;
    verify_all(md, &mut w.disk, &w.tree)?;
    let checks = w.checks + 1;
    println!(
        "mirror: raid1: {passes} fio passes without an error; after each of {checks} scenarios fsck clean, tree and \
         fio verified; mismatch_cnt 0"
    );
    drop(w);
    run(Command::new("mdadm").args(["--stop", md]))?;
    m0.detach()?;
    m1.detach()?;
    m2.detach()?;
    Ok(format!(
        "raid1: {} MiB, initial sync {:.1} s, {passes} fio crc32c passes without an error; after each of {checks} \
         scenarios e2fsck -fn clean and the tree and fio's file verified; kill -9 + restart: {}; \
         kill -9, down {} s ({} {}): {}; {}; tyche-init killed (-9) under the array and recovered in {:.1} s: md kept \
         both members, no resync; second host: {refused}; {moved}; fsck clean, all verified, mismatch_cnt 0",
        array >> 20,
        sync.as_secs_f64(),
        describe(&quick, array),
        DOWN.as_secs(),
        IO_DEADLINE.0,
        IO_DEADLINE.1,
        describe(&long, array),
        outages
            .iter()
            .map(|(secs, r)| format!("link down {secs} s: {}", describe(r, array)))
            .collect::<Vec<_>>()
            .join("; "),
        recovered.as_secs_f64()
    ))
}

fn raid10(lab: &Lab, targets: &mut [Target; 2], work: &Path) -> Result<String> {
    let md = "/dev/md1";
    // Near-2 layout: devices 0 and 1 mirror each other, as do 2 and 3: each pair spans the targets.
    let members = [(0, "r10a"), (1, "r10a"), (2, "r10b"), (3, "r10b")].map(|(k, e)| Member::attach(lab, k, e, work));
    let members: Vec<Member> = members.into_iter().collect::<Result<_>>()?;
    let devs: Vec<String> = members.iter().map(|m| m.dev.clone()).collect();
    let sync = create(md, "10", &devs.iter().map(String::as_str).collect::<Vec<_>>())?;
    let mut disk = BlockFs::new(md, work);
    let array = disk.size()?;
    disk.mkfs()?;
    let mnt = disk.mount()?;
    let tree = Tree::new(0x0d1e_a510, 24, 8 << 20);
    fs::create_dir_all(mnt.join("tree"))?;
    tree.write(&mnt.join("tree"), &mut |_| {})?;
    fio(&mnt.join("fio.dat"), false)?;
    targets.iter_mut().try_for_each(Target::check_alive)?;
    verify_all(md, &mut disk, &tree)?;
    drop(disk);
    run(Command::new("mdadm").args(["--stop", md]))?;
    for m in members {
        m.detach()?;
    }
    println!(
        "mirror: raid10 over {}: {} MiB, initial sync {:.1} s, fsck clean, tree and fio verified, mismatch_cnt 0",
        devs.join(" "),
        array >> 20,
        sync.as_secs_f64()
    );
    Ok(format!(
        "raid10: 4 members on 2 targets, {} MiB, initial sync {:.1} s, fio crc32c and tree verified, fsck clean, mismatch_cnt 0",
        array >> 20,
        sync.as_secs_f64()
    ))
}

/// Runs the test; returns the summary for the final line.
pub fn guest() -> Result<String> {
    let work = PathBuf::from("/tmp/mirror-test");
    fs::create_dir_all(&work)?;
    // As in the ublk test: `ip netns exec` gives tyche-init a mount namespace of its own.
    run(Command::new("mount").args(["--make-rshared", "/"]))?;
    // md throttles a resync to speed_limit_min (1 MB/s) while the array has other I/O (fio).
    fs::write("/proc/sys/dev/raid/speed_limit_min", "200000").context("md's speed_limit_min (md_mod loaded?)")?;
    // mdadm prints its version on stderr.
    let out = Command::new("mdadm").arg("--version").output().context("mdadm (in the initramfs?)")?;
    ensure!(out.status.success(), "mdadm --version failed: {}", String::from_utf8_lossy(&out.stderr));
    let mdadm = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let lab = Lab::create("vmt", "vmi", 5, 1500)?;
    // Targets 0 and 1 on pairs k and k + 2: one AF_XDP socket per queue, so each attachment of a
    // target at once needs a link of its own (RAID10 attaches two exports of each target).
    let mut targets = [Target::new(&lab, 0, &[0, 2], &work), Target::new(&lab, 1, &[1, 3], &work)];
    for t in &mut targets {
        t.start(&lab)?;
    }
    println!("mirror: {mdadm}; tyched on {} and {}", targets[0].ifaces.join(","), targets[1].ifaces.join(","));
    // Target 2, on pair 4, is where the raid1 scenario moves target 0's member.
    let mut third = Target::new(&lab, 2, &[4], &work);
    let r1 = raid1(&lab, &mut targets, &mut third, &work)?;
    let r10 = raid10(&lab, &mut targets, &work)?;
    // The exports' files live in the guest's memory (tmpfs); the tests after this one need it.
    for t in targets.iter_mut().chain([&mut third]) {
        t.daemon = None;
    }
    for e in fs::read_dir(&work)?.flatten() {
        if e.path().extension().is_some_and(|x| x == "img") {
            fs::remove_file(e.path())?;
        }
    }
    Ok(format!("{r1}; {r10}"))
}
