//! The decode GEMM (M <= 256, `GemmKernel::Decode`, what `Auto` picks there) against the CPU
//! reference: every M in 1..=256 for both B layouts (launches of one plan, M a launch argument),
//! ragged N and K, stream-K splits with many contributors per tile, f32 output through
//! `gemm_bf16`, and repeated launches of one plan (the per-tile counters return to zero, the
//! reduction order is fixed: bitwise equal results).
use half::bf16;
use mkernel::gemm::{gemm_bf16, BLayout, GemmConfig, GemmKernel, GemmPlan, GemmShape, GemmTensors, OutDtype};
use mkernel::Device;
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::device_or_skip;
use mkernel_tests::reference::{compare, gemm as cpu_gemm, BOrder, BF16_OUT_REL, F32_ACC, F32_OUT_REL};

fn order(l: BLayout) -> BOrder {
    match l {
        BLayout::KxN => BOrder::KxN,
        BLayout::NxK => BOrder::NxK,
    }
}

/// One `Decode` plan (max_m 256) launched at each of `ms` on one B, A and C buffers sized for
/// 256 rows (M is a launch argument); every element checked. Returns the count of shapes.
fn sweep(dev: &Device, n: usize, k: usize, b_layout: BLayout, ms: impl Iterator<Item = usize>) -> usize {
    let stream = dev.default_stream();
    let b = random_bf16(n * k, 7 + n as u64 + k as u64);
    let db = stream.clone_htod(&b).unwrap();
    let max_m = 256;
    let config = GemmConfig {
        max_m,
        n,
        k,
        b_layout,
        kernel: GemmKernel::Decode,
        ..GemmConfig::default()
    };
    let mut plan = GemmPlan::new(dev, config).unwrap();
    let mut da = stream.alloc_zeros::<bf16>(max_m * k).unwrap();
    let mut dc = stream.alloc_zeros::<bf16>(max_m * n).unwrap();
    let mut count = 0;
    let mut worst = 0f64;
    for m in ms {
        assert_eq!(GemmKernel::for_m(m), GemmKernel::Decode);
        let a = random_bf16(m * k, 1000 + m as u64);
        stream.memcpy_htod(&a, &mut da.slice_mut(..m * k)).unwrap();
        let t = GemmTensors {
            a: &da,
            b: &db,
            c: &mut dc,
        };
        let ran = plan.launch(&stream, t, m).unwrap();
        assert_eq!(ran.kernel, GemmKernel::Decode);
        let got: Vec<f64> = stream
            .clone_dtoh(&dc.slice(..m * n))
            .unwrap()
            .iter()
            .map(|x| x.to_f64())
            .collect();
        let (want, scale) = cpu_gemm(&a, &b, m, n, k, order(b_layout));
        let c = compare(&got, &want, &scale, BF16_OUT_REL, F32_ACC);
        assert_eq!(
            c.wrong,
            0,
            "decode gemm {m} x {n} x {k} B={b_layout:?} (bucket {:?}): wrong {} / {}; first (index, got, want) = {:?}",
            ran.tok,
            c.wrong,
            m * n,
            c.first_wrong
        );
        worst = worst.max(c.max_abs_err);
        count += 1;
    }
    println!("decode gemm M sweep on one plan, N = {n}, K = {k}, B = {b_layout:?}: {count} shapes correct, max |err| {worst:.3e}");
    count
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn decode_gemm_every_m_matches_cpu_reference() {
    let Some(dev) = device_or_skip("decode_gemm_every_m_matches_cpu_reference") else {
        return;
    };
    let mut shapes = 0;
    for b_layout in [BLayout::NxK, BLayout::KxN] {
        // N not a multiple of the 128-row tile, K not a multiple of 64: every M.
        shapes += sweep(&dev, 264, 200, b_layout, 1..=256);
        // Several tiles, a few units per CTA: every M.
        shapes += sweep(&dev, 1000, 520, b_layout, 1..=256);
        // 2 tiles of 64 K blocks over every SM: each tile summed from ~64 partials; bucket edges.
        shapes += sweep(
            &dev,
            256,
            4096,
            b_layout,
            [1, 7, 8, 9, 16, 17, 33, 64, 65, 100, 128, 129, 200, 256].into_iter(),
        );
    }
    // Odd N (N x K only; K x N needs N % 8 == 0) and a tiny problem.
    shapes += sweep(
        &dev,
        131,
        72,
        BLayout::NxK,
        [1, 2, 3, 5, 8, 13, 31, 97, 255, 256].into_iter(),
    );
    shapes += sweep(&dev, 8, 8, BLayout::KxN, [1, 8, 200].into_iter());
    println!("{shapes} decode shapes correct");
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn decode_gemm_f32_output_and_repeated_launches() {
    let Some(dev) = device_or_skip("decode_gemm_f32_output_and_repeated_launches") else {
        return;
    };
    let stream = dev.default_stream();
    for (m, n, k, b_layout) in [(5, 776, 1032, BLayout::NxK), (130, 520, 4096, BLayout::KxN)] {
        let shape = GemmShape { m, n, k, b_layout };
        let (a, b) = (random_bf16(m * k, 3), random_bf16(n * k, 4));
        let da = stream.clone_htod(&a).unwrap();
        let db = stream.clone_htod(&b).unwrap();
        let (want, scale) = cpu_gemm(&a, &b, m, n, k, order(b_layout));
        // f32 C.
        let mut dc = stream.alloc_zeros::<f32>(m * n).unwrap();
        gemm_bf16(&dev, &stream, &da, &db, &mut dc, shape).unwrap();
        let got: Vec<f64> = stream.clone_dtoh(&dc).unwrap().iter().map(|&x| x as f64).collect();
        let c = compare(&got, &want, &scale, F32_OUT_REL, F32_ACC);
        assert_eq!(c.wrong, 0, "f32 decode {m}x{n}x{k}: {c:?}");
        // One bf16 plan launched 4 times, C zeroed before each launch (a launch that left a
        // per-tile counter non-zero would make the next one skip that tile's reduction, leaving
        // zeros), on the full grid and on 7 CTAs (another split): each launch correct, and all
        // of one plan bitwise equal.
        for sms in [None, Some(7)] {
            let mut dc = stream.alloc_zeros::<bf16>(m * n).unwrap();
            let config = GemmConfig {
                sms,
                ..GemmConfig::for_shape(shape, OutDtype::Bf16)
            };
            let mut plan = GemmPlan::new(&dev, config).unwrap();
            let mut outs = vec![];
            for _ in 0..4 {
                stream.memset_zeros(&mut dc).unwrap();
                let t = GemmTensors {
                    a: &da,
                    b: &db,
                    c: &mut dc,
                };
                let ran = plan.launch(&stream, t, m).unwrap();
                assert_eq!(ran.kernel, GemmKernel::Decode);
                if let Some(cap) = sms {
                    assert!(ran.grid <= cap, "grid {} above the cap {cap}", ran.grid);
                }
                outs.push(stream.clone_dtoh(&dc).unwrap());
            }
            for o in &outs[1..] {
                assert_eq!(
                    &outs[0], o,
                    "repeated launches of {m}x{n}x{k} (sms {sms:?}) must be bitwise equal"
                );
            }
            let got: Vec<f64> = outs[0].iter().map(|x| x.to_f64()).collect();
            let c = compare(&got, &want, &scale, BF16_OUT_REL, F32_ACC);
            assert_eq!(c.wrong, 0, "bf16 decode {m}x{n}x{k} sms {sms:?}: {c:?}");
        }
        println!("decode gemm {m}x{n}x{k} B={b_layout:?}: f32 output, repeated launches, 7-CTA grid correct");
    }
}
