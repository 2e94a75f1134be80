//! `vm-test`'s mirror test (issue #30): Tyche volumes as members of Linux md arrays, in the VM.
//!
//! Two `tyched` targets in the guest's target namespace, each on veth links of its own (target
//! 0 on `tyt0` and `tyt2`, target 1 on `tyt1` and `tyt3`: one AF_XDP socket per queue, so each
//! attachment of a target needs a link of its own), each exporting files on the guest's tmpfs (kept across a
//! SIGKILL, so a restarted target serves the same data). `tyche-init attach` makes a ublk device
//! of each export, over that target's link only; md mirrors across the targets.
//!
//! - **raid1**: `mdadm --create /dev/md0 --level=1 --raid-devices=2 --bitmap=internal
//!   --failfast` over one export of each target, the initial sync waited for, ext4, a tree of
//!   files, then fio (`--verify=crc32c`, direct I/O) in passes for the whole scenario, every pass
//!   must exit 0. Round 1: target 0 SIGKILLed and restarted at once. Round 2: target 0 SIGKILLed
//!   and kept down past the members' I/O deadline ([`IO_DEADLINE`]), then restarted. In each
//!   round, if md marked the member faulty, the time from the kill is measured, the member is
//!   removed and re-added (`mdadm --re-add`) once its target serves again, and the resync is
//!   measured against the array (the bitmap's dirty chunks on the surviving member just before
//!   the re-add, and the time to a clean array). Then `mdadm --detail` must show both members
//!   active and none failed, fio stops, unmount, `e2fsck -fn` clean, the tree and fio's file
//!   verified, and md's own `check` must find `mismatch_cnt` 0 (both legs equal, byte for byte).
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
    fn new(lab: &Lab, k: usize, work: &Path) -> Target {
        let img = |name: &str, mib: u64| format!("{name}={}:{mib}M", work.join(format!("t{k}-{name}.img")).display());
        Target {
            k,
            // Pair k and pair k + 2: one AF_XDP socket per queue, so each attachment of a target
            // at once needs a link of its own (RAID10 attaches two exports of each target).
            ifaces: vec![lab.pairs[k].target_if.clone(), lab.pairs[k + 2].target_if.clone()],
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
}

impl Member {
    /// Attaches `export` over the lab's pair `k` (target `k % 2`).
    fn attach(lab: &Lab, k: usize, export: &str, work: &Path) -> Result<Member> {
        let log = work.join(format!("attach-{k}-{export}.log"));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &lab.initiator_ns]).arg(stack::bin(Path::new("/"), "tyche-init")).arg("attach");
        cmd.arg("--iface").arg(&lab.pairs[k].initiator_if).arg("--target").arg(lab.pairs[k].target_mac.to_string());
        // --retry: under TCG a target's first answer came after the attach's own timeout.
        cmd.args(["--export", export, "--queues", "1", "--depth", "32", "--retry"]);
        cmd.arg(IO_DEADLINE.0).arg(IO_DEADLINE.1.to_string()).env("TYCHE_LOG", "info");
        let mut daemon = Daemon::spawn("tyche-init attach", &mut cmd, &log)?;
        let dev = crate::vm_ublk::wait_started(&mut daemon, &log, "ublk device started")?;
        Ok(Member { daemon, log, dev })
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

/// What one fault round of the raid1 scenario saw.
struct Round {
    /// From the kill to md marking the member faulty, if it did.
    failed_after: Option<Duration>,
    /// Bitmap chunks dirty on the surviving member at the re-add, of all, and the chunk's bytes.
    dirty: Option<(u64, u64, u64)>,
    /// From the re-add to a clean array.
    resync: Option<Duration>,
    /// From the kill to the target serving again.
    restarted_after: Duration,
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

/// Kills `target`, restarts it after `down`, and watches `md` through it: a member md failed is
/// removed and re-added once its device serves again, and the resync waited for.
fn fault_round(
    md: &str,
    lab: &Lab,
    target: &mut Target,
    victim: &Member,
    survivor: &Member,
    fio: &FioLoop,
    down: Duration,
) -> Result<Round> {
    let state = format!("dev-{}/state", victim.name());
    let killed = Instant::now();
    target.kill()?;
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
    target.start(lab)?;
    let restarted_after = killed.elapsed();
    // The initiator reconnects; requests that waited are re-issued. Watch a while longer: a
    // member whose requests failed meanwhile is marked faulty now.
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(IO_DEADLINE.1 + 3) {
        watch(&mut failed_after)?;
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut round = Round { failed_after, dirty: None, resync: None, restarted_after };
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

fn describe(round: &Round, array: u64) -> String {
    let mut s = format!("target serving again {:.1} s after the kill, ", round.restarted_after.as_secs_f64());
    match round.failed_after {
        None => s.push_str("md kept the member (no request failed)"),
        Some(t) => {
            s.push_str(&format!("md failed the member {:.1} s after the kill", t.as_secs_f64()));
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

fn raid1(lab: &Lab, targets: &mut [Target; 2], work: &Path) -> Result<String> {
    let md = "/dev/md0";
    let m0 = Member::attach(lab, 0, "r1", work)?;
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
    let fio = FioLoop::start(mnt.join("fio.dat"));
    fio.wait_passes(1, Duration::from_secs(120))?;

    let quick = fault_round(md, lab, &mut targets[0], &m0, &m1, &fio, Duration::ZERO).context("round 1")?;
    println!("mirror: round 1 (kill -9, restart at once): {}", describe(&quick, array));
    fio.wait_passes(1, Duration::from_secs(120))?;
    let long = fault_round(md, lab, &mut targets[0], &m0, &m1, &fio, DOWN).context("round 2")?;
    println!("mirror: round 2 (kill -9, down {} s): {}", DOWN.as_secs(), describe(&long, array));
    ensure!(
        long.failed_after.is_some(),
        "md did not fail the member with its target down {} s (I/O deadline {} s)",
        DOWN.as_secs(),
        IO_DEADLINE.1
    );
    fio.wait_passes(1, Duration::from_secs(120))?;
    let passes = fio.finish()?;
    targets.iter_mut().try_for_each(Target::check_alive)?;
    verify_all(md, &mut disk, &tree)?;
    println!("mirror: raid1: {passes} fio passes without an error, fsck clean, tree and fio verified, mismatch_cnt 0");
    drop(disk);
    run(Command::new("mdadm").args(["--stop", md]))?;
    m0.detach()?;
    m1.detach()?;
    Ok(format!(
        "raid1: {} MiB, initial sync {:.1} s, {passes} fio crc32c passes without an error; kill -9 + restart: {}; \
         kill -9, down {} s ({} {}): {}; fsck clean, all verified, mismatch_cnt 0",
        array >> 20,
        sync.as_secs_f64(),
        describe(&quick, array),
        DOWN.as_secs(),
        IO_DEADLINE.0,
        IO_DEADLINE.1,
        describe(&long, array)
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
    let lab = Lab::create("vmt", "vmi", 4, 1500)?;
    let mut targets = [Target::new(&lab, 0, &work), Target::new(&lab, 1, &work)];
    for t in &mut targets {
        t.start(&lab)?;
    }
    println!("mirror: {mdadm}; tyched on {} and {}", targets[0].ifaces.join(","), targets[1].ifaces.join(","));
    let r1 = raid1(&lab, &mut targets, &work)?;
    let r10 = raid10(&lab, &mut targets, &work)?;
    Ok(format!("{r1}; {r10}"))
}
