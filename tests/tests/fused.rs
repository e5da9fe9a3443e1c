//! Fused AllGather + GEMM, GEMM + ReduceScatter and GEMM + AllReduce across ranks (one process
//! per GPU) against a CPU reference, launched directly and replayed from CUDA graphs.
//! Run: `bundle/xtask launch -n 2 -- bundle/tests/mkernel-tests-fused`; with `--nodes 2` every
//! case runs across emulated nodes (NVLink inside a node, the proxy between).
use half::bf16;
use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use mkernel::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use mkernel::ops::{AgGemmPlan, GemmRsPlan, RsSplit};
use mkernel::{CommConfig, Communicator};
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::launched_rank_or_skip;
use mkernel_tests::reference::{compare, gemm as cpu_gemm, BOrder, BF16_OUT_REL, F32_ACC};
use std::sync::Arc;
use std::time::Duration;

/// Launches of every case, each on new inputs.
const REPS: u64 = 3;
/// AllGather + GEMM cases: M, N, K (global M; A sharded by rows), comm CTAs.
const AG_CASES: [(usize, usize, usize, u32); 4] = [
    (1024, 512, 256, 4),
    (2048, 768, 1024, 8),
    (4096, 256, 512, 16),
    (1024, 1000, 136, 1),
];
/// GEMM + ReduceScatter cases: M, N, K per rank, parts per row chunk (1 where it does not
/// divide the chunk's row tiles at this world size), comm CTAs (`RsSplit::AUTO`, none, or a
/// count: the partials go through comm CTAs or straight from the epilogues; [`PULL`]: the
/// peers read them; [`CONSUMER_IO`]: straight, without stagers).
/// The last case of each has more tiles than an H100/H200 has SMs (132), so where stagers run
/// (one node of 2 ranks) its last partial round of tiles is computed stream-K
/// (`mkernel_config::stream_k`): 208 tiles of 16 K blocks (76 stream-K), and 272 tiles of 9
/// K blocks, the last one short, N not a multiple of the tile (140 stream-K: the partial round
/// and one more).
const RS_CASES: [(usize, usize, usize, u32, u32); 7] = [
    (1024, 512, 256, 2, RsSplit::AUTO),
    (2048, 768, 512, 4, RsSplit::NO_COMM_CTAS),
    (512, 1000, 136, 1, 3),
    (512, 1000, 136, 1, PULL),
    (2048, 768, 512, 2, PULL),
    (1024, 1000, 256, 2, CONSUMER_IO),
    (6656, 1024, 1024, 1, RsSplit::AUTO),
];
/// GEMM + AllReduce cases, as [`RS_CASES`].
const AR_CASES: [(usize, usize, usize, u32, u32); 5] = [
    (1024, 512, 256, 2, RsSplit::AUTO),
    (512, 1000, 136, 1, 4),
    (1024, 1000, 256, 2, PULL),
    (1024, 1000, 256, 2, CONSUMER_IO),
    (8704, 1000, 520, 1, RsSplit::AUTO),
];
/// In a case's comm CTAs: none, and the partials are pulled (`RsSplit::pull`).
const PULL: u32 = u32::MAX - 1;
/// In the comm CTA column: none, and no stager (`RsSplit::no_stager`): the consumer
/// warpgroups issue their own epilogue stores and loads (on one node of 2 ranks the stager is
/// the default).
const CONSUMER_IO: u32 = u32::MAX - 2;

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs it under xtask launch)"]
fn fused_collectives_ag_gemm_matches_cpu_reference() {
    let Some((dev, boot)) = launched_rank_or_skip("fused_collectives_ag_gemm_matches_cpu_reference") else {
        return;
    };
    let comm = Communicator::new(
        &dev,
        boot,
        CommConfig {
            heap_bytes: 512 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let stream = dev.default_stream();
    let mut lines = vec![];
    for (case, &shape) in AG_CASES.iter().enumerate() {
        lines.push(ag_gemm_case(&comm, &stream, case, shape, &Launch::Direct));
    }
    let graph = Launch::Graph(dev.context().new_stream().unwrap());
    // Each plan captured once into a CUDA graph on a stream of its own, replayed on new inputs
    // (case numbers after the direct ones: other data).
    lines.push(ag_gemm_case(&comm, &stream, AG_CASES.len(), AG_CASES[0], &graph));
    // GEMM + ReduceScatter: K split over ranks, rank r gets row chunk r of the sum of partials.
    for (case, &shape) in RS_CASES.iter().enumerate() {
        lines.push(reduce_case(&comm, &stream, case, shape, false, &Launch::Direct));
    }
    // GEMM + AllReduce: every rank gets the whole sum (in the heap).
    for (case, &shape) in AR_CASES.iter().enumerate() {
        lines.push(reduce_case(&comm, &stream, case, shape, true, &Launch::Direct));
    }
    lines.push(reduce_case(&comm, &stream, RS_CASES.len(), RS_CASES[0], false, &graph));
    lines.push(reduce_case(
        &comm,
        &stream,
        RS_CASES.len() + 1,
        RS_CASES[3],
        false,
        &graph,
    ));
    lines.push(reduce_case(&comm, &stream, AR_CASES.len(), AR_CASES[0], true, &graph));
    lines.push(reduce_case(
        &comm,
        &stream,
        AR_CASES.len() + 1,
        AR_CASES[AR_CASES.len() - 1],
        true,
        &graph,
    ));
    lines.push(safe_api_case(&comm, &stream));
    if comm.global_rank() == 0 {
        for l in lines {
            println!("[{} nodes x {} GPUs] {l}", comm.nnodes(), comm.world());
        }
    }
}

/// How a case's plan runs.
enum Launch {
    /// `plan.launch` on the default stream, each time.
    Direct,
    /// Captured once into a CUDA graph on this (non-default) stream, then replayed.
    Graph(Arc<CudaStream>),
}

impl Launch {
    fn describe(&self) -> String {
        match self {
            Launch::Direct => format!("{REPS} launches"),
            Launch::Graph(_) => format!("captured in a CUDA graph, {REPS} replays"),
        }
    }
}

/// The CPU reference of one launch's inputs, with `compare`'s scale and tolerances.
struct Reference {
    want: Vec<f64>,
    scale: Vec<f64>,
    rel: f64,
    acc: f64,
}

/// Runs a plan (`launch`) `REPS` times as `how` says, on new inputs each time: before each run
/// `write(rep)` uploads them on `stream` and returns their reference; after it `read()` gives
/// the output, which must match. Replays sit between store barriers so that no rank writes
/// inputs or reads outputs while its peers' replays may still use them.
fn run_reps(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    how: &Launch,
    what: &str,
    launch: impl Fn(&Arc<CudaStream>) -> mkernel::Result<()>,
    mut write: impl FnMut(u64) -> Reference,
    read: impl Fn() -> Vec<f64>,
) {
    let rank = comm.rank();
    let graph = match how {
        Launch::Direct => None,
        Launch::Graph(g) => {
            g.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            launch(g).unwrap();
            Some((
                g,
                g.end_capture(CUgraphInstantiate_flags(0))
                    .unwrap()
                    .expect("captured graph"),
            ))
        }
    };
    let barrier = |name: String| {
        comm.bootstrap()
            .store()
            .barrier(&name, Duration::from_secs(30))
            .unwrap()
    };
    for rep in 0..REPS {
        let r = write(rep);
        stream.synchronize().unwrap();
        match &graph {
            None => {
                launch(stream).unwrap();
                stream.synchronize().unwrap();
            }
            Some((g, exec)) => {
                barrier(format!("fused-graph-input-{rep}"));
                exec.launch().unwrap();
                g.synchronize().unwrap();
            }
        }
        comm.check().unwrap();
        let c = compare(&read(), &r.want, &r.scale, r.rel, r.acc);
        assert_eq!(c.wrong, 0, "rank {rank}: {what} ({}) rep {rep}: {c:?}", how.describe());
        if graph.is_some() {
            barrier(format!("fused-graph-output-{rep}"));
        }
    }
}

/// AllGather + GEMM, `m` x `n` x `k` with `n_comm` comm CTAs, run and checked `REPS` times.
fn ag_gemm_case(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    case: usize,
    (m, n, k, n_comm): (usize, usize, usize, u32),
    how: &Launch,
) -> String {
    // Shards by global rank: across nodes every rank of every node holds one.
    let (rank, world) = (comm.global_rank() as usize, (comm.world() * comm.nnodes()) as usize);
    let ms = m / world;
    let b = random_bf16(n * k, 7_000 + 10 * case as u64 + rank as u64);
    let db = stream.clone_htod(&b).unwrap();
    let mut da = stream.alloc_zeros::<bf16>(ms * k).unwrap();
    let mut dc = stream.alloc_zeros::<bf16>(m * n).unwrap();
    let (pa, pb, pc) = (
        {
            let (p, _g) = da.device_ptr_mut(stream);
            p
        },
        {
            let (p, _g) = db.device_ptr(stream);
            p
        },
        {
            let (p, _g) = dc.device_ptr_mut(stream);
            p
        },
    );
    // The raw layer: the case rewrites the inputs and reads the output between launches of
    // one plan, which a plan that borrows them would not allow.
    // SAFETY: buffers sized for the shape, on this device, alive until the end of the case;
    // written and read only between the plan's launches (stream-ordered, synchronized).
    let plan = unsafe { AgGemmPlan::new_raw(comm, stream, pa, pb, pc, m, n, k, n_comm) }.unwrap();
    let write = |rep: u64| {
        let a_full = random_bf16(m * k, 9_000 + 100 * case as u64 + rep);
        stream
            .memcpy_htod(&a_full[rank * ms * k..(rank + 1) * ms * k], &mut da)
            .unwrap();
        let (want, scale) = cpu_gemm(&a_full, &b, m, n, k, BOrder::NxK);
        Reference {
            want,
            scale,
            rel: BF16_OUT_REL,
            acc: F32_ACC,
        }
    };
    let read = || to_f64(&stream.clone_dtoh(&dc).unwrap());
    run_reps(
        comm,
        stream,
        how,
        &format!("ag_gemm m {m} n {n} k {k} n_comm {n_comm}"),
        |s| plan.launch(s),
        write,
        read,
    );
    format!(
        "ag_gemm M {m} N {n} K {k}, {n_comm} comm CTAs of {}, {}: every element within tolerance",
        plan.split().1,
        how.describe()
    )
}

/// GEMM + ReduceScatter (or, with `all_reduce`, GEMM + AllReduce), `m` x `n` x `kl` per rank
/// with `parts` parts per row chunk (1 where they do not divide the chunk), run and checked `REPS` times.
fn reduce_case(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    case: usize,
    (m, n, kl, parts, comm_ctas): (usize, usize, usize, u32, u32),
    all_reduce: bool,
    how: &Launch,
) -> String {
    // Chunks by global rank: across nodes every rank of every node reduces one.
    let (rank, world) = (comm.global_rank() as usize, (comm.world() * comm.nnodes()) as usize);
    let parts = if (m / world / 128) % parts as usize == 0 {
        parts
    } else {
        1
    };
    let ms = m / world;
    let mut da = stream.alloc_zeros::<bf16>(m * kl).unwrap();
    let mut db = stream.alloc_zeros::<bf16>(n * kl).unwrap();
    let mut dout = stream.alloc_zeros::<bf16>(ms * n).unwrap(); // ReduceScatter only
    let (pa, pb, po) = (
        {
            let (p, _g) = da.device_ptr_mut(stream);
            p
        },
        {
            let (p, _g) = db.device_ptr_mut(stream);
            p
        },
        {
            let (p, _g) = dout.device_ptr_mut(stream);
            p
        },
    );
    let split = match comm_ctas {
        PULL => RsSplit {
            parts,
            comm_ctas: RsSplit::AUTO,
            pull: true,
            ..RsSplit::default()
        },
        CONSUMER_IO => RsSplit {
            parts,
            comm_ctas: RsSplit::NO_COMM_CTAS,
            no_stager: true,
            ..RsSplit::default()
        },
        _ => RsSplit {
            parts,
            comm_ctas,
            ..RsSplit::default()
        },
    };
    // The raw layer, as in `ag_gemm_case`.
    // SAFETY: buffers sized for the shape, on this device, alive until the end of the case;
    // written and read only between the plan's launches (stream-ordered, synchronized).
    let plan =
        unsafe { GemmRsPlan::new_raw(comm, stream, pa, pb, (!all_reduce).then_some(po), m, n, kl, split) }.unwrap();
    let (op, seed_base, rows) = if all_reduce {
        ("gemm_ar", 40_000, 0..m)
    } else {
        ("gemm_rs", 20_000, rank * ms..(rank + 1) * ms)
    };
    let write = |rep: u64| {
        let seed = seed_base + 100 * case as u64 + 10 * rep;
        let a_all: Vec<Vec<bf16>> = (0..world).map(|r| random_bf16(m * kl, seed + r as u64)).collect();
        let b_all: Vec<Vec<bf16>> = (0..world).map(|r| random_bf16(n * kl, seed + 5 + r as u64)).collect();
        stream.memcpy_htod(&a_all[rank], &mut da).unwrap();
        stream.memcpy_htod(&b_all[rank], &mut db).unwrap();
        let (want, scale) = sum_of_partials(&a_all, &b_all, rows.clone(), n, kl);
        // Partials are rounded to bf16 before the f32 sum: two bf16 roundings; across nodes
        // each node's sum is rounded once more before it crosses.
        let roundings = if comm.nnodes() > 1 { 3.0 } else { 2.0 };
        Reference {
            want,
            scale,
            rel: roundings * BF16_OUT_REL,
            acc: roundings * BF16_OUT_REL,
        }
    };
    let read = || match plan.all_reduce_output() {
        Some(out) => {
            let mut raw = vec![0u8; m * n * 2];
            // SAFETY: the plan's output holds m x n bf16 in this rank's heap.
            unsafe { mkernel::cudarc::driver::result::memcpy_dtoh_sync(&mut raw, comm.ptr(&out).unwrap()) }.unwrap();
            raw.chunks(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
                .collect()
        }
        None => to_f64(&stream.clone_dtoh(&dout).unwrap()),
    };
    run_reps(
        comm,
        stream,
        how,
        &format!("{op} m {m} n {n} k_local {kl} parts {parts}"),
        |s| plan.launch(s),
        write,
        read,
    );
    let whole = if all_reduce { "whole sum on every rank, " } else { "" };
    let path = if split.pull {
        ", partials pulled".to_string()
    } else if plan.stager() {
        format!(", stagers, {} tiles stream-K", plan.stream_k_tiles())
    } else {
        String::new()
    };
    format!("{op} M {m} N {n} K_local {kl}, {parts} parts per chunk, {} CTAs ({} comm{path}), {}: {whole}every element within tolerance", plan.split().1, plan.comm_ctas(), how.describe())
}

/// The safe constructors (plans that borrow their buffers and communicator): AllGather+GEMM
/// (its output a view of a larger buffer), GEMM+ReduceScatter and GEMM+AllReduce, each planned
/// on cudarc buffers after its inputs are written, launched (GEMM+ReduceScatter twice, the
/// second time on another stream through `launch_raw`), dropped, and its output then compared
/// with the CPU reference.
fn safe_api_case(comm: &Communicator, stream: &Arc<CudaStream>) -> String {
    let (rank, world) = (comm.global_rank() as usize, (comm.world() * comm.nnodes()) as usize);
    let (m, n, k, kl) = (512 * world, 256, 256, 128);
    let ms = m / world;
    let a_full = random_bf16(m * k, 61_000);
    let b = random_bf16(n * k, 61_100 + rank as u64);
    let da = stream.clone_htod(&a_full[rank * ms * k..(rank + 1) * ms * k]).unwrap();
    let db = stream.clone_htod(&b).unwrap();
    let mut dc = stream.alloc_zeros::<bf16>(m * n + 64).unwrap();
    {
        let mut c_view = dc.slice_mut(..m * n);
        let plan = AgGemmPlan::new(comm, stream, &da, &db, &mut c_view, m, n, k, 4).unwrap();
        plan.launch(stream).unwrap();
        stream.synchronize().unwrap();
    }
    comm.check().unwrap();
    let (want, scale) = cpu_gemm(&a_full, &b, m, n, k, BOrder::NxK);
    let got = to_f64(&stream.clone_dtoh(&dc).unwrap()[..m * n]);
    let c = compare(&got, &want, &scale, BF16_OUT_REL, F32_ACC);
    assert_eq!(c.wrong, 0, "rank {rank}: ag_gemm through the safe constructor: {c:?}");

    let a_all: Vec<Vec<bf16>> = (0..world).map(|r| random_bf16(m * kl, 62_000 + r as u64)).collect();
    let b_all: Vec<Vec<bf16>> = (0..world).map(|r| random_bf16(n * kl, 62_100 + r as u64)).collect();
    let da = stream.clone_htod(&a_all[rank]).unwrap();
    let db = stream.clone_htod(&b_all[rank]).unwrap();
    let mut dout = stream.alloc_zeros::<bf16>(ms * n).unwrap();
    let other = stream.context().new_stream().unwrap();
    {
        let plan = GemmRsPlan::new(comm, stream, &da, &db, &mut dout, m, n, kl, RsSplit::default()).unwrap();
        plan.launch(stream).unwrap();
        // Again, on another stream through the raw-stream entry, without a host sync between:
        // the communicator orders it after the first launch (and the AllReduce below after it).
        // SAFETY: `other` is a live stream of this context, synchronized before it is dropped.
        unsafe { plan.launch_raw(other.cu_stream()) }.unwrap();
        other.synchronize().unwrap();
        stream.synchronize().unwrap();
    }
    comm.check().unwrap();
    let roundings = if comm.nnodes() > 1 { 3.0 } else { 2.0 };
    let tol = roundings * BF16_OUT_REL;
    let (want, scale) = sum_of_partials(&a_all, &b_all, rank * ms..(rank + 1) * ms, n, kl);
    let c = compare(&to_f64(&stream.clone_dtoh(&dout).unwrap()), &want, &scale, tol, tol);
    assert_eq!(c.wrong, 0, "rank {rank}: gemm_rs through the safe constructor: {c:?}");
    let ar_out = {
        let plan = GemmRsPlan::new_all_reduce(comm, stream, &da, &db, m, n, kl, RsSplit::default()).unwrap();
        plan.launch(stream).unwrap();
        stream.synchronize().unwrap();
        plan.all_reduce_output().expect("an AllReduce plan")
    };
    comm.check().unwrap();
    let mut raw = vec![0u8; m * n * 2];
    // SAFETY: the heap buffer (live as long as the communicator) holds m x n bf16.
    unsafe { mkernel::cudarc::driver::result::memcpy_dtoh_sync(&mut raw, comm.ptr(&ar_out).unwrap()) }.unwrap();
    let got: Vec<f64> = raw
        .chunks(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
        .collect();
    let (want, scale) = sum_of_partials(&a_all, &b_all, 0..m, n, kl);
    let c = compare(&got, &want, &scale, tol, tol);
    assert_eq!(c.wrong, 0, "rank {rank}: gemm_ar through the safe constructor: {c:?}");
    format!("ag_gemm, gemm_rs, gemm_ar M {m} N {n} through the safe constructors (slices, a view; gemm_rs again on a raw stream): every element within tolerance")
}

fn to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// CPU reference of `sum_r a_r[rows] * b_r^T` (every rank's partial product, rows of A given),
/// with the per-element scale of `compare`.
fn sum_of_partials(
    a_all: &[Vec<bf16>],
    b_all: &[Vec<bf16>],
    rows: std::ops::Range<usize>,
    n: usize,
    kl: usize,
) -> (Vec<f64>, Vec<f64>) {
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
