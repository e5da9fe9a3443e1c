//! LL ("low latency") transfers: every 4 bytes of data travel with a 4-byte flag holding the
//! epoch, in one naturally aligned 8-byte word (single-copy atomic), so a receiver that sees the
//! flag also sees the data: no fence, no separate signal, one NVLink hop. Costs twice the bytes,
//! so it is used for small messages only. Units: 8 data bytes = 16 LL bytes per thread access.
use super::wait::report_give_up;
use super::CommCtx;
use crate::arch::{ids, memory, time};
use mkernel_config::comm::{FlagSlot, ABORT_OFFSET};

/// LL bytes per 8 data bytes.
pub const LL_EXPANSION: u64 = 2;

#[inline(always)]
fn word(data: u32, flag: u32) -> u64 {
    data as u64 | ((flag as u64) << 32)
}

/// Sends `n8` units of 8 bytes from `src` to the LL buffer `dst` (a peer's staging slot),
/// tagged with the epoch. CTA-wide.
///
/// # Safety
///
/// The communicator contract (`crate::comm`); called by every thread of the CTA; `src` is an 8-byte aligned address of
/// `8 * n8` readable bytes of global memory, and `dst` a 16-byte aligned address of `16 * n8` writable bytes (a peer's
/// LL staging slot for this epoch) that the receiver reads only with [`recv`].
#[inline(always)]
pub unsafe fn send(c: &CommCtx, dst: *mut u8, src: *const u8, n8: u64) {
    let (t, nt) = (ids::thread_idx() as u64, ids::block_dim() as u64);
    let flag = c.epoch as u32;
    let mut i = t;
    while i < n8 {
        let d = unsafe { memory::ld_v2(src.add((i * 8) as usize)) };
        unsafe { memory::st_relaxed_sys_v2_u64(dst.add((i * 16) as usize), word(d[0], flag), word(d[1], flag)) };
        i += nt;
    }
}

/// Receives unit `i` of the LL buffer `src` (in this rank's heap, written by `peer`): polls
/// until both flags carry the epoch. `None` on timeout (error record written) or abort.
///
/// # Safety
///
/// The communicator contract (`crate::comm`); `src` is a 16-byte aligned LL buffer in this rank's heap written by
/// `peer` with [`send`], holding unit `i`, and `peer < world`.
// `is_multiple_of` here changes the emitted PTX of the polling loop (checked with `cargo xtask ptx`).
#[allow(clippy::manual_is_multiple_of)]
#[inline(always)]
pub unsafe fn recv(c: &CommCtx, src: *const u8, i: u64, peer: u32) -> Option<[u32; 2]> {
    let flag = c.epoch as u32;
    let p = unsafe { src.add((i * 16) as usize) };
    let (a, b) = unsafe { memory::ld_relaxed_sys_v2_u64(p) };
    if (a >> 32) as u32 == flag && (b >> 32) as u32 == flag {
        return Some([a as u32, b as u32]);
    }
    let abort = (c.heap(c.rank) + ABORT_OFFSET) as *const u32;
    let start = time::globaltimer_ns();
    let mut polls = 0u32;
    loop {
        let (a, b) = unsafe { memory::ld_relaxed_sys_v2_u64(p) };
        if (a >> 32) as u32 == flag && (b >> 32) as u32 == flag {
            return Some([a as u32, b as u32]);
        }
        polls += 1;
        if polls % 64 == 0 {
            let aborting = unsafe { super::wait::aborting_at(c.desc_addr(), abort, polls) };
            let waited = time::globaltimer_ns().wrapping_sub(start);
            if aborting || waited > c.timeout_ns {
                unsafe {
                    report_give_up(
                        c,
                        FlagSlot::Staged as u32,
                        peer + (c.global_rank_now() - c.rank),
                        c.epoch,
                        ((a >> 32) as u32).min((b >> 32) as u32) as u64,
                        waited,
                    )
                };
                return None;
            }
        }
    }
}
