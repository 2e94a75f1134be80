//! An NBD server on a Unix socket, backed by a [`Client`].
//!
//! Fixed newstyle handshake (NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_EXPORT_NAME, NBD_OPT_LIST,
//! NBD_OPT_ABORT, NBD_OPT_STRUCTURED_REPLY, NBD_OPT_EXTENDED_HEADERS, NBD_OPT_LIST_META_CONTEXT
//! and NBD_OPT_SET_META_CONTEXT with the one context `base:allocation`; everything else is
//! answered NBD_REP_ERR_UNSUP), simple, structured or extended replies, compact or extended
//! (64-bit) requests, and the commands READ (hole-aware from [`HOLE_READ_MIN`]: holes answered as
//! hole chunks, see [`read_plan`]; one chunk with DF), WRITE (with FUA), FLUSH, TRIM, WRITE_ZEROES
//! (with FUA and NO_HOLE), CACHE, BLOCK_STATUS (with REQ_ONE) and DISC. Both transmission paths
//! (tasks here, engine thread in [`direct`]) check requests with [`codec::check_payload`] and
//! [`codec::check_request`], answer block status
//! with [`block_status_reply`] and plan hole-aware reads with [`read_plan`]. Every connection
//! serves the same session, so the export is advertised with
//! CAN_MULTI_CONN. Each connection handles many requests at once and replies as they complete
//! (out of order, as NBD allows), at most [`NbdOptions::max_inflight`] per connection.
//!
//! No maintained Rust crate offers an NBD *server* with fixed newstyle, NBD_OPT_GO and
//! multi-conn on tokio, so the codec is this crate's own ([`codec`]), tested against literal
//! bytes and against libnbd's tools (`nbdinfo`, `nbdcopy`, `nbdfuse`).

pub mod codec;
pub(crate) mod direct;

use std::io;
use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, Semaphore};
use tracing::{debug, info, warn};

use crate::client::Client;
use crate::error::Error;
use codec::{cflag, cmd, errno, info as info_item, opt, rep, tflag, Action, Head};
use tyche_wire::{flags as wflags, Extent, Status};

/// Largest request the server accepts (advertised as the maximum block size): the most a READ
/// reads and the most payload a request carries. A payload over it ends the connection (the
/// NBD protocol's hard disconnect); a READ over it is EOVERFLOW.
pub const MAX_REQUEST: u32 = 32 << 20;
/// Largest effect length of a TRIM or WRITE_ZEROES (extended headers carry 64-bit lengths):
/// 1 TiB, 256 Tyche requests of 4 GiB. Longer ones are EOVERFLOW (the NBD protocol allows it
/// for requests that would take too many server resources); clients split them.
pub const MAX_EFFECT: u64 = 1 << 40;
/// Reads of at least this many bytes, with structured replies and without NBD_CMD_FLAG_DF, ask
/// the target which of their sectors are holes first and read only the rest (the holes are
/// answered as NBD_REPLY_TYPE_OFFSET_HOLE chunks). The default of [`NbdOptions::hole_read_min`].
pub const HOLE_READ_MIN: u64 = 256 << 10;
/// Holes shorter than this inside a hole-aware read are read as data (a chunk and a Tyche
/// request each would cost more than the zeroes).
pub const HOLE_CHUNK_MIN: u64 = 64 << 10;
/// Unit of the per-connection data budget.
const BYTE_UNIT: u32 = 64 << 10;
/// Data (read buffers and write payloads) one connection may hold at once: 256 MiB, in units.
const BYTE_UNITS: u32 = (256 << 20) / BYTE_UNIT;
/// Most replies gathered into one write (two iovecs each, well under IOV_MAX).
const REPLY_BATCH: usize = 256;
/// Read buffer of a connection's request stream.
const REQUEST_BUFFER: usize = 64 << 10;
/// Request buffers of a node's connection are located page by page on one request in this many.
const BUFFER_SAMPLE: u64 = 16;
/// Largest option data the server reads.
const MAX_OPTION: u32 = 64 << 10;
/// Smallest block size advertised (the Tyche sector).
const MIN_BLOCK: u32 = 512;
/// Preferred block size advertised.
const PREFERRED_BLOCK: u32 = 4096;

/// Settings of the NBD server.
#[derive(Debug, Clone)]
pub struct NbdOptions {
    /// Export name clients ask for (an empty name also selects it).
    pub name: String,
    /// Description shown by `nbdinfo`.
    pub description: String,
    /// Requests in flight per connection.
    pub max_inflight: usize,
    /// NUMA nodes the connections are served for, in turn by accept order (empty: the nodes of
    /// the session's NICs). A connection served for a node runs on a thread of its own, pinned
    /// to that node's CPUs with its memory bound there, so its request buffers are on the node
    /// and the affinity scheduler sends its requests to that node's channels.
    pub connection_nodes: Vec<u32>,
    /// Per connection counters, shared with the stats socket.
    pub stats: crate::report::NbdStats,
    /// After the handshake, serve the connection from the engine thread of its node (requests
    /// read and replies written in the engine's loop, see [`direct`]) rather than from a task
    /// per request on the connection's own thread.
    pub engine_io: bool,
    /// Reads of at least this many bytes ask for block status first and answer holes as hole
    /// chunks (with structured replies, without DF); `None`: never. See [`HOLE_READ_MIN`].
    pub hole_read_min: Option<u64>,
}

impl NbdOptions {
    /// Defaults for `name`.
    pub fn new(name: &str) -> Self {
        NbdOptions {
            name: name.to_owned(),
            description: "Tyche export".into(),
            max_inflight: 128,
            connection_nodes: Vec::new(),
            stats: crate::report::NbdStats::default(),
            engine_io: true,
            hole_read_min: Some(HOLE_READ_MIN),
        }
    }
}

/// Listens on the Unix socket `path` (replacing a stale socket file) and serves connections
/// until the listener fails.
pub async fn serve_unix(path: &Path, client: Client, opts: NbdOptions) -> io::Result<()> {
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    info!(socket = %path.display(), export = %opts.name, size = client.size(), "serving NBD");
    serve(listener, client, opts).await
}

/// Serves connections from `listener`.
pub async fn serve(listener: UnixListener, client: Client, opts: NbdOptions) -> io::Result<()> {
    let opts = Arc::new(opts);
    let mut n = 0u64;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: say so, breathe, keep serving.
                warn!("NBD accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        n += 1;
        // Each connection is served for one node: its requests go to that node's channels.
        let nodes = if opts.connection_nodes.is_empty() { client.nodes() } else { &opts.connection_nodes[..] };
        let node = (!nodes.is_empty()).then(|| nodes[(n as usize - 1) % nodes.len()]);
        let (client, opts) = (client.on_node(node), Arc::clone(&opts));
        let cpus = node.and_then(crate::sched::node_cpus);
        let report = crate::report::NbdConnReport { conn: n, node, open: true, ..Default::default() };
        let idx = opts.stats.add(report);
        match (node, cpus) {
            (Some(node), Some(cpus)) => {
                // A thread of its own on the node: buffers it allocates and fills are there.
                let stats = opts.stats.clone();
                let std_stream = match stream.into_std() {
                    Ok(s) => s,
                    Err(e) => {
                        warn!(conn = n, "NBD connection: {e}");
                        opts.stats.update(idx, |r| r.open = false);
                        continue;
                    }
                };
                let spawned = std::thread::Builder::new().name(format!("tyche-nbd{n}")).spawn(move || {
                    if let Err(e) = tyche_numa::pin_current_thread(&cpus) {
                        warn!(conn = n, node, "cannot pin the NBD connection thread: {e}");
                    }
                    if let Err(e) = tyche_numa::alloc::bind_thread_memory(node) {
                        warn!(conn = n, node, "cannot bind the NBD connection's memory: {e}");
                    }
                    let thread = tyche_numa::report::this_thread();
                    opts.stats.update(idx, |r| r.thread = thread);
                    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                        Ok(rt) => rt,
                        Err(e) => {
                            warn!(conn = n, "NBD connection runtime: {e}");
                            return;
                        }
                    };
                    rt.block_on(async move {
                        let stream = match UnixStream::from_std(std_stream) {
                            Ok(s) => s,
                            Err(e) => {
                                warn!(conn = n, "NBD connection: {e}");
                                return;
                            }
                        };
                        run_connection(n, idx, node.into(), stream, client, &opts).await;
                    });
                });
                if let Err(e) = spawned {
                    warn!(conn = n, "cannot start an NBD connection thread: {e}");
                    stats.update(idx, |r| r.open = false);
                }
            }
            _ => {
                tokio::spawn(async move {
                    opts.stats.update(idx, |r| r.thread = tyche_numa::report::this_thread());
                    run_connection(n, idx, node, stream, client, &opts).await;
                });
            }
        }
    }
}

async fn run_connection(n: u64, idx: u64, node: Option<u32>, stream: UnixStream, client: Client, opts: &NbdOptions) {
    debug!(conn = n, ?node, "NBD connection");
    match connection(stream, client, opts, idx, node).await {
        Ok(()) => debug!(conn = n, "NBD connection closed"),
        Err(e) => warn!(conn = n, "NBD connection ended: {e}"),
    }
    opts.stats.update(idx, |r| r.open = false);
}

fn transmission_flags(client: &Client) -> u16 {
    let i = client.info();
    flags_for(i.read_only, i.discard)
}

fn flags_for(read_only: bool, discard: bool) -> u16 {
    let mut f = tflag::HAS_FLAGS | tflag::SEND_FLUSH | tflag::SEND_FUA | tflag::CAN_MULTI_CONN | tflag::SEND_CACHE;
    if read_only {
        f |= tflag::READ_ONLY;
    } else {
        f |= tflag::SEND_WRITE_ZEROES;
        if discard {
            f |= tflag::SEND_TRIM;
        }
    }
    f
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_owned())
}

/// Handshake, then transmission.
async fn connection(
    stream: UnixStream,
    client: Client,
    opts: &NbdOptions,
    idx: u64,
    node: Option<u32>,
) -> io::Result<()> {
    let (mut rd, mut wr) = stream.into_split();
    let Some(neg) = handshake(&mut rd, &mut wr, client.size(), transmission_flags(&client), opts).await? else {
        return Ok(());
    };
    if !opts.engine_io {
        return transmission(rd, wr, client, opts, idx, node, neg).await;
    }
    // The handshake reads no further than its last option, so requests the client already
    // sent are still in the socket for the engine thread to read.
    let stream = rd.reunite(wr).map_err(|e| io::Error::other(e.to_string()))?.into_std()?;
    let (done, finished) = tokio::sync::oneshot::channel();
    let info = client.info();
    let spec = direct::ConnSpec {
        size: info.size,
        read_only: info.read_only,
        discard: info.discard,
        neg,
        max_inflight: opts.max_inflight,
        hole_read_min: opts.hole_read_min,
    };
    let conn = direct::DirectConn::new(stream, idx, spec, node, opts.stats.clone(), done)?;
    client.serve_front(Box::new(conn))?;
    finished.await.unwrap_or_else(|_| Err(io::Error::other("the engine stopped")))
}

/// What a connection's handshake settled for transmission.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Negotiated {
    /// NBD_OPT_STRUCTURED_REPLY (or NBD_OPT_EXTENDED_HEADERS) was accepted: reads and block
    /// status get structured replies.
    pub structured: bool,
    /// NBD_OPT_EXTENDED_HEADERS was accepted: 32-byte extended requests (64-bit lengths,
    /// NBD_CMD_FLAG_PAYLOAD_LEN) and extended reply chunks for every request.
    pub extended: bool,
    /// `base:allocation` was selected (NBD_OPT_SET_META_CONTEXT): BLOCK_STATUS is allowed.
    pub allocation: bool,
}

impl Negotiated {
    /// The transmission flags for what was negotiated: `base` and, with structured replies,
    /// SEND_DF (a READ with NBD_CMD_FLAG_DF gets one data chunk).
    pub fn flags(&self, base: u16) -> u16 {
        if self.structured {
            base | tflag::SEND_DF
        } else {
            base
        }
    }
}

/// The block sizes advertised (NBD_INFO_BLOCK_SIZE) for an export of `size` bytes: minimum 512
/// (the Tyche sector), preferred 4096 (or less on a tiny export), maximum the largest request
/// accepted ([`MAX_REQUEST`], or the export's size in whole sectors if smaller), a multiple of
/// the minimum.
fn block_sizes(size: u64) -> (u32, u32, u32) {
    let whole = u32::try_from(size / MIN_BLOCK as u64 * MIN_BLOCK as u64).unwrap_or(u32::MAX);
    let max = MAX_REQUEST.min(whole).max(MIN_BLOCK);
    let preferred = PREFERRED_BLOCK.min(1 << (u32::BITS - 1 - max.leading_zeros()));
    (MIN_BLOCK, preferred, max)
}

/// Option haggling for an export of `size` bytes with transmission flags `flags`. Returns what
/// was negotiated, or `None` when the client gave up (no transmission).
async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    size: u64,
    flags: u16,
    opts: &NbdOptions,
) -> io::Result<Option<Negotiated>>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    wr.write_all(&codec::greeting()).await?;
    let cflags = rd.read_u32().await?;
    if cflags & !(codec::FLAG_C_FIXED_NEWSTYLE | codec::FLAG_C_NO_ZEROES) != 0 {
        return Err(invalid("unknown client flags"));
    }
    let export = Haggled { size, flags, opts, no_zeroes: cflags & codec::FLAG_C_NO_ZEROES != 0 };
    let mut neg = Negotiated::default();
    loop {
        let mut h = [0u8; 16];
        rd.read_exact(&mut h).await?;
        let h = codec::parse_option_header(&h).ok_or_else(|| invalid("bad option magic"))?;
        if h.length > MAX_OPTION {
            // Too big to bother: skip it and say so.
            let mut left = h.length as u64;
            let mut sink = [0u8; 4096];
            while left > 0 {
                let n = rd.read(&mut sink[..left.min(4096) as usize]).await?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                left -= n as u64;
            }
            wr.write_all(&codec::option_reply(h.option, rep::ERR_TOO_BIG, &[])).await?;
            continue;
        }
        let mut data = vec![0u8; h.length as usize];
        rd.read_exact(&mut data).await?;
        let (reply, next) = export.answer(h.option, &data, &mut neg)?;
        wr.write_all(&reply).await?;
        match next {
            Next::Haggle => {}
            Next::Transmit => return Ok(Some(neg)),
            Next::Abort => return Ok(None),
        }
    }
}

/// What follows an option's reply.
enum Next {
    /// More options.
    Haggle,
    /// The transmission phase.
    Transmit,
    /// Nothing (the client aborted).
    Abort,
}

/// The export being haggled over, and how the client greeted.
struct Haggled<'a> {
    size: u64,
    flags: u16,
    opts: &'a NbdOptions,
    no_zeroes: bool,
}

impl Haggled<'_> {
    fn matches(&self, name: &str) -> bool {
        name.is_empty() || name == self.opts.name
    }

    /// The reply to `option` with payload `data` (what the client negotiated goes to `neg`),
    /// and what follows it; an error ends the connection.
    fn answer(&self, option: u32, data: &[u8], neg: &mut Negotiated) -> io::Result<(Vec<u8>, Next)> {
        let only = |reply: u32| codec::option_reply(option, reply, &[]);
        Ok(match option {
            opt::EXPORT_NAME => {
                if !self.matches(&String::from_utf8_lossy(data)) {
                    return Err(invalid("unknown export requested with NBD_OPT_EXPORT_NAME"));
                }
                if neg.extended {
                    // The protocol forbids it (no way to answer an error): end the session.
                    return Err(invalid("NBD_OPT_EXPORT_NAME after NBD_OPT_EXTENDED_HEADERS"));
                }
                (codec::export_name_reply(self.size, neg.flags(self.flags), self.no_zeroes), Next::Transmit)
            }
            opt::ABORT => (only(rep::ACK), Next::Abort),
            opt::STRUCTURED_REPLY => {
                let reply = if !data.is_empty() {
                    rep::ERR_INVALID
                } else if neg.extended {
                    // Extended headers take precedence: no way back to structured replies.
                    rep::ERR_EXT_HEADER_REQD
                } else {
                    neg.structured = true;
                    rep::ACK
                };
                (only(reply), Next::Haggle)
            }
            opt::EXTENDED_HEADERS => {
                // Implies structured replies (extended chunks); asking again changes nothing.
                let reply = if data.is_empty() {
                    neg.extended = true;
                    neg.structured = true;
                    rep::ACK
                } else {
                    rep::ERR_INVALID
                };
                (only(reply), Next::Haggle)
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => (self.meta_context(option, data, neg), Next::Haggle),
            opt::LIST if data.is_empty() => {
                let mut r = codec::option_reply(option, rep::SERVER, &codec::rep_server(&self.opts.name));
                r.extend(only(rep::ACK));
                (r, Next::Haggle)
            }
            opt::LIST => (only(rep::ERR_INVALID), Next::Haggle),
            opt::INFO | opt::GO => match self.info(option, data, neg) {
                Ok(r) if option == opt::GO => (r, Next::Transmit),
                Ok(r) | Err(r) => (r, Next::Haggle),
            },
            _ => (only(rep::ERR_UNSUP), Next::Haggle),
        })
    }

    /// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT: `base:allocation` only.
    fn meta_context(&self, option: u32, data: &[u8], neg: &mut Negotiated) -> Vec<u8> {
        let set = option == opt::SET_META_CONTEXT;
        let Some((name, queries)) = codec::parse_meta_request(data) else {
            return codec::option_reply(option, rep::ERR_INVALID, &[]);
        };
        if set && !neg.structured {
            // Block status replies are structured: no context without them.
            return codec::option_reply(option, rep::ERR_INVALID, &[]);
        }
        if !self.matches(&name) {
            return codec::option_reply(option, rep::ERR_UNKNOWN, &[]);
        }
        // LIST: no query, "base:" or the name itself; SET: the name itself.
        let wanted = (!set && queries.is_empty())
            || queries.iter().any(|q| q == codec::BASE_ALLOCATION || (!set && q == "base:"));
        let mut r = Vec::new();
        if wanted {
            let ctx = codec::rep_meta_context(codec::BASE_ALLOCATION_ID, codec::BASE_ALLOCATION);
            r.extend(codec::option_reply(option, rep::META_CONTEXT, &ctx));
        }
        if set {
            neg.allocation = wanted;
        }
        r.extend(codec::option_reply(option, rep::ACK, &[]));
        r
    }

    /// NBD_OPT_INFO and NBD_OPT_GO: the export's size, flags, block sizes and what else was
    /// asked for; or the error reply (a malformed request, another export's name).
    fn info(&self, option: u32, data: &[u8], neg: &Negotiated) -> Result<Vec<u8>, Vec<u8>> {
        let Some((name, items)) = codec::parse_info_request(data) else {
            return Err(codec::option_reply(option, rep::ERR_INVALID, &[]));
        };
        if !self.matches(&name) {
            return Err(codec::option_reply(option, rep::ERR_UNKNOWN, &[]));
        }
        let mut r = codec::option_reply(option, rep::INFO, &codec::info_export(self.size, neg.flags(self.flags)));
        let (min, preferred, max) = block_sizes(self.size);
        r.extend(codec::option_reply(option, rep::INFO, &codec::info_block_size(min, preferred, max)));
        if items.contains(&info_item::NAME) {
            r.extend(codec::option_reply(option, rep::INFO, &codec::info_text(info_item::NAME, &self.opts.name)));
        }
        if items.contains(&info_item::DESCRIPTION) {
            let d = codec::info_text(info_item::DESCRIPTION, &self.opts.description);
            r.extend(codec::option_reply(option, rep::INFO, &d));
        }
        r.extend(codec::option_reply(option, rep::ACK, &[]));
        Ok(r)
    }
}

/// One reply: header and, for a successful read or block status, its data.
struct Reply {
    header: Head,
    data: Vec<u8>,
}

/// Writes every reply of `batch` (header, then payload) with as few `writev` calls as the socket
/// takes.
async fn write_replies(wr: &mut OwnedWriteHalf, batch: &[Reply]) -> io::Result<()> {
    let mut parts: Vec<&[u8]> = Vec::with_capacity(batch.len() * 2);
    for r in batch {
        parts.push(r.header.as_slice());
        if !r.data.is_empty() {
            parts.push(&r.data);
        }
    }
    // Write from `parts[i][off..]` on.
    let (mut i, mut off) = (0, 0);
    while i < parts.len() {
        let slices: Vec<io::IoSlice<'_>> = std::iter::once(io::IoSlice::new(&parts[i][off..]))
            .chain(parts[i + 1..].iter().map(|p| io::IoSlice::new(p)))
            .collect();
        let mut n = wr.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let left = parts[i].len() - off;
            if n >= left {
                n -= left;
                i += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
    }
    Ok(())
}

fn nbd_error(e: Error) -> u32 {
    errno::from_errno(e.errno())
}

/// What a connection's requests are checked against ([`codec::check_request`], the one
/// validator of both transmission paths): the export (`size`, `read_only`, `discard`) and what was
/// negotiated.
pub(crate) fn rules(size: u64, read_only: bool, discard: bool, neg: Negotiated) -> codec::Rules {
    codec::Rules { size, read_only, discard, extended: neg.extended, allocation: neg.allocation }
}

/// The reply header of a request answered in one piece (not block status): with extended
/// headers always an extended chunk (ERROR, NONE, or a READ's OFFSET_DATA); with structured
/// replies an ERROR chunk for a failed READ or BLOCK_STATUS, OFFSET_DATA of `data_len` bytes (or
/// NONE for nothing) for a READ, a simple reply for the others; else a simple reply.
pub(crate) fn reply_head(neg: Negotiated, req: &codec::Request, error: u32, data_len: usize) -> Head {
    let ext = neg.extended;
    match req.command {
        _ if ext && error != 0 => Head::error(true, req, error, true),
        cmd::READ | cmd::BLOCK_STATUS if neg.structured && error != 0 => Head::error(false, req, error, true),
        cmd::READ if neg.structured && data_len == 0 => Head::none(ext, req),
        cmd::READ if neg.structured => Head::read_data(ext, req, req.offset, data_len, true),
        _ if ext => Head::none(true, req),
        _ => Head::simple(error, req.cookie),
    }
}

/// Whether a READ is answered hole-aware (block status first, then only the data): structured
/// replies negotiated, no NBD_CMD_FLAG_DF, at least `min` bytes, and the connection's
/// [`HoleProbe`] says to probe (`probe`: the target can tell, and the last probes did not all
/// find the range full of data). Call it last: asking the probe counts a skip.
pub(crate) fn hole_aware(req: &codec::Request, neg: Negotiated, min: Option<u64>, probe: &HoleProbe) -> bool {
    req.command == cmd::READ
        && neg.structured
        && req.flags & cflag::DF == 0
        && min.is_some_and(|m| req.length >= m.max(1))
        && probe.should_probe()
}

/// The most large reads a connection answers without a block status probe after probes found
/// only data: a dense export pays one probe per this many large reads at worst.
pub const HOLE_PROBE_BACKOFF_MAX: u32 = 64;
/// Probes in a row that find only data before large reads start to skip probing: a client that
/// reads a few data ranges and then a hole still gets its hole chunks.
pub const HOLE_PROBE_DENSE_AFTER: u32 = 8;

/// Whether a connection's large READs ask for block status first. The target may not be able
/// to tell (UNSUPPORTED: never again on this connection); and on a dense export every probe is a
/// round trip for nothing (measured: a quarter of read throughput at 256 KiB), so after
/// [`HOLE_PROBE_DENSE_AFTER`] probes in a row that found the range all data, each further one
/// doubles the number of large reads read at once before the next probe (1, 2, 4 ...
/// [`HOLE_PROBE_BACKOFF_MAX`]); a probe that finds a hole starts over. Shared by a connection's
/// tasks: atomics, no lock.
#[derive(Debug)]
pub(crate) struct HoleProbe {
    works: std::sync::atomic::AtomicBool,
    /// Large reads still to read without probing.
    skip: std::sync::atomic::AtomicU32,
    /// How many to skip after the next probe that finds only data (once dense).
    backoff: std::sync::atomic::AtomicU32,
    /// Probes in a row that found only data.
    dense: std::sync::atomic::AtomicU32,
}

impl Default for HoleProbe {
    fn default() -> Self {
        HoleProbe {
            works: std::sync::atomic::AtomicBool::new(true),
            skip: std::sync::atomic::AtomicU32::new(0),
            backoff: std::sync::atomic::AtomicU32::new(1),
            dense: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

impl HoleProbe {
    /// Whether this large read probes (else it counts one skip).
    pub(crate) fn should_probe(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.works.load(Relaxed) && self.skip.fetch_update(Relaxed, Relaxed, |s| s.checked_sub(1)).is_err()
    }

    /// The target cannot tell: no more probes on this connection.
    pub(crate) fn unsupported(&self) {
        self.works.store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// A probe's answer: whether it found a hole worth a chunk.
    pub(crate) fn found(&self, hole: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        if hole {
            self.skip.store(0, Relaxed);
            self.backoff.store(1, Relaxed);
            self.dense.store(0, Relaxed);
        } else if self.dense.fetch_add(1, Relaxed).saturating_add(1) >= HOLE_PROBE_DENSE_AFTER {
            let b = self.backoff.load(Relaxed);
            self.skip.store(b, Relaxed);
            self.backoff.store((b * 2).min(HOLE_PROBE_BACKOFF_MAX), Relaxed);
        }
    }
}

/// One part of a hole-aware read's answer: `(offset, length)` in the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Read and sent as an OFFSET_DATA chunk.
    Data(u64, u64),
    /// Sent as an OFFSET_HOLE chunk (reads as zeroes).
    Hole(u64, u64),
}

/// How to answer a READ of `len` bytes at `off` from the target's extents for the range from
/// `start` (at or before `off`): pieces in order covering the whole read, holes only where the
/// target says ZERO and at least [`HOLE_CHUNK_MIN`] long, data elsewhere (a range the extents do
/// not cover included).
pub(crate) fn read_plan(off: u64, len: u64, start: u64, extents: &[Extent]) -> Vec<Piece> {
    let end = off + len;
    fn push(runs: &mut Vec<(bool, u64, u64)>, hole: bool, at: u64, n: u64) {
        match runs.last_mut() {
            Some((h, _, l)) if *h == hole => *l += n,
            _ => runs.push((hole, at, n)),
        }
    }
    let mut runs = Vec::new();
    let (mut at, mut covered) = (start, off);
    for e in extents {
        let (s, t) = (at.max(off), at.saturating_add(e.length).min(end));
        at = at.saturating_add(e.length);
        if t > s {
            push(&mut runs, e.flags & wflags::EXTENT_ZERO != 0, s, t - s);
            covered = t;
        }
        if at >= end {
            break;
        }
    }
    if covered < end {
        push(&mut runs, false, covered, end - covered);
    }
    let mut out = Vec::new();
    for (hole, at, n) in runs {
        push(&mut out, hole && n >= HOLE_CHUNK_MIN, at, n);
    }
    out.into_iter().map(|(hole, at, n)| if hole { Piece::Hole(at, n) } else { Piece::Data(at, n) }).collect()
}

/// The Tyche BLOCK_STATUS range for an NBD one at `off` of `len` bytes: the sectors covering it
/// within the export, at most the largest range a request carries. `None` when no whole sector
/// is left to ask about (the tail of an export whose size is not whole sectors): the answer is
/// "data".
pub(crate) fn status_query(off: u64, len: u64, size: u64) -> Option<(u64, u64)> {
    let start = off / SECTOR * SECTOR;
    let end = (off + len).next_multiple_of(SECTOR).min(size / SECTOR * SECTOR);
    let most = (u32::MAX / MIN_BLOCK * MIN_BLOCK) as u64;
    (end > start).then(|| (start, (end - start).min(most)))
}

/// The reply to an NBD BLOCK_STATUS `req` (already validated) from the target's answer for the
/// query starting at `start`: the extents from `req.offset` on, cut at its end (or after the
/// first, with REQ_ONE), as one BLOCK_STATUS chunk of `base:allocation`. A target that cannot tell
/// (UNSUPPORTED, or no feature) or no query at all: the whole range is data. Other errors: an
/// ERROR chunk.
pub(crate) fn block_status_reply(
    extended: bool,
    req: &codec::Request,
    start: u64,
    answer: Result<Vec<Extent>, Error>,
) -> (Head, Vec<u8>) {
    let (off, end) = (req.offset, req.offset + req.length);
    let req_one = req.flags & cflag::REQ_ONE != 0;
    let mut out: Vec<(u64, u32)> = Vec::new();
    // Compact descriptors hold 32-bit lengths (a compact request's range fits them).
    let most = if extended { u64::MAX } else { u32::MAX as u64 };
    let push = |out: &mut Vec<(u64, u32)>, len: u64, state: u32| match out.last_mut() {
        Some((l, s)) if *s == state && *l + len <= most => *l += len,
        _ => out.push((len, state)),
    };
    match answer {
        Ok(extents) => {
            let mut at = start;
            for e in extents {
                let (s, t) = (at.max(off), (at + e.length).min(end));
                at += e.length;
                if t > s {
                    let mut state = 0;
                    if e.flags & wflags::EXTENT_HOLE != 0 {
                        state |= codec::state::HOLE;
                    }
                    if e.flags & wflags::EXTENT_ZERO != 0 {
                        state |= codec::state::ZERO;
                    }
                    push(&mut out, t - s, state);
                }
                if at >= end {
                    break;
                }
            }
        }
        Err(Error::Target(Status::Unsupported)) => {}
        Err(e) => return (Head::error(extended, req, nbd_error(e), true), Vec::new()),
    }
    if out.is_empty() {
        // Nothing said about the range (cannot happen with a valid list: its first extent
        // covers a whole sector from the sector holding `off`): data, as a server without
        // allocation information answers.
        push(&mut out, end - off, 0);
    }
    if req_one {
        out.truncate(1);
    }
    let mut data = Vec::with_capacity(out.len() * 16);
    for &(len, state) in &out {
        codec::descriptor(extended, len, state, &mut data);
    }
    (Head::block_status(extended, req, codec::BASE_ALLOCATION_ID, out.len()), data)
}

/// Writes replies as they come: those ready together go out in one vectored write, headers
/// and payloads from their own buffers (no copy).
async fn reply_writer(mut wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Reply>) -> io::Result<()> {
    let mut batch: Vec<Reply> = Vec::with_capacity(REPLY_BATCH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < REPLY_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        write_replies(&mut wr, &batch).await?;
        batch.clear();
    }
    wr.shutdown().await
}

/// One request of the task path, run in its own task.
struct Job {
    client: Client,
    tx: mpsc::Sender<Reply>,
    stats: crate::NbdStats,
    /// The connection's index in `stats`.
    idx: u64,
    /// The node the request's buffers should be on, when this request is sampled for it.
    node: Option<u32>,
    neg: Negotiated,
    size: u64,
    req: codec::Request,
    action: Result<Action, u32>,
    /// A WRITE's payload.
    data: Vec<u8>,
    /// A READ answered hole-aware.
    holes: bool,
    probe: Arc<HoleProbe>,
}

impl Job {
    async fn run(mut self) {
        let data = std::mem::take(&mut self.data);
        let Job { ref client, ref tx, ref stats, idx, node, neg, size, req, action, holes, .. } = self;
        if req.command == cmd::BLOCK_STATUS {
            let reply = match action {
                Err(e) => Reply { header: reply_head(neg, &req, e, 0), data: Vec::new() },
                Ok(_) => {
                    let answer = match status_query(req.offset, req.length, size) {
                        Some((start, len)) => (start, client.block_status(start, len).await),
                        None => (req.offset, Err(Error::Target(Status::Unsupported))),
                    };
                    let (header, data) = block_status_reply(neg.extended, &req, answer.0, answer.1);
                    Reply { header, data }
                }
            };
            let _ = tx.send(reply).await;
            return;
        }
        if holes {
            if let Some(replies) = read_with_holes(&self).await {
                let read: u64 = replies.iter().map(|r| r.data.len() as u64).sum();
                stats.update(idx, |r| r.bytes_read += read);
                for r in replies {
                    let _ = tx.send(r).await;
                }
                return;
            }
        }
        let written = data.len() as u64;
        let mut pages = node.and_then(|n| tyche_numa::report::count_slice(&data, Some(n)).ok());
        let (error, data) = match execute(&self, data).await {
            Ok(d) => (0, d),
            Err(e) => (e, Vec::new()),
        };
        let header = reply_head(neg, &req, error, data.len());
        if node.is_some() && !data.is_empty() {
            pages = tyche_numa::report::count_slice(&data, node).ok();
        }
        let read = data.len() as u64;
        stats.update(idx, |r| {
            if error == 0 {
                r.bytes_written += written;
                r.bytes_read += read;
            }
            if let Some(p) = pages.filter(|p| p.pages > 0) {
                if r.buffers.pages == 0 {
                    r.buffers.expected_node = node;
                }
                r.buffers.add(&p);
            }
        });
        let _ = tx.send(Reply { header, data }).await;
    }
}

/// Reads requests, runs each in its own task, writes replies as they complete.
async fn transmission(
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    client: Client,
    opts: &NbdOptions,
    idx: u64,
    node: Option<u32>,
    neg: Negotiated,
) -> io::Result<()> {
    let (tx, rx) = mpsc::channel::<Reply>(opts.max_inflight);
    let writer = tokio::spawn(reply_writer(wr, rx));
    // Several requests that arrive together are parsed from one read.
    let mut rd = tokio::io::BufReader::with_capacity(REQUEST_BUFFER, rd);
    let slots = Arc::new(Semaphore::new(opts.max_inflight));
    let bytes = Arc::new(Semaphore::new(BYTE_UNITS as usize));
    let size = client.size();
    let rules = rules(size, client.info().read_only, client.info().discard, neg);
    // Cleared when the target says it cannot tell holes from data: reads stop asking.
    let probe = Arc::new(HoleProbe::default());
    let mut seq = 0u64;
    let header_len = codec::request_len(neg.extended);
    let result = loop {
        let mut h = [0u8; codec::EXTENDED_REQUEST_LEN];
        match rd.read_exact(&mut h[..header_len]).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break Ok(()), // client went away
            Err(e) => break Err(e),
        }
        let req = match codec::parse_request(&h, neg.extended) {
            Ok(r) => r,
            Err(e) => break Err(invalid(&e.to_string())),
        };
        if req.command == cmd::DISC {
            break Ok(());
        }
        let payload = match codec::check_payload(&req, neg.extended) {
            Ok(p) => p,
            Err(e) => break Err(invalid(&e.to_string())),
        };
        // Bound what one connection holds: requests, and bytes of data (reads and payloads).
        let permit = Arc::clone(&slots).acquire_owned().await.expect("semaphore never closed");
        let held = match (req.command, payload) {
            (_, Some(n)) => n,
            (cmd::READ, None) => req.length.min(MAX_REQUEST as u64),
            _ => 0,
        };
        let units =
            if held > 0 || req.command == cmd::READ { held.div_ceil(BYTE_UNIT as u64).max(1) as u32 } else { 0 };
        let bytes_permit = Arc::clone(&bytes).acquire_many_owned(units).await.expect("semaphore never closed");
        let permits = (permit, bytes_permit);
        let mut data = Vec::new();
        if let Some(n) = payload {
            data = vec![0u8; n as usize];
            // What the read buffer holds of the payload is copied out of it; the rest comes
            // straight from the socket into the payload's own buffer.
            let buffered = rd.buffer().len().min(data.len());
            data[..buffered].copy_from_slice(&rd.buffer()[..buffered]);
            rd.consume(buffered);
            opts.stats.add_copied(idx, buffered as u64, true);
            if let Err(e) = rd.get_mut().read_exact(&mut data[buffered..]).await {
                break Err(e);
            }
        }
        // Where request buffers are, page by page (a move_pages(2) call), is checked on
        // connections served for a node only, and there on the first requests and one in
        // BUFFER_SAMPLE after: a syscall per request would cost more than the request.
        let sample = node.is_some() && (seq < 64 || seq % BUFFER_SAMPLE == 0);
        seq += 1;
        let action = codec::check_request(&req, &rules);
        let holes = action == Ok(Action::Read) && hole_aware(&req, neg, opts.hole_read_min, &probe);
        let job = Job {
            client: client.clone(),
            tx: tx.clone(),
            stats: opts.stats.clone(),
            idx,
            node: node.filter(|_| sample),
            neg,
            size,
            req,
            action,
            data,
            holes,
            probe: Arc::clone(&probe),
        };
        tokio::spawn(async move {
            job.run().await;
            drop(permits);
        });
    };
    // Let requests in flight finish and their replies go out, then close.
    let _ = slots.acquire_many(opts.max_inflight as u32).await;
    let _ = bytes.acquire_many(BYTE_UNITS).await;
    drop(tx);
    writer.await.map_err(|e| io::Error::other(e.to_string()))??;
    result
}

/// A hole-aware READ (already validated) on the task path: block status for its range, then the
/// data pieces read at once, answered as hole and data chunks (the last flagged DONE), or one
/// ERROR chunk if a read fails. `None` when the answer is a single data piece (no hole worth a
/// chunk, or the target could not tell): the caller reads it as usual.
async fn read_with_holes(job: &Job) -> Option<Vec<Reply>> {
    let Job { client, req, size, neg, probe, stats, idx, .. } = job;
    let (size, neg, idx) = (*size, *neg, *idx);
    let (start, len) = status_query(req.offset, req.length, size)?;
    let plan = match client.block_status(start, len).await {
        Ok(extents) => read_plan(req.offset, req.length, start, &extents),
        Err(Error::Target(Status::Unsupported)) => {
            probe.unsupported();
            return None;
        }
        // Block status only spares zeroes: on any other failure, read it all.
        Err(_) => return None,
    };
    let all_data = matches!(plan[..], [Piece::Data(..)]);
    probe.found(!all_data);
    if all_data {
        return None;
    }
    let reads: Vec<_> = plan
        .iter()
        .map(|p| match *p {
            Piece::Data(off, n) => {
                let (client, stats) = (client.clone(), stats.clone());
                Some(tokio::spawn(async move { read_range(&client, off, n, &stats, idx).await }))
            }
            Piece::Hole(..) => None,
        })
        .collect();
    let mut replies = Vec::with_capacity(plan.len());
    let last = plan.len() - 1;
    for (i, (piece, read)) in plan.iter().zip(reads).enumerate() {
        let done = i == last;
        match (*piece, read) {
            (Piece::Hole(off, n), _) => {
                replies.push(Reply { header: Head::hole(neg.extended, req, off, n as u32, done), data: Vec::new() })
            }
            (Piece::Data(off, n), read) => {
                let data = match read {
                    Some(read) => read.await.unwrap_or(Err(errno::EIO)),
                    None => read_range(client, off, n, stats, idx).await,
                };
                match data {
                    Ok(data) => {
                        replies.push(Reply { header: Head::read_data(neg.extended, req, off, data.len(), done), data })
                    }
                    Err(e) => {
                        // One ERROR chunk, no data: the client may assume nothing of the read.
                        return Some(vec![Reply { header: Head::error(neg.extended, req, e, true), data: Vec::new() }]);
                    }
                }
            }
        }
    }
    Some(replies)
}

/// The sector: reads and trims are rounded to it.
const SECTOR: u64 = MIN_BLOCK as u64;

/// Reads `len` bytes at `off`, through the sectors covering them (an unaligned range is copied
/// out of them, counted for connection `idx` in `stats`).
async fn read_range(client: &Client, off: u64, len: u64, stats: &crate::NbdStats, idx: u64) -> Result<Vec<u8>, u32> {
    let start = off / SECTOR * SECTOR;
    let end = (off + len).next_multiple_of(SECTOR);
    let buf = client.read(start, (end - start) as usize).await.map_err(nbd_error)?;
    if start == off && end == off + len {
        Ok(buf)
    } else {
        let at = (off - start) as usize;
        stats.add_copied(idx, len, false);
        Ok(buf[at..at + len as usize].to_vec())
    }
}

/// Runs one checked request ([`codec::check_request`]'s verdict); returns read data or an NBD
/// error number.
async fn execute(job: &Job, data: Vec<u8>) -> Result<Vec<u8>, u32> {
    let Job { client, req, action, stats, idx, .. } = job;
    let fua = req.flags & cflag::FUA != 0;
    match (*action)? {
        Action::Done => Ok(Vec::new()),
        Action::Flush => client.flush().await.map(|()| Vec::new()).map_err(nbd_error),
        // Unaligned reads read the covering sectors.
        Action::Read => read_range(client, req.offset, req.length, stats, *idx).await,
        Action::Write => client.write_owned(req.offset, data, fua).await.map(|()| Vec::new()).map_err(nbd_error),
        Action::Trim { start, length, flush } => {
            client.discard(start, length).await.map_err(nbd_error)?;
            if flush {
                client.flush().await.map_err(nbd_error)?;
            }
            Ok(Vec::new())
        }
        Action::WriteZeroes => {
            client.write_zeroes(req.offset, req.length, fua).await.map(|()| Vec::new()).map_err(nbd_error)
        }
        // Answered on its own path (see `transmission`).
        Action::BlockStatus => Err(errno::EINVAL),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(command: u16, flags: u16, offset: u64, length: u64) -> codec::Request {
        codec::Request { flags, command, cookie: 7, offset, length }
    }

    fn descriptors(h: &Head, d: &[u8]) -> Vec<(u32, u32)> {
        assert_eq!(&h.as_slice()[6..8], &codec::chunk::BLOCK_STATUS.to_be_bytes(), "a BLOCK_STATUS chunk");
        d.chunks_exact(8)
            .map(|c| (u32::from_be_bytes(c[..4].try_into().unwrap()), u32::from_be_bytes(c[4..].try_into().unwrap())))
            .collect()
    }

    #[test]
    fn reply_heads_follow_the_negotiation() {
        let plain = Negotiated::default();
        let st = Negotiated { structured: true, ..plain };
        let ext = Negotiated { structured: true, extended: true, allocation: false };
        let w = req(cmd::WRITE, 0, 0, 512);
        let r = req(cmd::READ, 0, 4096, 512);
        assert_eq!(reply_head(plain, &w, 0, 0), Head::simple(0, 7));
        assert_eq!(reply_head(st, &w, errno::EIO, 0), Head::simple(errno::EIO, 7));
        assert_eq!(reply_head(ext, &w, 0, 0), Head::none(true, &w), "no simple replies with extended headers");
        assert_eq!(reply_head(ext, &w, errno::ENOSPC, 0), Head::error(true, &w, errno::ENOSPC, true));
        assert_eq!(reply_head(st, &r, 0, 512), Head::read_data(false, &r, 4096, 512, true));
        assert_eq!(reply_head(ext, &r, 0, 512), Head::read_data(true, &r, 4096, 512, true));
        assert_eq!(reply_head(ext, &r, 0, 0), Head::none(true, &r));
        assert_eq!(plain.flags(tflag::HAS_FLAGS), tflag::HAS_FLAGS);
        assert_eq!(st.flags(tflag::HAS_FLAGS), tflag::HAS_FLAGS | tflag::SEND_DF);
    }

    #[test]
    fn read_plans_answer_long_holes_as_holes() {
        let e = |length, flags| Extent { length, flags };
        let hz = wflags::EXTENT_HOLE | wflags::EXTENT_ZERO;
        let k = 1024u64;
        // 1 MiB read at 100: data 0..64K, hole 64K..576K, data, a hole of 4K (read as data),
        // data, hole.
        let ext = [e(64 * k, 0), e(512 * k, hz), e(4 * k, 0), e(4 * k, hz), e(56 * k, 0), e(1024 * k, hz)];
        let plan = read_plan(100, 1024 * k, 0, &ext);
        assert_eq!(
            plan,
            [
                Piece::Data(100, 64 * k - 100),
                Piece::Hole(64 * k, 512 * k),
                Piece::Data(576 * k, 64 * k),
                Piece::Hole(640 * k, 1024 * k + 100 - 640 * k),
            ]
        );
        // HOLE without ZERO may hold anything: data.
        assert_eq!(read_plan(0, 256 * k, 0, &[e(256 * k, wflags::EXTENT_HOLE)]), [Piece::Data(0, 256 * k)]);
        // Extents that cover less than the read: the rest is data.
        assert_eq!(
            read_plan(0, 512 * k, 0, &[e(128 * k, hz)]),
            [Piece::Hole(0, 128 * k), Piece::Data(128 * k, 384 * k)]
        );
        // A short hole at the end is data too; nothing at all is data.
        assert_eq!(read_plan(0, 256 * k, 0, &[e(200 * k, 0), e(56 * k, hz)]), [Piece::Data(0, 256 * k)]);
        assert_eq!(read_plan(0, 256 * k, 0, &[]), [Piece::Data(0, 256 * k)]);
    }

    #[test]
    fn hole_aware_reads_need_structured_replies_size_and_no_df() {
        let st = Negotiated { structured: true, ..Negotiated::default() };
        let big = req(cmd::READ, 0, 0, HOLE_READ_MIN);
        let p = HoleProbe::default();
        assert!(hole_aware(&big, st, Some(HOLE_READ_MIN), &p));
        assert!(!hole_aware(&big, Negotiated::default(), Some(HOLE_READ_MIN), &p), "simple replies");
        assert!(!hole_aware(&req(cmd::READ, codec::cflag::DF, 0, HOLE_READ_MIN), st, Some(HOLE_READ_MIN), &p));
        assert!(!hole_aware(&req(cmd::READ, 0, 0, HOLE_READ_MIN - 512), st, Some(HOLE_READ_MIN), &p));
        assert!(!hole_aware(&big, st, None, &p), "turned off");
        assert!(!hole_aware(&req(cmd::WRITE, 0, 0, HOLE_READ_MIN), st, Some(HOLE_READ_MIN), &p));
        p.unsupported();
        assert!(!hole_aware(&big, st, Some(HOLE_READ_MIN), &p), "the target cannot tell");
    }

    #[test]
    fn probes_back_off_on_dense_exports_and_come_back_at_a_hole() {
        let p = HoleProbe::default();
        // Large reads one after another, every probe finding only data: how many reads went
        // without a probe before each probe.
        let (mut gaps, mut gap) = (Vec::new(), 0);
        for _ in 0..2000 {
            if p.should_probe() {
                p.found(false);
                gaps.push(gap);
                gap = 0;
            } else {
                gap += 1;
            }
        }
        let dense = HOLE_PROBE_DENSE_AFTER as usize;
        assert!(gaps[..dense].iter().all(|&g| g == 0), "every read probes at first: {gaps:?}");
        assert_eq!(gaps[dense..dense + 7], [1, 2, 4, 8, 16, 32, 64]);
        assert!(gaps[dense + 7..].iter().all(|&g| g == HOLE_PROBE_BACKOFF_MAX), "{gaps:?}");
        // A hole: probe every large read again.
        p.found(true);
        assert!(p.should_probe() && p.should_probe());
        p.unsupported();
        assert!(!p.should_probe());
    }

    #[test]
    fn extended_block_status_has_64_bit_descriptors() {
        let e = |length, flags| Extent { length, flags };
        let r = req(cmd::BLOCK_STATUS, 0, 0, 8 << 30);
        // The target could not tell: 8 GiB of data in one 16-byte descriptor.
        let (h, d) = block_status_reply(true, &r, 0, Err(Error::Target(Status::Unsupported)));
        assert_eq!(&h.as_slice()[..8], &[0x6e, 0x8a, 0x27, 0x8c, 0, 1, 0, 6]);
        assert_eq!(&h.as_slice()[32..], &[0, 0, 0, 1, 0, 0, 0, 1], "context 1, one descriptor");
        assert_eq!(d, [0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let (h, d) = block_status_reply(true, &r, 0, Ok(vec![e(4096, wflags::EXTENT_ZERO), e(4096, 0)]));
        assert_eq!(u64::from_be_bytes(h.as_slice()[24..32].try_into().unwrap()), 8 + 32);
        assert_eq!(d.len(), 32);
    }

    #[test]
    fn status_query_covers_whole_sectors_inside_the_export() {
        assert_eq!(status_query(0, 4096, 1 << 20), Some((0, 4096)));
        assert_eq!(status_query(700, 100, 1 << 20), Some((512, 512)));
        assert_eq!(status_query(1000, 100, 1 << 20), Some((512, 1024)));
        // An export of 1000 bytes: one whole sector; its tail has none.
        assert_eq!(status_query(0, 1000, 1000), Some((0, 512)));
        assert_eq!(status_query(600, 400, 1000), None);
        let most = (u32::MAX / 512 * 512) as u64;
        assert_eq!(status_query(100, u32::MAX as u64, 1 << 40), Some((0, most)));
    }

    #[test]
    fn block_status_reply_cuts_merges_and_falls_back_to_data() {
        let hz = codec::state::HOLE | codec::state::ZERO;
        let e = |length, flags| Extent { length, flags };
        let tyche_hz = wflags::EXTENT_HOLE | wflags::EXTENT_ZERO;
        // Asked 100..2100 (sectors 0..2560): cut at both ends.
        let r = req(cmd::BLOCK_STATUS, 0, 100, 2000);
        let (h, d) = block_status_reply(false, &r, 0, Ok(vec![e(1024, tyche_hz), e(1536, 0)]));
        assert_eq!(descriptors(&h, &d), [(924, hz), (1076, 0)]);
        assert_eq!(u32::from_be_bytes(h.as_slice()[16..20].try_into().unwrap()) as usize, 4 + d.len());
        // REQ_ONE: the first only.
        let r1 = req(cmd::BLOCK_STATUS, codec::cflag::REQ_ONE, 100, 2000);
        let (h, d) = block_status_reply(false, &r1, 0, Ok(vec![e(1024, tyche_hz), e(1536, 0)]));
        assert_eq!(descriptors(&h, &d), [(924, hz)]);
        // A shorter answer covers less; ZERO alone stays ZERO.
        let (h, d) = block_status_reply(false, &r, 0, Ok(vec![e(512, wflags::EXTENT_ZERO)]));
        assert_eq!(descriptors(&h, &d), [(412, codec::state::ZERO)]);
        // The target cannot tell: data.
        let (h, d) = block_status_reply(false, &r, 0, Err(Error::Target(Status::Unsupported)));
        assert_eq!(descriptors(&h, &d), [(2000, 0)]);
        // Other errors: an ERROR chunk, EIO for a malformed list.
        let (h, d) = block_status_reply(false, &r, 0, Err(Error::BadReply));
        assert_eq!(h, Head::error(false, &r, errno::EIO, true));
        assert!(d.is_empty());
        let (h, _) = block_status_reply(false, &r, 0, Err(Error::NoPath));
        assert_eq!(h, Head::error(false, &r, errno::EIO, true));
    }

    #[test]
    fn block_sizes_are_multiples_of_the_minimum() {
        assert_eq!(block_sizes(1 << 30), (512, 4096, MAX_REQUEST));
        assert_eq!(block_sizes(4 << 20), (512, 4096, 4 << 20));
        assert_eq!(block_sizes(2048 + 100), (512, 2048, 2048));
        assert_eq!(block_sizes(100), (512, 512, 512));
    }

    #[test]
    fn malformed_lists_from_the_target_are_bad_replies() {
        let mut list = vec![0u8; 512];
        assert_eq!(crate::client::parse_block_status(&list, 4096), Err(Error::BadReply), "no extents");
        tyche_wire::emit_block_status([Extent { length: 8192, flags: 0 }], &mut list);
        assert_eq!(crate::client::parse_block_status(&list, 4096), Err(Error::BadReply), "more than asked");
        assert_eq!(crate::client::parse_block_status(&list, 8192), Ok(vec![Extent { length: 8192, flags: 0 }]));
        assert_eq!(crate::client::parse_block_status(&list[..100], 8192), Err(Error::BadReply), "short");
        assert_eq!(crate::client::parse_block_status(&list, 1 << 40), Err(Error::BadReply), "a range no list answers");
    }
}

/// Entry points for the fuzz harnesses (`crates/tyche-fuzz`): the handshake over bytes in
/// memory, and an engine-mode connection ([`direct::DirectConn`]) whose volume the caller plays.
/// Not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    use std::future::Future;
    use std::io;
    use std::os::unix::net::UnixStream;
    use std::task::{Context, Poll, Waker};

    use tyche_wire::Op;

    use super::direct::DirectConn;
    use super::NbdOptions;
    use crate::engine_front::{Front, FrontIo};
    use crate::error::Error;

    /// Runs the server's handshake for export `name` of `size` bytes on the client bytes
    /// `input`. Returns how it ended (whether transmission was entered), what the server wrote
    /// and how many client bytes it read.
    pub fn handshake(
        input: &[u8],
        name: &str,
        size: u64,
        read_only: bool,
        discard: bool,
    ) -> (io::Result<bool>, Vec<u8>, usize) {
        let opts = NbdOptions::new(name);
        let mut rd: &[u8] = input;
        let mut wr: Vec<u8> = Vec::new();
        let flags = super::flags_for(read_only, discard);
        let result = {
            let mut fut = std::pin::pin!(super::handshake(&mut rd, &mut wr, size, flags, &opts));
            // Bytes in memory are always ready: one poll runs it to the end.
            match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
                Poll::Ready(r) => r.map(|n| n.is_some()),
                Poll::Pending => Err(io::Error::other("the handshake waited on memory")),
            }
        };
        let read = input.len() - rd.len();
        (result, wr, read)
    }

    /// A request the connection hands to the volume.
    #[derive(Debug)]
    pub struct Io(FrontIo);

    impl Io {
        /// The operation.
        pub fn op(&self) -> Op {
            self.0.op
        }
        /// Force unit access.
        pub fn fua(&self) -> bool {
            self.0.fua
        }
        /// Byte offset in the export.
        pub fn offset(&self) -> u64 {
            self.0.offset
        }
        /// Bytes.
        pub fn length(&self) -> u64 {
            self.0.length
        }
        /// Write data, or the buffer for read data.
        pub fn data(&self) -> &[u8] {
            self.0.data.as_slice()
        }
        /// The buffer for read data.
        pub fn data_mut(&mut self) -> &mut [u8] {
            self.0.data.as_mut_slice()
        }
    }

    /// An NBD connection in transmission, as an engine thread serves it.
    #[derive(Debug)]
    pub struct Conn(Option<DirectConn>);

    /// How a [`Conn`] serves.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Options {
        /// The export's size, bytes.
        pub size: u64,
        /// Writes, trims and zeroes are refused.
        pub read_only: bool,
        /// NBD_CMD_TRIM is offered.
        pub discard: bool,
        /// Requests read ahead of their replies, at most (at least 1).
        pub max_inflight: usize,
        /// As after NBD_OPT_STRUCTURED_REPLY and NBD_OPT_SET_META_CONTEXT `base:allocation`.
        pub structured: bool,
        /// As after NBD_OPT_EXTENDED_HEADERS too.
        pub extended: bool,
        /// Reads of this many bytes or more are hole-aware.
        pub hole_read_min: Option<u64>,
    }

    impl Conn {
        /// Serves `stream` (made non-blocking) as `options` say.
        pub fn new(stream: UnixStream, options: Options) -> io::Result<Conn> {
            let (done, _) = tokio::sync::oneshot::channel();
            let stats = crate::report::NbdStats::default();
            let idx = stats.add(crate::report::NbdConnReport::default());
            let Options { size, read_only, discard, max_inflight, structured, extended, hole_read_min } = options;
            let structured = structured || extended;
            let neg = super::Negotiated { structured, extended, allocation: structured };
            let spec = super::direct::ConnSpec { size, read_only, discard, neg, max_inflight, hole_read_min };
            Ok(Conn(Some(DirectConn::new(stream, idx, spec, None, stats, done)?)))
        }
        fn conn(&mut self) -> &mut DirectConn {
            self.0.as_mut().expect("open")
        }
        /// Reads and parses what the socket has; the requests for the volume.
        pub fn poll_requests(&mut self) -> Vec<Io> {
            let mut out = Vec::new();
            self.conn().receive(&mut out);
            out.into_iter().map(Io).collect()
        }
        /// The volume completed `io` (a read's data is in its buffer).
        pub fn complete(&mut self, io: Io, result: Result<(), Error>) {
            let Io(io) = io;
            let outcome = result.map(|()| (io.op, io.data));
            self.conn().complete(io.token, outcome);
        }
        /// Writes queued replies; whether anything was written.
        pub fn write_replies(&mut self) -> bool {
            self.conn().send()
        }
        /// Whether more requests may be read now.
        pub fn wants_read(&self) -> bool {
            self.0.as_ref().is_some_and(DirectConn::wants_read)
        }
        /// Whether the connection is over.
        pub fn finished(&self) -> bool {
            self.0.as_ref().is_none_or(|c| c.finished())
        }
        /// Requests in flight and data bytes held.
        pub fn load(&self) -> (usize, u64) {
            self.0.as_ref().map_or((0, 0), DirectConn::load)
        }
        /// Ends the connection.
        pub fn close(&mut self) {
            if let Some(c) = self.0.take() {
                Box::new(c).close(false);
            }
        }
    }

    /// Most data bytes one connection holds (its read buffers and write payloads).
    pub const HELD_BYTES: u64 = super::direct::HELD_BYTES;
    /// Largest request accepted.
    pub const MAX_REQUEST: u32 = super::MAX_REQUEST;
    /// Largest TRIM or WRITE_ZEROES accepted.
    pub const MAX_EFFECT: u64 = super::MAX_EFFECT;
}
