//! A consumer warpgroup: 64 key rows of the CTA's block (`64 wg..64 wg + 64`) against every
//! (Q, dO) block of the ring. Per block of 64 queries:
//!
//! ```text
//! S^T  = -lse log2e / (scale log2e) + K_wg Q^T   (accumulator set from the slot's stats; SS
//!                                                  wgmma, m64n64, D/16 k-steps)
//! dP^T = -delta + V_wg dO^T                      (SS wgmma, m64n64)
//! P^T  = 2^(S^T scale log2e)   masked to 0 where the key is not seen
//! dS^T = P^T dP^T
//! dV  += P^T dO            (RS wgmma: P^T packed to bf16 in registers, dO MN-major)
//! dK  += dS^T Q            (RS wgmma)
//! dS^T -> shared (bf16, [key][query] 128B-swizzled); both consumers meet at a named barrier
//! dQ_acc += dS K           (SS wgmma, dS^T read MN-major, K MN-major; red.global.add.v2.f32)
//! ```
//!
//! dQ split: D = 128, consumer `wg` takes columns `64 wg..64 wg + 64` of every block; D = 64,
//! consumer `it % 2` takes block `it` whole. dK is scaled by the softmax scale at the store;
//! dQ's scale is applied by the convert kernel.
//!
//! Thread layout as the forward's (see [`crate::arch::wgmma`]): thread (warp `w`, lane `l`) holds
//! key rows `16w + l/4` and `+8` of the warpgroup's 64; element `4j + 2h + e` of an m64n64
//! accumulator is key row `+8h`, query column `8j + 2(l%4) + e`.
use super::schedule::bwd_work;
use super::BwdSmem;
use crate::arch::convert::pack_bf16x2;
use crate::arch::smem::{self, SmemAddr};
use crate::arch::wgmma::{self, Swizzle};
use crate::arch::{ids, math, mbarrier, memory, regs, sync};
use crate::gemm::ring::RingPos;
use crate::kernels::attention::schedule::uniform;
use mkernel_config::ops::attention::SWIZZLE_ROW;
use mkernel_config::ops::attention_bwd::AttentionBwdArgs;

macro_rules! unroll {
    ([$($n:literal)*], $i:ident => $body:block) => {
        $( { #[allow(non_upper_case_globals)] const $i: usize = $n; $body } )*
    };
}
macro_rules! unroll4 {
    ($i:ident => $body:block) => { unroll!([0 1 2 3], $i => $body) };
}
macro_rules! unroll8 {
    ($i:ident => $body:block) => { unroll!([0 1 2 3 4 5 6 7], $i => $body) };
}
macro_rules! unroll16 {
    ($i:ident => $body:block) => { unroll!([0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], $i => $body) };
}
macro_rules! unroll32 {
    ($i:ident => $body:block) => {
        unroll!([0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31], $i => $body)
    };
}

/// Bytes of a K step (16 bf16) inside a 128-byte swizzled row.
const K_STEP_BYTES: u32 = 32;
/// Bytes of 16 rows of a 128-byte swizzled box.
const ROWS16_BYTES: u32 = 16 * SWIZZLE_ROW;
/// Named barrier at which both consumers' dS^T halves are in shared memory (0 is
/// `__syncthreads`).
const DS_BARRIER: u32 = 1;

/// One arrival per warp on `bar`.
#[inline(always)]
fn release(bar: SmemAddr) {
    if ids::lane_id() == 0 {
        unsafe { mbarrier::arrive(bar) };
    }
}

/// f32 pairs packed to bf16x2: `out[i] = (x[2i], x[2i + 1])`, the A-fragment layout.
#[inline(always)]
fn pack16(x: &[f32; 32]) -> [u32; 16] {
    let mut p = [0u32; 16];
    unroll16!(i => {
        p[i] = pack_bf16x2(x[2 * i], x[2 * i + 1]);
    });
    p
}

/// Issues `acc += A B^T` over `D / 16` k-steps with A = 64 rows at `a` and B = 64 rows at `b`,
/// both K-major in `D / 64` boxes (`a_box`, `b_box` bytes apart).
#[inline(always)]
unsafe fn issue_nt<const D: u32>(acc: &mut [f32; 32], a: SmemAddr, a_box: u32, b: SmemAddr, b_box: u32) {
    // K's and V's descriptors are the same every block: computed from an opaque address, they
    // are not hoisted out of the loop (16 registers each, live across it).
    let a = SmemAddr(regs::opaque_u32(a.0));
    for ks in 0..D / 16 {
        let (bx, w) = (ks / 4, ks % 4);
        let da = wgmma::smem_desc(a.add(bx * a_box + w * K_STEP_BYTES), 16, 1024, Swizzle::B128);
        let db = wgmma::smem_desc(b.add(bx * b_box + w * K_STEP_BYTES), 16, 1024, Swizzle::B128);
        unsafe { wgmma::mma_m64n64k16_bf16_ss::<0, 0>(acc, da, db, true) };
    }
}

/// Issues `acc += A B` over the block's 64 query rows (4 k-steps): A (64 key rows x 64
/// queries) from registers, B = a Q or dO block `[query][D]` read MN-major.
#[inline(always)]
unsafe fn issue_rs<const D: u32>(acc: &mut [f32; 64], a: &[u32; 16], b: SmemAddr, b_box: u32) {
    unroll4!(ks => {
        let frag = [a[4 * ks], a[4 * ks + 1], a[4 * ks + 2], a[4 * ks + 3]];
        let db = wgmma::smem_desc(b.add(ks as u32 * ROWS16_BYTES), b_box, 1024, Swizzle::B128);
        if D == 128 {
            unsafe { wgmma::mma_m64n128k16_bf16_rs::<1>(acc, frag, db, true) };
        } else {
            let a32 = unsafe { &mut *(acc.as_mut_ptr() as *mut [f32; 32]) };
            unsafe { wgmma::mma_m64n64k16_bf16_rs::<1>(a32, frag, db, true) };
        }
    });
}

/// Pins the live registers of a dK / dV accumulator (64 for D = 128, the first 32 for D = 64).
#[inline(always)]
fn fence_acc<const D: u32>(acc: &mut [f32; 64]) {
    if D == 128 {
        wgmma::fence_operands_64(acc);
    } else {
        wgmma::fence_operands_32(unsafe { &mut *(acc.as_mut_ptr() as *mut [f32; 32]) });
    }
}

/// The consumer loop.
///
/// # Safety
/// Called by every thread of consumer warpgroup `wg` after the CTA's setup, for a CTA with work:
/// `sm` is this CTA's initialised shared memory, `a` the launch's argument block.
#[inline(always)]
pub unsafe fn run<const D: u32>(sm: &BwdSmem, a: &AttentionBwdArgs, wg: u32) {
    let Some(w) = (unsafe { bwd_work::<true>(a, ids::block_idx_reread()) }) else {
        return;
    };
    let wg = uniform(wg);
    let t = sm.tile;
    let tid = ids::thread_idx_reread() % mkernel_config::WARPGROUP_SIZE;
    let (warp, lane) = (tid / 32, tid % 32);
    // The thread's first key row inside the CTA's block, and inside the sequence.
    let kr0 = 64 * wg + 16 * warp + lane / 4;
    let key = [w.n0 + kr0, w.n0 + kr0 + 8];
    let col0 = 2 * (lane % 4);
    let (q_box, kv_box) = (t.q_box_bytes(), t.kv_box_bytes());
    let k_rows = sm.k().add(64 * wg * SWIZZLE_ROW);
    let v_rows = sm.v().add(64 * wg * SWIZZLE_ROW);
    let (scale_log2, heads_q) = (a.scale_log2, uniform(a.heads_q));
    let inv_scale_log2 = 1.0 / scale_log2;
    let mut dk = [0f32; 64];
    let mut dv = [0f32; 64];
    unsafe { mbarrier::wait_parity(sm.kv_full(), 0) };
    let mut pos = RingPos::START;
    let iterations = w.iterations();
    for it in 0..iterations {
        let (hq, m0) = w.at(it);
        let s_ = pos.stage;
        // The thread's 16 query columns: 8 (c / 2) + col0 + c % 2.
        let col_of = |c: usize| (8 * (c / 2)) as u32 + col0 + (c % 2) as u32;
        unsafe { mbarrier::wait_parity(sm.q_full(s_), pos.phase) };
        // The accumulators start at the per-query terms the loader put next to the slot: S^T at
        // -lse2 / (scale log2 e), dP^T at -delta. Then P^T = 2^(acc scale log2e) and
        // dS^T = P^T acc need no LSE or delta registers next to S^T, dP^T, dK and dV (with them
        // the D = 128 consumer spilled 44 bytes at 232 registers). Rows past the sequence hold 0
        // (masked below).
        let (mut s, mut dp) = ([0f32; 32], [0f32; 32]);
        let (lse2_at, delta_at) = (sm.lse2(s_), sm.delta(s_));
        unroll16!(c => {
            let off = 4 * col_of(c);
            let l2 = f32::from_bits(unsafe { smem::ld_shared_u32(lse2_at.add(off)) });
            let d = f32::from_bits(unsafe { smem::ld_shared_u32(delta_at.add(off)) });
            let (j, e) = (c / 2, c % 2);
            unroll!([0 1], h => {
                s[4 * j + 2 * h + e] = -l2 * inv_scale_log2;
                dp[4 * j + 2 * h + e] = -d;
            });
        });
        // The cp.async writes (generic proxy) before wgmma's reads (async proxy).
        memory::fence_proxy_async_shared();
        // The initial values in 64 distinct registers before the wgmmas read them (copies made
        // after `wgmma.fence` make ptxas inject a fence and a wait, C7519 / C7517).
        wgmma::fence_operands_32(&mut s);
        wgmma::fence_operands_32(&mut dp);
        wgmma::fence();
        unsafe { issue_nt::<D>(&mut s, k_rows, kv_box, sm.q(s_), q_box) };
        wgmma::commit_group();
        unsafe { issue_nt::<D>(&mut dp, v_rows, kv_box, sm.d_o(s_), q_box) };
        wgmma::commit_group();
        wgmma::wait_group::<1>();
        wgmma::fence_operands_32(&mut s);
        unroll32!(i => {
            let (j, h, e) = (i / 4, (i / 2) % 2, i % 2);
            let c = 2 * j + e;
            s[i] = if w.visible(m0 + col_of(c), key[h]) {
                math::ex2(s[i] * scale_log2)
            } else {
                0.0
            };
        });
        wgmma::wait_group::<0>();
        wgmma::fence_operands_32(&mut dp);
        unroll32!(i => {
            dp[i] *= s[i];
        });
        let p = pack16(&s);
        let ds = pack16(&dp);
        // dS^T to shared memory: key row kr0 + 8h, query columns 8j + col0 (+1), swizzled.
        // (The row and column through an opaque move: hoisted out of the loop, the 16 addresses
        // would stay live across it.)
        let buf = sm.ds(it % 2);
        let (kr, c2) = (regs::opaque_u32(kr0), regs::opaque_u32(2 * col0));
        unroll8!(j => {
            unroll!([0 1], h => {
                let r = kr + 8 * h as u32;
                let at = buf.add(r * SWIZZLE_ROW + ((j as u32 ^ (r % 8)) * 16) + c2);
                unsafe { smem::st_shared_u32(at, ds[2 * j + h]) };
            });
        });
        memory::fence_proxy_async_shared();
        wgmma::fence();
        unsafe { issue_rs::<D>(&mut dv, &p, sm.d_o(s_), q_box) };
        unsafe { issue_rs::<D>(&mut dk, &ds, sm.q(s_), q_box) };
        wgmma::commit_group();
        // Both halves of dS^T written (and the other consumer's reads of this buffer two
        // blocks ago retired: it waited for them before arriving here).
        sync::named_barrier_sync(DS_BARRIER, 256);
        // dV, dK done before dQ's accumulator is allocated (P^T, dS^T, dQ together spill).
        wgmma::wait_group::<0>();
        fence_acc::<D>(&mut dv);
        fence_acc::<D>(&mut dk);
        let mine = D == 128 || it % 2 == wg;
        if mine {
            let mut dq = [0f32; 32];
            let kcols = SmemAddr(regs::opaque_u32(
                if D == 128 { sm.k().add(wg * kv_box) } else { sm.k() }.0,
            ));
            for ks in 0..8u32 {
                let da = wgmma::smem_desc(buf.add(ks * ROWS16_BYTES), 16384, 1024, Swizzle::B128);
                let db = wgmma::smem_desc(kcols.add(ks * ROWS16_BYTES), kv_box, 1024, Swizzle::B128);
                if ks == 0 {
                    unsafe { wgmma::mma_m64n64k16_bf16_ss_first::<1, 1>(&mut dq, da, db) };
                } else {
                    unsafe { wgmma::mma_m64n64k16_bf16_ss::<1, 1>(&mut dq, da, db, true) };
                }
            }
            wgmma::commit_group();
            wgmma::wait_group::<0>();
            wgmma::fence_operands_32(&mut dq);
            release(sm.q_empty(s_));
            let c0 = regs::opaque_u32(if D == 128 { 64 * wg } else { 0 });
            let r0 = regs::opaque_u32(16 * warp + lane / 4);
            unroll!([0 1], h => {
                let q = m0 + r0 + 8 * h as u32;
                if q < w.q_len {
                    let g = (w.q_start + q) as u64;
                    let base = ((g * heads_q as u64 + hq as u64) * D as u64 + (c0 + col0) as u64) as usize;
                    let acc = a.dq_acc as *mut f32;
                    unroll8!(j => {
                        unsafe { memory::red_add_v2_f32(acc.add(base + 8 * j), [dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]]) };
                    });
                }
            });
        } else {
            release(sm.q_empty(s_));
        }
        pos.advance(t.stages);
    }
    // dK (scaled) and dV of the thread's key rows inside the sequence.
    let scale = a.scale;
    let heads_kv = uniform(a.heads_kv);
    unroll!([0 1], h => {
        if key[h] < w.k_len {
            let g = (w.k_start + key[h]) as u64;
            let base = ((g * heads_kv as u64 + w.h_kv as u64) * D as u64 + col0 as u64) / 2;
            unroll16!(j => {
                if j < D as usize / 8 {
                    let i = 4 * j + 2 * h;
                    unsafe {
                        (a.dk as *mut u32).add(base as usize + 4 * j).write(pack_bf16x2(dk[i] * scale, dk[i + 1] * scale));
                        (a.dv as *mut u32).add(base as usize + 4 * j).write(pack_bf16x2(dv[i], dv[i + 1]));
                    }
                }
            });
        }
    });
}
