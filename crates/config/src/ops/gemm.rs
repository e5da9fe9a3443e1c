//! The persistent warp-specialized GEMM `C = A * B` (`mk_gemm_bf16_nk`, `mk_gemm_bf16_kn`;
//! device `kernels/gemm.rs`, host `gemm.rs`): warpgroup 0 produces (TMA loads), warpgroups 1 and 2
//! consume (wgmma, epilogue).
use crate::gemm::{GemmTile, RingLayout, SMEM_ALIGN_SLACK};
use crate::kernels::KernelSpec;
use core::mem::size_of;

/// The tile every GEMM kernel is compiled for.
pub const TILE: GemmTile = GemmTile::DEFAULT;

/// The GEMM's shared memory: its ring alone.
#[repr(C)]
pub struct GemmSmem {
    pub ring: crate::ring_smem!(TILE),
}

/// The ring's offsets.
pub const RING: RingLayout = <crate::ring_smem!(TILE)>::layout(TILE);
/// Dynamic shared memory of a launch.
pub const SMEM_BYTES: u32 = size_of::<GemmSmem>() as u32 + SMEM_ALIGN_SLACK;
const _: () = assert!(SMEM_BYTES <= crate::SM90_MAX_SMEM_PER_CTA);

/// The persistent warp-specialized GEMM, B stored N x K (K-major, `nn.Linear` weights).
pub const GEMM_BF16_NK: KernelSpec = KernelSpec {
    name: "mk_gemm_bf16_nk",
    max_threads: TILE.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: SMEM_BYTES,
};

/// The persistent warp-specialized GEMM, B stored K x N (N-major, row-major).
pub const GEMM_BF16_KN: KernelSpec = KernelSpec {
    name: "mk_gemm_bf16_kn",
    ..GEMM_BF16_NK
};

/// Diagnostic: the N x K GEMM on GEMM+ReduceScatter's ring and register split
/// ([`crate::ops::gemm_rs::TILE`]), launched with that kernel's shared memory.
pub const GEMM_BF16_NK_FUSED_RING: KernelSpec = KernelSpec {
    name: "mk_gemm_bf16_nk_fused_ring",
    dynamic_smem: crate::ops::gemm_rs::SMEM_BYTES,
    ..GEMM_BF16_NK
};
