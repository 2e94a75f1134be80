//! `cargo xtask bench e2e [--quick]`: the same fio jobs (fio's `nbd` engine) against
//!
//! 1. nbdkit's memory plugin over TCP on a veth pair (what users run today);
//! 2. Tyche over AF_XDP: `tyched` with a RAM export, `tyche-init serve-nbd` on a Unix socket (a local
//!    hop that nbdkit's path does not have, so the comparison is conservative), with 1 and 2 NICs;
//! 3. Tyche over its TCP transport (the papers' TSockets baseline), same path as 2, one link.
//!
//! For each: IOPS, GB/s, p50/p99 completion latency (total latency, submission included, for the
//! queue-depth-1 job), and CPU seconds per GB on each side (the
//! target's server process; on the initiator, fio plus `tyche-init` where there is one), from
//! `/proc/PID/stat` and fio's own accounting. Prints a table and the ratios against nbdkit and
//! writes `docs/benchmarks-e2e.md`.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use crate::charts::{self, Point};
use crate::disk::run;
use crate::lab::Lab;
use crate::stack::{bin, prepare, start_initiator, start_tyched_with, wait_for, Daemon, Link};

#[derive(Args, Debug)]
pub struct BenchE2eArgs {
    /// Short runs (4 s per job) so the whole suite takes a few minutes.
    #[arg(long)]
    quick: bool,
    /// Seconds per fio job (default 4 with --quick, else 15).
    #[arg(long)]
    runtime: Option<u64>,
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
    /// MTU of the veth pairs (above about 3500 AF_XDP needs multi-buffer frames).
    #[arg(long, default_value_t = 3000)]
    mtu: u32,
    /// Who serves NBD requests in `tyche-init serve-nbd`: `engine` (its engine threads) or
    /// `tasks` (a task per request handing each to the engine).
    #[arg(long, default_value = "engine", value_parser = ["engine", "tasks"])]
    nbd_io: String,
    /// Run only these systems (comma-separated: nbdkit-tcp, tyche-tcp, tyche-xdp,
    /// tyche-xdp-auth, tyche-xdp-encrypt, tyche-xdp-digest), to reproduce or A/B one row; the
    /// table is printed but docs/benchmarks-e2e.md and the charts are left as they are.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// How both daemons' threads wait for work (`--poll` of tyched and tyche-init): adaptive
    /// (their default), sleep or spin; for A/B runs of polling.
    #[arg(long, value_parser = ["adaptive", "sleep", "spin"])]
    poll: Option<String>,
    /// Run only these jobs (comma-separated names from the table, e.g. randread4k-qd1), with
    /// `--only`'s rules: printed, not written to docs/.
    #[arg(long, value_delimiter = ',')]
    jobs: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
struct Job {
    name: &'static str,
    rw: &'static str,
    bs: &'static str,
    depth: u32,
}

const JOBS: [Job; 7] = [
    Job { name: "randread4k", rw: "randread", bs: "4k", depth: 32 },
    // Latency: one request at a time, each hop's wake-up on the critical path.
    Job { name: "randread4k-qd1", rw: "randread", bs: "4k", depth: 1 },
    Job { name: "randwrite4k", rw: "randwrite", bs: "4k", depth: 32 },
    Job { name: "seqread128k", rw: "read", bs: "128k", depth: 16 },
    Job { name: "seqwrite128k", rw: "write", bs: "128k", depth: 16 },
    Job { name: "seqread1m", rw: "read", bs: "1m", depth: 4 },
    Job { name: "seqwrite1m", rw: "write", bs: "1m", depth: 4 },
];

impl Job {
    /// The block size in bytes.
    fn block(&self) -> u64 {
        let (n, unit) = self.bs.split_at(self.bs.len() - 1);
        let n: u64 = n.parse().expect("job block sizes are like 4k or 1m");
        n << if unit == "m" { 20 } else { 10 }
    }
}

#[derive(Debug, Clone)]
struct Row {
    system: String,
    nics: u32,
    job: &'static str,
    iops: f64,
    gbps: f64,
    p50_us: f64,
    p99_us: f64,
    cpu_target_s_per_gb: f64,
    cpu_init_s_per_gb: f64,
}

/// CPU seconds (user + system) a process has used, from `/proc/PID/stat`.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |r| r.1);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of stat, i.e. 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// How a benchmarked export protects its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protect {
    Plain,
    /// `key_file`: every frame authenticated.
    Auth,
    /// `key_file` and `encrypt = true`.
    Encrypt,
    /// No key; the initiator asks for feature DIGEST (a CRC32C of every payload).
    Digest,
}

struct Bench<'a> {
    root: &'a Path,
    work: PathBuf,
    runtime: u64,
    nbd_io: &'a str,
    poll: Option<&'a str>,
    jobs: &'a [String],
    /// Idle CPU of both daemons after the jobs, per Tyche system: (system, NICs, target %,
    /// initiator %).
    idle: std::cell::RefCell<Vec<(String, u32, f64, f64)>>,
    /// Per Tyche system: both daemons' polling summaries after its jobs.
    polls: std::cell::RefCell<Vec<String>>,
    /// Per Tyche job: the frames both daemons sent, retransmitted and dropped as duplicates.
    frames: std::cell::RefCell<Vec<String>>,
}

/// The processes of a system under test, for CPU time (`target`, `initiator`: their pids) and,
/// for Tyche, the frame counters of their stats.
struct Daemons<'a> {
    target: &'a [u32],
    initiator: &'a [u32],
    /// `tyched`'s stats socket and `tyche-init`'s pid.
    stats: Option<(&'a Path, u32)>,
}

/// One daemon's frame counters, summed over its channels.
#[derive(Debug, Default, Clone, Copy)]
struct Frames {
    sent: u64,
    retransmits: u64,
    /// Retransmission timer expiries, and those the next acknowledgement showed were spurious.
    timeouts: u64,
    spurious: u64,
    /// Frames dropped as already received (the peer's retransmissions of frames that had come).
    duplicates: u64,
}

impl Frames {
    /// The counters in `channels` (a stats document's array of channels).
    fn of(channels: &serde_json::Value) -> Frames {
        let mut f = Frames::default();
        for c in channels.as_array().into_iter().flatten() {
            f.sent += c["frames_tx"].as_u64().unwrap_or(0);
            f.retransmits += c["retransmits"].as_u64().unwrap_or(0);
            f.timeouts += c["timeouts"].as_u64().unwrap_or(0);
            f.spurious += c["spurious_timeouts"].as_u64().unwrap_or(0);
            f.duplicates += c["drops"]["duplicate"].as_u64().unwrap_or(0);
        }
        f
    }

    fn since(self, before: Frames) -> Frames {
        Frames {
            sent: self.sent.saturating_sub(before.sent),
            retransmits: self.retransmits.saturating_sub(before.retransmits),
            timeouts: self.timeouts.saturating_sub(before.timeouts),
            spurious: self.spurious.saturating_sub(before.spurious),
            duplicates: self.duplicates.saturating_sub(before.duplicates),
        }
    }

    fn describe(self) -> String {
        let pct = self.retransmits as f64 / self.sent.max(1) as f64 * 100.0;
        format!(
            "{} retransmits ({} timer expiries, {} found spurious) of {} frames sent ({pct:.4}%), {} duplicates dropped",
            self.retransmits, self.timeouts, self.spurious, self.sent, self.duplicates
        )
    }
}

/// Both daemons' frame counters now (`tyched stats --json`, `tyche-init stats --json`), and the
/// payload bytes the initiator copied in user space and moved (read and written).
fn frames(root: &Path, tsock: &Path, init_pid: u32) -> Result<(Frames, Frames, (u64, u64))> {
    let json = |out: String, what: &str| -> Result<serde_json::Value> {
        serde_json::from_str(&out).with_context(|| format!("{what} --json"))
    };
    let t =
        json(run(Command::new(bin(root, "tyched")).args(["stats", "--json", "--socket"]).arg(tsock))?, "tyched stats")?;
    let i = json(
        run(Command::new(bin(root, "tyche-init")).args(["stats", "--json"]).arg(init_pid.to_string()))?,
        "tyche-init stats",
    )?;
    let copied = i["payload_copied_bytes"].as_u64().context("tyche-init stats has no payload_copied_bytes")?;
    let moved = i["bytes_read"].as_u64().unwrap_or(0) + i["bytes_written"].as_u64().unwrap_or(0);
    Ok((Frames::of(&t["channels"]), Frames::of(&i["channels"]), (copied, moved)))
}

/// The job at queue depth 1, whose latency is compared.
const QD1_JOB: &str = "randread4k-qd1";

/// How long the daemons are watched, idle, after the jobs.
const IDLE_WATCH: Duration = Duration::from_secs(5);

impl Bench<'_> {
    /// The jobs this run does (`--jobs`, or all).
    fn jobs(&self) -> impl Iterator<Item = Job> + '_ {
        JOBS.into_iter().filter(|j| self.jobs.is_empty() || self.jobs.iter().any(|n| n == j.name))
    }

    /// Runs one fio job in namespace `ns` against `uri`; `target` and `initiator` are the pids
    /// whose CPU time is charged to each side.
    /// Writes the region the jobs use (`--size=512m`) once, untimed, before the first job, so
    /// that every read finds data: a server that answers a read of a never-written range with
    /// a hole (tyche-init's hole-aware reads of 256 KiB or more) would otherwise move no data,
    /// and a read job run alone (`--jobs seqread1m`) would measure nothing.
    fn fill(&self, system: &str, ns: &str, uri: &str) -> Result<()> {
        run(Command::new("ip").args(["netns", "exec", ns, "fio", "--name", "fill", "--ioengine=nbd"]).args([
            format!("--uri={uri}"),
            "--rw=write".into(),
            "--bs=1m".into(),
            "--iodepth=4".into(),
            "--size=512m".into(),
            "--output-format=terse".into(),
        ]))
        .with_context(|| format!("fio filling the export of {system}"))?;
        Ok(())
    }

    fn fio(&self, system: &str, nics: u32, ns: &str, uri: &str, job: Job, daemons: &Daemons<'_>) -> Result<Row> {
        let Daemons { target, initiator, stats } = *daemons;
        let out = self.work.join(format!("fio-{system}-{nics}-{}.json", job.name));
        let frames_before = stats.map(|(tsock, pid)| frames(self.root, tsock, pid)).transpose()?;
        let before_t: f64 = target.iter().map(|&p| cpu_seconds(p)).sum();
        let before_i: f64 = initiator.iter().map(|&p| cpu_seconds(p)).sum();
        run(Command::new("ip").args(["netns", "exec", ns, "fio", "--name", job.name, "--ioengine=nbd"]).args([
            format!("--uri={uri}"),
            format!("--rw={}", job.rw),
            format!("--bs={}", job.bs),
            format!("--iodepth={}", job.depth),
            format!("--runtime={}", self.runtime),
            "--ramp_time=1".into(),
            "--time_based".into(),
            "--size=512m".into(),
            "--lat_percentiles=1".into(),
            "--output-format=json".into(),
            format!("--output={}", out.display()),
        ]))
        .with_context(|| format!("fio {} against {system}", job.name))?;
        let cpu_t = target.iter().map(|&p| cpu_seconds(p)).sum::<f64>() - before_t;
        let cpu_i = initiator.iter().map(|&p| cpu_seconds(p)).sum::<f64>() - before_i;
        let frames_after = stats.map(|(tsock, pid)| frames(self.root, tsock, pid)).transpose()?;
        let text = fs::read_to_string(&out)?;
        let json = &text[text.find('{').context("fio wrote no JSON")?..];
        let v: serde_json::Value = serde_json::from_str(json).context("fio's JSON")?;
        let j = &v["jobs"][0];
        let dir = if job.rw.contains("read") { &j["read"] } else { &j["write"] };
        if let (Some((t0, i0, (c0, m0))), Some((t1, i1, (c1, m1)))) = (frames_before, frames_after) {
            // Both over the whole job, its ramp included.
            let moved = m1.saturating_sub(m0).max(1) as f64;
            self.frames.borrow_mut().push(format!(
                "- {system} ({nics} NIC) {}: target {}; initiator {}; initiator copies per payload byte {:.2}",
                job.name,
                t1.since(t0).describe(),
                i1.since(i0).describe(),
                c1.saturating_sub(c0) as f64 / moved,
            ));
        }
        // At queue depth 1, fio can be preempted between sending a request and taking its issue
        // time (the daemon it woke runs first), which makes completion latency (`clat`) look
        // shorter than the request took: count from submission (`lat`) there.
        let lat = if job.depth == 1 { "lat_ns" } else { "clat_ns" };
        let pct = |p: &str| dir[lat]["percentile"][p].as_f64().unwrap_or(0.0) / 1000.0;
        let secs = j["job_runtime"].as_f64().unwrap_or(0.0) / 1000.0;
        let bytes = dir["io_bytes"].as_f64().unwrap_or(0.0);
        ensure!(bytes > 0.0, "fio moved no data in {} against {system}", job.name);
        let fio_cpu = (j["usr_cpu"].as_f64().unwrap_or(0.0) + j["sys_cpu"].as_f64().unwrap_or(0.0)) / 100.0 * secs;
        let gb = bytes / 1e9;
        Ok(Row {
            system: system.to_string(),
            nics,
            job: job.name,
            iops: dir["iops"].as_f64().unwrap_or(0.0),
            gbps: dir["bw_bytes"].as_f64().unwrap_or(0.0) / 1e9,
            p50_us: pct("50.000000"),
            p99_us: pct("99.000000"),
            cpu_target_s_per_gb: cpu_t / gb,
            cpu_init_s_per_gb: (cpu_i + fio_cpu) / gb,
        })
    }

    fn nbdkit(&self, lab: &Lab, rows: &mut Vec<Row>) -> Result<()> {
        let log = self.work.join("nbdkit.log");
        let addr = &lab.pairs[0].target_ip;
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &lab.target_ns,
            "nbdkit",
            "--foreground",
            "--no-fork",
            "-i",
            addr,
            "-p",
            "10809",
            "memory",
            "1G",
        ]);
        let mut d = Daemon::spawn("nbdkit", &mut cmd, &log)?;
        let uri = format!("nbd://{addr}:10809/");
        let probe = lab.initiator_ns.clone();
        wait_for("nbdkit", Duration::from_secs(20), || {
            d.check_alive(&log)?;
            Ok(Command::new("ip")
                .args(["netns", "exec", &probe, "nbdinfo", "--size", &uri])
                .output()
                .is_ok_and(|o| o.status.success()))
        })?;
        let pid = d.pid();
        self.fill("nbdkit-tcp", &lab.initiator_ns, &uri)?;
        for job in self.jobs() {
            let daemons = Daemons { target: &[pid], initiator: &[], stats: None };
            rows.push(self.fio("nbdkit-tcp", 1, &lab.initiator_ns, &uri, job, &daemons)?);
        }
        Ok(())
    }

    fn tyche(&self, lab: &Lab, tcp: bool, rows: &mut Vec<Row>) -> Result<()> {
        self.tyche_keyed(lab, tcp, Protect::Plain, rows)
    }

    /// Tyche with the export `protect`ed: plain, keyed (every frame authenticated) or
    /// encrypted.
    fn tyche_keyed(&self, lab: &Lab, tcp: bool, protect: Protect, rows: &mut Vec<Row>) -> Result<()> {
        let nics = if tcp { 1 } else { lab.pairs.len() as u32 };
        let system = match (tcp, protect) {
            (true, _) => "tyche-tcp",
            (false, Protect::Plain) => "tyche-xdp",
            (false, Protect::Auth) => "tyche-xdp-auth",
            (false, Protect::Encrypt) => "tyche-xdp-encrypt",
            (false, Protect::Digest) => "tyche-xdp-digest",
        };
        let link = if tcp { Link::Tcp } else { Link::Xdp };
        let tsock = self.work.join(format!("{system}-{nics}.stats"));
        let tlog = self.work.join(format!("{system}-{nics}-tyched.log"));
        let mut extra = vec!["--nbd-io".to_string(), self.nbd_io.to_string()];
        if protect == Protect::Digest {
            extra.push("--digest".to_string());
        }
        let poll: Vec<String> = self.poll.iter().flat_map(|p| ["--poll".to_string(), p.to_string()]).collect();
        extra.extend(poll.iter().cloned());
        let tyched = if matches!(protect, Protect::Plain | Protect::Digest) {
            let args = [&["--export".to_string(), "bench=ram:1G".to_string()], &poll[..]].concat();
            start_tyched_with(self.root, lab, link, &args, &tsock, tlog)?
        } else {
            let key = self.work.join("bench.key");
            fs::write(&key, "a bench pre-shared key of some length\n")?;
            fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            let conf = self.work.join(format!("{system}.toml"));
            let encrypt = protect == Protect::Encrypt;
            fs::write(
                &conf,
                format!(
                    "[[export]]\nname = \"bench\"\nsize = \"1G\"\nkey_file = \"{}\"\nencrypt = {encrypt}\n",
                    key.display()
                ),
            )?;
            extra.extend(["--key".to_string(), key.display().to_string()]);
            let args = [&["--config".to_string(), conf.display().to_string()], &poll[..]].concat();
            start_tyched_with(self.root, lab, link, &args, &tsock, tlog)?
        };
        let sock = self.work.join(format!("{system}-{nics}.nbd"));
        let ilog = self.work.join(format!("{system}-{nics}-init.log"));
        let init = start_initiator(self.root, lab, link, "bench", &sock, ilog, &extra)?;
        let uri = format!("nbd+unix:///bench?socket={}", sock.display());
        self.fill(system, &lab.initiator_ns, &uri)?;
        let (tpid, ipid) = (tyched.daemon.pid(), init.daemon.pid());
        let daemons = Daemons { target: &[tpid], initiator: &[ipid], stats: Some((&tsock, ipid)) };
        for job in self.jobs() {
            rows.push(self.fio(system, nics, &lab.initiator_ns, &uri, job, &daemons)?);
        }
        // Idle: attached, no I/O. After a second (polling budgets run out within a millisecond),
        // the CPU both daemons use in IDLE_WATCH (target: under 2% each).
        std::thread::sleep(Duration::from_secs(1));
        let (t0, i0) = (cpu_seconds(tyched.daemon.pid()), cpu_seconds(init.daemon.pid()));
        std::thread::sleep(IDLE_WATCH);
        let pct = |a: f64, b: f64| (b - a) / IDLE_WATCH.as_secs_f64() * 100.0;
        let (t, i) = (pct(t0, cpu_seconds(tyched.daemon.pid())), pct(i0, cpu_seconds(init.daemon.pid())));
        self.idle.borrow_mut().push((system.to_string(), nics, t, i));
        // How the daemons' threads waited over the jobs (polling, sleeps, contention holdoffs).
        let summary = |cmd: &mut Command| {
            run(cmd)
                .ok()
                .and_then(|out| out.lines().map(str::trim).find(|l| l.starts_with("poll ")).map(str::to_owned))
                .unwrap_or_else(|| "no poll line in its stats".into())
        };
        let t = summary(Command::new(bin(self.root, "tyched")).args(["stats", "--socket"]).arg(&tsock));
        let i = summary(Command::new(bin(self.root, "tyche-init")).arg("stats").arg(init.daemon.pid().to_string()));
        self.polls.borrow_mut().push(format!("- {system} ({nics} NIC): tyched: {t}\n  tyche-init: {i}"));
        Ok(())
    }
}

fn ratio(rows: &[Row], system: &str, nics: u32, job: &str, metric: fn(&Row) -> f64) -> Option<f64> {
    let get = |s: &str, n: u32| rows.iter().find(|r| r.system == s && r.nics == n && r.job == job).map(metric);
    Some(get(system, nics)? / get("nbdkit-tcp", 1)?)
}

pub fn bench_e2e(root: &Path, args: &BenchE2eArgs) -> Result<()> {
    prepare(root, "bench e2e", args.no_install)?;
    let runtime = args.runtime.unwrap_or(if args.quick { 4 } else { 15 });
    let work = PathBuf::from(format!("/run/tyche-bench-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let bench = Bench {
        root,
        work: work.clone(),
        runtime,
        nbd_io: &args.nbd_io,
        poll: args.poll.as_deref(),
        jobs: &args.jobs,
        idle: Default::default(),
        polls: Default::default(),
        frames: Default::default(),
    };
    let known = ["nbdkit-tcp", "tyche-tcp", "tyche-xdp", "tyche-xdp-auth", "tyche-xdp-encrypt", "tyche-xdp-digest"];
    if let Some(bad) = args.only.iter().find(|s| !known.contains(&s.as_str())) {
        bail!("bench e2e: --only {bad}: not a system (one of {})", known.join(", "));
    }
    if let Some(bad) = args.jobs.iter().find(|n| !JOBS.iter().any(|j| j.name == n.as_str())) {
        let names: Vec<&str> = JOBS.iter().map(|j| j.name).collect();
        bail!("bench e2e: --jobs {bad}: not a job (one of {})", names.join(", "));
    }
    let rows = run_systems(&bench, args)?;
    let _ = fs::remove_dir_all(&work);

    let (table, ratios) = summary(&bench, &rows)?;
    println!("{table}\n{ratios}");
    if !args.only.is_empty() || !args.jobs.is_empty() {
        if rows.is_empty() {
            bail!("no results");
        }
        return Ok(());
    }
    record(root, args, runtime, &rows, &table, &ratios)
}

/// Runs every system and job asked for, on a lab of one NIC and then of two.
fn run_systems(bench: &Bench<'_>, args: &BenchE2eArgs) -> Result<Vec<Row>> {
    let want = |system: &str| args.only.is_empty() || args.only.iter().any(|s| s == system);
    let mut rows = Vec::new();
    for nics in [1u32, 2] {
        if nics == 2 && !want("tyche-xdp") {
            continue;
        }
        let pid = std::process::id();
        let lab = Lab::create(&format!("tyb-t{pid}"), &format!("tyb-i{pid}"), nics, args.mtu)?;
        eprintln!("bench: {nics} NIC(s)");
        if nics == 1 && want("nbdkit-tcp") {
            bench.nbdkit(&lab, &mut rows)?;
        }
        if nics == 1 && want("tyche-tcp") {
            bench.tyche(&lab, true, &mut rows)?;
        }
        if want("tyche-xdp") {
            bench.tyche(&lab, false, &mut rows)?;
        }
        if nics == 1 {
            for (system, protect) in [
                ("tyche-xdp-auth", Protect::Auth),
                ("tyche-xdp-encrypt", Protect::Encrypt),
                ("tyche-xdp-digest", Protect::Digest),
            ] {
                if want(system) {
                    bench.tyche_keyed(&lab, false, protect, &mut rows)?;
                }
            }
        }
    }
    Ok(rows)
}

/// The table of results and the ratios, frame counts, latency, idle and polling lines under it.
fn summary(bench: &Bench<'_>, rows: &[Row]) -> Result<(String, String)> {
    let mut table = String::new();
    writeln!(table, "| system | NICs | job | IOPS | GB/s | p50 µs | p99 µs | CPU s/GB target | CPU s/GB initiator |")?;
    writeln!(table, "|---|---|---|---:|---:|---:|---:|---:|---:|")?;
    for r in rows {
        writeln!(
            table,
            "| {} | {} | {} | {:.0} | {:.3} | {:.0} | {:.0} | {:.2} | {:.2} |",
            r.system, r.nics, r.job, r.iops, r.gbps, r.p50_us, r.p99_us, r.cpu_target_s_per_gb, r.cpu_init_s_per_gb
        )?;
    }
    let mut ratios = String::new();
    for (system, nics) in [("tyche-xdp", 1), ("tyche-xdp", 2), ("tyche-tcp", 1)] {
        let parts: Vec<String> = JOBS
            .iter()
            .filter_map(|j| ratio(rows, system, nics, j.name, |r| r.iops).map(|x| format!("{}={x:.2}x", j.name)))
            .collect();
        writeln!(ratios, "- {system} ({nics} NIC) / nbdkit: {}", parts.join(", "))?;
    }
    // The cost of keys (targets: authenticated at least 0.85 of plain IOPS on 4 KiB
    // random reads and 0.75 of plain throughput on 1 MiB sequential reads), same run, 1 NIC.
    let mut keyed = String::new();
    for system in ["tyche-xdp-auth", "tyche-xdp-encrypt", "tyche-xdp-digest"] {
        let parts: Vec<String> = JOBS
            .iter()
            .filter_map(|j| {
                let get = |s: &str| rows.iter().find(|r| r.system == s && r.nics == 1 && r.job == j.name);
                let (k, p) = (get(system)?, get("tyche-xdp")?);
                Some(format!("{}={:.2}", j.name, if j.bs == "4k" { k.iops / p.iops } else { k.gbps / p.gbps }))
            })
            .collect();
        writeln!(keyed, "- {system} / tyche-xdp (1 NIC; IOPS at 4k, GB/s above): {}", parts.join(", "))?;
    }
    // Latency at queue depth 1: Tyche's p50 and p99 over nbdkit's (lower is better).
    let qd1 = QD1_JOB;
    let mut latency = String::new();
    for (system, nics) in [("tyche-xdp", 1), ("tyche-xdp", 2), ("tyche-tcp", 1)] {
        if let (Some(p50), Some(p99)) =
            (ratio(rows, system, nics, qd1, |r| r.p50_us), ratio(rows, system, nics, qd1, |r| r.p99_us))
        {
            writeln!(latency, "- {system} ({nics} NIC) / nbdkit, {qd1}: p50={p50:.2}x, p99={p99:.2}x")?;
        }
    }
    let mut idle = String::new();
    for (system, nics, t, i) in bench.idle.borrow().iter() {
        writeln!(idle, "- {system} ({nics} NIC): tyched {t:.2}%, tyche-init {i:.2}%")?;
    }
    let polls = bench.polls.borrow().join("\n");
    let frames = bench.frames.borrow().join("\n");
    let ratios = format!(
        "{ratios}\nFrames per job (target: retransmits at most 0.01% of the frames sent on a lossless link), and the initiator's payload copies in user space per payload byte:\n\n{frames}\n\nLatency at queue depth 1 against nbdkit (lower is better; target: p50 at most 0.5x):\n\n{latency}\nIdle CPU of one core, attached and without I/O, {} s watched one second after the last job (target: under 2% each):\n\n{idle}\nHow the daemons' threads waited, over all jobs of each system:\n\n{polls}\n\nRatios against the same export without a key or digest (targets: auth at least 0.85 on randread4k and 0.75 on seqread1m, digest at least 0.95):\n\n{keyed}",
        IDLE_WATCH.as_secs()
    );
    Ok((table, ratios))
}

/// Writes docs/benchmarks-e2e.md and its charts for a run of every system and job, and prints the
/// summary line.
fn record(root: &Path, args: &BenchE2eArgs, runtime: u64, rows: &[Row], table: &str, ratios: &str) -> Result<()> {
    let kernel = run(Command::new("uname").arg("-r")).unwrap_or_default();
    let commit = run(Command::new("git").args(["rev-parse", "--short", "HEAD"]).current_dir(root)).unwrap_or_default();
    let date = run(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"])).unwrap_or_default();
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mtu = args.mtu;
    let doc = format!(
        "# End-to-end benchmarks (`cargo xtask bench e2e{}{}`)\n\nGenerated by the command; do not edit by hand.\nMachine: {} cores, kernel {kernel}, commit {commit}, {date}, load average at the end: {}.\nfio's `nbd` engine, {runtime} s per job after 1 s of ramp, RAM exports of 1 GiB (the 512 MiB the jobs use written once before the first job, so that no read finds a hole), veth pairs at MTU {mtu} in two network namespaces. nbdkit's path is fio → TCP → nbdkit; Tyche's is fio → Unix socket → `tyche-init` → AF_XDP (or TCP) → `tyched`, one local hop longer. nbdkit and tyche-tcp use one link; CPU s/GB counts the server process on the target side and fio plus `tyche-init` on the initiator side. p50 and p99 are fio's completion latency, and for `randread4k-qd1` (one request at a time) its total latency from submission.\n\n{table}\nRatios of IOPS against nbdkit:\n\n{ratios}\n![Throughput by block size](bench-e2e-block-size.png)\n\n![Tyche over AF_XDP by NIC count](bench-e2e-nics.png)\n",
        if args.quick { " --quick" } else { "" },
        args.poll.as_ref().map(|p| format!(" --poll {p}")).unwrap_or_default(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.split_whitespace().next().unwrap_or("?"),
    );
    fs::write(root.join("docs/benchmarks-e2e.md"), doc)?;
    let points: Vec<Point> = rows
        .iter()
        .filter_map(|r| {
            // The charts compare throughput by block size: the latency job is not one of them.
            let job = JOBS.iter().find(|j| j.name == r.job && j.depth > 1)?;
            let direction = if job.rw.contains("read") { "read" } else { "write" };
            Some(Point { system: r.system.clone(), nics: r.nics, direction, block: job.block(), gbps: r.gbps })
        })
        .collect();
    let title = format!("fio over NBD, queue depth 32/16/4, veth MTU {} ({commit})", args.mtu);
    charts::by_block_size(&points, &root.join("docs/bench-e2e-block-size.png"), &title)?;
    charts::by_nic_count(&points, "tyche-xdp", &root.join("docs/bench-e2e-nics.png"), "tyche-xdp by NIC count")?;
    let r = |job| ratio(rows, "tyche-xdp", 2, job, |r| r.iops).unwrap_or(0.0);
    if rows.is_empty() {
        bail!("no results");
    }
    // QD1 latency: Tyche over one AF_XDP NIC (nbdkit's path has one link too), p50 over p50.
    let qd1lat = ratio(rows, "tyche-xdp", 1, QD1_JOB, |r| r.p50_us).unwrap_or(0.0);
    println!(
        "bench: tyche/nbd randread4k={:.2}x seqread1m={:.2}x seqwrite1m={:.2}x qd1lat={qd1lat:.2}x",
        r("randread4k"),
        r("seqread1m"),
        r("seqwrite1m")
    );
    Ok(())
}
