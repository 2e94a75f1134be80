//! `GET /metrics` over HTTP/1.1, on a local TCP address or a Unix socket.
//!
//! HTTP is `hyper`'s HTTP/1 server on a single-threaded tokio runtime on one thread of its own:
//! one request per connection (no keep-alive), request heads of at most [`MAX_REQUEST`] bytes
//! (hyper answers 431 beyond), each connection done within [`IO_TIMEOUT`] or closed, at most
//! [`MAX_CONNECTIONS`] answered at once (more wait in the kernel's listen backlog). `GET` and
//! `HEAD` of `/metrics` (a query string is ignored); 404 for any other path, 405 for any other
//! method, and hyper's 400 for anything that is not an HTTP/1.x request. The text is what the
//! daemon's closure encodes, called once per scrape on the runtime's one blocking thread (so it
//! may wait, e.g. for the daemon's engine to answer, and scrapes are encoded one at a time).

use std::net::TcpListener;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::MetricsAddr;

/// The media type of the Prometheus text exposition format (0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
/// Largest request head (request line and headers) read; hyper answers 431 to larger ones. Also
/// the least hyper allows (its `max_buf_size`).
pub const MAX_REQUEST: usize = 8 * 1024;
/// How long one connection may take, from accept to the last byte of the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections answered at once; further ones wait in the listen backlog until one is done.
pub const MAX_CONNECTIONS: usize = 8;

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

/// A bound, not yet serving endpoint: bind early (so a bad or taken address fails before
/// anything else starts), serve once there is something to report.
pub struct MetricsListener {
    listener: Listener,
}

impl std::fmt::Debug for MetricsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsListener").field("addr", &self.local_addr().ok()).finish()
    }
}

impl MetricsListener {
    /// Binds `addr`. A stale Unix socket at the path is replaced; any other file there is an
    /// error (it is never deleted).
    pub fn bind(addr: &MetricsAddr) -> std::io::Result<MetricsListener> {
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
        Ok(MetricsListener { listener })
    }

    /// Where it listens (the actual port when bound to port 0).
    pub fn local_addr(&self) -> std::io::Result<MetricsAddr> {
        match &self.listener {
            Listener::Tcp(l) => Ok(MetricsAddr::Tcp(l.local_addr()?)),
            Listener::Unix(_, p) => Ok(MetricsAddr::Unix(p.clone())),
        }
    }

    /// Answers scrapes with the text `encode()` returns, until the server is dropped. The
    /// endpoint runs on a thread named `thread_name`; `encode` is called once per scrape on a
    /// second one of that name, started at the first scrape and ended after 10 s without one,
    /// so it may block.
    pub fn serve(
        self,
        thread_name: &str,
        encode: impl Fn() -> String + Send + Sync + 'static,
    ) -> std::io::Result<MetricsServer> {
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
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .thread_name(thread_name)
            .max_blocking_threads(1)
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let listener = self.listener;
        let source: Source = Arc::new(encode);
        // The listener becomes tokio's inside the runtime (registration needs its reactor); a
        // failure there is reported through this channel before `serve` returns.
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<std::io::Result<()>>(1);
        let thread = std::thread::Builder::new().name(thread_name.into()).spawn(move || {
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
            // Cancels the connections still being answered; an encoder still running on the
            // blocking thread is waited for up to IO_TIMEOUT, then left to finish on its own.
            runtime.shutdown_timeout(IO_TIMEOUT);
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
        Ok(MetricsServer { stop: Some(stop), thread: Some(thread), path, addr })
    }
}

/// A serving endpoint; stops (and removes its Unix socket) on drop.
#[derive(Debug)]
pub struct MetricsServer {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    path: Option<PathBuf>,
    addr: MetricsAddr,
}

impl MetricsServer {
    /// Where it listens.
    pub fn addr(&self) -> &MetricsAddr {
        &self.addr
    }
}

impl Drop for MetricsServer {
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

type Source = Arc<dyn Fn() -> String + Send + Sync>;

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
        let refused = refuse(req.method(), req.uri().path());
        let source = Arc::clone(&source);
        async move {
            let response = match refused {
                Some(r) => r,
                None => exposition(source).await,
            };
            Ok::<_, std::convert::Infallible>(response)
        }
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

fn plain(status: hyper::StatusCode) -> hyper::Response<Body> {
    use hyper::header;
    let mut r = hyper::Response::new(Body::from(format!("{}\n", status.canonical_reason().unwrap_or(""))));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

/// The answer to a request for anything but the exposition: 405 for a method other than `GET`
/// or `HEAD` (whose body hyper leaves out), 404 for a path other than `/metrics`; `None` for
/// the exposition.
fn refuse(method: &hyper::Method, path: &str) -> Option<hyper::Response<Body>> {
    use hyper::{header, Method, StatusCode};
    if method != Method::GET && method != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED);
        r.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return Some(r);
    }
    (path != "/metrics").then(|| plain(StatusCode::NOT_FOUND))
}

/// The exposition, encoded on the blocking thread (500 if the encoder panicked).
async fn exposition(source: Source) -> hyper::Response<Body> {
    use hyper::header;
    match tokio::task::spawn_blocking(move || source()).await {
        Ok(text) => {
            let mut r = hyper::Response::new(Body::from(text));
            r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static(CONTENT_TYPE));
            r
        }
        Err(e) => {
            tracing::warn!("prometheus endpoint: encoding failed: {e}");
            plain(hyper::StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}
