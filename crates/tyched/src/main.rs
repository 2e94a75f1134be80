//! `tyched`: the Tyche target daemon.
//!
//! Subcommands:
//! - `tyched topology [--xml FILE] [--json] [--model]`: the NUMA nodes, NICs and their nodes,
//!   and the channel placement plan (and, with `--model`, the I/O bandwidth model).

mod topology;

use std::io::IsTerminal;

use anyhow::Result;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Tyche target daemon.
#[derive(Debug, Parser)]
#[command(name = "tyched", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show NUMA nodes, NICs with their node, and the channel placement plan.
    Topology(topology::TopologyArgs),
}

fn main() -> Result<()> {
    // Log lines (placement warnings among them) go to stderr; stdout stays parseable.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(EnvFilter::try_from_env("TYCHE_LOG").unwrap_or_else(|_| EnvFilter::new("warn")))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Topology(args) => topology::run(&args),
    }
}
