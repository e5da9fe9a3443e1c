//! Warp shuffles (full mask).
use core::arch::asm;

/// `shfl.sync.idx.b32 d, v, src_lane, 0x1f, 0xffffffff;`
#[inline(always)]
pub fn shfl_idx(v: u32, src_lane: u32) -> u32 {
    let r: u32;
    unsafe {
        asm!("shfl.sync.idx.b32 {0}, {1}, {2}, 0x1f, 0xffffffff;", out(reg32) r, in(reg32) v, in(reg32) src_lane, options(nostack, nomem))
    };
    r
}
/// `shfl.sync.bfly.b32 d, v, lane_mask, 0x1f, 0xffffffff;`
#[inline(always)]
pub fn shfl_xor(v: u32, lane_mask: u32) -> u32 {
    let r: u32;
    unsafe {
        asm!("shfl.sync.bfly.b32 {0}, {1}, {2}, 0x1f, 0xffffffff;", out(reg32) r, in(reg32) v, in(reg32) lane_mask, options(nostack, nomem))
    };
    r
}
/// `shfl.sync.down.b32 d, v, delta, 0x1f, 0xffffffff;`
#[inline(always)]
pub fn shfl_down(v: u32, delta: u32) -> u32 {
    let r: u32;
    unsafe {
        asm!("shfl.sync.down.b32 {0}, {1}, {2}, 0x1f, 0xffffffff;", out(reg32) r, in(reg32) v, in(reg32) delta, options(nostack, nomem))
    };
    r
}
/// `shfl.sync.up.b32 d, v, delta, 0, 0xffffffff;` (lanes below `delta` keep their own `v`)
#[inline(always)]
pub fn shfl_up(v: u32, delta: u32) -> u32 {
    let r: u32;
    unsafe {
        asm!("shfl.sync.up.b32 {0}, {1}, {2}, 0, 0xffffffff;", out(reg32) r, in(reg32) v, in(reg32) delta, options(nostack, nomem))
    };
    r
}
/// Inclusive prefix sum of `v` over the warp's lanes (5 steps).
#[inline(always)]
pub fn warp_inclusive_sum_u32(v: u32) -> u32 {
    let lane = super::ids::lane_id();
    let mut x = v;
    let mut d = 1;
    while d < 32 {
        let y = shfl_up(x, d);
        if lane >= d {
            x += y;
        }
        d *= 2;
    }
    x
}
/// Sum of `v` over the warp (butterfly, 5 steps), in every lane.
#[inline(always)]
pub fn warp_sum_f32(v: f32) -> f32 {
    let mut x = v;
    let mut m = 16;
    while m > 0 {
        x += f32::from_bits(shfl_xor(x.to_bits(), m));
        m /= 2;
    }
    x
}
/// Bit `i` set where lane `i`'s `pred` is true: `vote.sync.ballot.b32 d, pred, 0xffffffff;`
#[inline(always)]
pub fn ballot(pred: bool) -> u32 {
    let r: u32;
    unsafe {
        asm!("{{ .reg .pred p; setp.ne.u32 p, {1}, 0; vote.sync.ballot.b32 {0}, p, 0xffffffff; }}", out(reg32) r, in(reg32) pred as u32, options(nostack, nomem))
    };
    r
}
