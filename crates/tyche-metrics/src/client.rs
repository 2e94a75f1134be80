//! A minimal blocking HTTP/1 client for an endpoint: what the tests of the daemons scrape with
//! (plain `std` sockets, so that the server is exercised by something other than itself).

use std::io::{Read, Write};
use std::time::Duration;

use crate::MetricsAddr;

/// An answer as read off the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status line (`HTTP/1.1 200 OK`).
    pub status: String,
    /// The headers, names in lower case, in order.
    pub headers: Vec<(String, String)>,
    /// Everything after the header block.
    pub body: String,
}

impl Response {
    /// The first header called `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Parses a whole answer: status line, headers, a blank line, the body.
    pub fn parse(text: &str) -> std::io::Result<Response> {
        let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{what}: {text:?}"));
        let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| bad("no header block"))?;
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap_or_default().to_owned();
        let headers = lines
            .map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned())))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("a header without a colon"))?;
        Ok(Response { status, headers, body: body.to_owned() })
    }
}

/// Sends `request` as it is over `stream` and reads the answer to its end (the server closes
/// every connection after one answer).
pub fn exchange(mut stream: impl Read + Write, request: &[u8]) -> std::io::Result<Response> {
    stream.write_all(request)?;
    let mut out = String::new();
    stream.read_to_string(&mut out)?;
    Response::parse(&out)
}

/// `GET path HTTP/1.0` at `addr`, within `timeout` per read or write.
pub fn get(addr: &MetricsAddr, path: &str, timeout: Duration) -> std::io::Result<Response> {
    let request = format!("GET {path} HTTP/1.0\r\n\r\n");
    match addr {
        MetricsAddr::Tcp(a) => {
            let s = std::net::TcpStream::connect_timeout(a, timeout)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            exchange(s, request.as_bytes())
        }
        MetricsAddr::Unix(p) => {
            let s = std::os::unix::net::UnixStream::connect(p)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            exchange(s, request.as_bytes())
        }
    }
}
