//! The backward's elementwise kernels around the main one (grid-stride loops, any grid of
//! `BWD_ELEMENTWISE_THREADS`-thread CTAs).
use crate::arch::convert::pack_bf16x2;
use crate::arch::shuffle::warp_sum_f32;
use crate::arch::{ids, memory};
use mkernel_config::ops::attention_bwd::{AttentionBwdArgs, BWD_ELEMENTWISE_THREADS};

/// bf16x2 bits to two f32.
#[inline(always)]
fn unpack(x: u32) -> (f32, f32) {
    (f32::from_bits(x << 16), f32::from_bits(x & 0xffff_0000))
}

/// `mk_flash_attn_bwd_prep`: per (query row, head) `delta = sum_d dO * O` (f32) and
/// `lse2 = lse * log2(e)` (`+inf` where the forward's LSE is `-inf`: such a row sees no key, and
/// `2^(s - inf) = 0`), both `[heads_q][total_q]`; then zeroes the f32 dQ accumulator. One warp
/// per (row, head); lane `l` reads bf16 pairs `l, l + 32, ...` of the row.
///
/// # Safety
/// The launch contract of `crate::kernels`; `a.o`, `a.d_o` hold `total_q x heads_q x head_dim`
/// bf16, `a.lse` the forward's LSE, the workspace pointers their sizes; `D` is the head dim.
#[inline(always)]
unsafe fn prep<const D: u32>(a: &AttentionBwdArgs) {
    let warps = ids::grid_dim() * (BWD_ELEMENTWISE_THREADS / 32);
    let lane = ids::lane_id();
    let (hq, total_q) = (a.heads_q, a.total_q);
    let items = total_q * hq;
    let mut it = ids::block_idx() * (BWD_ELEMENTWISE_THREADS / 32) + ids::warp_idx();
    while it < items {
        let (row, h) = (it / hq, it % hq);
        let base = ((row as u64 * hq as u64 + h as u64) * D as u64 / 2) as usize;
        let mut sum = 0f32;
        for i in 0..D / 64 {
            let at = base + (lane + 32 * i) as usize;
            let (o, d) = unsafe { ((a.o as *const u32).add(at).read(), (a.d_o as *const u32).add(at).read()) };
            let ((o0, o1), (d0, d1)) = (unpack(o), unpack(d));
            sum += o0 * d0 + o1 * d1;
        }
        let sum = warp_sum_f32(sum);
        if lane == 0 {
            let lse_at = if a.cu_seqlens_q != 0 {
                h as u64 * total_q as u64 + row as u64
            } else {
                let (b, s) = (row / a.seqlen_q, row % a.seqlen_q);
                (b as u64 * hq as u64 + h as u64) * a.seqlen_q as u64 + s as u64
            };
            let lse = unsafe { (a.lse as *const f32).add(lse_at as usize).read() };
            let lse2 = if lse == f32::NEG_INFINITY {
                f32::INFINITY
            } else {
                lse * core::f32::consts::LOG2_E
            };
            let at = (h as u64 * total_q as u64 + row as u64) as usize;
            unsafe {
                (a.delta as *mut f32).add(at).write(sum);
                (a.lse2 as *mut f32).add(at).write(lse2);
            }
        }
        it += warps;
    }
    let threads = ids::grid_dim() as u64 * BWD_ELEMENTWISE_THREADS as u64;
    let n4 = items as u64 * D as u64 / 4;
    let mut i = ids::block_idx() as u64 * BWD_ELEMENTWISE_THREADS as u64 + ids::thread_idx() as u64;
    while i < n4 {
        unsafe { memory::st_v4((a.dq_acc as *mut u8).add(16 * i as usize), [0; 4]) };
        i += threads;
    }
}

/// Backward preprocess (see [`prep`]); `head_dim` is 64 or 128.
///
/// # Safety
/// As [`prep`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_flash_attn_bwd_prep(a: AttentionBwdArgs, head_dim: u32) {
    if head_dim == 64 {
        unsafe { prep::<64>(&a) }
    } else {
        unsafe { prep::<128>(&a) }
    }
}

/// `mk_flash_attn_bwd_dq`: `dQ = bf16(scale * dQ_acc)` over `n` elements (a multiple of 8);
/// thread `i` of the grid takes 8 elements at `8 i, 8 (i + threads), ...`.
///
/// # Safety
/// The launch contract of `crate::kernels`; `a.dq_acc` holds `n` f32 and `a.dq` `n` bf16, both
/// 16-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_flash_attn_bwd_dq(a: AttentionBwdArgs, n: u64) {
    let threads = ids::grid_dim() as u64 * BWD_ELEMENTWISE_THREADS as u64;
    let mut i = ids::block_idx() as u64 * BWD_ELEMENTWISE_THREADS as u64 + ids::thread_idx() as u64;
    let s = a.scale;
    while 8 * i < n {
        let src = a.dq_acc as *const u8;
        let (lo, hi) = unsafe {
            (
                memory::ld_v4(src.add(32 * i as usize)),
                memory::ld_v4(src.add(32 * i as usize + 16)),
            )
        };
        let f = |x: u32| f32::from_bits(x) * s;
        let out = [
            pack_bf16x2(f(lo[0]), f(lo[1])),
            pack_bf16x2(f(lo[2]), f(lo[3])),
            pack_bf16x2(f(hi[0]), f(hi[1])),
            pack_bf16x2(f(hi[2]), f(hi[3])),
        ];
        unsafe { memory::st_v4((a.dq as *mut u8).add(16 * i as usize), out) };
        i += threads;
    }
}
