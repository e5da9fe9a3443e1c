//! The loader warpgroup: its 128 threads copy K and V of the CTA's key block once, then the Q
//! and dO blocks of every iteration into the ring, with 16-byte `cp.async` copies placed as a
//! 128B-swizzled TMA box would be (chunk `c` of row `r` at `r * 128 + ((c ^ r % 8) * 16)`). Each
//! thread's `cp.async.mbarrier.arrive.noinc` counts one arrival of the slot's `full` barrier
//! when its copies have landed. Rows past the sequence are zero-filled (not read).
use super::schedule::{bwd_work, BLOCK_M, BLOCK_N};
use super::BwdSmem;
use crate::arch::smem::SmemAddr;
use crate::arch::{cp_async, ids, mbarrier};
use crate::gemm::ring::RingPos;
use mkernel_config::ops::attention::SWIZZLE_ROW;
use mkernel_config::ops::attention_bwd::AttentionBwdArgs;

/// Copies `rows` rows of head `h` of a `[row][heads][D]` bf16 tensor at `src`, starting at row
/// `row0`, into `D / 64` swizzled boxes of `rows x 128` bytes at `dst` (`box_bytes` apart); rows
/// `valid..rows` are zero-filled. Thread `tid` of 128 takes chunks `tid, tid + 128, ...`.
///
/// # Safety
/// `src` is a device address of the tensor with rows `row0..row0 + valid` of `heads` heads; `dst`
/// a 1024-aligned shared region of `D / 64` boxes that nothing reads until the barrier the
/// caller arrives on completes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn copy_tile<const D: u32>(
    dst: SmemAddr,
    box_bytes: u32,
    src: u64,
    heads: u32,
    h: u32,
    row0: u32,
    rows: u32,
    valid: u32,
    tid: u32,
) {
    let per_row = D / 8;
    let mut t = tid;
    while t < rows * per_row {
        let (r, c) = (t / per_row, t % per_row);
        let d = dst.add((c / 8) * box_bytes + r * SWIZZLE_ROW + (((c % 8) ^ (r % 8)) * 16));
        if r < valid {
            let at = (((row0 + r) as u64 * heads as u64 + h as u64) * D as u64 + 8 * c as u64) * 2;
            unsafe { cp_async::copy_16(d, (src + at) as *const u8) };
        } else {
            unsafe { cp_async::copy_16_zfill(d, src as *const u8, 0) };
        }
        t += mkernel_config::WARPGROUP_SIZE;
    }
}

/// # Safety
/// Called by every thread of the loader warpgroup after the CTA's setup, for a CTA with work.
#[inline(always)]
pub unsafe fn run<const D: u32>(sm: &BwdSmem, a: &AttentionBwdArgs) {
    let Some(w) = (unsafe { bwd_work::<false>(a, ids::block_idx_reread()) }) else {
        return;
    };
    let tid = ids::thread_idx_reread() % mkernel_config::WARPGROUP_SIZE;
    let t = sm.tile;
    let kv_valid = (w.k_len - w.n0).min(BLOCK_N);
    let krow = w.k_start + w.n0;
    unsafe {
        copy_tile::<D>(
            sm.k(),
            t.kv_box_bytes(),
            a.k,
            a.heads_kv,
            w.h_kv,
            krow,
            BLOCK_N,
            kv_valid,
            tid,
        );
        copy_tile::<D>(
            sm.v(),
            t.kv_box_bytes(),
            a.v,
            a.heads_kv,
            w.h_kv,
            krow,
            BLOCK_N,
            kv_valid,
            tid,
        );
        cp_async::mbarrier_arrive_noinc(sm.kv_full());
    }
    let mut pos = RingPos::START;
    for it in 0..w.iterations() {
        let (hq, m0) = w.at(it);
        let s = pos.stage;
        let valid = (w.q_len - m0).min(BLOCK_M);
        let row = w.q_start + m0;
        unsafe {
            mbarrier::wait_parity(sm.q_empty(s), pos.phase ^ 1);
            copy_tile::<D>(sm.q(s), t.q_box_bytes(), a.q, a.heads_q, hq, row, BLOCK_M, valid, tid);
            copy_tile::<D>(
                sm.d_o(s),
                t.q_box_bytes(),
                a.d_o,
                a.heads_q,
                hq,
                row,
                BLOCK_M,
                valid,
                tid,
            );
            cp_async::mbarrier_arrive_noinc(sm.q_full(s));
        }
        pos.advance(t.stages);
    }
    // No copy outlives its thread.
    cp_async::commit_group();
    cp_async::wait_group::<0>();
}
