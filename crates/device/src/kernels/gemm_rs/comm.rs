//! A comm CTA of GEMM+ReduceScatter/AllReduce: copies the partials' row tiles from the outbox to
//! the local peers.
use super::shared::{fused_ctx_at, ldesc, lepoch, HALVES};
use crate::arch::memory::Scope;
use crate::arch::{ids, memory, smem};
use crate::comm::bulk::{BulkRing, Release};
use crate::comm::wait::wait_flag_of_cta;
use crate::gemm::TILE;
use mkernel_config::comm::{flag_offset, FlagSlot, Role};
use mkernel_config::ops::gemm_rs::GemmRsArgs;

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
pub(super) unsafe fn run(a: &GemmRsArgs) {
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
