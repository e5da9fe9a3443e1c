//! `Communicator::abort` while an inter-node AllGather runs: every rank's launch ends by itself
//! and `check()` names rank 0; across nodes an aborted communicator is dead, and `reset()` says
//! so. The abort reaches the other node's ranks through the wire's heap mappings (emulated
//! nodes) or through the proxies (`MKERNEL_TRANSPORT=tcp`: rank 0's proxy tells every peer
//! proxy, which stores rank 0 into its node's host abort words; `abort()` returns once every
//! peer acknowledged). Run: `bundle/xtask launch -n 2 --nodes 2 [--share-gpu] --
//! bundle/tests/mkernel-tests-internode_abort`, also with `MKERNEL_TRANSPORT=tcp`.
#[path = "support/abort_round.rs"]
mod abort_round;

use abort_round::{aborted_round, values, Mode, DEVICE_TIMEOUT};
use mkernel::proxy::backend::BackendKind;
use mkernel::{CommConfig, Error};
use mkernel_tests::gpu::launched_internode_comm_or_skip;

#[test]
#[ignore = "needs GPU ranks in 2 emulated nodes (xtask launch -n 2 --nodes 2 [--share-gpu])"]
fn abort_stops_an_internode_all_gather() {
    let cfg = CommConfig {
        heap_bytes: 16 << 20,
        timeout: DEVICE_TIMEOUT,
        internode_scratch_bytes: 16 << 20,
        ..Default::default()
    };
    let Some((dev, comm)) = launched_internode_comm_or_skip("abort_stops_an_internode_all_gather", cfg) else {
        return;
    };
    let kind = comm.transport().map(|c| c.kind);
    if !matches!(kind, Some(BackendKind::Emulated | BackendKind::Tcp)) {
        // The RDMA backends have no control path for aborts: `abort()` reaches this node's
        // ranks and returns `Error::Unsupported`; the other node's waits end at their timeout.
        eprintln!("SKIPPED: the job uses the {kind:?} transport, which does not carry aborts across nodes");
        return;
    }
    println!("rank {}: transport {kind:?}", comm.global_rank());
    let handle = comm.abort_handle();
    let stream = dev.default_stream();
    let (g, nglobal) = (comm.global_rank(), comm.world() * comm.nnodes());
    let bytes = 64u64 << 10;
    let src = stream.clone_htod(&values(bytes as usize / 2, g as u64)).unwrap();
    let out = comm.alloc(bytes * nglobal as u64).unwrap();
    comm.all_gather(&stream, &src, &out, 4).unwrap();
    stream.synchronize().unwrap();
    comm.check().unwrap();
    aborted_round(
        &comm,
        &handle,
        &stream,
        "internode_all_gather",
        Mode::LaggingRank,
        &|| comm.all_gather(&stream, &src, &out, 4),
    );
    match comm.reset() {
        Err(Error::Unsupported(why)) => println!("rank {g}: reset across nodes refused: {why}"),
        other => panic!("rank {g}: reset across nodes must be refused, got {other:?}"),
    }
}
