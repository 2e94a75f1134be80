//! What the VM runner (`vm`) and the systemd guest's test (`vm_boot`) share: the tests a guest
//! runs and their verdict lines, the guest's shape, the guest kernel, and the private apt
//! configuration both fetch packages with.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;

use crate::disk::run;

/// Marker prefix of guest verdict lines on the console.
pub const MARK: &str = "VMTEST";

/// A test run inside the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum GuestTest {
    /// `/dev/ublkb0` with ext4 over a 2-NIC veth lab.
    Ublk,
    /// Placement on a 2-node topology with a NIC per node on each side.
    Numa,
    /// The kernel's NBD client (nbd-client) and qemu's (virtio disks) on `tyche-init serve-nbd`.
    Nbd,
    /// Tyche volumes of several targets as members of md RAID1 and RAID10 arrays (failfast,
    /// bitmap) under fio: targets killed, links down 11 s and 30 s, members failed, re-added and
    /// resynced; tyche-init killed and recovered; a second host refused; a member moved.
    Mirror,
    /// Crash consistency at the target's disk: ext4 under a fsync-heavy workload over a target
    /// whose disk is a dm-log-writes device, the log replayed to every flush and FUA and each
    /// image fsck'd (calm, and with the target killed mid-workload).
    Crash,
    /// A Debian guest booted with systemd and the `.deb` installed: units from `/etc/tyche`, ext4
    /// from fstab across a reboot, a restart of the attachment unit (its own guest, not `/init`).
    Boot,
}

impl GuestTest {
    pub fn name(self) -> &'static str {
        match self {
            GuestTest::Ublk => "ublk",
            GuestTest::Numa => "numa",
            GuestTest::Nbd => "nbd",
            GuestTest::Mirror => "mirror",
            GuestTest::Crash => "crash",
            GuestTest::Boot => "boot",
        }
    }
}

/// The qemu hub of node N joins NIC `52:54:00:74:0N:01` (target side) and `...:0N:02` (initiator).
pub fn nic_mac(node: u32, side: u32) -> String {
    format!("52:54:00:74:{node:02x}:{side:02x}")
}

/// A guest to boot: what differs between the initramfs guest and the boot test's systemd one.
pub struct Guest {
    /// The kernel image.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// The guest's own part of the kernel command line (the console, `panic` and `oops` are set
    /// for every guest).
    pub append: String,
    /// NUMA nodes: each has 2 vCPUs, `NODE_MIB` of memory and a PCI expander bridge with two
    /// NICs on a qemu hub of its own ([`nic_mac`]).
    pub nodes: u32,
    /// More qemu arguments (disks).
    pub extra: Vec<String>,
    /// Console text that shows the guest reached user space, printed again at each boot when
    /// the guest reboots.
    pub up: &'static str,
    /// How often the guest reboots itself: with 0, qemu gets `-no-reboot`, and a panic (which
    /// reboots, `panic=-1`) ends the run; otherwise a boot more than this is an error.
    pub reboots: usize,
}

/// The extracted kernel package.
#[derive(Debug)]
pub struct Kernel {
    /// `uname -r` of the guest.
    pub version: String,
    /// The kernel image.
    pub vmlinuz: PathBuf,
    /// Its modules' tree.
    pub modules: PathBuf,
}

/// The machine's Debian mirror, read from its apt sources (never a host written here).
fn debian_mirror() -> Result<String> {
    let mut texts = Vec::new();
    for dir in ["/etc/apt/sources.list.d"] {
        if let Ok(rd) = fs::read_dir(dir) {
            for e in rd.flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "sources" || x == "list") {
                    texts.push(fs::read_to_string(&p).unwrap_or_default());
                }
            }
        }
    }
    texts.push(fs::read_to_string("/etc/apt/sources.list").unwrap_or_default());
    for text in &texts {
        // deb822 stanzas: URIs + Suites.
        for stanza in text.split("\n\n") {
            let field = |k: &str| stanza.lines().find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()));
            if let (Some(uris), Some(suites)) = (field("URIs:"), field("Suites:")) {
                if suites.split_whitespace().any(|s| s == "bookworm") {
                    if let Some(u) = uris.split_whitespace().next() {
                        return Ok(u.to_string());
                    }
                }
            }
        }
        // One-line style: deb [opts] URI suite components.
        for l in text.lines() {
            let words: Vec<&str> = l.split_whitespace().filter(|w| !w.starts_with('[')).collect();
            if words.first() == Some(&"deb") && words.get(2) == Some(&"bookworm") {
                return Ok(words[1].to_string());
            }
        }
    }
    bail!("no Debian bookworm source in /etc/apt: cannot fetch the bookworm-backports kernel")
}

/// Compares Debian-ish version strings by their numeric runs (enough for 6.12.N+deb12).
pub fn version_key(s: &str) -> Vec<u64> {
    s.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty()).map(|p| p.parse().unwrap_or(0)).collect()
}

/// A private apt configuration: the machine's own sources plus bookworm-backports on the same
/// mirror, with its own lists, so the machine's apt setup is left as it is.
pub struct Apt {
    dir: PathBuf,
}

impl Apt {
    pub fn new(cache: &Path) -> Result<Apt> {
        let dir = cache.join("apt");
        for d in ["lists/partial", "cache/archives/partial", "sources"] {
            fs::create_dir_all(dir.join(d))?;
        }
        Ok(Apt { dir })
    }

    /// `prog` (apt-get, apt-cache) with this configuration.
    pub fn cmd(&self, prog: &str) -> Command {
        let mut cmd = Command::new(prog);
        for (k, v) in [
            ("Dir::Etc::sourceparts", self.dir.join("sources")),
            ("Dir::State::Lists", self.dir.join("lists")),
            ("Dir::Cache", self.dir.join("cache")),
        ] {
            cmd.arg("-o").arg(format!("{k}={}", v.display()));
        }
        cmd.args(["-o", "APT::Sandbox::User=root"]).env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    }

    /// The sources files [`Apt::update`] wrote.
    pub fn sources(&self) -> Result<Vec<PathBuf>> {
        let mut files: Vec<PathBuf> = fs::read_dir(self.dir.join("sources"))?.flatten().map(|e| e.path()).collect();
        files.sort();
        Ok(files)
    }

    /// Writes the sources and runs `apt-get update`.
    pub fn update(&self) -> Result<()> {
        let sources = self.dir.join("sources");
        for e in fs::read_dir(&sources)?.flatten() {
            fs::remove_file(e.path())?;
        }
        if let Ok(rd) = fs::read_dir("/etc/apt/sources.list.d") {
            for e in rd.flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "sources" || x == "list") {
                    fs::copy(&p, sources.join(e.file_name()))?;
                }
            }
        }
        let mirror = debian_mirror()?;
        fs::write(
            sources.join("tyche-backports.sources"),
            format!(
                "Types: deb\nURIs: {mirror}\nSuites: bookworm-backports\nComponents: main\n\
                 Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
            ),
        )?;
        run(self.cmd("apt-get").args(["update", "-qq"])).context("apt-get update (with bookworm-backports)")?;
        Ok(())
    }
}

/// Prints a guest test's verdict line (none for `Ok(None)`: no verdict yet).
pub fn report(test: GuestTest, result: Result<Option<String>>) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match &result {
        Ok(Some(summary)) => writeln!(out, "{MARK} {} ok {summary}", test.name())?,
        Ok(None) => {}
        Err(e) => writeln!(out, "{MARK} {} FAIL {}", test.name(), format!("{e:#}").replace('\n', " | "))?,
    }
    out.flush()?;
    result.map(drop)
}
