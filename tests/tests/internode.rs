//! Collectives across emulated nodes: NVLink inside a node, GPU-posted puts through the proxy
//! and the emulated wire between nodes, against CPU references.
//! Run: `bundle/xtask launch -n 2 --nodes 2 -- bundle/tests/mkernel-tests-internode` (2 x 1),
//! `-n 4 --nodes 2` (2 x 2).
#[path = "support/reduce_data.rs"]
mod reduce_data;

use mkernel::{CommConfig, ReduceDtype};
use mkernel_tests::gpu::launched_internode_comm_or_skip;
use mkernel_tests::reference::{compare, BF16_OUT_REL, F32_ACC, F32_OUT_REL};
use reduce_data::{decode, dtoh, htod, values};

fn rank_data(rank: u32, len: usize, dtype: ReduceDtype, seed: u64) -> (Vec<f64>, Vec<u8>) {
    values(len, dtype, seed * 1000 + rank as u64)
}

#[test]
#[ignore = "needs GPU ranks (bundle/run-tests.sh runs it under xtask launch)"]
fn internode_collectives_match_cpu_reference() {
    let cfg = CommConfig {
        heap_bytes: 256 << 20,
        ..Default::default()
    };
    let Some((dev, comm)) = launched_internode_comm_or_skip("internode_collectives_match_cpu_reference", cfg) else {
        return;
    };
    let (g, nglobal) = (comm.global_rank(), comm.world() * comm.nnodes());
    let stream = dev.default_stream();
    let out = comm.alloc(128 << 20).unwrap();
    let inp = comm.alloc(32 << 20).unwrap();
    let mut local = stream.alloc_zeros::<u8>(32 << 20).unwrap();
    let mut lines = vec![];
    let mut seed = 1u64;
    for &bytes in &[16u64, 4096, 1 << 20, 8 << 20] {
        for rep in 0..3 {
            seed += 1;
            let all: Vec<Vec<u8>> = (0..nglobal)
                .map(|r| rank_data(r, bytes as usize, ReduceDtype::Bf16, seed).1[..bytes as usize].to_vec())
                .collect();
            let n = bytes as usize;
            stream.memcpy_htod(&all[g as usize], &mut local.slice_mut(..n)).unwrap();
            comm.all_gather(&stream, &local.slice(..n), &out, 8).unwrap();
            stream.synchronize().unwrap();
            comm.check().unwrap();
            assert!(
                dtoh(comm.ptr(&out).unwrap(), (bytes * nglobal as u64) as usize) == all.concat(),
                "rank {g}: all_gather {bytes} B rep {rep}"
            );
        }
        lines.push(format!(
            "all_gather {bytes:>8} B/rank over {} nodes, 3 launches: exact",
            comm.nnodes()
        ));
    }
    for dtype in [ReduceDtype::Bf16, ReduceDtype::F32] {
        for &count in &[1024usize, 100_000, 2 << 20] {
            for rep in 0..3 {
                seed += 1;
                let vals: Vec<(Vec<f64>, Vec<u8>)> = (0..nglobal).map(|r| rank_data(r, count, dtype, seed)).collect();
                htod(comm.ptr(&inp).unwrap(), &vals[g as usize].1);
                comm.all_reduce(&stream, &inp, &out, count as u64, dtype, 8).unwrap();
                stream.synchronize().unwrap();
                comm.check().unwrap();
                let got = decode(&dtoh(comm.ptr(&out).unwrap(), count * dtype.size() as usize), dtype);
                let want: Vec<f64> = (0..count).map(|i| vals.iter().map(|v| v.0[i]).sum()).collect();
                // Allowance: f32 accumulation over every input, plus the output's rounding and,
                // for bf16, the rounding of each node's sum to bf16 before it crosses the wire
                // (docs/internode.md): 2^-8 of |node sum| per node.
                let world = comm.world() as usize;
                let allowance: Vec<f64> = (0..count)
                    .map(|i| {
                        let acc = F32_ACC * vals.iter().map(|v| v.0[i].abs()).sum::<f64>();
                        let node_sums = (0..comm.nnodes() as usize).map(|n| {
                            vals[n * world..(n + 1) * world]
                                .iter()
                                .map(|v| v.0[i])
                                .sum::<f64>()
                                .abs()
                        });
                        acc + if dtype == ReduceDtype::Bf16 {
                            BF16_OUT_REL * node_sums.sum::<f64>()
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let rel = if dtype == ReduceDtype::Bf16 {
                    BF16_OUT_REL
                } else {
                    F32_OUT_REL
                };
                let c = compare(&got, &want, &allowance, rel, 1.0);
                assert_eq!(
                    c.wrong, 0,
                    "rank {g}: all_reduce {dtype:?} count {count} rep {rep}: {c:?}"
                );
            }
            lines.push(format!(
                "all_reduce {dtype:?} {count:>8} over {} nodes, 3 launches: within tolerance",
                comm.nnodes()
            ));
        }
    }
    // Back to back without host synchronization.
    seed += 1;
    let (vals, raw) = rank_data(g, 65536, ReduceDtype::Bf16, seed);
    let _ = vals;
    htod(comm.ptr(&inp).unwrap(), &raw);
    for _ in 0..30 {
        comm.all_reduce(&stream, &inp, &out, 65536, ReduceDtype::Bf16, 4)
            .unwrap();
        comm.all_gather(&stream, &local.slice(..4096), &out, 4).unwrap();
    }
    stream.synchronize().unwrap();
    comm.check().unwrap();
    lines.push("30 x (all_reduce + all_gather) across nodes back to back without host sync: no error".into());
    // Latency probes (their own epoch sequence on the wire), then peers the proxy would refuse:
    // each is an error before any launch, and the inter-node path keeps working.
    if comm.nnodes() == 2 {
        let peer = (g + comm.world()) % nglobal;
        let rtt = comm.proxy_pingpong(&stream, peer, 256, 16, g < peer).unwrap();
        assert_eq!(rtt.len(), 16);
        // The initiator times each round trip; the answering side records nothing.
        if g < peer {
            assert!(rtt.iter().all(|&t| t > 0), "rank {g}: round trips {rtt:?}");
        }
        lines.push("proxy_pingpong 16 x 256 B between the two nodes: every probe answered".into());
    }
    let same_node = comm.global_rank() - comm.rank() + (comm.rank() + 1) % comm.world();
    for bad in [g, same_node, nglobal, u32::MAX] {
        let e = comm.proxy_pingpong(&stream, bad, 256, 4, true).unwrap_err();
        assert!(
            e.to_string().contains("not a rank on another node"),
            "rank {g}, peer {bad}: {e}"
        );
    }
    comm.all_gather(&stream, &local.slice(..4096), &out, 4).unwrap();
    stream.synchronize().unwrap();
    comm.check().unwrap();
    lines.push("proxy_pingpong to itself, a same-node rank and out-of-range ranks: refused, proxy still up".into());
    if g == 0 {
        for l in lines {
            println!("[{} ranks, {} nodes] {l}", nglobal, comm.nnodes());
        }
    }
}
