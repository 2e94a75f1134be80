//! NBD transmission served by the engine thread itself.
//!
//! After the handshake (async, on the connection's own thread or task), the socket is handed to
//! the engine thread of the connection's node ([`crate::Client`] routes it). That thread reads
//! requests from the socket without blocking, submits them to the volume directly, and writes
//! the replies of completed requests back in gathered writes, in the same loop that moves the
//! frames: no thread hand-off per request, no async task per request. A connection is a
//! [`DirectConn`]: a non-blocking socket, a request parser, and a queue of replies; the engine
//! serves it as a [`Front`] and knows nothing of NBD. What a request needs to be answered stays
//! here, in a table keyed by the [`Token`] the engine hands back with the outcome.
//!
//! Semantics are those of the task-based server in [`super`]: the same validation, the same
//! replies and error numbers, out-of-order completion, at most `max_inflight` requests and
//! [`HELD_BYTES`] of data per connection. A hole-aware READ is first a BLOCK_STATUS for the
//! volume; its completion queues hole chunks and follow-up reads of the data pieces, which the
//! engine collects with the next [`Front::receive`]. A TRIM with FUA is a discard and, once that
//! succeeded, a follow-up FLUSH, then the reply.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use tokio::sync::oneshot;
use tyche_wire::Op;

use super::codec::{self, cflag, cmd, errno, Action, Head};
use super::{
    block_status_reply, hole_aware, read_plan, reply_head, status_query, Negotiated, Piece, REPLY_BATCH,
    REQUEST_BUFFER, SECTOR,
};
use crate::bell::Bell;
use crate::buf::{Buf, Outcome};
use crate::config::SendMode;
use crate::engine_front::{Front, FrontIo, Token, WaitFd};
use crate::error::Error;
use crate::report::NbdStats;

/// Data (read buffers and write payloads) one connection may hold at once.
pub(crate) const HELD_BYTES: u64 = 256 << 20;
/// Request buffers of a node's connection are located page by page on one request in this many.
const BUFFER_SAMPLE: u64 = super::BUFFER_SAMPLE;
/// Smallest pooled buffer (one page).
const MIN_BUFFER: usize = 4096;
/// Most bytes of idle buffers a connection keeps for reuse.
const POOL_BYTES: u64 = 64 << 20;

/// A request for the volume, parsed from the socket (or started by a completion).
#[derive(Debug)]
pub(crate) struct NbdIo {
    pub op: Op,
    pub fua: bool,
    pub offset: u64,
    pub length: u64,
    /// Write data, or the buffer for read data.
    pub data: Buf,
    /// How the completion turns into a reply.
    pub reply: NbdReply,
}

/// Where a request's reply goes, and what is left to do when the volume completes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NbdReply {
    /// The NBD request (its command, offset and flags shape the reply).
    pub req: codec::Request,
    /// A BLOCK_STATUS: where the range asked of the volume starts (the covering sector).
    pub status_start: u64,
    /// A BLOCK_STATUS: bytes asked of the volume.
    pub status_len: u64,
    /// The block status asked for a hole-aware READ (`req`), before its data is read.
    pub probe: bool,
    /// One data piece of a hole-aware READ.
    pub split: Option<Split>,
    /// For a read of sectors covering an unaligned range: the part to return.
    pub trim: Option<(usize, usize)>,
    /// A TRIM with FUA: flush after the discard succeeds (a follow-up), then reply.
    pub then_flush: bool,
    /// Locate the buffer's pages for the stats (see [`BUFFER_SAMPLE`]).
    pub sample: bool,
    /// Data bytes the request holds (released on completion).
    pub held: u64,
    /// Bytes a write carries (for the counters).
    pub written: u64,
}

/// A data piece of a hole-aware READ: which one, and where its data chunk says it is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Split {
    /// Key of the read's [`SplitState`].
    pub key: u64,
    /// Offset of the piece in the export.
    pub offset: u64,
}

/// A hole-aware READ whose data pieces are in flight.
#[derive(Debug)]
struct SplitState {
    /// Pieces not completed yet: the last one's chunk is flagged DONE.
    left: usize,
    /// An ERROR chunk was sent: later pieces send nothing but the final NONE.
    failed: bool,
}

/// One reply: header and, for a successful read or block status, its data.
#[derive(Debug)]
struct Reply {
    header: Head,
    data: Buf,
}

/// A write request whose payload is still arriving.
#[derive(Debug)]
struct Partial {
    req: codec::Request,
    data: Buf,
    filled: usize,
    /// Bytes of `data` copied from the read buffer (the rest came straight from the socket).
    copied: u64,
}

/// The replies of a connection's requests in the engine, by [`Token`]: a slab whose freed slots
/// are reused, so handing a request to the engine allocates nothing once it has grown to the
/// connection's most requests in flight (bounded by `max_inflight` and a hole-aware read's pieces).
#[derive(Debug, Default)]
struct Tokens {
    slots: Vec<Option<NbdReply>>,
    free: Vec<usize>,
}

impl Tokens {
    fn insert(&mut self, reply: NbdReply) -> Token {
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(reply);
                i as Token
            }
            None => {
                self.slots.push(Some(reply));
                (self.slots.len() - 1) as Token
            }
        }
    }

    /// The reply of `token`, once (an unknown or spent token is `None`).
    fn take(&mut self, token: Token) -> Option<NbdReply> {
        let i = usize::try_from(token).ok()?;
        let reply = self.slots.get_mut(i)?.take()?;
        self.free.push(i);
        Some(reply)
    }
}

/// Request buffers of a connection served for a node: regions bound to the node (`mbind`), by
/// power-of-two size, reused from one request to the next. Their pages are on the node whichever
/// thread touches them first and whatever the heap held before, and NUMA balancing leaves them
/// there (the regions' own policy says they are in place).
/// Connections of no particular node reuse heap buffers the same way (no zeroing per request).
#[derive(Debug, Default)]
struct Pool {
    free: HashMap<usize, Vec<tyche_numa::alloc::NodeRegion>>,
    heap: HashMap<usize, Vec<Vec<u8>>>,
    bytes: u64,
}

impl Pool {
    /// A buffer of `len` bytes: node-bound for a connection with a node (unless the kernel
    /// refuses the mapping), else from the heap. Read buffers are zeroed or hold old data, which
    /// the read overwrites entirely.
    fn take(&mut self, len: usize, node: Option<u32>) -> Buf {
        if len == 0 {
            return Buf::Heap(Vec::new());
        }
        let class = len.next_power_of_two().max(MIN_BUFFER);
        let Some(node) = node else {
            let mut v = match self.heap.get_mut(&class).and_then(Vec::pop) {
                Some(v) => {
                    self.bytes -= class as u64;
                    v
                }
                None => vec![0; class],
            };
            v.truncate(len);
            return Buf::Heap(v);
        };
        if let Some(r) = self.free.get_mut(&class).and_then(Vec::pop) {
            self.bytes -= class as u64;
            return Buf::Node(r, len);
        }
        match tyche_numa::alloc::NodeRegion::new(class, node, tyche_numa::alloc::HugePages::No) {
            Ok(r) => Buf::Node(r, len),
            Err(e) => {
                tracing::debug!(node, len, "NBD buffer from the heap: {e}");
                Buf::Heap(vec![0; len])
            }
        }
    }

    /// Keeps `buf` for a later request, up to [`POOL_BYTES`] in the pool.
    fn give(&mut self, buf: Buf) {
        match buf {
            Buf::Node(r, _) => {
                let class = r.len();
                if self.bytes + class as u64 <= POOL_BYTES {
                    self.bytes += class as u64;
                    self.free.entry(class).or_default().push(r);
                }
            }
            // A view of a read buffer: the reader reuses that buffer once no view holds it.
            Buf::Shared { .. } => {}
            Buf::Heap(mut v) => {
                let class = v.capacity();
                if class.is_power_of_two() && class >= MIN_BUFFER && self.bytes + class as u64 <= POOL_BYTES {
                    // Back to its full length: zeroes only where it was shorter.
                    v.resize(class, 0);
                    self.bytes += class as u64;
                    self.heap.entry(class).or_default().push(v);
                }
            }
        }
    }
}

/// A whole request read from the socket: its header and its payload (a write's data).
#[derive(Debug)]
pub(crate) enum Raw {
    /// The request, its payload, and how many of the payload's bytes were copied from the
    /// read buffer.
    Request(codec::Request, Buf, u64),
    /// NBD_CMD_DISC: the client is leaving.
    Disc,
}

/// Read buffers a connection's request stream keeps for reuse while writes still hold views of
/// them (each is [`REQUEST_BUFFER`] bytes); one more retired while all are held lets the oldest
/// go (freed when its last write completes).
const RETIRED_BUFFERS: usize = 16;

/// The request stream of a connection: a read buffer, and the write whose payload is still
/// arriving. Read by the engine thread (inline send mode) or by the connection's reader thread
/// (queue send mode, see [`reader_thread`]).
///
/// A write whose payload the read buffer holds whole is handed on as a view of it
/// ([`Buf::Shared`]): the payload is not copied in user space before the engine copies it into
/// the frames. When the buffer must take more bytes while views of it are alive, it is retired
/// and a free one (a retired buffer no view holds any more, or a new one) takes its place, with
/// the few bytes of a request header not yet whole. Only a payload that was partly read is
/// copied: the part the buffer holds goes into the payload's own buffer, and the rest comes
/// straight from the socket.
#[derive(Debug)]
pub(crate) struct Reader {
    stream: Arc<UnixStream>,
    extended: bool,
    inbuf: Arc<Buf>,
    /// Earlier read buffers that writes may still hold views of, oldest first.
    retired: VecDeque<Arc<Buf>>,
    start: usize,
    end: usize,
    partial: Option<Partial>,
}

impl Reader {
    fn new(stream: Arc<UnixStream>, extended: bool) -> Self {
        let inbuf = Arc::new(Buf::Heap(vec![0; REQUEST_BUFFER]));
        Reader { stream, extended, inbuf, retired: VecDeque::new(), start: 0, end: 0, partial: None }
    }

    /// Moves the unparsed bytes to the front of a read buffer nothing else holds: this one, or
    /// (while writes hold views of it) a free retired one or a new one from `alloc`.
    fn make_room(&mut self, alloc: &mut dyn FnMut(usize) -> Buf) {
        let (start, end) = (self.start, self.end);
        if let Some(b) = Arc::get_mut(&mut self.inbuf) {
            b.as_mut_slice().copy_within(start..end, 0);
        } else {
            let free = self.retired.iter().position(|b| Arc::strong_count(b) == 1);
            let mut next = match free.and_then(|i| self.retired.remove(i)) {
                Some(b) => b,
                None => Arc::new(alloc(REQUEST_BUFFER)),
            };
            let fresh = Arc::get_mut(&mut next).expect("a free or new read buffer is held by nothing else");
            fresh.as_mut_slice()[..end - start].copy_from_slice(&self.inbuf.as_slice()[start..end]);
            let old = std::mem::replace(&mut self.inbuf, next);
            if self.retired.len() == RETIRED_BUFFERS {
                self.retired.pop_front();
            }
            self.retired.push_back(old);
        }
        self.end -= start;
        self.start = 0;
    }

    /// The next whole request, `Ok(None)` when the socket has nothing more now (it does not
    /// block), `Err(UnexpectedEof)` when the client closed its end between requests. A write's
    /// payload goes into a buffer from `alloc`.
    pub(crate) fn next(&mut self, alloc: &mut dyn FnMut(usize) -> Buf) -> io::Result<Option<Raw>> {
        loop {
            if let Some(p) = &mut self.partial {
                // Payload already buffered, then straight from the socket into the request's
                // buffer.
                let data = p.data.as_mut_slice();
                let buffered = (self.end - self.start).min(data.len() - p.filled);
                data[p.filled..p.filled + buffered]
                    .copy_from_slice(&self.inbuf.as_slice()[self.start..self.start + buffered]);
                p.filled += buffered;
                p.copied += buffered as u64;
                self.start += buffered;
                while p.filled < data.len() {
                    match self.stream.as_ref().read(&mut data[p.filled..]) {
                        Ok(0) => {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "closed in the middle of a write's data",
                            ))
                        }
                        Ok(n) => p.filled += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                let p = self.partial.take().expect("partial");
                return Ok(Some(Raw::Request(p.req, p.data, p.copied)));
            }
            let header_len = codec::request_len(self.extended);
            if self.end - self.start < header_len {
                self.make_room(alloc);
                let inbuf = Arc::get_mut(&mut self.inbuf).expect("make_room leaves the read buffer to the reader");
                loop {
                    match self.stream.as_ref().read(&mut inbuf.as_mut_slice()[self.end..]) {
                        // The client went away: between requests that is no error.
                        Ok(0) if self.end == 0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                        Ok(0) => {
                            return Err(io::Error::new(io::ErrorKind::InvalidData, "closed in the middle of a request"))
                        }
                        Ok(n) => {
                            self.end += n;
                            break;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                if self.end - self.start < header_len {
                    continue;
                }
            }
            let req = codec::parse_request(&self.inbuf.as_slice()[self.start..self.end], self.extended)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            self.start += header_len;
            if req.command == cmd::DISC {
                return Ok(Some(Raw::Disc));
            }
            match codec::check_payload(&req, self.extended)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?
            {
                Some(n) if n <= (self.end - self.start) as u64 => {
                    // The whole payload is here: a view of the read buffer, no copy.
                    let (at, len) = (self.start, n as usize);
                    self.start += len;
                    return Ok(Some(Raw::Request(req, Buf::Shared { buf: Arc::clone(&self.inbuf), at, len }, 0)));
                }
                Some(n) => {
                    let data = alloc(n as usize);
                    self.partial = Some(Partial { req, data, filled: 0, copied: 0 });
                }
                None => return Ok(Some(Raw::Request(req, Buf::Heap(Vec::new()), 0))),
            }
        }
    }
}

/// Requests a queue-mode connection's reader thread may have waiting for the engine thread.
pub(crate) const HANDOFF_DEPTH: usize = 256;
/// Bytes of write payloads a queue-mode connection's reader thread may have waiting for the
/// engine thread (a request larger than the rest of it waits until the queue is empty).
pub(crate) const HANDOFF_BYTES: u64 = 64 << 20;
/// Longest a reader thread waits in `poll` before it looks whether its connection is over.
const READER_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// What a reader thread hands the engine thread.
#[derive(Debug)]
pub(crate) enum Handed {
    Raw(Raw),
    /// The client closed its end (`Ok`) or the stream failed.
    End(io::Result<()>),
}

#[derive(Debug, Default)]
struct HandOffState {
    items: VecDeque<(Handed, u64)>,
    bytes: u64,
    /// The engine let go of the connection: the reader thread stops.
    closed: bool,
}

/// The bounded queue (at most [`HANDOFF_DEPTH`] requests and [`HANDOFF_BYTES`] of payload)
/// from a queue-mode connection's reader thread to its engine thread. The reader blocks while
/// it is full; the engine never blocks on it.
#[derive(Debug, Default)]
pub(crate) struct HandOff {
    state: std::sync::Mutex<HandOffState>,
    room: std::sync::Condvar,
}

impl HandOff {
    fn lock(&self) -> std::sync::MutexGuard<'_, HandOffState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `item` of `bytes` payload bytes, waiting for room; `false` once closed.
    fn push(&self, item: Handed, bytes: u64) -> bool {
        let mut st = self.lock();
        while !st.closed
            && !st.items.is_empty()
            && (st.items.len() >= HANDOFF_DEPTH || st.bytes + bytes > HANDOFF_BYTES)
        {
            st = self.room.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        if st.closed {
            return false;
        }
        st.bytes += bytes;
        st.items.push_back((item, bytes));
        true
    }

    /// The oldest item, without waiting.
    fn pop(&self) -> Option<Handed> {
        let mut st = self.lock();
        let (item, bytes) = st.items.pop_front()?;
        st.bytes -= bytes;
        self.room.notify_all();
        Some(item)
    }

    fn is_empty(&self) -> bool {
        self.lock().items.is_empty()
    }

    fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The engine let go: the reader thread stops (what is queued is dropped).
    fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.items.clear();
        st.bytes = 0;
        self.room.notify_all();
    }
}

/// Queue send mode: reads `reader`'s requests (blocking in `poll`, not in the engine's loop)
/// and hands them to the engine thread over `handoff`, ringing `bell` after each. Returns when
/// the client leaves, the stream fails, or the engine lets go of the connection.
fn reader_thread(mut reader: Reader, handoff: Arc<HandOff>, bell: Arc<Bell>) {
    use std::os::fd::AsFd;
    loop {
        if handoff.is_closed() {
            return;
        }
        // The reader's own buffers (its thread runs on the connection's node).
        let got = reader.next(&mut |n| Buf::Heap(vec![0; n]));
        let (item, bytes, end) = match got {
            Ok(Some(Raw::Request(req, data, copied))) => {
                let n = data.len() as u64;
                (Handed::Raw(Raw::Request(req, data, copied)), n, false)
            }
            Ok(Some(Raw::Disc)) => (Handed::Raw(Raw::Disc), 0, true),
            Ok(None) => {
                let mut fds = [nix::poll::PollFd::new(reader.stream.as_fd(), nix::poll::PollFlags::POLLIN)];
                let wait = nix::sys::time::TimeSpec::from_duration(READER_POLL);
                let _ = nix::poll::ppoll(&mut fds, Some(wait), None);
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => (Handed::End(Ok(())), 0, true),
            Err(e) => (Handed::End(Err(e)), 0, true),
        };
        if !handoff.push(item, bytes) {
            return;
        }
        bell.ring();
        if end {
            return;
        }
    }
}

/// An NBD connection in transmission, served by an engine thread.
#[derive(Debug)]
pub(crate) struct DirectConn {
    /// The stats key of the connection (unique per server).
    pub(crate) id: u64,
    stream: Arc<UnixStream>,
    size: u64,
    /// What requests are checked against.
    rules: codec::Rules,
    neg: Negotiated,
    node: Option<u32>,
    stats: NbdStats,
    max_inflight: usize,
    /// Reads of at least this many bytes are hole-aware (see [`super::HOLE_READ_MIN`]).
    hole_read_min: Option<u64>,
    /// Cleared when the target says it cannot tell holes from data.
    probe: super::HoleProbe,
    /// Volume requests that completions started (a hole-aware read's data pieces, a TRIM's
    /// FLUSH), handed to the engine by the next [`Front::receive`].
    followups: Vec<NbdIo>,
    /// The replies of the requests in the engine.
    tokens: Tokens,
    /// Hole-aware reads with data pieces in flight, by key.
    splits: HashMap<u64, SplitState>,
    next_split: u64,
    /// Inline send mode: the request stream, read by the engine thread.
    reader: Option<Reader>,
    /// Queue send mode: requests the connection's reader thread read.
    handoff: Option<Arc<HandOff>>,
    out: VecDeque<Reply>,
    pool: Pool,
    /// Bytes of `out`'s first reply (header and data together) already written.
    out_off: usize,
    inflight: usize,
    held: u64,
    seq: u64,
    /// The client sent DISC or closed its end.
    eof: bool,
    /// The connection failed (bad request, socket error); replies are dropped.
    error: Option<io::Error>,
    done: Option<oneshot::Sender<io::Result<()>>>,
}

/// What a connection in transmission serves, what its handshake settled, and its limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnSpec {
    /// The export's size, bytes.
    pub size: u64,
    /// Writes, trims and zeroes are refused.
    pub read_only: bool,
    /// NBD_CMD_TRIM is offered.
    pub discard: bool,
    /// What the handshake settled.
    pub neg: Negotiated,
    /// Requests read ahead of their replies, at most (at least 1).
    pub max_inflight: usize,
    /// Reads of this many bytes or more are hole-aware (`--hole-read-min`).
    pub hole_read_min: Option<u64>,
}

impl DirectConn {
    /// Connection `id` on `stream` (any blocking mode; it is made non-blocking), serving as
    /// `spec` says, its report in `stats`, its buffers on `node`. `done` learns how it ended.
    pub(crate) fn new(
        stream: UnixStream,
        id: u64,
        spec: ConnSpec,
        node: Option<u32>,
        stats: NbdStats,
        done: oneshot::Sender<io::Result<()>>,
    ) -> io::Result<Self> {
        let ConnSpec { size, read_only, discard, neg, max_inflight, hole_read_min } = spec;
        stream.set_nonblocking(true)?;
        let stream = Arc::new(stream);
        Ok(DirectConn {
            id,
            reader: Some(Reader::new(Arc::clone(&stream), neg.extended)),
            handoff: None,
            stream,
            size,
            rules: super::rules(size, read_only, discard, neg),
            neg,
            node,
            stats,
            max_inflight: max_inflight.max(1),
            hole_read_min,
            probe: super::HoleProbe::default(),
            followups: Vec::new(),
            tokens: Tokens::default(),
            splits: HashMap::new(),
            next_split: 0,
            out: VecDeque::new(),
            pool: Pool::default(),
            out_off: 0,
            inflight: 0,
            held: 0,
            seq: 0,
            eof: false,
            error: None,
            done: Some(done),
        })
    }

    /// Whether more requests may be read now.
    pub(crate) fn wants_read(&self) -> bool {
        !self.eof && self.error.is_none() && self.inflight < self.max_inflight && self.held < HELD_BYTES
    }

    /// Requests in flight and data bytes held.
    pub(crate) fn load(&self) -> (usize, u64) {
        (self.inflight, self.held)
    }

    /// Whether replies wait to be written, or follow-up requests to be handed out: either way
    /// the engine must not sleep on this socket (it is writable, so a poll for writing returns at
    /// once and the next turn collects the follow-ups).
    pub(crate) fn wants_write(&self) -> bool {
        self.error.is_none() && (!self.out.is_empty() || !self.followups.is_empty())
    }

    /// Queue send mode: from now on a reader thread reads the request stream; returns what it
    /// needs (the stream, and the queue it hands requests over). `None` if already done.
    fn hand_off_reading(&mut self) -> Option<(Reader, Arc<HandOff>)> {
        let reader = self.reader.take()?;
        let handoff = Arc::new(HandOff::default());
        self.handoff = Some(Arc::clone(&handoff));
        Some((reader, handoff))
    }

    /// A request for the engine: counted in flight, its reply kept under the token it gets.
    fn issue(&mut self, io: NbdIo) -> FrontIo {
        self.inflight += 1;
        self.held += io.reply.held;
        let NbdIo { op, fua, offset, length, data, reply } = io;
        FrontIo { op, fua, offset, length, data, token: self.tokens.insert(reply) }
    }

    /// Reads what the socket has (inline send mode) or what the reader thread handed over
    /// (queue send mode) and parses requests, up to the connection's limits. Requests that need
    /// the volume go to `out` (follow-ups first); the others (refused ones, empty ranges,
    /// CACHE) are answered at once.
    fn poll_requests(&mut self, out: &mut Vec<FrontIo>) {
        if self.error.is_some() {
            self.followups.clear();
        }
        let mut followups = std::mem::take(&mut self.followups);
        for io in followups.drain(..) {
            out.push(self.issue(io));
        }
        // Kept for its capacity.
        self.followups = followups;
        if let Some(handoff) = self.handoff.clone() {
            while self.wants_read() {
                match handoff.pop() {
                    None => break,
                    Some(Handed::Raw(Raw::Request(req, data, copied))) => {
                        self.stats.add_copied(self.id, copied, true);
                        if let Some(io) = self.request(req, data) {
                            out.push(self.issue(io));
                        }
                    }
                    Some(Handed::Raw(Raw::Disc)) | Some(Handed::End(Ok(()))) => self.eof = true,
                    Some(Handed::End(Err(e))) => self.error = Some(e),
                }
            }
            return;
        }
        while self.wants_read() {
            match self.next_request() {
                Ok(Some(io)) => {
                    if let Some(io) = io {
                        out.push(self.issue(io));
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    if e.kind() == io::ErrorKind::UnexpectedEof {
                        self.eof = true;
                    } else {
                        self.error = Some(e);
                    }
                    break;
                }
            }
        }
    }

    /// One step of the parser: `Ok(None)` when the socket has nothing more now,
    /// `Ok(Some(None))` when a request was answered without the volume.
    fn next_request(&mut self) -> io::Result<Option<Option<NbdIo>>> {
        let DirectConn { reader, pool, node, .. } = self;
        let Some(reader) = reader.as_mut() else { return Ok(None) };
        let node = *node;
        match reader.next(&mut |n| pool.take(n, node))? {
            None => Ok(None),
            Some(Raw::Disc) => {
                self.eof = true;
                Ok(Some(None))
            }
            Some(Raw::Request(req, data, copied)) => {
                self.stats.add_copied(self.id, copied, true);
                Ok(Some(self.request(req, data)))
            }
        }
    }

    /// Turns a whole request into a volume request, or answers it.
    fn request(&mut self, req: codec::Request, data: Buf) -> Option<NbdIo> {
        let (off, len) = (req.offset, req.length);
        let fua = req.flags & cflag::FUA != 0;
        let seq = self.seq;
        self.seq += 1;
        let sample = self.node.is_some() && (seq < 64 || seq % BUFFER_SAMPLE == 0);
        let mut reply = NbdReply {
            req,
            status_start: 0,
            status_len: 0,
            probe: false,
            split: None,
            trim: None,
            then_flush: false,
            sample,
            held: 0,
            written: 0,
        };
        let io = |op, offset, length, data: Buf, reply| NbdIo { op, fua, offset, length, data, reply };
        let none = || Buf::Heap(Vec::new());
        let action = match codec::check_request(&req, &self.rules) {
            Ok(a) => a,
            Err(e) => {
                // A payload the request should not have carried goes back to the pool.
                self.pool.give(data);
                self.answer(&req, e);
                return None;
            }
        };
        let io = match action {
            Action::Done => {
                self.pool.give(data);
                self.answer(&req, 0);
                return None;
            }
            Action::Flush => io(Op::Flush, 0, 0, none(), reply),
            Action::BlockStatus => {
                let Some((start, length)) = status_query(off, len, self.size) else {
                    let (header, data) = block_status_reply(
                        self.neg.extended,
                        &req,
                        off,
                        Err(Error::Target(tyche_wire::Status::Unsupported)),
                    );
                    self.out.push_back(Reply { header, data: Buf::Heap(data) });
                    return None;
                };
                self.status_io(reply, start, length)
            }
            Action::Read if hole_aware(&req, self.neg, self.hole_read_min, &self.probe) => {
                match status_query(off, len, self.size) {
                    // Which parts are holes first; the data pieces follow (see `complete`).
                    Some((start, length)) => self.status_io(NbdReply { probe: true, ..reply }, start, length),
                    None => self.read_io(reply, off, len, None),
                }
            }
            Action::Read => self.read_io(reply, off, len, None),
            Action::Write => {
                if sample {
                    self.count_pages(data.as_slice());
                }
                reply.held = len;
                reply.written = len;
                io(Op::Write, off, len, data, reply)
            }
            Action::Trim { start, length, flush } => {
                reply.then_flush = flush;
                NbdIo { op: Op::Discard, fua: false, offset: start, length, data: none(), reply }
            }
            Action::WriteZeroes => io(Op::WriteZeroes, off, len, none(), reply),
        };
        Some(io)
    }

    /// A BLOCK_STATUS of `length` bytes at `start` for the volume (a list buffer with it).
    fn status_io(&mut self, mut reply: NbdReply, start: u64, length: u64) -> NbdIo {
        reply.status_start = start;
        reply.status_len = length;
        reply.held = tyche_wire::layout::block_status::LEN as u64;
        let list = self.pool.take(tyche_wire::layout::block_status::LEN, None);
        NbdIo { op: Op::BlockStatus, fua: false, offset: start, length, data: list, reply }
    }

    /// A READ for the volume of the sectors covering `len` bytes at `off` (unaligned reads read
    /// the covering sectors and return the part asked); `split`: one piece of a hole-aware read.
    fn read_io(&mut self, mut reply: NbdReply, off: u64, len: u64, split: Option<Split>) -> NbdIo {
        let start = off / SECTOR * SECTOR;
        let end = (off + len).next_multiple_of(SECTOR);
        reply.trim = (start != off || end != off + len).then_some(((off - start) as usize, len as usize));
        reply.held = end - start;
        reply.probe = false;
        reply.split = split;
        // On the connection's node, whichever thread later receives the data.
        let buf = self.pool.take((end - start) as usize, self.node);
        NbdIo { op: Op::Read, fua: false, offset: start, length: end - start, data: buf, reply }
    }

    /// Queues a reply without data for a request that never reached the volume.
    fn answer(&mut self, req: &codec::Request, error: u32) {
        self.out.push_back(Reply { header: reply_head(self.neg, req, error, 0), data: Buf::Heap(Vec::new()) });
    }

    /// Queues a reply (unless the connection failed: nothing more is written then).
    fn push(&mut self, header: Head, data: Buf) {
        if self.error.is_none() {
            self.out.push_back(Reply { header, data });
        } else {
            self.pool.give(data);
        }
    }

    /// The block status of a hole-aware READ came back: hole chunks for its holes at once, and
    /// follow-up reads for its data pieces (or, when it is all data or the target could not
    /// tell, one read of the whole range, answered as usual).
    fn after_probe(&mut self, reply: NbdReply, answer: Result<Vec<tyche_wire::Extent>, Error>) {
        let req = reply.req;
        let plan = match answer {
            Ok(extents) => read_plan(req.offset, req.length, reply.status_start, &extents),
            Err(Error::Target(tyche_wire::Status::Unsupported)) => {
                self.probe.unsupported();
                Vec::new()
            }
            // Block status only spares zeroes: on any other failure, read it all.
            Err(_) => Vec::new(),
        };
        if !plan.is_empty() {
            self.probe.found(plan.iter().any(|p| matches!(p, Piece::Hole(..))));
        }
        let base = NbdReply { probe: false, status_start: 0, status_len: 0, ..reply };
        if self.error.is_some() {
            return;
        }
        if plan.len() <= 1 && !matches!(plan.first(), Some(Piece::Hole(..))) {
            let io = self.read_io(base, req.offset, req.length, None);
            self.followups.push(io);
            return;
        }
        let key = self.next_split;
        self.next_split += 1;
        let data = plan.iter().filter(|p| matches!(p, Piece::Data(..))).count();
        let mut holes = plan.len() - data;
        for piece in plan {
            match piece {
                Piece::Hole(off, n) => {
                    holes -= 1;
                    let done = data == 0 && holes == 0;
                    self.push(Head::hole(self.neg.extended, &req, off, n as u32, done), Buf::Heap(Vec::new()));
                }
                Piece::Data(off, n) => {
                    let io = self.read_io(base, off, n, Some(Split { key, offset: off }));
                    self.followups.push(io);
                }
            }
        }
        if data > 0 {
            self.splits.insert(key, SplitState { left: data, failed: false });
        }
    }

    /// A data piece of a hole-aware READ completed: its OFFSET_DATA chunk (the read's last piece
    /// flagged DONE), or on the first failure one ERROR chunk; after a failure only the final
    /// NONE.
    fn complete_piece(&mut self, reply: NbdReply, split: Split, result: Outcome) {
        let ext = self.neg.extended;
        let Some(state) = self.splits.get_mut(&split.key) else {
            if let Ok((_, data)) = result {
                self.pool.give(data);
            }
            return;
        };
        state.left -= 1;
        let done = state.left == 0;
        let failed = state.failed;
        if done {
            self.splits.remove(&split.key);
        }
        match result {
            Ok((_, data)) if !failed => {
                let data = match reply.trim {
                    Some((at, len)) => {
                        let part = data.as_slice()[at..at + len].to_vec();
                        self.stats.add_copied(self.id, len as u64, false);
                        self.pool.give(data);
                        Buf::Heap(part)
                    }
                    None => data,
                };
                let read = data.len() as u64;
                self.stats.update(self.id, |r| r.bytes_read += read);
                self.push(Head::read_data(ext, &reply.req, split.offset, data.len(), done), data);
            }
            Ok((_, data)) => {
                self.pool.give(data);
                if done {
                    self.push(Head::none(ext, &reply.req), Buf::Heap(Vec::new()));
                }
            }
            Err(e) if !failed => {
                if let Some(s) = self.splits.get_mut(&split.key) {
                    s.failed = true;
                }
                self.push(Head::error(ext, &reply.req, errno::from_errno(e.errno()), done), Buf::Heap(Vec::new()));
            }
            Err(_) => {
                if done {
                    self.push(Head::none(ext, &reply.req), Buf::Heap(Vec::new()));
                }
            }
        }
    }

    /// The volume completed the request of `token`.
    fn complete_token(&mut self, token: Token, result: Outcome) {
        match self.tokens.take(token) {
            Some(reply) => self.complete(reply, result),
            // Not one of this connection's (an engine bug): its buffer goes back to the pool.
            None => {
                if let Ok((_, data)) = result {
                    self.pool.give(data);
                }
            }
        }
    }

    /// Queues the reply of a request the volume completed (a read's data with it).
    fn complete(&mut self, reply: NbdReply, result: Outcome) {
        self.inflight = self.inflight.saturating_sub(1);
        self.held = self.held.saturating_sub(reply.held);
        if reply.then_flush && result.is_ok() {
            // TRIM with FUA: the discard is done; the flush follows, then the reply (unless the
            // connection failed: nothing more is written then).
            if self.error.is_none() {
                let reply = NbdReply { then_flush: false, held: 0, ..reply };
                let none = Buf::Heap(Vec::new());
                self.followups.push(NbdIo { op: Op::Flush, fua: false, offset: 0, length: 0, data: none, reply });
            }
            return;
        }
        if let Some(split) = reply.split {
            self.complete_piece(reply, split, result);
            return;
        }
        if reply.req.command == cmd::BLOCK_STATUS || reply.probe {
            let answer = match result {
                Ok((_, list)) => {
                    // The list answers the range asked of the volume.
                    let parsed = crate::client::parse_block_status(list.as_slice(), reply.status_len);
                    self.pool.give(list);
                    parsed
                }
                Err(e) => Err(e),
            };
            if reply.probe {
                self.after_probe(reply, answer);
                return;
            }
            let (header, data) = block_status_reply(self.neg.extended, &reply.req, reply.status_start, answer);
            self.push(header, Buf::Heap(data));
            return;
        }
        let (error, data) = match result {
            Ok((Op::Read, data)) => match reply.trim {
                Some((at, len)) => {
                    let part = data.as_slice()[at..at + len].to_vec();
                    self.stats.add_copied(self.id, len as u64, false);
                    self.pool.give(data);
                    (0, Buf::Heap(part))
                }
                None => (0, data),
            },
            Ok((_, data)) => {
                // A write's buffer goes back to the pool.
                self.pool.give(data);
                (0, Buf::Heap(Vec::new()))
            }
            Err(e) => (errno::from_errno(e.errno()), Buf::Heap(Vec::new())),
        };
        if error == 0 {
            if reply.sample && !data.is_empty() {
                self.count_pages(data.as_slice());
            }
            let (read, written) = (data.len() as u64, reply.written);
            if read > 0 || written > 0 {
                self.stats.update(self.id, |r| {
                    r.bytes_read += read;
                    r.bytes_written += written;
                });
            }
        }
        if self.error.is_none() {
            let header = reply_head(self.neg, &reply.req, error, data.len());
            self.out.push_back(Reply { header, data });
        }
    }

    /// Adds where `buf`'s pages are to the connection's counters.
    fn count_pages(&self, buf: &[u8]) {
        let node = self.node;
        if let Some(p) = tyche_numa::report::count_slice(buf, node).ok().filter(|p| p.pages > 0) {
            self.stats.update(self.id, |r| {
                if r.buffers.pages == 0 {
                    r.buffers.expected_node = node;
                }
                r.buffers.add(&p);
            });
        }
    }

    /// Writes queued replies (gathered: headers and payloads from their own buffers) until the
    /// socket would block. Returns whether anything was written.
    fn write_replies(&mut self) -> bool {
        let mut wrote = false;
        while self.error.is_none() && !self.out.is_empty() {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * REPLY_BATCH.min(self.out.len()));
            let mut skip = self.out_off;
            for r in self.out.iter().take(REPLY_BATCH) {
                for part in [r.header.as_slice(), r.data.as_slice()] {
                    if skip >= part.len() {
                        skip -= part.len();
                    } else {
                        slices.push(IoSlice::new(&part[skip..]));
                        skip = 0;
                    }
                }
            }
            let mut n = match self.stream.as_ref().write_vectored(&slices) {
                Ok(0) => {
                    self.error = Some(io::ErrorKind::WriteZero.into());
                    break;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.error = Some(e);
                    break;
                }
            };
            wrote = true;
            while n > 0 {
                let first = self.out.front().expect("written bytes belong to a reply");
                let left = first.header.as_slice().len() + first.data.len() - self.out_off;
                if n >= left {
                    n -= left;
                    let done = self.out.pop_front().expect("front");
                    self.pool.give(done.data);
                    self.out_off = 0;
                } else {
                    self.out_off += n;
                    n = 0;
                }
            }
        }
        wrote
    }

    /// Ends the connection: shuts the socket down and tells the waiting task how it went.
    fn shut(mut self, closed: bool) {
        if let Some(h) = &self.handoff {
            h.close();
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let result = match self.error.take() {
            Some(e) => Err(e),
            None if closed && !self.eof => Err(io::Error::other("the session was closed")),
            None => Ok(()),
        };
        if let Some(done) = self.done.take() {
            let _ = done.send(result);
        }
    }
}

impl Front for DirectConn {
    fn key(&self) -> u64 {
        self.id
    }

    fn node(&self) -> Option<u32> {
        self.node
    }

    /// In queue send mode, a reader thread (`tyche-nbdqN`) reads the request stream from now on.
    fn start(&mut self, mode: SendMode, bell: &Arc<Bell>) -> io::Result<()> {
        if mode == SendMode::Queue {
            if let Some((reader, handoff)) = self.hand_off_reading() {
                let bell = Arc::clone(bell);
                std::thread::Builder::new()
                    .name(format!("tyche-nbdq{}", self.id))
                    .spawn(move || reader_thread(reader, handoff, bell))?;
            }
        }
        Ok(())
    }

    fn queued(&self) -> bool {
        self.handoff.is_some()
    }

    /// Records the engine thread that serves the connection in its report.
    fn placed(&self, thread: Option<tyche_numa::report::ThreadPlacement>) {
        if let Some(t) = thread {
            self.stats.update(self.id, |r| r.thread = t);
        }
    }

    fn receive(&mut self, out: &mut Vec<FrontIo>) {
        self.poll_requests(out);
    }

    fn complete(&mut self, token: Token, outcome: Outcome) {
        self.complete_token(token, outcome);
    }

    fn send(&mut self) -> bool {
        self.write_replies()
    }

    fn handed_waiting(&self) -> bool {
        self.wants_read() && self.handoff.as_ref().is_some_and(|h| !h.is_empty())
    }

    /// The socket: readable when more requests may be read and no reader thread reads it (that
    /// one rings), writable while replies or follow-ups wait.
    fn wait_for(&self) -> Option<(WaitFd, nix::poll::PollFlags)> {
        use nix::poll::PollFlags;
        let mut f = PollFlags::empty();
        if self.wants_read() && self.handoff.is_none() {
            f |= PollFlags::POLLIN;
        }
        if self.wants_write() {
            f |= PollFlags::POLLOUT;
        }
        (!f.is_empty()).then(|| (Arc::clone(&self.stream) as WaitFd, f))
    }

    /// The client left (or it failed), nothing is in flight or waiting to be, and every reply is
    /// out.
    fn finished(&self) -> bool {
        (self.eof || self.error.is_some())
            && self.inflight == 0
            && ((self.out.is_empty() && self.followups.is_empty()) || self.error.is_some())
    }

    fn close(self: Box<Self>, session_closed: bool) {
        (*self).shut(session_closed);
    }
}

impl Drop for DirectConn {
    fn drop(&mut self) {
        // However the connection goes, its reader thread (queue send mode) stops.
        if let Some(h) = &self.handoff {
            h.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoff_is_bounded_by_requests_and_bytes_and_close_frees_the_reader() {
        let h = Arc::new(HandOff::default());
        let req = |n| {
            Handed::Raw(Raw::Request(
                codec::Request { flags: 0, command: cmd::READ, cookie: 0, offset: 0, length: 0 },
                Buf::Heap(vec![0; n]),
                0,
            ))
        };
        for _ in 0..HANDOFF_DEPTH {
            assert!(h.push(req(0), 0));
        }
        // Full by count: the next push waits until the engine takes one.
        let (h2, t0) = (Arc::clone(&h), std::time::Instant::now());
        let pusher = std::thread::spawn(move || h2.push(req(0), 0));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!pusher.is_finished(), "a push into a full hand-off waits");
        assert!(h.pop().is_some());
        assert!(pusher.join().unwrap(), "room made: the push went through");
        assert!(t0.elapsed() >= std::time::Duration::from_millis(50));
        while h.pop().is_some() {}
        // By bytes: one request over the rest waits too, but never alone in an empty queue.
        assert!(h.push(req(0), HANDOFF_BYTES - 10));
        let h2 = Arc::clone(&h);
        let pusher = std::thread::spawn(move || h2.push(req(0), 100));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!pusher.is_finished(), "over the byte limit: waits");
        // The engine lets go: the waiting reader is told to stop, and later pushes fail.
        h.close();
        assert!(!pusher.join().unwrap());
        assert!(!h.push(req(0), 0) && h.is_empty() && h.is_closed());
    }

    /// Reads every whole request `reader` has now: (cookie, data, bytes copied); `allocs`
    /// counts the buffers asked for.
    fn read_all(reader: &mut Reader, allocs: &mut usize) -> Vec<(u64, Buf, u64)> {
        let mut got = Vec::new();
        while let Some(raw) = reader
            .next(&mut |n| {
                *allocs += 1;
                Buf::Heap(vec![0; n])
            })
            .unwrap()
        {
            match raw {
                Raw::Request(req, data, copied) => got.push((req.cookie, data, copied)),
                Raw::Disc => panic!("no DISC was sent"),
            }
        }
        got
    }

    #[test]
    fn whole_write_payloads_are_views_of_the_read_buffer_and_only_split_ones_are_copied() {
        let (client, server) = UnixStream::pair().unwrap();
        server.set_nonblocking(true).unwrap();
        let mut reader = Reader::new(Arc::new(server), false);
        // 20 writes of 4 KiB with their headers: more than one read buffer of 64 KiB.
        let send = |first: u64| {
            let mut bytes = Vec::new();
            for c in first..first + 20 {
                bytes.extend_from_slice(&codec::REQUEST_MAGIC.to_be_bytes());
                bytes.extend_from_slice(&0u16.to_be_bytes());
                bytes.extend_from_slice(&cmd::WRITE.to_be_bytes());
                bytes.extend_from_slice(&c.to_be_bytes());
                bytes.extend_from_slice(&(c * 4096).to_be_bytes());
                bytes.extend_from_slice(&4096u32.to_be_bytes());
                bytes.extend(std::iter::repeat_n(c as u8, 4096));
            }
            (&client).write_all(&bytes).unwrap();
        };
        let check = |got: &[(u64, Buf, u64)], first: u64| {
            assert_eq!(got.len(), 20);
            for (i, (cookie, data, copied)) in got.iter().enumerate() {
                assert_eq!(*cookie, first + i as u64);
                assert_eq!(data.len(), 4096);
                assert!(data.as_slice().iter().all(|&b| b == *cookie as u8), "payload of write {cookie}");
                // A view copies nothing; a payload split by the end of a read copies only what
                // was read with the requests before it.
                match data {
                    Buf::Shared { .. } => assert_eq!(*copied, 0),
                    _ => assert!(*copied < 4096),
                }
            }
            got.iter().filter(|(_, d, _)| !matches!(d, Buf::Shared { .. })).count()
        };
        let mut allocs = 0;
        send(0);
        let first = read_all(&mut reader, &mut allocs);
        let split = check(&first, 0);
        assert!(split <= 2, "{split} of 20 payloads copied");
        drop(first);
        // The views are gone: the retired read buffer is reused, so the only buffers asked for
        // are the split payloads'.
        let before = allocs;
        send(20);
        let second = read_all(&mut reader, &mut allocs);
        let split = check(&second, 20);
        assert_eq!(allocs - before, split, "no new read buffer while a retired one is free");
    }

    #[test]
    fn pool_reuses_node_buffers_by_size_class_up_to_its_cap() {
        let mut pool = Pool::default();
        // No node: heap buffers, pooled too.
        let b = pool.take(4000, None);
        assert!(matches!(&b, Buf::Heap(v) if v.len() == 4000 && v.capacity() == 4096));
        let addr = b.as_slice().as_ptr();
        pool.give(b);
        assert_eq!(pool.bytes, 4096);
        let b = pool.take(4096, None);
        assert_eq!((b.as_slice().as_ptr(), b.len()), (addr, 4096));
        assert_eq!(pool.bytes, 0);
        drop(b);
        let b = pool.take(3000, Some(0));
        let Buf::Node(r, len) = &b else {
            tyche_testkit::cannot_run(
                "pool_reuses_node_buffers_by_size_class_up_to_its_cap",
                "mbind refused node-bound memory",
            );
            return;
        };
        assert_eq!((r.len(), *len, b.as_slice().len()), (4096, 3000, 3000));
        let addr = b.as_slice().as_ptr();
        pool.give(b);
        assert_eq!(pool.bytes, 4096);
        // The same class comes back, a larger one is new.
        let again = pool.take(4096, Some(0));
        assert_eq!(again.as_slice().as_ptr(), addr);
        assert_eq!(pool.bytes, 0);
        let big = pool.take(5000, Some(0));
        assert!(matches!(&big, Buf::Node(r, 5000) if r.len() == 8192));
        pool.give(again);
        pool.give(big);
        assert_eq!(pool.bytes, 4096 + 8192);
        // Never more than POOL_BYTES idle.
        let many: Vec<Buf> = (0..(POOL_BYTES / (1 << 20)) + 2).map(|_| pool.take(1 << 20, Some(0))).collect();
        for b in many {
            pool.give(b);
        }
        assert!(pool.bytes <= POOL_BYTES, "{} idle bytes", pool.bytes);
    }
}
