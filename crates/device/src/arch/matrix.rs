//! Warp-wide 8x8 matrix loads and stores between shared memory and registers.
use super::smem::SmemAddr;
use core::arch::asm;

/// Four 8x8 b16 matrices from shared memory; lane `8i + r` gives the address of row `r` of
/// matrix `i`: `ldmatrix.sync.aligned.m8n8.x4.shared.b16 {d0, d1, d2, d3}, [addr];`
///
/// # Safety
///
/// Executed by all 32 lanes of the warp with the same control flow (`.sync.aligned`); each lane's `addr` is a 16-byte
/// aligned shared-memory address of this CTA with 16 readable bytes (one 8-element b16 row), written before this load
/// by this thread or ordered by a barrier.
#[inline(always)]
pub unsafe fn ldmatrix_x4(addr: SmemAddr) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg32) addr.0, options(nostack, readonly))
    };
    [a, b, c, d]
}
/// As [`ldmatrix_x4`], transposing each matrix: `ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`.
///
/// # Safety
///
/// As [`ldmatrix_x4`]: all 32 lanes of the warp execute it together and each lane's `addr` is a 16-byte aligned
/// shared-memory address of 16 readable bytes of this CTA.
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(addr: SmemAddr) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg32) addr.0, options(nostack, readonly))
    };
    [a, b, c, d]
}
/// Four 8x8 b16 matrices to shared memory (addresses as for [`ldmatrix_x4`]):
/// `stmatrix.sync.aligned.m8n8.x4.shared.b16 [addr], {s0, s1, s2, s3};`
///
/// # Safety
///
/// Executed by all 32 lanes of the warp together; each lane's `addr` is a 16-byte aligned shared-memory address of this
/// CTA with 16 writable bytes that no other thread or async-proxy operation (TMA, wgmma) accesses until a barrier
/// orders this store before it.
#[inline(always)]
pub unsafe fn stmatrix_x4(addr: SmemAddr, v: [u32; 4]) {
    unsafe {
        asm!("stmatrix.sync.aligned.m8n8.x4.shared.b16 [{0}], {{{1}, {2}, {3}, {4}}};", in(reg32) addr.0, in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3], options(nostack))
    };
}
