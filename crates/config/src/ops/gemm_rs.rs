//! GEMM + ReduceScatter / AllReduce (`mk_gemm_rs_bf16_nk`; device `kernels/gemm_rs/`, host
//! `ops/gemm_rs.rs`): `P_r = A_r * B_r^T` on every rank, reduced over ranks by row chunk. Its launch
//! arguments, kernel spec, shared memory (the GEMM ring, then copies of the descriptor and the
//! arguments, then the work-item table) and the warp-role table.
use crate::comm::CommDesc;
use crate::gemm::{GemmTile, RingLayout, SMEM_ALIGN_SLACK};
use crate::kernels::KernelSpec;
use core::mem::{offset_of, size_of};

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
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
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

/// The ring: the fused register split, one operand stage fewer than the plain GEMM and a whole
/// tile of epilogue staging per consumer warpgroup (4 boxes). Most tiles are stored to peers over
/// NVLink, and a bulk store to a peer finishes reading its staging box only as NVLink takes the
/// data: with a whole tile of staging the epilogue never waits for its own stores, only (at its
/// start) for the previous tile's, which had a mainloop to drain.
pub const TILE: GemmTile = GemmTile {
    stages: 3,
    epilogue_buffers: 4,
    ..GemmTile::FUSED
};
const _: () = TILE.check();

/// Work-item records in the table. Each compute CTA works out its items (tile origin, K range,
/// stream-K owner, A's source row) once at the launch's start; the producer and the consumers
/// read item `w` with two shared-memory loads instead of some 30 integer divisions each; a CTA
/// with more items works the rest out as it goes. 256 cover every CTA of the anchor shapes on 132
/// SMs (M = 32768, N = 28672: 218 tiles per CTA).
pub const ITEM_TABLE_ENTRIES: usize = 256;

/// One work-item record (two 16-byte words, each read or written with one `v4` access).
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ItemRecord {
    /// `[m0, n0, k0, k1]`: the tile's origin (node-blocked rows) and its K blocks.
    pub tile: [u32; 4],
    /// `[flags (ITEM_*), from (first contributor CTA), a_row (A's source row), local_m0 (the
    /// tile's first row inside its chunk)]`.
    pub meta: [u32; 4],
}
/// Flag bits of [`ItemRecord::meta`]`[0]`: this CTA runs the tile's epilogue (stream-K owner).
pub const ITEM_OWNER: u32 = 1;
/// The tile's rows are this rank's chunk (an own tile).
pub const ITEM_OWN: u32 = 2;
/// Stagers do this launch's epilogue I/O.
pub const ITEM_STAGER: u32 = 4;

/// Bytes of the descriptor copy's room (the descriptor, then the launch epoch in the last 8).
pub const DESC_ROOM_BYTES: usize = 128;

/// Shared memory of a CTA. The descriptor and the arguments are copied here by thread 0 at the
/// start and every role reads them here: a shared-memory load does not queue behind the SM's
/// global traffic, as each read of the global ones did (the tensor map addresses are read right
/// before the epilogue's bulk stores).
#[repr(C)]
pub struct GemmRsSmem {
    pub ring: crate::ring_smem!(TILE),
    /// The launch's `CommDesc`.
    pub desc: CommDesc,
    pub _desc_room: [u8; DESC_ROOM_BYTES - 8 - size_of::<CommDesc>()],
    /// The launch epoch (written once per CTA at setup, so no role and no exit reads it from
    /// global memory).
    pub epoch: u64,
    /// The launch's `GemmRsArgs`.
    pub args: GemmRsArgs,
    /// The work-item table of a compute CTA.
    pub items: [ItemRecord; ITEM_TABLE_ENTRIES],
}

/// The ring's offsets (the ring is at offset 0).
pub const RING: RingLayout = <crate::ring_smem!(TILE)>::layout(TILE);
/// Offset of the descriptor copy.
pub const DESC_OFFSET: u32 = offset_of!(GemmRsSmem, desc) as u32;
/// Offset of the launch epoch's copy.
pub const EPOCH_OFFSET: u32 = offset_of!(GemmRsSmem, epoch) as u32;
/// Offset of the argument copy.
pub const ARGS_OFFSET: u32 = offset_of!(GemmRsSmem, args) as u32;
/// Offset of the work-item table.
pub const ITEMS_OFFSET: u32 = offset_of!(GemmRsSmem, items) as u32;
/// Bytes of one work-item record, and offset of its second word.
pub const ITEM_BYTES: u32 = size_of::<ItemRecord>() as u32;
pub const ITEM_META_OFFSET: u32 = offset_of!(ItemRecord, meta) as u32;
/// Dynamic shared memory of a launch.
pub const SMEM_BYTES: u32 = size_of::<GemmRsSmem>() as u32 + SMEM_ALIGN_SLACK;
const _: () = assert!(SMEM_BYTES <= crate::SM90_MAX_SMEM_PER_CTA);
const _: () =
    assert!(offset_of!(GemmRsSmem, ring) == 0 && DESC_OFFSET.is_multiple_of(8) && ARGS_OFFSET.is_multiple_of(8));
const _: () = assert!(size_of::<GemmRsArgs>().is_multiple_of(8) && size_of::<CommDesc>().is_multiple_of(8));
// Comm CTAs run the bulk-copy ring from offset 0, below the GEMM ring's mbarriers (which every
// CTA initializes).
const _: () = assert!(crate::bulk::BULK_SMEM_BYTES <= RING.full);

/// The ring's auxiliary mbarriers (one arrival each; `crate::gemm::AUX_BARRIERS`): "the other
/// nodes' sums have landed" (across nodes; warp 3 arrives, the consumers wait).
pub const AUX_NODE_SUMS: u32 = 0;
/// `AUX_STAGING_READY + cw`: consumer warpgroup `cw`'s staging is ready (a staged peer partial
/// has landed, or with a stager: the staging is free or holds the partial).
pub const AUX_STAGING_READY: u32 = 1;
/// `AUX_TILE_STAGED + cw`: consumer warpgroup `cw` wrote its tile into its staging (with a
/// stager).
pub const AUX_TILE_STAGED: u32 = 3;
const _: () = assert!(AUX_TILE_STAGED + TILE.consumer_warpgroups <= crate::gemm::AUX_BARRIERS as u32);
/// The ring's tick words: ring slots the producer found free in the launch (the consumers'
/// progress, which paces a stager's trickled stores).
pub const TICK_FREE_SLOTS: u32 = 0;
/// Warps of the CTA that finished (the CTA's last one counts the CTA's exit for the launch).
pub const TICK_EXITED_WARPS: u32 = 1;

/// The kernel: the GEMM's launch shape on [`TILE`]; optional comm CTAs, the rest compute.
pub const GEMM_RS_NK: KernelSpec = KernelSpec {
    name: "mk_gemm_rs_bf16_nk",
    max_threads: TILE.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: SMEM_BYTES,
};

/// What a warp of a GEMM+ReduceScatter/AllReduce CTA does. The roles of warps 0-3 (the producer
/// warpgroup, `TILE.producer_regs` registers) run on their lane 0; the others idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Nothing (the warp exits).
    Idle = 0,
    /// Compute CTA, warp 0: the TMA loads of A and B for the consumers' work items.
    Producer = 1,
    /// Compute CTA, warp 1: with stagers the stager of consumer warpgroup 0; across nodes the
    /// sender of node block `idx` (one proxy PUT once the block's tiles are stored).
    StagerOrSender = 2,
    /// Compute CTA, warp 2: the relay (local tile counts turned into the peers' flags), where
    /// relays run.
    Relay = 3,
    /// Compute CTA, warp 3: with stagers the stager of consumer warpgroup 1; across nodes the
    /// receiver of the other nodes' sums of this rank's rows.
    StagerOrReceiver = 4,
    /// Compute CTA, warps 4-11: consumer warpgroups 0 and 1 (all threads: the mainloop and the
    /// epilogue).
    Consumer = 5,
    /// Comm CTA (the first `n_comm`), warp 4: its lane 0 copies the partials' row tiles to the
    /// local peers (bulk-copy ring), with the consumers' registers.
    Comm = 6,
}

/// Warps of a CTA.
pub const WARPS: usize = (TILE.threads() / crate::WARP_SIZE) as usize;

/// A compute CTA's warps, by index.
pub const COMPUTE_WARPS: [Role; WARPS] = [
    Role::Producer,
    Role::StagerOrSender,
    Role::Relay,
    Role::StagerOrReceiver,
    Role::Consumer,
    Role::Consumer,
    Role::Consumer,
    Role::Consumer,
    Role::Consumer,
    Role::Consumer,
    Role::Consumer,
    Role::Consumer,
];

/// A comm CTA's warps, by index.
pub const COMM_WARPS: [Role; WARPS] = [
    Role::Idle,
    Role::Idle,
    Role::Idle,
    Role::Idle,
    Role::Comm,
    Role::Idle,
    Role::Idle,
    Role::Idle,
    Role::Idle,
    Role::Idle,
    Role::Idle,
    Role::Idle,
];

// The producer warpgroup (`TILE.producer_regs`) holds the one-thread roles, the consumer
// warpgroups hold the consumers and a comm CTA's mover (which runs with their registers).
const _: () = {
    let mut w = 0;
    while w < WARPS {
        assert!(
            role(false, w as u32) as u8 == COMPUTE_WARPS[w] as u8 && role(true, w as u32) as u8 == COMM_WARPS[w] as u8
        );
        let producer_wg = w < 4;
        let c = COMPUTE_WARPS[w];
        assert!(
            producer_wg != matches!(c, Role::Consumer),
            "consumers fill the consumer warpgroups"
        );
        assert!(!matches!(c, Role::Comm) && !matches!(COMM_WARPS[w], Role::Consumer | Role::Producer));
        assert!(
            !matches!(COMM_WARPS[w], Role::Comm) || !producer_wg,
            "the mover needs consumer registers"
        );
        w += 1;
    }
};

/// The consumer warpgroup (0-based) whose epilogue I/O the stager in warp `warp` does (warps 1
/// and 3: [`Role::StagerOrSender`], [`Role::StagerOrReceiver`]).
#[inline(always)]
pub const fn stager_consumer(warp: u32) -> u32 {
    warp / 2
}
const _: () = assert!(
    matches!(COMPUTE_WARPS[1], Role::StagerOrSender)
        && matches!(COMPUTE_WARPS[3], Role::StagerOrReceiver)
        && stager_consumer(1) == 0
        && stager_consumer(3) == 1
);

/// A role table packed into one word, 4 bits per warp (what the device reads: a shift of a
/// constant, where indexing the array would load a table from global memory).
const fn pack(table: &[Role; WARPS]) -> u64 {
    let (mut w, mut packed) = (0, 0u64);
    while w < WARPS {
        packed |= (table[w] as u64) << (4 * w);
        w += 1;
    }
    packed
}
const COMPUTE_PACKED: u64 = pack(&COMPUTE_WARPS);
const COMM_PACKED: u64 = pack(&COMM_WARPS);
const _: () = assert!(WARPS * 4 <= 64);

/// The role of warp `warp` of a comm CTA or a compute CTA (`Idle` past the last warp).
#[inline(always)]
pub const fn role(comm_cta: bool, warp: u32) -> Role {
    if warp as usize >= WARPS {
        return Role::Idle;
    }
    let packed = if comm_cta { COMM_PACKED } else { COMPUTE_PACKED };
    let v = ((packed >> (4 * warp)) & 0xf) as u8;
    // SAFETY: `v` is the discriminant of a `Role` of the table (`pack`), and `Role` is `repr(u8)`.
    unsafe { core::mem::transmute::<u8, Role>(v) }
}

/// Rows of one bulk store issued by a stager (a piece of a 64-row staging box; the host
/// encodes the receive-buffer and output maps with this box height where stagers run). A bulk
/// store that crosses NVLink holds the SM's TMA unit while NVLink takes its bytes, and the
/// mainloop's operand loads queue behind it: smaller pieces, spread over the mainloop, hold it
/// up for less at a time. A multiple of 8 (the 128-byte swizzle's 1024-byte atom).
pub const STAGER_STORE_ROWS: u32 = 64;
const _: () =
    assert!(GemmTile::EPILOGUE_BOX_ROWS.is_multiple_of(STAGER_STORE_ROWS) && STAGER_STORE_ROWS.is_multiple_of(8));

/// Bytes of one consumer warpgroup's stream-K partial: 128 threads x 128 f32 accumulators.
pub const SK_SLOT_BYTES: u64 = 128 * 128 * 4;

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

/// Whether every work item of every compute CTA fits GEMM+ReduceScatter/AllReduce's item table
/// ([`ITEM_TABLE_ENTRIES`]): the stagers read their items from it alone (no fallback
/// that works them out), so the host runs stagers only then. A CTA has at most
/// `ceil(tiles / grid)` whole tiles and, with a stream-K tail, at most 3 pieces (its range is
/// at most 1.5 tiles of K long: [`crate::stream_k::StreamK::choose`]).
pub const fn stager_items_fit(tiles: u32, grid: u32) -> bool {
    grid > 0 && tiles.div_ceil(grid) + 3 <= ITEM_TABLE_ENTRIES as u32
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    #[test]
    fn stager_items_fit_bounds_every_plan_and_the_anchor_shapes_fit() {
        use crate::stream_k::StreamK;
        // M = 32768, N = 28672 (ANCHORS.md) on 132 SMs fits; one CTA past the table does not.
        assert!(super::stager_items_fit(256 * 112, 132));
        let cap = ITEM_TABLE_ENTRIES as u32;
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
    fn the_role_tables_place_every_role_where_the_kernel_expects_it() {
        // Lane 0 of warps 0-3 of a compute CTA: producer, stager/sender, relay, stager/receiver;
        // warps 4-11 consume; a comm CTA moves data from warp 4 alone.
        let compute: std::vec::Vec<Role> = (0..WARPS as u32).map(|w| role(false, w)).collect();
        assert_eq!(
            &compute[..4],
            &[
                Role::Producer,
                Role::StagerOrSender,
                Role::Relay,
                Role::StagerOrReceiver
            ]
        );
        assert!(compute[4..].iter().all(|&r| r == Role::Consumer));
        let comm: std::vec::Vec<u32> = (0..WARPS as u32).filter(|&w| role(true, w) != Role::Idle).collect();
        assert_eq!(comm, [4]);
        assert_eq!(role(true, 4), Role::Comm);
        assert_eq!((role(false, WARPS as u32), role(true, 99)), (Role::Idle, Role::Idle));
        assert_eq!(WARPS as u32 * crate::WARP_SIZE, TILE.threads());
    }
    #[test]
    fn the_shared_memory_struct_keeps_its_pieces_apart_and_fits() {
        // Ring, descriptor room, epoch, arguments and item table follow each other.
        assert_eq!(DESC_OFFSET, RING.tick + 4 * crate::gemm::TICK_WORDS as u32);
        assert_eq!(EPOCH_OFFSET, DESC_OFFSET + DESC_ROOM_BYTES as u32 - 8);
        assert_eq!(ARGS_OFFSET, DESC_OFFSET + DESC_ROOM_BYTES as u32);
        assert!(ARGS_OFFSET + core::mem::size_of::<GemmRsArgs>() as u32 <= ITEMS_OFFSET);
        assert_eq!(ITEMS_OFFSET % 16, 0);
        assert_eq!((ITEM_BYTES, ITEM_META_OFFSET), (32, 16));
        assert_eq!(
            SMEM_BYTES,
            ITEMS_OFFSET + ITEM_TABLE_ENTRIES as u32 * ITEM_BYTES + crate::gemm::SMEM_ALIGN_SLACK
        );
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
