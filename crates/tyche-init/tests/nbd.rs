//! The NBD server against libnbd's real clients (`nbdinfo`, `nbdcopy`), over the in-process
//! RAM target. Skipped with a message when the tools are not installed (`apt-get install
//! libnbd-bin`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tyche_init::loopback::{initiator_timers, mem_links, RamExport, RamTarget};
use tyche_init::nbd::{codec, NbdOptions};
use tyche_init::{connect, InitiatorConfig};

const MIB: u64 = 1 << 20;

fn have(tool: &str) -> bool {
    let found = Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("SKIP: {tool} not installed (apt-get install libnbd-bin)");
    }
    found
}

/// Runs a command with a time limit; panics with its output if it fails.
fn run(cmd: &mut Command) -> String {
    let mut full = Command::new("timeout");
    full.arg("120").arg(cmd.get_program()).args(cmd.get_args());
    let out = full.output().expect("spawn");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{:?} failed: {}\n{}\n{}",
        cmd,
        out.status,
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

struct Server {
    socket: PathBuf,
    _dir: tempfile::TempDir,
    _target: RamTarget,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn server(size: u64) -> Server {
    server_with(size, true).await
}

/// A server whose connections are served by the engine threads (`engine_io`) or by a task per
/// request.
async fn server_with(size: u64, engine_io: bool) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nbd.sock");
    let (links, _sw, target) = mem_links(RamExport::new("ram", size), 2);
    let mut cfg = InitiatorConfig::new("ram");
    cfg.timers = initiator_timers();
    let client = connect(cfg, links).await.expect("connect");
    let s = socket.clone();
    let opts = NbdOptions { engine_io, ..NbdOptions::new("ram") };
    let task = tokio::spawn(async move { tyche_init::nbd::serve_unix(&s, client, opts).await });
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Server { socket, _dir: dir, _target: target, task }
}

fn uri(socket: &Path) -> String {
    format!("nbd+unix:///ram?socket={}", socket.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_sees_size_and_flags() {
    if !have("nbdinfo") {
        return;
    }
    let s = server(64 * MIB).await;
    let u = uri(&s.socket);
    let out = tokio::task::spawn_blocking(move || run(Command::new("nbdinfo").arg("--json").arg(u))).await.unwrap();
    for want in [
        "\"export-size\": 67108864",
        "\"can_flush\": true",
        "\"can_fua\": true",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_multi_conn\": true",
        "\"block_size_minimum\": 512",
    ] {
        assert!(out.contains(want), "nbdinfo output lacks {want}:\n{out}");
    }
    let u = format!("nbd+unix:///?socket={}", s.socket.display());
    let list = tokio::task::spawn_blocking(move || run(Command::new("nbdinfo").arg("--list").arg(u))).await.unwrap();
    assert!(list.contains("export=\"ram\""), "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_round_trip_over_several_connections() {
    if !have("nbdcopy") {
        return;
    }
    let s = server(32 * MIB).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    let output = dir.path().join("out");
    let mut x = 0x1234_5678_9abc_def1u64;
    let data: Vec<u8> = (0..32 * MIB)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(&input, &data).unwrap();
    let u = uri(&s.socket);
    let (i, o) = (input.clone(), output.clone());
    tokio::task::spawn_blocking(move || {
        run(Command::new("nbdcopy").args(["--connections=4", "--requests=16"]).arg(&i).arg(&u));
        run(Command::new("nbdcopy").args(["--connections=4"]).arg(&u).arg(&o));
    })
    .await
    .unwrap();
    let back = std::fs::read(&output).unwrap();
    assert!(back == data, "nbdcopy out differs from what nbdcopy wrote in");
}

/// A raw client: handshake with NBD_OPT_GO, then out-of-order replies and error mapping, with
/// connections served by the engine threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_protocol_exchange() {
    raw_exchange(true).await;
}

/// The same exchange with a task per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_protocol_exchange_with_tasks() {
    raw_exchange(false).await;
}

async fn raw_exchange(engine_io: bool) {
    let s = server_with(4 * MIB, engine_io).await;
    let mut c = UnixStream::connect(&s.socket).await.unwrap();
    let mut greet = [0u8; 18];
    c.read_exact(&mut greet).await.unwrap();
    assert_eq!(greet, codec::greeting());
    c.write_u32(codec::FLAG_C_FIXED_NEWSTYLE | codec::FLAG_C_NO_ZEROES).await.unwrap();
    // An unsupported option first.
    let mut o = codec::IHAVEOPT.to_be_bytes().to_vec();
    o.extend(codec::opt::STRUCTURED_REPLY.to_be_bytes());
    o.extend(0u32.to_be_bytes());
    c.write_all(&o).await.unwrap();
    let mut r = [0u8; 20];
    c.read_exact(&mut r).await.unwrap();
    assert_eq!(u32::from_be_bytes(r[12..16].try_into().unwrap()), codec::rep::ERR_UNSUP);
    // NBD_OPT_GO for an unknown export, then for the default export.
    for (name, ok) in [("nope", false), ("", true)] {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend(name.as_bytes());
        d.extend(0u16.to_be_bytes());
        let mut o = codec::IHAVEOPT.to_be_bytes().to_vec();
        o.extend(codec::opt::GO.to_be_bytes());
        o.extend((d.len() as u32).to_be_bytes());
        o.extend(d);
        c.write_all(&o).await.unwrap();
        loop {
            let mut h = [0u8; 20];
            c.read_exact(&mut h).await.unwrap();
            let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let mut body = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
            c.read_exact(&mut body).await.unwrap();
            if !ok {
                assert_eq!(kind, codec::rep::ERR_UNKNOWN);
                break;
            }
            if kind == codec::rep::ACK {
                break;
            }
            assert_eq!(kind, codec::rep::INFO);
        }
    }
    // Transmission: a write, a read, an out-of-range read, an unaligned read.
    let req = |cmd: u16, flags: u16, cookie: u64, off: u64, len: u32| {
        let mut b = codec::REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend(flags.to_be_bytes());
        b.extend(cmd.to_be_bytes());
        b.extend(cookie.to_be_bytes());
        b.extend(off.to_be_bytes());
        b.extend(len.to_be_bytes());
        b
    };
    let mut w = req(codec::cmd::WRITE, codec::cflag::FUA, 1, 4096, 4096);
    w.extend([0xabu8; 4096]);
    c.write_all(&w).await.unwrap();
    let mut h = [0u8; 16];
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(0, 1));
    c.write_all(&req(codec::cmd::READ, 0, 2, 4 * MIB, 512)).await.unwrap();
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(codec::errno::EINVAL, 2));
    c.write_all(&req(codec::cmd::READ, 0, 3, 4096 + 100, 10)).await.unwrap();
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(0, 3));
    let mut d = [0u8; 10];
    c.read_exact(&mut d).await.unwrap();
    assert_eq!(d, [0xab; 10]);
    c.write_all(&req(codec::cmd::FLUSH, 0, 4, 0, 0)).await.unwrap();
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(0, 4));
    // Pipelined: 48 requests in one write (writes of 64 KiB, reads of what an earlier request
    // in the batch wrote, TRIM with FUA, WRITE_ZEROES, an empty read, CACHE, an unknown
    // command), replies in any order.
    let mut batch = Vec::new();
    let mut expect = std::collections::HashMap::new();
    for k in 0..16u64 {
        let at = MIB + k * 65536;
        let mut w = req(codec::cmd::WRITE, 0, 100 + k, at, 65536);
        w.extend(std::iter::repeat_n(k as u8 + 1, 65536));
        batch.extend(w);
        expect.insert(100 + k, (0u32, 0usize));
    }
    // Requests on one connection may complete in any order, so the reads go after a flush
    // round trip below; here: the other kinds.
    batch.extend(req(codec::cmd::TRIM, codec::cflag::FUA, 200, 2 * MIB, 8192));
    expect.insert(200, (0, 0));
    batch.extend(req(codec::cmd::WRITE_ZEROES, 0, 201, 2 * MIB + 8192, 4096));
    expect.insert(201, (0, 0));
    batch.extend(req(codec::cmd::READ, 0, 202, 0, 0));
    expect.insert(202, (0, 0));
    batch.extend(req(codec::cmd::CACHE, 0, 203, 0, 4096));
    expect.insert(203, (0, 0));
    batch.extend(req(99, 0, 204, 0, 512));
    expect.insert(204, (codec::errno::EINVAL, 0));
    c.write_all(&batch).await.unwrap();
    while !expect.is_empty() {
        c.read_exact(&mut h).await.unwrap();
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let (want, _) = expect.remove(&cookie).unwrap_or_else(|| panic!("unexpected reply {h:?}"));
        assert_eq!(error, want, "reply to {cookie}");
    }
    let mut batch = Vec::new();
    for k in 0..16u64 {
        batch.extend(req(codec::cmd::READ, 0, 300 + k, MIB + k * 65536, 65536));
    }
    c.write_all(&batch).await.unwrap();
    let mut seen = 0;
    while seen < 16 {
        c.read_exact(&mut h).await.unwrap();
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        assert_eq!(h, codec::simple_reply(0, cookie));
        let mut d = vec![0u8; 65536];
        c.read_exact(&mut d).await.unwrap();
        let k = cookie - 300;
        assert!(d.iter().all(|&b| b == k as u8 + 1), "read {k} returns what write {k} wrote");
        seen += 1;
    }
    c.write_all(&req(codec::cmd::DISC, 0, 5, 0, 0)).await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest)).await.expect("server closes").unwrap();
    assert!(rest.is_empty());
}

/// ext4 on a loop device over `nbdfuse` over `tyche-init serve-nbd --loopback-mib` (root only).
#[test]
#[ignore = "needs root, FUSE, loop devices and nbdfuse"]
fn ext4_over_nbdfuse() {
    if !have("nbdfuse") {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nbdfuse-ext4.sh");
    let out = Command::new("bash")
        .arg(script)
        .env("BIN", env!("CARGO_BIN_EXE_tyche-init"))
        .output()
        .expect("run the ext4 script");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("EXT4 ROUND TRIP OK") && text.contains("FSCK CLEAN"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// AF_XDP end to end in two network namespaces of its own: `tyche-init ram-target` and
/// `tyche-init serve-nbd` over two veth pairs, nbdcopy round trips, one link failing mid-copy
/// (root only).
#[test]
#[ignore = "needs root, network namespaces and AF_XDP"]
fn xdp_veth_nbdcopy_with_failover() {
    if !have("nbdcopy") {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/xdp-veth-nbd.sh");
    let out = Command::new("bash")
        .arg(script)
        .env("BIN", env!("CARGO_BIN_EXE_tyche-init"))
        .output()
        .expect("run the AF_XDP script");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("XDP DISCOVER OK")
            && text.contains("XDP NBDCOPY ROUND TRIP OK")
            && text.contains("XDP FAILOVER ROUND TRIP OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// fio's libnbd engine: random writes of 4 KiB and 64 KiB from two jobs at depth 32, each block
/// verified by checksum when read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_random_writes_verify() {
    let engine = Command::new("fio").arg("--enghelp=nbd").output();
    if !engine.is_ok_and(|o| o.status.success()) {
        eprintln!("SKIP: fio with the nbd engine not installed (apt-get install fio)");
        return;
    }
    let s = server(64 * MIB).await;
    let u = uri(&s.socket);
    tokio::task::spawn_blocking(move || {
        for bs in ["4k", "64k"] {
            let out = run(Command::new("fio")
                .arg(format!("--name=verify{bs}"))
                .args(["--ioengine=nbd", "--rw=randwrite", "--size=16M", "--offset_increment=16M"])
                .args(["--iodepth=32", "--numjobs=2", "--verify=crc32c", "--do_verify=1", "--group_reporting"])
                .arg("--verify_state_save=0")
                .arg(format!("--bs={bs}"))
                .arg(format!("--uri={u}")));
            assert!(out.contains("err= 0"), "fio reported errors:\n{out}");
            assert!(!out.contains("verify:"), "fio verification failed:\n{out}");
        }
    })
    .await
    .unwrap();
}

/// Against the real target daemon: `tests/tcp-tyched.sh` (TCP baseline, keyed export, target
/// found by discovery) and `tests/xdp-veth-nbd.sh` with `TYCHED` (AF_XDP, failover). Needs root
/// and a `tyched` binary built next to this one (`cargo build -p tyched`).
#[test]
#[ignore = "needs root, network namespaces, AF_XDP and a built tyched"]
fn interop_with_tyched() {
    let me = Path::new(env!("CARGO_BIN_EXE_tyche-init"));
    let tyched = me.with_file_name("tyched");
    if !tyched.exists() || !have("nbdcopy") {
        eprintln!("SKIP: no tyched binary at {} (cargo build -p tyched)", tyched.display());
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    for (script, needles) in [
        ("tcp-tyched.sh", &["TCP NBDCOPY ROUND TRIP OK"][..]),
        ("xdp-veth-nbd.sh", &["XDP DISCOVER OK", "XDP NBDCOPY ROUND TRIP OK", "XDP FAILOVER ROUND TRIP OK"][..]),
    ] {
        let out = Command::new("bash")
            .arg(dir.join(script))
            .env("BIN", me)
            .env("TYCHED", &tyched)
            .env("FIND_TARGET", "1")
            .output()
            .expect("run the script");
        let text = String::from_utf8_lossy(&out.stdout);
        for n in needles {
            assert!(text.contains(n), "{script}: no {n:?}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        }
    }
}
