//! MoE expert FFN on one GPU against the CPU reference (tests/src/moe.rs): uniform, skewed,
//! one hot expert, empty experts, top-1 and top-8, token counts that are not multiples of the
//! tile, no activation, f32 output, a CUDA graph replayed with new routing, and out-of-range
//! expert ids (an error, no stray write); each with the combine after the down projection
//! (`MoeCombine::Ordered`) and in its epilogue (`MoeCombine::Epilogue`).
// A NaN must fail the tolerance checks, so they are written as negated `<=` comparisons.
#![allow(clippy::neg_cmp_op_on_partial_ord)]
use half::bf16;
use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use mkernel::cudarc::driver::{CudaSlice, CudaStream};
use mkernel::ops::moe::{padded_offsets, Activation, GroupedGemmPlan, GroupedGemmShape, MoeCombine, MoePlan, MoeShape};
use mkernel::{Device, Error};
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::device_or_skip;
use mkernel_tests::moe::{output, routing_among, skewed_routing, uniform_routing, up_row, Dims};
use mkernel_tests::reference::{BF16_OUT_REL, F32_ACC, F32_OUT_REL};
use rayon::prelude::*;
use std::sync::Arc;

fn dims(s: MoeShape) -> Dims {
    Dims {
        tokens: s.tokens,
        experts: s.experts,
        top_k: s.top_k,
        hidden: s.hidden,
        ffn: s.ffn,
        swiglu: s.act == Activation::SwiGlu,
    }
}

fn shape(tokens: usize, experts: usize, top_k: usize, hidden: usize, ffn: usize, act: Activation) -> MoeShape {
    MoeShape {
        tokens,
        experts,
        top_k,
        hidden,
        ffn,
        act,
    }
}

struct Weights {
    w_up: Vec<bf16>,
    w_down: Vec<bf16>,
    d_up: CudaSlice<bf16>,
    d_down: CudaSlice<bf16>,
}

fn weights(stream: &Arc<CudaStream>, s: MoeShape, seed: u64) -> Weights {
    let (lu, ld) = s.weight_lens();
    let (w_up, w_down) = (random_bf16(lu, seed), random_bf16(ld, seed + 1));
    Weights {
        d_up: stream.clone_htod(&w_up).unwrap(),
        d_down: stream.clone_htod(&w_down).unwrap(),
        w_up,
        w_down,
    }
}

/// Checks the routing the GPU made (counts, padded offsets, slots), the grouped activations
/// and the output against the CPU; returns a log line.
#[allow(clippy::too_many_arguments)]
fn check(
    label: &str,
    plan: &MoePlan,
    stream: &Arc<CudaStream>,
    w: &Weights,
    x: &[bf16],
    ids: &[i32],
    wts: &[f32],
    got: &[f64],
    out_rel: f64,
) -> String {
    let s = plan.shape();
    let d = dims(s);
    let g = plan.inspect(stream).unwrap();
    // Routing: counts, 128-row padded offsets, every routed pair in its expert's group once.
    let mut counts = vec![0u32; s.experts];
    for &e in ids {
        if e >= 0 && (e as usize) < s.experts {
            counts[e as usize] += 1;
        }
    }
    assert_eq!(g.counts, counts, "{label}: counts");
    let mut off = 0u32;
    for (e, c) in counts.iter().enumerate() {
        assert_eq!(g.offsets[e], off, "{label}: offset of expert {e}");
        off += c.div_ceil(128) * 128;
    }
    assert_eq!(g.offsets[s.experts], off, "{label}: rows in use");
    let mut seen = vec![false; s.capacity_rows()];
    for (p, &slot) in g.slots.iter().enumerate() {
        let e = ids[p];
        if e < 0 || e as usize >= s.experts {
            assert_eq!(slot, u32::MAX, "{label}: pair {p} with bad id {e} got a slot");
            continue;
        }
        let e = e as usize;
        assert!(
            slot >= g.offsets[e] && slot < g.offsets[e] + counts[e],
            "{label}: pair {p} slot {slot} outside expert {e}'s rows"
        );
        assert!(!seen[slot as usize], "{label}: slot {slot} given twice");
        seen[slot as usize] = true;
    }
    // Grouped activations of every routed pair.
    let wrong_up: usize = (0..s.pairs())
        .into_par_iter()
        .map(|p| {
            let slot = g.slots[p];
            if slot == u32::MAX {
                return 0;
            }
            let want = up_row(x, &w.w_up, d, p / s.top_k, ids[p] as usize, F32_ACC);
            let row = &g.hidden_act[slot as usize * s.ffn..(slot as usize + 1) * s.ffn];
            let bad = want
                .iter()
                .zip(row)
                .filter(|((v, tol), got)| !((got.to_f64() - v).abs() <= *tol))
                .count();
            if bad > 0 {
                let (c, ((v, tol), got)) = want
                    .iter()
                    .zip(row)
                    .enumerate()
                    .find(|(_, ((v, tol), got))| !((got.to_f64() - v).abs() <= *tol))
                    .unwrap();
                eprintln!("{label}: pair {p} slot {slot} column {c}: got {got}, want {v} +- {tol}");
            }
            bad
        })
        .sum();
    assert_eq!(wrong_up, 0, "{label}: wrong activations");
    // Output from the GPU's activations.
    // The epilogue combine adds the f32 accumulators: no bf16 rounding of the down rows.
    let rounded = plan.combine() == MoeCombine::Ordered;
    let want = output(
        &g.hidden_act,
        &g.slots,
        ids,
        wts,
        &w.w_down,
        d,
        out_rel,
        F32_ACC,
        rounded,
    );
    let mut wrong = 0;
    let mut max_err = 0f64;
    for (i, (&got, &(v, tol))) in got.iter().zip(&want).enumerate() {
        let err = (got - v).abs();
        max_err = max_err.max(err);
        if !(err <= tol) {
            if wrong == 0 {
                eprintln!(
                    "{label}: out[{}][{}] = {got}, want {v} +- {tol}",
                    i / s.hidden,
                    i % s.hidden
                );
            }
            wrong += 1;
        }
    }
    assert_eq!(wrong, 0, "{label}: {wrong} wrong outputs");
    let hot = counts.iter().max().unwrap();
    let empty = counts.iter().filter(|&&c| c == 0).count();
    format!(
        "moe {label}: T={} E={} k={} H={} F={} {:?}: rows {} (hottest expert {hot}, {empty} empty), correct, max |err| {max_err:.3e}",
        s.tokens, s.experts, s.top_k, s.hidden, s.ffn, s.act, off
    )
}

/// Both combines, each test runs with each.
const COMBINES: [MoeCombine; 2] = [MoeCombine::Ordered, MoeCombine::Epilogue];

/// Plans (with `combine`), launches once on `ids`, checks everything; the output in bf16 (or f32).
#[allow(clippy::too_many_arguments)]
fn run_case(
    dev: &Device,
    label: &str,
    s: MoeShape,
    ids: &[i32],
    wts: &[f32],
    seed: u64,
    f32_out: bool,
    combine: MoeCombine,
) -> String {
    let stream = dev.default_stream();
    let w = weights(&stream, s, seed);
    let x = random_bf16(s.tokens * s.hidden, seed + 7);
    let dx = stream.clone_htod(&x).unwrap();
    let dids = stream.clone_htod(ids).unwrap();
    let dw = stream.clone_htod(wts).unwrap();
    let mut plan = MoePlan::new(dev, &stream, s, &w.d_up, &w.d_down, None)
        .unwrap()
        .with_combine(&stream, combine)
        .unwrap();
    let label = format!("{label}, {combine:?} combine");
    let label = label.as_str();
    let got: Vec<f64> = if f32_out {
        // Garbage in the output first: the epilogue combine must zero it itself.
        let mut out = stream.clone_htod(&vec![f32::NAN; s.tokens * s.hidden]).unwrap();
        plan.launch(&stream, &dx, &dids, &dw, &mut out).unwrap();
        stream.clone_dtoh(&out).unwrap().iter().map(|&v| v as f64).collect()
    } else {
        let mut out = stream.alloc_zeros::<bf16>(s.tokens * s.hidden).unwrap();
        plan.launch(&stream, &dx, &dids, &dw, &mut out).unwrap();
        stream.clone_dtoh(&out).unwrap().iter().map(|v| v.to_f64()).collect()
    };
    plan.take_error(&stream).unwrap();
    let rel = if f32_out { F32_OUT_REL } else { BF16_OUT_REL };
    check(label, &plan, &stream, &w, &x, ids, wts, &got, rel)
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn moe_matches_cpu_reference() {
    let Some(dev) = device_or_skip("moe_matches_cpu_reference") else {
        return;
    };
    use Activation::*;
    // (label, shape, routing)
    type Case = (&'static str, MoeShape, (Vec<i32>, Vec<f32>), bool);
    let cases: Vec<Case> = vec![
        (
            "uniform",
            shape(256, 16, 4, 256, 128, SwiGlu),
            uniform_routing(256, 16, 4, 1),
            false,
        ),
        (
            "skewed, T=300",
            shape(300, 8, 2, 192, 256, SwiGlu),
            skewed_routing(300, 8, 2, 2),
            false,
        ),
        (
            "all to one expert, top-1",
            shape(200, 8, 1, 512, 384, SwiGlu),
            (vec![3; 200], vec![1.0; 200]),
            false,
        ),
        (
            "empty experts",
            shape(160, 32, 2, 128, 64, SwiGlu),
            routing_among(160, &[0, 5, 31], 2, 4),
            false,
        ),
        (
            "top-8, T=130, F=200",
            shape(130, 64, 8, 256, 200, SwiGlu),
            uniform_routing(130, 64, 8, 5),
            false,
        ),
        (
            "no activation, N tails",
            shape(257, 4, 2, 264, 136, None),
            skewed_routing(257, 4, 2, 6),
            false,
        ),
        (
            "f32 out, many tiles per expert",
            shape(600, 4, 2, 1024, 512, SwiGlu),
            uniform_routing(600, 4, 2, 7),
            true,
        ),
        (
            "one token",
            shape(1, 64, 8, 64, 64, SwiGlu),
            uniform_routing(1, 64, 8, 8),
            false,
        ),
    ];
    for (i, (label, s, (ids, wts), f32_out)) in cases.into_iter().enumerate() {
        for c in COMBINES {
            println!(
                "{}",
                run_case(&dev, label, s, &ids, &wts, 100 + 10 * i as u64, f32_out, c)
            );
        }
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn moe_graph_replays_with_new_routing() {
    let Some(dev) = device_or_skip("moe_graph_replays_with_new_routing") else {
        return;
    };
    let ctx = dev.context().clone();
    // One stream only: no cross-stream event tracking inside the capture.
    // SAFETY: this test's buffers are used on `stream` alone.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let s = shape(333, 16, 4, 256, 192, Activation::SwiGlu);
    let w = weights(&stream, s, 40);
    let x = random_bf16(s.tokens * s.hidden, 41);
    let dx = stream.clone_htod(&x).unwrap();
    let (ids_a, w_a) = uniform_routing(s.tokens, s.experts, s.top_k, 42);
    let (ids_b, w_b) = skewed_routing(s.tokens, s.experts, s.top_k, 43);
    let mut dids = stream.clone_htod(&ids_a).unwrap();
    let mut dw = stream.clone_htod(&w_a).unwrap();
    let mut out = stream.alloc_zeros::<bf16>(s.tokens * s.hidden).unwrap();
    for combine in COMBINES {
        let mut plan = MoePlan::new(&dev, &stream, s, &w.d_up, &w.d_down, None)
            .unwrap()
            .with_combine(&stream, combine)
            .unwrap();
        stream.synchronize().unwrap();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        plan.launch(&stream, &dx, &dids, &dw, &mut out).unwrap();
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured graph");
        for (label, ids, wts) in [("graph, routing A", &ids_a, &w_a), ("graph, routing B", &ids_b, &w_b)] {
            stream.memcpy_htod(ids, &mut dids).unwrap();
            stream.memcpy_htod(wts, &mut dw).unwrap();
            graph.launch().unwrap();
            stream.synchronize().unwrap();
            let got: Vec<f64> = stream.clone_dtoh(&out).unwrap().iter().map(|v| v.to_f64()).collect();
            plan.take_error(&stream).unwrap();
            let label = format!("{label}, {combine:?} combine");
            println!(
                "{}",
                check(&label, &plan, &stream, &w, &x, ids, wts, &got, BF16_OUT_REL)
            );
        }
        drop(graph);
    }
    // SAFETY: restores the default for the other tests.
    unsafe { ctx.enable_event_tracking() };
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn moe_out_of_range_expert_is_an_error() {
    let Some(dev) = device_or_skip("moe_out_of_range_expert_is_an_error") else {
        return;
    };
    let stream = dev.default_stream();
    let s = shape(150, 8, 2, 128, 64, Activation::SwiGlu);
    let w = weights(&stream, s, 60);
    let x = random_bf16(s.tokens * s.hidden, 61);
    let (mut ids, wts) = uniform_routing(s.tokens, s.experts, s.top_k, 62);
    ids[7] = 8; // token 3, k = 1: one past the last expert
    ids[100] = -1;
    ids[299] = i32::MAX;
    let dx = stream.clone_htod(&x).unwrap();
    let dids = stream.clone_htod(&ids).unwrap();
    let dw = stream.clone_htod(&wts).unwrap();
    let mut out = stream.alloc_zeros::<bf16>(s.tokens * s.hidden).unwrap();
    let mut plan = MoePlan::new(&dev, &stream, s, &w.d_up, &w.d_down, None).unwrap();
    for combine in COMBINES {
        plan = plan.with_combine(&stream, combine).unwrap();
        plan.launch(&stream, &dx, &dids, &dw, &mut out).unwrap();
        let err = plan.take_error(&stream).unwrap_err();
        println!("moe bad ids, {combine:?} combine: {err}");
        match err {
            Error::MoeExpertId { experts, bad, id, .. } => {
                assert_eq!(experts, 8);
                assert_eq!(bad, 3);
                assert!([8, -1, i32::MAX].contains(&id));
            }
            other => panic!("expected MoeExpertId, got {other}"),
        }
        // The bad pairs add nothing; every other pair is right; the record was cleared.
        let got: Vec<f64> = stream.clone_dtoh(&out).unwrap().iter().map(|v| v.to_f64()).collect();
        let label = format!("bad ids, {combine:?} combine");
        println!(
            "{}",
            check(&label, &plan, &stream, &w, &x, &ids, &wts, &got, BF16_OUT_REL)
        );
        plan.take_error(&stream).unwrap();
    }
    // Wrong lengths are rejected before any launch.
    let short = stream.clone_htod(&ids[..10]).unwrap();
    let e = plan
        .launch(&stream, &dx, &short, &dw, &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("ids holds 10"), "{e}");
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn grouped_gemm_alone_matches_cpu_reference() {
    let Some(dev) = device_or_skip("grouped_gemm_alone_matches_cpu_reference") else {
        return;
    };
    let stream = dev.default_stream();
    let counts: Vec<u32> = vec![300, 0, 5, 128, 129, 1];
    let off = padded_offsets(&counts).unwrap();
    let used = *off.last().unwrap() as usize;
    for (act, n, k) in [(Activation::SwiGlu, 200, 264), (Activation::None, 136, 512)] {
        let s = GroupedGemmShape {
            groups: counts.len(),
            capacity_rows: used + 128,
            n,
            k,
            act,
        };
        let a = random_bf16(s.capacity_rows * k, 70);
        let w = random_bf16(s.groups * s.w_rows() * k, 71);
        let (da, dw) = (stream.clone_htod(&a).unwrap(), stream.clone_htod(&w).unwrap());
        let dn = stream.clone_htod(&counts).unwrap();
        let mut dc = stream.alloc_zeros::<bf16>(s.capacity_rows * n).unwrap();
        let mut plan = GroupedGemmPlan::new(&dev, &stream, s, &da, &dw, &mut dc, &dn, None).unwrap();
        plan.launch(&stream).unwrap();
        plan.take_error(&stream).unwrap();
        let dev_off = stream.clone_dtoh(&plan.offsets()).unwrap();
        assert_eq!(dev_off, off, "device offsets");
        drop(plan);
        let c = stream.clone_dtoh(&dc).unwrap();
        let d = Dims {
            tokens: s.capacity_rows,
            experts: s.groups,
            top_k: 1,
            hidden: k,
            ffn: n,
            swiglu: act == Activation::SwiGlu,
        };
        let mut wrong = 0;
        for (g, &cnt) in counts.iter().enumerate() {
            for r in 0..cnt as usize {
                let row = off[g] as usize + r;
                let want = up_row(&a, &w, d, row, g, F32_ACC);
                for (col, (v, tol)) in want.iter().enumerate() {
                    let got = c[row * n + col].to_f64();
                    if !((got - v).abs() <= *tol) {
                        if wrong == 0 {
                            eprintln!("group {g} row {r} col {col}: got {got}, want {v} +- {tol}");
                        }
                        wrong += 1;
                    }
                }
            }
        }
        assert_eq!(wrong, 0, "grouped gemm {act:?}");
        println!("grouped gemm alone {act:?}: groups {counts:?}, n={n} k={k}: correct");
    }
    // Capacity too small for the padded groups: an error, nothing written past C.
    let s = GroupedGemmShape {
        groups: counts.len(),
        capacity_rows: 512,
        n: 64,
        k: 64,
        act: Activation::None,
    };
    let da = stream.alloc_zeros::<bf16>(512 * 64).unwrap();
    let dw = stream.alloc_zeros::<bf16>(s.groups * 64 * 64).unwrap();
    let dn = stream.clone_htod(&counts).unwrap();
    let mut dc = stream.alloc_zeros::<bf16>(512 * 64).unwrap();
    let mut plan = GroupedGemmPlan::new(&dev, &stream, s, &da, &dw, &mut dc, &dn, None).unwrap();
    plan.launch(&stream).unwrap();
    let e = plan.take_error(&stream).unwrap_err().to_string();
    assert!(e.contains("exceed capacity_rows"), "{e}");
    println!("grouped gemm alone, capacity too small: {e}");
}

/// One plan launched alternately on two streams (inputs of two routings): each output is
/// bitwise the one the plan gives alone on one stream (the ordered combine is reproducible).
/// The plan's launches share its grouped buffers; it orders them itself (an event between
/// streams), so they never overlap on the device.
#[test]
#[ignore = "needs a Hopper GPU"]
fn moe_launches_on_two_streams_do_not_overlap() {
    let Some(dev) = device_or_skip("moe_launches_on_two_streams_do_not_overlap") else {
        return;
    };
    let ctx = dev.context().clone();
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let s = shape(4096, 16, 4, 512, 256, Activation::SwiGlu);
    let w = weights(&s1, s, 60);
    let x = [
        random_bf16(s.tokens * s.hidden, 61),
        random_bf16(s.tokens * s.hidden, 62),
    ];
    let routes = [
        uniform_routing(s.tokens, s.experts, s.top_k, 63),
        skewed_routing(s.tokens, s.experts, s.top_k, 64),
    ];
    let dx: Vec<_> = x.iter().map(|x| s1.clone_htod(x).unwrap()).collect();
    let dids: Vec<_> = routes.iter().map(|r| s1.clone_htod(&r.0).unwrap()).collect();
    let dw: Vec<_> = routes.iter().map(|r| s1.clone_htod(&r.1).unwrap()).collect();
    let mut plan = MoePlan::new(&dev, &s1, s, &w.d_up, &w.d_down, None)
        .unwrap()
        .with_combine(&s1, MoeCombine::Ordered)
        .unwrap();
    // Alone, one after the other on one stream.
    let mut want = vec![];
    for i in 0..2 {
        let mut out = s1.alloc_zeros::<bf16>(s.tokens * s.hidden).unwrap();
        plan.launch(&s1, &dx[i], &dids[i], &dw[i], &mut out).unwrap();
        want.push(s1.clone_dtoh(&out).unwrap());
    }
    plan.take_error(&s1).unwrap();
    // Alternating streams, enqueued back to back.
    let streams = [&s1, &s2];
    let mut outs: Vec<_> = streams
        .iter()
        .map(|st| st.alloc_zeros::<bf16>(s.tokens * s.hidden).unwrap())
        .collect();
    for round in 0..8 {
        for i in 0..2 {
            plan.launch(streams[i], &dx[i], &dids[i], &dw[i], &mut outs[i]).unwrap();
        }
        s1.synchronize().unwrap();
        s2.synchronize().unwrap();
        for i in 0..2 {
            let got = streams[i].clone_dtoh(&outs[i]).unwrap();
            let bad = got
                .iter()
                .zip(&want[i])
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                bad, 0,
                "round {round}, stream {i}: {bad} outputs differ from the plan alone"
            );
        }
    }
    plan.take_error(&s1).unwrap();
    println!("8 rounds of launches alternating between two streams: outputs bitwise as alone");
}

/// Streams and buffers of another CUDA context (here a non-primary context on the same GPU)
/// are refused with `Error::ForeignContext` by `MoePlan` and `GroupedGemmPlan`, at plan time
/// and at launch, before anything is enqueued.
#[test]
#[ignore = "needs a Hopper GPU"]
fn moe_and_grouped_gemm_refuse_another_context() {
    let Some(dev) = device_or_skip("moe_and_grouped_gemm_refuse_another_context") else {
        return;
    };
    let foreign = mkernel::cudarc::driver::CudaContext::new_non_primary(dev.ordinal(), 0).unwrap();
    let fstream = foreign.new_stream().unwrap();
    let stream = dev.default_stream();
    // cuCtxCreate made the new context current: back to the device's.
    dev.context().bind_to_thread().unwrap();
    let foreign_err = |r: mkernel::Result<()>, what: &str| match r {
        Err(Error::ForeignContext { .. }) => {}
        other => panic!("{what}: expected ForeignContext, got {other:?}"),
    };
    let s = shape(256, 8, 2, 256, 128, Activation::SwiGlu);
    let w = weights(&stream, s, 70);
    let (lu, _) = s.weight_lens();
    let f_up = fstream.alloc_zeros::<bf16>(lu).unwrap();
    foreign_err(
        MoePlan::new(&dev, &stream, s, &f_up, &w.d_down, None).map(|_| ()),
        "MoePlan::new, foreign W_up",
    );
    foreign_err(
        MoePlan::new(&dev, &fstream, s, &w.d_up, &w.d_down, None).map(|_| ()),
        "MoePlan::new, foreign stream",
    );
    let plan = MoePlan::new(&dev, &stream, s, &w.d_up, &w.d_down, None).unwrap();
    let (ids, wts) = uniform_routing(s.tokens, s.experts, s.top_k, 71);
    let dx = stream.clone_htod(&random_bf16(s.tokens * s.hidden, 72)).unwrap();
    let (dids, dw) = (stream.clone_htod(&ids).unwrap(), stream.clone_htod(&wts).unwrap());
    let fx = fstream.alloc_zeros::<bf16>(s.tokens * s.hidden).unwrap();
    let mut out = stream.alloc_zeros::<bf16>(s.tokens * s.hidden).unwrap();
    let mut fout = fstream.alloc_zeros::<bf16>(s.tokens * s.hidden).unwrap();
    foreign_err(
        plan.launch(&stream, &fx, &dids, &dw, &mut out),
        "MoePlan::launch, foreign x",
    );
    foreign_err(
        plan.launch(&stream, &dx, &dids, &dw, &mut fout),
        "MoePlan::launch, foreign out",
    );
    foreign_err(
        plan.launch(&fstream, &dx, &dids, &dw, &mut out),
        "MoePlan::launch, foreign stream",
    );
    plan.launch(&stream, &dx, &dids, &dw, &mut out).unwrap();
    stream.synchronize().unwrap();

    let g = GroupedGemmShape {
        groups: 2,
        capacity_rows: 256,
        n: 128,
        k: 128,
        act: Activation::None,
    };
    let a = stream.alloc_zeros::<bf16>(256 * 128).unwrap();
    let fa = fstream.alloc_zeros::<bf16>(256 * 128).unwrap();
    let wg = stream.alloc_zeros::<bf16>(2 * 128 * 128).unwrap();
    let mut c = stream.alloc_zeros::<bf16>(256 * 128).unwrap();
    let counts = stream.clone_htod(&[100u32, 20]).unwrap();
    foreign_err(
        GroupedGemmPlan::new(&dev, &stream, g, &fa, &wg, &mut c, &counts, None).map(|_| ()),
        "GroupedGemmPlan::new, foreign A",
    );
    let gp = GroupedGemmPlan::new(&dev, &stream, g, &a, &wg, &mut c, &counts, None).unwrap();
    foreign_err(gp.launch(&fstream), "GroupedGemmPlan::launch, foreign stream");
    gp.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    println!("foreign-context streams and buffers refused by MoePlan and GroupedGemmPlan");
}
