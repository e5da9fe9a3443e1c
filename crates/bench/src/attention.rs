//! FlashAttention forward: ours vs PyTorch SDPA's cuDNN and FlashAttention-2 backends.
//!
//! Ours is timed in this process (CUDA events, median); the baselines by the script
//! crates/bench/python/sdpa_bench.py (embedded in this binary, run with `python3`) on the same
//! GPU right after, same shapes, same timing rule. When python3 or torch is missing the table
//! says so and shows ours alone.
//! TFLOP/s = 4 B Hq S^2 D per call, halved when causal (the convention); the backward
//! (dQ, dK, dV: `FlashAttentionBackwardPlan`, all three of its kernels, beside the baselines'
//! `torch.autograd.grad` of the output) counts 2.5 times that.
use crate::timing::median_ms_interleaved;
use crate::Args;
use anyhow::Result;
use half::bf16;
use mkernel::ops::attention::{AttentionHeads, AttentionTensors, FlashAttentionPlan, Sequences};
use mkernel::ops::attention_bwd::{BackwardBuffers, BackwardSequences, BackwardShape, FlashAttentionBackwardPlan};
use mkernel::Device;
use mkernel_tests::data::random_bf16;
use serde_json::{json, Value};

const SCRIPT: &str = include_str!("../python/sdpa_bench.py");

/// (B, Hq, Hkv, S, D): the four shapes.
const SHAPES: [(usize, usize, usize, usize, usize); 4] = [
    (1, 32, 32, 16384, 128),
    (4, 16, 16, 8192, 128),
    (1, 32, 8, 16384, 128),
    (1, 32, 32, 16384, 64),
];

fn flops(b: usize, hq: usize, s: usize, d: usize, causal: bool) -> f64 {
    let f = 4.0 * (b * hq * d) as f64 * (s * s) as f64;
    if causal {
        f / 2.0
    } else {
        f
    }
}

/// Runs the baseline script; `None` with the reason when it cannot run.
fn baselines(cases: &[Value], args: &Args) -> std::result::Result<(Value, Vec<Value>), String> {
    let dir = std::env::temp_dir().join(format!("mkernel-sdpa-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let path = dir.join("sdpa_bench.py");
    std::fs::write(&path, SCRIPT).map_err(|e| e.to_string())?;
    let out = std::process::Command::new("python3")
        .arg(&path)
        .arg(serde_json::to_string(cases).unwrap())
        .arg(args.warmup.to_string())
        .arg(args.iters.to_string())
        .arg("bwd")
        .output()
        .map_err(|e| format!("python3 did not start: {e}"))?;
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "python3 sdpa_bench.py failed: {}",
            err.lines().last().unwrap_or("(no output)")
        ));
    }
    let mut lines = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect::<Vec<_>>();
    if lines.is_empty() {
        return Err("sdpa_bench.py printed nothing".into());
    }
    let head = lines.remove(0);
    Ok((head, lines))
}

/// An attention case: its label, B, Hq, Hkv, S, D, causal.
pub(crate) type Case = (String, usize, usize, usize, usize, usize, bool);

/// The cases of `shapes` (B, Hq, Hkv, S, D), each without then with the causal mask, that
/// `--filter` keeps (a substring of the label `BxHqxHkvxSxD`, `c` appended when causal).
pub(crate) fn selected(shapes: &[(usize, usize, usize, usize, usize)], args: &Args) -> Vec<Case> {
    let mut cases = vec![];
    for &(b, hq, hkv, s, d) in shapes {
        for causal in [false, true] {
            let label = format!("{b}x{hq}x{hkv}x{s}x{d}{}", if causal { "c" } else { "" });
            if args.filter.as_ref().is_some_and(|f| !label.contains(f.as_str())) {
                continue;
            }
            cases.push((label, b, hq, hkv, s, d, causal));
        }
    }
    cases
}

pub fn run(dev: &Device, args: &Args) -> Result<Vec<Value>> {
    let stream = dev.default_stream();
    let cases: Vec<_> = selected(&SHAPES, args)
        .into_iter()
        .map(|(_, b, hq, hkv, s, d, causal)| (b, hq, hkv, s, d, causal))
        .collect();
    println!(
        "# ours: FlashAttention forward, 128x128 tiles, 1 producer + 2 consumer warpgroups, persistent grid of {} SMs",
        dev.sm_count()
    );
    let mut ours_ms = vec![];
    let mut ours_bwd_ms = vec![];
    let mut launch_us = vec![];
    for &(b, hq, hkv, s, d, causal) in &cases {
        let q = stream.clone_htod(&random_bf16(b * s * hq * d, 1))?;
        let k = stream.clone_htod(&random_bf16(b * s * hkv * d, 2))?;
        let v = stream.clone_htod(&random_bf16(b * s * hkv * d, 3))?;
        let mut o = stream.alloc_zeros::<bf16>(b * s * hq * d)?;
        let mut lse = stream.alloc_zeros::<f32>(b * s * hq)?;
        let heads = AttentionHeads {
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            causal,
            softmax_scale: None,
        };
        let seqs = Sequences::Batched {
            batch: b,
            seqlen_q: s,
            seqlen_k: s,
        };
        let plan = FlashAttentionPlan::new(dev, heads)?;
        let mut ours = || {
            let t = AttentionTensors {
                q: &q,
                k: &k,
                v: &v,
                o: &mut o,
                lse: Some(&mut lse),
            };
            plan.launch(&stream, t, seqs)?;
            Ok(())
        };
        let t = median_ms_interleaved(&stream, args.warmup, args.iters, &mut [&mut ours])?;
        ours_ms.push(t[0]);
        // Host time of one launch (encoding the tensor maps, checks, enqueue), over a burst.
        let burst = 50;
        let t0 = std::time::Instant::now();
        for _ in 0..burst {
            ours()?;
        }
        launch_us.push(t0.elapsed().as_secs_f64() * 1e6 / burst as f64);
        stream.synchronize()?;
        // The backward of the same problem (dO random).
        let d_o = stream.clone_htod(&random_bf16(b * s * hq * d, 4))?;
        let shape = BackwardShape {
            seqs: BackwardSequences::Batched {
                batch: b,
                seqlen_q: s,
                seqlen_k: s,
            },
            heads,
        };
        let mut ws = stream.alloc_zeros::<u8>(FlashAttentionBackwardPlan::workspace_bytes(&shape)? as usize)?;
        let bwd = FlashAttentionBackwardPlan::new(dev, shape)?;
        let mut dq = stream.alloc_zeros::<bf16>(b * s * hq * d)?;
        let mut dk = stream.alloc_zeros::<bf16>(b * s * hkv * d)?;
        let mut dv = stream.alloc_zeros::<bf16>(b * s * hkv * d)?;
        let mut ours_bwd = || {
            let bufs = BackwardBuffers {
                q: &q,
                k: &k,
                v: &v,
                o: &o,
                d_o: &d_o,
                lse: &lse,
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
                cu_seqlens: None,
            };
            Ok(bwd.launch(&stream, bufs, &mut ws)?)
        };
        let t = median_ms_interleaved(&stream, args.warmup, args.iters, &mut [&mut ours_bwd])?;
        ours_bwd_ms.push(t[0]);
    }
    let case_json: Vec<Value> = cases
        .iter()
        .map(|&(b, hq, hkv, s, d, causal)| json!({"b": b, "hq": hq, "hkv": hkv, "s": s, "d": d, "causal": causal}))
        .collect();
    let base = baselines(&case_json, args);
    match &base {
        Ok((head, _)) => println!("# baselines: torch SDPA ({head}), median of {} after {} warm-up; TFLOP/s = 4 B Hq S^2 D, halved when causal", args.iters, args.warmup),
        Err(e) => println!("# baselines missing: {e}"),
    }
    println!(
        "{:>2} {:>3} {:>3} {:>6} {:>4} {:>6} {:>9} {:>8} {:>9} {:>8} {:>8} {:>12} {:>10}",
        "B",
        "Hq",
        "Hkv",
        "S",
        "D",
        "causal",
        "ours_ms",
        "TFLOP/s",
        "cudnn_ms",
        "TFLOP/s",
        "fa2 TF/s",
        "ours/cudnn",
        "launch_us"
    );
    let mut rows = vec![];
    let mut ratios = vec![];
    for (i, &(b, hq, hkv, s, d, causal)) in cases.iter().enumerate() {
        let f = flops(b, hq, s, d, causal);
        let tf = |ms: f64| f / (ms * 1e-3) / 1e12;
        let r = base.as_ref().ok().and_then(|(_, l)| l.iter().find(|x| x["case"] == i));
        let cudnn = r.and_then(|x| x["cudnn_ms"].as_f64());
        let fa2 = r.and_then(|x| x["fa2_ms"].as_f64());
        let ratio = cudnn.map(|c| c / ours_ms[i]);
        if let Some(x) = ratio {
            ratios.push(x);
        }
        let opt = |x: Option<f64>, w: usize, p: usize| x.map_or(format!("{:>w$}", "-"), |v| format!("{v:>w$.p$}"));
        println!(
            "{b:>2} {hq:>3} {hkv:>3} {s:>6} {d:>4} {:>6} {:>9.3} {:>8.1} {} {} {} {} {:>10.2}",
            causal,
            ours_ms[i],
            tf(ours_ms[i]),
            opt(cudnn, 9, 3),
            opt(cudnn.map(tf), 8, 1),
            opt(fa2.map(tf), 8, 1),
            opt(ratio, 12, 3),
            launch_us[i]
        );
        if let Some(x) = r {
            for k in ["cudnn_err", "fa2_err"] {
                if let Some(e) = x[k].as_str() {
                    println!("#   {k}: {e}");
                }
            }
        }
        rows.push(json!({"b": b, "hq": hq, "hkv": hkv, "s": s, "d": d, "causal": causal,
            "ours_ms": ours_ms[i], "ours_tflops": tf(ours_ms[i]),
            "cudnn_ms": cudnn, "cudnn_tflops": cudnn.map(tf), "fa2_ms": fa2, "fa2_tflops": fa2.map(tf),
            "ours_over_cudnn": ratio, "launch_us": launch_us[i], "baseline": r.cloned()}));
    }
    summary(&ratios, "");
    println!("# backward (dQ, dK, dV; ours: prep + main + dQ convert); TFLOP/s = 2.5 x the forward's FLOPs");
    println!(
        "{:>2} {:>3} {:>3} {:>6} {:>4} {:>6} {:>9} {:>8} {:>9} {:>8} {:>8} {:>12}",
        "B", "Hq", "Hkv", "S", "D", "causal", "ours_ms", "TFLOP/s", "cudnn_ms", "TFLOP/s", "fa2 TF/s", "ours/cudnn"
    );
    let mut bwd_ratios = vec![];
    for (i, &(b, hq, hkv, s, d, causal)) in cases.iter().enumerate() {
        let f = 2.5 * flops(b, hq, s, d, causal);
        let tf = |ms: f64| f / (ms * 1e-3) / 1e12;
        let r = base.as_ref().ok().and_then(|(_, l)| l.iter().find(|x| x["case"] == i));
        let cudnn = r.and_then(|x| x["cudnn_bwd_ms"].as_f64());
        let fa2 = r.and_then(|x| x["fa2_bwd_ms"].as_f64());
        let ratio = cudnn.map(|c| c / ours_bwd_ms[i]);
        if let Some(x) = ratio {
            bwd_ratios.push(x);
        }
        let opt = |x: Option<f64>, w: usize, p: usize| x.map_or(format!("{:>w$}", "-"), |v| format!("{v:>w$.p$}"));
        println!(
            "{b:>2} {hq:>3} {hkv:>3} {s:>6} {d:>4} {:>6} {:>9.3} {:>8.1} {} {} {} {}",
            causal,
            ours_bwd_ms[i],
            tf(ours_bwd_ms[i]),
            opt(cudnn, 9, 3),
            opt(cudnn.map(tf), 8, 1),
            opt(fa2.map(tf), 8, 1),
            opt(ratio, 12, 3)
        );
        if let Some(x) = r {
            for k in ["cudnn_bwd_err", "fa2_bwd_err"] {
                if let Some(e) = x[k].as_str() {
                    println!("#   {k}: {e}");
                }
            }
        }
        if let Some(row) = rows.get_mut(i) {
            row["ours_bwd_ms"] = json!(ours_bwd_ms[i]);
            row["ours_bwd_tflops"] = json!(tf(ours_bwd_ms[i]));
            row["cudnn_bwd_ms"] = json!(cudnn);
            row["cudnn_bwd_tflops"] = json!(cudnn.map(tf));
            row["fa2_bwd_ms"] = json!(fa2);
            row["fa2_bwd_tflops"] = json!(fa2.map(tf));
            row["ours_over_cudnn_bwd"] = json!(ratio);
        }
    }
    summary(&bwd_ratios, " backward");
    Ok(rows)
}

/// Prints the geometric mean and the worst of `ratios` (ours / cuDNN throughput).
fn summary(ratios: &[f64], what: &str) {
    if !ratios.is_empty() {
        let geo = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
        let min = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
        println!("# geometric mean{what} ours/cuDNN (throughput) = {geo:.3}, worst = {min:.3}");
    }
}
