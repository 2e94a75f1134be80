//! The interrupts of a NIC: which IRQs it has, where the kernel may and does deliver them, and
//! moving them (Hanford et al.: the receive thread does best on the same socket as its NIC's
//! interrupts but on another core; on the same core it does worst).
//!
//! Everything reads from a [`Roots`] pair (the sysfs and procfs mount points), so the logic is
//! tested against a fake directory tree, malformed files included. Reading:
//! - a NIC without `/sys/class/net/<if>/device` is virtual (veth, bridge, ifb): it has no IRQs;
//! - its IRQs are the entries of `device/msi_irqs/`, else of the parent device's `msi_irqs/`
//!   (a virtio NIC's `device` is the virtio device; the PCI function above it has the
//!   vectors), else the `/proc/interrupts` lines whose name mentions the interface, else the
//!   legacy `device/irq`;
//! - each IRQ's allowed CPUs are `/proc/irq/<n>/smp_affinity_list` and, where the kernel has
//!   it, the CPUs it really delivers to are `effective_affinity_list`.
//!
//! CPU lists go through [`crate::cpulist`], the one parser of the workspace.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{format_cpu_list, parse_cpu_list, Topology};

/// Where sysfs and procfs are mounted (`/sys`, `/proc` on a real machine; a fake tree in tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots {
    /// The sysfs mount point.
    pub sys: PathBuf,
    /// The procfs mount point.
    pub proc: PathBuf,
}

impl Default for Roots {
    fn default() -> Self {
        Roots { sys: PathBuf::from("/sys"), proc: PathBuf::from("/proc") }
    }
}

/// Most IRQs one NIC may report (a bound on what a strange tree can make us read).
pub const MAX_IRQS_PER_NIC: usize = 4096;

/// What can go wrong reading or setting IRQ affinity.
#[derive(Debug, thiserror::Error)]
pub enum IrqError {
    /// The interface does not exist.
    #[error("no network interface {0:?} in {1}")]
    NoSuchInterface(String, String),
    /// A file that should hold a number or a CPU list does not.
    #[error("{path}: {reason}")]
    Malformed {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file or directory could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// Writing an IRQ's affinity was refused because this process is not root.
    #[error(
        "setting the affinity of IRQ {irq} needs root (CAP_SYS_ADMIN); run as root or use irq_affinity = \"keep\""
    )]
    NotRoot {
        /// The IRQ.
        irq: u32,
    },
    /// The kernel refused the new affinity of an IRQ.
    #[error(
        "IRQ {irq} is not writable ({path}: {source}); the driver may manage its affinity itself \
         (managed MSI-X vectors), or the CPUs are not allowed; use irq_affinity = \"keep\""
    )]
    NotWritable {
        /// The IRQ.
        irq: u32,
        /// The file written.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// `auto` found no CPU to put a NIC's interrupts on.
    #[error("{0}")]
    NoCpu(String),
}

/// One IRQ and where it goes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IrqAffinity {
    /// The IRQ number.
    pub irq: u32,
    /// The CPUs the IRQ may be delivered to (`smp_affinity_list`).
    pub affinity: Vec<u32>,
    /// The CPUs it is delivered to (`effective_affinity_list`; empty where the kernel does not
    /// say).
    #[serde(default)]
    pub effective: Vec<u32>,
}

impl IrqAffinity {
    /// Where the interrupt lands: the effective CPUs when known, else the allowed ones.
    pub fn cpus(&self) -> &[u32] {
        if self.effective.is_empty() {
            &self.affinity
        } else {
            &self.effective
        }
    }
}

/// A NIC's interrupts, as read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicIrqs {
    /// Interface name.
    pub nic: String,
    /// A virtual NIC (no `device` in sysfs: veth, bridge, ifb): it has no IRQs.
    pub virtual_nic: bool,
    /// Its IRQs, ascending.
    pub irqs: Vec<IrqAffinity>,
}

impl NicIrqs {
    /// Every CPU an interrupt of this NIC lands on.
    pub fn cpus(&self) -> Vec<u32> {
        let set: BTreeSet<u32> = self.irqs.iter().flat_map(|i| i.cpus().iter().copied()).collect();
        set.into_iter().collect()
    }

    /// One line for humans: `none (virtual NIC)`, `none found`, or `IRQ 38 -> 1 (allowed 0-1), ...`.
    pub fn describe(&self) -> String {
        if self.virtual_nic {
            return "none (virtual NIC)".into();
        }
        if self.irqs.is_empty() {
            return "none found".into();
        }
        self.irqs
            .iter()
            .map(|i| {
                if i.effective.is_empty() || i.effective == i.affinity {
                    format!("{} -> {}", i.irq, format_cpu_list(&i.affinity))
                } else {
                    format!("{} -> {} (allowed {})", i.irq, format_cpu_list(&i.effective), format_cpu_list(&i.affinity))
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn read(path: &Path) -> Result<String, IrqError> {
    fs::read_to_string(path).map_err(|source| IrqError::Read { path: path.display().to_string(), source })
}

fn malformed(path: &Path, reason: impl Into<String>) -> IrqError {
    IrqError::Malformed { path: path.display().to_string(), reason: reason.into() }
}

/// The IRQ numbers named by the entries of an `msi_irqs` directory.
fn msi_dir(dir: &Path) -> Result<Vec<u32>, IrqError> {
    let entries = fs::read_dir(dir).map_err(|source| IrqError::Read { path: dir.display().to_string(), source })?;
    let mut irqs = Vec::new();
    for e in entries {
        let e = e.map_err(|source| IrqError::Read { path: dir.display().to_string(), source })?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        let irq =
            name.parse::<u32>().map_err(|_| malformed(&e.path(), "an msi_irqs entry that is not an IRQ number"))?;
        irqs.push(irq);
        if irqs.len() > MAX_IRQS_PER_NIC {
            return Err(malformed(dir, format!("more than {MAX_IRQS_PER_NIC} IRQs")));
        }
    }
    Ok(irqs)
}

/// The IRQs of `/proc/interrupts` lines whose action names mention `ifname` (`eth0-TxRx-0`,
/// `mlx5_comp0@pci:...` does not; drivers that name vectors after the interface do).
fn proc_interrupts(roots: &Roots, ifname: &str) -> Result<Vec<u32>, IrqError> {
    let path = roots.proc.join("interrupts");
    let text = read(&path)?;
    let mut irqs = Vec::new();
    for line in text.lines().skip(1) {
        let Some((num, rest)) = line.trim_start().split_once(':') else { continue };
        // NMI, LOC, ... are not numbered: not device interrupts.
        let Ok(irq) = num.trim().parse::<u32>() else { continue };
        let named = rest.split_whitespace().rev().take(2).any(|w| {
            w.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.')).any(|t| t == ifname)
                || w.starts_with(&format!("{ifname}-"))
        });
        if named {
            irqs.push(irq);
        }
    }
    Ok(irqs)
}

/// Reads the IRQs of `ifname` and their affinity.
pub fn nic_irqs(roots: &Roots, ifname: &str) -> Result<NicIrqs, IrqError> {
    if ifname.is_empty() || ifname.contains('/') || ifname == "." || ifname == ".." {
        return Err(IrqError::NoSuchInterface(ifname.into(), "/sys/class/net".into()));
    }
    let net = roots.sys.join("class/net").join(ifname);
    if !net.exists() {
        return Err(IrqError::NoSuchInterface(ifname.into(), roots.sys.join("class/net").display().to_string()));
    }
    let device = net.join("device");
    if !device.exists() {
        return Ok(NicIrqs { nic: ifname.into(), virtual_nic: true, irqs: Vec::new() });
    }
    let mut irqs = Vec::new();
    for dir in [device.join("msi_irqs"), device.join("../msi_irqs")] {
        if dir.is_dir() {
            irqs = msi_dir(&dir)?;
            if !irqs.is_empty() {
                break;
            }
        }
    }
    if irqs.is_empty() {
        irqs = proc_interrupts(roots, ifname)?;
    }
    if irqs.is_empty() {
        let legacy = device.join("irq");
        if legacy.exists() {
            let text = read(&legacy)?;
            let irq: u32 = text.trim().parse().map_err(|_| malformed(&legacy, "not an IRQ number"))?;
            if irq != 0 {
                irqs.push(irq);
            }
        }
    }
    irqs.sort_unstable();
    irqs.dedup();
    let irqs = irqs.into_iter().map(|irq| irq_affinity(roots, irq)).collect::<Result<_, _>>()?;
    Ok(NicIrqs { nic: ifname.into(), virtual_nic: false, irqs })
}

/// Reads one IRQ's allowed and effective CPUs.
pub fn irq_affinity(roots: &Roots, irq: u32) -> Result<IrqAffinity, IrqError> {
    let dir = roots.proc.join("irq").join(irq.to_string());
    let list = |name: &str| -> Result<Vec<u32>, IrqError> {
        let path = dir.join(name);
        let text = read(&path)?;
        parse_cpu_list(text.trim()).map_err(|e| malformed(&path, e))
    };
    let affinity = list("smp_affinity_list")?;
    let effective =
        if dir.join("effective_affinity_list").exists() { list("effective_affinity_list")? } else { Vec::new() };
    Ok(IrqAffinity { irq, affinity, effective })
}

/// Sets one IRQ's affinity (`smp_affinity_list`).
pub fn set_irq_affinity(roots: &Roots, irq: u32, cpus: &[u32]) -> Result<(), IrqError> {
    if cpus.is_empty() {
        return Err(IrqError::NoCpu(format!("IRQ {irq}: no CPU given")));
    }
    let path = roots.proc.join("irq").join(irq.to_string()).join("smp_affinity_list");
    let text = format!("{}\n", format_cpu_list(cpus));
    // Not created: an IRQ without the file does not exist (or cannot be moved).
    let res = fs::OpenOptions::new().write(true).truncate(true).open(&path).and_then(|mut f| {
        use std::io::Write;
        f.write_all(text.as_bytes())
    });
    match res {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied && !nix::unistd::geteuid().is_root() => {
            Err(IrqError::NotRoot { irq })
        }
        Err(source) => Err(IrqError::NotWritable { irq, path: path.display().to_string(), source }),
    }
}

/// `irq_affinity` / `--irq-affinity`: leave the NICs' interrupts as they are, or move them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IrqPolicy {
    /// Do not touch IRQ affinity (report it and warn).
    #[default]
    Keep,
    /// Put each NIC's interrupts on cores of its node that run no network thread.
    Auto,
}

impl std::fmt::Display for IrqPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IrqPolicy::Keep => "keep",
            IrqPolicy::Auto => "auto",
        })
    }
}

/// The physical core (its first CPU) of every CPU the topology knows.
fn core_of(topo: &Topology) -> BTreeMap<u32, u32> {
    topo.nodes.iter().flat_map(|n| n.cores.iter()).flat_map(|core| core.iter().map(move |&c| (c, core[0]))).collect()
}

/// Whether any CPU of `a` is on the same physical core as any CPU of `b` (CPUs the topology
/// does not know count as cores of their own).
pub fn share_a_core(topo: &Topology, a: &[u32], b: &[u32]) -> bool {
    let cores = core_of(topo);
    let of = |c: &u32| cores.get(c).copied().unwrap_or(*c);
    let a: BTreeSet<u32> = a.iter().map(of).collect();
    b.iter().map(of).any(|c| a.contains(&c))
}

/// The CPUs to put a NIC's interrupts on (`auto`): the cores of `node` that run none of
/// `network_cpus` (every network thread of the process, so that one NIC's interrupts do not
/// land on another NIC's network thread either), one CPU per core, lowest core first. Where every
/// core of the node runs a network thread, the cores without *this* NIC's network thread
/// (`own_cpus`). Pure.
pub fn auto_irq_cpus(topo: &Topology, node: u32, own_cpus: &[u32], network_cpus: &[u32]) -> Result<Vec<u32>, IrqError> {
    let n = topo
        .node(node)
        .filter(|n| !n.cores.is_empty())
        .ok_or_else(|| IrqError::NoCpu(format!("node {node} has no CPUs to take interrupts")))?;
    let free = |avoid: &[u32]| -> Vec<u32> {
        n.cores.iter().filter(|core| !core.iter().any(|c| avoid.contains(c))).map(|core| core[0]).collect()
    };
    let all: Vec<u32> = network_cpus.iter().chain(own_cpus).copied().collect();
    let cpus = free(&all);
    if !cpus.is_empty() {
        return Ok(cpus);
    }
    let cpus = free(own_cpus);
    if cpus.is_empty() {
        return Err(IrqError::NoCpu(format!(
            "node {node} has no core other than the network thread's (cpus {}): its interrupts cannot be kept off it",
            format_cpu_list(own_cpus)
        )));
    }
    Ok(cpus)
}

/// Moves every IRQ of `nic` onto `cpus`, spread round robin (IRQ `k` on `cpus[k % len]`).
/// Returns the NIC's IRQs as read again afterwards.
pub fn apply_auto(roots: &Roots, nic: &NicIrqs, cpus: &[u32]) -> Result<NicIrqs, IrqError> {
    if cpus.is_empty() {
        return Err(IrqError::NoCpu(format!("{}: no CPU for its interrupts", nic.nic)));
    }
    for (k, irq) in nic.irqs.iter().enumerate() {
        set_irq_affinity(roots, irq.irq, &[cpus[k % cpus.len()]])?;
    }
    nic_irqs(roots, &nic.nic)
}

/// What is wrong with where a NIC's interrupts land against its network thread (`network_cpus`,
/// the CPUs that thread may run on) and the CPUs of the application or other consumers of its
/// data (`consumer_cpus`), in words; empty when nothing is.
pub fn check(topo: &Topology, nic: &NicIrqs, network_cpus: &[u32], consumer_cpus: &[u32]) -> Vec<String> {
    let mut out = Vec::new();
    let irq_cpus = nic.cpus();
    if !network_cpus.is_empty() && !irq_cpus.is_empty() && share_a_core(topo, network_cpus, &irq_cpus) {
        out.push(format!(
            "{}: the network thread (cpus {}) shares a core with the NIC's interrupts (cpus {}); \
             interrupts on another core of the same node are best (irq_affinity = \"auto\")",
            nic.nic,
            format_cpu_list(network_cpus),
            format_cpu_list(&irq_cpus)
        ));
    }
    if !network_cpus.is_empty() && !consumer_cpus.is_empty() && share_a_core(topo, network_cpus, consumer_cpus) {
        out.push(format!(
            "{}: the network thread (cpus {}) shares a core with the consumers of its data (cpus {})",
            nic.nic,
            format_cpu_list(network_cpus),
            format_cpu_list(consumer_cpus)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A fake /sys and /proc: `eth0` a virtio NIC whose PCI parent has MSI vectors 37-39,
    /// `ens1` a PCI NIC with its own vectors 50-51, `veth0` virtual, `eno1` named in
    /// /proc/interrupts only, `old0` with a legacy IRQ.
    fn tree() -> (tempfile::TempDir, Roots) {
        let dir = tempfile::tempdir().expect("tempdir");
        let sys = dir.path().join("sys");
        let proc = dir.path().join("proc");
        let mk = |p: &Path| fs::create_dir_all(p).expect("mkdir");
        let put = |p: &Path, s: &str| {
            mk(p.parent().expect("parent"));
            fs::write(p, s).expect("write");
        };
        let pci = sys.join("devices/pci0000:00/0000:00:03.0");
        for irq in [37, 38, 39] {
            put(&pci.join("msi_irqs").join(irq.to_string()), "msix\n");
        }
        mk(&pci.join("virtio2/net/eth0"));
        symlink(pci.join("virtio2"), pci.join("virtio2/net/eth0/device")).expect("symlink");
        let ens = sys.join("devices/pci0000:40/0000:40:00.0");
        for irq in [50, 51] {
            put(&ens.join("msi_irqs").join(irq.to_string()), "msix\n");
        }
        mk(&ens.join("net/ens1"));
        symlink(&ens, ens.join("net/ens1/device")).expect("symlink");
        let eno = sys.join("devices/pci0000:00/0000:00:19.0");
        mk(&eno.join("net/eno1"));
        symlink(&eno, eno.join("net/eno1/device")).expect("symlink");
        let old = sys.join("devices/pci0000:00/0000:00:1f.0");
        put(&old.join("irq"), "11\n");
        mk(&old.join("net/old0"));
        symlink(&old, old.join("net/old0/device")).expect("symlink");
        mk(&sys.join("devices/virtual/net/veth0"));
        mk(&sys.join("class/net"));
        for (name, target) in [
            ("eth0", pci.join("virtio2/net/eth0")),
            ("ens1", ens.join("net/ens1")),
            ("eno1", eno.join("net/eno1")),
            ("old0", old.join("net/old0")),
            ("veth0", sys.join("devices/virtual/net/veth0")),
        ] {
            symlink(target, sys.join("class/net").join(name)).expect("symlink");
        }
        put(
            &proc.join("interrupts"),
            "           CPU0       CPU1\n 37:  0  0  PCI-MSIX-0000:00:03.0  0-edge  virtio2-config\n \
             60:  5  1  PCI-MSI-0000:00:19.0  0-edge  eno1-TxRx-0\n 61:  5  1  PCI-MSI-0000:00:19.0  1-edge  eno1-TxRx-1\n \
             62:  0  0  PCI-MSI  2-edge  eno10-TxRx-0\nNMI:  0  0  Non-maskable interrupts\n",
        );
        for (irq, aff, eff) in [
            (37, "0-1", Some("0")),
            (38, "0-1", Some("1")),
            (39, "0-1", Some("0")),
            (50, "8-15", None),
            (51, "8-15", None),
            (60, "0-3", Some("2")),
            (61, "0-3", Some("3")),
            (11, "0", None),
        ] {
            let d = proc.join("irq").join(irq.to_string());
            put(&d.join("smp_affinity_list"), &format!("{aff}\n"));
            if let Some(e) = eff {
                put(&d.join("effective_affinity_list"), &format!("{e}\n"));
            }
        }
        (dir, Roots { sys, proc })
    }

    fn fixture(name: &str) -> Topology {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name);
        Topology::from_xml_file(&path).expect("fixture loads")
    }

    #[test]
    fn reads_irqs_from_msi_dirs_proc_interrupts_and_legacy_irq() {
        let (_d, roots) = tree();
        let eth0 = nic_irqs(&roots, "eth0").expect("eth0");
        assert!(!eth0.virtual_nic);
        let got: Vec<(u32, Vec<u32>, Vec<u32>)> =
            eth0.irqs.iter().map(|i| (i.irq, i.affinity.clone(), i.effective.clone())).collect();
        assert_eq!(got, vec![(37, vec![0, 1], vec![0]), (38, vec![0, 1], vec![1]), (39, vec![0, 1], vec![0])]);
        assert_eq!(eth0.cpus(), vec![0, 1], "effective CPUs");
        assert_eq!(eth0.describe(), "37 -> 0 (allowed 0-1), 38 -> 1 (allowed 0-1), 39 -> 0 (allowed 0-1)");
        let ens1 = nic_irqs(&roots, "ens1").expect("ens1");
        assert_eq!(ens1.irqs.iter().map(|i| i.irq).collect::<Vec<_>>(), vec![50, 51]);
        assert_eq!(ens1.cpus(), (8..16).collect::<Vec<_>>(), "no effective list: the allowed CPUs");
        let eno1 = nic_irqs(&roots, "eno1").expect("eno1");
        assert_eq!(eno1.irqs.iter().map(|i| i.irq).collect::<Vec<_>>(), vec![60, 61], "not eno10's line");
        let old = nic_irqs(&roots, "old0").expect("old0");
        assert_eq!(old.irqs.iter().map(|i| i.irq).collect::<Vec<_>>(), vec![11]);
    }

    #[test]
    fn a_virtual_nic_has_no_irqs_and_says_so() {
        let (_d, roots) = tree();
        let v = nic_irqs(&roots, "veth0").expect("veth0");
        assert!(v.virtual_nic && v.irqs.is_empty());
        assert_eq!(v.describe(), "none (virtual NIC)");
        let err = nic_irqs(&roots, "nope0").expect_err("missing");
        assert!(err.to_string().contains("no network interface \"nope0\""), "{err}");
        assert!(nic_irqs(&roots, "../x").is_err());
    }

    #[test]
    fn malformed_files_are_clear_errors() {
        let (_d, roots) = tree();
        fs::write(roots.proc.join("irq/38/smp_affinity_list"), "0-x\n").unwrap();
        let err = nic_irqs(&roots, "eth0").expect_err("bad list").to_string();
        assert!(err.contains("irq/38/smp_affinity_list") && err.contains("bad cpu list entry"), "{err}");
        fs::write(roots.proc.join("irq/38/smp_affinity_list"), "1\n").unwrap();
        fs::write(roots.proc.join("irq/38/effective_affinity_list"), "\u{0}\u{ff}garbage").unwrap();
        assert!(nic_irqs(&roots, "eth0").is_err(), "binary junk is an error");
        fs::remove_file(roots.proc.join("irq/39/smp_affinity_list")).unwrap();
        fs::write(roots.proc.join("irq/38/effective_affinity_list"), "1\n").unwrap();
        let err = nic_irqs(&roots, "eth0").expect_err("missing file").to_string();
        assert!(err.contains("irq/39/smp_affinity_list"), "{err}");
        let msi = roots.sys.join("devices/pci0000:40/0000:40:00.0/msi_irqs/bogus");
        fs::write(msi, "").unwrap();
        let err = nic_irqs(&roots, "ens1").expect_err("bad entry").to_string();
        assert!(err.contains("not an IRQ number"), "{err}");
        fs::write(roots.sys.join("devices/pci0000:00/0000:00:1f.0/irq"), "eleven").unwrap();
        assert!(nic_irqs(&roots, "old0").expect_err("bad irq").to_string().contains("not an IRQ number"));
    }

    #[test]
    fn setting_writes_the_list_and_refusals_are_clear() {
        let (_d, roots) = tree();
        set_irq_affinity(&roots, 50, &[9, 10, 11]).expect("written");
        assert_eq!(fs::read_to_string(roots.proc.join("irq/50/smp_affinity_list")).unwrap(), "9-11\n");
        // An IRQ the kernel will not let us move: here a directory where the file should be.
        let f = roots.proc.join("irq/51/smp_affinity_list");
        fs::remove_file(&f).unwrap();
        fs::create_dir(&f).unwrap();
        let err = set_irq_affinity(&roots, 51, &[9]).expect_err("not writable").to_string();
        assert!(err.contains("IRQ 51 is not writable"), "{err}");
        let err = set_irq_affinity(&roots, 999, &[0]).expect_err("no such IRQ").to_string();
        assert!(err.contains("IRQ 999 is not writable"), "{err}");
        assert!(set_irq_affinity(&roots, 50, &[]).is_err());
    }

    #[test]
    fn auto_puts_interrupts_on_the_nics_node_off_the_network_cores() {
        // 2 sockets x 4 cores x 2 threads: node 1 has cores {8,9} {10,11} {12,13} {14,15}.
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let cpus = auto_irq_cpus(&topo, 1, &[14], &[10, 12, 14]).expect("a free core");
        assert_eq!(cpus, vec![8], "the one core of node 1 that runs no network thread");
        let cpus = auto_irq_cpus(&topo, 1, &[15], &[9, 11, 13, 15]).expect("fallback");
        assert_eq!(cpus, vec![8, 10, 12], "every core busy: any core but this NIC's own");
        assert!(!cpus.iter().any(|c| share_a_core(&topo, &[*c], &[15])));
        let one = fixture("laptop-1node.xml");
        let err = auto_irq_cpus(&one, 0, &[0, 1, 2, 3], &[]).expect_err("no other core").to_string();
        assert!(err.contains("no core other than the network thread's"), "{err}");
        assert!(auto_irq_cpus(&topo, 7, &[0], &[]).is_err(), "no such node");

        let (_d, roots) = tree();
        let ens1 = nic_irqs(&roots, "ens1").expect("ens1");
        let after = apply_auto(&roots, &ens1, &[8, 10]).expect("moved");
        assert_eq!(after.irqs.iter().map(|i| i.affinity.clone()).collect::<Vec<_>>(), vec![vec![8], vec![10]]);
        assert!(check(&topo, &after, &[14], &[]).is_empty(), "same socket, other core: no warning");
    }

    #[test]
    fn check_warns_on_a_shared_core_with_interrupts_or_consumers() {
        let topo = fixture("paper-2s4c2t-6nic.xml");
        let nic = NicIrqs {
            nic: "ens3f0".into(),
            virtual_nic: false,
            irqs: vec![IrqAffinity { irq: 50, affinity: vec![8, 9, 10, 11], effective: vec![11] }],
        };
        // CPU 10 is the sibling of 11: the same core.
        let w = check(&topo, &nic, &[10], &[]);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("shares a core with the NIC's interrupts (cpus 11)"), "{w:?}");
        assert!(check(&topo, &nic, &[12], &[]).is_empty());
        let w = check(&topo, &nic, &[12], &[13]);
        assert!(w[0].contains("consumers of its data (cpus 13)"), "{w:?}");
        let virt = NicIrqs { nic: "veth0".into(), virtual_nic: true, irqs: Vec::new() };
        assert!(check(&topo, &virt, &[0], &[]).is_empty(), "no interrupts, nothing to share");
    }

    #[test]
    fn policy_parses() {
        assert_eq!(<IrqPolicy as clap::ValueEnum>::from_str("auto", false), Ok(IrqPolicy::Auto));
        assert_eq!(<IrqPolicy as clap::ValueEnum>::from_str("keep", false), Ok(IrqPolicy::Keep));
        assert!(<IrqPolicy as clap::ValueEnum>::from_str("spread", false).is_err());
    }
}
