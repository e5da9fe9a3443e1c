//! Fused communication + GEMM kernels: one persistent launch per operation whose CTAs take
//! roles (docs/fused.md).
//! - [`ag_gemm`]: AllGather+GEMM, `mk_ag_gemm_bf16_nk`.
//! - [`gemm_rs`]: GEMM+ReduceScatter/AllReduce, `mk_gemm_rs_bf16_nk` - its setup, role split and
//!   tile loop; its roles and parts: [`stager`], [`relay`] and [`node_send`] (across nodes),
//!   [`work_items`] and [`stream_k`]; where no stager runs, [`rs_epilogue`], [`announce`] and
//!   [`trickle`].
//! - here: what both kernels share - the launch epoch, the abort word, the ring waits' bounds, the exit
//!   count, a voting barrier.
//!
//! Epoch: one per launch, read by every CTA at start and advanced by the last CTA to exit.
use crate::arch::{ids, mbarrier, memory, memory::Scope, regs, smem, sync, tma, tma::TensorMap};
use crate::comm::bulk::{BulkRing, Release};
use crate::comm::wait::{
    local_stall, stall_or_abort, wait_flag_of_cta, wait_flag_of_cta_from, wait_flag_of_cta_sleeping, wait_mbarrier,
    THIS_WARPGROUP,
};
use crate::comm::{proxy, CommCtx};
use crate::gemm::consumer::{drain_tile, mma_tile_bounded, mma_tile_hooked, KBlockHook};
use crate::gemm::epilogue::{
    add_acc_f32, add_bf16_tile, add_staged_tile, drain_tma_stores, store_acc_f32, store_staged_box, store_tile_tma,
    store_tile_tma_to, MapTable, StagedOnly,
};
use crate::gemm::producer::{fill_without_data, load_tile, load_tile_counted, wait_loads_landed};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::scheduler::Tile;
use crate::gemm::scheduler::TileScheduler;
use crate::gemm::trace;
use crate::gemm::{BLayout, TILE};
use mkernel_config::comm::{
    flag_offset, wait_code, CommDesc, FlagSlot, RemoteSlot, Role, ABORT_OFFSET, FIFO_HEAD_OFFSET, FUSED_EPOCH_OFFSET,
    FUSED_EXITS_OFFSET,
};
use mkernel_config::fused::{rs_source_row, AgGemmArgs, GemmRsArgs, SK_SLOT_BYTES, STAGER_STORE_ROWS};
use mkernel_config::stream_k::StreamK;
use mkernel_config::trace::{tile_kind, End, Mark};
use mkernel_config::GemmTile;

mod ag_gemm;
mod announce;
mod gemm_rs;
mod node_send;
mod relay;
mod rs_epilogue;
mod stager;
mod stream_k;
mod trickle;
mod work_items;

use announce::*;
use gemm_rs::*;
use node_send::*;
use relay::*;
use rs_epilogue::*;
use stager::*;
use stream_k::*;
use trickle::*;
use work_items::*;

#[inline(always)]
unsafe fn launch_epoch(c: &CommCtx) -> u64 {
    unsafe { ((c.heap(c.rank) + FUSED_EPOCH_OFFSET) as *const u64).read_volatile() + 1 }
}

/// Whether this rank gave up (a wait timed out or the host aborted): GEMM+ReduceScatter/AllReduce
/// reads it at each tile's start (each consumer warpgroup's leader) and ORs it into that tile's
/// epilogue barriers.
#[inline(always)]
unsafe fn aborted(desc: u64) -> bool {
    unsafe { abort_word(desc) != 0 }
}

/// The rank's abort word (nonzero: aborted), as loaded: a caller that compares it later keeps
/// the load's latency off its path until then.
#[inline(always)]
unsafe fn abort_word(desc: u64) -> u32 {
    let d = unsafe { &*(desc as *const CommDesc) };
    let heap = unsafe { *d.heaps.as_ptr().add(d.rank as usize) };
    unsafe { memory::ld_relaxed_u32(Scope::Gpu, (heap + ABORT_OFFSET) as *const u32) }
}

/// Stall callback of a fused kernel's consumer slot waits (`full`): past [`hung_ns`] the
/// wait gives up with a record (`RING_FULL`, the warpgroup) and the abort word raised; an abort
/// alone does not end it (the producer keeps filling: [`local_stall`]).
#[inline(always)]
fn consumer_stall(desc: u64) -> impl Fn(u64) -> bool + Copy {
    local_stall::<false>(desc, Role::Compute, wait_code::RING_FULL, THIS_WARPGROUP)
}

/// As [`consumer_stall`] for the producer's waits for a free slot (`empty`, `RING_EMPTY`).
#[inline(always)]
fn producer_stall(desc: u64) -> impl Fn(u64) -> bool + Copy {
    local_stall::<false>(desc, Role::Compute, wait_code::RING_EMPTY, THIS_WARPGROUP)
}

/// This launch's context, read from the descriptor. Each role builds its own after its
/// `setmaxnreg` (rather than one built before the role split and kept live across it, which
/// ptxas had to spill in the 56-register producer). Every warp reads the launch epoch before it
/// exits, and the epoch only advances after the last warp exited, so all reads agree.
#[inline(always)]
unsafe fn fused_ctx(desc: u64, role: Role) -> CommCtx {
    let mut c = unsafe { CommCtx::new(desc as *const CommDesc, 0, role) };
    c.epoch = unsafe { launch_epoch(&c) };
    c.epoch_seq = mkernel_config::comm::fifo::EPOCH_SEQ_FUSED;
    c
}

/// The last warp of the launch to get here advances the launch epoch. Counted per warp with
/// `bar.warp.sync` (no CTA-wide barrier: after the role split the producer's lane 0 runs long
/// after the rest of its warpgroup, and an aligned CTA barrier reached divergently is undefined).
#[inline(always)]
unsafe fn exit_launch(c: &CommCtx, epoch: u64) {
    unsafe { exit_launch_then(c, epoch, || {}) };
}

/// As [`exit_launch`]; the last warp's lane 0 first runs `last` (every other warp of the launch
/// has exited, and the exit counter's acquire/release chain orders their work before it).
#[inline(always)]
unsafe fn exit_launch_then(c: &CommCtx, epoch: u64, last: impl FnOnce()) {
    sync::sync_warp();
    if ids::lane_id() == 0 {
        unsafe { count_exit(c, epoch, ids::grid_dim() * (ids::block_dim() / 32), last) };
    }
}

/// One exit of `exits` in the launch (lane 0, after its warp's or CTA's work): the last one runs
/// `last`, resets the counter and advances the launch epoch.
#[inline(always)]
unsafe fn count_exit(c: &CommCtx, epoch: u64, exits: u32, last: impl FnOnce()) {
    let local = c.heap(c.rank);
    let exited = unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 1) };
    if exited + 1 == exits {
        last();
        unsafe {
            memory::st_relaxed_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 0);
            memory::st_release_u64(Scope::Gpu, (local + FUSED_EPOCH_OFFSET) as *mut u64, epoch);
        }
    }
}

/// As [`exit_launch_then`], counting warps per CTA first: each warp's lane 0 adds 1 to a
/// shared-memory word (`Ring::tick(1)` of GEMM+ReduceScatter's ring, zeroed by `Ring::init`
/// before the CTA's first barrier; `atom.acq_rel.cta`), and the CTA's last warp adds 1 to the
/// launch's exit counter - one global atomic per CTA instead of one per warp, which all land at
/// the end of the launch. The acquire/release chain (CTA scope, then GPU scope) still orders
/// every warp's work before the launch's last warp runs `last(lane, 32)` - in all its lanes
/// (ordered after lane 0's acquire by the warp barrier, and before lane 0's release of the
/// next epoch by another), which share its end-of-launch stores.
#[inline(always)]
unsafe fn exit_launch_by_cta_then(c: &CommCtx, epoch: u64, last: impl FnOnce(u32, u32)) {
    sync::sync_warp();
    let mut is_last = 0u32;
    if ids::lane_id() == 0 {
        let word = (smem::dynamic_smem() as u64 + RS_TILE.tick_offset() as u64 + 4) as *mut u32;
        let warps = ids::block_dim() / 32;
        if unsafe { memory::atom_acq_rel_add_u32(Scope::Cta, word, 1) } + 1 == warps {
            let local = c.heap(c.rank);
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
                memory::st_relaxed_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 0);
                memory::st_release_u64(Scope::Gpu, (local + FUSED_EPOCH_OFFSET) as *mut u64, epoch);
            }
        }
    }
}

/// Named barrier `id` among `threads` threads that also ORs `pred` over them:
/// `barrier.red.or.pred q, id, threads, p;`
#[inline(always)]
fn named_barrier_or(id: u32, threads: u32, pred: bool) -> bool {
    let r: u32;
    unsafe {
        core::arch::asm!(
            "{{ .reg .pred p, q; setp.ne.u32 p, {2}, 0; barrier.red.or.pred q, {0}, {1}, p; selp.u32 {3}, 1, 0, q; }}",
            in(reg32) id, in(reg32) threads, in(reg32) pred as u32, out(reg32) r, options(nostack)
        )
    };
    r != 0
}
