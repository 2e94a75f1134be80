//! Serves the counters as JSON on a Unix socket: one connection, one snapshot, then close
//! (the shared [`tyche_runtime::stats_socket`]).

use std::path::Path;

pub use tyche_runtime::stats_socket::StatsServer;

use crate::Snapshot;

/// Starts the stats server of a target on `path`.
pub fn start(path: &Path, source: impl Fn() -> Snapshot + Send + 'static) -> std::io::Result<StatsServer> {
    StatsServer::start(path, "tyched-stats", source)
}

/// Reads one snapshot from the socket at `path`.
pub fn query(path: &Path) -> std::io::Result<Snapshot> {
    tyche_runtime::stats_socket::query(path)
}
