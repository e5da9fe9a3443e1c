//! A comm CTA of AllGather+GEMM: pushes this rank's shard of A to the local peers (and, across
//! nodes, stages it for the proxy's PUTs to the remote ranks).
use crate::arch::{ids, memory, memory::Scope, smem};
use crate::comm::bulk::BulkRing;
use crate::comm::wait::wait_flag_of_cta;
use crate::comm::{proxy, CommCtx};
use crate::gemm::TILE;
use mkernel_config::comm::{flag_offset, FlagSlot, RemoteSlot};
use mkernel_config::ops::ag_gemm::AgGemmArgs;

/// Pushes this rank's shard, chunk by chunk, to every local peer with TMA bulk copies (thread 0
/// of each comm CTA; [`BulkRing`]), in the order the peers need it: rank `r` visits its own
/// rows first, then local rank `r + 1`'s, so local rank `r - 1` gets this shard first.
/// Across nodes (`global_world > world`), first every comm CTA stages its chunks in this rank's
/// own gathered buffer (the proxy's source) and raises `(Tile1, rank, chunk)` locally; comm
/// CTA 0 raises `FusedReady` at every remote rank, and once the whole shard is staged and a
/// remote rank's `FusedReady` arrived, posts one PUT of the shard to it, raising `FusedData`
/// there; it waits for the proxy to finish the puts before the launch ends.
#[inline(always)]
pub(super) unsafe fn run(c: &CommCtx, a: &AgGemmArgs, idx: u32, chunks: u32, row_bytes: u64) {
    let t = ids::thread_idx();
    unsafe {
        // Our gathered buffer is free (our previous launch ended): tell the local peers.
        if idx == 0 && t < c.world && t != c.rank {
            memory::st_release_u64(
                Scope::Sys,
                (c.heap(t) + flag_offset(FlagSlot::FusedReady, c.rank, 0)) as *mut u64,
                c.epoch,
            );
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
                        last_put = proxy::put_value(
                            c,
                            q,
                            off,
                            off,
                            chunks as u64 * chunk_bytes,
                            RemoteSlot::FusedData,
                            c.epoch,
                        );
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
                memory::st_release_u64(
                    Scope::Sys,
                    (c.heap(p) + flag_offset(FlagSlot::Tile0, c.rank, j)) as *mut u64,
                    c.epoch,
                );
                j += a.n_comm;
            }
        }
        if let Some(seq) = last_put {
            // The launch ends only when the proxy has read our shard (the next launch restages it).
            let _ = proxy::wait_done(c, seq);
        }
    }
}
