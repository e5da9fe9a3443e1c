//! Kernel entry points. Each is listed in `mkernel_config::KERNELS` with its launch bounds.

pub mod ag_gemm;
pub mod attention;
pub mod collectives;
pub mod gemm;
pub mod gemm_rs;
pub mod internode;
pub mod iota;
pub mod moe;
