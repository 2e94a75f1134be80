//! `cargo xtask readme`: the README's two-host walkthrough, run as written in a one-NIC veth lab
//! (root), so the commands operators copy from it cannot drift from what the daemons accept.
//!
//! The section "Two hosts, from nothing to a mounted volume at boot" has three `sh` blocks: the
//! target's, the initiator's, and "the same by hand". Every line of them is either run here or
//! named in [`IN_VM`] as the VM tests' (`cargo xtask vm-test`: the boot test runs the same
//! commands through the package's units on a systemd guest with ublk); a line that is neither
//! fails the test, so a README edit must say how it is proven. What changes between the
//! README and this lab, and nothing else:
//! - `ens5` is the lab's `tyt0` on the target side and `tyi0` on the initiator side;
//! - the lab's NICs take the MACs the README names (the target's from the attachment file's
//!   `target`, the initiator's from the export's `allow`);
//! - `/etc/tyche`, `/var/lib/tyched` and `/run` are directories under a scratch directory;
//! - `systemctl enable --now tyched` runs the `ExecStart` of `dist/systemd/tyched.service`
//!   (with a stats socket in the scratch directory), until the stats socket answers.
//!
//! Checked: `tyched serve --check` accepts the README's configuration; the unit's command serves
//! it; `tyche-init discover` lists the export at the size the README gives and the target's
//! MAC; the flag form `tyched serve --export NAME=PATH:SIZE` creates the file sparse with mode
//! 0600; `tyche-init serve-nbd` as written serves it: nbdinfo sees the size, qemu-io writes a
//! pattern and reads it back; `tyche-init list` shows the attachment live. Last line:
//! `readme: N commands of the walkthrough run as written, M proven by the VM tests`.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use crate::lab::{ip, Lab};
use crate::stack::{bin, prepare, wait_for, Daemon};

/// The README section walked through.
const SECTION: &str = "## Two hosts, from nothing to a mounted volume at boot";

/// Commands (by their start) that need ublk, systemd or a mount, which this host lacks: the VM
/// tests run each of them (the boot test on a systemd guest with the package installed: the
/// attachment unit, mkfs and fstab on the by-tyche name, mount; the ublk test: `attach`, and
/// `detach` refusing a mounted device).
const IN_VM: &[&str] = &[
    "systemctl enable --now tyche-attach@",
    "mkfs.ext4 /dev/disk/by-tyche/",
    "echo '/dev/disk/by-tyche/",
    "mount ",
    "tyche-init attach --config ",
    "tyche-init detach ",
];

#[derive(Args, Debug)]
pub struct ReadmeArgs {
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
}

impl ReadmeArgs {
    /// The run `cargo xtask test` makes (packages already installed).
    pub fn standard() -> ReadmeArgs {
        ReadmeArgs { no_install: true }
    }
}

/// One step of a block: a command line, or a file a here-document writes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Run(String),
    Write { path: String, text: String },
}

/// Which host a step runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Target,
    Initiator,
}

/// The `sh` blocks of the walkthrough section, each as its steps.
fn walkthrough(readme: &str) -> Result<Vec<Vec<Step>>> {
    let start = readme.find(SECTION).with_context(|| format!("README.md has no section {SECTION:?}"))?;
    let rest = &readme[start + SECTION.len()..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let mut blocks = Vec::new();
    let mut lines = section.lines();
    while let Some(l) = lines.next() {
        if l.trim() != "```sh" {
            continue;
        }
        let mut steps = Vec::new();
        loop {
            let l = lines.next().context("an sh block of the walkthrough is not closed")?;
            if l.trim() == "```" {
                break;
            }
            if let Some((path, end)) = here_document(l) {
                let mut text = String::new();
                loop {
                    let l = lines.next().with_context(|| format!("here-document for {path} is not closed"))?;
                    if l == end {
                        break;
                    }
                    text.push_str(l);
                    text.push('\n');
                }
                steps.push(Step::Write { path, text });
            } else if !l.trim().is_empty() && !l.trim_start().starts_with('#') {
                // Without its comment (a ` #` outside quotes: none of the README's quote one).
                let command = l.find(" #").map_or(l, |at| &l[..at]);
                steps.push(Step::Run(command.trim_end().to_string()));
            }
        }
        blocks.push(steps);
    }
    ensure!(blocks.len() == 3, "the walkthrough has {} sh blocks, not 3 (target, initiator, by hand)", blocks.len());
    Ok(blocks)
}

/// The files the blocks' here-documents write: (path, text).
fn written(blocks: &[Vec<Step>]) -> impl Iterator<Item = (&str, &str)> {
    blocks.iter().flatten().filter_map(|s| match s {
        Step::Write { path, text } => Some((path.as_str(), text.as_str())),
        Step::Run(_) => None,
    })
}

/// `cat > PATH <<'END'`: the path and the end marker.
fn here_document(line: &str) -> Option<(String, String)> {
    let rest = line.trim().strip_prefix("cat > ")?;
    let (path, end) = rest.split_once(" <<")?;
    Some((path.trim().to_string(), end.trim().trim_matches('\'').to_string()))
}

/// The value of `key = "..."` (or the first string of `key = ["..."]`) in a TOML text.
fn toml_string(text: &str, key: &str) -> Option<String> {
    let line = text.lines().find(|l| l.trim_start().starts_with(&format!("{key} ")))?;
    let v = line.split_once('=')?.1;
    Some(v.split('"').nth(1)?.to_string())
}

/// Where the README's paths go in the scratch directory `work`, and its interface name on `side`.
fn localize(s: &str, side: Side, work: &Path) -> String {
    let nic = match side {
        Side::Target => "tyt0",
        Side::Initiator => "tyi0",
    };
    let w = work.display();
    // `/run/` first: the scratch directory may itself be under /run.
    s.replace("ens5", nic)
        .replace("/run/", &format!("{w}/run/"))
        .replace("/etc/tyche/", &format!("{w}/etc/tyche/"))
        .replace("/var/lib/tyched/", &format!("{w}/var/lib/tyched/"))
}

pub fn readme(root: &Path, args: &ReadmeArgs) -> Result<()> {
    prepare(root, "readme", args.no_install)?;
    let text = fs::read_to_string(root.join("README.md")).context("reading README.md")?;
    let blocks = walkthrough(&text)?;
    let pid = std::process::id();
    let work = PathBuf::from(format!("/run/tyche-readme-{pid}"));
    let _ = fs::remove_dir_all(&work);
    for d in ["etc/tyche/attach.d", "var/lib/tyched", "run"] {
        fs::create_dir_all(work.join(d))?;
    }
    let lab = Lab::create(&format!("tyr-t{pid}"), &format!("tyr-i{pid}"), 1, 3000)?;
    let result = Walk::new(root, &lab, &work, &blocks).and_then(|mut w| w.run(&blocks));
    drop(lab);
    match &result {
        Ok(_) => {
            let _ = fs::remove_dir_all(&work);
        }
        Err(_) => eprintln!("readme: logs kept in {}", work.display()),
    }
    let (ran, in_vm) = result?;
    println!("readme: {ran} commands of the walkthrough run as written, {in_vm} proven by the VM tests");
    Ok(())
}

/// The walk through the blocks, and the daemons it started.
struct Walk<'a> {
    root: &'a Path,
    lab: &'a Lab,
    work: &'a Path,
    /// The export and its size in bytes, from the README's configuration.
    export: String,
    size: u64,
    target_mac: String,
    daemons: BTreeMap<&'static str, Daemon>,
}

impl<'a> Walk<'a> {
    fn new(root: &'a Path, lab: &'a Lab, work: &'a Path, blocks: &[Vec<Step>]) -> Result<Walk<'a>> {
        let files: Vec<&str> = written(blocks).map(|(_, text)| text).collect();
        let find =
            |key: &str| files.iter().find_map(|t| toml_string(t, key)).with_context(|| format!("no {key} in README"));
        let (target_mac, initiator_mac) = (find("target")?, find("allow")?);
        let export = find("name")?;
        let size = parse_size(&find("size")?)?;
        // The lab's NICs take the README's MACs.
        for (ns, nic, mac) in [(&lab.target_ns, "tyt0", &target_mac), (&lab.initiator_ns, "tyi0", &initiator_mac)] {
            ip(&["-n", ns, "link", "set", "dev", nic, "down"])?;
            ip(&["-n", ns, "link", "set", "dev", nic, "address", mac])?;
            ip(&["-n", ns, "link", "set", "dev", nic, "up"])?;
        }
        Ok(Walk { root, lab, work, export, size, target_mac, daemons: BTreeMap::new() })
    }

    fn ns(&self, side: Side) -> &str {
        match side {
            Side::Target => &self.lab.target_ns,
            Side::Initiator => &self.lab.initiator_ns,
        }
    }

    /// A shell on `side` running `line`, with the release binaries first on PATH.
    fn shell(&self, side: Side, line: &str) -> Command {
        let bins = bin(self.root, "tyched").parent().map(Path::to_path_buf).unwrap_or_default();
        let path = format!("{}:{}", bins.display(), std::env::var("PATH").unwrap_or_default());
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.ns(side), "env"]).arg(format!("PATH={path}")).args(["bash", "-c", line]);
        c
    }

    /// Runs `line` on `side` to its end; its standard output.
    fn run_line(&self, side: Side, line: &str) -> Result<String> {
        let out = self.shell(side, line).output().with_context(|| format!("running {line}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success(),
            "`{line}` failed ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    }

    /// Starts `line` on `side` as a daemon named `name` (logging to the scratch directory).
    fn start(&mut self, name: &'static str, side: Side, line: &str) -> Result<()> {
        let log = self.work.join(format!("{name}.log"));
        let d = Daemon::spawn(name, &mut self.shell(side, &format!("exec {line}")), &log)?;
        self.daemons.insert(name, d);
        Ok(())
    }

    fn check_alive(&mut self, name: &str) -> Result<()> {
        let log = self.work.join(format!("{name}.log"));
        match self.daemons.get_mut(name) {
            Some(d) => d.check_alive(&log),
            None => Ok(()),
        }
    }

    /// The steps of every block; (commands run, commands left to the VM). A command that looks
    /// at an attachment (`tyche-init list`) before this lab has one (the README's comes from the
    /// unit, which needs ublk) runs once `serve-nbd` attached.
    fn run(&mut self, blocks: &[Vec<Step>]) -> Result<(usize, usize)> {
        let (mut ran, mut in_vm) = (0, 0);
        let mut later = Vec::new();
        for (b, steps) in blocks.iter().enumerate() {
            for step in steps {
                match step {
                    Step::Write { path, text } => {
                        let side = if b == 0 { Side::Target } else { Side::Initiator };
                        let at = PathBuf::from(localize(path, side, self.work));
                        fs::write(&at, localize(text, side, self.work)).with_context(|| format!("writing {path}"))?;
                    }
                    Step::Run(line) => {
                        let side = match (b, line.split_whitespace().next()) {
                            (0, _) => Side::Target,
                            (2, Some("tyched")) => Side::Target,
                            _ => Side::Initiator,
                        };
                        if IN_VM.iter().any(|p| line.starts_with(p)) {
                            eprintln!("readme: (VM tests) {line}");
                            in_vm += 1;
                            continue;
                        }
                        if line.starts_with("tyche-init list") && !self.daemons.contains_key("serve-nbd") {
                            later.push((side, line));
                            continue;
                        }
                        eprintln!("readme: {line}");
                        let local = localize(line, side, self.work);
                        self.command(side, line, &local).with_context(|| format!("README: `{line}`"))?;
                        ran += 1;
                    }
                }
            }
        }
        for (side, line) in later {
            eprintln!("readme: {line}  (once serve-nbd attached)");
            let local = localize(line, side, self.work);
            self.command(side, line, &local).with_context(|| format!("README: `{line}`"))?;
            ran += 1;
        }
        Ok((ran, in_vm))
    }

    /// One command of the README (`line`, `local` with the lab's names), and its check.
    fn command(&mut self, side: Side, line: &str, local: &str) -> Result<()> {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["tyched", "serve", ..] if words.contains(&"--check") => {
                let out = self.run_line(side, local)?;
                ensure!(out.contains("configuration ok"), "no \"configuration ok\": {out}");
            }
            ["systemctl", "enable", "--now", "tyched"] => self.target_unit()?,
            ["tyche-init", "discover", ..] => self.discover(local)?,
            ["tyched", "serve", ..] => {
                // The by-hand target replaces the unit's.
                if let Some(mut d) = self.daemons.remove("tyched-unit") {
                    d.stop();
                }
                let file = self.work.join("var/lib/tyched").join(format!("{}.img", self.export));
                let _ = fs::remove_file(&file);
                let stats = self.work.join("tyched-hand.sock");
                self.start("tyched-hand", side, &format!("{local} --stats-socket {}", stats.display()))?;
                self.serving(&stats, "tyched-hand")?;
                let meta = fs::metadata(&file).with_context(|| format!("{} was not created", file.display()))?;
                ensure!(meta.len() == self.size, "{} is {} bytes, not {}", file.display(), meta.len(), self.size);
                ensure!(meta.permissions().mode() & 0o777 == 0o600, "{} has mode {:o}", file.display(), meta.permissions().mode());
                use std::os::unix::fs::MetadataExt;
                ensure!(meta.blocks() * 512 < 1 << 20, "{} is not sparse ({} blocks)", file.display(), meta.blocks());
            }
            ["tyche-init", "serve-nbd", ..] => self.serve_nbd(local)?,
            ["tyche-init", "list", ..] => {
                let out = self.run_line(side, local)?;
                ensure!(out.contains("live"), "no live attachment listed:\n{out}");
            }
            _ => bail!("this README line is neither run by `cargo xtask readme` nor named as the VM boot test's (xtask/src/readme.rs, IN_VM)"),
        }
        Ok(())
    }

    /// `systemctl enable --now tyched`: the unit's ExecStart, until its stats socket answers.
    fn target_unit(&mut self) -> Result<()> {
        let unit = fs::read_to_string(self.root.join("dist/systemd/tyched.service"))?;
        let exec = unit
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .context("tyched.service has no ExecStart")?
            .replace("/usr/bin/", "");
        let stats = self.work.join("tyched-unit.sock");
        let line = format!("{} --stats-socket {}", localize(&exec, Side::Target, self.work), stats.display());
        self.start("tyched-unit", Side::Target, &line)?;
        self.serving(&stats, "tyched-unit")
    }

    /// Waits until the tyched named `name` answers on `stats`.
    fn serving(&mut self, stats: &Path, name: &'static str) -> Result<()> {
        let bin = bin(self.root, "tyched");
        wait_for(&format!("{name} serving"), Duration::from_secs(30), || {
            self.check_alive(name)?;
            Ok(Command::new(&bin).arg("stats").arg("--socket").arg(stats).output()?.status.success())
        })
    }

    /// `tyche-init discover`: the export, its size and the target's MAC are listed.
    fn discover(&mut self, local: &str) -> Result<()> {
        let out = self.run_line(Side::Initiator, local)?;
        ensure!(out.contains(&self.target_mac), "discover does not list the target {}:\n{out}", self.target_mac);
        ensure!(out.contains(&self.export), "discover does not list export {}:\n{out}", self.export);
        let json = self.run_line(Side::Initiator, &format!("{local} --json"))?;
        let v: serde_json::Value = serde_json::from_str(&json).with_context(|| format!("discover --json: {json}"))?;
        let sizes: Vec<u64> = v
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["export"] == self.export.as_str() && e["target"] == self.target_mac.as_str())
            .filter_map(|e| e["size"].as_u64())
            .collect();
        ensure!(sizes == [self.size], "discover --json gives {} the sizes {sizes:?}, not {}", self.export, self.size);
        Ok(())
    }

    /// `tyche-init serve-nbd --socket S ...`: nbdinfo sees the export's size, qemu-io writes a
    /// pattern and reads it back.
    fn serve_nbd(&mut self, local: &str) -> Result<()> {
        let words: Vec<&str> = local.split_whitespace().collect();
        let socket = words
            .windows(2)
            .find(|w| w[0] == "--socket")
            .map(|w| PathBuf::from(w[1]))
            .context("serve-nbd without --socket")?;
        self.start("serve-nbd", Side::Initiator, local)?;
        wait_for("the NBD socket", Duration::from_secs(30), || {
            self.check_alive("serve-nbd")?;
            Ok(socket.exists())
        })?;
        let uri = format!("nbd+unix:///{}?socket={}", self.export, socket.display());
        let size = self.run_line(Side::Initiator, &format!("nbdinfo --size '{uri}'"))?;
        ensure!(size.trim() == self.size.to_string(), "nbdinfo --size says {size:?}, not {}", self.size);
        let io = format!(
            "qemu-io -f raw -c 'write -P 0x5a {off} 1M' -c 'read -P 0x5a {off} 1M' '{uri}'",
            off = self.size - (1 << 20)
        );
        let out = self.run_line(Side::Initiator, &io)?;
        ensure!(!out.contains("Pattern verification failed"), "qemu-io: {out}");
        Ok(())
    }
}

/// A size as the README writes it (`100G`).
fn parse_size(s: &str) -> Result<u64> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().with_context(|| format!("size {s:?}"))?;
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => bail!("size {s:?}"),
    };
    Ok(n << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_walkthrough_parses_into_three_blocks_with_their_files() {
        let text = fs::read_to_string(crate::root().join("README.md")).expect("README.md");
        let blocks = walkthrough(&text).expect("the walkthrough");
        let files: Vec<&str> = written(&blocks).map(|(path, _)| path).collect();
        assert_eq!(files, ["/etc/tyche/tyched.toml", "/etc/tyche/attach.d/data.toml"]);
        assert_eq!(
            localize("tyched serve --iface ens5 --export d=/var/lib/tyched/d.img", Side::Target, Path::new("/w")),
            "tyched serve --iface tyt0 --export d=/w/var/lib/tyched/d.img"
        );
        assert_eq!(parse_size("100G").expect("size"), 100 << 30);
    }
}
