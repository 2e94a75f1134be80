//! Snapshots and counters: each network thread's counters ([`Counters`]) and the piece of a
//! [`Snapshot`] it publishes when asked and when it exits ([`Piece`]: its NICs, its channels,
//! its storage and slot memory), and the snapshot made of every thread's piece and the
//! control's counters ([`merge`]), with the placement report (where each NIC's memory and slot
//! memory are, and which thread serves it) and what the limits refused or held back.

use std::sync::atomic::Ordering;

use tyche_channel::{DropReason, Instant};
use tyche_runtime::poll::{PollConfig, PollStats};

use crate::backend::FileBackend;
use crate::stats::{
    ChannelSnapshot, Drops, ExportStats, Holder, LimitStats, NicPlacement, NicStats, PollReport, Snapshot,
    StorageQueueStats, StorageThreadStats,
};

use super::control::Control;
use super::network::drop_name;
use super::{Network, PEER_LOGS};

/// A network thread's counters (the per-NIC ones are in each NIC's state, those of the slot
/// table and storage with them).
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// Per export: requests, bytes and errors of this thread's channels.
    pub(super) exports: Vec<ExportStats>,
    /// What the limits refused or held back here (`control_dropped`, `sessions_failed`).
    pub(super) limits: LimitStats,
    /// Payload bytes copied in user space.
    pub(super) payload_copied: u64,
    /// The part of `payload_copied` on the write path.
    pub(super) payload_copied_write: u64,
    /// Duplicates suppressed by parts that are gone.
    pub(super) duplicates_from_reclaimed: u64,
    /// Copies decided by their home's part, of parts that are gone.
    pub(super) decided_from_reclaimed: u64,
    /// Messages this thread's parts sent other threads' parts.
    pub(super) part_messages: u64,
}

/// What one network thread contributes to a snapshot.
#[derive(Debug, Clone, Default)]
pub(super) struct Piece {
    /// Its NICs: (index, counters, placement).
    nics: Vec<(usize, NicStats, NicPlacement)>,
    channels: Vec<ChannelSnapshot>,
    /// Per export: requests, bytes, errors.
    exports: Vec<ExportStats>,
    payload_copied: u64,
    payload_copied_write: u64,
    leases_held: u64,
    storage_inflight: u64,
    storage_timeouts: u64,
    duplicates: u64,
    decided_by_home: u64,
    part_messages: u64,
    limits: LimitStats,
    poll: PollStats,
    stopping: bool,
    storage_threads: Vec<StorageThreadStats>,
    storage_queues: Vec<StorageQueueStats>,
}

impl Network {
    /// Publishes this thread's piece if a snapshot was asked for since its last.
    pub(super) fn publish_if_requested(&mut self, now: Instant) {
        let want = self.shared.stats_requested.load(Ordering::SeqCst);
        if want > self.published {
            self.publish(now, want);
        }
    }

    /// Publishes this thread's piece as generation `generation` (`u64::MAX`: its last).
    pub(super) fn publish(&mut self, now: Instant, generation: u64) {
        let piece = self.piece(now);
        let mut pieces = self.shared.pieces.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        pieces[self.g] = Some((generation, piece));
        self.published = generation;
        self.shared.published.notify_all();
    }

    /// This thread's piece of a snapshot.
    pub(super) fn piece(&self, now: Instant) -> Piece {
        let mut dups = self.counters.duplicates_from_reclaimed;
        let mut decided_by_home = self.counters.decided_from_reclaimed;
        for s in self.sessions.values() {
            dups += s.session.duplicates_suppressed();
            decided_by_home += s.session.forwarded();
        }
        let channels = self.channel_snapshots();
        let storage = &self.storage;
        let _ = now;
        Piece {
            nics: self.placement(&channels),
            channels,
            exports: self.counters.exports.clone(),
            payload_copied: self.counters.payload_copied,
            payload_copied_write: self.counters.payload_copied_write,
            leases_held: self.slots.leases_held(),
            storage_inflight: storage.inflight,
            storage_timeouts: storage.timeouts,
            duplicates: dups,
            decided_by_home,
            part_messages: self.counters.part_messages,
            limits: LimitStats {
                slot_memory_bytes: self.slots.bytes(),
                slot_memory_waits: self.slots.memory_waits(),
                ..self.counters.limits
            },
            poll: self.poll_stats,
            stopping: self.stopping.is_some(),
            storage_threads: storage.threads.iter().map(|t| t.snapshot()).collect(),
            storage_queues: storage
                .queue_stats
                .iter()
                .enumerate()
                .map(|(q, sq)| StorageQueueStats {
                    workers: storage.threads.iter().filter(|t| t.queue == q && t.kind == "worker").count() as u64,
                    jobs: storage.threads.iter().filter(|t| t.queue == q).map(|t| t.jobs()).sum(),
                    ..sq.clone()
                })
                .collect(),
        }
    }

    /// This thread's NICs: counters, where their memory is, and which CPUs this (the serving)
    /// thread may use.
    fn placement(&self, channels: &[ChannelSnapshot]) -> Vec<(usize, NicStats, NicPlacement)> {
        self.nics
            .iter()
            .enumerate()
            .filter(|(_, n)| n.served_by == self.g)
            .map(|(k, n)| {
                let node = n.node;
                let mut p = NicPlacement {
                    nic: n.stats.name.clone(),
                    node,
                    thread: self.thread_of(k),
                    umem: tyche_numa::PageCounts { expected_node: node, ..Default::default() },
                    rings: tyche_numa::PageCounts { expected_node: node, ..Default::default() },
                    slots: tyche_numa::PageCounts { expected_node: node, ..Default::default() },
                };
                for a in &n.areas {
                    let Ok(c) = tyche_numa::report::count_area(a.addr, a.len, node) else { continue };
                    match a.what {
                        "umem" => p.umem.add(&c),
                        _ => p.rings.add(&c),
                    }
                }
                for c in channels.iter().filter(|c| c.nic == p.nic) {
                    p.slots.add(&c.slots);
                }
                (k, n.stats.clone(), p)
            })
            .collect()
    }

    /// The thread serving NIC `k` (the calling thread until that one has reported itself).
    fn thread_of(&self, k: usize) -> tyche_numa::report::ThreadPlacement {
        self.nics.get(k).and_then(|n| n.thread.clone()).unwrap_or_else(tyche_numa::report::this_thread)
    }

    /// Every channel of this thread's parts, as the snapshot shows it.
    fn channel_snapshots(&self) -> Vec<ChannelSnapshot> {
        let mut channels = Vec::new();
        for (&sid, s) in &self.sessions {
            for (&ch, &k) in &s.nic_of {
                let Some(c) = s.session.channel(ch) else { continue };
                let cs = c.stats();
                let drops = DropReason::ALL
                    .iter()
                    .zip(cs.dropped)
                    .filter(|(_, n)| *n > 0)
                    .map(|(r, n)| (drop_name(*r), n))
                    .collect();
                let node = self.nics[k].node;
                channels.push(ChannelSnapshot {
                    session: sid,
                    channel: ch,
                    export: self.exports[s.meta.export].spec.name.clone(),
                    nic: self.nics[k].stats.name.clone(),
                    peer: c.envelope().dst.to_string(),
                    addr: c.envelope().src.to_string(),
                    dead: c.dead().is_some(),
                    frames_tx: cs.frames_tx,
                    frames_rx: cs.frames_rx,
                    payload_tx: cs.payload_tx,
                    payload_rx: cs.payload_rx,
                    retransmits: cs.retransmits,
                    timeouts: cs.timeouts,
                    spurious_timeouts: cs.spurious_timeouts,
                    drops,
                    executing: s.executing.get(&ch).copied().unwrap_or(0),
                    node,
                    slots: self.slots.pages(sid, ch, s.epoch(ch), node),
                    thread: self.thread_of(k),
                    protection: c.protection().to_owned(),
                });
            }
        }
        channels
    }
}

/// An initiator's identity as `tyched stats` shows it: its host id in hexadecimal, or `mac:`
/// and the MAC for an identity made from the MAC (an initiator that sent no host id).
fn host_of(identity: &[u8; 16]) -> String {
    match identity.strip_prefix(b"mac:") {
        Some(rest) if rest[6..].iter().all(|&b| b == 0) => {
            format!("mac:{}", rest[..6].iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"))
        }
        _ => identity.iter().map(|b| format!("{b:02x}")).collect(),
    }
}

/// The snapshot made of the threads' pieces (those there are) and the control's counters, at
/// `now`, the threads polling as `poll` says.
pub(super) fn merge(ctl: &Control, pieces: &[Piece], poll: PollConfig, now: Instant) -> Snapshot {
    let mut nics: Vec<(usize, NicStats, NicPlacement)> = pieces.iter().flat_map(|p| p.nics.iter().cloned()).collect();
    nics.sort_by_key(|n| n.0);
    let exports = export_stats(ctl, pieces);
    let sum = |f: fn(&Piece) -> u64| pieces.iter().map(f).sum::<u64>();
    let limits = limit_stats(ctl, pieces);
    let first = pieces.first();
    Snapshot {
        uptime_ms: now.as_nanos() / 1_000_000,
        stopping: pieces.iter().any(|p| p.stopping),
        sessions: ctl.admission.sessions().len() as u64,
        sessions_reclaimed: ctl.reclaimed,
        payload_copied_bytes: sum(|p| p.payload_copied),
        storage_timeouts: sum(|p| p.storage_timeouts),
        sessions_fenced: ctl.fenced,
        payload_copied_write_bytes: sum(|p| p.payload_copied_write),
        leases_held: sum(|p| p.leases_held),
        storage_inflight: sum(|p| p.storage_inflight),
        duplicates_suppressed: sum(|p| p.duplicates),
        decided_by_home: sum(|p| p.decided_by_home),
        part_messages: sum(|p| p.part_messages),
        placement: nics.iter().map(|n| n.2.clone()).collect(),
        nics: nics.into_iter().map(|n| n.1).collect(),
        exports,
        // A thread's piece can predate a reclaim the control made since (the Forget is on its
        // way to the thread): only channels of sessions the registry still holds, so that the
        // snapshot agrees with itself (`sessions` 0 and a channel listed, otherwise).
        channels: pieces
            .iter()
            .flat_map(|p| p.channels.iter())
            .filter(|c| ctl.admission.session(c.session).is_some())
            .cloned()
            .collect(),
        // Read by the daemon's stats source (tyched's main), not the engine.
        irqs: Vec::new(),
        limits,
        storage_threads: first.map(|p| p.storage_threads.clone()).unwrap_or_default(),
        storage_queues: first.map(|p| p.storage_queues.clone()).unwrap_or_default(),
        poll: PollReport {
            mode: poll.mode,
            budget_us: poll.budget.as_micros() as u64,
            threads: pieces.iter().map(|p| p.poll).collect(),
        },
        reload: ctl.reload.clone(),
    }
}

/// Each export's counters (the threads' pieces summed) and holders.
fn export_stats(ctl: &Control, pieces: &[Piece]) -> Vec<ExportStats> {
    let mut exports: Vec<ExportStats> = ctl
        .exports
        .iter()
        .enumerate()
        .map(|(i, e)| ExportStats {
            name: e.spec.name.clone(),
            backend: e.backend.kind().into(),
            size: e.spec.size,
            read_only: e.read_only,
            keyed: e.key.is_some(),
            io: if e.uring {
                "io_uring"
            } else if e.backend.kind() == "ram" {
                "inline"
            } else {
                "threads"
            }
            .into(),
            denied: ctl.denied.get(i).copied().unwrap_or(0),
            direct_bytes: e.backend.as_file().map_or(0, FileBackend::direct_bytes),
            ..ExportStats::default()
        })
        .collect();
    for p in pieces {
        for (es, pe) in exports.iter_mut().zip(&p.exports) {
            es.requests.add(&pe.requests);
            es.bytes_read += pe.bytes_read;
            es.bytes_written += pe.bytes_written;
            es.fua_writes += pe.fua_writes;
            es.errors += pe.errors;
        }
    }
    for e in ctl.admission.sessions().values() {
        if let Some(es) = exports.get_mut(e.export) {
            es.sessions += 1;
            es.holders.push(Holder {
                session: format!("{:#x}", e.data.meta.id),
                mac: e.mac.to_string(),
                host: host_of(&e.identity),
                channels: e.channels.values().filter(|c| !c.data.dead.load(Ordering::Relaxed)).count(),
            });
        }
    }
    for es in &mut exports {
        es.holders.sort_by(|a, b| a.session.cmp(&b.session));
    }
    exports
}

/// The limits' counters: the acceptor's and the challenges', and the threads' summed.
fn limit_stats(ctl: &Control, pieces: &[Piece]) -> LimitStats {
    let busy = ctl.admission.acceptor.busy();
    let mut limits = LimitStats {
        busy_sessions: busy.sessions,
        busy_sessions_per_export: busy.sessions_per_export,
        busy_sessions_per_mac: busy.sessions_per_mac,
        busy_channels_per_session: busy.channels_per_session,
        busy_channels: busy.channels,
        challenges_evicted: ctl.admission.challenges.evicted,
        challenges_refused: ctl.admission.challenges.refused,
        warnings_suppressed: PEER_LOGS.suppressed(),
        ..LimitStats::default()
    };
    for p in pieces {
        limits.control_dropped += p.limits.control_dropped;
        limits.sessions_failed += p.limits.sessions_failed;
        limits.slot_memory_bytes += p.limits.slot_memory_bytes;
        limits.slot_memory_waits += p.limits.slot_memory_waits;
    }
    limits
}

impl Drops {
    /// Sum of the channel drop counters.
    pub fn channel_total(&self) -> u64 {
        self.channel.values().sum()
    }

    /// Adds `other`'s counts.
    pub(crate) fn add(&mut self, other: &Drops) {
        self.malformed += other.malformed;
        self.unknown_session += other.unknown_session;
        self.not_ours += other.not_ours;
        for (k, v) in &other.channel {
            *self.channel.entry(k.clone()).or_default() += v;
        }
        self.slot_busy += other.slot_busy;
        self.denied_mac += other.denied_mac;
        self.denied_key += other.denied_key;
        self.shutting_down += other.shutting_down;
    }
}
