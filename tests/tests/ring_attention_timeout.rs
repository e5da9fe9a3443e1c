//! A rank that never launches its ring-attention call: its ring neighbours report a timeout
//! naming it (the left one waiting for its `RingFree` credit, the right one for its `RingData`)
//! instead of hanging; the launch ends by itself. On 2 emulated nodes x 2 ranks the absent rank
//! 3's right neighbour, rank 0, is on the other node: it waits for the inter-node `RingData` flag.
//! Run: `bundle/xtask launch -n 2 --share-gpu -- bundle/tests/mkernel-tests-ring_attention_timeout --include-ignored --nocapture`.
use half::bf16;
use mkernel::ops::attention::AttentionHeads;
use mkernel::ops::ring_attention::{RingAttentionPlan, RingOptions};
use mkernel::Error;
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::launched_comm_or_skip;
use std::time::{Duration, Instant};

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs ring_* binaries under xtask launch at 2 and 4 ranks)"]
fn missing_rank_is_named_by_the_ring_timeout() {
    let Some((dev, comm)) = launched_comm_or_skip(
        "missing_rank_is_named_by_the_ring_timeout",
        16 << 20,
        Duration::from_secs(2),
    ) else {
        return;
    };
    let (rank, world) = (comm.global_rank(), comm.global_world());
    let absent = world - 1;
    let stream = dev.default_stream();
    let (s_local, h, d) = (256, 2, 64);
    let heads = AttentionHeads {
        heads_q: h,
        heads_kv: h,
        head_dim: d,
        causal: true,
        softmax_scale: None,
    };
    let ws = comm
        .alloc(RingAttentionPlan::workspace_bytes(1, s_local, &heads).unwrap())
        .unwrap();
    let n = s_local * h * d;
    let q = stream.clone_htod(&random_bf16(n, 1 + rank as u64)).unwrap();
    let k = stream.clone_htod(&random_bf16(n, 2 + rank as u64)).unwrap();
    let v = stream.clone_htod(&random_bf16(n, 3 + rank as u64)).unwrap();
    let mut o = stream.alloc_zeros::<bf16>(n).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(s_local * h).unwrap();
    let plan = RingAttentionPlan::new(
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
    )
    .unwrap();
    // One good call first: the ring epochs are in step.
    plan.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    comm.check().unwrap();
    if rank == absent {
        println!("rank {rank}: skipping the second ring-attention call on purpose");
        return;
    }
    let start = Instant::now();
    plan.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    let elapsed = start.elapsed();
    let neighbour = rank == (absent + 1) % world || rank + 1 == absent;
    match comm.check() {
        Err(err @ Error::CommTimeout { .. }) => {
            let Error::CommTimeout { rank: r, peer, .. } = &err else {
                unreachable!()
            };
            assert_eq!(*r, rank);
            if neighbour {
                assert_eq!(*peer, absent, "{err}");
            }
            println!("rank {rank}: {err} (returned after {:.2} s)", elapsed.as_secs_f64());
        }
        Err(other) => panic!("rank {rank}: expected CommTimeout, got {other}"),
        Ok(()) => {
            // A rank two hops away may finish on data its timed-out neighbour passed on anyway.
            assert!(
                !neighbour,
                "rank {rank}: a neighbour of the absent rank {absent} must time out"
            );
            println!(
                "rank {rank}: not a neighbour of rank {absent}; its launch finished (returned after {:.2} s)",
                elapsed.as_secs_f64()
            );
        }
    }
    assert!(
        elapsed < Duration::from_secs(10),
        "rank {rank}: gave up after {elapsed:?}, the timeout is 2 s"
    );
}
