//! `--op ag-gemm`: fused AllGather + GEMM (ours) beside NCCL AllGather + cuBLAS GEMM in
//! sequence, GEMM alone (cuBLAS) and AllGather alone (NCCL), all interleaved in one run.
//! M, K, N are global sizes: A is sharded by rows (M / world per rank), each rank multiplies
//! the gathered A by its own B of N / world rows (tensor parallelism).
use crate::gemm::cublas_gemm;
use crate::nccl::Nccl;
use crate::timing::median_ms_aligned;
use crate::Args;
use anyhow::Result;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use mkernel::bootstrap::{Bootstrap, RankInfo};
use mkernel::gemm::{BLayout, GemmConfig, GemmPlan, GemmShape, GemmTensors, OutDtype};
use mkernel::ops::{AgGemmPlan, GemmRsPlan, RsSplit};
use mkernel::tune::{parse, render, TuneKey};
use mkernel::{CommConfig, Communicator, Device};
use mkernel_tests::data::{random_bf16, ternary_bf16};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// Appends `key -> split` to the tune cache (rank 0 only; later lines win when read).
pub(crate) fn record_split(args: &Args, rank: usize, key: TuneKey, split: u32) -> Result<()> {
    let (Some(path), 0) = (&args.tune_out, rank) else {
        return Ok(());
    };
    let mut entries = std::fs::read_to_string(path).map(|t| parse(&t)).unwrap_or_default();
    entries.retain(|(k, _)| *k != key);
    println!(
        "# tune: {} world {} m {} n {} k {} -> split {split} (written to {})",
        key.op,
        key.world,
        key.m,
        key.n,
        key.k,
        path.display()
    );
    entries.push((key, split));
    std::fs::write(path, render(&entries))?;
    Ok(())
}

/// In the swept peer-partial paths (`--paths`): no comm CTAs, partials pulled by the peers
/// (`RsSplit::pull`).
const PULL: u32 = 0xff;

/// `--paths` as comm CTA counts (`PULL` for `pull`).
fn reduce_paths(args: &Args) -> Result<Vec<u32>> {
    args.paths
        .iter()
        .map(|p| match p.as_str() {
            "pull" => Ok(PULL),
            n => n
                .parse::<u32>()
                .ok()
                .filter(|&c| c < PULL)
                .ok_or_else(|| anyhow::anyhow!("--paths: `{n}` is neither a comm CTA count nor `pull`")),
        })
        .collect()
}

/// `shapes` (M, K, N) less those that `--filter` (a substring of `MxKxN`) or `--ms` leave out.
fn selected(args: &Args, shapes: impl IntoIterator<Item = (usize, usize, usize)>) -> Vec<(usize, usize, usize)> {
    shapes
        .into_iter()
        .map(|(m, k, n)| (m, args.k.unwrap_or(k), n))
        .filter(|(m, k, n)| {
            args.filter
                .as_ref()
                .is_none_or(|f| format!("{m}x{k}x{n}").contains(f.as_str()))
        })
        .filter(|(m, _, _)| args.ms.is_empty() || args.ms.contains(m))
        .collect()
}

/// Symmetric heap for `per_plan` bytes per plan, `splits` plans per shape: `Communicator::alloc`
/// is a bump allocator (a dropped plan keeps its heap), so the heap holds every plan of the
/// sweeps. With every shape: ~4.7 GB per rank for ag-gemm, ~4.2 GB gemm-rs, ~8.3 GB gemm-ar.
fn heap_config(
    shapes: &[(usize, usize, usize)],
    splits: usize,
    per_plan: impl Fn(usize, usize, usize) -> usize,
) -> CommConfig {
    let heap: usize = shapes.iter().map(|&(m, k, n)| splits * per_plan(m, k, n)).sum();
    CommConfig {
        heap_bytes: heap as u64 + (64 << 20),
        ..Default::default()
    }
}

/// The sweep's choice, the same on every rank (ranks must launch the same plan: each plan has
/// heap buffers of its own, which its peers write): the split whose slowest rank was fastest.
/// `sweep`: (split, this rank's ms, plan) per split, in the same order on every rank.
pub(crate) fn agreed_best<P>(comm: &Communicator, sweep: Vec<(u32, f64, P)>) -> Result<(u32, P)> {
    let mine: Vec<u8> = sweep.iter().flat_map(|s| s.1.to_le_bytes()).collect();
    let all = comm
        .bootstrap()
        .store()
        .all_gather("fused-split-sweep", &mine, Duration::from_secs(60))?;
    let slowest = |i: usize| {
        all.iter()
            .map(|r| f64::from_le_bytes(r[8 * i..8 * i + 8].try_into().expect("8 bytes")))
            .fold(0.0, f64::max)
    };
    let best = (0..sweep.len())
        .min_by(|&i, &j| slowest(i).total_cmp(&slowest(j)))
        .expect("a split");
    let (split, _, plan) = sweep.into_iter().nth(best).expect("a split");
    Ok((split, plan))
}

/// Elements that differ at all (bf16 bits, -0 taken as +0).
fn exact_mismatches(ours: &[bf16], theirs: &[bf16]) -> usize {
    assert_eq!(ours.len(), theirs.len());
    let canon = |x: &bf16| if x.to_bits() == 0x8000 { 0 } else { x.to_bits() };
    ours.iter().zip(theirs).filter(|(p, q)| canon(p) != canon(q)).count()
}

/// After timing: overwrites this rank's A and B with ternary data (seeds as for the timed data).
/// Exact check: products are 0/±1, so every sum in any order is an integer, exact in f32 and, being far below 256 (~K/16 random signs), in bf16 (partials, NCCL's ring steps): ours must match bit for bit.
fn write_ternary(
    stream: &Arc<CudaStream>,
    a: &mut CudaSlice<bf16>,
    b: &mut CudaSlice<bf16>,
    rank: usize,
) -> Result<()> {
    stream.memcpy_htod(&ternary_bf16(a.len(), 1 + rank as u64), a)?;
    stream.memcpy_htod(&ternary_bf16(b.len(), 100 + rank as u64), b)?;
    Ok(())
}

/// What both fused benches start with on this rank: the job, its device, and the NCCL
/// baseline's communicator over the same ranks.
struct Start {
    boot: Bootstrap,
    info: RankInfo,
    dev: Device,
    rank: usize,
    world: usize,
    nccl: Nccl,
}

impl Start {
    fn new() -> Result<Start> {
        let boot = Bootstrap::from_env(Duration::from_secs(60))?;
        let info = boot.info().clone();
        let dev = Device::new(info.device())?;
        let (rank, world) = (info.rank(), info.world_size());
        let nccl = Nccl::new(&boot, rank, world)?;
        Ok(Start {
            boot,
            info,
            dev,
            rank,
            world,
            nccl,
        })
    }
}

/// The device's default stream, a word on it (and its address) that NCCL all-reduces to line
/// the ranks up before each timed run, and cuBLAS on the stream.
fn bench_stream(dev: &Device) -> Result<(Arc<CudaStream>, CudaSlice<bf16>, u64, CudaBlas)> {
    let stream = dev.default_stream();
    let mut sync_word = stream.alloc_zeros::<bf16>(8)?;
    let psync = sync_word.device_ptr_mut(&stream).0;
    let blas = CudaBlas::new(stream.clone())?;
    Ok((stream, sync_word, psync, blas))
}

pub fn run(args: &Args) -> Result<Vec<Value>> {
    let Start {
        boot,
        dev,
        rank,
        world,
        nccl,
        ..
    } = Start::new()?;
    let shapes = selected(
        args,
        [2048usize, 4096, 8192, 16384, 32768]
            .map(|m| (m, 8192, 8192))
            .into_iter()
            .chain([(8192, 8192, 28672)]),
    );
    // Every plan reserves its gathered A (M x K bf16) in the heap.
    let comm = Communicator::new(
        &dev,
        boot,
        heap_config(&shapes, args.ag_splits.len(), |m, k, _| m * k * 2),
    )?;
    let (stream, _sync_word, psync, blas) = bench_stream(&dev)?;
    // Lines the ranks up before each timed run (see median_ms_aligned).
    let mut align = || nccl.all_reduce(&stream, psync, psync, 1);
    if rank == 0 {
        println!("# AllGather+GEMM, {world} ranks, bf16; M K N global (A rows sharded, B: N/world x K per rank); interleaved ({} order) medians of {} runs", args.order, args.iters);
        println!(
            "{:>6} {:>6} {:>6} | {:>7} {:>9} | {:>10} {:>10} {:>10} | {:>8} {:>8} {:>7}",
            "M",
            "K",
            "N",
            "n_comm",
            "ours(us)",
            "nccl+cublas",
            "gemm alone",
            "ag alone",
            "speedup",
            "overlap",
            "#wrong"
        );
    }
    let mut rows = vec![];
    for (m, k, n) in shapes {
        let (ms, nl) = (m / world, n / world);
        let mut a_shard = stream.clone_htod(&random_bf16(ms * k, 1 + rank as u64))?;
        let mut b = stream.clone_htod(&random_bf16(nl * k, 100 + rank as u64))?;
        let mut c_ours = stream.alloc_zeros::<bf16>(m * nl)?;
        let mut c_ref = stream.alloc_zeros::<bf16>(m * nl)?;
        let mut c_alone = stream.alloc_zeros::<bf16>(m * nl)?;
        let mut a_full = stream.alloc_zeros::<bf16>(m * k)?;
        let (pa, pb, pc) = (
            a_shard.device_ptr(&stream).0,
            b.device_ptr(&stream).0,
            c_ours.device_ptr_mut(&stream).0,
        );
        let pa_full = a_full.device_ptr_mut(&stream).0;
        // The baselines' library calls once before any fused launch (see `ruparts`).
        nccl.all_gather(&stream, pa, pa_full, ms * k * 2)?;
        cublas_gemm(
            &blas,
            GemmShape {
                m,
                n: nl,
                k,
                b_layout: BLayout::NxK,
            },
            &a_full,
            &b,
            &mut c_ref,
        )?;
        stream.synchronize()?;
        // The SM split: a short sweep, the best one measured below.
        let (mut plans, mut sweep) = (vec![], vec![]);
        for n_comm in args.ag_splits.iter().copied() {
            // The raw layer: the sweep's plans share the buffers, which are rewritten for the
            // exact check while the chosen plan lives.
            // SAFETY: buffers sized for the shape, on this device, alive for the whole case;
            // rewritten and read only between launches (stream-ordered).
            let plan = unsafe { AgGemmPlan::new_raw(&comm, &stream, pa, pb, pc, m, nl, k, n_comm)? };
            let mut f = || Ok(plan.launch(&stream)?);
            let t = median_ms_aligned(&stream, 2, 5, &mut align, &mut [&mut f])?[0];
            comm.check()?;
            sweep.push(json!({ "n_comm": n_comm, "ms": t }));
            plans.push((n_comm, t, plan));
        }
        let (n_comm, plan) = agreed_best(&comm, plans)?;
        record_split(
            args,
            rank,
            TuneKey {
                op: "ag-gemm".into(),
                world: world as u32,
                m,
                n: nl,
                k,
            },
            n_comm,
        )?;
        let shape = GemmShape {
            m,
            n: nl,
            k,
            b_layout: BLayout::NxK,
        };
        let mut ours = || Ok(plan.launch(&stream)?);
        let ag = || nccl.all_gather(&stream, pa, pa_full, ms * k * 2);
        let mut baseline = |b: &CudaSlice<bf16>| -> Result<()> {
            ag()?;
            cublas_gemm(&blas, shape, &a_full, b, &mut c_ref)
        };
        let mut baseline_timed = || baseline(&b);
        let mut gemm_alone = || cublas_gemm(&blas, shape, &a_full, &b, &mut c_alone);
        let mut ag_alone = || ag();
        let t = median_ms_aligned(
            &stream,
            args.warmup,
            args.iters,
            &mut align,
            &mut [&mut ours, &mut baseline_timed, &mut gemm_alone, &mut ag_alone],
        )?;
        comm.check()?;
        write_ternary(&stream, &mut a_shard, &mut b, rank)?;
        ours()?;
        baseline(&b)?;
        stream.synchronize()?;
        comm.check()?;
        let wrong = exact_mismatches(&stream.clone_dtoh(&c_ours)?, &stream.clone_dtoh(&c_ref)?);
        let (speedup, overlap) = (t[1] / t[0], t[2].max(t[3]) / t[0]);
        let tflops = 2.0 * m as f64 * nl as f64 * k as f64 / (t[0] * 1e-3) / 1e12;
        if rank == 0 {
            println!("{m:>6} {k:>6} {n:>6} | {n_comm:>7} {:>9.1} | {:>10.1} {:>10.1} {:>10.1} | {speedup:>8.3} {overlap:>8.3} {wrong:>7}", t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3);
        }
        rows.push(
            json!({ "m": m, "k": k, "n": n, "world": world, "rank": rank, "n_comm": n_comm, "sweep": sweep,
            "ours_ms": t[0], "nccl_cublas_ms": t[1], "gemm_alone_ms": t[2], "ag_alone_ms": t[3],
            "speedup": speedup, "overlap_efficiency": overlap, "ours_tflops_per_gpu": tflops, "wrong": wrong }),
        );
    }
    Ok(rows)
}

/// `--op gemm-rs`: fused GEMM + ReduceScatter beside cuBLAS GEMM + NCCL ReduceScatter in
/// sequence, GEMM alone and ReduceScatter alone. K is split over ranks (K / world per rank);
/// every rank gets M / world rows of the M x N sum.
pub fn run_rs(args: &Args) -> Result<Vec<Value>> {
    ruparts(args, false)
}

/// `--op gemm-ar`: fused GEMM + AllReduce beside cuBLAS GEMM + NCCL AllReduce in sequence.
pub fn run_ar(args: &Args) -> Result<Vec<Value>> {
    ruparts(args, true)
}

fn ruparts(args: &Args, all_reduce: bool) -> Result<Vec<Value>> {
    let Start {
        boot,
        info,
        dev,
        rank,
        world,
        nccl,
    } = Start::new()?;
    let shapes = selected(args, [2048usize, 4096, 8192, 16384, 32768].map(|m| (m, 8192, 8192)));
    // Every plan reserves its receive slots (M x N bf16 in all), an AllReduce plan also its
    // M x N output; across nodes the node-sum stage and remote receive blocks (< 2 M x N).
    let across = 2 * (info.nnodes() > 1) as usize;
    let paths = if world > 1 { reduce_paths(args)? } else { vec![0] };
    let no_stagers: Vec<bool> = args
        .stagers
        .iter()
        .map(|s| match s.as_str() {
            "on" => Ok(false),
            "off" => Ok(true),
            other => Err(anyhow::anyhow!("--stagers: `{other}` is neither `on` nor `off`")),
        })
        .collect::<Result<_>>()?;
    let (no_stream_k, sk_ab) = match args.stream_k.as_str() {
        "on" => (false, false),
        "off" => (true, false),
        "ab" => (false, true),
        other => anyhow::bail!("--stream-k: `{other}` is none of `on`, `off`, `ab`"),
    };
    // Where a stager can run (GemmRsPlan::stager): one node of 2 ranks, pushed directly.
    let stager_path = |cc: u32| world == 2 && info.nnodes() == 1 && cc == 0;
    let variants: usize = paths
        .iter()
        .map(|&cc| if stager_path(cc) { no_stagers.len() } else { 1 })
        .sum();
    let comm = Communicator::new(
        &dev,
        boot,
        heap_config(
            &shapes,
            args.parts.len() * variants * args.groups.len() + sk_ab as usize,
            |m, _, n| m * n * 2 * (2 + all_reduce as usize + across),
        ),
    )?;
    let (stream, _sync_word, psync, blas) = bench_stream(&dev)?;
    // Lines the ranks up before each timed run (see median_ms_aligned).
    let mut align = || nccl.all_reduce(&stream, psync, psync, 1);
    if rank == 0 {
        let what = if all_reduce {
            "GEMM+AllReduce (every rank gets C)"
        } else {
            "GEMM+ReduceScatter (rows of C scattered)"
        };
        println!("# {what}, {world} ranks, bf16 (f32 sums); M K N global (K split over ranks); interleaved ({} order) medians of {} runs", args.order, args.iters);
        println!(
            "{:>6} {:>6} {:>6} | {:>8} {:>9} | {:>11} {:>10} {:>10} | {:>8} {:>8} {:>7} | {:>9}",
            "M",
            "K",
            "N",
            "parts/cc",
            "ours(us)",
            "cublas+nccl",
            "gemm alone",
            "coll alone",
            "speedup",
            "overlap",
            "#wrong",
            "our gemm"
        );
    }
    let mut rows = vec![];
    for (m, k, n) in shapes {
        let (kl, ms) = (k / world, m / world);
        let mut a = stream.clone_htod(&random_bf16(m * kl, 1 + rank as u64))?;
        let mut b = stream.clone_htod(&random_bf16(n * kl, 100 + rank as u64))?;
        let mut out = stream.alloc_zeros::<bf16>(ms * n)?;
        let mut partial = stream.alloc_zeros::<bf16>(m * n)?;
        let mut partial_alone = stream.alloc_zeros::<bf16>(m * n)?;
        let mut out_ref = stream.alloc_zeros::<bf16>(ms * n)?;
        let (pa, pb, po) = (
            a.device_ptr(&stream).0,
            b.device_ptr(&stream).0,
            out.device_ptr_mut(&stream).0,
        );
        let (pp, pr) = (partial.device_ptr_mut(&stream).0, out_ref.device_ptr_mut(&stream).0);
        // Every library call of this shape (cuBLAS, NCCL) once before any fused launch: a
        // first call that loads a module synchronizes the context while a fused kernel runs,
        // and across emulated nodes that kernel waits for the proxy's CUDA calls in the same
        // context (docs/internode.md).
        {
            let shape = GemmShape {
                m,
                n,
                k: kl,
                b_layout: BLayout::NxK,
            };
            cublas_gemm(&blas, shape, &a, &b, &mut partial)?;
            if all_reduce {
                nccl.all_reduce(&stream, pp, pp, m * n)?;
            } else {
                nccl.reduce_scatter(&stream, pp, pr, ms * n)?;
            }
            stream.synchronize()?;
        }
        let (mut plans, mut sweep) = (vec![], vec![]);
        for parts in args
            .parts
            .iter()
            .copied()
            .filter(|&p| p > 0 && (m / world / 128) % p as usize == 0)
        {
            for &cc in &paths {
                for group_m in args.groups.iter().copied() {
                    for &no_stager in &no_stagers {
                        let split = rs_split(parts, cc, group_m, no_stager, no_stream_k);
                        // `on` where no stager can run is the same plan as `off`.
                        if !stager_path(cc) && !no_stager && no_stagers.contains(&true) {
                            continue;
                        }
                        // The raw layer, as for AllGather+GEMM's sweep.
                        // SAFETY: buffers sized for the shape, on this device, alive for the
                        // whole case; rewritten and read only between launches.
                        let plan = unsafe {
                            GemmRsPlan::new_raw(&comm, &stream, pa, pb, (!all_reduce).then_some(po), m, n, kl, split)?
                        };
                        let mut f = || Ok(plan.launch(&stream)?);
                        let t = median_ms_aligned(&stream, 2, 5, &mut align, &mut [&mut f])?[0];
                        comm.check()?;
                        sweep.push(json!({ "parts": parts, "comm_ctas": cc % PULL, "pull": cc == PULL, "group_m": group_m, "stager": plan.stager(), "stream_k_tiles": plan.stream_k_tiles(), "ms": t }));
                        plans.push(((no_stager as u32) << 24 | parts << 16 | cc << 8 | group_m, t, plan));
                    }
                }
            }
        }
        if plans.is_empty() {
            anyhow::bail!(
                "M = {m}: none of --parts {:?} divides a chunk's {} row tiles",
                args.parts,
                m / world / 128
            );
        }
        let (code, plan) = agreed_best(&comm, plans)?;
        let (parts, cc, group_m) = ((code >> 16) & 0xff, (code >> 8) & 0xff, code & 0xff);
        let stager = plan.stager();
        let (comm_ctas, pull) = (cc % PULL, cc == PULL);
        let path = if pull {
            "pull".to_string()
        } else if stager {
            format!("{comm_ctas}s")
        } else {
            comm_ctas.to_string()
        };
        let sk_tiles = plan.stream_k_tiles();
        // `--stream-k ab`: the chosen plan's twin without the stream-K tail, timed beside it.
        let twin = if sk_ab && sk_tiles > 0 {
            let split = rs_split(parts, cc, group_m, !stager, true);
            // SAFETY: as for the swept plans.
            Some(unsafe { GemmRsPlan::new_raw(&comm, &stream, pa, pb, (!all_reduce).then_some(po), m, n, kl, split)? })
        } else {
            None
        };
        let op = if all_reduce { "gemm-ar" } else { "gemm-rs" };
        record_split(
            args,
            rank,
            TuneKey {
                op: op.into(),
                world: world as u32,
                m,
                n,
                k,
            },
            parts,
        )?;
        let shape = GemmShape {
            m,
            n,
            k: kl,
            b_layout: BLayout::NxK,
        };
        let mut ours = || Ok(plan.launch(&stream)?);
        let mut ar_ref = stream.alloc_zeros::<bf16>(if all_reduce { m * n } else { 1 })?;
        let par = ar_ref.device_ptr_mut(&stream).0;
        let coll = || {
            if all_reduce {
                nccl.all_reduce(&stream, pp, par, m * n)
            } else {
                nccl.reduce_scatter(&stream, pp, pr, ms * n)
            }
        };
        let mut baseline = |a: &CudaSlice<bf16>, b: &CudaSlice<bf16>| -> Result<()> {
            cublas_gemm(&blas, shape, a, b, &mut partial)?;
            coll()
        };
        let mut baseline_timed = || baseline(&a, &b);
        let mut gemm_alone = || cublas_gemm(&blas, shape, &a, &b, &mut partial_alone);
        let mut rs_alone = || coll();
        // Our own GEMM on the same shape (diagnostic: what the fused kernel adds to it).
        let mut partial_ours = stream.alloc_zeros::<bf16>(m * n)?;
        let mut our_plan = GemmPlan::new(&dev, GemmConfig::for_shape(shape, OutDtype::Bf16))?;
        let mut our_gemm_alone = || {
            let t = GemmTensors {
                a: &a,
                b: &b,
                c: &mut partial_ours,
            };
            our_plan.launch(&stream, t, m)?;
            Ok(())
        };
        let mut twin_launch = || twin.as_ref().map_or(Ok(()), |p| Ok(p.launch(&stream)?));
        let t = if twin.is_some() {
            median_ms_aligned(
                &stream,
                args.warmup,
                args.iters,
                &mut align,
                &mut [
                    &mut ours,
                    &mut baseline_timed,
                    &mut gemm_alone,
                    &mut rs_alone,
                    &mut our_gemm_alone,
                    &mut twin_launch,
                ],
            )?
        } else {
            median_ms_aligned(
                &stream,
                args.warmup,
                args.iters,
                &mut align,
                &mut [
                    &mut ours,
                    &mut baseline_timed,
                    &mut gemm_alone,
                    &mut rs_alone,
                    &mut our_gemm_alone,
                ],
            )?
        };
        comm.check()?;
        let no_sk_ms = t.get(5).copied();
        if let (0, Some(x)) = (rank, no_sk_ms) {
            println!(
                "#   stream-K A/B: {sk_tiles} tiles stream-K {:.1} us, without {:.1} us ({:+.1}%)",
                t[0] * 1e3,
                x * 1e3,
                (x / t[0] - 1.0) * 100.0
            );
        }
        // Diagnostic: ours after each predecessor (index 1 of each pair), and back to back.
        let contexts = if args.contexts {
            let alone = median_ms_aligned(&stream, 2, args.iters, &mut align, &mut [&mut ours])?[0];
            let after_baseline = median_ms_aligned(
                &stream,
                2,
                args.iters,
                &mut align,
                &mut [&mut baseline_timed, &mut ours],
            )?[1];
            let after_gemm =
                median_ms_aligned(&stream, 2, args.iters, &mut align, &mut [&mut gemm_alone, &mut ours])?[1];
            let after_coll = median_ms_aligned(&stream, 2, args.iters, &mut align, &mut [&mut rs_alone, &mut ours])?[1];
            let after_our_gemm = median_ms_aligned(
                &stream,
                2,
                args.iters,
                &mut align,
                &mut [&mut our_gemm_alone, &mut ours],
            )?[1];
            // The same for cuBLAS alone: is the predecessor's effect ours alone?
            let blas_alone = median_ms_aligned(&stream, 2, args.iters, &mut align, &mut [&mut gemm_alone])?[0];
            let blas_after_coll = median_ms_aligned(
                &stream,
                2,
                args.iters,
                &mut align,
                &mut [&mut rs_alone, &mut gemm_alone],
            )?[1];
            let blas_after_ours =
                median_ms_aligned(&stream, 2, args.iters, &mut align, &mut [&mut ours, &mut gemm_alone])?[1];
            comm.check()?;
            if rank == 0 {
                println!("#   ours (us) back to back {:.1}; after cuBLAS+NCCL {:.1}; after cuBLAS {:.1}; after NCCL {:.1}; after our GEMM {:.1}", alone * 1e3, after_baseline * 1e3, after_gemm * 1e3, after_coll * 1e3, after_our_gemm * 1e3);
                println!(
                    "#   cuBLAS alone (us) back to back {:.1}; after NCCL {:.1}; after ours {:.1}",
                    blas_alone * 1e3,
                    blas_after_coll * 1e3,
                    blas_after_ours * 1e3
                );
            }
            Some(
                json!({ "back_to_back_ms": alone, "after_baseline_ms": after_baseline, "after_gemm_ms": after_gemm, "after_coll_ms": after_coll, "after_our_gemm_ms": after_our_gemm,
                "cublas_back_to_back_ms": blas_alone, "cublas_after_coll_ms": blas_after_coll, "cublas_after_ours_ms": blas_after_ours }),
            )
        } else {
            None
        };
        let timeline = if args.trace {
            // Also recorded right after each other kind of kernel (ranks lined up before both):
            // what the predecessor changes in the timeline (`--contexts` times it).
            let coll_name = if all_reduce {
                "after the AllReduce alone"
            } else {
                "after the ReduceScatter alone"
            };
            let mut after: [(&str, &mut dyn FnMut() -> Result<()>); 2] =
                [(coll_name, &mut rs_alone), ("after cuBLAS alone", &mut gemm_alone)];
            Some(trace_launch(
                args, &stream, &plan, rank, m, all_reduce, &mut align, &mut after,
            )?)
        } else {
            None
        };
        write_ternary(&stream, &mut a, &mut b, rank)?;
        ours()?;
        baseline(&a, &b)?;
        stream.synchronize()?;
        comm.check()?;
        let (x, y) = if all_reduce {
            let mut raw = vec![0u8; m * n * 2];
            let ours_out = plan.all_reduce_output().expect("an AllReduce plan");
            // SAFETY: the plan's output holds m x n bf16 in this rank's heap.
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut raw, comm.ptr(&ours_out)?)? };
            (
                raw.chunks(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect::<Vec<_>>(),
                stream.clone_dtoh(&ar_ref)?,
            )
        } else {
            (stream.clone_dtoh(&out)?, stream.clone_dtoh(&out_ref)?)
        };
        let wrong = exact_mismatches(&x, &y);
        let (speedup, overlap) = (t[1] / t[0], t[2].max(t[3]) / t[0]);
        if rank == 0 {
            println!("{m:>6} {k:>6} {n:>6} | {:>8} {:>9.1} | {:>11.1} {:>10.1} {:>10.1} | {speedup:>8.3} {overlap:>8.3} {wrong:>7} | {:>9.1}", format!("{parts}/{path}/{group_m}{}", if sk_tiles > 0 { format!("/k{sk_tiles}") } else { String::new() }), t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3, t[4] * 1e3);
        }
        rows.push(json!({ "m": m, "k": k, "n": n, "world": world, "rank": rank, "parts": parts, "comm_ctas": comm_ctas, "pull": pull, "group_m": group_m, "stager": stager, "stream_k_tiles": sk_tiles, "ours_no_stream_k_ms": no_sk_ms, "sweep": sweep,
            "op": if all_reduce { "gemm-ar" } else { "gemm-rs" },
            "ours_ms": t[0], "cublas_nccl_ms": t[1], "gemm_alone_ms": t[2], "coll_alone_ms": t[3], "our_gemm_alone_ms": t[4],
            "speedup": speedup, "overlap_efficiency": overlap, "wrong": wrong, "trace": timeline, "contexts": contexts }));
    }
    Ok(rows)
}

/// The split of a swept GEMM+RS/AR plan: `cc` is the path (0: no comm CTAs, [`PULL`]: pulled,
/// else that many comm CTAs).
fn rs_split(parts: u32, cc: u32, group_m: u32, no_stager: bool, no_stream_k: bool) -> RsSplit {
    let comm_ctas = if cc == 0 || cc == PULL {
        RsSplit::NO_COMM_CTAS
    } else {
        cc
    };
    RsSplit {
        parts,
        comm_ctas,
        group_m,
        pull: cc == PULL,
        no_stager,
        no_stream_k,
    }
}

/// `--trace`: records the timeline of the plan's next launches (the last of three back to back
/// stays), summarizes it (printed by every rank) and writes the raw words next to the JSON;
/// then records and summarizes one launch right after each of `after` (ranks lined up by
/// `align` before both, as in the timed runs), kept in the summary's `after` map.
#[allow(clippy::too_many_arguments)]
fn trace_launch(
    args: &Args,
    stream: &Arc<CudaStream>,
    plan: &GemmRsPlan,
    rank: usize,
    m: usize,
    all_reduce: bool,
    align: &mut dyn FnMut() -> Result<()>,
    after: &mut [(&str, &mut dyn FnMut() -> Result<()>)],
) -> Result<Value> {
    let ctas = plan.split().1;
    let mut buf = stream.alloc_zeros::<u64>(mkernel_config::trace::words(ctas))?;
    let ptr = buf.device_ptr_mut(stream).0;
    // SAFETY: `buf` holds words(ctas) words and outlives the launches (synchronized below).
    unsafe { plan.set_trace(stream, Some(ptr))? };
    for _ in 0..2 {
        plan.launch(stream)?;
    }
    // The recorded (last) launch is also timed with events: against its timeline, what the
    // launch costs before its CTAs start and after they end.
    let ctx = stream.context();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (start, stop) = (ctx.new_event(flags)?, ctx.new_event(flags)?);
    let op = if all_reduce { "gemm-ar" } else { "gemm-rs" };
    // One recorded launch: its timeline's words and summary (printed), with its event time.
    let record = |label: String| -> Result<(Vec<u64>, Value)> {
        start.record(stream)?;
        plan.launch(stream)?;
        stop.record(stream)?;
        stream.synchronize()?;
        let us = start.elapsed_ms(&stop)? as f64 * 1e3;
        let words = stream.clone_dtoh(&buf)?;
        let mut summary = crate::trace::summarize(&label, &words, ctas as usize);
        println!("#   the recorded launch between its events: {us:.1} us");
        summary["event_us"] = serde_json::json!(us);
        Ok((words, summary))
    };
    let (words, mut summary) = record(format!("{op} M={m} rank {rank}"))?;
    // The same launch recorded right after each other kernel (lined up before both, as timed).
    let mut contexts = serde_json::Map::new();
    for (name, before) in after.iter_mut() {
        align()?;
        before()?;
        align()?;
        contexts.insert(name.to_string(), record(format!("{op} M={m} rank {rank}, {name}"))?.1);
    }
    summary["after"] = Value::Object(contexts);
    // SAFETY: no launch after this reads the field.
    unsafe { plan.set_trace(stream, None)? };
    let raw: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let path = args.json.with_extension(format!("trace-{op}-{m}-r{rank}.bin"));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&path, raw)?;
    Ok(summary)
}
