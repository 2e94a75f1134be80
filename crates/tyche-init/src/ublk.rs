//! The ublk front end (feature `ublk`): `/dev/ublkbN` backed by a [`Client`], through libublk
//! 0.4.8.
//!
//! One thread per hardware queue (libublk's `run_target`), one smol task per tag that loops
//! fetch → serve through the [`Client`] → commit. The client's completions are woken from the
//! engine thread while the queue thread sleeps in `io_uring_enter`, so every client future is
//! polled with a waker that also rings a per-queue eventfd; a doorbell task keeps a read of
//! that eventfd in the queue's ring, so the ring wakes, libublk reaps, and the executor runs the
//! woken task.
//!
//! Send modes: in inline mode (the default) the queue thread itself submits each request into the
//! session and sends its frames (the papers' inline mode: no hand-off, no wake-up of an engine
//! thread); in queue mode it queues the request for a submitter thread. Either way the engine
//! threads receive the replies and complete the client futures.
//!
//! Data path: with `UBLK_F_USER_COPY` (kernel 6.5 and later; used whenever the driver offers it)
//! there is no per-tag I/O buffer: write data is read from `/dev/ublkcN` straight into the
//! request's buffer, and read data is written from the completion's buffer straight into the
//! block request's pages, each with one `pread`/`pwrite` (the kernel's copy). Without it, data is
//! copied once more through a per-tag I/O buffer. Zero copy (`UBLK_F_SUPPORT_ZERO_COPY`, 6.15) is
//! not used: it needs the data to move through io_uring fixed buffers, which the network side
//! does not do yet.
//!
//! Recovery: devices are created with `UBLK_F_USER_RECOVERY` and `UBLK_F_USER_RECOVERY_REISSUE`
//! where the driver has them, so a killed server leaves the device (and its mounted filesystem)
//! quiesced, with unanswered requests put back in the queue; [`UblkDevice::recover`] in a new
//! process takes it over (START_USER_RECOVERY, then END_USER_RECOVERY once the queues are ready).

use std::future::Future;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::helpers::IoBuf;
use libublk::io::{UblkDev, UblkIOCtx, UblkQueue};
use libublk::{sys, BufDesc, UblkError, UblkFlags};
use tracing::{error, info, warn};
use tyche_runtime::wake::WakeFd;

use crate::client::Client;
use crate::frontend::{BlockFrontend, FrontendError, UblkOptions};

/// Largest request ublk hands us (the per-tag I/O buffer).
const IO_BUF_BYTES: u32 = 1 << 20;

/// A waker that wakes the task and rings the queue's eventfd.
struct Doorbell {
    task: Waker,
    efd: Arc<WakeFd>,
}

impl Wake for Doorbell {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.task.wake_by_ref();
        self.efd.wake();
    }
}

/// Polls `fut` with a [`Doorbell`] waker.
struct Rung<F> {
    fut: Pin<Box<F>>,
    efd: Arc<WakeFd>,
}

impl<F: Future> Future for Rung<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let waker = Waker::from(Arc::new(Doorbell { task: cx.waker().clone(), efd: Arc::clone(&self.efd) }));
        let mut cx = Context::from_waker(&waker);
        self.fut.as_mut().poll(&mut cx)
    }
}

fn rung<F: Future>(efd: &Arc<WakeFd>, fut: F) -> Rung<F> {
    Rung { fut: Box::pin(fut), efd: Arc::clone(efd) }
}

/// Keeps a read of the eventfd in the ring so that a ring wakes the queue thread.
async fn doorbell(q: &UblkQueue<'_>, efd: &WakeFd) {
    // Leaked on purpose: the kernel may still write here while the ring is torn down.
    let buf: &'static mut [u8; 8] = Box::leak(Box::new([0u8; 8]));
    loop {
        let sqe = io_uring::opcode::Read::new(io_uring::types::Fd(efd.as_raw_fd()), buf.as_mut_ptr(), 8).build();
        if q.ublk_submit_sqe(sqe).await < 0 {
            return;
        }
    }
}

/// Where a tag's request data lives.
enum Data<'a> {
    /// `UBLK_F_USER_COPY`: in the kernel, reached with pread/pwrite on `/dev/ublkcN` at `pos`.
    UserCopy { cdev: i32, pos: u64 },
    /// The tag's I/O buffer.
    Buf(&'a mut IoBuf<u8>),
}

impl Data<'_> {
    /// Write data of the current request (`len` bytes).
    async fn take(&mut self, q: &UblkQueue<'_>, client: &Client, len: usize) -> Result<Vec<u8>, i32> {
        match self {
            Data::UserCopy { cdev, pos } => {
                let mut v = vec![0u8; len];
                // The ring reads into `v`, which lives across the await until the completion.
                let sqe = io_uring::opcode::Read::new(io_uring::types::Fd(*cdev), v.as_mut_ptr(), len as u32)
                    .offset(*pos)
                    .build();
                match q.ublk_submit_sqe(sqe).await {
                    n if n == len as i32 => Ok(v),
                    n if n < 0 => Err(n),
                    _ => Err(-libc::EIO),
                }
            }
            Data::Buf(buf) => {
                client.count_copied(len, true);
                Ok(buf.as_slice()[..len].to_vec())
            }
        }
    }

    /// Delivers read data of the current request.
    async fn give(&mut self, q: &UblkQueue<'_>, client: &Client, data: &[u8]) -> Result<(), i32> {
        match self {
            Data::UserCopy { cdev, pos } => {
                let sqe = io_uring::opcode::Write::new(io_uring::types::Fd(*cdev), data.as_ptr(), data.len() as u32)
                    .offset(*pos)
                    .build();
                match q.ublk_submit_sqe(sqe).await {
                    n if n == data.len() as i32 => Ok(()),
                    n if n < 0 => Err(n),
                    _ => Err(-libc::EIO),
                }
            }
            Data::Buf(buf) => {
                buf.as_mut_slice()[..data.len()].copy_from_slice(data);
                client.count_copied(data.len(), false);
                Ok(())
            }
        }
    }
}

/// Serves one ublk request; returns bytes done or a negative errno.
async fn serve_one(
    q: &UblkQueue<'_>,
    iod: &sys::ublksrv_io_desc,
    mut data: Data<'_>,
    client: &Client,
    efd: &Arc<WakeFd>,
) -> i32 {
    let op = iod.op_flags & 0xff;
    let fua = iod.op_flags & sys::UBLK_IO_F_FUA != 0;
    let offset = iod.start_sector << 9;
    let len = (iod.nr_sectors as usize) << 9;
    let done = |r: Result<(), crate::Error>| r.map_or_else(|e| -e.errno(), |()| len as i32);
    match op {
        sys::UBLK_IO_OP_READ => match rung(efd, client.read(offset, len)).await {
            Ok(bytes) => data.give(q, client, &bytes).await.map_or_else(|e| e, |()| len as i32),
            Err(e) => -e.errno(),
        },
        sys::UBLK_IO_OP_WRITE => match data.take(q, client, len).await {
            Ok(bytes) => done(rung(efd, client.write_owned(offset, bytes, fua)).await),
            Err(e) => e,
        },
        sys::UBLK_IO_OP_FLUSH => done(rung(efd, client.flush()).await),
        sys::UBLK_IO_OP_DISCARD => done(rung(efd, client.discard(offset, len as u64)).await),
        sys::UBLK_IO_OP_WRITE_ZEROES => done(rung(efd, client.write_zeroes(offset, len as u64, fua)).await),
        _ => -libc::EOPNOTSUPP,
    }
}

async fn tag_task(q: &UblkQueue<'_>, tag: u16, client: &Client, efd: &Arc<WakeFd>) -> Result<(), UblkError> {
    if q.dev.dev_info.flags & u64::from(sys::UBLK_F_USER_COPY) != 0 {
        let cdev = q.dev.tgt.fds[0];
        let pos = UblkIOCtx::ublk_user_copy_pos(q.get_qid(), tag, 0);
        q.submit_io_prep_cmd(tag, BufDesc::Slice(&[]), 0, None).await?;
        loop {
            let iod = *q.get_iod(tag);
            let res = serve_one(q, &iod, Data::UserCopy { cdev, pos }, client, efd).await;
            q.submit_io_commit_cmd(tag, BufDesc::Slice(&[]), res).await?;
        }
    }
    let mut buf = IoBuf::<u8>::new(q.dev.dev_info.max_io_buf_bytes as usize);
    q.submit_io_prep_cmd(tag, BufDesc::Slice(buf.as_slice()), 0, Some(&buf)).await?;
    loop {
        let iod = *q.get_iod(tag);
        let res = serve_one(q, &iod, Data::Buf(&mut buf), client, efd).await;
        q.submit_io_commit_cmd(tag, BufDesc::Slice(buf.as_slice()), res).await?;
    }
}

/// Names of the ublk feature flags in `flags` (the device's, or the driver's).
pub fn feature_names(flags: u64) -> Vec<&'static str> {
    const NAMES: &[(u64, &str)] = &[
        (sys::UBLK_F_SUPPORT_ZERO_COPY as u64, "zero_copy"),
        (sys::UBLK_F_URING_CMD_COMP_IN_TASK as u64, "uring_cmd_comp_in_task"),
        (sys::UBLK_F_NEED_GET_DATA as u64, "need_get_data"),
        (sys::UBLK_F_USER_RECOVERY as u64, "user_recovery"),
        (sys::UBLK_F_USER_RECOVERY_REISSUE as u64, "user_recovery_reissue"),
        (sys::UBLK_F_UNPRIVILEGED_DEV as u64, "unprivileged_dev"),
        (sys::UBLK_F_CMD_IOCTL_ENCODE as u64, "cmd_ioctl_encode"),
        (sys::UBLK_F_USER_COPY as u64, "user_copy"),
        (sys::UBLK_F_ZONED as u64, "zoned"),
        (sys::UBLK_F_AUTO_BUF_REG as u64, "auto_buf_reg"),
    ];
    NAMES.iter().filter(|(bit, _)| flags & bit != 0).map(|(_, n)| *n).collect()
}

/// The body of one queue thread.
fn queue_thread(qid: u16, dev: &UblkDev, client: &Client) {
    // Blocking: the doorbell's READ in the ring must wait for a wake (see `WakeFd::blocking`).
    let efd = match WakeFd::blocking() {
        Ok(e) => Arc::new(e),
        Err(e) => return error!(queue = qid, "eventfd: {e}"),
    };
    let q = match UblkQueue::new(qid, dev) {
        Ok(q) => Rc::new(q),
        Err(e) => return error!(queue = qid, "ublk queue: {e}"),
    };
    let exe = Rc::new(smol::LocalExecutor::new());
    let mut tasks = Vec::new();
    for tag in 0..dev.dev_info.queue_depth {
        let (q, client, efd) = (Rc::clone(&q), client.clone(), Arc::clone(&efd));
        tasks.push(exe.spawn(async move {
            match tag_task(&q, tag, &client, &efd).await {
                Err(UblkError::QueueIsDown) | Ok(()) => {}
                Err(e) => error!(queue = qid, tag, "ublk tag task failed: {e}"),
            }
        }));
    }
    {
        let (q, efd) = (Rc::clone(&q), Arc::clone(&efd));
        exe.spawn(async move { doorbell(&q, &efd).await }).detach();
    }
    let (q2, exe2) = (Rc::clone(&q), Rc::clone(&exe));
    smol::block_on(exe.run(async move {
        let run_ops = || while exe2.try_tick() {};
        let is_done = || tasks.iter().all(|t| t.is_finished());
        if let Err(e) = libublk::wait_and_handle_io_events(&q2, Some(20), run_ops, is_done).await {
            error!(queue = qid, "ublk queue stopped: {e}");
        }
    }));
}

/// A `/dev/ublkbN` device for a [`Client`].
pub struct UblkDevice {
    client: Client,
    opts: UblkOptions,
    ctrl: UblkCtrl,
    /// Taken over from a dead server (START_USER_RECOVERY sent; `serve` ends the recovery).
    recovered: bool,
}

impl std::fmt::Debug for UblkDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UblkDevice").field("id", &self.id()).field("opts", &self.opts).finish_non_exhaustive()
    }
}

impl UblkDevice {
    /// Adds the device (not started yet: [`BlockFrontend::serve`] starts it).
    pub fn new(client: Client, opts: UblkOptions) -> Result<Self, FrontendError> {
        let offered = UblkCtrl::get_features().unwrap_or(0);
        info!("ublk driver offers {offered:#x} ({})", feature_names(offered).join(","));
        // USER_COPY saves a copy each way; libublk adds CMD_IOCTL_ENCODE where the driver has it.
        let mut wanted = u64::from(sys::UBLK_F_USER_COPY);
        if opts.recovery {
            // The device outlives this process: a new `attach --recover` takes it over, and the
            // requests the dead one had not answered are issued again to the new one.
            wanted |= u64::from(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE);
        }
        let ctrl_flags = offered & wanted;
        if opts.recovery && ctrl_flags & u64::from(sys::UBLK_F_USER_RECOVERY) == 0 {
            warn!("the ublk driver offers no user recovery: the device goes with this process");
        }
        let ctrl = UblkCtrlBuilder::default()
            .name("tyche")
            .id(opts.dev_id.map_or(-1, |id| id as i32))
            .nr_queues(opts.queues)
            .depth(opts.depth)
            .io_buf_bytes(IO_BUF_BYTES)
            .ctrl_flags(ctrl_flags)
            .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
            .build()
            .map_err(|e| FrontendError::Other(format!("creating the ublk device: {e}")))?;
        Ok(UblkDevice { client, opts, ctrl, recovered: false })
    }

    /// Takes over `/dev/ublkb{id}`, whose server died, for `client`: checks that the device was
    /// created with `UBLK_F_USER_RECOVERY` and has the export's size, then sends
    /// START_USER_RECOVERY (waiting, up to 30 s, until the kernel has quiesced the device and the
    /// dead server's files are closed). [`BlockFrontend::serve`] ends the recovery
    /// (END_USER_RECOVERY) once every queue is ready; I/O then resumes on the same device.
    pub fn recover(client: Client, id: u32) -> Result<Self, FrontendError> {
        let other = |m: String| FrontendError::Other(m);
        let old = UblkCtrl::new_simple(id as i32).map_err(|e| other(format!("ublk device {id}: {e}")))?;
        let info = old.dev_info();
        drop(old);
        if info.flags & u64::from(sys::UBLK_F_USER_RECOVERY) == 0 {
            return Err(other(format!(
                "/dev/ublkb{id} was created without user recovery ({}); it cannot be taken over",
                feature_names(info.flags).join(",")
            )));
        }
        let sectors: u64 = std::fs::read_to_string(format!("/sys/block/ublkb{id}/size"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| other(format!("/dev/ublkb{id}: cannot read its size from /sys/block/ublkb{id}/size")))?;
        if sectors << 9 != client.size() {
            return Err(other(format!(
                "/dev/ublkb{id} has {} bytes, export {:?} {}: not the device of this export",
                sectors << 9,
                client.info().export,
                client.size()
            )));
        }
        let state = match u32::from(info.state) {
            sys::UBLK_S_DEV_LIVE => "live",
            sys::UBLK_S_DEV_QUIESCED => "quiesced",
            _ => "dead",
        };
        info!(
            device = format_args!("/dev/ublkb{id}"),
            state,
            queues = info.nr_hw_queues,
            depth = info.queue_depth,
            "recovering the ublk device"
        );
        let ctrl = UblkCtrlBuilder::default()
            .name("tyche")
            .id(id as i32)
            .nr_queues(info.nr_hw_queues)
            .depth(info.queue_depth)
            .io_buf_bytes(IO_BUF_BYTES)
            .dev_flags(UblkFlags::UBLK_DEV_F_RECOVER_DEV)
            .build()
            .map_err(|e| other(format!("opening ublk device {id} for recovery: {e}")))?;
        // libublk retries EBUSY (the old server's files still open, or the kernel still
        // quiescing) for 30 s and then returns it.
        match ctrl.start_user_recover() {
            Ok(r) if r >= 0 => {}
            Ok(r) => {
                return Err(other(format!(
                    "START_USER_RECOVERY of /dev/ublkb{id}: {} (is its server still running?)",
                    std::io::Error::from_raw_os_error(-r)
                )))
            }
            Err(e) => return Err(other(format!("START_USER_RECOVERY of /dev/ublkb{id}: {e}"))),
        }
        let opts = UblkOptions { queues: info.nr_hw_queues, depth: info.queue_depth, recovery: true, dev_id: Some(id) };
        Ok(UblkDevice { client, opts, ctrl, recovered: true })
    }

    /// The kernel's device id.
    pub fn id(&self) -> u32 {
        self.ctrl.dev_info().dev_id
    }
}

impl BlockFrontend for UblkDevice {
    fn path(&self) -> String {
        format!("/dev/ublkb{}", self.id())
    }

    fn stopper(&self) -> Box<dyn FnOnce() + Send> {
        let id = self.id();
        Box::new(move || {
            if let Err(e) = stop(id) {
                error!("{e}");
            }
        })
    }

    fn serve(self: Box<Self>) -> Result<(), FrontendError> {
        let size = self.client.size();
        let discard = self.client.info().discard;
        let tgt_init = move |dev: &mut UblkDev| {
            dev.set_default_params(size);
            if discard {
                let p = &mut dev.tgt.params;
                p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
                p.discard = sys::ublk_param_discard {
                    discard_granularity: 4096,
                    max_discard_sectors: 1 << 16,
                    max_write_zeroes_sectors: 1 << 16,
                    max_discard_segments: 1,
                    ..Default::default()
                };
            }
            Ok(())
        };
        let client = self.client.clone();
        let nodes: Vec<u32> = client.nodes().to_vec();
        let q_fn = move |qid: u16, dev: &UblkDev| {
            // Each queue is served for one node: its requests go to that node's channels.
            let node = (!nodes.is_empty()).then(|| nodes[qid as usize % nodes.len()]);
            if let Some(cpus) = node.and_then(crate::sched::node_cpus) {
                if let Err(e) = tyche_numa::pin_current_thread(&cpus) {
                    error!(queue = qid, ?node, "cannot pin the queue thread: {e}");
                }
                // Buffers this thread allocates (read buffers, write copies) go on the node.
                if let Some(n) = node {
                    if let Err(e) = tyche_numa::alloc::bind_thread_memory(n) {
                        error!(queue = qid, node = n, "cannot bind the queue thread's memory: {e}");
                    }
                }
            }
            queue_thread(qid, dev, &client.on_node(node));
        };
        let queues = self.opts.queues;
        let recovered = self.recovered;
        let on_start = move |c: &UblkCtrl| {
            let features = feature_names(c.dev_info().flags).join(",");
            let features = if features.is_empty() { "none".to_string() } else { features };
            let device = format!("/dev/ublkb{}", c.dev_info().dev_id);
            if recovered {
                info!(device, queues, features, "ublk device recovered");
            } else {
                info!(device, queues, features, "ublk device started");
            }
        };
        let served = self
            .ctrl
            .run_target(tgt_init, q_fn, on_start)
            .map(drop)
            .map_err(|e| FrontendError::Other(format!("ublk device stopped: {e}")));
        if self.recovered {
            // libublk deletes only the devices it added; this one was taken over.
            let _ = self.ctrl.del_dev();
        }
        served
    }
}

/// Deletes a device by id whose server is gone (from `detach`, for a device left by a killed
/// `attach`). Requests the kernel still holds for it fail.
pub fn delete(id: u32) -> Result<(), FrontendError> {
    let ctrl = UblkCtrl::new_simple(id as i32).map_err(|e| FrontendError::Other(format!("ublk device {id}: {e}")))?;
    ctrl.del_dev().map(drop).map_err(|e| FrontendError::Other(format!("deleting ublk device {id}: {e}")))
}

/// The pid of the process serving device `id`, as the kernel knows it (set when the device
/// was started, and again by a recovery); `None` if there is no such device or none started it.
pub fn server_pid(id: u32) -> Option<i32> {
    let ctrl = UblkCtrl::new_simple(id as i32).ok()?;
    let pid = ctrl.dev_info().ublksrv_pid;
    (pid > 0).then_some(pid)
}

/// Stops a running device by id (from `detach`).
pub fn stop(id: u32) -> Result<(), FrontendError> {
    let ctrl = UblkCtrl::new_simple(id as i32).map_err(|e| FrontendError::Other(format!("ublk device {id}: {e}")))?;
    ctrl.kill_dev().map(drop).map_err(|e| FrontendError::Other(format!("stopping ublk device {id}: {e}")))
}
