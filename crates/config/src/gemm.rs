//! Tile configuration of the warp-specialized TMA + wgmma GEMM.
//!
//! Layout of one CTA (see docs/gemm.md):
//! - warpgroup 0 is the producer: one elected thread issues TMA loads of A and B tiles into a
//!   `stages`-deep shared-memory ring; the warpgroup then gives registers back (`setmaxnreg.dec`).
//! - warpgroups 1..=consumer_warpgroups are consumers: each owns `block_m / consumer_warpgroups`
//!   rows of the output tile and issues `wgmma.m64n{block_n}k16` on them (`setmaxnreg.inc`).

/// Tile shape, pipeline depth and warp roles of one GEMM kernel instantiation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmTile {
    /// Rows of C per CTA tile.
    pub block_m: u32,
    /// Columns of C per CTA tile (the wgmma N).
    pub block_n: u32,
    /// K per pipeline stage (64 bf16 = one 128-byte swizzle row).
    pub block_k: u32,
    /// Depth of the shared-memory ring.
    pub stages: u32,
    /// Consumer (math) warpgroups; each covers `block_m / consumer_warpgroups` rows.
    pub consumer_warpgroups: u32,
    /// Register budget per thread of the producer warpgroup after `setmaxnreg.dec`.
    pub producer_regs: u32,
    /// Register budget per thread of each consumer warpgroup after `setmaxnreg.inc`.
    pub consumer_regs: u32,
    /// Tiles per rasterization group along M (L2 reuse of B across neighbouring tiles).
    pub group_m: u32,
    /// Epilogue staging boxes per consumer warpgroup: 2 (double-buffered) or `block_n / 64`
    /// (the whole 64 x block_n half-tile).
    pub epilogue_buffers: u32,
    /// Work-item records in shared memory after the argument copy (0: none). GEMM+ReduceScatter/
    /// AllReduce works out each compute CTA's items (tile origin, K range, stream-K owner,
    /// A's source row) once at the launch's start, and the producer and the consumers read
    /// item `w` with two shared-memory loads at its start instead of some 30 integer divisions
    /// each; a CTA with more items works the rest out as it goes.
    pub item_table_entries: u32,
}

/// Bytes of one bf16 element.
pub const BF16_BYTES: u32 = 2;
/// Bytes of one 128-byte-swizzled shared-memory row: TMA box inner dimension for bf16 is 64.
pub const SWIZZLE_BYTES: u32 = 128;

impl GemmTile {
    /// The production configuration: 128x256x64, 4 stages, 2 consumer warpgroups.
    /// 4 x 48 KiB of ring fits in 227 KiB; the epilogue stores from registers.
    pub const DEFAULT: GemmTile = GemmTile {
        block_m: 128,
        block_n: 256,
        block_k: 64,
        stages: 4,
        consumer_warpgroups: 2,
        producer_regs: 40,
        consumer_regs: 232,
        group_m: 8,
        epilogue_buffers: 2,
        item_table_entries: 0,
    };

    /// The GEMM inside fused kernels: the producer thread also waits on communication flags
    /// (bounded waits need the clock and the error record), so it keeps 56 registers and the
    /// consumers 224: (56 + 2 x 224) x 128 = 168 x 384, what the CTA is launched with.
    pub const FUSED: GemmTile = GemmTile {
        producer_regs: 56,
        consumer_regs: 224,
        ..GemmTile::DEFAULT
    };

    /// GEMM+ReduceScatter/AllReduce: most tiles are stored to peers over NVLink, and a bulk
    /// store to a peer finishes reading its staging box only as NVLink takes the data. With a
    /// whole tile of staging per consumer (4 boxes) the epilogue never waits for its own stores,
    /// only (at its start) for the previous tile's, which had a mainloop to drain; the room comes
    /// from one operand stage fewer.
    /// Its work items are read from a table ([`GemmTile::item_table_entries`]): 256 cover
    /// every CTA of the anchor shapes on 132 SMs (M = 32768, N = 28672: 218 tiles per CTA).
    pub const FUSED_RS: GemmTile = GemmTile {
        stages: 3,
        epilogue_buffers: 4,
        item_table_entries: 256,
        ..GemmTile::FUSED
    };

    /// Threads per CTA: one producer warpgroup plus the consumers.
    pub const fn threads(&self) -> u32 {
        (1 + self.consumer_warpgroups) * crate::WARPGROUP_SIZE
    }
    /// Registers per thread at launch (what `.maxntid` + `.minnctapersm 1` give): the register
    /// file split over the CTA's threads, rounded down to a multiple of 8.
    pub const fn entry_regs(&self) -> u32 {
        let r = crate::SM90_REGS_PER_SM / self.threads() / 8 * 8;
        if r > 255 {
            248
        } else {
            r
        }
    }
    /// Rows of the tile owned by one consumer warpgroup.
    pub const fn rows_per_consumer(&self) -> u32 {
        self.block_m / self.consumer_warpgroups
    }
    /// Bytes of the A tile of one stage (block_m x block_k bf16, K-major, 128B swizzle).
    pub const fn a_stage_bytes(&self) -> u32 {
        self.block_m * self.block_k * BF16_BYTES
    }
    /// Bytes of the B tile of one stage (block_n x block_k bf16).
    pub const fn b_stage_bytes(&self) -> u32 {
        self.block_n * self.block_k * BF16_BYTES
    }
    /// Bytes that the TMA engine delivers per stage (the mbarrier's expected transaction count).
    pub const fn stage_tx_bytes(&self) -> u32 {
        self.a_stage_bytes() + self.b_stage_bytes()
    }
    /// Rows x columns of one epilogue staging box (bf16, 128-byte swizzled rows): what one TMA
    /// store writes.
    pub const EPILOGUE_BOX_ROWS: u32 = 64;
    pub const EPILOGUE_BOX_COLS: u32 = 64;
    /// Bytes of one staging box.
    pub const fn epilogue_box_bytes(&self) -> u32 {
        Self::EPILOGUE_BOX_ROWS * Self::EPILOGUE_BOX_COLS * BF16_BYTES
    }
    /// Offset of the epilogue staging area (`epilogue_buffers` boxes per consumer warpgroup)
    /// after the operand ring.
    pub const fn epilogue_offset(&self) -> u32 {
        self.stages * self.stage_tx_bytes()
    }
    /// Bytes of the epilogue staging area.
    pub const fn epilogue_bytes(&self) -> u32 {
        self.consumer_warpgroups * self.epilogue_buffers * self.epilogue_box_bytes()
    }
    /// Offset of the mbarrier block after the staging area.
    pub const fn barrier_offset(&self) -> u32 {
        self.epilogue_offset() + self.epilogue_bytes()
    }
    /// Auxiliary mbarriers after the per-stage ones (one arrival each), for a kernel's own
    /// hand-offs (GEMM+ReduceScatter/AllReduce: 0 = "the other nodes' sums have landed",
    /// 1 + w = "consumer warpgroup w's staging is ready" (a staged peer partial has landed, or
    /// with a stager: the staging is free or holds the partial), 3 + w = "consumer warpgroup w
    /// wrote its tile into its staging" (with a stager)).
    pub const AUX_BARRIERS: u32 = 5;
    /// Offset of the auxiliary mbarriers.
    pub const fn aux_barrier_offset(&self) -> u32 {
        self.barrier_offset() + self.stages * 2 * 8
    }
    /// Bytes after the auxiliary mbarriers for a copy of the launch's communication
    /// descriptor (fused kernels read it there: a shared-memory load does not queue behind the
    /// SM's global traffic, as each read of the global one did).
    pub const DESC_COPY_BYTES: u32 = 128;
    /// Offset of two u32 words after the auxiliary mbarriers (GEMM+ReduceScatter/AllReduce:
    /// word 0 counts the ring slots the producer found free in the launch - the consumers'
    /// progress - which paces a stager's trickled stores).
    pub const fn tick_offset(&self) -> u32 {
        self.aux_barrier_offset() + 8 * Self::AUX_BARRIERS
    }
    /// Offset of the descriptor copy (8-byte aligned).
    pub const fn desc_copy_offset(&self) -> u32 {
        self.tick_offset() + 8
    }
    /// Offset of the launch epoch's copy: the last 8 bytes of the descriptor copy's room
    /// (written once per CTA at setup, so no role and no exit reads the epoch from global
    /// memory).
    pub const fn epoch_copy_offset(&self) -> u32 {
        self.desc_copy_offset() + Self::DESC_COPY_BYTES - 8
    }
    /// Bytes after the descriptor copy for a copy of the launch's argument block
    /// (GEMM+ReduceScatter/AllReduce's `GemmRsArgs`, read there for the same reason: its tensor
    /// map addresses are read right before the epilogue's bulk stores, and a global read there
    /// queues behind the SM's outstanding NVLink traffic).
    pub const ARGS_COPY_BYTES: u32 = 272;
    /// Offset of the argument block copy (8-byte aligned).
    pub const fn args_copy_offset(&self) -> u32 {
        self.desc_copy_offset() + Self::DESC_COPY_BYTES
    }
    /// Bytes of one work-item record: two 16-byte words (`[m0, n0, k0, k1]`,
    /// `[flags: owner, own tile, stagers; from; a_row; the row inside its chunk]`).
    pub const ITEM_RECORD_BYTES: u32 = 32;
    /// Offset of the work-item table (16-byte aligned), after the argument copy.
    pub const fn item_table_offset(&self) -> u32 {
        (self.args_copy_offset() + Self::ARGS_COPY_BYTES).div_ceil(16) * 16
    }
    /// Dynamic shared memory to launch with: ring + epilogue staging + 2 mbarriers per stage
    /// (full, empty) + the auxiliary ones + the descriptor and argument copies + the work-item
    /// table, padded so the 1024-byte alignment of the swizzled ring holds.
    pub const fn smem_bytes(&self) -> u32 {
        self.item_table_offset() + self.item_table_entries * Self::ITEM_RECORD_BYTES + 1024
    }
    /// Accumulator registers per consumer thread (f32): (rows_per_consumer x block_n) / 128.
    pub const fn accumulators_per_thread(&self) -> u32 {
        self.rows_per_consumer() * self.block_n / crate::WARPGROUP_SIZE
    }

    /// Checks every invariant the kernel relies on; panics (at compile time when used in a
    /// `const`) with the reason.
    pub const fn check(&self) {
        assert!(
            self.block_k * BF16_BYTES == SWIZZLE_BYTES,
            "block_k must fill one 128-byte swizzle row"
        );
        assert!(
            self.rows_per_consumer() == 64,
            "each consumer warpgroup issues m64 wgmmas on 64 rows"
        );
        assert!(
            self.block_m % self.consumer_warpgroups == 0,
            "block_m must split evenly over consumers"
        );
        assert!(
            self.block_n % 64 == 0 && self.block_n >= 64 && self.block_n <= 256,
            "wgmma N: 64..=256 in steps of 64 (B loads are 64-wide boxes)"
        );
        assert!(self.stages >= 2, "a ring needs at least 2 stages");
        assert!(
            self.a_stage_bytes() % 1024 == 0 && self.b_stage_bytes() % 1024 == 0,
            "stage tiles must keep 1024-byte swizzle alignment"
        );
        assert!(
            self.rows_per_consumer() == Self::EPILOGUE_BOX_ROWS,
            "one staging box spans a consumer's rows"
        );
        assert!(
            self.block_n % Self::EPILOGUE_BOX_COLS == 0,
            "staging boxes tile block_n"
        );
        assert!(
            self.epilogue_buffers == 2 || self.epilogue_buffers == self.block_n / Self::EPILOGUE_BOX_COLS,
            "epilogue staging: 2 boxes or a whole half-tile per consumer"
        );
        assert!(
            self.smem_bytes() <= crate::SM90_MAX_SMEM_PER_CTA,
            "shared memory ring does not fit in 227 KiB"
        );
        assert!(
            self.producer_regs % 8 == 0 && self.consumer_regs % 8 == 0,
            "setmaxnreg counts are multiples of 8"
        );
        assert!(
            self.producer_regs >= 24 && self.consumer_regs <= 256,
            "setmaxnreg range is 24..=256"
        );
        // setmaxnreg moves registers between the warpgroups of one CTA: the split must fit in
        // what the CTA was launched with (entry registers x threads), not the whole register
        // file, or `setmaxnreg.inc` waits forever for registers nobody releases.
        assert!(
            (self.producer_regs + self.consumer_regs * self.consumer_warpgroups) * crate::WARPGROUP_SIZE
                <= self.entry_regs() * self.threads(),
            "register split exceeds the registers the CTA is launched with"
        );
        assert!(
            self.accumulators_per_thread() + 40 <= self.consumer_regs,
            "accumulators must fit the consumer register budget"
        );
        assert!(self.group_m >= 1, "group_m must be positive");
    }
}

const _: () = GemmTile::DEFAULT.check();
const _: () = GemmTile::FUSED.check();
const _: () = GemmTile::FUSED_RS.check();

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn default_budget() {
        let t = GemmTile::DEFAULT;
        assert_eq!(t.threads(), 384);
        assert_eq!(t.stage_tx_bytes(), 48 * 1024);
        assert!(t.smem_bytes() <= 227 * 1024);
        assert_eq!(t.accumulators_per_thread(), 128);
    }
    #[test]
    #[should_panic(expected = "registers the CTA is launched with")]
    fn a_split_beyond_the_launch_registers_is_rejected() {
        // (64 + 2 x 224) x 128 = 65536 fits the register file but not 168 x 384 = 64512.
        GemmTile {
            producer_regs: 64,
            consumer_regs: 224,
            ..GemmTile::DEFAULT
        }
        .check();
    }
    #[test]
    #[should_panic(expected = "does not fit")]
    fn too_many_stages_is_rejected() {
        GemmTile {
            stages: 5,
            ..GemmTile::DEFAULT
        }
        .check();
    }
}
