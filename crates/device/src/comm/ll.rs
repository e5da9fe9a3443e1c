//! LL ("low latency") transfers: every 4 bytes of data travel with a 4-byte flag holding the
//! epoch, in one naturally aligned 8-byte word (single-copy atomic), so a receiver that sees the
//! flag also sees the data: no fence, no separate signal, one NVLink hop. Costs twice the bytes,
//! so it is used for small messages only. Units: 8 data bytes = 16 LL bytes per thread access.
use super::wait::{BoundedWait, Waiting};
use super::CommCtx;
use crate::arch::{ids, memory};
use mkernel_config::comm::FlagSlot;

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
/// until both flags carry the epoch ([`BoundedWait::until`]: the first poll reads no abort
/// word). `None` on timeout (error record written) or abort.
///
/// # Safety
///
/// The communicator contract (`crate::comm`); `src` is a 16-byte aligned LL buffer in this rank's heap written by
/// `peer` with [`send`], holding unit `i`, and `peer < world`.
#[inline(always)]
pub unsafe fn recv(c: &CommCtx, src: *const u8, i: u64, peer: u32) -> Option<[u32; 2]> {
    let flag = c.epoch as u32;
    let p = unsafe { src.add((i * 16) as usize) };
    let what = Waiting {
        code: FlagSlot::Staged as u32,
        peer: move |c: &CommCtx| peer + (c.global_rank_now() - c.rank),
        expected: c.epoch,
    };
    // The data as one u64 (an array through the loop's result would live on the stack).
    let got = unsafe {
        BoundedWait::new(c, what).until(|| {
            let (a, b) = memory::ld_relaxed_sys_v2_u64(p);
            if (a >> 32) as u32 == flag && (b >> 32) as u32 == flag {
                Ok(a as u32 as u64 | (b << 32))
            } else {
                Err(((a >> 32) as u32).min((b >> 32) as u32) as u64)
            }
        })
    };
    got.map(|v| [v as u32, (v >> 32) as u32])
}
