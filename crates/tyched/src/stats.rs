//! Counters and the snapshot `tyched stats` prints.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tyche_numa::{PageCounts, ThreadPlacement};
use tyche_runtime::poll::{PollMode, PollStats};

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
    /// Write segments kept in the frame they arrived in (no copy), since start.
    #[serde(default)]
    pub frames_kept: u64,
    /// Received frames the transport has lent and not yet got back (as the transport last said).
    #[serde(default)]
    pub leases_out: u64,
    /// DATA frames sent from the transmit chunk the read data was stored in (no copy).
    #[serde(default)]
    pub frames_sent_in_place: u64,
    /// Resends of read data skipped because the kernel still held the chunk's earlier send
    /// (that send carries the same bytes; a copy would be the only other way).
    #[serde(default)]
    pub resends_deferred: u64,
    /// Transmit chunks the transport lent that are free for read data now.
    #[serde(default)]
    pub tx_chunks_free: u64,
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
    /// BLOCK_STATUS.
    #[serde(default)]
    pub block_status: u64,
}

impl OpCounts {
    /// Adds `other`'s counts.
    pub(crate) fn add(&mut self, other: &OpCounts) {
        self.read += other.read;
        self.write += other.write;
        self.flush += other.flush;
        self.discard += other.discard;
        self.write_zeroes += other.write_zeroes;
        self.block_status += other.block_status;
    }

    pub(crate) fn bump(&mut self, op: tyche_wire::Op) {
        use tyche_wire::Op;
        *match op {
            Op::Read => &mut self.read,
            Op::Write => &mut self.write,
            Op::Flush => &mut self.flush,
            Op::Discard => &mut self.discard,
            Op::WriteZeroes => &mut self.write_zeroes,
            Op::BlockStatus => &mut self.block_status,
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
    /// WRITEs with FUA (force unit access) executed, whatever their outcome.
    #[serde(default)]
    pub fua_writes: u64,
    /// Requests that completed with an error status (from storage, or aborted at shutdown).
    pub errors: u64,
    /// CONNECTs refused (MAC or key).
    pub denied: u64,
    /// How storage requests run: `io_uring`, `threads` (the pool) or `inline` (RAM).
    #[serde(default)]
    pub io: String,
    /// Bytes of reads and writes handed to the device through its O_DIRECT descriptor (block
    /// devices; the rest went through the page cache).
    #[serde(default)]
    pub direct_bytes: u64,
    /// Who holds it: one entry per session, by session id.
    #[serde(default)]
    pub holders: Vec<Holder>,
}

/// A session holding an export: who attached it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// Session id (hexadecimal).
    pub session: String,
    /// The MAC address that created the session.
    pub mac: String,
    /// The initiator host's id (32 hexadecimal digits, its /etc/machine-id unless it gave
    /// another), or `mac:` and the MAC when it sent none.
    pub host: String,
    /// Its live channels.
    pub channels: usize,
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
    /// The target's address for this channel: its queue's address with `steer`, else the NIC's.
    #[serde(default)]
    pub addr: String,
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
    /// Retransmission timer expiries.
    #[serde(default)]
    pub timeouts: u64,
    /// Of which spurious: the frames were acknowledged without being sent again (delayed,
    /// not lost), and only the oldest was resent.
    #[serde(default)]
    pub spurious_timeouts: u64,
    /// Drops by reason.
    pub drops: BTreeMap<String, u64>,
    /// How its frames are protected: `none`, `digest` (CRC32C of data), `authenticated` or
    /// `encrypted` (a keyed export's sealed frames).
    #[serde(default)]
    pub protection: String,
    /// Requests being executed by storage (queue occupancy).
    pub executing: u64,
    /// NUMA node the channel was placed on: its NIC's node (`None`: unknown).
    #[serde(default)]
    pub node: Option<u32>,
    /// Where the channel's `damq` slot memory is, page by page, against `node`.
    #[serde(default)]
    pub slots: PageCounts,
    /// The thread serving the channel (its NIC's network thread), as it sees itself.
    #[serde(default)]
    pub thread: ThreadPlacement,
}

/// Where one NIC's memory and serving thread are.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicPlacement {
    /// Interface name (as in `nics`).
    pub nic: String,
    /// The NIC's NUMA node as the transport placed its memory (`None`: unknown, not bound).
    pub node: Option<u32>,
    /// The transport's frame memory (AF_XDP UMEM), page by page, against `node`.
    pub umem: PageCounts,
    /// The transport's rings (AF_XDP fill, completion, RX, TX), page by page, against `node`.
    pub rings: PageCounts,
    /// `damq` slot memory of the live channels on this NIC, page by page, against `node`.
    pub slots: PageCounts,
    /// The thread that serves this NIC, as it sees itself (`sched_getaffinity`).
    pub thread: ThreadPlacement,
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
    /// Payload bytes copied in user space on the target: write data copied out of a received
    /// frame into slot memory, and read data copied from slot memory into a transmit buffer.
    /// Zero when every payload moved between frames and storage in place (AF_XDP with a UMEM
    /// that can lend its frames; docs/tyched.md, "Data path"). The copy a RAM export's write
    /// makes into its store, and its read makes out of it, is the storage operation itself and is
    /// not counted here.
    pub payload_copied_bytes: u64,
    /// The part of `payload_copied_bytes` copied on the write path (received DATA payloads into
    /// slot memory); the rest is read data copied into transmit buffers.
    #[serde(default)]
    pub payload_copied_write_bytes: u64,
    /// Write segments kept in received frames by the engine (awaiting or in a storage write).
    #[serde(default)]
    pub leases_held: u64,
    /// Storage requests queued or running (queue occupancy).
    pub storage_inflight: u64,
    /// Storage requests answered with an I/O error at their deadline (`storage_deadline_ms`).
    #[serde(default)]
    pub storage_timeouts: u64,
    /// Sessions fenced because the same initiator (host) attached the export again.
    #[serde(default)]
    pub sessions_fenced: u64,
    /// Copies of executed modifying requests not executed again.
    pub duplicates_suppressed: u64,
    /// Copies of modifying requests that arrived on one network thread's channel and were
    /// decided (execute, wait, recorded status) by the thread holding their home channel's
    /// records: re-issues after a path failed (docs/architecture.md, "The session in parts").
    #[serde(default)]
    pub decided_by_home: u64,
    /// Messages between the parts of sessions held by different network threads.
    #[serde(default)]
    pub part_messages: u64,
    /// Per NIC.
    pub nics: Vec<NicStats>,
    /// Per export.
    pub exports: Vec<ExportStats>,
    /// Per live channel.
    pub channels: Vec<ChannelSnapshot>,
    /// Per NIC: where its memory and its thread are.
    #[serde(default)]
    pub placement: Vec<NicPlacement>,
    /// Per interface: its IRQs, the CPUs they land on, and how many share a core with its
    /// network thread (read from /proc when the stats are asked for; `none (virtual NIC)` for
    /// veth).
    #[serde(default)]
    pub irqs: Vec<tyche_numa::IrqReport>,
    /// What the limits (`[limits]` in the config, docs/tyched.md "Limits") refused or held back.
    #[serde(default)]
    pub limits: LimitStats,
    /// How the network threads waited for work (`poll`, `poll_budget_us`; docs/tyched.md,
    /// "Polling").
    #[serde(default)]
    pub poll: PollReport,
    /// The storage threads (workers and io_uring threads): where each runs and what it did.
    #[serde(default)]
    pub storage_threads: Vec<StorageThreadStats>,
    /// The storage queues (one per NUMA node with channels, or one for the pool).
    #[serde(default)]
    pub storage_queues: Vec<StorageQueueStats>,
    /// Configuration reloads (`SIGHUP`) and what the running configuration still lacks.
    #[serde(default)]
    pub reload: ReloadStats,
}

/// Configuration reloads (`SIGHUP`, `systemctl reload tyched`; docs/tyched.md, "Reloading").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReloadStats {
    /// Reloads applied (each one read a valid configuration, which may have changed nothing).
    pub applied: u64,
    /// Reloads refused: the configuration did not read or validate, or an export it adds could
    /// not be opened. Nothing of such a reload is applied.
    pub failed: u64,
    /// Why the last reload was refused; none when it was applied (or there was none).
    pub last_error: Option<String>,
    /// What the configuration file says and the running target does not do until it restarts
    /// (as of the last reload applied), each naming its field.
    pub needs_restart: Vec<String>,
}

/// One storage thread: a worker (`tyched-io{w}`) or an io_uring thread (`tyched-uring{q}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StorageThreadStats {
    /// Thread name.
    pub name: String,
    /// `worker` or `io_uring`.
    pub kind: String,
    /// The node of its queue (`None`: the pool, no particular node).
    pub node: Option<u32>,
    /// The CPUs it was meant to be pinned to (the plan's completion worker CPU; empty: not
    /// pinned).
    pub planned_cpus: Vec<u32>,
    /// The thread as it sees itself (`sched_getaffinity`).
    pub thread: ThreadPlacement,
    /// Storage jobs it executed.
    pub jobs: u64,
}

/// One storage queue: the jobs of the channels of `nics` go there.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StorageQueueStats {
    /// Its node (`None`: the pool, no particular node).
    pub node: Option<u32>,
    /// The NICs whose channels' jobs it takes.
    pub nics: Vec<String>,
    /// Its worker threads.
    pub workers: u64,
    /// Whether the plan had no completion worker on the node (its workers share the node's CPUs).
    pub fallback: bool,
    /// Jobs its threads (workers and io_uring thread) executed.
    pub jobs: u64,
}

/// The polling of the network threads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PollReport {
    /// `adaptive`, `sleep` or `spin`.
    pub mode: PollMode,
    /// The configured budget (the most the adaptive one reaches), in microseconds.
    pub budget_us: u64,
    /// Per network thread (`tyched-net0`, `tyched-net1`, ... or the one `tyched-net`).
    pub threads: Vec<PollStats>,
}

/// Counters of the target's limits: each says how often a limit was full, and what happened
/// instead of growth (a REJECT BUSY, a drop, a wait).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LimitStats {
    /// CONNECTs refused with BUSY: `limits.sessions` was full.
    pub busy_sessions: u64,
    /// CONNECTs refused with BUSY: `limits.sessions_per_export` was full.
    pub busy_sessions_per_export: u64,
    /// CONNECTs refused with BUSY: `limits.sessions_per_mac` was full.
    pub busy_sessions_per_mac: u64,
    /// CONNECTs refused with BUSY: `limits.channels_per_session` was full.
    pub busy_channels_per_session: u64,
    /// CONNECTs refused with BUSY: `limits.channels` was full.
    pub busy_channels: u64,
    /// Pending key challenges of one MAC forgotten to make room for that MAC's newer one
    /// (`limits.challenges_per_mac`).
    pub challenges_evicted: u64,
    /// CHALLENGEs not sent because `limits.challenges` live ones were pending (a flood): the
    /// pending ones are kept.
    pub challenges_refused: u64,
    /// Control replies (ACCEPT, REJECT, CHALLENGE, DISCOVER_REPLY) dropped because their NIC's
    /// queue held `limits.control_queue` already.
    pub control_dropped: u64,
    /// `damq` slot memory held now, in bytes (at most `limits.slot_memory`).
    pub slot_memory_bytes: u64,
    /// Times slot memory was wanted and `limits.slot_memory` was reached: a read waited for
    /// memory, or a copied write failed with an I/O error.
    pub slot_memory_waits: u64,
    /// Log lines left out by the rate limit on warnings a peer can cause.
    pub warnings_suppressed: u64,
    /// Sessions ended because handling them hit a bug (a panic, contained to that session).
    pub sessions_failed: u64,
}

impl Snapshot {
    /// Sum of a drop counter over every NIC.
    pub fn drops(&self, f: impl Fn(&Drops) -> u64) -> u64 {
        self.nics.iter().map(|n| f(&n.drops)).sum()
    }

    /// A human-readable rendering.
    pub fn human(&self) -> String {
        let mut s = String::new();
        self.human_summary(&mut s);
        self.human_nics_and_exports(&mut s);
        self.human_placement(&mut s);
        self.human_storage(&mut s);
        self.human_channels(&mut s);
        s
    }

    /// The first lines: uptime, sessions, reloads, polling.
    fn human_summary(&self, s: &mut String) {
        use std::fmt::Write;
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
        if self.decided_by_home > 0 {
            let _ = writeln!(
                s,
                "re-issued copies decided by their home channel's thread {}  messages between threads' parts {}",
                self.decided_by_home, self.part_messages
            );
        }
        let r = &self.reload;
        if r.applied + r.failed > 0 {
            let _ = writeln!(s, "configuration reloads: {} applied, {} refused", r.applied, r.failed);
            if let Some(e) = &r.last_error {
                let _ = writeln!(s, "  the last reload was refused, nothing changed: {e}");
            }
            for n in &r.needs_restart {
                let _ = writeln!(s, "  needs a restart: {n}");
            }
        }
        let p = &self.poll;
        let _ = writeln!(s, "{}", tyche_runtime::poll::summary(p.mode, p.budget_us, &p.threads));
    }

    /// Each NIC's traffic and drops, each export's requests and holders.
    fn human_nics_and_exports(&self, s: &mut String) {
        use std::fmt::Write;
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
                "  {:<12} {} {} B{}{}  sessions {}  read {} ({} B) write {} ({} B) flush {} discard {} write-zeroes {} block-status {}  errors {} denied {}",
                e.name, e.backend, e.size, if e.read_only { " ro" } else { "" }, if e.keyed { " keyed" } else { "" },
                e.sessions, r.read, e.bytes_read, r.write, e.bytes_written, r.flush, r.discard, r.write_zeroes,
                r.block_status, e.errors, e.denied
            );
            for h in &e.holders {
                let _ = writeln!(
                    s,
                    "    held by {} (host {}), session {}, {} channel(s)",
                    h.mac, h.host, h.session, h.channels
                );
            }
        }
    }

    /// Where each NIC's memory and thread are.
    fn human_placement(&self, s: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(s, "\nPlacement (pages on the NIC's node / elsewhere / not present):");
        let pc = |c: &PageCounts| format!("{}/{}/{}", c.on_expected, c.elsewhere, c.not_present);
        for p in &self.placement {
            let _ = writeln!(
                s,
                "  {:<10} node {}  umem {}  rings {}  slots {}  thread {} cpus {:?} (nodes {:?})",
                p.nic,
                p.node.map_or("unknown".into(), |n| n.to_string()),
                pc(&p.umem),
                pc(&p.rings),
                pc(&p.slots),
                p.thread.name,
                p.thread.cpus,
                p.thread.nodes
            );
        }
    }

    /// The storage queues and threads, and the NICs' interrupts.
    fn human_storage(&self, s: &mut String) {
        use std::fmt::Write;
        if !self.storage_threads.is_empty() {
            let node = |n: Option<u32>| n.map_or("none".into(), |n| n.to_string());
            let _ = writeln!(s, "\nStorage (a queue per node; jobs executed):");
            for q in &self.storage_queues {
                let _ = writeln!(
                    s,
                    "  node {:<5} nics {:?}  workers {}{}  jobs {}",
                    node(q.node),
                    q.nics,
                    q.workers,
                    if q.fallback { " (fallback: the node's cpus)" } else { "" },
                    q.jobs
                );
            }
            for t in &self.storage_threads {
                let _ = writeln!(
                    s,
                    "  {:<14} {:<8} node {:<5} planned cpus {:?}  runs on cpus {:?} (nodes {:?})  jobs {}",
                    t.name,
                    t.kind,
                    node(t.node),
                    t.planned_cpus,
                    t.thread.cpus,
                    t.thread.nodes,
                    t.jobs
                );
            }
        }
        if !self.irqs.is_empty() {
            let _ = writeln!(s, "\nInterrupts (IRQ -> cpus):");
            for r in &self.irqs {
                let _ = writeln!(s, "  {:<10} {}", r.nic, r.describe());
            }
        }
    }

    /// Each channel's traffic.
    fn human_channels(&self, s: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(s, "\nChannels:");
        for c in &self.channels {
            let _ = writeln!(
                s,
                "  session {:016x} ch {} {} on {} ({}) from {}{}  {}  tx {} frames {} B  rx {} frames {} B  retransmits {} (timer {}, spurious {})  executing {}  drops {:?}",
                c.session, c.channel, c.export, c.nic, c.addr, c.peer, if c.dead { " (dead)" } else { "" }, c.protection, c.frames_tx,
                c.payload_tx, c.frames_rx, c.payload_rx, c.retransmits, c.timeouts, c.spurious_timeouts, c.executing, c.drops
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn prometheus_label_values_are_escaped() {
        let mut s = super::Snapshot::default();
        s.exports.push(super::ExportStats { name: "a\"b\\c".into(), ..Default::default() });
        let text = s.prometheus();
        assert!(text.contains("tyched_export_errors_total{export=\"a\\\"b\\\\c\"} 0\n"), "{text}");
        s.exports[0].name = "x\ny".into();
        assert!(s.prometheus().contains("tyched_export_errors_total{export=\"x\\ny\"} 0\n"));
    }
}
