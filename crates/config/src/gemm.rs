//! Tile configuration and shared-memory ring of the warp-specialized TMA + wgmma GEMM, shared by
//! the plain GEMM (`ops::gemm`) and the fused kernels (`ops::ag_gemm`, `ops::gemm_rs`).
//!
//! Layout of one CTA (see docs/gemm.md):
//! - warpgroup 0 is the producer: one elected thread issues TMA loads of A and B tiles into a
//!   `stages`-deep shared-memory ring; the warpgroup then gives registers back (`setmaxnreg.dec`).
//! - warpgroups 1..=consumer_warpgroups are consumers: each owns `block_m / consumer_warpgroups`
//!   rows of the output tile and issues `wgmma.m64n{block_n}k16` on them (`setmaxnreg.inc`).
//!
//! Shared memory: each kernel has a `#[repr(C)]` struct that starts with a [`RingSmem`] for its
//! tile; the device's `Ring` takes the [`RingLayout`] that struct's `offset_of!`s give.
use core::mem::{offset_of, size_of};

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
}

/// Bytes of one bf16 element.
pub const BF16_BYTES: u32 = 2;
/// Bytes of one 128-byte-swizzled shared-memory row: TMA box inner dimension for bf16 is 64.
pub const SWIZZLE_BYTES: u32 = 128;

impl GemmTile {
    /// The production configuration: 128x256x64, 4 stages, 2 consumer warpgroups.
    /// 4 x 48 KiB of ring fits in 227 KiB; the epilogue stages two boxes per consumer.
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
    };

    /// The GEMM inside fused kernels: the producer thread also waits on communication flags
    /// (bounded waits need the clock and the error record), so it keeps 56 registers and the
    /// consumers 224: (56 + 2 x 224) x 128 = 168 x 384, what the CTA is launched with.
    pub const FUSED: GemmTile = GemmTile {
        producer_regs: 56,
        consumer_regs: 224,
        ..GemmTile::DEFAULT
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
    /// Bytes of the epilogue staging area (`epilogue_buffers` boxes per consumer warpgroup).
    pub const fn epilogue_bytes(&self) -> u32 {
        self.consumer_warpgroups * self.epilogue_buffers * self.epilogue_box_bytes()
    }
    /// Bytes of the operand ring and the epilogue staging: the least shared memory any kernel on
    /// this tile needs (a kernel's exact budget is the size of its `#[repr(C)]` struct).
    pub const fn ring_bytes(&self) -> u32 {
        self.stages * self.stage_tx_bytes() + self.epilogue_bytes()
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
            self.block_m.is_multiple_of(self.consumer_warpgroups),
            "block_m must split evenly over consumers"
        );
        assert!(
            self.block_n.is_multiple_of(64) && self.block_n >= 64 && self.block_n <= 256,
            "wgmma N: 64..=256 in steps of 64 (B loads are 64-wide boxes)"
        );
        assert!(self.stages >= 2, "a ring needs at least 2 stages");
        assert!(
            self.a_stage_bytes().is_multiple_of(1024) && self.b_stage_bytes().is_multiple_of(1024),
            "stage tiles must keep 1024-byte swizzle alignment"
        );
        assert!(
            self.rows_per_consumer() == Self::EPILOGUE_BOX_ROWS,
            "one staging box spans a consumer's rows"
        );
        assert!(
            self.block_n.is_multiple_of(Self::EPILOGUE_BOX_COLS),
            "staging boxes tile block_n"
        );
        assert!(
            self.epilogue_buffers == 2 || self.epilogue_buffers == self.block_n / Self::EPILOGUE_BOX_COLS,
            "epilogue staging: 2 boxes or a whole half-tile per consumer"
        );
        assert!(
            self.ring_bytes() <= crate::SM90_MAX_SMEM_PER_CTA,
            "shared memory ring does not fit in 227 KiB"
        );
        assert!(
            self.producer_regs.is_multiple_of(8) && self.consumer_regs.is_multiple_of(8),
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

/// Auxiliary mbarriers after the ring's per-stage ones (one arrival each), for a kernel's own
/// hand-offs; each kernel names their uses (e.g. `ops::gemm_rs::AUX_NODE_SUMS`).
pub const AUX_BARRIERS: usize = 5;
/// Progress words after the auxiliary mbarriers: one thread writes, others poll (uses named
/// per kernel, e.g. `ops::gemm_rs::TICK_FREE_SLOTS`).
pub const TICK_WORDS: usize = 2;
/// Headroom added to every kernel's shared-memory struct when it is launched, so the 1024-byte
/// alignment of the swizzled ring holds.
pub const SMEM_ALIGN_SLACK: u32 = 1024;
/// Bytes of one epilogue staging box (`GemmTile::EPILOGUE_BOX_ROWS` x `EPILOGUE_BOX_COLS` bf16).
pub const EPILOGUE_BOX_BYTES: usize = (GemmTile::EPILOGUE_BOX_ROWS * GemmTile::EPILOGUE_BOX_COLS * BF16_BYTES) as usize;

/// One stage of the operand ring: the A tile (`block_m` x `block_k`), then the B tile (`block_n` x
/// `block_k`), both 128-byte swizzled.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Stage<const A: usize, const B: usize> {
    pub a: [u8; A],
    pub b: [u8; B],
}

/// One epilogue staging box: 64 rows of 128 bytes, 128-byte swizzled (what one TMA store writes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct StagingBox(pub [u8; EPILOGUE_BOX_BYTES]);

/// The GEMM ring in shared memory, at offset 0 of a kernel's struct (1024-byte aligned): `STAGES`
/// operand stages, `BOXES` epilogue staging boxes (`epilogue_buffers` per consumer warpgroup,
/// warpgroup-major), a `full` mbarrier per stage (completed by the TMA bytes of the stage), an
/// `empty` one per stage (one arrival per consumer warp), the auxiliary mbarriers and the tick
/// words. Instantiate it with [`ring_smem!`](crate::ring_smem) for a [`GemmTile`].
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RingSmem<const STAGES: usize, const A: usize, const B: usize, const BOXES: usize> {
    pub stages: [Stage<A, B>; STAGES],
    pub staging: [StagingBox; BOXES],
    pub full: [u64; STAGES],
    pub empty: [u64; STAGES],
    pub aux: [u64; AUX_BARRIERS],
    pub tick: [u32; TICK_WORDS],
}

/// The [`RingSmem`] type of a [`GemmTile`] constant: `ring_smem!(GemmTile::DEFAULT)`.
#[macro_export]
macro_rules! ring_smem {
    ($tile:expr) => {
        $crate::gemm::RingSmem<
            { $tile.stages as usize },
            { $tile.a_stage_bytes() as usize },
            { $tile.b_stage_bytes() as usize },
            { ($tile.consumer_warpgroups * $tile.epilogue_buffers) as usize },
        >
    };
}

/// Where a ring's pieces lie in a kernel's shared memory (byte offsets from its base), with the
/// tile they are sized for: what the device's `Ring` addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    pub tile: GemmTile,
    pub staging: u32,
    pub full: u32,
    pub empty: u32,
    pub aux: u32,
    pub tick: u32,
}

impl<const STAGES: usize, const A: usize, const B: usize, const BOXES: usize> RingSmem<STAGES, A, B, BOXES> {
    /// The layout of this ring at offset 0 of a kernel's shared memory, for `tile` (which must be
    /// the tile the type was instantiated for; checked).
    pub const fn layout(tile: GemmTile) -> RingLayout {
        tile.check();
        assert!(
            STAGES as u32 == tile.stages
                && A as u32 == tile.a_stage_bytes()
                && B as u32 == tile.b_stage_bytes()
                && BOXES as u32 == tile.consumer_warpgroups * tile.epilogue_buffers,
            "ring type and tile disagree"
        );
        assert!(
            offset_of!(Self, stages) == 0 && size_of::<Stage<A, B>>().is_multiple_of(1024),
            "stages keep the 1024-byte swizzle alignment"
        );
        assert!(
            offset_of!(Self, staging).is_multiple_of(1024),
            "staging boxes are 1024-byte aligned"
        );
        RingLayout {
            tile,
            staging: offset_of!(Self, staging) as u32,
            full: offset_of!(Self, full) as u32,
            empty: offset_of!(Self, empty) as u32,
            aux: offset_of!(Self, aux) as u32,
            tick: offset_of!(Self, tick) as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn default_budget() {
        let t = GemmTile::DEFAULT;
        assert_eq!(t.threads(), 384);
        assert_eq!(t.stage_tx_bytes(), 48 * 1024);
        assert!(t.ring_bytes() <= 227 * 1024);
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
