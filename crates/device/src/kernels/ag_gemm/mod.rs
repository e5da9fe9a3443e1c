//! `mk_ag_gemm_bf16_nk`: C (M x N) = AllGather_rows(A) (M x K) * B^T (B: N x K, local).
//! Each rank holds rows `[rank * Ms, (rank + 1) * Ms)` of A (`Ms = M / world`, a multiple of 128).
//! - CTAs `0..n_comm` (role IntraComm) copy this rank's shard, 128-row chunk by chunk, into the
//!   gathered A buffer of every local peer over NVLink and raise flag `(Tile0, rank, chunk)` at
//!   the receiver after each chunk; across nodes they also stage the shard for one proxy PUT to
//!   every remote rank ([`comm::run`]).
//! - CTAs `n_comm..` (role Compute) run the persistent GEMM; tile rows are visited from this
//!   rank's shard on: those tiles read A in place from the shard (no copy, no wait), the peers'
//!   rows come from the gathered buffer, and the producer waits for a chunk's flag before its
//!   first TMA load of those rows.
//!
//! Buffer reuse: before writing into a peer's gathered buffer, a comm CTA waits for that peer's
//! `FusedReady` (raised by its comm CTA 0 at start: its previous launch, which read the buffer,
//! ended).
//!
//! Roles ([`mkernel_config::ops::ag_gemm::Role`]): [`comm`] (comm CTAs), [`producer`] and
//! [`consumer`] (compute CTAs); the launch's epoch and exit are `crate::comm::launch`. Config
//! (arguments, shared memory, role table): `mkernel_config::ops::ag_gemm`; host plan:
//! `mkernel::ops::AgGemmPlan`.
use crate::arch::{ids, regs, smem, sync, tma, tma::TensorMap};
use crate::comm::launch::{exit_launch, fused_ctx};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::scheduler::TileScheduler;
use crate::gemm::TILE;
use mkernel_config::comm::{CommDesc, Role as CtxRole};
use mkernel_config::ops::ag_gemm::{self as ag_op, AgGemmArgs, Role};

mod comm;
mod consumer;
mod producer;

/// The kernel.
///
/// # Safety
/// Launched as `mkernel_config::ops::ag_gemm::AG_GEMM_NK` says, by every rank of the
/// communicator at once, with `args` the device address of this launch's argument block (the
/// host's `AgGemmPlan` does both).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_ag_gemm_bf16_nk(args: *const AgGemmArgs) {
    // Fields are read from the kernel argument block in global memory where used; a by-value
    // copy passed by reference would live on the stack.
    let a = unsafe { &*args };
    let (role, role_idx) = if ids::block_idx() < a.n_comm {
        (CtxRole::IntraComm, ids::block_idx())
    } else {
        (CtxRole::Compute, ids::block_idx() - a.n_comm)
    };
    if role == CtxRole::IntraComm {
        let c = unsafe { fused_ctx(a.desc, role) };
        let shard_rows = a.m / c.global_world;
        unsafe { comm::run(&c, a, role_idx, shard_rows / TILE.block_m, a.k as u64 * 2) };
    } else {
        unsafe { compute(a, role_idx) };
    }
    let c = unsafe { fused_ctx(a.desc, role) };
    unsafe { exit_launch(&c, c.epoch) };
}

/// A compute CTA: the persistent GEMM over the gathered A, the producer waiting for each 128-row
/// chunk before loading it.
#[inline(always)]
unsafe fn compute(a: &AgGemmArgs, idx: u32) {
    let ring = Ring::new(smem::dynamic_smem_addr(), ag_op::RING);
    let (map_a, map_b, map_c) = (
        TensorMap(a.map_a as *const u8),
        TensorMap(a.map_b as *const u8),
        TensorMap(a.map_c as *const u8),
    );
    let map_a_local = TensorMap(a.map_a_local as *const u8);
    if ids::thread_idx() == 0 {
        unsafe {
            tma::prefetch(map_a);
            tma::prefetch(map_a_local);
            tma::prefetch(map_b);
            ring.init();
        }
    }
    sync::sync_threads();
    let wg = ids::warpgroup_idx();
    let pos = RingPos::START;
    // The warpgroup's role ([`ag_op::COMPUTE_WARPGROUPS`]): the producer, or a consumer.
    if ag_op::compute_role(wg) == Role::Producer {
        regs::setmaxnreg_dec::<{ ag_op::TILE.producer_regs }>();
        if ids::thread_idx() == 0 {
            unsafe { producer::run(a, idx, &ring, pos, [map_a, map_a_local, map_b]) };
        }
    } else {
        regs::setmaxnreg_inc::<{ ag_op::TILE.consumer_regs }>();
        unsafe { consumer::run(a, idx, &ring, pos, wg, map_c) };
    }
}

/// A compute CTA's tile order and geometry: `(world, global_rank, shard_rows, tiles, k_blocks)`.
/// Each role derives it after its setmaxnreg (values kept live across the split are what ptxas
/// spills).
#[inline(always)]
fn schedule(a: &AgGemmArgs, idx: u32) -> (u32, u32, u32, TileScheduler, u32) {
    let d = unsafe { &*(a.desc as *const CommDesc) };
    let (world, global_rank, global_world) = (d.world, d.global_rank, d.global_world);
    let shard_rows = a.m / global_world;
    // This node's rows first (from this rank's shard on), then the other nodes' in turn.
    let first_in_node = (global_rank % world) * shard_rows / TILE.block_m;
    let tiles = TileScheduler::new(
        a.m,
        a.n,
        TILE.block_m,
        TILE.block_n,
        TILE.group_m,
        idx,
        ids::grid_dim() - a.n_comm,
    )
    .node_major(global_world / world, global_rank / world, first_in_node);
    (world, global_rank, shard_rows, tiles, a.k.div_ceil(TILE.block_k))
}
