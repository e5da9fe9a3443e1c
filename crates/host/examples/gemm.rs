//! GEMM on one GPU: `y = x W^T` (bf16 in, f32 accumulate, bf16 out), planned once and launched
//! every step on new `x`, checked against an f64 CPU product.
//!
//! Run: `cargo run --release -p mkernel --example gemm` (or `target/release/examples/gemm`).
mod common;

use common::{check, random_bf16, Result, STEPS};
use half::bf16;
use mkernel::cudarc::driver::DevicePtr;
use mkernel::{BLayout, Device, GemmPlan, GemmShape, OutDtype};

/// Tokens x model width -> tokens x output features (`W` is `N x K`, as `nn.Linear` stores it).
const M: usize = 512;
const N: usize = 384;
const K: usize = 256;

fn main() -> std::process::ExitCode {
    common::run("gemm", gemm)
}

fn gemm() -> Result {
    let dev = Device::new(0)?; // a clear error without a driver or a Hopper GPU
    let stream = dev.default_stream(); // or any stream of dev.context()
    let w_host = random_bf16(N * K, 1, 1.0 / (K as f32).sqrt());
    let w = stream.clone_htod(&w_host)?;
    let mut x = stream.alloc_zeros::<bf16>(M * K)?;
    let y = stream.alloc_zeros::<bf16>(M * N)?;
    let shape = GemmShape {
        m: M,
        n: N,
        k: K,
        b_layout: BLayout::NxK,
    };

    // Plan once: TMA descriptors encoded and uploaded. `GemmPlan::new` would borrow x for the
    // plan's life (no new data could be written into it), so a server whose inputs change every
    // step plans on the buffers' addresses.
    let (px, py, pw) = (
        x.device_ptr(&stream).0,
        y.device_ptr(&stream).0,
        w.device_ptr(&stream).0,
    );
    // SAFETY: x, w and y hold the shape's elements and outlive the plan (declared before it);
    // every write of x and read of y below is on `stream`, ordered with the plan's launches.
    let plan = unsafe { GemmPlan::new_raw(&dev, &stream, px, pw, py, shape, OutDtype::Bf16, None)? };
    println!("gemm: {M} x {N} x {K} on GPU {} ({} CTAs)", dev.ordinal(), plan.grid());

    for step in 0..STEPS {
        let x_host = random_bf16(M * K, 100 + step, 1.0);
        stream.memcpy_htod(&x_host, &mut x)?;
        plan.launch(&stream)?; // one kernel launch; capturable in a CUDA graph
        let got = stream.clone_dtoh(&y)?;
        let want = common::matmul_nt(&x_host, &w_host, M, N, K);
        check(
            &format!("gemm step {step}"),
            got.iter().map(|v| v.to_f64()),
            &want,
            1.0 / 128.0,
        )?;
    }
    Ok(())
}
