//! `cargo xtask vm-test`: what this machine cannot show, proved in a VM.
//!
//! This kernel has no ublk driver and one NUMA node. The VM boots Debian's bookworm-backports 6.12
//! cloud kernel (`ublk_drv`, `veth` and `virtio_net` as modules, which we load) with an initramfs
//! holding busybox, the release `tyched` and `tyche-init`, iproute2, e2fsprogs and this xtask
//! binary itself, and two NUMA nodes, each with a PCI expander bridge carrying two virtio-net NICs
//! joined by a qemu hub. For the nbd test the initramfs also holds `nbd-client` and `fio`, the
//! guest loads `nbd` and `virtio_blk`, and two virtio disks are exports of `tyche-init serve-nbd`
//! processes on this host. The guest's `/init` runs `xtask vm-guest TEST` for each test; each
//! prints a `VMTEST <name> ok|FAIL ...` line on the console, and the host reads the verdict from
//! the console log (qemu exits 0 whatever happens inside).
//!
//! Everything downloaded (the kernel package) is cached under `target/vm/` and reused offline.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use crate::disk::run;
pub use crate::vm_base::GuestTest;
use crate::vm_base::{nic_mac, report, version_key, Apt, Guest, Kernel, MARK};

#[derive(Args, Debug)]
pub struct VmTestArgs {
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
    /// Run only these tests (default: all).
    #[arg(long = "only", value_enum)]
    only: Vec<GuestTest>,
    /// Seconds each boot may take (the suite's initramfs boot runs about 10 minutes under TCG).
    #[arg(long, default_value_t = 1500)]
    timeout: u64,
    /// Accelerator: try KVM first, or force TCG.
    #[arg(long)]
    tcg: bool,
}

impl VmTestArgs {
    /// What `cargo xtask test` runs.
    pub fn standard() -> VmTestArgs {
        VmTestArgs { no_install: false, only: Vec::new(), timeout: 1500, tcg: false }
    }

    /// The standard run of these guest tests only.
    pub fn only(tests: &[GuestTest]) -> VmTestArgs {
        VmTestArgs { only: tests.to_vec(), ..VmTestArgs::standard() }
    }
}

/// Guest memory per NUMA node, MiB.
const NODE_MIB: u32 = 1024;
/// Where the guest finds the release binaries (`stack::bin` with `CARGO_TARGET_DIR=/tyche`).
const GUEST_TARGET_DIR: &str = "/tyche";

pub fn vm_test(root: &Path, args: &VmTestArgs) -> Result<()> {
    crate::stack::prepare(root, "vm-test", args.no_install)?;
    let cache = crate::xdp::target_dir(root).join("vm");
    fs::create_dir_all(&cache)?;
    // One vm-test at a time per build directory: runs share the boot test's disk, the
    // initramfs and the console logs. Released when the process ends.
    let lock = fs::File::create(cache.join("vm-test.lock"))?;
    if lock.try_lock().is_err() {
        eprintln!("vm-test: waiting for another vm-test using {}", cache.display());
        lock.lock().context("locking the VM cache")?;
    }
    ensure_qemu(&cache, args.no_install)?;
    let kernel = fetch_kernel(&cache)?;
    eprintln!("vm-test: kernel {}", kernel.version);
    let tests: Vec<GuestTest> = if args.only.is_empty() {
        vec![GuestTest::Ublk, GuestTest::Numa, GuestTest::Nbd, GuestTest::Mirror, GuestTest::Crash, GuestTest::Boot]
    } else {
        args.only.iter().copied().collect::<BTreeSet<_>>().into_iter().collect()
    };
    // The boot test boots a guest of its own (systemd from a disk image); the others share one
    // initramfs boot.
    let (boot_test, tests): (Vec<GuestTest>, Vec<GuestTest>) = tests.into_iter().partition(|t| *t == GuestTest::Boot);
    let mut line = Vec::new();
    // The systemd guest's disk (its root file system built with mmdebstrap, ~1 min) is made
    // while the initramfs guest runs: that guest waits on timers and outages for much of its
    // run, and the image build runs at the lowest priority.
    // (The initramfs is built first: both fetch packages with the same private apt lists.)
    let initrd = if tests.is_empty() { None } else { Some(build_initramfs(root, &cache, &kernel, &tests)?) };
    let (initramfs, boot_guest) = std::thread::scope(|s| {
        let boot_guest = (!boot_test.is_empty()).then(|| s.spawn(|| crate::vm_boot::prepare(root, &cache, &kernel)));
        let initramfs = match initrd {
            Some(initrd) => initramfs_tests(root, &cache, &kernel, initrd, &tests, args),
            None => Ok(Vec::new()),
        };
        (initramfs, boot_guest.map(|h| h.join().expect("the boot guest's preparation panicked")))
    });
    line.extend(initramfs?);
    if let Some(guest) = boot_guest {
        let guest = guest?;
        let log = cache.join("console-boot.log");
        let outcome = run_guest(&guest, &log, args)?;
        line.extend(verdict(&log, &boot_test, &outcome)?);
    }
    println!("vm-test: {}", line.join(", "));
    Ok(())
}

/// The initramfs guest's tests (ublk, numa, nbd, mirror, crash), in one boot of `initrd`.
fn initramfs_tests(
    root: &Path,
    cache: &Path,
    kernel: &Kernel,
    initrd: PathBuf,
    tests: &[GuestTest],
    args: &VmTestArgs,
) -> Result<Vec<String>> {
    let log = cache.join("console.log");
    // The nbd test's virtio disks: exports of `tyche-init serve-nbd` processes on this host, which
    // run for the whole boot and are stopped when `servers` drops.
    let mut servers = if tests.contains(&GuestTest::Nbd) {
        Some(crate::vm_nbd::HostServers::start(root, cache).context("the nbd test's host NBD servers")?)
    } else {
        None
    };
    let guest = Guest {
        kernel: kernel.vmlinuz.clone(),
        initrd,
        append: "rdinit=/init quiet".to_string(),
        nodes: 2,
        extra: servers.as_ref().map(|s| s.qemu_args.clone()).unwrap_or_default(),
        up: MARK,
        reboots: 0,
    };
    let outcome = run_guest(&guest, &log, args)?;
    let alive = servers.as_mut().map_or(Ok(()), |s| s.check_alive());
    drop(servers);
    let line = verdict(&log, tests, &outcome)?;
    alive.context("a host NBD server behind the nbd test's virtio disks died")?;
    Ok(line)
}

/// Boots `guest` with KVM, or TCG when KVM cannot run it (or `--tcg`), once more if qemu or its
/// emulation failed before the guest came up ([`boot_once_more`]).
pub fn run_guest(guest: &Guest, log: &Path, args: &VmTestArgs) -> Result<Outcome> {
    let deadline = Duration::from_secs(args.timeout);
    let accel = if !args.tcg && kvm_usable() { "kvm" } else { "tcg" };
    let mut outcome = boot_once_more(guest, log, accel, deadline)?;
    if accel == "kvm" && !outcome.booted {
        eprintln!("vm-test: the guest did not boot under KVM; trying TCG");
        outcome = boot_once_more(guest, log, "tcg", deadline)?;
    }
    Ok(outcome)
}

/// [`boot`], once more if the guest never booted because of qemu or its emulation: Debian 12's
/// qemu under TCG sometimes aborts on an assertion of its own (`iotlb_to_section: Assertion
/// `section_index < d->map.sections_nb' failed`, seen once in a CI run whose other boot of the
/// same guest passed), and on a loaded host a TCG guest once stalled in early boot (RCU stalls
/// on its CPU 0, "timer wakeup didn't happen") and never reached `/init` in 900 s, where it
/// takes 15 to 40 s; in another run the same stall came after `/init` started, before any test
/// ran ([`EMULATION_STALL`]). A second such failure, or any other failure after the guest
/// booted, is an error.
fn boot_once_more(guest: &Guest, log: &Path, accel: &'static str, deadline: Duration) -> Result<Outcome> {
    match boot(guest, log, accel, deadline) {
        Err(e) if format!("{e}").contains(CRASHED_BEFORE_BOOT) || format!("{e}").contains(STALLED_BEFORE_TESTS) => {
            eprintln!("vm-test: {e:#}; booting once more");
            boot(guest, log, accel, deadline)
        }
        r => r,
    }
}

/// How the qemu run ended.
pub struct Outcome {
    booted: bool,
    timed_out: bool,
    /// Why the host stopped the guest before it powered off (a panic, an unplanned reboot).
    stopped: Option<String>,
    accel: &'static str,
    secs: f64,
}

/// The verdict line's parts for `tests`, from the console log; an error, with the console's
/// tail, when one of them did not pass.
fn verdict(log: &Path, tests: &[GuestTest], outcome: &Outcome) -> Result<Vec<String>> {
    let text = fs::read_to_string(log).unwrap_or_default();
    let marks: Vec<&str> = text.lines().filter_map(|l| l.trim_end_matches('\r').strip_prefix(MARK)).collect();
    let mut failed = Vec::new();
    let mut summaries = Vec::new();
    for t in tests {
        let name = t.name();
        let ok = marks.iter().find_map(|m| m.trim().strip_prefix(name)?.trim().strip_prefix("ok").map(str::trim));
        match ok {
            Some(summary) => summaries.push((*t, summary.to_string())),
            None => failed.push(name),
        }
    }
    if !failed.is_empty() || !outcome.booted {
        let tail: Vec<&str> = text.lines().collect();
        let tail = tail[tail.len().saturating_sub(60)..].join("\n");
        eprintln!("---- guest console (last 60 lines of {}) ----\n{tail}\n----", log.display());
        if !outcome.booted {
            bail!("vm-test: the guest never came up ({} s, {})", outcome.secs as u64, outcome.accel);
        }
        let why = match (&outcome.stopped, outcome.timed_out) {
            (Some(why), _) => format!(" ({why})"),
            (None, true) => " (the VM timed out)".to_string(),
            (None, false) => String::new(),
        };
        bail!("vm-test: {} failed{why}", failed.join(", "));
    }
    eprintln!("vm-test: {} run in {:.0} s", outcome.accel, outcome.secs);
    let part = |t: GuestTest| summaries.iter().find(|(x, _)| *x == t).map(|(_, s)| s.as_str());
    let mut line = Vec::new();
    if let Some(s) = part(GuestTest::Ublk) {
        // `features: ...; recovery: ...`
        let (ext4, recovery) = s.split_once("; recovery: ").map_or((s, None), |(a, b)| (a, Some(b)));
        line.push(format!("ublk ext4 ok ({ext4})"));
        if let Some(r) = recovery {
            line.push(format!("recovery ok ({r})"));
        }
    }
    for t in [GuestTest::Numa, GuestTest::Nbd, GuestTest::Mirror, GuestTest::Crash, GuestTest::Boot] {
        if let Some(s) = part(t) {
            line.push(format!("{} ok ({s})", t.name()));
        }
    }
    Ok(line)
}

/// qemu's major version, if installed.
fn qemu_major() -> Option<u32> {
    let out = Command::new("qemu-system-x86_64").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.split("version ").nth(1)?.split('.').next()?.parse().ok()
}

/// bookworm's qemu 7.2 corrupts guest state under TCG with more than one vCPU (seen here: slab
/// and list corruption oopses within seconds of boot); bookworm-backports' qemu 10 does not.
fn ensure_qemu(cache: &Path, no_install: bool) -> Result<()> {
    const WANT: u32 = 8;
    match qemu_major() {
        Some(v) if v >= WANT => return Ok(()),
        found => {
            let have = found.map_or("no qemu".to_string(), |v| format!("qemu {v}"));
            ensure!(!no_install, "vm-test needs qemu-system-x86 {WANT} or later (bookworm-backports); found {have}");
            eprintln!("vm-test: installing qemu-system-x86 from bookworm-backports (found {have})");
        }
    }
    let apt = Apt::new(cache)?;
    apt.update()?;
    run(apt.cmd("apt-get").args([
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        "-t",
        "bookworm-backports",
        "qemu-system-x86",
    ]))
    .context("installing qemu-system-x86 from bookworm-backports")?;
    ensure!(qemu_major().is_some_and(|v| v >= WANT), "qemu-system-x86_64 is still older than {WANT}");
    Ok(())
}

/// Fetches (or reuses) the newest bookworm-backports 6.12 cloud kernel.
fn fetch_kernel(cache: &Path) -> Result<Kernel> {
    let kernels = cache.join("kernels");
    fs::create_dir_all(&kernels)?;
    let fetched = (|| -> Result<Kernel> {
        let apt = Apt::new(cache)?;
        apt.update()?;
        let found = run(apt.cmd("apt-cache").args([
            "search",
            "--names-only",
            r"^linux-image-6\.12\..*-cloud-amd64-unsigned$",
        ]))?;
        let pkg = found
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .max_by_key(|p| version_key(p))
            .context("bookworm-backports has no linux-image-6.12.*-cloud-amd64-unsigned")?
            .to_string();
        let dir = kernels.join(&pkg);
        if !dir.join("done").exists() {
            let debs = cache.join("debs");
            fs::create_dir_all(&debs)?;
            run(apt.cmd("apt-get").args(["download", &pkg]).current_dir(&debs))
                .with_context(|| format!("downloading {pkg}"))?;
            let deb = fs::read_dir(&debs)?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{pkg}_"))))
                .context("the downloaded package is missing")?;
            let _ = fs::remove_dir_all(&dir);
            run(Command::new("dpkg").arg("-x").arg(&deb).arg(&dir))?;
            fs::remove_file(&deb)?;
            fs::write(dir.join("done"), "")?;
        }
        kernel_in(&dir)
    })();
    match fetched {
        Ok(k) => Ok(k),
        Err(e) => {
            // Offline: any kernel fetched before will do.
            let cached = fs::read_dir(&kernels)?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.join("done").exists())
                .max_by_key(|p| version_key(&p.to_string_lossy()));
            match cached {
                Some(dir) => {
                    eprintln!("vm-test: cannot fetch a kernel ({e:#}); using the cached {}", dir.display());
                    kernel_in(&dir)
                }
                None => Err(e),
            }
        }
    }
}

fn kernel_in(dir: &Path) -> Result<Kernel> {
    let modules_root = dir.join("lib/modules");
    let version = fs::read_dir(&modules_root)
        .with_context(|| format!("{}", modules_root.display()))?
        .flatten()
        .next()
        .context("the kernel package has no modules")?
        .file_name()
        .to_string_lossy()
        .to_string();
    let vmlinuz = dir.join("boot").join(format!("vmlinuz-{version}"));
    ensure!(vmlinuz.exists(), "{} missing", vmlinuz.display());
    Ok(Kernel { modules: modules_root.join(&version), version, vmlinuz })
}

/// A kernel module: its name and its decompressed object.
struct Module {
    name: String,
    object: Vec<u8>,
}

/// Modules the guest loads, in dependency order. Debian's package ships no `modules.dep` (depmod
/// makes it at install), so the dependencies come from each module's `.modinfo` `depends=`.
fn module_order(kernel: &Kernel, wanted: &[&str]) -> Result<Vec<Module>> {
    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                files(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut all = Vec::new();
    files(&kernel.modules.join("kernel"), &mut all);
    fn visit(name: &str, all: &[PathBuf], order: &mut Vec<Module>, seen: &mut BTreeSet<String>) -> Result<()> {
        let norm = |s: &str| s.replace('-', "_");
        if !seen.insert(norm(name)) {
            return Ok(());
        }
        let path = all
            .iter()
            .find(|p| {
                let f = p.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_default();
                norm(f.trim_end_matches(".xz").trim_end_matches(".ko")) == norm(name)
            })
            .with_context(|| format!("module {name} is not in this kernel"))?;
        let object = if path.extension().is_some_and(|x| x == "xz") {
            let out = Command::new("xz").arg("-dc").arg(path).output().context("xz (package xz-utils)")?;
            ensure!(out.status.success(), "xz -dc {} failed", path.display());
            out.stdout
        } else {
            fs::read(path)?
        };
        let needle = b"depends=";
        let deps = object
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|at| {
                let rest = &object[at + needle.len()..];
                let end = rest.iter().position(|&b| b == 0).unwrap_or(0);
                String::from_utf8_lossy(&rest[..end]).to_string()
            })
            .unwrap_or_default();
        for d in deps.split(',').filter(|d| !d.is_empty()) {
            visit(d, all, order, seen)?;
        }
        order.push(Module { name: name.replace('-', "_"), object });
        Ok(())
    }
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for w in wanted {
        visit(w, &all, &mut order, &mut seen)?;
    }
    Ok(order)
}

/// A Debian package's files, `apt-get download`ed and `dpkg -x`ed once into
/// `target/vm/pkgs/PKG` (with the private apt configuration) and reused offline.
fn debian_package(cache: &Path, pkg: &str) -> Result<PathBuf> {
    let dir = cache.join("pkgs").join(pkg);
    if dir.join("done").exists() {
        return Ok(dir);
    }
    let apt = Apt::new(cache)?;
    let debs = cache.join("debs");
    fs::create_dir_all(&debs)?;
    let download = |apt: &Apt| run(apt.cmd("apt-get").args(["download", pkg]).current_dir(&debs));
    if download(&apt).is_err() {
        // No lists yet, or stale ones.
        apt.update()?;
        download(&apt).with_context(|| format!("downloading {pkg}"))?;
    }
    let deb = fs::read_dir(&debs)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{pkg}_"))))
        .with_context(|| format!("the downloaded {pkg} package is missing"))?;
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(&dir))?;
    fs::remove_file(&deb)?;
    fs::write(dir.join("done"), "")?;
    Ok(dir)
}

/// An initramfs being assembled in a directory.
struct Initramfs {
    dir: PathBuf,
    libs: BTreeSet<PathBuf>,
}

impl Initramfs {
    fn path(&self, inside: &Path) -> PathBuf {
        self.dir.join(inside.strip_prefix("/").unwrap_or(inside))
    }

    fn copy(&self, from: &Path, inside: &Path, mode: u32) -> Result<()> {
        let to = self.path(inside);
        fs::create_dir_all(to.parent().expect("absolute"))?;
        fs::copy(from, &to).with_context(|| format!("copying {} into the initramfs", from.display()))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(mode))?;
        Ok(())
    }

    /// Copies a dynamically linked program and every shared library `ldd` names for it.
    fn program(&mut self, from: &Path, inside: &Path) -> Result<()> {
        self.copy(from, inside, 0o755)?;
        self.libraries(from)
    }

    /// As [`Initramfs::program`], without the program's debug info (`strip --strip-debug`; its
    /// symbols stay, so a backtrace still names functions). Our release binaries carry ~100 MB
    /// of it, which the emulated guest would unpack at every boot for nothing.
    fn stripped_program(&mut self, from: &Path, inside: &Path) -> Result<()> {
        let to = self.path(inside);
        fs::create_dir_all(to.parent().expect("absolute"))?;
        run(Command::new("strip").arg("--strip-debug").arg("-o").arg(&to).arg(from))
            .with_context(|| format!("strip --strip-debug {} (binutils)", from.display()))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(0o755))?;
        self.libraries(from)
    }

    /// Copies every shared library `ldd` names for `from`.
    fn libraries(&mut self, from: &Path) -> Result<()> {
        let out = Command::new("ldd").arg(from).output().context("ldd")?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let lib = match line.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next(),
                None => line.split_whitespace().next().filter(|w| w.starts_with('/')),
            };
            let Some(lib) = lib.filter(|l| l.starts_with('/')) else { continue };
            let lib = PathBuf::from(lib);
            if self.libs.insert(lib.clone()) {
                self.copy(&fs::canonicalize(&lib)?, &lib, 0o755)?;
            }
        }
        Ok(())
    }

    fn write(&self, inside: &str, text: &str, mode: u32) -> Result<()> {
        let to = self.path(Path::new(inside));
        fs::create_dir_all(to.parent().expect("absolute"))?;
        fs::write(&to, text)?;
        fs::set_permissions(&to, fs::Permissions::from_mode(mode))?;
        Ok(())
    }

    /// `find . | cpio -o -H newc | gzip`.
    fn pack(&self, out: &Path) -> Result<()> {
        let script = format!(
            "cd '{}' && find . -print0 | cpio --null -o -H newc --quiet | gzip -1 > '{}'",
            self.dir.display(),
            out.display()
        );
        run(Command::new("sh").args(["-c", &script])).context("packing the initramfs (cpio, gzip)")?;
        Ok(())
    }
}

pub fn which(name: &str) -> Result<PathBuf> {
    let path = run(Command::new("sh").args(["-c", &format!("command -v {name}")]))
        .with_context(|| format!("{name} not found"))?;
    ensure!(!path.is_empty(), "{name} not found");
    Ok(fs::canonicalize(path)?)
}

fn build_initramfs(root: &Path, cache: &Path, kernel: &Kernel, tests: &[GuestTest]) -> Result<PathBuf> {
    let dir = cache.join("initramfs");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let mut fs_ = Initramfs { dir, libs: BTreeSet::new() };
    let busybox = which("busybox")?;
    let ldd = Command::new("ldd").arg(&busybox).output()?;
    ensure!(!ldd.status.success(), "{} is not static: install busybox-static", busybox.display());
    fs_.copy(&busybox, Path::new("/bin/busybox"), 0o755)?;
    let release = crate::xdp::target_dir(root).join("release");
    for b in ["tyched", "tyche-init"] {
        fs_.stripped_program(&release.join(b), &Path::new(GUEST_TARGET_DIR).join("release").join(b))?;
    }
    fs_.stripped_program(&std::env::current_exe()?, Path::new("/usr/local/bin/xtask"))?;
    for (prog, name) in
        [("ip", "ip"), ("mkfs.ext4", "mkfs.ext4"), ("e2fsck", "e2fsck"), ("lstopo-no-graphics", "lstopo-no-graphics")]
    {
        fs_.program(&which(prog)?, &Path::new("/usr/local/bin").join(name))?;
    }
    if tests.contains(&GuestTest::Nbd) {
        // The nbd test's NBD client and verifier (fio brings ~80 MiB of libraries: only then).
        for prog in ["nbd-client", "fio"] {
            fs_.program(&which(prog)?, &Path::new("/usr/local/bin").join(prog))?;
        }
    }
    if tests.contains(&GuestTest::Mirror) {
        // The mirror test's verifier, and mdadm from Debian's package (not needed on the host).
        fs_.program(&which("fio")?, Path::new("/usr/local/bin/fio"))?;
        let mdadm = debian_package(cache, "mdadm")?.join("sbin/mdadm");
        fs_.program(&mdadm, Path::new("/usr/local/bin/mdadm"))?;
    }
    if tests.contains(&GuestTest::Crash) {
        // The crash test's device-mapper and loop tools (busybox's losetup has no --show).
        for prog in ["dmsetup", "losetup"] {
            fs_.program(&which(prog)?, &Path::new("/usr/local/bin").join(prog))?;
        }
    }
    if Path::new("/etc/mke2fs.conf").exists() {
        fs_.copy(Path::new("/etc/mke2fs.conf"), Path::new("/etc/mke2fs.conf"), 0o644)?;
    }
    let mut names = Vec::new();
    let mut wanted = vec!["ublk_drv", "veth", "virtio_net"];
    if tests.contains(&GuestTest::Nbd) {
        wanted.extend(["nbd", "virtio_blk"]);
    }
    if tests.contains(&GuestTest::Mirror) {
        wanted.extend(["md_mod", "raid1", "raid10"]);
    }
    if tests.contains(&GuestTest::Crash) {
        wanted.extend(["loop", "dm_mod", "dm_log_writes"]);
    }
    for m in module_order(kernel, &wanted)? {
        let name = format!("{}.ko", m.name);
        fs_.write(&format!("/lib/modules/{name}"), "", 0o644)?;
        fs::write(fs_.path(&Path::new("/lib/modules").join(&name)), &m.object)?;
        names.push(name);
    }
    fs_.write("/etc/modules", &(names.join("\n") + "\n"), 0o644)?;
    let names: Vec<&str> = tests.iter().map(|t| t.name()).collect();
    fs_.write("/etc/tests", &(names.join("\n") + "\n"), 0o644)?;
    fs_.write("/init", INIT, 0o755)?;
    let out = cache.join("initramfs.cpio.gz");
    fs_.pack(&out)?;
    Ok(out)
}

/// The guest's `/init`: mounts, loads modules, runs each test through `xtask vm-guest`, powers
/// off. Every failure still reaches `poweroff`, so the host never waits for its timeout.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/usr/local/bin:/bin CARGO_TARGET_DIR=/tyche HOME=/root TYCHE_LOG=info
mkdir -p /proc /sys /dev /run /tmp /root /mnt /var
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
ln -sf /run /var/run
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
for m in $(cat /etc/modules); do
    insmod /lib/modules/$m || echo "VMTEST insmod $m failed"
done
ip link set lo up
echo "VMTEST boot $(uname -r) cpus=$(nproc) nodes=$(ls -d /sys/devices/system/node/node* | wc -l)"
for t in $(cat /etc/tests); do
    if ! xtask vm-guest $t; then
        echo "VMTEST $t FAIL (exit $?)"
        # The daemons' logs, for the host's report.
        for f in /tmp/*/*.log; do
            echo "---- $f"; grep -m3 -A4 panicked "$f"; tail -n 25 "$f"
        done
    fi
done
echo "VMTEST end"
sync
poweroff -f
"#;

/// What [`boot`]'s error says when qemu died, or the guest stalled, before the guest printed
/// anything.
const CRASHED_BEFORE_BOOT: &str = "before the guest booted";

/// What [`boot`]'s error says when the emulated guest's timers stalled before any test ran.
const STALLED_BEFORE_TESTS: &str = "before any test ran";

/// The guest kernel's words when its timers stop firing under TCG: an RCU stall whose grace-period
/// thread never woke ("rcu_preempt kthread timer wakeup didn't happen"), seen in a CI run while
/// the guest's init set up its network, after which nothing ran for 900 s. It is the emulator's
/// stall, not a test's: no test's code had run, and the other boot of the same run passed.
const EMULATION_STALL: &str = "timer wakeup didn't happen";

/// Whether `line` is the initramfs guest's own first line (`VMTEST boot <kernel> cpus=N
/// nodes=N`, from its `/init`); every other [`MARK`] line is a test's (the systemd guest's
/// `VMTEST boot ok ...` included).
fn is_boot_line(line: &str) -> bool {
    line.contains("VMTEST boot ") && line.contains(" cpus=") && line.contains(" nodes=")
}

/// Longest a TCG guest may take to come up (the initramfs guest reaches `/init` in 15 to 40 s on
/// this machine).
const TCG_BOOT_LIMIT: Duration = Duration::from_secs(240);

fn kvm_usable() -> bool {
    fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok()
}

/// The console line of a kernel panic.
const PANIC: &str = "Kernel panic - not syncing";

/// Boots the guest and waits for it to power off (or the deadline).
fn boot(guest: &Guest, log: &Path, accel: &'static str, deadline: Duration) -> Result<Outcome> {
    let _ = fs::remove_file(log);
    let mut cmd = qemu_command(guest, log, accel);
    eprintln!("vm-test: booting ({accel})");
    let start = Instant::now();
    let mut child = cmd.spawn().context("starting qemu-system-x86_64 (package qemu-system-x86)")?;
    let (status, mut console) = watch_console(&mut child, guest, log, accel, deadline, start)?;
    let text = fs::read_to_string(log).unwrap_or_default();
    console.booted |= text.contains(guest.up);
    for l in text.lines().filter(|l| l.contains(MARK)).skip(console.printed) {
        eprintln!("  guest: {}", l.trim_end_matches('\r'));
    }
    check_qemu_exit(&mut child, status, &console, accel, start)?;
    let Console { booted, stopped, .. } = console;
    let timed_out = status.is_none() && stopped.is_none();
    Ok(Outcome { booted, timed_out, stopped, accel, secs: start.elapsed().as_secs_f64() })
}

/// The qemu command line for `guest` under `accel`, its console written to `log`.
fn qemu_command(guest: &Guest, log: &Path, accel: &str) -> Command {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-machine", "pc", "-accel", accel, "-cpu", if accel == "kvm" { "host" } else { "max" }]);
    cmd.args(["-smp", &(2 * guest.nodes).to_string(), "-m", &format!("{}M", guest.nodes * NODE_MIB)]);
    for node in 0..guest.nodes {
        cmd.args(["-object", &format!("memory-backend-ram,id=mem{node},size={NODE_MIB}M")]);
        let cpus = format!("{}-{}", node * 2, node * 2 + 1);
        cmd.args(["-numa", &format!("node,nodeid={node},cpus={cpus},memdev=mem{node}")]);
        // A PCI expander bridge on this node, carrying this node's two NICs.
        cmd.args(["-device", &format!("pxb,id=pxb{node},bus_nr={},numa_node={node},bus=pci.0", 16 * (node + 1))]);
        for side in 1..=2u32 {
            cmd.args(["-netdev", &format!("hubport,id=hp{node}{side},hubid={node}")]);
            cmd.args([
                "-device",
                &format!(
                    "virtio-net-pci,netdev=hp{node}{side},mac={},bus=pxb{node},addr={side:#x}",
                    nic_mac(node, side)
                ),
            ]);
        }
    }
    cmd.args(&guest.extra);
    cmd.arg("-kernel").arg(&guest.kernel).arg("-initrd").arg(&guest.initrd);
    cmd.args(["-append", &format!("console=ttyS0 panic=-1 oops=panic loglevel=4 {}", guest.append)]);
    cmd.args(["-nodefaults", "-display", "none"]);
    if guest.reboots == 0 {
        cmd.arg("-no-reboot");
    }
    cmd.arg("-serial").arg(format!("file:{}", log.display()));
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// What [`boot`] saw on the guest's console while qemu ran.
#[derive(Debug, Default)]
struct Console {
    /// Whether the guest came up (its console shows `guest.up`).
    booted: bool,
    /// How many [`MARK`] lines have been echoed.
    printed: usize,
    /// Why the host stopped the guest (a panic, an unplanned reboot).
    stopped: Option<String>,
    /// Whether the emulated guest's timers stalled before any test ran.
    stalled: bool,
}

/// Watches qemu and the console log until qemu exits (its status) or has to be killed (`None`):
/// a panic, an unplanned reboot, an emulation stall, the boot limit or the deadline passed, or an
/// interrupt. Echoes the guest's verdict lines as they come.
fn watch_console(
    child: &mut Child,
    guest: &Guest,
    log: &Path,
    accel: &str,
    deadline: Duration,
    start: Instant,
) -> Result<(Option<ExitStatus>, Console)> {
    let mut c = Console::default();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        // Echo the guest's verdict lines as they come, so a long run shows progress.
        let text = fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(MARK)).collect();
        for l in &lines[c.printed.min(lines.len())..] {
            eprintln!("  guest: {}", l.trim_end_matches('\r'));
        }
        c.printed = lines.len();
        c.booted |= text.contains(guest.up);
        let tests_ran = lines.iter().any(|l| !is_boot_line(l));
        c.stalled = accel != "kvm" && !tests_ran && text.contains(EMULATION_STALL);
        // A guest that reboots itself would boot again after a panic instead of stopping.
        if text.contains(PANIC) {
            c.stopped = Some("the guest's kernel panicked".to_string());
        } else if guest.reboots > 0 && text.matches(guest.up).count() > guest.reboots + 1 {
            c.stopped = Some(format!("the guest booted more than the {} time(s) it reboots itself", guest.reboots));
        }
        // Under KVM a guest that has not reached /init in 60 s is not going to; under TCG, in
        // TCG_BOOT_LIMIT.
        let limit = match (accel, c.booted) {
            ("kvm", false) => Duration::from_secs(60),
            (_, false) => TCG_BOOT_LIMIT.min(deadline),
            _ => deadline,
        };
        if c.stopped.is_some()
            || c.stalled
            || start.elapsed() > limit
            || crate::stack::INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed)
        {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    Ok((status, c))
}

/// Fails if the emulated guest stalled, did not come up under TCG, or qemu failed (with what it
/// said); a KVM qemu that failed before the guest came up is only reported.
fn check_qemu_exit(
    child: &mut Child,
    status: Option<ExitStatus>,
    c: &Console,
    accel: &str,
    start: Instant,
) -> Result<()> {
    let interrupted = crate::stack::INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed);
    if c.stalled && !interrupted {
        bail!(
            "the emulated guest's timers stalled ({EMULATION_STALL:?}) {STALLED_BEFORE_TESTS}, after {} s under {accel}",
            start.elapsed().as_secs()
        );
    }
    if status.is_none() && !c.booted && accel != "kvm" && !interrupted && c.stopped.is_none() {
        bail!("the guest did not come up in {} s under {accel} {CRASHED_BEFORE_BOOT}", start.elapsed().as_secs());
    }
    if let Some(st) = status {
        if !st.success() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            if accel == "kvm" && !c.booted {
                let why = err.lines().rev().find(|l| l.contains("error")).unwrap_or(err.trim());
                eprintln!("vm-test: qemu with KVM failed: {why}");
            } else if !c.booted {
                bail!("qemu failed ({st}) {CRASHED_BEFORE_BOOT}: {}", err.trim());
            } else {
                bail!("qemu failed ({st}): {}", err.trim());
            }
        }
    }
    Ok(())
}

/// `xtask vm-guest TEST`, inside the VM: runs one test and prints its verdict line.
pub fn guest(test: GuestTest) -> Result<()> {
    let result = match test {
        GuestTest::Ublk => crate::vm_ublk::guest(),
        GuestTest::Numa => crate::vm_numa::guest(),
        GuestTest::Nbd => crate::vm_nbd::guest(),
        GuestTest::Mirror => crate::vm_mirror::guest(),
        GuestTest::Crash => crate::vm_crash::guest(),
        // None: the guest reboots, the verdict comes from its next boot.
        GuestTest::Boot => return crate::vm_boot::guest(),
    };
    report(test, result.map(Some))
}
