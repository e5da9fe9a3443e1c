//! Fast transcendental functions of the special function unit.
use core::arch::asm;

/// `2^x`, approximate (max relative error 2^-22), flushing subnormals: `ex2.approx.ftz.f32 d, x;`
/// `ex2(-inf) = +0`.
#[inline(always)]
pub fn ex2(x: f32) -> f32 {
    let r: f32;
    unsafe { asm!("ex2.approx.ftz.f32 {0}, {1};", out(reg32) r, in(reg32) x, options(pure, nomem, nostack)) };
    r
}

/// `log2(x)`, approximate (max absolute error 2^-22 near 1), flushing subnormals:
/// `lg2.approx.ftz.f32 d, x;`
#[inline(always)]
pub fn lg2(x: f32) -> f32 {
    let r: f32;
    unsafe { asm!("lg2.approx.ftz.f32 {0}, {1};", out(reg32) r, in(reg32) x, options(pure, nomem, nostack)) };
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
    x * rcp_approx(1.0 + ex2(-core::f32::consts::LOG2_E * x))
}
