//! A rank on another node whose process dies (exits without cleaning up): over the TCP transport
//! the ranks connected to it get an error naming it within a bound, long before the device timeout.
//! Run: `MKERNEL_TRANSPORT=tcp bundle/xtask launch -n 2 --nodes 2 -- bundle/tests/mkernel-tests-internode_dead_peer
//! --include-ignored` (or as two `--nnodes 2` launches). Other transports print SKIPPED: the
//! emulated wire cannot see a process die (its peers time out instead: internode_timeout.rs).
use mkernel::proxy::backend::BackendKind;
use mkernel::{CommConfig, Error};
use mkernel_tests::gpu::launched_internode_comm_or_skip;
use std::time::{Duration, Instant};

#[test]
#[ignore = "needs GPU ranks (run under xtask launch with MKERNEL_TRANSPORT=tcp)"]
fn dead_remote_process_is_named_by_the_tcp_proxy() {
    let cfg = CommConfig {
        heap_bytes: 16 << 20,
        timeout: Duration::from_secs(10),
        internode_scratch_bytes: 16 << 20,
        ..Default::default()
    };
    let Some((dev, comm)) = launched_internode_comm_or_skip("dead_remote_process_is_named_by_the_tcp_proxy", cfg)
    else {
        return;
    };
    let kind = comm.transport().map(|c| c.kind);
    if kind != Some(BackendKind::Tcp) {
        eprintln!("SKIPPED: the job uses the {kind:?} transport; set MKERNEL_TRANSPORT=tcp");
        return;
    }
    let (g, nglobal) = (comm.global_rank(), comm.world() * comm.nnodes());
    let dead = nglobal - 1; // not rank 0, which hosts the store
    let stream = dev.default_stream();
    let out = comm.alloc(4096 * nglobal as u64).unwrap();
    let src = stream.alloc_zeros::<u8>(4096).unwrap();
    comm.all_gather(&stream, &src, &out, 4).unwrap();
    stream.synchronize().unwrap();
    comm.check().unwrap();
    comm.bootstrap()
        .store()
        .barrier("dead-peer-test/first-done", Duration::from_secs(30))
        .unwrap();
    if g == dead {
        println!("rank {g}: exiting without cleaning up (sockets closed by the kernel, no goodbye)");
        std::process::exit(0);
    }
    let start = Instant::now();
    comm.all_gather(&stream, &src, &out, 4).unwrap();
    let _ = stream.synchronize();
    let elapsed = start.elapsed();
    let err = comm.check().expect_err("the all_gather must fail");
    let dead_node = dead / comm.world();
    if g / comm.world() == dead_node {
        // Same node as the dead rank: it waits over NVLink until the device timeout names the
        // dead rank, unless its proxy heard first from a peer on the other node whose proxy
        // failed on its link with the dead rank (that peer's ABORT frame names it).
        let msg = err.to_string();
        assert!(
            match &err {
                Error::CommTimeout { .. } => true,
                Error::Proxy(_) => msg.contains(&format!("its proxy failed on its link with rank {dead}")),
                _ => false,
            },
            "{msg}"
        );
    } else {
        // Connected to the dead rank over TCP: the proxy names it (or, when a peer's failed
        // proxy told it first, that peer's ABORT names the dead rank as the broken link).
        let msg = err.to_string();
        assert!(
            matches!(err, Error::Proxy(_))
                && (msg.contains(&format!("peer {dead}")) || msg.contains(&format!("link with rank {dead}"))),
            "{msg}"
        );
        assert!(elapsed < Duration::from_secs(5), "noticed after {elapsed:?}");
    }
    println!("rank {g}: {err} (returned after {:.2} s)", elapsed.as_secs_f64());
}
