//! The `tyche-init` command line: errors that point the way, and serve-nbd → list → detach.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tyche-init"))
}

fn fails_with(args: &[&str], needle: &str) {
    let out = bin().args(args).env("TYCHE_LOG", "off").output().expect("run tyche-init");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(err.contains(needle), "{args:?}: stderr lacks {needle:?}:\n{err}");
}

/// Runs tyche-init; asserts its exit status and that stderr has `needle` on its one line.
fn exits_with(args: &[&str], code: i32, needle: &str) {
    let out = bin().args(args).env("TYCHE_LOG", "off").env("RUST_BACKTRACE", "1").output().expect("run tyche-init");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: stderr lacks {needle:?}:\n{err}");
    assert!(!err.contains("backtrace"), "{args:?}: a configuration error is one line, not a backtrace:\n{err}");
}

#[test]
fn configuration_errors_exit_78_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let misspelt = file("vol.toml", "export = \"d\"\nifaces = [\"lo\"]\nno_path_timout = 5\n");
    exits_with(&["attach", "--config", &misspelt], 78, "vol.toml: unknown field `no_path_timout`");
    exits_with(&["serve-nbd", "--socket", "/tmp/x.sock", "--config", &misspelt], 78, "unknown field");
    let no_nic = file("gone.toml", "export = \"d\"\nifaces = [\"tyche-no-such0\"]\n");
    exits_with(
        &["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x", "--iface", "tyche-no-such0"],
        78,
        "no such interface",
    );
    exits_with(&["attach", "--config", &dir.path().join("missing.toml").display().to_string()], 78, "missing.toml");
    exits_with(&["attach", "--config", &no_nic, "--export", "y"], 2, "cannot be used with");
    exits_with(&["discover", "--iface", "lo", "--ethertype", "0x10"], 2, "0x0600 or more");
    exits_with(
        &["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x", "--loopback-mib", "1", "--key", "/nonexistent/k"],
        78,
        "--key",
    );
}

/// With an attachment file (the unit's form), an interface that does not exist yet is waited
/// for (a NIC that comes late at boot), told in the log, and a stop while waiting exits 0; it
/// becomes exit 78 after a minute (`INTERFACE_WAIT`). Without `--config` or `--retry` it is
/// exit 78 at once (above).
#[test]
fn a_missing_interface_is_waited_for_with_an_attachment_file() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("late.toml");
    std::fs::write(&conf, "export = \"d\"\nifaces = [\"tyche-late0\"]\n").unwrap();
    let log = dir.path().join("log");
    let mut child = bin()
        .args(["serve-nbd", "--socket"])
        .arg(dir.path().join("s.sock"))
        .arg("--config")
        .arg(&conf)
        .env("TYCHE_INIT_STATE_DIR", dir.path())
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("run tyche-init");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("\"tyche-late0\": no such interface") && text.contains("trying again") {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "tyche-init exited instead of waiting:\n{text}");
        assert!(Instant::now() < deadline, "no waiting line in the log:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill takes integers; the child is ours and not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(0), "a stop while waiting: {}", std::fs::read_to_string(&log).unwrap_or_default());
}

#[test]
fn attach_without_ublk_points_to_nbd() {
    if Path::new("/dev/ublk-control").exists() {
        tyche_testkit::cannot_run("attach_without_ublk_points_to_nbd", "this kernel has ublk");
        return;
    }
    fails_with(&["attach", "--loopback-mib", "16", "--export", "x"], "tyche-init serve-nbd --socket PATH");
    fails_with(&["attach", "--loopback-mib", "16", "--export", "x"], "/dev/ublk-control not found");
}

#[test]
fn recover_options_say_what_is_wrong() {
    let conn = ["attach", "--loopback-mib", "16", "--export", "x"];
    let with = |extra: &[&'static str]| conn.iter().chain(extra).copied().collect::<Vec<_>>();
    fails_with(&with(&["--recover", "sda"]), "give /dev/ublkbN or N");
    fails_with(&with(&["--recover", "0", "--dev-id", "1"]), "cannot be used with");
    fails_with(&with(&["--recover", "/dev/ublkb0", "--no-recovery"]), "cannot be used with");
    if !Path::new("/dev/ublk-control").exists() {
        fails_with(&with(&["--recover", "/dev/ublkb0"]), "/dev/ublk-control not found");
    }
}

#[test]
fn bad_connection_options_say_what_is_wrong() {
    fails_with(&["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x"], "give --iface IF");
    let three_targets =
        ["--target", "02:00:00:00:00:01", "--target", "02:00:00:00:00:02", "--target", "02:00:00:00:00:03"];
    let mut args = vec!["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x", "--iface", "lo", "--iface", "lo"];
    args.extend(three_targets);
    fails_with(&args, "one per --iface");
    fails_with(
        &["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x", "--iface", "lo", "--target", "zz"],
        "not a MAC",
    );
    fails_with(
        &["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x", "--loopback-mib", "1", "--key", "/nonexistent/k"],
        "--key /nonexistent/k: No such file",
    );
    fails_with(
        &["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x", "--loopback-mib", "1", "--send-mode", "bulk"],
        "--send-mode",
    );
    fails_with(
        &["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x", "--iface", "lo", "--channel-memory-node", "999"],
        "NUMA node 999 does not exist",
    );
    fails_with(
        &[
            "serve-nbd",
            "--socket",
            "/tmp/x.sock",
            "--export",
            "x",
            "--loopback-mib",
            "1",
            "--engine-thread-node",
            "999",
        ],
        "--engine-thread-node 999",
    );
}

#[test]
fn serve_nbd_is_listed_and_detached() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("t.sock");
    let state = dir.path().join("state");
    let mut child = bin()
        .args(["serve-nbd", "--loopback-mib", "8", "--export", "ram", "--socket"])
        .arg(&socket)
        .env("TYCHE_INIT_STATE_DIR", &state)
        .env("TYCHE_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn serve-nbd");
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < Duration::from_secs(30), "socket never appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    let list = bin().arg("list").env("TYCHE_INIT_STATE_DIR", &state).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(list.contains(&socket.display().to_string()) && list.contains("export=ram"), "{list}");
    assert!(list.contains("state=live (2 of 2 links)"), "{list}");
    let json = bin().args(["list", "--json"]).env("TYCHE_INIT_STATE_DIR", &state).output().unwrap();
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("list --json is JSON");
    assert_eq!(json[0]["state"], "live", "{json}");
    assert_eq!(json[0]["export"], "ram", "{json}");
    assert_eq!(json[0]["live_links"], 2, "{json}");
    let udev = bin().args(["udev-info"]).arg(&socket).env("TYCHE_INIT_STATE_DIR", &state).output().unwrap();
    let udev = String::from_utf8_lossy(&udev.stdout);
    assert!(udev.contains("TYCHE_TARGET=loopback\nTYCHE_EXPORT=ram\n"), "{udev}");
    let d = bin().arg("detach").arg(&socket).env("TYCHE_INIT_STATE_DIR", &state).output().unwrap();
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    // detach returns once the attachment is gone.
    assert!(!socket.exists(), "socket removed before detach returned");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("serve-nbd did not exit after detach");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "socket removed on detach");
    let list = bin().arg("list").env("TYCHE_INIT_STATE_DIR", &state).output().unwrap();
    assert!(String::from_utf8_lossy(&list.stdout).contains("no attached exports"));
}

#[test]
fn stats_show_per_channel_bytes_and_nbd_buffers_on_their_node() {
    if Command::new("nbdcopy").arg("--version").output().is_err()
        || !Path::new("/sys/devices/system/node/node0").exists()
    {
        tyche_testkit::cannot_run(
            "stats_show_per_channel_bytes_and_nbd_buffers_on_their_node",
            "needs nbdcopy (libnbd-bin) and sysfs NUMA nodes",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("t.sock");
    let stats = dir.path().join("t.stats.sock");
    let state = dir.path().join("state");
    let mut child = bin()
        // A task per request on the connection's own (pinned) thread: the in-process target's links
        // have no node, so their engine thread is not pinned (`cargo xtask vm-test` checks the
        // engine threads of real NICs on two nodes serving NBD connections).
        .args(["serve-nbd", "--loopback-mib", "16", "--export", "ram", "--nbd-nodes", "0", "--nbd-io", "tasks"])
        .arg("--socket")
        .arg(&socket)
        .arg("--stats-socket")
        .arg(&stats)
        .env("TYCHE_INIT_STATE_DIR", &state)
        .env("TYCHE_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn serve-nbd");
    let t0 = Instant::now();
    while !socket.exists() || !stats.exists() {
        assert!(t0.elapsed() < Duration::from_secs(30), "sockets never appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    let input = dir.path().join("in");
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(&input, &data).unwrap();
    let uri = format!("nbd+unix:///ram?socket={}", socket.display());
    let out = Command::new("nbdcopy").args(["--connections=1", "--requests=4"]).arg(&input).arg(&uri).output().unwrap();
    assert!(out.status.success(), "nbdcopy: {}", String::from_utf8_lossy(&out.stderr));
    let back = dir.path().join("out");
    let out = Command::new("nbdcopy").args(["--connections=1"]).arg(&uri).arg(&back).output().unwrap();
    assert!(out.status.success(), "nbdcopy: {}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&back).unwrap()[..data.len()] == data[..], "read back differs");
    // By the NBD socket's path (through the state directory) and straight from the stats socket.
    for what in [socket.clone(), stats.clone()] {
        let out = bin().arg("stats").arg(&what).arg("--json").env("TYCHE_INIT_STATE_DIR", &state).output().unwrap();
        assert!(out.status.success(), "stats: {}", String::from_utf8_lossy(&out.stderr));
        let r: tyche_init::Report = serde_json::from_slice(&out.stdout).expect("stats --json is a report");
        assert_eq!(r.channels.len(), 2, "{r:?}");
        let tx: u64 = r.channels.iter().map(|c| c.payload_tx).sum();
        let rx: u64 = r.channels.iter().map(|c| c.payload_rx).sum();
        assert!(tx >= 8 << 20 && rx >= 8 << 20, "payload per channel: {:?}", r.channels);
        assert!(r.channels.iter().all(|c| c.thread.name == "tyche-engine"), "{:?}", r.channels);
        let node0 = std::fs::read_to_string("/sys/devices/system/node/node0/cpulist").unwrap();
        let node0 = tyche_numa::parse_cpu_list(node0.trim()).unwrap();
        let busy: Vec<_> = r.nbd.iter().filter(|c| c.bytes_written > 0).collect();
        assert_eq!(busy.len(), 1, "{:?}", r.nbd);
        let c = busy[0];
        assert_eq!(c.node, Some(0));
        assert_eq!(c.bytes_written, 8 << 20);
        assert_eq!(c.thread.name, format!("tyche-nbd{}", c.conn), "{c:?}");
        assert_eq!(c.thread.cpus, node0, "the connection thread is pinned to node 0's CPUs: {c:?}");
        assert!(c.buffers.all_on_expected(), "every buffer page on node 0: {c:?}");
        let text = bin().arg("stats").arg(&what).env("TYCHE_INIT_STATE_DIR", &state).output().unwrap();
        assert!(String::from_utf8_lossy(&text.stdout).contains("NBD connections"), "human output");
    }
    let _ = bin().arg("detach").arg(&socket).env("TYCHE_INIT_STATE_DIR", &state).output();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("serve-nbd did not exit after detach");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
