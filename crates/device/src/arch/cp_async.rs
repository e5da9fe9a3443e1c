//! `cp.async`: asynchronous 16- and 4-byte global -> shared copies (Ampere-style).
use super::smem::SmemAddr;
use core::arch::asm;

/// `cp.async.cg.shared.global [dst], [src], 16;` (bypasses L1).
///
/// # Safety
///
/// `dst` is a 16-byte aligned shared-memory address of this CTA with 16 writable bytes that nothing else reads or
/// writes until a later `wait_group` covers this copy; `src` is a 16-byte aligned generic address of 16 readable bytes
/// of global memory.
#[inline(always)]
pub unsafe fn copy_16(dst: SmemAddr, src: *const u8) {
    unsafe { asm!("cp.async.cg.shared.global [{0}], [{1}], 16;", in(reg32) dst.0, in(reg64) src, options(nostack)) };
}
/// Copies `src_bytes` (0..=16) and zero-fills the rest of 16:
/// `cp.async.cg.shared.global [dst], [src], 16, src_bytes;`
///
/// # Safety
///
/// As [`copy_16`], except that only the first `src_bytes` (at most 16) bytes at `src` need be readable; with `src_bytes
/// == 0`, `src` is not read but must still be a valid global address.
#[inline(always)]
pub unsafe fn copy_16_zfill(dst: SmemAddr, src: *const u8, src_bytes: u32) {
    unsafe {
        asm!("cp.async.cg.shared.global [{0}], [{1}], 16, {2};", in(reg32) dst.0, in(reg64) src, in(reg32) src_bytes, options(nostack))
    };
}
/// Copies `src_bytes` (0 or 4) and zero-fills the rest of 4 bytes:
/// `cp.async.ca.shared.global [dst], [src], 4, src_bytes;`
///
/// # Safety
///
/// `dst` is a 4-byte aligned shared-memory address of this CTA with 4 writable bytes that nothing else reads or
/// writes until a later `wait_group` (or the mbarrier a `cp.async.mbarrier.arrive` makes track it) covers this copy;
/// `src` is a 4-byte aligned generic address of global memory, readable for `src_bytes` bytes (with `src_bytes == 0`
/// not read but still a valid global address).
#[inline(always)]
pub unsafe fn copy_4_zfill(dst: SmemAddr, src: *const u8, src_bytes: u32) {
    unsafe {
        asm!("cp.async.ca.shared.global [{0}], [{1}], 4, {2};", in(reg32) dst.0, in(reg64) src, in(reg32) src_bytes, options(nostack))
    };
}
/// `cp.async.commit_group;`
#[inline(always)]
pub fn commit_group() {
    unsafe { asm!("cp.async.commit_group;", options(nostack)) };
}
/// Waits until at most `N` committed groups are pending: `cp.async.wait_group N;`
#[inline(always)]
pub fn wait_group<const N: u32>() {
    unsafe { asm!("cp.async.wait_group {0};", const N, options(nostack)) };
}
/// Makes the mbarrier `bar` receive one arrival when every `cp.async` this thread issued before
/// completes, counted as one of the phase's expected arrivals:
/// `cp.async.mbarrier.arrive.noinc.shared::cta.b64 [bar];`
///
/// # Safety
///
/// `bar` is an initialised mbarrier of this CTA whose current phase still expects this arrival (its count includes
/// one arrival per thread that calls this).
#[inline(always)]
pub unsafe fn mbarrier_arrive_noinc(bar: SmemAddr) {
    unsafe { asm!("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [{0}];", in(reg32) bar.0, options(nostack)) };
}
