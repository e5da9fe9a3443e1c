//! CPU checks of the device's tile scheduler (its source compiled for the host): the chunked
//! order of GEMM+ReduceScatter/AllReduce visits every tile once, and every own tile comes after
//! every peer computed that tile (the epilogue that adds the peers' partials can never wait for
//! a tile that is scheduled later), and the counter protocol cannot deadlock in that order (while
//! the order "wait, then announce the previous tile" can: the test shows the simulation fails).
// The models index several per-CTA and per-rank arrays by the same loop variable.
#![allow(clippy::needless_range_loop)]
#[allow(dead_code)]
#[path = "../../crates/device/src/gemm/scheduler.rs"]
mod scheduler;
use scheduler::TileScheduler;

/// Linear position of each tile (by (m0, n0)) in rank `rank`'s order on a grid of `grid` CTAs.
fn order(
    m: u32,
    n: u32,
    world: u32,
    rank: u32,
    part_tiles_m: u32,
    grid: u32,
) -> std::collections::HashMap<(u32, u32), u32> {
    let s = TileScheduler::new(m, n, 128, 256, 8, 0, grid).chunked(world, rank, part_tiles_m);
    let mut pos = std::collections::HashMap::new();
    for i in 0..s.total() {
        let t = s.tile(i);
        assert!(
            pos.insert((t.m0, t.n0), i).is_none(),
            "tile ({}, {}) visited twice",
            t.m0,
            t.n0
        );
    }
    pos
}

#[test]
fn chunked_order_is_a_permutation_with_own_tiles_after_the_peers() {
    let cases = [
        (2u32, 2048u32, 1024u32, 1u32),
        (2, 2048, 1000, 2),
        (4, 4096, 2048, 2),
        (4, 4096, 512, 4),
        (8, 8192, 768, 2),
        (4, 2048, 256, 1),
        (2, 16384, 8192, 4),
        (4, 16384, 8192, 2),
    ];
    for ((world, m, n, parts), grid) in cases.iter().flat_map(|&c| [1u32, 7, 132].map(move |g| (c, g))) {
        let chunk_tiles = m / 128 / world;
        let pm = chunk_tiles / parts;
        let orders: Vec<_> = (0..world).map(|r| order(m, n, world, r, pm, grid)).collect();
        let tiles = (m / 128) * n.div_ceil(256);
        for (r, o) in orders.iter().enumerate() {
            assert_eq!(o.len() as u32, tiles, "world {world} rank {r}: every tile once");
            // Own tiles are shared fairly among the CTAs (CTA c takes positions c, c + grid, ...).
            let mut own_per_cta = vec![0u32; grid as usize];
            for (&(m0, _), &p) in o {
                if m0 / 128 / chunk_tiles == r as u32 {
                    own_per_cta[(p % grid) as usize] += 1;
                }
            }
            let (lo, hi) = (own_per_cta.iter().min().unwrap(), own_per_cta.iter().max().unwrap());
            assert!(
                hi - lo <= parts + 1,
                "world {world} parts {parts} grid {grid}: own tiles per CTA from {lo} to {hi}"
            );
            for (&(m0, n0), &p) in o {
                let owner = m0 / 128 / chunk_tiles;
                if owner != r as u32 {
                    continue;
                }
                // An own tile: every peer reached the same tile earlier in its order, with at
                // least one tile of slack.
                for (q, oq) in orders.iter().enumerate() {
                    if q != r {
                        assert!(oq[&(m0, n0)] < p, "world {world} parts {parts}: rank {r}'s own tile ({m0}, {n0}) at {p}, rank {q} computes it at {}", oq[&(m0, n0)]);
                    }
                }
            }
        }
    }
}

#[test]
fn node_major_order_visits_every_tile_own_node_first() {
    for &(nodes, local, m, n) in &[
        (1u32, 2u32, 2048u32, 512u32),
        (2, 1, 1024, 256),
        (2, 2, 4096, 1000),
        (4, 2, 8192, 256),
    ] {
        let world = nodes * local;
        let shard_tiles = m / 128 / world;
        for g in 0..world {
            let (node, lr) = (g / local, g % local);
            let s = TileScheduler::new(m, n, 128, 256, 8, 0, 1).node_major(nodes, node, lr * shard_tiles);
            let tiles: Vec<_> = s.collect();
            let mut seen = std::collections::HashSet::new();
            assert!(tiles.iter().all(|t| seen.insert((t.m0, t.n0))), "a tile twice");
            assert_eq!(tiles.len() as u32, (m / 128) * n.div_ceil(256));
            // The first tiles are this rank's own shard; then the own node's rows come before
            // any other node's.
            assert_eq!(
                tiles[0].m0 / 128 / shard_tiles,
                g,
                "nodes {nodes} x {local}: rank {g} starts with its shard"
            );
            let node_of = |t: &scheduler::Tile| t.m0 / 128 / shard_tiles / local;
            let last_own_node = tiles.iter().rposition(|t| node_of(t) == node).unwrap();
            let first_other = tiles.iter().position(|t| node_of(t) != node).unwrap_or(tiles.len());
            assert!(
                nodes == 1 || last_own_node < first_other,
                "nodes {nodes} x {local}: rank {g} visits another node's rows before its own node's"
            );
        }
    }
}

/// One rank's CTA in the GEMM+ReduceScatter simulation below.
struct SimCta {
    tiles: Vec<(u32, u32)>,
    next: usize,
    /// Tiles not yet announced: the one before the previous (`older`) and the previous one.
    older: Option<(u32, u32)>,
    newer: Option<(u32, u32)>,
}

/// Runs the counter protocol of GEMM+ReduceScatter/AllReduce step by step: every CTA of every
/// rank walks its tiles in the chunked order; a tile is announced two tiles late, except that an
/// own tile (which waits) first announces the previous one if another rank waits for it during
/// the loop (a peer partial or a node sum: the kernel's rule); an own tile waits until every
/// peer's counter of its row is full. How a peer partial reaches the peer's counter: see
/// [`Carry`]. True when every CTA finishes (no wait cycle), false on a deadlock. One node of
/// [`simulate_nodes`].
fn simulate(world: u32, grid: u32, m: u32, n: u32, parts: &[u32], carry: Carry) -> bool {
    simulate_nodes(1, world, grid, m, n, parts, carry)
}

/// Who raises a peer's counter of a partial row tile, in [`simulate_protocol`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Carry {
    /// The computing CTA's own announcement (the kernel before the relays).
    Direct,
    /// The partial counts in the own outbox; the rank's comm CTAs (together: one queue) raise
    /// the peer's counter row tile by row tile in the kernel's order (per part, the peers' row
    /// tiles, chunk `rank + 1` first), once the row is complete.
    CommCtas,
    /// As `CommCtas`, but that queue is dealt round-robin to one relay per CTA (`relay_role`),
    /// each taking its items in order.
    Relays,
}

const CARRIES: [Carry; 3] = [Carry::Direct, Carry::CommCtas, Carry::Relays];

#[test]
fn the_counter_protocol_cannot_deadlock_in_the_chunked_order() {
    let mut cases = 0;
    for carry in CARRIES {
        for world in [2u32, 3, 4, 8] {
            for grid in [1u32, 3, 7, 33, 132] {
                for row_tiles in [1u32, 2, 4, 6, 16] {
                    for n in [256u32, 1000, 8192] {
                        let divisors: Vec<u32> = (1..=row_tiles).filter(|d| row_tiles % d == 0).collect();
                        for &p in &divisors {
                            // Every rank with `p` parts, and rank 0 with another count (plans may differ).
                            for &q in &[p, *divisors.last().unwrap()] {
                                let mut parts = vec![p; world as usize];
                                parts[0] = q;
                                cases += 1;
                                assert!(simulate(world, grid, world * row_tiles * 128, n, &parts, carry), "deadlock: {carry:?} world {world} grid {grid} row tiles {row_tiles} n {n} parts {parts:?}");
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(cases > 3000);
}

/// The same simulation across `nodes` nodes of `world` ranks each: rows are node-blocked
/// (`rs_source_row`; the scheduler works in those rows, so only the dependencies change). An own
/// tile of another node's block counts towards that block's `NodeSum` (its PUT leaves once the
/// block is complete); an own tile of the own node's block also waits, in its epilogue after
/// the announcements, until every other node's rail peer completed its block of our rows. True
/// when every CTA finishes.
fn simulate_nodes(nodes: u32, world: u32, grid: u32, m: u32, n: u32, parts: &[u32], carry: Carry) -> bool {
    simulate_protocol(nodes, world, grid, m, n, parts, carry, Rule::Kernel)
}

/// When a CTA announces its tiles, in [`simulate_protocol`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// The kernel's: at each epilogue the tile two back; before an own tile's wait also the
    /// previous one if another rank waits for it during the loop.
    Kernel,
    /// Wait for the next own tile's inputs *before* announcing anything (a wait there, before
    /// the earlier tiles are announced, can close a cycle between ranks).
    WaitFirst,
    /// Always two tiles late, also before a wait.
    NoFlush,
    /// With stagers (`stager_role`): every tile is announced once its stores complete, before
    /// the stager waits for a later own tile's partial - here: as soon as it is computed.
    Stager,
}

#[allow(clippy::too_many_arguments)]
fn simulate_protocol(
    nodes: u32,
    world: u32,
    grid: u32,
    m: u32,
    n: u32,
    parts: &[u32],
    carry: Carry,
    rule: Rule,
) -> bool {
    let all = vec![grid; (nodes * world) as usize];
    simulate_grids(nodes, world, &all, &all, m, n, parts, carry, rule).0
}

/// Counters `[node][dest][src][row tile]` at the end of a [`simulate_grids`] run.
type Counters = Vec<Vec<Vec<Vec<u32>>>>;

/// [`simulate_protocol`] with a grid per rank (`grids[global rank]`: ranks sharing a GPU under
/// MPS see different SM counts, so their grids differ), of which only CTAs
/// `0..running[global rank]` ever run (the others never got an SM: they compute nothing, and
/// with [`Carry::Relays`] their relays carry nothing). Returns whether every CTA finished, and
/// the tile counters at the end.
#[allow(clippy::too_many_arguments)]
fn simulate_grids(
    nodes: u32,
    world: u32,
    grids: &[u32],
    running: &[u32],
    m: u32,
    n: u32,
    parts: &[u32],
    carry: Carry,
    rule: Rule,
) -> (bool, Counters) {
    let chunk_rows = m / world;
    let block_rows = chunk_rows / nodes;
    let row_tiles = (chunk_rows / 128) as usize;
    let tiles_n = n.div_ceil(256);
    let block_tiles = block_rows / 128 * tiles_n;
    let (w, nn) = (world as usize, nodes as usize);
    // counters[node][dest][src][row tile]; outbox[node][src][dest][row tile];
    // node_sums[node][rank][block]
    let mut counters = vec![vec![vec![vec![0u32; row_tiles]; w]; w]; nn];
    let mut outbox = vec![vec![vec![vec![0u32; row_tiles]; w]; w]; nn];
    let mut node_sums = vec![vec![vec![0u32; nn]; w]; nn];
    // Each rank's carry queue: (dest, row tile) in the comm CTAs' order; dealt to `carriers`
    // in-order takers (item i to taker i mod carriers), and how far each got.
    let queues: Vec<Vec<Vec<(usize, usize)>>> = (0..nn)
        .map(|nd| {
            (0..w)
                .map(|r| {
                    let part = (block_rows / 128 / parts[nd * w + r]) as usize;
                    let mut q = vec![];
                    for g in 0..row_tiles / part {
                        for s in 1..w {
                            for mt in g * part..(g + 1) * part {
                                q.push(((r + s) % w, mt));
                            }
                        }
                    }
                    q
                })
                .collect()
        })
        .collect();
    let carriers = |nd: usize, r: usize| {
        if carry == Carry::Relays {
            grids[nd * w + r] as usize
        } else {
            1
        }
    };
    let mut heads: Vec<Vec<Vec<usize>>> = (0..nn)
        .map(|nd| (0..w).map(|r| vec![0usize; carriers(nd, r)]).collect())
        .collect();
    let mut ctas: Vec<Vec<Vec<SimCta>>> = (0..nodes)
        .map(|nd| {
            (0..world)
                .map(|r| {
                    let p = parts[(nd * world + r) as usize];
                    let grid = grids[(nd * world + r) as usize];
                    (0..grid)
                        .map(|c| {
                            let s =
                                TileScheduler::new(m, n, 128, 256, 8, c, grid).chunked(world, r, block_rows / 128 / p);
                            SimCta {
                                tiles: s.map(|t| (t.m0, t.n0)).collect(),
                                next: 0,
                                older: None,
                                newer: None,
                            }
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let split = |m0: u32| {
        (
            m0 / chunk_rows,
            ((m0 % chunk_rows) / 128) as usize,
            (m0 % chunk_rows) / block_rows,
        )
    };
    // Another rank waits for this tile's announcement during its loop.
    let awaited = |r: usize, m0: u32| {
        let (dest, _, j) = split(m0);
        dest as usize != r || j + 1 < nodes
    };
    loop {
        let (mut progress, mut done) = (false, true);
        for nd in 0..nn {
            for r in 0..w {
                let (carriers, runs) = (carriers(nd, r), running[nd * w + r] as usize);
                // Each taker carries every completed row tile at the head of its queue (a relay
                // only if its CTA runs).
                for k in 0..carriers {
                    if carry == Carry::Relays && k >= runs {
                        continue;
                    }
                    loop {
                        let i = k + heads[nd][r][k] * carriers;
                        if carry == Carry::Direct || i >= queues[nd][r].len() {
                            break;
                        }
                        let (dest, mt) = queues[nd][r][i];
                        if outbox[nd][r][dest][mt] < tiles_n {
                            break;
                        }
                        counters[nd][dest][r][mt] = tiles_n;
                        heads[nd][r][k] += 1;
                        progress = true;
                    }
                }
                for c in 0..ctas[nd][r].len() {
                    if c >= runs {
                        // Never started: its tiles stay undone.
                        done &= ctas[nd][r][c].tiles.is_empty();
                        continue;
                    }
                    // Whether the next tile (an own one) still waits for its inputs.
                    let blocked = |cta: &SimCta, counters: &[Vec<Vec<Vec<u32>>>], node_sums: &[Vec<Vec<u32>>]| {
                        let Some(&(m0, _)) = cta.tiles.get(cta.next) else {
                            return false;
                        };
                        let (dest, mt, j) = split(m0);
                        if dest as usize != r {
                            return false;
                        }
                        // The own node's block also needs every other node's rail peer to have
                        // finished its block for this node (block (nd - other - 1) mod nodes there).
                        let sums_in = |o: usize| node_sums[o][r][(nd + nn - o - 1) % nn] >= block_tiles;
                        !(0..w).all(|p| p == r || counters[nd][r][p][mt] >= tiles_n)
                            || (j + 1 == nodes && !(0..nn).all(|o| o == nd || sums_in(o)))
                    };
                    if rule == Rule::WaitFirst && blocked(&ctas[nd][r][c], &counters, &node_sums) {
                        done = false;
                        continue;
                    }
                    let mut announce = |m0: u32| {
                        let (dest, mt, j) = split(m0);
                        if dest as usize != r {
                            if carry != Carry::Direct {
                                outbox[nd][r][dest as usize][mt] += 1;
                            } else {
                                counters[nd][dest as usize][r][mt] += 1;
                            }
                        } else if j + 1 < nodes {
                            node_sums[nd][r][j as usize] += 1;
                        }
                    };
                    let cta = &mut ctas[nd][r][c];
                    let next = cta.tiles.get(cta.next).copied();
                    // The next tile's epilogue: the tile two back; before an own tile, also the
                    // previous one if awaited; at the end, both.
                    if let Some((m0, _)) = cta.older.take() {
                        announce(m0);
                        progress = true;
                    }
                    let own_next = next.is_some_and(|(m0, _)| split(m0).0 as usize == r);
                    if let Some((m0, _)) = cta.newer {
                        if next.is_none()
                            || rule == Rule::Stager
                            || (rule == Rule::Kernel && own_next && awaited(r, m0))
                        {
                            announce(m0);
                            cta.newer = None;
                            progress = true;
                        }
                    }
                    if blocked(&ctas[nd][r][c], &counters, &node_sums) {
                        done = false;
                        continue;
                    }
                    let cta = &mut ctas[nd][r][c];
                    let Some(&(m0, n0)) = cta.tiles.get(cta.next) else {
                        continue;
                    };
                    done = false;
                    cta.older = cta.newer.take();
                    cta.newer = Some((m0, n0));
                    cta.next += 1;
                    progress = true;
                }
            }
        }
        if done {
            return (true, counters);
        }
        if !progress {
            return (false, counters);
        }
    }
}

#[test]
fn the_counter_protocol_cannot_deadlock_across_nodes() {
    let mut cases = 0;
    for nodes in [2u32, 3] {
        for world in [1u32, 2, 4] {
            for grid in [1u32, 3, 7, 132] {
                for block_tiles in [1u32, 2, 4] {
                    for n in [256u32, 1000] {
                        let divisors: Vec<u32> = (1..=block_tiles).filter(|d| block_tiles % d == 0).collect();
                        for &p in &divisors {
                            for &q in &[p, *divisors.last().unwrap()] {
                                let mut parts = vec![p; (nodes * world) as usize];
                                parts[0] = q;
                                cases += 1;
                                let m = nodes * world * block_tiles * 128;
                                for carry in CARRIES {
                                    assert!(simulate_nodes(nodes, world, grid, m, n, &parts, carry), "deadlock: {carry:?} {nodes} nodes x {world} grid {grid} block tiles {block_tiles} n {n} parts {parts:?}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(cases > 200);
}

#[test]
fn the_stager_order_cannot_deadlock() {
    // One node (stagers run on one node of 2 ranks; simulated for more ranks too), the relays
    // carrying the partials.
    let mut cases = 0;
    for world in [2u32, 3, 4] {
        for grid in [1u32, 3, 7, 33, 132] {
            for row_tiles in [1u32, 2, 4, 6, 16] {
                for n in [256u32, 1000] {
                    let divisors: Vec<u32> = (1..=row_tiles).filter(|d| row_tiles % d == 0).collect();
                    for &p in &divisors {
                        let parts = vec![p; world as usize];
                        cases += 1;
                        assert!(simulate_protocol(1, world, grid, world * row_tiles * 128, n, &parts, Carry::Relays, Rule::Stager), "deadlock with stagers: world {world} grid {grid} row tiles {row_tiles} n {n} parts {parts:?}");
                    }
                }
            }
        }
    }
    assert!(cases > 300);
}

#[test]
fn other_announcement_orders_can_deadlock() {
    // The simulation can fail: with the wait moved before the announcements, or with every
    // announcement two tiles late even before a wait, some small configurations deadlock, while
    // the kernel's rule passes them all.
    for rule in [Rule::WaitFirst, Rule::NoFlush] {
        let mut deadlocks = 0;
        for (nodes, world) in [(1u32, 2u32), (1, 4), (2, 1), (2, 2)] {
            for grid in [1u32, 3, 7, 132] {
                for block_tiles in [1u32, 2, 4] {
                    let m = nodes * world * block_tiles * 128;
                    let parts = vec![1; (nodes * world) as usize];
                    assert!(
                        simulate_protocol(nodes, world, grid, m, 1000, &parts, Carry::Direct, Rule::Kernel),
                        "the kernel's order deadlocked"
                    );
                    if !simulate_protocol(nodes, world, grid, m, 1000, &parts, Carry::Direct, rule) {
                        deadlocks += 1;
                    }
                }
            }
        }
        let name = if rule == Rule::WaitFirst {
            "wait before announcing"
        } else {
            "always two tiles late"
        };
        assert!(deadlocks > 0, "no configuration deadlocked with {name}");
        println!("{name}: {deadlocks} of 48 configurations deadlock");
    }
}

/// The shapes of `tests/tests/abort_queued_gemm_rs.rs` and `tests/tests/abort.rs` on ranks
/// sharing one GPU through MPS: M = 2048 x world, N = 2048, one part (16 row tiles per chunk),
/// relays carrying the partials, and per-rank grids of 80% of MPS shares that the driver reports
/// as 32 or 33 SMs (25 or 26 CTAs), also 52/53 at 2 ranks.
fn shared_gpu_cases() -> Vec<(u32, Vec<u32>)> {
    vec![
        (4, vec![25, 25, 25, 25]),
        (4, vec![25, 26, 25, 26]),
        (4, vec![26, 25, 25, 25]),
        (4, vec![26, 26, 26, 25]),
        (2, vec![52, 52]),
        (2, vec![52, 53]),
    ]
}

#[test]
fn grids_that_differ_between_ranks_cannot_deadlock() {
    for (world, grids) in shared_gpu_cases() {
        let m = 2048 * world;
        for parts in [1u32, 2, 4] {
            let parts = vec![parts; world as usize];
            for carry in CARRIES {
                let (finished, _) = simulate_grids(1, world, &grids, &grids, m, 2048, &parts, carry, Rule::Kernel);
                assert!(
                    finished,
                    "deadlock: {carry:?} world {world} grids {grids:?} parts {parts:?}"
                );
            }
        }
    }
}

#[test]
fn a_rank_whose_ctas_did_not_all_start_stalls_every_peer() {
    // The protocol needs every CTA of every rank running at once: a rank of which only CTAs
    // 0..j started (the rest waiting for SMs, e.g. held by its peers' grids that wait for it)
    // never fills the counters of some of its peers' rows, and every peer's own tiles then wait
    // for it - the "Tile1 counter ... seen 0" of each peer, naming that rank - while the rank
    // itself finishes everything that does not wait for its missing CTAs.
    for (world, grids) in shared_gpu_cases() {
        let m = 2048 * world;
        let parts = vec![1; world as usize];
        for started in [1u32, 8, 16, grids[0] - 1] {
            let mut running = grids.clone();
            running[0] = started;
            let (finished, counters) =
                simulate_grids(1, world, &grids, &running, m, 2048, &parts, Carry::Relays, Rule::Kernel);
            assert!(
                !finished,
                "world {world} grids {grids:?}: rank 0 with {started} CTAs finished"
            );
            for d in 1..world as usize {
                assert!(
                    counters[0][d][0].contains(&0),
                    "world {world} grids {grids:?}, {started} CTAs: rank {d} got every row from rank 0"
                );
                // Each peer delivered all of its rows to rank 0 (8 column tiles each).
                assert!(
                    counters[0][0][d].iter().all(|&c| c == 8),
                    "rank {d} -> 0: {:?}",
                    counters[0][0][d]
                );
            }
        }
    }
}
