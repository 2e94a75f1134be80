//! `cargo xtask demo`: Tyche's main job on an embedded default, start to finish.
//!
//! Installs what is missing, builds in release mode, brings up a 2-NIC veth lab, starts `tyched`
//! with a RAM export in the target namespace and `tyche-init serve-nbd` in the initiator namespace
//! (AF_XDP on both NICs), puts ext4 on it through nbdfuse and a loop device (ublk where the kernel
//! has it is the VM test's job), copies data in and reads it back with a progress bar, prints a
//! report, and tears everything down, also on Ctrl-C or failure.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use crate::disk::{progress_bar, run, NbdDisk, Tree};
use crate::lab::Lab;

/// Set by the Ctrl-C handler; long steps check it and unwind, so every guard tears down.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Size of the RAM export in MiB.
    #[arg(long, default_value_t = 1024)]
    export_mib: u64,
    /// MiB of files to copy in and read back.
    #[arg(long, default_value_t = 256)]
    data_mib: u64,
    /// Veth pairs (NICs) in the lab.
    #[arg(long, default_value_t = 2)]
    nics: u32,
    /// MTU of the lab links.
    #[arg(long, default_value_t = 3000)]
    mtu: u32,
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
}

/// A child process killed (and reaped) when dropped.
pub(crate) struct Daemon {
    name: &'static str,
    child: Child,
}

impl Daemon {
    pub(crate) fn spawn(name: &'static str, cmd: &mut Command, log: &Path) -> Result<Daemon> {
        let out = fs::File::create(log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Daemon { name, child })
    }

    pub(crate) fn check_alive(&mut self, log: &Path) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let tail = fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(15).collect();
            bail!(
                "{} exited ({status}); its log ends:\n{}",
                self.name,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }

    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then SIGKILL after a grace period.
    pub(crate) fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Installs the packages in `.ci/packages` that are missing (root only).
pub fn ensure_packages(root: &Path) -> Result<()> {
    let list = fs::read_to_string(root.join(".ci/packages")).context("reading .ci/packages")?;
    let wanted: Vec<&str> = list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let missing: Vec<&str> = wanted
        .into_iter()
        .filter(|p| {
            let q = Command::new("dpkg-query").args(["-W", "-f=${Status}", p]).output();
            !q.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("demo: installing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    Ok(())
}

fn interrupted() -> Result<()> {
    ensure!(!INTERRUPTED.load(Ordering::Relaxed), "interrupted");
    Ok(())
}

pub(crate) fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !ready()? {
        interrupted()?;
        ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

pub fn demo(root: &Path, args: &DemoArgs) -> Result<()> {
    ensure!(crate::suite::is_root(), "the demo needs root (network namespaces, AF_XDP, loop devices)");
    if !args.no_install {
        ensure_packages(root)?;
    }
    eprintln!("demo: building tyched and tyche-init (release)");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "--quiet", "-p", "tyched", "-p", "tyche-init"])
        .current_dir(root)
        .status()?;
    ensure!(status.success(), "cargo build failed");
    let bin = |name: &str| crate::xdp::target_dir(root).join("release").join(name);

    let work = PathBuf::from("/run/tyche-demo");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let pid = std::process::id();
    let lab = Lab::create(&format!("tyche-demo-t{pid}"), &format!("tyche-demo-i{pid}"), args.nics, args.mtu)?;
    eprintln!(
        "demo: lab up: {} veth pairs at MTU {} ({} | {})",
        lab.pairs.len(),
        args.mtu,
        lab.target_ns,
        lab.initiator_ns
    );

    let tlog = work.join("tyched.log");
    let mut tcmd = Command::new("ip");
    tcmd.args(["netns", "exec", &lab.target_ns]).arg(bin("tyched")).arg("serve");
    tcmd.arg("--export").arg(format!("demo=ram:{}M", args.export_mib));
    tcmd.arg("--stats-socket").arg(work.join("tyched.sock"));
    for p in &lab.pairs {
        tcmd.arg("--iface").arg(&p.target_if);
    }
    let mut tyched = Daemon::spawn("tyched", &mut tcmd, &tlog)?;
    wait_for("tyched's stats socket", Duration::from_secs(20), || {
        tyched.check_alive(&tlog)?;
        Ok(work.join("tyched.sock").exists())
    })?;
    eprintln!(
        "demo: tyched serving 'demo' ({} MiB of RAM) on {}",
        args.export_mib,
        lab.pairs.iter().map(|p| p.target_if.as_str()).collect::<Vec<_>>().join(", ")
    );

    let socket = work.join("nbd.sock");
    let ilog = work.join("tyche-init.log");
    let mut icmd = Command::new("ip");
    icmd.args(["netns", "exec", &lab.initiator_ns]).arg(bin("tyche-init")).arg("serve-nbd");
    icmd.arg("--socket").arg(&socket).args(["--export", "demo"]);
    for p in &lab.pairs {
        icmd.arg("--iface").arg(&p.initiator_if).arg("--target").arg(p.target_mac.to_string());
    }
    let mut init = Daemon::spawn("tyche-init", &mut icmd, &ilog)?;
    wait_for("tyche-init's NBD socket", Duration::from_secs(30), || {
        init.check_alive(&ilog)?;
        Ok(socket.exists())
    })?;
    eprintln!("demo: tyche-init attached 'demo' over {} channels, NBD on {}", lab.pairs.len(), socket.display());

    let tree = Tree::new(0x0de0_7e5c, 400, args.data_mib << 20);
    let started = Instant::now();
    let mut disk = NbdDisk::attach(&socket, &work)?;
    eprintln!("demo: {} is the disk ({} MiB), making ext4", disk.dev, disk.size()? >> 20);
    disk.mkfs()?;
    let mnt = disk.mount()?;
    interrupted()?;
    let write_start = Instant::now();
    let mut bar = progress_bar("copy in", tree.bytes());
    tree.write(&mnt, &mut |n| {
        if !INTERRUPTED.load(Ordering::Relaxed) {
            bar(n)
        }
    })?;
    interrupted()?;
    disk.umount()?; // flushes everything to the export
    let write_secs = write_start.elapsed().as_secs_f64();
    disk.drop_caches()?; // fsck and the read-back must go over Tyche, not to local caches
    disk.fsck()?;
    disk.drop_caches()?;
    let mnt = disk.mount()?;
    let read_start = Instant::now();
    tree.verify(&mnt, &mut progress_bar("read back", tree.bytes()))?;
    let read_secs = read_start.elapsed().as_secs_f64();
    let dev = disk.dev.clone();
    disk.detach()?;
    tyched.check_alive(&tlog)?;
    init.check_alive(&ilog)?;

    let stats = run(Command::new(bin("tyched")).args(["stats", "--socket"]).arg(work.join("tyched.sock")))
        .unwrap_or_else(|e| format!("(stats unavailable: {e:#})"));
    let mb = tree.bytes() as f64 / 1e6;
    println!();
    println!("Tyche demo report");
    println!("  device        {dev} (nbdfuse over tyche-init's NBD socket; no ublk in this kernel)");
    println!("  export        'demo', {} MiB of RAM in tyched", args.export_mib);
    for (k, p) in lab.pairs.iter().enumerate() {
        println!(
            "  channel {k}     {} -> {} ({} -> {}), NUMA node: unknown (veth)",
            p.initiator_if, p.target_if, p.initiator_mac, p.target_mac
        );
    }
    println!(
        "  copy in       {mb:.0} MB in {write_secs:.2} s ({:.0} MB/s, through ext4, until unmounted)",
        mb / write_secs
    );
    println!(
        "  read back     {mb:.0} MB in {read_secs:.2} s ({:.0} MB/s, caches dropped first), every byte verified, fsck clean",
        mb / read_secs
    );
    println!("  total         {:.1} s", started.elapsed().as_secs_f64());
    println!("  target stats:");
    for line in stats.lines() {
        println!("    {line}");
    }
    drop(init);
    drop(tyched);
    drop(lab);
    let _ = fs::remove_dir_all(&work);
    println!("demo: ok, lab torn down");
    Ok(())
}
