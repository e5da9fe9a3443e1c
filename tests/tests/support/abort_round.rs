//! One aborted round of an operation, shared by `abort.rs` and `internode_abort.rs`: every rank
//! but the last launches the operation, which then waits for the last rank; rank 0 aborts from
//! a watchdog thread while its own kernel runs and its main thread sits in
//! `stream.synchronize()`; the last rank launches only once the abort has landed (its launch
//! must give up at its first wait; with [`aborted_round_after`] it launches an operation's first
//! kernels at once, the rest after the abort). Every rank must end its launch by itself (no
//! hang, no trap) and get `Error::Aborted` naming rank 0 from `check()`.
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

/// How the aborted round keeps the kernels busy when the abort comes.
#[derive(Clone, Copy, Debug)]
#[allow(dead_code)]
pub enum Mode {
    /// The last rank launches only after the abort: the others' kernels wait for it.
    LaggingRank,
    /// Every rank queues `n` launches at once (up to about 1.5 s of work, [`queued`];
    /// `work_ms` as timed on this rank): the abort meets kernels that run and make progress,
    /// and the queued rest, which must stop at their first wait (the round ends well before
    /// the queue's work would). The abort is a CPU store into host-mapped words, so it lands
    /// also while every rank's stream is full (docs/protocol.md, "Abort and reset").
    Queued { n: u32, work_ms: u32 },
}

/// [`Mode::Queued`] with launches for about 1.5 s of work (100 to 20 000), timed on every
/// rank (10 launches), the largest count of all ranks (collective).
#[allow(dead_code)]
pub fn queued(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    what: &str,
    launch: &dyn Fn() -> mkernel::Result<()>,
) -> Mode {
    let t = Instant::now();
    watching(comm, what, 32, || {
        for _ in 0..10 {
            launch().unwrap();
        }
        stream.synchronize().unwrap();
    });
    check_fused(comm, what, 32).unwrap();
    let one = t.elapsed().as_secs_f64() / 10.0;
    let mine = ((1.5 / one) as u32).clamp(100, 20_000);
    let all = comm
        .bootstrap()
        .store()
        .all_gather(
            &format!("abort-test/{what}/queue"),
            &mine.to_le_bytes(),
            Duration::from_secs(60),
        )
        .unwrap();
    let n = all
        .iter()
        .map(|v| u32::from_le_bytes(v.as_slice().try_into().unwrap()))
        .max()
        .unwrap_or(mine);
    Mode::Queued {
        n,
        work_ms: (n as f64 * one * 1e3) as u32,
    }
}

/// `comm.check()`, and when it reports a timeout naming a peer on this node, first prints that
/// peer's fused-launch state and this rank's, read through this process's mappings
/// ([`Communicator::fused_snapshot`], `row_tiles` of the chunk): a peer whose kernel stalls
/// without a record of its own (its waits are longer, or its CTAs never started) is seen from
/// here. Call after the stream synchronized.
#[allow(dead_code)]
pub fn check_fused(comm: &Communicator, what: &str, row_tiles: u32) -> mkernel::Result<()> {
    let r = comm.check();
    if let Err(Error::CommTimeout { peer, .. }) = &r {
        let (g, w) = (comm.global_rank(), comm.world());
        let mut ranks = vec![comm.rank()];
        if peer / w == g / w && peer % w != comm.rank() {
            ranks.insert(0, peer % w);
        }
        for l in ranks {
            match comm.fused_snapshot(l, 64, row_tiles) {
                Ok(s) => println!("rank {g}: {what}: after {}: {s}", r.as_ref().unwrap_err()),
                Err(e) => println!("rank {g}: {what}: no snapshot of local rank {l}: {e}"),
            }
        }
    }
    r
}

/// How long a watched stretch of launches ([`watching`]) may run before the watchdog prints
/// every local rank's fused state: well past any launch queue of these tests, well before the
/// device timeout (`DEVICE_TIMEOUT`), so the view is of the stall itself.
pub const STALL_REPORT: Duration = Duration::from_secs(20);

/// Runs `f` (launches, then `stream.synchronize()`); if it has not returned after
/// [`STALL_REPORT`], a watchdog thread prints the fused-launch state of every local rank
/// ([`Communicator::fused_snapshot`], `row_tiles` of the chunk), this rank first, while the
/// launches still run: on a rank whose launch stalls without a record of its own, this is all
/// it says before the launcher stops it.
#[allow(dead_code)]
pub fn watching<R>(comm: &Communicator, what: &str, row_tiles: u32, f: impl FnOnce() -> R) -> R {
    let (done, stalled) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            if stalled.recv_timeout(STALL_REPORT) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                return;
            }
            let g = comm.global_rank();
            let me = comm.rank();
            // First a line without CUDA calls (a snapshot's could wait on the driver).
            println!("rank {g}: {what}: still running after {STALL_REPORT:?}; reading every local rank's state");
            for l in std::iter::once(me).chain((0..comm.world()).filter(|&l| l != me)) {
                match comm.fused_snapshot(l, 64, row_tiles) {
                    Ok(snap) => println!("rank {g}: {what}: still running after {STALL_REPORT:?}: {snap}"),
                    Err(e) => println!("rank {g}: {what}: no snapshot of local rank {l}: {e}"),
                }
            }
        });
        let r = f();
        drop(done);
        r
    })
}

/// Runs one aborted round of `launch` (see the module doc); returns what `check()` said.
#[allow(dead_code)]
pub fn aborted_round(
    comm: &Communicator,
    handle: &AbortHandle,
    stream: &Arc<CudaStream>,
    what: &str,
    mode: Mode,
    launch: &dyn Fn() -> mkernel::Result<()>,
) -> Error {
    aborted_round_after(comm, handle, stream, what, mode, &|| Ok(()), launch)
}

/// As [`aborted_round`], every rank first enqueueing `head` at once, the lagging rank too
/// ([`Mode::LaggingRank`]; once, before the queue, in [`Mode::Queued`]): for an operation of
/// several kernels, `head` its first kernels and `launch` the rest, so that the other ranks'
/// kernels wait in `launch`'s first kernel when the abort comes.
pub fn aborted_round_after(
    comm: &Communicator,
    handle: &AbortHandle,
    stream: &Arc<CudaStream>,
    what: &str,
    mode: Mode,
    head: &dyn Fn() -> mkernel::Result<()>,
    launch: &dyn Fn() -> mkernel::Result<()>,
) -> Error {
    let store = comm.bootstrap().store();
    let g = comm.global_rank();
    let lagging = match mode {
        Mode::LaggingRank => comm.world() * comm.nnodes() - 1,
        Mode::Queued { .. } => u32::MAX,
    };
    let launches = match mode {
        Mode::LaggingRank => 1,
        Mode::Queued { n, .. } => n,
    };
    let key = format!("abort-test/{what}/aborted");
    let t = Duration::from_secs(60);
    store.barrier(&format!("abort-test/{what}/start"), t).unwrap();
    let start = Instant::now();
    head().unwrap_or_else(|e| panic!("rank {g}: {what}: the first kernels' launch failed: {e}"));
    let launch_all = || {
        for i in 0..launches {
            launch().unwrap_or_else(|e| {
                panic!(
                    "rank {g}: {what}: launch {i} of {launches} failed {:.3} s into the round: {e}",
                    start.elapsed().as_secs_f64()
                )
            });
        }
        if launches > 1 {
            println!(
                "rank {g}: {what}: {launches} launches enqueued {:.3} s into the round",
                start.elapsed().as_secs_f64()
            );
        }
    };
    if g == lagging {
        // The abort has landed (rank 0 wrote every reachable abort word before this key).
        store.get(&key, t).unwrap();
        launch_all();
    } else if g == ABORTER {
        std::thread::scope(|s| {
            let watchdog = s.spawn(|| {
                std::thread::sleep(ABORT_AFTER);
                handle.abort().unwrap();
                store.set(&key, b"1").unwrap();
            });
            launch_all();
            // The kernels run while the watchdog aborts.
            stream.synchronize().unwrap_or_else(|e| {
                panic!(
                    "rank {g}: {what}: the launch failed instead of ending ({:.3} s into the round): {e}",
                    start.elapsed().as_secs_f64()
                )
            });
            watchdog.join().unwrap();
        });
    } else {
        launch_all();
    }
    // Every launch ends by itself; a trap would make this a sticky launch failure.
    stream.synchronize().unwrap_or_else(|e| {
        panic!(
            "rank {g}: {what}: the launch failed instead of ending ({:.3} s into the round): {e}",
            start.elapsed().as_secs_f64()
        )
    });
    let elapsed = start.elapsed();
    if g != ABORTER {
        // (A queue may have run out before the abort: `check()` reports it once it landed.)
        store.get(&key, t).unwrap();
    }
    let err = comm.check().expect_err("an aborted communicator must report the abort");
    match &err {
        Error::Aborted { by_rank, .. } => assert_eq!(*by_rank, ABORTER, "rank {g}: {what}: {err}"),
        other => panic!("rank {g}: {what}: expected Error::Aborted, got {other}"),
    }
    let bound = match mode {
        // The queue held 1 s of work or more: ending well before, the abort cut it short.
        Mode::Queued { work_ms, .. } if work_ms >= 1000 => Duration::from_millis(work_ms as u64 * 3 / 4),
        _ => ROUND_BOUND,
    };
    assert!(
        elapsed < bound,
        "rank {g}: {what}: the aborted round took {elapsed:?} ({mode:?})"
    );
    println!(
        "rank {g}: {what} ({mode:?}): {err} (the round ended after {:.3} s)",
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
