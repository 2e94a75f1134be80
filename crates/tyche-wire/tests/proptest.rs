//! Property tests: parsing never panics, every valid message survives emit → parse unchanged,
//! and `segment_size_for` always picks a power of two that fits both limits.

use proptest::prelude::*;
use tyche_wire::*;

const ET: u16 = DEFAULT_ETHERTYPE;

// ---------------------------------------------------------------------------------------------
// Strategies.

fn mac() -> impl Strategy<Value = MacAddr> {
    any::<[u8; 6]>().prop_map(MacAddr)
}

fn envelope() -> impl Strategy<Value = Envelope> {
    (mac(), mac(), any::<u16>(), any::<u16>(), any::<u64>())
        .prop_map(|(dst, src, ethertype, channel, session)| Envelope { dst, src, ethertype, channel, session })
}

/// 1..=64 bytes of UTF-8 without control characters.
fn name() -> impl Strategy<Value = String> {
    "[^\\p{Cc}]{1,64}".prop_map(|s| {
        let mut out = String::new();
        for c in s.chars() {
            if out.len() + c.len_utf8() > MAX_EXPORT_NAME {
                break;
            }
            out.push(c);
        }
        out
    })
}

fn pick<T: Copy + core::fmt::Debug + 'static>(all: &'static [T]) -> impl Strategy<Value = T> {
    (0..all.len()).prop_map(move |i| all[i])
}

fn slot() -> impl Strategy<Value = u16> {
    0..NO_SLOT
}

fn seq() -> impl Strategy<Value = Seq> {
    (any::<u32>(), any::<u32>()).prop_map(|(seq, ack)| Seq { seq, ack })
}

fn params() -> impl Strategy<Value = ChannelParams> {
    (1u32..=15, 1..NO_SLOT, 1..NO_SLOT, 9u32..=15, any::<u32>()).prop_flat_map(
        |(ring_log, remq_slots, damq_slots, seg_log, features)| {
            let segment = 1u32 << seg_log;
            let max_sectors = (u32::MAX / SECTOR_SIZE).min(u16::MAX as u32 * (segment / SECTOR_SIZE));
            (1..=max_sectors).prop_map(move |sectors| ChannelParams {
                ring: 1 << ring_log,
                remq_slots,
                damq_slots,
                segment: segment as u16,
                max_io: sectors * SECTOR_SIZE,
                features,
            })
        },
    )
}

fn request() -> impl Strategy<Value = Request> {
    let max_len_sectors = u32::MAX / SECTOR_SIZE;
    let max_off_sectors = u64::MAX / SECTOR_SIZE as u64 - max_len_sectors as u64;
    (
        seq(),
        pick(Op::ALL),
        any::<bool>(),
        slot(),
        slot(),
        (any::<u16>(), any::<u64>()),
        any::<u64>(),
        0..=max_off_sectors,
        1..=max_len_sectors,
    )
        .prop_map(move |(seq, op, fua, remq, damq, (home, tag), floor_seed, off, len)| {
            let (damq, offset, length) = match op {
                Op::Read | Op::Write | Op::BlockStatus => (damq, off * SECTOR_SIZE as u64, len * SECTOR_SIZE),
                Op::Discard | Op::WriteZeroes => (NO_SLOT, off * SECTOR_SIZE as u64, len * SECTOR_SIZE),
                Op::Flush => (NO_SLOT, 0, 0),
            };
            Request {
                seq,
                op,
                fua,
                remq,
                damq,
                home,
                tag,
                floor: tag.checked_add(1).map_or(floor_seed, |n| floor_seed % n),
                offset,
                length,
            }
        })
}

fn data() -> impl Strategy<Value = (DataHeader, Vec<u8>)> {
    (seq(), slot(), 1..=u16::MAX, any::<u16>(), any::<u64>(), 0..=u32::MAX / SECTOR_SIZE, 1usize..=16).prop_flat_map(
        |(seq, damq, seg_count, idx_seed, tag, off, sectors)| {
            let header =
                DataHeader { seq, damq, seg_index: idx_seed % seg_count, seg_count, tag, offset: off * SECTOR_SIZE };
            let len = sectors * SECTOR_SIZE as usize;
            (Just(header), proptest::collection::vec(any::<u8>(), len))
        },
    )
}

type ExportOwned = (String, u64, u32, u16);

/// A message with the data it borrows.
#[derive(Debug, Clone)]
enum Owned {
    Plain(Message<'static>),
    DiscoverReply { nonce: u32, total: u16, start: u16, exports: Vec<ExportOwned> },
    Connect { nonce: u64, params: ChannelParams, proof: Option<[u8; 32]>, export: String, host: Option<[u8; 16]> },
    Data(DataHeader, Vec<u8>),
}

fn owned() -> impl Strategy<Value = Owned> {
    let plain = prop_oneof![
        (any::<u32>(), any::<u16>()).prop_map(|(nonce, start)| Message::Discover(Discover { nonce, start })),
        (any::<u64>(), any::<u64>())
            .prop_map(|(nonce, target_nonce)| Message::Challenge(Challenge { nonce, target_nonce })),
        (
            any::<u64>(),
            params(),
            any::<u64>(),
            any::<u32>(),
            any::<u16>(),
            any::<Option<[u8; 32]>>(),
            any::<[u8; 16]>(),
            any::<[u8; 6]>()
        )
            .prop_map(|(nonce, params, export_size, block_size, export_flags, proof, epoch, mac)| {
                let durability_epoch = DurabilityEpoch(epoch);
                let channel_mac = MacAddr(mac);
                Message::Accept(Accept {
                    nonce,
                    params,
                    export_size,
                    block_size,
                    export_flags,
                    proof,
                    durability_epoch,
                    channel_mac,
                })
            }),
        (any::<u64>(), pick(RejectReason::ALL), any::<Option<[u8; 6]>>()).prop_map(|(nonce, reason, holder)| {
            let holder = holder.map(MacAddr).filter(|m| *m != MacAddr::ZERO);
            Message::Reject(Reject { nonce, reason, holder })
        }),
        request().prop_map(Message::Request),
        (seq(), pick(Status::ALL), any::<u16>(), any::<u16>(), any::<u64>()).prop_map(
            |(seq, status, remq, damq, tag)| Message::Completion(Completion { seq, status, remq, damq, tag })
        ),
        (any::<u32>(), any::<u64>(), any::<bool>()).prop_map(|(cumulative, sack, duplicate)| Message::Ack(Ack {
            cumulative,
            sack,
            duplicate
        })),
        (any::<u32>(), any::<u64>()).prop_map(|(base, missing)| Message::Nack(Nack { base, missing })),
        (any::<u64>(), any::<u64>(), any::<bool>())
            .prop_map(|(nonce, timestamp, reply)| { Message::Keepalive(Keepalive { nonce, timestamp, reply }) }),
        pick(DisconnectReason::ALL).prop_map(|reason| Message::Disconnect(Disconnect { reason })),
    ];
    prop_oneof![
        4 => plain.prop_map(Owned::Plain),
        1 => (
            any::<u32>(),
            any::<u16>(),
            any::<u16>(),
            proptest::collection::vec((name(), any::<u64>(), any::<u32>(), any::<u16>()), 0..20)
        )
            .prop_map(|(nonce, total, start, exports)| Owned::DiscoverReply {
                nonce,
                total,
                start,
                exports
            }),
        1 => (any::<u64>(), params(), any::<Option<[u8; 32]>>(), name(), any::<Option<[u8; 16]>>()).prop_map(
            |(nonce, params, proof, export, host)| Owned::Connect {
                nonce,
                params,
                proof,
                export,
                host
            }
        ),
        1 => data().prop_map(|(h, p)| Owned::Data(h, p)),
    ]
}

/// Builds the message `o` describes and hands it to `f`.
fn with_message<R>(o: &Owned, f: impl FnOnce(&Message<'_>) -> R) -> R {
    match o {
        Owned::Plain(m) => f(m),
        Owned::DiscoverReply { nonce, total, start, exports } => {
            let infos: Vec<ExportInfo<'_>> = exports
                .iter()
                .map(|(name, size, block_size, flags)| ExportInfo {
                    name,
                    size: *size,
                    block_size: *block_size,
                    flags: *flags,
                })
                .collect();
            f(&Message::DiscoverReply(DiscoverReply {
                nonce: *nonce,
                total: *total,
                start: *start,
                exports: ExportList::Slice(&infos),
            }))
        }
        Owned::Connect { nonce, params, proof, export, host } => {
            f(&Message::Connect(Connect { nonce: *nonce, params: *params, proof: *proof, export, host: *host }))
        }
        Owned::Data(header, payload) => f(&Message::Data(Data { header: *header, payload })),
    }
}

/// Emits `m` into a dirty buffer and returns the frame.
fn emit(m: &Message<'_>, env: &Envelope) -> Vec<u8> {
    let mut buf = vec![0xa5; m.frame_len() + 8];
    let n = m.emit(env, &mut buf);
    assert_eq!(n, m.frame_len(), "emit returned frame_len()");
    buf.truncate(n);
    buf
}

/// Parses `bytes` every way a receiver might look at them; must never panic. If the frame is
/// valid, re-emitting what was parsed must give a frame that parses to the same message.
fn poke(bytes: &[u8], ethertype: u16) {
    let Ok(frame) = Frame::new_checked(bytes, ethertype) else {
        return;
    };
    let _ = (frame.dst(), frame.src(), frame.flags(), frame.channel());
    let _ = (frame.session(), frame.seq(), frame.message().len());
    let env = Envelope::of(&frame);
    if let Ok(m) = frame.parse() {
        if let Message::DiscoverReply(r) = &m {
            assert_eq!(r.exports.iter().count(), r.exports.len(), "entry count");
        }
        let again = emit(&m, &env);
        let frame2 = Frame::new_checked(&again[..], ethertype).expect("re-emitted frame checks");
        assert_eq!(frame2.parse(), Ok(m), "re-emitted frame parses the same");
    }
}

// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// (a) Arbitrary bytes never panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4000)) {
        poke(&bytes, ET);
        // Under the EtherType the bytes happen to carry, so that parsing goes past it.
        if bytes.len() >= ETH_HEADER_LEN {
            poke(&bytes, u16::from_be_bytes([bytes[12], bytes[13]]));
        }
    }

    /// (a) Arbitrary bytes behind a valid Ethernet and common header prefix never panic.
    #[test]
    fn arbitrary_bodies_never_panic(
        kind in prop_oneof![pick(Kind::ALL).prop_map(|k| k as u8), any::<u8>()],
        flags in any::<u16>(),
        exact_len in any::<bool>(),
        len_seed in any::<u16>(),
        head in any::<[u8; 10]>(),
        body in proptest::collection::vec(any::<u8>(), 0..4000),
    ) {
        let mut b = vec![0u8; ETH_HEADER_LEN + layout::common::END];
        b[..10].copy_from_slice(&head);
        b[12..14].copy_from_slice(&ET.to_be_bytes());
        let m = ETH_HEADER_LEN;
        b[m + layout::common::VERSION] = VERSION;
        b[m + layout::common::KIND] = kind;
        b[m + 2..m + 4].copy_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&body);
        let msg_len = b.len() - ETH_HEADER_LEN;
        let len = if exact_len { msg_len as u16 } else { len_seed % (msg_len as u16 + 2) };
        b[m + 4..m + 6].copy_from_slice(&len.to_be_bytes());
        poke(&b, ET);
    }

    /// (a) Valid frames with a few bytes changed never panic (parsing gets deepest here).
    #[test]
    fn mutated_frames_never_panic(
        o in owned(),
        env in envelope(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let mut b = with_message(&o, |m| emit(m, &env));
        for (at, v) in edits {
            let i = at.index(b.len());
            b[i] = v;
        }
        if do_cut {
            let n = cut.index(b.len() + 1);
            b.truncate(n);
        }
        poke(&b, env.ethertype);
    }

    /// (b) Every valid message survives emit → parse.
    #[test]
    fn every_message_round_trips(o in owned(), env in envelope()) {
        with_message(&o, |m| {
            let bytes = emit(m, &env);
            prop_assert!(bytes.len() >= ETH_MIN_FRAME_LEN, "padded to the Ethernet minimum");
            prop_assert_eq!(bytes.len(), (ETH_HEADER_LEN + m.message_len()).max(ETH_MIN_FRAME_LEN));
            let frame = Frame::new_checked(&bytes[..], env.ethertype)
                .unwrap_or_else(|e| panic!("emitted frame rejected: {e}: {m:?}"));
            prop_assert_eq!(Envelope::of(&frame), env);
            prop_assert_eq!(frame.kind(), m.kind());
            prop_assert_eq!(frame.message().len(), m.message_len());
            let parsed = frame.parse().unwrap_or_else(|e| panic!("emitted message rejected: {e}: {m:?}"));
            prop_assert_eq!(&parsed, m);
            // Padding is zero.
            let end = ETH_HEADER_LEN + m.message_len();
            prop_assert!(bytes[end..].iter().all(|&b| b == 0), "padding is zero");
            Ok(())
        })?;
    }

    /// (b) Block status lists survive emit → parse (extents merged where flags repeat, cut at
    /// the list's capacity), and arbitrary lists never panic the parser.
    #[test]
    fn block_status_lists_round_trip(
        extents in proptest::collection::vec((1u64..=1 << 16, 0u32..4), 1..80),
        junk in proptest::collection::vec(any::<u8>(), 0..600),
        requested in any::<u32>(),
    ) {
        let extents: Vec<Extent> =
            extents.into_iter().map(|(s, f)| Extent { length: s * SECTOR_SIZE as u64, flags: f }).collect();
        let mut buf = [0xa5u8; layout::block_status::LEN];
        let covered = emit_block_status(extents.iter().copied(), &mut buf);
        let list = BlockStatusList::parse(&buf, u32::MAX).expect("an emitted list parses");
        prop_assert_eq!(list.covered(), covered);
        prop_assert!(list.len() <= layout::block_status::MAX_EXTENTS);
        // The same states, merged, as far as the list goes.
        let mut at = 0u64;
        for e in list.iter() {
            let mut off = 0u64;
            for x in &extents {
                if off + x.length > at && off < at + e.length {
                    prop_assert_eq!(x.flags, e.flags);
                }
                off += x.length;
            }
            at += e.length;
        }
        let _ = BlockStatusList::parse(&junk, requested);
    }

    /// (b) A DATA header emitted in place matches `Message::emit`.
    #[test]
    fn data_emit_in_place_matches_emit((header, payload) in data(), env in envelope()) {
        let m = Message::Data(Data { header, payload: &payload });
        let whole = emit(&m, &env);
        let mut buf = vec![0x5a; DATA_FRAME_OVERHEAD + payload.len()];
        buf[DATA_FRAME_OVERHEAD..].copy_from_slice(&payload);
        let n = header.emit_in_place(&env, payload.len(), &mut buf);
        prop_assert_eq!(n, whole.len());
        prop_assert_eq!(buf, whole);
    }

    /// (c) The segment size fits the MTU and the buffer, is a power of two of at least 512, and
    /// is the largest such.
    #[test]
    fn segment_size_fits_both_limits(mtu in 0usize..70_000, cap in 0usize..70_000) {
        let t = layout::trailer::END;
        let by_mtu = mtu.saturating_sub(layout::data::PAYLOAD + t);
        let by_cap = cap.saturating_sub(DATA_FRAME_OVERHEAD + t);
        let fits = |s: usize| s <= by_mtu && s <= by_cap
            && ETH_HEADER_LEN + layout::data::PAYLOAD + s + t <= ETH_HEADER_LEN + mtu
            && DATA_FRAME_OVERHEAD + s + t <= cap
            && layout::data::PAYLOAD + s <= u16::MAX as usize;
        match segment_size_for(mtu, cap) {
            Some(s) => {
                let s = s as usize;
                prop_assert!(s.is_power_of_two(), "{} is a power of two", s);
                prop_assert!(s >= SECTOR_SIZE as usize, "{} >= 512", s);
                prop_assert!(fits(s), "{} fits mtu {} and buffer {}", s, mtu, cap);
                prop_assert!(s <= u16::MAX as usize, "{} fits the u16 segment field", s);
                prop_assert!(!fits(2 * s), "{} is the largest for mtu {} buffer {}", s, mtu, cap);
                // The ChannelParams segment field accepts it.
                let p = ChannelParams {
                    ring: 2, remq_slots: 1, damq_slots: 1, segment: s as u16,
                    max_io: s as u32, features: 0,
                };
                prop_assert_eq!(p.validate(), Ok(()));
            }
            None => prop_assert!(!fits(SECTOR_SIZE as usize), "512 fits mtu {} buffer {}", mtu, cap),
        }
    }
}
