//! `--prometheus-listen`: the address checks (configuration errors, before connecting), and the
//! real `tyche-init serve-nbd` over its in-process target serving `/metrics` on a Unix socket
//! and on loopback TCP while a plain NBD client writes and reads. No root, no network.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tyche_init::nbd::codec;
use tyche_metrics::client::{get, Response};
use tyche_metrics::MetricsAddr;

const MIB: usize = 1 << 20;
const LIMIT: Duration = Duration::from_secs(30);

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tyche-init"))
}

/// Runs tyche-init; asserts its exit status and that stderr has `needle` (on its one line but
/// for clap's usage errors, exit 2).
fn exits_with(args: &[impl AsRef<std::ffi::OsStr>], code: i32, needle: &str) {
    let out = bin().args(args).env("TYCHE_LOG", "off").output().expect("run tyche-init");
    let err = String::from_utf8_lossy(&out.stderr);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(AsRef::as_ref).collect();
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: stderr lacks {needle:?}:\n{err}");
    if code != 2 {
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line:\n{err}");
    }
}

#[test]
fn bad_or_remote_addresses_are_configuration_errors_before_connecting() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("x.sock").display().to_string();
    // Nothing listens on port 1: a check after connecting would fail on the connection instead.
    let conn = ["serve-nbd", "--socket", &sock, "--export", "x", "--tcp", "127.0.0.1:1"];
    let with =
        |extra: &[&str]| conn.iter().copied().chain(extra.iter().copied()).map(str::to_owned).collect::<Vec<_>>();
    exits_with(
        &with(&["--prometheus-listen", "0.0.0.0:9465"]),
        78,
        "--prometheus-listen: 0.0.0.0:9465 is not a loopback address",
    );
    exits_with(&with(&["--prometheus-listen", "[::]:9465"]), 78, "--prometheus-allow-remote");
    exits_with(&with(&["--prometheus-listen", "nowhere"]), 78, "--prometheus-listen: \"nowhere\" is neither");
    exits_with(&with(&["--prometheus-listen", "localhost:x"]), 78, "not a port");
    // Allowed explicitly, the address passes and the connection is what fails (exit 1).
    exits_with(&with(&["--prometheus-listen", "0.0.0.0:0", "--prometheus-allow-remote"]), 1, "connecting to");
    // A taken address fails the start, before connecting.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    exits_with(&with(&["--prometheus-listen", &taken]), 1, &format!("prometheus_listen: binding {taken}"));

    // The attachment file's form, for attach and serve-nbd alike.
    let file = dir.path().join("vol.toml");
    std::fs::write(&file, "export = \"d\"\nifaces = [\"lo\"]\nprometheus_listen = \"192.0.2.1:9465\"\n").unwrap();
    let file = file.display().to_string();
    exits_with(&["attach", "--config", &file], 78, "vol.toml: prometheus_listen: 192.0.2.1:9465 is not a loopback");
    exits_with(&["serve-nbd", "--socket", &sock, "--config", &file], 78, "prometheus_listen: 192.0.2.1:9465");
    // Beside --config the flags are refused: the file sets them.
    exits_with(&["attach", "--config", &file, "--prometheus-listen", "127.0.0.1:1"], 2, "cannot be used with");
}

/// A `tyche-init serve-nbd` over its in-process target; killed on drop if still running.
struct Served {
    child: Child,
    socket: PathBuf,
    state: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts serve-nbd with `--prometheus-listen metrics` (`None`: a Unix socket in its directory)
/// and waits until both sockets answer.
fn serve_nbd(metrics: Option<&str>) -> (Served, MetricsAddr) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let state = dir.path().join("state");
    let metrics =
        metrics.map_or_else(|| format!("unix:{}", dir.path().join("run/metrics.sock").display()), str::to_owned);
    let child = bin()
        .args(["serve-nbd", "--loopback-mib", "8", "--export", "ram", "--socket"])
        .arg(&socket)
        .args(["--prometheus-listen", &metrics])
        .env("TYCHE_INIT_STATE_DIR", &state)
        .env("TYCHE_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn serve-nbd");
    let mut served = Served { child, socket, state, _dir: dir };
    let addr: MetricsAddr = metrics.parse().expect("address");
    let t0 = Instant::now();
    loop {
        let up = served.socket.exists() && get(&addr, "/metrics", LIMIT).is_ok();
        if up {
            break;
        }
        if let Some(st) = served.child.try_wait().expect("wait") {
            panic!("serve-nbd exited before its sockets answered ({st}); its log is above");
        }
        assert!(t0.elapsed() < LIMIT, "serve-nbd's sockets never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
    (served, addr)
}

/// A scrape, checked: 200, the Prometheus text's media type.
fn scrape(addr: &MetricsAddr) -> String {
    let r: Response = get(addr, "/metrics", LIMIT).expect("scrape");
    assert_eq!(r.status, "HTTP/1.0 200 OK", "{r:?}");
    assert_eq!(r.header("content-type"), Some("text/plain; version=0.0.4; charset=utf-8"), "{r:?}");
    r.body
}

/// The value of the sample `name{labels...}` whose labels include every `want`.
fn value(text: &str, name: &str, want: &[&str]) -> u64 {
    let found: Vec<u64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && want.iter().all(|w| l.contains(w)))
        .map(|l| l.rsplit_once(' ').expect("NAME VALUE").1.parse().expect("an integer"))
        .collect();
    assert_eq!(found.len(), 1, "one {name} with {want:?} in\n{text}");
    found[0]
}

/// The sum of every `name` sample.
fn sum(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .map(|l| l.rsplit_once(' ').expect("NAME VALUE").1.parse::<u64>().expect("an integer"))
        .sum()
}

/// A plain NBD client: fixed newstyle, NBD_OPT_EXPORT_NAME, simple replies.
struct Nbd(UnixStream);

impl Nbd {
    fn connect(socket: &Path) -> Nbd {
        let mut s = UnixStream::connect(socket).expect("connect to the NBD socket");
        s.set_read_timeout(Some(LIMIT)).unwrap();
        let mut greet = [0u8; 18];
        s.read_exact(&mut greet).unwrap();
        assert_eq!(greet, codec::greeting());
        s.write_all(&(codec::FLAG_C_FIXED_NEWSTYLE | codec::FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
        let mut o = codec::IHAVEOPT.to_be_bytes().to_vec();
        o.extend(codec::opt::EXPORT_NAME.to_be_bytes());
        o.extend(3u32.to_be_bytes());
        o.extend(b"ram");
        s.write_all(&o).unwrap();
        let mut export = [0u8; 10];
        s.read_exact(&mut export).unwrap();
        assert_eq!(u64::from_be_bytes(export[..8].try_into().unwrap()), 8 * MIB as u64, "the export's size");
        Nbd(s)
    }

    /// Sends a request (with `data` for a write) and reads the simple reply and `read` bytes.
    fn request(&mut self, cmd: u16, offset: u64, len: usize, data: &[u8], read: usize) -> Vec<u8> {
        let mut b = codec::REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend(0u16.to_be_bytes());
        b.extend(cmd.to_be_bytes());
        b.extend(0x1234u64.to_be_bytes());
        b.extend(offset.to_be_bytes());
        b.extend((len as u32).to_be_bytes());
        b.extend(data);
        self.0.write_all(&b).unwrap();
        let mut reply = [0u8; 16];
        self.0.read_exact(&mut reply).unwrap();
        assert_eq!(u32::from_be_bytes(reply[..4].try_into().unwrap()), codec::SIMPLE_REPLY_MAGIC);
        assert_eq!(u32::from_be_bytes(reply[4..8].try_into().unwrap()), 0, "NBD error");
        let mut out = vec![0u8; read];
        self.0.read_exact(&mut out).unwrap();
        out
    }
}

#[test]
fn serve_nbd_serves_metrics_on_a_unix_socket_that_grow_with_io() {
    let (mut served, addr) = serve_nbd(None);
    let before = scrape(&addr);
    let socket = served.socket.display().to_string();
    let base = format!("attachment=\"{socket}\",export=\"ram\",target=\"loopback\"");
    assert!(before.contains(&format!("tyche_init_build_info{{version=\"{}\",", env!("CARGO_PKG_VERSION"))), "{before}");
    assert_eq!(
        value(&before, "tyche_init_attachment_info", &[&base, "kind=\"nbd\"", &format!("path=\"{socket}\"")]),
        1
    );
    assert_eq!(value(&before, "tyche_init_health", &[&base, "state=\"live\""]), 1);
    assert_eq!(value(&before, "tyche_init_health", &[&base, "state=\"no-path\""]), 0);
    assert_eq!(value(&before, "tyche_init_links", &[&base]), 2, "the in-process target's two links");
    assert_eq!(value(&before, "tyche_init_live_links", &[&base]), 2);
    assert_eq!(value(&before, "tyche_init_nbd_connections", &[&base]), 0);
    assert!(before.contains("# TYPE tyche_init_channel_tx_payload_bytes_total counter\n"), "{before}");

    // 1 MiB written and read back through NBD.
    let data: Vec<u8> = (0..MIB as u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let mut nbd = Nbd::connect(&served.socket);
    nbd.request(codec::cmd::WRITE, 0, MIB, &data, 0);
    assert!(nbd.request(codec::cmd::READ, 0, MIB, &[], MIB) == data, "read back differs");
    let after = scrape(&addr);
    assert_eq!(value(&after, "tyche_init_nbd_connections", &[&base]), 1, "{after}");
    let grew = |name: &str| sum(&after, name) - sum(&before, name);
    assert!(grew("tyche_init_channel_tx_payload_bytes_total") >= MIB as u64, "{after}");
    assert!(grew("tyche_init_channel_rx_payload_bytes_total") >= MIB as u64, "{after}");
    assert!(grew("tyche_init_channel_tx_frames_total") > 0 && grew("tyche_init_channel_rx_frames_total") > 0);
    assert!(value(&after, "tyche_init_written_bytes_total", &[&base]) >= MIB as u64, "{after}");
    assert!(value(&after, "tyche_init_read_bytes_total", &[&base]) >= MIB as u64, "{after}");
    assert!(value(&after, "tyche_init_requests_completed_total", &[&base]) >= 2, "{after}");
    assert_eq!(value(&after, "tyche_init_requests_failed_total", &[&base]), 0);
    assert_eq!(sum(&after, "tyche_init_channel_live"), 2, "{after}");
    // The scrape and `tyche-init stats` read the same report.
    let out = bin().args(["stats", "--json"]).arg(&served.socket).env("TYCHE_INIT_STATE_DIR", &served.state).output();
    let r: tyche_init::Report = serde_json::from_slice(&out.unwrap().stdout).expect("stats --json");
    assert_eq!(value(&after, "tyche_init_session_info", &[&format!("session=\"{:016x}\"", r.session)]), 1);
    assert_eq!(value(&after, "tyche_init_written_bytes_total", &[&base]), r.bytes_written);
    drop(nbd);

    for path in ["/", "/metrics/x", "/favicon.ico"] {
        assert_eq!(get(&addr, path, LIMIT).expect("answer").status, "HTTP/1.0 404 Not Found", "{path}");
    }
    let d = bin().arg("detach").arg(&served.socket).env("TYCHE_INIT_STATE_DIR", &served.state).output().unwrap();
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    let status = served.child.wait().unwrap();
    assert!(status.success(), "{status}");
    let MetricsAddr::Unix(path) = &addr else { unreachable!() };
    assert!(!path.exists(), "the metrics socket is removed on exit");
}

#[test]
fn serve_nbd_serves_metrics_on_loopback_tcp() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (served, addr) = serve_nbd(Some(&format!("127.0.0.1:{port}")));
    let text = scrape(&addr);
    assert_eq!(value(&text, "tyche_init_health", &["state=\"live\""]), 1, "{text}");
    assert_eq!(value(&text, "tyche_init_channels", &[]), 2, "{text}");
    let r = get(&addr, "/", LIMIT).expect("answer");
    assert_eq!(r.status, "HTTP/1.0 404 Not Found");
    drop(served);
}
