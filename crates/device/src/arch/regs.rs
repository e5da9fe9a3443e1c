//! Registers: reallocation between warpgroups (sm_90a), and an opaque move. `setmaxnreg` takes
//! effect only when the entry has `.maxntid` and `.minnctapersm`, which the PTX linker patches in
//! from `mkernel_config::KERNELS`.
use core::arch::asm;

/// `setmaxnreg.inc.sync.aligned.u32 N;` (warpgroup-wide)
#[inline(always)]
pub fn setmaxnreg_inc<const N: u32>() {
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {0};", const N, options(nostack)) };
}
/// `setmaxnreg.dec.sync.aligned.u32 N;` (warpgroup-wide)
#[inline(always)]
pub fn setmaxnreg_dec<const N: u32>() {
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {0};", const N, options(nostack)) };
}

/// `x` through an opaque register move: `mov.b32 r, x;` in a volatile asm, which the compilers
/// keep in program order with the other volatile asm (e.g. an mbarrier wait) instead of sinking
/// the computation of `x` past it.
#[inline(always)]
pub fn opaque_u32(x: u32) -> u32 {
    let r: u32;
    unsafe { asm!("mov.b32 {0}, {1};", out(reg32) r, in(reg32) x, options(nostack, nomem)) };
    r
}
