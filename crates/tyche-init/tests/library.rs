//! The async library API against the in-process RAM target over in-memory links.

use std::time::Duration;

use tokio::task::JoinSet;
use tyche_init::loopback::{initiator_timers, mem_links, set_link_down, RamExport, Restart};
use tyche_init::{connect, Client, ConnectError, EngineThreads, Error, InitiatorConfig, Link, SchedulerKind, SendMode};
use tyche_transport::{FrameTransport, MemLink};
use tyche_wire::MacAddr;

const MIB: u64 = 1 << 20;
/// Bound on every test's wait: a hang fails the test instead of stalling CI.
const LIMIT: Duration = Duration::from_secs(30);

fn config() -> InitiatorConfig {
    let mut c = InitiatorConfig::new("ram");
    c.timers = initiator_timers();
    c.no_path_timeout = Duration::from_secs(5);
    c.reconnect_delay = Duration::from_millis(100);
    c.connect_retry = Duration::from_millis(50);
    c
}

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

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f).await.unwrap_or_else(|_| panic!("{what} did not finish within {LIMIT:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_of_many_sizes_over_two_links() {
    let (links, _sw, target) = mem_links(RamExport::new("ram", 64 * MIB), 2).expect("the in-process target starts");
    let mut cfg = config();
    cfg.channels_per_link = 2;
    let client = bounded("connect", connect(cfg, links)).await.expect("connect");
    assert_eq!(client.size(), 64 * MIB);
    assert_eq!(client.info().block_size, 512);
    let mut offset = 0u64;
    for (i, len) in
        [512usize, 1024, 4096, 8192, 12288, 65536, 131072 + 512, 1 << 20, (3 << 20) + 4096].iter().enumerate()
    {
        let data = pattern(i as u64, *len);
        bounded("write", client.write(offset, &data)).await.expect("write");
        let back = bounded("read", client.read(offset, *len)).await.expect("read");
        assert!(back == data, "read back of {len} bytes at {offset} differs");
        assert!(target.snapshot(offset, *len) == data, "target holds other bytes for {len} at {offset}");
        offset += (*len as u64).next_multiple_of(MIB);
    }
    let stats = client.stats().await.expect("stats");
    assert_eq!(stats.live_channels, 4, "{stats:?}");
    assert_eq!(stats.failed, 0, "{stats:?}");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_fua_discard_and_write_zeroes() {
    let (links, _sw, target) = mem_links(RamExport::new("ram", 8 * MIB), 1).expect("the in-process target starts");
    let client = bounded("connect", connect(config(), links)).await.expect("connect");
    let data = pattern(7, 256 << 10);
    client.write(0, &data).await.expect("write");
    client.write_owned(MIB, data.clone(), true).await.expect("fua write");
    client.flush().await.expect("flush");
    let done = target.counters();
    assert!(done.flushes >= 1 && done.fua_writes >= 1, "{done:?}");
    client.discard(4096, 8192).await.expect("discard");
    client.write_zeroes(MIB + 65536, 65536, false).await.expect("write zeroes");
    let a = client.read(0, data.len()).await.expect("read");
    assert!(a[4096..12288].iter().all(|&b| b == 0), "discarded range reads zeroes");
    assert!(a[..4096] == data[..4096] && a[12288..] == data[12288..], "around the discard untouched");
    let b = client.read(MIB, data.len()).await.expect("read");
    assert!(b[65536..131072].iter().all(|&b| b == 0), "zeroed range reads zeroes");
    assert!(b[..65536] == data[..65536] && b[131072..] == data[131072..]);
    // Refusals are errors, not hangs.
    assert_eq!(client.read(100, 512).await, Err(Error::Unaligned));
    assert_eq!(client.read(8 * MIB, 512).await, Err(Error::OutOfRange));
    assert_eq!(client.write(8 * MIB - 512, &[0; 1024]).await, Err(Error::OutOfRange));
    client.close().await;
    assert_eq!(client.read(0, 512).await, Err(Error::Closed));
}

async fn concurrent(client: &Client, n: u64, len: usize) {
    let mut set = JoinSet::new();
    for i in 0..n {
        let c = client.clone();
        set.spawn(async move {
            let data = pattern(1000 + i, len);
            let at = i * len as u64;
            c.write_owned(at, data.clone(), false).await.expect("write");
            let back = c.read(at, len).await.expect("read");
            assert!(back == data, "request {i}: read back differs");
        });
    }
    while let Some(r) = bounded("concurrent requests", set.join_next()).await {
        r.expect("task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_requests() {
    let (links, _sw, _target) = mem_links(RamExport::new("ram", 64 * MIB), 2).expect("the in-process target starts");
    let mut cfg = config();
    cfg.max_requests = 32; // fewer than the requests: the engine's backlog is exercised
    cfg.scheduler = SchedulerKind::RoundRobin;
    let client = connect(cfg, links).await.expect("connect");
    concurrent(&client, 256, 64 << 10).await;
    let s = client.stats().await.unwrap();
    assert_eq!((s.completed, s.failed), (512, 0), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_send_mode_round_trips() {
    let (links, _sw, _target) = mem_links(RamExport::new("ram", 16 * MIB), 1).expect("the in-process target starts");
    let mut cfg = config();
    cfg.send_mode = SendMode::Queue;
    let client = connect(cfg, links).await.expect("connect");
    assert_eq!(client.send_mode(), SendMode::Queue);
    concurrent(&client.on_node(Some(0)), 64, 32 << 10).await;
    concurrent(&client, 64, 16 << 10).await;
    // Every request went through a submitter thread.
    let s = client.stats().await.unwrap();
    assert_eq!((s.handed_over, s.sent_inline, s.inline_fallbacks), (256, 0, 0), "{s:?}");
    assert_eq!(client.report().await.unwrap().send.mode, "queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_send_mode_sends_on_the_submitting_thread() {
    let (links, _sw, target) = mem_links(RamExport::new("ram", 16 * MIB), 2).expect("the in-process target starts");
    let mut cfg = config();
    cfg.channels_per_link = 2;
    assert_eq!(cfg.send_mode, SendMode::Inline, "inline is the default");
    let client = connect(cfg, links).await.expect("connect");
    concurrent(&client, 64, 32 << 10).await;
    let data = pattern(5, 4096);
    client.write(0, &data).await.expect("write");
    assert!(target.snapshot(0, 4096) == data);
    // No request was handed to an engine thread; those that found the volume full waited in
    // its backlog (a fallback), none here with 512 requests allowed.
    let s = client.stats().await.unwrap();
    assert_eq!((s.sent_inline, s.handed_over, s.inline_fallbacks), (129, 0, 0), "{s:?}");
    let r = client.report().await.unwrap();
    assert_eq!((r.send.mode.as_str(), r.send.inline), ("inline", 129));
    assert!(r.human().contains("send mode inline: 129 sent inline, 0 handed over"), "{}", r.human());
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_send_mode_falls_back_to_the_engine_when_the_volume_is_full() {
    let (links, _sw, _target) = mem_links(RamExport::new("ram", 16 * MIB), 1).expect("the in-process target starts");
    let mut cfg = config();
    cfg.max_requests = 4; // fewer than the requests: some wait in the backlog
    let client = connect(cfg, links).await.expect("connect");
    concurrent(&client, 64, 16 << 10).await;
    let s = client.stats().await.unwrap();
    assert_eq!(s.sent_inline + s.inline_fallbacks, 128, "{s:?}");
    assert!(s.inline_fallbacks > 0, "{s:?}");
    assert_eq!((s.handed_over, s.failed), (0, 0), "{s:?}");
}

/// Application threads of their own (not the runtime's), each driving its requests with a
/// runtime of its own, submit inline at once: they serialise on the session and every request
/// completes with the right data.
#[test]
fn inline_send_mode_with_concurrent_submitters_on_several_threads() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (links, _sw, target) = mem_links(RamExport::new("ram", 32 * MIB), 2).expect("the in-process target starts");
    let client = rt.block_on(connect(config(), links)).expect("connect");
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let c = client.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async {
                    for i in 0..40u64 {
                        let len = 4096 * (1 + (i as usize % 4));
                        let at = (t * 40 + i) * 16384;
                        let data = pattern(t * 1000 + i, len);
                        c.write_owned(at, data.clone(), false).await.expect("write");
                        let back = c.read(at, len).await.expect("read");
                        assert!(back == data, "thread {t} request {i}: read back differs");
                    }
                })
            })
        })
        .collect();
    for t in threads {
        t.join().expect("submitter thread");
    }
    let s = rt.block_on(client.stats()).unwrap();
    assert_eq!(s.completed, 6 * 40 * 2, "{s:?}");
    assert_eq!(s.sent_inline + s.inline_fallbacks, 6 * 40 * 2, "{s:?}");
    assert_eq!(s.handed_over, 0, "{s:?}");
    assert!(target.snapshot(16384, 8192) == pattern(1, 8192));
    rt.block_on(client.close());
}

/// The session closes while threads keep submitting inline: every request either completes or
/// fails with `Error::Closed`, nothing hangs or panics, and a request after the close is
/// `Error::Closed` at once.
#[test]
fn inline_send_mode_close_while_submitting_and_after() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (links, _sw, _target) = mem_links(RamExport::new("ram", 16 * MIB), 1).expect("the in-process target starts");
    let client = rt.block_on(connect(config(), links)).expect("connect");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (c, stop) = (client.clone(), std::sync::Arc::clone(&stop));
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                let (mut ok, mut closed) = (0u64, 0u64);
                let t0 = std::time::Instant::now();
                // Until the session is closed (plus a few more that must fail at once).
                while closed < 8 {
                    assert!(t0.elapsed() < LIMIT, "submitter {t} never saw the close");
                    let r = rt.block_on(async {
                        tokio::time::timeout(LIMIT, c.write_owned(t * MIB, vec![t as u8; 8192], false)).await
                    });
                    match r.expect("a request never hangs") {
                        Ok(()) => ok += 1,
                        Err(Error::Closed) => closed += 1,
                        Err(e) => panic!("submitter {t}: {e:?}"),
                    }
                    if ok > 20_000 && !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        panic!("submitter {t}: the close never came");
                    }
                }
                ok
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    rt.block_on(bounded("close", client.close()));
    let done: u64 = threads.into_iter().map(|t| t.join().expect("submitter thread")).sum();
    assert!(done > 0, "some writes completed before the close");
    for _ in 0..3 {
        assert_eq!(rt.block_on(client.read(0, 4096)), Err(Error::Closed));
        assert_eq!(rt.block_on(client.flush()), Err(Error::Closed));
    }
    assert!(rt.block_on(client.stats()).is_err(), "the engine threads are gone");
}

/// Two links on two nodes, an engine thread and a part of the volume each (the volume in parts).
fn links_on_two_nodes(links: &mut [Link], cfg: &mut InitiatorConfig) {
    for (k, l) in links.iter_mut().enumerate() {
        l.node = Some(k as u32);
    }
    cfg.engine_threads = EngineThreads::PerNode;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_when_one_of_two_links_goes_down() {
    failover_when_one_of_two_links_goes_down_with(false).await;
}

/// With an engine thread per link, each holding its part of the volume: the part whose link
/// went down hands its requests to the other part, and every write lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_between_parts_of_the_volume_when_one_nodes_link_goes_down() {
    let s = failover_when_one_of_two_links_goes_down_with(true).await;
    assert!(s.handoffs > 0, "the part of the dead link handed nothing over: {s:?}");
}

/// Reads in flight on the part whose link goes down: the other part reads for it, and the data
/// comes back with the hand-back, into the caller's buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_handed_between_parts_bring_their_data_back() {
    let (mut links, switches, target) =
        mem_links(RamExport::new("ram", 32 * MIB), 2).expect("the in-process target starts");
    let mut cfg = config();
    cfg.reconnect_warnings = 2;
    links_on_two_nodes(&mut links, &mut cfg);
    let client = connect(cfg, links).await.expect("connect");
    let len = 128 << 10;
    for i in 0..128u64 {
        client.write_owned(i * len as u64, pattern(i, len), false).await.expect("write");
    }
    let n0 = client.on_node(Some(0));
    let mut set = JoinSet::new();
    for i in 0..128u64 {
        let c = n0.clone();
        set.spawn(async move { c.read(i * len as u64, len).await.map(|d| (i, d)) });
        if i == 16 {
            set_link_down(&switches[0], true);
        }
    }
    while let Some(r) = bounded("reads across a failover", set.join_next()).await {
        let (i, data) = r.expect("task").expect("every read completes on the surviving link");
        assert!(data == pattern(i, len), "read {i} came back wrong across the failover");
    }
    let s = client.stats().await.unwrap();
    assert!(s.handoffs > 0, "node 0's part handed nothing over: {s:?}");
    assert!(target.snapshot(0, len) == pattern(0, len));
}

async fn failover_when_one_of_two_links_goes_down_with(parts: bool) -> tyche_init::Stats {
    let (mut links, switches, target) =
        mem_links(RamExport::new("ram", 32 * MIB), 2).expect("the in-process target starts");
    let mut cfg = config();
    cfg.reconnect_warnings = 2;
    if parts {
        links_on_two_nodes(&mut links, &mut cfg);
    }
    let client = connect(cfg, links).await.expect("connect");
    let len = 128 << 10;
    let mut set = JoinSet::new();
    for i in 0..128u64 {
        let c = client.clone();
        set.spawn(async move {
            let data = pattern(i, len);
            c.write_owned(i * len as u64, data, false).await.map(|()| i)
        });
        if i == 16 {
            set_link_down(&switches[0], true);
        }
    }
    while let Some(r) = bounded("writes across a failover", set.join_next()).await {
        let i = r.expect("task").expect("every write completes on the surviving link");
        let _ = i;
    }
    for i in 0..128u64 {
        let back = client.read(i * len as u64, len).await.expect("read after failover");
        assert!(back == pattern(i, len), "write {i} lost or corrupted across the failover");
    }
    let s = client.stats().await.unwrap();
    assert_eq!(s.live_channels, 1, "{s:?}");
    assert!(target.snapshot(0, len) == pattern(0, len));
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_link_reconnects_when_it_comes_back() {
    let (links, switches, _target) =
        mem_links(RamExport::new("ram", 8 * MIB), 2).expect("the in-process target starts");
    let mut cfg = config();
    cfg.reconnect_warnings = 50;
    let client = connect(cfg, links).await.expect("connect");
    set_link_down(&switches[1], true);
    // Wait for the channel to be declared dead (dead_after = 600 ms).
    let t0 = std::time::Instant::now();
    while client.stats().await.unwrap().live_channels == 2 {
        assert!(t0.elapsed() < LIMIT, "channel never declared dead");
        client.write(0, &[1; 4096]).await.expect("write on the survivor");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    set_link_down(&switches[1], false);
    let t0 = std::time::Instant::now();
    loop {
        let s = client.stats().await.unwrap();
        if s.live_channels == 2 && s.reconnects >= 1 {
            break;
        }
        assert!(t0.elapsed() < LIMIT, "channel never reconnected: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    concurrent(&client, 32, 64 << 10).await;
}

/// The target restarts (a crash, then a graceful stop) while writes are in flight: the
/// initiator opens a new session by itself and re-issues what had not completed; the
/// application sees no error, and everything it wrote reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_restarts_are_invisible_to_the_application() {
    target_restarts_are_invisible_with(false).await;
}

/// The same with the volume in two parts (an engine thread per link): both parts move to the
/// new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_restarts_are_invisible_to_a_volume_in_parts() {
    target_restarts_are_invisible_with(true).await;
}

async fn target_restarts_are_invisible_with(parts: bool) {
    let (mut links, _sw, target) = mem_links(RamExport::new("ram", 32 * MIB), 2).expect("the in-process target starts");
    let mut cfg = config();
    if parts {
        links_on_two_nodes(&mut links, &mut cfg);
    }
    let client = bounded("connect", connect(cfg, links)).await.expect("connect");
    let first = client.report().await.expect("report").session;
    let len = 64 << 10;
    for (round, how) in [Restart::Crash, Restart::Graceful].into_iter().enumerate() {
        let base = round as u64 * 256;
        let mut set = JoinSet::new();
        for i in 0..64u64 {
            let c = client.clone();
            set.spawn(async move { c.write_owned((base + i) * len as u64, pattern(base + i, len), false).await });
            if i == 16 {
                target.restart(how).expect("the target restarts");
            }
        }
        while let Some(r) = bounded("writes across a target restart", set.join_next()).await {
            r.expect("task").unwrap_or_else(|e| panic!("{how:?}: a write failed across the restart: {e}"));
        }
        for i in 0..64u64 {
            let at = (base + i) * len as u64;
            let back = bounded("read", client.read(at, len)).await.expect("read after the restart");
            assert!(back == pattern(base + i, len), "{how:?}: write {i} lost across the restart");
        }
    }
    let r = client.report().await.expect("report");
    assert_ne!(r.session, first, "the initiator still uses the session the target forgot");
    assert!(r.live_channels >= 1, "{}", r.human());
    let s = client.stats().await.expect("stats");
    assert_eq!(s.failed, 0, "{s:?}");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_path_fails_requests_after_the_timeout_and_never_hangs() {
    let (links, switches, _target) =
        mem_links(RamExport::new("ram", 8 * MIB), 1).expect("the in-process target starts");
    let mut cfg = config();
    cfg.no_path_timeout = Duration::from_millis(500);
    cfg.reconnect_warnings = 1;
    let client = connect(cfg, links).await.expect("connect");
    client.write(0, &[7; 4096]).await.expect("write while up");
    set_link_down(&switches[0], true);
    let t0 = std::time::Instant::now();
    let r = bounded("a request with no path", client.write(0, &[8; 4096])).await;
    assert_eq!(r, Err(Error::NoPath));
    // dead_after (600 ms) + no_path_timeout (500 ms), with slack.
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    let r = bounded("a request after the failure", client.read(0, 4096)).await;
    assert_eq!(r, Err(Error::NoPath));
}

/// `io_timeout` (a RAID member's): with the only link down, a request fails about that long
/// after its submission, far before `no_path_timeout`; once the link is back the same client
/// serves again (the device would stay attached).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_timeout_fails_requests_fast_and_the_volume_serves_again() {
    let (links, switches, _target) =
        mem_links(RamExport::new("ram", 8 * MIB), 1).expect("the in-process target starts");
    let mut cfg = config();
    cfg.no_path_timeout = Duration::from_secs(120);
    cfg.io_timeout = Some(Duration::from_millis(1500));
    let client = connect(cfg, links).await.expect("connect");
    client.write(0, &[7; 4096]).await.expect("write while up");
    set_link_down(&switches[0], true);
    let t0 = std::time::Instant::now();
    let r = bounded("a request with no path", client.write(0, &[8; 4096])).await;
    assert_eq!(r, Err(Error::NoPath));
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(1400) && took < Duration::from_secs(10), "took {took:?}");
    set_link_down(&switches[0], false);
    let back = bounded("a read once the link is back", async {
        loop {
            match client.read(0, 4096).await {
                Ok(d) => return d,
                Err(Error::NoPath) => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => panic!("{e}"),
            }
        }
    })
    .await;
    assert_eq!(back, vec![7; 4096], "the write before the outage; the failed one never executed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_errors_say_what_went_wrong() {
    let (links, _sw, _target) = mem_links(RamExport::new("ram", MIB), 1).expect("the in-process target starts");
    let err = connect(InitiatorConfig { export: "nope".into(), ..config() }, links).await.unwrap_err();
    assert!(matches!(err, ConnectError::UnknownExport { .. }), "{err}");
    assert!(err.to_string().contains("no export named \"nope\""), "{err}");

    // Nobody answers: a timeout naming the link, after connect_attempts × connect_retry.
    let (i, t) = MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 1500, 1514, 64);
    let mut cfg = config();
    cfg.connect_attempts = 3;
    let link = tyche_init::Link {
        name: "silent0".into(),
        transport: Box::new(i),
        target: t.capabilities().local_mac,
        node: None,
    };
    let err = bounded("connect to nobody", connect(cfg, vec![link])).await.unwrap_err();
    assert!(matches!(err, ConnectError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("silent0"), "{err}");
    assert!(connect(config(), vec![]).await.is_err());
}

#[test]
fn discover_lists_the_target_and_its_export() {
    let (mut links, _sw, _target) = mem_links(RamExport::new("ram", 4 * MIB), 2).expect("the in-process target starts");
    let found = tyche_init::discover(&mut links, tyche_wire::DEFAULT_ETHERTYPE, Duration::from_millis(300));
    assert_eq!(found.len(), 2, "one target per link: {found:?}");
    for (k, t) in found.iter().enumerate() {
        assert_eq!((t.link_index, t.link.as_str()), (k, format!("mem{k}").as_str()));
        assert_eq!(t.target, links[k].target);
        assert_eq!(t.exports.len(), 1);
        assert_eq!((t.exports[0].name.as_str(), t.exports[0].size), ("ram", 4 * MIB));
    }
    // The links still work for a session afterwards.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let client = connect(config(), links).await.expect("connect after discovery");
        client.write(0, &[3; 512]).await.unwrap();
    });
}

/// Links on two nodes: one engine thread per node, each serving its node's link, sharing one
/// session. Requests for either node, and for none, complete; with the node-1 link down, node-1
/// requests (handed to the node-1 thread) go out on the node-0 link (sent by the node-0 thread,
/// which the node-1 thread wakes); closing stops both threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_engine_thread_per_node_shares_the_session() {
    let (mut links, switches, target) =
        mem_links(RamExport::new("ram", 32 * MIB), 2).expect("the in-process target starts");
    links[0].node = Some(0);
    links[1].node = Some(1);
    let mut cfg = config();
    cfg.reconnect_warnings = 1;
    let client = bounded("connect", connect(cfg, links)).await.expect("connect");
    let (n0, n1) = (client.on_node(Some(0)), client.on_node(Some(1)));
    bounded("node 0 requests", concurrent(&n0, 32, 64 << 10)).await;
    let r = client.report().await.expect("report");
    let names: Vec<&str> = r.links.iter().map(|l| l.thread.name.as_str()).collect();
    assert_eq!(names, ["tyche-engine0", "tyche-engine1"], "{}", r.human());
    assert_ne!(r.links[0].thread.tid, r.links[1].thread.tid);
    for ch in &r.channels {
        let link = r.links.iter().find(|l| l.name == ch.link).expect("channel's link");
        assert_eq!(ch.thread.tid, link.thread.tid, "channel {} is served by its link's thread", ch.channel);
    }
    // Node-1 requests on the node-1 channel, from the node-1 thread.
    let before = r.channels.iter().find(|c| c.link == "mem1").map_or(0, |c| c.payload_tx);
    let len = 64 << 10;
    for i in 0..32u64 {
        n1.write_owned((16 * MIB) + i * len, pattern(i, len as usize), false).await.expect("node-1 write");
    }
    let r = client.report().await.expect("report");
    let after = r.channels.iter().find(|c| c.link == "mem1").map_or(0, |c| c.payload_tx);
    assert!(after - before >= 32 * len, "node-1 writes went to the node-1 channel: {}", r.human());
    // Requests of unknown node go to the first thread.
    bounded("requests of no node", concurrent(&client, 16, 16 << 10)).await;
    // The node-1 link fails: its thread's requests go out on node 0's link.
    set_link_down(&switches[1], true);
    let t0 = std::time::Instant::now();
    while client.stats().await.unwrap().live_channels == 2 {
        assert!(t0.elapsed() < LIMIT, "channel never declared dead");
        n1.write(0, &[1; 4096]).await.expect("node-1 write with its link down");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..32u64 {
        let at = 8 * MIB + i * len;
        bounded("node-1 write", n1.write_owned(at, pattern(100 + i, len as usize), false)).await.expect("write");
        let back = bounded("node-1 read", n1.read(at, len as usize)).await.expect("read");
        assert!(back == pattern(100 + i, len as usize), "node-1 request {i} over the node-0 link");
    }
    assert!(target.snapshot(8 * MIB, len as usize) == pattern(100, len as usize));
    bounded("close", client.close()).await;
    assert_eq!(n1.read(0, 512).await, Err(Error::Closed));
}

/// With the round-robin scheduler and the volume in parts (links on two nodes), requests whose
/// buffers are all on node 1 still go to every channel in turn, not only to node 1's part (the
/// VM's NUMA check caught this: node 1's channel carried everything).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_one_nodes_requests_over_every_part() {
    let (mut links, _sw, _target) =
        mem_links(RamExport::new("ram", 32 * MIB), 2).expect("the in-process target starts");
    let mut cfg = config();
    links_on_two_nodes(&mut links, &mut cfg);
    cfg.scheduler = SchedulerKind::RoundRobin;
    let client = bounded("connect", connect(cfg, links)).await.expect("connect");
    let n1 = client.on_node(Some(1));
    let len = 64 << 10;
    for i in 0..64u64 {
        n1.write_owned(i * len, pattern(i, len as usize), false).await.expect("node-1 write");
    }
    let r = client.report().await.expect("report");
    let tx: Vec<u64> = ["mem0", "mem1"]
        .iter()
        .map(|l| r.channels.iter().filter(|c| c.link == *l).map(|c| c.payload_tx).sum())
        .collect();
    let total = (tx[0] + tx[1]) as f64;
    assert!(total >= (64 * len) as f64, "{}", r.human());
    let share = tx[1] as f64 / total;
    assert!(
        (0.4..=0.6).contains(&share),
        "node 1's channel carried {:.1}% of the payload: {}",
        share * 100.0,
        r.human()
    );
    bounded("close", client.close()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_poll_mode_serves_requests_and_counts_its_waits() {
    use tyche_runtime::poll::{PollConfig, PollMode};
    for mode in [PollMode::Adaptive, PollMode::Sleep, PollMode::Spin] {
        let (links, _sw, _target) = mem_links(RamExport::new("ram", 8 * MIB), 1).expect("the in-process target starts");
        let mut cfg = config();
        cfg.poll = PollConfig::new(mode, 50).expect("budget in range");
        let client = bounded("connect", connect(cfg, links)).await.expect("connect");
        for i in 0..64u64 {
            let data = pattern(i, 4096);
            bounded("write", client.write(i * 4096, &data)).await.expect("write");
            assert!(bounded("read", client.read(i * 4096, 4096)).await.expect("read") == data, "{mode}: read back");
        }
        let r = client.report().await.expect("report");
        assert_eq!((r.poll_mode, r.poll_budget_us, r.poll.len()), (mode, 50, 1), "{}", r.human());
        let p = r.poll[0];
        match mode {
            // Every turn that found nothing after work polled a while before sleeping (unless
            // the machine was so busy that polling gave way to other work all along).
            PollMode::Adaptive => assert!((p.poll_ns > 0 || p.contended > 0) && p.budget_ns <= 50_000, "{mode}: {p:?}"),
            PollMode::Sleep => assert!(p.poll_ns == 0 && p.sleeps > 0 && p.poll_hits == 0, "{mode}: {p:?}"),
            PollMode::Spin => assert!(p.sleeps == 0 && p.poll_ns > 0, "{mode}: {p:?}"),
        }
        assert!(r.human().contains(&format!("poll {mode} (budget 50 µs")), "{}", r.human());
        bounded("close", client.close()).await;
    }
}

/// Multi-buffer links (MTU 9000 frames arriving in three pieces, as AF_XDP hands a jumbo frame
/// over): read data is copied from the pieces straight into the request's buffer without being
/// gathered first, and on DIGEST channels checked on the frame gathered whole; every size reads
/// back what was written, through tyched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_from_frames_in_pieces() {
    for digest in [false, true] {
        let (mut links, mut nics) = (Vec::new(), Vec::new());
        for k in 0..2u32 {
            let (imac, tmac) = (MacAddr::local(0x100 + k), MacAddr::local(0x200 + k));
            let (mut i, t) = MemLink::pair((imac, tmac), 9000, 9014, 4096);
            i.set_pieces(3646);
            links.push(tyche_init::Link { name: format!("mem{k}"), transport: Box::new(i), target: tmac, node: None });
            nics.push(tyched::Nic { name: format!("t{k}"), transport: Box::new(t) });
        }
        let exports = vec![tyched::ExportConfig::ram("ram", 64 * MIB)];
        let target = tyched::Target::start(tyched::Config { exports, ..tyched::Config::default() }, nics)
            .expect("tyched starts");
        let mut cfg = config();
        cfg.digest = digest;
        let client = bounded("connect", connect(cfg, links)).await.expect("connect");
        let mut offset = 0u64;
        for (i, len) in [512usize, 8192, 8192 + 512, 24576, 131072 + 512, 1 << 20].iter().enumerate() {
            let data = pattern(i as u64 + 100, *len);
            bounded("write", client.write(offset, &data)).await.expect("write");
            let back = bounded("read", client.read(offset, *len)).await.expect("read");
            assert!(back == data, "digest {digest}: read back of {len} bytes at {offset} differs");
            offset += (*len as u64).next_multiple_of(MIB);
        }
        let stats = client.stats().await.expect("stats");
        assert_eq!(stats.failed, 0, "{stats:?}");
        client.close().await;
        let s = target.shutdown();
        let malformed: u64 = s.nics.iter().map(|n| n.drops.malformed).sum();
        assert_eq!(malformed, 0, "digest {digest}: {s:?}");
    }
}
