//! Byte fixtures: one hand-written Ethernet frame per message kind, written from `layout.rs`
//! (not produced by `emit`), checked in both directions: parsing the bytes gives the expected
//! message, and emitting the message gives exactly the bytes. Then negative tests, one per
//! `WireError` variant and per validation rule.
//!
//! Addresses: initiator `02:54:00:00:00:01`, target `02:54:00:00:00:02`. Sequenced frames run on
//! channel 3 of session `0x0102030405060708`.

use tyche_wire::*;

const ET: u16 = DEFAULT_ETHERTYPE;
const INI: MacAddr = MacAddr([0x02, 0x54, 0, 0, 0, 0x01]);
const TGT: MacAddr = MacAddr([0x02, 0x54, 0, 0, 0, 0x02]);
const SESSION: u64 = 0x0102_0304_0506_0708;

fn env(src: MacAddr, dst: MacAddr, channel: u16, session: u64) -> Envelope {
    Envelope { dst, src, ethertype: ET, channel, session }
}

/// Concatenates two byte arrays at compile time (header literal + payload pattern).
const fn concat<const A: usize, const B: usize, const N: usize>(a: &[u8; A], b: &[u8; B]) -> [u8; N] {
    assert!(A + B == N);
    let mut out = [0u8; N];
    let mut i = 0;
    while i < A {
        out[i] = a[i];
        i += 1;
    }
    while i < N {
        out[i] = b[i - A];
        i += 1;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Fixtures. Comments give the absolute offset of each line in the Ethernet frame.

/// DISCOVER to broadcast, nonce 0xdeadbeef, start 1. 38 bytes, padded to 60.
const DISCOVER: [u8; 60] = [
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, // 0: dst broadcast
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6: src initiator
    0x88, 0xb5, // 12: EtherType
    0x03, 0x01, 0x00, 0x00, // 14: version 3, kind DISCOVER, flags 0
    0x00, 0x18, 0x00, 0x00, // 18: length 24, channel 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 22: session 0
    0xde, 0xad, 0xbe, 0xef, // 30: nonce
    0x00, 0x01, 0x00, 0x00, // 34: start 1, reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 38: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 49: padding
];

/// DISCOVER_REPLY, entries 1 and 2 of 3: "vol1" (4 GiB, 512 B blocks, discard) and "dísk"
/// (1 GiB, 4 KiB blocks, read-only and needs a key). 73 bytes of message, 87 of frame.
const DISCOVER_REPLY: [u8; 87] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x02, 0x00, 0x00, // 14: version 3, kind DISCOVER_REPLY, flags
    0x00, 0x49, 0x00, 0x00, // 18: length 73, channel 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 22: session 0
    0xde, 0xad, 0xbe, 0xef, // 30: nonce
    0x00, 0x03, 0x00, 0x01, // 34: total 3, start 1
    0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 38: count 2, reserved
    // 46: entry 0
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, // size 4 GiB
    0x00, 0x00, 0x02, 0x00, // block size 512
    0x00, 0x04, 0x04, 0x00, // flags DISCARD, name length 4, reserved
    b'v', b'o', b'l', b'1', // name
    // 66: entry 1
    0x00, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00, // size 1 GiB
    0x00, 0x00, 0x10, 0x00, // block size 4096
    0x00, 0x03, 0x05, 0x00, // flags READ_ONLY|NEEDS_KEY, name length 5, reserved
    b'd', 0xc3, 0xad, b's', b'k', // name "dísk"
];

const EXPORTS: [ExportInfo<'static>; 2] = [
    ExportInfo { name: "vol1", size: 4 << 30, block_size: 512, flags: flags::EXPORT_DISCARD },
    ExportInfo {
        name: "dísk",
        size: 1 << 30,
        block_size: 4096,
        flags: flags::EXPORT_READ_ONLY | flags::EXPORT_NEEDS_KEY,
    },
];

/// CONNECT without proof: new session (session 0), channel 0, export "vol1".
const CONNECT: [u8; 98] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0: dst target
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6: src initiator
    0x88, 0xb5, // 12
    0x03, 0x03, 0x00, 0x00, // 14: version 3, kind CONNECT, flags 0
    0x00, 0x54, 0x00, 0x00, // 18: length 84, channel 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 22: session 0
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // 30: nonce
    0x01, 0x00, 0x00, 0x40, // 38: ring 256, remq 64
    0x00, 0x20, 0x04, 0x00, // 42: damq 32, segment 1024
    0x00, 0x02, 0x00, 0x00, // 46: max_io 128 KiB
    0x00, 0x00, 0x00, 0x03, // 50: features 3
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 54: proof (absent: zero)
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 62
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 70
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 78
    0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 86: name length 4, reserved
    b'v', b'o', b'l', b'1', // 94: name
];

/// CONNECT with a host id: as `CONNECT`, flag HOST_ID, 16 bytes of host id after the name.
const CONNECT_HOST: [u8; 114] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0: dst target
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6: src initiator
    0x88, 0xb5, // 12
    0x03, 0x03, 0x00, 0x02, // 14: version 3, kind CONNECT, flags HOST_ID
    0x00, 0x64, 0x00, 0x00, // 18: length 100, channel 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 22: session 0
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // 30: nonce
    0x01, 0x00, 0x00, 0x40, // 38: ring 256, remq 64
    0x00, 0x20, 0x04, 0x00, // 42: damq 32, segment 1024
    0x00, 0x02, 0x00, 0x00, // 46: max_io 128 KiB
    0x00, 0x00, 0x00, 0x03, // 50: features 3
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 54: proof (absent: zero)
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 62
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 70
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 78
    0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 86: name length 4, reserved
    b'v', b'o', b'l', b'1', // 94: name
    0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, // 98: host id
    0xa8, 0xa9, 0xaa, 0xab, 0xac, 0xad, 0xae, 0xaf, // 106
];

const HOST_ID: [u8; 16] =
    [0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8, 0xa9, 0xaa, 0xab, 0xac, 0xad, 0xae, 0xaf];

/// REJECT IN_USE naming the holder 02:54:00:00:00:09.
const REJECT_IN_USE: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x06, 0x00, 0x00, // 14: version 3, kind REJECT, flags
    0x00, 0x20, 0x00, 0x00, // 18: length 32, channel 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 22: session 0
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // 30: nonce
    0x00, 0x08, 0x02, 0x54, 0x00, 0x00, 0x00, 0x09, // 38: reason IN_USE, holder
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 46: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 53: padding
];

const CONNECT_PARAMS: ChannelParams =
    ChannelParams { ring: 256, remq_slots: 64, damq_slots: 32, segment: 1024, max_io: 128 * 1024, features: 3 };

/// CONNECT with proof: joins session `SESSION` with channel index 1, export "dísk".
const CONNECT_PROOF: [u8; 99] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0: dst target
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6: src initiator
    0x88, 0xb5, // 12
    0x03, 0x03, 0x00, 0x01, // 14: version 3, kind CONNECT, flags PROOF
    0x00, 0x55, 0x00, 0x01, // 18: length 85, channel 1
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x89, // 30: nonce
    0x01, 0x00, 0x00, 0x40, // 38: ring 256, remq 64
    0x00, 0x20, 0x04, 0x00, // 42: damq 32, segment 1024
    0x00, 0x02, 0x00, 0x00, // 46: max_io 128 KiB
    0x00, 0x00, 0x00, 0x03, // 50: features 3
    0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, // 54: proof
    0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, // 62
    0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, // 70
    0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f, // 78
    0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 86: name length 5, reserved
    b'd', 0xc3, 0xad, b's', b'k', // 94: name "dísk"
];

const PROOF_A: [u8; 32] = [
    0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, 0x10, 0x11, 0x12,
    0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f,
];

/// CHALLENGE. 46 bytes, padded to 60.
const CHALLENGE: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x04, 0x00, 0x00, // 14: version 3, kind CHALLENGE, flags
    0x00, 0x20, 0x00, 0x00, // 18: length 32, channel 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 22: session 0
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // 30: initiator nonce
    0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff, 0x00, // 38: target nonce
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 46: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 53: padding
];

/// ACCEPT without proof, granting less than CONNECT asked, naming the channel's own target
/// address (a target that steers the channel to a NIC queue). 126 bytes.
const ACCEPT: [u8; 126] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x05, 0x00, 0x00, // 14: version 3, kind ACCEPT, flags 0
    0x00, 0x70, 0x00, 0x00, // 18: length 112, channel 0
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session granted
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // 30: nonce
    0x00, 0x80, 0x00, 0x40, // 38: ring 128, remq 64
    0x00, 0x10, 0x04, 0x00, // 42: damq 16, segment 1024
    0x00, 0x01, 0x00, 0x00, // 46: max_io 64 KiB
    0x00, 0x00, 0x00, 0x01, // 50: features 1
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, // 54: export size 4 GiB
    0x00, 0x00, 0x02, 0x00, // 62: block size 512
    0x00, 0x04, 0x00, 0x00, // 66: export flags DISCARD, reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 70: proof (absent: zero)
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 78
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 86
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 94
    0xe0, 0xe1, 0xe2, 0xe3, 0xe4, 0xe5, 0xe6, 0xe7, // 102: durability epoch
    0xe8, 0xe9, 0xea, 0xeb, 0xec, 0xed, 0xee, 0xef, // 110
    0x06, 0x54, 0x00, 0x00, 0x00, 0x02, // 118: channel MAC (the target's queue address)
    0x00, 0x00, // 124: reserved
];

const ACCEPT_PARAMS: ChannelParams =
    ChannelParams { ring: 128, remq_slots: 64, damq_slots: 16, segment: 1024, max_io: 64 * 1024, features: 1 };

/// ACCEPT with proof, for the joining channel 1, of an export that promises no durability
/// epoch (all zero), on the address the CONNECT went to (channel MAC all zero).
const ACCEPT_PROOF: [u8; 126] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x05, 0x00, 0x01, // 14: version 3, kind ACCEPT, flags PROOF
    0x00, 0x70, 0x00, 0x01, // 18: length 112, channel 1
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x89, // 30: nonce
    0x00, 0x80, 0x00, 0x40, // 38: ring 128, remq 64
    0x00, 0x10, 0x04, 0x00, // 42: damq 16, segment 1024
    0x00, 0x01, 0x00, 0x00, // 46: max_io 64 KiB
    0x00, 0x00, 0x00, 0x01, // 50: features 1
    0x00, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00, // 54: export size 1 GiB
    0x00, 0x00, 0x10, 0x00, // 62: block size 4096
    0x00, 0x03, 0x00, 0x00, // 66: export flags READ_ONLY|NEEDS_KEY, reserved
    0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, // 70: proof
    0xa8, 0xa9, 0xaa, 0xab, 0xac, 0xad, 0xae, 0xaf, // 78
    0xb0, 0xb1, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6, 0xb7, // 86
    0xb8, 0xb9, 0xba, 0xbb, 0xbc, 0xbd, 0xbe, 0xbf, // 94
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 102: durability epoch NONE
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 110
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 118: channel MAC: the address connected to
    0x00, 0x00, // 124: reserved
];

const CHANNEL_MAC: MacAddr = MacAddr([0x06, 0x54, 0x00, 0x00, 0x00, 0x02]);

const EPOCH: DurabilityEpoch =
    DurabilityEpoch([0xe0, 0xe1, 0xe2, 0xe3, 0xe4, 0xe5, 0xe6, 0xe7, 0xe8, 0xe9, 0xea, 0xeb, 0xec, 0xed, 0xee, 0xef]);

const PROOF_B: [u8; 32] = [
    0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8, 0xa9, 0xaa, 0xab, 0xac, 0xad, 0xae, 0xaf, 0xb0, 0xb1, 0xb2,
    0xb3, 0xb4, 0xb5, 0xb6, 0xb7, 0xb8, 0xb9, 0xba, 0xbb, 0xbc, 0xbd, 0xbe, 0xbf,
];

/// REJECT, AUTH_REQUIRED. 46 bytes, padded to 60.
const REJECT: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x06, 0x00, 0x00, // 14: version 3, kind REJECT, flags
    0x00, 0x20, 0x00, 0x00, // 18: length 32, channel 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 22: session 0
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // 30: nonce
    0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 38: reason AUTH_REQUIRED, reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 46: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 53: padding
];

/// REQUEST READ 8 KiB at 1 MiB into damq 2. 78 bytes.
const REQ_READ: [u8; 78] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0: dst target
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6: src initiator
    0x88, 0xb5, // 12
    0x03, 0x10, 0x00, 0x00, // 14: version 3, kind REQUEST, flags
    0x00, 0x40, 0x00, 0x03, // 18: length 64, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x10, // 30: seq 16
    0x00, 0x00, 0x00, 0x07, // 34: ack 7
    0x01, 0x00, 0x00, 0x05, // 38: op READ, req flags 0, remq 5
    0x00, 0x02, 0x00, 0x03, // 42: damq 2, home 3
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, // 46: tag 256
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, // 54: floor 240
    0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, // 62: offset 1 MiB
    0x00, 0x00, 0x20, 0x00, 0x00, 0x00, 0x00, 0x00, // 70: length 8192, reserved
];

/// REQUEST WRITE 1 KiB at 512 from damq 4.
const REQ_WRITE: [u8; 78] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6
    0x88, 0xb5, // 12
    0x03, 0x10, 0x00, 0x00, // 14: version 3, kind REQUEST, flags
    0x00, 0x40, 0x00, 0x03, // 18: length 64, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x11, // 30: seq 17
    0x00, 0x00, 0x00, 0x07, // 34: ack 7
    0x02, 0x00, 0x00, 0x07, // 38: op WRITE, req flags 0, remq 7
    0x00, 0x04, 0x00, 0x00, // 42: damq 4, home 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x02, // 46: tag 258
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, // 54: floor 240
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, // 62: offset 512
    0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, // 70: length 1024, reserved
];

/// REQUEST WRITE with FUA, 4 KiB at 4 GiB + 512, at the wrapping sequence number 0xffffffff.
const REQ_WRITE_FUA: [u8; 78] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6
    0x88, 0xb5, // 12
    0x03, 0x10, 0x00, 0x00, // 14: version 3, kind REQUEST, flags
    0x00, 0x40, 0x00, 0x03, // 18: length 64, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0xff, 0xff, 0xff, 0xff, // 30: seq 0xffffffff
    0x00, 0x00, 0x00, 0x00, // 34: ack 0
    0x02, 0x01, 0x00, 0x06, // 38: op WRITE, req flags FUA, remq 6
    0x00, 0x03, 0x00, 0x00, // 42: damq 3, home 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x01, // 46: tag 257
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf1, // 54: floor 241
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x02, 0x00, // 62: offset 4 GiB + 512
    0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, // 70: length 4096, reserved
];

/// REQUEST FLUSH: no damq slot, offset and length zero.
const REQ_FLUSH: [u8; 78] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6
    0x88, 0xb5, // 12
    0x03, 0x10, 0x00, 0x00, // 14: version 3, kind REQUEST, flags
    0x00, 0x40, 0x00, 0x03, // 18: length 64, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x12, // 30: seq 18
    0x00, 0x00, 0x00, 0x07, // 34: ack 7
    0x03, 0x00, 0x00, 0x08, // 38: op FLUSH, req flags 0, remq 8
    0xff, 0xff, 0x00, 0x00, // 42: damq NO_SLOT, home 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x03, // 46: tag 259
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xfa, // 54: floor 250
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 62: offset 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 70: length 0, reserved
];

/// REQUEST DISCARD 1 MiB at 1 GiB.
const REQ_DISCARD: [u8; 78] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6
    0x88, 0xb5, // 12
    0x03, 0x10, 0x00, 0x00, // 14: version 3, kind REQUEST, flags
    0x00, 0x40, 0x00, 0x03, // 18: length 64, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x13, // 30: seq 19
    0x00, 0x00, 0x00, 0x07, // 34: ack 7
    0x04, 0x00, 0x00, 0x09, // 38: op DISCARD, req flags 0, remq 9
    0xff, 0xff, 0x00, 0x00, // 42: damq NO_SLOT, home 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x04, // 46: tag 260
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xfa, // 54: floor 250
    0x00, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00, // 62: offset 1 GiB
    0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 70: length 1 MiB, reserved
];

/// REQUEST WRITE_ZEROES 512 bytes at 2048, with floor equal to tag.
const REQ_WRITE_ZEROES: [u8; 78] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6
    0x88, 0xb5, // 12
    0x03, 0x10, 0x00, 0x00, // 14: version 3, kind REQUEST, flags
    0x00, 0x40, 0x00, 0x03, // 18: length 64, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x14, // 30: seq 20
    0x00, 0x00, 0x00, 0x07, // 34: ack 7
    0x05, 0x00, 0x00, 0x0a, // 38: op WRITE_ZEROES, req flags 0, remq 10
    0xff, 0xff, 0x00, 0x00, // 42: damq NO_SLOT, home 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x05, // 46: tag 261
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x05, // 54: floor 261
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0x00, // 62: offset 2048
    0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, // 70: length 512, reserved
];

/// REQUEST BLOCK_STATUS: which parts of 64 MiB at 1 MiB are allocated; the list goes to damq 4.
const REQ_BLOCK_STATUS: [u8; 78] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0: dst target
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6
    0x88, 0xb5, // 12
    0x03, 0x10, 0x00, 0x00, // 14: version 3, kind REQUEST, flags
    0x00, 0x40, 0x00, 0x03, // 18: length 64, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x15, // 30: seq 21
    0x00, 0x00, 0x00, 0x07, // 34: ack 7
    0x06, 0x00, 0x00, 0x0b, // 38: op BLOCK_STATUS, req flags 0, remq 11
    0x00, 0x04, 0x00, 0x00, // 42: damq 4, home 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x06, // 46: tag 262
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x06, // 54: floor 262
    0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, // 62: offset 1 MiB
    0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 70: length 64 MiB, reserved
];

/// The block status list a target sends for REQ_BLOCK_STATUS (its first 64 of 512 bytes; the
/// rest are zeroes): 3 extents, 1 MiB of data, 62 MiB of hole, 512 bytes of zeroes.
const BLOCK_STATUS_LIST_HEAD: [u8; 64] = [
    0x00, 0x00, 0x00, 0x03, // 0: count 3
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 4: reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, // 16: length 1 MiB
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 24: flags 0 (data), reserved
    0x00, 0x00, 0x00, 0x00, 0x03, 0xe0, 0x00, 0x00, // 32: length 62 MiB
    0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, // 40: flags HOLE|ZERO, reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, // 48: length 512
    0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, // 56: flags ZERO, reserved
];

fn block_status_list() -> [u8; 512] {
    let mut b = [0u8; 512];
    b[..64].copy_from_slice(&BLOCK_STATUS_LIST_HEAD);
    b
}

const LIST_EXTENTS: [Extent; 3] = [
    Extent { length: 1 << 20, flags: 0 },
    Extent { length: 62 << 20, flags: flags::EXTENT_HOLE | flags::EXTENT_ZERO },
    Extent { length: 512, flags: flags::EXTENT_ZERO },
];

#[test]
fn block_status_list_fixture_parses_and_emits() {
    let b = block_status_list();
    let list = BlockStatusList::parse(&b, 64 << 20).expect("valid list");
    assert_eq!(list.len(), 3);
    assert_eq!(list.iter().collect::<Vec<_>>(), LIST_EXTENTS);
    assert_eq!(list.covered(), (63 << 20) + 512);
    let mut out = [0xee; 600];
    // Split extents of equal flags are merged on the way out.
    let split = [Extent { length: 512 << 10, flags: 0 }, Extent { length: 512 << 10, flags: 0 }];
    let covered = emit_block_status(split.into_iter().chain(LIST_EXTENTS[1..].iter().copied()), &mut out);
    assert_eq!(covered, (63 << 20) + 512);
    assert_eq!(&out[..512], &b[..]);
    assert!(out[512..].iter().all(|&x| x == 0xee), "wrote past the list");
}

#[test]
fn block_status_list_rejects_malformed_lists() {
    let good = block_status_list();
    let bad = |f: &dyn Fn(&mut [u8; 512]), requested: u32, what: &str| {
        let mut b = good;
        f(&mut b);
        assert!(BlockStatusList::parse(&b, requested).is_err(), "{what} accepted");
    };
    assert_eq!(BlockStatusList::parse(&good[..511], 64 << 20), Err(WireError::Truncated));
    assert!(BlockStatusList::parse(&[0u8; 513], 64 << 20).is_err(), "longer than a list");
    bad(&|_| {}, 63 << 20, "a list longer than the range asked");
    bad(&|b| b[3] = 0, 64 << 20, "no extents");
    bad(&|b| b[3] = 32, 64 << 20, "more extents than fit");
    bad(&|b| b[0] = 0x80, 64 << 20, "a huge count");
    bad(&|b| b[4] = 1, 64 << 20, "reserved header bytes");
    bad(&|b| b[23] = 1, 64 << 20, "an unaligned extent");
    bad(&|b| b[16..24].fill(0), 64 << 20, "an empty extent");
    bad(&|b| b[16..24].fill(0xff), u32::MAX, "extents that overflow");
    bad(&|b| b[27] = 4, 64 << 20, "an unknown flag");
    bad(&|b| b[31] = 1, 64 << 20, "reserved extent bytes");
    bad(&|b| b[100] = 1, 64 << 20, "bytes after the last extent");
}

#[test]
fn block_status_list_keeps_at_most_max_extents() {
    let alternating = (0..100).map(|i| Extent { length: 4096, flags: (i % 2) as u32 });
    let mut out = [0u8; 512];
    let covered = emit_block_status(alternating, &mut out);
    let list = BlockStatusList::parse(&out, 100 * 4096).expect("valid");
    assert_eq!(list.len(), layout::block_status::MAX_EXTENTS);
    assert_eq!(covered, 4096 * layout::block_status::MAX_EXTENTS as u64);
    assert_eq!(list.covered(), covered);
}

/// COMPLETION of the READ, status OUT_OF_RANGE. 54 bytes, padded to 60.
const COMPLETION: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x11, 0x00, 0x00, // 14: version 3, kind COMPLETION, flags
    0x00, 0x28, 0x00, 0x03, // 18: length 40, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x20, // 30: seq 32
    0x00, 0x00, 0x00, 0x15, // 34: ack 21
    0x00, 0x02, 0x00, 0x05, // 38: status OUT_OF_RANGE, remq 5
    0x00, 0x02, 0x00, 0x00, // 42: damq 2, reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, // 46: tag 256
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 54: padding
];

/// The fixed part of a DATA segment: segment 1 of 8 of the READ's data (1 KiB segments).
const DATA_HEADER: [u8; 62] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x12, 0x00, 0x00, // 14: version 3, kind DATA, flags
    0x04, 0x30, 0x00, 0x03, // 18: length 48 + 1024 = 1072, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x21, // 30: seq 33
    0x00, 0x00, 0x00, 0x15, // 34: ack 21
    0x00, 0x02, 0x00, 0x01, // 38: damq 2, seg_index 1
    0x00, 0x08, 0x00, 0x00, // 42: seg_count 8, reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, // 46: tag 256
    0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, // 54: offset 1024, reserved
];
/// Payload: two sectors, 0x5a then 0xc3.
const DATA_PAYLOAD: [u8; 1024] = concat::<512, 512, 1024>(&[0x5a; 512], &[0xc3; 512]);
/// DATA: header then payload at 62. 1086 bytes.
const DATA: [u8; 1086] = concat::<62, 1024, 1086>(&DATA_HEADER, &DATA_PAYLOAD);

/// ACK: cumulative 34, SACK bits 0, 2 and 63. 46 bytes, padded to 60.
const ACK: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0: dst target
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6: src initiator
    0x88, 0xb5, // 12
    0x03, 0x20, 0x00, 0x00, // 14: version 3, kind ACK, flags
    0x00, 0x20, 0x00, 0x03, // 18: length 32, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x22, // 30: cumulative 34
    0x00, 0x00, 0x00, 0x00, // 34: reserved
    0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, // 38: SACK bitmap
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 46: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 53: padding
];

/// NACK: positions 35 and 36 missing.
const NACK: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0: dst target
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6: src initiator
    0x88, 0xb5, // 12
    0x03, 0x21, 0x00, 0x00, // 14: version 3, kind NACK, flags
    0x00, 0x20, 0x00, 0x03, // 18: length 32, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x00, 0x00, 0x23, // 30: base 35
    0x00, 0x00, 0x00, 0x00, // 34: reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, // 38: missing bitmap
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 46: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 53: padding
];

/// KEEPALIVE probe, initiator to target.
const KEEPALIVE: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 0: dst target
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 6: src initiator
    0x88, 0xb5, // 12
    0x03, 0x22, 0x00, 0x00, // 14: version 3, kind KEEPALIVE, flags 0
    0x00, 0x20, 0x00, 0x03, // 18: length 32, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, // 30: nonce
    0x00, 0x00, 0x00, 0x17, 0x48, 0x76, 0xe8, 0x00, // 38: timestamp 100 s
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 46: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 53: padding
];

/// KEEPALIVE reply, target to initiator, nonce and timestamp echoed.
const KEEPALIVE_REPLY: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x22, 0x00, 0x01, // 14: version 3, kind KEEPALIVE, flags REPLY
    0x00, 0x20, 0x00, 0x03, // 18: length 32, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, // 30: nonce
    0x00, 0x00, 0x00, 0x17, 0x48, 0x76, 0xe8, 0x00, // 38: timestamp 100 s
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 46: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 53: padding
];

/// DISCONNECT, SHUTDOWN. 38 bytes, padded to 60.
const DISCONNECT: [u8; 60] = [
    0x02, 0x54, 0x00, 0x00, 0x00, 0x01, // 0: dst initiator
    0x02, 0x54, 0x00, 0x00, 0x00, 0x02, // 6: src target
    0x88, 0xb5, // 12
    0x03, 0x23, 0x00, 0x00, // 14: version 3, kind DISCONNECT, flags
    0x00, 0x18, 0x00, 0x03, // 18: length 24, channel 3
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // 22: session
    0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 30: reason SHUTDOWN, reserved
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 38: padding
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // 49: padding
];

// ---------------------------------------------------------------------------------------------
// Expected values.

fn req(seq: u32, ack: u32, op: Op, fua: bool, remq: u16, damq: u16) -> Request {
    Request { seq: Seq { seq, ack }, op, fua, remq, damq, home: 0, tag: 0, floor: 0, offset: 0, length: 0 }
}

/// Every fixture with its envelope and expected message.
fn fixtures() -> Vec<(&'static str, &'static [u8], Envelope, Message<'static>)> {
    let to_tgt = env(INI, TGT, 3, SESSION);
    let to_ini = env(TGT, INI, 3, SESSION);
    vec![
        (
            "DISCOVER",
            &DISCOVER[..],
            env(INI, MacAddr::BROADCAST, 0, 0),
            Message::Discover(Discover { nonce: 0xdead_beef, start: 1 }),
        ),
        (
            "DISCOVER_REPLY",
            &DISCOVER_REPLY[..],
            env(TGT, INI, 0, 0),
            Message::DiscoverReply(DiscoverReply {
                nonce: 0xdead_beef,
                total: 3,
                start: 1,
                exports: ExportList::Slice(&EXPORTS),
            }),
        ),
        (
            "CONNECT",
            &CONNECT[..],
            env(INI, TGT, 0, 0),
            Message::Connect(Connect {
                nonce: 0x1122_3344_5566_7788,
                params: CONNECT_PARAMS,
                proof: None,
                export: "vol1",
                host: None,
            }),
        ),
        (
            "CONNECT+HOST_ID",
            &CONNECT_HOST[..],
            env(INI, TGT, 0, 0),
            Message::Connect(Connect {
                nonce: 0x1122_3344_5566_7788,
                params: CONNECT_PARAMS,
                proof: None,
                export: "vol1",
                host: Some(HOST_ID),
            }),
        ),
        (
            "CONNECT+PROOF",
            &CONNECT_PROOF[..],
            env(INI, TGT, 1, SESSION),
            Message::Connect(Connect {
                nonce: 0x1122_3344_5566_7789,
                params: CONNECT_PARAMS,
                proof: Some(PROOF_A),
                export: "dísk",
                host: None,
            }),
        ),
        (
            "CHALLENGE",
            &CHALLENGE[..],
            env(TGT, INI, 0, 0),
            Message::Challenge(Challenge { nonce: 0x1122_3344_5566_7788, target_nonce: 0x99aa_bbcc_ddee_ff00 }),
        ),
        (
            "ACCEPT",
            &ACCEPT[..],
            env(TGT, INI, 0, SESSION),
            Message::Accept(Accept {
                nonce: 0x1122_3344_5566_7788,
                params: ACCEPT_PARAMS,
                export_size: 4 << 30,
                block_size: 512,
                export_flags: flags::EXPORT_DISCARD,
                proof: None,
                durability_epoch: EPOCH,
                channel_mac: CHANNEL_MAC,
            }),
        ),
        (
            "ACCEPT+PROOF",
            &ACCEPT_PROOF[..],
            env(TGT, INI, 1, SESSION),
            Message::Accept(Accept {
                nonce: 0x1122_3344_5566_7789,
                params: ACCEPT_PARAMS,
                export_size: 1 << 30,
                block_size: 4096,
                export_flags: flags::EXPORT_READ_ONLY | flags::EXPORT_NEEDS_KEY,
                proof: Some(PROOF_B),
                durability_epoch: DurabilityEpoch::NONE,
                channel_mac: MacAddr::ZERO,
            }),
        ),
        (
            "REJECT",
            &REJECT[..],
            env(TGT, INI, 0, 0),
            Message::Reject(Reject { nonce: 0x1122_3344_5566_7788, reason: RejectReason::AuthRequired, holder: None }),
        ),
        (
            "REJECT IN_USE",
            &REJECT_IN_USE[..],
            env(TGT, INI, 0, 0),
            Message::Reject(Reject {
                nonce: 0x1122_3344_5566_7788,
                reason: RejectReason::InUse,
                holder: Some(MacAddr([0x02, 0x54, 0, 0, 0, 0x09])),
            }),
        ),
        (
            "REQUEST READ",
            &REQ_READ[..],
            to_tgt,
            Message::Request(Request {
                home: 3,
                tag: 256,
                floor: 240,
                offset: 1 << 20,
                length: 8192,
                ..req(16, 7, Op::Read, false, 5, 2)
            }),
        ),
        (
            "REQUEST WRITE",
            &REQ_WRITE[..],
            to_tgt,
            Message::Request(Request {
                tag: 258,
                floor: 240,
                offset: 512,
                length: 1024,
                ..req(17, 7, Op::Write, false, 7, 4)
            }),
        ),
        (
            "REQUEST WRITE FUA",
            &REQ_WRITE_FUA[..],
            to_tgt,
            Message::Request(Request {
                tag: 257,
                floor: 241,
                offset: (4 << 30) + 512,
                length: 4096,
                ..req(u32::MAX, 0, Op::Write, true, 6, 3)
            }),
        ),
        (
            "REQUEST FLUSH",
            &REQ_FLUSH[..],
            to_tgt,
            Message::Request(Request { tag: 259, floor: 250, ..req(18, 7, Op::Flush, false, 8, NO_SLOT) }),
        ),
        (
            "REQUEST DISCARD",
            &REQ_DISCARD[..],
            to_tgt,
            Message::Request(Request {
                tag: 260,
                floor: 250,
                offset: 1 << 30,
                length: 1 << 20,
                ..req(19, 7, Op::Discard, false, 9, NO_SLOT)
            }),
        ),
        (
            "REQUEST WRITE_ZEROES",
            &REQ_WRITE_ZEROES[..],
            to_tgt,
            Message::Request(Request {
                tag: 261,
                floor: 261,
                offset: 2048,
                length: 512,
                ..req(20, 7, Op::WriteZeroes, false, 10, NO_SLOT)
            }),
        ),
        (
            "REQUEST BLOCK_STATUS",
            &REQ_BLOCK_STATUS[..],
            to_tgt,
            Message::Request(Request {
                tag: 262,
                floor: 262,
                offset: 1 << 20,
                length: 64 << 20,
                ..req(21, 7, Op::BlockStatus, false, 11, 4)
            }),
        ),
        (
            "COMPLETION",
            &COMPLETION[..],
            to_ini,
            Message::Completion(Completion {
                seq: Seq { seq: 32, ack: 21 },
                status: Status::OutOfRange,
                remq: 5,
                damq: 2,
                tag: 256,
            }),
        ),
        ("DATA", &DATA[..], to_ini, Message::Data(data_value())),
        ("ACK", &ACK[..], to_tgt, Message::Ack(Ack { cumulative: 34, sack: 0x8000_0000_0000_0005, duplicate: false })),
        ("NACK", &NACK[..], to_tgt, Message::Nack(Nack { base: 35, missing: 3 })),
        (
            "KEEPALIVE",
            &KEEPALIVE[..],
            to_tgt,
            Message::Keepalive(Keepalive { nonce: 0x0123_4567_89ab_cdef, timestamp: 100_000_000_000, reply: false }),
        ),
        (
            "KEEPALIVE REPLY",
            &KEEPALIVE_REPLY[..],
            to_ini,
            Message::Keepalive(Keepalive { nonce: 0x0123_4567_89ab_cdef, timestamp: 100_000_000_000, reply: true }),
        ),
        ("DISCONNECT", &DISCONNECT[..], to_ini, Message::Disconnect(Disconnect { reason: DisconnectReason::Shutdown })),
    ]
}

fn data_value() -> Data<'static> {
    Data {
        header: DataHeader {
            seq: Seq { seq: 33, ack: 21 },
            damq: 2,
            seg_index: 1,
            seg_count: 8,
            tag: 256,
            offset: 1024,
        },
        payload: &DATA_PAYLOAD,
    }
}

// ---------------------------------------------------------------------------------------------
// Both directions.

/// A checked frame that must be valid.
#[track_caller]
fn frame(bytes: &[u8]) -> Frame<&[u8]> {
    Frame::new_checked(bytes, ET).unwrap_or_else(|e| panic!("frame rejected: {e}"))
}

/// Parsing the frame only for its error (or success), whatever it borrows.
fn check(bytes: &[u8]) -> Result<()> {
    Frame::new_checked(bytes, ET).and_then(|f| f.parse().map(|_| ()))
}

#[test]
fn every_fixture_parses_to_its_message() {
    for (name, bytes, envelope, expected) in fixtures() {
        let frame = Frame::new_checked(bytes, ET).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(frame.kind(), expected.kind(), "{name}: kind");
        assert_eq!(Envelope::of(&frame), envelope, "{name}: envelope");
        assert_eq!(frame.message().len(), expected.message_len(), "{name}: message length");
        let got = frame.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, expected, "{name}: parsed message");
        let seq = match expected {
            Message::Request(r) => Some(r.seq.seq),
            Message::Completion(c) => Some(c.seq.seq),
            Message::Data(d) => Some(d.header.seq.seq),
            _ => None,
        };
        assert_eq!(frame.seq(), seq, "{name}: seq accessor");
    }
}

#[test]
fn every_message_emits_its_fixture() {
    for (name, bytes, envelope, message) in fixtures() {
        assert_eq!(message.frame_len(), bytes.len(), "{name}: frame_len");
        // Dirty buffer: emit must write every byte of the frame, reserved fields and padding too.
        let mut buf = vec![0xee; bytes.len() + 32];
        let n = message.emit(&envelope, &mut buf);
        assert_eq!(n, bytes.len(), "{name}: emitted length");
        assert_eq!(&buf[..n], bytes, "{name}: emitted bytes");
        assert!(buf[n..].iter().all(|&b| b == 0xee), "{name}: wrote past the frame");
    }
}

#[test]
fn every_kind_has_a_fixture() {
    let kinds: Vec<Kind> = fixtures().iter().map(|f| f.3.kind()).collect();
    for k in Kind::ALL {
        assert!(kinds.contains(k), "no fixture for {k:?}");
    }
    let ops: Vec<Op> = fixtures()
        .iter()
        .filter_map(|f| match f.3 {
            Message::Request(r) => Some(r.op),
            _ => None,
        })
        .collect();
    for op in Op::ALL {
        assert!(ops.contains(op), "no REQUEST fixture for {op:?}");
    }
}

#[test]
fn data_header_emits_in_place() {
    let mut buf = vec![0xee; DATA.len()];
    buf[DATA_FRAME_OVERHEAD..].copy_from_slice(&DATA_PAYLOAD);
    let n = data_value().header.emit_in_place(&env(TGT, INI, 3, SESSION), DATA_PAYLOAD.len(), &mut buf);
    assert_eq!(n, DATA.len(), "emit_in_place length");
    assert_eq!(&buf[..], &DATA[..], "emit_in_place bytes");
}

#[test]
fn parsed_discover_reply_lists_its_entries() {
    let f = frame(&DISCOVER_REPLY);
    let Message::DiscoverReply(r) = f.parse().expect("DISCOVER_REPLY parses") else {
        panic!("not a DISCOVER_REPLY");
    };
    assert_eq!(r.exports.len(), 2, "entry count");
    let entries: Vec<ExportInfo<'_>> = r.exports.iter().collect();
    assert_eq!(entries, EXPORTS, "entries");
    // A reply re-emitted from its parsed (borrowed) form gives the same bytes.
    let mut buf = vec![0; DISCOVER_REPLY.len()];
    let n = Message::DiscoverReply(r).emit(&env(TGT, INI, 0, 0), &mut buf);
    assert_eq!(&buf[..n], &DISCOVER_REPLY[..], "re-emitted reply");
}

#[test]
fn data_payload_borrows_the_frame() {
    let f = frame(&DATA);
    let Message::Data(d) = f.parse().expect("DATA parses") else {
        panic!("not DATA");
    };
    assert!(
        core::ptr::eq(d.payload.as_ptr(), DATA[DATA_FRAME_OVERHEAD..].as_ptr()),
        "payload is a sub-slice of the frame"
    );
}

// ---------------------------------------------------------------------------------------------
// Negative tests.

/// A copy of `bytes` with `with` written at absolute offset `at`.
fn patch(bytes: &[u8], at: usize, with: &[u8]) -> Vec<u8> {
    let mut v = bytes.to_vec();
    v[at..at + with.len()].copy_from_slice(with);
    v
}

/// Absolute offset of a Tyche-header-relative offset.
const fn abs(rel: usize) -> usize {
    ETH_HEADER_LEN + rel
}

/// A copy of `bytes` with the Tyche length field set to `len`.
fn with_len(bytes: &[u8], len: usize) -> Vec<u8> {
    patch(bytes, abs(layout::common::LENGTH.start), &(len as u16).to_be_bytes())
}

#[track_caller]
fn assert_err(bytes: &[u8], want: WireError, what: &str) {
    assert_eq!(check(bytes), Err(want), "{what}");
}

#[test]
fn every_prefix_of_every_fixture_is_truncated_or_whole() {
    for (name, bytes, _, expected) in fixtures() {
        let end = ETH_HEADER_LEN + expected.message_len();
        for n in 0..bytes.len() {
            let prefix = &bytes[..n];
            if n < end {
                assert_eq!(check(prefix), Err(WireError::Truncated), "{name}: prefix of {n} bytes");
            } else {
                // Only padding is missing: the message is whole.
                assert_eq!(frame(prefix).parse(), Ok(expected), "{name}: prefix of {n} bytes (padding cut)");
            }
        }
    }
}

#[test]
fn wrong_ethertype_is_not_tyche() {
    for (name, bytes, _, _) in fixtures() {
        let ipv4 = patch(bytes, 12, &[0x08, 0x00]);
        assert_err(&ipv4, WireError::NotTyche, name);
        // A frame of another configured EtherType.
        assert_eq!(
            Frame::new_checked(bytes, 0x88b6).err(),
            Some(WireError::NotTyche),
            "{name}: configured EtherType 0x88b6"
        );
    }
    // A short frame of another protocol is reported as such, not as truncated.
    assert_err(&patch(&DISCOVER, 12, &[0x08, 0x06])[..20], WireError::NotTyche, "short ARP");
    // A custom EtherType is honoured.
    let custom = patch(&ACK, 12, &[0x88, 0xb6]);
    assert!(Frame::new_checked(&custom[..], 0x88b6).is_ok(), "custom EtherType accepted");
}

#[test]
fn other_versions_are_rejected() {
    for (name, bytes, _, _) in fixtures() {
        for v in [0u8, 1, 2, 4, 0xff] {
            let b = patch(bytes, abs(layout::common::VERSION), &[v]);
            assert_err(&b, WireError::Version, &format!("{name}: version {v}"));
        }
    }
}

#[test]
fn an_accept_without_its_durability_epoch_is_refused() {
    // Version 1's 88-byte ACCEPT (no epoch), under either version, is a bad length: an
    // initiator never takes a grant that does not say where its writes live.
    for v in [1u8, VERSION] {
        let old = with_len(&patch(&ACCEPT, abs(layout::common::VERSION), &[v]), 88);
        let want = if v == VERSION { WireError::BadLength } else { WireError::Version };
        assert_err(&old[..14 + 88], want, &format!("88-byte ACCEPT, version {v}"));
        assert_err(&old, want, &format!("88-byte ACCEPT with the epoch as padding, version {v}"));
    }
}

#[test]
fn an_accept_without_its_channel_address_is_refused() {
    // Version 2's 104-byte ACCEPT (no CHANNEL_MAC), under either version, is refused: under
    // version 2 for its version, under version 3 as a bad length, padded or not.
    for v in [2u8, VERSION] {
        let old = with_len(&patch(&ACCEPT, abs(layout::common::VERSION), &[v]), 104);
        let want = if v == VERSION { WireError::BadLength } else { WireError::Version };
        assert_err(&old[..14 + 104], want, &format!("104-byte ACCEPT, version {v}"));
        assert_err(&old, want, &format!("104-byte ACCEPT with the channel MAC as padding, version {v}"));
    }
}

#[test]
fn the_channel_address_resolves_against_the_connected_address() {
    let connected = MacAddr::local(2);
    let accept = |channel_mac| Accept {
        nonce: 1,
        params: ACCEPT_PARAMS,
        export_size: 0,
        block_size: 512,
        export_flags: 0,
        proof: None,
        durability_epoch: DurabilityEpoch::NONE,
        channel_mac,
    };
    // All zero, or the address connected to: that address.
    assert_eq!(accept(MacAddr::ZERO).channel_addr(connected), Ok(connected));
    assert_eq!(accept(connected).channel_addr(connected), Ok(connected));
    // Another unicast address: that one.
    assert_eq!(accept(CHANNEL_MAC).channel_addr(connected), Ok(CHANNEL_MAC));
    // A group address owns no channel: refused, named.
    for bad in [MacAddr::BROADCAST, MacAddr([0x01, 0x00, 0x5e, 0, 0, 1]), MacAddr([0x33, 0x33, 0, 0, 0, 1])] {
        assert_eq!(accept(bad).channel_addr(connected), Err(bad), "{bad}");
    }
    // The reserved bytes after it are ignored on receipt.
    let b = patch(&ACCEPT, abs(layout::accept::RESERVED1.start), &[0xff, 0xff]);
    let Ok(Message::Accept(a)) = Frame::new_checked(&b[..], DEFAULT_ETHERTYPE).unwrap().parse() else {
        panic!("ACCEPT with reserved bytes set")
    };
    assert_eq!(a.channel_mac, CHANNEL_MAC);
}

#[test]
fn durability_epochs_print_and_parse_as_hex() {
    assert_eq!(EPOCH.to_hex(), "e0e1e2e3e4e5e6e7e8e9eaebecedeeef");
    assert_eq!(DurabilityEpoch::from_hex(&EPOCH.to_hex()), Some(EPOCH));
    assert_eq!(DurabilityEpoch::from_hex(" E0E1E2E3E4E5E6E7E8E9EAEBECEDEEEF\n"), Some(EPOCH));
    for bad in [
        "",
        "e0",
        "e0e1e2e3e4e5e6e7e8e9eaebecedeeefff",
        "g0e1e2e3e4e5e6e7e8e9eaebecedeeef",
        "+0e1e2e3e4e5e6e7e8e9eaebecedeeef",
    ] {
        assert_eq!(DurabilityEpoch::from_hex(bad), None, "{bad:?}");
    }
    // The all-zero epoch promises nothing: it keeps no writes, not even its own.
    assert!(DurabilityEpoch::NONE.is_none());
    assert!(!DurabilityEpoch::NONE.keeps(&DurabilityEpoch::NONE));
    assert!(EPOCH.keeps(&EPOCH));
    assert!(!EPOCH.keeps(&DurabilityEpoch([0xe0; 16])));
}

#[test]
fn unknown_kinds_are_rejected() {
    let known: Vec<u8> = Kind::ALL.iter().map(|&k| k as u8).collect();
    for k in 0..=u8::MAX {
        if known.contains(&k) {
            continue;
        }
        let b = patch(&KEEPALIVE, abs(layout::common::KIND), &[k]);
        assert_err(&b, WireError::UnknownKind, &format!("kind {k:#04x}"));
    }
    assert_err(&patch(&REQ_READ, abs(layout::common::KIND), &[0x7f]), WireError::UnknownKind, "kind 0x7f");
}

#[test]
fn fixed_size_messages_need_their_exact_length() {
    for (name, bytes, _, expected) in fixtures() {
        let kind = expected.kind();
        if matches!(kind, Kind::DiscoverReply | Kind::Connect | Kind::Data) {
            continue;
        }
        let len = kind.fixed_len();
        // One byte too long (the buffer holds it, so only the length is wrong).
        let mut longer = with_len(bytes, len + 1);
        longer.push(0);
        assert_err(&longer, WireError::BadLength, &format!("{name}: length + 1"));
        assert_err(&with_len(bytes, len - 1), WireError::BadLength, &format!("{name}: length - 1"));
        assert_err(&with_len(bytes, 0), WireError::BadLength, &format!("{name}: length 0"));
    }
}

#[test]
fn variable_messages_need_their_fixed_part() {
    assert_err(
        &with_len(&CONNECT, layout::connect::NAME - 1),
        WireError::BadLength,
        "CONNECT shorter than its fixed part",
    );
    assert_err(&with_len(&DATA, layout::data::PAYLOAD - 1), WireError::BadLength, "DATA shorter than its header");
    assert_err(
        &with_len(&DISCOVER_REPLY, layout::discover_reply::ENTRIES - 1),
        WireError::BadLength,
        "DISCOVER_REPLY shorter than its fixed part",
    );
}

#[test]
fn length_beyond_the_buffer_is_truncated() {
    for (name, bytes, _, expected) in fixtures() {
        let over = bytes.len() - ETH_HEADER_LEN + 1;
        assert_err(&with_len(bytes, over), WireError::Truncated, &format!("{name}: length {over}"));
        assert_err(&with_len(bytes, u16::MAX as usize), WireError::Truncated, &format!("{name}: length 65535"));
        // The true length with the buffer one byte short of it.
        let end = ETH_HEADER_LEN + expected.message_len();
        assert_err(&bytes[..end - 1], WireError::Truncated, name);
    }
}

#[test]
fn reserved_bits_and_fields_are_ignored() {
    // High flag byte, unknown low flag bits of kinds without flags, reserved body fields.
    let b = patch(&REQ_READ, abs(layout::common::FLAGS.start), &[0xff, 0xfe]);
    let b = patch(&b, abs(layout::request::RESERVED1.start), &[1, 2, 3, 4]);
    assert_eq!(frame(&b).parse(), frame(&REQ_READ).parse(), "REQUEST with reserved bits set");
    let b = patch(&KEEPALIVE_REPLY, abs(layout::common::FLAGS.start), &[0x80, 0x01]);
    assert_eq!(frame(&b).parse(), frame(&KEEPALIVE_REPLY).parse(), "KEEPALIVE reserved flag byte");
    // (The digest field is checked by a channel that negotiated it, not by the parser.)
    let b = patch(&DATA, abs(layout::data::DIGEST.start), &[9, 9, 9, 9]);
    assert_eq!(frame(&b).parse(), frame(&DATA).parse(), "DATA digest field");
    // Non-zero padding is not part of the message.
    let b = patch(&DISCONNECT, 50, &[0x55; 10]);
    assert_eq!(frame(&b).parse(), frame(&DISCONNECT).parse(), "non-zero padding");
    // A proof field without the PROOF flag is no proof.
    let b = patch(&CONNECT, abs(layout::connect::PROOF.start), &[0x77; 32]);
    assert_eq!(frame(&b).parse(), frame(&CONNECT).parse(), "CONNECT proof bytes without flag");
}

// --- REQUEST -------------------------------------------------------------------------------------

#[test]
fn request_with_unknown_op_is_malformed() {
    for op in [0u8, 7, 0x7f, 0xff] {
        let b = patch(&REQ_WRITE, abs(layout::request::OP), &[op]);
        assert_err(&b, WireError::Malformed, &format!("op {op}"));
    }
}

#[test]
fn request_with_unknown_flag_bit_is_malformed() {
    for bit in 1..8 {
        let f = 1u8 << bit;
        let b = patch(&REQ_WRITE, abs(layout::request::REQ_FLAGS), &[f]);
        assert_err(&b, WireError::Malformed, &format!("req flag {f:#04x}"));
        let b = patch(&REQ_WRITE, abs(layout::request::REQ_FLAGS), &[f | flags::FUA]);
        assert_err(&b, WireError::Malformed, &format!("req flag {f:#04x} | FUA"));
    }
}

#[test]
fn request_must_be_sector_aligned() {
    for (name, bytes) in [
        ("READ", &REQ_READ[..]),
        ("WRITE", &REQ_WRITE[..]),
        ("DISCARD", &REQ_DISCARD[..]),
        ("WRITE_ZEROES", &REQ_WRITE_ZEROES[..]),
    ] {
        for delta in [1u64, 256, 511] {
            let f = frame(bytes);
            let Message::Request(r) = f.parse().expect("fixture") else { panic!("not a request") };
            let off = (r.offset + delta).to_be_bytes();
            let b = patch(bytes, abs(layout::request::OFFSET.start), &off);
            assert_err(&b, WireError::Malformed, &format!("{name}: offset + {delta}"));
            let len = (r.length + delta as u32).to_be_bytes();
            let b = patch(bytes, abs(layout::request::LENGTH.start), &len);
            assert_err(&b, WireError::Malformed, &format!("{name}: length + {delta}"));
        }
    }
}

#[test]
fn request_slots_must_match_the_op() {
    let no_slot = NO_SLOT.to_be_bytes();
    let damq = layout::request::DAMQ.start;
    assert_err(&patch(&REQ_READ, abs(damq), &no_slot), WireError::Malformed, "READ with NO_SLOT damq");
    assert_err(&patch(&REQ_WRITE, abs(damq), &no_slot), WireError::Malformed, "WRITE with NO_SLOT damq");
    for (name, bytes) in
        [("FLUSH", &REQ_FLUSH[..]), ("DISCARD", &REQ_DISCARD[..]), ("WRITE_ZEROES", &REQ_WRITE_ZEROES[..])]
    {
        assert_err(&patch(bytes, abs(damq), &[0, 1]), WireError::Malformed, &format!("{name} with a damq slot"));
    }
    assert_err(&patch(&REQ_READ, abs(layout::request::REMQ.start), &no_slot), WireError::Malformed, "remq NO_SLOT");
}

#[test]
fn request_lengths_must_match_the_op() {
    let len = abs(layout::request::LENGTH.start);
    assert_err(&patch(&REQ_FLUSH, len, &512u32.to_be_bytes()), WireError::Malformed, "FLUSH with nonzero length");
    assert_err(
        &patch(&REQ_FLUSH, abs(layout::request::OFFSET.start), &512u64.to_be_bytes()),
        WireError::Malformed,
        "FLUSH with nonzero offset",
    );
    for (name, bytes) in [
        ("READ", &REQ_READ[..]),
        ("WRITE", &REQ_WRITE[..]),
        ("DISCARD", &REQ_DISCARD[..]),
        ("WRITE_ZEROES", &REQ_WRITE_ZEROES[..]),
    ] {
        assert_err(&patch(bytes, len, &[0; 4]), WireError::Malformed, &format!("{name} with zero length"));
    }
    // A range that wraps the 64-bit offset space.
    let b = patch(&REQ_READ, abs(layout::request::OFFSET.start), &(u64::MAX - 511).to_be_bytes());
    assert_err(&b, WireError::Malformed, "offset + length overflows");
}

#[test]
fn request_floor_above_tag_is_malformed() {
    // REQ_WRITE_ZEROES has floor == tag == 261: legal. One more is not.
    assert!(check(&REQ_WRITE_ZEROES).is_ok(), "floor == tag is legal");
    let b = patch(&REQ_WRITE_ZEROES, abs(layout::request::FLOOR.start), &262u64.to_be_bytes());
    assert_err(&b, WireError::Malformed, "floor > tag");
}

// --- COMPLETION, REJECT, DISCONNECT codes ------------------------------------------------------

#[test]
fn unknown_codes_are_malformed() {
    for s in [8u16, 0x00ff, 0xffff] {
        let b = patch(&COMPLETION, abs(layout::completion::STATUS.start), &s.to_be_bytes());
        assert_err(&b, WireError::Malformed, &format!("status {s}"));
    }
    for r in [0u16, 9, 0xffff] {
        let b = patch(&REJECT, abs(layout::reject::REASON.start), &r.to_be_bytes());
        assert_err(&b, WireError::Malformed, &format!("reject reason {r}"));
    }
    for r in [4u16, 0xffff] {
        let b = patch(&DISCONNECT, abs(layout::disconnect::REASON.start), &r.to_be_bytes());
        assert_err(&b, WireError::Malformed, &format!("disconnect reason {r}"));
    }
}

// --- DATA ------------------------------------------------------------------------------------------

#[test]
fn data_segment_index_must_be_below_count() {
    let idx = abs(layout::data::SEG_INDEX.start);
    let cnt = abs(layout::data::SEG_COUNT.start);
    assert_err(&patch(&DATA, idx, &[0, 8]), WireError::Malformed, "seg_index == seg_count");
    assert_err(&patch(&DATA, idx, &[0xff, 0xff]), WireError::Malformed, "seg_index 0xffff");
    assert_err(&patch(&DATA, cnt, &[0, 0]), WireError::Malformed, "seg_count 0");
    assert_err(&patch(&DATA, cnt, &[0, 1]), WireError::Malformed, "seg_count 1, index 1");
}

#[test]
fn data_payload_must_be_whole_sectors() {
    let pl = layout::data::PAYLOAD;
    assert_err(&with_len(&DATA, pl), WireError::Malformed, "empty payload");
    for n in [1usize, 511, 513, 1023] {
        assert_err(&with_len(&DATA, pl + n), WireError::Malformed, &format!("payload of {n} bytes"));
    }
    // A shorter but whole-sector payload is fine (the length field rules, not the buffer).
    let cut = with_len(&DATA, pl + 512);
    let f = frame(&cut);
    let Message::Data(d) = f.parse().expect("512-byte payload") else { panic!("not DATA") };
    assert_eq!(d.payload, &DATA_PAYLOAD[..512], "payload cut by the length field");
}

#[test]
fn data_needs_a_slot_and_an_aligned_offset() {
    assert_err(
        &patch(&DATA, abs(layout::data::DAMQ.start), &NO_SLOT.to_be_bytes()),
        WireError::Malformed,
        "DATA to NO_SLOT",
    );
    assert_err(
        &patch(&DATA, abs(layout::data::OFFSET.start), &1025u32.to_be_bytes()),
        WireError::Malformed,
        "DATA at an unaligned offset",
    );
}

// --- CONNECT / ACCEPT --------------------------------------------------------------------------

/// A CONNECT frame for an export name of raw bytes `name` (length field and name length agree).
fn connect_with_name(name: &[u8]) -> Vec<u8> {
    let mut v = CONNECT[..abs(layout::connect::NAME)].to_vec();
    v[abs(layout::connect::NAME_LEN)] = name.len() as u8;
    v.extend_from_slice(name);
    let v = with_len(&v, layout::connect::NAME + name.len());
    let mut v = v;
    if v.len() < ETH_MIN_FRAME_LEN {
        v.resize(ETH_MIN_FRAME_LEN, 0);
    }
    v
}

#[test]
fn connect_name_length_must_match() {
    let nl = abs(layout::connect::NAME_LEN);
    assert_err(&patch(&CONNECT, nl, &[5]), WireError::BadLength, "name length 5 for 4 bytes");
    assert_err(&patch(&CONNECT, nl, &[3]), WireError::BadLength, "name length 3 for 4 bytes");
    assert_err(&patch(&CONNECT, nl, &[0xff]), WireError::BadLength, "name length 255");
}

#[test]
fn connect_name_must_be_valid() {
    assert!(check(&connect_with_name(b"a")).is_ok(), "1-byte name");
    assert!(check(&connect_with_name(&[b'n'; 64])).is_ok(), "64-byte name");
    assert_err(&connect_with_name(b""), WireError::Malformed, "empty name");
    assert_err(&connect_with_name(&[b'n'; 65]), WireError::Malformed, "65-byte name");
    assert_err(&connect_with_name(&[b'n'; 255]), WireError::Malformed, "255-byte name");
    assert_err(&connect_with_name(b"vol\xff"), WireError::Malformed, "non-UTF-8 name");
    assert_err(&connect_with_name(b"d\xc3"), WireError::Malformed, "cut UTF-8 sequence");
    assert_err(&connect_with_name(b"vol\n1"), WireError::Malformed, "control character");
    assert_err(&connect_with_name(b"\0"), WireError::Malformed, "NUL name");
}

/// Channel parameter fields, relative to the start of RING, for CONNECT and ACCEPT alike.
const P_RING: usize = 0;
const P_REMQ: usize = 2;
const P_DAMQ: usize = 4;
const P_SEGMENT: usize = 6;
const P_MAX_IO: usize = 8;

#[test]
fn channel_params_must_be_valid() {
    let bad: &[(&str, usize, &[u8])] = &[
        ("ring 0", P_RING, &[0, 0]),
        ("ring 1", P_RING, &[0, 1]),
        ("ring 255", P_RING, &[0, 255]),
        ("ring 384", P_RING, &[1, 0x80]),
        ("remq 0", P_REMQ, &[0, 0]),
        ("remq 0xffff", P_REMQ, &[0xff, 0xff]),
        ("damq 0", P_DAMQ, &[0, 0]),
        ("damq 0xffff", P_DAMQ, &[0xff, 0xff]),
        ("segment 0", P_SEGMENT, &[0, 0]),
        ("segment 256", P_SEGMENT, &[1, 0]),
        ("segment 1000", P_SEGMENT, &[0x03, 0xe8]),
        ("segment 1536", P_SEGMENT, &[0x06, 0x00]),
        ("max_io 0", P_MAX_IO, &[0, 0, 0, 0]),
        ("max_io 256", P_MAX_IO, &[0, 0, 1, 0]),
        ("max_io 1000", P_MAX_IO, &[0, 0, 0x03, 0xe8]),
    ];
    for (fixture, bytes, base) in
        [("CONNECT", &CONNECT[..], layout::connect::RING.start), ("ACCEPT", &ACCEPT[..], layout::accept::RING.start)]
    {
        for (what, at, with) in bad {
            let b = patch(bytes, abs(base + at), with);
            assert_err(&b, WireError::Malformed, &format!("{fixture}: {what}"));
        }
        // max_io needing more than u16::MAX segments of 512 bytes.
        let b = patch(bytes, abs(base + P_SEGMENT), &512u16.to_be_bytes());
        let ok = patch(&b, abs(base + P_MAX_IO), &(512u32 * 65535).to_be_bytes());
        assert!(check(&ok).is_ok(), "{fixture}: 65535 segments");
        let b = patch(&b, abs(base + P_MAX_IO), &(512u32 * 65536).to_be_bytes());
        assert_err(&b, WireError::Malformed, &format!("{fixture}: 65536 segments"));
        // Boundaries that are legal.
        let b = patch(bytes, abs(base + P_RING), &[0, 2]);
        assert!(check(&b).is_ok(), "{fixture}: ring 2");
        let b = patch(bytes, abs(base + P_SEGMENT), &[0x80, 0]);
        assert!(check(&b).is_ok(), "{fixture}: segment 32768");
    }
}

#[test]
fn channel_params_validate_directly() {
    assert_eq!(CONNECT_PARAMS.validate(), Ok(()), "fixture params");
    let bad = [
        ChannelParams { ring: 3, ..CONNECT_PARAMS },
        ChannelParams { segment: 768, ..CONNECT_PARAMS },
        ChannelParams { remq_slots: 0, ..CONNECT_PARAMS },
        ChannelParams { damq_slots: NO_SLOT, ..CONNECT_PARAMS },
        ChannelParams { max_io: 513, ..CONNECT_PARAMS },
    ];
    for p in bad {
        assert_eq!(p.validate(), Err(WireError::Malformed), "{p:?}");
    }
}

// --- DISCOVER_REPLY ----------------------------------------------------------------------------

#[test]
fn discover_reply_count_must_match_the_entries() {
    let count = abs(layout::discover_reply::COUNT.start);
    for c in [0u16, 1, 3, 0xffff] {
        let b = patch(&DISCOVER_REPLY, count, &c.to_be_bytes());
        assert_err(&b, WireError::BadLength, &format!("count {c} for 2 entries"));
    }
    // The length field cuts the last entry short.
    assert_err(
        &with_len(&DISCOVER_REPLY, DISCOVER_REPLY.len() - ETH_HEADER_LEN - 1),
        WireError::BadLength,
        "last name cut",
    );
    assert_err(&with_len(&DISCOVER_REPLY, 52 + 10), WireError::BadLength, "last entry's fixed part cut");
    // An entry whose name length runs past the message.
    let b = patch(&DISCOVER_REPLY, 66 + 14, &[6]);
    assert_err(&b, WireError::BadLength, "name length past the end");
    // No entries: a valid empty page.
    let b = with_len(&DISCOVER_REPLY, layout::discover_reply::ENTRIES);
    let b = patch(&b, count, &[0, 0]);
    let f = frame(&b);
    let Message::DiscoverReply(r) = f.parse().expect("empty page") else { panic!("not a DISCOVER_REPLY") };
    assert!(r.exports.is_empty(), "empty page has no entries");
}

#[test]
fn discover_reply_names_must_be_valid() {
    assert_err(&patch(&DISCOVER_REPLY, 62, &[0xff]), WireError::Malformed, "non-UTF-8 name");
    assert_err(&patch(&DISCOVER_REPLY, 62, &[0x07]), WireError::Malformed, "control character");
    // An empty name is refused before the bytes it leaves over are looked at.
    let b = patch(&DISCOVER_REPLY, 46 + 14, &[0]);
    assert_err(&b, WireError::Malformed, "empty name");
}

#[test]
fn wire_errors_have_distinct_names() {
    let names: Vec<&str> = WireError::ALL.iter().map(|e| e.as_str()).collect();
    let shown: Vec<String> = WireError::ALL.iter().map(|e| e.to_string()).collect();
    for i in 0..names.len() {
        for j in i + 1..names.len() {
            assert_ne!(names[i], names[j], "as_str");
            assert_ne!(shown[i], shown[j], "Display");
        }
    }
}

#[test]
fn ack_flag_duplicate_round_trips() {
    let (_, _, envelope, _) = fixtures().into_iter().find(|f| f.0 == "ACK").expect("the ACK fixture");
    let flagged = patch(&ACK, abs(layout::common::FLAGS.start), &flags::DUPLICATE.to_be_bytes());
    let want = Message::Ack(Ack { cumulative: 34, sack: 0x8000_0000_0000_0005, duplicate: true });
    assert_eq!(frame(&flagged).parse().expect("parses"), want);
    let mut buf = vec![0xee; flagged.len()];
    assert_eq!(want.emit(&envelope, &mut buf), flagged.len());
    assert_eq!(buf, flagged, "emitted bytes");
}
