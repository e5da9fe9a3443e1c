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
use crate::comm::move_data::{reduce, Dtype};
use crate::gemm::scheduler::Tile;
use mkernel_config::fused::{AgGemmArgs, GemmRsArgs};
use mkernel_config::GemmTile;
use mkernel_config::comm::{flag_offset, CommDesc, FlagSlot, Role, CONSUMED_OFFSET, FUSED_EPOCH_OFFSET, FUSED_EXITS_OFFSET, MAX_COMM_CTAS};


#[inline(always)]
unsafe fn launch_epoch(c: &CommCtx) -> u64 {
    unsafe { ((c.heap(c.rank) + FUSED_EPOCH_OFFSET) as *const u64).read_volatile() + 1 }
}

/// This launch's context, read from the descriptor. Each role builds its own after its
/// `setmaxnreg` (rather than one built before the role split and kept live across it, which
/// ptxas had to spill in the 56-register producer). Every warp reads the launch epoch before it
/// exits, and the epoch only advances after the last warp exited, so all reads agree.
#[inline(always)]
unsafe fn fused_ctx(desc: u64, role: Role) -> CommCtx {
    let mut c = unsafe { CommCtx::new(desc as *const CommDesc, 0, role) };
    c.epoch = unsafe { launch_epoch(&c) };
    c
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
    if role == Role::IntraComm {
        let c = unsafe { fused_ctx(a.desc, role) };
        let shard_rows = a.m / c.world;
        unsafe { comm_role(&c, a, role_idx, shard_rows / TILE.block_m, a.k as u64 * 2) };
    } else {
        unsafe { compute_role(a, role_idx) };
    }
    let c = unsafe { fused_ctx(a.desc, role) };
    unsafe { exit_launch(&c, c.epoch) };
}

/// Pushes this rank's shard, chunk by chunk, to every peer.
#[inline(always)]
unsafe fn comm_role(c: &CommCtx, a: &AgGemmArgs, idx: u32, chunks: u32, row_bytes: u64) {
    let t = ids::thread_idx();
    unsafe {
        // Our gathered buffer is free (our previous launch ended): tell the peers.
        if idx == 0 && t < c.world && t != c.rank {
            memory::st_release_u64(Scope::Sys, (c.heap(t) + flag_offset(FlagSlot::FusedReady, c.rank, 0)) as *mut u64, c.epoch);
        }
        let chunk_bytes = TILE.block_m as u64 * row_bytes;
        let shard_first_row = c.rank as u64 * chunks as u64 * TILE.block_m as u64;
        for kk in 1..c.world {
            let p = (c.rank + kk) % c.world;
            // Wait (one thread, bounded) until p's previous launch finished with its buffer.
            let ok = t != 0 || wait_flag_of_cta(c, FlagSlot::FusedReady, p, 0, c.epoch);
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
unsafe fn compute_role(a: &AgGemmArgs, idx: u32) {
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
    let rank = unsafe { (*(a.desc as *const CommDesc)).rank };
    let world = unsafe { (*(a.desc as *const CommDesc)).world };
    let shard_rows = a.m / world;
    let first_row_tile = rank * shard_rows / TILE.block_m;
    let tiles = TileScheduler::new(a.m, a.n, TILE.block_m, TILE.block_n, TILE.group_m, idx, n_compute).starting_at_row(first_row_tile);
    let wg = ids::warpgroup_idx();
    let mut pos = RingPos::START;
    if wg == 0 {
        regs::setmaxnreg_dec::<{ GemmTile::FUSED.producer_regs }>();
        if ids::thread_idx() == 0 {
            let c = unsafe { fused_ctx(a.desc, Role::Compute) };
            let c = &c;
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

/// `mk_gemm_rs_bf16_nk`: GEMM + ReduceScatter. Every rank computes its partial product
/// `P_r = A_r * B_r^T` (M x N; K is split over ranks) and rank `d` gets rows chunk `d` of
/// `sum_r P_r`, summed in f32.
/// - CTAs `n_reduce..` (Compute): the persistent GEMM, tile rows visited from the next rank's
///   chunk on (own chunk last), so peers can start reducing early. Each output tile is stored
///   with TMA straight into the destination rank's receive slot for this rank (over NVLink for
///   peers); once the bulk stores completed, one thread adds 1 to `(Tile1, rank, row tile)` at
///   the destination (`red.release.sys`). Before the first tile for a peer, it waits for the
///   peer's `FusedReady` (its receive buffer is free).
/// - CTAs `0..n_reduce` (role InterReduce reused as "reduce"): for each row tile of this rank's
///   chunk, wait until every source's count reached `consumed + tiles_n`, sum the `world`
///   slots in f32 (rank order) into the output, and advance `consumed`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_gemm_rs_bf16_nk(args: *const GemmRsArgs) {
    let a = unsafe { &*args };
    let reducer = ids::block_idx() < a.n_reduce;
    let role = if reducer { Role::InterReduce } else { Role::Compute };
    if reducer {
        let c = unsafe { fused_ctx(a.desc, role) };
        unsafe { reduce_role(&c, a, ids::block_idx(), a.m / c.world) };
    } else {
        unsafe { rs_compute_role(a, ids::block_idx() - a.n_reduce) };
    }
    let c = unsafe { fused_ctx(a.desc, role) };
    unsafe { exit_launch(&c, c.epoch) };
}

#[inline(always)]
unsafe fn reduce_role(c: &CommCtx, a: &GemmRsArgs, idx: u32, chunk_rows: u32) {
    let t = ids::thread_idx();
    let local = c.heap(c.rank);
    unsafe {
        // Our receive buffer is free (our previous launch ended): tell the peers.
        if idx == 0 && t < c.world && t != c.rank {
            memory::st_release_u64(Scope::Sys, (c.heap(t) + flag_offset(FlagSlot::FusedReady, c.rank, 0)) as *mut u64, c.epoch);
        }
        let tiles_n = a.n.div_ceil(TILE.block_n) as u64;
        let row_tiles = chunk_rows / TILE.block_m;
        let slot_bytes = chunk_rows as u64 * a.n as u64 * 2;
        let tile_bytes = TILE.block_m as u64 * a.n as u64 * 2;
        let mut mt = idx;
        while mt < row_tiles {
            let consumed = |src: u32| (local + CONSUMED_OFFSET + ((src * MAX_COMM_CTAS + mt) as u64) * 8) as *mut u64;
            let failed = t < c.world && !wait_flag_of_cta(c, FlagSlot::Tile1, t, mt, consumed(t).read_volatile() + tiles_n);
            if sync::sync_threads_or(failed) {
                return;
            }
            let mut srcs = [0u64; 8];
            for r in 0..8u32 {
                if r < c.world {
                    srcs[r as usize] = local + a.recv_off + r as u64 * slot_bytes + mt as u64 * tile_bytes;
                }
            }
            let mut dsts = [0u64; 8];
            let ndst = if a.all_reduce != 0 {
                // AllReduce: the reduced rows go to their place in every rank's output (NVLink
                // stores for the peers) once each peer's buffers are free.
                let failed = t < c.world && t != c.rank && !wait_flag_of_cta(c, FlagSlot::FusedReady, t, 0, c.epoch);
                if sync::sync_threads_or(failed) {
                    return;
                }
                let row_off = (c.rank as u64 * chunk_rows as u64 + mt as u64 * TILE.block_m as u64) * a.n as u64 * 2;
                for r in 0..8u32 {
                    if r < c.world {
                        dsts[r as usize] = c.heap(r) + a.out_off + row_off;
                    }
                }
                c.world
            } else {
                dsts[0] = a.out + mt as u64 * tile_bytes;
                1
            };
            reduce(dsts, ndst, srcs, c.world, tile_bytes / 16, Dtype::Bf16);
            sync::sync_threads();
            if t < c.world {
                let p = consumed(t);
                p.write_volatile(p.read_volatile() + tiles_n);
                if a.all_reduce != 0 && t != c.rank {
                    // "Row tile mt of my chunk is in your output."
                    memory::st_release_u64(Scope::Sys, (c.heap(t) + flag_offset(FlagSlot::Tile0, c.rank, mt)) as *mut u64, c.epoch);
                }
            }
            mt += a.n_reduce;
        }
        if a.all_reduce != 0 {
            // The launch ends only when the peers' reduced rows are in our output: this CTA
            // waits for the same row tiles of every peer's chunk.
            let mut mt = idx;
            while mt < row_tiles {
                let failed = t < c.world && t != c.rank && !wait_flag_of_cta(c, FlagSlot::Tile0, t, mt, c.epoch);
                if sync::sync_threads_or(failed) {
                    return;
                }
                mt += a.n_reduce;
            }
        }
    }
}

#[inline(always)]
unsafe fn rs_compute_role(a: &GemmRsArgs, idx: u32) {
    let ring = Ring::new(smem::dynamic_smem_addr(), TILE);
    let (map_a, map_b) = (TensorMap(a.map_a as *const u8), TensorMap(a.map_b as *const u8));
    if ids::thread_idx() == 0 {
        unsafe {
            tma::prefetch(map_a);
            tma::prefetch(map_b);
            ring.init();
        }
    }
    sync::sync_threads();
    let k_blocks = a.k.div_ceil(TILE.block_k);
    let n_compute = ids::grid_dim() - a.n_reduce;
    let rank = unsafe { (*(a.desc as *const CommDesc)).rank };
    let world = unsafe { (*(a.desc as *const CommDesc)).world };
    let chunk_rows = a.m / world;
    let next_chunk_row_tile = ((rank + 1) % world) * chunk_rows / TILE.block_m;
    let tiles = TileScheduler::new(a.m, a.n, TILE.block_m, TILE.block_n, TILE.group_m, idx, n_compute).starting_at_row(next_chunk_row_tile);
    let wg = ids::warpgroup_idx();
    let mut pos = RingPos::START;
    if wg == 0 {
        regs::setmaxnreg_dec::<{ GemmTile::FUSED.producer_regs }>();
        if ids::thread_idx() == 0 {
            for tile in tiles {
                unsafe { load_tile(&ring, &mut pos, map_a, tile.m0, map_b, BLayout::Nk, tile, k_blocks) };
            }
        }
    } else {
        regs::setmaxnreg_inc::<{ GemmTile::FUSED.consumer_regs }>();
        let c = unsafe { fused_ctx(a.desc, Role::Compute) };
        let c = &c;
        let first_consumer = ids::thread_idx() == 128;
        let leader = ids::thread_in_warpgroup() == 0;
        let mut ready: u32 = 1 << c.rank; // peers whose receive buffer we may write
        let mut acc = [0f32; 128];
        // The counter of the previous tile is raised only when this tile's epilogue starts: its
        // bulk stores drained over NVLink during this tile's mainloop instead of stalling it.
        let mut pending: Option<*mut u64> = None;
        for tile in tiles {
            let dest = tile.m0 / chunk_rows;
            unsafe {
                mma_tile(&ring, &mut pos, &mut acc, wg - 1, BLayout::Nk, k_blocks);
                if let Some(counter) = pending.take() {
                    publish(counter, leader, first_consumer);
                }
                if ready & (1 << dest) == 0 {
                    let ok = !first_consumer || wait_flag_of_cta(c, FlagSlot::FusedReady, dest, 0, c.epoch);
                    // Both consumer warpgroups learn the outcome (named barrier 3, 256 threads).
                    let failed = named_barrier_or(3, 2 * crate::arch::ids::WARPGROUP_THREADS, !ok);
                    if failed {
                        break;
                    }
                    ready |= 1 << dest;
                }
                let local_row = tile.m0 - dest * chunk_rows;
                let map = TensorMap(*a.map_recv.as_ptr().add(dest as usize) as *const u8);
                store_tile_tma(&ring, map, Tile { m0: local_row, n0: tile.n0 }, wg - 1, &acc);
                pending = Some((c.heap(dest) + flag_offset(FlagSlot::Tile1, c.rank, local_row / TILE.block_m)) as *mut u64);
            }
        }
        if let Some(counter) = pending {
            unsafe { publish(counter, leader, first_consumer) };
        }
        drain_tma_stores();
    }
}

/// Waits until both consumer warpgroups' bulk stores of the last tile completed, then one
/// thread adds 1 to that tile's row counter at its destination (`red.release.sys`).
#[inline(always)]
unsafe fn publish(counter: *mut u64, leader: bool, first_consumer: bool) {
    if leader {
        tma::store_wait::<0>();
        memory::fence_proxy_async();
    }
    sync::named_barrier_sync(3, 2 * crate::arch::ids::WARPGROUP_THREADS);
    if first_consumer {
        unsafe { memory::red_release_add_u64(Scope::Sys, counter, 1) };
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
