//! Counters and the snapshot `tyched stats` prints.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Drops of received frames, by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drops {
    /// Not a valid Tyche frame (short, wrong version, wrong EtherType, bad fields).
    pub malformed: u64,
    /// For a session this target does not have (a stranger, or a reclaimed session).
    pub unknown_session: u64,
    /// For a channel or from a MAC the session does not have.
    pub not_ours: u64,
    /// Refused by the channel (duplicate, out of window, bad slot, ...), by reason.
    pub channel: BTreeMap<String, u64>,
    /// Write data for a slot whose request is being executed.
    pub slot_busy: u64,
    /// CONNECTs refused because the MAC is not allowed.
    pub denied_mac: u64,
    /// CONNECTs refused because the key proof was missing or wrong.
    pub denied_key: u64,
    /// CONNECTs ignored while shutting down.
    pub shutting_down: u64,
}

/// Counters of one NIC (transport).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicStats {
    /// Interface name (or transport index).
    pub name: String,
    /// Local MAC.
    pub mac: String,
    /// Frames received.
    pub frames_rx: u64,
    /// Bytes received.
    pub bytes_rx: u64,
    /// Frames sent.
    pub frames_tx: u64,
    /// Bytes sent.
    pub bytes_tx: u64,
    /// Receive errors reported by the transport.
    pub rx_errors: u64,
    /// Send errors reported by the transport.
    pub tx_errors: u64,
    /// Drops by reason.
    pub drops: Drops,
}

/// Requests by operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCounts {
    /// READ.
    pub read: u64,
    /// WRITE.
    pub write: u64,
    /// FLUSH.
    pub flush: u64,
    /// DISCARD.
    pub discard: u64,
    /// WRITE_ZEROES.
    pub write_zeroes: u64,
}

impl OpCounts {
    pub(crate) fn bump(&mut self, op: tyche_wire::Op) {
        use tyche_wire::Op;
        *match op {
            Op::Read => &mut self.read,
            Op::Write => &mut self.write,
            Op::Flush => &mut self.flush,
            Op::Discard => &mut self.discard,
            Op::WriteZeroes => &mut self.write_zeroes,
        } += 1;
    }
}

/// Counters of one export.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportStats {
    /// Name.
    pub name: String,
    /// Backend kind.
    pub backend: String,
    /// Size in bytes.
    pub size: u64,
    /// Whether read-only.
    pub read_only: bool,
    /// Whether a key is needed.
    pub keyed: bool,
    /// Live sessions.
    pub sessions: u64,
    /// Requests executed, by op.
    pub requests: OpCounts,
    /// Bytes read from storage.
    pub bytes_read: u64,
    /// Bytes written to storage.
    pub bytes_written: u64,
    /// Requests that completed with an error status (from storage, or aborted at shutdown).
    pub errors: u64,
    /// CONNECTs refused (MAC or key).
    pub denied: u64,
}

/// Counters of one live channel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelSnapshot {
    /// Session id.
    pub session: u64,
    /// Channel index.
    pub channel: u16,
    /// Export name.
    pub export: String,
    /// NIC it runs on.
    pub nic: String,
    /// Initiator MAC.
    pub peer: String,
    /// Whether dead (waiting to be reclaimed).
    pub dead: bool,
    /// Frames sent.
    pub frames_tx: u64,
    /// Frames received.
    pub frames_rx: u64,
    /// Payload bytes sent.
    pub payload_tx: u64,
    /// Payload bytes received.
    pub payload_rx: u64,
    /// Retransmissions.
    pub retransmits: u64,
    /// Drops by reason.
    pub drops: BTreeMap<String, u64>,
    /// Requests being executed by storage (queue occupancy).
    pub executing: u64,
}

/// Everything `tyched stats` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Milliseconds since start.
    pub uptime_ms: u64,
    /// Whether the daemon is shutting down.
    pub stopping: bool,
    /// Live sessions.
    pub sessions: u64,
    /// Sessions reclaimed after all their channels died.
    pub sessions_reclaimed: u64,
    /// Payload bytes copied in user space on the target (write data into slot memory, read data
    /// from slot memory into frames). Zero only with a zero-copy data path, which this daemon
    /// does not have yet (docs/tyched.md).
    pub payload_copied_bytes: u64,
    /// Storage requests queued or running (queue occupancy).
    pub storage_inflight: u64,
    /// Copies of executed modifying requests not executed again.
    pub duplicates_suppressed: u64,
    /// Per NIC.
    pub nics: Vec<NicStats>,
    /// Per export.
    pub exports: Vec<ExportStats>,
    /// Per live channel.
    pub channels: Vec<ChannelSnapshot>,
}

impl Snapshot {
    /// Sum of a drop counter over every NIC.
    pub fn drops(&self, f: impl Fn(&Drops) -> u64) -> u64 {
        self.nics.iter().map(|n| f(&n.drops)).sum()
    }

    /// A human-readable rendering.
    pub fn human(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "uptime {:.1}s{}  sessions {} (reclaimed {})  storage in flight {}  payload copied {} B  duplicates suppressed {}",
            self.uptime_ms as f64 / 1000.0,
            if self.stopping { " (stopping)" } else { "" },
            self.sessions,
            self.sessions_reclaimed,
            self.storage_inflight,
            self.payload_copied_bytes,
            self.duplicates_suppressed
        );
        let _ = writeln!(s, "\nNICs:");
        for n in &self.nics {
            let d = &n.drops;
            let _ = writeln!(
                s,
                "  {:<10} {}  rx {} frames {} B  tx {} frames {} B  drops: malformed {} unknown-session {} not-ours {} slot-busy {} denied-mac {} denied-key {} channel {:?}",
                n.name, n.mac, n.frames_rx, n.bytes_rx, n.frames_tx, n.bytes_tx, d.malformed, d.unknown_session,
                d.not_ours, d.slot_busy, d.denied_mac, d.denied_key, d.channel
            );
        }
        let _ = writeln!(s, "\nExports:");
        for e in &self.exports {
            let r = &e.requests;
            let _ = writeln!(
                s,
                "  {:<12} {} {} B{}{}  sessions {}  read {} ({} B) write {} ({} B) flush {} discard {} write-zeroes {}  errors {} denied {}",
                e.name, e.backend, e.size, if e.read_only { " ro" } else { "" }, if e.keyed { " keyed" } else { "" },
                e.sessions, r.read, e.bytes_read, r.write, e.bytes_written, r.flush, r.discard, r.write_zeroes,
                e.errors, e.denied
            );
        }
        let _ = writeln!(s, "\nChannels:");
        for c in &self.channels {
            let _ = writeln!(
                s,
                "  session {:016x} ch {} {} on {} from {}{}  tx {} frames {} B  rx {} frames {} B  retransmits {}  executing {}  drops {:?}",
                c.session, c.channel, c.export, c.nic, c.peer, if c.dead { " (dead)" } else { "" }, c.frames_tx,
                c.payload_tx, c.frames_rx, c.payload_rx, c.retransmits, c.executing, c.drops
            );
        }
        s
    }
}
