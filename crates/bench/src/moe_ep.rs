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
//!
//! Check: the baseline sends this rank's real token rows; after its timed runs the host sums
//! every token's returned rows with its weights (f32, `j` in order) and compares with our
//! layer's output of the same launch data (`#wrong`: elements off by more than 1% of the value
//! plus 1% of the output's RMS; both run the same grouped GEMM kernel, so they agree to about
//! one bf16 rounding of a row; a row of the wrong token or rank is off by about the RMS). Each
//! expert's weights differ ([`expert_weights`]), so a row computed with another expert is
//! caught too.
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
use mkernel_tests::data::random_bf16;
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
        None if args.no_nccl => {
            if rank == 0 {
                println!("# NCCL baseline skipped: --no-nccl");
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
    // NCCL's point-to-point connections now, before any kernel of ours (see `connect_p2p`).
    if let Some(n) = &nccl {
        n.connect_p2p(&stream, &(0..world).collect::<Vec<_>>())?;
    }
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
            "# dispatch GB/s = rows this rank stores (all owners, itself included) x H x 2 B / dispatch time; combine GB/s = rows it reads back / combine time; nccl: the same bytes / its first and second all-to-all"
        );
        println!(
            "# ctas: CTAs of our dispatch and combine kernels (each runs alone, on {} of the GPU's {} SMs at most); NCCL's all-to-all runs on its point-to-point channels' CTAs (NCCL_DEBUG=INFO lists the channels)",
            dev.sm_count(),
            dev.reported_sm_count()
        );
        println!(
            "# #wrong: elements of the NCCL baseline's weighted sum (on the host) that differ from our output (tolerance: 1% of the value + 1% of the output RMS)"
        );
        println!(
            "{:<6} {:<30} {:>9} {:>8} {:>9} {:>8} {:>8} {:>9} {:>5} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9} {:>7} {:>7}",
            "rank",
            "case",
            "ours_us",
            "route",
            "dispatch",
            "up",
            "down",
            "combine",
            "ctas",
            "disp_GB/s",
            "comb_GB/s",
            "nccl_us",
            "a2a_us",
            "nccl_dGB/s",
            "nccl_cGB/s",
            "speedup",
            "#wrong"
        );
    }
    let mut rows = vec![];
    for shape in &shapes {
        let (t, e, k, h, f) = (shape.tokens, shape.experts, shape.top_k, shape.hidden, shape.ffn);
        let l = shape.local_experts(world);
        let (lu, ld) = shape.weight_lens(world);
        let w_up = expert_weights(&stream, l, lu / l, 1 + rank as u64, 0.05)?;
        let w_down = expert_weights(&stream, l, ld / l, 2 + rank as u64, 0.05)?;
        // Every token its own row (`random_device` repeats a block every 1024 tokens at H = 4096),
        // kept on the host for the NCCL baseline's rows and its check.
        let x_host = random_bf16(t * h, 3 + rank as u64);
        let x = stream.clone_htod(&x_host)?;
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
            // NCCL baseline, checked against our output of this case.
            let base = match &nccl {
                Some(n) => {
                    let ours_out = stream.clone_dtoh(&out)?;
                    let b = nccl_baseline(
                        n, &dev, &stream, *shape, world, rank, &all, &x_host, &ours_out, &w_up, &w_down, args, &align,
                    )?;
                    if b.wrong > 0 {
                        println!(
                            "WARNING rank {rank} {label}: the NCCL baseline's output differs from ours at {} of {} elements (max |diff| {:.4}, output RMS {:.4})",
                            b.wrong,
                            t * h,
                            b.max_diff,
                            b.rms
                        );
                    }
                    Some(b)
                }
                None => None,
            };
            let nan = f64::NAN;
            let (nccl_us, a2a_us) = base.map_or((nan, nan), |b| (b.whole * 1e3, (b.dispatch + b.combine) * 1e3));
            let (nccl_dgbs, nccl_cgbs) =
                base.map_or((nan, nan), |b| (bytes / (b.dispatch * 1e6), bytes / (b.combine * 1e6)));
            let ctas = plan.grid();
            println!(
                "{:<6} {:<30} {:>9.1} {:>8.1} {:>9.1} {:>8.1} {:>8.1} {:>9.1} {:>5} {:>9.1} {:>9.1} {:>10.1} {:>10.1} {:>9.1} {:>9.1} {:>7.3} {:>7}",
                rank,
                label,
                total * 1e3,
                route * 1e3,
                disp * 1e3,
                up * 1e3,
                down * 1e3,
                comb * 1e3,
                ctas,
                disp_gbs,
                comb_gbs,
                nccl_us,
                a2a_us,
                nccl_dgbs,
                nccl_cgbs,
                nccl_us / (total * 1e3),
                base.map_or("-".to_string(), |b| b.wrong.to_string())
            );
            rows.push(json!({
                "case": label, "rank": rank, "world": world, "nodes": nodes,
                "emulated_nodes": info.emulated_nodes().is_some(), "tokens_per_rank": t, "experts": e, "top_k": k,
                "hidden": h, "ffn": f, "routing": kind,
                "ours_us": total * 1e3, "route_us": route * 1e3, "dispatch_us": disp * 1e3, "up_us": up * 1e3,
                "down_us": down * 1e3, "combine_us": comb * 1e3,
                "rows_stored": kept, "rows_to_peers": to_peers, "rows_to_other_nodes": to_other_nodes,
                "dispatch_gbps": disp_gbs, "combine_gbps": comb_gbs,
                // Our dispatch (separate plan) and combine kernels' CTAs, one per SM at most; the
                // fused plan's dispatch runs on the up projection's CTAs.
                "dispatch_ctas": if fused { None } else { Some(ctas) }, "combine_ctas": ctas,
                "sm_count": dev.sm_count(),
                "nccl_us": base.map(|b| b.whole * 1e3), "nccl_a2a_us": base.map(|b| (b.dispatch + b.combine) * 1e3),
                "nccl_dispatch_us": base.map(|b| b.dispatch * 1e3), "nccl_combine_us": base.map(|b| b.combine * 1e3),
                "nccl_dispatch_gbps": base.map(|_| nccl_dgbs), "nccl_combine_gbps": base.map(|_| nccl_cgbs),
                "nccl_wrong": base.map(|b| b.wrong), "nccl_max_diff": base.map(|b| b.max_diff),
                "rows_here": g.offsets[l],
            }));
        }
    }
    Ok(rows)
}

/// `experts` slices of `per` bf16 values in [-scale, scale): one random block of up to 4 Mi
/// values, repeated, starting 8 values further into it for each expert (device copies; the
/// single-GPU benchmark's `random_device` gives every expert of a rank the same weights, which
/// the NCCL baseline's check could not tell apart).
fn expert_weights(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    experts: usize,
    per: usize,
    seed: u64,
    scale: f32,
) -> Result<CudaSlice<bf16>> {
    let n = per.min(1 << 22);
    let block: Vec<bf16> = random_bf16(n + 8 * experts, seed)
        .iter()
        .map(|v| bf16::from_f32(v.to_f32() * scale))
        .collect();
    let src = stream.clone_htod(&block)?;
    let mut out = stream.alloc_zeros::<bf16>(experts * per)?;
    for i in 0..experts {
        let mut at = 0;
        while at < per {
            let m = n.min(per - at);
            stream.memcpy_dtod(
                &src.slice(8 * i..8 * i + m),
                &mut out.slice_mut(i * per + at..i * per + at + m),
            )?;
            at += m;
        }
    }
    Ok(out)
}

/// The NCCL baseline's all-to-all on one rank, in rows: every rank's ids are known on every
/// rank (the same seeds), so no counts are exchanged.
#[derive(Debug)]
struct A2aLayout {
    /// Rows per local expert received from all ranks (the grouped GEMMs' counts).
    totals: Vec<u32>,
    /// Padded first row of each local expert's group (`L + 1`, [`padded_offsets`]).
    poff: Vec<u32>,
    /// Per pair of this rank: its row among this rank's rows sorted by expert (pairs of one
    /// expert in pair order).
    slot: Vec<usize>,
    /// `(owner, first sorted row, rows)`: one per expert, in expert order.
    sends: Vec<(usize, usize, usize)>,
    /// `(source, first row of the padded groups, rows)`: one per (source, local expert), sources
    /// in rank order, then experts in order; inside an expert's group the sources in rank order.
    recvs: Vec<(usize, usize, usize)>,
}

/// [`A2aLayout`] of `rank` for every rank's ids (`ids[r]`, global expert ids `0..experts`).
/// A pair of ranks' sends and receives match in the order they are posted (NCCL's rule for
/// several operations between two ranks in a group): the sends from `s` to `d` are `s`'s
/// experts of `d` in order, the receives at `d` from `s` `d`'s local experts in order, and both
/// sides skip the same empty ones ([`Nccl::send_recv`] skips zero-byte entries).
fn a2a_layout(ids: &[&[i32]], experts: usize, rank: usize) -> A2aLayout {
    let world = ids.len();
    let l = experts / world;
    let cnt: Vec<Vec<usize>> = ids
        .iter()
        .map(|ids| {
            let mut c = vec![0usize; experts];
            for &id in *ids {
                c[id as usize] += 1;
            }
            c
        })
        .collect();
    let mut send_off = Vec::with_capacity(experts);
    let mut at = 0;
    for c in &cnt[rank] {
        send_off.push(at);
        at += c;
    }
    let totals: Vec<u32> = (0..l)
        .map(|j| (0..world).map(|r| cnt[r][rank * l + j]).sum::<usize>() as u32)
        .collect();
    // Counts of one bench routing: far below 2^32 rows.
    let poff = padded_offsets(&totals).expect("a bench routing's padded rows fit u32");
    let mut next = send_off.clone();
    let slot = ids[rank]
        .iter()
        .map(|&id| {
            let r = next[id as usize];
            next[id as usize] += 1;
            r
        })
        .collect();
    let sends = (0..experts).map(|x| (x / l, send_off[x], cnt[rank][x])).collect();
    let mut recvs = vec![];
    for src in 0..world {
        for j in 0..l {
            let before: usize = (0..src).map(|r| cnt[r][rank * l + j]).sum();
            recvs.push((src, poff[j] as usize + before, cnt[src][rank * l + j]));
        }
    }
    A2aLayout {
        totals,
        poff,
        slot,
        sends,
        recvs,
    }
}

/// What [`nccl_baseline`] measured (median ms) and how its result compares with ours.
#[derive(Clone, Copy)]
struct Baseline {
    /// All-to-all, grouped up and down, all-to-all back.
    whole: f64,
    /// The first all-to-all alone, and the second (medians of each).
    dispatch: f64,
    combine: f64,
    /// Output elements off by more than the tolerance, the largest difference, the output's RMS.
    wrong: usize,
    max_diff: f64,
    rms: f64,
}

/// NCCL all-to-all of the rows (this rank's token rows, sorted by expert on the host, received
/// into the padded grouped layout, sources in rank order inside a group), our grouped GEMMs up
/// and down, all-to-all back; then the returned rows' weighted sum on the host beside
/// `ours_out` (our layer's output for the same `x_host`, ids and weights).
#[allow(clippy::too_many_arguments)]
fn nccl_baseline(
    nccl: &Nccl,
    dev: &Device,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    s: MoeEpShape,
    world: usize,
    rank: usize,
    all: &[(Vec<i32>, Vec<f32>)],
    x_host: &[bf16],
    ours_out: &[bf16],
    w_up: &CudaSlice<bf16>,
    w_down: &CudaSlice<bf16>,
    args: &Args,
    align: &dyn Fn() -> mkernel::Result<()>,
) -> Result<Baseline> {
    let (e, k, h, f) = (s.experts, s.top_k, s.hidden, s.ffn);
    let l = s.local_experts(world);
    let row = h * 2;
    let ids_all: Vec<&[i32]> = all.iter().map(|(ids, _)| ids.as_slice()).collect();
    let a = a2a_layout(&ids_all, e, rank);
    let wts = &all[rank].1;
    let (slot, poff) = (&a.slot, &a.poff);
    // Padded groups: a multiple of 128 rows.
    let cap = (poff[l] as usize).max(128);
    let pairs = s.pairs();
    let mut rows = vec![bf16::ZERO; pairs * h];
    for (p, &r) in slot.iter().enumerate() {
        let t = p / k;
        rows[r * h..(r + 1) * h].copy_from_slice(&x_host[t * h..(t + 1) * h]);
    }
    let send = stream.clone_htod(&rows)?;
    drop(rows);
    let back = stream.alloc_zeros::<bf16>(pairs * h)?;
    let recv = stream.alloc_zeros::<bf16>(cap * h)?;
    let hid = stream.alloc_zeros::<bf16>(cap * f)?;
    let yp = stream.alloc_zeros::<bf16>(cap * h)?;
    let counts = stream.clone_htod(&a.totals)?;
    let ptr = |b: &CudaSlice<bf16>| b.device_ptr(stream).0;
    let (ps, pb, pr, ph, py) = (ptr(&send), ptr(&back), ptr(&recv), ptr(&hid), ptr(&yp));
    // Row segments to (peer, address, bytes); back: the same segments with the roles swapped
    // (yp instead of recv, back instead of send).
    let bytes = |segs: &[(usize, usize, usize)], base: u64| -> Vec<(usize, u64, usize)> {
        segs.iter()
            .map(|&(p, at, n)| (p, base + (at * row) as u64, n * row))
            .collect()
    };
    let (fwd_s, fwd_r) = (bytes(&a.sends, ps), bytes(&a.recvs, pr));
    let (bwd_s, bwd_r) = (bytes(&a.recvs, py), bytes(&a.sends, pb));
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
    let (mut up, mut down) = unsafe {
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
    let (mut whole, mut disp, mut comb) = (vec![], vec![], vec![]);
    for it in 0..args.warmup + args.iters {
        align()?;
        let ev: Vec<_> = (0..4)
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
            disp.push(ev[0].elapsed_ms(&ev[1])? as f64);
            comb.push(ev[2].elapsed_ms(&ev[3])? as f64);
        }
    }
    // Cannot happen (`cap` holds every padded group); a warning, not an end to the run.
    for (name, plan) in [("up", &mut up), ("down", &mut down)] {
        if let Err(e) = plan.take_error(stream) {
            println!("WARNING rank {rank}: the NCCL baseline's grouped {name} projection: {e}");
        }
    }
    // The check: every token's returned rows summed with its weights, beside ours.
    let back_h = stream.clone_dtoh(&back)?;
    let mut want = vec![0f32; ours_out.len()];
    for (p, (&r, &w)) in slot.iter().zip(wts).enumerate() {
        let t = p / k;
        for (o, y) in want[t * h..(t + 1) * h].iter_mut().zip(&back_h[r * h..(r + 1) * h]) {
            *o += w * y.to_f32();
        }
    }
    let rms = (want.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / want.len().max(1) as f64).sqrt();
    let (mut wrong, mut max_diff) = (0usize, 0f64);
    for (&o, &r) in ours_out.iter().zip(&want) {
        let d = (o.to_f32() as f64 - r as f64).abs();
        max_diff = max_diff.max(d);
        // NaN counts as wrong.
        if d.is_nan() || d > 1e-2 * ((r as f64).abs() + rms) {
            wrong += 1;
        }
    }
    Ok(Baseline {
        whole: median(&mut whole),
        dispatch: median(&mut disp),
        combine: median(&mut comb),
        wrong,
        max_diff,
        rms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mkernel_tests::moe::{skewed_routing, uniform_routing};

    /// Plays the baseline's two all-to-alls on the host with NCCL's matching rule (a pair of
    /// ranks' nonzero sends and receives in posting order, equal sizes) and an "expert" that
    /// tags each row with its expert and owner: every pair comes back to its own slot, computed
    /// by its own expert on its owner, inside that expert's padded group.
    #[test]
    fn the_all_to_all_returns_every_row_computed_by_its_expert() {
        for (world, experts, tokens, k, skewed) in [
            (2, 64, 300, 8, false),
            (4, 64, 257, 8, true),
            (3, 6, 40, 2, true),
            (4, 8, 1, 1, false),
        ] {
            let all: Vec<(Vec<i32>, Vec<f32>)> = (0..world)
                .map(|r| {
                    if skewed {
                        skewed_routing(tokens, experts, k, 100 + r as u64)
                    } else {
                        uniform_routing(tokens, experts, k, 100 + r as u64)
                    }
                })
                .collect();
            let ids: Vec<&[i32]> = all.iter().map(|(i, _)| i.as_slice()).collect();
            let lay: Vec<A2aLayout> = (0..world).map(|r| a2a_layout(&ids, experts, r)).collect();
            let l = experts / world;
            // A row: (source rank, pair) forward, (expert, owner, source, pair) back.
            let sorted: Vec<Vec<Option<(usize, usize)>>> = (0..world)
                .map(|r| {
                    let mut v = vec![None; ids[r].len()];
                    for (p, &s) in lay[r].slot.iter().enumerate() {
                        assert!(v[s].is_none(), "two pairs in one sorted row");
                        v[s] = Some((r, p));
                    }
                    v
                })
                .collect();
            let mut recv: Vec<Vec<Option<(usize, usize)>>> =
                (0..world).map(|d| vec![None; lay[d].poff[l] as usize]).collect();
            // Nonzero operations of `ops` with `peer`, in posting order.
            let with = |ops: &[(usize, usize, usize)], peer: usize| -> Vec<(usize, usize)> {
                ops.iter()
                    .filter(|o| o.0 == peer && o.2 > 0)
                    .map(|o| (o.1, o.2))
                    .collect()
            };
            for s in 0..world {
                for d in 0..world {
                    let (tx, rx) = (with(&lay[s].sends, d), with(&lay[d].recvs, s));
                    assert_eq!(tx.len(), rx.len(), "{s} -> {d}: sends and receives differ in number");
                    for ((ts, n), (rs, m)) in tx.into_iter().zip(rx) {
                        assert_eq!(n, m, "{s} -> {d}: a send and its receive differ in size");
                        for i in 0..n {
                            assert!(recv[d][rs + i].is_none(), "a receive row written twice");
                            recv[d][rs + i] = sorted[s][ts + i];
                        }
                    }
                }
            }
            // The grouped GEMM on each owner: group j's rows are expert d * l + j's.
            // (expert, owner, source rank, pair) of each computed row.
            type Done = Option<(usize, usize, usize, usize)>;
            let mut yp: Vec<Vec<Done>> = vec![];
            for d in 0..world {
                let mut y = vec![None; recv[d].len()];
                for j in 0..l {
                    let (g0, n) = (lay[d].poff[j] as usize, lay[d].totals[j] as usize);
                    assert!(lay[d].poff[j + 1] as usize >= g0 + n);
                    for r in g0..g0 + n {
                        let (s, p) = recv[d][r].expect("a row of a group never received");
                        y[r] = Some((d * l + j, d, s, p));
                    }
                }
                yp.push(y);
            }
            let mut back: Vec<Vec<Done>> = (0..world).map(|r| vec![None; ids[r].len()]).collect();
            for d in 0..world {
                for s in 0..world {
                    let (tx, rx) = (with(&lay[d].recvs, s), with(&lay[s].sends, d));
                    assert_eq!(tx.len(), rx.len());
                    for ((ts, n), (rs, m)) in tx.into_iter().zip(rx) {
                        assert_eq!(n, m);
                        for i in 0..n {
                            back[s][rs + i] = yp[d][ts + i];
                        }
                    }
                }
            }
            for r in 0..world {
                for (p, &id) in ids[r].iter().enumerate() {
                    let got = back[r][lay[r].slot[p]];
                    assert_eq!(got, Some((id as usize, id as usize / l, r, p)), "rank {r} pair {p}");
                }
            }
        }
    }
}
