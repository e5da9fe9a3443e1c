//! Whether GPU tests run here.
//!
//! GPU tests run when `MKERNEL_GPU_TESTS=1` (set by `cargo xtask test --gpu` and by the bundle's
//! `run-tests.sh`); then a missing GPU is a failure. Otherwise they print that they were
//! skipped and pass, so CI on machines without a GPU stays green and says so.
use mkernel::Device;

/// The environment variable that turns GPU tests on.
pub const GPU_TESTS_VAR: &str = "MKERNEL_GPU_TESTS";

/// Whether GPU tests were asked for.
pub fn gpu_tests_enabled() -> bool {
    std::env::var(GPU_TESTS_VAR).is_ok_and(|v| v == "1")
}

/// Device 0 when GPU tests are on; `None` (after printing why) when they are off.
/// Panics with the runtime's error when they are on but no usable GPU is present.
pub fn device_or_skip(test: &str) -> Option<Device> {
    if !gpu_tests_enabled() {
        eprintln!(
            "SKIPPED (no GPU requested): {test}; run `cargo xtask test --gpu` or set {GPU_TESTS_VAR}=1 on a GPU host"
        );
        return None;
    }
    match Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => panic!("{GPU_TESTS_VAR}=1 but no usable GPU: {e}"),
    }
}

/// For tests that run one process per GPU under `cargo xtask launch -n N -- <test binary>`:
/// this rank's device and bootstrap, or `None` (after printing why) when not launched that way
/// or when GPU tests are off.
pub fn launched_rank_or_skip(test: &str) -> Option<(Device, mkernel::bootstrap::Bootstrap)> {
    if std::env::var("RANK").is_err() {
        eprintln!("SKIPPED (not launched as ranks): {test}; run `bundle/xtask launch -n 2 -- <this test binary>` on a multi-GPU host");
        return None;
    }
    if !gpu_tests_enabled() {
        eprintln!("SKIPPED (no GPU requested): {test}; set {GPU_TESTS_VAR}=1");
        return None;
    }
    let boot = mkernel::bootstrap::Bootstrap::from_env(std::time::Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("bootstrap: {e}"));
    let dev = Device::new(boot.info().device()).unwrap_or_else(|e| panic!("rank {}: {e}", boot.info().rank()));
    Some((dev, boot))
}

/// [`launched_rank_or_skip`], then this rank's communicator with a heap of `heap_bytes` and a
/// device-wait timeout of `timeout` (everything else default); `None` when skipped.
pub fn launched_comm_or_skip(
    test: &str,
    heap_bytes: u64,
    timeout: std::time::Duration,
) -> Option<(Device, mkernel::Communicator)> {
    let (dev, boot) = launched_rank_or_skip(test)?;
    let cfg = mkernel::CommConfig {
        heap_bytes,
        timeout,
        ..Default::default()
    };
    let rank = boot.info().rank();
    let comm = mkernel::Communicator::new(&dev, boot, cfg).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    Some((dev, comm))
}

/// [`launched_rank_or_skip`] for a test of the inter-node path: `None` (after printing why) also
/// when the job has one node; else this rank's communicator with `cfg`.
pub fn launched_internode_comm_or_skip(
    test: &str,
    cfg: mkernel::CommConfig,
) -> Option<(Device, mkernel::Communicator)> {
    let (dev, boot) = launched_rank_or_skip(test)?;
    if boot.info().nnodes() < 2 {
        eprintln!("SKIPPED: launch with --nodes 2 (or more) to test the inter-node path");
        return None;
    }
    let rank = boot.info().rank();
    let comm = mkernel::Communicator::new(&dev, boot, cfg).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    Some((dev, comm))
}
