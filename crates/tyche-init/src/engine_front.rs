//! Front ends served by the engine threads themselves.
//!
//! Most front ends call the [`Client`](crate::Client) (the ublk queues, the NBD server's
//! per-request tasks, the benchmarks). A connection-style front end can instead be served by an
//! engine thread in its own loop: the thread takes the front end's requests, submits them into the
//! volume, hands each outcome back, lets it write its replies, and sleeps on its descriptor with
//! its links. No thread hand-off per request and no async task per request.
//!
//! The engine knows such a front end only through [`Front`]: it never sees its protocol. The NBD
//! server's engine mode ([`crate::nbd::direct::DirectConn`]) is the one implementation.
//!
//! Per request the engine makes one virtual call ([`Front::complete`]); reading and writing are
//! one call per front end and engine pass. A request's [`Token`] is the front end's key for what it
//! needs to answer it (kept on its side), so nothing is allocated per request to carry it.

use std::os::fd::AsFd;
use std::sync::Arc;

use nix::poll::PollFlags;
use tyche_wire::Op;

use crate::bell::Bell;
use crate::buf::{Buf, Outcome};
use crate::config::SendMode;

/// A front end's key for a request in the engine, handed back with its outcome. Opaque to the
/// engine.
pub(crate) type Token = u64;

/// A descriptor an engine thread sleeps on (shared, so that it outlives the engine thread's
/// part lock the front end lives under: the thread sleeps without holding it).
pub(crate) type WaitFd = Arc<dyn AsFd + Send + Sync>;

/// A request a front end hands the engine.
#[derive(Debug)]
pub(crate) struct FrontIo {
    pub op: Op,
    pub fua: bool,
    /// Byte offset in the export.
    pub offset: u64,
    /// Bytes.
    pub length: u64,
    /// Write data, or the buffer for read data (a block status list buffer for BLOCK_STATUS).
    pub data: Buf,
    /// Given back with the outcome ([`Front::complete`]).
    pub token: Token,
}

/// A connection-style front end that an engine thread serves in its loop.
///
/// Each engine pass over its front ends: [`Front::receive`] (requests for the volume),
/// then, as the volume completes them, [`Front::complete`], then [`Front::send`] (replies out);
/// a front end that is [`Front::finished`] is closed and dropped. While the thread sleeps it polls
/// [`Front::wait_for`]. A front end bounds what it takes in (requests in flight, bytes held) itself:
/// it returns no more requests while it is full.
pub(crate) trait Front: Send + std::fmt::Debug {
    /// Its key among the front ends of the session (unique for the session's life).
    fn key(&self) -> u64;

    /// The NUMA node its request buffers are on (the scheduler's hint), if any.
    fn node(&self) -> Option<u32>;

    /// Called once, on the thread that hands the front end over, before the engine serves it: in
    /// queue send mode a front end may start a thread of its own to read its requests, which
    /// rings `bell` (the serving engine thread's) when it has handed some over.
    fn start(&mut self, mode: SendMode, bell: &Arc<Bell>) -> std::io::Result<()>;

    /// Whether a thread of its own reads its requests (queue send mode): they count as handed
    /// over, not sent inline, and the engine does not poll its descriptor for reading.
    fn queued(&self) -> bool;

    /// The engine thread serving it, as that thread saw itself once placed (for reports).
    fn placed(&self, thread: Option<tyche_numa::report::ThreadPlacement>);

    /// Appends the requests it has for the volume now (never blocks). Requests it answers
    /// itself (refused ones, empty ranges) are not returned.
    fn receive(&mut self, out: &mut Vec<FrontIo>);

    /// The volume completed the request of `token` (a read's data in the buffer).
    fn complete(&mut self, token: Token, outcome: Outcome);

    /// Writes what it can of its replies without blocking; whether anything was written.
    fn send(&mut self) -> bool;

    /// Whether its reader thread (queue send mode) handed over requests it can take now: the
    /// engine thread must not go to sleep.
    fn handed_waiting(&self) -> bool;

    /// What the engine thread polls for it while sleeping (readable, writable), if anything.
    fn wait_for(&self) -> Option<(WaitFd, PollFlags)>;

    /// Whether it is over (its client left or it failed, nothing in flight, every reply out).
    fn finished(&self) -> bool;

    /// Ends it; `session_closed`: because the session closes, not because it finished.
    fn close(self: Box<Self>, session_closed: bool);
}
