//! Fast transcendental functions (the special function unit's approximations).
use core::arch::asm;

/// `2^x`, about 2 ulp: `ex2.approx.ftz.f32 d, x;`
#[inline(always)]
pub fn ex2_approx(x: f32) -> f32 {
    let r: f32;
    unsafe { asm!("ex2.approx.ftz.f32 {0}, {1};", out(reg32) r, in(reg32) x, options(pure, nomem, nostack)) };
    r
}

/// `1 / x`, about 1 ulp: `rcp.approx.ftz.f32 d, x;`
#[inline(always)]
pub fn rcp_approx(x: f32) -> f32 {
    let r: f32;
    unsafe { asm!("rcp.approx.ftz.f32 {0}, {1};", out(reg32) r, in(reg32) x, options(pure, nomem, nostack)) };
    r
}

/// `x * sigmoid(x) = x / (1 + e^-x)` (relative error a few 2^-22; `-inf` -> -0, large x -> x).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x * rcp_approx(1.0 + ex2_approx(-core::f32::consts::LOG2_E * x))
}
