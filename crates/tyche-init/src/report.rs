//! What `tyche-init stats` shows: the session's counters, per channel payload bytes, and where
//! each link's memory and the threads serving it are (measured, not planned: pages by
//! `move_pages(2)`, affinities by the threads themselves).

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tyche_numa::{PageCounts, ThreadPlacement};
use tyche_runtime::poll::{PollMode, PollStats};

/// One channel of the session.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelReport {
    /// Channel index (a reconnected channel gets a new one).
    pub channel: u16,
    /// Link (NIC) it runs on.
    pub link: String,
    /// The target address its frames go to: the one the ACCEPT named (a target steering each
    /// channel to a NIC queue of its own), else the target's address on the link.
    #[serde(default)]
    pub target: String,
    /// NUMA node it was placed on: its NIC's node (`None`: unknown).
    pub node: Option<u32>,
    /// Whether it is alive.
    pub live: bool,
    /// Payload bytes sent (write data; retransmissions included).
    pub payload_tx: u64,
    /// Payload bytes received (read data placed).
    pub payload_rx: u64,
    /// Frames sent.
    pub frames_tx: u64,
    /// Frames received.
    pub frames_rx: u64,
    /// Retransmissions.
    pub retransmits: u64,
    /// Retransmission timer expiries.
    #[serde(default)]
    pub timeouts: u64,
    /// Of which spurious (delayed frames, not lost ones: only the oldest was resent).
    #[serde(default)]
    pub spurious_timeouts: u64,
    /// The thread serving it (the engine thread), as it sees itself.
    pub thread: ThreadPlacement,
}

/// Where one link's memory is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkReport {
    /// Link (interface) name.
    pub name: String,
    /// NUMA node of the NIC, as the transport placed its memory.
    pub node: Option<u32>,
    /// Frame memory (AF_XDP UMEM), page by page, against `node`.
    pub umem: PageCounts,
    /// Rings (AF_XDP fill, completion, RX, TX), page by page, against `node`.
    pub rings: PageCounts,
    /// The thread serving the link (the engine thread), as it sees itself.
    pub thread: ThreadPlacement,
}

/// One NBD connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NbdConnReport {
    /// Connection number, in accept order (from 1).
    pub conn: u64,
    /// NUMA node the connection is served for (`None`: any).
    pub node: Option<u32>,
    /// Whether it is still open.
    pub open: bool,
    /// The thread serving it, as it sees itself.
    pub thread: ThreadPlacement,
    /// Bytes written through it.
    pub bytes_written: u64,
    /// Bytes read through it.
    pub bytes_read: u64,
    /// Its request buffers (write data and read data), page by page against `node`, asked of
    /// the kernel for every request.
    pub buffers: PageCounts,
    /// Payload bytes the connection copied in user space (write data taken from its read
    /// buffer, read data of hole-aware reads gathered into reply chunks).
    #[serde(default)]
    pub payload_copied_bytes: u64,
    /// The part of `payload_copied_bytes` that is write data.
    #[serde(default)]
    pub payload_copied_write_bytes: u64,
}

/// Frames the open channels refused, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    /// Bad or missing tags on a keyed export (forged or altered frames).
    pub unauthenticated: u64,
    /// Replays on a keyed export.
    pub replayed: u64,
    /// DATA frames with a wrong CRC32C (feature DIGEST).
    pub bad_digest: u64,
}

/// How requests reached the channels (`--send-mode`), see [`crate::SendMode`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendCounters {
    /// The send mode (`inline` or `queue`).
    pub mode: String,
    /// Requests the thread that had them submitted and sent itself.
    pub inline: u64,
    /// Requests handed to an engine thread over a queue.
    pub handed_over: u64,
    /// Inline submissions whose frames an engine thread sent after all.
    pub inline_fallbacks: u64,
    /// Engine threads rung after an inline send because their links cannot wake them.
    pub inline_wakes: u64,
}

/// Everything `tyche-init stats` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Export name.
    pub export: String,
    /// Session id.
    pub session: u64,
    /// Channel scheduler (`affinity` or `round-robin`).
    pub scheduler: String,
    /// Channels open now.
    pub live_channels: usize,
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
    /// Payload bytes copied in user space, by the engine threads (into and out of frames, and
    /// between engine threads) and by the NBD server (every connection, closed ones included):
    /// docs/tyche-init.md, "Copies".
    #[serde(default)]
    pub payload_copied_bytes: u64,
    /// The part of `payload_copied_bytes` that is write data.
    #[serde(default)]
    pub payload_copied_write_bytes: u64,
    /// Frames refused as forged or altered, replayed, or with a bad digest (open channels).
    #[serde(default)]
    pub refused: Refused,
    /// Per channel.
    pub channels: Vec<ChannelReport>,
    /// Per link.
    pub links: Vec<LinkReport>,
    /// Per NBD connection (empty for other front ends).
    pub nbd: Vec<NbdConnReport>,
    /// How the engine threads wait for work (`--poll`).
    #[serde(default)]
    pub poll_mode: PollMode,
    /// The configured poll budget (`--poll-budget-us`), in microseconds.
    #[serde(default)]
    pub poll_budget_us: u64,
    /// Polling counters per engine thread.
    #[serde(default)]
    pub poll: Vec<PollStats>,
    /// Per interface: its IRQs, the CPUs they land on, and how many share a core with the
    /// engine thread serving it (`none (virtual NIC)` for veth).
    #[serde(default)]
    pub irqs: Vec<tyche_numa::IrqReport>,
    /// Where the channel scheduler falls back when a node has no usable channel: `model`
    /// (bandwidth classes), `distances` or `id`.
    #[serde(default)]
    pub fallback: String,
    /// Requests sent inline and handed over.
    #[serde(default)]
    pub send: SendCounters,
}

/// An attachment's health, as `tyche-init list` shows it and `tyche_init_health` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Every link has a live channel.
    Live,
    /// Some links have no live channel.
    Degraded,
    /// No link has a live channel (requests wait, then fail after `--no-path-timeout`).
    NoPath,
    /// A ublk device whose serving process died, waiting for `attach --recover`.
    AwaitingRecovery,
    /// The serving process does not answer for its session.
    Unknown,
}

impl Health {
    /// Every value, in the order `tyche_init_health` lists them.
    pub const ALL: [Health; 5] =
        [Health::Live, Health::Degraded, Health::NoPath, Health::AwaitingRecovery, Health::Unknown];

    /// The name `list` prints (`live`, `degraded`, `no-path`, `awaiting-recovery`, `unknown`).
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Live => "live",
            Health::Degraded => "degraded",
            Health::NoPath => "no-path",
            Health::AwaitingRecovery => "awaiting-recovery",
            Health::Unknown => "unknown",
        }
    }
}

/// Which links of a session have a live channel: each link with a channel, in the order of its
/// first channel, and whether any of its channels is live.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Paths {
    /// (link name, has a live channel).
    pub links: Vec<(String, bool)>,
    /// Channels.
    pub channels: usize,
    /// Channels open now.
    pub live_channels: usize,
}

impl Paths {
    /// Links with at least one live channel.
    pub fn live_links(&self) -> usize {
        self.links.iter().filter(|(_, live)| *live).count()
    }

    /// Live when every link has a live channel, degraded when some have, else no-path.
    pub fn health(&self) -> Health {
        match self.live_links() {
            0 => Health::NoPath,
            k if k < self.links.len() => Health::Degraded,
            _ => Health::Live,
        }
    }
}

impl Report {
    /// Which links have a live channel, and the health that makes.
    pub fn paths(&self) -> Paths {
        let mut links: Vec<(String, bool)> = Vec::new();
        for c in &self.channels {
            match links.iter_mut().find(|(n, _)| *n == c.link) {
                Some(e) => e.1 |= c.live,
                None => links.push((c.link.clone(), c.live)),
            }
        }
        Paths { links, channels: self.channels.len(), live_channels: self.channels.iter().filter(|c| c.live).count() }
    }

    /// A human-readable rendering.
    pub fn human(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let node = |n: Option<u32>| n.map_or("unknown".to_owned(), |n| n.to_string());
        let pc = |c: &PageCounts| format!("{}/{}/{}", c.on_expected, c.elsewhere, c.not_present);
        let _ = writeln!(
            s,
            "export {}  session {:#x}  scheduler {}  live channels {}  completed {} failed {}  read {} B  written {} B  reconnects {}  refused: unauthenticated {} replayed {} bad digest {}",
            self.export, self.session, self.scheduler, self.live_channels, self.completed, self.failed,
            self.bytes_read, self.bytes_written, self.reconnects, self.refused.unauthenticated, self.refused.replayed,
            self.refused.bad_digest
        );
        let _ = writeln!(
            s,
            "payload copied in user space {} B (write data {} B)",
            self.payload_copied_bytes, self.payload_copied_write_bytes
        );
        let _ = writeln!(
            s,
            "send mode {}: {} sent inline, {} handed over, {} inline fallbacks, {} inline wakes",
            self.send.mode, self.send.inline, self.send.handed_over, self.send.inline_fallbacks, self.send.inline_wakes
        );
        let _ = writeln!(s, "\nChannels:");
        for c in &self.channels {
            let _ = writeln!(
                s,
                "  ch {:<3} {:<12} target {} node {:<7} {}  payload tx {} B rx {} B  frames tx {} rx {}  retransmits {} (timer {}, spurious {})  thread {} cpus {:?}",
                c.channel, c.link, c.target, node(c.node), if c.live { "live" } else { "dead" }, c.payload_tx, c.payload_rx,
                c.frames_tx, c.frames_rx, c.retransmits, c.timeouts, c.spurious_timeouts, c.thread.name, c.thread.cpus
            );
        }
        let _ = writeln!(s, "\nLinks (pages on the NIC's node / elsewhere / not present):");
        for l in &self.links {
            let _ = writeln!(
                s,
                "  {:<12} node {:<7} umem {}  rings {}  thread {} cpus {:?} (nodes {:?})",
                l.name,
                node(l.node),
                pc(&l.umem),
                pc(&l.rings),
                l.thread.name,
                l.thread.cpus,
                l.thread.nodes
            );
        }
        if !self.irqs.is_empty() {
            let _ = writeln!(s, "\nInterrupts (IRQ -> cpus):");
            for r in &self.irqs {
                let _ = writeln!(s, "  {:<10} {}", r.nic, r.describe());
            }
        }
        if !self.fallback.is_empty() {
            let _ = writeln!(s, "\nChannel fallback order: by {}", self.fallback);
        }
        let _ = writeln!(s, "\n{}", tyche_runtime::poll::summary(self.poll_mode, self.poll_budget_us, &self.poll));
        if !self.nbd.is_empty() {
            let _ = writeln!(s, "\nNBD connections (buffer pages on the connection's node / elsewhere / not present):");
            for c in &self.nbd {
                let _ = writeln!(
                    s,
                    "  conn {:<3} node {:<7} {}  written {} B read {} B  copied {} B  buffers {}  thread {} cpus {:?}",
                    c.conn,
                    node(c.node),
                    if c.open { "open" } else { "closed" },
                    c.bytes_written,
                    c.bytes_read,
                    c.payload_copied_bytes,
                    pc(&c.buffers),
                    c.thread.name,
                    c.thread.cpus
                );
            }
        }
        s
    }
}

/// Closed NBD connections whose reports are kept (the oldest are forgotten first).
const CLOSED_KEPT: usize = 64;

/// The NBD server's per-connection reports, shared with whoever serves `tyche-init stats`:
/// every open connection and the last [`CLOSED_KEPT`] closed ones, and the server's copy
/// counters (every connection's, forgotten ones included).
#[derive(Debug, Clone, Default)]
pub struct NbdStats(Arc<Mutex<NbdConns>>);

/// What [`NbdStats`] shares.
#[derive(Debug, Default)]
struct NbdConns {
    conns: std::collections::BTreeMap<u64, NbdConnReport>,
    /// Payload bytes copied by every connection, and of them write data.
    copied: u64,
    copied_write: u64,
}

impl NbdStats {
    /// A copy of every connection's report, in accept order.
    pub fn snapshot(&self) -> Vec<NbdConnReport> {
        self.0.lock().map(|v| v.conns.values().cloned().collect()).unwrap_or_default()
    }

    /// Payload bytes every connection the server had copied, and the part that is write data.
    pub fn copied(&self) -> (u64, u64) {
        self.0.lock().map(|v| (v.copied, v.copied_write)).unwrap_or_default()
    }

    /// Counts `bytes` copied by connection `key` (`write`: write data).
    pub(crate) fn add_copied(&self, key: u64, bytes: u64, write: bool) {
        if bytes == 0 {
            return;
        }
        if let Ok(mut v) = self.0.lock() {
            let w = if write { bytes } else { 0 };
            v.copied += bytes;
            v.copied_write += w;
            if let Some(r) = v.conns.get_mut(&key) {
                r.payload_copied_bytes += bytes;
                r.payload_copied_write_bytes += w;
            }
        }
    }

    /// Registers a connection; returns its key for [`NbdStats::update`].
    pub(crate) fn add(&self, r: NbdConnReport) -> u64 {
        let mut v = self.0.lock().expect("nbd stats lock");
        let closed: Vec<u64> = v.conns.values().filter(|c| !c.open).map(|c| c.conn).collect();
        for k in closed.iter().take(closed.len().saturating_sub(CLOSED_KEPT)) {
            v.conns.remove(k);
        }
        let key = r.conn;
        v.conns.insert(key, r);
        key
    }

    /// Changes the report of connection `key`.
    pub(crate) fn update(&self, key: u64, f: impl FnOnce(&mut NbdConnReport)) {
        if let Ok(mut v) = self.0.lock() {
            if let Some(r) = v.conns.get_mut(&key) {
                f(r);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_nbd_connections_are_forgotten_oldest_first() {
        let s = NbdStats::default();
        for n in 1..=100 {
            let k = s.add(NbdConnReport { conn: n, open: true, ..Default::default() });
            if n != 3 {
                s.update(k, |r| r.open = false);
            }
        }
        let all = s.snapshot();
        assert!(all.iter().any(|c| c.conn == 3 && c.open), "open connections stay");
        assert!(all.len() <= CLOSED_KEPT + 2, "{}", all.len());
        assert_eq!(all.last().map(|c| c.conn), Some(100));
        assert!(all.windows(2).all(|w| w[0].conn < w[1].conn), "accept order");
    }
}
