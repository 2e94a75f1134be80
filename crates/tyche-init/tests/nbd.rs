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
use tyche_init::{connect, EngineThreads, InitiatorConfig, SchedulerKind, SendMode};

const MIB: u64 = 1 << 20;

/// The system's own directories: nbdsh is a Python script run by the `python3` first on the
/// PATH, and python3-libnbd is the system Python's (a user's pyenv or venv has no `nbd`).
const SYSTEM_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

fn have(tool: &str) -> bool {
    let found = Command::new(tool).arg("--version").env("PATH", SYSTEM_PATH).output().is_ok_and(|o| o.status.success());
    if !found {
        tyche_testkit::cannot_run(tool, "not installed (apt-get install libnbd-bin)");
    }
    found
}

/// Runs a command with a time limit; panics with its output if it fails.
fn run(cmd: &mut Command) -> String {
    let mut full = Command::new("timeout");
    full.arg("120").arg(cmd.get_program()).args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => full.env(k, v),
            None => full.env_remove(k),
        };
    }
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
    /// The session the server serves (its counters: bytes read over the links).
    client: tyche_init::Client,
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
    server_opts(size, NbdOptions { engine_io, ..NbdOptions::new("ram") }).await
}

/// A server with options `opts` (export name "ram"), inline send mode.
async fn server_opts(size: u64, opts: NbdOptions) -> Server {
    server_full(size, opts, SendMode::Inline).await
}

/// A server whose session uses send mode `mode`.
async fn server_mode(size: u64, engine_io: bool, mode: SendMode) -> Server {
    server_full(size, NbdOptions { engine_io, ..NbdOptions::new("ram") }, mode).await
}

async fn server_full(size: u64, opts: NbdOptions, mode: SendMode) -> Server {
    server_export(RamExport::new("ram", size), opts, mode).await
}

/// A server of `export` (named "ram").
async fn server_export(export: RamExport, opts: NbdOptions, mode: SendMode) -> Server {
    server_links(export, opts, mode, None).await
}

/// With `two_nodes` (a scheduler), the two links on two nodes: an engine thread and a part of
/// the volume each.
async fn server_links(export: RamExport, opts: NbdOptions, mode: SendMode, two_nodes: Option<SchedulerKind>) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nbd.sock");
    let (mut links, _sw, target) = mem_links(export, 2).expect("the in-process target starts");
    let mut cfg = InitiatorConfig::new("ram");
    cfg.timers = initiator_timers();
    cfg.send_mode = mode;
    if let Some(scheduler) = two_nodes {
        for (k, l) in links.iter_mut().enumerate() {
            l.node = Some(k as u32);
        }
        cfg.engine_threads = EngineThreads::PerNode;
        cfg.scheduler = scheduler;
    }
    let client = connect(cfg, links).await.expect("connect");
    let s = socket.clone();
    let session = client.clone();
    let task = tokio::spawn(async move { tyche_init::nbd::serve_unix(&s, client, opts).await });
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Server { socket, _dir: dir, _target: target, client: session, task }
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
    nbdcopy_round_trip(None).await;
}

/// The volume in two parts, one per engine thread: with round-robin each connection's requests
/// go to both parts in turn, by the other thread's mailbox, and their outcomes come back to the
/// connection's thread the same way; with affinity they stay in the part of their buffers' node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_round_trip_with_the_volume_in_parts() {
    if !have("nbdcopy") {
        return;
    }
    for scheduler in [SchedulerKind::RoundRobin, SchedulerKind::Affinity] {
        let s = nbdcopy_round_trip(Some(scheduler)).await;
        let r = s.client.report().await.expect("report");
        let tx: Vec<u64> = ["mem0", "mem1"]
            .iter()
            .map(|l| r.channels.iter().filter(|c| c.link == *l).map(|c| c.payload_tx).sum())
            .collect();
        match scheduler {
            // Both parts, each about half.
            SchedulerKind::RoundRobin => assert!(tx.iter().all(|&t| t >= 8 * MIB), "{tx:?}: {}", r.human()),
            // The connections' buffers are on one node (this machine's): that node's part only.
            SchedulerKind::Affinity => assert!(tx.contains(&0), "{tx:?}: {}", r.human()),
        }
    }
}

async fn nbdcopy_round_trip(two_nodes: Option<SchedulerKind>) -> Server {
    let s = server_links(
        RamExport::new("ram", 32 * MIB),
        NbdOptions { engine_io: true, ..NbdOptions::new("ram") },
        SendMode::Inline,
        two_nodes,
    )
    .await;
    if !have("nbdcopy") {
        return s;
    }
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
    s
}

/// A raw client: handshake with NBD_OPT_GO, then out-of-order replies and error mapping, with
/// connections served by the engine threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_protocol_exchange() {
    raw_exchange(true, SendMode::Inline).await;
}

/// The same exchange in queue send mode: a reader thread per connection hands the requests to
/// the engine thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_protocol_exchange_in_queue_send_mode() {
    raw_exchange(true, SendMode::Queue).await;
}

/// The same exchange with a task per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_protocol_exchange_with_tasks() {
    raw_exchange(false, SendMode::Inline).await;
}

/// Connects to the NBD socket, checks the greeting and answers it (fixed newstyle, no zeroes).
async fn newstyle(socket: &Path) -> UnixStream {
    // The socket file appears at bind(2), a moment before listen(2): until then a connection is
    // refused (seen under CI load), so try again for a while.
    let mut tries = 0;
    let mut c = loop {
        match UnixStream::connect(socket).await {
            Ok(c) => break c,
            Err(e)
                if tries < 100
                    && matches!(e.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound) =>
            {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("connecting to {}: {e}", socket.display()),
        }
    };
    let mut greet = [0u8; 18];
    c.read_exact(&mut greet).await.unwrap();
    assert_eq!(greet, codec::greeting());
    c.write_u32(codec::FLAG_C_FIXED_NEWSTYLE | codec::FLAG_C_NO_ZEROES).await.unwrap();
    c
}

async fn raw_exchange(engine_io: bool, mode: SendMode) {
    let s = server_mode(4 * MIB, engine_io, mode).await;
    let mut c = newstyle(&s.socket).await;
    // An unsupported option first.
    let mut o = codec::IHAVEOPT.to_be_bytes().to_vec();
    o.extend(99u32.to_be_bytes());
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
    let mut w = request(codec::cmd::WRITE, codec::cflag::FUA, 1, 4096, 4096);
    w.extend([0xabu8; 4096]);
    c.write_all(&w).await.unwrap();
    let mut h = [0u8; 16];
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(0, 1));
    c.write_all(&request(codec::cmd::READ, 0, 2, 4 * MIB, 512)).await.unwrap();
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(codec::errno::EINVAL, 2));
    c.write_all(&request(codec::cmd::READ, 0, 3, 4096 + 100, 10)).await.unwrap();
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(0, 3));
    let mut d = [0u8; 10];
    c.read_exact(&mut d).await.unwrap();
    assert_eq!(d, [0xab; 10]);
    c.write_all(&request(codec::cmd::FLUSH, 0, 4, 0, 0)).await.unwrap();
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(0, 4));
    // Pipelined: 48 requests in one write (writes of 64 KiB, reads of what an earlier request
    // in the batch wrote, TRIM with FUA, WRITE_ZEROES, an empty read, CACHE, an unknown
    // command), replies in any order.
    let mut batch = Vec::new();
    let mut expect = std::collections::HashMap::new();
    for k in 0..16u64 {
        let at = MIB + k * 65536;
        let mut w = request(codec::cmd::WRITE, 0, 100 + k, at, 65536);
        w.extend(std::iter::repeat_n(k as u8 + 1, 65536));
        batch.extend(w);
        expect.insert(100 + k, (0u32, 0usize));
    }
    // Requests on one connection may complete in any order, so the reads go after a flush
    // round trip below; here: the other kinds.
    batch.extend(request(codec::cmd::TRIM, codec::cflag::FUA, 200, 2 * MIB, 8192));
    expect.insert(200, (0, 0));
    batch.extend(request(codec::cmd::WRITE_ZEROES, 0, 201, 2 * MIB + 8192, 4096));
    expect.insert(201, (0, 0));
    batch.extend(request(codec::cmd::READ, 0, 202, 0, 0));
    expect.insert(202, (0, 0));
    batch.extend(request(codec::cmd::CACHE, 0, 203, 0, 4096));
    expect.insert(203, (0, 0));
    batch.extend(request(99, 0, 204, 0, 512));
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
        batch.extend(request(codec::cmd::READ, 0, 300 + k, MIB + k * 65536, 65536));
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
    c.write_all(&request(codec::cmd::DISC, 0, 5, 0, 0)).await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest)).await.expect("server closes").unwrap();
    assert!(rest.is_empty());
    // The mode decided who sent: the thread that read the requests, or the engine thread they
    // were handed to.
    let send = s.client.report().await.expect("report").send;
    assert_eq!(send.mode, mode.to_string());
    match mode {
        SendMode::Inline => assert!(send.inline >= 30 && send.handed_over == 0, "{send:?}"),
        SendMode::Queue => assert!(send.handed_over >= 30 && send.inline == 0, "{send:?}"),
    }
}

/// Option haggling on a raw socket: `(option, data)` sent, the replies' (type, data) returned up
/// to and including the final one (ACK or an error).
async fn option(c: &mut UnixStream, option: u32, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
    let mut o = codec::IHAVEOPT.to_be_bytes().to_vec();
    o.extend(option.to_be_bytes());
    o.extend((data.len() as u32).to_be_bytes());
    o.extend(data);
    c.write_all(&o).await.unwrap();
    let mut out = Vec::new();
    loop {
        let mut h = [0u8; 20];
        c.read_exact(&mut h).await.unwrap();
        assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), option, "reply to another option");
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut body = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        c.read_exact(&mut body).await.unwrap();
        out.push((kind, body));
        if kind == codec::rep::ACK || kind & (1 << 31) != 0 {
            return out;
        }
    }
}

fn meta_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend(name.as_bytes());
    d.extend((queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend((q.len() as u32).to_be_bytes());
        d.extend(q.as_bytes());
    }
    d
}

fn request(cmd: u16, flags: u16, cookie: u64, off: u64, len: u32) -> Vec<u8> {
    let mut b = codec::REQUEST_MAGIC.to_be_bytes().to_vec();
    b.extend(flags.to_be_bytes());
    b.extend(cmd.to_be_bytes());
    b.extend(cookie.to_be_bytes());
    b.extend(off.to_be_bytes());
    b.extend(len.to_be_bytes());
    b
}

/// One structured chunk: (flags, type, cookie, payload).
async fn chunk(c: &mut UnixStream) -> (u16, u16, u64, Vec<u8>) {
    let mut h = [0u8; 20];
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), codec::STRUCTURED_REPLY_MAGIC, "{h:?}");
    let mut p = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
    c.read_exact(&mut p).await.unwrap();
    (
        u16::from_be_bytes([h[4], h[5]]),
        u16::from_be_bytes([h[6], h[7]]),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
        p,
    )
}

/// Block status descriptors (length, flags) of a BLOCK_STATUS chunk of `base:allocation`.
fn extents(p: &[u8]) -> Vec<(u32, u32)> {
    assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), codec::BASE_ALLOCATION_ID);
    p[4..]
        .chunks_exact(8)
        .map(|e| (u32::from_be_bytes(e[..4].try_into().unwrap()), u32::from_be_bytes(e[4..].try_into().unwrap())))
        .collect()
}

/// Structured replies, `base:allocation` and BLOCK_STATUS on a raw socket, engine path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_structured_replies_and_block_status() {
    raw_structured(true).await;
}

/// The same with a task per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_structured_replies_and_block_status_with_tasks() {
    raw_structured(false).await;
}

async fn raw_structured(engine_io: bool) {
    use codec::{chunk as ch, cmd, rep};
    let s = server_with(4 * MIB, engine_io).await;
    let mut c = newstyle(&s.socket).await;
    let ctx = codec::rep_meta_context(codec::BASE_ALLOCATION_ID, codec::BASE_ALLOCATION);
    // SET before structured replies: refused. LIST works and names the one context.
    let r = option(&mut c, codec::opt::SET_META_CONTEXT, &meta_request("ram", &["base:allocation"])).await;
    assert_eq!(r, [(rep::ERR_INVALID, vec![])]);
    for queries in [&[][..], &["base:"][..], &["base:allocation", "other:x"][..]] {
        let r = option(&mut c, codec::opt::LIST_META_CONTEXT, &meta_request("", queries)).await;
        assert_eq!(r, [(rep::META_CONTEXT, ctx.clone()), (rep::ACK, vec![])], "LIST {queries:?}");
    }
    let r = option(&mut c, codec::opt::LIST_META_CONTEXT, &meta_request("", &["other:x"])).await;
    assert_eq!(r, [(rep::ACK, vec![])]);
    let r = option(&mut c, codec::opt::LIST_META_CONTEXT, &meta_request("nope", &[])).await;
    assert_eq!(r, [(rep::ERR_UNKNOWN, vec![])]);
    let r = option(&mut c, codec::opt::LIST_META_CONTEXT, &[0, 0, 0, 9, b'x']).await;
    assert_eq!(r, [(rep::ERR_INVALID, vec![])], "a malformed query list");
    assert_eq!(option(&mut c, codec::opt::STRUCTURED_REPLY, &[1]).await, [(rep::ERR_INVALID, vec![])]);
    assert_eq!(option(&mut c, codec::opt::STRUCTURED_REPLY, &[]).await, [(rep::ACK, vec![])]);
    let r = option(&mut c, codec::opt::SET_META_CONTEXT, &meta_request("ram", &["base:allocation"])).await;
    assert_eq!(r, [(rep::META_CONTEXT, ctx.clone()), (rep::ACK, vec![])]);
    let mut go = 0u32.to_be_bytes().to_vec();
    go.extend(0u16.to_be_bytes());
    let r = option(&mut c, codec::opt::GO, &go).await;
    let block = r.iter().find(|(k, d)| *k == rep::INFO && d[..2] == codec::info::BLOCK_SIZE.to_be_bytes()).unwrap();
    assert_eq!(block.1, codec::info_block_size(512, 4096, 4 << 20), "block sizes: the export is 4 MiB");
    let flags = u16::from_be_bytes(r[0].1[10..12].try_into().unwrap());
    assert_ne!(flags & codec::tflag::SEND_CACHE, 0);

    // Data at 64 KiB (8 KiB) and at 1 MiB + 512 (one sector); the rest never written.
    let mut w = request(cmd::WRITE, 0, 1, 65536, 8192);
    w.extend([0x5a; 8192]);
    w.extend(request(cmd::WRITE, 0, 2, MIB + 512, 512));
    w.extend([0xa5; 512]);
    c.write_all(&w).await.unwrap();
    for _ in 0..2 {
        let mut h = [0u8; 16];
        c.read_exact(&mut h).await.unwrap();
        assert_eq!(&h[..8], &codec::simple_reply(0, 0)[..8], "writes get simple replies");
    }
    // A read: one OFFSET_DATA chunk, DONE.
    c.write_all(&request(cmd::READ, 0, 3, 65536 + 100, 20)).await.unwrap();
    let (f, t, cookie, p) = chunk(&mut c).await;
    assert_eq!((f, t, cookie), (ch::FLAG_DONE, ch::OFFSET_DATA, 3));
    assert_eq!(p[..8], (65536u64 + 100).to_be_bytes());
    assert_eq!(p[8..], [0x5a; 20]);
    // A read out of range: an ERROR chunk; an empty read: NONE.
    c.write_all(&request(cmd::READ, 0, 4, 4 * MIB, 512)).await.unwrap();
    let (f, t, cookie, p) = chunk(&mut c).await;
    assert_eq!((f, t, cookie), (ch::FLAG_DONE, ch::ERROR, 4));
    assert_eq!(p, [0, 0, 0, codec::errno::EINVAL as u8, 0, 0]);
    c.write_all(&request(cmd::READ, 0, 5, 0, 0)).await.unwrap();
    assert_eq!(chunk(&mut c).await, (ch::FLAG_DONE, ch::NONE, 5, vec![]));
    // Block status of the first 2 MiB: 64 KiB hole, 8 KiB data, hole, the page holding the
    // sector at 1 MiB + 512 data (the loopback target reports 4 KiB pages), hole.
    c.write_all(&request(cmd::BLOCK_STATUS, 0, 6, 0, 2 << 20)).await.unwrap();
    let (f, t, cookie, p) = chunk(&mut c).await;
    assert_eq!((f, t, cookie), (ch::FLAG_DONE, ch::BLOCK_STATUS, 6));
    let hz = codec::state::HOLE | codec::state::ZERO;
    assert_eq!(
        extents(&p),
        [(65536, hz), (8192, 0), ((MIB - 65536 - 8192) as u32, hz), (4096, 0), ((MIB - 4096) as u32, hz)]
    );
    // REQ_ONE: one extent. Unaligned: cut to the range asked.
    c.write_all(&request(cmd::BLOCK_STATUS, codec::cflag::REQ_ONE, 7, 0, 2 << 20)).await.unwrap();
    let (_, _, _, p) = chunk(&mut c).await;
    assert_eq!(extents(&p), [(65536, hz)]);
    c.write_all(&request(cmd::BLOCK_STATUS, 0, 8, 65536 - 100, 300)).await.unwrap();
    let (_, t, _, p) = chunk(&mut c).await;
    assert_eq!(t, ch::BLOCK_STATUS);
    assert_eq!(extents(&p), [(100, hz), (200, 0)]);
    // Past the end, and of length zero: ERROR chunks.
    c.write_all(&request(cmd::BLOCK_STATUS, 0, 9, 4 * MIB - 512, 1024)).await.unwrap();
    let (_, t, cookie, p) = chunk(&mut c).await;
    assert_eq!((t, cookie, p[3] as u32), (ch::ERROR, 9, codec::errno::EINVAL));
    c.write_all(&request(cmd::BLOCK_STATUS, 0, 10, 0, 0)).await.unwrap();
    let (_, t, _, _) = chunk(&mut c).await;
    assert_eq!(t, ch::ERROR);
    // CACHE and FLUSH: simple replies.
    c.write_all(&request(cmd::CACHE, 0, 11, 0, 4096)).await.unwrap();
    let mut h = [0u8; 16];
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, codec::simple_reply(0, 11));
    c.write_all(&request(cmd::DISC, 0, 12, 0, 0)).await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest)).await.expect("server closes").unwrap();
    assert!(rest.is_empty());
}

/// BLOCK_STATUS without `base:allocation` negotiated is EINVAL (a simple reply: no structured
/// replies either).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_without_a_context_is_invalid() {
    for engine_io in [true, false] {
        let s = server_with(4 * MIB, engine_io).await;
        let mut c = newstyle(&s.socket).await;
        let mut go = 0u32.to_be_bytes().to_vec();
        go.extend(0u16.to_be_bytes());
        option(&mut c, codec::opt::GO, &go).await;
        c.write_all(&request(codec::cmd::BLOCK_STATUS, 0, 1, 0, 4096)).await.unwrap();
        let mut h = [0u8; 16];
        c.read_exact(&mut h).await.unwrap();
        assert_eq!(h, codec::simple_reply(codec::errno::EINVAL, 1), "engine_io {engine_io}");
    }
}

/// Both transmission paths answer with the one validator (`codec::check_request`): on a
/// read-only export a WRITE, TRIM or WRITE_ZEROES is EPERM whatever its length (a zero-length one
/// included, which never reaches the volume), an unaligned WRITE is EINVAL (alignment first), a
/// TRIM of no whole sector EPERM; reads and FLUSH work; a payload over the maximum ends the
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_exports_refuse_modifications_on_both_paths() {
    use codec::{cmd, errno};
    for (engine_io, mode) in [(true, SendMode::Inline), (true, SendMode::Queue), (false, SendMode::Inline)] {
        let export = RamExport { read_only: true, ..RamExport::new("ram", 4 * MIB) };
        let s = server_export(export, NbdOptions { engine_io, ..NbdOptions::new("ram") }, mode).await;
        let mut c = newstyle(&s.socket).await;
        let mut go = 0u32.to_be_bytes().to_vec();
        go.extend(0u16.to_be_bytes());
        option(&mut c, codec::opt::GO, &go).await;
        let mut w = request(cmd::WRITE, 0, 1, 0, 4096);
        w.extend([7u8; 4096]);
        let cases: [(Vec<u8>, u32); 7] = [
            (w, errno::EPERM),
            (request(cmd::WRITE, 0, 2, 4096, 0), errno::EPERM),
            (request(cmd::TRIM, 0, 3, 0, 0), errno::EPERM),
            (request(cmd::TRIM, codec::cflag::FUA, 4, 100, 200), errno::EPERM),
            (request(cmd::WRITE_ZEROES, 0, 5, 0, 8192), errno::EPERM),
            ([request(cmd::WRITE, 0, 6, 100, 512), vec![1; 512]].concat(), errno::EINVAL),
            (request(cmd::FLUSH, 0, 7, 0, 0), 0),
        ];
        for (bytes, want) in &cases {
            c.write_all(bytes).await.unwrap();
            let mut h = [0u8; 16];
            c.read_exact(&mut h).await.unwrap();
            let cookie = u64::from_be_bytes(h[8..].try_into().unwrap());
            assert_eq!(h, codec::simple_reply(*want, cookie), "engine_io {engine_io} {mode:?}, request {cookie}");
        }
        c.write_all(&request(cmd::READ, 0, 8, 0, 4096)).await.unwrap();
        let mut h = [0u8; 16 + 4096];
        c.read_exact(&mut h).await.unwrap();
        assert_eq!(h[..16], codec::simple_reply(0, 8), "engine_io {engine_io} {mode:?}");
        assert!(h[16..].iter().all(|&b| b == 0), "nothing was written");
        // A payload over the maximum: the connection ends before it is read.
        c.write_all(&request(cmd::WRITE, 0, 9, 0, tyche_init::nbd::MAX_REQUEST + 512)).await.unwrap();
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest)).await.expect("closed");
        assert!(rest.is_empty(), "engine_io {engine_io} {mode:?}: {rest:?}");
    }
}

/// `nbdinfo --map` over the in-process target: holes where nothing was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_map_shows_holes() {
    if !have("nbdinfo") || !have("nbdcopy") {
        return;
    }
    for engine_io in [true, false] {
        let s = server_with(16 * MIB, engine_io).await;
        let u = uri(&s.socket);
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::write(&data, vec![0x77u8; MIB as usize]).unwrap();
        // 1 MiB of data at the start (nbdcopy writes a 1 MiB source from offset 0).
        let u2 = u.clone();
        tokio::task::spawn_blocking(move || run(Command::new("nbdcopy").arg(&data).arg(&u2))).await.unwrap();
        let map = tokio::task::spawn_blocking(move || run(Command::new("nbdinfo").arg("--map").arg(&u))).await.unwrap();
        let rows: Vec<(u64, u64, u32)> = map
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
            })
            .collect();
        assert_eq!(rows, [(0, MIB, 0), (MIB, 15 * MIB, 3)], "engine_io {engine_io}:\n{map}");
    }
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
        tyche_testkit::cannot_run(
            "fio_random_writes_verify",
            "fio with the nbd engine not installed (apt-get install fio)",
        );
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
    if !have("nbdcopy") {
        return;
    }
    if !tyched.exists() {
        let why = format!("no tyched binary at {} (cargo build -p tyched)", tyched.display());
        tyche_testkit::cannot_run("interop_with_tyched", &why);
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    for (script, queues, steer, mtu, needles) in [
        ("tcp-tyched.sh", "1", "none", "3000", &["TCP NBDCOPY ROUND TRIP OK"][..]),
        (
            "block-status.sh",
            "1",
            "none",
            "3000",
            &[
                "BLOCK STATUS NBDINFO MAP OK",
                "BLOCK STATUS QEMU-IMG MAP OK",
                "SPARSE QEMU-IMG CONVERT OK",
                "SPARSE NBDCOPY OK",
                "BLOCK STATUS NBDSH OK",
                "BLOCK STATUS EXTENDED HEADERS OK",
                "BLOCK STATUS TASKS PATH OK",
            ][..],
        ),
        (
            "xdp-veth-nbd.sh",
            "1",
            "none",
            "3000",
            &["XDP DISCOVER OK", "XDP NBDCOPY ROUND TRIP OK", "XDP FAILOVER ROUND TRIP OK"][..],
        ),
        // A queue and an AF_XDP socket per channel on both sides (two-queue veth).
        (
            "xdp-veth-nbd.sh",
            "2",
            "none",
            "3000",
            &["XDP DISCOVER OK", "XDP NBDCOPY ROUND TRIP OK", "XDP QUEUES OK", "XDP FAILOVER ROUND TRIP OK"][..],
        ),
        // The same with a queue address per target socket, named in ACCEPT (flow rules refused
        // on veth, clearly).
        (
            "xdp-veth-nbd.sh",
            "2",
            "queue-mac-no-rules",
            "3000",
            &[
                "XDP STEER RULES REFUSED ON VETH OK",
                "XDP NBDCOPY ROUND TRIP OK",
                "XDP QUEUES OK",
                "XDP STEER QUEUE ADDRESSES OK",
                "XDP FAILOVER ROUND TRIP OK",
            ][..],
        ),
        // Jumbo frames: multi-buffer AF_XDP frames, 128 KiB blocks with no payload copied.
        (
            "xdp-veth-nbd.sh",
            "1",
            "none",
            "9000",
            &[
                "XDP DISCOVER OK",
                "XDP NBDCOPY ROUND TRIP OK",
                "XDP FIO 128K VERIFY OK",
                "XDP FIO 128K ZERO COPY OK",
                "XDP FAILOVER ROUND TRIP OK",
            ][..],
        ),
    ] {
        let out = Command::new("bash")
            .arg(dir.join(script))
            .env("BIN", me)
            .env("TYCHED", &tyched)
            .env("FIND_TARGET", "1")
            .env("QUEUES", queues)
            .env("STEER", steer)
            .env("MTU", mtu)
            .output()
            .expect("run the script");
        let text = String::from_utf8_lossy(&out.stdout);
        for n in needles {
            assert!(text.contains(n), "{script}: no {n:?}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

/// Option haggling up to transmission: extended headers and/or structured replies, then
/// `base:allocation`, then NBD_OPT_GO. Returns the connection and the transmission flags.
async fn negotiate(socket: &Path, extended: bool, structured: bool) -> (UnixStream, u16) {
    let mut c = newstyle(socket).await;
    if extended {
        assert_eq!(option(&mut c, codec::opt::EXTENDED_HEADERS, &[]).await, [(codec::rep::ACK, vec![])]);
    }
    if structured {
        let want = if extended { codec::rep::ERR_EXT_HEADER_REQD } else { codec::rep::ACK };
        assert_eq!(option(&mut c, codec::opt::STRUCTURED_REPLY, &[]).await, [(want, vec![])]);
    }
    if extended || structured {
        let r = option(&mut c, codec::opt::SET_META_CONTEXT, &meta_request("ram", &["base:allocation"])).await;
        assert_eq!(r.last().unwrap().0, codec::rep::ACK);
    }
    let mut go = 0u32.to_be_bytes().to_vec();
    go.extend(0u16.to_be_bytes());
    let r = option(&mut c, codec::opt::GO, &go).await;
    let flags = u16::from_be_bytes(r[0].1[10..12].try_into().unwrap());
    (c, flags)
}

/// An extended request header (32 bytes, 64-bit length).
fn ext_request(cmd: u16, flags: u16, cookie: u64, off: u64, len: u64) -> Vec<u8> {
    let mut b = codec::EXTENDED_REQUEST_MAGIC.to_be_bytes().to_vec();
    b.extend(flags.to_be_bytes());
    b.extend(cmd.to_be_bytes());
    b.extend(cookie.to_be_bytes());
    b.extend(off.to_be_bytes());
    b.extend(len.to_be_bytes());
    b
}

/// One extended reply chunk: (flags, type, cookie, the header's offset, payload).
async fn ext_chunk(c: &mut UnixStream) -> (u16, u16, u64, u64, Vec<u8>) {
    let mut h = [0u8; 32];
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), codec::EXTENDED_REPLY_MAGIC, "{h:?}");
    let len = u64::from_be_bytes(h[24..32].try_into().unwrap());
    assert!(len <= 64 << 20, "a chunk of {len} bytes");
    let mut p = vec![0u8; len as usize];
    c.read_exact(&mut p).await.unwrap();
    (
        u16::from_be_bytes([h[4], h[5]]),
        u16::from_be_bytes([h[6], h[7]]),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
        u64::from_be_bytes(h[16..24].try_into().unwrap()),
        p,
    )
}

/// Whether the server closed the connection (a hard disconnect) within 10 s.
async fn closed(c: &mut UnixStream) -> bool {
    let mut rest = Vec::new();
    matches!(tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest)).await, Ok(Ok(_)) | Ok(Err(_)))
}

/// NBD_OPT_EXTENDED_HEADERS on a raw socket, engine path: negotiation rules, every command with
/// 64-bit lengths, the errors that keep the session and those that end it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_extended_headers() {
    raw_extended(true, SendMode::Inline).await;
}

/// The same in queue send mode: the reader thread meets the errors that end the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_extended_headers_in_queue_send_mode() {
    raw_extended(true, SendMode::Queue).await;
}

/// The same with a task per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_extended_headers_with_tasks() {
    raw_extended(false, SendMode::Inline).await;
}

async fn raw_extended(engine_io: bool, mode: SendMode) {
    use codec::{chunk as ch, cmd, errno, rep};
    let size = 64 * MIB;
    let s = server_mode(size, engine_io, mode).await;
    let mut c = newstyle(&s.socket).await;
    // Data with the option: invalid; then ACK, twice; structured replies can no longer be had.
    assert_eq!(option(&mut c, codec::opt::EXTENDED_HEADERS, &[0]).await, [(rep::ERR_INVALID, vec![])]);
    for _ in 0..2 {
        assert_eq!(option(&mut c, codec::opt::EXTENDED_HEADERS, &[]).await, [(rep::ACK, vec![])]);
    }
    assert_eq!(option(&mut c, codec::opt::STRUCTURED_REPLY, &[]).await, [(rep::ERR_EXT_HEADER_REQD, vec![])]);
    let ctx = codec::rep_meta_context(codec::BASE_ALLOCATION_ID, codec::BASE_ALLOCATION);
    let r = option(&mut c, codec::opt::SET_META_CONTEXT, &meta_request("ram", &["base:allocation"])).await;
    assert_eq!(r, [(rep::META_CONTEXT, ctx), (rep::ACK, vec![])], "no structured replies needed");
    let mut go = 0u32.to_be_bytes().to_vec();
    go.extend(0u16.to_be_bytes());
    let r = option(&mut c, codec::opt::GO, &go).await;
    let flags = u16::from_be_bytes(r[0].1[10..12].try_into().unwrap());
    assert_ne!(flags & codec::tflag::SEND_DF, 0, "SEND_DF with extended headers");

    let pl = codec::cflag::PAYLOAD_LEN;
    // A write (PAYLOAD_LEN), answered NONE: no simple replies with extended headers.
    let mut w = ext_request(cmd::WRITE, pl | codec::cflag::FUA, 1, 65536, 8192);
    w.extend([0x5a; 8192]);
    c.write_all(&w).await.unwrap();
    assert_eq!(ext_chunk(&mut c).await, (ch::FLAG_DONE, ch::NONE, 1, 65536, vec![]));
    // A write without PAYLOAD_LEN, as qemu sends every write: its length is still its payload
    // (the same bytes over the first write's first half, so the map below stays as it was).
    let mut w = ext_request(cmd::WRITE, 0, 2, 65536, 4096);
    w.extend([0x5a; 4096]);
    c.write_all(&w).await.unwrap();
    assert_eq!(ext_chunk(&mut c).await, (ch::FLAG_DONE, ch::NONE, 2, 65536, vec![]));
    // A read with a payload: the payload is read and dropped, EINVAL.
    let mut r = ext_request(cmd::READ, pl, 3, 0, 512);
    r.extend([0xee; 512]);
    c.write_all(&r).await.unwrap();
    let (_, t, cookie, _, p) = ext_chunk(&mut c).await;
    assert_eq!((t, cookie, p[3] as u32), (ch::ERROR, 3, errno::EINVAL));
    // A read: one OFFSET_DATA chunk; the header has the request's offset.
    c.write_all(&ext_request(cmd::READ, 0, 4, 65536 + 100, 20)).await.unwrap();
    let (f, t, cookie, off, p) = ext_chunk(&mut c).await;
    assert_eq!((f, t, cookie, off), (ch::FLAG_DONE, ch::OFFSET_DATA, 4, 65536 + 100));
    assert_eq!(p[..8], (65536u64 + 100).to_be_bytes());
    assert_eq!(p[8..], [0x5a; 20]);
    // Reads over the maximum (64-bit length): EOVERFLOW; past the end: EINVAL.
    c.write_all(&ext_request(cmd::READ, 0, 5, 0, 33 * MIB)).await.unwrap();
    let (_, t, _, _, p) = ext_chunk(&mut c).await;
    assert_eq!((t, p[3] as u32), (ch::ERROR, errno::EOVERFLOW));
    c.write_all(&ext_request(cmd::READ, 0, 6, 0, 1 << 40)).await.unwrap();
    let (_, t, _, _, p) = ext_chunk(&mut c).await;
    assert_eq!((t, p[3] as u32), (ch::ERROR, errno::EINVAL));
    // Block status of the whole export in one request: BLOCK_STATUS_EXT, 64-bit descriptors.
    c.write_all(&ext_request(cmd::BLOCK_STATUS, 0, 7, 0, size)).await.unwrap();
    let (f, t, cookie, _, p) = ext_chunk(&mut c).await;
    assert_eq!((f, t, cookie), (ch::FLAG_DONE, ch::BLOCK_STATUS_EXT, 7));
    assert_eq!(p[..4], codec::BASE_ALLOCATION_ID.to_be_bytes());
    let n = u32::from_be_bytes(p[4..8].try_into().unwrap()) as usize;
    assert_eq!(p.len(), 8 + 16 * n, "the descriptor count");
    let ext: Vec<(u64, u64)> = p[8..]
        .chunks_exact(16)
        .map(|e| (u64::from_be_bytes(e[..8].try_into().unwrap()), u64::from_be_bytes(e[8..].try_into().unwrap())))
        .collect();
    let hz = (codec::state::HOLE | codec::state::ZERO) as u64;
    assert_eq!(ext[..2], [(65536, hz), (8192, 0)], "{ext:?}");
    // Zeroes and trim over ranges of 64-bit lengths (the whole export), a FLUSH, CACHE.
    c.write_all(&ext_request(cmd::WRITE_ZEROES, 0, 8, 0, size)).await.unwrap();
    assert_eq!(ext_chunk(&mut c).await, (ch::FLAG_DONE, ch::NONE, 8, 0, vec![]));
    c.write_all(&ext_request(cmd::TRIM, codec::cflag::FUA, 9, 0, size)).await.unwrap();
    assert_eq!(ext_chunk(&mut c).await, (ch::FLAG_DONE, ch::NONE, 9, 0, vec![]));
    c.write_all(&ext_request(cmd::FLUSH, 0, 10, 0, 0)).await.unwrap();
    assert_eq!(ext_chunk(&mut c).await.1, ch::NONE);
    c.write_all(&ext_request(cmd::CACHE, 0, 11, 0, size)).await.unwrap();
    assert_eq!(ext_chunk(&mut c).await.1, ch::NONE);
    c.write_all(&ext_request(cmd::READ, 0, 12, 65536, 4096)).await.unwrap();
    let (_, t, _, _, p) = ext_chunk(&mut c).await;
    assert_eq!(t, ch::OFFSET_DATA);
    assert!(p[8..].iter().all(|&b| b == 0), "zeroed");
    // A payload over the maximum: the server hangs up (it will not read 33 MiB it cannot use).
    c.write_all(&ext_request(cmd::WRITE, pl, 13, 0, 33 * MIB)).await.unwrap();
    assert!(closed(&mut c).await, "a payload over the maximum ends the session");

    // The wrong header for what was negotiated, and a bad magic: the session ends (once a whole
    // header's bytes are in: a compact one is followed by the start of the next request).
    for (extended, bad) in [
        (true, request(cmd::READ, 0, 1, 0, 512).into_iter().chain(request(cmd::READ, 0, 2, 0, 512)).collect()),
        (false, ext_request(cmd::READ, 0, 1, 0, 512)),
        (true, [0xde, 0xad, 0xbe, 0xef].into_iter().chain([0u8; 28]).collect()),
    ] {
        let (mut c, _) = negotiate(&s.socket, extended, false).await;
        c.write_all(&bad).await.unwrap();
        assert!(closed(&mut c).await, "extended {extended}: {bad:x?}");
    }
    // NBD_OPT_EXPORT_NAME after extended headers: the session ends (no way to answer an error).
    let mut c = newstyle(&s.socket).await;
    option(&mut c, codec::opt::EXTENDED_HEADERS, &[]).await;
    let mut o = codec::IHAVEOPT.to_be_bytes().to_vec();
    o.extend(codec::opt::EXPORT_NAME.to_be_bytes());
    o.extend(0u32.to_be_bytes());
    c.write_all(&o).await.unwrap();
    assert!(closed(&mut c).await);
}

/// The chunks of one structured or extended reply, to its DONE: (type, offset, payload).
async fn reply_chunks(c: &mut UnixStream, extended: bool) -> Vec<(u16, u64, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        let (f, t, p) = if extended {
            let (f, t, _, _, p) = ext_chunk(c).await;
            (f, t, p)
        } else {
            let (f, t, _, p) = chunk(c).await;
            (f, t, p)
        };
        let off = if p.len() >= 8 { u64::from_be_bytes(p[..8].try_into().unwrap()) } else { 0 };
        out.push((t, off, p));
        if f & codec::chunk::FLAG_DONE != 0 {
            return out;
        }
    }
}

/// Reads of holes come back as NBD_REPLY_TYPE_OFFSET_HOLE chunks (no zeroes on the wire), data
/// as OFFSET_DATA, with structured replies and with extended headers, on both paths; with
/// NBD_CMD_FLAG_DF one data chunk; contents right either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_reads_answer_holes_as_hole_chunks() {
    use codec::{chunk as ch, cmd};
    for engine_io in [true, false] {
        let s = server_with(8 * MIB, engine_io).await;
        for extended in [false, true] {
            let (mut c, flags) = negotiate(&s.socket, extended, !extended).await;
            assert_ne!(flags & codec::tflag::SEND_DF, 0);
            // Data: 8 KiB at 1 MiB, 512 bytes at 2 MiB + 512 (4 KiB pages on the target).
            let mut want = vec![0u8; 3 * MIB as usize];
            for (at, n, v) in [(MIB, 8192u64, 0x11u8), (2 * MIB + 512, 512, 0x22)] {
                let mut w = if extended {
                    ext_request(cmd::WRITE, codec::cflag::PAYLOAD_LEN, 1, at, n)
                } else {
                    request(cmd::WRITE, 0, 1, at, n as u32)
                };
                w.extend(std::iter::repeat_n(v, n as usize));
                want[at as usize..(at + n) as usize].fill(v);
                c.write_all(&w).await.unwrap();
                if extended {
                    ext_chunk(&mut c).await;
                } else {
                    let mut h = [0u8; 16];
                    c.read_exact(&mut h).await.unwrap();
                    assert_eq!(h, codec::simple_reply(0, 1));
                }
            }
            // 2 MiB + 1000 from 512 K - 100 (unaligned both ends).
            let (off, len) = (512 * 1024 - 100, 2 * MIB + 1000);
            let req = |flags, cookie| {
                if extended {
                    ext_request(cmd::READ, flags, cookie, off, len)
                } else {
                    request(cmd::READ, flags, cookie, off, len as u32)
                }
            };
            c.write_all(&req(0, 2)).await.unwrap();
            let chunks = reply_chunks(&mut c, extended).await;
            let mut got = vec![0xffu8; len as usize];
            let (mut holes, mut data) = (0u64, 0u64);
            for (t, at, p) in &chunks {
                let rel = (at - off) as usize;
                match *t {
                    ch::OFFSET_HOLE => {
                        let n = u32::from_be_bytes(p[8..12].try_into().unwrap()) as usize;
                        got[rel..rel + n].fill(0);
                        holes += n as u64;
                    }
                    ch::OFFSET_DATA => {
                        got[rel..rel + p.len() - 8].copy_from_slice(&p[8..]);
                        data += p.len() as u64 - 8;
                    }
                    t => panic!("chunk type {t}"),
                }
            }
            assert_eq!(holes + data, len, "the chunks cover the read exactly: {chunks:?}");
            assert!(holes >= 2 * MIB - 64 * 1024, "extended {extended} engine {engine_io}: {holes} bytes of holes");
            assert!(got == want[off as usize..(off + len) as usize], "contents");
            // DF: one data chunk, zeroes and all.
            c.write_all(&req(codec::cflag::DF, 3)).await.unwrap();
            let chunks = reply_chunks(&mut c, extended).await;
            assert_eq!(chunks.len(), 1);
            assert_eq!(chunks[0].0, ch::OFFSET_DATA);
            assert!(chunks[0].2[8..] == want[off as usize..(off + len) as usize]);
        }
    }
}

/// python3-libnbd (nbdsh, libnbd 1.14: no extended headers in the client) reads holes as hole
/// chunks through `pread_structured`, data as data chunks, contents right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdsh_pread_structured_sees_hole_chunks() {
    if !have("nbdsh") {
        return;
    }
    for engine_io in [true, false] {
        let s = server_with(16 * MIB, engine_io).await;
        let u = uri(&s.socket);
        let script = r#"
import nbd
h.connect_uri(URI)
assert h.get_structured_replies_negotiated()
h.pwrite(b"\x5a" * 65536, 4 << 20)
h.pwrite(b"\xa5" * 4096, (6 << 20) + 8192)
want = bytearray(8 << 20)
want[4 << 20:(4 << 20) + 65536] = b"\x5a" * 65536
want[(6 << 20) + 8192:(6 << 20) + 12288] = b"\xa5" * 4096
chunks = []
def cb(buf, off, status, err):
    chunks.append((status, off, len(buf)))
    return 0
buf = h.pread_structured(8 << 20, 0, cb)
assert buf == bytes(want), "contents"
holes = sum(n for s, o, n in chunks if s == nbd.READ_HOLE)
data = sum(n for s, o, n in chunks if s == nbd.READ_DATA)
assert holes + data == 8 << 20, chunks
assert data <= 256 << 10 and holes >= 7 << 20, chunks
chunks.clear()
buf = h.pread_structured(8 << 20, 0, cb, flags=nbd.CMD_FLAG_DF)
assert buf == bytes(want) and len(chunks) == 1 and chunks[0][0] == nbd.READ_DATA, chunks
print("PREAD STRUCTURED OK", len(chunks))
"#
        .replace("URI", &format!("{u:?}"));
        let out = tokio::task::spawn_blocking(move || {
            run(Command::new("nbdsh").env("PATH", SYSTEM_PATH).arg("-c").arg(script))
        })
        .await
        .unwrap();
        assert!(out.contains("PREAD STRUCTURED OK"), "engine_io {engine_io}: {out}");
    }
}

/// What hole-aware reads cost and save: `nbdcopy --no-extents` (every byte read with READ, no
/// block status of its own) from a 256 MiB export to `null:`, all data or 1/16 data, with
/// hole-aware reads at the default threshold and off, for request sizes of 256 KiB and 1 MiB.
/// Prints a table (`cargo test -p tyche-init --test nbd -- --ignored bench_hole_reads
/// --nocapture`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check"]
async fn bench_hole_reads() {
    if !have("nbdcopy") {
        return;
    }
    let size = 256 * MIB;
    println!("| export | request | engine | hole-aware | MiB/s | MiB read from the target |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (name, stride) in [("all data", 1u64), ("1/16 data", 16)] {
        for engine_io in [true, false] {
            for holes in [Some(tyche_init::nbd::HOLE_READ_MIN), None] {
                let s =
                    server_opts(size, NbdOptions { engine_io, hole_read_min: holes, ..NbdOptions::new("ram") }).await;
                let u = uri(&s.socket);
                // Fill: 64 KiB of data in every `stride` 64 KiB.
                let dir = tempfile::tempdir().unwrap();
                let src = dir.path().join("src");
                let mut v = vec![0u8; size as usize];
                for (i, c) in v.chunks_mut(65536).enumerate() {
                    if i as u64 % stride == 0 {
                        c.fill(i as u8 | 1);
                    }
                }
                std::fs::write(&src, &v).unwrap();
                let u2 = u.clone();
                tokio::task::spawn_blocking(move || {
                    run(Command::new("nbdcopy").arg("--no-extents").arg(&src).arg(&u2))
                })
                .await
                .unwrap();
                for req in [262144, 1 << 20] {
                    let u = u.clone();
                    let before = s.client.stats().await.unwrap().bytes_read;
                    let best = tokio::task::spawn_blocking(move || {
                        (0..5)
                            .map(|_| {
                                let t = std::time::Instant::now();
                                run(Command::new("nbdcopy")
                                    .args(["--no-extents", "--connections=1", "--requests=16"])
                                    .arg(format!("--request-size={req}"))
                                    .arg(&u)
                                    .arg("null:"));
                                t.elapsed()
                            })
                            .min()
                            .unwrap()
                    })
                    .await
                    .unwrap();
                    let mibs = size as f64 / MIB as f64 / best.as_secs_f64();
                    let moved = (s.client.stats().await.unwrap().bytes_read - before) / 5 / MIB;
                    let on = if holes.is_some() { "on" } else { "off" };
                    let eng = if engine_io { "engine" } else { "tasks" };
                    println!("| {name} | {} KiB | {eng} | {on} | {mibs:.0} | {moved} |", req >> 10);
                }
            }
        }
    }
}

/// Queue send mode with a connection limit of 2 requests: the reader thread runs ahead of the
/// engine (requests wait in its hand-off while the connection is at its limit) and every pipelined
/// request still completes with the right data; then a request with a bad magic ends the
/// connection through the reader thread, and a new connection is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_send_mode_holds_back_a_pipelining_client() {
    for mode in [SendMode::Queue, SendMode::Inline] {
        let s = server_full(16 * MIB, NbdOptions { max_inflight: 2, ..NbdOptions::new("ram") }, mode).await;
        let (mut c, _) = negotiate(&s.socket, false, false).await;
        let n = 64u64;
        let mut batch = Vec::new();
        for k in 0..n {
            let mut w = request(codec::cmd::WRITE, 0, k, k * 65536, 65536);
            w.extend(std::iter::repeat_n(k as u8 ^ 0x5a, 65536));
            batch.extend(w);
        }
        c.write_all(&batch).await.unwrap();
        let mut h = [0u8; 16];
        let mut seen = std::collections::HashSet::new();
        while seen.len() < n as usize {
            tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut h)).await.expect("reply").unwrap();
            let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
            assert_eq!(h, codec::simple_reply(0, cookie));
            assert!(seen.insert(cookie), "two replies to {cookie}");
        }
        let mut batch = Vec::new();
        for k in 0..n {
            batch.extend(request(codec::cmd::READ, 0, 1000 + k, k * 65536, 65536));
        }
        c.write_all(&batch).await.unwrap();
        for _ in 0..n {
            c.read_exact(&mut h).await.unwrap();
            let k = u64::from_be_bytes(h[8..16].try_into().unwrap()) - 1000;
            let mut d = vec![0u8; 65536];
            c.read_exact(&mut d).await.unwrap();
            assert!(d.iter().all(|&b| b == k as u8 ^ 0x5a), "{mode}: read {k} returns what write {k} wrote");
        }
        // A bad magic: a hard disconnect.
        let mut bad = request(codec::cmd::READ, 0, 7, 0, 512);
        bad[0] ^= 0xff;
        c.write_all(&bad).await.unwrap();
        assert!(closed(&mut c).await, "{mode}: a bad request ends the connection");
        let (mut c, _) = negotiate(&s.socket, false, false).await;
        c.write_all(&request(codec::cmd::READ, 0, 8, 0, 512)).await.unwrap();
        c.read_exact(&mut h).await.unwrap();
        assert_eq!(h, codec::simple_reply(0, 8), "{mode}: a new connection is served");
        let send = s.client.report().await.expect("report").send;
        let (mine, other) = match mode {
            SendMode::Inline => (send.inline, send.handed_over),
            SendMode::Queue => (send.handed_over, send.inline),
        };
        assert!(mine > 2 * n && other == 0, "{mode}: {send:?}");
    }
}

/// What a connection negotiated, for [`framing_conformance`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Simple replies only (the kernel's NBD client).
    Simple,
    /// Structured replies (libnbd 1.14, qemu 7.2).
    Structured,
    /// Extended headers (qemu 8.2 and later).
    Extended,
}

/// One request of the conformance stream: what its reply may carry.
struct Sent {
    command: u16,
    length: u64,
}

/// The NBD framing rules on a raw socket, on both I/O paths and every reply style: every
/// command (and two unknown ones) with every combination of the six command flags, lengths of
/// zero, a sector, unaligned and over the maximum, WRITEs with and without
/// NBD_CMD_FLAG_PAYLOAD_LEN (qemu's), payloads on commands that have none; all pipelined in one
/// stream written in pieces of 1 to 97 bytes (headers split anywhere). Every request gets exactly
/// one final reply with a known NBD error, and afterwards the stream still parses: data written
/// before the storm reads back. Then a payload over the maximum ends the connection (the hard
/// disconnect the protocol allows; it cannot be framed) and a new connection is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framing_conformance() {
    use codec::{cflag, cmd, errno};
    for engine_io in [true, false] {
        let s = server_with(16 * MIB, engine_io).await;
        for framing in [Framing::Simple, Framing::Structured, Framing::Extended] {
            let on = format!("engine_io {engine_io}, {framing:?}");
            let extended = framing == Framing::Extended;
            let (c, _) = negotiate(&s.socket, extended, framing == Framing::Structured).await;
            let header = |command: u16, flags: u16, cookie: u64, off: u64, len: u64| {
                if extended {
                    ext_request(command, flags, cookie, off, len)
                } else {
                    request(command, flags, cookie, off, len as u32)
                }
            };
            let mut stream = Vec::new();
            let mut sent = Vec::new();
            // A known block first, read back after the storm.
            let mut w = header(cmd::WRITE, if extended { cflag::PAYLOAD_LEN } else { 0 }, 0, 8 * MIB, 4096);
            w.extend([0xc3; 4096]);
            stream.extend(w);
            sent.push(Sent { command: cmd::WRITE, length: 4096 });
            let commands =
                [cmd::READ, cmd::WRITE, cmd::FLUSH, cmd::TRIM, cmd::CACHE, cmd::WRITE_ZEROES, cmd::BLOCK_STATUS, 8, 99];
            let lengths = [0u64, 512, 100, 4096 + 512, 33 * MIB];
            for &command in &commands {
                for flags in 0..64u16 {
                    for &length in &lengths {
                        let payload_flag = flags & cflag::PAYLOAD_LEN != 0;
                        // A payload over the maximum ends the connection: that case comes last.
                        let payload = command == cmd::WRITE || extended && payload_flag;
                        if payload && length > 4 * MIB {
                            continue;
                        }
                        let cookie = sent.len() as u64;
                        // Offsets below 8 MiB: the known block stays as it was.
                        let off = (cookie * 4096) % (4 * MIB);
                        let mut r = header(command, flags, cookie, off, length);
                        if payload {
                            r.extend(std::iter::repeat_n(cookie as u8, length as usize));
                        }
                        stream.extend(r);
                        sent.push(Sent { command, length });
                    }
                }
            }
            // Flags no command has (bits 6 and 15) on a READ and a WRITE.
            for (command, flags) in [(cmd::READ, 1u16 << 6), (cmd::WRITE, 1 << 15)] {
                let cookie = sent.len() as u64;
                let mut r = header(command, flags, cookie, 0, 512);
                if command == cmd::WRITE {
                    r.extend([0u8; 512]);
                }
                stream.extend(r);
                sent.push(Sent { command, length: 512 });
            }
            let last = sent.len() as u64;
            stream.extend(header(cmd::READ, 0, last, 8 * MIB, 4096));
            sent.push(Sent { command: cmd::READ, length: 4096 });

            let (mut rd, mut wr) = c.into_split();
            let writer = tokio::spawn(async move {
                let mut x = 0x2545_f491_4f6c_dd1du64;
                let mut at = 0;
                while at < stream.len() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let n = (1 + x % 97) as usize;
                    let end = (at + n).min(stream.len());
                    wr.write_all(&stream[at..end]).await.unwrap();
                    at = end;
                }
                wr
            });
            let mut done = vec![false; sent.len()];
            let mut left = sent.len();
            let known = [
                0,
                errno::EPERM,
                errno::EIO,
                errno::ENOMEM,
                errno::EINVAL,
                errno::ENOSPC,
                errno::EOVERFLOW,
                errno::ENOTSUP,
            ];
            let mut errors = std::collections::BTreeMap::new();
            while left > 0 {
                let (cookie, error, final_) = tokio::time::timeout(Duration::from_secs(30), async {
                    let magic = rd.read_u32().await.unwrap();
                    match magic {
                        codec::SIMPLE_REPLY_MAGIC => {
                            assert_ne!(framing, Framing::Extended, "{on}: a simple reply with extended headers");
                            let error = rd.read_u32().await.unwrap();
                            let cookie = rd.read_u64().await.unwrap();
                            let req = &sent[cookie as usize];
                            if error == 0 && req.command == cmd::READ {
                                assert_eq!(framing, Framing::Simple, "{on}: a READ's data in a simple reply");
                                let mut d = vec![0u8; req.length as usize];
                                rd.read_exact(&mut d).await.unwrap();
                                if cookie == last {
                                    assert!(d.iter().all(|&b| b == 0xc3), "{on}: the known block");
                                }
                            }
                            (cookie, error, true)
                        }
                        codec::STRUCTURED_REPLY_MAGIC | codec::EXTENDED_REPLY_MAGIC => {
                            let ext = magic == codec::EXTENDED_REPLY_MAGIC;
                            assert_eq!(ext, extended, "{on}: reply magic {magic:#x}");
                            let flags = rd.read_u16().await.unwrap();
                            let kind = rd.read_u16().await.unwrap();
                            let cookie = rd.read_u64().await.unwrap();
                            let len = if ext {
                                rd.read_u64().await.unwrap(); // offset
                                rd.read_u64().await.unwrap()
                            } else {
                                rd.read_u32().await.unwrap() as u64
                            };
                            assert!(len <= 33 * MIB, "{on}: a chunk of {len} bytes");
                            let mut p = vec![0u8; len as usize];
                            rd.read_exact(&mut p).await.unwrap();
                            let error =
                                if kind & 0x8000 != 0 { u32::from_be_bytes(p[..4].try_into().unwrap()) } else { 0 };
                            if cookie == last && kind == codec::chunk::OFFSET_DATA {
                                assert!(p[8..].iter().all(|&b| b == 0xc3), "{on}: the known block");
                            }
                            (cookie, error, flags & codec::chunk::FLAG_DONE != 0)
                        }
                        m => panic!("{on}: reply magic {m:#x}: the stream lost its framing"),
                    }
                })
                .await
                .unwrap_or_else(|_| panic!("{on}: no reply in 30 s, {left} requests unanswered"));
                let k = cookie as usize;
                assert!(k < sent.len() && !done[k], "{on}: a reply to cookie {cookie}, unknown or answered");
                assert!(known.contains(&error), "{on}: error {error} to command {}", sent[k].command);
                *errors.entry(error).or_insert(0u32) += 1;
                if final_ {
                    done[k] = true;
                    left -= 1;
                }
            }
            assert!(done[last as usize], "{on}: the read after the storm");
            assert!(errors.get(&0).is_some_and(|&n| n > 100), "{on}: few successes: {errors:?}");
            assert!(errors.get(&errno::EINVAL).is_some_and(|&n| n > 100), "{on}: few refusals: {errors:?}");
            // A payload over the maximum: the connection ends (it cannot be framed).
            let mut wr = writer.await.unwrap();
            let big = 33 * MIB;
            wr.write_all(&header(cmd::WRITE, if extended { cflag::PAYLOAD_LEN } else { 0 }, last + 1, 0, big))
                .await
                .unwrap();
            let mut c = rd.reunite(wr).unwrap();
            assert!(closed(&mut c).await, "{on}: a payload over the maximum ends the connection");
        }
        // And the server goes on serving.
        let (mut c, _) = negotiate(&s.socket, false, false).await;
        c.write_all(&request(cmd::READ, 0, 1, 8 * MIB, 512)).await.unwrap();
        let mut h = [0u8; 16];
        c.read_exact(&mut h).await.unwrap();
        assert_eq!(h, codec::simple_reply(0, 1));
    }
}
