//! The AF_PACKET transport (`tyched serve --transport packet`), which lives in `tyche-xdp`
//! beside AF_XDP so that `tyche-init discover` can read through the kernel too.

pub use tyche_xdp::PacketTransport;
