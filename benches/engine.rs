//! Channel engine cost: a pair of engines (initiator `Volume`, target `TargetSession`) moving
//! 4 KiB writes over the in-memory transport, one thread, payloads copied in and out as a real
//! driver does. Throughput is in frames (both directions, acks included), so the time per
//! element is the engine's cost per frame. Goal: under 250 ns per frame.
//!
//! The same pair on a keyed export's channels (every frame sealed with AES-256-GCM and checked,
//! `auth`) and an encrypted one (`encrypt`): the cost of authentication per frame, side by side.
//!
//! Also: wire encode/decode of the hot-path messages, and the primitives a keyed export could
//! seal with, over a 64-byte control frame and a 2 KiB data segment (`seal`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use tyche::channel::auth::Sealer;
use tyche::channel::{
    Channel, ExportGeometry, Inbound, Instant, IoRequest, LeastBytes, Role, TargetEvent, TargetInbound, TargetSession,
    Timers, Volume, VolumeConfig,
};
use tyche::transport::{MemLink, MemPort};
use tyche::wire::{
    ChannelParams, DataHeader, Envelope, Frame, MacAddr, Message, Op, Request, Seq, Status, DATA_FRAME_OVERHEAD,
    DEFAULT_ETHERTYPE,
};
use tyche_transport::FrameTransportExt;

const BLOCK: usize = 4096;
const DEPTH: u64 = 64;
const SESSION: u64 = 0x7ec4e;

struct Pair {
    now: Instant,
    volume: Volume,
    target: TargetSession,
    ip: MemPort,
    tp: MemPort,
    write_buf: Vec<u8>,
    damq: Vec<Vec<u8>>,
    frames: u64,
    next_id: u64,
    scratch: Vec<u8>,
}

/// How the pair's channels protect their frames.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Plain,
    Auth,
    Encrypt,
}

impl Pair {
    fn new(mode: Mode) -> Pair {
        let (im, tm) = (MacAddr::local(1), MacAddr::local(2));
        let (ip, tp) = MemLink::pair((im, tm), 3000, 3840, 4096);
        let params =
            ChannelParams { ring: 1024, remq_slots: 128, damq_slots: 128, segment: 2048, max_io: 1 << 20, features: 0 };
        let now = Instant(1);
        let timers = Timers::default();
        let ienv = Envelope { dst: tm, src: im, ethertype: DEFAULT_ETHERTYPE, channel: 0, session: SESSION };
        let tenv = Envelope { dst: im, src: tm, ..ienv };
        let cfg = VolumeConfig {
            export_size: 1 << 30,
            read_only: false,
            no_path_timeout: Duration::from_secs(1),
            io_timeout: None,
            max_requests: 256,
        };
        let seal = |ch: Channel, role| match mode {
            Mode::Plain => ch,
            Mode::Auth | Mode::Encrypt => {
                // Both ends derive the same keys from the key and the target's proof.
                let sealer =
                    Sealer::derive(b"a key of at least sixteen bytes", &[7; 32], role, matches!(mode, Mode::Encrypt));
                ch.with_sealer(sealer)
            }
        };
        let mut volume = Volume::new(cfg, SESSION, DEFAULT_ETHERTYPE, Box::<LeastBytes>::default(), now);
        volume.add_channel(seal(Channel::new(Role::Initiator, ienv, params, timers, now), Role::Initiator), None, now);
        let geometry = ExportGeometry { size: 1 << 30, read_only: false, discard: true };
        let mut target = TargetSession::new(SESSION, DEFAULT_ETHERTYPE, geometry);
        target.add_channel(seal(Channel::new(Role::Target, tenv, params, timers, now), Role::Target));
        Pair {
            now,
            volume,
            target,
            ip,
            tp,
            write_buf: vec![0xa5; BLOCK],
            damq: vec![vec![0; 1 << 20]; 128],
            frames: 0,
            next_id: 0,
            scratch: Vec::new(),
        }
    }

    /// Submits `DEPTH` 4 KiB writes and runs both engines until every one completes.
    fn batch(&mut self) {
        for _ in 0..DEPTH {
            self.next_id += 1;
            let req = IoRequest {
                id: self.next_id,
                op: Op::Write,
                fua: false,
                offset: (self.next_id % 1000) * BLOCK as u64,
                length: BLOCK as u64,
                node: None,
            };
            self.volume.submit(self.now, req).expect("submit");
        }
        let mut done = 0;
        while done < DEPTH {
            self.now = Instant(self.now.0 + 100);
            // Initiator transmits.
            let (vol, buf) = (&mut self.volume, &self.write_buf);
            let now = self.now;
            self.frames += self
                .ip
                .send(usize::MAX, &mut |frame| {
                    let out = vol.poll_transmit(now, 0, frame)?;
                    if let Some((_, off, len)) = out.payload {
                        let (off, len) = (off as usize, len as usize);
                        frame[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + len].copy_from_slice(&buf[off..off + len]);
                    }
                    Some(vol.seal(0, frame, out.len))
                })
                .expect("send") as u64;
            // Target receives, executes, transmits.
            let (target, damq, scratch) = (&mut self.target, &mut self.damq, &mut self.scratch);
            self.tp
                .recv(usize::MAX, &mut |frame| {
                    if let TargetInbound::Write { damq: d, offset, payload, .. } =
                        target.handle_frame(now, frame, scratch)
                    {
                        damq[d as usize][offset as usize..offset as usize + payload.len()].copy_from_slice(payload);
                    }
                })
                .expect("recv");
            while let Some(ev) = self.target.poll_event() {
                if let TargetEvent::Execute { channel, request, .. } = ev {
                    self.target.complete(channel, &request, Status::Ok);
                }
            }
            let target = &mut self.target;
            self.frames += self
                .tp
                .send(usize::MAX, &mut |frame| {
                    let len = target.poll_transmit(now, 0, frame)?.len;
                    Some(target.seal(0, frame, len))
                })
                .expect("send") as u64;
            // Initiator receives.
            let (vol, scratch) = (&mut self.volume, &mut self.scratch);
            self.ip
                .recv(usize::MAX, &mut |frame| {
                    if let Inbound::Dropped(d) = vol.handle_frame(now, frame, scratch) {
                        panic!("frame dropped on a clean link: {d:?}");
                    }
                })
                .expect("recv");
            while self.volume.poll_event().is_some() {
                done += 1;
            }
            if self.volume.poll_timeout().is_some_and(|t| t <= self.now) {
                self.volume.handle_timeout(self.now);
            }
            if self.target.poll_timeout().is_some_and(|t| t <= self.now) {
                self.target.handle_timeout(self.now);
            }
        }
    }
}

fn engine_pair(c: &mut Criterion) {
    // Frames per batch are deterministic on a clean link: count them once.
    let mut probe = Pair::new(Mode::Plain);
    probe.batch();
    let per_batch = probe.frames;
    let mut g = c.benchmark_group("engine_pair");
    g.throughput(Throughput::Elements(per_batch));
    for (name, mode) in [("4k_writes_qd64_frames", Mode::Plain), ("auth", Mode::Auth), ("encrypt", Mode::Encrypt)] {
        g.bench_function(name, |b| {
            let mut pair = Pair::new(mode);
            b.iter(|| pair.batch());
        });
    }
    g.finish();
}

/// The candidates for sealing a frame, on a 64-byte control frame and a 2 KiB segment:
/// AES-256-GCM and ChaCha20-Poly1305, from ring and from aws-lc-rs, authenticating the frame as
/// additional data or encrypting it, and HMAC-SHA256 (the hmac and sha2 crates, SHA-NI where
/// the CPU has it).
fn seal(c: &mut Criterion) {
    let mut g = c.benchmark_group("seal");
    for size in [64usize, 2048 + 62] {
        let mut frame = vec![0x5au8; size];
        g.throughput(Throughput::Bytes(size as u64));
        macro_rules! aead {
            ($lib:literal, $m:ident) => {{
                use $m::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};
                for (name, alg) in [("aes256gcm", &AES_256_GCM), ("chacha20poly1305", &CHACHA20_POLY1305)] {
                    let key = LessSafeKey::new(UnboundKey::new(alg, &[9; 32]).expect("key"));
                    let mut n = 0u64;
                    let mut nonce = move || {
                        n += 1;
                        let mut b = [0u8; 12];
                        b[4..].copy_from_slice(&n.to_be_bytes());
                        Nonce::assume_unique_for_key(b)
                    };
                    g.bench_function(format!("{}_{name}_auth_{size}", $lib), |b| {
                        b.iter(|| {
                            key.seal_in_place_separate_tag(nonce(), Aad::from(black_box(&frame[..])), &mut []).unwrap()
                        })
                    });
                    g.bench_function(format!("{}_{name}_encrypt_{size}", $lib), |b| {
                        b.iter(|| {
                            let (h, rest) = frame.split_at_mut(30);
                            key.seal_in_place_separate_tag(nonce(), Aad::from(&*h), black_box(rest)).unwrap()
                        })
                    });
                }
            }};
        }
        aead!("ring", ring);
        aead!("awslc", aws_lc_rs);
        g.bench_function(format!("hmac_sha256_{size}"), |b| {
            use hmac::Mac;
            b.iter(|| {
                let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(&[9; 32]).unwrap();
                m.update(black_box(&frame[..]));
                m.finalize().into_bytes()
            })
        });
    }
    g.finish();
}

fn wire(c: &mut Criterion) {
    let env = Envelope {
        dst: MacAddr::local(1),
        src: MacAddr::local(2),
        ethertype: DEFAULT_ETHERTYPE,
        channel: 3,
        session: 42,
    };
    let req = Request {
        seq: Seq { seq: 7, ack: 9 },
        op: Op::Write,
        fua: false,
        remq: 1,
        damq: 2,
        home: 3,
        tag: 99,
        floor: 90,
        offset: 4096,
        length: 4096,
    };
    let mut frame = vec![0u8; 3840];
    let mut g = c.benchmark_group("wire");
    g.throughput(Throughput::Elements(1));
    g.bench_function("emit_request", |b| b.iter(|| Message::Request(black_box(req)).emit(&env, &mut frame)));
    let len = Message::Request(req).emit(&env, &mut frame);
    let bytes = frame[..len].to_vec();
    g.bench_function("parse_request", |b| {
        b.iter(|| Frame::new_checked(black_box(&bytes[..]), DEFAULT_ETHERTYPE).unwrap().parse().unwrap().kind())
    });
    let h = DataHeader { seq: Seq { seq: 1, ack: 2 }, damq: 3, seg_index: 1, seg_count: 2, tag: 99, offset: 2048 };
    g.bench_function("emit_data_header_in_place", |b| b.iter(|| black_box(h).emit_in_place(&env, 2048, &mut frame)));
    let len = h.emit_in_place(&env, 2048, &mut frame);
    let data = frame[..len].to_vec();
    g.bench_function("parse_data_2k", |b| {
        b.iter_batched(
            || (),
            |()| Frame::new_checked(black_box(&data[..]), DEFAULT_ETHERTYPE).unwrap().parse().unwrap().kind(),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = engine_pair, wire, seal
}
criterion_main!(benches);
