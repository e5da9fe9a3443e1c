//! Kernel entry points. Each is listed in `mkernel_config::KERNELS` with its launch bounds.
//!
//! # Safety
//!
//! Every entry point is an `unsafe extern "ptx-kernel" fn` that only the host library (crate
//! `mkernel`) launches. Their `# Safety` sections list the arguments' requirements on top of
//! "the launch contract", common to all of them:
//! - a 1-D grid and 1-D blocks of exactly the entry's `KernelSpec::max_threads` threads, with
//!   the `KernelSpec::dynamic_smem` bytes of dynamic shared memory;
//! - pointers and tensor maps are device addresses (or host-mapped memory) that stay valid and
//!   allocated until the launch completes; tensor maps are `CUtensorMap`s the host encoded for
//!   the kernel's boxes and swizzle; no other work writes the kernel's inputs or accesses its
//!   outputs while it runs;
//! - a communicating kernel gets a `desc` that meets the communicator contract
//!   ([`crate::comm`]), and every rank of the communicator launches it with the same grid and
//!   the same scalar arguments (sizes, offsets, dtype) in the same order of communicating
//!   launches, so epochs and flags match across ranks; its grid is at most
//!   `mkernel_config::comm::MAX_COMM_CTAS - 1` CTAs (one epoch counter and flag slot each).

pub mod ag_gemm;
pub mod allreduce_shot;
pub mod attention;
pub mod collectives;
pub mod gemm;
pub mod gemm_decode;
pub mod gemm_rs;
pub mod internode;
pub mod iota;
pub mod moe;
