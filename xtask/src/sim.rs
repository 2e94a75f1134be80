//! `cargo xtask sim`: many seeds of the deterministic simulator, in parallel.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use anyhow::{bail, Result};
use clap::Args;
use tyche_sim::{run_seed, SeedReport, SimConfig, Totals};

#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// Number of seeds to run (seeds `first..first+seeds`).
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// Replay exactly this seed (overrides --seeds).
    #[arg(long)]
    seed: Option<u64>,
    /// First seed of the range.
    #[arg(long, default_value_t = 0)]
    first: u64,
    /// Frame loss probability, each way.
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Reordering probability.
    #[arg(long, default_value_t = 0.0)]
    reorder: f64,
    /// Duplication probability.
    #[arg(long, default_value_t = 0.0)]
    dup: f64,
    /// Paths (channels) between initiator and target.
    #[arg(long, default_value_t = 2)]
    paths: usize,
    /// Fail one path mid-run.
    #[arg(long)]
    fail_path: bool,
    /// Restart the target (crash or graceful stop), partition every path for longer than the
    /// target's reclaim time, restart the initiator's engine; any error other than a storage
    /// error then fails the seed.
    #[arg(long)]
    restarts: bool,
    /// Requests per seed.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// A keyed export: every channel proves the key and seals every frame.
    #[arg(long)]
    keyed: bool,
    /// A keyed export that also encrypts (implies --keyed).
    #[arg(long)]
    encrypt: bool,
    /// Parts each target session is held in (as by tyched's network threads): a copy of a
    /// modifying request arriving on a part other than its home's is decided there by message.
    #[arg(long, default_value_t = 1)]
    target_parts: usize,
    /// Parts the initiator's volume is held in (as by tyche-init's engine threads, one per
    /// node): tags from each part's residue class, floors shared on a timer read late.
    #[arg(long, default_value_t = 1)]
    init_parts: usize,
    /// Worker threads (default: every core).
    #[arg(long)]
    jobs: Option<usize>,
}

impl SimArgs {
    /// The plain contract (2 paths, one failing, reordering, duplicates, `loss`; 200 requests a
    /// seed), shortened to `seeds` seeds.
    pub fn contract(seeds: u64, loss: f64) -> Self {
        SimArgs {
            seeds,
            seed: None,
            first: 0,
            loss,
            reorder: 0.1,
            dup: 0.01,
            paths: 2,
            fail_path: true,
            restarts: false,
            requests: 200,
            keyed: false,
            encrypt: false,
            target_parts: 1,
            init_parts: 1,
            jobs: None,
        }
    }

    /// The restarts contract (operators restart things), shortened to `seeds` seeds, with
    /// each target session in two parts (a copy re-issued on the other path's part is
    /// decided by its home's part, by message) and the initiator's volume in two parts (tags by
    /// residue class, floors read late, a failed path's requests handed to the other part).
    pub fn restarts_contract(seeds: u64) -> Self {
        SimArgs { restarts: true, target_parts: 2, init_parts: 2, ..SimArgs::contract(seeds, 0.05) }
    }

    /// The keyed contract: the restarts contract on an encrypted keyed export (every channel through
    /// the CHALLENGE round, every frame sealed, through loss, reordering, duplication, a failed
    /// path and restarts).
    pub fn keyed_contract(seeds: u64) -> Self {
        SimArgs { keyed: true, encrypt: true, ..SimArgs::restarts_contract(seeds) }
    }

    fn replay_flags(&self) -> String {
        let mut s = format!(
            "--loss {} --reorder {} --dup {} --paths {} --requests {}",
            self.loss, self.reorder, self.dup, self.paths, self.requests
        );
        if self.fail_path {
            s.push_str(" --fail-path");
        }
        if self.restarts {
            s.push_str(" --restarts");
        }
        if self.target_parts != 1 {
            s.push_str(&format!(" --target-parts {}", self.target_parts));
        }
        if self.init_parts != 1 {
            s.push_str(&format!(" --init-parts {}", self.init_parts));
        }
        if self.encrypt {
            s.push_str(" --encrypt");
        } else if self.keyed {
            s.push_str(" --keyed");
        }
        s
    }
}

/// Runs the seeds the arguments ask for and prints the totals; fails if a seed failed.
pub fn run(args: SimArgs) -> Result<()> {
    check_args(&args)?;
    let cfg = sim_config(&args);
    let (first, count) = match args.seed {
        Some(s) => (s, 1),
        None => (args.first, args.seeds),
    };
    let jobs = args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let started = std::time::Instant::now();
    let t = run_seeds(&args, &cfg, first, count, jobs);
    print_totals(&args, &t, started);
    if t.failed_seeds > 0 {
        bail!("{} of {} seeds failed", t.failed_seeds, t.seeds);
    }
    Ok(())
}

/// Fails unless the probabilities and the counts of paths and parts are in range.
fn check_args(args: &SimArgs) -> Result<()> {
    for (name, p) in [("loss", args.loss), ("reorder", args.reorder), ("dup", args.dup)] {
        if !(0.0..1.0).contains(&p) {
            bail!("--{name} must be in [0, 1), got {p}");
        }
    }
    if args.paths == 0 || args.paths > 16 {
        bail!("--paths must be between 1 and 16");
    }
    if args.target_parts == 0 || args.target_parts > 16 {
        bail!("--target-parts must be between 1 and 16");
    }
    if args.init_parts == 0 || args.init_parts > 16 {
        bail!("--init-parts must be between 1 and 16");
    }
    Ok(())
}

/// The simulator's configuration the arguments ask for.
fn sim_config(args: &SimArgs) -> SimConfig {
    SimConfig {
        paths: args.paths,
        loss: args.loss,
        reorder: args.reorder,
        dup: args.dup,
        fail_path: args.fail_path,
        restarts: args.restarts,
        keyed: (args.keyed || args.encrypt).then_some(args.encrypt),
        requests: args.requests,
        target_parts: args.target_parts,
        init_parts: args.init_parts,
        ..SimConfig::default()
    }
}

/// Runs seeds `first..first+count` on `jobs` worker threads; returns their totals.
fn run_seeds(args: &SimArgs, cfg: &SimConfig, first: u64, count: u64, jobs: usize) -> Totals {
    let next = AtomicU64::new(first);
    let totals = Mutex::new(Totals::default());
    // Keep panics quiet in workers; a panicking seed is reported with its replay command.
    let default_hook = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(count as usize).max(1) {
            scope.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= first + count {
                    break;
                }
                let report = run_one(args, cfg, seed, count);
                totals.lock().expect("totals").add(&report);
            });
        }
    });
    panic::set_hook(default_hook);
    totals.into_inner().expect("totals")
}

/// Runs one seed (a panic counts as a mismatch) and prints it if it failed or is the only one.
fn run_one(args: &SimArgs, cfg: &SimConfig, seed: u64, count: u64) -> SeedReport {
    let report = match panic::catch_unwind(AssertUnwindSafe(|| run_seed(cfg, seed))) {
        Ok(r) => r,
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            println!("sim: seed {seed} PANICKED: {msg}");
            SeedReport { seed, mismatches: 1, ..SeedReport::default() }
        }
    };
    if !report.ok() {
        println!(
            "sim: seed {seed} FAILED ({} mismatches, {} stuck, {} errors surfaced); replay: cargo xtask sim --seed {seed} {}",
            report.mismatches,
            report.stuck,
            report.surfaced,
            args.replay_flags()
        );
    }
    if count == 1 {
        println!("sim: seed {seed}: {report:?}");
    }
    report
}

/// Prints the totals: the frames and failures, then what the options asked for, then the seeds.
fn print_totals(args: &SimArgs, t: &Totals, started: std::time::Instant) {
    eprintln!(
        "sim: {:.1}s ({:.1} ms virtual per seed), {} frames, {} retransmits, {} failed requests, {} dead channels, \
         {} duplicate modifications suppressed",
        started.elapsed().as_secs_f64(),
        t.virtual_nanos as f64 / 1e6 / t.seeds.max(1) as f64,
        t.frames,
        t.retransmits,
        t.failed,
        t.dead_channels,
        t.duplicates_suppressed
    );
    if args.restarts {
        eprintln!(
            "sim: {} target restarts ({} process kills keeping the cache), {} partitions, {} engine restarts, \
             {} sessions resumed, {} sessions fenced, {} errors surfaced, {} FLUSHes failed for writes a crash may \
             have lost",
            t.target_restarts,
            t.target_kills,
            t.partitions,
            t.engine_restarts,
            t.resumes,
            t.fenced,
            t.surfaced,
            t.durability_errors
        );
        eprintln!(
            "sim: fences: storage stalled under {} engine restarts; {} requests of new sessions held until the fenced \
             sessions' storage work ended, {} queued operations of fenced sessions given up",
            t.storage_stalls, t.fence_held, t.fence_aborted
        );
    }
    if args.init_parts > 1 {
        eprintln!(
            "sim: volumes in {} parts: {} requests handed from one part to another ({} refused on arrival)",
            args.init_parts, t.handoffs, t.handoffs_refused
        );
    }
    if args.target_parts > 1 {
        eprintln!(
            "sim: sessions in {} parts: {} copies decided by their home's part, {} messages between parts, {} stray",
            args.target_parts, t.forwarded, t.part_messages, t.stray_messages
        );
    }
    if t.refused > 0 {
        eprintln!("sim: {} CONNECTs refused by the target's admission", t.refused);
    }
    println!("sim: {} seeds, {} requests, {} mismatches, {} stuck", t.seeds, t.requests, t.mismatches, t.stuck);
}
