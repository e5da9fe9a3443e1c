//! The stream-K tail of a persistent tile loop: which CTA computes which K blocks of which tile.
//!
//! A persistent GEMM over `tiles` output tiles on `grid` CTAs runs `ceil(tiles / grid)` rounds;
//! when `tiles % grid` is small the last round leaves most SMs idle (1024 tiles on 132 SMs: 7.76
//! rounds of work take 8). Here the first `tiles - sk_tiles` tiles stay *data-parallel* (CTA `c`
//! takes tiles `c, c + grid, ...`, whole), and the K blocks of the last `sk_tiles` tiles are cut
//! into `grid` contiguous ranges of (almost) equal length, one per CTA ("units" are (tile,
//! K block) pairs, tile-major). A range covers the end of one tile and the start of the next,
//! or lies inside one tile. Each CTA walks its range from the top down, tile by tile:
//! - its first piece (the start of its highest tile) is a *contributor* piece unless it reaches
//!   that tile's end: the CTA writes its f32 accumulators to its workspace slot and raises its
//!   flag;
//! - every later piece reaches its tile's end: the CTA *owns* that tile, adds the partials of
//!   the contributors (CTAs `from..cta`, whose first pieces they were, so they are written long
//!   before) and runs the tile's epilogue.
//!
//! So every CTA has at most one contributor piece, it comes first, and an owner waits only for
//! CTAs of lower index, for their first pieces: the waits cannot form a cycle (checked on the
//! wait graph of many plans in the tests), and no owner waits long.
//! [`StreamK::choose`] picks `sk_tiles`; 0 is the plain data-parallel loop.

/// One CTA's stream-K plan (every CTA of a launch computes the same one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamK {
    /// Output tiles of the launch, and CTAs that compute them.
    pub tiles: u32,
    pub grid: u32,
    /// K blocks per tile.
    pub k_blocks: u32,
    /// Tiles at the end of the order split by K ranges (0: none; else `tiles - sk_tiles` is a
    /// multiple of `grid`).
    pub sk_tiles: u32,
}

/// One work item of a CTA: K blocks `k0..k1` of linear tile `tile`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    pub tile: u32,
    pub k0: u32,
    pub k1: u32,
    /// This CTA runs the tile's epilogue (it computed the tile's last K block).
    pub owner: bool,
    /// Owner only: the contributors are CTAs `from..cta` (none when `from == cta`).
    pub from: u32,
}

impl Work {
    #[inline(always)]
    pub const fn k_len(&self) -> u32 {
        self.k1 - self.k0
    }
}

impl StreamK {
    /// Fewest K blocks per tile worth splitting.
    pub const MIN_K_BLOCKS: u32 = 4;

    /// The stream-K tail for `tiles` tiles of `k_blocks` K blocks on `grid` CTAs: the last,
    /// partial round (`tiles % grid` tiles) when it is at most 2/3 full, joined by one full
    /// round when it is under half full (so each CTA gets at least half a tile of K: a tile
    /// has at most 3 contributors). None (0) when the rounds are whole, the tiles fewer than
    /// one round, K too short, the partial round small and alone, or over 2/3 full: a CTA's
    /// stream-K pieces cost more than a whole tile's (the contributor's 64 KiB write per
    /// warpgroup and its flag, the owner's wait and add, two pipeline refills), which outweighs
    /// the idle SMs of a nearly full last round (measurements: docs/fused.md).
    pub const fn choose(tiles: u32, grid: u32, k_blocks: u32) -> u32 {
        if grid == 0 || tiles < grid || k_blocks < Self::MIN_K_BLOCKS || !Self::fits_u32(grid, 2 * grid, k_blocks) {
            return 0;
        }
        let r = tiles % grid;
        if r == 0 || 3 * r > 2 * grid {
            0
        } else if 2 * r >= grid {
            r
        } else if tiles >= 2 * grid {
            r + grid
        } else {
            0
        }
    }

    /// Whether `grid x sk_tiles x k_blocks` (the largest product of the unit arithmetic, kept in
    /// u32 for the device) fits.
    #[inline(always)]
    const fn fits_u32(grid: u32, sk_tiles: u32, k_blocks: u32) -> bool {
        (grid as u64) * (sk_tiles as u64) * (k_blocks as u64) < (1u64 << 32)
    }

    /// The plan; an `sk_tiles` that breaks the rules (above) falls back to none.
    // (`grid > 0` is tested first, so the plain `%` is safe and `is_multiple_of`'s zero test
    // would only add a branch to the device code.)
    #[allow(clippy::manual_is_multiple_of)]
    #[inline(always)]
    pub const fn new(tiles: u32, grid: u32, k_blocks: u32, sk_tiles: u32) -> StreamK {
        let ok = grid > 0
            && sk_tiles <= tiles
            && (tiles - sk_tiles) % grid == 0
            && 2 * sk_tiles >= grid
            && k_blocks > 0
            && Self::fits_u32(grid, sk_tiles, k_blocks);
        StreamK {
            tiles,
            grid,
            k_blocks,
            sk_tiles: if ok { sk_tiles } else { 0 },
        }
    }

    /// Whole tiles of CTA `c` (the data-parallel ones).
    #[inline(always)]
    pub const fn dp_items(&self, c: u32) -> u32 {
        if self.sk_tiles == 0 {
            if c < self.tiles {
                (self.tiles - c).div_ceil(self.grid)
            } else {
                0
            }
        } else {
            (self.tiles - self.sk_tiles) / self.grid
        }
    }

    /// Units (tile, K block) of the stream-K tail.
    #[inline(always)]
    const fn units(&self) -> u32 {
        self.sk_tiles * self.k_blocks
    }

    /// First unit of CTA `c`'s range (`c = grid`: the end).
    #[inline(always)]
    pub const fn range_start(&self, c: u32) -> u32 {
        c * self.units() / self.grid
    }

    /// The CTA whose range holds unit `u` (of the tail).
    #[inline(always)]
    pub const fn cta_of_unit(&self, u: u32) -> u32 {
        ((u + 1) * self.grid - 1) / self.units()
    }

    /// Stream-K pieces of CTA `c` (tiles its range touches).
    #[inline(always)]
    pub const fn sk_items(&self, c: u32) -> u32 {
        let (s, e) = (self.range_start(c), self.range_start(c + 1));
        if self.sk_tiles == 0 || s == e {
            0
        } else {
            (e - 1) / self.k_blocks - s / self.k_blocks + 1
        }
    }

    /// Work items of CTA `c`: its whole tiles, then its pieces.
    #[inline(always)]
    pub const fn items(&self, c: u32) -> u32 {
        self.dp_items(c) + self.sk_items(c)
    }

    /// Work item `w` of CTA `c` (`w < items(c)`).
    #[inline(always)]
    pub const fn item(&self, c: u32, w: u32) -> Work {
        let dp = self.dp_items(c);
        if w < dp {
            return Work {
                tile: c + w * self.grid,
                k0: 0,
                k1: self.k_blocks,
                owner: true,
                from: c,
            };
        }
        let kb = self.k_blocks;
        let (s, e) = (self.range_start(c), self.range_start(c + 1));
        let t = (e - 1) / kb - (w - dp);
        let lo = if s > t * kb { s } else { t * kb };
        let hi = if e < (t + 1) * kb { e } else { (t + 1) * kb };
        let owner = hi == (t + 1) * kb;
        let from = if owner { self.cta_of_unit(t * kb) } else { c };
        Work {
            tile: self.tiles - self.sk_tiles + t,
            k0: lo - t * kb,
            k1: hi - t * kb,
            owner,
            from,
        }
    }

    /// K blocks CTA `c` computes in all (`k_before(c, items(c))`).
    #[inline(always)]
    pub const fn k_total(&self, c: u32) -> u32 {
        self.dp_items(c) * self.k_blocks + self.range_start(c + 1) - self.range_start(c)
    }

    /// K blocks CTA `c` computes before its item `w` (`w = items(c)`: in all).
    #[inline(always)]
    pub const fn k_before(&self, c: u32, w: u32) -> u32 {
        let dp = self.dp_items(c);
        if w <= dp {
            return w * self.k_blocks;
        }
        // Pieces run from the range's end down: the first `w - dp` of them cover
        // `[lo, e)`, `lo` the start of piece `w - dp - 1` (in tile `t`).
        let (s, e) = (self.range_start(c), self.range_start(c + 1));
        let t = (e - 1) / self.k_blocks - (w - dp - 1);
        let lo = if s > t * self.k_blocks { s } else { t * self.k_blocks };
        dp * self.k_blocks + (e - lo)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::vec;

    fn check(tiles: u32, grid: u32, kb: u32) {
        let sk = StreamK::choose(tiles, grid, kb);
        let p = StreamK::new(tiles, grid, kb, sk);
        assert_eq!(p.sk_tiles, sk, "{tiles} {grid} {kb}: choose's answer is valid");
        let mut seen = vec![0u32; (tiles * kb) as usize];
        let mut owners = vec![0u32; tiles as usize];
        let mut longest = 0;
        for c in 0..grid {
            let mut k = 0;
            let mut non_owner = 0;
            for w in 0..p.items(c) {
                let it = p.item(c, w);
                assert!(it.k0 < it.k1 && it.k1 <= kb);
                assert_eq!(p.k_before(c, w), k, "k_before({c}, {w})");
                k += it.k_len();
                for x in it.k0..it.k1 {
                    seen[(it.tile * kb + x) as usize] += 1;
                }
                if it.owner {
                    owners[it.tile as usize] += 1;
                    assert_eq!(it.k1, kb);
                    assert!(it.from <= c);
                    // The contributors are exactly the CTAs before c that touch the tile,
                    // each with its first stream-K piece, which does not reach the end.
                    for f in it.from..c {
                        let first = p.item(f, p.dp_items(f));
                        assert_eq!(first.tile, it.tile, "contributor {f} of tile {}", it.tile);
                        assert!(!first.owner);
                    }
                    assert_eq!(it.k0 == 0, it.from == c, "a tile starting in c has no contributors");
                    if it.from < c {
                        // The first contributor holds the tile's first K block.
                        let first = p.item(it.from, p.dp_items(it.from));
                        assert_eq!(first.k0, 0);
                    }
                    assert!(c - it.from <= 3, "at most 3 contributors");
                } else {
                    non_owner += 1;
                    assert_eq!(w, p.dp_items(c), "a contributor piece comes first");
                }
            }
            assert_eq!(p.k_before(c, p.items(c)), k);
            assert_eq!(p.k_total(c), k);
            assert!(non_owner <= 1);
            longest = longest.max(k);
        }
        assert!(seen.iter().all(|&n| n == 1), "{tiles} {grid} {kb}: every K block once");
        assert!(
            owners.iter().all(|&n| n == 1),
            "{tiles} {grid} {kb}: one owner per tile"
        );
        // The whole point: every CTA computes its fair share, rounded up.
        if sk > 0 {
            assert_eq!(
                longest,
                (tiles * kb).div_ceil(grid),
                "{tiles} {grid} {kb}: longest range"
            );
        }
    }

    #[test]
    fn every_k_block_is_computed_once_and_every_tile_has_one_owner() {
        for (tiles, grid, kb) in [
            (1024, 132, 64),
            (2048, 132, 64),
            (4096, 132, 64),
            (8192, 132, 64),
            (512, 132, 64),
            (256, 132, 16),
            (272, 132, 8),
            (1024, 128, 64),
            (100, 132, 64),
            (150, 132, 64),
            (7, 3, 5),
            (10, 4, 4),
            (1000, 7, 9),
        ] {
            check(tiles, grid, kb);
        }
        for tiles in 132..800 {
            check(tiles, 132, 16);
        }
        // The benchmark's shapes on 132 SMs (M = 4096 .. 32768, N = 8192, K_local = 4096): the
        // last CTA computes 0.24 to 0.97 of a tile less than with whole rounds (M = 4096, 100
        // stream-K tiles, is not chosen).
        for (tiles, sk, saved) in [(1024, 100, 15), (2048, 68, 31), (4096, 136, 62), (8192, 140, 60)] {
            let p = StreamK::new(tiles, 132, 64, sk);
            let longest = (0..132).map(|c| p.k_before(c, p.items(c))).max().unwrap();
            assert_eq!(tiles.div_ceil(132) * 64 - longest, saved, "{tiles} tiles");
        }
    }

    /// The waits of a launch form no cycle: each CTA runs its items in order (item w after
    /// w - 1), and an owned stream-K piece waits for the first stream-K piece of each of its
    /// contributors. Every item must be reachable in a topological order (Kahn's algorithm).
    fn waits_are_acyclic(tiles: u32, grid: u32, kb: u32, sk: u32) {
        let p = StreamK::new(tiles, grid, kb, sk);
        let base: std::vec::Vec<u32> = (0..=grid)
            .scan(0, |acc, c| {
                let b = *acc;
                if c < grid {
                    *acc += p.items(c);
                }
                Some(b)
            })
            .collect();
        let n = base[grid as usize] as usize;
        let mut deps = vec![std::vec::Vec::new(); n];
        for c in 0..grid {
            for w in 0..p.items(c) {
                let me = (base[c as usize] + w) as usize;
                if w > 0 {
                    deps[me].push(me - 1);
                }
                let it = p.item(c, w);
                if it.owner {
                    for f in it.from..c {
                        deps[me].push((base[f as usize] + p.dp_items(f)) as usize);
                    }
                }
            }
        }
        let mut indeg: std::vec::Vec<usize> = deps.iter().map(|d| d.len()).collect();
        let mut users = vec![std::vec::Vec::new(); n];
        for (me, d) in deps.iter().enumerate() {
            for &x in d {
                users[x].push(me);
            }
        }
        let mut ready: std::vec::Vec<usize> = (0..n).filter(|&i| indeg[i] == 0).collect();
        let mut done = 0;
        while let Some(i) = ready.pop() {
            done += 1;
            for &u in &users[i] {
                indeg[u] -= 1;
                if indeg[u] == 0 {
                    ready.push(u);
                }
            }
        }
        assert_eq!(
            done, n,
            "{tiles} tiles, {grid} CTAs, {kb} K blocks, {sk} stream-K: a wait cycle"
        );
    }

    #[test]
    fn the_stream_k_waits_cannot_deadlock() {
        for (tiles, grid, kb) in [
            (1024, 132, 64),
            (2048, 132, 64),
            (4096, 132, 64),
            (8192, 132, 64),
            (272, 132, 9),
            (10, 4, 4),
            (1000, 7, 9),
        ] {
            let sk = StreamK::choose(tiles, grid, kb);
            waits_are_acyclic(tiles, grid, kb, sk);
        }
        // Every valid plan, not only the chosen ones (e.g. 100 stream-K tiles at 1024).
        for tiles in 132..600 {
            for sk in [tiles % 132, tiles % 132 + 132] {
                if StreamK::new(tiles, 132, 16, sk).sk_tiles == sk && sk > 0 {
                    waits_are_acyclic(tiles, 132, 16, sk);
                }
            }
        }
    }

    #[test]
    fn choose_takes_the_partial_round_and_one_more_when_it_is_small() {
        assert_eq!(StreamK::choose(1024, 132, 64), 0, "0.76 of a round: not worth it");
        assert_eq!(StreamK::new(1024, 132, 64, 100).sk_tiles, 100, "still a valid plan");
        assert_eq!(StreamK::choose(2048, 132, 64), 68);
        assert_eq!(StreamK::choose(4096, 132, 64), 136);
        assert_eq!(StreamK::choose(8192, 132, 64), 140);
        assert_eq!(StreamK::choose(1056, 132, 64), 0, "whole rounds");
        assert_eq!(StreamK::choose(100, 132, 64), 0, "under one round");
        assert_eq!(StreamK::choose(150, 132, 64), 0, "small partial round alone");
        assert_eq!(StreamK::choose(2048, 132, 2), 0, "short K");
        // Invalid splits fall back to none.
        assert_eq!(StreamK::new(1024, 132, 64, 99).sk_tiles, 0);
    }
}
