//! An in-process target over in-memory links, driven by the initiator-side engine.

mod common;

use std::time::Duration;

use common::{pattern, Initiator};
use tyche_channel::{ConnectError, IoError};
use tyche_transport::FrameTransportExt;
use tyche_wire::{Op, RejectReason, Status};
use tyched::config::{Config, ExportConfig, NetworkThreads};

fn config(exports: Vec<ExportConfig>) -> Config {
    Config { exports, workers: 2, ..Config::default() }
}

#[test]
fn many_sizes_over_two_nics_to_ram_and_file() {
    many_sizes_over_two_nics_with(NetworkThreads::PerNic, 2);
}

/// The same with one network thread serving both NICs (`network_threads = "one"`).
#[test]
fn many_sizes_over_two_nics_with_one_network_thread() {
    many_sizes_over_two_nics_with(NetworkThreads::One, 1);
}

fn many_sizes_over_two_nics_with(network_threads: NetworkThreads, threads: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let cfg = config(vec![ExportConfig::ram("ram", 8 << 20), ExportConfig::file("file", &file, Some(8 << 20))]);
    let cfg = Config { network_threads, ..cfg };
    let (target, ports) = common::start(cfg.clone(), 2);
    assert_eq!(target.network_threads(), threads, "network threads");
    let (_, ports2) = (0, ports);
    let mut ini = Initiator::new(ports2);
    let c = ini.attach("ram", None).expect("attach ram");
    assert_eq!(c.export_size, 8 << 20, "size reported in ACCEPT");
    let sizes = [512usize, 1024, 4096, 8192, 12288, 65536, 131072 + 512, 1 << 20];
    let mut offset = 0u64;
    let mut written = Vec::new();
    // Several in flight at once, spread over both channels.
    let mut ids = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(offset, len, i as u8);
        ids.push(ini.submit(Op::Write, offset, data.clone(), len as u64, false));
        written.push((offset, data));
        offset += len as u64;
    }
    for id in ids {
        let (r, _) = ini.wait(id);
        r.expect("write completes");
    }
    for (off, data) in &written {
        assert_eq!(&ini.read(*off, data.len()), data, "read back {} bytes at {off}", data.len());
    }
    let s = target.stats();
    let e = &s.exports[0];
    assert_eq!(e.requests.write, sizes.len() as u64, "{s:?}");
    assert_eq!(e.bytes_written, sizes.iter().sum::<usize>() as u64);
    // In-memory links lend nothing: each payload is copied once each way, and counted.
    assert!(s.payload_copied_bytes >= 2 * e.bytes_written, "payload copies are counted: {}", s.payload_copied_bytes);
    assert!(s.payload_copied_write_bytes >= e.bytes_written, "{s:?}");
    assert_eq!((s.leases_held, s.nics[0].frames_kept), (0, 0), "nothing kept without lending");
    assert_eq!(s.channels.len(), 2, "one channel per NIC");
    let prom = s.prometheus();
    assert!(prom.contains("tyched_export_requests_total{export=\"ram\",op=\"write\"} 8"), "{prom}");
    assert!(s.human().contains("ram"), "human rendering names the export");
    assert!(s.nics.iter().all(|n| n.frames_rx > 0), "both NICs carried traffic: {:?}", s.nics);
    drop(ini);

    // The file export on a fresh attachment (new session over new links).
    drop(target);
    let (target, ports) = common::start(cfg, 2);
    let mut ini = Initiator::new(ports);
    ini.attach("file", None).expect("attach file");
    for (off, data) in &written {
        ini.write(*off, data);
    }
    for (off, data) in &written {
        assert_eq!(&ini.read(*off, data.len()), data, "file: read back {} bytes at {off}", data.len());
    }
    let s = target.shutdown();
    assert_eq!(s.exports[1].requests.write, sizes.len() as u64);
    assert_eq!((s.exports[0].io.as_str(), s.exports[1].io.as_str()), ("inline", "io_uring"), "storage engines");
    let on_disk = std::fs::read(&file).expect("read the file");
    for (off, data) in &written {
        assert_eq!(&on_disk[*off as usize..*off as usize + data.len()], &data[..], "file holds the write at {off}");
    }
}

/// A write whose completion is lost on one NIC's channel is re-issued by the initiator on the
/// other NIC's channel, which another network thread serves: that thread asks the thread holding
/// the tag's home channel, which answers with the recorded status, and the write runs once.
#[test]
fn a_reissued_write_on_another_threads_channel_is_decided_by_its_home_thread() {
    let cfg = Config { network_threads: NetworkThreads::PerNic, ..config(vec![ExportConfig::ram("ram", 8 << 20)]) };
    let (target, ports) = common::start(cfg, 2);
    assert_eq!(target.network_threads(), 2);
    let mut ini = Initiator::new(ports);
    ini.attach("ram", None).expect("attach");
    // Everything the target sends on NIC 0 is lost from now on.
    ini.deaf = Some(0);
    let writes: Vec<(u64, Vec<u8>)> = (0..4u64).map(|i| (i << 16, pattern(i << 16, 8192, i as u8))).collect();
    let ids: Vec<u64> = writes.iter().map(|(o, d)| ini.submit(Op::Write, *o, d.clone(), 8192, false)).collect();
    for id in ids {
        ini.wait(id).0.expect("the write completes (on the other channel if it must)");
    }
    ini.deaf = None;
    for (o, d) in &writes {
        assert_eq!(&ini.read(*o, d.len()), d, "read back at {o}");
    }
    let s = target.stats();
    assert!(s.decided_by_home >= 1, "no copy was decided by its home's thread: {s:?}");
    assert!(s.part_messages >= 2 * s.decided_by_home, "{s:?}");
    assert_eq!(s.exports[0].requests.write, writes.len() as u64, "a re-issued write ran again: {s:?}");
    assert!(s.duplicates_suppressed >= 1, "{s:?}");
    assert!(s.human().contains("decided by their home channel's thread"), "{}", s.human());
}

/// Each poll mode serves I/O, and `stats` counts how the network threads waited.
#[test]
fn every_poll_mode_serves_requests_and_counts_its_waits() {
    use tyche_runtime::poll::PollMode;
    for mode in [PollMode::Adaptive, PollMode::Sleep, PollMode::Spin] {
        let cfg = Config { poll: mode, poll_budget_us: 40, ..config(vec![ExportConfig::ram("ram", 1 << 20)]) };
        let (target, ports) = common::start(cfg, 2);
        let mut ini = Initiator::new(ports);
        ini.attach("ram", None).expect("attach");
        for i in 0..32u64 {
            let data = pattern(i * 4096, 4096, i as u8);
            ini.write(i * 4096, &data);
            assert_eq!(ini.read(i * 4096, 4096), data, "{mode}: read back");
        }
        let s = target.stats();
        assert_eq!((s.poll.mode, s.poll.budget_us, s.poll.threads.len()), (mode, 40, 2), "{:?}", s.poll);
        let busy = s.poll.threads.iter().find(|t| t.poll_hits + t.wakeups > 0).expect("a thread found work");
        match mode {
            // Polled, unless the machine was so busy that polling gave way all along.
            PollMode::Adaptive => {
                assert!((busy.poll_ns > 0 || busy.contended > 0) && busy.budget_ns <= 40_000, "{mode}: {busy:?}")
            }
            PollMode::Sleep => assert!(busy.poll_ns == 0 && busy.sleeps > 0 && busy.poll_hits == 0, "{mode}: {busy:?}"),
            PollMode::Spin => assert!(busy.sleeps == 0 && busy.poll_ns > 0, "{mode}: {busy:?}"),
        }
        let prom = s.prometheus();
        assert!(prom.contains("tyched_poll_sleeps_total{thread=\"1\"}"), "{prom}");
        assert!(s.human().contains(&format!("poll {mode} (budget 40 µs")), "{}", s.human());
    }
}

#[test]
fn flush_fua_discard_write_zeroes() {
    flush_fua_discard_write_zeroes_with(true, "io_uring");
}

/// The same through the worker threads (io_uring off, as where the kernel refuses it).
#[test]
fn flush_fua_discard_write_zeroes_on_the_thread_pool() {
    flush_fua_discard_write_zeroes_with(false, "threads");
}

fn flush_fua_discard_write_zeroes_with(io_uring: bool, io: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let cfg = Config { io_uring, ..config(vec![ExportConfig::file("f", &file, Some(4 << 20))]) };
    let (target, ports) = common::start(cfg, 1);
    let mut ini = Initiator::new(ports);
    ini.attach("f", None).expect("attach");
    let data = pattern(0, 65536, 9);
    ini.write(0, &data);
    ini.range_op(Op::Flush, 0, 0).expect("flush");
    ini.io(Op::Write, 65536, data.clone(), true).expect("FUA write");
    // Durable writes are in the file (read through another descriptor).
    let disk = std::fs::read(&file).expect("file");
    assert_eq!(&disk[..65536], &data[..], "flushed write in the file");
    assert_eq!(&disk[65536..131072], &data[..], "FUA write in the file");
    ini.range_op(Op::Discard, 4096, 8192).expect("discard");
    let back = ini.read(0, 65536);
    assert_eq!(&back[..4096], &data[..4096], "before the discard");
    assert!(back[4096..12288].iter().all(|&b| b == 0), "discarded range reads zeroes");
    assert_eq!(&back[12288..], &data[12288..], "after the discard");
    ini.range_op(Op::WriteZeroes, 65536 + 512, 1024).expect("write zeroes");
    let back = ini.read(65536, 4096);
    assert_eq!(&back[..512], &data[..512]);
    assert!(back[512..1536].iter().all(|&b| b == 0), "zeroed range");
    assert_eq!(&back[1536..], &data[1536..4096]);
    let s = target.shutdown();
    let r = &s.exports[0].requests;
    assert_eq!((r.flush, r.discard, r.write_zeroes), (1, 1, 1), "{r:?}");
    assert_eq!(s.exports[0].io, io, "storage engine");
    assert_eq!(s.exports[0].errors, 0);
}

#[test]
fn read_only_and_out_of_range_are_refused_by_the_target() {
    let ro = ExportConfig { read_only: true, ..ExportConfig::ram("ro", 1 << 20) };
    let (target, ports) = common::start(config(vec![ro]), 1);
    let mut ini = Initiator::new(ports);
    // The volume is told a larger export so that the target, not the volume, refuses.
    ini.pretend_size = Some(2 << 20);
    let c = ini.attach("ro", None).expect("attach");
    assert_ne!(c.export_flags & tyche_wire::flags::EXPORT_READ_ONLY, 0, "read-only flag in ACCEPT");
    let r = ini.io(Op::Write, 0, vec![1; 4096], false);
    assert_eq!(r.err(), Some(IoError::Target(Status::ReadOnly)), "write to a read-only export");
    assert_eq!(ini.range_op(Op::Discard, 0, 512), Err(IoError::Target(Status::ReadOnly)));
    let r = ini.io(Op::Read, (1 << 20) - 512, vec![0; 1024], false);
    assert_eq!(r.err(), Some(IoError::Target(Status::OutOfRange)), "read past the end");
    assert_eq!(ini.read(0, 4096), vec![0; 4096], "reads still work");
    drop(target);
}

#[test]
fn mac_not_allowed_is_refused() {
    let e = ExportConfig { allow: vec!["02:00:00:00:99:99".into()], ..ExportConfig::ram("locked", 1 << 20) };
    let open = ExportConfig { allow: vec![common::init_mac(0).to_string()], ..ExportConfig::ram("mine", 1 << 20) };
    let (target, ports) = common::start(config(vec![e, open]), 1);
    let mut ini = Initiator::new(ports);
    let (_, r) = ini.handshake(0, 0, "locked", None);
    assert_eq!(r.err(), Some(ConnectError::Rejected(RejectReason::NotAllowed)));
    ini.attach("mine", None).expect("an allowed MAC attaches");
    let s = target.stats();
    assert_eq!(s.drops(|d| d.denied_mac), 1, "{:?}", s.nics);
    assert_eq!(s.exports[0].denied, 1);
}

#[test]
fn pre_shared_key_right_wrong_and_missing() {
    let key = "correct horse battery staple";
    let e = ExportConfig { key: Some(key.into()), ..ExportConfig::ram("secret", 1 << 20) };
    let (target, ports) = common::start(config(vec![e]), 2);
    let mut ini = Initiator::new(ports);
    let (_, r) = ini.handshake(0, 0, "secret", Some(b"wrong horse battery staple"));
    assert_eq!(r.err(), Some(ConnectError::Rejected(RejectReason::AuthFailed)), "wrong key");
    let (_, r) = ini.handshake(0, 0, "secret", None);
    assert_eq!(r.err(), Some(ConnectError::ChallengeUnsupported), "no key: the target challenges");
    let c = ini.attach("secret", Some(key.as_bytes())).expect("right key attaches on both NICs");
    assert_ne!(c.export_flags & tyche_wire::flags::EXPORT_NEEDS_KEY, 0);
    let data = pattern(0, 8192, 3);
    ini.write(0, &data);
    assert_eq!(ini.read(0, 8192), data);
    let s = target.stats();
    // The wrong key's proof, and the fresh round's (a target may have lost the first challenge).
    assert_eq!(s.drops(|d| d.denied_key), 1 + u64::from(tyche_channel::FRESH_KEY_ROUNDS), "{:?}", s.nics);
    assert_eq!(s.sessions, 1);
    // Who holds the export: the one session, its MAC and both channels.
    let h = &s.exports[0].holders;
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(h[0].mac, common::init_mac(0).to_string(), "{h:?}");
    assert_eq!(h[0].channels, 2, "{h:?}");
    assert!(!h[0].host.is_empty() && h[0].session.starts_with("0x"), "{h:?}");
    assert!(s.human().contains(&format!("held by {}", h[0].mac)), "{}", s.human());
}

#[test]
fn garbage_frames_are_counted_and_ignored() {
    let (target, ports) = common::start(config(vec![ExportConfig::ram("r", 1 << 20)]), 1);
    let mut ini = Initiator::new(ports);
    let c = ini.attach("r", None).expect("attach");
    let mut rng = tyche_transport::SplitMix64::new(42);
    let t = common::target_mac(0).octets();
    let s = common::init_mac(0).octets();
    for i in 0..500u32 {
        let len = rng.range(1, 200) as usize;
        let mut f: Vec<u8> = (0..len.max(60)).map(|_| rng.next_u64() as u8).collect();
        if i % 2 == 0 && f.len() >= 30 {
            // A Tyche header with a random kind and session: must be dropped, never crash.
            f[..6].copy_from_slice(&t);
            f[6..12].copy_from_slice(&s);
            f[12..14].copy_from_slice(&tyche_wire::DEFAULT_ETHERTYPE.to_be_bytes());
            f[14] = tyche_wire::VERSION;
            if i % 4 == 0 {
                f[22..30].copy_from_slice(&c.session.to_be_bytes());
            }
        }
        common::send(&mut ini.ports[0], &f[..len.min(f.len())]);
        if i % 5 == 0 {
            // Well-formed frames for a session nobody has, and an injection into the real session
            // on a channel it does not have.
            let session = if i % 10 == 0 { rng.next_u64() | 1 } else { c.session };
            let env = tyche_wire::Envelope {
                dst: common::target_mac(0),
                src: common::init_mac(0),
                ethertype: tyche_wire::DEFAULT_ETHERTYPE,
                channel: 7,
                session,
            };
            let mut buf = [0u8; 128];
            let m = tyche_wire::Message::Ack(tyche_wire::Ack {
                cumulative: rng.next_u64() as u32,
                sack: 0,
                duplicate: false,
            });
            let n = m.emit(&env, &mut buf);
            common::send(&mut ini.ports[0], &buf[..n]);
        }
        if i % 64 == 0 {
            ini.pump();
        }
    }
    let data = pattern(4096, 16384, 5);
    ini.write(4096, &data);
    assert_eq!(ini.read(4096, 16384), data, "still serving after garbage");
    let st = target.stats();
    let n = &st.nics[0];
    let dropped = n.drops.malformed + n.drops.unknown_session + n.drops.not_ours + n.drops.channel_total();
    assert!(dropped >= 400, "garbage is counted: {:?}", n.drops);
    assert!(n.drops.malformed > 0, "{:?}", n.drops);
    assert_eq!(n.drops.unknown_session, 50, "{:?}", n.drops);
    assert_eq!(n.drops.not_ours, 50, "{:?}", n.drops);
}

#[test]
fn restart_with_the_same_file_serves_the_same_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let cfg = config(vec![ExportConfig::file("f", &file, Some(2 << 20))]);
    let data = pattern(8192, 300 * 1024, 7);
    {
        let (target, ports) = common::start(cfg.clone(), 1);
        let mut ini = Initiator::new(ports);
        ini.attach("f", None).expect("attach");
        ini.write(8192, &data);
        let s = target.shutdown();
        assert_eq!(s.storage_inflight, 0, "nothing left in flight");
        assert!(s.stopping);
    }
    let (target, ports) = common::start(cfg, 1);
    let mut ini = Initiator::new(ports);
    ini.attach("f", None).expect("attach after restart");
    assert_eq!(ini.read(8192, data.len()), data, "acknowledged data survives a restart");
    drop(target);
}

#[test]
fn a_vanished_initiator_is_reclaimed() {
    let cfg = Config { dead_after_ms: 250, reclaim_after_ms: 500, ..config(vec![ExportConfig::ram("r", 1 << 20)]) };
    let (target, ports) = common::start(cfg, 2);
    let mut ini = Initiator::new(ports);
    ini.attach("r", None).expect("attach");
    ini.write(0, &[7; 4096]);
    assert_eq!(target.stats().sessions, 1);
    drop(ini); // vanishes without a word
    let deadline = std::time::Instant::now() + common::LIMIT;
    loop {
        let s = target.stats();
        if s.sessions == 0 {
            assert_eq!(s.sessions_reclaimed, 1, "{s:?}");
            assert!(s.channels.is_empty());
            break;
        }
        assert!(std::time::Instant::now() < deadline, "session never reclaimed: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn discovery_reports_exports_and_sizes() {
    let (target, mut ports) = common::start(
        config(vec![
            ExportConfig::ram("a", 1 << 20),
            ExportConfig { read_only: true, ..ExportConfig::ram("b", 2 << 20) },
        ]),
        1,
    );
    let env = tyche_wire::Envelope {
        dst: tyche_wire::MacAddr::BROADCAST,
        src: common::init_mac(0),
        ethertype: tyche_wire::DEFAULT_ETHERTYPE,
        channel: 0,
        session: 0,
    };
    let mut buf = vec![0u8; 256];
    let len = tyche_wire::Message::Discover(tyche_wire::Discover { nonce: 5, start: 0 }).emit(&env, &mut buf);
    common::send(&mut ports[0], &buf[..len]);
    let deadline = std::time::Instant::now() + common::LIMIT;
    let mut got = Vec::new();
    while got.is_empty() {
        assert!(std::time::Instant::now() < deadline, "no DISCOVER_REPLY");
        ports[0]
            .recv(8, &mut |b| {
                let f = tyche_wire::Frame::new_checked(b, tyche_wire::DEFAULT_ETHERTYPE).expect("valid reply");
                if let Ok(tyche_wire::Message::DiscoverReply(r)) = f.parse() {
                    got = r.exports.iter().map(|e| (e.name.to_string(), e.size, e.flags)).collect();
                }
            })
            .expect("recv");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(got[0].0, "a");
    assert_eq!(got[0].1, 1 << 20);
    assert_eq!(got[1].1, 2 << 20);
    assert_ne!(got[1].2 & tyche_wire::flags::EXPORT_READ_ONLY, 0);
    drop(target);
}

#[test]
fn shutdown_with_writes_in_flight_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let cfg = config(vec![ExportConfig::file("f", &file, Some(8 << 20))]);
    let (target, ports) = common::start(cfg.clone(), 2);
    let mut ini = Initiator::new(ports);
    ini.attach("f", None).expect("attach");
    // 64 writes of 64 KiB in flight, then the target is told to stop while they run.
    let mut pending = Vec::new();
    for i in 0..64u64 {
        let data = pattern(i * 65536, 65536, i as u8);
        let id = ini.submit(Op::Write, i * 65536, data.clone(), 65536, false);
        pending.push((id, i * 65536, data));
    }
    for _ in 0..3 {
        ini.pump();
    }
    let stopper = std::thread::spawn(move || target.shutdown());
    let mut acked = Vec::new();
    let mut failed = 0;
    for (id, off, data) in pending {
        match ini.wait(id).0 {
            Ok(()) => acked.push((off, data)),
            Err(_) => failed += 1,
        }
    }
    let snap = stopper.join().expect("shutdown");
    assert_eq!(snap.storage_inflight, 0, "shutdown waited for storage");
    assert!(!acked.is_empty(), "some writes were acknowledged ({failed} failed)");
    drop(ini);
    let (target, ports) = common::start(cfg, 1);
    let mut ini = Initiator::new(ports);
    ini.attach("f", None).expect("attach after restart");
    for (off, data) in &acked {
        assert!(ini.read(*off, data.len()) == *data, "acknowledged write at {off} survived the shutdown");
    }
    drop(target);
}

#[test]
fn discovery_of_many_long_names_pages() {
    let exports = (0..10).map(|i| ExportConfig::ram(&format!("{i:0>64}"), 1 << 20)).collect();
    let (target, mut ports) = common::start(config(exports), 1);
    let mut seen = Vec::new();
    for start in [0u16, 8] {
        let env = tyche_wire::Envelope {
            dst: common::target_mac(0),
            src: common::init_mac(0),
            ethertype: tyche_wire::DEFAULT_ETHERTYPE,
            channel: 0,
            session: 0,
        };
        let mut buf = vec![0u8; 256];
        let len = tyche_wire::Message::Discover(tyche_wire::Discover { nonce: 1, start }).emit(&env, &mut buf);
        common::send(&mut ports[0], &buf[..len]);
        let deadline = std::time::Instant::now() + common::LIMIT;
        let mut got = None;
        while got.is_none() {
            assert!(std::time::Instant::now() < deadline, "no DISCOVER_REPLY for start {start}");
            ports[0]
                .recv(8, &mut |b| {
                    let f = tyche_wire::Frame::new_checked(b, tyche_wire::DEFAULT_ETHERTYPE).expect("valid reply");
                    if let Ok(tyche_wire::Message::DiscoverReply(r)) = f.parse() {
                        got = Some((r.total, r.exports.iter().map(|e| e.name.to_string()).collect::<Vec<_>>()));
                    }
                })
                .expect("recv");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let (total, names) = got.expect("reply");
        assert_eq!(total, 10);
        seen.extend(names);
    }
    assert_eq!(seen.len(), 10, "two pages list every export: {seen:?}");
    assert_eq!(target.stats().exports.len(), 10);
}

#[test]
fn corrupted_copies_of_every_frame_never_crash_the_target() {
    for seed in 1..=6 {
        let (target, ports) = common::start(config(vec![ExportConfig::ram("r", 4 << 20)]), 2);
        let mut ini = Initiator::new(ports);
        ini.attach("r", None).expect("attach");
        ini.mutate = Some(tyche_transport::SplitMix64::new(seed));
        // Corrupted copies can be mistaken for real frames (Tyche relies on the Ethernet FCS),
        // so only liveness is checked here, not the data: every request ends, one way or another.
        let mut ids = Vec::new();
        for i in 0..48u64 {
            let op = if i % 3 == 2 { Op::Read } else { Op::Write };
            let len = 512 * (1 + (i * 37 + seed) % 200);
            let data = if op == Op::Write { pattern(i << 16, len as usize, i as u8) } else { vec![0; len as usize] };
            ids.push(ini.submit(op, i << 16, data, len, i % 5 == 0));
        }
        for id in ids {
            let _ = ini.wait(id);
        }
        let s = target.stats();
        assert!(!target.is_finished(), "seed {seed}: the target is still running");
        let dropped: u64 = s.nics.iter().map(|n| n.drops.malformed + n.drops.not_ours + n.drops.channel_total()).sum();
        assert!(dropped > 0, "seed {seed}: corrupted frames were counted: {:?}", s.nics);
        let last = target.shutdown();
        assert_eq!(last.storage_inflight, 0, "seed {seed}: clean shutdown");
    }
}

/// Write data stays in the frames it arrived in when the links lend them: nothing copied on the
/// write path, to a RAM and a file export, with lost and duplicated frames, and every kept frame
/// goes back to its link.
#[test]
fn write_data_stays_in_lent_frames_with_loss_and_duplicates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let cfg = config(vec![ExportConfig::ram("ram", 8 << 20), ExportConfig::file("file", &file, Some(8 << 20))]);
    let faults = tyche_transport::FaultConfig { loss: 0.01, duplicate: 0.05, ..Default::default() };
    for (e, export) in ["ram", "file"].into_iter().enumerate() {
        let (target, ports) = common::start_lending(cfg.clone(), 2, 1 << 16, faults);
        let mut ini = Initiator::new(ports);
        ini.attach(export, None).expect("attach");
        let sizes = [512usize, 1024, 4096, 8192 + 512, 65536, 131072 + 512, 1 << 20];
        let (mut offset, mut written, mut ids) = (0u64, Vec::new(), Vec::new());
        for (i, &len) in sizes.iter().enumerate() {
            let data = pattern(offset, len, i as u8 + 1);
            ids.push(ini.submit(Op::Write, offset, data.clone(), len as u64, i % 3 == 0));
            written.push((offset, data));
            offset += len as u64;
        }
        for id in ids {
            ini.wait(id).0.expect("write completes");
        }
        for (off, data) in &written {
            assert!(ini.read(*off, data.len()) == *data, "{export}: read back {} bytes at {off}", data.len());
        }
        let s = common::wait_leases_back(&target);
        let bytes: u64 = sizes.iter().map(|&l| l as u64).sum();
        assert_eq!(s.exports[e].bytes_written, bytes, "{export}");
        assert_eq!(s.payload_copied_write_bytes, 0, "{export}: no write payload copied: {s:?}");
        let kept: u64 = s.nics.iter().map(|n| n.frames_kept).sum();
        assert!(kept >= bytes / 8192, "{export}: every segment kept ({kept})");
        assert!(s.drops(|d| d.channel.get("duplicate").copied().unwrap_or(0)) > 0, "duplicates arrived: {:?}", s.nics);
        let s = target.shutdown();
        assert_eq!(s.leases_held, 0, "{export}: nothing kept after shutdown");
        if export == "file" {
            assert_file_holds(&file, &written);
        }
    }
}

/// Multi-buffer links (MTU 9000 frames in three pieces, as AF_XDP hands them over): write data
/// stays in all the pieces of the frames it arrived in, storage writes from the pieces, read
/// data goes straight into groups of transmit chunks sent as one frame each; nothing is copied
/// either way, to a RAM and a file export, and every piece goes back to its link.
#[test]
fn multi_buffer_frames_move_data_without_copies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let cfg = config(vec![ExportConfig::ram("ram", 8 << 20), ExportConfig::file("file", &file, Some(8 << 20))]);
    for (e, export) in ["ram", "file"].into_iter().enumerate() {
        let (target, ports) = common::start_lending_pieces(cfg.clone(), 2, 1 << 12);
        let mut ini = Initiator::new(ports);
        ini.attach(export, None).expect("attach");
        let sizes = [512usize, 8192, 8192 + 512, 128 << 10, 131072 + 512, 1 << 20];
        let (mut offset, mut written) = (0u64, Vec::new());
        for (i, &len) in sizes.iter().enumerate() {
            let data = pattern(offset, len, i as u8 + 1);
            ini.write(offset, &data);
            written.push((offset, data));
            offset += len as u64;
        }
        for (off, data) in &written {
            assert!(ini.read(*off, data.len()) == *data, "{export}: read back {} bytes at {off}", data.len());
        }
        let s = common::wait_leases_back(&target);
        let bytes: u64 = sizes.iter().map(|&l| l as u64).sum();
        assert_eq!(s.exports[e].bytes_written, bytes, "{export}");
        assert_eq!(s.exports[e].bytes_read, bytes, "{export}");
        assert_eq!(s.payload_copied_bytes, 0, "{export}: no payload copied either way: {s:?}");
        let kept: u64 = s.nics.iter().map(|n| n.frames_kept).sum();
        assert!(kept >= bytes / 8192, "{export}: every segment kept ({kept})");
        let in_place: u64 = s.nics.iter().map(|n| n.frames_sent_in_place).sum();
        assert!(in_place >= bytes / 8192, "{export}: read data sent from chunk groups ({in_place})");
        let s = target.shutdown();
        assert_eq!(s.leases_held, 0, "{export}: nothing kept after shutdown");
        if export == "file" {
            assert_file_holds(&file, &written);
        }
    }
}

/// A link that lends only a few frames at once: the rest is copied, and counted.
#[test]
fn lending_limit_falls_back_to_counted_copies() {
    let cfg = config(vec![ExportConfig::ram("ram", 4 << 20)]);
    let (target, ports) = common::start_lending(cfg, 1, 8, Default::default());
    let mut ini = Initiator::new(ports);
    ini.attach("ram", None).expect("attach");
    let data = pattern(0, 1 << 20, 3);
    ini.write(0, &data);
    assert!(ini.read(0, data.len()) == data, "read back");
    let s = common::wait_leases_back(&target);
    let kept = s.nics[0].frames_kept;
    assert!(kept > 0 && kept <= 8 * 2, "a few kept: {kept}");
    assert_eq!(s.payload_copied_write_bytes, (1 << 20) - kept * 8192, "the rest copied and counted: {s:?}");
}

/// Frames kept for writes that never execute go back when the session is reclaimed.
#[test]
fn kept_frames_of_a_vanished_initiator_go_back() {
    let cfg = Config { dead_after_ms: 250, reclaim_after_ms: 500, ..config(vec![ExportConfig::ram("r", 4 << 20)]) };
    let (target, ports) = common::start_lending(cfg, 2, 1 << 16, Default::default());
    let mut ini = Initiator::new(ports);
    ini.attach("r", None).expect("attach");
    // Big writes, only partly sent before the initiator vanishes.
    for i in 0..3u64 {
        ini.submit(Op::Write, i << 20, pattern(i << 20, 1 << 20, 9), 1 << 20, false);
    }
    ini.pump();
    let deadline = std::time::Instant::now() + common::LIMIT;
    while target.stats().leases_held == 0 {
        assert!(std::time::Instant::now() < deadline, "no frame kept");
        ini.pump();
    }
    drop(ini);
    let deadline = std::time::Instant::now() + common::LIMIT;
    while target.stats().sessions_reclaimed == 0 {
        assert!(std::time::Instant::now() < deadline, "session never reclaimed");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let s = common::wait_leases_back(&target);
    assert!(s.nics.iter().map(|n| n.frames_kept).sum::<u64>() > 0);
}

#[test]
fn a_session_silent_for_less_than_reclaim_after_is_resumed_with_its_id() {
    // Channels die after 500 ms of silence; the session that carried traffic is kept 10 s, so
    // the initiator, back after 1.5 s, rejoins the same session (and its at-most-once ledger).
    let ram = ExportConfig { shared: true, ..ExportConfig::ram("ram", 8 << 20) };
    let cfg = Config { dead_after_ms: 500, reclaim_after_ms: 10_000, ..config(vec![ram]) };
    let (target, ports) = common::start(cfg, 1);
    let mut ini = Initiator::new(ports);
    let c = ini.attach("ram", None).expect("attach");
    ini.write(0, &pattern(0, 65536, 3));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(target.stats().channels.iter().all(|ch| ch.dead), "the silent channel is dead");
    assert_eq!(target.stats().sessions, 1, "the session is kept");
    let (_, r) = ini.handshake(0, c.session, "ram", None);
    assert_eq!(r.expect("rejoins").session, c.session);
    // A session that never carried a frame after its handshake goes after dead_after + 500 ms
    // (another host's, so it does not fence the first).
    ini.host = Some([7; 16]);
    let (_, fresh) = ini.handshake(0, 0, "ram", None);
    let fresh = fresh.expect("a second session").session;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while target.stats().channels.iter().any(|ch| ch.session == fresh) {
        assert!(std::time::Instant::now() < deadline, "the idle session was not reclaimed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(target.stats().channels.iter().any(|ch| ch.session == c.session), "the resumed session stays");
}

#[test]
fn an_export_is_attached_by_one_initiator_and_a_reattach_fences_the_old_session() {
    let cfg = config(vec![ExportConfig::ram("solo", 8 << 20)]);
    let (target, ports) = common::start(cfg, 2);
    let mut ports = ports.into_iter();
    let mut a = Initiator::new(vec![ports.next().expect("port 0")]);
    a.host = Some([0xaa; 16]);
    let first = a.attach("solo", None).expect("the first initiator attaches");
    a.write(0, &pattern(0, 65536, 1));
    // Another host: refused, naming the holder's MAC.
    let mut b = Initiator::new(vec![ports.next().expect("port 1")]);
    b.target_macs = vec![common::target_mac(1)];
    b.host = Some([0xbb; 16]);
    let (_, r) = b.handshake(0, 0, "solo", None);
    assert_eq!(r.err(), Some(ConnectError::InUse(common::init_mac(0))), "a second host is refused");
    // The same host again (its process restarted): the old session is fenced, the new one serves.
    let mut a2 = Initiator::new(a.ports.drain(..).collect());
    a2.host = Some([0xaa; 16]);
    let second = a2.attach("solo", None).expect("the same host attaches again");
    assert_ne!(second.session, first.session);
    assert_eq!(a2.read(0, 65536), pattern(0, 65536, 1));
    a2.write(65536, &pattern(65536, 4096, 2));
    let s = target.stats();
    assert_eq!(s.sessions_fenced, 1);
    assert!(
        s.channels.iter().filter(|c| c.session == first.session).all(|c| c.dead),
        "the old session's channels are closed"
    );
    // A shared export takes both hosts.
    let shared = ExportConfig { shared: true, ..ExportConfig::ram("both", 1 << 20) };
    let (_target2, ports) = common::start(config(vec![shared]), 2);
    let mut ports = ports.into_iter();
    let mut a = Initiator::new(vec![ports.next().expect("port 0")]);
    a.host = Some([0xaa; 16]);
    a.attach("both", None).expect("first host");
    let mut b = Initiator::new(vec![ports.next().expect("port 1")]);
    b.target_macs = vec![common::target_mac(1)];
    b.host = Some([0xbb; 16]);
    assert!(b.handshake(0, 0, "both", None).1.is_ok(), "a shared export takes a second host");
}

/// A reattach of the same host fences its old session on every network thread: the old
/// session had a channel on each of two NICs (two threads), and both close; the new session
/// reads what the old one wrote.
#[test]
fn a_reattach_fences_the_old_session_on_every_thread() {
    // Channels never die of silence within the test: only the fence closes them.
    let cfg = Config { dead_after_ms: 120_000, ..config(vec![ExportConfig::ram("solo", 8 << 20)]) };
    let (target, ports) = common::start(cfg, 2);
    let mut a = Initiator::new(ports);
    a.host = Some([0xaa; 16]);
    let first = a.attach("solo", None).expect("the first initiator attaches");
    a.write(0, &pattern(0, 1 << 20, 1));
    let s = target.stats();
    let nics: std::collections::BTreeSet<String> =
        s.channels.iter().filter(|c| c.session == first.session).map(|c| c.nic.clone()).collect();
    assert_eq!(nics.len(), 2, "the old session spans both NICs' threads: {nics:?}");
    let mut a2 = Initiator::new(a.ports.drain(..).collect());
    a2.host = Some([0xaa; 16]);
    let second = a2.attach("solo", None).expect("the same host attaches again");
    assert_ne!(second.session, first.session);
    assert_eq!(a2.read(0, 1 << 20), pattern(0, 1 << 20, 1));
    let deadline = std::time::Instant::now() + common::LIMIT;
    loop {
        let s = target.stats();
        let old: Vec<(String, bool)> =
            s.channels.iter().filter(|c| c.session == first.session).map(|c| (c.nic.clone(), c.dead)).collect();
        if old.iter().all(|(_, dead)| *dead) {
            assert_eq!(s.sessions_fenced, 1);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the old session's channels stay open: {old:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// BLOCK_STATUS on RAM and file exports (through io_uring's engine and the thread pool): the
/// list comes back into the request's buffer, holes where nothing was written; a volume not
/// granted the feature never sends it and answers UNSUPPORTED.
#[test]
fn block_status_reports_holes_of_ram_and_file_exports() {
    use tyche_wire::{flags, BlockStatusList, Extent};
    let hz = flags::EXTENT_HOLE | flags::EXTENT_ZERO;
    for io_uring in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("sparse.img");
        let cfg = Config {
            io_uring,
            ..config(vec![ExportConfig::ram("r", 8 << 20), ExportConfig::file("f", &file, Some(8 << 20))])
        };
        for export in ["r", "f"] {
            let (target, ports) = common::start(cfg.clone(), 1);
            let mut ini = Initiator::new(ports);
            ini.features = flags::FEATURE_BLOCK_STATUS;
            ini.attach(export, None).expect("attach");
            ini.write(1 << 20, &pattern(0, 65536, 3));
            let list = ini
                .io(Op::BlockStatus, 0, vec![0; tyche_wire::layout::block_status::LEN], false)
                .expect("block status");
            // io() sends the buffer's length as the range: ask for 512 bytes of range first.
            let l = BlockStatusList::parse(&list, 512).expect("a valid list");
            assert_eq!(l.iter().collect::<Vec<_>>(), [Extent { length: 512, flags: hz }], "{export}");
            let id = ini.submit(Op::BlockStatus, 0, vec![0; 512], 4 << 20, false);
            let (r, list) = ini.wait(id);
            r.expect("block status of 4 MiB");
            let l = BlockStatusList::parse(&list, 4 << 20).expect("a valid list");
            let got: Vec<_> = l.iter().collect();
            assert!(got.len() >= 2 && got[0].flags == hz, "{export}: {got:?}");
            let mut at = 0;
            let mut data = Vec::new();
            for e in &got {
                if e.flags == 0 {
                    data.push((at, at + e.length));
                }
                at += e.length;
            }
            assert!(
                data.iter().any(|&(s, e)| s <= 1 << 20 && e >= (1 << 20) + 65536),
                "{export} (io_uring {io_uring}): the written range is data: {got:?}"
            );
            let s = target.shutdown();
            let e = s.exports.iter().find(|e| e.name == export).expect("export stats");
            assert_eq!((e.requests.block_status, e.errors), (2, 0), "{export}");
        }
    }
    // Without the feature: UNSUPPORTED from the volume, nothing sent.
    let (target, ports) = common::start(config(vec![ExportConfig::ram("r", 1 << 20)]), 1);
    let mut ini = Initiator::new(ports);
    ini.attach("r", None).expect("attach");
    let id = ini.submit(Op::BlockStatus, 0, vec![0; 512], 4096, false);
    assert_eq!(ini.wait(id).0, Err(IoError::Target(Status::Unsupported)));
    assert_eq!(target.shutdown().exports[0].requests.block_status, 0);
}

/// The file holds every `(offset, data)` written.
fn assert_file_holds(file: &std::path::Path, written: &[(u64, Vec<u8>)]) {
    let disk = std::fs::read(file).expect("file");
    for (off, data) in written {
        assert!(disk[*off as usize..*off as usize + data.len()] == data[..], "file holds the write at {off}");
    }
}
