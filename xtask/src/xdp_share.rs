//! `cargo xtask xdp-share`: the safety rails of a NIC shared with other traffic, on a one-NIC veth lab (root).
//!
//! `tyched` serves a RAM export, `tyche-init serve-nbd` attaches it over AF_XDP, and fio writes
//! and verifies through the NBD socket. While fio runs:
//! 1. `tyche-init discover --iface tyi0` (on the link that carries the live attachment) must
//!    list the export and the target's MAC;
//! 2. a second `tyched` on `tyt0` (the NIC the first serves) must be refused: exit status 69
//!    (EX_UNAVAILABLE) and one `Error:` line naming the first tyched's pid and queue 0.
//!
//! Then fio must end clean (no verify error), a fresh write and read-back through the same
//! attachment must work (the refused tyched's exit took nothing away), both daemons must still
//! run, and once they stop no XDP program is left on either NIC. Last, a tyched killed with
//! SIGKILL leaves its program behind, and the next tyched on that NIC must start anyway (the
//! program has no live user) and leave nothing when it stops. Last line:
//! `xdp-share: discover ok beside a live attachment, second tyched refused (exit 69), fio verify ok, no xdp left`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Args;

use crate::lab::Lab;
use crate::stack::{bin, fio_nbd, fio_result, prepare, start_initiator, start_tyched, wait_for, Daemon, Link, Running};

/// The export attached, and its size.
const EXPORT: &str = "share";
/// EX_UNAVAILABLE: tyched's exit status for a NIC queue another Tyche process holds.
const EX_UNAVAILABLE: i32 = 69;

#[derive(Args, Debug)]
pub struct XdpShareArgs {
    /// Seconds fio writes and verifies while discover and the second tyched run.
    #[arg(long, default_value_t = 8)]
    fio_secs: u64,
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
}

impl XdpShareArgs {
    /// The run `cargo xtask test` makes (packages already installed).
    pub fn standard() -> XdpShareArgs {
        XdpShareArgs { fio_secs: 8, no_install: true }
    }
}

pub fn xdp_share(root: &Path, args: &XdpShareArgs) -> Result<()> {
    let begun = Instant::now();
    prepare(root, "xdp-share", args.no_install)?;
    let pid = std::process::id();
    let work = PathBuf::from(format!("/run/tyche-xdp-share-{pid}"));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let lab = Lab::create(&format!("tys-t{pid}"), &format!("tys-i{pid}"), 1, 3000)?;
    let result = run(root, &lab, &work, args);
    drop(lab);
    match &result {
        Ok(()) => {
            let _ = fs::remove_dir_all(&work);
        }
        Err(_) => eprintln!("xdp-share: logs kept in {}", work.display()),
    }
    result?;
    eprintln!("xdp-share: took {:.1} s in all", begun.elapsed().as_secs_f64());
    println!(
        "xdp-share: discover ok beside a live attachment, second tyched refused (exit {EX_UNAVAILABLE}), \
         fio verify ok, no xdp left"
    );
    Ok(())
}

/// Runs `cmd` to its end (at most 30 s) with its output in `log`; returns the exit code and the
/// output.
fn finish(what: &'static str, cmd: &mut Command, log: &Path) -> Result<(Option<i32>, String)> {
    let status = Daemon::spawn(what, cmd, log)?.wait(Duration::from_secs(30))?;
    Ok((status.code(), fs::read_to_string(log)?))
}

/// The `ip link` lines of `dev` in `ns` that mention XDP (none when no program is attached).
fn xdp_lines(ns: &str, dev: &str) -> Result<String> {
    let out = Command::new("ip").args(["-n", ns, "link", "show", dev]).output().context("ip link show")?;
    ensure!(out.status.success(), "ip -n {ns} link show {dev} failed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    Ok(text.lines().filter(|l| l.contains("xdp")).collect::<Vec<_>>().join("\n"))
}

fn tyched_cmd(root: &Path, lab: &Lab, export: &str, stats: &Path) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.target_ns]).arg(bin(root, "tyched")).arg("serve");
    cmd.args(["--export", export, "--iface", &lab.pairs[0].target_if]).arg("--stats-socket").arg(stats);
    cmd
}

fn check_fio(out: &Path, what: &str, log: &Path) -> Result<()> {
    let (err, written, read) = fio_result(out)?;
    let text = fs::read_to_string(log).unwrap_or_default();
    ensure!(err == 0, "fio ({what}) reports error {err}:\n{text}");
    ensure!(written > 0 && read > 0, "fio ({what}) wrote {written} B and verified {read} B");
    eprintln!("xdp-share: fio ({what}) ok: {} KiB written, {} KiB read back and verified", written >> 10, read >> 10);
    Ok(())
}

fn run(root: &Path, lab: &Lab, work: &Path, args: &XdpShareArgs) -> Result<()> {
    let pair = &lab.pairs[0];
    let stats = work.join("tyched.sock");
    let mut tyched =
        start_tyched(root, lab, Link::Xdp, &format!("{EXPORT}=ram:256M"), &stats, work.join("tyched.log"))?;
    let socket = work.join("nbd.sock");
    let mut init = start_initiator(root, lab, Link::Xdp, EXPORT, &socket, work.join("init.log"), &[])?;

    let job: Vec<String> =
        ["--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=64m", "--time_based", "--verify_backlog=256"]
            .iter()
            .map(|s| s.to_string())
            .chain([format!("--runtime={}", args.fio_secs)])
            .collect();
    let (mut fio, fio_out) = fio_nbd(lab, work, EXPORT, &socket, "verify", &job)?;
    std::thread::sleep(Duration::from_secs(1));

    // 1. discover on the initiator's link, beside its live AF_XDP socket.
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.initiator_ns]).arg(bin(root, "tyche-init"));
    cmd.args(["discover", "--iface", &pair.initiator_if, "--wait", "1"]);
    let (code, out) = finish("tyche-init discover", &mut cmd, &work.join("discover.log"))?;
    ensure!(code == Some(0), "tyche-init discover beside the live attachment failed ({code:?}):\n{out}");
    let target = format!("{} target {}", pair.initiator_if, pair.target_mac);
    ensure!(
        out.contains(&target) && out.lines().any(|l| l.trim_start().starts_with(EXPORT)),
        "tyche-init discover did not list export {EXPORT} of {target}:\n{out}"
    );
    eprintln!("xdp-share: discover on {} beside the live attachment lists {EXPORT}", pair.initiator_if);

    // 2. A second tyched on the NIC the first serves: refused, one clear line.
    let tpid = tyched.daemon.pid();
    let mut cmd = tyched_cmd(root, lab, "other=ram:16M", &work.join("other.sock"));
    let (code, out) = finish("the second tyched", &mut cmd, &work.join("second.log"))?;
    ensure!(
        code == Some(EX_UNAVAILABLE),
        "a second tyched on {} exited {code:?}, not {EX_UNAVAILABLE}:\n{out}",
        pair.target_if
    );
    let errors: Vec<&str> = out.lines().filter(|l| l.starts_with("Error:")).collect();
    // The first tyched's pid, through `ip netns exec` (which execs it: the same process).
    let want = format!("{} queue 0 is served by another Tyche process (pid {tpid})", pair.target_if);
    ensure!(
        errors.len() == 1 && errors[0].contains(&want),
        "the second tyched's refusal is not one line naming the first ({want}):\n{out}"
    );
    eprintln!("xdp-share: second tyched refused: {}", errors[0]);

    // fio across both, then a fresh write and read-back after the second tyched is gone.
    let status = fio.wait(Duration::from_secs(args.fio_secs + 30)).context("fio")?;
    ensure!(status.success(), "fio failed ({status}):\n{}", fs::read_to_string(work.join("verify.log"))?);
    check_fio(&fio_out, "during discover and the second tyched", &work.join("verify.log"))?;
    let after: Vec<String> =
        ["--rw=write", "--bs=64k", "--size=16m", "--offset=128m"].iter().map(|s| s.to_string()).collect();
    let (mut fio, after_out) = fio_nbd(lab, work, EXPORT, &socket, "after", &after)?;
    let status = fio.wait(Duration::from_secs(60)).context("fio after")?;
    ensure!(
        status.success(),
        "fio after the refusal failed ({status}):\n{}",
        fs::read_to_string(work.join("after.log"))?
    );
    check_fio(&after_out, "after the refused tyched exited", &work.join("after.log"))?;
    tyched.check_alive()?;
    init.check_alive()?;

    // Everyone stops: no program is left on either NIC.
    init.daemon.stop();
    tyched.daemon.stop();
    for (ns, dev) in [(&lab.initiator_ns, &pair.initiator_if), (&lab.target_ns, &pair.target_if)] {
        let left = xdp_lines(ns, dev)?;
        ensure!(left.is_empty(), "an XDP program is left on {dev} after every Tyche process stopped:\n{left}");
    }

    // A killed tyched leaves its program; the next one on the NIC starts anyway.
    killed_then_restarted(root, lab, work)?;
    Ok(())
}

fn killed_then_restarted(root: &Path, lab: &Lab, work: &Path) -> Result<()> {
    let dev = &lab.pairs[0].target_if;
    for (round, name) in ["killed", "next"].into_iter().enumerate() {
        let stats = work.join(format!("{name}.sock"));
        let _ = fs::remove_file(&stats);
        let log = work.join(format!("{name}.log"));
        let mut t =
            Running { daemon: Daemon::spawn("tyched", &mut tyched_cmd(root, lab, "k=ram:16M", &stats), &log)?, log };
        wait_for("tyched", Duration::from_secs(30), || {
            t.check_alive()?;
            Ok(stats.exists())
        })?;
        if round == 0 {
            t.daemon.kill()?;
            ensure!(!xdp_lines(&lab.target_ns, dev)?.is_empty(), "SIGKILL is expected to leave the program on {dev}");
        } else {
            t.daemon.stop();
        }
    }
    let left = xdp_lines(&lab.target_ns, dev)?;
    ensure!(left.is_empty(), "an XDP program is left on {dev} after the tyched that replaced a killed one:\n{left}");
    eprintln!("xdp-share: a tyched starts on a NIC a killed tyched left its program on, and leaves none");
    Ok(())
}
