//! `cargo xtask fuzz`: builds the libFuzzer binaries of `fuzz/` with coverage instrumentation on
//! the stable toolchain, replays every regression input, fuzzes each target for its share of the
//! time, and prints what ran (docs/fuzzing.md).
//!
//! No cargo-fuzz and no nightly: the binaries are built with stable rustc's LLVM sanitizer
//! coverage pass (`-Cpasses=sancov-module`, inline 8-bit counters, PC table, comparison
//! tracing) and linked against libFuzzer as `libfuzzer-sys` builds it (it needs a C++ compiler).
//! Debug assertions and overflow checks are on.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use clap::Args;

/// Every fuzz target (the binaries of `fuzz/` and the folders of `fuzz/regressions/`).
pub const TARGETS: &[&str] = &["target", "initiator", "nbd", "nbd-stream"];

/// Coverage instrumentation for libFuzzer, on stable rustc.
const RUSTFLAGS: &str = "-Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares \
    --cfg fuzzing -Cdebug-assertions -Coverflow-checks -Cforce-frame-pointers=yes";

#[derive(Args, Debug, Clone)]
pub struct FuzzArgs {
    /// Seconds of fuzzing in all, shared equally by the targets run (regressions not counted).
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Only this target (target, initiator, nbd).
    #[arg(long)]
    pub target: Option<String>,
    /// Replay the regression inputs only.
    #[arg(long)]
    pub regressions_only: bool,
    /// libFuzzer's random seed (default: a fresh one each run).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop each target after this many inputs (still within `--seconds`).
    #[arg(long)]
    pub runs: Option<u64>,
}

impl FuzzArgs {
    /// The bounded pass of `cargo xtask test`: a fixed seed and a fixed number of inputs per
    /// target, so that on a clean clone (an empty corpus) the pass is the same every run and a
    /// red CI is reproducible. Exploring is the job of longer runs with fresh seeds.
    pub fn short() -> FuzzArgs {
        FuzzArgs { seconds: 90, target: None, regressions_only: false, seed: Some(1), runs: Some(12_000) }
    }
}

/// What one target's run found.
#[derive(Debug, Default)]
struct Outcome {
    inputs: u64,
    frames: u64,
    crashes: u64,
}

fn host_triple() -> Result<String> {
    let out = Command::new("rustc").arg("-vV").output().context("running rustc -vV")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| l.strip_prefix("host: ")).map(str::to_owned).context("rustc -vV names no host")
}

/// `cargo build` of the fuzz targets, through `prefix` (e.g. `nice`) when not empty.
fn build_command(root: &Path, triple: &str, prefix: &[&str]) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(cargo);
            c
        }
        None => Command::new(cargo),
    };
    cmd.current_dir(root.join("fuzz"))
        .args(["build", "--release", "--bins", "--target", triple])
        // Only the target's code is instrumented: with an explicit --target, RUSTFLAGS skip
        // build scripts and proc macros.
        .env("RUSTFLAGS", RUSTFLAGS)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env("CARGO_TARGET_DIR", root.join("fuzz/target"));
    cmd
}

const BUILD_FAILED: &str = "building the fuzz targets failed; libfuzzer-sys needs a C++ compiler (c++)";

fn build(root: &Path, triple: &str) -> Result<PathBuf> {
    eprintln!("fuzz: building the fuzz targets (release, coverage-instrumented, stable toolchain)");
    let status = build_command(root, triple, &[]).status().context("running cargo build for fuzz/")?;
    if !status.success() {
        bail!("{BUILD_FAILED} ({status})");
    }
    Ok(root.join("fuzz/target").join(triple).join("release"))
}

/// Builds the fuzz targets at the lowest priority, cargo's output in `log`: `cargo xtask test`
/// runs this while the VM guests run, on the cores their vCPUs leave idle (the fuzz step then
/// finds them built). On failure the error carries the log's tail.
pub fn prebuild(root: &Path, log: &Path) -> Result<()> {
    let triple = host_triple()?;
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let status = build_command(root, &triple, &["nice", "-n", "19"])
        .stdout(out.try_clone()?)
        .stderr(out)
        .status()
        .context("running cargo build for fuzz/")?;
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        bail!("{BUILD_FAILED} ({status}); the last lines of {}:\n{}", log.display(), tail(&text, 30));
    }
    Ok(())
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Parses the harness's counters and libFuzzer's final stats from a run's output.
fn parse_stats(log: &str) -> (u64, u64) {
    let mut frames = 0;
    let mut units = 0;
    for line in log.lines() {
        if let Some(rest) = line.strip_prefix("tyche-fuzz-stats: ") {
            for kv in rest.split_whitespace() {
                if let Some(v) = kv.strip_prefix("frames=") {
                    frames = v.parse().unwrap_or(0);
                }
            }
        }
        if let Some(v) = line.strip_prefix("stat::number_of_executed_units:") {
            units = v.trim().parse().unwrap_or(0);
        }
    }
    (units, frames)
}

/// Runs `bin` with `args`, its output to `log`; returns whether it exited cleanly and the output.
fn run_logged(bin: &Path, args: &[String], log: &Path) -> Result<(bool, String)> {
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let status = Command::new(bin)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    Ok((status.success(), text))
}

fn tail(text: &str, lines: usize) -> String {
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Saves a crash input under `fuzz/regressions/<target>/` and says how to replay it.
fn save_crash(root: &Path, bins: &Path, target: &str, artifacts: &Path, log: &str) -> Result<()> {
    let regressions = root.join("fuzz/regressions").join(target);
    std::fs::create_dir_all(&regressions)?;
    let found = files_in(artifacts)
        .into_iter()
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| !n.ends_with(".log")))
        .collect::<Vec<_>>();
    eprintln!("fuzz: {target}: CRASH\n{}", tail(log, 40));
    for f in found {
        let name = f.file_name().expect("a file").to_owned();
        let dst = regressions.join(&name);
        std::fs::copy(&f, &dst)?;
        std::fs::remove_file(&f)?;
        eprintln!(
            "fuzz: {target}: input saved as {}\nfuzz: reproduce: {} {}\nfuzz:        or: cargo test -p tyche-fuzz --test regressions",
            dst.strip_prefix(root).unwrap_or(&dst).display(),
            bins.join(target).strip_prefix(root).unwrap_or(&bins.join(target)).display(),
            dst.strip_prefix(root).unwrap_or(&dst).display(),
        );
    }
    Ok(())
}

fn run_target(root: &Path, bins: &Path, target: &str, seconds: u64, args: &FuzzArgs) -> Result<Outcome> {
    let bin = bins.join(target);
    let fuzz = root.join("fuzz");
    let artifacts = fuzz.join("artifacts").join(target);
    std::fs::create_dir_all(&artifacts)?;
    let prefix = format!("{}/", artifacts.display());
    let common = [
        "-rss_limit_mb=3072".to_owned(),
        "-timeout=30".to_owned(),
        format!("-artifact_prefix={prefix}"),
        "-print_final_stats=1".to_owned(),
    ];
    let mut out = Outcome::default();

    // Every regression input first, each once.
    let regressions = files_in(&fuzz.join("regressions").join(target));
    if !regressions.is_empty() {
        let mut replay: Vec<String> = common.to_vec();
        replay.extend(regressions.iter().map(|p| p.display().to_string()));
        let log = artifacts.join("regressions.log");
        let (ok, text) = run_logged(&bin, &replay, &log)?;
        let (_, frames) = parse_stats(&text);
        out.inputs += regressions.len() as u64;
        out.frames += frames;
        if !ok {
            out.crashes += 1;
            eprintln!("fuzz: {target}: a regression input fails\n{}", tail(&text, 40));
            eprintln!("fuzz: log: {}", log.display());
            return Ok(out);
        }
        eprintln!("fuzz: {target}: {} regression inputs pass", regressions.len());
    }
    if args.regressions_only || seconds == 0 {
        return Ok(out);
    }

    // Then fuzz: new inputs go to the (ignored) corpus, seeded by the committed seeds and the
    // regressions.
    let corpus = fuzz.join("corpus").join(target);
    std::fs::create_dir_all(&corpus)?;
    let mut fuzz_args: Vec<String> = common.to_vec();
    fuzz_args.push(format!("-max_total_time={seconds}"));
    fuzz_args.push("-max_len=16384".to_owned());
    if let Some(seed) = args.seed {
        fuzz_args.push(format!("-seed={seed}"));
    }
    if let Some(runs) = args.runs {
        fuzz_args.push(format!("-runs={runs}"));
    }
    fuzz_args.push(corpus.display().to_string());
    for dir in [fuzz.join("seeds").join(target), fuzz.join("regressions").join(target)] {
        if dir.is_dir() {
            fuzz_args.push(dir.display().to_string());
        }
    }
    let log = artifacts.join("fuzz.log");
    let (ok, text) = run_logged(&bin, &fuzz_args, &log)?;
    let (units, frames) = parse_stats(&text);
    out.inputs += units;
    out.frames += frames;
    if !ok {
        out.crashes += 1;
        save_crash(root, bins, target, &artifacts, &text)?;
        eprintln!("fuzz: log: {}", log.display());
    }
    Ok(out)
}

pub fn run(root: &Path, args: &FuzzArgs) -> Result<()> {
    let targets: Vec<&str> = match &args.target {
        Some(t) if TARGETS.contains(&t.as_str()) => vec![TARGETS[TARGETS.iter().position(|x| x == t).expect("listed")]],
        Some(t) => bail!("no fuzz target {t:?} (targets: {})", TARGETS.join(", ")),
        None => TARGETS.to_vec(),
    };
    let triple = host_triple()?;
    let bins = build(root, &triple)?;
    let share = args.seconds / targets.len() as u64;
    let mut total = Outcome::default();
    for t in &targets {
        let started = std::time::Instant::now();
        let o = run_target(root, &bins, t, share.max(u64::from(args.seconds > 0)), args)?;
        let secs = started.elapsed().as_secs_f64().max(0.001);
        eprintln!(
            "fuzz: {t}: {} inputs ({:.0}/s), {} frames ({:.0}/s), {} crashes",
            o.inputs,
            o.inputs as f64 / secs,
            o.frames,
            o.frames as f64 / secs,
            o.crashes
        );
        total.inputs += o.inputs;
        total.frames += o.frames;
        total.crashes += o.crashes;
    }
    println!(
        "fuzz: {} targets, {} inputs, {} frames, {} crashes",
        targets.len(),
        total.inputs,
        total.frames,
        total.crashes
    );
    if total.crashes > 0 {
        bail!("the fuzzer found {} crash(es); inputs are under fuzz/regressions/", total.crashes);
    }
    Ok(())
}
