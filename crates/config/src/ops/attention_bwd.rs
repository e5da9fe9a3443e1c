//! FlashAttention backward: argument block, tile, shared-memory layout and warp roles.
//!
//! Three kernels per call, in stream order (docs/attention.md, "Backward"):
//! 1. [`FLASH_ATTN_BWD_PREP`]: `delta = rowsum(dO * O)` and the forward's LSE in log2 units per
//!    (head, query row), and zeroes the f32 dQ accumulator;
//! 2. [`FLASH_ATTN_BWD_D64`] / [`FLASH_ATTN_BWD_D128`]: one CTA per (key block of
//!    [`AttentionBwdTile::block_n`] rows, sequence, key/value head). Warpgroup 0 loads (K, V once,
//!    then Q and dO blocks of `block_m` rows of every query head of the group through a
//!    `stages`-deep ring); warpgroups 1 and 2 own 64 key rows each and keep dK, dV in registers;
//!    dQ goes to the f32 accumulator with `red.global.add`;
//! 3. [`FLASH_ATTN_BWD_DQ`]: `dQ = bf16(scale * dQ_accum)`.
//!
//! Every buffer is a kernel parameter (the [`AttentionBwdArgs`] block is passed by value), so a
//! plan binds its buffers at launch and needs no upload.
use crate::kernels::KernelSpec;
use core::mem::{offset_of, size_of};

/// The backward's parameter block, passed by value to all three kernels. Layouts as the forward
/// (`AttentionArgs`): batched Q, O, dO, dQ `[batch][seqlen_q][heads_q][head_dim]`, K, V, dK, dV
/// `[batch][seqlen_k][heads_kv][head_dim]`, LSE `[batch][heads_q][seqlen_q]`; varlen
/// `[total][heads][head_dim]` with `cu_seqlens_*`, LSE `[heads_q][total_q]`.
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionBwdArgs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    /// The forward's output O (bf16).
    pub o: u64,
    /// dO, the gradient of O (bf16, O's shape).
    pub d_o: u64,
    /// The forward's log-sum-exp (f32, natural log).
    pub lse: u64,
    /// dQ (bf16, Q's shape), written by the convert kernel.
    pub dq: u64,
    /// dK, dV (bf16, K's shape).
    pub dk: u64,
    pub dv: u64,
    /// Workspace: f32 dQ accumulator `[total_q][heads_q][head_dim]`.
    pub dq_acc: u64,
    /// Workspace: f32 `lse * log2(e)` `[heads_q][total_q]` (+inf for rows that see no key).
    pub lse2: u64,
    /// Workspace: f32 `rowsum(dO * O)` `[heads_q][total_q]`.
    pub delta: u64,
    /// `batch + 1` i32 query offsets, or 0 for batched input.
    pub cu_seqlens_q: u64,
    /// `batch + 1` i32 key offsets, or 0 for batched input.
    pub cu_seqlens_k: u64,
    pub batch: u32,
    pub heads_q: u32,
    pub heads_kv: u32,
    /// Query rows per sequence (batched; unused with varlen).
    pub seqlen_q: u32,
    /// Key rows per sequence (batched; unused with varlen).
    pub seqlen_k: u32,
    /// Query rows of the whole tensor.
    pub total_q: u32,
    /// 1: causal, aligned to the bottom right (query `i` sees keys `j <= i + seqlen_k - seqlen_q`).
    pub causal: u32,
    /// Softmax scale times log2(e).
    pub scale_log2: f32,
    /// Softmax scale (dQ and dK are `scale * dS K` and `scale * dS^T Q`).
    pub scale: f32,
    pub _pad: u32,
}

const _: () = assert!(
    size_of::<AttentionBwdArgs>() == 8 * 14 + 4 * 10,
    "argument block layout"
);

/// What a warpgroup of the main backward CTA does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdRole {
    /// Its 128 threads copy K and V once, then Q and dO blocks into the ring with `cp.async`.
    Loader,
    /// `S^T`, `dP^T`, `dV += P^T dO`, `dK += dS^T Q` for 64 key rows (the index: which 64), and
    /// its share of `dQ += dS K`.
    Consumer(u32),
}

/// The warp-role table of the main backward kernel: warpgroup `i` has role `BWD_ROLES[i]`.
pub const BWD_ROLES: [BwdRole; 3] = [BwdRole::Loader, BwdRole::Consumer(0), BwdRole::Consumer(1)];

/// Tile shape, pipeline depth and register split of one head dimension's backward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionBwdTile {
    pub head_dim: u32,
    /// Query rows per Q/dO block (the N of `S^T = K Q^T`).
    pub block_m: u32,
    /// Key rows per CTA (64 per consumer warpgroup).
    pub block_n: u32,
    /// (Q, dO) slots in the ring.
    pub stages: u32,
    /// Registers per thread of the loader warpgroup after `setmaxnreg.dec`.
    pub loader_regs: u32,
    /// Registers per thread of each consumer warpgroup after `setmaxnreg.inc`.
    pub consumer_regs: u32,
}

/// The shared memory of a backward CTA: K and V of the CTA's key block, the (Q, dO) ring, two
/// dS^T buffers, the (LSE, delta) ring, then the mbarriers. `KV` is the bytes of the K (or V) block, `QB` of one Q (or
/// dO) block, `ST` the stages. Tiles are `head_dim / 64` boxes of `rows x 128` bytes
/// (128B-swizzled as TMA writes them), 1024-byte aligned.
#[repr(C, align(1024))]
pub struct AttentionBwdSmem<const KV: usize, const QB: usize, const ST: usize> {
    pub k: [u8; KV],
    pub v: [u8; KV],
    pub q: [[u8; QB]; ST],
    pub d_o: [[u8; QB]; ST],
    /// `dS^T` of one query block, bf16 `[block_n keys][block_m queries]` (one 128-byte swizzled
    /// row per key): the A operand of `dQ += dS K` read MN-major. Two buffers, by block parity.
    pub ds: [[u8; DS_BYTES]; 2],
    /// Per (Q, dO) slot: f32 `lse2` then f32 `delta` of the block's 64 query rows (0 past the
    /// sequence), the initial values of the consumers' `S^T` and `dP^T` accumulators.
    pub stats: [[u8; STATS_BYTES]; ST],
    /// K and V landed (one `cp.async` arrival per loader thread).
    pub kv_full: u64,
    /// Q and dO slot landed (one arrival per loader thread).
    pub q_full: [u64; ST],
    /// Q and dO slot read by every consumer warp.
    pub q_empty: [u64; ST],
}

/// Bytes of one dS^T buffer: 128 keys x 64 queries x bf16.
pub const DS_BYTES: usize = 128 * 64 * 2;
/// Bytes of one (LSE, delta) slot: 2 x 64 query rows x f32.
pub const STATS_BYTES: usize = 2 * 64 * 4;

/// Byte offsets of an [`AttentionBwdSmem`] instantiation (from `offset_of!`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdSmemLayout {
    pub k: u32,
    pub v: u32,
    pub q: u32,
    pub d_o: u32,
    pub ds: u32,
    pub stats: u32,
    pub kv_full: u32,
    pub q_full: u32,
    pub q_empty: u32,
    pub bytes: u32,
}

macro_rules! bwd_layout_of {
    ($t:ty) => {
        BwdSmemLayout {
            k: offset_of!($t, k) as u32,
            v: offset_of!($t, v) as u32,
            q: offset_of!($t, q) as u32,
            d_o: offset_of!($t, d_o) as u32,
            ds: offset_of!($t, ds) as u32,
            stats: offset_of!($t, stats) as u32,
            kv_full: offset_of!($t, kv_full) as u32,
            q_full: offset_of!($t, q_full) as u32,
            q_empty: offset_of!($t, q_empty) as u32,
            bytes: size_of::<$t>() as u32,
        }
    };
}

/// Head dim 64: K, V 16 KiB each, 4 stages of (Q, dO) 2 x 8 KiB, dS^T 2 x 16 KiB, 4 x 512 B of
/// (LSE, delta).
pub type BwdSmem64 = AttentionBwdSmem<16384, 8192, 4>;
/// Head dim 128: K, V 32 KiB each, 2 stages of (Q, dO) 2 x 16 KiB, dS^T 2 x 16 KiB, 2 x 512 B of
/// (LSE, delta).
pub type BwdSmem128 = AttentionBwdSmem<32768, 16384, 2>;

impl AttentionBwdTile {
    pub const D64: AttentionBwdTile = AttentionBwdTile {
        head_dim: 64,
        block_m: 64,
        block_n: 128,
        stages: 4,
        loader_regs: 40,
        consumer_regs: 232,
    };
    pub const D128: AttentionBwdTile = AttentionBwdTile {
        head_dim: 128,
        block_m: 64,
        block_n: 128,
        stages: 2,
        loader_regs: 40,
        consumer_regs: 232,
    };
    /// Threads per CTA (one warpgroup per role).
    pub const fn threads(&self) -> u32 {
        BWD_ROLES.len() as u32 * crate::WARPGROUP_SIZE
    }
    /// Registers per thread at launch (`.maxntid` + `.minnctapersm 1`), rounded down to 8.
    pub const fn entry_regs(&self) -> u32 {
        crate::SM90_REGS_PER_SM / self.threads() / 8 * 8
    }
    /// Bytes of one box of the Q / dO block (`block_m` rows of 128 bytes).
    pub const fn q_box_bytes(&self) -> u32 {
        self.block_m * crate::ops::attention::SWIZZLE_ROW
    }
    /// Bytes of one box of K / V (`block_n` rows of 128 bytes).
    pub const fn kv_box_bytes(&self) -> u32 {
        self.block_n * crate::ops::attention::SWIZZLE_ROW
    }
    /// Bytes of a Q (or dO) block.
    pub const fn q_bytes(&self) -> u32 {
        self.block_m * self.head_dim * 2
    }
    /// Bytes of the K (or V) block.
    pub const fn kv_bytes(&self) -> u32 {
        self.block_n * self.head_dim * 2
    }
    /// The shared-memory layout of this head dimension.
    pub const fn layout(&self) -> BwdSmemLayout {
        match self.head_dim {
            64 => bwd_layout_of!(BwdSmem64),
            _ => bwd_layout_of!(BwdSmem128),
        }
    }
    /// Dynamic shared memory to launch with.
    pub const fn smem_bytes(&self) -> u32 {
        self.layout().bytes
    }
    /// Checks every invariant the kernel relies on (at compile time in a `const`).
    pub const fn check(&self) {
        assert!(self.head_dim == 64 || self.head_dim == 128, "head dim 64 or 128");
        assert!(self.block_m == 64, "S^T = K Q^T is one m64n64 wgmma chain per consumer");
        assert!(self.block_n == 128, "two consumer warpgroups of 64 key rows");
        let l = self.layout();
        assert!(l.k == 0 && l.v == self.kv_bytes(), "K, then V");
        assert!(l.q == 2 * self.kv_bytes(), "the Q ring after V");
        assert!(
            l.d_o == l.q + self.stages * self.q_bytes(),
            "the dO ring after the Q ring"
        );
        assert!(l.ds == l.d_o + self.stages * self.q_bytes(), "dS^T after the dO ring");
        assert!(
            l.q.is_multiple_of(1024) && l.d_o.is_multiple_of(1024) && l.ds.is_multiple_of(1024),
            "swizzled tiles 1024-aligned"
        );
        assert!(self.q_bytes().is_multiple_of(1024), "Q slots keep 1024-byte alignment");
        assert!(l.stats == l.ds + 2 * DS_BYTES as u32, "(LSE, delta) after dS^T");
        assert!(
            STATS_BYTES as u32 == 2 * self.block_m * 4,
            "a stats slot holds lse2 and delta of block_m rows"
        );
        assert!(
            l.kv_full == l.stats + self.stages * STATS_BYTES as u32,
            "barriers after (LSE, delta)"
        );
        assert!(l.q_empty + 8 * self.stages <= l.bytes, "barriers inside the struct");
        assert!(l.bytes <= crate::SM90_MAX_SMEM_PER_CTA, "shared memory exceeds 227 KiB");
        assert!(self.stages >= 2, "a ring needs two stages");
        assert!(
            (self.loader_regs + 2 * self.consumer_regs) * crate::WARPGROUP_SIZE <= self.entry_regs() * self.threads(),
            "register split exceeds the registers the CTA is launched with"
        );
        assert!(self.loader_regs >= 24 && self.consumer_regs <= 256, "setmaxnreg range");
        assert!(
            self.loader_regs.is_multiple_of(8) && self.consumer_regs.is_multiple_of(8),
            "setmaxnreg multiples of 8"
        );
    }
}

const _: () = AttentionBwdTile::D64.check();
const _: () = AttentionBwdTile::D128.check();

/// Threads per CTA of the preprocess and dQ-convert kernels.
pub const BWD_ELEMENTWISE_THREADS: u32 = 256;

/// Backward preprocess: `delta`, `lse2`, zeroed dQ accumulator (grid-stride, any grid).
pub const FLASH_ATTN_BWD_PREP: KernelSpec = KernelSpec {
    name: "mk_flash_attn_bwd_prep",
    max_threads: BWD_ELEMENTWISE_THREADS,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};
/// Backward main kernel, head dim 64.
pub const FLASH_ATTN_BWD_D64: KernelSpec = KernelSpec {
    name: "mk_flash_attn_bwd_d64",
    max_threads: AttentionBwdTile::D64.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: AttentionBwdTile::D64.smem_bytes(),
};
/// Backward main kernel, head dim 128.
pub const FLASH_ATTN_BWD_D128: KernelSpec = KernelSpec {
    name: "mk_flash_attn_bwd_d128",
    max_threads: AttentionBwdTile::D128.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: AttentionBwdTile::D128.smem_bytes(),
};
/// Backward dQ convert: `dQ = bf16(scale * dQ_accum)` (grid-stride, any grid).
pub const FLASH_ATTN_BWD_DQ: KernelSpec = KernelSpec {
    name: "mk_flash_attn_bwd_dq",
    max_threads: BWD_ELEMENTWISE_THREADS,
    min_blocks_per_sm: 1,
    dynamic_smem: 0,
};

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn budgets() {
        assert_eq!(
            AttentionBwdTile::D128.smem_bytes(),
            32768 * 2 + 16384 * 4 + 32768 + 2 * 512 + 1024
        );
        assert_eq!(
            AttentionBwdTile::D64.smem_bytes(),
            16384 * 2 + 8192 * 8 + 32768 + 4 * 512 + 1024
        );
    }
}
