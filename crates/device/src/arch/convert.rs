//! Number conversions.
use core::arch::asm;

/// Two f32 to packed bf16x2, round to nearest even; `lo` in bits 0..16:
/// `cvt.rn.bf16x2.f32 d, hi, lo;`
#[inline(always)]
pub fn pack_bf16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {0}, {1}, {2};", out(reg32) r, in(reg32) hi, in(reg32) lo, options(pure, nomem, nostack))
    };
    r
}
/// bf16 bits to f32 (exact): the bits go to the upper half.
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}
