//! The initiator library end to end: `tyche_init::Client` → engine thread → in-memory links →
//! the in-process RAM target and back, two links, one channel each. Measures what a front end
//! (NBD, ublk) sees per request: 4 KiB reads at queue depth 1 (latency), and 64 KiB reads and
//! writes at queue depth 32 (throughput).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tokio::runtime::Runtime;
use tyche_init::loopback::{initiator_timers, mem_links, RamExport, RamTarget};
use tyche_init::{connect, Client, InitiatorConfig};

const MIB: u64 = 1 << 20;

fn setup(rt: &Runtime) -> (Client, RamTarget) {
    let (links, _switches, target) =
        mem_links(RamExport::new("bench", 256 * MIB), 2).expect("the in-process target starts");
    let mut cfg = InitiatorConfig::new("bench");
    cfg.timers = initiator_timers();
    let client = rt.block_on(connect(cfg, links)).expect("connect");
    (client, target)
}

fn initiator(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (client, _target) = setup(&rt);
    let mut g = c.benchmark_group("initiator");
    g.measurement_time(Duration::from_secs(5));

    g.throughput(Throughput::Bytes(4096));
    g.bench_function("read_4k_qd1", |b| {
        let mut at = 0u64;
        b.iter(|| {
            at = (at + 4096) % (256 * MIB);
            rt.block_on(client.read(at, 4096)).expect("read")
        })
    });

    for (name, write) in [("read_64k_qd32", false), ("write_64k_qd32", true)] {
        g.throughput(Throughput::Bytes(32 * 65536));
        g.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(async {
                    let mut set = tokio::task::JoinSet::new();
                    for i in 0..32u64 {
                        let c = client.clone();
                        set.spawn(async move {
                            if write {
                                c.write_owned(i * 65536, vec![i as u8; 65536], false).await.map(drop)
                            } else {
                                c.read(i * 65536, 65536).await.map(drop)
                            }
                        });
                    }
                    while let Some(r) = set.join_next().await {
                        r.expect("task").expect("request");
                    }
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, initiator);
criterion_main!(benches);
