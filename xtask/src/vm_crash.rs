//! `vm-test`'s crash test: crash consistency at the target's disk, with dm-log-writes.
//!
//! In the guest, `tyched` exports a device-mapper `log-writes` device: every write, flush and FUA
//! that reaches the target's disk (a loop device over a file on tmpfs) is also logged, in the
//! order it completed, to a second loop device. The initiator attaches the export as
//! `/dev/ublkbN`; ext4 is made on it, the log marked `mkfs`, and a metadata-heavy, fsync-heavy
//! workload ([`Workload`]: files created, appended, overwritten, truncated, renamed across
//! directories and deleted, most operations followed by an fsync of the file or its
//! directories) runs on the mounted filesystem, then its final tree is checked against the
//! workload's own model. After unmount, detach and `dmsetup remove`, [`logwrites::replay`]
//! replays the log onto a scratch image and, at the `mkfs` mark and at every flush and FUA
//! after it, the image (as a power loss at that moment would leave the disk) gets its journal
//! recovered (`e2fsck -E journal_only`, what a mount does) and `e2fsck -fn` must find it clean.
//! At the log's end the scratch image must equal the target's disk byte for byte (the replay
//! itself is proven). Two variants: `calm`, and `target-kill`, where `tyched` is killed with
//! SIGKILL halfway through the workload and started again at once (its network threads, and
//! everything else of it, restarted), so requests in flight are re-sent to a new process.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::disk::{run, BlockFs};
use crate::lab::Lab;
use crate::logwrites;
use crate::stack::{self, Daemon, Link, Running};

/// The target's disk, MiB.
const DISK_MIB: u64 = 32;
/// The log device, MiB (a sparse file on tmpfs: only what is logged takes memory).
const LOG_MIB: u64 = 512;
/// Workload operations per variant.
const OPS: u64 = 100;
/// The mark after mkfs: the replay checks from there.
const START: &str = "mkfs";
/// Images checked at once (each a copy of the scratch image at one point; the replay goes on).
const CHECKERS: usize = 2;

/// A device-mapper `log-writes` device over two loop devices; removed (with its loops) when
/// dropped, which also makes the kernel write the log's final super block.
struct LoggedDisk {
    name: String,
    /// `/dev/dm-N`.
    dev: String,
    loops: Vec<String>,
}

impl LoggedDisk {
    fn create(name: &str, data: &Path, log: &Path) -> Result<LoggedDisk> {
        let mut disk = LoggedDisk { name: name.to_string(), dev: String::new(), loops: Vec::new() };
        for f in [data, log] {
            let dev = run(Command::new("losetup").args(["--find", "--show"]).arg(f))?;
            disk.loops.push(dev);
        }
        let sectors = DISK_MIB << 11;
        let table = format!("0 {sectors} log-writes {} {}", disk.loops[0], disk.loops[1]);
        // No udev in the guest: dmsetup must not wait for it.
        run(Command::new("dmsetup").args(["create", name, "--noudevsync", "--table", &table]))
            .context("dmsetup create (dm-log-writes loaded?)")?;
        let blk = run(Command::new("dmsetup").args(["info", "-c", "--noheadings", "-o", "blkdevname", name]))?;
        disk.dev = format!("/dev/{}", blk.trim());
        stack::wait_for(&disk.dev, Duration::from_secs(10), || Ok(Path::new(&disk.dev).exists()))?;
        Ok(disk)
    }

    fn mark(&self, mark: &str) -> Result<()> {
        run(Command::new("dmsetup").args(["message", &self.name, "0", "mark", mark]))?;
        Ok(())
    }

    fn remove(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        let mut first = None;
        if !self.dev.is_empty() {
            if let Err(e) = run(Command::new("dmsetup").args(["remove", "--noudevsync", &self.name])) {
                first.get_or_insert(e);
            }
            self.dev.clear();
        }
        for l in self.loops.drain(..).rev() {
            if let Err(e) = run(Command::new("losetup").args(["--detach", &l])) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for LoggedDisk {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("warning: removing {}: {e:#}", self.name);
        }
    }
}

/// A small deterministic generator (xorshift64*), so a failing run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }

    /// `min` to `min + spread - 1` random bytes.
    fn some_bytes(&mut self, min: usize, spread: u64) -> Vec<u8> {
        let n = min + self.below(spread) as usize;
        self.bytes(n)
    }
}

/// Directories the workload's files live in (renames move files between them).
const DIRS: u64 = 4;

/// The workload on the mounted filesystem, with a model of what each file must hold.
struct Workload {
    root: PathBuf,
    rng: Rng,
    files: BTreeMap<String, Vec<u8>>,
    made: u64,
    fsyncs: u64,
}

impl Workload {
    fn new(root: &Path, seed: u64) -> Result<Workload> {
        for d in 0..DIRS {
            fs::create_dir_all(root.join(format!("d{d}")))?;
        }
        Ok(Workload { root: root.to_path_buf(), rng: Rng(seed | 1), files: BTreeMap::new(), made: 0, fsyncs: 0 })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// fsync of the directory holding `name`.
    fn sync_dir(&mut self, name: &str) -> Result<()> {
        let dir = self.path(name).parent().context("a file with no directory")?.to_path_buf();
        fs::File::open(&dir)?.sync_all().with_context(|| format!("fsync of {}", dir.display()))?;
        self.fsyncs += 1;
        Ok(())
    }

    fn pick(&mut self) -> Option<String> {
        if self.files.is_empty() {
            return None;
        }
        let i = self.rng.below(self.files.len() as u64) as usize;
        self.files.keys().nth(i).cloned()
    }

    /// One operation; most end with an fsync (of the file, its directory, or both).
    fn step(&mut self) -> Result<()> {
        let sync = self.rng.below(4) != 0;
        // Creations outnumber deletions two to one: the tree grows.
        let op = if self.files.len() < 8 { 0 } else { self.rng.below(7) };
        match (op, self.pick()) {
            (1, Some(name)) => {
                // Append.
                let more = self.rng.some_bytes(512, 8192);
                let mut f = fs::OpenOptions::new().append(true).open(self.path(&name))?;
                f.write_all(&more)?;
                if sync {
                    f.sync_data()?;
                    self.fsyncs += 1;
                }
                self.files.get_mut(&name).context("model")?.extend_from_slice(&more);
            }
            (2, Some(name)) => {
                // Rename into another directory, under a new name.
                self.made += 1;
                let to = format!("d{}/r{}", self.rng.below(DIRS), self.made);
                fs::rename(self.path(&name), self.path(&to))?;
                if sync {
                    self.sync_dir(&name)?;
                    self.sync_dir(&to)?;
                }
                let data = self.files.remove(&name).context("model")?;
                self.files.insert(to, data);
            }
            (3, Some(name)) => {
                // Delete.
                fs::remove_file(self.path(&name))?;
                if sync {
                    self.sync_dir(&name)?;
                }
                self.files.remove(&name);
            }
            (4, Some(name)) => {
                // Overwrite inside the file.
                let len = self.files[&name].len() as u64;
                let at = self.rng.below(len.max(1));
                let data = self.rng.some_bytes(1, 4096);
                let f = fs::OpenOptions::new().write(true).open(self.path(&name))?;
                f.write_all_at(&data, at)?;
                if sync {
                    f.sync_all()?;
                    self.fsyncs += 1;
                }
                let model = self.files.get_mut(&name).context("model")?;
                let end = at as usize + data.len();
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[at as usize..end].copy_from_slice(&data);
            }
            (5, Some(name)) => {
                // Truncate to a shorter length.
                let len = self.files[&name].len() as u64;
                let to = self.rng.below(len.max(1));
                let f = fs::OpenOptions::new().write(true).open(self.path(&name))?;
                f.set_len(to)?;
                if sync {
                    f.sync_all()?;
                    self.fsyncs += 1;
                }
                self.files.get_mut(&name).context("model")?.truncate(to as usize);
            }
            _ => {
                // Create.
                self.made += 1;
                let name = format!("d{}/f{}", self.rng.below(DIRS), self.made);
                let data = self.rng.some_bytes(1, 24 << 10);
                let mut f = fs::File::create(self.path(&name))?;
                f.write_all(&data)?;
                if sync {
                    f.sync_all()?;
                    self.fsyncs += 1;
                    self.sync_dir(&name)?;
                }
                self.files.insert(name, data);
            }
        }
        Ok(())
    }

    /// Every file of the model holds its bytes, and no other file exists.
    fn verify(&self, root: &Path) -> Result<()> {
        let mut found = Vec::new();
        for d in 0..DIRS {
            for e in fs::read_dir(root.join(format!("d{d}")))? {
                found.push(format!("d{d}/{}", e?.file_name().to_string_lossy()));
            }
        }
        found.sort();
        let want: Vec<&String> = self.files.keys().collect();
        ensure!(found.iter().collect::<Vec<_>>() == want, "files found {found:?}, the workload left {want:?}");
        for (name, data) in &self.files {
            let mut got = Vec::new();
            fs::File::open(root.join(name))?.read_to_end(&mut got)?;
            ensure!(&got == data, "{name}: {} bytes read back differ from the {} written", got.len(), data.len());
        }
        Ok(())
    }
}

/// `tyche-init attach` of the export over the lab's one link, and its device.
fn attach(lab: &Lab, log: &Path) -> Result<(Daemon, String)> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.initiator_ns]).arg(stack::bin(Path::new("/"), "tyche-init")).arg("attach");
    cmd.arg("--iface").arg(&lab.pairs[0].initiator_if).arg("--target").arg(lab.pairs[0].target_mac.to_string());
    cmd.args(["--export", "crash", "--queues", "1", "--depth", "32", "--retry"]).env("TYCHE_LOG", "info");
    let mut d = Daemon::spawn("tyche-init attach", &mut cmd, log)?;
    let dev = crate::vm_ublk::wait_started(&mut d, log, "ublk device started")?;
    Ok((d, dev))
}

/// Journal recovery on `copy` (a copy of the replayed image at one point; as a mount would do),
/// then `e2fsck -fn` of it: clean.
fn check_image(copy: &Path) -> Result<()> {
    let out = Command::new("e2fsck").args(["-E", "journal_only", "-p"]).arg(copy).output()?;
    // 0: nothing to do, 1: the journal was recovered.
    ensure!(
        matches!(out.status.code(), Some(0 | 1)),
        "e2fsck -E journal_only ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("e2fsck").args(["-f", "-n"]).arg(copy).output()?;
    if !out.status.success() {
        bail!(
            "e2fsck -fn found problems ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// [`logwrites::replay`] of `log` onto `scratch`, each point's image copied and checked by
/// [`CHECKERS`] threads while the replay goes on; fails with the first point (in log order) whose
/// image was not clean.
fn replay_and_check(log: &Path, scratch: &Path, dir: &Path) -> Result<logwrites::Replayed> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<(u64, PathBuf)>(CHECKERS);
    let rx = std::sync::Mutex::new(rx);
    let failures = std::sync::Mutex::new(Vec::<(u64, anyhow::Error)>::new());
    let replayed = std::thread::scope(|s| {
        for _ in 0..CHECKERS {
            s.spawn(|| loop {
                let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok((entry, copy)) = job else { return };
                if let Err(e) = check_image(&copy) {
                    failures.lock().unwrap_or_else(|p| p.into_inner()).push((entry, e));
                }
                let _ = fs::remove_file(&copy);
            });
        }
        let r = logwrites::replay(log, scratch, DISK_MIB << 20, START, &mut |e| {
            let copy = dir.join(format!("check-{}.img", e.index));
            fs::copy(scratch, &copy)?;
            tx.send((e.index, copy)).context("the checkers stopped")?;
            Ok(())
        });
        drop(tx);
        r
    })?;
    let mut failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    failures.sort_by_key(|(entry, _)| *entry);
    if let Some((entry, e)) = failures.into_iter().next() {
        return Err(e.context(format!("at log entry {entry} of {}", replayed.entries)));
    }
    Ok(replayed)
}

/// Whether two files hold the same bytes; the first differing offset if not.
fn first_difference(a: &Path, b: &Path) -> Result<Option<u64>> {
    let (fa, fb) = (fs::File::open(a)?, fs::File::open(b)?);
    let (la, lb) = (fa.metadata()?.len(), fb.metadata()?.len());
    ensure!(la == lb, "{} is {la} bytes, {} {lb}", a.display(), b.display());
    let mut at = 0;
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    while at < la {
        let n = (la - at).min(1 << 20) as usize;
        fa.read_exact_at(&mut ba[..n], at)?;
        fb.read_exact_at(&mut bb[..n], at)?;
        if let Some(i) = ba[..n].iter().zip(&bb[..n]).position(|(x, y)| x != y) {
            return Ok(Some(at + i as u64));
        }
        at += n as u64;
    }
    Ok(None)
}

/// One run: the logged disk, the stack on it, the workload (with the target killed halfway
/// when `kill`), teardown, and the replay with its checks. Returns the verdict's part.
fn variant(lab: &Lab, work: &Path, name: &str, seed: u64, kill: bool) -> Result<String> {
    let dir = work.join(name);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let (data, log) = (dir.join("disk.img"), dir.join("log.img"));
    fs::File::create(&data)?.set_len(DISK_MIB << 20)?;
    fs::File::create(&log)?.set_len(LOG_MIB << 20)?;
    let disk = LoggedDisk::create(&format!("tyche-{name}"), &data, &log)?;
    let stats = dir.join("tyched.sock");
    let export = format!("crash={}", disk.dev);
    let start_target = |n: usize| -> Result<Running> {
        stack::start_tyched(Path::new("/"), lab, Link::Xdp, &export, &stats, dir.join(format!("tyched-{n}.log")))
    };
    let mut target = start_target(1)?;
    let (mut init, dev) = attach(lab, &dir.join("attach.log"))?;
    let mut fsys = BlockFs::new(&dev, &dir);
    fsys.mkfs()?;
    // mkfs synced the device (its last FLUSH reached the log); from here the log holds ext4.
    disk.mark(START)?;
    let mnt = fsys.mount()?;
    let started = Instant::now();
    let done = Arc::new(AtomicU64::new(0));
    let worker = {
        let (mnt, done) = (mnt.clone(), Arc::clone(&done));
        std::thread::spawn(move || -> Result<Workload> {
            let mut w = Workload::new(&mnt, seed)?;
            for i in 0..OPS {
                w.step().with_context(|| format!("workload operation {i}"))?;
                done.store(i + 1, Ordering::Relaxed);
            }
            Ok(w)
        })
    };
    let mut restart = None;
    if kill {
        stack::wait_for("half the workload", Duration::from_secs(300), || {
            target.check_alive()?;
            Ok(done.load(Ordering::Relaxed) >= OPS / 2 || worker.is_finished())
        })?;
        ensure!(!worker.is_finished(), "the workload ended before the target could be killed");
        let at = done.load(Ordering::Relaxed);
        let killed = Instant::now();
        target.daemon.kill()?;
        target = start_target(2)?;
        restart = Some((at, killed.elapsed()));
    }
    let w = match worker.join() {
        Ok(r) => r.context("the workload failed")?,
        Err(_) => bail!("the workload thread panicked"),
    };
    let took = started.elapsed();
    target.check_alive()?;
    fsys.umount()?;
    fsys.drop_caches()?;
    let mnt = fsys.mount()?;
    w.verify(&mnt).context("the workload's files, read back through the initiator")?;
    fsys.umount()?;
    drop(fsys);
    run(Command::new(stack::bin(Path::new("/"), "tyche-init")).args(["detach", &dev]))?;
    let status = init.wait(Duration::from_secs(30)).context("tyche-init attach did not exit after detach")?;
    ensure!(status.success(), "tyche-init attach exited with {status} after detach");
    target.daemon.stop();
    disk.remove()?;

    let scratch = dir.join("replay.img");
    let t = Instant::now();
    let replayed = replay_and_check(&log, &scratch, &dir)
        .with_context(|| format!("variant {name}: the filesystem as a power loss would leave it"))?;
    let replay_took = t.elapsed();
    if let Some(at) = first_difference(&scratch, &data)? {
        bail!("variant {name}: the replayed log differs from the target's disk at byte {at}");
    }
    // The guest's memory holds these files (tmpfs): gone once proven.
    for f in [&data, &log, &scratch] {
        fs::remove_file(f)?;
    }
    let mut s = format!(
        "{name}: {OPS} operations ({} fsyncs, {} files left) in {:.1} s",
        w.fsyncs,
        w.files.len(),
        took.as_secs_f64()
    );
    if let Some((at, t)) = restart {
        s.push_str(&format!(", tyched killed (-9) after operation {at} and serving again in {:.1} s", t.as_secs_f64()));
    }
    s.push_str(&format!(
        "; log: {} entries, {} MiB written; {} flush/FUA points replayed, {} distinct images fsck'd clean in {:.1} s; \
         final image equals the disk",
        replayed.entries,
        replayed.bytes >> 20,
        replayed.marks,
        replayed.checked,
        replay_took.as_secs_f64()
    ));
    println!("crash: {s}");
    Ok(s)
}

/// Runs the test; returns the summary for the final line.
pub fn guest() -> Result<String> {
    let work = PathBuf::from("/tmp/crash-test");
    fs::create_dir_all(&work)?;
    // As in the ublk test: `ip netns exec` gives tyche-init a mount namespace of its own.
    run(Command::new("mount").args(["--make-rshared", "/"]))?;
    let lab = Lab::create("vct", "vci", 1, 1500)?;
    let calm = variant(&lab, &work, "calm", 0x00c0_ffee, false)?;
    let killed = variant(&lab, &work, "target-kill", 0x0dea_d00d, true)?;
    Ok(format!("{calm}; {killed}"))
}
