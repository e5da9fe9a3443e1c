//! Operations, one module per operation: its plan (buffers borrowed for its lifetime,
//! descriptors encoded once) and a pure policy function. Their config lives in
//! `mkernel_config::ops` and their kernels in `crates/device/src/kernels/`.
//!
//! - [`attention`]: FlashAttention forward on one GPU ([`attention::FlashAttentionPlan`]).
//! - [`moe`]: mixture-of-experts expert FFN on one GPU ([`moe::MoePlan`]).
//! - [`ring_attention`]: ring attention forward across a communicator's local ranks
//!   ([`ring_attention::RingAttentionPlan`]).

pub mod attention;
pub mod moe;
pub mod ring_attention;
