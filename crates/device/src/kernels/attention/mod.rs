//! `mk_flash_attn_fwd_d64` / `mk_flash_attn_fwd_d128`: FlashAttention forward, persistent and
//! warp-specialized (see `mkernel_config::ops::attention` and docs/attention.md).
//!
//! Launch: grid = min(tiles, SMs), block = 384 threads, dynamic shared memory =
//! `AttentionTile::smem_bytes()`; the single argument is an [`AttentionParams`] block passed by
//! value (the Q, K, V tensor maps, then the [`AttentionArgs`]), read in place
//! ([`crate::arch::param`]). Ring attention's entries take the address of a [`RingArgs`] block
//! in global memory instead (its tensor maps are in that block).
//!
//! - [`schedule`]: which tiles a CTA computes and each tile's sequence bounds (both roles walk
//!   the same sequence);
//! - [`producer`]: TMA loads of Q and the (K, V) ring;
//! - [`consumer`]: `S = Q K^T`, online softmax, `O += P V`, the O/LSE epilogue (ring attention:
//!   the merge of each step's partial);
//! - [`ring`]: ring attention's launch epoch, its producer across the ring steps and its comm
//!   CTAs (`mk_ring_attn_fwd_d64` / `mk_ring_attn_fwd_d128`).
pub mod backward;
pub mod consumer;
pub mod producer;
pub mod ring;
pub mod schedule;

use crate::arch::{ids, mbarrier, regs, smem, sync, tma};
use mkernel_config::ops::attention::{
    AttentionArgs, AttentionParams, AttentionTile, RingArgs, Role, RING_CONSUMER_REGS, RING_PRODUCER_REGS, ROLES,
};

/// The Q, K, V tensor maps of a launch.
#[derive(Clone, Copy)]
pub struct Maps {
    pub q: tma::TensorMap,
    pub k: tma::TensorMap,
    pub v: tma::TensorMap,
}

impl Maps {
    /// The maps of a parameter block at generic address `p`.
    #[inline(always)]
    fn of_params(p: *const AttentionParams) -> Maps {
        Maps {
            q: tma::TensorMap(unsafe { &raw const (*p).map_q } as *const u8),
            k: tma::TensorMap(unsafe { &raw const (*p).map_k } as *const u8),
            v: tma::TensorMap(unsafe { &raw const (*p).map_v } as *const u8),
        }
    }
    /// The maps an argument block points to (ring attention's global block).
    #[inline(always)]
    fn of_args(a: &AttentionArgs) -> Maps {
        Maps {
            q: tma::TensorMap(a.map_q as *const u8),
            k: tma::TensorMap(a.map_k as *const u8),
            v: tma::TensorMap(a.map_v as *const u8),
        }
    }
}

/// The shared-memory addresses of one CTA (from the config's `offset_of!` layout).
#[derive(Clone, Copy)]
pub struct Smem {
    pub base: smem::SmemAddr,
    pub tile: AttentionTile,
}

impl Smem {
    #[inline(always)]
    pub fn q(&self) -> smem::SmemAddr {
        self.base.add(self.tile.layout().q)
    }
    #[inline(always)]
    pub fn k(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().k + s * self.tile.kv_bytes())
    }
    #[inline(always)]
    pub fn v(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().v + s * self.tile.kv_bytes())
    }
    #[inline(always)]
    pub fn q_full(&self) -> smem::SmemAddr {
        self.base.add(self.tile.layout().q_full)
    }
    #[inline(always)]
    pub fn q_empty(&self) -> smem::SmemAddr {
        self.base.add(self.tile.layout().q_empty)
    }
    #[inline(always)]
    pub fn k_full(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().k_full + 8 * s)
    }
    #[inline(always)]
    pub fn k_empty(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().k_empty + 8 * s)
    }
    #[inline(always)]
    pub fn v_full(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().v_full + 8 * s)
    }
    #[inline(always)]
    pub fn v_empty(&self, s: u32) -> smem::SmemAddr {
        self.base.add(self.tile.layout().v_empty + 8 * s)
    }
    /// Initializes every barrier (one thread): the `full` ones take the producer's arrival plus
    /// the TMA bytes, the `empty` ones one arrival per consumer warp.
    #[inline(always)]
    unsafe fn init(&self) {
        let warps = self.tile.consumers() * 4;
        unsafe {
            mbarrier::init(self.q_full(), 1);
            mbarrier::init(self.q_empty(), warps);
            for s in 0..self.tile.stages {
                mbarrier::init(self.k_full(s), 1);
                mbarrier::init(self.k_empty(s), warps);
                mbarrier::init(self.v_full(s), 1);
                mbarrier::init(self.v_empty(s), warps);
            }
        }
        mbarrier::fence_init();
    }
}

/// The kernel body for one head dimension, with the launch's tensor maps `maps`. `RING`: `args`
/// is a [`RingArgs`] block; CTAs past `compute_ctas` are comm CTAs.
#[inline(always)]
unsafe fn flash_attn<const D: u32, const PR: u32, const CR: u32, const RING: bool>(
    tile: AttentionTile,
    args: *const AttentionArgs,
    maps: Maps,
) {
    if RING {
        let r = unsafe { &*(args as *const RingArgs) };
        if ids::block_idx() >= r.compute_ctas {
            unsafe { ring::communicate(r, ids::block_idx() - r.compute_ctas) };
            unsafe { ring::exit(r.desc) };
            return;
        }
    }
    let sm = Smem {
        base: smem::dynamic_smem_addr(),
        tile,
    };
    if ids::thread_idx() == 0 {
        unsafe {
            tma::prefetch(maps.q);
            tma::prefetch(maps.k);
            tma::prefetch(maps.v);
            sm.init();
        }
    }
    sync::sync_threads();
    match ROLES[ids::warpgroup_idx() as usize] {
        Role::Producer => {
            regs::setmaxnreg_dec::<PR>();
            if ids::thread_idx_reread() == 0 {
                if RING {
                    unsafe { ring::produce::<D>(&sm, &*(args as *const RingArgs)) };
                } else {
                    unsafe { producer::run::<D>(&sm, args, &maps) };
                }
            }
        }
        Role::Consumer(wg) => {
            regs::setmaxnreg_inc::<CR>();
            unsafe { consumer::run::<D, RING>(&sm, args, wg) };
        }
    }
    if RING {
        unsafe { ring::exit((*(args as *const RingArgs)).desc) };
    }
}

/// FlashAttention forward, head dim 64.
///
/// # Safety
/// The launch contract of `crate::kernels` (block size and dynamic shared memory from its `KernelSpec`),
/// and `params` holds valid tensor maps of Q, K, V and an argument block whose buffers are valid for
/// this launch.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_flash_attn_fwd_d64(_params: AttentionParams) {
    const T: AttentionTile = AttentionTile::D64;
    let p = crate::param_block!("mk_flash_attn_fwd_d64") as *const AttentionParams;
    let args = unsafe { &raw const (*p).args };
    unsafe { flash_attn::<64, { T.producer_regs }, { T.consumer_regs }, false>(T, args, Maps::of_params(p)) }
}

/// FlashAttention forward, head dim 128.
///
/// # Safety
/// As [`mk_flash_attn_fwd_d64`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_flash_attn_fwd_d128(_params: AttentionParams) {
    const T: AttentionTile = AttentionTile::D128;
    let p = crate::param_block!("mk_flash_attn_fwd_d128") as *const AttentionParams;
    let args = unsafe { &raw const (*p).args };
    unsafe { flash_attn::<128, { T.producer_regs }, { T.consumer_regs }, false>(T, args, Maps::of_params(p)) }
}

/// Ring attention forward, head dim 64 (the argument is a [`RingArgs`] block).
///
/// # Safety
/// As for the FlashAttention entries, with a [`RingArgs`] block whose communicator descriptor is valid
/// for this launch; every rank of the ring launches the same kernel with the same shapes.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_ring_attn_fwd_d64(args: *const RingArgs) {
    const T: AttentionTile = AttentionTile::D64;
    let maps = Maps::of_args(unsafe { &(*args).attn });
    unsafe { flash_attn::<64, RING_PRODUCER_REGS, RING_CONSUMER_REGS, true>(T, args as *const AttentionArgs, maps) }
}

/// Ring attention forward, head dim 128 (the argument is a [`RingArgs`] block).
///
/// # Safety
/// As for the FlashAttention entries, with a [`RingArgs`] block whose communicator descriptor is valid
/// for this launch; every rank of the ring launches the same kernel with the same shapes.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_ring_attn_fwd_d128(args: *const RingArgs) {
    const T: AttentionTile = AttentionTile::D128;
    let maps = Maps::of_args(unsafe { &(*args).attn });
    unsafe { flash_attn::<128, RING_PRODUCER_REGS, RING_CONSUMER_REGS, true>(T, args as *const AttentionArgs, maps) }
}
