//! Fused communication + GEMM kernels: one persistent launch whose CTAs take roles.
//!
//! `mk_ag_gemm_bf16_nk`: C (M x N) = AllGather_rows(A) (M x K) * B^T (B: N x K, local).
//! Each rank holds rows `[rank * Ms, (rank + 1) * Ms)` of A (`Ms = M / world`, a multiple of 128).
//! - CTAs `0..n_comm` (role IntraComm) copy this rank's shard, 128-row chunk by chunk, into the
//!   gathered A buffer of every local peer over NVLink and raise flag `(Tile0, rank, chunk)` at
//!   the receiver after each chunk; across nodes they also stage the shard for one proxy PUT to
//!   every remote rank (see `comm_role`).
//! - CTAs `n_comm..` (role Compute) run the persistent GEMM; tile rows are visited from this
//!   rank's shard on: those tiles read A in place from the shard (no copy, no wait), the peers'
//!   rows come from the gathered buffer, and the producer waits for a chunk's flag before its
//!   first TMA load of those rows.
//!
//! Epoch: one per launch, read by every CTA at start and advanced by the last CTA to exit.
//! Buffer reuse: before writing into a peer's gathered buffer, a comm CTA waits for that peer's
//! `FusedReady` (raised by its comm CTA 0 at start: its previous launch, which read the buffer,
//! ended).
use crate::arch::{ids, mbarrier, memory, memory::Scope, regs, smem, sync, tma, tma::TensorMap};
use crate::comm::bulk::{BulkRing, Release};
use crate::comm::wait::{wait_flag_of_cta, wait_flag_of_cta_from, wait_flag_of_cta_sleeping};
use crate::comm::{proxy, CommCtx};
use crate::gemm::consumer::{drain_tile, mma_tile_bounded, mma_tile_hooked, KBlockHook};
use crate::gemm::epilogue::{add_acc_f32, add_bf16_tile, add_staged_tile, drain_tma_stores, store_acc_f32, store_staged_box, store_tile_tma, store_tile_tma_to, MapTable, StagedOnly};
use crate::gemm::producer::{fill_without_data, load_tile, load_tile_counted, wait_loads_landed};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::scheduler::TileScheduler;
use crate::gemm::{BLayout, TILE};
use crate::gemm::scheduler::Tile;
use crate::gemm::trace;
use mkernel_config::trace::{End, Mark, tile_kind};
use mkernel_config::fused::{rs_source_row, AgGemmArgs, GemmRsArgs, SK_SLOT_BYTES, STAGER_STORE_ROWS};
use mkernel_config::stream_k::StreamK;
use mkernel_config::GemmTile;
use mkernel_config::comm::{flag_offset, CommDesc, FlagSlot, RemoteSlot, Role, ABORT_OFFSET, FIFO_HEAD_OFFSET, FUSED_EPOCH_OFFSET, FUSED_EXITS_OFFSET};

#[inline(always)]
unsafe fn launch_epoch(c: &CommCtx) -> u64 {
    unsafe { ((c.heap(c.rank) + FUSED_EPOCH_OFFSET) as *const u64).read_volatile() + 1 }
}

/// Whether this rank gave up (a wait timed out or the host aborted): GEMM+ReduceScatter/AllReduce
/// reads it at each tile's start (each consumer warpgroup's leader) and ORs it into that tile's
/// epilogue barriers.
#[inline(always)]
unsafe fn aborted(desc: u64) -> bool {
    unsafe { abort_word(desc) != 0 }
}

/// The rank's abort word (nonzero: aborted), as loaded: a caller that compares it later keeps
/// the load's latency off its path until then.
#[inline(always)]
unsafe fn abort_word(desc: u64) -> u32 {
    let d = unsafe { &*(desc as *const CommDesc) };
    let heap = unsafe { *d.heaps.as_ptr().add(d.rank as usize) };
    unsafe { memory::ld_relaxed_u32(Scope::Gpu, (heap + ABORT_OFFSET) as *const u32) }
}

/// How long a fused kernel's GEMM ring may stall before the wait is declared hung (a trap): past
/// every communication wait it can be behind (a relayed wait takes twice the timeout).
#[inline(always)]
unsafe fn fused_hung_ns(desc: u64) -> u64 {
    unsafe { (*(desc as *const CommDesc)).timeout_ns }.saturating_mul(4).saturating_add(mbarrier::HUNG_NS)
}

/// Stall callback of a fused kernel's consumer slot waits: trap once hung ([`fused_hung_ns`]).
#[inline(always)]
fn consumer_stall(desc: u64) -> impl Fn(u64) -> bool + Copy {
    move |stalled| {
        if stalled > unsafe { fused_hung_ns(desc) } {
            crate::arch::trap();
        }
        false
    }
}

/// This launch's context, read from the descriptor. Each role builds its own after its
/// `setmaxnreg` (rather than one built before the role split and kept live across it, which
/// ptxas had to spill in the 56-register producer). Every warp reads the launch epoch before it
/// exits, and the epoch only advances after the last warp exited, so all reads agree.
#[inline(always)]
unsafe fn fused_ctx(desc: u64, role: Role) -> CommCtx {
    let mut c = unsafe { CommCtx::new(desc as *const CommDesc, 0, role) };
    c.epoch = unsafe { launch_epoch(&c) };
    c.epoch_seq = mkernel_config::comm::fifo::EPOCH_SEQ_FUSED;
    c
}

/// The last warp of the launch to get here advances the launch epoch. Counted per warp with
/// `bar.warp.sync` (no CTA-wide barrier: after the role split the producer's lane 0 runs long
/// after the rest of its warpgroup, and an aligned CTA barrier reached divergently is undefined).
#[inline(always)]
unsafe fn exit_launch(c: &CommCtx, epoch: u64) {
    unsafe { exit_launch_then(c, epoch, || {}) };
}

/// As [`exit_launch`]; the last warp's lane 0 first runs `last` (every other warp of the launch
/// has exited, and the exit counter's acquire/release chain orders their work before it).
#[inline(always)]
unsafe fn exit_launch_then(c: &CommCtx, epoch: u64, last: impl FnOnce()) {
    sync::sync_warp();
    if ids::lane_id() == 0 {
        unsafe { count_exit(c, epoch, ids::grid_dim() * (ids::block_dim() / 32), last) };
    }
}

/// One exit of `exits` in the launch (lane 0, after its warp's or CTA's work): the last one runs
/// `last`, resets the counter and advances the launch epoch.
#[inline(always)]
unsafe fn count_exit(c: &CommCtx, epoch: u64, exits: u32, last: impl FnOnce()) {
    let local = c.heap(c.rank);
    let exited = unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 1) };
    if exited + 1 == exits {
        last();
        unsafe {
            memory::st_relaxed_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 0);
            memory::st_release_u64(Scope::Gpu, (local + FUSED_EPOCH_OFFSET) as *mut u64, epoch);
        }
    }
}

/// As [`exit_launch_then`], counting warps per CTA first: each warp's lane 0 adds 1 to a
/// shared-memory word (`Ring::tick(1)` of GEMM+ReduceScatter's ring, zeroed by `Ring::init`
/// before the CTA's first barrier; `atom.acq_rel.cta`), and the CTA's last warp adds 1 to the
/// launch's exit counter - one global atomic per CTA instead of one per warp, which all land at
/// the end of the launch. The acquire/release chain (CTA scope, then GPU scope) still orders
/// every warp's work before the launch's last warp runs `last(lane, 32)` - in all its lanes
/// (ordered after lane 0's acquire by the warp barrier, and before lane 0's release of the
/// next epoch by another), which share its end-of-launch stores.
#[inline(always)]
unsafe fn exit_launch_by_cta_then(c: &CommCtx, epoch: u64, last: impl FnOnce(u32, u32)) {
    sync::sync_warp();
    let mut is_last = 0u32;
    if ids::lane_id() == 0 {
        let word = (smem::dynamic_smem() as u64 + RS_TILE.tick_offset() as u64 + 4) as *mut u32;
        let warps = ids::block_dim() / 32;
        if unsafe { memory::atom_acq_rel_add_u32(Scope::Cta, word, 1) } + 1 == warps {
            let local = c.heap(c.rank);
            let exited = unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 1) };
            is_last = (exited + 1 == ids::grid_dim()) as u32;
        }
    }
    if crate::arch::shuffle::shfl_idx(is_last, 0) != 0 {
        sync::sync_warp();
        last(ids::lane_id(), 32);
        sync::sync_warp();
        if ids::lane_id() == 0 {
            let local = c.heap(c.rank);
            unsafe {
                memory::st_relaxed_u32(Scope::Gpu, (local + FUSED_EXITS_OFFSET) as *mut u32, 0);
                memory::st_release_u64(Scope::Gpu, (local + FUSED_EPOCH_OFFSET) as *mut u64, epoch);
            }
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_ag_gemm_bf16_nk(args: *const AgGemmArgs) {
    // Fields are read from the kernel argument block in global memory where used; a by-value
    // copy passed by reference would live on the stack.
    let a = unsafe { &*args };
    let (role, role_idx) = if ids::block_idx() < a.n_comm { (Role::IntraComm, ids::block_idx()) } else { (Role::Compute, ids::block_idx() - a.n_comm) };
    if role == Role::IntraComm {
        let c = unsafe { fused_ctx(a.desc, role) };
        let shard_rows = a.m / c.global_world;
        unsafe { comm_role(&c, a, role_idx, shard_rows / TILE.block_m, a.k as u64 * 2) };
    } else {
        unsafe { compute_role(a, role_idx) };
    }
    let c = unsafe { fused_ctx(a.desc, role) };
    unsafe { exit_launch(&c, c.epoch) };
}

/// Pushes this rank's shard, chunk by chunk, to every local peer with TMA bulk copies (thread 0
/// of each comm CTA; [`BulkRing`]), in the order the peers need it: rank `r` visits its own
/// rows first, then local rank `r + 1`'s, so local rank `r - 1` gets this shard first.
/// Across nodes (`global_world > world`), first every comm CTA stages its chunks in this rank's
/// own gathered buffer (the proxy's source) and raises `(Tile1, rank, chunk)` locally; comm
/// CTA 0 raises `FusedReady` at every remote rank, and once the whole shard is staged and a
/// remote rank's `FusedReady` arrived, posts one PUT of the shard to it, raising `FusedData`
/// there; it waits for the proxy to finish the puts before the launch ends.
#[inline(always)]
unsafe fn comm_role(c: &CommCtx, a: &AgGemmArgs, idx: u32, chunks: u32, row_bytes: u64) {
    let t = ids::thread_idx();
    unsafe {
        // Our gathered buffer is free (our previous launch ended): tell the local peers.
        if idx == 0 && t < c.world && t != c.rank {
            memory::st_release_u64(Scope::Sys, (c.heap(t) + flag_offset(FlagSlot::FusedReady, c.rank, 0)) as *mut u64, c.epoch);
        }
        if t != 0 {
            return;
        }
        let mut ring = BulkRing::new(smem::dynamic_smem_addr());
        let chunk_bytes = TILE.block_m as u64 * row_bytes;
        // Byte offset of this rank's rows in the gathered buffer (rows are by global rank).
        let shard_off = c.global_rank as u64 * chunks as u64 * chunk_bytes;
        let my_node = c.global_rank / c.world;
        let remote = |q: u32| q / c.world != my_node;
        let mut last_put = None;
        if c.global_world > c.world {
            if idx == 0 {
                for q in 0..c.global_world {
                    if remote(q) && proxy::signal(c, q, RemoteSlot::FusedReady).is_none() {
                        return;
                    }
                }
            }
            let own = c.heap(c.rank) + a.a_gathered_off + shard_off;
            let mut j = idx;
            while j < chunks {
                let mut dsts = [0u64; 8];
                dsts[0] = own + j as u64 * chunk_bytes;
                ring.copy(&dsts, 1, a.a_shard + j as u64 * chunk_bytes, chunk_bytes);
                memory::st_release_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::Tile1, c.rank, j), c.epoch);
                j += a.n_comm;
            }
            if idx == 0 {
                for j in 0..chunks {
                    if !wait_flag_of_cta(c, FlagSlot::Tile1, c.rank, j, c.epoch) {
                        return;
                    }
                }
                for q in 0..c.global_world {
                    if remote(q) {
                        if !proxy::wait_remote(c, RemoteSlot::FusedReady, q) {
                            return;
                        }
                        let off = a.a_gathered_off + shard_off;
                        last_put = proxy::put_value(c, q, off, off, chunks as u64 * chunk_bytes, RemoteSlot::FusedData, c.epoch);
                        if last_put.is_none() {
                            return;
                        }
                    }
                }
            }
        }
        for kk in 1..c.world {
            let p = (c.rank + c.world - kk) % c.world;
            // Wait (bounded) until p's previous launch finished with its buffer.
            if !wait_flag_of_cta(c, FlagSlot::FusedReady, p, 0, c.epoch) {
                return;
            }
            let mut j = idx;
            while j < chunks {
                let off = shard_off + j as u64 * chunk_bytes;
                let mut dsts = [0u64; 8];
                dsts[0] = c.heap(p) + a.a_gathered_off + off;
                ring.copy(&dsts, 1, a.a_shard + j as u64 * chunk_bytes, chunk_bytes);
                memory::st_release_u64(Scope::Sys, (c.heap(p) + flag_offset(FlagSlot::Tile0, c.rank, j)) as *mut u64, c.epoch);
                j += a.n_comm;
            }
        }
        if let Some(seq) = last_put {
            // The launch ends only when the proxy has read our shard (the next launch restages it).
            let _ = proxy::wait_done(c, seq);
        }
    }
}

/// The producer's bounded wait for a chunk. Inline: a call from a warpgroup that gave
/// registers back with `setmaxnreg` may use registers it no longer has.
#[inline(always)]
unsafe fn wait_chunk(c: &CommCtx, src: u32, chunk: u32) -> bool {
    unsafe { wait_flag_of_cta(c, FlagSlot::Tile0, src, chunk, c.epoch) }
}

/// The persistent GEMM over the gathered A, waiting for each 128-row chunk before loading it.
#[inline(always)]
unsafe fn compute_role(a: &AgGemmArgs, idx: u32) {
    let ring = Ring::new(smem::dynamic_smem_addr(), TILE);
    let (map_a, map_b, map_c) = (TensorMap(a.map_a as *const u8), TensorMap(a.map_b as *const u8), TensorMap(a.map_c as *const u8));
    let map_a_local = TensorMap(a.map_a_local as *const u8);
    if ids::thread_idx() == 0 {
        unsafe {
            tma::prefetch(map_a);
            tma::prefetch(map_a_local);
            tma::prefetch(map_b);
            ring.init();
        }
    }
    sync::sync_threads();
    // Each role derives its loop state after its setmaxnreg (values kept live across the split
    // are what ptxas spills).
    let setup = || {
        let d = unsafe { &*(a.desc as *const CommDesc) };
        let (world, global_rank, global_world) = (d.world, d.global_rank, d.global_world);
        let shard_rows = a.m / global_world;
        // This node's rows first (from this rank's shard on), then the other nodes' in turn.
        let first_in_node = (global_rank % world) * shard_rows / TILE.block_m;
        let tiles = TileScheduler::new(a.m, a.n, TILE.block_m, TILE.block_n, TILE.group_m, idx, ids::grid_dim() - a.n_comm).node_major(global_world / world, global_rank / world, first_in_node);
        (world, global_rank, shard_rows, tiles, a.k.div_ceil(TILE.block_k))
    };
    let wg = ids::warpgroup_idx();
    let mut pos = RingPos::START;
    if wg == 0 {
        regs::setmaxnreg_dec::<{ GemmTile::FUSED.producer_regs }>();
        if ids::thread_idx() == 0 {
            let (world, global_rank, shard_rows, tiles, k_blocks) = setup();
            // The context is built only where a wait needs it (once per chunk or remote
            // shard): kept across the loop it would not fit the producer's 56 registers.
            let mut ready_row: u32 = u32::MAX; // last tile row known to have arrived
            let mut remote_ready: u32 = u32::MAX; // last remote shard known to have arrived
            // AllGather+GEMM's consumers never stop early: the producer's waits only trap once hung.
            let give_up = consumer_stall(a.desc);
            let mut tiles = tiles;
            while let Some(tile) = tiles.next() {
                let src = tile.m0 / shard_rows; // global rank
                let mut arrived = true;
                if src == global_rank {
                    // Our own rows: read the shard in place.
                    if !unsafe { load_tile(&ring, &mut pos, map_a_local, tile.m0 - src * shard_rows, map_b, BLayout::Nk, tile, k_blocks, give_up) } {
                        break;
                    }
                    continue;
                }
                if src / world != global_rank / world {
                    // Another node's shard, put whole by its proxy.
                    if src != remote_ready {
                        let c = unsafe { fused_ctx(a.desc, Role::Compute) };
                        arrived = unsafe { proxy::wait_remote(&c, RemoteSlot::FusedData, src) };
                        memory::fence_proxy_async();
                        remote_ready = src;
                    }
                } else if tile.m0 != ready_row {
                    let chunk = (tile.m0 % shard_rows) / TILE.block_m;
                    let c = unsafe { fused_ctx(a.desc, Role::Compute) };
                    arrived = unsafe { wait_chunk(&c, src % world, chunk) };
                    // The rows were written by a peer's bulk copies over NVLink and announced
                    // by a generic release; TMA reads through the async proxy.
                    memory::fence_proxy_async();
                    ready_row = tile.m0;
                }
                if !arrived {
                    // The error record names the stalled source: the consumers run through
                    // the remaining tiles without data and the launch ends.
                    let rest = k_blocks * (1 + tiles.count() as u32);
                    let _ = unsafe { fill_without_data(&ring, &mut pos, rest, give_up) };
                    break;
                }
                if !unsafe { load_tile(&ring, &mut pos, map_a, tile.m0, map_b, BLayout::Nk, tile, k_blocks, give_up) } {
                    break;
                }
            }
        }
    } else {
        regs::setmaxnreg_inc::<{ GemmTile::FUSED.consumer_regs }>();
        let (_, _, _, tiles, k_blocks) = setup();
        let mut acc = [0f32; 128];
        for tile in tiles {
            unsafe {
                mma_tile_bounded(&ring, &mut pos, &mut acc, wg - 1, BLayout::Nk, k_blocks, consumer_stall(a.desc));
                store_tile_tma(&ring, map_c, tile, wg - 1, &mut acc);
            }
        }
        drain_tma_stores();
    }
}

/// `mk_gemm_rs_bf16_nk`: GEMM + ReduceScatter / AllReduce. Every rank computes its partial
/// product `P_r = A_r * B_r^T` (M x N; K is split over ranks); global rank `g` reduces row chunk
/// `g` of `sum_r P_r` in f32. Rows are visited node-blocked ([`rs_source_row`]): local rank
/// `l`'s chunk (`M / world` rows) is its rail's global chunks, other nodes' first, own last.
/// CTAs `0..n_comm` move partials ([`rs_comm_role`]); the others compute, in the chunked order
/// of [`TileScheduler::chunked`] over those chunks (per part: the peers' chunks first, the own
/// chunk last):
/// - a peer's tile is stored with TMA into the local outbox (with comm CTAs, which copy each
///   completed row tile to the peer) or straight into this rank's slot of the peer's receive
///   buffer over NVLink (without; the first store to a peer waits for its `FusedReady`). Each
///   consumer warpgroup counts its half locally once its bulk stores completed ([`publish`]),
///   two tiles later unless another rank waits for it ([`awaited_in_loop`]); comm CTAs or the
///   relay warps ([`relay_role`]) raise the peer's flag once the row tile is complete.
/// - an own tile waits until every local peer's counter of its row tile is full and adds the
///   peers' partial tiles (bf16, in rank order) to its f32 accumulators. In another node's block
///   the sum is this node's partial of a remote rank's rows: it is stored in the stage, and the
///   tile that completes the block (`NodeSum` counter) posts one proxy PUT of it to that rank
///   (after its remote `FusedReady`), raising `FusedData`. In the own node's block the tile
///   also adds the other nodes' sums (after their `FusedData`) and stores the result: to the
///   output (ReduceScatter) or to the rows of this chunk in every local rank's output
///   (AllReduce, then a relay raises `(Tile2, rank, row tile)` at every peer; across nodes the
///   completed block is PUT to every remote rank's output, raising `FusedOut`). An AllReduce
///   launch ends once every other rank's reduced rows are in this rank's output.
/// CTA 0 first zeroes this rank's incoming counters, then raises `FusedReady` at every peer
/// (and, through the proxy, at every remote rank): senders add to the counters only after that,
/// and all additions of a launch have landed before the receiver's launch ends, whose last warp
/// zeroes the counters again (so no CTA of the next launch can meet a full counter before CTA 0
/// ran) and, across nodes, waits until the proxy has read every PUT source.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_gemm_rs_bf16_nk(args: *const GemmRsArgs, desc: *const CommDesc) {
    // (The clock read before the arguments: their load is part of the entry.)
    let entered = crate::arch::time::globaltimer_ns();
    unsafe { rs_roles(args, desc, entered) };
    // Everything from the shared copies: the launch's end reads nothing from global memory
    // before its exit count.
    let c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    unsafe {
        exit_launch_by_cta_then(&c, c.epoch, |lane, lanes| {
            let a = &*(largs() as *const GemmRsArgs);
            finish_reduce_launch(&c, a, lane, lanes);
            if lane == 0 && ids::block_idx_reread() >= a.n_comm {
                trace::end(a.trace, ids::block_idx_reread() - a.n_comm, End::Exit);
            }
        })
    };
}

/// A comm CTA of GEMM+ReduceScatter/AllReduce (thread 128; [`BulkRing`]): copies its slice of
/// every row tile (128 rows x N) of partials to the local peers as the compute CTAs complete
/// them, in the order they are computed ([`TileScheduler::chunked`]: per part, the peers' row
/// tiles, chunk `rank + 1` first):
/// once this rank stored all its halves of the row tile in the outbox (`(Outbox, d, mt)` full),
/// the slice goes into this rank's slot of d's receive buffer (after d's `FusedReady`), and
/// `(Tile1, rank, mt)` there is raised by 1 (`red.release.sys`, deferred until the stores are
/// complete: [`BulkRing::copy_deferred`]); the counter is full at `n_comm`. The compute CTAs' stores stay local (TMA into the outbox), so their mainloops neither wait
/// for NVLink nor share their SM's memory pipe with it; a few CTAs move the bytes at NVLink
/// rate. Waits are bounded (error record, then the launch ends).
#[inline(always)]
unsafe fn rs_comm_role(a: &GemmRsArgs) {
    let idx = ids::block_idx_reread();
    let mut c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    c.role = Role::IntraComm;
    c.cta = idx;
    let c = &c;
    let mut ring = unsafe { BulkRing::new(smem::dynamic_smem_addr()) };
    let (rank, world) = (c.rank, c.world);
    let chunk_rows = a.m / world;
    let row_bytes = a.n as u64 * 2;
    let full = HALVES * a.n.div_ceil(TILE.block_n) as u64;
    // This CTA's slice of every row tile (16-byte multiples; the last slice may be shorter).
    let slice = (TILE.block_m as u64 * row_bytes).div_ceil(16 * a.n_comm as u64) * 16;
    let first = (idx as u64 * slice).min(TILE.block_m as u64 * row_bytes);
    let len = slice.min(TILE.block_m as u64 * row_bytes - first);
    let part = a.part_tiles_m;
    let parts = chunk_rows / TILE.block_m / part;
    let mut ready = 1u32 << rank; // local ranks whose buffers we may write
    unsafe {
        for g in 0..parts {
            for s in 1..world {
                let dest = (rank + s) % world;
                let mut mt = g * part;
                while mt < (g + 1) * part {
                    // A release still held by the ring is raised before any wait that may
                    // take long (the peer may be waiting for it).
                    let counter = c.flag_of_cta(rank, FlagSlot::Outbox, dest, mt);
                    if memory::ld_acquire_u64(Scope::Gpu, counter) < full || ready & (1 << dest) == 0 {
                        ring.flush();
                    }
                    // (A failed wait leaves the error record; the CTA exits once nothing is
                    // in flight.)
                    if !wait_flag_of_cta(c, FlagSlot::Outbox, dest, mt, full) {
                        return ring.flush();
                    }
                    if ready & (1 << dest) == 0 {
                        if !wait_flag_of_cta(c, FlagSlot::FusedReady, dest, 0, c.epoch) {
                            return ring.flush();
                        }
                        ready |= 1 << dest;
                    }
                    // The outbox was written by TMA stores (announced by a generic release):
                    // the bulk loads read it through the async proxy.
                    memory::fence_proxy_async();
                    let mut dsts = [0u64; 8];
                    dsts[0] = c.heap(dest) + a.recv_off + (rank * chunk_rows + mt * TILE.block_m) as u64 * row_bytes + first;
                    let mut flags = [0u64; 8];
                    flags[0] = c.heap(dest) + flag_offset(FlagSlot::Tile1, rank, mt);
                    // Raised once these stores are complete, while the next slices stream.
                    ring.copy_deferred(&dsts, 1, c.heap(rank) + a.outbox_off + (dest * chunk_rows + mt * TILE.block_m) as u64 * row_bytes + first, len, Release { flags, n: 1, add: 1 });
                    mt += 1;
                }
            }
        }
        ring.flush();
    }
}

/// CTA 0, all threads: zero the incoming `Tile1` (and `Tile2`) counters of this shape's row
/// tiles, then raise `FusedReady` at every peer and every remote rank.
#[inline(always)]
unsafe fn open_receive_buffers(c: &CommCtx, a: &GemmRsArgs) {
    let t = ids::thread_idx();
    unsafe { zero_counters(c, a, t, ids::block_dim(), false) };
    sync::sync_threads();
    if t < c.world && t != c.rank {
        unsafe { memory::st_release_u64(Scope::Sys, (c.heap(t) + flag_offset(FlagSlot::FusedReady, c.rank, 0)) as *mut u64, c.epoch) };
    }
    if t < c.global_world && t / c.world != c.global_rank / c.world {
        // A failed post leaves the error record; the remote side's wait then times out.
        let _ = unsafe { proxy::signal(c, t, RemoteSlot::FusedReady) };
    }
}

/// Zeroes this rank's incoming `Tile1` and `Tile2` counters of this shape's row tiles (thread `t`
/// of `nt` sharing the work; with `outbox`, the local `Outbox` ones too). Done twice per
/// launch: by CTA 0 before it raises `FusedReady`, and by the launch's last warp once every
/// counter was seen full - so a launch starts with zeros and no CTA can read the previous
/// launch's full counters before CTA 0 got to its prologue. (The heap base is read once and
/// nothing is divided: at the launch's end, one lane rereading the base behind each store
/// and dividing per counter took ~5 us.)
#[inline(always)]
unsafe fn zero_counters(c: &CommCtx, a: &GemmRsArgs, t: u32, nt: u32, outbox: bool) {
    let row_tiles = a.m / c.world / TILE.block_m;
    let base = c.heap(c.rank);
    let zero = |slot: FlagSlot, src: u32, mt: u32| unsafe { memory::st_relaxed_u64(Scope::Gpu, (base + flag_offset(slot, src, mt)) as *mut u64, 0) };
    let mut src = 0;
    while src < c.world {
        let mut mt = t;
        while mt < row_tiles {
            zero(FlagSlot::Tile1, src, mt);
            zero(FlagSlot::Tile2, src, mt);
            if outbox {
                zero(FlagSlot::Outbox, src, mt);
            }
            mt += nt;
        }
        src += 1;
    }
}

/// The launch's last warp (lane `lane` of `lanes`): zero the counters (also the `Outbox` and
/// `NodeSum` ones, which only this zeroing may touch) and, across nodes, wait until the proxy
/// completed every command posted so far (lane 0): the next launch rewrites the stage and the
/// output the PUTs read.
#[inline(always)]
unsafe fn finish_reduce_launch(c: &CommCtx, a: &GemmRsArgs, lane: u32, lanes: u32) {
    unsafe {
        zero_counters(c, a, lane, lanes, true);
        let nodes = c.global_world / c.world;
        if nodes > 1 && lane == 0 {
            for j in 0..nodes {
                memory::st_relaxed_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::NodeSum, c.rank, j), 0);
            }
            let claimed = memory::ld_relaxed_u64(Scope::Gpu, (c.heap(c.rank) + FIFO_HEAD_OFFSET) as *const u64);
            if claimed > 0 {
                let _ = proxy::wait_done(c, claimed - 1);
            }
        }
    }
}

/// The GEMM+ReduceScatter/AllReduce ring (whole-tile epilogue staging).
const RS_TILE: GemmTile = GemmTile::FUSED_RS;
/// Bits of a consumer's `ready` word above the local ranks' `FusedReady` bits: the current own
/// tile's first peer partial is staged; the parity of the next staged phase of `aux(wg)`.
const STAGED: u32 = 1 << 29;
const STAGE_PARITY: u32 = 1 << 30;

/// Tiles whose completion is still to be announced: the previous one and the one before it.
struct Pendings {
    older: Option<Pending>,
    newer: Option<Pending>,
}

/// Epilogue bulk-store groups per tile and consumer warpgroup (one per staging box).
const TILE_GROUPS: u32 = GemmTile::FUSED_RS.block_n / GemmTile::EPILOGUE_BOX_COLS;

/// Whether another rank waits for a tile's announcement before the end of its tile loop: a
/// partial for a local peer, or part of a node sum for another node.
#[inline(always)]
fn awaited_in_loop(c: &CommCtx, a: &GemmRsArgs, p: Pending) -> bool {
    let (nodes, _, block_rows) = node_blocks(c, a.m);
    p.dest != c.rank || p.mt * TILE.block_m / block_rows + 1 < nodes
}

/// Announces the older pending tile (if any, and if it is announced at all): its bulk stores
/// are complete once at most the newer tile's `TILE_GROUPS` groups are in flight. False when
/// the warpgroup stops.
#[inline(always)]
unsafe fn announce_older(c: &CommCtx, a: &GemmRsArgs, pending: &mut Pendings, wg: u32, stop: bool) -> bool {
    match pending.older.take() {
        Some(p) if announced(c, a, p) => unsafe { publish::<TILE_GROUPS>(c, a, p, wg, stop) },
        _ => true,
    }
}

/// Announces the newer pending tile (every bulk store complete). False when the warpgroup
/// stops.
#[inline(always)]
unsafe fn announce_newer(c: &CommCtx, a: &GemmRsArgs, pending: &mut Pendings, wg: u32, stop: bool) -> bool {
    match pending.newer.take() {
        Some(p) if announced(c, a, p) => unsafe { publish::<0>(c, a, p, wg, stop) },
        _ => true,
    }
}

/// A ReduceScatter peer partial tile (pushed without comm CTAs) staged at its epilogue, whose bulk stores
/// into the peer's receive buffer the warpgroup's leader issues during the next mainloop, one
/// staging box every quarter of it ([`KBlockHook`]). Issued at the epilogue, every CTA's 64 KiB
/// crossed NVLink at once (the CTAs finish their tiles nearly together), and the burst held up
/// the next mainloop's TMA loads behind it. Each box is its own bulk group, as when stored at
/// once, so the announcement rule ([`publish`]) is unchanged: the next epilogue finds them as
/// the newest `TILE_GROUPS` groups. All threads track `left`; the leader issues.
#[derive(Clone, Copy)]
struct Trickle {
    /// Destination local rank (its receive buffer: `map_recv[dest]`).
    dest: u32,
    /// The tile (rows inside the chunk).
    m0: u32,
    n0: u32,
    /// Boxes not yet issued (0: nothing staged).
    left: u32,
}

impl Trickle {
    const NONE: Trickle = Trickle { dest: 0, m0: 0, n0: 0, left: 0 };

    /// Issues the next box (consumer warpgroup `cw`: 0-based).
    #[inline(always)]
    unsafe fn issue(&mut self, ring: &Ring, cw: u32) {
        if ids::thread_in_warpgroup() == 0 {
            let a = unsafe { &*(largs() as *const GemmRsArgs) };
            let map = TensorMap(unsafe { *a.map_recv.as_ptr().add(self.dest as usize) } as *const u8);
            unsafe { store_staged_box(ring, map, Tile { m0: self.m0, n0: self.n0 }, cw, RS_TILE.epilogue_buffers - self.left) };
        }
        self.left -= 1;
    }

    /// Issues every box not yet issued.
    #[inline(always)]
    unsafe fn flush(&mut self, ring: &Ring, cw: u32) {
        while self.left > 0 {
            unsafe { self.issue(ring, cw) };
        }
    }
}

impl KBlockHook for Trickle {
    /// Box q goes out after K block (2q + 1) k_blocks / 8 (64 K blocks: 8, 24, 40, 56).
    #[inline(always)]
    fn at(&mut self, kb: u32, k_blocks: u32) {
        let q = RS_TILE.epilogue_buffers - self.left;
        if self.left > 0 && kb == (2 * q + 1) * k_blocks / (2 * RS_TILE.epilogue_buffers) {
            let cw = ids::warpgroup_idx() - 1;
            unsafe { self.issue(&Ring::new(smem::dynamic_smem_addr(), RS_TILE), cw) };
        }
    }

}

/// A tile whose completion is announced at a later tile's epilogue.
#[derive(Clone, Copy)]
struct Pending {
    /// Destination local rank (this rank: an own tile).
    dest: u32,
    /// Row tile inside the chunk.
    mt: u32,
}

/// Node geometry of a launch: `(nodes, node, rows of one node block = M / global_world)`.
#[inline(always)]
fn node_blocks(c: &CommCtx, m: u32) -> (u32, u32, u32) {
    (c.global_world / c.world, c.global_rank / c.world, m / c.global_world)
}

#[inline(always)]
unsafe fn rs_roles(args: *const GemmRsArgs, desc: *const CommDesc, entered: u64) {
    let ring = Ring::new(smem::dynamic_smem_addr(), RS_TILE);
    if ids::thread_idx_reread() == 0 {
        unsafe {
            // Every role below reads the descriptor and the arguments from these copies
            // ([`ldesc`], [`largs`]). Both come as kernel parameters, so all their loads are in
            // flight at once (one round trip; through `args.desc` it took two). All loads
            // first, then the stores (interleaved, each load waited behind the previous
            // volatile store).
            const D: usize = core::mem::size_of::<CommDesc>() / 8;
            const G: usize = core::mem::size_of::<GemmRsArgs>() / 8;
            let dw: [u64; D] = core::array::from_fn(|i| (desc as *const u64).add(i).read());
            let aw: [u64; G] = core::array::from_fn(|i| (args as *const u64).add(i).read());
            ring.init();
            for (i, w) in dw.iter().enumerate() {
                (ldesc() as *mut u64).add(i).write_volatile(*w);
            }
            for (i, w) in aw.iter().enumerate() {
                (largs() as *mut u64).add(i).write_volatile(*w);
            }
            let a = &*(largs() as *const GemmRsArgs);
            tma::prefetch(TensorMap(a.map_a as *const u8));
            tma::prefetch(TensorMap(a.map_b as *const u8));
        }
    }
    sync::sync_threads();
    let a = unsafe { &*(largs() as *const GemmRsArgs) };
    // Thread 0 reads the launch epoch while the CTA fills its item table and keeps it in
    // shared memory ([`lepoch`]) for every role and the exit.
    let epoch = if ids::thread_idx_reread() == 0 { unsafe { launch_epoch(&fused_ctx_at(ldesc(), 0)) } } else { 0 };
    if ids::block_idx_reread() >= a.n_comm {
        unsafe { fill_item_table(ids::block_idx_reread() - a.n_comm) };
    }
    if ids::thread_idx_reread() == 0 {
        unsafe { ((smem::dynamic_smem() as u64 + RS_TILE.epoch_copy_offset() as u64) as *mut u64).write_volatile(epoch) };
    }
    sync::sync_threads();
    if ids::block_idx_reread() == 0 {
        // (All of CTA 0's threads: it has a CTA barrier.)
        unsafe { open_receive_buffers(&fused_ctx_at(ldesc(), lepoch()), a) };
    }
    if ids::thread_idx_reread() == 0 && ids::block_idx_reread() >= a.n_comm {
        let cta = ids::block_idx_reread() - a.n_comm;
        unsafe { trace::end_at(a.trace, cta, End::Entry, entered) };
        unsafe { trace::end(a.trace, cta, End::Setup) };
    }
    // Each role derives its loop state after its setmaxnreg: values computed before the split
    // and kept live across it are what ptxas spills. Indices are read again for the same reason.
    // `idx`: this CTA among the compute CTAs.
    let compute_idx = || ids::block_idx_reread() - a.n_comm;
    let mut pos = RingPos::START;
    // Every CTA runs the same register split (a comm CTA's thread 128 moves the data, with
    // the consumers' registers): role branches around setmaxnreg cost the consumers their
    // larger register budget in ptxas (they spilled).
    if ids::warpgroup_idx_reread() == 0 {
        regs::setmaxnreg_dec::<{ RS_TILE.producer_regs }>();
        if ids::block_idx_reread() < a.n_comm {
            return;
        }
        let (idx, tid) = (compute_idx(), ids::thread_idx_reread());
        if tid == 64 && relays_run(a) {
            // Warp 2 (otherwise idle): raises the peers' flags of finished row tiles.
            unsafe { relay_role(a, idx) };
            unsafe { trace::end(a.trace, idx, End::RelayDone) };
        }
        if (tid == 32 || tid == 96) && stager_runs(a) {
            // Lane 0 of warps 1 and 3 (idle on one node): the stagers of consumer warpgroups
            // 0 and 1.
            unsafe { stager_role(idx, tid / 64) };
        }
        if tid == 32 && idx < node_blocks_to_send(a) {
            // Warp 1 of the producer warpgroup (otherwise idle) of compute CTA j: inter-node
            // sender of node block j.
            unsafe { send_node_block(a, idx) };
        }
        if tid == 96 && node_blocks_to_send(a) > 0 {
            // Warp 3: wait for the other nodes' sums of our rows (one PUT from each node's rank
            // of our rail), then arrive on the aux barrier, which the consumers wait for before
            // they add the sums (also after a failed wait, so theirs stays bounded: the error
            // record is written and the host reports it). Compute CTA 0 alone polls the
            // inter-node flags and raises `(FusedReady, own rank, 1)` locally for the others;
            // for AllReduce it then waits until every remote rank's reduced rows are in our
            // output (the launch ends after that).
            let mut c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
            c.role = Role::InterReduce;
            let (nodes, node) = (c.global_world / c.world, c.global_rank / c.world);
            if idx == 0 {
                let mut all = true;
                for nd in 0..nodes {
                    if nd != node && !unsafe { proxy::wait_remote(&c, RemoteSlot::FusedData, nd * c.world + c.rank) } {
                        all = false;
                        break;
                    }
                }
                if all {
                    unsafe { memory::st_release_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::FusedReady, c.rank, 1), c.epoch) };
                }
                unsafe { mbarrier::arrive(Ring::new(smem::dynamic_smem_addr(), RS_TILE).aux(0)) };
                if all && a.all_reduce != 0 {
                    for q in 0..c.global_world {
                        if q / c.world != node && !unsafe { proxy::wait_remote(&c, RemoteSlot::FusedOut, q) } {
                            break;
                        }
                    }
                }
            } else {
                // Twice CTA 0's patience: a stalled remote rank is reported by CTA 0's wait
                // (naming that rank), which also stops this one.
                let mut relay = c;
                relay.timeout_ns = c.timeout_ns.saturating_mul(2);
                let _ = unsafe { wait_flag_of_cta(&relay, FlagSlot::FusedReady, c.rank, 1, c.epoch) };
                unsafe { mbarrier::arrive(Ring::new(smem::dynamic_smem_addr(), RS_TILE).aux(0)) };
            }
        }
        if tid == 0 {
            let ring = Ring::new(smem::dynamic_smem_addr(), RS_TILE);
            let (mut w, items) = (0, stream_k().items(idx));
            // The consumers' work items: whole tiles, then stream-K pieces (K ranges), each read
            // from the work-item table ([`item`]).
            while w < items {
                let it = unsafe { item(idx, w) };
                w += 1;
                let (tile, a_row) = (it.tile, it.a_row);
                // Gives up once the rank aborted and the consumers stopped taking slots.
                // Consumers that stop early keep freeing slots: every tile is loaded.
                // With a stager, its trickle follows the count of free slots ([`Ring::tick`]).
                let count = stager_runs(a).then(|| ring.tick(0));
                let _ = unsafe { load_tile_counted::<true>(&ring, &mut pos, TensorMap(a.map_a as *const u8), a_row, TensorMap(a.map_b as *const u8), BLayout::Nk, tile, it.k0, it.k_len(), consumer_stall(ldesc()), count) };
            }
            // Consumers that stop early may leave fills unconsumed (also after this loop ended
            // normally): the CTA must not exit while they still land. Consumed ones pass at once.
            unsafe { wait_loads_landed(&ring, pos) };
        }
        return;
    }
    regs::setmaxnreg_inc::<{ RS_TILE.consumer_regs }>();
    if ids::block_idx_reread() < a.n_comm {
        if ids::thread_idx_reread() == crate::arch::ids::WARPGROUP_THREADS {
            unsafe { rs_comm_role(a) };
        }
        return;
    }
    let (wg, idx) = (ids::warpgroup_idx_reread(), compute_idx());
    let ring = Ring::new(smem::dynamic_smem_addr(), RS_TILE);
    // Only the tile loop's own state lives across the mainloop (next to 128 accumulators):
    // the context is re-read from the descriptor in each tile (volatile reads, so nothing
    // derived from it is hoisted out of the loop and kept live, which ptxas spills).
    let epoch = lepoch();
    let mut ready: u32 = 1 << unsafe { rank_world(ldesc()) }.0; // local ranks whose buffers we may write
    let mut acc = [0f32; 128];
    let mut pending = Pendings { older: None, newer: None };
    let mut trickle = Trickle::NONE;
    // The optional timeline (thread 0 of the first consumer warpgroup): this CTA's tile count.
    let mut traced = 0u32;
    let first = ids::thread_idx_reread() == crate::arch::ids::WARPGROUP_THREADS;
    let mark = |i: u32, m: Mark| if first { unsafe { trace::mark(a.trace, idx, i, m) } };
    // Work items: whole tiles, then (stream-K) K ranges of the last tiles, the first of which
    // may be a contributor piece (no epilogue: its partial goes to the workspace).
    // (Each read from the work-item table, [`item`].)
    let items = stream_k().items(idx);
    let mut w = 0u32;
    while w < items {
        let it = unsafe { item(idx, w) };
        w += 1;
        let tile = it.tile;
        mark(traced, Mark::Begin);
        // Read now by every thread, used at this tile's epilogue barrier: the load's register
        // is first read there, so its latency hides under the mainloop (read by the leader
        // alone and turned into a flag at once, the warpgroup waited for it here).
        let abort_word = unsafe { abort_word(ldesc()) };
        unsafe {
            let (rank, world) = rank_world(ldesc());
            if it.own && !it.stager && world > 1 {
                // The staging still holds the previous peer tile while its boxes trickle out
                // (uniform in the warpgroup): this tile then adds its first partial from global
                // memory too, rather than wait here for those NVLink stores.
                let staged = trickle.left == 0 && stage_first_partial(a, &ring, tile, wg, rank, world);
                if staged {
                    ready |= STAGED;
                } else {
                    ready &= !STAGED;
                }
                prefetch_partials(a, tile, rank, world, staged);
            }
            mark(traced, Mark::Mainloop);
            mma_tile_hooked::<true>(&ring, &mut pos, &mut acc, wg - 1, BLayout::Nk, it.k_len(), consumer_stall(ldesc()), &mut trickle);
            // (A short K leaves boxes over.)
            trickle.flush(&ring, wg - 1);
            mark(traced, Mark::MainloopDone);
            if first {
                let kind = if !it.owner { tile_kind::PIECE } else if it.own { tile_kind::OWN } else { tile_kind::PEER };
                trace::tile(a.trace, idx, traced, tile.m0 / TILE.block_m, tile.n0 / TILE.block_n, kind);
            }
            let stop = ids::thread_in_warpgroup() == 0 && abort_word != 0;
            let done = if it.owner {
                // A stream-K tile's earlier K ranges (other CTAs' first pieces) are added
                // first.
                // With stagers the epilogue is theirs: the tile's place comes from its record.
                (it.from == idx || add_sk_partials(a, epoch, it.from, idx, wg, &mut acc))
                    && if it.stager {
                        stager_epilogue(&ring, Tile { m0: it.local_m0, n0: tile.n0 }, wg, &mut acc, &mut ready, it.own, stop, |m| mark(traced, m))
                    } else {
                        rs_epilogue(a, epoch, &ring, tile, wg, &mut acc, &mut ready, &mut pending, &mut trickle, stop, |m| mark(traced, m))
                    }
            } else {
                // A stream-K contributor piece: to the workspace, for the tile's owner.
                write_sk_partial(a, epoch, idx, wg, &acc, |m| mark(traced, m));
                true
            };
            if !done {
                // A wait gave up or the rank aborted (the error record is written): stop, once
                // the bulk stores stopped reading shared memory and a staged partial's load
                // (always completes) has landed.
                drain_tma_stores();
                if ready & STAGED != 0 {
                    while !mbarrier::try_wait_parity(ring.aux(wg), (ready & STAGE_PARITY != 0) as u32) {}
                }
                // Keep freeing the ring's slots for this CTA's remaining work (without
                // computing): the producer and the other consumer warpgroup, which stops at its
                // next barrier (the abort word is up), run to the end.
                while w < items {
                    drain_tile(&ring, &mut pos, item(idx, w).k_len(), consumer_stall(ldesc()));
                    w += 1;
                }
                // AllReduce: both warpgroups vote once on barrier 3 before the completion wait
                // (the other may not have seen the abort yet).
                if a.all_reduce != 0 {
                    let _ = named_barrier_or(3, 2 * crate::arch::ids::WARPGROUP_THREADS, true);
                }
                return;
            }
        }
        mark(traced, Mark::Stored);
        traced += 1;
    }
    let end = |e: End| if first { unsafe { trace::end(a.trace, idx, e) } };
    let chunk_rows = a.m / unsafe { rank_world(ldesc()) }.1;
    end(End::LoopDone);
    let c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    let ct = ids::thread_idx_reread() - crate::arch::ids::WARPGROUP_THREADS;
    let stop = ids::thread_in_warpgroup() == 0 && unsafe { aborted(ldesc()) };
    unsafe { trickle.flush(&ring, wg - 1) };
    let published = unsafe { announce_older(&c, a, &mut pending, wg, stop) && announce_newer(&c, a, &mut pending, wg, stop) };
    drain_tma_stores();
    end(End::Drained);
    // AllReduce: every consumer warpgroup reaches this vote exactly once (also one that gave up
    // in its loop), so the completion wait below starts in both or in neither.
    let go_on = if a.all_reduce != 0 { !named_barrier_or(3, 2 * crate::arch::ids::WARPGROUP_THREADS, !published) } else { published };
    if !go_on {
        return;
    }
    if a.all_reduce != 0 {
        // The launch ends once every other rank's reduced rows are in our output: this CTA
        // waits for row tiles idx, idx + grid, ... of the own-node block of every local peer's
        // chunk (the remote ranks' PUTs: warp 3 of compute CTA 0).
        let (nodes, _, block_rows) = node_blocks(&c, a.m);
        let full = HALVES * a.n.div_ceil(TILE.block_n) as u64;
        let mut mt = (nodes - 1) * block_rows / TILE.block_m + idx;
        while mt < chunk_rows / TILE.block_m {
            let ok = ct >= c.world || ct == c.rank || unsafe { wait_flag_of_cta(&c, FlagSlot::Tile2, ct, mt, full) };
            if named_barrier_or(3, 2 * crate::arch::ids::WARPGROUP_THREADS, !ok) {
                return;
            }
            mt += ids::grid_dim() - a.n_comm;
        }
    }
    end(End::Done);
}

/// Before an own tile's mainloop: the peers' partial tiles it will add from global memory (all
/// but a staged first one) are pulled into L2
/// (each consumer thread prefetches two 128-byte lines of one row per peer), so the epilogue's
/// loads hit L2. The data has usually landed long before; a line prefetched early is still
/// coherent (remote stores go through this GPU's L2).
#[inline(always)]
unsafe fn prefetch_partials(a: &GemmRsArgs, tile: Tile, rank: u32, world: u32, first_staged: bool) {
    let ct = ids::thread_idx() - crate::arch::ids::WARPGROUP_THREADS;
    let chunk_rows = a.m / world;
    if a.pull != 0 {
        // The partials stay in the peers' memory: nothing to pull into L2 here.
        return;
    }
    let (row, half) = (tile.m0 - rank * chunk_rows + ct / 2, ct % 2);
    let col = tile.n0 + half * 128;
    if col >= a.n {
        return;
    }
    let slot_bytes = chunk_rows as u64 * a.n as u64 * 2;
    let local = unsafe { *(*(ldesc() as *const CommDesc)).heaps.as_ptr().add(rank as usize) };
    let at = local + a.recv_off + (row as u64 * a.n as u64 + col as u64) * 2;
    for src in 0..8u32 {
        if src < world && src != rank && !(first_staged && src == (rank + 1) % world) {
            let p = at + src as u64 * slot_bytes;
            unsafe {
                memory::prefetch_l2(p as *const u8);
                if col + 64 < a.n {
                    memory::prefetch_l2((p + 128) as *const u8);
                }
            }
        }
    }
}

/// Before an own tile's mainloop, the leader of each consumer warpgroup TMA-loads the first
/// peer's (`(rank + 1) % world`) partial of its 64 rows into the warpgroup's epilogue staging
/// ([`load_partial`]) if that peer's counter of the row tile is already full; `aux(wg)`
/// completes when it landed. It never waits for the counter (a wait here, before this tile's
/// epilogue announces the previous tile, could close a cycle between ranks); true (for every
/// thread of the warpgroup) when the load was issued, else the epilogue loads that partial.
#[inline(always)]
unsafe fn stage_first_partial(a: &GemmRsArgs, ring: &Ring, tile: Tile, wg: u32, rank: u32, world: u32) -> bool {
    let mut issued = false;
    if ids::thread_in_warpgroup() == 0 {
        let local_m0 = tile.m0 - rank * (a.m / world);
        let d = unsafe { &*(ldesc() as *const CommDesc) };
        let own_heap = unsafe { *d.heaps.as_ptr().add(rank as usize) };
        let counter = (own_heap + flag_offset(FlagSlot::Tile1, (rank + 1) % world, local_m0 / TILE.block_m)) as *const u64;
        if unsafe { memory::ld_acquire_u64(Scope::Sys, counter) } >= tile1_full(a) {
            unsafe { load_partial(ring, tile, wg, 0) };
            issued = true;
        }
    }
    // The warpgroup's epilogue barrier (id 1 + consumer index), with the leader's answer.
    named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, issued)
}

/// The leader of consumer warpgroup `wg` TMA-loads the partial of local peer `(rank + 1 +
/// step) % world` of its 64 rows of own tile `tile` into the warpgroup's whole-tile staging,
/// completing on `aux(wg)`: once this thread's earlier bulk stores finished reading the
/// staging, and after the caller's acquire of that peer's counter (the partial was written by
/// bulk stores and announced by a generic release: the load reads through the async proxy,
/// after `fence.proxy.async`). Pushed: from that peer's slot of our receive buffer (`map_in`
/// spans every slot); pulled (step 0 only): from its outbox over NVLink, at the tile's own row.
/// Everything else is re-read here (volatile), so a caller's loop keeps nothing of it live next
/// to the accumulators.
#[inline(always)]
unsafe fn load_partial(ring: &Ring, tile: Tile, wg: u32, step: u32) {
    let (rank, world) = unsafe { rank_world(ldesc()) };
    let a = largs() as *const GemmRsArgs;
    let (m, pull, map_in) = unsafe { ((&raw const (*a).m).read_volatile(), (&raw const (*a).pull).read_volatile(), (&raw const (*a).map_in).read_volatile()) };
    let chunk_rows = m / world;
    let bar = ring.aux(wg);
    memory::fence_proxy_async();
    tma::store_wait_read::<0>();
    unsafe { mbarrier::arrive_expect_tx(bar, RS_TILE.epilogue_buffers * RS_TILE.epilogue_box_bytes()) };
    let src = (rank + 1 + step) % world;
    let row0 = if pull != 0 { tile.m0 } else { src * chunk_rows + tile.m0 - rank * chunk_rows };
    let map = TensorMap(map_in as *const u8);
    for q in 0..RS_TILE.epilogue_buffers {
        unsafe { tma::load_2d(ring.staging(wg - 1, q), map, tile.n0 + GemmTile::EPILOGUE_BOX_COLS * q, row0 + (wg - 1) * TILE.rows_per_consumer(), bar) };
    }
}

/// Pushed partials of an own tile, after the first one's load was issued: while another peer's
/// partial is still to come, wait for the staged one, add it, and (once every thread read the
/// staging) load the next; the last one stays in the staging for the store pass.
#[inline(always)]
unsafe fn add_chained_partials(ring: &Ring, tile: Tile, wg: u32, acc: &mut [f32; 128], ready: &mut u32) {
    macro_rules! step {
        ($($step:literal)*) => {$(
            if $step + 1 < unsafe { rank_world(ldesc()) }.1 {
                unsafe {
                    wait_staged(ring, wg, ready);
                    add_staged_tile(ring, wg - 1, acc);
                }
                // Every thread's reads of the staging precede the next load into it.
                memory::fence_proxy_async_shared();
                sync::named_barrier_sync(wg, crate::arch::ids::WARPGROUP_THREADS);
                if ids::thread_in_warpgroup() == 0 {
                    unsafe { load_partial(ring, tile, wg, $step) };
                }
            }
        )*};
    }
    step!(1 2 3 4 5 6);
}

/// Waits for the staged partial's load on `aux(wg)` (the phase `ready` tracks) and flips the
/// tracked parity.
#[inline(always)]
unsafe fn wait_staged(ring: &Ring, wg: u32, ready: &mut u32) {
    let parity = (*ready & STAGE_PARITY != 0) as u32;
    while !unsafe { mbarrier::try_wait_parity(ring.aux(wg), parity) } {}
    *ready ^= STAGE_PARITY;
}

/// The epilogue of one tile of GEMM+ReduceScatter/AllReduce without stagers (both consumer
/// warpgroups; with stagers the tile loop calls [`stager_epilogue`]): announce the previous
/// tile, then store this one to its peer, or add the peers' partials (and, in the own node's
/// block, the other nodes' sums) and store the sum. False when a wait gave up (the error
/// record is written).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rs_epilogue(a: &GemmRsArgs, epoch: u64, ring: &Ring, tile: Tile, wg: u32, acc: &mut [f32; 128], ready: &mut u32, pending: &mut Pendings, trickle: &mut Trickle, stop: bool, mark: impl Fn(Mark)) -> bool {
    let c = unsafe { fused_ctx_at(ldesc(), epoch) };
    let c = &c;
    // Each consumer warpgroup handles its half of the tile on its own (its named barrier `wg`).
    let t = ids::thread_in_warpgroup();
    let chunk_rows = a.m / c.world;
    let dest = tile.m0 / chunk_rows;
    let local = Tile { m0: tile.m0 - dest * chunk_rows, n0: tile.n0 };
    let mt = local.m0 / TILE.block_m;
    unsafe {
        // The tile two back (its stores had two mainloops to complete); an own tile, which
        // waits below, first also the one before if another rank waits for it during the loop
        // (a peer partial or a node sum: every such tile is announced before any wait, so no
        // cycle between ranks; AllReduce's rows for the peers are awaited at the launch's end).
        if !announce_older(c, a, pending, wg, stop) {
            return false;
        }
        if dest == c.rank && pending.newer.is_some_and(|p| awaited_in_loop(c, a, p)) && !announce_newer(c, a, pending, wg, stop) {
            return false;
        }
        mark(Mark::Published);
        // AllReduce writes the own node's reduced rows into every local rank's output: their
        // FusedReady first.
        let (nodes, node, block_rows) = node_blocks(c, a.m);
        let j = local.m0 / block_rows;
        let need = if dest != c.rank && a.n_comm == 0 {
            1 << dest
        } else if dest == c.rank && a.all_reduce != 0 && j + 1 == nodes {
            (1u32 << c.world) - 1
        } else {
            0
        };
        if need & !*ready != 0 {
            let ok = t >= c.world || need & !*ready & (1 << t) == 0 || wait_flag_of_cta(c, FlagSlot::FusedReady, t, 0, c.epoch);
            if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, !ok) {
                return false;
            }
            *ready |= need;
        }
        if dest != c.rank {
            mark(Mark::Waited);
            if a.pull != 0 {
                // Into the outbox (local, the tile's own row), from where the peer's own tile
                // reads it over NVLink: this CTA's stores stay local.
                store_tile_tma(ring, TensorMap(a.map_outbox as *const u8), tile, wg - 1, acc);
            } else if a.n_comm == 0 && a.all_reduce == 0 {
                // Straight into this rank's slot of the peer's receive buffer (over NVLink):
                // staged now, stored box by box during the next mainloop ([`Trickle`]).
                store_tile_tma_to(ring, StagedOnly, local, wg - 1, acc, false);
                *trickle = Trickle { dest, m0: local.m0, n0: local.n0, left: RS_TILE.epilogue_buffers };
            } else if a.n_comm == 0 {
                // AllReduce: at once (its own tiles, which also cross NVLink from their
                // epilogues, ran slower with the peer tiles trickling: 2 x H200).
                store_tile_tma(ring, TensorMap(*a.map_recv.as_ptr().add(dest as usize) as *const u8), local, wg - 1, acc);
            } else {
                // Into the outbox (local, the tile's own row), from where the comm CTAs copy
                // the completed row tile to the peer.
                store_tile_tma(ring, TensorMap(a.map_outbox as *const u8), tile, wg - 1, acc);
            }
        } else {
            // Every peer's partial of this row tile has landed here.
            // (The first peer's counter was seen full if its partial is staged.)
            let staged = *ready & STAGED != 0;
            let seen = staged && t == (c.rank + 1) % c.world;
            let ok = t >= c.world || t == c.rank || seen || wait_flag_of_cta(c, FlagSlot::Tile1, t, mt, tile1_full(a));
            // Also where an own tile whose predecessor was not announced hears of an abort.
            if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, !ok || stop) {
                return false;
            }
            mark(Mark::Waited);
            // The partial left in the staging, added by the store below.
            let mut staged = staged;
            if a.pull == 0 && c.world > 1 {
                // Pushed: the peers' partials (rank + 1, rank + 2, ...) pass through the
                // staging one after another, each TMA-loaded from our receive buffer once the
                // one before is added (`ldmatrix`); the last one stays for the store pass.
                // Loads of the global partials from the registers' layout (32-bit pieces of
                // 8 rows per warp) were latency-bound behind this SM's NVLink traffic: ~10 us
                // per partial on 4 x H200, where a TMA load of it takes a few.
                if !staged && t == 0 {
                    load_partial(ring, tile, wg, 0);
                }
                staged = true;
                add_chained_partials(ring, tile, wg, acc, ready);
            } else {
                let at = (tile.m0 as u64 * a.n as u64 + local.n0 as u64) * 2;
                for src in 0..8u32 {
                    // The first peer's partial, when staged, is added by the store below.
                    if src < c.world && src != c.rank && !(staged && src == (c.rank + 1) % c.world) {
                        add_bf16_tile(acc, partials_of(c, a, src) + at, a.n, a.n - local.n0, wg - 1);
                    }
                }
            }
            if staged {
                // The staged partial has landed.
                wait_staged(ring, wg, ready);
                *ready &= !STAGED;
            }
            mark(Mark::Added);
            if j + 1 < nodes {
                // This node's sum of a remote rank's rows: to the stage (rows as in the chunk).
                store_tile_tma_to(ring, TensorMap(a.map_stage as *const u8), local, wg - 1, acc, staged);
            } else {
                if nodes > 1 {
                    // The other nodes' sums of our rows have landed once warp 3 arrived on the
                    // aux barrier (its acquire of their flags, then the barrier's release/acquire
                    // order our loads after the proxy's writes). Bounded by warp 3's wait.
                    while !mbarrier::try_wait_parity(ring.aux(0), 0) {}
                    let block_bytes = block_rows as u64 * a.n as u64 * 2;
                    let at = c.heap(c.rank) + a.xrecv_off + ((local.m0 - j * block_rows) as u64 * a.n as u64 + local.n0 as u64) * 2;
                    let mut nd = 0;
                    while nd < nodes {
                        if nd != node {
                            add_bf16_tile(acc, at + nd as u64 * block_bytes, a.n, a.n - local.n0, wg - 1);
                        }
                        nd += 1;
                    }
                }
                // To the output; AllReduce: with one bulk group into every local rank's output
                // (a peer's over NVLink).
                let outs = MapTable { maps: a.map_out.as_ptr(), count: if a.all_reduce != 0 { c.world } else { 1 } };
                store_tile_tma_to(ring, outs, Tile { m0: local.m0 - j * block_rows, n0: local.n0 }, wg - 1, acc, staged);
            }
        }
        pending.older = pending.newer.take();
        pending.newer = Some(Pending { dest, mt });
    }
    true
}

/// Whether each consumer warpgroup's epilogue I/O is handed to a stager thread
/// ([`stager_role`]; the host sets it on one node of 2 ranks, partials pushed by the compute
/// CTAs: no comm CTAs, not pulled). Elsewhere the consumers issue their bulk stores and
/// partial loads themselves.
#[inline(always)]
fn stager_runs(a: &GemmRsArgs) -> bool {
    // The host's choice, checked against what the stager assumes (one peer, one node, pushed).
    let d = ldesc() as *const CommDesc;
    let (world, global_world) = unsafe { ((&raw const (*d).world).read_volatile(), (&raw const (*d).global_world).read_volatile()) };
    a.stager != 0 && world == 2 && global_world == 2 && a.n_comm == 0 && a.pull == 0
}

/// This launch's stream-K plan ([`StreamK`]): `GemmRsArgs::sk_tiles` where stagers run (the
/// host sets it only there), none elsewhere. Read afresh (volatile) from the arguments' shared
/// copy at each call, so a loop that calls it keeps none of it live in registers.
#[inline(always)]
fn stream_k() -> StreamK {
    let a = largs() as *const GemmRsArgs;
    let field = |f: *const u32| unsafe { f.read_volatile() };
    let (m, n, k, n_comm) = unsafe { (field(&raw const (*a).m), field(&raw const (*a).n), field(&raw const (*a).k), field(&raw const (*a).n_comm)) };
    let on = unsafe { (&raw const (*a).sk_ws).read_volatile() != 0 && stager_runs(&*a) };
    let sk = if on { unsafe { field(&raw const (*a).sk_tiles) } } else { 0 };
    StreamK::new(m.div_ceil(TILE.block_m) * n.div_ceil(TILE.block_n), ids::grid_dim() - n_comm, k.div_ceil(TILE.block_k), sk)
}

/// A compute CTA's work item as both the producer and the consumers use it: the tile (in the
/// scheduler's node-blocked rows), its K blocks `k0..k1`, whether this CTA runs its epilogue
/// (and from which contributor CTA on, [`StreamK`]), and the row of A it reads.
#[derive(Clone, Copy)]
struct ItemRec {
    tile: Tile,
    k0: u32,
    k1: u32,
    owner: bool,
    from: u32,
    a_row: u32,
    /// The tile's rows are this rank's chunk (an own tile).
    own: bool,
    /// Stagers do this launch's epilogue I/O ([`stager_runs`]).
    stager: bool,
    /// The tile's first row inside its chunk (the destination rank's rows).
    local_m0: u32,
}

impl ItemRec {
    #[inline(always)]
    fn k_len(&self) -> u32 {
        self.k1 - self.k0
    }
}

/// Works out item `w` of compute CTA `idx` (the stream-K plan, the chunked scheduler and A's
/// source row; some 30 integer divisions), everything re-read from the shared copies.
#[inline(always)]
unsafe fn compute_item(idx: u32, w: u32) -> ItemRec {
    let a = unsafe { &*(largs() as *const GemmRsArgs) };
    let d = unsafe { &*(ldesc() as *const CommDesc) };
    let it = stream_k().item(idx, w);
    let (rank, world) = unsafe { rank_world(ldesc()) };
    let tiles = TileScheduler::new(a.m, a.n, TILE.block_m, TILE.block_n, a.group_m, idx, ids::grid_dim() - a.n_comm).chunked(world, rank, a.part_tiles_m);
    let tile = tiles.tile(it.tile);
    let (nodes, node) = (d.global_world / world, d.global_rank / world);
    // The scheduler walks node-blocked rows; A is read at the row they stand for.
    let a_row = rs_source_row(tile.m0, a.m, world, nodes, node);
    let chunk_rows = a.m / world;
    let dest = tile.m0 / chunk_rows;
    ItemRec { tile, k0: it.k0, k1: it.k1, owner: it.owner, from: it.from, a_row, own: dest == rank, stager: stager_runs(a), local_m0: tile.m0 - dest * chunk_rows }
}

/// Flag bits of a work-item record's word 4.
const REC_OWNER: u32 = 1;
const REC_OWN: u32 = 2;
const REC_STAGER: u32 = 4;

/// Record `w` of the work-item table (`GemmTile::item_table_offset`).
#[inline(always)]
fn item_slot(w: u32) -> smem::SmemAddr {
    smem::dynamic_smem_addr().add(RS_TILE.item_table_offset() + w * GemmTile::ITEM_RECORD_BYTES)
}

/// Fills the work-item table of this compute CTA (every thread of the CTA, before the role
/// split; a CTA barrier must follow): records `0..min(items, capacity)`.
#[inline(always)]
unsafe fn fill_item_table(idx: u32) {
    let items = stream_k().items(idx).min(RS_TILE.item_table_entries);
    let mut w = ids::thread_idx_reread();
    while w < items {
        let r = unsafe { compute_item(idx, w) };
        unsafe {
            smem::st_shared_v4(item_slot(w), [r.tile.m0, r.tile.n0, r.k0, r.k1]);
            let flags = if r.owner { REC_OWNER } else { 0 } | if r.own { REC_OWN } else { 0 } | if r.stager { REC_STAGER } else { 0 };
            smem::st_shared_v4(item_slot(w).add(16), [flags, r.from, r.a_row, r.local_m0]);
        }
        w += RS_TILE.threads();
    }
}

/// Item `w` (below the table's capacity) from the table.
#[inline(always)]
unsafe fn table_item(w: u32) -> ItemRec {
    let (x, y) = unsafe { (smem::ld_shared_v4(item_slot(w)), smem::ld_shared_v4(item_slot(w).add(16))) };
    ItemRec { tile: Tile { m0: x[0], n0: x[1] }, k0: x[2], k1: x[3], owner: y[0] & REC_OWNER != 0, from: y[1], a_row: y[2], own: y[0] & REC_OWN != 0, stager: y[0] & REC_STAGER != 0, local_m0: y[3] }
}

/// Item `w` of compute CTA `idx`: two shared-memory loads from the table, or worked out past
/// its capacity.
#[inline(always)]
unsafe fn item(idx: u32, w: u32) -> ItemRec {
    if w < RS_TILE.item_table_entries {
        unsafe { table_item(w) }
    } else {
        unsafe { compute_item(idx, w) }
    }
}

/// The workspace slot of consumer warpgroup `wg` of compute CTA `cta` (its stream-K partial).
#[inline(always)]
fn sk_slot(a: &GemmRsArgs, cta: u32, wg: u32) -> u64 {
    a.sk_ws + (cta * TILE.consumer_warpgroups + wg - 1) as u64 * SK_SLOT_BYTES
}

/// A contributor piece's end ([`StreamK`]): the warpgroup's f32 accumulators go to its
/// workspace slot (thread-major 16-byte pieces: every store coalesced), then its leader raises
/// `(StreamK, wg - 1, cta)` to the launch epoch (`st.release.gpu` after the warpgroup's
/// barrier orders every thread's stores before it).
#[inline(always)]
unsafe fn write_sk_partial(a: &GemmRsArgs, epoch: u64, cta: u32, wg: u32, acc: &[f32; 128], mark: impl Fn(Mark)) {
    unsafe { store_acc_f32(acc, sk_slot(a, cta, wg)) };
    mark(Mark::Waited);
    sync::named_barrier_sync(wg, crate::arch::ids::WARPGROUP_THREADS);
    if ids::thread_in_warpgroup() == 0 {
        let c = unsafe { fused_ctx_at(ldesc(), epoch) };
        unsafe { memory::st_release_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::StreamK, wg - 1, cta), epoch) };
    }
}

/// An owned stream-K tile's other K ranges: the leader waits (bounded, error record) for the
/// flags of contributor CTAs `from..cta` (written at their first piece, long done), then every
/// thread adds their partials (through L2) to its accumulators. False when a wait gave up.
#[inline(always)]
unsafe fn add_sk_partials(a: &GemmRsArgs, epoch: u64, from: u32, cta: u32, wg: u32, acc: &mut [f32; 128]) -> bool {
    let mut ok = true;
    if ids::thread_in_warpgroup() == 0 {
        let mut c = unsafe { fused_ctx_at(ldesc(), epoch) };
        c.cta = cta;
        let mut f = from;
        while ok && f < cta {
            ok = unsafe { wait_flag_of_cta(&c, FlagSlot::StreamK, wg - 1, f, epoch) };
            f += 1;
        }
    }
    if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, !ok) {
        return false;
    }
    let mut f = from;
    while f < cta {
        unsafe { add_acc_f32(acc, sk_slot(a, f, wg)) };
        f += 1;
    }
    true
}

/// The epilogue of a tile with a stager ([`stager_role`]): wait until the warpgroup's staging
/// is ready (`aux(wg)`: free, or holding the peer's partial of an own tile), write the tile
/// into it (an own tile: the partial added, `ldmatrix`), and tell the stager (`aux(wg + 2)`),
/// which stores and announces it. No bulk store or flag is touched here: the warpgroup goes
/// back to its tensor cores at once. False when the rank aborted.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn stager_epilogue(ring: &Ring, local: Tile, wg: u32, acc: &mut [f32; 128], ready: &mut u32, own: bool, stop: bool, mark: impl Fn(Mark)) -> bool {
    mark(Mark::Published);
    let parity = (*ready & STAGE_PARITY != 0) as u32;
    *ready ^= STAGE_PARITY;
    let desc = ldesc();
    // Bounded by the stager's own bounded waits: a failed one aborts the rank.
    let ok = unsafe {
        mbarrier::wait_parity_or(ring.aux(wg), parity, |stalled| {
            if stalled > fused_hung_ns(desc) {
                crate::arch::trap();
            }
            aborted(desc)
        })
    };
    if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, !ok || stop) {
        return false;
    }
    mark(Mark::Waited);
    mark(Mark::Added);
    // The staging's reads (an own tile's partial) and writes below are this warpgroup's; the
    // stager's earlier bulk stores had finished reading it before it arrived on `aux(wg)`.
    unsafe { store_tile_tma_to(ring, StagedOnly, local, wg - 1, acc, own) };
    if ids::thread_in_warpgroup() == 0 {
        unsafe { mbarrier::arrive(ring.aux(wg + 2)) };
    }
    true
}

/// What a stager's staging holds for the tile ahead: nothing in flight, told to its consumers.
const ARRIVED: u32 = 3;

/// Makes consumer warpgroup `cw`'s staging ready for `tile` (phase `parity` of `aux(1 + cw)`):
/// an own tile's peer partial is TMA-loaded into it (the caller saw the peer's counter full:
/// the partial was written by the peer's bulk stores and announced by a generic release, so
/// the load, through the async proxy, comes after `fence.proxy.async`); for a peer tile it
/// just arrives. Returns the stager's `loading` state: `parity` (a load in flight) or
/// [`ARRIVED`].
#[inline(always)]
unsafe fn stager_ready(cw: u32, tile: Tile, parity: u32) -> u32 {
    let a = unsafe { &*(largs() as *const GemmRsArgs) };
    let (rank, world) = unsafe { rank_world(ldesc()) };
    let chunk_rows = a.m / world;
    let ready = Ring::new(smem::dynamic_smem_addr(), RS_TILE).aux(1 + cw);
    if tile.m0 / chunk_rows != rank {
        unsafe { mbarrier::arrive(ready) };
        return ARRIVED;
    }
    memory::fence_proxy_async();
    unsafe { mbarrier::arrive_expect_tx(ready, RS_TILE.epilogue_buffers * RS_TILE.epilogue_box_bytes()) };
    let map = TensorMap(a.map_in as *const u8);
    let row0 = (rank + 1) % world * chunk_rows + (tile.m0 - rank * chunk_rows) + cw * TILE.rows_per_consumer();
    for q in 0..RS_TILE.epilogue_buffers {
        let dst = Ring::new(smem::dynamic_smem_addr(), RS_TILE).staging(cw, q);
        // Read once: first to leave L2.
        unsafe { tma::load_2d_hinted(dst, map, tile.n0 + GemmTile::EPILOGUE_BOX_COLS * q, row0, ready, tma::evict_first_policy()) };
    }
    parity
}

/// The stager of consumer warpgroup `cw` of compute CTA `idx` (lane 0 of producer warp
/// `1 + 2 cw`; [`stager_runs`]): the warpgroup's epilogue I/O, so its `wgmma` issue never
/// waits for NVLink. For each tile of the CTA, in the consumers' order:
/// 1. makes the staging ready (`aux(1 + cw)`, [`stager_ready`]): an own tile's peer partial
///    is TMA-loaded into it once the peer's counter `(Tile1, peer, mt)` is full (completing
///    the barrier with its bytes); for a peer tile it just arrives;
/// 2. waits until the consumers wrote the tile into it (`aux(3 + cw)`);
/// 3. issues its bulk stores (a peer tile: into this rank's slot of the peer's receive buffer;
///    an own tile: to the output, AllReduce: to every local rank's output) in pieces of
///    [`STAGER_STORE_ROWS`] rows; those that cross NVLink trickle as the consumers pass the K
///    blocks of their next mainloop, the local ones at once;
/// 4. waits until the stores are complete and announces the half tile locally
///    (`red.release.gpu` +1 on `(Outbox, dest, mt)`: a peer partial, or AllReduce's reduced
///    rows) for the relays.
///
/// Every tile is announced before the wait for a later tile's counter (the deadlock-freedom
/// rule of [`publish`], met early). Waits are bounded (error record, abort); on an abort it
/// stops once its stores and loads are done with the staging.
#[inline(always)]
unsafe fn stager_role(idx: u32, cw: u32) {
    // Only the loop's own state lives across it (56 registers): the context is rebuilt where
    // a wait needs it, the ring's addresses recomputed.
    let epoch = lepoch();
    let ctx = || {
        let mut c = unsafe { fused_ctx_at(ldesc(), epoch) };
        c.role = Role::Stager;
        c.cta = idx;
        c
    };
    let ring = || Ring::new(smem::dynamic_smem_addr(), RS_TILE);
    let give_up = |stalled: u64| {
        if stalled > unsafe { fused_hung_ns(ldesc()) } {
            crate::arch::trap();
        }
        unsafe { aborted(ldesc()) }
    };
    // The phase of `ready` whose TMA load may still land (NONE, ARRIVED: none), waited for
    // before stopping.
    const NONE: u32 = 2;
    let mut loading = NONE;
    let (mut w, mut parity) = (0u32, 0u32);
    // The peer's receive buffer and output are open.
    let mut ok = unsafe {
        let (rank, world) = rank_world(ldesc());
        wait_flag_of_cta(&ctx(), FlagSlot::FusedReady, (rank + 1) % world, 0, epoch)
    };
    while ok && w < stream_k().items(idx) {
        // The consumers' work item `w` (from the work-item table: the host runs stagers only
        // where every item fits it). A stream-K contributor piece has no epilogue.
        let a = unsafe { &*(largs() as *const GemmRsArgs) };
        let it = unsafe { table_item(w) };
        w += 1;
        if !it.owner {
            continue;
        }
        // 1. The staging, ready for this tile.
        {
            let (rank, world) = unsafe { rank_world(ldesc()) };
            let chunk_rows = a.m / world;
            let dest = it.tile.m0 / chunk_rows;
            let mt = (it.tile.m0 - dest * chunk_rows) / TILE.block_m;
            // (The peer is `rank ^ 1`: stagers run on 2 ranks only. Read again where the wait
            // uses it, the flag's address and the error record: kept across the wait, ptxas
            // spilled it.)
            let c = ctx();
            if dest == rank && !unsafe { wait_flag_of_cta_from::<RELAY_SLEEP_NS>(&c, FlagSlot::Tile1, |c| c.rank_now() ^ 1, mt, tile1_full(a)) } {
                break;
            }
            // (The tile read again: kept across the wait, ptxas spilled.)
            loading = unsafe { stager_ready(cw, table_item(w - 1).tile, parity) };
        }
        let staged = ring().aux(3 + cw);
        // 2. The consumers' tile in the staging.
        // (Sleeping between tests: this thread shares its SM with the tensor cores' issue.)
        ok = unsafe { mbarrier::wait_parity_sleeping_or::<RELAY_SLEEP_NS>(staged, parity, give_up) };
        if !ok {
            break;
        }
        loading = NONE;
        parity ^= 1;
        // 3. Its bulk stores, piece by piece ([`STAGER_STORE_ROWS`] rows of one staging box).
        // Those that cross NVLink (a peer's partial, AllReduce's reduced rows) trickle when
        // more work follows: piece p of P once the consumers reach K block (2p + 1) k / 2P of
        // their next mainloop (k K blocks; before an own tile, whose peer partial is loaded
        // into the staging once these stores are complete, over its first half, so the load
        // lands before its epilogue). A burst of every CTA's tile at once held up the next
        // mainloop's loads; paced by time instead, every mainloop took 5-13% more cycles on
        // 2 x H200.
        // Everything but the loop's counters is derived again for each piece (from the shared
        // copies and the item table): kept live across the loop it does not fit in the
        // stager's 56 registers.
        const PIECES: u32 = GemmTile::EPILOGUE_BOX_ROWS / STAGER_STORE_ROWS * RS_TILE.epilogue_buffers;
        // An own AllReduce tile's copy into this rank's output crosses no NVLink: issued at
        // once, one group (than trickled with the peers' copies: -0.7% at M = 4096 on 2 x H200);
        // only the copies for the peers trickle.
        let local_at_once = {
            let a = unsafe { &*(largs() as *const GemmRsArgs) };
            let (rank, world) = unsafe { rank_world(ldesc()) };
            a.all_reduce != 0 && unsafe { table_item(w - 1) }.tile.m0 / (a.m / world) == rank
        };
        if local_at_once {
            let a = unsafe { &*(largs() as *const GemmRsArgs) };
            let (rank, world) = unsafe { rank_world(ldesc()) };
            let tile = unsafe { table_item(w - 1) }.tile;
            let local = Tile { m0: tile.m0 - rank * (a.m / world), n0: tile.n0 };
            let map = unsafe { *a.map_out.as_ptr().add(rank as usize) };
            for q in 0..PIECES {
                let (b, r) = (q / (PIECES / RS_TILE.epilogue_buffers), q % (PIECES / RS_TILE.epilogue_buffers));
                let src = ring().staging(cw, b).add(r * STAGER_STORE_ROWS * GemmTile::EPILOGUE_BOX_COLS * 2);
                unsafe { stager_store(TensorMap(map as *const u8), local.n0 + GemmTile::EPILOGUE_BOX_COLS * b, local.m0 + cw * TILE.rows_per_consumer() + r * STAGER_STORE_ROWS, src) };
            }
            tma::store_commit();
        }
        let mut p = 0;
        while p < PIECES {
            let a = unsafe { &*(largs() as *const GemmRsArgs) };
            let (rank, world) = unsafe { rank_world(ldesc()) };
            let chunk_rows = a.m / world;
            let tile = unsafe { table_item(w - 1) }.tile;
            let dest = tile.m0 / chunk_rows;
            let local = Tile { m0: tile.m0 - dest * chunk_rows, n0: tile.n0 };
            let sk = stream_k();
            if (dest != rank || a.all_reduce != 0) && w < sk.items(idx) {
                // The consumers compute K block x of the launch once they released block
                // x - 1, i.e. once the producer found x + stages slots free (the last loads'
                // slots are never waited for: capped).
                let next = unsafe { table_item(w) };
                let spread = if next.tile.m0 / chunk_rows == rank { 4 * PIECES } else { 2 * PIECES };
                let x = sk.k_before(idx, w) + (2 * p + 1) * next.k_len() / spread;
                if !unsafe { wait_tick(ring().tick(0), (x + RS_TILE.stages).min(sk.k_total(idx)), give_up) } {
                    ok = false;
                    break;
                }
            }
            let dests = if dest != rank { 1 } else if a.all_reduce != 0 { world } else { 1 };
            let (q, r) = (p / (PIECES / RS_TILE.epilogue_buffers), p % (PIECES / RS_TILE.epilogue_buffers));
            for d in 0..dests {
                if local_at_once && d == rank {
                    continue;
                }
                let map = unsafe { if dest != rank { *a.map_recv.as_ptr().add(dest as usize) } else { *a.map_out.as_ptr().add(d as usize) } };
                let src = ring().staging(cw, q).add(r * STAGER_STORE_ROWS * GemmTile::EPILOGUE_BOX_COLS * 2);
                unsafe { stager_store(TensorMap(map as *const u8), local.n0 + GemmTile::EPILOGUE_BOX_COLS * q, local.m0 + cw * TILE.rows_per_consumer() + r * STAGER_STORE_ROWS, src) };
            }
            tma::store_commit();
            p += 1;
        }
        if !ok {
            break;
        }
        // 4. Complete: announced (the tile derived again, as above).
        tma::store_wait::<0>();
        memory::fence_proxy_async();
        let a = unsafe { &*(largs() as *const GemmRsArgs) };
        let (rank, world) = unsafe { rank_world(ldesc()) };
        let chunk_rows = a.m / world;
        let tile = unsafe { table_item(w - 1) }.tile;
        let dest = tile.m0 / chunk_rows;
        if dest != rank || a.all_reduce != 0 {
            let mt = (tile.m0 - dest * chunk_rows) / TILE.block_m;
            unsafe { memory::red_release_add_u64(Scope::Gpu, ctx().flag_of_cta(rank, FlagSlot::Outbox, dest, mt), 1) };
        }
    }
    // Stopping early: nothing may still read or fill the staging when the CTA exits.
    tma::store_wait::<0>();
    if loading < NONE {
        unsafe { mbarrier::wait_parity(ring().aux(1 + cw), loading) };
    }
    let a = unsafe { &*(largs() as *const GemmRsArgs) };
    unsafe { trace::end(a.trace, idx, if cw == 0 { End::Stager0Done } else { End::Stager1Done }) };
}

/// A stager's bulk store (a peer's partial, an output tile): nothing reads it again soon (a
/// partial only rounds later, at its owner), so its lines are the first to leave L2, ahead of
/// the operands the mainloops still read (AllReduce at M = 4096 on 2 x H200: -1.7% with the
/// partial loads' and B's policies, docs/fused.md).
#[inline(always)]
unsafe fn stager_store(map: TensorMap, c0: u32, c1: u32, src: smem::SmemAddr) {
    unsafe { tma::store_2d_hinted(map, c0, c1, src, tma::evict_first_policy()) };
}

/// Waits (sleeping between polls) until a tick counter ([`Ring::tick`]) reached `target`;
/// false when `give_up` says so.
#[inline(always)]
unsafe fn wait_tick(tick: smem::SmemAddr, target: u32, give_up: impl Fn(u64) -> bool) -> bool {
    crate::arch::time::poll_until::<RELAY_SLEEP_NS>(1024, || unsafe { smem::ld_volatile_shared_u32(tick) } >= target, give_up)
}

/// Pulled: where local rank `src`'s partials for this rank's own tiles lie (its outbox, rows x
/// N bf16 over NVLink, indexed by the tiles' own rows).
#[inline(always)]
fn partials_of(c: &CommCtx, a: &GemmRsArgs, src: u32) -> u64 {
    c.heap(src) + a.outbox_off
}

/// The value of a full `(Tile1, src, row tile)`: src's comm CTAs each add 1 for their slice;
/// without comm CTAs, src's compute CTAs add 1 per half tile.
#[inline(always)]
fn tile1_full(a: &GemmRsArgs) -> u64 {
    if a.n_comm == 0 { HALVES * a.n.div_ceil(TILE.block_n) as u64 } else { a.n_comm as u64 }
}

/// Announcements per tile: each consumer warpgroup announces its half (rows) on its own, so
/// a full count is this many times the tiles.
const HALVES: u64 = TILE.consumer_warpgroups as u64;

/// The GEMM+ReduceScatter/AllReduce launch's copy of its `CommDesc` in shared memory, as a
/// generic address (written by thread 0 before the role split; `GemmTile::desc_copy_offset`).
#[inline(always)]
fn ldesc() -> u64 {
    smem::dynamic_smem() as u64 + RS_TILE.desc_copy_offset() as u64
}

/// The launch's copy of its `GemmRsArgs` in shared memory, as a generic address (written by
/// thread 0 before the role split; `GemmTile::args_copy_offset`).
#[inline(always)]
fn largs() -> u64 {
    smem::dynamic_smem() as u64 + RS_TILE.args_copy_offset() as u64
}

/// The launch epoch, from its shared-memory copy (written at setup by thread 0; volatile:
/// re-read wherever called).
#[inline(always)]
fn lepoch() -> u64 {
    unsafe { ((smem::dynamic_smem() as u64 + RS_TILE.epoch_copy_offset() as u64) as *const u64).read_volatile() }
}

/// `(rank, world)` read from the descriptor (volatile: re-read wherever called).
#[inline(always)]
unsafe fn rank_world(desc: u64) -> (u32, u32) {
    let d = desc as *const CommDesc;
    unsafe { ((&raw const (*d).rank).read_volatile(), (&raw const (*d).world).read_volatile()) }
}

/// The fused launch context with a known epoch (re-read from the descriptor in each epilogue).
#[inline(always)]
unsafe fn fused_ctx_at(desc: u64, epoch: u64) -> CommCtx {
    let mut c = unsafe { CommCtx::with_epoch(desc as *const CommDesc, 0, Role::Compute, epoch) };
    c.epoch_seq = mkernel_config::comm::fifo::EPOCH_SEQ_FUSED;
    c
}

/// Whether a finished tile is announced (by [`publish`] at the next tile's epilogue): peer
/// partials, AllReduce's rows for the local peers, every own tile across nodes. An own
/// ReduceScatter tile on one node concerns nobody else.
#[inline(always)]
fn announced(c: &CommCtx, a: &GemmRsArgs, p: Pending) -> bool {
    p.dest != c.rank || c.global_world > c.world || (a.all_reduce != 0 && c.world > 1)
}

/// Consumer warpgroup `wg`'s announcement of its half of a pending tile, once its leader's
/// bulk stores of it completed (at most `NEWER_GROUPS` newer groups in flight; `red.release.gpu`,
/// +1 each, all local): a peer's partial counts in `(Outbox, peer, mt)` (the comm CTAs copy a
/// row tile on once it is full; without them the relay warps raise `(Tile1, rank, mt)` at the
/// peer: pushed, the partial is there; pulled, the peer may read it from our outbox); an own
/// AllReduce tile of the own node's block in `(Outbox, rank, mt)` (the relays raise
/// `(Tile2, rank, mt)` at every local peer: [`relay_role`]); across nodes an own tile also in
/// its block's `NodeSum`, which the block's sender warp waits for ([`send_node_block`]). The
/// warpgroup's barrier also ORs `stop` (the rank aborted, read by the leader at the tile's
/// start): false then, and the warpgroup stops.
#[inline(always)]
unsafe fn publish<const NEWER_GROUPS: u32>(c: &CommCtx, a: &GemmRsArgs, p: Pending, wg: u32, stop: bool) -> bool {
    let leader = ids::thread_in_warpgroup() == 0;
    if leader {
        tma::store_wait::<NEWER_GROUPS>();
        memory::fence_proxy_async();
    }
    if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, stop) {
        return false;
    }
    if !leader {
        return true;
    }
    let (nodes, _, block_rows) = node_blocks(c, a.m);
    let j = p.mt * TILE.block_m / block_rows;
    unsafe {
        // Counted locally (a release at GPU scope: ~1 us where one at system scope stalled the
        // warpgroup ~4.5 us per tile); comm CTAs or the relay warps carry it to the peers.
        if p.dest != c.rank || (a.all_reduce != 0 && j + 1 == nodes && c.world > 1) {
            memory::red_release_add_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::Outbox, p.dest, p.mt), 1);
        }
        if p.dest != c.rank {
            return true;
        }
        if nodes > 1 && (j + 1 < nodes || a.all_reduce != 0) {
            memory::red_release_add_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::NodeSum, c.rank, j), 1);
        }
    }
    true
}

/// Whether the compute CTAs' relay warps run: some local peer waits for a flag that the
/// compute CTAs count locally (`Outbox`) and no comm CTA carries - peer partials without comm
/// CTAs, AllReduce's reduced rows.
#[inline(always)]
fn relays_run(a: &GemmRsArgs) -> bool {
    let d = unsafe { &*(ldesc() as *const CommDesc) };
    d.world > 1 && (a.n_comm == 0 || a.all_reduce != 0)
}

/// The relay (lane 0 of warp 2 of compute CTA `idx`'s producer warpgroup): turns full local
/// `(Outbox, d, row tile)` counters into the peers' flags, so the consumers' announcements stay
/// GPU-scope releases and the system-scope ones stall this otherwise idle warp instead.
/// Items, in the order the row tiles complete ([`TileScheduler::chunked`]: per segment g the
/// peers' row tiles of part g, chunk `rank + 1` first, then AllReduce's own row tiles of part
/// g - 1 in the own node's block), go round-robin to the compute CTAs' relays:
/// - a peer row tile (without comm CTAs): once full (every half tile stored into d's receive
///   buffer, or pulled: into our outbox) and d's `FusedReady` is here, `(Tile1, rank, mt)` at d
///   is raised by the full count;
/// - an own AllReduce row tile: once full (stored into every local rank's output),
///   `(Tile2, rank, mt)` at every local peer.
/// The release is cumulative: the consumers' releases of the local counter, which this
/// thread's acquire saw, order their completed stores before the peer's flag. Deadlock-free
/// like the comm CTAs' walk: an item of part g waits only for tiles whose waits concern parts
/// below g, and each relay takes its items in part order. Bounded waits (error record; the
/// relay stops on abort).
#[inline(always)]
unsafe fn relay_role(a: &GemmRsArgs, idx: u32) {
    let mut c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    c.role = Role::Relay;
    c.cta = idx;
    let c = &c;
    let relays = ids::grid_dim() - a.n_comm;
    let (rank, world) = (c.rank, c.world);
    let part = a.part_tiles_m;
    let parts = a.m / world / TILE.block_m / part;
    let full = HALVES * a.n.div_ceil(TILE.block_n) as u64;
    let (nodes, _, block_rows) = node_blocks(c, a.m);
    let own_from = (nodes - 1) * block_rows / TILE.block_m;
    // Every peer opened its buffers (`FusedReady`, raised at the start of its launch): only
    // then may its counters be raised.
    let mut q = 0;
    while q < world {
        if q != rank && !unsafe { wait_flag_of_cta(c, FlagSlot::FusedReady, q, 0, c.epoch) } {
            return;
        }
        q += 1;
    }
    // This relay's items: idx, idx + relays, ... of the walk, decoded per segment.
    let mut item = idx;
    let (mut seg_start, mut g) = (0u32, 0u32);
    while g <= parts {
        let peer_items = if g < parts && a.n_comm == 0 { (world - 1) * part } else { 0 };
        let own_first = if g >= 1 { ((g - 1) * part).max(own_from) } else { 0 };
        let own_items = if g >= 1 && a.all_reduce != 0 { (g * part).saturating_sub(own_first) } else { 0 };
        while item < seg_start + peer_items + own_items {
            let off = item - seg_start;
            let (dest, mt) = if off < peer_items { ((rank + 1 + off / part) % world, g * part + off % part) } else { (rank, own_first + off - peer_items) };
            if !unsafe { relay_item(c, dest, mt, full) } {
                return;
            }
            item += relays;
        }
        seg_start += peer_items + own_items;
        g += 1;
    }
}

/// One relay item (see [`relay_role`]): `dest` = the peer of a partial row tile, or this rank
/// for an own AllReduce row tile. False when the wait gave up.
#[inline(always)]
unsafe fn relay_item(c: &CommCtx, dest: u32, mt: u32, full: u64) -> bool {
    // The local counter fills as this rank's compute CTAs finish the row tile, which wait
    // (bounded) on the peers: twice the timeout here, so a stalled peer is reported by the
    // wait that names it rather than by this one naming our own counter.
    let mut patient = *c;
    patient.timeout_ns = c.timeout_ns.saturating_mul(2);
    unsafe {
        if !wait_flag_of_cta_sleeping::<RELAY_SLEEP_NS>(&patient, FlagSlot::Outbox, dest, mt, full) {
            return false;
        }
        let mut q = 0;
        while q < c.world {
            if q != c.rank && (dest == c.rank || q == dest) {
                let slot = if dest == c.rank { FlagSlot::Tile2 } else { FlagSlot::Tile1 };
                memory::red_release_add_u64(Scope::Sys, (c.heap(q) + flag_offset(slot, c.rank, mt)) as *mut u64, full);
            }
            q += 1;
        }
    }
    true
}

/// Between a relay's polls of a counter that is not full yet.
const RELAY_SLEEP_NS: u32 = 200;

/// Node blocks whose PUTs this rank posts: across nodes the `nodes - 1` other nodes' blocks, and
/// for AllReduce also the own one; none on one node.
#[inline(always)]
fn node_blocks_to_send(a: &GemmRsArgs) -> u32 {
    let d = unsafe { &*(ldesc() as *const CommDesc) };
    let nodes = d.global_world / d.world;
    if nodes == 1 { 0 } else if a.all_reduce != 0 { nodes } else { nodes - 1 }
}

/// The sender of node block `j` (one thread): waits until every tile of the block is stored
/// (its `NodeSum` counter is full), then posts the block's PUT(s) ([`put_node_block`]). A
/// failed wait or post leaves the error record; the receivers' waits then end too.
#[inline(always)]
unsafe fn send_node_block(a: &GemmRsArgs, j: u32) {
    let mut c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    c.role = Role::InterSend;
    c.cta = j;
    // The counter fills as this rank computes the block, which waits (bounded) on its peers: twice
    // the timeout for it, so a stalled peer is reported by the wait that names it.
    let mut patient = c;
    patient.timeout_ns = c.timeout_ns.saturating_mul(2);
    let (_, _, block_rows) = node_blocks(&c, a.m);
    let block_tiles = HALVES * (block_rows / TILE.block_m * a.n.div_ceil(TILE.block_n)) as u64;
    unsafe {
        if wait_flag_of_cta(&patient, FlagSlot::NodeSum, c.rank, j, block_tiles) {
            let _ = put_node_block(&c, a, j);
        }
    }
}

/// Posts the proxy PUT(s) of this rank's completed node block `j` (every tile of it stored):
/// `j < nodes - 1`: the node's sum of rail peer `(node + 1 + j) % nodes`'s rows, from the stage
/// into that rank's remote receive block of this node (`FusedData`); `j = nodes - 1`
/// (AllReduce): the reduced rows of this rank's chunk, into every remote rank's output
/// (`FusedOut`). Each destination's buffer is free once its remote `FusedReady` arrived.
#[inline(always)]
unsafe fn put_node_block(c: &CommCtx, a: &GemmRsArgs, j: u32) -> bool {
    let (nodes, node, block_rows) = node_blocks(c, a.m);
    let block_bytes = block_rows as u64 * a.n as u64 * 2;
    unsafe {
        if j + 1 < nodes {
            let dst = (node + 1 + j) % nodes * c.world + c.rank;
            if !proxy::wait_remote(c, RemoteSlot::FusedReady, dst) {
                return false;
            }
            let (src_off, dst_off) = (a.stage_off + j as u64 * block_bytes, a.xrecv_off + node as u64 * block_bytes);
            return proxy::put_value(c, dst, src_off, dst_off, block_bytes, RemoteSlot::FusedData, c.epoch).is_some();
        }
        let off = a.out_off + c.global_rank as u64 * block_bytes;
        for q in 0..c.global_world {
            if q / c.world != node && (!proxy::wait_remote(c, RemoteSlot::FusedReady, q) || proxy::put_value(c, q, off, off, block_bytes, RemoteSlot::FusedOut, c.epoch).is_none()) {
                return false;
            }
        }
    }
    true
}

/// Named barrier `id` among `threads` threads that also ORs `pred` over them:
/// `barrier.red.or.pred q, id, threads, p;`
#[inline(always)]
fn named_barrier_or(id: u32, threads: u32, pred: bool) -> bool {
    let r: u32;
    unsafe {
        core::arch::asm!(
            "{{ .reg .pred p, q; setp.ne.u32 p, {2}, 0; barrier.red.or.pred q, {0}, {1}, p; selp.u32 {3}, 1, 0, q; }}",
            in(reg32) id, in(reg32) threads, in(reg32) pred as u32, out(reg32) r, options(nostack)
        )
    };
    r != 0
}
