//! mkernel: persistent fused communication + compute kernels for multi-GPU training and inference.
//!
//! The kernels are written in Rust (crates/device), compiled to PTX by rustc's nvptx64 backend,
//! and the PTX is committed in `ptx/mkernel.ptx` and embedded here, so this crate builds on stable
//! Rust with no CUDA toolkit: the driver is loaded at run time through cudarc.
//!
//! Layers:
//! - [`Device`]: a CUDA context with mkernel's module loaded (errors, never panics, when no
//!   driver or no Hopper GPU is present);
//! - operations ([`gemm`], the communicator's collectives, the fused operations in [`ops`])
//!   take the cudarc streams and buffers a server already has. [`gemm::GemmPlan`] and
//!   [`ops::attention::FlashAttentionPlan`] are made from shapes and take their buffers (and
//!   GEMM's row count) at each launch; the other plans borrow their buffers and communicator
//!   for their lifetime, and a raw-pointer layer underneath is `unsafe`
//!   ([`ops::AgGemmPlan::new_raw`], [`ops::GemmRsPlan::new_raw`],
//!   [`Communicator::all_gather_raw`], [`Communicator::reduce_scatter_raw`], and launches on a
//!   raw `CUstream`: [`ops::AgGemmPlan::launch_raw`], [`ops::GemmRsPlan::launch_raw`]);
//! - [`tensor_map`]: TMA descriptors encoded with `cuTensorMapEncodeTiled`.
#![deny(clippy::undocumented_unsafe_blocks)]

mod check;
pub mod comm;
pub mod error;
pub mod gemm;
pub mod ops;
pub mod params;
pub mod ptx;
pub mod runtime;
pub mod tensor_map;
pub mod tune;

pub use comm::{
    AbortHandle, AllReducePath, AllReducePolicy, CommConfig, Communicator, HeapRegion, ReduceDtype, ReduceElem,
    SymBuffer,
};
pub use cudarc;
pub use error::{Error, Result};
pub use gemm::{BLayout, GemmConfig, GemmKernel, GemmLaunch, GemmPlan, GemmShape, GemmTensors, OutDtype};
pub use mkernel_bootstrap as bootstrap;
pub use mkernel_proxy as proxy;
pub use ops::{AgGemmPlan, GemmRsPlan, RsSplit};
pub use runtime::Device;
