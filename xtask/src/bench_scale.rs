//! `cargo xtask bench scale`: channel scaling of both daemons' frame handling.
//!
//! Builds and runs the `scale` example of `tyche-init` in release mode (examples/scale.rs): the
//! real `tyched` network threads and the real `tyche-init` engine threads, each over in-memory
//! links whose far end replays frames built in advance (`tyche_tools::replay`), 1 channel
//! on 1 thread pinned to CPU 1 against 2 channels on 2 threads pinned to CPUs 0 and 1, the same
//! total work, alternating, `--repeats` times. Prints its table and, last, `scale: target
//! 2x=<r>x initiator 2x=<r>x` (median rate with 2 channels over the median with 1). A benchmark,
//! never a test: its numbers depend on the machine and what else runs on it.

use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct BenchScaleArgs {
    /// Requests replayed to the target per run (split evenly over its channels).
    #[arg(long, default_value_t = 400_000)]
    requests: u64,
    /// Reads handed to the initiator per run.
    #[arg(long, default_value_t = 200_000)]
    initiator_requests: u64,
    /// Runs of each configuration (at least 3 for the table's min/median/max).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Requests the replay keeps in flight per target channel.
    #[arg(long, default_value_t = 64)]
    window: u16,
    /// Measure one side only (`target` or `initiator`).
    #[arg(long, value_parser = ["target", "initiator"])]
    only: Option<String>,
}

pub fn bench_scale(root: &std::path::Path, args: &BenchScaleArgs) -> Result<()> {
    if args.repeats < 3 {
        eprintln!("bench scale: {} repeat(s): the table's min/median/max want at least 3", args.repeats);
    }
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root).args(["run", "--release", "--quiet", "-p", "tyche-init", "--example", "scale", "--"]);
    cmd.args(["--requests", &args.requests.to_string()]);
    cmd.args(["--initiator-requests", &args.initiator_requests.to_string()]);
    cmd.args(["--repeats", &args.repeats.to_string()]);
    cmd.args(["--window", &args.window.to_string()]);
    if let Some(side) = &args.only {
        cmd.args(["--only", side]);
    }
    let status = cmd.status().context("running the scale example")?;
    if !status.success() {
        bail!("the scale bench failed ({status})");
    }
    Ok(())
}
