//! Tyche's lab tools, not shipped: the binaries (`tyche-attack`, a hostile peer; `tyche-flood`,
//! a CONNECT flood; `tyche-xdp-peer`, the raw AF_XDP/TCP peer of the transport bench) and, as a
//! library, [`replay::ReplayPort`]: a peer that replays frames built in advance, so that the
//! channel scaling bench measures one daemon's frame handling alone.

pub mod replay;
