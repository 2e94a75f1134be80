//! [`XdpPort`]: one AF_XDP socket on one NIC queue, with its own UMEM, as a [`FrameTransport`].

use std::io;
use std::num::NonZeroU32;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex};

use tyche_transport::{
    Capabilities, ChunkState, FrameTransport, Lease, OnLentFrame, Rx, Sent, TxChunk, TxPiece, MAX_PIECES,
};
use xsk_rs::config::{BindFlags, FrameSize, Interface, LibxdpFlags, QueueSize, SocketConfig, UmemConfig};
use xsk_rs::{CompQueue, FillQueue, FrameDesc, RxQueue, Socket, TxQueue, Umem};

use crate::program::{AttachMode, AttachedMode, XdpProgram};
use crate::{Error, InterfaceInfo};

/// The NUMA node of the port's memory (`config.numa`), the calling thread pinned to it when
/// `config.pin_thread` asks.
fn place_thread(config: &PortConfig, ifname: &str) -> Result<Option<u32>, Error> {
    let numa_node = match config.numa {
        NumaPlacement::Auto => tyche_numa::nic_node(ifname),
        NumaPlacement::Node(n) => Some(n),
        NumaPlacement::Off => None,
    };
    if let (true, Some(node)) = (config.pin_thread, numa_node) {
        tyche_numa::pin_current_thread_to_node(node)
            .map_err(|e| Error::numa(format!("pinning to NUMA node {node}"), e))?;
    }
    Ok(numa_node)
}

/// Binds an AF_XDP socket on `umem` to `ifname`'s queue `config.queue`, its rings on
/// `numa_node`: its TX and RX rings, and the UMEM's fill and completion rings. `umem` is fresh:
/// no socket was bound to it yet.
fn bind_socket(
    config: &PortConfig,
    ifname: &str,
    umem: &Umem,
    numa_node: Option<u32>,
    multi_buffer: bool,
) -> Result<(TxQueue, RxQueue, FillQueue, CompQueue), Error> {
    let half = config.frame_count / 2;
    let q = |n: u32| QueueSize::new(n).map_err(|e| xsk_err("ring size", e));
    let socket_config = SocketConfig::builder()
        .rx_queue_size(q(half)?)
        .tx_queue_size(q(half)?)
        .libxdp_flags(LibxdpFlags::XSK_LIBXDP_FLAGS_INHIBIT_PROG_LOAD)
        .bind_flags(bind_flags(config.copy, multi_buffer))
        .build();
    let iface: Interface = ifname.parse().map_err(|_| Error::NoInterface(ifname.to_string()))?;
    // The RX and TX rings are allocated by the kernel when the socket is set up, under the
    // calling thread's memory policy: bind it here too so they land beside the UMEM.
    // SAFETY: this UMEM is bound to (ifname, queue) once, by this socket; the program is
    // ours (INHIBIT_PROG_LOAD), so libxdp never detaches one it did not load.
    let (tx, rx, rings) = tyche_numa::alloc::with_thread_memory_on(numa_node, || unsafe {
        Socket::new(socket_config, umem, &iface, config.queue)
    })
    .map_err(|e| Error::numa("binding the rings to the NIC's NUMA node", e))?
    .map_err(|e| {
        let hint = bind_hint(config.copy, multi_buffer);
        xsk_err(&format!("binding an AF_XDP socket to {ifname} queue {}{hint}", config.queue), with_sources(&e))
    })?;
    let (fq, cq) = rings.expect("first socket on a fresh UMEM gets the fill and completion rings");
    Ok((tx, rx, fq, cq))
}

/// UMEM chunk size: the largest the kernel accepts for an aligned-mode UMEM on 4 KiB pages
/// (`xdp_umem_reg` refuses chunks below `XDP_UMEM_MIN_CHUNK_SIZE`, 2048 bytes, or above the page
/// size, with `EINVAL`).
pub const CHUNK_SIZE: usize = 4096;
/// Headroom the kernel keeps in front of every received frame (`XDP_PACKET_HEADROOM`).
pub const XDP_HEADROOM: usize = 256;
/// Headroom of our own in front of every frame (the UMEM's `frame_headroom`), chosen so that a
/// DATA frame's payload starts 512 bytes into its chunk: payloads kept in received frames, and
/// read data stored in transmit chunks, are then aligned for O_DIRECT on 512-byte-sector devices.
pub const FRAME_HEADROOM: usize = 512 - XDP_HEADROOM - tyche_wire::DATA_FRAME_OVERHEAD;
/// Bytes of frame one UMEM chunk carries (Ethernet header included).
pub const BUFFER_CAPACITY: usize = CHUNK_SIZE - XDP_HEADROOM - FRAME_HEADROOM;
/// `XDP_PKT_CONTD` (linux/if_xdp.h): on a descriptor, more buffers of the same frame follow.
const XDP_PKT_CONTD: u32 = 1;
/// Longest frame accepted in multi-buffer mode (a 9216-byte jumbo MTU plus Ethernet header).
pub const MAX_SG_FRAME: usize = 9216 + tyche_wire::ETH_HEADER_LEN;

/// How the frames of a link fit the UMEM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FramePlan {
    /// Largest frame the port sends or receives (MTU + Ethernet header).
    pub frame_capacity: usize,
    /// Whether frames span several chunks (`XDP_USE_SG`, `xdp.frags`).
    pub multi_buffer: bool,
    /// Tyche segment payload size for this link ([`tyche_wire::segment_size_for`]).
    pub segment_size: u32,
}

/// Chooses the frame capacity, multi-buffer use and segment size for a link of `mtu`, or says
/// clearly why the MTU and the UMEM chunk cannot work together.
pub fn plan_frames(ifname: &str, mtu: usize, allow_multi_buffer: bool) -> Result<FramePlan, Error> {
    let needed = mtu + tyche_wire::ETH_HEADER_LEN;
    let multi_buffer = needed > BUFFER_CAPACITY;
    let too_big =
        |hint| Error::FrameSize { ifname: ifname.to_string(), mtu, needed, per_buffer: BUFFER_CAPACITY, hint };
    if multi_buffer && !allow_multi_buffer {
        return Err(too_big("lower the MTU to 3632 or less, or enable multi-buffer (XDP_USE_SG)"));
    }
    if needed > MAX_SG_FRAME {
        return Err(too_big("MTUs above 9216 are not supported"));
    }
    let segment_size = tyche_wire::segment_size_for(mtu, needed)
        .ok_or_else(|| too_big("the MTU cannot carry a 512-byte Tyche segment; raise it to 584 or more"))?;
    Ok(FramePlan { frame_capacity: needed, multi_buffer, segment_size })
}

/// Where to put the UMEM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumaPlacement {
    /// On the NIC's node when it has one (`tyche_numa::nic_node`); nowhere in particular otherwise.
    Auto,
    /// On this node.
    Node(u32),
    /// Wherever the kernel puts it.
    Off,
}

/// Kernel busy polling of the socket (`SO_PREFER_BUSY_POLL`, `SO_BUSY_POLL`,
/// `SO_BUSY_POLL_BUDGET`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusyPoll {
    /// Microseconds to busy-poll the device in a receive call.
    pub usecs: u32,
    /// Packets per busy-poll round.
    pub budget: u32,
}

/// Whether the kernel may, must, or must not bind a socket in zero-copy mode, where the driver
/// works on the UMEM itself (ice, mlx5; veth and drivers without AF_XDP support copy every
/// frame between their buffers and the UMEM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CopyMode {
    /// Zero copy where the driver offers it, else copy mode (the kernel's choice; the port
    /// says which it got: [`XdpPort::zero_copy`]).
    #[default]
    Auto,
    /// Copy mode always (`XDP_COPY`).
    Copy,
    /// Zero copy or fail (`XDP_ZEROCOPY`): opening the port is an error where the driver
    /// cannot (no AF_XDP zero-copy support, or none for multi-buffer frames).
    ZeroCopy,
}

/// How to open a port.
#[derive(Debug, Clone)]
pub struct PortConfig {
    /// NIC receive queue to bind.
    pub queue: u32,
    /// UMEM chunks, a power of two; half receive, half transmit.
    pub frame_count: u32,
    /// Extra receive chunks, so that received frames of up to this many chunks in all can be
    /// lent to the receiver ([`FrameTransport::receive`] with `Rx::Lend`) while the fill ring stays full (a
    /// multi-buffer frame takes one per piece); 0: frames are never lent.
    pub lend_frames: u32,
    /// Extra chunks the sender may take for good ([`FrameTransport::lend_tx_chunks`]) to prepare
    /// frames in ahead of time (read data stored straight into them; on a multi-buffer link in
    /// groups of as many chunks as a frame spans); 0: none.
    pub tx_lend_frames: u32,
    /// Descriptors moved per ring operation.
    pub batch: usize,
    /// Where to run the XDP program.
    pub mode: AttachMode,
    /// Use multi-buffer frames when the MTU needs them (else such an MTU is an error).
    pub multi_buffer: bool,
    /// Optional busy polling.
    pub busy_poll: Option<BusyPoll>,
    /// UMEM placement.
    pub numa: NumaPlacement,
    /// Also pin the calling thread to the UMEM's node.
    pub pin_thread: bool,
    /// EtherType to steer and expect.
    pub ethertype: u16,
    /// Copy or zero-copy mode.
    pub copy: CopyMode,
}

impl Default for PortConfig {
    fn default() -> Self {
        PortConfig {
            queue: 0,
            frame_count: 4096,
            lend_frames: 0,
            tx_lend_frames: 0,
            batch: 64,
            mode: AttachMode::Auto,
            multi_buffer: true,
            busy_poll: None,
            numa: NumaPlacement::Auto,
            pin_thread: false,
            ethertype: tyche_wire::DEFAULT_ETHERTYPE,
            copy: CopyMode::Auto,
        }
    }
}

/// Counters of one port.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortStats {
    /// Frames delivered by `recv`.
    pub rx_frames: u64,
    /// Frames queued by `send`.
    pub tx_frames: u64,
    /// Multi-buffer frames discarded for exceeding the frame capacity.
    pub rx_oversized: u64,
    /// Multi-buffer frames discarded for coming in more than [`MAX_PIECES`] buffers.
    pub rx_too_many_pieces: u64,
    /// Kernel: frames dropped for lack of room (`rx_dropped`).
    pub kernel_rx_dropped: u64,
    /// Kernel: frames dropped because the RX ring was full.
    pub kernel_rx_ring_full: u64,
    /// Kernel: times the fill ring was empty.
    pub kernel_fill_ring_empty: u64,
    /// Kernel: invalid TX descriptors.
    pub kernel_tx_invalid: u64,
    /// Frames lent to the receiver (`recv_lend`) and kept.
    pub lent: u64,
    /// Frames offered without a lease because every spare chunk was lent.
    pub lend_exhausted: u64,
}

/// An AF_XDP socket bound to one NIC queue, with its own UMEM, implementing
/// [`FrameTransport`].
///
/// UMEM layout: `frame_count` chunks of [`CHUNK_SIZE`] bytes. The first half are receive
/// buffers, owned by the kernel through the fill ring until they come back on the RX ring and
/// are handed to `recv`'s callback in place, then returned to the fill ring. The second half are
/// transmit buffers: `send` hands a free one to its callback to write a frame in place, puts it
/// on the TX ring, and gets it back from the completion ring. No frame bytes are copied in user
/// space, except for multi-buffer frames (longer than one chunk) handed to `recv` (gathered
/// through one reusable buffer) or written by a `send` callback (scattered through another):
/// `recv_lend` hands a multi-buffer frame over in its pieces, and a lent transmit chunk group
/// ([`FrameTransport::lend_tx_chunks`]) goes out as one multi-buffer frame from where it is.
///
/// With [`PortConfig::lend_frames`], `lend_frames` more chunks are spare receive buffers: when
/// the receiver keeps a frame ([`FrameTransport::receive`] with `Rx::Lend`), a spare chunk goes on the fill
/// ring in its place, and the kept chunk becomes a spare again when it is released. So kept
/// frames never starve the fill ring; when no spare is left, frames are offered without a lease
/// (the receiver copies).
#[derive(Debug)]
pub struct XdpPort {
    // Field order is drop order: the sockets go before the UMEM, the program last.
    rx: RxQueue,
    tx: TxQueue,
    fq: FillQueue,
    cq: CompQueue,
    umem: Umem,
    /// This process's claim on the queue (`queue-<q>.lock`), released after the socket closes.
    _queue_lock: std::fs::File,
    program: Arc<XdpProgram>,
    info: InterfaceInfo,
    /// Bound in zero-copy mode (`XDP_OPTIONS_ZEROCOPY`).
    zero_copy: bool,
    queue: u32,
    plan: FramePlan,
    batch: usize,
    rx_descs: Vec<FrameDesc>,
    fill_backlog: Vec<FrameDesc>,
    tx_free: Vec<FrameDesc>,
    tx_staged: Vec<FrameDesc>,
    /// Filled transmit chunks the TX ring had no room for yet, in order (the kernel can hand
    /// chunks back on the completion ring before it releases their TX ring slots).
    tx_pending: Vec<FrameDesc>,
    comp_descs: Vec<FrameDesc>,
    tx_ring_size: u32,
    tx_unkicked: usize,
    gather: Vec<u8>,
    scatter: Vec<u8>,
    stats: PortStats,
    /// Receive chunks in no ring and lent to nobody, to replace kept frames on the fill ring.
    rx_spare: Vec<FrameDesc>,
    /// Per receive chunk (by [`chunk_index`]): lent to the receiver, with its descriptor.
    /// Empty when the port lends nothing.
    lent: Vec<Option<FrameDesc>>,
    /// Frames lent to the receiver (a multi-buffer frame holds several of `lent`).
    lent_frames: usize,
    /// Transmit chunks not lent yet ([`FrameTransport::lend_tx_chunks`]).
    tx_lendable: Vec<FrameDesc>,
    /// Transmit chunks (groups, on a multi-buffer link) lent for good, and how many of their
    /// buffers the kernel has now; a group's number is its place here.
    tx_lent: Vec<TxGroup>,
    /// Per UMEM chunk (by [`chunk_index`]): the number of the lent transmit group it belongs
    /// to, or [`NO_GROUP`]. Empty when the port lends no transmit chunks. One array lookup per
    /// completed frame, where a hash of its address was.
    tx_member: Vec<u32>,
    /// The buffers received so far of a multi-buffer frame whose last buffer has not come yet.
    rx_partial: Vec<FrameDesc>,
    /// The ids of the groups of `tx_lent` the kernel has now (few: a scan of `tx_lent` would
    /// cost a pass over every lent chunk per transmit turn); each group knows its place here.
    tx_lent_busy: Vec<u64>,
    /// A handle on the UMEM that every lease shares, so lent bytes stay mapped.
    umem_keep: Arc<dyn std::any::Any + Send + Sync>,
    numa_node: Option<u32>,
    /// Start and length of the UMEM mapping.
    umem_area: (usize, usize),
}

/// A lent transmit chunk: its buffers (one, or a group on a multi-buffer link) and how many of
/// them the kernel still has.
#[derive(Debug, Clone)]
struct TxGroup {
    descs: [FrameDesc; MAX_PIECES],
    count: usize,
    in_flight: usize,
    /// Its place in `tx_lent_busy` while the kernel has it, else [`NO_GROUP`].
    busy_at: u32,
    /// Shared with the lent chunk: sending while its sender writes it is refused, and so is
    /// writing while the kernel has it.
    state: Arc<ChunkState>,
}

/// No lent transmit group (in `tx_member`), not busy (in [`TxGroup::busy_at`]).
const NO_GROUP: u32 = u32::MAX;

/// The number of the UMEM chunk an address (of a descriptor, or a lease's piece) lies in.
fn chunk_index(addr: u64) -> usize {
    (addr / CHUNK_SIZE as u64) as usize
}

/// Most buffers of one received frame held while waiting for its last one: more than the
/// kernel's fragment limit (`MAX_SKB_FRAGS` + 1), so only a broken ring reaches it.
const RX_PARTIAL_LIMIT: usize = 64;

fn xsk_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Xsk { what: what.to_string(), detail: e.to_string() }
}

/// An error with its sources, `a: b: c` (xsk-rs keeps the kernel's errno in the source).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

const SO_BUSY_POLL: libc::c_int = 46;
const SO_PREFER_BUSY_POLL: libc::c_int = 69;
const SO_BUSY_POLL_BUDGET: libc::c_int = 70;

/// Whether the kernel bound the AF_XDP socket `fd` in zero-copy mode (`XDP_OPTIONS`): the
/// driver's own rings over our UMEM; else copy mode (every frame copied between the driver's
/// buffers and the UMEM, as on veth).
fn bound_zero_copy(fd: i32) -> io::Result<bool> {
    let mut opts = libc::xdp_options { flags: 0 };
    let mut len = std::mem::size_of::<libc::xdp_options>() as libc::socklen_t;
    // SAFETY: `opts` is a live xdp_options and `len` its size; the kernel writes at most that.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_XDP,
            libc::XDP_OPTIONS,
            &mut opts as *mut libc::xdp_options as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(opts.flags & libc::XDP_OPTIONS_ZEROCOPY != 0)
}

fn set_sockopt_int(fd: i32, level: libc::c_int, opt: libc::c_int, value: u32) -> io::Result<()> {
    let v = value as libc::c_int;
    // SAFETY: `v` is a live c_int and the length passed is its size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl XdpPort {
    /// Opens a port on `ifname` (in the calling thread's network namespace), loading and
    /// attaching the steering program for it.
    pub fn open(ifname: &str, config: &PortConfig) -> Result<Self, Error> {
        let info = InterfaceInfo::query(ifname)?;
        let plan = plan_frames(ifname, info.mtu, config.multi_buffer)?;
        let program =
            Arc::new(XdpProgram::attach(ifname, info.index, config.mode, plan.multi_buffer, config.ethertype)?);
        Self::open_on(program, info, config)
    }

    /// Opens a port on each of queues `0..queues` of `ifname` (`config` with each queue's number
    /// set): queue 0 attaches the steering program, the others share it.
    pub fn open_queues(ifname: &str, queues: u32, config: &PortConfig) -> Result<Vec<Self>, Error> {
        let mut ports: Vec<XdpPort> = Vec::with_capacity(queues as usize);
        for queue in 0..queues {
            let pc = PortConfig { queue, ..config.clone() };
            let port = match ports.first() {
                None => Self::open(ifname, &pc)?,
                Some(first) => Self::open_on(first.program.clone(), first.info.clone(), &pc)?,
            };
            ports.push(port);
        }
        Ok(ports)
    }

    /// Opens a port on another queue of an interface whose program is already attached.
    pub fn open_on(program: Arc<XdpProgram>, info: InterfaceInfo, config: &PortConfig) -> Result<Self, Error> {
        let plan = plan_frames(&info.name, info.mtu, config.multi_buffer)?;
        if plan.multi_buffer && !program.frags() {
            return Err(Error::Attach {
                ifname: info.name.clone(),
                detail: "a multi-buffer port needs the xdp.frags program".into(),
            });
        }
        // Before anything is bound: a queue another Tyche process serves is refused by name.
        let queue_lock = program.nic().take_queue(config.queue)?.map_err(|pid| Error::QueueBusy {
            ifname: info.name.clone(),
            queue: config.queue,
            pid,
        })?;
        let half = config.frame_count / 2;
        let numa_node = place_thread(config, &info.name)?;
        let (umem, descs, frame_count) = create_umem(config, numa_node)?;
        let (tx, rx, mut fq, cq) = bind_socket(config, &info.name, &umem, numa_node, plan.multi_buffer)?;
        let zero_copy = bound_zero_copy(rx.fd().as_raw_fd()).map_err(|e| Error::io("getsockopt XDP_OPTIONS", e))?;

        if let Some(bp) = config.busy_poll {
            set_busy_poll(rx.fd().as_raw_fd(), bp)?;
        }

        // The UMEM's first chunk has address 0, so its data pointer is the start of the area.
        // SAFETY: `descs[0]` is a chunk of this UMEM that no ring holds yet; only its address is
        // taken, nothing is read.
        let umem_base = unsafe { umem.data(&descs[0]) }.contents().as_ptr() as usize - descs[0].addr();
        let umem_len = frame_count.get() as usize * CHUNK_SIZE;
        let (descs, spare) = descs.split_at(config.frame_count as usize);
        let (spare, tx_lendable) = spare.split_at(config.lend_frames as usize);
        let (rx_half, tx_half) = descs.split_at(half as usize);
        // SAFETY: the descriptors come from this UMEM and none is in any ring yet.
        let filled = unsafe { fq.produce(rx_half) };
        assert_eq!(filled, rx_half.len(), "fill ring holds every receive buffer");

        program.register(config.queue, rx.fd_borrowed())?;

        let batch = config.batch.max(1);
        let umem_keep: Arc<dyn std::any::Any + Send + Sync> = Arc::new(Mutex::new(umem.clone()));
        Ok(XdpPort {
            rx,
            tx,
            fq,
            cq,
            umem,
            _queue_lock: queue_lock,
            program,
            queue: config.queue,
            plan,
            batch,
            rx_descs: vec![FrameDesc::default(); batch],
            fill_backlog: Vec::new(),
            tx_free: tx_half.to_vec(),
            tx_staged: Vec::with_capacity(batch * 3),
            tx_pending: Vec::new(),
            comp_descs: vec![FrameDesc::default(); half as usize],
            tx_ring_size: half,
            tx_unkicked: 0,
            gather: Vec::new(),
            scatter: if plan.multi_buffer { vec![0; plan.frame_capacity] } else { Vec::new() },
            stats: PortStats::default(),
            rx_spare: spare.to_vec(),
            // Receive chunks are the first half and the spares: below `frame_count + lend_frames`.
            lent: if config.lend_frames > 0 {
                vec![None; (config.frame_count + config.lend_frames) as usize]
            } else {
                Vec::new()
            },
            lent_frames: 0,
            tx_lendable: tx_lendable.to_vec(),
            tx_lent: Vec::new(),
            tx_member: if config.tx_lend_frames > 0 { vec![NO_GROUP; frame_count.get() as usize] } else { Vec::new() },
            rx_partial: Vec::with_capacity(MAX_PIECES),
            tx_lent_busy: Vec::new(),
            umem_keep,
            numa_node,
            umem_area: (umem_base, umem_len),
            info,
            zero_copy,
        })
    }

    /// Whether the kernel bound this socket in zero-copy mode (the driver works on the UMEM
    /// itself, as ice and mlx5 do), or in copy mode (veth; drivers without AF_XDP support).
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// The frame plan (capacity, multi-buffer, segment size) chosen for this link.
    pub fn plan(&self) -> FramePlan {
        self.plan
    }

    /// The mode the steering program runs in.
    pub fn mode(&self) -> AttachedMode {
        self.program.mode()
    }

    /// The steering program (shared by every port on this interface).
    pub fn program(&self) -> &Arc<XdpProgram> {
        &self.program
    }

    /// The interface.
    pub fn interface(&self) -> &InterfaceInfo {
        &self.info
    }

    /// The NUMA node the UMEM was placed on, if any.
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// The memory of this port: the UMEM, and the four rings (fill, completion, RX, TX) the
    /// kernel allocated and mapped through the socket (found in `/proc/self/maps` by the
    /// socket's inode).
    pub fn memory_areas(&self) -> Vec<tyche_transport::MemoryArea> {
        let mut areas =
            vec![tyche_transport::MemoryArea { what: "umem", addr: self.umem_area.0, len: self.umem_area.1 }];
        for (start, end) in socket_mappings(self.rx.fd().as_raw_fd()) {
            areas.push(tyche_transport::MemoryArea { what: "rings", addr: start, len: end - start });
        }
        areas
    }

    /// Counters of this port, including the kernel's socket statistics.
    pub fn stats(&self) -> PortStats {
        let mut s = self.stats;
        if let Ok(k) = self.rx.fd().xdp_statistics() {
            s.kernel_rx_dropped = k.rx_dropped();
            s.kernel_rx_ring_full = k.rx_ring_full();
            s.kernel_fill_ring_empty = k.rx_fill_ring_empty_descs();
            s.kernel_tx_invalid = k.tx_invalid_descs();
        }
        s
    }

    /// Sleeps until a frame is waiting on the RX ring or `timeout` passes (`poll(2)`; in copy
    /// mode the poll also drives pending transmissions). Returns whether frames are waiting. For
    /// threads that poll the port themselves: spin while busy, call this when idle.
    pub fn wait_readable(&mut self, timeout: std::time::Duration) -> io::Result<bool> {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(self.rx.fd_borrowed(), PollFlags::POLLIN)];
        let ms = timeout.as_millis().min(i32::MAX as u128);
        match nix::poll::poll(&mut fds, PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)) {
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(e) => Err(e.into()),
            Ok(n) => Ok(n > 0 && fds[0].revents().is_some_and(|r| r.contains(PollFlags::POLLIN))),
        }
    }

    /// Transmit buffers not yet given back by the kernel.
    pub fn tx_in_flight(&self) -> usize {
        self.tx_ring_size as usize - self.tx_free.len()
    }

    fn reclaim(&mut self) {
        // SAFETY: the completion ring only returns descriptors of this UMEM's transmit half.
        let n = unsafe { self.cq.consume(&mut self.comp_descs) };
        for i in 0..n {
            let desc = self.comp_descs[i];
            match self.tx_member.get(chunk_index(desc.addr() as u64)).copied().unwrap_or(NO_GROUP) {
                NO_GROUP => self.tx_free.push(desc),
                g => {
                    let group = &mut self.tx_lent[g as usize];
                    group.in_flight = group.in_flight.saturating_sub(1);
                    if group.in_flight == 0 {
                        group.state.end_send();
                        let at = std::mem::replace(&mut group.busy_at, NO_GROUP);
                        self.unbusy(at);
                    }
                }
            }
        }
    }

    /// Takes the group at place `at` of `tx_lent_busy` out of it (the kernel is done with it).
    fn unbusy(&mut self, at: u32) {
        let at = at as usize;
        if at >= self.tx_lent_busy.len() {
            return;
        }
        self.tx_lent_busy.swap_remove(at);
        // The group moved into the freed place learns its new place.
        if let Some(&moved) = self.tx_lent_busy.get(at) {
            if let Some(&g) = self.tx_member.get(chunk_index(moved)) {
                self.tx_lent[g as usize].busy_at = at as u32;
            }
        }
    }

    fn refill(&mut self) -> io::Result<()> {
        if !self.fill_backlog.is_empty() {
            // SAFETY: backlog descriptors belong to this UMEM and are referenced nowhere else.
            let n = unsafe { self.fq.produce(&self.fill_backlog) };
            if n == self.fill_backlog.len() {
                self.fill_backlog.clear();
            }
        }
        if self.fq.needs_wakeup() {
            self.fq.wakeup(self.rx.fd_mut(), 0)?;
        }
        Ok(())
    }

    /// Puts pending frames on the TX ring; returns whether none is left pending.
    fn push_pending(&mut self) -> io::Result<bool> {
        if self.tx_pending.is_empty() {
            return Ok(true);
        }
        for _ in 0..2 {
            // SAFETY: pending descriptors are filled transmit chunks of this UMEM, in no ring.
            // `produce` is all or nothing.
            if unsafe { self.tx.produce(&self.tx_pending) } == self.tx_pending.len() {
                self.tx_unkicked += self.tx_pending.len();
                self.tx_pending.clear();
                self.kick()?;
                return Ok(true);
            }
            // Make the kernel consume the ring (and release its slots), then try once more.
            self.tx.wakeup()?;
            self.reclaim();
        }
        Ok(false)
    }

    /// The last buffer of a frame in pieces (`rx_partial`) arrived: hands the frame over as
    /// `mode` asks (gathered, in pieces, or lent in place when spare chunks can take its
    /// buffers' places on the fill ring). The buffers not kept go to `refill`. Whether a frame
    /// was delivered (not one over the limits, counted and given back).
    fn deliver_pieces(&mut self, mode: Rx, on_frame: &mut OnLentFrame<'_>, refill: &mut Vec<FrameDesc>) -> bool {
        let total: usize = self.rx_partial.iter().map(|d| d.lengths().data()).sum();
        let count = self.rx_partial.len();
        if count > MAX_PIECES {
            self.stats.rx_too_many_pieces += 1;
            refill.append(&mut self.rx_partial);
            return false;
        }
        if total > self.plan.frame_capacity {
            self.stats.rx_oversized += 1;
            refill.append(&mut self.rx_partial);
            return false;
        }
        let mut pieces: [&[u8]; MAX_PIECES] = [&[]; MAX_PIECES];
        for (p, d) in pieces.iter_mut().zip(&self.rx_partial) {
            // SAFETY: each buffer of the frame was taken off the RX ring of this UMEM and is in
            // no ring until it goes back on the fill ring; no mutable reference to it exists.
            *p = unsafe { self.umem.data(d) }.contents();
        }
        let pieces = &pieces[..count];
        if mode == Rx::Pieces {
            on_frame(pieces, None);
            refill.append(&mut self.rx_partial);
            return true;
        }
        if mode != Rx::Lend {
            // `recv` hands over whole frames: gather them.
            tyche_transport::gather(pieces, &mut self.gather);
            on_frame(&[&self.gather], None);
            refill.append(&mut self.rx_partial);
            return true;
        }
        if self.rx_spare.len() < count {
            self.stats.lend_exhausted += 1;
            on_frame(pieces, None);
            refill.append(&mut self.rx_partial);
            return true;
        }
        // SAFETY: the buffers lie in this UMEM, which `umem_keep` keeps mapped; a
        // kept frame's buffers go on no ring (spare chunks take their places) until
        // the lease comes back through `release`, so nothing writes them meanwhile.
        let lease = unsafe {
            Lease::new_pieces(
                self.rx_partial.iter().zip(pieces).map(|(d, p)| (d.addr() as u64, *p)),
                Arc::clone(&self.umem_keep),
            )
        }
        .expect("1 to MAX_PIECES pieces");
        match on_frame(pieces, Some(lease)) {
            None => {
                // Kept: as many spare chunks take their places on the fill ring.
                for d in self.rx_partial.drain(..) {
                    self.lent[chunk_index(d.addr() as u64)] = Some(d);
                    refill.push(self.rx_spare.pop().expect("checked above"));
                }
                self.lent_frames += 1;
                self.stats.lent += 1;
            }
            Some(lease) => {
                drop(lease);
                refill.append(&mut self.rx_partial);
            }
        }
        true
    }

    /// Receives frames, offering leases when `lend` (and a spare chunk is left).
    fn receive_frames(&mut self, budget: usize, mode: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        let lend = mode == Rx::Lend;
        let mut delivered = 0;
        let mut refill = Vec::with_capacity(self.batch);
        while delivered < budget {
            let want = (budget - delivered).min(self.batch);
            // SAFETY: `rx_descs` are plain descriptor slots; the RX ring of this socket only
            // hands out chunks of this UMEM.
            let n = unsafe { self.rx.consume(&mut self.rx_descs[..want]) };
            if n == 0 {
                break;
            }
            refill.clear();
            for i in 0..n {
                let desc = self.rx_descs[i];
                // SAFETY: the descriptor was just taken off the RX ring of this UMEM; the kernel
                // does not touch the chunk again until it goes back on the fill ring (here, or
                // when a lent chunk is released), and no mutable reference to it exists.
                let data = unsafe { self.umem.data(&desc) };
                let bytes = data.contents();
                if self.plan.multi_buffer && (desc.has_more_frames() || !self.rx_partial.is_empty()) {
                    self.rx_partial.push(desc);
                    if desc.has_more_frames() {
                        if self.rx_partial.len() >= RX_PARTIAL_LIMIT {
                            // Never more buffers than the kernel's fragment limit: a broken
                            // ring. Give them back and count the frame.
                            self.stats.rx_too_many_pieces += 1;
                            refill.append(&mut self.rx_partial);
                        }
                        continue;
                    }
                    // The last buffer of the frame: hand it over in its pieces.
                    if self.deliver_pieces(mode, on_frame, &mut refill) {
                        delivered += 1;
                    }
                    continue;
                }
                delivered += 1;
                if !lend || self.rx_spare.is_empty() {
                    if lend {
                        self.stats.lend_exhausted += 1;
                    }
                    on_frame(&[bytes], None);
                    refill.push(desc);
                    continue;
                }
                // SAFETY: as for a frame in pieces: mapped while `umem_keep` lives, on no ring
                // until the lease comes back.
                let lease = unsafe { Lease::new(desc.addr() as u64, bytes, Arc::clone(&self.umem_keep)) };
                match on_frame(&[bytes], Some(lease)) {
                    None => {
                        // Kept: a spare chunk takes its place on the fill ring.
                        self.lent[chunk_index(desc.addr() as u64)] = Some(desc);
                        self.lent_frames += 1;
                        self.stats.lent += 1;
                        refill.push(self.rx_spare.pop().expect("checked above"));
                    }
                    Some(lease) => {
                        drop(lease);
                        refill.push(desc);
                    }
                }
            }
            // SAFETY: these chunks belong to this UMEM, are in no ring, and nothing refers to
            // them any more (kept ones were replaced by spares).
            let put = unsafe { self.fq.produce(&refill) };
            if put != refill.len() {
                self.fill_backlog.extend_from_slice(&refill);
            }
            if n < want {
                break;
            }
        }
        self.stats.rx_frames += delivered as u64;
        self.refill()?;
        Ok(delivered)
    }

    /// Stages lent transmit chunk `id` (a group of buffers on a multi-buffer link) as a frame of
    /// `len` bytes, `head` (the frame's first `header` bytes) written in front of the payload
    /// already there: one descriptor per buffer the frame fills, `XDP_PKT_CONTD` on all but the
    /// last.
    fn stage_lent(&mut self, id: u64, head: &[u8], header: usize, len: usize) {
        assert!(head.len() == header && header <= len && header <= BUFFER_CAPACITY, "bad lent frame");
        let g = self.tx_member.get(chunk_index(id)).copied().unwrap_or(NO_GROUP);
        assert!(g != NO_GROUP, "a transmit chunk this port lent");
        let busy_at = self.tx_lent_busy.len() as u32;
        let group = &mut self.tx_lent[g as usize];
        assert!(group.in_flight == 0, "a lent chunk is sent again only once the kernel is done with it");
        assert!(group.state.begin_send(), "lent chunk {id} is sent while its sender writes it");
        assert!(len <= group.count * BUFFER_CAPACITY, "a frame within its chunk");
        let used = len.div_ceil(BUFFER_CAPACITY).max(1);
        let mut left = len;
        for i in 0..used {
            let mut d = group.descs[i];
            let n = left.min(BUFFER_CAPACITY);
            left -= n;
            // SAFETY: a buffer of this UMEM lent to the caller and not in flight, so no ring
            // holds it; its sender holds no writer on it (begin_send succeeded above), so this
            // is the only reference.
            let mut data = unsafe { self.umem.data_mut(&mut d) };
            let full = data.cursor().buf_len();
            data.cursor().set_pos(full);
            if i == 0 {
                data.contents_mut()[..header].copy_from_slice(head);
            }
            data.cursor().set_pos(n);
            d.set_options(if i + 1 < used { XDP_PKT_CONTD } else { 0 });
            self.tx_staged.push(d);
        }
        group.in_flight = used;
        group.busy_at = busy_at;
        self.tx_lent_busy.push(id);
    }

    /// Kicks the kernel to transmit what is on the TX ring (one `sendto`; the kernel sends a
    /// bounded batch per call in copy mode).
    fn kick(&mut self) -> io::Result<()> {
        if self.tx.needs_wakeup() {
            self.tx.wakeup()?;
        }
        self.tx_unkicked = 0;
        Ok(())
    }
}

/// The mappings of socket `fd` in this process (`/proc/self/maps` names them `socket:[INODE]`).
fn socket_mappings(fd: i32) -> Vec<(usize, usize)> {
    // SAFETY: all-zero is a valid `stat`, which fstat fills in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable stat buffer; a bad descriptor is an error, not UB.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Vec::new();
    }
    let name = format!("socket:[{}]", st.st_ino);
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    maps.lines()
        .filter(|l| l.split_whitespace().nth(5) == Some(name.as_str()))
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))
        })
        .collect()
}

trait FdBorrow {
    fn fd_borrowed(&self) -> BorrowedFd<'_>;
}

impl FdBorrow for RxQueue {
    fn fd_borrowed(&self) -> BorrowedFd<'_> {
        // SAFETY: the socket's descriptor stays open as long as this queue (which holds a
        // handle to the socket) lives, and the borrow cannot outlive `self`.
        unsafe { BorrowedFd::borrow_raw(self.fd().as_raw_fd()) }
    }
}

impl Drop for XdpPort {
    fn drop(&mut self) {
        self.program.unregister(self.queue);
    }
}

impl FrameTransport for XdpPort {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            frame_capacity: self.plan.frame_capacity,
            mtu: self.info.mtu,
            local_mac: self.info.mac,
            numa_node: self.numa_node,
            memory_areas: self.memory_areas(),
        }
    }

    fn receive(&mut self, budget: usize, rx: Rx, on_frame: &mut OnLentFrame<'_>) -> io::Result<usize> {
        self.receive_frames(budget, rx, on_frame)
    }

    fn release(&mut self, lease: Lease) {
        assert!(Arc::ptr_eq(lease.memory(), &self.umem_keep), "a lease goes back to the port that lent it");
        for piece in lease.pieces() {
            let desc = self
                .lent
                .get_mut(chunk_index(piece.id))
                .and_then(Option::take)
                .expect("a lease this port lent and did not get back yet");
            self.rx_spare.push(desc);
        }
        self.lent_frames -= 1;
    }

    fn leases_out(&self) -> usize {
        self.lent_frames
    }

    fn lend_tx_chunks(&mut self, max: usize) -> Vec<TxChunk> {
        // On a multi-buffer link a chunk is a group of buffers that one frame fills in order.
        let per = if self.plan.multi_buffer { self.plan.frame_capacity.div_ceil(BUFFER_CAPACITY) } else { 1 };
        if per > MAX_PIECES {
            return Vec::new();
        }
        let n = max.min(self.tx_lendable.len() / per);
        let base = self.umem_area.0;
        let taken = self.tx_lendable.split_off(self.tx_lendable.len() - n * per);
        taken
            .chunks(per)
            .map(|group| {
                let id = group[0].addr() as u64;
                let g = self.tx_lent.len() as u32;
                let mut descs = [FrameDesc::default(); MAX_PIECES];
                let mut pieces = [TxPiece::default(); MAX_PIECES];
                for (i, d) in group.iter().enumerate() {
                    descs[i] = *d;
                    pieces[i] = TxPiece { addr: base + d.addr(), capacity: BUFFER_CAPACITY };
                    self.tx_member[chunk_index(d.addr() as u64)] = g;
                }
                // SAFETY: buffers of this UMEM (mapped while `umem_keep` lives), taken off the
                // lendable list for good, so on no ring and lent once; this port writes them
                // (the headers) and puts them on the TX ring only in `stage_lent`, after
                // begin_send on the chunk's state, and calls end_send once the completion ring
                // gave every one of them back (`reclaim`).
                let chunk = unsafe { TxChunk::new_pieces(id, &pieces[..per], Arc::clone(&self.umem_keep)) }
                    .expect("1 to MAX_PIECES pieces");
                let state = Arc::clone(chunk.state());
                self.tx_lent.push(TxGroup { descs, count: per, in_flight: 0, busy_at: NO_GROUP, state });
                chunk
            })
            .collect()
    }

    fn tx_chunks_in_flight(&mut self) -> Vec<u64> {
        self.reclaim();
        self.tx_lent_busy.clone()
    }

    fn transmit(&mut self, budget: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<Sent>) -> io::Result<usize> {
        self.reclaim();
        if !self.push_pending()? {
            return Ok(0);
        }
        let capacity = self.plan.frame_capacity;
        let mut queued = 0;
        self.tx_staged.clear();
        while queued < budget {
            if self.plan.multi_buffer {
                let chunks = capacity.div_ceil(BUFFER_CAPACITY);
                if self.tx_free.len() < chunks {
                    break;
                }
                let len = match fill(&mut self.scatter[..capacity]) {
                    None => break,
                    Some(Sent::Here(len)) => len,
                    Some(Sent::Chunk { id, header, len }) => {
                        // Headers into the group's first buffer; the group goes out as is.
                        let mut head = [0u8; 256];
                        assert!(header <= head.len() && header <= len && len <= capacity, "bad lent frame");
                        head[..header].copy_from_slice(&self.scatter[..header]);
                        self.stage_lent(id, &head[..header], header, len);
                        queued += 1;
                        continue;
                    }
                };
                assert!(len <= capacity, "frame of {len} bytes overran its buffer");
                if len == 0 {
                    continue;
                }
                let pieces = len.div_ceil(BUFFER_CAPACITY);
                for (i, piece) in self.scatter[..len].chunks(BUFFER_CAPACITY).enumerate() {
                    let mut desc = self.tx_free.pop().expect("counted above");
                    // SAFETY: a free transmit chunk of this UMEM, in no ring, referenced nowhere.
                    let mut data = unsafe { self.umem.data_mut(&mut desc) };
                    let mut cur = data.cursor();
                    cur.set_pos(0);
                    std::io::Write::write_all(&mut cur, piece).expect("piece fits a chunk");
                    desc.set_options(if i + 1 < pieces { XDP_PKT_CONTD } else { 0 });
                    self.tx_staged.push(desc);
                }
                queued += 1;
                continue;
            }
            let Some(mut desc) = self.tx_free.pop() else {
                break;
            };
            // SAFETY: a free transmit chunk of this UMEM: in no ring and referenced nowhere, so
            // this is the only reference to its bytes.
            let mut data = unsafe { self.umem.data_mut(&mut desc) };
            let full = data.cursor().buf_len();
            data.cursor().set_pos(full);
            let result = fill(&mut data.contents_mut()[..capacity]);
            match result {
                Some(Sent::Here(len)) if len > 0 => {
                    assert!(len <= capacity, "frame of {len} bytes overran its buffer");
                    data.cursor().set_pos(len);
                    desc.set_options(0);
                    self.tx_staged.push(desc);
                    queued += 1;
                }
                Some(Sent::Here(_)) => {
                    self.tx_free.push(desc);
                }
                Some(Sent::Chunk { id, header, len }) => {
                    // The headers were written here; the payload already lies in the lent chunk.
                    let mut head = [0u8; 256];
                    assert!(header <= head.len() && header <= len && len <= capacity, "bad lent frame");
                    head[..header].copy_from_slice(&data.contents()[..header]);
                    self.tx_free.push(desc);
                    self.stage_lent(id, &head[..header], header, len);
                    queued += 1;
                }
                None => {
                    self.tx_free.push(desc);
                    break;
                }
            }
        }
        if !self.tx_staged.is_empty() {
            // SAFETY: staged descriptors are transmit chunks of this UMEM, filled above.
            let n = unsafe { self.tx.produce(&self.tx_staged) };
            self.stats.tx_frames += queued as u64;
            if n == self.tx_staged.len() {
                self.tx_unkicked += n;
                self.kick()?;
            } else {
                // No room on the ring yet (`produce` is all or nothing): keep the frames, in
                // order, for the next send or flush.
                self.tx_pending.append(&mut self.tx_staged);
                self.tx.wakeup()?;
            }
        }
        Ok(queued)
    }

    fn flush(&mut self) -> io::Result<()> {
        // Copy mode transmits a bounded batch per wake-up: kick until the ring is drained, with
        // a bound so a stalled device cannot spin us forever.
        self.push_pending()?;
        let mut rounds = self.tx_ring_size as usize / 16 + 4;
        while self.tx.nb_free_exact() < self.tx_ring_size && rounds > 0 {
            self.kick()?;
            rounds -= 1;
        }
        self.reclaim();
        self.refill()
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.rx.fd_borrowed())
    }
}

/// The UMEM of a port: `frame_count` chunks for its rings plus those it lends, on `node` (its
/// pages placed there as they are mapped); the chunks' descriptors and their count.
fn create_umem(config: &PortConfig, node: Option<u32>) -> Result<(Umem, Vec<FrameDesc>, NonZeroU32), Error> {
    assert!(
        config.frame_count.is_power_of_two() && config.frame_count >= 64,
        "frame_count must be a power of two >= 64"
    );
    let half = config.frame_count / 2;
    let q = |n: u32| QueueSize::new(n).map_err(|e| xsk_err("ring size", e));
    let umem_config = UmemConfig::builder()
        .frame_size(FrameSize::new(CHUNK_SIZE as u32).map_err(|e| xsk_err("frame size", e))?)
        .frame_headroom(FRAME_HEADROOM as u32)
        .fill_queue_size(q(half)?)
        .comp_queue_size(q(half)?)
        .build()
        .map_err(|e| xsk_err("UMEM config", e))?;
    let frame_count =
        NonZeroU32::new(config.frame_count + config.lend_frames + config.tx_lend_frames).expect("frame_count > 0");
    // Umem::new maps with MAP_POPULATE: binding the memory policy around it places every page on
    // the NIC's node.
    let (umem, descs) = tyche_numa::alloc::with_thread_memory_on(node, || Umem::new(umem_config, frame_count, false))
        .map_err(|e| Error::numa("binding the UMEM to the NIC's NUMA node", e))?
        .map_err(|e| xsk_err("creating the UMEM", with_sources(&e)))?;
    Ok((umem, descs, frame_count))
}

/// The socket's bind flags: wake-ups only when needed, scatter-gather for multi-buffer frames,
/// and the copy mode asked for.
fn bind_flags(copy: CopyMode, multi_buffer: bool) -> BindFlags {
    let mut bind = BindFlags::XDP_USE_NEED_WAKEUP;
    if multi_buffer {
        bind |= BindFlags::XDP_USE_SG;
    }
    match copy {
        CopyMode::Auto => {}
        CopyMode::Copy => bind |= BindFlags::XDP_COPY,
        CopyMode::ZeroCopy => bind |= BindFlags::XDP_ZEROCOPY,
    }
    bind
}

/// What a failed bind most likely lacked, for its error.
fn bind_hint(copy: CopyMode, multi_buffer: bool) -> &'static str {
    match (copy, multi_buffer) {
        (CopyMode::ZeroCopy, true) => {
            " in zero-copy mode (the driver needs AF_XDP zero-copy support, for multi-buffer frames too)"
        }
        (CopyMode::ZeroCopy, false) => " in zero-copy mode (the driver needs AF_XDP zero-copy support)",
        (_, true) => " (multi-buffer needs kernel 6.6+ and driver support)",
        (_, false) => "",
    }
}

/// Busy polling on the socket `fd` (preferred, its time and budget).
fn set_busy_poll(fd: std::os::fd::RawFd, bp: BusyPoll) -> Result<(), Error> {
    for (opt, v, name) in [
        (SO_PREFER_BUSY_POLL, 1, "SO_PREFER_BUSY_POLL"),
        (SO_BUSY_POLL, bp.usecs, "SO_BUSY_POLL"),
        (SO_BUSY_POLL_BUDGET, bp.budget, "SO_BUSY_POLL_BUDGET"),
    ] {
        set_sockopt_int(fd, libc::SOL_SOCKET, opt, v).map_err(|e| Error::io(format!("setsockopt {name}"), e))?;
    }
    Ok(())
}
