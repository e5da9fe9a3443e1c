//! The cases of the expert-parallel MoE tests (`moe_ep.rs`: separate dispatch; `moe_ep_fused.rs`:
//! the dispatch fused into the up projection): every rank derives every rank's tokens,
//! routing and the full expert weights from seeds, checks where its pairs went and its own
//! output against the CPU reference of the whole layer (tests/src/moe.rs).
use half::bf16;
use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use mkernel::cudarc::driver::CudaStream;
use mkernel::ops::moe::Activation;
use mkernel::ops::moe_ep::{MoeEpPlan, MoeEpShape};
use mkernel::Communicator;
use mkernel_tests::data::random_bf16;
use mkernel_tests::moe::{ep_expected, layer_row, routing_among, skewed_routing, uniform_routing, Dims};
use mkernel_tests::reference::{BF16_OUT_REL, F32_ACC, F32_OUT_REL};
use rayon::prelude::*;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    Uniform,
    Skewed,
    /// Every pair to the last expert (owned by the last rank).
    OneExpert,
}

pub struct Case {
    pub label: &'static str,
    pub shape: MoeEpShape,
    pub routing: Routing,
    pub f32_out: bool,
    /// Launches with fresh routing on the same plan.
    pub launches: usize,
    /// Capture the first launch in a CUDA graph and replay it for every launch.
    pub graph: bool,
    /// The dispatch fused into the up projection (`MoeEpPlan::new_fused`).
    pub fused: bool,
}

fn routing(r: Routing, tokens: usize, experts: usize, top_k: usize, seed: u64) -> (Vec<i32>, Vec<f32>) {
    match r {
        Routing::Uniform => uniform_routing(tokens, experts, top_k, seed),
        Routing::Skewed => skewed_routing(tokens, experts, top_k, seed),
        Routing::OneExpert => routing_among(tokens, &[experts - 1], top_k, seed),
    }
}

/// Runs one case on this rank; returns a log line.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub fn run_case(comm: &Communicator, default_stream: &Arc<CudaStream>, c: &Case, seed: u64) -> String {
    let (rank, world) = (comm.global_rank() as usize, comm.global_world() as usize);
    // A graph is captured on a stream of its own (the default stream cannot be captured),
    // without cudarc's cross-stream event tracking; the case then uses that stream alone.
    let stream = &if c.graph {
        default_stream.synchronize().unwrap();
        let ctx = default_stream.context().clone();
        // SAFETY: from here on every buffer of this process is used on one stream at a time
        // (this case's own stream, then the default stream after it synchronized).
        unsafe { ctx.disable_event_tracking() };
        ctx.new_stream().unwrap()
    } else {
        default_stream.clone()
    };
    let s = c.shape;
    let l = s.local_experts(world);
    let up_rows = s.up_rows();
    let (h, f, k, t) = (s.hidden, s.ffn, s.top_k, s.tokens);
    // The full weights (every rank derives them); this rank uploads its experts' slices.
    let w_up = random_bf16(s.experts * up_rows * h, seed);
    let w_down = random_bf16(s.experts * h * f, seed + 1);
    let d_up = stream
        .clone_htod(&w_up[rank * l * up_rows * h..(rank + 1) * l * up_rows * h])
        .unwrap();
    let d_down = stream
        .clone_htod(&w_down[rank * l * h * f..(rank + 1) * l * h * f])
        .unwrap();
    let mut plan = if c.fused {
        MoeEpPlan::new_fused(comm, stream, s, &d_up, &d_down).unwrap()
    } else {
        MoeEpPlan::new(comm, stream, s, &d_up, &d_down).unwrap()
    };
    let cap = plan.capacity_rows();
    let d = Dims {
        tokens: t,
        experts: s.experts,
        top_k: k,
        hidden: h,
        ffn: f,
        swiglu: s.act == Activation::SwiGlu,
    };
    let mut lines = vec![];
    // Launch buffers: the same device buffers every launch (a captured graph reads them).
    let mut dx = stream.alloc_zeros::<bf16>(t * h).unwrap();
    let mut dids = stream.alloc_zeros::<i32>(t * k).unwrap();
    let mut dw = stream.alloc_zeros::<f32>(t * k).unwrap();
    let mut out32 = stream.alloc_zeros::<f32>(t * h).unwrap();
    let mut out16 = stream.alloc_zeros::<bf16>(t * h).unwrap();
    let graph = if c.graph {
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        if c.f32_out {
            plan.launch(stream, &dx, &dids, &dw, &mut out32).unwrap();
        } else {
            plan.launch(stream, &dx, &dids, &dw, &mut out16).unwrap();
        }
        Some(
            stream
                .end_capture(CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("captured graph"),
        )
    } else {
        None
    };
    for launch in 0..c.launches {
        let lseed = seed + 1000 * (launch as u64 + 1);
        let all: Vec<(Vec<i32>, Vec<f32>)> = (0..world)
            .map(|r| routing(c.routing, t, s.experts, k, lseed + r as u64))
            .collect();
        let all_ids: Vec<Vec<i32>> = all.iter().map(|(i, _)| i.clone()).collect();
        let (ids, wts) = &all[rank];
        let x = random_bf16(t * h, lseed + 100 + rank as u64);
        stream.memcpy_htod(&x, &mut dx).unwrap();
        stream.memcpy_htod(ids, &mut dids).unwrap();
        stream.memcpy_htod(wts, &mut dw).unwrap();
        match (&graph, c.f32_out) {
            (Some(g), _) => g.launch().unwrap(),
            (None, true) => plan.launch(stream, &dx, &dids, &dw, &mut out32).unwrap(),
            (None, false) => plan.launch(stream, &dx, &dids, &dw, &mut out16).unwrap(),
        }
        plan.check(stream).unwrap();
        let got: Vec<f64> = if c.f32_out {
            stream.clone_dtoh(&out32).unwrap().iter().map(|&v| v as f64).collect()
        } else {
            stream.clone_dtoh(&out16).unwrap().iter().map(|v| v.to_f64()).collect()
        };
        let label = format!(
            "{}{} (launch {launch})",
            c.label,
            if c.fused { ", fused dispatch" } else { "" }
        );
        // Routing: drops as expected, every pair in its range of its owner's rows, once.
        let exp = ep_expected(&all_ids, s.experts, world, cap);
        let (sent, received, ranges) = (&exp[rank].sent, &exp[rank].received, &exp[rank].ranges);
        let drops = plan.drops(stream).unwrap();
        assert_eq!((drops.sent, drops.received), (*sent, *received), "{label}: drops");
        let g = plan.inspect(stream).unwrap();
        let mut seen = std::collections::HashSet::new();
        for (p, &row) in g.pos.iter().enumerate() {
            let e = ids[p] as usize;
            let (lo, hi) = ranges[e];
            if row == u32::MAX {
                continue;
            }
            assert!(
                row >= lo && row < hi && row < cap as u32,
                "{label}: pair {p} (expert {e}) at row {row}, outside {lo}..{hi}"
            );
            assert!(
                seen.insert((e / l, row)),
                "{label}: row {row} of rank {} given twice",
                e / l
            );
        }
        let kept_pairs = g.pos.iter().filter(|&&r| r != u32::MAX).count();
        assert_eq!(kept_pairs + *sent as usize, t * k, "{label}: pairs kept + dropped");
        // Output against the reference over the kept pairs.
        let rel = if c.f32_out { F32_OUT_REL } else { BF16_OUT_REL };
        let pos = &g.pos;
        let wrong: Vec<(usize, f64, f64, f64)> = (0..t)
            .into_par_iter()
            .flat_map_iter(|tok| {
                let want = layer_row(
                    &x,
                    &w_up,
                    &w_down,
                    d,
                    tok,
                    ids,
                    wts,
                    |j| pos[tok * k + j] != u32::MAX,
                    rel,
                    F32_ACC,
                );
                let got = &got[tok * h..(tok + 1) * h];
                want.into_iter()
                    .zip(got.iter())
                    .enumerate()
                    // Written so that a NaN counts as wrong.
                    .filter(|(_, ((v, tol), g))| !((**g - v).abs() <= *tol))
                    .map(move |(col, ((v, tol), g))| (tok * h + col, *g, v, tol))
                    .collect::<Vec<_>>()
            })
            .collect();
        if let Some(&(i, g, v, tol)) = wrong.first() {
            panic!(
                "{label}: rank {rank}: {} wrong outputs; out[{}][{}] = {g}, want {v} +- {tol}",
                wrong.len(),
                i / h,
                i % h
            );
        }
        let max_err = got.iter().fold(0f64, |m, v| m.max(v.abs()));
        lines.push(format!(
            "rank {rank}/{world} moe_ep {label}: T={t}/rank E={} k={k} H={h} F={f} cap={cap}: correct (max |out| {max_err:.3}), drops sent {sent} received {received}, rows in use here {}",
            s.experts,
            g.offsets[l]
        ));
    }
    stream.synchronize().unwrap();
    lines.join("\n")
}

/// A shape of the tests (H = 256, F = 128).
pub fn shape(tokens: usize, experts: usize, top_k: usize, act: Activation, capacity: Option<usize>) -> MoeEpShape {
    MoeEpShape {
        tokens,
        experts,
        top_k,
        hidden: 256,
        ffn: 128,
        act,
        capacity,
    }
}

/// The cases of the test at `world` ranks.
pub fn cases(world: usize, fused: bool) -> Vec<Case> {
    const SW: Activation = Activation::SwiGlu;
    vec![
        Case {
            label: "uniform top-4, 2 launches",
            shape: shape(96, 4 * world, 4, SW, None),
            routing: Routing::Uniform,
            f32_out: true,
            launches: 2,
            graph: false,
            fused,
        },
        Case {
            label: "skewed top-2",
            shape: shape(130, 8 * world, 2, SW, None),
            routing: Routing::Skewed,
            f32_out: true,
            launches: 1,
            graph: false,
            fused,
        },
        Case {
            label: "all tokens to one expert, top-1, bf16 out",
            shape: shape(200, 2 * world, 1, SW, None),
            routing: Routing::OneExpert,
            f32_out: false,
            launches: 1,
            graph: false,
            fused,
        },
        Case {
            label: "top-8, no activation",
            shape: shape(64, 4 * world, 8, Activation::None, None),
            routing: Routing::Uniform,
            f32_out: true,
            launches: 1,
            graph: false,
            fused,
        },
        Case {
            label: "capacity 128 rows, skewed top-4 (drops)",
            shape: shape(96, 4 * world, 4, SW, Some(128)),
            routing: Routing::Skewed,
            f32_out: true,
            launches: 2,
            graph: false,
            fused,
        },
        Case {
            label: "CUDA graph replayed with new routing (uniform, then new x, ids, weights)",
            shape: shape(100, 4 * world, 4, SW, None),
            routing: Routing::Uniform,
            f32_out: true,
            launches: 3,
            graph: true,
            fused,
        },
    ]
}
