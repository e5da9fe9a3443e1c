//! Mixture-of-experts expert FFN on one GPU: device-side routing, row gather, grouped expert
//! GEMMs (up projection with SwiGLU or no activation fused in the epilogue, down projection)
//! and the top-k weighted combine. docs/moe.md describes the layouts and the limits.
//!
//! Launch sequence (one stream, no host round trip, capturable in a CUDA graph):
//! 1. `mk_moe_route` (1 CTA): counts per expert, padded offsets (each expert's group starts at
//!    a multiple of [`ROW_ALIGN`] rows), the expert of every row tile, a slot per (token, k)
//!    pair; an out-of-range expert id gets no slot and sets the error record.
//! 2. `mk_moe_gather`: token rows to their slots (one read of a token, `top_k` writes).
//! 3. `mk_moe_grouped_gemm` (up): `Hid[slot] = act(Xp[slot] * W_up[e]^T)`.
//! 4. `mk_moe_grouped_gemm` (down): `Yp[slot] = Hid[slot] * W_down[e]^T`.
//! 5. `mk_moe_combine`: `out[t] = sum_j w[t, j] * Yp[slot(t, j)]`, f32 accumulation.
use crate::gemm::{GemmTile, RingLayout, SMEM_ALIGN_SLACK};
use crate::kernels::KernelSpec;

/// The grouped GEMM's tile configuration: the plain GEMM's tile and ring; the producer keeps 56
/// registers (the consumers 224, the split of `GemmTile::FUSED`): its loop over the tile-expert
/// words and the per-box A loads of the row-granular mode does not fit 40 without spilling.
pub const TILE: GemmTile = GemmTile {
    producer_regs: 56,
    consumer_regs: 224,
    ..GemmTile::DEFAULT
};
/// The grouped GEMM's shared memory: its ring alone.
#[repr(C)]
pub struct GroupedGemmSmem {
    pub ring: crate::ring_smem!(TILE),
}
/// The grouped GEMM ring's offsets.
pub const RING: RingLayout = <crate::ring_smem!(TILE)>::layout(TILE);
/// The grouped GEMM's dynamic shared memory.
pub const GROUPED_GEMM_SMEM_BYTES: u32 = core::mem::size_of::<GroupedGemmSmem>() as u32 + SMEM_ALIGN_SLACK;
const _: () = assert!(GROUPED_GEMM_SMEM_BYTES <= crate::SM90_MAX_SMEM_PER_CTA);
/// Rows of one expert group are padded to a multiple of this (the tile's rows): no row tile
/// holds rows of two experts, so every tile's bulk stores stay inside its expert's group.
pub const ROW_ALIGN: u32 = TILE.block_m;
/// Output columns of one up-projection tile with SwiGLU: the tile's 256 accumulator columns
/// are 128 gate and 128 up columns of the same output columns.
pub const SWIGLU_TILE_COLS: u32 = TILE.block_n / 2;

/// Most experts (the routing kernel keeps a counter and a cursor per expert in shared memory).
pub const MAX_EXPERTS: u32 = 1024;
/// Most experts per token.
pub const MAX_TOP_K: u32 = 32;
/// Threads of the routing kernel (one CTA): one expert per thread in the scan.
pub const ROUTE_THREADS: u32 = 1024;
/// Threads of the gather and combine kernels (each thread moves 16-byte pieces of a row).
pub const ROW_THREADS: u32 = 256;

/// Activation fused into the up projection's epilogue (the low byte of `GroupedGemmArgs::act`;
/// the bits above it are [`mode`] flags).
pub mod act {
    /// `Hid = X W^T`: W has `F` rows per expert.
    pub const NONE: u32 = 0;
    /// `Hid = silu(X Wg^T) * (X Wu^T)`: W has `2F` rows per expert, rows `0..F` gate, `F..2F` up.
    pub const SWIGLU: u32 = 1;
    /// The bits of `GroupedGemmArgs::act` that name the activation.
    pub const MASK: u32 = 0xff;
}

/// How `mk_moe_grouped_gemm` moves a tile's rows (flags in `GroupedGemmArgs::act` above the
/// activation byte; 0: every tile loads and stores all its `TILE.block_m` rows).
pub mod mode {
    /// Row-granular tiles: `map_a` and `map_c` each point to two tensor maps
    /// [`super::PARTIAL_MAP_OFFSET`] bytes apart, the whole-tile one (box 64 x `block_m`,
    /// 64 x 64) and one with a 64 x [`super::PARTIAL_BOX_ROWS`] box. A tile whose last rows are
    /// padding (the tile-expert word's padding count, [`super::TILE_PAD_SHIFT`]) loads and stores
    /// only the `PARTIAL_BOX_ROWS`-row boxes that hold its valid rows, through the second map:
    /// an expert with 16 rows moves 16 rows of A and C, not 128. Full tiles (and full 64-row
    /// halves) move as without the flag. Padding rows are computed on whatever the ring slot
    /// held before and never stored.
    pub const PARTIAL_ROWS: u32 = 1 << 8;
}

/// Rows of one A load and one C store box of a partial tile with [`mode::PARTIAL_ROWS`] (a
/// multiple of 8, the 128-byte swizzle's period, so every box starts on a 1024-byte boundary).
pub const PARTIAL_BOX_ROWS: u32 = 16;
/// With [`mode::PARTIAL_ROWS`]: bytes from a whole-tile tensor map to its `PARTIAL_BOX_ROWS` twin.
pub const PARTIAL_MAP_OFFSET: u64 = 128;
/// A tile-expert word (`MoeRouteArgs::tile_expert`) is `expert | pad << TILE_PAD_SHIFT`, `pad`
/// the padding rows at the end of the tile (0 for a full tile: a word without the field reads as
/// full). Experts fit below it (`MAX_EXPERTS`).
pub const TILE_PAD_SHIFT: u32 = 16;
/// The expert bits of a tile-expert word.
pub const TILE_EXPERT_MASK: u32 = (1 << TILE_PAD_SHIFT) - 1;

/// The error record the routing kernel writes (device memory, 4 words; all zero: no error).
/// The first bad pair wins `flag` (compare-and-swap 0 -> 1) and writes `pair` and `id`; every
/// bad pair adds 1 to `bad`. Sticky until the host clears it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct MoeErrorRecord {
    pub flag: u32,
    /// Index `t * top_k + j` of the first bad pair seen (not necessarily the lowest).
    pub pair: u32,
    /// Its expert id (as given, i32).
    pub id: i32,
    /// Pairs with an out-of-range id in the launches since the record was cleared.
    pub bad: u32,
}

/// `mk_moe_route`'s argument block (device memory; the kernel gets its address). Buffers are
/// device addresses of u32 arrays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
pub struct MoeRouteArgs {
    /// Rows per expert (`experts`).
    pub counts: u64,
    /// Padded first row of every expert's group (`experts + 1`; the last is the total).
    pub offsets: u64,
    /// Expert of every row tile (`max_tiles`; only the first `rows / ROW_ALIGN` are written),
    /// with the tile's padding rows above [`TILE_PAD_SHIFT`].
    pub tile_expert: u64,
    /// One word: padded rows in use (the grouped GEMMs' M).
    pub rows: u64,
    /// Row of pair `t * top_k + j` in the grouped buffers (`u32::MAX`: none, a bad id).
    pub slots: u64,
    /// The [`MoeErrorRecord`].
    pub error: u64,
    /// Pair of every grouped row (`max_tiles x ROW_ALIGN` u32: `t * top_k + j`, `u32::MAX` for
    /// a padding row), for the combine in the down projection's epilogue
    /// (`mk_moe_grouped_gemm_combine`); 0: not written.
    pub row_pair: u64,
    /// `tokens * top_k`.
    pub pairs: u32,
    pub experts: u32,
    pub max_tiles: u32,
    pub _pad: u32,
}

/// `mk_moe_gather`'s argument block: `Xp[slots[t * top_k + j]] = X[t]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
pub struct MoeGatherArgs {
    pub slots: u64,
    /// The grouped rows (`capacity rows x hidden` bf16).
    pub xp: u64,
    pub tokens: u32,
    pub top_k: u32,
    /// Elements per row (a multiple of 8).
    pub hidden: u32,
    pub _pad: u32,
}

/// `mk_moe_grouped_gemm`'s argument block: for every row tile of the grouped A (row tile `i`
/// belongs to expert `tile_expert[i]`), `C = act(A W_e^T)` with W stored as one
/// `experts * b_rows x k` tensor (N x K per expert, `nn.Linear` layout).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
pub struct GroupedGemmArgs {
    /// Tensor maps (global memory): A (capacity rows x k, box 64 x 128), W (`experts * b_rows`
    /// x k, box 64 x 256, or 64 x 128 with SwiGLU: the gate and up halves load separately),
    /// C (capacity rows x n, box 64 x 64).
    pub map_a: u64,
    pub map_b: u64,
    pub map_c: u64,
    /// One word: rows of A in use (padded; written by the routing kernel).
    pub rows: u64,
    /// Expert of every row tile (and its padding rows: [`TILE_PAD_SHIFT`]).
    pub tile_expert: u64,
    /// Columns of C (`F` up, `H` down).
    pub n: u32,
    /// The reduction length (`H` up, `F` down).
    pub k: u32,
    /// Rows of W per expert (`2F` SwiGLU, `F` none, `H` down).
    pub b_rows: u32,
    /// [`act`] in the low byte, [`mode`] flags above it.
    pub act: u32,
    /// For `mk_moe_grouped_gemm_combine`: the pair of every grouped row (`MoeRouteArgs::row_pair`).
    pub row_pair: u64,
    /// For `mk_moe_grouped_gemm_combine`: experts per token (a row's pair `p` is token `p / top_k`).
    pub top_k: u32,
    pub _pad: u32,
}

/// `mk_moe_combine`'s argument block: `out[t] = sum_j w[t * top_k + j] * Yp[slots[..]]`
/// (the weights, the output and its type - `f32_out` - are launch parameters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
pub struct MoeCombineArgs {
    pub slots: u64,
    /// The down projection's grouped rows (`capacity rows x hidden` bf16).
    pub yp: u64,
    pub tokens: u32,
    pub top_k: u32,
    pub hidden: u32,
    pub _pad: u32,
}

/// Shared memory of `mk_moe_route` (dynamic, this struct at its base).
#[repr(C)]
pub struct RouteSmem {
    /// Rows per expert.
    pub counts: [u32; MAX_EXPERTS as usize],
    /// Next free row of every expert's group (starts at its padded offset).
    pub cursor: [u32; MAX_EXPERTS as usize],
    /// Per-warp totals of the tile scan.
    pub warp_tiles: [u32; (ROUTE_THREADS / crate::WARP_SIZE) as usize],
}

/// Byte offsets inside [`RouteSmem`] (what the device code addresses).
pub const ROUTE_SMEM_COUNTS: u32 = core::mem::offset_of!(RouteSmem, counts) as u32;
pub const ROUTE_SMEM_CURSOR: u32 = core::mem::offset_of!(RouteSmem, cursor) as u32;
pub const ROUTE_SMEM_WARP_TILES: u32 = core::mem::offset_of!(RouteSmem, warp_tiles) as u32;
pub const ROUTE_SMEM_BYTES: u32 = core::mem::size_of::<RouteSmem>() as u32;

/// One warp role of a kernel: warpgroups `first..first + count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Role {
    pub name: &'static str,
    pub first_warpgroup: u32,
    pub warpgroups: u32,
}

/// Roles of `mk_moe_grouped_gemm` (the plain GEMM's split).
pub const GROUPED_GEMM_ROLES: [Role; 2] = [
    Role {
        name: "producer",
        first_warpgroup: 0,
        warpgroups: 1,
    },
    Role {
        name: "consumer",
        first_warpgroup: 1,
        warpgroups: TILE.consumer_warpgroups,
    },
];

/// Index into [`GROUPED_GEMM_ROLES`] of warpgroup `wg`.
pub const fn grouped_gemm_role(wg: u32) -> usize {
    if wg == 0 {
        0
    } else {
        1
    }
}

pub const MOE_ROUTE: KernelSpec = KernelSpec {
    name: "mk_moe_route",
    max_threads: ROUTE_THREADS,
    min_blocks_per_sm: 1,
    dynamic_smem: ROUTE_SMEM_BYTES,
};
/// The grouped GEMM alone: its groups' padded offsets and tiles from rows per group.
pub const MOE_GROUP_TILES: KernelSpec = KernelSpec {
    name: "mk_moe_group_tiles",
    ..MOE_ROUTE
};
pub const MOE_GATHER: KernelSpec = KernelSpec {
    name: "mk_moe_gather",
    max_threads: ROW_THREADS,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};
pub const MOE_GROUPED_GEMM: KernelSpec = KernelSpec {
    name: "mk_moe_grouped_gemm",
    max_threads: TILE.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: GROUPED_GEMM_SMEM_BYTES,
};
pub const MOE_COMBINE: KernelSpec = KernelSpec {
    name: "mk_moe_combine",
    max_threads: ROW_THREADS,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};
/// The down projection with the combine in its epilogue: C is not stored; every row's
/// accumulators, times its pair's router weight, are added (`red.global.add.v4.f32`) into its
/// token's f32 output row, zeroed before the launch. The top-k sum is f32 but its order is
/// whatever order the tiles finish in: not bitwise reproducible (`mk_moe_combine` is).
pub const MOE_GROUPED_GEMM_COMBINE: KernelSpec = KernelSpec {
    name: "mk_moe_grouped_gemm_combine",
    ..MOE_GROUPED_GEMM
};
/// f32 sums of the fused combine to a bf16 output (`mk_moe_to_bf16`).
pub const MOE_TO_BF16: KernelSpec = KernelSpec {
    name: "mk_moe_to_bf16",
    ..MOE_COMBINE
};

/// Expert parallelism (docs/moe.md, "Across ranks"): most CTAs of the dispatch and the combine
/// kernels (one rows flag and one output flag per source rank and CTA).
pub const EP_MAX_CTAS: u32 = 256;
/// Most ranks of one node in an expert-parallel layer (its flags are per local rank).
pub const EP_MAX_RANKS: u32 = crate::comm::MAX_LOCAL_RANKS;
// The fused dispatch counts a pass's rows per owner on the node in lane `owner` of a warp.
const _: () = assert!(EP_MAX_RANKS <= crate::WARP_SIZE);
/// Most ranks of an expert-parallel layer in all nodes (the proxy's remote flags are per
/// global rank; the kernels give a thread to every rank).
pub const EP_MAX_WORLD: u32 = crate::comm::MAX_RANKS;

/// `mk_moe_ep_route`, `mk_moe_ep_dispatch` and `mk_moe_ep_combine`'s argument block (device
/// memory). Local buffers are device addresses; `heap_*` are offsets into every rank's
/// symmetric heap (the same on every rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
pub struct MoeEpArgs {
    /// The receive layout of this rank's local experts, written by the routing kernel with
    /// [`MoeRouteArgs`]'s meaning (`experts` = local experts, `max_tiles` = receive capacity in
    /// row tiles, `error` a scratch record: cut groups are counted in `drops` instead).
    pub layout: MoeRouteArgs,
    /// One `u64`: the layer's launch epoch (the routing kernel advances it; the others read it).
    pub epoch: u64,
    /// `u32` per pair: its row in the receive buffer of the rank owning its expert
    /// (`u32::MAX`: bad id or dropped).
    pub pos: u64,
    /// Two `u32`: this launch's pairs of this rank dropped for want of receive capacity at
    /// their owner, and rows sent to this rank that it dropped.
    pub drops: u64,
    /// The [`MoeErrorRecord`] of bad expert ids.
    pub error: u64,
    /// Heap offsets: the flags ([`ep_flag`]), the count matrix (`world x experts` u32: row `s`
    /// written by rank `s`), the received rows (`capacity x hidden` bf16), the down
    /// projection's rows (`capacity x hidden` bf16, read back by the source ranks).
    pub heap_flags: u64,
    pub heap_counts: u64,
    pub heap_recv: u64,
    pub heap_yp: u64,
    pub tokens: u32,
    pub top_k: u32,
    pub hidden: u32,
    /// Experts of the whole layer (`world x local_experts`).
    pub experts: u32,
    pub local_experts: u32,
    /// Receive capacity in rows (a multiple of [`ROW_ALIGN`]).
    pub capacity: u32,
    /// Across nodes (ranks on other nodes, reached through the proxy; all 0 on one node):
    /// `u32` per pair: its row in this rank's transfer rows (`heap_xfer`), where a pair whose
    /// owner is on another node is staged for the PUT and its result lands.
    pub xrow: u64,
    /// [`EpSend`] per expert of the layer: this rank's rows of the expert (the PUT to its owner).
    pub send: u64,
    /// [`EpSend`] per (source rank, local expert), `source * local_experts + l`: the rows of
    /// that source in this rank's down projection (the PUT back into the source's transfer rows).
    pub ret: u64,
    /// One `u32`: CTAs of the dispatch that finished their stores (the last one posts the PUTs
    /// and resets it).
    pub exits: u64,
    /// One `u64`: the combine's relay of the remote `Out` flags (CTA 0 waits on the proxy's
    /// flags and stores the epoch here; the other CTAs wait on this word).
    pub relay: u64,
    /// Heap offset of the transfer rows (`tokens x top_k` rows of `hidden` bf16).
    pub heap_xfer: u64,
    /// Heap offset of the arrival counters (`u64` per local expert, only grow): rows of the
    /// expert that the node's ranks stored into this rank's receive rows, added by the fused
    /// dispatch ([`MOE_EP_DISPATCH_UP`]) after each CTA's stores (`red.release.sys`).
    pub heap_arrival: u64,
    /// Fused plans only (0 otherwise): two `u64` per local expert, written by the routing
    /// kernel: the arrival counter's value once this launch's rows from the node have landed
    /// (the running sum of every launch's), and this launch's rows from other nodes.
    pub target: u64,
}

/// One contiguous run of rows between two ranks on different nodes (in units of rows of
/// `hidden` bf16): `rows` rows from row `src` of the sender's buffer to row `dst` of the
/// receiver's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
pub struct EpSend {
    pub src: u32,
    pub dst: u32,
    pub rows: u32,
}

/// The flags of an expert-parallel layer in its heap region (`u64` epochs, written by the
/// source rank only, read by their owner): `Ready` (the source entered this launch: it no
/// longer reads my buffers and its own are free), `Counts` (its row of the count matrix is
/// in my heap), `Rows` per CTA (its CTA's token rows are in my receive buffer), `Out` per CTA
/// (its down projection's rows are final: I may read them back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum EpFlag {
    Ready = 0,
    Counts = 1,
    Rows = 2,
    Out = 3,
}

/// Byte offset inside the flag region of flag `(kind, src, cta)` (`cta` 0 for Ready and Counts).
pub const fn ep_flag(kind: EpFlag, src: u32, cta: u32) -> u64 {
    let slot = match kind {
        EpFlag::Ready => src,
        EpFlag::Counts => EP_MAX_RANKS + src,
        EpFlag::Rows => 2 * EP_MAX_RANKS + src * EP_MAX_CTAS + cta,
        EpFlag::Out => 2 * EP_MAX_RANKS + EP_MAX_RANKS * EP_MAX_CTAS + src * EP_MAX_CTAS + cta,
    };
    slot as u64 * 8
}
/// Bytes of the flag region.
pub const EP_FLAG_BYTES: u64 = ep_flag(EpFlag::Out, EP_MAX_RANKS - 1, EP_MAX_CTAS - 1) + 8;

/// Shared memory of `mk_moe_ep_route`: the routing's struct first (its group placement is
/// reused for the receive layout), then per expert of the layer the tile scan, the first
/// receive row of this rank's rows and the rows all ranks send.
#[repr(C)]
pub struct EpRouteSmem {
    pub route: RouteSmem,
    pub scan: [u32; MAX_EXPERTS as usize],
    pub base: [u32; MAX_EXPERTS as usize],
    pub total: [u32; MAX_EXPERTS as usize],
}
pub const EP_SMEM_SCAN: u32 = core::mem::offset_of!(EpRouteSmem, scan) as u32;
pub const EP_SMEM_BASE: u32 = core::mem::offset_of!(EpRouteSmem, base) as u32;
pub const EP_SMEM_TOTAL: u32 = core::mem::offset_of!(EpRouteSmem, total) as u32;
pub const EP_SMEM_BYTES: u32 = core::mem::size_of::<EpRouteSmem>() as u32;

pub const MOE_EP_ROUTE: KernelSpec = KernelSpec {
    name: "mk_moe_ep_route",
    max_threads: ROUTE_THREADS,
    min_blocks_per_sm: 1,
    dynamic_smem: EP_SMEM_BYTES,
};
pub const MOE_EP_DISPATCH: KernelSpec = KernelSpec {
    name: "mk_moe_ep_dispatch",
    max_threads: ROW_THREADS,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};
/// `mk_moe_ep_dispatch_up`: the dispatch fused with the up projection (the grouped GEMM's
/// threads, roles and shared memory; the dispatch runs before the role split).
pub const MOE_EP_DISPATCH_UP: KernelSpec = KernelSpec {
    name: "mk_moe_ep_dispatch_up",
    max_threads: TILE.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: GROUPED_GEMM_SMEM_BYTES,
};
pub const MOE_EP_COMBINE: KernelSpec = KernelSpec {
    name: "mk_moe_ep_combine",
    max_threads: ROW_THREADS,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};

const _: () = {
    assert!(EP_SMEM_BYTES <= 48 * 1024);
    assert!(core::mem::offset_of!(EpRouteSmem, route) == 0);
    assert!(ROUTE_THREADS >= EP_MAX_RANKS);
    assert!(ROUTE_THREADS >= EP_MAX_WORLD && ROW_THREADS >= EP_MAX_WORLD && TILE.threads() >= EP_MAX_WORLD);
    // The fused dispatch counts rows per expert in the ring's first stage before the ring starts.
    assert!(4 * MAX_EXPERTS <= TILE.a_stage_bytes());
};

/// Row tiles the grouped buffers may need: every expert that gets rows rounds up by less than
/// one tile, so `ceil(pairs / ROW_ALIGN) + min(experts, pairs)` tiles always suffice.
pub const fn max_tiles(pairs: u32, experts: u32) -> u32 {
    let nonempty = if experts < pairs { experts } else { pairs };
    pairs.div_ceil(ROW_ALIGN) + nonempty
}

const _: () = {
    assert!(
        MAX_EXPERTS <= TILE_EXPERT_MASK + 1,
        "experts fit the tile-expert word's low bits"
    );
    assert!(
        ROW_ALIGN < 1 << (32 - TILE_PAD_SHIFT),
        "padding rows fit the tile-expert word"
    );
    assert!(PARTIAL_BOX_ROWS.is_multiple_of(8) && ROW_ALIGN.is_multiple_of(PARTIAL_BOX_ROWS));
    assert!(GemmTile::EPILOGUE_BOX_ROWS.is_multiple_of(PARTIAL_BOX_ROWS));
    assert!(ROUTE_THREADS >= MAX_EXPERTS, "the scan gives every expert a thread");
    assert!(ROUTE_THREADS.is_multiple_of(crate::WARP_SIZE));
    assert!(ROUTE_SMEM_BYTES <= 48 * 1024);
    assert!(SWIGLU_TILE_COLS.is_multiple_of(GemmTile::EPILOGUE_BOX_COLS));
    assert!(GROUPED_GEMM_ROLES[1].first_warpgroup + GROUPED_GEMM_ROLES[1].warpgroups == TILE.threads() / 128);
};

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn capacity_covers_the_worst_padding() {
        // Every expert gets 1 row: each pads to a whole tile.
        assert!(max_tiles(64, 64) >= 64);
        // All rows to one expert.
        assert!(max_tiles(1000, 8) >= 1000u32.div_ceil(128));
        // 129 rows each over 8 experts: 2 tiles each.
        assert!(max_tiles(8 * 129, 8) >= 16);
    }
    #[test]
    fn ep_flags_do_not_overlap() {
        // Every flag inside the region, 8-byte aligned, none twice, none of the region unused.
        let mut seen = [false; (EP_FLAG_BYTES / 8) as usize];
        let mut mark = |at: u64| {
            assert!(at.is_multiple_of(8) && at + 8 <= EP_FLAG_BYTES);
            assert!(!seen[(at / 8) as usize], "flag at {at} twice");
            seen[(at / 8) as usize] = true;
        };
        for src in 0..EP_MAX_RANKS {
            mark(ep_flag(EpFlag::Ready, src, 0));
            mark(ep_flag(EpFlag::Counts, src, 0));
            for cta in 0..EP_MAX_CTAS {
                mark(ep_flag(EpFlag::Rows, src, cta));
                mark(ep_flag(EpFlag::Out, src, cta));
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(EP_SMEM_SCAN, ROUTE_SMEM_BYTES);
        assert_eq!(EP_SMEM_BASE, EP_SMEM_SCAN + 4 * MAX_EXPERTS);
        assert_eq!(EP_SMEM_TOTAL, EP_SMEM_BASE + 4 * MAX_EXPERTS);
    }
    #[test]
    fn route_smem_offsets() {
        assert_eq!(ROUTE_SMEM_COUNTS, 0);
        assert_eq!(ROUTE_SMEM_CURSOR, 4 * MAX_EXPERTS);
        assert_eq!(ROUTE_SMEM_WARP_TILES, 8 * MAX_EXPERTS);
    }
}
