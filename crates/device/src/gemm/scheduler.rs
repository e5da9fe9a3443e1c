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
    /// Tile rows are visited starting at this one (wrapping): fused kernels start where their
    /// data is already present (AllGather+GEMM: the local shard first, then peers in order).
    first_tile_m: u32,
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
        }
    }

    /// Visits tile rows from `first_tile_m` on (wrapping around).
    #[inline(always)]
    pub fn starting_at_row(mut self, first_tile_m: u32) -> Self {
        self.first_tile_m = first_tile_m % self.tiles_m.max(1);
        self
    }

    /// The tile with linear index `t` under grouped rasterization.
    #[inline(always)]
    pub fn tile(&self, t: u32) -> Tile {
        let group_size = self.group_m * self.tiles_n;
        let group = t / group_size;
        let first_m = group * self.group_m;
        let rows = if self.tiles_m - first_m < self.group_m { self.tiles_m - first_m } else { self.group_m };
        let in_group = t % group_size;
        let tm = (first_m + in_group % rows + self.first_tile_m) % self.tiles_m;
        Tile { m0: tm * self.block_m, n0: (in_group / rows) * self.block_n }
    }

    /// Number of output tiles.
    #[inline(always)]
    pub fn total(&self) -> u32 {
        self.tiles_m * self.tiles_n
    }
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
