//! The grouped GEMM's consumer role (warpgroups 1 and 2): the plain GEMM's mainloop on each
//! tile, then the activation (SwiGLU: `silu(gate) * up` folds the 256 accumulator columns
//! into 128) and the TMA-store epilogue (with `mode::PARTIAL_ROWS`, a half with padding rows
//! stores only its valid rows, in `PARTIAL_BOX_ROWS`-row boxes; a half of only padding stores
//! nothing).
use super::grouped_gemm::Launch;
use crate::arch::{regs, tma::TensorMap};
use crate::gemm::consumer::mma_tile;
use crate::gemm::epilogue::{
    drain_tma_stores, red_rows_f32, store_boxes_tma_to, store_tile_tma, store_tile_tma_to, swiglu_in_place,
    thread_rows, RowBoxes,
};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::BLayout;
use mkernel_config::ops::moe::{PARTIAL_BOX_ROWS, PARTIAL_MAP_OFFSET, TILE};

/// # Safety
///
/// Called by all 128 threads of consumer warpgroup `wg` (0 or 1: warpgroup `wg + 1` of `mk_moe_grouped_gemm`), under
/// the ring contract (`crate::gemm`) with the producer role's [`super::producer::run`] on the same `ring` and `l`;
/// `l.args` meets the argument-block contract (`crate::kernels::moe`).
#[inline(always)]
pub unsafe fn run(ring: &Ring, l: Launch, wg: u32) {
    regs::setmaxnreg_inc::<{ TILE.consumer_regs }>();
    if let Some(c) = l.combine {
        unsafe { run_combine(ring, l, c, wg) };
        return;
    }
    let map_c = TensorMap(unsafe { (*l.args).map_c } as *const u8);
    let map_c_rows = TensorMap((unsafe { (*l.args).map_c } + PARTIAL_MAP_OFFSET) as *const u8);
    let mut acc = [0f32; 128];
    let mut pos = RingPos::START;
    for tile in l.tiles() {
        // This warpgroup's valid rows of the tile (read before the mainloop hides the load).
        let rows = if l.partial {
            l.tile_expert(tile.m0)
                .1
                .saturating_sub(wg * TILE.rows_per_consumer())
                .min(TILE.rows_per_consumer())
        } else {
            TILE.rows_per_consumer()
        };
        unsafe {
            mma_tile(ring, &mut pos, &mut acc, wg, BLayout::Nk, l.k_blocks);
            if rows < TILE.rows_per_consumer() {
                // Padding in this half: its valid rows in PARTIAL_BOX_ROWS-row boxes; a half of
                // only padding stores nothing, so nothing is staged either.
                if rows > 0 {
                    let dst = RowBoxes {
                        map: map_c_rows,
                        rows,
                        box_rows: PARTIAL_BOX_ROWS,
                    };
                    if l.swiglu {
                        swiglu_in_place(&mut acc);
                        store_boxes_tma_to::<2>(ring, dst, tile, wg, &mut acc, false);
                    } else {
                        store_tile_tma_to(ring, dst, tile, wg, &mut acc, false);
                    }
                }
            } else if l.swiglu {
                swiglu_in_place(&mut acc);
                store_boxes_tma_to::<2>(ring, map_c, tile, wg, &mut acc, false);
            } else {
                store_tile_tma(ring, map_c, tile, wg, &mut acc);
            }
        }
    }
    drain_tma_stores();
}

/// The consumer loop of `mk_moe_grouped_gemm_combine`: each tile's rows, times their pairs'
/// weights, added into their tokens' f32 output rows ([`red_rows_f32`]); padding rows
/// (`row_pair` `u32::MAX`) are skipped. The row words and weights are read before the
/// mainloop, which hides their latency.
///
/// # Safety
///
/// As [`run`], launched through `mk_moe_grouped_gemm_combine` (its `c` and `row_pair` contracts).
#[inline(always)]
unsafe fn run_combine(ring: &Ring, l: Launch, c: super::grouped_gemm::Combine, wg: u32) {
    let (row_pair, top_k, n) = unsafe { ((*l.args).row_pair as *const u32, (*l.args).top_k, (*l.args).n) };
    let mut acc = [0f32; 128];
    let mut pos = RingPos::START;
    for tile in l.tiles() {
        let row = |r: u32| {
            let p = unsafe { row_pair.add((tile.m0 + r) as usize).read() };
            if p == u32::MAX {
                (0, 0.0)
            } else {
                let at = c.out as u64 + 4 * ((p / top_k) as u64 * n as u64 + tile.n0 as u64);
                (at, unsafe { c.weights.add(p as usize).read() })
            }
        };
        let [r0, r1] = thread_rows(wg);
        let ((d0, w0), (d1, w1)) = (row(r0), row(r1));
        unsafe {
            mma_tile(ring, &mut pos, &mut acc, wg, BLayout::Nk, l.k_blocks);
            red_rows_f32(&acc, [d0, d1], [w0, w1], n - tile.n0);
        }
    }
}
