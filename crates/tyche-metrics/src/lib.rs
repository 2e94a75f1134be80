//! Prometheus text exposition over local HTTP, for Tyche's daemons (`tyched serve
//! --prometheus-listen ADDR`, `tyche-init attach|serve-nbd --prometheus-listen ADDR`).
//!
//! What is generic lives here; each daemon keeps what its metrics are:
//! - [`MetricsAddr`]: where the endpoint listens (`IP:PORT`, `localhost:PORT`, or a Unix socket
//!   path), and [`MetricsAddr::check_local`], which refuses a non-loopback address unless the
//!   operator allows it.
//! - [`MetricsListener`] / [`MetricsServer`]: `GET /metrics` over HTTP/1 (hyper, on a
//!   single-threaded tokio runtime on one thread of its own), answered with the text a closure
//!   encodes at scrape time. Limits: [`MAX_REQUEST`], [`IO_TIMEOUT`], [`MAX_CONNECTIONS`].
//! - [`text`]: helpers for a daemon's `prometheus-client` collector: one family from rows of
//!   labels and values ([`text::family`]), the `*_build_info` gauge ([`text::build_info`]), and
//!   a collector encoded under a prefix ([`text::encode`]).
//! - [`client`]: a minimal blocking HTTP/1 client, for tests and checks of an endpoint, and
//!   [`check`], which reads an exposition's families back (and a document's table of them).
//!
//! The endpoint has no authentication and no TLS, and daemons' labels name exports, sessions,
//! NICs and links, so by default it only listens on loopback addresses (or a Unix socket, which
//! file permissions protect).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod addr;
pub mod check;
pub mod client;
mod server;
pub mod text;

pub use addr::{AddrError, MetricsAddr};
pub use server::{MetricsListener, MetricsServer, CONTENT_TYPE, IO_TIMEOUT, MAX_CONNECTIONS, MAX_REQUEST};
