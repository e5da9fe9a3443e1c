//! CPU reference of attention (f64, rayon), independent of the GPU kernel's tiling.
use half::bf16;
use rayon::prelude::*;

/// One sequence: rows `q_start..q_start + q_len` of Q/O and `k_start..k_start + k_len` of K/V.
#[derive(Clone, Copy, Debug)]
pub struct Seq {
    pub q_start: usize,
    pub q_len: usize,
    pub k_start: usize,
    pub k_len: usize,
}

/// `O = softmax(scale * Q K^T + mask) V` and `LSE = log sum exp(scale * Q K^T + mask)` per row.
/// Q/O rows are `[row][heads_q][d]`, K/V `[row][heads_kv][d]`; query head `h` reads key head
/// `h / (heads_q / heads_kv)`. Causal: query `i` of a sequence sees keys
/// `j <= i + k_len - q_len`. Returns O (`total_q x heads_q x d`) and LSE indexed
/// `[h][global query row]`; a row with no visible key has O = 0 and LSE = -inf.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    seqs: &[Seq],
    total_q: usize,
    heads_q: usize,
    heads_kv: usize,
    d: usize,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let group = heads_q / heads_kv;
    let jobs: Vec<(usize, usize, usize)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, sq)| (0..heads_q).flat_map(move |h| (0..sq.q_len).map(move |i| (s, h, i))))
        .collect();
    let rows: Vec<(usize, usize, Vec<f64>, f64)> = jobs
        .par_iter()
        .map(|&(s, h, i)| {
            let sq = seqs[s];
            let hk = h / group;
            let g = sq.q_start + i;
            let qrow: Vec<f64> = (0..d).map(|x| q[(g * heads_q + h) * d + x].to_f64()).collect();
            let visible = if causal {
                (i as i64 + sq.k_len as i64 - sq.q_len as i64 + 1).clamp(0, sq.k_len as i64) as usize
            } else {
                sq.k_len
            };
            if visible == 0 {
                return (g, h, vec![0.0; d], f64::NEG_INFINITY);
            }
            let scores: Vec<f64> = (0..visible)
                .map(|j| {
                    let kr = ((sq.k_start + j) * heads_kv + hk) * d;
                    scale * (0..d).map(|x| qrow[x] * k[kr + x].to_f64()).sum::<f64>()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = p.iter().sum();
            let mut o = vec![0.0; d];
            for (j, pj) in p.iter().enumerate() {
                let vr = ((sq.k_start + j) * heads_kv + hk) * d;
                for x in 0..d {
                    o[x] += pj * v[vr + x].to_f64();
                }
            }
            o.iter_mut().for_each(|x| *x /= sum);
            (g, h, o, m + sum.ln())
        })
        .collect();
    let mut out = vec![0.0; total_q * heads_q * d];
    let mut lse = vec![f64::NEG_INFINITY; heads_q * total_q];
    for (g, h, o, l) in rows {
        out[(g * heads_q + h) * d..(g * heads_q + h + 1) * d].copy_from_slice(&o);
        lse[h * total_q + g] = l;
    }
    (out, lse)
}

/// Zigzag sharding of a causal sequence over `world` ranks: the sequence is cut into
/// `2 x world` equal chunks and rank `r` holds chunks `r` and `2 world - 1 - r` (in that order),
/// so every rank gets the same causal work. Returns the two chunk indices.
pub fn zigzag_chunks(rank: usize, world: usize) -> [usize; 2] {
    [rank, 2 * world - 1 - rank]
}

/// Merges two partial attention results of the same query row over disjoint key sets, in f32:
/// `(o, lse)` with `o` normalized over its keys. `lse = -inf` is an empty set.
pub fn merge_f32(o_a: &mut [f32], lse_a: &mut f32, o_b: &[f32], lse_b: f32) {
    if lse_b == f32::NEG_INFINITY {
        return;
    }
    if *lse_a == f32::NEG_INFINITY {
        o_a.copy_from_slice(o_b);
        *lse_a = lse_b;
        return;
    }
    let m = lse_a.max(lse_b);
    let (wa, wb) = ((*lse_a - m).exp(), (lse_b - m).exp());
    let s = wa + wb;
    for (x, y) in o_a.iter_mut().zip(o_b) {
        *x = (wa * *x + wb * y) / s;
    }
    *lse_a = m + s.ln();
}

/// Attention of one query row against the keys `keys` (indices into `k`/`v`, rows of `d`),
/// f32 arithmetic as the kernel does it (scores, max, exponentials, sums in f32): `(o, lse)`,
/// `o = 0, lse = -inf` for no keys.
pub fn partial_f32(q: &[f32], k: &[f32], v: &[f32], keys: &[usize], d: usize, scale: f32) -> (Vec<f32>, f32) {
    if keys.is_empty() {
        return (vec![0.0; d], f32::NEG_INFINITY);
    }
    let s: Vec<f32> = keys
        .iter()
        .map(|&j| scale * (0..d).map(|x| q[x] * k[j * d + x]).sum::<f32>())
        .collect();
    let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f32 = p.iter().sum();
    let mut o = vec![0.0f32; d];
    for (pj, &j) in p.iter().zip(keys) {
        for x in 0..d {
            o[x] += pj * v[j * d + x];
        }
    }
    o.iter_mut().for_each(|x| *x /= l);
    (o, m + l.ln())
}

/// Gradients of attention (f64): `(dQ, dK, dV)` of `O = softmax(scale Q K^T + mask) V` for the
/// output gradient `d_o`, layouts and masking as [`attention`]; dK and dV of a key/value head
/// are summed over the query heads of its group. Per query row: `P` the softmax over the visible
/// keys, `dP_j = dO . V_j`, `delta = sum_j P_j dP_j`, `dS_j = P_j (dP_j - delta)`;
/// `dQ = scale sum_j dS_j K_j`, `dK_j += scale dS_j Q`, `dV_j += P_j dO`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    d_o: &[bf16],
    seqs: &[Seq],
    total_q: usize,
    total_k: usize,
    heads_q: usize,
    heads_kv: usize,
    d: usize,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let group = heads_q / heads_kv;
    let f = |x: &[bf16], row: usize, heads: usize, h: usize| -> Vec<f64> {
        (0..d).map(|i| x[(row * heads + h) * d + i].to_f64()).collect()
    };
    // One job per (sequence, key/value head): it owns those keys' dK, dV and its heads' dQ rows.
    let jobs: Vec<(usize, usize)> = (0..seqs.len())
        .flat_map(|s| (0..heads_kv).map(move |h| (s, h)))
        .collect();
    type Part = (Vec<(usize, usize, Vec<f64>)>, Vec<(usize, Vec<f64>, Vec<f64>)>);
    let parts: Vec<(usize, Part)> = jobs
        .par_iter()
        .map(|&(s, hk)| {
            let sq = seqs[s];
            let keys: Vec<Vec<f64>> = (0..sq.k_len).map(|j| f(k, sq.k_start + j, heads_kv, hk)).collect();
            let vals: Vec<Vec<f64>> = (0..sq.k_len).map(|j| f(v, sq.k_start + j, heads_kv, hk)).collect();
            let mut dk = vec![vec![0.0; d]; sq.k_len];
            let mut dv = vec![vec![0.0; d]; sq.k_len];
            let mut dq_rows = vec![];
            for h in hk * group..(hk + 1) * group {
                for i in 0..sq.q_len {
                    let g = sq.q_start + i;
                    let qr = f(q, g, heads_q, h);
                    let dor = f(d_o, g, heads_q, h);
                    let visible = if causal {
                        (i as i64 + sq.k_len as i64 - sq.q_len as i64 + 1).clamp(0, sq.k_len as i64) as usize
                    } else {
                        sq.k_len
                    };
                    let mut dqr = vec![0.0; d];
                    if visible > 0 {
                        let sc: Vec<f64> = (0..visible)
                            .map(|j| scale * (0..d).map(|x| qr[x] * keys[j][x]).sum::<f64>())
                            .collect();
                        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                        let sum: f64 = e.iter().sum();
                        let p: Vec<f64> = e.iter().map(|x| x / sum).collect();
                        let dp: Vec<f64> = (0..visible)
                            .map(|j| (0..d).map(|x| dor[x] * vals[j][x]).sum::<f64>())
                            .collect();
                        let delta: f64 = (0..visible).map(|j| p[j] * dp[j]).sum();
                        for j in 0..visible {
                            let ds = p[j] * (dp[j] - delta);
                            for x in 0..d {
                                dqr[x] += scale * ds * keys[j][x];
                                dk[j][x] += scale * ds * qr[x];
                                dv[j][x] += p[j] * dor[x];
                            }
                        }
                    }
                    dq_rows.push((g, h, dqr));
                }
            }
            let kv = (0..sq.k_len)
                .map(|j| (sq.k_start + j, std::mem::take(&mut dk[j]), std::mem::take(&mut dv[j])))
                .collect();
            (hk, (dq_rows, kv))
        })
        .collect();
    let mut dq = vec![0.0; total_q * heads_q * d];
    let mut dk = vec![0.0; total_k * heads_kv * d];
    let mut dv = vec![0.0; total_k * heads_kv * d];
    for (hk, (dq_rows, kv)) in parts {
        for (g, h, r) in dq_rows {
            dq[(g * heads_q + h) * d..(g * heads_q + h + 1) * d].copy_from_slice(&r);
        }
        for (row, a, b) in kv {
            dk[(row * heads_kv + hk) * d..(row * heads_kv + hk + 1) * d].copy_from_slice(&a);
            dv[(row * heads_kv + hk) * d..(row * heads_kv + hk + 1) * d].copy_from_slice(&b);
        }
    }
    (dq, dk, dv)
}
