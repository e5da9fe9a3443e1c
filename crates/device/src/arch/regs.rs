//! Register reallocation between warpgroups (sm_90a). Takes effect only when the entry has
//! `.maxntid` and `.minnctapersm`, which the PTX linker patches in from `mkernel_config::KERNELS`.
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
