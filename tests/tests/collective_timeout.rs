//! A rank that never arrives: the others report a timeout naming it instead of hanging.
//! Run: `bundle/xtask launch -n 2 -- bundle/tests/mkernel-tests-collective_timeout`.
use mkernel::Error;
use mkernel_tests::gpu::launched_comm_or_skip;
use std::time::{Duration, Instant};

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs it under xtask launch)"]
fn missing_rank_is_named_by_the_timeout() {
    let Some((dev, comm)) =
        launched_comm_or_skip("missing_rank_is_named_by_the_timeout", 16 << 20, Duration::from_secs(2))
    else {
        return;
    };
    let (rank, world) = (comm.rank(), comm.world());
    let absent = world - 1;
    let stream = dev.default_stream();
    let dst = comm.alloc(4096 * world as u64).unwrap();
    let src = stream.alloc_zeros::<u8>(4096).unwrap();
    // One good round first: epochs are in step.
    comm.all_gather(&stream, &src, &dst, 4).unwrap();
    stream.synchronize().unwrap();
    comm.check().unwrap();
    if rank == absent {
        println!("rank {rank}: skipping the second all_gather on purpose");
        return;
    }
    let start = Instant::now();
    comm.all_gather(&stream, &src, &dst, 4).unwrap();
    stream.synchronize().unwrap();
    let elapsed = start.elapsed();
    let err = comm.check().expect_err("the all_gather must time out");
    match &err {
        Error::CommTimeout { rank: r, peer, .. } => {
            assert_eq!(*r, rank);
            assert_eq!(*peer, absent, "{err}");
        }
        other => panic!("expected CommTimeout, got {other}"),
    }
    assert!(
        elapsed < Duration::from_secs(10),
        "gave up after {elapsed:?}, the timeout is 2 s"
    );
    println!("rank {rank}: {err} (returned after {:.2} s)", elapsed.as_secs_f64());
}
