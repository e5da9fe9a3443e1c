//! MoE expert FFN on one GPU: ours (`MoePlan`: routing, gather, grouped up + SwiGLU, grouped
//! down, combine) beside a per-expert cuBLAS loop (the up and down GEMMs of every expert on
//! rows already grouped: GEMMs only, no routing, gather, activation or combine) and
//! `torch._grouped_mm` (crates/bench/python/moe_torch.py through python3, when PyTorch is
//! present: the whole layer, and its two grouped GEMMs alone). TFLOP/s =
//! `(2 T k H 2F + 2 T k F H) / time`, the routed rows only.
use crate::timing::median_ms_interleaved;
use crate::Args;
use anyhow::{Context, Result};
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use mkernel::ops::moe::{moe_combine, Activation, MoeCombine, MoePlan, MoeShape, MoeStage};
use mkernel::Device;
use mkernel_tests::data::random_bf16;
use mkernel_tests::moe::{skewed_routing, uniform_routing};
use serde_json::{json, Value};
use std::sync::Arc;

/// The cases: (T, E, top_k, H, F, routing).
fn cases() -> Vec<(usize, usize, usize, usize, usize, &'static str)> {
    vec![
        (4096, 64, 8, 4096, 2048, "uniform"),
        (4096, 64, 8, 4096, 2048, "skewed"),
        (16384, 16, 4, 4096, 1408, "uniform"),
        (128, 64, 8, 4096, 2048, "uniform"),
    ]
}

/// `len` bf16 values in [-1, 1) scaled by `scale`: a random block of 4 Mi values repeated
/// (device copies; values repeat, timing does not care).
pub(crate) fn random_device(stream: &Arc<CudaStream>, len: usize, seed: u64, scale: f32) -> Result<CudaSlice<bf16>> {
    let block: Vec<bf16> = random_bf16(len.min(1 << 22), seed)
        .iter()
        .map(|v| bf16::from_f32(v.to_f32() * scale))
        .collect();
    let src = stream.clone_htod(&block)?;
    let mut out = stream.alloc_zeros::<bf16>(len)?;
    let mut at = 0;
    while at < len {
        let n = block.len().min(len - at);
        stream.memcpy_dtod(&src.slice(..n), &mut out.slice_mut(at..at + n))?;
        at += n;
    }
    Ok(out)
}

/// Row-major `c (m x n) = a (m x k) * w^T` with `w` stored n x k, on cuBLAS.
#[allow(clippy::too_many_arguments)]
fn cublas_nt(
    blas: &CudaBlas,
    m: usize,
    n: usize,
    k: usize,
    a: &cudarc::driver::CudaView<bf16>,
    w: &cudarc::driver::CudaView<bf16>,
    c: &mut cudarc::driver::CudaViewMut<bf16>,
) -> Result<()> {
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: bf16::ONE,
        lda: k as i32,
        ldb: k as i32,
        beta: bf16::ZERO,
        ldc: n as i32,
    };
    // SAFETY: the views hold the shapes' elements.
    unsafe { blas.gemm(cfg, w, a, c) }?;
    Ok(())
}

/// Runs the PyTorch script on every case; `None` per case when python3/PyTorch is missing
/// or the case failed (the reason printed).
fn torch_results(cases: &[(String, MoeShape, &str)], args: &Args) -> Vec<Option<(f64, f64)>> {
    let script = [
        std::env::var("MKERNEL_MOE_TORCH_SCRIPT")
            .ok()
            .map(std::path::PathBuf::from),
        std::env::current_exe().ok().map(|p| p.with_file_name("moe_torch.py")),
        Some(std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/python/moe_torch.py"
        ))),
    ]
    .into_iter()
    .flatten()
    .find(|p| p.exists());
    let Some(script) = script else {
        println!("# torch._grouped_mm: moe_torch.py not found; column left empty");
        return vec![None; cases.len()];
    };
    let req = json!({
        "iters": args.iters, "warmup": args.warmup,
        "cases": cases.iter().map(|(label, s, routing)| json!({
            "label": label, "tokens": s.tokens, "experts": s.experts, "top_k": s.top_k,
            "hidden": s.hidden, "ffn": s.ffn, "routing": routing })).collect::<Vec<_>>(),
    });
    let out = match std::process::Command::new("python3")
        .arg(&script)
        .arg(req.to_string())
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            println!("# torch._grouped_mm: python3 did not start ({e}); column left empty");
            return vec![None; cases.len()];
        }
    };
    if !out.status.success() {
        println!(
            "# torch._grouped_mm: {} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        );
    }
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    cases
        .iter()
        .map(|(label, _, _)| {
            let r = lines.iter().find(|v| v["label"] == label.as_str())?;
            if let Some(e) = r["error"].as_str() {
                println!("# torch._grouped_mm {label}: {e}");
                return None;
            }
            Some((r["layer_ms"].as_f64()?, r["gemm_ms"].as_f64()?))
        })
        .collect()
}

pub fn run(dev: &Device, args: &Args) -> Result<Vec<Value>> {
    let stream = dev.default_stream();
    let blas = CudaBlas::new(stream.clone())?;
    let mut list = vec![];
    for (t, e, k, h, f, routing) in cases() {
        let label = format!("T{t}-E{e}-k{k}-H{h}-F{f}-{routing}");
        if args.filter.as_ref().is_some_and(|x| !label.contains(x.as_str())) {
            continue;
        }
        let s = MoeShape {
            tokens: t,
            experts: e,
            top_k: k,
            hidden: h,
            ffn: f,
            act: Activation::SwiGlu,
        };
        list.push((label, s, routing));
    }
    // PyTorch first (its own process; the GPU is free again when it returns).
    let torch = torch_results(&list, args);
    println!(
        "# ours: route + gather + grouped GEMM up (SwiGLU fused) + grouped GEMM down + combine, {} SMs; cuBLAS loop: per-expert up and down GEMMs only; torch: whole layer (and its two _grouped_mm alone)",
        dev.sm_count()
    );
    println!(
        "# median of {} runs after {} warm-up; TFLOP/s = (2 T k H 2F + 2 T k F H) / time",
        args.iters, args.warmup
    );
    println!(
        "{:<34} {:>9} {:>8} {:>11} {:>8} {:>10} {:>8} {:>10} {:>8} {:>9} {:>9}",
        "case",
        "ours_us",
        "TFLOP/s",
        "cublas_us",
        "TFLOP/s",
        "torch_us",
        "TFLOP/s",
        "tgemm_us",
        "TFLOP/s",
        "/torch",
        "/cublas"
    );
    let mut rows = vec![];
    for ((label, s, routing), torch) in list.iter().zip(torch) {
        let (lu, ld) = s.weight_lens();
        let w_up = random_device(&stream, lu, 1, 0.05)?;
        let w_down = random_device(&stream, ld, 2, 0.05)?;
        let x = random_device(&stream, s.tokens * s.hidden, 3, 1.0)?;
        let (ids, wts) = match *routing {
            "uniform" => uniform_routing(s.tokens, s.experts, s.top_k, 4),
            _ => skewed_routing(s.tokens, s.experts, s.top_k, 4),
        };
        let dids = stream.clone_htod(&ids)?;
        let dw = stream.clone_htod(&wts)?;
        let mut out = stream.alloc_zeros::<bf16>(s.tokens * s.hidden)?;
        // Both combines (ordered: `mk_moe_combine`; epilogue: in the down projection), timed
        // side by side; "ours" is the one `moe_combine` picks for the shape.
        let plan = MoePlan::new(dev, &stream, *s, &w_up, &w_down, None).context("MoePlan")?;
        let plan_o = plan.with_combine(&stream, MoeCombine::Ordered)?;
        let plan_e =
            MoePlan::new(dev, &stream, *s, &w_up, &w_down, None)?.with_combine(&stream, MoeCombine::Epilogue)?;
        let default = moe_combine(s);
        // cuBLAS loop buffers: rows grouped without padding.
        let mut counts = vec![0usize; s.experts];
        for &i in &ids {
            counts[i as usize] += 1;
        }
        let m = s.pairs();
        let xg = random_device(&stream, m * s.hidden, 5, 1.0)?;
        let mut hg = stream.alloc_zeros::<bf16>(m * s.up_rows())?;
        let hin = random_device(&stream, m * s.ffn, 6, 1.0)?;
        let mut yg = stream.alloc_zeros::<bf16>(m * s.hidden)?;
        let (ms_o, ms_e, ms_blas) = {
            let mut out_e = stream.alloc_zeros::<bf16>(s.tokens * s.hidden)?;
            let mut ours_o = || Ok(plan_o.launch(&stream, &x, &dids, &dw, &mut out)?);
            let mut ours_e = || Ok(plan_e.launch(&stream, &x, &dids, &dw, &mut out_e)?);
            let mut theirs = || -> Result<()> {
                let mut row = 0;
                for (e, &c) in counts.iter().enumerate() {
                    if c == 0 {
                        continue;
                    }
                    let (ur, h, f) = (s.up_rows(), s.hidden, s.ffn);
                    cublas_nt(
                        &blas,
                        c,
                        ur,
                        h,
                        &xg.slice(row * h..(row + c) * h),
                        &w_up.slice(e * ur * h..(e + 1) * ur * h),
                        &mut hg.slice_mut(row * ur..(row + c) * ur),
                    )?;
                    cublas_nt(
                        &blas,
                        c,
                        h,
                        f,
                        &hin.slice(row * f..(row + c) * f),
                        &w_down.slice(e * h * f..(e + 1) * h * f),
                        &mut yg.slice_mut(row * h..(row + c) * h),
                    )?;
                    row += c;
                }
                Ok(())
            };
            let t = median_ms_interleaved(
                &stream,
                args.warmup,
                args.iters,
                &mut [&mut ours_o, &mut ours_e, &mut theirs],
            )?;
            (t[0], t[1], t[2])
        };
        let ms_ours = if default == MoeCombine::Epilogue { ms_e } else { ms_o };
        // Diagnostic: each stage alone (on the state the full launches left).
        let stages = {
            let mut fs: Vec<Box<dyn FnMut() -> Result<()>>> = vec![];
            for (plan, st) in [&plan_o, &plan_e]
                .into_iter()
                .flat_map(|p| MoeStage::ALL.map(|st| (p, st)))
            {
                let (stream, x, dids, dw) = (&stream, &x, &dids, &dw);
                let out = std::cell::RefCell::new(stream.alloc_zeros::<bf16>(s.tokens * s.hidden)?);
                fs.push(Box::new(move || {
                    Ok(plan.launch_stage(st, stream, x, dids, dw, &mut *out.borrow_mut())?)
                }));
            }
            let mut refs: Vec<&mut dyn FnMut() -> Result<()>> = fs.iter_mut().map(|f| &mut **f as _).collect();
            median_ms_interleaved(&stream, args.warmup, args.iters, &mut refs)?
        };
        let us = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{:.1}", x * 1e3))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        println!(
            "#   stages alone (us), route / gather / up / down / combine: ordered {}; epilogue {} (down: zeroing + down with the combine; combine: f32 -> bf16); whole layer: ordered {:.1}, epilogue {:.1}",
            us(&stages[..5]),
            us(&stages[5..]),
            ms_o * 1e3,
            ms_e * 1e3
        );
        let (mut plan_o, mut plan_e) = (plan_o, plan_e);
        plan_o.take_error(&stream)?;
        plan_e.take_error(&stream)?;
        let plan = &plan_o;
        let tf = |ms: f64| s.flops() / (ms * 1e-3) / 1e12;
        let (torch_layer, torch_gemm) = (torch.map(|t| t.0), torch.map(|t| t.1));
        let fmt = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{:.1}", x * 1e3));
        let fmt_tf = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{:.1}", tf(x)));
        let vs_torch = torch_layer.map(|t| t / ms_ours);
        println!(
            "{:<34} {:>9.1} {:>8.1} {:>11.1} {:>8.1} {:>10} {:>8} {:>10} {:>8} {:>9} {:>9.3}",
            label,
            ms_ours * 1e3,
            tf(ms_ours),
            ms_blas * 1e3,
            tf(ms_blas),
            fmt(torch_layer),
            fmt_tf(torch_layer),
            fmt(torch_gemm),
            fmt_tf(torch_gemm),
            vs_torch.map_or("-".into(), |r| format!("{r:.3}")),
            ms_blas / ms_ours
        );
        if let Some(tg) = torch_gemm {
            println!(
                "#   / torch grouped_mm: ours (layer, {default:?} combine) {:.3}, ordered {:.3}, epilogue {:.3}, our up + down GEMMs alone {:.3}",
                tg / ms_ours,
                tg / ms_o,
                tg / ms_e,
                tg / (stages[2] + stages[3])
            );
        }
        let hot = counts.iter().max().copied().unwrap_or(0);
        rows.push(
            json!({ "label": label, "tokens": s.tokens, "experts": s.experts, "top_k": s.top_k,
            "hidden": s.hidden, "ffn": s.ffn, "routing": routing, "hottest_expert_rows": hot,
            "ours_ms": ms_ours, "ours_tflops": tf(ms_ours), "ours_combine": format!("{default:?}"),
            "ours_ordered_ms": ms_o, "ours_epilogue_ms": ms_e,
            "stages_ordered_ms": &stages[..5], "stages_epilogue_ms": &stages[5..],
            "ours_gemms_ms": stages[2] + stages[3],
            "ours_gemms_over_torch_grouped_mm": torch_gemm.map(|t| t / (stages[2] + stages[3])),
            "ours_over_torch_grouped_mm": torch_gemm.map(|t| t / ms_ours),
            "cublas_loop_gemms_ms": ms_blas, "cublas_loop_gemms_tflops": tf(ms_blas),
            "torch_layer_ms": torch_layer, "torch_layer_tflops": torch_layer.map(tf),
            "torch_grouped_mm_only_ms": torch_gemm, "torch_grouped_mm_only_tflops": torch_gemm.map(tf),
            "ours_over_torch_layer": vs_torch, "ours_over_cublas_loop": ms_blas / ms_ours,
            "gemm_grid": plan.gemm_grid() }),
        );
    }
    Ok(rows)
}
