//! A request's data buffer, and what a request gives back.

use std::sync::Arc;

use tyche_wire::Op;

use crate::error::Error;

/// A request's data: a heap buffer (the [`Client`](crate::Client) API's `Vec`), pages bound to a
/// NUMA node (front ends served by the engine, see [`crate::engine_front`]), or a view of a
/// buffer others share.
#[derive(Debug)]
pub(crate) enum Buf {
    Heap(Vec<u8>),
    /// The first `len` bytes of a region bound to its node.
    Node(tyche_numa::alloc::NodeRegion, usize),
    /// `len` bytes at `at` of a buffer others share: a write's payload left where the NBD
    /// server's read buffer received it (`nbd::direct`), which the read buffer's owner reuses
    /// once no request holds a view of it.
    Shared {
        buf: Arc<Buf>,
        at: usize,
        len: usize,
    },
}

impl Buf {
    pub(crate) fn len(&self) -> usize {
        match self {
            Buf::Heap(v) => v.len(),
            Buf::Node(_, len) => *len,
            Buf::Shared { len, .. } => *len,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Buf::Heap(v) => v,
            Buf::Node(r, len) => &r.as_slice()[..*len],
            Buf::Shared { buf, at, len } => &buf.as_slice()[*at..*at + *len],
        }
    }

    /// The data, writable. A shared view is first made a buffer of its own (a copy; nothing
    /// writes into a write's payload, the only data that is shared).
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        if let Buf::Shared { .. } = self {
            *self = Buf::Heap(self.as_slice().to_vec());
        }
        match self {
            Buf::Heap(v) => v,
            Buf::Node(r, len) => &mut r.as_mut_slice()[..*len],
            Buf::Shared { .. } => unreachable!("a shared view was just made a heap buffer"),
        }
    }

    /// The data as a `Vec` (a copy only for node-bound buffers and shared views, which `Client`
    /// never makes).
    pub(crate) fn into_vec(self) -> Vec<u8> {
        match self {
            Buf::Heap(v) => v,
            Buf::Node(..) | Buf::Shared { .. } => self.as_slice().to_vec(),
        }
    }
}

/// What a request gives back: its op and its buffer (read data for a read).
pub(crate) type Outcome = Result<(Op, Buf), Error>;
