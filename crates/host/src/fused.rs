//! Fused communication + GEMM operations on a [`Communicator`].
//!
//! [`AgGemmPlan`]: AllGather + GEMM for tensor parallelism: each rank holds `m / world` rows of
//! A (`a_shard`, local) and its own B (`n` x `k`, `nn.Linear` layout); every rank gets
//! `C = gather_rows(A) * B^T` (`m` x `n`, bf16) from one persistent kernel whose first `n_comm`
//! CTAs move A over NVLink chunk by chunk while the others run the GEMM on chunks as they land
//! (docs/fused.md).
//!
//! Across nodes AllGather+GEMM shards A by global rank: NVLink pushes inside the node, one
//! proxy PUT of the whole shard to every rank of the other nodes (docs/fused.md).
//! [`GemmRsPlan`]: GEMM + ReduceScatter / AllReduce with K split over ranks. Across nodes a
//! node's partials of a rank's rows are summed inside the node (NVLink) on that rank's rail
//! peer, which PUTs the node's sum through the proxy; AllReduce PUTs each reduced chunk to every
//! remote rank (docs/fused.md). B as N x K.
use crate::comm::{Communicator, SymBuffer};
use crate::error::{Error, Result};
use crate::runtime::Device;
use crate::tensor_map::{encode_bf16_sw128, Tensor2d};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, PushKernelArg};
use mkernel_config::ops::ag_gemm::AgGemmArgs;
use mkernel_config::ops::gemm_rs::{GemmRsArgs, SK_SLOT_BYTES};
use mkernel_config::stream_k::StreamK;
use mkernel_config::{kernels, GemmTile};
use std::sync::Arc;

const OP: &str = "ag_gemm";

/// A planned AllGather + GEMM: descriptors and arguments uploaded, gathered-A buffer reserved.
pub struct AgGemmPlan {
    func: CudaFunction,
    _maps: CudaSlice<u64>,
    args: CudaSlice<u8>,
    args_addr: u64,
    grid: u32,
    n_comm: u32,
    gathered: SymBuffer,
}

impl AgGemmPlan {
    /// [`AgGemmPlan::new`] on cudarc buffers (lengths checked): `a_shard` holds `m / world` x
    /// `k`, `b` holds `n` x `k`, `c` holds `m` x `n`. The buffers must outlive every launch of
    /// the plan (they are borrowed only while planning).
    #[allow(clippy::too_many_arguments)]
    pub fn from_slices(
        comm: &mut Communicator,
        stream: &Arc<CudaStream>,
        a_shard: &CudaSlice<half::bf16>,
        b: &CudaSlice<half::bf16>,
        c: &mut CudaSlice<half::bf16>,
        m: usize,
        n: usize,
        k: usize,
        n_comm: u32,
    ) -> Result<AgGemmPlan> {
        let world = (comm.world() * comm.nnodes()) as usize;
        check_len(OP, "A shard", a_shard.len(), m / world.max(1) * k)?;
        check_len(OP, "B", b.len(), n * k)?;
        check_len(OP, "C", c.len(), m * n)?;
        let (pa, pb) = (a_shard.device_ptr(stream).0, b.device_ptr(stream).0);
        let pc = {
            use cudarc::driver::DevicePtrMut;
            c.device_ptr_mut(stream).0
        };
        // SAFETY: lengths checked above; the caller keeps the buffers alive (documented).
        unsafe { Self::new(comm, stream, pa, pb, pc, m, n, k, n_comm) }
    }

    /// Plans `c = gather_rows(a_shard) * b^T` (`c`: `m` x `n`; `b`: `n` x `k`; `a_shard`:
    /// `m / world` x `k` with `world` every rank of every node, rows of global rank order;
    /// device addresses, 16-byte aligned). `n_comm` CTAs move A; the rest of
    /// the GPU's SMs compute; 0 takes the split from the tune cache ([`crate::tune`]).
    /// Collective: every local rank plans the same shape.
    ///
    /// # Safety
    /// The buffers must hold the sizes above and stay valid while the plan is launched.
    pub unsafe fn new(
        comm: &mut Communicator,
        stream: &Arc<CudaStream>,
        a_shard: u64,
        b: u64,
        c: u64,
        m: usize,
        n: usize,
        k: usize,
        n_comm: u32,
    ) -> Result<AgGemmPlan> {
        // Shards are by global rank (world = every rank of every node).
        let world = (comm.world() * comm.nnodes()) as usize;
        let t = GemmTile::DEFAULT;
        check_ag_gemm(m, n, k, world, [("A shard", a_shard), ("B", b), ("C", c)])?;
        let device: Device = comm.device().clone();
        let sms = device.sm_count();
        let n_comm = crate::tune::split_for(
            n_comm,
            &crate::tune::TuneKey {
                op: "ag-gemm".into(),
                world: world as u32,
                m,
                n,
                k,
            },
        );
        check_n_comm(n_comm, sms)?;
        let gathered = comm.alloc((m * k * 2) as u64)?;
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        let map_a = encode_bf16_sw128(
            Tensor2d {
                ptr: comm.ptr(&gathered),
                cols: k64,
                rows: m64,
                row_stride_bytes: 2 * k64,
            },
            t.block_k,
            t.block_m,
        )?;
        let map_a_local = encode_bf16_sw128(
            Tensor2d {
                ptr: a_shard,
                cols: k64,
                rows: (m / world) as u64,
                row_stride_bytes: 2 * k64,
            },
            t.block_k,
            t.block_m,
        )?;
        let map_b = encode_bf16_sw128(
            Tensor2d {
                ptr: b,
                cols: k64,
                rows: n64,
                row_stride_bytes: 2 * k64,
            },
            t.block_k,
            t.block_n,
        )?;
        let map_c = encode_bf16_sw128(
            Tensor2d {
                ptr: c,
                cols: n64,
                rows: m64,
                row_stride_bytes: 2 * n64,
            },
            GemmTile::EPILOGUE_BOX_COLS,
            GemmTile::EPILOGUE_BOX_ROWS,
        )?;
        let mut words = [0u64; 64];
        words[..16].copy_from_slice(&map_a.opaque);
        words[16..32].copy_from_slice(&map_b.opaque);
        words[32..48].copy_from_slice(&map_c.opaque);
        words[48..].copy_from_slice(&map_a_local.opaque);
        let maps = stream.clone_htod(&words)?;
        let maps_addr = maps.device_ptr(stream).0;
        let a = AgGemmArgs {
            desc: comm.desc_ptr(),
            a_shard,
            a_gathered_off: gathered.offset,
            map_a: maps_addr,
            map_a_local: maps_addr + 384,
            map_b: maps_addr + 128,
            map_c: maps_addr + 256,
            m: m as u32,
            n: n as u32,
            k: k as u32,
            n_comm,
        };
        // SAFETY: AgGemmArgs is repr(C) plain data.
        let bytes = unsafe {
            std::slice::from_raw_parts(&a as *const AgGemmArgs as *const u8, std::mem::size_of::<AgGemmArgs>())
        };
        let args = stream.clone_htod(bytes)?;
        let args_addr = args.device_ptr(stream).0;
        Ok(AgGemmPlan {
            func: device.function(&kernels::AG_GEMM_NK)?,
            _maps: maps,
            args,
            args_addr,
            grid: sms,
            n_comm,
            gathered,
        })
    }

    /// Enqueues the fused kernel.
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let mut b = stream.launch_builder(&self.func);
        b.arg(&self.args_addr);
        // SAFETY: mk_ag_gemm_bf16_nk(args); the plan's buffers outlive its launches (new's contract).
        unsafe { b.launch(Device::launch_config(&kernels::AG_GEMM_NK, self.grid)) }?;
        let _ = &self.args;
        Ok(())
    }
    /// CTAs moving A, and in total.
    pub fn split(&self) -> (u32, u32) {
        (self.n_comm, self.grid)
    }
    /// The gathered-A buffer in the heap: the peers' shards (and, across nodes, this rank's own,
    /// staged for the proxy). On one node this rank's own rows are never written there: the
    /// kernel reads them in place from `a_shard`.
    pub fn gathered(&self) -> SymBuffer {
        self.gathered
    }
}

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
}

/// A planned GEMM + ReduceScatter: every rank holds `a` (`m` x `k_local`) and `b` (`n` x
/// `k_local`, `nn.Linear` layout) with K split over ranks, and gets rows
/// `[rank * m / world, (rank + 1) * m / world)` of `sum_r a_r * b_r^T` in `out` (`m / world` x
/// `n` bf16, local; `rank` and `world` global: every rank of every node), partial tiles summed
/// in f32 (across nodes, each node's sum is rounded to bf16 once before it crosses). A few
/// comm CTAs copy completed row tiles to the local peers, the others compute; `parts` cuts
/// each rank's row chunk into parts visited in turn (docs/fused.md), so reductions (and
/// AllReduce's broadcasts) start early.
pub struct GemmRsPlan {
    func: CudaFunction,
    _maps: CudaSlice<u64>,
    _args: CudaSlice<u8>,
    /// The stream-K contributors' partials (local; `None` without a stream-K tail).
    _sk_ws: Option<CudaSlice<u8>>,
    args_addr: u64,
    /// The communicator's descriptor, the kernel's second parameter (also `GemmRsArgs::desc`):
    /// its loads and the arguments' then issue together at the launch's start.
    desc_addr: u64,
    grid: u32,
    parts: u32,
    n_comm: u32,
    /// GEMM + AllReduce: the whole `m` x `n` sum, in the heap (same offset on every rank).
    ar_out: Option<SymBuffer>,
    stager: bool,
    sk_tiles: u32,
}

impl GemmRsPlan {
    /// [`GemmRsPlan::new`] on cudarc buffers (lengths checked): `a` holds `m` x `k_local`, `b`
    /// holds `n` x `k_local`, `out` holds `m / world` x `n`. The buffers must outlive every
    /// launch of the plan.
    #[allow(clippy::too_many_arguments)]
    pub fn from_slices(
        comm: &mut Communicator,
        stream: &Arc<CudaStream>,
        a: &CudaSlice<half::bf16>,
        b: &CudaSlice<half::bf16>,
        out: &mut CudaSlice<half::bf16>,
        m: usize,
        n: usize,
        k_local: usize,
        parts: u32,
    ) -> Result<GemmRsPlan> {
        let world = (comm.world() * comm.nnodes()) as usize;
        check_len("gemm_rs", "A", a.len(), m * k_local)?;
        check_len("gemm_rs", "B", b.len(), n * k_local)?;
        check_len("gemm_rs", "out", out.len(), m / world.max(1) * n)?;
        let (pa, pb) = (a.device_ptr(stream).0, b.device_ptr(stream).0);
        let po = {
            use cudarc::driver::DevicePtrMut;
            out.device_ptr_mut(stream).0
        };
        // SAFETY: lengths checked above; the caller keeps the buffers alive (documented).
        unsafe { Self::new(comm, stream, pa, pb, po, m, n, k_local, parts) }
    }

    /// Plans the fused GEMM + ReduceScatter (collective: every local rank plans the same shape).
    ///
    /// # Safety
    /// `a`, `b`, `out` must hold the sizes above (16-byte aligned) and stay valid while the plan
    /// is launched.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        comm: &mut Communicator,
        stream: &Arc<CudaStream>,
        a: u64,
        b: u64,
        out: u64,
        m: usize,
        n: usize,
        k_local: usize,
        parts: u32,
    ) -> Result<GemmRsPlan> {
        unsafe {
            Self::build(
                comm,
                stream,
                a,
                b,
                Some(out),
                m,
                n,
                k_local,
                RsSplit {
                    parts,
                    ..RsSplit::default()
                },
            )
        }
    }

    /// [`GemmRsPlan::new`] (`out: Some`) or [`GemmRsPlan::new_all_reduce`] (`None`) with the
    /// whole split chosen ([`RsSplit`]).
    ///
    /// # Safety
    /// As [`GemmRsPlan::new`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn with_split(
        comm: &mut Communicator,
        stream: &Arc<CudaStream>,
        a: u64,
        b: u64,
        out: Option<u64>,
        m: usize,
        n: usize,
        k_local: usize,
        split: RsSplit,
    ) -> Result<GemmRsPlan> {
        unsafe { Self::build(comm, stream, a, b, out, m, n, k_local, split) }
    }

    /// Plans GEMM + AllReduce: as [`GemmRsPlan::new`], but every rank gets the whole
    /// `m` x `n` sum, in a heap buffer the plan reserves ([`GemmRsPlan::all_reduce_output`]):
    /// comm CTAs copy each reduced row tile into every local rank's output over NVLink.
    ///
    /// # Safety
    /// As [`GemmRsPlan::new`] (without `out`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new_all_reduce(
        comm: &mut Communicator,
        stream: &Arc<CudaStream>,
        a: u64,
        b: u64,
        m: usize,
        n: usize,
        k_local: usize,
        parts: u32,
    ) -> Result<GemmRsPlan> {
        unsafe {
            Self::build(
                comm,
                stream,
                a,
                b,
                None,
                m,
                n,
                k_local,
                RsSplit {
                    parts,
                    ..RsSplit::default()
                },
            )
        }
    }

    /// The AllReduce output in the heap (`None` for a ReduceScatter plan).
    pub fn all_reduce_output(&self) -> Option<SymBuffer> {
        self.ar_out
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn build(
        comm: &mut Communicator,
        stream: &Arc<CudaStream>,
        a: u64,
        b: u64,
        out: Option<u64>,
        m: usize,
        n: usize,
        k_local: usize,
        split: RsSplit,
    ) -> Result<GemmRsPlan> {
        let op = if out.is_some() { "gemm_rs" } else { "gemm_ar" };
        let (world, nodes) = (comm.world() as usize, comm.nnodes() as usize);
        let global_world = world * nodes;
        let t = GemmTile::DEFAULT;
        check_gemm_reduce(
            op,
            m,
            n,
            k_local,
            world,
            nodes as u32,
            [("A", a), ("B", b), ("out", out.unwrap_or(0))],
        )?;
        let device: Device = comm.device().clone();
        let sms = device.sm_count();
        let tune_op = if out.is_some() { "gemm-rs" } else { "gemm-ar" };
        let parts = crate::tune::split_for(
            split.parts,
            &crate::tune::TuneKey {
                op: tune_op.into(),
                world: global_world as u32,
                m,
                n,
                k: k_local * global_world,
            },
        );
        check_parts(op, m, global_world, parts)?;
        let n_comm = match split.comm_ctas {
            _ if world == 1 => 0,
            RsSplit::AUTO | RsSplit::NO_COMM_CTAS if split.pull => 0,
            n if split.pull => {
                return Err(Error::Shape {
                    op,
                    reason: format!(
                        "comm_ctas = {n} with pulled partials: pulling needs no comm CTAs (AUTO or NO_COMM_CTAS)"
                    ),
                })
            }
            RsSplit::AUTO => mkernel_config::ops::gemm_rs::rs_comm_ctas(world as u32, out.is_none()),
            RsSplit::NO_COMM_CTAS => 0,
            n => n,
        };
        // Compute CTA j < nodes sends node block j across nodes (warp 1): at least that many.
        if n_comm + (nodes as u32).max(1) > sms {
            return Err(Error::Shape {
                op,
                reason: format!(
                    "comm_ctas = {n_comm}: leaves fewer than {} compute CTAs of the {sms} SMs",
                    nodes.max(1)
                ),
            });
        }
        // Rows are node-blocked (mkernel_config::ops::gemm_rs::rs_source_row): a local rank's chunk of
        // m / world rows is `nodes` blocks of m / global_world rows, one per node's rank of
        // its rail.
        let (chunk_rows, block_rows) = ((m / world) as u64, (m / global_world) as u64);
        let (n64, k64) = (n as u64, k_local as u64);
        let slot_bytes = chunk_rows * n64 * 2;
        let block_bytes = block_rows * n64 * 2;
        let pull = split.pull && world > 1;
        // Pushed partials land here; pulled ones are read from the peers' outboxes.
        let recv = if pull {
            None
        } else {
            Some(comm.alloc(slot_bytes * world as u64)?)
        };
        // With comm CTAs or pulled: the partials for the local peers, at their own rows (the
        // comm CTAs copy them on, or the peers read them).
        let outbox = if n_comm > 0 || pull {
            Some(comm.alloc((m * n * 2) as u64)?)
        } else {
            None
        };
        let ar_out = if out.is_none() {
            Some(comm.alloc((m * n * 2) as u64)?)
        } else {
            None
        };
        // Across nodes: this node's sums of the other nodes' rows of our rail (the PUT
        // sources), and one block per node for their sums of our rows.
        let (stage, xrecv) = if nodes > 1 {
            (
                Some(comm.alloc(block_bytes * (nodes as u64 - 1))?),
                Some(comm.alloc(block_bytes * nodes as u64)?),
            )
        } else {
            (None, None)
        };
        let (rank, global_rank) = (comm.rank() as u64, comm.global_rank() as u64);
        let map_a = encode_bf16_sw128(
            Tensor2d {
                ptr: a,
                cols: k64,
                rows: m as u64,
                row_stride_bytes: 2 * k64,
            },
            t.block_k,
            t.block_m,
        )?;
        let map_b = encode_bf16_sw128(
            Tensor2d {
                ptr: b,
                cols: k64,
                rows: n64,
                row_stride_bytes: 2 * k64,
            },
            t.block_k,
            t.block_n,
        )?;
        // Tensor maps: A, B, the outbox (with comm CTAs) or this rank's slot in every local
        // rank's receive buffer (without), where the reduced chunk goes (AllReduce: into every
        // local rank's output), the stage, the first peer's slot of our receive buffer (its
        // partials, TMA-loaded by own tiles). Each is 128 bytes in one table.
        let box_map = |ptr: u64, rows: u64| {
            encode_bf16_sw128(
                Tensor2d {
                    ptr,
                    cols: n64,
                    rows,
                    row_stride_bytes: 2 * n64,
                },
                GemmTile::EPILOGUE_BOX_COLS,
                GemmTile::EPILOGUE_BOX_ROWS,
            )
        };
        // Stagers where they can run (one node of 2 ranks, pushed directly), unless declined.
        // (And where every compute CTA's work items fit the kernel's item table, which the
        // stagers read their items from: every anchor shape.)
        let tiles_all = (m.div_ceil(t.block_m as usize) * n.div_ceil(t.block_n as usize)) as u32;
        let stager = world == 2
            && nodes == 1
            && n_comm == 0
            && !pull
            && !split.no_stager
            && mkernel_config::ops::gemm_rs::stager_items_fit(tiles_all, sms - n_comm);
        // Where a stager stores (the peers' receive buffers, the outputs): its pieces' height.
        let store_rows = if stager {
            mkernel_config::ops::gemm_rs::STAGER_STORE_ROWS
        } else {
            GemmTile::EPILOGUE_BOX_ROWS
        };
        let store_map = |ptr: u64, rows: u64| {
            encode_bf16_sw128(
                Tensor2d {
                    ptr,
                    cols: n64,
                    rows,
                    row_stride_bytes: 2 * n64,
                },
                GemmTile::EPILOGUE_BOX_COLS,
                store_rows,
            )
        };
        let outs: Vec<u64> = match (out, ar_out) {
            (Some(o), _) => vec![o],
            (None, Some(ar)) => (0..world)
                .map(|p| comm.peer_ptr(p as u32, &ar) + global_rank * block_bytes)
                .collect(),
            (None, None) => unreachable!("an AllReduce plan reserves its output"),
        };
        let mut maps_host = vec![map_a.opaque, map_b.opaque];
        let mut push = |map: [u64; 16]| {
            maps_host.push(map);
            maps_host.len() - 1
        };
        let outbox_map = match outbox {
            Some(o) => Some(push(box_map(comm.ptr(&o), m as u64)?.opaque)),
            None => None,
        };
        let mut recv_maps = vec![];
        if let (None, Some(recv)) = (outbox, recv) {
            for p in 0..world {
                recv_maps.push(push(
                    store_map(comm.peer_ptr(p as u32, &recv) + rank * slot_bytes, chunk_rows)?.opaque,
                ));
            }
        }
        let mut out_maps = vec![];
        for &o in &outs {
            out_maps.push(push(store_map(o, block_rows)?.opaque));
        }
        let stage_map = match stage {
            Some(st) => Some(push(box_map(comm.ptr(&st), block_rows * (nodes as u64 - 1))?.opaque)),
            None => None,
        };
        let first_peer = (rank + 1) % world as u64;
        let in_map = match (recv, outbox) {
            _ if world == 1 => None,
            // Pushed: the whole receive buffer (every peer's slot; own tiles TMA-load each
            // peer's partial in turn).
            (Some(recv), _) => Some(push(box_map(comm.ptr(&recv), chunk_rows * world as u64)?.opaque)),
            // Pulled: the first peer's outbox (all `m` rows) as mapped here.
            (None, Some(o)) => Some(push(box_map(comm.peer_ptr(first_peer as u32, &o), m as u64)?.opaque)),
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
        let args = GemmRsArgs {
            desc: comm.desc_ptr(),
            map_a: map_at(Some(0)),
            map_b: map_at(Some(1)),
            map_outbox: map_at(outbox_map),
            map_recv,
            map_out,
            map_stage: map_at(stage_map),
            map_in: map_at(in_map),
            recv_off: recv.map_or(0, |b| b.offset),
            outbox_off: outbox.map_or(0, |b| b.offset),
            stage_off: stage.map_or(0, |b| b.offset),
            xrecv_off: xrecv.map_or(0, |b| b.offset),
            out_off: ar_out.map_or(0, |b| b.offset),
            m: m as u32,
            n: n as u32,
            k: k_local as u32,
            part_tiles_m: (block_rows as usize / t.block_m as usize / parts as usize) as u32,
            all_reduce: ar_out.is_some() as u32,
            n_comm,
            group_m: if split.group_m == 0 {
                t.group_m
            } else {
                split
                    .group_m
                    .min((block_rows as usize / t.block_m as usize / parts as usize) as u32)
            },
            pull: pull as u32,
            trace: 0,
            stager: stager as u32,
            sk_tiles: 0,
            sk_ws: 0,
        };
        // The stream-K tail (with the stagers only): the last partial round of tiles cut into
        // equal K ranges, one per compute CTA; contributors' f32 partials go through `sk_ws`.
        let mut args = args;
        let tiles = (m.div_ceil(t.block_m as usize) * n.div_ceil(t.block_n as usize)) as u32;
        let compute_ctas = sms - n_comm;
        let sk_tiles = if args.stager != 0 && !split.no_stream_k {
            StreamK::choose(tiles, compute_ctas, k_local.div_ceil(t.block_k as usize) as u32)
        } else {
            0
        };
        let sk_ws = if sk_tiles > 0 {
            let slots = compute_ctas as usize * t.consumer_warpgroups as usize;
            Some(stream.alloc_zeros::<u8>(slots * SK_SLOT_BYTES as usize)?)
        } else {
            None
        };
        if let Some(ws) = &sk_ws {
            args.sk_tiles = sk_tiles;
            args.sk_ws = ws.device_ptr(stream).0;
        }
        // SAFETY: GemmRsArgs is repr(C) plain data.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                &args as *const GemmRsArgs as *const u8,
                std::mem::size_of::<GemmRsArgs>(),
            )
        };
        let args_dev = stream.clone_htod(bytes)?;
        let args_addr = args_dev.device_ptr(stream).0;
        Ok(GemmRsPlan {
            func: device.function(&kernels::GEMM_RS_NK)?,
            _maps: maps,
            _args: args_dev,
            _sk_ws: sk_ws,
            args_addr,
            desc_addr: args.desc,
            grid: sms,
            parts,
            n_comm,
            ar_out,
            stager: args.stager != 0,
            sk_tiles: args.sk_tiles,
        })
    }

    /// Enqueues the fused kernel.
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let mut b = stream.launch_builder(&self.func);
        b.arg(&self.args_addr);
        b.arg(&self.desc_addr);
        // SAFETY: mk_gemm_rs_bf16_nk(args, desc); buffers outlive launches (new's contract).
        unsafe { b.launch(Device::launch_config(&kernels::GEMM_RS_NK, self.grid)) }?;
        Ok(())
    }
    /// Parts per row chunk, and CTAs in total.
    pub fn split(&self) -> (u32, u32) {
        (self.parts, self.grid)
    }
    /// Whether stager threads issue the consumers' epilogue I/O ([`RsSplit::no_stager`]).
    pub fn stager(&self) -> bool {
        self.stager
    }
    /// Comm CTAs (of [`GemmRsPlan::split`]'s total).
    pub fn comm_ctas(&self) -> u32 {
        self.n_comm
    }
    /// Tiles computed stream-K at the end of the launch (0: none; [`RsSplit::no_stream_k`]).
    pub fn stream_k_tiles(&self) -> u32 {
        self.sk_tiles
    }

    /// Diagnostic: the launches enqueued from now on record their per-tile timeline into the
    /// device buffer at `buf` (`mkernel_config::trace::words(grid)` u64 words; layout in
    /// [`mkernel_config::trace`]), or, with `None`, stop recording.
    ///
    /// # Safety
    /// `buf` must stay allocated, with at least that many words, while such launches run.
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

/// AllGather+GEMM's shape rules (`world`: every rank of every node), before anything is
/// allocated: `m` a multiple of `world x 128` with at most `MAX_COMM_CTAS` chunks per shard,
/// `k` and `n` multiples of 8 (16-byte TMA rows), 16-byte aligned pointers.
fn check_ag_gemm(m: usize, n: usize, k: usize, world: usize, ptrs: [(&'static str, u64); 3]) -> Result<()> {
    let block_m = GemmTile::DEFAULT.block_m as usize;
    let bad = |reason: String| Err(Error::Shape { op: OP, reason });
    if m == 0 || m % (world * block_m) != 0 {
        return bad(format!(
            "m = {m} must be a positive multiple of world x {block_m} = {}",
            world * block_m
        ));
    }
    if k == 0 || k % 8 != 0 || n == 0 || n % 8 != 0 {
        return bad(format!(
            "k = {k} and n = {n} must be positive multiples of 8 (16-byte TMA rows)"
        ));
    }
    let chunks = m / world / block_m;
    if chunks > mkernel_config::comm::MAX_COMM_CTAS as usize {
        return bad(format!(
            "{chunks} chunks of {block_m} rows per shard; at most {} (flags per chunk)",
            mkernel_config::comm::MAX_COMM_CTAS
        ));
    }
    check_aligned(OP, ptrs)
}

/// `n_comm` comm CTAs leave at least one compute CTA on a GPU of `sms` SMs.
fn check_n_comm(n_comm: u32, sms: u32) -> Result<()> {
    if n_comm == 0 || n_comm + 1 >= sms {
        return Err(Error::Shape {
            op: OP,
            reason: format!("n_comm = {n_comm}: between 1 and {} (the GPU has {sms} SMs)", sms - 2),
        });
    }
    Ok(())
}

/// GEMM+ReduceScatter/AllReduce's shape rules (`world` ranks per node, `nnodes` nodes): `m` a
/// multiple of `world x nnodes x 128` with at most `MAX_COMM_CTAS` row tiles per local rank's
/// chunk (`m / world`: one flag per row tile); `k_local`, `n` multiples of 8; aligned pointers.
fn check_gemm_reduce(
    op: &'static str,
    m: usize,
    n: usize,
    k_local: usize,
    world: usize,
    nnodes: u32,
    ptrs: [(&'static str, u64); 3],
) -> Result<()> {
    let block_m = GemmTile::DEFAULT.block_m as usize;
    let bad = |reason: String| Err(Error::Shape { op, reason });
    let global_world = world * nnodes as usize;
    if m == 0 || m % (global_world * block_m) != 0 {
        return bad(format!(
            "m = {m} must be a positive multiple of world x nodes x {block_m} = {}",
            global_world * block_m
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
    check_aligned(op, ptrs)
}

/// `parts` divides the row tiles of a rank's chunk (`world`: every rank of every node).
fn check_parts(op: &'static str, m: usize, world: usize, parts: u32) -> Result<()> {
    let block_m = GemmTile::DEFAULT.block_m as usize;
    let row_tiles = m / world / block_m;
    if parts == 0 || row_tiles % parts as usize != 0 {
        return Err(Error::Shape {
            op,
            reason: format!(
                "parts = {parts} must divide the {row_tiles} row tiles of a rank's chunk (m / world / {block_m})"
            ),
        });
    }
    Ok(())
}

fn check_aligned(op: &'static str, ptrs: [(&'static str, u64); 3]) -> Result<()> {
    for (what, ptr) in ptrs {
        if ptr % 16 != 0 {
            return Err(Error::Alignment {
                op,
                what,
                ptr,
                align: 16,
            });
        }
    }
    Ok(())
}

fn check_len(op: &'static str, what: &'static str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(Error::BufferTooSmall { op, what, have, need });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK_PTRS: [(&str, u64); 3] = [("A", 256), ("B", 512), ("C", 1024)];

    fn reason(r: Result<()>) -> String {
        match r {
            Err(Error::Shape { reason, .. }) => reason,
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn ag_gemm_shapes_are_checked_before_planning() {
        assert!(check_ag_gemm(4096, 8192, 8192, 4, OK_PTRS).is_ok());
        assert!(reason(check_ag_gemm(4096 + 128, 8192, 8192, 4, OK_PTRS)).contains("multiple of world x 128 = 512"));
        assert!(reason(check_ag_gemm(0, 8192, 8192, 2, OK_PTRS)).contains("positive multiple"));
        assert!(reason(check_ag_gemm(4096, 8192, 100, 2, OK_PTRS)).contains("multiples of 8"));
        assert!(reason(check_ag_gemm(2 * 128 * 257, 256, 256, 2, OK_PTRS)).contains("257 chunks"));
        let misaligned = [("A shard", 256), ("B", 520), ("C", 1024)];
        assert!(matches!(
            check_ag_gemm(4096, 8192, 8192, 2, misaligned),
            Err(Error::Alignment {
                what: "B",
                ptr: 520,
                ..
            })
        ));
        assert!(check_n_comm(8, 132).is_ok());
        assert!(reason(check_n_comm(0, 132)).contains("between 1 and 130"));
        assert!(reason(check_n_comm(131, 132)).contains("between 1 and 130"));
    }

    #[test]
    fn gemm_reduce_shapes_and_parts_are_checked_before_planning() {
        assert!(check_gemm_reduce("gemm_rs", 16384, 8192, 2048, 4, 1, OK_PTRS).is_ok());
        assert!(check_gemm_reduce("gemm_ar", 16384, 8192, 2048, 2, 2, OK_PTRS).is_ok());
        assert!(reason(check_gemm_reduce("gemm_rs", 1000, 8192, 2048, 2, 1, OK_PTRS))
            .contains("multiple of world x nodes x 128 = 256"));
        assert!(reason(check_gemm_reduce("gemm_rs", 256 * 3, 8192, 2048, 2, 2, OK_PTRS))
            .contains("multiple of world x nodes x 128 = 512"));
        assert!(reason(check_gemm_reduce("gemm_rs", 4096, 8190, 2048, 2, 1, OK_PTRS)).contains("multiples of 8"));
        assert!(
            reason(check_gemm_reduce("gemm_rs", 2 * 128 * 300, 256, 256, 2, 1, OK_PTRS))
                .contains("more than 256 row tiles")
        );
        // 16384 rows over 4 ranks: 32 row tiles per chunk.
        for ok in [1, 2, 4, 8, 16, 32] {
            assert!(check_parts("gemm_rs", 16384, 4, ok).is_ok(), "parts {ok}");
        }
        assert!(reason(check_parts("gemm_rs", 16384, 4, 3)).contains("parts = 3 must divide the 32 row tiles"));
        assert!(reason(check_parts("gemm_rs", 16384, 4, 0)).contains("parts = 0"));
    }
}
