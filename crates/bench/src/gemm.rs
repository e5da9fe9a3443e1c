//! GEMM: ours vs cuBLAS (cublasGemmEx, bf16 in/out, f32 compute) on the same buffers.
// A NaN must fail the tolerance checks, so they are written as negated `<=` comparisons.
#![allow(clippy::neg_cmp_op_on_partial_ord)]
use crate::timing::median_ms_interleaved;
use crate::Args;
use anyhow::{bail, Result};
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use half::bf16;
use mkernel::gemm::{BLayout, GemmKernel, GemmPlan, GemmShape, GemmTensors, OutDtype};
use mkernel::Device;
use mkernel_tests::data::random_bf16;
use serde_json::{json, Value};
use std::sync::Arc;

/// The shapes of the GEMM issue: 8192^3 and M x (K, N) over the tensor-parallel shapes.
fn shapes() -> Vec<(usize, usize, usize)> {
    let mut v = vec![(8192, 8192, 8192)];
    for m in [1024, 4096, 8192, 16384] {
        for (k, n) in [(8192, 8192), (8192, 28672), (28672, 8192)] {
            if !v.contains(&(m, n, k)) {
                v.push((m, n, k));
            }
        }
    }
    // The per-rank shapes of the fused GEMM+RS/AR benchmarks (K = 8192 split over 2 and 4 GPUs).
    for m in [4096, 8192, 16384] {
        for k in [4096, 2048] {
            v.push((m, 8192, k));
        }
    }
    v
}

/// cuBLAS computing the same row-major product (column-major C^T = op(B)^T A^T).
pub(crate) fn cublas_gemm(
    blas: &CudaBlas,
    s: GemmShape,
    a: &CudaSlice<bf16>,
    b: &CudaSlice<bf16>,
    c: &mut CudaSlice<bf16>,
) -> Result<()> {
    let (m, n, k) = (s.m as i32, s.n as i32, s.k as i32);
    let (transa, lda) = match s.b_layout {
        BLayout::KxN => (cublasOperation_t::CUBLAS_OP_N, n),
        BLayout::NxK => (cublasOperation_t::CUBLAS_OP_T, k),
    };
    let cfg = GemmConfig {
        transa,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n,
        n: m,
        k,
        alpha: bf16::ONE,
        lda,
        ldb: k,
        beta: bf16::ZERO,
        ldc: n,
    };
    // SAFETY: buffers hold the shape's elements.
    unsafe { blas.gemm(cfg, b, a, c) }?;
    Ok(())
}

/// Elements where ours and cuBLAS differ by more than two bf16 ulps plus accumulation slack.
pub(crate) fn count_mismatches(ours: &[bf16], theirs: &[bf16], k: usize) -> usize {
    let slack = (k as f32).sqrt() * 1e-3;
    ours.iter()
        .zip(theirs)
        .filter(|(x, y)| {
            let (x, y) = (x.to_f32(), y.to_f32());
            !((x - y).abs() <= x.abs().max(y.abs()) / 64.0 + slack)
        })
        .count()
}

/// Launches in the burst that [`host_us_per_launch`] times.
pub(crate) const LAUNCH_BURST: usize = 50;

/// Host microseconds of one call of `launch` (argument checks, tensor-map encoding, enqueue),
/// the mean over [`LAUNCH_BURST`] calls back to back; the stream is synchronized after the burst.
pub(crate) fn host_us_per_launch(stream: &Arc<CudaStream>, launch: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    stream.synchronize()?;
    let t0 = std::time::Instant::now();
    for _ in 0..LAUNCH_BURST {
        launch()?;
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / LAUNCH_BURST as f64;
    stream.synchronize()?;
    Ok(us)
}

pub fn run(dev: &Device, args: &Args) -> Result<Vec<Value>> {
    if args.decode {
        return crate::gemm_decode::run(dev, args);
    }
    let b_layout = match args.b_layout.as_str() {
        "nk" => BLayout::NxK,
        "kn" => BLayout::KxN,
        other => bail!("--b-layout must be nk or kn, not {other}"),
    };
    let stream: Arc<CudaStream> = dev.default_stream();
    let blas = CudaBlas::new(stream.clone())?;
    let t = mkernel_config::GemmTile::DEFAULT;
    println!("# ours: persistent TMA + wgmma GEMM, tile {}x{}x{}, {} stages, {} consumer warpgroups + 1 producer, {} threads, {} B smem, grid = {} SMs",
        t.block_m, t.block_n, t.block_k, t.stages, t.consumer_warpgroups, t.threads(), mkernel_config::ops::gemm::SMEM_BYTES, dev.sm_count());
    println!("# B layout {:?}; ours and cuBLAS interleaved run by run, median of {} after {} warm-up each; TFLOP/s = 2MNK / time", b_layout, args.iters, args.warmup);
    println!("# launch_us: host microseconds of one of our launches (checks, tensor-map encoding, enqueue), mean over a burst of {LAUNCH_BURST}");
    println!(
        "{:>6} {:>6} {:>6} {:>10} {:>9} {:>10} {:>9} {:>7} {:>7} {:>13} {:>9}",
        "M", "N", "K", "ours_us", "TFLOP/s", "cublas_us", "TFLOP/s", "ratio", "#wrong", "fused_ring_us", "launch_us"
    );
    let mut rows = vec![];
    let mut ratios = vec![];
    for (m, n, k) in shapes() {
        let label = format!("{m}x{n}x{k}");
        if args.filter.as_ref().is_some_and(|f| !label.contains(f.as_str())) {
            continue;
        }
        let shape = GemmShape { m, n, k, b_layout };
        let (la, lb, lc) = shape.lens();
        let a = stream.clone_htod(&random_bf16(la, 1))?;
        let b = stream.clone_htod(&random_bf16(lb, 2))?;
        let mut c_ours = stream.alloc_zeros::<bf16>(lc)?;
        let mut c_blas = stream.alloc_zeros::<bf16>(lc)?;
        let (ours_ms, blas_ms, fused_ring_ms, launch_us) = {
            let config = mkernel::gemm::GemmConfig {
                kernel: GemmKernel::Tiled,
                ..mkernel::gemm::GemmConfig::for_shape(shape, OutDtype::Bf16)
            };
            // Diagnostic competitor (N x K only): our GEMM on GEMM+ReduceScatter's ring.
            let mut c_ring = stream.alloc_zeros::<bf16>(lc)?;
            let mut ring_plan = match b_layout {
                BLayout::NxK => Some(GemmPlan::new(dev, config)?.on_fused_ring()?),
                BLayout::KxN => None,
            };
            let mut plan = GemmPlan::new(dev, config)?;
            let mut ours = || {
                plan.launch(
                    &stream,
                    GemmTensors {
                        a: &a,
                        b: &b,
                        c: &mut c_ours,
                    },
                    m,
                )?;
                Ok(())
            };
            let mut theirs = || cublas_gemm(&blas, shape, &a, &b, &mut c_blas);
            let mut on_ring = || match ring_plan.as_mut() {
                Some(p) => {
                    p.launch(
                        &stream,
                        GemmTensors {
                            a: &a,
                            b: &b,
                            c: &mut c_ring,
                        },
                        m,
                    )?;
                    Ok(())
                }
                None => Ok(()),
            };
            let t = median_ms_interleaved(
                &stream,
                args.warmup,
                args.iters,
                &mut [&mut ours, &mut theirs, &mut on_ring],
            )?;
            let launch_us = host_us_per_launch(&stream, &mut ours)?;
            // `--trace`: the fused-ring launch's per-tile timeline, summarized as the fused
            // kernels' is (their mainloops and epilogues beside a plain GEMM's on the same ring).
            let ring_ms = ring_plan.is_some().then_some(t[2]);
            if let (true, Some(p)) = (args.trace, ring_plan.as_mut()) {
                let grid = p.launch_info(m)?.grid;
                let mut buf = stream.alloc_zeros::<u64>(mkernel_config::trace::words(grid))?;
                // SAFETY: `buf` holds words(grid) words for the launches of M = m and outlives
                // them (synchronized below).
                unsafe { p.set_trace(Some(buf.device_ptr_mut(&stream).0))? };
                for _ in 0..3 {
                    p.launch(
                        &stream,
                        GemmTensors {
                            a: &a,
                            b: &b,
                            c: &mut c_ring,
                        },
                        m,
                    )?;
                }
                stream.synchronize()?;
                // SAFETY: stops the recording before `buf` is dropped.
                unsafe { p.set_trace(None)? };
                let words = stream.clone_dtoh(&buf)?;
                crate::trace::summarize(
                    &format!("plain GEMM on the fused ring {m}x{n}x{k}"),
                    &words,
                    grid as usize,
                );
            }
            (t[0], t[1], ring_ms, launch_us)
        };
        let wrong = count_mismatches(&stream.clone_dtoh(&c_ours)?, &stream.clone_dtoh(&c_blas)?, k);
        let tf = |ms: f64| shape.flops() / (ms * 1e-3) / 1e12;
        let ratio = blas_ms / ours_ms;
        ratios.push(ratio);
        println!(
            "{m:>6} {n:>6} {k:>6} {:>10.1} {:>9.1} {:>10.1} {:>9.1} {:>7.3} {:>7} {:>13} {:>9.2}",
            ours_ms * 1e3,
            tf(ours_ms),
            blas_ms * 1e3,
            tf(blas_ms),
            ratio,
            wrong,
            fused_ring_ms.map_or("-".into(), |t| format!("{:.1}", t * 1e3)),
            launch_us
        );
        rows.push(json!({ "m": m, "n": n, "k": k, "b_layout": format!("{b_layout:?}"), "ours_ms": ours_ms, "ours_tflops": tf(ours_ms),
            "cublas_ms": blas_ms, "cublas_tflops": tf(blas_ms), "ours_over_cublas": ratio, "wrong": wrong, "ours_on_fused_ring_ms": fused_ring_ms,
            "ours_host_us_per_launch": launch_us }));
    }
    if !ratios.is_empty() {
        let geo = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
        let min = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
        println!("# geometric mean ours/cuBLAS (throughput) = {geo:.3}, worst = {min:.3}");
    }
    Ok(rows)
}
