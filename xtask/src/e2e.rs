//! `cargo xtask e2e`: ext4 over Tyche, end to end, on a 2-NIC veth lab (root).
//!
//! 1. `tyched` with a RAM export in the target namespace, `tyche-init serve-nbd` (AF_XDP on every
//!    link) in the initiator namespace; nbdfuse → loop → `mkfs.ext4` → mount; a tree of files with
//!    known contents; unmount, detach, stop the initiator; start it again (re-attach), drop every
//!    cache, `e2fsck -fn` (clean), verify every byte.
//! 2. The same with frame loss injected in both directions on every link, and one veth taken down
//!    in the middle of the copy: the writes fail over to the other link. After re-attaching, the
//!    filesystem is checked and both trees are verified.
//!
//! The loss is injected by the initiator's fault-injection transport wrapper (`tyche-init
//! --inject-loss`, `tyche_transport::FaultInjector`), on transmit and on receive: AF_XDP's copy-mode
//! transmit bypasses the qdisc, so `tc netem` would not see Tyche frames.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use clap::Args;

use crate::demo::{ensure_packages, wait_for, Daemon};
use crate::disk::{progress_bar, run, NbdDisk, Tree};
use crate::lab::{ip, Lab};

#[derive(Args, Debug)]
pub struct E2eArgs {
    /// Veth pairs (NICs).
    #[arg(long, default_value_t = 2)]
    nics: u32,
    /// MTU of the links.
    #[arg(long, default_value_t = 3000)]
    mtu: u32,
    /// Frame loss in the second phase, each way.
    #[arg(long, default_value_t = 0.03)]
    loss: f64,
    /// MiB of files per phase.
    #[arg(long, default_value_t = 64)]
    data_mib: u64,
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
}

impl E2eArgs {
    /// The run: 2 NICs at MTU 3000, 3% loss, 64 MiB per phase, packages already installed.
    pub fn standard() -> E2eArgs {
        E2eArgs { nics: 2, mtu: 3000, loss: 0.03, data_mib: 64, no_install: true }
    }
}

struct Stack<'a> {
    root: &'a Path,
    work: PathBuf,
    lab: &'a Lab,
}

impl Stack<'_> {
    fn bin(&self, name: &str) -> PathBuf {
        crate::xdp::target_dir(self.root).join("release").join(name)
    }

    fn socket(&self) -> PathBuf {
        self.work.join("nbd.sock")
    }

    fn start_initiator(&self, loss: Option<f64>, log: &str) -> Result<(Daemon, PathBuf)> {
        let log = self.work.join(log);
        let _ = fs::remove_file(self.socket());
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.lab.initiator_ns]).arg(self.bin("tyche-init")).arg("serve-nbd");
        cmd.arg("--socket").arg(self.socket()).args(["--export", "e2e", "--no-path-timeout", "30"]);
        for p in &self.lab.pairs {
            cmd.arg("--iface").arg(&p.initiator_if).arg("--target").arg(p.target_mac.to_string());
        }
        if let Some(loss) = loss {
            cmd.arg("--inject-loss").arg(loss.to_string());
        }
        cmd.env("TYCHE_LOG", "info");
        let mut d = Daemon::spawn("tyche-init", &mut cmd, &log)?;
        let sock = self.socket();
        wait_for("tyche-init's NBD socket", Duration::from_secs(60), || {
            d.check_alive(&log)?;
            Ok(sock.exists())
        })?;
        Ok((d, log))
    }
}

pub fn e2e(root: &Path, args: &E2eArgs) -> Result<()> {
    ensure!(crate::suite::is_root(), "e2e needs root (network namespaces, AF_XDP, loop devices)");
    ensure!(args.nics >= 2, "e2e needs at least 2 NICs to fail one over");
    if !args.no_install {
        ensure_packages(root)?;
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let st = Command::new(cargo)
        .args(["build", "--release", "--quiet", "-p", "tyched", "-p", "tyche-init"])
        .current_dir(root)
        .status()?;
    ensure!(st.success(), "cargo build failed");

    let pid = std::process::id();
    let work = PathBuf::from(format!("/run/tyche-e2e-{pid}"));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let lab = Lab::create(&format!("tyche-e2e-t{pid}"), &format!("tyche-e2e-i{pid}"), args.nics, args.mtu)?;
    let stack = Stack { root, work: work.clone(), lab: &lab };
    let result = phases(&stack, args);
    drop(lab);
    if result.is_ok() {
        let _ = fs::remove_dir_all(&work);
    } else {
        eprintln!("e2e: logs kept in {}", work.display());
    }
    result?;
    println!("e2e: ext4 over tyche ok ({} nics, loss {}%, failover ok)", args.nics, args.loss * 100.0);
    Ok(())
}

fn phases(s: &Stack<'_>, args: &E2eArgs) -> Result<()> {
    let tlog = s.work.join("tyched.log");
    let mut tcmd = Command::new("ip");
    tcmd.args(["netns", "exec", &s.lab.target_ns]).arg(s.bin("tyched")).arg("serve");
    tcmd.arg("--export").arg("e2e=ram:1G").arg("--stats-socket").arg(s.work.join("tyched.sock"));
    for p in &s.lab.pairs {
        tcmd.arg("--iface").arg(&p.target_if);
    }
    let mut tyched = Daemon::spawn("tyched", &mut tcmd, &tlog)?;
    wait_for("tyched", Duration::from_secs(30), || {
        tyched.check_alive(&tlog)?;
        Ok(s.work.join("tyched.sock").exists())
    })?;
    let disk_work = s.work.join("disk");
    let first = Tree::new(0xe2e1, 150, args.data_mib << 20);
    let second = Tree::new(0xe2e2, 150, args.data_mib << 20);

    // Phase 1: a clean network.
    eprintln!("e2e: phase 1: ext4 over tyche, detach, re-attach, fsck, verify");
    let (mut init, _) = s.start_initiator(None, "init-1.log")?;
    let mut disk = NbdDisk::attach(&s.socket(), &disk_work)?;
    disk.mkfs()?;
    let mnt = disk.mount()?;
    first.write(&mnt, &mut progress_bar("write", first.bytes()))?;
    disk.umount()?;
    disk.detach()?;
    init.stop();
    let (mut init, _) = s.start_initiator(None, "init-2.log")?;
    let mut disk = NbdDisk::attach(&s.socket(), &disk_work)?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    first.verify(&mnt, &mut progress_bar("verify", first.bytes()))?;
    disk.umount()?;
    disk.detach()?;
    init.stop();

    // Phase 2: loss both ways, and a link going down in the middle of the copy.
    eprintln!("e2e: phase 2: {}% loss each way, {} down mid-copy", args.loss * 100.0, s.lab.pairs[1].target_if);
    let (mut init, ilog) = s.start_initiator(Some(args.loss), "init-3.log")?;
    let mut disk = NbdDisk::attach(&s.socket(), &disk_work)?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    let victim = &s.lab.pairs[1];
    let cut = AtomicBool::new(false);
    let half = second.bytes() / 2;
    let mut bar = progress_bar("write", second.bytes());
    second.write(&mnt.join("phase2"), &mut |n| {
        bar(n);
        if n >= half && !cut.swap(true, Ordering::Relaxed) {
            if let Err(e) = ip(&["-n", &s.lab.target_ns, "link", "set", &victim.target_if, "down"]) {
                eprintln!("e2e: could not take {} down: {e:#}", victim.target_if);
            }
        }
    })?;
    ensure!(cut.load(Ordering::Relaxed), "the link was never taken down");
    disk.umount()?; // every write reaches the target over the surviving link
    disk.detach()?;
    init.check_alive(&ilog)?;
    init.stop();
    let log = fs::read_to_string(&ilog).unwrap_or_default();
    // tyche-init logs "channel dead; its requests go to the other channels" with the link name.
    let failed_over = log.lines().any(|l| l.contains("channel dead") && l.contains(victim.initiator_if.as_str()));
    ensure!(
        failed_over,
        "tyche-init's log shows no failover of {} after {} went down:\n{log}",
        victim.initiator_if,
        victim.target_if
    );
    ip(&["-n", &s.lab.target_ns, "link", "set", &victim.target_if, "up"]).context("bringing the link back")?;

    eprintln!("e2e: phase 2: re-attach (still lossy), fsck, verify both trees");
    let (mut init, _) = s.start_initiator(Some(args.loss), "init-4.log")?;
    let mut disk = NbdDisk::attach(&s.socket(), &disk_work)?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    first.verify(&mnt, &mut progress_bar("verify 1", first.bytes()))?;
    second.verify(&mnt.join("phase2"), &mut progress_bar("verify 2", second.bytes()))?;
    disk.umount()?;
    disk.detach()?;
    init.stop();
    tyched.check_alive(&tlog)?;
    let stats = run(Command::new(s.bin("tyched")).args(["stats", "--socket"]).arg(s.work.join("tyched.sock")))?;
    for line in stats.lines().filter(|l| l.contains("retransmits") || l.contains("NICs")) {
        eprintln!("  {}", line.trim());
    }
    tyched.stop();
    Ok(())
}
