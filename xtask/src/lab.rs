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
//!
//! [`Lab::create_bridged`] makes the attack test's shape (`cargo xtask attack`): one link whose
//! two ends are ports of a Linux bridge in a switch namespace, with a third namespace (the
//! attacker's) on a third port. The bridge learns nothing (`ageing_time 0`, `learning off` on
//! every port), so it floods every frame to every other port: the attacker sees the whole
//! session, and a frame it sends with the initiator's or the target's source MAC does not
//! divert that end's traffic to it.

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
    /// The bridge and the attacker of a [`Lab::create_bridged`] lab.
    pub bridged: Option<Bridged>,
    keep: bool,
}

/// What a bridged lab adds: the switch namespace holding the bridge, and the attacker's port.
#[derive(Debug, Clone)]
pub struct Bridged {
    pub switch_ns: String,
    pub bridge: String,
    pub attacker_ns: String,
    pub attacker_if: String,
    pub attacker_mac: MacAddr,
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
            bridged: None,
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

    /// The attack test's lab (fresh namespaces; any of the same names are deleted first): the
    /// target's `tyt0` and the initiator's `tyi0` (pair 0's names, MACs and addresses) and the
    /// attacker's `tyx0` (`10.99.0.3`, promiscuous) are veths whose peers `tybt0`, `tybi0`,
    /// `tybx0` are ports of bridge `tybr0` in `switch_ns`. The bridge floods every frame to every
    /// other port (no learning, `ageing_time 0`, no multicast snooping). AF_XDP on `tyt0` and
    /// `tyi0` attaches natively: their peers need no XDP program, since AF_XDP's copy-mode
    /// transmit goes through veth's ordinary transmit path and the bridge.
    pub fn create_bridged(
        target_ns: &str,
        initiator_ns: &str,
        switch_ns: &str,
        attacker_ns: &str,
        mtu: u32,
    ) -> Result<Lab> {
        let bridged = Bridged {
            switch_ns: switch_ns.to_string(),
            bridge: "tybr0".to_string(),
            attacker_ns: attacker_ns.to_string(),
            attacker_if: "tyx0".to_string(),
            attacker_mac: MacAddr::local(0x74f0),
        };
        // The guard first, so that a failure half way deletes what was made.
        let mut lab = Lab {
            target_ns: target_ns.to_string(),
            initiator_ns: initiator_ns.to_string(),
            pairs: Vec::new(),
            bridged: Some(bridged.clone()),
            keep: false,
        };
        for ns in [target_ns, initiator_ns, switch_ns, attacker_ns] {
            delete_ns(ns)?;
            ip(&["netns", "add", ns])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        let br = bridged.bridge.as_str();
        ip(&["-n", switch_ns, "link", "add", br, "type", "bridge", "ageing_time", "0", "stp_state", "0"])?;
        ip(&["-n", switch_ns, "link", "set", br, "type", "bridge", "mcast_snooping", "0"])?;
        let mtu_s = mtu.to_string();
        let p = Pair::new(0);
        let ends = [
            (target_ns, p.target_if.as_str(), "tybt0", p.target_mac, p.target_ip.clone()),
            (initiator_ns, p.initiator_if.as_str(), "tybi0", p.initiator_mac, p.initiator_ip.clone()),
            (attacker_ns, bridged.attacker_if.as_str(), "tybx0", bridged.attacker_mac, "10.99.0.3".to_string()),
        ];
        for (ns, ifname, port, mac, addr) in &ends {
            ip(&["link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", port, "netns", switch_ns])
                .with_context(|| format!("creating veth {ifname} in {ns}"))?;
            ip(&["-n", switch_ns, "link", "set", "dev", port, "mtu", &mtu_s, "master", br])?;
            ip(&[
                "-n",
                switch_ns,
                "link",
                "set",
                "dev",
                port,
                "type",
                "bridge_slave",
                "learning",
                "off",
                "flood",
                "on",
            ])?;
            ip(&["-n", switch_ns, "link", "set", "dev", port, "up"])?;
            let mac = mac.to_string();
            ip(&["-n", ns, "link", "set", "dev", ifname, "address", &mac, "mtu", &mtu_s])?;
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", ifname])?;
            ip(&["-n", ns, "link", "set", "dev", ifname, "up"])?;
        }
        ip(&["-n", attacker_ns, "link", "set", "dev", &bridged.attacker_if, "promisc", "on"])?;
        ip(&["-n", switch_ns, "link", "set", "dev", br, "mtu", &mtu_s, "up"])?;
        lab.pairs.push(p);
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
        let extra = self.bridged.iter().flat_map(|b| [&b.switch_ns, &b.attacker_ns]);
        for ns in [&self.target_ns, &self.initiator_ns].into_iter().chain(extra) {
            if let Err(e) = delete_ns(ns) {
                eprintln!("lab: could not delete namespace {ns}: {e:#}");
            }
        }
    }
}
