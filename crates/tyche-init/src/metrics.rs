//! The initiator's counters as Prometheus text: what `GET /metrics` answers with
//! `tyche-init attach|serve-nbd --prometheus-listen ADDR` (served by
//! [`tyche_metrics::MetricsListener`], loopback or a Unix socket unless
//! `--prometheus-allow-remote`).
//!
//! Each scrape encodes one [`Report`], asked of the engine at scrape time exactly as
//! `tyche-init stats` asks for it (`Client::report_blocking`: a command to the first engine
//! thread, answered between two rounds of its loop), so the numbers of one scrape are of one
//! moment and the scrape takes no lock of the frame path that `stats` does not. Names are
//! prefixed `tyche_init_`; every family but `tyche_init_build_info` carries the labels
//! `attachment`, `export` and `target` ([`Identity`]); docs/tyche-init.md lists them (a unit
//! test checks that list against the encoder).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tyche_metrics::text::{build_info, family, Labels, MetricType};
use tyche_metrics::{MetricsListener, MetricsServer};

use crate::report::{ChannelReport, Health, Report};

/// Name of the endpoint's thread.
pub const THREAD: &str = "tyche-prom";

/// What the metrics of one attachment are labelled with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// The attachment: its attachment file's name (`--config`), else its device or socket path.
    pub attachment: String,
    /// Export name.
    pub export: String,
    /// The target: the `<target>` of `/dev/disk/by-tyche/<target>/<export>` (`--target-name`,
    /// else the target's MAC, `loopback` for `--loopback-mib`).
    pub target: String,
    /// `ublk` or `nbd`.
    pub kind: String,
    /// Device path (`/dev/ublkbN`) or NBD socket path.
    pub path: String,
}

/// Answers scrapes on `listener` until the server is dropped, each with the report `source`
/// returns then (`None`: the session does not answer, reported as health `unknown`).
pub fn serve(
    listener: MetricsListener,
    id: Identity,
    source: impl Fn() -> Option<Report> + Send + Sync + 'static,
) -> std::io::Result<MetricsServer> {
    listener.serve(THREAD, move || encode(&id, source()))
}

/// One attachment's report in the Prometheus text exposition format (0.0.4), by
/// prometheus-client. Without a report: the build, the attachment and its health (`unknown`).
pub fn encode(id: &Identity, report: Option<Report>) -> String {
    tyche_metrics::text::encode("tyche_init", Scrape { id: id.clone(), report })
}

/// One scrape: encoded when the registry is. Counter names are given without `_total`:
/// prometheus-client appends it.
#[derive(Debug)]
struct Scrape {
    id: Identity,
    report: Option<Report>,
}

/// A family with a sample per channel: name, help, type, and the channel's value.
type PerChannel = (&'static str, &'static str, MetricType, fn(&ChannelReport) -> u64);

impl Scrape {
    /// The labels every family but the build's has, then `more`.
    fn labels(&self, more: &[(&'static str, String)]) -> Labels {
        let mut l = vec![
            ("attachment", self.id.attachment.clone()),
            ("export", self.id.export.clone()),
            ("target", self.id.target.clone()),
        ];
        l.extend(more.iter().cloned());
        l
    }

    /// One sample with the attachment's labels only.
    fn one(&self, v: u64) -> Vec<(Labels, u64)> {
        vec![(self.labels(&[]), v)]
    }
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        use MetricType::{Counter, Gauge};
        let enc = &mut enc;
        build_info(enc, env!("CARGO_PKG_VERSION"))?;
        let info = self.labels(&[("kind", self.id.kind.clone()), ("path", self.id.path.clone())]);
        family(enc, "attachment_info", "The attachment's kind and path; the value is 1.", Gauge, vec![(info, 1)])?;
        let paths = self.report.as_ref().map(Report::paths);
        let now = paths.as_ref().map_or(Health::Unknown, |p| p.health());
        let health = Health::ALL
            .iter()
            .map(|h| (self.labels(&[("state", h.as_str().to_owned())]), u64::from(*h == now)))
            .collect();
        family(
            enc,
            "health",
            "1 for the state the attachment is in (as `tyche-init list` shows it), 0 for the others.",
            Gauge,
            health,
        )?;
        let (Some(r), Some(paths)) = (&self.report, paths) else { return Ok(()) };
        let session = self.labels(&[("session", format!("{:016x}", r.session))]);
        family(
            enc,
            "session_info",
            "The session's id (tyched's `session` label); the value is 1.",
            Gauge,
            vec![(session, 1)],
        )?;
        family(enc, "links", "Links (NICs) with a channel.", Gauge, self.one(paths.links.len() as u64))?;
        family(enc, "live_links", "Links with at least one live channel.", Gauge, self.one(paths.live_links() as u64))?;
        family(enc, "channels", "Channels.", Gauge, self.one(paths.channels as u64))?;
        family(enc, "live_channels", "Channels open now.", Gauge, self.one(paths.live_channels as u64))?;
        let link_live =
            paths.links.iter().map(|(l, live)| (self.labels(&[("link", l.clone())]), u64::from(*live))).collect();
        family(enc, "link_live", "Whether the link has a live channel.", Gauge, link_live)?;
        family(enc, "requests_completed", "Requests completed successfully.", Counter, self.one(r.completed))?;
        family(enc, "requests_failed", "Requests failed.", Counter, self.one(r.failed))?;
        family(enc, "read_bytes", "Bytes read.", Counter, self.one(r.bytes_read))?;
        family(enc, "written_bytes", "Bytes written.", Counter, self.one(r.bytes_written))?;
        family(enc, "reconnects", "Channels reopened after dying.", Counter, self.one(r.reconnects))?;
        let copied = [
            ("read", r.payload_copied_bytes.saturating_sub(r.payload_copied_write_bytes)),
            ("write", r.payload_copied_write_bytes),
        ]
        .into_iter()
        .map(|(data, v)| (self.labels(&[("data", data.to_owned())]), v))
        .collect();
        family(enc, "payload_copied_bytes", "Payload bytes copied in user space, by direction.", Counter, copied)?;
        let refused = [
            ("unauthenticated", r.refused.unauthenticated),
            ("replayed", r.refused.replayed),
            ("bad_digest", r.refused.bad_digest),
        ]
        .into_iter()
        .map(|(reason, v)| (self.labels(&[("reason", reason.to_owned())]), v))
        .collect();
        family(enc, "refused_frames", "Frames the open channels refused, by reason.", Counter, refused)?;
        let sent = [("inline", r.send.inline), ("handed_over", r.send.handed_over)]
            .into_iter()
            .map(|(how, v)| (self.labels(&[("how", how.to_owned())]), v))
            .collect();
        family(enc, "sent_requests", "Requests sent inline or handed to an engine thread.", Counter, sent)?;
        family(
            enc,
            "inline_fallbacks",
            "Inline submissions whose frames an engine thread sent after all.",
            Counter,
            self.one(r.send.inline_fallbacks),
        )?;
        family(
            enc,
            "inline_wakes",
            "Engine threads rung after an inline send.",
            Counter,
            self.one(r.send.inline_wakes),
        )?;
        if self.id.kind == "nbd" {
            let open = r.nbd.iter().filter(|c| c.open).count() as u64;
            family(enc, "nbd_connections", "NBD connections open now.", Gauge, self.one(open))?;
        }
        let per_channel: [PerChannel; 8] = [
            ("channel_live", "Whether the channel is alive.", Gauge, |c| u64::from(c.live)),
            ("channel_tx_payload_bytes", "Payload bytes sent (write data, retransmissions included).", Counter, |c| {
                c.payload_tx
            }),
            ("channel_rx_payload_bytes", "Payload bytes received (read data).", Counter, |c| c.payload_rx),
            ("channel_tx_frames", "Frames sent.", Counter, |c| c.frames_tx),
            ("channel_rx_frames", "Frames received.", Counter, |c| c.frames_rx),
            ("channel_retransmits", "Retransmissions.", Counter, |c| c.retransmits),
            ("channel_rto_expiries", "Retransmission timer expiries.", Counter, |c| c.timeouts),
            (
                "channel_spurious_rto_expiries",
                "Timer expiries whose frames were delayed, not lost (only the oldest was resent).",
                Counter,
                |c| c.spurious_timeouts,
            ),
        ];
        for (name, help, kind, value) in per_channel {
            let rows = r
                .channels
                .iter()
                .map(|c| (self.labels(&[("link", c.link.clone()), ("channel", c.channel.to_string())]), value(c)))
                .collect();
            family(enc, name, help, kind, rows)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{NbdConnReport, Refused, SendCounters};

    fn id() -> Identity {
        Identity {
            attachment: "vol\"1\\\nx".into(),
            export: "disk0".into(),
            target: "store1".into(),
            kind: "nbd".into(),
            path: "/run/vol.sock".into(),
        }
    }

    /// Two links, one of them without a live channel; a dead and two live channels.
    fn report() -> Report {
        let ch = |channel: u16, link: &str, live: bool, n: u64| ChannelReport {
            channel,
            link: link.into(),
            live,
            payload_tx: n,
            payload_rx: 2 * n,
            frames_tx: 3 * n,
            frames_rx: 4 * n,
            retransmits: 5 * n,
            ..Default::default()
        };
        Report {
            export: "disk0".into(),
            session: 0xabc,
            live_channels: 2,
            completed: 7,
            failed: 1,
            bytes_read: 4096,
            bytes_written: 8192,
            reconnects: 2,
            refused: Refused { unauthenticated: 3, replayed: 0, bad_digest: 1 },
            channels: vec![ch(0, "eth0", true, 10), ch(1, "eth1", false, 20), ch(2, "eth0", true, 30)],
            nbd: vec![
                NbdConnReport { conn: 1, open: true, ..Default::default() },
                NbdConnReport { conn: 2, open: false, ..Default::default() },
            ],
            send: SendCounters {
                mode: "inline".into(),
                inline: 6,
                handed_over: 2,
                inline_fallbacks: 1,
                inline_wakes: 4,
            },
            ..Default::default()
        }
    }

    const BASE: &str = "attachment=\"vol\\\"1\\\\\\nx\",export=\"disk0\",target=\"store1\"";

    #[test]
    fn a_report_is_encoded_with_escaped_labels() {
        let text = encode(&id(), Some(report()));
        let has = |line: String| assert!(text.contains(&format!("{line}\n")), "{line} missing from\n{text}");
        assert!(text.starts_with("# HELP tyche_init_build_info "), "{text}");
        has(format!(
            "tyche_init_build_info{{version=\"{}\",rustc=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            tyche_metrics::text::RUSTC_VERSION
        ));
        has(format!("tyche_init_attachment_info{{{BASE},kind=\"nbd\",path=\"/run/vol.sock\"}} 1"));
        has(format!("tyche_init_health{{{BASE},state=\"degraded\"}} 1"));
        for other in ["live", "no-path", "awaiting-recovery", "unknown"] {
            has(format!("tyche_init_health{{{BASE},state=\"{other}\"}} 0"));
        }
        has(format!("tyche_init_session_info{{{BASE},session=\"0000000000000abc\"}} 1"));
        has(format!("tyche_init_links{{{BASE}}} 2"));
        has(format!("tyche_init_live_links{{{BASE}}} 1"));
        has(format!("tyche_init_channels{{{BASE}}} 3"));
        has(format!("tyche_init_live_channels{{{BASE}}} 2"));
        has(format!("tyche_init_link_live{{{BASE},link=\"eth0\"}} 1"));
        has(format!("tyche_init_link_live{{{BASE},link=\"eth1\"}} 0"));
        has(format!(
            "# TYPE tyche_init_requests_completed_total counter\ntyche_init_requests_completed_total{{{BASE}}} 7"
        ));
        has(format!("tyche_init_requests_failed_total{{{BASE}}} 1"));
        has(format!("tyche_init_read_bytes_total{{{BASE}}} 4096"));
        has(format!("tyche_init_written_bytes_total{{{BASE}}} 8192"));
        has(format!("tyche_init_reconnects_total{{{BASE}}} 2"));
        has(format!("tyche_init_refused_frames_total{{{BASE},reason=\"unauthenticated\"}} 3"));
        has(format!("tyche_init_refused_frames_total{{{BASE},reason=\"bad_digest\"}} 1"));
        has(format!("tyche_init_sent_requests_total{{{BASE},how=\"inline\"}} 6"));
        has(format!("tyche_init_sent_requests_total{{{BASE},how=\"handed_over\"}} 2"));
        has(format!("tyche_init_inline_fallbacks_total{{{BASE}}} 1"));
        has(format!("tyche_init_inline_wakes_total{{{BASE}}} 4"));
        has(format!("tyche_init_nbd_connections{{{BASE}}} 1"));
        has(format!("tyche_init_channel_live{{{BASE},link=\"eth1\",channel=\"1\"}} 0"));
        has(format!("tyche_init_channel_tx_payload_bytes_total{{{BASE},link=\"eth0\",channel=\"2\"}} 30"));
        has(format!("tyche_init_channel_rx_payload_bytes_total{{{BASE},link=\"eth0\",channel=\"2\"}} 60"));
        has(format!("tyche_init_channel_tx_frames_total{{{BASE},link=\"eth0\",channel=\"0\"}} 30"));
        has(format!("tyche_init_channel_rx_frames_total{{{BASE},link=\"eth1\",channel=\"1\"}} 80"));
        has(format!("tyche_init_channel_retransmits_total{{{BASE},link=\"eth1\",channel=\"1\"}} 100"));
        assert!(!text.contains("# EOF"), "the 0.0.4 text format has no EOF marker");
        // A ublk attachment has no NBD connections to count.
        let ublk = encode(&Identity { kind: "ublk".into(), ..id() }, Some(report()));
        assert!(!ublk.contains("nbd_connections"), "{ublk}");
    }

    #[test]
    fn without_a_report_the_health_is_unknown_and_nothing_else_is_said() {
        let text = encode(&id(), None);
        assert!(text.contains(&format!("tyche_init_health{{{BASE},state=\"unknown\"}} 1\n")), "{text}");
        assert!(text.contains(&format!("tyche_init_health{{{BASE},state=\"live\"}} 0\n")), "{text}");
        assert!(text.contains("tyche_init_build_info{"), "{text}");
        let families: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).collect();
        assert_eq!(
            families,
            ["tyche_init_build_info gauge", "tyche_init_attachment_info gauge", "tyche_init_health gauge"]
        );
        // Health as `tyche-init list` computes it.
        let mut r = report();
        assert_eq!(r.paths().health(), Health::Degraded);
        r.channels[1].live = true;
        assert_eq!(r.paths().health(), Health::Live);
        r.channels.iter_mut().for_each(|c| c.live = false);
        assert_eq!(r.paths().health(), Health::NoPath);
        assert!(encode(&id(), Some(r)).contains(&format!("tyche_init_health{{{BASE},state=\"no-path\"}} 1\n")));
    }

    #[test]
    fn every_family_is_documented_with_its_type_and_labels() {
        let text = encode(&id(), Some(report()));
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("a Prometheus parser reads it");
        // The table lists the labels besides the three every family but the build's has.
        let mut documented =
            tyche_metrics::check::documented(include_str!("../../../docs/tyche-init.md"), "tyche_init_");
        for (_, _, labels) in documented.iter_mut().filter(|(name, _, _)| name != "tyche_init_build_info") {
            labels.splice(0..0, ["attachment", "export", "target"].map(String::from));
        }
        assert_eq!(
            tyche_metrics::check::families(&text),
            documented,
            "docs/tyche-init.md's metric table and the encoder"
        );
    }
}
