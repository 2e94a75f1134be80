//! dm-log-writes' log, read and replayed: `vm-test`'s crash test replays it onto a scratch image
//! at every flush and FUA to check the filesystem as a power loss at that moment would leave it.
//!
//! The format (the kernel's device-mapper documentation, "log-writes", and
//! `drivers/md/dm-log-writes.c`), all little-endian:
//!
//! - At byte 0, the super block: `magic u64` ([`MAGIC`]), `version u64` (1), `nr_entries u64`,
//!   `sectorsize u32` (the logged device's logical block size). The kernel rewrites it after each
//!   FUA and mark, and when the target is removed (which first logs the mark
//!   `dm-log-writes-end`), so a log read after `dmsetup remove` counts every entry.
//! - From byte `sectorsize`, the entries in the order the writes completed (a plain write is
//!   logged only once a flush covered it): each is one `sectorsize` block holding
//!   `sector u64`, `nr_sectors u64` (both in `sectorsize` units), `flags u64` ([`FLUSH`],
//!   [`FUA`], [`DISCARD`], [`MARK`], [`METADATA`]), `data_len u64`, and for a mark its name
//!   (`data_len` bytes); then, unless it is a discard, the written data: `nr_sectors`
//!   blocks.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

/// The log's magic number (`WRITE_LOG_MAGIC`).
pub const MAGIC: u64 = 0x006a_7366_7773_6872;
/// The only version of the format.
pub const VERSION: u64 = 1;
/// A preflush: every write logged before it was on stable storage when it completed.
pub const FLUSH: u64 = 1 << 0;
/// A write with forced unit access: on stable storage when it completed.
pub const FUA: u64 = 1 << 1;
/// A discard of `nr_sectors` blocks (no data in the log; replayed as zeroes).
pub const DISCARD: u64 = 1 << 2;
/// A mark (`dmsetup message DEV 0 mark NAME`), no write.
pub const MARK: u64 = 1 << 3;
/// A write the filesystem tagged as metadata (REQ_META).
pub const METADATA: u64 = 1 << 4;
/// Every flag this reader knows; any other bit is an error (a newer format).
const KNOWN: u64 = FLUSH | FUA | DISCARD | MARK | METADATA;
/// The largest write one entry may hold (the kernel splits nothing: a bio's size), so a corrupt
/// count cannot make the replay allocate without bound.
const MAX_ENTRY_BYTES: u64 = 64 << 20;

/// One entry of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its number, from 0.
    pub index: u64,
    /// The first block written (in the log's `sectorsize` units).
    pub sector: u64,
    /// Blocks written or discarded.
    pub sectors: u64,
    /// [`FLUSH`], [`FUA`], [`DISCARD`], [`MARK`], [`METADATA`].
    pub flags: u64,
    /// A mark's name.
    pub mark: Option<String>,
    /// Where its data starts in the log, bytes.
    data_at: u64,
}

impl Entry {
    /// Whether everything logged up to and including this entry was on stable storage when it
    /// completed: the points a power loss can be checked at.
    pub fn durable_point(&self) -> bool {
        self.flags & (FLUSH | FUA) != 0
    }

    /// Whether it changes the device (a write with data, or a discard).
    pub fn writes(&self) -> bool {
        self.flags & MARK == 0 && self.sectors > 0
    }
}

/// A dm-log-writes log being read from its start.
pub struct Log {
    file: File,
    len: u64,
    sectorsize: u64,
    entries: u64,
    next_at: u64,
    next_index: u64,
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Log {
    /// Opens the log at `path` (a file, or the log device itself) and reads its super block.
    pub fn open(path: &Path) -> Result<Log> {
        let file = File::open(path).with_context(|| format!("opening the log {}", path.display()))?;
        let len = device_len(&file).with_context(|| format!("the size of {}", path.display()))?;
        let mut sup = [0u8; 28];
        file.read_exact_at(&mut sup, 0).with_context(|| format!("reading the super block of {}", path.display()))?;
        let magic = le64(&sup, 0);
        ensure!(magic == MAGIC, "{} is not a dm-log-writes log (magic {magic:#x}, want {MAGIC:#x})", path.display());
        let version = le64(&sup, 8);
        ensure!(version == VERSION, "{}: log version {version}, this reader knows {VERSION}", path.display());
        let entries = le64(&sup, 16);
        let sectorsize = u64::from(u32::from_le_bytes(sup[24..28].try_into().expect("4 bytes")));
        ensure!(
            sectorsize.is_power_of_two() && (512..=65536).contains(&sectorsize),
            "{}: sector size {sectorsize} in the super block",
            path.display()
        );
        Ok(Log { file, len, sectorsize, entries, next_at: sectorsize, next_index: 0 })
    }

    /// The logged device's block size: the unit of [`Entry::sector`] and [`Entry::sectors`].
    pub fn sectorsize(&self) -> u64 {
        self.sectorsize
    }

    /// The entries the super block counts.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// The next entry, or `None` after the last one the super block counts.
    pub fn next_entry(&mut self) -> Result<Option<Entry>> {
        if self.next_index >= self.entries {
            return Ok(None);
        }
        let index = self.next_index;
        let at = self.next_at;
        ensure!(at + self.sectorsize <= self.len, "the log ends inside entry {index} (at byte {at})");
        let mut head = vec![0u8; self.sectorsize as usize];
        self.file.read_exact_at(&mut head, at).with_context(|| format!("reading entry {index}"))?;
        let (sector, sectors, flags, data_len) = (le64(&head, 0), le64(&head, 8), le64(&head, 16), le64(&head, 24));
        ensure!(flags & !KNOWN == 0, "entry {index}: unknown flags {flags:#x}");
        let mut mark = None;
        let mut data = 0;
        if flags & MARK != 0 {
            ensure!(data_len <= self.sectorsize - 32, "entry {index}: a mark of {data_len} bytes");
            let name = &head[32..32 + data_len as usize];
            mark = Some(String::from_utf8_lossy(name).into_owned());
        } else {
            // The kernel logs inline data only for marks; a write's data follows in blocks.
            ensure!(data_len == 0, "entry {index}: {data_len} bytes of inline data, which this reader does not know");
            if flags & DISCARD == 0 {
                data = sectors
                    .checked_mul(self.sectorsize)
                    .filter(|&b| b <= MAX_ENTRY_BYTES)
                    .with_context(|| format!("entry {index}: {sectors} blocks, more than {MAX_ENTRY_BYTES} bytes"))?;
            }
        }
        let data_at = at + self.sectorsize;
        ensure!(data_at + data <= self.len, "the log ends inside the data of entry {index}");
        self.next_at = data_at + data;
        self.next_index += 1;
        Ok(Some(Entry { index, sector, sectors, flags, mark, data_at }))
    }

    /// Applies `entry` to `dev` (of `dev_len` bytes): its data written at its place, or for a
    /// discard zeroes (what the replay device reads after a discard is not defined; zeroes
    /// match a file whose holes were punched, as the loop driver discards).
    pub fn apply(&self, entry: &Entry, dev: &File, dev_len: u64) -> Result<()> {
        if !entry.writes() {
            return Ok(());
        }
        let offset = entry.sector.checked_mul(self.sectorsize).context("entry offset overflows")?;
        let len = entry.sectors.checked_mul(self.sectorsize).context("entry length overflows")?;
        ensure!(
            offset.checked_add(len).is_some_and(|end| end <= dev_len),
            "entry {}: blocks {}+{} lie beyond the {dev_len}-byte device",
            entry.index,
            entry.sector,
            entry.sectors
        );
        let chunk = 1 << 20;
        let mut buf = vec![0u8; len.min(chunk) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(chunk) as usize;
            if entry.flags & DISCARD == 0 {
                self.file
                    .read_exact_at(&mut buf[..n], entry.data_at + done)
                    .with_context(|| format!("reading the data of entry {}", entry.index))?;
            }
            dev.write_all_at(&buf[..n], offset + done).with_context(|| format!("replaying entry {}", entry.index))?;
            done += n as u64;
        }
        Ok(())
    }
}

/// The size of a regular file or a block device.
fn device_len(file: &File) -> Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    let mut f = file.try_clone()?;
    Ok(f.seek(SeekFrom::End(0))?)
}

/// What a [`replay`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// Entries in the log.
    pub entries: u64,
    /// Flush and FUA entries from the start mark on (the start mark itself counted too): the
    /// points a power loss was checked at.
    pub marks: u64,
    /// How often `check` ran: once per point whose image differs from the last one checked
    /// (consecutive flushes with no write between them leave the same image).
    pub checked: u64,
    /// Bytes written to the scratch image (data and discards).
    pub bytes: u64,
}

/// Replays the log at `log` onto `scratch` (a file made `dev_len` bytes of zeroes first, as the
/// logged device was when logging began), and from the mark named `start` (the point the
/// filesystem existed: before it, a flush finds a half-made one) calls `check(entry)` at that
/// mark and at every flush and FUA after it, with `scratch` holding exactly what the device held
/// on stable storage at that point; and once more at the end if writes followed the last point.
pub fn replay(
    log: &Path,
    scratch: &Path,
    dev_len: u64,
    start: &str,
    check: &mut dyn FnMut(&Entry) -> Result<()>,
) -> Result<Replayed> {
    let mut log = Log::open(log)?;
    let dev = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(scratch)
        .with_context(|| format!("creating {}", scratch.display()))?;
    dev.set_len(dev_len)?;
    let mut out = Replayed { entries: log.entries(), ..Replayed::default() };
    let mut started = false;
    let mut dirty = false;
    let mut last = None;
    while let Some(e) = log.next_entry()? {
        log.apply(&e, &dev, dev_len)?;
        if e.writes() {
            dirty = true;
            out.bytes += e.sectors * log.sectorsize();
        }
        let point = if started {
            e.durable_point()
        } else if e.mark.as_deref() == Some(start) {
            started = true;
            true
        } else {
            false
        };
        if point {
            out.marks += 1;
            if dirty || out.checked == 0 {
                check(&e).with_context(|| format!("at log entry {} of {}", e.index, out.entries))?;
                out.checked += 1;
                dirty = false;
            }
        }
        last = Some(e);
    }
    if !started {
        bail!("the log has no mark {start:?}");
    }
    if dirty {
        let e = last.context("a dirty image with no entry")?;
        check(&e).with_context(|| format!("at the log's end (entry {})", e.index))?;
        out.checked += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log as the kernel writes it, built entry by entry.
    struct Writer {
        bytes: Vec<u8>,
        entries: u64,
        ss: usize,
    }

    impl Writer {
        fn new(ss: usize) -> Writer {
            Writer { bytes: vec![0; ss], entries: 0, ss }
        }

        fn entry(&mut self, sector: u64, sectors: u64, flags: u64, mark: &str, data: &[u8]) {
            let mut head = vec![0u8; self.ss];
            head[0..8].copy_from_slice(&sector.to_le_bytes());
            head[8..16].copy_from_slice(&sectors.to_le_bytes());
            head[16..24].copy_from_slice(&flags.to_le_bytes());
            head[24..32].copy_from_slice(&(mark.len() as u64).to_le_bytes());
            head[32..32 + mark.len()].copy_from_slice(mark.as_bytes());
            self.bytes.extend_from_slice(&head);
            self.bytes.extend_from_slice(data);
            self.entries += 1;
        }

        fn finish(mut self, dir: &Path) -> std::path::PathBuf {
            self.bytes[0..8].copy_from_slice(&MAGIC.to_le_bytes());
            self.bytes[8..16].copy_from_slice(&VERSION.to_le_bytes());
            self.bytes[16..24].copy_from_slice(&self.entries.to_le_bytes());
            self.bytes[24..28].copy_from_slice(&(self.ss as u32).to_le_bytes());
            let p = dir.join("log");
            std::fs::write(&p, &self.bytes).expect("write log");
            p
        }
    }

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("xtask-logwrites-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    #[test]
    fn replays_to_every_durable_point_after_the_start_mark() {
        let d = dir("points");
        let mut w = Writer::new(512);
        w.entry(0, 2, 0, "", &[1u8; 1024]); // before the mark: applied, not checked
        w.entry(0, 0, FLUSH, "", &[]);
        w.entry(0, 0, MARK, "mkfs", &[]);
        w.entry(4, 1, 0, "", &[2u8; 512]);
        w.entry(0, 0, FLUSH, "", &[]);
        w.entry(0, 0, FLUSH, "", &[]); // nothing written since: the same image, not checked again
        w.entry(0, 1, DISCARD, "", &[]);
        w.entry(6, 1, FUA | METADATA, "", &[3u8; 512]);
        w.entry(7, 1, 0, "", &[4u8; 512]); // after the last point: checked at the end
        let log = w.finish(&d);
        let scratch = d.join("scratch");
        let mut seen = Vec::new();
        let r = replay(&log, &scratch, 8 * 512, "mkfs", &mut |e| {
            let img = std::fs::read(&scratch)?;
            seen.push((e.index, img[0], img[600], img[4 * 512], img[6 * 512], img[7 * 512]));
            Ok(())
        })
        .expect("replay");
        assert_eq!(r, Replayed { entries: 9, marks: 4, checked: 4, bytes: 1024 + 512 + 512 + 512 + 512 });
        assert_eq!(
            seen,
            vec![(2, 1, 1, 0, 0, 0), (4, 1, 1, 2, 0, 0), (7, 0, 1, 2, 3, 0), (8, 0, 1, 2, 3, 4)],
            "(entry, block 0, block 1, block 4, block 6, block 7) at each check"
        );
    }

    #[test]
    fn bad_logs_are_errors() {
        let d = dir("bad");
        let scratch = d.join("scratch");
        // Not a log.
        std::fs::write(d.join("log"), [0u8; 4096]).expect("write");
        let e = replay(&d.join("log"), &scratch, 4096, "mkfs", &mut |_| Ok(())).unwrap_err();
        assert!(format!("{e:#}").contains("not a dm-log-writes log"), "{e:#}");
        // No start mark.
        let mut w = Writer::new(512);
        w.entry(0, 1, FLUSH, "", &[9u8; 512]);
        let log = w.finish(&d);
        let e = replay(&log, &scratch, 4096, "mkfs", &mut |_| Ok(())).unwrap_err();
        assert!(format!("{e:#}").contains("no mark"), "{e:#}");
        // A write past the device's end.
        let mut w = Writer::new(512);
        w.entry(0, 0, MARK, "mkfs", &[]);
        w.entry(8, 1, 0, "", &[9u8; 512]);
        let log = w.finish(&d);
        let e = replay(&log, &scratch, 4096, "mkfs", &mut |_| Ok(())).unwrap_err();
        assert!(format!("{e:#}").contains("beyond"), "{e:#}");
        // A log cut short inside an entry's data.
        let mut w = Writer::new(512);
        w.entry(0, 0, MARK, "mkfs", &[]);
        w.entry(0, 2, 0, "", &[9u8; 512]);
        let log = w.finish(&d);
        let e = replay(&log, &scratch, 4096, "mkfs", &mut |_| Ok(())).unwrap_err();
        assert!(format!("{e:#}").contains("ends inside the data of entry 1"), "{e:#}");
        // A failed check names the entry.
        let mut w = Writer::new(512);
        w.entry(0, 0, MARK, "mkfs", &[]);
        w.entry(0, 1, FUA, "", &[9u8; 512]);
        let log = w.finish(&d);
        let e =
            replay(&log, &scratch, 4096, "mkfs", &mut |e| if e.index == 1 { bail!("fsck said no") } else { Ok(()) })
                .unwrap_err();
        assert!(format!("{e:#}").contains("at log entry 1 of 2: fsck said no"), "{e:#}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
