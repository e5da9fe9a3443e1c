//! A rank that skips a fused ag_gemm launch: the others report a timeout naming it instead of
//! hanging or trapping. Run: `bundle/xtask launch -n 2 -- bundle/tests/mkernel-tests-fused_timeout_ag_gemm`.
#[path = "support/fused_timeout.rs"]
mod fused_timeout;

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs it under xtask launch)"]
fn missing_rank_ends_the_ag_gemm_launch_with_a_timeout() {
    fused_timeout::missing_rank_ends_the_launch_with_a_timeout(
        "missing_rank_ends_the_ag_gemm_launch_with_a_timeout",
        fused_timeout::Op::AgGemm,
    );
}
