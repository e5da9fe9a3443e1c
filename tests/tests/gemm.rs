//! GEMM on the GPU against the CPU reference: tails, small M, both B layouts, f32 output,
//! and rejection of bad input.
use half::bf16;
use mkernel::gemm::{gemm_bf16, BLayout, GemmPlan, GemmShape, OutDtype};
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
    let first = {
        let plan = GemmPlan::new(&dev, &stream, &da, &db, &mut dc, shape, Some(7)).unwrap();
        plan.launch(&stream).unwrap();
        for _ in 0..20 {
            plan.launch(&stream).unwrap();
        }
        stream.synchronize().unwrap();
        plan.grid()
    };
    assert_eq!(first, 7, "the sms cap sets the grid");
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
    // SAFETY: rejected before any use of the pointers.
    let misaligned = unsafe {
        GemmPlan::new_raw(
            &dev,
            &stream,
            0x1002,
            0x2000,
            0x3000,
            GemmShape {
                m: 8,
                n: 8,
                k: 8,
                b_layout: BLayout::NxK,
            },
            OutDtype::Bf16,
            None,
        )
    };
    assert!(matches!(misaligned, Err(Error::Alignment { what: "A", .. })));
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn gemm_plan_replays_in_a_cuda_graph() {
    let Some(dev) = device_or_skip("gemm_plan_replays_in_a_cuda_graph") else {
        return;
    };
    use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let ctx = dev.context().clone();
    // One stream only: no cross-stream event tracking inside the capture.
    // SAFETY: this test's buffers are used on `stream` alone.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let shape = GemmShape {
        m: 300,
        n: 512,
        k: 256,
        b_layout: BLayout::KxN,
    };
    let (la, lb, lc) = shape.lens();
    let (a, b) = (random_bf16(la, 5), random_bf16(lb, 6));
    let da = stream.clone_htod(&a).unwrap();
    let db = stream.clone_htod(&b).unwrap();
    let mut dc = stream.alloc_zeros::<bf16>(lc).unwrap();
    let got = {
        let plan = GemmPlan::new(&dev, &stream, &da, &db, &mut dc, shape, None).unwrap();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        plan.launch(&stream).unwrap();
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured graph");
        for _ in 0..3 {
            graph.launch().unwrap();
        }
        stream.synchronize().unwrap();
        drop(graph);
        plan.grid()
    };
    assert!(got > 0);
    let out: Vec<f64> = stream.clone_dtoh(&dc).unwrap().iter().map(|x| x.to_f64()).collect();
    let (want, scale) = cpu_gemm(&a, &b, shape.m, shape.n, shape.k, BOrder::KxN);
    let c = compare(&out, &want, &scale, BF16_OUT_REL, F32_ACC);
    assert_eq!(c.wrong, 0, "graph replay: {c:?}");
    // SAFETY: restores the default for the other tests.
    unsafe { ctx.enable_event_tracking() };
    println!(
        "gemm {}x{}x{} replayed 3 times from a CUDA graph: correct",
        shape.m, shape.n, shape.k
    );
}
