//! Mixture-of-experts expert FFN on one GPU: from the router's top-k expert ids and weights
//! (GPU tensors) to the layer's output, in five kernel launches with no host round trip (a
//! launch can be captured in a CUDA graph and replayed with new routing):
//!
//! ```text
//! out[t] = sum_j w[t, j] * FFN_{e(t, j)}(x[t]),  FFN_e(x) = W_down[e] act(W_up[e] x)
//! ```
//!
//! `act` is SwiGLU (`W_up[e]` has `2F` rows: `F` gate rows, then `F` up rows;
//! `silu(gate) * up`) or none (`F` rows). Weights are stored as `nn.Linear` stores them:
//! `W_up` is `E x up_rows x H`, `W_down` is `E x H x F`, bf16. Ids are `i32` (`T x top_k`,
//! row-major), weights `f32`, x and the output `T x H`. An id outside `0..E` is not routed
//! (its pair adds nothing) and is reported by [`MoePlan::take_error`]; it never causes a
//! write outside the plan's buffers. docs/moe.md has the layouts and the measured numbers.
use crate::comm::LaunchOrder;
use crate::error::{Error, Result};
use crate::gemm::{GemmOutput, OutDtype};
use crate::runtime::Device;
use crate::tensor_map::{encode_bf16_sw128_packed, TensorMap};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use mkernel_config::ops::moe::{
    self as cfg, act, mode, GroupedGemmArgs, MoeCombineArgs, MoeErrorRecord, MoeGatherArgs, MoeRouteArgs, MAX_EXPERTS,
    MAX_TOP_K, PARTIAL_BOX_ROWS, ROW_ALIGN, SWIGLU_TILE_COLS, TILE,
};
use mkernel_config::{GemmTile, KernelSpec};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

const OP: &str = "moe";

/// Activation between the up and the down projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(x W_gate^T) * (x W_up^T)`: `W_up[e]` holds `2F` rows, gate rows first.
    SwiGlu,
    /// `x W_up^T`: `W_up[e]` holds `F` rows.
    None,
}

impl Activation {
    /// Rows of `W_up` per expert for the FFN width `ffn`: `2 ffn` with SwiGLU, `ffn` without.
    pub(super) fn up_rows(self, ffn: usize) -> usize {
        match self {
            Activation::SwiGlu => ffn.saturating_mul(2),
            Activation::None => ffn,
        }
    }
    /// Output columns of one up-projection tile, and the box of its `W_up` map (a SwiGLU tile
    /// loads gate and up rows for each of its columns).
    pub(super) fn up_tile_cols(self) -> u32 {
        match self {
            Activation::SwiGlu => SWIGLU_TILE_COLS,
            Activation::None => TILE.block_n,
        }
    }
    /// The activation bits of `GroupedGemmArgs::act`.
    pub(super) fn flag(self) -> u32 {
        match self {
            Activation::SwiGlu => act::SWIGLU,
            Activation::None => act::NONE,
        }
    }
}

/// Sizes of one MoE expert FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    /// Tokens (`T`).
    pub tokens: usize,
    /// Experts (`E`).
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Model width (`H`).
    pub hidden: usize,
    /// Expert FFN width (`F`).
    pub ffn: usize,
    pub act: Activation,
}

impl MoeShape {
    /// Checks the sizes against the kernels' limits, with the reason when one is exceeded:
    /// `1 <= E <= 1024`, `1 <= top_k <= 32`, `H` and `F` multiples of 8 (16-byte rows for
    /// TMA), `T x top_k` and the grouped rows below 2^31, `E x up_rows` and `E x H` below 2^31.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::Shape { op: OP, reason });
        if self.tokens == 0 || self.experts == 0 || self.top_k == 0 || self.hidden == 0 || self.ffn == 0 {
            return bad(format!("empty dimension in {self:?}"));
        }
        if self.experts > MAX_EXPERTS as usize {
            return bad(format!("{} experts; at most {MAX_EXPERTS}", self.experts));
        }
        if self.top_k > MAX_TOP_K as usize {
            return bad(format!("top_k={}; at most {MAX_TOP_K}", self.top_k));
        }
        if self.hidden % 8 != 0 || self.ffn % 8 != 0 {
            return bad(format!(
                "hidden={} and ffn={} must be multiples of 8 (16-byte rows for TMA)",
                self.hidden, self.ffn
            ));
        }
        // Products saturate (the helpers below do too): a saturated value fails its limit.
        let limit = (i32::MAX as usize) / 2;
        if self.pairs() > limit || self.capacity_rows() > limit {
            return bad(format!("tokens x top_k = {} is too large", self.pairs()));
        }
        if self.experts.saturating_mul(self.up_rows()) > limit || self.experts.saturating_mul(self.hidden) > limit {
            return bad("experts x rows per expert must stay below 2^30".into());
        }
        if self.capacity_rows().saturating_mul(self.hidden.max(self.ffn)) > (u32::MAX as usize) * 8 {
            return bad("grouped buffers above 64 GiB".into());
        }
        Ok(())
    }
    /// (token, expert) pairs: `T x top_k` (saturating; [`MoeShape::validate`] bounds it).
    pub fn pairs(&self) -> usize {
        self.tokens.saturating_mul(self.top_k)
    }
    /// Rows of `W_up` per expert: `2F` with SwiGLU, `F` without.
    pub fn up_rows(&self) -> usize {
        self.act.up_rows(self.ffn)
    }
    /// Row tiles the grouped buffers hold (the worst case over all routings).
    pub fn max_tiles(&self) -> usize {
        worst_tiles(self.pairs(), self.experts)
    }
    /// Rows of the grouped buffers: every expert's group padded to whole row tiles.
    pub fn capacity_rows(&self) -> usize {
        self.max_tiles().saturating_mul(ROW_ALIGN as usize)
    }
    /// Elements of `W_up` and `W_down` (saturating).
    pub fn weight_lens(&self) -> (usize, usize) {
        (
            sat(&[self.experts, self.up_rows(), self.hidden]),
            sat(&[self.experts, self.hidden, self.ffn]),
        )
    }
    /// Floating-point operations of the routed rows (padding not counted):
    /// `2 T k H up_rows + 2 T k F H`.
    pub fn flops(&self) -> f64 {
        let r = self.pairs() as f64;
        2.0 * r * self.hidden as f64 * self.up_rows() as f64 + 2.0 * r * self.ffn as f64 * self.hidden as f64
    }
}

/// `mkernel_config::ops::moe::max_tiles` in `usize`, saturating: row tiles of the grouped
/// layout in the worst routing of `pairs` rows over `experts` groups.
pub(super) fn worst_tiles(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(ROW_ALIGN as usize).saturating_add(experts.min(pairs))
}

/// The product of `factors`, saturating at `usize::MAX` (sizes before validation).
pub(super) fn sat(factors: &[usize]) -> usize {
    factors.iter().fold(1usize, |a, &f| a.saturating_mul(f))
}

/// The kernel launches of [`MoePlan::launch`], in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeStage {
    /// `mk_moe_route`: counts, padded offsets, tile experts, slots, error record.
    Route,
    /// `mk_moe_gather`: token rows to their slots.
    Gather,
    /// `mk_moe_grouped_gemm`: up projection with the activation.
    Up,
    /// `mk_moe_grouped_gemm`: down projection.
    Down,
    /// `mk_moe_combine`: top-k weighted sum in token order.
    Combine,
}

impl MoeStage {
    pub const ALL: [MoeStage; 5] = [
        MoeStage::Route,
        MoeStage::Gather,
        MoeStage::Up,
        MoeStage::Down,
        MoeStage::Combine,
    ];
}

/// Where [`MoePlan`] takes the top-k weighted sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeCombine {
    /// `mk_moe_combine` after the down projection, which stores its grouped rows (bf16):
    /// `out[t]` sums `j` in order, so the layer is bitwise reproducible.
    Ordered,
    /// In the down projection's epilogue (`mk_moe_grouped_gemm_combine`): each grouped row's
    /// f32 accumulators, times its router weight, are added (`red.global.add.v4.f32`) into its
    /// token's f32 output row, zeroed first; a bf16 output goes through an f32 buffer of the
    /// plan (`T x H`) and `mk_moe_to_bf16`. No grouped down-projection rows are stored or
    /// read back, and the rows are not rounded to bf16 before the sum; the order of the
    /// top-k additions varies between runs (not bitwise reproducible).
    Epilogue,
}

/// Environment variable that forces [`MoePlan`]'s combine: `ordered` or `epilogue`.
pub const COMBINE_VAR: &str = "MKERNEL_MOE_COMBINE";

/// The combine [`MoePlan::new`] picks for `shape` ([`COMBINE_VAR`] overrides it).
pub fn moe_combine(shape: &MoeShape) -> MoeCombine {
    match std::env::var(COMBINE_VAR).as_deref() {
        Ok("ordered") => MoeCombine::Ordered,
        Ok("epilogue") => MoeCombine::Epilogue,
        _ => combine_for(shape),
    }
}

/// [`moe_combine`] without the environment.
fn combine_for(_shape: &MoeShape) -> MoeCombine {
    MoeCombine::Ordered
}

/// What the grouped buffers held after a launch ([`MoePlan::inspect`]; diagnostics and tests).
#[derive(Clone, Debug)]
pub struct MoeGrouped {
    /// Rows per expert.
    pub counts: Vec<u32>,
    /// First row of every expert's group (`E + 1`, the last is the rows in use).
    pub offsets: Vec<u32>,
    /// Row of pair `t * top_k + j` (`u32::MAX`: not routed).
    pub slots: Vec<u32>,
    /// Up projection after the activation, `capacity_rows x F` (rows in use only are defined).
    pub hidden_act: Vec<bf16>,
    /// Down projection, `capacity_rows x H` (not written with [`MoeCombine::Epilogue`]: what an
    /// earlier `Ordered` launch left, or zeros).
    pub down: Vec<bf16>,
}

/// Grids of an [`MoePlan`]'s launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeGrids {
    /// CTAs of the up and the down grouped GEMM: one per SM (at most `sms`), fewer when the
    /// worst routing has fewer tiles (persistent: each CTA loops over tiles, and one whose
    /// tiles the routing left empty exits at once).
    pub gemm: [u32; 2],
    /// CTAs of the gather and the combine: one per token, at most 8 per SM (256 threads each:
    /// 2048 resident threads per SM).
    pub rows: u32,
}

/// The launch policy of [`MoePlan`]: grids from the shape and the SM count (`sms` caps the
/// grouped GEMMs' CTAs). Fixed per plan, whatever the routing, so launches can be captured.
pub fn moe_grids(shape: &MoeShape, sm_count: u32, sms: Option<u32>) -> MoeGrids {
    let sms = sms.unwrap_or(sm_count).clamp(1, sm_count.max(1)) as usize;
    let grid = |n: usize, cols: u32| grouped_gemm_grid(shape.max_tiles(), n, cols, sms);
    MoeGrids {
        gemm: [
            grid(shape.ffn, shape.act.up_tile_cols()),
            grid(shape.hidden, TILE.block_n),
        ],
        rows: shape.tokens.clamp(1, 8 * sm_count.max(1) as usize) as u32,
    }
}

/// The grouped GEMMs' [`mode`] flags for an MoE layer of `shape` (fixed per plan):
/// row-granular tiles ([`mode::PARTIAL_ROWS`]: each expert's last tile loads and stores only its
/// valid rows) when the average expert has fewer rows than one tile. There most of A's and C's
/// rows would be padding while the kernels stream the weights; with more rows per expert the
/// padding is a small share and the partial tiles' extra 16-row TMA boxes cost more than they
/// save (measurements in docs/moe.md). [`MODE_VAR`] overrides the choice.
pub fn moe_gemm_mode(shape: &MoeShape) -> u32 {
    let forced = std::env::var(MODE_VAR).ok().and_then(|v| v.parse::<u32>().ok());
    gemm_mode_for(shape, forced)
}

/// Environment variable that forces [`moe_gemm_mode`]: `0` whole tiles, `1` row-granular.
pub const MODE_VAR: &str = "MKERNEL_MOE_MODE";

/// [`moe_gemm_mode`] without the environment: `forced` (0 or 1) wins when given.
fn gemm_mode_for(shape: &MoeShape, forced: Option<u32>) -> u32 {
    match forced {
        Some(0) => 0,
        Some(_) => mode::PARTIAL_ROWS,
        None if shape.pairs() < shape.experts * ROW_ALIGN as usize => mode::PARTIAL_ROWS,
        None => 0,
    }
}

/// CTAs of a grouped GEMM over `max_tiles` row tiles and `n` columns in tiles of `cols`: one
/// per tile, at least 1, at most `sms` (persistent CTAs loop over the tiles).
pub(super) fn grouped_gemm_grid(max_tiles: usize, n: usize, cols: u32, sms: usize) -> u32 {
    (max_tiles * n.div_ceil(cols as usize)).clamp(1, sms) as u32
}

/// The TMA map of a packed `rows x cols` bf16 operand of the grouped GEMMs.
pub(super) fn grouped_map(ptr: u64, cols: usize, rows: usize, box_cols: u32, box_rows: u32) -> Result<TensorMap> {
    encode_bf16_sw128_packed(ptr, cols as u64, rows as u64, box_cols, box_rows)
}

/// A plan's uploaded block of `len` bytes: the tensor maps `MAP_BYTES` apart from offset 0,
/// then each `(offset, bytes)` argument block.
pub(super) fn arg_block(len: usize, maps: &[TensorMap], blocks: &[(usize, &[u8])]) -> Vec<u8> {
    let mut block = vec![0u8; len];
    for (i, m) in maps.iter().enumerate() {
        block[i * MAP_BYTES..(i + 1) * MAP_BYTES].copy_from_slice(crate::tensor_map::bytes(m));
    }
    for &(at, b) in blocks {
        block[at..at + b.len()].copy_from_slice(b);
    }
    block
}

/// Checks a layer launch's buffer lengths: `x` and `out` `T x H`, `ids` and `weights` one per
/// (token, expert) pair.
pub(super) fn check_layer_lens(
    op: &'static str,
    tokens_x_hidden: usize,
    pairs: usize,
    [x, ids, weights, out]: [usize; 4],
) -> Result<()> {
    crate::check::exact_lens(
        op,
        &[
            ("x", x, tokens_x_hidden),
            ("ids", ids, pairs),
            ("weights", weights, pairs),
            ("out", out, tokens_x_hidden),
        ],
    )
}

/// Refuses a launch's stream and buffers of another CUDA context than `device`'s.
pub(super) fn check_layer_contexts<O>(
    op: &'static str,
    device: &Device,
    stream: &CudaStream,
    x: &CudaSlice<bf16>,
    ids: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    out: &CudaSlice<O>,
) -> Result<()> {
    crate::check::stream_on(op, device, stream)?;
    crate::check::buffer_on(op, "x", device, x)?;
    crate::check::buffer_on(op, "ids", device, ids)?;
    crate::check::buffer_on(op, "weights", device, weights)?;
    crate::check::buffer_on(op, "out", device, out)
}

/// Reads the 4-word error record at word `at` of `words` (synchronizes `stream`); when it is
/// set, clears it on the device and returns it.
pub(super) fn take_record(stream: &Arc<CudaStream>, words: &mut CudaSlice<u32>, at: usize) -> Result<Option<[u32; 4]>> {
    let mut rec = [0u32; 4];
    stream.memcpy_dtoh(&words.slice(at..at + 4), &mut rec)?;
    stream.synchronize()?;
    if rec[0] == 0 {
        return Ok(None);
    }
    stream.memset_zeros(&mut words.slice_mut(at..at + 4))?;
    Ok(Some(rec))
}

/// The error of a set routing error record ([`MoeErrorRecord`] words) for a layer of
/// `experts` experts, `top_k` per token.
pub(super) fn expert_id_error(rec: [u32; 4], top_k: usize, experts: usize) -> Error {
    let r = MoeErrorRecord {
        flag: rec[0],
        pair: rec[1],
        id: rec[2] as i32,
        bad: rec[3],
    };
    Error::MoeExpertId {
        token: r.pair as usize / top_k,
        k: r.pair as usize % top_k,
        id: r.id,
        experts,
        bad: r.bad as usize,
    }
}

/// An MoE expert FFN ready to launch: arguments and TMA descriptors uploaded, the grouped
/// buffers allocated (sized for the worst routing). Borrows the expert weights for `'a`.
///
/// # Launch order
/// The plan's launches share its grouped buffers, so they must not overlap on the device. The
/// plan orders them itself (`launch(&self)` stays shareable between threads): each launch
/// takes the plan's lock while it enqueues, and a launch on another stream than the previous
/// one first waits for an event recorded on that stream. Launches into a CUDA graph capture
/// are not ordered this way (replay the graph on the stream of the direct launches, or
/// synchronize between them). `&mut self` would only keep two threads apart, not two streams
/// of one thread.
pub struct MoePlan<'a> {
    shape: MoeShape,
    device: Device,
    order: Mutex<LaunchOrder>,
    route: CudaFunction,
    gather: CudaFunction,
    gemm: CudaFunction,
    combine: CudaFunction,
    gemm_combine: CudaFunction,
    to_bf16: CudaFunction,
    combine_mode: MoeCombine,
    /// With [`MoeCombine::Epilogue`]: the f32 sums of a bf16 output (`T x H`).
    sums: Option<CudaSlice<f32>>,
    /// Tensor maps and argument blocks (see `ARG_*`).
    args: CudaSlice<u8>,
    /// The grouped token rows (kept alive for the kernels; read by the up projection).
    _xp: CudaSlice<bf16>,
    hid: CudaSlice<bf16>,
    yp: CudaSlice<bf16>,
    /// counts (E) | offsets (E + 1) | rows (1) | error record (4) | tile_expert | slots |
    /// row_pair (capacity rows).
    words: CudaSlice<u32>,
    gemm_grid: [u32; 2],
    row_grid: u32,
    _weights: PhantomData<&'a ()>,
}

/// Byte offsets in the uploaded block: ten tensor maps (128 bytes each: A, its
/// `PARTIAL_BOX_ROWS` twin, W, C and its twin of the up projection, then the same five of the
/// down projection), then the argument blocks (128 bytes apart).
pub(super) const MAP_BYTES: usize = 128;
const ARG_ROUTE: usize = 10 * MAP_BYTES;
const _: () = assert!(MAP_BYTES as u64 == mkernel_config::ops::moe::PARTIAL_MAP_OFFSET);
const ARG_GATHER: usize = ARG_ROUTE + 128;
const ARG_UP: usize = ARG_GATHER + 128;
const ARG_DOWN: usize = ARG_UP + 128;
const ARG_COMBINE: usize = ARG_DOWN + 128;
const ARG_BYTES: usize = ARG_COMBINE + 128;

impl<'a> MoePlan<'a> {
    /// Plans the layer for `shape` with the expert weights `w_up` (`E x up_rows x H`) and
    /// `w_down` (`E x H x F`). `sms` caps the grouped GEMMs' CTAs (default: every SM).
    pub fn new(
        device: &Device,
        stream: &Arc<CudaStream>,
        shape: MoeShape,
        w_up: &'a CudaSlice<bf16>,
        w_down: &'a CudaSlice<bf16>,
        sms: Option<u32>,
    ) -> Result<Self> {
        shape.validate()?;
        crate::check::stream_on(OP, device, stream)?;
        crate::check::buffer_on(OP, "W_up", device, w_up)?;
        crate::check::buffer_on(OP, "W_down", device, w_down)?;
        let (lu, ld) = shape.weight_lens();
        crate::check::lens(OP, &[("W_up", w_up.len(), lu), ("W_down", w_down.len(), ld)])?;
        let (pu, _ru) = w_up.device_ptr(stream);
        let (pd, _rd) = w_down.device_ptr(stream);
        // SAFETY: the weights are borrowed for 'a and hold the shape's elements.
        unsafe { Self::new_raw(device, stream, shape, pu, pd, sms) }
    }

    /// As [`MoePlan::new`] on raw device addresses of the weights (16-byte aligned).
    ///
    /// # Safety
    /// `w_up` and `w_down` must hold `shape.weight_lens()` bf16 elements on `device` and stay
    /// valid while the plan is launched.
    pub unsafe fn new_raw(
        device: &Device,
        stream: &Arc<CudaStream>,
        shape: MoeShape,
        w_up: u64,
        w_down: u64,
        sms: Option<u32>,
    ) -> Result<Self> {
        shape.validate()?;
        crate::check::stream_on(OP, device, stream)?;
        crate::check::aligned16(OP, &[("W_up", w_up), ("W_down", w_down)])?;
        let (e, h, f) = (shape.experts, shape.hidden, shape.ffn);
        let cap = shape.capacity_rows();
        let max_tiles = shape.max_tiles();
        let xp = stream.alloc_zeros::<bf16>(cap * h)?;
        let hid = stream.alloc_zeros::<bf16>(cap * f)?;
        let yp = stream.alloc_zeros::<bf16>(cap * h)?;
        let n_words = e + (e + 1) + 1 + 4 + max_tiles + shape.pairs() + cap;
        let words = stream.alloc_zeros::<u32>(n_words)?;
        let base = words.device_ptr(stream).0;
        let (counts, offsets) = (base, base + 4 * e as u64);
        let rows = offsets + 4 * (e as u64 + 1);
        let error = rows + 4;
        let tile_expert = error + 16;
        let slots = tile_expert + 4 * max_tiles as u64;
        let row_pair = slots + 4 * shape.pairs() as u64;
        let (pxp, phid, pyp) = (
            xp.device_ptr(stream).0,
            hid.device_ptr(stream).0,
            yp.device_ptr(stream).0,
        );

        let t = TILE;
        let map = grouped_map;
        let b_up_box = shape.act.up_tile_cols();
        let gemm_mode = moe_gemm_mode(&shape);
        let (box_c, part) = (GemmTile::EPILOGUE_BOX_COLS, PARTIAL_BOX_ROWS);
        // Every A and C map with its PARTIAL_BOX_ROWS twin right after it (see `ARG_ROUTE`).
        let maps = [
            map(pxp, h, cap, t.block_k, t.block_m)?,
            map(pxp, h, cap, t.block_k, part)?,
            map(w_up, h, e * shape.up_rows(), t.block_k, b_up_box)?,
            map(phid, f, cap, box_c, GemmTile::EPILOGUE_BOX_ROWS)?,
            map(phid, f, cap, box_c, part)?,
            map(phid, f, cap, t.block_k, t.block_m)?,
            map(phid, f, cap, t.block_k, part)?,
            map(w_down, f, e * h, t.block_k, t.block_n)?,
            map(pyp, h, cap, box_c, GemmTile::EPILOGUE_BOX_ROWS)?,
            map(pyp, h, cap, box_c, part)?,
        ];
        // Where the block will be: allocate first, then fill in addresses.
        let mut args = stream.alloc_zeros::<u8>(ARG_BYTES)?;
        let abase = args.device_ptr(stream).0;
        let map_at = |i: usize| abase + (i * MAP_BYTES) as u64;
        let route = MoeRouteArgs {
            counts,
            offsets,
            tile_expert,
            rows,
            slots,
            error,
            row_pair,
            pairs: shape.pairs() as u32,
            experts: e as u32,
            max_tiles: max_tiles as u32,
            _pad: 0,
        };
        let gather = MoeGatherArgs {
            slots,
            xp: pxp,
            tokens: shape.tokens as u32,
            top_k: shape.top_k as u32,
            hidden: h as u32,
            _pad: 0,
        };
        let up = GroupedGemmArgs {
            map_a: map_at(0),
            map_b: map_at(2),
            map_c: map_at(3),
            rows,
            tile_expert,
            n: f as u32,
            k: h as u32,
            b_rows: shape.up_rows() as u32,
            act: shape.act.flag() | gemm_mode,
            row_pair: 0,
            top_k: 0,
            _pad: 0,
        };
        let down = GroupedGemmArgs {
            map_a: map_at(5),
            map_b: map_at(7),
            map_c: map_at(8),
            rows,
            tile_expert,
            n: h as u32,
            k: f as u32,
            b_rows: h as u32,
            act: act::NONE | gemm_mode,
            row_pair,
            top_k: shape.top_k as u32,
            _pad: 0,
        };
        let combine = MoeCombineArgs {
            slots,
            yp: pyp,
            tokens: shape.tokens as u32,
            top_k: shape.top_k as u32,
            hidden: h as u32,
            _pad: 0,
        };
        let block = arg_block(
            ARG_BYTES,
            &maps,
            &[
                (ARG_ROUTE, bytemuck::bytes_of(&route)),
                (ARG_GATHER, bytemuck::bytes_of(&gather)),
                (ARG_UP, bytemuck::bytes_of(&up)),
                (ARG_DOWN, bytemuck::bytes_of(&down)),
                (ARG_COMBINE, bytemuck::bytes_of(&combine)),
            ],
        );
        stream.memcpy_htod(&block, &mut args)?;

        let grids = moe_grids(&shape, device.sm_count(), sms);
        MoePlan {
            shape,
            device: device.clone(),
            order: Mutex::new(LaunchOrder::default()),
            route: device.function(&cfg::MOE_ROUTE)?,
            gather: device.function(&cfg::MOE_GATHER)?,
            gemm: device.function(&cfg::MOE_GROUPED_GEMM)?,
            combine: device.function(&cfg::MOE_COMBINE)?,
            gemm_combine: device.function(&cfg::MOE_GROUPED_GEMM_COMBINE)?,
            to_bf16: device.function(&cfg::MOE_TO_BF16)?,
            combine_mode: MoeCombine::Ordered,
            sums: None,
            args,
            _xp: xp,
            hid,
            yp,
            words,
            gemm_grid: grids.gemm,
            row_grid: grids.rows,
            _weights: PhantomData,
        }
        .with_combine(stream, moe_combine(&shape))
    }

    /// Enqueues the layer on `stream`: `out = MoE(x)` with the routing `ids` (`T x top_k`
    /// i32) and `weights` (`T x top_k` f32); `out` is `T x H`, bf16 or f32.
    pub fn launch<O: GemmOutput>(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<bf16>,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        out: &mut CudaSlice<O>,
    ) -> Result<()> {
        for stage in MoeStage::ALL {
            self.launch_stage(stage, stream, x, ids, weights, out)?;
        }
        Ok(())
    }

    /// Enqueues one stage of [`MoePlan::launch`] (diagnostics: each stage reads what the
    /// earlier ones left in the plan's buffers, so a stage can be timed alone once the
    /// earlier ones ran). With [`MoeCombine::Epilogue`], `Down` zeroes the f32 sums (`out`, or
    /// the plan's buffer for a bf16 `out`) and runs the down projection with the combine, and
    /// `Combine` converts the plan's sums to a bf16 `out` (nothing for an f32 `out`).
    pub fn launch_stage<O: GemmOutput>(
        &self,
        stage: MoeStage,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<bf16>,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        out: &mut CudaSlice<O>,
    ) -> Result<()> {
        let s = &self.shape;
        check_layer_lens(
            OP,
            s.tokens * s.hidden,
            s.pairs(),
            [x.len(), ids.len(), weights.len(), out.len()],
        )?;
        check_layer_contexts(OP, &self.device, stream, x, ids, weights, out)?;
        // Held until this stage is enqueued; the stream follows the plan's previous launch.
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        order.follow(stream)?;
        let a = self.args.device_ptr(stream).0;
        let f32_out = (O::DTYPE == OutDtype::F32) as u32;
        // SAFETY: for every stage the argument lists match the kernels' (`mkernel_config::ops::moe`
        // argument blocks at the uploaded addresses, then the launch-time buffers), the
        // buffers hold the shape's elements (checked above), the grouped buffers are the
        // plan's own.
        unsafe {
            match stage {
                MoeStage::Route => {
                    let at = a + ARG_ROUTE as u64;
                    stream
                        .launch_builder(&self.route)
                        .arg(&at)
                        .arg(ids)
                        .launch(Device::launch_config(&cfg::MOE_ROUTE, 1))?;
                }
                MoeStage::Gather => {
                    let at = a + ARG_GATHER as u64;
                    stream
                        .launch_builder(&self.gather)
                        .arg(&at)
                        .arg(x)
                        .launch(Device::launch_config(&cfg::MOE_GATHER, self.row_grid))?;
                }
                MoeStage::Down if self.combine_mode == MoeCombine::Epilogue => {
                    // The f32 sums: `out` itself when it is f32, else the plan's buffer. The
                    // guards live until both writers are enqueued (cudarc records the write then).
                    let (target, _out_guard, _sums_guard) = match (O::DTYPE, &self.sums) {
                        (OutDtype::F32, _) => {
                            let (p, g) = out.device_ptr_mut(stream);
                            (p, Some(g), None)
                        }
                        (OutDtype::Bf16, Some(sums)) => {
                            let (p, g) = sums.device_ptr(stream);
                            (p, None, Some(g))
                        }
                        (OutDtype::Bf16, None) => {
                            return Err(Error::Shape {
                                op: OP,
                                reason: "the epilogue combine of a bf16 output needs the plan's f32 sums".into(),
                            })
                        }
                    };
                    let bytes = s.tokens * s.hidden * 4;
                    cudarc::driver::result::memset_d8_async(target, 0, bytes, stream.cu_stream())?;
                    let at = a + ARG_DOWN as u64;
                    stream
                        .launch_builder(&self.gemm_combine)
                        .arg(&at)
                        .arg(weights)
                        .arg(&target)
                        .launch(Device::launch_config(&cfg::MOE_GROUPED_GEMM_COMBINE, self.gemm_grid[1]))?;
                }
                MoeStage::Combine if self.combine_mode == MoeCombine::Epilogue => {
                    if let Some(sums) = &self.sums {
                        if f32_out == 0 {
                            let n = (s.tokens * s.hidden) as u64;
                            stream
                                .launch_builder(&self.to_bf16)
                                .arg(sums)
                                .arg(out)
                                .arg(&n)
                                .launch(Device::launch_config(&cfg::MOE_TO_BF16, self.row_grid))?;
                        }
                    }
                }
                MoeStage::Up | MoeStage::Down => {
                    let (arg, grid) = if stage == MoeStage::Up {
                        (ARG_UP, self.gemm_grid[0])
                    } else {
                        (ARG_DOWN, self.gemm_grid[1])
                    };
                    let at = a + arg as u64;
                    stream
                        .launch_builder(&self.gemm)
                        .arg(&at)
                        .launch(Device::launch_config(&cfg::MOE_GROUPED_GEMM, grid))?;
                }
                MoeStage::Combine => {
                    let at = a + ARG_COMBINE as u64;
                    stream
                        .launch_builder(&self.combine)
                        .arg(&at)
                        .arg(weights)
                        .arg(out)
                        .arg(&f32_out)
                        .launch(Device::launch_config(&cfg::MOE_COMBINE, self.row_grid))?;
                }
            }
        }
        Ok(())
    }

    /// Where this plan takes the top-k weighted sum.
    pub fn combine(&self) -> MoeCombine {
        self.combine_mode
    }

    /// The plan with its combine set to `combine` (instead of [`moe_combine`]'s choice); for
    /// [`MoeCombine::Epilogue`] it allocates the `T x H` f32 sums (used only for a bf16 `out`),
    /// for `Ordered` it frees them. The kernels and argument blocks are the same for both: the
    /// launch picks the entry points. A CUDA graph captured before this call still launches
    /// the old sequence and reads the old sums: capture again after it.
    pub fn with_combine(mut self, stream: &Arc<CudaStream>, combine: MoeCombine) -> Result<Self> {
        self.sums = match combine {
            MoeCombine::Ordered => None,
            MoeCombine::Epilogue => match self.sums.take() {
                Some(s) => Some(s),
                None => Some(stream.alloc_zeros::<f32>(self.shape.tokens * self.shape.hidden)?),
            },
        };
        self.combine_mode = combine;
        Ok(self)
    }

    /// Reads and clears the routing error record (synchronizes `stream`): an error naming
    /// the first out-of-range expert id seen since the last call, and how many pairs had one.
    pub fn take_error(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let e = self.shape.experts;
        match take_record(stream, &mut self.words, 2 * e + 2)? {
            None => Ok(()),
            Some(rec) => Err(expert_id_error(rec, self.shape.top_k, e)),
        }
    }

    /// Copies the routing and the grouped buffers of the last launch back (synchronizes).
    pub fn inspect(&self, stream: &Arc<CudaStream>) -> Result<MoeGrouped> {
        let e = self.shape.experts;
        let w = stream.clone_dtoh(&self.words)?;
        let slots_at = 2 * e + 2 + 4 + self.shape.max_tiles();
        Ok(MoeGrouped {
            counts: w[..e].to_vec(),
            offsets: w[e..2 * e + 1].to_vec(),
            slots: w[slots_at..slots_at + self.shape.pairs()].to_vec(),
            hidden_act: stream.clone_dtoh(&self.hid)?,
            down: stream.clone_dtoh(&self.yp)?,
        })
    }

    /// The planned shape.
    pub fn shape(&self) -> MoeShape {
        self.shape
    }
    /// CTAs of the up and down grouped GEMMs.
    pub fn gemm_grid(&self) -> [u32; 2] {
        self.gemm_grid
    }
    /// The grouped GEMMs' kernel spec.
    pub fn gemm_spec(&self) -> &'static KernelSpec {
        &cfg::MOE_GROUPED_GEMM
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn shape(tokens: usize, experts: usize, top_k: usize, hidden: usize, ffn: usize) -> MoeShape {
        MoeShape {
            tokens,
            experts,
            top_k,
            hidden,
            ffn,
            act: Activation::SwiGlu,
        }
    }
    #[test]
    fn shapes_are_validated() {
        assert!(shape(4096, 64, 8, 4096, 2048).validate().is_ok());
        assert!(shape(1, 1, 1, 8, 8).validate().is_ok());
        let e = shape(16, 2048, 8, 64, 64).validate().unwrap_err().to_string();
        assert!(e.contains("at most 1024"), "{e}");
        let e = shape(16, 8, 33, 64, 64).validate().unwrap_err().to_string();
        assert!(e.contains("top_k=33"), "{e}");
        let e = shape(16, 8, 2, 100, 64).validate().unwrap_err().to_string();
        assert!(e.contains("multiples of 8"), "{e}");
        assert!(shape(0, 8, 2, 64, 64).validate().is_err());
    }
    /// The wraps a read of main found: `ffn = 2^62` passed the checks (4 x 2^63 wrapped), and
    /// `tokens = 2^59 + 1` with top-32 gave 32 pairs.
    #[test]
    fn huge_sizes_are_refused_not_wrapped() {
        assert!(shape(1, 4, 1, 8, 1 << 62).validate().is_err());
        let s = shape((1 << 59) + 1, 8, 32, 8, 8);
        assert_eq!(s.pairs(), usize::MAX);
        assert!(s.validate().is_err());
        assert!(shape(usize::MAX, usize::MAX, usize::MAX, usize::MAX, usize::MAX)
            .validate()
            .is_err());
        let g = GroupedGemmShape {
            groups: 1,
            capacity_rows: 128,
            n: 8,
            k: 1 << 40,
            act: Activation::None,
        };
        assert!(
            g.validate().is_err(),
            "k above 2^31 would be cut to u32 in the arguments"
        );
    }

    proptest::proptest! {
        /// Any sizes: no panic, and an accepted shape's sizes are exact (the checked products
        /// exist) and within the kernels' u32 arguments.
        #[test]
        fn accepted_moe_shapes_have_exact_sizes(
            tokens in size(), experts in size(), top_k in size(), hidden in size(), ffn in size(), swiglu: bool,
        ) {
            let act = if swiglu { Activation::SwiGlu } else { Activation::None };
            let s = MoeShape { tokens, experts, top_k, hidden, ffn, act };
            if s.validate().is_ok() {
                let pairs = tokens.checked_mul(top_k).unwrap();
                proptest::prop_assert_eq!(s.pairs(), pairs);
                proptest::prop_assert!(pairs <= u32::MAX as usize);
                let up = if swiglu { ffn.checked_mul(2).unwrap() } else { ffn };
                let (lu, ld) = s.weight_lens();
                proptest::prop_assert_eq!(Some(lu), experts.checked_mul(up).and_then(|x| x.checked_mul(hidden)));
                proptest::prop_assert_eq!(Some(ld), experts.checked_mul(hidden).and_then(|x| x.checked_mul(ffn)));
                let cap = s.capacity_rows();
                proptest::prop_assert_eq!(cap, cfg::max_tiles(pairs as u32, experts as u32) as usize * 128);
                proptest::prop_assert!(cap.checked_mul(hidden.max(ffn)).is_some());
                proptest::prop_assert!(hidden <= u32::MAX as usize && ffn <= u32::MAX as usize);
            }
        }

        #[test]
        fn accepted_grouped_gemm_shapes_have_exact_sizes(
            groups in size(), rows in size(), n in size(), k in size(), swiglu: bool,
        ) {
            let act = if swiglu { Activation::SwiGlu } else { Activation::None };
            let g = GroupedGemmShape { groups, capacity_rows: rows, n, k, act };
            if g.validate().is_ok() {
                proptest::prop_assert!(n <= i32::MAX as usize && k <= i32::MAX as usize);
                proptest::prop_assert!(rows.checked_mul(k).is_some() && rows.checked_mul(n).is_some());
                let w = groups.checked_mul(g.w_rows()).and_then(|x| x.checked_mul(k));
                proptest::prop_assert!(w.is_some());
            }
        }

        /// The padded offsets against a u64 reference: exact where they fit u32, an error where not.
        #[test]
        fn padded_offsets_fit_or_fail(counts in proptest::collection::vec(proptest::prop_oneof![
            0u32..300, proptest::num::u32::ANY, (u32::MAX - 200)..=u32::MAX
        ], 0..8)) {
            let mut at = 0u64;
            let mut want = vec![];
            for &c in &counts {
                want.push(at);
                at += (c as u64).div_ceil(128) * 128;
            }
            want.push(at);
            match padded_offsets(&counts) {
                Ok(v) => proptest::prop_assert_eq!(v.iter().map(|&x| x as u64).collect::<Vec<_>>(), want),
                Err(_) => proptest::prop_assert!(at > u32::MAX as u64),
            }
        }
    }

    /// Sizes from small to the top of `usize`: most draws near the limits.
    fn size() -> impl proptest::strategy::Strategy<Value = usize> {
        proptest::prop_oneof![
            0usize..4096,
            (0u32..64).prop_map(|e| 1usize << e),
            (0u32..64).prop_map(|e| (1usize << e) + 1),
            proptest::num::usize::ANY,
            (usize::MAX - 255)..=usize::MAX,
        ]
    }
    use proptest::strategy::Strategy as _;

    #[test]
    fn grids_follow_the_worst_routing_and_the_sm_cap() {
        // T = 128, top-8 over 64 experts: 8 + 64 row tiles, 16 SwiGLU and 16 down column tiles.
        let g = moe_grids(&shape(128, 64, 8, 4096, 2048), 132, None);
        assert_eq!(
            g,
            MoeGrids {
                gemm: [132, 132],
                rows: 128
            }
        );
        // One token, one expert: the capacity bound counts 2 row tiles (ceil(1 / 128) + 1),
        // one column tile each.
        let g = moe_grids(&shape(1, 1, 1, 256, 128), 132, None);
        assert_eq!(g, MoeGrids { gemm: [2, 2], rows: 1 });
        // A cap below the SM count; many tokens: 8 row CTAs per SM.
        let g = moe_grids(&shape(65536, 16, 4, 4096, 1408), 132, Some(100));
        assert_eq!(
            g,
            MoeGrids {
                gemm: [100, 100],
                rows: 1056
            }
        );
    }
    #[test]
    fn row_granular_tiles_below_one_tile_per_expert() {
        // T = 128, top-8 over 64 experts: 16 rows per expert on average.
        assert_eq!(gemm_mode_for(&shape(128, 64, 8, 4096, 2048), None), mode::PARTIAL_ROWS);
        // T = 4096: 512 rows per expert; T = 16384 over 16 experts, top-4: 4096.
        assert_eq!(gemm_mode_for(&shape(4096, 64, 8, 4096, 2048), None), 0);
        assert_eq!(gemm_mode_for(&shape(16384, 16, 4, 4096, 1408), None), 0);
        // Exactly one tile per expert on average: whole tiles.
        assert_eq!(gemm_mode_for(&shape(1024, 64, 8, 64, 64), None), 0);
        assert_eq!(gemm_mode_for(&shape(4096, 64, 8, 64, 64), Some(1)), mode::PARTIAL_ROWS);
        assert_eq!(gemm_mode_for(&shape(128, 64, 8, 64, 64), Some(0)), 0);
    }
    #[test]
    fn the_combine_stays_after_the_down_projection_by_default() {
        // The measurements behind this default: docs/moe.md, "Combine in the epilogue".
        for s in [
            shape(4096, 64, 8, 4096, 2048),
            shape(16384, 16, 4, 4096, 1408),
            shape(128, 64, 8, 4096, 2048),
        ] {
            assert_eq!(combine_for(&s), MoeCombine::Ordered);
        }
    }
    #[test]
    fn padded_offsets_start_groups_on_row_tiles() {
        assert_eq!(
            padded_offsets(&[300, 0, 5, 128, 129, 1]).unwrap(),
            vec![0, 384, 384, 512, 640, 896, 1024]
        );
        assert_eq!(padded_offsets(&[]).unwrap(), vec![0]);
        // Past u32: an error, not a wrap.
        assert!(padded_offsets(&[u32::MAX, 1]).is_err());
        assert!(padded_offsets(&[1 << 31, 1 << 31]).is_err());
        assert_eq!(padded_offsets(&[u32::MAX - 127]).unwrap(), vec![0, u32::MAX - 127]);
    }
    #[test]
    fn flops_and_capacity() {
        let s = shape(4096, 64, 8, 4096, 2048);
        // (2 T k H 2F + 2 T k F H)
        assert_eq!(
            s.flops(),
            2.0 * 32768.0 * 4096.0 * 4096.0 + 2.0 * 32768.0 * 2048.0 * 4096.0
        );
        assert_eq!(s.capacity_rows(), (32768 / 128 + 64) * 128);
        let s1 = shape(1, 64, 8, 64, 64);
        assert_eq!(s1.capacity_rows(), 9 * 128); // 8 experts with one row each, tile 1
    }
}

/// Sizes of a grouped GEMM run alone ([`GroupedGemmPlan`]): `C_g = act(A_g W_g^T)` for
/// `groups` groups; W is `groups x w_rows x k` (`nn.Linear` layout per group; `w_rows = 2n`
/// with SwiGLU - gate rows, then up rows - or `n`), A is `capacity_rows x k` and C
/// `capacity_rows x n`, both in the padded grouped layout ([`padded_offsets`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedGemmShape {
    pub groups: usize,
    /// Rows of A and C (a multiple of 128).
    pub capacity_rows: usize,
    /// Columns of C.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    pub act: Activation,
}

impl GroupedGemmShape {
    /// Rows of W per group.
    pub fn w_rows(&self) -> usize {
        self.act.up_rows(self.n)
    }
    /// Checks the sizes against the kernels' limits.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::Shape {
                op: "grouped gemm",
                reason,
            })
        };
        if self.groups == 0 || self.capacity_rows == 0 || self.n == 0 || self.k == 0 {
            return bad(format!("empty dimension in {self:?}"));
        }
        if self.groups > MAX_EXPERTS as usize {
            return bad(format!("{} groups; at most {MAX_EXPERTS}", self.groups));
        }
        if self.capacity_rows % ROW_ALIGN as usize != 0 || self.capacity_rows > i32::MAX as usize / 2 {
            return bad(format!(
                "capacity_rows={} must be a multiple of {ROW_ALIGN} below 2^30",
                self.capacity_rows
            ));
        }
        if self.n % 8 != 0 || self.k % 8 != 0 {
            return bad(format!("n={} and k={} must be multiples of 8", self.n, self.k));
        }
        if self.n > i32::MAX as usize || self.k > i32::MAX as usize {
            return bad(format!("n={} and k={} must be below 2^31", self.n, self.k));
        }
        if self.groups.saturating_mul(self.w_rows()) > i32::MAX as usize / 2 {
            return bad("groups x rows per group must stay below 2^30".into());
        }
        Ok(())
    }
}

/// The padded grouped layout: group `g` starts at row `128 x (sum over g' < g of
/// ceil(counts[g'] / 128))`; the last entry is the rows in use. What the plans compute on the
/// device, for callers that know the counts on the host. [`Error::Shape`] when the padded rows
/// pass `u32::MAX` (the kernels' offsets are u32).
pub fn padded_offsets(counts: &[u32]) -> Result<Vec<u32>> {
    let mut v = Vec::with_capacity(counts.len() + 1);
    let mut at = 0u32;
    for &c in counts {
        v.push(at);
        at = c
            .div_ceil(ROW_ALIGN)
            .checked_mul(ROW_ALIGN)
            .and_then(|rows| at.checked_add(rows))
            .ok_or_else(|| Error::Shape {
                op: "grouped gemm",
                reason: format!("padded rows pass 2^32 at group {} (count {c})", v.len() - 1),
            })?;
    }
    v.push(at);
    Ok(v)
}

/// [`GroupedGemmPlan`]'s uploaded block: five tensor maps (A, its `PARTIAL_BOX_ROWS` twin, W,
/// C, its twin), the group placement's arguments, the GEMM's.
const GG_ARG_ROUTE: usize = 5 * MAP_BYTES;
const GG_ARG_GEMM: usize = GG_ARG_ROUTE + 128;
const GG_ARG_BYTES: usize = GG_ARG_GEMM + 128;

/// A grouped GEMM ready to launch alone: rows per group are read from a device buffer at
/// every launch (no host round trip), so a launch captured in a CUDA graph follows new
/// counts. Borrows A, W, C and the counts for `'a`. Padded rows that exceed the capacity are
/// cut off and reported by [`GroupedGemmPlan::take_error`].
///
/// Launches share the plan's words (counts, offsets, tile table): the plan orders them as
/// [`MoePlan`] does ("Launch order").
pub struct GroupedGemmPlan<'a> {
    shape: GroupedGemmShape,
    device: Device,
    order: Mutex<LaunchOrder>,
    tiles_fn: CudaFunction,
    gemm: CudaFunction,
    args: CudaSlice<u8>,
    /// counts (G) | offsets (G + 1) | rows (1) | error record (4) | tile_group.
    words: CudaSlice<u32>,
    counts_in: u64,
    grid: u32,
    _buffers: PhantomData<&'a ()>,
}

impl<'a> GroupedGemmPlan<'a> {
    /// Plans `c = act(a w_g^T)` per group, the rows per group in `counts` (`groups` u32).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device: &Device,
        stream: &Arc<CudaStream>,
        shape: GroupedGemmShape,
        a: &'a CudaSlice<bf16>,
        w: &'a CudaSlice<bf16>,
        c: &'a mut CudaSlice<bf16>,
        counts: &'a CudaSlice<u32>,
        sms: Option<u32>,
    ) -> Result<Self> {
        shape.validate()?;
        let s = shape;
        let op = "grouped gemm";
        crate::check::stream_on(op, device, stream)?;
        crate::check::buffer_on(op, "A", device, a)?;
        crate::check::buffer_on(op, "W", device, w)?;
        crate::check::buffer_on(op, "C", device, &*c)?;
        crate::check::buffer_on(op, "counts", device, counts)?;
        crate::check::lens(
            "grouped gemm",
            &[
                ("A", a.len(), s.capacity_rows * s.k),
                ("W", w.len(), s.groups * s.w_rows() * s.k),
                ("C", c.len(), s.capacity_rows * s.n),
                ("counts", counts.len(), s.groups),
            ],
        )?;
        let (pa, _ra) = a.device_ptr(stream);
        let (pw, _rw) = w.device_ptr(stream);
        let (pc, _rc) = cudarc::driver::DevicePtrMut::device_ptr_mut(c, stream);
        let (pn, _rn) = counts.device_ptr(stream);
        // SAFETY: the buffers are borrowed for 'a and hold the shape's elements.
        unsafe { Self::new_raw(device, stream, shape, pa, pw, pc, pn, sms) }
    }

    /// As [`GroupedGemmPlan::new`] on raw device addresses (A, W, C 16-byte aligned).
    ///
    /// # Safety
    /// The addresses must hold the shape's elements on `device` (A `capacity_rows x k`, W
    /// `groups x w_rows x k`, C `capacity_rows x n` bf16, `groups` u32 counts) and stay valid
    /// while the plan is launched.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new_raw(
        device: &Device,
        stream: &Arc<CudaStream>,
        shape: GroupedGemmShape,
        a: u64,
        w: u64,
        c: u64,
        counts: u64,
        sms: Option<u32>,
    ) -> Result<Self> {
        shape.validate()?;
        crate::check::stream_on("grouped gemm", device, stream)?;
        crate::check::aligned16("grouped gemm", &[("A", a), ("W", w), ("C", c)])?;
        let s = shape;
        let g = s.groups;
        let max_tiles = s.capacity_rows / ROW_ALIGN as usize;
        let words = stream.alloc_zeros::<u32>(g + (g + 1) + 1 + 4 + max_tiles)?;
        let base = words.device_ptr(stream).0;
        let (counts_out, offsets) = (base, base + 4 * g as u64);
        let rows = offsets + 4 * (g as u64 + 1);
        let error = rows + 4;
        let tile_expert = error + 16;
        let t = TILE;
        let map = grouped_map;
        // A, its PARTIAL_BOX_ROWS twin, W, C, its twin (row-granular tiles, as in `MoePlan`).
        let maps = [
            map(a, s.k, s.capacity_rows, t.block_k, t.block_m)?,
            map(a, s.k, s.capacity_rows, t.block_k, PARTIAL_BOX_ROWS)?,
            map(w, s.k, g * s.w_rows(), t.block_k, s.act.up_tile_cols())?,
            map(
                c,
                s.n,
                s.capacity_rows,
                GemmTile::EPILOGUE_BOX_COLS,
                GemmTile::EPILOGUE_BOX_ROWS,
            )?,
            map(c, s.n, s.capacity_rows, GemmTile::EPILOGUE_BOX_COLS, PARTIAL_BOX_ROWS)?,
        ];
        let mut args = stream.alloc_zeros::<u8>(GG_ARG_BYTES)?;
        let abase = args.device_ptr(stream).0;
        let route = MoeRouteArgs {
            counts: counts_out,
            offsets,
            tile_expert,
            rows,
            slots: 0,
            error,
            pairs: 0,
            experts: g as u32,
            max_tiles: max_tiles as u32,
            _pad: 0,
            row_pair: 0,
        };
        let gemm = GroupedGemmArgs {
            map_a: abase,
            map_b: abase + 2 * MAP_BYTES as u64,
            map_c: abase + 3 * MAP_BYTES as u64,
            rows,
            tile_expert,
            n: s.n as u32,
            k: s.k as u32,
            b_rows: s.w_rows() as u32,
            act: s.act.flag() | mode::PARTIAL_ROWS,
            row_pair: 0,
            top_k: 0,
            _pad: 0,
        };
        let block = arg_block(
            GG_ARG_BYTES,
            &maps,
            &[
                (GG_ARG_ROUTE, bytemuck::bytes_of(&route)),
                (GG_ARG_GEMM, bytemuck::bytes_of(&gemm)),
            ],
        );
        stream.memcpy_htod(&block, &mut args)?;
        let sms = sms.unwrap_or(device.sm_count()).clamp(1, device.sm_count());
        Ok(GroupedGemmPlan {
            shape,
            device: device.clone(),
            order: Mutex::new(LaunchOrder::default()),
            tiles_fn: device.function(&cfg::MOE_GROUP_TILES)?,
            gemm: device.function(&cfg::MOE_GROUPED_GEMM)?,
            args,
            words,
            counts_in: counts,
            grid: grouped_gemm_grid(max_tiles, s.n, s.act.up_tile_cols(), sms as usize),
            _buffers: PhantomData,
        })
    }

    /// Enqueues the group placement (one CTA) and the grouped GEMM on `stream`.
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        crate::check::stream_on("grouped gemm", &self.device, stream)?;
        // Held until both launches are enqueued, behind the plan's previous launch.
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        order.follow(stream)?;
        let a = self.args.device_ptr(stream).0;
        let (route, gemm) = (a + GG_ARG_ROUTE as u64, a + GG_ARG_GEMM as u64);
        // SAFETY: the argument lists match `mk_moe_group_tiles(args, counts)` and
        // `mk_moe_grouped_gemm(args)`; the buffers are borrowed for 'a.
        unsafe {
            stream
                .launch_builder(&self.tiles_fn)
                .arg(&route)
                .arg(&self.counts_in)
                .launch(Device::launch_config(&cfg::MOE_GROUP_TILES, 1))?;
            stream
                .launch_builder(&self.gemm)
                .arg(&gemm)
                .launch(Device::launch_config(&cfg::MOE_GROUPED_GEMM, self.grid))?;
        }
        Ok(())
    }

    /// The padded offsets of the last launch's groups (`groups + 1` words on the device; the
    /// last is the rows in use): where a device-side producer of A puts group `g`'s rows.
    pub fn offsets(&self) -> cudarc::driver::CudaView<'_, u32> {
        let g = self.shape.groups;
        self.words.slice(g..2 * g + 1)
    }

    /// Reads and clears the error record (synchronizes): an error when the padded groups of a
    /// launch exceeded `capacity_rows` (the rows past it were not computed).
    pub fn take_error(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if take_record(stream, &mut self.words, 2 * self.shape.groups + 2)?.is_none() {
            return Ok(());
        }
        Err(Error::Shape {
            op: "grouped gemm",
            reason: format!(
                "the groups, each padded to {ROW_ALIGN} rows, exceed capacity_rows = {}; rows past it were not computed",
                self.shape.capacity_rows
            ),
        })
    }
}
