//! GEMM+ReduceScatter/AllReduce's epilogue without stagers: partial loads and adds, stores,
//! and (across nodes) the node sums.
use super::announce::{announce_newer, announce_older, awaited_in_loop, Pending, Pendings};
use super::shared::{
    fused_ctx_at, largs, ldesc, node_blocks, partials_of, rank_world, tile1_full, RS_TILE, STAGED, STAGE_PARITY,
};
use super::shared::{node_sums, staging_ready};
use super::trickle::Trickle;
use crate::arch::memory::Scope;
use crate::arch::sync::named_barrier_or;
use crate::arch::tma::TensorMap;
use crate::arch::{ids, mbarrier, memory, sync, tma};
use crate::comm::wait::{wait_flag_of_cta, wait_mbarrier};
use crate::gemm::epilogue::{add_bf16_tile, add_staged_tile, store_tile_tma, store_tile_tma_to, MapTable, StagedOnly};
use crate::gemm::ring::Ring;
use crate::gemm::scheduler::Tile;
use crate::gemm::TILE;
use mkernel_config::comm::{flag_offset, wait_code, CommDesc, FlagSlot, Role};
use mkernel_config::ops::gemm_rs::GemmRsArgs;
use mkernel_config::trace::Mark;
use mkernel_config::GemmTile;

/// Before an own tile's mainloop: the peers' partial tiles it will add from global memory (all
/// but a staged first one) are pulled into L2
/// (each consumer thread prefetches two 128-byte lines of one row per peer), so the epilogue's
/// loads hit L2. The data has usually landed long before; a line prefetched early is still
/// coherent (remote stores go through this GPU's L2).
#[inline(always)]
pub(super) unsafe fn prefetch_partials(a: &GemmRsArgs, tile: Tile, rank: u32, world: u32, first_staged: bool) {
    let ct = ids::thread_idx() - crate::arch::ids::WARPGROUP_THREADS;
    let chunk_rows = a.m / world;
    if a.pull != 0 {
        // The partials stay in the peers' memory: nothing to pull into L2 here.
        return;
    }
    let (row, half) = (tile.m0 - rank * chunk_rows + ct / 2, ct % 2);
    let col = tile.n0 + half * 128;
    if col >= a.n {
        return;
    }
    let slot_bytes = chunk_rows as u64 * a.n as u64 * 2;
    let local = unsafe { *(*(ldesc() as *const CommDesc)).heaps.as_ptr().add(rank as usize) };
    let at = local + a.recv_off + (row as u64 * a.n as u64 + col as u64) * 2;
    for src in 0..8u32 {
        if src < world && src != rank && !(first_staged && src == (rank + 1) % world) {
            let p = at + src as u64 * slot_bytes;
            unsafe {
                memory::prefetch_l2(p as *const u8);
                if col + 64 < a.n {
                    memory::prefetch_l2((p + 128) as *const u8);
                }
            }
        }
    }
}

/// Before an own tile's mainloop, the leader of each consumer warpgroup TMA-loads the first
/// peer's (`(rank + 1) % world`) partial of its 64 rows into the warpgroup's epilogue staging
/// ([`load_partial`]) if that peer's counter of the row tile is already full; `staging_ready(wg)`
/// completes when it landed. It never waits for the counter (a wait here, before this tile's
/// epilogue announces the previous tile, could close a cycle between ranks); true (for every
/// thread of the warpgroup) when the load was issued, else the epilogue loads that partial.
#[inline(always)]
pub(super) unsafe fn stage_first_partial(
    a: &GemmRsArgs,
    ring: &Ring,
    tile: Tile,
    wg: u32,
    rank: u32,
    world: u32,
) -> bool {
    let mut issued = false;
    if ids::thread_in_warpgroup() == 0 {
        let local_m0 = tile.m0 - rank * (a.m / world);
        let d = unsafe { &*(ldesc() as *const CommDesc) };
        let own_heap = unsafe { *d.heaps.as_ptr().add(rank as usize) };
        let counter =
            (own_heap + flag_offset(FlagSlot::Tile1, (rank + 1) % world, local_m0 / TILE.block_m)) as *const u64;
        if unsafe { memory::ld_acquire_u64(Scope::Sys, counter) } >= tile1_full(a) {
            unsafe { load_partial(ring, tile, wg, 0) };
            issued = true;
        }
    }
    // The warpgroup's epilogue barrier (id 1 + consumer index), with the leader's answer.
    named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, issued)
}

/// The leader of consumer warpgroup `wg` TMA-loads the partial of local peer `(rank + 1 +
/// step) % world` of its 64 rows of own tile `tile` into the warpgroup's whole-tile staging,
/// completing on `staging_ready(wg)`: once this thread's earlier bulk stores finished reading the
/// staging, and after the caller's acquire of that peer's counter (the partial was written by
/// bulk stores and announced by a generic release: the load reads through the async proxy,
/// after `fence.proxy.async`). Pushed: from that peer's slot of our receive buffer (`map_in`
/// spans every slot); pulled (step 0 only): from its outbox over NVLink, at the tile's own row.
/// Everything else is re-read here (volatile), so a caller's loop keeps nothing of it live next
/// to the accumulators.
#[inline(always)]
pub(super) unsafe fn load_partial(ring: &Ring, tile: Tile, wg: u32, step: u32) {
    let (rank, world) = unsafe { rank_world(ldesc()) };
    let a = largs() as *const GemmRsArgs;
    let (m, pull, map_in) = unsafe {
        (
            (&raw const (*a).m).read_volatile(),
            (&raw const (*a).pull).read_volatile(),
            (&raw const (*a).map_in).read_volatile(),
        )
    };
    let chunk_rows = m / world;
    let bar = staging_ready(ring, wg);
    memory::fence_proxy_async();
    tma::store_wait_read::<0>();
    unsafe { mbarrier::arrive_expect_tx(bar, RS_TILE.epilogue_buffers * RS_TILE.epilogue_box_bytes()) };
    let src = (rank + 1 + step) % world;
    let row0 = if pull != 0 {
        tile.m0
    } else {
        src * chunk_rows + tile.m0 - rank * chunk_rows
    };
    let map = TensorMap(map_in as *const u8);
    for q in 0..RS_TILE.epilogue_buffers {
        unsafe {
            tma::load_2d(
                ring.staging(wg - 1, q),
                map,
                tile.n0 + GemmTile::EPILOGUE_BOX_COLS * q,
                row0 + (wg - 1) * TILE.rows_per_consumer(),
                bar,
            )
        };
    }
}

/// Pushed partials of an own tile, after the first one's load was issued: while another peer's
/// partial is still to come, wait for the staged one, add it, and (once every thread read the
/// staging) load the next; the last one stays in the staging for the store pass.
#[inline(always)]
pub(super) unsafe fn add_chained_partials(ring: &Ring, tile: Tile, wg: u32, acc: &mut [f32; 128], ready: &mut u32) {
    macro_rules! step {
        ($($step:literal)*) => {$(
            if $step + 1 < unsafe { rank_world(ldesc()) }.1 {
                unsafe {
                    wait_staged(ring, wg, ready);
                    add_staged_tile(ring, wg - 1, acc);
                }
                // Every thread's reads of the staging precede the next load into it.
                memory::fence_proxy_async_shared();
                sync::named_barrier_sync(wg, crate::arch::ids::WARPGROUP_THREADS);
                if ids::thread_in_warpgroup() == 0 {
                    unsafe { load_partial(ring, tile, wg, $step) };
                }
            }
        )*};
    }
    step!(1 2 3 4 5 6);
}

/// Waits for the staged partial's load on `staging_ready(wg)` (the phase `ready` tracks) and flips the
/// tracked parity.
#[inline(always)]
pub(super) unsafe fn wait_staged(ring: &Ring, wg: u32, ready: &mut u32) {
    let parity = (*ready & STAGE_PARITY != 0) as u32;
    // (A load always lands; bounded anyway: a record, then the tile goes on with what the
    // staging holds and the next barrier sees the abort.)
    let _ = unsafe {
        wait_mbarrier(
            staging_ready(ring, wg),
            parity,
            ldesc(),
            Role::Compute,
            wait_code::STAGING,
            wg,
        )
    };
    *ready ^= STAGE_PARITY;
}

/// The epilogue of one tile of GEMM+ReduceScatter/AllReduce without stagers (both consumer
/// warpgroups; with stagers the tile loop calls [`stager_epilogue`]): announce the previous
/// tile, then store this one to its peer, or add the peers' partials (and, in the own node's
/// block, the other nodes' sums) and store the sum. False when a wait gave up (the error
/// record is written).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rs_epilogue(
    a: &GemmRsArgs,
    epoch: u64,
    ring: &Ring,
    tile: Tile,
    wg: u32,
    acc: &mut [f32; 128],
    ready: &mut u32,
    pending: &mut Pendings,
    trickle: &mut Trickle,
    stop: bool,
    mark: impl Fn(Mark),
) -> bool {
    let c = unsafe { fused_ctx_at(ldesc(), epoch) };
    let c = &c;
    // Each consumer warpgroup handles its half of the tile on its own (its named barrier `wg`).
    let t = ids::thread_in_warpgroup();
    let chunk_rows = a.m / c.world;
    let dest = tile.m0 / chunk_rows;
    let local = Tile {
        m0: tile.m0 - dest * chunk_rows,
        n0: tile.n0,
    };
    let mt = local.m0 / TILE.block_m;
    unsafe {
        // The tile two back (its stores had two mainloops to complete); an own tile, which
        // waits below, first also the one before if another rank waits for it during the loop
        // (a peer partial or a node sum: every such tile is announced before any wait, so no
        // cycle between ranks; AllReduce's rows for the peers are awaited at the launch's end).
        if !announce_older(c, a, pending, wg, stop) {
            return false;
        }
        if dest == c.rank
            && pending.newer.is_some_and(|p| awaited_in_loop(c, a, p))
            && !announce_newer(c, a, pending, wg, stop)
        {
            return false;
        }
        mark(Mark::Published);
        // AllReduce writes the own node's reduced rows into every local rank's output: their
        // FusedReady first.
        let (nodes, node, block_rows) = node_blocks(c, a.m);
        let j = local.m0 / block_rows;
        let need = if dest != c.rank && a.n_comm == 0 {
            1 << dest
        } else if dest == c.rank && a.all_reduce != 0 && j + 1 == nodes {
            (1u32 << c.world) - 1
        } else {
            0
        };
        if need & !*ready != 0 {
            let ok = t >= c.world
                || need & !*ready & (1 << t) == 0
                || wait_flag_of_cta(c, FlagSlot::FusedReady, t, 0, c.epoch);
            if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, !ok) {
                return false;
            }
            *ready |= need;
        }
        if dest != c.rank {
            mark(Mark::Waited);
            if a.pull != 0 {
                // Into the outbox (local, the tile's own row), from where the peer's own tile
                // reads it over NVLink: this CTA's stores stay local.
                store_tile_tma(ring, TensorMap(a.map_outbox as *const u8), tile, wg - 1, acc);
            } else if a.n_comm == 0 && a.all_reduce == 0 {
                // Straight into this rank's slot of the peer's receive buffer (over NVLink):
                // staged now, stored box by box during the next mainloop ([`Trickle`]).
                store_tile_tma_to(ring, StagedOnly, local, wg - 1, acc, false);
                *trickle = Trickle {
                    dest,
                    m0: local.m0,
                    n0: local.n0,
                    left: RS_TILE.epilogue_buffers,
                };
            } else if a.n_comm == 0 {
                // AllReduce: at once (its own tiles also cross NVLink from their epilogues, and
                // trickled peer tiles would compete with them; docs/fused.md).
                store_tile_tma(
                    ring,
                    TensorMap(*a.map_recv.as_ptr().add(dest as usize) as *const u8),
                    local,
                    wg - 1,
                    acc,
                );
            } else {
                // Into the outbox (local, the tile's own row), from where the comm CTAs copy
                // the completed row tile to the peer.
                store_tile_tma(ring, TensorMap(a.map_outbox as *const u8), tile, wg - 1, acc);
            }
        } else {
            // Every peer's partial of this row tile has landed here.
            // (The first peer's counter was seen full if its partial is staged.)
            let staged = *ready & STAGED != 0;
            let seen = staged && t == (c.rank + 1) % c.world;
            let ok = t >= c.world || t == c.rank || seen || wait_flag_of_cta(c, FlagSlot::Tile1, t, mt, tile1_full(a));
            // Also where an own tile whose predecessor was not announced hears of an abort.
            if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, !ok || stop) {
                return false;
            }
            mark(Mark::Waited);
            // The partial left in the staging, added by the store below.
            let mut staged = staged;
            if a.pull == 0 && c.world > 1 {
                // Pushed: the peers' partials (rank + 1, rank + 2, ...) pass through the
                // staging one after another, each TMA-loaded from our receive buffer once the
                // one before is added (`ldmatrix`); the last one stays for the store pass.
                // (Loads of the global partials in the registers' layout, 32-bit pieces of 8
                // rows per warp, are latency-bound behind this SM's NVLink traffic; one TMA load
                // per box is not.)
                if !staged && t == 0 {
                    load_partial(ring, tile, wg, 0);
                }
                staged = true;
                add_chained_partials(ring, tile, wg, acc, ready);
            } else {
                let at = (tile.m0 as u64 * a.n as u64 + local.n0 as u64) * 2;
                for src in 0..8u32 {
                    // The first peer's partial, when staged, is added by the store below.
                    if src < c.world && src != c.rank && !(staged && src == (c.rank + 1) % c.world) {
                        add_bf16_tile(acc, partials_of(c, a, src) + at, a.n, a.n - local.n0, wg - 1);
                    }
                }
            }
            if staged {
                // The staged partial has landed.
                wait_staged(ring, wg, ready);
                *ready &= !STAGED;
            }
            mark(Mark::Added);
            if j + 1 < nodes {
                // This node's sum of a remote rank's rows: to the stage (rows as in the chunk).
                store_tile_tma_to(ring, TensorMap(a.map_stage as *const u8), local, wg - 1, acc, staged);
            } else {
                if nodes > 1 {
                    // The other nodes' sums of our rows have landed once warp 3 arrived on the
                    // aux barrier (its acquire of their flags, then the barrier's release/acquire
                    // order our loads after the proxy's writes). Bounded by warp 3's wait.
                    let _ = wait_mbarrier(node_sums(ring), 0, ldesc(), Role::Compute, wait_code::NODE_SUMS, 0);
                    let block_bytes = block_rows as u64 * a.n as u64 * 2;
                    let at = c.heap(c.rank)
                        + a.xrecv_off
                        + ((local.m0 - j * block_rows) as u64 * a.n as u64 + local.n0 as u64) * 2;
                    let mut nd = 0;
                    while nd < nodes {
                        if nd != node {
                            add_bf16_tile(acc, at + nd as u64 * block_bytes, a.n, a.n - local.n0, wg - 1);
                        }
                        nd += 1;
                    }
                }
                // To the output; AllReduce: with one bulk group into every local rank's output
                // (a peer's over NVLink).
                let outs = MapTable {
                    maps: a.map_out.as_ptr(),
                    count: if a.all_reduce != 0 { c.world } else { 1 },
                };
                store_tile_tma_to(
                    ring,
                    outs,
                    Tile {
                        m0: local.m0 - j * block_rows,
                        n0: local.n0,
                    },
                    wg - 1,
                    acc,
                    staged,
                );
            }
        }
        pending.older = pending.newer.take();
        pending.newer = Some(Pending { dest, mt });
    }
    true
}
