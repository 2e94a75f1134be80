//! A target and an initiator in one process over the in-memory transport: writes data with the
//! async API, reads it back and prints a short report. Needs no root and no network.
//!
//! ```sh
//! cargo run -p tyche-init --example loopback
//! ```

use std::time::{Duration, Instant};

use tyche_init::loopback::{initiator_timers, mem_links, RamExport};
use tyche_init::{connect, InitiatorConfig};

const MIB: u64 = 1 << 20;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    // Two in-memory links to a 64 MiB RAM export, two channels on each.
    let (links, _switches, _target) =
        mem_links(RamExport::new("demo", 64 * MIB), 2).expect("the in-process target starts");
    let mut cfg = InitiatorConfig::new("demo");
    cfg.channels_per_link = 2;
    cfg.timers = initiator_timers();
    let client = connect(cfg, links).await?;
    let info = client.info().clone();
    println!("attached export {:?}: {} MiB, session {:#x}", info.export, info.size / MIB, info.session);

    let chunk = 1 << 20;
    let total = 32 * MIB;
    let t0 = Instant::now();
    let mut writes = tokio::task::JoinSet::new();
    for i in 0..total / chunk as u64 {
        let c = client.clone();
        let data: Vec<u8> = (0..chunk).map(|b| (b as u64 ^ i.wrapping_mul(31)) as u8).collect();
        writes.spawn(async move { c.write_owned(i * chunk as u64, data, false).await });
    }
    while let Some(r) = writes.join_next().await {
        r??;
    }
    client.flush().await?;
    let wrote = t0.elapsed();

    let t1 = Instant::now();
    let mut bad = 0;
    for i in 0..total / chunk as u64 {
        let back = client.read(i * chunk as u64, chunk).await?;
        bad += back.iter().enumerate().filter(|&(b, &v)| v != (b as u64 ^ i.wrapping_mul(31)) as u8).count();
    }
    let read = t1.elapsed();
    let s = client.stats().await?;
    let rate = |d: Duration| total as f64 / MIB as f64 / d.as_secs_f64();
    println!(
        "wrote {} MiB in {wrote:.2?} ({:.0} MiB/s), read back in {read:.2?} ({:.0} MiB/s)",
        total / MIB,
        rate(wrote),
        rate(read)
    );
    println!(
        "{} channels live, {} requests, {} failed, {} retransmits, {bad} bytes differ",
        s.live_channels, s.completed, s.failed, s.retransmits
    );
    client.close().await;
    anyhow::ensure!(bad == 0, "{bad} bytes read back differ from what was written");
    println!("ok");
    Ok(())
}
