//! A compute CTA's work items (whole tiles, then stream-K pieces) and their table in shared
//! memory.
use super::shared::{largs, ldesc, rank_world, RS_TILE};
use super::stager::stager_runs;
use crate::arch::{ids, smem};
use crate::gemm::scheduler::{Tile, TileScheduler};
use crate::gemm::TILE;
use mkernel_config::comm::CommDesc;
use mkernel_config::ops::gemm_rs as rs_op;
use mkernel_config::ops::gemm_rs::{rs_source_row, GemmRsArgs};
use mkernel_config::stream_k::StreamK;

/// This launch's stream-K plan ([`StreamK`]): `GemmRsArgs::sk_tiles` where stagers run (the
/// host sets it only there), none elsewhere. Read afresh (volatile) from the arguments' shared
/// copy at each call, so a loop that calls it keeps none of it live in registers.
#[inline(always)]
pub(super) fn stream_k() -> StreamK {
    let a = largs() as *const GemmRsArgs;
    let field = |f: *const u32| unsafe { f.read_volatile() };
    let (m, n, k, n_comm) = unsafe {
        (
            field(&raw const (*a).m),
            field(&raw const (*a).n),
            field(&raw const (*a).k),
            field(&raw const (*a).n_comm),
        )
    };
    let on = unsafe { (&raw const (*a).sk_ws).read_volatile() != 0 && stager_runs(&*a) };
    let sk = if on {
        unsafe { field(&raw const (*a).sk_tiles) }
    } else {
        0
    };
    StreamK::new(
        m.div_ceil(TILE.block_m) * n.div_ceil(TILE.block_n),
        ids::grid_dim() - n_comm,
        k.div_ceil(TILE.block_k),
        sk,
    )
}

/// A compute CTA's work item as both the producer and the consumers use it: the tile (in the
/// scheduler's node-blocked rows), its K blocks `k0..k1`, whether this CTA runs its epilogue
/// (and from which contributor CTA on, [`StreamK`]), and the row of A it reads.
#[derive(Clone, Copy)]
pub(super) struct ItemRec {
    pub(super) tile: Tile,
    pub(super) k0: u32,
    pub(super) k1: u32,
    pub(super) owner: bool,
    pub(super) from: u32,
    pub(super) a_row: u32,
    /// The tile's rows are this rank's chunk (an own tile).
    pub(super) own: bool,
    /// Stagers do this launch's epilogue I/O ([`stager_runs`]).
    pub(super) stager: bool,
    /// The tile's first row inside its chunk (the destination rank's rows).
    pub(super) local_m0: u32,
}

impl ItemRec {
    #[inline(always)]
    pub(super) fn k_len(&self) -> u32 {
        self.k1 - self.k0
    }
}

/// Works out item `w` of compute CTA `idx` (the stream-K plan, the chunked scheduler and A's
/// source row; some 30 integer divisions), everything re-read from the shared copies.
#[inline(always)]
pub(super) unsafe fn compute_item(idx: u32, w: u32) -> ItemRec {
    let a = unsafe { &*(largs() as *const GemmRsArgs) };
    let d = unsafe { &*(ldesc() as *const CommDesc) };
    let it = stream_k().item(idx, w);
    let (rank, world) = unsafe { rank_world(ldesc()) };
    let tiles = TileScheduler::new(
        a.m,
        a.n,
        TILE.block_m,
        TILE.block_n,
        a.group_m,
        idx,
        ids::grid_dim() - a.n_comm,
    )
    .chunked(world, rank, a.part_tiles_m);
    let tile = tiles.tile(it.tile);
    let (nodes, node) = (d.global_world / world, d.global_rank / world);
    // The scheduler walks node-blocked rows; A is read at the row they stand for.
    let a_row = rs_source_row(tile.m0, a.m, world, nodes, node);
    let chunk_rows = a.m / world;
    let dest = tile.m0 / chunk_rows;
    ItemRec {
        tile,
        k0: it.k0,
        k1: it.k1,
        owner: it.owner,
        from: it.from,
        a_row,
        own: dest == rank,
        stager: stager_runs(a),
        local_m0: tile.m0 - dest * chunk_rows,
    }
}

/// Record `w` of the work-item table (`GemmRsSmem::items`).
#[inline(always)]
pub(super) fn item_slot(w: u32) -> smem::SmemAddr {
    smem::dynamic_smem_addr().add(rs_op::ITEMS_OFFSET + w * rs_op::ITEM_BYTES)
}

/// Fills the work-item table of this compute CTA (every thread of the CTA, before the role
/// split; a CTA barrier must follow): records `0..min(items, capacity)`.
#[inline(always)]
pub(super) unsafe fn fill_item_table(idx: u32) {
    let items = stream_k().items(idx).min(rs_op::ITEM_TABLE_ENTRIES as u32);
    let mut w = ids::thread_idx_reread();
    while w < items {
        let r = unsafe { compute_item(idx, w) };
        unsafe {
            smem::st_shared_v4(item_slot(w), [r.tile.m0, r.tile.n0, r.k0, r.k1]);
            let flags = if r.owner { rs_op::ITEM_OWNER } else { 0 }
                | if r.own { rs_op::ITEM_OWN } else { 0 }
                | if r.stager { rs_op::ITEM_STAGER } else { 0 };
            smem::st_shared_v4(
                item_slot(w).add(rs_op::ITEM_META_OFFSET),
                [flags, r.from, r.a_row, r.local_m0],
            );
        }
        w += RS_TILE.threads();
    }
}

/// Item `w` (below the table's capacity) from the table.
#[inline(always)]
pub(super) unsafe fn table_item(w: u32) -> ItemRec {
    let (x, y) = unsafe {
        (
            smem::ld_shared_v4(item_slot(w)),
            smem::ld_shared_v4(item_slot(w).add(rs_op::ITEM_META_OFFSET)),
        )
    };
    ItemRec {
        tile: Tile { m0: x[0], n0: x[1] },
        k0: x[2],
        k1: x[3],
        owner: y[0] & rs_op::ITEM_OWNER != 0,
        from: y[1],
        a_row: y[2],
        own: y[0] & rs_op::ITEM_OWN != 0,
        stager: y[0] & rs_op::ITEM_STAGER != 0,
        local_m0: y[3],
    }
}

/// Item `w` of compute CTA `idx`: two shared-memory loads from the table, or worked out past
/// its capacity.
#[inline(always)]
pub(super) unsafe fn item(idx: u32, w: u32) -> ItemRec {
    if w < rs_op::ITEM_TABLE_ENTRIES as u32 {
        unsafe { table_item(w) }
    } else {
        unsafe { compute_item(idx, w) }
    }
}
