//! 200 random GEMM shapes on the GPU against the CPU reference: M, N, K drawn tiny, ragged
//! (not multiples of the 128 x 256 x 64 tile) and large, both B layouts, bf16 and f32 output.
//! Shapes the plan must refuse (K or, for B as K x N, N not a multiple of 8) are checked to be
//! refused with `Error::Shape`, never run.
use half::bf16;
use mkernel::gemm::{gemm_bf16, BLayout, GemmShape};
use mkernel::Error;
use mkernel_tests::data::{random_bf16, Rng};
use mkernel_tests::gpu::device_or_skip;
use mkernel_tests::reference::{compare, gemm as cpu_gemm, BOrder, BF16_OUT_REL, F32_ACC, F32_OUT_REL};

/// Shapes in the test: the seed makes every run draw the same ones.
const CASES: usize = 200;
const SEED: u64 = 0x6e6d_6b72_6e6c;
/// Work bound of one case (multiply-adds), so the f64 CPU reference stays a few seconds.
const MAX_MACS: u64 = 1 << 32;

/// One dimension: tiny (1-16), ragged small (17-600), or large (600-8192), with a bias to
/// values around tile multiples (exactly one, one less, one more).
fn dim(r: &mut Rng) -> usize {
    let pick = r.next_u64() % 100;
    let base = match pick {
        0..=19 => 1 + (r.next_u64() % 16) as usize,
        20..=74 => 17 + (r.next_u64() % 584) as usize,
        _ => 600 + (r.next_u64() % 7593) as usize,
    };
    match r.next_u64() % 8 {
        0 => base.div_ceil(64) * 64,
        1 => (base.div_ceil(64) * 64).saturating_sub(1).max(1),
        2 => base.div_ceil(64) * 64 + 1,
        _ => base,
    }
}

fn draw(r: &mut Rng) -> GemmShape {
    loop {
        let (m, n, mut k) = (dim(r), dim(r), dim(r));
        // Most draws keep K a multiple of 8 (the TMA row-pitch rule); some do not, to be refused.
        if !r.next_u64().is_multiple_of(10) {
            k = k.div_ceil(8) * 8;
        }
        let b_layout = if r.next_u64().is_multiple_of(3) {
            BLayout::KxN
        } else {
            BLayout::NxK
        };
        if (m * n * k) as u64 <= MAX_MACS {
            return GemmShape { m, n, k, b_layout };
        }
    }
}

fn valid(s: &GemmShape) -> bool {
    s.k.is_multiple_of(8) && (s.b_layout == BLayout::NxK || s.n.is_multiple_of(8))
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_random_shapes_match_cpu_reference() {
    let Some(dev) = device_or_skip("gemm_random_shapes_match_cpu_reference") else {
        return;
    };
    let stream = dev.default_stream();
    let mut r = Rng::new(SEED);
    let (mut ran, mut refused) = (0, 0);
    for case in 0..CASES {
        let shape = draw(&mut r);
        let f32_out = r.next_u64().is_multiple_of(4);
        let (la, lb, lc) = shape.lens();
        let a = random_bf16(la, SEED + 3 * case as u64);
        let b = random_bf16(lb, SEED + 3 * case as u64 + 1);
        let da = stream.clone_htod(&a).unwrap();
        let db = stream.clone_htod(&b).unwrap();
        let got: Result<Vec<f64>, Error> = if f32_out {
            let mut dc = stream.alloc_zeros::<f32>(lc).unwrap();
            gemm_bf16(&dev, &stream, &da, &db, &mut dc, shape)
                .map(|_| stream.clone_dtoh(&dc).unwrap().iter().map(|&x| x as f64).collect())
        } else {
            let mut dc = stream.alloc_zeros::<bf16>(lc).unwrap();
            gemm_bf16(&dev, &stream, &da, &db, &mut dc, shape)
                .map(|_| stream.clone_dtoh(&dc).unwrap().iter().map(|x| x.to_f64()).collect())
        };
        let label = format!(
            "case {case:3}: {:>5} x {:>5} x {:>5} B={:?} out={}",
            shape.m,
            shape.n,
            shape.k,
            shape.b_layout,
            if f32_out { "f32" } else { "bf16" }
        );
        match got {
            Err(e) => {
                assert!(!valid(&shape), "{label}: a valid shape was refused: {e}");
                assert!(
                    matches!(e, Error::Shape { .. }),
                    "{label}: refused with {e}, not Error::Shape"
                );
                refused += 1;
            }
            Ok(got) => {
                assert!(valid(&shape), "{label}: an invalid shape was accepted");
                let order = match shape.b_layout {
                    BLayout::KxN => BOrder::KxN,
                    BLayout::NxK => BOrder::NxK,
                };
                let (want, scale) = cpu_gemm(&a, &b, shape.m, shape.n, shape.k, order);
                let rel = if f32_out { F32_OUT_REL } else { BF16_OUT_REL };
                let c = compare(&got, &want, &scale, rel, F32_ACC);
                assert_eq!(
                    c.wrong, 0,
                    "{label}: {} wrong of {lc}; first (index, got, want) = {:?}",
                    c.wrong, c.first_wrong
                );
                ran += 1;
            }
        }
    }
    println!("{CASES} random shapes: {ran} ran and matched the CPU reference, {refused} refused as invalid");
    // The seeded draw gives 137 valid shapes of 200 (the rest test the refusals).
    assert!(ran >= CASES / 2, "too few valid shapes drawn ({ran})");
}

#[test]
fn random_shapes_cover_tiny_ragged_large_and_invalid() {
    let mut r = Rng::new(SEED);
    let shapes: Vec<GemmShape> = (0..CASES)
        .map(|_| {
            let s = draw(&mut r);
            r.next_u64(); // the output-type draw, as in the GPU test
            s
        })
        .collect();
    assert!(shapes.iter().any(|s| s.m <= 16 && s.n <= 16));
    assert!(shapes.iter().any(|s| s.m % 128 != 0 && s.n % 256 != 0 && s.k % 64 != 0));
    assert!(shapes.iter().any(|s| s.m >= 2048 || s.n >= 2048 || s.k >= 2048));
    assert!(shapes.iter().any(|s| !valid(s)));
    assert!(shapes.iter().any(|s| s.b_layout == BLayout::KxN));
    assert!(shapes.iter().all(|s| (s.m * s.n * s.k) as u64 <= MAX_MACS));
}
