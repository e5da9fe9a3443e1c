//! mkernel's GEMM on candle tensors against candle's own matmul (cuBLAS), on candle's device,
//! context and stream. Exits non-zero on a mismatch or without a GPU.
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

/// Largest |ours - theirs| / max(1, |theirs|): both are bf16 roundings of f32 sums, so they
/// differ by about two bf16 ulps of the result (2^-7 relative) plus summation order.
const TOL: f32 = 2.0 * 0.0078125;

fn max_rel_err(ours: &Tensor, theirs: &Tensor) -> Result<f32> {
    let a = ours.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = theirs.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if a.len() != b.len() {
        bail!("lengths differ: {} vs {}", a.len(), b.len());
    }
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| {
            if x.is_finite() {
                (x - y).abs() / y.abs().max(1.0)
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0, f32::max))
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)
        .map_err(anyhow::Error::from)
        .context("candle could not open CUDA device 0")?;
    let cuda = dev.as_cuda_device()?;
    let mk = mkernel_candle::device(cuda)?;
    let again = mkernel_candle::device(cuda)?;
    println!(
        "mkernel device from candle's context: GPU {} with {} SMs; module shared by a second call: {}",
        mk.ordinal(),
        mk.sm_count(),
        mk.shares_module_with(&again)
    );
    if !mk.shares_module_with(&again) {
        bail!("a second Device of candle's context loaded the module again");
    }
    let mut worst = 0.0f32;
    for &(m, n, k) in &[
        (1, 4096, 4096),
        (7, 1024, 512),
        (128, 256, 64),
        (1000, 1536, 1024),
        (4096, 4096, 4096),
    ] {
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(0f32, 1.0 / (k as f32).sqrt(), (n, k), &dev)?.to_dtype(DType::BF16)?;
        // nn.Linear: x @ w^T, w as [n, k].
        let ours = mkernel_candle::linear(&x, &w)?;
        let theirs = x.matmul(&w.t()?)?;
        let e_lin = max_rel_err(&ours, &theirs)?;
        // Plain matmul: a [m, k] @ b [k, n].
        let b = w.t()?.contiguous()?;
        let ours_mm = mkernel_candle::matmul(&x, &b)?;
        let theirs_mm = x.matmul(&b)?;
        let e_mm = max_rel_err(&ours_mm, &theirs_mm)?;
        // A batched activation [2, m, k] through linear keeps its leading dims.
        let xb = Tensor::cat(&[&x, &x], 0)?.reshape((2, m, k))?;
        let ours_b = mkernel_candle::linear(&xb, &w)?;
        if ours_b.dims() != [2, m, n] {
            bail!("batched linear gave shape {:?}", ours_b.dims());
        }
        let e_b = max_rel_err(&ours_b.get(1)?, &theirs)?;
        println!(
            "m={m:5} n={n:5} k={k:5}: linear {e_lin:.2e}, matmul {e_mm:.2e}, batched linear {e_b:.2e} (max |ours - candle| / max(1, |candle|))"
        );
        worst = worst.max(e_lin).max(e_mm).max(e_b);
    }
    // A strided view is refused, not copied silently.
    let x = Tensor::randn(0f32, 1.0, (64, 128), &dev)?.to_dtype(DType::BF16)?;
    let err = mkernel_candle::matmul(&x.t()?, &x).unwrap_err();
    println!("strided input refused: {err}");
    if !matches!(err, mkernel_candle::Error::Layout { .. }) {
        bail!("expected a layout error, got {err}");
    }
    if worst > TOL {
        bail!("max relative error {worst:.3e} above the tolerance {TOL:.3e}");
    }
    println!("mkernel-candle: all shapes within {TOL:.3e} of candle's matmul: ok");
    Ok(())
}
