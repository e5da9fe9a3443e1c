//! The relay warps: local tile counts turned into the peers' row-tile flags.
use super::shared::{fused_ctx_at, ldesc, lepoch, node_blocks, HALVES};
use crate::arch::memory::Scope;
use crate::arch::{ids, memory};
use crate::comm::wait::{wait_flag_of_cta, wait_flag_of_cta_sleeping};
use crate::comm::CommCtx;
use crate::gemm::TILE;
use mkernel_config::comm::{flag_offset, CommDesc, FlagSlot, Role};
use mkernel_config::ops::gemm_rs::GemmRsArgs;

/// Whether the compute CTAs' relay warps run: some local peer waits for a flag that the
/// compute CTAs count locally (`Outbox`) and no comm CTA carries - peer partials without comm
/// CTAs, AllReduce's reduced rows.
#[inline(always)]
pub(super) fn relays_run(a: &GemmRsArgs) -> bool {
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
///
/// The release is cumulative: the consumers' releases of the local counter, which this
/// thread's acquire saw, order their completed stores before the peer's flag. Deadlock-free
/// like the comm CTAs' walk: an item of part g waits only for tiles whose waits concern parts
/// below g, and each relay takes its items in part order. Bounded waits (error record; the
/// relay stops on abort).
#[inline(always)]
pub(super) unsafe fn relay_role(a: &GemmRsArgs, idx: u32) {
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
        let peer_items = if g < parts && a.n_comm == 0 {
            (world - 1) * part
        } else {
            0
        };
        let own_first = if g >= 1 { ((g - 1) * part).max(own_from) } else { 0 };
        let own_items = if g >= 1 && a.all_reduce != 0 {
            (g * part).saturating_sub(own_first)
        } else {
            0
        };
        while item < seg_start + peer_items + own_items {
            let off = item - seg_start;
            let (dest, mt) = if off < peer_items {
                ((rank + 1 + off / part) % world, g * part + off % part)
            } else {
                (rank, own_first + off - peer_items)
            };
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
pub(super) unsafe fn relay_item(c: &CommCtx, dest: u32, mt: u32, full: u64) -> bool {
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
                let slot = if dest == c.rank {
                    FlagSlot::Tile2
                } else {
                    FlagSlot::Tile1
                };
                memory::red_release_add_u64(
                    Scope::Sys,
                    (c.heap(q) + flag_offset(slot, c.rank, mt)) as *mut u64,
                    full,
                );
            }
            q += 1;
        }
    }
    true
}

/// Between a relay's polls of a counter that is not full yet.
pub(super) const RELAY_SLEEP_NS: u32 = 200;
