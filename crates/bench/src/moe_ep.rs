//! MoE with expert parallelism over the ranks of a job (`xtask bench --op moe --nproc W`; across
//! emulated nodes: `xtask launch -n W --nodes 2 [--share-gpu] -- mkernel-bench --op moe`):
//! ours (`MoeEpPlan`: route + dispatch + grouped up (SwiGLU) + grouped down + combine) beside
//! NCCL all-to-all + our grouped GEMMs alone + all-to-all in sequence, per rank, with the time
//! of every stage of ours and its dispatch / combine bandwidth per GPU.
//!
//! The NCCL baseline is given what ours computes on the device: its rows already sorted by
//! expert on the host (no gather), the receive counts known on the host (no counts exchange),
//! and it stops at the returned rows (no weighted sum). NCCL refuses ranks that share a GPU
//! ("Duplicate GPU detected", NCCL >= 2.5), so under `--share-gpu` only ours runs.
use crate::moe::random_device;
use crate::nccl::Nccl;
use crate::report::shared_gpu;
use crate::timing::median;
use crate::Args;
use anyhow::Result;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use mkernel::bootstrap::Bootstrap;
use mkernel::ops::moe::{padded_offsets, Activation, GroupedGemmPlan, GroupedGemmShape};
use mkernel::ops::moe_ep::{MoeEpPlan, MoeEpShape, MoeEpStage};
use mkernel::{CommConfig, Communicator, Device, ReduceDtype};
use mkernel_tests::moe::{skewed_routing, uniform_routing};
use serde_json::{json, Value};
use std::time::Duration;

/// (T per rank, E, top_k, H, F, routing).
fn cases() -> Vec<(usize, usize, usize, usize, usize, &'static str)> {
    vec![
        (4096, 64, 8, 4096, 2048, "uniform"),
        (4096, 64, 8, 4096, 2048, "skewed"),
        (128, 64, 8, 4096, 2048, "uniform"),
    ]
}

fn routing(kind: &str, t: usize, e: usize, k: usize, seed: u64) -> (Vec<i32>, Vec<f32>) {
    if kind == "skewed" {
        skewed_routing(t, e, k, seed)
    } else {
        uniform_routing(t, e, k, seed)
    }
}

pub fn run(args: &Args) -> Result<Vec<Value>> {
    let boot = Bootstrap::from_env(Duration::from_secs(60))?;
    let info = boot.info().clone();
    let dev = Device::new(info.device())?;
    let (rank, world, nodes) = (info.rank(), info.world_size(), info.nnodes());
    let nccl = match shared_gpu() {
        Some(n) => {
            if rank == 0 {
                println!("# NCCL baseline skipped: {n} ranks share this GPU, and NCCL refuses two ranks on one GPU");
            }
            None
        }
        None => Some(Nccl::new(&boot, rank, world)?),
    };
    // `--filter` with `fused` in it: the same cases with the dispatch fused into the up
    // projection (`MoeEpPlan::new_fused`, labels ending in `-fused`), selected by the rest of
    // the filter.
    let fused = args.filter.as_deref().is_some_and(|x| x.contains("fused"));
    let base_filter = args
        .filter
        .as_deref()
        .map(|x| x.replace("-fused", "").replace("fused", ""));
    let selected: Vec<_> = cases()
        .into_iter()
        .filter(|(t, e, k, h, f, r)| {
            let label = format!("T{t}-E{e}-k{k}-H{h}-F{f}-{r}");
            base_filter.as_ref().is_none_or(|x| label.contains(x.as_str()))
        })
        .collect();
    // One plan per distinct shape (uniform and skewed share one): the heap holds them all.
    let shape_of = |&(t, e, k, h, f, _): &(usize, usize, usize, usize, usize, &str)| MoeEpShape {
        tokens: t,
        experts: e,
        top_k: k,
        hidden: h,
        ffn: f,
        act: Activation::SwiGlu,
        capacity: None,
    };
    let mut shapes: Vec<MoeEpShape> = vec![];
    for c in &selected {
        if !shapes.contains(&shape_of(c)) {
            shapes.push(shape_of(c));
        }
    }
    let heap: u64 = shapes.iter().map(|s| s.heap_bytes_nodes(world, nodes)).sum::<u64>() + (16 << 20);
    let comm = Communicator::new(
        &dev,
        boot,
        CommConfig {
            heap_bytes: heap,
            ..Default::default()
        },
    )?;
    let stream = dev.default_stream();
    let sync_buf = comm.alloc(256)?;
    if rank == 0 {
        println!(
            "# moe expert parallel: {world} ranks on {nodes} node(s){}, {} SMs per rank (persistent grids); median of {} runs after {} warm-up, ranks lined up by a 16-byte all_reduce before each run",
            if info.emulated_nodes().is_some() { " (emulated: other nodes through the proxy's emulated wire)" } else { "" },
            dev.sm_count(),
            args.iters,
            args.warmup
        );
        println!(
            "# ours: route + dispatch + grouped up (SwiGLU) + grouped down + combine; nccl: all-to-all + grouped up + grouped down + all-to-all (rows pre-sorted on the host, counts known, no weighted sum)"
        );
        if fused {
            println!("# fused (-fused): the dispatch runs inside the up projection's kernel (MoeEpPlan::new_fused): the dispatch column is empty, its time is in up");
        }
        println!(
            "# dispatch GB/s = rows this rank stores (all owners, itself included) x H x 2 B / dispatch time; combine GB/s = rows it reads back / combine time"
        );
        println!(
            "{:<6} {:<30} {:>9} {:>8} {:>9} {:>8} {:>8} {:>9} {:>9} {:>10} {:>10} {:>9} {:>7}",
            "rank",
            "case",
            "ours_us",
            "route",
            "dispatch",
            "up",
            "down",
            "combine",
            "disp_GB/s",
            "comb_GB/s",
            "nccl_us",
            "a2a_us",
            "speedup"
        );
    }
    let mut rows = vec![];
    for shape in &shapes {
        let (t, e, k, h, f) = (shape.tokens, shape.experts, shape.top_k, shape.hidden, shape.ffn);
        let l = shape.local_experts(world);
        let (lu, ld) = shape.weight_lens(world);
        let w_up = random_device(&stream, lu, 1 + rank as u64, 0.05)?;
        let w_down = random_device(&stream, ld, 2 + rank as u64, 0.05)?;
        let x = random_device(&stream, t * h, 3 + rank as u64, 1.0)?;
        let mut out = stream.alloc_zeros::<bf16>(t * h)?;
        let mut plan = if fused {
            MoeEpPlan::new_fused(&comm, &stream, *shape, &w_up, &w_down)?
        } else {
            MoeEpPlan::new(&comm, &stream, *shape, &w_up, &w_down)?
        };
        for c in selected.iter().filter(|c| shape_of(c) == *shape) {
            let kind = c.5;
            let label = format!("T{t}-E{e}-k{k}-H{h}-F{f}-{kind}{}", if fused { "-fused" } else { "" });
            let all: Vec<(Vec<i32>, Vec<f32>)> = (0..world).map(|r| routing(kind, t, e, k, 100 + r as u64)).collect();
            let (ids, wts) = &all[rank];
            let (dids, dw) = (stream.clone_htod(ids)?, stream.clone_htod(wts)?);
            let comm_ref = plan.comm();
            let align = || comm_ref.all_reduce(&stream, &sync_buf, &sync_buf, 4, ReduceDtype::F32, 4);
            // Ours, every stage between events.
            let ctx = stream.context();
            let mut samples: Vec<[f64; 6]> = vec![];
            for it in 0..args.warmup + args.iters {
                align()?;
                let ev: Vec<_> = (0..6)
                    .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
                    .collect::<Result<_, _>>()?;
                ev[0].record(&stream)?;
                for (i, stage) in MoeEpStage::ALL.iter().enumerate() {
                    plan.launch_stage(*stage, &stream, &x, &dids, &dw, &mut out)?;
                    ev[i + 1].record(&stream)?;
                }
                stream.synchronize()?;
                if it >= args.warmup {
                    let mut s = [0f64; 6];
                    for i in 0..5 {
                        s[i] = ev[i].elapsed_ms(&ev[i + 1])? as f64;
                    }
                    s[5] = ev[0].elapsed_ms(&ev[5])? as f64;
                    samples.push(s);
                }
            }
            plan.check(&stream)?;
            let med = |i: usize| {
                let mut v: Vec<f64> = samples.iter().map(|s| s[i]).collect();
                median(&mut v)
            };
            let g = plan.inspect(&stream)?;
            let kept = g.pos.iter().filter(|&&p| p != u32::MAX).count();
            let to_peers = g
                .pos
                .iter()
                .zip(ids)
                .filter(|(&p, &id)| p != u32::MAX && id as usize / l != rank)
                .count();
            let local = world / nodes.max(1);
            let to_other_nodes = g
                .pos
                .iter()
                .zip(ids)
                .filter(|(&p, &id)| p != u32::MAX && id as usize / l / local != rank / local)
                .count();
            let bytes = (kept * h * 2) as f64;
            let (route, disp, up, down, comb, total) = (med(0), med(1), med(2), med(3), med(4), med(5));
            // Fused: the dispatch stage enqueues nothing, its stores are inside the up projection.
            let disp_gbs = if fused { f64::NAN } else { bytes / (disp * 1e6) };
            let comb_gbs = bytes / (comb * 1e6);
            // NCCL baseline.
            let base = match &nccl {
                Some(n) => Some(nccl_baseline(
                    n, &dev, &stream, *shape, world, rank, &all, &w_up, &w_down, args, &align,
                )?),
                None => None,
            };
            let (nccl_us, a2a_us) = base.map_or((f64::NAN, f64::NAN), |(a, b)| (a * 1e3, b * 1e3));
            println!(
                "{:<6} {:<30} {:>9.1} {:>8.1} {:>9.1} {:>8.1} {:>8.1} {:>9.1} {:>9.1} {:>10.1} {:>10.1} {:>9.1} {:>7.3}",
                rank,
                label,
                total * 1e3,
                route * 1e3,
                disp * 1e3,
                up * 1e3,
                down * 1e3,
                comb * 1e3,
                disp_gbs,
                comb_gbs,
                nccl_us,
                a2a_us,
                nccl_us / (total * 1e3)
            );
            rows.push(json!({
                "case": label, "rank": rank, "world": world, "nodes": nodes,
                "emulated_nodes": info.emulated_nodes().is_some(), "tokens_per_rank": t, "experts": e, "top_k": k,
                "hidden": h, "ffn": f, "routing": kind,
                "ours_us": total * 1e3, "route_us": route * 1e3, "dispatch_us": disp * 1e3, "up_us": up * 1e3,
                "down_us": down * 1e3, "combine_us": comb * 1e3,
                "rows_stored": kept, "rows_to_peers": to_peers, "rows_to_other_nodes": to_other_nodes,
                "dispatch_gbps": disp_gbs, "combine_gbps": comb_gbs,
                "nccl_us": base.map(|b| b.0 * 1e3), "nccl_a2a_us": base.map(|b| b.1 * 1e3),
                "rows_here": g.offsets[l],
            }));
        }
    }
    Ok(rows)
}

/// NCCL all-to-all of the rows (sorted by expert on the host, received into the padded
/// grouped layout, sources in rank order inside a group), our grouped GEMMs up and down,
/// all-to-all back. Returns (median ms of the whole, median ms of the two all-to-alls alone).
#[allow(clippy::too_many_arguments)]
fn nccl_baseline(
    nccl: &Nccl,
    dev: &Device,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    s: MoeEpShape,
    world: usize,
    rank: usize,
    all: &[(Vec<i32>, Vec<f32>)],
    w_up: &CudaSlice<bf16>,
    w_down: &CudaSlice<bf16>,
    args: &Args,
    align: &dyn Fn() -> mkernel::Result<()>,
) -> Result<(f64, f64)> {
    let (e, h, f) = (s.experts, s.hidden, s.ffn);
    let l = s.local_experts(world);
    let row = h * 2;
    let cnt: Vec<Vec<usize>> = all
        .iter()
        .map(|(ids, _)| {
            let mut c = vec![0usize; e];
            for &id in ids {
                c[id as usize] += 1;
            }
            c
        })
        .collect();
    // Sender: my rows sorted by expert (offsets by expert); receiver: my experts' groups.
    let send_off: Vec<usize> = (0..e)
        .scan(0, |a, x| {
            let o = *a;
            *a += cnt[rank][x];
            Some(o)
        })
        .collect();
    let totals: Vec<u32> = (0..l)
        .map(|j| (0..world).map(|r| cnt[r][rank * l + j]).sum::<usize>() as u32)
        .collect();
    let poff = padded_offsets(&totals);
    // Padded groups: a multiple of 128 rows.
    let cap = (poff[l] as usize).max(128);
    let pairs = s.pairs();
    let send = random_device(stream, pairs * h, 9, 1.0)?;
    let back = stream.alloc_zeros::<bf16>(pairs * h)?;
    let recv = stream.alloc_zeros::<bf16>(cap * h)?;
    let hid = stream.alloc_zeros::<bf16>(cap * f)?;
    let yp = stream.alloc_zeros::<bf16>(cap * h)?;
    let counts = stream.clone_htod(&totals)?;
    let ptr = |b: &CudaSlice<bf16>| b.device_ptr(stream).0;
    let (ps, pb, pr, ph, py) = (ptr(&send), ptr(&back), ptr(&recv), ptr(&hid), ptr(&yp));
    let mut fwd_s = vec![];
    let mut fwd_r = vec![];
    for x in 0..e {
        fwd_s.push((x / l, ps + (send_off[x] * row) as u64, cnt[rank][x] * row));
    }
    for src in 0..world {
        for j in 0..l {
            let before: usize = (0..src).map(|r| cnt[r][rank * l + j]).sum();
            let at = poff[j] as usize + before;
            fwd_r.push((src, pr + (at * row) as u64, cnt[src][rank * l + j] * row));
        }
    }
    // Back: the same segments with the roles swapped (yp instead of recv, back instead of send).
    let bwd_s: Vec<_> = fwd_r.iter().map(|&(p, a, b)| (p, a - pr + py, b)).collect();
    let bwd_r: Vec<_> = fwd_s.iter().map(|&(p, a, b)| (p, a - ps + pb, b)).collect();
    let gshape = |n, k, act| GroupedGemmShape {
        groups: l,
        capacity_rows: cap,
        n,
        k,
        act,
    };
    let counts_ptr = counts.device_ptr(stream).0;
    // SAFETY: every buffer above holds its shape's elements and outlives both plans (they are
    // dropped at the end of this function, after the stream synchronized).
    let (up, down) = unsafe {
        (
            GroupedGemmPlan::new_raw(
                dev,
                stream,
                gshape(f, h, Activation::SwiGlu),
                pr,
                ptr(w_up),
                ph,
                counts_ptr,
                None,
            )?,
            GroupedGemmPlan::new_raw(
                dev,
                stream,
                gshape(h, f, Activation::None),
                ph,
                ptr(w_down),
                py,
                counts_ptr,
                None,
            )?,
        )
    };
    let ctx = stream.context();
    let (mut whole, mut a2a) = (vec![], vec![]);
    for it in 0..args.warmup + args.iters {
        align()?;
        let ev: Vec<_> = (0..5)
            .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<Result<_, _>>()?;
        ev[0].record(stream)?;
        nccl.send_recv(stream, &fwd_s, &fwd_r)?;
        ev[1].record(stream)?;
        up.launch(stream)?;
        down.launch(stream)?;
        ev[2].record(stream)?;
        nccl.send_recv(stream, &bwd_s, &bwd_r)?;
        ev[3].record(stream)?;
        stream.synchronize()?;
        if it >= args.warmup {
            whole.push(ev[0].elapsed_ms(&ev[3])? as f64);
            a2a.push((ev[0].elapsed_ms(&ev[1])? + ev[2].elapsed_ms(&ev[3])?) as f64);
        }
    }
    Ok((median(&mut whole), median(&mut a2a)))
}
