//! Fused communication + GEMM kernels: one persistent launch whose CTAs take roles.
//!
//! `mk_ag_gemm_bf16_nk`: C (M x N) = AllGather_rows(A) (M x K) * B^T (B: N x K, local).
//! Each rank holds rows `[rank * Ms, (rank + 1) * Ms)` of A (`Ms = M / world`, a multiple of 128).
//! - CTAs `0..n_comm` (role IntraComm) copy this rank's shard, 128-row chunk by chunk, into the
//!   gathered A buffer of every peer over NVLink and raise flag `(Tile0, rank, chunk)` at the
//!   receiver after each chunk.
//! - CTAs `n_comm..` (role Compute) run the persistent GEMM; tile rows are visited from this
//!   rank's shard on: those tiles read A in place from the shard (no copy, no wait), the peers'
//!   rows come from the gathered buffer, and the producer waits for a chunk's flag before its
//!   first TMA load of those rows.
//!
//! Epoch: one per launch, read by every CTA at start and advanced by the last CTA to exit.
//! Buffer reuse: before writing into a peer's gathered buffer, a comm CTA waits for that peer's
//! `Ready` (raised by its comm CTA 0 at start: its previous launch, which read the buffer, ended).
use crate::arch::{ids, memory, memory::Scope, regs, smem, sync, tma, tma::TensorMap};
use crate::comm::move_data::copy;
use crate::comm::wait::wait_flag_of_cta;
use crate::comm::CommCtx;
use crate::gemm::consumer::mma_tile;
use crate::gemm::epilogue::{drain_tma_stores, store_tile_tma};
use crate::gemm::producer::load_tile;
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::scheduler::TileScheduler;
use crate::gemm::{BLayout, TILE};
use mkernel_config::fused::AgGemmArgs;
use mkernel_config::GemmTile;
use mkernel_config::comm::{flag_offset, CommDesc, FlagSlot, Role, FUSED_EPOCH_OFFSET, FUSED_EXITS_OFFSET};


#[inline(always)]
unsafe fn launch_epoch(c: &CommCtx) -> u64 {
    unsafe { ((c.heap(c.rank) + FUSED_EPOCH_OFFSET) as *const u64).read_volatile() + 1 }
}

/// The last warp of the launch to get here advances the launch epoch. Counted per warp with
/// `bar.warp.sync` (no CTA-wide barrier: after the role split the producer's lane 0 runs long
/// after the rest of its warpgroup, and an aligned CTA barrier reached divergently is undefined).
#[inline(always)]
unsafe fn exit_launch(c: &CommCtx, epoch: u64) {
    sync::sync_warp();
    if ids::lane_id() == 0 {
        let local = c.heap(c.rank);
        let exited = unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 1) };
        if exited + 1 == ids::grid_dim() * (ids::block_dim() / 32) {
            unsafe {
                memory::st_relaxed_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 0);
                memory::st_release_u64(Scope::Gpu, (local + FUSED_EPOCH_OFFSET) as *mut u64, epoch);
            }
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_ag_gemm_bf16_nk(args: *const AgGemmArgs) {
    // Fields are read from the kernel argument block in global memory where used; a by-value
    // copy passed by reference would live on the stack.
    let a = unsafe { &*args };
    let (role, role_idx) = if ids::block_idx() < a.n_comm { (Role::IntraComm, ids::block_idx()) } else { (Role::Compute, ids::block_idx() - a.n_comm) };
    let mut c = unsafe { CommCtx::new(a.desc as *const CommDesc, 0, role) };
    c.epoch = unsafe { launch_epoch(&c) };
    let shard_rows = a.m / c.world;
    let chunks = shard_rows / TILE.block_m;
    let row_bytes = a.k as u64 * 2;
    if role == Role::IntraComm {
        unsafe { comm_role(&c, a, role_idx, chunks, row_bytes) };
    } else {
        unsafe { compute_role(&c, a, role_idx, shard_rows) };
    }
    unsafe { exit_launch(&c, c.epoch) };
}

/// Pushes this rank's shard, chunk by chunk, to every peer.
#[inline(always)]
unsafe fn comm_role(c: &CommCtx, a: &AgGemmArgs, idx: u32, chunks: u32, row_bytes: u64) {
    let t = ids::thread_idx();
    unsafe {
        // Our gathered buffer is free (our previous launch ended): tell the peers.
        if idx == 0 && t < c.world && t != c.rank {
            memory::st_release_u64(Scope::Sys, (c.heap(t) + flag_offset(FlagSlot::Ready, c.rank, 0)) as *mut u64, c.epoch);
        }
        let chunk_bytes = TILE.block_m as u64 * row_bytes;
        let shard_first_row = c.rank as u64 * chunks as u64 * TILE.block_m as u64;
        for kk in 1..c.world {
            let p = (c.rank + kk) % c.world;
            // Wait (one thread, bounded) until p's previous launch finished with its buffer.
            let ok = t != 0 || wait_flag_of_cta(c, FlagSlot::Ready, p, 0, c.epoch);
            if sync::sync_threads_or(!ok) {
                return;
            }
            let mut j = idx;
            while j < chunks {
                let off = (shard_first_row + j as u64 * TILE.block_m as u64) * row_bytes;
                copy((c.heap(p) + a.a_gathered_off + off) as *mut u8, (a.a_shard + j as u64 * chunk_bytes) as *const u8, chunk_bytes / 16);
                sync::sync_threads();
                if t == 0 {
                    memory::st_release_u64(Scope::Sys, (c.heap(p) + flag_offset(FlagSlot::Tile0, c.rank, j)) as *mut u64, c.epoch);
                }
                j += a.n_comm;
            }
        }
    }
}

/// The producer's bounded wait for a chunk. Inline: a call from a warpgroup that gave
/// registers back with `setmaxnreg` may use registers it no longer has.
#[inline(always)]
unsafe fn wait_chunk(c: &CommCtx, src: u32, chunk: u32) -> bool {
    unsafe { wait_flag_of_cta(c, FlagSlot::Tile0, src, chunk, c.epoch) }
}

/// The persistent GEMM over the gathered A, waiting for each 128-row chunk before loading it.
#[inline(always)]
unsafe fn compute_role(c: &CommCtx, a: &AgGemmArgs, idx: u32, shard_rows: u32) {
    let ring = Ring::new(smem::dynamic_smem_addr(), TILE);
    let (map_a, map_b, map_c) = (TensorMap(a.map_a as *const u8), TensorMap(a.map_b as *const u8), TensorMap(a.map_c as *const u8));
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
    let k_blocks = a.k.div_ceil(TILE.block_k);
    let n_compute = ids::grid_dim() - a.n_comm;
    let first_row_tile = c.rank * shard_rows / TILE.block_m;
    let tiles = TileScheduler::new(a.m, a.n, TILE.block_m, TILE.block_n, TILE.group_m, idx, n_compute).starting_at_row(first_row_tile);
    let wg = ids::warpgroup_idx();
    let mut pos = RingPos::START;
    if wg == 0 {
        regs::setmaxnreg_dec::<{ GemmTile::FUSED.producer_regs }>();
        if ids::thread_idx() == 0 {
            let mut ready_row: u32 = u32::MAX; // last tile row known to have arrived
            for tile in tiles {
                let src = tile.m0 / shard_rows;
                if src == c.rank {
                    // Our own rows: read the shard in place.
                    unsafe { load_tile(&ring, &mut pos, map_a_local, tile.m0 - src * shard_rows, map_b, BLayout::Nk, tile, k_blocks) };
                    continue;
                }
                if tile.m0 != ready_row {
                    let chunk = (tile.m0 % shard_rows) / TILE.block_m;
                    if !unsafe { wait_chunk(c, src, chunk) } {
                        break; // the error record names the stalled source; consumers trap
                    }
                    // The rows were written by a peer's generic-proxy stores over NVLink; TMA
                    // reads through the async proxy.
                    memory::fence_proxy_async();
                    ready_row = tile.m0;
                }
                unsafe { load_tile(&ring, &mut pos, map_a, tile.m0, map_b, BLayout::Nk, tile, k_blocks) };
            }
        }
    } else {
        regs::setmaxnreg_inc::<{ GemmTile::FUSED.consumer_regs }>();
        let mut acc = [0f32; 128];
        for tile in tiles {
            unsafe {
                mma_tile(&ring, &mut pos, &mut acc, wg - 1, BLayout::Nk, k_blocks);
                store_tile_tma(&ring, map_c, tile, wg - 1, &acc);
            }
        }
        drain_tma_stores();
    }
}
