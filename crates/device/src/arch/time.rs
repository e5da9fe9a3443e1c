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

/// Tests `ready` until it holds, sleeping about `SLEEP_NS` between tests (0: spinning); after
/// every `check_every` failed tests calls `give_up(ns since the first check)` and returns
/// false when it says so. The loop behind every bounded wait on a shared-memory condition.
// `is_multiple_of` here changes the emitted PTX of the polling loop (checked with `cargo xtask ptx`).
#[allow(clippy::manual_is_multiple_of)]
#[inline(always)]
pub fn poll_until<const SLEEP_NS: u32>(
    check_every: u32,
    mut ready: impl FnMut() -> bool,
    give_up: impl Fn(u64) -> bool,
) -> bool {
    let mut tries = 0u32;
    let mut since = 0u64;
    while !ready() {
        if SLEEP_NS > 0 {
            nanosleep(SLEEP_NS);
        }
        tries += 1;
        if tries % check_every == 0 {
            let now = globaltimer_ns();
            if since == 0 {
                since = now;
            }
            if give_up(now - since) {
                return false;
            }
        }
    }
    true
}
