//! The launch's start (the shared-memory copies, the item table, the epoch, CTA 0 opening the
//! receive buffers) and its end (the counters zeroed for the next launch).
use super::shared::{fused_ctx_at, largs, ldesc, lepoch, RS_RING};
use super::work_items::fill_item_table;
use crate::arch::memory::Scope;
use crate::arch::tma::TensorMap;
use crate::arch::{ids, memory, smem, sync, tma};
use crate::comm::launch::launch_epoch;
use crate::comm::{proxy, CommCtx};
use crate::gemm::ring::Ring;
use crate::gemm::{trace, TILE};
use mkernel_config::comm::{
    cta_mark, flag_offset, CommDesc, FlagSlot, RemoteSlot, FIFO_HEAD_OFFSET, FUSED_CTA_MARKS_OFFSET,
};
use mkernel_config::ops::gemm_rs as rs_op;
use mkernel_config::ops::gemm_rs::GemmRsArgs;
use mkernel_config::trace::End;

/// Every thread of every CTA, before the role split: thread 0 copies the descriptor and the
/// arguments into shared memory and initializes the ring; the CTA fills its item table; CTA 0
/// opens this rank's receive buffers.
///
/// # Safety
///
/// `args` and `desc` as [`super::mk_gemm_rs_bf16_nk`] requires; called by every thread of every CTA, once, at the start
/// of the launch and before any other role function.
#[inline(always)]
pub(super) unsafe fn run(args: *const GemmRsArgs, desc: *const CommDesc, entered: u64) {
    let ring = Ring::new(smem::dynamic_smem_addr(), RS_RING);
    if ids::thread_idx_reread() == 0 {
        unsafe {
            // Every role below reads the descriptor and the arguments from these copies
            // ([`ldesc`], [`largs`]). Both come as kernel parameters, so all their loads are in
            // flight at once (one round trip, where reading the descriptor through `args.desc`
            // takes two). All loads first, then the stores (interleaved, each load would wait
            // behind the previous volatile store).
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
        unsafe { ((smem::dynamic_smem() as u64 + rs_op::EPOCH_OFFSET as u64) as *mut u64).write_volatile(epoch) };
        // This CTA's entry mark (diagnostics: a peer that timed out reads which CTAs started).
        unsafe { mark_cta(ids::block_idx_reread(), epoch) };
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
}

/// Writes mark `slot` (`0..MAX_COMM_CTAS`: CTA `b`'s entry; `MAX_COMM_CTAS + b`: its exit) of
/// this rank's `FUSED_CTA_MARKS_OFFSET` area: the launch epoch and this thread's SM. Diagnostics
/// only (nothing waits on it; `Communicator::fused_snapshot` reads it).
///
/// # Safety
///
/// Called once per mark and launch by one thread of the CTA the mark belongs to, after the shared copy of the
/// descriptor was written (`setup::run`).
#[inline(always)]
pub(super) unsafe fn mark_cta(slot: u32, epoch: u64) {
    let d = unsafe { &*(ldesc() as *const CommDesc) };
    let heap = unsafe { *d.heaps.as_ptr().add(d.rank as usize) };
    let at = heap + FUSED_CTA_MARKS_OFFSET + 8 * slot as u64;
    unsafe { memory::st_relaxed_u64(Scope::Gpu, at as *mut u64, cta_mark(epoch, ids::sm_id())) };
}

/// CTA 0, all threads: zero the incoming `Tile1` (and `Tile2`) counters of this shape's row
/// tiles, then raise `FusedReady` at every peer and every remote rank.
///
/// # Safety
///
/// The role contract (`crate::kernels::gemm_rs`); called by every thread of CTA 0, once per launch, before any role of
/// this CTA waits on another rank.
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
/// nothing is divided: at the launch's end this is on the critical path.)
///
/// # Safety
///
/// The role contract (`crate::kernels::gemm_rs`); called by threads `t` of `nt` together (each `t < nt` once), only
/// where no other thread of this rank can be adding to the counters: by CTA 0 before it raises `FusedReady`, or by the
/// launch's last warp after every counter was seen full.
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
///
/// # Safety
///
/// The role contract (`crate::kernels::gemm_rs`); called by lanes `0..lanes` of the launch's last warp only (the exit
/// count says which), once every CTA of this rank has exited its roles.
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
