//! `mbarrier`: the transaction-counting barrier in shared memory that TMA completes on.
//!
//! Phases alternate; a waiter passes once the phase with the given parity has completed.
//! A freshly initialised barrier treats the phase "before" phase 0 (parity 1) as complete, so a
//! producer's first wait for an empty slot with parity 1 passes at once.
use super::smem::SmemAddr;
use core::arch::asm;

/// `mbarrier.init.shared::cta.b64 [bar], count;`
///
/// # Safety
///
/// `bar` is an 8-byte aligned shared-memory address of this CTA reserved for this barrier, not in use by any thread or
/// pending TMA transaction; `count` is the number of arrivals per phase (at least 1). Other threads and the async proxy
/// may use the barrier only after [`fence_init`] and a CTA barrier.
#[inline(always)]
pub unsafe fn init(bar: SmemAddr, count: u32) {
    unsafe { asm!("mbarrier.init.shared::cta.b64 [{0}], {1};", in(reg32) bar.0, in(reg32) count, options(nostack)) };
}
/// Makes barrier initialisation visible to the async proxy (TMA) and the other threads:
/// `fence.mbarrier_init.release.cluster;`
#[inline(always)]
pub fn fence_init() {
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) };
}
/// One arrival: `mbarrier.arrive.shared::cta.b64 _, [bar];`
///
/// # Safety
///
/// `bar` is the shared-memory address of an mbarrier of this CTA initialised by [`init`] (and made visible by
/// [`fence_init`] and a CTA barrier), and the current phase still expects this arrival: arriving more often than the
/// `count` it was initialised with completes a phase early.
#[inline(always)]
pub unsafe fn arrive(bar: SmemAddr) {
    unsafe { asm!("mbarrier.arrive.shared::cta.b64 _, [{0}];", in(reg32) bar.0, options(nostack)) };
}
/// One arrival that also expects `tx_bytes` more bytes of async-proxy transactions:
/// `mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], tx_bytes;`
///
/// # Safety
///
/// As [`arrive`]; in addition `tx_bytes` is exactly the number of bytes the async-proxy copies that complete on `bar`
/// in this phase will deliver, or the phase never completes (or completes early).
#[inline(always)]
pub unsafe fn arrive_expect_tx(bar: SmemAddr, tx_bytes: u32) {
    unsafe {
        asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{0}], {1};", in(reg32) bar.0, in(reg32) tx_bytes, options(nostack))
    };
}
/// Expects `tx_bytes` without arriving: `mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [bar], tx_bytes;`
///
/// # Safety
///
/// `bar` is the shared-memory address of an initialised mbarrier of this CTA whose current phase has not yet completed;
/// `tx_bytes` is exactly the bytes of the async copies that will complete on it in this phase.
#[inline(always)]
pub unsafe fn expect_tx(bar: SmemAddr, tx_bytes: u32) {
    unsafe {
        asm!("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [{0}], {1};", in(reg32) bar.0, in(reg32) tx_bytes, options(nostack))
    };
}
/// One non-blocking test: `mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity;`
///
/// # Safety
///
/// `bar` is the shared-memory address of an initialised mbarrier of this CTA (see [`init`]).
#[inline(always)]
pub unsafe fn try_wait_parity(bar: SmemAddr, parity: u32) -> bool {
    let r: u32;
    unsafe {
        asm!(
            "{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{1}], {2}; selp.u32 {0}, 1, 0, p; }}",
            out(reg32) r, in(reg32) bar.0, in(reg32) parity, options(nostack)
        )
    };
    r != 0
}
/// Waits until the phase with `parity` completed; traps once it has been stalled for
/// [`HUNG_NS`], so a lost TMA transaction or a missing arrival fails the launch instead of
/// hanging the GPU.
///
/// # Safety
///
/// `bar` is the shared-memory address of an initialised mbarrier of this CTA, and `parity` names the phase the caller
/// is waiting for (the phase before the current one, or the current one); waiting for a phase that nobody will complete
/// traps after [`HUNG_NS`].
#[inline(always)]
pub unsafe fn wait_parity(bar: SmemAddr, parity: u32) {
    let _ = unsafe { wait_parity_or(bar, parity, trap_after(HUNG_NS)) };
}

/// Tries between two calls of the stall callback in [`wait_parity_or`].
pub const TRIES_PER_STALL_CHECK: u32 = 1 << 14;
/// How long a plain wait may stall before it is declared hung.
pub const HUNG_NS: u64 = 10_000_000_000;

/// As [`wait_parity`], but a wait that has not completed after every [`TRIES_PER_STALL_CHECK`]
/// tries calls `give_up(ns stalled so far)`, and returns false when it says so. The callback
/// bounds the wait: it may trap ([`trap_after`]) or end it (e.g. "the consumers have stopped").
///
/// # Safety
///
/// As [`wait_parity`]: `bar` is the shared-memory address of an initialised mbarrier of this CTA; `give_up` decides
/// what happens when the phase does not complete.
#[inline(always)]
pub unsafe fn wait_parity_or(bar: SmemAddr, parity: u32, give_up: impl Fn(u64) -> bool) -> bool {
    super::time::poll_until::<0>(
        TRIES_PER_STALL_CHECK,
        || unsafe { try_wait_parity(bar, parity) },
        give_up,
    )
}

/// As [`wait_parity_or`], sleeping about `SLEEP_NS` between tests (`give_up` every 1024 of
/// them): for a waiter that shares its SM with tensor-core work and need not react at once.
///
/// # Safety
///
/// As [`wait_parity_or`]: `bar` is the shared-memory address of an initialised mbarrier of this CTA.
#[inline(always)]
pub unsafe fn wait_parity_sleeping_or<const SLEEP_NS: u32>(
    bar: SmemAddr,
    parity: u32,
    give_up: impl Fn(u64) -> bool,
) -> bool {
    super::time::poll_until::<SLEEP_NS>(1024, || unsafe { try_wait_parity(bar, parity) }, give_up)
}

/// A stall callback that traps once a wait has stalled for `limit_ns` and never ends it early.
#[inline(always)]
pub fn trap_after(limit_ns: u64) -> impl Fn(u64) -> bool + Copy {
    move |stalled| {
        if stalled > limit_ns {
            super::trap();
        }
        false
    }
}
