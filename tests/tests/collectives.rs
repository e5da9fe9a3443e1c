//! Collectives across ranks (one process per GPU) against CPU references.
//! Run: `bundle/xtask launch -n 2 -- bundle/tests/mkernel-tests-collectives` (and -n 4, -n 8).
#[path = "support/reduce_data.rs"]
mod reduce_data;

use half::bf16;
use mkernel::{CommConfig, ReduceDtype};
use mkernel_tests::gpu::launched_comm_or_skip;
use mkernel_tests::reference::{compare, Comparison, BF16_OUT_REL, F32_ACC, F32_OUT_REL};
use reduce_data::{decode, dtoh, htod, values};

fn seed(rank: u32, case: u64, rep: u64) -> u64 {
    1_000_000 * case + 1000 * rep + rank as u64
}

/// `got` (`count` elements) against the sums over the ranks' `vals` at elements `lo..lo + count`,
/// each within `rel` of its sum of magnitudes.
fn compare_sum(got: &[f64], vals: &[Vec<f64>], lo: usize, count: usize, rel: f64) -> Comparison {
    let want: Vec<f64> = (0..count).map(|i| vals.iter().map(|v| v[lo + i]).sum()).collect();
    let scale: Vec<f64> = (0..count).map(|i| vals.iter().map(|v| v[lo + i].abs()).sum()).collect();
    compare(got, &want, &scale, rel, F32_ACC)
}

/// The output tolerance of a sum in `dtype`.
fn out_rel(dtype: ReduceDtype) -> f64 {
    if dtype == ReduceDtype::Bf16 {
        BF16_OUT_REL
    } else {
        F32_OUT_REL
    }
}

/// Every rank's input as f64, and its bit pattern to upload.
fn inputs(world: u32, len: usize, dtype: ReduceDtype, case: u64, rep: u64) -> (Vec<Vec<f64>>, Vec<Vec<u8>>) {
    (0..world).map(|r| values(len, dtype, seed(r, case, rep))).unzip()
}

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs it under xtask launch)"]
fn collectives_match_cpu_reference() {
    let timeout = CommConfig::default().timeout;
    let Some((dev, comm)) = launched_comm_or_skip("collectives_match_cpu_reference", 1 << 30, timeout) else {
        return;
    };
    let (rank, world) = (comm.rank(), comm.world());
    let stream = dev.default_stream();
    let big = comm.alloc(256 << 20).unwrap();
    let big2 = comm.alloc(256 << 20).unwrap();
    // Local buffers, passed to the collectives as views of their first elements.
    let mut local = stream.alloc_zeros::<u8>(64 << 20).unwrap();
    let mut local_bf16 = stream.alloc_zeros::<bf16>(3 << 20).unwrap();
    let mut local_f32 = stream.alloc_zeros::<f32>(3 << 20).unwrap();
    let mut case = 0u64;
    let mut lines = vec![];

    // AllGather: bytes per rank x CTAs, three launches each (epochs advance, no reset).
    for &bytes in &[16u64, 4096, (1 << 20) + 48, 8 << 20] {
        for &ctas in &[1u32, 7, 32] {
            case += 1;
            for rep in 0..3 {
                let (_, all) = inputs(world, bytes as usize, ReduceDtype::F32, case, rep); // bytes as raw data
                let all: Vec<Vec<u8>> = all.into_iter().map(|v| v[..bytes as usize].to_vec()).collect();
                let n = bytes as usize;
                stream
                    .memcpy_htod(&all[rank as usize], &mut local.slice_mut(..n))
                    .unwrap();
                comm.all_gather(&stream, &local.slice(..n), &big, ctas).unwrap();
                stream.synchronize().unwrap();
                comm.check().unwrap();
                let got = dtoh(comm.ptr(&big).unwrap(), (bytes * world as u64) as usize);
                let want: Vec<u8> = all.concat();
                assert!(
                    got == want,
                    "rank {rank}: all_gather {bytes} B x {ctas} CTAs rep {rep} differs"
                );
            }
            lines.push(format!(
                "all_gather {bytes:>8} B/rank, {ctas:>2} CTAs, 3 launches: exact"
            ));
        }
    }

    // ReduceScatter and AllReduce, bf16 and f32, including counts whose chunks are uneven.
    for dtype in [ReduceDtype::Bf16, ReduceDtype::F32] {
        let esize = dtype.size() as usize;
        for &count in &[8usize, 4096, 100_000, 3 << 20] {
            let count = count / (16 / esize) * (16 / esize); // whole 16-byte vectors per rank
            for &ctas in &[1u32, 16] {
                case += 1;
                for rep in 0..2 {
                    let (vals, raw) = inputs(world, count * world as usize, dtype, case, rep);
                    htod(comm.ptr(&big).unwrap(), &raw[rank as usize]);
                    let got: Vec<f64> = match dtype {
                        ReduceDtype::Bf16 => {
                            let mut dst = local_bf16.slice_mut(..count);
                            comm.reduce_scatter(&stream, &big, &mut dst, ctas).unwrap();
                            stream.clone_dtoh(&dst).unwrap().iter().map(|x| x.to_f64()).collect()
                        }
                        ReduceDtype::F32 => {
                            let mut dst = local_f32.slice_mut(..count);
                            comm.reduce_scatter(&stream, &big, &mut dst, ctas).unwrap();
                            stream.clone_dtoh(&dst).unwrap().iter().map(|&x| x as f64).collect()
                        }
                    };
                    comm.check().unwrap();
                    let lo = rank as usize * count;
                    let c = compare_sum(&got, &vals, lo, count, out_rel(dtype));
                    assert_eq!(
                        c.wrong, 0,
                        "rank {rank}: reduce_scatter {dtype:?} count {count} ctas {ctas}: {c:?}"
                    );
                }
                lines.push(format!(
                    "reduce_scatter {dtype:?} {count:>8}/rank, {ctas:>2} CTAs: all elements within tolerance"
                ));
            }
        }
        for &count in &[8usize, 1000, 123_456, 4 << 20] {
            let count = count / (16 / esize) * (16 / esize);
            for (in_place, ctas) in [(false, 3u32), (true, 24)] {
                case += 1;
                let dst = if in_place { big } else { big2 };
                let (vals, raw) = inputs(world, count, dtype, case, 0);
                htod(comm.ptr(&big).unwrap(), &raw[rank as usize]);
                comm.all_reduce(&stream, &big, &dst, count as u64, dtype, ctas).unwrap();
                stream.synchronize().unwrap();
                comm.check().unwrap();
                let got = decode(&dtoh(comm.ptr(&dst).unwrap(), count * esize), dtype);
                let c = compare_sum(&got, &vals, 0, count, out_rel(dtype));
                assert_eq!(
                    c.wrong, 0,
                    "rank {rank}: all_reduce {dtype:?} count {count} in_place {in_place}: {c:?}"
                );
                lines.push(format!(
                    "all_reduce {dtype:?} {count:>8}, in place {in_place}, {ctas} CTAs: all elements within tolerance"
                ));
            }
        }
    }

    // Many launches back to back with no host synchronization, alternating the staged and the
    // direct paths (staging credits and epochs must keep the ranks in step).
    {
        case += 1;
        let small = 8192usize; // bf16 elements: 16 KiB, staged
        let big_bytes = 2u64 << 20; // per rank, direct
        let (vals, raw) = inputs(world, small, ReduceDtype::Bf16, case, 0);
        let small_in = comm.alloc(small as u64 * 2).unwrap();
        let small_out = comm.alloc(small as u64 * 2).unwrap();
        let gather_out = comm.alloc(big_bytes * world as u64).unwrap();
        htod(comm.ptr(&small_in).unwrap(), &raw[rank as usize]);
        let (_, gathered) = inputs(world, big_bytes as usize / 4, ReduceDtype::F32, case + 1, 0);
        let src = stream.clone_htod(&gathered[rank as usize]).unwrap();
        for _ in 0..50 {
            comm.all_reduce(&stream, &small_in, &small_out, small as u64, ReduceDtype::Bf16, 2)
                .unwrap();
            comm.all_gather(&stream, &src, &gather_out, 16).unwrap();
        }
        stream.synchronize().unwrap();
        comm.check().unwrap();
        let got = decode(&dtoh(comm.ptr(&small_out).unwrap(), small * 2), ReduceDtype::Bf16);
        assert_eq!(
            compare_sum(&got, &vals, 0, small, BF16_OUT_REL).wrong,
            0,
            "rank {rank}: back-to-back all_reduce"
        );
        assert!(
            dtoh(comm.ptr(&gather_out).unwrap(), (big_bytes * world as u64) as usize) == gathered.concat(),
            "rank {rank}: back-to-back all_gather"
        );
        lines.push("50 x (staged all_reduce + direct all_gather) back to back without host sync: correct".into());
    }

    // The same all_reduce captured once in a CUDA graph and replayed with new inputs.
    {
        use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let gstream = dev.context().new_stream().unwrap();
        let count = 65536usize;
        gstream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        comm.all_reduce(&gstream, &big, &big2, count as u64, ReduceDtype::Bf16, 8)
            .unwrap();
        let graph = gstream
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("graph");
        for rep in 0..3 {
            case += 1;
            let (vals, raw) = inputs(world, count, ReduceDtype::Bf16, case, rep);
            htod(comm.ptr(&big).unwrap(), &raw[rank as usize]);
            comm.bootstrap()
                .store()
                .barrier(&format!("graph-input-{rep}"), std::time::Duration::from_secs(30))
                .unwrap();
            graph.launch().unwrap();
            gstream.synchronize().unwrap();
            comm.check().unwrap();
            let got = decode(&dtoh(comm.ptr(&big2).unwrap(), count * 2), ReduceDtype::Bf16);
            let c = compare_sum(&got, &vals, 0, count, BF16_OUT_REL);
            assert_eq!(c.wrong, 0, "rank {rank}: graph replay {rep}: {c:?}");
            comm.bootstrap()
                .store()
                .barrier(&format!("graph-output-{rep}"), std::time::Duration::from_secs(30))
                .unwrap();
        }
        lines.push("all_reduce captured in a CUDA graph, replayed 3 times with new inputs: correct".into());
    }
    if rank == 0 {
        for l in lines {
            println!("[world {world}] {l}");
        }
    }
}
