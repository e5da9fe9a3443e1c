//! GEMM+ReduceScatter/AllReduce (`mk_gemm_rs_bf16_nk`): the launch's setup, the role split and
//! the compute CTAs' tile loop, the comm CTAs, the counters' zeroing, and the shared copies of
//! the arguments and the descriptor every role reads.
use super::*;

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
pub(super) unsafe fn rs_comm_role(a: &GemmRsArgs) {
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
                    dsts[0] =
                        c.heap(dest) + a.recv_off + (rank * chunk_rows + mt * TILE.block_m) as u64 * row_bytes + first;
                    let mut flags = [0u64; 8];
                    flags[0] = c.heap(dest) + flag_offset(FlagSlot::Tile1, rank, mt);
                    // Raised once these stores are complete, while the next slices stream.
                    ring.copy_deferred(
                        &dsts,
                        1,
                        c.heap(rank)
                            + a.outbox_off
                            + (dest * chunk_rows + mt * TILE.block_m) as u64 * row_bytes
                            + first,
                        len,
                        Release { flags, n: 1, add: 1 },
                    );
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
pub(super) unsafe fn open_receive_buffers(c: &CommCtx, a: &GemmRsArgs) {
    let t = ids::thread_idx();
    unsafe { zero_counters(c, a, t, ids::block_dim(), false) };
    sync::sync_threads();
    if t < c.world && t != c.rank {
        unsafe {
            memory::st_release_u64(
                Scope::Sys,
                (c.heap(t) + flag_offset(FlagSlot::FusedReady, c.rank, 0)) as *mut u64,
                c.epoch,
            )
        };
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
pub(super) unsafe fn zero_counters(c: &CommCtx, a: &GemmRsArgs, t: u32, nt: u32, outbox: bool) {
    let row_tiles = a.m / c.world / TILE.block_m;
    let base = c.heap(c.rank);
    let zero = |slot: FlagSlot, src: u32, mt: u32| unsafe {
        memory::st_relaxed_u64(Scope::Gpu, (base + flag_offset(slot, src, mt)) as *mut u64, 0)
    };
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
pub(super) unsafe fn finish_reduce_launch(c: &CommCtx, a: &GemmRsArgs, lane: u32, lanes: u32) {
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
pub(super) const RS_TILE: GemmTile = GemmTile::FUSED_RS;
/// Bits of a consumer's `ready` word above the local ranks' `FusedReady` bits: the current own
/// tile's first peer partial is staged; the parity of the next staged phase of `aux(wg)`.
pub(super) const STAGED: u32 = 1 << 29;
pub(super) const STAGE_PARITY: u32 = 1 << 30;

/// Node geometry of a launch: `(nodes, node, rows of one node block = M / global_world)`.
#[inline(always)]
pub(super) fn node_blocks(c: &CommCtx, m: u32) -> (u32, u32, u32) {
    (c.global_world / c.world, c.global_rank / c.world, m / c.global_world)
}

#[inline(always)]
pub(super) unsafe fn rs_roles(args: *const GemmRsArgs, desc: *const CommDesc, entered: u64) {
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
    let epoch = if ids::thread_idx_reread() == 0 {
        unsafe { launch_epoch(&fused_ctx_at(ldesc(), 0)) }
    } else {
        0
    };
    if ids::block_idx_reread() >= a.n_comm {
        unsafe { fill_item_table(ids::block_idx_reread() - a.n_comm) };
    }
    if ids::thread_idx_reread() == 0 {
        unsafe {
            ((smem::dynamic_smem() as u64 + RS_TILE.epoch_copy_offset() as u64) as *mut u64).write_volatile(epoch)
        };
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
                    unsafe {
                        memory::st_release_u64(
                            Scope::Gpu,
                            c.flag_of_cta(c.rank, FlagSlot::FusedReady, c.rank, 1),
                            c.epoch,
                        )
                    };
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
                // Consumers that stop early keep freeing slots: every item's slots are filled -
                // once the rank aborted, without data (an aborted launch does not stream its
                // operands; the consumers stop at their next epilogue barrier).
                // With a stager, its trickle follows the count of free slots ([`Ring::tick`]).
                let count = stager_runs(a).then(|| ring.tick(0));
                if unsafe { abort_word(ldesc()) } != 0 {
                    let _ = unsafe { fill_without_data(&ring, &mut pos, it.k_len(), producer_stall(ldesc())) };
                    continue;
                }
                let _ = unsafe {
                    load_tile_counted::<true>(
                        &ring,
                        &mut pos,
                        TensorMap(a.map_a as *const u8),
                        a_row,
                        TensorMap(a.map_b as *const u8),
                        BLayout::Nk,
                        tile,
                        it.k0,
                        it.k_len(),
                        producer_stall(ldesc()),
                        count,
                    )
                };
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
    let mut pending = Pendings {
        older: None,
        newer: None,
    };
    let mut trickle = Trickle::NONE;
    // The optional timeline (thread 0 of the first consumer warpgroup): this CTA's tile count.
    let mut traced = 0u32;
    let first = ids::thread_idx_reread() == crate::arch::ids::WARPGROUP_THREADS;
    let mark = |i: u32, m: Mark| {
        if first {
            unsafe { trace::mark(a.trace, idx, i, m) }
        }
    };
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
            mma_tile_hooked::<true>(
                &ring,
                &mut pos,
                &mut acc,
                wg - 1,
                BLayout::Nk,
                it.k_len(),
                consumer_stall(ldesc()),
                &mut trickle,
            );
            // (A short K leaves boxes over.)
            trickle.flush(&ring, wg - 1);
            mark(traced, Mark::MainloopDone);
            if first {
                let kind = if !it.owner {
                    tile_kind::PIECE
                } else if it.own {
                    tile_kind::OWN
                } else {
                    tile_kind::PEER
                };
                trace::tile(
                    a.trace,
                    idx,
                    traced,
                    tile.m0 / TILE.block_m,
                    tile.n0 / TILE.block_n,
                    kind,
                );
            }
            let stop = ids::thread_in_warpgroup() == 0 && abort_word != 0;
            let done = if it.owner {
                // A stream-K tile's earlier K ranges (other CTAs' first pieces) are added
                // first.
                // With stagers the epilogue is theirs: the tile's place comes from its record.
                (it.from == idx || add_sk_partials(a, epoch, it.from, idx, wg, &mut acc))
                    && if it.stager {
                        stager_epilogue(
                            &ring,
                            Tile {
                                m0: it.local_m0,
                                n0: tile.n0,
                            },
                            wg,
                            &mut acc,
                            &mut ready,
                            it.own,
                            stop,
                            |m| mark(traced, m),
                        )
                    } else {
                        rs_epilogue(
                            a,
                            epoch,
                            &ring,
                            tile,
                            wg,
                            &mut acc,
                            &mut ready,
                            &mut pending,
                            &mut trickle,
                            stop,
                            |m| mark(traced, m),
                        )
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
                    let parity = (ready & STAGE_PARITY != 0) as u32;
                    let _ = wait_mbarrier(ring.aux(wg), parity, ldesc(), Role::Compute, wait_code::STAGING, wg);
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
    let end = |e: End| {
        if first {
            unsafe { trace::end(a.trace, idx, e) }
        }
    };
    let chunk_rows = a.m / unsafe { rank_world(ldesc()) }.1;
    end(End::LoopDone);
    let c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    let ct = ids::thread_idx_reread() - crate::arch::ids::WARPGROUP_THREADS;
    let stop = ids::thread_in_warpgroup() == 0 && unsafe { aborted(ldesc()) };
    unsafe { trickle.flush(&ring, wg - 1) };
    let published =
        unsafe { announce_older(&c, a, &mut pending, wg, stop) && announce_newer(&c, a, &mut pending, wg, stop) };
    drain_tma_stores();
    end(End::Drained);
    // AllReduce: every consumer warpgroup reaches this vote exactly once (also one that gave up
    // in its loop), so the completion wait below starts in both or in neither.
    let go_on = if a.all_reduce != 0 {
        !named_barrier_or(3, 2 * crate::arch::ids::WARPGROUP_THREADS, !published)
    } else {
        published
    };
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

/// Pulled: where local rank `src`'s partials for this rank's own tiles lie (its outbox, rows x
/// N bf16 over NVLink, indexed by the tiles' own rows).
#[inline(always)]
pub(super) fn partials_of(c: &CommCtx, a: &GemmRsArgs, src: u32) -> u64 {
    c.heap(src) + a.outbox_off
}

/// The value of a full `(Tile1, src, row tile)`: src's comm CTAs each add 1 for their slice;
/// without comm CTAs, src's compute CTAs add 1 per half tile.
#[inline(always)]
pub(super) fn tile1_full(a: &GemmRsArgs) -> u64 {
    if a.n_comm == 0 {
        HALVES * a.n.div_ceil(TILE.block_n) as u64
    } else {
        a.n_comm as u64
    }
}

/// Announcements per tile: each consumer warpgroup announces its half (rows) on its own, so
/// a full count is this many times the tiles.
pub(super) const HALVES: u64 = TILE.consumer_warpgroups as u64;

/// The GEMM+ReduceScatter/AllReduce launch's copy of its `CommDesc` in shared memory, as a
/// generic address (written by thread 0 before the role split; `GemmTile::desc_copy_offset`).
#[inline(always)]
pub(super) fn ldesc() -> u64 {
    smem::dynamic_smem() as u64 + RS_TILE.desc_copy_offset() as u64
}

/// The launch's copy of its `GemmRsArgs` in shared memory, as a generic address (written by
/// thread 0 before the role split; `GemmTile::args_copy_offset`).
#[inline(always)]
pub(super) fn largs() -> u64 {
    smem::dynamic_smem() as u64 + RS_TILE.args_copy_offset() as u64
}

/// The launch epoch, from its shared-memory copy (written at setup by thread 0; volatile:
/// re-read wherever called).
#[inline(always)]
pub(super) fn lepoch() -> u64 {
    unsafe { ((smem::dynamic_smem() as u64 + RS_TILE.epoch_copy_offset() as u64) as *const u64).read_volatile() }
}

/// `(rank, world)` read from the descriptor (volatile: re-read wherever called).
#[inline(always)]
pub(super) unsafe fn rank_world(desc: u64) -> (u32, u32) {
    let d = desc as *const CommDesc;
    unsafe {
        (
            (&raw const (*d).rank).read_volatile(),
            (&raw const (*d).world).read_volatile(),
        )
    }
}

/// The fused launch context with a known epoch (re-read from the descriptor in each epilogue).
#[inline(always)]
pub(super) unsafe fn fused_ctx_at(desc: u64, epoch: u64) -> CommCtx {
    let mut c = unsafe { CommCtx::with_epoch(desc as *const CommDesc, 0, Role::Compute, epoch) };
    c.epoch_seq = mkernel_config::comm::fifo::EPOCH_SEQ_FUSED;
    c
}
