//! Mixture-of-experts expert FFN on one GPU (`mkernel_config::ops::moe`, docs/moe.md):
//! [`route`] (counts, padded offsets, slots; bad ids to the error record), [`gather`] (token
//! rows to their slots), [`grouped_gemm`] (up with the activation fused, down; the plain
//! GEMM's mainloop, epilogue and scheduler over the grouped rows) and [`combine`] (top-k
//! weighted sum, f32); [`ep`]: the same layer with experts spread over the node's ranks.
//!
//! # Safety
//!
//! On top of the launch contract ([`crate::kernels`]), the entry points here share "the
//! argument-block contract": `args` is the device address of the kernel's argument block
//! (`mkernel_config::ops::moe`), written by the host before the launch and not changed while it
//! runs, and every buffer address in it is a device allocation (or, for `MoeEpArgs`' `heap_*`,
//! an offset into every rank's heap) of the length and element type its field's doc gives for
//! the block's sizes (`tokens`, `top_k`, `experts`, `hidden`, capacity), suitably aligned
//! (16 bytes for bf16 rows). `ids` is the device address of `tokens * top_k` `i32` expert ids.
pub mod combine;
pub mod consumer;
pub mod ep;
pub mod ep_up;
pub mod gather;
pub mod grouped_gemm;
pub mod producer;
pub mod route;
