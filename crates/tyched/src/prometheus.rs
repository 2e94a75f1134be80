//! Serves the counters as Prometheus text (`GET /metrics`) over HTTP/1.1, on a local TCP address
//! or a Unix socket (`tyched serve --prometheus-listen ADDR`).
//!
//! A deliberately small responder: one thread, one request per connection (`Connection:
//! close`), requests of at most [`MAX_REQUEST`] bytes read within [`IO_TIMEOUT`], `GET` and
//! `HEAD` of `/metrics` (a query string is ignored), 404 for any other path, 405 for any other
//! method, 400 for anything that is not an HTTP/1.x request. The body is
//! [`Snapshot::prometheus`], the same text `tyched stats --prometheus` prints.
//!
//! The endpoint has no authentication and no TLS, and its labels name exports, sessions and
//! NICs, so by default it only listens on loopback addresses (or a Unix socket, which file
//! permissions protect); [`MetricsAddr::check_local`] refuses anything else unless the operator
//! sets `prometheus_allow_remote`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::Snapshot;

/// The media type of the Prometheus text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// Longest request (request line and headers) read; longer ones get 431.
pub const MAX_REQUEST: usize = 8 * 1024;
/// How long one connection may take to send its request and to read the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the endpoint listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsAddr {
    /// A TCP address (`127.0.0.1:9100`, `[::1]:9100`, `localhost:9100`).
    Tcp(SocketAddr),
    /// A Unix socket path (anything with a `/`, or `unix:PATH`).
    Unix(PathBuf),
}

impl std::fmt::Display for MetricsAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetricsAddr::Tcp(a) => write!(f, "{a}"),
            MetricsAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl std::str::FromStr for MetricsAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err("empty Unix socket path".into());
            }
            return Ok(MetricsAddr::Unix(PathBuf::from(p)));
        }
        if s.contains('/') {
            return Ok(MetricsAddr::Unix(PathBuf::from(s)));
        }
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(MetricsAddr::Tcp(a));
        }
        if let Some(port) = s.strip_prefix("localhost:") {
            let port: u16 = port.parse().map_err(|_| format!("not a port: {port:?}"))?;
            return Ok(MetricsAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], port))));
        }
        Err(format!("{s:?} is neither IP:PORT (e.g. 127.0.0.1:9464), localhost:PORT, nor a Unix socket path"))
    }
}

impl MetricsAddr {
    /// Refuses a TCP address other than loopback (the unspecified address `0.0.0.0` included)
    /// unless `allow_remote`.
    pub fn check_local(&self, allow_remote: bool) -> Result<(), String> {
        match self {
            MetricsAddr::Tcp(a) if !allow_remote && !a.ip().to_canonical().is_loopback() => Err(format!(
                "{a} is not a loopback address; the endpoint has no authentication, so serving it to other \
                 hosts needs prometheus_allow_remote = true (--prometheus-allow-remote)"
            )),
            _ => Ok(()),
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

/// A bound, not yet serving endpoint: bind early (so a bad address fails before anything else
/// starts), serve once the target is running.
pub struct PrometheusListener {
    listener: Listener,
}

impl std::fmt::Debug for PrometheusListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrometheusListener").field("addr", &self.local_addr().ok()).finish()
    }
}

impl PrometheusListener {
    /// Binds `addr`. A stale Unix socket at the path is replaced; any other file there is an
    /// error (it is never deleted).
    pub fn bind(addr: &MetricsAddr) -> std::io::Result<PrometheusListener> {
        let listener = match addr {
            MetricsAddr::Tcp(a) => Listener::Tcp(TcpListener::bind(a)?),
            MetricsAddr::Unix(p) => {
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)?;
                }
                match std::fs::symlink_metadata(p) {
                    Ok(m) if m.file_type().is_socket() => std::fs::remove_file(p)?,
                    Ok(_) => {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::AlreadyExists,
                            format!("{} exists and is not a socket", p.display()),
                        ))
                    }
                    Err(_) => {}
                }
                Listener::Unix(UnixListener::bind(p)?, p.clone())
            }
        };
        Ok(PrometheusListener { listener })
    }

    /// Where it listens (the actual port when bound to port 0).
    pub fn local_addr(&self) -> std::io::Result<MetricsAddr> {
        match &self.listener {
            Listener::Tcp(l) => Ok(MetricsAddr::Tcp(l.local_addr()?)),
            Listener::Unix(_, p) => Ok(MetricsAddr::Unix(p.clone())),
        }
    }

    /// Answers scrapes with `source()` on a thread of its own until the server is dropped.
    pub fn serve(self, source: impl Fn() -> Snapshot + Send + 'static) -> std::io::Result<PrometheusServer> {
        let addr = self.local_addr()?;
        let stop = Arc::new(crate::target::new_eventfd()?);
        let flag = Arc::clone(&stop);
        let listener = self.listener;
        let (fd, path) = match &listener {
            Listener::Tcp(l) => (l.as_raw_fd(), None),
            Listener::Unix(l, p) => (l.as_raw_fd(), Some(p.clone())),
        };
        let thread = std::thread::Builder::new().name("tyched-prom".into()).spawn(move || {
            loop {
                let mut fds = [
                    libc::pollfd { fd, events: libc::POLLIN, revents: 0 },
                    libc::pollfd { fd: flag.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                ];
                // SAFETY: `fds` is a live array of two pollfd structures.
                let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        tracing::warn!("prometheus endpoint: poll: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    continue;
                }
                if fds[1].revents != 0 {
                    return;
                }
                if fds[0].revents == 0 {
                    continue;
                }
                let r = match &listener {
                    Listener::Tcp(l) => l.accept().map(|(s, _)| {
                        let _ = s.set_nodelay(true);
                        Box::new(s) as Box<dyn Conn>
                    }),
                    Listener::Unix(l, _) => l.accept().map(|(s, _)| Box::new(s) as Box<dyn Conn>),
                };
                match r {
                    Ok(mut c) => {
                        if let Err(e) = answer(&mut *c, &source) {
                            tracing::debug!("prometheus endpoint: {e}");
                        }
                    }
                    Err(e) => {
                        tracing::warn!("prometheus endpoint: accept: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        })?;
        tracing::info!(%addr, "Prometheus metrics at /metrics");
        Ok(PrometheusServer { stop, thread: Some(thread), path, addr })
    }
}

/// A serving endpoint; stops (and removes its Unix socket) on drop.
#[derive(Debug)]
pub struct PrometheusServer {
    stop: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
    path: Option<PathBuf>,
    addr: MetricsAddr,
}

impl PrometheusServer {
    /// Where it listens.
    pub fn addr(&self) -> &MetricsAddr {
        &self.addr
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        crate::target::wake_fd(&self.stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

trait Conn: Read + Write {
    fn set_timeouts(&self, t: Duration) -> std::io::Result<()>;
    fn shutdown_write(&self) -> std::io::Result<()>;
}

impl Conn for std::net::TcpStream {
    fn set_timeouts(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
    fn shutdown_write(&self) -> std::io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

impl Conn for std::os::unix::net::UnixStream {
    fn set_timeouts(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
    fn shutdown_write(&self) -> std::io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

/// Reads one request and writes one response.
fn answer(c: &mut dyn Conn, source: &dyn Fn() -> Snapshot) -> std::io::Result<()> {
    c.set_timeouts(IO_TIMEOUT)?;
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(i);
        }
        if buf.len() > MAX_REQUEST {
            break None;
        }
        if Instant::now() > deadline {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "request not received in time"));
        }
        let n = c.read(&mut chunk)?;
        if n == 0 {
            if buf.is_empty() {
                return Ok(()); // connected and closed: nothing to answer
            }
            break Some(buf.len());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let (status, body, head_only) = match head_end {
        None => (Status::TooLarge, None, false),
        Some(end) => route(&buf[..end], source),
    };
    let body = body.unwrap_or_else(|| format!("{}\n", status.reason()));
    let content_type = if status == Status::Ok { CONTENT_TYPE } else { "text/plain; charset=utf-8" };
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        status.code(),
        status.reason(),
        body.len()
    );
    if status == Status::MethodNotAllowed {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    out.push_str("\r\n");
    if !head_only {
        out.push_str(&body);
    }
    c.write_all(out.as_bytes())?;
    c.flush()?;
    if head_end.is_none() {
        // Closing with unread input would reset the connection and could discard the answer
        // before the client reads it: end our side and drain theirs (bounded) first.
        c.shutdown_write()?;
        let mut left = 16 * MAX_REQUEST;
        while left > 0 && Instant::now() < deadline + IO_TIMEOUT {
            match c.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Ok,
    BadRequest,
    NotFound,
    MethodNotAllowed,
    TooLarge,
}

impl Status {
    fn code(self) -> u16 {
        match self {
            Status::Ok => 200,
            Status::BadRequest => 400,
            Status::NotFound => 404,
            Status::MethodNotAllowed => 405,
            Status::TooLarge => 431,
        }
    }
    fn reason(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::BadRequest => "Bad Request",
            Status::NotFound => "Not Found",
            Status::MethodNotAllowed => "Method Not Allowed",
            Status::TooLarge => "Request Header Fields Too Large",
        }
    }
}

/// The status, the body (none: the reason phrase) and whether to send headers only.
fn route(head: &[u8], source: &dyn Fn() -> Snapshot) -> (Status, Option<String>, bool) {
    let Ok(head) = std::str::from_utf8(head) else { return (Status::BadRequest, None, false) };
    let line = head.split("\r\n").next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return (Status::BadRequest, None, false);
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return (Status::BadRequest, None, false);
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return (Status::MethodNotAllowed, None, false),
    };
    let path = target.split(['?', '#']).next().unwrap_or(target);
    if path != "/metrics" {
        return (Status::NotFound, None, head_only);
    }
    (Status::Ok, Some(source().prometheus()), head_only)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{ExportStats, OpCounts};

    fn snapshot() -> Snapshot {
        Snapshot {
            uptime_ms: 1234,
            sessions: 2,
            exports: vec![ExportStats {
                name: "disk".into(),
                requests: OpCounts { write: 7, ..OpCounts::default() },
                ..ExportStats::default()
            }],
            ..Snapshot::default()
        }
    }

    /// Sends `request` and returns (status line, headers, body).
    fn exchange(mut s: impl Read + Write, request: &[u8]) -> (String, Vec<(String, String)>, String) {
        s.write_all(request).expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read the response");
        let (head, body) = out.split_once("\r\n\r\n").expect("a header block");
        let mut lines = head.split("\r\n");
        let status = lines.next().expect("status line").to_owned();
        let headers = lines
            .map(|l| {
                let (k, v) = l.split_once(": ").expect("header");
                (k.to_ascii_lowercase(), v.to_owned())
            })
            .collect();
        (status, headers, body.to_owned())
    }

    fn header<'a>(h: &'a [(String, String)], name: &str) -> &'a str {
        h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()).unwrap_or_else(|| panic!("no {name} header"))
    }

    #[test]
    fn addresses_parse_and_non_loopback_is_refused() {
        let a: MetricsAddr = "127.0.0.1:9464".parse().expect("v4");
        assert_eq!(a, MetricsAddr::Tcp("127.0.0.1:9464".parse().unwrap()));
        assert!(a.check_local(false).is_ok());
        assert!("[::1]:9464".parse::<MetricsAddr>().expect("v6").check_local(false).is_ok());
        assert_eq!("localhost:9464".parse::<MetricsAddr>().expect("localhost"), a);
        assert_eq!(
            "/run/tyched/metrics.sock".parse::<MetricsAddr>().expect("path"),
            MetricsAddr::Unix("/run/tyched/metrics.sock".into())
        );
        assert_eq!("unix:m.sock".parse::<MetricsAddr>().expect("unix:"), MetricsAddr::Unix("m.sock".into()));
        for bad in ["", "9464", "host:9464", "localhost:x", "unix:"] {
            assert!(bad.parse::<MetricsAddr>().is_err(), "{bad:?} is refused");
        }
        for remote in ["0.0.0.0:9464", "192.0.2.1:9464", "[::]:9464", "[::ffff:192.0.2.1]:9464"] {
            let a: MetricsAddr = remote.parse().expect("parses");
            let e = a.check_local(false).expect_err("not loopback");
            assert!(e.contains("prometheus_allow_remote"), "{e}");
            assert!(a.check_local(true).is_ok(), "allowed explicitly");
        }
        assert!("[::ffff:127.0.0.1]:9464".parse::<MetricsAddr>().unwrap().check_local(false).is_ok());
    }

    #[test]
    fn scrapes_over_tcp() {
        let l = PrometheusListener::bind(&"127.0.0.1:0".parse().unwrap()).expect("bind");
        let MetricsAddr::Tcp(addr) = l.local_addr().expect("addr") else { panic!("TCP") };
        let server = l.serve(snapshot).expect("serve");
        let connect = || std::net::TcpStream::connect(addr).expect("connect");

        let (status, h, body) = exchange(connect(), b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert!(header(&h, "content-type").starts_with("text/plain; version=0.0.4"));
        assert_eq!(header(&h, "content-length"), body.len().to_string());
        assert_eq!(body, snapshot().prometheus(), "the same text as `tyched stats --prometheus`");
        assert!(body.contains("tyched_export_requests_total{export=\"disk\",op=\"write\"} 7\n"), "{body}");
        assert!(body.contains("# TYPE tyched_sessions gauge\ntyched_sessions 2\n"), "{body}");

        let (status, _, body) = exchange(connect(), b"GET /metrics?name[]=x HTTP/1.0\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 200 OK", "a query string is ignored");
        assert!(body.contains("tyched_uptime_milliseconds 1234"));

        let (status, h, body) = exchange(connect(), b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert!(body.is_empty(), "HEAD has no body");
        assert_eq!(header(&h, "content-length"), snapshot().prometheus().len().to_string());

        for path in ["/", "/metric", "/metrics/x", "/favicon.ico"] {
            let (status, _, _) = exchange(connect(), format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes());
            assert_eq!(status, "HTTP/1.1 404 Not Found", "{path}");
        }
        let (status, h, _) = exchange(connect(), b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");
        assert_eq!(header(&h, "allow"), "GET, HEAD");
        for garbage in
            [&b"hello\r\n\r\n"[..], b"GET /metrics\r\n\r\n", b"GET /metrics SPDY/3\r\n\r\n", b"\xff\xfe\r\n\r\n"]
        {
            let (status, _, _) = exchange(connect(), garbage);
            assert_eq!(status, "HTTP/1.1 400 Bad Request", "{garbage:?}");
        }
        let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        huge.extend(std::iter::repeat_n(b'a', 2 * MAX_REQUEST));
        let (status, _, _) = exchange(connect(), &huge);
        assert_eq!(status, "HTTP/1.1 431 Request Header Fields Too Large");

        // A client that connects and says nothing does not block the next one for long.
        let idle = connect();
        let t = Instant::now();
        let (status, _, _) = exchange(connect(), b"GET /metrics HTTP/1.1\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert!(t.elapsed() < IO_TIMEOUT + Duration::from_secs(2), "{:?}", t.elapsed());
        drop(idle);
        drop(server);
        assert!(std::net::TcpStream::connect(addr).is_err(), "dropping the server closes the port");
    }

    #[test]
    fn scrapes_over_a_unix_socket_and_removes_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("run/metrics.sock");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        // A stale socket from an earlier run is replaced.
        drop(UnixListener::bind(&path).expect("stale socket"));
        let server = PrometheusListener::bind(&MetricsAddr::Unix(path.clone())).expect("bind").serve(snapshot);
        let server = server.expect("serve");
        let s = std::os::unix::net::UnixStream::connect(&path).expect("connect");
        let (status, h, body) = exchange(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert!(header(&h, "content-type").starts_with("text/plain; version=0.0.4"));
        assert_eq!(body, snapshot().prometheus());
        drop(server);
        assert!(!path.exists(), "the socket is removed on drop");

        // Another kind of file is never replaced.
        let file = dir.path().join("not-a-socket");
        std::fs::write(&file, b"keep me").unwrap();
        let e = PrometheusListener::bind(&MetricsAddr::Unix(file.clone())).expect_err("not a socket");
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    }
}
