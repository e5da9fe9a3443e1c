//! `Communicator::abort` while a kernel runs, on one node: an AllGather (LL, staged and direct
//! paths), then each fused op (AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce); the kernels
//! wait for a lagging rank, and (direct AllGather, GEMM+ReduceScatter, GEMM+AllReduce) every
//! rank also queues about 1.5 s of launches at once (`Mode`). In each
//! round every rank's launches end by themselves within the round's bound (the device timeout
//! is 60 s) and `check()` names rank 0 as the aborter; `reset()` then makes the communicator
//! usable again: the next launch gives the same result as the launch before the abort.
//! Run: `bundle/xtask launch -n 2 [--share-gpu] -- bundle/tests/mkernel-tests-abort`.
#[path = "support/abort_round.rs"]
mod abort_round;

use abort_round::{aborted_round, assert_close, queued, values, Mode, DEVICE_TIMEOUT};
use half::bf16;
use mkernel::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use mkernel::ops::{AgGemmPlan, GemmRsPlan, RsSplit};
use mkernel::{Communicator, SymBuffer};
use mkernel_tests::gpu::launched_comm_or_skip;
use std::sync::Arc;

fn ptr<T>(s: &mut CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _g) = s.device_ptr_mut(stream);
    p
}

fn read_heap(comm: &Communicator, b: &SymBuffer, elems: usize) -> Vec<bf16> {
    let mut v = vec![bf16::ZERO; elems];
    // SAFETY: `b` holds at least `elems` bf16 of this rank's heap; the stream is idle.
    unsafe { mkernel::cudarc::driver::result::memcpy_dtoh_sync(&mut v, comm.ptr(b).unwrap()).unwrap() };
    v
}

fn zero_heap(comm: &Communicator, b: &SymBuffer) {
    let zeros = vec![0u8; b.bytes() as usize];
    // SAFETY: `b` is this rank's heap buffer of `b.bytes` bytes; no kernel uses it now.
    unsafe { mkernel::cudarc::driver::result::memcpy_htod_sync(comm.ptr(b).unwrap(), &zeros).unwrap() };
}

fn label(m: Mode) -> &'static str {
    match m {
        Mode::LaggingRank => "lagging",
        Mode::Queued { .. } => "queued",
    }
}

#[test]
#[ignore = "needs GPU ranks (xtask launch -n 2 [--share-gpu]; cargo xtask test --gpu runs it)"]
fn abort_stops_every_op_and_reset_makes_the_communicator_usable() {
    let Some((dev, comm)) = launched_comm_or_skip(
        "abort_stops_every_op_and_reset_makes_the_communicator_usable",
        512 << 20,
        DEVICE_TIMEOUT,
    ) else {
        return;
    };
    let handle = comm.abort_handle();
    let stream = dev.default_stream();
    let (rank, world) = (comm.rank(), comm.world() as usize);

    // 1. AllGather on each path: LL (4 KiB per rank), staged (128 KiB), direct (1 MiB,
    // Ready/Done handshakes); the direct one also with a queue of launches.
    for (bytes, path) in [(4u64 << 10, "ll"), (128 << 10, "staged"), (1 << 20, "direct")] {
        let mine = values(bytes as usize / 2, rank as u64);
        let src = stream.clone_htod(&mine).unwrap();
        let dst = comm.alloc(bytes * world as u64).unwrap();
        let expected: Vec<bf16> = (0..world as u64).flat_map(|r| values(bytes as usize / 2, r)).collect();
        let check_data =
            |comm: &Communicator| assert_close("all_gather", &read_heap(comm, &dst, expected.len()), &expected);
        comm.all_gather(&stream, &src, &dst, 8).unwrap();
        stream.synchronize().unwrap();
        comm.check().unwrap();
        check_data(&comm);
        let mut modes = vec![Mode::LaggingRank];
        if path == "direct" {
            let launch = || comm.all_gather(&stream, &src, &dst, 8);
            modes.push(queued(&comm, &stream, &format!("all_gather_{path}"), &launch));
        }
        for mode in modes {
            let what = format!("all_gather_{path}_{}", label(mode));
            aborted_round(&comm, &handle, &stream, &what, mode, &|| {
                comm.all_gather(&stream, &src, &dst, 8)
            });
            comm.reset().unwrap();
            comm.check().unwrap();
            zero_heap(&comm, &dst);
            comm.all_gather(&stream, &src, &dst, 8).unwrap();
            stream.synchronize().unwrap();
            comm.check().unwrap();
            check_data(&comm);
            println!("rank {rank}: {what}: after reset: correct");
        }
    }

    // 2. The fused ops (shapes of tests/tests/support/fused_timeout.rs: two tiles and more per
    // CTA, more K blocks than ring stages).
    let (m, n, k) = (2048 * world, 2048, 1024);
    let a_host = values(m * k, 100 + rank as u64);
    let b_host = values(n * k, 200 + rank as u64);
    let mut a = stream.clone_htod(&a_host).unwrap();
    let mut b = stream.clone_htod(&b_host).unwrap();
    let mut c = stream.alloc_zeros::<bf16>(m * n).unwrap();
    let (pa, pb, pc) = (ptr(&mut a, &stream), ptr(&mut b, &stream), ptr(&mut c, &stream));
    for op in ["ag_gemm", "gemm_rs", "gemm_ar"] {
        // The raw constructors: the outputs are read between launches.
        // SAFETY: buffers sized for every plan's shape (A shard <= m x k, out <= m x n), alive
        // to the end; nothing else touches them while a launch runs.
        let (launch, ar_out): (Box<dyn Fn() -> mkernel::Result<()> + '_>, Option<SymBuffer>) = unsafe {
            let s = &stream;
            match op {
                "ag_gemm" => {
                    let plan = AgGemmPlan::new_raw(&comm, s, pa, pb, pc, m, n, k, 2).unwrap();
                    (Box::new(move || plan.launch(s)), None)
                }
                "gemm_rs" => {
                    let plan = GemmRsPlan::new_raw(&comm, s, pa, pb, Some(pc), m, n, k, RsSplit::parts(1)).unwrap();
                    (Box::new(move || plan.launch(s)), None)
                }
                _ => {
                    let plan = GemmRsPlan::new_raw(&comm, s, pa, pb, None, m, n, k, RsSplit::parts(1)).unwrap();
                    let out = plan.all_reduce_output();
                    (Box::new(move || plan.launch(s)), out)
                }
            }
        };
        let out_elems = match op {
            "ag_gemm" => m * n,
            "gemm_rs" => m / world * n,
            _ => m * n,
        };
        let read = |comm: &Communicator| match &ar_out {
            Some(o) => read_heap(comm, o, out_elems),
            None => stream.clone_dtoh(&c.slice(..out_elems)).unwrap(),
        };
        let clear = |comm: &Communicator| match &ar_out {
            Some(o) => zero_heap(comm, o),
            None => {
                let zeros = vec![bf16::ZERO; out_elems];
                // SAFETY: `c` holds at least `out_elems` elements; no kernel uses it now.
                unsafe { mkernel::cudarc::driver::result::memcpy_htod_sync(c.device_ptr(&stream).0, &zeros).unwrap() };
            }
        };
        launch().unwrap();
        stream.synchronize().unwrap();
        comm.check().unwrap();
        let before = read(&comm);
        // AllGather+GEMM is not queued: its consumers do not read the abort word (an aborted
        // launch still runs its math on stale operands; docs/protocol.md).
        let mut modes = vec![Mode::LaggingRank];
        if op != "ag_gemm" {
            modes.push(queued(&comm, &stream, op, &*launch));
        }
        for mode in modes {
            let what = format!("{op}_{}", label(mode));
            aborted_round(&comm, &handle, &stream, &what, mode, &*launch);
            comm.reset().unwrap();
            comm.check().unwrap();
            clear(&comm);
            launch().unwrap();
            stream.synchronize().unwrap();
            comm.check().unwrap();
            assert_close(op, &read(&comm), &before);
            println!("rank {rank}: {what}: after reset: same result as before the abort");
        }
    }
}
