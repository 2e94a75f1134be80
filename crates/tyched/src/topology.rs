//! `tyched topology`: what the NUMA crate sees and plans, as a table or as JSON.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use tyche_numa::model::{self, BandwidthModel, ModelConfig};
use tyche_numa::placement::{self, PlacementRequest, Plan};
use tyche_numa::topology::{Nic, Node, TopologySource};
use tyche_numa::{NodeOrder, Topology};

/// Arguments of `tyched topology`.
#[derive(Debug, Args)]
pub struct TopologyArgs {
    /// Read the topology from an hwloc XML file (`lstopo-no-graphics --of xml`) instead of
    /// discovering this machine.
    #[arg(long, value_name = "FILE")]
    xml: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Show the I/O bandwidth model (node-bound copy tests; this machine only): the one the
    /// daemons cached (`--model-cache`), else measured now and cached.
    #[arg(long)]
    model: bool,
    /// Where the daemons keep the measured model.
    #[arg(long, value_name = "FILE", default_value = tyche_numa::model::DEFAULT_CACHE)]
    model_cache: PathBuf,
    /// Measure the model again (and store it) instead of showing the cached one.
    #[arg(long)]
    model_refresh: bool,
    /// Use the I/O bandwidth model in FILE (a model cache file, or the `model` of
    /// `tyched topology --json`) instead of measuring: works with `--xml`, to see how another
    /// machine's channels are placed with its measured classes.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["model", "model_refresh"])]
    model_file: Option<PathBuf>,
    /// Milliseconds each copy test of the model runs when it is measured.
    #[arg(long, value_name = "MS", default_value_t = 60)]
    model_ms: u64,
    /// Channels per NIC in the placement plan.
    #[arg(long, value_name = "N", default_value_t = 1)]
    channels_per_nic: u32,
    /// Plan channels only for this interface (repeatable; default: every NIC).
    #[arg(long = "iface", value_name = "NAME")]
    ifaces: Vec<String>,
    /// CPUs that run consumers outside the plan (comma-separated list, ranges allowed:
    /// `0-3,8`); network threads keep off their cores.
    #[arg(long, value_name = "LIST")]
    consumer_cpus: Option<String>,
}

/// The whole report, as printed by `--json`.
#[derive(Debug, Serialize)]
struct Report<'a> {
    source: &'a TopologySource,
    nodes: &'a [Node],
    nics: &'a [Nic],
    plan: &'a Plan,
    /// For each node, the other nodes in the order the channel scheduler falls back to them.
    fallback: &'a NodeOrder,
    model: Option<&'a BandwidthModel>,
}

/// Runs `tyched topology`.
pub fn run(args: &TopologyArgs) -> Result<()> {
    let topo = match &args.xml {
        Some(path) => {
            Topology::from_xml_file(path).with_context(|| format!("loading hwloc XML topology {}", path.display()))?
        }
        None => Topology::this_system().context("discovering this machine's topology")?,
    };
    let mut req =
        PlacementRequest::channels_per_nic(&topo, &args.ifaces, args.channels_per_nic).map_err(|unknown| {
            anyhow::anyhow!(
                "no such network interface in the topology: {} (known: {})",
                unknown.join(", "),
                topo.nics.iter().map(|n| n.name.as_str()).collect::<Vec<_>>().join(", ")
            )
        })?;
    // (A `Vec` from a value parser would be taken by clap for a list of values.)
    if let Some(list) = &args.consumer_cpus {
        req.consumer_cpus =
            parse_cpu_list(list).map_err(|e| anyhow::anyhow!("--consumer-cpus {list:?}: not a CPU list: {e}"))?;
    }

    let model = if let Some(path) = &args.model_file {
        Some(model::load_file(path).map_err(|e| anyhow::anyhow!("--model-file {}: {e}", path.display()))?)
    } else if args.model {
        if !topo.is_this_system() {
            bail!("--model measures this machine and cannot run on a topology loaded with --xml");
        }
        let mut io_nodes: Vec<u32> = topo.nics.iter().filter_map(|n| n.node).collect();
        io_nodes.sort_unstable();
        io_nodes.dedup();
        if io_nodes.is_empty() {
            tracing::warn!("no NIC has a known NUMA node: modelling every node as a device node");
            io_nodes = topo.nodes.iter().map(|n| n.id).collect();
        }
        let cfg = ModelConfig { duration: Duration::from_millis(args.model_ms), ..ModelConfig::default() };
        let (m, how) = model::cached(&args.model_cache, &topo, &io_nodes, &cfg, args.model_refresh)
            .context("measuring the bandwidth model")?;
        eprintln!("bandwidth model: {how:?} ({})", args.model_cache.display());
        Some(m)
    } else {
        None
    };
    // The model, when there is one, decides where channels go when their NIC's node cannot
    // have them (no CPUs, no free core).
    let plan = placement::plan_with_model(&topo, &req, model.as_ref());
    if let Some(m) = &model {
        for w in model::plan_warnings(m, &plan) {
            tracing::warn!("{w}");
        }
    }
    let fallback = match &model {
        Some(m) => NodeOrder::from_model(m, &topo.nodes.iter().map(|n| n.id).collect::<Vec<_>>()),
        None => NodeOrder::from_topology(&topo),
    };

    let report = Report {
        source: &topo.source,
        nodes: &topo.nodes,
        nics: &topo.nics,
        plan: &plan,
        fallback: &fallback,
        model: model.as_ref(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&topo, &report, args.channels_per_nic));
    }
    Ok(())
}

fn table(topo: &Topology, r: &Report<'_>, per_nic: u32) -> String {
    let mut s = String::new();
    let source = match r.source {
        TopologySource::ThisSystem => "this machine".to_string(),
        TopologySource::Xml(p) => format!("hwloc XML {}", p.display()),
        TopologySource::XmlString => "hwloc XML".to_string(),
    };
    let _ = writeln!(s, "Topology of {source}\n");
    let _ = writeln!(s, "NUMA nodes");
    let _ = writeln!(s, "  {:<5} {:<16} {:>5} {:>11}  DISTANCES", "NODE", "CPUS", "CORES", "MEMORY");
    for n in r.nodes {
        let dist = if n.distances.is_empty() {
            "-".to_string()
        } else {
            n.distances.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
        };
        let _ = writeln!(
            s,
            "  {:<5} {:<16} {:>5} {:>11}  {dist}",
            n.id,
            cpu_list(&n.cpus),
            n.cores.len(),
            gib(n.memory_bytes)
        );
    }
    let _ = writeln!(s, "\nNICs");
    let _ = writeln!(s, "  {:<16} {:<8} FOUND BY", "NAME", "NODE");
    for nic in r.nics {
        let source =
            serde_json::to_value(nic.node_source).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        let _ = writeln!(s, "  {:<16} {:<8} {source}", nic.name, node(nic.node));
    }
    let _ = writeln!(s, "\nChannel placement ({per_nic} channel{} per NIC)", if per_nic == 1 { "" } else { "s" });
    let _ = writeln!(
        s,
        "  {:<16} {:>3} {:>8} {:>11} {:>8} {:>11}  CORE",
        "NIC", "CH", "NIC NODE", "THREAD NODE", "MEM NODE", "NETWORK CPU"
    );
    for c in &r.plan.channels {
        let _ = writeln!(
            s,
            "  {:<16} {:>3} {:>8} {:>11} {:>8} {:>11}  {}",
            c.nic,
            c.channel,
            node(c.nic_node),
            c.node,
            c.memory_node,
            c.network_cpu,
            if c.exclusive_core { "own" } else { "shared" }
        );
    }
    let _ = writeln!(s, "\nCompletion workers");
    for n in &topo.nodes {
        let cpus: Vec<u32> = r.plan.workers_on(n.id).map(|w| w.cpu).collect();
        if !cpus.is_empty() {
            let _ = writeln!(s, "  node {}: cpus {}", n.id, cpu_list(&cpus));
        }
    }
    if !r.plan.warnings.is_empty() {
        let _ = writeln!(s, "\nWarnings");
        for w in &r.plan.warnings {
            let _ = writeln!(s, "  {w}");
        }
    }
    if let Some(m) = r.model {
        let _ = writeln!(s, "\nI/O bandwidth model (GB/s, class 1 = best, tolerance {:.0} %)", m.tolerance * 100.0);
        let _ = writeln!(
            s,
            "  {:<8} {:<5} {:>12} {:>6} {:>12} {:>6}",
            "IO NODE", "NODE", "WRITE", "CLASS", "READ", "CLASS"
        );
        for io in &m.io_nodes {
            for (w, rd) in io.write.iter().zip(&io.read) {
                let _ = writeln!(
                    s,
                    "  {:<8} {:<5} {:>12.2} {:>6} {:>12.2} {:>6}",
                    io.io_node, w.node, w.gbytes_per_s, w.class, rd.gbytes_per_s, rd.class
                );
            }
        }
    }
    s
}

fn node(n: Option<u32>) -> String {
    n.map_or_else(|| "unknown".to_string(), |n| n.to_string())
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

use tyche_numa::{format_cpu_list as cpu_list, parse_cpu_list};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_round_trip() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpu_list(&[]), "");
        assert_eq!(parse_cpu_list("0-3,8").expect("valid"), vec![0, 1, 2, 3, 8]);
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("x").is_err());
    }
}
