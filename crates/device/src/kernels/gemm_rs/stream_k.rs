//! The stream-K tail's partials: a contributor piece's accumulators through the workspace to
//! the tile's owner.
use super::shared::{fused_ctx_at, ldesc};
use crate::arch::memory::Scope;
use crate::arch::sync::named_barrier_or;
use crate::arch::{ids, memory, sync};
use crate::comm::wait::wait_flag_of_cta;
use crate::gemm::epilogue::{add_acc_f32, store_acc_f32};
use crate::gemm::TILE;
use mkernel_config::comm::FlagSlot;
use mkernel_config::ops::gemm_rs::{GemmRsArgs, SK_SLOT_BYTES};
use mkernel_config::trace::Mark;

/// The workspace slot of consumer warpgroup `wg` of compute CTA `cta` (its stream-K partial).
#[inline(always)]
pub(super) fn sk_slot(a: &GemmRsArgs, cta: u32, wg: u32) -> u64 {
    a.sk_ws + (cta * TILE.consumer_warpgroups + wg - 1) as u64 * SK_SLOT_BYTES
}

/// A contributor piece's end ([`StreamK`]): the warpgroup's f32 accumulators go to its
/// workspace slot (thread-major 16-byte pieces: every store coalesced), then its leader raises
/// `(StreamK, wg - 1, cta)` to the launch epoch (`st.release.gpu` after the warpgroup's
/// barrier orders every thread's stores before it).
#[inline(always)]
pub(super) unsafe fn write_sk_partial(
    a: &GemmRsArgs,
    epoch: u64,
    cta: u32,
    wg: u32,
    acc: &[f32; 128],
    mark: impl Fn(Mark),
) {
    unsafe { store_acc_f32(acc, sk_slot(a, cta, wg)) };
    mark(Mark::Waited);
    sync::named_barrier_sync(wg, crate::arch::ids::WARPGROUP_THREADS);
    if ids::thread_in_warpgroup() == 0 {
        let c = unsafe { fused_ctx_at(ldesc(), epoch) };
        unsafe { memory::st_release_u64(Scope::Gpu, c.flag_of_cta(c.rank, FlagSlot::StreamK, wg - 1, cta), epoch) };
    }
}

/// An owned stream-K tile's other K ranges: the leader waits (bounded, error record) for the
/// flags of contributor CTAs `from..cta` (written at their first piece, long done), then every
/// thread adds their partials (through L2) to its accumulators. False when a wait gave up.
#[inline(always)]
pub(super) unsafe fn add_sk_partials(
    a: &GemmRsArgs,
    epoch: u64,
    from: u32,
    cta: u32,
    wg: u32,
    acc: &mut [f32; 128],
) -> bool {
    let mut ok = true;
    if ids::thread_in_warpgroup() == 0 {
        let mut c = unsafe { fused_ctx_at(ldesc(), epoch) };
        c.cta = cta;
        let mut f = from;
        while ok && f < cta {
            ok = unsafe { wait_flag_of_cta(&c, FlagSlot::StreamK, wg - 1, f, epoch) };
            f += 1;
        }
    }
    if named_barrier_or(wg, crate::arch::ids::WARPGROUP_THREADS, !ok) {
        return false;
    }
    let mut f = from;
    while f < cta {
        unsafe { add_acc_f32(acc, sk_slot(a, f, wg)) };
        f += 1;
    }
    true
}
