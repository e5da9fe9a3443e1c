//! `--op gemm -- --decode`: decode-size GEMM (M = 1..256), ours beside cuBLAS, with the weights
//! coming from HBM as in a server that runs many layers: each competitor rotates through copies of
//! B whose total is at least [`ROTATION_BYTES`] (several times the L2), so a run never finds its
//! weights in L2. A stays the same (the activations a layer just produced).
#![allow(clippy::neg_cmp_op_on_partial_ord)]
use crate::gemm::{count_mismatches, cublas_gemm, host_us_per_launch, LAUNCH_BURST};
use crate::timing::median_ms_interleaved;
use crate::Args;
use anyhow::{bail, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use mkernel::gemm::{BLayout, GemmConfig, GemmPlan, GemmShape, GemmTensors};
use mkernel::Device;
use mkernel_tests::data::random_bf16;
use serde_json::{json, Value};
use std::cell::Cell;
use std::sync::Arc;

/// The M of the decode issue.
const MS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];
/// (N, K) of the decode issue: Llama-class projections (QKV, O, up/gate, down).
const NKS: [(usize, usize); 7] = [
    (4096, 4096),
    (6144, 4096),
    (4096, 14336),
    (14336, 4096),
    (8192, 8192),
    (28672, 8192),
    (8192, 28672),
];
/// Least bytes of weight copies each competitor rotates through (H100 and H200 have 50 MB of L2).
const ROTATION_BYTES: usize = 256 << 20;

/// HBM bandwidth of the GPU (bytes/s) by its name: H200 4.8 TB/s, H100 SXM 3.35 TB/s, H100 NVL
/// 3.9 TB/s, H100 PCIe 2.0 TB/s.
fn hbm_peak(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    if n.contains("H200") {
        Some(4.8e12)
    } else if n.contains("H100") && n.contains("NVL") {
        Some(3.9e12)
    } else if n.contains("H100") && n.contains("PCIE") {
        Some(2.0e12)
    } else if n.contains("H100") {
        Some(3.35e12)
    } else {
        None
    }
}

fn layouts(arg: &str) -> Result<Vec<BLayout>> {
    Ok(match arg {
        "nk" => vec![BLayout::NxK],
        "kn" => vec![BLayout::KxN],
        "both" => vec![BLayout::NxK, BLayout::KxN],
        other => bail!("--b-layout must be nk, kn or both, not {other}"),
    })
}

pub fn run(dev: &Device, args: &Args) -> Result<Vec<Value>> {
    let stream: Arc<CudaStream> = dev.default_stream();
    let blas = CudaBlas::new(stream.clone())?;
    let name = dev.context().name()?;
    let Some(peak) = hbm_peak(&name) else {
        bail!("no HBM bandwidth known for `{name}` (H100 or H200 expected)");
    };
    println!("# decode GEMM on {name} ({} SMs), HBM peak {:.2} TB/s; weights rotated through >= {} MiB of copies (from HBM); ours and cuBLAS interleaved, median of {} after {} warm-up each",
        dev.sm_count(), peak / 1e12, ROTATION_BYTES >> 20, args.iters, args.warmup);
    println!("# HBM fraction = (weights + A + C bytes) / time / peak; ratio = cuBLAS time / ours");
    println!("# one plan per (N, K) for every M (M and the weight copy are launch arguments); launch_us: host microseconds of one launch, mean over a burst of {LAUNCH_BURST}");
    println!(
        "{:>3} {:>4} {:>6} {:>6} {:>8} {:>9} {:>9} {:>7} {:>7} {:>8} {:>6} {:>7} {:>9}",
        "B",
        "M",
        "N",
        "K",
        "W_MB",
        "ours_us",
        "cublas_us",
        "ratio",
        "ours_bw",
        "cublas_bw",
        "tok",
        "#wrong",
        "launch_us"
    );
    let mut rows = vec![];
    for b_layout in layouts(&args.b_layout)? {
        let mut per_m: Vec<Vec<f64>> = vec![vec![]; MS.len()];
        for (n, k) in NKS {
            if args
                .filter
                .as_ref()
                .is_some_and(|f| !format!("{n}x{k}").contains(f.as_str()))
            {
                continue;
            }
            let w_len = n * k;
            let w_bytes = w_len * 2;
            let copies = ROTATION_BYTES.div_ceil(w_bytes).max(2);
            let first = stream.clone_htod(&random_bf16(w_len, 2))?;
            let mut weights: Vec<CudaSlice<bf16>> = vec![];
            for _ in 1..copies {
                weights.push(stream.clone_dtod(&first)?);
            }
            weights.push(first);
            // One plan for every M and every weight copy (buffers and M are launch arguments).
            let config = GemmConfig {
                max_m: MS[MS.len() - 1],
                n,
                k,
                b_layout,
                ..GemmConfig::default()
            };
            let mut plan = GemmPlan::new(dev, config)?;
            for (mi, &m) in MS.iter().enumerate() {
                if !args.ms.is_empty() && !args.ms.contains(&m) {
                    continue;
                }
                let shape = GemmShape { m, n, k, b_layout };
                let a = stream.clone_htod(&random_bf16(m * k, 1))?;
                let mut c_ours = stream.alloc_zeros::<bf16>(m * n)?;
                let mut c_blas = stream.alloc_zeros::<bf16>(m * n)?;
                let (ours_ms, blas_ms, tok, launch_us) = {
                    let tok = plan.launch_info(m)?.tok.unwrap_or(0);
                    let (i, j) = (Cell::new(0usize), Cell::new(0usize));
                    let mut ours = || {
                        i.set(i.get() + 1);
                        let b = &weights[i.get() % weights.len()];
                        plan.launch(
                            &stream,
                            GemmTensors {
                                a: &a,
                                b,
                                c: &mut c_ours,
                            },
                            m,
                        )?;
                        Ok(())
                    };
                    let mut theirs = || {
                        j.set(j.get() + 1);
                        cublas_gemm(&blas, shape, &a, &weights[j.get() % weights.len()], &mut c_blas)
                    };
                    let t = median_ms_interleaved(&stream, args.warmup, args.iters, &mut [&mut ours, &mut theirs])?;
                    let launch_us = host_us_per_launch(&stream, &mut ours)?;
                    (t[0], t[1], tok, launch_us)
                };
                let wrong = count_mismatches(&stream.clone_dtoh(&c_ours)?, &stream.clone_dtoh(&c_blas)?, k);
                let bytes = (w_len + m * k + m * n) as f64 * 2.0;
                let bw = |ms: f64| bytes / (ms * 1e-3) / peak;
                let ratio = blas_ms / ours_ms;
                per_m[mi].push(ratio);
                let lay = match b_layout {
                    BLayout::NxK => "nk",
                    BLayout::KxN => "kn",
                };
                println!(
                    "{lay:>3} {m:>4} {n:>6} {k:>6} {:>8.1} {:>9.1} {:>9.1} {:>7.3} {:>7.3} {:>8.3} {tok:>6} {wrong:>7} {launch_us:>9.2}",
                    w_bytes as f64 / 1e6,
                    ours_ms * 1e3,
                    blas_ms * 1e3,
                    ratio,
                    bw(ours_ms),
                    bw(blas_ms)
                );
                rows.push(json!({ "gpu": name, "b_layout": lay, "m": m, "n": n, "k": k, "weight_bytes": w_bytes,
                    "ours_ms": ours_ms, "cublas_ms": blas_ms, "ours_over_cublas": ratio, "ours_hbm_fraction": bw(ours_ms),
                    "cublas_hbm_fraction": bw(blas_ms), "hbm_peak_bytes_per_s": peak, "tok_bucket": tok, "wrong": wrong,
                    "weight_copies": copies, "ours_host_us_per_launch": launch_us }));
            }
        }
        for (mi, r) in per_m.iter().enumerate() {
            if r.is_empty() {
                continue;
            }
            let geo = (r.iter().map(|x| x.ln()).sum::<f64>() / r.len() as f64).exp();
            let min = r.iter().cloned().fold(f64::INFINITY, f64::min);
            println!(
                "# B {b_layout:?} M = {:>3}: geometric mean ours/cuBLAS = {geo:.3}, worst = {min:.3}",
                MS[mi]
            );
            rows.push(json!({ "summary": true, "b_layout": format!("{b_layout:?}"), "m": MS[mi], "geomean_ours_over_cublas": geo, "worst": min }));
        }
    }
    Ok(rows)
}
