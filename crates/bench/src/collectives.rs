//! AllGather / ReduceScatter / AllReduce: ours beside NCCL, nccl-tests style rows, one process
//! per GPU (run under `xtask launch`; `xtask bench --op allgather` does that itself).
//! Sizes follow nccl-tests: AllGather = output bytes, ReduceScatter = input bytes,
//! AllReduce = buffer bytes; busbw = algbw x (n-1)/n (x 2(n-1)/n for AllReduce). bf16 data.
//! AllReduce also prints the path the policy took, the host time of one `all_reduce` call
//! (median, microseconds: checks, kernel lookup, launch lock, launch; no GPU wait), and with
//! `--ar-paths` every forced path's time at every size (`-`: the path cannot carry the size).
use crate::nccl::Nccl;
use crate::timing::median_ms_interleaved;
use crate::Args;
use anyhow::Result;
use mkernel::bootstrap::Bootstrap;
use mkernel::{AllReducePath, CommConfig, Communicator, Device, ReduceDtype, SymBuffer};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

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

/// The forced AllReduce paths of `--ar-paths`.
fn forced_paths(names: &[String]) -> Result<Vec<AllReducePath>> {
    if names.iter().any(|n| n == "all") {
        return Ok(AllReducePath::SINGLE_NODE.to_vec());
    }
    names
        .iter()
        .map(|n| {
            AllReducePath::from_name(n)
                .filter(|p| AllReducePath::SINGLE_NODE.contains(p))
                .ok_or_else(|| anyhow::anyhow!("--ar-paths: `{n}` is none of ll, oneshot, twoshot, bandwidth, all"))
        })
        .collect()
}

/// Median host microseconds of one `all_reduce` call (enqueue only), over `iters` calls
/// followed by one synchronization.
fn host_us_per_launch(
    comm: &Communicator,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    (a, b): (&SymBuffer, &SymBuffer),
    count: u64,
    ctas: u32,
    iters: usize,
) -> Result<f64> {
    let mut us = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        comm.all_reduce(stream, a, b, count, ReduceDtype::Bf16, ctas)?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    stream.synchronize()?;
    Ok(crate::timing::median(&mut us))
}

pub fn run(args: &Args, coll: Coll) -> Result<Vec<Value>> {
    let forced = forced_paths(&args.ar_paths)?;
    let boot = Bootstrap::from_env(Duration::from_secs(60))?;
    let info = boot.info().clone();
    let dev = Device::new(info.device())?;
    let (rank, world) = (info.rank(), info.world_size());
    let max_bytes: u64 = args.max_bytes;
    // NCCL refuses ranks that share a GPU (MPS); there, or with `--no-nccl`, ours runs alone
    // and AllReduce's #wrong compares with the exact sum computed here.
    let nccl = if crate::report::shared_gpu().is_none() && !args.no_nccl {
        Some(Nccl::new(&boot, rank, world)?)
    } else {
        None
    };
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
        if nccl.is_none() {
            println!("# NCCL left out (ranks share a GPU, or --no-nccl): its columns print `-`");
        }
        if coll == Coll::AllReduce {
            println!(
                "# AllReduce: path = the policy's choice (provisional thresholds), host(us) = one all_reduce call on \
                 the host; forced paths: {}",
                forced.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
            );
        }
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
    // AllReduce takes any count (8 B = 4 bf16); the others need 16 bytes per rank.
    let mut size = if coll == Coll::AllReduce {
        args.min_bytes.max(8)
    } else {
        args.min_bytes.max(16 * n * n)
    };
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
            let Some(nccl) = &nccl else { return Ok(()) };
            match coll {
                Coll::AllGather => nccl.all_gather(&stream, pa, ps, per_rank as usize),
                Coll::ReduceScatter => nccl.reduce_scatter(&stream, pa, ps, (per_rank / 2) as usize),
                Coll::AllReduce => nccl.all_reduce(&stream, pa, ps, count as usize),
            }
        };
        // Forced AllReduce paths that can carry this size, timed in the same interleaved rounds.
        let carried: Vec<AllReducePath> = if coll == Coll::AllReduce {
            let m = mkernel::comm::AllReduceMsg {
                bytes: size,
                overlap: mkernel::comm::Overlap::Disjoint,
                nodes: comm.nnodes(),
            };
            forced.iter().copied().filter(|&p| m.unavailable(p).is_none()).collect()
        } else {
            vec![]
        };
        let mut forced_fns: Vec<Box<dyn FnMut() -> Result<()> + '_>> = carried
            .iter()
            .map(|&p| {
                let (comm, stream, a, b) = (&comm, &stream, &a, &b);
                Box::new(move || -> Result<()> {
                    comm.all_reduce_via(p, stream, a, b, count, ReduceDtype::Bf16, ctas)?;
                    Ok(())
                }) as Box<dyn FnMut() -> Result<()>>
            })
            .collect();
        let mut fs: Vec<&mut dyn FnMut() -> Result<()>> = vec![&mut ours];
        if nccl.is_some() {
            fs.push(&mut theirs);
        }
        let first_forced = fs.len();
        fs.extend(
            forced_fns
                .iter_mut()
                .map(|f| f.as_mut() as &mut dyn FnMut() -> Result<()>),
        );
        let t = median_ms_interleaved(&stream, args.warmup, args.iters, &mut fs)?;
        drop(fs);
        drop(forced_fns);
        comm.check()?;
        let ar = if coll == Coll::AllReduce {
            let path = comm.all_reduce_path(&a, &b, count, ReduceDtype::Bf16)?;
            let host_us = host_us_per_launch(&comm, &stream, (&a, &b), count, ctas, args.iters)?;
            comm.check()?;
            let per_path: Vec<(AllReducePath, Option<f64>)> = forced
                .iter()
                .map(|&p| {
                    (
                        p,
                        carried.iter().position(|&q| q == p).map(|i| t[first_forced + i] * 1e3),
                    )
                })
                .collect();
            Some((path, host_us, per_path))
        } else {
            None
        };
        // #wrong: our result against NCCL's, byte for byte (exact small values); without NCCL,
        // AllReduce's against the exact sum (every rank holds `init`: world x each value, exact
        // in bf16), the others unchecked (`-`).
        let out_bytes = match coll {
            Coll::AllGather => size,
            Coll::ReduceScatter => per_rank,
            Coll::AllReduce => size,
        } as usize;
        let mut ours_out = vec![0u8; out_bytes];
        // SAFETY: `pb` holds max_bytes >= out_bytes.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut ours_out, pb)? };
        let want: Option<Vec<u8>> = if nccl.is_some() {
            let mut nccl_out = vec![0u8; out_bytes];
            // SAFETY: `ps` holds max_bytes >= out_bytes.
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut nccl_out, ps)? };
            Some(nccl_out)
        } else if coll == Coll::AllReduce {
            Some(
                init[..out_bytes]
                    .chunks(2)
                    .flat_map(|c| {
                        let v = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                        half::bf16::from_f32(v * world as f32).to_bits().to_le_bytes()
                    })
                    .collect(),
            )
        } else {
            None
        };
        let wrong = want.map(|w| ours_out.chunks(2).zip(w.chunks(2)).filter(|(x, y)| x != y).count());
        let ours_us = t[0] * 1e3;
        let nccl_us = nccl.is_some().then(|| t[1] * 1e3);
        let algbw = |us: f64| size as f64 / (us * 1e-6) / 1e9;
        let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
        if rank == 0 {
            println!(
                "{:>12} {:>12} {:>6} {:>5} | {:>10.1} {:>8.2} {:>8.2} | {:>10} {:>8} {:>8} | {:>6} {:>6}",
                size,
                count,
                "bf16",
                ctas,
                ours_us,
                algbw(ours_us),
                algbw(ours_us) * bus_factor,
                opt(nccl_us, 1),
                opt(nccl_us.map(algbw), 2),
                opt(nccl_us.map(|us| algbw(us) * bus_factor), 2),
                opt(nccl_us.map(|us| us / ours_us), 2),
                wrong.map_or("-".to_string(), |w| w.to_string())
            );
            if let Some((path, host_us, per_path)) = &ar {
                let forced: Vec<String> = per_path
                    .iter()
                    .map(|(p, us)| match us {
                        Some(us) => format!("{} {us:.1}", p.name()),
                        None => format!("{} -", p.name()),
                    })
                    .collect();
                println!(
                    "{:>12}   path {:<9} host {:>5.1} us/launch | forced (us): {}",
                    "",
                    path.name(),
                    host_us,
                    forced.join("  ")
                );
            }
        }
        let mut row = json!({ "op": format!("{coll:?}"), "size": size, "count": count, "type": "bf16", "ctas": ctas, "world": world, "rank": rank,
            "ours_us": ours_us, "ours_algbw": algbw(ours_us), "ours_busbw": algbw(ours_us) * bus_factor,
            "nccl_us": nccl_us, "nccl_algbw": nccl_us.map(algbw), "nccl_busbw": nccl_us.map(|us| algbw(us) * bus_factor), "wrong": wrong });
        if let Some((path, host_us, per_path)) = &ar {
            row["path"] = json!(path.name());
            row["host_us_per_launch"] = json!(host_us);
            for (p, us) in per_path {
                row[format!("{}_us", p.name())] = json!(us);
            }
        }
        rows.push(row);
        size *= 2;
    }
    drop(comm);
    Ok(rows)
}
