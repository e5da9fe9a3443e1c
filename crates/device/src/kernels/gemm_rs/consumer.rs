//! A consumer warpgroup of a compute CTA: the tile loop (mainloop, stream-K pieces, the
//! epilogue: with stagers [`super::stager::stager_epilogue`], else [`super::epilogue::rs_epilogue`])
//! and the end of the launch's work (AllReduce: waiting for the other ranks' rows).
use super::announce::{announce_newer, announce_older, Pendings};
use super::epilogue::{prefetch_partials, rs_epilogue, stage_first_partial};
use super::shared::staging_ready;
use super::shared::{fused_ctx_at, ldesc, lepoch, node_blocks, rank_world, HALVES, RS_RING, STAGED, STAGE_PARITY};
use super::stager::stager_epilogue;
use super::stream_k::{add_sk_partials, write_sk_partial};
use super::trickle::Trickle;
use super::work_items::{item, stream_k};
use crate::arch::sync::named_barrier_or;
use crate::arch::{ids, smem};
use crate::comm::launch::{abort_word, aborted, consumer_stall};
use crate::comm::wait::{wait_flag_of_cta, wait_mbarrier};
use crate::gemm::consumer::{drain_tile, mma_tile_hooked};
use crate::gemm::epilogue::drain_tma_stores;
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::scheduler::Tile;
use crate::gemm::{trace, BLayout, TILE};
use mkernel_config::comm::{wait_code, FlagSlot, Role};
use mkernel_config::ops::gemm_rs::GemmRsArgs;
use mkernel_config::trace::{tile_kind, End, Mark};

/// The tile loop of this thread's consumer warpgroup.
#[inline(always)]
pub(super) unsafe fn run(a: &GemmRsArgs, pos: RingPos) {
    let mut pos = pos;
    let compute_idx = || ids::block_idx_reread() - a.n_comm;
    let (wg, idx) = (ids::warpgroup_idx_reread(), compute_idx());
    let ring = Ring::new(smem::dynamic_smem_addr(), RS_RING);
    // Only the tile loop's own state lives across the mainloop (next to 128 accumulators):
    // the context is re-read from the descriptor in each tile (volatile reads, so nothing
    // derived from it is hoisted out of the loop and kept live, which ptxas spills).
    let epoch = lepoch();
    let mut ready: u32 = 1 << unsafe { rank_world(ldesc()) }.0; // local ranks whose buffers we may write
    let mut acc = [0f32; 128];
    let mut pending = Pendings {
        older: None,
        newer: None,
    };
    let mut trickle = Trickle::NONE;
    // The optional timeline (thread 0 of the first consumer warpgroup): this CTA's tile count.
    let mut traced = 0u32;
    let first = ids::thread_idx_reread() == crate::arch::ids::WARPGROUP_THREADS;
    let mark = |i: u32, m: Mark| {
        if first {
            unsafe { trace::mark(a.trace, idx, i, m) }
        }
    };
    // Work items: whole tiles, then (stream-K) K ranges of the last tiles, the first of which
    // may be a contributor piece (no epilogue: its partial goes to the workspace).
    // (Each read from the work-item table, [`item`].)
    let items = stream_k().items(idx);
    let mut w = 0u32;
    while w < items {
        let it = unsafe { item(idx, w) };
        w += 1;
        let tile = it.tile;
        mark(traced, Mark::Begin);
        // Read now by every thread, used at this tile's epilogue barrier: the load's register
        // is first read there, so its latency hides under the mainloop (read by the leader
        // alone and turned into a flag at once, the warpgroup waited for it here).
        let abort_word = unsafe { abort_word(ldesc()) };
        unsafe {
            let (rank, world) = rank_world(ldesc());
            if it.own && !it.stager && world > 1 {
                // The staging still holds the previous peer tile while its boxes trickle out
                // (uniform in the warpgroup): this tile then adds its first partial from global
                // memory too, rather than wait here for those NVLink stores.
                let staged = trickle.left == 0 && stage_first_partial(a, &ring, tile, wg, rank, world);
                if staged {
                    ready |= STAGED;
                } else {
                    ready &= !STAGED;
                }
                prefetch_partials(a, tile, rank, world, staged);
            }
            mark(traced, Mark::Mainloop);
            mma_tile_hooked::<true>(
                &ring,
                &mut pos,
                &mut acc,
                wg - 1,
                BLayout::Nk,
                it.k_len(),
                consumer_stall(ldesc()),
                &mut trickle,
            );
            // (A short K leaves boxes over.)
            trickle.flush(&ring, wg - 1);
            mark(traced, Mark::MainloopDone);
            if first {
                let kind = if !it.owner {
                    tile_kind::PIECE
                } else if it.own {
                    tile_kind::OWN
                } else {
                    tile_kind::PEER
                };
                trace::tile(
                    a.trace,
                    idx,
                    traced,
                    tile.m0 / TILE.block_m,
                    tile.n0 / TILE.block_n,
                    kind,
                );
            }
            let stop = ids::thread_in_warpgroup() == 0 && abort_word != 0;
            let done = if it.owner {
                // A stream-K tile's earlier K ranges (other CTAs' first pieces) are added
                // first.
                // With stagers the epilogue is theirs: the tile's place comes from its record.
                (it.from == idx || add_sk_partials(a, epoch, it.from, idx, wg, &mut acc))
                    && if it.stager {
                        stager_epilogue(
                            &ring,
                            Tile {
                                m0: it.local_m0,
                                n0: tile.n0,
                            },
                            wg,
                            &mut acc,
                            &mut ready,
                            it.own,
                            stop,
                            |m| mark(traced, m),
                        )
                    } else {
                        rs_epilogue(
                            a,
                            epoch,
                            &ring,
                            tile,
                            wg,
                            &mut acc,
                            &mut ready,
                            &mut pending,
                            &mut trickle,
                            stop,
                            |m| mark(traced, m),
                        )
                    }
            } else {
                // A stream-K contributor piece: to the workspace, for the tile's owner.
                write_sk_partial(a, epoch, idx, wg, &acc, |m| mark(traced, m));
                true
            };
            if !done {
                // A wait gave up or the rank aborted (the error record is written): stop, once
                // the bulk stores stopped reading shared memory and a staged partial's load
                // (always completes) has landed.
                drain_tma_stores();
                if ready & STAGED != 0 {
                    let parity = (ready & STAGE_PARITY != 0) as u32;
                    let _ = wait_mbarrier(
                        staging_ready(&ring, wg),
                        parity,
                        ldesc(),
                        Role::Compute,
                        wait_code::STAGING,
                        wg,
                    );
                }
                // Keep freeing the ring's slots for this CTA's remaining work (without
                // computing): the producer and the other consumer warpgroup, which stops at its
                // next barrier (the abort word is up), run to the end.
                while w < items {
                    drain_tile(&ring, &mut pos, item(idx, w).k_len(), consumer_stall(ldesc()));
                    w += 1;
                }
                // AllReduce: both warpgroups vote once on barrier 3 before the completion wait
                // (the other may not have seen the abort yet).
                if a.all_reduce != 0 {
                    let _ = named_barrier_or(3, 2 * crate::arch::ids::WARPGROUP_THREADS, true);
                }
                return;
            }
        }
        mark(traced, Mark::Stored);
        traced += 1;
    }
    let end = |e: End| {
        if first {
            unsafe { trace::end(a.trace, idx, e) }
        }
    };
    let chunk_rows = a.m / unsafe { rank_world(ldesc()) }.1;
    end(End::LoopDone);
    let c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    let ct = ids::thread_idx_reread() - crate::arch::ids::WARPGROUP_THREADS;
    let stop = ids::thread_in_warpgroup() == 0 && unsafe { aborted(ldesc()) };
    unsafe { trickle.flush(&ring, wg - 1) };
    let published =
        unsafe { announce_older(&c, a, &mut pending, wg, stop) && announce_newer(&c, a, &mut pending, wg, stop) };
    drain_tma_stores();
    end(End::Drained);
    // AllReduce: every consumer warpgroup reaches this vote exactly once (also one that gave up
    // in its loop), so the completion wait below starts in both or in neither.
    let go_on = if a.all_reduce != 0 {
        !named_barrier_or(3, 2 * crate::arch::ids::WARPGROUP_THREADS, !published)
    } else {
        published
    };
    if !go_on {
        return;
    }
    if a.all_reduce != 0 {
        // The launch ends once every other rank's reduced rows are in our output: this CTA
        // waits for row tiles idx, idx + grid, ... of the own-node block of every local peer's
        // chunk (the remote ranks' PUTs: warp 3 of compute CTA 0).
        let (nodes, _, block_rows) = node_blocks(&c, a.m);
        let full = HALVES * a.n.div_ceil(TILE.block_n) as u64;
        let mut mt = (nodes - 1) * block_rows / TILE.block_m + idx;
        while mt < chunk_rows / TILE.block_m {
            let ok = ct >= c.world || ct == c.rank || unsafe { wait_flag_of_cta(&c, FlagSlot::Tile2, ct, mt, full) };
            if named_barrier_or(3, 2 * crate::arch::ids::WARPGROUP_THREADS, !ok) {
                return;
            }
            mt += ids::grid_dim() - a.n_comm;
        }
    }
    end(End::Done);
}
