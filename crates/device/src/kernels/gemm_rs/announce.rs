//! Announcing finished GEMM+ReduceScatter/AllReduce tiles (without stagers): the pending tiles
//! and the rule that says when their bulk stores are complete.
use super::shared::{node_blocks, RS_TILE};
use crate::arch::memory::Scope;
use crate::arch::sync::named_barrier_or;
use crate::arch::{ids, memory, tma};
use crate::comm::CommCtx;
use crate::gemm::TILE;
use mkernel_config::comm::FlagSlot;
use mkernel_config::ops::gemm_rs::GemmRsArgs;
use mkernel_config::GemmTile;

/// Tiles whose completion is still to be announced: the previous one and the one before it.
pub(super) struct Pendings {
    pub(super) older: Option<Pending>,
    pub(super) newer: Option<Pending>,
}

/// Epilogue bulk-store groups per tile and consumer warpgroup (one per staging box).
pub(super) const TILE_GROUPS: u32 = RS_TILE.block_n / GemmTile::EPILOGUE_BOX_COLS;

/// Whether another rank waits for a tile's announcement before the end of its tile loop: a
/// partial for a local peer, or part of a node sum for another node.
#[inline(always)]
pub(super) fn awaited_in_loop(c: &CommCtx, a: &GemmRsArgs, p: Pending) -> bool {
    let (nodes, _, block_rows) = node_blocks(c, a.m);
    p.dest != c.rank || p.mt * TILE.block_m / block_rows + 1 < nodes
}

/// Announces the older pending tile (if any, and if it is announced at all): its bulk stores
/// are complete once at most the newer tile's `TILE_GROUPS` groups are in flight. False when
/// the warpgroup stops.
#[inline(always)]
pub(super) unsafe fn announce_older(c: &CommCtx, a: &GemmRsArgs, pending: &mut Pendings, wg: u32, stop: bool) -> bool {
    match pending.older.take() {
        Some(p) if announced(c, a, p) => unsafe { publish::<TILE_GROUPS>(c, a, p, wg, stop) },
        _ => true,
    }
}

/// Announces the newer pending tile (every bulk store complete). False when the warpgroup
/// stops.
#[inline(always)]
pub(super) unsafe fn announce_newer(c: &CommCtx, a: &GemmRsArgs, pending: &mut Pendings, wg: u32, stop: bool) -> bool {
    match pending.newer.take() {
        Some(p) if announced(c, a, p) => unsafe { publish::<0>(c, a, p, wg, stop) },
        _ => true,
    }
}

/// A tile whose completion is announced at a later tile's epilogue.
#[derive(Clone, Copy)]
pub(super) struct Pending {
    /// Destination local rank (this rank: an own tile).
    pub(super) dest: u32,
    /// Row tile inside the chunk.
    pub(super) mt: u32,
}

/// Whether a finished tile is announced (by [`publish`] at the next tile's epilogue): peer
/// partials, AllReduce's rows for the local peers, every own tile across nodes. An own
/// ReduceScatter tile on one node concerns nobody else.
#[inline(always)]
pub(super) fn announced(c: &CommCtx, a: &GemmRsArgs, p: Pending) -> bool {
    p.dest != c.rank || c.global_world > c.world || (a.all_reduce != 0 && c.world > 1)
}

/// Consumer warpgroup `wg`'s announcement of its half of a pending tile, once its leader's
/// bulk stores of it completed (at most `NEWER_GROUPS` newer groups in flight; `red.release.gpu`,
/// +1 each, all local): a peer's partial counts in `(Outbox, peer, mt)` (the comm CTAs copy a
/// row tile on once it is full; without them the relay warps raise `(Tile1, rank, mt)` at the
/// peer: pushed, the partial is there; pulled, the peer may read it from our outbox); an own
/// AllReduce tile of the own node's block in `(Outbox, rank, mt)` (the relays raise
/// `(Tile2, rank, mt)` at every local peer: [`relay_role`]); across nodes an own tile also in
/// its block's `NodeSum`, which the block's sender warp waits for ([`send_node_block`]). The
/// warpgroup's barrier also ORs `stop` (the rank aborted, read by the leader at the tile's
/// start): false then, and the warpgroup stops.
#[inline(always)]
pub(super) unsafe fn publish<const NEWER_GROUPS: u32>(
    c: &CommCtx,
    a: &GemmRsArgs,
    p: Pending,
    wg: u32,
    stop: bool,
) -> bool {
    let leader = ids::thread_in_warpgroup() == 0;
    if leader {
        tma::store_wait::<NEWER_GROUPS>();
        memory::fence_proxy_async();
    }
    if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, stop) {
        return false;
    }
    if !leader {
        return true;
    }
    let (nodes, _, block_rows) = node_blocks(c, a.m);
    let j = p.mt * TILE.block_m / block_rows;
    unsafe {
        // Counted locally with a release at GPU scope (one at system scope stalls the
        // warpgroup for the NVLink round trip); comm CTAs or the relay warps carry it to the
        // peers.
        if p.dest != c.rank || (a.all_reduce != 0 && j + 1 == nodes && c.world > 1) {
            memory::red_release_add_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::Outbox, p.dest, p.mt), 1);
        }
        if p.dest != c.rank {
            return true;
        }
        if nodes > 1 && (j + 1 < nodes || a.all_reduce != 0) {
            memory::red_release_add_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::NodeSum, c.rank, j), 1);
        }
    }
    true
}
