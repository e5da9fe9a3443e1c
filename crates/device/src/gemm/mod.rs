//! Building blocks of the persistent warp-specialized GEMM `C = A * B`.
//!
//! A is M x K row-major (K-major), B is either N x K (K-major, `nn.Linear` weights) or K x N
//! (N-major); C is M x N row-major, bf16 or f32. The shapes and budgets come from
//! [`mkernel_config::GemmTile`]; docs/gemm.md draws the pipeline.
//!
//! - [`scheduler`]: which output tiles a CTA computes, in grouped (L2-friendly) order;
//! - [`ring`]: the shared-memory ring of A/B stages and its full/empty mbarriers;
//! - [`producer`]: TMA loads of one tile's K blocks into the ring;
//! - [`consumer`]: wgmma over the ring into register accumulators;
//! - [`epilogue`]: accumulators to global memory with tail masking;
//! - [`trace`]: the optional per-tile timeline of a fused launch.
//!
//! The fused kernels reuse these pieces on a subset of their CTAs.
//!
//! # Safety
//!
//! The `unsafe fn`s of the mainloop and epilogue share one contract, which their `# Safety`
//! sections refer to as "the ring contract":
//! - the [`ring::Ring`] was made over this CTA's dynamic shared memory with the kernel's own
//!   `RingLayout` (the launch gave at least that struct's bytes), and [`ring::Ring::init`] ran in
//!   one thread, followed by a CTA barrier, before any other use;
//! - the producer and the consumer warpgroups walk the ring through the same sequence of
//!   positions (the same tiles and K-block counts, in the same order, each side with its own
//!   [`ring::RingPos`] starting at [`ring::RingPos::START`]), so every wait on a slot's
//!   mbarrier names a phase that the other side will complete;
//! - tensor maps point to valid `CUtensorMap`s in global memory, encoded by the host for the
//!   operand they load or store (the box and 128-byte swizzle the ring's slots and staging
//!   boxes assume), whose tensors stay allocated for the launch.

pub mod consumer;
pub mod epilogue;
pub mod producer;
pub mod ring;
pub mod scheduler;
pub mod trace;

use mkernel_config::GemmTile;

/// The tile configuration every GEMM kernel in this crate is compiled for.
pub const TILE: GemmTile = GemmTile::DEFAULT;
const _: () = {
    TILE.check();
    assert!(
        TILE.block_m == 128 && TILE.block_n == 256 && TILE.block_k == 64,
        "the consumer issues m64n256k16 wgmmas"
    );
    assert!(
        TILE.consumer_warpgroups == 2,
        "kernels are written for two consumer warpgroups"
    );
};

/// Storage order of B.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum BLayout {
    /// B is N x K row-major (K contiguous): wgmma reads it K-major.
    Nk,
    /// B is K x N row-major (N contiguous): wgmma reads it MN-major (transposed).
    Kn,
}
