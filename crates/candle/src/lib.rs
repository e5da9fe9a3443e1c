//! mkernel on candle tensors.
//!
//! A candle server already holds a CUDA context, a stream and its tensors' device buffers, all
//! cudarc 0.19 types, the ones mkernel's API takes. This crate hands them over with no copy:
//! - [`device`]: the [`mkernel::Device`] of candle's CUDA context (the PTX module is loaded once
//!   per context; later calls return the same module);
//! - [`linear`] and [`matmul`]: mkernel's bf16 GEMM on candle tensors, launched on candle's
//!   stream, reading candle's storage in place and returning a `Tensor` that wraps the output
//!   buffer the kernel wrote (no copy in or out).
//!
//! Inputs must be contiguous bf16 tensors on a CUDA device (what a server's weights and
//! activations are); a strided view is refused with [`Error::Layout`] rather than copied
//! silently (call `.contiguous()` first if a copy is what you want).
use candle_core::backend::BackendStorage;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Storage, Tensor};
use half::bf16;
use mkernel::gemm::{gemm_bf16, BLayout, GemmShape};
use std::ops::Deref;

/// What can go wrong handing candle tensors to mkernel.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Mkernel(#[from] mkernel::Error),
    /// The tensor is not on a CUDA device.
    #[error("{what}: the tensor is on {device:?}; mkernel needs a CUDA tensor")]
    NotCuda {
        what: &'static str,
        device: candle_core::DeviceLocation,
    },
    /// The tensor's dtype is not the one the operation takes.
    #[error("{what}: dtype {have:?}, expected {want:?}")]
    DType {
        what: &'static str,
        have: DType,
        want: DType,
    },
    /// The tensor is a strided view; mkernel reads contiguous rows.
    #[error("{what}: layout {layout:?} is not contiguous (call .contiguous() to copy it)")]
    Layout { what: &'static str, layout: String },
    /// The shapes do not compose.
    #[error("{0}")]
    Shape(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// The mkernel device of candle's CUDA device: its context, shared (no second context, no
/// second copy of the PTX per call).
pub fn device(dev: &CudaDevice) -> Result<mkernel::Device> {
    Ok(mkernel::Device::from_context(dev.cuda_stream().context().clone())?)
}

/// `x @ w^T` with `w` stored as `nn.Linear` stores it: `x` is `[.., k]`, `w` is `[n, k]`, the
/// result `[.., n]`. bf16 in and out, f32 accumulation, on candle's stream.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (rows, k) = rows_cols("x", x)?;
    let (n, wk) = matrix("w", w)?;
    if wk != k {
        return Err(Error::Shape(format!(
            "linear: x has k = {k} columns, w is [{n}, {wk}] (expected [n, {k}])"
        )));
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rows_cols checked rank >= 1") = n;
    gemm(
        x,
        w,
        GemmShape {
            m: rows,
            n,
            k,
            b_layout: BLayout::NxK,
        },
        dims,
    )
}

/// `a @ b` for `a` `[m, k]` and `b` `[k, n]` (both row-major): the result is `[m, n]`.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (m, k) = matrix("a", a)?;
    let (bk, n) = matrix("b", b)?;
    if bk != k {
        return Err(Error::Shape(format!("matmul: a is [{m}, {k}], b is [{bk}, {n}]")));
    }
    gemm(
        a,
        b,
        GemmShape {
            m,
            n,
            k,
            b_layout: BLayout::KxN,
        },
        vec![m, n],
    )
}

/// `(rows, last dim)` of a tensor of rank >= 1, rows being the product of the leading dims.
fn rows_cols(what: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    let dims = t.dims();
    let Some((&cols, lead)) = dims.split_last() else {
        return Err(Error::Shape(format!("{what} is a scalar; a matrix is needed")));
    };
    Ok((lead.iter().product(), cols))
}

fn matrix(what: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match *t.dims() {
        [r, c] => Ok((r, c)),
        ref d => Err(Error::Shape(format!(
            "{what} has shape {d:?}; a matrix [rows, cols] is needed"
        ))),
    }
}

/// The CUDA storage of `t`, after checking device, dtype and contiguity.
fn cuda_storage<'t>(what: &'static str, t: &'t Tensor) -> Result<(impl Deref<Target = Storage> + 't, &'t Layout)> {
    if t.dtype() != DType::BF16 {
        return Err(Error::DType {
            what,
            have: t.dtype(),
            want: DType::BF16,
        });
    }
    let (storage, layout) = t.storage_and_layout();
    if !matches!(&*storage, Storage::Cuda(_)) {
        return Err(Error::NotCuda {
            what,
            device: t.device().location(),
        });
    }
    if !layout.is_contiguous() {
        return Err(Error::Layout {
            what,
            layout: format!("{layout:?}"),
        });
    }
    Ok((storage, layout))
}

fn cuda(storage: &Storage) -> &CudaStorage {
    match storage {
        Storage::Cuda(s) => s,
        _ => unreachable!("cuda_storage checked the variant"),
    }
}

fn gemm(a: &Tensor, b: &Tensor, shape: GemmShape, out_dims: Vec<usize>) -> Result<Tensor> {
    let (a_storage, a_layout) = cuda_storage("a", a)?;
    let (b_storage, b_layout) = cuda_storage("b", b)?;
    let (a_cuda, b_cuda) = (cuda(&a_storage), cuda(&b_storage));
    // A `b` of another CUDA device is refused by mkernel's context check (ForeignContext).
    let dev = a_cuda.device().clone();
    let (a_len, b_len, c_len) = shape.lens();
    // Views at the tensors' offsets into candle's own allocations: no copy.
    let a_start = a_layout.start_offset();
    let b_start = b_layout.start_offset();
    let a_view = a_cuda.as_cuda_slice::<bf16>()?.slice(a_start..a_start + a_len);
    let b_view = b_cuda.as_cuda_slice::<bf16>()?.slice(b_start..b_start + b_len);
    let stream = dev.cuda_stream();
    let mk = device(&dev)?;
    // SAFETY: uninitialized bf16 storage for C; the GEMM writes every one of its M x N elements
    // before anything reads it (the tensor is returned only after the launch is enqueued on the
    // same stream that every later candle op on this device uses).
    let mut c = unsafe { dev.alloc::<bf16>(c_len) }?;
    gemm_bf16(&mk, &stream, &a_view, &b_view, &mut c, shape)?;
    drop((a_storage, b_storage));
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(c, dev));
    Ok(Tensor::from_storage(
        storage,
        out_dims,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}
