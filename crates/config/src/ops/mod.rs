//! One module per operation: its launch argument block, its `KernelSpec`s, its `#[repr(C)]`
//! shared-memory struct (offsets from `offset_of!`, budgets checked at compile time) and the table
//! of which warps take which role. The device code of op `x` is `crates/device/src/kernels/x/`
//! (or `kernels/x.rs`), its host plan `crates/host/src/ops/x.rs` (the plain GEMM's:
//! `crates/host/src/gemm.rs`).
//!
//! Shared pieces stay outside: the GEMM tile and ring (`crate::gemm`), the bulk-copy ring
//! (`crate::bulk`), the stream-K split (`crate::stream_k`) and the heap's flags (`crate::comm`).

pub mod ag_gemm;
pub mod attention;
pub mod attention_bwd;
pub mod gemm;
pub mod gemm_decode;
pub mod gemm_rs;
pub mod moe;
