//! A session's counters, as [`Client::stats`](crate::Client::stats) reports them.

/// Counters of a session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Channels open now.
    pub live_channels: usize,
    /// Channels configured (links × channels per link).
    pub channels: usize,
    /// Requests in the volume.
    pub outstanding: usize,
    /// Requests waiting for room in the volume.
    pub queued: usize,
    /// Requests completed successfully.
    pub completed: u64,
    /// Requests failed.
    pub failed: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Channels reopened after dying.
    pub reconnects: u64,
    /// Payload bytes the engine threads copied in user space: write data into the frames that
    /// carry it, read data out of the frames into the request's buffer, and the data of parts
    /// of requests handed between engine threads (docs/tyche-init.md, "Copies").
    pub payload_copied_bytes: u64,
    /// The part of `payload_copied_bytes` that is write data.
    pub payload_copied_write_bytes: u64,
    /// Retransmitted frames on the open channels.
    pub retransmits: u64,
    /// Frames the open channels refused as forged or altered (a keyed export's bad tags).
    pub unauthenticated: u64,
    /// Frames the open channels refused as replays (a keyed export's replay window).
    pub replayed: u64,
    /// DATA frames the open channels refused for a wrong CRC32C (feature DIGEST).
    pub bad_digest: u64,
    /// Requests the thread that had them submitted and sent itself (inline send mode: the
    /// application's thread; an NBD connection in inline mode: the engine thread that reads it).
    pub sent_inline: u64,
    /// Requests handed to an engine thread over a queue (queue send mode: a submitter thread's
    /// batches; an NBD connection in queue mode: its reader thread's requests).
    pub handed_over: u64,
    /// Inline submissions whose frames were left to an engine thread after all (the request
    /// waited in the backlog, or a part's transports were busy).
    pub inline_fallbacks: u64,
    /// Inline sends after which an engine thread whose links cannot wake it on arrival
    /// (in-memory links) was rung to look for the reply.
    pub inline_wakes: u64,
    /// Parts of requests one engine thread's part of the volume handed to another's (its links
    /// were all down): see docs/architecture.md, "The initiator: a volume in parts".
    pub handoffs: u64,
    /// The durability epoch of the current session, once a channel of it is open.
    pub durability_epoch: Option<tyche_wire::DurabilityEpoch>,
    /// What the volume owes about the writes it completed (`Volume::durability_debt`):
    /// recorded in the attachment's state file for `attach --recover`.
    pub durability_debt: tyche_channel::DurabilityDebt,
}
