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
use mkernel_config::bulk::{BULK_BARS_OFFSET, BULK_LOOKAHEAD, BULK_STAGES, BULK_STAGE_BYTES};

/// Flags to raise once a copy's stores are complete: `red.release.sys.add` of `add` to each of
/// `flags[..n]` (device addresses, a peer's over NVLink).
#[derive(Clone, Copy)]
pub struct Release {
    pub flags: [u64; 8],
    pub n: u32,
    pub add: u64,
}

/// The ring, how many pieces it has carried (its mbarrier phases and bulk groups: one group
/// per piece), and a copy whose release is deferred ([`BulkRing::copy_deferred`]).
pub struct BulkRing {
    base: SmemAddr,
    pieces: u32,
    pending: Option<(Release, u32)>,
}

/// Bulk groups that may still be in flight while an older copy's release waits for its own.
const RELEASE_LAG: u32 = BULK_STAGES - BULK_LOOKAHEAD;

impl BulkRing {
    /// A ring at `base` (1024-byte aligned dynamic shared memory). One thread initialises it.
    #[inline(always)]
    pub unsafe fn new(base: SmemAddr) -> BulkRing {
        let r = BulkRing {
            base,
            pieces: 0,
            pending: None,
        };
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
        self.base.add(BULK_BARS_OFFSET + 8 * s)
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
        unsafe {
            self.copy_deferred(
                dsts,
                ndst,
                src,
                bytes,
                Release {
                    flags: [0; 8],
                    n: 0,
                    add: 0,
                },
            );
            self.flush();
        }
    }

    /// As [`BulkRing::copy`], but returns once the stores are issued; `release` is raised
    /// later, when this copy's stores are complete: during the next copy, once
    /// `RELEASE_LAG` newer bulk groups were issued (`cp.async.bulk.wait_group`, which keeps
    /// those in flight: the ring does not drain between copies), or at [`BulkRing::flush`].
    /// Call `flush` before anything that may wait on another rank: a held release could close
    /// a cycle.
    #[inline(always)]
    pub unsafe fn copy_deferred(&mut self, dsts: &[u64; 8], ndst: u32, src: u64, bytes: u64, release: Release) {
        let np = bytes.div_ceil(BULK_STAGE_BYTES as u64) as u32;
        let piece = |i: u32| -> (u64, u32) {
            let off = i as u64 * BULK_STAGE_BYTES as u64;
            (off, (bytes - off).min(BULK_STAGE_BYTES as u64) as u32)
        };
        let g0 = self.pieces;
        // The stages of the first loads last held pieces g0 - S .. g0 - S + L - 1: read once
        // at most S - L newer groups still read.
        tma::store_wait_read::<RELEASE_LAG>();
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
            if let Some((r, end)) = self.pending {
                if g + 1 - end >= RELEASE_LAG {
                    // Every group up to the older copy's last is complete.
                    tma::store_wait::<RELEASE_LAG>();
                    unsafe { raise(r) };
                    self.pending = None;
                }
            }
            let j = i + BULK_LOOKAHEAD;
            if j < np {
                tma::store_wait_read::<RELEASE_LAG>();
                let (off, len) = piece(j);
                unsafe { self.load(g0 + j, (src + off) as *const u8, len) };
            }
        }
        self.pieces = g0 + np;
        if self.pending.is_some() {
            // The older copy's stores are not yet known complete (this copy was short): wait
            // for every store, this copy's too, and raise both.
            unsafe {
                self.flush();
                raise(release);
            }
            return;
        }
        self.pending = Some((release, self.pieces));
    }

    /// Waits until every store issued is complete, then raises a deferred release.
    #[inline(always)]
    pub unsafe fn flush(&mut self) {
        tma::store_wait::<0>();
        memory::fence_proxy_async();
        if let Some((r, _)) = self.pending.take() {
            unsafe { raise(r) };
        }
    }
}

/// `red.release.sys.add` of `r.add` to each of `r.flags[..r.n]`, after `fence.proxy.async`
/// (the stores were made by the async proxy).
#[inline(always)]
unsafe fn raise(r: Release) {
    memory::fence_proxy_async();
    for (i, f) in r.flags.iter().enumerate() {
        if (i as u32) < r.n {
            unsafe { memory::red_release_add_u64(memory::Scope::Sys, *f as *mut u64, r.add) };
        }
    }
}
