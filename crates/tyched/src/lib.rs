//! `tyched`, the Tyche target daemon, as a library: tests, the demo and benchmarks start a target
//! in-process with [`Target::start`] over any [`tyche_transport::FrameTransport`].
//!
//! - [`config`]: the TOML configuration and its validation; [`reload`]: what a reload
//!   (`SIGHUP`) changes in a running target and what needs a restart.
//! - [`backend`]: RAM, file and block-device exports.
//! - [`epoch`]: each export's durability epoch (ACCEPT `DURABILITY_EPOCH`).
//! - [`uring`]: the io_uring engine for file and block exports (the worker pool where the
//!   kernel does not allow io_uring).
//! - [`runtime`]: the target runtime (network thread, storage workers, access control, shutdown).
//! - [`workers`]: storage workers per NUMA node (the placement plan's completion workers), the
//!   per-node job queues and where completions go.
//! - [`stats`]: the counters `tyched stats` shows, and [`stats_server`] serving them.
//! - [`prometheus`]: the same counters as Prometheus text on `GET /metrics` (local HTTP, served
//!   by `tyche-metrics`).
//!
//! # Promises
//! - A malformed, stray or hostile frame is dropped and counted, never a panic.
//! - [`TargetHandle::shutdown`] stops accepting channels, completes or aborts every request in
//!   flight, flushes every export, and returns the final counters.
//! - No payload byte is copied in user space where the transport lends frames (AF_XDP): write
//!   data stays in the received frames until storage has written it (vectored writes over them),
//!   and read data is read straight into transmit chunks the transport lent, behind the room for
//!   the DATA headers, and sent from there. Where it cannot (TCP, AF_PACKET, O_DIRECT block
//!   devices, multi-buffer frames, exhausted chunk pools) each payload is copied once through
//!   `damq` slot memory, and the counter `payload_copied_bytes` counts every byte copied.
//! - A kept frame goes back to its transport once its write is done or can never execute
//!   (slot reused for another tag, channel replaced, session reclaimed); lent memory stays
//!   mapped while storage uses it, even past its transport.

pub mod backend;
pub mod config;
pub mod epoch;
mod job;
pub mod packet;
pub mod prometheus;
mod rate_limit;
pub mod reload;
pub mod runtime;
pub mod stats;
pub mod stats_server;
pub mod steer;
pub mod uring;
pub mod workers;

pub use config::{Config, ConfigError, ExportConfig};
pub use runtime::{Nic, Placement, ReloadError, Reloaded, StartError, Target, TargetHandle};
pub use stats::Snapshot;

/// Spare UMEM chunks each AF_XDP port of `tyched serve` gets so that received write data can
/// stay in its frames until storage has written it (16 MiB per port): up to this many DATA
/// frames per port are kept at once (a third as many at MTU 9000, where a frame spans three
/// chunks); beyond that, write data is copied into slot memory (and
/// counted in `payload_copied_bytes`).
pub const LEND_FRAMES: u32 = 4096;

/// UMEM chunks each AF_XDP port of `tyched serve` lends the target for good to store read data
/// in, one segment per chunk behind room for the DATA frame's headers, and send it from there
/// (16 MiB per port; at MTU 9000 in groups of three, one group per 8 KiB segment). A read
/// finding too few free ones goes through slot memory and is copied
/// into the transmit buffers (counted in `payload_copied_bytes`).
pub const TX_LEND_FRAMES: u32 = 4096;

/// The MAC address the `k`th TCP connection of `tyched serve --transport tcp` uses when its
/// interface has none (loopback): a locally administered `02:00:00:00:7c:0k`-style address.
pub fn tcp_mac(k: usize) -> tyche_wire::MacAddr {
    tyche_wire::MacAddr::local(0x7c00 + k as u32)
}
