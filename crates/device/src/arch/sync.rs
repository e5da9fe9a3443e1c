//! CTA barriers.
use core::arch::asm;

/// All threads of the CTA: `barrier.sync 0;` (`bar.sync 0`).
#[inline(always)]
pub fn sync_threads() {
    unsafe { core::arch::nvptx::_syncthreads() }
}
/// Named barrier `id` (1..16) among `threads` threads (a multiple of 32): `bar.sync id, threads;`
#[inline(always)]
pub fn named_barrier_sync(id: u32, threads: u32) {
    unsafe { asm!("bar.sync {0}, {1};", in(reg32) id, in(reg32) threads, options(nostack)) };
}
/// Arrive at named barrier `id` without waiting: `bar.arrive id, threads;`
#[inline(always)]
pub fn named_barrier_arrive(id: u32, threads: u32) {
    unsafe { asm!("bar.arrive {0}, {1};", in(reg32) id, in(reg32) threads, options(nostack)) };
}
/// The lanes of the current warp: `bar.warp.sync 0xffffffff;`
#[inline(always)]
pub fn sync_warp() {
    unsafe { asm!("bar.warp.sync 0xffffffff;", options(nostack)) };
}
/// Elects one lane of the full warp: `elect.sync _|p, 0xffffffff;` (true in exactly one lane).
#[inline(always)]
pub fn elect_one() -> bool {
    let r: u32;
    unsafe {
        asm!(
            "{{ .reg .pred p; elect.sync _|p, 0xffffffff; selp.u32 {0}, 1, 0, p; }}",
            out(reg32) r, options(nostack)
        )
    };
    r != 0
}
/// All threads of the CTA, returning whether `pred` held in any of them:
/// `bar.red.or.pred q, 0, p;`
#[inline(always)]
pub fn sync_threads_or(pred: bool) -> bool {
    let r: u32;
    unsafe {
        asm!(
            "{{ .reg .pred p, q; setp.ne.u32 p, {1}, 0; bar.red.or.pred q, 0, p; selp.u32 {0}, 1, 0, q; }}",
            out(reg32) r, in(reg32) pred as u32, options(nostack)
        )
    };
    r != 0
}
