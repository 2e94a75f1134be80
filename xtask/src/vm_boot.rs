//! `vm-test`'s boot test: Tyche as an operator installs it, on a Debian guest booted
//! with systemd.
//!
//! On the host: a Debian 12 root file system built from Debian's packages by `mmdebstrap`
//! (systemd, udev, e2fsprogs, fio, the same 6.12 kernel as the other tests, and the `.deb`'s
//! dependencies), cached under `target/vm/rootfs/` as an ext4 image keyed by the package list and
//! the kernel; a per-run copy of it gets the `.deb` (`dpkg -i`), `/etc/tyche` (a `tyched` serving a
//! file export on the target-side NIC, an attachment `vol` on the initiator-side NIC), both units
//! enabled, and a test unit that runs `xtask vm-guest boot`.
//!
//! In the guest, boot 1: both units are up, `/dev/disk/by-tyche/t1/disk0` appears, ext4 is made
//! on it and mounted through an fstab line, files are written, `systemctl restart
//! tyche-attach@vol` must leave the mounted filesystem reading and writing, then `systemctl
//! reboot`. Boot 2: `/mnt/vol` must have been mounted from fstab at boot on the by-tyche device,
//! every file intact, the previous boot's journal free of I/O errors and its shutdown must have
//! unmounted `/mnt/vol` before stopping the attachment; then `e2fsck -fn`, a stop of the
//! attachment must delete its unused device, and power off.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::disk::{run, BlockFs, Tree};
use crate::stack::wait_for;
use crate::vm_base::{nic_mac, report, Apt, Guest, GuestTest, Kernel};

/// Debian packages of the guest, besides the kernel and the `.deb`'s dependencies.
const PACKAGES: &[&str] = &["systemd-sysv", "udev", "kmod", "e2fsprogs", "iproute2", "fio", "initramfs-tools"];
/// Changed whenever the image's own setup ([`configure_base`]) changes, so cached images are
/// built again.
const IMAGE_FORMAT: u32 = 1;
/// Size of the guest's root disk (a sparse file).
const DISK_SIZE: &str = "2G";
/// The attachment's name (`/etc/tyche/attach.d/vol.toml`, `tyche-attach@vol.service`).
const ATTACHMENT: &str = "vol";
/// The export, and the name the attachment gives its target.
const EXPORT: &str = "disk0";
const TARGET_NAME: &str = "t1";
/// The export `systemctl reload tyched` adds (a RAM export).
const ADDED: &str = "added";
/// Size of the export (a file on the guest's root disk), MiB.
const EXPORT_MIB: u64 = 256;
/// Where fstab mounts it.
const MOUNT: &str = "/mnt/vol";
/// The guest's names of its two NICs (by `.link` files matching their MACs).
const TARGET_NIC: &str = "tyt0";
const INITIATOR_NIC: &str = "tyi0";
/// The test's state across the reboot, on the guest's root disk.
const STATE: &str = "/var/lib/tyche-boot-test";
/// The test unit.
const TEST_UNIT: &str = "tyche-boot-test.service";

fn attach_unit() -> String {
    format!("tyche-attach@{ATTACHMENT}.service")
}

fn by_tyche() -> String {
    format!("/dev/disk/by-tyche/{TARGET_NAME}/{EXPORT}")
}

/// Builds (or reuses) the root file system and the run's disk; returns the guest to boot.
pub fn prepare(root: &Path, cache: &Path, kernel: &Kernel) -> Result<Guest> {
    let deb = package(root)?;
    let mut packages: Vec<String> = PACKAGES.iter().map(|p| p.to_string()).collect();
    packages.push(format!("linux-image-{}-unsigned", kernel.version));
    packages.extend(depends(&deb)?);
    packages.sort();
    packages.dedup();
    let image = base_image(cache, kernel, &packages)?;
    let disk = cache.join("boot-disk.img");
    instance(&image, &deb, &disk)?;
    let disk = disk.to_str().context("disk path is not UTF-8")?;
    ensure!(!disk.contains(','), "qemu cannot take a disk path with a comma: {disk}");
    Ok(Guest {
        kernel: image.join("vmlinuz"),
        initrd: image.join("initrd.img"),
        append: "root=/dev/vda rw".to_string(),
        nodes: 1,
        extra: vec![
            "-drive".to_string(),
            format!("file={disk},format=raw,if=none,id=root,cache=unsafe"),
            "-device".to_string(),
            // On the root bus (the default would be the NICs' PCI expander bridge).
            "virtio-blk-pci,drive=root,bus=pci.0,addr=0x1b".to_string(),
        ],
        up: "Welcome to",
        reboots: 1,
    })
}

/// The `.deb` to install: `$TYCHE_VM_DEB` when set (a package built elsewhere, e.g. a release),
/// else this tree's, built by `cargo xtask package`'s [`crate::package::build`].
fn package(root: &Path) -> Result<PathBuf> {
    if let Some(deb) = std::env::var_os("TYCHE_VM_DEB") {
        let deb = PathBuf::from(deb);
        ensure!(deb.is_file(), "TYCHE_VM_DEB={} is not a file", deb.display());
        return Ok(deb);
    }
    crate::package::build(root).context("building the .deb (cargo xtask package)")
}

/// The packages a `.deb` depends on (the first of each alternative, without versions).
fn depends(deb: &Path) -> Result<Vec<String>> {
    let field = run(Command::new("dpkg-deb").arg("--field").arg(deb).arg("Depends"))?;
    Ok(field
        .split(',')
        .filter_map(|alt| alt.split('|').next()?.split_whitespace().next().map(str::to_string))
        .filter(|p| !p.is_empty())
        .collect())
}

/// 64-bit FNV-1a: names the cached image after what went into it.
fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The cached root file system for `packages` (`root.img`, `vmlinuz`, `initrd.img` in the
/// returned directory), built with mmdebstrap when missing; images of other package lists are
/// removed after a build.
fn base_image(cache: &Path, kernel: &Kernel, packages: &[String]) -> Result<PathBuf> {
    let key = format!("format {IMAGE_FORMAT}, kernel {}, packages {}", kernel.version, packages.join(" "));
    let images = cache.join("rootfs");
    let dir = images.join(format!("{:016x}", fnv(&key)));
    if dir.join("done").exists() {
        eprintln!("vm-test: root file system {} (cached)", dir.display());
        return Ok(dir);
    }
    let started = Instant::now();
    eprintln!("vm-test: building the guest's root file system with mmdebstrap ({})", packages.join(", "));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let apt = Apt::new(cache)?;
    apt.update()?;
    let tree = dir.join("tree");
    // At the lowest priority: `vm-test` builds this while the initramfs guest runs, on cores
    // that guest's vCPUs leave idle between its bursts.
    let mut cmd = Command::new("nice");
    cmd.args(["-n", "19", "mmdebstrap", "--variant=apt", "--quiet", &format!("--include={}", packages.join(","))]);
    cmd.arg("bookworm").arg(&tree).args(apt.sources()?);
    run(&mut cmd).context("mmdebstrap (package mmdebstrap) building the guest's root file system")?;
    configure_base(&tree)?;
    for (from, to) in [("vmlinuz", "vmlinuz"), ("initrd.img", "initrd.img")] {
        let from = tree.join("boot").join(format!("{from}-{}", kernel.version));
        fs::copy(&from, dir.join(to)).with_context(|| format!("{} (the kernel in the image)", from.display()))?;
    }
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "tyche-root", "-d"])
        .arg(&tree)
        .arg(dir.join("root.img"))
        .arg(DISK_SIZE))
    .context("making the root disk image from the tree")?;
    fs::remove_dir_all(&tree)?;
    fs::write(dir.join("done"), format!("{key}\n"))?;
    for e in fs::read_dir(&images)?.flatten() {
        if e.path() != dir {
            fs::remove_dir_all(e.path())?;
        }
    }
    eprintln!("vm-test: root file system built in {:.0} s", started.elapsed().as_secs_f64());
    Ok(dir)
}

/// Writes `text` to `path` under `root`, making its directories.
fn put(root: &Path, path: &str, text: &str, mode: u32) -> Result<()> {
    let to = root.join(path.trim_start_matches('/'));
    fs::create_dir_all(to.parent().expect("absolute path"))?;
    fs::write(&to, text).with_context(|| format!("writing {}", to.display()))?;
    fs::set_permissions(&to, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// What every boot-test guest has: its root from `/dev/vda`, a persistent journal (the test reads
/// the previous boot's), no login prompt on the serial console the test writes to.
fn configure_base(tree: &Path) -> Result<()> {
    put(tree, "/etc/fstab", "/dev/vda / ext4 rw,errors=remount-ro 0 1\n", 0o644)?;
    put(tree, "/etc/hostname", "tyche-vm\n", 0o644)?;
    fs::create_dir_all(tree.join("var/log/journal"))?;
    run(Command::new("chroot").arg(tree).args(["systemctl", "mask", "serial-getty@ttyS0.service"]))?;
    Ok(())
}

/// A loop-mounted disk image, unmounted on drop.
struct Mounted(PathBuf);

impl Mounted {
    fn new(image: &Path, at: &Path) -> Result<Mounted> {
        fs::create_dir_all(at)?;
        run(Command::new("mount").args(["-o", "loop"]).arg(image).arg(at)).context("loop-mounting the disk image")?;
        Ok(Mounted(at.to_path_buf()))
    }

    fn unmount(self) -> Result<()> {
        let r = run(Command::new("umount").arg(&self.0)).map(drop);
        std::mem::forget(self);
        r
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = run(Command::new("umount").arg(&self.0));
    }
}

/// The run's disk: a copy of the cached image (which stays clean) with the `.deb` installed,
/// `/etc/tyche` written, the units enabled and the test unit in place.
fn instance(image: &Path, deb: &Path, disk: &Path) -> Result<()> {
    run(Command::new("cp").arg("--sparse=always").arg(image.join("root.img")).arg(disk))?;
    let root = Mounted::new(disk, &disk.with_extension("mnt"))?;
    let r = &root.0;
    // The package as an operator installs it; its dependencies are in the image already (they are
    // part of its key), so this needs no network.
    fs::copy(deb, r.join("tmp/tyche.deb"))?;
    put(r, "/usr/sbin/policy-rc.d", "#!/bin/sh\nexit 101\n", 0o755)?;
    let installed = run(Command::new("chroot").arg(r).args(["dpkg", "-i", "/tmp/tyche.deb"]));
    fs::remove_file(r.join("usr/sbin/policy-rc.d"))?;
    fs::remove_file(r.join("tmp/tyche.deb"))?;
    installed.context("installing the .deb in the guest's image (dpkg -i)")?;
    let xtask = r.join("usr/local/bin/xtask");
    fs::copy(std::env::current_exe()?, &xtask)?;
    fs::set_permissions(&xtask, fs::Permissions::from_mode(0o755))?;

    // The NICs get stable names from their MACs, and come up (without addresses) by networkd.
    for (name, side) in [(TARGET_NIC, 1), (INITIATOR_NIC, 2)] {
        let mac = nic_mac(0, side);
        put(
            r,
            &format!("/etc/systemd/network/10-{name}.link"),
            &format!("[Match]\nMACAddress={mac}\n\n[Link]\nName={name}\n"),
            0o644,
        )?;
        put(
            r,
            &format!("/etc/systemd/network/10-{name}.network"),
            &format!(
                "[Match]\nName={name}\n\n[Link]\nRequiredForOnline=carrier\n\n\
                 [Network]\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n"
            ),
            0o644,
        )?;
    }
    fs::create_dir_all(r.join("var/lib/tyched"))?;
    put(
        r,
        "/etc/tyche/tyched.toml",
        &format!(
            "# vm-test's boot test: one export, a file on the root disk.\nifaces = [\"{TARGET_NIC}\"]\n\n\
             [[export]]\nname = \"{EXPORT}\"\npath = \"/var/lib/tyched/{EXPORT}.img\"\nsize = \"{EXPORT_MIB}M\"\n"
        ),
        0o644,
    )?;
    put(
        r,
        &format!("/etc/tyche/attach.d/{ATTACHMENT}.toml"),
        &format!(
            "export = \"{EXPORT}\"\nifaces = [\"{INITIATOR_NIC}\"]\ntarget = \"{}\"\ntarget_name = \"{TARGET_NAME}\"\n",
            nic_mac(0, 1)
        ),
        0o644,
    )?;
    put(
        r,
        &format!("/etc/systemd/system/{TEST_UNIT}"),
        &format!(
            "[Unit]\nDescription=vm-test boot test\nAfter=remote-fs.target tyched.service {}\n\n\
             [Service]\nType=oneshot\nExecStart=/usr/local/bin/xtask vm-guest boot\n\
             StandardOutput=tty\nStandardError=tty\nTTYPath=/dev/ttyS0\nTimeoutStartSec=infinity\n\n\
             [Install]\nWantedBy=multi-user.target\n",
            attach_unit()
        ),
        0o644,
    )?;
    run(Command::new("chroot")
        .arg(r)
        .args(["systemctl", "enable", "systemd-networkd.service", "tyched.service"])
        .arg(attach_unit())
        .arg(TEST_UNIT))
    .context("enabling the units")?;
    root.unmount()
}

// ---- In the guest ----

/// `xtask vm-guest boot`, run by the test unit: boot 1 (reboots, `None`) or boot 2 (the summary).
/// Powers the guest off after boot 2 or a failure, whose journal it prints first.
pub fn guest() -> Result<()> {
    fs::create_dir_all(STATE)?;
    let first = !Path::new(STATE).join("boot1").exists();
    let result = if first { first_boot().map(|()| None) } else { second_boot().map(Some) };
    if let Err(e) = &result {
        // The units' side of it, for the host's console tail.
        eprintln!("boot: failed: {e:#}; the units' journal:");
        let mut cmd = Command::new("journalctl");
        cmd.args(["-b", "--no-pager", "-n", "30", "-o", "short-monotonic"]);
        for unit in ["tyched.service".to_string(), attach_unit(), "mnt-vol.mount".to_string()] {
            cmd.arg("-u").arg(unit);
        }
        if let Ok(j) = run(&mut cmd) {
            eprintln!("{j}");
        }
    }
    let rebooting = matches!(result, Ok(None));
    let reported = report(GuestTest::Boot, result);
    let how: &[&str] = match (rebooting, reported.is_ok()) {
        (true, _) => &["--no-block", "reboot"],
        (false, true) => &["--no-block", "poweroff"],
        // Stopping every unit would push the journal out of the host's console tail; and at
        // once (-ff, no unmount): killing every process stops the volume's ublk server and
        // target, so remounting /mnt/vol read-only would wait until the host's timeout.
        (false, false) => &["--force", "--force", "poweroff"],
    };
    run(Command::new("systemctl").args(how))?;
    reported
}

/// Whether a unit is active (for `Type=notify`: it said it was ready).
fn active(unit: &str) -> bool {
    Command::new("systemctl").args(["is-active", "--quiet", unit]).status().is_ok_and(|s| s.success())
}

fn enabled(unit: &str) -> bool {
    Command::new("systemctl").args(["is-enabled", "--quiet", unit]).status().is_ok_and(|s| s.success())
}

/// The units, enabled, must be active and the by-tyche link present; returns the device.
fn units_up() -> Result<PathBuf> {
    for unit in ["tyched.service".to_string(), attach_unit()] {
        ensure!(enabled(&unit), "{unit} is not enabled");
    }
    let link = by_tyche();
    wait_for(&format!("{link} (udev)"), Duration::from_secs(120), || Ok(Path::new(&link).exists()))?;
    for unit in ["tyched.service".to_string(), attach_unit()] {
        ensure!(active(&unit), "{unit} is not active");
    }
    let dev = fs::canonicalize(&link)?;
    let size = BlockFs::new(&link, Path::new(STATE)).size()?;
    ensure!(size == EXPORT_MIB << 20, "{link} is {size} bytes, the export {EXPORT_MIB} MiB");
    Ok(dev)
}

/// The files written in boot 1, before and after the restart of the attachment unit.
fn trees() -> [Tree; 2] {
    [Tree::new(0xb007_0001, 48, 12 << 20), Tree::new(0xb007_0002, 24, 4 << 20)]
}

/// fio writes 8 MiB with crc32c checksums to a file on the volume, with direct I/O, and reads it
/// back (`--verify_only`: reads and checks what an earlier run wrote).
fn fio(extra: &[&str]) -> Result<()> {
    let file = format!("--filename={MOUNT}/fio.dat");
    let args = ["--name=vol", &file, "--rw=write", "--bs=64k", "--size=8M", "--direct=1", "--verify=crc32c"];
    run(Command::new("fio").args(args).args(extra).arg("--output-format=terse")).map(drop)
}

fn sync_and_drop_caches() -> Result<()> {
    run(&mut Command::new("sync"))?;
    fs::write("/proc/sys/vm/drop_caches", "3").context("dropping the page cache")
}

fn first_boot() -> Result<()> {
    let dev = units_up()?;
    println!("boot: 1: tyched.service and {} up, {} -> {}", attach_unit(), by_tyche(), dev.display());
    BlockFs::new(&by_tyche(), Path::new(STATE)).mkfs()?;
    fs::create_dir_all(MOUNT)?;
    let mut fstab = fs::read_to_string("/etc/fstab")?;
    // No `nofail`: a mount that fails at boot must fail the test.
    fstab.push_str(&format!("{} {MOUNT} ext4 _netdev 0 2\n", by_tyche()));
    fs::write("/etc/fstab", fstab)?;
    run(Command::new("systemctl").arg("daemon-reload"))?;
    run(Command::new("mount").arg(MOUNT)).context("mount /mnt/vol (from fstab)")?;
    let [before, after] = trees();
    let mnt = Path::new(MOUNT);
    before.write(&mnt.join("before"), &mut |_| {})?;

    // The attachment unit restarted under the mounted filesystem: it must keep working.
    let started = Instant::now();
    run(Command::new("systemctl").arg("restart").arg(attach_unit())).context("systemctl restart")?;
    ensure!(active(&attach_unit()), "{} is not active after its restart", attach_unit());
    let again = fs::canonicalize(by_tyche())?;
    ensure!(again == dev, "{} is {} after the restart, {} before", by_tyche(), again.display(), dev.display());
    let restart = started.elapsed().as_secs_f64();
    after.write(&mnt.join("after"), &mut |_| {})?;
    fio(&[]).context("fio write and verify on /mnt/vol after the restart")?;
    sync_and_drop_caches()?;
    before.verify(&mnt.join("before"), &mut |_| {})?;
    after.verify(&mnt.join("after"), &mut |_| {})?;
    println!("boot: 1: {} restarted in {restart:.1} s under the mounted {MOUNT}: written and verified", attach_unit());
    reload_target()?;
    fs::write(Path::new(STATE).join("boot1"), format!("{}\n", dev.display()))?;
    println!("boot: 1: rebooting");
    Ok(())
}

/// `systemctl reload tyched` under the mounted volume: an export added to
/// /etc/tyche/tyched.toml is served at once, and the volume's session is not dropped.
fn reload_target() -> Result<()> {
    let conf = "/etc/tyche/tyched.toml";
    let mut text = fs::read_to_string(conf)?;
    text.push_str(&format!("\n[[export]]\nname = \"{ADDED}\"\nsize = \"16M\"\n"));
    fs::write(conf, text)?;
    let stats = || -> Result<serde_json::Value> {
        Ok(serde_json::from_str(&run(Command::new("tyched").args(["stats", "--json"]))?)?)
    };
    let sessions = |s: &serde_json::Value| s["sessions"].as_u64();
    let before = sessions(&stats()?);
    run(Command::new("systemctl").args(["reload", "tyched.service"])).context("systemctl reload tyched")?;
    wait_for("the reload in tyched stats", Duration::from_secs(30), || {
        let s = stats()?;
        Ok(s["reload"]["applied"].as_u64().unwrap_or(0) + s["reload"]["failed"].as_u64().unwrap_or(0) > 0)
    })?;
    let s = stats()?;
    ensure!(s["reload"]["applied"] == 1, "the reload was refused: {}", s["reload"]);
    let names: Vec<&str> = s["exports"].as_array().into_iter().flatten().filter_map(|e| e["name"].as_str()).collect();
    ensure!(names == [EXPORT, ADDED], "exports after the reload: {names:?}");
    ensure!(sessions(&s) == before, "sessions {before:?} before the reload, {:?} after", sessions(&s));
    ensure!(active("tyched.service"), "tyched.service is not active after the reload");
    fio(&[]).context("fio write and verify on /mnt/vol after the reload")?;
    println!("boot: 1: systemctl reload tyched: export {ADDED} added, the volume's session kept, {MOUNT} written and verified");
    Ok(())
}

fn second_boot() -> Result<String> {
    let dev = units_up()?;
    // Mounted by systemd from fstab before this unit (After=remote-fs.target) started.
    let source = run(Command::new("findmnt").args(["-n", "-o", "SOURCE", MOUNT]))
        .with_context(|| format!("{MOUNT} is not mounted after the reboot"))?;
    ensure!(
        fs::canonicalize(&source)? == dev,
        "{MOUNT} is mounted from {source}, not {} ({})",
        by_tyche(),
        dev.display()
    );
    let from = run(Command::new("systemctl").args(["show", "-P", "SourcePath", "mnt-vol.mount"]))?;
    ensure!(from == "/etc/fstab", "mnt-vol.mount comes from {from:?}, not /etc/fstab");
    let mnt = Path::new(MOUNT);
    let [before, after] = trees();
    before.verify(&mnt.join("before"), &mut |_| {})?;
    after.verify(&mnt.join("after"), &mut |_| {})?;
    fio(&["--verify_only"]).context("fio verify of the file written before the reboot")?;
    let count = count_files(mnt)?;
    println!("boot: 2: {MOUNT} mounted from fstab on {}, {count} files verified", dev.display());

    let journal = run(Command::new("journalctl").args(["-b", "-1", "--no-pager", "-o", "short-monotonic"]))
        .context("the previous boot's journal")?;
    check_journal(&journal)?;
    run(Command::new("umount").arg(MOUNT))?;
    BlockFs::new(&by_tyche(), Path::new(STATE)).fsck()?;
    // What the shutdown did after the unmount: a stop with the device unused deletes it.
    run(Command::new("systemctl").arg("stop").arg(attach_unit()))?;
    let sys = Path::new("/sys/block").join(dev.file_name().context("device name")?);
    let link = by_tyche();
    wait_for(&format!("{} and {link} gone after the stop", dev.display()), Duration::from_secs(30), || {
        Ok(!sys.exists() && !Path::new(&link).exists())
    })?;
    Ok(format!(
        "tyched.service and {} ready from /etc/tyche, {} mounted from fstab at boot, reboot kept {count} files \
         intact, restart of {} kept {MOUNT} working, reload of tyched.service added an export and kept the \
         session, shutdown unmounted before detach, stop of the unused \
         device deleted it, no I/O errors in the journal",
        attach_unit().trim_end_matches(".service"),
        by_tyche(),
        attach_unit().trim_end_matches(".service"),
    ))
}

fn count_files(dir: &Path) -> Result<usize> {
    let mut n = 0;
    for e in fs::read_dir(dir)?.flatten() {
        let t = e.file_type()?;
        if t.is_dir() && e.file_name() != "lost+found" {
            n += count_files(&e.path())?;
        } else if t.is_file() {
            n += 1;
        }
    }
    Ok(n)
}

/// The previous boot's journal: no I/O or ext4 error, and its shutdown unmounted `/mnt/vol` before
/// it stopped the attachment unit (the last stop: the restart stopped it too).
fn check_journal(journal: &str) -> Result<()> {
    for bad in ["I/O error", "Buffer I/O error", "EXT4-fs error", "EXT4-fs warning", "Aborting journal"] {
        if let Some(l) = journal.lines().find(|l| l.contains(bad)) {
            bail!("the previous boot's journal has {bad:?}: {l}");
        }
    }
    let unit = attach_unit();
    let lines: Vec<&str> = journal.lines().collect();
    let last = |what: &dyn Fn(&str) -> bool| lines.iter().rposition(|l| what(l));
    let unmounted = last(&|l| l.contains("Unmounted") && (l.contains("mnt-vol.mount") || l.contains(MOUNT)))
        .context("the previous boot's journal has no \"Unmounted mnt-vol.mount\"")?;
    // The shutdown's stop of the attachment is its last (the restart stopped it too).
    let stopping = last(&|l| l.contains("Stopping") && l.contains(&unit))
        .with_context(|| format!("the previous boot's journal never stops {unit}"))?;
    ensure!(
        unmounted < stopping,
        "the shutdown stopped {unit} (journal line {stopping}) before it unmounted {MOUNT} (line {unmounted})"
    );
    Ok(())
}
