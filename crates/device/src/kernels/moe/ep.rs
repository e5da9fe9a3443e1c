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
//! Across nodes (docs/moe.md, "Across nodes"), ranks of the other nodes are reached through the
//! proxy: the count row by one PUT per remote rank (remote flag `FusedReady`), the token rows
//! staged in this rank's transfer rows and PUT per expert by the dispatch's last CTA (then a
//! SIGNAL, `FusedData`), the results PUT back per (source, expert) by the combine's CTA 0 into
//! the source's transfer rows (then a SIGNAL, `FusedOut`). The launch epoch is the fused
//! kernels' (`FUSED_EPOCH_OFFSET`), so the proxy commands' epochs and those remote flags grow
//! across every fused launch of the rank.
//!
//! Every wait is bounded (`CommDesc::timeout_ns`) and leaves the rank's error record naming
//! the rank, the role, the flag and the peer; a kernel that finds the rank aborting moves no data.
use super::combine::store_sums;
use super::route::{cta_exclusive_sum, place_groups};
use crate::arch::{ids, memory, memory::Scope, smem, sync};
use crate::comm::wait::{BoundedWait, Waiting};
use crate::comm::{proxy, CommCtx};
use mkernel_config::comm::fifo::EPOCH_SEQ_FUSED;
use mkernel_config::comm::{wait_code, CommDesc, RemoteSlot, Role, ABORT_OFFSET, FUSED_EPOCH_OFFSET};
use mkernel_config::ops::moe::{
    ep_flag, EpFlag, EpSend, MoeEpArgs, MoeErrorRecord, EP_SMEM_BASE, EP_SMEM_SCAN, EP_SMEM_TOTAL, MAX_EXPERTS,
    ROUTE_SMEM_CURSOR, ROUTE_SMEM_WARP_TILES, ROUTE_THREADS, ROW_ALIGN, ROW_THREADS,
};

/// Whether this rank is aborting (an earlier wait gave up, or a wait copied the host's abort
/// into the heap's word): a kernel that finds it so moves no data.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`.
#[inline(always)]
pub(super) unsafe fn aborting(c: &CommCtx) -> bool {
    unsafe { memory::ld_relaxed_u32(Scope::Sys, (c.heap(c.rank) + ABORT_OFFSET) as *const u32) != 0 }
}

/// Raises flag `(kind, my rank, cta)` = `c.epoch` in `dst`'s heap (one thread, after a CTA
/// barrier that follows the data it publishes; the release is cumulative).
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`, and `a` this layer's `MoeEpArgs` (its `heap_flags` region inside
/// every heap); `dst < world`, `cta` a flag index of this kernel; called by one thread after a CTA barrier that follows
/// the data the flag publishes.
#[inline(always)]
unsafe fn signal(c: &CommCtx, a: &MoeEpArgs, dst: u32, kind: EpFlag, cta: u32) {
    let f = (c.heap(dst) + a.heap_flags + ep_flag(kind, c.rank, cta)) as *mut u64;
    unsafe { memory::st_release_u64(Scope::Sys, f, c.epoch) };
}

/// Waits until this rank's flag `(kind, src, cta)` reaches `c.epoch`; false (after leaving
/// the error record if first: `Timeout`, or `Aborted` when the rank's abort word is up) on
/// timeout or when the rank aborts.
///
/// # Safety
///
/// As [`signal`], with `src < world`.
#[inline(always)]
unsafe fn wait(c: &CommCtx, a: &MoeEpArgs, kind: EpFlag, src: u32, cta: u32) -> bool {
    let f = (c.heap(c.rank) + a.heap_flags + ep_flag(kind, src, cta)) as *const u64;
    let peer = move |c: &CommCtx| src + (c.global_rank_now() - c.rank_now());
    unsafe { wait_word(c, f, c.epoch, kind, peer, c.timeout_ns) }
}

/// Waits until the word `f` (this GPU's memory) reaches `target`, for at most `timeout_ns`: a
/// [`BoundedWait::at_least`] (the rank's heap and host abort words); false (after leaving the
/// error record if first, naming flag `kind` of global rank `peer(c)`) on timeout or when the
/// rank aborts.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`; `f` an 8-byte aligned address of this GPU.
#[inline(always)]
pub(super) unsafe fn wait_word(
    c: &CommCtx,
    f: *const u64,
    target: u64,
    kind: EpFlag,
    peer: impl Fn(&CommCtx) -> u32 + Copy,
    timeout_ns: u64,
) -> bool {
    let what = Waiting {
        code: wait_code::MOE_EP + kind as u32,
        peer,
        expected: target,
    };
    unsafe { BoundedWait::new(c, what).timeout_ns(timeout_ns).at_least(f) }
}

/// The node's ranks in global numbering: `[node0, node0 + world)`.
#[inline(always)]
pub(super) fn node0(c: &CommCtx) -> u32 {
    c.global_rank - c.rank
}

/// Whether global rank `s` is on this rank's node (reached over NVLink, not the proxy).
#[inline(always)]
pub(super) fn on_node(c: &CommCtx, s: u32) -> bool {
    s.wrapping_sub(node0(c)) < c.world
}

/// Every thread `t < global_world` of another node waits for remote flag `(slot, t)` of this
/// epoch (the error record names flag `kind`); the CTA learns whether all arrived.
///
/// # Safety
///
/// As [`signal`], across nodes (`c.fifo` this rank's proxy FIFO); called by every thread of the CTA.
#[inline(always)]
pub(super) unsafe fn wait_remotes(c: &CommCtx, slot: RemoteSlot, kind: EpFlag) -> bool {
    let t = ids::thread_idx();
    let failed = t < c.global_world
        && !on_node(c, t)
        && !unsafe { proxy::wait_remote_as(c, slot, t, wait_code::MOE_EP + kind as u32) };
    !sync::sync_threads_or(failed)
}

/// Every thread `t < global_world` of another node SIGNALs remote flag `slot` there (after the
/// PUTs this CTA posted before the barrier that precedes the call). False if a post failed.
///
/// # Safety
///
/// As [`wait_remotes`].
#[inline(always)]
unsafe fn signal_remotes(c: &CommCtx, slot: RemoteSlot) -> bool {
    let t = ids::thread_idx();
    let failed = t < c.global_world && !on_node(c, t) && unsafe { proxy::signal(c, t, slot) }.is_none();
    !sync::sync_threads_or(failed)
}

/// Exclusive prefix sum of `v` over the routing CTA's threads (thread order), through the
/// shared words at `warp_tiles` (32 words, free at the call). Every thread calls it.
#[inline(always)]
fn block_exclusive_sum(v: u32, warp_tiles: impl Fn(u32) -> smem::SmemAddr) -> u32 {
    let (warp, lane) = (ids::thread_idx() / 32, ids::lane_id());
    sync::sync_threads();
    cta_exclusive_sum!(v, warp_tiles, warp, lane)
}

/// The context of a launch that follows this layer's routing launch: the epoch that launch stored at `a.epoch`, and
/// the epoch sequence of the fused launches (their proxy commands and remote flags).
///
/// # Safety
///
/// As [`CommCtx::with_epoch`] for `desc` and `cta`; `a` meets the argument-block contract (`crate::kernels::moe`), after
/// this layer's routing launch.
#[inline(always)]
pub(crate) unsafe fn layer_ctx(desc: *const CommDesc, a: &MoeEpArgs, cta: u32, role: Role) -> CommCtx {
    let epoch = unsafe { (a.epoch as *const u64).read_volatile() };
    let mut c = unsafe { CommCtx::with_epoch(desc, cta, role, epoch) };
    c.epoch_seq = EPOCH_SEQ_FUSED;
    c
}

/// The row layout the dispatch and the combine share: 16-byte pieces per token row, bytes per row (bf16), local
/// experts per rank (at least 1) and the receive row of every (token, choice) pair (`a.pos`).
#[inline(always)]
fn row_layout(a: &MoeEpArgs) -> (u32, u64, u32, *const u32) {
    (
        a.hidden / 8,
        a.hidden as u64 * 2,
        a.local_experts.max(1),
        a.pos as *const u32,
    )
}

/// Rows of a run of `n` rows starting at receive row `row0` that fit below `capacity`.
#[inline(always)]
fn kept_rows(row0: u32, n: u32, capacity: u32) -> u32 {
    n.min(capacity.saturating_sub(row0))
}

/// Every thread `s < world`, `s != rank` raises `(kind, rank, cta)` at rank `s` and waits for
/// `(kind, s, cta)`; the CTA learns whether all arrived. Call from every thread after a
/// barrier that follows the data the flag publishes.
///
/// # Safety
///
/// As [`signal`]; called by every thread of the CTA (it ends in a CTA barrier), after a barrier that follows the data
/// the flags publish.
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

/// Across nodes, after the CTA's stores and a CTA barrier: whether this CTA is the launch's last
/// to finish its stores (a counter in device memory, `atom.acq_rel.gpu`, reset by the last).
/// Every thread calls it; all get the same answer.
///
/// # Safety
///
/// `a` this layer's `MoeEpArgs` (its `exits` word); every CTA of the grid calls it once per launch.
#[inline(always)]
pub(super) unsafe fn last_to_store(a: &MoeEpArgs) -> bool {
    let mut last = false;
    if ids::thread_idx() == 0 {
        let exits = a.exits as *mut u32;
        last = unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, exits, 1) } + 1 == ids::grid_dim();
        if last {
            unsafe { memory::st_relaxed_u32(Scope::Gpu, exits, 0) };
        }
    }
    sync::sync_threads_or(last)
}

/// The last CTA of the dispatch: one flagless PUT per expert owned on another node with rows
/// (my run of its rows, from my transfer rows into the owner's receive rows), then a SIGNAL
/// `FusedData` to every rank of the other nodes. False if a post failed. Every thread calls it.
///
/// # Safety
///
/// As [`wait_remotes`], with `a` this layer's `MoeEpArgs` and every CTA's stores into the
/// transfer rows ordered before ([`last_to_store`] answered true).
#[inline(always)]
pub(super) unsafe fn post_remote_rows(c: &CommCtx, a: &MoeEpArgs) -> bool {
    // Every CTA's stores are ordered before its count (CTA barrier, then acq_rel): make them
    // visible to the proxy's copies before the commits.
    memory::fence_acq_rel(Scope::Sys);
    let mut c = *c;
    c.role = Role::InterSend;
    let row_bytes = a.hidden as u64 * 2;
    let le = a.local_experts.max(1);
    let send = a.send as *const EpSend;
    let mut failed = false;
    let mut e = ids::thread_idx();
    while e < a.experts {
        let owner = e / le;
        let r = unsafe { send.add(e as usize).read() };
        if !on_node(&c, owner) && r.rows > 0 {
            failed |= unsafe {
                proxy::put_no_flag(
                    &c,
                    owner,
                    a.heap_xfer + r.src as u64 * row_bytes,
                    a.heap_recv + r.dst as u64 * row_bytes,
                    r.rows as u64 * row_bytes,
                )
            }
            .is_none();
        }
        e += ids::block_dim();
    }
    !sync::sync_threads_or(failed) && unsafe { signal_remotes(&c, RemoteSlot::FusedData) }
}

/// `mk_moe_ep_route(desc, args, ids)`: one CTA of `ROUTE_THREADS`.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel (one CTA of `ROUTE_THREADS`) and the
/// argument-block contract (`crate::kernels::moe`): `args` is this rank's `MoeEpArgs`, with the same sizes and heap
/// offsets on every rank, and `heap_*` regions inside every heap past `mkernel_config::comm::HEAP_RESERVED_BYTES`.
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
    // The launch epoch: one past the fused kernels' last (this rank's counter in its heap), so
    // that the proxy commands (epoch sequence "fused") and the remote flags only grow.
    let fused_epoch = {
        let c0 = unsafe { CommCtx::with_epoch(desc, 0, Role::IntraComm, 0) };
        (c0.heap(c0.rank) + FUSED_EPOCH_OFFSET) as *mut u64
    };
    let epoch = unsafe { fused_epoch.read_volatile() } + 1;
    let mut c = unsafe { CommCtx::with_epoch(desc, 0, Role::IntraComm, epoch) };
    c.epoch_seq = EPOCH_SEQ_FUSED;
    let (g, gw) = (c.global_rank, c.global_world);
    let across = gw > c.world;
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
    // Every thread has read the epoch: the later kernels of the launch read the plan's word,
    // the next fused launch of the rank starts past it (also when a wait below fails).
    if tid == 0 {
        unsafe {
            epoch_word.write_volatile(epoch);
            fused_epoch.write_volatile(epoch);
        }
    }

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

    // On a failed wait the GEMMs see no rows; the dispatch and the combine see the abort word.
    let fail = || {
        if ids::thread_idx() == 0 {
            unsafe { (a.layout.rows as *mut u32).write_volatile(0) };
        }
    };
    // 2. Across nodes, first: my row of the count matrix into my heap, then one PUT of it to
    //    every rank of the other nodes (remote flag `FusedReady` = this epoch). No handshake
    //    precedes it: a remote rank reads its count matrix in its routing kernel, which ended
    //    before it raised `FusedOut` of the last launch, which my last combine waited for. Posted
    //    before any wait, so a rank that waits for a missing peer of its node still sends its
    //    counts and the other nodes' waits name the missing rank, not this one.
    if across {
        if tid < experts {
            let n = unsafe { smem::ld_shared_u32(cursor(tid)) };
            let at = c.heap(c.rank) + a.heap_counts + 4 * (g * experts + tid) as u64;
            unsafe { (at as *mut u32).write_volatile(n) };
        }
        sync::sync_threads();
        let row = a.heap_counts + 4 * (g * experts) as u64;
        let failed = tid < gw
            && !on_node(&c, tid)
            && unsafe { proxy::put_value(&c, tid, row, row, 4 * experts as u64, RemoteSlot::FusedReady, epoch) }
                .is_none();
        if sync::sync_threads_or(failed) {
            fail();
            return;
        }
    }
    // 3. Ready: every peer of the node entered this launch (its reads of my buffers from the
    //    last launch are over, and its count matrix, receive rows and down projection may be
    //    overwritten).
    if !unsafe { exchange(&c, &a, EpFlag::Ready, 0) } {
        fail();
        return;
    }
    // 4. My row of the count matrix into every heap of the node (mine included), then Counts;
    //    then the other nodes' rows (their PUTs).
    if tid < experts {
        let n = unsafe { smem::ld_shared_u32(cursor(tid)) };
        for s in 0..c.world {
            let at = c.heap(s) + a.heap_counts + 4 * (g * experts + tid) as u64;
            unsafe { (at as *mut u32).write_volatile(n) };
        }
    }
    sync::sync_threads();
    if !unsafe { exchange(&c, &a, EpFlag::Counts, 0) } {
        fail();
        return;
    }
    if across && !unsafe { wait_remotes(&c, RemoteSlot::FusedReady, EpFlag::Counts) } {
        fail();
        return;
    }

    // 5. Expert e's rows at its owner d = e / L: groups of d's experts in order, each padded
    //    to ROW_ALIGN rows; inside a group the sources in (global) rank order. `scan` = row
    //    tiles of all experts before e (a block scan over the layer's experts).
    let (mut before, mut total) = (0u32, 0u32);
    if tid < experts {
        for s in 0..gw {
            let at = c.heap(c.rank) + a.heap_counts + 4 * (s * experts + tid) as u64;
            let n = unsafe { memory::ld_relaxed_u32(Scope::Sys, at as *const u32) };
            if s < g {
                before += n;
            }
            total += n;
        }
    }
    let tiles = total.div_ceil(ROW_ALIGN);
    let (warp, lane) = (tid / 32, ids::lane_id());
    let excl = cta_exclusive_sum!(tiles, warp_tiles, warp, lane);
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
    let mine = g * le;
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

    // 6. Across nodes: the runs of rows the proxy moves. Source s's rows of expert e sit in
    //    its transfer rows in expert order, `xoff_s(e) = sum_{e' < e} count[s][e']` (a block
    //    scan per source); at e's owner from `group(e) + sum_{s' < s} count[s'][e]`. `send[e]`:
    //    my rows of e; `ret[s L + l]`: source s's rows of my local expert l (both cut at the
    //    capacity like the pairs below).
    if across {
        let send = a.send as *mut EpSend;
        let ret = a.ret as *mut EpSend;
        let mut sources_before = 0u32;
        for s in 0..gw {
            let n = if tid < experts {
                let at = c.heap(c.rank) + a.heap_counts + 4 * (s * experts + tid) as u64;
                unsafe { memory::ld_relaxed_u32(Scope::Sys, at as *const u32) }
            } else {
                0
            };
            let xoff = block_exclusive_sum(n, warp_tiles);
            if s == g && tid < experts {
                let row0 = unsafe { smem::ld_shared_u32(first(tid)) };
                let rows = kept_rows(row0, n, a.capacity);
                unsafe {
                    send.add(tid as usize).write(EpSend {
                        src: xoff,
                        dst: row0,
                        rows,
                    })
                };
            }
            if tid >= mine && tid < mine + le && tid < experts && !on_node(&c, s) {
                let group = ROW_ALIGN * unsafe { smem::ld_shared_u32(scan(tid)) - smem::ld_shared_u32(scan(mine)) };
                let row0 = group + sources_before;
                let rows = kept_rows(row0, n, a.capacity);
                let at = (s * le + tid - mine) as usize;
                unsafe {
                    ret.add(at).write(EpSend {
                        src: row0,
                        dst: xoff,
                        rows,
                    })
                };
            }
            sources_before += n;
        }
        sync::sync_threads();
    }

    // Fused plans: where the arrival counter of each local expert stands once this launch's
    //    rows from the node have landed (it only grows), and the rows from other nodes.
    if a.target != 0 && tid >= mine && tid < mine + le && tid < experts {
        let group = ROW_ALIGN * unsafe { smem::ld_shared_u32(scan(tid)) - smem::ld_shared_u32(scan(mine)) };
        let (mut before_s, mut on, mut off) = (0u32, 0u64, 0u64);
        for s in 0..gw {
            let at = c.heap(c.rank) + a.heap_counts + 4 * (s * experts + tid) as u64;
            let n = unsafe { memory::ld_relaxed_u32(Scope::Sys, at as *const u32) };
            let kept = kept_rows(group + before_s, n, a.capacity) as u64;
            if on_node(&c, s) {
                on += kept;
            } else {
                off += kept;
            }
            before_s += n;
        }
        unsafe {
            let t = (a.target as *mut u64).add(2 * (tid - mine) as usize);
            t.write(t.read() + on);
            t.add(1).write(off);
        }
    }

    // 7. Each pair's receive row; rows past the owner's capacity are dropped and counted.
    //    Across nodes also its transfer row (used when its owner is on another node).
    let mut p = tid;
    let mut dropped = 0u32;
    while p < pairs {
        let e = unsafe { ids.add(p as usize).read() };
        if (e as u32) < experts {
            let idx = unsafe { pos.add(p as usize).read() };
            let row = unsafe { smem::ld_shared_u32(first(e as u32)) } + idx;
            let keep = row < a.capacity;
            if !keep {
                dropped += 1;
            }
            unsafe { pos.add(p as usize).write(if keep { row } else { u32::MAX }) };
            if across {
                let xoff = unsafe { (*(a.send as *const EpSend).add(e as usize)).src };
                unsafe { (a.xrow as *mut u32).add(p as usize).write(xoff + idx) };
            }
        }
        p += ROUTE_THREADS;
    }
    if dropped > 0 {
        unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, drops, dropped) };
    }
    // Every `HOST_ABORT_LAUNCHES` layers the host abort word, also when no wait stalled: the
    // next kernel of the rank then finds the heap word up.
    if tid == 0 {
        unsafe { crate::comm::wait::host_abort_at_launch_end(desc as u64, epoch) };
    }
}

/// `mk_moe_ep_dispatch(desc, args, ids, x)`: CTA `b` of `g` takes tokens `b, b + g, ...` and
/// stores each token row (16-byte pieces, read once) into the receive rows of its pairs'
/// owners; then `Rows` of this CTA to every peer and from every peer.
///
/// # Safety
///
/// As [`mk_moe_ep_route`] (same `desc` and `args`, after the routing launch of this layer); `x` is a 16-byte aligned
/// device address of `tokens x hidden` bf16 elements.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_ep_dispatch(
    desc: *const CommDesc,
    args: *const MoeEpArgs,
    ids: *const i32,
    x: *const u8,
) {
    let a = unsafe { args.read() };
    let b = ids::block_idx();
    let c = unsafe { layer_ctx(desc, &a, b, Role::IntraComm) };
    if unsafe { aborting(&c) } {
        return;
    }
    let (pieces, row_bytes, le, pos) = row_layout(&a);
    let xrow = a.xrow as *const u32;
    let node0 = node0(&c);
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
                    // On the node: into the owner's receive row; else into my transfer row
                    // (the PUT below carries it).
                    let dst = if on_node(&c, owner) {
                        c.heap(owner - node0) + a.heap_recv + row as u64 * row_bytes
                    } else {
                        c.heap(c.rank) + a.heap_xfer + unsafe { xrow.add(p).read() } as u64 * row_bytes
                    };
                    unsafe { memory::st_v4((dst + 16 * q as u64) as *mut u8, v) };
                }
            }
            q += ROW_THREADS;
        }
        t += ids::grid_dim();
    }
    sync::sync_threads();
    // Across nodes: the last CTA to finish its stores posts one PUT per expert owned on another
    // node (my run of its rows, from my transfer rows into the owner's receive rows), then a
    // SIGNAL (`FusedData`) to every rank of the other nodes, and waits for theirs.
    let across = c.global_world > c.world;
    let mut last = false;
    if across {
        last = unsafe { last_to_store(&a) };
        if last && !unsafe { post_remote_rows(&c, &a) } {
            return;
        }
    }
    if !unsafe { exchange(&c, &a, EpFlag::Rows, b) } {
        return;
    }
    if last {
        let _ = unsafe { wait_remotes(&c, RemoteSlot::FusedData, EpFlag::Rows) };
    }
}

/// Pairs whose rows `mk_moe_ep_combine` loads at once (a batch of a token's `top_k`).
const BATCH: u32 = 4;

/// `mk_moe_ep_combine(desc, args, ids, weights, out, f32_out)`: `Out` of this CTA to every
/// peer and from every peer, then `out[t] = sum_j w[t, j] Y_owner[pos(t, j)]` (f32, `j` in
/// order; pairs without a row add nothing), stored as bf16 or f32.
///
/// # Safety
///
/// As [`mk_moe_ep_route`] (same `desc` and `args`, after this layer's dispatch and down projection); `weights` is the
/// device address of `tokens * top_k` `f32`s; `out` a 16-byte aligned device address of `tokens x hidden` writable
/// elements (f32 if `f32_out != 0`, else bf16).
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
    let c = unsafe { layer_ctx(desc, &a, b, Role::IntraComm) };
    if unsafe { aborting(&c) } {
        return;
    }
    let (pieces, row_bytes, le, pos) = row_layout(&a);
    let across = c.global_world > c.world;
    // Across nodes, CTA 0 first sends the results back: one PUT per (source on another node,
    // local expert) from my down projection's rows into the source's transfer rows, then a
    // SIGNAL (`FusedOut`) to every rank of the other nodes.
    if across && b == 0 {
        let mut c = c;
        c.role = Role::InterSend;
        let ret = a.ret as *const EpSend;
        let mut failed = false;
        let mut i = ids::thread_idx();
        while i < c.global_world * le {
            let s = i / le;
            let r = unsafe { ret.add(i as usize).read() };
            if !on_node(&c, s) && r.rows > 0 {
                failed |= unsafe {
                    proxy::put_no_flag(
                        &c,
                        s,
                        a.heap_yp + r.src as u64 * row_bytes,
                        a.heap_xfer + r.dst as u64 * row_bytes,
                        r.rows as u64 * row_bytes,
                    )
                }
                .is_none();
            }
            i += ROW_THREADS;
        }
        if sync::sync_threads_or(failed) || !unsafe { signal_remotes(&c, RemoteSlot::FusedOut) } {
            return;
        }
    }
    if !unsafe { exchange(&c, &a, EpFlag::Out, b) } {
        return;
    }
    // Across nodes: CTA 0 waits for the other nodes' `FusedOut` (remote flags, polled with the
    // proxy's abort word) and relays the epoch through a word of this GPU that the other CTAs
    // wait on (twice the timeout: the wait that names the peer gives up first).
    if across {
        let relay = a.relay as *mut u64;
        if b == 0 {
            if !unsafe { wait_remotes(&c, RemoteSlot::FusedOut, EpFlag::Out) } {
                return;
            }
            if ids::thread_idx() == 0 {
                unsafe { memory::st_release_u64(Scope::Gpu, relay, c.epoch) };
            }
        } else {
            let failed = ids::thread_idx() == 0
                && !unsafe {
                    wait_word(
                        &c,
                        relay,
                        c.epoch,
                        EpFlag::Out,
                        CommCtx::global_rank_now,
                        c.timeout_ns.saturating_mul(2),
                    )
                };
            if sync::sync_threads_or(failed) {
                return;
            }
        }
    }
    let xrow = a.xrow as *const u32;
    let node0 = node0(&c);
    let mut t = b;
    while t < a.tokens {
        let pair0 = t * a.top_k;
        let mut q = ids::thread_idx();
        while q < pieces {
            // BATCH pairs' loads issued before any is added (NVLink loads take microseconds:
            // one at a time, a thread would wait out every round trip); the adds stay in `j`
            // order, so the sum is the same as one pair at a time.
            let mut acc = [0f32; 8];
            let mut j = 0;
            while j < a.top_k {
                let mut v = [[0u32; 4]; BATCH as usize];
                let mut w = [0f32; BATCH as usize];
                for i in 0..BATCH {
                    let p = (pair0 + j + i) as usize;
                    let row = if j + i < a.top_k {
                        unsafe { pos.add(p).read() }
                    } else {
                        u32::MAX
                    };
                    if row != u32::MAX {
                        let owner = unsafe { ids.add(p).read() } as u32 / le;
                        w[i as usize] = unsafe { weights.add(p).read() };
                        let at = if on_node(&c, owner) {
                            c.heap(owner - node0) + a.heap_yp + row as u64 * row_bytes
                        } else {
                            c.heap(c.rank) + a.heap_xfer + unsafe { xrow.add(p).read() } as u64 * row_bytes
                        } + 16 * q as u64;
                        v[i as usize] = unsafe { memory::ld_cg_v4(at as *const u8) };
                    }
                }
                for i in 0..BATCH as usize {
                    for h in 0..4 {
                        acc[2 * h] += w[i] * f32::from_bits(v[i][h] << 16);
                        acc[2 * h + 1] += w[i] * f32::from_bits(v[i][h] & 0xffff_0000);
                    }
                }
                j += BATCH;
            }
            store_sums!(out, t as u64 * a.hidden as u64 + 8 * q as u64, acc, f32_out);
            q += ROW_THREADS;
        }
        t += ids::grid_dim();
    }
}
