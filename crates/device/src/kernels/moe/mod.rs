//! Mixture-of-experts expert FFN on one GPU (`mkernel_config::ops::moe`, docs/moe.md):
//! [`route`] (counts, padded offsets, slots; bad ids to the error record), [`gather`] (token
//! rows to their slots), [`grouped_gemm`] (up with the activation fused, down; the plain
//! GEMM's mainloop, epilogue and scheduler over the grouped rows) and [`combine`] (top-k
//! weighted sum, f32); [`ep`]: the same layer with experts spread over the node's ranks.
pub mod combine;
pub mod consumer;
pub mod ep;
pub mod gather;
pub mod grouped_gemm;
pub mod producer;
pub mod route;
