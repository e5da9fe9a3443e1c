//! `mk_moe_ep_dispatch_up`: the expert-parallel dispatch fused with the up projection
//! (docs/moe.md, "Fused dispatch"). Rows for ranks on other nodes are stored first, by every
//! thread, into the transfer rows (the last CTA to finish PUTs them). Then the grouped GEMM
//! runs ([`super::consumer`] unchanged, the producer below), and while it runs, warps 2 and 3
//! of the producer warpgroup store this CTA's tokens' rows for the node's ranks into their
//! owners' receive rows, one pass per local expert index, adding each pass's rows to the
//! owners' arrival counters (`red.release.sys`). Before the first load of a tile of local
//! expert `l` the producer waits (bounded) until `l`'s arrival counter reaches the launch's
//! target and, if rows of `l` come from other nodes, for every remote rank's `FusedData`. Every
//! source sends every owner's expert 0 first, so an owner's first tiles start after about
//! `1 / L` of the dispatch, and the rest of the dispatch overlaps its GEMM.
//!
//! Every CTA of the grid is resident at once (one CTA per SM, at most the SMs), and the
//! dispatch warps wait for nothing, so no tile waits for a CTA that cannot run.
use super::consumer;
use super::ep::{aborting, last_to_store, layer_ctx, node0, on_node, post_remote_rows, wait_word};
use super::grouped_gemm::Launch;
use crate::arch::{ids, mbarrier, memory, memory::Scope, regs, shuffle, smem, sync, tma, tma::TensorMap};
use crate::comm::{proxy, CommCtx};
use crate::gemm::producer::{fill_without_data, load_tile_rows, ARows, BRows};
use crate::gemm::ring::{Ring, RingPos};
use mkernel_config::comm::{wait_code, CommDesc, RemoteSlot, Role};
use mkernel_config::ops::moe::{
    act, grouped_gemm_role, EpFlag, GroupedGemmArgs, MoeEpArgs, GROUPED_GEMM_ROLES, RING, TILE,
};

/// # Safety
///
/// As `mk_moe_ep_dispatch` (same `desc` and `args`, after this layer's routing launch; `x` a 16-byte aligned device
/// address of `tokens x hidden` bf16) and `mk_moe_grouped_gemm` for `up` (the up projection's `GroupedGemmArgs` over
/// this rank's receive rows); the plan is fused (`args.target` nonzero) and the grid at most the CTAs resident at once.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_ep_dispatch_up(
    desc: *const CommDesc,
    args: *const MoeEpArgs,
    up: *const GroupedGemmArgs,
    ids: *const i32,
    x: *const u8,
) {
    let a = unsafe { args.read() };
    let b = ids::block_idx();
    let tid = ids::thread_idx();
    let threads = ids::block_dim();
    let c = unsafe { layer_ctx(desc, &a, b, Role::IntraComm) };
    let stopped = sync::sync_threads_or(unsafe { aborting(&c) });
    // Rows for other nodes first, by every thread (into the transfer rows; the last CTA to
    // finish PUTs them): the proxy's copies then overlap the whole up projection. Rows for
    // the node are stored by the dispatch warps during the GEMM ([`dispatch_node`]).
    if !stopped && c.global_world > c.world {
        let pieces = a.hidden / 8;
        let row_bytes = a.hidden as u64 * 2;
        let le = a.local_experts.max(1);
        let (pos, xrow) = (a.pos as *const u32, a.xrow as *const u32);
        let mut t = b;
        while t < a.tokens {
            let src = x as u64 + t as u64 * row_bytes;
            let mut q = tid;
            while q < pieces {
                let v = unsafe { memory::ld_v4((src + 16 * q as u64) as *const u8) };
                for j in 0..a.top_k {
                    let p = (t * a.top_k + j) as usize;
                    let row = unsafe { pos.add(p).read() };
                    let owner = unsafe { ids.add(p).read() } as u32 / le;
                    if row != u32::MAX && !on_node(&c, owner) {
                        let dst = c.heap(c.rank) + a.heap_xfer + unsafe { xrow.add(p).read() } as u64 * row_bytes;
                        unsafe { memory::st_v4((dst + 16 * q as u64) as *mut u8, v) };
                    }
                }
                q += threads;
            }
            t += ids::grid_dim();
        }
        sync::sync_threads();
        if unsafe { last_to_store(&a) } {
            let _ = unsafe { post_remote_rows(&c, &a) };
        }
    }

    let ring = Ring::new(smem::dynamic_smem_addr(), RING);
    if tid == 0 {
        unsafe {
            tma::prefetch(TensorMap((*up).map_a as *const u8));
            tma::prefetch(TensorMap((*up).map_b as *const u8));
            tma::prefetch(TensorMap((*up).map_c as *const u8));
            ring.init();
        }
    }
    sync::sync_threads();
    // Whole tiles (no `mode::PARTIAL_ROWS`: the plan's maps have no row-granular twins).
    let launch = Launch {
        args: up,
        swiglu: unsafe { (*up).act } & act::MASK == act::SWIGLU,
        partial: false,
        k_blocks: unsafe { (*up).k }.div_ceil(TILE.block_k),
        combine: None,
    };
    let wg = ids::warpgroup_idx();
    match GROUPED_GEMM_ROLES[grouped_gemm_role(wg)].first_warpgroup {
        0 => unsafe { produce(&ring, launch, args, desc, ids, x, stopped) },
        _ => unsafe { consumer::run(&ring, launch, wg - 1) },
    }
}

/// The producer warpgroup: thread 0 issues the TMA loads of each tile (the grouped GEMM's
/// producer), thread 32 waits for the rows: for local experts `0, 1, ...` in order it waits
/// (bounded) until the expert's rows have landed and then publishes how many experts are ready
/// (the ring's tick word 0, `st.release.cta`). Before each tile thread 0 waits until its
/// expert is among them (the scheduler walks row tiles, and so experts, in increasing order).
/// A failed wait leaves the error record and publishes `u32::MAX`; the consumers then run
/// through the remaining tiles without data. (Two threads: the waits' state beside the tile
/// loop spilled in one thread's 40 registers, the producer's count when that was written; it has
/// 56 now.) Warps 2 and 3 store the node's rows meanwhile ([`dispatch_node`]); the other threads
/// exit.
///
/// # Safety
///
/// As `super::producer::run`, with `args` and `desc` this launch's (see [`mk_moe_ep_dispatch_up`]).
#[inline(always)]
unsafe fn produce(
    ring: &Ring,
    l: Launch,
    args: *const MoeEpArgs,
    desc: *const CommDesc,
    ids: *const i32,
    x: *const u8,
    stopped: bool,
) {
    regs::setmaxnreg_dec::<{ TILE.producer_regs }>();
    match ids::thread_idx() {
        0 => unsafe { load(ring, l) },
        32 => unsafe { wait_experts(args, desc) },
        64..128 if !stopped => unsafe { dispatch_node(args, desc, ids, x) },
        _ => {}
    }
}

/// Warps 2 and 3 of the producer warpgroup, while the GEMM runs: this CTA's tokens' rows for
/// the node's ranks, one pass per local expert index `l` (every owner's expert `l` in pass
/// `l`, on every source rank), so the owners' first experts are complete early and their
/// tiles start while later passes are still in flight. Warp `w` takes the CTA's tokens
/// `b + w g, b + (w + 2) g, ...`; a row is copied by the whole warp (16-byte pieces, two
/// loads in flight per lane: four spilled in the producer's 56 registers). Lane `o` counts
/// the rows the warp stored for the node's rank `o` in this pass; after the pass
/// (`bar.warp.sync`, which orders the lanes' stores) it adds them to that rank's arrival
/// counter of expert `l` (`red.release.sys`). That a lane's release covers the other lanes'
/// stores through `bar.warp.sync` is what the PTX ISA says of that barrier ("memory ordering
/// among threads participating in barrier"); the formal memory model names only `bar{.cta}`
/// among the synchronizing barriers. A `fence.acq_rel.sys` in every lane before the barrier
/// would not depend on that reading; it was not measured.
///
/// # Safety
///
/// As [`produce`]: called by the 64 threads `64..128` of the producer warpgroup, with this launch's `args` and `desc`,
/// `ids` and `x` as [`mk_moe_ep_dispatch_up`] got them.
#[inline(always)]
unsafe fn dispatch_node(args: *const MoeEpArgs, desc: *const CommDesc, ids: *const i32, x: *const u8) {
    let a = unsafe { args.read() };
    let b = ids::block_idx();
    let g = ids::grid_dim();
    let c = unsafe { layer_ctx(desc, &a, b, Role::IntraComm) };
    let (warp, lane) = (ids::warp_idx() - 2, ids::lane_id());
    let pieces = a.hidden / 8;
    let row_bytes = a.hidden as u64 * 2;
    let le = a.local_experts.max(1);
    let pos = a.pos as *const u32;
    let node0 = node0(&c);
    for l in 0..le {
        let mut count = 0u32;
        let mut t = b + warp * g;
        while t < a.tokens {
            // Lane j < top_k looks at pair j of token t: the address of its receive row (0: no
            // row for the node in this pass) and its owner among the node's ranks.
            let (mut dst, mut local) = (0u64, 0u32);
            if lane < a.top_k {
                let p = (t * a.top_k + lane) as usize;
                let e = unsafe { ids.add(p).read() } as u32;
                let owner = e / le;
                if e % le == l && on_node(&c, owner) {
                    let row = unsafe { pos.add(p).read() };
                    if row != u32::MAX {
                        local = owner - node0;
                        dst = c.heap(local) + a.heap_recv + row as u64 * row_bytes;
                    }
                }
            }
            let mut hits = shuffle::ballot(dst != 0);
            let src = x as u64 + t as u64 * row_bytes;
            while hits != 0 {
                let j = hits.trailing_zeros();
                hits &= hits - 1;
                let local_j = shuffle::shfl_idx(local, j);
                let dst =
                    (shuffle::shfl_idx(dst as u32, j) as u64) | (shuffle::shfl_idx((dst >> 32) as u32, j) as u64) << 32;
                let mut q = lane;
                while q < pieces {
                    let mut v = [[0u32; 4]; 2];
                    for (u, vu) in v.iter_mut().enumerate() {
                        let qu = q + 32 * u as u32;
                        if qu < pieces {
                            *vu = unsafe { memory::ld_v4((src + 16 * qu as u64) as *const u8) };
                        }
                    }
                    for (u, vu) in v.iter().enumerate() {
                        let qu = q + 32 * u as u32;
                        if qu < pieces {
                            unsafe { memory::st_v4((dst + 16 * qu as u64) as *mut u8, *vu) };
                        }
                    }
                    q += 2 * 32;
                }
                if lane == local_j {
                    count += 1;
                }
            }
            t += 2 * g;
        }
        sync::sync_warp();
        if lane < c.world && count > 0 {
            let at = c.heap(lane) + a.heap_arrival + 8 * l as u64;
            unsafe { memory::red_release_add_u64(Scope::Sys, at as *mut u64, count as u64) };
        }
    }
}

/// The ring's tick word 0 (zeroed by `ring.init`): local experts whose rows are in, or
/// `u32::MAX` after a failed wait.
#[inline(always)]
fn ready_word() -> *mut u32 {
    (smem::dynamic_smem() as u64 + RING.tick as u64) as *mut u32
}

/// Thread 0 of the producer warpgroup: the tiles' TMA loads, each once the waiter said its
/// expert's rows are in.
///
/// # Safety
///
/// As [`produce`].
#[inline(always)]
unsafe fn load(ring: &Ring, l: Launch) {
    let g = unsafe { l.args.read() };
    let (map_a, map_b) = (TensorMap(g.map_a as *const u8), TensorMap(g.map_b as *const u8));
    let mut pos = RingPos::START;
    let give_up = mbarrier::trap_after(mbarrier::HUNG_NS);
    let mut tiles = l.tiles();
    while let Some(tile) = tiles.next() {
        let (e, _) = l.tile_expert(tile.m0);
        loop {
            let r = unsafe { memory::ld_acquire_u32(Scope::Cta, ready_word()) };
            if r == u32::MAX {
                let rest = l.k_blocks * (1 + tiles.count() as u32);
                let _ = unsafe { fill_without_data(ring, &mut pos, rest, give_up) };
                return;
            }
            if e < r {
                break;
            }
        }
        // Rows written by generic stores (here, over NVLink, or the proxy's copies) and
        // announced by releases the waiter acquired; TMA reads them through the async proxy.
        memory::fence_proxy_async();
        let b_row = e * g.b_rows + tile.n0;
        let b_rows = if l.swiglu {
            BRows::Split([b_row, b_row + g.n])
        } else {
            BRows::Whole(b_row)
        };
        let a_rows = ARows {
            map: map_a,
            row: tile.m0,
            boxes: 1,
            box_rows: TILE.block_m,
        };
        unsafe { load_tile_rows(ring, &mut pos, a_rows, map_b, b_rows, l.k_blocks, give_up) };
    }
}

/// Thread 32 of the producer warpgroup: for each local expert in order, waits until its
/// arrival counter reaches this launch's target and, before the first expert with rows from
/// other nodes, for every remote rank's `FusedData`; publishes the experts ready.
///
/// # Safety
///
/// As [`produce`].
#[inline(always)]
unsafe fn wait_experts(args: *const MoeEpArgs, desc: *const CommDesc) {
    let a = unsafe { args.read() };
    let mut c = unsafe { layer_ctx(desc, &a, ids::block_idx(), Role::Compute) };
    // The consumers' ring waits trap after `HUNG_NS`: give up well before, so that they run
    // through the tiles without data instead.
    c.timeout_ns = c.timeout_ns.min(mbarrier::HUNG_NS / 2);
    let target = a.target as *const u64;
    let arrival = c.heap(c.rank) + a.heap_arrival;
    let mut remote_ready = c.global_world == c.world;
    for e in 0..a.local_experts {
        let want = unsafe { target.add(2 * e as usize).read() };
        let counter = (arrival + 8 * e as u64) as *const u64;
        let mut arrived = unsafe { wait_word(&c, counter, want, EpFlag::Rows, CommCtx::global_rank_now, c.timeout_ns) };
        if arrived && !remote_ready && unsafe { target.add(2 * e as usize + 1).read() } > 0 {
            let mut s = 0;
            while arrived && s < c.global_world {
                if !on_node(&c, s) {
                    arrived = unsafe {
                        proxy::wait_remote_as(&c, RemoteSlot::FusedData, s, wait_code::MOE_EP + EpFlag::Rows as u32)
                    };
                }
                s += 1;
            }
            remote_ready = arrived;
        }
        let published = if arrived { e + 1 } else { u32::MAX };
        unsafe { memory::st_release_u32(Scope::Cta, ready_word(), published) };
        if !arrived {
            return;
        }
    }
    // Every remote rank's `FusedData` before the kernel ends, rows for this rank or not: it
    // follows that rank's combine of the last launch, which waited for this rank's `FusedOut`
    // SIGNAL, which follows the proxy's reads of this rank's down-projection rows - which the
    // down projection after this kernel overwrites (docs/moe.md, "Fused dispatch").
    let mut s = 0;
    while !remote_ready && s < c.global_world {
        if !on_node(&c, s)
            && !unsafe { proxy::wait_remote_as(&c, RemoteSlot::FusedData, s, wait_code::MOE_EP + EpFlag::Rows as u32) }
        {
            return;
        }
        s += 1;
    }
}
