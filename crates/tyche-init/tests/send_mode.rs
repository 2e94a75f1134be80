//! Inline against queue send mode, side by side: a measurement, not a check (ignored; run by
//! `cargo xtask bench send-mode`, or `cargo test --release -p tyche-init --test send_mode --
//! --ignored --nocapture`).
//!
//! The library client against the in-process RAM target over two in-memory links (one channel
//! each): 4 KiB random reads at queue depth 1 and 32, each mode in turn (inline, queue, inline,
//! ...) for `TYCHE_BENCH_REPEATS` rounds (default 3) of `TYCHE_BENCH_SECS` seconds (default 2).
//! Then, where fio with its nbd engine is installed, the same through the NBD server
//! (`nbd::serve_unix`, connections served by the engine threads): fio 4 KiB random reads at
//! iodepth 1 and 32, one connection, the modes alternating the same way.
//! Prints a table (IOPS and p50 latency of every run, min/median/max of the IOPS per mode), a
//! line `send-mode nbd: inline/queue qd1=<r>x qd32=<r>x` for the NBD runs, and a last line
//! `send-mode: inline/queue qd1=<r>x qd32=<r>x` (ratios of the median IOPS, library client).

use std::process::Command;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tyche_init::loopback::{initiator_timers, mem_links, RamExport};
use tyche_init::{connect, InitiatorConfig, SendMode};

const MIB: u64 = 1 << 20;
/// Export size: reads land anywhere in it.
const EXPORT: u64 = 256 * MIB;
/// Request size.
const BLOCK: usize = 4096;
/// Latencies kept per run (a sample of the rest past it).
const MAX_SAMPLES: usize = 1 << 20;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One run: IOPS and the median latency in microseconds.
async fn run(mode: SendMode, qd: usize, secs: u64) -> (f64, f64) {
    let (links, _sw, _target) = mem_links(RamExport::new("ram", EXPORT), 2).expect("the in-process target starts");
    let mut cfg = InitiatorConfig::new("ram");
    cfg.timers = initiator_timers();
    cfg.send_mode = mode;
    let client = connect(cfg, links).await.expect("connect");
    // Warm up: the first reads allocate the target's pages and the buffers.
    for i in 0..256u64 {
        client.read(i * BLOCK as u64, BLOCK).await.expect("warm-up read");
    }
    let end = Instant::now() + Duration::from_secs(secs);
    let t0 = Instant::now();
    let mut set = JoinSet::new();
    for task in 0..qd as u64 {
        let c = client.clone();
        set.spawn(async move {
            let mut x = (task + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut lat = Vec::with_capacity(1 << 16);
            let mut n = 0u64;
            while Instant::now() < end {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x % (EXPORT / BLOCK as u64)) * BLOCK as u64;
                let t = Instant::now();
                c.read(at, BLOCK).await.expect("read");
                if lat.len() < MAX_SAMPLES / qd {
                    lat.push(t.elapsed().as_nanos() as u64);
                }
                n += 1;
            }
            (n, lat)
        });
    }
    let mut total = 0u64;
    let mut lat = Vec::new();
    while let Some(r) = set.join_next().await {
        let (n, l) = r.expect("reader task");
        total += n;
        lat.extend(l);
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let s = client.stats().await.expect("stats");
    match mode {
        SendMode::Inline => assert_eq!(s.handed_over, 0, "{s:?}"),
        SendMode::Queue => assert_eq!(s.sent_inline, 0, "{s:?}"),
    }
    client.close().await;
    lat.sort_unstable();
    let p50 = lat.get(lat.len() / 2).copied().unwrap_or(0) as f64 / 1000.0;
    (total as f64 / elapsed, p50)
}

/// One fio run through the NBD server: IOPS and the median completion latency in microseconds;
/// `None` when fio (with its nbd engine) is missing.
async fn run_nbd(mode: SendMode, qd: usize, secs: u64) -> Option<(f64, f64)> {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nbd.sock");
    let (links, _sw, _target) = mem_links(RamExport::new("ram", EXPORT), 2).expect("the in-process target starts");
    let mut cfg = InitiatorConfig::new("ram");
    cfg.timers = initiator_timers();
    cfg.send_mode = mode;
    let client = connect(cfg, links).await.expect("connect");
    let (s, c) = (socket.clone(), client.clone());
    let server =
        tokio::spawn(async move { tyche_init::nbd::serve_unix(&s, c, tyche_init::nbd::NbdOptions::new("ram")).await });
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let uri = format!("nbd+unix:///ram?socket={}", socket.display());
    let out = tokio::task::spawn_blocking(move || {
        Command::new("fio")
            .args(["--name=randread", "--ioengine=nbd", "--rw=randread", "--bs=4k", "--time_based"])
            .args(["--size=256M", "--output-format=json", "--randrepeat=0"])
            .arg(format!("--runtime={secs}"))
            .arg(format!("--iodepth={qd}"))
            .arg(format!("--uri={uri}"))
            .output()
    })
    .await
    .expect("fio thread");
    server.abort();
    let s = client.stats().await.expect("stats");
    client.close().await;
    let out = out.ok().filter(|o| o.status.success())?;
    match mode {
        SendMode::Inline => assert_eq!(s.handed_over, 0, "{s:?}"),
        SendMode::Queue => assert_eq!(s.sent_inline, 0, "{s:?}"),
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(&text[text.find('{')?..]).ok()?;
    let read = &json["jobs"][0]["read"];
    let iops = read["iops"].as_f64()?;
    let p50 = read["clat_ns"]["percentile"]["50.000000"].as_f64().unwrap_or(0.0) / 1000.0;
    Some((iops, p50))
}

/// One summary line of the table: IOPS min/median/max and the median p50 over the runs.
fn summary_row(label: &str, mode: SendMode, iops: &[f64], p50: &[f64]) -> String {
    let mut v = iops.to_vec();
    v.sort_by(f64::total_cmp);
    format!(
        "| {label} | {mode} | IOPS min/median/max {:.0}/{:.0}/{:.0} | p50 µs (median of runs) {:.1} |",
        v[0],
        median(&v),
        v[v.len() - 1],
        median(p50)
    )
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check"]
async fn bench_send_mode() {
    let repeats = env_or("TYCHE_BENCH_REPEATS", 3).max(1) as usize;
    let secs = env_or("TYCHE_BENCH_SECS", 2).max(1);
    let modes = [SendMode::Inline, SendMode::Queue];
    let mut ratios = Vec::new();
    println!("| QD | mode | run | IOPS | p50 µs |");
    println!("| --- | --- | --- | --- | --- |");
    let mut summary = Vec::new();
    for qd in [1usize, 32] {
        let mut iops: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut p50: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for r in 0..repeats {
            // Alternating, so that a slow phase of the machine hits both modes.
            for (m, mode) in modes.iter().enumerate() {
                let (i, p) = run(*mode, qd, secs).await;
                println!("| {qd} | {mode} | {} | {i:.0} | {p:.1} |", r + 1);
                iops[m].push(i);
                p50[m].push(p);
            }
        }
        for (m, mode) in modes.iter().enumerate() {
            summary.push(summary_row(&qd.to_string(), *mode, &iops[m], &p50[m]));
        }
        ratios.push(median(&iops[0]) / median(&iops[1]));
    }
    // Through the NBD server, where fio can reach it.
    let mut nbd_ratios = Vec::new();
    'nbd: for qd in [1usize, 32] {
        let mut iops: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut p50: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for r in 0..repeats {
            for (m, mode) in modes.iter().enumerate() {
                let Some((i, p)) = run_nbd(*mode, qd, secs).await else {
                    println!("(no NBD runs: fio with its nbd engine is not installed)");
                    break 'nbd;
                };
                println!("| NBD {qd} | {mode} | {} | {i:.0} | {p:.1} |", r + 1);
                iops[m].push(i);
                p50[m].push(p);
            }
        }
        for (m, mode) in modes.iter().enumerate() {
            summary.push(summary_row(&format!("NBD {qd}"), *mode, &iops[m], &p50[m]));
        }
        nbd_ratios.push(median(&iops[0]) / median(&iops[1]));
    }
    println!();
    println!("| QD | mode | IOPS | p50 |");
    println!("| --- | --- | --- | --- |");
    for s in summary {
        println!("{s}");
    }
    println!();
    if let [qd1, qd32] = nbd_ratios[..] {
        println!("send-mode nbd: inline/queue qd1={qd1:.2}x qd32={qd32:.2}x");
    }
    println!("send-mode: inline/queue qd1={:.2}x qd32={:.2}x", ratios[0], ratios[1]);
}
