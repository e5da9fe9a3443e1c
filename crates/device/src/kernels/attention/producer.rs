//! The producer: one thread walks the CTA's tiles and issues the TMA loads - the tile's Q once
//! its buffer is free, then K and V of each key block into the next ring slot.
use super::consumer::ring_mask;
use super::schedule::{total, work_in, Mask, BLOCK};
use super::{Maps, Smem};
use crate::arch::{ids, mbarrier, tma, tma::TensorMap};
use crate::gemm::ring::RingPos;
use mkernel_config::ops::attention::{AttentionArgs, BOX_COLS};

/// Where the producer is in its rings (carried from one ring-attention step to the next).
pub struct Pos {
    pub kv: RingPos,
    pub q_phase: u32,
}

impl Pos {
    pub const START: Pos = Pos {
        kv: RingPos::START,
        q_phase: 0,
    };
}

/// # Safety
/// Called by the producer's elected thread after the CTA's setup: `sm` is this CTA's initialised
/// shared memory, `args` the launch's argument block and `maps` its valid Q, K, V tensor maps.
#[inline(always)]
pub unsafe fn run<const D: u32>(sm: &Smem, args: *const AttentionArgs, maps: &Maps) {
    let a = unsafe { &*args };
    let mut pos = Pos::START;
    unsafe { tiles::<D>(sm, a, maps.q, maps.k, maps.v, None, ids::grid_dim(), &mut pos) };
}

/// Loads the tiles of this CTA (`block_idx`, `block_idx + stride`, ...) with Q from `mq` and K
/// and V from `mk`, `mv`; `ring_step = Some(t)`: `a` is a `RingArgs` block and the mask is ring step
/// `t`'s ([`ring_mask`], re-read per tile: the producer is short of registers).
///
/// # Safety
/// As [`run`]; `mq` is this launch's Q tensor map, `mk`, `mv` valid tensor maps of its K and V
/// (or a ring slot), `pos`
/// is the producer's ring position, and with `ring_step` `a` is a [`RingArgs`] block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tiles<const D: u32>(
    sm: &Smem,
    a: &AttentionArgs,
    mq: TensorMap,
    mk: TensorMap,
    mv: TensorMap,
    ring_step: Option<u32>,
    stride: u32,
    pos: &mut Pos,
) {
    let t = sm.tile;
    let mut i = ids::block_idx_reread();
    let end = total::<false>(a);
    while i < end {
        let zigzag: Option<Mask> = match ring_step {
            Some(t) => unsafe { ring_mask::<false>(a, t) },
            None => None,
        };
        let w = unsafe { work_in::<false>(a, i, zigzag) };
        i += stride;
        let Some(w) = w else { continue };
        if w.n_blocks == 0 {
            continue;
        }
        unsafe {
            mbarrier::wait_parity(sm.q_empty(), pos.q_phase ^ 1);
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
        pos.q_phase ^= 1;
        for n in 0..w.n_blocks {
            let kv = pos.kv;
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
            pos.kv.advance(t.stages);
        }
    }
}

/// Waits until the consumers have released every (K, V) slot the producer filled: after it, no
/// load of this CTA reads the K/V source any more (ring attention frees its receive slot).
///
/// # Safety
/// Called by the producer's thread with the position its loads reached; the consumers keep
/// releasing slots until they have consumed every loaded tile.
#[inline(always)]
pub unsafe fn drain(sm: &Smem, pos: &Pos) {
    let kv = pos.kv;
    for s in 0..sm.tile.stages {
        // The parity the producer's next wait for slot `s` uses.
        let parity = if s >= kv.stage { kv.phase ^ 1 } else { kv.phase };
        unsafe {
            mbarrier::wait_parity(sm.k_empty(s), parity);
            mbarrier::wait_parity(sm.v_empty(s), parity);
        }
    }
}
