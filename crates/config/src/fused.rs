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
