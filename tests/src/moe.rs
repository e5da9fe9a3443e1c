//! MoE test data (routings) and the CPU reference of the expert FFN (rayon, f64), independent
//! of the GPU code.
use crate::data::Rng;
use half::bf16;
use rayon::prelude::*;

/// Routing of `tokens` tokens to `top_k` distinct experts each: ids (`T x top_k`, i32) and
/// positive weights summing to 1 per token. `pick(rng)` draws one expert; repeats within a
/// token are drawn again.
fn routing(
    tokens: usize,
    experts: usize,
    top_k: usize,
    seed: u64,
    mut pick: impl FnMut(&mut Rng) -> usize,
) -> (Vec<i32>, Vec<f32>) {
    assert!(top_k <= experts);
    let mut r = Rng::new(seed);
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut w = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        let first = ids.len();
        while ids.len() < first + top_k {
            let e = pick(&mut r) as i32;
            if !ids[first..].contains(&e) {
                ids.push(e);
            }
        }
        let raw: Vec<f32> = (0..top_k).map(|_| 0.1 + (r.uniform() + 1.0) / 2.0).collect();
        let sum: f32 = raw.iter().sum();
        w.extend(raw.iter().map(|x| x / sum));
    }
    (ids, w)
}

/// Every token to `top_k` distinct experts drawn uniformly.
pub fn uniform_routing(tokens: usize, experts: usize, top_k: usize, seed: u64) -> (Vec<i32>, Vec<f32>) {
    routing(tokens, experts, top_k, seed, |r| {
        (r.next_u64() % experts as u64) as usize
    })
}

/// Skewed: expert `i` is drawn with probability proportional to `1 / (i + 1)`.
pub fn skewed_routing(tokens: usize, experts: usize, top_k: usize, seed: u64) -> (Vec<i32>, Vec<f32>) {
    let cdf: Vec<f64> = (0..experts)
        .scan(0.0, |acc, i| {
            *acc += 1.0 / (i + 1) as f64;
            Some(*acc)
        })
        .collect();
    let total = *cdf.last().unwrap();
    routing(tokens, experts, top_k, seed, move |r| {
        let u = (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        cdf.partition_point(|&c| c <= u).min(experts - 1)
    })
}

/// Every token to the experts in `allowed` (distinct, `top_k <= allowed.len()`).
pub fn routing_among(tokens: usize, allowed: &[usize], top_k: usize, seed: u64) -> (Vec<i32>, Vec<f32>) {
    let a = allowed.to_vec();
    routing(tokens, usize::MAX, top_k, seed, move |r| {
        a[(r.next_u64() % a.len() as u64) as usize]
    })
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Sizes of the reference's problem.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub tokens: usize,
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub swiglu: bool,
}

/// The activation of token `t`'s row under expert `e`: (value, tolerance) per column of F.
/// Tolerance: half a bf16 ulp of the value plus f32 accumulation (`acc` x sum |x w|)
/// propagated through SwiGLU (|silu'| <= 1.1) plus the fast exp/rcp (2^-18 relative).
pub fn up_row(x: &[bf16], w_up: &[bf16], d: Dims, t: usize, e: usize, acc: f64) -> Vec<(f64, f64)> {
    let (h, f) = (d.hidden, d.ffn);
    let up_rows = if d.swiglu { 2 * f } else { f };
    let xr: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|v| v.to_f64()).collect();
    let dot = |row: usize| -> (f64, f64) {
        let w = &w_up[(e * up_rows + row) * h..(e * up_rows + row + 1) * h];
        let (mut s, mut a) = (0.0, 0.0);
        for k in 0..h {
            let p = xr[k] * w[k].to_f64();
            s += p;
            a += p.abs();
        }
        (s, a)
    };
    (0..f)
        .map(|c| {
            if d.swiglu {
                let ((g, sg), (u, su)) = (dot(c), dot(f + c));
                let v = silu(g) * u;
                let tol = v.abs() / 256.0 + acc * (1.1 * u.abs() * sg + silu(g).abs() * su) + v.abs() * 4e-6;
                (v, tol)
            } else {
                let (v, s) = dot(c);
                (v, v.abs() / 256.0 + acc * s)
            }
        })
        .collect()
}

/// The layer's output from the grouped activations the GPU computed (`hid`, `capacity x F`,
/// row `slots[p]` for pair `p`; `u32::MAX`: pair not routed): (value, tolerance) per element
/// of `T x H`. Tolerance: the output's rounding (`out_rel`), each down-projection value's
/// bf16 rounding and f32 accumulation, weighted.
#[allow(clippy::too_many_arguments)]
pub fn output(
    hid: &[bf16],
    slots: &[u32],
    ids: &[i32],
    weights: &[f32],
    w_down: &[bf16],
    d: Dims,
    out_rel: f64,
    acc: f64,
) -> Vec<(f64, f64)> {
    let (h, f, k) = (d.hidden, d.ffn, d.top_k);
    let mut out = vec![(0.0, 0.0); d.tokens * h];
    out.par_chunks_mut(h).enumerate().for_each(|(t, row)| {
        let mut sum = vec![0.0f64; h];
        let mut tol = vec![0.0f64; h];
        for j in 0..k {
            let p = t * k + j;
            let (s, e) = (slots[p], ids[p]);
            if s == u32::MAX {
                assert!(e < 0 || e as usize >= d.experts, "pair {p} (expert {e}) has no slot");
                continue;
            }
            let hr: Vec<f64> = hid[s as usize * f..(s as usize + 1) * f]
                .iter()
                .map(|v| v.to_f64())
                .collect();
            let wj = weights[p] as f64;
            for c in 0..h {
                let w = &w_down[(e as usize * h + c) * f..(e as usize * h + c + 1) * f];
                let (mut v, mut a) = (0.0, 0.0);
                for q in 0..f {
                    let x = hr[q] * w[q].to_f64();
                    v += x;
                    a += x.abs();
                }
                sum[c] += wj * v;
                tol[c] += wj.abs() * (v.abs() / 256.0 + acc * a) + 1e-6 * (wj * v).abs();
            }
        }
        for c in 0..h {
            row[c] = (sum[c], tol[c] + out_rel * sum[c].abs());
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routings_pick_distinct_experts_with_normalized_weights() {
        for (ids, w) in [
            uniform_routing(500, 16, 4, 1),
            skewed_routing(500, 16, 4, 2),
            routing_among(500, &[0, 5, 31], 2, 3),
        ] {
            let k = ids.len() / 500;
            for t in 0..500 {
                let row = &ids[t * k..(t + 1) * k];
                for j in 0..k {
                    assert!(!row[..j].contains(&row[j]), "token {t}: {row:?}");
                }
                let s: f32 = w[t * k..(t + 1) * k].iter().sum();
                assert!((s - 1.0).abs() < 1e-5 && w[t * k..(t + 1) * k].iter().all(|&x| x > 0.0));
            }
        }
        let (ids, _) = routing_among(100, &[0, 5, 31], 2, 3);
        assert!(ids.iter().all(|e| [0, 5, 31].contains(e)));
    }

    #[test]
    fn skewed_routing_favours_low_experts() {
        let (ids, _) = skewed_routing(4096, 64, 8, 4);
        let mut counts = [0usize; 64];
        for &e in &ids {
            counts[e as usize] += 1;
        }
        // Without replacement inside a token the head flattens, but stays far above the tail.
        assert!(counts[0] > 3 * counts[63], "{counts:?}");
        assert!(counts[0] >= counts[8] && counts[8] >= counts[40], "{counts:?}");
    }

    #[test]
    fn reference_swiglu_row_by_hand() {
        // H = 2, F = 1, one expert: gate row [1, 0], up row [0, 2]; x = [2, 3].
        let b = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let d = Dims {
            tokens: 1,
            experts: 1,
            top_k: 1,
            hidden: 2,
            ffn: 1,
            swiglu: true,
        };
        let r = up_row(&b(&[2.0, 3.0]), &b(&[1.0, 0.0, 0.0, 2.0]), d, 0, 0, 0.0);
        let want = 2.0 / (1.0 + (-2.0f64).exp()) * 6.0;
        assert!((r[0].0 - want).abs() < 1e-12, "{:?}", r[0]);
    }
}
