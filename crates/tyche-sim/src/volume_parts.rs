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
//!
//! Each part keeps the buffers of the requests submitted to it, as an engine thread does: a
//! DATA frame's write data comes from there, or from the data the part adopted with a handed
//! part ([`tyche_channel::Volume::adopted_data`]), read data lands there too, and what an
//! adopter read goes back in its hand-back into the origin's buffer. So the data of a request
//! in parts travels only as the engine moves it, and the model checks what arrives.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tyche_channel::{
    Channel, DurabilityDebt, HandCourier, HandMessage, Inbound, Instant, IoRequest, LeastBytes, OutFrame, ReadBack,
    SubmitError, VolumeConfig, VolumeEvent, VolumeParts,
};
use tyche_transport::SplitMix64;
use tyche_wire::{Frame, DATA_FRAME_OVERHEAD};

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
    /// Parts yet to follow the volume to a new session, and when each will.
    following: Vec<Option<(u64, Instant)>>,
    /// Draws when each part follows, a stream of its own.
    follow_rng: SplitMix64,
    /// Each part's request buffers, by request id (write data to send, read data landed).
    requests: Vec<HashMap<u64, Vec<u8>>>,
    ethertype: u16,
    seed: u64,
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
        let requests = vec![HashMap::new(); refresh.len()];
        let following = vec![None; refresh.len()];
        PartedVolume {
            parts,
            part_of: HashMap::new(),
            refresh,
            requests,
            following,
            follow_rng: SplitMix64::new(seed ^ session.rotate_left(31) ^ 0x464f_4c4c),
            ethertype,
            seed,
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
        // A channel of the new session reaches a thread that has followed it.
        self.follow(p, now);
        self.part_of.insert(channel.envelope().channel, p);
        self.parts.part(p).add_channel(channel, None, now);
        self.exchange(now);
    }

    /// [`VolumeParts::exchange`], each part's request buffers at hand.
    fn exchange(&mut self, now: Instant) {
        let requests = &self.requests;
        self.parts.exchange(now, |p, id| requests[p].get(&id).map(Vec::as_slice));
    }

    /// Submits to part `id % parts`, or to the next part after it with a live channel while
    /// that one has none (the application's threads on a node whose paths are down hand their
    /// requests to another node's engine). The part takes the request's buffer (`buf`: the
    /// write data, or as long as the read's) until it completes ([`PartedVolume::finished`]).
    pub(crate) fn submit(&mut self, now: Instant, req: IoRequest, buf: &mut Vec<u8>) -> Result<(), SubmitError> {
        let p = self.parts.submit_part((req.id % self.refresh.len() as u64) as usize);
        let r = self.parts.part(p).submit(now, req);
        if r.is_ok() {
            self.requests[p].insert(req.id, std::mem::take(buf));
        }
        self.exchange(now);
        r
    }

    /// The buffers of the requests not completed, by request (an engine that stops gives them
    /// back to the application, which submits them to the next one).
    pub(crate) fn into_buffers(self) -> impl Iterator<Item = (u64, Vec<u8>)> {
        self.requests.into_iter().flatten()
    }

    /// The buffer of request `id`, once it completed (with a read's data).
    pub(crate) fn finished(&mut self, id: u64) -> Vec<u8> {
        let buf = self.requests.iter_mut().find_map(|r| r.remove(&id));
        buf.unwrap_or_else(|| panic!("seed {}: no buffer for completed request {id}", self.seed))
    }

    /// A frame from the target, to the part holding its channel; read data goes into the
    /// buffer of the request it names, the part's own or one it adopted with a part.
    pub(crate) fn handle_frame(&mut self, now: Instant, bytes: &[u8], scratch: &mut Vec<u8>) {
        let p = Frame::new_checked(bytes, self.ethertype)
            .map_or(0, |f| self.part_of.get(&f.channel()).copied().unwrap_or(0));
        let part = self.parts.part(p);
        if let Inbound::Read { id, offset, payload } = part.handle_frame(now, bytes, scratch) {
            let own = self.requests[p].get_mut(&id).map(Vec::as_mut_slice);
            // The volume names only a part it holds, and only inside the request.
            let dst = part
                .request_data(own, id, offset, payload.len())
                .unwrap_or_else(|| panic!("seed {}: part {p} has no buffer for read {id} at {offset}", self.seed));
            dst.copy_from_slice(payload);
        }
        self.exchange(now);
    }

    /// Channel indices with the part holding each.
    pub(crate) fn channels(&self) -> Vec<(usize, u16)> {
        let mut v = Vec::new();
        for (p, part) in self.parts.parts().iter().enumerate() {
            v.extend(part.channel_indices().map(|c| (p, c)));
        }
        v
    }

    /// [`tyche_channel::Volume::poll_transmit`] of part `p`, a DATA frame's write data copied
    /// in from the buffer of its request (the part's own, or the data of a part it adopted).
    pub(crate) fn poll_transmit(&mut self, p: usize, now: Instant, channel: u16, buf: &mut [u8]) -> Option<usize> {
        let part = self.parts.part(p);
        let OutFrame { len, payload } = part.poll_transmit(now, channel, buf)?;
        if let Some((id, offset, n)) = payload {
            let n = n as usize;
            let own = self.requests[p].get_mut(&id).map(Vec::as_mut_slice);
            let src = part
                .request_data(own, id, offset, n)
                .unwrap_or_else(|| panic!("seed {}: part {p} has no write data of {id} at {offset}", self.seed));
            buf[DATA_FRAME_OVERHEAD..DATA_FRAME_OVERHEAD + n].copy_from_slice(src);
        }
        Some(len)
    }

    /// [`tyche_channel::Volume::seal`] of part `p`.
    pub(crate) fn seal(&mut self, p: usize, channel: u16, buf: &mut [u8], len: usize) -> usize {
        self.parts.part(p).seal(channel, buf, len)
    }

    /// The next time [`PartedVolume::handle_timeout`] must run.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let refresh = self.refresh.iter().copied().filter(|_| self.refresh.len() > 1 && self.parts.busy());
        let message = self.parts.courier().in_flight.keys().next().map(|k| k.0);
        let follow = self.following.iter().flatten().map(|f| f.1);
        self.parts.poll_timers().into_iter().chain(refresh).chain(message).chain(follow).min()
    }

    /// Runs the timers due at `now`, the board reads due and the messages due.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        for p in 0..self.following.len() {
            if self.following[p].is_some_and(|f| f.1 <= now) {
                self.follow(p, now);
            }
        }
        self.parts.handle_timeout(now);
        self.exchange(now);
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
            if let Some(ReadBack { id, offset, data }) = self.parts.deliver(now, to, msg) {
                let at = offset as usize;
                let dst = self.requests[to].get_mut(&id).and_then(|b| b.get_mut(at..at + data.len()));
                let dst = dst.unwrap_or_else(|| panic!("seed {}: read {id} came back to no buffer", self.seed));
                dst.copy_from_slice(&data);
            }
        }
        self.exchange(now);
    }

    /// The next event of any part.
    pub(crate) fn poll_event(&mut self) -> Option<VolumeEvent> {
        self.parts.poll_event()
    }

    /// Moves the volume to `session`: each part follows at its thread's next pass, 0.2 to 3 ms
    /// later (as tyche-init's engine threads each follow the control at the start of a pass),
    /// or at once when a channel of the new session comes to it. Until then it runs in the old
    /// session, and may hand its queued parts to a part that moved already, which refuses them.
    pub(crate) fn resume(&mut self, session: u64, now: Instant) {
        for f in &mut self.following {
            *f = Some((session, now + Duration::from_micros(self.follow_rng.range(200, 3_000))));
        }
    }

    /// Part `p` follows the volume to its new session, if it has not yet.
    fn follow(&mut self, p: usize, now: Instant) {
        if let Some((session, _)) = self.following[p].take() {
            self.parts.part(p).resume(session, now);
            self.exchange(now);
        }
    }

    /// [`tyche_channel::Volume::inherit_debt`] for the volume.
    pub(crate) fn inherit_debt(&mut self, debt: DurabilityDebt) {
        self.parts.inherit_debt(debt);
    }
}
