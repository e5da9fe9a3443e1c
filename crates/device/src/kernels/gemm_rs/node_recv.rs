//! Across nodes: the warp that waits for the other nodes' sums of this rank's rows.
use super::shared::node_sums;
use super::shared::{fused_ctx_at, ldesc, lepoch, RS_RING};
use crate::arch::memory::Scope;
use crate::arch::{mbarrier, memory, smem};
use crate::comm::proxy;
use crate::comm::wait::wait_flag_of_cta;
use crate::gemm::ring::Ring;
use mkernel_config::comm::{FlagSlot, RemoteSlot, Role};
use mkernel_config::ops::gemm_rs::GemmRsArgs;

/// Warp 3 of compute CTA `idx` (lane 0), across nodes.
#[inline(always)]
pub(super) unsafe fn run(a: &GemmRsArgs, idx: u32) {
    // Warp 3: wait for the other nodes' sums of our rows (one PUT from each node's rank
    // of our rail), then arrive on the aux barrier, which the consumers wait for before
    // they add the sums (also after a failed wait, so theirs stays bounded: the error
    // record is written and the host reports it). Compute CTA 0 alone polls the
    // inter-node flags and raises `(FusedReady, own rank, 1)` locally for the others;
    // for AllReduce it then waits until every remote rank's reduced rows are in our
    // output (the launch ends after that).
    let mut c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    c.role = Role::InterReduce;
    let (nodes, node) = (c.global_world / c.world, c.global_rank / c.world);
    if idx == 0 {
        let mut all = true;
        for nd in 0..nodes {
            if nd != node && !unsafe { proxy::wait_remote(&c, RemoteSlot::FusedData, nd * c.world + c.rank) } {
                all = false;
                break;
            }
        }
        if all {
            unsafe {
                memory::st_release_u64(
                    Scope::Gpu,
                    c.flag_of_cta(c.rank, FlagSlot::FusedReady, c.rank, 1),
                    c.epoch,
                )
            };
        }
        unsafe { mbarrier::arrive(node_sums(&Ring::new(smem::dynamic_smem_addr(), RS_RING))) };
        if all && a.all_reduce != 0 {
            for q in 0..c.global_world {
                if q / c.world != node && !unsafe { proxy::wait_remote(&c, RemoteSlot::FusedOut, q) } {
                    break;
                }
            }
        }
    } else {
        // Twice CTA 0's patience: a stalled remote rank is reported by CTA 0's wait
        // (naming that rank), which also stops this one.
        let mut relay = c;
        relay.timeout_ns = c.timeout_ns.saturating_mul(2);
        let _ = unsafe { wait_flag_of_cta(&relay, FlagSlot::FusedReady, c.rank, 1, c.epoch) };
        unsafe { mbarrier::arrive(node_sums(&Ring::new(smem::dynamic_smem_addr(), RS_RING))) };
    }
}
