//! GEMM on the GPU against the CPU reference: tails, small M, both B layouts, f32 output, M
//! chosen per launch on one plan, graph replay on new inputs, a buffer freed after a launch on
//! another stream, and rejection of bad input.
use half::bf16;
use mkernel::gemm::{gemm_bf16, BLayout, GemmConfig, GemmKernel, GemmPlan, GemmShape, GemmTensors, OutDtype};
use mkernel::{Device, Error};
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::device_or_skip;
use mkernel_tests::reference::{compare, gemm as cpu_gemm, BOrder, BF16_OUT_REL, F32_ACC, F32_OUT_REL};

fn order(l: BLayout) -> BOrder {
    match l {
        BLayout::KxN => BOrder::KxN,
        BLayout::NxK => BOrder::NxK,
    }
}

/// Runs one shape and checks every element; returns a line for the log.
fn check_shape(dev: &Device, shape: GemmShape, out: OutDtype, seed: u64) -> String {
    let stream = dev.default_stream();
    let (la, lb, lc) = shape.lens();
    let a = random_bf16(la, seed);
    let b = random_bf16(lb, seed + 1);
    let da = stream.clone_htod(&a).unwrap();
    let db = stream.clone_htod(&b).unwrap();
    let got: Vec<f64> = match out {
        OutDtype::Bf16 => {
            let mut dc = stream.alloc_zeros::<bf16>(lc).unwrap();
            gemm_bf16(dev, &stream, &da, &db, &mut dc, shape).unwrap();
            stream.clone_dtoh(&dc).unwrap().iter().map(|x| x.to_f64()).collect()
        }
        OutDtype::F32 => {
            let mut dc = stream.alloc_zeros::<f32>(lc).unwrap();
            gemm_bf16(dev, &stream, &da, &db, &mut dc, shape).unwrap();
            stream.clone_dtoh(&dc).unwrap().iter().map(|&x| x as f64).collect()
        }
    };
    let (want, scale) = cpu_gemm(&a, &b, shape.m, shape.n, shape.k, order(shape.b_layout));
    let rel = if out == OutDtype::F32 {
        F32_OUT_REL
    } else {
        BF16_OUT_REL
    };
    let c = compare(&got, &want, &scale, rel, F32_ACC);
    let line = format!(
        "gemm {:>5} x {:>5} x {:>5} B={:?} out={:?}: wrong {} / {}, max |err| {:.3e}",
        shape.m, shape.n, shape.k, shape.b_layout, out, c.wrong, lc, c.max_abs_err
    );
    assert_eq!(
        c.wrong, 0,
        "{line}; first wrong (index, got, want) = {:?}",
        c.first_wrong
    );
    line
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_matches_cpu_reference_on_many_shapes() {
    let Some(dev) = device_or_skip("gemm_matches_cpu_reference_on_many_shapes") else {
        return;
    };
    use BLayout::*;
    let shapes: &[(usize, usize, usize, BLayout)] = &[
        (128, 256, 64, NxK),     // one tile, one K block
        (256, 512, 1024, NxK),   // several tiles and K blocks
        (1, 256, 512, NxK),      // decode: M = 1
        (7, 1001, 264, NxK),     // M, N tails; odd N (scalar edge stores); K not a multiple of 64
        (64, 384, 4096, NxK),    // half-empty M tile, long K
        (333, 777, 200, NxK),    // everything ragged
        (4096, 4096, 512, NxK),  // 256 tiles: several per CTA on the persistent grid
        (2048, 2048, 8192, NxK), // long K on many tiles
        (1024, 1024, 1024, KxN), // B row-major K x N
        (100, 264, 136, KxN),    // tails with K x N
        (128, 8, 8, KxN),        // tiny N and K
        (513, 2048, 2048, KxN),  // M tail, several tiles
        (16, 4096, 4096, KxN),   // decode-like M = 16
    ];
    for (i, &(m, n, k, b_layout)) in shapes.iter().enumerate() {
        println!(
            "{}",
            check_shape(&dev, GemmShape { m, n, k, b_layout }, OutDtype::Bf16, 10 + i as u64)
        );
    }
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_f32_output() {
    let Some(dev) = device_or_skip("gemm_f32_output") else {
        return;
    };
    println!(
        "{}",
        check_shape(
            &dev,
            GemmShape {
                m: 300,
                n: 520,
                k: 128,
                b_layout: BLayout::NxK
            },
            OutDtype::F32,
            99
        )
    );
    println!(
        "{}",
        check_shape(
            &dev,
            GemmShape {
                m: 129,
                n: 264,
                k: 1024,
                b_layout: BLayout::KxN
            },
            OutDtype::F32,
            98
        )
    );
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_repeated_launches_of_one_plan_agree() {
    let Some(dev) = device_or_skip("gemm_repeated_launches_of_one_plan_agree") else {
        return;
    };
    let stream = dev.default_stream();
    let shape = GemmShape {
        m: 512,
        n: 1024,
        k: 512,
        b_layout: BLayout::NxK,
    };
    let (la, lb, lc) = shape.lens();
    let da = stream.clone_htod(&random_bf16(la, 1)).unwrap();
    let db = stream.clone_htod(&random_bf16(lb, 2)).unwrap();
    let mut dc = stream.alloc_zeros::<bf16>(lc).unwrap();
    let config = GemmConfig {
        sms: Some(7),
        ..GemmConfig::for_shape(shape, OutDtype::Bf16)
    };
    let mut plan = GemmPlan::new(&dev, config).unwrap();
    let mut grid = 0;
    for _ in 0..21 {
        let t = GemmTensors {
            a: &da,
            b: &db,
            c: &mut dc,
        };
        grid = plan.launch(&stream, t, shape.m).unwrap().grid;
    }
    stream.synchronize().unwrap();
    assert_eq!(grid, 7, "the sms cap sets the grid");
    let again = stream.clone_dtoh(&dc).unwrap();
    let mut dc2 = stream.alloc_zeros::<bf16>(lc).unwrap();
    gemm_bf16(&dev, &stream, &da, &db, &mut dc2, shape).unwrap();
    assert_eq!(
        again,
        stream.clone_dtoh(&dc2).unwrap(),
        "7-CTA and full-grid results must be bitwise equal"
    );
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_rejects_bad_input() {
    let Some(dev) = device_or_skip("gemm_rejects_bad_input") else {
        return;
    };
    let stream = dev.default_stream();
    let a = stream.alloc_zeros::<bf16>(256 * 100).unwrap();
    let b = stream.alloc_zeros::<bf16>(256 * 100).unwrap();
    let mut c = stream.alloc_zeros::<bf16>(128 * 256).unwrap();
    let bad_k = GemmShape {
        m: 128,
        n: 256,
        k: 100,
        b_layout: BLayout::NxK,
    };
    assert!(matches!(
        gemm_bf16(&dev, &stream, &a, &b, &mut c, bad_k),
        Err(Error::Shape { .. })
    ));
    let too_big = GemmShape {
        m: 256,
        n: 256,
        k: 96,
        b_layout: BLayout::NxK,
    };
    let e = gemm_bf16(&dev, &stream, &a, &b, &mut c, too_big).unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { what: "C", .. }), "{e}");
    // Plans: configurations refused before anything is allocated.
    let config = GemmConfig {
        max_m: 64,
        n: 64,
        k: 64,
        ..GemmConfig::default()
    };
    for bad in [
        GemmConfig::default(),
        GemmConfig {
            max_m: 300,
            kernel: GemmKernel::Decode,
            ..config
        },
        GemmConfig { sms: Some(0), ..config },
    ] {
        let e = GemmPlan::new(&dev, bad).err().expect("refused");
        assert!(matches!(e, Error::Shape { .. }), "{bad:?}: {e}");
    }
    // Launches: M outside 1..=max_m, C of the other type, a misaligned buffer.
    let mut plan = GemmPlan::new(&dev, config).unwrap();
    for m in [0, 65] {
        let t = GemmTensors {
            a: &a,
            b: &b,
            c: &mut c,
        };
        let e = plan.launch(&stream, t, m).unwrap_err();
        assert!(
            matches!(&e, Error::Shape { reason, .. } if reason.contains("max_m")),
            "{e}"
        );
    }
    let mut c32 = stream.alloc_zeros::<f32>(64 * 64).unwrap();
    let e = plan
        .launch(
            &stream,
            GemmTensors {
                a: &a,
                b: &b,
                c: &mut c32,
            },
            8,
        )
        .unwrap_err();
    assert!(
        matches!(&e, Error::Shape { reason, .. } if reason.contains("GemmConfig::out")),
        "{e}"
    );
    let a_off = a.slice(1..);
    let e = plan
        .launch(
            &stream,
            GemmTensors {
                a: &a_off,
                b: &b,
                c: &mut c,
            },
            8,
        )
        .unwrap_err();
    assert!(matches!(e, Error::Alignment { what: "A", .. }), "{e}");
    let short = stream.alloc_zeros::<bf16>(8 * 64 - 1).unwrap();
    let e = plan
        .launch(
            &stream,
            GemmTensors {
                a: &short,
                b: &b,
                c: &mut c,
            },
            8,
        )
        .unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { what: "A", .. }), "{e}");
}

/// One plan launched with M = 1, 7, 128 and max_m in turn (and back down), on buffers sized for
/// max_m: each launch against the CPU reference, and the rows of C past M untouched. `Auto`
/// runs M <= 256 on the decode kernels and larger M on the tiled kernel; `Tiled` and `Decode`
/// plans run every M on their kernel.
#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_m_varies_per_launch_on_one_plan() {
    let Some(dev) = device_or_skip("gemm_m_varies_per_launch_on_one_plan") else {
        return;
    };
    let stream = dev.default_stream();
    let cases: &[(usize, usize, usize, BLayout, GemmKernel, OutDtype)] = &[
        (384, 1000, 520, BLayout::NxK, GemmKernel::Auto, OutDtype::Bf16),
        (300, 264, 136, BLayout::KxN, GemmKernel::Auto, OutDtype::Bf16),
        (333, 777, 200, BLayout::NxK, GemmKernel::Tiled, OutDtype::Bf16),
        (256, 520, 1032, BLayout::KxN, GemmKernel::Decode, OutDtype::Bf16),
        (300, 520, 128, BLayout::NxK, GemmKernel::Auto, OutDtype::F32),
    ];
    // Exact in bf16 and f32, and far from any product of these inputs.
    const SENTINEL: f32 = 12288.0;
    for (i, &(max_m, n, k, b_layout, kernel, out)) in cases.iter().enumerate() {
        let config = GemmConfig {
            max_m,
            n,
            k,
            b_layout,
            out,
            kernel,
            sms: None,
        };
        let mut plan = GemmPlan::new(&dev, config).unwrap();
        let b = random_bf16(n * k, 50 + i as u64);
        let db = stream.clone_htod(&b).unwrap();
        let mut da = stream.alloc_zeros::<bf16>(max_m * k).unwrap();
        let mut dc16 = stream.alloc_zeros::<bf16>(max_m * n).unwrap();
        let mut dc32 = stream.alloc_zeros::<f32>(max_m * n).unwrap();
        let mut ran = vec![];
        for (j, m) in [1, 7, 128, max_m, 7].into_iter().enumerate() {
            let a = random_bf16(m * k, 100 * i as u64 + j as u64);
            stream.memcpy_htod(&a, &mut da.slice_mut(..m * k)).unwrap();
            let got: Vec<f64> = match out {
                OutDtype::Bf16 => {
                    stream
                        .memcpy_htod(&vec![bf16::from_f32(SENTINEL); max_m * n], &mut dc16)
                        .unwrap();
                    let t = GemmTensors {
                        a: &da,
                        b: &db,
                        c: &mut dc16,
                    };
                    ran.push((m, plan.launch(&stream, t, m).unwrap()));
                    stream.clone_dtoh(&dc16).unwrap().iter().map(|x| x.to_f64()).collect()
                }
                OutDtype::F32 => {
                    stream.memcpy_htod(&vec![SENTINEL; max_m * n], &mut dc32).unwrap();
                    let t = GemmTensors {
                        a: &da,
                        b: &db,
                        c: &mut dc32,
                    };
                    ran.push((m, plan.launch(&stream, t, m).unwrap()));
                    stream.clone_dtoh(&dc32).unwrap().iter().map(|&x| x as f64).collect()
                }
            };
            let (want, scale) = cpu_gemm(&a, &b, m, n, k, order(b_layout));
            let rel = if out == OutDtype::F32 {
                F32_OUT_REL
            } else {
                BF16_OUT_REL
            };
            let c = compare(&got[..m * n], &want, &scale, rel, F32_ACC);
            assert_eq!(
                c.wrong,
                0,
                "plan {config:?}, launch with M = {m}: wrong {} / {}; first (index, got, want) = {:?}",
                c.wrong,
                m * n,
                c.first_wrong
            );
            let past = got[m * n..].iter().filter(|&&x| x != SENTINEL as f64).count();
            assert_eq!(
                past, 0,
                "plan {config:?}, M = {m}: {past} elements of C past row M were written"
            );
            let want_kernel = match kernel {
                GemmKernel::Auto => GemmKernel::for_m(m),
                k => k,
            };
            assert_eq!(ran.last().unwrap().1.kernel, want_kernel, "M = {m}");
        }
        println!(
            "gemm plan max_m {max_m} x {n} x {k} B={b_layout:?} {kernel:?} {out:?}: launches {:?} correct, rows past M untouched",
            ran.iter()
                .map(|(m, r)| format!("M={m}:{:?}/{}/{:?}", r.kernel, r.grid, r.tok))
                .collect::<Vec<_>>()
        );
    }
}

/// A launch's C is replayed from a CUDA graph on new inputs: `launch_captured` on a plan whose
/// first capture runs the tiled kernel (M = 300) and second the decode kernels (M = 5, the
/// plan's workspace); the safe `launch` refuses the capturing stream. Each replay, after new A
/// is copied into the captured input buffer, equals the direct launch on that A bitwise.
#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_plan_replays_in_a_cuda_graph() {
    let Some(dev) = device_or_skip("gemm_plan_replays_in_a_cuda_graph") else {
        return;
    };
    use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let stream = dev.context().new_stream().unwrap();
    let (max_m, n, k) = (300, 512, 256);
    let b = random_bf16(k * n, 6);
    let db = stream.clone_htod(&b).unwrap();
    let config = GemmConfig {
        max_m,
        n,
        k,
        b_layout: BLayout::KxN,
        ..GemmConfig::default()
    };
    let mut plan = GemmPlan::new(&dev, config).unwrap();
    for (m, want_kernel) in [(300, GemmKernel::Tiled), (5, GemmKernel::Decode)] {
        let inputs: Vec<Vec<bf16>> = (0..2).map(|s| random_bf16(m * k, 70 + s + m as u64)).collect();
        let d_inputs: Vec<_> = inputs.iter().map(|a| stream.clone_htod(a).unwrap()).collect();
        // The direct launches.
        let mut want = vec![];
        for da in &d_inputs {
            let mut dc = stream.alloc_zeros::<bf16>(m * n).unwrap();
            let t = GemmTensors {
                a: da,
                b: &db,
                c: &mut dc,
            };
            assert_eq!(plan.launch(&stream, t, m).unwrap().kernel, want_kernel);
            want.push(stream.clone_dtoh(&dc).unwrap());
        }
        let mut a_in = stream.alloc_zeros::<bf16>(m * k).unwrap();
        let mut c = stream.alloc_zeros::<bf16>(m * n).unwrap();
        stream.synchronize().unwrap();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let t = GemmTensors {
            a: &a_in,
            b: &db,
            c: &mut c,
        };
        let e = plan.launch(&stream, t, m).unwrap_err();
        assert!(matches!(e, Error::Capturing { .. }), "{e}");
        let t = GemmTensors {
            a: &a_in,
            b: &db,
            c: &mut c,
        };
        // SAFETY: a_in, db and c outlive the graph (dropped after it, at the end of this
        // iteration, once the last replay's result was read on the same stream); the plan
        // (whose workspace the decode capture uses) outlives it too, and nothing else launches
        // the plan while the graph is replayed.
        let ran = unsafe { plan.launch_captured(&stream, t, m) }.unwrap();
        assert_eq!(ran.kernel, want_kernel);
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured graph");
        for i in [0, 1, 0, 1] {
            stream.memcpy_dtod(&d_inputs[i], &mut a_in).unwrap();
            graph.launch().unwrap();
            let got = stream.clone_dtoh(&c).unwrap();
            assert!(
                got.iter().zip(&want[i]).all(|(x, y)| x.to_bits() == y.to_bits()),
                "M = {m}: the replay on input {i} differs from the direct launch"
            );
        }
        stream.synchronize().unwrap();
        drop(graph);
        let (expect, scale) = cpu_gemm(&inputs[1], &b, m, n, k, BOrder::KxN);
        let got: Vec<f64> = want[1].iter().map(|x| x.to_f64()).collect();
        let cmp = compare(&got, &expect, &scale, BF16_OUT_REL, F32_ACC);
        assert_eq!(cmp.wrong, 0, "M = {m}: {cmp:?}");
        println!("gemm {m}x{n}x{k} ({want_kernel:?}) captured once, replayed 4 times on new A: bitwise equal to the direct launches, correct");
    }
}

/// The serving-loop issue's scenario for GEMM: a launch on stream s1 writes C, allocated on s0;
/// C (and the plan) are dropped right after the launch is enqueued, and s0 allocates a zeroed
/// buffer of the same size (cudarc's stream-ordered allocator hands the freed address back).
/// The launch held C's write guard until it was enqueued, so the free waits for the kernel and
/// the new buffer stays zero. Both kernels: tiled (8192^3) and decode (M = 128 over 28672 x 8192
/// weights, the plan's workspace freed with the plan).
#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_output_freed_after_a_launch_on_another_stream_is_not_written() {
    let Some(dev) = device_or_skip("gemm_output_freed_after_a_launch_on_another_stream_is_not_written") else {
        return;
    };
    let s0 = dev.context().new_stream().unwrap();
    let s1 = dev.context().new_stream().unwrap();
    for (m, n, k) in [(8192, 8192, 8192), (128, 28672, 8192)] {
        let a = s0.clone_htod(&random_bf16(m * k, 21)).unwrap();
        let b = s0.clone_htod(&random_bf16(n * k, 22)).unwrap();
        let len = m * n;
        for round in 0..5 {
            s0.synchronize().unwrap();
            let mut plan = GemmPlan::new(
                &dev,
                GemmConfig {
                    max_m: m,
                    n,
                    k,
                    ..GemmConfig::default()
                },
            )
            .unwrap();
            let mut c = s0.alloc_zeros::<bf16>(len).unwrap();
            // The address, read before the launch (a guard taken afterwards would make s0 wait
            // for the kernel and hide what is tested).
            let freed = {
                use mkernel::cudarc::driver::DevicePtr;
                c.device_ptr(&s0).0
            };
            let t = GemmTensors {
                a: &a,
                b: &b,
                c: &mut c,
            };
            let ran = plan.launch(&s1, t, m).unwrap();
            drop(plan);
            drop(c);
            let fresh = s0.alloc_zeros::<bf16>(len).unwrap();
            let same = {
                use mkernel::cudarc::driver::DevicePtr;
                fresh.device_ptr(&s0).0 == freed
            };
            s1.synchronize().unwrap();
            s0.synchronize().unwrap();
            let host = s0.clone_dtoh(&fresh).unwrap();
            let nonzero = host.iter().filter(|x| x.to_bits() != 0).count();
            println!(
                "{m}x{n}x{k} ({:?}) round {round}: new allocation at the freed address: {same}; non-zero elements: {nonzero} of {len}",
                ran.kernel
            );
            assert_eq!(nonzero, 0, "the kernel wrote into memory freed after its launch");
        }
    }
}
