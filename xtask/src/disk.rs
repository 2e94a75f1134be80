//! A real filesystem on an NBD export: NBD Unix socket → nbdfuse → loop device → ext4.
//!
//! Used by the demo and the end-to-end tests, and on its own as `cargo xtask fs-check --socket
//! PATH` against any NBD server (nbdkit, `tyche-init serve-nbd`). Everything it sets up is torn down
//! by [`NbdDisk`]'s `Drop`, also when a step fails.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use tyche_transport::SplitMix64;

/// Runs a command, failing with its stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// An ext4 filesystem on a block device, mounted under a scratch directory.
#[derive(Debug)]
pub struct BlockFs {
    /// The block device (`/dev/loopN`, `/dev/ublkbN`).
    pub dev: String,
    work: PathBuf,
    mounted: Option<PathBuf>,
}

impl BlockFs {
    /// The device `dev`, with `work` as scratch directory (the mount point goes there).
    pub fn new(dev: &str, work: &Path) -> BlockFs {
        BlockFs { dev: dev.to_string(), work: work.to_path_buf(), mounted: None }
    }

    /// Size of the device in bytes.
    pub fn size(&self) -> Result<u64> {
        run(Command::new("blockdev").args(["--getsize64", &self.dev]))?.parse().context("blockdev size")
    }

    /// Makes an ext4 filesystem on the device.
    pub fn mkfs(&self) -> Result<()> {
        run(Command::new("mkfs.ext4").args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", &self.dev]))?;
        Ok(())
    }

    /// Mounts the filesystem and returns the mount point.
    pub fn mount(&mut self) -> Result<PathBuf> {
        let mnt = self.work.join("mnt");
        fs::create_dir_all(&mnt)?;
        run(Command::new("mount").args(["-t", "ext4"]).arg(&self.dev).arg(&mnt))?;
        self.mounted = Some(mnt.clone());
        Ok(mnt)
    }

    /// Unmounts (syncing everything to the device first).
    pub fn umount(&mut self) -> Result<()> {
        if let Some(mnt) = self.mounted.take() {
            run(Command::new("umount").arg(&mnt))?;
        }
        Ok(())
    }

    /// Unmounts, lazily if the normal unmount fails (teardown paths).
    fn umount_or_detach(&mut self) -> Result<()> {
        let r = self.umount();
        if r.is_err() {
            let _ = run(Command::new("umount").arg("-l").arg(self.work.join("mnt")));
        }
        r
    }

    /// Empties every cache between the filesystem and the device (the block device's buffers and
    /// the page cache), so the next reads really go to the server behind it.
    pub fn drop_caches(&self) -> Result<()> {
        ensure!(self.mounted.is_none(), "dropping caches under a mounted filesystem");
        run(&mut Command::new("sync"))?;
        run(Command::new("blockdev").args(["--flushbufs", &self.dev]))?;
        fs::write("/proc/sys/vm/drop_caches", "3").context("dropping the page cache")?;
        Ok(())
    }

    /// `e2fsck -fn`: a full check that changes nothing; fails unless clean.
    pub fn fsck(&self) -> Result<()> {
        ensure!(self.mounted.is_none(), "fsck on a mounted filesystem");
        run(Command::new("e2fsck").args(["-f", "-n", &self.dev])).context("e2fsck -fn found problems")?;
        Ok(())
    }

    /// ext4 made on the device, `tree` written, unmounted, caches dropped, `e2fsck -fn` clean,
    /// mounted again and `tree` verified, unmounted.
    pub fn ext4_round_trip(&mut self, tree: &Tree) -> Result<()> {
        self.mkfs()?;
        let mnt = self.mount()?;
        tree.write(&mnt, &mut |_| {})?;
        self.umount()?;
        self.drop_caches()?;
        self.fsck()?;
        let mnt = self.mount()?;
        tree.verify(&mnt, &mut |_| {})?;
        self.umount()
    }
}

impl Drop for BlockFs {
    fn drop(&mut self) {
        if let Err(e) = self.umount_or_detach() {
            eprintln!("warning: unmounting {}: {e:#}", self.dev);
        }
    }
}

/// An NBD export attached as a block device through nbdfuse and a loop device.
#[derive(Debug)]
pub struct NbdDisk {
    fs: BlockFs,
    work: PathBuf,
    fuse: Child,
}

impl std::ops::Deref for NbdDisk {
    type Target = BlockFs;
    fn deref(&self) -> &BlockFs {
        &self.fs
    }
}

impl std::ops::DerefMut for NbdDisk {
    fn deref_mut(&mut self) -> &mut BlockFs {
        &mut self.fs
    }
}

impl NbdDisk {
    /// Attaches the NBD server listening on `socket`, with `work` as scratch directory.
    pub fn attach(socket: &Path, work: &Path) -> Result<NbdDisk> {
        let fuse_dir = work.join("fuse");
        fs::create_dir_all(&fuse_dir)?;
        let fuse = Command::new("nbdfuse")
            .arg(&fuse_dir)
            .arg("--unix")
            .arg(socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting nbdfuse (package libnbd-bin)")?;
        let image = fuse_dir.join("nbd");
        let mut disk = NbdDisk { fs: BlockFs::new("", work), work: work.to_path_buf(), fuse };
        let deadline = Instant::now() + Duration::from_secs(20);
        while fs::metadata(&image).map(|m| m.len()).unwrap_or(0) == 0 {
            ensure!(Instant::now() < deadline, "nbdfuse did not expose {}", image.display());
            std::thread::sleep(Duration::from_millis(50));
        }
        disk.fs.dev =
            run(Command::new("losetup").args(["-f", "--show"]).arg(&image)).context("attaching a loop device")?;
        Ok(disk)
    }

    /// Detaches everything (also done on drop).
    pub fn detach(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        let mut first_err = self.fs.umount_or_detach().err();
        if !self.fs.dev.is_empty() {
            if let Err(e) = run(Command::new("losetup").args(["-d", &self.fs.dev])) {
                first_err.get_or_insert(e);
            }
            self.fs.dev.clear();
        }
        let fuse_dir = self.work.join("fuse");
        let _ = run(Command::new("umount").arg(&fuse_dir));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.fuse.try_wait() {
                Ok(Some(_)) => break,
                _ if Instant::now() > deadline => {
                    let _ = self.fuse.kill();
                    let _ = self.fuse.wait();
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for NbdDisk {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("warning: tearing down {}: {e:#}", self.work.display());
        }
    }
}

/// A tree of files whose contents derive from a seed, so they can be checked without storing them.
#[derive(Debug, Clone)]
pub struct Tree {
    seed: u64,
    files: Vec<(PathBuf, u64)>,
}

impl Tree {
    /// A tree of `count` files totalling about `bytes`, in a few directories, sizes from 1 byte up.
    pub fn new(seed: u64, count: usize, bytes: u64) -> Tree {
        let mut rng = SplitMix64::new(seed);
        let mean = (bytes / count.max(1) as u64).max(1);
        let files = (0..count)
            .map(|i| {
                let dir = format!("d{}/e{}", i % 7, i % 3);
                let len = rng.range(1, 2 * mean);
                (PathBuf::from(dir).join(format!("f{i:05}.bin")), len)
            })
            .collect();
        Tree { seed, files }
    }

    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.1).sum()
    }

    fn fill(&self, i: usize, buf: &mut [u8], at: u64) {
        // Each 8-byte word is a function of (seed, file, word index): any misplaced block shows.
        for (word, chunk) in (at / 8..).zip(buf.chunks_mut(8)) {
            let mut g = SplitMix64::new(self.seed ^ ((i as u64) << 40) ^ word);
            let v = g.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// Writes every file under `root`, calling `progress(bytes so far)` as it goes; syncs.
    pub fn write(&self, root: &Path, progress: &mut dyn FnMut(u64)) -> Result<()> {
        let mut buf = vec![0u8; 1 << 20];
        let mut done = 0;
        for (i, (path, len)) in self.files.iter().enumerate() {
            let path = root.join(path);
            fs::create_dir_all(path.parent().expect("files are in directories"))?;
            let mut f = fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            let mut at = 0;
            while at < *len {
                let n = (buf.len() as u64).min(len - at) as usize;
                self.fill(i, &mut buf[..n], at);
                f.write_all(&buf[..n])?;
                at += n as u64;
                done += n as u64;
                progress(done);
            }
            f.sync_all()?;
        }
        Ok(())
    }

    /// Reads every file back and compares it with what was written.
    pub fn verify(&self, root: &Path, progress: &mut dyn FnMut(u64)) -> Result<()> {
        let (mut got, mut want) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
        let mut done = 0;
        for (i, (path, len)) in self.files.iter().enumerate() {
            let path = root.join(path);
            let mut f = fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            ensure!(f.metadata()?.len() == *len, "{}: size differs", path.display());
            let mut at = 0;
            while at < *len {
                let n = (got.len() as u64).min(len - at) as usize;
                f.read_exact(&mut got[..n])?;
                self.fill(i, &mut want[..n], at);
                ensure!(got[..n] == want[..n], "{}: content differs near byte {at}", path.display());
                at += n as u64;
                done += n as u64;
                progress(done);
            }
        }
        Ok(())
    }
}

/// A one-line progress bar on stderr.
pub fn progress_bar(label: &str, total: u64) -> impl FnMut(u64) + '_ {
    let started = Instant::now();
    let mut last = Instant::now() - Duration::from_secs(1);
    move |done| {
        if last.elapsed() < Duration::from_millis(100) && done < total {
            return;
        }
        last = Instant::now();
        let frac = done as f64 / total.max(1) as f64;
        let width = 30;
        let filled = (frac * width as f64) as usize;
        let mbps = done as f64 / started.elapsed().as_secs_f64().max(1e-6) / 1e6;
        eprint!(
            "\r  {label:<8} [{}{}] {:5.1}% {mbps:7.1} MB/s",
            "#".repeat(filled),
            " ".repeat(width - filled),
            frac * 100.0
        );
        if done >= total {
            eprintln!();
        }
    }
}

#[derive(Args, Debug)]
pub struct FsCheckArgs {
    /// NBD server's Unix socket.
    #[arg(long)]
    socket: PathBuf,
    /// Bytes of files to write.
    #[arg(long, default_value_t = 64 << 20)]
    bytes: u64,
    /// Number of files.
    #[arg(long, default_value_t = 200)]
    files: usize,
}

/// Full cycle: mkfs, write a tree, unmount, fsck, remount, verify, detach.
pub fn check_cycle(socket: &Path, work: &Path, tree: &Tree) -> Result<()> {
    let mut disk = NbdDisk::attach(socket, work)?;
    eprintln!("  attached {} ({} MiB) via nbdfuse", disk.dev, disk.size()? >> 20);
    disk.mkfs()?;
    let mnt = disk.mount()?;
    tree.write(&mnt, &mut progress_bar("write", tree.bytes()))?;
    disk.umount()?;
    disk.drop_caches()?;
    disk.fsck()?;
    disk.drop_caches()?;
    let mnt = disk.mount()?;
    tree.verify(&mnt, &mut progress_bar("verify", tree.bytes()))?;
    disk.detach()
}

pub fn fs_check(args: FsCheckArgs) -> Result<()> {
    let work = std::env::temp_dir().join(format!("tyche-fscheck-{}", std::process::id()));
    let tree = Tree::new(0x07e5_c0de, args.files, args.bytes);
    let r = check_cycle(&args.socket, &work, &tree);
    let _ = fs::remove_dir_all(&work);
    r?;
    println!("fs-check: ext4 ok ({} files, {} MiB written, fsck clean, verified)", args.files, tree.bytes() >> 20);
    Ok(())
}
