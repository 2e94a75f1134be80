//! `cargo xtask faults` (root): the faults a user meets, each on a fresh 2-NIC AF_XDP veth lab
//! with a file export and fio writing with verify through `tyche-init serve-nbd`:
//!
//! 1. `sigterm-restart`: `tyched` stopped with SIGTERM mid-run and started again a second later;
//!    then a FLUSH that succeeds (the target said SHUTDOWN: nothing is owed).
//! 2. `sigkill-restart`: a flushed copy and more writes not flushed, `tyched` killed with SIGKILL
//!    and started again, then a byte-exact read-back of both and a FLUSH that succeeds (the
//!    file export's durability epoch is unchanged: the unflushed writes were in the page cache).
//! 3. `links-down`: both links down for 20 s mid-run, then up; then a FLUSH that succeeds.
//! 4. `fencing`: a second initiator (another host) is refused, naming the holder; the first
//!    initiator killed and started again fences its old session and reads its data back.
//! 5. `hung-storage`: reads that hang in the backend are answered with an error within the
//!    storage deadline, and the channels stay up.
//! 6. `ublk-recovery` (in the VM of `cargo xtask vm-test`, since this kernel has no ublk): ext4
//!    mounted on `/dev/ublkb0` with a writer running, `kill -9` of `tyche-init`,
//!    `tyche-init attach --recover`, the writer finishes, fsck clean, checksums match.
//!
//! fio must finish with no error and its verify clean wherever the target is back within the
//! initiator's no-path timeout. fio's closing `end_fsync` through its NBD engine does not report
//! a failed flush, so the FLUSHes that must succeed are sent with nbdsh. The last line is `faults: N passed, M failed`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use crate::disk::run;
use crate::lab::{ip, Lab};
use crate::stack::{self, prepare, start_initiator, start_tyched_with, wait_for, Link, Running};

#[derive(Args, Debug)]
pub struct FaultsArgs {
    /// Run only the scenarios whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
    /// Leave out `ublk-recovery`: the caller runs the VM's ublk test itself (the suite, in its
    /// one boot of the VM's other tests).
    #[arg(skip)]
    ublk_elsewhere: bool,
}

impl FaultsArgs {
    /// What the test suite runs: every scenario but `ublk-recovery`, whose guest test the suite
    /// runs in its vm-test boot; packages already installed.
    pub fn suite() -> FaultsArgs {
        FaultsArgs { only: None, no_install: true, ublk_elsewhere: true }
    }
}

/// Size of the file export.
const EXPORT_BYTES: u64 = 256 << 20;
/// The initiator's no-path timeout (seconds): every outage here is shorter.
const NO_PATH_S: &str = "30";

/// One scenario's world: a lab, a work directory, the export's backing file.
struct World<'a> {
    root: &'a Path,
    lab: Lab,
    work: PathBuf,
    image: PathBuf,
    stats: PathBuf,
}

type Scenario = fn(&World<'_>) -> Result<String>;

pub fn faults(root: &Path, args: &FaultsArgs) -> Result<()> {
    prepare(root, "faults", args.no_install)?;
    let scenarios: [(&str, Scenario); 6] = [
        ("sigterm-restart", sigterm_restart),
        ("sigkill-restart", sigkill_restart),
        ("links-down", links_down),
        ("fencing", fencing),
        ("hung-storage", hung_storage),
        ("ublk-recovery", ublk_recovery),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (name, scenario) in scenarios {
        if args.only.as_deref().is_some_and(|o| !name.contains(o)) {
            continue;
        }
        if args.ublk_elsewhere && name == "ublk-recovery" {
            eprintln!("faults: ublk-recovery runs with the suite's other VM tests, in one boot");
            continue;
        }
        let pid = std::process::id();
        let work = PathBuf::from(format!("/run/tyche-faults-{pid}-{name}"));
        let _ = fs::remove_dir_all(&work);
        fs::create_dir_all(&work)?;
        let lab = Lab::create(&format!("tyf-t{pid}"), &format!("tyf-i{pid}"), 2, 3000)?;
        let image = work.join("export.img");
        fs::File::create(&image)?.set_len(EXPORT_BYTES)?;
        let world = World { root, lab, stats: work.join("tyched.sock"), work: work.clone(), image };
        eprintln!("faults: {name} ...");
        let t0 = Instant::now();
        let result = scenario(&world);
        drop(world);
        match result {
            Ok(detail) => {
                passed += 1;
                eprintln!("faults: {name} ok in {:.1} s ({detail})", t0.elapsed().as_secs_f64());
                let _ = fs::remove_dir_all(&work);
            }
            Err(e) => {
                failed += 1;
                eprintln!("faults: {name} FAILED: {e:#}\nfaults: logs kept in {}", work.display());
            }
        }
    }
    println!("faults: {passed} passed, {failed} failed");
    ensure!(failed == 0, "{failed} fault scenario(s) failed");
    Ok(())
}

impl World<'_> {
    fn socket(&self) -> PathBuf {
        self.work.join("nbd.sock")
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///data?socket={}", self.socket().display())
    }

    /// An NBD FLUSH through the initiator (nbdsh's `h.flush()`), which must succeed: fio's
    /// closing `end_fsync` through its NBD engine does not report a failed flush, so a scenario
    /// in which no acknowledged write may be lost says so with this. nbdsh runs the system's
    /// python3, which has the nbd module.
    fn flush(&self, after: &str) -> Result<()> {
        let said = run(Command::new("ip")
            .args(["netns", "exec", &self.lab.initiator_ns, "env", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"])
            .args(["nbdsh", "-u", &self.uri(), "-c", "h.flush()"])
            .current_dir(&self.work))
        .with_context(|| format!("a FLUSH after {after} (EIO: the initiator took acknowledged writes for lost)"))?;
        ensure!(said.is_empty(), "nbdsh said: {said}");
        Ok(())
    }

    /// `tyched` serving the file export (and `extra` arguments), its log numbered `n`.
    fn tyched(&self, n: u32, extra: &[String]) -> Result<Running> {
        let mut serve = vec!["--export".to_string(), format!("data={}", self.image.display())];
        serve.extend_from_slice(extra);
        start_tyched_with(
            self.root,
            &self.lab,
            Link::Xdp,
            &serve,
            &self.stats,
            self.work.join(format!("tyched-{n}.log")),
        )
    }

    /// `tyche-init serve-nbd` for the export, as host `host` (32 hex digits), log numbered `n`.
    fn initiator(&self, n: u32, host: &str) -> Result<Running> {
        let extra = ["--no-path-timeout", NO_PATH_S, "--host-id", host].map(String::from);
        start_initiator(
            self.root,
            &self.lab,
            Link::Xdp,
            "data",
            &self.socket(),
            self.work.join(format!("init-{n}.log")),
            &extra,
        )
    }

    /// fio through the NBD socket (in the initiator's namespace), in the background.
    fn fio(&self, name: &str, args: &[&str]) -> Result<Fio> {
        let log = self.work.join(format!("fio-{name}.log"));
        let out = fs::File::create(&log)?;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.lab.initiator_ns, "fio", "--name", name, "--ioengine=nbd"])
            .arg(format!("--uri={}", self.uri()))
            .args(args)
            // fio leaves its verify state files in its working directory.
            .current_dir(&self.work)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting fio")?;
        Ok(Fio { child, log, started: Instant::now() })
    }

    /// The target's counters (JSON).
    fn target_stats(&self) -> Result<serde_json::Value> {
        let out =
            run(Command::new(stack::bin(self.root, "tyched")).args(["stats", "--json", "--socket"]).arg(&self.stats))?;
        serde_json::from_str(&out).context("tyched stats --json")
    }

    /// Takes both links down (`up` false) or brings them up, on the target's side.
    fn links(&self, up: bool) -> Result<()> {
        for p in &self.lab.pairs {
            ip(&["-n", &self.lab.target_ns, "link", "set", &p.target_if, if up { "up" } else { "down" }])?;
        }
        Ok(())
    }
}

/// A running fio job.
struct Fio {
    child: Child,
    log: PathBuf,
    started: Instant,
}

impl Fio {
    /// Waits for fio (at most `limit`) and fails unless it exited 0 with no error in its output.
    fn success(mut self, limit: Duration) -> Result<Duration> {
        let deadline = self.started + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait()? {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("fio still ran after {limit:?}:\n{}", tail(&self.log));
            }
            stack::interrupted()?;
            std::thread::sleep(Duration::from_millis(100));
        };
        // fio exits non-zero on any I/O error and on any block that fails its verify.
        ensure!(status.success(), "fio failed ({status}):\n{}", tail(&self.log));
        Ok(self.started.elapsed())
    }

    /// Waits for fio to fail (at most `limit`); returns how long it took.
    fn failure(mut self, limit: Duration) -> Result<Duration> {
        let deadline = self.started + limit;
        loop {
            if let Some(s) = self.child.try_wait()? {
                ensure!(!s.success(), "fio succeeded where an error was expected:\n{}", tail(&self.log));
                return Ok(self.started.elapsed());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("fio got no answer within {limit:?}:\n{}", tail(&self.log));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(25).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// fio arguments: a sequential write of `mib` MiB in 64 KiB blocks with crc32c verify, rate
/// limited to `rate` so that a fault lands in the middle of it.
fn write_verify(mib: u64, rate: &str) -> Vec<String> {
    [
        "--rw=write".to_string(),
        "--bs=64k".into(),
        "--iodepth=8".into(),
        format!("--size={mib}m"),
        "--verify=crc32c".into(),
        "--do_verify=1".into(),
        format!("--rate={rate}"),
        "--end_fsync=1".into(),
    ]
    .into()
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

const HOST_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const HOST_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

/// 1. SIGTERM to the target mid-run, a new target a second later: no error, verify clean.
fn sigterm_restart(w: &World<'_>) -> Result<String> {
    let mut t = w.tyched(1, &[])?;
    let _i = w.initiator(1, HOST_A)?;
    let job = write_verify(96, "16m");
    let fio = w.fio("sigterm", &args(&job))?;
    std::thread::sleep(Duration::from_secs(2));
    t.daemon.stop();
    std::thread::sleep(Duration::from_secs(1));
    let _t2 = w.tyched(2, &[])?;
    let took = fio.success(Duration::from_secs(60))?;
    // The target said SHUTDOWN and flushed before it stopped: nothing is owed.
    w.flush("the SIGTERM restart")?;
    Ok(format!(
        "fio wrote and verified 96 MiB in {:.1} s across the restart, then a FLUSH succeeded",
        took.as_secs_f64()
    ))
}

/// 2. A flushed copy, SIGKILL, a new target: every byte reads back.
fn sigkill_restart(w: &World<'_>) -> Result<String> {
    let mut t = w.tyched(1, &[])?;
    let _i = w.initiator(1, HOST_A)?;
    let job =
        ["--rw=write", "--bs=64k", "--iodepth=8", "--size=64m", "--verify=crc32c", "--do_verify=0", "--end_fsync=1"];
    w.fio("copy", &job)?.success(Duration::from_secs(60)).context("the copy")?;
    // 16 MiB more, acknowledged and never flushed: in the target host's page cache only.
    let tail = ["--rw=write", "--bs=64k", "--iodepth=8", "--offset=64m", "--size=16m", "--verify=crc32c"];
    let unflushed: Vec<&str> = tail.iter().copied().chain(["--do_verify=0"]).collect();
    w.fio("unflushed", &unflushed)?.success(Duration::from_secs(60)).context("the unflushed writes")?;
    let pid = t.daemon.pid();
    run(Command::new("kill").args(["-KILL", &pid.to_string()]))?;
    t.daemon.wait(Duration::from_secs(10))?;
    let t0 = Instant::now();
    let _t2 = w.tyched(2, &[])?;
    let check = ["--rw=write", "--bs=64k", "--iodepth=8", "--size=64m", "--verify=crc32c", "--verify_only=1"];
    w.fio("readback", &check)?.success(Duration::from_secs(60)).context("the read-back")?;
    let check_tail: Vec<&str> = tail.iter().copied().chain(["--verify_only=1"]).collect();
    w.fio("readback-unflushed", &check_tail)?
        .success(Duration::from_secs(60))
        .context("the read-back of the writes not flushed before the SIGKILL")?;
    // The same host, the same file: the same durability epoch, so the writes acknowledged
    // before the kill are not reported lost, and a FLUSH succeeds.
    w.flush("the SIGKILL")?;
    Ok(format!(
        "64 MiB flushed and 16 MiB not flushed before SIGKILL read back intact, then a FLUSH succeeded, \
         {:.1} s after the restart",
        t0.elapsed().as_secs_f64()
    ))
}

/// 3. Both links down for 20 s mid-run: the volume waits and goes on.
fn links_down(w: &World<'_>) -> Result<String> {
    let _t = w.tyched(1, &[])?;
    let _i = w.initiator(1, HOST_A)?;
    let job = write_verify(64, "8m");
    let fio = w.fio("outage", &args(&job))?;
    std::thread::sleep(Duration::from_secs(2));
    w.links(false)?;
    std::thread::sleep(Duration::from_secs(20));
    w.links(true)?;
    let took = fio.success(Duration::from_secs(90))?;
    // The session outlived the outage: no write was lost, a FLUSH succeeds.
    w.flush("the outage")?;
    let s = w.target_stats()?;
    Ok(format!(
        "fio finished in {:.1} s with a 20 s outage, then a FLUSH succeeded; target sessions {}, reclaimed {}",
        took.as_secs_f64(),
        s["sessions"],
        s["sessions_reclaimed"]
    ))
}

/// `tyche-init serve-nbd` as host `host` on link `k` alone (two initiators cannot share an
/// AF_XDP queue), serving NBD on `socket`.
fn initiator_on(w: &World<'_>, k: usize, host: &str, socket: &Path, log: &Path) -> Result<stack::Daemon> {
    let _ = fs::remove_file(socket);
    let p = &w.lab.pairs[k];
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &w.lab.initiator_ns]).arg(stack::bin(w.root, "tyche-init")).arg("serve-nbd");
    cmd.arg("--socket").arg(socket).args(["--export", "data", "--host-id", host, "--no-path-timeout", NO_PATH_S]);
    cmd.arg("--iface").arg(&p.initiator_if).arg("--target").arg(p.target_mac.to_string());
    stack::Daemon::spawn("tyche-init", cmd.env("TYCHE_LOG", "info"), log)
}

/// 4. A second host is refused, naming the holder; the first host again fences its old session.
fn fencing(w: &World<'_>) -> Result<String> {
    let _t = w.tyched(1, &[])?;
    let log_a = w.work.join("init-a.log");
    let mut a = initiator_on(w, 0, HOST_A, &w.socket(), &log_a)?;
    wait_for("host A's NBD socket", Duration::from_secs(60), || {
        a.check_alive(&log_a)?;
        Ok(w.socket().exists())
    })?;
    let job =
        ["--rw=write", "--bs=64k", "--iodepth=8", "--size=32m", "--verify=crc32c", "--do_verify=0", "--end_fsync=1"];
    w.fio("first", &job)?.success(Duration::from_secs(60))?;
    // Another host: refused with the holder named.
    let log_b = w.work.join("init-b.log");
    let mut b = initiator_on(w, 1, HOST_B, &w.work.join("other.sock"), &log_b)?;
    let status = b.wait(Duration::from_secs(30)).context("the second host's tyche-init should give up")?;
    let said = fs::read_to_string(&log_b).unwrap_or_default();
    let holder = w.lab.pairs[0].initiator_mac.to_string();
    ensure!(!status.success() && said.contains(&holder), "the second host was not refused naming {holder}:\n{said}");
    // The first host crashes and comes back: its old session is fenced, its data is there.
    run(Command::new("kill").args(["-KILL", &a.pid().to_string()]))?;
    a.wait(Duration::from_secs(10))?;
    let log_a2 = w.work.join("init-a2.log");
    let mut a2 = initiator_on(w, 0, HOST_A, &w.socket(), &log_a2)?;
    wait_for("host A's NBD socket again", Duration::from_secs(60), || {
        a2.check_alive(&log_a2)?;
        Ok(w.socket().exists())
    })?;
    let check = ["--rw=write", "--bs=64k", "--iodepth=8", "--size=32m", "--verify=crc32c", "--verify_only=1"];
    w.fio("again", &check)?.success(Duration::from_secs(60))?;
    let s = w.target_stats()?;
    ensure!(s["sessions_fenced"].as_u64() == Some(1), "sessions_fenced is {}", s["sessions_fenced"]);
    Ok(format!("host B refused naming {holder}; host A again fenced its old session and read its data back"))
}

/// Scenario 5: reads hang in the backend. Each is answered with an error within the deadline,
/// and the channels stay up (the next request is served, not wedged behind the hung one).
fn hung_storage(w: &World<'_>) -> Result<String> {
    // The export's backing file lives on nbdfuse over nbdkit's memory plugin with a delay filter:
    // reads take 20 s (ten times the deadline), writes none.
    let fuse = w.work.join("slow");
    fs::create_dir_all(&fuse)?;
    let sock = w.work.join("nbdkit.sock");
    let log = w.work.join("nbdkit.log");
    let mut nbdkit = stack::Daemon::spawn(
        "nbdkit",
        Command::new("nbdkit").args(["-f", "-U"]).arg(&sock).args([
            "--filter=delay",
            "memory",
            &format!("size={EXPORT_BYTES}"),
            "rdelay=20",
        ]),
        &log,
    )?;
    wait_for("nbdkit", Duration::from_secs(10), || {
        nbdkit.check_alive(&log)?;
        Ok(sock.exists())
    })?;
    let mut nbdfuse = stack::Daemon::spawn(
        "nbdfuse",
        Command::new("nbdfuse").arg(&fuse).arg("--unix").arg(&sock),
        &w.work.join("nbdfuse.log"),
    )?;
    let image = fuse.join("nbd");
    wait_for("nbdfuse", Duration::from_secs(20), || {
        nbdfuse.check_alive(&w.work.join("nbdfuse.log"))?;
        Ok(fs::metadata(&image).map(|m| m.len()).unwrap_or(0) > 0)
    })?;
    let config = w.work.join("tyched.toml");
    fs::write(&config, "storage_deadline_ms = 2000\nio_uring = false\n")?;
    let export = format!("data={}", image.display());
    let result = (move || {
        let serve = ["--export".to_string(), export, "--config".to_string(), config.display().to_string()];
        let _t = start_tyched_with(w.root, &w.lab, Link::Xdp, &serve, &w.stats, w.work.join("tyched-1.log"))?;
        let _i = w.initiator(1, HOST_A)?;
        let mut took = Vec::new();
        for (n, offset) in ["--offset=128m", "--offset=64m"].into_iter().enumerate() {
            let read = ["--rw=read", "--bs=64k", "--iodepth=1", "--size=64k", offset];
            let t = w.fio(&format!("hung-read-{n}"), &read)?.failure(Duration::from_secs(20))?;
            ensure!(t < Duration::from_secs(15), "hung read {n} took {t:?} to be answered");
            took.push(format!("{:.1} s", t.as_secs_f64()));
        }
        let s = w.target_stats()?;
        ensure!(
            s["storage_timeouts"].as_u64().unwrap_or(0) >= 2,
            "storage timeouts counted: {}",
            s["storage_timeouts"]
        );
        let live = s["channels"].as_array().map_or(0, |c| c.iter().filter(|c| c["dead"] == false).count());
        ensure!(live > 0, "no live channel after the hung reads: {}", s["channels"]);
        Ok(format!("reads hung for 20 s answered with an error after {}; channels alive", took.join(" and ")))
    })();
    let _ = run(Command::new("umount").arg("-l").arg(&fuse));
    nbdfuse.stop();
    nbdkit.stop();
    result
}

/// Scenario 6: `tyche-init` killed under a mounted filesystem and recovered, in the VM (the
/// guest's ublk test has the recovery phase; vm-test prints what it saw).
fn ublk_recovery(w: &World<'_>) -> Result<String> {
    crate::vm::vm_test(w.root, &crate::vm::VmTestArgs::only(&[crate::vm::GuestTest::Ublk]))?;
    Ok("ext4 on /dev/ublkb0 in the VM: kill -9 of tyche-init mid-write, attach --recover, writer finished, fsck clean, checksums match".into())
}
