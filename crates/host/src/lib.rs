//! mkernel: persistent fused communication + compute kernels for multi-GPU training and inference.
//!
//! The kernels are written in Rust (crates/device), compiled to PTX by rustc's nvptx64 backend,
//! and the PTX is committed in `ptx/mkernel.ptx` and embedded here, so this crate builds on stable
//! Rust with no CUDA toolkit: the driver is loaded at run time through cudarc.
//!
//! Layers:
//! - [`Device`]: a CUDA context with mkernel's module loaded (errors, never panics, when no
//!   driver or no Hopper GPU is present);
//! - operations ([`gemm`]) take the cudarc streams and buffers a server already has, with a raw
//!   pointer layer underneath ([`gemm::GemmPlan::new_raw`]);
//! - [`tensor_map`]: TMA descriptors encoded with `cuTensorMapEncodeTiled`.

pub mod comm;
pub mod error;
pub mod fused;
pub mod gemm;
pub mod ops;
pub mod ptx;
pub mod runtime;
pub mod tensor_map;
pub mod tune;

pub use comm::{CommConfig, Communicator, ReduceDtype, SymBuffer};
pub use cudarc;
pub use error::{Error, Result};
pub use gemm::{BLayout, GemmPlan, GemmShape, OutDtype};
pub use mkernel_bootstrap as bootstrap;
pub use mkernel_proxy as proxy;
pub use runtime::Device;
