//! Bulk copies with TMA (`cp.async.bulk`), run by one thread: data streams from global memory
//! through a ring of shared-memory stages into one or more destinations (a peer's heap over
//! NVLink). A few CTAs move at NVLink rate this way, where thread-by-thread stores
//! ([`super::move_data::copy`]) need many SMs.
//!
//! Per piece `i` (stage `i % S`): a bulk load completes on the stage's mbarrier; once it
//! landed, one bulk store per destination is issued and committed as one bulk group. Loads run
//! `L` pieces ahead (`BULK_LOOKAHEAD`): the stage of piece `i + L` last held piece `i + L - S`,
//! whose stores have finished reading it once at most `S - L` newer groups are still reading
//! (`cp.async.bulk.wait_group.read S - L`). So up to `S - L` stores are in flight.
use crate::arch::{mbarrier, memory, smem::SmemAddr, tma};
use mkernel_config::fused::{BULK_LOOKAHEAD, BULK_STAGES, BULK_STAGE_BYTES};

/// The ring and how many pieces it has carried (its mbarrier phases).
pub struct BulkRing {
    base: SmemAddr,
    pieces: u32,
}

impl BulkRing {
    /// A ring at `base` (1024-byte aligned dynamic shared memory). One thread initialises it.
    #[inline(always)]
    pub unsafe fn new(base: SmemAddr) -> BulkRing {
        let r = BulkRing { base, pieces: 0 };
        for s in 0..BULK_STAGES {
            unsafe { mbarrier::init(r.bar(s), 1) };
        }
        mbarrier::fence_init();
        r
    }

    #[inline(always)]
    fn stage(&self, s: u32) -> SmemAddr {
        self.base.add(s * BULK_STAGE_BYTES)
    }

    #[inline(always)]
    fn bar(&self, s: u32) -> SmemAddr {
        self.base.add(BULK_STAGES * BULK_STAGE_BYTES + 8 * s)
    }

    /// Starts the load of piece `g` (global piece count), `len` bytes from `src`.
    #[inline(always)]
    unsafe fn load(&self, g: u32, src: *const u8, len: u32) {
        let s = g % BULK_STAGES;
        unsafe {
            mbarrier::arrive_expect_tx(self.bar(s), len);
            tma::bulk_load(self.stage(s), src, len, self.bar(s));
        }
    }

    /// Copies `bytes` (a multiple of 16, 16-byte aligned addresses) from `src` to each of
    /// `dsts[..ndst]`, and returns once every destination's copy is complete and visible to
    /// a later release by this thread (`cp.async.bulk.wait_group 0` + `fence.proxy.async`).
    #[inline(always)]
    pub unsafe fn copy(&mut self, dsts: &[u64; 8], ndst: u32, src: u64, bytes: u64) {
        let np = bytes.div_ceil(BULK_STAGE_BYTES as u64) as u32;
        let piece = |i: u32| -> (u64, u32) {
            let off = i as u64 * BULK_STAGE_BYTES as u64;
            (off, (bytes - off).min(BULK_STAGE_BYTES as u64) as u32)
        };
        let g0 = self.pieces;
        // The previous call's stores may still read the stages.
        tma::store_wait_read::<0>();
        for i in 0..np.min(BULK_LOOKAHEAD) {
            let (off, len) = piece(i);
            unsafe { self.load(g0 + i, (src + off) as *const u8, len) };
        }
        for i in 0..np {
            let g = g0 + i;
            let (off, len) = piece(i);
            unsafe { mbarrier::wait_parity(self.bar(g % BULK_STAGES), (g / BULK_STAGES) & 1) };
            for d in 0..8 {
                if d < ndst as usize {
                    unsafe { tma::bulk_store((dsts[d] + off) as *mut u8, self.stage(g % BULK_STAGES), len) };
                }
            }
            tma::store_commit();
            let j = i + BULK_LOOKAHEAD;
            if j < np {
                tma::store_wait_read::<{ BULK_STAGES - BULK_LOOKAHEAD }>();
                let (off, len) = piece(j);
                unsafe { self.load(g0 + j, (src + off) as *const u8, len) };
            }
        }
        self.pieces = g0 + np;
        tma::store_wait::<0>();
        memory::fence_proxy_async();
    }
}
