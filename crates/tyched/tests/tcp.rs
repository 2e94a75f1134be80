//! The `tyched` binary over the TCP transport on loopback (no privileges needed): attach, write,
//! read, SIGTERM (exit 0), restart with the same file export, read back.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{pattern, Initiator, Port};

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn start(addr: &str, file: &std::path::Path, socket: &std::path::Path) -> Daemon {
    let child = Command::new(env!("CARGO_BIN_EXE_tyched"))
        .args(["serve", "--transport", "tcp", "--iface", "lo", "--tcp-listen", addr, "--workers", "2"])
        .arg("--export")
        .arg(format!("disk={}", file.display()))
        .arg("--stats-socket")
        .arg(socket)
        .stdin(Stdio::null())
        .spawn()
        .expect("start tyched");
    Daemon(child)
}

/// Connects to the daemon (retrying while it starts) and wraps the stream as the initiator's port.
fn connect(addr: &str) -> Port {
    let deadline = std::time::Instant::now() + common::LIMIT;
    loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => {
                let t = tyche_tcp::TcpTransport::new(s, 9000, common::init_mac(0)).expect("TCP transport");
                return Box::new(t);
            }
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "tyched never listened on {addr}: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn stop(d: &mut Daemon, sig: i32) {
    // SAFETY: kill takes integers; the child is ours and not yet reaped.
    assert_eq!(unsafe { libc::kill(d.0.id() as i32, sig) }, 0);
    let deadline = std::time::Instant::now() + common::LIMIT;
    loop {
        if let Some(st) = d.0.try_wait().expect("wait") {
            assert!(st.success(), "tyched exits 0 after signal {sig}: {st:?}");
            return;
        }
        assert!(std::time::Instant::now() < deadline, "tyched did not exit after signal {sig}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn tyched_binary_over_tcp_survives_sigterm_and_restart() {
    if Command::new("ip").args(["link", "show", "lo"]).output().map_or(true, |o| !o.status.success()) {
        eprintln!("skipping: no loopback interface");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    std::fs::File::create(&file).expect("create").set_len(4 << 20).expect("size");
    let socket = dir.path().join("stats.sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
    let addr = format!("127.0.0.1:{port}");

    let mut d = start(&addr, &file, &socket);
    let mut ini = Initiator::new(vec![connect(&addr)]);
    ini.target_macs = vec![tyched::tcp_mac(0)];
    let c = ini.attach("disk", None).expect("attach over TCP");
    assert_eq!(c.export_size, 4 << 20);
    let mut written = Vec::new();
    for (i, len) in [512usize, 8192, 100 * 1024, 1 << 20].into_iter().enumerate() {
        let off = (i as u64) << 20;
        let data = pattern(off, len, i as u8 + 3);
        ini.write(off, &data);
        written.push((off, data));
    }
    for (off, data) in &written {
        assert!(ini.read(*off, data.len()) == *data, "read back {} bytes at {off}", data.len());
    }
    stop(&mut d, libc::SIGTERM);
    drop(ini);

    let mut d = start(&addr, &file, &socket);
    let mut ini = Initiator::new(vec![connect(&addr)]);
    ini.target_macs = vec![tyched::tcp_mac(0)];
    ini.attach("disk", None).expect("attach after restart");
    for (off, data) in &written {
        assert!(ini.read(*off, data.len()) == *data, "after restart: {} bytes at {off}", data.len());
    }
    stop(&mut d, libc::SIGINT);
}
