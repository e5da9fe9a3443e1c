//! `mk_ag_gemm_bf16_nk`: C (M x N) = AllGather_rows(A) (M x K) * B^T (B: N x K, local).
//! Each rank holds rows `[rank * Ms, (rank + 1) * Ms)` of A (`Ms = M / world`, a multiple of 128).
//! - CTAs `0..n_comm` (role IntraComm) copy this rank's shard, 128-row chunk by chunk, into the
//!   gathered A buffer of every local peer over NVLink and raise flag `(Tile0, rank, chunk)` at
//!   the receiver after each chunk; across nodes they also stage the shard for one proxy PUT to
//!   every remote rank (see `comm_role`).
//! - CTAs `n_comm..` (role Compute) run the persistent GEMM; tile rows are visited from this
//!   rank's shard on: those tiles read A in place from the shard (no copy, no wait), the peers'
//!   rows come from the gathered buffer, and the producer waits for a chunk's flag before its
//!   first TMA load of those rows.
//!
//! Buffer reuse: before writing into a peer's gathered buffer, a comm CTA waits for that peer's
//! `FusedReady` (raised by its comm CTA 0 at start: its previous launch, which read the buffer,
//! ended).
use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_ag_gemm_bf16_nk(args: *const AgGemmArgs) {
    // Fields are read from the kernel argument block in global memory where used; a by-value
    // copy passed by reference would live on the stack.
    let a = unsafe { &*args };
    let (role, role_idx) = if ids::block_idx() < a.n_comm {
        (Role::IntraComm, ids::block_idx())
    } else {
        (Role::Compute, ids::block_idx() - a.n_comm)
    };
    if role == Role::IntraComm {
        let c = unsafe { fused_ctx(a.desc, role) };
        let shard_rows = a.m / c.global_world;
        unsafe { comm_role(&c, a, role_idx, shard_rows / TILE.block_m, a.k as u64 * 2) };
    } else {
        unsafe { compute_role(a, role_idx) };
    }
    let c = unsafe { fused_ctx(a.desc, role) };
    unsafe { exit_launch(&c, c.epoch) };
}

/// Pushes this rank's shard, chunk by chunk, to every local peer with TMA bulk copies (thread 0
/// of each comm CTA; [`BulkRing`]), in the order the peers need it: rank `r` visits its own
/// rows first, then local rank `r + 1`'s, so local rank `r - 1` gets this shard first.
/// Across nodes (`global_world > world`), first every comm CTA stages its chunks in this rank's
/// own gathered buffer (the proxy's source) and raises `(Tile1, rank, chunk)` locally; comm
/// CTA 0 raises `FusedReady` at every remote rank, and once the whole shard is staged and a
/// remote rank's `FusedReady` arrived, posts one PUT of the shard to it, raising `FusedData`
/// there; it waits for the proxy to finish the puts before the launch ends.
#[inline(always)]
pub(super) unsafe fn comm_role(c: &CommCtx, a: &AgGemmArgs, idx: u32, chunks: u32, row_bytes: u64) {
    let t = ids::thread_idx();
    unsafe {
        // Our gathered buffer is free (our previous launch ended): tell the local peers.
        if idx == 0 && t < c.world && t != c.rank {
            memory::st_release_u64(
                Scope::Sys,
                (c.heap(t) + flag_offset(FlagSlot::FusedReady, c.rank, 0)) as *mut u64,
                c.epoch,
            );
        }
        if t != 0 {
            return;
        }
        let mut ring = BulkRing::new(smem::dynamic_smem_addr());
        let chunk_bytes = TILE.block_m as u64 * row_bytes;
        // Byte offset of this rank's rows in the gathered buffer (rows are by global rank).
        let shard_off = c.global_rank as u64 * chunks as u64 * chunk_bytes;
        let my_node = c.global_rank / c.world;
        let remote = |q: u32| q / c.world != my_node;
        let mut last_put = None;
        if c.global_world > c.world {
            if idx == 0 {
                for q in 0..c.global_world {
                    if remote(q) && proxy::signal(c, q, RemoteSlot::FusedReady).is_none() {
                        return;
                    }
                }
            }
            let own = c.heap(c.rank) + a.a_gathered_off + shard_off;
            let mut j = idx;
            while j < chunks {
                let mut dsts = [0u64; 8];
                dsts[0] = own + j as u64 * chunk_bytes;
                ring.copy(&dsts, 1, a.a_shard + j as u64 * chunk_bytes, chunk_bytes);
                memory::st_release_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::Tile1, c.rank, j), c.epoch);
                j += a.n_comm;
            }
            if idx == 0 {
                for j in 0..chunks {
                    if !wait_flag_of_cta(c, FlagSlot::Tile1, c.rank, j, c.epoch) {
                        return;
                    }
                }
                for q in 0..c.global_world {
                    if remote(q) {
                        if !proxy::wait_remote(c, RemoteSlot::FusedReady, q) {
                            return;
                        }
                        let off = a.a_gathered_off + shard_off;
                        last_put = proxy::put_value(
                            c,
                            q,
                            off,
                            off,
                            chunks as u64 * chunk_bytes,
                            RemoteSlot::FusedData,
                            c.epoch,
                        );
                        if last_put.is_none() {
                            return;
                        }
                    }
                }
            }
        }
        for kk in 1..c.world {
            let p = (c.rank + c.world - kk) % c.world;
            // Wait (bounded) until p's previous launch finished with its buffer.
            if !wait_flag_of_cta(c, FlagSlot::FusedReady, p, 0, c.epoch) {
                return;
            }
            let mut j = idx;
            while j < chunks {
                let off = shard_off + j as u64 * chunk_bytes;
                let mut dsts = [0u64; 8];
                dsts[0] = c.heap(p) + a.a_gathered_off + off;
                ring.copy(&dsts, 1, a.a_shard + j as u64 * chunk_bytes, chunk_bytes);
                memory::st_release_u64(
                    Scope::Sys,
                    (c.heap(p) + flag_offset(FlagSlot::Tile0, c.rank, j)) as *mut u64,
                    c.epoch,
                );
                j += a.n_comm;
            }
        }
        if let Some(seq) = last_put {
            // The launch ends only when the proxy has read our shard (the next launch restages it).
            let _ = proxy::wait_done(c, seq);
        }
    }
}

/// The producer's bounded wait for a chunk. Inline: a call from a warpgroup that gave
/// registers back with `setmaxnreg` may use registers it no longer has.
#[inline(always)]
pub(super) unsafe fn wait_chunk(c: &CommCtx, src: u32, chunk: u32) -> bool {
    unsafe { wait_flag_of_cta(c, FlagSlot::Tile0, src, chunk, c.epoch) }
}

/// The persistent GEMM over the gathered A, waiting for each 128-row chunk before loading it.
#[inline(always)]
pub(super) unsafe fn compute_role(a: &AgGemmArgs, idx: u32) {
    let ring = Ring::new(smem::dynamic_smem_addr(), TILE);
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
    // Each role derives its loop state after its setmaxnreg (values kept live across the split
    // are what ptxas spills).
    let setup = || {
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
    };
    let wg = ids::warpgroup_idx();
    let mut pos = RingPos::START;
    if wg == 0 {
        regs::setmaxnreg_dec::<{ GemmTile::FUSED.producer_regs }>();
        if ids::thread_idx() == 0 {
            let (world, global_rank, shard_rows, tiles, k_blocks) = setup();
            // The context is built only where a wait needs it (once per chunk or remote
            // shard): kept across the loop it would not fit the producer's 56 registers.
            let mut ready_row: u32 = u32::MAX; // last tile row known to have arrived
            let mut remote_ready: u32 = u32::MAX; // last remote shard known to have arrived
                                                  // AllGather+GEMM's consumers never stop early: the producer's waits give up only once hung.
            let give_up = producer_stall(a.desc);
            let mut tiles = tiles;
            while let Some(tile) = tiles.next() {
                let src = tile.m0 / shard_rows; // global rank
                let mut arrived = true;
                if src == global_rank {
                    // Our own rows: read the shard in place.
                    if !unsafe {
                        load_tile(
                            &ring,
                            &mut pos,
                            map_a_local,
                            tile.m0 - src * shard_rows,
                            map_b,
                            BLayout::Nk,
                            tile,
                            k_blocks,
                            give_up,
                        )
                    } {
                        break;
                    }
                    continue;
                }
                if src / world != global_rank / world {
                    // Another node's shard, put whole by its proxy.
                    if src != remote_ready {
                        let c = unsafe { fused_ctx(a.desc, Role::Compute) };
                        arrived = unsafe { proxy::wait_remote(&c, RemoteSlot::FusedData, src) };
                        memory::fence_proxy_async();
                        remote_ready = src;
                    }
                } else if tile.m0 != ready_row {
                    let chunk = (tile.m0 % shard_rows) / TILE.block_m;
                    let c = unsafe { fused_ctx(a.desc, Role::Compute) };
                    arrived = unsafe { wait_chunk(&c, src % world, chunk) };
                    // The rows were written by a peer's bulk copies over NVLink and announced
                    // by a generic release; TMA reads through the async proxy.
                    memory::fence_proxy_async();
                    ready_row = tile.m0;
                }
                if !arrived {
                    // The error record names the stalled source: the consumers run through
                    // the remaining tiles without data and the launch ends.
                    let rest = k_blocks * (1 + tiles.count() as u32);
                    let _ = unsafe { fill_without_data(&ring, &mut pos, rest, give_up) };
                    break;
                }
                if !unsafe {
                    load_tile(
                        &ring,
                        &mut pos,
                        map_a,
                        tile.m0,
                        map_b,
                        BLayout::Nk,
                        tile,
                        k_blocks,
                        give_up,
                    )
                } {
                    break;
                }
            }
        }
    } else {
        regs::setmaxnreg_inc::<{ GemmTile::FUSED.consumer_regs }>();
        let (_, _, _, tiles, k_blocks) = setup();
        let mut acc = [0f32; 128];
        for tile in tiles {
            unsafe {
                mma_tile_bounded(
                    &ring,
                    &mut pos,
                    &mut acc,
                    wg - 1,
                    BLayout::Nk,
                    k_blocks,
                    consumer_stall(a.desc),
                );
                store_tile_tma(&ring, map_c, tile, wg - 1, &mut acc);
            }
        }
        drain_tma_stores();
    }
}
