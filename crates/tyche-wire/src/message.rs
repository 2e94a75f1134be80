use crate::layout::{self, Field};
use crate::{MacAddr, Result, WireError, ETH_HEADER_LEN, ETH_MIN_FRAME_LEN, MAX_EXPORT_NAME, NO_SLOT};
use crate::{SECTOR_SIZE, VERSION};

// ---------------------------------------------------------------------------------------------
// Field access. Callers have checked the length, so slicing cannot fail; a failure here is a bug
// in this crate, hence the plain indexing.

fn get_u16(b: &[u8], f: Field) -> u16 {
    u16::from_be_bytes([b[f.start], b[f.start + 1]])
}
fn get_u32(b: &[u8], f: Field) -> u32 {
    u32::from_be_bytes(b[f].try_into().expect("4-byte field"))
}
fn get_u64(b: &[u8], f: Field) -> u64 {
    u64::from_be_bytes(b[f].try_into().expect("8-byte field"))
}
fn put_u16(b: &mut [u8], f: Field, v: u16) {
    b[f].copy_from_slice(&v.to_be_bytes());
}
fn put_u32(b: &mut [u8], f: Field, v: u32) {
    b[f].copy_from_slice(&v.to_be_bytes());
}
fn put_u64(b: &mut [u8], f: Field, v: u64) {
    b[f].copy_from_slice(&v.to_be_bytes());
}

macro_rules! wire_enum {
    ($(#[$m:meta])* $name:ident : $repr:ty { $($(#[$vm:meta])* $var:ident = $val:expr),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name { $($(#[$vm])* $var = $val),+ }

        impl $name {
            /// Every value, in wire order.
            pub const ALL: &'static [$name] = &[$($name::$var),+];

            /// Decodes a wire value.
            pub fn from_wire(v: $repr) -> Result<Self> {
                match v {
                    $($val => Ok($name::$var),)+
                    _ => Err(WireError::Malformed),
                }
            }
        }
    };
}

wire_enum! {
    /// Message kind (common header byte 1).
    Kind: u8 {
        /// Who serves which exports.
        Discover = 0x01,
        /// A page of a target's export list.
        DiscoverReply = 0x02,
        /// Open a channel.
        Connect = 0x03,
        /// Prove you hold the key.
        Challenge = 0x04,
        /// Channel granted.
        Accept = 0x05,
        /// Channel refused.
        Reject = 0x06,
        /// An I/O request.
        Request = 0x10,
        /// An I/O completion.
        Completion = 0x11,
        /// A data segment.
        Data = 0x12,
        /// Cumulative and selective acknowledgement.
        Ack = 0x20,
        /// Negative acknowledgement.
        Nack = 0x21,
        /// Liveness probe or its echo.
        Keepalive = 0x22,
        /// Channel torn down.
        Disconnect = 0x23,
    }
}

impl Kind {
    /// Whether frames of this kind carry a ring position and are acknowledged and retransmitted.
    pub fn is_sequenced(self) -> bool {
        matches!(self, Kind::Request | Kind::Completion | Kind::Data)
    }

    /// Fixed part of the message (common header included): the exact length of fixed-size
    /// messages, the minimum of variable ones.
    pub fn fixed_len(self) -> usize {
        match self {
            Kind::Discover => layout::discover::END,
            Kind::DiscoverReply => layout::discover_reply::ENTRIES,
            Kind::Connect => layout::connect::NAME,
            Kind::Challenge => layout::challenge::END,
            Kind::Accept => layout::accept::END,
            Kind::Reject => layout::reject::END,
            Kind::Request => layout::request::END,
            Kind::Completion => layout::completion::END,
            Kind::Data => layout::data::PAYLOAD,
            Kind::Ack | Kind::Nack => layout::ack::END,
            Kind::Keepalive => layout::keepalive::END,
            Kind::Disconnect => layout::disconnect::END,
        }
    }
}

wire_enum! {
    /// Block operation of a request.
    Op: u8 {
        /// Read `length` bytes at `offset` into the request's `damq` slot.
        Read = 1,
        /// Write `length` bytes from the request's `damq` slot at `offset`.
        Write = 2,
        /// Make every write completed before this request durable.
        Flush = 3,
        /// Deallocate the range; later reads of it return zeroes.
        Discard = 4,
        /// Write zeroes over the range without sending data.
        WriteZeroes = 5,
        /// Report which parts of the range are allocated: the target sends a block status list
        /// ([`BlockStatusList`], [`layout::block_status::LEN`] bytes) into the request's `damq`
        /// slot. Only on channels granted feature `BLOCK_STATUS`.
        BlockStatus = 6,
    }
}

impl Op {
    /// Whether the initiator sends data for this op (in its `damq` slot).
    pub fn has_write_data(self) -> bool {
        self == Op::Write
    }
    /// Whether the target sends data back for this op.
    pub fn has_read_data(self) -> bool {
        matches!(self, Op::Read | Op::BlockStatus)
    }
    /// Whether the request names a `damq` slot.
    pub fn uses_damq(self) -> bool {
        matches!(self, Op::Read | Op::Write | Op::BlockStatus)
    }
    /// Bytes of data a request of this op and `length` moves through its `damq` slot: the
    /// length for READ and WRITE, a block status list for BLOCK_STATUS (whose `length` is the
    /// range asked about), none for the others.
    pub fn data_len(self, length: u32) -> u32 {
        match self {
            Op::Read | Op::Write => length,
            Op::BlockStatus => layout::block_status::LEN as u32,
            Op::Flush | Op::Discard | Op::WriteZeroes => 0,
        }
    }
    /// Whether executing the op twice may differ from executing it once (the target runs these
    /// at most once per tag).
    pub fn modifies(self) -> bool {
        matches!(self, Op::Write | Op::Discard | Op::WriteZeroes)
    }
}

wire_enum! {
    /// Outcome of a request, as carried by a completion.
    Status: u16 {
        /// Done.
        Ok = 0,
        /// The storage failed the operation.
        IoError = 1,
        /// The range runs past the end of the export.
        OutOfRange = 2,
        /// The export is read-only.
        ReadOnly = 3,
        /// The request is inconsistent (bad slot, length larger than the slot, ...).
        Invalid = 4,
        /// The export does not support this operation.
        Unsupported = 5,
        /// The storage is out of space.
        NoSpace = 6,
        /// The target is shutting down or dropped the session before executing it.
        Aborted = 7,
    }
}

wire_enum! {
    /// Why a CONNECT was refused.
    RejectReason: u16 {
        /// No export of that name.
        UnknownExport = 1,
        /// The initiator's MAC address is not allowed for this export.
        NotAllowed = 2,
        /// The proof of the pre-shared key was wrong.
        AuthFailed = 3,
        /// The export needs a key and the CONNECT had no proof.
        AuthRequired = 4,
        /// The requested parameters cannot be granted.
        BadParameters = 5,
        /// The target has no room for another channel or session.
        Busy = 6,
        /// The session to join does not exist (anymore).
        UnknownSession = 7,
        /// Another initiator has the export attached (and it is not shared); REJECT names it.
        InUse = 8,
    }
}

wire_enum! {
    /// Why a channel was torn down.
    DisconnectReason: u16 {
        /// The peer closed it on purpose.
        Normal = 0,
        /// The peer is shutting down.
        Shutdown = 1,
        /// The peer stopped hearing from us.
        Timeout = 2,
        /// We broke the protocol.
        ProtocolError = 3,
    }
}

/// Flags of the common header and of requests.
pub mod flags {
    /// KEEPALIVE: this frame answers a probe.
    pub const REPLY: u16 = 0x0001;
    /// ACK: since its previous ACK the sender dropped a sequenced frame it had already
    /// received (D-SACK, RFC 2883 in spirit): a retransmission was not needed.
    pub const DUPLICATE: u16 = 0x0001;
    /// CONNECT/ACCEPT: the proof field holds a key proof.
    pub const PROOF: u16 = 0x0001;
    /// CONNECT: the initiator's host id follows the export name.
    pub const HOST_ID: u16 = 0x0002;
    /// REQUEST flags byte: force unit access (the write is durable before it completes).
    pub const FUA: u8 = 0x01;
    /// Export flag: the export is read-only.
    pub const EXPORT_READ_ONLY: u16 = 0x0001;
    /// Export flag: attaching needs the pre-shared key.
    pub const EXPORT_NEEDS_KEY: u16 = 0x0002;
    /// Export flag: DISCARD is supported (and zeroes the range).
    pub const EXPORT_DISCARD: u16 = 0x0004;
    /// Export flag: the export's channels encrypt what follows the common header (it also
    /// needs the key).
    pub const EXPORT_ENCRYPTED: u16 = 0x0008;
    /// Feature bit (CONNECT/ACCEPT `FEATURES`): every DATA frame carries a CRC32C of its
    /// payload in `DIGEST`; a frame whose payload does not match is dropped and sent again.
    pub const FEATURE_DIGEST: u32 = 0x0000_0001;
    /// Feature bit (CONNECT/ACCEPT `FEATURES`): the target understands op BLOCK_STATUS. An
    /// initiator sends BLOCK_STATUS only on channels granted it.
    pub const FEATURE_BLOCK_STATUS: u32 = 0x0000_0002;
    /// Block status extent flag: the range is not allocated (a hole).
    pub const EXTENT_HOLE: u32 = 0x0000_0001;
    /// Block status extent flag: the range reads as zeroes.
    pub const EXTENT_ZERO: u32 = 0x0000_0002;
    /// Common header flag of every kind (high byte): an authentication trailer follows the
    /// message (`layout::trailer`). Every frame of a channel of a keyed export carries it.
    pub const SEALED: u16 = 0x8000;
}

// ---------------------------------------------------------------------------------------------

/// A checked view of a whole Tyche Ethernet frame.
///
/// [`Frame::new_checked`] validates the Ethernet header, EtherType, version, kind and length
/// field once; after it succeeds no accessor panics.
#[derive(Debug, Clone, Copy)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
    kind: Kind,
    len: usize,
}

impl<T: AsRef<[u8]>> Frame<T> {
    /// Validates `buffer` as a Tyche frame with EtherType `ethertype`.
    pub fn new_checked(buffer: T, ethertype: u16) -> Result<Self> {
        let b = buffer.as_ref();
        if b.len() < ETH_HEADER_LEN + layout::common::END {
            return Err(if b.len() >= ETH_HEADER_LEN && ethertype_of(b) != ethertype {
                WireError::NotTyche
            } else {
                WireError::Truncated
            });
        }
        if ethertype_of(b) != ethertype {
            return Err(WireError::NotTyche);
        }
        let m = &b[ETH_HEADER_LEN..];
        if m[layout::common::VERSION] != VERSION {
            return Err(WireError::Version);
        }
        let kind = Kind::from_wire(m[layout::common::KIND]).map_err(|_| WireError::UnknownKind)?;
        let len = get_u16(m, layout::common::LENGTH) as usize;
        if len > m.len() {
            return Err(WireError::Truncated);
        }
        let fixed = kind.fixed_len();
        let fixed_size = !matches!(kind, Kind::DiscoverReply | Kind::Connect | Kind::Data);
        if len < fixed || (fixed_size && len != fixed) {
            return Err(WireError::BadLength);
        }
        Ok(Frame { buffer, kind, len })
    }

    /// The bytes of the whole Ethernet frame as received (padding included).
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// The Tyche message: common header, body and payload, without Ethernet header or padding.
    pub fn message(&self) -> &[u8] {
        &self.buffer.as_ref()[ETH_HEADER_LEN..ETH_HEADER_LEN + self.len]
    }
    /// Destination MAC address.
    pub fn dst(&self) -> MacAddr {
        MacAddr(self.buffer.as_ref()[0..6].try_into().expect("checked"))
    }
    /// Source MAC address.
    pub fn src(&self) -> MacAddr {
        MacAddr(self.buffer.as_ref()[6..12].try_into().expect("checked"))
    }
    /// The message kind.
    pub fn kind(&self) -> Kind {
        self.kind
    }
    /// Common-header flags.
    pub fn flags(&self) -> u16 {
        get_u16(self.message(), layout::common::FLAGS)
    }
    /// The `LENGTH` field: bytes of Tyche message (a sealed frame's trailer follows them).
    pub fn length(&self) -> u16 {
        get_u16(self.message(), layout::common::LENGTH)
    }
    /// Channel index.
    pub fn channel(&self) -> u16 {
        get_u16(self.message(), layout::common::CHANNEL)
    }
    /// Session id.
    pub fn session(&self) -> u64 {
        get_u64(self.message(), layout::common::SESSION)
    }
    /// Ring position of a sequenced frame.
    pub fn seq(&self) -> Option<u32> {
        self.kind.is_sequenced().then(|| get_u32(self.message(), layout::seq::SEQ))
    }

    /// Parses the body into a [`Message`] that borrows from this frame.
    pub fn parse(&self) -> Result<Message<'_>> {
        Message::parse_body(self.kind, self.message())
    }
}

impl<'a> Frame<&'a [u8]> {
    /// Parses the body into a [`Message`] that borrows from the underlying buffer (so it may
    /// outlive this view).
    pub fn parse_borrowed(&self) -> Result<Message<'a>> {
        let b: &'a [u8] = self.buffer;
        Message::parse_body(self.kind, &b[ETH_HEADER_LEN..ETH_HEADER_LEN + self.len])
    }
}

fn ethertype_of(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[12], b[13]])
}

/// Addressing of a frame: what goes in the Ethernet header and the common header besides the
/// kind, flags and length, which come from the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope {
    /// Destination MAC address.
    pub dst: MacAddr,
    /// Source MAC address.
    pub src: MacAddr,
    /// EtherType to send with.
    pub ethertype: u16,
    /// Channel index.
    pub channel: u16,
    /// Session id (zero before a session exists).
    pub session: u64,
}

impl Envelope {
    /// Reads the envelope of a checked frame.
    pub fn of<T: AsRef<[u8]>>(frame: &Frame<T>) -> Envelope {
        Envelope {
            dst: frame.dst(),
            src: frame.src(),
            ethertype: ethertype_of(frame.as_bytes()),
            channel: frame.channel(),
            session: frame.session(),
        }
    }

    /// The envelope of a reply: addresses swapped.
    pub fn reply(&self) -> Envelope {
        Envelope { dst: self.src, src: self.dst, ..*self }
    }

    /// Writes the Ethernet header and common header of a message of `kind` whose Tyche length is
    /// `msg_len`. Panics if `buf` is shorter than the two headers or `msg_len` exceeds `u16`.
    pub fn emit_headers(&self, kind: Kind, flags: u16, msg_len: usize, buf: &mut [u8]) {
        assert!(msg_len <= u16::MAX as usize, "Tyche message of {msg_len} bytes");
        buf[0..6].copy_from_slice(&self.dst.0);
        buf[6..12].copy_from_slice(&self.src.0);
        buf[12..14].copy_from_slice(&self.ethertype.to_be_bytes());
        let m = &mut buf[ETH_HEADER_LEN..];
        m[layout::common::VERSION] = VERSION;
        m[layout::common::KIND] = kind as u8;
        put_u16(m, layout::common::FLAGS, flags);
        put_u16(m, layout::common::LENGTH, msg_len as u16);
        put_u16(m, layout::common::CHANNEL, self.channel);
        put_u64(m, layout::common::SESSION, self.session);
    }
}

// ---------------------------------------------------------------------------------------------
// Message representations.

/// Ring position and piggybacked acknowledgement of a sequenced frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seq {
    /// This frame's ring position (sequence number).
    pub seq: u32,
    /// Every peer frame below this sequence number was received.
    pub ack: u32,
}

/// DISCOVER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Discover {
    /// Echoed in replies.
    pub nonce: u32,
    /// First export index wanted.
    pub start: u16,
}

/// One export as listed by discovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo<'a> {
    /// Export name.
    pub name: &'a str,
    /// Size in bytes.
    pub size: u64,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// `flags::EXPORT_*` bits.
    pub flags: u16,
}

impl ExportInfo<'_> {
    fn wire_len(&self) -> usize {
        layout::discover_reply::ENTRY_FIXED + self.name.len()
    }
}

/// The entries of a DISCOVER_REPLY: parsed (borrowing the frame) or to be emitted.
///
/// Two lists are equal when they hold the same entries in the same order, whichever form they
/// are in, so a parsed reply compares equal to the reply that was emitted.
#[derive(Debug, Clone, Copy)]
pub enum ExportList<'a> {
    /// Validated wire bytes holding `count` entries.
    Wire {
        /// Entry bytes.
        bytes: &'a [u8],
        /// Number of entries.
        count: u16,
    },
    /// Entries to emit.
    Slice(&'a [ExportInfo<'a>]),
}

impl<'a> ExportList<'a> {
    /// Number of entries.
    pub fn len(&self) -> usize {
        match self {
            ExportList::Wire { count, .. } => *count as usize,
            ExportList::Slice(s) => s.len(),
        }
    }
    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The entries.
    pub fn iter(&self) -> impl Iterator<Item = ExportInfo<'a>> + 'a {
        let (mut bytes, count, slice) = match *self {
            ExportList::Wire { bytes, count } => (bytes, count as usize, &[][..]),
            ExportList::Slice(s) => (&[][..], 0, s),
        };
        let wire = (0..count).map(move |_| {
            let (e, rest) = parse_export_entry(bytes).expect("validated at parse");
            bytes = rest;
            e
        });
        wire.chain(slice.iter().copied())
    }
    fn wire_len(&self) -> usize {
        match self {
            ExportList::Wire { bytes, .. } => bytes.len(),
            ExportList::Slice(s) => s.iter().map(ExportInfo::wire_len).sum(),
        }
    }
}

impl PartialEq for ExportList<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for ExportList<'_> {}

fn parse_export_entry(b: &[u8]) -> Result<(ExportInfo<'_>, &[u8])> {
    const F: usize = layout::discover_reply::ENTRY_FIXED;
    if b.len() < F {
        return Err(WireError::BadLength);
    }
    let name_len = b[14] as usize;
    if b.len() < F + name_len {
        return Err(WireError::BadLength);
    }
    let name = parse_name(&b[F..F + name_len])?;
    let info = ExportInfo { size: get_u64(b, 0..8), block_size: get_u32(b, 8..12), flags: get_u16(b, 12..14), name };
    Ok((info, &b[F + name_len..]))
}

fn parse_name(b: &[u8]) -> Result<&str> {
    if b.is_empty() || b.len() > MAX_EXPORT_NAME {
        return Err(WireError::Malformed);
    }
    let s = core::str::from_utf8(b).map_err(|_| WireError::Malformed)?;
    if s.chars().any(char::is_control) {
        return Err(WireError::Malformed);
    }
    Ok(s)
}

/// DISCOVER_REPLY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiscoverReply<'a> {
    /// Nonce of the DISCOVER answered.
    pub nonce: u32,
    /// Exports the target has in all.
    pub total: u16,
    /// Index of the first entry here.
    pub start: u16,
    /// The entries.
    pub exports: ExportList<'a>,
}

/// Channel parameters, asked for in CONNECT and granted in ACCEPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelParams {
    /// Ring positions per direction (power of two).
    pub ring: u16,
    /// `remq` slots.
    pub remq_slots: u16,
    /// `damq` slots.
    pub damq_slots: u16,
    /// Segment payload bytes (power of two, >= 512).
    pub segment: u16,
    /// Bytes per `damq` slot: the largest request the channel carries.
    pub max_io: u32,
    /// Feature bits.
    pub features: u32,
}

impl ChannelParams {
    fn parse(m: &[u8], ring: Field) -> Result<Self> {
        let base = ring.start;
        let p = ChannelParams {
            ring: get_u16(m, base..base + 2),
            remq_slots: get_u16(m, base + 2..base + 4),
            damq_slots: get_u16(m, base + 4..base + 6),
            segment: get_u16(m, base + 6..base + 8),
            max_io: get_u32(m, base + 8..base + 12),
            features: get_u32(m, base + 12..base + 16),
        };
        p.validate()?;
        Ok(p)
    }
    fn emit(&self, m: &mut [u8], ring: Field) {
        let base = ring.start;
        put_u16(m, base..base + 2, self.ring);
        put_u16(m, base + 2..base + 4, self.remq_slots);
        put_u16(m, base + 4..base + 6, self.damq_slots);
        put_u16(m, base + 6..base + 8, self.segment);
        put_u32(m, base + 8..base + 12, self.max_io);
        put_u32(m, base + 12..base + 16, self.features);
    }

    /// Checks the invariants every side relies on: rings and segments are powers of two, slots
    /// are usable indices, `max_io` is whole sectors and splits into at most `u16::MAX` segments.
    pub fn validate(&self) -> Result<()> {
        let seg = self.segment as u32;
        let ok = self.ring.is_power_of_two()
            && self.ring >= 2
            && self.remq_slots >= 1
            && self.remq_slots < NO_SLOT
            && self.damq_slots >= 1
            && self.damq_slots < NO_SLOT
            && seg.is_power_of_two()
            && seg >= SECTOR_SIZE
            && self.max_io >= SECTOR_SIZE
            && self.max_io % SECTOR_SIZE == 0
            && self.max_io.div_ceil(seg) <= u16::MAX as u32;
        ok.then_some(()).ok_or(WireError::Malformed)
    }
}

/// CONNECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connect<'a> {
    /// Initiator's nonce.
    pub nonce: u64,
    /// Parameters wanted.
    pub params: ChannelParams,
    /// Proof of the pre-shared key, if any.
    pub proof: Option<[u8; 32]>,
    /// Export to attach.
    pub export: &'a str,
    /// The initiator's stable host id (flag `HOST_ID`), by which the target tells one initiator
    /// from another across its NICs and restarts (exclusive attach, fencing).
    pub host: Option<[u8; 16]>,
}

/// CHALLENGE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    /// Initiator's nonce, echoed.
    pub nonce: u64,
    /// Target's nonce.
    pub target_nonce: u64,
}

/// An export's durability epoch (ACCEPT `DURABILITY_EPOCH`): names the target-side cache
/// domain that acknowledged writes live in (the target host's page cache and the device's
/// cache for a file or block export, the target process for a RAM export). Writes the target
/// acknowledged under an epoch survive as long as it presents the same epoch again; a target
/// whose acknowledged writes may be gone (its host rebooted, a RAM export's process restarted)
/// presents another one. [`DurabilityEpoch::NONE`] (all zero) promises nothing: it never
/// matches, not even itself.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DurabilityEpoch(pub [u8; 16]);

impl DurabilityEpoch {
    /// No promise: the target's acknowledged writes may be gone whenever it forgets a session.
    pub const NONE: DurabilityEpoch = DurabilityEpoch([0; 16]);

    /// Whether this is [`DurabilityEpoch::NONE`].
    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }

    /// Whether writes acknowledged under `self` are still there under `other`: the same epoch,
    /// and not [`DurabilityEpoch::NONE`].
    pub fn keeps(&self, other: &DurabilityEpoch) -> bool {
        !self.is_none() && self == other
    }

    /// The 32 lowercase hexadecimal digits of the epoch.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 32 hexadecimal digits ([`DurabilityEpoch::to_hex`]).
    pub fn from_hex(s: &str) -> Option<DurabilityEpoch> {
        let s = s.trim();
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(DurabilityEpoch(out))
    }
}

impl core::fmt::Debug for DurabilityEpoch {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "DurabilityEpoch({})", self.to_hex())
    }
}

impl core::fmt::Display for DurabilityEpoch {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// ACCEPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accept {
    /// Initiator's nonce, echoed.
    pub nonce: u64,
    /// Parameters granted.
    pub params: ChannelParams,
    /// Export size in bytes.
    pub export_size: u64,
    /// Export logical block size.
    pub block_size: u32,
    /// `flags::EXPORT_*` bits.
    pub export_flags: u16,
    /// Target's proof of the key, if the CONNECT carried one.
    pub proof: Option<[u8; 32]>,
    /// The export's durability epoch.
    pub durability_epoch: DurabilityEpoch,
    /// The channel's target address (`CHANNEL_MAC`): where the initiator sends this channel's
    /// frames and whom it accepts them from. [`MacAddr::ZERO`] (or the ACCEPT's source): the
    /// address the CONNECT went to. Carried as received: the initiator checks it
    /// ([`Accept::channel_addr`]).
    pub channel_mac: MacAddr,
}

impl Accept {
    /// The address a channel accepted by an ACCEPT from `connected` (the address its CONNECT
    /// went to) uses for its frames: `connected` when `CHANNEL_MAC` is all zero or equal to it,
    /// else the named address, which must be a unicast address (a group address cannot own a
    /// channel: `Err` with the address named).
    pub fn channel_addr(&self, connected: MacAddr) -> core::result::Result<MacAddr, MacAddr> {
        match self.channel_mac {
            MacAddr::ZERO => Ok(connected),
            m if m == connected => Ok(connected),
            m if m.is_multicast() => Err(m),
            m => Ok(m),
        }
    }
}

/// REJECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reject {
    /// Initiator's nonce, echoed.
    pub nonce: u64,
    /// Why.
    pub reason: RejectReason,
    /// With [`RejectReason::InUse`]: the MAC of the initiator that holds the export.
    pub holder: Option<MacAddr>,
}

/// REQUEST.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Ring position and piggybacked ack.
    pub seq: Seq,
    /// Operation.
    pub op: Op,
    /// Force unit access.
    pub fua: bool,
    /// `remq` slot.
    pub remq: u16,
    /// `damq` slot, or [`NO_SLOT`].
    pub damq: u16,
    /// Index of the channel the tag was first issued on in this session (kept across
    /// re-issue): where the target keeps its at-most-once record.
    pub home: u16,
    /// Tag (unique per session, kept across re-issue).
    pub tag: u64,
    /// Every tag below this one is finished at the initiator.
    pub floor: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Length in bytes.
    pub length: u32,
}

impl Request {
    fn validate(&self) -> Result<()> {
        let aligned = self.offset % SECTOR_SIZE as u64 == 0 && self.length % SECTOR_SIZE == 0;
        let shape = match self.op {
            Op::Read | Op::Write | Op::BlockStatus => self.length > 0 && self.damq != NO_SLOT,
            Op::Discard | Op::WriteZeroes => self.length > 0 && self.damq == NO_SLOT,
            Op::Flush => self.length == 0 && self.offset == 0 && self.damq == NO_SLOT,
        };
        let fits = self.offset.checked_add(self.length as u64).is_some();
        (aligned && shape && fits && self.floor <= self.tag && self.remq != NO_SLOT)
            .then_some(())
            .ok_or(WireError::Malformed)
    }
}

/// COMPLETION.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Ring position and piggybacked ack.
    pub seq: Seq,
    /// Outcome.
    pub status: Status,
    /// `remq` slot of the request.
    pub remq: u16,
    /// `damq` slot of the request.
    pub damq: u16,
    /// Tag of the request.
    pub tag: u64,
}

/// The fixed fields of a DATA segment (everything but the payload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// Ring position and piggybacked ack.
    pub seq: Seq,
    /// `damq` slot.
    pub damq: u16,
    /// Index of this segment.
    pub seg_index: u16,
    /// Segments in the message.
    pub seg_count: u16,
    /// Tag of the request (message id).
    pub tag: u64,
    /// Byte offset of the payload within the message.
    pub offset: u32,
}

impl DataHeader {
    /// Writes the Ethernet, common and DATA headers for a payload of `payload_len` bytes that
    /// the caller has placed (or will place) at `buf[DATA_FRAME_OVERHEAD..]`. Returns the frame
    /// length (padded to the Ethernet minimum, which a payload of 512 bytes always exceeds).
    pub fn emit_in_place(&self, env: &Envelope, payload_len: usize, buf: &mut [u8]) -> usize {
        let msg_len = layout::data::PAYLOAD + payload_len;
        env.emit_headers(Kind::Data, 0, msg_len, buf);
        let m = &mut buf[ETH_HEADER_LEN..];
        emit_seq(m, self.seq);
        put_u16(m, layout::data::DAMQ, self.damq);
        put_u16(m, layout::data::SEG_INDEX, self.seg_index);
        put_u16(m, layout::data::SEG_COUNT, self.seg_count);
        put_u16(m, layout::data::RESERVED0, 0);
        put_u64(m, layout::data::TAG, self.tag);
        put_u32(m, layout::data::OFFSET, self.offset);
        put_u32(m, layout::data::DIGEST, 0); // filled in when the payload is (a DIGEST channel)
        pad(buf, ETH_HEADER_LEN + msg_len)
    }
}

/// DATA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Data<'a> {
    /// The fixed fields.
    pub header: DataHeader,
    /// The payload (borrowed from the received frame).
    pub payload: &'a [u8],
}

/// ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    /// Every sequence number below this was received.
    pub cumulative: u32,
    /// Bit `i`: `cumulative + 1 + i` was received.
    pub sack: u64,
    /// Flag DUPLICATE: a frame already received arrived again since the previous ACK.
    pub duplicate: bool,
}

/// NACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nack {
    /// First sequence number the bitmap covers.
    pub base: u32,
    /// Bit `i`: `base + i` is missing.
    pub missing: u64,
}

/// KEEPALIVE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Prober's nonce.
    pub nonce: u64,
    /// Prober's clock when sent (nanoseconds).
    pub timestamp: u64,
    /// This is the echo.
    pub reply: bool,
}

/// DISCONNECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disconnect {
    /// Why.
    pub reason: DisconnectReason,
}

/// Any Tyche message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Message<'a> {
    Discover(Discover),
    DiscoverReply(DiscoverReply<'a>),
    Connect(Connect<'a>),
    Challenge(Challenge),
    Accept(Accept),
    Reject(Reject),
    Request(Request),
    Completion(Completion),
    Data(Data<'a>),
    Ack(Ack),
    Nack(Nack),
    Keepalive(Keepalive),
    Disconnect(Disconnect),
}

fn parse_seq(m: &[u8]) -> Seq {
    Seq { seq: get_u32(m, layout::seq::SEQ), ack: get_u32(m, layout::seq::ACK) }
}
fn emit_seq(m: &mut [u8], s: Seq) {
    put_u32(m, layout::seq::SEQ, s.seq);
    put_u32(m, layout::seq::ACK, s.ack);
}
fn parse_proof(m: &[u8], f: Field, present: bool) -> Option<[u8; 32]> {
    present.then(|| m[f].try_into().expect("32-byte field"))
}
fn emit_proof(m: &mut [u8], f: Field, proof: Option<[u8; 32]>) {
    m[f].copy_from_slice(&proof.unwrap_or([0; 32]));
}
fn pad(buf: &mut [u8], len: usize) -> usize {
    if len < ETH_MIN_FRAME_LEN {
        buf[len..ETH_MIN_FRAME_LEN].fill(0);
        ETH_MIN_FRAME_LEN
    } else {
        len
    }
}

impl<'a> Message<'a> {
    /// The message kind.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Discover(_) => Kind::Discover,
            Message::DiscoverReply(_) => Kind::DiscoverReply,
            Message::Connect(_) => Kind::Connect,
            Message::Challenge(_) => Kind::Challenge,
            Message::Accept(_) => Kind::Accept,
            Message::Reject(_) => Kind::Reject,
            Message::Request(_) => Kind::Request,
            Message::Completion(_) => Kind::Completion,
            Message::Data(_) => Kind::Data,
            Message::Ack(_) => Kind::Ack,
            Message::Nack(_) => Kind::Nack,
            Message::Keepalive(_) => Kind::Keepalive,
            Message::Disconnect(_) => Kind::Disconnect,
        }
    }

    /// Bytes of Tyche message (common header to the end of any payload).
    pub fn message_len(&self) -> usize {
        match self {
            Message::DiscoverReply(r) => layout::discover_reply::ENTRIES + r.exports.wire_len(),
            Message::Connect(c) => {
                layout::connect::NAME + c.export.len() + c.host.map_or(0, |_| layout::connect::HOST_ID_LEN)
            }
            Message::Data(d) => layout::data::PAYLOAD + d.payload.len(),
            other => other.kind().fixed_len(),
        }
    }

    /// Bytes of Ethernet frame [`Message::emit`] writes (padded to the Ethernet minimum).
    pub fn frame_len(&self) -> usize {
        (ETH_HEADER_LEN + self.message_len()).max(ETH_MIN_FRAME_LEN)
    }

    fn flags(&self) -> u16 {
        match self {
            Message::Keepalive(k) if k.reply => flags::REPLY,
            Message::Ack(a) if a.duplicate => flags::DUPLICATE,
            Message::Connect(c) => {
                (if c.proof.is_some() { flags::PROOF } else { 0 }) | (if c.host.is_some() { flags::HOST_ID } else { 0 })
            }
            Message::Accept(a) if a.proof.is_some() => flags::PROOF,
            _ => 0,
        }
    }

    /// Parses the body of a message of `kind` from the Tyche message bytes `m` (common header
    /// first; `m.len()` is the length field, already checked against `kind.fixed_len()`).
    fn parse_body(kind: Kind, m: &'a [u8]) -> Result<Message<'a>> {
        let flags = get_u16(m, layout::common::FLAGS);
        Ok(match kind {
            Kind::Discover => Message::Discover(Discover {
                nonce: get_u32(m, layout::discover::NONCE),
                start: get_u16(m, layout::discover::START),
            }),
            Kind::DiscoverReply => parse_discover_reply(m)?,
            Kind::Connect => parse_connect(m, flags)?,
            Kind::Challenge => Message::Challenge(Challenge {
                nonce: get_u64(m, layout::challenge::NONCE),
                target_nonce: get_u64(m, layout::challenge::TARGET_NONCE),
            }),
            Kind::Accept => {
                use layout::accept as f;
                Message::Accept(Accept {
                    nonce: get_u64(m, f::NONCE),
                    params: ChannelParams::parse(m, f::RING)?,
                    export_size: get_u64(m, f::EXPORT_SIZE),
                    block_size: get_u32(m, f::BLOCK_SIZE),
                    export_flags: get_u16(m, f::EXPORT_FLAGS),
                    proof: parse_proof(m, f::PROOF, flags & flags::PROOF != 0),
                    durability_epoch: DurabilityEpoch(m[f::DURABILITY_EPOCH].try_into().expect("16 bytes")),
                    channel_mac: MacAddr(m[f::CHANNEL_MAC].try_into().expect("6 bytes")),
                })
            }
            Kind::Reject => {
                let holder = MacAddr(m[layout::reject::HOLDER].try_into().expect("6 bytes"));
                Message::Reject(Reject {
                    nonce: get_u64(m, layout::reject::NONCE),
                    reason: RejectReason::from_wire(get_u16(m, layout::reject::REASON))?,
                    holder: (holder != MacAddr::ZERO).then_some(holder),
                })
            }
            Kind::Request => parse_request(m)?,
            Kind::Completion => {
                use layout::completion as f;
                Message::Completion(Completion {
                    seq: parse_seq(m),
                    status: Status::from_wire(get_u16(m, f::STATUS))?,
                    remq: get_u16(m, f::REMQ),
                    damq: get_u16(m, f::DAMQ),
                    tag: get_u64(m, f::TAG),
                })
            }
            Kind::Data => parse_data(m)?,
            Kind::Ack => Message::Ack(Ack {
                cumulative: get_u32(m, layout::ack::SEQ),
                sack: get_u64(m, layout::ack::BITMAP),
                duplicate: flags & flags::DUPLICATE != 0,
            }),
            Kind::Nack => {
                Message::Nack(Nack { base: get_u32(m, layout::ack::SEQ), missing: get_u64(m, layout::ack::BITMAP) })
            }
            Kind::Keepalive => Message::Keepalive(Keepalive {
                nonce: get_u64(m, layout::keepalive::NONCE),
                timestamp: get_u64(m, layout::keepalive::TIMESTAMP),
                reply: flags & flags::REPLY != 0,
            }),
            Kind::Disconnect => Message::Disconnect(Disconnect {
                reason: DisconnectReason::from_wire(get_u16(m, layout::disconnect::REASON))?,
            }),
        })
    }

    /// Writes the whole Ethernet frame (headers, body, payload, padding) into `buf` and returns
    /// its length, [`Message::frame_len`]. Panics if `buf` is shorter, or if the message could
    /// not be parsed back (an export name longer than [`MAX_EXPORT_NAME`], a payload that makes
    /// the message longer than `u16::MAX`): both are the caller's bugs.
    pub fn emit(&self, env: &Envelope, buf: &mut [u8]) -> usize {
        let msg_len = self.message_len();
        let frame_len = self.frame_len();
        assert!(buf.len() >= frame_len, "buffer of {} for a {frame_len}-byte frame", buf.len());
        if let Message::Data(d) = self {
            let at = ETH_HEADER_LEN + layout::data::PAYLOAD;
            buf[at..at + d.payload.len()].copy_from_slice(d.payload);
            return d.header.emit_in_place(env, d.payload.len(), buf);
        }
        env.emit_headers(self.kind(), self.flags(), msg_len, buf);
        let m = &mut buf[ETH_HEADER_LEN..ETH_HEADER_LEN + msg_len];
        m[layout::common::END..].fill(0); // reserved fields
        match self {
            Message::Discover(d) => {
                put_u32(m, layout::discover::NONCE, d.nonce);
                put_u16(m, layout::discover::START, d.start);
            }
            Message::DiscoverReply(r) => r.emit_body(m),
            Message::Connect(c) => c.emit_body(m),
            Message::Challenge(c) => {
                put_u64(m, layout::challenge::NONCE, c.nonce);
                put_u64(m, layout::challenge::TARGET_NONCE, c.target_nonce);
            }
            Message::Accept(a) => a.emit_body(m),
            Message::Reject(r) => {
                put_u64(m, layout::reject::NONCE, r.nonce);
                put_u16(m, layout::reject::REASON, r.reason as u16);
                m[layout::reject::HOLDER].copy_from_slice(&r.holder.unwrap_or(MacAddr::ZERO).octets());
            }
            Message::Request(r) => r.emit_body(m),
            Message::Completion(c) => {
                use layout::completion as f;
                emit_seq(m, c.seq);
                put_u16(m, f::STATUS, c.status as u16);
                put_u16(m, f::REMQ, c.remq);
                put_u16(m, f::DAMQ, c.damq);
                put_u64(m, f::TAG, c.tag);
            }
            Message::Data(_) => unreachable!("handled above"),
            Message::Ack(a) => {
                put_u32(m, layout::ack::SEQ, a.cumulative);
                put_u64(m, layout::ack::BITMAP, a.sack);
            }
            Message::Nack(n) => {
                put_u32(m, layout::ack::SEQ, n.base);
                put_u64(m, layout::ack::BITMAP, n.missing);
            }
            Message::Keepalive(k) => {
                put_u64(m, layout::keepalive::NONCE, k.nonce);
                put_u64(m, layout::keepalive::TIMESTAMP, k.timestamp);
            }
            Message::Disconnect(d) => put_u16(m, layout::disconnect::REASON, d.reason as u16),
        }
        pad(buf, ETH_HEADER_LEN + msg_len)
    }
}

impl DiscoverReply<'_> {
    /// Writes the body (its entries after the fixed fields) into `m`, the message's bytes.
    fn emit_body(&self, m: &mut [u8]) {
        use layout::discover_reply as f;
        let count = u16::try_from(self.exports.len()).expect("export count fits u16");
        put_u32(m, f::NONCE, self.nonce);
        put_u16(m, f::TOTAL, self.total);
        put_u16(m, f::START, self.start);
        put_u16(m, f::COUNT, count);
        let mut at = f::ENTRIES;
        for e in self.exports.iter() {
            assert!(!e.name.is_empty() && e.name.len() <= MAX_EXPORT_NAME);
            put_u64(m, at..at + 8, e.size);
            put_u32(m, at + 8..at + 12, e.block_size);
            put_u16(m, at + 12..at + 14, e.flags);
            m[at + 14] = e.name.len() as u8;
            m[at + 15] = 0;
            m[at + 16..at + 16 + e.name.len()].copy_from_slice(e.name.as_bytes());
            at += e.wire_len();
        }
    }
}

impl Connect<'_> {
    /// Writes the body (the name, then the host id if any) into `m`, the message's bytes.
    fn emit_body(&self, m: &mut [u8]) {
        use layout::connect as f;
        assert!(!self.export.is_empty() && self.export.len() <= MAX_EXPORT_NAME);
        put_u64(m, f::NONCE, self.nonce);
        self.params.emit(m, f::RING);
        emit_proof(m, f::PROOF, self.proof);
        m[f::NAME_LEN] = self.export.len() as u8;
        let end = f::NAME + self.export.len();
        m[f::NAME..end].copy_from_slice(self.export.as_bytes());
        if let Some(host) = self.host {
            m[end..end + f::HOST_ID_LEN].copy_from_slice(&host);
        }
    }
}

impl Accept {
    /// Writes the body into `m`, the message's bytes.
    fn emit_body(&self, m: &mut [u8]) {
        use layout::accept as f;
        put_u64(m, f::NONCE, self.nonce);
        self.params.emit(m, f::RING);
        put_u64(m, f::EXPORT_SIZE, self.export_size);
        put_u32(m, f::BLOCK_SIZE, self.block_size);
        put_u16(m, f::EXPORT_FLAGS, self.export_flags);
        emit_proof(m, f::PROOF, self.proof);
        m[f::DURABILITY_EPOCH].copy_from_slice(&self.durability_epoch.0);
        m[f::CHANNEL_MAC].copy_from_slice(&self.channel_mac.octets());
    }
}

impl Request {
    /// Writes the body into `m`, the message's bytes.
    fn emit_body(&self, m: &mut [u8]) {
        use layout::request as f;
        emit_seq(m, self.seq);
        m[f::OP] = self.op as u8;
        m[f::REQ_FLAGS] = if self.fua { flags::FUA } else { 0 };
        put_u16(m, f::REMQ, self.remq);
        put_u16(m, f::DAMQ, self.damq);
        put_u16(m, f::HOME, self.home);
        put_u64(m, f::TAG, self.tag);
        put_u64(m, f::FLOOR, self.floor);
        put_u64(m, f::OFFSET, self.offset);
        put_u32(m, f::LENGTH, self.length);
    }
}

// ---------------------------------------------------------------------------------------------
// Block status lists (the read data of a BLOCK_STATUS request).

/// One extent of a block status list: `length` bytes from where the previous one ended (the
/// first starts at the request's offset) with the same state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    /// Bytes, a positive multiple of 512.
    pub length: u64,
    /// [`flags::EXTENT_HOLE`] and [`flags::EXTENT_ZERO`].
    pub flags: u32,
}

/// A validated block status list borrowed from a `damq` slot (see [`layout::block_status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStatusList<'a> {
    entries: &'a [u8],
}

impl<'a> BlockStatusList<'a> {
    /// Checks the list a target sent for a BLOCK_STATUS request of `requested` bytes: exactly
    /// [`layout::block_status::LEN`] bytes, a count from 1 to
    /// [`layout::block_status::MAX_EXTENTS`], reserved fields zero, every extent a positive
    /// multiple of 512 bytes with only known flags, together no longer than `requested`, and
    /// zeroes after the last extent. Anything else is [`WireError::Malformed`] (or
    /// [`WireError::Truncated`] for a short buffer).
    pub fn parse(b: &'a [u8], requested: u32) -> Result<Self> {
        use layout::block_status as l;
        if b.len() < l::LEN {
            return Err(WireError::Truncated);
        }
        if b.len() > l::LEN {
            return Err(WireError::BadLength);
        }
        let count = get_u32(b, l::COUNT) as usize;
        if count == 0 || count > l::MAX_EXTENTS || b[l::RESERVED0].iter().any(|&x| x != 0) {
            return Err(WireError::Malformed);
        }
        let end = l::EXTENTS + count * l::EXTENT_LEN;
        if b[end..].iter().any(|&x| x != 0) {
            return Err(WireError::Malformed);
        }
        let entries = &b[l::EXTENTS..end];
        let known = flags::EXTENT_HOLE | flags::EXTENT_ZERO;
        let mut total = 0u64;
        for e in entries.chunks_exact(l::EXTENT_LEN) {
            let length = get_u64(e, l::EXTENT_LENGTH);
            let fl = get_u32(e, l::EXTENT_FLAGS);
            if length == 0
                || length % SECTOR_SIZE as u64 != 0
                || fl & !known != 0
                || get_u32(e, l::EXTENT_RESERVED) != 0
            {
                return Err(WireError::Malformed);
            }
            total = total.checked_add(length).ok_or(WireError::Malformed)?;
        }
        if total > requested as u64 {
            return Err(WireError::Malformed);
        }
        Ok(BlockStatusList { entries })
    }

    /// Number of extents (at least one).
    pub fn len(&self) -> usize {
        self.entries.len() / layout::block_status::EXTENT_LEN
    }

    /// Never true: a valid list has an extent.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes the list covers from the request's offset (at most the requested length).
    pub fn covered(&self) -> u64 {
        self.iter().map(|e| e.length).sum()
    }

    /// The extents, in order.
    pub fn iter(&self) -> impl Iterator<Item = Extent> + 'a {
        use layout::block_status as l;
        self.entries
            .chunks_exact(l::EXTENT_LEN)
            .map(|e| Extent { length: get_u64(e, l::EXTENT_LENGTH), flags: get_u32(e, l::EXTENT_FLAGS) })
    }
}

/// Writes a block status list of `extents` into `buf` (at least [`layout::block_status::LEN`]
/// bytes; the list's bytes are zeroed first). Adjacent extents with the same flags are merged;
/// extents past [`layout::block_status::MAX_EXTENTS`] are left out (the list then covers less
/// than the extents did, as the protocol allows). Returns the bytes the list covers. Panics if
/// `buf` is too short or an extent is empty or unaligned (the caller's bug, not input).
pub fn emit_block_status(extents: impl IntoIterator<Item = Extent>, buf: &mut [u8]) -> u64 {
    use layout::block_status as l;
    let buf = &mut buf[..l::LEN];
    buf.fill(0);
    let mut count = 0usize;
    let mut covered = 0u64;
    let mut last: Option<Extent> = None;
    let mut put = |e: Extent, count: &mut usize, covered: &mut u64| -> bool {
        if *count == l::MAX_EXTENTS {
            return false;
        }
        let at = l::EXTENTS + *count * l::EXTENT_LEN;
        let m = &mut buf[at..at + l::EXTENT_LEN];
        put_u64(m, l::EXTENT_LENGTH, e.length);
        put_u32(m, l::EXTENT_FLAGS, e.flags);
        *count += 1;
        *covered += e.length;
        true
    };
    for e in extents {
        assert!(e.length > 0 && e.length % SECTOR_SIZE as u64 == 0, "extent of {} bytes", e.length);
        match &mut last {
            Some(prev) if prev.flags == e.flags => prev.length += e.length,
            Some(prev) => {
                if !put(*prev, &mut count, &mut covered) {
                    last = None;
                    break;
                }
                *prev = e;
            }
            None => last = Some(e),
        }
    }
    if let Some(prev) = last {
        put(prev, &mut count, &mut covered);
    }
    put_u32(buf, l::COUNT, count as u32);
    covered
}

/// A DISCOVER_REPLY's body: its export entries must fill it exactly.
fn parse_discover_reply(m: &[u8]) -> Result<Message<'_>> {
    use layout::discover_reply as f;
    let count = get_u16(m, f::COUNT);
    let bytes = &m[f::ENTRIES..];
    let mut rest = bytes;
    for _ in 0..count {
        rest = parse_export_entry(rest)?.1;
    }
    if !rest.is_empty() {
        return Err(WireError::BadLength);
    }
    Ok(Message::DiscoverReply(DiscoverReply {
        nonce: get_u32(m, f::NONCE),
        total: get_u16(m, f::TOTAL),
        start: get_u16(m, f::START),
        exports: ExportList::Wire { bytes, count },
    }))
}

/// A CONNECT's body: its name (and host id, when flagged) must end it exactly.
fn parse_connect(m: &[u8], fl: u16) -> Result<Message<'_>> {
    use layout::connect as f;
    let name_len = m[f::NAME_LEN] as usize;
    let has_host = fl & flags::HOST_ID != 0;
    let end = f::NAME + name_len;
    if m.len() != end + if has_host { f::HOST_ID_LEN } else { 0 } {
        return Err(WireError::BadLength);
    }
    Ok(Message::Connect(Connect {
        nonce: get_u64(m, f::NONCE),
        params: ChannelParams::parse(m, f::RING)?,
        proof: parse_proof(m, f::PROOF, fl & flags::PROOF != 0),
        export: parse_name(&m[f::NAME..end])?,
        host: has_host.then(|| m[end..end + f::HOST_ID_LEN].try_into().expect("16 bytes")),
    }))
}

/// A REQUEST's body, checked ([`Request::validate`]).
fn parse_request(m: &[u8]) -> Result<Message<'_>> {
    use layout::request as f;
    let req_flags = m[f::REQ_FLAGS];
    if req_flags & !flags::FUA != 0 {
        return Err(WireError::Malformed);
    }
    let r = Request {
        seq: parse_seq(m),
        op: Op::from_wire(m[f::OP])?,
        fua: req_flags & flags::FUA != 0,
        remq: get_u16(m, f::REMQ),
        damq: get_u16(m, f::DAMQ),
        home: get_u16(m, f::HOME),
        tag: get_u64(m, f::TAG),
        floor: get_u64(m, f::FLOOR),
        offset: get_u64(m, f::OFFSET),
        length: get_u32(m, f::LENGTH),
    };
    r.validate()?;
    Ok(Message::Request(r))
}

/// A DATA message's header and payload: a segment within its count, of whole sectors at a
/// sector offset, into a slot.
fn parse_data(m: &[u8]) -> Result<Message<'_>> {
    use layout::data as f;
    let header = DataHeader {
        seq: parse_seq(m),
        damq: get_u16(m, f::DAMQ),
        seg_index: get_u16(m, f::SEG_INDEX),
        seg_count: get_u16(m, f::SEG_COUNT),
        tag: get_u64(m, f::TAG),
        offset: get_u32(m, f::OFFSET),
    };
    let payload = &m[f::PAYLOAD..];
    let ok = header.seg_index < header.seg_count
        && header.damq != NO_SLOT
        && !payload.is_empty()
        && payload.len() % SECTOR_SIZE as usize == 0
        && header.offset % SECTOR_SIZE == 0;
    if !ok {
        return Err(WireError::Malformed);
    }
    Ok(Message::Data(Data { header, payload }))
}
