//! `--op ag-gemm`: fused AllGather + GEMM (ours) beside NCCL AllGather + cuBLAS GEMM in
//! sequence, GEMM alone (cuBLAS) and AllGather alone (NCCL), all interleaved in one run.
//! M, K, N are global sizes: A is sharded by rows (M / world per rank), each rank multiplies
//! the gathered A by its own B of N / world rows (tensor parallelism).
use crate::gemm::cublas_gemm;
use crate::nccl::Nccl;
use crate::timing::median_ms_interleaved;
use crate::Args;
use anyhow::Result;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use mkernel::bootstrap::Bootstrap;
use mkernel::fused::{AgGemmPlan, GemmRsPlan};
use mkernel::gemm::{BLayout, GemmShape};
use mkernel::{CommConfig, Communicator, Device};
use mkernel_tests::data::random_bf16;
use mkernel::tune::{parse, render, TuneKey};
use serde_json::{json, Value};
use std::time::Duration;

/// Appends `key -> split` to the tune cache (rank 0 only; later lines win when read).
fn record_split(args: &Args, rank: usize, key: TuneKey, split: u32) -> Result<()> {
    let (Some(path), 0) = (&args.tune_out, rank) else { return Ok(()) };
    let mut entries = std::fs::read_to_string(path).map(|t| parse(&t)).unwrap_or_default();
    entries.retain(|(k, _)| *k != key);
    println!("# tune: {} world {} m {} n {} k {} -> split {split} (written to {})", key.op, key.world, key.m, key.n, key.k, path.display());
    entries.push((key, split));
    std::fs::write(path, render(&entries))?;
    Ok(())
}

pub fn run(args: &Args) -> Result<Vec<Value>> {
    let boot = Bootstrap::from_env(Duration::from_secs(60))?;
    let info = boot.info().clone();
    let dev = Device::new(info.device())?;
    let (rank, world) = (info.rank(), info.world_size());
    let nccl = Nccl::new(&boot, rank, world)?;
    let shapes: Vec<(usize, usize, usize)> = [2048usize, 4096, 8192, 16384].iter().map(|&m| (m, 8192, 8192)).chain([(8192, 8192, 28672)]).collect();
    // Every plan reserves its gathered A in the heap (4 plans per shape for the SM-split sweep).
    let heap: usize = shapes.iter().map(|s| 4 * s.0 * s.1 * 2).sum();
    let mut comm = Communicator::new(&dev, boot, CommConfig { heap_bytes: heap as u64 + (64 << 20), ..Default::default() })?;
    let stream = dev.default_stream();
    let blas = CudaBlas::new(stream.clone())?;
    if rank == 0 {
        println!("# AllGather+GEMM, {world} ranks, bf16; M K N global (A rows sharded, B: N/world x K per rank); interleaved medians of {} runs", args.iters);
        println!("{:>6} {:>6} {:>6} | {:>7} {:>9} | {:>10} {:>10} {:>10} | {:>8} {:>8} {:>7}", "M", "K", "N", "n_comm", "ours(us)", "nccl+cublas", "gemm alone", "ag alone", "speedup", "overlap", "#wrong");
    }
    let mut rows = vec![];
    for (m, k, n) in shapes {
        if args.filter.as_ref().is_some_and(|f| !format!("{m}x{k}x{n}").contains(f.as_str())) {
            continue;
        }
        let (ms, nl) = (m / world, n / world);
        let a_shard = stream.clone_htod(&random_bf16(ms * k, 1 + rank as u64))?;
        let b = stream.clone_htod(&random_bf16(nl * k, 100 + rank as u64))?;
        let mut c_ours = stream.alloc_zeros::<bf16>(m * nl)?;
        let mut c_ref = stream.alloc_zeros::<bf16>(m * nl)?;
        let mut c_alone = stream.alloc_zeros::<bf16>(m * nl)?;
        let mut a_full = stream.alloc_zeros::<bf16>(m * k)?;
        let (pa, pb, pc) = (a_shard.device_ptr(&stream).0, b.device_ptr(&stream).0, c_ours.device_ptr_mut(&stream).0);
        let pa_full = a_full.device_ptr_mut(&stream).0;
        // The SM split: a short sweep, the best one measured below.
        let mut best = (f64::INFINITY, 0u32, None);
        let mut sweep = vec![];
        for n_comm in [2u32, 4, 8, 16] {
            // SAFETY: buffers sized for the shape and alive for the whole case.
            let plan = unsafe { AgGemmPlan::new(&mut comm, &stream, pa, pb, pc, m, nl, k, n_comm)? };
            let mut f = || Ok(plan.launch(&stream)?);
            let t = median_ms_interleaved(&stream, 2, 5, &mut [&mut f])?[0];
            comm.check()?;
            sweep.push(json!({ "n_comm": n_comm, "ms": t }));
            if t < best.0 {
                best = (t, n_comm, Some(plan));
            }
        }
        let plan = best.2.take().expect("a plan");
        record_split(args, rank, TuneKey { op: "ag-gemm".into(), world: world as u32, m, n: nl, k }, best.1)?;
        let shape = GemmShape { m, n: nl, k, b_layout: BLayout::NxK };
        let mut ours = || Ok(plan.launch(&stream)?);
        let mut baseline = || -> Result<()> {
            nccl.all_gather(&stream, pa, pa_full, ms * k * 2)?;
            cublas_gemm(&blas, shape, &a_full, &b, &mut c_ref)
        };
        let mut gemm_alone = || cublas_gemm(&blas, shape, &a_full, &b, &mut c_alone);
        let mut ag_alone = || nccl.all_gather(&stream, pa, pa_full, ms * k * 2);
        let t = median_ms_interleaved(&stream, args.warmup, args.iters, &mut [&mut ours, &mut baseline, &mut gemm_alone, &mut ag_alone])?;
        comm.check()?;
        baseline()?;
        let (x, y) = (stream.clone_dtoh(&c_ours)?, stream.clone_dtoh(&c_ref)?);
        let wrong = x.iter().zip(&y).filter(|(p, q)| {
            let (p, q) = (p.to_f32(), q.to_f32());
            !((p - q).abs() <= p.abs().max(q.abs()) / 64.0 + (k as f32).sqrt() * 1e-3)
        }).count();
        let (speedup, overlap) = (t[1] / t[0], t[2].max(t[3]) / t[0]);
        let tflops = 2.0 * m as f64 * nl as f64 * k as f64 / (t[0] * 1e-3) / 1e12;
        if rank == 0 {
            println!("{m:>6} {k:>6} {n:>6} | {:>7} {:>9.1} | {:>10.1} {:>10.1} {:>10.1} | {speedup:>8.3} {overlap:>8.3} {wrong:>7}", best.1, t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3);
        }
        rows.push(json!({ "m": m, "k": k, "n": n, "world": world, "rank": rank, "n_comm": best.1, "sweep": sweep,
            "ours_ms": t[0], "nccl_cublas_ms": t[1], "gemm_alone_ms": t[2], "ag_alone_ms": t[3],
            "speedup": speedup, "overlap_efficiency": overlap, "ours_tflops_per_gpu": tflops, "wrong": wrong }));
    }
    Ok(rows)
}

/// `--op gemm-rs`: fused GEMM + ReduceScatter beside cuBLAS GEMM + NCCL ReduceScatter in
/// sequence, GEMM alone and ReduceScatter alone. K is split over ranks (K / world per rank);
/// every rank gets M / world rows of the M x N sum.
pub fn run_rs(args: &Args) -> Result<Vec<Value>> {
    run_reduce(args, false)
}

/// `--op gemm-ar`: fused GEMM + AllReduce beside cuBLAS GEMM + NCCL AllReduce in sequence.
pub fn run_ar(args: &Args) -> Result<Vec<Value>> {
    run_reduce(args, true)
}

fn run_reduce(args: &Args, all_reduce: bool) -> Result<Vec<Value>> {
    let boot = Bootstrap::from_env(Duration::from_secs(60))?;
    let info = boot.info().clone();
    let dev = Device::new(info.device())?;
    let (rank, world) = (info.rank(), info.world_size());
    let nccl = Nccl::new(&boot, rank, world)?;
    let shapes: Vec<(usize, usize, usize)> = [2048usize, 4096, 8192, 16384].iter().map(|&m| (m, 8192, 8192)).collect();
    let heap: usize = shapes.iter().map(|s| 4 * s.0 * s.2 * 2 * if all_reduce { 2 } else { 1 }).sum();
    let mut comm = Communicator::new(&dev, boot, CommConfig { heap_bytes: heap as u64 + (64 << 20), ..Default::default() })?;
    let stream = dev.default_stream();
    let blas = CudaBlas::new(stream.clone())?;
    if rank == 0 {
        let what = if all_reduce { "GEMM+AllReduce (every rank gets C)" } else { "GEMM+ReduceScatter (rows of C scattered)" };
        println!("# {what}, {world} ranks, bf16 (f32 sums); M K N global (K split over ranks); interleaved medians of {} runs", args.iters);
        println!("{:>6} {:>6} {:>6} | {:>8} {:>9} | {:>11} {:>10} {:>10} | {:>8} {:>8} {:>7}", "M", "K", "N", "n_reduce", "ours(us)", "cublas+nccl", "gemm alone", "coll alone", "speedup", "overlap", "#wrong");
    }
    let mut rows = vec![];
    for (m, k, n) in shapes {
        if args.filter.as_ref().is_some_and(|f| !format!("{m}x{k}x{n}").contains(f.as_str())) {
            continue;
        }
        let (kl, ms) = (k / world, m / world);
        let a = stream.clone_htod(&random_bf16(m * kl, 1 + rank as u64))?;
        let b = stream.clone_htod(&random_bf16(n * kl, 100 + rank as u64))?;
        let mut out = stream.alloc_zeros::<bf16>(ms * n)?;
        let mut partial = stream.alloc_zeros::<bf16>(m * n)?;
        let mut partial_alone = stream.alloc_zeros::<bf16>(m * n)?;
        let mut out_ref = stream.alloc_zeros::<bf16>(ms * n)?;
        let (pa, pb, po) = (a.device_ptr(&stream).0, b.device_ptr(&stream).0, out.device_ptr_mut(&stream).0);
        let (pp, pr) = (partial.device_ptr_mut(&stream).0, out_ref.device_ptr_mut(&stream).0);
        let mut best = (f64::INFINITY, 0u32, None);
        let mut sweep = vec![];
        for n_reduce in [8u32, 16, 32, 48] {
            // SAFETY: buffers sized for the shape and alive for the whole case.
            let plan = unsafe {
                if all_reduce { GemmRsPlan::new_all_reduce(&mut comm, &stream, pa, pb, m, n, kl, n_reduce)? } else { GemmRsPlan::new(&mut comm, &stream, pa, pb, po, m, n, kl, n_reduce)? }
            };
            let mut f = || Ok(plan.launch(&stream)?);
            let t = median_ms_interleaved(&stream, 2, 5, &mut [&mut f])?[0];
            comm.check()?;
            sweep.push(json!({ "n_reduce": n_reduce, "ms": t }));
            if t < best.0 {
                best = (t, n_reduce, Some(plan));
            }
        }
        let plan = best.2.take().expect("a plan");
        let op = if all_reduce { "gemm-ar" } else { "gemm-rs" };
        record_split(args, rank, TuneKey { op: op.into(), world: world as u32, m, n, k }, best.1)?;
        let shape = GemmShape { m, n, k: kl, b_layout: BLayout::NxK };
        let mut ours = || Ok(plan.launch(&stream)?);
        let mut ar_ref = stream.alloc_zeros::<bf16>(if all_reduce { m * n } else { 1 })?;
        let par = ar_ref.device_ptr_mut(&stream).0;
        let mut baseline = || -> Result<()> {
            cublas_gemm(&blas, shape, &a, &b, &mut partial)?;
            if all_reduce { nccl.all_reduce(&stream, pp, par, m * n) } else { nccl.reduce_scatter(&stream, pp, pr, ms * n) }
        };
        let mut gemm_alone = || cublas_gemm(&blas, shape, &a, &b, &mut partial_alone);
        let mut rs_alone = || if all_reduce { nccl.all_reduce(&stream, pp, par, m * n) } else { nccl.reduce_scatter(&stream, pp, pr, ms * n) };
        let t = median_ms_interleaved(&stream, args.warmup, args.iters, &mut [&mut ours, &mut baseline, &mut gemm_alone, &mut rs_alone])?;
        comm.check()?;
        baseline()?;
        let (x, y) = if all_reduce {
            let mut raw = vec![0u8; m * n * 2];
            let ours_out = plan.all_reduce_output().expect("an AllReduce plan");
            // SAFETY: the plan's output holds m x n bf16 in this rank's heap.
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut raw, comm.ptr(&ours_out))? };
            (raw.chunks(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect::<Vec<_>>(), stream.clone_dtoh(&ar_ref)?)
        } else {
            (stream.clone_dtoh(&out)?, stream.clone_dtoh(&out_ref)?)
        };
        let wrong = x.iter().zip(&y).filter(|(p, q)| {
            let (p, q) = (p.to_f32(), q.to_f32());
            !((p - q).abs() <= p.abs().max(q.abs()) / 32.0 + (k as f32).sqrt() * 2e-3)
        }).count();
        let (speedup, overlap) = (t[1] / t[0], t[2].max(t[3]) / t[0]);
        if rank == 0 {
            println!("{m:>6} {k:>6} {n:>6} | {:>8} {:>9.1} | {:>11.1} {:>10.1} {:>10.1} | {speedup:>8.3} {overlap:>8.3} {wrong:>7}", best.1, t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3);
        }
        rows.push(json!({ "m": m, "k": k, "n": n, "world": world, "rank": rank, "n_reduce": best.1, "sweep": sweep,
            "op": if all_reduce { "gemm-ar" } else { "gemm-rs" },
            "ours_ms": t[0], "cublas_nccl_ms": t[1], "gemm_alone_ms": t[2], "coll_alone_ms": t[3],
            "speedup": speedup, "overlap_efficiency": overlap, "wrong": wrong }));
    }
    Ok(rows)
}
