//! FlashAttention forward on the GPU against the CPU reference (f64): causal and non-causal,
//! head dim 64 and 128, GQA/MQA, ragged lengths, S_q != S_k, packed varlen batches, a CUDA
//! graph replay, and rejection of bad input.
use half::bf16;
use mkernel::ops::attention::{flash_attention, AttentionHeads, AttentionTensors, FlashAttentionPlan, Sequences};
use mkernel::{Device, Error};
use mkernel_tests::attention::{attention as cpu_attention, Seq};
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::device_or_skip;

/// O is right when `|got - want| <= O_ABS + O_REL * |want|`: bf16 output rounding (2^-9
/// relative) plus P rounded to bf16 before P V (each weight 2^-9 relative, averaging out).
const O_ABS: f64 = 4e-3;
const O_REL: f64 = 1e-2;
/// LSE (f32, `ex2`/`lg2` approximations): absolute.
const LSE_ABS: f64 = 2e-3;

struct Case {
    batch: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    scale: Option<f32>,
}

/// Compares O (bf16) and LSE; returns (wrong O, wrong LSE, max O err, max LSE err).
fn compare(o: &[bf16], lse: &[f32], want_o: &[f64], want_lse: &[f64]) -> (usize, usize, f64, f64, String) {
    let (mut wo, mut wl, mut mo, mut ml) = (0, 0, 0.0f64, 0.0f64);
    let mut first = String::new();
    for (i, (g, w)) in o.iter().zip(want_o).enumerate() {
        let e = (g.to_f64() - w).abs();
        mo = mo.max(e);
        if e.is_nan() || e > O_ABS + O_REL * w.abs() {
            if wo == 0 {
                first = format!("O[{i}] = {} want {w}", g.to_f64());
            }
            wo += 1;
        }
    }
    for (i, (&g, &w)) in lse.iter().zip(want_lse).enumerate() {
        let ok = if w == f64::NEG_INFINITY {
            g == f32::NEG_INFINITY
        } else {
            let e = (g as f64 - w).abs();
            ml = ml.max(e);
            e <= LSE_ABS
        };
        if !ok {
            if wl == 0 && first.is_empty() {
                first = format!("LSE[{i}] = {g} want {w}");
            }
            wl += 1;
        }
    }
    (wo, wl, mo, ml, first)
}

fn run_batched(dev: &Device, c: &Case, seed: u64) -> String {
    let stream = dev.default_stream();
    let (tq, tk) = (c.batch * c.sq, c.batch * c.sk);
    let q = random_bf16(tq * c.hq * c.d, seed);
    let k = random_bf16(tk * c.hkv * c.d, seed + 1);
    let v = random_bf16(tk * c.hkv * c.d, seed + 2);
    let (dq, dk, dv) = (
        stream.clone_htod(&q).unwrap(),
        stream.clone_htod(&k).unwrap(),
        stream.clone_htod(&v).unwrap(),
    );
    let mut o = stream.alloc_zeros::<bf16>(tq * c.hq * c.d).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(tq * c.hq).unwrap();
    let heads = AttentionHeads {
        heads_q: c.hq,
        heads_kv: c.hkv,
        head_dim: c.d,
        causal: c.causal,
        softmax_scale: c.scale,
    };
    let seqs = Sequences::Batched {
        batch: c.batch,
        seqlen_q: c.sq,
        seqlen_k: c.sk,
    };
    let t = AttentionTensors {
        q: &dq,
        k: &dk,
        v: &dv,
        o: &mut o,
        lse: Some(&mut lse),
    };
    flash_attention(dev, &stream, heads, t, seqs).unwrap();
    let (go, gl) = (stream.clone_dtoh(&o).unwrap(), stream.clone_dtoh(&lse).unwrap());
    let cpu_seqs: Vec<Seq> = (0..c.batch)
        .map(|b| Seq {
            q_start: b * c.sq,
            q_len: c.sq,
            k_start: b * c.sk,
            k_len: c.sk,
        })
        .collect();
    let (want_o, want_lse_hg) = cpu_attention(
        &q,
        &k,
        &v,
        &cpu_seqs,
        tq,
        c.hq,
        c.hkv,
        c.d,
        c.causal,
        heads.scale() as f64,
    );
    // Batched LSE is [b][h][s]; the reference's is [h][global row].
    let mut want_lse = vec![0.0; tq * c.hq];
    for b in 0..c.batch {
        for h in 0..c.hq {
            for s in 0..c.sq {
                want_lse[(b * c.hq + h) * c.sq + s] = want_lse_hg[h * tq + b * c.sq + s];
            }
        }
    }
    let (wo, wl, mo, ml, first) = compare(&go, &gl, &want_o, &want_lse);
    let line = format!(
        "B={} Sq={:>5} Sk={:>5} Hq={:>2} Hkv={:>2} D={:>3} causal={:<5} scale={:?}: wrong O {wo} / {}, LSE {wl} / {}, max |err| O {mo:.2e} LSE {ml:.2e}",
        c.batch, c.sq, c.sk, c.hq, c.hkv, c.d, c.causal, c.scale, go.len(), gl.len()
    );
    assert!(wo == 0 && wl == 0, "{line}; first: {first}");
    line
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn attention_matches_cpu_reference() {
    let Some(dev) = device_or_skip("attention_matches_cpu_reference") else {
        return;
    };
    #[rustfmt::skip]
    let cases = [
        // B, Sq, Sk, Hq, Hkv, D, causal, scale
        (1, 128, 128, 1, 1, 64, false, None),     // one tile, one key block
        (1, 128, 128, 1, 1, 128, true, None),
        (2, 300, 300, 4, 2, 128, false, None),    // ragged, GQA
        (2, 300, 300, 4, 2, 128, true, None),
        (1, 1000, 1000, 4, 1, 64, true, None),    // MQA, causal, ragged
        (1, 1000, 1000, 4, 1, 64, false, Some(0.3f32)),
        (1, 200, 517, 2, 2, 128, true, None),     // S_q < S_k: bottom-right causal
        (1, 517, 200, 2, 2, 64, true, None),      // S_q > S_k: leading rows see no key
        (3, 77, 129, 8, 8, 128, false, None),     // short, several sequences
        (3, 129, 77, 8, 4, 64, false, None),
        (4, 1024, 1024, 8, 2, 64, true, None),    // 256 tiles: several per CTA
        (2, 1536, 1536, 8, 8, 128, false, None),  // 192 tiles, 12 key blocks
        (2, 1536, 1536, 8, 8, 128, true, None),
        (1, 1, 1, 1, 1, 128, false, None),        // one row, one key
        (1, 1, 700, 2, 1, 64, true, None),        // decode-like: one query sees every key
    ];
    for (i, &(batch, sq, sk, hq, hkv, d, causal, scale)) in cases.iter().enumerate() {
        let c = Case {
            batch,
            sq,
            sk,
            hq,
            hkv,
            d,
            causal,
            scale,
        };
        println!("{}", run_batched(&dev, &c, 100 + 3 * i as u64));
    }
}

/// Packed sequences (including empty ones and a query sequence without keys).
fn run_varlen(
    dev: &Device,
    lens: &[(usize, usize)],
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    seed: u64,
) -> String {
    let stream = dev.default_stream();
    let mut cu_q = vec![0i32];
    let mut cu_k = vec![0i32];
    for &(lq, lk) in lens {
        cu_q.push(cu_q.last().unwrap() + lq as i32);
        cu_k.push(cu_k.last().unwrap() + lk as i32);
    }
    let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    let q = random_bf16(tq * hq * d, seed);
    let k = random_bf16(tk * hkv * d, seed + 1);
    let v = random_bf16(tk * hkv * d, seed + 2);
    let (dq, dk, dv) = (
        stream.clone_htod(&q).unwrap(),
        stream.clone_htod(&k).unwrap(),
        stream.clone_htod(&v).unwrap(),
    );
    let (dcq, dck) = (stream.clone_htod(&cu_q).unwrap(), stream.clone_htod(&cu_k).unwrap());
    let mut o = stream.alloc_zeros::<bf16>(tq * hq * d).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(tq * hq).unwrap();
    let heads = AttentionHeads {
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
        causal,
        softmax_scale: None,
    };
    let seqs = Sequences::Varlen {
        cu_seqlens_q: &dcq,
        cu_seqlens_k: &dck,
        batch: lens.len(),
        max_seqlen_q: lens.iter().map(|l| l.0).max().unwrap().max(1),
        total_q: tq,
        total_k: tk,
    };
    let t = AttentionTensors {
        q: &dq,
        k: &dk,
        v: &dv,
        o: &mut o,
        lse: Some(&mut lse),
    };
    flash_attention(dev, &stream, heads, t, seqs).unwrap();
    let (go, gl) = (stream.clone_dtoh(&o).unwrap(), stream.clone_dtoh(&lse).unwrap());
    let cpu_seqs: Vec<Seq> = (0..lens.len())
        .map(|b| Seq {
            q_start: cu_q[b] as usize,
            q_len: lens[b].0,
            k_start: cu_k[b] as usize,
            k_len: lens[b].1,
        })
        .collect();
    let (want_o, want_lse) = cpu_attention(&q, &k, &v, &cpu_seqs, tq, hq, hkv, d, causal, heads.scale() as f64);
    let (wo, wl, mo, ml, first) = compare(&go, &gl, &want_o, &want_lse);
    let line = format!(
        "varlen {lens:?} Hq={hq} Hkv={hkv} D={d} causal={causal}: wrong O {wo} / {}, LSE {wl} / {}, max |err| O {mo:.2e} LSE {ml:.2e}",
        go.len(),
        gl.len()
    );
    assert!(wo == 0 && wl == 0, "{line}; first: {first}");
    line
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn varlen_attention_matches_cpu_reference() {
    let Some(dev) = device_or_skip("varlen_attention_matches_cpu_reference") else {
        return;
    };
    let lens = [(1, 1), (130, 257), (0, 5), (300, 300), (64, 0), (513, 200), (129, 129)];
    for (i, (d, causal)) in [(64, false), (64, true), (128, false), (128, true)]
        .into_iter()
        .enumerate()
    {
        println!("{}", run_varlen(&dev, &lens, 4, 2, d, causal, 500 + 3 * i as u64));
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn attention_replays_in_a_cuda_graph() {
    use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(dev) = device_or_skip("attention_replays_in_a_cuda_graph") else {
        return;
    };
    let stream = dev.context().new_stream().unwrap();
    let (b, s, hq, hkv, d) = (2, 777, 4, 2, 128);
    let q = stream.clone_htod(&random_bf16(b * s * hq * d, 7)).unwrap();
    let k = stream.clone_htod(&random_bf16(b * s * hkv * d, 8)).unwrap();
    let v = stream.clone_htod(&random_bf16(b * s * hkv * d, 9)).unwrap();
    let heads = AttentionHeads {
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
        causal: true,
        softmax_scale: None,
    };
    let seqs = Sequences::Batched {
        batch: b,
        seqlen_q: s,
        seqlen_k: s,
    };
    let plan = FlashAttentionPlan::new(&dev, heads).unwrap();
    // The direct launches, on the first Q and on a second one.
    let q2 = stream.clone_htod(&random_bf16(b * s * hq * d, 10)).unwrap();
    let mut want = vec![];
    for qi in [&q, &q2] {
        let mut o_ref = stream.alloc_zeros::<bf16>(b * s * hq * d).unwrap();
        let mut lse_ref = stream.alloc_zeros::<f32>(b * s * hq).unwrap();
        let t = AttentionTensors {
            q: qi,
            k: &k,
            v: &v,
            o: &mut o_ref,
            lse: Some(&mut lse_ref),
        };
        plan.launch(&stream, t, seqs).unwrap();
        want.push((stream.clone_dtoh(&o_ref).unwrap(), stream.clone_dtoh(&lse_ref).unwrap()));
    }
    // One capture on a Q buffer that each replay's input is copied into; the plan is dropped
    // right after the capture (the graph holds its own copy of the launch's parameter block).
    let mut q_in = stream.alloc_zeros::<bf16>(b * s * hq * d).unwrap();
    let mut o = stream.alloc_zeros::<bf16>(b * s * hq * d).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(b * s * hq).unwrap();
    stream.synchronize().unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    // The safe launch refuses a capturing stream (the graph would outlive its borrows) ...
    let t = AttentionTensors {
        q: &q_in,
        k: &k,
        v: &v,
        o: &mut o,
        lse: Some(&mut lse),
    };
    let e = plan.launch(&stream, t, seqs).unwrap_err();
    assert!(matches!(e, Error::Capturing { .. }), "{e}");
    // ... the unsafe one captures, its contract covering the buffers while the graph lives.
    let t = AttentionTensors {
        q: &q_in,
        k: &k,
        v: &v,
        o: &mut o,
        lse: Some(&mut lse),
    };
    // SAFETY: q_in, k, v, o and lse outlive the graph (dropped at the end of the test, after
    // the last replay's results were read on the same stream).
    unsafe { plan.launch_captured(&stream, t, seqs) }.unwrap();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("graph");
    drop(plan);
    for (round, qi) in [&q, &q2, &q, &q2].into_iter().enumerate() {
        stream.memcpy_dtod(qi, &mut q_in).unwrap();
        graph.launch().unwrap();
        let got = (stream.clone_dtoh(&o).unwrap(), stream.clone_dtoh(&lse).unwrap());
        let w = &want[round % 2];
        assert!(
            got.0.iter().zip(&w.0).all(|(a, b)| a.to_bits() == b.to_bits())
                && got.1.iter().zip(&w.1).all(|(a, b)| a.to_bits() == b.to_bits()),
            "graph replay {round} differs from the direct launch on the same input"
        );
    }
    println!("attention captured in a CUDA graph, replayed 4 times on new Q: bitwise equal to the direct launches");
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn bad_attention_input_is_rejected() {
    let Some(dev) = device_or_skip("bad_attention_input_is_rejected") else {
        return;
    };
    let stream = dev.default_stream();
    let n = 2 * 256 * 4 * 128;
    let q = stream.alloc_zeros::<bf16>(n).unwrap();
    let k = stream.alloc_zeros::<bf16>(n).unwrap();
    let v = stream.alloc_zeros::<bf16>(n).unwrap();
    let mut o = stream.alloc_zeros::<bf16>(n).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(2 * 256 * 4).unwrap();
    let heads = |hq: usize, hkv: usize, d: usize| AttentionHeads {
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
        causal: false,
        softmax_scale: None,
    };
    let batched = Sequences::Batched {
        batch: 2,
        seqlen_q: 256,
        seqlen_k: 256,
    };
    let mut err = |seqs: Sequences, h: AttentionHeads| -> String {
        let t = AttentionTensors {
            q: &q,
            k: &k,
            v: &v,
            o: &mut o,
            lse: Some(&mut lse),
        };
        match flash_attention(&dev, &stream, h, t, seqs) {
            Err(e @ (Error::Shape { .. } | Error::BufferTooSmall { .. })) => e.to_string(),
            other => panic!("expected a shape error, got {other:?}"),
        }
    };
    let e = err(batched, heads(4, 4, 96));
    assert!(e.contains("head_dim 96"), "{e}");
    let e = err(batched, heads(4, 3, 128));
    assert!(e.contains("not a multiple of heads_kv"), "{e}");
    let e = err(
        Sequences::Batched {
            batch: 3,
            seqlen_q: 256,
            seqlen_k: 256,
        },
        heads(4, 4, 128),
    );
    assert!(e.contains("holds"), "{e}");
    let cu_ok = stream.clone_htod(&[0i32, 100, 200]).unwrap();
    let cu_short = stream.clone_htod(&[0i32, 100]).unwrap();
    let varlen = |cu_q, cu_k| Sequences::Varlen {
        cu_seqlens_q: cu_q,
        cu_seqlens_k: cu_k,
        batch: 2,
        max_seqlen_q: 100,
        total_q: 200,
        total_k: 200,
    };
    let e = err(varlen(&cu_short, &cu_ok), heads(4, 4, 128));
    assert!(e.contains("cu_seqlens_q holds 2"), "{e}");
    // Tile counts are u32 on the device: a launch past 2^32 tiles is refused on the host.
    // (2^31 - 1 query rows, within the row limit, in 2^24 blocks x 4096 heads = 2^36 tiles.)
    let e = err(
        Sequences::Batched {
            batch: 1,
            seqlen_q: (1 << 31) - 1,
            seqlen_k: 1,
        },
        heads(4096, 4096, 128),
    );
    assert!(e.contains("tiles"), "{e}");
    println!(
        "bad head dim, GQA grouping, short buffers, short cu_seqlens and too many tiles are rejected with clear errors"
    );
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn bad_cu_seqlens_never_write_outside_o_and_lse() {
    let Some(dev) = device_or_skip("bad_cu_seqlens_never_write_outside_o_and_lse") else {
        return;
    };
    let stream = dev.default_stream();
    let (hq, d, rows, canary) = (2, 64, 200, 4096);
    let q = stream.clone_htod(&random_bf16(rows * hq * d, 1)).unwrap();
    let k = stream.clone_htod(&random_bf16(rows * hq * d, 2)).unwrap();
    let v = stream.clone_htod(&random_bf16(rows * hq * d, 3)).unwrap();
    // O and LSE with a canary tail past the rows the launch declares.
    let nan = bf16::from_f32(f32::NAN).to_bits();
    let mut o_full = stream
        .clone_htod(&vec![bf16::from_bits(nan); rows * hq * d + canary])
        .unwrap();
    let mut lse_full = stream.clone_htod(&vec![f32::NAN; rows * hq + canary]).unwrap();
    // Offsets past the rows, decreasing, and a sequence longer than max_seqlen_q.
    let cu_q = stream.clone_htod(&[0i32, 150, 90, 100_000, 7]).unwrap();
    let cu_k = stream.clone_htod(&[0i32, 500, 1 << 30, 20, 200]).unwrap();
    let heads = AttentionHeads {
        heads_q: hq,
        heads_kv: hq,
        head_dim: d,
        causal: true,
        softmax_scale: None,
    };
    {
        let mut o = o_full.slice_mut(..rows * hq * d);
        let mut lse = lse_full.slice_mut(..rows * hq);
        let t = AttentionTensors {
            q: &q,
            k: &k,
            v: &v,
            o: &mut o,
            lse: Some(&mut lse),
        };
        let seqs = Sequences::Varlen {
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
            batch: 4,
            max_seqlen_q: 128,
            total_q: rows,
            total_k: rows,
        };
        flash_attention(&dev, &stream, heads, t, seqs).unwrap();
    }
    let o = stream.clone_dtoh(&o_full).unwrap();
    let lse = stream.clone_dtoh(&lse_full).unwrap();
    assert!(
        o[rows * hq * d..].iter().all(|x| x.to_bits() == nan),
        "O written past its rows"
    );
    assert!(lse[rows * hq..].iter().all(|x| x.is_nan()), "LSE written past its rows");
    println!("bad cu_seqlens (past the rows, decreasing, longer than max_seqlen_q): nothing written outside O and LSE");
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn no_lse_is_written_when_none_is_given() {
    let Some(dev) = device_or_skip("no_lse_is_written_when_none_is_given") else {
        return;
    };
    let stream = dev.default_stream();
    let (b, s, h, d) = (1, 300, 2, 128);
    let q = stream.clone_htod(&random_bf16(b * s * h * d, 4)).unwrap();
    let k = stream.clone_htod(&random_bf16(b * s * h * d, 5)).unwrap();
    let v = stream.clone_htod(&random_bf16(b * s * h * d, 6)).unwrap();
    let heads = AttentionHeads {
        heads_q: h,
        heads_kv: h,
        head_dim: d,
        causal: false,
        softmax_scale: None,
    };
    let seqs = Sequences::Batched {
        batch: b,
        seqlen_q: s,
        seqlen_k: s,
    };
    let plan = FlashAttentionPlan::new(&dev, heads).unwrap();
    let mut o1 = stream.alloc_zeros::<bf16>(b * s * h * d).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(b * s * h).unwrap();
    let mut o2 = stream.alloc_zeros::<bf16>(b * s * h * d).unwrap();
    let t = AttentionTensors {
        q: &q,
        k: &k,
        v: &v,
        o: &mut o1,
        lse: Some(&mut lse),
    };
    plan.launch(&stream, t, seqs).unwrap();
    let t = AttentionTensors {
        q: &q,
        k: &k,
        v: &v,
        o: &mut o2,
        lse: None,
    };
    plan.launch(&stream, t, seqs).unwrap();
    let (a, c) = (stream.clone_dtoh(&o1).unwrap(), stream.clone_dtoh(&o2).unwrap());
    assert!(a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()));
    println!("a launch without LSE writes the same O");
}

/// The scenario of the serving-loop issue: a launch on stream s1 writes O, which was allocated
/// on s0; O is dropped right after the launch is enqueued and s0 allocates a zeroed buffer of
/// the same size (cudarc's stream-ordered allocator returns the freed address). The launch
/// held O's write guard until it was enqueued, so the free waits for the kernel, and the new
/// buffer stays zero.
#[test]
#[ignore = "needs a Hopper GPU"]
fn a_buffer_freed_after_a_launch_on_another_stream_is_not_written() {
    let Some(dev) = device_or_skip("a_buffer_freed_after_a_launch_on_another_stream_is_not_written") else {
        return;
    };
    let s0 = dev.context().new_stream().unwrap();
    let s1 = dev.context().new_stream().unwrap();
    let (b, s, h, d) = (1, 16384, 32, 128);
    let q = s0.clone_htod(&random_bf16(b * s * h * d, 11)).unwrap();
    let k = s0.clone_htod(&random_bf16(b * s * h * d, 12)).unwrap();
    let v = s0.clone_htod(&random_bf16(b * s * h * d, 13)).unwrap();
    let heads = AttentionHeads {
        heads_q: h,
        heads_kv: h,
        head_dim: d,
        causal: false,
        softmax_scale: None,
    };
    let seqs = Sequences::Batched {
        batch: b,
        seqlen_q: s,
        seqlen_k: s,
    };
    let n = b * s * h * d;
    for round in 0..5 {
        s0.synchronize().unwrap();
        let plan = FlashAttentionPlan::new(&dev, heads).unwrap();
        let mut o = s0.alloc_zeros::<bf16>(n).unwrap();
        // The address, read before the launch (a read guard taken afterwards would make s0
        // wait for the kernel and hide what is tested).
        let freed = {
            use mkernel::cudarc::driver::DevicePtr;
            o.device_ptr(&s0).0
        };
        let t = AttentionTensors {
            q: &q,
            k: &k,
            v: &v,
            o: &mut o,
            lse: None,
        };
        plan.launch(&s1, t, seqs).unwrap();
        drop(plan);
        drop(o);
        let fresh = s0.alloc_zeros::<bf16>(n).unwrap();
        let same = {
            use mkernel::cudarc::driver::DevicePtr;
            fresh.device_ptr(&s0).0 == freed
        };
        s1.synchronize().unwrap();
        s0.synchronize().unwrap();
        let host = s0.clone_dtoh(&fresh).unwrap();
        let nonzero = host.iter().filter(|x| x.to_bits() != 0).count();
        println!("round {round}: new allocation at the freed address: {same}; non-zero elements: {nonzero} of {n}");
        assert_eq!(nonzero, 0, "the kernel wrote into memory freed after its launch");
    }
}
