//! What a new attachment inherits about an earlier process's writes (`attach --recover`):
//! `InitiatorConfig::prior_writes` against the export's durability epoch, through the engine.

use std::time::Duration;

use tyche_channel::DurabilityDebt;
use tyche_init::loopback::{initiator_timers, mem_links, RamExport, RamTarget, Restart};
use tyche_init::{connect, Client, Error, InitiatorConfig};
use tyche_wire::{DurabilityEpoch, Status};

const MIB: u64 = 1 << 20;
const LIMIT: Duration = Duration::from_secs(30);
/// An attachment whose earlier process owed what `prior` says, given the target's epoch (the
/// in-process target derives it from its export's file, as `tyched` does); the client, the
/// target and its epoch.
async fn attach(prior: impl FnOnce(DurabilityEpoch) -> DurabilityDebt) -> (Client, RamTarget, DurabilityEpoch) {
    let (links, _sw, target) = mem_links(RamExport::new("ram", 4 * MIB), 1).expect("the in-process target starts");
    let epoch = target.durability_epoch().expect("the export's epoch");
    let mut cfg = InitiatorConfig::new("ram");
    cfg.timers = initiator_timers();
    cfg.connect_retry = Duration::from_millis(50);
    cfg.prior_writes = prior(epoch);
    let client = tokio::time::timeout(LIMIT, connect(cfg, links)).await.expect("in time").expect("connect");
    (client, target, epoch)
}

async fn flush(c: &Client) -> Result<(), Error> {
    tokio::time::timeout(LIMIT, c.flush()).await.expect("a FLUSH in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_reports_its_epoch_and_what_it_owes() {
    let (c, _t, e) = attach(|_| DurabilityDebt::Clear).await;
    let s = c.stats().await.unwrap();
    assert_eq!((s.durability_epoch, s.durability_debt), (Some(e), DurabilityDebt::Clear));
    c.write(0, &[7; 4096]).await.unwrap();
    assert_eq!(c.stats().await.unwrap().durability_debt, DurabilityDebt::AtRisk(e));
    flush(&c).await.unwrap();
    assert_eq!(c.stats().await.unwrap().durability_debt, DurabilityDebt::Clear);
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_process_writes_are_kept_under_the_same_epoch_and_owed_under_another() {
    // (what the dead process owed, given the target's epoch; whether the first FLUSH fails)
    type Owed = fn(DurabilityEpoch) -> DurabilityDebt;
    let cases: [(Owed, bool); 4] = [
        (|_| DurabilityDebt::Clear, false),
        (DurabilityDebt::AtRisk, false),
        (|_| DurabilityDebt::AtRisk(DurabilityEpoch([0x11; 16])), true),
        (|_| DurabilityDebt::Owed, true),
    ];
    for (owed, fails) in cases {
        let (c, _t, e) = attach(owed).await;
        let prior = owed(e);
        if prior == DurabilityDebt::AtRisk(e) {
            // Kept, and still not flushed: handed on as it came until a FLUSH covers it.
            assert_eq!(c.stats().await.unwrap().durability_debt, prior);
        }
        let first = flush(&c).await;
        if fails {
            assert_eq!(first, Err(Error::Target(Status::IoError)), "{prior:?}");
            flush(&c).await.unwrap_or_else(|e| panic!("{prior:?}: the second FLUSH failed too: {e}"));
        } else {
            first.unwrap_or_else(|e| panic!("{prior:?}: {e}"));
        }
        assert_eq!(c.stats().await.unwrap().durability_debt, DurabilityDebt::Clear, "{prior:?}");
        c.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_restart_that_kept_its_storage_costs_no_flush_error() {
    // The loopback target's memfd outlives its restart, as a file export's page cache outlives
    // a killed tyched: the same epoch, so the writes not flushed before the crash are there and
    // the FLUSH after it succeeds.
    let (c, t, e) = attach(|_| DurabilityDebt::Clear).await;
    let first = c.stats().await.unwrap().reconnects;
    c.write(0, &[9; 65536]).await.unwrap();
    t.restart(Restart::Crash).expect("the target restarts");
    let t0 = std::time::Instant::now();
    loop {
        // A read goes through the new session once the engine has moved to it.
        tokio::time::timeout(LIMIT, c.read(0, 4096)).await.expect("in time").expect("read");
        if c.stats().await.unwrap().reconnects > first {
            break;
        }
        assert!(t0.elapsed() < LIMIT, "the engine never moved to a new session");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(c.stats().await.unwrap().durability_debt, DurabilityDebt::AtRisk(e));
    flush(&c).await.expect("the FLUSH after a restart that lost nothing");
    assert!(t.snapshot(0, 65536).iter().all(|&b| b == 9));
    c.close().await;
}
