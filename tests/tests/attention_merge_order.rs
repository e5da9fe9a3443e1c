//! CPU check of the numerics ring attention is to use (no GPU): a sequence split over W ranks
//! (zigzag chunks when causal), each rank's queries attending the K/V shard of every rank in
//! ring order, the partials merged in f32 through their log-sum-exp. The merged result equals
//! full attention (f64) and its error does not grow with W; the same merge with the running O
//! rounded to bf16 after every step (what a bf16 merge would do) is printed beside it.
use half::bf16;
use mkernel_tests::attention::{attention, merge_f32, partial_f32, zigzag_chunks, Seq};
use mkernel_tests::data::random_bf16;
use rayon::prelude::*;

/// Max |O error| of the ring merge over `world` ranks against the f64 reference (f32 and
/// bf16 running O).
fn ring_error(s: usize, d: usize, world: usize, causal: bool, seed: u64) -> (f64, f64, f64) {
    let (qb, kb, vb) = (
        random_bf16(s * d, seed),
        random_bf16(s * d, seed + 1),
        random_bf16(s * d, seed + 2),
    );
    let f = |x: &[bf16]| x.iter().map(|y| y.to_f32()).collect::<Vec<f32>>();
    let (q, k, v) = (f(&qb), f(&kb), f(&vb));
    let scale = 1.0 / (d as f32).sqrt();
    let seq = [Seq {
        q_start: 0,
        q_len: s,
        k_start: 0,
        k_len: s,
    }];
    let (want, want_lse) = attention(&qb, &kb, &vb, &seq, s, 1, 1, d, causal, scale as f64);
    // Rows of rank r: zigzag chunks when causal, one contiguous shard otherwise.
    let rows_of = |r: usize| -> Vec<usize> {
        if causal {
            let c = s / (2 * world);
            zigzag_chunks(r, world)
                .iter()
                .flat_map(|&i| i * c..(i + 1) * c)
                .collect()
        } else {
            let c = s / world;
            (r * c..(r + 1) * c).collect()
        }
    };
    let results: Vec<(f64, f64, f64)> = (0..world)
        .into_par_iter()
        .flat_map(|r| {
            let mine = rows_of(r);
            mine.into_par_iter()
                .map(|i| {
                    let (mut o32, mut l32) = (vec![0.0f32; d], f32::NEG_INFINITY);
                    let (mut o16, mut l16) = (vec![0.0f32; d], f32::NEG_INFINITY);
                    // Step t brings the shard of rank (r - t) mod W.
                    for t in 0..world {
                        let src = (r + world - t) % world;
                        let keys: Vec<usize> = rows_of(src).into_iter().filter(|&j| !causal || j <= i).collect();
                        let (o, l) = partial_f32(&q[i * d..(i + 1) * d], &k, &v, &keys, d, scale);
                        merge_f32(&mut o32, &mut l32, &o, l);
                        merge_f32(&mut o16, &mut l16, &o, l);
                        o16.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
                    }
                    let e = |o: &[f32]| {
                        o.iter()
                            .zip(&want[i * d..(i + 1) * d])
                            .map(|(g, w)| (*g as f64 - w).abs())
                            .fold(0.0, f64::max)
                    };
                    (e(&o32), e(&o16), (l32 as f64 - want_lse[i]).abs())
                })
                .collect::<Vec<_>>()
        })
        .collect();
    results
        .iter()
        .fold((0.0, 0.0, 0.0), |a, b| (a.0.max(b.0), a.1.max(b.1), a.2.max(b.2)))
}

#[test]
fn ring_lse_merge_in_f32_does_not_drift_with_the_ring_size() {
    let (s, d) = (512, 128);
    for causal in [false, true] {
        let mut base = None;
        for world in [1, 2, 4, 8] {
            let (e32, e16, el) = ring_error(s, d, world, causal, 40);
            println!(
                "S={s} D={d} causal={causal} W={world}: max |O err| f32 merge {e32:.2e}, bf16 running O {e16:.2e}; max |LSE err| {el:.2e}"
            );
            let b = *base.get_or_insert(e32);
            assert!(
                e32 <= 2.0 * b + 1e-6,
                "f32 merge error grew with W: {e32:.2e} vs {b:.2e} at W = 1"
            );
            assert!(el <= 1e-4, "LSE error {el:.2e}");
        }
    }
}
