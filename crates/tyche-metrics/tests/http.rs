//! The endpoint over real sockets: routes, limits, slow and silent clients, Unix sockets.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tyche_metrics::client::{exchange, get};
use tyche_metrics::{MetricsAddr, MetricsListener, IO_TIMEOUT, MAX_CONNECTIONS, MAX_REQUEST};

const TEXT: &str = "# HELP demo_up Up.\n# TYPE demo_up gauge\ndemo_up 1\n";

fn text() -> String {
    TEXT.to_owned()
}

fn tcp(l: &MetricsListener) -> std::net::SocketAddr {
    match l.local_addr().expect("addr") {
        MetricsAddr::Tcp(a) => a,
        other => panic!("not TCP: {other}"),
    }
}

#[test]
fn scrapes_over_tcp() {
    let l = MetricsListener::bind(&"127.0.0.1:0".parse().unwrap()).expect("bind");
    let addr = tcp(&l);
    let scrapes = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&scrapes);
    let server = l
        .serve("test-metrics", move || {
            counted.fetch_add(1, Ordering::Relaxed);
            text()
        })
        .expect("serve");
    assert_eq!(server.addr(), &MetricsAddr::Tcp(addr));
    let connect = || std::net::TcpStream::connect(addr).expect("connect");

    let r = exchange(connect(), b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n").unwrap();
    assert_eq!(r.status, "HTTP/1.1 200 OK");
    assert!(r.header("content-type").unwrap().starts_with("text/plain; version=0.0.4"));
    assert_eq!(r.header("content-length"), Some(TEXT.len().to_string().as_str()));
    assert_eq!(r.body, TEXT);
    assert_eq!(scrapes.load(Ordering::Relaxed), 1, "the text is encoded at scrape time");

    let r = exchange(connect(), b"GET /metrics?name[]=x HTTP/1.0\r\n\r\n").unwrap();
    assert_eq!(r.status, "HTTP/1.0 200 OK", "a query string is ignored (and 1.0 is answered in 1.0)");
    assert_eq!(r.body, TEXT);
    let r = get(&MetricsAddr::Tcp(addr), "/metrics", Duration::from_secs(5)).unwrap();
    assert_eq!((r.status.as_str(), r.body.as_str()), ("HTTP/1.0 200 OK", TEXT));

    let r = exchange(connect(), b"HEAD /metrics HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(r.status, "HTTP/1.1 200 OK");
    assert!(r.body.is_empty(), "HEAD has no body");
    assert_eq!(r.header("content-length"), Some(TEXT.len().to_string().as_str()));

    for path in ["/", "/metric", "/metrics/x", "/favicon.ico"] {
        let r = exchange(connect(), format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes()).unwrap();
        assert_eq!(r.status, "HTTP/1.1 404 Not Found", "{path}");
    }
    let r = exchange(connect(), b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").unwrap();
    assert_eq!(r.status, "HTTP/1.1 405 Method Not Allowed");
    assert_eq!(r.header("allow"), Some("GET, HEAD"));
    for garbage in [&b"hello\r\n\r\n"[..], b"GET /metrics\r\n\r\n", b"GET /metrics SPDY/3\r\n\r\n", b"\xff\xfe\r\n\r\n"]
    {
        let r = exchange(connect(), garbage).unwrap();
        assert_eq!(r.status, "HTTP/1.1 400 Bad Request", "{garbage:?}");
    }
    let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 2 * MAX_REQUEST));
    let r = exchange(connect(), &huge).unwrap();
    assert_eq!(r.status, "HTTP/1.1 431 Request Header Fields Too Large");

    // A client that connects and says nothing does not block the next one for long.
    let idle = connect();
    let t = Instant::now();
    let r = exchange(connect(), b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(r.status, "HTTP/1.1 200 OK");
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
    let addr = MetricsAddr::Unix(path.clone());
    let server = MetricsListener::bind(&addr).expect("bind").serve("test-metrics", text).expect("serve");
    let s = std::os::unix::net::UnixStream::connect(&path).expect("connect");
    let r = exchange(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_eq!(r.status, "HTTP/1.1 200 OK");
    assert!(r.header("content-type").unwrap().starts_with("text/plain; version=0.0.4"));
    assert_eq!(r.body, TEXT);
    assert_eq!(get(&addr, "/nope", Duration::from_secs(5)).unwrap().status, "HTTP/1.0 404 Not Found");
    drop(server);
    assert!(!path.exists(), "the socket is removed on drop");

    // Another kind of file is never replaced.
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, b"keep me").unwrap();
    let e = MetricsListener::bind(&MetricsAddr::Unix(file.clone())).expect_err("not a socket");
    assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
}

#[test]
fn silent_and_trickling_clients_are_bounded() {
    let l = MetricsListener::bind(&"127.0.0.1:0".parse().unwrap()).expect("bind");
    let addr = tcp(&l);
    let _server = l.serve("test-metrics", text).expect("serve");
    let connect = || std::net::TcpStream::connect(addr).expect("connect");
    let scrape = || exchange(connect(), b"GET /metrics HTTP/1.1\r\n\r\n").unwrap().status;

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

#[test]
fn the_encoder_may_block_and_one_that_panics_is_a_500() {
    // What a daemon's encoder does to ask its engine: wait on tokio's blocking receive, which
    // panics on a runtime's own thread.
    let waits = || {
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || tx.send(text()));
        rx.blocking_recv().expect("an answer")
    };
    let l = MetricsListener::bind(&"127.0.0.1:0".parse().unwrap()).expect("bind");
    let addr = MetricsAddr::Tcp(tcp(&l));
    let _server = l.serve("test-metrics", waits).expect("serve");
    for _ in 0..3 {
        assert_eq!(get(&addr, "/metrics", Duration::from_secs(5)).unwrap().body, TEXT);
    }

    let l = MetricsListener::bind(&"127.0.0.1:0".parse().unwrap()).expect("bind");
    let addr = MetricsAddr::Tcp(tcp(&l));
    let fails = Arc::new(AtomicU64::new(1));
    let f = Arc::clone(&fails);
    let _server = l
        .serve("test-metrics", move || {
            assert_eq!(f.swap(0, Ordering::Relaxed), 0, "the encoder fails once");
            text()
        })
        .expect("serve");
    assert_eq!(get(&addr, "/metrics", Duration::from_secs(5)).unwrap().status, "HTTP/1.0 500 Internal Server Error");
    assert_eq!(get(&addr, "/metrics", Duration::from_secs(5)).unwrap().body, TEXT, "still serving");
}
