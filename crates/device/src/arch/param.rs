//! Launch-parameter blocks: a kernel's first parameter passed by value (tensor maps and
//! arguments together), read in place through its generic address.
//!
//! The host passes the block by value at launch, so nothing is uploaded and a CUDA graph keeps
//! its own copy of it. The PTX declares the parameter `.align 64` (the PTX linker's
//! `PARAM_BLOCK_ALIGN`), so a `CUtensorMap` at a 64-byte offset inside it is a valid TMA
//! descriptor in parameter space.

/// Generic address of the entry `$entry`'s first parameter (a by-value block):
/// `mov.u64 %rd, <entry>_param_0; cvta.param.u64 %rd, %rd;`
///
/// Expand it in the body of the `extern "ptx-kernel"` fn named `$entry` itself, not in a
/// function it calls: PTX names a parameter only inside its own entry. `$entry` is a string
/// literal, or `stringify!(name)` in a macro that declares entries.
#[macro_export]
macro_rules! param_block {
    ($entry:expr) => {{
        let p: u64;
        // SAFETY: reads no memory; PTX ISA 7.7+ lets a kernel take the generic address of its
        // own parameters (`cvta.param`), and the parameter space is readable for the whole launch.
        unsafe {
            core::arch::asm!(
                concat!("mov.u64 {0}, ", $entry, "_param_0;"),
                "cvta.param.u64 {0}, {0};",
                out(reg64) p,
                options(pure, nomem, nostack)
            )
        };
        p as *const u8
    }};
}

/// `x` through a register move the optimizer cannot see through. For 32-bit fields of a
/// parameter block read by value: LLVM loads two adjacent ones as one 64-bit `ld.param` and
/// extracts the upper with a shift, after which it no longer knows the field fits 32 bits
/// (e.g. `row * ldc` becomes a 64-bit `mul.lo` instead of `mul.wide.u32`, which ptxas could not
/// rematerialize and spilled in the decode GEMM's 256-token bucket).
#[inline(always)]
pub fn opaque_u32(x: u32) -> u32 {
    let r: u32;
    // SAFETY: a register move; reads and writes no memory.
    unsafe { core::arch::asm!("mov.b32 {0}, {1};", out(reg32) r, in(reg32) x, options(pure, nomem, nostack)) };
    r
}
