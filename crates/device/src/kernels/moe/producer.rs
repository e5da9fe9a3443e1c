//! The grouped GEMM's producer role (warpgroup 0; one thread issues): for each tile, its
//! expert's weight rows and the tile's grouped rows (all `block_m`, or with `mode::PARTIAL_ROWS`
//! for a tile with padding only the boxes that hold valid rows), through the shared GEMM's TMA
//! loader.
use super::grouped_gemm::Launch;
use crate::arch::{ids, mbarrier, regs, tma::TensorMap};
use crate::gemm::producer::{load_tile_rows, ARows, BRows};
use crate::gemm::ring::{Ring, RingPos};
use mkernel_config::ops::moe::{PARTIAL_BOX_ROWS, PARTIAL_MAP_OFFSET, TILE};

/// # Safety
///
/// Called by all 128 threads of the producer warpgroup of `mk_moe_grouped_gemm` (`setmaxnreg` is warpgroup-wide; thread
/// 0 issues), under the ring contract (`crate::gemm`) with the consumer role's [`super::consumer::run`] on the same
/// `ring` and `l`; `l.args` meets the argument-block contract (`crate::kernels::moe`).
#[inline(always)]
pub unsafe fn run(ring: &Ring, l: Launch) {
    regs::setmaxnreg_dec::<{ TILE.producer_regs }>();
    if ids::thread_idx() != 0 {
        return;
    }
    let args = unsafe { l.args.read() };
    let (a, b) = (TensorMap(args.map_a as *const u8), TensorMap(args.map_b as *const u8));
    let a_rows_map = TensorMap((args.map_a + PARTIAL_MAP_OFFSET) as *const u8);
    let mut pos = RingPos::START;
    let give_up = mbarrier::trap_after(mbarrier::HUNG_NS);
    for tile in l.tiles() {
        let (e, valid) = l.tile_expert(tile.m0);
        let b_row = e * args.b_rows + tile.n0;
        let b_rows = if l.swiglu {
            BRows::Split([b_row, b_row + args.n])
        } else {
            BRows::Whole(b_row)
        };
        let a_rows = if l.partial && valid < TILE.block_m {
            ARows {
                map: a_rows_map,
                row: tile.m0,
                boxes: valid.div_ceil(PARTIAL_BOX_ROWS),
                box_rows: PARTIAL_BOX_ROWS,
            }
        } else {
            ARows {
                map: a,
                row: tile.m0,
                boxes: 1,
                box_rows: TILE.block_m,
            }
        };
        unsafe { load_tile_rows(ring, &mut pos, a_rows, b, b_rows, l.k_blocks, give_up) };
    }
}
