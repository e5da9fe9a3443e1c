//! CPU references (rayon), accumulating in f64, independent of the GPU code paths.
// A NaN must fail the tolerance checks, so they are written as negated `<=` comparisons.
#![allow(clippy::neg_cmp_op_on_partial_ord)]
use half::bf16;
use rayon::prelude::*;

/// Storage order of B in [`gemm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BOrder {
    KxN,
    NxK,
}

/// `C = A * B` with A M x K row-major; returns (C, sum over k of |a * b|) per element, the
/// second being the scale against which accumulation error is judged.
pub fn gemm(a: &[bf16], b: &[bf16], m: usize, n: usize, k: usize, order: BOrder) -> (Vec<f64>, Vec<f64>) {
    let a: Vec<f64> = a.iter().map(|x| x.to_f64()).collect();
    // B as N x K so the inner loop is contiguous for both operands.
    let bt: Vec<f64> = match order {
        BOrder::NxK => b.iter().map(|x| x.to_f64()).collect(),
        BOrder::KxN => {
            let mut t = vec![0.0; n * k];
            for kk in 0..k {
                for j in 0..n {
                    t[j * k + kk] = b[kk * n + j].to_f64();
                }
            }
            t
        }
    };
    let mut c = vec![0.0; m * n];
    let mut s = vec![0.0; m * n];
    c.par_chunks_mut(n)
        .zip(s.par_chunks_mut(n))
        .enumerate()
        .for_each(|(i, (crow, srow))| {
            let arow = &a[i * k..(i + 1) * k];
            for j in 0..n {
                let brow = &bt[j * k..(j + 1) * k];
                let (mut acc, mut abs) = (0.0, 0.0);
                for kk in 0..k {
                    let p = arow[kk] * brow[kk];
                    acc += p;
                    abs += p.abs();
                }
                crow[j] = acc;
                srow[j] = abs;
            }
        });
    (c, s)
}

/// Result of comparing GPU output with a reference.
#[derive(Debug)]
pub struct Comparison {
    pub wrong: usize,
    pub max_abs_err: f64,
    pub first_wrong: Option<(usize, f64, f64)>,
}

/// Element `i` is right when `|got - want| <= rel * |want| + acc * scale[i]`: `rel` covers the
/// rounding of the output type, `acc` the f32 accumulation over the reduction.
pub fn compare(got: &[f64], want: &[f64], scale: &[f64], rel: f64, acc: f64) -> Comparison {
    let mut c = Comparison {
        wrong: 0,
        max_abs_err: 0.0,
        first_wrong: None,
    };
    for i in 0..want.len() {
        let err = (got[i] - want[i]).abs();
        c.max_abs_err = c.max_abs_err.max(err);
        if !(err <= rel * want[i].abs() + acc * scale[i]) {
            c.wrong += 1;
            c.first_wrong.get_or_insert((i, got[i], want[i]));
        }
    }
    c
}

/// Tolerance of a bf16 output: half an ulp of bf16 (2^-8 relative) plus f32 accumulation.
pub const BF16_OUT_REL: f64 = 1.0 / 256.0;
/// Tolerance of an f32 output: f32 rounding.
pub const F32_OUT_REL: f64 = 1.0 / (1u64 << 22) as f64;
/// Accumulation allowance relative to the sum of |a b| (f32 has 2^-24; tensor cores add a few bits).
pub const F32_ACC: f64 = 1.0 / (1u64 << 16) as f64;

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn reference_gemm_matches_hand_computation() {
        let f = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let a = f(&[1.0, 2.0, 3.0, 4.0]); // 2 x 2
        let b_kn = f(&[5.0, 6.0, 7.0, 8.0]); // 2 x 2, K x N
        let (c, _) = gemm(&a, &b_kn, 2, 2, 2, BOrder::KxN);
        assert_eq!(c, vec![19.0, 22.0, 43.0, 50.0]);
        let b_nk = f(&[5.0, 7.0, 6.0, 8.0]); // the same B stored N x K
        assert_eq!(gemm(&a, &b_nk, 2, 2, 2, BOrder::NxK).0, c);
    }
    #[test]
    fn compare_counts_wrong_elements() {
        let c = compare(&[1.0, 2.0, 3.5], &[1.0, 2.0, 3.0], &[1.0; 3], BF16_OUT_REL, 0.0);
        assert_eq!(c.wrong, 1);
        assert_eq!(c.first_wrong.unwrap().0, 2);
    }
}
