//! The veth lab: a target-side and an initiator-side network namespace joined by N veth pairs.
//!
//! `cargo xtask lab up --nics N --mtu M` creates (or brings to that shape, idempotently)
//! namespaces `tyche-t` and `tyche-i` with pairs `tyt<k>` (target side) / `tyi<k>` (initiator
//! side). Pair `k` gets `10.99.<k>.1/24` on the target side and `10.99.<k>.2/24` on the
//! initiator side, fixed MAC addresses, and the MTU. Nothing is routed outside the namespaces.
//! `cargo xtask lab down` deletes both namespaces (and with them the veths).
//!
//! Tests and the smoke create uniquely named labs through [`Lab::create`], whose guard deletes
//! the namespaces on drop, panics included.

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use tyche_wire::MacAddr;

/// Namespace of the target side of `lab up`.
pub const TARGET_NS: &str = "tyche-t";
/// Namespace of the initiator side of `lab up`.
pub const INITIATOR_NS: &str = "tyche-i";

#[derive(Debug, clap::Subcommand)]
pub enum LabCommand {
    /// Create the lab, or bring an existing one to this shape.
    Up {
        /// Veth pairs (NICs per side).
        #[arg(long, default_value_t = 2)]
        nics: u32,
        /// MTU of every veth.
        #[arg(long, default_value_t = 3000)]
        mtu: u32,
    },
    /// Delete the lab.
    Down,
}

pub fn run(cmd: LabCommand) -> Result<()> {
    match cmd {
        LabCommand::Up { nics, mtu } => {
            let lab = Lab::create(TARGET_NS, INITIATOR_NS, nics, mtu)?;
            for p in &lab.pairs {
                println!(
                    "lab: {}/{} {} {} <-> {}/{} {} {} mtu {mtu}",
                    lab.target_ns,
                    p.target_if,
                    p.target_ip,
                    p.target_mac,
                    lab.initiator_ns,
                    p.initiator_if,
                    p.initiator_ip,
                    p.initiator_mac
                );
            }
            lab.keep();
            Ok(())
        }
        LabCommand::Down => {
            delete_ns(TARGET_NS)?;
            delete_ns(INITIATOR_NS)?;
            println!("lab: down");
            Ok(())
        }
    }
}

/// One veth pair of the lab.
#[derive(Debug, Clone)]
pub struct Pair {
    pub target_if: String,
    pub initiator_if: String,
    pub target_ip: String,
    pub initiator_ip: String,
    pub target_mac: MacAddr,
    pub initiator_mac: MacAddr,
}

/// A lab; deletes its namespaces when dropped unless [`Lab::keep`] was called.
#[derive(Debug)]
pub struct Lab {
    pub target_ns: String,
    pub initiator_ns: String,
    pub pairs: Vec<Pair>,
    keep: bool,
}

/// Runs `ip` with `args`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).stdin(Stdio::null()).output().context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn ns_exists(ns: &str) -> bool {
    std::path::Path::new("/run/netns").join(ns).exists()
}

fn link_exists(ns: &str, ifname: &str) -> bool {
    ip(&["-n", ns, "link", "show", "dev", ifname]).is_ok()
}

/// Deletes a namespace if it exists.
pub fn delete_ns(ns: &str) -> Result<()> {
    if ns_exists(ns) {
        ip(&["netns", "del", ns])?;
    }
    Ok(())
}

impl Pair {
    fn new(k: u32) -> Pair {
        Pair {
            target_if: format!("tyt{k}"),
            initiator_if: format!("tyi{k}"),
            target_ip: format!("10.99.{k}.1"),
            initiator_ip: format!("10.99.{k}.2"),
            target_mac: MacAddr::local(0x7400 + k * 2),
            initiator_mac: MacAddr::local(0x7400 + k * 2 + 1),
        }
    }
}

impl Lab {
    /// Creates the namespaces and `nics` veth pairs at `mtu`, reusing what already exists and
    /// removing pairs beyond `nics`.
    pub fn create(target_ns: &str, initiator_ns: &str, nics: u32, mtu: u32) -> Result<Lab> {
        if nics == 0 || nics > 16 {
            bail!("--nics must be 1..=16");
        }
        let mut lab = Lab {
            target_ns: target_ns.to_string(),
            initiator_ns: initiator_ns.to_string(),
            pairs: Vec::new(),
            keep: false,
        };
        for ns in [target_ns, initiator_ns] {
            if !ns_exists(ns) {
                ip(&["netns", "add", ns])?;
            }
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        // Drop pairs left over from a larger lab (deleting one end deletes both).
        for k in nics..16 {
            let t = format!("tyt{k}");
            if link_exists(target_ns, &t) {
                ip(&["-n", target_ns, "link", "del", &t])?;
            }
        }
        let mtu_s = mtu.to_string();
        for k in 0..nics {
            let p = Pair::new(k);
            let have_t = link_exists(target_ns, &p.target_if);
            let have_i = link_exists(initiator_ns, &p.initiator_if);
            if have_t != have_i || !have_t {
                if have_t {
                    ip(&["-n", target_ns, "link", "del", &p.target_if])?;
                }
                if have_i {
                    ip(&["-n", initiator_ns, "link", "del", &p.initiator_if])?;
                }
                ip(&[
                    "link",
                    "add",
                    &p.target_if,
                    "netns",
                    target_ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &p.initiator_if,
                    "netns",
                    initiator_ns,
                ])
                .with_context(|| format!("creating veth pair {k}"))?;
            }
            for (ns, ifname, mac, addr) in [
                (target_ns, &p.target_if, p.target_mac, &p.target_ip),
                (initiator_ns, &p.initiator_if, p.initiator_mac, &p.initiator_ip),
            ] {
                let mac = mac.to_string();
                ip(&["-n", ns, "link", "set", "dev", ifname, "down"])?;
                ip(&["-n", ns, "link", "set", "dev", ifname, "address", &mac])?;
                ip(&["-n", ns, "link", "set", "dev", ifname, "mtu", &mtu_s])?;
                ip(&["-n", ns, "addr", "flush", "dev", ifname])?;
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", ifname])?;
                ip(&["-n", ns, "link", "set", "dev", ifname, "up"])?;
            }
            lab.pairs.push(p);
        }
        Ok(lab)
    }

    /// Leaves the namespaces in place when this value is dropped.
    pub fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        for ns in [&self.target_ns, &self.initiator_ns] {
            if let Err(e) = delete_ns(ns) {
                eprintln!("lab: could not delete namespace {ns}: {e:#}");
            }
        }
    }
}
