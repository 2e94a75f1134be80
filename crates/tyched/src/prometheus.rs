//! Serves the counters as Prometheus text (`GET /metrics`) over HTTP/1.1, on a local TCP address
//! or a Unix socket (`tyched serve --prometheus-listen ADDR`).
//!
//! The text is encoded by `prometheus-client` (the Prometheus project's Rust client) in the
//! Prometheus text format 0.0.4, from a custom collector over one [`Snapshot`] taken at scrape
//! time ([`encode`]; `tyched stats --prometheus` prints the same). HTTP is `hyper`'s HTTP/1
//! server on a single-threaded tokio runtime on one thread of its own: one request per
//! connection (no keep-alive), request heads of at most [`MAX_REQUEST`] bytes (hyper answers
//! 431 beyond), each connection done within [`IO_TIMEOUT`] or closed, at most
//! [`MAX_CONNECTIONS`] answered at once (more wait in the kernel's listen backlog). `GET` and
//! `HEAD` of `/metrics` (a query string is ignored); 404 for any other path, 405 for any other
//! method, and hyper's 400 for anything that is not an HTTP/1.x request.
//!
//! The endpoint has no authentication and no TLS, and its labels name exports, sessions and
//! NICs, so by default it only listens on loopback addresses (or a Unix socket, which file
//! permissions protect); [`MetricsAddr::check_local`] refuses anything else unless the operator
//! sets `prometheus_allow_remote`.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use tyche_transport::poll::PollStats;

use crate::stats::{ChannelSnapshot, ExportStats, NicStats};
use crate::Snapshot;

/// The media type of the Prometheus text exposition format (0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
/// Largest request head (request line and headers) read; hyper answers 431 to larger ones. Also
/// the least hyper allows (its `max_buf_size`).
pub const MAX_REQUEST: usize = 8 * 1024;
/// How long one connection may take, from accept to the last byte of the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections answered at once; further ones wait in the listen backlog until one is done.
pub const MAX_CONNECTIONS: usize = 8;

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
    pub fn serve(self, source: impl Fn() -> Snapshot + Send + Sync + 'static) -> std::io::Result<PrometheusServer> {
        let addr = self.local_addr()?;
        let path = match &self.listener {
            Listener::Tcp(l) => {
                l.set_nonblocking(true)?;
                None
            }
            Listener::Unix(l, p) => {
                l.set_nonblocking(true)?;
                Some(p.clone())
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let listener = self.listener;
        let source: Source = Arc::new(source);
        // The listener becomes tokio's inside the runtime (registration needs its reactor); a
        // failure there is reported through this channel before `serve` returns.
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<std::io::Result<()>>(1);
        let thread = std::thread::Builder::new().name("tyched-prom".into()).spawn(move || {
            runtime.block_on(async move {
                let accept = match Accept::new(listener) {
                    Ok(a) => {
                        let _ = ready_tx.send(Ok(()));
                        a
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                accept_loop(accept, source, stopped).await;
            });
            // Dropping the runtime here cancels the connections still being answered.
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(std::io::Error::other("the endpoint's thread ended before serving"));
            }
        }
        tracing::info!(%addr, "Prometheus metrics at /metrics");
        Ok(PrometheusServer { stop: Some(stop), thread: Some(thread), path, addr })
    }
}

/// A serving endpoint; stops (and removes its Unix socket) on drop.
#[derive(Debug)]
pub struct PrometheusServer {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
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
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

type Source = Arc<dyn Fn() -> Snapshot + Send + Sync>;

/// The listener on the endpoint's runtime.
enum Accept {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

impl Accept {
    fn new(l: Listener) -> std::io::Result<Accept> {
        Ok(match l {
            Listener::Tcp(l) => Accept::Tcp(tokio::net::TcpListener::from_std(l)?),
            Listener::Unix(l, _) => Accept::Unix(tokio::net::UnixListener::from_std(l)?),
        })
    }
}

/// Accepts connections while fewer than [`MAX_CONNECTIONS`] are being answered (the rest wait
/// in the kernel's backlog) and answers each on this one thread, until `stopped`.
async fn accept_loop(accept: Accept, source: Source, mut stopped: tokio::sync::oneshot::Receiver<()>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = tokio::select! {
            _ = &mut stopped => return,
            s = Arc::clone(&slots).acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => return, // never closed
            },
        };
        let accepted = tokio::select! {
            _ = &mut stopped => return,
            a = async {
                match &accept {
                    Accept::Tcp(l) => l.accept().await.map(|(s, _)| {
                        let _ = s.set_nodelay(true);
                        Conn::Tcp(s)
                    }),
                    Accept::Unix(l) => l.accept().await.map(|(s, _)| Conn::Unix(s)),
                }
            } => a,
        };
        match accepted {
            Ok(conn) => {
                let source = Arc::clone(&source);
                tokio::spawn(async move {
                    let r = match conn {
                        Conn::Tcp(s) => answer(s, source).await,
                        Conn::Unix(s) => answer(s, source).await,
                    };
                    if let Err(e) = r {
                        tracing::debug!("prometheus endpoint: {e}");
                    }
                    drop(slot);
                });
            }
            Err(e) => {
                tracing::warn!("prometheus endpoint: accept: {e}");
                drop(slot);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

enum Conn {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

/// Serves one connection (one request: no keep-alive) with hyper, all within [`IO_TIMEOUT`].
async fn answer<S>(stream: S, source: Source) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let response = route(req.method(), req.uri().path(), &*source);
        async move { Ok::<_, std::convert::Infallible>(response) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .title_case_headers(true)
        .max_buf_size(MAX_REQUEST)
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(IO_TIMEOUT)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    match tokio::time::timeout(IO_TIMEOUT, conn).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("connection not done within {IO_TIMEOUT:?}, closed")),
    }
}

type Body = http_body_util::Full<hyper::body::Bytes>;

/// The answer to one request: `GET` (or `HEAD`, whose body hyper leaves out) of `/metrics` is
/// the exposition, any other path 404, any other method 405.
fn route(method: &hyper::Method, path: &str, source: &dyn Fn() -> Snapshot) -> hyper::Response<Body> {
    use hyper::{header, Method, StatusCode};
    let plain = |status: StatusCode| {
        let mut r = hyper::Response::new(Body::from(format!("{}\n", status.canonical_reason().unwrap_or(""))));
        *r.status_mut() = status;
        r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; charset=utf-8"));
        r
    };
    if method != Method::GET && method != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED);
        r.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if path != "/metrics" {
        return plain(StatusCode::NOT_FOUND);
    }
    let mut r = hyper::Response::new(Body::from(encode(&source())));
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static(CONTENT_TYPE));
    r
}

/// `snapshot` in the Prometheus text exposition format (0.0.4), by prometheus-client: the
/// text `tyched stats --prometheus` prints and `GET /metrics` answers.
pub fn encode(snapshot: &Snapshot) -> String {
    let mut registry = prometheus_client::registry::Registry::with_prefix("tyched");
    registry.register_collector(Box::new(SnapshotCollector(snapshot.clone())));
    let mut text = String::new();
    // Writing into a String fails only if a collector fails, and this one only passes on the
    // encoder's own results.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry) {
        tracing::warn!("prometheus encoding: {e}");
    }
    text
}

/// One snapshot as metric families, encoded when the registry is (at scrape time). Counter
/// names are given without `_total`: prometheus-client appends it.
#[derive(Debug)]
struct SnapshotCollector(Snapshot);

type Labels = Vec<(&'static str, String)>;

/// Writes one family: its `# HELP` and `# TYPE` lines and a sample per row.
fn family(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: Vec<(Labels, u64)>,
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in rows {
        let e = m.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(e)?,
            _ => ConstGauge::new(v).encode(e)?,
        }
    }
    Ok(())
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        use MetricType::{Counter, Gauge};
        let s = &self.0;
        let enc = &mut enc;
        let one = |v: u64| vec![(Labels::new(), v)];
        // Milliseconds since start: a gauge, so that the name keeps no `_total`.
        family(enc, "uptime_milliseconds", "Time since start.", Gauge, one(s.uptime_ms))?;
        family(enc, "sessions", "Live sessions.", Gauge, one(s.sessions))?;
        family(enc, "sessions_reclaimed", "Sessions reclaimed.", Counter, one(s.sessions_reclaimed))?;
        family(
            enc,
            "payload_copied_bytes",
            "Payload bytes copied in user space.",
            Counter,
            one(s.payload_copied_bytes),
        )?;
        family(enc, "storage_inflight", "Storage requests queued or running.", Gauge, one(s.storage_inflight))?;
        let nic = |f: &dyn Fn(&NicStats) -> u64| {
            s.nics.iter().map(|n| (vec![("nic", n.name.clone())], f(n))).collect::<Vec<_>>()
        };
        family(enc, "nic_rx_frames", "Frames received.", Counter, nic(&|n| n.frames_rx))?;
        family(enc, "nic_rx_bytes", "Bytes received.", Counter, nic(&|n| n.bytes_rx))?;
        family(enc, "nic_tx_frames", "Frames sent.", Counter, nic(&|n| n.frames_tx))?;
        family(enc, "nic_tx_bytes", "Bytes sent.", Counter, nic(&|n| n.bytes_tx))?;
        let mut drops = Vec::new();
        for n in &s.nics {
            let d = &n.drops;
            for (reason, v) in [
                ("malformed", d.malformed),
                ("unknown_session", d.unknown_session),
                ("not_ours", d.not_ours),
                ("slot_busy", d.slot_busy),
                ("denied_mac", d.denied_mac),
                ("denied_key", d.denied_key),
                ("shutting_down", d.shutting_down),
            ] {
                drops.push((vec![("nic", n.name.clone()), ("reason", reason.to_owned())], v));
            }
            for (reason, v) in &d.channel {
                drops.push((vec![("nic", n.name.clone()), ("reason", format!("channel_{reason}"))], *v));
            }
        }
        family(enc, "nic_drops", "Frames dropped, by reason.", Counter, drops)?;
        let mut reqs = Vec::new();
        for e in &s.exports {
            let r = &e.requests;
            for (op, v) in [
                ("read", r.read),
                ("write", r.write),
                ("flush", r.flush),
                ("discard", r.discard),
                ("write_zeroes", r.write_zeroes),
                ("block_status", r.block_status),
            ] {
                reqs.push((vec![("export", e.name.clone()), ("op", op.to_owned())], v));
            }
        }
        family(enc, "export_requests", "Requests executed, by op.", Counter, reqs)?;
        let ex = |f: &dyn Fn(&ExportStats) -> u64| {
            s.exports.iter().map(|e| (vec![("export", e.name.clone())], f(e))).collect::<Vec<_>>()
        };
        family(enc, "export_read_bytes", "Bytes read from storage.", Counter, ex(&|e| e.bytes_read))?;
        family(enc, "export_written_bytes", "Bytes written to storage.", Counter, ex(&|e| e.bytes_written))?;
        family(enc, "export_errors", "Requests completed with an error.", Counter, ex(&|e| e.errors))?;
        family(enc, "export_denied", "CONNECTs refused.", Counter, ex(&|e| e.denied))?;
        let th = |f: &dyn Fn(&PollStats) -> u64| {
            s.poll.threads.iter().enumerate().map(|(k, t)| (vec![("thread", k.to_string())], f(t))).collect::<Vec<_>>()
        };
        family(enc, "poll_nanoseconds", "Time network threads spent polling.", Counter, th(&|t| t.poll_ns))?;
        family(enc, "poll_hits", "Polls that found work (wake-ups saved).", Counter, th(&|t| t.poll_hits))?;
        family(enc, "poll_misses", "Polls that ran out of budget and slept.", Counter, th(&|t| t.poll_misses))?;
        family(enc, "poll_sleeps", "Sleeps of network threads.", Counter, th(&|t| t.sleeps))?;
        family(enc, "poll_wakeups", "Sleeps that ended in work.", Counter, th(&|t| t.wakeups))?;
        family(enc, "poll_budget_nanoseconds", "The adaptive poll budget now.", Gauge, th(&|t| t.budget_ns))?;
        family(
            enc,
            "poll_contended",
            "Times polling was given up because the thread waited for a CPU.",
            Counter,
            th(&|t| t.contended),
        )?;
        let irq = |f: &dyn Fn(&tyche_numa::IrqReport) -> u64| {
            s.irqs.iter().map(|r| (vec![("nic", r.nic.clone())], f(r))).collect::<Vec<_>>()
        };
        family(enc, "nic_irqs", "IRQs of the interface (0: virtual NIC).", Gauge, irq(&|r| r.irqs.len() as u64))?;
        family(
            enc,
            "nic_irqs_on_network_core",
            "IRQs of the interface delivered on the core of its network thread.",
            Gauge,
            irq(&|r| r.sharing_network_core),
        )?;
        let storage = s
            .storage_threads
            .iter()
            .map(|t| {
                let node = t.node.map_or_else(|| "none".to_owned(), |n| n.to_string());
                (vec![("thread", t.name.clone()), ("node", node)], t.jobs)
            })
            .collect();
        family(
            enc,
            "storage_jobs",
            "Storage jobs executed by a worker or io_uring thread, with its queue's node.",
            Counter,
            storage,
        )?;
        let ch = |f: &dyn Fn(&ChannelSnapshot) -> u64| {
            s.channels
                .iter()
                .map(|c| {
                    let labels = vec![
                        ("session", format!("{:016x}", c.session)),
                        ("channel", c.channel.to_string()),
                        ("nic", c.nic.clone()),
                    ];
                    (labels, f(c))
                })
                .collect::<Vec<_>>()
        };
        family(enc, "channel_retransmits", "Retransmissions.", Counter, ch(&|c| c.retransmits))?;
        family(enc, "channel_executing", "Requests executing.", Gauge, ch(&|c| c.executing))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Instant;

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
        assert_eq!(status, "HTTP/1.0 200 OK", "a query string is ignored (and 1.0 is answered in 1.0)");
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

    /// A snapshot with a row in every family, two NICs, two exports and label values that need
    /// escaping.
    fn sample() -> Snapshot {
        use crate::stats::{ChannelSnapshot, Drops, PollReport};
        let mut channel = std::collections::BTreeMap::new();
        channel.insert("duplicate".to_string(), 4u64);
        channel.insert("out_of_window".to_string(), 1u64);
        Snapshot {
            uptime_ms: 1234,
            sessions: 2,
            sessions_reclaimed: 3,
            payload_copied_bytes: 4096,
            storage_inflight: 5,
            nics: vec![
                NicStats {
                    name: "eth0".into(),
                    frames_rx: 10,
                    bytes_rx: 11,
                    frames_tx: 12,
                    bytes_tx: 13,
                    drops: Drops {
                        malformed: 1,
                        unknown_session: 2,
                        not_ours: 3,
                        slot_busy: 4,
                        denied_mac: 5,
                        denied_key: 6,
                        shutting_down: 7,
                        channel,
                    },
                    ..Default::default()
                },
                NicStats { name: "we\"ird\\".into(), ..Default::default() },
            ],
            exports: vec![
                ExportStats {
                    name: "disk".into(),
                    requests: OpCounts { read: 1, write: 7, flush: 2, discard: 3, write_zeroes: 4, block_status: 5 },
                    bytes_read: 100,
                    bytes_written: 200,
                    errors: 1,
                    denied: 2,
                    ..Default::default()
                },
                ExportStats { name: "a\nb".into(), ..Default::default() },
            ],
            channels: vec![ChannelSnapshot {
                session: 0xabc,
                channel: 1,
                nic: "eth0".into(),
                retransmits: 9,
                executing: 3,
                ..Default::default()
            }],
            storage_threads: vec![
                crate::stats::StorageThreadStats {
                    name: "tyched-io0".into(),
                    kind: "worker".into(),
                    node: Some(1),
                    jobs: 11,
                    ..Default::default()
                },
                crate::stats::StorageThreadStats {
                    name: "tyched-uring0".into(),
                    kind: "io_uring".into(),
                    ..Default::default()
                },
            ],
            irqs: vec![
                tyche_numa::IrqReport {
                    nic: "eth0".into(),
                    irqs: vec![tyche_numa::irq::IrqAffinity { irq: 38, affinity: vec![0, 1], effective: vec![1] }],
                    network_cpus: vec![1],
                    sharing_network_core: 1,
                    ..Default::default()
                },
                tyche_numa::IrqReport { nic: "veth0".into(), virtual_nic: true, ..Default::default() },
            ],
            poll: PollReport {
                threads: vec![
                    PollStats {
                        poll_ns: 1,
                        poll_hits: 2,
                        poll_misses: 3,
                        sleeps: 4,
                        wakeups: 5,
                        budget_ns: 6,
                        contended: 7,
                    },
                    PollStats::default(),
                ],
                ..Default::default()
            },
            ..Snapshot::default()
        }
    }

    #[test]
    fn the_text_is_the_hand_written_encoders_but_for_uptimes_type() {
        // Written by the encoder this crate had before prometheus-client, with one change:
        // `tyched_uptime_milliseconds` was typed `counter` (prometheus-client names every
        // counter `*_total`, so it is a gauge now to keep its name), and families added since:
        // `tyched_poll_contended_total`, `tyched_nic_irqs*`, `tyched_storage_jobs_total`.
        let expected = include_str!("../testdata/metrics-sample.prom");
        let text = sample().prometheus();
        assert_eq!(text, expected);
        assert!(text.contains("tyched_nic_rx_frames_total{nic=\"we\\\"ird\\\\\"} 0\n"), "{text}");
        assert!(text.contains("tyched_export_errors_total{export=\"a\\nb\"} 0\n"), "{text}");
        assert!(!text.contains("# EOF"), "the 0.0.4 text format has no EOF marker");
        assert_eq!(Snapshot::default().prometheus().lines().filter(|l| l.starts_with("# TYPE")).count(), 27);
    }

    /// One row of the metric table in docs/tyched.md: name, type, label names.
    fn documented() -> Vec<(String, String, Vec<String>)> {
        let doc = include_str!("../../../docs/tyched.md");
        doc.lines()
            .filter_map(|l| l.trim().strip_prefix("| `tyched_"))
            .map(|row| {
                let cells: Vec<&str> = row.split('|').map(str::trim).collect();
                let name = format!("tyched_{}", cells[0].trim_end_matches('`'));
                let labels =
                    cells[2].split(',').map(|c| c.trim().trim_matches('`').to_owned()).filter(|c| !c.is_empty());
                (name, cells[1].to_owned(), labels.collect())
            })
            .collect()
    }

    #[test]
    fn every_scraped_family_is_documented_with_its_type_and_labels() {
        let l = PrometheusListener::bind(&"127.0.0.1:0".parse().unwrap()).expect("bind");
        let MetricsAddr::Tcp(addr) = l.local_addr().expect("addr") else { panic!("TCP") };
        let _server = l.serve(sample).expect("serve");
        let s = std::net::TcpStream::connect(addr).expect("connect");
        let (status, _, body) = exchange(s, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n");
        assert_eq!(status, "HTTP/1.1 200 OK");
        let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).expect("parses");
        let mut families: Vec<(String, String, Vec<String>)> = Vec::new();
        for line in body.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let (name, kind) = line.split_once(' ').expect("TYPE name kind");
            let sample = scrape.samples.iter().find(|s| s.metric == name).unwrap_or_else(|| panic!("a {name} sample"));
            let mut labels: Vec<String> = body
                .lines()
                .find(|l| l.starts_with(&format!("{name}{{")))
                .map(|l| {
                    l[name.len() + 1..]
                        .split(',')
                        .filter_map(|kv| kv.split_once('='))
                        .map(|(k, _)| k.to_owned())
                        .collect()
                })
                .unwrap_or_default();
            labels.retain(|k| sample.labels.get(k).is_some());
            match (kind, &sample.value) {
                ("counter", prometheus_parse::Value::Counter(_)) | ("gauge", prometheus_parse::Value::Gauge(_)) => {}
                other => panic!("{name}: TYPE and parsed value disagree: {other:?}"),
            }
            families.push((name.to_owned(), kind.to_owned(), labels));
        }
        assert_eq!(families, documented(), "docs/tyched.md's metric table and a scrape");
        // Values come through the parser as encoded.
        let value = |name: &str, key: &str, want: &str| {
            scrape
                .samples
                .iter()
                .find(|s| s.metric == name && s.labels.get(key) == Some(want))
                .map(|s| s.value.clone())
                .unwrap_or_else(|| panic!("{name}{{{key}={want}}}"))
        };
        assert_eq!(value("tyched_export_requests_total", "op", "write"), prometheus_parse::Value::Counter(7.0));
        assert_eq!(
            value("tyched_nic_drops_total", "reason", "channel_duplicate"),
            prometheus_parse::Value::Counter(4.0)
        );
        assert_eq!(
            value("tyched_channel_executing", "session", "0000000000000abc"),
            prometheus_parse::Value::Gauge(3.0)
        );
    }

    #[test]
    fn silent_and_trickling_clients_are_bounded() {
        let l = PrometheusListener::bind(&"127.0.0.1:0".parse().unwrap()).expect("bind");
        let MetricsAddr::Tcp(addr) = l.local_addr().expect("addr") else { panic!("TCP") };
        let _server = l.serve(snapshot).expect("serve");
        let connect = || std::net::TcpStream::connect(addr).expect("connect");
        let scrape = || exchange(connect(), b"GET /metrics HTTP/1.1\r\n\r\n").0;

        // Fewer silent clients than the limit delay nobody.
        let idle: Vec<_> = (0..MAX_CONNECTIONS - 1).map(|_| connect()).collect();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        assert_eq!(scrape(), "HTTP/1.1 200 OK");
        assert!(t.elapsed() < IO_TIMEOUT / 2, "answered beside {} silent clients: {:?}", idle.len(), t.elapsed());
        // One more fills the limit: the next scrape waits in the backlog until the silent ones
        // time out, then is answered.
        let full = connect();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        assert_eq!(scrape(), "HTTP/1.1 200 OK");
        assert!(t.elapsed() < IO_TIMEOUT + Duration::from_secs(1), "{:?}", t.elapsed());
        // The silent ones were closed at their deadline.
        for mut c in idle.into_iter().chain([full]) {
            c.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let mut buf = Vec::new();
            let n = c.read_to_end(&mut buf).unwrap_or(0);
            assert!(n == 0 || String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 408"), "{buf:?}");
        }

        // A client that trickles its request a byte at a time is cut off by the deadline.
        let mut slow = connect();
        slow.set_read_timeout(Some(IO_TIMEOUT * 3)).unwrap();
        let t = Instant::now();
        for b in b"GET /metrics HTTP/1.1\r\nX-Slow: ".iter().chain(std::iter::repeat(&b'a')) {
            if slow.write_all(&[*b]).is_err() || t.elapsed() > IO_TIMEOUT * 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest);
        assert!(t.elapsed() < IO_TIMEOUT * 2, "cut off near {IO_TIMEOUT:?}: {:?}", t.elapsed());
        assert!(!String::from_utf8_lossy(&rest).contains(" 200 "), "no answer to an unfinished request");
        assert_eq!(scrape(), "HTTP/1.1 200 OK", "still serving");
    }
}
