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

/// The addresses a `tyched serve` that asked for port 0 bound, read from its log: no port is
/// picked here and released for the daemon to bind, where another test's socket could take it
/// first.
struct Bound {
    rx: std::sync::mpsc::Receiver<(bool, Option<String>)>,
    tcp: Option<String>,
    metrics: Option<String>,
}

impl Bound {
    /// The TCP transport's address, or with `metrics` the metrics endpoint's (logged once the
    /// daemon serves, i.e. after the initiators connected).
    fn wait(&mut self, d: &mut Daemon, metrics: bool) -> String {
        let deadline = std::time::Instant::now() + common::LIMIT;
        loop {
            if let Some(a) = if metrics { &self.metrics } else { &self.tcp } {
                return a.clone();
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((m, a)) => {
                    let a = a.expect("an addr= field in the daemon's log line");
                    *if m { &mut self.metrics } else { &mut self.tcp } = Some(a);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("tyched exited before it listened: {:?}", d.0.wait())
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("tyched did not listen within {:?}", common::LIMIT)
                }
            }
        }
    }
}

/// Starts `cmd` (a `tyched serve` asking for port 0); its log goes on to this test's stderr.
fn spawn(mut cmd: Command) -> (Daemon, Bound) {
    use std::io::BufRead;
    let mut child = cmd.stdin(Stdio::null()).stderr(Stdio::piped()).spawn().expect("start tyched");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            let addr = || line.split_once(" addr=").and_then(|(_, r)| r.split_whitespace().next()).map(str::to_owned);
            if line.contains("TCP transport: waiting for initiators") {
                let _ = tx.send((false, addr()));
            } else if line.contains("Prometheus metrics at /metrics") {
                let _ = tx.send((true, addr()));
            }
        }
    });
    (Daemon(child), Bound { rx, tcp: None, metrics: None })
}

fn start(file: &std::path::Path, socket: &std::path::Path) -> (Daemon, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tyched"));
    cmd.args(["serve", "--transport", "tcp", "--iface", "lo", "--tcp-listen", "127.0.0.1:0", "--workers", "2"])
        .arg("--export")
        .arg(format!("disk={}", file.display()))
        .arg("--stats-socket")
        .arg(socket);
    let (mut d, mut bound) = spawn(cmd);
    let addr = bound.wait(&mut d, false);
    (d, addr)
}

/// Connects to the daemon's TCP transport and wraps the stream as the initiator's port.
fn connect(addr: &str) -> Port {
    let s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to tyched at {addr}: {e}"));
    Box::new(tyche_tcp::TcpTransport::new(s, 9000, common::init_mac(0)).expect("TCP transport"))
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
        tyche_testkit::cannot_run("tyched over TCP on loopback", "no loopback interface (ip link show lo)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    std::fs::File::create(&file).expect("create").set_len(4 << 20).expect("size");
    let socket = dir.path().join("stats.sock");

    let (mut d, addr) = start(&file, &socket);
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

    let (mut d, addr) = start(&file, &socket);
    let mut ini = Initiator::new(vec![connect(&addr)]);
    ini.target_macs = vec![tyched::tcp_mac(0)];
    ini.attach("disk", None).expect("attach after restart");
    for (off, data) in &written {
        assert!(ini.read(*off, data.len()) == *data, "after restart: {} bytes at {off}", data.len());
    }
    stop(&mut d, libc::SIGINT);
}

/// One HTTP GET over TCP; returns the whole response.
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the Prometheus endpoint");
    s.set_read_timeout(Some(common::LIMIT)).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    out
}

#[test]
fn tyched_binary_serves_prometheus_metrics() {
    if Command::new("ip").args(["link", "show", "lo"]).output().map_or(true, |o| !o.status.success()) {
        tyche_testkit::cannot_run("tyched over TCP on loopback", "no loopback interface (ip link show lo)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    std::fs::File::create(&file).expect("create").set_len(4 << 20).expect("size");
    let socket = dir.path().join("stats.sock");

    // A non-loopback address is refused unless allowed, with the field named.
    let check = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_tyched"))
            .args(["serve", "--check", "--iface", "lo", "--export", "d=ram:1M"])
            .args(extra)
            .output()
            .expect("tyched serve --check")
    };
    let out = check(&["--prometheus-listen", "0.0.0.0:9464"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prometheus_listen: 0.0.0.0:9464 is not a loopback address"), "{err}");
    assert!(check(&["--prometheus-listen", "0.0.0.0:9464", "--prometheus-allow-remote"]).status.success());
    // A consumer CPU list that does not parse is refused with the field named.
    let out = check(&["--consumer-cpus", "3-1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("consumer_cpus"), "{out:?}");
    assert!(check(&["--consumer-cpus", "0"]).status.success());
    // --check refuses what serve would: an interface this host lacks, a file export that does
    // not exist and has no size, one whose directory does not exist; it creates nothing.
    // Each on one line, exit status 78 (EX_CONFIG), no backtrace even with RUST_BACKTRACE set.
    let refused = |extra: &[&str], needle: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_tyched"))
            .args(["serve", "--check", "--iface", "lo", "--export", "d=ram:1M"])
            .args(extra)
            .env("RUST_BACKTRACE", "1")
            .output()
            .expect("tyched serve --check");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{extra:?}: {err}");
        assert!(err.contains(needle) && err.trim().lines().count() == 1, "{extra:?}: {err}");
    };
    refused(&["--iface", "no-such-if0"], "ifaces[1]: no network interface \"no-such-if0\"");
    let missing = dir.path().join("missing.img");
    refused(&["--export", &format!("m={}", missing.display())], "no such file, and no size to create it with");
    let nodir = dir.path().join("nodir/disk.img");
    refused(&["--export", &format!("m={}:1M", nodir.display())], "does not exist");
    assert!(!missing.exists() && !nodir.exists(), "--check created a file");
    let fresh = dir.path().join("fresh.img");
    assert!(check(&["--export", &format!("m={}:1M", fresh.display())]).status.success());
    assert!(!fresh.exists(), "--check created {}", fresh.display());

    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tyched"));
    cmd.args(["serve", "--transport", "tcp", "--iface", "lo", "--tcp-listen", "127.0.0.1:0", "--workers", "2"])
        .arg("--export")
        .arg(format!("disk={}", file.display()))
        .arg("--stats-socket")
        .arg(&socket)
        .args(["--prometheus-listen", "127.0.0.1:0"]);
    let (mut d, mut bound) = spawn(cmd);
    let addr = bound.wait(&mut d, false);
    let mut ini = Initiator::new(vec![connect(&addr)]);
    ini.target_macs = vec![tyched::tcp_mac(0)];
    ini.attach("disk", None).expect("attach over TCP");
    for i in 0..3u64 {
        ini.write(i << 16, &pattern(i << 16, 8192, 9));
    }
    let _ = ini.read(0, 8192);
    let metrics = bound.wait(&mut d, true);
    // Scrape until the counters show the writes (a snapshot is taken per scrape).
    let deadline = std::time::Instant::now() + common::LIMIT;
    let body = loop {
        let r = http_get(&metrics, "/metrics");
        let (head, body) = r.split_once("\r\n\r\n").expect("headers");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.contains("\r\nContent-Type: text/plain; version=0.0.4"), "{head}");
        if body.contains("tyched_export_requests_total{export=\"disk\",op=\"write\"} 3\n") {
            break body.to_owned();
        }
        assert!(std::time::Instant::now() < deadline, "the write counter never reached 3:\n{body}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(body.contains("tyched_export_requests_total{export=\"disk\",op=\"read\"} 1\n"), "{body}");
    assert!(body.contains("# TYPE tyched_sessions gauge\ntyched_sessions 1\n"), "{body}");
    assert!(body.contains("tyched_nic_rx_frames_total{nic=\"lo\"}"), "{body}");
    let build =
        format!("# TYPE tyched_build_info gauge\ntyched_build_info{{version=\"{}\",rustc=", env!("CARGO_PKG_VERSION"));
    assert!(body.contains(&build), "{body}");
    // The same text as `tyched stats --prometheus`, apart from values that move between reads.
    let out = Command::new(env!("CARGO_BIN_EXE_tyched"))
        .args(["stats", "--prometheus", "--socket"])
        .arg(&socket)
        .output()
        .expect("tyched stats --prometheus");
    let names = |t: &str| t.lines().map(|l| l.rsplit_once(' ').map_or(l, |(n, _)| n).to_owned()).collect::<Vec<_>>();
    assert_eq!(names(&body), names(&String::from_utf8_lossy(&out.stdout)), "same series as stats --prometheus");
    assert!(http_get(&metrics, "/").starts_with("HTTP/1.1 404 Not Found\r\n"));
    stop(&mut d, libc::SIGTERM);
    assert!(std::net::TcpStream::connect(&metrics).is_err(), "the endpoint is gone after exit");
}

/// Two TCP links on loopback as two NICs of an in-process target, one network thread each, with
/// a file export (completions come back from the io_uring thread and are taken by whichever
/// network thread locks the engine first). Unlike `MemLink`, the transports have readiness
/// descriptors, so the threads really sleep in `poll(2)` and a completion taken by the thread of
/// the other NIC must wake the channel's thread. This checks that the exchange works and that no
/// round stalls for long; it is not a precise detector of lost wakeups (the engine's own timers
/// and the shared storage eventfd bound what one costs to a few milliseconds).
#[test]
fn per_nic_threads_over_two_tcp_links_wake_each_other() {
    use tyched::config::{Config, ExportConfig, NetworkThreads};
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let cfg = Config {
        exports: vec![ExportConfig::file("disk", &file, Some(16 << 20))],
        workers: 2,
        network_threads: NetworkThreads::PerNic,
        ..Config::default()
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (mut ports, mut nics) = (Vec::new(), Vec::new());
    for k in 0..2 {
        let c = std::net::TcpStream::connect(addr).expect("connect");
        let (s, _) = listener.accept().expect("accept");
        let t = tyche_tcp::TcpTransport::new(s, 9000, tyched::tcp_mac(k)).expect("target side");
        nics.push(tyched::Nic { name: format!("tcp{k}"), transport: Box::new(t) });
        ports.push(Box::new(tyche_tcp::TcpTransport::new(c, 9000, common::init_mac(k)).expect("initiator side")) as Port);
    }
    let target = tyched::Target::start(cfg, nics).expect("target starts");
    assert_eq!(target.network_threads(), 2);
    let mut ini = Initiator::new(ports);
    ini.target_macs = vec![tyched::tcp_mac(0), tyched::tcp_mac(1)];
    ini.attach("disk", None).expect("attach over two links");
    let rounds = 200u64;
    let t = std::time::Instant::now();
    let mut slow = 0;
    for i in 0..rounds {
        let r = std::time::Instant::now();
        // Two writes in flight (one per channel), then both read back.
        let (a, b) = ((i % 64) * 8192, (i % 64) * 8192 + 4096);
        let (da, db) = (pattern(a, 4096, i as u8), pattern(b, 4096, !(i as u8)));
        let ia = ini.submit(tyche_wire::Op::Write, a, da.clone(), 4096, false);
        let ib = ini.submit(tyche_wire::Op::Write, b, db.clone(), 4096, false);
        ini.wait(ia).0.expect("write a");
        ini.wait(ib).0.expect("write b");
        assert!(ini.read(a, 4096) == da && ini.read(b, 4096) == db, "round {i} reads back");
        // A round of 80 ms or more waited for a poll cap or a timer (or the machine stalled).
        slow += usize::from(r.elapsed() >= Duration::from_millis(80));
    }
    let per_round = t.elapsed() / rounds as u32;
    let s = target.shutdown();
    eprintln!("per-NIC threads over two TCP links: {per_round:?} per round of 2 writes + 2 reads, {slow} slow");
    assert!(slow <= 3, "{slow} rounds of {rounds} took 80 ms or more");
    assert_eq!(s.exports[0].requests.write, 2 * rounds);
    assert_eq!(s.exports[0].io, "io_uring");
    assert!(s.nics.iter().all(|n| n.frames_rx > 0 && n.frames_tx > 0), "both links carried traffic: {:?}", s.nics);
}

/// Waits until the daemon's stats show `n` reloads (applied and refused together).
fn reloads(socket: &std::path::Path, n: u64) -> tyched::Snapshot {
    let deadline = std::time::Instant::now() + common::LIMIT;
    loop {
        if let Ok(s) = tyched::stats_server::query(socket) {
            if s.reload.applied + s.reload.failed >= n {
                return s;
            }
        }
        assert!(std::time::Instant::now() < deadline, "no reload {n} in the daemon's stats");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn tyched_binary_reloads_its_configuration_on_sighup() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("stats.sock");
    let conf = dir.path().join("tyched.toml");
    let head = format!(
        "transport = \"tcp\"\nifaces = [\"lo\"]\ntcp_listen = \"127.0.0.1:0\"\nworkers = 2\nstats_socket = \"{}\"\n\
         [[export]]\nname = \"disk\"\npath = \"{}\"\nsize = \"4M\"\n",
        socket.display(),
        dir.path().join("disk.img").display()
    );
    std::fs::write(&conf, &head).expect("write the configuration");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tyched"));
    cmd.args(["serve", "--config"]).arg(&conf);
    let (mut d, mut bound) = spawn(cmd);
    let addr = bound.wait(&mut d, false);
    let mut ini = Initiator::new(vec![connect(&addr)]);
    ini.target_macs = vec![tyched::tcp_mac(0)];
    ini.attach("disk", None).expect("attach over TCP");
    let data = pattern(0, 65536, 9);
    ini.write(0, &data);
    let hup = |d: &Daemon| {
        // SAFETY: kill takes integers; the child is ours and not yet reaped.
        assert_eq!(unsafe { libc::kill(d.0.id() as i32, libc::SIGHUP) }, 0);
    };

    // `tyched reload` (the unit's ExecReload): SIGHUP, then the outcome from the stats.
    let reload = |d: &Daemon| {
        Command::new(env!("CARGO_BIN_EXE_tyched"))
            .args(["reload", "--pid", &d.0.id().to_string(), "--config"])
            .arg(&conf)
            .output()
            .expect("tyched reload")
    };

    // An export added: served at once, the session from before untouched.
    std::fs::write(&conf, format!("{head}[[export]]\nname = \"more\"\nsize = \"1M\"\n")).expect("write");
    let out = reload(&d);
    assert!(out.status.success(), "tyched reload: {}", String::from_utf8_lossy(&out.stderr));
    let s = reloads(&socket, 1);
    assert_eq!((s.reload.applied, s.reload.failed), (1, 0), "{:?}", s.reload);
    assert_eq!(s.exports.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(), ["disk", "more"]);
    assert_eq!(s.sessions, 1, "the session survived the reload");
    assert_eq!(ini.read(0, data.len()), data);

    // A file that does not parse: refused, nothing changes, the daemon serves on.
    std::fs::write(&conf, format!("{head}[[export]\n")).expect("write");
    let out = reload(&d);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a refused reload fails `tyched reload`: {err}");
    assert!(err.contains("the reload was refused, nothing changed") && err.contains("tyched.toml"), "{err}");
    let s = reloads(&socket, 2);
    assert_eq!((s.reload.applied, s.reload.failed), (1, 1), "{:?}", s.reload);
    let why = s.reload.last_error.clone().unwrap_or_default();
    assert!(why.contains("tyched.toml"), "the error names the file: {why}");
    assert_eq!(s.exports.len(), 2);
    assert!(d.0.try_wait().expect("wait").is_none(), "a bad reload does not stop the daemon");

    // A change that needs a restart is named (and `tyched stats` shows it).
    std::fs::write(&conf, head.replace("workers = 2", "workers = 3")).expect("write");
    hup(&d);
    let s = reloads(&socket, 3);
    assert_eq!(s.reload.needs_restart, ["workers", "export \"more\" removed"], "{:?}", s.reload);
    let out = Command::new(env!("CARGO_BIN_EXE_tyched"))
        .args(["stats", "--socket"])
        .arg(&socket)
        .output()
        .expect("tyched stats");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("configuration reloads: 2 applied, 1 refused"), "{text}");
    assert!(text.contains("needs a restart: workers"), "{text}");
    assert_eq!(ini.read(0, data.len()), data);
    stop(&mut d, libc::SIGTERM);
}
