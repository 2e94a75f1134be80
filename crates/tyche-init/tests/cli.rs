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

#[test]
fn attach_without_ublk_points_to_nbd() {
    if Path::new("/dev/ublk-control").exists() {
        eprintln!("SKIP: this kernel has ublk");
        return;
    }
    fails_with(&["attach", "--loopback-mib", "16", "--export", "x"], "tyche-init serve-nbd --socket PATH");
    fails_with(&["attach", "--loopback-mib", "16", "--export", "x"], "/dev/ublk-control not found");
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
        "reading the key file",
    );
    fails_with(
        &["serve-nbd", "--socket", "/tmp/x.sock", "--export", "x", "--loopback-mib", "1", "--send-mode", "bulk"],
        "send mode",
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
    let d = bin().arg("detach").arg(&socket).env("TYCHE_INIT_STATE_DIR", &state).output().unwrap();
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
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
