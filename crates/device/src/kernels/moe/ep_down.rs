//! `mk_moe_ep_down`: the expert-parallel down projection, which sends each finished row back to
//! its source on the node (docs/moe.md, "Rows pushed back"). The grouped GEMM runs as
//! `mk_moe_grouped_gemm` does, with two additions:
//!
//! - each consumer warpgroup adds 1 to its tile's expert's counter (`MoeEpArgs::done`) once the
//!   tile's bulk stores have completed (counted after the next tile's mainloop, so no wait);
//! - warps 2 and 3 of the producer warpgroup walk the local experts in order: once expert `l`'s
//!   counter says every tile of it is stored, they copy its rows that came from this node
//!   (the dispatch left `[epoch, rank << 32 | pair]` per receive row) into the sources'
//!   returned rows (`heap_ret`, row = pair), over NVLink, while the GEMM goes on with the next
//!   experts. The combine then reads those rows from its own memory.
//!
//! Rows from other nodes keep their way back through the proxy (the combine's PUTs from
//! `heap_yp`). Every CTA of the grid is resident at once (one per SM, at most the SMs); the
//! push warps wait only for tiles, which wait for nothing of theirs.
use super::ep::{aborting, layer_ctx, wait_word};
use super::grouped_gemm::Launch;
use super::{consumer, producer};
use crate::arch::{ids, memory, regs, shuffle, smem, sync, tma, tma::TensorMap};
use crate::gemm::ring::Ring;
use mkernel_config::comm::{wait_code, CommDesc, Role};
use mkernel_config::ops::moe::{
    grouped_gemm_role, GroupedGemmArgs, MoeEpArgs, EP_PRODUCER_REGS, GROUPED_GEMM_ROLES, RING, ROW_ALIGN, TILE,
};

/// # Safety
///
/// As `mk_moe_ep_combine` for `desc` and `args` (this layer's, after its routing, dispatch and up projection) and
/// `mk_moe_grouped_gemm` for `down` (the down projection's `GroupedGemmArgs` over this rank's rows, whole tiles, no
/// activation); `args.done` holds a zeroed `u64` per local expert; the grid is at most the CTAs resident at once.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_ep_down(
    desc: *const CommDesc,
    args: *const MoeEpArgs,
    down: *const GroupedGemmArgs,
) {
    let ring = Ring::new(smem::dynamic_smem_addr(), RING);
    if ids::thread_idx() == 0 {
        unsafe {
            tma::prefetch(TensorMap((*down).map_a as *const u8));
            tma::prefetch(TensorMap((*down).map_b as *const u8));
            tma::prefetch(TensorMap((*down).map_c as *const u8));
            ring.init();
        }
    }
    sync::sync_threads();
    let launch = Launch {
        args: down,
        swiglu: false,
        partial: false,
        k_blocks: unsafe { (*down).k }.div_ceil(TILE.block_k),
        combine: None,
        done: unsafe { (*args).done },
    };
    let wg = ids::warpgroup_idx();
    match GROUPED_GEMM_ROLES[grouped_gemm_role(wg)].first_warpgroup {
        0 => {
            regs::setmaxnreg_dec::<{ EP_PRODUCER_REGS }>();
            match ids::thread_idx() {
                0 => unsafe { producer::load_tiles(&ring, launch) },
                64..128 => unsafe { push(args, desc) },
                _ => {}
            }
        }
        _ => unsafe { consumer::run(&ring, launch, wg - 1) },
    }
}

/// Warps 2 and 3 of the producer warpgroup: for local experts `0, 1, ...` lane 0 waits
/// (bounded) until the expert's tile counter reaches `2 x` its tiles (two consumer
/// warpgroups count each tile), then the warps copy the expert's rows, row `r` by warp
/// `2 b + w` of the grid's `2 g` when `r - offset` is that index modulo `2 g`; a row is copied
/// when its source entry carries this launch's epoch. A failed wait leaves the error record
/// and stops the pushes (the combine's `Out` wait then times out on this rank's peers too).
///
/// # Safety
///
/// Called by threads `64..128` of `mk_moe_ep_down` (its contract).
#[inline(always)]
unsafe fn push(args: *const MoeEpArgs, desc: *const CommDesc) {
    let a = unsafe { args.read() };
    let (b, g) = (ids::block_idx(), ids::grid_dim());
    let c = unsafe { layer_ctx(desc, &a, b, Role::IntraComm) };
    if unsafe { aborting(&c) } {
        return;
    }
    let (warp, lane) = (ids::warp_idx() - 2, ids::lane_id());
    let pieces = a.hidden / 8;
    let row_bytes = a.hidden as u64 * 2;
    let n_tiles = a.hidden.div_ceil(TILE.block_n);
    let (counts, offsets) = (a.layout.counts as *const u32, a.layout.offsets as *const u32);
    let yp = c.heap(c.rank) + a.heap_yp;
    let src = c.heap(c.rank) + a.heap_src;
    for l in 0..a.local_experts {
        let (lo, hi) = unsafe { (offsets.add(l as usize).read(), offsets.add(l as usize + 1).read()) };
        if hi <= lo {
            continue;
        }
        let end = (lo + unsafe { counts.add(l as usize).read() }).min(hi);
        let target = (2 * n_tiles * ((hi - lo) / ROW_ALIGN)) as u64;
        // One lane polls; `bar.warp.sync` orders its acquire before the other lanes' loads.
        let ok = lane != 0
            || unsafe {
                wait_word(
                    &c,
                    (a.done + 8 * l as u64) as *const u64,
                    target,
                    wait_code::MOE_DOWN_TILES,
                    c.global_rank,
                    c.timeout_ns,
                )
            };
        let ok = shuffle::shfl_idx(ok as u32, 0) != 0;
        sync::sync_warp();
        if !ok {
            return;
        }
        let mut r = lo + 2 * b + warp;
        while r < end {
            let w = unsafe { memory::ld_v4((src + 16 * r as u64) as *const u8) };
            let (epoch, s, p) = ((w[0] as u64) | (w[1] as u64) << 32, w[3], w[2]);
            if epoch == c.epoch {
                let from = yp + r as u64 * row_bytes;
                let to = c.heap(s) + a.heap_ret + p as u64 * row_bytes;
                let mut q = lane;
                while q < pieces {
                    let mut v = [[0u32; 4]; 2];
                    for (u, vu) in v.iter_mut().enumerate() {
                        let qu = q + 32 * u as u32;
                        if qu < pieces {
                            *vu = unsafe { memory::ld_v4((from + 16 * qu as u64) as *const u8) };
                        }
                    }
                    for (u, vu) in v.iter().enumerate() {
                        let qu = q + 32 * u as u32;
                        if qu < pieces {
                            unsafe { memory::st_v4((to + 16 * qu as u64) as *mut u8, *vu) };
                        }
                    }
                    q += 2 * 32;
                }
            }
            r += 2 * g;
        }
    }
}
