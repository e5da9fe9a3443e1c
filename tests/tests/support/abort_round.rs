//! One aborted round of an operation, shared by `abort.rs` and `internode_abort.rs`: every rank
//! but the last launches the operation, which then waits for the last rank; rank 0 aborts from
//! a watchdog thread while its own kernel runs and its main thread sits in
//! `stream.synchronize()`; the last rank launches only once the abort has landed (its launch
//! must give up at its first wait). Every rank must end its launch by itself (no hang, no
//! trap) and get `Error::Aborted` naming rank 0 from `check()`.
use mkernel::cudarc::driver::CudaStream;
use mkernel::{AbortHandle, Communicator, Error};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The rank that aborts.
pub const ABORTER: u32 = 0;
/// How long a round may take on any rank: the device timeout of these tests is far longer
/// (`DEVICE_TIMEOUT`), so only the abort can end the waits in time.
pub const ROUND_BOUND: Duration = Duration::from_secs(10);
/// The communicators' device-wait timeout in these tests.
pub const DEVICE_TIMEOUT: Duration = Duration::from_secs(60);
/// When rank 0's watchdog aborts, after its launch.
const ABORT_AFTER: Duration = Duration::from_millis(300);

/// Runs one aborted round of `launch` (see the module doc); returns what `check()` said.
pub fn aborted_round(
    comm: &Communicator,
    handle: &AbortHandle,
    stream: &Arc<CudaStream>,
    what: &str,
    launch: &dyn Fn() -> mkernel::Result<()>,
) -> Error {
    let store = comm.bootstrap().store();
    let g = comm.global_rank();
    let lagging = comm.world() * comm.nnodes() - 1;
    let key = format!("abort-test/{what}/aborted");
    let t = Duration::from_secs(60);
    store.barrier(&format!("abort-test/{what}/start"), t).unwrap();
    let start = Instant::now();
    if g == lagging {
        // The abort has landed (rank 0 wrote every reachable abort word before this key).
        store.get(&key, t).unwrap();
        launch().unwrap();
    } else if g == ABORTER {
        launch().unwrap();
        std::thread::scope(|s| {
            let watchdog = s.spawn(|| {
                std::thread::sleep(ABORT_AFTER);
                handle.abort().unwrap();
                store.set(&key, b"1").unwrap();
            });
            // The kernel runs (it waits for the lagging rank) while the watchdog aborts.
            stream
                .synchronize()
                .unwrap_or_else(|e| panic!("rank {g}: {what}: the launch failed instead of ending: {e}"));
            watchdog.join().unwrap();
        });
    } else {
        launch().unwrap();
    }
    // Every launch ends by itself; a trap would make this a sticky launch failure.
    stream
        .synchronize()
        .unwrap_or_else(|e| panic!("rank {g}: {what}: the launch failed instead of ending: {e}"));
    let elapsed = start.elapsed();
    let err = comm.check().expect_err("an aborted communicator must report the abort");
    match &err {
        Error::Aborted { by_rank, .. } => assert_eq!(*by_rank, ABORTER, "rank {g}: {what}: {err}"),
        other => panic!("rank {g}: {what}: expected Error::Aborted, got {other}"),
    }
    assert!(
        elapsed < ROUND_BOUND,
        "rank {g}: {what}: the aborted round took {elapsed:?}"
    );
    println!(
        "rank {g}: {what}: {err} (the round ended after {:.3} s)",
        elapsed.as_secs_f64()
    );
    err
}

/// Deterministic small bf16 values (a simple LCG), distinct per `seed`.
pub fn values(len: usize, seed: u64) -> Vec<half::bf16> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            half::bf16::from_f32(((x >> 40) % 17) as f32 / 16.0 - 0.5)
        })
        .collect()
}

/// Element-wise comparison of two bf16 results (they should be bit-equal; a tolerance keeps
/// the check independent of the reduction order).
#[allow(dead_code)]
pub fn assert_close(what: &str, a: &[half::bf16], b: &[half::bf16]) {
    assert_eq!(a.len(), b.len());
    let bad = a
        .iter()
        .zip(b)
        .filter(|(x, y)| {
            let (x, y) = (x.to_f32(), y.to_f32());
            (x - y).abs() > 1e-2 * x.abs().max(1.0)
        })
        .count();
    assert_eq!(bad, 0, "{what}: {bad} of {} elements differ after the reset", a.len());
}
