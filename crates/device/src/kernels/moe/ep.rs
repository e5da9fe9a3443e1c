//! Expert parallelism over the node's ranks (docs/moe.md, "Across ranks"): experts are split
//! evenly (rank `r` owns experts `r L .. (r + 1) L`), every (token, k) pair's row goes to the
//! rank owning its expert, the owner runs the grouped expert FFN ([`super::grouped_gemm`]) on
//! what it received, and every source reads its rows' results back and sums them.
//!
//! - [`mk_moe_ep_route`] (1 CTA): counts per expert, `Ready` handshake, count matrix exchange
//!   (`Counts`), each pair's row in its owner's receive buffer (`pos`), the receive layout of
//!   the local experts, capacity drops, bad ids to the error record.
//! - [`mk_moe_ep_dispatch`] (persistent grid): token rows into the owners' receive buffers
//!   (NVLink stores), `Rows` flags per CTA.
//! - [`mk_moe_ep_combine`] (persistent grid): `Out` flags per CTA, then the top-k weighted sum
//!   of the rows read back from the owners' down projections (NVLink loads), f32.
//!
//! Every wait is bounded (`CommDesc::timeout_ns`) and leaves the rank's error record naming
//! the rank, the role, the flag and the peer; a kernel that finds the rank aborting moves no data.
use super::route::place_groups;
use crate::arch::{convert::pack_bf16x2, ids, memory, memory::Scope, shuffle, smem, sync, time};
use crate::comm::wait::report_give_up;
use crate::comm::CommCtx;
use mkernel_config::comm::{wait_code, CommDesc, Role, ABORT_OFFSET};
use mkernel_config::ops::moe::{
    ep_flag, EpFlag, MoeEpArgs, MoeErrorRecord, EP_SMEM_BASE, EP_SMEM_SCAN, EP_SMEM_TOTAL, MAX_EXPERTS,
    ROUTE_SMEM_CURSOR, ROUTE_SMEM_WARP_TILES, ROUTE_THREADS, ROW_ALIGN, ROW_THREADS,
};

/// Polls between clock and abort checks.
const POLLS_PER_CHECK: u32 = 64;

/// Whether this rank is aborting (an earlier wait gave up, or the host aborted).
#[inline(always)]
unsafe fn aborting(c: &CommCtx) -> bool {
    unsafe { memory::ld_relaxed_u32(Scope::Sys, (c.heap(c.rank) + ABORT_OFFSET) as *const u32) != 0 }
}

/// Raises flag `(kind, my rank, cta)` = `c.epoch` in `dst`'s heap (one thread, after a CTA
/// barrier that follows the data it publishes; the release is cumulative).
#[inline(always)]
unsafe fn signal(c: &CommCtx, a: &MoeEpArgs, dst: u32, kind: EpFlag, cta: u32) {
    let f = (c.heap(dst) + a.heap_flags + ep_flag(kind, c.rank, cta)) as *mut u64;
    unsafe { memory::st_release_u64(Scope::Sys, f, c.epoch) };
}

/// Waits until this rank's flag `(kind, src, cta)` reaches `c.epoch`; false (after leaving
/// the error record if first: `Timeout`, or `Aborted` when the rank's abort word is up) on
/// timeout or when the rank aborts.
#[inline(always)]
unsafe fn wait(c: &CommCtx, a: &MoeEpArgs, kind: EpFlag, src: u32, cta: u32) -> bool {
    let f = (c.heap(c.rank) + a.heap_flags + ep_flag(kind, src, cta)) as *const u64;
    let start = time::globaltimer_ns();
    let mut polls = 0u32;
    loop {
        let seen = unsafe { memory::ld_acquire_u64(Scope::Sys, f) };
        if seen >= c.epoch {
            return true;
        }
        polls += 1;
        if polls % POLLS_PER_CHECK == 0 {
            let waited = time::globaltimer_ns().wrapping_sub(start);
            if unsafe { aborting(c) } || waited > c.timeout_ns {
                // Timeout, or the rank aborts: the record says which (docs/protocol.md).
                let peer = src + (c.global_rank_now() - c.rank_now());
                unsafe { report_give_up(c, wait_code::MOE_EP + kind as u32, peer, c.epoch, seen, waited) };
                return false;
            }
        }
    }
}

/// Every thread `s < world`, `s != rank` raises `(kind, rank, cta)` at rank `s` and waits for
/// `(kind, s, cta)`; the CTA learns whether all arrived. Call from every thread after a
/// barrier that follows the data the flag publishes.
#[inline(always)]
unsafe fn exchange(c: &CommCtx, a: &MoeEpArgs, kind: EpFlag, cta: u32) -> bool {
    let t = ids::thread_idx();
    let peer = t < c.world && t != c.rank;
    if peer {
        unsafe { signal(c, a, t, kind, cta) };
    }
    let failed = peer && !unsafe { wait(c, a, kind, t, cta) };
    !sync::sync_threads_or(failed)
}

/// `mk_moe_ep_route(desc, args, ids)`: one CTA of `ROUTE_THREADS`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_ep_route(desc: *const CommDesc, args: *const MoeEpArgs, ids: *const i32) {
    let a = unsafe { args.read() };
    let base = smem::dynamic_smem_addr();
    let cursor = |e: u32| base.add(ROUTE_SMEM_CURSOR + 4 * e);
    let warp_tiles = |w: u32| base.add(ROUTE_SMEM_WARP_TILES + 4 * w);
    let scan = |e: u32| base.add(EP_SMEM_SCAN + 4 * e);
    let first = |e: u32| base.add(EP_SMEM_BASE + 4 * e);
    let total_of = |e: u32| base.add(EP_SMEM_TOTAL + 4 * e);
    let tid = ids::thread_idx();
    let epoch_word = a.epoch as *mut u64;
    let epoch = unsafe { epoch_word.read_volatile() } + 1;
    let c = unsafe { CommCtx::with_epoch(desc, 0, Role::IntraComm, epoch) };
    let experts = a.experts.min(MAX_EXPERTS);
    let le = a.local_experts.max(1);
    let pairs = a.tokens * a.top_k;
    let drops = a.drops as *mut u32;
    let pos = a.pos as *mut u32;
    if tid < MAX_EXPERTS {
        unsafe {
            smem::st_shared_u32(cursor(tid), 0);
        }
    }
    if tid < 2 {
        unsafe { drops.add(tid as usize).write_volatile(0) };
    }
    sync::sync_threads();

    // 1. Counts per expert of the layer and each pair's index among this rank's pairs of its
    //    expert; bad ids to the error record.
    let err = a.error as *mut MoeErrorRecord;
    let mut p = tid;
    while p < pairs {
        let e = unsafe { ids.add(p as usize).read() };
        let idx = if (e as u32) < experts {
            unsafe { smem::atom_add_shared_u32(cursor(e as u32), 1) }
        } else {
            unsafe {
                let rec = &raw mut (*err).flag;
                if memory::atom_acq_rel_cas_u32(Scope::Gpu, rec, 0, 1) == 0 {
                    (&raw mut (*err).pair).write_volatile(p);
                    (&raw mut (*err).id).write_volatile(e);
                }
                memory::atom_acq_rel_add_u32(Scope::Gpu, &raw mut (*err).bad, 1);
            }
            u32::MAX
        };
        unsafe { pos.add(p as usize).write(idx) };
        p += ROUTE_THREADS;
    }
    sync::sync_threads();

    // 2. Ready: every peer entered this launch (its reads of my buffers from the last launch
    //    are over, and its count matrix, receive rows and down projection may be overwritten).
    // On a failed wait the GEMMs see no rows; the dispatch and the combine see the abort word.
    let fail = || {
        if ids::thread_idx() == 0 {
            unsafe { (a.layout.rows as *mut u32).write_volatile(0) };
        }
    };
    if !unsafe { exchange(&c, &a, EpFlag::Ready, 0) } {
        fail();
        return;
    }
    // 3. My row of the count matrix into every rank's heap (mine included), then Counts.
    if tid < experts {
        let n = unsafe { smem::ld_shared_u32(cursor(tid)) };
        for s in 0..c.world {
            let at = c.heap(s) + a.heap_counts + 4 * (c.rank * experts + tid) as u64;
            unsafe { (at as *mut u32).write_volatile(n) };
        }
    }
    sync::sync_threads();
    if !unsafe { exchange(&c, &a, EpFlag::Counts, 0) } {
        fail();
        return;
    }

    // 4. Expert e's rows at its owner d = e / L: groups of d's experts in order, each padded
    //    to ROW_ALIGN rows; inside a group the sources in rank order. `scan` = row tiles of
    //    all experts before e (a block scan over the layer's experts).
    let (mut before, mut total) = (0u32, 0u32);
    if tid < experts {
        for s in 0..c.world {
            let at = c.heap(c.rank) + a.heap_counts + 4 * (s * experts + tid) as u64;
            let n = unsafe { memory::ld_relaxed_u32(Scope::Sys, at as *const u32) };
            if s < c.rank {
                before += n;
            }
            total += n;
        }
    }
    let tiles = total.div_ceil(ROW_ALIGN);
    let (warp, lane) = (tid / 32, ids::lane_id());
    let inclusive = shuffle::warp_inclusive_sum_u32(tiles);
    if lane == 31 {
        unsafe { smem::st_shared_u32(warp_tiles(warp), inclusive) };
    }
    sync::sync_threads();
    if warp == 0 {
        let w = unsafe { smem::ld_shared_u32(warp_tiles(lane)) };
        let excl = shuffle::warp_inclusive_sum_u32(w) - w;
        unsafe { smem::st_shared_u32(warp_tiles(lane), excl) };
    }
    sync::sync_threads();
    let excl = unsafe { smem::ld_shared_u32(warp_tiles(warp)) } + inclusive - tiles;
    if tid < MAX_EXPERTS {
        unsafe {
            smem::st_shared_u32(scan(tid), excl);
            smem::st_shared_u32(total_of(tid), total);
        }
    }
    sync::sync_threads();
    if tid < experts {
        let seg = tid / le * le;
        let group = ROW_ALIGN * (excl - unsafe { smem::ld_shared_u32(scan(seg)) });
        unsafe { smem::st_shared_u32(first(tid), group + before) };
    }
    // Receive side: my experts' groups (thread l brings local expert l's rows from all
    // ranks); rows past the capacity are cut and counted.
    let mine = c.rank * le;
    let (mut count, mut cut) = (0u32, 0u32);
    if tid < le && mine + tid < experts {
        count = unsafe { smem::ld_shared_u32(total_of(mine + tid)) };
        let group = ROW_ALIGN * (unsafe { smem::ld_shared_u32(scan(mine + tid)) - smem::ld_shared_u32(scan(mine)) });
        let room = a.capacity.saturating_sub(group);
        cut = count.saturating_sub(room);
    }
    if cut > 0 {
        unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, drops.add(1), cut) };
    }
    sync::sync_threads();
    unsafe { place_groups(&a.layout, le, count) };

    // 5. Each pair's receive row; rows past the owner's capacity are dropped and counted.
    let mut p = tid;
    let mut dropped = 0u32;
    while p < pairs {
        let e = unsafe { ids.add(p as usize).read() };
        if (e as u32) < experts {
            let row = unsafe { smem::ld_shared_u32(first(e as u32)) + pos.add(p as usize).read() };
            let keep = row < a.capacity;
            if !keep {
                dropped += 1;
            }
            unsafe { pos.add(p as usize).write(if keep { row } else { u32::MAX }) };
        }
        p += ROUTE_THREADS;
    }
    if dropped > 0 {
        unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, drops, dropped) };
    }
    sync::sync_threads();
    if tid == 0 {
        unsafe { epoch_word.write_volatile(epoch) };
    }
}

/// `mk_moe_ep_dispatch(desc, args, ids, x)`: CTA `b` of `g` takes tokens `b, b + g, ...` and
/// stores each token row (16-byte pieces, read once) into the receive rows of its pairs'
/// owners; then `Rows` of this CTA to every peer and from every peer.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_ep_dispatch(
    desc: *const CommDesc,
    args: *const MoeEpArgs,
    ids: *const i32,
    x: *const u8,
) {
    let a = unsafe { args.read() };
    let b = ids::block_idx();
    let epoch = unsafe { (a.epoch as *const u64).read_volatile() };
    let c = unsafe { CommCtx::with_epoch(desc, b, Role::IntraComm, epoch) };
    if unsafe { aborting(&c) } {
        return;
    }
    let pieces = a.hidden / 8;
    let row_bytes = a.hidden as u64 * 2;
    let le = a.local_experts.max(1);
    let pos = a.pos as *const u32;
    let mut t = b;
    while t < a.tokens {
        let src = x as u64 + t as u64 * row_bytes;
        let mut q = ids::thread_idx();
        while q < pieces {
            let v = unsafe { memory::ld_v4((src + 16 * q as u64) as *const u8) };
            for j in 0..a.top_k {
                let p = (t * a.top_k + j) as usize;
                let row = unsafe { pos.add(p).read() };
                if row != u32::MAX {
                    let owner = unsafe { ids.add(p).read() } as u32 / le;
                    let dst = c.heap(owner) + a.heap_recv + row as u64 * row_bytes + 16 * q as u64;
                    unsafe { memory::st_v4(dst as *mut u8, v) };
                }
            }
            q += ROW_THREADS;
        }
        t += ids::grid_dim();
    }
    sync::sync_threads();
    unsafe { exchange(&c, &a, EpFlag::Rows, b) };
}

/// `mk_moe_ep_combine(desc, args, ids, weights, out, f32_out)`: `Out` of this CTA to every
/// peer and from every peer, then `out[t] = sum_j w[t, j] Y_owner[pos(t, j)]` (f32, `j` in
/// order; pairs without a row add nothing), stored as bf16 or f32.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_ep_combine(
    desc: *const CommDesc,
    args: *const MoeEpArgs,
    ids: *const i32,
    weights: *const f32,
    out: *mut u8,
    f32_out: u32,
) {
    let a = unsafe { args.read() };
    let b = ids::block_idx();
    let epoch = unsafe { (a.epoch as *const u64).read_volatile() };
    let c = unsafe { CommCtx::with_epoch(desc, b, Role::IntraComm, epoch) };
    if unsafe { aborting(&c) } {
        return;
    }
    if !unsafe { exchange(&c, &a, EpFlag::Out, b) } {
        return;
    }
    let pieces = a.hidden / 8;
    let row_bytes = a.hidden as u64 * 2;
    let le = a.local_experts.max(1);
    let pos = a.pos as *const u32;
    let mut t = b;
    while t < a.tokens {
        let pair0 = t * a.top_k;
        let mut q = ids::thread_idx();
        while q < pieces {
            let mut acc = [0f32; 8];
            for j in 0..a.top_k {
                let p = (pair0 + j) as usize;
                let row = unsafe { pos.add(p).read() };
                if row != u32::MAX {
                    let owner = unsafe { ids.add(p).read() } as u32 / le;
                    let w = unsafe { weights.add(p).read() };
                    let at = c.heap(owner) + a.heap_yp + row as u64 * row_bytes + 16 * q as u64;
                    let v = unsafe { memory::ld_cg_v4(at as *const u8) };
                    for i in 0..4 {
                        acc[2 * i] += w * f32::from_bits(v[i] << 16);
                        acc[2 * i + 1] += w * f32::from_bits(v[i] & 0xffff_0000);
                    }
                }
            }
            let at = t as u64 * a.hidden as u64 + 8 * q as u64;
            if f32_out != 0 {
                let p = out as u64 + 4 * at;
                let lo = [acc[0].to_bits(), acc[1].to_bits(), acc[2].to_bits(), acc[3].to_bits()];
                let hi = [acc[4].to_bits(), acc[5].to_bits(), acc[6].to_bits(), acc[7].to_bits()];
                unsafe {
                    memory::st_v4(p as *mut u8, lo);
                    memory::st_v4((p + 16) as *mut u8, hi);
                }
            } else {
                let v = [
                    pack_bf16x2(acc[0], acc[1]),
                    pack_bf16x2(acc[2], acc[3]),
                    pack_bf16x2(acc[4], acc[5]),
                    pack_bf16x2(acc[6], acc[7]),
                ];
                unsafe { memory::st_v4((out as u64 + 2 * at) as *mut u8, v) };
            }
            q += ROW_THREADS;
        }
        t += ids::grid_dim();
    }
}
