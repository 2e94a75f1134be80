//! The initiator's volume in parts, as tyche-init's engine threads hold it: a
//! [`VolumeParts`] whose parts ([`tyche_channel::Volume::part`]) own the channels of some paths
//! (path `k` goes to part `k % parts`) and the requests submitted to them, allocate tags from
//! their own residue classes and share the floor and the durability state through a board. Each
//! part reads the others' floors on its own timer, late by a seeded 0.2 to 3 ms (a thread that
//! was busy or asleep), so the REQUESTs carry floors that lag as they would between threads. A
//! part left without a live channel hands its queued requests to the next part that has one, and
//! the adopter reports each back, both with the seeded delays of the target's part messages (in
//! order between any two parts), as over the bounded queues between engine threads. With one
//! part it is exactly a [`tyche_channel::Volume`].

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tyche_channel::{
    Channel, DurabilityDebt, HandCourier, HandMessage, Inbound, Instant, IoRequest, LeastBytes, OutFrame, SubmitError,
    VolumeConfig, VolumeEvent, VolumeParts,
};
use tyche_transport::SplitMix64;
use tyche_wire::Frame;

/// Hand-offs and hand-backs on their way, with seeded delays.
#[derive(Debug)]
pub(crate) struct HandDelays {
    /// By (due time, order sent): (to which part, the message).
    in_flight: BTreeMap<(Instant, u64), (usize, HandMessage)>,
    /// Due time of the last message from one part to another: later ones are not due earlier.
    last_due: HashMap<(usize, usize), Instant>,
    sent: u64,
    rng: SplitMix64,
}

impl HandCourier for HandDelays {
    fn post(&mut self, now: Instant, from: usize, to: usize, msg: HandMessage) {
        let due = crate::session_parts::due(&mut self.rng, &mut self.last_due, now, from, to);
        self.sent += 1;
        self.in_flight.insert((due, self.sent), (to, msg));
    }
}

/// A volume in parts (see the module docs).
#[derive(Debug)]
pub(crate) struct PartedVolume {
    parts: VolumeParts<HandDelays>,
    /// The part holding each channel index.
    part_of: HashMap<u16, usize>,
    /// When each part next reads the board.
    refresh: Vec<Instant>,
    ethertype: u16,
    rng: SplitMix64,
}

impl PartedVolume {
    /// A volume of `parts` parts on `session`, the delays drawn from `seed`.
    pub(crate) fn new(
        config: VolumeConfig,
        session: u64,
        ethertype: u16,
        now: Instant,
        parts: usize,
        seed: u64,
    ) -> Self {
        let courier = HandDelays {
            in_flight: BTreeMap::new(),
            last_due: HashMap::new(),
            sent: 0,
            rng: SplitMix64::new(seed ^ session.rotate_left(23) ^ 0x4841_4e44),
        };
        let parts = VolumeParts::new(config, session, ethertype, now, parts, || Box::<LeastBytes>::default(), courier);
        let refresh = vec![now; parts.parts().len()];
        PartedVolume {
            parts,
            part_of: HashMap::new(),
            refresh,
            ethertype,
            rng: SplitMix64::new(seed ^ session.rotate_left(29) ^ 0x5041_5254),
        }
    }

    /// The parts.
    pub(crate) fn parts(&self) -> &VolumeParts<HandDelays> {
        &self.parts
    }

    /// Adds a channel opened on `path` to that path's part.
    pub(crate) fn add_channel(&mut self, path: usize, channel: Channel, now: Instant) {
        let p = path % self.refresh.len();
        self.part_of.insert(channel.envelope().channel, p);
        self.parts.part(p).add_channel(channel, None, now);
        self.parts.exchange(now);
    }

    /// Submits to part `id % parts`, or to the next part after it with a live channel while
    /// that one has none (the application's threads on a node whose paths are down hand their
    /// requests to another node's engine).
    pub(crate) fn submit(&mut self, now: Instant, req: IoRequest) -> Result<(), SubmitError> {
        let p = self.parts.submit_part((req.id % self.refresh.len() as u64) as usize);
        let r = self.parts.part(p).submit(now, req);
        self.parts.exchange(now);
        r
    }

    /// A frame from the target, to the part holding its channel.
    pub(crate) fn handle_frame<'a>(&mut self, now: Instant, bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> Inbound<'a> {
        let p = Frame::new_checked(bytes, self.ethertype)
            .map_or(0, |f| self.part_of.get(&f.channel()).copied().unwrap_or(0));
        let out = self.parts.part(p).handle_frame(now, bytes, scratch);
        self.parts.exchange(now);
        out
    }

    /// Channel indices with the part holding each.
    pub(crate) fn channels(&self) -> Vec<(usize, u16)> {
        let mut v = Vec::new();
        for (p, part) in self.parts.parts().iter().enumerate() {
            v.extend(part.channel_indices().map(|c| (p, c)));
        }
        v
    }

    /// [`tyche_channel::Volume::poll_transmit`] of part `p`.
    pub(crate) fn poll_transmit(&mut self, p: usize, now: Instant, channel: u16, buf: &mut [u8]) -> Option<OutFrame> {
        self.parts.part(p).poll_transmit(now, channel, buf)
    }

    /// [`tyche_channel::Volume::seal`] of part `p`.
    pub(crate) fn seal(&mut self, p: usize, channel: u16, buf: &mut [u8], len: usize) -> usize {
        self.parts.part(p).seal(channel, buf, len)
    }

    /// The next time [`PartedVolume::handle_timeout`] must run.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let refresh = self.refresh.iter().copied().filter(|_| self.refresh.len() > 1 && self.parts.busy());
        let message = self.parts.courier().in_flight.keys().next().map(|k| k.0);
        self.parts.poll_timers().into_iter().chain(refresh).chain(message).min()
    }

    /// Runs the timers due at `now`, the board reads due and the messages due.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        self.parts.handle_timeout(now);
        if self.refresh.len() > 1 && self.parts.busy() {
            for p in 0..self.refresh.len() {
                if self.refresh[p] <= now {
                    self.parts.part(p).refresh(now);
                    self.refresh[p] = now + Duration::from_micros(self.rng.range(200, 3_000));
                }
            }
        }
        while let Some(entry) = self.parts.courier_mut().in_flight.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (to, msg) = entry.remove();
            self.parts.deliver(now, to, msg);
        }
        self.parts.exchange(now);
    }

    /// The next event of any part.
    pub(crate) fn poll_event(&mut self) -> Option<VolumeEvent> {
        self.parts.poll_event()
    }

    /// Moves every part to `session`.
    pub(crate) fn resume(&mut self, session: u64, now: Instant) {
        self.parts.resume(session, now);
    }

    /// [`tyche_channel::Volume::inherit_debt`] for the volume.
    pub(crate) fn inherit_debt(&mut self, debt: DurabilityDebt) {
        self.parts.inherit_debt(debt);
    }
}
