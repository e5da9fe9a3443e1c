//! Across nodes: the warp that PUTs a completed node block to its remote rank through the proxy.
use super::shared::{fused_ctx_at, ldesc, lepoch, node_blocks, HALVES};
use crate::comm::wait::wait_flag_of_cta;
use crate::comm::{proxy, CommCtx};
use crate::gemm::TILE;
use mkernel_config::comm::{CommDesc, FlagSlot, RemoteSlot, Role};
use mkernel_config::ops::gemm_rs::GemmRsArgs;

/// Node blocks whose PUTs this rank posts: across nodes the `nodes - 1` other nodes' blocks, and
/// for AllReduce also the own one; none on one node.
#[inline(always)]
pub(super) fn node_blocks_to_send(a: &GemmRsArgs) -> u32 {
    let d = unsafe { &*(ldesc() as *const CommDesc) };
    let nodes = d.global_world / d.world;
    if nodes == 1 {
        0
    } else if a.all_reduce != 0 {
        nodes
    } else {
        nodes - 1
    }
}

/// The sender of node block `j` (one thread): waits until every tile of the block is stored
/// (its `NodeSum` counter is full), then posts the block's PUT(s) ([`put_node_block`]). A
/// failed wait or post leaves the error record; the receivers' waits then end too.
#[inline(always)]
pub(super) unsafe fn send_node_block(a: &GemmRsArgs, j: u32) {
    let mut c = unsafe { fused_ctx_at(ldesc(), lepoch()) };
    c.role = Role::InterSend;
    c.cta = j;
    // The counter fills as this rank computes the block, which waits (bounded) on its peers: twice
    // the timeout for it, so a stalled peer is reported by the wait that names it.
    let mut patient = c;
    patient.timeout_ns = c.timeout_ns.saturating_mul(2);
    let (_, _, block_rows) = node_blocks(&c, a.m);
    let block_tiles = HALVES * (block_rows / TILE.block_m * a.n.div_ceil(TILE.block_n)) as u64;
    unsafe {
        if wait_flag_of_cta(&patient, FlagSlot::NodeSum, c.rank, j, block_tiles) {
            let _ = put_node_block(&c, a, j);
        }
    }
}

/// Posts the proxy PUT(s) of this rank's completed node block `j` (every tile of it stored):
/// `j < nodes - 1`: the node's sum of rail peer `(node + 1 + j) % nodes`'s rows, from the stage
/// into that rank's remote receive block of this node (`FusedData`); `j = nodes - 1`
/// (AllReduce): the reduced rows of this rank's chunk, into every remote rank's output
/// (`FusedOut`). Each destination's buffer is free once its remote `FusedReady` arrived.
#[inline(always)]
pub(super) unsafe fn put_node_block(c: &CommCtx, a: &GemmRsArgs, j: u32) -> bool {
    let (nodes, node, block_rows) = node_blocks(c, a.m);
    let block_bytes = block_rows as u64 * a.n as u64 * 2;
    unsafe {
        if j + 1 < nodes {
            let dst = (node + 1 + j) % nodes * c.world + c.rank;
            if !proxy::wait_remote(c, RemoteSlot::FusedReady, dst) {
                return false;
            }
            let (src_off, dst_off) = (
                a.stage_off + j as u64 * block_bytes,
                a.xrecv_off + node as u64 * block_bytes,
            );
            return proxy::put_value(c, dst, src_off, dst_off, block_bytes, RemoteSlot::FusedData, c.epoch).is_some();
        }
        let off = a.out_off + c.global_rank as u64 * block_bytes;
        for q in 0..c.global_world {
            if q / c.world != node
                && (!proxy::wait_remote(c, RemoteSlot::FusedReady, q)
                    || proxy::put_value(c, q, off, off, block_bytes, RemoteSlot::FusedOut, c.epoch).is_none())
            {
                return false;
            }
        }
    }
    true
}
