//! Expert-parallel MoE (one process per GPU): every rank owns `E / W` experts and routes its
//! own tokens; the layer dispatches each (token, expert) row to the expert's rank through the
//! symmetric heap, runs the SwiGLU expert FFNs there as grouped GEMMs, and combines the results
//! back at the token's rank. Planned once with this rank's expert weights; every step brings
//! new tokens and a new routing. Each rank checks its output against an f64 CPU layer.
//!
//! Run: `cargo xtask launch -n 2 -- target/release/examples/moe_ep` (`--share-gpu` on one GPU).
mod common;

use common::{check, random_bf16, random_f32, Result, STEPS};
use half::bf16;
use mkernel::ops::moe::Activation;
use mkernel::ops::moe_ep::{MoeEpPlan, MoeEpShape};
use mkernel::{CommConfig, Communicator};

const TOKENS: usize = 128; // per rank
const EXPERTS_PER_RANK: usize = 2;
const TOP_K: usize = 2;
const HIDDEN: usize = 256;
const FFN: usize = 256;

fn main() -> std::process::ExitCode {
    common::run("moe_ep", moe_ep)
}

/// Global expert `e`'s weights, the same on every rank: `W_up` (2 FFN x HIDDEN: gate rows, then
/// up rows) and `W_down` (HIDDEN x FFN).
fn expert(e: usize) -> (Vec<bf16>, Vec<bf16>) {
    (
        random_bf16(2 * FFN * HIDDEN, 1000 + e as u64, 1.0 / (HIDDEN as f32).sqrt()),
        random_bf16(HIDDEN * FFN, 2000 + e as u64, 1.0 / (FFN as f32).sqrt()),
    )
}

fn moe_ep() -> Result {
    let (dev, boot) = common::rank()?;
    let (world, nodes) = (boot.info().world_size(), boot.info().nnodes());
    let shape = MoeEpShape {
        tokens: TOKENS,
        experts: EXPERTS_PER_RANK * world,
        top_k: TOP_K,
        hidden: HIDDEN,
        ffn: FFN,
        act: Activation::SwiGlu,
        capacity: None, // receive rows for the worst routing: nothing is ever dropped
    };
    // Heap: what the plan reserves (flags, counts, receive rows, down-projection rows).
    let heap_bytes = MoeEpPlan::heap_bytes(&shape, world, nodes)?;
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
    // This rank's experts, rank x E/W .. (rank + 1) x E/W, stacked.
    let mine: Vec<_> = (rank * EXPERTS_PER_RANK..(rank + 1) * EXPERTS_PER_RANK)
        .map(expert)
        .collect();
    let w_up = stream.clone_htod(&mine.iter().flat_map(|e| e.0.clone()).collect::<Vec<_>>())?;
    let w_down = stream.clone_htod(&mine.iter().flat_map(|e| e.1.clone()).collect::<Vec<_>>())?;
    let all: Vec<_> = (0..shape.experts).map(expert).collect();
    let mut x = stream.alloc_zeros::<bf16>(TOKENS * HIDDEN)?;
    let mut ids = stream.alloc_zeros::<i32>(TOKENS * TOP_K)?;
    let mut weights = stream.alloc_zeros::<f32>(TOKENS * TOP_K)?;
    let mut out = stream.alloc_zeros::<f32>(TOKENS * HIDDEN)?;

    // Plan once (collective: every rank, same shape). `MoeEpPlan::new_fused` fuses the
    // dispatch into the up projection.
    let mut plan = MoeEpPlan::new(&comm, &stream, shape, &w_up, &w_down)?;
    for step in 0..STEPS {
        let seed = 100 * step + rank as u64;
        let x_host = random_bf16(TOKENS * HIDDEN, seed, 1.0);
        let (ids_host, weights_host) = routing(seed, shape.experts);
        stream.memcpy_htod(&x_host, &mut x)?;
        stream.memcpy_htod(&ids_host, &mut ids)?;
        stream.memcpy_htod(&weights_host, &mut weights)?;
        plan.launch(&stream, &x, &ids, &weights, &mut out)?; // every rank, same order
        plan.check(&stream)?; // synchronizes; a timeout names rank, role and peer
        let got = stream.clone_dtoh(&out)?;
        let want = reference(&x_host, &ids_host, &weights_host, &all);
        check(
            &format!("moe_ep step {step}"),
            got.iter().map(|&v| v as f64),
            &want,
            1.0 / 64.0,
        )?;
    }
    Ok(())
}

/// `TOP_K` distinct experts of all ranks per token, and positive weights summing to 1.
fn routing(seed: u64, experts: usize) -> (Vec<i32>, Vec<f32>) {
    let r = random_f32(TOKENS * (TOP_K + 1), seed + 7, 1.0);
    let mut ids = vec![];
    let mut w = vec![];
    for t in 0..TOKENS {
        let first = ((r[t] + 1.0) * 0.5 * experts as f32) as usize % experts;
        let raw: Vec<f32> = (0..TOP_K).map(|j| 1.5 + r[TOKENS + t * TOP_K + j]).collect();
        let sum: f32 = raw.iter().sum();
        for (j, x) in raw.iter().enumerate() {
            ids.push(((first + j) % experts) as i32);
            w.push(x / sum);
        }
    }
    (ids, w)
}

/// `out[t] = sum_j weight[t, j] x W_down[e] (silu(W_gate[e] x_t) * (W_up[e] x_t))`, in f64.
fn reference(x: &[bf16], ids: &[i32], weights: &[f32], experts: &[(Vec<bf16>, Vec<bf16>)]) -> Vec<f64> {
    let (h, f) = (HIDDEN, FFN);
    let dot = |a: &[bf16], b: &[bf16]| a.iter().zip(b).map(|(p, q)| p.to_f64() * q.to_f64()).sum::<f64>();
    let mut out = vec![0.0; TOKENS * h];
    for t in 0..TOKENS {
        let xt = &x[t * h..(t + 1) * h];
        for j in 0..TOP_K {
            let (w_up, w_down) = &experts[ids[t * TOP_K + j] as usize];
            let act: Vec<f64> = (0..f)
                .map(|c| {
                    let (g, u) = (
                        dot(xt, &w_up[c * h..(c + 1) * h]),
                        dot(xt, &w_up[(f + c) * h..(f + c + 1) * h]),
                    );
                    bf16::from_f64(g / (1.0 + (-g).exp()) * u).to_f64() // bf16 between the GEMMs
                })
                .collect();
            for c in 0..h {
                let y: f64 = act
                    .iter()
                    .zip(&w_down[c * f..(c + 1) * f])
                    .map(|(a, w)| a * w.to_f64())
                    .sum();
                out[t * h + c] += weights[t * TOP_K + j] as f64 * y;
            }
        }
    }
    out
}
