//! The producer: one thread walks the CTA's tiles and issues the TMA loads - the tile's Q once
//! its buffer is free, then K and V of each key block into the next ring slot.
use super::schedule::{total, work, BLOCK};
use super::Smem;
use crate::arch::{ids, mbarrier, tma, tma::TensorMap};
use crate::gemm::ring::RingPos;
use mkernel_config::ops::attention::{AttentionArgs, BOX_COLS};

#[inline(always)]
pub unsafe fn run<const D: u32>(sm: &Smem, args: *const AttentionArgs) {
    let a = unsafe { &*args };
    let (mq, mk, mv) = (
        TensorMap(a.map_q as *const u8),
        TensorMap(a.map_k as *const u8),
        TensorMap(a.map_v as *const u8),
    );
    let t = sm.tile;
    let mut kv = RingPos::START;
    let mut q_phase = 0u32;
    let mut i = ids::block_idx_reread();
    let (end, stride) = (total::<false>(a), ids::grid_dim());
    while i < end {
        let w = unsafe { work::<false>(a, i) };
        i += stride;
        let Some(w) = w else { continue };
        if w.n_blocks == 0 {
            continue;
        }
        unsafe {
            mbarrier::wait_parity(sm.q_empty(), q_phase ^ 1);
            mbarrier::arrive_expect_tx(sm.q_full(), t.q_bytes());
            for bx in 0..D / BOX_COLS {
                tma::load_3d(
                    sm.q().add(bx * t.q_box_bytes()),
                    mq,
                    bx * BOX_COLS,
                    w.h,
                    w.q_start + w.m0,
                    sm.q_full(),
                );
            }
        }
        q_phase ^= 1;
        for n in 0..w.n_blocks {
            let (s, row) = (kv.stage, w.k_start + n * BLOCK);
            unsafe {
                mbarrier::wait_parity(sm.k_empty(s), kv.phase ^ 1);
                mbarrier::arrive_expect_tx(sm.k_full(s), t.kv_bytes());
                for bx in 0..D / BOX_COLS {
                    tma::load_3d(
                        sm.k(s).add(bx * t.kv_box_bytes()),
                        mk,
                        bx * BOX_COLS,
                        w.h_kv,
                        row,
                        sm.k_full(s),
                    );
                }
                mbarrier::wait_parity(sm.v_empty(s), kv.phase ^ 1);
                mbarrier::arrive_expect_tx(sm.v_full(s), t.kv_bytes());
                for bx in 0..D / BOX_COLS {
                    tma::load_3d(
                        sm.v(s).add(bx * t.kv_box_bytes()),
                        mv,
                        bx * BOX_COLS,
                        w.h_kv,
                        row,
                        sm.v_full(s),
                    );
                }
            }
            kv.advance(t.stages);
        }
    }
}
