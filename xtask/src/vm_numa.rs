//! Test 2 of `cargo xtask vm-test`, run inside the VM (as root) by `xtask vm-guest numa`: NUMA
//! placement on a real two-node topology.
//!
//! The VM has two NUMA nodes and four virtio-net NICs, two on a PCI expander bridge of each
//! node, with fixed MACs `52:54:00:74:0N:0S` (N: node, S: 1 target side, 2 initiator side); the
//! two NICs of a node are joined by a qemu hub. This test:
//!
//! 1. finds the NICs by MAC and moves the target-side ones into namespace `tgt`, the
//!    initiator-side ones into `ini`;
//! 2. checks that hwloc (`tyched topology --json`, in each namespace) puts each NIC on its node;
//!    then, with consumers on every CPU of node 1, that the I/O bandwidth model decides where
//!    the node-1 NIC's channel thread goes (`--model-file`, a given model, since TCG's memory
//!    has no NUMA bandwidth to measure): to node 0 when node 0 is in class 1 for node 1's
//!    NICs, memory staying on node 1; on node 1, sharing a core, when node 0 is in class 2;
//!    and that the NESUS paper's *Worst* case can be set up by options (`tyched
//!    --network-thread-node 0 --channel-memory-node 0`, `tyche-init --engine-thread-node 0
//!    --channel-memory-node 0`: on both sides the node-1 NIC's thread on node 0's CPUs, its
//!    UMEM and rings on node 0);
//! 3. for each scheduler (`affinity`, then `round-robin`): starts `tyched` (a file export on the
//!    guest's tmpfs, io_uring, AF_XDP on both NICs) and `tyche-init serve-nbd` (AF_XDP on both NICs, every NBD connection served
//!    for node 1: `--nbd-nodes 1`), writes [`WORKLOAD`] bytes through one NBD connection from
//!    this process, reads them back and compares, and reads both daemons' stats;
//! 4. checks, from the stats (page by page with `move_pages(2)`, affinities as the threads see
//!    themselves):
//!    - every channel's UMEM, rings and slot memory on its NIC's node, on both daemons;
//!    - the NBD connection's thread on node 1's CPUs and its request buffers on node 1;
//!    - with `affinity`, at least [`AFFINITY_SHARE`] of the payload bytes on the node-1
//!      channel (initiator and target); with `round-robin`, each channel within
//!      [`RR_SPREAD`] of half;
//!    - no payload byte copied in user space on the target (`payload_copied_bytes` 0);
//!    - each of `tyched`'s per-NIC network threads, and each of `tyche-init`'s per-node engine
//!      threads, on its NIC's node's CPUs;
//!    - the initiator's channel fallback order by the I/O bandwidth model (Li et al.);
//!    - the paper's inline send mode: every request posted by the thread that read it from the
//!      NBD socket (on node 1), none handed over;
//!    - each target NIC's interrupts read from the VM's sysfs and procfs; in the `affinity` run,
//!      `tyched --irq-affinity auto` has put every one of them on its NIC's node and none on its
//!      network thread's core (Hanford et al., FGCS 2015);
//!    - `tyched`'s storage threads (completion placement, the NESUS 2015 paper): a worker on every CPU where
//!      the placement plan (`tyched topology --json`) puts a completion worker, each pinned there
//!      and on no other CPU, an io_uring thread per node on one of them, and the storage jobs
//!      counted per node where the channels that carried them are: with `affinity` none of the
//!      data requests on node 0, with `round-robin` each node's share of the jobs within
//!      [`RR_SPREAD`] of its share of the payload.
//!
//! Prints each step and the per-channel byte counts, prefixed `vm-numa:`.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::lab::{delete_ns, ip};
use crate::stack::{wait_for, Daemon};

/// Namespace of the target side.
const TGT: &str = "tgt";
/// Namespace of the initiator side.
const INI: &str = "ini";
/// Bytes written and read back per scheduler run (in 1 MiB requests, one at a time).
const WORKLOAD: usize = 16 << 20;
/// NBD request size.
const REQUEST: usize = 1 << 20;
/// Export size.
const EXPORT_MIB: usize = 64;
/// Share of the payload bytes the node-1 channel must carry with the affinity scheduler. The
/// workload runs one request at a time, so the node-1 channel is never full and the scheduler
/// never has a reason to fall back to node 0: anything on node 0 would be a bug. 99% leaves
/// room only for payload counted twice by retransmissions on a lossy hub, not for fallbacks
/// (one 1 MiB request on node 0 would be 3% of the 32 MiB moved).
const AFFINITY_SHARE: f64 = 0.99;
/// With round robin each channel carries half the bytes, give or take this (1 MiB requests
/// alternate exactly; the slack covers retransmissions).
const RR_SPREAD: f64 = 0.15;
/// Work directory in the guest (the VM's `/init` prints `/tmp/*/*.log` when a test fails).
const WORK: &str = "/tmp/tyche-numa";

/// One NIC of the VM.
#[derive(Debug, Clone)]
struct VmNic {
    name: String,
    mac: String,
    node: u32,
}

/// The binary `name`: from `TYCHE_BIN_DIR`, the release build (`stack::bin`, which the VM's
/// `CARGO_TARGET_DIR=/tyche` points at), next to this executable, or on `PATH`.
fn guest_bin(name: &str) -> PathBuf {
    if let Some(d) = std::env::var_os("TYCHE_BIN_DIR") {
        return Path::new(&d).join(name);
    }
    let release = crate::stack::bin(&crate::root(), name);
    if release.exists() {
        return release;
    }
    if let Some(p) = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join(name))) {
        if p.exists() {
            return p;
        }
    }
    PathBuf::from(name)
}

/// Whether this is a trial of the plumbing on a machine that is not the VM
/// (`VM_NUMA_TRIAL=1`): failed NUMA checks are printed and the run goes on.
fn trial() -> bool {
    std::env::var_os("VM_NUMA_TRIAL").is_some()
}

/// `ensure!` for the NUMA checks: in a trial, says what would fail and goes on.
macro_rules! check {
    ($cond:expr, $($arg:tt)+) => {
        let ok: bool = $cond;
        if !ok {
            if trial() {
                say(format!("trial: would fail: {}", format!($($arg)+)));
            } else {
                anyhow::bail!($($arg)+);
            }
        }
    };
}

fn say(msg: impl AsRef<str>) {
    println!("vm-numa: {}", msg.as_ref());
}

/// The interfaces of the root namespace by MAC.
fn nics_by_mac() -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir("/sys/class/net").context("listing /sys/class/net")? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Ok(mac) = fs::read_to_string(e.path().join("address")) {
            out.insert(mac.trim().to_lowercase(), name);
        }
    }
    Ok(out)
}

/// Runs `cmd` in namespace `ns` and returns its stdout.
fn in_ns(ns: &str, cmd: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(cmd)
        .args(args)
        .env("TYCHE_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} in {ns}", cmd.display()))?;
    ensure!(
        out.status.success(),
        "{} {} in {ns}: {}",
        cmd.display(),
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn json(text: &str, what: &str) -> Result<Value> {
    serde_json::from_str(text).with_context(|| format!("{what} is not JSON: {text}"))
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

/// The CPUs of a thread report (`thread.cpus`).
fn thread_cpus(thread: &Value) -> Vec<u64> {
    thread["cpus"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

/// Checks that the reported `thread` runs on node `node`'s CPUs only; returns its CPUs.
fn thread_on_node(thread: &Value, what: &str, node: u32, cpus: &[Vec<u64>; 2]) -> Result<Vec<u64>> {
    let tc = thread_cpus(thread);
    let mine = &cpus[node as usize];
    check!(
        !tc.is_empty() && tc.iter().all(|c| mine.contains(c)),
        "{what} {} runs on cpus {tc:?}, not only node {node}'s {mine:?}",
        thread["name"]
    );
    Ok(tc)
}

fn node_of(v: &Value) -> Option<u32> {
    v.as_u64().map(|n| n as u32)
}

/// CPUs of node `n` from sysfs.
fn node_cpus(n: u32) -> Result<Vec<u64>> {
    let text = fs::read_to_string(format!("/sys/devices/system/node/node{n}/cpulist"))
        .with_context(|| format!("reading node {n}'s cpulist"))?;
    let cpus = tyche_cpulist::parse_cpu_list(&text).map_err(|e| anyhow::anyhow!("node {n}'s cpulist: {e}"))?;
    Ok(cpus.into_iter().map(u64::from).collect())
}

/// Checks that a `PageCounts` value has every page on its expected node (`need_pages`: and at
/// least one page). Returns a one-line description.
fn pages_ok(v: &Value, what: &str, node: u32, need_pages: bool) -> Result<String> {
    let (pages, on, elsewhere, absent) = (u(v, "pages"), u(v, "on_expected"), u(v, "elsewhere"), u(v, "not_present"));
    check!(node_of(&v["expected_node"]) == Some(node), "{what}: expected node is {}, not {node}", v["expected_node"]);
    check!(!need_pages || pages > 0, "{what}: no pages reported");
    check!(
        elsewhere == 0 && absent == 0 && on == pages,
        "{what}: {on} of {pages} pages on node {node}, {elsewhere} elsewhere ({}), {absent} not present",
        v["by_node"]
    );
    Ok(format!("{what} {on}/{pages} pages on node {node}"))
}

// ------------------------------------------------------------------------------------------
// A minimal NBD client (fixed newstyle, NBD_OPT_EXPORT_NAME, simple replies).

struct Nbd {
    s: UnixStream,
    size: u64,
    cookie: u64,
}

const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
const NBD_REPLY_MAGIC: u32 = 0x6744_6698;
const IHAVEOPT: u64 = 0x4948_4156_454F_5054;

impl Nbd {
    fn connect(path: &Path, export: &str) -> Result<Nbd> {
        let mut s = UnixStream::connect(path).with_context(|| format!("connecting to {}", path.display()))?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut greet = [0u8; 18];
        s.read_exact(&mut greet)?;
        ensure!(&greet[..8] == b"NBDMAGIC", "not an NBD server");
        ensure!(u64::from_be_bytes(greet[8..16].try_into()?) == IHAVEOPT, "not a newstyle NBD server");
        // FIXED_NEWSTYLE | NO_ZEROES.
        s.write_all(&3u32.to_be_bytes())?;
        let mut opt = Vec::new();
        opt.extend_from_slice(&IHAVEOPT.to_be_bytes());
        opt.extend_from_slice(&1u32.to_be_bytes()); // NBD_OPT_EXPORT_NAME
        opt.extend_from_slice(&(export.len() as u32).to_be_bytes());
        opt.extend_from_slice(export.as_bytes());
        s.write_all(&opt)?;
        let mut info = [0u8; 10];
        s.read_exact(&mut info)?;
        let size = u64::from_be_bytes(info[..8].try_into()?);
        Ok(Nbd { s, size, cookie: 0 })
    }

    fn request(&mut self, kind: u16, offset: u64, len: u32, data: &[u8]) -> Result<Vec<u8>> {
        self.cookie += 1;
        let mut h = Vec::with_capacity(28 + data.len());
        h.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        h.extend_from_slice(&0u16.to_be_bytes());
        h.extend_from_slice(&kind.to_be_bytes());
        h.extend_from_slice(&self.cookie.to_be_bytes());
        h.extend_from_slice(&offset.to_be_bytes());
        h.extend_from_slice(&len.to_be_bytes());
        h.extend_from_slice(data);
        self.s.write_all(&h)?;
        let mut r = [0u8; 16];
        self.s.read_exact(&mut r)?;
        ensure!(u32::from_be_bytes(r[..4].try_into()?) == NBD_REPLY_MAGIC, "bad NBD reply magic");
        let err = u32::from_be_bytes(r[4..8].try_into()?);
        ensure!(u64::from_be_bytes(r[8..16].try_into()?) == self.cookie, "NBD reply for another request");
        ensure!(err == 0, "NBD error {err} (command {kind} at {offset}, {len} bytes)");
        let mut out = Vec::new();
        if kind == 0 {
            out = vec![0u8; len as usize];
            self.s.read_exact(&mut out)?;
        }
        Ok(out)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.request(1, offset, data.len() as u32, data).map(drop)
    }

    fn read(&mut self, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.request(0, offset, len as u32, &[])
    }

    fn flush(&mut self) -> Result<()> {
        self.request(3, 0, 0, &[]).map(drop)
    }

    fn disconnect(mut self) {
        let mut h = Vec::new();
        h.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        h.extend_from_slice(&0u16.to_be_bytes());
        h.extend_from_slice(&2u16.to_be_bytes());
        h.extend_from_slice(&[0u8; 20]);
        let _ = self.s.write_all(&h);
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut g = tyche_transport::SplitMix64::new(seed);
    (0..len).map(|_| g.next_u64() as u8).collect()
}

// ------------------------------------------------------------------------------------------

/// The namespaces; deleted (with the NICs moved back by the kernel) on drop.
struct Namespaces;

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in [TGT, INI] {
            let _ = delete_ns(ns);
        }
    }
}

const NUMA_BALANCING: &str = "/proc/sys/kernel/numa_balancing";

/// What one scheduler run measured.
struct Run {
    /// Payload bytes per initiator channel node (tx + rx).
    ini_by_node: BTreeMap<u32, u64>,
    /// Read data placed per initiator channel node (counted once, unlike sent bytes, which
    /// include retransmissions).
    ini_read_by_node: BTreeMap<u32, u64>,
    /// Payload bytes per target NIC node (tx + rx).
    tgt_by_node: BTreeMap<u32, u64>,
}

/// Runs the NUMA test; returns a summary such as `2 nodes, 2 nics`.
///
/// The network threads: `tyched` serves each NIC from a network thread of its own, and
/// `tyche-init` each node's links from an engine thread of its own, each pinned to its node:
/// both are checked, as is the consumer side (the NBD connection thread).
pub fn guest() -> Result<String> {
    let tyched = guest_bin("tyched");
    let tyche_init = guest_bin("tyche-init");
    let nodes: Vec<u32> = (0..2).filter(|n| Path::new(&format!("/sys/devices/system/node/node{n}")).exists()).collect();
    check!(nodes == [0, 1], "the VM should have NUMA nodes 0 and 1; sysfs has {nodes:?}");
    let cpus = [node_cpus(0)?, if trial() { node_cpus(0)? } else { node_cpus(1)? }];
    say(format!("nodes: 0 cpus {:?}, 1 cpus {:?}", cpus[0], cpus[1]));

    // 1. NICs by MAC, into their namespaces.
    let (tgt, ini) = nics_by_side()?;
    for ns in [TGT, INI] {
        delete_ns(ns)?;
    }
    fs::create_dir_all(WORK)?;
    let _ns = Namespaces;
    into_namespaces(&tgt, &ini)?;

    // 2. hwloc puts each NIC on its node, in each namespace.
    let planned = check_topology(&tyched, &tgt, &ini)?;

    // 2b. Seed 003 deciding placement: node 1's CPUs all taken by consumers.
    model_guided_placement(&tyched, &tgt, &cpus)?;
    // 2c. The NESUS paper's Worst case set up by options: threads and memory on node 0.
    misplaced_by_options(&tyched, &tyche_init, &tgt, &ini, &cpus)?;

    // 2d. AF_XDP zero copy on the guest's virtio-net NICs: asked for, and what the kernel said.
    let zero_copy = zero_copy_probe(&tyched, &tgt)?;
    say(format!("AF_XDP zero copy: {zero_copy}"));

    // Automatic NUMA balancing (on by default on a NUMA kernel) migrates a page towards the CPU
    // that touches it, unless a memory policy says otherwise. The test runs with it as the
    // machine has it: the initiator binds the memory policy of its engine threads (which copy
    // the data of requests from both nodes) so that the buffers stay where the consumers put them.
    let balancing = fs::read_to_string(NUMA_BALANCING).unwrap_or_default();
    say(format!("automatic NUMA balancing: {}", if balancing.trim() == "0" { "off" } else { "on" }));

    // 3 and 4, once per scheduler.
    let aff = run_scheduler("affinity", &tyched, &tyche_init, &tgt, &ini, &cpus, &planned)?;
    check_affinity_shares(&aff)?;
    let rr = run_scheduler("round-robin", &tyched, &tyche_init, &tgt, &ini, &cpus, &planned)?;
    check_round_robin_shares(&rr)?;
    let summary = format!("2 nodes, 2 nics; AF_XDP zero copy: {zero_copy}");
    say(format!("ok: {summary}"));
    Ok(summary)
}

/// The VM's NICs by their fixed MACs: the target-side ones and the initiator-side ones.
fn nics_by_side() -> Result<(Vec<VmNic>, Vec<VmNic>)> {
    let by_mac = nics_by_mac()?;
    let mut tgt = Vec::new();
    let mut ini = Vec::new();
    for node in 0..2u32 {
        for side in 1..=2u32 {
            let mac = format!("52:54:00:74:{node:02x}:{side:02x}");
            let name = by_mac.get(&mac).with_context(|| format!("no NIC with MAC {mac} (have {by_mac:?})"))?.clone();
            let nic = VmNic { name, mac, node };
            if side == 1 { &mut tgt } else { &mut ini }.push(nic);
        }
    }
    Ok((tgt, ini))
}

/// Adds the namespaces and moves the target-side NICs into `tgt`, the initiator-side ones into
/// `ini`, each up.
fn into_namespaces(tgt: &[VmNic], ini: &[VmNic]) -> Result<()> {
    for (ns, list) in [(TGT, tgt), (INI, ini)] {
        ip(&["netns", "add", ns])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        for n in list.iter() {
            ip(&["link", "set", "dev", &n.name, "netns", ns])?;
            ip(&["-n", ns, "link", "set", "dev", &n.name, "up"])?;
            say(format!("{ns}: {} {} (node {})", n.name, n.mac, n.node));
        }
    }
    Ok(())
}

/// Checks that hwloc puts each NIC on its node, in each namespace; returns the target's
/// placement plan's completion workers (node → CPUs).
fn check_topology(tyched: &Path, tgt: &[VmNic], ini: &[VmNic]) -> Result<BTreeMap<u32, Vec<u64>>> {
    let mut planned = BTreeMap::new();
    for (ns, list) in [(TGT, tgt), (INI, ini)] {
        let mut args = vec!["topology", "--json"];
        for n in list.iter() {
            args.extend(["--iface", n.name.as_str()]);
        }
        let topo = json(&in_ns(ns, tyched, &args)?, "tyched topology --json")?;
        if ns == TGT {
            planned = completion_workers(&topo["plan"])?;
            say(format!("{ns}: the plan's completion workers (node: cpus): {planned:?}"));
        }
        for n in list.iter() {
            let found = topo["nics"]
                .as_array()
                .and_then(|a| a.iter().find(|x| x["name"] == n.name.as_str()))
                .with_context(|| format!("{ns}: hwloc does not list {}", n.name))?;
            check!(
                node_of(&found["node"]) == Some(n.node),
                "{ns}: {} is on node {} by {}, expected node {}",
                n.name,
                found["node"],
                found["node_source"],
                n.node
            );
            check!(
                found["node_source"] == "hwloc",
                "{ns}: the node of {} comes from {}, not from hwloc",
                n.name,
                found["node_source"]
            );
            say(format!("{ns}: topology puts {} on node {} ({})", n.name, n.node, found["node_source"]));
        }
    }
    Ok(planned)
}

/// The node-1 channel's share of the payload bytes per node, and their total.
fn node1_share(m: &BTreeMap<u32, u64>) -> (f64, u64) {
    let total: u64 = m.values().sum();
    (m.get(&1).copied().unwrap_or(0) as f64 / total.max(1) as f64, total)
}

/// With the affinity scheduler, the node-1 channel carried at least [`AFFINITY_SHARE`] of the
/// payload, on both sides.
fn check_affinity_shares(aff: &Run) -> Result<()> {
    for (side, m) in [("initiator", &aff.ini_by_node), ("target", &aff.tgt_by_node)] {
        let (s, total) = node1_share(m);
        say(format!("affinity: {side}: node-1 channel carried {:.2}% of {total} payload bytes", s * 100.0));
        check!(
            s >= AFFINITY_SHARE,
            "affinity: the {side}'s node-1 channel carried {:.2}% of the payload (< {:.0}%): {m:?}",
            s * 100.0,
            AFFINITY_SHARE * 100.0
        );
    }
    Ok(())
}

/// With round robin, each channel carried half the payload within [`RR_SPREAD`] (the
/// initiator's read data and the target's bytes).
fn check_round_robin_shares(rr: &Run) -> Result<()> {
    // Retransmissions inflate the initiator's sent bytes unevenly (TCG is slow enough for
    // retransmission timers to fire); its read bytes and the target's bytes are exact.
    let (s, total) = node1_share(&rr.ini_by_node);
    say(format!("round-robin: initiator: node-1 channel carried {:.2}% of {total} payload bytes", s * 100.0));
    for (side, m) in [("initiator (read data)", &rr.ini_read_by_node), ("target", &rr.tgt_by_node)] {
        let (s, total) = node1_share(m);
        say(format!("round-robin: {side}: node-1 channel carried {:.2}% of {total} payload bytes", s * 100.0));
        check!(
            (s - 0.5).abs() <= RR_SPREAD,
            "round-robin: the {side}'s node-1 channel carried {:.2}% of the payload (not within {:.0}% of half): {m:?}",
            s * 100.0,
            RR_SPREAD * 100.0
        );
    }
    Ok(())
}

/// Starts `tyched --xdp-copy zero-copy` on the target NICs: where the guest's virtio-net binds
/// AF_XDP sockets in zero-copy mode it serves (and is stopped), else it refuses to start and
/// its error says why. Returns which, in words, for the test's line; the other runs here use
/// `auto`, and their sockets run in the mode this finds.
fn zero_copy_probe(tyched: &Path, tgt: &[VmNic]) -> Result<String> {
    let log = Path::new(WORK).join("tyched-zero-copy.log");
    let stats = Path::new(WORK).join("tyched-zero-copy.sock");
    let _ = fs::remove_file(&stats);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", TGT]).arg(tyched).args(["serve", "--xdp-copy", "zero-copy", "--export", "z=ram:4M"]);
    cmd.arg("--stats-socket").arg(&stats);
    for n in tgt {
        cmd.args(["--iface", &n.name]);
    }
    let mut t = Daemon::spawn("tyched --xdp-copy zero-copy", &mut cmd, &log)?;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        if stats.exists() {
            t.stop();
            return Ok("bound (zero-copy mode on every socket)".into());
        }
        if t.check_alive(&log).is_err() {
            let text = fs::read_to_string(&log).unwrap_or_default();
            let why = text.lines().rev().find(|l| l.starts_with("Error:")).unwrap_or("(no error line)");
            check!(why.contains("zero-copy mode"), "tyched --xdp-copy zero-copy failed for another reason: {why}");
            let errno = why.rsplit(": ").next().unwrap_or(why);
            return Ok(format!("refused by virtio_net ({errno}), copy mode"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    t.stop();
    bail!("tyched --xdp-copy zero-copy neither served nor exited within 60 s")
}

/// A bandwidth model of the VM for NICs on node 1 in which node 0 moves `node0` GB/s (node 1
/// its own 10): class 1 when within 10 % of node 1, else class 2.
fn vm_model(node0: f64) -> Value {
    let class = if node0 >= 9.0 { 1 } else { 2 };
    let side = serde_json::json!([
        {"node": 0, "gbytes_per_s": node0, "class": class},
        {"node": 1, "gbytes_per_s": 10.0, "class": 1},
    ]);
    serde_json::json!({"tolerance": 0.1, "io_nodes": [{"io_node": 1, "write": side, "read": side}]})
}

/// The placement plan on the VM's real topology when consumers run on every CPU of node 1 (the
/// node of the target's second NIC), with a given bandwidth model (`--model-file`: TCG's
/// memory has no NUMA bandwidth to measure): with node 0 in class 1, the channel's network
/// thread goes to a CPU of node 0 and its memory stays on node 1; with node 0 in class 2 it
/// stays on node 1 and shares a consumer's core.
fn model_guided_placement(tyched: &Path, tgt: &[VmNic], cpus: &[Vec<u64>; 2]) -> Result<()> {
    let nic = tgt.iter().find(|n| n.node == 1).context("no target NIC on node 1")?;
    let busy = cpus[1].iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    for (node0, want) in [(9.5, 0u32), (6.0, 1u32)] {
        let file = Path::new(WORK).join(format!("model-{node0}.json"));
        fs::write(&file, vm_model(node0).to_string())?;
        let file = file.to_str().context("utf-8 path")?;
        let args = [
            "topology",
            "--json",
            "--iface",
            nic.name.as_str(),
            "--consumer-cpus",
            busy.as_str(),
            "--model-file",
            file,
        ];
        let v = json(&in_ns(TGT, tyched, &args)?, "tyched topology --json --model-file")?;
        let ch = &v["plan"]["channels"][0];
        let cpu = ch["network_cpu"].as_u64().unwrap_or(u64::MAX);
        let class = if want == 0 { 1 } else { 2 };
        check!(
            node_of(&ch["node"]) == Some(want) && cpus[want as usize].contains(&cpu),
            "model (node 0 in class {class}): {}'s thread on node {} cpu {cpu}, expected node {want} ({:?})",
            nic.name,
            ch["node"],
            cpus[want as usize]
        );
        check!(node_of(&ch["memory_node"]) == Some(1), "{}'s memory planned on node {}", nic.name, ch["memory_node"]);
        check!(
            ch["exclusive_core"] == (want == 0),
            "{}: exclusive_core {} with node 0 in class {class}",
            nic.name,
            ch["exclusive_core"]
        );
        say(format!(
            "model-guided placement: node 1's cpus {busy} busy, node 0 in class {class}: {}'s thread on node {want} cpu {cpu}, memory on node 1",
            nic.name
        ));
    }
    Ok(())
}

/// Starts `tyched serve` in the target namespace on every target NIC, with `args` (the export
/// and options) and its stats socket at `stats`; returns once the socket is there.
fn start_tyched(tyched: &Path, tgt: &[VmNic], args: &[String], stats: &Path, log: &Path) -> Result<Daemon> {
    let _ = fs::remove_file(stats);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", TGT]).arg(tyched).arg("serve").args(args).arg("--stats-socket").arg(stats);
    for n in tgt {
        cmd.args(["--iface", &n.name]);
    }
    cmd.env("TYCHE_LOG", "info");
    let mut t = Daemon::spawn("tyched", &mut cmd, log)?;
    wait_for("tyched's stats socket", Duration::from_secs(60), || {
        t.check_alive(log)?;
        Ok(stats.exists())
    })?;
    Ok(t)
}

/// Starts `tyche-init serve-nbd --socket nbd` in the initiator namespace, each initiator NIC
/// paired with the target NIC of its node, with `args` and its stats socket at `stats`; returns
/// once both sockets are there.
fn start_initiator(
    tyche_init: &Path,
    tgt: &[VmNic],
    ini: &[VmNic],
    args: &[&str],
    nbd: &Path,
    stats: &Path,
    log: &Path,
) -> Result<Daemon> {
    for p in [nbd, stats] {
        let _ = fs::remove_file(p);
    }
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", INI]).arg(tyche_init).arg("serve-nbd").arg("--socket").arg(nbd).args(args);
    cmd.arg("--stats-socket").arg(stats);
    for (i, t) in ini.iter().zip(tgt) {
        ensure!(i.node == t.node, "NIC lists out of order");
        cmd.args(["--iface", &i.name, "--target", &t.mac]);
    }
    cmd.env("TYCHE_LOG", "info").env("TYCHE_INIT_STATE_DIR", Path::new(WORK).join("state"));
    let mut i = Daemon::spawn("tyche-init", &mut cmd, log)?;
    wait_for("tyche-init's NBD socket", Duration::from_secs(60), || {
        i.check_alive(log)?;
        Ok(nbd.exists() && stats.exists())
    })?;
    Ok(i)
}

/// The NESUS paper's *Worst* placement, set up by options: `tyched --network-thread-node 0
/// --channel-memory-node 0` (a RAM export) and `tyche-init serve-nbd --engine-thread-node 0
/// --channel-memory-node 0` attached to it (no traffic): on both sides the node-1 NIC's thread
/// runs on node 0's CPUs and its UMEM and rings are on node 0, as the stats measure them.
fn misplaced_by_options(
    tyched: &Path,
    tyche_init: &Path,
    tgt: &[VmNic],
    ini: &[VmNic],
    cpus: &[Vec<u64>; 2],
) -> Result<()> {
    let work = Path::new(WORK);
    let stats = work.join("tyched-misplaced.sock");
    let targs: Vec<String> =
        ["--export", "w=ram:16M", "--network-thread-node", "0", "--channel-memory-node", "0"].map(String::from).into();
    let mut t = start_tyched(tyched, tgt, &targs, &stats, &work.join("tyched-misplaced.log"))?;
    let tr = json(&run_cmd(tyched, &["stats", "--json", "--socket", &stats.display().to_string()])?, "tyched stats")?;
    // The initiator in the same case: `tyche-init --engine-thread-node 0 --channel-memory-node 0`.
    let istats = work.join("tyche-init-misplaced.stats.sock");
    let iargs = ["--export", "w", "--engine-thread-node", "0", "--channel-memory-node", "0"];
    let nbd = work.join("nbd-misplaced.sock");
    let mut i = start_initiator(tyche_init, tgt, ini, &iargs, &nbd, &istats, &work.join("tyche-init-misplaced.log"))?;
    let ir = json(&run_cmd(tyche_init, &["stats", &istats.display().to_string(), "--json"])?, "tyche-init stats")?;
    i.stop();
    t.stop();
    for l in ir["links"].as_array().context("tyche-init stats: no links")? {
        let name = l["name"].as_str().unwrap_or_default();
        let nic_node = ini.iter().find(|n| n.name == name).map(|n| n.node).context("unknown initiator link")?;
        let a = pages_ok(&l["umem"], &format!("misplaced: initiator {name} UMEM"), 0, true)?;
        let b = pages_ok(&l["rings"], &format!("misplaced: initiator {name} rings"), 0, true)?;
        let tc = thread_on_node(&l["thread"], &format!("misplaced: initiator {name}: its engine thread"), 0, cpus)?;
        say(format!(
            "misplaced by options: initiator {name} (NIC on node {nic_node}): engine thread on cpus {tc:?}; {a}; {b}"
        ));
    }
    for p in tr["placement"].as_array().context("tyched stats: no placement")? {
        let name = p["nic"].as_str().unwrap_or_default();
        let nic_node = tgt.iter().find(|n| n.name == name).map(|n| n.node).context("unknown target NIC")?;
        let a = pages_ok(&p["umem"], &format!("misplaced: target {name} UMEM"), 0, true)?;
        let b = pages_ok(&p["rings"], &format!("misplaced: target {name} rings"), 0, true)?;
        let tc = thread_on_node(&p["thread"], &format!("misplaced: target {name}: its network thread"), 0, cpus)?;
        say(format!("misplaced by options: target {name} (NIC on node {nic_node}): thread on cpus {tc:?}; {a}; {b}"));
    }
    Ok(())
}

/// Starts both daemons with `scheduler`, runs the workload, checks placement, stops them.
fn run_scheduler(
    scheduler: &str,
    tyched: &Path,
    tyche_init: &Path,
    tgt: &[VmNic],
    ini: &[VmNic],
    cpus: &[Vec<u64>; 2],
    planned: &BTreeMap<u32, Vec<u64>>,
) -> Result<Run> {
    say(format!("--- scheduler {scheduler}"));
    let work = Path::new(WORK);
    let tstats = work.join(format!("tyched-{scheduler}.sock"));
    let istats = work.join(format!("tyche-init-{scheduler}.stats.sock"));
    let nbd = work.join(format!("nbd-{scheduler}.sock"));
    let tlog = work.join(format!("tyched-{scheduler}.log"));
    // A file export, so that storage jobs go to the storage threads (a RAM export's run on the
    // network thread).
    let image = work.join(format!("numa-{scheduler}.img"));
    fs::File::create(&image)?.set_len((EXPORT_MIB as u64) << 20)?;
    let mut targs = vec!["--export".to_string(), format!("numa={}", image.display())];
    // Seed 002: the NICs' interrupts on their node, off the network thread's core (the
    // affinity run moves them; the other run reports where they are).
    let irq_auto = scheduler == "affinity";
    if irq_auto {
        targs.extend(["--irq-affinity", "auto"].map(String::from));
    }
    let mut t = start_tyched(tyched, tgt, &targs, &tstats, &tlog)?;
    let ilog = work.join(format!("tyche-init-{scheduler}.log"));
    let iargs = ["--export", "numa", "--scheduler", scheduler, "--nbd-nodes", "1"];
    let mut i = start_initiator(tyche_init, tgt, ini, &iargs, &nbd, &istats, &ilog)?;
    say_xdp_modes(&tlog, &ilog);

    let (ir, tr) = run_workload(scheduler, &nbd, tyched, tyche_init, &tstats, &istats)?;

    // Initiator: channels and their bytes.
    let (ini_by_node, ini_read_by_node) = initiator_channels(scheduler, &ir, ini)?;
    initiator_links(scheduler, &ir, ini, cpus)?;
    nbd_connection(scheduler, &ir, cpus)?;
    // Target: per NIC memory, per channel bytes.
    target_placement(scheduler, &tr, tgt, cpus)?;
    initiator_send(scheduler, &ir)?;
    target_irqs(scheduler, &tr, tgt, cpus, irq_auto)?;
    no_payload_copied(scheduler, &tr)?;
    let tgt_by_node = target_channels(scheduler, &tr, tgt)?;
    storage_checks(scheduler, &tr, &tgt_by_node, cpus, planned)?;
    i.stop();
    t.stop();
    let _ = fs::remove_file(&image);
    Ok(Run { ini_by_node, ini_read_by_node, tgt_by_node })
}

/// Prints the AF_XDP mode lines of both daemons' logs.
fn say_xdp_modes(tlog: &Path, ilog: &Path) {
    for (log, what) in [(tlog, "tyched"), (ilog, "tyche-init")] {
        let text = fs::read_to_string(log).unwrap_or_default();
        for l in text.lines().filter(|l| l.contains("AF_XDP") && (l.contains("mode") || l.contains("open"))) {
            say(format!("{what}: {}", l.trim()));
        }
    }
}

/// The workload: one connection (served for node 1), 1 MiB at a time, written, flushed, read
/// back and compared; returns both daemons' stats (`tyche-init`'s, then `tyched`'s), read
/// before the connection ends.
fn run_workload(
    scheduler: &str,
    nbd: &Path,
    tyched: &Path,
    tyche_init: &Path,
    tstats: &Path,
    istats: &Path,
) -> Result<(Value, Value)> {
    let mut c = Nbd::connect(nbd, "numa")?;
    ensure!(c.size == (EXPORT_MIB as u64) << 20, "export size {}", c.size);
    let data = pattern(0x5eed ^ scheduler.len() as u64, WORKLOAD);
    for (k, chunk) in data.chunks(REQUEST).enumerate() {
        c.write((k * REQUEST) as u64, chunk)?;
    }
    c.flush()?;
    for (k, chunk) in data.chunks(REQUEST).enumerate() {
        let back = c.read((k * REQUEST) as u64, chunk.len())?;
        ensure!(back == chunk, "read back differs at {}", k * REQUEST);
    }
    say(format!("{scheduler}: wrote and read back {} MiB through one NBD connection", WORKLOAD >> 20));

    let ir = json(&run_cmd(tyche_init, &["stats", &istats.display().to_string(), "--json"])?, "tyche-init stats")?;
    let tr = json(&run_cmd(tyched, &["stats", "--json", "--socket", &tstats.display().to_string()])?, "tyched stats")?;
    c.disconnect();
    Ok((ir, tr))
}

/// The node of the NIC called `name` in `list`.
fn node_of_nic(name: &str, list: &[VmNic]) -> Option<u32> {
    list.iter().find(|n| n.name == name).map(|n| n.node)
}

/// Checks each initiator channel is placed on its NIC's node; returns the payload bytes (tx +
/// rx) and the read data (rx) per node.
fn initiator_channels(scheduler: &str, ir: &Value, ini: &[VmNic]) -> Result<(BTreeMap<u32, u64>, BTreeMap<u32, u64>)> {
    let mut ini_by_node = BTreeMap::new();
    let mut ini_read_by_node = BTreeMap::new();
    for ch in ir["channels"].as_array().context("tyche-init stats: no channels")? {
        let link = ch["link"].as_str().unwrap_or_default();
        let node = node_of_nic(link, ini).with_context(|| format!("initiator channel on unknown link {link}"))?;
        check!(
            node_of(&ch["node"]) == Some(node),
            "initiator channel on {link}: placed on {}, NIC on {node}",
            ch["node"]
        );
        let (tx, rx) = (u(ch, "payload_tx"), u(ch, "payload_rx"));
        *ini_by_node.entry(node).or_insert(0) += tx + rx;
        *ini_read_by_node.entry(node).or_insert(0) += rx;
        say(format!(
            "{scheduler}: initiator channel {} on {link} (node {node}): payload tx {tx} B, rx {rx} B; thread {} cpus {}",
            ch["channel"], ch["thread"]["name"], ch["thread"]["cpus"]
        ));
    }
    Ok((ini_by_node, ini_read_by_node))
}

/// Checks each initiator link's memory on its NIC's node and its engine thread pinned there,
/// one engine thread per link.
fn initiator_links(scheduler: &str, ir: &Value, ini: &[VmNic], cpus: &[Vec<u64>; 2]) -> Result<()> {
    let mut engine_threads = Vec::new();
    for l in ir["links"].as_array().context("tyche-init stats: no links")? {
        let name = l["name"].as_str().unwrap_or_default();
        let node = node_of_nic(name, ini).with_context(|| format!("unknown initiator link {name}"))?;
        check!(
            node_of(&l["node"]) == Some(node),
            "initiator link {name}: memory placed on {}, NIC on {node}",
            l["node"]
        );
        let a = pages_ok(&l["umem"], &format!("initiator {name} UMEM"), node, true)?;
        let b = pages_ok(&l["rings"], &format!("initiator {name} rings"), node, true)?;
        say(format!("{scheduler}: {a}; {b}"));
        // tyche-init serves each node's links from an engine thread of its own, pinned there.
        let tc = thread_on_node(&l["thread"], &format!("initiator {name}: its engine thread"), node, cpus)?;
        engine_threads.push(l["thread"]["tid"].as_u64().unwrap_or_default());
        say(format!(
            "{scheduler}: initiator {name}: engine thread {} on cpus {tc:?} (node {node})",
            l["thread"]["name"]
        ));
    }
    engine_threads.sort_unstable();
    engine_threads.dedup();
    check!(engine_threads.len() == 2, "the initiator's two links share an engine thread: {engine_threads:?}");
    Ok(())
}

/// The NBD connection: its thread on node 1, its buffers on node 1, the workload's bytes.
fn nbd_connection(scheduler: &str, ir: &Value, cpus: &[Vec<u64>; 2]) -> Result<()> {
    let conns: Vec<&Value> =
        ir["nbd"].as_array().map(|a| a.iter().filter(|c| u(c, "bytes_written") > 0).collect()).unwrap_or_default();
    ensure!(conns.len() == 1, "one NBD connection carried the workload: {}", ir["nbd"]);
    let conn = conns[0];
    check!(node_of(&conn["node"]) == Some(1), "the NBD connection is served for node {}", conn["node"]);
    let tc = thread_cpus(&conn["thread"]);
    check!(tc == cpus[1], "the NBD connection thread runs on cpus {tc:?}, not node 1's {:?}", cpus[1]);
    let b = pages_ok(&conn["buffers"], "NBD request buffers", 1, true)?;
    say(format!("{scheduler}: NBD connection {} thread {} on cpus {tc:?}; {b}", conn["conn"], conn["thread"]["name"]));
    ensure!(
        u(conn, "bytes_written") == WORKLOAD as u64 && u(conn, "bytes_read") == WORKLOAD as u64,
        "NBD bytes: {conn}"
    );
    Ok(())
}

/// Checks each target NIC's memory on its node and its network thread pinned there.
fn target_placement(scheduler: &str, tr: &Value, tgt: &[VmNic], cpus: &[Vec<u64>; 2]) -> Result<()> {
    for p in tr["placement"].as_array().context("tyched stats: no placement")? {
        let name = p["nic"].as_str().unwrap_or_default();
        let node = node_of_nic(name, tgt).with_context(|| format!("unknown target NIC {name}"))?;
        check!(node_of(&p["node"]) == Some(node), "target {name}: memory placed on {}, NIC on {node}", p["node"]);
        let a = pages_ok(&p["umem"], &format!("target {name} UMEM"), node, true)?;
        let b = pages_ok(&p["rings"], &format!("target {name} rings"), node, true)?;
        let c = pages_ok(&p["slots"], &format!("target {name} slots"), node, false)?;
        say(format!("{scheduler}: {a}; {b}; {c}"));
        // tyched serves each NIC from a network thread of its own, pinned to the NIC's node.
        let tc = thread_on_node(&p["thread"], &format!("target {name}: its network thread"), node, cpus)?;
        say(format!("{scheduler}: target {name}: network thread {} on cpus {tc:?} (node {node})", p["thread"]["name"]));
    }
    Ok(())
}

/// Checks the initiator's send mode (inline, none handed over) and its channel fallback order
/// (by the bandwidth model).
fn initiator_send(scheduler: &str, ir: &Value) -> Result<()> {
    // The paper's inline send mode (the default): the thread that read each NBD request, on
    // node 1, posted its frames itself; at least the 16 writes, the FLUSH and the 16 reads.
    let send = &ir["send"];
    let requests = 2 * (WORKLOAD / REQUEST) as u64 + 1;
    check!(
        send["mode"] == "inline" && u(send, "inline") >= requests && u(send, "handed_over") == 0,
        "initiator: send mode {} with {} requests sent inline, {} handed over (expected inline, at least \
         {requests}, none handed over)",
        send["mode"],
        send["inline"],
        send["handed_over"]
    );
    say(format!(
        "{scheduler}: initiator: send mode {}: {} sent inline, {} handed over, {} inline fallbacks",
        send["mode"], send["inline"], send["handed_over"], send["inline_fallbacks"]
    ));
    // Seed 003: with two nodes the initiator measured (or loaded) the bandwidth model, and its
    // channel fallback order follows it.
    check!(ir["fallback"] == "model", "initiator: channel fallback by {}, not by the bandwidth model", ir["fallback"]);
    say(format!("{scheduler}: initiator: channel fallback order by {}", ir["fallback"]));
    Ok(())
}

/// Seed 002: each target NIC's interrupts, read from the VM's sysfs and procfs; with
/// `irq_auto`, each on its NIC's node and none on its network thread's core.
fn target_irqs(scheduler: &str, tr: &Value, tgt: &[VmNic], cpus: &[Vec<u64>; 2], irq_auto: bool) -> Result<()> {
    for n in tgt {
        let r = tr["irqs"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["nic"] == n.name.as_str()))
            .with_context(|| format!("tyched stats: no IRQ report for {}", n.name))?;
        let irqs = r["irqs"].as_array().cloned().unwrap_or_default();
        check!(!irqs.is_empty() && r["virtual_nic"] != true, "target {}: no IRQs read: {r}", n.name);
        if irq_auto {
            check!(u(r, "sharing_network_core") == 0, "target {}: IRQs on its network thread's core: {r}", n.name);
            for q in &irqs {
                let on: Vec<u64> =
                    q["affinity"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default();
                check!(
                    !on.is_empty() && on.iter().all(|c| cpus[n.node as usize].contains(c)),
                    "target {}: IRQ {} on cpus {on:?}, not on node {}'s {:?}",
                    n.name,
                    q["irq"],
                    n.node,
                    cpus[n.node as usize]
                );
            }
        }
        say(format!(
            "{scheduler}: target {}: {} IRQs, {} on the network thread's core{}",
            n.name,
            irqs.len(),
            u(r, "sharing_network_core"),
            if irq_auto { " (moved: --irq-affinity auto)" } else { "" }
        ));
    }
    Ok(())
}

/// The target moved the data between UMEM frames and its RAM store with no copy in user space
/// (native XDP on virtio-net here).
fn no_payload_copied(scheduler: &str, tr: &Value) -> Result<()> {
    let copied = tr["payload_copied_bytes"].as_u64().context("tyched stats: no payload_copied_bytes")?;
    check!(
        copied == 0,
        "target: {copied} payload bytes copied in user space, {} of them on the write path (expected none over AF_XDP)",
        u(tr, "payload_copied_write_bytes")
    );
    say(format!("{scheduler}: target: payload_copied_bytes 0 (data straight between UMEM frames and storage)"));
    Ok(())
}

/// Checks each target channel is placed on its NIC's node; returns the payload bytes (tx + rx)
/// per node.
fn target_channels(scheduler: &str, tr: &Value, tgt: &[VmNic]) -> Result<BTreeMap<u32, u64>> {
    let mut tgt_by_node = BTreeMap::new();
    for ch in tr["channels"].as_array().context("tyched stats: no channels")? {
        let name = ch["nic"].as_str().unwrap_or_default();
        let node = node_of_nic(name, tgt).with_context(|| format!("target channel on unknown NIC {name}"))?;
        check!(node_of(&ch["node"]) == Some(node), "target channel on {name}: placed on {}, NIC on {node}", ch["node"]);
        let (tx, rx) = (u(ch, "payload_tx"), u(ch, "payload_rx"));
        *tgt_by_node.entry(node).or_insert(0) += tx + rx;
        say(format!(
            "{scheduler}: target channel {} on {name} (node {node}): payload tx {tx} B, rx {rx} B; slots {}/{} pages on node {node}",
            ch["channel"], ch["slots"]["on_expected"], ch["slots"]["pages"]
        ));
    }
    Ok(tgt_by_node)
}

/// The completion workers of a placement plan (`plan` of `tyched topology --json`): node → CPUs.
fn completion_workers(plan: &Value) -> Result<BTreeMap<u32, Vec<u64>>> {
    let mut out: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for w in plan["completion_workers"].as_array().context("tyched topology: no completion_workers")? {
        let node = node_of(&w["node"]).with_context(|| format!("completion worker without a node: {w}"))?;
        out.entry(node).or_default().push(w["cpu"].as_u64().with_context(|| format!("no cpu: {w}"))?);
    }
    Ok(out)
}

/// Seed 000 (completion placement): `tyched`'s storage threads are the plan's completion
/// workers, and a channel's storage jobs ran on its NIC's node.
fn storage_checks(
    scheduler: &str,
    tr: &Value,
    tgt_by_node: &BTreeMap<u32, u64>,
    cpus: &[Vec<u64>; 2],
    planned: &BTreeMap<u32, Vec<u64>>,
) -> Result<()> {
    let threads = tr["storage_threads"].as_array().context("tyched stats: no storage_threads")?;
    let queues = tr["storage_queues"].as_array().context("tyched stats: no storage_queues")?;
    let mut jobs_by_node = BTreeMap::new();
    for node in 0..2u32 {
        let want = planned.get(&node).cloned().unwrap_or_default();
        check!(!want.is_empty(), "the plan has no completion worker on node {node}: {planned:?}");
        check!(
            want.iter().all(|c| cpus[node as usize].contains(c)),
            "the plan's node-{node} workers {want:?} are not on node {node}'s cpus {:?}",
            cpus[node as usize]
        );
        let on = |kind: &str| {
            threads.iter().filter(|t| t["kind"] == kind && node_of(&t["node"]) == Some(node)).collect::<Vec<_>>()
        };
        let workers = on("worker");
        let mut seen = Vec::new();
        for w in &workers {
            let tc = thread_cpus(&w["thread"]);
            check!(
                tc.len() == 1 && want.contains(&tc[0]),
                "storage worker {} of node {node} runs on cpus {tc:?}, not on one planned cpu of {want:?}",
                w["name"]
            );
            seen.extend(tc);
        }
        check!(
            want.iter().all(|c| seen.contains(c)),
            "node {node}: planned completion worker cpus {want:?}, storage workers on {seen:?}"
        );
        let rings = on("io_uring");
        check!(rings.len() == 1, "node {node}: {} io_uring threads, expected one", rings.len());
        let rc = rings.first().map(|r| thread_cpus(&r["thread"])).unwrap_or_default();
        check!(
            rc.len() == 1 && want.contains(&rc[0]),
            "node {node}: the io_uring thread runs on cpus {rc:?}, not on one of its completion worker cpus {want:?}"
        );
        let jobs: u64 = queues.iter().filter(|q| node_of(&q["node"]) == Some(node)).map(|q| u(q, "jobs")).sum();
        jobs_by_node.insert(node, jobs);
        say(format!(
            "{scheduler}: target node {node}: {} storage workers on cpus {seen:?} (planned {want:?}), io_uring thread on cpus {rc:?}; {jobs} jobs",
            workers.len()
        ));
    }
    let total_jobs: u64 = jobs_by_node.values().sum();
    let data_jobs = (2 * WORKLOAD / REQUEST) as u64;
    check!(total_jobs >= data_jobs, "target: {total_jobs} storage jobs counted, at least {data_jobs} ran");
    let total_bytes: u64 = tgt_by_node.values().sum();
    for node in 0..2u32 {
        let jobs = jobs_by_node[&node];
        let bytes = tgt_by_node.get(&node).copied().unwrap_or(0);
        let (job_share, byte_share) =
            (jobs as f64 / total_jobs.max(1) as f64, bytes as f64 / total_bytes.max(1) as f64);
        if bytes < REQUEST as u64 {
            // No data request on this node's channel: at most the FLUSH (which has no buffer,
            // so the initiator may send it on either channel).
            check!(
                jobs <= 2,
                "target node {node}: its channel carried no data request but {jobs} jobs ran on node {node}"
            );
        } else {
            check!(jobs > 0, "target node {node}: its channel carried {bytes} B but no job ran on node {node}");
            check!(
                (job_share - byte_share).abs() <= RR_SPREAD,
                "target node {node}: {:.1}% of the jobs ran there, its channel carried {:.1}% of the payload",
                job_share * 100.0,
                byte_share * 100.0
            );
        }
        say(format!(
            "{scheduler}: target node {node}: {jobs} of {total_jobs} storage jobs ({:.1}%) on node {node}, its channel carried {:.1}% of the payload",
            job_share * 100.0,
            byte_share * 100.0
        ));
    }
    Ok(())
}

fn run_cmd(bin: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("{} {}: {}", bin.display(), args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_checks_say_what_is_wrong() {
        let ok = serde_json::json!({"expected_node": 1, "pages": 4, "on_expected": 4, "elsewhere": 0, "not_present": 0, "by_node": {"1": 4}});
        assert!(pages_ok(&ok, "x", 1, true).is_ok());
        let bad = serde_json::json!({"expected_node": 1, "pages": 4, "on_expected": 3, "elsewhere": 1, "not_present": 0, "by_node": {"0": 1, "1": 3}});
        let e = pages_ok(&bad, "umem", 1, true).unwrap_err().to_string();
        assert!(e.contains("3 of 4 pages on node 1, 1 elsewhere"), "{e}");
        let none =
            serde_json::json!({"expected_node": 1, "pages": 0, "on_expected": 0, "elsewhere": 0, "not_present": 0});
        assert!(pages_ok(&none, "slots", 1, false).is_ok());
        assert!(pages_ok(&none, "umem", 1, true).is_err());
        assert!(pages_ok(&ok, "x", 0, true).is_err(), "wrong expected node");
    }

    fn storage_stats(worker_cpus: [u64; 2], jobs: [u64; 2]) -> Value {
        let t = |name: &str, kind: &str, node: u32, cpu: u64, jobs: u64| {
            serde_json::json!({"name": name, "kind": kind, "node": node, "planned_cpus": [cpu], "jobs": jobs,
                "thread": {"name": name, "cpus": [cpu], "nodes": [node]}})
        };
        serde_json::json!({
            "storage_threads": [
                t("tyched-io0", "worker", 0, worker_cpus[0], jobs[0]), t("tyched-io1", "worker", 0, 0, 0),
                t("tyched-io2", "worker", 1, worker_cpus[1], jobs[1]), t("tyched-io3", "worker", 1, 2, 0),
                t("tyched-uring0", "io_uring", 0, 0, 0), t("tyched-uring1", "io_uring", 1, 2, 0)],
            "storage_queues": [{"node": 0, "jobs": jobs[0]}, {"node": 1, "jobs": jobs[1]}],
        })
    }

    #[test]
    fn storage_checks_want_the_planned_cpus_and_jobs_on_the_channels_node() {
        let cpus = [vec![0, 1], vec![2, 3]];
        let planned: BTreeMap<u32, Vec<u64>> = [(0, vec![0]), (1, vec![2])].into();
        let aff: BTreeMap<u32, u64> = [(0, 0), (1, 32 << 20)].into();
        let rr: BTreeMap<u32, u64> = [(0, 16 << 20), (1, 16 << 20)].into();
        storage_checks("affinity", &storage_stats([0, 2], [1, 32]), &aff, &cpus, &planned).expect("as planned");
        storage_checks("round-robin", &storage_stats([0, 2], [17, 16]), &rr, &cpus, &planned).expect("as planned");
        let e = storage_checks("affinity", &storage_stats([0, 2], [20, 13]), &aff, &cpus, &planned).unwrap_err();
        assert!(e.to_string().contains("carried no data request but 20 jobs"), "{e}");
        let e = storage_checks("round-robin", &storage_stats([0, 2], [0, 33]), &rr, &cpus, &planned).unwrap_err();
        assert!(e.to_string().contains("no job ran on node 0"), "{e}");
        let e = storage_checks("affinity", &storage_stats([1, 2], [1, 32]), &aff, &cpus, &planned).unwrap_err();
        assert!(e.to_string().contains("not on one planned cpu"), "{e}");
    }

    /// The guest test on this machine, over veth pairs given the VM's MACs (root; `TYCHE_BIN_DIR`
    /// names the directory of `tyched` and `tyche-init`). This machine has one NUMA node, so it
    /// is expected to stop at the node check; run it to exercise the plumbing by hand.
    #[test]
    #[ignore = "root, and a VM with two NUMA nodes for the checks to pass"]
    fn guest_plumbing_on_veth() {
        let pairs = [
            ("vmn0t", "52:54:00:74:00:01", "vmn0i", "52:54:00:74:00:02"),
            ("vmn1t", "52:54:00:74:01:01", "vmn1i", "52:54:00:74:01:02"),
        ];
        for (a, ma, b, mb) in pairs {
            let _ = ip(&["link", "del", a]);
            ip(&["link", "add", a, "address", ma, "type", "veth", "peer", "name", b, "address", mb]).unwrap();
        }
        let r = guest();
        eprintln!("{r:?}");
    }
}
