//! FlashAttention backward on the GPU against the CPU reference (f64) of the gradients: dQ, dK,
//! dV for causal and non-causal, head dim 64 and 128, MHA/GQA/MQA, ragged lengths, S_q != S_k,
//! packed varlen batches with empty and length-1 sequences, a CUDA graph replay, bad input.
//! O and LSE come from our forward on the same inputs.
use half::bf16;
use mkernel::cudarc::driver::{CudaSlice, DevicePtr};
use mkernel::ops::attention::{flash_attention, AttentionHeads, AttentionTensors, Sequences};
use mkernel::ops::attention_bwd::{
    BackwardBuffers, BackwardPtrs, BackwardSequences, BackwardShape, FlashAttentionBackwardPlan,
};
use mkernel::{Device, Error};
use mkernel_tests::attention::{attention_backward, Seq};
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::device_or_skip;

/// A gradient element is right when `|got - want| <= G_FLOOR + G_ABS * max|want| + G_REL * |want|`
/// (max over the tensor; the floor covers gradients that are 0 up to f32 rounding, e.g. a row
/// with one key, where `dP - delta` cancels): P and dS are rounded to bf16 before their matmuls (2^-9 relative each,
/// averaging out over the keys / queries summed), the outputs to bf16, and O (for delta) is the
/// forward's bf16 output.
const G_ABS: f64 = 1e-2;
const G_REL: f64 = 2e-2;
const G_FLOOR: f64 = 1e-3;

/// (wrong, max |err|, max |want|, first wrong) of one gradient tensor.
fn compare(name: &str, got: &[bf16], want: &[f64]) -> (usize, f64, f64, String) {
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let (mut wrong, mut max_err) = (0, 0.0f64);
    let mut first = String::new();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = (g.to_f64() - w).abs();
        max_err = max_err.max(e);
        if e.is_nan() || e > G_FLOOR + G_ABS * scale + G_REL * w.abs() {
            if wrong == 0 {
                first = format!("{name}[{i}] = {} want {w}", g.to_f64());
            }
            wrong += 1;
        }
    }
    (wrong, max_err, scale, first)
}

/// Inputs, outputs and gradients of one problem on the GPU.
struct Problem {
    seqs: Vec<Seq>,
    tq: usize,
    tk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    scale: Option<f32>,
}

impl Problem {
    fn heads(&self) -> AttentionHeads {
        AttentionHeads {
            heads_q: self.hq,
            heads_kv: self.hkv,
            head_dim: self.d,
            causal: self.causal,
            softmax_scale: self.scale,
        }
    }
}

/// Runs forward + backward (launched `launches` times, the last one checked) and compares with the
/// reference; returns the report line.
fn check(dev: &Device, p: &Problem, bseqs: BackwardSequences, label: String, seed: u64) -> String {
    let stream = dev.default_stream();
    let (q, k, v, d_o) = (
        random_bf16(p.tq * p.hq * p.d, seed),
        random_bf16(p.tk * p.hkv * p.d, seed + 1),
        random_bf16(p.tk * p.hkv * p.d, seed + 2),
        random_bf16(p.tq * p.hq * p.d, seed + 3),
    );
    let up = |x: &[bf16]| stream.clone_htod(x).unwrap();
    let (gq, gk, gv, gdo) = (up(&q), up(&k), up(&v), up(&d_o));
    let mut o = stream.alloc_zeros::<bf16>(p.tq * p.hq * p.d).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(p.tq * p.hq).unwrap();
    let cu: Option<(CudaSlice<i32>, CudaSlice<i32>)> = match &bseqs {
        BackwardSequences::Varlen {
            cu_seqlens_q,
            cu_seqlens_k,
        } => Some((
            stream.clone_htod(cu_seqlens_q).unwrap(),
            stream.clone_htod(cu_seqlens_k).unwrap(),
        )),
        BackwardSequences::Batched { .. } => None,
    };
    let fseqs = match (&bseqs, &cu) {
        (
            BackwardSequences::Batched {
                batch,
                seqlen_q,
                seqlen_k,
            },
            _,
        ) => Sequences::Batched {
            batch: *batch,
            seqlen_q: *seqlen_q,
            seqlen_k: *seqlen_k,
        },
        (
            BackwardSequences::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
            },
            Some((cq, ck)),
        ) => {
            let lens = |cu: &[i32]| cu.windows(2).map(|w| (w[1] - w[0]) as usize).collect::<Vec<_>>();
            Sequences::Varlen {
                cu_seqlens_q: cq,
                cu_seqlens_k: ck,
                batch: cu_seqlens_q.len() - 1,
                max_seqlen_q: lens(cu_seqlens_q).into_iter().max().unwrap_or(0).max(1),
                total_q: *cu_seqlens_q.last().unwrap() as usize,
                total_k: *cu_seqlens_k.last().unwrap() as usize,
            }
        }
        _ => unreachable!(),
    };
    let t = AttentionTensors {
        q: &gq,
        k: &gk,
        v: &gv,
        o: &mut o,
        lse: Some(&mut lse),
    };
    flash_attention(dev, &stream, p.heads(), t, fseqs).unwrap();
    let shape = BackwardShape {
        seqs: bseqs,
        heads: p.heads(),
    };
    let ws_bytes = FlashAttentionBackwardPlan::workspace_bytes(&shape).unwrap();
    let plan = FlashAttentionBackwardPlan::new(dev, shape).unwrap();
    let mut ws = stream.alloc_zeros::<u8>(ws_bytes as usize).unwrap();
    let mut dq = stream.alloc_zeros::<bf16>(p.tq * p.hq * p.d).unwrap();
    let mut dk = stream.alloc_zeros::<bf16>(p.tk * p.hkv * p.d).unwrap();
    let mut dv = stream.alloc_zeros::<bf16>(p.tk * p.hkv * p.d).unwrap();
    // Twice: the second launch must not see the first one's accumulator.
    for _ in 0..2 {
        let b = BackwardBuffers {
            q: &gq,
            k: &gk,
            v: &gv,
            o: &o,
            d_o: &gdo,
            lse: &lse,
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
            cu_seqlens: cu.as_ref().map(|(a, b)| (a, b)),
        };
        plan.launch(&stream, b, &mut ws).unwrap();
    }
    let (hdq, hdk, hdv) = (
        stream.clone_dtoh(&dq).unwrap(),
        stream.clone_dtoh(&dk).unwrap(),
        stream.clone_dtoh(&dv).unwrap(),
    );
    let scale = p.heads().scale() as f64;
    let (wq, wk, wv) = attention_backward(&q, &k, &v, &d_o, &p.seqs, p.tq, p.tk, p.hq, p.hkv, p.d, p.causal, scale);
    let rq = compare("dQ", &hdq, &wq);
    let rk = compare("dK", &hdk, &wk);
    let rv = compare("dV", &hdv, &wv);
    let rel = |r: &(usize, f64, f64, String)| if r.2 > 0.0 { r.1 / r.2 } else { r.1 };
    let line = format!(
        "{label}: wrong dQ {} dK {} dV {} of {}/{}/{}; max |err| / max |want|: dQ {:.2e} dK {:.2e} dV {:.2e}",
        rq.0,
        rk.0,
        rv.0,
        hdq.len(),
        hdk.len(),
        hdv.len(),
        rel(&rq),
        rel(&rk),
        rel(&rv)
    );
    assert!(
        rq.0 == 0 && rk.0 == 0 && rv.0 == 0,
        "{line}; first: {} {} {}",
        rq.3,
        rk.3,
        rv.3
    );
    line
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn attention_backward_matches_cpu_reference() {
    let Some(dev) = device_or_skip("attention_backward_matches_cpu_reference") else {
        return;
    };
    #[rustfmt::skip]
    let cases = [
        // B, Sq, Sk, Hq, Hkv, D, causal, scale
        (1, 128, 128, 1, 1, 64, false, None),     // one key block, two query blocks
        (1, 128, 128, 1, 1, 128, true, None),
        (2, 300, 300, 4, 2, 128, false, None),    // ragged, GQA
        (2, 300, 300, 4, 2, 64, true, None),
        (1, 1000, 1000, 4, 1, 64, true, None),    // MQA, causal, ragged
        (1, 384, 384, 2, 2, 128, false, Some(0.3f32)),
        (1, 200, 517, 2, 2, 128, true, None),     // S_q < S_k: bottom-right causal
        (1, 517, 200, 2, 2, 64, true, None),      // S_q > S_k: leading rows see no key
        (3, 77, 129, 8, 4, 128, false, None),     // short, several sequences
        (2, 1024, 1024, 8, 2, 128, true, None),   // 8 key blocks, 16 query blocks
        (1, 1, 1, 1, 1, 128, false, None),        // one row, one key
        (1, 1, 700, 2, 1, 64, true, None),        // one query sees every key
    ];
    for (i, &(batch, sq, sk, hq, hkv, d, causal, scale)) in cases.iter().enumerate() {
        let p = Problem {
            seqs: (0..batch)
                .map(|b| Seq {
                    q_start: b * sq,
                    q_len: sq,
                    k_start: b * sk,
                    k_len: sk,
                })
                .collect(),
            tq: batch * sq,
            tk: batch * sk,
            hq,
            hkv,
            d,
            causal,
            scale,
        };
        let label = format!(
            "B={batch} Sq={sq:>5} Sk={sk:>5} Hq={hq:>2} Hkv={hkv:>2} D={d:>3} causal={causal:<5} scale={scale:?}"
        );
        let seqs = BackwardSequences::Batched {
            batch,
            seqlen_q: sq,
            seqlen_k: sk,
        };
        println!("{}", check(&dev, &p, seqs, label, 900 + 5 * i as u64));
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn varlen_attention_backward_matches_cpu_reference() {
    let Some(dev) = device_or_skip("varlen_attention_backward_matches_cpu_reference") else {
        return;
    };
    // Empty sequences (no queries, no keys, both), length-1 ones, ragged blocks.
    let lens = [
        (1, 1),
        (130, 257),
        (0, 5),
        (300, 300),
        (64, 0),
        (513, 200),
        (0, 0),
        (129, 129),
        (1, 300),
    ];
    for (i, (d, causal)) in [(64, false), (64, true), (128, false), (128, true)]
        .into_iter()
        .enumerate()
    {
        let (mut cu_q, mut cu_k, mut seqs) = (vec![0i32], vec![0i32], vec![]);
        for &(lq, lk) in &lens {
            seqs.push(Seq {
                q_start: *cu_q.last().unwrap() as usize,
                q_len: lq,
                k_start: *cu_k.last().unwrap() as usize,
                k_len: lk,
            });
            cu_q.push(cu_q.last().unwrap() + lq as i32);
            cu_k.push(cu_k.last().unwrap() + lk as i32);
        }
        let p = Problem {
            seqs,
            tq: *cu_q.last().unwrap() as usize,
            tk: *cu_k.last().unwrap() as usize,
            hq: 4,
            hkv: 2,
            d,
            causal,
            scale: None,
        };
        let label = format!("varlen {lens:?} Hq=4 Hkv=2 D={d} causal={causal}");
        let seqs = BackwardSequences::Varlen {
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
        };
        println!("{}", check(&dev, &p, seqs, label, 700 + 5 * i as u64));
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn attention_backward_replays_in_a_cuda_graph() {
    use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(dev) = device_or_skip("attention_backward_replays_in_a_cuda_graph") else {
        return;
    };
    let stream = dev.context().new_stream().unwrap();
    let (b, s, hq, hkv, d) = (2, 777, 4, 2, 128);
    let up = |x: Vec<bf16>| stream.clone_htod(&x).unwrap();
    let q = up(random_bf16(b * s * hq * d, 17));
    let k = up(random_bf16(b * s * hkv * d, 18));
    let v = up(random_bf16(b * s * hkv * d, 19));
    let d_o = up(random_bf16(b * s * hq * d, 20));
    let heads = AttentionHeads {
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
        causal: true,
        softmax_scale: None,
    };
    let mut o = stream.alloc_zeros::<bf16>(b * s * hq * d).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(b * s * hq).unwrap();
    let fseqs = Sequences::Batched {
        batch: b,
        seqlen_q: s,
        seqlen_k: s,
    };
    let t = AttentionTensors {
        q: &q,
        k: &k,
        v: &v,
        o: &mut o,
        lse: Some(&mut lse),
    };
    flash_attention(&dev, &stream, heads, t, fseqs).unwrap();
    let shape = BackwardShape {
        seqs: BackwardSequences::Batched {
            batch: b,
            seqlen_q: s,
            seqlen_k: s,
        },
        heads,
    };
    let ws_bytes = FlashAttentionBackwardPlan::workspace_bytes(&shape).unwrap() as usize;
    let plan = FlashAttentionBackwardPlan::new(&dev, shape).unwrap();
    macro_rules! grads {
        ($dq:expr, $dk:expr, $dv:expr) => {
            BackwardBuffers {
                q: &q,
                k: &k,
                v: &v,
                o: &o,
                d_o: &d_o,
                lse: &lse,
                dq: $dq,
                dk: $dk,
                dv: $dv,
                cu_seqlens: None,
            }
        };
    }
    let alloc = |n: usize| stream.alloc_zeros::<bf16>(n).unwrap();
    let (mut dq0, mut dk0, mut dv0) = (alloc(b * s * hq * d), alloc(b * s * hkv * d), alloc(b * s * hkv * d));
    let mut ws = stream.alloc_zeros::<u8>(ws_bytes).unwrap();
    plan.launch(&stream, grads!(&mut dq0, &mut dk0, &mut dv0), &mut ws)
        .unwrap();
    let (mut dq, mut dk, mut dv) = (alloc(b * s * hq * d), alloc(b * s * hkv * d), alloc(b * s * hkv * d));
    // The addresses, taken before the capture (their guards wait on and record cudarc's events,
    // which a capture may not).
    let ptr = |x: &CudaSlice<bf16>| x.device_ptr(&stream).0;
    let ptrs = BackwardPtrs {
        q: ptr(&q),
        k: ptr(&k),
        v: ptr(&v),
        o: ptr(&o),
        d_o: ptr(&d_o),
        lse: lse.device_ptr(&stream).0,
        dq: ptr(&dq),
        dk: ptr(&dk),
        dv: ptr(&dv),
        workspace: ws.device_ptr(&stream).0,
        cu_seqlens_q: 0,
        cu_seqlens_k: 0,
    };
    stream.synchronize().unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    // `launch` refuses a capture (it would wait on events recorded outside it).
    match plan.launch(&stream, grads!(&mut dq, &mut dk, &mut dv), &mut ws) {
        Err(e @ Error::OutOfRange { .. }) => assert!(e.to_string().contains("launch_raw"), "{e}"),
        other => panic!("expected launch to refuse the capture, got {other:?}"),
    }
    // SAFETY: the buffers outlive the graph's replays below, and nothing else touches them meanwhile.
    unsafe { plan.launch_raw(&stream, &ptrs) }.unwrap();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("graph");
    for _ in 0..3 {
        graph.launch().unwrap();
    }
    stream.synchronize().unwrap();
    let host = |x: &CudaSlice<bf16>| stream.clone_dtoh(x).unwrap();
    let bits = |x: &[bf16], y: &[bf16]| x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        bits(&host(&dk), &host(&dk0)) && bits(&host(&dv), &host(&dv0)),
        "dK / dV of the replay differ"
    );
    // dQ sums f32 atomics in arrival order: equal up to rounding.
    let (a, w) = (host(&dq), host(&dq0));
    let max = a
        .iter()
        .zip(&w)
        .map(|(x, y)| (x.to_f64() - y.to_f64()).abs())
        .fold(0.0, f64::max);
    assert!(max <= 1e-2, "dQ of the replay differs by {max}");
    println!(
        "backward (launch_raw) captured in a CUDA graph, replayed 3 times: dK, dV bitwise equal to the direct launch, dQ within {max:.1e}"
    );
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn bad_attention_backward_input_is_rejected() {
    let Some(dev) = device_or_skip("bad_attention_backward_input_is_rejected") else {
        return;
    };
    let stream = dev.default_stream();
    let heads = AttentionHeads {
        heads_q: 4,
        heads_kv: 2,
        head_dim: 128,
        causal: false,
        softmax_scale: None,
    };
    let batched = BackwardSequences::Batched {
        batch: 2,
        seqlen_q: 256,
        seqlen_k: 256,
    };
    let shape = |seqs: BackwardSequences, h: AttentionHeads| BackwardShape { seqs, heads: h };
    let msg = |r: mkernel::Result<FlashAttentionBackwardPlan>| match r {
        Err(e @ Error::Shape { .. }) => e.to_string(),
        Err(e) => panic!("expected a shape error, got {e}"),
        Ok(_) => panic!("expected a shape error, got a plan"),
    };
    let e = msg(FlashAttentionBackwardPlan::new(
        &dev,
        shape(batched.clone(), AttentionHeads { head_dim: 96, ..heads }),
    ));
    assert!(e.contains("head_dim 96"), "{e}");
    let e = msg(FlashAttentionBackwardPlan::new(
        &dev,
        shape(
            BackwardSequences::Varlen {
                cu_seqlens_q: vec![0, 300, 200],
                cu_seqlens_k: vec![0, 100, 200],
            },
            heads,
        ),
    ));
    assert!(e.contains("decreases"), "{e}");
    let plan = FlashAttentionBackwardPlan::new(&dev, shape(batched, heads)).unwrap();
    let n = 2 * 256 * 4 * 128;
    let z = |n: usize| stream.alloc_zeros::<bf16>(n).unwrap();
    let (q, k, v, o, d_o) = (z(n), z(n / 2), z(n / 2), z(n), z(n));
    let lse = stream.alloc_zeros::<f32>(2 * 256 * 4).unwrap();
    let (mut dq, mut dk, mut dv) = (z(n), z(n / 2 - 1), z(n / 2));
    let mut ws = stream.alloc_zeros::<u8>(16).unwrap();
    let b = BackwardBuffers {
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
    match plan.launch(&stream, b, &mut ws) {
        Err(e @ Error::BufferTooSmall { .. }) => assert!(e.to_string().contains("dK"), "{e}"),
        other => panic!("expected a short-buffer error, got {other:?}"),
    }
    println!("bad head dim, bad cu_seqlens and a short dK are rejected with clear errors");
}
