//! The NBD server fed by a hostile client.
//!
//! Two parts per input:
//!
//! - the fixed-newstyle handshake ([`fuzzing::handshake`]) on client bytes in memory: flags,
//!   options of every kind with well-formed, short, overlong and huge data, bad magic, raw bytes;
//! - the engine-mode transmission ([`fuzzing::Conn`], what an engine thread serves) over a real
//!   socket pair, compact or (as after NBD_OPT_EXTENDED_HEADERS) extended headers, hole-aware
//!   reads on or off: requests of every command with chosen flags (NBD_CMD_FLAG_PAYLOAD_LEN
//!   included), offsets and lengths (in range, past the end, unaligned, overflowing, over the
//!   maximum, 64-bit), payloads cut short, compact headers on an extended connection and the
//!   other way round, raw bytes, the client's bytes delivered in arbitrary chunks, completions in
//!   arbitrary order and with errors. The volume's part is played by a RAM disk here.
//!
//! Invariants: no panic; every request handed to the volume is sector-aligned, inside the
//! export, at most the maximum request, with a buffer of its length, TRIM only where the export
//! discards, nothing that modifies a read-only export (the server's one request validator,
//! `codec::check_request`, refuses the rest); the connection never holds more than its bound of requests and data; every reply
//! is well-formed (simple, or with structured replies negotiated structured chunks for READ and
//! BLOCK_STATUS, with extended headers extended chunks for everything: a READ's content chunks
//! inside its range, not overlapping, covering it all unless an error chunk came; block status
//! extents inside the range asked, one with REQ_ONE, 64-bit descriptors with extended headers)
//! and a request is answered at most once (one chunk flagged DONE, nothing after it), also when
//! the volume's block status list is malformed; once the client closes and every request
//! completes, the connection is finished.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use arbitrary::{Arbitrary, Unstructured};
use tyche_init::nbd::codec::{self, cmd, opt};
use tyche_init::nbd::fuzzing::{self, Conn, Io, Options};
use tyche_init::Error;
use tyche_wire::{Op, Status};

const NAME: &str = "fuzz";
const MAX_ITEMS: usize = 256;
/// Most request bytes (headers and payloads) the client sends per input.
const MAX_CLIENT_BYTES: usize = 8 << 20;

/// A fuzz input for the NBD server.
#[derive(Debug, Arbitrary)]
pub struct Input {
    /// Export size in sectors.
    sectors: u16,
    read_only: bool,
    discard: bool,
    max_inflight: u8,
    /// Transmission as after NBD_OPT_STRUCTURED_REPLY and `base:allocation`.
    structured: bool,
    /// Transmission as after NBD_OPT_EXTENDED_HEADERS (structured replies implied).
    extended: bool,
    /// Reads of 4 KiB or more are hole-aware (block status first, hole chunks).
    hole_reads: bool,
    client_flags: u32,
    options: Vec<Opt>,
    items: Vec<Item>,
}

/// One option message of the handshake.
#[derive(Debug, Arbitrary)]
pub enum Opt {
    /// A well-formed option header with this option and data.
    Option { option: u8, data: OptData },
    /// An option header whose length is not the data's.
    Lying { option: u32, length: u32, data: Vec<u8> },
    /// Bytes.
    Raw(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
pub enum OptData {
    None,
    /// An export name (ours, empty or another).
    Name(u8),
    /// An NBD_OPT_INFO/GO request for a name with info items.
    Info {
        name: u8,
        items: Vec<u16>,
        count: Option<u16>,
        name_len: Option<u32>,
    },
    Bytes(Vec<u8>),
    /// An NBD_OPT_LIST/SET_META_CONTEXT request for a name with queries.
    Meta {
        name: u8,
        queries: Vec<u8>,
        count: Option<u32>,
    },
}

/// One step of the transmission phase.
#[derive(Debug, Arbitrary)]
pub enum Item {
    /// A request (`bad_magic`: the other header style's magic, or none).
    Request { command: u8, flags: u16, offset: Offset, length: Length, payload: Payload, bad_magic: Option<bool> },
    /// Bytes.
    Raw(Vec<u8>),
    /// The server reads and replies; the volume completes some of what it holds.
    Serve { complete: u8, fail: Option<u8>, newest_first: bool },
    /// The client delivers only this many of its pending bytes before the server runs.
    Trickle(u16),
}

#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Offset {
    /// In sectors, wrapping at the export's end.
    Sector(u16),
    /// Any byte offset.
    Raw(u64),
    /// Near the end.
    End(i16),
}

#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Length {
    Sectors(u8),
    Raw(u32),
    /// Just over the maximum request.
    OverMax(u8),
    /// Any 64-bit length (extended headers; cut to 32 bits in a compact header).
    Wide(u64),
}

#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Payload {
    /// As long as the request says.
    Full,
    /// Cut short (the rest of the stream is then read as payload).
    Short(u16),
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    crate::count_input();
    let size = input.sectors as u64 * 512;
    handshake(&input, size);
    transmission(&input, size);
}

fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_be_bytes());
}

fn name(k: u8) -> &'static str {
    ["", NAME, "other", "fuzz\0"][k as usize % 4]
}

fn handshake(input: &Input, size: u64) {
    let mut b = Vec::new();
    put_u32(&mut b, input.client_flags & if input.client_flags & 0x100 != 0 { u32::MAX } else { 3 });
    for o in input.options.iter().take(MAX_ITEMS) {
        crate::count_frames(1);
        match o {
            Opt::Option { option, data } => {
                let option = [
                    opt::EXPORT_NAME,
                    opt::ABORT,
                    opt::LIST,
                    opt::STARTTLS,
                    opt::INFO,
                    opt::GO,
                    opt::STRUCTURED_REPLY,
                    opt::LIST_META_CONTEXT,
                    opt::SET_META_CONTEXT,
                    opt::EXTENDED_HEADERS,
                    0,
                    99,
                ][*option as usize % 12];
                let d = match data {
                    OptData::None => Vec::new(),
                    OptData::Name(k) => name(*k).as_bytes().to_vec(),
                    OptData::Info { name: k, items, count, name_len } => {
                        let n = name(*k);
                        let mut d = Vec::new();
                        put_u32(&mut d, name_len.unwrap_or(n.len() as u32));
                        d.extend_from_slice(n.as_bytes());
                        d.extend_from_slice(&count.unwrap_or(items.len() as u16).to_be_bytes());
                        for i in items {
                            d.extend_from_slice(&(i % 5).to_be_bytes());
                        }
                        d
                    }
                    OptData::Bytes(v) => v.clone(),
                    OptData::Meta { name: k, queries, count } => {
                        let n = name(*k);
                        let mut d = Vec::new();
                        put_u32(&mut d, n.len() as u32);
                        d.extend_from_slice(n.as_bytes());
                        put_u32(&mut d, count.unwrap_or(queries.len() as u32));
                        for q in queries {
                            let q = ["base:allocation", "base:", "qemu:dirty-bitmap:x", ""][*q as usize % 4];
                            put_u32(&mut d, q.len() as u32);
                            d.extend_from_slice(q.as_bytes());
                        }
                        d
                    }
                };
                b.extend_from_slice(&codec::IHAVEOPT.to_be_bytes());
                put_u32(&mut b, option);
                put_u32(&mut b, d.len() as u32);
                b.extend_from_slice(&d);
            }
            Opt::Lying { option, length, data } => {
                b.extend_from_slice(&codec::IHAVEOPT.to_be_bytes());
                put_u32(&mut b, *option);
                put_u32(&mut b, *length);
                b.extend_from_slice(data);
            }
            Opt::Raw(v) => b.extend_from_slice(v),
        }
    }
    let (result, out, read) = fuzzing::handshake(&b, NAME, size, input.read_only, input.discard);
    assert!(read <= b.len(), "the handshake read {read} of {} bytes", b.len());
    assert!(out.starts_with(&codec::greeting()), "the handshake did not start with the greeting");
    if let Ok(true) = result {
        // Transmission starts: the last thing written is the export's details or an ACK.
        assert!(out.len() > 18, "transmission entered without a reply");
    }
}

/// The client of the transmission phase.
struct Client {
    sock: UnixStream,
    /// Bytes not yet delivered.
    pending: VecDeque<u8>,
    /// Replies not yet parsed.
    got: Vec<u8>,
    /// Requests sent by cookie: command, flags, offset and length.
    asked: HashMap<u64, Asked>,
    /// Structured replies were negotiated.
    structured: bool,
    /// Extended headers were negotiated.
    extended: bool,
    /// Content bytes received and whether an error chunk came, by cookie of a reply not done.
    partial: HashMap<u64, (u64, bool)>,
    /// Cookies answered.
    answered: HashMap<u64, u32>,
    /// Replies are no longer parseable (a reply to a cookie the client did not track).
    lost: bool,
}

impl Client {
    /// Delivers up to `max` pending bytes (as many as the socket takes).
    fn deliver(&mut self, max: usize) {
        let mut left = max;
        while left > 0 && !self.pending.is_empty() {
            let (a, _) = self.pending.as_slices();
            let n = a.len().min(left);
            match self.sock.write(&a[..n]) {
                Ok(0) => break,
                Ok(w) => {
                    self.pending.drain(..w);
                    left -= w;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // The server shut the connection down.
                Err(_) => {
                    self.pending.clear();
                    break;
                }
            }
        }
    }

    /// Reads and checks the replies the server wrote.
    fn receive(&mut self) {
        let mut buf = [0u8; 65536];
        loop {
            match self.sock.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => self.got.extend_from_slice(&buf[..n]),
                Err(_) => break,
            }
        }
        let mut at = 0;
        while !self.lost && self.got.len() - at >= 16 {
            let h = &self.got[at..];
            let magic = u32::from_be_bytes(h[..4].try_into().expect("4"));
            let (cookie, len, done) = if magic == codec::STRUCTURED_REPLY_MAGIC || magic == codec::EXTENDED_REPLY_MAGIC
            {
                let ext = magic == codec::EXTENDED_REPLY_MAGIC;
                assert_eq!(ext, self.extended, "reply magic {magic:#x} with extended headers {}", self.extended);
                assert!(self.structured, "a structured reply without structured replies negotiated");
                let head = if ext { 32 } else { 20 };
                if h.len() < head {
                    break;
                }
                let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8"));
                let payload = if ext {
                    let n = u64::from_be_bytes(h[24..32].try_into().expect("8"));
                    assert!(n <= fuzzing::MAX_REQUEST as u64 + 64, "an extended chunk of {n} bytes");
                    n as usize
                } else {
                    u32::from_be_bytes(h[16..20].try_into().expect("4")) as usize
                };
                if h.len() < head + payload {
                    break;
                }
                let Some(&asked) = self.asked.get(&cookie) else {
                    self.lost = true;
                    break;
                };
                if ext {
                    let offset = u64::from_be_bytes(h[16..24].try_into().expect("8"));
                    assert_eq!(offset, asked.offset, "an extended chunk's offset is the request's");
                }
                let state = self.partial.entry(cookie).or_default();
                let done = check_chunk(&h[..head + payload], head, ext, asked, state);
                if done {
                    self.partial.remove(&cookie);
                }
                (cookie, head + payload, done)
            } else {
                assert_eq!(magic, codec::SIMPLE_REPLY_MAGIC, "a reply without the reply magic");
                assert!(!self.extended, "a simple reply with extended headers negotiated");
                let error = u32::from_be_bytes(h[4..8].try_into().expect("4"));
                let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8"));
                let Some(&Asked { command, length, .. }) = self.asked.get(&cookie) else {
                    // A cookie of raw bytes: its data length is unknown.
                    self.lost = true;
                    break;
                };
                assert!(
                    !(self.structured && matches!(command, cmd::READ | cmd::BLOCK_STATUS)),
                    "a simple reply to {command} with structured replies negotiated"
                );
                let body = if error == 0 && command == cmd::READ { length as usize } else { 0 };
                if h.len() < 16 + body {
                    break;
                }
                (cookie, 16 + body, true)
            };
            assert_eq!(self.answered.get(&cookie), None, "a chunk for request {cookie:#x} after its last");
            if done {
                self.answered.insert(cookie, 1);
            }
            at += len;
        }
        self.got.drain(..at);
    }
}

/// A request the client sent.
#[derive(Debug, Clone, Copy)]
struct Asked {
    command: u16,
    flags: u16,
    offset: u64,
    length: u64,
}

/// Checks one structured or extended chunk (header of `head` bytes and payload) answering
/// `asked`; `state` is what earlier chunks of the reply carried (content bytes, an error seen).
/// Returns whether the chunk ends the reply.
fn check_chunk(c: &[u8], head: usize, ext: bool, asked: Asked, state: &mut (u64, bool)) -> bool {
    let Asked { command, flags, offset, length } = asked;
    let cflags = u16::from_be_bytes([c[4], c[5]]);
    let kind = u16::from_be_bytes([c[6], c[7]]);
    let p = &c[head..];
    assert_eq!(cflags & !codec::chunk::FLAG_DONE, 0, "unknown chunk flags {cflags:#x}");
    let done = cflags & codec::chunk::FLAG_DONE != 0;
    assert!(
        ext || matches!(command, cmd::READ | cmd::BLOCK_STATUS),
        "a structured reply to command {command} without extended headers"
    );
    match kind {
        codec::chunk::ERROR => {
            assert_eq!(p.len(), 6, "an error chunk without a message");
            assert_ne!(u32::from_be_bytes(p[..4].try_into().expect("4")), 0, "an error chunk of error 0");
            assert!(!state.1, "two error chunks in one reply");
            state.1 = true;
        }
        codec::chunk::NONE => {
            assert!(p.is_empty() && done, "a NONE chunk with a payload or not last");
            if command == cmd::READ && !state.1 {
                assert_eq!(state.0, length, "a READ's reply ends before its content covers it");
            }
        }
        codec::chunk::OFFSET_DATA | codec::chunk::OFFSET_HOLE => {
            assert_eq!(command, cmd::READ, "content for command {command}");
            let at = u64::from_be_bytes(p[..8].try_into().expect("8"));
            let n = if kind == codec::chunk::OFFSET_DATA {
                assert!(p.len() > 8, "an empty OFFSET_DATA chunk");
                p.len() as u64 - 8
            } else {
                assert_eq!(p.len(), 12, "an OFFSET_HOLE chunk of {} bytes", p.len());
                assert_eq!(flags & codec::cflag::DF, 0, "a hole chunk for a DF read");
                u32::from_be_bytes(p[8..12].try_into().expect("4")) as u64
            };
            assert!(n > 0 && at >= offset && at + n <= offset + length, "content {at}+{n} outside {offset}+{length}");
            state.0 += n;
            assert!(state.0 <= length, "content chunks overlap: {} bytes for a read of {length}", state.0);
            if flags & codec::cflag::DF != 0 {
                assert!(done && state.0 == length, "a DF read in more than one chunk");
            }
            if done && !state.1 {
                assert_eq!(state.0, length, "a READ's reply ends before its content covers it");
            }
        }
        codec::chunk::BLOCK_STATUS | codec::chunk::BLOCK_STATUS_EXT => {
            assert_eq!(command, cmd::BLOCK_STATUS, "block status for command {command}");
            assert_eq!(kind == codec::chunk::BLOCK_STATUS_EXT, ext, "block status chunk type {kind}");
            assert!(done, "one block status chunk, the last");
            assert_eq!(u32::from_be_bytes(p[..4].try_into().expect("4")), codec::BASE_ALLOCATION_ID);
            let (fixed, size) = if ext { (8, 16) } else { (4, 8) };
            assert!(
                p.len() >= fixed + size && (p.len() - fixed) % size == 0,
                "block status payload of {} bytes",
                p.len()
            );
            let n = (p.len() - fixed) / size;
            if ext {
                assert_eq!(u32::from_be_bytes(p[4..8].try_into().expect("4")) as usize, n, "descriptor count");
            }
            if flags & codec::cflag::REQ_ONE != 0 {
                assert_eq!(n, 1, "REQ_ONE answered with {n} extents");
            }
            let mut total = 0u64;
            for e in p[fixed..].chunks_exact(size) {
                let (len, state) = if ext {
                    (
                        u64::from_be_bytes(e[..8].try_into().expect("8")),
                        u64::from_be_bytes(e[8..].try_into().expect("8")),
                    )
                } else {
                    (
                        u32::from_be_bytes(e[..4].try_into().expect("4")) as u64,
                        u32::from_be_bytes(e[4..].try_into().expect("4")) as u64,
                    )
                };
                assert!(len > 0, "an empty extent");
                assert_eq!(state & !3, 0, "unknown state bits {state:#x}");
                total += len;
            }
            assert!(total <= length, "extents cover {total} bytes of {length} asked");
        }
        k => panic!("chunk type {k}"),
    }
    done
}

/// The `nbd-stream` target: a mode byte, a pacing byte, then a client's transmission bytes as
/// they go on the wire, served as they come. The committed seeds (`fuzz/seeds/nbd-stream/`) are
/// the byte streams qemu 10 (extended headers), qemu 7.2 (structured replies) and the kernel's
/// client (simple replies) sent, so the fuzzer mutates real clients' traffic rather than only
/// the requests [`Input`] composes.
///
/// Mode bits: 0-1 the negotiation (0 simple replies, 1 structured replies, 2 and 3 extended
/// headers), 2 a read-only export, 3 an export that does not discard, 4 hole-aware reads. The
/// export is 8 MiB. Invariants: those of [`run`]; and when the client's own framing of the stream
/// ([`frame_stream`], by the NBD protocol) reads it whole, every request before the end (or
/// before NBD_CMD_DISC) is answered exactly once.
pub fn run_stream(data: &[u8]) {
    let [mode, pace, stream @ ..] = data else { return };
    if stream.len() > MAX_CLIENT_BYTES {
        return;
    }
    crate::count_input();
    let framing = mode & 3;
    let pace = u16::from(*pace) + 1;
    let input = Input {
        sectors: 16_384,
        read_only: mode & 4 != 0,
        discard: mode & 8 == 0,
        max_inflight: 63,
        structured: framing >= 1,
        extended: framing >= 2,
        hole_reads: mode & 16 != 0,
        client_flags: 0,
        options: Vec::new(),
        // Requests arrive split at varying points while the volume completes some of them.
        items: (0..32u16)
            .flat_map(|i| {
                [
                    Item::Trickle(1 + pace.wrapping_mul(i + 1) % 977),
                    Item::Serve { complete: 3, fail: None, newest_first: i % 2 == 0 },
                ]
            })
            .collect(),
    };
    transmission_with(&input, input.sectors as u64 * 512, Some(stream));
}

/// The client's own framing of a raw request stream, written from the NBD protocol (not from the
/// server's code): each header, then for a WRITE (or with extended headers any request flagged
/// NBD_CMD_FLAG_PAYLOAD_LEN) `length` bytes of payload. Each framed request's cookie is rewritten
/// in `s` to one of its own (clients reuse a cookie once its reply came, as qemu does; here every
/// request is sent before any reply is read). Returns the requests up to the first that cannot be
/// framed (a bad magic, a payload over the maximum, a stream cut short) or NBD_CMD_DISC, and
/// whether the stream was framed whole.
fn frame_stream(s: &mut [u8], extended: bool) -> (Vec<(u64, Asked)>, bool) {
    let (head, magic) = if extended { (32, codec::EXTENDED_REQUEST_MAGIC) } else { (28, codec::REQUEST_MAGIC) };
    let mut out = Vec::new();
    let mut at = 0;
    while s.len() - at >= head {
        let h = &s[at..at + head];
        let be16 = |i: usize| u16::from_be_bytes([h[i], h[i + 1]]);
        let be64 = |i: usize| u64::from_be_bytes(h[i..i + 8].try_into().expect("8"));
        if u32::from_be_bytes(h[..4].try_into().expect("4")) != magic {
            return (out, false);
        }
        let (flags, command, offset) = (be16(4), be16(6), be64(16));
        let length = if extended { be64(24) } else { u32::from_be_bytes(h[24..28].try_into().expect("4")) as u64 };
        if command == cmd::DISC {
            return (out, true);
        }
        let payload = command == cmd::WRITE || extended && flags & codec::cflag::PAYLOAD_LEN != 0;
        let body = if payload { length } else { 0 };
        if body > fuzzing::MAX_REQUEST as u64 || body > (s.len() - at - head) as u64 {
            return (out, false);
        }
        let cookie = (1 << 62) + out.len() as u64;
        s[at + 8..at + 16].copy_from_slice(&cookie.to_be_bytes());
        out.push((cookie, Asked { command, flags, offset, length }));
        at += head + body as usize;
    }
    (out, at == s.len())
}

fn transmission(input: &Input, size: u64) {
    transmission_with(input, size, None)
}

/// The transmission phase of `input`, after `stream` (raw client bytes) when there is one.
fn transmission_with(input: &Input, size: u64, stream: Option<&[u8]>) {
    let Some(mut t) = Transmission::open(input, size) else { return };
    let (framed, whole) = match stream {
        Some(s) => t.queue_stream(s),
        None => (Vec::new(), false),
    };
    for item in input.items.iter().take(MAX_ITEMS) {
        t.item(item);
    }
    // The client sends the rest and closes its end; the volume completes everything.
    t.send_rest();
    t.close();
    if whole && !t.client.lost {
        for (cookie, a) in &framed {
            assert!(
                t.client.answered.contains_key(cookie),
                "request {cookie:#x} (command {}, {} bytes) of a stream framed whole was never answered",
                a.command,
                a.length
            );
        }
    }
}

/// The commands a composed request picks from (the last two unknown).
const COMMANDS: [u16; 10] = [
    cmd::READ,
    cmd::WRITE,
    cmd::DISC,
    cmd::FLUSH,
    cmd::TRIM,
    cmd::CACHE,
    cmd::WRITE_ZEROES,
    cmd::BLOCK_STATUS,
    8,
    0xffff,
];

impl Offset {
    /// The byte offset this selects in an export of `size` bytes.
    fn bytes(self, size: u64) -> u64 {
        match self {
            Offset::Sector(s) => (s as u64 % (size / 512 + 1)) * 512,
            Offset::Raw(v) => v,
            Offset::End(d) => size.wrapping_add_signed(d as i64),
        }
    }
}

impl Length {
    /// The byte length this selects, cut to 32 bits unless the headers are `extended`.
    fn bytes(self, extended: bool) -> u64 {
        let mut length = match self {
            Length::Sectors(s) => s as u64 * 512,
            Length::Raw(v) => v as u64,
            Length::OverMax(d) => fuzzing::MAX_REQUEST as u64 + d as u64,
            Length::Wide(v) => v,
        };
        if !extended {
            length &= u32::MAX as u64;
        }
        length
    }
}

/// The header of `req`, compact or `extended`, with its style's magic unless `bad_magic` says otherwise.
fn request_header(req: &codec::Request, extended: bool, bad_magic: Option<bool>) -> Vec<u8> {
    let mut h = Vec::with_capacity(32);
    let (good, other) = if extended {
        (codec::EXTENDED_REQUEST_MAGIC, codec::REQUEST_MAGIC)
    } else {
        (codec::REQUEST_MAGIC, codec::EXTENDED_REQUEST_MAGIC)
    };
    put_u32(
        &mut h,
        match bad_magic {
            None => good,
            Some(true) => other,
            Some(false) => 0xdead_beef,
        },
    );
    h.extend_from_slice(&req.flags.to_be_bytes());
    h.extend_from_slice(&req.command.to_be_bytes());
    h.extend_from_slice(&req.cookie.to_be_bytes());
    h.extend_from_slice(&req.offset.to_be_bytes());
    if extended {
        h.extend_from_slice(&req.length.to_be_bytes());
    } else {
        put_u32(&mut h, req.length as u32);
    }
    h
}

/// The transmission phase under way: the server's connection, its client, and the RAM disk
/// playing the volume with the requests it holds (declared in the order they are dropped).
struct Transmission<'a> {
    input: &'a Input,
    /// Export size in bytes.
    size: u64,
    max_inflight: usize,
    /// Cookie of the next composed request.
    next_cookie: u64,
    /// Client bytes queued so far (at most [`MAX_CLIENT_BYTES`] of composed requests).
    queued: usize,
    /// Requests handed to the volume, not yet completed.
    held: VecDeque<Io>,
    disk: Vec<u8>,
    client: Client,
    conn: Conn,
}

impl<'a> Transmission<'a> {
    /// A server connection for `input` and its client over a socket pair (`None` if either fails).
    fn open(input: &'a Input, size: u64) -> Option<Transmission<'a>> {
        let Ok((server, client)) = UnixStream::pair() else { return None };
        let max = input.max_inflight as usize % 64 + 1;
        let hole_min = input.hole_reads.then_some(4096);
        let options = Options {
            size,
            read_only: input.read_only,
            discard: input.discard,
            max_inflight: max,
            structured: input.structured,
            extended: input.extended,
            hole_read_min: hole_min,
        };
        let Ok(conn) = Conn::new(server, options) else {
            return None;
        };
        client.set_nonblocking(true).expect("non-blocking");
        let client = Client {
            sock: client,
            pending: VecDeque::new(),
            got: Vec::new(),
            asked: HashMap::new(),
            structured: input.structured || input.extended,
            extended: input.extended,
            partial: HashMap::new(),
            answered: HashMap::new(),
            lost: false,
        };
        Some(Transmission {
            input,
            size,
            max_inflight: input.max_inflight as usize % 64 + 1,
            next_cookie: 1u64 << 63,
            queued: 0,
            held: VecDeque::new(),
            disk: vec![0u8; size as usize],
            client,
            conn,
        })
    }

    /// Queues the raw client bytes `s`; returns [`frame_stream`]'s requests and whether it framed them whole.
    fn queue_stream(&mut self, s: &[u8]) -> (Vec<(u64, Asked)>, bool) {
        let mut s = s.to_vec();
        let (framed, whole) = frame_stream(&mut s, self.input.extended);
        crate::count_frames(framed.len() as u64);
        self.client.asked.extend(framed.iter().copied());
        self.queued += s.len();
        self.client.pending.extend(s);
        (framed, whole)
    }

    /// Plays one step of the transmission phase.
    fn item(&mut self, item: &Item) {
        match *item {
            Item::Request { command, flags, offset, length, payload, bad_magic } => {
                self.request(command, flags, offset, length, payload, bad_magic)
            }
            Item::Raw(ref v) => {
                crate::count_frames(1);
                self.queued += v.len();
                self.client.pending.extend(v.iter().copied());
            }
            Item::Trickle(n) => {
                self.client.deliver(n as usize);
                self.serve_requests();
                self.client.receive();
            }
            Item::Serve { complete, fail, newest_first } => {
                self.client.deliver(usize::MAX);
                self.serve_requests();
                for _ in 0..complete as usize % 8 {
                    let io = if newest_first { self.held.pop_back() } else { self.held.pop_front() };
                    let Some(io) = io else { break };
                    finish(&mut self.conn, io, &mut self.disk, fail);
                }
                self.conn.write_replies();
                self.client.receive();
            }
        }
    }

    /// [`Item::Request`]: a composed request, queued unless the client's bytes would pass [`MAX_CLIENT_BYTES`].
    fn request(
        &mut self,
        command: u8,
        flags: u16,
        offset: Offset,
        length: Length,
        payload: Payload,
        bad_magic: Option<bool>,
    ) {
        crate::count_frames(1);
        let extended = self.input.extended;
        let command = COMMANDS[command as usize % COMMANDS.len()];
        let offset = offset.bytes(self.size);
        let length = length.bytes(extended);
        // With extended headers a WRITE carries PAYLOAD_LEN unless the flags ask to leave it
        // out (bit 15: a WRITE without it, as qemu sends them; its payload follows all the same).
        let mut flags = flags;
        if extended && command == cmd::WRITE && flags & 0x8000 == 0 {
            flags |= codec::cflag::PAYLOAD_LEN;
        }
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let req = codec::Request { flags, command, cookie, offset, length };
        let h = request_header(&req, extended, bad_magic);
        let body = match (req.payload(extended), payload) {
            (Some(n), Payload::Full) => n.min(MAX_CLIENT_BYTES as u64 + 1) as usize,
            (Some(n), Payload::Short(k)) => (k as u64).min(n) as usize,
            (None, _) => 0,
        };
        if self.queued + 28 + body > MAX_CLIENT_BYTES {
            return;
        }
        self.queued += 28 + body;
        self.client.pending.extend(h);
        self.client.pending.extend(std::iter::repeat_n(cookie as u8 | 1, body));
        self.client.asked.insert(cookie, Asked { command, flags, offset, length });
    }

    /// The server reads requests; each one for the volume is checked and held.
    fn serve_requests(&mut self) {
        serve(&mut self.conn, &mut self.held, &mut self.disk, self.input, self.max_inflight);
    }

    /// The server reads requests, the volume completes all it holds, the client reads the replies.
    fn serve_all(&mut self) {
        self.serve_requests();
        while let Some(io) = self.held.pop_front() {
            finish(&mut self.conn, io, &mut self.disk, None);
        }
        self.conn.write_replies();
        self.client.receive();
    }

    /// The client sends the rest; the volume completes everything.
    fn send_rest(&mut self) {
        for _ in 0..100_000 {
            self.client.deliver(usize::MAX);
            let before = self.held.len();
            self.serve_all();
            if self.client.pending.is_empty() && before == 0 && self.held.is_empty() {
                break;
            }
        }
    }

    /// The client closes its end: once everything completes the connection must be finished.
    fn close(&mut self) {
        let _ = self.client.sock.shutdown(std::net::Shutdown::Write);
        for _ in 0..1000 {
            self.serve_all();
            if self.conn.finished() {
                break;
            }
        }
        assert!(self.conn.finished(), "the client closed, nothing is in flight, yet the connection is not finished");
        self.conn.close();
    }
}

/// The server reads requests; each one for the volume is checked and held.
fn serve(conn: &mut Conn, held: &mut VecDeque<Io>, disk: &mut [u8], input: &Input, max_inflight: usize) {
    for _ in 0..64 {
        let ios = conn.poll_requests();
        if ios.is_empty() {
            break;
        }
        for io in ios {
            check(&io, disk.len() as u64, input);
            held.push_back(io);
        }
        let (inflight, bytes) = conn.load();
        assert_eq!(inflight, held.len(), "the connection counts {inflight} in flight, the volume holds {}", held.len());
        assert!(inflight <= max_inflight, "{inflight} requests in flight, the bound is {max_inflight}");
        assert!(
            bytes <= fuzzing::HELD_BYTES + fuzzing::MAX_REQUEST as u64,
            "the connection holds {bytes} bytes of data"
        );
    }
}

/// What the volume requires of a request.
fn check(io: &Io, size: u64, input: &Input) {
    let (off, len) = (io.offset(), io.length());
    match io.op() {
        Op::Flush => assert_eq!((off, len), (0, 0), "a flush with a range"),
        op => {
            assert!(len > 0, "an empty {op:?}");
            // Reads and trims the server rounds to sectors; unaligned writes and write-zeroes
            // its validator refuses.
            assert!(off % 512 == 0 && len % 512 == 0, "{op:?} at {off}+{len} not in whole sectors");
            assert!(off.checked_add(len).is_some_and(|e| e <= size), "{op:?} at {off}+{len} past the end ({size})");
            if matches!(op, Op::Read | Op::Write) {
                assert!(len <= fuzzing::MAX_REQUEST as u64, "{op:?} of {len} bytes");
            }
            if matches!(op, Op::Discard | Op::WriteZeroes) {
                assert!(len <= fuzzing::MAX_EFFECT, "{op:?} of {len} bytes");
            }
        }
    }
    match io.op() {
        Op::Read | Op::Write => assert_eq!(io.data().len() as u64, len, "{:?} buffer of the wrong length", io.op()),
        Op::BlockStatus => assert_eq!(io.data().len(), 512, "a block status list buffer of the wrong length"),
        _ => {}
    }
    if io.op() == Op::Discard {
        assert!(input.discard, "a discard on an export that does not discard");
    }
    if input.read_only {
        assert!(!io.op().modifies(), "a {:?} on a read-only export", io.op());
    }
}

fn finish(conn: &mut Conn, mut io: Io, disk: &mut [u8], fail: Option<u8>) {
    let (off, len) = (io.offset() as usize, io.length() as usize);
    let result = match fail {
        // A hostile target's block status list: garbage, which the server must refuse.
        Some(k) if io.op() == Op::BlockStatus && k % 6 >= 4 => {
            for (i, b) in io.data_mut().iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(k) ^ k;
            }
            Ok(())
        }
        Some(k) => Err([
            Error::Target(Status::IoError),
            Error::NoPath,
            Error::ReadOnly,
            Error::Closed,
            Error::Target(Status::Unsupported),
            Error::BadReply,
        ][k as usize % 6]),
        None => {
            match io.op() {
                Op::Read => io.data_mut().copy_from_slice(&disk[off..off + len]),
                Op::Write => disk[off..off + len].copy_from_slice(io.data()),
                Op::Discard | Op::WriteZeroes => disk[off..off + len].fill(0),
                Op::Flush => {}
                Op::BlockStatus => {
                    // Pages of zeroes are holes.
                    let extents = disk[off..off + len].chunks(4096).map(|c| tyche_wire::Extent {
                        length: c.len() as u64,
                        flags: if c.iter().all(|&b| b == 0) { 3 } else { 0 },
                    });
                    tyche_wire::emit_block_status(extents, io.data_mut());
                }
            }
            Ok(())
        }
    };
    conn.complete(io, result);
}
