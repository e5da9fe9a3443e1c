//! Ring attention: the launch epoch, the compute CTAs' producer across ring steps, and the comm
//! CTAs that pass K/V shards to the right neighbour (docs/attention.md, "Ring attention").
//!
//! The ring runs over every rank of the job, in global rank order (`W` ranks, `L` per node):
//! rank `g` receives from `g - 1` and sends to `g + 1` (mod W). Inside a node a hop is NVLink
//! stores into the neighbour's heap; on several nodes the last local rank's hop to the next
//! node's first one goes through the proxy (one PUT per step, see [`send_across`]).
//!
//! Step `t` (0..W) of rank `g` attends the local Q to the K/V shard of rank `(g - t) mod W`:
//! the local K, V at step 0, receive slot `t % 2` after. Step values `v(t) = (e - 1) W + t + 1`
//! (`e` the ring launch epoch) only grow, across launches too, so flags are never reset.
//! - comm CTA `k` of rank `r`, step `t < W - 1`, right neighbour on this node: waits
//!   `(RingData, left, k) >= v(t)` (its slice of step `t`'s shard landed; `t >= 1`) and
//!   `(RingFree, right, c) >= v(t - 1)` for every CTA `c` of the right neighbour (its slot
//!   `(t + 1) % 2` is no longer read; at `t = 0` instead the right neighbour's ring launch epoch
//!   `>= e - 1`: its previous launch, whatever its grid, has ended), copies its slice of K and V
//!   into the right neighbour's slot `(t + 1) % 2`, and after a CTA barrier raises
//!   `(RingData, r, k) = v(t + 1)` there. Every step it then frees its step ([`free`]).
//! - right neighbour on another node: at `t = 0` comm CTA `k` copies its slice of the local K, V
//!   into its own slot 0 and raises its own `(RingData, r, k) = v(0)`; comm CTA 0 then posts one
//!   PUT per step (`t < W - 1`) of its whole slot `t % 2` into the right's slot `(t + 1) % 2`
//!   ([`send_across`]).
//! - left neighbour on another node: at every step `t >= 1` comm CTA `k` waits for the inter-node
//!   `(RingData, left)` flag `>= v(t)` (raised by the PUT after its data) and relays it to the
//!   local `(RingData, left, k)` that the producers wait for.
//! - compute CTA `c`: its producer waits `(RingData, left, k) >= v(t)` for every comm CTA `k`
//!   (`t >= 1`), loads the step's tiles, waits until its consumers released every slot, and
//!   frees its step ([`free`]).
//! - [`free`]: left neighbour on this node: `(RingFree, r, cta) = v(t)` in its heap; on another
//!   node: the CTA counts itself at `RING_FREE_COUNT_OFFSET` and the step's last CTA posts the
//!   inter-node `RingFree` SIGNAL with `v(t)` to it.
use super::producer::{drain, tiles, Pos};
use super::Smem;
use crate::arch::{ids, memory, memory::Scope, sync, tma::TensorMap};
use crate::comm::move_data;
use crate::comm::proxy::{self, Command};
use crate::comm::wait::{wait_flag_of_cta, BoundedWait, Waiting};
use crate::comm::CommCtx;
use mkernel_config::comm::{
    fifo, remote_flag_offset, CommDesc, FlagSlot, RemoteSlot, Role, FUSED_EPOCH_OFFSET, RING_EPOCH_OFFSET,
    RING_EXITS_OFFSET, RING_FREE_COUNT_OFFSET,
};
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

/// Step value of step `t` (`value(c, 0) - 1`: the previous launch's last step).
#[inline(always)]
fn value(c: &CommCtx, t: u32) -> u64 {
    (c.epoch - 1) * c.global_world as u64 + t as u64 + 1
}

/// Whether the left neighbour (global rank `g - 1`) is on another node: this rank is its node's
/// first and the job has several nodes.
#[inline(always)]
fn left_across(c: &CommCtx) -> bool {
    c.global_world != c.world && c.rank == 0
}

/// Whether the right neighbour (global rank `g + 1`) is on another node.
#[inline(always)]
fn right_across(c: &CommCtx) -> bool {
    c.global_world != c.world && c.rank + 1 == c.world
}

/// The left neighbour's global rank, read from the descriptor now (volatile): for error
/// records, a cold path, so that no register keeps the job's size across the waits.
#[inline(always)]
fn left_global(c: &CommCtx) -> u32 {
    let world = unsafe { (&raw const (*(c.desc_addr() as *const CommDesc)).global_world).read_volatile() };
    (c.global_rank_now() + world - 1) % world
}

/// The context whose epoch stamps this launch's proxy commands: the fused kernels' epoch
/// sequence at its current value (the last finished fused launch's epoch). The proxy only asks
/// that a sequence's epochs never decrease along the FIFO; launches on a communicator are
/// serialized, a fused launch stamps its commands with that value + 1, and the ring's own step
/// values travel as flag values, so the ring needs no sequence of its own.
#[inline(always)]
unsafe fn proxy_ctx(c: &CommCtx) -> CommCtx {
    let mut pc = *c;
    pc.epoch = unsafe { ((c.heap(c.rank) + FUSED_EPOCH_OFFSET) as *const u64).read_volatile() };
    pc.epoch_seq = fifo::EPOCH_SEQ_FUSED;
    pc
}

/// A bounded wait ([`BoundedWait`]: the timeout, the rank's abort words) for a u64 (this
/// rank's heap, or a peer's over NVLink) to reach `target`; the record names wait code `code`
/// and global rank `peer(c)`.
#[inline(always)]
fn waiting<'c>(
    c: &'c CommCtx,
    target: u64,
    code: u32,
    peer: impl Fn(&CommCtx) -> u32 + Copy,
) -> BoundedWait<'c, impl Fn(&CommCtx) -> u32 + Copy> {
    BoundedWait::new(
        c,
        Waiting {
            code,
            peer,
            expected: target,
        },
    )
}

/// Waits until local rank `peer`'s ring launch epoch (in its heap, read over NVLink) reached
/// this launch's `e - 1`: every CTA of its previous ring-attention launch exited. The record
/// names `peer` and the `RingFree` slot with the epoch expected.
#[inline(always)]
unsafe fn wait_previous_launch(c: &CommCtx, peer: u32) -> bool {
    let word = (c.heap(peer) + RING_EPOCH_OFFSET) as *const u64;
    unsafe {
        waiting(c, c.epoch - 1, FlagSlot::RingFree as u32, move |c| {
            peer + (c.global_rank_now() - c.rank)
        })
        .at_least(word)
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
    let world = unsafe { (*(r.desc as *const CommDesc)).global_world };
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
                TensorMap(a.map_q as *const u8),
                TensorMap(mk as *const u8),
                TensorMap(mv as *const u8),
                Some(t),
                r.compute_ctas,
                &mut pos,
            )
        };
        unsafe { drain(sm, &pos) };
        let cta = ids::block_idx_reread();
        unsafe { free(&ctx(r, cta, Role::Compute), t, cta) };
    }
}

/// Compute CTA: waits until every comm CTA of the left neighbour stored its slice of step `t`'s
/// shard here (across nodes: until this rank's comm CTAs relayed the PUT's flag). On a timeout
/// (recorded) the loads go ahead on stale data: the launch ends and `Communicator::check`
/// reports the error.
#[inline(always)]
unsafe fn wait_data(r: &RingArgs, t: u32) {
    let c = unsafe { ctx(r, ids::block_idx_reread(), Role::Compute) };
    let left = (c.rank + c.world - 1) % c.world;
    for k in 0..r.comm_ctas {
        let flag = c.flag_of_cta(c.rank, FlagSlot::RingData, left, k);
        // The first poll reads no abort word (`until_at_least`): the producer is short of registers.
        let _ = unsafe { waiting(&c, value(&c, t), FlagSlot::RingData as u32, left_global).until_at_least(flag) };
    }
    // The peer's generic-proxy stores, acquired above, before this thread's TMA reads.
    memory::fence_proxy_async();
}

/// CTA `cta` (compute or comm, thread 0) no longer reads its receive slot of step `t` (its loads
/// landed and were consumed, or its copies and PUT are done): the left neighbour may overwrite
/// it. Left neighbour on this node: `(RingFree, r, cta) = v(t)` in its heap. On another node:
/// one count at `RING_FREE_COUNT_OFFSET + 8 (t % 2)`, which [`signal_free_across`] turns into
/// the inter-node `RingFree` SIGNAL.
#[inline(always)]
unsafe fn free(c: &CommCtx, t: u32, cta: u32) {
    if left_across(c) {
        let count = (c.heap(c.rank) + RING_FREE_COUNT_OFFSET + 8 * (t % 2) as u64) as *mut u64;
        unsafe { memory::red_release_add_u64(Scope::Gpu, count, 1) };
    } else {
        let left = (c.rank + c.world - 1) % c.world;
        unsafe {
            memory::st_release_u64(
                Scope::Sys,
                c.flag_of_cta(left, FlagSlot::RingFree, c.rank, cta),
                value(c, t),
            )
        };
    }
}

/// Comm CTA 0's thread 0 of a rank whose left neighbour is on another node: waits until every
/// CTA counted its free of step `t` ([`free`]), resets the step parity's counter (next used at
/// step `t + 2`, whose data needs this SIGNAL first) and posts the inter-node `RingFree` SIGNAL
/// with `v(t)` to the left neighbour. Returns false if a wait gave up (recorded; the SIGNAL is
/// posted anyway).
#[inline(always)]
unsafe fn signal_free_across(r: &RingArgs, c: &CommCtx, t: u32) -> bool {
    let count = (c.heap(c.rank) + RING_FREE_COUNT_OFFSET + 8 * (t % 2) as u64) as *mut u64;
    let ctas = (r.compute_ctas + r.comm_ctas) as u64;
    // Named as a wait for this rank's own CTAs (a `RingFree` wait on itself).
    let ok = unsafe { waiting(c, ctas, FlagSlot::RingFree as u32, CommCtx::global_rank_now).at_least(count) };
    unsafe { memory::st_relaxed_u64(Scope::Gpu, count, 0) };
    let pc = unsafe { proxy_ctx(c) };
    let cmd = Command {
        opcode: fifo::OP_SIGNAL,
        dst_rank: (c.global_rank + c.global_world - 1) % c.global_world,
        src_offset: 0,
        dst_offset: 0,
        bytes: 0,
        flag_offset: remote_flag_offset(RemoteSlot::RingFree, c.global_rank),
        flag_value: value(c, t),
    };
    ok && unsafe { proxy::post(&pc, cmd) }.is_some()
}

/// Comm CTA 0's thread 0 of a rank whose right neighbour is on another node, step `t < W - 1`:
/// waits until the right neighbour freed its slot `(t + 1) % 2` (the inter-node `RingFree`
/// flag `>= v(t - 1)`; at `t = 0` the previous launch's last step) and until the whole shard of
/// step `t` is in this rank's slot `t % 2` (every comm CTA's `(RingData, src, k)`: its own
/// staged slices at `t = 0`, the left neighbour's, or their relays, after), then posts one PUT
/// of the slot (K and V, `2 kv_bytes`) into the right's slot `(t + 1) % 2` whose flag, the
/// inter-node `(RingData, g) = v(t + 1)`, the proxy raises after the data; then waits until the
/// proxy read the slot (`done`), so that its free of step `t` covers the PUT. Returns false if
/// a wait gave up (recorded; the PUT is posted anyway so that the launch ends).
#[inline(always)]
unsafe fn send_across(r: &RingArgs, c: &CommCtx, t: u32) -> bool {
    let right = (c.global_rank + 1) % c.global_world;
    let mut ok = unsafe { proxy::wait_remote_value(c, RemoteSlot::RingFree, right, value(c, t) - 1) };
    let (src, target) = if t == 0 {
        (c.rank, value(c, 0))
    } else {
        ((c.rank + c.world - 1) % c.world, value(c, t))
    };
    for k in 0..r.comm_ctas {
        let flag = c.flag_of_cta(c.rank, FlagSlot::RingData, src, k);
        let peer = move |c: &CommCtx| if t == 0 { c.global_rank_now() } else { left_global(c) };
        ok &= unsafe { waiting(c, target, FlagSlot::RingData as u32, peer).at_least(flag) };
    }
    let pc = unsafe { proxy_ctx(c) };
    let cmd = Command {
        opcode: fifo::OP_PUT,
        dst_rank: right,
        src_offset: r.slots + 2 * (t % 2) as u64 * r.kv_bytes,
        dst_offset: r.slots + 2 * ((t + 1) % 2) as u64 * r.kv_bytes,
        bytes: 2 * r.kv_bytes,
        flag_offset: remote_flag_offset(RemoteSlot::RingData, c.global_rank),
        flag_value: value(c, t + 1),
    };
    match unsafe { proxy::post(&pc, cmd) } {
        Some(seq) => ok && unsafe { proxy::wait_done(&pc, seq) },
        None => false,
    }
}

/// Comm CTA `k` (of `r.comm_ctas`): moves slice `k` of each step's K and V to the right
/// neighbour (or stages it for the PUT across nodes), relays the inter-node data flag from a
/// left neighbour on another node, and frees its steps. Every thread of the CTA runs it.
///
/// # Safety
/// Called by every thread of comm CTA `k < r.comm_ctas` of a ring launch; the right neighbour's
/// receive slots are mapped through the symmetric heap (on this node), or the communicator has
/// a proxy FIFO (across nodes).
#[inline(always)]
pub unsafe fn communicate(r: &RingArgs, k: u32) {
    let cta = r.compute_ctas + k;
    let c = unsafe { ctx(r, cta, Role::IntraComm) };
    let (rank, world, steps) = (c.rank, c.world, c.global_world);
    let (left, right) = ((rank + world - 1) % world, (rank + 1) % world);
    let (from_node, to_node) = (left_across(&c), right_across(&c));
    let ctas = r.compute_ctas + r.comm_ctas;
    let tid = ids::thread_idx();
    let n16 = r.kv_bytes / 16;
    let per = n16.div_ceil(r.comm_ctas as u64);
    let lo = (k as u64 * per).min(n16);
    let n = per.min(n16 - lo);
    let off = lo * 16;
    let slot = |owner: u32, j: u32| c.heap(owner) + r.slots + 2 * j as u64 * r.kv_bytes;
    for t in 0..steps {
        let mut failed = false;
        // Step t's shard from another node: the PUT's flag, relayed to the local flag of this
        // CTA's slice for the producers (and for the forwarding below). Relayed after a timeout
        // too (recorded): the launch goes on and ends.
        if t > 0 && from_node && tid == 0 {
            let left_g = (c.global_rank + steps - 1) % steps;
            failed |= !unsafe { proxy::wait_remote_value(&c, RemoteSlot::RingData, left_g, value(&c, t)) };
            unsafe {
                memory::st_release_u64(
                    Scope::Sys,
                    c.flag_of_cta(rank, FlagSlot::RingData, left, k),
                    value(&c, t),
                )
            };
        }
        // Step t - 1's free across nodes: before this step's PUT when the right neighbour is on
        // another node too (one rank per node: every rank's PUT waits for its right's SIGNAL,
        // so a SIGNAL after the PUT would close a cycle), else after the forwarding.
        if t > 0 && from_node && to_node && k == 0 && tid == 0 {
            let _ = unsafe { signal_free_across(r, &c, t - 1) };
        }
        if t + 1 < steps && !to_node {
            if t > 0 && !from_node && tid == 0 {
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
        } else if t + 1 < steps {
            // The right neighbour is on another node. Step 0: stage this CTA's slice of the
            // local K, V in the own slot 0 (free: the left neighbour writes it at its step 1,
            // after this rank's CTAs freed step 0) for comm CTA 0's PUT.
            if t == 0 {
                let dst = slot(rank, 0);
                unsafe {
                    move_data::copy((dst + off) as *mut u8, (r.k_local + off) as *const u8, n);
                    move_data::copy((dst + r.kv_bytes + off) as *mut u8, (r.v_local + off) as *const u8, n);
                }
                sync::sync_threads();
                if tid == 0 {
                    unsafe {
                        memory::st_release_u64(
                            Scope::Sys,
                            c.flag_of_cta(rank, FlagSlot::RingData, rank, k),
                            value(&c, 0),
                        )
                    };
                }
            }
            if k == 0 && tid == 0 {
                let _ = unsafe { send_across(r, &c, t) };
            }
        }
        if t > 0 && from_node && !to_node && k == 0 && tid == 0 {
            let _ = unsafe { signal_free_across(r, &c, t - 1) };
        }
        if tid == 0 {
            unsafe { free(&c, t, cta) };
        }
    }
    // The last step's free across nodes (the next launch's PUT at step 0 waits for it).
    if from_node && k == 0 && tid == 0 {
        let _ = unsafe { signal_free_across(r, &c, steps - 1) };
    }
}
