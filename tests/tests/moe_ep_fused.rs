//! The expert-parallel MoE layer with the dispatch fused into the up projection
//! (`MoeEpPlan::new_fused`, docs/moe.md "Fused dispatch") against the CPU reference of the
//! whole layer: the cases of `moe_ep.rs` (uniform with a second launch, skewed, all tokens to
//! one expert, top-8 without activation, a capacity that drops rows, a CUDA graph replayed
//! with new routing), then a fused and a separate plan launched in turn on one communicator.
//! Run: `bundle/xtask launch -n 2 --share-gpu -- <this binary> --include-ignored --nocapture`
//! (`-n 4`, `-n 4 --nodes 2`).
#[path = "support/moe_ep_case.rs"]
mod moe_ep_case;
use mkernel_tests::gpu::launched_comm_or_skip;
use moe_ep_case::run_case;
use std::time::Duration;

#[test]
#[ignore = "needs GPU ranks (xtask launch -n 2|4 [--share-gpu] [--nodes 2] -- <this binary>)"]
fn moe_ep_fused_dispatch_matches_cpu_reference() {
    let Some((dev, comm)) = launched_comm_or_skip(
        "moe_ep_fused_dispatch_matches_cpu_reference",
        256 << 20,
        Duration::from_secs(4),
    ) else {
        return;
    };
    let world = comm.global_world() as usize;
    let stream = dev.default_stream();
    for (i, c) in moe_ep_case::cases(world, true).iter().enumerate() {
        println!("{}", run_case(&comm, &stream, c, 7 + 10 * i as u64));
    }
    // Fused and separate plans in turn: one launch epoch sequence for both.
    for (i, fused) in [false, true, false, true].into_iter().enumerate() {
        let mut c = moe_ep_case::cases(world, fused).remove(0);
        c.launches = 1;
        println!("{}", run_case(&comm, &stream, &c, 300 + i as u64));
    }
}
