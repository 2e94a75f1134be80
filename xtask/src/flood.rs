//! `cargo xtask flood`: the flood test (root): a storm of forged CONNECTs against a live target.
//!
//! A 2-NIC veth lab: `tyched` with a shared file export (`shared = true`, so that the flood can
//! create sessions) in the target namespace, `tyche-init serve-nbd`
//! (AF_XDP on every link) in the initiator namespace, and fio with verify through the NBD socket
//! (random 4 KiB writes, each block read back and checked while the job runs). While fio runs,
//! `tyche-flood` (crate `tyche-tools`) sends 100,000 CONNECT frames from 1,000 forged
//! source MACs into the target's first NIC through an AF_PACKET socket on the initiator side of
//! the same link: eight in ten ask for a new session, one for a new session on channel 65535,
//! one names channel 65535 of a session that does not exist (see `tyche-flood`'s docs).
//!
//! Meanwhile tyched's `VmRSS` is sampled from `/proc/PID/status` every 50 ms (and it is killed if
//! it passes `--kill-above-mib`, to spare the machine). Then it checks: fio exited 0 with no
//! verify error; the flood's sessions are reclaimed; a fresh write and read-back through the same
//! initiator works; both daemons still run; tyched's peak RSS (`VmHWM`, and the samples) is
//! under [`RSS_BOUND_MIB`] (stated in docs/tyched.md, "Limits under a flood"); and the refused
//! CONNECTs were counted (`limits.busy_*` in `tyched stats --json`). The last line:
//! `flood: <N> connects from <M> macs, peak rss <X> MiB (bound <B> MiB), <R> refused, fio verify ok`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Args;
use serde_json::Value;

use crate::lab::Lab;
use crate::stack::{
    bin, fio_nbd, fio_result, interrupted, prepare, start_initiator, start_tyched_with, Guard, Link, Running,
};

/// The bound on tyched's peak resident memory during the flood, in MiB (docs/tyched.md,
/// "Limits under a flood"). Measured: about 105 MiB at rest with two AF_XDP NICs (UMEMs, rings,
/// the honest session) and 129-131 MiB at the peak of the flood (256 sessions, the
/// `limits.sessions` default, each with one channel); before the limits the same flood took
/// tyched past 3 GiB in 14 s. About twice the measured peak, so a machine with a different
/// base does not fail it, and still far below what an unbounded flood reaches.
pub const RSS_BOUND_MIB: u64 = 256;

/// The export the honest initiator and the flood both name.
const EXPORT: &str = "flood";
/// Size of its backing file.
const EXPORT_MIB: u64 = 256;

#[derive(Args, Debug)]
pub struct FloodArgs {
    /// CONNECT frames in the flood.
    #[arg(long, default_value_t = 100_000)]
    connects: u64,
    /// Distinct source MACs of the flood.
    #[arg(long, default_value_t = 1000)]
    macs: u32,
    /// The flood stops after this many seconds even if not every frame went out (a failure).
    #[arg(long, default_value_t = 20)]
    flood_secs: u64,
    /// CONNECTs per second at most (0: as fast as the link takes them).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Seconds fio runs; the flood starts 2 s into it.
    #[arg(long, default_value_t = 25)]
    fio_secs: u64,
    /// Veth pairs (NICs); the flood goes into the first.
    #[arg(long, default_value_t = 2)]
    nics: u32,
    /// MTU of the links.
    #[arg(long, default_value_t = 3000)]
    mtu: u32,
    /// Bound on tyched's peak RSS, MiB.
    #[arg(long, default_value_t = RSS_BOUND_MIB)]
    rss_bound_mib: u64,
    /// Kill tyched (and fail) if its RSS passes this many MiB.
    #[arg(long, default_value_t = 3072)]
    kill_above_mib: u64,
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
}

impl FloodArgs {
    /// The standard run: 100,000 CONNECTs from 1,000 MACs, packages already installed.
    pub fn standard() -> FloodArgs {
        FloodArgs {
            connects: 100_000,
            macs: 1000,
            flood_secs: 20,
            rate: 0,
            fio_secs: 25,
            nics: 2,
            mtu: 3000,
            rss_bound_mib: RSS_BOUND_MIB,
            kill_above_mib: 3072,
            no_install: true,
        }
    }
}

/// A field of `/proc/PID/status` in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// What the RSS sampler saw.
#[derive(Debug, Default, Clone)]
struct Samples {
    /// (seconds since the sampler started, VmRSS KiB).
    rss: Vec<(f64, u64)>,
    /// Whether it killed the daemon for passing the cap.
    killed: bool,
}

impl Samples {
    fn peak(&self) -> u64 {
        self.rss.iter().map(|s| s.1).max().unwrap_or(0)
    }
    /// The largest sample in `[from, to)` seconds.
    fn peak_between(&self, from: f64, to: f64) -> u64 {
        self.rss.iter().filter(|s| s.0 >= from && s.0 < to).map(|s| s.1).max().unwrap_or(0)
    }
}

/// Samples a process's VmRSS every 50 ms on a thread until stopped.
struct Sampler {
    start: Instant,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Samples>>,
}

impl Sampler {
    fn start(pid: u32, kill_above_kib: u64) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut s = Samples::default();
            while !flag.load(Ordering::Relaxed) {
                let Some(kib) = status_kib(pid, "VmRSS") else { break };
                s.rss.push((start.elapsed().as_secs_f64(), kib));
                if kib > kill_above_kib && !s.killed {
                    eprintln!("flood: tyched's RSS is {:.0} MiB, over the cap: killing it", mib(kib));
                    let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                    s.killed = true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            s
        });
        Sampler { start, stop, thread: Some(thread) }
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn finish(&mut self) -> Samples {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.finish();
    }
}

struct Flood<'a> {
    root: &'a Path,
    work: PathBuf,
    lab: &'a Lab,
    args: &'a FloodArgs,
    stats: PathBuf,
}

impl Flood<'_> {
    /// `tyched stats --json`, bounded in time (a wedged daemon must not hang the test).
    fn stats(&self) -> Result<Value> {
        let out = self.work.join("stats.json");
        let file = fs::File::create(&out)?;
        let child = Command::new(bin(self.root, "tyched"))
            .args(["stats", "--json", "--socket"])
            .arg(&self.stats)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(Stdio::null())
            .spawn()
            .context("running tyched stats")?;
        let status = Guard(child).wait(Duration::from_secs(10)).context("tyched stats")?;
        ensure!(status.success(), "tyched stats failed ({status})");
        serde_json::from_str(&fs::read_to_string(&out)?).context("tyched stats --json")
    }

    /// fio with verify through the NBD socket, in the initiator namespace.
    fn fio(&self, name: &str, job: &[String]) -> Result<(Guard, PathBuf)> {
        fio_nbd(self.lab, &self.work, EXPORT, &self.work.join("nbd.sock"), name, job)
    }
}

/// Frames the first NIC has received, from `tyched stats --json`.
fn nic_rx(v: &Value) -> u64 {
    v["nics"][0]["frames_rx"].as_u64().unwrap_or(0)
}

/// The numbers the report is made of.
#[derive(Debug, Default)]
struct Outcome {
    sent: u64,
    flood_line: String,
    flood_secs: f64,
    refused: u64,
    limits: Option<serde_json::Map<String, Value>>,
    peak_sessions: u64,
    hwm_kib: u64,
}

pub fn flood(root: &Path, args: &FloodArgs) -> Result<()> {
    let begun = Instant::now();
    prepare(root, "flood", args.no_install)?;
    let pid = std::process::id();
    let work = PathBuf::from(format!("/run/tyche-flood-{pid}"));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let lab = Lab::create(&format!("tyf-t{pid}"), &format!("tyf-i{pid}"), args.nics, args.mtu)?;
    let f = Flood { root, work: work.clone(), lab: &lab, args, stats: work.join("tyched.sock") };
    let result = run(&f);
    drop(lab);
    match &result {
        Ok(_) => {
            let _ = fs::remove_dir_all(&work);
        }
        Err(_) => eprintln!("flood: logs kept in {}", work.display()),
    }
    let (o, peak_kib) = result?;
    eprintln!("flood: took {:.1} s in all", begun.elapsed().as_secs_f64());
    println!(
        "flood: {} connects from {} macs, peak rss {:.1} MiB (bound {} MiB), {} refused, fio verify ok",
        o.sent,
        args.macs,
        mib(peak_kib),
        args.rss_bound_mib,
        o.refused
    );
    Ok(())
}

/// When each phase began and ended, in seconds on the sampler's clock.
struct Marks {
    fio_started: f64,
    flood_started: f64,
    flood_ended: f64,
    fio_ended: f64,
}

/// Runs the test; returns the outcome and the peak RSS in KiB.
fn run(f: &Flood<'_>) -> Result<(Outcome, u64)> {
    let args = f.args;
    let mut tyched = start_target(f)?;
    let extra = ["--no-path-timeout".to_string(), "30".to_string()];
    let socket = f.work.join("nbd.sock");
    let mut init = start_initiator(f.root, f.lab, Link::Xdp, EXPORT, &socket, f.work.join("init.log"), &extra)?;
    let tpid = tyched.daemon.pid();
    let mut sampler = Sampler::start(tpid, args.kill_above_mib << 10);
    let mut o = Outcome::default();

    // fio: random 4 KiB writes over the first half of the export, each read back and checked
    // (verify_backlog) while the job runs.
    let fio_secs = args.fio_secs.max(args.flood_secs + 4);
    let (mut fio, fio_out) = f.fio("verify", &verify_job(fio_secs))?;
    let fio_started = sampler.now();
    std::thread::sleep(Duration::from_secs(2));
    tyched.check_alive()?;

    // The flood, into the first link.
    eprintln!(
        "flood: {} CONNECTs from {} MACs into {} while fio runs ({} s)",
        args.connects, args.macs, f.lab.pairs[0].target_if, fio_secs
    );
    let rx_before = nic_rx(&f.stats()?);
    let flood_out = f.work.join("flood.out");
    let flood_started = sampler.now();
    let mut flooder = start_flooder(f, &flood_out)?;
    let status = watch_flood(f, &mut flooder, &mut tyched, &mut o)?;
    let flood_ended = sampler.now();
    let flood_end = Instant::now();
    read_flood_line(&mut o, &flood_out, flood_ended - flood_started);
    eprintln!("flood: {}", o.flood_line);
    ensure!(
        status.success() && o.sent == args.connects,
        "tyche-flood sent {} of {} CONNECTs ({status}): {}{}",
        o.sent,
        args.connects,
        o.flood_line,
        fs::read_to_string(f.work.join("flood.err")).unwrap_or_default()
    );

    // fio finishes on its own; the daemons must have lived through it.
    let (fio_status, rx_after) = watch_fio(f, &mut fio, &mut tyched, &mut o, flood_end, fio_secs)?;
    let fio_ended = sampler.now();
    check_fio(f, &mut tyched, &mut init, fio_status, &fio_out, fio_secs)?;
    let reclaim_secs = wait_reclaimed(f, &mut tyched)?;
    check_after(f)?;

    let v = f.stats()?;
    o.hwm_kib = status_kib(tpid, "VmHWM").unwrap_or(0);
    let rss_end = status_kib(tpid, "VmRSS").unwrap_or(0);
    tyched.check_alive()?;
    init.check_alive()?;
    let samples = sampler.finish();
    ensure!(!samples.killed, "tyched's RSS passed {} MiB; it was killed", args.kill_above_mib);

    // Report.
    let peak_kib = samples.peak().max(o.hwm_kib);
    let marks = Marks { fio_started, flood_started, flood_ended, fio_ended };
    report_rss(&o, &samples, &marks, rss_end);
    report_sessions(f, &o, &v, reclaim_secs, rx_before, rx_after);
    report_limits(&mut o, &v);
    report_initiator(f);
    init.daemon.stop();
    tyched.daemon.stop();
    check_outcome(args, &o, peak_kib)?;
    Ok((o, peak_kib))
}

/// Writes tyched's config and starts it.
///
/// A shared export (several initiators at once), so that the flood's CONNECTs create sessions up
/// to the limits; a non-shared one attached by the honest initiator would refuse them all with
/// REJECT IN_USE, which holds nothing.
fn start_target(f: &Flood<'_>) -> Result<Running> {
    let config = f.work.join("tyched.toml");
    let image = f.work.join("export.img");
    fs::write(
        &config,
        format!(
            "[[export]]\nname = \"{EXPORT}\"\npath = \"{}\"\nsize = \"{EXPORT_MIB}M\"\nshared = true\n",
            image.display()
        ),
    )?;
    let serve = ["--config".to_string(), config.display().to_string()];
    start_tyched_with(f.root, f.lab, Link::Xdp, &serve, &f.stats, f.work.join("tyched.log"))
}

/// fio's options for the verify job that runs `fio_secs` seconds under the flood.
fn verify_job(fio_secs: u64) -> Vec<String> {
    ["--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=128m", "--time_based", "--verify_backlog=256"]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--runtime={fio_secs}")])
        .collect()
}

/// Starts `tyche-flood` in the initiator namespace, into the first link; its stdout in `out`.
fn start_flooder(f: &Flood<'_>, out: &Path) -> Result<Guard> {
    let args = f.args;
    let pair = &f.lab.pairs[0];
    Ok(Guard(
        Command::new("ip")
            .args(["netns", "exec", &f.lab.initiator_ns])
            .arg(bin(f.root, "tyche-flood"))
            .args(["--iface", &pair.initiator_if, "--target", &pair.target_mac.to_string(), "--export", EXPORT])
            .args(["--connects", &args.connects.to_string(), "--macs", &args.macs.to_string()])
            .args(["--seconds", &args.flood_secs.to_string(), "--rate", &args.rate.to_string()])
            .stdin(Stdio::null())
            .stdout(fs::File::create(out)?)
            .stderr(fs::File::create(f.work.join("flood.err"))?)
            .spawn()
            .context("starting tyche-flood")?,
    ))
}

/// Watches while the flood runs (the daemons alive, the live sessions); returns its exit status.
fn watch_flood(f: &Flood<'_>, flooder: &mut Guard, tyched: &mut Running, o: &mut Outcome) -> Result<ExitStatus> {
    let flood_deadline = Instant::now() + Duration::from_secs(f.args.flood_secs + 10);
    let mut next_stats = Instant::now();
    let status = loop {
        if let Some(status) = flooder.0.try_wait()? {
            break status;
        }
        interrupted()?;
        ensure!(Instant::now() < flood_deadline, "tyche-flood still runs past its time bound");
        tyched.check_alive().context("tyched died under the flood")?;
        if Instant::now() >= next_stats {
            if let Ok(v) = f.stats() {
                o.peak_sessions = o.peak_sessions.max(v["sessions"].as_u64().unwrap_or(0));
            }
            next_stats = Instant::now() + Duration::from_millis(500);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok(status)
}

/// Reads tyche-flood's summary line into `o` (frames sent, seconds, or `measured_secs` if the
/// line does not say).
fn read_flood_line(o: &mut Outcome, flood_out: &Path, measured_secs: f64) {
    o.flood_line = fs::read_to_string(flood_out).unwrap_or_default().trim().to_string();
    let field = |k: &str| -> Option<u64> {
        o.flood_line.split_whitespace().find_map(|w| w.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
    };
    o.sent = field("sent").unwrap_or(0);
    o.flood_secs =
        o.flood_line.split_whitespace().find_map(|w| w.strip_prefix("secs=")?.parse().ok()).unwrap_or(measured_secs);
}

/// Waits for fio to finish on its own, watching the daemons and the live sessions; returns its
/// exit status and the first NIC's received frames 1 s after the flood's end (if sampled).
fn watch_fio(
    f: &Flood<'_>,
    fio: &mut Guard,
    tyched: &mut Running,
    o: &mut Outcome,
    flood_end: Instant,
    fio_secs: u64,
) -> Result<(ExitStatus, Option<u64>)> {
    let mut next_stats = Instant::now();
    let mut rx_after = None;
    let fio_deadline = Instant::now() + Duration::from_secs(fio_secs + 30);
    let fio_status = loop {
        if let Some(status) = fio.0.try_wait()? {
            break status;
        }
        interrupted()?;
        ensure!(Instant::now() < fio_deadline, "fio still runs {} s past its runtime", 30);
        tyched.check_alive().context("tyched died under the flood")?;
        if Instant::now() >= next_stats {
            if let Ok(v) = f.stats() {
                o.peak_sessions = o.peak_sessions.max(v["sessions"].as_u64().unwrap_or(0));
                if rx_after.is_none() && flood_end.elapsed() >= Duration::from_secs(1) {
                    rx_after = Some(nic_rx(&v));
                }
            }
            next_stats = Instant::now() + Duration::from_millis(500);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok((fio_status, rx_after))
}

/// Checks that both daemons lived through fio and that fio verified without error.
fn check_fio(
    f: &Flood<'_>,
    tyched: &mut Running,
    init: &mut Running,
    fio_status: ExitStatus,
    fio_out: &Path,
    fio_secs: u64,
) -> Result<()> {
    tyched.check_alive().context("tyched died under the flood")?;
    init.check_alive().context("tyche-init died under the flood")?;
    let log = fs::read_to_string(f.work.join("verify.log")).unwrap_or_default();
    ensure!(fio_status.success(), "fio failed under the flood ({fio_status}):\n{log}");
    let (err, written, read) = fio_result(fio_out)?;
    ensure!(err == 0, "fio reports error {err} under the flood:\n{log}");
    ensure!(written > 0 && read > 0, "fio wrote {written} B and verified {read} B");
    eprintln!(
        "flood: fio ok: {:.1} MiB written, {:.1} MiB read back and verified in {} s",
        written as f64 / 1048576.0,
        read as f64 / 1048576.0,
        fio_secs
    );
    Ok(())
}

/// Waits up to 20 s for the flood's sessions to go (their channels hear nothing, die, and are
/// reclaimed); returns the seconds it took.
fn wait_reclaimed(f: &Flood<'_>, tyched: &mut Running) -> Result<f64> {
    let reclaim_from = Instant::now();
    let mut last = Value::Null;
    let mut reclaimed = false;
    while reclaim_from.elapsed() < Duration::from_secs(20) {
        interrupted()?;
        tyched.check_alive()?;
        if let Ok(v) = f.stats() {
            let live = v["sessions"].as_u64().unwrap_or(u64::MAX);
            last = v;
            if live <= 1 {
                reclaimed = true;
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let reclaim_secs = reclaim_from.elapsed().as_secs_f64();
    ensure!(
        reclaimed,
        "{} sessions still live {reclaim_secs:.1} s after the flood (only the honest one should be)",
        last["sessions"]
    );
    Ok(reclaim_secs)
}

/// A fresh write and read-back through the same initiator, outside fio's region.
fn check_after(f: &Flood<'_>) -> Result<()> {
    let check: Vec<String> = ["--rw=write", "--bs=64k", "--iodepth=4", "--size=8m", "--offset=200m", "--do_verify=1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let (mut after, after_out) = f.fio("after", &check)?;
    let status = after.wait(Duration::from_secs(60)).context("fio after the flood")?;
    let (err, written, read) = fio_result(&after_out)?;
    ensure!(
        status.success() && err == 0 && written == 8 << 20 && read == 8 << 20,
        "the write and read-back after the flood failed ({status}, error {err}, {written} B written, {read} B read)"
    );
    Ok(())
}

/// Reports tyched's RSS in each phase.
fn report_rss(o: &Outcome, samples: &Samples, marks: &Marks, rss_end: u64) {
    let before = samples.rss.first().map_or(0, |s| s.1);
    eprintln!(
        "flood: tyched RSS MiB: {:.1} at start, {:.1} peak under fio alone, {:.1} peak during the flood ({:.2} s), \
         {:.1} peak from its end to fio's, {:.1} at the end; VmHWM {:.1}",
        mib(before),
        mib(samples.peak_between(marks.fio_started, marks.flood_started)),
        mib(samples.peak_between(marks.flood_started, marks.flood_ended)),
        o.flood_secs,
        mib(samples.peak_between(marks.flood_ended, marks.fio_ended)),
        mib(rss_end),
        mib(o.hwm_kib)
    );
}

/// Reports the sessions, the drops by NIC and the frames the first NIC received.
fn report_sessions(f: &Flood<'_>, o: &Outcome, v: &Value, reclaim_secs: f64, rx_before: u64, rx_after: Option<u64>) {
    eprintln!(
        "flood: sessions: peak {} sampled, {} reclaimed in all, back to {} in {reclaim_secs:.1} s",
        o.peak_sessions, v["sessions_reclaimed"], v["sessions"]
    );
    let nic_drops: Vec<String> = v["nics"]
        .as_array()
        .map(|nics| nics.iter().map(|n| format!("{} {}", n["name"].as_str().unwrap_or("?"), n["drops"])).collect())
        .unwrap_or_default();
    eprintln!("flood: drops by NIC: {}", nic_drops.join("; "));
    if let Some(after) = rx_after {
        eprintln!(
            "flood: {} received {} frames from the flood's start to 1 s after its end (the flood's and fio's)",
            f.lab.pairs[0].target_if,
            after.saturating_sub(rx_before)
        );
    }
}

/// Reads tyched's `limits` into `o` (the CONNECTs refused as busy) and reports what became of
/// the flood's CONNECTs.
fn report_limits(o: &mut Outcome, v: &Value) {
    o.limits = v.get("limits").and_then(Value::as_object).cloned();
    match &o.limits {
        Some(limits) => {
            o.refused = limits.iter().filter(|(k, _)| k.starts_with("busy_")).filter_map(|(_, v)| v.as_u64()).sum();
            eprintln!("flood: limits: {}", Value::Object(limits.clone()));
            // Every session but the honest one came from the flood, and all were reclaimed.
            let accepted = v["sessions_reclaimed"].as_u64().unwrap_or(0);
            let unknown =
                o.flood_line.split_whitespace().find_map(|w| w.strip_prefix("ch65535_unknown=")?.parse().ok());
            let unknown: u64 = unknown.unwrap_or(0);
            eprintln!(
                "flood: of {} CONNECTs, tyched accepted {accepted} (new sessions, all reclaimed since) and refused {} \
                 as busy; of the other {}, {unknown} at most named a session that does not exist (REJECT \
                 UNKNOWN_SESSION, not counted) and the rest were dropped before tyched read them (its AF_XDP \
                 receive ring full)",
                o.sent,
                o.refused,
                o.sent.saturating_sub(accepted + o.refused)
            );
        }
        None => eprintln!("flood: tyched stats has no `limits` object"),
    }
}

/// Reports what the honest initiator's log says of the flood.
fn report_initiator(f: &Flood<'_>) {
    let ilog = fs::read_to_string(f.work.join("init.log")).unwrap_or_default();
    let dead = ilog.lines().filter(|l| l.contains("channel dead")).count();
    let reconnects = ilog.lines().filter(|l| l.contains("reconnect attempt")).count();
    eprintln!("flood: the honest initiator saw {dead} channel(s) die and made {reconnects} reconnect attempt(s)");
}

/// The final checks: the peak RSS under its bound, the refused CONNECTs counted, no session failed.
fn check_outcome(args: &FloodArgs, o: &Outcome, peak_kib: u64) -> Result<()> {
    ensure!(
        mib(peak_kib) <= args.rss_bound_mib as f64,
        "tyched's peak RSS {:.1} MiB is over the bound of {} MiB",
        mib(peak_kib),
        args.rss_bound_mib
    );
    ensure!(o.limits.is_some(), "tyched stats --json has no `limits` object: the refused CONNECTs are not counted");
    ensure!(o.refused > 0, "no CONNECT of the flood was refused as busy (limits.busy_* all 0)");
    let failed = o.limits.as_ref().and_then(|l| l.get("sessions_failed")).and_then(Value::as_u64).unwrap_or(0);
    ensure!(failed == 0, "{failed} sessions failed (a panic contained) under the flood");
    Ok(())
}
