//! Channel scaling (`cargo xtask bench scale`): the real daemons' frame handling, 1 channel on 1
//! pinned thread against 2 channels on 2, with the peer replaced by frames built in advance.
//!
//! - **Target**: `tyched`'s `Target` (its network threads, one per NIC, pinned through
//!   `Placement::nic_cpus`: CPU 1 alone, or CPUs 0 and 1) serving a RAM export over in-memory
//!   NICs that are [`ReplayPort`]s. A real `tyche-init` engine opens the session (one channel per
//!   NIC) and reads a little; then the ports cut it off and replay READ requests of 4 KiB, each
//!   port keeping `--window` in flight, until `--requests` (split evenly over the channels) have
//!   completed.
//! - **Initiator**: `tyche-init`'s engine (its engine threads, one per link, pinned by thread id
//!   after start: CPU 1 alone, or CPUs 0 and 1) over [`ReplayPort`]s that stand in for the
//!   target. A real `tyched` (a `Harness` driven on a helper thread) answers the handshake and a
//!   warm-up; then the helper stops, `--initiator-requests` reads of 4 KiB are handed to the
//!   client before the clock starts (futures polled once, with a waker that does nothing), and
//!   the ports answer every READ the engine sends with the recorded DATA segments and
//!   COMPLETION.
//!
//! Only the measured threads run while the clock runs; the main thread sleeps in 1 ms steps.
//! The rate is requests completed per second of wall time. Every run is checked: the target
//! executed every request and counted no drop, or every read future completed with its data.
//!
//! Prints one row per run, a table (min/median/max per configuration) and the last line
//! `scale: target 2x=<r>x initiator 2x=<r>x` (ratio of the medians, 2 channels over 1).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tyche_init::{connect_blocking, Client, EngineThreads, InitiatorConfig, Link, SchedulerKind};
use tyche_runtime::poll::{PollConfig, PollMode};
use tyche_tools::replay::{ReplayControl, ReplayPlan, ReplayPort};
use tyche_transport::MemLink;
use tyche_wire::{MacAddr, DEFAULT_ETHERTYPE};
use tyched::config::NetworkThreads;
use tyched::{Config, ExportConfig, Nic, Placement, Target};

/// Link MTU: 2 KiB segments, a 4 KiB read is 2 DATA frames and a COMPLETION (as in `cargo
/// xtask bench e2e`'s veth lab at MTU 3000).
const MTU: usize = 3000;
/// Buffer per frame.
const FRAME: usize = 4096;
/// Frames queued per direction of a link (live phase only).
const DEPTH: usize = 4096;
/// Transmit chunks the target's ports lend (read data goes straight into them, as over AF_XDP).
const TX_CHUNKS: usize = 1024;
/// Bytes per read.
const READ: usize = 4096;
/// Size of the RAM export.
const EXPORT: u64 = 64 << 20;
/// Real reads on each channel before the replay (they fill the templates).
const WARMUP: u64 = 32;
/// Longest one run may take.
const LIMIT: Duration = Duration::from_secs(120);

fn init_mac(k: usize) -> MacAddr {
    MacAddr::local(0x100 + k as u32)
}
fn target_mac(k: usize) -> MacAddr {
    MacAddr::local(0x200 + k as u32)
}

#[derive(Debug, Clone)]
struct Args {
    requests: u64,
    initiator_requests: u64,
    repeats: usize,
    window: u16,
    sides: Vec<Side>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Target,
    Initiator,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Target => "target",
            Side::Initiator => "initiator",
        }
    }
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        requests: 400_000,
        initiator_requests: 200_000,
        repeats: 3,
        window: 64,
        sides: vec![Side::Target, Side::Initiator],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--requests" => a.requests = value()?.parse().map_err(|e| format!("--requests: {e}"))?,
            "--initiator-requests" => {
                a.initiator_requests = value()?.parse().map_err(|e| format!("--initiator-requests: {e}"))?
            }
            "--repeats" => a.repeats = value()?.parse().map_err(|e| format!("--repeats: {e}"))?,
            "--window" => a.window = value()?.parse().map_err(|e| format!("--window: {e}"))?,
            "--only" => {
                a.sides = match value()?.as_str() {
                    "target" => vec![Side::Target],
                    "initiator" => vec![Side::Initiator],
                    other => return Err(format!("--only target|initiator, not {other}")),
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.repeats == 0 || a.requests < 2 || a.initiator_requests < 2 || a.window == 0 {
        return Err("--repeats, --window at least 1, --requests and --initiator-requests at least 2".into());
    }
    Ok(a)
}

/// What one run measured.
#[derive(Debug, Clone, Copy)]
struct Run {
    requests: u64,
    elapsed: Duration,
}

impl Run {
    fn rate(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

/// The CPUs the measured threads are pinned to: CPU 1 alone, or CPUs 0 and 1 (on a machine
/// with one CPU, which only the tests would run on, CPU 0).
fn cpus(channels: usize) -> Vec<Vec<u32>> {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    if channels == 1 {
        vec![vec![1 % n]]
    } else {
        (0..channels as u32).map(|c| vec![c % n]).collect()
    }
}

/// Runs `fut` to completion on this thread.
fn block_on<F: Future>(fut: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime").block_on(fut)
}

/// Polls `fut` once with a waker that does nothing.
fn poll_once<F: Future + ?Sized>(fut: Pin<&mut F>) -> Poll<F::Output> {
    fut.poll(&mut Context::from_waker(Waker::noop()))
}

/// Waits (sleeping) until `done` says the run is over, or a port reports an error or a failed
/// request, or the time limit passes.
fn wait_for(ctls: &[Arc<ReplayControl>], done: impl Fn() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(e) = ctls.iter().find_map(|c| c.error()) {
            return Err(format!("replay could not start: {e}"));
        }
        let failed: u64 = ctls.iter().map(|c| c.failed()).sum();
        if failed > 0 {
            return Err(format!("{failed} request(s) failed or could not be answered"));
        }
        if done() {
            return Ok(());
        }
        if Instant::now() > deadline {
            let progress: Vec<(u64, u64)> = ctls.iter().map(|c| (c.delivered(), c.completed())).collect();
            return Err(format!("no end within {LIMIT:?}: (delivered, completed) per port {progress:?}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn bench_config() -> Config {
    Config {
        exports: vec![ExportConfig::ram("bench", EXPORT)],
        poll: PollMode::Spin,
        network_threads: NetworkThreads::PerNic,
        ..Config::default()
    }
}

fn initiator_config(poll: PollMode) -> Result<InitiatorConfig, String> {
    let mut c = InitiatorConfig::new("bench");
    c.scheduler = SchedulerKind::RoundRobin;
    c.host_id = None;
    c.poll =
        PollConfig::new(poll, tyche_runtime::poll::DEFAULT_BUDGET.as_micros() as u64).map_err(|e| e.to_string())?;
    Ok(c)
}

/// Reads `WARMUP` blocks per channel through the client and checks them.
fn warm_up(client: &Client, channels: usize) -> Result<(), String> {
    block_on(async {
        for i in 0..WARMUP * channels as u64 {
            let data = client.read(i * READ as u64, READ).await.map_err(|e| format!("warm-up read: {e}"))?;
            if data.len() != READ {
                return Err(format!("warm-up read returned {} bytes", data.len()));
            }
        }
        Ok(())
    })
}

/// What every port recorded in the live phase: one more than the highest tag.
fn next_tag(ctls: &[Arc<ReplayControl>]) -> Result<u64, String> {
    if let Some(k) = ctls.iter().position(|c| c.recorded() == 0) {
        return Err(format!("port {k} recorded nothing to replay in the warm-up"));
    }
    Ok(ctls.iter().map(|c| c.recorded_tag()).max().unwrap_or(0) + 1)
}

/// The target's frame handling: `channels` NICs, one network thread each.
fn target_run(channels: usize, requests: u64, window: u16) -> Result<Run, String> {
    let mut nics = Vec::new();
    let mut links = Vec::new();
    let mut ctls = Vec::new();
    for k in 0..channels {
        let (a, mut b) = MemLink::pair((init_mac(k), target_mac(k)), MTU, FRAME, DEPTH);
        b.set_tx_lending(TX_CHUNKS);
        let (port, ctl) = ReplayPort::initiator(b, DEFAULT_ETHERTYPE);
        nics.push(Nic { name: format!("mem{k}"), transport: Box::new(port) });
        links.push(Link { name: format!("mem{k}"), transport: Box::new(a), target: target_mac(k), node: None });
        ctls.push(ctl);
    }
    let placement = Placement { nic_cpus: cpus(channels), ..Placement::default() };
    let target = Target::start_placed(bench_config(), nics, placement).map_err(|e| format!("tyched: {e}"))?;
    let mut cfg = initiator_config(PollMode::Sleep)?;
    cfg.engine_threads = EngineThreads::One;
    let client = connect_blocking(cfg, links).map_err(|e| format!("tyche-init: {e}"))?;
    warm_up(&client, channels)?;
    for c in &ctls {
        c.hold();
    }
    // The real initiator goes away (what it sends now reaches no one), its engine thread too.
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(10);
    while threads().iter().any(|(_, n)| n.starts_with("tyche-engine")) {
        if Instant::now() > deadline {
            return Err("the live initiator's engine thread did not exit".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let first_tag = next_tag(&ctls)?;
    // What the live phase left in the counters (a retransmission of the live initiator's
    // counts as a duplicate): the checks below are about the replay alone.
    let before = target.stats();
    let per = requests / channels as u64;
    let t0 = Instant::now();
    for (p, c) in ctls.iter().enumerate() {
        c.replay(ReplayPlan {
            requests: per,
            window,
            first_tag: first_tag + p as u64,
            tag_stride: channels as u64,
            span: EXPORT,
        });
    }
    let outcome = wait_for(&ctls, || ctls.iter().all(|c| c.finished_at().is_some()));
    let end = ctls.iter().filter_map(|c| c.finished_at()).max();
    let threads = thread_cpus("tyched-net");
    let stats = target.stats();
    target.shutdown();
    outcome?;
    let elapsed = end.expect("finished") - t0;
    // The target executed every request, and dropped nothing.
    let reads = stats.exports[0].requests.read - before.exports[0].requests.read;
    let want = per * channels as u64;
    if reads != want {
        return Err(format!("the target executed {reads} reads, not {want}"));
    }
    let drops = target_drops(&stats) - target_drops(&before);
    if drops > 0 {
        let nics: Vec<_> = stats.nics.iter().map(|n| &n.drops).collect();
        let channels: Vec<_> = stats.channels.iter().map(|c| &c.drops).collect();
        return Err(format!("the target counted {drops} dropped frames: NICs {nics:?}, channels {channels:?}"));
    }
    eprintln!("  target    {channels} ch: {threads}");
    Ok(Run { requests: per * channels as u64, elapsed })
}

/// Every drop the target counted, on its NICs and its channels.
fn target_drops(s: &tyched::Snapshot) -> u64 {
    let nic: u64 = s
        .nics
        .iter()
        .map(|n| {
            let d = &n.drops;
            d.malformed
                + d.unknown_session
                + d.not_ours
                + d.channel.values().sum::<u64>()
                + d.slot_busy
                + d.denied_mac
                + d.denied_key
                + d.shutting_down
        })
        .sum();
    let channel: u64 = s.channels.iter().map(|c| c.drops.values().sum::<u64>()).sum();
    nic + channel
}

/// A read handed to the client, polled by hand.
type PendingRead = Pin<Box<dyn Future<Output = Result<Vec<u8>, tyche_init::Error>>>>;

/// The initiator's frame handling: `channels` links, one engine thread each.
fn initiator_run(channels: usize, requests: u64) -> Result<Run, String> {
    let mut nics = Vec::new();
    let mut links = Vec::new();
    let mut ctls = Vec::new();
    for k in 0..channels {
        let (a, mut b) = MemLink::pair((init_mac(k), target_mac(k)), MTU, FRAME, DEPTH);
        b.set_tx_lending(TX_CHUNKS);
        let (port, ctl) = ReplayPort::target(a, DEFAULT_ETHERTYPE);
        nics.push(Nic { name: format!("mem{k}"), transport: Box::new(b) });
        // A node per link: one engine thread per link (the nodes need not exist; the threads
        // are pinned below by thread id).
        links.push(Link {
            name: format!("mem{k}"),
            transport: Box::new(port),
            target: target_mac(k),
            node: Some(k as u32),
        });
        ctls.push(ctl);
    }
    // The real target for the handshake and the warm-up, on a helper thread that stops before
    // the replay.
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let helper = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut h = match tyched::runtime::Harness::new(bench_config(), nics) {
                Ok(h) => h,
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("tyched: {e}")));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            while !stop.load(Ordering::Acquire) {
                if !h.turn() {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        })
    };
    ready_rx.recv().map_err(|_| "the target helper died".to_owned())??;
    let mut cfg = initiator_config(PollMode::Spin)?;
    cfg.engine_threads = EngineThreads::PerNode;
    let client = connect_blocking(cfg, links).map_err(|e| format!("tyche-init: {e}"));
    let client = match client.and_then(|c| warm_up(&c, channels).map(|()| c)) {
        Ok(c) => c,
        Err(e) => {
            stop.store(true, Ordering::Release);
            let _ = helper.join();
            return Err(e);
        }
    };
    stop.store(true, Ordering::Release);
    helper.join().map_err(|_| "the target helper panicked".to_owned())?;
    for c in &ctls {
        c.hold();
    }
    next_tag(&ctls)?;
    let names: Vec<String> = if channels == 1 {
        vec!["tyche-engine".into()]
    } else {
        (0..channels).map(|k| format!("tyche-engine{k}")).collect()
    };
    for (name, cpus) in names.iter().zip(cpus(channels)) {
        pin_thread(name, &cpus)?;
    }
    // Every request is handed over before the clock starts: the engine sends what its slots
    // allow and the rest waits in its backlog.
    let mut reads: Vec<PendingRead> = (0..requests)
        .map(|i| {
            let offset = (i * READ as u64) % EXPORT;
            let c = client.clone();
            Box::pin(async move { c.read(offset, READ).await }) as PendingRead
        })
        .collect();
    for r in reads.iter_mut() {
        if poll_once(r.as_mut()).is_ready() {
            return Err("a read completed before the replay started".into());
        }
    }
    let t0 = Instant::now();
    for c in &ctls {
        c.replay(ReplayPlan { requests, window: 1, first_tag: 0, tag_stride: 1, span: EXPORT });
    }
    let outcome = wait_for(&ctls, || ctls.iter().map(|c| c.completed()).sum::<u64>() >= requests).map_err(|e| {
        // What the initiator saw, for a run that did not end.
        let stats = block_on(client.stats()).map_or_else(|e| e.to_string(), |s| format!("{s:?}"));
        format!("{e}; initiator: {stats}")
    });
    let end = ctls.iter().filter_map(|c| c.finished_at()).max();
    let threads = thread_cpus("tyche-engine");
    let mut ok = 0u64;
    let mut failed = 0u64;
    for r in reads.iter_mut() {
        match poll_once(r.as_mut()) {
            Poll::Ready(Ok(data)) if data.len() == READ => ok += 1,
            _ => failed += 1,
        }
    }
    drop(reads);
    drop(client);
    outcome?;
    if failed > 0 {
        return Err(format!("{failed} of {requests} reads did not complete with their data"));
    }
    eprintln!("  initiator {channels} ch: {threads}");
    let elapsed = end.ok_or("no end time")? - t0;
    Ok(Run { requests: ok, elapsed })
}

/// Threads of this process whose name starts with `prefix`, with the CPUs each may run on.
fn thread_cpus(prefix: &str) -> String {
    let mut out = Vec::new();
    for (tid, name) in threads() {
        if name.starts_with(prefix) {
            let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap_or_default();
            let allowed = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(str::trim)
                .unwrap_or("?")
                .to_owned();
            out.push(format!("{name} on CPU {allowed}"));
        }
    }
    out.sort();
    out.join(", ")
}

/// (thread id, name) of every thread of this process.
fn threads() -> Vec<(i32, String)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    dir.filter_map(|e| {
        let tid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
        Some((tid, name.trim().to_owned()))
    })
    .collect()
}

/// Pins the thread named `name` (exactly one must exist) to `cpus`.
fn pin_thread(name: &str, cpus: &[u32]) -> Result<(), String> {
    let found: Vec<i32> = threads().into_iter().filter(|(_, n)| n == name).map(|(t, _)| t).collect();
    let [tid] = found[..] else { return Err(format!("{} threads named {name}", found.len())) };
    // SAFETY: `set` is a plain bit set that CPU_ZERO/CPU_SET initialise in place, and
    // sched_setaffinity only reads `size_of::<cpu_set_t>()` bytes of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &c in cpus {
            libc::CPU_SET(c as usize, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(format!("cannot pin {name} to {cpus:?}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("scale: {e}");
            std::process::exit(2);
        }
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("scale: needs 2 CPUs (0 and 1), this machine has {cores}");
        std::process::exit(2);
    }
    println!(
        "scale: 4 KiB reads over in-memory links (MTU {MTU}), target {} requests (window {} per channel), initiator {} requests, {} rounds",
        args.requests, args.window, args.initiator_requests, args.repeats
    );
    // rates[side][channels - 1]
    let mut rates: Vec<[Vec<f64>; 2]> = args.sides.iter().map(|_| [Vec::new(), Vec::new()]).collect();
    for round in 0..args.repeats {
        // Alternate the order: 1 then 2 channels, then 2 then 1.
        let order = if round % 2 == 0 { [1, 2] } else { [2, 1] };
        for (s, side) in args.sides.iter().enumerate() {
            for channels in order {
                let run = match side {
                    Side::Target => target_run(channels, args.requests, args.window),
                    Side::Initiator => initiator_run(channels, args.initiator_requests),
                };
                match run {
                    Ok(r) => {
                        println!(
                            "round {round} {:<9} {channels} channel(s): {:>9} requests in {:>7.1} ms = {:>9.0} req/s",
                            side.name(),
                            r.requests,
                            r.elapsed.as_secs_f64() * 1e3,
                            r.rate()
                        );
                        rates[s][channels - 1].push(r.rate());
                    }
                    Err(e) => {
                        eprintln!("scale: {} with {channels} channel(s): {e}", side.name());
                        std::process::exit(1);
                    }
                }
            }
        }
    }
    println!();
    println!("| side | channels (threads) | runs | min req/s | median req/s | max req/s |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut ratio = Vec::new();
    for (s, side) in args.sides.iter().enumerate() {
        for (c, v) in rates[s].iter().enumerate() {
            let min = v.iter().copied().fold(f64::INFINITY, f64::min);
            let max = v.iter().copied().fold(0.0, f64::max);
            println!("| {} | {} | {} | {:.0} | {:.0} | {:.0} |", side.name(), c + 1, v.len(), min, median(v), max);
        }
        ratio.push((*side, median(&rates[s][1]) / median(&rates[s][0])));
    }
    println!();
    let r = |side: Side| ratio.iter().find(|(s, _)| *s == side).map_or("-".to_owned(), |(_, r)| format!("{r:.2}"));
    println!("scale: target 2x={}x initiator 2x={}x", r(Side::Target), r(Side::Initiator));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs find their threads by name in this process: one run at a time.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The replayed requests are accepted: the target executes every one (the run checks its
    /// read counter) and counts no drop, with 1 and 2 channels.
    #[test]
    fn target_accepts_the_replayed_requests() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for channels in [1, 2] {
            let run = target_run(channels, 2_000, 16).unwrap_or_else(|e| panic!("{channels} channel(s): {e}"));
            assert_eq!(run.requests, 2_000);
        }
    }

    /// The replayed responses are accepted: every read handed to the initiator completes with
    /// its data, with 1 and 2 channels.
    #[test]
    fn initiator_accepts_the_replayed_responses() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for channels in [1, 2] {
            let run = initiator_run(channels, 2_000).unwrap_or_else(|e| panic!("{channels} channel(s): {e}"));
            assert_eq!(run.requests, 2_000);
        }
    }
}
