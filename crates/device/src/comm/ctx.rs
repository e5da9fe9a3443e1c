//! A CTA's view of the communicator: its rank, the peers' heaps and its epoch.
use crate::arch::{ids, memory, memory::Scope};
use mkernel_config::comm::{flag_offset, CommDesc, FlagSlot, Role, EPOCH_COUNTERS_OFFSET};
use mkernel_config::comm::{ll_offset, staging_offset};

/// What one CTA of a communication kernel knows.
#[derive(Clone, Copy)]
pub struct CommCtx {
    pub rank: u32,
    pub world: u32,
    pub timeout_ns: u64,
    /// The descriptor in global memory (peer heap bases are read from it, not copied: a copy
    /// indexed by a run-time rank would live on the stack).
    desc: *const CommDesc,
    /// Index of this CTA among the CTAs that share flags (its slice of the work).
    pub cta: u32,
    /// Role of this CTA (for error records).
    pub role: Role,
    /// This launch's epoch for this CTA: its counter + 1.
    pub epoch: u64,
    /// This rank in the whole job, and the job's size.
    pub global_rank: u32,
    pub global_world: u32,
    /// Device address of the host-mapped proxy FIFO (0 on a single node) and its slots.
    pub fifo: u64,
    pub fifo_capacity: u32,
    /// Which epoch sequence `epoch` counts (`mkernel_config::comm::fifo::EPOCH_SEQ_*`), sent
    /// with proxy commands.
    pub epoch_seq: u32,
}

impl CommCtx {
    /// Reads the descriptor and this CTA's epoch counter. Every thread reads the counter; it is
    /// advanced by [`CommCtx::finish`] after a CTA barrier, so all threads see the same value.
    ///
    /// # Safety
    ///
    /// `desc` meets the communicator contract (`crate::comm`), and `cta` is this CTA's index among the CTAs that share
    /// flags (its epoch counter is `EPOCH_COUNTERS_OFFSET + 8 * cta` of this rank's heap); every thread of the CTA
    /// calls it before the counter is advanced by [`CommCtx::finish`].
    #[inline(always)]
    pub unsafe fn new(desc: *const CommDesc, cta: u32, role: Role) -> CommCtx {
        let d = unsafe { &*desc };
        let local = unsafe { *d.heaps.as_ptr().add(d.rank as usize) };
        let counter = (local + EPOCH_COUNTERS_OFFSET + 8 * cta as u64) as *const u64;
        let epoch = unsafe { counter.read_volatile() } + 1;
        unsafe { Self::with_epoch(desc, cta, role, epoch) }
    }

    /// As [`CommCtx::new`] with a known `epoch` (no read of the counter): for loops that
    /// rebuild the context instead of keeping it in registers.
    ///
    /// # Safety
    ///
    /// `desc` meets the communicator contract (`crate::comm`) and `cta` is this CTA's flag index; `epoch` is this
    /// launch's epoch for that CTA (as [`CommCtx::new`] read it), or 0 where the context only writes an error record.
    #[inline(always)]
    pub unsafe fn with_epoch(desc: *const CommDesc, cta: u32, role: Role, epoch: u64) -> CommCtx {
        let d = unsafe { &*desc };
        CommCtx {
            rank: d.rank,
            world: d.world,
            timeout_ns: d.timeout_ns,
            desc,
            cta,
            role,
            epoch,
            global_rank: d.global_rank,
            global_world: d.global_world,
            fifo: d.fifo,
            fifo_capacity: d.fifo_capacity,
            epoch_seq: mkernel_config::comm::fifo::EPOCH_SEQ_COLLECTIVES,
        }
    }
    /// The descriptor's address.
    #[inline(always)]
    pub fn desc_addr(&self) -> u64 {
        self.desc as u64
    }
    /// This rank in the whole job, read from the descriptor now (volatile): for cold paths
    /// such as error records, so that no register keeps it across the waits they follow.
    #[inline(always)]
    pub fn global_rank_now(&self) -> u32 {
        unsafe { (&raw const (*self.desc).global_rank).read_volatile() }
    }
    /// This rank on its node, read from the descriptor now (volatile; as
    /// [`CommCtx::global_rank_now`]).
    #[inline(always)]
    pub fn rank_now(&self) -> u32 {
        unsafe { (&raw const (*self.desc).rank).read_volatile() }
    }
    /// Base address of `rank`'s heap (this rank's own heap for `rank == self.rank`).
    #[inline(always)]
    pub fn heap(&self, rank: u32) -> u64 {
        unsafe { *(*self.desc).heaps.as_ptr().add(rank as usize) }
    }
    /// The flag `(slot, src, self.cta)` in `owner`'s heap.
    #[inline(always)]
    pub fn flag(&self, owner: u32, slot: FlagSlot, src: u32) -> *mut u64 {
        self.flag_of_cta(owner, slot, src, self.cta)
    }
    /// The flag `(slot, src, cta)` in `owner`'s heap.
    #[inline(always)]
    pub fn flag_of_cta(&self, owner: u32, slot: FlagSlot, src: u32, cta: u32) -> *mut u64 {
        (self.heap(owner) + flag_offset(slot, src, cta)) as *mut u64
    }
    /// Raises `slot` for this epoch in `dst`'s heap: `st.release.sys`. Call from one thread after
    /// a CTA barrier that follows the data this flag publishes; the release is cumulative over
    /// the CTA's writes ordered before it by the barrier.
    ///
    /// # Safety
    ///
    /// The communicator contract (`crate::comm`) and `dst < world`; the caller is one thread, after a CTA barrier that
    /// follows the data the flag publishes.
    #[inline(always)]
    pub unsafe fn signal(&self, dst: u32, slot: FlagSlot) {
        unsafe { memory::st_release_u64(Scope::Sys, self.flag(dst, slot, self.rank), self.epoch) };
    }
    /// Address of the LL slot `src` writes into in `owner`'s heap during this epoch.
    #[inline(always)]
    pub fn ll_slot(&self, owner: u32, src: u32) -> u64 {
        self.heap(owner) + ll_offset(self.epoch, src)
    }
    /// Address of the staging slot `src` writes into in `owner`'s heap during this epoch.
    #[inline(always)]
    pub fn staging(&self, owner: u32, src: u32) -> u64 {
        self.heap(owner) + staging_offset(self.epoch, src)
    }
    /// Stores the advanced epoch counter (thread 0, after the CTA's last barrier).
    ///
    /// # Safety
    ///
    /// Called by every thread (only thread 0 stores) after the CTA's last barrier, once per launch and after every wait
    /// on this epoch: a second call or an early one would let a later launch reuse this epoch's flags.
    #[inline(always)]
    pub unsafe fn finish(&self) {
        if ids::thread_idx() == 0 {
            let counter = (self.heap(self.rank) + EPOCH_COUNTERS_OFFSET + 8 * self.cta as u64) as *mut u64;
            unsafe { counter.write_volatile(self.epoch) };
            if self.cta == 0 {
                unsafe { super::wait::host_abort_at_launch_end(self.desc as u64, self.epoch) };
            }
        }
    }
}
