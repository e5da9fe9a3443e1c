//! The persistent warp-specialized GEMM `C = A * B` (`mk_gemm_bf16_nk`, `mk_gemm_bf16_kn`;
//! device `kernels/gemm.rs`, host `gemm.rs`): warpgroup 0 produces (TMA loads), warpgroups 1 and 2
//! consume (wgmma, epilogue).
use crate::gemm::{GemmTile, RingLayout, SMEM_ALIGN_SLACK};
use crate::kernels::KernelSpec;
use crate::TensorMapWords;
use core::mem::{offset_of, size_of};

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

/// The arguments of a GEMM launch after its tensor maps (see [`GemmParams`]).
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmArgs {
    /// The fused-ring diagnostic's timeline buffer (`crate::trace`), 0 for none; the other
    /// entries ignore it.
    pub trace: u64,
    /// Rows of A and C this launch.
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Row stride of C in elements (`>= n`).
    pub ldc: u32,
    /// 1: bf16 C stored by TMA through `map_c`; 0: direct stores to `c` (`map_c` unused).
    pub tma_store: u32,
    /// 1: f32 C; 0: bf16 C.
    pub f32_out: u32,
}

/// A GEMM launch's parameter block, passed by value as the kernel's first parameter and read
/// in place: the tensor maps of A (box 64 (K) x 128 rows), B (N x K: 64 x 256; K x N: 64 x 64)
/// and C (box 64 x 64, only when `args.tma_store`), each at a 64-byte offset, then the
/// arguments. Nothing is uploaded: a launch carries its own buffers' maps and M, and a CUDA
/// graph keeps a copy of the block. The kernel's second parameter is C's address (`m x ldc`
/// elements, written directly when `tma_store` is 0): as a pointer parameter, LLVM compiles the
/// stores through it as `st.global` (from a `u64` field of the block they would be generic).
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmParams {
    pub map_a: TensorMapWords,
    pub map_b: TensorMapWords,
    pub map_c: TensorMapWords,
    pub args: GemmArgs,
}
const _: () = assert!(size_of::<GemmArgs>() == 8 + 6 * 4, "argument block layout");
const _: () = assert!(
    offset_of!(GemmParams, map_a) % 64 == 0
        && offset_of!(GemmParams, map_b) % 64 == 0
        && offset_of!(GemmParams, map_c) % 64 == 0
);
const _: () = assert!(offset_of!(GemmParams, args) == 3 * 128);
const _: () = assert!(
    size_of::<GemmParams>() <= crate::MAX_PARAM_BYTES,
    "kernel parameters are limited to 4 KiB"
);

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
