//! `Communicator::abort` while an inter-node AllGather runs (emulated nodes: the abort reaches
//! the other node's ranks through the wire's heap mappings): every rank's launch ends by itself
//! and `check()` names rank 0; across nodes an aborted communicator is dead, and `reset()` says
//! so. Run: `bundle/xtask launch -n 2 --nodes 2 [--share-gpu] -- bundle/tests/mkernel-tests-internode_abort`.
#[path = "support/abort_round.rs"]
mod abort_round;

use abort_round::{aborted_round, values, Mode, DEVICE_TIMEOUT};
use mkernel::proxy::backend::BackendKind;
use mkernel::{CommConfig, Communicator, Error};
use mkernel_tests::gpu::launched_rank_or_skip;

#[test]
#[ignore = "needs GPU ranks in 2 emulated nodes (xtask launch -n 2 --nodes 2 [--share-gpu])"]
fn abort_stops_an_internode_all_gather() {
    let Some((dev, boot)) = launched_rank_or_skip("abort_stops_an_internode_all_gather") else {
        return;
    };
    if boot.info().nnodes() < 2 {
        eprintln!("SKIPPED: launch with --nodes 2 to test the inter-node path");
        return;
    }
    let cfg = CommConfig {
        heap_bytes: 16 << 20,
        timeout: DEVICE_TIMEOUT,
        internode_scratch_bytes: 16 << 20,
        ..Default::default()
    };
    let comm = Communicator::new(&dev, boot, cfg).unwrap();
    let kind = comm.transport().map(|c| c.kind);
    if kind != Some(BackendKind::Emulated) {
        // Only the emulated wire maps the other node's heaps: over TCP (or RDMA) an abort reaches
        // this node's ranks alone, and the other node's waits end at their device timeout.
        eprintln!("SKIPPED: the job uses the {kind:?} transport; the abort crosses nodes only on the emulated wire");
        return;
    }
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
