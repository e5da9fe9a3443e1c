//! Mixture-of-experts expert FFN on one GPU (`mkernel_config::ops::moe`, docs/moe.md):
//! [`route`] (counts, padded offsets, slots; bad ids to the error record), [`gather`] (token
//! rows to their slots), [`grouped_gemm`] (up with the activation fused, down; the plain
//! GEMM's mainloop, epilogue and scheduler over the grouped rows) and [`combine`] (top-k
//! weighted sum, f32).
pub mod combine;
pub mod consumer;
pub mod gather;
pub mod grouped_gemm;
pub mod producer;
pub mod route;
