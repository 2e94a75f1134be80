//! What a volume tells its scheduler: payload bytes moved, not the range a request covers.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tyche_channel::{Channel, ChannelView, Instant, IoRequest, Role, Scheduler, Timers, Volume, VolumeConfig};
use tyche_wire::{ChannelParams, Envelope, MacAddr, Op, DEFAULT_ETHERTYPE};

#[derive(Debug, Default)]
struct Recorder(Arc<Mutex<Vec<u64>>>);

impl Scheduler for Recorder {
    fn pick(&mut self, bytes: u64, _node: Option<u32>, channels: &[ChannelView]) -> Option<usize> {
        self.0.lock().unwrap().push(bytes);
        channels.iter().position(|c| c.live && c.has_room)
    }
}

#[test]
fn discard_and_write_zeroes_charge_no_bytes() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let now = Instant(1);
    let cfg = VolumeConfig {
        export_size: 1 << 30,
        read_only: false,
        no_path_timeout: Duration::from_secs(1),
        io_timeout: None,
        max_requests: 16,
    };
    let mut v = Volume::new(cfg, 7, DEFAULT_ETHERTYPE, Box::new(Recorder(Arc::clone(&seen))), now);
    let env = Envelope {
        dst: MacAddr::local(2),
        src: MacAddr::local(1),
        ethertype: DEFAULT_ETHERTYPE,
        channel: 0,
        session: 7,
    };
    let params =
        ChannelParams { ring: 256, remq_slots: 32, damq_slots: 32, segment: 1024, max_io: 1 << 20, features: 0 };
    v.add_channel(Channel::new(Role::Initiator, env, params, Timers::default(), now), None, now);
    let req = |id, op, length| IoRequest { id, op, fua: false, offset: 0, length, node: None };
    v.submit(now, req(1, Op::Discard, 1 << 30)).unwrap();
    v.submit(now, req(2, Op::WriteZeroes, 1 << 20)).unwrap();
    v.submit(now, req(3, Op::Flush, 0)).unwrap();
    v.submit(now, req(4, Op::Write, 4096)).unwrap();
    v.submit(now, req(5, Op::Read, 8192)).unwrap();
    assert_eq!(*seen.lock().unwrap(), [0, 0, 0, 4096, 8192]);
}
