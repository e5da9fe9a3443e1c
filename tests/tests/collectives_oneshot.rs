//! AllReduce through every path (LL, one-shot, two-shot, bandwidth) and through the policy,
//! against the CPU reference, at 8 B .. 1 MiB (powers of two and odd counts), bf16 and f32, in
//! place and not; then CUDA-graph replays with new data each.
//! Run: `bundle/xtask launch -n 2 -- bundle/tests/mkernel-tests-collectives_oneshot` (and -n 3, -n 4;
//! `--share-gpu` where ranks share one GPU). `MKERNEL_GRAPH_REPLAYS` sets the replays per graph
//! (default 1000).
#[path = "support/reduce_data.rs"]
mod reduce_data;

use mkernel::comm::{AllReduceMsg, Overlap};
use mkernel::{AllReducePath, CommConfig, ReduceDtype, SymBuffer};
use mkernel_tests::gpu::launched_comm_or_skip;
use mkernel_tests::reference::{compare, Comparison, BF16_OUT_REL, F32_ACC, F32_OUT_REL};
use reduce_data::{decode, dtoh, htod, values};
use std::collections::BTreeSet;

/// Bytes past the reduced elements that must stay untouched (the tail ends inside them).
const GUARD: usize = 32;
/// The byte every destination is filled with before a launch (0xffff is a bf16 NaN, 0xffffffff
/// an f32 NaN): an element the kernel forgot stays NaN and fails the comparison.
const POISON: u8 = 0xff;

fn seed(rank: u32, case: u64) -> u64 {
    7_000_000 + 1000 * case + rank as u64
}

/// `got` against the sums over the ranks' `vals`, each within `rel` of its sum of magnitudes.
fn compare_sum(got: &[f64], vals: &[Vec<f64>], rel: f64) -> Comparison {
    let want: Vec<f64> = (0..got.len()).map(|i| vals.iter().map(|v| v[i]).sum()).collect();
    let scale: Vec<f64> = (0..got.len()).map(|i| vals.iter().map(|v| v[i].abs()).sum()).collect();
    compare(got, &want, &scale, rel, F32_ACC)
}

fn out_rel(dtype: ReduceDtype) -> f64 {
    if dtype == ReduceDtype::Bf16 {
        BF16_OUT_REL
    } else {
        F32_OUT_REL
    }
}

/// Every rank's input as f64, and this rank's bytes to upload.
fn inputs(world: u32, rank: u32, count: usize, dtype: ReduceDtype, case: u64) -> (Vec<Vec<f64>>, Vec<u8>) {
    let mut mine = vec![];
    let vals = (0..world)
        .map(|r| {
            let (v, raw) = values(count, dtype, seed(r, case));
            if r == rank {
                mine = raw;
            }
            v
        })
        .collect();
    (vals, mine)
}

/// The element counts of the sweep for `dtype`: every power-of-two size from 8 B to 1 MiB, and
/// odd counts (not a multiple of 16 bytes, so the tail path runs) up to 1 MiB.
fn counts(dtype: ReduceDtype) -> Vec<usize> {
    let esize = dtype.size() as usize;
    let mut v: Vec<usize> = (3..=20).map(|k| (1usize << k) / esize).collect();
    v.extend([1, 3, 5, 7, 9, 1001, 12_345, 65_537, (1 << 20) / esize - 3]);
    v
}

/// One AllReduce of `count` elements through `path` (`None`: the policy) from `src` into
/// `dst`, checked against the reference; also checks that the `GUARD` bytes after the result
/// kept their poison. Returns the path the policy takes for this message.
#[allow(clippy::too_many_arguments)]
fn check_one(
    comm: &mkernel::Communicator,
    stream: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>,
    (src, dst): (&SymBuffer, &SymBuffer),
    count: usize,
    dtype: ReduceDtype,
    path: Option<AllReducePath>,
    ctas: u32,
    case: u64,
) -> AllReducePath {
    let (rank, world) = (comm.rank(), comm.world());
    let bytes = count * dtype.size() as usize;
    let (vals, raw) = inputs(world, rank, count, dtype, case);
    let dptr = comm.ptr(dst).unwrap();
    if src != dst {
        htod(dptr, &vec![POISON; bytes + GUARD]);
    } else {
        htod(dptr + bytes as u64, &[POISON; GUARD]);
    }
    htod(comm.ptr(src).unwrap(), &raw);
    let chosen = comm.all_reduce_path(src, dst, count as u64, dtype).unwrap();
    match path {
        None => comm.all_reduce(stream, src, dst, count as u64, dtype, ctas).unwrap(),
        Some(p) => comm
            .all_reduce_via(p, stream, src, dst, count as u64, dtype, ctas)
            .unwrap(),
    }
    stream.synchronize().unwrap();
    comm.check().unwrap();
    let out = dtoh(dptr, bytes + GUARD);
    let c = compare_sum(&decode(&out[..bytes], dtype), &vals, out_rel(dtype));
    let via = path.map_or(format!("policy ({})", chosen.name()), |p| p.name().to_string());
    let in_place = src == dst;
    assert_eq!(
        c.wrong, 0,
        "rank {rank}/{world}: all_reduce {dtype:?} count {count} via {via} in place {in_place} ctas {ctas}: {c:?}"
    );
    assert!(
        out[bytes..].iter().all(|&b| b == POISON),
        "rank {rank}/{world}: all_reduce {dtype:?} count {count} via {via}: wrote past the last element"
    );
    chosen
}

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs it under xtask launch)"]
fn allreduce_paths_match_cpu_reference_and_replay_from_graphs() {
    let timeout = CommConfig::default().timeout;
    let Some((dev, comm)) = launched_comm_or_skip("allreduce_paths", 64 << 20, timeout) else {
        return;
    };
    let (rank, world) = (comm.rank(), comm.world());
    let stream = dev.default_stream();
    let a = comm.alloc((6 << 20) + 256).unwrap();
    let b = comm.alloc((6 << 20) + 256).unwrap();
    let mut case = 0u64;
    let mut lines = vec![];

    // 1. Every size through every path that can carry it, and through the policy.
    let mut policy_took = BTreeSet::new();
    let mut launches = 0usize;
    for dtype in [ReduceDtype::Bf16, ReduceDtype::F32] {
        for count in counts(dtype) {
            for (in_place, dst) in [(false, &b), (true, &a)] {
                let bytes = count as u64 * dtype.size();
                let m = AllReduceMsg {
                    bytes,
                    overlap: if in_place { Overlap::InPlace } else { Overlap::Disjoint },
                    nodes: 1,
                };
                let paths = AllReducePath::SINGLE_NODE
                    .into_iter()
                    .filter(|&p| m.unavailable(p).is_none())
                    .map(Some)
                    .chain([None]);
                for path in paths {
                    case += 1;
                    let ctas = [1u32, 5, 16][case as usize % 3];
                    let chosen = check_one(&comm, &stream, (&a, dst), count, dtype, path, ctas, case);
                    if path.is_none() {
                        policy_took.insert(chosen.name());
                    }
                    launches += 1;
                }
            }
        }
        lines.push(format!(
            "all_reduce {dtype:?}: {} counts (8 B .. 1 MiB, powers of two and odd), every path that carries each, \
             in place and not: all elements within tolerance, nothing written past the end",
            counts(dtype).len()
        ));
    }
    // The bandwidth path through the policy (above its two-shot range).
    for in_place in [false, true] {
        case += 1;
        let dst = if in_place { &a } else { &b };
        let chosen = check_one(&comm, &stream, (&a, dst), 5 << 19, ReduceDtype::Bf16, None, 24, case);
        policy_took.insert(chosen.name());
        launches += 1;
    }
    lines.push(format!("{launches} launches; the policy took: {policy_took:?}"));
    for p in AllReducePath::SINGLE_NODE {
        assert!(policy_took.contains(p.name()), "the policy never took {p:?}");
    }
    // A path that cannot carry a message says why instead of launching.
    let odd = comm.all_reduce_via(AllReducePath::Ll, &stream, &a, &b, 3, ReduceDtype::Bf16, 4);
    assert!(matches!(odd, Err(mkernel::Error::Unsupported(_))), "{odd:?}");
    let in_place = comm.all_reduce_via(AllReducePath::OneShot, &stream, &a, &a, 64, ReduceDtype::F32, 4);
    assert!(matches!(in_place, Err(mkernel::Error::Unsupported(_))), "{in_place:?}");

    // 2. Graph replays: each path captured once, replayed with new inputs every time, no host
    //    synchronization between the ranks (the epoch flags order them).
    let replays: u64 = std::env::var("MKERNEL_GRAPH_REPLAYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    {
        use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let gstream = dev.context().new_stream().unwrap();
        let graphs: [(Option<AllReducePath>, usize, ReduceDtype, bool); 5] = [
            (Some(AllReducePath::OneShot), 4099, ReduceDtype::Bf16, false),
            (Some(AllReducePath::TwoShot), 50_001, ReduceDtype::Bf16, true),
            (Some(AllReducePath::TwoShot), 20_003, ReduceDtype::F32, false),
            (Some(AllReducePath::Ll), 2048, ReduceDtype::Bf16, false),
            (None, 30_000, ReduceDtype::F32, false),
        ];
        for (path, count, dtype, in_place) in graphs {
            let dst = if in_place { &a } else { &b };
            gstream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            match path {
                None => comm.all_reduce(&gstream, &a, dst, count as u64, dtype, 8).unwrap(),
                Some(p) => comm
                    .all_reduce_via(p, &gstream, &a, dst, count as u64, dtype, 8)
                    .unwrap(),
            }
            let graph = gstream
                .end_capture(CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("graph");
            let bytes = count * dtype.size() as usize;
            for rep in 0..replays {
                case += 1;
                let (vals, raw) = inputs(world, rank, count, dtype, case);
                htod(comm.ptr(&a).unwrap(), &raw);
                graph.launch().unwrap();
                gstream.synchronize().unwrap();
                comm.check().unwrap();
                let got = decode(&dtoh(comm.ptr(dst).unwrap(), bytes), dtype);
                let c = compare_sum(&got, &vals, out_rel(dtype));
                assert_eq!(
                    c.wrong, 0,
                    "rank {rank}/{world}: graph {path:?} {dtype:?} count {count} replay {rep}: {c:?}"
                );
            }
            let via = path.map_or("policy", |p| p.name());
            lines.push(format!(
                "all_reduce via {via} {dtype:?} count {count} in place {in_place}: captured once, {replays} replays \
                 with new inputs: correct"
            ));
        }
    }
    if rank == 0 {
        for l in lines {
            println!("[world {world}] {l}");
        }
    }
}
