//! The PTX idioms the kernels use, one small function each.
//!
//! Every function is `#[inline(always)]` and documents the PTX it emits. Orders and scopes are
//! spelled out in the instruction: LLVM 22 drops the ordering of read-modify-write atomics
//! (`fetch_add(Release)` becomes a relaxed `atom`), so signalling never uses `core::sync::atomic`.
//! Shared-memory addresses are 32-bit `.shared::cta` addresses ([`smem::SmemAddr`]).

pub mod convert;
pub mod cp_async;
pub mod ids;
pub mod math;
pub mod matrix;
pub mod mbarrier;
pub mod memory;
pub mod param;
pub mod regs;
pub mod shuffle;
pub mod smem;
pub mod sync;
pub mod time;
pub mod tma;
pub mod wgmma;

/// Aborts the kernel: `trap;`. The host sees `CUDA_ERROR_ILLEGAL_INSTRUCTION`/launch failure.
#[inline(always)]
pub fn trap() -> ! {
    unsafe { core::arch::nvptx::trap() }
}
