//! `vm-test`'s first guest test: `/dev/ublkbN` with ext4 on it, inside the VM.
//!
//! A 2-NIC veth lab in two namespaces, `tyched` with a RAM export on AF_XDP, `tyche-init attach`
//! creating `/dev/ublkbN`; then mkfs.ext4, mount, a tree of files with known contents, unmount,
//! `e2fsck -fn` clean, remount and verify. Then recovery: mounted again, a writer thread writes
//! a second tree (each file synced), `tyche-init attach` is killed with SIGKILL mid-write, the
//! device must stay, `tyche-init attach --recover` takes it over, the writer must finish without
//! an error; unmount, `e2fsck -fn` clean, remount, both trees verified, unmount, detach (the
//! recovering process must exit 0 and the device go). Last, a device nobody recovers
//! (`--dev-id 5`, its server killed) must be deleted by `detach`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::disk::{run, BlockFs, Tree};
use crate::lab::Lab;
use crate::stack::{self, Daemon, Link};

/// Runs the test; returns the summary for the final line (`features: ...`).
pub fn guest() -> Result<String> {
    // Binaries come from `$CARGO_TARGET_DIR/release` (`/tyche` in the guest).
    let root = Path::new("/");
    let work = PathBuf::from("/tmp/ublk-test");
    fs::create_dir_all(&work)?;
    // As systemd sets it up on a real host: `ip netns exec` gives tyche-init a mount namespace of
    // its own, and with shared mounts the copy of a filesystem mounted before it started (the
    // recovery below) is a slave, which our unmount reaches. With the initramfs's private mounts
    // the copy would keep ext4 mounted, and its writes would meet the device being detached.
    run(Command::new("mount").args(["--make-rshared", "/"]))?;
    let lab = Lab::create("vmt", "vmi", 2, 1500)?;
    let stats = work.join("tyched.sock");
    let mut target = stack::start_tyched(root, &lab, Link::Xdp, "vm=ram:256M", &stats, work.join("tyched.log"))?;

    let log = work.join("attach.log");
    let mut attach = spawn_attach(root, &lab, &[], &log)?;
    let dev = wait_started(&mut attach, &log, "ublk device started")?;
    let features = logged_features(&log)?;
    println!("ublk: {dev} started (features {features})");

    let mut disk = BlockFs::new(&dev, &work);
    let tree = write_first_tree(&mut disk, &dev)?;
    target.check_alive()?;

    // Recovery: kill -9 of the serving process with ext4 mounted and a writer running.
    let again = Tree::new(0x5eed_0f9e, 160, 32 << 20);
    let (written, rx) = start_writer(&mut disk)?;
    let killed = kill_mid_write(&mut attach, &written, &rx, &again, &dev)?;

    let log2 = work.join("attach-recover.log");
    let mut recovered = spawn_attach(root, &lab, &["--recover", &dev], &log2)?;
    let (resumed, mode) = wait_recovered(&mut recovered, &log2, &dev, killed)?;
    match rx.recv_timeout(Duration::from_secs(300)) {
        Ok(r) => r.context("the writer failed across the recovery")?,
        Err(e) => bail!("the writer did not finish after the recovery: {e}"),
    }
    verify_after_recovery(root, &mut disk, &tree, &again, &dev)?;
    target.check_alive()?;

    detach_recovered(root, &mut recovered, &log2, &dev)?;
    orphan_deleted_by_detach(root, &lab, &work)?;
    let path = data_path(&features);
    Ok(format!(
        "data path: {path}, features: {features}; recovery: kill -9 mid-write, {mode}, resumed in {:.1} s",
        resumed.as_secs_f64()
    ))
}

/// Checks the device's size, then ext4 made on it, a tree written, fsck clean and the tree
/// verified; returns the tree.
fn write_first_tree(disk: &mut BlockFs, dev: &str) -> Result<Tree> {
    let size = disk.size()?;
    ensure!(size == 256 << 20, "{dev} is {size} bytes, the export 256 MiB");
    let tree = Tree::new(0x0b1c_0de5, 120, 48 << 20);
    disk.ext4_round_trip(&tree)?;
    println!("ublk: ext4 written, fsck clean, {} MiB verified", tree.bytes() >> 20);
    Ok(tree)
}

/// Mounts the filesystem and starts a writer thread on a second tree under `again`; returns its
/// bytes written so far and where its result will come.
fn start_writer(disk: &mut BlockFs) -> Result<(Arc<AtomicU64>, Receiver<Result<()>>)> {
    let mnt = disk.mount()?;
    let written = Arc::new(AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (mnt, written) = (mnt.join("again"), Arc::clone(&written));
        std::thread::spawn(move || {
            let tree = Tree::new(0x5eed_0f9e, 160, 32 << 20);
            let r = tree.write(&mnt, &mut |n| written.store(n, Ordering::Relaxed));
            let _ = tx.send(r);
        });
    }
    Ok((written, rx))
}

/// Kills `attach` with SIGKILL once the writer is a quarter through `again`; checks that the
/// device stays and the writer still runs. Returns when it was killed.
fn kill_mid_write(
    attach: &mut Daemon,
    written: &AtomicU64,
    rx: &Receiver<Result<()>>,
    again: &Tree,
    dev: &str,
) -> Result<Instant> {
    let kill_at = again.bytes() / 4;
    stack::wait_for("the writer a quarter through", Duration::from_secs(120), || {
        Ok(written.load(Ordering::Relaxed) >= kill_at)
    })?;
    let status = attach.kill()?;
    let at = written.load(Ordering::Relaxed);
    let killed = Instant::now();
    println!("ublk: tyche-init attach killed ({status}) with {} of {} MiB written", at >> 20, again.bytes() >> 20);
    ensure!(Path::new(dev).exists(), "{dev} went away with its server");
    if let Ok(r) = rx.try_recv() {
        bail!("the writer ended before recovery: {r:?}");
    }
    Ok(killed)
}

/// Waits until `recovered` (`attach --recover`) has taken `dev` over; returns how long after the
/// kill that was and its recovery mode.
fn wait_recovered(recovered: &mut Daemon, log: &Path, dev: &str, killed: Instant) -> Result<(Duration, &'static str)> {
    let dev2 = wait_started(recovered, log, "ublk device recovered")?;
    ensure!(dev2 == dev, "--recover {dev} printed {dev2}");
    let rec_features = logged_features(log)?;
    let resumed = killed.elapsed();
    println!("ublk: {dev} recovered {:.1} s after the kill (features {rec_features})", resumed.as_secs_f64());
    let mode = if rec_features.split(',').any(|f| f == "user_recovery_reissue") {
        "user_recovery_reissue"
    } else if rec_features.split(',').any(|f| f == "user_recovery") {
        "user_recovery"
    } else {
        bail!("the recovered device runs without user recovery ({rec_features})");
    };
    Ok((resumed, mode))
}

/// After the writer finished: unmounted, fsck clean, both trees verified, and a detach of the
/// mounted device refused; unmounted again.
fn verify_after_recovery(root: &Path, disk: &mut BlockFs, tree: &Tree, again: &Tree, dev: &str) -> Result<()> {
    run(&mut Command::new("sync"))?;
    disk.umount()?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    tree.verify(&mnt, &mut |_| {})?;
    again.verify(&mnt.join("again"), &mut |_| {})?;
    // A mounted device is not detached from under its file system.
    let busy = Command::new(stack::bin(root, "tyche-init")).args(["detach", dev]).output()?;
    let said = String::from_utf8_lossy(&busy.stderr);
    ensure!(!busy.status.success() && said.contains("is in use"), "detach of the mounted {dev}: {said}");
    ensure!(Path::new(dev).exists(), "{dev} went away under its mounted file system");
    disk.umount()?;
    println!(
        "ublk: writer finished across kill -9 and recovery, fsck clean, {} MiB verified, detach of the mounted device refused",
        (tree.bytes() + again.bytes()) >> 20
    );
    Ok(())
}

/// Detaches `dev`: the recovering process must exit 0 and the device go.
fn detach_recovered(root: &Path, recovered: &mut Daemon, log: &Path, dev: &str) -> Result<()> {
    run(Command::new(stack::bin(root, "tyche-init")).args(["detach", dev]))?;
    let status =
        recovered.wait(Duration::from_secs(30)).context("tyche-init attach --recover did not exit after detach")?;
    if !status.success() {
        let tail = fs::read_to_string(log).unwrap_or_default();
        bail!("tyche-init attach --recover exited with {status} after detach:\n{tail}");
    }
    ensure!(!Path::new(dev).exists(), "{dev} still exists after detach");
    Ok(())
}

/// A device nobody recovers: `detach` deletes it (asked for by number, as a supervisor does).
fn orphan_deleted_by_detach(root: &Path, lab: &Lab, work: &Path) -> Result<()> {
    let log3 = work.join("attach-orphan.log");
    let mut orphan = spawn_attach(root, lab, &["--dev-id", "5"], &log3)?;
    let dev3 = wait_started(&mut orphan, &log3, "ublk device started")?;
    ensure!(dev3 == "/dev/ublkb5", "--dev-id 5 made {dev3}");
    orphan.kill()?;
    ensure!(Path::new(&dev3).exists(), "{dev3} went away with its server");
    let said = run(Command::new(stack::bin(root, "tyche-init")).args(["detach", &dev3]))?;
    ensure!(said.contains("deleted"), "detach of the orphaned {dev3} said {said:?}");
    stack::wait_for("the orphaned device to go", Duration::from_secs(10), || Ok(!Path::new(&dev3).exists()))?;
    println!("ublk: orphaned {dev3} (server killed) deleted by detach");
    Ok(())
}

/// Which ublk data path the device ran with, from its features: how request data moves
/// between the kernel's pages and tyche-init.
fn data_path(features: &str) -> &'static str {
    let has = |f: &str| features.split(',').any(|x| x == f);
    if has("auto_buf_reg") {
        "auto buffer registration (zero copy)"
    } else if has("zero_copy") {
        "zero copy"
    } else if has("user_copy") {
        "user copy (one copy, by read/write on /dev/ublkcN)"
    } else {
        "per-tag bounce buffers"
    }
}

/// Starts `tyche-init attach` over the lab's links with `extra` arguments.
fn spawn_attach(root: &Path, lab: &Lab, extra: &[&str], log: &Path) -> Result<Daemon> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.initiator_ns]).arg(stack::bin(root, "tyche-init")).arg("attach");
    for p in &lab.pairs {
        cmd.arg("--iface").arg(&p.initiator_if).arg("--target").arg(p.target_mac.to_string());
    }
    cmd.args(["--export", "vm", "--queues", "2", "--depth", "32"]).args(extra).env("TYCHE_LOG", "info");
    Daemon::spawn("tyche-init attach", &mut cmd, log)
}

/// Waits until `attach` printed its device and logged `what`; returns the device.
pub(crate) fn wait_started(attach: &mut Daemon, log: &Path, what: &str) -> Result<String> {
    let mut dev = String::new();
    stack::wait_for("/dev/ublkbN", Duration::from_secs(60), || {
        attach.check_alive(log)?;
        let text = fs::read_to_string(log).unwrap_or_default();
        if let Some(d) = text.lines().find(|l| l.starts_with("/dev/ublkb")) {
            dev = d.trim().to_string();
        }
        Ok(!dev.is_empty() && text.contains(what) && Path::new(&dev).exists())
    })?;
    Ok(dev)
}

/// The ublk features `attach` logged it runs with.
fn logged_features(log: &Path) -> Result<String> {
    let text = fs::read_to_string(log)?;
    text.lines()
        .find_map(|l| l.split("features=").nth(1))
        .map(|f| f.split_whitespace().next().unwrap_or("").trim_matches('"').to_string())
        .context("tyche-init did not log the ublk features it uses")
}
