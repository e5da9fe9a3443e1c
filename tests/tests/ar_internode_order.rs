//! CPU simulation of GEMM+AllReduce across nodes (`mk_gemm_rs_bf16_nk`, `all_reduce = 1`,
//! `n_comm = 0`): what `scheduler_order.rs` leaves out. Every actor of one launch on every rank:
//! - consumers: each CTA walks `TileScheduler::chunked`, announcing with the kernel's rule
//!   (`publish`: the tile two back; before an own tile also the previous one if it is awaited in
//!   the loop). Peer tile -> `(Outbox, dest, mt)`; own tile of a remote node's block ->
//!   `NodeSum[j]`; own tile of the own node's block (AllReduce) -> `(Outbox, rank, mt)` AND
//!   `NodeSum[nodes - 1]`. An own tile waits for every local peer's `Tile1` of its row and, in the
//!   own node's block, for the aux barrier (warp 3 saw every other node's `FusedData`). After the
//!   loop: the AllReduce completion wait (`Tile2` of rows idx, idx + grid, ... of the own node's
//!   block from every local peer).
//! - relays (one per compute CTA): the kernel's walk (`relay_role`), *including* the own
//!   AllReduce row tiles of part g - 1 after the peers' row tiles of part g, dealt round-robin.
//! - senders (warp 1 of compute CTA j): block j < nodes - 1 -> `FusedData` at the rail peer of node
//!   (node + 1 + j) % nodes; block nodes - 1 -> `FusedOut` at every remote rank.
//! - receiver (warp 3 of compute CTA 0): every other node's `FusedData` (then the aux barrier
//!   opens), then every remote rank's `FusedOut`.
//!
//! The proxy delivers every PUT (its completion is not what is modelled). True when every actor
//! of every rank finishes.
// The models index several per-CTA and per-rank arrays by the same loop variable.
#![allow(clippy::needless_range_loop)]
#[allow(dead_code)]
#[path = "../../crates/device/src/gemm/scheduler.rs"]
mod scheduler;
use scheduler::TileScheduler;

struct Cta {
    tiles: Vec<(u32, u32)>,
    next: usize,
    older: Option<u32>,
    newer: Option<u32>,
    /// Completion-wait rows still to see (after the loop).
    tail: Vec<usize>,
    loop_done: bool,
}

/// `relay_role`'s walk for one rank: (dest, mt); dest == rank: an own AllReduce row tile.
fn relay_walk(world: usize, rank: usize, row_tiles: usize, part: usize, own_from: usize) -> Vec<(usize, usize)> {
    let parts = row_tiles / part;
    let mut v = vec![];
    for g in 0..=parts {
        if g < parts && world > 1 {
            for off in 0..(world - 1) * part {
                v.push(((rank + 1 + off / part) % world, g * part + off % part));
            }
        }
        if g >= 1 {
            let own_first = ((g - 1) * part).max(own_from);
            for mt in own_first..(g * part).max(own_first) {
                v.push((rank, mt));
            }
        }
    }
    v
}

fn simulate_ar(
    nodes: usize,
    world: usize,
    grid: usize,
    block_row_tiles: usize,
    n: u32,
    parts: &[usize],
) -> Result<(), String> {
    simulate_ar_rule(nodes, world, grid, block_row_tiles, n, parts, true)
}

/// `flush_awaited`: the kernel's rule (false: always two tiles late, also before an own tile's
/// wait - the negative control).
#[allow(clippy::too_many_arguments)]
fn simulate_ar_rule(
    nodes: usize,
    world: usize,
    grid: usize,
    block_row_tiles: usize,
    n: u32,
    parts: &[usize],
    flush_awaited: bool,
) -> Result<(), String> {
    let (nn, w) = (nodes, world);
    let gw = nn * w;
    let m = (gw * block_row_tiles * 128) as u32;
    let chunk_rows = m / w as u32;
    let block_rows = chunk_rows / nn as u32;
    let row_tiles = (chunk_rows / 128) as usize;
    let tiles_n = n.div_ceil(256);
    let block_tiles = block_row_tiles as u32 * tiles_n;
    let own_from = (nn - 1) * block_row_tiles;
    let split = |m0: u32| {
        (
            (m0 / chunk_rows) as usize,
            ((m0 % chunk_rows) / 128) as usize,
            ((m0 % chunk_rows) / block_rows) as usize,
        )
    };
    // Per global rank g = nd * w + r.
    let mut tile1 = vec![vec![vec![0u32; row_tiles]; w]; gw]; // [g][src local][mt]
    let mut tile2 = vec![vec![vec![0u32; row_tiles]; w]; gw];
    let mut outbox = vec![vec![vec![0u32; row_tiles]; w]; gw]; // [g][dest local][mt]
    let mut node_sum = vec![vec![0u32; nn]; gw];
    let mut fused_data = vec![vec![false; gw]; gw]; // [receiver][sender]
    let mut fused_out = vec![vec![false; gw]; gw];
    let mut sums_in = vec![false; gw]; // warp 3 of CTA 0 passed FusedData: aux barrier open
    let mut recv_done = vec![false; gw];
    let mut sent = vec![vec![false; nn]; gw];
    let walks: Vec<Vec<(usize, usize)>> = (0..gw)
        .map(|g| relay_walk(w, g % w, row_tiles, block_row_tiles / parts[g], own_from))
        .collect();
    let relays_run = w > 1;
    let mut heads = vec![vec![0usize; grid]; gw];
    let mut ctas: Vec<Vec<Cta>> = (0..gw)
        .map(|g| {
            let (r, part) = (g % w, block_row_tiles / parts[g]);
            (0..grid)
                .map(|c| Cta {
                    tiles: TileScheduler::new(m, n, 128, 256, 8, c as u32, grid as u32)
                        .chunked(w as u32, r as u32, part as u32)
                        .map(|t| (t.m0, t.n0))
                        .collect(),
                    next: 0,
                    older: None,
                    newer: None,
                    tail: if w > 1 {
                        (own_from + c..row_tiles).step_by(grid).collect()
                    } else {
                        vec![]
                    },
                    loop_done: false,
                })
                .collect()
        })
        .collect();
    loop {
        let mut progress = false;
        let mut done = true;
        for g in 0..gw {
            let (nd, r) = (g / w, g % w);
            // Relays.
            if relays_run {
                for k in 0..grid {
                    loop {
                        let i = k + heads[g][k] * grid;
                        let Some(&(dest, mt)) = walks[g].get(i) else { break };
                        if outbox[g][dest][mt] < tiles_n {
                            done = false;
                            break;
                        }
                        if dest != r {
                            tile1[nd * w + dest][r][mt] = tiles_n;
                        } else {
                            for q in (0..w).filter(|&q| q != r) {
                                tile2[nd * w + q][r][mt] = tiles_n;
                            }
                        }
                        heads[g][k] += 1;
                        progress = true;
                    }
                }
            }
            // Senders (warp 1 of compute CTA j).
            for j in 0..nn {
                if nn == 1 || sent[g][j] {
                    continue;
                }
                if node_sum[g][j] < block_tiles {
                    done = false;
                    continue;
                }
                if j + 1 < nn {
                    fused_data[((nd + 1 + j) % nn) * w + r][g] = true;
                } else {
                    for q in (0..gw).filter(|q| q / w != nd) {
                        fused_out[q][g] = true;
                    }
                }
                sent[g][j] = true;
                progress = true;
            }
            // Receiver (warp 3 of compute CTA 0).
            if nn > 1 && !recv_done[g] {
                if !sums_in[g] && (0..nn).filter(|&o| o != nd).all(|o| fused_data[g][o * w + r]) {
                    sums_in[g] = true;
                    progress = true;
                }
                if sums_in[g] && (0..gw).filter(|q| q / w != nd).all(|q| fused_out[g][q]) {
                    recv_done[g] = true;
                    progress = true;
                } else {
                    done = false;
                }
            }
            // Consumers.
            for c in 0..grid {
                let cta = &mut ctas[g][c];
                if cta.loop_done {
                    // The AllReduce completion wait.
                    while let Some(&mt) = cta.tail.first() {
                        if (0..w).all(|q| q == r || tile2[g][q][mt] >= tiles_n) {
                            cta.tail.remove(0);
                            progress = true;
                        } else {
                            break;
                        }
                    }
                    if !cta.tail.is_empty() {
                        done = false;
                    }
                    continue;
                }
                done = false;
                let announce = |m0: u32, outbox: &mut Vec<Vec<Vec<u32>>>, node_sum: &mut Vec<Vec<u32>>| {
                    let (dest, mt, j) = split(m0);
                    if dest != r {
                        outbox[g][dest][mt] += 1;
                        return;
                    }
                    if j + 1 == nn && w > 1 {
                        outbox[g][r][mt] += 1;
                    }
                    if nn > 1 {
                        node_sum[g][j] += 1;
                    }
                };
                let next = cta.tiles.get(cta.next).copied();
                if let Some(m0) = cta.older.take() {
                    announce(m0, &mut outbox, &mut node_sum);
                    progress = true;
                }
                let own_next = next.is_some_and(|(m0, _)| split(m0).0 == r);
                if let Some(m0) = cta.newer {
                    let (dest, _, j) = split(m0);
                    let awaited = dest != r || j + 1 < nn;
                    if next.is_none() || (flush_awaited && own_next && awaited) {
                        announce(m0, &mut outbox, &mut node_sum);
                        cta.newer = None;
                        progress = true;
                    }
                }
                let Some((m0, _)) = next else {
                    cta.loop_done = true;
                    progress = true;
                    continue;
                };
                let (dest, mt, j) = split(m0);
                if dest == r {
                    let peers = (0..w).all(|q| q == r || tile1[g][q][mt] >= tiles_n);
                    let sums = j + 1 < nn || nn == 1 || sums_in[g];
                    if !(peers && sums) {
                        continue;
                    }
                }
                cta.older = cta.newer.take();
                cta.newer = Some(m0);
                cta.next += 1;
                progress = true;
            }
        }
        if done {
            return Ok(());
        }
        if !progress {
            // Describe the stuck state.
            let mut s = String::new();
            for g in 0..gw {
                let stuck_relays = (0..grid)
                    .filter(|&k| walks[g].get(k + heads[g][k] * grid).is_some())
                    .count();
                let stuck_ctas = ctas[g].iter().filter(|c| !c.loop_done || !c.tail.is_empty()).count();
                s += &format!(
                    "rank {g}: {stuck_ctas} CTAs, {stuck_relays} relays stuck, sent {:?}, sums_in {}, recv_done {}; ",
                    sent[g], sums_in[g], recv_done[g]
                );
            }
            return Err(s);
        }
    }
}

#[test]
fn allreduce_across_nodes_cannot_deadlock() {
    let mut cases = 0;
    for nodes in [2usize, 3] {
        for world in [1usize, 2, 4] {
            for grid in [1usize, 3, 7, 132] {
                for block_row_tiles in [1usize, 2, 4, 8] {
                    for n in [256u32, 1000, 8192] {
                        let divisors: Vec<usize> = (1..=block_row_tiles).filter(|d| block_row_tiles % d == 0).collect();
                        for &p in &divisors {
                            for &q in &[p, *divisors.last().unwrap()] {
                                let mut parts = vec![p; nodes * world];
                                parts[0] = q;
                                cases += 1;
                                if let Err(e) = simulate_ar(nodes, world, grid, block_row_tiles, n, &parts) {
                                    panic!("deadlock: {nodes} nodes x {world}, grid {grid}, block row tiles {block_row_tiles}, n {n}, parts {parts:?}: {e}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(cases > 500, "{cases}");
}

/// The failing run's shapes: 2 nodes x 2 GPUs, 132 compute CTAs, N = 8192 (32 column tiles),
/// M = 2048 / 4096 / 8192 (4 / 8 / 16 row tiles per node block), parts 1 and 2 (and more).
#[test]
fn allreduce_2x2_bench_shapes_cannot_deadlock() {
    for block_row_tiles in [4usize, 8, 16, 32, 64] {
        for parts in [1usize, 2, 4] {
            if block_row_tiles % parts != 0 {
                continue;
            }
            for grid in [132usize, 131, 128] {
                let r = simulate_ar(2, 2, grid, block_row_tiles, 8192, &[parts; 4]);
                assert!(
                    r.is_ok(),
                    "M = {}: parts {parts} grid {grid}: {}",
                    block_row_tiles * 128 * 4,
                    r.unwrap_err()
                );
            }
        }
    }
}

/// The walk puts every own AllReduce row tile of part g - 1 after every peer row tile of part g
/// (the order the tiles complete), as `relay_role` documents.
#[test]
fn relay_walk_own_items_follow_the_next_parts_peer_items() {
    for (nodes, world, brt, parts) in [
        (2usize, 2usize, 16usize, 1usize),
        (2, 2, 16, 2),
        (3, 2, 4, 2),
        (2, 4, 8, 4),
    ] {
        let (row_tiles, part) = (nodes * brt, brt / parts);
        let own_from = (nodes - 1) * brt;
        for rank in 0..world {
            let w = relay_walk(world, rank, row_tiles, part, own_from);
            assert_eq!(
                w.len(),
                (world - 1) * row_tiles + brt,
                "every peer row tile once, every own row tile of the own block once"
            );
            for (i, &(d, mt)) in w.iter().enumerate() {
                if d == rank {
                    let g = mt / part + 1;
                    let last_peer_of_g = w.iter().rposition(|&(d2, t)| d2 != rank && t / part == g);
                    assert!(
                        last_peer_of_g.is_none_or(|p| p < i),
                        "{nodes}x{world} rank {rank}: own mt {mt} before the peers of part {g}"
                    );
                }
            }
        }
    }
}

/// The simulation can fail: announcing always two tiles late (no flush before an own tile's
/// wait) deadlocks some small AllReduce configurations across nodes.
#[test]
fn always_two_late_deadlocks_somewhere() {
    let mut deadlocks = 0;
    for (nodes, world) in [(2usize, 1usize), (2, 2), (3, 2)] {
        for grid in [1usize, 3, 7, 132] {
            for brt in [1usize, 2, 4] {
                assert!(simulate_ar_rule(nodes, world, grid, brt, 1000, &vec![1; nodes * world], true).is_ok());
                if simulate_ar_rule(nodes, world, grid, brt, 1000, &vec![1; nodes * world], false).is_err() {
                    deadlocks += 1;
                }
            }
        }
    }
    println!("always two tiles late: {deadlocks} of 36 configurations deadlock");
    assert!(deadlocks > 0);
}
