//! Shared memory: the dynamic allocation and 32-bit `.shared::cta` addresses.
use core::arch::asm;

/// A 32-bit address in the CTA's shared window, as `mbarrier`, `cp.async`, TMA, `ldmatrix` and
/// wgmma descriptors take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct SmemAddr(pub u32);

impl SmemAddr {
    /// The address `bytes` further on.
    #[inline(always)]
    pub const fn add(self, bytes: u32) -> SmemAddr {
        SmemAddr(self.0 + bytes)
    }
}

/// Alignment unit of the dynamic shared allocation: 1024 bytes, what 128-byte TMA swizzle needs.
#[repr(C, align(1024))]
pub struct Align1024([u8; 1024]);

/// Base of the dynamic shared memory (`extern .shared .align 1024 .b8 ...[]`), 1024-byte aligned,
/// as a generic pointer. Its size is whatever the launch gave.
#[inline(always)]
pub fn dynamic_smem() -> *mut u8 {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<Align1024>() as *mut u8
}

/// Generic pointer to shared address: `cvta.to.shared.u64 d, p;` (truncated to 32 bits).
#[inline(always)]
pub fn to_smem_addr<T>(p: *const T) -> SmemAddr {
    let r: u64;
    unsafe { asm!("cvta.to.shared.u64 {0}, {1};", out(reg64) r, in(reg64) p as u64, options(pure, nomem, nostack)) };
    SmemAddr(r as u32)
}

/// Base of the dynamic shared memory as a shared address.
#[inline(always)]
pub fn dynamic_smem_addr() -> SmemAddr {
    to_smem_addr(dynamic_smem())
}

/// `st.shared.v4.b32 [a], {x, y, z, w};`
///
/// # Safety
///
/// `a` is a 16-byte aligned shared-memory address of this CTA with 16 writable bytes inside the launch's dynamic
/// allocation, which no other thread or async operation accesses until a barrier orders them after this store.
#[inline(always)]
pub unsafe fn st_shared_v4(a: SmemAddr, v: [u32; 4]) {
    unsafe {
        asm!("st.shared.v4.b32 [{0}], {{{1}, {2}, {3}, {4}}};", in(reg32) a.0, in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3], options(nostack))
    };
}
/// `ld.shared.v4.b32 {x, y, z, w}, [a];`
///
/// # Safety
///
/// `a` is a 16-byte aligned shared-memory address of this CTA with 16 readable bytes inside the launch's allocation,
/// whose writers are ordered before this load by a barrier (or are this thread).
#[inline(always)]
pub unsafe fn ld_shared_v4(a: SmemAddr) -> [u32; 4] {
    let (x, y, z, w): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.shared.v4.b32 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) x, out(reg32) y, out(reg32) z, out(reg32) w, in(reg32) a.0, options(nostack, readonly))
    };
    [x, y, z, w]
}

/// `st.volatile.shared.u32 [a], v;` (a flag another warp of the CTA polls)
///
/// # Safety
///
/// `a` is a 4-byte aligned shared-memory address of this CTA inside the launch's allocation, used as a flag that other
/// threads access only with volatile or atomic accesses.
#[inline(always)]
pub unsafe fn st_volatile_shared_u32(a: SmemAddr, v: u32) {
    unsafe { asm!("st.volatile.shared.u32 [{0}], {1};", in(reg32) a.0, in(reg32) v, options(nostack)) };
}
/// `ld.volatile.shared.u32 d, [a];`
///
/// # Safety
///
/// `a` is a 4-byte aligned shared-memory address of this CTA inside the launch's allocation, used as a flag that other
/// threads access only with volatile or atomic accesses.
#[inline(always)]
pub unsafe fn ld_volatile_shared_u32(a: SmemAddr) -> u32 {
    let r: u32;
    unsafe { asm!("ld.volatile.shared.u32 {0}, [{1}];", out(reg32) r, in(reg32) a.0, options(nostack, readonly)) };
    r
}

/// Relaxed shared-memory add returning the old value: `atom.shared.add.u32 d, [a], v;`
///
/// # Safety
///
/// `a` is a 4-byte aligned shared-memory address of this CTA inside the launch's allocation that other threads access
/// only atomically while this add can race with them.
#[inline(always)]
pub unsafe fn atom_add_shared_u32(a: SmemAddr, v: u32) -> u32 {
    let r: u32;
    unsafe { asm!("atom.shared.add.u32 {0}, [{1}], {2};", out(reg32) r, in(reg32) a.0, in(reg32) v, options(nostack)) };
    r
}
/// Relaxed shared-memory add with no result: `red.shared.add.u32 [a], v;`
///
/// # Safety
///
/// `a` is a 4-byte aligned shared-memory address of this CTA inside the launch's allocation that other threads access
/// only atomically while this add can race with them.
#[inline(always)]
pub unsafe fn red_add_shared_u32(a: SmemAddr, v: u32) {
    unsafe { asm!("red.shared.add.u32 [{0}], {1};", in(reg32) a.0, in(reg32) v, options(nostack)) };
}
/// `st.shared.u32 [a], v;`
///
/// # Safety
///
/// `a` is a 4-byte aligned shared-memory address of this CTA inside the launch's allocation that no other thread
/// accesses until a barrier orders them after this store.
#[inline(always)]
pub unsafe fn st_shared_u32(a: SmemAddr, v: u32) {
    unsafe { asm!("st.shared.u32 [{0}], {1};", in(reg32) a.0, in(reg32) v, options(nostack)) };
}
/// `ld.shared.u32 d, [a];`
///
/// # Safety
///
/// `a` is a 4-byte aligned shared-memory address of this CTA inside the launch's allocation whose writers are ordered
/// before this load by a barrier (or are this thread).
#[inline(always)]
pub unsafe fn ld_shared_u32(a: SmemAddr) -> u32 {
    let r: u32;
    unsafe { asm!("ld.shared.u32 {0}, [{1}];", out(reg32) r, in(reg32) a.0, options(nostack, readonly)) };
    r
}
