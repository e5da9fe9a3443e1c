//! The MoE layer with expert parallelism over W ranks against a CPU reference of the whole
//! layer (tests/src/moe.rs): every rank derives every rank's tokens, routing and the full
//! expert weights from seeds, checks where its pairs went and its own output. Cases: uniform,
//! skewed, all tokens to one expert (top-1), top-8, a second launch with new routing on the
//! same plan, a CUDA graph replayed with new routing, a receive capacity that drops rows (counted), out-of-range ids, and last a rank
//! that never launches (the others end with a timeout naming it).
//! Ranks are global ranks: as 2 emulated nodes x 2 ranks the pairs owned on the other node go
//! through the proxy.
//! Run: `bundle/xtask launch -n 2 --share-gpu -- <this binary> --include-ignored --nocapture`
//! (`-n 4 --nodes 2`: 2 emulated nodes x 2 ranks).
#[path = "support/moe_ep_case.rs"]
mod moe_ep_case;
use half::bf16;
use mkernel::ops::moe::Activation;
use mkernel::ops::moe_ep::MoeEpPlan;
use mkernel::Error;
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::launched_comm_or_skip;
use mkernel_tests::moe::uniform_routing;
use moe_ep_case::{run_case, shape};
use std::time::{Duration, Instant};

#[test]
#[ignore = "needs GPU ranks (xtask launch -n 2|4 [--share-gpu] -- <this binary>)"]
fn moe_ep_matches_cpu_reference_and_names_a_missing_rank() {
    let Some((dev, comm)) = launched_comm_or_skip(
        "moe_ep_matches_cpu_reference_and_names_a_missing_rank",
        256 << 20,
        Duration::from_secs(4),
    ) else {
        return;
    };
    let (rank, world) = (comm.global_rank() as usize, comm.global_world() as usize);
    let stream = dev.default_stream();
    const SW: Activation = Activation::SwiGlu;
    let cases = moe_ep_case::cases(world, false);
    for (i, c) in cases.iter().enumerate() {
        println!("{}", run_case(&comm, &stream, c, 7 + 10 * i as u64));
    }

    // Out-of-range ids on rank 0: an error there, the other ranks unaffected, nothing written
    // for the bad pairs.
    {
        let s = shape(32, 2 * world, 2, SW, None);
        let l = s.local_experts(world);
        let w_up = random_bf16(l * s.up_rows() * 256, 3);
        let w_down = random_bf16(l * 256 * 128, 4);
        let (d_up, d_down) = (stream.clone_htod(&w_up).unwrap(), stream.clone_htod(&w_down).unwrap());
        let mut plan = MoeEpPlan::new(&comm, &stream, s, &d_up, &d_down).unwrap();
        let (mut ids, wts) = uniform_routing(32, s.experts, 2, 5 + rank as u64);
        if rank == 0 {
            ids[3] = -1;
            ids[10] = s.experts as i32;
        }
        let x = random_bf16(32 * 256, 6);
        let (dx, dids, dw) = (
            stream.clone_htod(&x).unwrap(),
            stream.clone_htod(&ids).unwrap(),
            stream.clone_htod(&wts).unwrap(),
        );
        let mut out = stream.alloc_zeros::<f32>(32 * 256).unwrap();
        plan.launch(&stream, &dx, &dids, &dw, &mut out).unwrap();
        let r = plan.check(&stream);
        if rank == 0 {
            match r {
                Err(Error::MoeExpertId { token, k, id, bad, .. }) => {
                    assert_eq!(bad, 2);
                    assert!((token, k, id) == (1, 1, -1) || (token, k, id) == (5, 0, s.experts as i32));
                    println!("rank 0: bad ids reported: {}", r.unwrap_err());
                }
                other => panic!("rank 0: expected MoeExpertId, got {other:?}"),
            }
            let g = plan.inspect(&stream).unwrap();
            assert_eq!((g.pos[3], g.pos[10]), (u32::MAX, u32::MAX));
        } else {
            r.unwrap();
        }
        plan.check(&stream).unwrap();
        // A short ids buffer is rejected before any launch.
        let short = stream.clone_htod(&ids[1..]).unwrap();
        assert!(matches!(
            plan.launch(&stream, &dx, &short, &dw, &mut out),
            Err(Error::Shape { .. })
        ));
    }
    {
        let s = shape(32, 6, 2, SW, None);
        if world == 4 {
            let w = stream.alloc_zeros::<bf16>(1).unwrap();
            let e = MoeEpPlan::new(&comm, &stream, s, &w, &w).err().expect("E % W != 0");
            assert!(e.to_string().contains("E % W"), "{e}");
        }
    }

    // The last rank never launches: the others' waits end with a timeout naming it.
    let s = shape(64, 2 * world, 2, SW, None);
    let l = s.local_experts(world);
    let d_up = stream.clone_htod(&random_bf16(l * s.up_rows() * 256, 8)).unwrap();
    let d_down = stream.clone_htod(&random_bf16(l * 256 * 128, 9)).unwrap();
    let mut plan = MoeEpPlan::new(&comm, &stream, s, &d_up, &d_down).unwrap();
    let (ids, wts) = uniform_routing(64, s.experts, 2, 11 + rank as u64);
    let x = random_bf16(64 * 256, 12);
    let (dx, dids, dw) = (
        stream.clone_htod(&x).unwrap(),
        stream.clone_htod(&ids).unwrap(),
        stream.clone_htod(&wts).unwrap(),
    );
    let mut out = stream.alloc_zeros::<f32>(64 * 256).unwrap();
    plan.launch(&stream, &dx, &dids, &dw, &mut out).unwrap();
    plan.check(&stream).unwrap();
    let absent = world - 1;
    if rank == absent {
        println!("rank {rank}: skipping the second moe_ep launch on purpose");
        return;
    }
    let start = Instant::now();
    plan.launch(&stream, &dx, &dids, &dw, &mut out).unwrap();
    let err = plan.check(&stream).expect_err("the launch must time out");
    let elapsed = start.elapsed();
    match &err {
        Error::CommTimeout {
            rank: r, peer, flag, ..
        } => {
            assert_eq!(*r as usize, rank, "{err}");
            assert_eq!(*peer as usize, absent, "{err}");
            assert!(flag.contains("MoE"), "{err}");
        }
        other => panic!("rank {rank}: expected CommTimeout, got {other}"),
    }
    assert!(
        elapsed < Duration::from_secs(20),
        "gave up after {elapsed:?}, the timeout is 4 s"
    );
    println!("rank {rank}: {err} (returned after {:.2} s)", elapsed.as_secs_f64());
}
