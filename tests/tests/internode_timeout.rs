//! A rank on another node that never arrives: the others report a timeout naming it.
//! Run: `bundle/xtask launch -n 2 --nodes 2 -- bundle/tests/mkernel-tests-internode_timeout`.
use mkernel::{CommConfig, Error};
use mkernel_tests::gpu::launched_internode_comm_or_skip;
use std::time::{Duration, Instant};

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs it under xtask launch)"]
fn missing_remote_rank_is_named_by_the_timeout() {
    let cfg = CommConfig {
        heap_bytes: 16 << 20,
        timeout: Duration::from_secs(2),
        internode_scratch_bytes: 16 << 20,
        ..Default::default()
    };
    let Some((dev, comm)) = launched_internode_comm_or_skip("missing_remote_rank_is_named_by_the_timeout", cfg) else {
        return;
    };
    let (g, nglobal) = (comm.global_rank(), comm.world() * comm.nnodes());
    let absent = nglobal - 1;
    let stream = dev.default_stream();
    let out = comm.alloc(4096 * nglobal as u64).unwrap();
    let src = stream.alloc_zeros::<u8>(4096).unwrap();
    comm.all_gather(&stream, &src, &out, 4).unwrap();
    stream.synchronize().unwrap();
    comm.check().unwrap();
    if g == absent {
        println!("rank {g}: skipping the second all_gather on purpose");
        return;
    }
    let start = Instant::now();
    comm.all_gather(&stream, &src, &out, 4).unwrap();
    stream.synchronize().unwrap();
    let elapsed = start.elapsed();
    let err = comm.check().expect_err("the all_gather must time out");
    assert!(matches!(err, Error::CommTimeout { .. }), "{err}");
    if let Error::CommTimeout { peer, .. } = &err {
        // Peers are named by global rank. Ranks on the absent rank's node wait for it over
        // NVLink. A rank on another node names the rank it waits for over the wire: the absent
        // rank itself, or (2 x 2 and up) its rail peer on the absent node, which stalls first
        // on the absent rank and so never raises its inter-node flag.
        let absent_node = absent / comm.world();
        assert!(*peer == absent || *peer / comm.world() == absent_node, "{err}");
    }
    assert!(
        elapsed < Duration::from_secs(10),
        "gave up after {elapsed:?}, the timeout is 2 s"
    );
    println!("rank {g}: {err} (returned after {:.2} s)", elapsed.as_secs_f64());
}
