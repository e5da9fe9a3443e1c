//! Testing support shared by the integration tests (tests/tests/*.rs) and the benchmarks:
//! GPU gating, deterministic data, and CPU references computed independently of the kernels.

pub mod attention;
pub mod data;
pub mod gpu;
pub mod moe;
pub mod reference;
