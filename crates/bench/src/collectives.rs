//! AllGather / ReduceScatter / AllReduce: ours beside NCCL, nccl-tests style rows, one process
//! per GPU (run under `xtask launch`; `xtask bench --op allgather` does that itself).
//! Sizes follow nccl-tests: AllGather = output bytes, ReduceScatter = input bytes,
//! AllReduce = buffer bytes; busbw = algbw x (n-1)/n (x 2(n-1)/n for AllReduce). bf16 data.
use crate::nccl::Nccl;
use crate::timing::median_ms_interleaved;
use crate::Args;
use anyhow::Result;
use mkernel::bootstrap::Bootstrap;
use mkernel::{CommConfig, Communicator, Device, ReduceDtype};
use serde_json::{json, Value};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coll {
    AllGather,
    ReduceScatter,
    AllReduce,
}

/// CTAs for a message of `bytes` moved per rank: one per 64 KiB, 4..=48 (override: --ctas;
/// the communicator raises anything below 4 to 4).
fn default_ctas(bytes_per_rank: u64) -> u32 {
    (bytes_per_rank / (64 << 10)).clamp(4, 48) as u32
}

pub fn run(args: &Args, coll: Coll) -> Result<Vec<Value>> {
    let boot = Bootstrap::from_env(Duration::from_secs(60))?;
    let info = boot.info().clone();
    let dev = Device::new(info.device())?;
    let (rank, world) = (info.rank(), info.world_size());
    let max_bytes: u64 = args.max_bytes;
    let nccl = Nccl::new(&boot, rank, world)?;
    let comm = Communicator::new(
        &dev,
        boot,
        CommConfig {
            heap_bytes: 2 * max_bytes + (64 << 20),
            ..Default::default()
        },
    )?;
    let stream = dev.default_stream();
    let a = comm.alloc(max_bytes)?;
    let b = comm.alloc(max_bytes)?;
    let (pa, pb) = (comm.ptr(&a)?, comm.ptr(&b)?);
    // Deterministic small values so sums stay exact in bf16 and #wrong can compare with NCCL.
    let init: Vec<u8> = (0..max_bytes / 2)
        .flat_map(|i| {
            half::bf16::from_f32(((i % 7) as f32 - 3.0) / 4.0)
                .to_bits()
                .to_le_bytes()
        })
        .collect();
    // SAFETY: pa is this rank's heap buffer of max_bytes.
    unsafe { cudarc::driver::result::memcpy_htod_sync(pa, &init)? };
    let scratch = stream.alloc_zeros::<u8>(max_bytes as usize)?;
    let ps = {
        use cudarc::driver::DevicePtr;
        scratch.device_ptr(&stream).0
    };
    let n = world as u64;
    if rank == 0 {
        println!("# {coll:?}: {world} ranks ({} per node), bf16, ours vs NCCL 2.x (NCCL_NVLS_ENABLE={}), interleaved, median of {} after {} warm-up",
            info.local_world_size(), std::env::var("NCCL_NVLS_ENABLE").unwrap_or_default(), args.iters, args.warmup);
        println!(
            "{:>12} {:>12} {:>6} {:>5} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>6} {:>6}",
            "size(B)",
            "count",
            "type",
            "ctas",
            "ours(us)",
            "algbw",
            "busbw",
            "nccl(us)",
            "algbw",
            "busbw",
            "speedup",
            "#wrong"
        );
    }
    let mut rows = vec![];
    let mut size = args.min_bytes.max(16 * n * n);
    while size <= max_bytes {
        let per_rank = size / n;
        let (bytes_moved, bus_factor) = match coll {
            Coll::AllGather | Coll::ReduceScatter => (per_rank, (n - 1) as f64 / n as f64),
            Coll::AllReduce => (size / n, 2.0 * (n - 1) as f64 / n as f64),
        };
        let ctas = args.ctas.unwrap_or_else(|| default_ctas(bytes_moved));
        let count = size / 2;
        let mut ours = || -> Result<()> {
            match coll {
                // The raw layer: the source (AllGather) and the destination (ReduceScatter) are
                // heap buffers, compared with NCCL's below.
                // SAFETY: `pa` and `pb` are this rank's heap buffers `a` and `b` of `max_bytes`
                // >= `size` >= `per_rank`; the heap lives as long as `comm`.
                Coll::AllGather => unsafe { comm.all_gather_raw(&stream, pa, &b, per_rank, ctas)? },
                // SAFETY: as above.
                Coll::ReduceScatter => unsafe {
                    comm.reduce_scatter_raw(&stream, &a, pb, per_rank / 2, ReduceDtype::Bf16, ctas)?
                },
                Coll::AllReduce => comm.all_reduce(&stream, &a, &b, count, ReduceDtype::Bf16, ctas)?,
            }
            Ok(())
        };
        let mut theirs = || -> Result<()> {
            match coll {
                Coll::AllGather => nccl.all_gather(&stream, pa, ps, per_rank as usize),
                Coll::ReduceScatter => nccl.reduce_scatter(&stream, pa, ps, (per_rank / 2) as usize),
                Coll::AllReduce => nccl.all_reduce(&stream, pa, ps, count as usize),
            }
        };
        let t = median_ms_interleaved(&stream, args.warmup, args.iters, &mut [&mut ours, &mut theirs])?;
        comm.check()?;
        // #wrong: our result against NCCL's, byte for byte (exact small values).
        let out_bytes = match coll {
            Coll::AllGather => size,
            Coll::ReduceScatter => per_rank,
            Coll::AllReduce => size,
        } as usize;
        let mut ours_out = vec![0u8; out_bytes];
        let mut nccl_out = vec![0u8; out_bytes];
        // SAFETY: both buffers hold out_bytes.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_sync(&mut ours_out, pb)?;
            cudarc::driver::result::memcpy_dtoh_sync(&mut nccl_out, ps)?;
        }
        let wrong = ours_out
            .chunks(2)
            .zip(nccl_out.chunks(2))
            .filter(|(x, y)| x != y)
            .count();
        let (ours_us, nccl_us) = (t[0] * 1e3, t[1] * 1e3);
        let algbw = |us: f64| size as f64 / (us * 1e-6) / 1e9;
        if rank == 0 {
            println!(
                "{:>12} {:>12} {:>6} {:>5} | {:>10.1} {:>8.2} {:>8.2} | {:>10.1} {:>8.2} {:>8.2} | {:>6.2} {:>6}",
                size,
                count,
                "bf16",
                ctas,
                ours_us,
                algbw(ours_us),
                algbw(ours_us) * bus_factor,
                nccl_us,
                algbw(nccl_us),
                algbw(nccl_us) * bus_factor,
                nccl_us / ours_us,
                wrong
            );
        }
        rows.push(json!({ "op": format!("{coll:?}"), "size": size, "count": count, "type": "bf16", "ctas": ctas, "world": world, "rank": rank,
            "ours_us": ours_us, "ours_algbw": algbw(ours_us), "ours_busbw": algbw(ours_us) * bus_factor,
            "nccl_us": nccl_us, "nccl_algbw": algbw(nccl_us), "nccl_busbw": algbw(nccl_us) * bus_factor, "wrong": wrong }));
        size *= 2;
    }
    drop(comm);
    Ok(rows)
}
