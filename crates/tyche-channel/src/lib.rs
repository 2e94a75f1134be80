//! Tyche's channel engine, sans-IO.
//!
//! A [`Channel`] is one end of one Tyche channel: the paper's TX and RX rings (head, tail and
//! `rx_ackd`), the `remq` and `damq` slots, data messages split into segments and reassembled
//! out of order into the named slot, and the reliability that the network does not give:
//! cumulative and selective acknowledgement, negative acknowledgement, retransmission with
//! backoff, duplicate suppression and credit flow control. A [`Volume`] bundles an initiator's
//! channels (one or more per NIC) into one block device and re-issues a dead channel's requests
//! on the survivors; a [`TargetSession`] is the target's side of a session and executes every
//! modifying request at most once. [`Connector`] and [`Acceptor`] open channels.
//!
//! # Promises
//! - **No I/O, no clock, no randomness inside.** Everything is driven by calls that carry the
//!   time ([`Instant`]) and the bytes; identical inputs give identical outputs, so a simulator
//!   replays any run from its seed (quinn-proto's discipline).
//! - **No payload memory.** The engine names where payloads go ([`Placement`], [`Inbound::Read`],
//!   [`TargetInbound::Write`]) and where they come from ([`PayloadRef`], [`OutFrame`]); the
//!   caller copies them or leaves them in place in UMEM.
//! - **A bad peer is an error value.** Malformed, stale, duplicate or out-of-window frames are
//!   dropped and counted, never a panic. Broken internal invariants (a caller completing a slot it
//!   never got, a queue over its bound) are assertions.
//! - **Bounded.** Rings, slots, queues, the tag window and the target's ledger all have named
//!   limits ([`config`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admission;
/// Pre-shared key proofs for the CHALLENGE round.
pub mod auth;
mod board;
mod challenges;
mod channel;
/// Limits and timer settings.
pub mod config;
mod drop_reason;
pub mod fence;
mod handshake;
mod initiator;
mod ledger;
mod parts;
mod reconnect;
mod role;
mod scheduler;
mod seq;
mod session;
mod target;
mod time;
mod volume_parts;

pub use admission::{
    mac_identity, Admission, Admitted, ExportAccess, Grant, HeldChannel, Holder, Joined, Refused, Verdict,
};
pub use board::VolumeBoard;
pub use challenges::{Challenges, KeyCheck, PendingChallenge, CHALLENGE_LIFETIME};
pub use channel::data_head;
pub use channel::{
    Channel, ChannelEvent, ChannelStats, DeadReason, DropReason, FrameDrop, PayloadRef, Pieces, Placement,
    ReadyRequest, Received, Role, Submission, Transmit, DATA_HEAD_COPY, FLOOR_DECAY, MAX_FLOOR_DECAY, MAX_PIECES,
};
pub use config::Timers;
pub use fence::{FenceWait, Fenceable, LocalWork};
pub use handshake::{
    Accepted, Acceptor, AcceptorLimits, BusyCounts, ConnectError, Connected, Connector, ExportSpec, HandshakeFrame,
    KeyedConnect, FRESH_KEY_ROUNDS,
};
pub use initiator::{
    DurabilityDebt, Handback, Handoff, Inbound, InboundOf, IoError, IoRequest, OutFrame, ReadBack, SubmitError, Volume,
    VolumeConfig, VolumeEvent,
};
pub use parts::{post_messages, Courier, SessionParts};
pub use reconnect::{ConnectPlan, Failed, Opened, ReconnectPolicy, Reconnector};
pub use scheduler::{ChannelView, LeastBytes, RoundRobin, Scheduler, IDLE_RUN_BYTES};
pub use session::{FirstOpen, InitiatorSession, Opening, Refusal, Setup};
pub use target::{
    Directory, ExportGeometry, PartId, PartMessage, TargetEvent, TargetInbound, TargetInboundOf, TargetSession,
};
pub use time::Instant;
pub use volume_parts::{exchange_part, AtOnce, HandCourier, HandMessage, VolumeParts};
