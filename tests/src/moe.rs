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
/// bf16 rounding (when `down_rounded`: the grouped rows are stored as bf16 before the sum)
/// and f32 accumulation, weighted.
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
    down_rounded: bool,
) -> Vec<(f64, f64)> {
    let round = if down_rounded { 1.0 / 256.0 } else { 0.0 };
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
                tol[c] += wj.abs() * (v.abs() * round + acc * a) + 1e-6 * (wj * v).abs();
            }
        }
        for c in 0..h {
            row[c] = (sum[c], tol[c] + out_rel * sum[c].abs());
        }
    });
    out
}

/// The whole layer's output row of token `t` (`x` row `t`, its pairs' ids and weights; pair
/// `j` counted when `kept(j)`), from the full weights of every expert: (value, tolerance) per
/// column of H. Tolerance: each activation's (from [`up_row`], bf16 rounding included)
/// propagated through the down projection, the down projection's bf16 rounding and f32
/// accumulation, weighted, plus the output's rounding (`out_rel`).
#[allow(clippy::too_many_arguments)]
pub fn layer_row(
    x: &[bf16],
    w_up: &[bf16],
    w_down: &[bf16],
    d: Dims,
    t: usize,
    ids: &[i32],
    weights: &[f32],
    kept: impl Fn(usize) -> bool,
    out_rel: f64,
    acc: f64,
) -> Vec<(f64, f64)> {
    let (h, f, k) = (d.hidden, d.ffn, d.top_k);
    let mut sum = vec![0.0f64; h];
    let mut tol = vec![0.0f64; h];
    for j in 0..k {
        let p = t * k + j;
        let e = ids[p];
        if e < 0 || e as usize >= d.experts || !kept(j) {
            continue;
        }
        let e = e as usize;
        let hid = up_row(x, w_up, d, t, e, acc);
        let wj = weights[p] as f64;
        for c in 0..h {
            let w = &w_down[(e * h + c) * f..(e * h + c + 1) * f];
            let (mut v, mut a, mut prop) = (0.0, 0.0, 0.0);
            for q in 0..f {
                let wq = w[q].to_f64();
                v += hid[q].0 * wq;
                a += (hid[q].0 * wq).abs();
                prop += hid[q].1 * wq.abs();
            }
            sum[c] += wj * v;
            tol[c] += wj.abs() * (v.abs() / 256.0 + acc * a + prop) + 1e-6 * (wj * v).abs();
        }
    }
    (0..h).map(|c| (sum[c], tol[c] + out_rel * sum[c].abs())).collect()
}

/// What one rank of an expert-parallel layer must see ([`ep_expected`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpExpected {
    /// Pairs of this rank dropped (their owner had no room).
    pub sent: u32,
    /// Rows sent to this rank that it drops.
    pub received: u32,
    /// Per expert of the layer: the owner's receive rows `[lo, hi)` this rank's pairs may take.
    pub ranges: Vec<(u32, u32)>,
}

/// What expert parallelism over `world` ranks must do with every rank's routing (`ids[r]`,
/// global expert ids; `experts / world` experts per rank, in rank order) and `capacity`
/// receive rows per rank: per rank, its [`EpExpected`].
/// Layout: at each owner its experts' groups in order, each padded to 128 rows, inside a
/// group the sources in rank order; a row at or past `capacity` is dropped.
pub fn ep_expected(ids: &[Vec<i32>], experts: usize, world: usize, capacity: usize) -> Vec<EpExpected> {
    let le = experts / world;
    let cnt: Vec<Vec<u32>> = ids
        .iter()
        .map(|v| {
            let mut c = vec![0u32; experts];
            for &e in v {
                if e >= 0 && (e as usize) < experts {
                    c[e as usize] += 1;
                }
            }
            c
        })
        .collect();
    let total: Vec<u32> = (0..experts).map(|e| cnt.iter().map(|c| c[e]).sum()).collect();
    let mut group = vec![0u32; experts];
    for d in 0..world {
        let mut at = 0u32;
        for e in d * le..(d + 1) * le {
            group[e] = at;
            at += total[e].div_ceil(128) * 128;
        }
    }
    let cap = capacity as u32;
    (0..world)
        .map(|r| {
            let mut sent = 0;
            let ranges: Vec<(u32, u32)> = (0..experts)
                .map(|e| {
                    let lo = group[e] + cnt[..r].iter().map(|c| c[e]).sum::<u32>();
                    let hi = lo + cnt[r][e];
                    sent += hi - hi.min(cap).max(lo);
                    (lo, hi)
                })
                .collect();
            let received = (r * le..(r + 1) * le)
                .map(|e| total[e] - total[e].min(cap.saturating_sub(group[e])))
                .sum();
            EpExpected { sent, received, ranges }
        })
        .collect()
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
    fn ep_expected_drops_past_the_capacity() {
        // 2 ranks, 4 experts (2 each). Rank 0: 100 rows to expert 0, 50 to expert 1;
        // rank 1: 60 rows to expert 0. At rank 0: expert 0 has 160 rows (2 tiles, rows
        // 0..160: rank 0's 0..100, rank 1's 100..160), expert 1 starts at row 256.
        let mut a = vec![0i32; 100];
        a.extend(vec![1i32; 50]);
        let b = vec![0i32; 60];
        let all = [a, b];
        let full = ep_expected(&all, 4, 2, 384);
        assert_eq!((full[0].sent, full[0].received, full[1].sent), (0, 0, 0));
        assert_eq!(full[0].ranges[0], (0, 100));
        assert_eq!(full[1].ranges[0], (100, 160));
        assert_eq!(full[0].ranges[1], (256, 306));
        // Capacity 128: rank 0 keeps 100 of expert 0 and none of expert 1; rank 1 keeps 28.
        let cut = ep_expected(&all, 4, 2, 128);
        assert_eq!((cut[0].sent, cut[1].sent), (50, 32));
        assert_eq!(cut[0].received, 82);
        assert_eq!(cut[1].received, 0);
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
