//! Thread, warp, warpgroup and block indices.
use core::arch::{asm, nvptx};

/// Threads in a warpgroup.
pub const WARPGROUP_THREADS: u32 = 128;

/// `mov.u32 %r, %tid.x;`
#[inline(always)]
pub fn thread_idx() -> u32 {
    unsafe { nvptx::_thread_idx_x() as u32 }
}
/// `mov.u32 %r, %ctaid.x;`
#[inline(always)]
pub fn block_idx() -> u32 {
    unsafe { nvptx::_block_idx_x() as u32 }
}
/// `mov.u32 %r, %nctaid.x;`
#[inline(always)]
pub fn grid_dim() -> u32 {
    unsafe { nvptx::_grid_dim_x() as u32 }
}
/// `mov.u32 %r, %ntid.x;`
#[inline(always)]
pub fn block_dim() -> u32 {
    unsafe { nvptx::_block_dim_x() as u32 }
}
/// `mov.u32 %r, %laneid;`
#[inline(always)]
pub fn lane_id() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {0}, %laneid;", out(reg32) r, options(pure, nomem, nostack)) };
    r
}
/// Warp index within the CTA: `%tid.x / 32`, made warp-uniform with `shfl.sync.idx` so the
/// compiler knows branches on it do not diverge.
#[inline(always)]
pub fn warp_idx() -> u32 {
    crate::arch::shuffle::shfl_idx(thread_idx() / 32, 0)
}
/// Warpgroup (4 consecutive warps) index within the CTA, warp-uniform.
#[inline(always)]
pub fn warpgroup_idx() -> u32 {
    warp_idx() / 4
}
/// [`thread_idx`] read again (an asm the compiler may not merge with earlier reads): for role
/// code after `setmaxnreg`, so the value is not computed before the register split and kept
/// live across it (which ptxas spills).
#[inline(always)]
pub fn thread_idx_reread() -> u32 {
    let t: u32;
    unsafe { asm!("mov.u32 {0}, %tid.x;", out(reg32) t, options(nomem, nostack)) };
    t
}
/// [`block_idx`] read again (see [`thread_idx_reread`]).
#[inline(always)]
pub fn block_idx_reread() -> u32 {
    let b: u32;
    unsafe { asm!("mov.u32 {0}, %ctaid.x;", out(reg32) b, options(nomem, nostack)) };
    b
}
/// [`warp_idx`] from [`thread_idx_reread`].
#[inline(always)]
pub fn warp_idx_reread() -> u32 {
    crate::arch::shuffle::shfl_idx(thread_idx_reread() / 32, 0)
}
/// [`warpgroup_idx`] from [`thread_idx_reread`].
#[inline(always)]
pub fn warpgroup_idx_reread() -> u32 {
    warp_idx_reread() / 4
}
/// The SM this thread runs on (`mov.u32 %r, %smid;`): for diagnostics only (PTX: it may change
/// during a thread's life, e.g. after preemption).
#[inline(always)]
pub fn sm_id() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {0}, %smid;", out(reg32) r, options(nomem, nostack)) };
    r
}
/// Thread index within its warpgroup (0..128).
#[inline(always)]
pub fn thread_in_warpgroup() -> u32 {
    thread_idx() % 128
}
