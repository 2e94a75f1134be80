use std::collections::HashMap;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use tokio::sync::oneshot;
use tyche_wire::Op;

use crate::bell::Bell;
use crate::buf::Buf;
use crate::config::{InitiatorConfig, Link, SendMode};
use crate::engine::{Cmd, Completion, IoCmd, Shared, Started};
use crate::engine_front::Front;
use crate::error::{ConnectError, Error};
use crate::export_info::ExportInfo;
use crate::stats::Stats;

#[derive(Debug)]
struct Inner {
    /// Each engine thread's command queue and bell; the first one takes the session commands.
    engines: Vec<(Sender<Cmd>, Arc<Bell>)>,
    /// The engine thread serving each node's links.
    node_engine: Vec<(Option<u32>, usize)>,
    /// Queue mode: one queue per node (key `None` for requests of unknown node).
    queues: HashMap<Option<u32>, Sender<IoCmd>>,
    info: ExportInfo,
    /// Distinct NUMA nodes of the links' NICs.
    nodes: Vec<u32>,
    /// The send mode.
    mode: SendMode,
    /// What the engine threads share: inline mode submits and sends through it.
    shared: Arc<Shared>,
}

/// An async handle to an attached export. Cheap to clone; the session closes when the last
/// clone is dropped or [`Client::close`] is called.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
    node: Option<u32>,
}

/// Submitter thread of queue mode: drains its node's queue and hands batches to the engine.
fn submitter(rx: std::sync::mpsc::Receiver<IoCmd>, engine: Sender<Cmd>, bell: Arc<Bell>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(io) => batch.push(io),
                Err(_) => break,
            }
        }
        if engine.send(Cmd::Batch(batch)).is_err() {
            return;
        }
        bell.ring();
    }
}

/// The engine thread for requests whose buffers are on `node`: the one serving that node's
/// links, else the first.
fn engine_for(node_engine: &[(Option<u32>, usize)], node: Option<u32>) -> usize {
    node_engine.iter().find(|(n, _)| *n == node).map_or(0, |(_, g)| *g)
}

/// Opens the session and starts the engine threads (blocking version of [`crate::connect`]).
pub fn connect_blocking(cfg: InitiatorConfig, links: Vec<Link>) -> Result<Client, ConnectError> {
    crate::engine::start(cfg, links).and_then(Client::new)
}

impl Client {
    /// The client of a started session; in queue mode, with a submitter thread per node (an
    /// OS refusal to start one fails the connect; the engine threads stop with the session).
    fn new(started: Started) -> Result<Self, ConnectError> {
        let Started { engines, node_engine, info, mode, nodes, shared } = started;
        let mut queues = HashMap::new();
        if mode == SendMode::Queue {
            let mut keys: Vec<Option<u32>> = nodes.clone();
            keys.push(None);
            keys.sort_unstable();
            keys.dedup();
            for node in keys {
                let (tx, rx) = std::sync::mpsc::channel();
                let (engine, bell) = &engines[engine_for(&node_engine, node)];
                let (engine, bell) = (engine.clone(), Arc::clone(bell));
                let name = node.map_or("tyche-submit".to_owned(), |n| format!("tyche-submit{n}"));
                std::thread::Builder::new()
                    .name(name)
                    .spawn(move || submitter(rx, engine, bell))
                    .map_err(|e| ConnectError::Os { what: "start a submitter thread", source: e })?;
                queues.insert(node, tx);
            }
        }
        let mut known: Vec<u32> = nodes.iter().flatten().copied().collect();
        known.sort_unstable();
        known.dedup();
        Ok(Client {
            inner: Arc::new(Inner { engines, node_engine, queues, info, nodes: known, mode, shared }),
            node: None,
        })
    }

    /// A handle whose requests say their buffers live on NUMA node `node` (the scheduler sends
    /// them to channels on that node).
    pub fn on_node(&self, node: Option<u32>) -> Client {
        Client { inner: Arc::clone(&self.inner), node }
    }

    /// The NUMA nodes of the links' NICs (empty when unknown).
    pub fn nodes(&self) -> &[u32] {
        &self.inner.nodes
    }

    /// The send mode the session was opened with.
    pub fn send_mode(&self) -> SendMode {
        self.inner.mode
    }

    /// What was attached.
    pub fn info(&self) -> &ExportInfo {
        &self.inner.info
    }

    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.info.size
    }

    async fn io(&self, op: Op, fua: bool, offset: u64, length: u64, data: Vec<u8>) -> Result<Vec<u8>, Error> {
        let (reply, rx) = oneshot::channel();
        let io =
            IoCmd { op, fua, offset, length, data: Buf::Heap(data), node: self.node, reply: Completion::Client(reply) };
        let sent = match self.inner.queues.get(&self.node).or_else(|| self.inner.queues.get(&None)) {
            Some(q) => q.send(io).is_ok(),
            None => {
                // Inline: this thread submits and sends (a closed session fails the request).
                self.inner.shared.submit_inline(io);
                true
            }
        };
        if !sent {
            return Err(Error::Closed);
        }
        rx.await.unwrap_or(Err(Error::Closed))
    }

    /// Reads `length` bytes at `offset` (both multiples of 512). The buffer is allocated, and
    /// its pages touched, by the calling thread, so it sits on that thread's NUMA node (under
    /// its memory policy) before the engine places the data into it.
    pub async fn read(&self, offset: u64, length: usize) -> Result<Vec<u8>, Error> {
        let mut buf = vec![0u8; length];
        // A zeroed allocation may be untouched pages: fault each one in here, not in the engine.
        for i in (0..length).step_by(4096) {
            buf[i] = std::hint::black_box(0);
        }
        self.io(Op::Read, false, offset, length as u64, buf).await
    }

    /// Writes `data` at `offset` (offset and length multiples of 512). The data is copied (and
    /// counted in `payload_copied_bytes`); [`Client::write_owned`] moves a buffer in instead.
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.count_copied(data.len(), true);
        self.write_owned(offset, data.to_vec(), false).await
    }

    /// Counts `bytes` of payload a front end copied on its own thread (`write`: write data), in
    /// the session's `payload_copied_bytes`.
    pub(crate) fn count_copied(&self, bytes: usize, write: bool) {
        self.inner.shared.count_front_copy(bytes as u64, write);
    }

    /// Writes `data` at `offset`, moving the buffer in; with `fua` the data is durable when
    /// this returns.
    pub async fn write_owned(&self, offset: u64, data: Vec<u8>, fua: bool) -> Result<(), Error> {
        let len = data.len() as u64;
        self.io(Op::Write, fua, offset, len, data).await.map(drop)
    }

    /// Makes every completed write durable.
    pub async fn flush(&self) -> Result<(), Error> {
        self.io(Op::Flush, false, 0, 0, Vec::new()).await.map(drop)
    }

    /// Deallocates a range (later reads return zeroes).
    pub async fn discard(&self, offset: u64, length: u64) -> Result<(), Error> {
        if !self.inner.info.discard {
            return Err(Error::Unsupported);
        }
        self.io(Op::Discard, false, offset, length, Vec::new()).await.map(drop)
    }

    /// Which parts of `offset..offset + length` (multiples of 512) are allocated: extents from
    /// `offset` on, covering at most `length` bytes (a target may cover less; ask again from
    /// where they end). The target's list is checked ([`tyche_wire::BlockStatusList::parse`]): a
    /// malformed one is [`Error::BadReply`]. A target that cannot tell (or lacks the feature)
    /// answers `Error::Target(Status::Unsupported)`.
    pub async fn block_status(&self, offset: u64, length: u64) -> Result<Vec<tyche_wire::Extent>, Error> {
        let buf = vec![0u8; tyche_wire::layout::block_status::LEN];
        let list = self.io(Op::BlockStatus, false, offset, length, buf).await?;
        parse_block_status(&list, length)
    }

    /// Writes zeroes over a range without sending data.
    pub async fn write_zeroes(&self, offset: u64, length: u64, fua: bool) -> Result<(), Error> {
        self.io(Op::WriteZeroes, fua, offset, length, Vec::new()).await.map(drop)
    }

    /// Session counters.
    pub async fn stats(&self) -> Result<Stats, Error> {
        let (tx, rx) = oneshot::channel();
        self.session_cmd(Cmd::Stats(tx))?;
        rx.await.map_err(|_| Error::Closed)
    }

    /// Counters, per channel payload bytes and placement of the session (see [`crate::Report`]).
    pub async fn report(&self) -> Result<crate::Report, Error> {
        let (tx, rx) = oneshot::channel();
        self.session_cmd(Cmd::Report(tx))?;
        rx.await.map_err(|_| Error::Closed)
    }

    /// [`Client::report`] for threads outside an async runtime (a stats socket thread).
    pub fn report_blocking(&self) -> Result<crate::Report, Error> {
        let (tx, rx) = oneshot::channel();
        self.session_cmd(Cmd::Report(tx))?;
        rx.blocking_recv().map_err(|_| Error::Closed)
    }

    /// Closes the session: new requests fail, requests in flight get up to 5 s to finish, every
    /// channel sends DISCONNECT. Returns when the engine has stopped.
    pub async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.session_cmd(Cmd::Close(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Hands a front end to the engine thread of this handle's node, which serves it from then
    /// on (see [`crate::engine_front`]). It starts first, on the calling thread ([`Front::start`]: in
    /// queue send mode a reader thread of its own, on the calling thread's CPUs and memory
    /// policy, may read its requests and hand them over).
    pub(crate) fn serve_front(&self, mut front: Box<dyn Front>) -> std::io::Result<()> {
        let g = engine_for(&self.inner.node_engine, self.node);
        let (engine, bell) = &self.inner.engines[g];
        front.start(self.inner.mode, bell)?;
        if let Err(std::sync::mpsc::SendError(Cmd::Front(front))) = engine.send(Cmd::Front(front)) {
            // The session is over: the front end's reader thread (if any) stops.
            front.close(true);
            return Err(std::io::Error::other(Error::Closed.to_string()));
        }
        bell.ring();
        Ok(())
    }

    /// Hands a command about the whole session to the first engine thread.
    fn session_cmd(&self, cmd: Cmd) -> Result<(), Error> {
        let (engine, bell) = &self.inner.engines[0];
        engine.send(cmd).map_err(|_| Error::Closed)?;
        bell.ring();
        Ok(())
    }
}

/// Checks a block status list the target sent for a BLOCK_STATUS of `length` bytes.
pub(crate) fn parse_block_status(list: &[u8], length: u64) -> Result<Vec<tyche_wire::Extent>, Error> {
    let requested = u32::try_from(length).map_err(|_| Error::BadReply)?;
    match tyche_wire::BlockStatusList::parse(list, requested) {
        Ok(l) => Ok(l.iter().collect()),
        Err(e) => {
            tracing::warn!("the target sent a malformed block status list: {e}");
            Err(Error::BadReply)
        }
    }
}
