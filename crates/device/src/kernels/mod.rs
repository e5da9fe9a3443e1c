//! Kernel entry points. Each is listed in `mkernel_config::KERNELS` with its launch bounds.

pub mod attention;
pub mod collectives;
pub mod fused;
pub mod gemm;
pub mod internode;
pub mod iota;
pub mod moe;
