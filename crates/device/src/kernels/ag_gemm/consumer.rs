//! A consumer warpgroup of an AllGather+GEMM compute CTA: wgmma over the ring, then the tile's
//! TMA-store epilogue.
use super::schedule;
use crate::arch::tma::TensorMap;
use crate::comm::launch::consumer_stall;
use crate::gemm::consumer::mma_tile_bounded;
use crate::gemm::epilogue::{drain_tma_stores, store_tile_tma};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::BLayout;
use mkernel_config::ops::ag_gemm::AgGemmArgs;

/// The tile loop of consumer warpgroup `wg` (1-based) of compute CTA `idx`, storing C through
/// `map_c`.
#[inline(always)]
pub(super) unsafe fn run(a: &AgGemmArgs, idx: u32, ring: &Ring, pos: RingPos, wg: u32, map_c: TensorMap) {
    let ring = *ring;
    let mut pos = pos;
    let (_, _, _, tiles, k_blocks) = schedule(a, idx);
    let mut acc = [0f32; 128];
    for tile in tiles {
        unsafe {
            mma_tile_bounded(
                &ring,
                &mut pos,
                &mut acc,
                wg - 1,
                BLayout::Nk,
                k_blocks,
                consumer_stall(a.desc),
            );
            store_tile_tma(&ring, map_c, tile, wg - 1, &mut acc);
        }
    }
    drain_tma_stores();
}
