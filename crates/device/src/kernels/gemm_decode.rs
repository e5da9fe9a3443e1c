//! `mk_gemm_decode_{nk,kn}_t{8..256}`: the decode-size GEMM `C = A * B` (M <= 256), computed as
//! `C^T = B^T A^T` with stream-K over every SM (`mkernel_config::ops::gemm_decode` has the split and
//! the shared-memory layout; docs/gemm.md the measurements).
//!
//! Launch: grid = `DecodeSplit::grid` CTAs, block = 384 threads (warpgroup 0: one TMA producer
//! thread; warpgroups 1 and 2: consumers, 64 weight rows each), dynamic shared memory of the bucket's
//! `DecodeLayout`. Parameters: a `DecodeParams` block passed by value and read in place
//! ([`crate::arch::param`]), then C's address. In the block, `map_w` encodes B (N x K: box 64 (K) x 128 rows; K x N: box 64 (N) x
//! 64 (K)), `map_x` encodes A (M x K, box 64 (K) x TOK rows), both 128-byte swizzled with zero fill,
//! so rows past M or N and K past its end contribute zeros; then the arguments (`DecodeArgs`).
use crate::arch::{convert::pack_bf16x2, ids, mbarrier, memory, memory::Scope, regs, smem, smem::SmemAddr, sync, tma};
use crate::arch::{param::opaque_u32, tma::TensorMap, wgmma, wgmma::MmaTile, wgmma::Swizzle};
use crate::gemm::ring::RingPos;
use mkernel_config::ops::gemm_decode::{self as cfg, DecodeLayout, DecodeParams, DecodeSplit};

/// Runs `$body` with `$j` bound to each constant `0..32` below `$end` (a constant expression):
/// accumulators indexed by constants stay in registers.
macro_rules! unroll_below {
    ($end:expr, $j:ident => $body:block) => {
        unroll_below!(@ $end, $j $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
    };
    (@ $end:expr, $j:ident $body:block; $($n:literal)*) => {
        $( if $n < $end { #[allow(non_upper_case_globals)] const $j: usize = $n; $body } )*
    };
}

/// The ring of one bucket: `stages` slots of (weights, tokens) and their mbarriers.
#[derive(Clone, Copy)]
struct DecodeRing {
    base: SmemAddr,
    l: DecodeLayout,
}

impl DecodeRing {
    #[inline(always)]
    fn w(&self, s: u32) -> SmemAddr {
        self.base.add(s * cfg::W_STAGE_BYTES)
    }
    #[inline(always)]
    fn x(&self, s: u32) -> SmemAddr {
        self.base.add(self.l.x + s * cfg::x_stage_bytes(self.l.tok))
    }
    #[inline(always)]
    fn full(&self, s: u32) -> SmemAddr {
        self.base.add(self.l.full + 8 * s)
    }
    #[inline(always)]
    fn empty(&self, s: u32) -> SmemAddr {
        self.base.add(self.l.empty + 8 * s)
    }
    #[inline(always)]
    fn last(&self) -> SmemAddr {
        self.base.add(self.l.last)
    }
    /// # Safety
    ///
    /// One thread, before any other use of the ring and before a CTA barrier; the layout lies inside the launch's
    /// dynamic shared memory.
    #[inline(always)]
    unsafe fn init(&self) {
        for s in 0..self.l.stages {
            unsafe {
                mbarrier::init(self.full(s), 1);
                mbarrier::init(self.empty(s), cfg::CONSUMER_THREADS / 32);
            }
        }
        mbarrier::fence_init();
    }
}

/// What [`decode_on`] takes from a launch's `DecodeParams` block: the generic addresses of its
/// tensor maps and its arguments.
#[derive(Clone, Copy)]
struct DecodeArgs {
    map_w: *const u8,
    map_x: *const u8,
    c: *mut u8,
    ws: *mut u8,
    counters: *mut u32,
    m: u32,
    n: u32,
    k: u32,
    ldc: u32,
    f32_out: u32,
}

impl DecodeArgs {
    /// The tensor maps of the parameter block at generic address `p` (addressed in place), its
    /// arguments `a`, which the entry reads from its by-value parameter (`ld.param`; loaded
    /// through `p` they made the 256-token bucket spill), each 32-bit one through
    /// [`opaque_u32`] (see there why), and C's address `c` (the entry's pointer parameter).
    ///
    /// # Safety
    ///
    /// `p` is the generic address of the launch's `DecodeParams` block (`crate::param_block!`) and `a` its `args`.
    #[inline(always)]
    unsafe fn of_params(p: *const DecodeParams, a: cfg::DecodeArgs, c: *mut u8) -> DecodeArgs {
        DecodeArgs {
            map_w: unsafe { &raw const (*p).map_w as *const u8 },
            map_x: unsafe { &raw const (*p).map_x as *const u8 },
            c,
            ws: a.ws as *mut u8,
            counters: a.counters as *mut u32,
            m: opaque_u32(a.m),
            n: opaque_u32(a.n),
            k: opaque_u32(a.k),
            ldc: opaque_u32(a.ldc),
            f32_out: opaque_u32(a.f32_out),
        }
    }
}

/// The kernel body for bucket `A` (`[f32; TOK / 2]` accumulators per consumer thread), B stored
/// K x N when `KN`.
///
/// # Safety
///
/// As [`mk_gemm_decode_nk_t8`], with `l` the layout of `A`'s bucket.
#[inline(always)]
unsafe fn decode_on<A: MmaTile + AsRef<[f32]> + AsMut<[f32]>, const KN: bool>(l: DecodeLayout, args: DecodeArgs) {
    let ring = DecodeRing {
        base: smem::dynamic_smem_addr(),
        l,
    };
    let (w, x) = (TensorMap(args.map_w), TensorMap(args.map_x));
    if ids::thread_idx() == 0 {
        unsafe {
            tma::prefetch(w);
            tma::prefetch(x);
            ring.init();
        }
    }
    sync::sync_threads();
    let split = DecodeSplit {
        tiles: args.n.div_ceil(cfg::W_ROWS),
        k_blocks: args.k.div_ceil(cfg::BLOCK_K),
        grid: ids::grid_dim(),
    };
    let cta = ids::block_idx();
    let (u0, u1) = (split.start(cta), split.start(cta + 1));
    if ids::warpgroup_idx() == 0 {
        regs::setmaxnreg_dec::<{ cfg::PRODUCER_REGS }>();
        if ids::thread_idx() == 0 {
            unsafe { produce::<KN>(&ring, w, x, split, u0, u1) };
        }
    } else {
        regs::setmaxnreg_inc::<{ cfg::CONSUMER_REGS }>();
        unsafe { consume::<A, KN>(&ring, &args, split, cta, u0, u1) };
    }
}

/// The producer thread: units `u0..u1`, each one weight stage (evict-first: read once) and the
/// tokens' K block.
///
/// # Safety
///
/// One thread; the consumers take the same units in the same order.
#[inline(always)]
unsafe fn produce<const KN: bool>(ring: &DecodeRing, w: TensorMap, x: TensorMap, split: DecodeSplit, u0: u32, u1: u32) {
    let policy = tma::evict_first_policy();
    let tx = cfg::W_STAGE_BYTES + cfg::x_stage_bytes(ring.l.tok);
    let mut pos = RingPos::START;
    let mut t = u0 / split.k_blocks;
    let mut kb = u0 - t * split.k_blocks;
    for _ in u0..u1 {
        let s = pos.stage;
        let (n0, k0) = (t * cfg::W_ROWS, kb * cfg::BLOCK_K);
        unsafe {
            mbarrier::wait_parity(ring.empty(s), pos.phase ^ 1);
            mbarrier::arrive_expect_tx(ring.full(s), tx);
            if KN {
                tma::load_2d_hinted(ring.w(s), w, n0, k0, ring.full(s), policy);
                let half = ring.w(s).add(cfg::W_KN_BOX_BYTES);
                tma::load_2d_hinted(half, w, n0 + 64, k0, ring.full(s), policy);
            } else {
                tma::load_2d_hinted(ring.w(s), w, k0, n0, ring.full(s), policy);
            }
            tma::load_2d(ring.x(s), x, k0, 0, ring.full(s));
        }
        pos.advance(ring.l.stages);
        kb += 1;
        if kb == split.k_blocks {
            kb = 0;
            t += 1;
        }
    }
}

/// The consumer warpgroups: each piece of the range (one tile's K blocks) is multiplied into the
/// accumulators, then stored (a whole tile) or handed to the tile's reduction.
///
/// # Safety
///
/// All 256 consumer threads together, with the producer loading units `u0..u1`.
#[inline(always)]
unsafe fn consume<A: MmaTile + AsRef<[f32]> + AsMut<[f32]>, const KN: bool>(
    ring: &DecodeRing,
    args: &DecodeArgs,
    split: DecodeSplit,
    cta: u32,
    u0: u32,
    u1: u32,
) {
    let wg = ids::warpgroup_idx() - 1;
    let ct = ids::thread_idx() - crate::arch::ids::WARPGROUP_THREADS;
    let slot_bytes = cfg::slot_bytes(A::N) as usize;
    let mut pos = RingPos::START;
    let mut acc = A::ZERO;
    let mut u = u0;
    while u < u1 {
        let t = u / split.k_blocks;
        let end = if u1 < (t + 1) * split.k_blocks {
            u1
        } else {
            (t + 1) * split.k_blocks
        };
        unsafe { mainloop::<A, KN>(ring, &mut pos, &mut acc, wg, end - u) };
        u = end;
        let (lo, hi) = split.contributors(t);
        if lo == hi {
            unsafe { store_out(args, &acc, t, wg) };
            continue;
        }
        let slot = |c: u32| unsafe { args.ws.add((2 * c + split.slot(c, t)) as usize * slot_bytes) };
        unsafe { store_partial(&acc, slot(cta), ct) };
        sync::named_barrier_sync(cfg::EPILOGUE_BARRIER, cfg::CONSUMER_THREADS);
        if ct == 0 {
            // The barrier ordered every consumer's partial stores before this thread's release.
            memory::fence_acq_rel(Scope::Gpu);
            let counter = unsafe { args.counters.add(t as usize) };
            let before = unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, counter, 1) };
            let last = before == hi - lo;
            if last {
                // Every contributor has counted: the next launch starts from 0.
                unsafe { memory::st_relaxed_u32(Scope::Gpu, counter, 0) };
            }
            unsafe { smem::st_volatile_shared_u32(ring.last(), last as u32) };
        }
        sync::named_barrier_sync(cfg::EPILOGUE_BARRIER, cfg::CONSUMER_THREADS);
        if unsafe { smem::ld_volatile_shared_u32(ring.last()) } != 0 {
            unsafe {
                load_partial(&mut acc, slot(lo), ct);
                for c in lo + 1..=hi {
                    add_partial(&mut acc, slot(c), ct);
                }
                store_out(args, &acc, t, wg);
            }
        }
    }
}

/// `k_blocks` stages into `acc` (overwritten): per stage four k16 wgmmas of warpgroup `wg`'s 64
/// weight rows by the tokens, one commit group in flight; a stage is released once the wgmmas of
/// the next one are issued and its own have completed.
///
/// # Safety
///
/// All 128 threads of consumer warpgroup `wg`, with `pos` its ring position and the producer filling these stages.
#[inline(always)]
unsafe fn mainloop<A: MmaTile, const KN: bool>(
    ring: &DecodeRing,
    pos: &mut RingPos,
    acc: &mut A,
    wg: u32,
    k_blocks: u32,
) {
    let mut prev = 0u32;
    for i in 0..k_blocks {
        let s = pos.stage;
        unsafe { mbarrier::wait_parity(ring.full(s), pos.phase) };
        // Weights: K-major 128-byte rows (N x K), or one 64 (N) x 64 (K) MN-major box (K x N,
        // transposed A; the k16 step is 16 rows of 128 bytes). Tokens: K-major rows.
        let a_desc = if KN {
            wgmma::smem_desc(
                ring.w(s).add(wg * cfg::W_KN_BOX_BYTES),
                cfg::W_KN_BOX_BYTES,
                1024,
                Swizzle::B128,
            )
        } else {
            wgmma::smem_desc(ring.w(s).add(wg * 64 * 128), 16, 1024, Swizzle::B128)
        };
        let b_desc = wgmma::smem_desc(ring.x(s), 16, 1024, Swizzle::B128);
        wgmma::fence();
        for ks in 0..4u64 {
            let a = if KN { a_desc + 128 * ks } else { a_desc + 2 * ks };
            unsafe {
                if KN {
                    acc.mma::<1, 0>(a, b_desc + 2 * ks, i > 0 || ks > 0)
                } else {
                    acc.mma::<0, 0>(a, b_desc + 2 * ks, i > 0 || ks > 0)
                }
            };
        }
        wgmma::commit_group();
        wgmma::wait_group::<1>();
        if i > 0 {
            release(ring, prev);
        }
        prev = s;
        pos.advance(ring.l.stages);
    }
    wgmma::wait_group::<0>();
    if k_blocks > 0 {
        release(ring, prev);
    }
}

/// One arrival per consumer warp on the slot's empty barrier.
#[inline(always)]
fn release(ring: &DecodeRing, s: u32) {
    if ids::lane_id() == 0 {
        unsafe { mbarrier::arrive(ring.empty(s)) };
    }
}

/// Writes the accumulators as they are, f32: piece `j` (four values) of consumer thread `ct` at
/// `(j x 256 + ct) x 16`, so each store instruction of a warp is 512 contiguous bytes.
///
/// # Safety
///
/// `slot` is 16-byte aligned with `slot_bytes(TOK)` writable bytes nobody else accesses until a release publishes them.
#[inline(always)]
unsafe fn store_partial<A: MmaTile + AsRef<[f32]>>(acc: &A, slot: *mut u8, ct: u32) {
    let v = acc.as_ref();
    let at = slot as u64 + ct as u64 * 16;
    unroll_below!(A::LEN / 4, j => {
        let p = [v[4 * j].to_bits(), v[4 * j + 1].to_bits(), v[4 * j + 2].to_bits(), v[4 * j + 3].to_bits()];
        unsafe { memory::st_v4((at + (j * cfg::CONSUMER_THREADS as usize * 16) as u64) as *mut u8, p) };
    });
}

/// Replaces the accumulators by what [`store_partial`] wrote at `slot` (through L2).
///
/// # Safety
///
/// `slot` holds a partial published to this thread (acquired by the consumers' counter thread, then a barrier).
#[inline(always)]
unsafe fn load_partial<A: MmaTile + AsMut<[f32]>>(acc: &mut A, slot: *const u8, ct: u32) {
    let v = acc.as_mut();
    let at = slot as u64 + ct as u64 * 16;
    unroll_below!(A::LEN / 4, j => {
        let p = unsafe { memory::ld_cg_v4((at + (j * cfg::CONSUMER_THREADS as usize * 16) as u64) as *const u8) };
        for e in 0..4 {
            v[4 * j + e] = f32::from_bits(p[e]);
        }
    });
}

/// Adds what [`store_partial`] wrote at `slot` to the accumulators (through L2).
///
/// # Safety
///
/// As [`load_partial`].
#[inline(always)]
unsafe fn add_partial<A: MmaTile + AsMut<[f32]>>(acc: &mut A, slot: *const u8, ct: u32) {
    let v = acc.as_mut();
    let at = slot as u64 + ct as u64 * 16;
    unroll_below!(A::LEN / 4, j => {
        let p = unsafe { memory::ld_cg_v4((at + (j * cfg::CONSUMER_THREADS as usize * 16) as u64) as *const u8) };
        for e in 0..4 {
            v[4 * j + e] += f32::from_bits(p[e]);
        }
    });
}

/// Stores warpgroup `wg`'s accumulators of tile `t` to C (row = token, column = weight row),
/// bf16 or f32, each element checked against M and N. Accumulator `4j + e` of a thread (warp `w`,
/// lane `l`) is weight row `16w + l/4 (+8 for e >= 2)` and token `8j + 2(l%4) + e%2`.
///
/// # Safety
///
/// `args.c` holds `m x ldc` writable elements of the output type.
#[inline(always)]
unsafe fn store_out<A: MmaTile + AsRef<[f32]>>(args: &DecodeArgs, acc: &A, t: u32, wg: u32) {
    let v = acc.as_ref();
    let tw = ids::thread_in_warpgroup();
    let row = t * cfg::W_ROWS + wg * 64 + (tw / 32) * 16 + (tw % 32) / 4;
    let tok0 = 2 * (tw % 4);
    let put = |tok: u32, row: u32, x: f32| {
        if tok < args.m && row < args.n {
            let idx = tok as usize * args.ldc as usize + row as usize;
            unsafe {
                if args.f32_out != 0 {
                    (args.c as *mut f32).add(idx).write(x);
                } else {
                    (args.c as *mut u16).add(idx).write(pack_bf16x2(x, 0.0) as u16);
                }
            }
        }
    };
    unroll_below!(A::LEN / 4, j => {
        let tok = tok0 + 8 * j as u32;
        put(tok, row, v[4 * j]);
        put(tok + 1, row, v[4 * j + 1]);
        put(tok, row + 8, v[4 * j + 2]);
        put(tok + 1, row + 8, v[4 * j + 3]);
    });
}

/// Declares one entry per (bucket, layout).
macro_rules! decode_kernels {
    ($($name:ident $tok:literal $len:literal $kn:literal),* $(,)?) => {$(
        /// Decode GEMM entry (see the module doc): bucket of `
        #[doc = stringify!($tok)]
        /// ` tokens.
        ///
        /// # Safety
        ///
        /// The launch contract (`crate::kernels`) with the launch and parameter block of the module doc; `c` holds
        /// `m x ldc` writable elements (f32 if `f32_out != 0`, else bf16), `m <= TOK`; `ws` holds
        /// `DecodeSplit::workspace_bytes` bytes (16-byte aligned) and `counters` one zeroed `u32` per tile (left zeroed
        /// at the end), neither used by another launch at the same time.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(params: DecodeParams, c: *mut u8) {
            let p = crate::param_block!(stringify!($name)) as *const DecodeParams;
            unsafe { decode_on::<[f32; $len], $kn>(cfg::layout($tok), DecodeArgs::of_params(p, params.args, c)) }
        }
    )*};
}

decode_kernels! {
    mk_gemm_decode_nk_t8 8 4 false,
    mk_gemm_decode_nk_t16 16 8 false,
    mk_gemm_decode_nk_t32 32 16 false,
    mk_gemm_decode_nk_t64 64 32 false,
    mk_gemm_decode_nk_t128 128 64 false,
    mk_gemm_decode_nk_t256 256 128 false,
    mk_gemm_decode_kn_t8 8 4 true,
    mk_gemm_decode_kn_t16 16 8 true,
    mk_gemm_decode_kn_t32 32 16 true,
    mk_gemm_decode_kn_t64 64 32 true,
    mk_gemm_decode_kn_t128 128 64 true,
    mk_gemm_decode_kn_t256 256 128 true,
}
