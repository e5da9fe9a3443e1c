//! FlashAttention backward (see `mkernel_config::ops::attention_bwd` and docs/attention.md):
//! `mk_flash_attn_bwd_prep`, then `mk_flash_attn_bwd_d64` / `mk_flash_attn_bwd_d128`, then
//! `mk_flash_attn_bwd_dq`, all taking the [`AttentionBwdArgs`] block by value.
//!
//! - [`schedule`]: the CTA's key block and the query blocks it visits (both roles walk the same);
//! - [`loader`]: `cp.async` copies of K, V and the (Q, dO) ring into 128B-swizzled tiles;
//! - [`consumer`]: `S^T`, `dP^T`, `dV`, `dK` in registers, `dQ` through `red.global.add`;
//! - [`elementwise`]: the preprocess and the dQ convert.
pub mod consumer;
pub mod elementwise;
pub mod loader;
pub mod schedule;

use crate::arch::{ids, mbarrier, regs, smem, sync};
use mkernel_config::ops::attention_bwd::{
    AttentionBwdArgs, AttentionBwdTile, BwdRole, BWD_ROLES, DS_BYTES, STATS_BYTES,
};

/// The shared-memory addresses of one backward CTA (from the config's `offset_of!` layout).
#[derive(Clone, Copy)]
pub struct BwdSmem {
    pub base: smem::SmemAddr,
    pub tile: AttentionBwdTile,
}

impl BwdSmem {
    #[inline(always)]
    pub fn k(&self) -> smem::SmemAddr {
        self.base.add(self.tile.layout().k)
    }
    #[inline(always)]
    pub fn v(&self) -> smem::SmemAddr {
        self.base.add(self.tile.layout().v)
    }
    #[inline(always)]
    pub fn q(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().q + s * self.tile.q_bytes())
    }
    #[inline(always)]
    pub fn d_o(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().d_o + s * self.tile.q_bytes())
    }
    #[inline(always)]
    pub fn ds(&self, buf: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().ds + buf * DS_BYTES as u32)
    }
    /// Slot `s`'s f32 `lse2` of the block's 64 query rows.
    #[inline(always)]
    pub fn lse2(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().stats + s * STATS_BYTES as u32)
    }
    /// Slot `s`'s f32 `delta` of the block's 64 query rows.
    #[inline(always)]
    pub fn delta(&self, s: u32) -> smem::SmemAddr {
        self.lse2(s).add(STATS_BYTES as u32 / 2)
    }
    #[inline(always)]
    pub fn kv_full(&self) -> smem::SmemAddr {
        self.base.add(self.tile.layout().kv_full)
    }
    #[inline(always)]
    pub fn q_full(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().q_full + 8 * s)
    }
    #[inline(always)]
    pub fn q_empty(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().q_empty + 8 * s)
    }
    /// Initializes every barrier (one thread): the `full` ones take one `cp.async` arrival per
    /// loader thread, the `empty` ones one arrival per consumer warp.
    #[inline(always)]
    unsafe fn init(&self) {
        unsafe {
            mbarrier::init(self.kv_full(), mkernel_config::WARPGROUP_SIZE);
            for s in 0..self.tile.stages {
                mbarrier::init(self.q_full(s), mkernel_config::WARPGROUP_SIZE);
                mbarrier::init(self.q_empty(s), 8);
            }
        }
        mbarrier::fence_init();
    }
}

/// The main backward kernel body for one head dimension.
#[inline(always)]
unsafe fn flash_attn_bwd<const D: u32, const LR: u32, const CR: u32>(tile: AttentionBwdTile, a: &AttentionBwdArgs) {
    // A CTA whose key block lies past its sequence's keys has nothing to write.
    if unsafe { schedule::bwd_work::<false>(a, ids::block_idx()) }.is_none() {
        return;
    }
    let sm = BwdSmem {
        base: smem::dynamic_smem_addr(),
        tile,
    };
    if ids::thread_idx() == 0 {
        unsafe { sm.init() };
    }
    sync::sync_threads();
    match BWD_ROLES[ids::warpgroup_idx() as usize] {
        BwdRole::Loader => {
            regs::setmaxnreg_dec::<LR>();
            unsafe { loader::run::<D>(&sm, a) };
        }
        BwdRole::Consumer(wg) => {
            regs::setmaxnreg_inc::<CR>();
            unsafe { consumer::run::<D>(&sm, a, wg) };
        }
    }
}

/// FlashAttention backward main kernel, head dim 64.
///
/// # Safety
/// The launch contract of `crate::kernels`; `a` names buffers of the shapes it states (the host
/// plan checks them), its workspace filled by `mk_flash_attn_bwd_prep` earlier in stream order.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_flash_attn_bwd_d64(a: AttentionBwdArgs) {
    const T: AttentionBwdTile = AttentionBwdTile::D64;
    unsafe { flash_attn_bwd::<64, { T.loader_regs }, { T.consumer_regs }>(T, &a) }
}

/// FlashAttention backward main kernel, head dim 128.
///
/// # Safety
/// As [`mk_flash_attn_bwd_d64`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_flash_attn_bwd_d128(a: AttentionBwdArgs) {
    const T: AttentionBwdTile = AttentionBwdTile::D128;
    unsafe { flash_attn_bwd::<128, { T.loader_regs }, { T.consumer_regs }>(T, &a) }
}
