//! The loader warpgroup: its 128 threads copy K and V of the CTA's key block once, then the Q
//! and dO blocks of every iteration into the ring, with 16-byte `cp.async` copies placed as a
//! 128B-swizzled TMA box would be (chunk `c` of row `r` at `r * 128 + ((c ^ r % 8) * 16)`). Each
//! thread's `cp.async.mbarrier.arrive.noinc` counts one arrival of the slot's `full` barrier
//! when its copies have landed. Rows past the sequence are zero-filled (not read). With each
//! (Q, dO) block go the block's `lse2` and `delta` (4-byte copies: a varlen sequence's rows need
//! not start 16-byte aligned).
use super::schedule::{bwd_work, BLOCK_M, BLOCK_N};
use super::BwdSmem;
use crate::arch::smem::SmemAddr;
use crate::arch::{cp_async, ids, mbarrier};
use crate::gemm::ring::RingPos;
use mkernel_config::ops::attention::SWIZZLE_ROW;
use mkernel_config::ops::attention_bwd::AttentionBwdArgs;

const _: () = assert!(
    2 * BLOCK_M == mkernel_config::WARPGROUP_SIZE,
    "one loader thread per lse2 or delta row of a block"
);

/// Copies `rows` rows of head `h` of a `[row][heads][D]` bf16 tensor at `src`, starting at row
/// `row0`, into `D / 64` swizzled boxes of `rows x 128` bytes at `dst` (`box_bytes` apart); rows
/// `valid..rows` are zero-filled. Thread `tid` of 128 takes chunks `tid, tid + 128, ...`: as 128
/// is a multiple of the `D / 8` chunks of a row, its chunk column `c` and the row's swizzle phase
/// `r % 8` stay the same, so each step moves both addresses by a constant (few registers: the
/// loader runs at 40).
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
    const {
        assert!(
            mkernel_config::WARPGROUP_SIZE.is_multiple_of(8 * (D / 8)),
            "a step of 128 chunks is a whole number of 8-row swizzle periods"
        )
    };
    // Rows a step of 128 chunks advances (a multiple of 8: the swizzle phase is kept).
    let step = mkernel_config::WARPGROUP_SIZE / per_row;
    let (r0, c) = (tid / per_row, tid % per_row);
    let mut d = dst.add((c / 8) * box_bytes + r0 * SWIZZLE_ROW + (((c % 8) ^ (r0 % 8)) * 16));
    let row_bytes = heads as u64 * D as u64 * 2;
    let mut at = src + ((row0 + r0) as u64 * heads as u64 + h as u64) * D as u64 * 2 + 16 * c as u64;
    let mut r = r0;
    while r < rows {
        if r < valid {
            unsafe { cp_async::copy_16(d, at as *const u8) };
        } else {
            unsafe { cp_async::copy_16_zfill(d, src as *const u8, 0) };
        }
        r += step;
        d = d.add(step * SWIZZLE_ROW);
        at += step as u64 * row_bytes;
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
            // lse2 (threads 0..64) and delta (64..128) of the block's rows, both `[heads_q][total_q]`
            // (the index in u32, as the consumer computed it before), into the slot's stats: thread
            // `tid` writes f32 `tid` of the slot (delta follows lse2).
            let r = tid % BLOCK_M;
            let src = if tid < BLOCK_M { a.lse2 } else { a.delta };
            let (at, bytes) = if r < valid {
                (src + 4 * (hq * a.total_q + row + r) as u64, 4)
            } else {
                (src, 0)
            };
            cp_async::copy_4_zfill(sm.lse2(s).add(4 * tid), at as *const u8, bytes);
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
