//! Collective plans agree across ranks and keep the symmetric heap in step (comm::agree):
//! - rank 0 plans another shape than the others for MoE-EP, ring attention, AllGather+GEMM,
//!   GEMM+ReduceScatter and GEMM+AllReduce: every rank returns the same `PlanMismatch` naming
//!   the field, within the bootstrap timeout, and no heap is taken (nothing launched);
//! - buffers of another CUDA context fail MoE-EP and ring attention plans on every rank;
//! - a plan whose own checks fail on rank 0 only fails on every rank (`PlanFailed` naming rank
//!   0), and the next plan works on every rank;
//! - the heap a plan takes is what its `heap_bytes` says, and 1000 plans made and dropped leave
//!   the heap as it was.
//!
//! Run: `bundle/xtask launch -n 2 --share-gpu -- bundle/tests/mkernel-tests-agree --include-ignored --nocapture`
//! (`bundle/run-tests.sh --only agree` runs it at 2 and 4 ranks and as 2 emulated nodes).
use half::bf16;
use mkernel::ops::attention::AttentionHeads;
use mkernel::ops::gemm_rs::RsProblem;
use mkernel::ops::moe::Activation;
use mkernel::ops::moe_ep::{MoeEpPlan, MoeEpShape};
use mkernel::ops::ring_attention::{RingAttentionPlan, RingOptions};
use mkernel::{AgGemmPlan, Communicator, Error, GemmRsPlan, RsSplit};
use mkernel_tests::gpu::launched_comm_or_skip;
use std::time::{Duration, Instant};

/// Every rank's text of `e` (through the store): they must all be the same.
fn same_on_every_rank(comm: &Communicator, what: &str, e: &Error) {
    let all = comm
        .bootstrap()
        .store()
        .all_gather(
            &format!("test/agree/{what}"),
            e.to_string().as_bytes(),
            Duration::from_secs(30),
        )
        .unwrap();
    for (r, t) in all.iter().enumerate() {
        assert_eq!(
            String::from_utf8_lossy(t),
            e.to_string(),
            "{what}: rank {r}'s error differs from rank {}'s",
            comm.global_rank()
        );
    }
}

/// `r` must be a `PlanMismatch` on `field`, returned within the bootstrap timeout, with the
/// heap as it was.
fn expect_mismatch<T>(
    comm: &Communicator,
    what: &str,
    field: &str,
    start: Instant,
    heap: (u64, usize),
    r: mkernel::Result<T>,
) {
    let elapsed = start.elapsed();
    let e = match r {
        Err(e) => e,
        Ok(_) => panic!("rank {}: {what}: mismatched shapes were accepted", comm.global_rank()),
    };
    assert!(
        matches!(&e, Error::PlanMismatch { field: f, .. } if f == field),
        "rank {}: {what}: expected a mismatch on {field}, got {e}",
        comm.global_rank()
    );
    assert!(elapsed < comm.bootstrap_timeout(), "{what}: {elapsed:?}");
    assert_eq!(comm.heap_usage(), heap, "{what}: the failed plan left heap taken");
    same_on_every_rank(comm, what, &e);
    println!(
        "rank {}: {what}: {e} ({:.1} ms)",
        comm.global_rank(),
        elapsed.as_secs_f64() * 1e3
    );
}

#[test]
#[ignore = "needs GPU ranks (xtask launch -n 2|4 [--share-gpu] -- <this binary>)"]
fn ranks_agree_on_plans_and_the_heap_stays_in_step() {
    let Some((dev, comm)) = launched_comm_or_skip(
        "ranks_agree_on_plans_and_the_heap_stays_in_step",
        64 << 20,
        Duration::from_secs(4),
    ) else {
        return;
    };
    let (rank, world) = (comm.global_rank() as usize, comm.global_world() as usize);
    let stream = dev.default_stream();
    let zeros = |n: usize| stream.alloc_zeros::<bf16>(n).unwrap();
    let heap0 = comm.heap_usage();

    // MoE-EP: 64 tokens on rank 0, 128 elsewhere.
    let shape = |tokens| MoeEpShape {
        tokens,
        experts: 2 * world,
        top_k: 2,
        hidden: 256,
        ffn: 128,
        act: Activation::SwiGlu,
        capacity: None,
    };
    let s = shape(if rank == 0 { 64 } else { 128 });
    let (lu, ld) = s.weight_lens(world);
    let (w_up, w_down) = (zeros(lu), zeros(ld));
    let t = Instant::now();
    expect_mismatch(
        &comm,
        "moe_ep",
        "tokens",
        t,
        heap0,
        MoeEpPlan::new(&comm, &stream, s, &w_up, &w_down),
    );

    // Ring attention: 128 rows per rank on rank 0, 256 elsewhere (one workspace for both).
    let heads = AttentionHeads {
        heads_q: 2,
        heads_kv: 2,
        head_dim: 64,
        causal: true,
        softmax_scale: None,
    };
    let ws = comm
        .alloc_region(RingAttentionPlan::heap_bytes(1, 256, &heads).unwrap())
        .unwrap();
    let heap1 = comm.heap_usage();
    let s_local = if rank == 0 { 128 } else { 256 };
    let n = s_local * 2 * 64;
    let (q, k, v) = (zeros(n), zeros(n), zeros(n));
    let mut o = zeros(n);
    let mut lse = stream.alloc_zeros::<f32>(s_local * 2).unwrap();
    let t = Instant::now();
    let r = RingAttentionPlan::new(
        &comm,
        &stream,
        &q,
        &k,
        &v,
        &mut o,
        &mut lse,
        &ws,
        1,
        s_local,
        heads,
        RingOptions::default(),
    );
    expect_mismatch(&comm, "ring attention", "seqlen_local", t, heap1, r);
    drop(ws);
    assert_eq!(comm.heap_usage(), heap0, "the workspace region was not given back");

    // AllGather+GEMM: n = 256 on rank 0, 512 elsewhere.
    let (m, kk) = (128 * world, 256);
    let nn = if rank == 0 { 256 } else { 512 };
    let (a, b) = (zeros(m / world * kk), zeros(nn * kk));
    let mut c = zeros(m * nn);
    let t = Instant::now();
    expect_mismatch(
        &comm,
        "ag_gemm",
        "n",
        t,
        heap0,
        AgGemmPlan::new(&comm, &stream, &a, &b, &mut c, m, nn, kk, 2),
    );

    // GEMM+ReduceScatter and GEMM+AllReduce: the same.
    let (a, b) = (zeros(m * kk), zeros(nn * kk));
    let mut out = zeros(m / world * nn);
    let t = Instant::now();
    let r = GemmRsPlan::new(&comm, &stream, &a, &b, &mut out, m, nn, kk, RsSplit::parts(1));
    expect_mismatch(&comm, "gemm_rs", "n", t, heap0, r);
    let t = Instant::now();
    let r = GemmRsPlan::new_all_reduce(&comm, &stream, &a, &b, m, nn, kk, RsSplit::parts(1));
    expect_mismatch(&comm, "gemm_ar", "n", t, heap0, r);

    // Rank 0's B is too short: its own check fails, every rank fails naming it.
    let (m, n, k) = (128 * world, 256, 256);
    let a = zeros(m / world * k);
    let b = zeros(if rank == 0 { n * k - 8 } else { n * k });
    let mut c = zeros(m * n);
    let e = AgGemmPlan::new(&comm, &stream, &a, &b, &mut c, m, n, k, 2)
        .err()
        .expect("rank 0's short B must fail the plan");
    assert!(
        matches!(&e, Error::PlanFailed { ranks, reason, .. } if ranks == &[0] && reason.contains("rank 0")),
        "rank {rank}: {e}"
    );
    assert_eq!(comm.heap_usage(), heap0);
    same_on_every_rank(&comm, "failed on rank 0", &e);
    println!("rank {rank}: {e}");
    // The next plan works on every rank.
    let b = zeros(n * k);
    {
        let plan = AgGemmPlan::new(&comm, &stream, &a, &b, &mut c, m, n, k, 2).unwrap();
        assert_eq!(
            comm.heap_usage().0 - heap0.0,
            AgGemmPlan::heap_bytes(m, n, k, world).unwrap()
        );
        plan.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        comm.check().unwrap();
    }
    assert_eq!(comm.heap_usage(), heap0);

    // heap_bytes says what a plan takes, before it is built.
    {
        let s = shape(64);
        let (lu, ld) = s.weight_lens(world);
        let (w_up, w_down) = (zeros(lu), zeros(ld));
        let plan = MoeEpPlan::new(&comm, &stream, s, &w_up, &w_down).unwrap();
        let nodes = comm.nnodes() as usize;
        assert_eq!(
            comm.heap_usage().0 - heap0.0,
            MoeEpPlan::heap_bytes(&s, world, nodes).unwrap()
        );
        drop(plan);
        let (a, b) = (zeros(m * k), zeros(n * k));
        let plan = GemmRsPlan::new_all_reduce(&comm, &stream, &a, &b, m, n, k, RsSplit::parts(1)).unwrap();
        let problem = RsProblem {
            m,
            n,
            k_local: k,
            world: comm.world() as usize,
            nodes,
            sms: dev.sm_count(),
            all_reduce: true,
        };
        assert_eq!(
            comm.heap_usage().0 - heap0.0,
            GemmRsPlan::heap_bytes(&problem, RsSplit::parts(1)).unwrap()
        );
        assert!(plan.all_reduce_output().is_some());
    }
    assert_eq!(comm.heap_usage(), heap0);

    // 1000 plans made and dropped leave the heap as it was.
    let t = Instant::now();
    for i in 0..1000 {
        let plan = AgGemmPlan::new(&comm, &stream, &a, &b, &mut c, m, n, k, 2)
            .unwrap_or_else(|e| panic!("rank {rank}: plan {i}: {e}"));
        drop(plan);
    }
    assert_eq!(comm.heap_usage(), heap0);
    println!(
        "rank {rank}: 1000 AllGather+GEMM plans made and dropped in {:.2} s, heap as it was ({:?})",
        t.elapsed().as_secs_f64(),
        heap0
    );

    // Buffers of another CUDA context (a non-primary context on the same GPU) are refused by
    // every rank's checks: every rank fails naming all of them, before any heap is taken.
    {
        let foreign = mkernel::cudarc::driver::CudaContext::new_non_primary(dev.ordinal(), 0).unwrap();
        let fstream = foreign.new_stream().unwrap();
        dev.context().bind_to_thread().unwrap();
        let s = shape(64);
        let (lu, ld) = s.weight_lens(world);
        let (f_up, w_down) = (fstream.alloc_zeros::<bf16>(lu).unwrap(), zeros(ld));
        let e = MoeEpPlan::new(&comm, &stream, s, &f_up, &w_down)
            .err()
            .expect("foreign weights must fail the plan");
        assert!(
            matches!(&e, Error::PlanFailed { ranks, reason, .. } if ranks.len() == world && reason.contains("another CUDA context")),
            "rank {rank}: {e}"
        );
        let ws = comm
            .alloc_region(RingAttentionPlan::heap_bytes(1, 128, &heads).unwrap())
            .unwrap();
        let n = 128 * 2 * 64;
        let fq = fstream.alloc_zeros::<bf16>(n).unwrap();
        let (k, v) = (zeros(n), zeros(n));
        let mut o = zeros(n);
        let mut lse = stream.alloc_zeros::<f32>(128 * 2).unwrap();
        let e = RingAttentionPlan::new(
            &comm,
            &stream,
            &fq,
            &k,
            &v,
            &mut o,
            &mut lse,
            &ws,
            1,
            128,
            heads,
            RingOptions::default(),
        )
        .err()
        .expect("a foreign Q must fail the plan");
        assert!(
            matches!(&e, Error::PlanFailed { reason, .. } if reason.contains("another CUDA context")),
            "rank {rank}: {e}"
        );
        drop(ws);
        assert_eq!(comm.heap_usage(), heap0);
        println!("rank {rank}: foreign-context buffers: {e}");
    }
}
