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
///
/// # Safety
///
/// Called by every thread of the CTA; `src` and `dst` are 16-byte aligned addresses of `16 * n16` readable (source) and
/// writable (destination, local or a peer's heap) bytes of global memory; no other thread writes the source or accesses
/// the destination during the copy.
// Constant-bound index loops over register arrays: fully unrolled, constant indices.
#[allow(clippy::needless_range_loop)]
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

/// [`reduce_n`] instantiated for the run-time `world` (1..=8), so every loop over sources has
/// a constant trip count and the loaded vectors stay in registers.
///
/// # Safety
///
/// Called by every thread of the CTA; `world` is 1..=8; `srcs[..world]` are 16-byte aligned addresses of `16 * n16`
/// readable bytes of `dtype` elements each, and `dsts[..ndst]` (`ndst <= 8`) of `16 * n16` writable bytes; no other
/// thread writes a source or accesses a destination during the reduction.
#[inline(always)]
pub unsafe fn reduce(dsts: [u64; 8], ndst: u32, srcs: [u64; 8], world: u32, n16: u64, dtype: Dtype) {
    unsafe {
        match dtype {
            Dtype::Bf16 => reduce_w::<false>(dsts, ndst, srcs, world, n16),
            Dtype::F32 => reduce_w::<true>(dsts, ndst, srcs, world, n16),
        }
    }
}

/// # Safety
///
/// As [`reduce`].
#[inline(always)]
unsafe fn reduce_w<const F32: bool>(dsts: [u64; 8], ndst: u32, srcs: [u64; 8], world: u32, n16: u64) {
    unsafe {
        match world {
            1 => reduce_n::<1, 4, F32>(&dsts, ndst, &srcs, n16),
            2 => reduce_n::<2, 4, F32>(&dsts, ndst, &srcs, n16),
            3 => reduce_n::<3, 2, F32>(&dsts, ndst, &srcs, n16),
            4 => reduce_n::<4, 2, F32>(&dsts, ndst, &srcs, n16),
            5 => reduce_n::<5, 1, F32>(&dsts, ndst, &srcs, n16),
            6 => reduce_n::<6, 1, F32>(&dsts, ndst, &srcs, n16),
            7 => reduce_n::<7, 1, F32>(&dsts, ndst, &srcs, n16),
            _ => reduce_n::<8, 1, F32>(&dsts, ndst, &srcs, n16),
        }
    }
}

/// `dsts[*][i] = sum over r < W of srcs[r][i]` for `n16` 16-byte vectors, f32 accumulation,
/// the sum stored to every pointer in `dsts[..ndst]`. Sources are summed in rank order, so every
/// rank computes bit-identical sums. Each thread keeps `U` vectors of every source in flight
/// (remote loads over NVLink need many outstanding requests).
///
/// # Safety
///
/// As [`reduce`], with `W` sources `srcs[..W]` (`W` between 1 and 8) and `U >= 1`.
// Constant-bound index loops over register arrays: fully unrolled, constant indices.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub unsafe fn reduce_n<const W: usize, const U: usize, const F32: bool>(
    dsts: &[u64; 8],
    ndst: u32,
    srcs: &[u64; 8],
    n16: u64,
) {
    let (t, nt) = (ids::thread_idx() as u64, ids::block_dim() as u64);
    let mut base = t;
    // Full trips: U vectors per thread, no bounds checks; all loads before any sum.
    while base + (U as u64 - 1) * nt < n16 {
        let mut vs = [[[0u32; 4]; W]; U];
        for u in 0..U {
            let off = ((base + u as u64 * nt) * 16) as usize;
            for r in 0..W {
                vs[u][r] = unsafe { memory::ld_v4((srcs[r] as *const u8).add(off)) };
            }
        }
        for u in 0..U {
            unsafe { sum_store::<W, F32>(dsts, ndst, &vs[u], ((base + u as u64 * nt) * 16) as usize) };
        }
        base += nt * U as u64;
    }
    // The rest, one vector per trip.
    while base < n16 {
        let off = (base * 16) as usize;
        let mut v = [[0u32; 4]; W];
        for r in 0..W {
            v[r] = unsafe { memory::ld_v4((srcs[r] as *const u8).add(off)) };
        }
        unsafe { sum_store::<W, F32>(dsts, ndst, &v, off) };
        base += nt;
    }
}

/// # Safety
///
/// `dsts[..ndst]` (`ndst <= 8`) are 16-byte aligned addresses such that `dsts[d] + off` has 16 writable bytes of global
/// memory no other thread accesses concurrently.
// Constant-bound index loops over register arrays: fully unrolled, constant indices.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn sum_store<const W: usize, const F32: bool>(dsts: &[u64; 8], ndst: u32, vs: &[[u32; 4]; W], off: usize) {
    {
        let mut acc = [0f32; 8];
        for r in 0..W {
            let v = vs[r];
            if F32 {
                for w in 0..4 {
                    acc[w] += f32::from_bits(v[w]);
                }
            } else {
                for w in 0..4 {
                    acc[2 * w] += f32::from_bits(v[w] << 16);
                    acc[2 * w + 1] += f32::from_bits(v[w] & 0xffff_0000);
                }
            }
        }
        let out = if F32 {
            [acc[0].to_bits(), acc[1].to_bits(), acc[2].to_bits(), acc[3].to_bits()]
        } else {
            [
                pack_bf16x2(acc[0], acc[1]),
                pack_bf16x2(acc[2], acc[3]),
                pack_bf16x2(acc[4], acc[5]),
                pack_bf16x2(acc[6], acc[7]),
            ]
        };
        for d in 0..8 {
            if d as u32 >= ndst {
                continue;
            }
            unsafe { memory::st_v4((dsts[d] as *mut u8).add(off), out) };
        }
    }
}
