//! The per-tile timeline of a fused launch ([`mkernel_config::trace`]): a diagnostic, written
//! only when the launch was given a buffer, by one thread per CTA (the caller picks it).
use mkernel_config::trace::{End, Mark, TILES_PER_CTA, WORDS_PER_TILE};

use crate::arch::time::{clock64, globaltimer_ns};

/// Word `word` of record `i` of CTA `cta` in buffer `buf` (0: none, nothing is written).
///
/// # Safety
///
/// `buf` is 0 or the address of the launch's trace buffer (`mkernel_config::trace`: `TILES_PER_CTA + 1` records of
/// `WORDS_PER_TILE` u64 words per CTA), sized for more than `cta` CTAs; `i <= TILES_PER_CTA`, `word < WORDS_PER_TILE`;
/// one thread per CTA writes the CTA's records.
#[inline(always)]
unsafe fn put(buf: u64, cta: u32, i: u32, word: u32, value: u64) {
    if buf != 0 {
        let at = ((cta * (TILES_PER_CTA + 1) + i) * WORDS_PER_TILE + word) as usize;
        unsafe { (buf as *mut u64).add(at).write_volatile(value) };
    }
}

/// Stamps the time of `mark` in the record of this CTA's `i`-th tile (past `TILES_PER_CTA`:
/// nothing).
///
/// # Safety
///
/// As for `put`: `buf` is 0 or the launch's trace buffer sized for more than `cta` CTAs, written by one thread of this
/// CTA.
#[inline(always)]
pub unsafe fn mark(buf: u64, cta: u32, i: u32, mark: Mark) {
    if buf != 0 && i < TILES_PER_CTA {
        unsafe { put(buf, cta, i, mark as u32, globaltimer_ns()) };
        // The mainloop's SM cycles too (its clock rate).
        match mark {
            Mark::Mainloop => unsafe { put(buf, cta, i, Mark::MainloopClock as u32, clock64()) },
            Mark::MainloopDone => unsafe { put(buf, cta, i, Mark::MainloopDoneClock as u32, clock64()) },
            _ => {}
        }
    }
}

/// Records what this CTA's `i`-th tile was (`Mark::Tile`; `kind`: [`mkernel_config::trace::tile_kind`]).
///
/// # Safety
///
/// As [`mark`].
#[inline(always)]
pub unsafe fn tile(buf: u64, cta: u32, i: u32, row_tile: u32, col_tile: u32, kind: u32) {
    if buf != 0 && i < TILES_PER_CTA {
        unsafe {
            put(
                buf,
                cta,
                i,
                Mark::Tile as u32,
                (row_tile as u64) << 40 | (col_tile as u64) << 20 | kind as u64,
            )
        };
    }
}

/// Stamps `end` in this CTA's end-of-launch record.
///
/// # Safety
///
/// As [`mark`].
#[inline(always)]
pub unsafe fn end(buf: u64, cta: u32, end: End) {
    unsafe { end_at(buf, cta, end, globaltimer_ns()) };
}

/// Writes time `t` (`%globaltimer`, read earlier) as `end` in this CTA's end-of-launch record.
///
/// # Safety
///
/// As [`mark`].
#[inline(always)]
pub unsafe fn end_at(buf: u64, cta: u32, end: End, t: u64) {
    unsafe { put(buf, cta, TILES_PER_CTA, end as u32, t) };
}
