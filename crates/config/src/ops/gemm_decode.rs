//! The decode-size GEMM `C = A * B` for M <= [`DECODE_MAX_M`] (device `kernels/gemm_decode.rs`,
//! host `gemm.rs`): the weights B stream from HBM once, across every SM.
//!
//! The product is computed transposed (`C^T = B^T A^T`): the wgmma's M side is 128 rows of B
//! (the weights' N; warpgroup `w` of the two consumers takes rows `64w..64w+64`), its N side is the
//! `TOK` rows of A (M rounded up to a bucket of [`TOK_BUCKETS`]). So a tile is 128 weight rows x
//! all tokens, and no tensor-core work is spent on 128-row tiles of a handful of tokens.
//!
//! Work split (stream-K): a launch has `tiles = ceil(N / 128)` tiles of `k_blocks = ceil(K / 64)`
//! K blocks; the `tiles x k_blocks` units (tile-major) are cut into `grid` contiguous ranges of
//! (almost) equal length, one per CTA ([`DecodeSplit`]). A tile that one CTA covers whole is stored
//! by it; the others' pieces are written as f32 partials to the CTA's workspace slot (slot 0 for
//! its first tile, 1 for its last), each contributor adds 1 to the tile's counter, and the one that
//! completes the count sums the partials in CTA order (deterministic for a given grid), stores C and
//! resets the counter for the next launch.
use crate::kernels::KernelSpec;
use crate::TensorMapWords;
use core::mem::{offset_of, size_of};

/// Largest M the GEMM policy sends to the decode kernels (the largest wgmma N).
pub const DECODE_MAX_M: u32 = 256;
/// Weight rows per tile: two consumer warpgroups x m64.
pub const W_ROWS: u32 = 128;
/// K per stage: 64 bf16 = one 128-byte swizzle row.
pub const BLOCK_K: u32 = 64;
/// Bytes of a stage's weight tile (128 rows x 64 K, or two 64 (N) x 64 (K) boxes for K x N B).
pub const W_STAGE_BYTES: u32 = W_ROWS * BLOCK_K * 2;
/// Bytes of one 64 (N) x 64 (K) box of a K x N weight tile (one consumer warpgroup's rows).
pub const W_KN_BOX_BYTES: u32 = 64 * BLOCK_K * 2;
/// Token counts (the wgmma N) the kernels are compiled for; M is rounded up to the next one.
pub const TOK_BUCKETS: [u32; 6] = [8, 16, 32, 64, 128, 256];
/// Most stages a ring gets (more only adds barrier bookkeeping).
pub const MAX_STAGES: u32 = 16;
/// Threads: one producer warpgroup, two consumer warpgroups.
pub const THREADS: u32 = 3 * crate::WARPGROUP_SIZE;
/// Consumer threads (the epilogue's named barrier).
pub const CONSUMER_THREADS: u32 = 2 * crate::WARPGROUP_SIZE;
/// Register split after `setmaxnreg`: (40 + 2 x 232) x 128 <= 168 x 384, as the tiled GEMM.
pub const PRODUCER_REGS: u32 = 40;
pub const CONSUMER_REGS: u32 = 232;
/// Named barrier of the two consumer warpgroups (the epilogue's hand-offs).
pub const EPILOGUE_BARRIER: u32 = 1;
/// Headroom for the 1024-byte alignment of the swizzled ring.
pub const SMEM_ALIGN_SLACK: u32 = 1024;

/// Bytes of a stage's token tile (`tok` rows x 64 K).
pub const fn x_stage_bytes(tok: u32) -> u32 {
    tok * BLOCK_K * 2
}
/// Stages that fit in shared memory for `tok` tokens (at most [`MAX_STAGES`]).
pub const fn stages(tok: u32) -> u32 {
    // Barriers (2 x 8 bytes per stage) and the flag word: 512 bytes is enough for 16 stages.
    let avail = crate::SM90_MAX_SMEM_PER_CTA - SMEM_ALIGN_SLACK - 512;
    let s = avail / (W_STAGE_BYTES + x_stage_bytes(tok));
    if s > MAX_STAGES {
        MAX_STAGES
    } else {
        s
    }
}
/// Bytes of one CTA's partial slot: 128 rows x `tok` f32.
pub const fn slot_bytes(tok: u32) -> u32 {
    W_ROWS * tok * 4
}
/// The bucket for `m` rows of A (None above [`DECODE_MAX_M`] or for 0).
pub const fn tok_for(m: u32) -> Option<u32> {
    let mut i = 0;
    while i < TOK_BUCKETS.len() {
        if m >= 1 && m <= TOK_BUCKETS[i] {
            return Some(TOK_BUCKETS[i]);
        }
        i += 1;
    }
    None
}

/// A decode kernel's shared memory: `S` stages of weights, then of tokens (`XB` bytes each),
/// the `full` mbarriers (completed by the stage's TMA bytes), the `empty` ones (one arrival per
/// consumer warp), and the word by which the epilogue tells the consumers "this CTA sums the tile".
#[repr(C)]
pub struct DecodeSmem<const S: usize, const XB: usize> {
    pub w: [[u8; W_STAGE_BYTES as usize]; S],
    pub x: [[u8; XB]; S],
    pub full: [u64; S],
    pub empty: [u64; S],
    pub last: u32,
}

/// Byte offsets of a [`DecodeSmem`] from the 1024-aligned base, with its stage count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLayout {
    pub tok: u32,
    pub stages: u32,
    pub x: u32,
    pub full: u32,
    pub empty: u32,
    pub last: u32,
    /// Dynamic shared memory of a launch (struct + alignment slack).
    pub smem_bytes: u32,
}

impl<const S: usize, const XB: usize> DecodeSmem<S, XB> {
    /// The layout for `tok` tokens (which must be what the type was instantiated for; checked).
    pub const fn layout(tok: u32) -> DecodeLayout {
        assert!(
            S as u32 == stages(tok) && XB as u32 == x_stage_bytes(tok),
            "type and bucket disagree"
        );
        assert!(S >= 2, "a ring needs at least 2 stages");
        assert!(
            offset_of!(Self, x).is_multiple_of(1024) && XB.is_multiple_of(1024),
            "token stages keep the 1024-byte swizzle alignment"
        );
        let smem_bytes = size_of::<Self>() as u32 + SMEM_ALIGN_SLACK;
        assert!(
            smem_bytes <= crate::SM90_MAX_SMEM_PER_CTA,
            "ring does not fit in 227 KiB"
        );
        DecodeLayout {
            tok,
            stages: S as u32,
            x: offset_of!(Self, x) as u32,
            full: offset_of!(Self, full) as u32,
            empty: offset_of!(Self, empty) as u32,
            last: offset_of!(Self, last) as u32,
            smem_bytes,
        }
    }
}

/// The [`DecodeSmem`] type of a bucket: `decode_smem!(8)`.
#[macro_export]
macro_rules! decode_smem {
    ($tok:expr) => {
        $crate::ops::gemm_decode::DecodeSmem<
            { $crate::ops::gemm_decode::stages($tok) as usize },
            { $crate::ops::gemm_decode::x_stage_bytes($tok) as usize },
        >
    };
}

/// The layout of every bucket, in [`TOK_BUCKETS`] order.
pub const LAYOUTS: [DecodeLayout; 6] = [
    <decode_smem!(8)>::layout(8),
    <decode_smem!(16)>::layout(16),
    <decode_smem!(32)>::layout(32),
    <decode_smem!(64)>::layout(64),
    <decode_smem!(128)>::layout(128),
    <decode_smem!(256)>::layout(256),
];

/// The layout of bucket `tok` (one of [`TOK_BUCKETS`]).
pub const fn layout(tok: u32) -> DecodeLayout {
    let mut i = 0;
    while i < LAYOUTS.len() {
        if LAYOUTS[i].tok == tok {
            return LAYOUTS[i];
        }
        i += 1;
    }
    panic!("not a decode bucket")
}

const fn spec(name: &'static str, tok: u32) -> KernelSpec {
    KernelSpec {
        name,
        max_threads: THREADS,
        min_blocks_per_sm: 1,
        dynamic_smem: layout(tok).smem_bytes,
    }
}

/// Decode kernels, B stored N x K, one per bucket ([`TOK_BUCKETS`] order).
pub const DECODE_NK: [KernelSpec; 6] = [
    spec("mk_gemm_decode_nk_t8", 8),
    spec("mk_gemm_decode_nk_t16", 16),
    spec("mk_gemm_decode_nk_t32", 32),
    spec("mk_gemm_decode_nk_t64", 64),
    spec("mk_gemm_decode_nk_t128", 128),
    spec("mk_gemm_decode_nk_t256", 256),
];
/// Decode kernels, B stored K x N, one per bucket ([`TOK_BUCKETS`] order).
pub const DECODE_KN: [KernelSpec; 6] = [
    spec("mk_gemm_decode_kn_t8", 8),
    spec("mk_gemm_decode_kn_t16", 16),
    spec("mk_gemm_decode_kn_t32", 32),
    spec("mk_gemm_decode_kn_t64", 64),
    spec("mk_gemm_decode_kn_t128", 128),
    spec("mk_gemm_decode_kn_t256", 256),
];

/// The kernel of bucket `tok` for B stored N x K (`kn = false`) or K x N.
pub const fn kernel(tok: u32, kn: bool) -> &'static KernelSpec {
    let mut i = 0;
    while i < TOK_BUCKETS.len() {
        if TOK_BUCKETS[i] == tok {
            return if kn { &DECODE_KN[i] } else { &DECODE_NK[i] };
        }
        i += 1;
    }
    panic!("not a decode bucket")
}

/// The arguments of a decode launch after its tensor maps (see [`DecodeParams`]).
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeArgs {
    /// The partial workspace: [`DecodeSplit::workspace_bytes`] of the launch's bucket, 16-byte
    /// aligned.
    pub ws: u64,
    /// One `u32` per tile, zero before the launch (and left zero by it).
    pub counters: u64,
    /// Rows of A and C this launch (at most the kernel's bucket).
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Row stride of C in elements (`>= n`).
    pub ldc: u32,
    /// 1: f32 C; 0: bf16 C.
    pub f32_out: u32,
    pub _pad: u32,
}

/// A decode launch's parameter block, passed by value as the kernel's first parameter and read in
/// place: the tensor maps of the weights B (N x K: box 64 (K) x 128 rows; K x N: box 64 (N) x 64
/// (K)) and of the tokens A (box 64 (K) x the bucket's rows), each at a 64-byte offset, then the
/// arguments. The second parameter is C's address (`m x ldc` elements), a pointer parameter so
/// that its stores compile to `st.global` (as for [`crate::ops::gemm::GemmParams`]).
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeParams {
    pub map_w: TensorMapWords,
    pub map_x: TensorMapWords,
    pub args: DecodeArgs,
}
const _: () = assert!(size_of::<DecodeArgs>() == 2 * 8 + 6 * 4, "argument block layout");
const _: () = assert!(offset_of!(DecodeParams, map_w) % 64 == 0 && offset_of!(DecodeParams, map_x) % 64 == 0);
const _: () = assert!(offset_of!(DecodeParams, args) == 2 * 128);
const _: () = assert!(
    size_of::<DecodeParams>() <= crate::MAX_PARAM_BYTES,
    "kernel parameters are limited to 4 KiB"
);

/// The stream-K split of one launch (every CTA computes the same): units are (tile, K block)
/// pairs, tile-major; CTA `c` takes units `start(c)..start(c + 1)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeSplit {
    pub tiles: u32,
    pub k_blocks: u32,
    /// CTAs: at most the units, so every CTA has at least one.
    pub grid: u32,
}

impl DecodeSplit {
    /// The split of an `n x k` weight matrix over at most `max_grid` CTAs.
    pub const fn new(n: u32, k: u32, max_grid: u32) -> DecodeSplit {
        let tiles = n.div_ceil(W_ROWS);
        let k_blocks = k.div_ceil(BLOCK_K);
        let units = tiles as u64 * k_blocks as u64;
        let grid = if (max_grid as u64) < units {
            max_grid
        } else {
            units as u32
        };
        DecodeSplit {
            tiles,
            k_blocks,
            grid: if grid == 0 { 1 } else { grid },
        }
    }
    pub const fn units(&self) -> u64 {
        self.tiles as u64 * self.k_blocks as u64
    }
    /// First unit of CTA `c` (`c <= grid`; `start(grid)` is the end).
    #[inline(always)]
    pub const fn start(&self, c: u32) -> u32 {
        (c as u64 * self.units() / self.grid as u64) as u32
    }
    /// The CTA whose range holds unit `u`.
    #[inline(always)]
    pub const fn owner(&self, u: u32) -> u32 {
        (((u as u64 + 1) * self.grid as u64 - 1) / self.units()) as u32
    }
    /// The CTAs whose ranges meet tile `t`: `first..=last`.
    #[inline(always)]
    pub const fn contributors(&self, t: u32) -> (u32, u32) {
        (
            self.owner(t * self.k_blocks),
            self.owner(t * self.k_blocks + self.k_blocks - 1),
        )
    }
    /// The partial slot (0 or 1) in which CTA `c` keeps its piece of tile `t`: 0 for the first
    /// tile of its range, 1 for its last.
    #[inline(always)]
    pub const fn slot(&self, c: u32, t: u32) -> u32 {
        if t == self.start(c) / self.k_blocks {
            0
        } else {
            1
        }
    }
    /// Bytes of the partial workspace for bucket `tok` (two slots per CTA).
    pub const fn workspace_bytes(&self, tok: u32) -> u64 {
        self.grid as u64 * 2 * slot_bytes(tok) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_and_budgets() {
        assert_eq!(tok_for(1), Some(8));
        assert_eq!(tok_for(9), Some(16));
        assert_eq!(tok_for(256), Some(256));
        assert_eq!(tok_for(257), None);
        assert_eq!(tok_for(0), None);
        for l in LAYOUTS {
            assert!(l.stages >= 4, "{l:?}");
            assert!(l.smem_bytes <= crate::SM90_MAX_SMEM_PER_CTA);
        }
        assert_eq!(layout(256).stages, 4);
    }

    /// Every unit belongs to exactly one CTA; a tile's contributors are its units' owners, and a
    /// CTA's pieces other than its first and last tiles are whole tiles (no slot needed).
    #[test]
    fn split_covers_every_unit_once() {
        for (n, k, g) in [
            (4096, 4096, 132),
            (6144, 4096, 132),
            (8, 8, 132),
            (28672, 8192, 132),
            (1001, 200, 7),
            (256, 64, 1),
        ] {
            let s = DecodeSplit::new(n, k, g);
            assert!(s.grid >= 1 && s.grid as u64 <= s.units());
            for c in 0..s.grid {
                assert!(s.start(c) < s.start(c + 1), "every CTA has work");
                for u in s.start(c)..s.start(c + 1) {
                    assert_eq!(s.owner(u), c);
                }
                let (t0, t1) = (s.start(c) / s.k_blocks, (s.start(c + 1) - 1) / s.k_blocks);
                assert_eq!(s.slot(c, t0), 0);
                if t1 != t0 {
                    assert_eq!(s.slot(c, t1), 1);
                }
            }
            assert_eq!(s.start(s.grid) as u64, s.units());
            for t in 0..s.tiles {
                let (lo, hi) = s.contributors(t);
                assert!(lo <= hi && hi < s.grid);
                let whole = s.start(lo) <= t * s.k_blocks && s.start(lo + 1) >= (t + 1) * s.k_blocks;
                assert_eq!(whole, lo == hi);
            }
        }
    }
}
