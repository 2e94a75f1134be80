//! Helpers for a daemon's `prometheus-client` collector, which encodes one snapshot of its
//! counters at scrape time: families from rows of labels and values, the `*_build_info` gauge,
//! and the text of a collector under the daemon's prefix (Prometheus text format 0.0.4).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
pub use prometheus_client::metrics::MetricType;

/// One sample's labels, in order.
pub type Labels = Vec<(&'static str, String)>;

/// The compiler this was built with (`rustc --version`'s version), or `unknown`.
pub const RUSTC_VERSION: &str = match env!("TYCHE_RUSTC_VERSION").as_bytes() {
    [] => "unknown",
    _ => env!("TYCHE_RUSTC_VERSION"),
};

/// Writes one family: its `# HELP` and `# TYPE` lines and a sample per row. A counter's `name`
/// is given without `_total`: prometheus-client appends it. `MetricType::Counter` rows are
/// counters, any other type's are gauges.
pub fn family(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: Vec<(Labels, u64)>,
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in rows {
        let e = m.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(e)?,
            _ => ConstGauge::new(v).encode(e)?,
        }
    }
    Ok(())
}

/// Writes `PREFIX_build_info{version,rustc} 1`: `version` is the daemon's (its
/// `CARGO_PKG_VERSION`), `rustc` the compiler's ([`RUSTC_VERSION`]).
pub fn build_info(enc: &mut DescriptorEncoder<'_>, version: &str) -> std::fmt::Result {
    let labels = vec![("version", version.to_owned()), ("rustc", RUSTC_VERSION.to_owned())];
    family(
        enc,
        "build_info",
        "The daemon's version and compiler; the value is 1.",
        MetricType::Gauge,
        vec![(labels, 1)],
    )
}

/// `collector`'s families in the Prometheus text exposition format (0.0.4), every name
/// prefixed with `prefix_`.
pub fn encode(prefix: &str, collector: impl Collector) -> String {
    let mut registry = prometheus_client::registry::Registry::with_prefix(prefix);
    registry.register_collector(Box::new(collector));
    let mut text = String::new();
    // Writing into a String fails only if a collector fails, and a collector of these helpers
    // only passes on the encoder's own results.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry) {
        tracing::warn!("prometheus encoding: {e}");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Two;

    impl Collector for Two {
        fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
            build_info(&mut enc, "9.8.7")?;
            let rows = vec![(vec![("name", "a\"b\\c\nd".to_owned())], 5), (vec![("name", "x".to_owned())], 0)];
            family(&mut enc, "things", "Things seen.", MetricType::Counter, rows)?;
            family(&mut enc, "level", "A level.", MetricType::Gauge, vec![(Labels::new(), 3)])
        }
    }

    #[test]
    fn families_build_info_and_escaping() {
        let text = encode("demo", Two);
        let rustc = format!("rustc=\"{RUSTC_VERSION}\"");
        assert!(
            text.starts_with(&format!(
                "# HELP demo_build_info The daemon's version and compiler; the value is 1.\n\
                 # TYPE demo_build_info gauge\ndemo_build_info{{version=\"9.8.7\",{rustc}}} 1\n"
            )),
            "{text}"
        );
        assert!(RUSTC_VERSION.starts_with("1.") || RUSTC_VERSION == "unknown", "{RUSTC_VERSION}");
        assert!(text.contains("# TYPE demo_things_total counter\n"), "{text}");
        assert!(text.contains("demo_things_total{name=\"a\\\"b\\\\c\\nd\"} 5\n"), "{text}");
        assert!(text.contains("demo_things_total{name=\"x\"} 0\n"), "{text}");
        assert!(text.contains("# TYPE demo_level gauge\ndemo_level 3\n"), "{text}");
        assert!(!text.contains("# EOF"), "the 0.0.4 text format has no EOF marker");
    }
}
