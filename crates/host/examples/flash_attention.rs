//! FlashAttention forward on one GPU: causal, grouped-query (4 query heads over 2 key/value
//! heads), head dim 128, a batch of 2 sequences; new Q, K, V every step, checked against an f64
//! CPU softmax(Q K^T / sqrt(d)) V.
//!
//! Run: `cargo run --release -p mkernel --example flash_attention`.
mod common;

use common::{check, random_bf16, Result, STEPS};
use half::bf16;
use mkernel::ops::attention::{AttentionHeads, AttentionTensors, FlashAttentionPlan, Sequences};
use mkernel::Device;

const BATCH: usize = 2;
const SEQ: usize = 256;
const HEADS: AttentionHeads = AttentionHeads {
    heads_q: 4,
    heads_kv: 2,
    head_dim: 128,
    causal: true,
    softmax_scale: None, // 1 / sqrt(head_dim)
};

fn main() -> std::process::ExitCode {
    common::run("flash_attention", flash_attention)
}

fn flash_attention() -> Result {
    let dev = Device::new(0)?;
    let stream = dev.default_stream();
    let (hq, hkv, d) = (HEADS.heads_q, HEADS.heads_kv, HEADS.head_dim);
    let rows = BATCH * SEQ; // Q, K, V, O are [rows][heads][d], rows = batch x sequence
    let mut q = stream.alloc_zeros::<bf16>(rows * hq * d)?;
    let mut k = stream.alloc_zeros::<bf16>(rows * hkv * d)?;
    let mut v = stream.alloc_zeros::<bf16>(rows * hkv * d)?;
    let mut o = stream.alloc_zeros::<bf16>(rows * hq * d)?;
    let mut lse = stream.alloc_zeros::<f32>(hq * rows)?; // log-sum-exp per query head and row
    let seqs = Sequences::Batched {
        batch: BATCH,
        seqlen_q: SEQ,
        seqlen_k: SEQ,
    };

    // Planned once for the heads; each step launches on its buffers.
    let plan = FlashAttentionPlan::new(&dev, HEADS)?;
    for step in 0..STEPS {
        let (qh, kh, vh) = (
            random_bf16(q.len(), 3 * step, 1.0),
            random_bf16(k.len(), 3 * step + 1, 1.0),
            random_bf16(v.len(), 3 * step + 2, 1.0),
        );
        stream.memcpy_htod(&qh, &mut q)?;
        stream.memcpy_htod(&kh, &mut k)?;
        stream.memcpy_htod(&vh, &mut v)?;
        let t = AttentionTensors {
            q: &q,
            k: &k,
            v: &v,
            o: &mut o,
            lse: Some(&mut lse), // or None when the LSE is not needed
        };
        plan.launch(&stream, t, seqs)?; // one kernel; capturable in a CUDA graph
        let got = stream.clone_dtoh(&o)?;
        check(
            &format!("flash_attention step {step}"),
            got.iter().map(|x| x.to_f64()),
            &reference(&qh, &kh, &vh),
            1.0 / 64.0,
        )?;
    }
    Ok(())
}

/// softmax(Q K^T / sqrt(d) + causal mask) V per sequence and query head, in f64.
fn reference(q: &[bf16], k: &[bf16], v: &[bf16]) -> Vec<f64> {
    let (hq, hkv, d) = (HEADS.heads_q, HEADS.heads_kv, HEADS.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let mut o = vec![0.0; q.len()];
    for b in 0..BATCH {
        for h in 0..hq {
            let hk = h / (hq / hkv); // the key/value head of this query head's group
            for i in 0..SEQ {
                let qi = ((b * SEQ + i) * hq + h) * d;
                let kv = |j: usize| ((b * SEQ + j) * hkv + hk) * d;
                let scores: Vec<f64> = (0..=i) // causal: keys up to the query's own position
                    .map(|j| scale * (0..d).map(|x| q[qi + x].to_f64() * k[kv(j) + x].to_f64()).sum::<f64>())
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = p.iter().sum();
                for x in 0..d {
                    o[qi + x] = p
                        .iter()
                        .enumerate()
                        .map(|(j, pj)| pj * v[kv(j) + x].to_f64())
                        .sum::<f64>()
                        / sum;
                }
            }
        }
    }
    o
}
