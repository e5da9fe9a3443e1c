//! GEMM on one GPU: `y = x W^T` (bf16 in, f32 accumulate, bf16 out), planned once for the
//! weights' shape and launched every step on new `x` with a different number of tokens (M),
//! checked against an f64 CPU product.
//!
//! Run: `cargo run --release -p mkernel --example gemm` (or `target/release/examples/gemm`).
mod common;

use common::{check, random_bf16, Result};
use half::bf16;
use mkernel::{BLayout, Device, GemmConfig, GemmPlan, GemmTensors};

/// Model width -> output features (`W` is `N x K`, as `nn.Linear` stores it).
const N: usize = 384;
const K: usize = 256;
/// Most tokens a step holds; the buffers are sized for it.
const MAX_M: usize = 512;
/// Tokens of each step: a prefill (tiled kernel), then decode-sized steps (M <= 256: the
/// bandwidth-bound decode kernels), all launches of one plan.
const STEP_M: [usize; 4] = [512, 1, 7, 300];

fn main() -> std::process::ExitCode {
    common::run("gemm", gemm)
}

fn gemm() -> Result {
    let dev = Device::new(0)?; // a clear error without a driver or a Hopper GPU
    let stream = dev.default_stream(); // or any stream of dev.context()
    let w_host = random_bf16(N * K, 1, 1.0 / (K as f32).sqrt());
    let w = stream.clone_htod(&w_host)?;
    let mut x = stream.alloc_zeros::<bf16>(MAX_M * K)?;
    let mut y = stream.alloc_zeros::<bf16>(MAX_M * N)?;

    // Plan once from the shapes (no buffers); each step launches on its buffers and its M.
    let config = GemmConfig {
        max_m: MAX_M,
        n: N,
        k: K,
        b_layout: BLayout::NxK,
        ..GemmConfig::default() // bf16 C, every SM, kernel chosen per launch from M
    };
    let mut plan = GemmPlan::new(&dev, config)?;
    println!(
        "gemm: up to {MAX_M} x {N} x {K} on GPU {} (plan workspace {} bytes)",
        dev.ordinal(),
        plan.workspace_bytes()
    );

    for (step, m) in STEP_M.into_iter().enumerate() {
        let x_host = random_bf16(m * K, 100 + step as u64, 1.0);
        stream.memcpy_htod(&x_host, &mut x.slice_mut(..m * K))?;
        let t = GemmTensors {
            a: &x,
            b: &w,
            c: &mut y,
        };
        let ran = plan.launch(&stream, t, m)?; // one kernel launch; reads x[..m K], writes y[..m N]
        let got = stream.clone_dtoh(&y.slice(..m * N))?;
        let want = common::matmul_nt(&x_host, &w_host, m, N, K);
        check(
            &format!("gemm step {step} (M = {m}, {:?} kernel, {} CTAs)", ran.kernel, ran.grid),
            got.iter().map(|v| v.to_f64()),
            &want,
            1.0 / 128.0,
        )?;
    }
    Ok(())
}
