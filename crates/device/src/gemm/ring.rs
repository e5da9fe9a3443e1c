//! The shared-memory ring: `stages` slots of (A tile, B tile), a `full` mbarrier per slot
//! (completed by the TMA bytes of the slot) and an `empty` mbarrier per slot (one arrival per
//! consumer warp once its wgmmas stopped reading the slot).
//!
//! Layout from the base of dynamic shared memory (1024-byte aligned), `mkernel_config::gemm::RingSmem`:
//! `[A0 B0][A1 B1]...[A(s-1) B(s-1)][epilogue staging: `epilogue_buffers` boxes per consumer][full 0..s][empty 0..s][aux][tick]`;
//! each kernel passes the [`RingLayout`] of its shared-memory struct.
use crate::arch::{mbarrier, smem::SmemAddr};
use mkernel_config::gemm::{RingLayout, AUX_BARRIERS};
use mkernel_config::GemmTile;

/// Addresses of the ring's slots and barriers.
#[derive(Clone, Copy)]
pub struct Ring {
    base: SmemAddr,
    layout: RingLayout,
}

/// Position in the ring: slot and the parity of the pass over the ring.
#[derive(Clone, Copy)]
pub struct RingPos {
    pub stage: u32,
    pub phase: u32,
}

impl RingPos {
    pub const START: RingPos = RingPos { stage: 0, phase: 0 };
    /// The next slot, flipping the phase at the end of the ring.
    #[inline(always)]
    pub fn advance(&mut self, stages: u32) {
        self.stage += 1;
        if self.stage == stages {
            self.stage = 0;
            self.phase ^= 1;
        }
    }
}

impl Ring {
    #[inline(always)]
    pub fn new(base: SmemAddr, layout: RingLayout) -> Ring {
        Ring { base, layout }
    }
    #[inline(always)]
    pub fn stages(&self) -> u32 {
        self.layout.tile.stages
    }
    /// A tile of slot `s`: block_m rows of 128 bytes, 128B-swizzled.
    #[inline(always)]
    pub fn a(&self, s: u32) -> SmemAddr {
        self.base.add(s * self.layout.tile.stage_tx_bytes())
    }
    /// B tile of slot `s`.
    #[inline(always)]
    pub fn b(&self, s: u32) -> SmemAddr {
        self.a(s).add(self.layout.tile.a_stage_bytes())
    }
    /// Epilogue staging box `buf` (`0..epilogue_buffers`) of consumer warpgroup `wg`: 64 rows
    /// of 128 bytes, 128B-swizzled, 1024-byte aligned.
    #[inline(always)]
    pub fn staging(&self, wg: u32, buf: u32) -> SmemAddr {
        self.base.add(
            self.layout.staging
                + (self.layout.tile.epilogue_buffers * wg + buf) * self.layout.tile.epilogue_box_bytes(),
        )
    }
    /// Whether every staging box of a tile has its own buffer (`GemmTile::epilogue_buffers`).
    #[inline(always)]
    pub fn whole_tile_staging(&self) -> bool {
        self.layout.tile.epilogue_buffers * GemmTile::EPILOGUE_BOX_COLS >= self.layout.tile.block_n
    }
    #[inline(always)]
    pub fn full(&self, s: u32) -> SmemAddr {
        self.base.add(self.layout.full + 8 * s)
    }
    #[inline(always)]
    pub fn empty(&self, s: u32) -> SmemAddr {
        self.base.add(self.layout.empty + 8 * s)
    }
    /// Auxiliary mbarrier `i` (one arrival; `mkernel_config::gemm::AUX_BARRIERS`).
    #[inline(always)]
    pub fn aux(&self, i: u32) -> SmemAddr {
        self.base.add(self.layout.aux + 8 * i)
    }
    /// Tick word `i` (`mkernel_config::gemm::TICK_WORDS`): a progress count one thread writes and
    /// others poll.
    #[inline(always)]
    pub fn tick(&self, i: u32) -> SmemAddr {
        self.base.add(self.layout.tick + 4 * i)
    }
    /// Initializes every barrier (one thread), then makes them visible
    /// to TMA; zeroes the tick counters.
    #[inline(always)]
    pub unsafe fn init(&self) {
        for i in 0..2 {
            unsafe { crate::arch::smem::st_volatile_shared_u32(self.tick(i), 0) };
        }
        for s in 0..self.layout.tile.stages {
            unsafe {
                mbarrier::init(self.full(s), 1);
                mbarrier::init(self.empty(s), self.layout.tile.consumer_warpgroups * 4);
            }
        }
        for i in 0..AUX_BARRIERS as u32 {
            unsafe { mbarrier::init(self.aux(i), 1) };
        }
        mbarrier::fence_init();
    }
}
