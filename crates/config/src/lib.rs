//! mkernel-config: every number that the kernels, their launches and the PTX build must agree on.
//!
//! This crate is `no_std` with no required dependencies (the optional `bytemuck` feature, for
//! the host, adds `Pod` impls of the FIFO's wire types), so that the nvptx device crate, the host runtime,
//! the PTX linker (which patches launch bounds into the PTX) and xtask all compile the *same*
//! constants. A kernel's shared-memory budget, thread count and register split are computed here
//! once and checked at compile time (`const _: () = ...check()`).
//!
//! Each operation has one module in [`ops`] (argument block, kernel specs, shared-memory struct,
//! warp roles); [`gemm`], [`bulk`], [`stream_k`], [`comm`] and [`trace`] are shared by them, and
//! [`kernels`] lists every kernel entry.
#![no_std]

pub mod bulk;
pub mod comm;
pub mod fifo;
pub mod gemm;
pub mod kernels;
pub mod ops;
pub mod stream_k;
pub mod trace;

pub use gemm::GemmTile;
pub use kernels::{KernelSpec, KERNELS};

/// The opaque words of one `CUtensorMap` (128 bytes), as a field of a launch-parameter block: at a
/// 64-byte offset of a block that the PTX declares 64-byte aligned (crates/ptx-linker,
/// `PARAM_BLOCK_ALIGN`), it is a valid TMA descriptor in parameter space.
pub type TensorMapWords = [u64; 16];

/// Largest launch-parameter block (the driver's limit for all of a kernel's parameters before
/// CUDA 12.1).
pub const MAX_PARAM_BYTES: usize = 4096;

/// Threads in a warp.
pub const WARP_SIZE: u32 = 32;
/// Threads in a warpgroup (the unit that issues `wgmma`).
pub const WARPGROUP_SIZE: u32 = 128;
/// Largest dynamic shared memory an sm_90 CTA may opt into (227 KiB).
pub const SM90_MAX_SMEM_PER_CTA: u32 = 227 * 1024;
/// Registers in one sm_90 multiprocessor's register file.
pub const SM90_REGS_PER_SM: u32 = 64 * 1024;
