//! Random loss, duplication and reordering over a small write-then-read workload: everything
//! completes with the right data, or (if the schedule kills the channel) ends with an error;
//! never a hang, never wrong data.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proptest::prelude::*;
use tyche_wire::ChannelParams;
use util::{pattern, Fate, Pair, PairConfig};

fn fate(action: u8) -> Fate {
    match action % 10 {
        0..=5 => Fate::Deliver,
        6 => Fate::Drop,
        7 => Fate::Duplicate,
        8 => Fate::Delay(Duration::from_micros(300)),
        _ => Fate::Delay(Duration::from_micros(30)),
    }
}

fn run(actions: Vec<u8>, cfg: PairConfig) {
    let mut pair = Pair::with(cfg);
    let actions = Rc::new(RefCell::new(actions.into_iter()));
    let a = actions.clone();
    pair.fault = Box::new(move |_| a.borrow_mut().next().map_or(Fate::Deliver, fate));
    let seg = pair.cfg.params.segment as usize;
    let writes = [(1u64, 0u64, 512usize), (2, 65536, 3 * seg + 512), (3, 131072, 4 * seg)];
    for &(id, offset, len) in &writes {
        pair.write(id, offset, &pattern(id, len));
    }
    pair.drive_until("every write ends", |p| p.completed.len() == writes.len());
    for &(id, offset, len) in &writes {
        pair.read(id + 10, offset, len as u64);
    }
    pair.drive_until("every read ends", |p| p.completed.len() == 2 * writes.len());
    assert!(pair.sent.len() >= 16, "the workload sent only {} frames", pair.sent.len());
    for &(id, offset, len) in &writes {
        let data = pattern(id, len);
        let w = pair.result(id).unwrap();
        let r = pair.result(id + 10).unwrap();
        if w.is_ok() {
            assert!(pair.storage[offset as usize..offset as usize + len] == data[..], "write {id} not stored");
            if r.is_ok() {
                assert!(pair.bufs[&(id + 10)] == data, "read {id} returned wrong data");
            }
        }
        if w.is_err() || r.is_err() {
            assert!(!pair.volume_dead.is_empty(), "request failed with every channel alive: {w:?} {r:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_faults_one_path(actions in proptest::collection::vec(any::<u8>(), 0..160)) {
        run(actions, PairConfig::default());
    }

    #[test]
    fn random_faults_two_paths(actions in proptest::collection::vec(any::<u8>(), 0..160)) {
        run(actions, PairConfig { paths: 2, ..PairConfig::default() });
    }

    #[test]
    fn random_faults_tiny_ring(actions in proptest::collection::vec(any::<u8>(), 0..160)) {
        // A ring of 2 (below ack_every), 512-byte segments, two slots: credit and delayed acks
        // interact on every frame.
        let params = ChannelParams { ring: 2, remq_slots: 2, damq_slots: 2, segment: 512, max_io: 4096, features: 0 };
        run(actions, PairConfig { params, ..PairConfig::default() });
    }
}
