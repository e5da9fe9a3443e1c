//! Operations, one module per operation: its plan (buffers borrowed for its lifetime,
//! descriptors encoded once) and a pure policy function. Their config lives in
//! `mkernel_config::ops` and their kernels in `crates/device/src/kernels/`.
//!
//! - [`attention`]: FlashAttention forward on one GPU ([`attention::FlashAttentionPlan`]).
//! - [`moe`]: mixture-of-experts expert FFN on one GPU ([`moe::MoePlan`]).
//! - [`moe_ep`]: the same layer with expert parallelism over the node's ranks ([`moe_ep::MoeEpPlan`]).

pub mod attention;
pub mod moe;
pub mod moe_ep;
