//! Storage workers per NUMA node, on the paper's two-socket server (an hwloc XML fixture): a
//! channel's storage jobs run on its NIC's node, with io_uring and with the worker threads.
//!
//! The fixture's CPUs (8-15 on node 1) need not exist here: pinning to them fails with a
//! warning, and the routing, which is what is checked, does not depend on it.

mod common;

use std::path::Path;

use common::{init_mac, pattern, target_mac, Initiator, Port};
use tyche_numa::placement::{plan, PlacementRequest};
use tyche_transport::MemLink;
use tyched::config::{Config, ExportConfig};
use tyched::workers::StoragePlan;
use tyched::{Nic, Placement, Snapshot, Target, TargetHandle};

/// A target on NICs `ens1f0` (node 0) and `ens3f0` (node 1) of the fixture, with the plan's
/// storage workers; returns the initiator's port of the node-1 NIC only.
fn start(config: Config) -> (TargetHandle, Port, StoragePlan) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tyche-numa/fixtures/paper-2s4c2t-6nic.xml");
    let topo = tyche_numa::Topology::from_xml_file(&path).expect("fixture");
    let names = vec!["ens1f0".to_string(), "ens3f0".to_string()];
    let req = PlacementRequest::channels_per_nic(&topo, &names, 1).expect("known NICs");
    let storage = StoragePlan::from_plan(&topo, &plan(&topo, &req), &names);
    // The initiator's path 0 goes to the node-1 NIC.
    let (a0, b0) = MemLink::pair((init_mac(1), target_mac(1)), 9000, 9014, 8192);
    let (a1, b1) = MemLink::pair((init_mac(0), target_mac(0)), 9000, 9014, 8192);
    drop(a0);
    let nics = vec![
        Nic { name: "ens1f0".into(), transport: Box::new(b0) },
        Nic { name: "ens3f0".into(), transport: Box::new(b1) },
    ];
    let placement = Placement { storage: Some(storage.clone()), ..Placement::default() };
    let t = Target::start_placed(config, nics, placement).expect("target starts");
    (t, Box::new(a1), storage)
}

fn jobs_on(s: &Snapshot, node: u32) -> u64 {
    s.storage_queues.iter().filter(|q| q.node == Some(node)).map(|q| q.jobs).sum()
}

fn a_channels_jobs_run_on_its_nics_node(io_uring: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let config =
        Config { exports: vec![ExportConfig::file("file", &file, Some(8 << 20))], io_uring, ..Config::default() };
    let (target, port, storage) = start(config);
    assert_eq!(storage.nic_queue, vec![0, 1]);
    let mut ini = Initiator::new(vec![port]);
    ini.attach("file", None).expect("attach over the node-1 NIC");
    let mut written = Vec::new();
    for k in 0..16u64 {
        let data = pattern(k * 65536, 65536, k as u8);
        ini.write(k * 65536, &data);
        written.push(data);
    }
    for (k, data) in written.iter().enumerate() {
        assert_eq!(&ini.read(k as u64 * 65536, data.len()), data, "read back {k}");
    }
    let s = target.stats();
    let engine = if io_uring { "io_uring" } else { "worker" };
    assert_eq!(s.exports[0].io, if io_uring { "io_uring" } else { "threads" });
    assert_eq!(s.storage_queues.len(), 2, "{:?}", s.storage_queues);
    assert_eq!(s.storage_queues[1].nics, vec!["ens3f0".to_string()]);
    assert_eq!(jobs_on(&s, 1), 32, "every job of the node-1 channel on node 1: {:?}", s.storage_queues);
    assert_eq!(jobs_on(&s, 0), 0, "none on node 0: {:?}", s.storage_threads);
    // The threads that ran them are node 1's, as planned: workers on CPUs 8, 10 and 12, the ring
    // on 8.
    for t in s.storage_threads.iter().filter(|t| t.jobs > 0) {
        assert_eq!((t.node, t.kind.as_str()), (Some(1), engine), "{t:?}");
        assert!(t.planned_cpus.iter().all(|c| [8, 10, 12].contains(c)), "{t:?}");
    }
    let workers = |n: u32| s.storage_threads.iter().filter(|t| t.kind == "worker" && t.node == Some(n)).count();
    assert_eq!((workers(0), workers(1)), (3, 3), "one worker per planned completion worker");
    let rings = s.storage_threads.iter().filter(|t| t.kind == "io_uring").count();
    assert_eq!(rings, if io_uring { 2 } else { 0 }, "one ring per node");
    let prom = s.prometheus();
    assert!(prom.contains("tyched_storage_jobs_total{thread="), "{prom}");
    assert!(s.human().contains("Storage (a queue per node"), "{}", s.human());
    drop(ini);
    let end = target.shutdown();
    assert_eq!(end.storage_inflight, 0);
}

#[test]
fn a_channels_jobs_run_on_its_nics_node_with_io_uring() {
    a_channels_jobs_run_on_its_nics_node(true);
}

#[test]
fn a_channels_jobs_run_on_its_nics_node_with_workers() {
    a_channels_jobs_run_on_its_nics_node(false);
}

/// `workers = N` keeps the pool: one queue, N unpinned workers, whatever the plan.
#[test]
fn workers_given_keep_the_pool() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("disk.img");
    let config = Config {
        exports: vec![ExportConfig::file("file", &file, Some(1 << 20))],
        io_uring: false,
        workers: 3,
        ..Config::default()
    };
    let (target, port, _) = start(config);
    let mut ini = Initiator::new(vec![port]);
    ini.attach("file", None).expect("attach");
    ini.write(0, &pattern(0, 4096, 1));
    let s = target.stats();
    assert_eq!(s.storage_queues.len(), 1, "{:?}", s.storage_queues);
    assert_eq!(s.storage_queues[0].node, None);
    assert_eq!(s.storage_queues[0].workers, 3);
    assert_eq!(s.storage_queues[0].jobs, 1);
    assert!(s.storage_threads.iter().all(|t| t.planned_cpus.is_empty()));
}
