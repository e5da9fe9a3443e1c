//! FlashAttention forward: argument block, tile, shared-memory layout and warp roles.
//!
//! One CTA = three warpgroups ([`ROLES`]): warpgroup 0 is the producer (one thread issues the TMA
//! loads of Q, K and V), warpgroups 1 and 2 are consumers, each owning 64 of the tile's
//! `block_m = 128` query rows. A tile is (sequence, query head, 128-row query block); the
//! consumers walk its key/value blocks of `block_n = 128` rows through a `stages`-deep ring
//! of (K, V) slots. See docs/attention.md.
use crate::kernels::KernelSpec;
use core::mem::{offset_of, size_of};

/// Bytes of one bf16 element.
const BF16: u32 = 2;
/// Bytes of one 128-byte swizzled shared-memory row (64 bf16): the inner extent of every TMA box.
pub const SWIZZLE_ROW: u32 = 128;
/// Elements of the head dimension per TMA box (one swizzled row).
pub const BOX_COLS: u32 = SWIZZLE_ROW / BF16;

/// The launch's arguments: by value in the FlashAttention forward's [`AttentionParams`] (where
/// `map_q`, `map_k`, `map_v` are unused: the maps sit in the parameter block), in ring
/// attention's [`RingArgs`] block in global memory. Addresses are device pointers; the three
/// tensor maps (`CUtensorMap`, 128 bytes, 64-byte aligned) describe
/// Q, K, V as 3D tensors `[rows][heads][head_dim]` (innermost last) with boxes of
/// `BOX_COLS x 1 x block rows`.
///
/// Batched inputs are `[batch][seqlen][heads][head_dim]`; packed variable-length inputs are
/// `[total][heads][head_dim]` with `cu_seqlens_*` (`batch + 1` i32 offsets, first 0). Either way
/// the kernel sees one tensor of rows and a start row per sequence.
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionArgs {
    /// `CUtensorMap` of Q (rows = total query rows).
    pub map_q: u64,
    /// `CUtensorMap` of K (rows = total key rows).
    pub map_k: u64,
    /// `CUtensorMap` of V (same shape as K).
    pub map_v: u64,
    /// O, bf16, Q's shape.
    pub o: u64,
    /// Log-sum-exp, f32: `[batch][heads_q][seqlen_q]` (batched) or `[heads_q][total_q]` (varlen).
    pub lse: u64,
    /// `batch + 1` i32 query offsets, or 0 for batched input.
    pub cu_seqlens_q: u64,
    /// `batch + 1` i32 key offsets, or 0 for batched input.
    pub cu_seqlens_k: u64,
    pub batch: u32,
    pub heads_q: u32,
    pub heads_kv: u32,
    /// Query rows per sequence (batched) or the longest sequence's (varlen).
    pub seqlen_q: u32,
    /// Key rows per sequence (batched); with varlen the key rows of the whole tensor, which
    /// clamp the offsets the kernel reads.
    pub seqlen_k: u32,
    /// Query rows of the whole tensor (the LSE row stride of varlen input).
    pub total_q: u32,
    /// Query blocks per (sequence, head): `ceil(seqlen_q / block_m)`.
    pub m_blocks: u32,
    /// 1: causal, aligned to the bottom right (query `i` sees keys `j <= i + seqlen_k - seqlen_q`).
    pub causal: u32,
    /// Softmax scale times log2(e): scores are exponentiated with `ex2`.
    pub scale_log2: f32,
    pub _pad: u32,
}

/// What a warpgroup of the CTA does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// One thread issues the TMA loads of Q, K and V; the warpgroup gives its registers away.
    Producer,
    /// `S = Q K^T`, online softmax, `O += P V` on 64 query rows (the index: which 64).
    Consumer(u32),
}

/// The warp-role table: warpgroup `i` has role `ROLES[i]`.
pub const ROLES: [Role; 3] = [Role::Producer, Role::Consumer(0), Role::Consumer(1)];

/// Tile shape, pipeline depth and register split of one head dimension's kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionTile {
    pub head_dim: u32,
    /// Query rows per tile (64 per consumer warpgroup).
    pub block_m: u32,
    /// Key/value rows per block (the wgmma N of `Q K^T`).
    pub block_n: u32,
    /// (K, V) slots in the ring.
    pub stages: u32,
    /// Registers per thread of the producer warpgroup after `setmaxnreg.dec`.
    pub producer_regs: u32,
    /// Registers per thread of each consumer warpgroup after `setmaxnreg.inc`.
    pub consumer_regs: u32,
}

/// The shared memory of a CTA: Q, the (K, V) ring, then the mbarriers. `Q`/`KV` are the
/// bytes of one Q tile and one K (or V) block, `ST` the stages. Every tile is made of
/// `head_dim / 64` boxes of `rows x 128` bytes (128B-swizzled), 1024-byte aligned.
#[repr(C, align(1024))]
pub struct AttentionSmem<const Q: usize, const KV: usize, const ST: usize> {
    pub q: [u8; Q],
    pub k: [[u8; KV]; ST],
    pub v: [[u8; KV]; ST],
    /// Q landed (TMA bytes).
    pub q_full: u64,
    /// Both consumers finished reading Q (one arrival per consumer warp).
    pub q_empty: u64,
    /// K slot landed.
    pub k_full: [u64; ST],
    /// K slot read by every consumer warp.
    pub k_empty: [u64; ST],
    pub v_full: [u64; ST],
    pub v_empty: [u64; ST],
}

/// Byte offsets of an [`AttentionSmem`] instantiation (from `offset_of!`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmemLayout {
    pub q: u32,
    pub k: u32,
    pub v: u32,
    pub q_full: u32,
    pub q_empty: u32,
    pub k_full: u32,
    pub k_empty: u32,
    pub v_full: u32,
    pub v_empty: u32,
    pub bytes: u32,
}

macro_rules! layout_of {
    ($t:ty) => {
        SmemLayout {
            q: offset_of!($t, q) as u32,
            k: offset_of!($t, k) as u32,
            v: offset_of!($t, v) as u32,
            q_full: offset_of!($t, q_full) as u32,
            q_empty: offset_of!($t, q_empty) as u32,
            k_full: offset_of!($t, k_full) as u32,
            k_empty: offset_of!($t, k_empty) as u32,
            v_full: offset_of!($t, v_full) as u32,
            v_empty: offset_of!($t, v_empty) as u32,
            bytes: size_of::<$t>() as u32,
        }
    };
}

/// Head dim 64: Q 16 KiB, 4 stages of (K, V) 2 x 16 KiB.
pub type Smem64 = AttentionSmem<16384, 16384, 4>;
/// Head dim 128: Q 32 KiB, 2 stages of (K, V) 2 x 32 KiB.
pub type Smem128 = AttentionSmem<32768, 32768, 2>;

impl AttentionTile {
    pub const D64: AttentionTile = AttentionTile {
        head_dim: 64,
        block_m: 128,
        block_n: 128,
        stages: 4,
        producer_regs: 40,
        consumer_regs: 232,
    };
    pub const D128: AttentionTile = AttentionTile {
        head_dim: 128,
        block_m: 128,
        block_n: 128,
        stages: 2,
        producer_regs: 40,
        consumer_regs: 232,
    };
    /// Threads per CTA (one warpgroup per role).
    pub const fn threads(&self) -> u32 {
        ROLES.len() as u32 * crate::WARPGROUP_SIZE
    }
    /// Consumer warpgroups.
    pub const fn consumers(&self) -> u32 {
        ROLES.len() as u32 - 1
    }
    /// Registers per thread at launch (`.maxntid` + `.minnctapersm 1`), rounded down to 8.
    pub const fn entry_regs(&self) -> u32 {
        crate::SM90_REGS_PER_SM / self.threads() / 8 * 8
    }
    /// Boxes per tile along the head dimension.
    pub const fn boxes(&self) -> u32 {
        self.head_dim / BOX_COLS
    }
    /// Bytes of one Q box (`block_m` rows of 128 bytes).
    pub const fn q_box_bytes(&self) -> u32 {
        self.block_m * SWIZZLE_ROW
    }
    /// Bytes of one K or V box (`block_n` rows of 128 bytes).
    pub const fn kv_box_bytes(&self) -> u32 {
        self.block_n * SWIZZLE_ROW
    }
    /// TMA bytes of the Q tile.
    pub const fn q_bytes(&self) -> u32 {
        self.block_m * self.head_dim * BF16
    }
    /// TMA bytes of one K (or V) block.
    pub const fn kv_bytes(&self) -> u32 {
        self.block_n * self.head_dim * BF16
    }
    /// The shared-memory layout of this head dimension.
    pub const fn layout(&self) -> SmemLayout {
        match self.head_dim {
            64 => layout_of!(Smem64),
            _ => layout_of!(Smem128),
        }
    }
    /// Dynamic shared memory to launch with (the allocation's base is 1024-byte aligned).
    pub const fn smem_bytes(&self) -> u32 {
        self.layout().bytes
    }
    /// Checks every invariant the kernel relies on (at compile time in a `const`).
    pub const fn check(&self) {
        assert!(self.head_dim == 64 || self.head_dim == 128, "head dim 64 or 128");
        assert!(self.block_m == 128, "two consumer warpgroups of 64 rows");
        assert!(self.block_n == 128, "S = Q K^T is one m64n128 wgmma chain");
        let l = self.layout();
        assert!(l.q == 0 && l.k == self.q_bytes(), "Q first, K ring after it");
        assert!(l.v == l.k + self.stages * self.kv_bytes(), "V ring after the K ring");
        assert!(
            l.q_full == l.v + self.stages * self.kv_bytes(),
            "barriers after the V ring"
        );
        assert!(
            l.q.is_multiple_of(1024) && l.k.is_multiple_of(1024) && l.v.is_multiple_of(1024),
            "swizzled tiles 1024-aligned"
        );
        assert!(
            self.kv_bytes().is_multiple_of(1024),
            "K/V slots keep 1024-byte alignment"
        );
        assert!(l.k_full + 8 * self.stages == l.k_empty, "one k_full per stage");
        assert!(l.v_empty + 8 * self.stages <= l.bytes, "barriers inside the struct");
        assert!(l.bytes <= crate::SM90_MAX_SMEM_PER_CTA, "shared memory exceeds 227 KiB");
        assert!(self.stages >= 2, "a ring needs two stages");
        assert!(
            (self.producer_regs + self.consumer_regs * self.consumers()) * crate::WARPGROUP_SIZE
                <= self.entry_regs() * self.threads(),
            "register split exceeds the registers the CTA is launched with"
        );
        assert!(
            self.producer_regs >= 24 && self.consumer_regs <= 256,
            "setmaxnreg range"
        );
        assert!(
            self.producer_regs.is_multiple_of(8) && self.consumer_regs.is_multiple_of(8),
            "setmaxnreg multiples of 8"
        );
    }
}

const _: () = AttentionTile::D64.check();
const _: () = AttentionTile::D128.check();
const _: () = assert!(size_of::<AttentionArgs>() == 8 * 7 + 4 * 10, "argument block layout");

pub use crate::TensorMapWords;

/// The FlashAttention forward's launch-parameter block, passed by value: the tensor maps of Q,
/// K and V (each at a 64-byte offset of the block, which the PTX declares 64-byte aligned), then
/// the arguments. Nothing is uploaded: a launch carries its own buffers' maps, and a CUDA graph
/// keeps a copy of the block.
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionParams {
    pub map_q: TensorMapWords,
    pub map_k: TensorMapWords,
    pub map_v: TensorMapWords,
    pub args: AttentionArgs,
}
const _: () = assert!(offset_of!(AttentionParams, map_k) % 64 == 0 && offset_of!(AttentionParams, map_v) % 64 == 0);
const _: () = assert!(offset_of!(AttentionParams, args) == 3 * 128);
const _: () = assert!(
    size_of::<AttentionParams>() <= 4096,
    "kernel parameters are limited to 4 KiB"
);

/// FlashAttention forward, head dim 64.
pub const FLASH_ATTN_FWD_D64: KernelSpec = KernelSpec {
    name: "mk_flash_attn_fwd_d64",
    max_threads: AttentionTile::D64.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: AttentionTile::D64.smem_bytes(),
};
/// FlashAttention forward, head dim 128.
pub const FLASH_ATTN_FWD_D128: KernelSpec = KernelSpec {
    name: "mk_flash_attn_fwd_d128",
    max_threads: AttentionTile::D128.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: AttentionTile::D128.smem_bytes(),
};

/// Ring attention's argument block: the single-GPU block for the local shard (maps of the local
/// Q, K, V; O; LSE; the shard's shape), then the ring. Batched layout only; `attn.causal = 1`
/// means causal over the whole sequence with zigzag shards (rank `r` holds chunks `r` and
/// `2W - 1 - r` of `2W`, `chunk` rows each, per sequence).
///
/// Grid: CTAs `0..compute_ctas` compute (the FlashAttention roles), CTAs
/// `compute_ctas..compute_ctas + comm_ctas` move K/V to the right neighbour.
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RingArgs {
    pub attn: AttentionArgs,
    /// `CUtensorMap`s of K and V in receive slots 0 and 1 (same shape as the local K, V).
    pub map_k_slot: [u64; 2],
    pub map_v_slot: [u64; 2],
    /// The communicator's `CommDesc`.
    pub desc: u64,
    /// f32 running O `[batch][seqlen][heads_q][head_dim]` (normalized) and LSE
    /// `[batch][heads_q][seqlen]` between steps.
    pub o_acc: u64,
    pub lse_acc: u64,
    /// The local K and V (device addresses; the comm CTAs send them at step 0).
    pub k_local: u64,
    pub v_local: u64,
    /// Heap offset of the receive slots: slot `j` holds K at `slots + 2 j kv_bytes`, V after it.
    pub slots: u64,
    /// Bytes of one K (or V) shard.
    pub kv_bytes: u64,
    pub compute_ctas: u32,
    pub comm_ctas: u32,
    /// Rows of one zigzag chunk (`seqlen / 2`; causal only).
    pub chunk: u32,
    pub _pad: u32,
}

const _: () = assert!(
    size_of::<RingArgs>() == size_of::<AttentionArgs>() + 8 * 11 + 4 * 4,
    "ring block layout"
);

/// Registers per thread of ring attention's producer warpgroup after `setmaxnreg.dec`: its loop
/// over the ring steps (flag waits, the zigzag mask) spilled 60 bytes at 40.
pub const RING_PRODUCER_REGS: u32 = 56;
/// Registers per thread of each of ring attention's consumer warpgroups (0 spills at 224).
pub const RING_CONSUMER_REGS: u32 = 224;
const _: () = assert!(
    (RING_PRODUCER_REGS + 2 * RING_CONSUMER_REGS) * crate::WARPGROUP_SIZE
        <= AttentionTile::D128.entry_regs() * AttentionTile::D128.threads(),
    "ring register split exceeds the CTA's registers"
);

/// Ring attention forward, head dim 64 (same tile and roles as [`FLASH_ATTN_FWD_D64`], plus comm CTAs).
pub const RING_ATTN_FWD_D64: KernelSpec = KernelSpec {
    name: "mk_ring_attn_fwd_d64",
    max_threads: AttentionTile::D64.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: AttentionTile::D64.smem_bytes(),
};
/// Ring attention forward, head dim 128.
pub const RING_ATTN_FWD_D128: KernelSpec = KernelSpec {
    name: "mk_ring_attn_fwd_d128",
    max_threads: AttentionTile::D128.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: AttentionTile::D128.smem_bytes(),
};

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn budgets() {
        assert_eq!(AttentionTile::D128.smem_bytes(), 32768 * 5 + 1024);
        assert_eq!(AttentionTile::D64.smem_bytes(), 16384 * 9 + 1024);
        assert_eq!(AttentionTile::D128.entry_regs(), 168);
    }
}
