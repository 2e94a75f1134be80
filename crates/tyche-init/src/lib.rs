//! Tyche's initiator: a remote export as a local block device.
//!
//! [`connect`] opens a session to a target over one or more [`Link`]s (one per NIC, any
//! [`FrameTransport`]), several channels per link, and starts an **engine thread** that owns the
//! sans-IO [`tyche_channel::Volume`] and the transports. It returns a [`Client`], a cheap,
//! cloneable, async handle: [`Client::read`], [`Client::write`], [`Client::flush`],
//! [`Client::discard`], [`Client::write_zeroes`]. The front ends ([`nbd`], the ublk front end
//! behind [`frontend::BlockFrontend`]), the benchmarks and the examples all use that handle. A
//! connection-style front end can also be served by an engine thread in its own loop (the NBD
//! server's engine mode): the engine knows it only through a small trait (`engine_front::Front`), never
//! its protocol.
//!
//! # Promises
//! - **Never hangs.** A request completes with data, with the target's error, or, when no
//!   channel is alive for [`InitiatorConfig::no_path_timeout`] (NVMe's `ctrl_loss_tmo`), with
//!   [`Error::NoPath`]. Dead channels are reconnected with capped exponential backoff for as
//!   long as the process runs; when the target no longer knows the session (it restarted, or
//!   reclaimed it) a new session is opened on the same export and every request not yet
//!   completed is issued again (docs/tyche-init.md, "Session resumption").
//! - **Never corrupts.** A dead channel's requests are re-issued on the survivors under the same
//!   tags, and the target executes every modifying request at most once per tag.
//! - **Who owns the memory.** Request buffers live on the engine side from submission to
//!   completion: write data is moved in with the request, read data is placed into a buffer the
//!   engine allocates and hands back on completion.
//! - [`loopback`] holds an in-process target (`tyched`'s library on an export in RAM) over the
//!   in-memory link, shared by the tests, the examples, the benches and `--loopback-mib`; it
//!   needs no privileges.
//!
//! [`FrameTransport`]: tyche_transport::FrameTransport
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod attachfile;
mod bell;
mod buf;
mod client;
mod config;
mod discover;
mod engine;
mod engine_front;
mod error;
mod export_info;
pub mod frontend;
pub mod loopback;
pub mod metrics;
pub mod nbd;
pub mod report;
pub mod sched;
pub mod state;
mod stats;
#[cfg(feature = "ublk")]
pub mod ublk;
pub mod ublk_frontend;

pub use client::{connect_blocking, Client};
pub use config::{machine_id, parse_host_id, EngineThreads, InitiatorConfig, Link, SchedulerKind, SendMode};
pub use discover::{discover, discover_with_nonce, new_nonce, DiscoveredExport, DiscoveredTarget};
pub use error::{ConnectError, Error};
pub use export_info::ExportInfo;
pub use report::{ChannelReport, Health, LinkReport, NbdConnReport, NbdStats, Paths, Report};
pub use stats::Stats;

/// Opens a session to `config.export` over `links` and starts the engine thread.
///
/// Returns once the first channel is open and every other initial channel has either opened or
/// failed (failed ones are retried in the background, see
/// [`InitiatorConfig::reconnect_delay`]).
pub async fn connect(config: InitiatorConfig, links: Vec<Link>) -> Result<Client, ConnectError> {
    tokio::task::spawn_blocking(move || connect_blocking(config, links)).await.unwrap_or(Err(ConnectError::EngineGone))
}
