//! `mk_moe_combine`: `out[t] = sum_j w[t, j] * Yp[slot(t, j)]` in f32, j in order (the same
//! sum on every run), stored as bf16 or f32. CTA `b` of `g` takes tokens `b, b + g, ...`;
//! each thread 8 columns at a time, the `top_k` rows' loads issued four at a time before
//! they are added.
use crate::arch::{ids, memory};
use mkernel_config::ops::moe::{MoeCombineArgs, ROW_THREADS};

/// Stores the 8 sums `$acc` (`[f32; 8]`) as elements `$at..$at + 8` of `$out` (a device address, 16-byte aligned
/// there): f32 if `$f32_out != 0`, else bf16 (round to nearest even). A macro, not a function: as an
/// `#[inline(always)]` fn it changed the PTX of `mk_moe_combine`.
macro_rules! store_sums {
    ($out:expr, $at:expr, $acc:expr, $f32_out:expr) => {{
        let (at, acc) = ($at, &$acc);
        if $f32_out != 0 {
            let p = $out as u64 + 4 * at;
            let lo = [acc[0].to_bits(), acc[1].to_bits(), acc[2].to_bits(), acc[3].to_bits()];
            let hi = [acc[4].to_bits(), acc[5].to_bits(), acc[6].to_bits(), acc[7].to_bits()];
            unsafe {
                $crate::arch::memory::st_v4(p as *mut u8, lo);
                $crate::arch::memory::st_v4((p + 16) as *mut u8, hi);
            }
        } else {
            let v = [
                $crate::arch::convert::pack_bf16x2(acc[0], acc[1]),
                $crate::arch::convert::pack_bf16x2(acc[2], acc[3]),
                $crate::arch::convert::pack_bf16x2(acc[4], acc[5]),
                $crate::arch::convert::pack_bf16x2(acc[6], acc[7]),
            ];
            unsafe { $crate::arch::memory::st_v4(($out as u64 + 2 * at) as *mut u8, v) };
        }
    }};
}
pub(crate) use store_sums;

/// # Safety
///
/// The argument-block contract (`crate::kernels::moe`); the slots were written by `mk_moe_route` and the grouped rows
/// `yp` by the down projection, both complete before this launch; `weights` is the device address of `tokens * top_k`
/// `f32`s; `out` a 16-byte aligned device address of `tokens x hidden` writable elements (f32 if `f32_out != 0`, else
/// bf16).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_combine(
    args: *const MoeCombineArgs,
    weights: *const f32,
    out: *mut u8,
    f32_out: u32,
) {
    let a = unsafe { args.read() };
    let pieces = a.hidden / 8;
    let row_bytes = a.hidden as u64 * 2;
    let slots = a.slots as *const u32;
    let mut t = ids::block_idx();
    while t < a.tokens {
        let pair0 = t * a.top_k;
        let mut c = ids::thread_idx();
        while c < pieces {
            let mut acc = [0f32; 8];
            let mut j = 0;
            while j < a.top_k {
                let mut v = [[0u32; 4]; 4];
                let mut w = [0f32; 4];
                for i in 0..4 {
                    if j + i < a.top_k {
                        let s = unsafe { slots.add((pair0 + j + i) as usize).read() };
                        if s != u32::MAX {
                            w[i as usize] = unsafe { weights.add((pair0 + j + i) as usize).read() };
                            v[i as usize] =
                                unsafe { memory::ld_v4((a.yp + s as u64 * row_bytes + 16 * c as u64) as *const u8) };
                        }
                    }
                }
                for i in 0..4 {
                    for q in 0..4 {
                        let x = v[i][q];
                        acc[2 * q] += w[i] * f32::from_bits(x << 16);
                        acc[2 * q + 1] += w[i] * f32::from_bits(x & 0xffff_0000);
                    }
                }
                j += 4;
            }
            store_sums!(out, t as u64 * a.hidden as u64 + 8 * c as u64, acc, f32_out);
            c += ROW_THREADS;
        }
        t += ids::grid_dim();
    }
}

/// `mk_moe_to_bf16`: `out[i] = bf16(sums[i])` for `n` elements (a multiple of 8): the f32 sums
/// of the combine in the down projection's epilogue to a bf16 output (round to nearest even).
/// Thread `i` of the grid takes 8 elements at `8 i, 8 (i + threads), ...`.
///
/// # Safety
///
/// `sums` is a 16-byte aligned device address of `n` readable f32 and `out` of `n` writable bf16 (16-byte aligned),
/// neither written by others while this kernel runs; `n` is a multiple of 8.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_to_bf16(sums: *const f32, out: *mut u8, n: u64) {
    let stride = ids::grid_dim() as u64 * ROW_THREADS as u64;
    let mut i = ids::block_idx() as u64 * ROW_THREADS as u64 + ids::thread_idx() as u64;
    while 8 * i < n {
        let (lo, hi) = unsafe {
            (
                memory::ld_v4(sums.add(8 * i as usize) as *const u8),
                memory::ld_v4(sums.add(8 * i as usize + 4) as *const u8),
            )
        };
        let mut acc = [0f32; 8];
        for q in 0..4 {
            acc[q] = f32::from_bits(lo[q]);
            acc[q + 4] = f32::from_bits(hi[q]);
        }
        store_sums!(out, 8 * i, acc, 0u32);
        i += stride;
    }
}
