//! A rank that never launches a fused kernel: the others' launches end (no hang, no trap) and
//! `Communicator::check` names what they waited for. Shared by `fused_timeout_*.rs` (each op
//! in a process of its own: a timed-out communicator stays aborted).
use half::bf16;
use mkernel::ops::{AgGemmPlan, GemmRsPlan, RsSplit};
use mkernel::Error;
use mkernel_tests::gpu::launched_comm_or_skip;
use std::time::{Duration, Instant};

/// Which fused kernel the absent rank skips (each test binary uses one).
#[derive(Clone, Copy, Debug)]
#[allow(dead_code)]
pub enum Op {
    AgGemm,
    GemmRs,
    GemmAr,
}

pub fn missing_rank_ends_the_launch_with_a_timeout(test: &str, op: Op) {
    let Some((dev, comm)) = launched_comm_or_skip(test, 160 << 20, Duration::from_secs(2)) else {
        return;
    };
    let (rank, world) = (comm.global_rank(), comm.world() * comm.nnodes());
    let absent = world - 1;
    let stream = dev.default_stream();
    // Two tiles and more per CTA, more K blocks than ring stages: when a wait gives up, the
    // GEMM ring is mid-flight (loaded slots nobody consumes, a producer ahead of its consumers).
    let (m, n, k) = (2048 * world as usize, 2048, 1024);
    let a = stream.alloc_zeros::<bf16>(m * k).unwrap();
    let b = stream.alloc_zeros::<bf16>(n * k).unwrap();
    let mut c = stream.alloc_zeros::<bf16>(m * n).unwrap();
    // The safe constructors: the plans borrow `comm` and the buffers (A shard <= m x k, out
    // <= m x n) until the end of the test.
    let s = &stream;
    let launch: Box<dyn Fn() -> mkernel::Result<()> + '_> = match op {
        Op::AgGemm => {
            let plan = AgGemmPlan::new(&comm, s, &a, &b, &mut c, m, n, k, 2).unwrap();
            Box::new(move || plan.launch(s))
        }
        Op::GemmAr => {
            let plan = GemmRsPlan::new_all_reduce(&comm, s, &a, &b, m, n, k, RsSplit::parts(1)).unwrap();
            Box::new(move || plan.launch(s))
        }
        Op::GemmRs => {
            let plan = GemmRsPlan::new(&comm, s, &a, &b, &mut c, m, n, k, RsSplit::parts(1)).unwrap();
            Box::new(move || plan.launch(s))
        }
    };
    // One good launch first: epochs are in step.
    launch().unwrap();
    stream.synchronize().unwrap();
    comm.check().unwrap();
    if rank == absent {
        println!("rank {rank}: skipping the second {op:?} launch on purpose");
        return;
    }
    let start = Instant::now();
    launch().unwrap();
    // The launch must end by itself (a trap would make this an error: a sticky launch failure).
    stream
        .synchronize()
        .unwrap_or_else(|e| panic!("rank {rank}: the {op:?} launch failed instead of reporting the timeout: {e}"));
    let elapsed = start.elapsed();
    let err = comm.check().expect_err("the launch must time out");
    match &err {
        Error::CommTimeout { rank: r, peer, .. } => {
            // Ranks are named globally.
            assert_eq!(*r, comm.global_rank(), "{err}");
            // On 2 GPUs of one node the stalled flag is the absent rank's own. With more ranks
            // (or across nodes) a rank may report the peer it waited for, itself stalled on the
            // absent rank: on 1 x 4, GEMM+RS's in-order comm walk of rank 1 stops at absent rank
            // 3, and rank 0 then reports rank 1's partial (measured). Never itself.
            if comm.nnodes() == 1 && comm.world() == 2 {
                assert_eq!(*peer, absent, "{err}");
            }
            assert_ne!(*peer, comm.global_rank(), "{err}");
        }
        other => panic!("expected CommTimeout, got {other}"),
    }
    assert!(
        elapsed < Duration::from_secs(15),
        "gave up after {elapsed:?}, the timeout is 2 s"
    );
    println!(
        "rank {rank}: {op:?}: {err} (returned after {:.2} s)",
        elapsed.as_secs_f64()
    );
}
