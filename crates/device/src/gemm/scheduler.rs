//! Persistent tile scheduler: CTA `b` of a grid of `g` takes linear tiles `b, b + g, b + 2g, ...`.
//!
//! Linear tiles are rasterized in groups of `group_m` tile-rows: inside a group consecutive tiles
//! walk down M first, so the CTAs running at one time share B columns and A rows in L2.

/// Origin of one output tile, in elements.
#[derive(Clone, Copy)]
pub struct Tile {
    pub m0: u32,
    pub n0: u32,
}

/// Iterates the tiles of one CTA.
pub struct TileScheduler {
    tiles_m: u32,
    tiles_n: u32,
    group_m: u32,
    next: u32,
    stride: u32,
    block_m: u32,
    block_n: u32,
    /// Tile rows are visited node group by node group, this node's first, each group from its
    /// row `first_tile_m` on (wrapping): fused kernels start where their data is already
    /// present (AllGather+GEMM: the local shard first, then local peers, then other nodes).
    first_tile_m: u32,
    nodes: u32,
    node: u32,
    /// Chunked order of GEMM+ReduceScatter/AllReduce (0: off): see [`TileScheduler::chunked`].
    part_tiles_m: u32,
    chunk_tiles_m: u32,
    world: u32,
    rank: u32,
}

impl TileScheduler {
    /// Scheduler over an `m x n` output for the CTA `first` of `stride` CTAs.
    #[inline(always)]
    pub fn new(m: u32, n: u32, block_m: u32, block_n: u32, group_m: u32, first: u32, stride: u32) -> Self {
        TileScheduler {
            tiles_m: m.div_ceil(block_m),
            tiles_n: n.div_ceil(block_n),
            group_m,
            next: first,
            stride,
            block_m,
            block_n,
            first_tile_m: 0,
            nodes: 1,
            node: 0,
            part_tiles_m: 0,
            chunk_tiles_m: 0,
            world: 1,
            rank: 0,
        }
    }

    /// The order of GEMM+ReduceScatter/AllReduce on rank `rank` of `world`: the M rows form
    /// `world` chunks (chunk `d` is reduced on rank `d`), each cut into `G` parts of
    /// `part_tiles_m` tile rows; a *block* is one part of one chunk (`part_tiles_m x tiles_n`
    /// tiles). The sequence is
    /// - segment 0: the peers' blocks of part 0, chunks `rank + 1, rank + 2, ...`;
    /// - segment g = 1..G: the peers' blocks of part g merged with this rank's own block of
    ///   part g - 1 ([`TileScheduler::merged`]: `world - 1` waves of peer tiles, one of own);
    /// - last: the own block of part G - 1.
    ///
    /// So every own tile comes a whole segment after the peers computed (and sent) their
    /// partials of it, and the NVLink stores are spread over the whole launch instead of
    /// pausing while the own chunk is computed. `m` must be a multiple of
    /// `world x part_tiles_m x block_m`. Inside a block tiles walk down M first, `group_m`
    /// rows at a time.
    #[inline(always)]
    pub fn chunked(mut self, world: u32, rank: u32, part_tiles_m: u32) -> Self {
        self.world = world;
        self.rank = rank;
        self.part_tiles_m = part_tiles_m;
        self.chunk_tiles_m = self.tiles_m / world;
        self
    }

    /// Visits tile rows from `first_tile_m` on (wrapping around).
    #[inline(always)]
    pub fn starting_at_row(self, first_tile_m: u32) -> Self {
        self.node_major(1, 0, first_tile_m)
    }

    /// The rows form `nodes` equal groups (node `i`'s rows are group `i`): group `node` is
    /// visited first, then `node + 1`, ... (wrapping); inside each group from its row
    /// `first_in_node` on (wrapping). One node: [`TileScheduler::starting_at_row`].
    #[inline(always)]
    pub fn node_major(mut self, nodes: u32, node: u32, first_in_node: u32) -> Self {
        self.nodes = nodes.max(1);
        self.node = node;
        self.first_tile_m = first_in_node % (self.tiles_m / self.nodes).max(1);
        self
    }

    /// Position `v` of a merged segment (`world - 1` peer blocks and one own block of `b` tiles
    /// each): `(own, index)`, the index counted over the own block or over the peer blocks in
    /// turn. Merged by waves of `stride` tiles (one tile per CTA): `world - 1` peer waves, then
    /// one own wave, so every CTA gets its share of own tiles (a tile-by-tile merge would give
    /// all own tiles to the CTAs whose index is `world - 1` modulo `world`). What does not fill
    /// whole groups of waves ends the segment: the remaining peer tiles, then own ones.
    #[inline(always)]
    fn merged(&self, v: u32, b: u32) -> (bool, u32) {
        let (w, g) = (self.world, self.stride);
        let full = (w * b) / (w * g);
        if v < full * w * g {
            let (k, j) = (v / g, v % g);
            let grp = k / w;
            if k % w == w - 1 {
                (true, grp * g + j)
            } else {
                (false, (grp * (w - 1) + k % w) * g + j)
            }
        } else {
            let r = v - full * w * g;
            let peer_left = (w - 1) * b - full * (w - 1) * g;
            if r < peer_left {
                (false, full * (w - 1) * g + r)
            } else {
                (true, full * g + r - peer_left)
            }
        }
    }

    /// Tile `t` of the chunked order: (chunk, part, index inside the block).
    #[inline(always)]
    fn chunked_tile(&self, t: u32) -> Tile {
        let (w, b) = (self.world, self.part_tiles_m * self.tiles_n);
        let total = self.total();
        let peer = |step: u32| (self.rank + 1 + step) % w;
        let (chunk, part, i) = if t < (w - 1) * b {
            (peer(t / b), 0, t % b)
        } else if t >= total - b {
            (self.rank, self.chunk_tiles_m / self.part_tiles_m - 1, t - (total - b))
        } else {
            let u = t - (w - 1) * b;
            let (part, v) = (1 + u / (w * b), u % (w * b));
            match self.merged(v, b) {
                (true, i) => (self.rank, part - 1, i),
                (false, i) => (peer(i / b), part, i % b),
            }
        };
        let (tm, tn) = grouped(i, self.part_tiles_m, self.tiles_n, self.group_m);
        let tm = chunk * self.chunk_tiles_m + part * self.part_tiles_m + tm;
        Tile {
            m0: tm * self.block_m,
            n0: tn * self.block_n,
        }
    }

    /// The tile with linear index `t` under grouped rasterization.
    #[inline(always)]
    pub fn tile(&self, t: u32) -> Tile {
        if self.part_tiles_m != 0 {
            return self.chunked_tile(t);
        }
        let (tm, tn) = grouped(t, self.tiles_m, self.tiles_n, self.group_m);
        let node_rows = self.tiles_m / self.nodes;
        let (group, within) = (tm / node_rows, tm % node_rows);
        let tm = ((self.node + group) % self.nodes) * node_rows + (within + self.first_tile_m) % node_rows;
        Tile {
            m0: tm * self.block_m,
            n0: tn * self.block_n,
        }
    }

    /// Number of output tiles.
    #[inline(always)]
    pub fn total(&self) -> u32 {
        self.tiles_m * self.tiles_n
    }
}

/// Tile `(row, column)` of linear index `t` in a `tiles_m x tiles_n` grid rasterized in groups
/// of `group_m` rows (consecutive tiles walk down M inside a group).
#[inline(always)]
fn grouped(t: u32, tiles_m: u32, tiles_n: u32, group_m: u32) -> (u32, u32) {
    let group_size = group_m * tiles_n;
    let first_m = (t / group_size) * group_m;
    let rows = if tiles_m - first_m < group_m {
        tiles_m - first_m
    } else {
        group_m
    };
    let in_group = t % group_size;
    (first_m + in_group % rows, in_group / rows)
}

impl Iterator for TileScheduler {
    type Item = Tile;
    #[inline(always)]
    fn next(&mut self) -> Option<Tile> {
        if self.next >= self.total() {
            return None;
        }
        let t = self.tile(self.next);
        self.next += self.stride;
        Some(t)
    }
}
