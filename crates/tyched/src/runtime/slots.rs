//! The slot table: everything the target keeps per `damq` slot of a channel, under one owner.
//!
//! A slot is named by a [`SlotKey`] (session, channel, channel epoch, `damq` slot). For each it
//! holds the slot memory copied data goes through (or `None` while a storage job has it), the
//! write data kept in received frames ([`LentSegment`]s of `crate::job`, with their leases), the read data held
//! in lent transmit chunks ([`Region`]) until every frame of it is acknowledged, and whether
//! copied write data of a slot generation fell short (that write fails instead of writing
//! holes). Beside them it owns what those hold of each NIC's transport (leases to give back,
//! transmit chunks free or still in the kernel's hands) and the accounting: slot memory
//! allocated against `limits.slot_memory`, leases held, waits for memory.
//!
//! The table knows nothing of sessions: where it must know whether a slot is idle or its read
//! data acknowledged, the caller says so with a predicate over keys.

use std::collections::BTreeMap;

use rustc_hash::{FxHashMap, FxHashSet};

use tyche_channel::Pieces;
use tyche_transport::{FrameTransport, Lease, TxChunk};
use tyche_wire::Request;

use crate::backend::Memory;
use crate::job::{LentSegment, Region};

/// (session, channel, channel epoch, `damq` slot).
pub(super) type SlotKey = (u64, u16, u64, u16);

/// Write data of one `damq` slot kept in received frames (for request `tag`), by offset.
#[derive(Debug)]
struct LentSlot {
    tag: u64,
    /// The slot generation the segments were placed in.
    generation: u32,
    segs: BTreeMap<u32, LentSegment>,
}

/// What the table holds of one NIC's transport.
#[derive(Debug, Default)]
struct NicLending {
    /// Leases to give back (by the thread serving the NIC).
    release: Vec<Lease>,
    /// Transmit chunks its transport lent, free for read data.
    tx_free: Vec<TxChunk>,
    /// Chunks given up that the kernel may still be sending (checked by the NIC's thread
    /// before they are free again).
    tx_draining: Vec<TxChunk>,
}

/// A DATA segment of a write, as its channel handed it over: slot `key`, the request's `tag`
/// and slot `generation`, where it goes in the request's data (`offset`), and its bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct WriteSegment<'a, 'b> {
    pub(super) key: SlotKey,
    pub(super) tag: u64,
    pub(super) generation: u32,
    pub(super) offset: u32,
    pub(super) payload: &'a Pieces<'b>,
}

/// How [`SlotTable::place_write`] placed a DATA payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placed {
    /// The payload stays in its frame: the table holds the lease.
    Kept,
    /// Copied into slot memory (this many bytes); the frame may go back.
    Copied(usize),
    /// Not placed: a storage job holds the slot's memory. The write of this generation fails.
    SlotBusy,
    /// Not placed: no slot memory, or the payload lies outside it. The write of this
    /// generation fails when it executes.
    Short,
}

/// All per-slot state of the target (see the module documentation).
///
/// The maps use the Fx hash, not the default keyed SipHash: they are looked up for every frame,
/// and a peer cannot aim collisions at them (every key holds the session id, which the target
/// draws at random, and a peer reaches only its own sessions' slots, bounded by its channels'
/// `damq` slots).
#[derive(Debug)]
pub(super) struct SlotTable {
    /// Slot memory: `None` while a storage job holds it.
    memory: FxHashMap<SlotKey, Option<Memory>>,
    /// Write data kept in frames, per slot (beside or instead of the slot memory).
    lent: FxHashMap<SlotKey, LentSlot>,
    /// Read data held in transmit chunks, per slot, until all of it is acknowledged.
    regions: FxHashMap<SlotKey, Region>,
    /// Slots whose current read data went into a region (never sent from stale slot memory).
    in_region: FxHashSet<SlotKey>,
    /// Slots whose copied write data of this generation could not be kept (no slot memory):
    /// that write fails instead of running with holes.
    short: FxHashMap<SlotKey, u32>,
    /// Per NIC: leases to give back, transmit chunks free and draining.
    nics: Vec<NicLending>,
    /// Bytes of one slot's memory (`limits.max_io`).
    slot_len: usize,
    /// Slot memory allowed (`limits.slot_memory`).
    budget: u64,
    /// Slot memory allocated (at most `budget`).
    bytes: u64,
    /// Write segments kept in frames: in `lent` or in storage jobs.
    leases_held: u64,
    /// Times slot memory was wanted and the budget was spent.
    memory_waits: u64,
}

impl SlotTable {
    /// An empty table for `nics` NICs, slots of `slot_len` bytes, at most `budget` bytes.
    pub(super) fn new(nics: usize, slot_len: usize, budget: u64) -> SlotTable {
        SlotTable {
            memory: FxHashMap::default(),
            lent: FxHashMap::default(),
            regions: FxHashMap::default(),
            in_region: FxHashSet::default(),
            short: FxHashMap::default(),
            nics: (0..nics).map(|_| NicLending::default()).collect(),
            slot_len,
            budget,
            bytes: 0,
            leases_held: 0,
            memory_waits: 0,
        }
    }

    /// Transmit chunks NIC `k`'s transport lent for good, for read data.
    pub(super) fn lend_tx(&mut self, k: usize, chunks: Vec<TxChunk>) {
        self.nics[k].tx_free.extend(chunks);
    }

    /// Slot memory allocated now, in bytes.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Write segments kept in frames now (in the table or in storage jobs).
    pub(super) fn leases_held(&self) -> u64 {
        self.leases_held
    }

    /// Times slot memory was wanted and the budget was spent.
    pub(super) fn memory_waits(&self) -> u64 {
        self.memory_waits
    }

    /// Whether NIC `k` has read data held in transmit chunks.
    pub(super) fn has_regions(&self, k: usize) -> bool {
        self.regions.values().any(|r| r.nic == k)
    }

    /// The read data of request `tag` held in transmit chunks for slot `key`.
    pub(super) fn region(&self, key: &SlotKey, tag: u64) -> Option<&Region> {
        self.regions.get(key).filter(|r| r.tag == tag)
    }

    /// The data in slot `key`'s memory, unless the slot's current read data went into a region
    /// (or a job holds the memory).
    pub(super) fn data(&self, key: &SlotKey) -> Option<&[u8]> {
        match self.memory.get(key) {
            Some(Some(mem)) if !self.in_region.contains(key) => Some(mem.as_slice()),
            _ => None,
        }
    }

    // -------------------------------------------------------------------------------------
    // Slot memory.

    /// The budget permitting, one slot's memory (on `node`). When the budget is spent, memory
    /// that an idle slot holds (`idle` says which) is taken back first.
    pub(super) fn alloc(&mut self, node: Option<u32>, idle: impl Fn(&SlotKey) -> bool) -> Option<Memory> {
        let len = self.slot_len as u64;
        if self.bytes + len > self.budget {
            if let Some(mem) = self.take_idle(idle) {
                return Some(mem);
            }
            self.memory_waits += 1;
            return None;
        }
        self.bytes += len;
        Some(Memory::new(self.slot_len, node))
    }

    /// Memory of a slot that holds some and that `idle` says no request uses and no frame will
    /// be sent from; the slot is forgotten.
    fn take_idle(&mut self, idle: impl Fn(&SlotKey) -> bool) -> Option<Memory> {
        let key = *self.memory.iter().find_map(|(key, slot)| (slot.is_some() && idle(key)).then_some(key))?;
        self.memory.remove(&key).flatten()
    }

    /// Gives slot memory back to the budget.
    fn free(&mut self, mem: Memory) {
        self.bytes -= self.slot_len as u64;
        drop(mem);
    }

    /// Gives back a kept write segment's frame (to its NIC, by the thread serving it).
    fn release(&mut self, seg: LentSegment) {
        self.nics[seg.nic].release.push(seg.lease);
        self.leases_held -= 1;
    }

    /// Gives up read data in transmit chunks (free again once the kernel is done with them).
    fn drain(&mut self, region: Region) {
        self.nics[region.nic].tx_draining.extend(region.chunks);
    }

    // -------------------------------------------------------------------------------------
    // Receive: write data.

    /// Places segment `seg`, received on NIC `k`, in one piece or across the pieces of a
    /// multi-buffer frame. Kept in its frame when the transport lent it (`lease`), the lease
    /// covers every piece of the payload and the export writes from frames (`lend`); else
    /// copied into the slot's memory (allocated on `node` if the slot has none, `idle` naming
    /// slots whose memory may be taken back). Segments kept for another tag or slot generation
    /// (a write that never executed, early data of a refused request) or at this offset go back
    /// first. Returns how it went and the lease unless the frame is kept.
    pub(super) fn place_write(
        &mut self,
        seg: WriteSegment<'_, '_>,
        k: usize,
        lease: Option<Lease>,
        (lend, node): (bool, Option<u32>),
        idle: impl Fn(&SlotKey) -> bool,
    ) -> (Placed, Option<Lease>) {
        let WriteSegment { key, tag, generation, offset, payload } = seg;
        let mut stale = Vec::new();
        if let Some(ls) = self.lent.get_mut(&key) {
            if ls.tag != tag || ls.generation != generation {
                ls.tag = tag;
                ls.generation = generation;
                stale.extend(std::mem::take(&mut ls.segs).into_values());
            } else {
                stale.extend(ls.segs.remove(&offset));
            }
        }
        for seg in stale {
            self.release(seg);
        }
        let lease = match lease {
            Some(lease) if lend && payload.parts().iter().all(|p| lease.covers(p)) => {
                let ls = self.lent.entry(key).or_insert_with(|| LentSlot { tag, generation, segs: BTreeMap::new() });
                let seg = LentSegment::new(offset, payload, k, lease);
                ls.segs.insert(offset, seg);
                self.leases_held += 1;
                return (Placed::Kept, None);
            }
            lease => lease,
        };
        match self.memory.get(&key) {
            Some(Some(_)) => {}
            Some(None) => {
                // Held by a storage job (cannot happen: the channel refuses data for a slot
                // whose request executes); never write under it.
                self.short.insert(key, generation);
                return (Placed::SlotBusy, lease);
            }
            None => match self.alloc(node, idle) {
                Some(mem) => {
                    self.memory.insert(key, Some(mem));
                }
                None => {
                    // No memory to copy into: the write of this slot generation fails with an
                    // I/O error when it executes (its data is incomplete).
                    self.short.insert(key, generation);
                    return (Placed::Short, lease);
                }
            },
        }
        let Some(Some(mem)) = self.memory.get_mut(&key) else { return (Placed::Short, lease) };
        let o = offset as usize;
        match mem.as_mut_slice().get_mut(o..o + payload.len()) {
            Some(place) => {
                let mut at = 0;
                for part in payload.parts() {
                    place[at..at + part.len()].copy_from_slice(part);
                    at += part.len();
                }
            }
            None => {
                self.short.insert(key, generation);
                return (Placed::Short, lease);
            }
        }
        (Placed::Copied(payload.len()), lease)
    }

    // -------------------------------------------------------------------------------------
    // Storage jobs.

    /// Slot `key` is reused by `request` (of slot generation `generation`): read data of its
    /// previous request is not needed, and write data kept for another request goes back.
    /// Returns the write data kept in frames for this one, and whether copied data of it fell
    /// short.
    pub(super) fn reuse(&mut self, key: SlotKey, request: &Request, generation: u32) -> (Vec<LentSegment>, bool) {
        if let Some(old) = self.regions.remove(&key) {
            self.drain(old);
        }
        self.in_region.remove(&key);
        let mut lent = Vec::new();
        if let Some(ls) = self.lent.remove(&key) {
            if request.op == tyche_wire::Op::Write && ls.tag == request.tag && ls.generation == generation {
                lent = ls.segs.into_values().collect();
            } else {
                for seg in ls.segs.into_values() {
                    self.release(seg);
                }
            }
        }
        let short = self.short.remove(&key) == Some(generation);
        (lent, short)
    }

    /// `need` free transmit chunks of NIC `k` for the read data of request `tag` in slot `key`
    /// (segments of `seg` bytes), if it has that many.
    pub(super) fn take_region(&mut self, key: SlotKey, k: usize, need: usize, seg: u32, tag: u64) -> Option<Region> {
        let free = &mut self.nics[k].tx_free;
        if free.len() < need {
            return None;
        }
        let chunks = free.split_off(free.len() - need);
        self.in_region.insert(key);
        Some(Region { chunks, seg, nic: k, tag })
    }

    /// Slot `key`'s memory for a storage job (the slot stays, marked held), allocating it on
    /// `node` if the slot has none. `None` when there is no memory to be had.
    pub(super) fn take_for_job(
        &mut self,
        key: SlotKey,
        node: Option<u32>,
        idle: impl Fn(&SlotKey) -> bool,
    ) -> Option<Memory> {
        let mem = match self.memory.get_mut(&key).and_then(Option::take) {
            Some(mem) => mem,
            None => self.alloc(node, idle)?,
        };
        self.memory.entry(key).or_insert(None);
        Some(mem)
    }

    /// Slot `key`'s memory, if it holds some, for a storage job (the slot stays, marked held).
    pub(super) fn take_memory(&mut self, key: &SlotKey) -> Option<Memory> {
        self.memory.get_mut(key).and_then(Option::take)
    }

    /// A write that cannot run: its kept frames go back, and the slot memory it took (if any)
    /// goes back to the slot.
    pub(super) fn cancel(&mut self, key: SlotKey, lent: Vec<LentSegment>, mem: Option<Memory>) {
        for seg in lent {
            self.release(seg);
        }
        if let Some(mem) = mem {
            self.memory.insert(key, Some(mem));
        }
    }

    /// A storage job on slot `key` ended: its kept frames go back; its read data in transmit
    /// chunks and its slot memory return to the slot when the job's channel still `live`s to
    /// send them (the chunks only if it succeeded, `ok`), else they are given up.
    pub(super) fn job_ended(
        &mut self,
        key: SlotKey,
        lent: Vec<LentSegment>,
        region: Option<Region>,
        mem: Option<Memory>,
        live: bool,
        ok: bool,
    ) {
        for seg in lent {
            self.release(seg);
        }
        if let Some(region) = region {
            if live && ok {
                if let Some(old) = self.regions.insert(key, region) {
                    self.drain(old);
                }
            } else {
                self.drain(region);
            }
        }
        if let Some(mem) = mem {
            match self.memory.get_mut(&key) {
                Some(slot @ None) if live => *slot = Some(mem),
                _ => {
                    if self.memory.get(&key).is_some_and(Option::is_none) {
                        self.memory.remove(&key);
                    }
                    self.free(mem);
                }
            }
        }
    }

    /// A storage job already answered (at its deadline) ended: everything it held goes back.
    pub(super) fn job_dropped(&mut self, lent: Vec<LentSegment>, region: Option<Region>, mem: Option<Memory>) {
        for seg in lent {
            self.release(seg);
        }
        if let Some(region) = region {
            self.drain(region);
        }
        if let Some(mem) = mem {
            self.free(mem);
        }
    }

    // -------------------------------------------------------------------------------------
    // Channels and sessions going away, and NICs getting their memory back.

    /// Drops the slots `gone` names (their channel or session went): slot memory (memory a job
    /// holds goes when the job finishes), kept write data, read data in transmit chunks.
    pub(super) fn drop_where(&mut self, gone: impl Fn(&SlotKey) -> bool) {
        let keys: Vec<SlotKey> = self.memory.keys().filter(|key| gone(key)).copied().collect();
        for key in keys {
            if let Some(Some(mem)) = self.memory.remove(&key) {
                self.free(mem);
            }
        }
        self.short.retain(|key, _| !gone(key));
        self.release_lent_where(gone);
    }

    /// Releases the kept write data and read data in transmit chunks of the slots `gone` names.
    pub(super) fn release_lent_where(&mut self, gone: impl Fn(&SlotKey) -> bool) {
        let keys: Vec<SlotKey> = self.regions.keys().filter(|key| gone(key)).copied().collect();
        for key in keys {
            let region = self.regions.remove(&key).expect("listed");
            self.drain(region);
        }
        self.in_region.retain(|key| !gone(key));
        let keys: Vec<SlotKey> = self.lent.keys().filter(|key| gone(key)).copied().collect();
        for key in keys {
            let ls = self.lent.remove(&key).expect("listed");
            for seg in ls.segs.into_values() {
                self.release(seg);
            }
        }
    }

    /// Gives NIC `k`'s transport back the frames it lent that are no longer needed; read data
    /// on NIC `k` every frame of which is acknowledged (`acked` says which slots) gives its
    /// chunks up, and chunks the kernel is done with are free again. Returns how many are free.
    pub(super) fn give_back(
        &mut self,
        k: usize,
        transport: &mut dyn FrameTransport,
        acked: impl Fn(&SlotKey) -> bool,
    ) -> usize {
        for lease in self.nics[k].release.drain(..) {
            transport.release(lease);
        }
        // Every turn: regions done move their chunks in place (no list of keys is built); the
        // only allocation left is the transport's list of busy chunks, asked only while some
        // chunks are draining.
        let nic = &mut self.nics[k];
        self.regions.retain(|key, r| {
            if r.nic != k || !acked(key) {
                return true;
            }
            nic.tx_draining.append(&mut r.chunks);
            false
        });
        if !nic.tx_draining.is_empty() {
            // The chunks the kernel still has: few (a transmit ring's worth at most).
            let busy = transport.tx_chunks_in_flight();
            let mut i = 0;
            while i < nic.tx_draining.len() {
                if busy.contains(&nic.tx_draining[i].id()) {
                    i += 1;
                } else {
                    nic.tx_free.push(nic.tx_draining.swap_remove(i));
                }
            }
        }
        nic.tx_free.len()
    }

    /// Where the slot memory of channel `ch` (instance `epoch`) of session `sid` is, against
    /// `node`.
    pub(super) fn pages(&self, sid: u64, ch: u16, epoch: u64, node: Option<u32>) -> tyche_numa::PageCounts {
        let mut c = tyche_numa::PageCounts { expected_node: node, ..Default::default() };
        for (key, slot) in &self.memory {
            if key.0 == sid && key.1 == ch && key.2 == epoch {
                if let Some(mem) = slot {
                    if let Ok(p) = tyche_numa::report::count_slice(mem.as_slice(), node) {
                        c.add(&p);
                    }
                }
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tyche_wire::{MacAddr, Op, Request};

    use super::*;

    const LEN: usize = 4096;

    fn write(tag: u64, damq: u16, length: u32) -> Request {
        Request {
            seq: tyche_wire::Seq::default(),
            op: Op::Write,
            fua: false,
            remq: 0,
            damq,
            home: 0,
            tag,
            floor: 0,
            offset: 0,
            length,
        }
    }

    /// A received frame (kept alive by the lease) and its lease.
    fn frame(id: u64, bytes: Vec<u8>) -> (Arc<Vec<u8>>, Lease) {
        let mem = Arc::new(bytes);
        // SAFETY: the Arc keeps the bytes, and nothing writes them.
        let lease = unsafe { Lease::new(id, &mem[..], Arc::clone(&mem) as Arc<dyn std::any::Any + Send + Sync>) };
        (mem, lease)
    }

    #[test]
    fn memory_stays_within_the_budget_and_comes_back() {
        let mut t = SlotTable::new(1, LEN, 2 * LEN as u64);
        let never = |_: &SlotKey| false;
        for damq in 0..2 {
            let (placed, _) = t.place_write(
                WriteSegment {
                    key: (1, 0, 0, damq),
                    tag: 7,
                    generation: 1,
                    offset: 0,
                    payload: &Pieces::one(&[1; 512]),
                },
                0,
                None,
                (false, None),
                never,
            );
            assert_eq!(placed, Placed::Copied(512));
        }
        assert_eq!(t.bytes(), 2 * LEN as u64);
        // A third slot finds the budget spent and no idle slot: that write falls short.
        let (placed, _) = t.place_write(
            WriteSegment { key: (1, 0, 0, 2), tag: 8, generation: 1, offset: 0, payload: &Pieces::one(&[1; 512]) },
            0,
            None,
            (false, None),
            never,
        );
        assert_eq!(placed, Placed::Short);
        assert_eq!(t.memory_waits(), 1);
        let (_, short) = t.reuse((1, 0, 0, 2), &write(8, 2, 512), 1);
        assert!(short, "the write whose data was not kept fails");
        // An idle slot's memory is taken back for a new one, within the budget.
        let (placed, _) = t.place_write(
            WriteSegment { key: (1, 0, 0, 3), tag: 9, generation: 1, offset: 0, payload: &Pieces::one(&[1; 512]) },
            0,
            None,
            (false, None),
            |k: &SlotKey| k.3 == 0,
        );
        assert_eq!(placed, Placed::Copied(512));
        assert_eq!(t.bytes(), 2 * LEN as u64);
        // The session goes: all of it is free again.
        t.drop_where(|k| k.0 == 1);
        assert_eq!(t.bytes(), 0);
        assert!(t.memory.is_empty() && t.short.is_empty());
    }

    #[test]
    fn copied_data_outside_the_slot_is_short_never_written() {
        let mut t = SlotTable::new(1, LEN, 4 * LEN as u64);
        let key = (1, 0, 0, 0);
        let (placed, _) = t.place_write(
            WriteSegment { key, tag: 7, generation: 3, offset: LEN as u32 - 10, payload: &Pieces::one(&[1; 20]) },
            0,
            None,
            (false, None),
            |_| false,
        );
        assert_eq!(placed, Placed::Short);
        // Another generation of the slot is not affected.
        let (_, short) = t.reuse(key, &write(7, 0, 512), 4);
        assert!(!short);
    }

    #[test]
    fn kept_frames_are_counted_and_all_go_back() {
        let mut t = SlotTable::new(2, LEN, 4 * LEN as u64);
        let key = (5, 1, 0, 3);
        let mut frames = Vec::new();
        for (i, nic) in [(0u32, 0usize), (1, 1), (2, 0)] {
            let (mem, lease) = frame(i as u64, vec![0xab; 1024]);
            let (placed, back) = t.place_write(
                WriteSegment { key, tag: 11, generation: 2, offset: i * 512, payload: &Pieces::one(&mem[..512]) },
                nic,
                Some(lease),
                (true, None),
                |_| false,
            );
            assert_eq!(placed, Placed::Kept);
            assert!(back.is_none());
            frames.push(mem);
        }
        assert_eq!(t.leases_held(), 3);
        // The same offset again replaces the segment there: the old frame goes back first.
        let (mem, lease) = frame(9, vec![0xcd; 1024]);
        let (placed, _) = t.place_write(
            WriteSegment { key, tag: 11, generation: 2, offset: 512, payload: &Pieces::one(&mem[..512]) },
            0,
            Some(lease),
            (true, None),
            |_| false,
        );
        assert_eq!(placed, Placed::Kept);
        assert_eq!(t.leases_held(), 3);
        assert_eq!(t.nics[1].release.len(), 1);
        // Data of another generation of the slot drops the kept segments of the old one.
        let (lent, short) = t.reuse(key, &write(11, 3, 1536), 3);
        assert!(lent.is_empty() && !short);
        assert_eq!(t.leases_held(), 0);
        assert_eq!(t.nics[0].release.len() + t.nics[1].release.len(), 4);
        // A payload the lease does not cover is copied, and the frame comes straight back.
        let (_, lease) = frame(10, vec![0; 16]);
        let (placed, back) = t.place_write(
            WriteSegment { key, tag: 12, generation: 1, offset: 0, payload: &Pieces::one(&[3; 64]) },
            0,
            Some(lease),
            (true, None),
            |_| false,
        );
        assert_eq!(placed, Placed::Copied(64));
        assert!(back.is_some());
        t.drop_where(|k| k.0 == 5);
        assert_eq!((t.bytes(), t.leases_held()), (0, 0));
    }

    #[test]
    fn read_data_in_transmit_chunks_gives_them_back_once_acknowledged() {
        let (_peer, mut port) = tyche_transport::MemLink::pair((MacAddr::local(1), MacAddr::local(2)), 3000, 4096, 8);
        port.set_tx_lending(4);
        let mut t = SlotTable::new(1, LEN, 4 * LEN as u64);
        t.lend_tx(0, port.lend_tx_chunks(usize::MAX));
        let key = (1, 0, 0, 0);
        assert!(t.take_region(key, 0, 5, 2048, 7).is_none(), "more chunks than are free");
        let region = t.take_region(key, 0, 2, 2048, 7).expect("two free");
        assert!(t.data(&key).is_none(), "read data in a region is never sent from slot memory");
        // The read succeeded on a live channel: its chunks hold the data until acknowledged.
        t.job_ended(key, Vec::new(), Some(region), None, true, true);
        assert!(t.region(&key, 7).is_some() && t.region(&key, 8).is_none());
        assert!(t.has_regions(0));
        assert_eq!(t.give_back(0, &mut port, |_| false), 2);
        assert_eq!(t.give_back(0, &mut port, |_| true), 4);
        assert!(!t.has_regions(0));
        // A region whose channel went away, or whose read failed, comes straight back.
        let region = t.take_region(key, 0, 3, 2048, 8).expect("three free");
        t.job_ended(key, Vec::new(), Some(region), None, false, true);
        let region = t.take_region((1, 0, 0, 1), 0, 1, 2048, 9).expect("one free");
        t.job_ended((1, 0, 0, 1), Vec::new(), Some(region), None, true, false);
        assert_eq!(t.give_back(0, &mut port, |_| false), 4);
        // So does one of a slot dropped with its session.
        let region = t.take_region(key, 0, 4, 2048, 10).expect("four free");
        t.job_ended(key, Vec::new(), Some(region), None, true, true);
        t.drop_where(|k| k.0 == 1);
        assert_eq!(t.give_back(0, &mut port, |_| false), 4);
        assert!(t.in_region.is_empty());
    }

    #[test]
    fn a_job_returns_its_memory_to_a_live_slot_and_frees_it_otherwise() {
        let mut t = SlotTable::new(1, LEN, 4 * LEN as u64);
        let key = (1, 0, 0, 0);
        let mem = t.take_for_job(key, None, |_| false).expect("budget");
        assert_eq!(t.bytes(), LEN as u64);
        assert!(t.data(&key).is_none(), "held by the job");
        t.job_ended(key, Vec::new(), None, Some(mem), true, true);
        assert!(t.data(&key).is_some(), "back in its slot");
        let mem = t.take_memory(&key).expect("memory");
        t.job_ended(key, Vec::new(), None, Some(mem), false, true);
        assert!(t.memory.is_empty());
        assert_eq!(t.bytes(), 0);
    }
}
