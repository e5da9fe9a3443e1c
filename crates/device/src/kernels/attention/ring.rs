//! Ring attention: the launch epoch, the compute CTAs' producer across ring steps, and the comm
//! CTAs that pass K/V shards to the right neighbour (docs/attention.md, "Ring attention").
//!
//! Step `t` (0..W) of rank `r` attends the local Q to the K/V shard of rank `(r - t) mod W`:
//! the local K, V at step 0, receive slot `t % 2` after. Step values `v(t) = (e - 1) W + t + 1`
//! (`e` the ring launch epoch) only grow, across launches too, so flags are never reset.
//! - comm CTA `k` of rank `r`, step `t < W - 1`: waits `(RingData, left, k) >= v(t)` (its slice
//!   of step `t`'s shard landed; `t >= 1`) and `(RingFree, right, c) >= v(t - 1)` for every CTA
//!   `c` of the right neighbour (its slot `(t + 1) % 2` is no longer read; at `t = 0` instead the
//!   right neighbour's ring launch epoch `>= e - 1`: its previous launch, whatever its grid, has
//!   ended), copies its slice of
//!   K and V into the right neighbour's slot `(t + 1) % 2`, and after a CTA barrier raises
//!   `(RingData, r, k) = v(t + 1)` there. Every step it then raises `(RingFree, r, C + k) =
//!   v(t)` at the left neighbour (`C` compute CTAs).
//! - compute CTA `c`: its producer waits `(RingData, left, k) >= v(t)` for every comm CTA `k`
//!   (`t >= 1`), loads the step's tiles, waits until its consumers released every slot, and
//!   raises `(RingFree, r, c) = v(t)` at the left neighbour.
use super::producer::{drain, tiles, Pos};
use super::Smem;
use crate::arch::{ids, memory, memory::Scope, sync, time, tma::TensorMap};
use crate::comm::move_data;
use crate::comm::wait::{report_give_up, wait_flag_of_cta};
use crate::comm::CommCtx;
use mkernel_config::comm::{CommDesc, FlagSlot, Role, ABORT_OFFSET, RING_EPOCH_OFFSET, RING_EXITS_OFFSET};
use mkernel_config::ops::attention::{AttentionArgs, RingArgs};

/// This CTA's view of the communicator with the ring launch epoch.
///
/// # Safety
/// `r.desc` is the launch's valid communicator descriptor (heaps mapped, epochs in step).
#[inline(always)]
pub unsafe fn ctx(r: &RingArgs, cta: u32, role: Role) -> CommCtx {
    let mut c = unsafe { CommCtx::new(r.desc as *const CommDesc, cta, role) };
    c.epoch = unsafe { ((c.heap(c.rank) + RING_EPOCH_OFFSET) as *const u64).read_volatile() } + 1;
    c
}

/// Step value of step `t` (`t` may be -1: the previous launch's last step).
#[inline(always)]
fn value(c: &CommCtx, t: u32) -> u64 {
    (c.epoch - 1) * c.world as u64 + t as u64 + 1
}

/// Waits until rank `peer`'s ring launch epoch (in its heap, read over NVLink) reached this
/// launch's `e - 1`: every CTA of its previous ring-attention launch exited. Bounded like every
/// flag wait (gives up on the timeout or the rank's abort word); the record names `peer` and the
/// `RingFree` slot with the epoch expected.
// `polls % 64` keeps the polling loop's PTX as measured (`is_multiple_of` changes it).
#[allow(clippy::manual_is_multiple_of)]
#[inline(always)]
unsafe fn wait_previous_launch(c: &CommCtx, peer: u32) -> bool {
    let word = (c.heap(peer) + RING_EPOCH_OFFSET) as *const u64;
    let abort = (c.heap(c.rank) + ABORT_OFFSET) as *const u32;
    let target = c.epoch - 1;
    let start = time::globaltimer_ns();
    let mut polls = 0u32;
    loop {
        let seen = unsafe { memory::ld_acquire_u64(Scope::Sys, word) };
        if seen >= target {
            return true;
        }
        polls += 1;
        if polls % 64 == 0 {
            let aborting = unsafe { crate::comm::wait::aborting_at(c.desc_addr(), abort, polls) };
            let waited = time::globaltimer_ns().wrapping_sub(start);
            if aborting || waited > c.timeout_ns {
                let src = peer + (c.global_rank_now() - c.rank);
                unsafe { report_give_up(c, FlagSlot::RingFree as u32, src, target, seen, waited) };
                return false;
            }
        }
    }
}

/// Counts this warp's exit; the launch's last warp advances the ring launch epoch. Every warp
/// calls it once, after its work (lane 0 after its warp barrier).
///
/// # Safety
/// Called once per warp of the launch, after the warp's last access to the ring buffers;
/// `desc` is the launch's communicator descriptor.
#[inline(always)]
pub unsafe fn exit(desc: u64) {
    sync::sync_warp();
    if ids::lane_id() == 0 {
        let d = unsafe { &*(desc as *const CommDesc) };
        let local = unsafe { *d.heaps.as_ptr().add(d.rank as usize) };
        let exits = ids::grid_dim() * (ids::block_dim() / 32);
        let word = (local + RING_EXITS_OFFSET) as *mut u32;
        if unsafe { memory::atom_acq_rel_add_u32(Scope::Gpu, word, 1) } + 1 == exits {
            let epoch = (local + RING_EPOCH_OFFSET) as *mut u64;
            unsafe {
                let e = epoch.read_volatile();
                crate::comm::wait::host_abort_at_launch_end(desc, e + 1);
                memory::st_relaxed_u32(Scope::Gpu, word, 0);
                // System scope: the left neighbour reads it over NVLink (`wait_previous_launch`).
                memory::st_release_u64(Scope::Sys, epoch, e + 1);
            }
        }
    }
}

/// The producer of compute CTA `ids::block_idx()` over the W steps. The communicator context is
/// rebuilt around each wait and signal rather than kept live across the tile loop (the producer
/// is short of registers).
///
/// # Safety
/// As [`super::producer::run`] for a ring launch: `r` is the launch's [`RingArgs`] block and its
/// receive slots are mapped on this rank.
#[inline(always)]
pub unsafe fn produce<const D: u32>(sm: &Smem, r: &RingArgs) {
    let world = unsafe { (*(r.desc as *const CommDesc)).world };
    let a: &AttentionArgs = &r.attn;
    let mut pos = Pos::START;
    for t in 0..world {
        let (mk, mv) = if t == 0 {
            (a.map_k, a.map_v)
        } else {
            unsafe { wait_data(r, t) };
            (r.map_k_slot[(t % 2) as usize], r.map_v_slot[(t % 2) as usize])
        };
        unsafe {
            tiles::<D>(
                sm,
                a,
                TensorMap(mk as *const u8),
                TensorMap(mv as *const u8),
                Some(t),
                r.compute_ctas,
                &mut pos,
            )
        };
        unsafe { drain(sm, &pos) };
        unsafe { signal_free(r, t) };
    }
}

/// Compute CTA: waits until every comm CTA of the left neighbour stored its slice of step `t`'s
/// shard here. On a timeout (recorded) the loads go ahead on stale data: the launch ends and
/// `Communicator::check` reports the error.
#[inline(always)]
unsafe fn wait_data(r: &RingArgs, t: u32) {
    let c = unsafe { ctx(r, ids::block_idx_reread(), Role::Compute) };
    let left = (c.rank + c.world - 1) % c.world;
    for k in 0..r.comm_ctas {
        let _ = unsafe { wait_flag_of_cta(&c, FlagSlot::RingData, left, k, value(&c, t)) };
    }
    // The peer's generic-proxy stores, acquired above, before this thread's TMA reads.
    memory::fence_proxy_async();
}

/// Compute CTA: step `t`'s loads have all landed and been consumed; the left neighbour may
/// overwrite the slot.
#[inline(always)]
unsafe fn signal_free(r: &RingArgs, t: u32) {
    let cta = ids::block_idx_reread();
    let c = unsafe { ctx(r, cta, Role::Compute) };
    let left = (c.rank + c.world - 1) % c.world;
    unsafe {
        memory::st_release_u64(
            Scope::Sys,
            c.flag_of_cta(left, FlagSlot::RingFree, c.rank, cta),
            value(&c, t),
        )
    };
}

/// Comm CTA `k` (of `r.comm_ctas`): moves slice `k` of each step's K and V to the right
/// neighbour. Every thread of the CTA runs it.
///
/// # Safety
/// Called by every thread of comm CTA `k < r.comm_ctas` of a ring launch; the right neighbour's
/// receive slots are mapped through the symmetric heap.
#[inline(always)]
pub unsafe fn communicate(r: &RingArgs, k: u32) {
    let c = unsafe { ctx(r, r.compute_ctas + k, Role::IntraComm) };
    let (rank, world) = (c.rank, c.world);
    let (left, right) = ((rank + world - 1) % world, (rank + 1) % world);
    let ctas = r.compute_ctas + r.comm_ctas;
    let tid = ids::thread_idx();
    let n16 = r.kv_bytes / 16;
    let per = n16.div_ceil(r.comm_ctas as u64);
    let lo = (k as u64 * per).min(n16);
    let n = per.min(n16 - lo);
    let slot = |owner: u32, j: u32| c.heap(owner) + r.slots + 2 * j as u64 * r.kv_bytes;
    for t in 0..world {
        if t + 1 < world {
            let mut failed = false;
            if t > 0 && tid == 0 {
                failed |= !unsafe { wait_flag_of_cta(&c, FlagSlot::RingData, left, k, value(&c, t)) };
            }
            // The right neighbour's CTAs finished step t - 1, the last reader of slot (t + 1) % 2:
            // in this launch, each of its CTAs' RingFree flag; for t = 0, its previous launch
            // (whose grid may have had other CTAs) ended: its ring launch epoch reached e - 1.
            if t == 0 {
                if tid == 0 {
                    failed |= !unsafe { wait_previous_launch(&c, right) };
                }
            } else if tid < ctas {
                failed |= !unsafe { wait_flag_of_cta(&c, FlagSlot::RingFree, right, tid, value(&c, t) - 1) };
            }
            // A failed wait is recorded; the copy goes ahead so that the launch ends.
            let _ = sync::sync_threads_or(failed);
            let (src_k, src_v) = if t == 0 {
                (r.k_local, r.v_local)
            } else {
                let s = slot(rank, t % 2);
                (s, s + r.kv_bytes)
            };
            let dst = slot(right, (t + 1) % 2);
            let off = lo * 16;
            unsafe {
                move_data::copy((dst + off) as *mut u8, (src_k + off) as *const u8, n);
                move_data::copy((dst + r.kv_bytes + off) as *mut u8, (src_v + off) as *const u8, n);
            }
            sync::sync_threads();
            if tid == 0 {
                unsafe {
                    memory::st_release_u64(
                        Scope::Sys,
                        c.flag_of_cta(right, FlagSlot::RingData, rank, k),
                        value(&c, t + 1),
                    )
                };
            }
        }
        if tid == 0 {
            unsafe {
                memory::st_release_u64(
                    Scope::Sys,
                    c.flag_of_cta(left, FlagSlot::RingFree, rank, r.compute_ctas + k),
                    value(&c, t),
                )
            };
        }
    }
}
