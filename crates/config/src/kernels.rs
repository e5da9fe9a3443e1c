//! The table of every kernel entry in the PTX, with its launch bounds.
//!
//! Rust cannot spell `__launch_bounds__`, so the PTX linker (crates/ptx-linker) patches
//! `.maxntid` / `.minnctapersm` into each `.entry` from this table, and the host launches each
//! kernel with exactly `max_threads` threads. A kernel in the PTX that is missing here, or an
//! entry here missing from the PTX, fails the build.
//!
//! The kernels of an operation are defined in its module in `crate::ops` (re-exported here);
//! the small ones without a module of their own (iota, the collectives) are defined here.

/// Launch bounds and shared memory of one kernel entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSpec {
    /// The `.entry` symbol (the `#[unsafe(no_mangle)]` name of the `extern "ptx-kernel"` fn).
    pub name: &'static str,
    /// Threads per CTA: `.maxntid` in the PTX and `blockDim.x` at launch.
    pub max_threads: u32,
    /// `.minnctapersm`; together with `max_threads` this caps registers per thread, which
    /// `setmaxnreg` needs in order to take effect.
    pub min_blocks_per_sm: u32,
    /// Dynamic shared memory bytes the host launches with.
    pub dynamic_smem: u32,
}

/// Kernel that fills a buffer with its index: the smallest end-to-end check of the pipeline.
pub const IOTA: KernelSpec = KernelSpec {
    name: "mk_iota_u32",
    max_threads: 256,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};

pub use crate::ops::ag_gemm::AG_GEMM_NK;
pub use crate::ops::gemm::{GEMM_BF16_KN, GEMM_BF16_NK, GEMM_BF16_NK_FUSED_RING};
pub use crate::ops::gemm_rs::GEMM_RS_NK;

/// Threads of the communication kernels (each keeps 4 x 16 bytes in flight per thread).
pub const COLLECTIVE: KernelSpec = KernelSpec {
    name: "mk_allgather",
    max_threads: 384,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};
/// AllGather over NVLink (push).
pub const ALLGATHER: KernelSpec = COLLECTIVE;
/// ReduceScatter over NVLink (pull + f32 sum).
pub const REDUCE_SCATTER: KernelSpec = KernelSpec {
    name: "mk_reduce_scatter",
    ..COLLECTIVE
};
/// AllReduce over NVLink (two-shot: pull-reduce own chunk, push to all).
pub const ALLREDUCE: KernelSpec = KernelSpec {
    name: "mk_allreduce",
    ..COLLECTIVE
};
/// AllReduce over NVLink, one-shot: every rank pulls every rank's buffer and sums (any count).
pub const ALLREDUCE_ONESHOT: KernelSpec = KernelSpec {
    name: "mk_allreduce_oneshot",
    ..COLLECTIVE
};
/// AllReduce over NVLink, two-shot: reduce-scatter by pull, all-gather by push (any count).
pub const ALLREDUCE_TWOSHOT: KernelSpec = KernelSpec {
    name: "mk_allreduce_twoshot",
    ..COLLECTIVE
};

/// AllGather across nodes (NVLink + proxy puts).
pub const ALLGATHER_INTERNODE: KernelSpec = KernelSpec {
    name: "mk_allgather_internode",
    ..COLLECTIVE
};
/// The inter-node half of AllReduce (proxy puts to rail peers + sum over nodes).
pub const ALLREDUCE_INTERNODE: KernelSpec = KernelSpec {
    name: "mk_allreduce_internode",
    ..COLLECTIVE
};

/// Latency probe of the inter-node path: one thread ping-pongs puts with a remote rank.
pub const PROXY_PINGPONG: KernelSpec = KernelSpec {
    name: "mk_proxy_pingpong",
    max_threads: 32,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};

/// Every kernel entry in the embedded PTX.
pub const KERNELS: &[KernelSpec] = &[
    IOTA,
    GEMM_BF16_NK,
    GEMM_BF16_KN,
    GEMM_BF16_NK_FUSED_RING,
    ALLGATHER,
    REDUCE_SCATTER,
    ALLREDUCE,
    ALLREDUCE_ONESHOT,
    ALLREDUCE_TWOSHOT,
    ALLGATHER_INTERNODE,
    ALLREDUCE_INTERNODE,
    PROXY_PINGPONG,
    AG_GEMM_NK,
    GEMM_RS_NK,
    crate::ops::moe::MOE_ROUTE,
    crate::ops::moe::MOE_GROUP_TILES,
    crate::ops::moe::MOE_GATHER,
    crate::ops::moe::MOE_GROUPED_GEMM,
    crate::ops::moe::MOE_COMBINE,
    crate::ops::moe::MOE_GROUPED_GEMM_COMBINE,
    crate::ops::moe::MOE_TO_BF16,
    crate::ops::moe::MOE_EP_ROUTE,
    crate::ops::moe::MOE_EP_DISPATCH,
    crate::ops::moe::MOE_EP_DISPATCH_UP,
    crate::ops::moe::MOE_EP_COMBINE,
    crate::ops::attention::FLASH_ATTN_FWD_D64,
    crate::ops::attention::FLASH_ATTN_FWD_D128,
    crate::ops::attention::RING_ATTN_FWD_D64,
    crate::ops::attention::RING_ATTN_FWD_D128,
    crate::ops::gemm_decode::DECODE_NK[0],
    crate::ops::gemm_decode::DECODE_NK[1],
    crate::ops::gemm_decode::DECODE_NK[2],
    crate::ops::gemm_decode::DECODE_NK[3],
    crate::ops::gemm_decode::DECODE_NK[4],
    crate::ops::gemm_decode::DECODE_NK[5],
    crate::ops::gemm_decode::DECODE_KN[0],
    crate::ops::gemm_decode::DECODE_KN[1],
    crate::ops::gemm_decode::DECODE_KN[2],
    crate::ops::gemm_decode::DECODE_KN[3],
    crate::ops::gemm_decode::DECODE_KN[4],
    crate::ops::gemm_decode::DECODE_KN[5],
    crate::ops::attention_bwd::FLASH_ATTN_BWD_PREP,
    crate::ops::attention_bwd::FLASH_ATTN_BWD_D64,
    crate::ops::attention_bwd::FLASH_ATTN_BWD_D128,
    crate::ops::attention_bwd::FLASH_ATTN_BWD_DQ,
];

/// Looks a kernel up by its entry name.
pub fn find(name: &str) -> Option<&'static KernelSpec> {
    KERNELS.iter().find(|k| k.name.as_bytes() == name.as_bytes())
}
