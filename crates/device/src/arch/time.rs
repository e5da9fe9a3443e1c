//! Clocks and sleeping.
use core::arch::asm;

/// Nanoseconds of the global timer: `mov.u64 d, %globaltimer;`
#[inline(always)]
pub fn globaltimer_ns() -> u64 {
    let r: u64;
    unsafe { asm!("mov.u64 {0}, %globaltimer;", out(reg64) r, options(nostack, nomem)) };
    r
}
/// Sleeps about `ns` nanoseconds (0..=1_000_000): `nanosleep.u32 ns;`
#[inline(always)]
pub fn nanosleep(ns: u32) {
    unsafe { asm!("nanosleep.u32 {0};", in(reg32) ns, options(nostack, nomem)) };
}

/// This SM's cycle counter: `mov.u64 d, %clock64;`
#[inline(always)]
pub fn clock64() -> u64 {
    let r: u64;
    unsafe { asm!("mov.u64 {0}, %clock64;", out(reg64) r, options(nostack, nomem)) };
    r
}
