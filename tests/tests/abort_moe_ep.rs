//! `Communicator::abort` while the expert-parallel MoE layer runs, on one node
//! (docs/protocol.md, "Abort and reset"; docs/moe.md): every rank enqueues the layer's first
//! kernels at once, and every rank but the last the rest too; the last rank enqueues the rest
//! only after rank 0's watchdog aborted (`support/abort_round.rs`), so the other ranks' kernels
//! wait for it in the routing, the dispatch (separate, and fused into the up projection) or the
//! combine when the abort comes. In each round every rank's launches end by themselves within
//! 10 s with the device timeout at 60 s (only the host abort word can end the waits in time),
//! `check()` is `Error::Aborted` by rank 0 on every rank, and on rank 0, whose kernels were
//! waiting when it aborted, the record names the MoE flag that wait was for. Then `reset()`, a
//! new plan (an aborted plan's flags are out of step), and its launch gives the result the
//! layer gave before the abort.
//! Run: `bundle/xtask launch -n 2 [--share-gpu] -- bundle/tests/mkernel-tests-abort_moe_ep`.
#[path = "support/abort_round.rs"]
mod abort_round;

use abort_round::{aborted_round_after, assert_close, values, Mode, ABORTER, DEVICE_TIMEOUT};
use half::bf16;
use mkernel::cudarc::driver::{CudaSlice, CudaStream};
use mkernel::ops::moe::Activation;
use mkernel::ops::moe_ep::{MoeEpPlan, MoeEpShape, MoeEpStage};
use mkernel::{Communicator, Error};
use mkernel_tests::gpu::launched_comm_or_skip;
use mkernel_tests::moe::uniform_routing;
use std::sync::Arc;

/// One aborted round: the plan kind, the first stage the lagging rank enqueues only after the
/// abort, and the MoE flag rank 0's record names (the kernel rank 0 waits in).
struct Round {
    fused: bool,
    stage: MoeEpStage,
    flag: &'static str,
}

/// The layer's launch buffers (the same on every launch of every plan of this test).
struct Inputs {
    x: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
}

fn plan<'a>(
    comm: &'a Communicator,
    stream: &Arc<CudaStream>,
    shape: MoeEpShape,
    w: &'a (CudaSlice<bf16>, CudaSlice<bf16>),
    fused: bool,
) -> MoeEpPlan<'a> {
    if fused {
        MoeEpPlan::new_fused(comm, stream, shape, &w.0, &w.1).unwrap()
    } else {
        MoeEpPlan::new(comm, stream, shape, &w.0, &w.1).unwrap()
    }
}

/// A whole launch of `plan`, checked; the output.
fn run(plan: &mut MoeEpPlan, stream: &Arc<CudaStream>, i: &Inputs, out: &mut CudaSlice<f32>) -> Vec<f32> {
    plan.launch(stream, &i.x, &i.ids, &i.weights, out).unwrap();
    plan.check(stream).unwrap();
    stream.clone_dtoh(out).unwrap()
}

#[test]
#[ignore = "needs GPU ranks (xtask launch -n 2|4 [--share-gpu]; cargo xtask test --gpu runs it)"]
fn abort_stops_every_rank_in_the_moe_ep_route_dispatch_and_combine() {
    let Some((dev, comm)) = launched_comm_or_skip(
        "abort_stops_every_rank_in_the_moe_ep_route_dispatch_and_combine",
        512 << 20,
        DEVICE_TIMEOUT,
    ) else {
        return;
    };
    let handle = comm.abort_handle();
    let stream = dev.default_stream();
    let (rank, world) = (comm.global_rank(), comm.global_world() as usize);
    let shape = MoeEpShape {
        tokens: 256,
        experts: 4 * world,
        top_k: 4,
        hidden: 512,
        ffn: 256,
        act: Activation::SwiGlu,
        capacity: None,
    };
    let l = shape.local_experts(world);
    let w = (
        stream
            .clone_htod(&values(l * shape.up_rows() * shape.hidden, 10 + rank as u64))
            .unwrap(),
        stream
            .clone_htod(&values(l * shape.hidden * shape.ffn, 20 + rank as u64))
            .unwrap(),
    );
    let (ids, weights) = uniform_routing(shape.tokens, shape.experts, shape.top_k, 30 + rank as u64);
    let inputs = Inputs {
        x: stream
            .clone_htod(&values(shape.tokens * shape.hidden, 40 + rank as u64))
            .unwrap(),
        ids: stream.clone_htod(&ids).unwrap(),
        weights: stream.clone_htod(&weights).unwrap(),
    };
    let mut out = stream.alloc_zeros::<f32>(shape.tokens * shape.hidden).unwrap();

    let rounds = [
        Round {
            fused: false,
            stage: MoeEpStage::Route,
            flag: "MoE",
        },
        Round {
            fused: false,
            stage: MoeEpStage::Dispatch,
            flag: "MoE Rows",
        },
        Round {
            fused: false,
            stage: MoeEpStage::Combine,
            flag: "MoE Out",
        },
        // Fused: the dispatch runs in the up projection's kernel (its `Dispatch` stage is empty).
        Round {
            fused: true,
            stage: MoeEpStage::Up,
            flag: "MoE Rows",
        },
        Round {
            fused: true,
            stage: MoeEpStage::Combine,
            flag: "MoE Out",
        },
    ];
    let mut current: Option<(bool, MoeEpPlan, Vec<f32>)> = None;
    for r in rounds {
        if current.as_ref().is_none_or(|c| c.0 != r.fused) {
            let mut p = plan(&comm, &stream, shape, &w, r.fused);
            let before = run(&mut p, &stream, &inputs, &mut out);
            current = Some((r.fused, p, before));
        }
        let (_, p, before) = current.as_mut().expect("a plan");
        let what = format!("moe_ep{}_{:?}", if r.fused { "_fused" } else { "" }, r.stage).to_lowercase();
        let split = MoeEpStage::ALL
            .iter()
            .position(|&s| s == r.stage)
            .expect("a stage of the layer");
        let (head, rest) = MoeEpStage::ALL.split_at(split);
        let out_cell = std::cell::RefCell::new(&mut out);
        let stages = |stages: &[MoeEpStage]| -> mkernel::Result<()> {
            let mut o = out_cell.borrow_mut();
            for &s in stages {
                p.launch_stage(s, &stream, &inputs.x, &inputs.ids, &inputs.weights, &mut o)?;
            }
            Ok(())
        };
        let err = aborted_round_after(
            &comm,
            &handle,
            &stream,
            &what,
            Mode::LaggingRank,
            &|| stages(head),
            &|| stages(rest),
        );
        if rank == ABORTER {
            match &err {
                Error::Aborted { during: Some(d), .. } => assert!(d.contains(r.flag), "rank {rank}: {what}: {err}"),
                other => panic!("rank {rank}: {what}: expected an Aborted record of a MoE wait, got {other}"),
            }
        }
        comm.reset().unwrap();
        comm.check().unwrap();
        let mut fresh = plan(&comm, &stream, shape, &w, r.fused);
        let after = run(&mut fresh, &stream, &inputs, &mut out);
        let (a, b): (Vec<bf16>, Vec<bf16>) = (
            after.iter().map(|&v| bf16::from_f32(v)).collect(),
            before.iter().map(|&v| bf16::from_f32(v)).collect(),
        );
        assert_close(&what, &a, &b);
        println!("rank {rank}: {what}: after reset, a new plan: same result as before the abort");
        *p = fresh;
    }
}
