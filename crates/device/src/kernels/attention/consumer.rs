//! A consumer warpgroup: 64 query rows of each tile against every key block of the tile.
//!
//! Per key block `n` (after block 0, which runs alone): issue `S = Q K_n^T` (SS wgmma), issue
//! `O += P_{n-1} V_{n-1}` (RS wgmma: P in registers as bf16x2, V through the transpose bit),
//! wait for S only, mask it and compute `P_n` and the new row maxima while the tensor cores
//! still multiply P V, then wait for O and rescale it. Scores stay f32 from the wgmma to the
//! exponent (`ex2` of `S * scale * log2 e - max`). The two consumers take turns issuing their
//! wgmmas ([`turn_begin`]), so one's softmax overlaps the other's matmuls.
//!
//! Thread layout (see [`crate::arch::wgmma`]): thread `t` (warp `w`, lane `l`) holds rows
//! `r = 16w + l/4` and `r + 8` of the warpgroup's 64; element `4j + 2h + e` of an accumulator is
//! row `r + 8h`, column `8j + 2(l%4) + e`. A row's values are spread over the 4 lanes of a quad.
use super::schedule::{total, uniform, work_in, Mask, Work, BLOCK};
use super::Smem;
use crate::arch::convert::pack_bf16x2;
use crate::arch::memory;
use crate::arch::shuffle::shfl_xor;
use crate::arch::smem::SmemAddr;
use crate::arch::wgmma::{self, Swizzle};
use crate::arch::{ids, math, mbarrier, sync};
use crate::gemm::ring::RingPos;
use mkernel_config::comm::CommDesc;
use mkernel_config::ops::attention::{AttentionArgs, RingArgs, SWIZZLE_ROW};

macro_rules! unroll {
    ([$($n:literal)*], $i:ident => $body:block) => {
        $( { #[allow(non_upper_case_globals)] const $i: usize = $n; $body } )*
    };
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
macro_rules! unroll64 {
    ($i:ident => $body:block) => {
        unroll!([0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
                 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63], $i => $body)
    };
}

/// Bytes of a K step (16 bf16) inside a 128-byte swizzled row.
const K_STEP_BYTES: u32 = 32;
/// Bytes of 16 rows of a 128-byte swizzled box (a K step of `P V` along the key rows).
const ROWS16_BYTES: u32 = 16 * SWIZZLE_ROW;

/// Named barrier of consumer 0's turn; consumer 1's is the next id (0 is `__syncthreads`).
const TURN_BARRIER: u32 = 1;

/// Waits for this consumer's turn at the tensor cores: the two consumers issue their wgmmas
/// in alternation (barrier `TURN_BARRIER + wg`: this warpgroup syncs, the other arrives), so
/// one's softmax runs while the other's matmuls occupy the tensor cores (FlashAttention-3's
/// ping-pong). Every tile takes `n_blocks + 1` turns in both consumers.
#[inline(always)]
fn turn_begin(wg: u32) {
    if cfg!(mk_variant = "no_pingpong") {
        return;
    }
    sync::named_barrier_sync(TURN_BARRIER + wg, 256);
}
/// Hands the turn to the other consumer.
#[inline(always)]
fn turn_end(wg: u32) {
    if cfg!(mk_variant = "no_pingpong") {
        return;
    }
    sync::named_barrier_arrive(TURN_BARRIER + (1 - wg), 256);
}

/// One arrival per warp on `bar`.
#[inline(always)]
fn release(bar: SmemAddr) {
    if ids::lane_id() == 0 {
        unsafe { mbarrier::arrive(bar) };
    }
}

/// Max over the quad (the 4 lanes that hold one row).
#[inline(always)]
fn quad_max(x: f32) -> f32 {
    let x = x.max(f32::from_bits(shfl_xor(x.to_bits(), 1)));
    x.max(f32::from_bits(shfl_xor(x.to_bits(), 2)))
}
/// Sum over the quad.
#[inline(always)]
fn quad_sum(x: f32) -> f32 {
    let x = x + f32::from_bits(shfl_xor(x.to_bits(), 1));
    x + f32::from_bits(shfl_xor(x.to_bits(), 2))
}

/// Issues `S = Q K^T` for this warpgroup's 64 rows over the `D / 16` K steps.
#[inline(always)]
unsafe fn issue_qk<const D: u32>(s: &mut [f32; 64], q: SmemAddr, k: SmemAddr, q_box: u32, k_box: u32) {
    for ks in 0..D / 16 {
        let (bx, w) = (ks / 4, ks % 4);
        let da = wgmma::smem_desc(q.add(bx * q_box + w * K_STEP_BYTES), 16, 1024, Swizzle::B128);
        let db = wgmma::smem_desc(k.add(bx * k_box + w * K_STEP_BYTES), 16, 1024, Swizzle::B128);
        if ks == 0 {
            unsafe { wgmma::mma_m64n128k16_bf16_first::<0>(s, da, db) };
        } else {
            unsafe { wgmma::mma_m64n128k16_bf16::<0>(s, da, db, true) };
        }
    }
}

/// Issues `O (+)= P V` over the block's 128 key rows (8 K steps); V is `[key][head_dim]` in
/// `D / 64` boxes of 128 rows, read MN-major (transpose bit), `lbo` = one box.
#[inline(always)]
// `ks > 0` is a constant of each unrolled step (false on the first): the comparison is meant.
#[allow(clippy::absurd_extreme_comparisons)]
unsafe fn issue_pv<const D: u32>(o: &mut [f32; 64], p: &[u32; 32], v: SmemAddr, v_box: u32, accumulate: bool) {
    unroll8!(ks => {
        let a = [p[4 * ks], p[4 * ks + 1], p[4 * ks + 2], p[4 * ks + 3]];
        let db = wgmma::smem_desc(v.add(ks as u32 * ROWS16_BYTES), v_box, 1024, Swizzle::B128);
        let acc = accumulate || ks > 0;
        if D == 128 {
            unsafe { wgmma::mma_m64n128k16_bf16_rs::<1>(o, a, db, acc) };
        } else {
            let o32 = unsafe { &mut *(o.as_mut_ptr() as *mut [f32; 32]) };
            unsafe { wgmma::mma_m64n64k16_bf16_rs::<1>(o32, a, db, acc) };
        }
    });
}

/// Pins O's live registers (all 64 for D = 128, the first 32 for D = 64).
#[inline(always)]
fn fence_o<const D: u32>(o: &mut [f32; 64]) {
    if D == 128 {
        wgmma::fence_operands_64(o);
    } else {
        wgmma::fence_operands_32(unsafe { &mut *(o.as_mut_ptr() as *mut [f32; 32]) });
    }
}

/// Sets masked scores to -inf: keys a row does not see. `lim[h]` is the number of keys (a
/// prefix) row `h` of the thread sees ([`Work::visible`]), `col` its first column.
#[inline(always)]
fn mask(s: &mut [f32; 64], col: i32, lim: [i32; 2]) {
    unroll64!(i => {
        let (j, h, e) = (i / 4, (i / 2) % 2, i % 2);
        let kv = col + (8 * j + e) as i32;
        if kv >= lim[h] {
            s[i] = f32::NEG_INFINITY;
        }
    });
}

/// Row maxima of `s` (both rows of the thread), reduced over the quad, at least `m`.
#[inline(always)]
fn row_max(s: &[f32; 64], m: [f32; 2]) -> [f32; 2] {
    let mut mx = m;
    unroll64!(i => {
        let h = (i / 2) % 2;
        mx[h] = mx[h].max(s[i]);
    });
    [quad_max(mx[0]), quad_max(mx[1])]
}

/// `S = 2^(S * scale_log2 - m * scale_log2)` in place (P, f32), and the thread's partial row
/// sums of P. A row whose maximum is still -inf (all masked so far) uses 0 as its offset, so it
/// gets P = 0, not NaN.
#[inline(always)]
fn exponentiate(s: &mut [f32; 64], m: [f32; 2], scale_log2: f32) -> [f32; 2] {
    let off = [
        if m[0] == f32::NEG_INFINITY {
            0.0
        } else {
            m[0] * scale_log2
        },
        if m[1] == f32::NEG_INFINITY {
            0.0
        } else {
            m[1] * scale_log2
        },
    ];
    let mut sum = [0f32; 2];
    unroll64!(i => {
        let h = (i / 2) % 2;
        s[i] = math::ex2(core::intrinsics::fmaf32(s[i], scale_log2, -off[h]));
        sum[h] += s[i];
    });
    sum
}

/// P (f32) packed pairwise to bf16x2: the A operand of `P V` (see [`wgmma::mma_m64n128k16_bf16_rs`]).
#[inline(always)]
fn pack(s: &[f32; 64]) -> [u32; 32] {
    let mut p = [0u32; 32];
    unroll32!(i => {
        p[i] = pack_bf16x2(s[2 * i], s[2 * i + 1]);
    });
    p
}

/// Waits for a K or V slot. Ring attention bounds it past the communication timeouts the
/// producer can be behind (4 x the timeout + `HUNG_NS`, as the fused kernels) and then traps.
#[inline(always)]
unsafe fn wait_slot<const RING: bool>(bar: SmemAddr, parity: u32, args: *const AttentionArgs) {
    if RING {
        let _ = unsafe {
            mbarrier::wait_parity_or(bar, parity, move |stalled| {
                let d = (*(args as *const RingArgs)).desc as *const CommDesc;
                if stalled > (*d).timeout_ns.saturating_mul(4).saturating_add(mbarrier::HUNG_NS) {
                    crate::arch::trap();
                }
                false
            })
        };
    } else {
        unsafe { mbarrier::wait_parity(bar, parity) };
    }
}

/// The consumer loop. `RING`: `args` is a [`RingArgs`] block; the tiles are walked once per
/// ring step (the key/value shard of rank `(r - t) mod W` at step `t`) and each tile's partial
/// is merged into the running f32 O and LSE ([`merge`]).
///
/// # Safety
/// Called by every thread of consumer warpgroup `wg` after the CTA's setup: `sm` is this CTA's
/// initialised shared memory, `args` the launch's argument block (a [`RingArgs`] block when `RING`).
#[inline(always)]
pub unsafe fn run<const D: u32, const RING: bool>(sm: &Smem, args: *const AttentionArgs, wg: u32) {
    let a = unsafe { &*args };
    let t = sm.tile;
    let scale_log2 = a.scale_log2;
    let tid = ids::thread_idx_reread() % 128;
    let (warp, lane) = (tid / 32, tid % 32);
    let row0 = 64 * wg + 16 * warp + lane / 4;
    let col0 = 2 * (lane % 4);
    let (q_box, kv_box) = (t.q_box_bytes(), t.kv_box_bytes());
    let q_rows = sm.q().add(64 * wg * SWIZZLE_ROW);
    let (mut kpos, mut vpos) = (RingPos::START, RingPos::START);
    let mut q_phase = 0u32;
    let (end, stride) = if RING {
        let r = unsafe { &*(args as *const RingArgs) };
        (total::<true>(a), uniform(r.compute_ctas))
    } else {
        (total::<true>(a), ids::grid_dim())
    };
    let steps = if RING { uniform(unsafe { ring_world(args) }) } else { 1 };
    // Consumer 0 takes the first turn.
    if wg == 1 && !cfg!(mk_variant = "no_pingpong") {
        sync::named_barrier_arrive(TURN_BARRIER, 256);
    }
    for step in 0..steps {
        let zigzag = if RING {
            unsafe { ring_mask::<true>(args, step) }
        } else {
            None
        };
        let mut i = ids::block_idx_reread();
        while i < end {
            let w = unsafe { work_in::<true>(a, i, zigzag) };
            i += stride;
            let Some(w) = w else { continue };
            let row = (w.m0 + row0) as i32;
            let lim = [w.visible(row), w.visible(row + 8)];
            let mut o = [0f32; 64];
            let mut m = [f32::NEG_INFINITY; 2];
            let mut l = [0f32; 2];
            if w.n_blocks > 0 {
                unsafe { mbarrier::wait_parity(sm.q_full(), q_phase) };
                q_phase ^= 1;
                // Key block 0.
                let mut s = [0f32; 64];
                unsafe { wait_slot::<RING>(sm.k_full(kpos.stage), kpos.phase, args) };
                turn_begin(wg);
                wgmma::fence();
                unsafe { issue_qk::<D>(&mut s, q_rows, sm.k(kpos.stage), q_box, kv_box) };
                wgmma::commit_group();
                turn_end(wg);
                wgmma::wait_group::<0>();
                wgmma::fence_operands_64(&mut s);
                release(sm.k_empty(kpos.stage));
                kpos.advance(t.stages);
                if w.n_blocks == 1 {
                    release(sm.q_empty());
                }
                if w.needs_mask(0) {
                    mask(&mut s, col0 as i32, lim);
                }
                m = row_max(&s, m);
                l = exponentiate(&mut s, m, scale_log2);
                let mut p = pack(&s);
                // Key blocks 1.. overlapped with P V of the block before.
                for n in 1..w.n_blocks {
                    unsafe { wait_slot::<RING>(sm.k_full(kpos.stage), kpos.phase, args) };
                    unsafe { wait_slot::<RING>(sm.v_full(vpos.stage), vpos.phase, args) };
                    turn_begin(wg);
                    wgmma::fence();
                    unsafe { issue_qk::<D>(&mut s, q_rows, sm.k(kpos.stage), q_box, kv_box) };
                    wgmma::commit_group();
                    unsafe { issue_pv::<D>(&mut o, &p, sm.v(vpos.stage), kv_box, n > 1) };
                    wgmma::commit_group();
                    turn_end(wg);
                    wgmma::wait_group::<1>();
                    wgmma::fence_operands_64(&mut s);
                    release(sm.k_empty(kpos.stage));
                    kpos.advance(t.stages);
                    if n + 1 == w.n_blocks {
                        release(sm.q_empty());
                    }
                    if w.needs_mask(n) {
                        mask(&mut s, (n * BLOCK + col0) as i32, lim);
                    }
                    let m_new = row_max(&s, m);
                    let factor = [0, 1].map(|h| {
                        if m_new[h] == f32::NEG_INFINITY {
                            1.0
                        } else {
                            math::ex2((m[h] - m_new[h]) * scale_log2)
                        }
                    });
                    let sum = exponentiate(&mut s, m_new, scale_log2);
                    wgmma::wait_group::<0>();
                    fence_o::<D>(&mut o);
                    // P is packed over the registers the finished P V read, so only now.
                    wgmma::fence_operands_64(&mut s);
                    release(sm.v_empty(vpos.stage));
                    vpos.advance(t.stages);
                    unroll64!(i => {
                        if i < D as usize / 2 {
                            o[i] *= factor[(i / 2) % 2];
                        }
                    });
                    l = [l[0] * factor[0] + sum[0], l[1] * factor[1] + sum[1]];
                    m = m_new;
                    p = pack(&s);
                }
                // The last block's P V.
                unsafe { wait_slot::<RING>(sm.v_full(vpos.stage), vpos.phase, args) };
                turn_begin(wg);
                wgmma::fence();
                unsafe { issue_pv::<D>(&mut o, &p, sm.v(vpos.stage), kv_box, w.n_blocks > 1) };
                wgmma::commit_group();
                turn_end(wg);
                wgmma::wait_group::<0>();
                fence_o::<D>(&mut o);
                release(sm.v_empty(vpos.stage));
                vpos.advance(t.stages);
            }
            if RING {
                unsafe { merge::<D>(args as *const RingArgs, &w, &o, m, l, row, col0, step, steps) };
            } else {
                unsafe { store::<D>(a, &w, &mut o, m, l, row, col0, scale_log2) };
            }
        }
    }
    // Consumer 1's last turn handed one to consumer 0: take it, so no arrival is left pending.
    if wg == 0 && !cfg!(mk_variant = "no_pingpong") {
        sync::named_barrier_sync(TURN_BARRIER, 256);
    }
}

/// Normalizes O by the row sums and stores it (bf16) and the LSE (f32) for the rows inside
/// the sequence. A row with no visible key (sum 0) gets O = 0 and LSE = -inf.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn store<const D: u32>(
    a: &AttentionArgs,
    w: &Work,
    o: &mut [f32; 64],
    m: [f32; 2],
    l: [f32; 2],
    row: i32,
    col0: u32,
    scale_log2: f32,
) {
    let l = [quad_sum(l[0]), quad_sum(l[1])];
    let inv = l.map(|x| if x > 0.0 { 1.0 / x } else { 0.0 });
    let out = a.o as *mut u32;
    unroll!([0 1], h => {
        let q = row as u32 + 8 * h as u32;
        if q < w.q_len {
        let g = (w.q_start + q) as u64;
        // bf16 pairs: element offset / 2.
        let base = ((g * a.heads_q as u64 + w.h as u64) * D as u64 + col0 as u64) / 2;
        unroll16!(j => {
            if j < D as usize / 8 {
                let (x, y) = if h == 0 { (o[4 * j], o[4 * j + 1]) } else { (o[4 * j + 2], o[4 * j + 3]) };
                let hi = h;
                unsafe { out.add(base as usize + 4 * j).write(pack_bf16x2(x * inv[hi], y * inv[hi])) };
            }
        });
        // The LSE is optional: a null `lse` writes none.
        if col0 == 0 && a.lse != 0 {
            let hi = h;
            let lse = if l[hi] > 0.0 {
                (m[hi] * scale_log2 + math::lg2(l[hi])) * core::f32::consts::LN_2
            } else {
                f32::NEG_INFINITY
            };
            let at = if a.cu_seqlens_q != 0 {
                w.h as u64 * a.total_q as u64 + (w.q_start + q) as u64
            } else {
                (w.b as u64 * a.heads_q as u64 + w.h as u64) * w.q_len as u64 + q as u64
            };
            unsafe { (a.lse as *mut f32).add(at as usize).write(lse) };
        }
    }
    });
}

/// Ranks of the ring: every rank of the job (`RingArgs::desc`).
#[inline(always)]
unsafe fn ring_world(args: *const AttentionArgs) -> u32 {
    unsafe { (*((*(args as *const RingArgs)).desc as *const CommDesc)).global_world }
}

/// The mask of ring step `step`: [`Mask::None`] (non-causal), or the zigzag mask of the local
/// queries against the shard of rank `(r - step) mod W`.
/// `UNIFORM` (full warps only): the values read from memory go through [`uniform`]; the
/// producer's single thread passes `false`.
///
/// # Safety
/// `args` is a [`RingArgs`] block with a valid communicator descriptor; `UNIFORM` only when every
/// lane of the warp calls it.
#[inline(always)]
pub unsafe fn ring_mask<const UNIFORM: bool>(args: *const AttentionArgs, step: u32) -> Option<Mask> {
    let uniform = |x: u32| if UNIFORM { uniform(x) } else { x };
    let r = unsafe { &*(args as *const RingArgs) };
    if uniform(r.attn.causal) == 0 {
        return Some(Mask::None);
    }
    let d = unsafe { &*(r.desc as *const CommDesc) };
    // The ring is in global rank order over the whole job.
    let (rank, world) = (uniform(d.global_rank), uniform(d.global_world));
    let src = (rank + world - step % world) % world;
    Some(Mask::Zigzag {
        chunk: uniform(r.chunk),
        q: [rank, 2 * world - 1 - rank],
        k: [src, 2 * world - 1 - src],
    })
}

/// Ring attention's epilogue of one tile at step `step` of `steps`: merges this step's partial
/// (`o` unnormalized, row maxima `m`, row sums `l`) into the running f32 O and LSE through the
/// log-sum-exp (`m = max(lse_a, lse_b)`, weights `2^((lse - m) log2 e)`), all in f32. The last
/// step writes O (bf16) and LSE (f32) instead of the running values. Each thread reads back
/// only what it wrote at the step before (the same CTA owns a tile at every step); a row's LSE
/// is read by the quad's first lane and passed on by a shuffle before that lane writes it.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn merge<const D: u32>(
    r: *const RingArgs,
    w: &Work,
    o: &[f32; 64],
    m: [f32; 2],
    l: [f32; 2],
    row: i32,
    col0: u32,
    step: u32,
    steps: u32,
) {
    let r = unsafe { &*r };
    let a = &r.attn;
    let scale_log2 = a.scale_log2;
    let l = [quad_sum(l[0]), quad_sum(l[1])];
    let last = step + 1 == steps;
    let lane = ids::lane_id();
    unroll!([0 1], h => {
        let q = row as u32 + 8 * h as u32;
        let inside = q < w.q_len;
        let lse_p = if l[h] > 0.0 {
            (m[h] * scale_log2 + math::lg2(l[h])) * core::f32::consts::LN_2
        } else {
            f32::NEG_INFINITY
        };
        let at = ((w.b as u64 * a.heads_q as u64 + w.h as u64) * w.q_len as u64 + q as u64) as usize;
        let mut lse_a = f32::NEG_INFINITY;
        if step > 0 && inside && col0 == 0 {
            lse_a = unsafe { (r.lse_acc as *const f32).add(at).read() };
        }
        let lse_a = f32::from_bits(crate::arch::shuffle::shfl_idx(lse_a.to_bits(), lane & !3));
        let mx = lse_a.max(lse_p);
        let (ca, cb, lse) = if mx == f32::NEG_INFINITY {
            (0.0, 0.0, f32::NEG_INFINITY)
        } else {
            let wa = math::ex2((lse_a - mx) * core::f32::consts::LOG2_E);
            let wb = math::ex2((lse_p - mx) * core::f32::consts::LOG2_E);
            let inv = 1.0 / (wa + wb);
            let cb = if l[h] > 0.0 { wb * inv / l[h] } else { 0.0 };
            (wa * inv, cb, mx + math::lg2(wa + wb) * core::f32::consts::LN_2)
        };
        if inside {
            let g = (w.q_start + q) as u64;
            let base = ((g * a.heads_q as u64 + w.h as u64) * D as u64 + col0 as u64) as usize;
            let acc = r.o_acc as *mut f32;
            unroll16!(j => {
                if j < D as usize / 8 {
                    let (x, y) = if h == 0 { (o[4 * j], o[4 * j + 1]) } else { (o[4 * j + 2], o[4 * j + 3]) };
                    let (mut x, mut y) = (x * cb, y * cb);
                    if step > 0 {
                        let old = unsafe { memory::ld_v2(acc.add(base + 8 * j) as *const u8) };
                        x += ca * f32::from_bits(old[0]);
                        y += ca * f32::from_bits(old[1]);
                    }
                    if last {
                        unsafe { (a.o as *mut u32).add((base + 8 * j) / 2).write(pack_bf16x2(x, y)) };
                    } else {
                        unsafe { memory::st_v2(acc.add(base + 8 * j) as *mut u8, [x.to_bits(), y.to_bits()]) };
                    }
                }
            });
            if col0 == 0 {
                let dst = if last { a.lse } else { r.lse_acc };
                unsafe { (dst as *mut f32).add(at).write(lse) };
            }
        }
    });
}
