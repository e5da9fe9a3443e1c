//! `mk_moe_grouped_gemm`: the persistent warp-specialized GEMM over grouped rows. Row tile `i`
//! of A (capacity rows x k, every expert's group padded to whole tiles by the routing kernel)
//! is multiplied by its expert's weights `W[tile_expert[i]]` (one `experts * b_rows x k`
//! tensor, N x K per expert); the rows in use are read from device memory at the start, so
//! the launch (grid, arguments) is the same whatever the routing: hot experts have many row
//! tiles, empty experts none. The tile scheduler, ring, mainloop and epilogue are the plain
//! GEMM's (`crate::gemm`); the roles are [`GROUPED_GEMM_ROLES`].
//!
//! With SwiGLU a tile covers 128 output columns: its 256 B rows are the 128 gate rows and the
//! 128 up rows of those columns (two TMA boxes), and the epilogue stores
//! `silu(gate) * up` (two 64 x 64 boxes per consumer warpgroup).
//!
//! With `mode::PARTIAL_ROWS` a tile moves only its valid rows (the tile-expert word's padding
//! count), in boxes of `PARTIAL_BOX_ROWS`: A loads and C stores of an expert with few rows stop
//! there instead of moving a whole `block_m`-row tile (docs/moe.md, "Row-granular tiles").
use super::{consumer, producer};
use crate::arch::{ids, smem, sync, tma, tma::TensorMap};
use crate::gemm::ring::Ring;
use crate::gemm::scheduler::TileScheduler;
use mkernel_config::ops::moe::{
    act, grouped_gemm_role, mode, GroupedGemmArgs, GROUPED_GEMM_ROLES, RING, SWIGLU_TILE_COLS, TILE, TILE_EXPERT_MASK,
    TILE_PAD_SHIFT,
};

/// What both roles need of the launch.
#[derive(Clone, Copy)]
pub struct Launch {
    pub args: *const GroupedGemmArgs,
    pub swiglu: bool,
    /// [`mode::PARTIAL_ROWS`]: loads and stores cover a tile's valid rows only.
    pub partial: bool,
    pub k_blocks: u32,
    /// `mk_moe_grouped_gemm_combine`: where the epilogue adds its rows.
    pub combine: Option<Combine>,
}

/// The combine in the epilogue: row `i` of the grouped C, pair `p = row_pair[i]`, is added
/// times `weights[p]` into f32 row `p / top_k` of `out` (`n` columns).
#[derive(Clone, Copy)]
pub struct Combine {
    pub weights: *const f32,
    pub out: *mut f32,
}

impl Launch {
    /// The tiles of this CTA (the rows in use, read once per role).
    #[inline(always)]
    pub fn tiles(&self) -> TileScheduler {
        let (rows, n) = unsafe { (((*self.args).rows as *const u32).read_volatile(), (*self.args).n) };
        let block_n = if self.swiglu { SWIGLU_TILE_COLS } else { TILE.block_n };
        TileScheduler::new(
            rows,
            n,
            TILE.block_m,
            block_n,
            TILE.group_m,
            ids::block_idx(),
            ids::grid_dim(),
        )
    }

    /// The expert of the row tile at row `m0` and its valid rows (all `block_m` of them unless
    /// it is its expert's last tile).
    #[inline(always)]
    pub fn tile_expert(&self, m0: u32) -> (u32, u32) {
        let w = unsafe {
            ((*self.args).tile_expert as *const u32)
                .add((m0 / TILE.block_m) as usize)
                .read()
        };
        (
            w & TILE_EXPERT_MASK,
            TILE.block_m - (w >> TILE_PAD_SHIFT).min(TILE.block_m),
        )
    }
}

/// # Safety
///
/// The argument-block contract (`crate::kernels::moe`): `map_a`, `map_b` and `map_c` are tensor maps encoded as
/// `GroupedGemmArgs` says, `rows` and `tile_expert` were written by the routing kernel before this launch, with `rows`
/// at most the capacity the maps encode and every `tile_expert` of those rows `< experts`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_grouped_gemm(args: *const GroupedGemmArgs) {
    unsafe { run(args, None) }
}

/// The down projection with the combine in its epilogue: instead of storing
/// C, every grouped row's accumulators times its router weight are added into its token's f32
/// row of `out`.
///
/// # Safety
///
/// As [`mk_moe_grouped_gemm`], and `row_pair` of the block was written by `mk_moe_route` for these rows (a pair below
/// `tokens * top_k`, or `u32::MAX`); `weights` is the device address of `tokens * top_k` `f32`s and `out` a 16-byte
/// aligned device address of `tokens x n` f32 (zeroed before the launch: the kernel only adds) that nothing but this
/// kernel's reductions accesses while it runs; `n` is a multiple of 4 (each reduction adds 4 columns).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_moe_grouped_gemm_combine(
    args: *const GroupedGemmArgs,
    weights: *const f32,
    out: *mut f32,
) {
    unsafe { run(args, Some(Combine { weights, out })) }
}

/// Both entry points: ring set-up, then the warpgroup's role.
///
/// # Safety
///
/// As the entry point that calls it.
#[inline(always)]
unsafe fn run(args: *const GroupedGemmArgs, combine: Option<Combine>) {
    let ring = Ring::new(smem::dynamic_smem_addr(), RING);
    if ids::thread_idx() == 0 {
        unsafe {
            tma::prefetch(TensorMap((*args).map_a as *const u8));
            tma::prefetch(TensorMap((*args).map_b as *const u8));
            tma::prefetch(TensorMap((*args).map_c as *const u8));
            ring.init();
        }
    }
    sync::sync_threads();
    let flags = unsafe { (*args).act };
    let launch = Launch {
        args,
        swiglu: flags & act::MASK == act::SWIGLU,
        partial: flags & mode::PARTIAL_ROWS != 0,
        k_blocks: unsafe { (*args).k }.div_ceil(TILE.block_k),
        combine,
    };
    let wg = ids::warpgroup_idx();
    match GROUPED_GEMM_ROLES[grouped_gemm_role(wg)].first_warpgroup {
        0 => unsafe { producer::run(&ring, launch) },
        _ => unsafe { consumer::run(&ring, launch, wg - 1) },
    }
}
