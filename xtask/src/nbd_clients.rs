//! `cargo xtask nbd-clients`: the NBD clients people run, reading and writing a Tyche volume.
//!
//! qemu (`qemu-img`, `qemu-io`) and libnbd (`nbdinfo`, `nbdcopy`) against `tyche-init serve-nbd`
//! on both NBD I/O paths (`--nbd-io engine` and `--nbd-io tasks`) and both targets: `tyched`
//! over AF_XDP on a veth lab, and tyche-init's in-process RAM target (`--loopback-mib`). qemu
//! runs twice: the installed qemu (8.2 and later negotiate NBD extended headers) and Debian 12's
//! qemu 7.2 (compact headers), unpacked from its package into `target/qemu-7.2/` (cached). The
//! kernel's NBD client and a qemu VM whose disk is the export run in `cargo xtask vm-test`.
//!
//! A client that is missing fails the run: nothing here is skipped.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use crate::disk::run;
use crate::lab::Lab;
use crate::stack::{self, Daemon, Link};

/// The export every server here serves.
const EXPORT: &str = "clients";
/// Its size, MiB.
const EXPORT_MIB: u64 = 64;

#[derive(Args, Debug)]
pub struct NbdClientsArgs {
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
}

impl NbdClientsArgs {
    /// What `cargo xtask test` runs.
    pub fn standard() -> NbdClientsArgs {
        NbdClientsArgs { no_install: false }
    }
}

/// One qemu build: its `qemu-img` and `qemu-io`, and the library path its programs need.
struct Qemu {
    version: String,
    img: PathBuf,
    io: PathBuf,
    /// `LD_LIBRARY_PATH` for a qemu unpacked from its package (none for the installed one).
    libs: Option<PathBuf>,
}

impl Qemu {
    fn cmd(&self, prog: &Path) -> Command {
        let mut c = Command::new("timeout");
        c.arg("300").arg(prog);
        if let Some(l) = &self.libs {
            c.env("LD_LIBRARY_PATH", l);
        }
        c
    }

    /// NBD extended headers (qemu 8.2 and later negotiate them).
    fn extended(&self) -> bool {
        let mut v = self.version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        (major, minor) >= (8, 2)
    }

    fn label(&self) -> String {
        format!("qemu {} ({} headers)", self.version, if self.extended() { "extended" } else { "compact" })
    }
}

/// `qemu-img --version`'s version number.
fn qemu_version(q: &Qemu) -> Result<String> {
    let out = run(q.cmd(&q.img).arg("--version"))?;
    let v = out
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(2))
        .with_context(|| format!("no version in {out:?}"))?;
    Ok(v.to_string())
}

/// The installed qemu and Debian 12's qemu 7.2 (fetched once into `target/qemu-7.2/`).
fn qemus(root: &Path) -> Result<Vec<Qemu>> {
    let mut installed = Qemu {
        version: String::new(),
        img: crate::vm::which("qemu-img").context("qemu-img is not installed (apt-get install qemu-utils)")?,
        io: crate::vm::which("qemu-io").context("qemu-io is not installed (apt-get install qemu-utils)")?,
        libs: None,
    };
    installed.version = qemu_version(&installed)?;
    let dir = root.join("target/qemu-7.2");
    let usr = dir.join("root/usr");
    if !usr.join("bin/qemu-io").exists() {
        fetch_qemu_7_2(&dir)?;
    }
    let mut old =
        Qemu { version: String::new(), img: usr.join("bin/qemu-img"), io: usr.join("bin/qemu-io"), libs: None };
    old.version = qemu_version(&old)?;
    ensure!(
        !old.extended() && installed.extended(),
        "want one qemu with NBD extended headers and one without: have {} and {}",
        installed.version,
        old.version
    );
    Ok(vec![installed, old])
}

/// Debian 12's qemu-utils 7.2, downloaded with apt and unpacked (not installed) into `dir`.
fn fetch_qemu_7_2(dir: &Path) -> Result<()> {
    let version = |update: bool| -> Result<Option<String>> {
        if update {
            run(Command::new("apt-get").args(["update", "-qq"]))?;
        }
        let out = run(Command::new("apt-cache").args(["madison", "qemu-utils"]))?;
        Ok(out
            .lines()
            .filter_map(|l| l.split('|').nth(1).map(str::trim))
            .find(|v| v.starts_with("1:7.2+"))
            .map(str::to_string))
    };
    let v = match version(false)? {
        Some(v) => v,
        None => version(true)?.context("apt knows no qemu-utils 7.2 (Debian 12's): is bookworm in its sources?")?,
    };
    eprintln!("nbd-clients: fetching Debian 12's qemu-utils {v} into {}", dir.display());
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    run(Command::new("apt-get").args(["download", "-qq", &format!("qemu-utils={v}")]).current_dir(dir))
        .with_context(|| format!("apt-get download qemu-utils={v}"))?;
    let deb = fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no .deb")?;
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(dir.join("root")))?;
    Ok(())
}

/// Where an export is served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// `tyched` with a RAM export, over AF_XDP on a one-pair veth lab.
    Tyched,
    /// tyche-init's in-process RAM target (`--loopback-mib`).
    Loopback,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Tyched => "tyched over AF_XDP",
            Target::Loopback => "in-process target",
        }
    }
}

/// A file of the export's size with data at a few places and holes (zeros) between.
fn source_image(path: &Path) -> Result<Vec<(u64, u64)>> {
    let size = EXPORT_MIB << 20;
    let regions = [(0u64, 1u64 << 20), (5 << 20, 300 << 10), (17 << 20, 4 << 20), (size - (64 << 10), 64 << 10)];
    let mut data = vec![0u8; size as usize];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for &(at, len) in &regions {
        for b in &mut data[at as usize..(at + len) as usize] {
            // xorshift: bytes no two regions share.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8 | 1;
        }
    }
    fs::write(path, data)?;
    Ok(regions.to_vec())
}

/// The qemu-io commands run on every server, each checked: `-P` patterns are verified by the
/// reads that name one. Returns the commands.
fn qemu_io_ops() -> Vec<&'static str> {
    vec![
        "write -P 0xab 40M 64k",
        "read -P 0xab 40M 64k",
        "writev -P 0xcd 41M 4k 8k 512",
        "readv -P 0xcd 41M 4k 8k 512",
        "aio_write -P 0x11 42M 128k",
        "aio_write -P 0x12 43M 128k",
        "aio_flush",
        "aio_read -P 0x11 42M 128k",
        "aio_read -P 0x12 43M 128k",
        "aio_flush",
        "write -P 0x5a 44M 256k",
        "write -z 44M 256k",
        "read -P 0 44M 256k",
        "write -P 0x5b 45M 256k",
        "write -z -u 45M 256k",
        "read -P 0 45M 256k",
        "write -P 0x5c 46M 1M",
        "discard 46M 1M",
        "flush",
        "write -f -P 0x77 47M 4k",
        "read -P 0x77 47M 4k",
        "write -P 0x33 48M 3M",
        "read -P 0x33 48M 3M",
        "write -P 0x44 52M 1536",
        "read -P 0x44 52M 1536",
        "read -P 0 52M 0",
    ]
}

/// The NBD URI of the export on `socket`.
fn uri(socket: &Path) -> String {
    format!("nbd+unix:///{EXPORT}?socket={}", socket.display())
}

/// qemu-img: convert the source into the export and out again, compare, map. qemu-io: every
/// command of [`qemu_io_ops`]. Returns the count of qemu-io commands run.
fn qemu_checks(q: &Qemu, socket: &Path, src: &Path, regions: &[(u64, u64)], work: &Path) -> Result<usize> {
    let u = uri(socket);
    let what = q.label();
    run(q.cmd(&q.img).args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(src).arg(&u))
        .with_context(|| format!("{what}: qemu-img convert into the export"))?;
    let out = run(q.cmd(&q.img).args(["compare", "-f", "raw", "-F", "raw"]).arg(src).arg(&u))
        .with_context(|| format!("{what}: qemu-img compare"))?;
    ensure!(out.contains("Images are identical"), "{what}: qemu-img compare: {out}");
    let back = work.join("back.raw");
    let _ = fs::remove_file(&back);
    run(q.cmd(&q.img).args(["convert", "-f", "raw", "-O", "raw"]).arg(&u).arg(&back))
        .with_context(|| format!("{what}: qemu-img convert out of the export"))?;
    ensure!(fs::read(&back)? == fs::read(src)?, "{what}: qemu-img convert out of the export: contents differ");
    let map = run(q.cmd(&q.img).args(["map", "--output=json", "-f", "raw"]).arg(&u))
        .with_context(|| format!("{what}: qemu-img map"))?;
    check_map(&map, regions).with_context(|| format!("{what}: qemu-img map"))?;

    let ops = qemu_io_ops();
    let mut cmd = q.cmd(&q.io);
    cmd.args(["-f", "raw"]);
    for op in &ops {
        cmd.arg("-c").arg(op);
    }
    cmd.arg(&u);
    let out = cmd.output().context("running qemu-io")?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let failed: Vec<&str> =
        text.lines().filter(|l| l.contains("failed") || l.contains("error") || l.contains("Error")).collect();
    ensure!(
        out.status.success() && failed.is_empty(),
        "{what}: qemu-io ({}): {}\n{text}",
        out.status,
        failed.join("; ")
    );
    // Every read and write reports its bytes ("wrote N/N bytes", "read N/N bytes").
    let done = text.lines().filter(|l| l.starts_with("wrote ") || l.starts_with("read ")).count();
    let want = ops.iter().filter(|o| !o.ends_with("flush") && !o.starts_with("discard")).count();
    ensure!(done == want, "{what}: qemu-io reported {done} reads and writes, not {want}:\n{text}");
    Ok(ops.len())
}

/// `qemu-img map --output=json`: extents covering the export from 0 to its end without gaps, some
/// of them holes or zeroes, and every data region of the source inside extents that hold data.
fn check_map(json: &str, regions: &[(u64, u64)]) -> Result<()> {
    let v: serde_json::Value = serde_json::from_str(json).context("not JSON")?;
    let extents = v.as_array().context("not a list")?;
    let mut at = 0;
    let mut data = Vec::new();
    for e in extents {
        let start = e["start"].as_u64().context("an extent without start")?;
        let len = e["length"].as_u64().context("an extent without length")?;
        ensure!(start == at, "an extent at {start}, expected {at}");
        if e["data"].as_bool() == Some(true) {
            data.push((start, start + len));
        }
        at = start + len;
    }
    ensure!(at == EXPORT_MIB << 20, "extents end at {at}, not at the export's end");
    // The source's holes were written as zeroes: block status (`base:allocation`) maps some of
    // them as such, on both targets.
    ensure!(
        extents.iter().any(|e| e["data"].as_bool() == Some(false) || e["zero"].as_bool() == Some(true)),
        "nothing mapped as a hole or zeroes: was base:allocation negotiated?"
    );
    for &(s, l) in regions {
        ensure!(
            data.iter().any(|&(a, b)| a <= s && s + l <= b)
                || (s..s + l).step_by(4096).all(|o| data.iter().any(|&(a, b)| a <= o && o < b)),
            "data at {s}+{l} is not mapped as data"
        );
    }
    Ok(())
}

/// libnbd: `nbdinfo --map` and an `nbdcopy` of the whole export out, compared with qemu-img.
fn libnbd_checks(socket: &Path, work: &Path, q: &Qemu) -> Result<()> {
    let u = uri(socket);
    let map = run(Command::new("timeout").args(["120", "nbdinfo", "--map"]).arg(&u)).context("nbdinfo --map")?;
    ensure!(!map.trim().is_empty(), "nbdinfo --map printed nothing");
    let out = work.join("nbdcopy.raw");
    let _ = fs::remove_file(&out);
    run(Command::new("timeout").args(["120", "nbdcopy"]).arg(&u).arg(&out)).context("nbdcopy out of the export")?;
    let cmp = run(q.cmd(&q.img).args(["compare", "-f", "raw", "-F", "raw"]).arg(&out).arg(&u))
        .context("qemu-img compare with nbdcopy's copy")?;
    ensure!(cmp.contains("Images are identical"), "nbdcopy's copy differs: {cmp}");
    run(Command::new("timeout").args(["120", "nbdcopy"]).arg(&out).arg(&u)).context("nbdcopy into the export")?;
    Ok(())
}

/// A running `tyche-init serve-nbd` (and what it needs: `tyched`, or nothing).
struct Served {
    socket: PathBuf,
    _init: Daemon,
    log: PathBuf,
}

fn serve(root: &Path, lab: &Lab, target: Target, io: &str, work: &Path) -> Result<Served> {
    let socket = work.join(format!("nbd-{io}.sock"));
    let log =
        work.join(format!("tyche-init-{}-{io}.log", if target == Target::Tyched { "tyched" } else { "loopback" }));
    let extra = vec!["--nbd-io".to_string(), io.to_string()];
    match target {
        Target::Tyched => {
            let r = stack::start_initiator(root, lab, Link::Xdp, EXPORT, &socket, log.clone(), &extra)?;
            Ok(Served { socket, _init: r.daemon, log })
        }
        Target::Loopback => {
            let d = stack::start_loopback_initiator(root, EXPORT, EXPORT_MIB, io, &socket, &log)?;
            Ok(Served { socket, _init: d, log })
        }
    }
}

/// Runs every client against every server.
pub fn nbd_clients(root: &Path, args: &NbdClientsArgs) -> Result<Report> {
    stack::prepare(root, "nbd-clients", args.no_install)?;
    for tool in ["nbdinfo", "nbdcopy"] {
        crate::vm::which(tool).with_context(|| format!("{tool} is not installed (apt-get install libnbd-bin)"))?;
    }
    let qemus = qemus(root)?;
    let work = PathBuf::from("/run/tyche-nbd-clients");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let src = work.join("source.raw");
    let regions = source_image(&src)?;
    let pid = std::process::id();
    let lab = Lab::create(&format!("tyche-nc-t{pid}"), &format!("tyche-nc-i{pid}"), 1, 3000)?;
    let stats = work.join("tyched.sock");
    let mut tyched = stack::start_tyched(
        root,
        &lab,
        Link::Xdp,
        &format!("{EXPORT}=ram:{EXPORT_MIB}M"),
        &stats,
        work.join("tyched.log"),
    )?;
    let started = Instant::now();
    let mut ops = 0;
    let mut servers = 0;
    for target in [Target::Tyched, Target::Loopback] {
        for io in ["engine", "tasks"] {
            let s = serve(root, &lab, target, io, &work)?;
            let on = format!("{} with --nbd-io {io}", target.name());
            for q in &qemus {
                ops = qemu_checks(q, &s.socket, &src, &regions, &work)
                    .with_context(|| format!("on {on} (tyche-init's log: {})", s.log.display()))?;
                eprintln!("nbd-clients: {} on {on}: qemu-img ok, qemu-io {ops} commands ok", q.label());
            }
            libnbd_checks(&s.socket, &work, &qemus[0])
                .with_context(|| format!("libnbd on {on} (tyche-init's log: {})", s.log.display()))?;
            eprintln!("nbd-clients: libnbd on {on}: nbdinfo --map, nbdcopy out and in ok");
            servers += 1;
            drop(s);
            if target == Target::Tyched {
                tyched.check_alive()?;
            }
        }
    }
    if ops == 0 {
        bail!("no qemu-io command ran");
    }
    Ok(Report {
        clients: format!(
            "nbd clients: qemu-img ok (convert in and out, compare, map), qemu-io {ops} ops ok, with {} \
             and {}; libnbd ok (nbdinfo, nbdcopy); on {servers} servers (tyched over AF_XDP and the \
             in-process target, --nbd-io engine and tasks)",
            qemus[0].label(),
            qemus[1].label(),
        ),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// What [`nbd_clients`] ran: which clients did what, and how long it took.
pub struct Report {
    /// `nbd clients: ...`: each client with what it did, on which servers.
    pub clients: String,
    /// Seconds the clients ran.
    pub seconds: f64,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} in {:.0} s", self.clients, self.seconds)
    }
}
