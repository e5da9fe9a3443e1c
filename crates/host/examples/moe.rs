//! Mixture-of-experts FFN on one GPU: route every token to its top-k experts, run each expert's
//! SwiGLU FFN as grouped GEMMs, and sum the results weighted by the router (routing, gather,
//! up projection, down projection and combine all on the device). Planned once with the expert
//! weights; every step brings new tokens and a new routing. Checked against an f64 CPU layer.
//!
//! Run: `cargo run --release -p mkernel --example moe`.
mod common;

use common::{check, random_bf16, random_f32, Result, STEPS};
use half::bf16;
use mkernel::ops::moe::{Activation, MoePlan, MoeShape};
use mkernel::Device;

const SHAPE: MoeShape = MoeShape {
    tokens: 256,
    experts: 8,
    top_k: 2,
    hidden: 256,
    ffn: 256,
    act: Activation::SwiGlu, // W_up[e] holds 2 x ffn rows: gate rows, then up rows
};

fn main() -> std::process::ExitCode {
    common::run("moe", moe)
}

fn moe() -> Result {
    let dev = Device::new(0)?;
    let stream = dev.default_stream();
    let MoeShape {
        tokens,
        top_k,
        hidden,
        ffn,
        ..
    } = SHAPE;
    let (up_len, down_len) = SHAPE.weight_lens();
    let w_up_host = random_bf16(up_len, 1, 1.0 / (hidden as f32).sqrt());
    let w_down_host = random_bf16(down_len, 2, 1.0 / (ffn as f32).sqrt());
    let (w_up, w_down) = (stream.clone_htod(&w_up_host)?, stream.clone_htod(&w_down_host)?);
    let mut x = stream.alloc_zeros::<bf16>(tokens * hidden)?;
    let mut ids = stream.alloc_zeros::<i32>(tokens * top_k)?;
    let mut weights = stream.alloc_zeros::<f32>(tokens * top_k)?;
    let mut out = stream.alloc_zeros::<f32>(tokens * hidden)?; // bf16 works too

    // Plan once: it borrows the weights; tokens and routing are launch arguments.
    let mut plan = MoePlan::new(&dev, &stream, SHAPE, &w_up, &w_down, None)?;
    for step in 0..STEPS {
        let x_host = random_bf16(tokens * hidden, 100 + step, 1.0);
        let (ids_host, weights_host) = routing(step);
        stream.memcpy_htod(&x_host, &mut x)?;
        stream.memcpy_htod(&ids_host, &mut ids)?;
        stream.memcpy_htod(&weights_host, &mut weights)?;
        plan.launch(&stream, &x, &ids, &weights, &mut out)?;
        plan.take_error(&stream)?; // an expert id outside 0..experts is named here
        let got = stream.clone_dtoh(&out)?;
        let want = reference(&x_host, &ids_host, &weights_host, &w_up_host, &w_down_host);
        check(
            &format!("moe step {step}"),
            got.iter().map(|&v| v as f64),
            &want,
            1.0 / 64.0,
        )?;
    }
    Ok(())
}

/// `top_k` distinct experts per token and positive weights summing to 1 (a router's softmax).
fn routing(step: u64) -> (Vec<i32>, Vec<f32>) {
    let MoeShape {
        tokens, experts, top_k, ..
    } = SHAPE;
    let r = random_f32(tokens * (top_k + 1), 7 + step, 1.0);
    let mut ids = vec![];
    let mut w = vec![];
    for t in 0..tokens {
        let first = ((r[t] + 1.0) * 0.5 * experts as f32) as usize % experts;
        let raw: Vec<f32> = (0..top_k).map(|j| 1.5 + r[tokens + t * top_k + j]).collect();
        let sum: f32 = raw.iter().sum();
        for (j, x) in raw.iter().enumerate() {
            ids.push(((first + j) % experts) as i32);
            w.push(x / sum);
        }
    }
    (ids, w)
}

/// `out[t] = sum_j weight[t, j] x W_down[e] (silu(W_gate[e] x_t) * (W_up[e] x_t))`, `e = ids[t, j]`, in f64.
fn reference(x: &[bf16], ids: &[i32], weights: &[f32], w_up: &[bf16], w_down: &[bf16]) -> Vec<f64> {
    let MoeShape {
        tokens,
        top_k,
        hidden: h,
        ffn: f,
        ..
    } = SHAPE;
    let dot = |a: &[bf16], b: &[bf16]| a.iter().zip(b).map(|(p, q)| p.to_f64() * q.to_f64()).sum::<f64>();
    let mut out = vec![0.0; tokens * h];
    for t in 0..tokens {
        let xt = &x[t * h..(t + 1) * h];
        for j in 0..top_k {
            let e = ids[t * top_k + j] as usize;
            let row = |r: usize| &w_up[(e * 2 * f + r) * h..(e * 2 * f + r + 1) * h];
            let act: Vec<f64> = (0..f)
                .map(|c| {
                    let (g, u) = (dot(xt, row(c)), dot(xt, row(f + c)));
                    // The GPU keeps the activation in bf16 between the two GEMMs.
                    bf16::from_f64(g / (1.0 + (-g).exp()) * u).to_f64()
                })
                .collect();
            for c in 0..h {
                let wd = &w_down[(e * h + c) * f..(e * h + c + 1) * f];
                let y: f64 = act.iter().zip(wd).map(|(a, w)| a * w.to_f64()).sum();
                out[t * h + c] += weights[t * top_k + j] as f64 * y;
            }
        }
    }
    out
}
