//! mkernel-device: every GPU kernel of mkernel, in `no_std` Rust, compiled to PTX.
//!
//! - [`arch`]: one small function per PTX idiom (ids, barriers, mbarrier, TMA, wgmma, memory
//!   model, ...), each with the PTX it emits in its doc comment. Nothing else writes `asm!`.
//! - [`gemm`]: the building blocks of the persistent warp-specialized GEMM (tile scheduler,
//!   TMA producer, wgmma consumer mainloop, epilogue) that the fused kernels reuse.
//! - [`kernels`]: the `extern "ptx-kernel"` entry points. Each one is listed, with its launch
//!   bounds, in `mkernel_config::KERNELS`; the PTX linker refuses a mismatch.
#![no_std]
#![feature(
    abi_ptx,
    asm_experimental_arch,
    stdarch_nvptx,
    core_intrinsics,
    gpu_launch_sized_workgroup_mem,
    gpu_intrinsics
)]
#![allow(internal_features)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod arch;
pub mod comm;
pub mod gemm;
pub mod kernels;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    arch::trap()
}
