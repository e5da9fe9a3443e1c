//! `mk_moe_gather`: every token row to the rows of its experts' groups. CTA `b` of a grid of
//! `g` takes tokens `b, b + g, ...`; each thread moves 16-byte pieces of the row (up to four
//! loads in flight), read once and written `top_k` times (pairs without a slot are skipped).
use crate::arch::{ids, memory};
use mkernel_config::ops::moe::{MoeGatherArgs, ROW_THREADS};

/// # Safety
///
/// The argument-block contract (`crate::kernels::moe`), with `slots` written by `mk_moe_route` for these tokens before
/// this launch; `x` is a 16-byte aligned device address of `tokens x hidden` bf16 elements (`hidden` a multiple of 8).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_gather(args: *const MoeGatherArgs, x: *const u8) {
    let a = unsafe { args.read() };
    let pieces = a.hidden / 8;
    let row_bytes = a.hidden as u64 * 2;
    let slots = a.slots as *const u32;
    let mut t = ids::block_idx();
    while t < a.tokens {
        let src = x as u64 + t as u64 * row_bytes;
        let mut c = ids::thread_idx();
        while c < pieces {
            // Up to UNROLL pieces of the row loaded before any is stored (the stores' memory
            // clobber would otherwise keep the next load behind them: one load in flight).
            let mut v = [[0u32; 4]; UNROLL as usize];
            for (u, vu) in v.iter_mut().enumerate() {
                let cu = c + u as u32 * ROW_THREADS;
                if cu < pieces {
                    *vu = unsafe { memory::ld_v4((src + 16 * cu as u64) as *const u8) };
                }
            }
            for j in 0..a.top_k {
                let s = unsafe { slots.add((t * a.top_k + j) as usize).read() };
                if s != u32::MAX {
                    let dst = a.xp + s as u64 * row_bytes;
                    for (u, vu) in v.iter().enumerate() {
                        let cu = c + u as u32 * ROW_THREADS;
                        if cu < pieces {
                            unsafe { memory::st_v4((dst + 16 * cu as u64) as *mut u8, *vu) };
                        }
                    }
                }
            }
            c += UNROLL * ROW_THREADS;
        }
        t += ids::grid_dim();
    }
}

/// 16-byte pieces of a row each thread has in flight at once.
const UNROLL: u32 = 4;
