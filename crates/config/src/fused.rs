//! Launch arguments of the fused kernels, shared by the device and the host.

/// `mk_ag_gemm_bf16_nk`'s argument block (device memory; the kernel gets its address).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct AgGemmArgs {
    /// Device address of the rank's `CommDesc`.
    pub desc: u64,
    /// This rank's shard of A (local, `m / world` x `k` bf16).
    pub a_shard: u64,
    /// Heap offset of the gathered A (`m` x `k`) on every rank.
    pub a_gathered_off: u64,
    /// Tensor maps (global memory): A over the gathered buffer (box 64 x 128), B as N x K
    /// (box 64 x 256), C (box 64 x 64).
    pub map_a: u64,
    /// A over this rank's shard itself (box 64 x 128): its tiles are read in place, not copied.
    pub map_a_local: u64,
    pub map_b: u64,
    pub map_c: u64,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// CTAs that move A; the rest of the grid computes.
    pub n_comm: u32,
}

/// `mk_gemm_rs_bf16_nk`'s argument block: `P_r = A_r * B_r^T` (M x N, K split over ranks),
/// reduced over ranks by row chunk: global rank g gets rows `[g * Mg, (g + 1) * Mg)`,
/// `Mg = M / global_world`. CTAs `0..n_comm` move the partials' row tiles to the local peers
/// with bulk copies; the others compute. A rank's own tiles are computed after its peers sent their
/// partials of them, and the epilogue adds those in (no reducer CTAs).
///
/// The kernel works in *node-blocked* rows ([`rs_source_row`]): local rank `l`'s chunk of
/// `M / world` rows is its rail's global chunks (`l` on every node), other nodes' first, own
/// node's last, so one node's partials of a rail's rows are summed on that rail's rank before
/// they cross nodes. One node: the plain rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct GemmRsArgs {
    /// Device address of the rank's `CommDesc`.
    pub desc: u64,
    /// Tensor maps: A (M x K_local, box 64 x 128), B as N x K_local (box 64 x 256).
    pub map_a: u64,
    pub map_b: u64,
    /// The outbox (local, `M` node-blocked rows x N bf16, box 64 x 64): a partial tile for
    /// local peer `d` is stored at its own row (chunk `d`'s rows), from where comm CTAs copy
    /// whole row tiles into `d`'s receive buffer, or (`pull`) `d` reads it over NVLink.
    pub map_outbox: u64,
    /// Without comm CTAs (`n_comm = 0`): `map_recv[p]`, this rank's slot in local rank p's
    /// receive buffer (`M / world` rows x N bf16, box 64 x 64; a peer's over NVLink), where
    /// the compute CTAs store their partials for p directly.
    pub map_recv: [u64; 8],
    /// Where the reduced rows of this rank's global chunk go (`Mg` x N bf16, box 64 x 64):
    /// ReduceScatter: `map_out[0]`, the local output. AllReduce: `map_out[p]`, the rows of this
    /// rank's chunk in local rank p's output (a heap buffer; a peer's over NVLink).
    pub map_out: [u64; 8],
    /// Across nodes: this rank's node sums of its rail's rows of the other nodes, `(nodes - 1) x
    /// Mg` rows x N bf16 in the heap (box 64 x 64; the proxy's PUT source). 0 on one node.
    pub map_stage: u64,
    /// This rank's receive buffer (local, `world` slots of `M / world` x N bf16, box 64 x 64):
    /// an own tile TMA-loads the peers' partials into its epilogue staging one after another
    /// (the first, `(rank + 1) % world`'s, during its mainloop). Pulled: the first peer's outbox
    /// (all `M` rows, as mapped here) instead. 0 on one rank.
    pub map_in: u64,
    /// Heap offsets: the receive buffer (`world` slots of `M / world` x N bf16); across nodes
    /// the node-sum stage above, the remote receive buffer (`nodes` blocks of `Mg` x N: block
    /// `i` is node `i`'s sum of this rank's rows) and, for AllReduce, the `M` x N output.
    pub recv_off: u64,
    /// Heap offset of the outbox (`M` x N bf16).
    pub outbox_off: u64,
    pub stage_off: u64,
    pub xrecv_off: u64,
    pub out_off: u64,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Tile rows per part of the chunked tile order (`TileScheduler::chunked`): smaller parts
    /// reduce (and, for AllReduce, broadcast) earlier; larger ones leave peers more slack.
    /// Across nodes a part never straddles two nodes' blocks (`Mg / 128` is a multiple of it).
    pub part_tiles_m: u32,
    /// 1: GEMM + AllReduce (every rank gets the whole sum), 0: GEMM + ReduceScatter.
    pub all_reduce: u32,
    /// Comm CTAs (the first `n_comm` of the grid; 0 on one rank).
    pub n_comm: u32,
    /// Tile rows per rasterization group inside a block (1: a row tile completes every
    /// `tiles_n` tiles, so comm CTAs get a steady stream; larger: more L2 reuse of B).
    pub group_m: u32,
    /// 1: partials are pulled (requires `n_comm = 0`): a peer tile is stored into the local
    /// outbox and announced at the peer, whose own tile reads it from here over NVLink
    /// (`map_in` is then the first peer's outbox as mapped here). 0: pushed (above).
    pub pull: u32,
    /// Device address of a per-tile timeline buffer ([`crate::trace`]), 0: none (the default).
    pub trace: u64,
    /// 1: each consumer warpgroup's epilogue I/O (bulk stores, announcements, partial loads)
    /// is handed to a stager thread (one node of 2 ranks, pushed without comm CTAs); 0: the
    /// consumers do it.
    pub stager: u32,
    /// Tiles at the end of the order computed stream-K ([`crate::stream_k::StreamK`]; 0:
    /// none). Only with stagers (the device ignores it otherwise).
    pub sk_tiles: u32,
    /// Device address of the stream-K workspace: `grid x consumer_warpgroups` slots of
    /// [`SK_SLOT_BYTES`] (a contributor warpgroup's f32 accumulators, thread-major). 0: none.
    pub sk_ws: u64,
}

/// Rows of one bulk store issued by a stager (a piece of a 64-row staging box; the host
/// encodes the receive-buffer and output maps with this box height where stagers run). A bulk
/// store that crosses NVLink holds the SM's TMA unit while NVLink takes its bytes, and the
/// mainloop's operand loads queue behind it: smaller pieces, spread over the mainloop, hold it
/// up for less at a time. A multiple of 8 (the 128-byte swizzle's 1024-byte atom).
pub const STAGER_STORE_ROWS: u32 = 64;
const _: () = assert!(crate::GemmTile::EPILOGUE_BOX_ROWS % STAGER_STORE_ROWS == 0 && STAGER_STORE_ROWS % 8 == 0);

/// Bytes of one consumer warpgroup's stream-K partial: 128 threads x 128 f32 accumulators.
pub const SK_SLOT_BYTES: u64 = 128 * 128 * 4;

const _: () = assert!(
    core::mem::size_of::<GemmRsArgs>() as u32 <= crate::GemmTile::ARGS_COPY_BYTES
        && core::mem::size_of::<GemmRsArgs>() % 8 == 0
);

/// The row of A (and of the sum) that node-blocked row `v` of GEMM+ReduceScatter/AllReduce is,
/// on node `node` of `nodes` with `world` ranks each: `v` lies in local rank `l`'s chunk
/// (`M / world` rows), in its `j`-th block of `Mg = M / (world x nodes)` rows; block `j` holds
/// global chunk `(node + 1 + j) % nodes x world + l` (the own node's block last).
pub const fn rs_source_row(v: u32, m: u32, world: u32, nodes: u32, node: u32) -> u32 {
    let chunk = m / world;
    let mg = chunk / nodes;
    let (l, local) = (v / chunk, v % chunk);
    let (j, i) = (local / mg, local % mg);
    ((node + 1 + j) % nodes * world + l) * mg + i
}

/// GEMM+ReduceScatter/AllReduce's comm CTAs by default (`world` local ranks): none. The
/// compute CTAs store the partials straight into the peers' receive buffers (on one node of 2
/// ranks through their stagers); comm CTAs take SMs from the GEMM and were slower in the
/// benchmark's sweeps (docs/fused.md).
pub const fn rs_comm_ctas(world: u32, all_reduce: bool) -> u32 {
    let _ = (world, all_reduce);
    0
}

/// AllGather+GEMM comm CTAs move the shard with TMA bulk copies through a ring of
/// `BULK_STAGES` shared-memory stages of `BULK_STAGE_BYTES` (plus one mbarrier per stage), in
/// the dynamic shared memory the launch already has for the GEMM's compute CTAs. Loads run
/// `BULK_LOOKAHEAD` pieces ahead; the other stages are read by stores in flight (a store to a
/// peer finishes reading shared memory only as NVLink takes the data, so a CTA's bandwidth
/// grows with the bytes it keeps in flight).
pub const BULK_STAGES: u32 = 12;
/// Bytes per bulk-copy stage (a multiple of 16).
pub const BULK_STAGE_BYTES: u32 = 16 << 10;
/// Pieces loaded ahead of the one being stored.
pub const BULK_LOOKAHEAD: u32 = 3;
const _: () = assert!(BULK_STAGE_BYTES % 16 == 0 && BULK_LOOKAHEAD >= 1 && BULK_LOOKAHEAD < BULK_STAGES);
const _: () = assert!(BULK_STAGES * (BULK_STAGE_BYTES + 8) <= crate::GemmTile::FUSED.smem_bytes());
// GEMM+ReduceScatter/AllReduce comm CTAs run the same ring below their (unused) GEMM ring's
// mbarriers, which every CTA initializes.
const _: () = assert!(BULK_STAGES * (BULK_STAGE_BYTES + 8) <= crate::GemmTile::FUSED_RS.barrier_offset());

/// Whether every work item of every compute CTA fits GEMM+ReduceScatter/AllReduce's item table
/// (`GemmTile::item_table_entries`): the stagers read their items from it alone (no fallback
/// that works them out), so the host runs stagers only then. A CTA has at most
/// `ceil(tiles / grid)` whole tiles and, with a stream-K tail, at most 3 pieces (its range is
/// at most 1.5 tiles of K long: [`crate::stream_k::StreamK::choose`]).
pub const fn stager_items_fit(tiles: u32, grid: u32) -> bool {
    grid > 0 && tiles.div_ceil(grid) + 3 <= crate::GemmTile::FUSED_RS.item_table_entries
}

#[cfg(test)]
mod tests {
    use super::rs_source_row;
    #[test]
    fn stager_items_fit_bounds_every_plan_and_the_anchor_shapes_fit() {
        use crate::stream_k::StreamK;
        // M = 32768, N = 28672 (ANCHORS.md) on 132 SMs fits; one CTA past the table does not.
        assert!(super::stager_items_fit(256 * 112, 132));
        let cap = crate::GemmTile::FUSED_RS.item_table_entries;
        assert!(!super::stager_items_fit((cap - 2) * 10, 10));
        // The bound holds for every plan `choose` makes.
        for grid in [1u32, 7, 64, 132] {
            for tiles in 1..(cap * grid).min(6000) {
                for kb in [4u32, 9, 64] {
                    let sk = StreamK::new(tiles, grid, kb, StreamK::choose(tiles, grid, kb));
                    let most = (0..grid).map(|c| sk.items(c)).max().unwrap();
                    assert!(
                        most <= tiles.div_ceil(grid) + 3,
                        "tiles {tiles} grid {grid} kb {kb}: {most} items"
                    );
                }
            }
        }
    }
    #[test]
    fn node_blocked_rows_are_a_permutation_with_the_own_node_last() {
        for (world, nodes) in [(1, 1), (4, 1), (1, 2), (2, 2), (4, 2), (2, 3), (8, 4)] {
            let m = world * nodes * 256;
            let mg = m / world / nodes;
            for node in 0..nodes {
                let mut seen = [false; 8 * 4 * 256];
                for v in 0..m {
                    let r = rs_source_row(v, m, world, nodes, node);
                    assert!(!seen[r as usize], "world {world} nodes {nodes}: row {r} twice");
                    seen[r as usize] = true;
                    // Local rank l's chunk holds only global chunks of local rank l.
                    assert_eq!((r / mg) % world, v / (m / world));
                }
                // The last block of every local rank's chunk is its own node's chunk.
                for l in 0..world {
                    let v = l * (m / world) + (nodes - 1) * mg;
                    assert_eq!(rs_source_row(v, m, world, nodes, node), (node * world + l) * mg);
                }
            }
            if nodes == 1 {
                assert!((0..m).all(|v| rs_source_row(v, m, world, 1, 0) == v));
            }
        }
    }
}
