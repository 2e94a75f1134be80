//! The NBD wire format (fixed newstyle handshake, simple, structured and extended replies,
//! compact and extended requests, metadata contexts), as far as the server needs it, and the
//! server's one request validator ([`check_payload`] for a header, [`check_request`] for a whole
//! request), used by both transmission paths.
//! Numbers from the NBD protocol document (`doc/proto.md` in NetworkBlockDevice/nbd). All
//! integers are big-endian.

/// Server greeting: "NBDMAGIC".
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle negotiation, and the magic of every option the client sends.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Magic of an extended request (32 bytes, 64-bit length; NBD_OPT_EXTENDED_HEADERS).
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of an extended reply chunk (32 bytes, with the request's offset and a 64-bit length).
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;
/// The one metadata context served.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Id the server gives `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Handshake flag: fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: no 124 zero bytes after NBD_OPT_EXPORT_NAME.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options.
pub mod opt {
    /// Old-style export selection; moves straight to transmission.
    pub const EXPORT_NAME: u32 = 1;
    /// The client gives up.
    pub const ABORT: u32 = 2;
    /// List the exports.
    pub const LIST: u32 = 3;
    /// TLS (not supported).
    pub const STARTTLS: u32 = 5;
    /// Export information without entering transmission.
    pub const INFO: u32 = 6;
    /// Export information, then transmission.
    pub const GO: u32 = 7;
    /// Structured replies.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// List metadata contexts.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Select metadata contexts for transmission.
    pub const SET_META_CONTEXT: u32 = 10;
    /// Extended headers: 32-byte requests and replies with 64-bit lengths.
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub mod rep {
    /// Done.
    pub const ACK: u32 = 1;
    /// One export of a LIST.
    pub const SERVER: u32 = 2;
    /// One NBD_INFO item.
    pub const INFO: u32 = 3;
    /// One metadata context (id and name).
    pub const META_CONTEXT: u32 = 4;
    /// Option not supported.
    pub const ERR_UNSUP: u32 = (1 << 31) + 1;
    /// Option malformed.
    pub const ERR_INVALID: u32 = (1 << 31) + 3;
    /// Unknown export.
    pub const ERR_UNKNOWN: u32 = (1 << 31) + 6;
    /// Option too big.
    pub const ERR_TOO_BIG: u32 = (1 << 31) + 9;
    /// Extended headers are required, or (to NBD_OPT_STRUCTURED_REPLY) already negotiated.
    pub const ERR_EXT_HEADER_REQD: u32 = (1 << 31) + 10;
}

/// NBD_INFO item types.
pub mod info {
    /// Size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// Name.
    pub const NAME: u16 = 1;
    /// Description.
    pub const DESCRIPTION: u16 = 2;
    /// Block size constraints.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags.
pub mod tflag {
    /// Flags are valid.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// Read-only export.
    pub const READ_ONLY: u16 = 1 << 1;
    /// FLUSH supported.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// FUA supported.
    pub const SEND_FUA: u16 = 1 << 3;
    /// TRIM supported.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// WRITE_ZEROES supported.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// READ honours NBD_CMD_FLAG_DF (only with structured replies or extended headers).
    pub const SEND_DF: u16 = 1 << 7;
    /// Several connections see one consistent export (a FLUSH on one covers all).
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// CACHE supported.
    pub const SEND_CACHE: u16 = 1 << 10;
}

/// Commands.
pub mod cmd {
    /// Read.
    pub const READ: u16 = 0;
    /// Write.
    pub const WRITE: u16 = 1;
    /// Disconnect.
    pub const DISC: u16 = 2;
    /// Flush.
    pub const FLUSH: u16 = 3;
    /// Trim (discard).
    pub const TRIM: u16 = 4;
    /// Cache (prefetch).
    pub const CACHE: u16 = 5;
    /// Write zeroes.
    pub const WRITE_ZEROES: u16 = 6;
    /// Block status of a metadata context.
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cflag {
    /// Force unit access.
    pub const FUA: u16 = 1 << 0;
    /// WRITE_ZEROES must not punch a hole.
    pub const NO_HOLE: u16 = 1 << 1;
    /// READ must be answered with at most one content chunk.
    pub const DF: u16 = 1 << 2;
    /// BLOCK_STATUS: one extent only.
    pub const REQ_ONE: u16 = 1 << 3;
    /// Extended headers: the length is a payload that follows the header (WRITE must set it).
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    /// Flag: the last chunk of the reply.
    pub const FLAG_DONE: u16 = 1 << 0;
    /// No payload (a reply without data).
    pub const NONE: u16 = 0;
    /// Read data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// A read's range that reads as zeroes (offset and 32-bit size, no data).
    pub const OFFSET_HOLE: u16 = 2;
    /// Block status extents of one metadata context (32-bit lengths).
    pub const BLOCK_STATUS: u16 = 5;
    /// Block status extents with 64-bit lengths and states (extended headers only).
    pub const BLOCK_STATUS_EXT: u16 = 6;
    /// An error (errno, message).
    pub const ERROR: u16 = (1 << 15) + 1;
}

/// Block status flags of `base:allocation`.
pub mod state {
    /// Not allocated.
    pub const HOLE: u32 = 1 << 0;
    /// Reads as zeroes.
    pub const ZERO: u32 = 1 << 1;
}

/// Errno values NBD carries.
pub mod errno {
    /// Operation not permitted.
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid argument.
    pub const EINVAL: u32 = 22;
    /// No space left.
    pub const ENOSPC: u32 = 28;
    /// Value too large.
    pub const EOVERFLOW: u32 = 75;
    /// Not supported.
    pub const ENOTSUP: u32 = 95;
    /// Server shutting down.
    pub const ESHUTDOWN: u32 = 108;

    /// The NBD error for a Linux errno (NBD uses fixed numbers, equal to Linux's for these).
    pub fn from_errno(e: i32) -> u32 {
        match e {
            libc::EPERM => EPERM,
            libc::ENOMEM => ENOMEM,
            libc::EINVAL => EINVAL,
            libc::ENOSPC => ENOSPC,
            libc::EOVERFLOW => EOVERFLOW,
            libc::EOPNOTSUPP => ENOTSUP,
            libc::ESHUTDOWN => ESHUTDOWN,
            _ => EIO,
        }
    }
}

/// The server's first 18 bytes.
pub fn greeting() -> [u8; 18] {
    let mut b = [0u8; 18];
    b[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    b
}

/// Header of an option from the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option number.
    pub option: u32,
    /// Bytes of data that follow.
    pub length: u32,
}

/// Parses an option header; `None` if the magic is wrong.
pub fn parse_option_header(b: &[u8; 16]) -> Option<OptionHeader> {
    let magic = u64::from_be_bytes(b[..8].try_into().expect("8 bytes"));
    (magic == IHAVEOPT).then(|| OptionHeader {
        option: u32::from_be_bytes(b[8..12].try_into().expect("4 bytes")),
        length: u32::from_be_bytes(b[12..16].try_into().expect("4 bytes")),
    })
}

/// An option reply.
pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&reply.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// The answer to NBD_OPT_EXPORT_NAME: size, flags and (unless no-zeroes) 124 zero bytes.
pub fn export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut b = Vec::with_capacity(134);
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        b.extend_from_slice(&[0; 124]);
    }
    b
}

/// NBD_INFO_EXPORT payload.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&info::EXPORT.to_be_bytes());
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b
}

/// NBD_INFO_BLOCK_SIZE payload.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(14);
    b.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    for v in [min, preferred, max] {
        b.extend_from_slice(&v.to_be_bytes());
    }
    b
}

/// NBD_INFO_NAME or NBD_INFO_DESCRIPTION payload.
pub fn info_text(kind: u16, text: &str) -> Vec<u8> {
    let mut b = kind.to_be_bytes().to_vec();
    b.extend_from_slice(text.as_bytes());
    b
}

/// NBD_REP_SERVER payload (one export of a LIST).
pub fn rep_server(name: &str) -> Vec<u8> {
    let mut b = (name.len() as u32).to_be_bytes().to_vec();
    b.extend_from_slice(name.as_bytes());
    b
}

/// The data of NBD_OPT_INFO/NBD_OPT_GO: export name and the info items asked for.
pub fn parse_info_request(d: &[u8]) -> Option<(String, Vec<u16>)> {
    let n = u32::from_be_bytes(d.get(..4)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(d.get(4..4 + n)?).ok()?.to_owned();
    let rest = &d[4 + n..];
    let count = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?) as usize;
    let items = rest.get(2..)?;
    if items.len() != count * 2 {
        return None;
    }
    Some((name, items.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect()))
}

/// A transmission request (compact or extended: the length is 64 bits either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command.
    pub command: u16,
    /// Cookie (handle), echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Bytes: the effect length, or with [`Request::payload`] the payload that follows.
    pub length: u64,
}

impl Request {
    /// Bytes of payload that follow the header: a WRITE's length, whatever its flags; with
    /// extended headers, also the length of any other request flagged [`cflag::PAYLOAD_LEN`].
    ///
    /// The NBD protocol says a client with extended headers MUST flag every WRITE with
    /// NBD_CMD_FLAG_PAYLOAD_LEN, but qemu's client (8.2 and later, which negotiate extended
    /// headers) never does, and qemu's own server and nbdkit take such a WRITE's length as its
    /// payload. Reading a WRITE's payload only when the flag was set left qemu's data in the
    /// stream to be read as the next request header (`bad request magic 0xabababab`).
    pub fn payload(&self, extended: bool) -> Option<u64> {
        let has = self.command == cmd::WRITE || extended && self.flags & cflag::PAYLOAD_LEN != 0;
        has.then_some(self.length)
    }
}

/// Length of a compact request header.
pub const REQUEST_LEN: usize = 28;
/// Length of an extended request header.
pub const EXTENDED_REQUEST_LEN: usize = 32;

/// The request header length of a connection with (or without) extended headers.
pub fn request_len(extended: bool) -> usize {
    if extended {
        EXTENDED_REQUEST_LEN
    } else {
        REQUEST_LEN
    }
}

/// Why a request header was refused. The stream cannot be framed after one: the connection
/// ends (a hard disconnect, as the NBD protocol has it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadRequest {
    /// Neither request magic.
    Magic(u32),
    /// A compact header on a connection that negotiated extended headers.
    CompactAfterExtended,
    /// An extended header on a connection that did not negotiate them.
    ExtendedNotNegotiated,
    /// Fewer bytes than a header.
    Short,
    /// A payload (a WRITE's, or any NBD_CMD_FLAG_PAYLOAD_LEN request's) of this many bytes, over
    /// the largest request accepted (`nbd::MAX_REQUEST`): the server will not take it in.
    PayloadTooLarge(u64),
}

impl std::fmt::Display for BadRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadRequest::Magic(m) => write!(f, "bad request magic {m:#010x}"),
            BadRequest::CompactAfterExtended => {
                f.write_str("a compact request header after extended headers were negotiated")
            }
            BadRequest::ExtendedNotNegotiated => {
                f.write_str("an extended request header without NBD_OPT_EXTENDED_HEADERS negotiated")
            }
            BadRequest::Short => f.write_str("a short request header"),
            BadRequest::PayloadTooLarge(n) => {
                write!(f, "a request payload of {n} bytes, over the maximum of {}", super::MAX_REQUEST)
            }
        }
    }
}

impl std::error::Error for BadRequest {}

/// The queries of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT: export name and the
/// query strings. `None` if the lengths do not add up or a string is not UTF-8.
pub fn parse_meta_request(d: &[u8]) -> Option<(String, Vec<String>)> {
    let n = u32::from_be_bytes(d.get(..4)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(d.get(4..4usize.checked_add(n)?)?).ok()?.to_owned();
    let mut rest = &d[4 + n..];
    let count = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    rest = &rest[4..];
    // Each query takes at least its 4-byte length: a count larger than that is a lie.
    if count > rest.len() / 4 {
        return None;
    }
    let mut queries = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let q = std::str::from_utf8(rest.get(4..4usize.checked_add(len)?)?).ok()?;
        queries.push(q.to_owned());
        rest = &rest[4 + len..];
    }
    rest.is_empty().then_some((name, queries))
}

/// NBD_REP_META_CONTEXT payload: context id and name.
pub fn rep_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut b = id.to_be_bytes().to_vec();
    b.extend_from_slice(name.as_bytes());
    b
}

/// Parses a request header of [`request_len`]`(extended)` bytes (the first bytes of `b`).
pub fn parse_request(b: &[u8], extended: bool) -> Result<Request, BadRequest> {
    let b = b.get(..request_len(extended)).ok_or(BadRequest::Short)?;
    let be32 = |r: std::ops::Range<usize>| u32::from_be_bytes(b[r].try_into().expect("4 bytes"));
    let be64 = |r: std::ops::Range<usize>| u64::from_be_bytes(b[r].try_into().expect("8 bytes"));
    match (be32(0..4), extended) {
        (REQUEST_MAGIC, false) | (EXTENDED_REQUEST_MAGIC, true) => {}
        (REQUEST_MAGIC, true) => return Err(BadRequest::CompactAfterExtended),
        (EXTENDED_REQUEST_MAGIC, false) => return Err(BadRequest::ExtendedNotNegotiated),
        (m, _) => return Err(BadRequest::Magic(m)),
    }
    Ok(Request {
        flags: u16::from_be_bytes([b[4], b[5]]),
        command: u16::from_be_bytes([b[6], b[7]]),
        cookie: be64(8..16),
        offset: be64(16..24),
        length: if extended { be64(24..32) } else { be32(24..28) as u64 },
    })
}

/// The payload that follows `req`'s header on a connection with (or without) extended headers:
/// its length, `None` for none. A payload over `nbd::MAX_REQUEST` is
/// [`BadRequest::PayloadTooLarge`]: the connection ends before it is read (the NBD protocol's hard
/// disconnect; the stream cannot be framed without reading it).
pub fn check_payload(req: &Request, extended: bool) -> Result<Option<u64>, BadRequest> {
    match req.payload(extended) {
        Some(n) if n > super::MAX_REQUEST as u64 => Err(BadRequest::PayloadTooLarge(n)),
        p => Ok(p),
    }
}

/// What [`check_request`] checks a request against: the export and what was negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// Export size in bytes.
    pub size: u64,
    /// The export is read-only.
    pub read_only: bool,
    /// The export discards (TRIM is supported).
    pub discard: bool,
    /// Extended headers were negotiated.
    pub extended: bool,
    /// The `base:allocation` metadata context was selected (BLOCK_STATUS is allowed).
    pub allocation: bool,
}

/// What a request that passed [`check_request`] asks of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing for the volume: success at once (a zero length, CACHE, a TRIM that covers no
    /// whole sector).
    Done,
    /// FLUSH (its range ignored).
    Flush,
    /// READ of the request's range (an unaligned one reads the covering sectors).
    Read,
    /// WRITE of the request's range (whole sectors) with its payload.
    Write,
    /// TRIM: discard the whole sectors inside the request's range (advisory, so the ends are
    /// dropped).
    Trim {
        /// The first whole sector's offset.
        start: u64,
        /// Bytes of whole sectors (at least one sector).
        length: u64,
        /// FUA: a FLUSH after the discard succeeds, then the reply.
        flush: bool,
    },
    /// WRITE_ZEROES of the request's range (whole sectors).
    WriteZeroes,
    /// BLOCK_STATUS of `base:allocation` over the request's range.
    BlockStatus,
}

/// The one NBD request validator: what to do with a whole request (its payload read), or the NBD
/// error to answer it with, without going to the volume. In this order:
///
/// 1. NBD_CMD_FLAG_PAYLOAD_LEN without extended headers, or with extended headers on a command
///    other than WRITE: EINVAL (its payload was read: [`Request::payload`]). A WRITE with extended
///    headers and without the flag is taken, as qemu sends it.
/// 2. An unknown command: EINVAL. FLUSH ignores its range.
/// 3. A range past the end of the export (or whose end overflows): EINVAL, ENOSPC for a WRITE.
/// 4. A READ longer than `nbd::MAX_REQUEST`, a TRIM or WRITE_ZEROES longer than
///    `nbd::MAX_EFFECT`: EOVERFLOW. A BLOCK_STATUS without `base:allocation` selected, or of length
///    zero: EINVAL.
/// 5. A WRITE or WRITE_ZEROES of at least one byte not in whole 512-byte sectors (the advertised
///    minimum block size): EINVAL.
/// 6. A TRIM on an export that does not discard (TRIM not advertised): ENOTSUP.
/// 7. A WRITE, TRIM or WRITE_ZEROES on a read-only export: EPERM.
///
/// Then a zero length (a READ, WRITE, TRIM or WRITE_ZEROES; a CACHE whatever its length) is
/// [`Action::Done`].
pub fn check_request(req: &Request, rules: &Rules) -> Result<Action, u32> {
    const SECTOR: u64 = super::SECTOR;
    let (off, len) = (req.offset, req.length);
    let payload = req.flags & cflag::PAYLOAD_LEN != 0;
    if payload && (!rules.extended || req.command != cmd::WRITE) {
        return Err(errno::EINVAL);
    }
    match req.command {
        cmd::FLUSH => return Ok(Action::Flush),
        cmd::READ | cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES | cmd::CACHE | cmd::BLOCK_STATUS => {}
        _ => return Err(errno::EINVAL),
    }
    if off.checked_add(len).is_none_or(|end| end > rules.size) {
        return Err(if req.command == cmd::WRITE { errno::ENOSPC } else { errno::EINVAL });
    }
    match req.command {
        cmd::READ if len > super::MAX_REQUEST as u64 => return Err(errno::EOVERFLOW),
        cmd::TRIM | cmd::WRITE_ZEROES if len > super::MAX_EFFECT => return Err(errno::EOVERFLOW),
        cmd::BLOCK_STATUS if !rules.allocation || len == 0 => return Err(errno::EINVAL),
        cmd::WRITE | cmd::WRITE_ZEROES if len > 0 && (off % SECTOR != 0 || len % SECTOR != 0) => {
            return Err(errno::EINVAL)
        }
        cmd::TRIM if !rules.discard => return Err(errno::ENOTSUP),
        _ => {}
    }
    let modifies = matches!(req.command, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
    if rules.read_only && modifies {
        return Err(errno::EPERM);
    }
    Ok(match req.command {
        cmd::BLOCK_STATUS => Action::BlockStatus,
        cmd::CACHE => Action::Done,
        _ if len == 0 => Action::Done,
        cmd::READ => Action::Read,
        cmd::WRITE => Action::Write,
        cmd::WRITE_ZEROES => Action::WriteZeroes,
        _ => {
            // TRIM: the whole sectors inside the range.
            let end = (off + len) / SECTOR * SECTOR;
            match off.checked_next_multiple_of(SECTOR) {
                Some(start) if start < end => {
                    Action::Trim { start, length: end - start, flush: req.flags & cflag::FUA != 0 }
                }
                _ => Action::Done,
            }
        }
    })
}

/// A simple reply header (read data follows it on success).
pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Most bytes of a reply head: an extended chunk header (32) and the largest fixed payload part
/// (an OFFSET_HOLE's 12).
const HEAD_MAX: usize = 48;

/// A reply's header: a simple reply, or a structured or extended chunk header with the fixed
/// part of its payload (a read's offset, a hole's offset and size, an error's number, a block
/// status's context id and count). Inline, no allocation per reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    b: [u8; HEAD_MAX],
    n: u8,
}

impl Head {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.b[..self.n as usize]
    }

    fn put(&mut self, bytes: &[u8]) {
        let at = self.n as usize;
        self.b[at..at + bytes.len()].copy_from_slice(bytes);
        self.n += bytes.len() as u8;
    }

    /// A simple reply (read data, if any, follows).
    pub fn simple(error: u32, cookie: u64) -> Head {
        let mut h = Head { b: [0; HEAD_MAX], n: 0 };
        h.put(&simple_reply(error, cookie));
        h
    }

    /// A chunk header of type `kind` answering `req` (flagged DONE when `done`), whose payload is
    /// `fixed` and then `more` bytes that follow the head: structured (20 bytes), or extended
    /// (32 bytes, echoing the request's offset, 64-bit length).
    fn chunk(extended: bool, req: &Request, done: bool, kind: u16, fixed: &[u8], more: usize) -> Head {
        let mut h = Head { b: [0; HEAD_MAX], n: 0 };
        let flags = if done { chunk::FLAG_DONE } else { 0 };
        h.put(&if extended { EXTENDED_REPLY_MAGIC } else { STRUCTURED_REPLY_MAGIC }.to_be_bytes());
        h.put(&flags.to_be_bytes());
        h.put(&kind.to_be_bytes());
        h.put(&req.cookie.to_be_bytes());
        let len = fixed.len() + more;
        if extended {
            h.put(&req.offset.to_be_bytes());
            h.put(&(len as u64).to_be_bytes());
        } else {
            h.put(&(len as u32).to_be_bytes());
        }
        h.put(fixed);
        h
    }

    /// NBD_REPLY_TYPE_NONE, DONE: success without data.
    pub fn none(extended: bool, req: &Request) -> Head {
        Head::chunk(extended, req, true, chunk::NONE, &[], 0)
    }

    /// NBD_REPLY_TYPE_OFFSET_DATA of `len` bytes at `offset` (the data follows).
    pub fn read_data(extended: bool, req: &Request, offset: u64, len: usize, done: bool) -> Head {
        Head::chunk(extended, req, done, chunk::OFFSET_DATA, &offset.to_be_bytes(), len)
    }

    /// NBD_REPLY_TYPE_OFFSET_HOLE: `len` bytes at `offset` read as zeroes.
    pub fn hole(extended: bool, req: &Request, offset: u64, len: u32, done: bool) -> Head {
        let mut fixed = [0u8; 12];
        fixed[..8].copy_from_slice(&offset.to_be_bytes());
        fixed[8..].copy_from_slice(&len.to_be_bytes());
        Head::chunk(extended, req, done, chunk::OFFSET_HOLE, &fixed, 0)
    }

    /// NBD_REPLY_TYPE_ERROR with `error` and no message.
    pub fn error(extended: bool, req: &Request, error: u32, done: bool) -> Head {
        let mut fixed = [0u8; 6];
        fixed[..4].copy_from_slice(&error.to_be_bytes());
        Head::chunk(extended, req, done, chunk::ERROR, &fixed, 0)
    }

    /// NBD_REPLY_TYPE_BLOCK_STATUS (or, extended, NBD_REPLY_TYPE_BLOCK_STATUS_EXT with its
    /// descriptor count) of context `id`, DONE, with `count` descriptors (written by
    /// [`descriptor`]) following.
    pub fn block_status(extended: bool, req: &Request, id: u32, count: usize) -> Head {
        if extended {
            let mut fixed = [0u8; 8];
            fixed[..4].copy_from_slice(&id.to_be_bytes());
            fixed[4..].copy_from_slice(&(count as u32).to_be_bytes());
            Head::chunk(true, req, true, chunk::BLOCK_STATUS_EXT, &fixed, count * 16)
        } else {
            Head::chunk(false, req, true, chunk::BLOCK_STATUS, &id.to_be_bytes(), count * 8)
        }
    }
}

/// Appends one block status descriptor: 32-bit length and state, or (extended) 64-bit length
/// and state. A compact descriptor's length must fit 32 bits (the caller's range does).
pub fn descriptor(extended: bool, len: u64, state: u32, out: &mut Vec<u8>) {
    if extended {
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&(state as u64).to_be_bytes());
    } else {
        out.extend_from_slice(&(len as u32).to_be_bytes());
        out.extend_from_slice(&state.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_bytes() {
        assert_eq!(
            greeting(),
            [b'N', b'B', b'D', b'M', b'A', b'G', b'I', b'C', b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T', 0, 3]
        );
    }

    #[test]
    fn option_header_parses_and_rejects_bad_magic() {
        let mut b = *b"IHAVEOPT\0\0\0\x07\0\0\0\x0c";
        assert_eq!(parse_option_header(&b), Some(OptionHeader { option: opt::GO, length: 12 }));
        b[0] = b'X';
        assert_eq!(parse_option_header(&b), None);
    }

    #[test]
    fn option_reply_bytes() {
        let r = option_reply(opt::LIST, rep::SERVER, &rep_server("ram"));
        assert_eq!(
            r,
            [
                0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // magic
                0, 0, 0, 3, // option
                0, 0, 0, 2, // NBD_REP_SERVER
                0, 0, 0, 7, // length
                0, 0, 0, 3, b'r', b'a', b'm'
            ]
        );
        let e = option_reply(opt::STRUCTURED_REPLY, rep::ERR_UNSUP, &[]);
        assert_eq!(&e[12..], &[0x80, 0, 0, 1, 0, 0, 0, 0]);
        let e = option_reply(opt::EXTENDED_HEADERS, rep::ERR_EXT_HEADER_REQD, &[]);
        assert_eq!(&e[8..], &[0, 0, 0, 11, 0x80, 0, 0, 10, 0, 0, 0, 0]);
    }

    #[test]
    fn info_items_bytes() {
        let flags = tflag::HAS_FLAGS | tflag::SEND_FLUSH | tflag::SEND_FUA | tflag::CAN_MULTI_CONN;
        assert_eq!(info_export(1 << 30, flags), [0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0, 0x01, 0x0d]);
        assert_eq!(info_block_size(512, 4096, 32 << 20), [0, 3, 0, 0, 2, 0, 0, 0, 0x10, 0, 0x02, 0, 0, 0]);
        assert_eq!(info_text(info::NAME, "ab"), [0, 1, b'a', b'b']);
        assert_eq!(export_name_reply(512, 1, true), [0, 0, 0, 0, 0, 0, 2, 0, 0, 1]);
        assert_eq!(export_name_reply(512, 1, false).len(), 134);
    }

    #[test]
    fn info_request_parses() {
        let d = [0, 0, 0, 3, b'r', b'a', b'm', 0, 2, 0, 3, 0, 1];
        assert_eq!(parse_info_request(&d), Some(("ram".to_owned(), vec![info::BLOCK_SIZE, info::NAME])));
        assert_eq!(parse_info_request(&[0, 0, 0, 0, 0, 0]), Some((String::new(), vec![])));
        assert_eq!(parse_info_request(&d[..12]), None, "item list shorter than its count");
        assert_eq!(parse_info_request(&[0, 0, 0, 9, b'x']), None, "name longer than the data");
        assert_eq!(parse_info_request(&[0, 0, 0, 1, 0xff, 0, 0]), None, "name not UTF-8");
    }

    #[test]
    fn request_and_reply_bytes() {
        let b = [
            0x25, 0x60, 0x95, 0x13, // magic
            0, 1, // FUA
            0, 1, // WRITE
            1, 2, 3, 4, 5, 6, 7, 8, // cookie
            0, 0, 0, 0, 0, 0, 0x10, 0, // offset 4096
            0, 0, 0x02, 0, // length 512
        ];
        let want = Request {
            flags: cflag::FUA,
            command: cmd::WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: 4096,
            length: 512,
        };
        assert_eq!(parse_request(&b, false), Ok(want));
        assert_eq!(want.payload(false), Some(512), "a compact WRITE carries its length");
        let mut bad = b;
        bad[3] = 0;
        assert_eq!(parse_request(&bad, false), Err(BadRequest::Magic(0x2560_9500)));
        assert_eq!(parse_request(&b, true), Err(BadRequest::Short), "28 bytes are no extended header");
        assert_eq!(parse_request(&b[..27], false), Err(BadRequest::Short));
        assert_eq!(simple_reply(errno::EIO, 9), [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 9]);
    }

    #[test]
    fn extended_request_bytes() {
        let b = [
            0x21, 0xe4, 0x1c, 0x71, // magic
            0, 0x21, // PAYLOAD_LEN | FUA
            0, 1, // WRITE
            1, 2, 3, 4, 5, 6, 7, 8, // cookie
            0, 0, 0, 1, 0, 0, 0, 0, // offset 4 GiB
            0, 0, 0, 0, 0, 0, 0x10, 0, // length 4096
        ];
        let r = parse_request(&b, true).unwrap();
        assert_eq!(
            r,
            Request {
                flags: cflag::PAYLOAD_LEN | cflag::FUA,
                command: cmd::WRITE,
                cookie: 0x0102_0304_0506_0708,
                offset: 1 << 32,
                length: 4096
            }
        );
        assert_eq!(r.payload(true), Some(4096));
        // A TRIM of 8 TiB: an effect length over 32 bits, no payload.
        let mut t = b;
        t[4..8].copy_from_slice(&[0, 0, 0, 4]);
        t[24..32].copy_from_slice(&(8u64 << 40).to_be_bytes());
        let r = parse_request(&t, true).unwrap();
        assert_eq!((r.command, r.length, r.payload(true)), (cmd::TRIM, 8 << 40, None));
        // The wrong header for what was negotiated, either way, and a bad magic.
        assert_eq!(parse_request(&b, false), Err(BadRequest::ExtendedNotNegotiated));
        let mut compact = [0u8; 32];
        compact[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        assert_eq!(parse_request(&compact, true), Err(BadRequest::CompactAfterExtended));
        compact[..4].copy_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(parse_request(&compact, true), Err(BadRequest::Magic(EXTENDED_REPLY_MAGIC)));
        assert_eq!(parse_request(&b[..31], true), Err(BadRequest::Short));
        assert!(BadRequest::CompactAfterExtended.to_string().contains("extended headers were negotiated"));
    }

    fn req(cookie: u64, offset: u64, length: u64) -> Request {
        Request { flags: 0, command: cmd::READ, cookie, offset, length }
    }

    #[test]
    fn structured_chunks_bytes() {
        let magic = [0x66, 0x8e, 0x33, 0xef];
        let r = Head::read_data(false, &req(7, 4096, 512), 4096, 512, true);
        let mut want = magic.to_vec();
        want.extend([0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 2, 8, 0, 0, 0, 0, 0, 0, 0x10, 0]);
        assert_eq!(r.as_slice(), want);
        let mut want = magic.to_vec();
        want.extend([0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0]);
        assert_eq!(Head::none(false, &req(7, 0, 0)).as_slice(), want, "NONE");
        let mut want = magic.to_vec();
        want.extend([0, 1, 0x80, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 6, 0, 0, 0, 5, 0, 0]);
        assert_eq!(Head::error(false, &req(9, 0, 1), errno::EIO, true).as_slice(), want);
        let mut want = magic.to_vec();
        want.extend([0, 1, 0, 5, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 20, 0, 0, 0, 1]);
        assert_eq!(Head::block_status(false, &req(3, 0, 1), BASE_ALLOCATION_ID, 2).as_slice(), want);
        // A hole chunk, not the last: flags 0, type 2, 12 bytes of offset and size.
        let mut want = magic.to_vec();
        want.extend([0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 12]);
        want.extend([0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0x02, 0, 0]);
        assert_eq!(Head::hole(false, &req(4, 0, 1 << 21), 1 << 20, 128 << 10, false).as_slice(), want);
        assert_eq!(Head::simple(0, 2).as_slice(), simple_reply(0, 2));
        let mut d = Vec::new();
        descriptor(false, 4096, state::HOLE | state::ZERO, &mut d);
        assert_eq!(d, [0, 0, 0x10, 0, 0, 0, 0, 3]);
    }

    #[test]
    fn extended_chunks_bytes() {
        let magic = [0x6e, 0x8a, 0x27, 0x8c];
        // Header: magic, flags, type, cookie, the request's offset, 64-bit payload length.
        let head = |flags: u16, kind: u16, cookie: u64, offset: u64, len: u64| {
            let mut v = magic.to_vec();
            v.extend(flags.to_be_bytes());
            v.extend(kind.to_be_bytes());
            v.extend(cookie.to_be_bytes());
            v.extend(offset.to_be_bytes());
            v.extend(len.to_be_bytes());
            v
        };
        let r = req(7, 1 << 33, 1 << 20);
        assert_eq!(Head::none(true, &r).as_slice(), head(1, 0, 7, 1 << 33, 0));
        assert_eq!(Head::none(true, &r).as_slice().len(), 32);
        // A data chunk in the middle of the read: its own offset in the payload, the request's in
        // the header.
        let mut want = head(0, 1, 7, 1 << 33, 8 + 4096);
        want.extend(((1u64 << 33) + 8192).to_be_bytes());
        assert_eq!(Head::read_data(true, &r, (1 << 33) + 8192, 4096, false).as_slice(), want);
        let mut want = head(1, 2, 7, 1 << 33, 12);
        want.extend((1u64 << 33).to_be_bytes());
        want.extend((64u32 << 10).to_be_bytes());
        assert_eq!(Head::hole(true, &r, 1 << 33, 64 << 10, true).as_slice(), want);
        assert_eq!(Head::hole(true, &r, 0, 1, true).as_slice().len(), 44, "the largest head");
        let mut want = head(1, 0x8001, 7, 1 << 33, 6);
        want.extend([0, 0, 0, 75, 0, 0]);
        assert_eq!(Head::error(true, &r, errno::EOVERFLOW, true).as_slice(), want);
        // BLOCK_STATUS_EXT: context id, descriptor count, then 16-byte descriptors.
        let mut want = head(1, 6, 7, 1 << 33, 8 + 2 * 16);
        want.extend([0, 0, 0, 1, 0, 0, 0, 2]);
        assert_eq!(Head::block_status(true, &r, BASE_ALLOCATION_ID, 2).as_slice(), want);
        let mut d = Vec::new();
        descriptor(true, 5 << 32, state::ZERO, &mut d);
        assert_eq!(d, [0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
    }

    #[test]
    fn meta_requests_parse() {
        let mut d = vec![0, 0, 0, 3, b'r', b'a', b'm', 0, 0, 0, 2];
        d.extend([0, 0, 0, 5]);
        d.extend(b"base:");
        d.extend([0, 0, 0, 15]);
        d.extend(b"base:allocation");
        assert_eq!(parse_meta_request(&d), Some(("ram".into(), vec!["base:".into(), "base:allocation".into()])));
        assert_eq!(parse_meta_request(&[0, 0, 0, 0, 0, 0, 0, 0]), Some((String::new(), vec![])));
        assert_eq!(parse_meta_request(&d[..d.len() - 1]), None, "query shorter than its length");
        let mut extra = d.clone();
        extra.push(0);
        assert_eq!(parse_meta_request(&extra), None, "bytes after the last query");
        assert_eq!(parse_meta_request(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]), None, "a count that cannot fit");
        assert_eq!(parse_meta_request(&[0xff, 0xff, 0xff, 0xff]), None, "a name that cannot fit");
        assert_eq!(rep_meta_context(1, "ab"), [0, 0, 0, 1, b'a', b'b']);
    }

    /// The bytes of a request header: compact (28 bytes, 32-bit length) or extended (32 bytes).
    fn header(extended: bool, flags: u16, command: u16, offset: u64, length: u64) -> Vec<u8> {
        let magic = if extended { EXTENDED_REQUEST_MAGIC } else { REQUEST_MAGIC };
        let mut b = magic.to_be_bytes().to_vec();
        b.extend(flags.to_be_bytes());
        b.extend(command.to_be_bytes());
        b.extend(7u64.to_be_bytes());
        b.extend(offset.to_be_bytes());
        if extended {
            b.extend(length.to_be_bytes());
        } else {
            b.extend(u32::try_from(length).expect("a compact length").to_be_bytes());
        }
        b
    }

    const MIB: u64 = 1 << 20;
    /// A writable, discarding 1 MiB export with `base:allocation`, compact headers.
    const RW: Rules = Rules { size: MIB, read_only: false, discard: true, extended: false, allocation: true };

    /// [`check_request`] on the request these header bytes carry.
    fn check(rules: &Rules, flags: u16, command: u16, offset: u64, length: u64) -> Result<Action, u32> {
        let b = header(rules.extended, flags, command, offset, length);
        assert_eq!(b.len(), request_len(rules.extended));
        let req = parse_request(&b, rules.extended).expect("a well-formed header");
        check_request(&req, rules)
    }

    #[test]
    fn validator_refuses_payload_flags_that_do_not_match_the_negotiation() {
        let pl = cflag::PAYLOAD_LEN;
        assert_eq!(check(&RW, pl, cmd::WRITE, 0, 512), Err(errno::EINVAL), "PAYLOAD_LEN without extended headers");
        assert_eq!(check(&RW, pl, cmd::READ, 0, 512), Err(errno::EINVAL));
        let ext = Rules { extended: true, ..RW };
        assert_eq!(check(&ext, pl, cmd::WRITE, 0, 4096), Ok(Action::Write));
        assert_eq!(check(&ext, 0, cmd::WRITE, 0, 4096), Ok(Action::Write), "an extended WRITE without it (qemu's)");
        assert_eq!(check(&ext, pl, cmd::READ, 0, 4096), Err(errno::EINVAL), "a READ with a payload");
        assert_eq!(check(&ext, pl, cmd::FLUSH, 0, 8), Err(errno::EINVAL), "before FLUSH's range is ignored");
        assert_eq!(check(&ext, pl, cmd::CACHE, 0, 512), Err(errno::EINVAL));
    }

    #[test]
    fn validator_refuses_unknown_commands_and_flush_ignores_its_range() {
        for command in [cmd::DISC, 8, 99, u16::MAX] {
            assert_eq!(check(&RW, 0, command, 0, 512), Err(errno::EINVAL), "command {command}");
        }
        assert_eq!(check(&RW, 0, cmd::FLUSH, u64::MAX, 9), Ok(Action::Flush), "FLUSH ignores its range");
        let ro = Rules { read_only: true, ..RW };
        assert_eq!(check(&ro, cflag::FUA, cmd::FLUSH, 0, 0), Ok(Action::Flush), "FLUSH on a read-only export");
    }

    #[test]
    fn validator_refuses_ranges_past_the_end() {
        // One byte over: EINVAL, ENOSPC for a WRITE (the NBD protocol's choice), whatever the
        // length (a zero length at the very end is inside).
        for command in [cmd::READ, cmd::TRIM, cmd::WRITE_ZEROES, cmd::CACHE, cmd::BLOCK_STATUS] {
            assert_eq!(check(&RW, 0, command, MIB - 512, 1024), Err(errno::EINVAL), "command {command}");
            assert_eq!(check(&RW, 0, command, MIB + 512, 0), Err(errno::EINVAL), "command {command}");
        }
        assert_eq!(check(&RW, 0, cmd::WRITE, MIB, 512), Err(errno::ENOSPC));
        assert_eq!(check(&RW, 0, cmd::WRITE, MIB, 0), Ok(Action::Done), "an empty write at the end");
        assert_eq!(check(&RW, 0, cmd::READ, MIB, 0), Ok(Action::Done));
        // An end that overflows 64 bits is past the end too.
        assert_eq!(check(&RW, 0, cmd::READ, u64::MAX, 512), Err(errno::EINVAL), "overflow");
        let ext = Rules { extended: true, size: u64::MAX, ..RW };
        assert_eq!(check(&ext, 0, cmd::READ, u64::MAX - 10, 1 << 33), Err(errno::EINVAL), "overflow");
        assert_eq!(check(&ext, cflag::PAYLOAD_LEN, cmd::WRITE, 512, u64::MAX), Err(errno::ENOSPC), "overflow");
    }

    #[test]
    fn validator_refuses_lengths_over_the_maxima() {
        let max = super::super::MAX_REQUEST as u64;
        let effect = super::super::MAX_EFFECT;
        let big = Rules { size: 4 << 40, ..RW };
        assert_eq!(check(&big, 0, cmd::READ, 0, max), Ok(Action::Read));
        assert_eq!(check(&big, 0, cmd::READ, 0, max + 512), Err(errno::EOVERFLOW));
        // 64-bit effect lengths (extended headers): up to MAX_EFFECT for TRIM and WRITE_ZEROES, the
        // export for BLOCK_STATUS and CACHE, MAX_REQUEST for READ.
        let ext = Rules { extended: true, ..big };
        assert_eq!(check(&ext, 0, cmd::TRIM, 0, effect), Ok(Action::Trim { start: 0, length: effect, flush: false }));
        assert_eq!(check(&ext, 0, cmd::TRIM, 0, effect + 512), Err(errno::EOVERFLOW));
        assert_eq!(check(&ext, 0, cmd::WRITE_ZEROES, 0, effect), Ok(Action::WriteZeroes));
        assert_eq!(check(&ext, 0, cmd::WRITE_ZEROES, 0, 2 << 40), Err(errno::EOVERFLOW));
        assert_eq!(check(&ext, 0, cmd::BLOCK_STATUS, 0, 4 << 40), Ok(Action::BlockStatus));
        assert_eq!(check(&ext, 0, cmd::CACHE, 0, 4 << 40), Ok(Action::Done));
        assert_eq!(check(&ext, 0, cmd::READ, 0, 1 << 33), Err(errno::EOVERFLOW));
        // Past the end comes first.
        assert_eq!(check(&ext, 0, cmd::READ, 4 << 40, 1 << 33), Err(errno::EINVAL));
    }

    #[test]
    fn validator_refuses_block_status_without_its_context_or_length() {
        assert_eq!(check(&RW, 0, cmd::BLOCK_STATUS, 0, 4096), Ok(Action::BlockStatus));
        assert_eq!(check(&RW, cflag::REQ_ONE, cmd::BLOCK_STATUS, 100, 1), Ok(Action::BlockStatus));
        assert_eq!(check(&RW, 0, cmd::BLOCK_STATUS, 0, 0), Err(errno::EINVAL), "length zero");
        let none = Rules { allocation: false, ..RW };
        assert_eq!(check(&none, 0, cmd::BLOCK_STATUS, 0, 4096), Err(errno::EINVAL), "no base:allocation");
        // A read-only export answers block status.
        let ro = Rules { read_only: true, ..RW };
        assert_eq!(check(&ro, 0, cmd::BLOCK_STATUS, 0, 4096), Ok(Action::BlockStatus));
    }

    #[test]
    fn validator_refuses_writes_not_in_whole_sectors() {
        for command in [cmd::WRITE, cmd::WRITE_ZEROES] {
            assert_eq!(check(&RW, 0, command, 100, 512), Err(errno::EINVAL), "command {command}: offset");
            assert_eq!(check(&RW, 0, command, 512, 100), Err(errno::EINVAL), "command {command}: length");
            assert_eq!(check(&RW, 0, command, 100, 0), Ok(Action::Done), "command {command}: empty");
        }
        // Reads read the covering sectors; a TRIM trims the whole sectors inside.
        assert_eq!(check(&RW, 0, cmd::READ, 100, 100), Ok(Action::Read));
        assert_eq!(check(&RW, 0, cmd::TRIM, 100, 1000), Ok(Action::Trim { start: 512, length: 512, flush: false }));
        assert_eq!(
            check(&RW, cflag::FUA, cmd::TRIM, 0, 4096),
            Ok(Action::Trim { start: 0, length: 4096, flush: true })
        );
        assert_eq!(check(&RW, cflag::FUA, cmd::TRIM, 100, 500), Ok(Action::Done), "no whole sector");
        // Alignment comes before read-only (the volume's order, which answered it before).
        let ro = Rules { read_only: true, ..RW };
        assert_eq!(check(&ro, 0, cmd::WRITE, 100, 512), Err(errno::EINVAL));
    }

    #[test]
    fn validator_refuses_trim_where_the_export_does_not_discard() {
        let nd = Rules { discard: false, ..RW };
        assert_eq!(check(&nd, 0, cmd::TRIM, 0, 4096), Err(errno::ENOTSUP));
        assert_eq!(check(&nd, 0, cmd::TRIM, 100, 100), Err(errno::ENOTSUP), "no whole sector");
        // Stricter than before, where a zero-length TRIM succeeded on either path: the command is
        // refused whatever its length.
        assert_eq!(check(&nd, 0, cmd::TRIM, 0, 0), Err(errno::ENOTSUP), "a zero length");
        assert_eq!(check(&nd, 0, cmd::TRIM, MIB, 512), Err(errno::EINVAL), "past the end first");
        assert_eq!(check(&nd, 0, cmd::WRITE_ZEROES, 0, 4096), Ok(Action::WriteZeroes));
        // Not discarding comes before read-only.
        let ro = Rules { read_only: true, ..nd };
        assert_eq!(check(&ro, 0, cmd::TRIM, 0, 4096), Err(errno::ENOTSUP));
    }

    #[test]
    fn validator_refuses_modifications_of_a_read_only_export() {
        let ro = Rules { read_only: true, ..RW };
        for command in [cmd::WRITE, cmd::TRIM, cmd::WRITE_ZEROES] {
            assert_eq!(check(&ro, 0, command, 0, 4096), Err(errno::EPERM), "command {command}");
            // Stricter than before (both paths left read-only to the volume, which a zero length
            // or a TRIM of no whole sector never reached: they succeeded): EPERM whatever the length,
            // as the NBD protocol asks of a write or trim on a read-only export.
            assert_eq!(check(&ro, 0, command, 0, 0), Err(errno::EPERM), "command {command}, zero length");
        }
        assert_eq!(check(&ro, 0, cmd::TRIM, 100, 100), Err(errno::EPERM), "a TRIM of no whole sector");
        assert_eq!(check(&ro, 0, cmd::WRITE, MIB, 512), Err(errno::ENOSPC), "past the end first");
        assert_eq!(check(&ro, 0, cmd::READ, 0, 4096), Ok(Action::Read));
        assert_eq!(check(&ro, 0, cmd::CACHE, 0, 4096), Ok(Action::Done));
    }

    #[test]
    fn validator_answers_empty_ranges_and_cache_at_once() {
        for command in [cmd::READ, cmd::WRITE, cmd::TRIM, cmd::WRITE_ZEROES] {
            assert_eq!(check(&RW, 0, command, 4096, 0), Ok(Action::Done), "command {command}");
        }
        assert_eq!(check(&RW, 0, cmd::CACHE, 0, MIB), Ok(Action::Done));
        assert_eq!(check(&RW, 0, cmd::READ, 0, 4096), Ok(Action::Read));
        assert_eq!(check(&RW, cflag::FUA, cmd::WRITE, 0, 4096), Ok(Action::Write));
        assert_eq!(check(&RW, cflag::FUA | cflag::NO_HOLE, cmd::WRITE_ZEROES, 0, 4096), Ok(Action::WriteZeroes));
    }

    #[test]
    fn payloads_over_the_maximum_end_the_connection() {
        let max = super::super::MAX_REQUEST as u64;
        let req = |extended, flags, command, length| {
            parse_request(&header(extended, flags, command, 0, length), extended).expect("a header")
        };
        assert_eq!(check_payload(&req(false, 0, cmd::WRITE, max), false), Ok(Some(max)));
        assert_eq!(
            check_payload(&req(false, 0, cmd::WRITE, max + 1), false),
            Err(BadRequest::PayloadTooLarge(max + 1))
        );
        // A READ's length is no payload; without extended headers PAYLOAD_LEN means nothing here
        // (check_request refuses it).
        assert_eq!(check_payload(&req(false, 0, cmd::READ, u32::MAX as u64), false), Ok(None));
        assert_eq!(check_payload(&req(false, cflag::PAYLOAD_LEN, cmd::READ, max + 1), false), Ok(None));
        let pl = cflag::PAYLOAD_LEN;
        assert_eq!(check_payload(&req(true, pl, cmd::WRITE, max), true), Ok(Some(max)));
        assert_eq!(check_payload(&req(true, pl, cmd::READ, 512), true), Ok(Some(512)), "read, then refused");
        assert_eq!(check_payload(&req(true, pl, cmd::TRIM, 1 << 40), true), Err(BadRequest::PayloadTooLarge(1 << 40)));
        assert_eq!(check_payload(&req(true, 0, cmd::WRITE, max), true), Ok(Some(max)), "a WRITE without the flag");
        assert_eq!(
            check_payload(&req(true, 0, cmd::WRITE, 1 << 40), true),
            Err(BadRequest::PayloadTooLarge(1 << 40)),
            "a WRITE's length is its payload, flagged or not"
        );
        assert_eq!(check_payload(&req(true, 0, cmd::READ, 1 << 40), true), Ok(None), "no payload flag: none");
        assert_eq!(
            BadRequest::PayloadTooLarge(max + 1).to_string(),
            format!("a request payload of {} bytes, over the maximum of {max}", max + 1)
        );
    }

    #[test]
    fn errno_mapping() {
        assert_eq!(errno::from_errno(libc::EOPNOTSUPP), errno::ENOTSUP);
        assert_eq!(errno::from_errno(libc::EPERM), errno::EPERM);
        assert_eq!(errno::from_errno(libc::EBADMSG), errno::EIO);
        assert_eq!(errno::from_errno(crate::Error::NoPath.errno()), errno::EIO);
        assert_eq!(errno::from_errno(crate::Error::ReadOnly.errno()), errno::EPERM);
    }
}
