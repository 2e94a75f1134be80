//! Proofs of an export's pre-shared key (the CHALLENGE round of docs/protocol.md §4.2).
//!
//! Both proofs are HMAC-SHA256 keyed with the pre-shared key over the same transcript, preceded
//! by a label that differs per direction so that one end's proof is never valid as the other's:
//!
//! ```text
//! label            "tyche-psk-v1 initiator" or "tyche-psk-v1 target" (ASCII, no terminator)
//! 0x00             separator
//! nonce            u64 big-endian: the initiator's CONNECT nonce
//! target_nonce     u64 big-endian: the target's CHALLENGE nonce
//! name_len         u8: length of the export name
//! export           the export name (UTF-8)
//! initiator MAC    6 bytes: the source of the CONNECT
//! target MAC       6 bytes: the destination of the CONNECT
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tyche_wire::MacAddr;

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
            ProofRole::Initiator => b"tyche-psk-v1 initiator",
            ProofRole::Target => b"tyche-psk-v1 target",
        }
    }
}

/// What both proofs of one CONNECT cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProofInput<'a> {
    /// The initiator's CONNECT nonce.
    pub nonce: u64,
    /// The target's CHALLENGE nonce.
    pub target_nonce: u64,
    /// The export name.
    pub export: &'a str,
    /// The initiator's MAC (source of the CONNECT).
    pub initiator: MacAddr,
    /// The target's MAC (destination of the CONNECT).
    pub target: MacAddr,
}

fn mac_for(key: &[u8], role: ProofRole, input: &ProofInput<'_>) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts keys of any length");
    m.update(role.label());
    m.update(&[0]);
    m.update(&input.nonce.to_be_bytes());
    m.update(&input.target_nonce.to_be_bytes());
    m.update(&[input.export.len() as u8]);
    m.update(input.export.as_bytes());
    m.update(&input.initiator.octets());
    m.update(&input.target.octets());
    m
}

/// The proof `role` sends for `input` with `key`.
pub fn proof(key: &[u8], role: ProofRole, input: &ProofInput<'_>) -> [u8; 32] {
    mac_for(key, role, input).finalize().into_bytes().into()
}

/// Whether `candidate` is the proof `role` must send for `input` (compared in constant time).
pub fn verify(key: &[u8], role: ProofRole, input: &ProofInput<'_>, candidate: &[u8; 32]) -> bool {
    mac_for(key, role, input).verify_slice(candidate).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> ProofInput<'static> {
        ProofInput {
            nonce: 1,
            target_nonce: 2,
            export: "disk",
            initiator: MacAddr::local(1),
            target: MacAddr::local(2),
        }
    }

    #[test]
    fn proofs_differ_by_role_key_and_transcript() {
        let p = proof(b"secret", ProofRole::Initiator, &input());
        assert!(verify(b"secret", ProofRole::Initiator, &input(), &p), "own proof verifies");
        assert!(!verify(b"secret", ProofRole::Target, &input(), &p), "initiator proof is not a target proof");
        assert!(!verify(b"other", ProofRole::Initiator, &input(), &p), "wrong key fails");
        let moved = ProofInput { target_nonce: 3, ..input() };
        assert!(!verify(b"secret", ProofRole::Initiator, &moved, &p), "other nonce fails");
    }
}
