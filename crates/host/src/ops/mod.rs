//! Operations, one module per operation: its plan (buffers borrowed for its lifetime,
//! descriptors encoded once) and a pure policy function (which splits and paths a shape gets,
//! from the shape, the world size, the SM count and the tune cache; unit-tested on the CPU).
//! Their config lives in `mkernel_config` (`mkernel_config::ops`) and their kernels in
//! `crates/device/src/kernels/`.
//!
//! - [`ag_gemm`]: AllGather + GEMM ([`AgGemmPlan`]).
//! - [`gemm_rs`]: GEMM + ReduceScatter and GEMM + AllReduce ([`GemmRsPlan`]).
//! - [`attention`]: FlashAttention forward on one GPU ([`attention::FlashAttentionPlan`]).
//! - [`attention_bwd`]: its backward ([`attention_bwd::FlashAttentionBackwardPlan`]).
//! - [`moe`]: mixture-of-experts expert FFN on one GPU ([`moe::MoePlan`]).
//! - [`moe_ep`]: the same layer with expert parallelism over the node's ranks ([`moe_ep::MoeEpPlan`]).
//! - [`ring_attention`]: ring attention forward across a communicator's local ranks
//!   ([`ring_attention::RingAttentionPlan`]).
//!
//! # Soundness of the communicating plans
//! A plan borrows its communicator and the buffers it was made from for its lifetime `'a`: the
//! buffers cannot be dropped, written or read elsewhere, and the communicator (whose drop unmaps
//! the heap the plan's kernels use) cannot be dropped while the plan exists. The constructors over raw device addresses (`new_raw`) are
//! `unsafe`, for servers that manage their own memory, as is `launch_raw`, which launches on a
//! raw `CUstream`. Launches go through the communicator's launch lock (see
//! [`crate::Communicator`]).
//!
//! Borrowing fixes the buffers for the plan's lifetime: a plan made by `new` is launched on
//! the data its inputs held when it was planned (or that its own launches left there), and its
//! output is read after the plan is dropped. Rewriting the inputs between launches of one plan
//! (a server's decode loop, a CUDA graph replayed on new data) takes `new_raw`, whose contract
//! then covers those writes. A plan's heap buffers stay reserved after it is dropped (the heap
//! is a bump allocator), so plan once per shape, not per launch.
//!
//! A plan cannot outlive a buffer it reads:
//! ```compile_fail,E0505
//! # use mkernel::ops::AgGemmPlan;
//! # fn f(comm: &mkernel::Communicator, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
//! let a = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let b = s.alloc_zeros::<half::bf16>(64 * 64)?;
//! let mut c = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let plan = AgGemmPlan::new(comm, s, &a, &b, &mut c, 256, 64, 64, 0)?;
//! drop(a);
//! plan.launch(s)?;
//! # Ok(()) }
//! ```
//! nor the buffer it writes, which it holds mutably (it cannot be read meanwhile either):
//! ```compile_fail,E0502
//! # use mkernel::ops::AgGemmPlan;
//! # fn f(comm: &mkernel::Communicator, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
//! let a = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let b = s.alloc_zeros::<half::bf16>(64 * 64)?;
//! let mut c = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let plan = AgGemmPlan::new(comm, s, &a, &b, &mut c, 256, 64, 64, 0)?;
//! let _ = s.clone_dtoh(&c)?;
//! plan.launch(s)?;
//! # Ok(()) }
//! ```
//! nor its communicator:
//! ```compile_fail,E0505
//! # use mkernel::ops::AgGemmPlan;
//! # fn f(comm: mkernel::Communicator, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
//! let a = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let b = s.alloc_zeros::<half::bf16>(64 * 64)?;
//! let mut c = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let plan = AgGemmPlan::new(&comm, s, &a, &b, &mut c, 256, 64, 64, 0)?;
//! drop(comm);
//! plan.launch(s)?;
//! # Ok(()) }
//! ```
//! The same holds for GEMM + ReduceScatter (buffer, then communicator):
//! ```compile_fail,E0505
//! # use mkernel::ops::{GemmRsPlan, RsSplit};
//! # fn f(comm: &mkernel::Communicator, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
//! let a = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let b = s.alloc_zeros::<half::bf16>(64 * 64)?;
//! let mut out = s.alloc_zeros::<half::bf16>(128 * 64)?;
//! let plan = GemmRsPlan::new(comm, s, &a, &b, &mut out, 256, 64, 64, RsSplit::default())?;
//! drop(b);
//! plan.launch(s)?;
//! # Ok(()) }
//! ```
//! ```compile_fail,E0505
//! # use mkernel::ops::{GemmRsPlan, RsSplit};
//! # fn f(comm: mkernel::Communicator, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
//! let a = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let b = s.alloc_zeros::<half::bf16>(64 * 64)?;
//! let mut out = s.alloc_zeros::<half::bf16>(128 * 64)?;
//! let plan = GemmRsPlan::new(&comm, s, &a, &b, &mut out, 256, 64, 64, RsSplit::default())?;
//! drop(comm);
//! plan.launch(s)?;
//! # Ok(()) }
//! ```
//! and for GEMM + AllReduce, whose output lives in the communicator's heap:
//! ```compile_fail,E0505
//! # use mkernel::ops::{GemmRsPlan, RsSplit};
//! # fn f(comm: mkernel::Communicator, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
//! let a = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let b = s.alloc_zeros::<half::bf16>(64 * 64)?;
//! let plan = GemmRsPlan::new_all_reduce(&comm, s, &a, &b, 256, 64, 64, RsSplit::default())?;
//! drop(comm);
//! plan.launch(s)?;
//! # Ok(()) }
//! ```
//! ```compile_fail,E0505
//! # use mkernel::ops::{GemmRsPlan, RsSplit};
//! # fn f(comm: &mkernel::Communicator, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
//! let a = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let b = s.alloc_zeros::<half::bf16>(64 * 64)?;
//! let plan = GemmRsPlan::new_all_reduce(comm, s, &a, &b, 256, 64, 64, RsSplit::default())?;
//! drop(a);
//! plan.launch(s)?;
//! # Ok(()) }
//! ```
//! (Each fails with the error code it names: a move or a shared borrow of what the plan
//! borrows.) Without the drop, each of these compiles:
//! ```no_run
//! # use mkernel::ops::{AgGemmPlan, GemmRsPlan, RsSplit};
//! # fn f(comm: &mkernel::Communicator, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
//! let a = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let b = s.alloc_zeros::<half::bf16>(64 * 64)?;
//! let mut c = s.alloc_zeros::<half::bf16>(256 * 64)?;
//! let mut out = s.alloc_zeros::<half::bf16>(128 * 64)?;
//! let ag = AgGemmPlan::new(comm, s, &a, &b, &mut c, 256, 64, 64, 0)?;
//! let rs = GemmRsPlan::new(comm, s, &a, &b, &mut out, 256, 64, 64, RsSplit::default())?;
//! let a_view = a.slice(..);
//! let ar = GemmRsPlan::new_all_reduce(comm, s, &a_view, &b, 256, 64, 64, RsSplit::default())?;
//! ag.launch(s)?;
//! rs.launch(s)?;
//! ar.launch(s)?;
//! drop((ag, rs, ar));
//! let _ = s.clone_dtoh(&c)?;
//! # Ok(()) }
//! ```
pub mod ag_gemm;
pub mod attention;
pub mod attention_bwd;
pub mod gemm_rs;
pub mod moe;
pub mod moe_ep;
pub mod ring_attention;

pub use ag_gemm::AgGemmPlan;
pub use gemm_rs::{GemmRsPlan, RsSplit};

use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Uploads a `#[repr(C)]` argument block (plain data: `Pod`); returns it with its device address.
pub(crate) fn upload_args<T: bytemuck::Pod>(stream: &Arc<CudaStream>, args: &T) -> Result<(CudaSlice<u8>, u64)> {
    let bytes = bytemuck::bytes_of(args);
    let dev = stream.clone_htod(bytes)?;
    let addr = dev.device_ptr(stream).0;
    Ok((dev, addr))
}
