//! The producer (lane 0 of warp 0 of a compute CTA): the TMA loads of A and B for each of the
//! CTA's work items.
use super::shared::free_slots;
use super::shared::{ldesc, RS_RING};
use super::stager::stager_runs;
use super::work_items::{item, stream_k};
use crate::arch::smem;
use crate::arch::tma::TensorMap;
use crate::comm::launch::{abort_word, producer_stall};
use crate::gemm::producer::{fill_without_data, load_tile_counted, wait_loads_landed};
use crate::gemm::ring::{Ring, RingPos};
use crate::gemm::BLayout;
use mkernel_config::ops::gemm_rs::GemmRsArgs;

/// The producer loop of compute CTA `idx`.
#[inline(always)]
pub(super) unsafe fn run(a: &GemmRsArgs, idx: u32, pos: RingPos) {
    let mut pos = pos;
    let ring = Ring::new(smem::dynamic_smem_addr(), RS_RING);
    let (mut w, items) = (0, stream_k().items(idx));
    // The consumers' work items: whole tiles, then stream-K pieces (K ranges), each read
    // from the work-item table ([`item`]).
    while w < items {
        let it = unsafe { item(idx, w) };
        w += 1;
        let (tile, a_row) = (it.tile, it.a_row);
        // Consumers that stop early keep freeing slots: every item's slots are filled -
        // once the rank aborted, without data (an aborted launch does not stream its
        // operands; the consumers stop at their next epilogue barrier).
        // With a stager, its trickle follows the count of free slots ([`Ring::tick`]).
        let count = stager_runs(a).then(|| free_slots(&ring));
        if unsafe { abort_word(ldesc()) } != 0 {
            let _ = unsafe { fill_without_data(&ring, &mut pos, it.k_len(), producer_stall(ldesc())) };
            continue;
        }
        let _ = unsafe {
            load_tile_counted::<true>(
                &ring,
                &mut pos,
                TensorMap(a.map_a as *const u8),
                a_row,
                TensorMap(a.map_b as *const u8),
                BLayout::Nk,
                tile,
                it.k0,
                it.k_len(),
                producer_stall(ldesc()),
                count,
            )
        };
    }
    // Consumers that stop early may leave fills unconsumed (also after this loop ended
    // normally): the CTA must not exit while they still land. Consumed ones pass at once.
    unsafe { wait_loads_landed(&ring, pos) };
}
