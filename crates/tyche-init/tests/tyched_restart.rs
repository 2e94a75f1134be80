//! tyche-init against an in-process `tyched` on a file export, stopped (as by SIGTERM) and
//! started again on the same file while writes are in flight: the initiator opens a new session
//! by itself, the application sees no error, a FLUSH afterwards succeeds (the stopping target
//! flushed and said DISCONNECT SHUTDOWN), and everything reads back.

use std::path::Path;
use std::time::Duration;

use tokio::task::JoinSet;
use tyche_init::loopback::{initiator_timers, Shared};
use tyche_init::{connect, InitiatorConfig, Link};
use tyche_transport::{FrameTransport, MemLink, MemPort};
use tyche_wire::MacAddr;
use tyched::{Config, ExportConfig, Nic, Target, TargetHandle};

const MIB: u64 = 1 << 20;
const LIMIT: Duration = Duration::from_secs(60);

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A target process on `file`, on the target ends of the links (which outlive it, as NICs do).
fn start_target(file: &Path, ports: &[Shared<MemPort>]) -> TargetHandle {
    let cfg = Config { exports: vec![ExportConfig::file("f", file, Some(16 * MIB))], workers: 2, ..Config::default() };
    let nics = ports
        .iter()
        .enumerate()
        .map(|(k, p)| Nic { name: format!("mem{k}"), transport: Box::new(p.clone()) })
        .collect();
    Target::start(cfg, nics).expect("target starts")
}

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f).await.unwrap_or_else(|_| panic!("{what} did not finish within {LIMIT:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_target_restart_is_invisible_to_the_application() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("export.img");
    let mut links = Vec::new();
    let mut ports = Vec::new();
    for k in 0..2u32 {
        let (imac, tmac) = (MacAddr::local(0x100 + k), MacAddr::local(0x200 + k));
        let (i, t) = MemLink::pair((imac, tmac), 9000, 9014, 8192);
        ports.push(Shared::new(t).expect("share a port"));
        links.push(Link { name: format!("mem{k}"), transport: Box::new(i), target: tmac, node: None });
    }
    assert_eq!(ports[0].capabilities().local_mac, MacAddr::local(0x200));
    let target = start_target(&file, &ports);
    let mut cfg = InitiatorConfig::new("f");
    cfg.timers = initiator_timers();
    cfg.no_path_timeout = Duration::from_secs(20);
    let client = bounded("connect", connect(cfg, links)).await.expect("connect");
    let first = client.report().await.expect("report").session;

    let len = 64 << 10;
    let mut set = JoinSet::new();
    let mut target = Some(target);
    let mut restart = None;
    for i in 0..64u64 {
        let c = client.clone();
        set.spawn(async move { c.write_owned(i * len as u64, pattern(i, len), false).await });
        if i == 16 {
            // SIGTERM, and a new process on the same file a moment later.
            let (old, file, ports) = (target.take().expect("running"), file.clone(), ports.clone());
            restart = Some(std::thread::spawn(move || {
                old.shutdown();
                std::thread::sleep(Duration::from_millis(200));
                start_target(&file, &ports)
            }));
        }
    }
    while let Some(r) = bounded("writes across a target restart", set.join_next()).await {
        r.expect("task").unwrap_or_else(|e| panic!("a write failed across the restart: {e}"));
    }
    let _target = restart.expect("restarted").join().expect("the new target starts");
    bounded("flush", client.flush()).await.expect("a FLUSH after a graceful restart succeeds");
    for i in 0..64u64 {
        let back = bounded("read", client.read(i * len as u64, len)).await.expect("read after the restart");
        assert!(back == pattern(i, len), "write {i} lost across the restart");
    }
    let r = client.report().await.expect("report");
    assert_ne!(r.session, first, "the initiator still uses the session the old target had");
    let s = client.stats().await.expect("stats");
    assert_eq!(s.failed, 0, "{s:?}");
    client.close().await;
}
