//! The producer of an AllGather+GEMM compute CTA (thread 0): per tile, waits (bounded) until
//! its rows of A have arrived, then issues the TMA loads of A and B into the ring.
use super::schedule;
use crate::arch::{memory, tma::TensorMap};
use crate::comm::launch::{fused_ctx, producer_stall};
use crate::comm::wait::wait_flag_of_cta;
use crate::comm::{proxy, CommCtx};
use crate::gemm::producer::{fill_without_data, load_tile};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::{BLayout, TILE};
use mkernel_config::comm::{FlagSlot, RemoteSlot, Role};
use mkernel_config::ops::ag_gemm::AgGemmArgs;

/// The producer loop of compute CTA `idx`; `maps`: A over the gathered buffer, A over this
/// rank's shard, B.
#[inline(always)]
pub(super) unsafe fn run(a: &AgGemmArgs, idx: u32, ring: &Ring, pos: RingPos, maps: [TensorMap; 3]) {
    let [map_a, map_a_local, map_b] = maps;
    let ring = *ring;
    let mut pos = pos;
    let (world, global_rank, shard_rows, tiles, k_blocks) = schedule(a, idx);
    // The context is built only where a wait needs it (once per chunk or remote
    // shard): kept across the loop it would not fit the producer's 56 registers.
    let mut ready_row: u32 = u32::MAX; // last tile row known to have arrived
    let mut remote_ready: u32 = u32::MAX; // last remote shard known to have arrived
                                          // AllGather+GEMM's consumers never stop early: the producer's waits give up only once hung.
    let give_up = producer_stall(a.desc);
    let mut tiles = tiles;
    while let Some(tile) = tiles.next() {
        let src = tile.m0 / shard_rows; // global rank
        let mut arrived = true;
        if src == global_rank {
            // Our own rows: read the shard in place.
            if !unsafe {
                load_tile(
                    &ring,
                    &mut pos,
                    map_a_local,
                    tile.m0 - src * shard_rows,
                    map_b,
                    BLayout::Nk,
                    tile,
                    k_blocks,
                    give_up,
                )
            } {
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
        if !unsafe {
            load_tile(
                &ring,
                &mut pos,
                map_a,
                tile.m0,
                map_b,
                BLayout::Nk,
                tile,
                k_blocks,
                give_up,
            )
        } {
            break;
        }
    }
}

/// The producer's bounded wait for a chunk. Inline: a call from a warpgroup that gave
/// registers back with `setmaxnreg` may use registers it no longer has.
#[inline(always)]
pub(super) unsafe fn wait_chunk(c: &CommCtx, src: u32, chunk: u32) -> bool {
    unsafe { wait_flag_of_cta(c, FlagSlot::Tile0, src, chunk, c.epoch) }
}
