//! `cargo xtask demo`: Tyche's main job on an embedded default, start to finish.
//!
//! Installs what is missing, builds in release mode, brings up a 2-NIC veth lab, starts `tyched`
//! with a RAM export in the target namespace and `tyche-init serve-nbd` in the initiator namespace
//! (AF_XDP on both NICs), puts ext4 on it through nbdfuse and a loop device (ublk where the kernel
//! has it is the VM test's job), copies data in and reads it back with a progress bar, prints a
//! report, and tears everything down, also on Ctrl-C or failure.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::Result;
use clap::Args;

use crate::disk::{progress_bar, run, NbdDisk, Tree};
use crate::lab::Lab;
use crate::stack::{self, interrupted, prepare, start_initiator, start_tyched, Link, INTERRUPTED};

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

pub fn demo(root: &Path, args: &DemoArgs) -> Result<()> {
    eprintln!("demo: building tyched and tyche-init (release)");
    prepare(root, "the demo", args.no_install)?;
    let bin = |name: &str| stack::bin(root, name);

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

    let stats = work.join("tyched.sock");
    let export = format!("demo=ram:{}M", args.export_mib);
    let mut tyched = start_tyched(root, &lab, Link::Xdp, &export, &stats, work.join("tyched.log"))?;
    eprintln!(
        "demo: tyched serving 'demo' ({} MiB of RAM) on {}",
        args.export_mib,
        lab.pairs.iter().map(|p| p.target_if.as_str()).collect::<Vec<_>>().join(", ")
    );

    let socket = work.join("nbd.sock");
    let mut init = start_initiator(root, &lab, Link::Xdp, "demo", &socket, work.join("tyche-init.log"), &[])?;
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
    tyched.check_alive()?;
    init.check_alive()?;

    let stats = run(Command::new(bin("tyched")).args(["stats", "--socket"]).arg(&stats))
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
