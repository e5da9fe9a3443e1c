//! The launch of a fused persistent kernel (`kernels::ag_gemm`, `kernels::gemm_rs`): its epoch,
//! the rank's abort word, the bounds of its GEMM ring's waits, and the exit count whose last warp
//! advances the epoch.
//!
//! Epoch: one per launch, read by every CTA at start and advanced by the last warp (or CTA) to
//! exit; the last exit also resets the exit counter.
use crate::arch::{ids, memory, memory::Scope, sync};
use crate::comm::wait::{local_stall, THIS_WARPGROUP};
use crate::comm::CommCtx;
use mkernel_config::comm::{
    cta_mark, wait_code, CommDesc, Role, ABORT_OFFSET, FUSED_CTA_MARKS_OFFSET, FUSED_EPOCH_OFFSET, FUSED_EXITS_OFFSET,
    MAX_COMM_CTAS,
};

/// This launch's epoch: one past the last finished launch's.
///
/// # Safety
/// `c` is this launch's context (its own heap mapped).
#[inline(always)]
pub unsafe fn launch_epoch(c: &CommCtx) -> u64 {
    unsafe { ((c.heap(c.rank) + FUSED_EPOCH_OFFSET) as *const u64).read_volatile() + 1 }
}

/// Whether this rank gave up (a wait timed out or the host aborted): GEMM+ReduceScatter/AllReduce
/// reads it at each tile's start (each consumer warpgroup's leader) and ORs it into that tile's
/// epilogue barriers.
///
/// # Safety
/// `desc` is the address of this launch's `CommDesc` (global memory or a shared copy).
#[inline(always)]
pub unsafe fn aborted(desc: u64) -> bool {
    unsafe { abort_word(desc) != 0 }
}

/// The rank's abort word (nonzero: aborted), as loaded: a caller that compares it later keeps
/// the load's latency off its path until then.
///
/// # Safety
/// `desc` is the address of this launch's `CommDesc` (global memory or a shared copy).
#[inline(always)]
pub unsafe fn abort_word(desc: u64) -> u32 {
    let d = unsafe { &*(desc as *const CommDesc) };
    let heap = unsafe { *d.heaps.as_ptr().add(d.rank as usize) };
    unsafe { memory::ld_relaxed_u32(Scope::Gpu, (heap + ABORT_OFFSET) as *const u32) }
}

/// Stall callback of a fused kernel's consumer slot waits (`full`): past `comm::wait::hung_ns` the
/// wait gives up with a record (`RING_FULL`, the warpgroup) and the abort word raised; an abort
/// alone does not end it (the producer keeps filling: [`local_stall`]).
#[inline(always)]
pub fn consumer_stall(desc: u64) -> impl Fn(u64) -> bool + Copy {
    local_stall::<false>(desc, Role::Compute, wait_code::RING_FULL, THIS_WARPGROUP)
}

/// As [`consumer_stall`] for the producer's waits for a free slot (`empty`, `RING_EMPTY`).
#[inline(always)]
pub fn producer_stall(desc: u64) -> impl Fn(u64) -> bool + Copy {
    local_stall::<false>(desc, Role::Compute, wait_code::RING_EMPTY, THIS_WARPGROUP)
}

/// This launch's context, read from the descriptor. Each role builds its own after its
/// `setmaxnreg` (rather than one built before the role split and kept live across it, which
/// ptxas had to spill in the 56-register producer). Every warp reads the launch epoch before it
/// exits, and the epoch only advances after the last warp exited, so all reads agree.
///
/// # Safety
/// `desc` is the address of this launch's `CommDesc` (global memory or a shared copy).
#[inline(always)]
pub unsafe fn fused_ctx(desc: u64, role: Role) -> CommCtx {
    let mut c = unsafe { CommCtx::new(desc as *const CommDesc, 0, role) };
    c.epoch = unsafe { launch_epoch(&c) };
    c.epoch_seq = mkernel_config::comm::fifo::EPOCH_SEQ_FUSED;
    c
}

/// The last warp of the launch to get here advances the launch epoch. Counted per warp with
/// `bar.warp.sync` (no CTA-wide barrier: after the role split the producer's lane 0 runs long
/// after the rest of its warpgroup, and an aligned CTA barrier reached divergently is undefined).
///
/// # Safety
/// Every warp of the launch calls it (or [`exit_launch_then`]) once, after its work, with this launch's context and epoch.
#[inline(always)]
pub unsafe fn exit_launch(c: &CommCtx, epoch: u64) {
    unsafe { exit_launch_then(c, epoch, || {}) };
}

/// As [`exit_launch`]; the last warp's lane 0 first runs `last` (every other warp of the launch
/// has exited, and the exit counter's acquire/release chain orders their work before it).
///
/// # Safety
/// As [`exit_launch`].
#[inline(always)]
pub unsafe fn exit_launch_then(c: &CommCtx, epoch: u64, last: impl FnOnce()) {
    sync::sync_warp();
    if ids::lane_id() == 0 {
        unsafe { count_exit(c, epoch, ids::grid_dim() * (ids::block_dim() / 32), last) };
    }
}

/// One exit of `exits` in the launch (lane 0, after its warp's or CTA's work): the last one runs
/// `last`, resets the counter and advances the launch epoch.
///
/// # Safety
/// Called by lane 0 once per exiting unit, `exits` times in the launch in all, with this launch's context and epoch.
#[inline(always)]
pub unsafe fn count_exit(c: &CommCtx, epoch: u64, exits: u32, last: impl FnOnce()) {
    let local = c.heap(c.rank);
    let exited = unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 1) };
    if exited + 1 == exits {
        last();
        unsafe {
            crate::comm::wait::host_abort_at_launch_end(c.desc_addr(), epoch);
            memory::st_relaxed_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 0);
            memory::st_release_u64(Scope::Gpu, (local + FUSED_EPOCH_OFFSET) as *mut u64, epoch);
        }
    }
}

/// As [`exit_launch_then`], counting warps per CTA first (and writing the CTA's exit mark,
/// `FUSED_CTA_MARKS_OFFSET`: GEMM+ReduceScatter/AllReduce alone uses this): each warp's lane 0 adds 1 to the
/// shared-memory `word` (zeroed before the CTA's first barrier, e.g. a `Ring::tick` word;
/// `atom.acq_rel.cta`), and the CTA's last warp adds 1 to the
/// launch's exit counter - one global atomic per CTA instead of one per warp, which all land at
/// the end of the launch. The acquire/release chain (CTA scope, then GPU scope) still orders
/// every warp's work before the launch's last warp runs `last(lane, 32)` - in all its lanes
/// (ordered after lane 0's acquire by the warp barrier, and before lane 0's release of the
/// next epoch by another), which share its end-of-launch stores.
///
/// # Safety
/// Every warp of the launch calls it once, after its work; `word` is a generic address of a shared-memory word of this CTA, zero before the CTA's first barrier and used for nothing else.
#[inline(always)]
pub unsafe fn exit_launch_by_cta_then(c: &CommCtx, epoch: u64, word: *mut u32, last: impl FnOnce(u32, u32)) {
    sync::sync_warp();
    let mut is_last = 0u32;
    if ids::lane_id() == 0 {
        let warps = ids::block_dim() / 32;
        if unsafe { memory::atom_acq_rel_add_u32(Scope::Cta, word, 1) } + 1 == warps {
            let local = c.heap(c.rank);
            // The CTA's exit mark (diagnostics, `FUSED_CTA_MARKS_OFFSET`: a peer that timed out
            // reads which CTAs are still inside the launch).
            let mark = local + FUSED_CTA_MARKS_OFFSET + 8 * (MAX_COMM_CTAS + ids::block_idx()) as u64;
            unsafe { memory::st_relaxed_u64(Scope::Gpu, mark as *mut u64, cta_mark(epoch, ids::sm_id())) };
            let exited =
                unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 1) };
            is_last = (exited + 1 == ids::grid_dim()) as u32;
        }
    }
    if crate::arch::shuffle::shfl_idx(is_last, 0) != 0 {
        sync::sync_warp();
        last(ids::lane_id(), 32);
        sync::sync_warp();
        if ids::lane_id() == 0 {
            let local = c.heap(c.rank);
            unsafe {
                crate::comm::wait::host_abort_at_launch_end(c.desc_addr(), epoch);
                memory::st_relaxed_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 0);
                memory::st_release_u64(Scope::Gpu, (local + FUSED_EPOCH_OFFSET) as *mut u64, epoch);
            }
        }
    }
}
