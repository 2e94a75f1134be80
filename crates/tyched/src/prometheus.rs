//! tyched's counters as Prometheus text: what `GET /metrics` answers (`tyched serve
//! --prometheus-listen ADDR`, served by [`tyche_metrics::MetricsListener`]) and `tyched stats
//! --prometheus` prints.
//!
//! The text is encoded by `prometheus-client` (the Prometheus project's Rust client) in the
//! Prometheus text format 0.0.4, from a custom collector over one [`Snapshot`] taken at scrape
//! time ([`encode`]), with `tyched_build_info`. The endpoint itself (addresses, HTTP, limits,
//! loopback only unless `prometheus_allow_remote`) is `tyche-metrics`'.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tyche_metrics::text::{build_info, family, Labels, MetricType};
use tyche_metrics::MetricsListener;
use tyche_runtime::poll::PollStats;

use crate::stats::{ChannelSnapshot, ExportStats, NicStats};
use crate::Snapshot;

/// Name of the endpoint's thread.
pub const THREAD: &str = "tyched-prom";

/// Answers scrapes on `listener` with a fresh snapshot from `source` each, encoded by
/// [`encode`], until the server is dropped.
pub fn serve(
    listener: MetricsListener,
    source: impl Fn() -> Snapshot + Send + Sync + 'static,
) -> std::io::Result<tyche_metrics::MetricsServer> {
    listener.serve(THREAD, move || encode(&source()))
}

impl Snapshot {
    /// The counters in the Prometheus text exposition format (by prometheus-client; the text
    /// `GET /metrics` answers, [`encode`]).
    pub fn prometheus(&self) -> String {
        encode(self)
    }
}

/// `snapshot` in the Prometheus text exposition format (0.0.4), by prometheus-client: the
/// text `tyched stats --prometheus` prints and `GET /metrics` answers.
pub fn encode(snapshot: &Snapshot) -> String {
    tyche_metrics::text::encode("tyched", SnapshotCollector(snapshot.clone()))
}

/// One snapshot as metric families, encoded when the registry is (at scrape time). Counter
/// names are given without `_total`: prometheus-client appends it.
#[derive(Debug)]
struct SnapshotCollector(Snapshot);

impl Collector for SnapshotCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let (s, enc) = (&self.0, &mut enc);
        daemon(enc, s)?;
        nics(enc, s)?;
        exports(enc, s)?;
        poll(enc, s)?;
        irqs_and_storage(enc, s)?;
        channels(enc, s)?;
        Ok(())
    }
}

/// The daemon's own families: build, uptime, sessions, copies, reloads.
fn daemon(enc: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    use MetricType::{Counter, Gauge};
    let one = |v: u64| vec![(Labels::new(), v)];
    build_info(enc, env!("CARGO_PKG_VERSION"))?;
    // Milliseconds since start: a gauge, so that the name keeps no `_total`.
    family(enc, "uptime_milliseconds", "Time since start.", Gauge, one(s.uptime_ms))?;
    family(enc, "sessions", "Live sessions.", Gauge, one(s.sessions))?;
    family(enc, "sessions_reclaimed", "Sessions reclaimed.", Counter, one(s.sessions_reclaimed))?;
    family(enc, "payload_copied_bytes", "Payload bytes copied in user space.", Counter, one(s.payload_copied_bytes))?;
    family(enc, "storage_inflight", "Storage requests queued or running.", Gauge, one(s.storage_inflight))?;
    let r = &s.reload;
    let reloads =
        vec![(vec![("result", "applied".to_owned())], r.applied), (vec![("result", "refused".to_owned())], r.failed)];
    family(enc, "config_reloads", "Configuration reloads (SIGHUP), by outcome.", Counter, reloads)?;
    family(
        enc,
        "config_last_reload_successful",
        "Whether the last configuration reload was applied (1; also before any) or refused (0).",
        Gauge,
        one(u64::from(r.last_error.is_none())),
    )?;
    family(
        enc,
        "config_changes_need_restart",
        "Changes in the configuration file that the running daemon applies only at its next start.",
        Gauge,
        one(r.needs_restart.len() as u64),
    )?;
    Ok(())
}

/// Per NIC: frames, bytes and drops by reason.
fn nics(enc: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    use MetricType::Counter;
    let nic =
        |f: &dyn Fn(&NicStats) -> u64| s.nics.iter().map(|n| (vec![("nic", n.name.clone())], f(n))).collect::<Vec<_>>();
    family(enc, "nic_rx_frames", "Frames received.", Counter, nic(&|n| n.frames_rx))?;
    family(enc, "nic_rx_bytes", "Bytes received.", Counter, nic(&|n| n.bytes_rx))?;
    family(enc, "nic_tx_frames", "Frames sent.", Counter, nic(&|n| n.frames_tx))?;
    family(enc, "nic_tx_bytes", "Bytes sent.", Counter, nic(&|n| n.bytes_tx))?;
    let mut drops = Vec::new();
    for n in &s.nics {
        let d = &n.drops;
        for (reason, v) in [
            ("malformed", d.malformed),
            ("unknown_session", d.unknown_session),
            ("not_ours", d.not_ours),
            ("slot_busy", d.slot_busy),
            ("denied_mac", d.denied_mac),
            ("denied_key", d.denied_key),
            ("shutting_down", d.shutting_down),
        ] {
            drops.push((vec![("nic", n.name.clone()), ("reason", reason.to_owned())], v));
        }
        for (reason, v) in &d.channel {
            drops.push((vec![("nic", n.name.clone()), ("reason", format!("channel_{reason}"))], *v));
        }
    }
    family(enc, "nic_drops", "Frames dropped, by reason.", Counter, drops)?;
    Ok(())
}

/// Per export: requests by op, bytes, FUA writes, errors, refusals.
fn exports(enc: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    use MetricType::Counter;
    let mut reqs = Vec::new();
    for e in &s.exports {
        let r = &e.requests;
        for (op, v) in [
            ("read", r.read),
            ("write", r.write),
            ("flush", r.flush),
            ("discard", r.discard),
            ("write_zeroes", r.write_zeroes),
            ("block_status", r.block_status),
        ] {
            reqs.push((vec![("export", e.name.clone()), ("op", op.to_owned())], v));
        }
    }
    family(enc, "export_requests", "Requests executed, by op.", Counter, reqs)?;
    let ex = |f: &dyn Fn(&ExportStats) -> u64| {
        s.exports.iter().map(|e| (vec![("export", e.name.clone())], f(e))).collect::<Vec<_>>()
    };
    family(enc, "export_read_bytes", "Bytes read from storage.", Counter, ex(&|e| e.bytes_read))?;
    family(enc, "export_written_bytes", "Bytes written to storage.", Counter, ex(&|e| e.bytes_written))?;
    family(enc, "export_fua_writes", "WRITEs with FUA executed.", Counter, ex(&|e| e.fua_writes))?;
    family(enc, "export_errors", "Requests completed with an error.", Counter, ex(&|e| e.errors))?;
    family(enc, "export_denied", "CONNECTs refused.", Counter, ex(&|e| e.denied))?;
    Ok(())
}

/// Per network thread: the adaptive poller.
fn poll(enc: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    use MetricType::{Counter, Gauge};
    let th = |f: &dyn Fn(&PollStats) -> u64| {
        s.poll.threads.iter().enumerate().map(|(k, t)| (vec![("thread", k.to_string())], f(t))).collect::<Vec<_>>()
    };
    family(enc, "poll_nanoseconds", "Time network threads spent polling.", Counter, th(&|t| t.poll_ns))?;
    family(enc, "poll_hits", "Polls that found work (wake-ups saved).", Counter, th(&|t| t.poll_hits))?;
    family(enc, "poll_misses", "Polls that ran out of budget and slept.", Counter, th(&|t| t.poll_misses))?;
    family(enc, "poll_sleeps", "Sleeps of network threads.", Counter, th(&|t| t.sleeps))?;
    family(enc, "poll_wakeups", "Sleeps that ended in work.", Counter, th(&|t| t.wakeups))?;
    family(enc, "poll_budget_nanoseconds", "The adaptive poll budget now.", Gauge, th(&|t| t.budget_ns))?;
    family(
        enc,
        "poll_contended",
        "Times polling was given up because the thread waited for a CPU.",
        Counter,
        th(&|t| t.contended),
    )?;
    Ok(())
}

/// Per NIC its IRQs, per storage thread its jobs.
fn irqs_and_storage(enc: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    use MetricType::{Counter, Gauge};
    let irq = |f: &dyn Fn(&tyche_numa::IrqReport) -> u64| {
        s.irqs.iter().map(|r| (vec![("nic", r.nic.clone())], f(r))).collect::<Vec<_>>()
    };
    family(enc, "nic_irqs", "IRQs of the interface (0: virtual NIC).", Gauge, irq(&|r| r.irqs.len() as u64))?;
    family(
        enc,
        "nic_irqs_on_network_core",
        "IRQs of the interface delivered on the core of its network thread.",
        Gauge,
        irq(&|r| r.sharing_network_core),
    )?;
    let storage = s
        .storage_threads
        .iter()
        .map(|t| {
            let node = t.node.map_or_else(|| "none".to_owned(), |n| n.to_string());
            (vec![("thread", t.name.clone()), ("node", node)], t.jobs)
        })
        .collect();
    family(
        enc,
        "storage_jobs",
        "Storage jobs executed by a worker or io_uring thread, with its queue's node.",
        Counter,
        storage,
    )?;
    Ok(())
}

/// Per channel: retransmissions, timer expiries and the rest of its counters.
fn channels(enc: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    use MetricType::{Counter, Gauge};
    let ch = |f: &dyn Fn(&ChannelSnapshot) -> u64| {
        s.channels
            .iter()
            .map(|c| {
                let labels = vec![
                    ("session", format!("{:016x}", c.session)),
                    ("channel", c.channel.to_string()),
                    ("nic", c.nic.clone()),
                ];
                (labels, f(c))
            })
            .collect::<Vec<_>>()
    };
    family(enc, "channel_retransmits", "Retransmissions.", Counter, ch(&|c| c.retransmits))?;
    family(enc, "channel_rto_expiries", "Retransmission timer expiries.", Counter, ch(&|c| c.timeouts))?;
    family(
        enc,
        "channel_spurious_rto_expiries",
        "Timer expiries whose frames were delayed, not lost (only the oldest was resent).",
        Counter,
        ch(&|c| c.spurious_timeouts),
    )?;
    family(enc, "channel_executing", "Requests executing.", Gauge, ch(&|c| c.executing))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tyche_metrics::client::get;
    use tyche_metrics::MetricsAddr;

    use super::*;
    use crate::stats::OpCounts;

    /// A snapshot with a row in every family, two NICs, two exports and label values that need
    /// escaping.
    fn sample() -> Snapshot {
        use crate::stats::{ChannelSnapshot, Drops, PollReport};
        let mut channel = std::collections::BTreeMap::new();
        channel.insert("duplicate".to_string(), 4u64);
        channel.insert("out_of_window".to_string(), 1u64);
        Snapshot {
            uptime_ms: 1234,
            sessions: 2,
            sessions_reclaimed: 3,
            payload_copied_bytes: 4096,
            storage_inflight: 5,
            reload: crate::stats::ReloadStats {
                applied: 2,
                failed: 1,
                last_error: Some("export[0].size: bad".into()),
                needs_restart: vec!["workers".into()],
            },
            nics: vec![
                NicStats {
                    name: "eth0".into(),
                    frames_rx: 10,
                    bytes_rx: 11,
                    frames_tx: 12,
                    bytes_tx: 13,
                    drops: Drops {
                        malformed: 1,
                        unknown_session: 2,
                        not_ours: 3,
                        slot_busy: 4,
                        denied_mac: 5,
                        denied_key: 6,
                        shutting_down: 7,
                        channel,
                    },
                    ..Default::default()
                },
                NicStats { name: "we\"ird\\".into(), ..Default::default() },
            ],
            exports: vec![
                ExportStats {
                    name: "disk".into(),
                    requests: OpCounts { read: 1, write: 7, flush: 2, discard: 3, write_zeroes: 4, block_status: 5 },
                    bytes_read: 100,
                    bytes_written: 200,
                    errors: 1,
                    denied: 2,
                    ..Default::default()
                },
                ExportStats { name: "a\nb".into(), ..Default::default() },
            ],
            channels: vec![ChannelSnapshot {
                session: 0xabc,
                channel: 1,
                nic: "eth0".into(),
                retransmits: 9,
                executing: 3,
                ..Default::default()
            }],
            storage_threads: vec![
                crate::stats::StorageThreadStats {
                    name: "tyched-io0".into(),
                    kind: "worker".into(),
                    node: Some(1),
                    jobs: 11,
                    ..Default::default()
                },
                crate::stats::StorageThreadStats {
                    name: "tyched-uring0".into(),
                    kind: "io_uring".into(),
                    ..Default::default()
                },
            ],
            irqs: vec![
                tyche_numa::IrqReport {
                    nic: "eth0".into(),
                    irqs: vec![tyche_numa::irq::IrqAffinity { irq: 38, affinity: vec![0, 1], effective: vec![1] }],
                    network_cpus: vec![1],
                    sharing_network_core: 1,
                    ..Default::default()
                },
                tyche_numa::IrqReport { nic: "veth0".into(), virtual_nic: true, ..Default::default() },
            ],
            poll: PollReport {
                threads: vec![
                    PollStats {
                        poll_ns: 1,
                        poll_hits: 2,
                        poll_misses: 3,
                        sleeps: 4,
                        wakeups: 5,
                        budget_ns: 6,
                        contended: 7,
                    },
                    PollStats::default(),
                ],
                ..Default::default()
            },
            ..Snapshot::default()
        }
    }

    #[test]
    fn the_text_is_the_hand_written_encoders_but_for_uptimes_type() {
        // Written by the encoder this crate had before prometheus-client, with one change:
        // `tyched_uptime_milliseconds` was typed `counter` (prometheus-client names every
        // counter `*_total`, so it is a gauge now to keep its name), and families added since:
        // `tyched_poll_contended_total`, `tyched_nic_irqs*`, `tyched_storage_jobs_total`,
        // `tyched_config_*`, `tyched_channel_*rto_expiries_total`, `tyched_export_fua_writes_total`.
        // And `tyched_build_info` first, whose labels are this build's.
        let expected = include_str!("../testdata/metrics-sample.prom")
            .replace("@VERSION@", env!("CARGO_PKG_VERSION"))
            .replace("@RUSTC@", tyche_metrics::text::RUSTC_VERSION);
        let text = sample().prometheus();
        assert_eq!(text, expected);
        assert!(text.starts_with("# HELP tyched_build_info "), "{text}");
        assert!(text.contains("tyched_nic_rx_frames_total{nic=\"we\\\"ird\\\\\"} 0\n"), "{text}");
        assert!(text.contains("tyched_export_errors_total{export=\"a\\nb\"} 0\n"), "{text}");
        assert!(!text.contains("# EOF"), "the 0.0.4 text format has no EOF marker");
        assert_eq!(Snapshot::default().prometheus().lines().filter(|l| l.starts_with("# TYPE")).count(), 34);
    }

    #[test]
    fn every_scraped_family_is_documented_with_its_type_and_labels() {
        let l = MetricsListener::bind(&"127.0.0.1:0".parse().unwrap()).expect("bind");
        let addr = l.local_addr().expect("addr");
        assert!(matches!(addr, MetricsAddr::Tcp(_)));
        let server = serve(l, sample).expect("serve");
        let r = get(&addr, "/metrics", Duration::from_secs(10)).expect("scrape");
        assert_eq!(r.status, "HTTP/1.0 200 OK");
        assert_eq!(r.header("content-type"), Some(tyche_metrics::CONTENT_TYPE));
        let body = r.body;
        assert_eq!(body, sample().prometheus(), "the same text as `tyched stats --prometheus`");
        drop(server);
        let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).expect("parses");
        let families = tyche_metrics::check::families(&body);
        // The parser reads each family as its TYPE line says, with the label names found.
        for (name, kind, labels) in &families {
            let sample = scrape.samples.iter().find(|s| s.metric == *name).unwrap_or_else(|| panic!("a {name} sample"));
            assert!(labels.iter().all(|k| sample.labels.get(k).is_some()), "{name}: {labels:?}");
            match (kind.as_str(), &sample.value) {
                ("counter", prometheus_parse::Value::Counter(_)) | ("gauge", prometheus_parse::Value::Gauge(_)) => {}
                other => panic!("{name}: TYPE and parsed value disagree: {other:?}"),
            }
        }
        let documented = tyche_metrics::check::documented(include_str!("../../../docs/tyched.md"), "tyched_");
        assert_eq!(families, documented, "docs/tyched.md's metric table and a scrape");
        // Values come through the parser as encoded.
        let value = |name: &str, key: &str, want: &str| {
            scrape
                .samples
                .iter()
                .find(|s| s.metric == name && s.labels.get(key) == Some(want))
                .map(|s| s.value.clone())
                .unwrap_or_else(|| panic!("{name}{{{key}={want}}}"))
        };
        assert_eq!(value("tyched_export_requests_total", "op", "write"), prometheus_parse::Value::Counter(7.0));
        assert_eq!(
            value("tyched_nic_drops_total", "reason", "channel_duplicate"),
            prometheus_parse::Value::Counter(4.0)
        );
        assert_eq!(
            value("tyched_channel_executing", "session", "0000000000000abc"),
            prometheus_parse::Value::Gauge(3.0)
        );
    }
}
