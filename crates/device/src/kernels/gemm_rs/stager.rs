//! The stagers: each consumer warpgroup's epilogue I/O (partial loads, bulk stores, trickled
//! where they cross NVLink, announcements) on a producer-warpgroup thread.
use super::relay::RELAY_SLEEP_NS;
use super::shared::{free_slots, staging_ready, tile_staged};
use super::shared::{fused_ctx_at, largs, ldesc, lepoch, rank_world, tile1_full, RS_RING, RS_TILE, STAGE_PARITY};
use super::work_items::{stream_k, table_item};
use crate::arch::memory::Scope;
use crate::arch::sync::named_barrier_or;
use crate::arch::tma::TensorMap;
use crate::arch::{ids, mbarrier, memory, smem, tma};
use crate::comm::wait::{local_stall, stall_or_abort, wait_flag_of_cta, wait_flag_of_cta_from};
use crate::gemm::epilogue::{store_tile_tma_to, StagedOnly};
use crate::gemm::ring::Ring;
use crate::gemm::scheduler::Tile;
use crate::gemm::{trace, TILE};
use mkernel_config::comm::{wait_code, CommDesc, FlagSlot, Role};
use mkernel_config::ops::gemm_rs::{GemmRsArgs, STAGER_STORE_ROWS};
use mkernel_config::trace::{End, Mark};
use mkernel_config::GemmTile;

/// Whether each consumer warpgroup's epilogue I/O is handed to a stager thread
/// ([`stager_role`]; the host sets it on one node of 2 ranks, partials pushed by the compute
/// CTAs: no comm CTAs, not pulled). Elsewhere the consumers issue their bulk stores and
/// partial loads themselves.
#[inline(always)]
pub(super) fn stager_runs(a: &GemmRsArgs) -> bool {
    // The host's choice, checked against what the stager assumes (one peer, one node, pushed).
    let d = ldesc() as *const CommDesc;
    let (world, global_world) = unsafe {
        (
            (&raw const (*d).world).read_volatile(),
            (&raw const (*d).global_world).read_volatile(),
        )
    };
    a.stager != 0 && world == 2 && global_world == 2 && a.n_comm == 0 && a.pull == 0
}

/// The epilogue of a tile with a stager ([`stager_role`]): wait until the warpgroup's staging
/// is ready (`staging_ready(wg)`: free, or holding the peer's partial of an own tile), write the tile
/// into it (an own tile: the partial added, `ldmatrix`), and tell the stager (`tile_staged(wg)`),
/// which stores and announces it. No bulk store or flag is touched here: the warpgroup goes
/// back to its tensor cores at once. False when the rank aborted.
///
/// # Safety
///
/// The role contract (`crate::kernels::gemm_rs`), with stagers; called by every thread of consumer warpgroup `wg` after
/// the mainloop of `local` retired its wgmmas, with `ready` the warpgroup's tracked `staging_ready(wg)` parity and
/// `own` whether the tile is an own tile.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn stager_epilogue(
    ring: &Ring,
    local: Tile,
    wg: u32,
    acc: &mut [f32; 128],
    ready: &mut u32,
    own: bool,
    stop: bool,
    mark: impl Fn(Mark),
) -> bool {
    mark(Mark::Published);
    let parity = (*ready & STAGE_PARITY != 0) as u32;
    *ready ^= STAGE_PARITY;
    let desc = ldesc();
    // Bounded: gives up once the rank aborts or past the hung bound (a record either way; a
    // stager that gave up leaves its record to this wait). A stager that stops early arrives
    // once more (`stager_role`), so in an aborted launch this passes at once and `stop` ends
    // the tile; where `stop` was read before the abort, the next tile's wait finds the abort
    // word at a stall check, every [`STAGING_CHECK_TRIES`] tries.
    let ok = crate::arch::time::poll_until::<0>(
        STAGING_CHECK_TRIES,
        || unsafe { mbarrier::try_wait_parity(staging_ready(ring, wg), parity) },
        local_stall::<true>(desc, Role::Compute, wait_code::STAGING, wg),
    );
    if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, !ok || stop) {
        return false;
    }
    mark(Mark::Waited);
    mark(Mark::Added);
    // The staging's reads (an own tile's partial) and writes below are this warpgroup's; the
    // stager's earlier bulk stores had finished reading it before it arrived on `staging_ready(wg)`.
    unsafe { store_tile_tma_to(ring, StagedOnly, local, wg - 1, acc, own) };
    if ids::thread_in_warpgroup() == 0 {
        unsafe { mbarrier::arrive(tile_staged(ring, wg)) };
    }
    true
}

/// Failed tests of the staging's mbarrier between a consumer warpgroup's checks of the abort
/// word in [`stager_epilogue`]: fewer than the GEMM ring's `mbarrier::TRIES_PER_STALL_CHECK`
/// (16 384), because a failed `mbarrier.try_wait` may suspend the thread up to a hardware time
/// limit and the stager these consumers wait for may have stopped; docs/protocol.md, "Abort and
/// reset", has the measurement that set it.
pub(super) const STAGING_CHECK_TRIES: u32 = 1024;

/// What a stager's staging holds for the tile ahead: nothing in flight, told to its consumers.
pub(super) const ARRIVED: u32 = 3;

/// Makes consumer warpgroup `cw`'s staging ready for `tile` (phase `parity` of `staging_ready(1 + cw)`):
/// an own tile's peer partial is TMA-loaded into it (the caller saw the peer's counter full:
/// the partial was written by the peer's bulk stores and announced by a generic release, so
/// the load, through the async proxy, comes after `fence.proxy.async`); for a peer tile it
/// just arrives. Returns the stager's `loading` state: `parity` (a load in flight) or
/// [`ARRIVED`].
///
/// # Safety
///
/// The role contract (`crate::kernels::gemm_rs`); called by the stager of consumer warpgroup `cw` ([`stager_role`])
/// once that warpgroup's staging is free, with `parity` the current phase of `staging_ready(1 + cw)`; for an own tile,
/// after it acquired the peer's counter of `tile`'s row tile.
#[inline(always)]
pub(super) unsafe fn stager_ready(cw: u32, tile: Tile, parity: u32) -> u32 {
    let a = unsafe { &*(largs() as *const GemmRsArgs) };
    let (rank, world) = unsafe { rank_world(ldesc()) };
    let chunk_rows = a.m / world;
    let ready = staging_ready(&Ring::new(smem::dynamic_smem_addr(), RS_RING), 1 + cw);
    if tile.m0 / chunk_rows != rank {
        unsafe { mbarrier::arrive(ready) };
        return ARRIVED;
    }
    memory::fence_proxy_async();
    unsafe { mbarrier::arrive_expect_tx(ready, RS_TILE.epilogue_buffers * RS_TILE.epilogue_box_bytes()) };
    let map = TensorMap(a.map_in as *const u8);
    let row0 = (rank + 1) % world * chunk_rows + (tile.m0 - rank * chunk_rows) + cw * TILE.rows_per_consumer();
    for q in 0..RS_TILE.epilogue_buffers {
        let dst = Ring::new(smem::dynamic_smem_addr(), RS_RING).staging(cw, q);
        // Read once: first to leave L2.
        unsafe {
            tma::load_2d_hinted(
                dst,
                map,
                tile.n0 + GemmTile::EPILOGUE_BOX_COLS * q,
                row0,
                ready,
                tma::evict_first_policy(),
            )
        };
    }
    parity
}

/// The stager of consumer warpgroup `cw` of compute CTA `idx` (lane 0 of producer warp
/// `1 + 2 cw`; [`stager_runs`]): the warpgroup's epilogue I/O, so its `wgmma` issue never
/// waits for NVLink. For each tile of the CTA, in the consumers' order:
/// 1. makes the staging ready (`staging_ready(1 + cw)`, [`stager_ready`]): an own tile's peer partial
///    is TMA-loaded into it once the peer's counter `(Tile1, peer, mt)` is full (completing
///    the barrier with its bytes); for a peer tile it just arrives;
/// 2. waits until the consumers wrote the tile into it (`tile_staged(1 + cw)`);
/// 3. issues its bulk stores (a peer tile: into this rank's slot of the peer's receive buffer;
///    an own tile: to the output, AllReduce: to every local rank's output) in pieces of
///    [`STAGER_STORE_ROWS`] rows; an AllReduce tile's or a peer partial's trickle as the
///    consumers pass the K blocks of their next mainloop (each stager at its own points,
///    [`trickle_point`]; AllReduce's local copy beside the NVLink ones), ReduceScatter's own
///    output at once;
/// 4. waits until the stores are complete and announces the half tile locally
///    (`red.release.gpu` +1 on `(Outbox, dest, mt)`: a peer partial, or AllReduce's reduced
///    rows) for the relays.
///
/// Every tile is announced before the wait for a later tile's counter (the deadlock-freedom
/// rule of [`publish`], met early). Waits are bounded (error record, abort); on an abort it
/// stops once its stores and loads are done with the staging, and arrives on the consumers'
/// staging barrier if it had not for its next phase, so they pass it at once and stop.
///
/// # Safety
///
/// The role contract (`crate::kernels::gemm_rs`), when [`stager_runs`] says the stagers run; called by lane 0 of
/// producer warp `1 + 2 cw` of compute CTA `idx` only (`cw` 0 or 1).
#[inline(always)]
pub(super) unsafe fn stager_role(idx: u32, cw: u32) {
    // Only the loop's own state lives across it (56 registers): the context is rebuilt where
    // a wait needs it, the ring's addresses recomputed.
    let epoch = lepoch();
    let ctx = || {
        let mut c = unsafe { fused_ctx_at(ldesc(), epoch) };
        c.role = Role::Stager;
        c.cta = idx;
        c
    };
    let ring = || Ring::new(smem::dynamic_smem_addr(), RS_RING);
    // Its two shared-memory waits - the consumers' "staged", their ring progress - give up
    // once the rank aborts or past the hung bound, without a record of their own (record code
    // does not fit this thread's 56 registers without spills): its consumers then stall on their
    // staging ([`stager_epilogue`]) and record that (Aborted, or a STAGING timeout).
    let give_up = stall_or_abort(ldesc());
    // The phase of `ready` whose TMA load may still land (NONE, ARRIVED: none), waited for
    // before stopping.
    pub(super) const NONE: u32 = 2;
    let mut loading = NONE;
    let (mut w, mut parity) = (0u32, 0u32);
    // The peer's receive buffer and output are open.
    let mut ok = unsafe {
        let (rank, world) = rank_world(ldesc());
        wait_flag_of_cta(&ctx(), FlagSlot::FusedReady, (rank + 1) % world, 0, epoch)
    };
    while ok && w < stream_k().items(idx) {
        // The consumers' work item `w` (from the work-item table: the host runs stagers only
        // where every item fits it). A stream-K contributor piece has no epilogue.
        let a = unsafe { &*(largs() as *const GemmRsArgs) };
        let it = unsafe { table_item(w) };
        w += 1;
        if !it.owner {
            continue;
        }
        // 1. The staging, ready for this tile.
        {
            let (rank, world) = unsafe { rank_world(ldesc()) };
            let chunk_rows = a.m / world;
            let dest = it.tile.m0 / chunk_rows;
            let mt = (it.tile.m0 - dest * chunk_rows) / TILE.block_m;
            // (The peer is `rank ^ 1`: stagers run on 2 ranks only. Read again where the wait
            // uses it, the flag's address and the error record: kept across the wait, it does
            // not fit the 56 registers.)
            let c = ctx();
            if dest == rank
                && !unsafe {
                    wait_flag_of_cta_from::<RELAY_SLEEP_NS>(
                        &c,
                        FlagSlot::Tile1,
                        |c| c.rank_now() ^ 1,
                        mt,
                        tile1_full(a),
                    )
                }
            {
                break;
            }
            // (The tile read again: kept across the wait, it does not fit the 56 registers.)
            loading = unsafe { stager_ready(cw, table_item(w - 1).tile, parity) };
        }
        let staged = tile_staged(&ring(), 1 + cw);
        // 2. The consumers' tile in the staging.
        // (Sleeping between tests: this thread shares its SM with the tensor cores' issue.)
        ok = unsafe { mbarrier::wait_parity_sleeping_or::<RELAY_SLEEP_NS>(staged, parity, give_up) };
        if !ok {
            break;
        }
        loading = NONE;
        parity ^= 1;
        // 3. Its bulk stores, piece by piece ([`STAGER_STORE_ROWS`] rows of one staging box).
        // Those that cross NVLink (a peer's partial, AllReduce's reduced rows) trickle when
        // more work follows: piece p of P once the consumers reach a K block in
        // [p + 1/4, p + 3/4) k / P of their next mainloop, staggered over the stagers
        // ([`trickle_point`]; k K blocks; before an own tile, whose peer partial is loaded
        // into the staging once these stores are complete, over its first half, so the load
        // lands before its epilogue). A burst of every CTA's tile at once holds up the next
        // mainloop's loads, and pacing by time rather than by the consumers' progress slows
        // every mainloop (docs/fused.md).
        // Everything but the loop's counters is derived again for each piece (from the shared
        // copies and the item table): kept live across the loop it does not fit in the
        // stager's 56 registers.
        const PIECES: u32 = GemmTile::EPILOGUE_BOX_ROWS / STAGER_STORE_ROWS * RS_TILE.epilogue_buffers;
        // An own AllReduce tile's copy into this rank's output (no NVLink) goes out with each
        // piece's copies for the peers, at the same staggered points: issued at once it puts
        // 64 KiB on the SM's TMA unit, queued ahead of the operand loads (docs/fused.md).
        let mut p = 0;
        while p < PIECES {
            let a = unsafe { &*(largs() as *const GemmRsArgs) };
            let (rank, world) = unsafe { rank_world(ldesc()) };
            let chunk_rows = a.m / world;
            let tile = unsafe { table_item(w - 1) }.tile;
            let dest = tile.m0 / chunk_rows;
            let local = Tile {
                m0: tile.m0 - dest * chunk_rows,
                n0: tile.n0,
            };
            let sk = stream_k();
            if (dest != rank || a.all_reduce != 0) && w < sk.items(idx) {
                // The consumers compute K block x of the launch once they released block
                // x - 1, i.e. once the producer found x + stages slots free (the last loads'
                // slots are never waited for: capped).
                let next = unsafe { table_item(w) };
                let spread = if next.tile.m0 / chunk_rows == rank {
                    4 * PIECES
                } else {
                    2 * PIECES
                };
                let x = sk.k_before(idx, w) + trickle_point(p, next.k_len(), spread, idx, cw);
                if !unsafe { wait_tick(free_slots(&ring()), (x + RS_TILE.stages).min(sk.k_total(idx)), give_up) } {
                    ok = false;
                    break;
                }
            }
            let dests = if dest != rank {
                1
            } else if a.all_reduce != 0 {
                world
            } else {
                1
            };
            for d in 0..dests {
                let map = unsafe {
                    if dest != rank {
                        *a.map_recv.as_ptr().add(dest as usize)
                    } else {
                        *a.map_out.as_ptr().add(d as usize)
                    }
                };
                unsafe { stager_store(map, local, cw, p) };
            }
            tma::store_commit();
            p += 1;
        }
        if !ok {
            break;
        }
        // 4. Complete: announced (the tile derived again, as above).
        tma::store_wait::<0>();
        memory::fence_proxy_async();
        let a = unsafe { &*(largs() as *const GemmRsArgs) };
        let (rank, world) = unsafe { rank_world(ldesc()) };
        let chunk_rows = a.m / world;
        let tile = unsafe { table_item(w - 1) }.tile;
        let dest = tile.m0 / chunk_rows;
        if dest != rank || a.all_reduce != 0 {
            let mt = (tile.m0 - dest * chunk_rows) / TILE.block_m;
            unsafe { memory::red_release_add_u64(Scope::Gpu, ctx().flag_of_cta(rank, FlagSlot::Outbox, dest, mt), 1) };
        }
    }
    // Stopping early: nothing may still read or fill the staging when the CTA exits.
    tma::store_wait::<0>();
    if loading < NONE {
        // A TMA load this thread issued: it lands unless memory failed (bounded by a trap: the
        // CTA must not exit while it may still write the staging).
        unsafe { mbarrier::wait_parity(staging_ready(&ring(), 1 + cw), loading) };
    } else if loading == NONE {
        // The phase the consumers wait for next was not arrived on: arrive now (nothing of this
        // thread reads or fills the staging any more), so consumers that are still to reach
        // their epilogue pass at once and stop there (`stop`, the abort word read at the
        // tile's start), rather than stall until a check of theirs finds the abort word. After
        // the last tile nobody waits for it.
        unsafe { mbarrier::arrive(staging_ready(&ring(), 1 + cw)) };
    }
    let a = unsafe { &*(largs() as *const GemmRsArgs) };
    unsafe { trace::end(a.trace, idx, if cw == 0 { End::Stager0Done } else { End::Stager1Done }) };
}

/// Piece `p` of consumer warpgroup `cw`'s staged half of tile `local` (rows inside the
/// destination's chunk) as one bulk store through `map` ([`STAGER_STORE_ROWS`] rows of a
/// staging box). Nothing reads it again soon (a peer's partial only rounds later, at its
/// owner; an output tile not in this launch), so its lines are the first to leave L2, ahead of
/// the operands the mainloops still read (docs/fused.md measures the cache policies).
///
/// # Safety
///
/// The role contract (`crate::kernels::gemm_rs`); called by the stager of consumer warpgroup `cw` once the warpgroup
/// wrote the tile into its staging (`tile_staged(1 + cw)` passed), with `map` the address of the destination's tensor
/// map (a peer's receive buffer or an output; box `EPILOGUE_BOX_COLS` x `STAGER_STORE_ROWS`) and `p` below the stager's
/// piece count (`EPILOGUE_BOX_ROWS / STAGER_STORE_ROWS * epilogue_buffers`); the staging is not rewritten before the
/// store has read it.
// `PER_BOX` is 1 with the current `STAGER_STORE_ROWS` (`p % PER_BOX` is then 0); the split is kept for other values.
#[allow(clippy::modulo_one)]
#[inline(always)]
pub(super) unsafe fn stager_store(map: u64, local: Tile, cw: u32, p: u32) {
    const PER_BOX: u32 = GemmTile::EPILOGUE_BOX_ROWS / STAGER_STORE_ROWS;
    let (q, r) = (p / PER_BOX, p % PER_BOX);
    let src = Ring::new(smem::dynamic_smem_addr(), RS_RING)
        .staging(cw, q)
        .add(r * STAGER_STORE_ROWS * GemmTile::EPILOGUE_BOX_COLS * 2);
    let (c0, c1) = (
        local.n0 + GemmTile::EPILOGUE_BOX_COLS * q,
        local.m0 + cw * TILE.rows_per_consumer() + r * STAGER_STORE_ROWS,
    );
    unsafe { tma::store_2d_hinted(TensorMap(map as *const u8), c0, c1, src, tma::evict_first_policy()) };
}

/// Waits (sleeping between polls) until a tick counter ([`Ring::tick`]) reached `target`;
/// false when `give_up` says so.
///
/// # Safety
///
/// `tick` is a tick word of this CTA's ring ([`Ring::tick`]), written only with volatile stores by the thread that
/// counts it.
#[inline(always)]
pub(super) unsafe fn wait_tick(tick: smem::SmemAddr, target: u32, give_up: impl Fn(u64) -> bool) -> bool {
    crate::arch::time::poll_until::<RELAY_SLEEP_NS>(
        1024,
        || unsafe { smem::ld_volatile_shared_u32(tick) } >= target,
        give_up,
    )
}

/// The K block of the next item (of `k_len` K blocks) after which piece `p` of a trickled
/// store goes out (the caller's `spread` is twice the pieces per item, or four times before an
/// own tile: piece `p`'s span is K blocks `[p, p + 1) 2 k_len / spread`). Each stager takes
/// one of 8 points in the middle half of the span (by CTA and warpgroup): the CTAs finish their
/// tiles nearly together, and pieces that every stager issues at the same point go out as one
/// burst that holds up the SMs' operand loads; staggered, the first round with NVLink stores
/// runs its mainloops as fast as the later ones (measurements in docs/fused.md).
#[inline(always)]
pub(super) fn trickle_point(p: u32, k_len: u32, spread: u32, idx: u32, cw: u32) -> u32 {
    let phase = ((2 * idx + cw) * 3) & 7;
    (16 * p + 4 + phase) * k_len / (8 * spread)
}
