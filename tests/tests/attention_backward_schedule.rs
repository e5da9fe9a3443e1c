//! CPU checks of the FlashAttention backward's CTA schedule (its device source compiled for the
//! host): every key block of every (sequence, key/value head) is owned by exactly one CTA (so
//! dK and dV are written once), CTAs past a sequence's keys have no work, and the query blocks a
//! CTA visits cover every (query head of the group, query block) holding a (query, key) pair the
//! mask lets through, each once, with `visible` equal to a brute-force mask.
#[allow(dead_code)]
#[path = "../../crates/device/src/kernels/attention/backward/schedule.rs"]
mod bwd_schedule;

/// The forward's schedule module, which the backward's takes `uniform` from.
#[allow(dead_code)]
#[path = "../../crates/device/src/kernels/attention/schedule.rs"]
pub mod fwd_schedule;
mod kernels {
    pub mod attention {
        pub use crate::fwd_schedule as schedule;
    }
}

/// The device's `arch::shuffle` for one host "thread": a broadcast from lane 0 is the value.
mod arch {
    pub mod shuffle {
        pub fn shfl_idx(x: u32, _lane: u32) -> u32 {
            x
        }
    }
}

use bwd_schedule::{bwd_work, BLOCK_M, BLOCK_N};
use mkernel_config::ops::attention_bwd::AttentionBwdArgs;
use std::collections::HashMap;

/// (q_len, k_len) per sequence; batched when `varlen` is false (all lengths equal).
fn check(lens: &[(u32, u32)], heads_q: u32, heads_kv: u32, causal: bool, varlen: bool) {
    let mut cu_q = vec![0u32];
    let mut cu_k = vec![0u32];
    for &(q, k) in lens {
        cu_q.push(cu_q.last().unwrap() + q);
        cu_k.push(cu_k.last().unwrap() + k);
    }
    let max_k = lens.iter().map(|l| l.1).max().unwrap();
    let a = AttentionBwdArgs {
        cu_seqlens_q: if varlen { cu_q.as_ptr() as u64 } else { 0 },
        cu_seqlens_k: if varlen { cu_k.as_ptr() as u64 } else { 0 },
        batch: lens.len() as u32,
        heads_q,
        heads_kv,
        seqlen_q: if varlen { 0 } else { lens[0].0 },
        seqlen_k: if varlen { 0 } else { lens[0].1 },
        total_q: *cu_q.last().unwrap(),
        causal: causal as u32,
        ..AttentionBwdArgs::default()
    };
    let grid = max_k.div_ceil(BLOCK_N) * lens.len() as u32 * heads_kv;
    let group = heads_q / heads_kv;
    // (b, h_kv, key block) -> owners; (b, h_q, key block, query block) -> visits.
    let mut owners: HashMap<(u32, u32, u32), u32> = HashMap::new();
    let mut visits: HashMap<(u32, u32, u32, u32), u32> = HashMap::new();
    for t in 0..grid {
        let Some(w) = (unsafe { bwd_work::<false>(&a, t) }) else {
            continue;
        };
        let (ql, kl) = lens[w.b as usize];
        assert_eq!((w.q_len, w.k_len), (ql, kl), "CTA {t}: lengths");
        assert_eq!(
            (w.q_start, w.k_start),
            (cu_q[w.b as usize], cu_k[w.b as usize]),
            "CTA {t}: starts"
        );
        assert!(
            w.n0 < kl && w.n0 % BLOCK_N == 0,
            "CTA {t}: key block {} of {kl} keys",
            w.n0
        );
        assert_eq!(w.group, group);
        *owners.entry((w.b, w.h_kv, w.n0 / BLOCK_N)).or_default() += 1;
        for it in 0..w.iterations() {
            let (hq, m0) = w.at(it);
            assert!(hq / group == w.h_kv && m0 < ql, "CTA {t}: head {hq}, query row {m0}");
            *visits.entry((w.b, hq, w.n0 / BLOCK_N, m0 / BLOCK_M)).or_default() += 1;
            // The element mask against the brute-force rule.
            for i in m0..m0 + BLOCK_M {
                for j in w.n0..w.n0 + BLOCK_N {
                    let want = i < ql && j < kl && (!causal || j as i64 <= i as i64 + kl as i64 - ql as i64);
                    assert_eq!(w.visible(i, j), want, "CTA {t}: visible({i}, {j})");
                }
            }
        }
    }
    for (b, &(ql, kl)) in lens.iter().enumerate() {
        let b = b as u32;
        for hk in 0..heads_kv {
            for n in 0..kl.div_ceil(BLOCK_N) {
                assert_eq!(
                    owners.get(&(b, hk, n)),
                    Some(&1),
                    "sequence {b} head {hk} key block {n}: owners"
                );
                for hq in hk * group..(hk + 1) * group {
                    for m in 0..ql.div_ceil(BLOCK_M) {
                        let any = (m * BLOCK_M..((m + 1) * BLOCK_M).min(ql)).any(|i| {
                            (n * BLOCK_N..((n + 1) * BLOCK_N).min(kl))
                                .any(|j| !causal || j as i64 <= i as i64 + kl as i64 - ql as i64)
                        });
                        let got = visits.get(&(b, hq, n, m)).copied().unwrap_or(0);
                        if any {
                            assert_eq!(got, 1, "sequence {b} head {hq} key block {n} query block {m}: visits");
                        } else {
                            assert!(got <= 1, "sequence {b} head {hq} key block {n} query block {m}: visits");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn backward_schedule_covers_every_visible_block_once() {
    for causal in [false, true] {
        check(&[(300, 300), (300, 300)], 4, 2, causal, false);
        check(&[(1000, 1000)], 4, 1, causal, false);
        check(&[(200, 517)], 2, 2, causal, false);
        check(&[(517, 200)], 2, 2, causal, false);
        check(&[(1, 1)], 1, 1, causal, false);
        check(&[(1, 700)], 2, 1, causal, false);
        check(&[(77, 129), (77, 129), (77, 129)], 8, 4, causal, false);
        let lens = [
            (1, 1),
            (130, 257),
            (0, 5),
            (300, 300),
            (64, 0),
            (513, 200),
            (0, 0),
            (129, 129),
            (1, 300),
        ];
        check(&lens, 4, 2, causal, true);
    }
    println!(
        "backward schedule: every key block owned once, every visible (head, key block, query block) visited once"
    );
}
