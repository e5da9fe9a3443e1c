//! The producer: one thread walks the same tile sequence as the consumers and keeps the ring
//! full with TMA loads. For each K block it waits for the slot to be empty, announces the bytes
//! the slot will receive (`arrive.expect_tx`) and issues the loads that complete them.
use super::ring::{Ring, RingPos};
use super::scheduler::Tile;
use super::{BLayout, TILE};
use crate::arch::{mbarrier, smem::SmemAddr, tma, tma::TensorMap};

/// Bytes of one 64 (N) x 64 (K) box of an MN-major B tile.
const B_KN_BOX_BYTES: u32 = 64 * 64 * 2;

/// Loads the `k_blocks` K blocks of `tile` into the ring, starting at `pos`. A's rows are read
/// from row `a_row` of the tensor `a` (the tile's own `m0` for a plain GEMM; fused kernels may
/// point a tile at another tensor, e.g. the local shard instead of the gathered buffer).
/// False when a slot never frees up and `give_up` says to stop (its stall callback, see
/// [`mbarrier::wait_parity_or`]; a plain GEMM passes `mbarrier::trap_after(HUNG_NS)`); then
/// call [`wait_loads_landed`] before the CTA exits.
///
/// # Safety
///
/// The ring contract (`crate::gemm`); called by the one producer thread, with `pos` the producer's ring position; `a`
/// and `b` are tensor maps of A (box 64 x `block_m`) and B (`b_layout`'s box), and the consumers take the same
/// `k_blocks` slots for this tile. If it returns false, the caller calls [`wait_loads_landed`] before the CTA exits.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn load_tile(
    ring: &Ring,
    pos: &mut RingPos,
    a: TensorMap,
    a_row: u32,
    b: TensorMap,
    b_layout: BLayout,
    tile: Tile,
    k_blocks: u32,
    give_up: impl Fn(u64) -> bool + Copy,
) -> bool {
    unsafe { load_tile_counted::<false>(ring, pos, a, a_row, b, b_layout, tile, 0, k_blocks, give_up, None) }
}

/// As [`load_tile`], for K blocks `k_first..k_first + k_blocks` of the tile (a stream-K
/// piece; 0 and all of them otherwise); with `count`, adds 1 to that shared-memory word each
/// time a slot was free (the consumers' progress as the producer sees it: after `stages` free
/// slots at the start, one per K block both consumer warpgroups released). `B_EVICT_FIRST`:
/// B's boxes (N x K) load under an evict-first L2 policy - a B tile is read by the row tiles of
/// a rasterization group at about the same time and not again soon, while A's row tiles are
/// read by every column tile of the group and stay (GEMM+ReduceScatter/AllReduce).
///
/// # Safety
///
/// As [`load_tile`], with `k_first + k_blocks` within the tile's K blocks; `count`, if any, is a 4-byte aligned
/// shared-memory word of this CTA that only this thread writes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn load_tile_counted<const B_EVICT_FIRST: bool>(
    ring: &Ring,
    pos: &mut RingPos,
    a: TensorMap,
    a_row: u32,
    b: TensorMap,
    b_layout: BLayout,
    tile: Tile,
    k_first: u32,
    k_blocks: u32,
    give_up: impl Fn(u64) -> bool + Copy,
    count: Option<SmemAddr>,
) -> bool {
    for kb in k_first..k_first + k_blocks {
        let s = pos.stage;
        let k0 = kb * TILE.block_k;
        unsafe {
            if !mbarrier::wait_parity_or(ring.empty(s), pos.phase ^ 1, give_up) {
                return false;
            }
            if let Some(c) = count {
                crate::arch::smem::st_volatile_shared_u32(c, crate::arch::smem::ld_volatile_shared_u32(c) + 1);
            }
            mbarrier::arrive_expect_tx(ring.full(s), TILE.stage_tx_bytes());
            tma::load_2d(ring.a(s), a, k0, a_row, ring.full(s));
            match b_layout {
                BLayout::Nk if B_EVICT_FIRST => {
                    tma::load_2d_hinted(ring.b(s), b, k0, tile.n0, ring.full(s), tma::evict_first_policy())
                }
                BLayout::Nk => tma::load_2d(ring.b(s), b, k0, tile.n0, ring.full(s)),
                BLayout::Kn => {
                    for c in 0..TILE.block_n / 64 {
                        tma::load_2d(ring.b(s).add(c * B_KN_BOX_BYTES), b, tile.n0 + 64 * c, k0, ring.full(s));
                    }
                }
            }
        }
        pos.advance(ring.stages());
    }
    true
}

/// A's part of a stage for [`load_tile_rows`]: `boxes` boxes of `box_rows` rows (the map's box)
/// from row `row` of `map` on, into the first `boxes x box_rows` rows of the slot's A tile.
#[derive(Clone, Copy)]
pub struct ARows {
    pub map: TensorMap,
    pub row: u32,
    pub boxes: u32,
    pub box_rows: u32,
}

/// B's rows of a tile for [`load_tile_rows`] (B stored N x K).
#[derive(Clone, Copy)]
pub enum BRows {
    /// `block_n` rows from this row on (`b` encoded with a 64 x `block_n` box).
    Whole(u32),
    /// Two ranges of `block_n / 2` rows (`b` with a 64 x `block_n / 2` box): the first fills
    /// the slot's first half, the second its second (a grouped GEMM's SwiGLU tile: gate and up
    /// rows of the same outputs).
    Split([u32; 2]),
}

/// As [`load_tile`] with B stored N x K (whole or split, [`BRows`]), A loaded as `a.boxes` boxes
/// of `a.box_rows` rows: a tile whose last rows are padding loads only the boxes that hold
/// real rows (the slot's other A rows keep what they held; the consumers compute on them and
/// never store those rows). The slot expects the bytes of those boxes and all of B.
///
/// # Safety
///
/// As [`load_tile`], with `a.map` a tensor map of A with a 64 x `a.box_rows` box,
/// `a.boxes x a.box_rows <= block_m`, `a.box_rows` a multiple of 8 and `b` encoded as `b_rows` says.
#[inline(always)]
pub unsafe fn load_tile_rows(
    ring: &Ring,
    pos: &mut RingPos,
    a: ARows,
    b: TensorMap,
    b_rows: BRows,
    k_blocks: u32,
    give_up: impl Fn(u64) -> bool + Copy,
) -> bool {
    const HALF_BYTES: u32 = TILE.b_stage_bytes() / 2;
    let a_box_bytes = a.box_rows * TILE.block_k * 2;
    let tx = a.boxes * a_box_bytes + TILE.b_stage_bytes();
    for kb in 0..k_blocks {
        let s = pos.stage;
        let k0 = kb * TILE.block_k;
        unsafe {
            if !mbarrier::wait_parity_or(ring.empty(s), pos.phase ^ 1, give_up) {
                return false;
            }
            mbarrier::arrive_expect_tx(ring.full(s), tx);
            for j in 0..a.boxes {
                tma::load_2d(
                    ring.a(s).add(j * a_box_bytes),
                    a.map,
                    k0,
                    a.row + j * a.box_rows,
                    ring.full(s),
                );
            }
            let (first, second) = match b_rows {
                BRows::Whole(r) => (r, None),
                BRows::Split([r0, r1]) => (r0, Some(r1)),
            };
            tma::load_2d(ring.b(s), b, k0, first, ring.full(s));
            if let Some(r1) = second {
                tma::load_2d(ring.b(s).add(HALF_BYTES), b, k0, r1, ring.full(s));
            }
        }
        pos.advance(ring.stages());
    }
    true
}

/// Completes the next `k_blocks` slots without data (one arrival, no bytes): once a fused
/// kernel's producer cannot get a tile's data (a communication wait failed; the error record
/// is written), the consumers run through the remaining tiles on stale operands and the launch
/// ends, instead of waiting for slots that would never fill. False as for [`load_tile`].
///
/// # Safety
///
/// The ring contract (`crate::gemm`); called by the one producer thread, with `pos` the producer's ring position, for
/// slots the consumers will take.
#[inline(always)]
pub unsafe fn fill_without_data(
    ring: &Ring,
    pos: &mut RingPos,
    k_blocks: u32,
    give_up: impl Fn(u64) -> bool + Copy,
) -> bool {
    for _ in 0..k_blocks {
        let s = pos.stage;
        unsafe {
            if !mbarrier::wait_parity_or(ring.empty(s), pos.phase ^ 1, give_up) {
                return false;
            }
            mbarrier::arrive(ring.full(s));
        }
        pos.advance(ring.stages());
    }
    true
}

/// Waits until the loads of the last `stages` fills before `pos` have landed - a CTA must not
/// exit while TMA still writes its shared memory. Each is bounded (a load always completes); a
/// slot never filled is waited for at parity 1, which a fresh barrier passes at once.
///
/// # Safety
///
/// The ring contract (`crate::gemm`); called by the producer thread with its final ring position `pos`.
#[inline(always)]
pub unsafe fn wait_loads_landed(ring: &Ring, pos: RingPos) {
    let mut p = pos;
    for _ in 0..ring.stages() {
        if p.stage == 0 {
            p.stage = ring.stages() - 1;
            p.phase ^= 1;
        } else {
            p.stage -= 1;
        }
        unsafe { mbarrier::wait_parity(ring.full(p.stage), p.phase) };
    }
}
