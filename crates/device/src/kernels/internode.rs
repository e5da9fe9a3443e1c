//! Collectives across nodes: NVLink inside the node (as in `collectives`), GPU-initiated puts
//! through the CPU proxy between nodes (docs/internode.md). Used when the job has more than one
//! node; ranks `node * world .. (node + 1) * world` form a node.
//!
//! Inter-node steps are run by CTA 0 (one command per peer, so the proxy sees few, large
//! commands); the flags they raise are per source rank, so every CTA can wait on them.
use crate::arch::{ids, sync};
use crate::comm::move_data::{copy, reduce, Dtype};
use crate::comm::proxy;
use crate::comm::wait::{signal_all_peers, wait_all_peers};
use crate::comm::CommCtx;
use mkernel_config::comm::{CommDesc, FlagSlot, RemoteSlot, Role, PROBE_COUNTER};

#[inline(always)]
fn slice(n: u64) -> (u64, u64) {
    let (b, g) = (ids::block_idx() as u64, ids::grid_dim() as u64);
    (n * b / g, n * (b + 1) / g)
}

/// Node of global rank `r`.
#[inline(always)]
fn node(c: &CommCtx, r: u32) -> u32 {
    r / c.world
}

/// Every thread `t < global_world` with `pick(t)` waits for `t`'s inter-node `slot` flag; the
/// CTA learns whether all arrived.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`; called by every thread of the CTA (it ends in a CTA barrier);
/// `pick` selects global ranks that raise `slot` at this rank in this epoch.
#[inline(always)]
unsafe fn wait_remotes(c: &CommCtx, slot: RemoteSlot, pick: impl Fn(u32) -> bool) -> bool {
    let t = ids::thread_idx();
    let failed = t < c.global_world && pick(t) && !unsafe { proxy::wait_remote(c, slot, t) };
    !sync::sync_threads_or(failed)
}

/// CTA 0's inter-node exchange: Ready to every `pick`ed peer, wait for theirs, one PUT each
/// (`dst_off(q)` in q's heap), wait for their data and for our puts to complete (so the source
/// may be reused once the kernel ends). Every CTA then waits for the peers' data.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`, with the proxy FIFO of this node in `c.fifo`; called by every
/// thread of the CTA; `src_off + bytes` and every `dst_off(q) + bytes` of a `pick`ed rank `q` lie inside the heaps, and
/// the `pick`ed ranks run the same exchange in this epoch.
#[inline(always)]
unsafe fn exchange(
    c: &CommCtx,
    src_off: u64,
    bytes: u64,
    pick: impl Fn(u32) -> bool + Copy,
    dst_off: impl Fn(u32) -> u64,
) -> bool {
    unsafe {
        if c.cta == 0 {
            let mut ok = true;
            if ids::thread_idx() == 0 {
                for q in 0..c.global_world {
                    if pick(q) && proxy::signal(c, q, RemoteSlot::Ready).is_none() {
                        ok = false;
                    }
                }
            }
            if sync::sync_threads_or(!ok) || !wait_remotes(c, RemoteSlot::Ready, pick) {
                return false;
            }
            if ids::thread_idx() == 0 {
                let mut last = None;
                for q in 0..c.global_world {
                    if pick(q) {
                        last = proxy::put(c, q, src_off, dst_off(q), bytes);
                        ok &= last.is_some();
                    }
                }
                if let (true, Some(seq)) = (ok, last) {
                    ok = proxy::wait_done(c, seq);
                }
            }
            if sync::sync_threads_or(!ok) {
                return false;
            }
        }
        wait_remotes(c, RemoteSlot::Data, pick)
    }
}

/// AllGather over nodes: every rank's `bytes` at `src_off` go to `dst_off + global_rank * bytes`
/// in every rank's heap; NVLink pushes inside the node, one proxy PUT to every remote rank.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel, with the proxy running for this node (`desc`'s
/// `fifo` nonzero when `global_world > world`); `bytes` is a multiple of 16, the same on every rank; `src_off` and
/// `dst_off` are 16-byte aligned, `src_off + bytes` and `dst_off + global_world * bytes` inside every rank's heap (the
/// proxy's registered region).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_allgather_internode(
    desc: *const CommDesc,
    src_off: u64,
    dst_off: u64,
    bytes: u64,
) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::InterSend) };
    let (lo, hi) = slice(bytes / 16);
    let g = c.global_rank as u64;
    let my_node = node(&c, c.global_rank);
    unsafe {
        signal_all_peers(&c, FlagSlot::Ready);
        if !wait_all_peers(&c, FlagSlot::Ready) {
            return;
        }
        for k in 0..c.world {
            let p = (c.rank + k) % c.world;
            copy(
                (c.heap(p) + dst_off + g * bytes + lo * 16) as *mut u8,
                (c.heap(c.rank) + src_off + lo * 16) as *const u8,
                hi - lo,
            );
        }
        sync::sync_threads();
        let remote = move |q: u32| q / c.world != my_node;
        if !exchange(&c, src_off, bytes, remote, |_| dst_off + g * bytes) {
            return;
        }
        signal_all_peers(&c, FlagSlot::Done);
        if !wait_all_peers(&c, FlagSlot::Done) {
            return;
        }
        c.finish();
    }
}

/// The inter-node half of AllReduce: `src_off` holds this node's sum (an intra-node AllReduce
/// ran before); it is put into every rail peer's (same local rank, other node) `scratch_off +
/// node * bytes`, and `dst_off` gets the sum over nodes in node order (identical on every rank).
/// `dtype`: 0 bf16, 1 f32. At most 8 nodes.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel, with the proxy running for this node; at most 8
/// nodes; `dtype_code` is 0 (bf16) or 1 (f32) and `count` elements of it are a multiple of 16 bytes; `src_off`,
/// `scratch_off` and `dst_off` are 16-byte aligned, with `count` elements at `src_off` and `dst_off` and `nodes *
/// count` at `scratch_off` inside every rank's heap.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_allreduce_internode(
    desc: *const CommDesc,
    src_off: u64,
    scratch_off: u64,
    dst_off: u64,
    count: u64,
    dtype_code: u32,
) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::InterReduce) };
    let dt = if dtype_code == 1 { Dtype::F32 } else { Dtype::Bf16 };
    let bytes = count * if dt == Dtype::F32 { 4 } else { 2 };
    let my_node = node(&c, c.global_rank);
    let nnodes = c.global_world / c.world;
    let rail = move |q: u32| q % c.world == c.rank && q / c.world != my_node;
    unsafe {
        if !exchange(&c, src_off, bytes, rail, |_| scratch_off + my_node as u64 * bytes) {
            return;
        }
        let (lo, hi) = slice(bytes / 16);
        let local = c.heap(c.rank);
        let mut srcs = [0u64; 8];
        for n in 0..8u32 {
            if n < nnodes {
                srcs[n as usize] = if n == my_node {
                    local + src_off
                } else {
                    local + scratch_off + n as u64 * bytes
                } + lo * 16;
            }
        }
        let mut dsts = [0u64; 8];
        dsts[0] = local + dst_off + lo * 16;
        reduce(dsts, 1, srcs, nnodes, hi - lo, dt);
        sync::sync_threads();
        c.finish();
    }
}

/// Latency probe: one thread posts `iters` puts of `bytes` to `peer` and waits for each to come
/// back (the peer answers every put with its own); `out[i]` gets the round trip of probe `i` in
/// nanoseconds (`%globaltimer`), measured from before the post to the arrival of the answer's
/// flag. Flag values `epoch << 12 | i` in the `Probe` slot. `initiator`: 1 on the rank that
/// starts, 0 on the answering rank. `iters` < 4096.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel (one CTA), with the proxy running on both nodes;
/// `peer` is a global rank on another node that launches this kernel with `initiator` flipped and the same `bytes` and
/// `iters` (`iters < 4096`); `src_off + bytes` and `dst_off + bytes` lie inside the heaps; `out` is an 8-byte aligned
/// device address of `iters` writable `u64`s.
// `if let` + `if` stays nested: a let chain (edition 2024) breaks the repo-wide `rustfmt --edition 2021` run.
#[allow(clippy::collapsible_if)]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_proxy_pingpong(
    desc: *const CommDesc,
    peer: u32,
    src_off: u64,
    dst_off: u64,
    bytes: u64,
    iters: u32,
    initiator: u32,
    out: *mut u64,
) {
    // Its own epoch counter (the last CTA slot, which collectives never use), so probes do not
    // move the collectives' epochs out of step.
    let mut c = unsafe { CommCtx::new(desc, PROBE_COUNTER, Role::InterSend) };
    c.epoch_seq = mkernel_config::comm::fifo::EPOCH_SEQ_PROBES;
    if ids::thread_idx() != 0 {
        return;
    }
    let base = c.epoch << 12;
    let mut last = None;
    unsafe {
        for i in 1..=iters as u64 {
            let v = base | i;
            if initiator != 0 {
                let t0 = crate::arch::time::globaltimer_ns();
                last = proxy::put_value(&c, peer, src_off, dst_off, bytes, RemoteSlot::Probe, v);
                if last.is_none() || !proxy::wait_remote_value(&c, RemoteSlot::Probe, peer, v) {
                    return;
                }
                out.add(i as usize - 1).write(crate::arch::time::globaltimer_ns() - t0);
            } else {
                if !proxy::wait_remote_value(&c, RemoteSlot::Probe, peer, v) {
                    return;
                }
                last = proxy::put_value(&c, peer, src_off, dst_off, bytes, RemoteSlot::Probe, v);
                if last.is_none() {
                    return;
                }
            }
        }
        if let Some(seq) = last {
            if !proxy::wait_done(&c, seq) {
                return;
            }
        }
        c.finish();
    }
}
