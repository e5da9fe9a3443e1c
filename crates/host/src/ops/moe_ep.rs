//! The MoE expert FFN with expert parallelism over the ranks of a job (docs/moe.md, "Across
//! ranks"): `E` experts split evenly over the `W` ranks of a [`Communicator`] (global rank `r`
//! owns experts `r E/W .. (r + 1) E/W`); every rank brings `T` tokens with their top-k ids
//! (global expert ids) and weights; each pair's token row goes to the rank owning its expert
//! (on the node: NVLink stores into the owner's receive rows in the symmetric heap; on another
//! node: proxy PUTs, "Across nodes"), the owner runs the grouped expert FFN of the single-GPU
//! layer on what it received, and every rank gets its pairs' results back (NVLink loads, or
//! the owner's PUTs) and sums them in f32:
//!
//! ```text
//! out_r[t] = sum_j w_r[t, j] * FFN_{e_r(t, j)}(x_r[t])     (on every rank r)
//! ```
//!
//! Five launches on one stream, no host round trip (capturable): `mk_moe_ep_route` (1 CTA:
//! counts, `Ready` handshake, count-matrix exchange, receive rows, receive layout),
//! `mk_moe_ep_dispatch`, the up and the down `mk_moe_grouped_gemm`, `mk_moe_ep_combine`.
//! Receive capacity: the worst case by default, or rows given by the caller; pairs past an
//! owner's capacity are dropped (they add nothing to the output) and counted
//! ([`MoeEpPlan::drops`]).
use super::moe::{
    arg_block, check_layer_lens, expert_id_error, grouped_gemm_grid, grouped_map, sat, take_record, worst_tiles,
    Activation, MAP_BYTES,
};
use crate::check;
use crate::comm::agree::PlanDesc;
use crate::comm::{Communicator, HeapRegion};
use crate::error::{Error, Result};
use crate::gemm::{GemmOutput, OutDtype};
use crate::runtime::Device;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, PushKernelArg};
use half::bf16;
use mkernel_config::ops::moe::{
    self as cfg, act, GroupedGemmArgs, MoeEpArgs, MoeRouteArgs, EP_FLAG_BYTES, EP_MAX_CTAS, EP_MAX_RANKS, EP_MAX_WORLD,
    MAX_EXPERTS, MAX_TOP_K, ROW_ALIGN, TILE,
};
use mkernel_config::GemmTile;
use std::marker::PhantomData;
use std::sync::Arc;

const OP: &str = "moe_ep";

/// Sizes of an expert-parallel MoE layer (per rank, except `experts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeEpShape {
    /// Tokens on every rank (`T`).
    pub tokens: usize,
    /// Experts of the whole layer (`E`, a multiple of the world size).
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub act: Activation,
    /// Rows every rank can receive (rounded up to a multiple of 128); `None`: the worst case,
    /// every pair of every rank to one rank.
    pub capacity: Option<usize>,
}

impl MoeEpShape {
    /// (token, expert) pairs of one rank.
    pub fn pairs(&self) -> usize {
        self.tokens.saturating_mul(self.top_k)
    }
    /// Experts per rank.
    pub fn local_experts(&self, world: usize) -> usize {
        self.experts / world.max(1)
    }
    /// Rows of `W_up` per expert.
    pub fn up_rows(&self) -> usize {
        self.act.up_rows(self.ffn)
    }
    /// Receive rows per rank: the caller's capacity rounded up to 128, or the worst case
    /// (`W T k` rows to one rank, every local expert's group padded). Saturating (sizes past
    /// the limits fail [`MoeEpShape::validate`]).
    pub fn capacity_rows(&self, world: usize) -> usize {
        let align = ROW_ALIGN as usize;
        match self.capacity {
            Some(c) => c.max(1).div_ceil(align).saturating_mul(align),
            None => worst_tiles(world.saturating_mul(self.pairs()), self.local_experts(world)).saturating_mul(align),
        }
    }
    /// Elements of this rank's `W_up` (`L x up_rows x H`) and `W_down` (`L x H x F`), `L` local
    /// experts (saturating).
    pub fn weight_lens(&self, world: usize) -> (usize, usize) {
        let l = self.local_experts(world);
        (sat(&[l, self.up_rows(), self.hidden]), sat(&[l, self.hidden, self.ffn]))
    }
    /// Bytes of every rank's symmetric heap the plan takes ([`Communicator::alloc`]) on one node
    /// of `world` ranks.
    pub fn heap_bytes(&self, world: usize) -> u64 {
        self.heap_bytes_nodes(world, 1)
    }
    /// As [`MoeEpShape::heap_bytes`] for `world` ranks (all nodes) on `nodes` nodes: across
    /// nodes the plan also takes the transfer rows (`T top_k x H` bf16).
    /// Saturating: exact for shapes that pass [`MoeEpShape::validate`].
    pub fn heap_bytes_nodes(&self, world: usize, nodes: usize) -> u64 {
        let round = |b: u64| b.div_ceil(256).saturating_mul(256);
        let rows = self.row_bytes(world);
        let counts = sat(&[world, self.experts, 4]) as u64;
        let xfer = if nodes > 1 { self.xfer_bytes() } else { 0 };
        [
            round(self.flag_bytes(world)),
            round(counts),
            round(rows),
            round(rows),
            round(xfer),
        ]
        .into_iter()
        .fold(0u64, u64::saturating_add)
    }
    /// Bytes of the receive rows (and of the down projection's rows): `capacity x H` bf16.
    fn row_bytes(&self, world: usize) -> u64 {
        sat(&[self.capacity_rows(world), self.hidden, 2]) as u64
    }
    /// Bytes of the flag region: the flags, then the arrival counters (`u64` per local expert).
    fn flag_bytes(&self, world: usize) -> u64 {
        EP_FLAG_BYTES.saturating_add((self.local_experts(world) as u64).saturating_mul(8))
    }
    /// Bytes of the transfer rows (across nodes: the rows a rank sends to and gets back from
    /// the other nodes, one per pair; saturating).
    pub fn xfer_bytes(&self) -> u64 {
        sat(&[self.pairs(), self.hidden, 2]) as u64
    }
    /// Checks the sizes against the kernels' limits (those of the single-GPU layer, plus:
    /// `E` a multiple of the world size, at most 64 ranks in all nodes, receive rows below 2^31;
    /// [`MoeEpPlan::new`] also checks at most 8 ranks per node).
    pub fn validate(&self, world: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::Shape { op: OP, reason });
        if world == 0 || world > EP_MAX_WORLD as usize {
            return bad(format!("{world} ranks; 1..={EP_MAX_WORLD} supported"));
        }
        if self.experts % world != 0 {
            return bad(format!(
                "{} experts do not split evenly over {world} ranks (E % W must be 0)",
                self.experts
            ));
        }
        if self.tokens == 0 || self.experts == 0 || self.top_k == 0 || self.hidden == 0 || self.ffn == 0 {
            return bad(format!("empty dimension in {self:?}"));
        }
        if self.experts > MAX_EXPERTS as usize || self.top_k > MAX_TOP_K as usize {
            return bad(format!("at most {MAX_EXPERTS} experts and top_k {MAX_TOP_K}: {self:?}"));
        }
        if self.hidden % 8 != 0 || self.ffn % 8 != 0 {
            return bad(format!(
                "hidden={} and ffn={} must be multiples of 8 (16-byte rows)",
                self.hidden, self.ffn
            ));
        }
        // Products saturate: a saturated value fails its limit.
        let limit = i32::MAX as usize / 2;
        let cap = self.capacity_rows(world);
        if world.saturating_mul(self.pairs()) > limit
            || cap > limit
            || cap.saturating_mul(self.hidden.max(self.ffn)) > (u32::MAX as usize) * 8
        {
            return bad(format!("{cap} receive rows (tokens x top_k x ranks) is too large"));
        }
        let l = self.local_experts(world);
        if l.saturating_mul(self.up_rows()) > limit || l.saturating_mul(self.hidden) > limit {
            return bad("local experts x rows per expert must stay below 2^30".into());
        }
        Ok(())
    }
}

/// The kernel launches of [`MoeEpPlan::launch`], in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeEpStage {
    /// `mk_moe_ep_route`: counts, `Ready` handshake, count matrix, receive rows and layout.
    Route,
    /// `mk_moe_ep_dispatch`: token rows to their experts' owners.
    Dispatch,
    /// `mk_moe_grouped_gemm`: up projection (with the activation) of the received rows.
    Up,
    /// `mk_moe_grouped_gemm`: down projection into the heap.
    Down,
    /// `mk_moe_ep_combine`: rows read back from the owners, top-k weighted sum.
    Combine,
}

impl MoeEpStage {
    pub const ALL: [MoeEpStage; 5] = [
        MoeEpStage::Route,
        MoeEpStage::Dispatch,
        MoeEpStage::Up,
        MoeEpStage::Down,
        MoeEpStage::Combine,
    ];
}

/// Rows dropped by one launch for want of receive capacity ([`MoeEpPlan::drops`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoeEpDrops {
    /// This rank's pairs whose owner had no room: they add nothing to this rank's output.
    pub sent: u32,
    /// Rows the other ranks (and this one) sent here that did not fit.
    pub received: u32,
}

/// What the routing of the last launch decided ([`MoeEpPlan::inspect`]; tests, diagnostics).
#[derive(Clone, Debug)]
pub struct MoeEpRouting {
    /// Per pair of this rank: its row in the owner's receive buffer (`u32::MAX`: bad id or dropped).
    pub pos: Vec<u32>,
    /// Rows per local expert received (from all ranks, before the capacity cut).
    pub counts: Vec<u32>,
    /// Padded first row of every local expert's group (`L + 1`; the last: rows in use).
    pub offsets: Vec<u32>,
}

/// Where the plan's pieces sit in its heap region.
#[derive(Clone, Copy, Debug)]
struct HeapLayout {
    flags: u64,
    counts: u64,
    recv: u64,
    yp: u64,
    /// The transfer rows (across nodes; 0 on one node).
    xfer: u64,
    /// The arrival counters (after the flags, zeroed with them).
    arrival: u64,
    /// This rank's addresses of the receive rows and the down projection's rows.
    recv_ptr: u64,
    yp_ptr: u64,
}

/// Byte offsets in the uploaded block: six tensor maps, then the argument blocks.
const ARG_EP: usize = 6 * MAP_BYTES;
const ARG_UP: usize = ARG_EP + 256;
const ARG_DOWN: usize = ARG_UP + 128;
const ARG_BYTES: usize = ARG_DOWN + 128;

/// Grid of the dispatch and the combine: one CTA per token up to one per SM (every rank
/// computes the same from the same shape and GPU; the flags are per CTA).
pub fn moe_ep_grid(tokens: usize, sm_count: u32) -> u32 {
    tokens.clamp(1, sm_count.clamp(1, EP_MAX_CTAS) as usize) as u32
}

/// An expert-parallel MoE layer ready to launch on one rank. Borrows the communicator (its
/// heap holds the plan's flags, count matrix, receive rows and down-projection rows) and this
/// rank's expert weights for `'a`. Collective: every rank of the communicator builds it with
/// the same shape, and every rank launches it the same number of times, in the same order
/// relative to the communicator's other kernels. Launches must be ordered (one stream).
pub struct MoeEpPlan<'a> {
    comm: &'a Communicator,
    shape: MoeEpShape,
    world: usize,
    route: CudaFunction,
    dispatch: CudaFunction,
    gemm: CudaFunction,
    combine: CudaFunction,
    /// The fused dispatch + up projection (`Some` for a plan from [`MoeEpPlan::new_fused`]).
    dispatch_up: Option<CudaFunction>,
    args: CudaSlice<u8>,
    /// The up projection's rows (local).
    _hid: CudaSlice<bf16>,
    /// epoch (2 words) | error record (4) | scratch record (4) | drops (2) | counts (L) |
    /// offsets (L + 1) | rows (1) | tile_expert (max tiles) | pos (pairs) | across nodes:
    /// xrow (pairs) | send (3 E) | ret (3 W L) | exits (1) | relay (2, 8-byte aligned).
    words: CudaSlice<u32>,
    grid: u32,
    gemm_grid: [u32; 2],
    /// The plan's heap buffers, given back when the plan drops (after the last field: the
    /// device buffers above go first).
    _heap: Vec<HeapRegion<'a>>,
    _weights: PhantomData<&'a ()>,
}

const W_ERROR: usize = 2;
const W_DROPS: usize = 10;
const W_COUNTS: usize = 12;

impl<'a> MoeEpPlan<'a> {
    /// Plans the layer on `comm`'s ranks (all nodes: `W = comm.global_world()`) with this rank's
    /// expert weights `w_up` (`L x up_rows x H`) and `w_down` (`L x H x F`), `L = E / W` (the
    /// experts global rank `comm.global_rank()` owns, in order). Takes
    /// `shape.heap_bytes_nodes(W, nodes)` of the heap on every rank. Collective (every rank of
    /// every node calls it).
    pub fn new(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        shape: MoeEpShape,
        w_up: &'a CudaSlice<bf16>,
        w_down: &'a CudaSlice<bf16>,
    ) -> Result<Self> {
        Self::new_with(comm, stream, shape, w_up, w_down, false)
    }

    /// As [`MoeEpPlan::new`], with the dispatch fused into the up projection
    /// (`mk_moe_ep_dispatch_up`, docs/moe.md "Fused dispatch"): the up projection's CTAs store
    /// the token rows first, and each tile waits (bounded) only for its expert's rows, counted
    /// per expert, instead of for the end of the dispatch kernel. [`MoeEpStage::Dispatch`]
    /// then enqueues nothing and [`MoeEpStage::Up`] both.
    pub fn new_fused(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        shape: MoeEpShape,
        w_up: &'a CudaSlice<bf16>,
        w_down: &'a CudaSlice<bf16>,
    ) -> Result<Self> {
        Self::new_with(comm, stream, shape, w_up, w_down, true)
    }

    fn new_with(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        shape: MoeEpShape,
        w_up: &'a CudaSlice<bf16>,
        w_down: &'a CudaSlice<bf16>,
        fused: bool,
    ) -> Result<Self> {
        let world = comm.global_world() as usize;
        let nodes = comm.nnodes() as usize;
        let device = comm.device();
        // Validate, take the heap (the same offsets on every rank whose heap is in step) and
        // zero the flags; then agree. The agreement is also the barrier after which peers may
        // signal into the zeroed flags.
        let checked = (|| {
            check::stream_on(OP, device, stream)?;
            check::buffer_on(OP, "W_up", device, w_up)?;
            check::buffer_on(OP, "W_down", device, w_down)?;
            shape.validate(world)?;
            if comm.world() > EP_MAX_RANKS {
                return Err(Error::Shape {
                    op: OP,
                    reason: format!("{} ranks per node; at most {EP_MAX_RANKS}", comm.world()),
                });
            }
            let (lu, ld) = shape.weight_lens(world);
            check::lens(OP, &[("W_up", w_up.len(), lu), ("W_down", w_down.len(), ld)])?;
            let regions = Self::take_heap(comm, shape, world, nodes > 1)?;
            // Flags start at zero (the region may have held another plan's).
            stream.synchronize()?;
            // SAFETY: the flag region of this rank's own heap, allocated above.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    comm.ptr(&regions[0])?,
                    0,
                    shape.flag_bytes(world) as usize,
                    stream.cu_stream(),
                )?
            };
            stream.synchronize()?;
            Ok(regions)
        })();
        let (regions, _) = comm.agree_on(OP, checked, |regions| {
            let offsets: Vec<(u64, u64)> = regions.iter().map(|r| (r.offset(), r.bytes())).collect();
            PlanDesc::new(OP)
                .field("tokens", shape.tokens)
                .field("experts", shape.experts)
                .field("top_k", shape.top_k)
                .field("hidden", shape.hidden)
                .field("ffn", shape.ffn)
                .field("act", format!("{:?}", shape.act))
                .field("capacity rows", shape.capacity_rows(world))
                .field("dtype", "bf16")
                .field("fused dispatch", fused)
                .field("nodes", nodes)
                .field("grid", moe_ep_grid(shape.tokens, device.sm_count()))
                .field("heap (offset, bytes)", format!("{offsets:?}"))
        })?;
        let heap = HeapLayout {
            flags: regions[0].offset(),
            counts: regions[1].offset(),
            recv: regions[2].offset(),
            yp: regions[3].offset(),
            xfer: regions.get(4).map_or(0, |r| r.offset()),
            arrival: regions[0].offset() + EP_FLAG_BYTES,
            recv_ptr: comm.ptr(&regions[2])?,
            yp_ptr: comm.ptr(&regions[3])?,
        };
        let (pu, _gu) = w_up.device_ptr(stream);
        let (pd, _gd) = w_down.device_ptr(stream);
        // SAFETY: the weights are borrowed for 'a and hold the shape's elements (checked).
        unsafe { Self::build(comm, stream, shape, world, heap, regions, pu, pd, fused) }
    }

    /// Heap bytes a plan of `shape` takes on every rank, for `world` ranks (all nodes) on
    /// `nodes` nodes, before it is built: [`MoeEpShape::heap_bytes_nodes`] after
    /// [`MoeEpShape::validate`].
    pub fn heap_bytes(shape: &MoeEpShape, world: usize, nodes: usize) -> Result<u64> {
        shape.validate(world)?;
        Ok(shape.heap_bytes_nodes(world, nodes))
    }

    /// The plan's heap buffers, in order: flags (and arrival counters), count matrix, receive
    /// rows, down-projection rows, and across nodes the transfer rows.
    fn take_heap(comm: &'a Communicator, shape: MoeEpShape, world: usize, across: bool) -> Result<Vec<HeapRegion<'a>>> {
        let row_bytes = shape.row_bytes(world);
        let mut sizes = vec![
            shape.flag_bytes(world),
            (world * shape.experts * 4) as u64,
            row_bytes,
            row_bytes,
        ];
        if across {
            sizes.push(shape.xfer_bytes());
        }
        sizes.into_iter().map(|b| comm.alloc_region(b)).collect()
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn build(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        shape: MoeEpShape,
        world: usize,
        heap: HeapLayout,
        regions: Vec<HeapRegion<'a>>,
        w_up: u64,
        w_down: u64,
        fused: bool,
    ) -> Result<Self> {
        let device: &Device = comm.device();
        let (h, f) = (shape.hidden, shape.ffn);
        let l = shape.local_experts(world);
        let cap = shape.capacity_rows(world);
        let max_tiles = cap / ROW_ALIGN as usize;
        let hid = stream.alloc_zeros::<bf16>(cap * f)?;
        let across = heap.xfer != 0;
        let pos_at = W_COUNTS + 2 * l + 2 + max_tiles;
        // Across nodes: xrow, send, ret, exits, relay (u64 at an even word).
        let xrow_at = pos_at + shape.pairs();
        let send_at = xrow_at + shape.pairs();
        let ret_at = send_at + 3 * shape.experts;
        let exits_at = ret_at + 3 * world * l;
        let relay_at = (exits_at + 1).next_multiple_of(2);
        // Fused plans: the targets (2 u64 per local expert, at an even word).
        let target_at = (if across { relay_at + 2 } else { send_at }).next_multiple_of(2);
        let n_words = if fused {
            target_at + 4 * l
        } else if across {
            relay_at + 2
        } else {
            xrow_at
        };
        let words = stream.alloc_zeros::<u32>(n_words)?;
        let base = words.device_ptr(stream).0;
        let w = |i: usize| base + 4 * i as u64;
        let wx = |i: usize| if across { w(i) } else { 0 };
        let (counts, offsets) = (w(W_COUNTS), w(W_COUNTS + l));
        let rows = w(W_COUNTS + 2 * l + 1);
        let tile_expert = w(W_COUNTS + 2 * l + 2);
        let pos = w(pos_at);
        let phid = hid.device_ptr(stream).0;
        let (precv, pyp) = (heap.recv_ptr, heap.yp_ptr);
        let t = TILE;
        let map = grouped_map;
        let b_up_box = shape.act.up_tile_cols();
        let maps = [
            map(precv, h, cap, t.block_k, t.block_m)?,
            map(w_up, h, l * shape.up_rows(), t.block_k, b_up_box)?,
            map(phid, f, cap, GemmTile::EPILOGUE_BOX_COLS, GemmTile::EPILOGUE_BOX_ROWS)?,
            map(phid, f, cap, t.block_k, t.block_m)?,
            map(w_down, f, l * h, t.block_k, t.block_n)?,
            map(pyp, h, cap, GemmTile::EPILOGUE_BOX_COLS, GemmTile::EPILOGUE_BOX_ROWS)?,
        ];
        let mut args = stream.alloc_zeros::<u8>(ARG_BYTES)?;
        let abase = args.device_ptr(stream).0;
        let map_at = |i: usize| abase + (i * MAP_BYTES) as u64;
        let ep = MoeEpArgs {
            layout: MoeRouteArgs {
                counts,
                offsets,
                tile_expert,
                rows,
                slots: 0,
                error: w(W_ERROR + 4),
                pairs: 0,
                experts: l as u32,
                max_tiles: max_tiles as u32,
                _pad: 0,
                row_pair: 0,
            },
            epoch: w(0),
            pos,
            drops: w(W_DROPS),
            error: w(W_ERROR),
            heap_flags: heap.flags,
            heap_counts: heap.counts,
            heap_recv: heap.recv,
            heap_yp: heap.yp,
            tokens: shape.tokens as u32,
            top_k: shape.top_k as u32,
            hidden: h as u32,
            experts: shape.experts as u32,
            local_experts: l as u32,
            capacity: cap as u32,
            xrow: wx(xrow_at),
            send: wx(send_at),
            ret: wx(ret_at),
            exits: wx(exits_at),
            relay: wx(relay_at),
            heap_xfer: heap.xfer,
            heap_arrival: heap.arrival,
            target: if fused { w(target_at) } else { 0 },
        };
        let up = GroupedGemmArgs {
            map_a: map_at(0),
            map_b: map_at(1),
            map_c: map_at(2),
            rows,
            tile_expert,
            n: f as u32,
            k: h as u32,
            b_rows: shape.up_rows() as u32,
            act: shape.act.flag(),
            row_pair: 0,
            top_k: 0,
            _pad: 0,
        };
        let down = GroupedGemmArgs {
            map_a: map_at(3),
            map_b: map_at(4),
            map_c: map_at(5),
            rows,
            tile_expert,
            n: h as u32,
            k: f as u32,
            b_rows: h as u32,
            act: act::NONE,
            row_pair: 0,
            top_k: 0,
            _pad: 0,
        };
        assert!(std::mem::size_of::<MoeEpArgs>() <= ARG_UP - ARG_EP);
        let block = arg_block(
            ARG_BYTES,
            &maps,
            &[
                (ARG_EP, bytemuck::bytes_of(&ep)),
                (ARG_UP, bytemuck::bytes_of(&up)),
                (ARG_DOWN, bytemuck::bytes_of(&down)),
            ],
        );
        stream.memcpy_htod(&block, &mut args)?;
        stream.synchronize()?;
        let sms = device.sm_count().max(1) as usize;
        let gemm_grid = |n: usize, cols: u32| grouped_gemm_grid(max_tiles, n, cols, sms);
        Ok(MoeEpPlan {
            comm,
            shape,
            world,
            route: device.function(&cfg::MOE_EP_ROUTE)?,
            dispatch: device.function(&cfg::MOE_EP_DISPATCH)?,
            gemm: device.function(&cfg::MOE_GROUPED_GEMM)?,
            combine: device.function(&cfg::MOE_EP_COMBINE)?,
            dispatch_up: if fused {
                Some(device.function(&cfg::MOE_EP_DISPATCH_UP)?)
            } else {
                None
            },
            args,
            _hid: hid,
            words,
            grid: moe_ep_grid(shape.tokens, device.sm_count()),
            gemm_grid: [gemm_grid(f, shape.act.up_tile_cols()), gemm_grid(h, t.block_n)],
            _heap: regions,
            _weights: PhantomData,
        })
    }

    /// Enqueues the layer on `stream`: this rank's `x` (`T x H` bf16), `ids` (`T x top_k` i32,
    /// global expert ids), `weights` (`T x top_k` f32) -> `out` (`T x H`, bf16 or f32).
    pub fn launch<O: GemmOutput>(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<bf16>,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        out: &mut CudaSlice<O>,
    ) -> Result<()> {
        for stage in MoeEpStage::ALL {
            self.launch_stage(stage, stream, x, ids, weights, out)?;
        }
        Ok(())
    }

    /// Enqueues one stage of [`MoeEpPlan::launch`]. The stages of one launch must all be
    /// enqueued, in order (the route starts a launch epoch that the others use): this is for
    /// timing the stages with events between them, not for running one alone.
    pub fn launch_stage<O: GemmOutput>(
        &self,
        stage: MoeEpStage,
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
        super::moe::check_layer_contexts(OP, self.comm.device(), stream, x, ids, weights, out)?;
        let a = self.args.device_ptr(stream).0;
        let (ep, up, down) = (a + ARG_EP as u64, a + ARG_UP as u64, a + ARG_DOWN as u64);
        let desc = self.comm.desc_ptr();
        let f32_out = (O::DTYPE == OutDtype::F32) as u32;
        // Under the communicator's launch lock, ordered behind its previous launch (its
        // kernels share the communicator's epochs, error record and abort word).
        self.comm.enqueue(OP, stream, || {
            // SAFETY: the argument lists match the kernels' (`mk_moe_ep_route(desc, args, ids)`,
            // `mk_moe_ep_dispatch(desc, args, ids, x)`, `mk_moe_grouped_gemm(args)`,
            // `mk_moe_ep_dispatch_up(desc, args, up, ids, x)`,
            // `mk_moe_ep_combine(desc, args, ids, weights, out, f32_out)`); the buffers hold
            // the shape's elements (checked above); the heap buffers and the local ones are the plan's.
            unsafe {
                match stage {
                    MoeEpStage::Route => {
                        stream
                            .launch_builder(&self.route)
                            .arg(&desc)
                            .arg(&ep)
                            .arg(ids)
                            .launch(Device::launch_config(&cfg::MOE_EP_ROUTE, 1))?;
                    }
                    MoeEpStage::Dispatch if self.dispatch_up.is_some() => {}
                    MoeEpStage::Up if self.dispatch_up.is_some() => {
                        let f = self.dispatch_up.as_ref().expect("fused plan");
                        // All its CTAs resident at once (at most one per SM): a tile may wait
                        // for rows another CTA of the launch stores.
                        stream
                            .launch_builder(f)
                            .arg(&desc)
                            .arg(&ep)
                            .arg(&up)
                            .arg(ids)
                            .arg(x)
                            .launch(Device::launch_config(&cfg::MOE_EP_DISPATCH_UP, self.gemm_grid[0]))?;
                    }
                    MoeEpStage::Dispatch => {
                        stream
                            .launch_builder(&self.dispatch)
                            .arg(&desc)
                            .arg(&ep)
                            .arg(ids)
                            .arg(x)
                            .launch(Device::launch_config(&cfg::MOE_EP_DISPATCH, self.grid))?;
                    }
                    MoeEpStage::Up => {
                        stream
                            .launch_builder(&self.gemm)
                            .arg(&up)
                            .launch(Device::launch_config(&cfg::MOE_GROUPED_GEMM, self.gemm_grid[0]))?;
                    }
                    MoeEpStage::Down => {
                        stream
                            .launch_builder(&self.gemm)
                            .arg(&down)
                            .launch(Device::launch_config(&cfg::MOE_GROUPED_GEMM, self.gemm_grid[1]))?;
                    }
                    MoeEpStage::Combine => {
                        stream
                            .launch_builder(&self.combine)
                            .arg(&desc)
                            .arg(&ep)
                            .arg(ids)
                            .arg(weights)
                            .arg(out)
                            .arg(&f32_out)
                            .launch(Device::launch_config(&cfg::MOE_EP_COMBINE, self.grid))?;
                    }
                }
            }
            Ok(())
        })
    }

    /// After the stream finished: a timeout of any of the layer's waits
    /// ([`Error::CommTimeout`] naming the rank, role, flag and peer), then bad expert ids
    /// ([`Error::MoeExpertId`], the record is cleared). Synchronizes `stream`.
    pub fn check(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.synchronize()?;
        self.comm.check()?;
        match take_record(stream, &mut self.words, W_ERROR)? {
            None => Ok(()),
            Some(rec) => Err(expert_id_error(rec, self.shape.top_k, self.shape.experts)),
        }
    }

    /// Rows the last launch dropped for want of receive capacity (synchronizes `stream`).
    pub fn drops(&self, stream: &Arc<CudaStream>) -> Result<MoeEpDrops> {
        let mut d = [0u32; 2];
        stream.memcpy_dtoh(&self.words.slice(W_DROPS..W_DROPS + 2), &mut d)?;
        stream.synchronize()?;
        Ok(MoeEpDrops {
            sent: d[0],
            received: d[1],
        })
    }

    /// The device words of the last launch's drops (`[sent, received]`, u32): for a caller
    /// that reads them on the device or after a captured graph.
    pub fn drops_device(&self) -> cudarc::driver::CudaView<'_, u32> {
        self.words.slice(W_DROPS..W_DROPS + 2)
    }

    /// The routing of the last launch (synchronizes `stream`).
    pub fn inspect(&self, stream: &Arc<CudaStream>) -> Result<MoeEpRouting> {
        let l = self.shape.local_experts(self.world);
        let w = stream.clone_dtoh(&self.words)?;
        let pos_at = W_COUNTS + 2 * l + 2 + self.shape.capacity_rows(self.world) / ROW_ALIGN as usize;
        Ok(MoeEpRouting {
            pos: w[pos_at..pos_at + self.shape.pairs()].to_vec(),
            counts: w[W_COUNTS..W_COUNTS + l].to_vec(),
            offsets: w[W_COUNTS + l..W_COUNTS + 2 * l + 1].to_vec(),
        })
    }

    /// The planned shape.
    pub fn shape(&self) -> MoeEpShape {
        self.shape
    }
    /// The communicator the plan runs on.
    pub fn comm(&self) -> &'a Communicator {
        self.comm
    }
    /// Receive rows per rank.
    pub fn capacity_rows(&self) -> usize {
        self.shape.capacity_rows(self.world)
    }
    /// CTAs of the dispatch and the combine.
    pub fn grid(&self) -> u32 {
        self.grid
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn shape(tokens: usize, experts: usize, top_k: usize, capacity: Option<usize>) -> MoeEpShape {
        MoeEpShape {
            tokens,
            experts,
            top_k,
            hidden: 256,
            ffn: 128,
            act: Activation::SwiGlu,
            capacity,
        }
    }
    #[test]
    fn experts_must_split_evenly() {
        assert!(shape(64, 8, 2, None).validate(2).is_ok());
        let e = shape(64, 6, 2, None).validate(4).unwrap_err().to_string();
        assert!(e.contains("E % W"), "{e}");
        assert!(shape(64, 16, 2, None).validate(16).is_ok());
        assert!(shape(64, 128, 2, None).validate(65).is_err());
    }
    #[test]
    fn capacity_is_the_worst_case_or_rounded_up() {
        // 2 ranks x 64 tokens x top-2 = 256 rows to one rank, over 4 local experts.
        let s = shape(64, 8, 2, None);
        assert_eq!(s.capacity_rows(2), (256 / 128 + 4) * 128);
        assert_eq!(shape(64, 8, 2, Some(200)).capacity_rows(2), 256);
        assert_eq!(shape(64, 8, 2, Some(0)).capacity_rows(2), 128);
    }
    #[test]
    fn huge_sizes_are_refused_not_wrapped() {
        let mut s = shape((1 << 59) + 1, 8, 32, None);
        assert_eq!(s.pairs(), usize::MAX);
        assert!(s.validate(2).is_err());
        s = shape(64, 8, 2, Some(usize::MAX));
        assert_eq!(s.capacity_rows(2), usize::MAX);
        assert!(s.validate(2).is_err());
        s = shape(64, 8, 2, None);
        s.ffn = 1 << 62;
        assert!(s.validate(2).is_err());
        assert!(MoeEpPlan::heap_bytes(&s, 2, 1).is_err());
    }

    proptest::proptest! {
        /// Any sizes: no panic, and an accepted shape's sizes and heap bytes are exact.
        #[test]
        fn accepted_shapes_have_exact_sizes(
            tokens in size(), experts in size(), top_k in size(), hidden in size(), ffn in size(),
            capacity in proptest::option::of(size()), world in 0usize..80, nodes in 1usize..4,
        ) {
            let s = MoeEpShape { tokens, experts, top_k, hidden, ffn, act: Activation::SwiGlu, capacity };
            if s.validate(world).is_ok() {
                let wide = |f: &[usize]| f.iter().try_fold(1u64, |a, &x| a.checked_mul(x as u64));
                let pairs = wide(&[tokens, top_k]).unwrap();
                proptest::prop_assert_eq!(s.pairs() as u64, pairs);
                let l = experts / world;
                let (lu, ld) = s.weight_lens(world);
                proptest::prop_assert_eq!(Some(lu as u64), wide(&[l, 2 * ffn, hidden]));
                proptest::prop_assert_eq!(Some(ld as u64), wide(&[l, hidden, ffn]));
                let cap = s.capacity_rows(world) as u64;
                proptest::prop_assert!(cap <= i32::MAX as u64);
                let round = |b: u64| b.div_ceil(256) * 256;
                let rows = cap * hidden as u64 * 2;
                let xfer = if nodes > 1 { pairs * hidden as u64 * 2 } else { 0 };
                let want = round(EP_FLAG_BYTES + 8 * l as u64)
                    + round((world * experts * 4) as u64)
                    + 2 * round(rows)
                    + round(xfer);
                proptest::prop_assert_eq!(MoeEpPlan::heap_bytes(&s, world, nodes).unwrap(), want);
            } else {
                proptest::prop_assert!(MoeEpPlan::heap_bytes(&s, world, nodes).is_err());
            }
        }
    }

    fn size() -> impl proptest::strategy::Strategy<Value = usize> {
        use proptest::strategy::Strategy as _;
        proptest::prop_oneof![
            0usize..512,
            (0u32..64).prop_map(|e| 1usize << e),
            (0u32..64).prop_map(|e| (1usize << e) + 8),
            proptest::num::usize::ANY,
        ]
    }

    #[test]
    fn grid_is_capped_by_the_sms_and_the_flags() {
        assert_eq!(moe_ep_grid(10, 132), 10);
        assert_eq!(moe_ep_grid(4096, 132), 132);
        assert_eq!(moe_ep_grid(4096, 400), EP_MAX_CTAS);
    }
}
