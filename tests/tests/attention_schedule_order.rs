//! CPU checks of the FlashAttention kernel's tile schedule (its device source compiled for the
//! host): every (sequence, head, query block) is visited once and empty blocks are skipped, the
//! key-block count of a tile equals a brute-force count of the keys its rows see, every element
//! the mask would hide lies in a block marked for masking, and under a causal mask each head's
//! query blocks come longest first.
#[allow(dead_code)]
#[path = "../../crates/device/src/kernels/attention/schedule.rs"]
mod schedule;

/// The device's `arch::shuffle` for one host "thread": a broadcast from lane 0 is the value.
mod arch {
    pub mod shuffle {
        pub fn shfl_idx(x: u32, _lane: u32) -> u32 {
            x
        }
    }
}

use mkernel_config::ops::attention::AttentionArgs;
use schedule::{total, work, BLOCK};

/// (q_len, k_len) per sequence; batched when all are equal and `varlen` is false.
fn check(lens: &[(u32, u32)], heads_q: u32, heads_kv: u32, causal: bool, varlen: bool) {
    let mut cu_q = vec![0u32];
    let mut cu_k = vec![0u32];
    for &(q, k) in lens {
        cu_q.push(cu_q.last().unwrap() + q);
        cu_k.push(cu_k.last().unwrap() + k);
    }
    let max_q = lens.iter().map(|l| l.0).max().unwrap();
    let a = AttentionArgs {
        cu_seqlens_q: if varlen { cu_q.as_ptr() as u64 } else { 0 },
        cu_seqlens_k: if varlen { cu_k.as_ptr() as u64 } else { 0 },
        batch: lens.len() as u32,
        heads_q,
        heads_kv,
        seqlen_q: max_q,
        // With varlen input `seqlen_k` holds the key rows of the tensor (they clamp the offsets).
        seqlen_k: if varlen { *cu_k.last().unwrap() } else { lens[0].1 },
        total_q: *cu_q.last().unwrap(),
        m_blocks: max_q.div_ceil(BLOCK),
        causal: causal as u32,
        ..Default::default()
    };
    let mut seen = std::collections::HashSet::new();
    let mut last_blocks: std::collections::HashMap<(u32, u32), u32> = Default::default();
    for t in 0..total::<true>(&a) {
        let Some(w) = (unsafe { work::<true>(&a, t) }) else {
            continue;
        };
        let (b, h) = (w.b as usize, w.h);
        let (lq, lk) = lens[b];
        assert_eq!((w.q_start, w.q_len, w.k_start, w.k_len), (cu_q[b], lq, cu_k[b], lk));
        assert!(w.m0 < lq, "tile past its sequence");
        assert_eq!(w.h_kv, h / (heads_q / heads_kv));
        assert!(seen.insert((b, h, w.m0)), "tile ({b}, {h}, {}) twice", w.m0);
        // Keys seen by the tile's rows, brute force.
        let rows = w.m0..(w.m0 + BLOCK).min(lq);
        let visible = |q: u32, j: u32| j < lk && (!causal || j as i64 <= q as i64 + lk as i64 - lq as i64);
        let seen_keys = rows
            .clone()
            .map(|q| (0..lk).filter(|&j| visible(q, j)).count() as u32)
            .max()
            .unwrap();
        let want = if causal {
            // The last row sees a prefix of the keys; the count is its length.
            seen_keys.div_ceil(BLOCK)
        } else {
            lk.div_ceil(BLOCK)
        };
        assert_eq!(
            w.n_blocks, want,
            "n_blocks of {lens:?} causal={causal} tile ({b}, {h}, {})",
            w.m0
        );
        for n in 0..w.n_blocks {
            let hidden = rows
                .clone()
                .any(|q| (n * BLOCK..(n + 1) * BLOCK).any(|j| !visible(q, j)));
            assert!(
                !hidden || w.needs_mask(n),
                "block {n} of tile ({b}, {h}, {}) needs its mask",
                w.m0
            );
        }
        if causal {
            if let Some(&prev) = last_blocks.get(&(w.b, h)) {
                assert!(w.n_blocks <= prev, "causal blocks not longest first");
            }
            last_blocks.insert((w.b, h), w.n_blocks);
        }
    }
    let want: usize = lens.iter().map(|&(q, _)| q.div_ceil(BLOCK) as usize).sum::<usize>() * heads_q as usize;
    assert_eq!(seen.len(), want, "tiles visited");
}

#[test]
fn attention_tiles_are_visited_once_with_exact_key_blocks_and_masks() {
    for causal in [false, true] {
        check(&[(128, 128)], 1, 1, causal, false);
        check(&[(300, 300); 2], 4, 2, causal, false);
        check(&[(1000, 1000)], 4, 1, causal, false);
        check(&[(200, 517)], 2, 2, causal, false);
        check(&[(517, 200)], 2, 2, causal, false);
        check(&[(77, 129); 3], 8, 8, causal, false);
        check(&[(1, 700)], 2, 1, causal, false);
        check(&[(255, 383)], 2, 1, causal, false);
        check(
            &[(1, 1), (130, 257), (0, 5), (300, 300), (64, 0), (513, 200), (129, 129)],
            4,
            2,
            causal,
            true,
        );
        check(&[(1024, 1024); 4], 8, 2, causal, true);
    }
}

/// Ring attention's zigzag mask (`Mask::Zigzag`, one step: rank `r`'s queries against rank `s`'s
/// shard): each tile's key-block count and masks against a brute force over global positions,
/// and the sum over the ring's W steps of every query's visible keys equals its causal count
/// over the whole sequence (each key seen exactly once).
#[test]
fn zigzag_ring_steps_see_each_earlier_key_once() {
    use schedule::{work_in, Mask};
    for (world, s_local, batch, heads) in [(2u32, 256u32, 1u32, 2u32), (4, 250, 2, 1), (4, 128, 1, 3), (8, 2, 1, 1)] {
        let c = s_local / 2;
        let a = AttentionArgs {
            batch,
            heads_q: heads,
            heads_kv: 1,
            seqlen_q: s_local,
            seqlen_k: s_local,
            total_q: batch * s_local,
            m_blocks: s_local.div_ceil(BLOCK),
            causal: 1,
            ..Default::default()
        };
        let global = |rank: u32, i: u32| {
            if i < c {
                rank * c + i
            } else {
                (2 * world - 1 - rank) * c + i - c
            }
        };
        for r in 0..world {
            let mut seen_total = vec![0u32; s_local as usize];
            for step in 0..world {
                let src = (r + world - step) % world;
                let mask = Mask::Zigzag {
                    chunk: c,
                    q: [r, 2 * world - 1 - r],
                    k: [src, 2 * world - 1 - src],
                };
                for t in 0..total::<true>(&a) {
                    let w = unsafe { work_in::<true>(&a, t, Some(mask)) }.expect("batched tiles exist");
                    let rows = w.m0..(w.m0 + BLOCK).min(s_local);
                    let sees = |q: u32, j: u32| global(src, j) <= global(r, q);
                    for q in rows.clone() {
                        let n = (0..s_local).filter(|&j| sees(q, j)).count() as i32;
                        assert_eq!(w.visible(q as i32), n, "W {world} rank {r} step {step} row {q}");
                        // The keys seen are a prefix.
                        assert!((0..n as u32).all(|j| sees(q, j)));
                        if w.b == 0 && w.h == 0 {
                            seen_total[q as usize] += n as u32;
                        }
                    }
                    let last = rows.clone().last().unwrap();
                    assert_eq!(w.n_blocks, (w.visible(last as i32) as u32).div_ceil(BLOCK));
                    for n in 0..w.n_blocks {
                        let hidden = rows
                            .clone()
                            .any(|q| (n * BLOCK..((n + 1) * BLOCK).min(s_local)).any(|j| !sees(q, j)));
                        assert!(!hidden || w.needs_mask(n), "W {world} rank {r} step {step} block {n}");
                    }
                }
            }
            for (q, &n) in seen_total.iter().enumerate() {
                assert_eq!(
                    n,
                    global(r, q as u32) + 1,
                    "W {world} rank {r} row {q}: keys over the ring"
                );
            }
        }
    }
}
