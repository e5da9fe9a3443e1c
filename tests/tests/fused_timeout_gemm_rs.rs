//! A rank that skips a fused gemm_rs launch: the others report a timeout naming it instead of
//! hanging or trapping. Run: `bundle/xtask launch -n 2 -- bundle/tests/mkernel-tests-fused_timeout_gemm_rs`.
#[path = "support/fused_timeout.rs"]
mod fused_timeout;

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs it under xtask launch)"]
fn missing_rank_ends_the_gemm_rs_launch_with_a_timeout() {
    fused_timeout::missing_rank_ends_the_launch_with_a_timeout(
        "missing_rank_ends_the_gemm_rs_launch_with_a_timeout",
        fused_timeout::Op::GemmRs,
    );
}
