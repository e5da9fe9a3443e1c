//! GEMM + ReduceScatter and GEMM + AllReduce with K split over ranks (B as N x K): every rank
//! holds `a` (`m` x `k_local`) and `b` (`n` x `k_local`, `nn.Linear` layout). ReduceScatter:
//! rank `r` (global: every rank of every node) gets rows `[r * m / world, (r + 1) * m / world)`
//! of `sum_r a_r * b_r^T` in a local buffer; AllReduce: every rank gets the whole sum in a heap
//! buffer the plan reserves. Partial tiles are summed in f32. Across nodes a node's partials
//! of a rank's rows are summed inside the node (NVLink) on that rank's rail peer, which PUTs
//! the node's sum (rounded to bf16 once) through the proxy; AllReduce PUTs each reduced chunk
//! to every remote rank (docs/fused.md).
use crate::check;
use crate::comm::agree::PlanDesc;
use crate::comm::{Communicator, HeapRegion, SymBuffer};
use crate::error::{Error, Result};
use crate::runtime::Device;
use crate::tensor_map::encode_bf16_sw128_packed;
use crate::tune;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use mkernel_config::ops::gemm_rs::{GemmRsArgs, SK_SLOT_BYTES};
use mkernel_config::stream_k::StreamK;
use mkernel_config::{kernels, GemmTile};
use std::marker::PhantomData;
use std::sync::Arc;

/// How a GEMM+ReduceScatter/AllReduce plan splits its work: `parts` per row chunk (0: the tune
/// cache's or the default), comm CTAs ([`RsSplit::AUTO`]: the default,
/// `mkernel_config::ops::gemm_rs::rs_comm_ctas` - the tune cache holds `parts` only;
/// [`RsSplit::NO_COMM_CTAS`]: none, the compute CTAs store partials straight into the peers'
/// receive buffers) and the rasterization group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RsSplit {
    pub parts: u32,
    pub comm_ctas: u32,
    /// Tile rows per rasterization group (0: `GemmTile::group_m`).
    pub group_m: u32,
    /// Partials are pulled (no comm CTAs; `comm_ctas` must be `AUTO` or `NO_COMM_CTAS`): a
    /// compute CTA stores a peer's partial tile into its local outbox and announces it at the
    /// peer, whose own tile TMA-loads it over NVLink during its mainloop. The computing SMs
    /// then never store over NVLink.
    pub pull: bool,
    /// The consumer warpgroups issue their epilogue bulk stores and partial loads themselves
    /// even where a stager thread could (on one node of 2 ranks, pushed without comm CTAs:
    /// there the stager is the default; docs/fused.md, "Stagers").
    pub no_stager: bool,
    /// Whole tiles only: no stream-K tail ([`mkernel_config::stream_k::StreamK`]; it runs
    /// where the stagers do, on the tiles [`StreamK::choose`] picks).
    pub no_stream_k: bool,
}

impl RsSplit {
    /// `comm_ctas`: the default for the op and world size.
    pub const AUTO: u32 = 0;
    /// `comm_ctas`: none.
    pub const NO_COMM_CTAS: u32 = u32::MAX;
    /// `parts` only, the rest the defaults.
    pub fn parts(parts: u32) -> RsSplit {
        RsSplit {
            parts,
            ..RsSplit::default()
        }
    }
}

/// The problem of one GEMM+ReduceScatter/AllReduce plan, as [`policy`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RsProblem {
    pub m: usize,
    pub n: usize,
    pub k_local: usize,
    /// Ranks per node.
    pub world: usize,
    pub nodes: usize,
    /// SMs of the GPU (CTAs of the launch).
    pub sms: u32,
    /// GEMM + AllReduce (else ReduceScatter).
    pub all_reduce: bool,
}

impl RsProblem {
    fn op(&self) -> &'static str {
        if self.all_reduce {
            "gemm_ar"
        } else {
            "gemm_rs"
        }
    }
    /// The tune cache's name of the operation.
    pub fn tune_op(&self) -> &'static str {
        if self.all_reduce {
            "gemm-ar"
        } else {
            "gemm-rs"
        }
    }
}

/// What [`policy`] chose for one GEMM+ReduceScatter/AllReduce plan: the split, the path of the
/// partials, and the heap buffers the plan reserves (bytes; `None`: not needed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmRsPolicy {
    /// Parts per row chunk.
    pub parts: u32,
    /// Comm CTAs.
    pub n_comm: u32,
    /// CTAs in total (one per SM).
    pub grid: u32,
    /// Partials pulled by the peers.
    pub pull: bool,
    /// Stager threads issue the consumers' epilogue I/O.
    pub stager: bool,
    /// Height of the pieces stored into the peers' receive buffers and the outputs.
    pub store_rows: u32,
    /// Tile rows per rasterization group.
    pub group_m: u32,
    /// Row tiles per part.
    pub part_tiles_m: u32,
    /// Tiles computed stream-K at the end of the launch.
    pub sk_tiles: u32,
    /// Rows of a local rank's chunk (`m / world`) and of a node block (`m / (world x nodes)`).
    pub chunk_rows: u64,
    pub block_rows: u64,
    /// Pushed partials land here (`world` slots of a chunk).
    pub recv_bytes: Option<u64>,
    /// The partials for the local peers at their own rows (comm CTAs or pulled).
    pub outbox_bytes: Option<u64>,
    /// GEMM + AllReduce: the whole `m` x `n` sum.
    pub ar_out_bytes: Option<u64>,
    /// Across nodes: this node's sums of the other nodes' rows of our rail, and one block per
    /// node for their sums of our rows.
    pub stage_bytes: Option<u64>,
    pub xrecv_bytes: Option<u64>,
    /// The stream-K contributors' partials (local, not in the heap).
    pub sk_ws_bytes: Option<u64>,
}

/// The split and paths of GEMM+ReduceScatter/AllReduce `p` given `split` and the tune cache's
/// `cached_parts` (used when `split.parts` is 0; else [`tune::DEFAULT_PARTS`]).
///
/// Shape rules: `m` a positive multiple of `world x nodes x 128` with at most `MAX_COMM_CTAS`
/// row tiles per local rank's chunk (one flag per row tile); `k_local` and `n` positive
/// multiples of 8 (16-byte TMA rows); every dimension below 2^31; `parts` divides the row
/// tiles of a node block; the comm CTAs leave at least `nodes` compute CTAs.
pub fn policy(p: &RsProblem, split: RsSplit, cached_parts: Option<u32>) -> Result<GemmRsPolicy> {
    let op = p.op();
    let t = GemmTile::DEFAULT;
    let block_m = t.block_m as usize;
    let bad = |reason: String| Err(Error::Shape { op, reason });
    let (m, n, k_local, world, nodes, sms) = (p.m, p.n, p.k_local, p.world, p.nodes, p.sms);
    if world == 0 || nodes == 0 {
        return bad(format!("world = {world}, nodes = {nodes}"));
    }
    for (what, v) in [("m", m), ("n", n), ("k_local", k_local)] {
        if v > i32::MAX as usize {
            return bad(format!("{what} = {v} must be below 2^31"));
        }
    }
    let global_world = check::product_usize(op, "world x nodes", &[world, nodes])?;
    let rows_per_round = check::product_usize(op, "world x nodes x 128", &[global_world, block_m])?;
    if m == 0 || m % rows_per_round != 0 {
        return bad(format!(
            "m = {m} must be a positive multiple of world x nodes x {block_m} = {rows_per_round}"
        ));
    }
    if m / world / block_m > mkernel_config::comm::MAX_COMM_CTAS as usize {
        return bad(format!(
            "m / world = {} is more than {} row tiles",
            m / world,
            mkernel_config::comm::MAX_COMM_CTAS
        ));
    }
    if k_local == 0 || k_local % 8 != 0 || n == 0 || n % 8 != 0 {
        return bad(format!(
            "k_local = {k_local} and n = {n} must be positive multiples of 8"
        ));
    }
    let parts = match split.parts {
        0 => cached_parts.unwrap_or(tune::DEFAULT_PARTS),
        r => r,
    };
    let row_tiles = m / global_world / block_m;
    if parts == 0 || row_tiles % parts as usize != 0 {
        return bad(format!(
            "parts = {parts} must divide the {row_tiles} row tiles of a rank's chunk (m / world / {block_m})"
        ));
    }
    let n_comm = match split.comm_ctas {
        _ if world == 1 => 0,
        RsSplit::AUTO | RsSplit::NO_COMM_CTAS if split.pull => 0,
        c if split.pull => {
            return bad(format!(
                "comm_ctas = {c} with pulled partials: pulling needs no comm CTAs (AUTO or NO_COMM_CTAS)"
            ))
        }
        RsSplit::AUTO => mkernel_config::ops::gemm_rs::rs_comm_ctas(world as u32, p.all_reduce),
        RsSplit::NO_COMM_CTAS => 0,
        c => c,
    };
    // Compute CTA j < nodes sends node block j across nodes (warp 1): at least that many.
    let compute_ctas = match sms.checked_sub(n_comm) {
        Some(c) if c as usize >= nodes => c,
        _ => {
            return bad(format!(
                "comm_ctas = {n_comm}: leaves fewer than {nodes} compute CTAs of the {sms} SMs"
            ))
        }
    };
    // Rows are node-blocked (mkernel_config::ops::gemm_rs::rs_source_row): a local rank's chunk of
    // m / world rows is `nodes` blocks of m / global_world rows, one per node's rank of its rail.
    let (chunk_rows, block_rows) = ((m / world) as u64, (m / global_world) as u64);
    let (m64, n64) = (m as u64, n as u64);
    let slot_bytes = check::product(op, "chunk rows x n x 2", &[chunk_rows, n64, 2])?;
    let block_bytes = check::product(op, "block rows x n x 2", &[block_rows, n64, 2])?;
    let whole_bytes = check::product(op, "m x n x 2", &[m64, n64, 2])?;
    let pull = split.pull && world > 1;
    let recv_bytes = match pull {
        true => None,
        false => Some(check::product(op, "slot bytes x world", &[slot_bytes, world as u64])?),
    };
    let outbox_bytes = (n_comm > 0 || pull).then_some(whole_bytes);
    let ar_out_bytes = p.all_reduce.then_some(whole_bytes);
    let (stage_bytes, xrecv_bytes) = if nodes > 1 {
        (
            Some(check::product(
                op,
                "block bytes x (nodes - 1)",
                &[block_bytes, nodes as u64 - 1],
            )?),
            Some(check::product(op, "block bytes x nodes", &[block_bytes, nodes as u64])?),
        )
    } else {
        (None, None)
    };
    // m, n < 2^31: the tile counts fit u32.
    let tiles = (m.div_ceil(block_m) * n.div_ceil(t.block_n as usize)) as u32;
    // Stagers where they can run (one node of 2 ranks, pushed directly), unless declined, and
    // where every compute CTA's work items fit the kernel's item table (the stagers read their
    // items from it): every anchor shape.
    let stager = world == 2
        && nodes == 1
        && n_comm == 0
        && !pull
        && !split.no_stager
        && mkernel_config::ops::gemm_rs::stager_items_fit(tiles, compute_ctas);
    let store_rows = if stager {
        mkernel_config::ops::gemm_rs::STAGER_STORE_ROWS
    } else {
        GemmTile::EPILOGUE_BOX_ROWS
    };
    let part_tiles_m = (block_rows as usize / block_m / parts as usize) as u32;
    let group_m = match split.group_m {
        0 => t.group_m,
        g => g.min(part_tiles_m),
    };
    // The stream-K tail (with the stagers only): the last partial round of tiles cut into
    // equal K ranges, one per compute CTA; contributors' f32 partials go through a workspace.
    let sk_tiles = if stager && !split.no_stream_k {
        StreamK::choose(tiles, compute_ctas, k_local.div_ceil(t.block_k as usize) as u32)
    } else {
        0
    };
    let sk_ws_bytes = match sk_tiles {
        0 => None,
        _ => Some(check::product(
            op,
            "compute CTAs x consumer warpgroups x slot bytes",
            &[compute_ctas as u64, t.consumer_warpgroups as u64, SK_SLOT_BYTES],
        )?),
    };
    Ok(GemmRsPolicy {
        parts,
        n_comm,
        grid: sms,
        pull,
        stager,
        store_rows,
        group_m,
        part_tiles_m,
        sk_tiles,
        chunk_rows,
        block_rows,
        recv_bytes,
        outbox_bytes,
        ar_out_bytes,
        stage_bytes,
        xrecv_bytes,
        sk_ws_bytes,
    })
}

/// A planned GEMM + ReduceScatter or GEMM + AllReduce (module docs). A few comm CTAs copy
/// completed row tiles to the local peers (or none: the compute CTAs store or the peers pull),
/// the others compute; `parts` cuts each rank's row chunk into parts visited in turn
/// (docs/fused.md), so reductions (and AllReduce's broadcasts) start early. Borrows its
/// communicator and its buffers for `'a` (see [`crate::ops`]).
pub struct GemmRsPlan<'a> {
    comm: &'a Communicator,
    func: CudaFunction,
    _maps: CudaSlice<u64>,
    _args: CudaSlice<u8>,
    /// The stream-K contributors' partials (local; `None` without a stream-K tail).
    _sk_ws: Option<CudaSlice<u8>>,
    args_addr: u64,
    /// The communicator's descriptor, the kernel's second parameter (also `GemmRsArgs::desc`):
    /// its loads and the arguments' then issue together at the launch's start.
    desc_addr: u64,
    policy: GemmRsPolicy,
    /// GEMM + AllReduce: the whole `m` x `n` sum, in the heap (same offset on every rank).
    ar_out: Option<SymBuffer>,
    /// The heap buffers (recv, outbox, ar_out, stage, xrecv), given back when the plan drops.
    _heap: Vec<Option<HeapRegion<'a>>>,
    _buffers: PhantomData<&'a ()>,
}

impl<'a> GemmRsPlan<'a> {
    /// Plans GEMM + ReduceScatter on cudarc slices or views of this communicator's device:
    /// `a` holds `m` x `k_local`, `b` holds `n` x `k_local`, `out` holds `m / world` x `n`
    /// (`world`: every rank of every node; lengths checked). Collective: every local rank
    /// plans the same shape, in the same order relative to its other heap allocations.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        a: &'a impl DevicePtr<bf16>,
        b: &'a impl DevicePtr<bf16>,
        out: &'a mut impl DevicePtrMut<bf16>,
        m: usize,
        n: usize,
        k_local: usize,
        split: RsSplit,
    ) -> Result<Self> {
        let op = "gemm_rs";
        let world = (comm.world() * comm.nnodes()) as usize;
        let checked = check::buffer_on(op, "out", comm.device(), &*out)
            .and_then(|()| check::len_of(op, "out", out.len(), "m / world x n", &[m / world.max(1), n]));
        let mut _guard = None;
        let po = checked.map(|()| {
            let (po, wo) = out.device_ptr_mut(stream);
            _guard = Some(wo);
            Some(po)
        });
        // SAFETY: `out` holds the shape's elements, is on this device and is borrowed mutably
        // for 'a; `checked_inputs` does the same for `a` and `b`.
        unsafe { Self::checked_inputs(comm, stream, a, b, po, false, m, n, k_local, split) }
    }

    /// Plans GEMM + AllReduce: as [`GemmRsPlan::new`], but every rank gets the whole `m` x `n`
    /// sum, in a heap buffer the plan reserves ([`GemmRsPlan::all_reduce_output`]): comm CTAs
    /// (or the compute CTAs) copy each reduced row tile into every local rank's output over
    /// NVLink.
    #[allow(clippy::too_many_arguments)]
    pub fn new_all_reduce(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        a: &'a impl DevicePtr<bf16>,
        b: &'a impl DevicePtr<bf16>,
        m: usize,
        n: usize,
        k_local: usize,
        split: RsSplit,
    ) -> Result<Self> {
        // SAFETY: `checked_inputs` checks `a` and `b`, which are borrowed for 'a.
        unsafe { Self::checked_inputs(comm, stream, a, b, Ok(None), true, m, n, k_local, split) }
    }

    /// Checks `a` and `b` (device, lengths) and plans on their addresses.
    ///
    /// # Safety
    /// As [`GemmRsPlan::new_raw`] for `out`; `a` and `b` must be borrowed for 'a.
    #[allow(clippy::too_many_arguments)]
    unsafe fn checked_inputs(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        a: &'a impl DevicePtr<bf16>,
        b: &'a impl DevicePtr<bf16>,
        out: Result<Option<u64>>,
        all_reduce: bool,
        m: usize,
        n: usize,
        k_local: usize,
        split: RsSplit,
    ) -> Result<Self> {
        let op = if all_reduce { "gemm_ar" } else { "gemm_rs" };
        let device = comm.device();
        let checked = out.and_then(|out| {
            check::stream_on(op, device, stream)?;
            check::buffer_on(op, "A", device, a)?;
            check::buffer_on(op, "B", device, b)?;
            check::len_of(op, "A", a.len(), "m x k_local", &[m, k_local])?;
            check::len_of(op, "B", b.len(), "n x k_local", &[n, k_local])?;
            Ok(out)
        });
        let mut _guards = None;
        let pre = checked.map(|out| {
            let (pa, ra) = a.device_ptr(stream);
            let (pb, rb) = b.device_ptr(stream);
            _guards = Some((ra, rb));
            (pa, pb, out)
        });
        // SAFETY: `a` and `b` hold the shape's elements, are on this device and are borrowed
        // for 'a; `out` by the caller's contract.
        unsafe { Self::build(comm, stream, pre, all_reduce, m, n, k_local, split) }
    }

    /// Heap bytes a plan of `problem` with `split` takes on every rank, before it is built:
    /// the receive, outbox, AllReduce output and inter-node buffers [`policy`] asks for, each
    /// rounded up to 256 bytes. They do not depend on `parts` (0 is taken as 1 here).
    pub fn heap_bytes(problem: &RsProblem, split: RsSplit) -> Result<u64> {
        let split = RsSplit {
            parts: split.parts.max(1),
            ..split
        };
        let p = policy(problem, split, None)?;
        let op = problem.op();
        [
            p.recv_bytes,
            p.outbox_bytes,
            p.ar_out_bytes,
            p.stage_bytes,
            p.xrecv_bytes,
        ]
        .into_iter()
        .flatten()
        .try_fold(0u64, |sum, b| {
            b.checked_next_multiple_of(256).and_then(|b| sum.checked_add(b))
        })
        .ok_or_else(|| Error::Shape {
            op,
            reason: "heap bytes overflow 64 bits".into(),
        })
    }

    /// GEMM + ReduceScatter (`out: Some`, the local output's address) or GEMM + AllReduce
    /// (`None`) on raw device addresses (16-byte aligned).
    ///
    /// # Safety
    /// `a`, `b` and `out` must be device addresses of the communicator's context holding
    /// `m` x `k_local`, `n` x `k_local` and `m / world` x `n` bf16, and stay allocated while the
    /// plan's launches run; `out` is written by them, and nothing else may access it meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new_raw(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        a: u64,
        b: u64,
        out: Option<u64>,
        m: usize,
        n: usize,
        k_local: usize,
        split: RsSplit,
    ) -> Result<Self> {
        // SAFETY: the caller's contract.
        unsafe { Self::build(comm, stream, Ok((a, b, out)), out.is_none(), m, n, k_local, split) }
    }

    /// Validate (`pre`: the safe constructors' checks, or the raw addresses), take the heap,
    /// agree with every rank, encode and upload.
    ///
    /// # Safety
    /// As [`GemmRsPlan::new_raw`] for the addresses in `pre`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn build(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        pre: Result<(u64, u64, Option<u64>)>,
        all_reduce: bool,
        m: usize,
        n: usize,
        k_local: usize,
        split: RsSplit,
    ) -> Result<Self> {
        let device: &Device = comm.device();
        let problem = RsProblem {
            m,
            n,
            k_local,
            world: comm.world() as usize,
            nodes: comm.nnodes() as usize,
            sms: device.sm_count(),
            all_reduce,
        };
        let op = problem.op();
        let global_world = problem.world * problem.nodes;
        let cached = match split.parts {
            0 => tune::lookup(&tune::TuneKey {
                op: problem.tune_op().into(),
                world: global_world as u32,
                m,
                n,
                k: k_local.saturating_mul(global_world),
            }),
            _ => None,
        };
        let checked = pre.and_then(|(a, b, out)| {
            check::stream_on(op, device, stream)?;
            if out.is_none() != all_reduce {
                return Err(Error::Shape {
                    op,
                    reason: "GEMM + AllReduce has no local output; GEMM + ReduceScatter needs one".into(),
                });
            }
            let pol = policy(&problem, split, cached)?;
            check::aligned16(op, &[("A", a), ("B", b), ("out", out.unwrap_or(0))])?;
            // recv, outbox, AllReduce output, stage, inter-node receive: the heap, in this order.
            let heap = [
                pol.recv_bytes,
                pol.outbox_bytes,
                pol.ar_out_bytes,
                pol.stage_bytes,
                pol.xrecv_bytes,
            ]
            .map(|bytes| bytes.map(|b| comm.alloc_region(b)).transpose());
            let heap: Vec<Option<HeapRegion<'a>>> = heap.into_iter().collect::<Result<_>>()?;
            Ok((a, b, out, pol, heap))
        });
        let ((a, b, out, pol, heap), _) = comm.agree_on(op, checked, |(_, _, _, pol, heap)| {
            let offsets: Vec<Option<(u64, u64)>> = heap
                .iter()
                .map(|r| r.as_ref().map(|r| (r.offset(), r.bytes())))
                .collect();
            PlanDesc::new(op)
                .field("m", m)
                .field("n", n)
                .field("k_local", k_local)
                .field("dtype", "bf16")
                .field("world", problem.world)
                .field("nodes", problem.nodes)
                .field("split", format!("{split:?}"))
                .field("parts", pol.parts)
                .field("n_comm", pol.n_comm)
                .field("pull", pol.pull)
                .field("stager", pol.stager)
                .field("sk_tiles", pol.sk_tiles)
                .field("grid", pol.grid)
                .field(
                    "heap (offset, bytes): recv, outbox, ar_out, stage, xrecv",
                    format!("{offsets:?}"),
                )
        })?;
        let t = GemmTile::DEFAULT;
        let (world, nodes) = (problem.world, problem.nodes);
        let (n64, k64) = (n as u64, k_local as u64);
        let slot_bytes = pol.chunk_rows * n64 * 2;
        let block_bytes = pol.block_rows * n64 * 2;
        let buf = |i: usize| heap[i].as_ref().map(|r| r.buffer());
        let (recv, outbox, ar_out, stage, xrecv) = (buf(0), buf(1), buf(2), buf(3), buf(4));
        let (rank, global_rank) = (comm.rank() as u64, comm.global_rank() as u64);
        let map_a = encode_bf16_sw128_packed(a, k64, m as u64, t.block_k, t.block_m)?;
        let map_b = encode_bf16_sw128_packed(b, k64, n64, t.block_k, t.block_n)?;
        // Tensor maps: A, B, the outbox (with comm CTAs) or this rank's slot in every local
        // rank's receive buffer (without), where the reduced chunk goes (AllReduce: into every
        // local rank's output), the stage, the first peer's slot of our receive buffer (its
        // partials, TMA-loaded by own tiles). Each is 128 bytes in one table.
        let box_map = |ptr: u64, rows: u64| {
            encode_bf16_sw128_packed(ptr, n64, rows, GemmTile::EPILOGUE_BOX_COLS, GemmTile::EPILOGUE_BOX_ROWS)
        };
        // Where a stager stores (the peers' receive buffers, the outputs): its pieces' height.
        let store_map =
            |ptr: u64, rows: u64| encode_bf16_sw128_packed(ptr, n64, rows, GemmTile::EPILOGUE_BOX_COLS, pol.store_rows);
        let outs: Vec<u64> = match (out, ar_out) {
            (Some(o), _) => vec![o],
            (None, Some(ar)) => (0..world)
                .map(|p| Ok(comm.peer_ptr(p as u32, &ar)? + global_rank * block_bytes))
                .collect::<Result<_>>()?,
            (None, None) => unreachable!("an AllReduce plan reserves its output"),
        };
        let mut maps_host = vec![map_a.opaque, map_b.opaque];
        let mut push = |map: [u64; 16]| {
            maps_host.push(map);
            maps_host.len() - 1
        };
        let outbox_map = match outbox {
            Some(o) => Some(push(box_map(comm.ptr(&o)?, m as u64)?.opaque)),
            None => None,
        };
        let mut recv_maps = vec![];
        if let (None, Some(recv)) = (outbox, recv) {
            for p in 0..world {
                recv_maps.push(push(
                    store_map(comm.peer_ptr(p as u32, &recv)? + rank * slot_bytes, pol.chunk_rows)?.opaque,
                ));
            }
        }
        let mut out_maps = vec![];
        for &o in &outs {
            out_maps.push(push(store_map(o, pol.block_rows)?.opaque));
        }
        let stage_map = match stage {
            Some(st) => Some(push(
                box_map(comm.ptr(&st)?, pol.block_rows * (nodes as u64 - 1))?.opaque,
            )),
            None => None,
        };
        let first_peer = (rank + 1) % world as u64;
        let in_map = match (recv, outbox) {
            _ if world == 1 => None,
            // Pushed: the whole receive buffer (every peer's slot; own tiles TMA-load each
            // peer's partial in turn).
            (Some(recv), _) => Some(push(box_map(comm.ptr(&recv)?, pol.chunk_rows * world as u64)?.opaque)),
            // Pulled: the first peer's outbox (all `m` rows) as mapped here.
            (None, Some(o)) => Some(push(box_map(comm.peer_ptr(first_peer as u32, &o)?, m as u64)?.opaque)),
            (None, None) => unreachable!("pulled partials need the outbox"),
        };
        let words: Vec<u64> = maps_host.concat();
        let maps = stream.clone_htod(&words)?;
        let maps_addr = maps.device_ptr(stream).0;
        let map_at = |i: Option<usize>| i.map_or(0, |i| maps_addr + 128 * i as u64);
        let (mut map_recv, mut map_out) = ([0u64; 8], [0u64; 8]);
        for (m, &i) in map_recv.iter_mut().zip(&recv_maps) {
            *m = map_at(Some(i));
        }
        for (m, &i) in map_out.iter_mut().zip(&out_maps) {
            *m = map_at(Some(i));
        }
        let sk_ws = match pol.sk_ws_bytes {
            Some(bytes) => Some(stream.alloc_zeros::<u8>(bytes as usize)?),
            None => None,
        };
        let args = GemmRsArgs {
            desc: comm.desc_ptr(),
            map_a: map_at(Some(0)),
            map_b: map_at(Some(1)),
            map_outbox: map_at(outbox_map),
            map_recv,
            map_out,
            map_stage: map_at(stage_map),
            map_in: map_at(in_map),
            recv_off: recv.map_or(0, |b| b.offset()),
            outbox_off: outbox.map_or(0, |b| b.offset()),
            stage_off: stage.map_or(0, |b| b.offset()),
            xrecv_off: xrecv.map_or(0, |b| b.offset()),
            out_off: ar_out.map_or(0, |b| b.offset()),
            m: m as u32,
            n: n as u32,
            k: k_local as u32,
            part_tiles_m: pol.part_tiles_m,
            all_reduce: ar_out.is_some() as u32,
            n_comm: pol.n_comm,
            group_m: pol.group_m,
            pull: pol.pull as u32,
            trace: 0,
            stager: pol.stager as u32,
            sk_tiles: if sk_ws.is_some() { pol.sk_tiles } else { 0 },
            sk_ws: sk_ws.as_ref().map_or(0, |ws| ws.device_ptr(stream).0),
        };
        let (args_dev, args_addr) = super::upload_args(stream, &args)?;
        // Launches may come on other streams: the uploads are complete before the plan exists.
        stream.synchronize()?;
        Ok(GemmRsPlan {
            comm,
            func: device.function(&kernels::GEMM_RS_NK)?,
            _maps: maps,
            _args: args_dev,
            _sk_ws: sk_ws,
            args_addr,
            desc_addr: args.desc,
            policy: pol,
            ar_out,
            _heap: heap,
            _buffers: PhantomData,
        })
    }

    /// Enqueues the fused kernel (under the communicator's launch lock).
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let op = if self.ar_out.is_some() { "gemm_ar" } else { "gemm_rs" };
        self.comm.enqueue(op, stream, || {
            let mut b = stream.launch_builder(&self.func);
            b.arg(&self.args_addr);
            b.arg(&self.desc_addr);
            // SAFETY: mk_gemm_rs_bf16_nk(args, desc); the buffers and the communicator are
            // borrowed for the plan's lifetime (or kept alive by new_raw's caller).
            unsafe { b.launch(Device::launch_config(&kernels::GEMM_RS_NK, self.policy.grid)) }?;
            Ok(())
        })
    }
    /// [`GemmRsPlan::launch`] on a raw `CUstream` (a stream a server got from elsewhere, e.g.
    /// PyTorch's): refused unless it belongs to the communicator's context; ordered after the
    /// communicator's previous launch, and the next one after it, through events.
    ///
    /// # Safety
    /// `stream` must be a live stream (or null, the legacy default stream) that stays valid
    /// until the launch has completed.
    pub unsafe fn launch_raw(&self, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        let op = if self.ar_out.is_some() { "gemm_ar" } else { "gemm_rs" };
        // SAFETY: caller's contract for `stream`.
        unsafe {
            self.comm.enqueue_raw(op, stream, || {
                let cfg = Device::launch_config(&kernels::GEMM_RS_NK, self.policy.grid);
                let mut params = [
                    &self.args_addr as *const u64 as *mut std::ffi::c_void,
                    &self.desc_addr as *const u64 as *mut std::ffi::c_void,
                ];
                // SAFETY: mk_gemm_rs_bf16_nk(args, desc), its two parameters; the plan's buffers
                // and communicator outlive the launch as in `launch`.
                cudarc::driver::result::launch_kernel(
                    self.func.cu_function(),
                    cfg.grid_dim,
                    cfg.block_dim,
                    cfg.shared_mem_bytes,
                    stream,
                    &mut params,
                )?;
                Ok(())
            })
        }
    }
    /// The AllReduce output in the heap (`None` for a ReduceScatter plan).
    pub fn all_reduce_output(&self) -> Option<SymBuffer> {
        self.ar_out
    }
    /// The policy's choices.
    pub fn policy(&self) -> GemmRsPolicy {
        self.policy
    }
    /// Parts per row chunk, and CTAs in total.
    pub fn split(&self) -> (u32, u32) {
        (self.policy.parts, self.policy.grid)
    }
    /// Whether stager threads issue the consumers' epilogue I/O ([`RsSplit::no_stager`]).
    pub fn stager(&self) -> bool {
        self.policy.stager
    }
    /// Comm CTAs (of [`GemmRsPlan::split`]'s total).
    pub fn comm_ctas(&self) -> u32 {
        self.policy.n_comm
    }
    /// Tiles computed stream-K at the end of the launch (0: none; [`RsSplit::no_stream_k`]).
    pub fn stream_k_tiles(&self) -> u32 {
        self.policy.sk_tiles
    }

    /// Diagnostic: the launches enqueued from now on record their per-tile timeline into the
    /// device buffer at `buf` (`mkernel_config::trace::words(grid)` u64 words; layout in
    /// [`mkernel_config::trace`]), or, with `None`, stop recording.
    ///
    /// # Safety
    /// `buf` must stay allocated, with at least that many words, while such launches run, and
    /// no launch of this plan may run on another stream than `stream` meanwhile (the change
    /// is ordered on `stream` only).
    pub unsafe fn set_trace(&self, stream: &Arc<CudaStream>, buf: Option<u64>) -> Result<()> {
        let field = self.args_addr + std::mem::offset_of!(GemmRsArgs, trace) as u64;
        let word = [buf.unwrap_or(0)];
        // SAFETY: the field lies in this plan's argument block; the copy is stream-ordered
        // after the launches enqueued so far, and `word` outlives it (synchronized below).
        unsafe { cudarc::driver::result::memcpy_htod_async(field, &word, stream.cu_stream())? };
        stream.synchronize()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(m: usize, n: usize, k_local: usize, world: usize, nodes: usize) -> RsProblem {
        RsProblem {
            m,
            n,
            k_local,
            world,
            nodes,
            sms: 132,
            all_reduce: false,
        }
    }

    fn reason(r: Result<GemmRsPolicy>) -> String {
        match r {
            Err(Error::Shape { reason, .. }) => reason,
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn shapes_and_parts_are_checked_before_planning() {
        let d = RsSplit::default();
        assert!(policy(&problem(16384, 8192, 2048, 4, 1), d, None).is_ok());
        let ar = RsProblem {
            all_reduce: true,
            ..problem(16384, 8192, 2048, 2, 2)
        };
        assert!(policy(&ar, d, None).is_ok());
        assert!(
            reason(policy(&problem(1000, 8192, 2048, 2, 1), d, None)).contains("multiple of world x nodes x 128 = 256")
        );
        assert!(reason(policy(&problem(256 * 3, 8192, 2048, 2, 2), d, None))
            .contains("multiple of world x nodes x 128 = 512"));
        assert!(reason(policy(&problem(4096, 8190, 2048, 2, 1), d, None)).contains("multiples of 8"));
        assert!(reason(policy(&problem(2 * 128 * 300, 256, 256, 2, 1), d, None)).contains("more than 256 row tiles"));
        assert!(reason(policy(&problem(4096, 1 << 31, 256, 2, 1), d, None)).contains("below 2^31"));
        assert!(reason(policy(&problem(4096, 256, 256, 0, 1), d, None)).contains("world = 0"));
        // 16384 rows over 4 ranks: 32 row tiles per chunk.
        for ok in [1, 2, 4, 8, 16, 32] {
            assert!(
                policy(&problem(16384, 256, 256, 4, 1), RsSplit::parts(ok), None).is_ok(),
                "parts {ok}"
            );
        }
        let p = |parts, cached| policy(&problem(16384, 256, 256, 4, 1), RsSplit::parts(parts), cached);
        assert!(reason(p(3, None)).contains("parts = 3 must divide the 32 row tiles"));
        assert!(reason(p(0, Some(0))).contains("parts = 0"));
        assert_eq!(
            p(0, Some(4)).unwrap().parts,
            4,
            "the tune cache when no parts are given"
        );
        assert_eq!(p(8, Some(4)).unwrap().parts, 8, "given parts win");
        assert_eq!(p(0, None).unwrap().parts, tune::DEFAULT_PARTS);
    }

    /// Every combination of edge values: never a panic (no overflow, no division by zero), and
    /// an accepted plan keeps its invariants.
    #[test]
    fn edge_values_never_panic_and_accepted_plans_hold() {
        let dims = [
            0usize,
            1,
            8,
            127,
            128,
            256,
            1000,
            4096,
            6656,
            i32::MAX as usize,
            1 << 31,
            usize::MAX,
        ];
        let counts = [0usize, 1, 2, 3, 4, 8, 64, usize::MAX];
        let sms = [0u32, 1, 2, 132, u32::MAX];
        let splits = [
            RsSplit::default(),
            RsSplit::parts(2),
            RsSplit::parts(u32::MAX),
            RsSplit {
                comm_ctas: RsSplit::NO_COMM_CTAS,
                ..RsSplit::default()
            },
            RsSplit {
                comm_ctas: u32::MAX - 1,
                group_m: u32::MAX,
                ..RsSplit::default()
            },
            RsSplit {
                pull: true,
                ..RsSplit::default()
            },
        ];
        let mut accepted = 0;
        for &m in &dims {
            for &n in &[0usize, 8, 1000, i32::MAX as usize, usize::MAX] {
                for &k_local in &[0usize, 8, 136, usize::MAX] {
                    for &world in &counts {
                        for &nodes in &counts[..5] {
                            for &sms in &sms {
                                for split in splits {
                                    for all_reduce in [false, true] {
                                        let p = RsProblem {
                                            m,
                                            n,
                                            k_local,
                                            world,
                                            nodes,
                                            sms,
                                            all_reduce,
                                        };
                                        let Ok(pol) = policy(&p, split, Some(3)) else {
                                            continue;
                                        };
                                        accepted += 1;
                                        let gw = (world * nodes) as u64;
                                        assert!(pol.n_comm as usize + nodes <= sms as usize, "{p:?} {split:?}");
                                        assert_eq!(pol.chunk_rows * world as u64, m as u64);
                                        assert_eq!(pol.block_rows * gw, m as u64);
                                        assert_eq!(pol.part_tiles_m as u64 * pol.parts as u64 * 128, pol.block_rows);
                                        if let Some(r) = pol.recv_bytes {
                                            assert_eq!(r, m as u64 * n as u64 * 2);
                                        }
                                        assert_eq!(pol.ar_out_bytes.is_some(), all_reduce);
                                        assert_eq!(pol.stage_bytes.is_some(), nodes > 1);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(accepted > 0);
    }

    #[test]
    fn paths_and_buffers_follow_the_split() {
        // One node of 2 ranks, pushed, no comm CTAs: stagers, a receive buffer, no outbox.
        let two = problem(4096, 1024, 512, 2, 1);
        let s = policy(&two, RsSplit::default(), None).unwrap();
        assert!(s.stager && !s.pull);
        assert_eq!(
            (s.n_comm, s.grid, s.store_rows),
            (0, 132, mkernel_config::ops::gemm_rs::STAGER_STORE_ROWS)
        );
        assert_eq!(s.recv_bytes, Some(2048 * 1024 * 2 * 2));
        assert_eq!(
            (s.outbox_bytes, s.ar_out_bytes, s.stage_bytes, s.xrecv_bytes),
            (None, None, None, None)
        );
        // 32 x 4 = 128 tiles on 132 CTAs: no partial round to cut.
        assert_eq!((s.sk_tiles, s.sk_ws_bytes), (0, None));
        let no_stager = policy(
            &two,
            RsSplit {
                no_stager: true,
                ..RsSplit::default()
            },
            None,
        )
        .unwrap();
        assert!(!no_stager.stager);
        assert_eq!(no_stager.store_rows, GemmTile::EPILOGUE_BOX_ROWS);
        // Pulled: an outbox, no receive buffer, no comm CTAs; comm CTAs with pull are refused.
        let pull = RsSplit {
            pull: true,
            ..RsSplit::default()
        };
        let s = policy(&two, pull, None).unwrap();
        assert!(s.pull && !s.stager);
        assert_eq!(
            (s.recv_bytes, s.outbox_bytes, s.n_comm),
            (None, Some(4096 * 1024 * 2), 0)
        );
        assert!(reason(policy(&two, RsSplit { comm_ctas: 4, ..pull }, None)).contains("pulling needs no comm CTAs"));
        // Explicit comm CTAs: an outbox, and the comm CTAs must leave compute CTAs.
        let cc = |c| RsSplit {
            comm_ctas: c,
            ..RsSplit::default()
        };
        let s = policy(&two, cc(3), None).unwrap();
        assert_eq!((s.n_comm, s.outbox_bytes.is_some(), s.stager), (3, true, false));
        assert!(reason(policy(&two, cc(132), None)).contains("leaves fewer than 1 compute CTAs"));
        assert!(reason(policy(&two, cc(u32::MAX - 1), None)).contains("leaves fewer"));
        // One rank: no peers, no comm CTAs whatever is asked.
        assert_eq!(policy(&problem(4096, 1024, 512, 1, 1), cc(8), None).unwrap().n_comm, 0);
        // Across nodes: the stage and the remote receive blocks; AllReduce: its output.
        let x = RsProblem {
            all_reduce: true,
            ..problem(4096, 1024, 512, 2, 2)
        };
        let s = policy(&x, RsSplit::default(), None).unwrap();
        let block = 1024 * 1024 * 2;
        assert_eq!((s.stage_bytes, s.xrecv_bytes), (Some(block), Some(2 * block)));
        assert_eq!(s.ar_out_bytes, Some(4096 * 1024 * 2));
        assert!(!s.stager);
        // More tiles than CTAs with a partial last round: a stream-K tail and its workspace.
        let sk = policy(&problem(6656, 1024, 1024, 2, 1), RsSplit::default(), None).unwrap();
        assert!(sk.stager && sk.sk_tiles > 0);
        assert_eq!(
            sk.sk_ws_bytes,
            Some(132 * GemmTile::DEFAULT.consumer_warpgroups as u64 * SK_SLOT_BYTES)
        );
        let no_sk = RsSplit {
            no_stream_k: true,
            ..RsSplit::default()
        };
        assert_eq!(
            policy(&problem(6656, 1024, 1024, 2, 1), no_sk, None).unwrap().sk_tiles,
            0
        );
        // group_m is capped at the row tiles of a part.
        let g = RsSplit {
            group_m: 1000,
            parts: 2,
            ..RsSplit::default()
        };
        assert_eq!(policy(&two, g, None).unwrap().group_m, 8);
    }
}
