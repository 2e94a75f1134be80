//! BLOCK_STATUS through a volume and a target session: the list comes back into the request's
//! buffer like read data, only on channels granted the feature, and never runs "at most once".

mod util;

use tyche_channel::{IoError, IoRequest};
use tyche_wire::flags::FEATURE_BLOCK_STATUS;
use tyche_wire::{layout, BlockStatusList, Extent, Op, Status};
use util::{Pair, PairConfig};

fn pair(features: u32) -> Pair {
    let mut cfg = PairConfig::default();
    cfg.params.features = features;
    Pair::with(cfg)
}

fn block_status(p: &mut Pair, id: u64, offset: u64, length: u64) {
    p.bufs.insert(id, vec![0xEE; layout::block_status::LEN]);
    let req = IoRequest { id, op: Op::BlockStatus, fua: false, offset, length, node: None };
    p.volume.submit(p.now, req).unwrap_or_else(|e| panic!("block status {id} refused: {e:?}"));
    p.collect();
}

#[test]
fn block_status_returns_the_targets_list() {
    let mut p = pair(FEATURE_BLOCK_STATUS);
    p.write(1, 4096, &[7u8; 1024]);
    p.drive();
    p.expect_ok(1);
    // 64 KiB from 2048: 2 KiB of zeroes, 1 KiB of data, the rest zeroes.
    block_status(&mut p, 2, 2048, 64 << 10);
    p.drive();
    p.expect_ok(2);
    let list = BlockStatusList::parse(&p.bufs[&2], 64 << 10).expect("a valid list");
    let got: Vec<Extent> = list.iter().collect();
    assert_eq!(
        got,
        [
            Extent { length: 2048, flags: 3 },
            Extent { length: 1024, flags: 0 },
            Extent { length: (64 << 10) - 3072, flags: 3 },
        ]
    );
    // Not recorded for at-most-once: asking again runs again.
    block_status(&mut p, 3, 2048, 64 << 10);
    p.drive();
    p.expect_ok(3);
    assert_eq!(p.executed.iter().filter(|(_, r)| r.op == Op::BlockStatus).count(), 2);
}

#[test]
fn block_status_spans_more_than_max_io_in_one_request() {
    let mut p = pair(FEATURE_BLOCK_STATUS);
    let size = p.cfg.export_size;
    block_status(&mut p, 1, 0, size);
    p.drive();
    p.expect_ok(1);
    let asked: Vec<_> = p.executed.iter().filter(|(_, r)| r.op == Op::BlockStatus).collect();
    assert_eq!(asked.len(), 1, "one request, not parts of max_io");
    assert_eq!(asked[0].1.length as u64, size);
    let list = BlockStatusList::parse(&p.bufs[&1], size as u32).expect("valid");
    assert_eq!(list.iter().collect::<Vec<_>>(), [Extent { length: size, flags: 3 }]);
}

#[test]
fn without_the_feature_block_status_is_unsupported_and_never_sent() {
    let mut p = pair(0);
    block_status(&mut p, 1, 0, 4096);
    p.drive();
    assert_eq!(p.result(1), Some(Err(IoError::Target(Status::Unsupported))));
    assert!(p.sent.iter().all(|f| !matches!(f.msg(), tyche_wire::Message::Request(r) if r.op == Op::BlockStatus)));
}
