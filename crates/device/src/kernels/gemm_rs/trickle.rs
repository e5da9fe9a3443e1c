//! A ReduceScatter peer tile's bulk stores spread over the next mainloop (without stagers).
use super::shared::{largs, RS_RING, RS_TILE};
use crate::arch::tma::TensorMap;
use crate::arch::{ids, smem};
use crate::gemm::consumer::KBlockHook;
use crate::gemm::epilogue::store_staged_box;
use crate::gemm::ring::Ring;
use crate::gemm::scheduler::Tile;
use mkernel_config::ops::gemm_rs::GemmRsArgs;

/// A ReduceScatter peer partial tile (pushed without comm CTAs) staged at its epilogue, whose bulk stores
/// into the peer's receive buffer the warpgroup's leader issues during the next mainloop, one
/// staging box every quarter of it ([`KBlockHook`]). Issued at the epilogue, every CTA's 64 KiB
/// crossed NVLink at once (the CTAs finish their tiles nearly together), and the burst held up
/// the next mainloop's TMA loads behind it. Each box is its own bulk group, as when stored at
/// once, so the announcement rule ([`publish`]) is unchanged: the next epilogue finds them as
/// the newest `TILE_GROUPS` groups. All threads track `left`; the leader issues.
#[derive(Clone, Copy)]
pub(super) struct Trickle {
    /// Destination local rank (its receive buffer: `map_recv[dest]`).
    pub(super) dest: u32,
    /// The tile (rows inside the chunk).
    pub(super) m0: u32,
    pub(super) n0: u32,
    /// Boxes not yet issued (0: nothing staged).
    pub(super) left: u32,
}

impl Trickle {
    pub(super) const NONE: Trickle = Trickle {
        dest: 0,
        m0: 0,
        n0: 0,
        left: 0,
    };

    /// Issues the next box (consumer warpgroup `cw`: 0-based).
    #[inline(always)]
    pub(super) unsafe fn issue(&mut self, ring: &Ring, cw: u32) {
        if ids::thread_in_warpgroup() == 0 {
            let a = unsafe { &*(largs() as *const GemmRsArgs) };
            let map = TensorMap(unsafe { *a.map_recv.as_ptr().add(self.dest as usize) } as *const u8);
            unsafe {
                store_staged_box(
                    ring,
                    map,
                    Tile {
                        m0: self.m0,
                        n0: self.n0,
                    },
                    cw,
                    RS_TILE.epilogue_buffers - self.left,
                )
            };
        }
        self.left -= 1;
    }

    /// Issues every box not yet issued.
    #[inline(always)]
    pub(super) unsafe fn flush(&mut self, ring: &Ring, cw: u32) {
        while self.left > 0 {
            unsafe { self.issue(ring, cw) };
        }
    }
}

impl KBlockHook for Trickle {
    /// Box q goes out after K block (2q + 1) k_blocks / 8 (64 K blocks: 8, 24, 40, 56).
    #[inline(always)]
    fn at(&mut self, kb: u32, k_blocks: u32) {
        let q = RS_TILE.epilogue_buffers - self.left;
        if self.left > 0 && kb == (2 * q + 1) * k_blocks / (2 * RS_TILE.epilogue_buffers) {
            let cw = ids::warpgroup_idx() - 1;
            unsafe { self.issue(&Ring::new(smem::dynamic_smem_addr(), RS_RING), cw) };
        }
    }
}
