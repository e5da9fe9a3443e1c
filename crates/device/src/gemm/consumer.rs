//! The consumer mainloop: a warpgroup multiplies its 64 rows of A by the whole B tile of each
//! slot with four m64n256k16 wgmmas (K = 64), keeping one commit group in flight: the slot of
//! K block `kb - 1` is released once the wgmmas of block `kb` are issued and those of `kb - 1`
//! have completed.
use super::ring::{Ring, RingPos};
use super::{BLayout, TILE};
use crate::arch::{ids, mbarrier, smem::SmemAddr, wgmma, wgmma::Swizzle};

/// Bytes of one 128B-swizzled row (64 bf16 of K for A and K-major B).
const ROW: u32 = 128;
/// Bytes between the 64-element N atoms of an MN-major B slot (a 64 x 64 box).
const B_KN_ATOM: u32 = 64 * 64 * 2;

/// Accumulates A[rows of warpgroup `wg`] x B over `k_blocks` K blocks into `acc` (overwriting it).
#[inline(always)]
pub unsafe fn mma_tile(
    ring: &Ring,
    pos: &mut RingPos,
    acc: &mut [f32; 128],
    wg: u32,
    b_layout: BLayout,
    k_blocks: u32,
) {
    unsafe {
        mma_tile_bounded(
            ring,
            pos,
            acc,
            wg,
            b_layout,
            k_blocks,
            mbarrier::trap_after(mbarrier::HUNG_NS),
        )
    };
}

/// As [`mma_tile`]; a stalled wait for a full slot calls `stall` (see
/// [`mbarrier::wait_parity_or`]), which bounds it: the plain GEMM traps, the fused kernels give
/// up with an error record (`comm::wait::local_stall`). A wait that gives up goes on to the
/// same wgmmas as one that passed (every warp of the warpgroup reaches each of them), on what
/// the slot holds, and still frees the slot.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn mma_tile_bounded(
    ring: &Ring,
    pos: &mut RingPos,
    acc: &mut [f32; 128],
    wg: u32,
    b_layout: BLayout,
    k_blocks: u32,
    stall: impl Fn(u64) -> bool + Copy,
) {
    unsafe { mma_tile_hooked::<false>(ring, pos, acc, wg, b_layout, k_blocks, stall, &mut NoHook) };
}

/// Work a warpgroup slips into its mainloop: [`KBlockHook::at`] runs after the wgmmas of each
/// K block are issued (the tensor cores busy), in every thread of the warpgroup.
pub trait KBlockHook {
    fn at(&mut self, kb: u32, k_blocks: u32);
}

/// No work in the mainloop.
pub struct NoHook;

impl KBlockHook for NoHook {
    #[inline(always)]
    fn at(&mut self, _: u32, _: u32) {}
}

/// As [`mma_tile_bounded`], calling `hook` once per K block. `EARLY_DESC` (B stored N x K; with
/// K x N it has no effect):
/// each slot's wgmma descriptors are worked out before the wait for its data, so only the
/// wgmma issue follows the data's arrival - for a kernel whose mainloop state lives in vector
/// registers (GEMM+ReduceScatter/AllReduce: it halves the instructions between the wait and
/// the first wgmma). The plain GEMM keeps its descriptors in uniform registers and does not
/// use it: there the opaque moves only add instructions.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn mma_tile_hooked<const EARLY_DESC: bool>(
    ring: &Ring,
    pos: &mut RingPos,
    acc: &mut [f32; 128],
    wg: u32,
    b_layout: BLayout,
    k_blocks: u32,
    stall: impl Fn(u64) -> bool + Copy,
    hook: &mut impl KBlockHook,
) {
    let mut prev = 0u32;
    for kb in 0..k_blocks {
        let s = pos.stage;
        // (Early descriptors are written for B stored N x K; any other layout takes the path
        // below.)
        if EARLY_DESC && matches!(b_layout, BLayout::Nk) {
            // The high words are constants (stride, swizzle): only the low words (start
            // address, leading offset) are computed, and the K steps add to them (the 14-bit
            // start address field never carries: the ring lies below 256 KiB). `before_wait`
            // keeps the compilers from moving the arithmetic past the wait.
            let a_lo = before_wait(wgmma::smem_desc(
                ring.a(s).add(wg * TILE.rows_per_consumer() * ROW),
                16,
                1024,
                Swizzle::B128,
            ) as u32);
            let b_lo = before_wait(wgmma::smem_desc(ring.b(s), 16, 1024, Swizzle::B128) as u32);
            let hi = wgmma::smem_desc(SmemAddr(0), 16, 1024, Swizzle::B128) & !0xffff_ffff;
            let _ = unsafe { mbarrier::wait_parity_or(ring.full(s), pos.phase, stall) };
            wgmma::fence();
            for ks in 0..4u32 {
                // K step of 16 bf16 = 32 bytes inside the swizzled row: start address += 32 >> 4.
                unsafe {
                    wgmma::mma_m64n256k16_bf16::<0>(
                        acc,
                        hi | (a_lo + 2 * ks) as u64,
                        hi | (b_lo + 2 * ks) as u64,
                        kb > 0 || ks > 0,
                    )
                };
            }
        } else {
            let _ = unsafe { mbarrier::wait_parity_or(ring.full(s), pos.phase, stall) };
            let a_desc = wgmma::smem_desc(
                ring.a(s).add(wg * TILE.rows_per_consumer() * ROW),
                16,
                1024,
                Swizzle::B128,
            );
            wgmma::fence();
            match b_layout {
                BLayout::Nk => {
                    let b_desc = wgmma::smem_desc(ring.b(s), 16, 1024, Swizzle::B128);
                    for ks in 0..4u64 {
                        // K step of 16 bf16 = 32 bytes inside the swizzled row: start address += 32 >> 4.
                        unsafe {
                            wgmma::mma_m64n256k16_bf16::<0>(acc, a_desc + 2 * ks, b_desc + 2 * ks, kb > 0 || ks > 0)
                        };
                    }
                }
                BLayout::Kn => {
                    let b_desc = wgmma::smem_desc(ring.b(s), B_KN_ATOM, 1024, Swizzle::B128);
                    for ks in 0..4u64 {
                        // K step of 16 rows of 128 bytes: start address += 2048 >> 4.
                        unsafe {
                            wgmma::mma_m64n256k16_bf16::<1>(acc, a_desc + 2 * ks, b_desc + 128 * ks, kb > 0 || ks > 0)
                        };
                    }
                }
            }
        }
        wgmma::commit_group();
        hook.at(kb, k_blocks);
        wgmma::wait_group::<1>();
        if kb > 0 {
            release(ring, prev);
        }
        prev = s;
        pos.advance(ring.stages());
    }
    wgmma::wait_group::<0>();
    if k_blocks > 0 {
        release(ring, prev);
    }
}

/// `x`, computed where this stands in program order: an opaque move (a volatile asm, ordered
/// with the wait's) that the compilers cannot sink past a later wait.
#[inline(always)]
fn before_wait(x: u32) -> u32 {
    crate::arch::regs::opaque_u32(x)
}

/// A consumer warpgroup that stopped computing (its launch gave up) still takes a tile's
/// `k_blocks` slots: waits until each is full and frees it, so the producer and the other
/// consumer warpgroup can run to the end (bounded like [`mma_tile_bounded`]).
#[inline(always)]
pub unsafe fn drain_tile(ring: &Ring, pos: &mut RingPos, k_blocks: u32, stall: impl Fn(u64) -> bool + Copy) {
    for _ in 0..k_blocks {
        let _ = unsafe { mbarrier::wait_parity_or(ring.full(pos.stage), pos.phase, stall) };
        release(ring, pos.stage);
        pos.advance(ring.stages());
    }
}

/// One arrival per warp on the slot's empty barrier.
#[inline(always)]
fn release(ring: &Ring, s: u32) {
    if ids::lane_id() == 0 {
        unsafe { mbarrier::arrive(ring.empty(s)) };
    }
}
