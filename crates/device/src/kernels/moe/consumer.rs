//! The grouped GEMM's consumer role (warpgroups 1 and 2): the plain GEMM's mainloop on each
//! tile, then the activation (SwiGLU: `silu(gate) * up` folds the 256 accumulator columns
//! into 128) and the TMA-store epilogue. A warpgroup whose 64 rows of the tile are all
//! padding (past its expert's rows) only frees the tile's ring slots: no wgmma, no store
//! (padding rows are never read).
use super::grouped_gemm::Launch;
use crate::arch::{mbarrier, regs, tma::TensorMap};
use crate::gemm::consumer::{drain_tile, mma_tile};
use crate::gemm::epilogue::{drain_tma_stores, store_boxes_tma_to, store_tile_tma, swiglu_in_place};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::BLayout;
use mkernel_config::ops::moe::TILE;

#[inline(always)]
pub unsafe fn run(ring: &Ring, l: Launch, wg: u32) {
    regs::setmaxnreg_inc::<{ TILE.consumer_regs }>();
    let map_c = TensorMap(unsafe { (*l.args).map_c } as *const u8);
    let mut acc = [0f32; 128];
    let mut pos = RingPos::START;
    for tile in l.tiles() {
        let first_row = tile.m0 + wg * TILE.rows_per_consumer();
        let live = unsafe {
            let a = &*l.args;
            let e = (a.tile_expert as *const u32)
                .add((tile.m0 / TILE.block_m) as usize)
                .read() as usize;
            let end = (a.offsets as *const u32).add(e).read() + (a.counts as *const u32).add(e).read();
            first_row < end
        };
        unsafe {
            if !live {
                drain_tile(ring, &mut pos, l.k_blocks, mbarrier::trap_after(mbarrier::HUNG_NS));
                continue;
            }
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
