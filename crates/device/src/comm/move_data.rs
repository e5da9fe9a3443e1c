//! CTA-wide data movement in 16-byte vectors: copies (local -> local or peer) and sums of
//! several ranks' buffers with f32 accumulation. Each thread keeps `UNROLL` vectors in flight.
use crate::arch::{convert::pack_bf16x2, ids, memory};

/// 16-byte vectors each thread moves per loop trip (independent loads in flight).
const UNROLL: usize = 4;

/// Element type of a reduction.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F32,
}

/// Copies `n16` 16-byte vectors from `src` to `dst` with all threads of the CTA.
#[inline(always)]
pub unsafe fn copy(dst: *mut u8, src: *const u8, n16: u64) {
    let (t, nt) = (ids::thread_idx() as u64, ids::block_dim() as u64);
    let mut i = t;
    let step = nt * UNROLL as u64;
    while i + (UNROLL as u64 - 1) * nt < n16 {
        let mut v = [[0u32; 4]; UNROLL];
        for u in 0..UNROLL {
            v[u] = unsafe { memory::ld_v4(src.add(((i + u as u64 * nt) * 16) as usize)) };
        }
        for u in 0..UNROLL {
            unsafe { memory::st_v4(dst.add(((i + u as u64 * nt) * 16) as usize), v[u]) };
        }
        i += step;
    }
    while i < n16 {
        unsafe { memory::st_v4(dst.add((i * 16) as usize), memory::ld_v4(src.add((i * 16) as usize))) };
        i += nt;
    }
}

/// [`reduce_n`] for a run-time `world` (2, 4 or 8 get fully unrolled code; others the generic 8).
#[inline(always)]
pub unsafe fn reduce(dsts: &[u64; 8], ndst: u32, srcs: &[u64; 8], world: u32, n16: u64, dtype: Dtype) {
    unsafe {
        match world {
            1 => reduce_n::<1>(dsts, ndst, srcs, n16, dtype),
            2 => reduce_n::<2>(dsts, ndst, srcs, n16, dtype),
            4 => reduce_n::<4>(dsts, ndst, srcs, n16, dtype),
            _ => reduce_n::<8>(dsts, ndst.min(world), srcs, n16, dtype),
        }
    }
}

/// `dsts[*][i] = sum over r < W of srcs[r][i]` for `n16` 16-byte vectors, f32 accumulation,
/// the sum stored to every pointer in `dsts[..ndst]`. Sources are summed in rank order, so every
/// rank computes bit-identical sums. Unused sources (r >= world when W = 8) must be 0 and are
/// skipped.
#[inline(always)]
pub unsafe fn reduce_n<const W: usize>(dsts: &[u64; 8], ndst: u32, srcs: &[u64; 8], n16: u64, dtype: Dtype) {
    let (t, nt) = (ids::thread_idx() as u64, ids::block_dim() as u64);
    let mut i = t;
    while i < n16 {
        let off = (i * 16) as usize;
        // All loads first (predicated, independent), then the sums in rank order.
        let mut vs = [[0u32; 4]; W];
        for r in 0..W {
            if srcs[r] != 0 {
                vs[r] = unsafe { memory::ld_v4((srcs[r] as *const u8).add(off)) };
            }
        }
        let mut acc = [0f32; 8];
        for r in 0..W {
            let v = vs[r];
            match dtype {
                Dtype::Bf16 => {
                    for w in 0..4 {
                        acc[2 * w] += f32::from_bits(v[w] << 16);
                        acc[2 * w + 1] += f32::from_bits(v[w] & 0xffff_0000);
                    }
                }
                Dtype::F32 => {
                    for w in 0..4 {
                        acc[w] += f32::from_bits(v[w]);
                    }
                }
            }
        }
        let out = match dtype {
            Dtype::Bf16 => [pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]), pack_bf16x2(acc[6], acc[7])],
            Dtype::F32 => [acc[0].to_bits(), acc[1].to_bits(), acc[2].to_bits(), acc[3].to_bits()],
        };
        for d in 0..8 {
            if d as u32 >= ndst {
                continue;
            }
            unsafe { memory::st_v4((dsts[d] as *mut u8).add(off), out) };
        }
        i += nt;
    }
}
