//! What every role of GEMM+ReduceScatter/AllReduce reads: the shared-memory copies of the
//! descriptor, the arguments and the epoch ([`rs_op::GemmRsSmem`]), the launch's geometry and the counts
//! that make a row tile full.
use crate::arch::smem;
use crate::arch::smem::SmemAddr;
use crate::comm::CommCtx;
use crate::gemm::ring::Ring;
use crate::gemm::TILE;
use mkernel_config::comm::{CommDesc, Role};
use mkernel_config::gemm::RingLayout;
use mkernel_config::ops::gemm_rs as rs_op;
use mkernel_config::ops::gemm_rs::GemmRsArgs;
use mkernel_config::GemmTile;

/// The GEMM+ReduceScatter/AllReduce ring (whole-tile epilogue staging).
pub(super) const RS_TILE: GemmTile = rs_op::TILE;
pub(super) const RS_RING: RingLayout = rs_op::RING;
/// Bits of a consumer's `ready` word above the local ranks' `FusedReady` bits: the current own
/// tile's first peer partial is staged; the parity of the next staged phase of `staging_ready(wg)`.
pub(super) const STAGED: u32 = 1 << 29;
pub(super) const STAGE_PARITY: u32 = 1 << 30;

/// Node geometry of a launch: `(nodes, node, rows of one node block = M / global_world)`.
#[inline(always)]
pub(super) fn node_blocks(c: &CommCtx, m: u32) -> (u32, u32, u32) {
    (c.global_world / c.world, c.global_rank / c.world, m / c.global_world)
}

/// Pulled: where local rank `src`'s partials for this rank's own tiles lie (its outbox, rows x
/// N bf16 over NVLink, indexed by the tiles' own rows).
#[inline(always)]
pub(super) fn partials_of(c: &CommCtx, a: &GemmRsArgs, src: u32) -> u64 {
    c.heap(src) + a.outbox_off
}

/// The value of a full `(Tile1, src, row tile)`: src's comm CTAs each add 1 for their slice;
/// without comm CTAs, src's compute CTAs add 1 per half tile.
#[inline(always)]
pub(super) fn tile1_full(a: &GemmRsArgs) -> u64 {
    if a.n_comm == 0 {
        HALVES * a.n.div_ceil(TILE.block_n) as u64
    } else {
        a.n_comm as u64
    }
}

/// Announcements per tile: each consumer warpgroup announces its half (rows) on its own, so
/// a full count is this many times the tiles.
pub(super) const HALVES: u64 = TILE.consumer_warpgroups as u64;

/// The GEMM+ReduceScatter/AllReduce launch's copy of its `CommDesc` in shared memory, as a
/// generic address (written by thread 0 before the role split; `GemmTile::desc_copy_offset`).
#[inline(always)]
pub(super) fn ldesc() -> u64 {
    smem::dynamic_smem() as u64 + rs_op::DESC_OFFSET as u64
}

/// The launch's copy of its `GemmRsArgs` in shared memory, as a generic address (written by
/// thread 0 before the role split; `GemmTile::args_copy_offset`).
#[inline(always)]
pub(super) fn largs() -> u64 {
    smem::dynamic_smem() as u64 + rs_op::ARGS_OFFSET as u64
}

/// The launch epoch, from its shared-memory copy (written at setup by thread 0; volatile:
/// re-read wherever called).
#[inline(always)]
pub(super) fn lepoch() -> u64 {
    unsafe { ((smem::dynamic_smem() as u64 + rs_op::EPOCH_OFFSET as u64) as *const u64).read_volatile() }
}

/// `(rank, world)` read from the descriptor (volatile: re-read wherever called).
#[inline(always)]
pub(super) unsafe fn rank_world(desc: u64) -> (u32, u32) {
    let d = desc as *const CommDesc;
    unsafe {
        (
            (&raw const (*d).rank).read_volatile(),
            (&raw const (*d).world).read_volatile(),
        )
    }
}

/// The fused launch context with a known epoch (re-read from the descriptor in each epilogue).
#[inline(always)]
pub(super) unsafe fn fused_ctx_at(desc: u64, epoch: u64) -> CommCtx {
    let mut c = unsafe { CommCtx::with_epoch(desc as *const CommDesc, 0, Role::Compute, epoch) };
    c.epoch_seq = mkernel_config::comm::fifo::EPOCH_SEQ_FUSED;
    c
}

/// The ring's auxiliary mbarrier [`rs_op::AUX_STAGING_READY`] of consumer warpgroup `wg`
/// (1-based): its staging is ready (a staged peer partial has landed; with a stager: the
/// staging is free or holds the partial).
#[inline(always)]
pub(super) fn staging_ready(ring: &Ring, wg: u32) -> SmemAddr {
    ring.aux(rs_op::AUX_STAGING_READY + wg - 1)
}

/// The ring's auxiliary mbarrier [`rs_op::AUX_TILE_STAGED`] of consumer warpgroup `wg`
/// (1-based): it wrote its tile into its staging (with a stager).
#[inline(always)]
pub(super) fn tile_staged(ring: &Ring, wg: u32) -> SmemAddr {
    ring.aux(rs_op::AUX_TILE_STAGED + wg - 1)
}

/// The ring's auxiliary mbarrier [`rs_op::AUX_NODE_SUMS`]: the other nodes' sums have landed.
#[inline(always)]
pub(super) fn node_sums(ring: &Ring) -> SmemAddr {
    ring.aux(rs_op::AUX_NODE_SUMS)
}

/// The ring's tick word [`rs_op::TICK_FREE_SLOTS`]: ring slots the producer found free.
#[inline(always)]
pub(super) fn free_slots(ring: &Ring) -> SmemAddr {
    ring.tick(rs_op::TICK_FREE_SLOTS)
}
