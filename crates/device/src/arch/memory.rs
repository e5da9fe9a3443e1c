//! The memory model, with order and scope spelled out in every instruction.
//!
//! Scope: `Cta` (this block), `Gpu` (this device), `Sys` (peers over NVLink and the host CPU).
//! Signalling between GPUs and with the CPU proxy uses `.sys`. Addresses are generic, so the
//! same helpers work on local, peer-mapped and host-mapped memory.
use core::arch::asm;

/// Visibility scope of an ordering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Cta,
    Gpu,
    Sys,
}

/// `ld.acquire.{cta,gpu,sys}.u32 d, [p];`
///
/// # Safety
///
/// `p` is a 4-byte aligned generic address of a readable `u32` (local, peer-mapped or host-mapped global memory, or
/// shared memory) for the whole access; concurrent writers use the same address with `.relaxed`/`.release` stores or
/// atomics of a scope that includes this thread.
#[inline(always)]
pub unsafe fn ld_acquire_u32(scope: Scope, p: *const u32) -> u32 {
    let r: u32;
    unsafe {
        match scope {
            Scope::Cta => asm!("ld.acquire.cta.u32 {0}, [{1}];", out(reg32) r, in(reg64) p, options(nostack)),
            Scope::Gpu => asm!("ld.acquire.gpu.u32 {0}, [{1}];", out(reg32) r, in(reg64) p, options(nostack)),
            Scope::Sys => asm!("ld.acquire.sys.u32 {0}, [{1}];", out(reg32) r, in(reg64) p, options(nostack)),
        }
    }
    r
}
/// `ld.relaxed.{cta,gpu,sys}.u32 d, [p];`
///
/// # Safety
///
/// `p` is a 4-byte aligned generic address of a readable `u32` for the whole access; concurrent writers use only strong
/// (relaxed/release/atomic) accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn ld_relaxed_u32(scope: Scope, p: *const u32) -> u32 {
    let r: u32;
    unsafe {
        match scope {
            Scope::Cta => asm!("ld.relaxed.cta.u32 {0}, [{1}];", out(reg32) r, in(reg64) p, options(nostack)),
            Scope::Gpu => asm!("ld.relaxed.gpu.u32 {0}, [{1}];", out(reg32) r, in(reg64) p, options(nostack)),
            Scope::Sys => asm!("ld.relaxed.sys.u32 {0}, [{1}];", out(reg32) r, in(reg64) p, options(nostack)),
        }
    }
    r
}
/// `ld.acquire.{cta,gpu,sys}.u64 d, [p];`
///
/// # Safety
///
/// `p` is an 8-byte aligned generic address of a readable `u64` for the whole access; concurrent writers use only
/// strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn ld_acquire_u64(scope: Scope, p: *const u64) -> u64 {
    let r: u64;
    unsafe {
        match scope {
            Scope::Cta => asm!("ld.acquire.cta.u64 {0}, [{1}];", out(reg64) r, in(reg64) p, options(nostack)),
            Scope::Gpu => asm!("ld.acquire.gpu.u64 {0}, [{1}];", out(reg64) r, in(reg64) p, options(nostack)),
            Scope::Sys => asm!("ld.acquire.sys.u64 {0}, [{1}];", out(reg64) r, in(reg64) p, options(nostack)),
        }
    }
    r
}
/// `st.release.{cta,gpu,sys}.u32 [p], v;`
///
/// # Safety
///
/// `p` is a 4-byte aligned generic address of a writable `u32` for the whole access; concurrent readers and writers use
/// only strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn st_release_u32(scope: Scope, p: *mut u32, v: u32) {
    unsafe {
        match scope {
            Scope::Cta => asm!("st.release.cta.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
            Scope::Gpu => asm!("st.release.gpu.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
            Scope::Sys => asm!("st.release.sys.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
        }
    }
}
/// `st.release.{cta,gpu,sys}.u64 [p], v;`
///
/// # Safety
///
/// `p` is an 8-byte aligned generic address of a writable `u64` for the whole access; concurrent readers and writers
/// use only strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn st_release_u64(scope: Scope, p: *mut u64, v: u64) {
    unsafe {
        match scope {
            Scope::Cta => asm!("st.release.cta.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack)),
            Scope::Gpu => asm!("st.release.gpu.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack)),
            Scope::Sys => asm!("st.release.sys.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack)),
        }
    }
}
/// `st.relaxed.{cta,gpu,sys}.u32 [p], v;`
///
/// # Safety
///
/// `p` is a 4-byte aligned generic address of a writable `u32` for the whole access; concurrent readers and writers use
/// only strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn st_relaxed_u32(scope: Scope, p: *mut u32, v: u32) {
    unsafe {
        match scope {
            Scope::Cta => asm!("st.relaxed.cta.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
            Scope::Gpu => asm!("st.relaxed.gpu.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
            Scope::Sys => asm!("st.relaxed.sys.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
        }
    }
}
/// `st.relaxed.{cta,gpu,sys}.u64 [p], v;`
///
/// # Safety
///
/// `p` is an 8-byte aligned generic address of a writable `u64` for the whole access; concurrent readers and writers
/// use only strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn st_relaxed_u64(scope: Scope, p: *mut u64, v: u64) {
    unsafe {
        match scope {
            Scope::Cta => asm!("st.relaxed.cta.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack)),
            Scope::Gpu => asm!("st.relaxed.gpu.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack)),
            Scope::Sys => asm!("st.relaxed.sys.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack)),
        }
    }
}
/// Release-ordered add with no result: `red.release.{cta,gpu,sys}.add.u32 [p], v;`
///
/// # Safety
///
/// `p` is a 4-byte aligned generic address of a writable `u32` for the whole access; other threads access it only with
/// strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn red_release_add_u32(scope: Scope, p: *mut u32, v: u32) {
    unsafe {
        match scope {
            Scope::Cta => asm!("red.release.cta.add.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
            Scope::Gpu => asm!("red.release.gpu.add.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
            Scope::Sys => asm!("red.release.sys.add.u32 [{0}], {1};", in(reg64) p, in(reg32) v, options(nostack)),
        }
    }
}
/// `atom.acq_rel.{cta,gpu,sys}.add.u32 d, [p], v;` (returns the old value)
///
/// # Safety
///
/// `p` is a 4-byte aligned generic address of a readable and writable `u32` for the whole access; other threads access
/// it only with strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn atom_acq_rel_add_u32(scope: Scope, p: *mut u32, v: u32) -> u32 {
    let r: u32;
    unsafe {
        match scope {
            Scope::Cta => {
                asm!("atom.acq_rel.cta.add.u32 {0}, [{1}], {2};", out(reg32) r, in(reg64) p, in(reg32) v, options(nostack))
            }
            Scope::Gpu => {
                asm!("atom.acq_rel.gpu.add.u32 {0}, [{1}], {2};", out(reg32) r, in(reg64) p, in(reg32) v, options(nostack))
            }
            Scope::Sys => {
                asm!("atom.acq_rel.sys.add.u32 {0}, [{1}], {2};", out(reg32) r, in(reg64) p, in(reg32) v, options(nostack))
            }
        }
    }
    r
}
/// `atom.acq_rel.{cta,gpu,sys}.add.u64 d, [p], v;` (returns the old value; e.g. counters whose
/// last adder acts on everyone's data)
///
/// # Safety
///
/// `p` is an 8-byte aligned generic address of a readable and writable `u64` for the whole access; other threads access
/// it only with strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn atom_acq_rel_add_u64(scope: Scope, p: *mut u64, v: u64) -> u64 {
    let r: u64;
    unsafe {
        match scope {
            Scope::Cta => {
                asm!("atom.acq_rel.cta.add.u64 {0}, [{1}], {2};", out(reg64) r, in(reg64) p, in(reg64) v, options(nostack))
            }
            Scope::Gpu => {
                asm!("atom.acq_rel.gpu.add.u64 {0}, [{1}], {2};", out(reg64) r, in(reg64) p, in(reg64) v, options(nostack))
            }
            Scope::Sys => {
                asm!("atom.acq_rel.sys.add.u64 {0}, [{1}], {2};", out(reg64) r, in(reg64) p, in(reg64) v, options(nostack))
            }
        }
    }
    r
}
/// `atom.relaxed.{cta,gpu,sys}.add.u64 d, [p], v;` (returns the old value; e.g. claiming FIFO slots)
///
/// # Safety
///
/// `p` is an 8-byte aligned generic address of a readable and writable `u64` for the whole access; other threads access
/// it only with strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn atom_relaxed_add_u64(scope: Scope, p: *mut u64, v: u64) -> u64 {
    let r: u64;
    unsafe {
        match scope {
            Scope::Cta => {
                asm!("atom.relaxed.cta.add.u64 {0}, [{1}], {2};", out(reg64) r, in(reg64) p, in(reg64) v, options(nostack))
            }
            Scope::Gpu => {
                asm!("atom.relaxed.gpu.add.u64 {0}, [{1}], {2};", out(reg64) r, in(reg64) p, in(reg64) v, options(nostack))
            }
            Scope::Sys => {
                asm!("atom.relaxed.sys.add.u64 {0}, [{1}], {2};", out(reg64) r, in(reg64) p, in(reg64) v, options(nostack))
            }
        }
    }
    r
}
/// `atom.acq_rel.{cta,gpu,sys}.cas.b32 d, [p], expected, new;` (returns the old value)
///
/// # Safety
///
/// `p` is a 4-byte aligned generic address of a readable and writable `u32` for the whole access; other threads access
/// it only with strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn atom_acq_rel_cas_u32(scope: Scope, p: *mut u32, expected: u32, new: u32) -> u32 {
    let r: u32;
    unsafe {
        match scope {
            Scope::Cta => {
                asm!("atom.acq_rel.cta.cas.b32 {0}, [{1}], {2}, {3};", out(reg32) r, in(reg64) p, in(reg32) expected, in(reg32) new, options(nostack))
            }
            Scope::Gpu => {
                asm!("atom.acq_rel.gpu.cas.b32 {0}, [{1}], {2}, {3};", out(reg32) r, in(reg64) p, in(reg32) expected, in(reg32) new, options(nostack))
            }
            Scope::Sys => {
                asm!("atom.acq_rel.sys.cas.b32 {0}, [{1}], {2}, {3};", out(reg32) r, in(reg64) p, in(reg32) expected, in(reg32) new, options(nostack))
            }
        }
    }
    r
}
/// `fence.acq_rel.{cta,gpu,sys};`
#[inline(always)]
pub fn fence_acq_rel(scope: Scope) {
    unsafe {
        match scope {
            Scope::Cta => asm!("fence.acq_rel.cta;", options(nostack)),
            Scope::Gpu => asm!("fence.acq_rel.gpu;", options(nostack)),
            Scope::Sys => asm!("fence.acq_rel.sys;", options(nostack)),
        }
    }
}
/// `fence.sc.{cta,gpu,sys};`
#[inline(always)]
pub fn fence_sc(scope: Scope) {
    unsafe {
        match scope {
            Scope::Cta => asm!("fence.sc.cta;", options(nostack)),
            Scope::Gpu => asm!("fence.sc.gpu;", options(nostack)),
            Scope::Sys => asm!("fence.sc.sys;", options(nostack)),
        }
    }
}
/// Orders generic-proxy accesses before later async-proxy ones (TMA, wgmma) on all state spaces:
/// `fence.proxy.async;`
#[inline(always)]
pub fn fence_proxy_async() {
    unsafe { asm!("fence.proxy.async;", options(nostack)) };
}
/// As [`fence_proxy_async`] for shared memory only: `fence.proxy.async.shared::cta;`
#[inline(always)]
pub fn fence_proxy_async_shared() {
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
}
/// `ld.relaxed.{cta,gpu,sys}.u64 d, [p];`
///
/// # Safety
///
/// `p` is an 8-byte aligned generic address of a readable `u64` for the whole access; concurrent writers use only
/// strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn ld_relaxed_u64(scope: Scope, p: *const u64) -> u64 {
    let r: u64;
    unsafe {
        match scope {
            Scope::Cta => asm!("ld.relaxed.cta.u64 {0}, [{1}];", out(reg64) r, in(reg64) p, options(nostack)),
            Scope::Gpu => asm!("ld.relaxed.gpu.u64 {0}, [{1}];", out(reg64) r, in(reg64) p, options(nostack)),
            Scope::Sys => asm!("ld.relaxed.sys.u64 {0}, [{1}];", out(reg64) r, in(reg64) p, options(nostack)),
        }
    }
    r
}
/// 16 bytes from global memory: `ld.global.v4.u32 {a, b, c, d}, [p];`
///
/// # Safety
///
/// `p` is a 16-byte aligned address of 16 readable bytes of global memory that no thread writes during the load (weak
/// load; the data is published to this thread by an acquire or a barrier).
#[inline(always)]
pub unsafe fn ld_v4(p: *const u8) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.global.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) p, options(nostack, readonly))
    };
    [a, b, c, d]
}
/// 16 bytes to global memory (local or a peer's, over NVLink): `st.global.v4.u32 [p], {a, b, c, d};`
///
/// # Safety
///
/// `p` is a 16-byte aligned address of 16 writable bytes of global memory (local or peer-mapped) that no other thread
/// accesses concurrently; readers are ordered after it by a later release or barrier.
#[inline(always)]
pub unsafe fn st_v4(p: *mut u8, v: [u32; 4]) {
    unsafe {
        asm!("st.global.v4.u32 [{0}], {{{1}, {2}, {3}, {4}}};", in(reg64) p, in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3], options(nostack))
    };
}
/// Two 8-byte words to global memory, each single-copy atomic (what the LL protocol relies on:
/// a word's data half and flag half land together): `st.relaxed.sys.global.v2.u64 [p], {a, b};`
///
/// # Safety
///
/// `p` is a 16-byte aligned address of 16 writable bytes of global memory (local, peer-mapped or host-mapped);
/// concurrent readers use strong loads such as [`ld_relaxed_sys_v2_u64`].
#[inline(always)]
pub unsafe fn st_relaxed_sys_v2_u64(p: *mut u8, a: u64, b: u64) {
    unsafe {
        asm!("st.relaxed.sys.global.v2.u64 [{0}], {{{1}, {2}}};", in(reg64) p, in(reg64) a, in(reg64) b, options(nostack))
    };
}
/// Two 8-byte words from global memory, each single-copy atomic:
/// `ld.relaxed.sys.global.v2.u64 {a, b}, [p];`
///
/// # Safety
///
/// `p` is a 16-byte aligned address of 16 readable bytes of global memory; concurrent writers use strong stores such as
/// [`st_relaxed_sys_v2_u64`].
#[inline(always)]
pub unsafe fn ld_relaxed_sys_v2_u64(p: *const u8) -> (u64, u64) {
    let (a, b): (u64, u64);
    unsafe {
        asm!("ld.relaxed.sys.global.v2.u64 {{{0}, {1}}}, [{2}];", out(reg64) a, out(reg64) b, in(reg64) p, options(nostack))
    };
    (a, b)
}
/// 8 bytes from global memory: `ld.global.v2.u32 {a, b}, [p];`
///
/// # Safety
///
/// `p` is an 8-byte aligned address of 8 readable bytes of global memory that no thread writes during the load.
#[inline(always)]
pub unsafe fn ld_v2(p: *const u8) -> [u32; 2] {
    let (a, b): (u32, u32);
    unsafe {
        asm!("ld.global.v2.u32 {{{0}, {1}}}, [{2}];", out(reg32) a, out(reg32) b, in(reg64) p, options(nostack, readonly))
    };
    [a, b]
}
/// 8 bytes to global memory: `st.global.v2.u32 [p], {a, b};`
///
/// # Safety
///
/// `p` is an 8-byte aligned address of 8 writable bytes of global memory that no other thread accesses concurrently.
#[inline(always)]
pub unsafe fn st_v2(p: *mut u8, v: [u32; 2]) {
    unsafe {
        asm!("st.global.v2.u32 [{0}], {{{1}, {2}}};", in(reg64) p, in(reg32) v[0], in(reg32) v[1], options(nostack))
    };
}
/// Release-ordered 64-bit add with no result: `red.release.{gpu,sys}.global.add.u64 [p], v;`
///
/// # Safety
///
/// `p` is an 8-byte aligned address of a writable `u64` in global memory (local, peer-mapped or host-mapped) for the
/// whole access; other threads access it only with strong accesses of a scope that includes this thread.
#[inline(always)]
pub unsafe fn red_release_add_u64(scope: Scope, p: *mut u64, v: u64) {
    unsafe {
        match scope {
            Scope::Cta => {
                asm!("red.release.cta.global.add.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack))
            }
            Scope::Gpu => {
                asm!("red.release.gpu.global.add.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack))
            }
            Scope::Sys => {
                asm!("red.release.sys.global.add.u64 [{0}], {1};", in(reg64) p, in(reg64) v, options(nostack))
            }
        }
    }
}
/// 4 bytes from global memory through L2 only (data another GPU wrote during this launch; no
/// stale L1 line): `ld.global.cg.u32 v, [p];`
///
/// # Safety
///
/// `p` is a 4-byte aligned address of 4 readable bytes of global memory that no thread writes during the load.
#[inline(always)]
pub unsafe fn ld_cg_u32(p: *const u8) -> u32 {
    let v: u32;
    unsafe { asm!("ld.global.cg.u32 {0}, [{1}];", out(reg32) v, in(reg64) p, options(nostack, readonly)) };
    v
}
/// 16 bytes from global memory through L2 only (data another SM wrote during this launch,
/// acquired by a flag; no stale L1 line): `ld.global.cg.v4.u32 {a, b, c, d}, [p];`
///
/// # Safety
///
/// `p` is a 16-byte aligned address of 16 readable bytes of global memory that no thread writes during the load.
#[inline(always)]
pub unsafe fn ld_cg_v4(p: *const u8) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.global.cg.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) p, options(nostack, readonly))
    };
    [a, b, c, d]
}
/// Pulls the 128-byte line at `p` into L2: `prefetch.global.L2 [p];`
///
/// # Safety
///
/// `p` is an address inside a global-memory allocation mapped on this device (a prefetch of an unmapped address may
/// fault).
#[inline(always)]
pub unsafe fn prefetch_l2(p: *const u8) {
    unsafe { asm!("prefetch.global.L2 [{0}];", in(reg64) p, options(nostack, readonly)) };
}

/// Adds four f32 to four consecutive f32 of global memory (one L2 reduction of 16 bytes, no
/// value returned): `red.relaxed.gpu.global.add.v4.f32 [p], {a, b, c, d};` (sm_90).
///
/// # Safety
///
/// `p` is a 16-byte aligned address of 16 bytes of writable global memory (local or peer-mapped); concurrent
/// accesses to them are other reductions, or readers ordered after every reduction by a later release or the end of
/// the kernel.
#[inline(always)]
pub unsafe fn red_add_v4_f32(p: *mut f32, v: [f32; 4]) {
    unsafe {
        asm!("red.relaxed.gpu.global.add.v4.f32 [{0}], {{{1}, {2}, {3}, {4}}};", in(reg64) p, in(reg32) v[0].to_bits(), in(reg32) v[1].to_bits(), in(reg32) v[2].to_bits(), in(reg32) v[3].to_bits(), options(nostack))
    };
}
/// `red.relaxed.gpu.global.add.v2.f32 [p], {a, b};`
///
/// # Safety
///
/// `p` is an 8-byte aligned address of 8 bytes of writable global memory; concurrent accesses to them are other
/// reductions, or readers ordered after every reduction by a later release or the end of the kernel.
#[inline(always)]
pub unsafe fn red_add_v2_f32(p: *mut f32, v: [f32; 2]) {
    unsafe {
        asm!("red.relaxed.gpu.global.add.v2.f32 [{0}], {{{1}, {2}}};", in(reg64) p, in(reg32) v[0].to_bits(), in(reg32) v[1].to_bits(), options(nostack))
    };
}
