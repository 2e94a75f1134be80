//! `vm-test`'s NBD clients test: the NBD clients users run against `tyche-init
//! serve-nbd`, each where only a VM can run it.
//!
//! 1. **The kernel's NBD client**, inside the guest. `tyched` serves a file export (on the
//!    guest's tmpfs) over AF_XDP on a 2-NIC veth lab, as in the ublk test; `tyche-init
//!    serve-nbd` serves it on a Unix socket, once with `--nbd-io engine` and once with
//!    `--nbd-io tasks`; Debian's `nbd-client` 3.24 hands the socket to the kernel (`/dev/nbdN`).
//!    The kernel's client negotiates with NBD_OPT_EXPORT_NAME and takes simple replies only: the
//!    server path qemu and libnbd no longer use. On the device: mkfs.ext4, mount, a tree of files
//!    with known contents, `fio --verify=crc32c`, unmount; then `tyche-init serve-nbd` is
//!    killed with SIGKILL and started again on the same socket, and the device attached again
//!    (nbd-client 3.24 does not reconnect on 6.12, see [`kernel_nbd`]): fio verifies again, the
//!    tree is verified, more written, unmount, `e2fsck -fn` clean, remount, all verified,
//!    `nbd-client -d`. Then the same client on the in-process target (`tyche-init serve-nbd
//!    --loopback-mib`, both paths): ext4 round trip and fio verify, no restart (its RAM goes
//!    with the process).
//! 2. **qemu's NBD client**: the host runs `tyche-init serve-nbd` four times, one per target and
//!    NBD I/O path: its in-process RAM target (`--loopback-mib 64`), and `tyched` with a RAM
//!    export per path over AF_XDP on a veth lab of the host's (a pair per path); qemu gets each export as
//!    a virtio disk (`-drive file=nbd+unix:///qemu-<path>?socket=...`) with serial
//!    `tyche-<lo|xdp>-<path>`. qemu 10 negotiates extended headers, so every guest write reaches
//!    tyche-init as qemu sends it. In the guest: mkfs.ext4 on each, a tree of files, unmount, drop
//!    caches, `e2fsck -fn` clean, remount, every byte verified.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

use crate::disk::{run, BlockFs, Tree};
use crate::lab::{Lab, Pair};
use crate::stack::{self, wait_for, Daemon, Link};

/// The two ways `tyche-init serve-nbd` serves NBD requests (`--nbd-io`).
pub const NBD_IO: [&str; 2] = ["engine", "tasks"];
/// Export name of the host's loopback servers (qemu's disks).
const QEMU_EXPORT: &str = "qemu";
/// Size of every export, MiB.
const EXPORT_MIB: u64 = 64;
/// Export name of the guest's `tyched`.
const EXPORT: &str = "knbd";
/// Work directory in the guest (the VM's `/init` prints `/tmp/*/*.log` when a test fails).
const WORK: &str = "/tmp/nbd-test";

/// The targets behind the guest's virtio disks: `lo`, tyche-init's in-process RAM target
/// (`--loopback-mib`); `xdp`, `tyched` with a RAM export over AF_XDP on a veth lab of the host's.
pub const QEMU_TARGETS: [&str; 2] = ["lo", "xdp"];

/// The virtio serial number (at most 20 bytes) of the disk served by `target` with `--nbd-io io`.
fn serial(target: &str, io: &str) -> String {
    format!("tyche-{target}-{io}")
}

/// On the host: the `tyche-init serve-nbd` processes whose exports the guest gets as virtio
/// disks, one per target and NBD I/O path, and the lab and `tyched` of the `xdp` ones. Dropping
/// it stops them (the initiators first).
pub struct HostServers {
    servers: Vec<(Daemon, PathBuf)>,
    tyched: stack::Running,
    _lab: Lab,
    /// The qemu arguments that attach the exports.
    pub qemu_args: Vec<String>,
}

impl HostServers {
    /// Starts one server per target and NBD I/O path, sockets and logs in `dir`.
    pub fn start(root: &Path, dir: &Path) -> Result<HostServers> {
        let pid = std::process::id();
        // A link per initiator: two processes cannot bind AF_XDP sockets to one queue.
        let lab = Lab::create(&format!("tyche-vq-t{pid}"), &format!("tyche-vq-i{pid}"), NBD_IO.len() as u32, 3000)?;
        // An export per path: two attachments of one export from one host would fence each other.
        let exports: Vec<String> = NBD_IO
            .iter()
            .flat_map(|io| ["--export".to_string(), format!("{QEMU_EXPORT}-{io}=ram:{EXPORT_MIB}M")])
            .collect();
        let tyched = stack::start_tyched_with(
            root,
            &lab,
            Link::Xdp,
            &exports,
            &dir.join("tyched.sock"),
            dir.join("tyched.log"),
        )?;
        let mut servers = Vec::new();
        let mut qemu_args = Vec::new();
        for (t, target) in QEMU_TARGETS.into_iter().enumerate() {
            for (k, io) in NBD_IO.into_iter().enumerate() {
                let socket = dir.join(format!("nbd-{target}-{io}.sock"));
                let log = dir.join(format!("nbd-{target}-{io}.log"));
                let export = format!("{QEMU_EXPORT}-{io}");
                let d = if target == "lo" {
                    stack::start_loopback_initiator(root, &export, EXPORT_MIB, io, &socket, &log)?
                } else {
                    start_initiator(root, &lab, &lab.pairs[k..=k], &export, &socket, io, &log)?
                };
                let path = socket.to_str().context("socket path is not UTF-8")?;
                ensure!(!path.contains(','), "qemu cannot take a socket path with a comma: {path}");
                let id = format!("nbd{target}{io}");
                qemu_args.push("-drive".to_string());
                qemu_args
                    .push(format!("file=nbd+unix:///{export}?socket={path},format=raw,if=none,id={id},cache=none"));
                qemu_args.push("-device".to_string());
                // On the root bus, at a slot of its own: the default bus would be the last PCI
                // expander bridge of the numa test, which takes only bridges.
                qemu_args.push(format!(
                    "virtio-blk-pci,drive={id},serial={},bus=pci.0,addr={:#x}",
                    serial(target, io),
                    0x1c + 2 * t + k
                ));
                servers.push((d, log));
            }
        }
        Ok(HostServers { servers, tyched, _lab: lab, qemu_args })
    }

    /// Fails if a server died while the VM ran.
    pub fn check_alive(&mut self) -> Result<()> {
        for (d, log) in &mut self.servers {
            d.check_alive(log)?;
        }
        self.tyched.check_alive()
    }
}

/// Runs the test in the guest; returns the summary for the verdict line.
pub fn guest() -> Result<String> {
    let work = PathBuf::from(WORK);
    fs::create_dir_all(&work)?;
    let r = parts(&work);
    if r.is_err() {
        // The kernel's side of a failure, for the console (the VM's /init prints the logs).
        if let Ok(text) = run(&mut Command::new("dmesg")) {
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            let _ = fs::write(work.join("dmesg.log"), tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
    }
    r
}

fn parts(work: &Path) -> Result<String> {
    let root = Path::new("/");
    let mut done = Vec::new();
    {
        let lab = Lab::create("nbt", "nbi", 2, 1500)?;
        let image = work.join("export.img");
        fs::File::create(&image)?.set_len(EXPORT_MIB << 20)?;
        let stats = work.join("tyched.sock");
        let export = format!("{EXPORT}={}", image.display());
        let mut target = stack::start_tyched(root, &lab, Link::Xdp, &export, &stats, work.join("tyched.log"))?;
        for (k, io) in NBD_IO.iter().enumerate() {
            let s = kernel_nbd(root, &lab, work, io, k).with_context(|| format!("kernel NBD client, --nbd-io {io}"))?;
            target.check_alive()?;
            done.push(format!("kernel-nbd xdp {io}: {s}"));
        }
    }
    for (k, io) in NBD_IO.iter().enumerate() {
        let s = kernel_nbd_loopback(root, work, io, NBD_IO.len() + k)
            .with_context(|| format!("kernel NBD client on the in-process target, --nbd-io {io}"))?;
        done.push(format!("kernel-nbd lo {io}: {s}"));
    }
    for target in QEMU_TARGETS {
        for io in NBD_IO {
            let s = qemu_disk(work, target, io)
                .with_context(|| format!("qemu's NBD client (virtio disk), {target} target, --nbd-io {io}"))?;
            done.push(format!("qemu-vm-disk {target} {io}: {s}"));
        }
    }
    Ok(done.join("; "))
}

/// The kernel's NBD client on `/dev/nbd<k>` over `tyche-init serve-nbd --loopback-mib` (the
/// in-process RAM target, `--nbd-io io`): ext4 and fio verify, no restart (the RAM goes with the
/// process).
fn kernel_nbd_loopback(root: &Path, work: &Path, io: &str, k: usize) -> Result<String> {
    let socket = work.join(format!("nbd-lo-{io}.sock"));
    let log = work.join(format!("tyche-init-lo-{io}.log"));
    let mut server = stack::start_loopback_initiator(root, EXPORT, EXPORT_MIB, io, &socket, &log)?;
    let dev = format!("/dev/nbd{k}");
    let clog = work.join(format!("nbd-client-lo-{io}.log"));
    let mut client = nbd_client(&socket, &dev, &clog)?;
    let mut disk = BlockFs::new(&dev, &work.join(format!("lo-{io}")));
    let tree = Tree::new(0x6e62_6c00 + k as u64, 30, 8 << 20);
    disk.ext4_round_trip(&tree)?;
    let mnt = disk.mount()?;
    fio(&mnt.join("fio.dat"), false)?;
    disk.umount()?;
    server.check_alive(&log)?;
    run(Command::new("nbd-client").args(["-d", &dev]))?;
    client.wait(Duration::from_secs(20)).context("nbd-client did not exit after nbd-client -d")?;
    ensure!(!connected(&dev), "{dev} still connected after nbd-client -d");
    println!("nbd: {dev} (in-process target, --nbd-io {io}): ext4 round trip and fio crc32c verified");
    Ok("ext4+fio verify ok".to_string())
}

/// Starts `tyche-init serve-nbd --nbd-io io` of `export` in the lab's initiator namespace over
/// the links `pairs`, logging each NBD connection (debug), and waits for its socket.
fn start_initiator(
    root: &Path,
    lab: &Lab,
    pairs: &[Pair],
    export: &str,
    socket: &Path,
    io: &str,
    log: &Path,
) -> Result<Daemon> {
    let _ = fs::remove_file(socket);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.initiator_ns]).arg(stack::bin(root, "tyche-init")).arg("serve-nbd");
    cmd.arg("--socket").arg(socket).args(["--export", export, "--nbd-io", io]);
    for p in pairs {
        cmd.arg("--iface").arg(&p.initiator_if).arg("--target").arg(p.target_mac.to_string());
    }
    cmd.env("TYCHE_LOG", "info,tyche_init::nbd=debug");
    let mut d = Daemon::spawn("tyche-init serve-nbd", &mut cmd, log)?;
    wait_for("tyche-init's NBD socket", Duration::from_secs(60), || {
        d.check_alive(log)?;
        Ok(socket.exists())
    })?;
    Ok(d)
}

/// NBD connections `tyche-init` logged having accepted (its debug line `NBD connection conn=N`).
fn connections(log: &Path) -> usize {
    fs::read_to_string(log).unwrap_or_default().lines().filter(|l| l.contains("NBD connection conn=")).count()
}

/// Whether `/dev/nbdN` is connected (the driver shows the pid of its client).
fn connected(dev: &str) -> bool {
    let name = dev.trim_start_matches("/dev/");
    Path::new(&format!("/sys/block/{name}/pid")).exists()
}

/// `fio` on a file of the mounted filesystem: writes 8 MiB with CRC32C headers in every block and
/// reads them back (`verify_only`: only the read and check, of what an earlier run wrote).
fn fio(file: &Path, verify_only: bool) -> Result<()> {
    let mut cmd = Command::new("fio");
    cmd.args(["--name=tyche", "--thread", "--ioengine=psync", "--direct=1", "--rw=write", "--bs=64k", "--size=8M"]);
    cmd.args(["--verify=crc32c", "--verify_fatal=1", "--do_verify=1"]).arg(format!("--filename={}", file.display()));
    if verify_only {
        cmd.arg("--verify_only=1");
    }
    run(&mut cmd).with_context(|| format!("fio --verify=crc32c{}", if verify_only { " --verify_only" } else { "" }))?;
    Ok(())
}

/// `nbd-client` for `dev` on `socket`, as our child; returns once the device is connected.
///
/// nbd-client 3.24: `-unix` makes the host argument a socket path; `-N` names the export (our
/// server has no default export); `-b 4096` ext4's block size; `-nonetlink` the ioctl interface,
/// whose client process stays in NBD_DO_IT and is the only one that could reconnect
/// (`-persist`; with netlink the client exits once the device is set up); `-nofork` keeps it our
/// child, with its messages in `log`.
fn nbd_client(socket: &Path, dev: &str, log: &Path) -> Result<Daemon> {
    let mut cmd = Command::new("nbd-client");
    cmd.arg("-unix").arg(socket).arg(dev).args(["-N", EXPORT, "-b", "4096", "-nonetlink", "-persist", "-nofork"]);
    let mut client = Daemon::spawn("nbd-client", &mut cmd, log)?;
    wait_for(&format!("{dev} connected"), Duration::from_secs(30), || {
        client.check_alive(log)?;
        Ok(connected(dev) && BlockFs::new(dev, Path::new("/tmp")).size().unwrap_or(0) > 0)
    })?;
    Ok(client)
}

/// The kernel's NBD client on `/dev/nbd<k>`, served by `tyche-init serve-nbd --nbd-io io`.
fn kernel_nbd(root: &Path, lab: &Lab, work: &Path, io: &str, k: usize) -> Result<String> {
    let socket = work.join(format!("nbd-{io}.sock"));
    let log = work.join(format!("tyche-init-{io}.log"));
    let mut server = start_initiator(root, lab, &lab.pairs, EXPORT, &socket, io, &log)?;
    let dev = format!("/dev/nbd{k}");
    let clog = work.join(format!("nbd-client-{io}.log"));
    let mut client = nbd_client(&socket, &dev, &clog)?;
    let mut disk = BlockFs::new(&dev, work);
    let size = disk.size()?;
    ensure!(size == EXPORT_MIB << 20, "{dev} is {size} bytes, the export {EXPORT_MIB} MiB");
    ensure!(connections(&log) >= 1, "tyche-init logged no NBD connection for nbd-client's");
    let tree = Tree::new(0x6e62_6400 + k as u64, 40, 8 << 20);
    disk.mkfs()?;
    let mnt = disk.mount()?;
    tree.write(&mnt.join("tree"), &mut |_| {})?;
    let data = mnt.join("fio.dat");
    fio(&data, false)?;
    disk.umount()?;
    println!("nbd: {dev} (--nbd-io {io}): ext4, {} KiB tree and fio crc32c verified", tree.bytes() >> 10);

    // Restart: SIGKILL the server under the connected (unmounted, synced) device and start it
    // again on the same socket. Measured with nbd-client 3.24 on 6.12: the kernel fails the
    // connection ("Receive control failed (result -32)"), NBD_DO_IT returns 0 (the kernel sets an
    // error only for a timeout), and nbd-client then quits ("Kernel call returned.") instead of
    // reconnecting: `-persist` reconnects only when NBD_DO_IT fails. With ext4 mounted the
    // filesystem is shut down at that moment (journal aborted, I/O errors). So the device is
    // unmounted here, and a new nbd-client attaches it again unless the old one reconnected.
    let status = server.kill()?;
    let killed = Instant::now();
    let exited = client.wait(Duration::from_secs(15)).ok();
    let log2 = work.join(format!("tyche-init-{io}-2.log"));
    let mut server = start_initiator(root, lab, &lab.pairs, EXPORT, &socket, io, &log2)?;
    let up = killed.elapsed();
    let how = match exited {
        Some(st) => {
            ensure!(!connected(&dev), "{dev} still connected after its nbd-client exited ({st})");
            client = nbd_client(&socket, &dev, &work.join(format!("nbd-client-{io}-2.log")))?;
            format!("nbd-client exited ({st}) when the server died, a new one attached")
        }
        None => {
            wait_for("nbd-client -persist to reconnect", Duration::from_secs(30), || {
                client.check_alive(&clog)?;
                Ok(connections(&log2) >= 1 && connected(&dev))
            })?;
            "nbd-client -persist reconnected".to_string()
        }
    };
    let resumed = killed.elapsed();
    println!(
        "nbd: tyche-init killed ({status}), serving again in {:.1} s; {how} {:.1} s after the kill",
        up.as_secs_f64(),
        resumed.as_secs_f64()
    );
    let mnt = disk.mount()?;
    fio(&data, true).context("after the restart")?;
    tree.verify(&mnt.join("tree"), &mut |_| {}).context("after the restart")?;
    // New writes after the restart, then everything from the device.
    let again = Tree::new(0x6e62_6480 + k as u64, 20, 4 << 20);
    again.write(&mnt.join("again"), &mut |_| {}).context("writing after the restart")?;
    disk.umount()?;
    disk.drop_caches()?;
    disk.fsck()?;
    let mnt = disk.mount()?;
    tree.verify(&mnt.join("tree"), &mut |_| {})?;
    again.verify(&mnt.join("again"), &mut |_| {})?;
    fio(&data, true)?;
    disk.umount()?;
    server.check_alive(&log2)?;
    run(Command::new("nbd-client").args(["-d", &dev]))?;
    let status = client.wait(Duration::from_secs(20)).context("nbd-client did not exit after nbd-client -d")?;
    ensure!(!connected(&dev), "{dev} still connected after nbd-client -d");
    println!("nbd: {dev} verified after the restart, fsck clean, disconnected (nbd-client {status})");
    Ok(format!("ext4+fio verify+restart ok (kill -9 of the server, {how}, data verified)"))
}

/// The virtio disk with serial `tyche-<target>-<io>`, qemu's NBD client behind it.
fn qemu_disk(work: &Path, target: &str, io: &str) -> Result<String> {
    let want = serial(target, io);
    let mut dev = None;
    for e in fs::read_dir("/sys/block")?.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with("vd") && fs::read_to_string(e.path().join("serial")).is_ok_and(|s| s.trim() == want) {
            dev = Some(format!("/dev/{name}"));
        }
    }
    let dev = dev.with_context(|| format!("no virtio disk with serial {want} (is virtio_blk loaded?)"))?;
    let mut disk = BlockFs::new(&dev, &work.join(format!("vd-{target}-{io}")));
    let size = disk.size()?;
    ensure!(size == EXPORT_MIB << 20, "{dev} is {size} bytes, the export {EXPORT_MIB} MiB");
    let tree = Tree::new(0x7165_6d75 ^ (io.len() + 8 * target.len()) as u64, 60, 16 << 20);
    disk.ext4_round_trip(&tree)?;
    println!("nbd: {dev} ({want}): ext4, {} KiB written, caches dropped, fsck clean, verified", tree.bytes() >> 10);
    Ok(format!("ext4 ok ({dev}, {} MiB verified)", tree.bytes() >> 20))
}
