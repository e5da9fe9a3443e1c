//! AllGather + GEMM (`mk_ag_gemm_bf16_nk`; device `kernels/ag_gemm/`, host `ops/ag_gemm.rs`):
//! `C = AllGather_rows(A) * B^T`, A gathered by rows over NVLink (and across nodes through the
//! proxy), B as N x K. The first `n_comm` CTAs move A; the others run the GEMM.
use crate::bulk::BulkSmem;
use crate::gemm::{GemmTile, RingLayout, SMEM_ALIGN_SLACK};
use crate::kernels::KernelSpec;
use core::mem::size_of;

/// `mk_ag_gemm_bf16_nk`'s argument block (device memory; the kernel gets its address).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
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

/// The GEMM of the compute CTAs: the default tile with the fused register split (the producer
/// thread also runs bounded flag waits).
pub const TILE: GemmTile = GemmTile::FUSED;

/// Shared memory: a compute CTA's GEMM ring, or a comm CTA's bulk-copy ring, both from offset 0.
#[repr(C)]
pub union AgGemmSmem {
    pub compute: crate::ring_smem!(TILE),
    pub comm: BulkSmem,
}

/// The compute CTAs' ring offsets.
pub const RING: RingLayout = <crate::ring_smem!(TILE)>::layout(TILE);
/// Dynamic shared memory of a launch.
pub const SMEM_BYTES: u32 = size_of::<AgGemmSmem>() as u32 + SMEM_ALIGN_SLACK;
const _: () = assert!(SMEM_BYTES <= crate::SM90_MAX_SMEM_PER_CTA);

/// The kernel: the GEMM's launch shape; the first `n_comm` CTAs move A, the others compute.
pub const AG_GEMM_NK: KernelSpec = KernelSpec {
    name: "mk_ag_gemm_bf16_nk",
    max_threads: TILE.threads(),
    min_blocks_per_sm: 1,
    dynamic_smem: SMEM_BYTES,
};

/// What a warpgroup of an AllGather+GEMM CTA does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Comm CTA (the first `n_comm`), every warpgroup: CTA 0's threads `0..world` open this rank's
    /// gathered buffer to the local peers; thread 0 pushes the shard (bulk-copy ring).
    Comm = 0,
    /// Compute CTA, warpgroup 0: thread 0 waits for each chunk of A and issues the TMA loads.
    Producer = 1,
    /// Compute CTA, warpgroups 1 and 2: wgmma and the TMA-store epilogue.
    Consumer = 2,
}

/// A compute CTA's warpgroups, by index.
pub const COMPUTE_WARPGROUPS: [Role; 3] = [Role::Producer, Role::Consumer, Role::Consumer];
const _: () = assert!(COMPUTE_WARPGROUPS.len() as u32 == 1 + TILE.consumer_warpgroups);

/// The role of warpgroup `wg` of CTA `cta` (of a launch with `n_comm` comm CTAs).
#[inline(always)]
pub const fn role(cta: u32, n_comm: u32, wg: u32) -> Role {
    if cta < n_comm {
        Role::Comm
    } else {
        compute_role(wg)
    }
}

/// The role of warpgroup `wg` of a compute CTA ([`COMPUTE_WARPGROUPS`]). The table is one
/// warpgroup, then warpgroups that all share a role (checked below), so the lookup is one
/// comparison, as ptxas needs it around `setmaxnreg` (a lookup it cannot see through made it
/// spill).
#[inline(always)]
pub const fn compute_role(wg: u32) -> Role {
    if wg == 0 {
        COMPUTE_WARPGROUPS[0]
    } else {
        COMPUTE_WARPGROUPS[COMPUTE_WARPGROUPS.len() - 1]
    }
}
const _: () = {
    let mut w = 0;
    while w < COMPUTE_WARPGROUPS.len() {
        assert!(role(1, 0, w as u32) as u8 == COMPUTE_WARPGROUPS[w] as u8);
        w += 1;
    }
    assert!(matches!(COMPUTE_WARPGROUPS[0], Role::Producer));
    assert!(matches!(role(0, 1, 0), Role::Comm));
};

// A comm CTA's bulk ring fits in the launch's shared memory (it overlays the unused GEMM ring).
const _: () = assert!(size_of::<BulkSmem>() as u32 <= SMEM_BYTES);
