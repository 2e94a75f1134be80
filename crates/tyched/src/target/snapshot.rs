//! Snapshots and counters: the target-wide counters the engine keeps ([`Counters`]), the
//! [`Snapshot`] it publishes when asked (and at shutdown), with each channel's state, the
//! placement report (where each NIC's memory and slot memory are, and which thread serves it)
//! and what the limits refused or held back.

use std::sync::atomic::Ordering;

use tyche_channel::{DropReason, Instant};

use crate::backend::FileBackend;
use crate::stats::{
    ChannelSnapshot, Drops, ExportStats, LimitStats, NicPlacement, PollReport, Snapshot, StorageQueueStats,
};

use super::network::drop_name;
use super::{Network, PEER_LOGS};

/// Target-wide counters (the per-NIC ones are in each NIC's state, those of the slot table,
/// the challenges and storage with them).
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// Per export.
    pub(super) exports: Vec<ExportStats>,
    /// What the limits refused or held back (the slot table's and the challenges' own counts
    /// are added in [`Network::limit_snapshot`]).
    pub(super) limits: LimitStats,
    /// Payload bytes copied in user space.
    pub(super) payload_copied: u64,
    /// The part of `payload_copied` on the write path.
    pub(super) payload_copied_write: u64,
    /// Sessions reclaimed.
    pub(super) reclaimed: u64,
    /// Duplicates suppressed by sessions that are gone.
    pub(super) duplicates_from_reclaimed: u64,
    /// Of reclaimed sessions: copies decided by their home's part, messages between parts.
    pub(super) forwarding_from_reclaimed: (u64, u64),
    /// Sessions fenced by a new attachment of the same initiator.
    pub(super) fenced: u64,
}

impl Network {
    /// Publishes a snapshot if one was asked for since the last.
    pub(super) fn publish_if_requested(&mut self, now: Instant) {
        let want = self.shared.stats_requested.load(Ordering::SeqCst);
        if self.shared.snapshot.lock().expect("snapshot lock").0 >= want {
            return;
        }
        self.publish(now, want);
    }

    /// Publishes a snapshot as generation `generation` (`u64::MAX`: the last one).
    pub(super) fn publish(&self, now: Instant, generation: u64) {
        let snap = self.snapshot(now);
        let mut g = self.shared.snapshot.lock().expect("snapshot lock");
        g.0 = generation;
        g.1 = snap;
        self.shared.published.notify_all();
    }

    /// Where each NIC's memory is and which CPUs this (the serving) thread may use.
    fn placement(&self, channels: &[ChannelSnapshot]) -> Vec<NicPlacement> {
        self.nics
            .iter()
            .enumerate()
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
                p
            })
            .collect()
    }

    /// The thread serving NIC `k` (the calling thread until that one has reported itself).
    fn thread_of(&self, k: usize) -> tyche_numa::report::ThreadPlacement {
        self.nics.get(k).and_then(|n| n.thread.clone()).unwrap_or_else(tyche_numa::report::this_thread)
    }

    /// Every channel of every session, as the snapshot shows it.
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
                    export: self.exports[s.export].spec.name.clone(),
                    nic: self.nics[k].stats.name.clone(),
                    peer: c.envelope().dst.to_string(),
                    addr: c.envelope().src.to_string(),
                    dead: c.dead().is_some(),
                    frames_tx: cs.frames_tx,
                    frames_rx: cs.frames_rx,
                    payload_tx: cs.payload_tx,
                    payload_rx: cs.payload_rx,
                    retransmits: cs.retransmits,
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

    /// The counters now.
    pub(super) fn snapshot(&self, now: Instant) -> Snapshot {
        let mut exports = self.counters.exports.clone();
        for (es, e) in exports.iter_mut().zip(&self.exports) {
            es.direct_bytes = e.backend.as_file().map_or(0, FileBackend::direct_bytes);
        }
        let mut dups = self.counters.duplicates_from_reclaimed;
        let (mut decided_by_home, mut part_messages) = self.counters.forwarding_from_reclaimed;
        for s in self.sessions.values() {
            exports[s.export].sessions += 1;
            dups += s.session.duplicates_suppressed();
            let (f, m) = s.session.forwarding();
            decided_by_home += f;
            part_messages += m;
        }
        let channels = self.channel_snapshots();
        let placement = self.placement(&channels);
        let storage = &self.storage;
        Snapshot {
            uptime_ms: now.as_nanos() / 1_000_000,
            stopping: self.stopping.is_some(),
            sessions: self.sessions.len() as u64,
            sessions_reclaimed: self.counters.reclaimed,
            payload_copied_bytes: self.counters.payload_copied,
            storage_timeouts: storage.timeouts,
            sessions_fenced: self.counters.fenced,
            payload_copied_write_bytes: self.counters.payload_copied_write,
            leases_held: self.slots.leases_held(),
            storage_inflight: storage.inflight,
            duplicates_suppressed: dups,
            decided_by_home,
            part_messages,
            nics: self.nics.iter().map(|n| n.stats.clone()).collect(),
            exports,
            channels,
            placement,
            // Read by the daemon's stats source (tyched's main), not the engine.
            irqs: Vec::new(),
            limits: self.limit_snapshot(),
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
            poll: PollReport {
                mode: self.groups.poll.mode,
                budget_us: self.groups.poll.budget.as_micros() as u64,
                threads: self.groups.poll_stats.clone(),
            },
        }
    }

    /// What the limits refused or held back, and the slot memory held.
    fn limit_snapshot(&self) -> LimitStats {
        let busy = self.acceptor.busy();
        LimitStats {
            busy_sessions: busy.sessions,
            busy_sessions_per_export: busy.sessions_per_export,
            busy_sessions_per_mac: busy.sessions_per_mac,
            busy_channels_per_session: busy.channels_per_session,
            busy_channels: busy.channels,
            challenges_evicted: self.challenges.evicted,
            challenges_refused: self.challenges.refused,
            slot_memory_bytes: self.slots.bytes(),
            slot_memory_waits: self.slots.memory_waits(),
            warnings_suppressed: PEER_LOGS.suppressed(),
            ..self.counters.limits
        }
    }
}

impl Drops {
    /// Sum of the channel drop counters.
    pub fn channel_total(&self) -> u64 {
        self.channel.values().sum()
    }
}
