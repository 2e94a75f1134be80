//! Loading and attaching the XDP steering program (`bpf/tyche_steer.bpf.c`).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Mutex;

use libbpf_rs::{MapCore, MapFlags, Object, ObjectBuilder, Xdp, XdpFlags};

use crate::Error;

/// The compiled steering program, built from `bpf/tyche_steer.bpf.c` by this crate's build
/// script.
static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tyche_steer.bpf.o"));

/// Where to run the XDP program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// Native (driver) mode only.
    Native,
    /// Generic (skb) mode only: slower, works on every device.
    Skb,
    /// Native mode, falling back to generic mode (logged) if the driver refuses.
    Auto,
}

/// The mode a program ended up attached in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachedMode {
    /// Driver mode.
    Native,
    /// Generic (skb) mode.
    Skb,
}

impl std::fmt::Display for AttachedMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AttachedMode::Native => "native",
            AttachedMode::Skb => "skb",
        })
    }
}

/// Counters kept by the XDP program, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SteerStats {
    /// Tyche frames redirected towards an AF_XDP socket.
    pub steered: u64,
    /// Frames with the Tyche EtherType but a short header or another version (passed on).
    pub malformed: u64,
    /// Other frames, left to the kernel.
    pub passed: u64,
}

/// The steering program attached to one interface. Detaches on drop.
#[derive(Debug)]
pub struct XdpProgram {
    object: Mutex<Object>,
    prog_name: &'static str,
    ifindex: i32,
    ifname: String,
    mode: AttachedMode,
    frags: bool,
}

const SINGLE: &str = "tyche_steer";
const FRAGS: &str = "tyche_steer_frags";

fn xdp_flags(mode: AttachedMode) -> XdpFlags {
    match mode {
        AttachedMode::Native => XdpFlags::DRV_MODE,
        AttachedMode::Skb => XdpFlags::SKB_MODE,
    }
}

impl XdpProgram {
    /// Loads the program and attaches it to `ifname` (index `ifindex`). `frags` asks for the
    /// multi-buffer build (`SEC("xdp.frags")`); without it the single-buffer build is tried
    /// first and the frags build second (it serves single-buffer sockets too). With
    /// [`AttachMode::Auto`], native mode is tried before generic mode, and the fall-back is
    /// logged. `ethertype` is the EtherType to steer.
    pub fn attach(ifname: &str, ifindex: u32, mode: AttachMode, frags: bool, ethertype: u16) -> Result<Self, Error> {
        let mut open =
            ObjectBuilder::default().open_memory(OBJECT).map_err(|e| Error::bpf("opening the XDP object", e))?;
        // Without frags, only the single-buffer entry point is a candidate at first; the frags
        // build also serves single-buffer sockets, so it is the second choice in native mode
        // (veth refuses single-buffer programs above an MTU of about 3500).
        let native_fallback_to_frags = !frags;
        for mut prog in open.progs_mut() {
            let wanted = prog.name() == FRAGS || native_fallback_to_frags;
            prog.set_autoload(wanted);
        }
        let object = open.load().map_err(|e| Error::bpf("loading the XDP programs", e))?;
        let ifindex = ifindex as i32;
        let mut candidates: Vec<(AttachedMode, &'static str)> = Vec::new();
        if matches!(mode, AttachMode::Native | AttachMode::Auto) {
            if !frags {
                candidates.push((AttachedMode::Native, SINGLE));
            }
            candidates.push((AttachedMode::Native, FRAGS));
        }
        if matches!(mode, AttachMode::Skb | AttachMode::Auto) {
            candidates.push((AttachedMode::Skb, if frags { FRAGS } else { SINGLE }));
        }
        let mut errors = Vec::new();
        let mut attached = None;
        for (m, name) in candidates {
            let prog = object.progs().find(|p| p.name() == name);
            let Some(prog) = prog else {
                continue;
            };
            let xdp = Xdp::new(prog.as_fd());
            // Replace whatever a crashed earlier run may have left attached in the other mode,
            // so that the two never stack.
            let _ = xdp.detach(ifindex, xdp_flags(other(m)));
            match xdp.attach(ifindex, xdp_flags(m)) {
                Ok(()) => {
                    attached = Some((m, name));
                    break;
                }
                Err(e) => {
                    if m == AttachedMode::Native && mode == AttachMode::Auto {
                        tracing::warn!(ifname, program = name, error = %e, "native XDP attach failed");
                        eprintln!("tyche-xdp: {ifname}: native XDP attach of {name} failed ({e})");
                    }
                    errors.push(format!("{m} {name}: {e}"));
                }
            }
        }
        let Some((mode, prog_name)) = attached else {
            return Err(Error::Attach { ifname: ifname.to_string(), detail: errors.join("; ") });
        };
        if mode == AttachedMode::Skb && !errors.is_empty() {
            tracing::warn!(ifname, "XDP falls back to generic (skb) mode");
            eprintln!("tyche-xdp: {ifname}: falling back to generic (skb) mode");
        }
        let frags = prog_name == FRAGS;
        let program =
            XdpProgram { object: Mutex::new(object), prog_name, ifindex, ifname: ifname.to_string(), mode, frags };
        if ethertype != tyche_wire::DEFAULT_ETHERTYPE {
            program.update_map("tyche_config", &0u32.to_ne_bytes(), &u32::from(ethertype).to_ne_bytes())?;
        }
        tracing::info!(ifname, %mode, frags, "XDP steering program attached");
        Ok(program)
    }

    /// The mode the program runs in.
    pub fn mode(&self) -> AttachedMode {
        self.mode
    }

    /// Whether the multi-buffer (`xdp.frags`) build is the one attached.
    pub fn frags(&self) -> bool {
        self.frags
    }

    /// The interface the program is attached to.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    fn update_map(&self, map: &str, key: &[u8], value: &[u8]) -> Result<(), Error> {
        let object = self.object.lock().expect("XDP object lock poisoned");
        let m = object.maps().find(|m| m.name() == map).ok_or_else(|| Error::Attach {
            ifname: self.ifname.clone(),
            detail: format!("map {map} missing from the object"),
        })?;
        m.update(key, value, MapFlags::ANY).map_err(|e| Error::bpf(format!("updating map {map}"), e))
    }

    /// Steers Tyche frames arriving on receive queue `queue` into the AF_XDP socket `fd`.
    pub fn register(&self, queue: u32, fd: BorrowedFd<'_>) -> Result<(), Error> {
        self.update_map("xsks_map", &queue.to_ne_bytes(), &(fd.as_raw_fd() as u32).to_ne_bytes())
    }

    /// Stops steering queue `queue` (its frames go to the kernel again).
    pub fn unregister(&self, queue: u32) {
        let object = self.object.lock().expect("XDP object lock poisoned");
        let map = object.maps().find(|m| m.name() == "xsks_map");
        if let Some(m) = map {
            let _ = m.delete(&queue.to_ne_bytes());
        }
    }

    /// The program's counters, summed over CPUs.
    pub fn stats(&self) -> Result<SteerStats, Error> {
        let object = self.object.lock().expect("XDP object lock poisoned");
        let m = object.maps().find(|m| m.name() == "tyche_stats").ok_or_else(|| Error::Attach {
            ifname: self.ifname.clone(),
            detail: "map tyche_stats missing from the object".into(),
        })?;
        let mut sums = [0u64; 3];
        for (i, sum) in sums.iter_mut().enumerate() {
            let per_cpu = m
                .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
                .map_err(|e| Error::bpf("reading tyche_stats", e))?
                .unwrap_or_default();
            *sum = per_cpu.iter().map(|v| u64::from_ne_bytes(v[..8].try_into().expect("8-byte counter"))).sum();
        }
        Ok(SteerStats { steered: sums[0], malformed: sums[1], passed: sums[2] })
    }
}

fn other(m: AttachedMode) -> AttachedMode {
    match m {
        AttachedMode::Native => AttachedMode::Skb,
        AttachedMode::Skb => AttachedMode::Native,
    }
}

impl Drop for XdpProgram {
    fn drop(&mut self) {
        let object = self.object.lock().unwrap_or_else(|p| p.into_inner());
        let prog = object.progs().find(|p| p.name() == self.prog_name);
        if let Some(prog) = prog {
            let _ = Xdp::new(prog.as_fd()).detach(self.ifindex, xdp_flags(self.mode));
        }
    }
}
