//! `cargo xtask bench send-mode [--secs N] [--repeats N]`: the papers' two send modes side by
//! side on this machine. Runs the ignored measurement `bench_send_mode` of tyche-init's
//! `tests/send_mode.rs` in release mode: the library client against the in-process RAM target
//! over two in-memory links, 4 KiB random reads at queue depth 1 and 32, inline and queue mode
//! alternating, each repeated; then the same through the NBD server with fio's nbd engine (where
//! fio is installed). Prints the table (IOPS and p50 latency per run, min/median/max per
//! mode) and the last line `send-mode: inline/queue qd1=<r>x qd32=<r>x`. Needs no privileges.

use std::process::Command;

use anyhow::{ensure, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct BenchSendModeArgs {
    /// Seconds per run.
    #[arg(long, default_value_t = 2)]
    secs: u64,
    /// Runs per mode and queue depth (the modes alternate).
    #[arg(long, default_value_t = 3)]
    repeats: u64,
}

pub fn bench_send_mode(root: &std::path::Path, args: &BenchSendModeArgs) -> Result<()> {
    ensure!((1..=600).contains(&args.secs), "--secs is 1 to 600");
    ensure!((1..=100).contains(&args.repeats), "--repeats is 1 to 100");
    let out = Command::new(env!("CARGO"))
        .current_dir(root)
        .args(["test", "--release", "-p", "tyche-init", "--test", "send_mode", "--"])
        .args(["--ignored", "--nocapture", "--test-threads=1", "bench_send_mode"])
        .env("TYCHE_BENCH_SECS", args.secs.to_string())
        .env("TYCHE_BENCH_REPEATS", args.repeats.to_string())
        .output()
        .context("running cargo test")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "the measurement failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let mut last = None;
    for line in stdout.lines() {
        if line.starts_with('|') || line.is_empty() || line.starts_with("send-mode nbd:") || line.starts_with("(no NBD")
        {
            println!("{line}");
        }
        if line.starts_with("send-mode: ") {
            last = Some(line.to_owned());
        }
    }
    let last = last.context("the measurement printed no `send-mode:` line")?;
    println!("{last}");
    Ok(())
}
