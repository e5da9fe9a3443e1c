//! AllGather and AllReduce over NVLink (one process per GPU): every step each rank gathers
//! every rank's new vector and sums them, checked against the CPU (every rank can make every
//! rank's input: the data is seeded by rank and step).
//!
//! Run: `cargo xtask launch -n 2 -- target/release/examples/collectives` (one GPU per rank;
//! add `--share-gpu` where the ranks share fewer GPUs).
mod common;

use common::{check, random_f32, read_heap, write_heap, Result, STEPS};
use mkernel::{CommConfig, Communicator, ReduceDtype};

/// f32 elements per rank.
const LEN: usize = 1 << 16;
/// CTAs that move the data (1..=127; `mkernel-bench` uses one per 64 KiB, 4 to 48).
const CTAS: u32 = 8;

fn main() -> std::process::ExitCode {
    common::run("collectives", collectives)
}

fn collectives() -> Result {
    let (dev, boot) = common::rank()?;
    let world = boot.info().world_size();
    // Heap: everything this process will `alloc`, each rounded up to 256 bytes.
    let bytes = (LEN * 4) as u64;
    let heap_bytes = bytes * world as u64 + 2 * bytes;
    let comm = Communicator::new(
        &dev,
        boot,
        CommConfig {
            heap_bytes,
            ..Default::default()
        },
    )?;
    let rank = comm.global_rank() as u64;
    let stream = dev.default_stream();
    // Same allocations in the same order on every rank: same offsets everywhere.
    let gathered = comm.alloc(bytes * world as u64)?;
    let (sum_in, sum_out) = (comm.alloc(bytes)?, comm.alloc(bytes)?);
    let mut local = stream.alloc_zeros::<f32>(LEN)?;

    for step in 0..STEPS {
        let input = |r: u64| random_f32(LEN, 1000 * step + r, 1.0);
        let mine = input(rank);
        stream.memcpy_htod(&mine, &mut local)?;
        // AllGather: from a local cudarc buffer into the heap (rank r's part at r * bytes).
        comm.all_gather(&stream, &local, &gathered, CTAS)?;
        // AllReduce: heap to heap.
        write_heap(&comm, &stream, &sum_in, &mine)?;
        comm.all_reduce(&stream, &sum_in, &sum_out, LEN as u64, ReduceDtype::F32, CTAS)?;
        stream.synchronize()?;
        comm.check()?; // a device-side timeout or an abort becomes an error naming rank and peer

        let all: Vec<Vec<f32>> = (0..world as u64).map(input).collect();
        let want: Vec<f64> = all.iter().flatten().map(|&v| v as f64).collect();
        let got: Vec<f32> = read_heap(&comm, &stream, &gathered, LEN * world)?;
        check(
            &format!("all_gather step {step}"),
            got.iter().map(|&v| v as f64),
            &want,
            0.0,
        )?;
        let want: Vec<f64> = (0..LEN).map(|i| all.iter().map(|v| v[i] as f64).sum()).collect();
        let got: Vec<f32> = read_heap(&comm, &stream, &sum_out, LEN)?;
        check(
            &format!("all_reduce step {step}"),
            got.iter().map(|&v| v as f64),
            &want,
            1e-6,
        )?;
    }
    Ok(())
}
