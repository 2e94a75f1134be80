//! Export backends: RAM (node-bound), regular file, block device.
//!
//! Every backend is shared by the storage workers (`&self` methods); requests of one session
//! may run concurrently, and the initiator orders overlapping ones (docs/protocol.md §4.3).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use tyche_numa::{HugePages, NodeRegion};
use tyche_wire::{flags, DurabilityEpoch, Extent};

/// Errors opening a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The backing file or device could not be opened or sized.
    #[error("{path}: {source}")]
    Open {
        /// The path.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The configured size does not fit the device, or the device's size is not whole sectors.
    #[error("{0}")]
    Size(String),
    /// RAM could not be allocated.
    #[error("RAM export of {size} bytes: {message}")]
    Ram {
        /// Requested size.
        size: u64,
        /// Why.
        message: String,
    },
}

/// The backends of a target's exports by index, as its storage threads (workers, io_uring)
/// find them: room for [`crate::config::MAX_EXPORTS`], filled in order, the exports opened at
/// start and then those a reload adds. A slot once set never changes and no backend leaves the
/// table while the threads run, so reading one takes no lock and a descriptor a storage thread
/// uses stays open.
#[derive(Debug)]
pub struct BackendTable {
    slots: Box<[std::sync::OnceLock<std::sync::Arc<dyn Backend>>]>,
}

impl BackendTable {
    /// An empty table with room for `capacity` exports.
    pub fn new(capacity: usize) -> BackendTable {
        BackendTable { slots: (0..capacity).map(|_| std::sync::OnceLock::new()).collect() }
    }

    /// Sets the backend of export `index`; false (and nothing changes) when that slot is taken
    /// or beyond the table's room.
    pub fn set(&self, index: usize, backend: std::sync::Arc<dyn Backend>) -> bool {
        self.slots.get(index).is_some_and(|s| s.set(backend).is_ok())
    }

    /// The backend of export `index`, if it has been set.
    pub fn get(&self, index: usize) -> Option<&dyn Backend> {
        self.slots.get(index).and_then(|s| s.get()).map(|b| &**b)
    }

    /// The backend of export `index` to keep, if it has been set.
    pub fn get_arc(&self, index: usize) -> Option<std::sync::Arc<dyn Backend>> {
        self.slots.get(index).and_then(|s| s.get()).cloned()
    }
}

/// Storage behind one export.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// What kind of backend ("ram", "file", "block").
    fn kind(&self) -> &'static str;
    /// Fills `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`; with `fua`, the data is durable before this returns.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// The export's durability epoch (ACCEPT `DURABILITY_EPOCH`): the same for as long as the
    /// writes this backend completed are kept, flushed or not ([`crate::epoch`]). The default
    /// promises nothing.
    fn durability_epoch(&self) -> DurabilityEpoch {
        DurabilityEpoch::NONE
    }
    /// Deallocates a range; it reads back as zeroes.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Writes zeroes over a range.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()>;
    /// The file or block device behind the export, for the io_uring engine (None: RAM).
    fn as_file(&self) -> Option<&FileBackend> {
        None
    }
    /// Writes `pieces`, one after the other, from `offset` (write data left in the frames it
    /// arrived in); with `fua`, durable before this returns.
    fn write_vectored_at(&self, pieces: &[&[u8]], mut offset: u64, fua: bool) -> io::Result<()> {
        for (i, p) in pieces.iter().enumerate() {
            self.write_at(p, offset, fua && i + 1 == pieces.len())?;
            offset += p.len() as u64;
        }
        Ok(())
    }
    /// Fills `places`, one after the other, from `offset` (read data stored straight into the
    /// frames it is sent from).
    fn read_vectored_at(&self, places: &mut [&mut [u8]], mut offset: u64) -> io::Result<()> {
        for p in places.iter_mut() {
            self.read_at(p, offset)?;
            offset += p.len() as u64;
        }
        Ok(())
    }
    /// Whether writes may come from received frames in place ([`Backend::write_vectored_at`])
    /// and reads go into transmit frames in place ([`Backend::read_vectored_at`]).
    fn writes_from_frames(&self) -> bool {
        false
    }
    /// Which parts of `offset..offset + len` are allocated (op BLOCK_STATUS): at most `max`
    /// extents from `offset` on, covering at most `len` bytes (less is fine: the initiator asks
    /// again), each a positive multiple of 512 bytes. `Ok(None)`: this storage cannot tell
    /// (the request completes with UNSUPPORTED and the initiator treats the range as data).
    fn block_status(&self, offset: u64, len: u64, max: usize) -> io::Result<Option<Vec<Extent>>> {
        let _ = (offset, len, max);
        Ok(None)
    }
}

/// Most bytes of a RAM export one BLOCK_STATUS looks at (it runs on the network thread; the
/// initiator asks again for the rest).
pub const RAM_STATUS_SCAN: u64 = 4 << 20;
/// Granule of a RAM export's block status: a page of zeroes is reported as a hole.
const RAM_STATUS_PAGE: usize = 4096;

/// Flags of an extent that reads as zeroes and is not allocated.
const HOLE: u32 = flags::EXTENT_HOLE | flags::EXTENT_ZERO;

/// Appends `length` bytes of `flags` to `out`, merging with the last extent when it has the same
/// flags. Returns `false`, adding nothing, when that needs an extent past `max`.
fn push_extent(out: &mut Vec<Extent>, length: u64, flags: u32, max: usize) -> bool {
    if length == 0 {
        return true;
    }
    let full = out.len() >= max;
    match out.last_mut() {
        Some(last) if last.flags == flags => last.length += length,
        _ if full => return false,
        _ => out.push(Extent { length, flags }),
    }
    true
}

/// Memory that is node-bound when a node is known and the kernel allows it, else the heap.
/// Either way it starts on a page boundary, so O_DIRECT can use it.
#[derive(Debug)]
pub enum Memory {
    /// Pages bound to a NUMA node.
    Node(NodeRegion),
    /// Page-aligned heap memory.
    Heap(AlignedBuf),
}

/// Zeroed bytes starting on a page boundary, from an anonymous private mapping: O_DIRECT needs
/// buffers aligned to the device's logical block size, which the default allocator does not
/// give, and the kernel zero-fills the pages on first touch (a 1 GiB RAM export costs nothing
/// until written, as `calloc` would).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its mapping exclusively (like a Vec<u8>); nothing else aliases it.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give `&[u8]`, as with a Vec<u8>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zeroed bytes (aborts, as an allocation failure does, when the kernel refuses).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let map = len.max(1);
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing; no file
        // and no existing memory is involved.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(map, 4096).expect("layout"));
        }
        AlignedBuf { ptr: std::ptr::NonNull::new(p.cast()).expect("mmap never returns null"), len }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points at a readable mapping of at least `len` bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref` (the mapping is writable), and `&mut self` makes it exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `zeroed`, once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len.max(1)) };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish_non_exhaustive()
    }
}

impl Memory {
    /// `len` zeroed bytes, on `node` if given (falls back to the heap when binding fails).
    pub fn new(len: usize, node: Option<u32>) -> Memory {
        if let Some(node) = node {
            match NodeRegion::new(len, node, HugePages::No) {
                Ok(r) => return Memory::Node(r),
                Err(e) => tracing::debug!(node, len, "node-bound allocation failed, using the heap: {e}"),
            }
        }
        Memory::Heap(AlignedBuf::zeroed(len))
    }

    /// The bytes (a node region is rounded up to whole pages; callers index within their length).
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Memory::Node(r) => r.as_slice(),
            Memory::Heap(v) => v,
        }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Memory::Node(r) => r.as_mut_slice(),
            Memory::Heap(v) => v,
        }
    }
}

/// A RAM export: contents are lost when the daemon stops.
#[derive(Debug)]
pub struct RamBackend {
    mem: RwLock<Memory>,
    size: u64,
    /// Random: the contents die with the process.
    epoch: DurabilityEpoch,
}

impl RamBackend {
    /// `size` bytes of zeroes on `node`.
    pub fn new(size: u64, node: Option<u32>) -> Result<Self, BackendError> {
        let len = usize::try_from(size).map_err(|_| BackendError::Ram { size, message: "too large".into() })?;
        Ok(RamBackend { mem: RwLock::new(Memory::new(len, node)), size, epoch: crate::epoch::random() })
    }

    fn range(&self, offset: u64, len: u64) -> io::Result<std::ops::Range<usize>> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(offset as usize..end as usize),
            _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "range past the end of the export")),
        }
    }
}

impl Backend for RamBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn kind(&self) -> &'static str {
        "ram"
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let r = self.range(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.mem.read().expect("RAM export lock").as_slice()[r]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> io::Result<()> {
        let r = self.range(offset, buf.len() as u64)?;
        self.mem.write().expect("RAM export lock").as_mut_slice()[r].copy_from_slice(buf);
        Ok(())
    }
    fn write_vectored_at(&self, pieces: &[&[u8]], offset: u64, _fua: bool) -> io::Result<()> {
        let total = pieces.iter().map(|p| p.len() as u64).sum();
        let r = self.range(offset, total)?;
        let mut mem = self.mem.write().expect("RAM export lock");
        let mut at = r.start;
        for p in pieces {
            mem.as_mut_slice()[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(())
    }
    fn writes_from_frames(&self) -> bool {
        true
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn durability_epoch(&self) -> DurabilityEpoch {
        self.epoch
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let r = self.range(offset, len)?;
        self.mem.write().expect("RAM export lock").as_mut_slice()[r].fill(0);
        Ok(())
    }
    /// Pages of zeroes (never written, discarded, or zeroed) are holes; at most
    /// [`RAM_STATUS_SCAN`] bytes are looked at.
    fn block_status(&self, offset: u64, len: u64, max: usize) -> io::Result<Option<Vec<Extent>>> {
        let r = self.range(offset, len.min(RAM_STATUS_SCAN))?;
        let mem = self.mem.read().expect("RAM export lock");
        let bytes = &mem.as_slice()[r];
        let mut out = Vec::new();
        // Page by page of the export, the first and last possibly partial (offsets are sectors).
        let mut at = 0usize;
        while at < bytes.len() {
            let page_end = ((offset as usize + at) / RAM_STATUS_PAGE + 1) * RAM_STATUS_PAGE - offset as usize;
            let chunk = &bytes[at..page_end.min(bytes.len())];
            let zero = chunk.chunks(64).all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0);
            if !push_extent(&mut out, chunk.len() as u64, if zero { HOLE } else { 0 }, max) {
                break;
            }
            at += chunk.len();
        }
        Ok(Some(out))
    }
}

/// Most pieces one `pwritev` takes (`IOV_MAX` on Linux).
pub(crate) const IOV_MAX: usize = 1024;

/// `ioctl` request numbers from `<linux/fs.h>`.
mod blk {
    /// `_IOR(0x12, 114, size_t)`: device size in bytes.
    pub const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    /// `_IO(0x12, 119)`: discard a byte range.
    pub const BLKDISCARD: libc::c_ulong = 0x1277;
    /// `_IO(0x12, 127)`: zero a byte range.
    pub const BLKZEROOUT: libc::c_ulong = 0x127f;
    /// `_IO(0x12, 104)`: logical block size.
    pub const BLKSSZGET: libc::c_ulong = 0x1268;
}

/// A regular file or a block device.
#[derive(Debug)]
pub struct FileBackend {
    file: File,
    /// A second descriptor with O_DIRECT (block devices), used for aligned transfers.
    direct: Option<File>,
    /// Logical block size of the device (alignment needed by O_DIRECT).
    align: usize,
    /// Bytes handed to the O_DIRECT descriptor.
    direct_bytes: std::sync::atomic::AtomicU64,
    size: u64,
    block: bool,
    /// From the host's boot and the file's identity ([`crate::epoch::of_file`]).
    epoch: DurabilityEpoch,
}

fn open_err(path: &Path) -> impl FnOnce(io::Error) -> BackendError + '_ {
    move |source| BackendError::Open { path: path.to_owned(), source }
}

/// The bytes a `pwritev`/`preadv` call moved: `None` when a signal interrupted it (call again),
/// the error when it failed, and an error of `nothing` when it moved no byte.
fn moved(n: isize, nothing: io::ErrorKind, what: &'static str) -> io::Result<Option<usize>> {
    match n {
        n if n < 0 => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(None)
            } else {
                Err(e)
            }
        }
        0 => Err(io::Error::new(nothing, what)),
        n => Ok(Some(n as usize)),
    }
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl FileBackend {
    /// Opens `path`: a block device (size from the device; O_DIRECT when `direct`), or a regular
    /// file (grown to `size` when given; created, mode 0600, only when a size is given: a missing
    /// file without one is an error that leaves nothing behind).
    pub fn open(path: &Path, size: Option<u64>, read_only: bool, direct: bool) -> Result<Self, BackendError> {
        let meta = std::fs::metadata(path);
        let block = meta.as_ref().is_ok_and(|m| m.file_type().is_block_device());
        if meta.is_err() && (size.is_none() || read_only) {
            return Err(BackendError::Size(format!(
                "{}: no such file, and no size to create it with (NAME=PATH:SIZE, or size = in the config)",
                path.display()
            )));
        }
        let mut opts = OpenOptions::new();
        opts.read(true).write(!read_only);
        if !block && !read_only && size.is_some() {
            opts.create(true).mode(0o600);
        }
        let file = opts.open(path).map_err(open_err(path))?;
        if block {
            let mut bytes: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `bytes`.
            check(unsafe { libc::ioctl(file.as_raw_fd(), blk::BLKGETSIZE64, &mut bytes as *mut u64) })
                .map_err(open_err(path))?;
            let mut ssz: libc::c_int = 0;
            // SAFETY: BLKSSZGET writes one int through the pointer, which points at `ssz`.
            check(unsafe { libc::ioctl(file.as_raw_fd(), blk::BLKSSZGET, &mut ssz as *mut libc::c_int) })
                .map_err(open_err(path))?;
            let size = match size {
                Some(s) if s > bytes => {
                    return Err(BackendError::Size(format!(
                        "{}: size {s} exceeds the device ({bytes})",
                        path.display()
                    )))
                }
                Some(s) => s,
                None => bytes / tyche_wire::SECTOR_SIZE as u64 * tyche_wire::SECTOR_SIZE as u64,
            };
            let direct = if direct {
                let mut o = OpenOptions::new();
                o.read(true).write(!read_only).custom_flags(libc::O_DIRECT);
                o.open(path).map_err(|e| tracing::info!(path = %path.display(), "no O_DIRECT: {e}")).ok()
            } else {
                None
            };
            let align = (ssz as usize).max(512);
            let epoch = crate::epoch::of_file(&file).map_err(open_err(path))?;
            return Ok(FileBackend { file, direct, align, direct_bytes: Default::default(), size, block: true, epoch });
        }
        let current = file.metadata().map_err(open_err(path))?.len();
        let size = match size {
            Some(s) if s > current && !read_only => {
                file.set_len(s).map_err(open_err(path))?;
                s
            }
            Some(s) if s > current => {
                return Err(BackendError::Size(format!("{}: read-only file is smaller than size {s}", path.display())))
            }
            Some(s) => s,
            None => current / tyche_wire::SECTOR_SIZE as u64 * tyche_wire::SECTOR_SIZE as u64,
        };
        if size == 0 {
            return Err(BackendError::Size(format!("{}: empty file and no size given", path.display())));
        }
        let epoch = crate::epoch::of_file(&file).map_err(open_err(path))?;
        Ok(FileBackend { file, direct: None, align: 512, direct_bytes: Default::default(), size, block: false, epoch })
    }

    /// Whether this is a block device (else a regular file).
    pub fn is_block(&self) -> bool {
        self.block
    }

    /// The descriptor a transfer of `len` bytes at `ptr` and `offset` uses: the O_DIRECT one when
    /// everything is aligned to the device's logical block size, else the buffered one.
    pub fn fd_for(&self, ptr: *const u8, len: usize, offset: u64) -> std::os::fd::RawFd {
        self.file_for(ptr, len, offset).as_raw_fd()
    }

    /// The buffered descriptor (FLUSH, DISCARD, WRITE_ZEROES).
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }

    /// The descriptor for a vectored transfer at `offset`: the O_DIRECT one when every piece
    /// is aligned for it (frame payloads are: see `tyche_xdp::FRAME_HEADROOM`), else the
    /// buffered one.
    pub fn fd_for_iov(&self, iov: &[libc::iovec], offset: u64) -> std::os::fd::RawFd {
        let a = self.align;
        let ok = offset % a as u64 == 0 && iov.iter().all(|v| (v.iov_base as usize) % a == 0 && v.iov_len % a == 0);
        match &self.direct {
            Some(d) if ok => {
                self.count_direct(iov.iter().map(|v| v.iov_len).sum());
                d.as_raw_fd()
            }
            _ => self.file.as_raw_fd(),
        }
    }

    /// [`FileBackend::fd_for`] as a `File`.
    fn file_for(&self, ptr: *const u8, len: usize, offset: u64) -> &File {
        match self.aligned(ptr, len, offset) {
            Some(d) => {
                self.count_direct(len);
                d
            }
            None => &self.file,
        }
    }

    fn count_direct(&self, len: usize) {
        self.direct_bytes.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes handed to the O_DIRECT descriptor so far (see `ExportStats::direct_bytes`).
    pub fn direct_bytes(&self) -> u64 {
        self.direct_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether a transfer would use O_DIRECT.
    pub fn is_direct(&self, ptr: *const u8, len: usize, offset: u64) -> bool {
        self.aligned(ptr, len, offset).is_some()
    }

    fn aligned(&self, ptr: *const u8, len: usize, offset: u64) -> Option<&File> {
        let a = self.align;
        let ok = (ptr as usize) % a == 0 && len % a == 0 && offset % a as u64 == 0;
        self.direct.as_ref().filter(|_| ok)
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: fallocate only takes integers; the descriptor is owned by `self.file`.
        check(unsafe { libc::fallocate(self.file.as_raw_fd(), mode, offset as libc::off_t, len as libc::off_t) })
    }

    fn blk_range(&self, req: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKDISCARD and BLKZEROOUT read two u64 (start, length) through the pointer.
        check(unsafe { libc::ioctl(self.file.as_raw_fd(), req, range.as_ptr()) })
    }

    fn write_zero_bytes(&self, mut offset: u64, len: u64) -> io::Result<()> {
        let zeros = vec![0u8; (len as usize).min(1 << 20)];
        let end = offset + len;
        while offset < end {
            let n = ((end - offset) as usize).min(zeros.len());
            self.file.write_all_at(&zeros[..n], offset)?;
            offset += n as u64;
        }
        Ok(())
    }
}

/// Whether an error means "this storage cannot do that operation" (so a fallback applies).
pub(crate) fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::EINVAL))
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn as_file(&self) -> Option<&FileBackend> {
        Some(self)
    }
    fn kind(&self) -> &'static str {
        if self.block {
            "block"
        } else {
            "file"
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let f = self.file_for(buf.as_ptr(), buf.len(), offset);
        f.read_exact_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let f = self.file_for(buf.as_ptr(), buf.len(), offset);
        f.write_all_at(buf, offset)?;
        if fua {
            f.sync_data()?;
        }
        Ok(())
    }
    fn write_vectored_at(&self, pieces: &[&[u8]], mut offset: u64, fua: bool) -> io::Result<()> {
        // pwritev over at most IOV_MAX pieces at a time, resuming after short writes.
        let mut todo: Vec<&[u8]> = pieces.iter().copied().filter(|p| !p.is_empty()).collect();
        let mut first = 0;
        while first < todo.len() {
            let iov: Vec<libc::iovec> = todo[first..todo.len().min(first + IOV_MAX)]
                .iter()
                .map(|p| libc::iovec { iov_base: p.as_ptr() as *mut libc::c_void, iov_len: p.len() })
                .collect();
            // SAFETY: every iovec names a live slice of `pieces` (borrowed for this call), and
            // pwritev only reads through them.
            let n = unsafe {
                libc::pwritev(
                    self.fd_for_iov(&iov, offset),
                    iov.as_ptr(),
                    iov.len() as libc::c_int,
                    offset as libc::off_t,
                )
            };
            let Some(mut n) = moved(n, io::ErrorKind::WriteZero, "pwritev wrote nothing")? else { continue };
            offset += n as u64;
            while n > 0 {
                let p = todo[first];
                if n >= p.len() {
                    n -= p.len();
                    first += 1;
                } else {
                    todo[first] = &p[n..];
                    n = 0;
                }
            }
        }
        if fua {
            self.file.sync_data()?;
        }
        Ok(())
    }
    fn writes_from_frames(&self) -> bool {
        // Aligned frames go through O_DIRECT, any others through the buffered descriptor.
        true
    }
    fn read_vectored_at(&self, places: &mut [&mut [u8]], mut offset: u64) -> io::Result<()> {
        // preadv over at most IOV_MAX places at a time, resuming after short reads.
        let mut todo: Vec<&mut [u8]> = places.iter_mut().map(|p| &mut **p).filter(|p| !p.is_empty()).collect();
        let mut first = 0;
        while first < todo.len() {
            let end = todo.len().min(first + IOV_MAX);
            let iov: Vec<libc::iovec> = todo[first..end]
                .iter_mut()
                .map(|p| libc::iovec { iov_base: p.as_mut_ptr().cast(), iov_len: p.len() })
                .collect();
            // SAFETY: every iovec names a live, writable slice of `places` (borrowed mutably for
            // this call, distinct from each other).
            let n = unsafe {
                libc::preadv(
                    self.fd_for_iov(&iov, offset),
                    iov.as_ptr(),
                    iov.len() as libc::c_int,
                    offset as libc::off_t,
                )
            };
            let Some(mut n) = moved(n, io::ErrorKind::UnexpectedEof, "preadv read nothing")? else { continue };
            offset += n as u64;
            while n > 0 {
                let p = std::mem::take(&mut todo[first]);
                if n >= p.len() {
                    n -= p.len();
                    first += 1;
                } else {
                    todo[first] = &mut p[n..];
                    n = 0;
                }
            }
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn durability_epoch(&self) -> DurabilityEpoch {
        self.epoch
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let r = if self.block {
            self.blk_range(blk::BLKDISCARD, offset, len)
        } else {
            self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len)
        };
        match r {
            // DISCARD promises zeroes afterwards: where the storage cannot deallocate, zero.
            Err(e) if unsupported(&e) => self.write_zeroes(offset, len),
            r => r,
        }
    }
    /// A regular file's holes (`SEEK_DATA`/`SEEK_HOLE`); a block device is all data.
    fn block_status(&self, offset: u64, len: u64, max: usize) -> io::Result<Option<Vec<Extent>>> {
        let end = match offset.checked_add(len) {
            Some(end) if end <= self.size => end,
            _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, "range past the end of the export")),
        };
        if self.block {
            return Ok(Some(vec![Extent { length: len, flags: 0 }]));
        }
        let sector = tyche_wire::SECTOR_SIZE as u64;
        let fd = self.file.as_raw_fd();
        let seek = |pos: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
            // SAFETY: lseek only takes integers; the descriptor is owned by `self.file`. It moves
            // the file position, which nothing here uses (every transfer is positioned).
            let r = unsafe { libc::lseek(fd, pos as libc::off_t, whence) };
            if r < 0 {
                let e = io::Error::last_os_error();
                // ENXIO: no data (or hole) at or after `pos` (past the end of the file).
                return if e.raw_os_error() == Some(libc::ENXIO) { Ok(None) } else { Err(e) };
            }
            Ok(Some(r as u64))
        };
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            let data = match seek(pos, libc::SEEK_DATA) {
                Ok(d) => d,
                // A file system without SEEK_DATA: it cannot tell.
                Err(e) if unsupported(&e) && out.is_empty() => return Ok(None),
                Err(e) => return Err(e),
            };
            // Where data starts, rounded down to a sector (the partial sector is data).
            let data = data.map_or(end, |d| (d / sector * sector).max(pos)).min(end);
            if !push_extent(&mut out, data - pos, HOLE, max) || data == end {
                break;
            }
            // Where the data ends, rounded up to a sector; the end of the file counts as a hole.
            let hole = seek(data, libc::SEEK_HOLE)?.map_or(end, |h| h.next_multiple_of(sector));
            let hole = hole.clamp(data + sector, end);
            if !push_extent(&mut out, hole - data, 0, max) {
                break;
            }
            pos = hole;
        }
        Ok(Some(out))
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let r = if self.block {
            self.blk_range(blk::BLKZEROOUT, offset, len)
        } else {
            match self.fallocate(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE, offset, len) {
                // A file system without zero ranges (tmpfs, a memfd) may still punch holes,
                // which read as zeroes too (and free the memory).
                Err(e) if unsupported(&e) => {
                    self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len)
                }
                r => r,
            }
        };
        match r {
            Err(e) if unsupported(&e) => self.write_zero_bytes(offset, len),
            r => r,
        }
    }
}

/// Test fixtures shared by this crate's unit tests.
#[cfg(test)]
pub(crate) mod test_support {
    /// A loop device over a temporary file, detached when dropped.
    pub(crate) struct LoopDevice {
        /// `/dev/loopN`.
        pub dev: String,
        _dir: tempfile::TempDir,
    }

    impl LoopDevice {
        /// A `len`-byte loop device; `None` where losetup fails, e.g. without root (the
        /// test then cannot run: `tyche_testkit::cannot_run`).
        pub(crate) fn new(len: u64) -> Option<LoopDevice> {
            let dir = tempfile::tempdir().expect("tempdir");
            let img = dir.path().join("loop.img");
            std::fs::File::create(&img).expect("create").set_len(len).expect("size");
            let out = std::process::Command::new("losetup").args(["-f", "--show"]).arg(&img).output();
            let out =
                out.map_err(|e| tyche_testkit::cannot_run("a loop device test", &format!("losetup: {e}"))).ok()?;
            if !out.status.success() {
                let why = format!("losetup: {}", String::from_utf8_lossy(&out.stderr).trim());
                tyche_testkit::cannot_run("a loop device test", &why);
                return None;
            }
            Some(LoopDevice { dev: String::from_utf8_lossy(&out.stdout).trim().to_owned(), _dir: dir })
        }
    }

    impl Drop for LoopDevice {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup").args(["-d", &self.dev]).status();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exercise(b: &dyn Backend) {
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 + 1).collect();
        b.write_at(&data, 4096, false).expect("write");
        b.write_at(&data[..512], 0, true).expect("FUA write");
        b.flush().expect("flush");
        let mut back = vec![0u8; 8192];
        b.read_at(&mut back, 4096).expect("read");
        assert!(back == data, "{}: read returns what was written", b.kind());
        b.discard(4096, 4096).expect("discard");
        b.read_at(&mut back, 4096).expect("read");
        assert!(back[..4096].iter().all(|&x| x == 0), "{}: discarded range reads as zeroes", b.kind());
        assert!(back[4096..] == data[4096..], "{}: discard stays in its range", b.kind());
        b.write_zeroes(10240, 512).expect("write zeroes");
        b.read_at(&mut back[..1024], 9728).expect("read");
        assert!(back[..512] == data[5632..6144], "{}: before the zeroed range", b.kind());
        assert!(back[512..1024].iter().all(|&x| x == 0), "{}: zeroed range", b.kind());
    }

    /// Resident memory of this process in bytes.
    fn resident() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
        let pages: u64 = statm.split_whitespace().nth(1).expect("resident").parse().expect("number");
        pages * 4096
    }

    #[test]
    fn memory_is_page_aligned_and_zero_filled_lazily() {
        let before = resident();
        let mut m = Memory::new(1 << 30, None);
        let grew = resident().saturating_sub(before);
        // (Other tests run in this process at the same time: leave them room.)
        assert!(grew < 256 << 20, "a 1 GiB region is not touched when made: resident grew by {grew} bytes");
        let s = m.as_mut_slice();
        assert_eq!(s.as_ptr() as usize % 4096, 0, "page-aligned");
        assert!(s[..4096].iter().all(|&b| b == 0) && s[(1 << 30) - 1] == 0, "zero-filled");
        s[12345] = 7;
        assert_eq!(m.as_slice()[12345], 7);
        assert_eq!(Memory::new(0, None).as_slice().len(), 0, "empty regions work");
    }

    #[test]
    fn ram_backend_semantics() {
        let b = RamBackend::new(1 << 20, None).expect("RAM");
        exercise(&b);
        assert!(b.read_at(&mut [0; 512], 1 << 20).is_err(), "read past the end fails");
    }

    #[test]
    fn file_backend_semantics_and_persistence() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("export.img");
        {
            let b = FileBackend::open(&path, Some(1 << 20), false, true).expect("open");
            assert_eq!(b.size(), 1 << 20);
            assert_eq!(b.kind(), "file");
            exercise(&b);
        }
        let b = FileBackend::open(&path, None, true, true).expect("reopen read-only");
        assert_eq!(b.size(), 1 << 20, "size comes from the file");
        let mut back = vec![0u8; 512];
        b.read_at(&mut back, 0).expect("read");
        assert_eq!(back[0], 1, "data survives a reopen");
    }

    const HZ: u32 = flags::EXTENT_HOLE | flags::EXTENT_ZERO;

    fn ext(length: u64, flags: u32) -> Extent {
        Extent { length, flags }
    }

    #[test]
    fn ram_block_status_reports_pages_of_zeroes_as_holes() {
        let b = RamBackend::new(8 << 20, None).expect("RAM");
        b.write_at(&[1; 4096], 8192, false).unwrap();
        b.write_at(&[2; 512], (1 << 20) + 512, false).unwrap();
        let got = b.block_status(0, 2 << 20, 31).unwrap().expect("RAM can tell");
        assert_eq!(
            got,
            [ext(8192, HZ), ext(4096, 0), ext((1 << 20) - 12288, HZ), ext(4096, 0), ext((1 << 20) - 4096, HZ)]
        );
        // From an unaligned sector: the page boundaries are the export's.
        let got = b.block_status(7680, 1024, 31).unwrap().unwrap();
        assert_eq!(got, [ext(512, HZ), ext(512, 0)]);
        // At most `max` extents, and at most RAM_STATUS_SCAN bytes looked at.
        assert_eq!(b.block_status(0, 2 << 20, 2).unwrap().unwrap(), [ext(8192, HZ), ext(4096, 0)]);
        let whole = b.block_status(0, 8 << 20, 31).unwrap().unwrap();
        assert_eq!(whole.iter().map(|e| e.length).sum::<u64>(), RAM_STATUS_SCAN);
        // Discarded pages are holes again.
        b.discard(8192, 4096).unwrap();
        assert_eq!(b.block_status(0, 65536, 31).unwrap().unwrap(), [ext(65536, HZ)]);
        assert!(b.block_status(8 << 20, 512, 31).is_err(), "past the end");
    }

    /// tmpfs has no FALLOC_FL_ZERO_RANGE: WRITE_ZEROES punches a hole there (zeroes, and a hole
    /// in BLOCK_STATUS, as qemu-img map expects), rather than writing zero bytes.
    #[test]
    fn write_zeroes_on_tmpfs_leaves_a_hole() {
        let fd = nix::sys::memfd::memfd_create("tyched-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).expect("memfd");
        let path = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let b = FileBackend::open(&path, Some(1 << 20), false, false).expect("open");
        b.write_at(&[7; 65536], 0, false).unwrap();
        b.write_zeroes(16384, 32768).unwrap();
        let mut back = vec![1; 65536];
        b.read_at(&mut back, 0).unwrap();
        assert!(back[..16384].iter().all(|&x| x == 7) && back[49152..].iter().all(|&x| x == 7));
        assert!(back[16384..49152].iter().all(|&x| x == 0), "the zeroed range reads zeroes");
        let got = b.block_status(0, 65536, 31).unwrap().expect("tmpfs has SEEK_DATA");
        assert_eq!(got, [ext(16384, 0), ext(32768, HOLE), ext(16384, 0)], "{got:?}");
    }

    #[test]
    fn file_block_status_follows_seek_data_and_seek_hole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sparse.img");
        let b = FileBackend::open(&path, Some(16 << 20), false, false).expect("open");
        b.write_at(&[1; 65536], 1 << 20, false).unwrap();
        b.write_at(&[2; 4096], (15 << 20) + 4096, false).unwrap();
        b.flush().unwrap();
        let got = b.block_status(0, 16 << 20, 31).unwrap().expect("SEEK_DATA");
        let total: u64 = got.iter().map(|e| e.length).sum();
        assert_eq!(total, 16 << 20);
        if got.len() == 1 {
            let why = format!("the temporary directory's file system reports no holes ({got:?})");
            tyche_testkit::cannot_run("file_block_status_follows_seek_data_and_seek_hole", &why);
            return;
        }
        // Allocation may be coarser than the writes (file system blocks), never finer.
        let data: Vec<(u64, u64)> = {
            let mut at = 0;
            got.iter()
                .filter_map(|e| {
                    at += e.length;
                    (e.flags == 0).then_some((at - e.length, at))
                })
                .collect()
        };
        assert!(data.iter().any(|&(s, e)| s <= 1 << 20 && e >= (1 << 20) + 65536), "{got:?}");
        assert!(data.iter().any(|&(s, e)| s <= (15 << 20) + 4096 && e >= (15 << 20) + 8192), "{got:?}");
        assert_eq!(got[0].flags, HZ, "the file starts with a hole: {got:?}");
        // A range inside a hole, and one inside data.
        assert_eq!(b.block_status(4 << 20, 1 << 20, 31).unwrap().unwrap(), [ext(1 << 20, HZ)]);
        assert_eq!(b.block_status(1 << 20, 65536, 31).unwrap().unwrap(), [ext(65536, 0)]);
        // Bounded: one extent.
        assert_eq!(b.block_status(0, 16 << 20, 1).unwrap().unwrap().len(), 1);
        assert!(b.block_status(16 << 20, 512, 31).is_err(), "past the end");
    }

    /// A loop device over a temporary file (root only; where losetup is unavailable it cannot
    /// run: skipped, or failed under `cargo xtask test`).
    #[test]
    fn block_device_backend_on_a_loop_device() {
        let Some(lo) = test_support::LoopDevice::new(8 << 20) else { return };
        let dev = lo.dev.clone();
        let b = FileBackend::open(Path::new(&dev), None, false, true).expect("open the loop device");
        assert_eq!(b.kind(), "block");
        assert_eq!(b.size(), 8 << 20, "size from BLKGETSIZE64");
        exercise(&b);
        // Page-aligned memory takes the O_DIRECT path.
        let mut m = Memory::new(8192, Some(0));
        let aligned = m.as_slice().as_ptr() as usize % 4096 == 0;
        m.as_mut_slice()[..8192].fill(0xab);
        b.write_at(&m.as_slice()[..8192], 1 << 20, false).expect("aligned write");
        let mut back = Memory::new(8192, Some(0));
        b.read_at(&mut back.as_mut_slice()[..8192], 1 << 20).expect("aligned read");
        assert!(back.as_slice()[..8192].iter().all(|&x| x == 0xab), "aligned round trip (O_DIRECT: {aligned})");
        assert_eq!(b.block_status(0, 8 << 20, 31).unwrap(), Some(vec![Extent { length: 8 << 20, flags: 0 }]));
        let too_big = FileBackend::open(Path::new(&dev), Some(16 << 20), false, true);
        assert!(matches!(too_big, Err(BackendError::Size(_))), "a size beyond the device is refused");
    }
}
