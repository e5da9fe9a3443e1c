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
/// function it calls: PTX names a parameter only inside its own entry.
#[macro_export]
macro_rules! param_block {
    ($entry:literal) => {{
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
