//! TMA: bulk tensor copies between global and shared memory, described by a `CUtensorMap`.
//!
//! Descriptors are encoded on the host with `cuTensorMapEncodeTiled` and live in global memory;
//! kernels get a pointer ([`TensorMap`]). Coordinates are in elements, innermost first.
use super::smem::SmemAddr;
use core::arch::asm;

/// Generic address of a 64-byte aligned, 128-byte `CUtensorMap` in global memory.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct TensorMap(pub *const u8);

/// Pulls the descriptor into the TMA unit's cache: `prefetch.tensormap [map];`
///
/// # Safety
///
/// `map.0` is the generic address of a valid, 64-byte aligned `CUtensorMap` in global (or constant/param) memory.
#[inline(always)]
pub unsafe fn prefetch(map: TensorMap) {
    unsafe { asm!("prefetch.tensormap [{0}];", in(reg64) map.0, options(nostack)) };
}

/// 2D tile load into shared memory that completes `bytes` on `bar`:
/// `cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [map, {c0, c1}], [bar];`
/// Elements outside the tensor are filled with zeros.
///
/// # Safety
///
/// `map` points to a valid 2D `CUtensorMap` in global memory whose tensor is readable for this launch; `dst` is a
/// shared-memory address of this CTA, aligned as the map's swizzle requires (1024 bytes for 128-byte swizzle), with
/// room for one box that nothing reads or writes until the copy completes; `bar` is an initialised mbarrier of this CTA
/// whose current phase expects these box bytes (see [`super::mbarrier::arrive_expect_tx`]).
#[inline(always)]
pub unsafe fn load_2d(dst: SmemAddr, map: TensorMap, c0: u32, c1: u32, bar: SmemAddr) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{0}], [{1}, {{{2}, {3}}}], [{4}];",
            in(reg32) dst.0, in(reg64) map.0, in(reg32) c0, in(reg32) c1, in(reg32) bar.0, options(nostack)
        )
    };
}

/// 3D tile load into shared memory that completes `bytes` on `bar`:
/// `cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [map, {c0, c1, c2}], [bar];`
/// Elements outside the tensor are filled with zeros.
///
/// # Safety
///
/// As [`load_2d`], with `map` a valid 3D `CUtensorMap`.
#[inline(always)]
pub unsafe fn load_3d(dst: SmemAddr, map: TensorMap, c0: u32, c1: u32, c2: u32, bar: SmemAddr) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{0}], [{1}, {{{2}, {3}, {4}}}], [{5}];",
            in(reg32) dst.0, in(reg64) map.0, in(reg32) c0, in(reg32) c1, in(reg32) c2, in(reg32) bar.0, options(nostack)
        )
    };
}

/// As [`load_2d`], with an L2 cache policy ([`evict_first_policy`]):
/// `cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [dst], [map, {c0, c1}], [bar], policy;`
///
/// # Safety
///
/// As [`load_2d`]; `policy` is a cache policy made by [`evict_first_policy`].
#[inline(always)]
pub unsafe fn load_2d_hinted(dst: SmemAddr, map: TensorMap, c0: u32, c1: u32, bar: SmemAddr, policy: u64) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [{0}], [{1}, {{{2}, {3}}}], [{4}], {5};",
            in(reg32) dst.0, in(reg64) map.0, in(reg32) c0, in(reg32) c1, in(reg32) bar.0, in(reg64) policy, options(nostack)
        )
    };
}

/// 2D tile store from shared memory; elements outside the tensor are not written:
/// `cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [map, {c0, c1}], [src];`
///
/// # Safety
///
/// `map` points to a valid 2D `CUtensorMap` whose tensor is writable global memory that no other thread accesses until
/// the store completes ([`store_wait`]); `src` is a shared-memory address of this CTA, aligned as the swizzle requires,
/// holding one box written before this call and ordered for the async proxy
/// ([`super::memory::fence_proxy_async_shared`]); `src` must not be overwritten before [`store_wait_read`] covers this
/// store.
#[inline(always)]
pub unsafe fn store_2d(map: TensorMap, c0: u32, c1: u32, src: SmemAddr) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [{0}, {{{1}, {2}}}], [{3}];",
            in(reg64) map.0, in(reg32) c0, in(reg32) c1, in(reg32) src.0, options(nostack)
        )
    };
}
/// As [`store_2d`], with an L2 cache policy ([`evict_first_policy`]):
/// `cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [map, {c0, c1}], [src], policy;`
///
/// # Safety
///
/// As [`store_2d`]; `policy` is a cache policy made by [`evict_first_policy`].
#[inline(always)]
pub unsafe fn store_2d_hinted(map: TensorMap, c0: u32, c1: u32, src: SmemAddr, policy: u64) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [{0}, {{{1}, {2}}}], [{3}], {4};",
            in(reg64) map.0, in(reg32) c0, in(reg32) c1, in(reg32) src.0, in(reg64) policy, options(nostack)
        )
    };
}

/// An L2 policy under which the lines an access brings in are the first to go:
/// `createpolicy.fractional.L2::evict_first.b64 policy, 1.0;`
#[inline(always)]
pub fn evict_first_policy() -> u64 {
    let p: u64;
    unsafe {
        asm!("createpolicy.fractional.L2::evict_first.b64 {0}, 1.0;", out(reg64) p, options(nostack, nomem, pure))
    };
    p
}

/// `cp.async.bulk.commit_group;`
#[inline(always)]
pub fn store_commit() {
    unsafe { asm!("cp.async.bulk.commit_group;", options(nostack)) };
}
/// Waits until at most `N` bulk store groups still read shared memory:
/// `cp.async.bulk.wait_group.read N;`
#[inline(always)]
pub fn store_wait_read<const N: u32>() {
    unsafe { asm!("cp.async.bulk.wait_group.read {0};", const N, options(nostack)) };
}
/// Waits until at most `N` bulk store groups are incomplete (writes visible):
/// `cp.async.bulk.wait_group N;`
#[inline(always)]
pub fn store_wait<const N: u32>() {
    unsafe { asm!("cp.async.bulk.wait_group {0};", const N, options(nostack)) };
}

/// Contiguous bulk copy global -> shared that completes `bytes` on `bar` (addresses 16-byte
/// aligned, `bytes` a multiple of 16):
/// `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], bytes, [bar];`
///
/// # Safety
///
/// `src` is a 16-byte aligned address of `bytes` readable bytes of global memory; `dst` a 16-byte aligned shared-memory
/// address of this CTA with `bytes` bytes that nothing accesses until the copy completes; `bytes` is a multiple of 16;
/// `bar` is an initialised mbarrier of this CTA whose current phase expects these bytes.
#[inline(always)]
pub unsafe fn bulk_load(dst: SmemAddr, src: *const u8, bytes: u32, bar: SmemAddr) {
    unsafe {
        asm!(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{0}], [{1}], {2}, [{3}];",
            in(reg32) dst.0, in(reg64) src, in(reg32) bytes, in(reg32) bar.0, options(nostack)
        )
    };
}

/// Contiguous bulk copy shared -> global (local or a peer's memory over NVLink), tracked by the
/// bulk async-group of [`store_commit`] / [`store_wait`]:
/// `cp.async.bulk.global.shared::cta.bulk_group [dst], [src], bytes;`
///
/// # Safety
///
/// `dst` is a 16-byte aligned address of `bytes` writable bytes of global memory (local or peer-mapped) that no other
/// thread accesses until the store completes ([`store_wait`]); `src` a 16-byte aligned shared-memory address of this
/// CTA holding the `bytes` bytes, written before and fenced for the async proxy, and not overwritten before
/// [`store_wait_read`] covers this store; `bytes` is a multiple of 16.
#[inline(always)]
pub unsafe fn bulk_store(dst: *mut u8, src: SmemAddr, bytes: u32) {
    unsafe {
        asm!("cp.async.bulk.global.shared::cta.bulk_group [{0}], [{1}], {2};", in(reg64) dst, in(reg32) src.0, in(reg32) bytes, options(nostack))
    };
}
