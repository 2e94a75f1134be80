//! The `tyched` binary in a two-NIC veth lab (root only; elsewhere skipped, or failed under
//! `cargo xtask test`: `tyche_testkit::cannot_run`).
//!
//! Each test creates two network namespaces of its own (`tyd<transport><pid>i`/`t`) joined by
//! two veth pairs, runs `tyched serve --transport packet|xdp --config FILE` in the target
//! namespace and drives it with the initiator engine (over AF_PACKET or AF_XDP) from the other:
//! patterns of many sizes over both NICs, FLUSH/FUA/DISCARD/WRITE_ZEROES, a refused MAC, a refused
//! key, garbage frames, SIGTERM (exit 0), a restart with the same config, and a read back of
//! everything acknowledged before the signal. A guard deletes the namespaces (and with
//! them the veths) however the test ends.

mod common;

use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{pattern, Initiator, Port};
use tyche_channel::ConnectError;
use tyche_wire::{Op, RejectReason};
use tyched::packet::PacketTransport;

const KEY: &str = "lab pre-shared key 0123456789";

struct Lab {
    ns_i: String,
    ns_t: String,
}

fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("run ip");
    assert!(st.success(), "ip {args:?} failed");
}

impl Lab {
    fn new(tag: &str) -> Option<Lab> {
        Lab::with_mtu(tag, 1500)
    }

    /// A lab whose links have MTU `mtu`.
    fn with_mtu(tag: &str, mtu: u32) -> Option<Lab> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || Command::new("ip").arg("-V").output().is_err() {
            tyche_testkit::cannot_run(&format!("the veth lab test {tag}"), "it needs root and iproute2");
            return None;
        }
        let pid = std::process::id();
        let lab = Lab { ns_i: format!("tyd{tag}{pid}i"), ns_t: format!("tyd{tag}{pid}t") };
        // Interface names are per namespace: the two variants may run at once.
        ip(&["netns", "add", &lab.ns_i]);
        ip(&["netns", "add", &lab.ns_t]);
        for k in 0..2u32 {
            let (a, b) = (format!("tydi{k}"), format!("tydt{k}"));
            ip(&["link", "add", &a, "netns", &lab.ns_i, "type", "veth", "peer", "name", &b, "netns", &lab.ns_t]);
            let (ma, mb) = (common::init_mac(k as usize).to_string(), common::target_mac(k as usize).to_string());
            let mtu = mtu.to_string();
            ip(&["-n", &lab.ns_i, "link", "set", &a, "address", &ma, "mtu", &mtu, "up"]);
            ip(&["-n", &lab.ns_t, "link", "set", &b, "address", &mb, "mtu", &mtu, "up"]);
        }
        Some(lab)
    }

    /// Opens the initiator's sockets (AF_PACKET, or AF_XDP with `xdp`) inside its namespace.
    fn initiator_ports(&self, xdp: bool) -> Vec<Port> {
        in_netns(&self.ns_i, move || {
            (0..2)
                .map(|k| {
                    let name = format!("tydi{k}");
                    if xdp {
                        let port = tyche_xdp::XdpPort::open(&name, &tyche_xdp::PortConfig::default())
                            .unwrap_or_else(|e| panic!("{name}: AF_XDP port: {e}"));
                        Box::new(port) as Port
                    } else {
                        Box::new(PacketTransport::open(&name, tyche_wire::DEFAULT_ETHERTYPE).expect("socket")) as Port
                    }
                })
                .collect()
        })
    }

    /// Opens AF_XDP ports on both NICs inside namespace `ns` (`tydi*` or `tydt*`), lending
    /// `lend` frames each.
    fn xdp_ports(ns: &str, prefix: &str, lend: u32) -> Vec<tyche_xdp::XdpPort> {
        let prefix = prefix.to_owned();
        in_netns(ns, move || {
            (0..2)
                .map(|k| {
                    let name = format!("{prefix}{k}");
                    let pc = tyche_xdp::PortConfig { lend_frames: lend, tx_lend_frames: lend, ..Default::default() };
                    // The kernel releases a closed AF_XDP socket's hold on its queue after an RCU
                    // grace period, so binding the queue again right after closing a port there
                    // can fail for a moment: try for up to two seconds.
                    let t0 = std::time::Instant::now();
                    loop {
                        match tyche_xdp::XdpPort::open(&name, &pc) {
                            Ok(port) => break port,
                            Err(e) if t0.elapsed() > std::time::Duration::from_secs(2) => {
                                panic!("{name}: AF_XDP port: {e}")
                            }
                            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
                        }
                    }
                })
                .collect()
        })
    }

    /// Starts the daemon from a config file (three exports: a file, a MAC-locked RAM export and
    /// a keyed RAM export), with the transport and interfaces given as flags.
    fn tyched(&self, transport: &str, file: &std::path::Path, socket: &std::path::Path) -> Daemon {
        let config = file.with_extension("toml");
        let text = format!(
            "workers = 2\nstats_socket = {socket:?}\n\n[[export]]\nname = \"disk\"\npath = {file:?}\n\n\
             [[export]]\nname = \"locked\"\nsize = \"1M\"\nallow = [\"02:00:00:00:99:99\"]\n\n\
             [[export]]\nname = \"secret\"\nsize = \"1M\"\nkey = \"{KEY}\"\n"
        );
        std::fs::write(&config, text).expect("write config");
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns_t, env!("CARGO_BIN_EXE_tyched"), "serve", "--transport", transport])
            .args(["--iface", "tydt0", "--iface", "tydt1"])
            .arg("--config")
            .arg(&config)
            .env("TYCHE_LOG", "info")
            .stdin(Stdio::null())
            .spawn()
            .expect("start tyched");
        Daemon(child)
    }
}

/// The daemon's process; killed if the test ends without stopping it.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in [&self.ns_i, &self.ns_t] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn wait_exit(d: &mut Daemon) -> std::process::ExitStatus {
    let child = &mut d.0;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("tyched did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_socket(socket: &std::path::Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while tyched::stats_server::query(socket).is_err() {
        assert!(std::time::Instant::now() < deadline, "tyched never answered on its stats socket");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn tyched_binary_over_two_veth_nics_af_packet() {
    run_lab("packet");
}

#[test]
fn tyched_binary_over_two_veth_nics_af_xdp() {
    run_lab("xdp");
}

/// Writes patterns of many sizes over both NICs, SIGTERMs the daemon (exit 0), restarts it with
/// the same config and reads everything back.
fn run_lab(transport: &str) {
    // One lab at a time: opening AF_XDP sockets while the other lab sets up failed once
    // ("non-zero error code returned when creating AF_XDP socket").
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let xdp = transport == "xdp";
    let Some(lab) = Lab::new(transport) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    std::fs::File::create(&file).expect("create").set_len(16 << 20).expect("size");
    let socket = dir.path().join("stats.sock");

    let mut child = lab.tyched(transport, &file, &socket);
    wait_socket(&socket);
    let mut ini = Initiator::new(lab.initiator_ports(xdp));
    let c = ini.attach("disk", None).expect("attach over veth");
    assert_eq!(c.export_size, 16 << 20);
    let sizes = [512usize, 4096, 65536, 200 * 1024, 1 << 20];
    let mut written = Vec::new();
    let mut offset = 0u64;
    let mut ids = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(offset, len, i as u8 + 40);
        ids.push(ini.submit(Op::Write, offset, data.clone(), len as u64, i % 2 == 0));
        written.push((offset, data));
        offset += len as u64 + 4096;
    }
    for id in ids {
        ini.wait(id).0.expect("write acknowledged");
    }
    for (off, data) in &written {
        assert!(ini.read(*off, data.len()) == *data, "read back {} bytes at {off}", data.len());
    }
    let snap = tyched::stats_server::query(&socket).expect("stats");
    assert!(snap.nics.iter().all(|n| n.frames_rx > 0), "both NICs used: {:?}", snap.nics);
    if xdp {
        // AF_XDP lends frames both ways: no payload byte copied in user space on the target.
        assert_eq!(snap.payload_copied_bytes, 0, "{snap:?}");
    } else {
        assert!(snap.payload_copied_bytes >= 2 * (sizes.iter().sum::<usize>() as u64), "AF_PACKET copies, counted");
    }
    assert_eq!(snap.exports[0].requests.write, sizes.len() as u64);
    // Placement: veth has no NUMA node, so nothing is bound; on this one-node machine every
    // present page is on node 0 and the network thread reports its own affinity.
    assert_eq!(snap.placement.len(), 2, "one placement entry per NIC: {:?}", snap.placement);
    assert_ne!(snap.placement[0].thread.tid, snap.placement[1].thread.tid, "a thread per NIC: {:?}", snap.placement);
    for p in &snap.placement {
        assert_eq!(p.node, None, "veth has no node: {p:?}");
        // One network thread per NIC (the default): tyched-net0, tyched-net1.
        assert!(p.thread.name.starts_with("tyched-net"), "{p:?}");
        assert!(!p.thread.cpus.is_empty(), "{p:?}");
        if xdp {
            let chunks = 4096 + tyched::LEND_FRAMES as u64 + tyched::TX_LEND_FRAMES as u64;
            assert_eq!(p.umem.pages, chunks, "4096 UMEM chunks of 4 KiB and the spares to lend: {p:?}");
            assert!(p.rings.pages >= 4, "four rings mapped: {p:?}");
            assert_eq!(p.rings.not_present, 0, "ring pages are mapped: {p:?}");
        }
        if std::path::Path::new("/sys/devices/system/node/node1").exists() {
            continue;
        }
        for c in [&p.umem, &p.rings, &p.slots] {
            assert_eq!(
                c.by_node.keys().copied().collect::<Vec<_>>(),
                c.by_node.keys().filter(|&&n| n == 0).copied().collect::<Vec<_>>(),
                "{p:?}"
            );
        }
    }
    // Each channel is reported with its NIC's serving thread (tydt0 → tyched-net0, ...).
    assert!(snap.channels.iter().all(|c| c.thread.name == format!("tyched-net{}", &c.nic[4..])), "{:?}", snap.channels);
    // Slot memory is taken only for copied payloads: none when nothing was copied.
    if snap.payload_copied_bytes == 0 {
        assert_eq!(snap.limits.slot_memory_bytes, 0, "slot memory without a copy");
    }
    // FLUSH, DISCARD and WRITE_ZEROES over the wire.
    let base = 8u64 << 20;
    let mut expect = pattern(base, 65536, 77);
    ini.write(base, &expect);
    ini.range_op(Op::Flush, 0, 0).expect("flush");
    ini.range_op(Op::Discard, base + 4096, 8192).expect("discard");
    expect[4096..12288].fill(0);
    ini.range_op(Op::WriteZeroes, base + 32768, 4096).expect("write zeroes");
    expect[32768..36864].fill(0);
    assert!(ini.read(base, 65536) == expect, "discard and write-zeroes read back as zeroes");
    written.push((base, expect));

    // Strangers: a MAC not on the allow-list, a wrong key; the right key attaches.
    let (_, r) = ini.handshake(0, 0, "locked", None);
    assert_eq!(r.err(), Some(ConnectError::Rejected(RejectReason::NotAllowed)), "MAC allow-list");
    let (_, r) = ini.handshake(1, 0, "secret", Some(b"not the lab key at all"));
    assert_eq!(r.err(), Some(ConnectError::Rejected(RejectReason::AuthFailed)), "wrong key");
    let (_, r) = ini.handshake(1, 0, "secret", Some(KEY.as_bytes()));
    assert!(r.is_ok(), "right key attaches: {r:?}");

    // Garbage: well-formed frames for sessions nobody has, and an unparsable Tyche frame.
    for k in 0..2 {
        let env = tyche_wire::Envelope {
            dst: common::target_mac(k),
            src: common::init_mac(k),
            ethertype: tyche_wire::DEFAULT_ETHERTYPE,
            channel: 3,
            session: 0xdead_beef_0000 + k as u64,
        };
        let mut buf = [0u8; 128];
        let n =
            tyche_wire::Message::Ack(tyche_wire::Ack { cumulative: 9, sack: 0, duplicate: false }).emit(&env, &mut buf);
        common::send(&mut ini.ports[k], &buf[..n]);
        buf[15] = 0x7f; // an unknown kind
        common::send(&mut ini.ports[k], &buf[..n]);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let snap = tyched::stats_server::query(&socket).expect("stats");
        let (unknown, mac, key) =
            (snap.drops(|d| d.unknown_session), snap.drops(|d| d.denied_mac), snap.drops(|d| d.denied_key));
        if unknown >= 2 && mac >= 1 && key >= 1 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "refusals and garbage are counted: {:?}", snap.nics);
        std::thread::sleep(Duration::from_millis(20));
    }
    // Still serving.
    assert!(ini.read(0, 512) == written[0].1, "serving after garbage");
    let out = Command::new(env!("CARGO_BIN_EXE_tyched"))
        .args(["stats", "--json", "--socket"])
        .arg(&socket)
        .output()
        .expect("tyched stats");
    assert!(out.status.success(), "tyched stats: {}", String::from_utf8_lossy(&out.stderr));
    let _: tyched::Snapshot = serde_json::from_slice(&out.stdout).expect("stats --json is a snapshot");

    // SAFETY: kill takes integers; the child is ours and has not been reaped.
    assert_eq!(unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) }, 0);
    let st = wait_exit(&mut child);
    assert!(st.success(), "tyched exits 0 after SIGTERM: {st:?}");
    drop(ini);

    // Same config, new daemon: everything acknowledged before the signal is there.
    let mut child = lab.tyched(transport, &file, &socket);
    wait_socket(&socket);
    let mut ini = Initiator::new(lab.initiator_ports(xdp));
    ini.attach("disk", None).expect("attach after restart");
    for (off, data) in &written {
        assert!(ini.read(*off, data.len()) == *data, "after restart: {} bytes at {off}", data.len());
    }
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(child.0.id() as i32, libc::SIGINT) }, 0);
    assert!(wait_exit(&mut child).success(), "tyched exits 0 after SIGINT");
}

/// An in-process target on two AF_XDP NICs: write data goes from the UMEM frames it arrived in
/// straight to storage (RAM and file exports), with lost and duplicated frames, and every kept
/// frame goes back to its port.
#[test]
fn in_process_target_over_af_xdp_keeps_write_data_in_the_umem() {
    zero_copy_over_af_xdp("zc", 1500);
}

/// The same at MTU 9000: every DATA frame (8 KiB segments) is a multi-buffer frame over three
/// UMEM chunks. Write data stays in all three, storage writes from the pieces, and read data is
/// read into groups of three transmit chunks sent as one frame each: no payload copied.
#[test]
fn in_process_target_over_af_xdp_at_mtu_9000_copies_nothing() {
    zero_copy_over_af_xdp("zj", 9000);
}

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn zero_copy_over_af_xdp(tag: &str, mtu: u32) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::with_mtu(tag, mtu) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let mut exports =
        vec![tyched::ExportConfig::ram("ram", 8 << 20), tyched::ExportConfig::file("file", &file, Some(8 << 20))];
    // A block device (O_DIRECT by default): frame payloads are 512-byte aligned, so the data
    // goes between the frames and the device through O_DIRECT, still without a copy.
    let blk = LoopDevice::new(&dir.path().join("blk.img"), 8 << 20);
    if let Some(l) = &blk {
        exports.push(tyched::ExportConfig::file("blk", &l.dev, None));
    }
    let names: Vec<String> = exports.iter().map(|e| e.name.clone()).collect();
    let cfg = tyched::Config { exports, workers: 2, ..tyched::Config::default() };
    let nics = Lab::xdp_ports(&lab.ns_t, "tydt", tyched::LEND_FRAMES)
        .into_iter()
        .enumerate()
        .map(|(k, p)| {
            // The target loses some of what it sends too: resends of read data go out again from
            // the same chunks.
            let lossy = tyche_transport::FaultConfig { loss: 0.01, ..Default::default() };
            let p = tyche_transport::FaultInjector::new(p, lossy, Default::default(), 99 + k as u64);
            tyched::Nic { name: format!("tydt{k}"), transport: Box::new(p) }
        })
        .collect();
    let target = tyched::Target::start(cfg, nics).expect("target starts");
    let faults = tyche_transport::FaultConfig { loss: 0.01, duplicate: 0.05, ..Default::default() };
    let sizes = [512usize, 1024, 4096, 8192 + 512, 65536, 200 * 1024, 1 << 20];
    let mut bytes = 0;
    for (e, export) in names.iter().map(String::as_str).enumerate() {
        let ports = Lab::xdp_ports(&lab.ns_i, "tydi", 0)
            .into_iter()
            .enumerate()
            .map(|(k, p)| {
                Box::new(tyche_transport::FaultInjector::new(p, faults, Default::default(), 7 + k as u64)) as Port
            })
            .collect();
        let mut ini = Initiator::new(ports);
        ini.attach(export, None).expect("attach over AF_XDP");
        let (mut offset, mut written, mut ids) = (0u64, Vec::new(), Vec::new());
        for (i, &len) in sizes.iter().enumerate() {
            let data = pattern(offset, len, i as u8 + 60);
            ids.push(ini.submit(Op::Write, offset, data.clone(), len as u64, i % 2 == 0));
            written.push((offset, data));
            offset += len as u64 + 4096;
        }
        for id in ids {
            ini.wait(id).0.expect("write acknowledged");
        }
        // Reads in flight together, twice (the initiator balances bytes over the paths, so the
        // second round goes where the writes did not), so both NICs carry read data.
        for _ in 0..2 {
            let reads: Vec<u64> = written
                .iter()
                .map(|(off, d)| ini.submit(Op::Read, *off, vec![0; d.len()], d.len() as u64, false))
                .collect();
            for (id, (off, data)) in reads.into_iter().zip(&written) {
                let (r, back) = ini.wait(id);
                r.expect("read completes");
                assert!(back == *data, "{export}: read back {} bytes at {off}", data.len());
            }
        }
        bytes += sizes.iter().sum::<usize>() as u64;
        let s = common::wait_leases_back(&target);
        assert_eq!(s.exports[e].bytes_written, sizes.iter().sum::<usize>() as u64, "{export}");
        assert!(s.nics.iter().all(|n| n.frames_kept > 0), "both NICs kept frames: {:?}", s.nics);
        assert_eq!(s.payload_copied_write_bytes, 0, "{export}: no write payload copied in user space: {s:?}");
        assert_eq!(s.payload_copied_bytes, 0, "{export}: no payload copied in user space: {s:?}");
        if export == "blk" && mtu <= 3632 {
            // Written once, read twice, every byte through O_DIRECT. (A multi-buffer frame's
            // pieces after the first start 450 bytes into their chunks: not sector-aligned, so
            // at MTU 9000 those transfers go through the page cache, still without a copy.)
            let moved = 3 * sizes.iter().sum::<usize>() as u64;
            assert!(s.exports[e].direct_bytes >= moved, "{export}: O_DIRECT for all of it: {:?}", s.exports[e]);
        }
        assert!(
            s.nics.iter().all(|n| n.frames_sent_in_place > 0),
            "read data sent in place on both NICs: {:?}",
            s.nics
        );
        eprintln!(
            "MTU {mtu} {export}: payload_copied_bytes = {} (write path {}), frames kept {}, sent in place {}, \
             direct {}",
            s.payload_copied_bytes,
            s.payload_copied_write_bytes,
            s.nics.iter().map(|n| n.frames_kept).sum::<u64>(),
            s.nics.iter().map(|n| n.frames_sent_in_place).sum::<u64>(),
            s.exports[e].direct_bytes
        );
        drop(ini);
    }
    let s = target.shutdown();
    assert_eq!(s.leases_held, 0, "nothing kept after shutdown");
    assert_eq!(s.exports.iter().map(|e| e.bytes_written).sum::<u64>(), bytes);
}

/// Runs `f` on a short-lived thread that has entered network namespace `ns`, and returns what it
/// made (sockets opened there stay in that namespace).
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("open netns");
        // SAFETY: setns on this (short-lived) thread only; the descriptor is a live netns file.
        let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("netns thread")
}

/// A loop device over a file, detached on drop; `None` (said on stderr) where `losetup` fails.
struct LoopDevice {
    dev: String,
}

impl LoopDevice {
    fn new(img: &std::path::Path, len: u64) -> Option<LoopDevice> {
        std::fs::File::create(img).and_then(|f| f.set_len(len)).expect("loop image");
        let out = Command::new("losetup").args(["-f", "--show"]).arg(img).output();
        match out {
            Ok(o) if o.status.success() => {
                Some(LoopDevice { dev: String::from_utf8_lossy(&o.stdout).trim().to_owned() })
            }
            Ok(o) => {
                eprintln!("no block-device export: losetup: {}", String::from_utf8_lossy(&o.stderr).trim());
                None
            }
            Err(e) => {
                eprintln!("no block-device export: losetup: {e}");
                None
            }
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}
