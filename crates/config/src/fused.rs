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
/// reduced over ranks by row chunk: rank r gets rows `[r * M / world, (r + 1) * M / world)`.
/// Every CTA computes; a rank's own tiles are computed after its peers sent their partials of
/// them, and the epilogue adds those in (no reducer CTAs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct GemmRsArgs {
    /// Device address of the rank's `CommDesc`.
    pub desc: u64,
    /// Tensor maps: A (M x K_local, box 64 x 128), B as N x K_local (box 64 x 256).
    pub map_a: u64,
    pub map_b: u64,
    /// `map_recv[p]`: this rank's slot in rank p's receive buffer (`M / world` x N bf16,
    /// box 64 x 64), as mapped here (a peer's over NVLink).
    pub map_recv: [u64; 8],
    /// Where the reduced rows of this rank's chunk go (`M / world` x N bf16, box 64 x 64):
    /// ReduceScatter: `map_out[0]`, the local output. AllReduce: `map_out[p]`, the rows of this
    /// rank's chunk in rank p's output (a heap buffer; a peer's over NVLink).
    pub map_out: [u64; 8],
    /// Heap offset of the receive buffer: `world` slots of `M / world` x N bf16.
    pub recv_off: u64,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Tile rows per part of the chunked tile order (`TileScheduler::chunked`): smaller parts
    /// reduce (and, for AllReduce, broadcast) earlier; larger ones leave peers more slack.
    pub part_tiles_m: u32,
    /// 1: GEMM + AllReduce (every rank gets the whole sum), 0: GEMM + ReduceScatter.
    pub all_reduce: u32,
    pub _pad: u32,
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
