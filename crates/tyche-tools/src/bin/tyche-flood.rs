//! `tyche-flood`: a CONNECT flood for the flood test (`cargo xtask flood`), run in the
//! initiator namespace of a veth lab. Not a tool for anything else: it forges source MACs.
//!
//! It sends `--connects` Tyche CONNECT frames to `--target` through an AF_PACKET raw socket on
//! `--iface` (veth takes any source MAC), cycling over `--macs` locally administered source
//! MACs (`02:54:00:f1:xx:xx`), each CONNECT with a fresh random nonce and asking for the
//! largest channel the protocol allows (the target grants at most its own limits). Of every ten:
//!
//! - eight ask for a new session (session 0) on channel 0 of export `--export`;
//! - one asks for a new session on channel 65535;
//! - one names channel 65535 of a random nonzero session id (a session that does not exist).
//!
//! It sends as fast as the link takes frames (or at most `--rate` per second): a frame the kernel refuses (socket buffer full,
//! or `ENOBUFS` when veth's peer ring is full) is sent again after a short pause, so every frame
//! counted as sent reached the target's veth. It stops after `--connects` frames or `--seconds`,
//! whichever comes first, and prints one line:
//! `FLOOD sent=N new=N ch65535_new=N ch65535_unknown=N retries=N secs=S complete=true|false`.

use std::io;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use tyche_transport::SplitMix64;
use tyche_wire::{ChannelParams, Connect, Envelope, MacAddr, Message, DEFAULT_ETHERTYPE};
use tyched::packet::PacketTransport;

/// Sends a bounded flood of CONNECT frames from many source MACs (flood test only).
#[derive(Debug, Parser)]
#[command(name = "tyche-flood")]
struct Args {
    /// Interface to send on (the initiator side of a lab link).
    #[arg(long)]
    iface: String,
    /// The target's MAC on that link.
    #[arg(long)]
    target: MacAddr,
    /// An export the target has.
    #[arg(long)]
    export: String,
    /// CONNECT frames in all.
    #[arg(long, default_value_t = 100_000)]
    connects: u64,
    /// Distinct source MACs, used in turn.
    #[arg(long, default_value_t = 1000)]
    macs: u32,
    /// Frames per second at most (0: as fast as the link takes them).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Stop after this many seconds even if not every frame went out.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// EtherType.
    #[arg(long, default_value_t = DEFAULT_ETHERTYPE)]
    ethertype: u16,
    /// Seed of the nonces and session ids (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
}

/// First source MAC: `MacAddr::local(MAC_BASE + i)`, apart from the lab's own (`0x7400..`).
const MAC_BASE: u32 = 0x00f1_0000;

/// The largest channel the protocol allows; the target grants at most its own limits.
const GREEDY: ChannelParams =
    ChannelParams { ring: 4096, remq_slots: 1024, damq_slots: 1024, segment: 2048, max_io: 16 << 20, features: 0 };

fn main() -> ExitCode {
    let args = Args::parse();
    match flood(&args) {
        Ok(complete) => {
            if complete {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            }
        }
        Err(e) => {
            eprintln!("tyche-flood: {e}");
            ExitCode::FAILURE
        }
    }
}

fn flood(args: &Args) -> io::Result<bool> {
    if args.macs == 0 || args.macs > 0xffff {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "--macs must be 1..=65535"));
    }
    let port = PacketTransport::open(&args.iface, args.ethertype)?;
    let seed = args.seed.unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        t.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32)
    });
    let mut rng = SplitMix64::new(seed);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.seconds);
    let mut buf = vec![0u8; 2048];
    let (mut sent, mut new, mut ch_new, mut ch_unknown, mut retries) = (0u64, 0u64, 0u64, 0u64, 0u64);
    'frames: for i in 0..args.connects {
        if args.rate > 0 && i % 64 == 0 {
            let due = start + Duration::from_secs_f64(i as f64 / args.rate as f64);
            let now = Instant::now();
            if due >= deadline {
                break;
            }
            if due > now {
                std::thread::sleep(due - now);
            }
        }
        let src = MacAddr::local(MAC_BASE + (i % u64::from(args.macs)) as u32);
        let (channel, session) = match i % 10 {
            8 => (u16::MAX, 0),
            9 => (u16::MAX, rng.next_u64() | 1),
            _ => (0, 0),
        };
        let env = Envelope { dst: args.target, src, ethertype: args.ethertype, channel, session };
        let connect = Connect { nonce: rng.next_u64(), params: GREEDY, proof: None, export: &args.export, host: None };
        let len = Message::Connect(connect).emit(&env, &mut buf);
        loop {
            match port.send_frame(&buf[..len]) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.raw_os_error() == Some(libc::ENOBUFS) => {
                    retries += 1;
                    if Instant::now() >= deadline {
                        break 'frames;
                    }
                    std::thread::sleep(Duration::from_micros(20));
                }
                Err(e) => return Err(e),
            }
        }
        sent += 1;
        match (channel, session) {
            (0, _) => new += 1,
            (_, 0) => ch_new += 1,
            _ => ch_unknown += 1,
        }
        if sent % 1024 == 0 && Instant::now() >= deadline {
            break;
        }
    }
    let complete = sent == args.connects;
    println!(
        "FLOOD sent={sent} new={new} ch65535_new={ch_new} ch65535_unknown={ch_unknown} retries={retries} secs={:.3} \
         complete={complete}",
        start.elapsed().as_secs_f64()
    );
    Ok(complete)
}
