//! Epilogue: a consumer warpgroup's 64 x 256 f32 accumulators to C in global memory.
//!
//! Thread layout of the accumulators: see [`crate::arch::wgmma`]. Interior tiles store without
//! checks; tiles on the M/N edge check every element pair.
use super::scheduler::Tile;
use super::TILE;
use crate::arch::{convert::pack_bf16x2, ids};

/// Where and how C is stored.
#[derive(Clone, Copy)]
pub struct Output {
    pub c: *mut u8,
    pub m: u32,
    pub n: u32,
    /// Row stride of C in elements.
    pub ldc: u32,
    /// f32 output instead of bf16.
    pub f32_out: bool,
}

macro_rules! unroll_32 {
    ($j:ident => $body:block) => {
        unroll_32!(@ $j $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
    };
    (@ $j:ident $body:block; $($n:literal)*) => {
        $( { #[allow(non_upper_case_globals)] const $j: usize = $n; $body } )*
    };
}

/// Stores warpgroup `wg`'s rows of `tile`.
#[inline(always)]
pub unsafe fn store_tile(out: &Output, tile: Tile, wg: u32, acc: &[f32; 128]) {
    let t = ids::thread_in_warpgroup();
    let row0 = tile.m0 + wg * TILE.rows_per_consumer() + (t / 32) * 16 + (t % 32) / 4;
    let col0 = tile.n0 + 2 * (t % 4);
    let interior = tile.m0 + TILE.block_m <= out.m && tile.n0 + TILE.block_n <= out.n && out.ldc % 2 == 0;
    if interior {
        unroll_32!(j => {
            let col = col0 + 8 * j as u32;
            unsafe {
                store_pair::<false>(out, row0, col, acc[4 * j], acc[4 * j + 1]);
                store_pair::<false>(out, row0 + 8, col, acc[4 * j + 2], acc[4 * j + 3]);
            }
        });
    } else {
        unroll_32!(j => {
            let col = col0 + 8 * j as u32;
            unsafe {
                store_pair::<true>(out, row0, col, acc[4 * j], acc[4 * j + 1]);
                store_pair::<true>(out, row0 + 8, col, acc[4 * j + 2], acc[4 * j + 3]);
            }
        });
    }
}

/// Stores C[row][col] = x and C[row][col + 1] = y.
#[inline(always)]
unsafe fn store_pair<const CHECKED: bool>(out: &Output, row: u32, col: u32, x: f32, y: f32) {
    if CHECKED && (row >= out.m || col >= out.n) {
        return;
    }
    let idx = row as usize * out.ldc as usize + col as usize;
    let pair_ok = !CHECKED || (col + 1 < out.n && out.ldc % 2 == 0);
    unsafe {
        if out.f32_out {
            let p = (out.c as *mut f32).add(idx);
            if pair_ok {
                (p as *mut [f32; 2]).write([x, y]);
            } else {
                p.write(x);
                if col + 1 < out.n {
                    p.add(1).write(y);
                }
            }
        } else {
            let p = (out.c as *mut u16).add(idx);
            let v = pack_bf16x2(x, y);
            if pair_ok {
                (p as *mut u32).write(v);
            } else {
                p.write(v as u16);
                if col + 1 < out.n {
                    p.add(1).write((v >> 16) as u16);
                }
            }
        }
    }
}
