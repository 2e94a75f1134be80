//! Tyche: network block storage straight over Ethernet.
//!
//! This facade re-exports the workspace's library crates and hosts the top-level `benches/` and
//! `examples/`.
#![forbid(unsafe_code)]

pub use tyche_channel as channel;
pub use tyche_transport as transport;
pub use tyche_wire as wire;
