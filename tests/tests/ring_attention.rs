//! Ring attention across every rank of the job (W = global ranks; on several nodes the ring's
//! hops between nodes go through the proxy) against the single-GPU FlashAttention kernel and the
//! f64 CPU reference over the whole sequence: causal (zigzag shards) and non-causal, head dim 64
//! and 128, GQA, chunks that are not a multiple of the 128-row tile; the error of W ranks beside
//! the single-GPU kernel's (W = 1); repeated launches and a CUDA-graph replay; bad input.
//! Run: `bundle/xtask launch -n 2 --share-gpu -- bundle/tests/mkernel-tests-ring_attention --include-ignored --nocapture`
//! (2 emulated nodes x 2 ranks: `-n 4 --nodes 2`).
use half::bf16;
use mkernel::ops::attention::{flash_attention, AttentionHeads, AttentionTensors, Sequences};
use mkernel::ops::ring_attention::{RingAttentionPlan, RingOptions};
use mkernel::{Communicator, Device};
use mkernel_tests::attention::{attention as cpu_attention, zigzag_chunks, Seq};
use mkernel_tests::data::random_bf16;
use mkernel_tests::gpu::launched_comm_or_skip;
use std::time::Duration;

/// Tolerances of tests/tests/attention.rs: bf16 output rounding plus P rounded to bf16.
const O_ABS: f64 = 4e-3;
const O_REL: f64 = 1e-2;
const LSE_ABS: f64 = 2e-3;

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    /// Rows of each whole sequence.
    s: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
}

/// Global row (inside its sequence) of local row `l` of `rank`.
fn global_row(l: usize, rank: usize, world: usize, s_local: usize, causal: bool) -> usize {
    if causal {
        let c = s_local / 2;
        let [a, b] = zigzag_chunks(rank, world);
        if l < c {
            a * c + l
        } else {
            b * c + l - c
        }
    } else {
        rank * s_local + l
    }
}

/// Rows `[batch][s_local][heads][d]` of this rank's shard of a `[batch][s][heads][d]` tensor.
fn shard(x: &[bf16], c: &Case, heads: usize, rank: usize, world: usize) -> Vec<bf16> {
    let s_local = c.s / world;
    let row = heads * c.d;
    let mut out = Vec::with_capacity(c.batch * s_local * row);
    for b in 0..c.batch {
        for l in 0..s_local {
            let g = b * c.s + global_row(l, rank, world, s_local, c.causal);
            out.extend_from_slice(&x[g * row..(g + 1) * row]);
        }
    }
    out
}

struct Errors {
    ring_o: f64,
    ring_lse: f64,
    single_o: f64,
    single_lse: f64,
    ring_vs_single_o: f64,
    wrong: usize,
    first: String,
}

fn run_case(comm: &Communicator, dev: &Device, ws: &mkernel::SymBuffer, c: &Case, seed: u64) -> Errors {
    let stream = dev.default_stream();
    let (rank, world) = (comm.global_rank() as usize, comm.global_world() as usize);
    let s_local = c.s / world;
    let total = c.batch * c.s;
    let q = random_bf16(total * c.hq * c.d, seed);
    let k = random_bf16(total * c.hkv * c.d, seed + 1);
    let v = random_bf16(total * c.hkv * c.d, seed + 2);
    let heads = AttentionHeads {
        heads_q: c.hq,
        heads_kv: c.hkv,
        head_dim: c.d,
        causal: c.causal,
        softmax_scale: None,
    };
    // W = 1: the single-GPU kernel over the whole sequence.
    let (gq, gk, gv) = (
        stream.clone_htod(&q).unwrap(),
        stream.clone_htod(&k).unwrap(),
        stream.clone_htod(&v).unwrap(),
    );
    let mut go = stream.alloc_zeros::<bf16>(total * c.hq * c.d).unwrap();
    let mut glse = stream.alloc_zeros::<f32>(total * c.hq).unwrap();
    let seqs = Sequences::Batched {
        batch: c.batch,
        seqlen_q: c.s,
        seqlen_k: c.s,
    };
    let t = AttentionTensors {
        q: &gq,
        k: &gk,
        v: &gv,
        o: &mut go,
        lse: Some(&mut glse),
    };
    flash_attention(dev, &stream, heads, t, seqs).unwrap();
    let (single_o, single_lse) = (stream.clone_dtoh(&go).unwrap(), stream.clone_dtoh(&glse).unwrap());
    // The ring over the shards.
    let rows = c.batch * s_local;
    let lq = stream.clone_htod(&shard(&q, c, c.hq, rank, world)).unwrap();
    let lk = stream.clone_htod(&shard(&k, c, c.hkv, rank, world)).unwrap();
    let lv = stream.clone_htod(&shard(&v, c, c.hkv, rank, world)).unwrap();
    let mut lo = stream.alloc_zeros::<bf16>(rows * c.hq * c.d).unwrap();
    let mut llse = stream.alloc_zeros::<f32>(rows * c.hq).unwrap();
    assert!(ws.bytes() >= RingAttentionPlan::workspace_bytes(c.batch, s_local, &heads).unwrap());
    {
        let plan = RingAttentionPlan::new(
            comm,
            &stream,
            &lq,
            &lk,
            &lv,
            &mut lo,
            &mut llse,
            ws,
            c.batch,
            s_local,
            heads,
            RingOptions::default(),
        )
        .unwrap();
        plan.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        comm.check().unwrap();
    }
    let (ring_o, ring_lse) = (stream.clone_dtoh(&lo).unwrap(), stream.clone_dtoh(&llse).unwrap());
    // The f64 reference over the whole sequence.
    let seq_list: Vec<Seq> = (0..c.batch)
        .map(|b| Seq {
            q_start: b * c.s,
            q_len: c.s,
            k_start: b * c.s,
            k_len: c.s,
        })
        .collect();
    let scale = 1.0 / (c.d as f64).sqrt();
    let (want_o, want_lse) = cpu_attention(&q, &k, &v, &seq_list, total, c.hq, c.hkv, c.d, c.causal, scale);
    let mut e = Errors {
        ring_o: 0.0,
        ring_lse: 0.0,
        single_o: 0.0,
        single_lse: 0.0,
        ring_vs_single_o: 0.0,
        wrong: 0,
        first: String::new(),
    };
    for b in 0..c.batch {
        for l in 0..s_local {
            let g = b * c.s + global_row(l, rank, world, s_local, c.causal);
            let lr = b * s_local + l;
            for h in 0..c.hq {
                for x in 0..c.d {
                    let want = want_o[(g * c.hq + h) * c.d + x];
                    let got = ring_o[(lr * c.hq + h) * c.d + x].to_f64();
                    let one = single_o[(g * c.hq + h) * c.d + x].to_f64();
                    let err = (got - want).abs();
                    e.ring_o = e.ring_o.max(err);
                    e.single_o = e.single_o.max((one - want).abs());
                    e.ring_vs_single_o = e.ring_vs_single_o.max((got - one).abs());
                    if err.is_nan() || err > O_ABS + O_REL * want.abs() {
                        if e.wrong == 0 {
                            e.first =
                                format!("O(b {b}, local row {l} = global {g}, head {h}, col {x}) = {got} want {want}");
                        }
                        e.wrong += 1;
                    }
                }
                let want = want_lse[h * total + g];
                let got = ring_lse[(b * c.hq + h) * s_local + l] as f64;
                let one = single_lse[(b * c.hq + h) * c.s + (g - b * c.s)] as f64;
                let err = (got - want).abs();
                e.ring_lse = e.ring_lse.max(err);
                e.single_lse = e.single_lse.max((one - want).abs());
                if err.is_nan() || err > LSE_ABS {
                    if e.wrong == 0 {
                        e.first = format!("LSE(b {b}, local row {l} = global {g}, head {h}) = {got} want {want}");
                    }
                    e.wrong += 1;
                }
            }
        }
    }
    e
}

/// In this order the grid grows from case to case (more tiles): a plan's first step must not
/// wait for flags of CTAs the previous launch did not have.
const CASES: [Case; 6] = [
    Case {
        batch: 1,
        s: 1024,
        hq: 4,
        hkv: 4,
        d: 128,
        causal: false,
    },
    Case {
        batch: 1,
        s: 1024,
        hq: 4,
        hkv: 4,
        d: 128,
        causal: true,
    },
    Case {
        batch: 2,
        s: 512,
        hq: 4,
        hkv: 2,
        d: 64,
        causal: true,
    },
    Case {
        batch: 1,
        s: 768,
        hq: 8,
        hkv: 2,
        d: 64,
        causal: false,
    },
    // Chunks of 125 (W = 4) or 250 (W = 2) rows: tiles straddle the two chunks of a shard.
    Case {
        batch: 1,
        s: 1000,
        hq: 4,
        hkv: 1,
        d: 128,
        causal: true,
    },
    Case {
        batch: 2,
        s: 1000,
        hq: 2,
        hkv: 2,
        d: 64,
        causal: false,
    },
];

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs ring_* binaries under xtask launch at 2 and 4 ranks)"]
fn ring_attention_matches_the_whole_sequence() {
    let Some((dev, comm)) = launched_comm_or_skip(
        "ring_attention_matches_the_whole_sequence",
        64 << 20,
        Duration::from_secs(10),
    ) else {
        return;
    };
    let (rank, world) = (comm.global_rank() as usize, comm.global_world() as usize);
    let nodes = comm.nnodes();
    let stream = dev.default_stream();
    let biggest = CASES
        .iter()
        .map(|c| {
            let h = AttentionHeads {
                heads_q: c.hq,
                heads_kv: c.hkv,
                head_dim: c.d,
                causal: c.causal,
                softmax_scale: None,
            };
            RingAttentionPlan::workspace_bytes(c.batch, c.s, &h).unwrap()
        })
        .max()
        .unwrap();
    // The heap is a bump allocator: one workspace for the largest case.
    let ws = comm.alloc(biggest).unwrap();
    let mut failures = Vec::new();
    for (i, c) in CASES.iter().enumerate() {
        if c.s % (2 * world) != 0 {
            continue;
        }
        let e = run_case(&comm, &dev, &ws, c, 100 + 10 * i as u64);
        println!(
            "rank {rank}/{world} ({nodes} node(s)) {c:?}: max |O err| W=1 (single-GPU kernel) {:.2e}, W={world} (ring) {:.2e}; \
             max |LSE err| W=1 {:.2e}, W={world} {:.2e}; max |ring - single| O {:.2e}",
            e.single_o, e.ring_o, e.single_lse, e.ring_lse, e.ring_vs_single_o
        );
        if e.wrong > 0 {
            failures.push(format!("{c:?}: {} wrong, first {}", e.wrong, e.first));
        }
        // The f32 merge does not drift with W: no more than twice the one-GPU error (+ one bf16
        // rounding step of O).
        if e.ring_o > 2.0 * e.single_o + 2e-3 || e.ring_lse > 2.0 * e.single_lse + 1e-4 {
            failures.push(format!(
                "{c:?}: ring error O {:.2e} / LSE {:.2e} grows past W = 1's {:.2e} / {:.2e}",
                e.ring_o, e.ring_lse, e.single_o, e.single_lse
            ));
        }
    }
    assert!(failures.is_empty(), "rank {rank}: {failures:#?}");

    // Repeated launches and a CUDA-graph replay give the same bits (epochs advance on the device).
    {
        use mkernel::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let c = CASES[2];
        let s_local = c.s / world;
        let rows = c.batch * s_local;
        let heads = AttentionHeads {
            heads_q: c.hq,
            heads_kv: c.hkv,
            head_dim: c.d,
            causal: c.causal,
            softmax_scale: None,
        };
        let q = stream
            .clone_htod(&random_bf16(rows * c.hq * c.d, 900 + rank as u64))
            .unwrap();
        let k = stream
            .clone_htod(&random_bf16(rows * c.hkv * c.d, 910 + rank as u64))
            .unwrap();
        let v = stream
            .clone_htod(&random_bf16(rows * c.hkv * c.d, 920 + rank as u64))
            .unwrap();
        let mut o = stream.alloc_zeros::<bf16>(rows * c.hq * c.d).unwrap();
        let mut lse = stream.alloc_zeros::<f32>(rows * c.hq).unwrap();
        let cstream = dev.context().new_stream().unwrap();
        // Plans are dropped before O and LSE are read (a plan borrows them mutably).
        let mut run = |launches: usize, graph: bool| {
            {
                let plan = RingAttentionPlan::new(
                    &comm,
                    &cstream,
                    &q,
                    &k,
                    &v,
                    &mut o,
                    &mut lse,
                    &ws,
                    c.batch,
                    s_local,
                    heads,
                    RingOptions::default(),
                )
                .unwrap();
                if graph {
                    cstream
                        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                        .unwrap();
                    plan.launch(&cstream).unwrap();
                    let g = cstream
                        .end_capture(CUgraphInstantiate_flags(0))
                        .unwrap()
                        .expect("graph");
                    for _ in 0..launches {
                        g.launch().unwrap();
                    }
                    cstream.synchronize().unwrap();
                } else {
                    for _ in 0..launches {
                        plan.launch(&cstream).unwrap();
                    }
                }
                cstream.synchronize().unwrap();
                comm.check().unwrap();
            }
            let o_bits: Vec<u16> = cstream.clone_dtoh(&o).unwrap().iter().map(|x| x.to_bits()).collect();
            let l_bits: Vec<u32> = cstream.clone_dtoh(&lse).unwrap().iter().map(|x| x.to_bits()).collect();
            (o_bits, l_bits)
        };
        let first = run(1, false);
        let again = run(3, false);
        assert!(again == first, "rank {rank}: repeated launches differ from the first");
        let replayed = run(3, true);
        assert!(
            replayed == first,
            "rank {rank}: graph replay differs from the direct launch"
        );
        println!("rank {rank}: 4 launches and a graph replayed 3 times: bitwise equal to the first launch");
    }

    // Bad input: clear errors, the same on every rank (so the next plan's exchange stays in step).
    {
        let heads = AttentionHeads {
            heads_q: 4,
            heads_kv: 4,
            head_dim: 128,
            causal: true,
            softmax_scale: None,
        };
        let n = 2 * 258 * 4 * 128;
        let q = stream.alloc_zeros::<bf16>(n).unwrap();
        let k = stream.alloc_zeros::<bf16>(n).unwrap();
        let v = stream.alloc_zeros::<bf16>(n).unwrap();
        let mut o = stream.alloc_zeros::<bf16>(n).unwrap();
        let mut lse = stream.alloc_zeros::<f32>(n / 128).unwrap();
        let mut plan_err = |s_local: usize, heads: AttentionHeads| {
            RingAttentionPlan::new(
                &comm,
                &stream,
                &q,
                &k,
                &v,
                &mut o,
                &mut lse,
                &ws,
                1,
                s_local,
                heads,
                RingOptions::default(),
            )
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
        };
        let e = plan_err(if rank == 0 { 258 } else { 256 }, heads);
        assert!(
            e.contains("ranks disagree on seqlen_local: rank 0 258"),
            "rank {rank}: {e}"
        );
        println!("rank {rank}: shards of different lengths -> {e}");
        let e = plan_err(255, heads);
        assert!(e.contains("zigzag"), "rank {rank}: {e}");
        println!("rank {rank}: odd shard, causal -> {e}");
        let e = plan_err(256, AttentionHeads { head_dim: 96, ..heads });
        assert!(e.contains("head_dim 96"), "rank {rank}: {e}");
        let e = plan_err(256, AttentionHeads { heads_kv: 3, ..heads });
        assert!(e.contains("not a multiple of heads_kv"), "rank {rank}: {e}");
        println!("rank {rank}: head dim 96 and 4 heads over 3 KV heads rejected");
    }
}
