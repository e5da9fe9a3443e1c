//! GEMM+ReduceScatter in deep launch queues on one node: thousands of launches queued back to
//! back with no host synchronization between them (on 2 ranks the stager path, docs/fused.md
//! "Stagers"; with `no_stager` the consumers' own epilogue I/O), and the queued round that rank 0
//! aborts (`support/abort_round.rs`, `Mode::Queued`) on each path.
//!
//! Cases (`MKERNEL_QUEUE_CASES`, comma-separated; default all, in this order):
//! - `flow`, `flow-no-stager`: [`LAUNCHES`] launches queued at once; the output must equal the
//!   first launch's (the sum is computed in the same order every launch).
//! - `abort`, `abort-no-stager`: about 1.5 s of launches queued, rank 0 aborts 300 ms in; every
//!   rank's queue ends well before its work would, `check()` names rank 0, and after `reset()`
//!   the next launch gives the result of the launch before the abort.
//!
//! Run: `bundle/xtask launch -n 2 [--share-gpu] -- bundle/tests/mkernel-tests-abort_queued_gemm_rs
//! --include-ignored --nocapture`.
#[path = "support/abort_round.rs"]
mod abort_round;

use abort_round::{aborted_round, assert_close, check_fused, queued, values, watching, DEVICE_TIMEOUT};
use half::bf16;
use mkernel::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use mkernel::ops::{GemmRsPlan, RsSplit};
use mkernel_tests::gpu::launched_comm_or_skip;
use std::sync::Arc;
use std::time::Instant;

/// Launches queued at once in a `flow` case.
const LAUNCHES: u32 = 3000;

fn ptr<T>(s: &mut CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _g) = s.device_ptr_mut(stream);
    p
}

#[test]
#[ignore = "needs GPU ranks (xtask launch -n 2 [--share-gpu]; cargo xtask test --gpu runs it)"]
fn gemm_rs_queued_back_to_back_and_aborted() {
    let Some((dev, comm)) = launched_comm_or_skip("gemm_rs_queued_back_to_back_and_aborted", 512 << 20, DEVICE_TIMEOUT)
    else {
        return;
    };
    let handle = comm.abort_handle();
    let stream = dev.default_stream();
    let (rank, world) = (comm.rank(), comm.world() as usize);
    // The shape of tests/tests/abort.rs: 4 tiles per CTA and more on 66 SMs, 16 K blocks.
    let (m, n, k) = (2048 * world, 2048, 1024);
    let mut a = stream.clone_htod(&values(m * k, 100 + rank as u64)).unwrap();
    let mut b = stream.clone_htod(&values(n * k, 200 + rank as u64)).unwrap();
    let out_elems = m / world * n;
    let mut c = stream.alloc_zeros::<bf16>(out_elems).unwrap();
    let (pa, pb, pc) = (ptr(&mut a, &stream), ptr(&mut b, &stream), ptr(&mut c, &stream));
    let cases = std::env::var("MKERNEL_QUEUE_CASES").unwrap_or("flow,flow-no-stager,abort,abort-no-stager".into());
    for case in cases.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let no_stager = case.ends_with("-no-stager");
        let split = RsSplit {
            no_stager,
            ..RsSplit::parts(1)
        };
        // SAFETY: `a`, `b` hold m x k and n x k elements, `c` m / world x n; all alive to the
        // end of the test; only the plan's launches touch them while they run.
        let plan = unsafe { GemmRsPlan::new_raw(&comm, &stream, pa, pb, Some(pc), m, n, k, split) }.unwrap();
        let read = || stream.clone_dtoh(&c.slice(..out_elems)).unwrap();
        let clear = || {
            let zeros = vec![bf16::ZERO; out_elems];
            // SAFETY: `c` holds `out_elems` elements; no kernel uses it now.
            unsafe { mkernel::cudarc::driver::result::memcpy_htod_sync(c.device_ptr(&stream).0, &zeros).unwrap() };
        };
        let launch = || plan.launch(&stream);
        clear();
        // Row tiles of a rank's chunk (the counters the snapshot of a stalled rank shows).
        let row_tiles = (m / world / 128) as u32;
        launch().unwrap();
        stream.synchronize().unwrap();
        check_fused(&comm, case, row_tiles).unwrap();
        let first = read();
        if rank == 0 {
            println!(
                "{case}: stagers {}, {} CTAs, {} stream-K tiles",
                plan.stager(),
                plan.split().1,
                plan.stream_k_tiles()
            );
        }
        match case.trim_end_matches("-no-stager") {
            "flow" => {
                clear();
                let t = Instant::now();
                watching(&comm, case, row_tiles, || {
                    for i in 0..LAUNCHES {
                        launch().unwrap_or_else(|e| panic!("rank {rank}: {case}: launch {i} of {LAUNCHES}: {e}"));
                    }
                    stream.synchronize().unwrap_or_else(|e| {
                        panic!("rank {rank}: {case}: the queue of {LAUNCHES} launches failed: {e}")
                    });
                });
                let each = t.elapsed().as_secs_f64() / LAUNCHES as f64;
                check_fused(&comm, case, row_tiles).unwrap();
                let last = read();
                let differ = first
                    .iter()
                    .zip(&last)
                    .filter(|(x, y)| x.to_bits() != y.to_bits())
                    .count();
                assert_close(case, &last, &first);
                println!(
                    "rank {rank}: {case}: {LAUNCHES} launches queued at once: {:.1} us each, the last output equals the first ({differ} of {} elements not bit-equal)",
                    each * 1e6,
                    first.len()
                );
            }
            "abort" => {
                let mode = queued(&comm, &stream, case, &launch);
                aborted_round(&comm, &handle, &stream, case, mode, &launch);
                comm.reset().unwrap();
                comm.check().unwrap();
                clear();
                launch().unwrap();
                stream.synchronize().unwrap();
                comm.check().unwrap();
                assert_close(case, &read(), &first);
                println!("rank {rank}: {case}: after reset: same result as before the abort");
            }
            other => {
                panic!("MKERNEL_QUEUE_CASES: unknown case {other:?} (flow, flow-no-stager, abort, abort-no-stager)")
            }
        }
    }
}
