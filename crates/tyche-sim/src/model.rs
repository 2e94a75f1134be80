//! The reference model: what every sector of the export must hold.

use tyche_wire::SECTOR_SIZE;

const SECTOR: usize = SECTOR_SIZE as usize;

/// A sector's expected content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Written by write `n` (content [`fill_sector`] of `n`); 0 means zeroes.
    Version(u64),
    /// A failed or unfinished modification may or may not have reached it.
    Unknown,
}

/// Expected content of every sector, updated as modifications are acknowledged, and what of
/// it must survive a crash of the target.
#[derive(Debug)]
pub struct Model {
    sectors: Vec<Expect>,
    /// What a crash of the target must leave: acknowledged before a FLUSH that completed (or
    /// written with FUA). A sector whose content differs from it may hold anything after a
    /// crash (storage may or may not have kept unflushed data).
    durable: Vec<Expect>,
    /// Sectors whose expected content may differ from `durable` (each listed once).
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    /// Acknowledged (or failed) modifications of each sector so far: a FLUSH makes a sector
    /// clean only if none came after the FLUSH was submitted. (Comparing contents is not
    /// enough: zeroes, then data, then zeroes again look unchanged, but the data may be what
    /// the FLUSH wrote to the medium.)
    changes: Vec<u32>,
    /// Crashes of the target so far: a FLUSH started before one covers nothing after it.
    epoch: u64,
    /// Acknowledged writes a crash may have lost (sector, its [`Model::changes`] count at the
    /// crash): while any is left, the next FLUSH must fail, not succeed as if they were durable.
    /// A FLUSH submitted before the crash that completes after it ran before it: the sectors it
    /// covered, unmodified since its submission, were durable, and leave this list.
    owed: Vec<(u32, u32)>,
    /// The initiator resumed its volume since the last crash: a FLUSH from before the crash
    /// that completes now may have been re-issued and run after it (it then proves nothing).
    resumed: bool,
}

/// What a FLUSH covers: the acknowledged content, when it was submitted, of every sector not
/// yet durable ([`Model::flush_started`]).
#[derive(Debug, Clone)]
pub struct FlushCover {
    epoch: u64,
    /// Sector, its acknowledged content and its [`Model::changes`] count at submission.
    sectors: Vec<(u32, Expect, u32)>,
}

/// The 8-byte words of sector `sector` as written by write `version` (0: zeroes).
#[inline]
fn word(version: u64, sector: u64, w: u64) -> u64 {
    if version == 0 {
        0
    } else {
        version.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (sector << 8 | w) ^ 0x5555_0000_0000_0000
    }
}

/// Fills `buf` (whole sectors starting at sector `first`) with write `version`'s content.
pub fn fill(buf: &mut [u8], version: u64, first: u64) {
    for (i, sector) in buf.chunks_exact_mut(SECTOR).enumerate() {
        for (w, bytes) in sector.chunks_exact_mut(8).enumerate() {
            bytes.copy_from_slice(&word(version, first + i as u64, w as u64).to_le_bytes());
        }
    }
}

fn matches(buf: &[u8], version: u64, sector: u64) -> bool {
    buf.chunks_exact(8)
        .enumerate()
        .all(|(w, b)| u64::from_le_bytes(b.try_into().expect("8 bytes")) == word(version, sector, w as u64))
}

impl Model {
    /// A model of an export of `bytes` bytes, all zeroes.
    pub fn new(bytes: u64) -> Self {
        let n = (bytes / SECTOR_SIZE as u64) as usize;
        Model {
            sectors: vec![Expect::Version(0); n],
            durable: vec![Expect::Version(0); n],
            dirty: Vec::new(),
            is_dirty: vec![false; n],
            changes: vec![0; n],
            epoch: 0,
            owed: Vec::new(),
            resumed: false,
        }
    }

    fn mark_dirty(&mut self, range: std::ops::Range<usize>) {
        for s in range {
            self.changes[s] = self.changes[s].wrapping_add(1);
            if !self.is_dirty[s] {
                self.is_dirty[s] = true;
                self.dirty.push(s as u32);
            }
        }
    }

    fn range(offset: u64, length: u64) -> std::ops::Range<usize> {
        (offset / SECTOR_SIZE as u64) as usize..((offset + length) / SECTOR_SIZE as u64) as usize
    }

    /// An acknowledged write of `version` (0 for zeroes: DISCARD, WRITE_ZEROES).
    pub fn written(&mut self, offset: u64, length: u64, version: u64) {
        let r = Self::range(offset, length);
        self.sectors[r.clone()].fill(Expect::Version(version));
        self.mark_dirty(r);
    }

    /// An acknowledged write with FUA: durable at once.
    pub fn written_durable(&mut self, offset: u64, length: u64, version: u64) {
        let r = Self::range(offset, length);
        self.sectors[r.clone()].fill(Expect::Version(version));
        self.durable[r.clone()].fill(Expect::Version(version));
        for s in r {
            self.changes[s] = self.changes[s].wrapping_add(1);
        }
    }

    /// A modification that failed or was never acknowledged: its sectors are unknown until the
    /// next acknowledged write.
    pub fn unknown(&mut self, offset: u64, length: u64) {
        let r = Self::range(offset, length);
        self.sectors[r.clone()].fill(Expect::Unknown);
        self.mark_dirty(r);
    }

    /// Crashes of the target so far.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A FLUSH is submitted: it will make durable what is acknowledged now.
    pub fn flush_started(&self) -> FlushCover {
        let sectors = self.dirty.iter().map(|&s| (s, self.sectors[s as usize], self.changes[s as usize])).collect();
        FlushCover { epoch: self.epoch, sectors }
    }

    /// A FLUSH completed successfully. Returns `false` if it must not have: a crash lost
    /// acknowledged writes since, and no FLUSH has failed to say so.
    pub fn flush_done(&mut self, cover: FlushCover) -> bool {
        if cover.epoch != self.epoch {
            // Submitted before a crash. Completed before the volume resumed: its completion was
            // on the wire, so it ran before the crash, and what it covered was durable then.
            // (Completed after: it may have been re-issued and run after the crash, where it
            // had to fail if the crash owed a report; it proves nothing.)
            if self.resumed {
                return true;
            }
            let changes = &self.changes;
            let covered: Vec<(u32, u32)> =
                cover.sectors.iter().filter(|&&(s, _, c)| changes[s as usize] == c).map(|&(s, _, c)| (s, c)).collect();
            self.owed.retain(|o| !covered.contains(o));
            return true;
        }
        if !self.owed.is_empty() {
            return false;
        }
        // Clean: covered, and not modified since the FLUSH was submitted. Every other sector
        // stays dirty (one modified since may or may not have reached the medium).
        let mut clean = Vec::new();
        for (s, e, changes) in cover.sectors {
            // Modified since the FLUSH was submitted: what it made durable is not known (a
            // FUA write since made its own content durable, and the FLUSH ran after it; seed
            // 1304 of `--restarts`, where taking the older content for durable made a crash
            // owe a report for a FUA write).
            if self.changes[s as usize] == changes {
                self.durable[s as usize] = e;
                clean.push(s);
            }
        }
        for s in clean {
            self.is_dirty[s as usize] = false;
        }
        let is_dirty = &self.is_dirty;
        self.dirty.retain(|&s| is_dirty[s as usize]);
        true
    }

    /// The initiator resumed its volume on a new session (re-issuing what was outstanding).
    pub fn resumed(&mut self) {
        self.resumed = true;
    }

    /// A FLUSH failed: whatever a crash lost has been reported.
    pub fn flush_failed(&mut self) {
        self.owed.clear();
    }

    /// The target crashed: every sector modified since a FLUSH last covered it may hold
    /// anything until it is written again (even one whose content now equals what was
    /// flushed: a modification in between may have reached the medium).
    pub fn crash(&mut self) {
        self.epoch += 1;
        self.resumed = false;
        let (sectors, durable, changes) = (&self.sectors, &self.durable, &self.changes);
        self.owed.extend(
            self.dirty
                .iter()
                .filter(|&&s| {
                    let s = s as usize;
                    matches!(sectors[s], Expect::Version(_)) && sectors[s] != durable[s]
                })
                .map(|&s| (s, changes[s as usize])),
        );
        for s in std::mem::take(&mut self.dirty) {
            let s = s as usize;
            self.is_dirty[s] = false;
            self.sectors[s] = Expect::Unknown;
            self.durable[s] = Expect::Unknown;
        }
    }

    /// Number of sectors in `buf` (read at `offset`) that differ from the model.
    pub fn mismatches(&self, offset: u64, buf: &[u8]) -> usize {
        let first = offset / SECTOR_SIZE as u64;
        buf.chunks_exact(SECTOR)
            .enumerate()
            .filter(|(i, data)| {
                let s = first + *i as u64;
                match self.sectors[s as usize] {
                    Expect::Unknown => false,
                    Expect::Version(v) => !matches(data, v, s),
                }
            })
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fua_write_after_a_flush_was_submitted_stays_durable_when_it_completes() {
        // Seed 1304 of the restarts contract: a sector dirty, a FLUSH submitted, a FUA write
        // of the sector, the FLUSH completes: the FUA write is durable, so a crash owes nothing.
        let mut m = Model::new(8 * SECTOR as u64);
        m.written(0, SECTOR as u64, 1);
        let cover = m.flush_started();
        m.written_durable(0, SECTOR as u64, 2);
        assert!(m.flush_done(cover));
        m.crash();
        assert!(m.owed.is_empty(), "{:?}", m.owed);
        // A plain write in the same place is at risk, and owed after a crash.
        let mut m = Model::new(8 * SECTOR as u64);
        m.written(0, SECTOR as u64, 1);
        let cover = m.flush_started();
        m.written(0, SECTOR as u64, 2);
        assert!(m.flush_done(cover));
        m.crash();
        assert_eq!(m.owed.len(), 1);
    }

    #[test]
    fn a_flush_does_not_clean_a_sector_modified_after_it_was_submitted() {
        // Found by seed 122 of the restarts contract with --reorder 0 --dup 0: zeroes (durable),
        // a FLUSH submitted, data written over them, zeroes again, the FLUSH completes (storage
        // ran it while the data was there, so the data is what it made durable), a crash loses
        // the unflushed zeroes: the sector holds the data, which the model must allow.
        let mut m = Model::new(4 * 512);
        let cover = m.flush_started();
        m.written(0, 512, 86);
        m.written(0, 512, 0);
        assert!(m.flush_done(cover));
        m.crash();
        let mut disk = vec![0u8; 4 * 512];
        fill(&mut disk[..512], 86, 0);
        assert_eq!(m.mismatches(0, &disk), 0, "the flushed data is a valid outcome of the crash");
        // A sector the FLUSH covered and nothing modified since is clean: a crash keeps it.
        let mut m = Model::new(4 * 512);
        m.written(512, 512, 7);
        let cover = m.flush_started();
        assert!(m.flush_done(cover));
        m.crash();
        let disk = vec![0u8; 4 * 512];
        assert_eq!(m.mismatches(0, &disk), 1, "sector 1 must hold write 7 after the crash");
    }

    #[test]
    fn a_flush_that_ran_before_the_crash_pays_what_the_crash_owed() {
        // Found by seed 1260 (--paths 3 --restarts): a FLUSH's completion was on the wire when
        // the target crashed; it ran before the crash, so the writes it covered were durable,
        // and the initiator rightly let the next FLUSH succeed.
        let mut m = Model::new(4 * 512);
        m.written(0, 1024, 5);
        let cover = m.flush_started();
        m.crash();
        assert!(m.flush_done(cover), "a FLUSH from before the crash");
        let next = m.flush_started();
        assert!(m.flush_done(next), "nothing acknowledged was lost");
        // Without that FLUSH the next one must fail.
        let mut m = Model::new(4 * 512);
        m.written(0, 1024, 5);
        m.crash();
        let next = m.flush_started();
        assert!(!m.flush_done(next), "a crash lost write 5 and no FLUSH said so");
        // A FLUSH from before the crash whose sectors were modified after it covers nothing.
        let mut m = Model::new(4 * 512);
        m.written(0, 512, 5);
        let cover = m.flush_started();
        m.written(0, 512, 6);
        m.crash();
        assert!(m.flush_done(cover));
        let next = m.flush_started();
        assert!(!m.flush_done(next), "write 6 may have been lost");
        // One completed after the volume resumed proves nothing either.
        let mut m = Model::new(4 * 512);
        m.written(0, 1024, 5);
        let cover = m.flush_started();
        m.crash();
        m.resumed();
        assert!(m.flush_done(cover));
        let next = m.flush_started();
        assert!(!m.flush_done(next), "write 6 may have been lost");
    }

    #[test]
    fn model_tracks_writes_and_unknowns() {
        let mut m = Model::new(8 * 512);
        let mut disk = vec![0u8; 8 * 512];
        assert_eq!(m.mismatches(0, &disk), 0);
        fill(&mut disk[512..1536], 7, 1);
        assert_eq!(m.mismatches(0, &disk), 2);
        m.written(512, 1024, 7);
        assert_eq!(m.mismatches(0, &disk), 0);
        // A sector of version 7 moved elsewhere does not match there.
        let moved = disk[512..1024].to_vec();
        disk[2048..2560].copy_from_slice(&moved);
        assert_eq!(m.mismatches(0, &disk), 1);
        m.unknown(2048, 512);
        assert_eq!(m.mismatches(0, &disk), 0);
    }

    #[test]
    fn a_crash_keeps_only_what_a_flush_covered() {
        let mut m = Model::new(8 * 512);
        let mut disk = vec![0u8; 8 * 512];
        fill(&mut disk[..1024], 3, 0);
        m.written(0, 1024, 3);
        let cover = m.flush_started();
        fill(&mut disk[1024..1536], 4, 2);
        m.written(1024, 512, 4); // after the FLUSH was submitted: not covered
        assert!(m.flush_done(cover));
        fill(&mut disk[1536..2048], 5, 3);
        m.written_durable(1536, 512, 5);
        m.crash();
        // Sector 2 (write 4) may hold anything now; the others must be as written.
        disk[1024..1536].fill(0xAB);
        assert_eq!(m.mismatches(0, &disk), 0);
        disk[0] ^= 1;
        assert_eq!(m.mismatches(0, &disk), 1, "a flushed sector changed by the crash");
        disk[0] ^= 1;
        disk[1536] ^= 1;
        assert_eq!(m.mismatches(0, &disk), 1, "a FUA sector changed by the crash");
    }

    #[test]
    fn a_flush_from_before_a_crash_covers_nothing() {
        let mut m = Model::new(4 * 512);
        m.written(0, 512, 3);
        let cover = m.flush_started();
        m.crash();
        // Completed after the volume resumed: re-issued, it may have run after the crash.
        m.resumed();
        assert!(m.flush_done(cover));
        m.crash();
        assert_eq!(m.mismatches(0, &[0xCD; 512]), 0, "write 3 was never made durable");
        // Write 3 may be lost: the next FLUSH must fail.
        assert!(!m.flush_done(m.flush_started()), "a FLUSH succeeded after a crash lost a write");
        m.flush_failed();
        assert!(m.flush_done(m.flush_started()));
    }
}
