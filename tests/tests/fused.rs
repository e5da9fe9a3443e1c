//! Fused AllGather + GEMM across ranks (one process per GPU) against a CPU reference.
//! Run: `bundle/xtask launch -n 2 -- bundle/tests/mkernel-tests-fused`.
use half::bf16;
use mkernel::cudarc::driver::{DevicePtr, DevicePtrMut};
use mkernel::fused::AgGemmPlan;
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
    if rank == 0 {
        for l in lines {
            println!("[world {world}] {l}");
        }
    }
}
