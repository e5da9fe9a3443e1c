//! `mk_moe_route`: one CTA of `ROUTE_THREADS` turns the router's top-k expert ids into the
//! grouped layout, with no host round trip:
//! 1. count rows per expert (shared-memory atomics); an id outside `0..experts` is counted in
//!    the error record instead and gets no slot;
//! 2. scan the row tiles per expert (`ceil(count / ROW_ALIGN)`, one expert per thread: warp
//!    scans, then a scan of the warp totals): expert `e`'s group starts at row
//!    `ROW_ALIGN x (tiles before e)`; write counts, offsets, every tile's expert (the last one
//!    with its padding rows) and the rows in use;
//! 3. give every pair a row of its expert's group (a shared-memory cursor per expert; the
//!    order inside a group is whatever the atomics give - every row's result is the same
//!    wherever it sits), and with `row_pair` set, every row its pair (padding rows
//!    `u32::MAX`, written in step 2) for the combine in the down projection's epilogue.
use crate::arch::{ids, memory, memory::Scope, smem, sync};
use mkernel_config::ops::moe::{
    MoeErrorRecord, MoeRouteArgs, MAX_EXPERTS, ROUTE_SMEM_COUNTS, ROUTE_SMEM_CURSOR, ROUTE_SMEM_WARP_TILES,
    ROUTE_THREADS, ROW_ALIGN, TILE_PAD_SHIFT,
};

/// # Safety
///
/// The argument-block contract (`crate::kernels::moe`), launched as one CTA of `ROUTE_THREADS` with `RouteSmem`'s
/// dynamic shared memory; `experts <= MAX_EXPERTS` and `max_tiles` covers every expert's padded rows.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_route(args: *const MoeRouteArgs, ids: *const i32) {
    let a = unsafe { args.read() };
    let base = smem::dynamic_smem_addr();
    let counts = |e: u32| base.add(ROUTE_SMEM_COUNTS + 4 * e);
    let cursor = |e: u32| base.add(ROUTE_SMEM_CURSOR + 4 * e);
    let tid = ids::thread_idx();
    let experts = a.experts.min(MAX_EXPERTS);
    if tid < MAX_EXPERTS {
        unsafe { smem::st_shared_u32(counts(tid), 0) };
    }
    sync::sync_threads();

    // 1. Counts.
    let err = a.error as *mut MoeErrorRecord;
    let mut p = tid;
    while p < a.pairs {
        let e = unsafe { ids.add(p as usize).read() };
        if (e as u32) < experts {
            unsafe { smem::red_add_shared_u32(counts(e as u32), 1) };
        } else {
            unsafe {
                let rec = &raw mut (*err).flag;
                if memory::atom_acq_rel_cas_u32(Scope::Gpu, rec, 0, 1) == 0 {
                    (&raw mut (*err).pair).write_volatile(p);
                    (&raw mut (*err).id).write_volatile(e);
                }
                memory::atom_acq_rel_add_u32(Scope::Gpu, &raw mut (*err).bad, 1);
            }
        }
        p += ROUTE_THREADS;
    }
    sync::sync_threads();

    // 2. Groups.
    let count = if tid < experts {
        unsafe { smem::ld_shared_u32(counts(tid)) }
    } else {
        0
    };
    unsafe { place_groups(&a, experts, count) };

    // 3. Slots.
    let mut p = tid;
    while p < a.pairs {
        let e = unsafe { ids.add(p as usize).read() };
        let slot = if (e as u32) < experts {
            unsafe { smem::atom_add_shared_u32(cursor(e as u32), 1) }
        } else {
            u32::MAX
        };
        unsafe { (a.slots as *mut u32).add(p as usize).write(slot) };
        if a.row_pair != 0 && slot < a.max_tiles * ROW_ALIGN {
            unsafe { (a.row_pair as *mut u32).add(slot as usize).write(p) };
        }
        p += ROUTE_THREADS;
    }
}

/// Exclusive prefix sum of `$v` over the CTA's threads (thread order; warp scans, then a scan of the warp totals),
/// through the shared words at `$warp_tiles(w)` (32 words, free at the call); `$warp`, `$lane` are this thread's warp
/// and lane. Every thread runs it; it ends in a CTA barrier after the words' last write. A macro, not a function: as
/// an `#[inline(always)]` fn it changed the PTX of the routing kernels.
macro_rules! cta_exclusive_sum {
    ($v:expr, $warp_tiles:expr, $warp:expr, $lane:expr) => {{
        let inclusive = $crate::arch::shuffle::warp_inclusive_sum_u32($v);
        if $lane == 31 {
            unsafe { $crate::arch::smem::st_shared_u32($warp_tiles($warp), inclusive) };
        }
        $crate::arch::sync::sync_threads();
        if $warp == 0 {
            let w = unsafe { $crate::arch::smem::ld_shared_u32($warp_tiles($lane)) };
            let excl = $crate::arch::shuffle::warp_inclusive_sum_u32(w) - w;
            unsafe { $crate::arch::smem::st_shared_u32($warp_tiles($lane), excl) };
        }
        $crate::arch::sync::sync_threads();
        (unsafe { $crate::arch::smem::ld_shared_u32($warp_tiles($warp)) }) + inclusive - $v
    }};
}
pub(crate) use cta_exclusive_sum;

/// Step 2 of the routing (every thread of the CTA calls it; thread `e < experts` brings
/// expert `e`'s row count): scans the row tiles per expert (`ceil(count / ROW_ALIGN)`; warp
/// scans, then a scan of the warp totals), writes counts, padded offsets, the expert of every
/// row tile (`expert | pad << TILE_PAD_SHIFT`) and the rows in use, and sets each expert's shared-memory cursor to its first
/// row. Groups that would run past `max_tiles` are cut there (their tiles are not written and
/// the rows in use stop at the capacity) and the error record's `flag` gets bit 1.
///
/// # Safety
///
/// Called by every thread of the routing CTA (it uses CTA barriers) whose dynamic shared memory is a `RouteSmem`; `a`
/// meets the argument-block contract (`crate::kernels::moe`) and `experts <= MAX_EXPERTS`, at most the CTA's thread
/// count.
#[inline(always)]
pub(crate) unsafe fn place_groups(a: &MoeRouteArgs, experts: u32, count: u32) {
    let base = smem::dynamic_smem_addr();
    let cursor = |e: u32| base.add(ROUTE_SMEM_CURSOR + 4 * e);
    let warp_tiles = |w: u32| base.add(ROUTE_SMEM_WARP_TILES + 4 * w);
    let tid = ids::thread_idx();
    let (warp, lane) = (tid / 32, ids::lane_id());
    let tiles = count.div_ceil(ROW_ALIGN);
    let first_tile = cta_exclusive_sum!(tiles, warp_tiles, warp, lane);
    if tid < experts {
        unsafe {
            (a.counts as *mut u32).add(tid as usize).write(count);
            (a.offsets as *mut u32)
                .add(tid as usize)
                .write(first_tile.min(a.max_tiles) * ROW_ALIGN);
            smem::st_shared_u32(cursor(tid), first_tile * ROW_ALIGN);
            let te = a.tile_expert as *mut u32;
            for i in 0..tiles {
                if first_tile + i < a.max_tiles {
                    // The last tile carries its padding rows (the row-granular loads and stores).
                    let pad = if i + 1 == tiles { tiles * ROW_ALIGN - count } else { 0 };
                    te.add((first_tile + i) as usize).write(tid | pad << TILE_PAD_SHIFT);
                }
            }
            if a.row_pair != 0 {
                // The padding rows have no pair (the fused combine skips them).
                let end = ((first_tile + tiles).min(a.max_tiles) * ROW_ALIGN) as usize;
                let mut r = (first_tile * ROW_ALIGN + count) as usize;
                while r < end {
                    (a.row_pair as *mut u32).add(r).write(u32::MAX);
                    r += 1;
                }
            }
        }
        if tid == experts - 1 {
            let total = first_tile + tiles;
            if total > a.max_tiles {
                let err = a.error as *mut MoeErrorRecord;
                unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, &raw mut (*err).flag, 2) };
            }
            let rows = total.min(a.max_tiles) * ROW_ALIGN;
            unsafe {
                (a.offsets as *mut u32).add(experts as usize).write(rows);
                (a.rows as *mut u32).write(rows);
            }
        }
    }
    sync::sync_threads();
}

/// `mk_moe_group_tiles`: the grouped GEMM alone (`mkernel::ops::moe::GroupedGemmPlan`): from
/// rows per group (`counts_in`, device memory, `experts` words) to padded offsets, the group
/// of every row tile and the rows in use ([`place_groups`]); one CTA.
///
/// # Safety
///
/// As [`mk_moe_route`] (one CTA); `counts_in` is the device address of `experts` `u32` row counts.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_group_tiles(args: *const MoeRouteArgs, counts_in: *const u32) {
    let a = unsafe { args.read() };
    let tid = ids::thread_idx();
    let experts = a.experts.min(MAX_EXPERTS);
    let count = if tid < experts {
        unsafe { counts_in.add(tid as usize).read() }
    } else {
        0
    };
    unsafe { place_groups(&a, experts, count) };
}
