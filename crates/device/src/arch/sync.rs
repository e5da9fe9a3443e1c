//! CTA barriers.
use core::arch::asm;

/// All threads of the CTA: `barrier.sync 0;` — the non-`.aligned` form (`bar.sync` is
/// `barrier.sync.aligned`), so threads of a warp may arrive from divergent paths (a lane that
/// waited on a flag while its warp-mates went ahead); an aligned barrier reached divergently is
/// undefined behaviour.
#[inline(always)]
pub fn sync_threads() {
    unsafe { asm!("barrier.sync 0;", options(nostack)) };
}
/// Named barrier `id` (1..16) among `threads` threads (a multiple of 32):
/// `barrier.sync id, threads;` (non-aligned).
#[inline(always)]
pub fn named_barrier_sync(id: u32, threads: u32) {
    unsafe { asm!("barrier.sync {0}, {1};", in(reg32) id, in(reg32) threads, options(nostack)) };
}
/// Named barrier `id` among `threads` threads that also ORs `pred` over them:
/// `barrier.red.or.pred q, id, threads, p;`
#[inline(always)]
pub fn named_barrier_or(id: u32, threads: u32, pred: bool) -> bool {
    let r: u32;
    unsafe {
        asm!(
            "{{ .reg .pred p, q; setp.ne.u32 p, {2}, 0; barrier.red.or.pred q, {0}, {1}, p; selp.u32 {3}, 1, 0, q; }}",
            in(reg32) id, in(reg32) threads, in(reg32) pred as u32, out(reg32) r, options(nostack)
        )
    };
    r != 0
}
/// Arrive at named barrier `id` without waiting: `barrier.arrive id, threads;` (non-aligned).
#[inline(always)]
pub fn named_barrier_arrive(id: u32, threads: u32) {
    unsafe { asm!("barrier.arrive {0}, {1};", in(reg32) id, in(reg32) threads, options(nostack)) };
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
/// `barrier.red.or.pred q, 0, p;` (non-aligned: divergent arrival allowed).
#[inline(always)]
pub fn sync_threads_or(pred: bool) -> bool {
    let r: u32;
    unsafe {
        asm!(
            "{{ .reg .pred p, q; setp.ne.u32 p, {1}, 0; barrier.red.or.pred q, 0, p; selp.u32 {0}, 1, 0, q; }}",
            out(reg32) r, in(reg32) pred as u32, options(nostack)
        )
    };
    r != 0
}
