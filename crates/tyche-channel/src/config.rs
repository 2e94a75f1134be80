use core::time::Duration;

use tyche_wire::{ChannelParams, SECTOR_SIZE};

/// Largest ring (positions per direction) a channel accepts.
pub const MAX_RING: u16 = 4096;
/// Largest number of `remq` or `damq` slots per channel.
pub const MAX_SLOTS: u16 = 1024;
/// Largest `damq` slot (request) a channel accepts: 16 MiB.
pub const MAX_IO: u32 = 16 << 20;
/// Most tags an initiator may have between its floor and its newest tag; bounds the target's
/// executed-tag ledger.
pub const TAG_WINDOW: u64 = 1 << 16;
/// How often each part of an initiator volume held in parts publishes its own floor and reads
/// the others' ([`crate::Volume::refresh`]): a floor read this late still holds, and with
/// [`TAG_WINDOW`] tags between floor and newest tag a part allocating millions of tags a second
/// does not run into the window between two refreshes.
pub const FLOOR_REFRESH: Duration = Duration::from_millis(1);
/// Frames a channel queues for a ring position from its slots: one data message per `damq`
/// slot plus one request or completion per `remq` slot (a target's slot is busy until its
/// completion has been sent once; an initiator drops what it still had queued of a request the
/// target completed, so an early completion frees nothing twice). A target also queues
/// refusals (completions of requests that got no slot) while its queue is shorter than this, so
/// its queue never exceeds twice this.
pub(crate) const fn max_queued(params: &ChannelParams) -> usize {
    params.remq_slots as usize + params.damq_slots as usize
}

/// Timer settings of a channel. Defaults suit a LAN of tens of microseconds round trip; the
/// simulator and tests scale them to their virtual networks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timers {
    /// Retransmission timeout before any RTT sample.
    pub initial_rto: Duration,
    /// Floor of the retransmission timeout.
    pub min_rto: Duration,
    /// Ceiling of the retransmission timeout (after exponential backoff).
    pub max_rto: Duration,
    /// Longest a received frame waits for its acknowledgement.
    pub ack_delay: Duration,
    /// A standalone ACK is sent after this many unacknowledged frames arrive.
    pub ack_every: u32,
    /// How long a hole in the received positions may persist (reordering) before a NACK.
    pub nack_delay: Duration,
    /// Idle time after which a KEEPALIVE probe is sent.
    pub keepalive: Duration,
    /// A channel that has heard nothing, or made no acknowledgement progress on frames it is
    /// waiting for, for this long is dead.
    pub dead_after: Duration,
}

impl Default for Timers {
    fn default() -> Self {
        Timers {
            initial_rto: Duration::from_millis(2),
            min_rto: Duration::from_micros(500),
            max_rto: Duration::from_millis(200),
            ack_delay: Duration::from_micros(50),
            ack_every: 16,
            nack_delay: Duration::from_micros(200),
            keepalive: Duration::from_millis(250),
            dead_after: Duration::from_secs(3),
        }
    }
}

impl Timers {
    /// Checks the settings are usable.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.min_rto.is_zero() || self.min_rto > self.max_rto {
            return Err("min_rto must be positive and at most max_rto");
        }
        if self.initial_rto < self.min_rto || self.initial_rto > self.max_rto {
            return Err("initial_rto must lie between min_rto and max_rto");
        }
        if self.ack_every == 0 {
            return Err("ack_every must be at least 1");
        }
        if self.dead_after <= self.max_rto || self.keepalive >= self.dead_after {
            return Err("dead_after must exceed max_rto and keepalive");
        }
        Ok(())
    }
}

/// What this end can grant or wants: the upper bounds for negotiation.
pub fn default_params(segment: u16) -> ChannelParams {
    ChannelParams { ring: 1024, remq_slots: 128, damq_slots: 128, segment, max_io: 1 << 20, features: 0 }
}

/// The parameters a target grants for a request `asked`, never more than asked nor more than
/// its own `limit`. `None` when the result would be unusable.
pub fn negotiate(asked: &ChannelParams, limit: &ChannelParams) -> Option<ChannelParams> {
    let p = ChannelParams {
        ring: asked.ring.min(limit.ring).min(MAX_RING),
        remq_slots: asked.remq_slots.min(limit.remq_slots).min(MAX_SLOTS),
        damq_slots: asked.damq_slots.min(limit.damq_slots).min(MAX_SLOTS),
        segment: asked.segment.min(limit.segment),
        max_io: asked.max_io.min(limit.max_io).min(MAX_IO) / SECTOR_SIZE * SECTOR_SIZE,
        features: asked.features & limit.features,
    };
    p.validate().ok().map(|()| p)
}

/// Checks that granted parameters are within this implementation's limits.
pub fn params_supported(p: &ChannelParams) -> bool {
    p.validate().is_ok()
        && p.ring <= MAX_RING
        && p.remq_slots <= MAX_SLOTS
        && p.damq_slots <= MAX_SLOTS
        && p.max_io <= MAX_IO
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_never_exceeds_either_side() {
        let asked =
            ChannelParams { ring: 2048, remq_slots: 64, damq_slots: 300, segment: 2048, max_io: 4 << 20, features: 3 };
        let limit =
            ChannelParams { ring: 512, remq_slots: 256, damq_slots: 128, segment: 1024, max_io: 1 << 20, features: 1 };
        let p = negotiate(&asked, &limit).unwrap();
        assert_eq!(
            p,
            ChannelParams { ring: 512, remq_slots: 64, damq_slots: 128, segment: 1024, max_io: 1 << 20, features: 1 }
        );
        assert!(params_supported(&p));
        assert!(Timers::default().validate().is_ok());
    }
}
