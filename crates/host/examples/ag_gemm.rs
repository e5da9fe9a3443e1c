//! AllGather + GEMM in one persistent kernel (one process per GPU): every rank holds `M / W`
//! rows of `x` (sequence parallel) and the whole weight; the kernel gathers the rows over
//! NVLink while it multiplies, giving every rank `y = gather(x) W^T`. Planned once, launched
//! every step on new rows, checked against the CPU.
//!
//! Run: `cargo xtask launch -n 2 -- target/release/examples/ag_gemm` (`--share-gpu` on one GPU).
mod common;

use common::{check, random_bf16, Result, STEPS};
use half::bf16;
use mkernel::cudarc::driver::DevicePtr;
use mkernel::ops::AgGemmPlan;
use mkernel::{CommConfig, Communicator};

/// Rows per rank (a multiple of 128), output features, model width.
const ROWS: usize = 256;
const N: usize = 256;
const K: usize = 256;

fn main() -> std::process::ExitCode {
    common::run("ag_gemm", ag_gemm)
}

fn ag_gemm() -> Result {
    let (dev, boot) = common::rank()?;
    let world = boot.info().world_size();
    let m = ROWS * world;
    // Heap: what the plan takes, the gathered rows (`m x k` bf16).
    let cfg = CommConfig {
        heap_bytes: AgGemmPlan::heap_bytes(m, N, K, world)?,
        ..Default::default()
    };
    let comm = Communicator::new(&dev, boot, cfg)?;
    let rank = comm.global_rank() as u64;
    let stream = dev.default_stream();
    let w_host = random_bf16(N * K, 1, 1.0 / (K as f32).sqrt());
    let w = stream.clone_htod(&w_host)?;
    let mut x = stream.alloc_zeros::<bf16>(ROWS * K)?;
    let y = stream.alloc_zeros::<bf16>(m * N)?;

    // Plan once (collective: every rank, same shape, same order of heap allocations). Its
    // input changes every step, so the plan takes addresses (`AgGemmPlan::new` would borrow x).
    let (px, pw, py) = (
        x.device_ptr(&stream).0,
        w.device_ptr(&stream).0,
        y.device_ptr(&stream).0,
    );
    // SAFETY: x, w and y hold the shape's elements and outlive the plan (declared before it);
    // every write of x and read of y below is on `stream`, ordered with the plan's launches.
    let plan = unsafe { AgGemmPlan::new_raw(&comm, &stream, px, pw, py, m, N, K, 0)? };
    let (n_comm, grid) = plan.split();
    println!("ag_gemm: rank {rank}: {m} x {N} x {K}, {n_comm} of {grid} CTAs move rows");

    for step in 0..STEPS {
        let rows = |r: u64| random_bf16(ROWS * K, 1000 * step + r, 1.0);
        stream.memcpy_htod(&rows(rank), &mut x)?;
        plan.launch(&stream)?;
        stream.synchronize()?;
        comm.check()?;
        let gathered: Vec<bf16> = (0..world as u64).flat_map(rows).collect();
        let want = common::matmul_nt(&gathered, &w_host, m, N, K);
        let got = stream.clone_dtoh(&y)?;
        check(
            &format!("ag_gemm step {step}"),
            got.iter().map(|v| v.to_f64()),
            &want,
            1.0 / 128.0,
        )?;
    }
    Ok(())
}
