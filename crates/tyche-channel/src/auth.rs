//! Keyed exports: the proofs of the pre-shared key in the CHALLENGE round, the per-channel keys
//! derived from them, and the sealing of every frame of a keyed channel (docs/protocol.md §4.2
//! and §7, docs/security.md).
//!
//! **Proofs** are HMAC-SHA256 keyed with the pre-shared key over the handshake transcript,
//! preceded by a label that differs per direction so that one end's proof is never valid as the
//! other's. The initiator's proof (in CONNECT) covers what the CONNECT says; the target's proof
//! (in ACCEPT) covers that and what the ACCEPT grants:
//!
//! ```text
//! label            "tyche-psk-v2 initiator" or "tyche-psk-v2 target" (ASCII, no terminator)
//! 0x00             separator
//! nonce            u64: the initiator's CONNECT nonce
//! target_nonce     u64: the target's CHALLENGE nonce
//! session          u64: the CONNECT's SESSION (0 when it creates a session)
//! channel          u16: the CONNECT's CHANNEL
//! initiator MAC    6 bytes: the source of the CONNECT
//! target MAC       6 bytes: the destination of the CONNECT
//! host flag        u8: 1 if the CONNECT carries a host id, else 0
//! host id          16 bytes: the host id, or zeros
//! asked            16 bytes: RING u16, REMQ_SLOTS u16, DAMQ_SLOTS u16, SEGMENT u16,
//!                  MAX_IO u32, FEATURES u32 as in the CONNECT
//! name_len         u8: length of the export name
//! export           the export name (UTF-8)
//! -- the target's proof only --
//! granted session  u64: the ACCEPT's SESSION
//! granted          16 bytes: the ACCEPT's parameters, laid out as `asked`
//! export size      u64
//! block size       u32
//! export flags     u16
//! durability epoch 16 bytes: the ACCEPT's DURABILITY_EPOCH
//! channel MAC      6 bytes: the ACCEPT's CHANNEL_MAC as sent (zeros: the address connected to)
//! ```
//!
//! Every integer is big-endian. Nonces come from the operating system's random source.
//!
//! **Channel keys**: each direction of a channel has its own AES-256-GCM key,
//! `HKDF-SHA256(salt = the target's proof, ikm = the pre-shared key, info = label)` with label
//! `"tyche-v2 initiator to target"` or `"tyche-v2 target to initiator"`. The target's proof
//! commits to the whole transcript (both fresh nonces, the session, the channel, the grant), so
//! every CONNECT gives new keys.
//!
//! **Sealing**: the sender sets flag `SEALED` in the common header and appends a 24-byte trailer
//! after the message (outside `LENGTH`): its frame counter for this direction (`u64`, starting at
//! 0 and incremented for every frame, retransmissions included) and the AES-256-GCM tag. The
//! nonce is 4 zero bytes and the counter. Without encryption the additional data is the frame
//! from the destination MAC to the end of the message and nothing is encrypted; with encryption
//! (export flag `ENCRYPTED`) the additional data is the Ethernet and common headers and the rest
//! of the message (sequencing fields, request fields, payload) is encrypted in place. A receiver
//! drops a frame without a valid tag, or whose counter it already accepted or is older than its
//! window of [`REPLAY_WINDOW`] counters, before anything else looks at it.

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use aws_lc_rs::hkdf;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tyche_wire::{flags, layout, ChannelParams, MacAddr, ETH_HEADER_LEN, ETH_MIN_FRAME_LEN};

use crate::drop_reason::DropReason;
use crate::role::Role;

/// A pre-shared key in memory: zeroed when dropped, never printed.
#[derive(Clone)]
pub struct Psk(zeroize::Zeroizing<Vec<u8>>);

impl Psk {
    /// A copy of `key`.
    pub fn new(key: &[u8]) -> Psk {
        Psk(zeroize::Zeroizing::new(key.to_vec()))
    }
}

impl From<Vec<u8>> for Psk {
    /// Takes the key's bytes (no copy is left behind).
    fn from(key: Vec<u8>) -> Psk {
        Psk(zeroize::Zeroizing::new(key))
    }
}

impl std::ops::Deref for Psk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Psk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Psk(<{} bytes, redacted>)", self.0.len())
    }
}

/// Fewest bytes a pre-shared key has.
pub const MIN_KEY_LEN: usize = 16;
/// Most bytes a key file may hold (a key is hashed into channel keys; more is a wrong file).
pub const MAX_KEY_FILE: u64 = 4096;

/// Why a key file was refused ([`read_key_file`]); each says which file.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// The file could not be examined or read.
    #[error("{}: {source}", path.display())]
    Os {
        /// The key file.
        path: std::path::PathBuf,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// Not a regular file, or larger than [`MAX_KEY_FILE`].
    #[error("{}: a key file is a regular file of at most {MAX_KEY_FILE} bytes", path.display())]
    NotAKeyFile {
        /// The key file.
        path: std::path::PathBuf,
    },
    /// Its group or others may read it.
    #[error(
        "{} can be read by its group or others (mode {mode:o}); make it readable by its owner alone (chmod 600)",
        path.display()
    )]
    Readable {
        /// The key file.
        path: std::path::PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Fewer than [`MIN_KEY_LEN`] bytes of key.
    #[error("{}: a pre-shared key has at least {MIN_KEY_LEN} bytes", path.display())]
    TooShort {
        /// The key file.
        path: std::path::PathBuf,
    },
}

/// Reads a key file, the one rule of both daemons: refused when its group or others may read
/// it; the key is the file's bytes without one final line break (`\n` or `\r\n`), at least
/// [`MIN_KEY_LEN`] of them. The error's text is a sentence naming the file.
pub fn read_key_file(path: &std::path::Path) -> Result<Psk, KeyFileError> {
    use std::os::unix::fs::PermissionsExt;
    let os = |source| KeyFileError::Os { path: path.to_owned(), source };
    let meta = std::fs::metadata(path).map_err(os)?;
    let mode = meta.permissions().mode();
    if !meta.is_file() || meta.len() > MAX_KEY_FILE {
        return Err(KeyFileError::NotAKeyFile { path: path.to_owned() });
    }
    if mode & 0o077 != 0 {
        return Err(KeyFileError::Readable { path: path.to_owned(), mode: mode & 0o777 });
    }
    // Held as a Psk from the first byte read: wiped when dropped, never printed.
    let mut key = Psk::from(std::fs::read(path).map_err(os)?);
    if key.0.last() == Some(&b'\n') {
        key.0.pop();
        if key.0.last() == Some(&b'\r') {
            key.0.pop();
        }
    }
    if key.len() < MIN_KEY_LEN {
        return Err(KeyFileError::TooShort { path: path.to_owned() });
    }
    Ok(key)
}

/// Which end a proof comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProofRole {
    /// The initiator's proof, carried in CONNECT.
    Initiator,
    /// The target's proof, carried in ACCEPT.
    Target,
}

impl ProofRole {
    fn label(self) -> &'static [u8] {
        match self {
            ProofRole::Initiator => b"tyche-psk-v2 initiator",
            ProofRole::Target => b"tyche-psk-v2 target",
        }
    }
}

/// What a CONNECT says, as both proofs cover it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProofInput<'a> {
    /// The initiator's CONNECT nonce.
    pub nonce: u64,
    /// The target's CHALLENGE nonce.
    pub target_nonce: u64,
    /// The CONNECT's session id (0: a new session).
    pub session: u64,
    /// The CONNECT's channel index.
    pub channel: u16,
    /// The export name.
    pub export: &'a str,
    /// The initiator's MAC (source of the CONNECT).
    pub initiator: MacAddr,
    /// The target's MAC (destination of the CONNECT).
    pub target: MacAddr,
    /// The CONNECT's host id.
    pub host: Option<[u8; 16]>,
    /// The parameters the CONNECT asked for.
    pub asked: ChannelParams,
}

/// What an ACCEPT grants, as the target's proof covers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The session id in the ACCEPT.
    pub session: u64,
    /// The granted parameters.
    pub params: ChannelParams,
    /// Export size in bytes.
    pub export_size: u64,
    /// Export logical block size.
    pub block_size: u32,
    /// Export flags.
    pub export_flags: u16,
    /// The export's durability epoch: covered, so that nobody between the ends can make an
    /// initiator believe writes survived a target crash that lost them.
    pub durability_epoch: tyche_wire::DurabilityEpoch,
    /// The ACCEPT's `CHANNEL_MAC` as sent: covered, so that nobody between the ends can move
    /// the channel's frames to an address of their choosing.
    pub channel_mac: MacAddr,
}

fn params_bytes(p: &ChannelParams) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..2].copy_from_slice(&p.ring.to_be_bytes());
    b[2..4].copy_from_slice(&p.remq_slots.to_be_bytes());
    b[4..6].copy_from_slice(&p.damq_slots.to_be_bytes());
    b[6..8].copy_from_slice(&p.segment.to_be_bytes());
    b[8..12].copy_from_slice(&p.max_io.to_be_bytes());
    b[12..16].copy_from_slice(&p.features.to_be_bytes());
    b
}

fn mac_for(key: &[u8], role: ProofRole, input: &ProofInput<'_>, grant: Option<&Grant>) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts keys of any length");
    m.update(role.label());
    m.update(&[0]);
    m.update(&input.nonce.to_be_bytes());
    m.update(&input.target_nonce.to_be_bytes());
    m.update(&input.session.to_be_bytes());
    m.update(&input.channel.to_be_bytes());
    m.update(&input.initiator.octets());
    m.update(&input.target.octets());
    m.update(&[u8::from(input.host.is_some())]);
    m.update(&input.host.unwrap_or([0; 16]));
    m.update(&params_bytes(&input.asked));
    m.update(&[input.export.len() as u8]);
    m.update(input.export.as_bytes());
    if let Some(g) = grant {
        m.update(&g.session.to_be_bytes());
        m.update(&params_bytes(&g.params));
        m.update(&g.export_size.to_be_bytes());
        m.update(&g.block_size.to_be_bytes());
        m.update(&g.export_flags.to_be_bytes());
        m.update(&g.durability_epoch.0);
        m.update(&g.channel_mac.octets());
    }
    m
}

/// The initiator's proof (in CONNECT) for `input` with `key`.
pub fn initiator_proof(key: &[u8], input: &ProofInput<'_>) -> [u8; 32] {
    mac_for(key, ProofRole::Initiator, input, None).finalize().into_bytes().into()
}

/// Whether `candidate` is the initiator's proof for `input` (compared in constant time).
pub fn verify_initiator(key: &[u8], input: &ProofInput<'_>, candidate: &[u8; 32]) -> bool {
    mac_for(key, ProofRole::Initiator, input, None).verify_slice(candidate).is_ok()
}

/// The target's proof (in ACCEPT) for `input` and `grant` with `key`.
pub fn target_proof(key: &[u8], input: &ProofInput<'_>, grant: &Grant) -> [u8; 32] {
    mac_for(key, ProofRole::Target, input, Some(grant)).finalize().into_bytes().into()
}

/// Whether `candidate` is the target's proof for `input` and `grant` (constant time).
pub fn verify_target(key: &[u8], input: &ProofInput<'_>, grant: &Grant, candidate: &[u8; 32]) -> bool {
    mac_for(key, ProofRole::Target, input, Some(grant)).verify_slice(candidate).is_ok()
}

/// 64 bits from the operating system's random source (CONNECT and CHALLENGE nonces, session
/// ids). Panics only if the kernel cannot supply randomness at all, which no caller can work
/// around safely.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    aws_lc_rs::rand::fill(&mut b).expect("the operating system's random source failed");
    u64::from_ne_bytes(b)
}

/// Counters of one receiver's window: the highest counter accepted and which of the
/// [`REPLAY_WINDOW`] counters below it were.
pub const REPLAY_WINDOW: u64 = 1024;

#[derive(Debug, Clone)]
struct ReplayWindow {
    /// One more than the highest counter accepted (0: none yet).
    next: u64,
    bits: [u64; (REPLAY_WINDOW / 64) as usize],
}

impl ReplayWindow {
    fn new() -> Self {
        ReplayWindow { next: 0, bits: [0; (REPLAY_WINDOW / 64) as usize] }
    }

    fn bit(c: u64) -> (usize, u64) {
        let i = c % REPLAY_WINDOW;
        ((i / 64) as usize, 1u64 << (i % 64))
    }

    /// Whether counter `c` may be accepted (not seen, not too old).
    fn fresh(&self, c: u64) -> bool {
        if c >= self.next {
            return true;
        }
        if self.next - c > REPLAY_WINDOW {
            return false;
        }
        let (w, m) = Self::bit(c);
        self.bits[w] & m == 0
    }

    /// Records counter `c` as accepted (after [`ReplayWindow::fresh`] and the tag).
    fn accept(&mut self, c: u64) {
        if c >= self.next {
            // Counters between the old highest and `c` were not seen: clear their bits.
            let gap = c - self.next;
            if gap >= REPLAY_WINDOW {
                self.bits = [0; (REPLAY_WINDOW / 64) as usize];
            } else {
                for k in self.next..c {
                    let (w, m) = Self::bit(k);
                    self.bits[w] &= !m;
                }
            }
            self.next = c + 1;
        }
        let (w, m) = Self::bit(c);
        self.bits[w] |= m;
    }
}

/// The keys and counters of one channel end of a keyed export.
pub struct Sealer {
    tx: LessSafeKey,
    rx: LessSafeKey,
    encrypt: bool,
    tx_counter: u64,
    window: ReplayWindow,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        f.debug_struct("Sealer")
            .field("encrypt", &self.encrypt)
            .field("tx_counter", &self.tx_counter)
            .field("rx_next", &self.window.next)
            .finish_non_exhaustive()
    }
}

fn direction_key(prk: &hkdf::Prk, label: &'static [u8]) -> LessSafeKey {
    let info = [label];
    let okm = prk.expand(&info, &AES_256_GCM).expect("32 bytes is a valid HKDF-SHA256 output length");
    LessSafeKey::new(UnboundKey::from(okm))
}

const I2T: &[u8] = b"tyche-v2 initiator to target";
const T2I: &[u8] = b"tyche-v2 target to initiator";

impl Sealer {
    /// The sealer of `role`'s end of a channel whose ACCEPT carried `target_proof`, for the
    /// export's pre-shared `key`; `encrypt` when the export is encrypted.
    pub fn derive(key: &[u8], target_proof: &[u8; 32], role: Role, encrypt: bool) -> Sealer {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, target_proof).extract(key);
        let (tx, rx) = match role {
            Role::Initiator => (I2T, T2I),
            Role::Target => (T2I, I2T),
        };
        Sealer {
            tx: direction_key(&prk, tx),
            rx: direction_key(&prk, rx),
            encrypt,
            tx_counter: 0,
            window: ReplayWindow::new(),
        }
    }

    /// Whether this channel encrypts.
    pub fn encrypts(&self) -> bool {
        self.encrypt
    }

    fn nonce(counter: u64) -> Nonce {
        let mut n = [0u8; aead::NONCE_LEN];
        n[4..].copy_from_slice(&counter.to_be_bytes());
        Nonce::assume_unique_for_key(n)
    }

    /// Seals the frame in `buf` (as written by an emit: Ethernet header, message, padding):
    /// sets flag `SEALED`, encrypts if the channel does, and writes the trailer after the
    /// message. Returns the sealed frame's length; `buf` must hold [`SEAL_OVERHEAD`] bytes more
    /// than the message.
    pub fn seal(&mut self, buf: &mut [u8]) -> usize {
        let c = ETH_HEADER_LEN;
        let length =
            u16::from_be_bytes([buf[c + layout::common::LENGTH.start], buf[c + layout::common::LENGTH.start + 1]]);
        let end = c + length as usize;
        let f = c + layout::common::FLAGS.start;
        let fl = u16::from_be_bytes([buf[f], buf[f + 1]]) | flags::SEALED;
        buf[f..f + 2].copy_from_slice(&fl.to_be_bytes());
        let counter = self.tx_counter;
        self.tx_counter += 1;
        let nonce = Self::nonce(counter);
        let tag = if self.encrypt {
            let (head, rest) = buf.split_at_mut(c + layout::SEALED_PLAINTEXT_START);
            let plain = &mut rest[..end - head.len()];
            self.tx.seal_in_place_separate_tag(nonce, Aad::from(&*head), plain)
        } else {
            self.tx.seal_in_place_separate_tag(nonce, Aad::from(&buf[..end]), &mut [])
        }
        .expect("a frame is far below AES-GCM's message limit");
        buf[end + layout::trailer::COUNTER.start..end + layout::trailer::COUNTER.end]
            .copy_from_slice(&counter.to_be_bytes());
        buf[end + layout::trailer::TAG.start..end + layout::trailer::TAG.end].copy_from_slice(tag.as_ref());
        let sealed = end + layout::trailer::END;
        if sealed < ETH_MIN_FRAME_LEN {
            buf[sealed..ETH_MIN_FRAME_LEN].fill(0);
        }
        sealed.max(ETH_MIN_FRAME_LEN)
    }

    /// Checks a received frame (a valid Tyche frame of this channel) and gives its plaintext:
    /// `bytes` itself when the channel only authenticates, the decrypted copy in `scratch` when
    /// it encrypts. Nothing of this end changes unless the frame is authentic and new.
    pub fn open<'a>(&mut self, bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> Result<&'a [u8], DropReason> {
        let c = ETH_HEADER_LEN;
        let head = c + layout::common::END;
        if bytes.len() < head {
            return Err(DropReason::Unauthenticated);
        }
        let fl =
            u16::from_be_bytes([bytes[c + layout::common::FLAGS.start], bytes[c + layout::common::FLAGS.start + 1]]);
        let length =
            u16::from_be_bytes([bytes[c + layout::common::LENGTH.start], bytes[c + layout::common::LENGTH.start + 1]]);
        let end = c + length as usize;
        if fl & flags::SEALED == 0 || end < head || bytes.len() < end + layout::trailer::END {
            return Err(DropReason::Unauthenticated);
        }
        let t = &bytes[end..end + layout::trailer::END];
        let counter = u64::from_be_bytes(t[layout::trailer::COUNTER].try_into().expect("8 bytes"));
        let tag = &t[layout::trailer::TAG];
        if !self.window.fresh(counter) {
            return Err(DropReason::Replayed);
        }
        let nonce = Self::nonce(counter);
        let out: &'a [u8] = if self.encrypt {
            scratch.clear();
            scratch.extend_from_slice(&bytes[..end]);
            let (aad, ct) = scratch.split_at_mut(c + layout::SEALED_PLAINTEXT_START);
            self.rx
                .open_in_place_separate_tag(nonce, Aad::from(&*aad), tag, ct)
                .map_err(|_| DropReason::Unauthenticated)?;
            &scratch[..]
        } else {
            self.rx
                .open_in_place_separate_tag(nonce, Aad::from(&bytes[..end]), tag, &mut [])
                .map_err(|_| DropReason::Unauthenticated)?;
            &bytes[..end]
        };
        self.window.accept(counter);
        Ok(out)
    }
}

/// Bytes a sealed frame needs beyond its message: the trailer.
pub const SEAL_OVERHEAD: usize = layout::trailer::END;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_are_read_by_one_rule() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("tyche-key-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let key = |name: &str, bytes: &[u8], mode: u32| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).expect("write");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
            read_key_file(&p)
        };
        let k = b"0123456789abcdef";
        assert_eq!(&key("plain", k, 0o600).expect("a key")[..], k);
        assert_eq!(&key("lf", b"0123456789abcdef\n", 0o400).expect("a key")[..], k, "one LF dropped");
        assert_eq!(&key("crlf", b"0123456789abcdef\r\n", 0o600).expect("a key")[..], k, "one CRLF dropped");
        // Only one line break is not part of the key (both daemons read it so).
        assert_eq!(&key("lflf", b"0123456789abcdef\n\n", 0o600).expect("a key")[..], b"0123456789abcdef\n");
        let e = key("short", b"0123456789abcde\n", 0o600).expect_err("15 bytes");
        assert!(matches!(e, KeyFileError::TooShort { .. }) && e.to_string().contains("at least 16 bytes"), "{e}");
        let e = key("open", k, 0o644).expect_err("group-readable").to_string();
        assert!(e.contains("mode 644") && e.contains("chmod 600"), "{e}");
        let e = read_key_file(&dir.join("missing")).expect_err("missing");
        assert!(matches!(&e, KeyFileError::Os { source, .. } if source.kind() == std::io::ErrorKind::NotFound), "{e}");
        assert!(e.to_string().contains("missing"), "{e}");
        let e = key("huge", &[b'k'; 4097], 0o600).expect_err("over the limit");
        assert!(e.to_string().contains("at most 4096 bytes"), "{e}");
        assert!(read_key_file(&dir).expect_err("a directory").to_string().contains("regular file"));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    fn input() -> ProofInput<'static> {
        ProofInput {
            nonce: 1,
            target_nonce: 2,
            session: 0,
            channel: 0,
            export: "disk",
            initiator: MacAddr::local(1),
            target: MacAddr::local(2),
            host: Some([7; 16]),
            asked: crate::config::default_params(1024),
        }
    }

    fn grant() -> Grant {
        Grant {
            session: 9,
            params: crate::config::default_params(1024),
            export_size: 1 << 20,
            block_size: 512,
            export_flags: 2,
            durability_epoch: tyche_wire::DurabilityEpoch(core::array::from_fn(|i| 0x10 + i as u8)),
            channel_mac: MacAddr([0x06, 0x54, 0, 0, 0, 2]),
        }
    }

    #[test]
    fn proofs_differ_by_role_key_and_transcript() {
        let p = initiator_proof(b"secret", &input());
        assert!(verify_initiator(b"secret", &input(), &p), "own proof verifies");
        assert!(!verify_target(b"secret", &input(), &grant(), &p), "initiator proof is not a target proof");
        assert!(!verify_initiator(b"other", &input(), &p), "wrong key fails");
        for moved in [
            ProofInput { target_nonce: 3, ..input() },
            ProofInput { session: 5, ..input() },
            ProofInput { channel: 9, ..input() },
            ProofInput { host: None, ..input() },
            ProofInput { host: Some([8; 16]), ..input() },
            ProofInput { asked: crate::config::default_params(512), ..input() },
            ProofInput { export: "disk2", ..input() },
            ProofInput { initiator: MacAddr::local(3), ..input() },
        ] {
            assert!(!verify_initiator(b"secret", &moved, &p), "{moved:?} must not verify");
        }
        let t = target_proof(b"secret", &input(), &grant());
        assert!(verify_target(b"secret", &input(), &grant(), &t));
        for g in [
            Grant { session: 10, ..grant() },
            Grant { export_flags: 0, ..grant() },
            Grant { export_size: 1, ..grant() },
            Grant { durability_epoch: tyche_wire::DurabilityEpoch::NONE, ..grant() },
            Grant { channel_mac: MacAddr::ZERO, ..grant() },
            Grant { channel_mac: MacAddr([0x06, 0x54, 0, 0, 0, 3]), ..grant() },
        ] {
            assert!(!verify_target(b"secret", &input(), &g, &t), "{g:?} must not verify");
        }
    }

    /// The proofs of one transcript, computed independently (Python's `hmac` and `hashlib`) from
    /// the layout in the module docs and docs/protocol.md §4.2.
    #[test]
    fn proof_fixtures() {
        let hex = |b: [u8; 32]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let key = b"a key of at least sixteen bytes";
        assert_eq!(
            hex(initiator_proof(key, &input())),
            "07ef95b93b0c17f1736259418dcd1263103746942b36de16804e044845b258b9"
        );
        assert_eq!(
            hex(target_proof(key, &input(), &grant())),
            "216249c6efae38efcf629c1c6f8347d23511a52d3abe96167064c8353ec2d9ac"
        );
    }

    #[test]
    fn replay_window_accepts_each_counter_once() {
        let mut w = ReplayWindow::new();
        for c in [0, 2, 1, 5, 1000, 3] {
            assert!(w.fresh(c), "{c}");
            w.accept(c);
            assert!(!w.fresh(c), "{c} again");
        }
        assert!(w.fresh(4));
        w.accept(5000);
        assert!(!w.fresh(5000 - REPLAY_WINDOW - 1), "older than the window");
        assert!(w.fresh(5000 - REPLAY_WINDOW + 1), "inside the window and never seen");
        assert!(!w.fresh(1000), "accepted long ago, now outside");
    }
}
