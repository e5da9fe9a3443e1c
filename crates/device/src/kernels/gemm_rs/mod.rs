//! GEMM+ReduceScatter/AllReduce (`mk_gemm_rs_bf16_nk`): the kernel entry, the register split and
//! the dispatch of each warp to its role. Config (arguments, shared memory, role table):
//! `mkernel_config::ops::gemm_rs`; host plan: `mkernel::ops::GemmRsPlan`.
//!
//! Modules, one per role ([`mkernel_config::ops::gemm_rs::Role`]): [`producer`], [`consumer`]
//! (the tile loop; its epilogue in [`epilogue`] without stagers, announcing through
//! [`announce`] and trickling peer tiles out with [`trickle`]), [`stager`], [`relay`],
//! [`node_send`] and [`node_recv`] (across nodes), [`comm`] (comm CTAs); the parts they share:
//! [`setup`] (the launch's start and end), [`shared`] (the shared-memory copies every role
//! reads), [`work_items`] and [`stream_k`].
use crate::arch::{ids, regs, smem};
use crate::comm::launch::exit_launch_by_cta_then;
use crate::gemm::ring::RingPos;
use crate::gemm::trace;
use mkernel_config::comm::CommDesc;
use mkernel_config::ops::gemm_rs::GemmRsArgs;
use mkernel_config::ops::gemm_rs::{self as rs_op, Role};
use mkernel_config::trace::End;
use node_send::{node_blocks_to_send, send_node_block};
use relay::{relay_role, relays_run};
use setup::finish_reduce_launch;
use shared::{fused_ctx_at, largs, ldesc, lepoch, RS_RING, RS_TILE};
use stager::{stager_role, stager_runs};

mod announce;
mod comm;
mod consumer;
mod epilogue;
mod node_recv;
mod node_send;
mod producer;
mod relay;
mod setup;
mod shared;
mod stager;
mod stream_k;
mod trickle;
mod work_items;

/// `mk_gemm_rs_bf16_nk`: GEMM + ReduceScatter / AllReduce. Every rank computes its partial
/// product `P_r = A_r * B_r^T` (M x N; K is split over ranks); global rank `g` reduces row chunk
/// `g` of `sum_r P_r` in f32. Rows are visited node-blocked ([`rs_source_row`]): local rank
/// `l`'s chunk (`M / world` rows) is its rail's global chunks, other nodes' first, own last.
/// CTAs `0..n_comm` move partials ([`comm::run`]); the others compute, in the chunked order
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
///
/// CTA 0 first zeroes this rank's incoming counters, then raises `FusedReady` at every peer
/// (and, through the proxy, at every remote rank): senders add to the counters only after that,
/// and all additions of a launch have landed before the receiver's launch ends, whose last warp
/// zeroes the counters again (so no CTA of the next launch can meet a full counter before CTA 0
/// ran) and, across nodes, waits until the proxy has read every PUT source.
///
/// # Safety
/// Launched as `mkernel_config::ops::gemm_rs::GEMM_RS_NK` says, by every rank of the
/// communicator at once, with `args` and `desc` the device addresses of this launch's argument
/// block and this rank's descriptor (the host's `GemmRsPlan` does both).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_gemm_rs_bf16_nk(args: *const GemmRsArgs, desc: *const CommDesc) {
    // (The clock read before the arguments: their load is part of the entry.)
    let entered = crate::arch::time::globaltimer_ns();
    unsafe { rs_roles(args, desc, entered) };
    // Everything from the shared copies: the launch's end reads nothing from global memory
    // before its exit count.
    let c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    unsafe {
        exit_launch_by_cta_then(&c, c.epoch, exited_warps(), |lane, lanes| {
            let a = &*(largs() as *const GemmRsArgs);
            finish_reduce_launch(&c, a, lane, lanes);
            if lane == 0 && ids::block_idx_reread() >= a.n_comm {
                trace::end(a.trace, ids::block_idx_reread() - a.n_comm, End::Exit);
            }
        })
    };
}

/// The launch's setup, the register split, then each warp's role ([`rs_op::role`]: one table for
/// comm CTAs, one for compute CTAs).
#[inline(always)]
unsafe fn rs_roles(args: *const GemmRsArgs, desc: *const CommDesc, entered: u64) {
    unsafe { setup::run(args, desc, entered) };
    let a = unsafe { &*(largs() as *const GemmRsArgs) };
    let pos = RingPos::START;
    // Every CTA runs the same register split (a comm CTA's mover runs with the consumers'
    // registers): role branches around setmaxnreg cost the consumers their larger register
    // budget in ptxas (they spilled). The two warpgroup kinds' paths never join: code of the
    // consumers reachable after `setmaxnreg.dec` makes ptxas ignore the split.
    if ids::warpgroup_idx_reread() == 0 {
        regs::setmaxnreg_dec::<{ RS_TILE.producer_regs }>();
        unsafe { run_role::<true>(a, pos) };
        return;
    }
    regs::setmaxnreg_inc::<{ RS_TILE.consumer_regs }>();
    unsafe { run_role::<false>(a, pos) };
}

/// This warp's role, in the producer warpgroup (`PRODUCER_WG`) or a consumer warpgroup: the
/// arms of the other kind are compiled out (the role tables keep each role in its warpgroup
/// kind, checked at compile time in `mkernel_config::ops::gemm_rs`). The one-thread roles run
/// on lane 0.
#[inline(always)]
unsafe fn run_role<const PRODUCER_WG: bool>(a: &GemmRsArgs, pos: RingPos) {
    // Each role derives its loop state after its setmaxnreg: values computed before the split
    // and kept live across it are what ptxas spills. Indices are read again for the same reason.
    // `idx`: this CTA among the compute CTAs.
    let compute_idx = || ids::block_idx_reread() - a.n_comm;
    let lane0 = ids::lane_id() == 0;
    match rs_op::role(ids::block_idx_reread() < a.n_comm, ids::warp_idx_reread()) {
        Role::Producer if PRODUCER_WG => {
            if lane0 {
                unsafe { producer::run(a, compute_idx(), pos) };
            }
        }
        Role::Relay if PRODUCER_WG => {
            if lane0 && relays_run(a) {
                let idx = compute_idx();
                unsafe { relay_role(a, idx) };
                unsafe { trace::end(a.trace, idx, End::RelayDone) };
            }
        }
        // Warps 1 and 3: the stagers of consumer warpgroups 0 and 1 (one node of 2 ranks), or
        // across nodes (where no stager runs) the sender of node block `idx` and the receiver of
        // the other nodes' sums. Nothing stays live across the stager's loop.
        r @ (Role::StagerOrSender | Role::StagerOrReceiver) if PRODUCER_WG => {
            if lane0 {
                let receiver = r == Role::StagerOrReceiver;
                if stager_runs(a) {
                    // (The warp read again: derived from `r`, kept live across the check, ptxas
                    // spilled in the stager.)
                    let warp = ids::thread_idx_reread() / mkernel_config::WARP_SIZE;
                    unsafe { stager_role(compute_idx(), rs_op::stager_consumer(warp)) };
                } else if !receiver && compute_idx() < node_blocks_to_send(a) {
                    unsafe { send_node_block(a, compute_idx()) };
                } else if receiver && node_blocks_to_send(a) > 0 {
                    unsafe { node_recv::run(a, compute_idx()) };
                }
            }
        }
        Role::Consumer if !PRODUCER_WG => unsafe { consumer::run(a, pos) },
        Role::Comm if !PRODUCER_WG && lane0 => unsafe { comm::run(a) },
        // Idle, and (never) a role of the other warpgroup kind.
        _ => {}
    }
}

/// The CTA's count of exited warps (tick word [`rs_op::TICK_EXITED_WARPS`], zeroed by
/// `Ring::init`), as a generic address.
#[inline(always)]
fn exited_warps() -> *mut u32 {
    (smem::dynamic_smem() as u64 + RS_RING.tick as u64 + 4 * rs_op::TICK_EXITED_WARPS as u64) as *mut u32
}
