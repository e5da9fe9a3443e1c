//! The grouped GEMM's producer role (warpgroup 0; one thread issues): for each tile, its
//! expert's weight rows and the tile's grouped rows, through the plain GEMM's TMA loaders.
use super::grouped_gemm::Launch;
use crate::arch::{ids, mbarrier, regs, tma::TensorMap};
use crate::gemm::producer::{load_tile, load_tile_split_b};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::scheduler::Tile;
use crate::gemm::BLayout;
use mkernel_config::ops::moe::TILE;

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
    let tile_expert = args.tile_expert as *const u32;
    let mut pos = RingPos::START;
    let give_up = mbarrier::trap_after(mbarrier::HUNG_NS);
    for tile in l.tiles() {
        let e = unsafe { tile_expert.add((tile.m0 / TILE.block_m) as usize).read() };
        let b_row = e * args.b_rows + tile.n0;
        unsafe {
            if l.swiglu {
                load_tile_split_b(
                    ring,
                    &mut pos,
                    a,
                    tile.m0,
                    b,
                    [b_row, b_row + args.n],
                    l.k_blocks,
                    give_up,
                );
            } else {
                let t = Tile { m0: tile.m0, n0: b_row };
                load_tile(ring, &mut pos, a, tile.m0, b, BLayout::Nk, t, l.k_blocks, give_up);
            }
        }
    }
}
