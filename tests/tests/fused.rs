//! Fused AllGather + GEMM across ranks (one process per GPU) against a CPU reference.
//! Run: `bundle/xtask launch -n 2 -- bundle/tests/mkernel-tests-fused`.
use half::bf16;
use mkernel::cudarc::driver::{DevicePtr, DevicePtrMut};
use mkernel::fused::{AgGemmPlan, GemmRsPlan};
use mkernel::{CommConfig, Communicator};
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::launched_rank_or_skip;
use mkernel_tests::reference::{compare, gemm as cpu_gemm, BOrder, BF16_OUT_REL, F32_ACC};

#[test]
fn fused_collectives_ag_gemm_matches_cpu_reference() {
    let Some((dev, boot)) = launched_rank_or_skip("fused_collectives_ag_gemm_matches_cpu_reference") else { return };
    let mut comm = Communicator::new(&dev, boot, CommConfig { heap_bytes: 512 << 20, ..Default::default() }).unwrap();
    let (rank, world) = (comm.rank() as usize, comm.world() as usize);
    let stream = dev.default_stream();
    let mut lines = vec![];
    for (case, &(m, n, k, n_comm)) in [(1024usize, 512usize, 256usize, 4u32), (2048, 768, 1024, 8), (4096, 256, 512, 16), (1024, 1000, 136, 1)].iter().enumerate() {
        let ms = m / world;
        let b = random_bf16(n * k, 7_000 + 10 * case as u64 + rank as u64);
        let db = stream.clone_htod(&b).unwrap();
        let mut da = stream.alloc_zeros::<bf16>(ms * k).unwrap();
        let mut dc = stream.alloc_zeros::<bf16>(m * n).unwrap();
        let (pa, pb, pc) = ({ let (p, _g) = da.device_ptr_mut(&stream); p }, { let (p, _g) = db.device_ptr(&stream); p }, { let (p, _g) = dc.device_ptr_mut(&stream); p });
        // SAFETY: buffers sized for the shape, alive until the end of the case.
        let plan = unsafe { AgGemmPlan::new(&mut comm, &stream, pa, pb, pc, m, n, k, n_comm) }.unwrap();
        for rep in 0..3u64 {
            let a_full = random_bf16(m * k, 9_000 + 100 * case as u64 + rep);
            stream.memcpy_htod(&a_full[rank * ms * k..(rank + 1) * ms * k], &mut da).unwrap();
            stream.synchronize().unwrap();
            plan.launch(&stream).unwrap();
            stream.synchronize().unwrap();
            comm.check().unwrap();
            let got: Vec<f64> = stream.clone_dtoh(&dc).unwrap().iter().map(|x| x.to_f64()).collect();
            let (want, scale) = cpu_gemm(&a_full, &b, m, n, k, BOrder::NxK);
            let c = compare(&got, &want, &scale, BF16_OUT_REL, F32_ACC);
            assert_eq!(c.wrong, 0, "rank {rank}: ag_gemm m {m} n {n} k {k} n_comm {n_comm} rep {rep}: {c:?}");
        }
        lines.push(format!("ag_gemm M {m} N {n} K {k}, {n_comm} comm CTAs of {}, 3 launches: every element within tolerance", plan.split().1));
    }
    // GEMM + ReduceScatter: K split over ranks, rank r gets row chunk r of the sum of partials.
    for (case, &(m, n, kl, n_reduce)) in [(1024usize, 512usize, 256usize, 4u32), (2048, 768, 512, 8), (512, 1000, 136, 1)].iter().enumerate() {
        let ms = m / world;
        let mut da = stream.alloc_zeros::<bf16>(m * kl).unwrap();
        let mut db = stream.alloc_zeros::<bf16>(n * kl).unwrap();
        let mut dout = stream.alloc_zeros::<bf16>(ms * n).unwrap();
        let (pa, pb, po) = ({ let (p, _g) = da.device_ptr_mut(&stream); p }, { let (p, _g) = db.device_ptr_mut(&stream); p }, { let (p, _g) = dout.device_ptr_mut(&stream); p });
        // SAFETY: buffers sized for the shape, alive until the end of the case.
        let plan = unsafe { GemmRsPlan::new(&mut comm, &stream, pa, pb, po, m, n, kl, n_reduce) }.unwrap();
        for rep in 0..3u64 {
            let seed = 20_000 + 100 * case as u64 + 10 * rep;
            let a_all: Vec<Vec<bf16>> = (0..world).map(|r| random_bf16(m * kl, seed + r as u64)).collect();
            let b_all: Vec<Vec<bf16>> = (0..world).map(|r| random_bf16(n * kl, seed + 5 + r as u64)).collect();
            stream.memcpy_htod(&a_all[rank], &mut da).unwrap();
            stream.memcpy_htod(&b_all[rank], &mut db).unwrap();
            stream.synchronize().unwrap();
            plan.launch(&stream).unwrap();
            stream.synchronize().unwrap();
            comm.check().unwrap();
            let got: Vec<f64> = stream.clone_dtoh(&dout).unwrap().iter().map(|x| x.to_f64()).collect();
            let (want, scale) = sum_of_partials(&a_all, &b_all, rank * ms..(rank + 1) * ms, n, kl);
            // Partials are rounded to bf16 before the f32 sum: two bf16 roundings.
            let c = compare(&got, &want, &scale, 2.0 * BF16_OUT_REL, 2.0 * BF16_OUT_REL);
            assert_eq!(c.wrong, 0, "rank {rank}: gemm_rs m {m} n {n} k_local {kl} n_reduce {n_reduce} rep {rep}: {c:?}");
        }
        lines.push(format!("gemm_rs M {m} N {n} K_local {kl}, {n_reduce} reduce CTAs of {}, 3 launches: every element within tolerance", plan.split().1));
    }
    // GEMM + AllReduce: every rank gets the whole sum (in the heap).
    for (case, &(m, n, kl, n_reduce)) in [(1024usize, 512usize, 256usize, 4u32), (512, 1000, 136, 2)].iter().enumerate() {
        let mut da = stream.alloc_zeros::<bf16>(m * kl).unwrap();
        let mut db = stream.alloc_zeros::<bf16>(n * kl).unwrap();
        let (pa, pb) = ({ let (p, _g) = da.device_ptr_mut(&stream); p }, { let (p, _g) = db.device_ptr_mut(&stream); p });
        // SAFETY: buffers sized for the shape, alive until the end of the case.
        let plan = unsafe { GemmRsPlan::new_all_reduce(&mut comm, &stream, pa, pb, m, n, kl, n_reduce) }.unwrap();
        let out = plan.all_reduce_output().unwrap();
        for rep in 0..3u64 {
            let seed = 40_000 + 100 * case as u64 + 10 * rep;
            let a_all: Vec<Vec<bf16>> = (0..world).map(|r| random_bf16(m * kl, seed + r as u64)).collect();
            let b_all: Vec<Vec<bf16>> = (0..world).map(|r| random_bf16(n * kl, seed + 5 + r as u64)).collect();
            stream.memcpy_htod(&a_all[rank], &mut da).unwrap();
            stream.memcpy_htod(&b_all[rank], &mut db).unwrap();
            stream.synchronize().unwrap();
            plan.launch(&stream).unwrap();
            stream.synchronize().unwrap();
            comm.check().unwrap();
            let mut raw = vec![0u8; m * n * 2];
            // SAFETY: the plan's output holds m x n bf16 in this rank's heap.
            unsafe { mkernel::cudarc::driver::result::memcpy_dtoh_sync(&mut raw, comm.ptr(&out)) }.unwrap();
            let got: Vec<f64> = raw.chunks(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64()).collect();
            let (want, scale) = sum_of_partials(&a_all, &b_all, 0..m, n, kl);
            let c = compare(&got, &want, &scale, 2.0 * BF16_OUT_REL, 2.0 * BF16_OUT_REL);
            assert_eq!(c.wrong, 0, "rank {rank}: gemm_ar m {m} n {n} k_local {kl} rep {rep}: {c:?}");
        }
        lines.push(format!("gemm_ar M {m} N {n} K_local {kl}, {n_reduce} reduce CTAs, 3 launches: whole sum on every rank, every element within tolerance"));
    }
    if rank == 0 {
        for l in lines {
            println!("[world {world}] {l}");
        }
    }
}

/// CPU reference of `sum_r a_r[rows] * b_r^T` (every rank's partial product, rows of A given),
/// with the per-element scale of `compare`.
fn sum_of_partials(a_all: &[Vec<bf16>], b_all: &[Vec<bf16>], rows: std::ops::Range<usize>, n: usize, kl: usize) -> (Vec<f64>, Vec<f64>) {
    let m = rows.len();
    let (mut want, mut scale) = (vec![0.0; m * n], vec![0.0; m * n]);
    for (a, b) in a_all.iter().zip(b_all) {
        let (p, s) = cpu_gemm(&a[rows.start * kl..rows.end * kl], b, m, n, kl, BOrder::NxK);
        for i in 0..m * n {
            want[i] += p[i];
            scale[i] += s[i];
        }
    }
    (want, scale)
}
