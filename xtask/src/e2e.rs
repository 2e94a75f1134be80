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

use anyhow::{ensure, Context, Result};
use clap::Args;

use crate::disk::{progress_bar, run, NbdDisk, Tree};
use crate::lab::{ip, Lab};
use crate::stack::{self, prepare, start_initiator, start_tyched, Link, Running};

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
    /// The standard run: 2 NICs at MTU 3000, 3% loss, 64 MiB per phase, packages already installed.
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
    fn socket(&self) -> PathBuf {
        self.work.join("nbd.sock")
    }

    fn start_initiator(&self, loss: Option<f64>, log: &str) -> Result<Running> {
        let mut extra = vec!["--no-path-timeout".to_string(), "30".to_string()];
        if let Some(loss) = loss {
            extra.extend(["--inject-loss".to_string(), loss.to_string()]);
        }
        start_initiator(self.root, self.lab, Link::Xdp, "e2e", &self.socket(), self.work.join(log), &extra)
    }
}

pub fn e2e(root: &Path, args: &E2eArgs) -> Result<()> {
    ensure!(args.nics >= 2, "e2e needs at least 2 NICs to fail one over");
    prepare(root, "e2e", args.no_install)?;

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
    let stats = s.work.join("tyched.sock");
    let mut tyched = start_tyched(s.root, s.lab, Link::Xdp, "e2e=ram:1G", &stats, s.work.join("tyched.log"))?;
    let disk_work = s.work.join("disk");
    let first = Tree::new(0xe2e1, 150, args.data_mib << 20);
    let second = Tree::new(0xe2e2, 150, args.data_mib << 20);

    // Phase 1: a clean network.
    eprintln!("e2e: phase 1: ext4 over tyche, detach, re-attach, fsck, verify");
    let mut init = s.start_initiator(None, "init-1.log")?;
    let mut disk = NbdDisk::attach(&s.socket(), &disk_work)?;
    disk.mkfs()?;
    let mnt = disk.mount()?;
    first.write(&mnt, &mut progress_bar("write", first.bytes()))?;
    disk.umount()?;
    disk.detach()?;
    init.daemon.stop();
    let mut init = s.start_initiator(None, "init-2.log")?;
    let mut disk = NbdDisk::attach(&s.socket(), &disk_work)?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    first.verify(&mnt, &mut progress_bar("verify", first.bytes()))?;
    disk.umount()?;
    disk.detach()?;
    init.daemon.stop();

    // Phase 2: loss both ways, and a link going down in the middle of the copy.
    eprintln!("e2e: phase 2: {}% loss each way, {} down mid-copy", args.loss * 100.0, s.lab.pairs[1].target_if);
    let mut init = s.start_initiator(Some(args.loss), "init-3.log")?;
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
    init.check_alive()?;
    init.daemon.stop();
    let log = fs::read_to_string(&init.log).unwrap_or_default();
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
    let mut init = s.start_initiator(Some(args.loss), "init-4.log")?;
    let mut disk = NbdDisk::attach(&s.socket(), &disk_work)?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    first.verify(&mnt, &mut progress_bar("verify 1", first.bytes()))?;
    second.verify(&mnt.join("phase2"), &mut progress_bar("verify 2", second.bytes()))?;
    disk.umount()?;
    disk.detach()?;
    init.daemon.stop();
    tyched.check_alive()?;
    let report = run(Command::new(stack::bin(s.root, "tyched")).args(["stats", "--socket"]).arg(&stats))?;
    for line in report.lines().filter(|l| l.contains("retransmits") || l.contains("NICs")) {
        eprintln!("  {}", line.trim());
    }
    tyched.daemon.stop();
    Ok(())
}
