//! Ring attention forward across the ranks (one process per GPU, under `xtask launch`; `cargo
//! xtask bench --op ring-attention --nproc W` does that itself, sharing a GPU when there are
//! fewer GPUs than W). Per shape (the four, causal and not; S is the whole sequence):
//! - ours: one `RingAttentionPlan` launch (K/V passed around the ring inside the kernel);
//! - local block: our single-GPU kernel on one rank's block (`S/W` queries x `S/W` keys; causal:
//!   the causal block, the same pairs as one zigzag step);
//! - sequential baseline: W local-block kernels with NCCL send/recv of K and V (to the right,
//!   from the left) between them, nothing overlapped. The merge of the partials is not in it
//!   (ours merges inside the kernel), which favours the baseline. NCCL refuses two ranks on one
//!   GPU, so where ranks share a GPU (MPS) the baseline moves K and V with copy-engine copies
//!   into the right neighbour's heap, a barrier, and a local copy into the next buffer
//!   (marked `copies` in the table).
//!
//! TFLOP/s per GPU = this rank's visible pairs x 4 x Hq x D / ring time; overlap efficiency =
//! W x local-block time / ring time (1.0: the ring costs no more than its compute).
use crate::nccl::Nccl;
use crate::timing::median_ms_aligned;
use crate::Args;
use anyhow::Result;
use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use mkernel::bootstrap::Bootstrap;
use mkernel::ops::attention::{AttentionHeads, AttentionTensors, FlashAttentionPlan, Sequences};
use mkernel::ops::ring_attention::{comm_cta_candidates, tune_key, RingAttentionPlan, RingOptions};
use mkernel::{CommConfig, Communicator, Device, ReduceDtype};
use mkernel_tests::data::random_bf16;
use serde_json::{json, Value};
use std::cell::RefCell;
use std::time::Duration;

/// (batch, heads_q, heads_kv, whole sequence, head_dim): issue 24's shapes.
const SHAPES: [(usize, usize, usize, usize, usize); 4] = [
    (1, 32, 32, 16384, 128),
    (4, 16, 16, 8192, 128),
    (1, 32, 8, 16384, 128),
    (1, 32, 32, 16384, 64),
];

pub fn run(args: &Args) -> Result<Vec<Value>> {
    let boot = Bootstrap::from_env(Duration::from_secs(60))?;
    let info = boot.info().clone();
    let dev = Device::new(info.device())?;
    let (rank, world) = (info.rank(), info.world_size());
    // NCCL refuses ranks that share a GPU; `--no-nccl` leaves it out (the copies baseline runs).
    let nccl = if crate::report::shared_gpu().is_none() && !args.no_nccl {
        Some(Nccl::new(&boot, rank, world)?)
    } else {
        None
    };
    let cases = crate::attention::selected(&SHAPES, args);
    let ws_bytes = cases
        .iter()
        .map(|&(_, b, _, hkv, s, d, _)| 4 * (b * (s / world) * hkv * d * 2) as u64)
        .max()
        .unwrap_or(0);
    let comm = Communicator::new(
        &dev,
        boot,
        CommConfig {
            heap_bytes: 2 * ws_bytes + (64 << 20),
            ..Default::default()
        },
    )?;
    let ws = comm.alloc(ws_bytes.max(256))?;
    // The baseline's receive buffers where NCCL cannot run (K then V).
    let stage = comm.alloc(ws_bytes.max(256) / 2)?;
    let sync = comm.alloc(256)?;
    let stream = dev.default_stream();
    // NCCL's point-to-point connections to both neighbours now, before any kernel of ours (see
    // `connect_p2p`), not at the baseline's first run inside the timing loop.
    if let Some(n) = &nccl {
        let mut peers = vec![(rank + 1) % world, (rank + world - 1) % world];
        peers.dedup();
        n.connect_p2p(&stream, &peers)?;
    }
    // Lines the ranks up before each timed run (see median_ms_aligned).
    let barrier = || comm.all_reduce(&stream, &sync, &sync, 8, ReduceDtype::Bf16, 1);
    let mut align = || Ok(barrier()?);
    if rank == 0 {
        println!(
            "# ring attention forward, {world} ranks, {} SMs per rank",
            dev.sm_count()
        );
        println!(
            "| shape (BxHqxHkvxSxD, c = causal) | comm/compute CTAs | ours ms | TFLOP/s per GPU | local block ms | overlap eff. | NCCL + local, sequential ms | sequential / ours |"
        );
        println!("|---|---|---|---|---|---|---|---|");
    }
    let mut rows = vec![];
    for (label, b, hq, hkv, s, d, causal) in cases {
        if s % (2 * world) != 0 {
            continue;
        }
        let sl = s / world;
        let heads = AttentionHeads {
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            causal,
            softmax_scale: None,
        };
        let nq = b * sl * hq * d;
        let nkv = b * sl * hkv * d;
        let seed = 10 * rank as u64;
        let q = stream.clone_htod(&random_bf16(nq, seed + 1))?;
        let ka = stream.clone_htod(&random_bf16(nkv, seed + 2))?;
        let va = stream.clone_htod(&random_bf16(nkv, seed + 3))?;
        let kb = stream.alloc_zeros::<bf16>(nkv)?;
        let vb = stream.alloc_zeros::<bf16>(nkv)?;
        let (mut o, mut lse) = (stream.alloc_zeros::<bf16>(nq)?, stream.alloc_zeros::<f32>(b * sl * hq)?);
        let (oa, la) = (stream.alloc_zeros::<bf16>(nq)?, stream.alloc_zeros::<f32>(b * sl * hq)?);
        let (ob, lb) = (stream.alloc_zeros::<bf16>(nq)?, stream.alloc_zeros::<f32>(b * sl * hq)?);
        let seqs = Sequences::Batched {
            batch: b,
            seqlen_q: sl,
            seqlen_k: sl,
        };
        // `cargo xtask tune --op ring-attention`: time every candidate comm CTA count alone, take
        // the one whose slowest rank was fastest, record it and run the table with it.
        let mut sweep = vec![];
        let comm_ctas = match &args.tune_out {
            Some(_) => {
                let tiles = b * hq * sl.div_ceil(128);
                let mut timed = vec![];
                for c in comm_cta_candidates(dev.sm_count(), world as u32, tiles) {
                    let opts = RingOptions { comm_ctas: Some(c) };
                    let plan = RingAttentionPlan::new(
                        &comm, &stream, &q, &ka, &va, &mut o, &mut lse, &ws, b, sl, heads, opts,
                    )?;
                    let mut f = || Ok(plan.launch(&stream)?);
                    let t = median_ms_aligned(&stream, args.warmup, args.iters, &mut align, &mut [&mut f])?;
                    comm.check()?;
                    sweep.push(json!({ "comm_ctas": c, "ms": t[0] }));
                    timed.push((c, t[0], ()));
                }
                if timed.is_empty() {
                    None
                } else {
                    let (best, ()) = crate::fused::agreed_best(&comm, timed)?;
                    crate::fused::record_split(args, rank, tune_key(world as u32, b, sl, &heads), best)?;
                    Some(best)
                }
            }
            None => None,
        };
        let ring = RingAttentionPlan::new(
            &comm,
            &stream,
            &q,
            &ka,
            &va,
            &mut o,
            &mut lse,
            &ws,
            b,
            sl,
            heads,
            RingOptions { comm_ctas },
        )?;
        let local = FlashAttentionPlan::new(&dev, heads)?;
        let (oa, la, ob, lb) = (RefCell::new(oa), RefCell::new(la), RefCell::new(ob), RefCell::new(lb));
        let launch_local = |k: &CudaSlice<bf16>,
                            v: &CudaSlice<bf16>,
                            o: &RefCell<CudaSlice<bf16>>,
                            l: &RefCell<CudaSlice<f32>>|
         -> Result<()> {
            let (mut o, mut l) = (o.borrow_mut(), l.borrow_mut());
            let t = AttentionTensors {
                q: &q,
                k,
                v,
                o: &mut *o,
                lse: Some(&mut *l),
            };
            local.launch(&stream, t, seqs)?;
            Ok(())
        };
        let bufs = [
            (ka.device_ptr(&stream).0, va.device_ptr(&stream).0),
            (kb.device_ptr(&stream).0, vb.device_ptr(&stream).0),
        ];
        // The baseline's even steps receive into `ka`/`va`: from W = 3 on, after its first run
        // ours and the local block read another rank's K and V (the same distribution; only
        // times are taken here, no output is checked).
        let bytes = nkv * 2;
        let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
        let mut f_ring = || Ok(ring.launch(&stream)?);
        let mut f_local = || launch_local(&ka, &va, &oa, &la);
        // The copies baseline reaches the right neighbour through its heap: one node only.
        let copies = nccl.is_none() && comm.nnodes() == 1;
        let stage_peer = if copies {
            comm.peer_ptr(right as u32, &stage)?
        } else {
            0
        };
        let stage_local = comm.ptr(&stage)?;
        let copy = |dst: u64, src: u64, n: usize| -> Result<()> {
            // SAFETY: device ranges of `n` bytes (heap buffers sized for the largest case).
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, n, stream.cu_stream())? };
            Ok(())
        };
        let mut f_seq = || -> Result<()> {
            launch_local(&ka, &va, &oa, &la)?;
            for t in 1..world {
                let (from, to) = (bufs[(t - 1) % 2], bufs[t % 2]);
                if let Some(nccl) = &nccl {
                    nccl.send_recv(
                        &stream,
                        &[(right, from.0, bytes), (right, from.1, bytes)],
                        &[(left, to.0, bytes), (left, to.1, bytes)],
                    )?;
                } else {
                    copy(stage_peer, from.0, bytes)?;
                    copy(stage_peer + bytes as u64, from.1, bytes)?;
                    barrier()?;
                    copy(to.0, stage_local, bytes)?;
                    copy(to.1, stage_local + bytes as u64, bytes)?;
                    // The left neighbour may overwrite the stage at the next step only after this.
                    barrier()?;
                }
                if t % 2 == 1 {
                    launch_local(&kb, &vb, &ob, &lb)?;
                } else {
                    launch_local(&ka, &va, &oa, &la)?;
                }
            }
            Ok(())
        };
        let t = if nccl.is_some() || copies {
            median_ms_aligned(
                &stream,
                args.warmup,
                args.iters,
                &mut align,
                &mut [&mut f_ring, &mut f_local, &mut f_seq],
            )?
        } else {
            // Ranks sharing a GPU across (emulated) nodes: neither NCCL nor peer copies.
            let mut t = median_ms_aligned(
                &stream,
                args.warmup,
                args.iters,
                &mut align,
                &mut [&mut f_ring, &mut f_local],
            )?;
            t.push(f64::NAN);
            t
        };
        comm.check()?;
        let (ring_ms, local_ms, seq_ms) = (t[0], t[1], t[2]);
        let tflops = ring.flops() / ring_ms / 1e9;
        let eff = world as f64 * local_ms / ring_ms;
        let roles = ring.roles();
        if rank == 0 {
            let (seq, ratio) = if nccl.is_some() {
                (format!("{seq_ms:.3}"), format!("{:.2}", seq_ms / ring_ms))
            } else if copies {
                (format!("{seq_ms:.3} (copies)"), format!("{:.2}", seq_ms / ring_ms))
            } else {
                ("- (shared GPU across nodes: no baseline)".to_string(), "-".to_string())
            };
            println!(
                "| {label} | {}/{} | {ring_ms:.3} | {tflops:.1} | {local_ms:.3} | {eff:.2} | {seq} | {ratio} |",
                roles.comm, roles.compute
            );
        }
        rows.push(json!({
            "shape": label, "batch": b, "heads_q": hq, "heads_kv": hkv, "seqlen": s, "head_dim": d,
            "causal": causal, "world": world, "comm_ctas": roles.comm, "compute_ctas": roles.compute,
            "ring_ms": ring_ms, "tflops_per_gpu": tflops, "local_block_ms": local_ms,
            "overlap_efficiency": eff, "sequential_ms": seq_ms,
            "sequential_transport": if nccl.is_some() { "nccl" } else if copies { "copies" } else { "none" }, "sweep": sweep,
        }));
    }
    Ok(rows)
}
