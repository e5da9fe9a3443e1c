//! Ring attention (one process per GPU): the sequence is split over the ranks (context
//! parallel); each rank attends its queries over every rank's keys and values, which travel
//! around the ring over NVLink while the kernel computes. New Q, K, V every step; each rank
//! checks its rows against an f64 CPU attention over the whole sequence.
//!
//! Run: `cargo xtask launch -n 2 -- target/release/examples/ring_attention` (`--share-gpu` on
//! one GPU).
mod common;

use common::{check, random_bf16, Result, STEPS};
use half::bf16;
use mkernel::ops::attention::AttentionHeads;
use mkernel::ops::ring_attention::{RingAttentionPlan, RingOptions};
use mkernel::{CommConfig, Communicator};

/// Rows of the sequence on each rank (rank r holds rows r x LOCAL ..; not causal here: causal
/// shards are zigzag chunks, docs/attention.md).
const LOCAL: usize = 256;
const HEADS: AttentionHeads = AttentionHeads {
    heads_q: 2,
    heads_kv: 2,
    head_dim: 64,
    causal: false,
    softmax_scale: None,
};

fn main() -> std::process::ExitCode {
    common::run("ring_attention", ring_attention)
}

fn ring_attention() -> Result {
    let (dev, boot) = common::rank()?;
    // Heap: the plan's workspace (two receive slots of one K and one V shard).
    let ws_bytes = RingAttentionPlan::workspace_bytes(1, LOCAL, &HEADS)?;
    let comm = Communicator::new(
        &dev,
        boot,
        CommConfig {
            heap_bytes: ws_bytes,
            ..Default::default()
        },
    )?;
    let (rank, world) = (comm.global_rank() as usize, comm.global_world() as usize);
    let stream = dev.default_stream();
    let workspace = comm.alloc(ws_bytes)?;
    let (hq, hkv, d) = (HEADS.heads_q, HEADS.heads_kv, HEADS.head_dim);
    let mut q = stream.alloc_zeros::<bf16>(LOCAL * hq * d)?;
    let mut k = stream.alloc_zeros::<bf16>(LOCAL * hkv * d)?;
    let mut v = stream.alloc_zeros::<bf16>(LOCAL * hkv * d)?;
    let mut o = stream.alloc_zeros::<bf16>(LOCAL * hq * d)?;
    let mut lse = stream.alloc_zeros::<f32>(LOCAL * hq)?;

    for step in 0..STEPS {
        // The whole sequence ([rows][heads][d]), the same on every rank; this rank's shard.
        let whole = |heads: usize, seed: u64| random_bf16(world * LOCAL * heads * d, 3 * step + seed, 1.0);
        let (qa, ka, va) = (whole(hq, 0), whole(hkv, 1), whole(hkv, 2));
        let shard = |x: &[bf16], heads: usize| x[rank * LOCAL * heads * d..(rank + 1) * LOCAL * heads * d].to_vec();
        stream.memcpy_htod(&shard(&qa, hq), &mut q)?;
        stream.memcpy_htod(&shard(&ka, hkv), &mut k)?;
        stream.memcpy_htod(&shard(&va, hkv), &mut v)?;
        // RingAttentionPlan borrows its buffers and has no raw-address constructor yet: a plan
        // per step (collective: it checks the shapes with every rank through the store). The
        // workspace is the caller's, so planning again takes no more heap.
        {
            let plan = RingAttentionPlan::new(
                &comm,
                &stream,
                &q,
                &k,
                &v,
                &mut o,
                &mut lse,
                &workspace,
                1,
                LOCAL,
                HEADS,
                RingOptions::default(),
            )?;
            plan.launch(&stream)?;
            stream.synchronize()?;
            comm.check()?;
        }
        let got = stream.clone_dtoh(&o)?;
        let want = reference(&qa, &ka, &va, rank, world);
        check(
            &format!("ring_attention step {step}"),
            got.iter().map(|x| x.to_f64()),
            &want,
            1.0 / 64.0,
        )?;
    }
    Ok(())
}

/// Rows `rank x LOCAL ..` of softmax(Q K^T / sqrt(d)) V over the whole sequence, in f64.
fn reference(q: &[bf16], k: &[bf16], v: &[bf16], rank: usize, world: usize) -> Vec<f64> {
    let (hq, hkv, d) = (HEADS.heads_q, HEADS.heads_kv, HEADS.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let mut o = vec![0.0; LOCAL * hq * d];
    for l in 0..LOCAL {
        let i = rank * LOCAL + l;
        for h in 0..hq {
            let hk = h / (hq / hkv);
            let kv = |j: usize| (j * hkv + hk) * d;
            let qi = (i * hq + h) * d;
            let scores: Vec<f64> = (0..world * LOCAL)
                .map(|j| scale * (0..d).map(|x| q[qi + x].to_f64() * k[kv(j) + x].to_f64()).sum::<f64>())
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = p.iter().sum();
            for x in 0..d {
                o[(l * hq + h) * d + x] = p
                    .iter()
                    .enumerate()
                    .map(|(j, pj)| pj * v[kv(j) + x].to_f64())
                    .sum::<f64>()
                    / sum;
            }
        }
    }
    o
}
