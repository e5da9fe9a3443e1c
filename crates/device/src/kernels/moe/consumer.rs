//! The grouped GEMM's consumer role (warpgroups 1 and 2): the plain GEMM's mainloop on each
//! tile, then the activation (SwiGLU: `silu(gate) * up` folds the 256 accumulator columns
//! into 128) and the TMA-store epilogue.
use super::grouped_gemm::Launch;
use crate::arch::{regs, tma::TensorMap};
use crate::gemm::consumer::mma_tile;
use crate::gemm::epilogue::{drain_tma_stores, store_boxes_tma_to, store_tile_tma, swiglu_in_place};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::BLayout;
use mkernel_config::ops::moe::TILE;

/// # Safety
///
/// Called by all 128 threads of consumer warpgroup `wg` (0 or 1: warpgroup `wg + 1` of `mk_moe_grouped_gemm`), under
/// the ring contract (`crate::gemm`) with the producer role's [`super::producer::run`] on the same `ring` and `l`;
/// `l.args` meets the argument-block contract (`crate::kernels::moe`).
#[inline(always)]
pub unsafe fn run(ring: &Ring, l: Launch, wg: u32) {
    regs::setmaxnreg_inc::<{ TILE.consumer_regs }>();
    let map_c = TensorMap(unsafe { (*l.args).map_c } as *const u8);
    let mut acc = [0f32; 128];
    let mut pos = RingPos::START;
    for tile in l.tiles() {
        unsafe {
            mma_tile(ring, &mut pos, &mut acc, wg, BLayout::Nk, l.k_blocks);
            if l.swiglu {
                swiglu_in_place(&mut acc);
                store_boxes_tma_to::<2>(ring, map_c, tile, wg, &mut acc, false);
            } else {
                store_tile_tma(ring, map_c, tile, wg, &mut acc);
            }
        }
    }
    drain_tma_stores();
}
