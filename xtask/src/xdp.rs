//! `cargo xtask xdp-smoke` and `cargo xtask bench xdp`: AF_XDP over the veth lab.
//!
//! Both build the workspace in release mode, create a uniquely named lab (deleted by its guard
//! even on failure), and run `tyche-xdp-peer` inside each namespace with `ip netns exec`. Every
//! wait is bounded.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::lab::{Lab, Pair};

#[derive(Debug, clap::Args)]
pub struct SmokeArgs {
    /// Veth pairs.
    #[arg(long, default_value_t = 2)]
    nics: u32,
    /// MTU of the lab.
    #[arg(long, default_value_t = 3000)]
    mtu: u32,
    /// Tyche frames each way, spread over the NICs.
    #[arg(long, default_value_t = 100_000)]
    frames: u64,
    /// XDP attach mode: auto (native, else skb), native or skb.
    #[arg(long, default_value = "auto")]
    mode: String,
    /// Seconds before the peers give up.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

impl SmokeArgs {
    /// The smoke run: 2 NICs at MTU 3000, 100,000 frames each way, native mode first.
    pub fn standard() -> SmokeArgs {
        SmokeArgs { nics: 2, mtu: 3000, frames: 100_000, mode: "auto".into(), timeout: 120 }
    }
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// MTU of the veth pair.
    #[arg(long, default_value_t = 3000)]
    mtu: u32,
    /// Tyche frames per AF_XDP run.
    #[arg(long, default_value_t = 1_000_000)]
    frames: u64,
    /// Runs of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 5)]
    iperf_secs: u64,
    /// Unacknowledged frames the sender may have in flight.
    #[arg(long, default_value_t = 1536)]
    window: u64,
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Where cargo puts build outputs (`CARGO_TARGET_DIR`, relative to the workspace root, or `target/`).
pub fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(|d| root.join(d)).unwrap_or_else(|| root.join("target"))
}

/// Builds every release binary and library of the workspace but xtask, with the whole
/// workspace's features: the one release build the suite's steps share (a build of some
/// packages alone unifies their dependencies' features differently and rebuilds them).
pub fn build(root: &Path) -> Result<PathBuf> {
    // Not xtask itself: built with the whole workspace's features it is a different binary from
    // the `cargo xtask` one, and replacing the running binary leaves `current_exe()` pointing at
    // a deleted file (which `cargo xtask test` then fails to copy into the VM of vm-test).
    let status = Command::new(cargo())
        .current_dir(root)
        .args(["build", "--release", "--workspace", "--exclude", "xtask", "--bins", "--lib"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build --release --workspace failed");
    }
    let peer = target_dir(root).join("release/tyche-xdp-peer");
    if !peer.exists() {
        bail!("{} was not built", peer.display());
    }
    Ok(peer)
}

/// A peer process inside a namespace, its stdout lines arriving on a channel.
struct Peer {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Peer {
    fn spawn(name: &str, ns: &str, peer: &Path, args: &[String]) -> Result<Peer> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(peer)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting peer {name} in {ns}"))?;
        let stdout = child.stdout.take().expect("piped");
        let stdin = child.stdin.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Peer { name: name.to_string(), child, stdin, lines: rx, seen: Vec::new() })
    }

    /// Waits for a line starting with `prefix`.
    fn wait_for(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.starts_with(prefix) {
                        return Ok(line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    bail!("peer {}: no {prefix} within {timeout:?}", self.name)
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("peer {} exited before {prefix}", self.name)
                }
            }
        }
    }

    fn go(&mut self) -> Result<()> {
        let mut stdin = self.stdin.take().context("GO sent twice")?;
        writeln!(stdin, "GO").with_context(|| format!("sending GO to {}", self.name))?;
        Ok(())
    }

    /// Waits for the process to exit and returns its RESULT lines.
    fn finish(mut self, timeout: Duration) -> Result<Vec<String>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                // Collect what is left of its output.
                while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(line);
                }
                if !status.success() {
                    bail!("peer {} failed: {status}", self.name);
                }
                return Ok(std::mem::take(&mut self.seen).into_iter().filter(|l| l.starts_with("RESULT")).collect());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("peer {} did not finish within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `key=value` from a RESULT line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn num(line: &str, key: &str) -> Result<f64> {
    field(line, key)
        .with_context(|| format!("{key} missing in {line:?}"))?
        .parse()
        .with_context(|| format!("{key} not a number in {line:?}"))
}

fn links(pairs: &[Pair], target_side: bool) -> Vec<String> {
    let mut v = Vec::new();
    for p in pairs {
        v.push("--link".into());
        v.push(if target_side {
            format!("{}={}", p.target_if, p.initiator_mac)
        } else {
            format!("{}={}", p.initiator_if, p.target_mac)
        });
    }
    v
}

fn unique(tag: &str) -> (String, String) {
    let id = std::process::id();
    (format!("tyche-{tag}-t-{id}"), format!("tyche-{tag}-i-{id}"))
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

pub fn smoke(root: &Path, args: &SmokeArgs) -> Result<()> {
    let peer_bin = build(root)?;
    let (t_ns, i_ns) = unique("smoke");
    let lab = Lab::create(&t_ns, &i_ns, args.nics, args.mtu)?;
    let per_link = args.frames / u64::from(args.nics);
    let timeout = Duration::from_secs(args.timeout);
    let common = |target: bool| {
        let mut a = links(&lab.pairs, target);
        a.extend(strs(&[
            "--frames",
            &per_link.to_string(),
            "--expect",
            &per_link.to_string(),
            "--mode",
            &args.mode,
            "--timeout",
            &args.timeout.to_string(),
        ]));
        a
    };
    let mut target = Peer::spawn("target", &t_ns, &peer_bin, &common(true))?;
    let mut initiator = Peer::spawn("initiator", &i_ns, &peer_bin, &common(false))?;
    target.wait_for("ALL-READY", Duration::from_secs(30))?;
    initiator.wait_for("ALL-READY", Duration::from_secs(30))?;
    target.go()?;
    initiator.go()?;
    // IP across the same veth pairs while Tyche frames flow.
    let mut pings = Vec::new();
    for p in &lab.pairs {
        pings.push(
            Command::new("ip")
                .args(["netns", "exec", &i_ns, "ping", "-q", "-c", "20", "-i", "0.05", "-W", "2"])
                .arg(&p.target_ip)
                .stdout(Stdio::null())
                .spawn()
                .context("starting ping")?,
        );
    }
    let t_results = target.finish(timeout + Duration::from_secs(10))?;
    let i_results = initiator.finish(timeout + Duration::from_secs(10))?;
    let mut ip_ok = true;
    for mut ping in pings {
        ip_ok &= ping.wait().context("waiting for ping")?.success();
    }
    // And once more after the run, to show the links were left working.
    for p in &lab.pairs {
        ip_ok &= Command::new("ip")
            .args(["netns", "exec", &i_ns, "ping", "-q", "-c", "2", "-i", "0.2", "-W", "2"])
            .arg(&p.target_ip)
            .stdout(Stdio::null())
            .status()
            .context("running ping")?
            .success();
    }
    drop(lab);
    let mut sent = 0.0;
    let mut received = 0.0;
    let mut skb = false;
    for r in t_results.iter().chain(&i_results) {
        println!("{r}");
        sent += num(r, "sent")?;
        received += num(r, "received")?;
        skb |= field(r, "mode") == Some("skb");
    }
    if t_results.len() + i_results.len() != 2 * args.nics as usize {
        bail!("expected a RESULT per link and side");
    }
    let lost = sent - received;
    println!(
        "xdp-smoke: {} nics, {} frames, {} lost, ip {}, mode {}",
        args.nics,
        sent as u64,
        lost as i64,
        if ip_ok { "ok" } else { "FAILED" },
        if skb { "skb" } else { "native" }
    );
    if lost != 0.0 || !ip_ok {
        bail!("xdp-smoke failed");
    }
    Ok(())
}

/// One run one way over pair 0, AF_XDP or (with `tcp`) the same frames over `tyche-tcp`:
/// (frames/s, frame bytes/s, frame length).
fn xdp_run(peer_bin: &Path, lab: &Lab, args: &BenchArgs, tcp: bool) -> Result<(f64, f64, f64)> {
    let n = args.frames.to_string();
    let w = args.window.to_string();
    let mut tx_args = links(&lab.pairs, true);
    tx_args.extend(strs(&["--frames", &n, "--expect", "0", "--window", &w, "--timeout", "60"]));
    let mut rx_args = links(&lab.pairs, false);
    rx_args.extend(strs(&["--frames", "0", "--expect", &n, "--window", &w, "--timeout", "60"]));
    if tcp {
        let addr = format!("{}:7400", lab.pairs[0].initiator_ip);
        rx_args.extend(strs(&["--tcp-listen", &addr]));
        tx_args.extend(strs(&["--tcp-connect", &addr]));
    }
    let mut rx = Peer::spawn("receiver", &lab.initiator_ns, peer_bin, &rx_args)?;
    let mut tx = Peer::spawn("sender", &lab.target_ns, peer_bin, &tx_args)?;
    rx.wait_for("ALL-READY", Duration::from_secs(30))?;
    tx.wait_for("ALL-READY", Duration::from_secs(30))?;
    rx.go()?;
    tx.go()?;
    let r = rx.finish(Duration::from_secs(90))?;
    tx.finish(Duration::from_secs(90))?;
    let line = r.first().context("no RESULT from the receiver")?;
    let received = num(line, "received")?;
    let bytes = num(line, "rx_bytes")?;
    let secs = num(line, "rx_secs")?;
    if received < args.frames as f64 {
        eprintln!("bench: receiver got {received} of {} frames", args.frames);
    }
    if secs <= 0.0 {
        bail!("receiver measured no time");
    }
    Ok((received / secs, bytes / secs, bytes / received))
}

/// One iperf3 TCP run from the target side to the initiator side of pair 0: bytes/s.
fn iperf_run(lab: &Lab, secs: u64) -> Result<f64> {
    let p = &lab.pairs[0];
    let mut server = Command::new("ip")
        .args(["netns", "exec", &lab.initiator_ns, "iperf3", "-s", "-1", "-B"])
        .arg(&p.initiator_ip)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s (is iperf3 installed?)")?;
    std::thread::sleep(Duration::from_millis(500));
    let out = Command::new("timeout")
        .arg((secs + 20).to_string())
        .args(["ip", "netns", "exec", &lab.target_ns, "iperf3", "-J", "-c"])
        .arg(&p.initiator_ip)
        .args(["-t", &secs.to_string()])
        .output()
        .context("running iperf3 -c")?;
    let _ = server.kill();
    let _ = server.wait();
    let json = String::from_utf8_lossy(&out.stdout);
    let at = json.find("\"sum_received\"").context("iperf3 gave no sum_received")?;
    let rest = &json[at..];
    let k = rest.find("\"bits_per_second\":").context("no bits_per_second")? + 18;
    let v: f64 = rest[k..]
        .trim_start()
        .split(|c: char| c == ',' || c.is_whitespace() || c == '}')
        .next()
        .unwrap_or("")
        .parse()
        .context("bits_per_second")?;
    Ok(v / 8.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn sh(cmd: &str) -> String {
    Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

pub fn bench(root: &Path, args: &BenchArgs) -> Result<()> {
    let peer_bin = build(root)?;
    let (t_ns, i_ns) = unique("bench");
    let lab = Lab::create(&t_ns, &i_ns, 1, args.mtu)?;
    let runs = args.runs.max(1);

    // Interleaved, so that load from elsewhere on the machine hits all three alike.
    let mut tcp_plain = Vec::new();
    let mut xdp = Vec::new();
    let mut tsockets = Vec::new();
    let mut tcp_xdp = Vec::new();
    let mut frame_len = 0.0;
    for run in 0..runs {
        eprintln!("bench: run {}/{runs}", run + 1);
        tcp_plain.push(iperf_run(&lab, args.iperf_secs)?);
        let (fps, bps, len) = xdp_run(&peer_bin, &lab, args, false)?;
        frame_len = len;
        xdp.push((fps, bps));
        let (fps, bps, _) = xdp_run(&peer_bin, &lab, args, true)?;
        tsockets.push((fps, bps));
        // TCP again with the steering program attached on both ends, as when Tyche shares the
        // link.
        let hold = (args.iperf_secs + 4).to_string();
        let mut holders = Vec::new();
        for (name, ns, target) in [("t", &lab.target_ns, true), ("i", &lab.initiator_ns, false)] {
            let mut a = links(&lab.pairs, target);
            a.extend(strs(&["--frames", "0", "--expect", "1", "--timeout", &hold]));
            let mut p = Peer::spawn(name, ns, &peer_bin, &a)?;
            p.wait_for("ALL-READY", Duration::from_secs(30))?;
            p.go()?;
            holders.push(p);
        }
        tcp_xdp.push(iperf_run(&lab, args.iperf_secs)?);
        for h in holders {
            h.finish(Duration::from_secs(30))?;
        }
    }
    drop(lab);

    let fps = median(xdp.iter().map(|x| x.0).collect());
    let bps = median(xdp.iter().map(|x| x.1).collect());
    let payload_bps = bps * (frame_len - 62.0) / frame_len;
    let ts_fps = median(tsockets.iter().map(|x| x.0).collect());
    let ts_bps = median(tsockets.iter().map(|x| x.1).collect());
    let ts_payload = ts_bps * (frame_len - 62.0) / frame_len;
    let tcp_p = median(tcp_plain);
    let tcp_x = median(tcp_xdp);
    let gb = |b: f64| b / 1e9;
    println!();
    println!(
        "xdp bench: {} (kernel {}, {} CPUs, {}), veth MTU {}, one way, median of {runs}",
        sh("date -u +%Y-%m-%dT%H:%MZ"),
        sh("uname -r"),
        sh("nproc"),
        sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"),
        args.mtu
    );
    println!();
    println!("| Transport | Frames/s | GB/s (frames) | GB/s (payload) | AF_XDP payload rate vs this |");
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| AF_XDP (tyche-xdp), raw Tyche DATA frames ({frame_len:.0} B, {} B payload) | {:.0} | {:.3} | {:.3} | 1.00x |",
        frame_len as u64 - 62,
        fps,
        gb(bps),
        gb(payload_bps),
    );
    println!(
        "| Same frames over TCP (tyche-tcp, TSockets baseline) | {:.0} | {:.3} | {:.3} | {:.2}x |",
        ts_fps,
        gb(ts_bps),
        gb(ts_payload),
        payload_bps / ts_payload
    );
    println!("| iperf3 TCP, veth without XDP | - | - | {:.3} | {:.2}x |", gb(tcp_p), payload_bps / tcp_p);
    println!("| iperf3 TCP, steering program attached | - | - | {:.3} | {:.2}x |", gb(tcp_x), payload_bps / tcp_x);
    println!();
    println!(
        "ratio: AF_XDP / iperf3 TCP = {:.2}x (veth without XDP), {:.2}x (steering program attached); AF_XDP / tyche-tcp = {:.2}x",
        payload_bps / tcp_p,
        payload_bps / tcp_x,
        payload_bps / ts_payload
    );
    Ok(())
}
