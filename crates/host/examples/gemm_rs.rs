//! GEMM + ReduceScatter and GEMM + AllReduce in one persistent kernel each (one process per
//! GPU): every rank holds a slice of the model width (tensor parallel, `K / W` columns of `x`
//! and of `W`); the kernel multiplies and reduces the partial products over NVLink while it
//! computes. ReduceScatter leaves every rank its `M / W` rows of the sum, AllReduce all of it.
//! Planned once, launched every step on new activations, checked against the CPU.
//!
//! Run: `cargo xtask launch -n 2 -- target/release/examples/gemm_rs` (`--share-gpu` on one GPU).
mod common;

use common::{check, random_bf16, read_heap, Result, STEPS};
use half::bf16;
use mkernel::cudarc::driver::DevicePtr;
use mkernel::ops::gemm_rs::RsProblem;
use mkernel::ops::{GemmRsPlan, RsSplit};
use mkernel::{CommConfig, Communicator};

/// Rows (a multiple of W x 128), output features, this rank's slice of the model width.
const M: usize = 512;
const N: usize = 256;
const K_LOCAL: usize = 128;

fn main() -> std::process::ExitCode {
    common::run("gemm_rs", gemm_rs)
}

fn gemm_rs() -> Result {
    let (dev, boot) = common::rank()?;
    let info = boot.info().clone();
    let (world, nodes) = (info.local_world_size(), info.nnodes());
    let global = info.world_size();
    // Heap: what the two plans take (both alive at once).
    let problem = |all_reduce| RsProblem {
        m: M,
        n: N,
        k_local: K_LOCAL,
        world,
        nodes,
        sms: dev.sm_count(),
        all_reduce,
    };
    let heap_bytes = GemmRsPlan::heap_bytes(&problem(false), RsSplit::default())?
        + GemmRsPlan::heap_bytes(&problem(true), RsSplit::default())?;
    let comm = Communicator::new(
        &dev,
        boot,
        CommConfig {
            heap_bytes,
            ..Default::default()
        },
    )?;
    let rank = comm.global_rank() as usize;
    let stream = dev.default_stream();
    // This rank's slices: x is M x K_LOCAL, W is N x K_LOCAL.
    let w_of = |r: usize| random_bf16(N * K_LOCAL, 1 + r as u64, 1.0 / ((K_LOCAL * global) as f32).sqrt());
    let w = stream.clone_htod(&w_of(rank))?;
    let mut x = stream.alloc_zeros::<bf16>(M * K_LOCAL)?;
    let rows = M / global;
    let out = stream.alloc_zeros::<bf16>(rows * N)?;

    // Plan once, both ops (collective: same shapes and order on every rank). x changes every
    // step, so the plans take addresses (`GemmRsPlan::new` would borrow x).
    let (px, pw, po) = (
        x.device_ptr(&stream).0,
        w.device_ptr(&stream).0,
        out.device_ptr(&stream).0,
    );
    // SAFETY: x, w and out hold the shapes' elements and outlive the plans (declared before
    // them); every write of x and read of out below is on `stream`, ordered with the launches.
    let rs = unsafe { GemmRsPlan::new_raw(&comm, &stream, px, pw, Some(po), M, N, K_LOCAL, RsSplit::default())? };
    // SAFETY: as above; the AllReduce output is a heap buffer of the plan.
    let ar = unsafe { GemmRsPlan::new_raw(&comm, &stream, px, pw, None, M, N, K_LOCAL, RsSplit::default())? };
    let ar_out = ar.all_reduce_output().ok_or("an AllReduce plan has an output")?;

    for step in 0..STEPS {
        let x_of = |r: usize| random_bf16(M * K_LOCAL, 1000 * step + r as u64, 1.0);
        stream.memcpy_htod(&x_of(rank), &mut x)?;
        rs.launch(&stream)?;
        ar.launch(&stream)?;
        stream.synchronize()?;
        comm.check()?;
        // The sum over ranks of x_r W_r^T.
        let mut sum = vec![0.0; M * N];
        for r in 0..global {
            for (s, p) in sum.iter_mut().zip(common::matmul_nt(&x_of(r), &w_of(r), M, N, K_LOCAL)) {
                *s += p;
            }
        }
        let got = stream.clone_dtoh(&out)?;
        let mine = &sum[rank * rows * N..(rank + 1) * rows * N];
        check(
            &format!("gemm_rs step {step}"),
            got.iter().map(|v| v.to_f64()),
            mine,
            1.0 / 64.0,
        )?;
        let got: Vec<bf16> = read_heap(&comm, &stream, &ar_out, M * N)?;
        check(
            &format!("gemm_ar step {step}"),
            got.iter().map(|v| v.to_f64()),
            &sum,
            1.0 / 64.0,
        )?;
    }
    Ok(())
}
