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

/// Expected content of every sector, updated as modifications are acknowledged.
#[derive(Debug)]
pub struct Model {
    sectors: Vec<Expect>,
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
        Model { sectors: vec![Expect::Version(0); (bytes / SECTOR_SIZE as u64) as usize] }
    }

    fn range(offset: u64, length: u64) -> std::ops::Range<usize> {
        (offset / SECTOR_SIZE as u64) as usize..((offset + length) / SECTOR_SIZE as u64) as usize
    }

    /// An acknowledged write of `version` (0 for zeroes: DISCARD, WRITE_ZEROES).
    pub fn written(&mut self, offset: u64, length: u64, version: u64) {
        self.sectors[Self::range(offset, length)].fill(Expect::Version(version));
    }

    /// A modification that failed or was never acknowledged: its sectors are unknown until the
    /// next acknowledged write.
    pub fn unknown(&mut self, offset: u64, length: u64) {
        self.sectors[Self::range(offset, length)].fill(Expect::Unknown);
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
}
