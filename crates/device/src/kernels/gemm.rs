//! `mk_gemm_bf16_nk` / `mk_gemm_bf16_kn`: persistent warp-specialized GEMM `C = A * B`.
//!
//! Launch: grid = number of CTAs to use (at most one per SM), block = `GemmTile::threads()`,
//! dynamic shared memory = `mkernel_config::ops::gemm::SMEM_BYTES` (`GemmSmem`). Parameters: a
//! [`GemmParams`] block passed by value and read in place ([`crate::arch::param`]), then C's
//! address. The block holds the tensor maps (encoded by crates/host for the launch's buffers
//! and M) of A: box 64 x 128, B: box 64 x 256 (N x K) or 64 x 64 (K x N), 128B swizzle, zero fill
//! out of bounds, and, when `args.tma_store` is set, of C (box 64 x 64, 128B swizzle), which
//! selects the TMA-store epilogue for bf16 C; otherwise C is written by direct stores to `c`.
use crate::arch::{ids, regs, smem, sync, tma, tma::TensorMap};
use crate::gemm::consumer::mma_tile;
use crate::gemm::epilogue::{drain_tma_stores, store_tile, store_tile_tma, Output};
use crate::gemm::producer::load_tile;
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::scheduler::TileScheduler;
use crate::gemm::trace as gemm_trace;
use crate::gemm::{BLayout, TILE};
use mkernel_config::gemm::RingLayout;
use mkernel_config::ops::gemm::GemmParams;
use mkernel_config::ops::{gemm as gemm_op, gemm_rs};
use mkernel_config::trace::{tile_kind, End, Mark};
use mkernel_config::GemmTile;

/// What [`gemm_on`] takes from a launch's [`GemmParams`] block: the generic addresses of its
/// tensor maps (`map_c` null unless C is stored by TMA) and its arguments.
#[derive(Clone, Copy)]
struct GemmArgs {
    map_a: *const u8,
    map_b: *const u8,
    map_c: *const u8,
    c: *mut u8,
    m: u32,
    n: u32,
    k: u32,
    ldc: u32,
    f32_out: u32,
}

impl GemmArgs {
    /// The tensor maps of the parameter block at generic address `p` (addressed in place), its
    /// arguments `a` (which the entry reads from its by-value parameter: `ld.param`) and C's
    /// address `c` (the entry's pointer parameter).
    ///
    /// # Safety
    ///
    /// `p` is the generic address of the launch's [`GemmParams`] block (`crate::param_block!`) and `a` its `args`.
    #[inline(always)]
    unsafe fn of_params(p: *const GemmParams, a: mkernel_config::ops::gemm::GemmArgs, c: *mut u8) -> GemmArgs {
        let map_c = if a.tma_store != 0 {
            unsafe { &raw const (*p).map_c as *const u8 }
        } else {
            core::ptr::null()
        };
        GemmArgs {
            map_a: unsafe { &raw const (*p).map_a as *const u8 },
            map_b: unsafe { &raw const (*p).map_b as *const u8 },
            map_c,
            c,
            m: a.m,
            n: a.n,
            k: a.k,
            ldc: a.ldc,
            f32_out: a.f32_out,
        }
    }
}

/// The kernel body on the ring `ring_layout` (same block shape as [`TILE`]); `PR`/`CR` are its
/// producer/consumer register counts.
///
/// # Safety
///
/// As [`mk_gemm_bf16_nk`] (or [`mk_gemm_bf16_kn`] for `b_layout`), with `ring_layout` the ring the launch's dynamic
/// shared memory was sized for and `PR`/`CR` register counts that fit `GemmTile::threads()` threads at one CTA per SM;
/// `trace` is 0 or a trace buffer for the grid.
#[inline(always)]
unsafe fn gemm_on<const PR: u32, const CR: u32>(
    ring_layout: RingLayout,
    args: GemmArgs,
    b_layout: BLayout,
    trace: u64,
) {
    let GemmArgs {
        map_a,
        map_b,
        map_c,
        c,
        m,
        n,
        k,
        ldc,
        f32_out,
    } = args;
    let ring = Ring::new(smem::dynamic_smem_addr(), ring_layout);
    let (a, b) = (TensorMap(map_a), TensorMap(map_b));
    if ids::thread_idx() == 0 {
        unsafe {
            tma::prefetch(a);
            tma::prefetch(b);
            ring.init();
        }
    }
    sync::sync_threads();

    let k_blocks = k.div_ceil(TILE.block_k);
    let tiles = TileScheduler::new(
        m,
        n,
        TILE.block_m,
        TILE.block_n,
        TILE.group_m,
        ids::block_idx(),
        ids::grid_dim(),
    );
    let wg = ids::warpgroup_idx();
    let mut pos = RingPos::START;
    if wg == 0 {
        regs::setmaxnreg_dec::<PR>();
        if ids::thread_idx() == 0 {
            for tile in tiles {
                let _ = unsafe {
                    load_tile(
                        &ring,
                        &mut pos,
                        a,
                        tile.m0,
                        b,
                        b_layout,
                        tile,
                        k_blocks,
                        crate::arch::mbarrier::trap_after(crate::arch::mbarrier::HUNG_NS),
                    )
                };
            }
        }
    } else {
        regs::setmaxnreg_inc::<CR>();
        let out = Output {
            c,
            m,
            n,
            ldc,
            f32_out: f32_out != 0,
        };
        let mut acc = [0f32; 128];
        let tma_out = !map_c.is_null();
        // The optional timeline (the fused-ring diagnostic; thread 0 of the first consumer
        // warpgroup), in the fused kernels' layout: Begin = Mainloop, MainloopDone, Stored.
        let first = ids::thread_idx() == crate::arch::ids::WARPGROUP_THREADS;
        let (cta, mut i) = (ids::block_idx(), 0u32);
        let mark = |i: u32, m: Mark| {
            if first {
                unsafe { gemm_trace::mark(trace, cta, i, m) }
            }
        };
        for tile in tiles {
            unsafe {
                mark(i, Mark::Begin);
                mark(i, Mark::Mainloop);
                mma_tile(&ring, &mut pos, &mut acc, wg - 1, b_layout, k_blocks);
                mark(i, Mark::MainloopDone);
                if first {
                    gemm_trace::tile(
                        trace,
                        cta,
                        i,
                        tile.m0 / TILE.block_m,
                        tile.n0 / TILE.block_n,
                        tile_kind::OWN,
                    );
                }
                if tma_out {
                    store_tile_tma(&ring, TensorMap(map_c), tile, wg - 1, &mut acc);
                } else {
                    store_tile(&out, tile, wg - 1, &acc);
                }
                mark(i, Mark::Stored);
            }
            i += 1;
        }
        if tma_out {
            drain_tma_stores();
        }
        if first {
            unsafe { gemm_trace::end(trace, cta, End::LoopDone) };
            unsafe { gemm_trace::end(trace, cta, End::Done) };
        }
    }
}

/// B stored N x K (K contiguous).
///
/// # Safety
///
/// The launch contract (`crate::kernels`) with the launch of this module's doc; in `params`, `map_a`/`map_b` encode
/// the bf16 A (`m x k`) and B (`n x k`) tensors; with `tma_store` set, `map_c` encodes a bf16 C (`m x n`) with a
/// 64 x 64 box; otherwise `c` is the address of `m x n` writable elements (f32 if `f32_out != 0`, else bf16) with row
/// stride `ldc >= n`, aligned to twice the element size.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_gemm_bf16_nk(params: GemmParams, c: *mut u8) {
    let p = crate::param_block!("mk_gemm_bf16_nk") as *const GemmParams;
    unsafe {
        gemm_on::<{ TILE.producer_regs }, { TILE.consumer_regs }>(
            gemm_op::RING,
            GemmArgs::of_params(p, params.args, c),
            BLayout::Nk,
            0,
        )
    }
}

/// B stored K x N (N contiguous).
///
/// # Safety
///
/// As [`mk_gemm_bf16_nk`], with `map_b` encoding B stored `k x n` with a 64 x 64 box.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_gemm_bf16_kn(params: GemmParams, c: *mut u8) {
    let p = crate::param_block!("mk_gemm_bf16_kn") as *const GemmParams;
    unsafe {
        gemm_on::<{ TILE.producer_regs }, { TILE.consumer_regs }>(
            gemm_op::RING,
            GemmArgs::of_params(p, params.args, c),
            BLayout::Kn,
            0,
        )
    }
}

/// Diagnostic: [`mk_gemm_bf16_nk`] on GEMM+ReduceScatter's ring (`ops::gemm_rs::TILE`: 3 stages,
/// whole-tile staging, the fused register split), to measure what that ring costs the mainloop
/// with no communication (`mkernel-bench --op gemm`); with `args.trace` (0: none) it records the
/// fused kernels' per-tile timeline ([`mkernel_config::trace`]) for comparison.
///
/// # Safety
///
/// As [`mk_gemm_bf16_nk`], launched with the dynamic shared memory of
/// `mkernel_config::ops::gemm::GEMM_BF16_NK_FUSED_RING`; `args.trace` is 0 or the address of a trace buffer
/// (`mkernel_config::trace`) for the launch's grid.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_gemm_bf16_nk_fused_ring(params: GemmParams, c: *mut u8) {
    const R: GemmTile = gemm_rs::TILE;
    let p = crate::param_block!("mk_gemm_bf16_nk_fused_ring") as *const GemmParams;
    unsafe {
        gemm_on::<{ R.producer_regs }, { R.consumer_regs }>(
            gemm_rs::RING,
            GemmArgs::of_params(p, params.args, c),
            BLayout::Nk,
            params.args.trace,
        )
    }
}
