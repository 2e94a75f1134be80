//! Loading, attaching and sharing the XDP steering program (`bpf/tyche_steer.bpf.c`).
//!
//! One program per interface, whichever Tyche process attached it: a process attaches only
//! where no program is (`XDP_FLAGS_UPDATE_IF_NOEXIST`), shares a Tyche program another live
//! process uses (found by the attached program's name and map names, its maps opened by id),
//! refuses a foreign program, and detaches only as the last user (see `share`). A Tyche program
//! no live process uses (its last user was killed) is replaced.

use std::ffi::CStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use libbpf_rs::libbpf_sys;
use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType, ObjectBuilder, Xdp, XdpFlags};

use crate::share::NicDir;
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

/// The steering program attached to one interface, used by this process (and perhaps by
/// other Tyche processes: see the module doc). The last user detaches it on drop.
#[derive(Debug)]
pub struct XdpProgram {
    ours: Ours,
    ifindex: i32,
    ifname: String,
    mode: AttachedMode,
    shared: bool,
    nic: NicDir,
    /// This process's shared lock on the program's users (`share`), released on drop.
    user: Option<std::fs::File>,
}

/// The entry point names; the kernel keeps 15 bytes of a program's name.
const SINGLE: &str = "tyche_steer";
const FRAGS: &str = "tyche_steer_frags";
const NAME_LEN: usize = 15;

fn xdp_flags(mode: AttachedMode) -> XdpFlags {
    match mode {
        AttachedMode::Native => XdpFlags::DRV_MODE,
        AttachedMode::Skb => XdpFlags::SKB_MODE,
    }
}

/// A program attached to an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Present {
    id: u32,
    /// `None`: offloaded to the NIC (never Tyche's).
    mode: Option<AttachedMode>,
}

/// The programs attached to interface `ifindex`, by mode.
fn present(ifname: &str, ifindex: i32) -> Result<Vec<Present>, Error> {
    let mut opts = libbpf_sys::bpf_xdp_query_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_xdp_query_opts>() as libbpf_sys::size_t,
        ..Default::default()
    };
    // SAFETY: `opts` is a live, sized `bpf_xdp_query_opts` that the call fills.
    let rc = unsafe { libbpf_sys::bpf_xdp_query(ifindex, 0, &mut opts) };
    if rc < 0 {
        return Err(Error::io(
            format!("querying the XDP programs of {ifname}"),
            std::io::Error::from_raw_os_error(-rc),
        ));
    }
    let found = [
        (opts.drv_prog_id, Some(AttachedMode::Native)),
        (opts.skb_prog_id, Some(AttachedMode::Skb)),
        (opts.hw_prog_id, None),
    ];
    Ok(found.into_iter().filter(|(id, _)| *id != 0).map(|(id, mode)| Present { id, mode }).collect())
}

/// What a program is, read from the kernel by its id.
#[derive(Debug)]
struct Inspected {
    prog: OwnedFd,
    name: String,
    maps: Vec<MapHandle>,
}

/// A Tyche steering program's handles.
#[derive(Debug)]
struct Ours {
    prog: OwnedFd,
    id: u32,
    frags: bool,
    xsks: MapHandle,
    config: MapHandle,
    stats: MapHandle,
    discover: MapHandle,
}

fn inspect(id: u32) -> Result<Inspected, Error> {
    let err =
        |what: &str, rc: i32| Error::io(format!("{what} of XDP program {id}"), std::io::Error::from_raw_os_error(-rc));
    // SAFETY: plain bpf(2) wrapper; a non-negative result is a new descriptor we own.
    let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id) };
    if fd < 0 {
        return Err(err("opening", fd));
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let prog = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut map_ids = [0u32; 16];
    let mut info = libbpf_sys::bpf_prog_info {
        nr_map_ids: map_ids.len() as u32,
        map_ids: map_ids.as_mut_ptr() as u64,
        ..Default::default()
    };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: `info` is a live `bpf_prog_info` of `len` bytes whose `map_ids` points at
    // `map_ids`, which holds `nr_map_ids` entries and outlives the call.
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(prog.as_raw_fd(), &mut info, &mut len) };
    if rc < 0 {
        return Err(err("reading the info", rc));
    }
    // SAFETY: the kernel NUL-terminates the 16-byte name.
    let name = unsafe { CStr::from_ptr(info.name.as_ptr()) }.to_string_lossy().into_owned();
    let n = (info.nr_map_ids as usize).min(map_ids.len());
    let maps = map_ids[..n]
        .iter()
        .map(|&m| MapHandle::from_map_id(m).map_err(|e| Error::bpf(format!("opening map {m} of XDP program {id}"), e)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Inspected { prog, name, maps })
}

/// What an attached program is to this build.
#[derive(Debug)]
enum Kind {
    /// Tyche's steering program with the maps this build uses.
    Ours(Ours),
    /// Tyche's by name, but its maps are another build's (an older or newer version's).
    OtherBuild(OwnedFd),
    /// Not Tyche's (its name).
    Foreign(String),
}

impl Inspected {
    /// What the program is: Tyche's (either entry point) by name, and this build's by its maps.
    fn kind(self, id: u32) -> Kind {
        let frags = self.name == FRAGS[..NAME_LEN];
        if self.name != SINGLE && !frags {
            return Kind::Foreign(self.name);
        }
        let mut maps = self.maps;
        let mut take = |name: &str, ty: MapType| {
            let at = maps.iter().position(|m| m.name() == name && m.map_type() == ty)?;
            Some(maps.swap_remove(at))
        };
        let (Some(xsks), Some(config), Some(stats), Some(discover)) = (
            take("xsks_map", MapType::Xskmap),
            take("tyche_config", MapType::Array),
            take("tyche_stats", MapType::PercpuArray),
            take("tyche_discover", MapType::LruHash),
        ) else {
            return Kind::OtherBuild(self.prog);
        };
        Kind::Ours(Ours { prog: self.prog, id, frags, xsks, config, stats, discover })
    }
}

/// Detaches program `prog` from `ifindex` in `mode`, unless another program has replaced it.
fn detach_expected(ifindex: i32, mode: AttachedMode, prog: BorrowedFd<'_>) -> Result<(), std::io::Error> {
    let opts = libbpf_sys::bpf_xdp_attach_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_xdp_attach_opts>() as libbpf_sys::size_t,
        old_prog_fd: prog.as_raw_fd(),
        ..Default::default()
    };
    let flags = (xdp_flags(mode) | XdpFlags::REPLACE).bits();
    // SAFETY: `opts` is a live, sized `bpf_xdp_attach_opts`; `prog` is open across the call.
    let rc = unsafe { libbpf_sys::bpf_xdp_detach(ifindex, flags, &opts) };
    if rc < 0 {
        return Err(std::io::Error::from_raw_os_error(-rc));
    }
    Ok(())
}

/// The Tyche program attached in `mode` to `ifindex`.
fn attached_ours(ifname: &str, ifindex: i32, mode: AttachedMode) -> Result<Ours, Error> {
    let p = present(ifname, ifindex)?.into_iter().find(|p| p.mode == Some(mode));
    let lost =
        || Error::Attach { ifname: ifname.to_string(), detail: format!("the {mode} program is gone after attaching") };
    let p = p.ok_or_else(lost)?;
    match inspect(p.id)?.kind(p.id) {
        Kind::Ours(ours) => Ok(ours),
        _ => Err(lost()),
    }
}

impl XdpProgram {
    /// Attaches the steering program to `ifname` (index `ifindex`), or shares the one another
    /// live Tyche process attached. `frags` asks for the multi-buffer build (`SEC("xdp.frags")`);
    /// without it the single-buffer build is tried first and the frags build second (it serves
    /// single-buffer sockets too). With [`AttachMode::Auto`], native mode is tried before
    /// generic mode, and the fall-back is logged. `ethertype` is the EtherType to steer.
    ///
    /// A foreign program on the interface is [`Error::ForeignProgram`] (never replaced); a
    /// shared Tyche program that does not fit (mode, build, EtherType) is
    /// [`Error::Incompatible`].
    pub fn attach(ifname: &str, ifindex: u32, mode: AttachMode, frags: bool, ethertype: u16) -> Result<Self, Error> {
        let nic = NicDir::of(ifindex)?;
        let _deciding = nic.decide()?;
        let unused = nic.unused()?;
        let ifx = ifindex as i32;
        let mut shared = None;
        for p in present(ifname, ifx)? {
            let (Some(m), kind) = (p.mode, inspect(p.id)?.kind(p.id)) else {
                return Err(Error::ForeignProgram { ifname: ifname.to_string(), id: p.id, name: "(offloaded)".into() });
            };
            let prog = match kind {
                Kind::Foreign(name) => {
                    return Err(Error::ForeignProgram { ifname: ifname.to_string(), id: p.id, name })
                }
                Kind::Ours(ours) if !unused => {
                    shared.get_or_insert((m, ours));
                    continue;
                }
                Kind::OtherBuild(_) if !unused => {
                    return Err(Error::Incompatible {
                        ifname: ifname.to_string(),
                        id: p.id,
                        detail: "it is another Tyche build's (its maps differ from this build's)".into(),
                    })
                }
                Kind::Ours(ours) => ours.prog,
                Kind::OtherBuild(prog) => prog,
            };
            // Its users are gone (killed: the kernel dropped their locks and sockets).
            tracing::info!(ifname, id = p.id, mode = %m, "replacing a Tyche XDP program no process uses");
            detach_expected(ifx, m, prog.as_fd())
                .map_err(|e| Error::io(format!("detaching unused Tyche XDP program {} from {ifname}", p.id), e))?;
        }
        let user = nic.join()?;
        let (ours, mode, is_shared) = match shared {
            Some((m, ours)) => {
                check_fits(ifname, &ours, m, mode, frags, ethertype)?;
                tracing::info!(ifname, id = ours.id, mode = %m, "sharing the Tyche XDP program another process attached");
                (ours, m, true)
            }
            None => {
                let m = load_and_attach(ifname, ifx, mode, frags)?;
                let ours = attached_ours(ifname, ifx, m)?;
                (ours, m, false)
            }
        };
        let program = XdpProgram {
            ours,
            ifindex: ifx,
            ifname: ifname.to_string(),
            mode,
            shared: is_shared,
            nic,
            user: Some(user),
        };
        if !is_shared {
            let value = if ethertype == tyche_wire::DEFAULT_ETHERTYPE { 0 } else { u32::from(ethertype) };
            update(&program.ours.config, "tyche_config", &0u32.to_ne_bytes(), &value.to_ne_bytes())?;
            tracing::info!(ifname, %mode, frags = program.ours.frags, "XDP steering program attached");
        }
        Ok(program)
    }

    /// The mode the program runs in.
    pub fn mode(&self) -> AttachedMode {
        self.mode
    }

    /// Whether the multi-buffer (`xdp.frags`) build is the one attached.
    pub fn frags(&self) -> bool {
        self.ours.frags
    }

    /// Whether another Tyche process had attached the program (this one shares it).
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// The kernel's id of the program.
    pub fn id(&self) -> u32 {
        self.ours.id
    }

    /// The interface the program is attached to.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    pub(crate) fn nic(&self) -> &NicDir {
        &self.nic
    }

    /// Steers Tyche frames arriving on receive queue `queue` into the AF_XDP socket `fd`.
    pub fn register(&self, queue: u32, fd: BorrowedFd<'_>) -> Result<(), Error> {
        update(&self.ours.xsks, "xsks_map", &queue.to_ne_bytes(), &(fd.as_raw_fd() as u32).to_ne_bytes())
    }

    /// Stops steering queue `queue` (its frames go to the kernel again). Only the process
    /// holding the queue calls it.
    pub fn unregister(&self, queue: u32) {
        let _ = self.ours.xsks.delete(&queue.to_ne_bytes());
    }

    /// The program's counters, summed over CPUs.
    pub fn stats(&self) -> Result<SteerStats, Error> {
        let mut sums = [0u64; 3];
        for (i, sum) in sums.iter_mut().enumerate() {
            let per_cpu = self
                .ours
                .stats
                .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
                .map_err(|e| Error::bpf("reading tyche_stats", e))?
                .unwrap_or_default();
            *sum = per_cpu.iter().map(|v| u64::from_ne_bytes(v[..8].try_into().expect("8-byte counter"))).sum();
        }
        Ok(SteerStats { steered: sums[0], malformed: sums[1], passed: sums[2] })
    }
}

fn update(map: &MapHandle, name: &str, key: &[u8], value: &[u8]) -> Result<(), Error> {
    map.update(key, value, MapFlags::ANY).map_err(|e| Error::bpf(format!("updating map {name}"), e))
}

/// Whether a program another process uses serves this one too.
fn check_fits(
    ifname: &str,
    ours: &Ours,
    attached: AttachedMode,
    wanted: AttachMode,
    frags: bool,
    ethertype: u16,
) -> Result<(), Error> {
    let misfit = |detail: String| Err(Error::Incompatible { ifname: ifname.to_string(), id: ours.id, detail });
    match (wanted, attached) {
        (AttachMode::Native, AttachedMode::Skb) | (AttachMode::Skb, AttachedMode::Native) => {
            return misfit(format!("it runs in {attached} mode"));
        }
        _ => {}
    }
    if frags && !ours.frags {
        return misfit("it is the single-buffer build and this port needs xdp.frags (multi-buffer)".into());
    }
    let slot =
        ours.config.lookup(&0u32.to_ne_bytes(), MapFlags::ANY).map_err(|e| Error::bpf("reading tyche_config", e))?;
    let configured = slot.and_then(|v| Some(u32::from_ne_bytes(v.get(..4)?.try_into().ok()?))).unwrap_or(0);
    let steered = if configured == 0 { u32::from(tyche_wire::DEFAULT_ETHERTYPE) } else { configured };
    if steered != u32::from(ethertype) {
        return misfit(format!("it steers EtherType {steered:#06x}, not {ethertype:#06x}"));
    }
    Ok(())
}

/// Loads the program and attaches it where none is, trying the modes `mode` allows in order.
fn load_and_attach(ifname: &str, ifindex: i32, mode: AttachMode, frags: bool) -> Result<AttachedMode, Error> {
    let mut open = ObjectBuilder::default().open_memory(OBJECT).map_err(|e| Error::bpf("opening the XDP object", e))?;
    // Without frags, only the single-buffer entry point is a candidate at first; the frags
    // build also serves single-buffer sockets, so it is the second choice in native mode
    // (veth refuses single-buffer programs above an MTU of about 3500).
    let native_fallback_to_frags = !frags;
    for mut prog in open.progs_mut() {
        let wanted = prog.name() == FRAGS || native_fallback_to_frags;
        prog.set_autoload(wanted);
    }
    let object = open.load().map_err(|e| Error::bpf("loading the XDP programs", e))?;
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
    for (m, name) in candidates {
        let Some(prog) = object.progs().find(|p| p.name() == name) else {
            continue;
        };
        // Only where no program is: never over another process's.
        match Xdp::new(prog.as_fd()).attach(ifindex, xdp_flags(m) | XdpFlags::UPDATE_IF_NOEXIST) {
            Ok(()) => {
                if m == AttachedMode::Skb && !errors.is_empty() {
                    tracing::warn!(ifname, "XDP falls back to generic (skb) mode");
                    eprintln!("tyche-xdp: {ifname}: falling back to generic (skb) mode");
                }
                // The attachment holds the program; the object's descriptors close here.
                return Ok(m);
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
    Err(Error::Attach { ifname: ifname.to_string(), detail: errors.join("; ") })
}

impl Drop for XdpProgram {
    fn drop(&mut self) {
        let deciding = self.nic.decide();
        drop(self.user.take());
        let last = deciding.is_ok() && self.nic.unused().unwrap_or(false);
        if !last {
            tracing::debug!(ifname = %self.ifname, "XDP program left to its other users");
            return;
        }
        if let Err(e) = detach_expected(self.ifindex, self.mode, self.ours.prog.as_fd()) {
            tracing::warn!(ifname = %self.ifname, error = %e, "detaching the XDP program");
        }
    }
}

/// Lets the DISCOVER_REPLYs answering one DISCOVER (by nonce) through to the kernel on an
/// interface whose Tyche program would steer them into a live AF_XDP socket, so that an
/// AF_PACKET socket reads them. Nothing to do where no program is attached; removed on drop.
#[derive(Debug)]
pub struct DiscoveryTap {
    maps: Vec<MapHandle>,
    nonce: u32,
}

impl DiscoveryTap {
    /// Opens the tap for `nonce` on `ifname`; a foreign program there is
    /// [`Error::ForeignProgram`] (its owner decides where Tyche frames go), another Tyche
    /// build's [`Error::Incompatible`].
    pub fn open(ifname: &str, nonce: u32) -> Result<Self, Error> {
        let info = crate::InterfaceInfo::query(ifname)?;
        let mut maps = Vec::new();
        for p in present(ifname, info.index as i32)? {
            let ours = match inspect(p.id)?.kind(p.id) {
                Kind::Ours(ours) => ours,
                Kind::Foreign(name) => {
                    return Err(Error::ForeignProgram { ifname: ifname.to_string(), id: p.id, name })
                }
                Kind::OtherBuild(_) => {
                    return Err(Error::Incompatible {
                        ifname: ifname.to_string(),
                        id: p.id,
                        detail: "it is another Tyche build's, without this build's discovery map".into(),
                    })
                }
            };
            update(&ours.discover, "tyche_discover", &nonce.to_ne_bytes(), &std::process::id().to_ne_bytes())?;
            maps.push(ours.discover);
        }
        Ok(DiscoveryTap { maps, nonce })
    }

    /// Whether a Tyche program was there to open it on (else replies reach the kernel anyway).
    pub fn active(&self) -> bool {
        !self.maps.is_empty()
    }
}

impl Drop for DiscoveryTap {
    fn drop(&mut self) {
        for m in &self.maps {
            let _ = m.delete(&self.nonce.to_ne_bytes());
        }
    }
}
