//! Where an endpoint listens.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Where the endpoint listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsAddr {
    /// A TCP address (`127.0.0.1:9100`, `[::1]:9100`, `localhost:9100`).
    Tcp(SocketAddr),
    /// A Unix socket path (anything with a `/`, or `unix:PATH`).
    Unix(PathBuf),
}

/// What is wrong with an endpoint address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    /// `unix:` with nothing after it.
    #[error("empty Unix socket path")]
    EmptyPath,
    /// `localhost:` followed by something that is not a port.
    #[error("not a port: {0:?}")]
    NotAPort(String),
    /// Neither form.
    #[error("{0:?} is neither IP:PORT (e.g. 127.0.0.1:9464), localhost:PORT, nor a Unix socket path")]
    Unrecognized(String),
    /// A TCP address other than loopback, not allowed.
    #[error(
        "{0} is not a loopback address; the endpoint has no authentication, so serving it to other \
         hosts needs prometheus_allow_remote = true (--prometheus-allow-remote)"
    )]
    NotLoopback(SocketAddr),
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
    type Err = AddrError;
    fn from_str(s: &str) -> Result<Self, AddrError> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(AddrError::EmptyPath);
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
            let port: u16 = port.parse().map_err(|_| AddrError::NotAPort(port.to_owned()))?;
            return Ok(MetricsAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], port))));
        }
        Err(AddrError::Unrecognized(s.to_owned()))
    }
}

impl MetricsAddr {
    /// Refuses a TCP address other than loopback (the unspecified address `0.0.0.0` included)
    /// unless `allow_remote`.
    pub fn check_local(&self, allow_remote: bool) -> Result<(), AddrError> {
        match self {
            MetricsAddr::Tcp(a) if !allow_remote && !a.ip().to_canonical().is_loopback() => {
                Err(AddrError::NotLoopback(*a))
            }
            _ => Ok(()),
        }
    }

    /// Parses `s` and checks it with [`MetricsAddr::check_local`]: what a daemon does with its
    /// `prometheus_listen` setting before anything else starts.
    pub fn parse_local(s: &str, allow_remote: bool) -> Result<MetricsAddr, AddrError> {
        let a: MetricsAddr = s.parse()?;
        a.check_local(allow_remote)?;
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            assert!(e.to_string().contains("prometheus_allow_remote"), "{e}");
            assert!(a.check_local(true).is_ok(), "allowed explicitly");
            assert_eq!(MetricsAddr::parse_local(remote, false), Err(e));
            assert_eq!(MetricsAddr::parse_local(remote, true), Ok(a));
        }
        assert!("[::ffff:127.0.0.1]:9464".parse::<MetricsAddr>().unwrap().check_local(false).is_ok());
        assert_eq!(MetricsAddr::parse_local("nowhere", true), Err(AddrError::Unrecognized("nowhere".into())));
        assert_eq!(a.to_string(), "127.0.0.1:9464");
        assert_eq!(MetricsAddr::Unix("/m.sock".into()).to_string(), "unix:/m.sock");
    }
}
