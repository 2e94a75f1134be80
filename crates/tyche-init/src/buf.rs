//! A request's data buffer, and what a request gives back.

use tyche_wire::Op;

use crate::error::Error;

/// A request's data: a heap buffer (the [`Client`](crate::Client) API's `Vec`), or pages bound to a NUMA node
/// (front ends served by the engine, see [`crate::front`]).
#[derive(Debug)]
pub(crate) enum Buf {
    Heap(Vec<u8>),
    /// The first `len` bytes of a region bound to its node.
    Node(tyche_numa::alloc::NodeRegion, usize),
}

impl Buf {
    pub(crate) fn len(&self) -> usize {
        match self {
            Buf::Heap(v) => v.len(),
            Buf::Node(_, len) => *len,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Buf::Heap(v) => v,
            Buf::Node(r, len) => &r.as_slice()[..*len],
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Buf::Heap(v) => v,
            Buf::Node(r, len) => &mut r.as_mut_slice()[..*len],
        }
    }

    /// The data as a `Vec` (a copy only for node-bound buffers, which `Client` never makes).
    pub(crate) fn into_vec(self) -> Vec<u8> {
        match self {
            Buf::Heap(v) => v,
            Buf::Node(..) => self.as_slice().to_vec(),
        }
    }
}

/// What a request gives back: its op and its buffer (read data for a read).
pub(crate) type Outcome = Result<(Op, Buf), Error>;
