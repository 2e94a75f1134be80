//! `vm-test`'s first guest test: `/dev/ublkbN` with ext4 on it, inside the VM.
//!
//! A 2-NIC veth lab in two namespaces, `tyched` with a RAM export on AF_XDP, `tyche-init attach`
//! creating `/dev/ublkbN`; then mkfs.ext4, mount, a tree of files with known contents, unmount,
//! `e2fsck -fn` clean, remount and verify, unmount, detach (the attach process must exit 0).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::disk::{BlockFs, Tree};
use crate::lab::Lab;
use crate::stack::{self, Daemon, Link};

/// Runs the test; returns the summary for the final line (`features: ...`).
pub fn guest() -> Result<String> {
    // Binaries come from `$CARGO_TARGET_DIR/release` (`/tyche` in the guest).
    let root = Path::new("/");
    let work = PathBuf::from("/tmp/ublk-test");
    fs::create_dir_all(&work)?;
    let lab = Lab::create("vmt", "vmi", 2, 1500)?;
    let stats = work.join("tyched.sock");
    let mut target = stack::start_tyched(root, &lab, Link::Xdp, "vm=ram:256M", &stats, work.join("tyched.log"))?;

    let log = work.join("attach.log");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.initiator_ns]).arg(stack::bin(root, "tyche-init")).arg("attach");
    for p in &lab.pairs {
        cmd.arg("--iface").arg(&p.initiator_if).arg("--target").arg(p.target_mac.to_string());
    }
    cmd.args(["--export", "vm", "--queues", "2", "--depth", "32"]).env("TYCHE_LOG", "info");
    let mut attach = Daemon::spawn("tyche-init attach", &mut cmd, &log)?;
    let mut dev = String::new();
    stack::wait_for("/dev/ublkbN", Duration::from_secs(60), || {
        attach.check_alive(&log)?;
        let text = fs::read_to_string(&log).unwrap_or_default();
        if let Some(d) = text.lines().find(|l| l.starts_with("/dev/ublkb")) {
            dev = d.trim().to_string();
        }
        Ok(!dev.is_empty() && text.contains("ublk device started") && Path::new(&dev).exists())
    })?;
    let text = fs::read_to_string(&log)?;
    let features = text
        .lines()
        .find_map(|l| l.split("features=").nth(1))
        .map(|f| f.split_whitespace().next().unwrap_or("").trim_matches('"').to_string())
        .context("tyche-init did not log the ublk features it uses")?;
    println!("ublk: {dev} started (features {features})");

    let mut disk = BlockFs::new(&dev, &work);
    let size = disk.size()?;
    ensure!(size == 256 << 20, "{dev} is {size} bytes, the export 256 MiB");
    let tree = Tree::new(0x0b1c_0de5, 120, 48 << 20);
    disk.mkfs()?;
    let mnt = disk.mount()?;
    tree.write(&mnt, &mut |_| {})?;
    disk.umount()?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    tree.verify(&mnt, &mut |_| {})?;
    disk.umount()?;
    println!("ublk: ext4 written, fsck clean, {} MiB verified", tree.bytes() >> 20);
    target.check_alive()?;

    crate::disk::run(Command::new(stack::bin(root, "tyche-init")).args(["detach", &dev]))?;
    let status = attach.wait(Duration::from_secs(30)).context("tyche-init attach did not exit after detach")?;
    if !status.success() {
        let tail = fs::read_to_string(&log).unwrap_or_default();
        bail!("tyche-init attach exited with {status} after detach:\n{tail}");
    }
    ensure!(!Path::new(&dev).exists(), "{dev} still exists after detach");
    Ok(format!("features: {features}"))
}
