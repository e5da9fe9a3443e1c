//! Bounded waits on epoch flags, and the error record they leave when they give up.
use super::CommCtx;
use crate::arch::{ids, memory, memory::Scope, sync, time};
use mkernel_config::comm::{ErrorCode, ErrorRecord, FlagSlot, ABORT_OFFSET, ERROR_RECORD_OFFSET, STAGED_CTAS};

/// Polls between clock and abort checks.
const POLLS_PER_CHECK: u32 = 64;

/// Waits until this rank's flag `(slot, src)` of this CTA reaches `target`. Returns false
/// (after writing the error record if it is the first to fail) on timeout or when the rank is
/// aborting.
#[inline(always)]
pub unsafe fn wait_flag(c: &CommCtx, slot: FlagSlot, src: u32, target: u64) -> bool {
    unsafe { wait_flag_of_cta(c, slot, src, c.cta, target) }
}

/// As [`wait_flag`] for the flag of CTA `cta`.
#[inline(always)]
pub unsafe fn wait_flag_of_cta(c: &CommCtx, slot: FlagSlot, src: u32, cta: u32, target: u64) -> bool {
    unsafe { wait_flag_of_cta_sleeping::<0>(c, slot, src, cta, target) }
}

/// As [`wait_flag_of_cta`], sleeping about `SLEEP_NS` between polls that found the flag short
/// (0: spin): for a waiter that shares its SM with tensor-core work and need not react within
/// a microsecond.
#[inline(always)]
pub unsafe fn wait_flag_of_cta_sleeping<const SLEEP_NS: u32>(
    c: &CommCtx,
    slot: FlagSlot,
    src: u32,
    cta: u32,
    target: u64,
) -> bool {
    unsafe { wait_flag_of_cta_from::<SLEEP_NS>(c, slot, move |_| src, cta, target) }
}

/// As [`wait_flag_of_cta_sleeping`], the source derived from the context where it is used
/// (the flag's address, the error record): e.g. `|c| c.rank ^ 1`, the other rank of two,
/// which a caller short of registers need not keep beside the context across the wait.
#[inline(always)]
pub unsafe fn wait_flag_of_cta_from<const SLEEP_NS: u32>(
    c: &CommCtx,
    slot: FlagSlot,
    src: impl Fn(&CommCtx) -> u32 + Copy,
    cta: u32,
    target: u64,
) -> bool {
    let flag = c.flag_of_cta(c.rank, slot, src(c), cta);
    let abort = (c.heap(c.rank) + ABORT_OFFSET) as *const u32;
    let start = time::globaltimer_ns();
    let mut polls = 0u32;
    loop {
        let seen = unsafe { memory::ld_acquire_u64(Scope::Sys, flag) };
        if seen >= target {
            return true;
        }
        if SLEEP_NS > 0 {
            time::nanosleep(SLEEP_NS);
        }
        polls += 1;
        if polls % POLLS_PER_CHECK == 0 {
            if unsafe { memory::ld_relaxed_u32(Scope::Gpu, abort) } != 0 {
                return false;
            }
            let waited = time::globaltimer_ns().wrapping_sub(start);
            if waited > c.timeout_ns {
                unsafe { report_timeout(c, slot, src(c), target, seen, waited) };
                return false;
            }
        }
    }
}

/// Threads `0..world` (except the own rank) each wait for one source's flag to reach this
/// epoch; then the whole CTA learns whether all arrived. Call from every thread of the CTA.
#[inline(always)]
pub unsafe fn wait_all_peers(c: &CommCtx, slot: FlagSlot) -> bool {
    unsafe { wait_all_peers_at(c, slot, c.epoch) }
}

/// As [`wait_all_peers`] for an explicit `target` (e.g. the staging credit, epoch - 2).
#[inline(always)]
pub unsafe fn wait_all_peers_at(c: &CommCtx, slot: FlagSlot, target: u64) -> bool {
    let t = ids::thread_idx();
    let failed = t < c.world && t != c.rank && !unsafe { wait_flag(c, slot, t, target) };
    !sync::sync_threads_or(failed)
}

/// The staging credit: every peer finished epoch `epoch - 2` in every staged CTA
/// (`0..STAGED_CTAS`), so the slots of this epoch's parity are free. Thread `t` waits for
/// peer `t / STAGED_CTAS`, CTA `t % STAGED_CTAS`. Call from every thread of the CTA.
#[inline(always)]
pub unsafe fn wait_staging_credit(c: &CommCtx) -> bool {
    let t = ids::thread_idx();
    let (peer, cta) = (t / STAGED_CTAS, t % STAGED_CTAS);
    let target = c.epoch.saturating_sub(2);
    let failed = peer < c.world && peer != c.rank && !unsafe { wait_flag_of_cta(c, FlagSlot::Done, peer, cta, target) };
    !sync::sync_threads_or(failed)
}

/// Threads `0..world` (except the own rank) each raise `slot` at one peer. Call from every
/// thread of the CTA after a barrier that follows the data.
#[inline(always)]
pub unsafe fn signal_all_peers(c: &CommCtx, slot: FlagSlot) {
    let t = ids::thread_idx();
    if t < c.world && t != c.rank {
        unsafe { c.signal(t, slot) };
    }
}

/// Claims the rank's error record (first failure wins) and raises its abort word. `src` is
/// a local rank (recorded as its global rank).
pub(crate) unsafe fn report_timeout(c: &CommCtx, slot: FlagSlot, src: u32, target: u64, seen: u64, waited: u64) {
    unsafe {
        report_timeout_code(
            c,
            slot as u32,
            src + (c.global_rank_now() - c.rank),
            target,
            seen,
            waited,
        )
    }
}

/// As [`report_timeout`] with a raw wait code (flag slots, or the inter-node codes of
/// [`super::proxy`]) and `src` a global rank. The record names this rank by its global rank.
pub(crate) unsafe fn report_timeout_code(
    c: &CommCtx,
    code_of_wait: u32,
    src: u32,
    target: u64,
    seen: u64,
    waited: u64,
) {
    let local = c.heap(c.rank);
    let rec = (local + ERROR_RECORD_OFFSET) as *mut ErrorRecord;
    let code = rec as *mut u32;
    unsafe {
        if memory::atom_acq_rel_cas_u32(Scope::Gpu, code, 0, u32::MAX) == 0 {
            (*rec).rank = c.global_rank_now();
            (*rec).role = c.role as u32;
            (*rec).slot = code_of_wait;
            (*rec).peer = src;
            (*rec).cta = c.cta;
            (*rec).expected = target;
            (*rec).seen = seen;
            (*rec).waited_ns = waited;
            memory::st_release_u32(Scope::Gpu, code, ErrorCode::Timeout as u32);
        }
        memory::st_release_u32(Scope::Gpu, (local + ABORT_OFFSET) as *mut u32, 1);
    }
}
