//! Epilogue: a consumer warpgroup's 64 x 256 f32 accumulators to C in global memory.
//!
//! Two paths: [`store_tile_tma`] (bf16 C whose rows are 16-byte multiples: staged in shared memory,
//! written by TMA, asynchronous) and [`store_tile`] (f32 C or odd widths: direct stores from
//! registers; interior tiles store without checks, edge tiles check every element pair).
//! Thread layout of the accumulators: see [`crate::arch::wgmma`].
use super::ring::Ring;
use super::scheduler::Tile;
use super::TILE;
use crate::arch::{convert::pack_bf16x2, ids, matrix, memory, sync, tma, tma::TensorMap};

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

/// Writes a warpgroup's accumulators as they are, f32, to `buf` (128 threads x 128 values,
/// 64 KiB): thread-major 16-byte pieces (piece `j` of thread `t` at `(j x 128 + t) x 16`), so
/// every store instruction of the warpgroup is one contiguous 2 KiB run. [`add_acc_f32`] reads
/// it back in the same layout (a stream-K partial: no layout change on either side).
///
/// # Safety
///
/// Called by all 128 threads of the warpgroup (thread `t` is `thread_idx % 128`); `buf` is a 16-byte aligned address of
/// 64 KiB of writable global memory that no other thread accesses until a release after these stores publishes it.
#[inline(always)]
pub unsafe fn store_acc_f32(acc: &[f32; 128], buf: u64) {
    let at = buf + ids::thread_in_warpgroup() as u64 * 16;
    unroll_32!(j => {
        let v = [acc[4 * j].to_bits(), acc[4 * j + 1].to_bits(), acc[4 * j + 2].to_bits(), acc[4 * j + 3].to_bits()];
        unsafe { memory::st_v4((at + (j * 128 * 16) as u64) as *mut u8, v) };
    });
}

/// Adds what [`store_acc_f32`] wrote at `buf` (another SM, ordered before by a flag this
/// warpgroup acquired) to the accumulators, through L2: four batches of eight 16-byte loads,
/// each batch issued before any of it is added (one L2 round trip per batch, not per load).
///
/// # Safety
///
/// Called by all 128 threads of the warpgroup; `buf` is a 16-byte aligned address of 64 KiB of global memory holding
/// what [`store_acc_f32`] wrote, ordered before this call by a flag this thread (or its warpgroup, through a barrier)
/// acquired, and not written during the reads.
#[inline(always)]
pub unsafe fn add_acc_f32(acc: &mut [f32; 128], buf: u64) {
    let at = buf + ids::thread_in_warpgroup() as u64 * 16;
    let ld = |j: usize| unsafe { memory::ld_cg_v4((at + (j * 128 * 16) as u64) as *const u8) };
    // A batch: the loads of pieces j (eight in a row), then their adds.
    macro_rules! batch {
        ($($j:literal)*) => {
            let v = [$(ld($j)),*];
            $(
                let x = v[$j % 8];
                acc[4 * $j] += f32::from_bits(x[0]);
                acc[4 * $j + 1] += f32::from_bits(x[1]);
                acc[4 * $j + 2] += f32::from_bits(x[2]);
                acc[4 * $j + 3] += f32::from_bits(x[3]);
            )*
        };
    }
    batch!(0 1 2 3 4 5 6 7);
    batch!(8 9 10 11 12 13 14 15);
    batch!(16 17 18 19 20 21 22 23);
    batch!(24 25 26 27 28 29 30 31);
}

/// Stores warpgroup `wg`'s 64 x 256 accumulators as bf16 through shared memory and TMA: four
/// 64 x 64 boxes, double-buffered per warpgroup. For each box every thread converts its values and
/// writes them with `stmatrix` into the 128B-swizzled staging box (the layout the TMA store
/// expects), `fence.proxy.async` makes them visible to the copy engine, a named barrier joins the
/// warpgroup, and one thread issues the bulk store. Rows and columns outside C are clipped by TMA.
/// A buffer is rewritten only after the store that last read it has finished reading
/// (`cp.async.bulk.wait_group.read 1` keeps the other buffer's store in flight; with whole-tile
/// staging, `wait_group.read 0` once per tile).
///
/// # Safety
///
/// The ring contract (`crate::gemm`); called by all 128 threads of consumer warpgroup `wg` together (it uses warpgroup
/// `wg`'s named barrier and staging boxes, which nothing else touches), with `map_c` a bf16 tensor map of C with a 64 x
/// 64 box; before the CTA exits, [`drain_tma_stores`] runs.
#[inline(always)]
pub unsafe fn store_tile_tma(ring: &Ring, map_c: TensorMap, tile: Tile, wg: u32, acc: &mut [f32; 128]) {
    unsafe { store_tile_tma_to(ring, map_c, tile, wg, acc, false) };
}

/// Where an epilogue's bulk stores go: one tensor map, or several ([`MapTable`]).
pub trait TileDestinations: Copy {
    fn count(&self) -> u32;
    fn map(&self, i: u32) -> TensorMap;
    /// Issues the bulk store(s) of one staged 64 x 64 box to destination `i` at column `c0`,
    /// row `c1` (one store of the whole box unless the destination says otherwise).
    ///
    /// # Safety
    ///
    /// As [`tma::store_2d`] for `self.map(i)` and the staging box at `staging`.
    #[inline(always)]
    unsafe fn store(&self, i: u32, c0: u32, c1: u32, staging: crate::arch::smem::SmemAddr) {
        unsafe { tma::store_2d(self.map(i), c0, c1, staging) };
    }
}

/// One tensor map whose box is `box_rows` rows: of each 64-row staged box only the first
/// `rows` rows are stored, rounded up to whole boxes (nothing when `rows` is 0) - the rows of
/// a tile that are not padding (the grouped GEMM's row-granular mode).
#[derive(Clone, Copy)]
pub struct RowBoxes {
    pub map: TensorMap,
    pub rows: u32,
    pub box_rows: u32,
}

impl TileDestinations for RowBoxes {
    #[inline(always)]
    fn count(&self) -> u32 {
        1
    }
    #[inline(always)]
    fn map(&self, _: u32) -> TensorMap {
        self.map
    }
    #[inline(always)]
    unsafe fn store(&self, _: u32, c0: u32, c1: u32, staging: crate::arch::smem::SmemAddr) {
        let mut r = 0;
        while r < self.rows {
            // 128-byte rows: a box of a multiple of 8 rows starts on the swizzle's 1024-byte period.
            unsafe { tma::store_2d(self.map, c0, c1 + r, staging.add(r * 128)) };
            r += self.box_rows;
        }
    }
}

impl TileDestinations for TensorMap {
    #[inline(always)]
    fn count(&self) -> u32 {
        1
    }
    #[inline(always)]
    fn map(&self, _: u32) -> TensorMap {
        *self
    }
}

/// `count` tensor maps whose addresses are in a table in global memory (read when used, so
/// they cost the epilogue no registers).
#[derive(Clone, Copy)]
pub struct MapTable {
    pub maps: *const u64,
    pub count: u32,
}

impl TileDestinations for MapTable {
    #[inline(always)]
    fn count(&self) -> u32 {
        self.count
    }
    #[inline(always)]
    fn map(&self, i: u32) -> TensorMap {
        TensorMap(unsafe { self.maps.add(i as usize).read() } as *const u8)
    }
}

/// No destination: the tile is only staged (whole-tile staging), and its bulk stores are
/// issued later, box by box ([`store_staged_box`]).
#[derive(Clone, Copy)]
pub struct StagedOnly;

impl TileDestinations for StagedOnly {
    #[inline(always)]
    fn count(&self) -> u32 {
        0
    }
    #[inline(always)]
    fn map(&self, _: u32) -> TensorMap {
        TensorMap(core::ptr::null())
    }
}

/// Warpgroup `wg`'s leader issues the bulk store of staging box `q` of a tile staged with
/// [`StagedOnly`] (whole-tile staging; its own bulk group). Call from the leader only.
///
/// # Safety
///
/// The ring contract (`crate::gemm`); called by warpgroup `wg`'s leader only, after the warpgroup's staging box `q`
/// holds the box (written with [`store_tile_tma_to`]'s layout, fenced for the async proxy and joined by the warpgroup
/// barrier); the box is not rewritten before the store has read it (`tma::store_wait_read`).
#[inline(always)]
pub unsafe fn store_staged_box(ring: &Ring, map: TensorMap, tile: Tile, wg: u32, q: u32) {
    unsafe {
        tma::store_2d(
            map,
            tile.n0 + 64 * q,
            tile.m0 + wg * TILE.rows_per_consumer(),
            ring.staging(wg, q),
        )
    };
    tma::store_commit();
}

/// As [`store_tile_tma`], the same tile to every destination of `maps` (the bulk stores of one
/// staged box to all of them form one bulk group). `add_staged` (whole-tile staging only): the
/// staging boxes already hold a bf16 tile in the stored layout (a TMA load waited for by the
/// caller); each thread first reads its values back with `ldmatrix` (the inverse of the
/// `stmatrix` below, same addresses, a warp's own rows) and adds them to `acc`.
///
/// # Safety
///
/// As [`store_tile_tma`], for every map of `maps`; with `add_staged`, the ring uses whole-tile staging and the staging
/// boxes hold a bf16 tile whose load the caller waited for.
#[inline(always)]
pub unsafe fn store_tile_tma_to(
    ring: &Ring,
    maps: impl TileDestinations,
    tile: Tile,
    wg: u32,
    acc: &mut [f32; 128],
    add_staged: bool,
) {
    unsafe { store_boxes_tma_to::<4>(ring, maps, tile, wg, acc, add_staged) };
}

/// As [`store_tile_tma_to`], only the first `BOXES` (1..=4) 64 x 64 boxes of the warpgroup's
/// rows: columns `tile.n0 .. tile.n0 + 64 BOXES` from accumulator columns `0 .. 64 BOXES` (an
/// epilogue that folded the accumulators into fewer columns, e.g. SwiGLU's gate x up).
///
/// # Safety
///
/// As [`store_tile_tma_to`], with `BOXES` in 1..=4.
#[inline(always)]
pub unsafe fn store_boxes_tma_to<const BOXES: u32>(
    ring: &Ring,
    maps: impl TileDestinations,
    tile: Tile,
    wg: u32,
    acc: &mut [f32; 128],
    add_staged: bool,
) {
    const { assert!(BOXES >= 1 && BOXES <= 4) };
    let t = ids::thread_in_warpgroup();
    let (warp, lane) = (t / 32, t % 32);
    let leader = t == 0;
    let barrier = 1 + wg; // named barrier per consumer warpgroup; 0 is __syncthreads
                          // Lane l addresses row (l % 8) of matrix (l / 8): matrices 0/1 = rows +0/+8 of n8 block j,
                          // 2/3 = the same rows of block j + 1.
    let row = warp * 16 + ((lane / 8) % 2) * 8 + lane % 8;
    let chunk_of_pair = lane / 16;
    // Whole-tile staging: one wait, before the first box, for the previous tile's stores (they
    // had a mainloop to drain); double-buffered: before each box, for the store two boxes back.
    let whole = ring.whole_tile_staging();
    macro_rules! store_box {
        ($q:literal, $buf:literal) => {if $q < BOXES {
            let staging = ring.staging(wg, if whole { $q } else { $buf });
            if !whole || $q == 0 {
                if leader {
                    if whole {
                        tma::store_wait_read::<0>();
                    } else {
                        tma::store_wait_read::<1>();
                    }
                }
                sync::named_barrier_sync(barrier, 128);
            }
            store_box_pairs!($q, staging, 0 1 2 3);
            // Only staged (no destination): one fence and one barrier after the last box are
            // enough (the fence orders all of this thread's earlier writes); its stores are
            // issued later, after that barrier.
            if maps.count() > 0 || $q == BOXES - 1 {
                memory::fence_proxy_async_shared();
                sync::named_barrier_sync(barrier, 128);
            }
            if leader && maps.count() > 0 {
                for m in 0..maps.count() {
                    unsafe { maps.store(m, tile.n0 + 64 * $q, tile.m0 + wg * TILE.rows_per_consumer(), staging) };
                }
                tma::store_commit();
            }
        }};
    }
    macro_rules! store_box_pairs {
        ($q:literal, $staging:ident, $($p:literal)*) => {$({
            // n8 blocks j = 8q + 2p and j + 1: 16-byte chunks 2p and 2p + 1 of the 128-byte row.
            const J: usize = 8 * $q + 2 * $p;
            let chunk = 2 * $p + chunk_of_pair;
            let addr = $staging.add(row * 128 + ((chunk ^ (row % 8)) * 16));
            if add_staged {
                unsafe { add_staged_pairs::<J>(acc, addr) };
            }
            let v = [
                pack_bf16x2(acc[4 * J], acc[4 * J + 1]),
                pack_bf16x2(acc[4 * J + 2], acc[4 * J + 3]),
                pack_bf16x2(acc[4 * J + 4], acc[4 * J + 5]),
                pack_bf16x2(acc[4 * J + 6], acc[4 * J + 7]),
            ];
            unsafe { matrix::stmatrix_x4(addr, v) };
        })*};
    }
    store_box!(0, 0);
    store_box!(1, 1);
    store_box!(2, 0);
    store_box!(3, 1);
}

/// Reads this thread's 8 bf16 values of n8 blocks `J` and `J + 1` from a staging box
/// with `ldmatrix` (the inverse of the store pass's `stmatrix` at `addr`) and adds them to `acc`.
///
/// # Safety
///
/// Executed by all 32 lanes of the warp together; `addr` is this lane's `ldmatrix` address in a staging box of this CTA
/// that holds the staged bf16 tile (loaded and waited for), as for [`crate::arch::matrix::ldmatrix_x4`].
#[inline(always)]
unsafe fn add_staged_pairs<const J: usize>(acc: &mut [f32; 128], addr: crate::arch::smem::SmemAddr) {
    let w = unsafe { matrix::ldmatrix_x4(addr) };
    for (i, x) in w.iter().enumerate() {
        acc[4 * J + 2 * i] += f32::from_bits(x << 16);
        acc[4 * J + 2 * i + 1] += f32::from_bits(x & 0xffff_0000);
    }
}

/// Adds the bf16 tile staged in warpgroup `wg`'s whole-tile staging (the layout
/// [`store_tile_tma_to`] writes; a TMA load waited for by the caller) into its accumulators,
/// reading each thread's values with `ldmatrix` at the addresses the store pass uses. The
/// staging is left as it was: the caller joins the warpgroup before it is rewritten.
///
/// # Safety
///
/// The ring contract (`crate::gemm`) with whole-tile staging; called by all 128 threads of warpgroup `wg`, after the
/// staged tile's load completed (waited for by the caller); the staging is not rewritten until the warpgroup has joined
/// after this call.
#[inline(always)]
pub unsafe fn add_staged_tile(ring: &Ring, wg: u32, acc: &mut [f32; 128]) {
    // Re-read (not hoisted out of a caller's loop: 16 addresses kept live next to the
    // accumulators are what ptxas spills).
    let t = ids::thread_idx_reread() % crate::arch::ids::WARPGROUP_THREADS;
    let (warp, lane) = (t / 32, t % 32);
    let row = warp * 16 + ((lane / 8) % 2) * 8 + lane % 8;
    let chunk_of_pair = lane / 16;
    macro_rules! add_box {
        ($q:literal, $($p:literal)*) => {$({
            const J: usize = 8 * $q + 2 * $p;
            let chunk = 2 * $p + chunk_of_pair;
            let addr = ring.staging(wg, $q).add(row * 128 + ((chunk ^ (row % 8)) * 16));
            unsafe { add_staged_pairs::<J>(acc, addr) };
        })*};
    }
    add_box!(0, 0 1 2 3);
    add_box!(1, 0 1 2 3);
    add_box!(2, 0 1 2 3);
    add_box!(3, 0 1 2 3);
}

/// Adds a bf16 matrix into warpgroup `wg`'s accumulators of a tile: `src` is the address of the
/// tile's element (0, 0) in a row-major matrix of row stride `ld` elements, `cols` how many of
/// the tile's columns exist (at least 256 for an interior tile); missing columns are skipped
/// (the TMA store clips them). Loads go through L2 only (`ld.global.cg`): the data was written
/// by other GPUs during this launch.
///
/// # Safety
///
/// Called by all 128 threads of warpgroup `wg`; `src` is a 4-byte aligned address of element (0, 0) of the tile in a
/// bf16 row-major matrix with an even row stride `ld`, whose rows `64 wg .. 64 wg + 64` (all of them: rows are not
/// checked) and first `cols` columns (`cols <= 256`) are readable global memory, published to this thread before the
/// call and not written during it.
#[inline(always)]
pub unsafe fn add_bf16_tile(acc: &mut [f32; 128], src: u64, ld: u32, cols: u32, wg: u32) {
    let t = ids::thread_in_warpgroup();
    let row0 = (wg * TILE.rows_per_consumer() + (t / 32) * 16 + (t % 32) / 4) as u64;
    let col0 = 2 * (t % 4);
    let p0 = src + (row0 * ld as u64 + col0 as u64) * 2;
    let down8 = 8 * ld as u64 * 2;
    // Columns of this thread's pair j are col0 + 8 j: compare 8 j (an immediate) with what is
    // left, so no per-pair value stays live across the tile loop.
    let left = cols.saturating_sub(col0);
    // Two batches of 16 pairs: all 32 loads of a batch are issued before any is used, so a
    // batch costs one memory round trip (loads used one by one cost 32).
    macro_rules! batch {
        ($checked:expr, $($j:literal)*) => {{
            let mut v = [[0u32; 2]; 32];
            $( if !$checked || 8 * ($j as u32) < left {
                let p = p0 + 16 * $j as u64;
                v[$j] = unsafe { [memory::ld_cg_u32(p as *const u8), memory::ld_cg_u32((p + down8) as *const u8)] };
            } )*
            $( if !$checked || 8 * ($j as u32) < left {
                acc[4 * $j] += f32::from_bits(v[$j][0] << 16);
                acc[4 * $j + 1] += f32::from_bits(v[$j][0] & 0xffff_0000);
                acc[4 * $j + 2] += f32::from_bits(v[$j][1] << 16);
                acc[4 * $j + 3] += f32::from_bits(v[$j][1] & 0xffff_0000);
            } )*
        }};
    }
    macro_rules! add_pairs {
        ($checked:expr) => {{
            batch!($checked, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
            batch!($checked, 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
        }};
    }
    if cols >= TILE.block_n {
        add_pairs!(false);
    } else {
        add_pairs!(true);
    }
}

/// Waits until the warpgroup's bulk stores stopped reading shared memory (before the CTA exits).
#[inline(always)]
pub fn drain_tma_stores() {
    if ids::thread_in_warpgroup() == 0 {
        tma::store_wait::<0>();
    }
}

/// Stores warpgroup `wg`'s rows of `tile`.
///
/// # Safety
///
/// Called by all 128 threads of warpgroup `wg`; `out.c` is the address of an `out.m` x `out.n` matrix of bf16 (or f32,
/// `out.f32_out`) elements with row stride `out.ldc >= out.n`, in writable global memory and aligned to twice the
/// element size (element pairs are stored as one access); no other thread accesses warpgroup `wg`'s rows of `tile`
/// concurrently.
#[inline(always)]
pub unsafe fn store_tile(out: &Output, tile: Tile, wg: u32, acc: &[f32; 128]) {
    let t = ids::thread_in_warpgroup();
    let row0 = tile.m0 + wg * TILE.rows_per_consumer() + (t / 32) * 16 + (t % 32) / 4;
    let col0 = tile.n0 + 2 * (t % 4);
    let interior = tile.m0 + TILE.block_m <= out.m && tile.n0 + TILE.block_n <= out.n && out.ldc.is_multiple_of(2);
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
///
/// # Safety
///
/// As [`store_tile`]: `out` describes writable global memory aligned to twice the element size, and unchecked
/// (`CHECKED` false) calls have `row < out.m`, `col + 1 < out.n` and an even `out.ldc`.
#[inline(always)]
unsafe fn store_pair<const CHECKED: bool>(out: &Output, row: u32, col: u32, x: f32, y: f32) {
    if CHECKED && (row >= out.m || col >= out.n) {
        return;
    }
    let idx = row as usize * out.ldc as usize + col as usize;
    let pair_ok = !CHECKED || (col + 1 < out.n && out.ldc.is_multiple_of(2));
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

/// Rows of warpgroup `wg`'s tile held by this thread (the wgmma accumulator layout): `r` and
/// `r + 8`, counted from the tile's first row.
#[inline(always)]
pub fn thread_rows(wg: u32) -> [u32; 2] {
    let t = ids::thread_in_warpgroup();
    let r = wg * TILE.rows_per_consumer() + (t / 32) * 16 + (t % 32) / 4;
    [r, r + 8]
}

/// Adds a warpgroup's 64 x 256 accumulators, each row times its weight, into f32 rows in global
/// memory with 16-byte reductions (`red.global.add.v4.f32`; no staging, no return values).
/// `dst[i]` is the address of the destination element of column `tile.n0` for this thread's row
/// [`thread_rows`]`[i]` (0: the row is skipped), `w[i]` its weight; columns at or past `cols`
/// (counted from `tile.n0`, a multiple of 4) are skipped. In the accumulator layout the four
/// threads of a quad hold two columns each of an 8-column block, in rows `r` and `r + 8`; one
/// `shfl.bfly` exchange per column pair gives the even thread four columns of row `r` and the odd
/// thread four of row `r + 8`, so every reduction moves 16 bytes.
///
/// # Safety
///
/// Called by all 128 threads of the warpgroup (it shuffles within each warp); every nonzero `dst[i]` is a 16-byte
/// aligned address with `cols` writable f32 after it, accessed concurrently only by reductions until the kernel ends.
#[inline(always)]
pub unsafe fn red_rows_f32(acc: &[f32; 128], dst: [u64; 2], w: [f32; 2], cols: u32) {
    let q = ids::thread_in_warpgroup() % 4;
    let odd = q & 1 == 1;
    let (to, c0) = (if odd { dst[1] } else { dst[0] }, 2 * (q & !1));
    unroll_32!(j => {
        let (a0, a1) = (acc[4 * j] * w[0], acc[4 * j + 1] * w[0]);
        let (b0, b1) = (acc[4 * j + 2] * w[1], acc[4 * j + 3] * w[1]);
        let (s0, s1) = if odd { (a0, a1) } else { (b0, b1) };
        let r0 = f32::from_bits(crate::arch::shuffle::shfl_xor(s0.to_bits(), 1));
        let r1 = f32::from_bits(crate::arch::shuffle::shfl_xor(s1.to_bits(), 1));
        let v = if odd { [r0, r1, b0, b1] } else { [a0, a1, r0, r1] };
        let col = 8 * j as u32 + c0;
        if to != 0 && col < cols {
            unsafe { memory::red_add_v4_f32((to + 4 * col as u64) as *mut f32, v) };
        }
    });
}

/// SwiGLU over a tile whose 256 accumulator columns are 128 gate columns then the 128 up
/// columns of the same outputs: columns `0..128` become `silu(gate) * up` (f32). In the wgmma
/// layout a thread holds the same position of every n8 block, so gate value `i` and its up
/// value `i + 64` are the same thread's.
#[inline(always)]
pub fn swiglu_in_place(acc: &mut [f32; 128]) {
    unroll_32!(j => {
        acc[2 * j] = crate::arch::math::silu(acc[2 * j]) * acc[2 * j + 64];
        acc[2 * j + 1] = crate::arch::math::silu(acc[2 * j + 1]) * acc[2 * j + 65];
    });
}
