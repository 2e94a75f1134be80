//! AF_XDP transport for Tyche.
//!
//! An XDP program ([`XdpProgram`], source `bpf/tyche_steer.bpf.c`) steers frames with the Tyche
//! EtherType and a valid Tyche header into AF_XDP sockets, by receive queue, and passes every
//! other frame to the kernel, so Tyche shares links with IP. Each [`XdpPort`] is one socket on
//! one NIC queue with its own UMEM, allocated on the NIC's NUMA node (`tyche_numa::nic_node`, `tyche_numa::alloc`), and implements
//! [`tyche_transport::FrameTransport`], so the channel engine runs on it unchanged.
//!
//! # Promises
//! - Frames are read and written in place in UMEM chunks (no user-space copies), except
//!   multi-buffer frames longer than one chunk, gathered/scattered through one buffer.
//! - An MTU the UMEM cannot carry is an [`Error::FrameSize`] at setup, never silent drops.
//! - Native XDP is tried first; generic (skb) mode is used only when allowed, and logged.
//! - One steering program per interface, shared by every Tyche process on it: a process
//!   attaches only where no program is, shares Tyche's, refuses a foreign one
//!   ([`Error::ForeignProgram`]) and never removes a program another live process uses; a
//!   queue another process holds is [`Error::QueueBusy`] naming it.
//! - Dropping a port unregisters its socket; the last port of the last process using an
//!   interface detaches the program.
//!
//! # Ownership
//! The UMEM belongs to its port. Receive chunks belong to the kernel except during `recv`'s
//! callback; transmit chunks belong to the port except between `send` and their completion.

mod async_io;
mod error;
mod iface;
mod packet;
mod port;
mod program;
mod share;

pub use async_io::AsyncTransport;
pub use error::Error;
pub use iface::{queue_count, InterfaceInfo};
pub use packet::{packet_socket, PacketTransport};
pub use port::{
    plan_frames, BusyPoll, CopyMode, FramePlan, NumaPlacement, PortConfig, PortStats, XdpPort, BUFFER_CAPACITY,
    CHUNK_SIZE, FRAME_HEADROOM, MAX_SG_FRAME, XDP_HEADROOM,
};
pub use program::{AttachMode, AttachedMode, DiscoveryTap, SteerStats, XdpProgram};
pub use share::RUN_DIR;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_plans_follow_mtu_and_chunk() {
        let p = plan_frames("x", 3000, false).expect("3000 fits one chunk");
        assert_eq!(p, FramePlan { frame_capacity: 3014, multi_buffer: false, segment_size: 2048 });
        let p = plan_frames("x", 1500, false).expect("1500 fits");
        assert_eq!(p.segment_size, 1024);
        let e = plan_frames("x", 9000, false).expect_err("9000 needs multi-buffer");
        assert!(matches!(e, Error::FrameSize { mtu: 9000, needed: 9014, per_buffer: 3646, .. }), "{e}");
        let p = plan_frames("x", 9000, true).expect("9000 with multi-buffer");
        assert!(p.multi_buffer);
        assert_eq!(p.segment_size, 8192);
        assert!(matches!(plan_frames("x", 400, true), Err(Error::FrameSize { .. })));
        assert!(matches!(plan_frames("x", 65000, true), Err(Error::FrameSize { .. })));
    }
}
