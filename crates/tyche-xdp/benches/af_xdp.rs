//! Criterion bench: batches of raw Tyche DATA frames through AF_XDP over a veth pair, one way.
//!
//! One thread opens a port in each of two throw-away network namespaces (a socket keeps the
//! namespace it was created in), then times "write 64 frames in place, transmit, receive and
//! parse all 64 on the other side". Needs root; prints why and does nothing otherwise.
//! `cargo xtask bench xdp` gives the end-to-end figure next to iperf3.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tyche_transport::FrameTransport;
use tyche_transport::FrameTransportExt;
use tyche_wire::{DataHeader, Envelope, Frame, Seq, DATA_FRAME_OVERHEAD};
use tyche_xdp::{PortConfig, XdpPort};

const BATCH: usize = 64;

struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn ip(args: &[&str]) {
    let ok = Command::new("ip").args(args).status().map(|s| s.success());
    assert!(matches!(ok, Ok(true)), "ip {}", args.join(" "));
}

fn enter(ns: &str) {
    let f = File::open(format!("/run/netns/{ns}")).expect("open netns");
    // SAFETY: `f` is an open network namespace descriptor; setns only affects this thread.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {ns}");
}

fn bench(c: &mut Criterion) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("af_xdp bench skipped: needs root for network namespaces and XDP");
        return;
    }
    let id = std::process::id();
    let (a, b) = (format!("tyb-a-{id}"), format!("tyb-b-{id}"));
    let _guard = Netns(vec![a.clone(), b.clone()]);
    ip(&["netns", "add", &a]);
    ip(&["netns", "add", &b]);
    ip(&["link", "add", "tya", "netns", &a, "type", "veth", "peer", "name", "tyb", "netns", &b]);
    for (ns, dev) in [(&a, "tya"), (&b, "tyb")] {
        ip(&["-n", ns, "link", "set", dev, "mtu", "3000", "up"]);
    }
    let original = File::open("/proc/self/ns/net").expect("own netns");
    enter(&a);
    let mut tx = XdpPort::open("tya", &PortConfig::default()).expect("port a");
    enter(&b);
    let mut rx = XdpPort::open("tyb", &PortConfig::default()).expect("port b");
    let segment = tx.plan().segment_size as usize;
    let env = Envelope {
        dst: rx.capabilities().local_mac,
        src: tx.capabilities().local_mac,
        ethertype: tyche_wire::DEFAULT_ETHERTYPE,
        channel: 0,
        session: 1,
    };
    let frame_len = segment + DATA_FRAME_OVERHEAD;
    let mut g = c.benchmark_group("af_xdp_veth");
    g.throughput(Throughput::Bytes((BATCH * frame_len) as u64));
    let mut seq = 0u32;
    g.bench_function(format!("{BATCH}x{frame_len}B one way"), |bench| {
        bench.iter_custom(|iters| {
            let t0 = Instant::now();
            for _ in 0..iters {
                let mut queued = 0;
                let mut got = 0;
                let deadline = Instant::now() + Duration::from_secs(5);
                while got < BATCH {
                    assert!(Instant::now() < deadline, "frames lost on the veth");
                    if queued < BATCH {
                        queued += tx
                            .send(BATCH - queued, &mut |buf| {
                                seq = seq.wrapping_add(1);
                                let h = DataHeader {
                                    seq: Seq { seq, ack: 0 },
                                    damq: 0,
                                    seg_index: 0,
                                    seg_count: 1,
                                    tag: u64::from(seq),
                                    offset: 0,
                                };
                                Some(h.emit_in_place(&env, segment, buf))
                            })
                            .expect("send");
                        tx.flush().expect("flush");
                    }
                    got += rx
                        .recv(BATCH, &mut |buf| {
                            let f = Frame::new_checked(buf, tyche_wire::DEFAULT_ETHERTYPE).expect("Tyche frame");
                            assert!(f.seq().is_some());
                        })
                        .expect("recv");
                }
            }
            t0.elapsed()
        })
    });
    g.finish();
    // Detach each program from inside its own namespace (interface indexes are per namespace).
    drop(rx);
    enter(&a);
    drop(tx);
    // SAFETY: `original` is this process's initial network namespace descriptor.
    let rc = unsafe { libc::setns(original.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "back to the original namespace");
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
