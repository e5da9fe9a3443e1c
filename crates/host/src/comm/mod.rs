//! Intra-node communication: the symmetric heap, the communicator and its collectives.
//!
//! ```text
//! Bootstrap (ranks, keyed TCP store, fd passing)  ->  SymmetricHeap (cuMem VMM, peer mappings)
//!   -> Communicator (CommDesc on the device, epochs, error record)
//!   -> all_gather / reduce_scatter / all_reduce  (mk_* kernels, NVLink loads and stores)
//! ```
//! Buffers that peers read or write live in the heap ([`SymBuffer`], same offset on every rank).
//! Every launch advances per-CTA epochs on the device, so calls need no reset and can be
//! captured in CUDA graphs. Every device-side wait has a timeout; [`Communicator::check`] turns
//! the device error record into [`Error::CommTimeout`] naming the rank, role and flag that stalled.
pub mod heap;
pub mod internode;
#[cfg(feature = "rdma")]
mod rdma;
mod residency;

use crate::error::{Error, Result};
use crate::runtime::Device;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use heap::SymmetricHeap;
use internode::{InterNode, FIFO_CAPACITY};
use mkernel_bootstrap::Bootstrap;
use mkernel_config::comm::{
    CommDesc, ErrorRecord, FlagSlot, Role, ABORT_OFFSET, ERROR_RECORD_OFFSET, HEAP_RESERVED_BYTES, HEAP_ZEROED_BYTES,
    MAX_COMM_CTAS, MAX_LOCAL_RANKS, STAGED_CTAS,
};
use mkernel_config::{kernels, KernelSpec};
use std::sync::Arc;
use std::time::Duration;

/// Element type of a reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceDtype {
    Bf16,
    F32,
}

impl ReduceDtype {
    pub fn size(self) -> u64 {
        match self {
            ReduceDtype::Bf16 => 2,
            ReduceDtype::F32 => 4,
        }
    }
    fn code(self) -> u32 {
        match self {
            ReduceDtype::Bf16 => 0,
            ReduceDtype::F32 => 1,
        }
    }
}

/// A region of the symmetric heap: the same offset and size on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SymBuffer {
    pub offset: u64,
    pub bytes: u64,
}

/// Settings of a communicator.
#[derive(Clone, Copy, Debug)]
pub struct CommConfig {
    /// Bytes of heap data per rank (the control area is added).
    pub heap_bytes: u64,
    /// Timeout of every device-side wait.
    pub timeout: Duration,
    /// Timeout of host-side bootstrap steps.
    pub bootstrap_timeout: Duration,
    /// Jobs of several nodes: heap bytes reserved for inter-node staging (split into a
    /// source stage, a node-sum buffer and one receive slot per node).
    pub internode_scratch_bytes: u64,
    /// Jobs of several nodes: the inter-node backend; `None` reads `MKERNEL_TRANSPORT` or
    /// detects one (docs/internode.md, "Which backend").
    pub transport: Option<mkernel_proxy::backend::BackendKind>,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            heap_bytes: 256 << 20,
            timeout: Duration::from_secs(10),
            bootstrap_timeout: Duration::from_secs(60),
            internode_scratch_bytes: 256 << 20,
            transport: None,
        }
    }
}

/// Heap buffers of the inter-node path.
struct Wire {
    node: InterNode,
    nnodes: u32,
    /// Largest per-rank message of an inter-node collective.
    max_bytes: u64,
    stage: SymBuffer,
    node_sum: SymBuffer,
    recv: SymBuffer,
}

/// The NVLink communicator of one rank: its heap, its peers' heaps, its device descriptor.
pub struct Communicator {
    /// Inter-node transport (jobs of several nodes); dropped (proxy stopped) before the heap.
    wire: Option<Wire>,
    device: Device,
    boot: Bootstrap,
    heap: SymmetricHeap,
    /// The device copy of this rank's `CommDesc` (kept alive; kernels read it by address).
    _desc: CudaSlice<u8>,
    /// `desc`'s device address, cached: taking it through cudarc per launch records an event.
    desc_addr: u64,
    rank: u32,
    world: u32,
    next_free: u64,
}

impl Communicator {
    /// Builds the communicator among this node's local ranks (collective: every local rank
    /// calls it). `device` must be the GPU of this rank.
    pub fn new(device: &Device, mut boot: Bootstrap, cfg: CommConfig) -> Result<Communicator> {
        let info = boot.info().clone();
        let (rank, world) = (info.local_rank() as u32, info.local_world_size() as u32);
        if world > MAX_LOCAL_RANKS {
            return Err(Error::Shape {
                op: "communicator",
                reason: format!("{world} local ranks; at most {MAX_LOCAL_RANKS} are supported"),
            });
        }
        device.context().bind_to_thread()?;
        // Before any kernel can wait for a peer: ranks sharing a GPU must fit on it together.
        residency::check(device, &boot, cfg.bootstrap_timeout)?;
        let nnodes = info.nnodes() as u32;
        let wire_bytes = if nnodes > 1 { cfg.internode_scratch_bytes } else { 0 };
        let heap = SymmetricHeap::new(
            device.ordinal() as i32,
            HEAP_RESERVED_BYTES + cfg.heap_bytes + wire_bytes,
            &mut boot,
            cfg.bootstrap_timeout,
        )?;
        let stream = device.default_stream();
        // Zero the control and LL areas (flags, epochs, error record, LL words) before anyone signals into them.
        let zeros = vec![0u8; HEAP_ZEROED_BYTES as usize];
        // SAFETY: the first HEAP_ZEROED_BYTES of our heap are ours and mapped.
        unsafe { cudarc::driver::result::memcpy_htod_sync(heap.local_base(), &zeros)? };
        let node = if nnodes > 1 {
            Some(InterNode::new(
                device.context(),
                &boot,
                heap.own_fd(),
                heap.local_base(),
                heap.bytes(),
                cfg.transport,
                cfg.bootstrap_timeout,
            )?)
        } else {
            None
        };
        let mut d = CommDesc {
            rank,
            world,
            timeout_ns: cfg.timeout.as_nanos() as u64,
            heaps: [0; MAX_LOCAL_RANKS as usize],
            global_rank: info.rank() as u32,
            global_world: info.world_size() as u32,
            fifo: node.as_ref().map_or(0, |n| n.fifo_device_ptr()),
            fifo_capacity: FIFO_CAPACITY,
            _pad: 0,
        };
        for r in 0..world as usize {
            d.heaps[r] = heap.base(r);
        }
        // SAFETY: CommDesc is repr(C) plain data.
        let bytes =
            unsafe { std::slice::from_raw_parts(&d as *const CommDesc as *const u8, std::mem::size_of::<CommDesc>()) };
        let desc = stream.clone_htod(bytes)?;
        stream.synchronize()?;
        // Nobody may signal into a heap before its owner zeroed it.
        boot.store()
            .barrier("mkernel/communicator/zeroed", cfg.bootstrap_timeout)?;
        let desc_addr = desc.device_ptr(&stream).0;
        let mut comm = Communicator {
            wire: None,
            device: device.clone(),
            boot,
            heap,
            _desc: desc,
            desc_addr,
            rank,
            world,
            next_free: HEAP_RESERVED_BYTES,
        };
        if let Some(node) = node {
            let max_bytes = wire_bytes / (nnodes as u64 + 2) / 256 * 256;
            let stage = comm.alloc(max_bytes)?;
            let node_sum = comm.alloc(max_bytes)?;
            let recv = comm.alloc(max_bytes * nnodes as u64)?;
            comm.wire = Some(Wire {
                node,
                nnodes,
                max_bytes,
                stage,
                node_sum,
                recv,
            });
        }
        Ok(comm)
    }

    /// This rank among the local ranks.
    pub fn rank(&self) -> u32 {
        self.rank
    }
    /// Local ranks.
    pub fn world(&self) -> u32 {
        self.world
    }
    /// Nodes of the job (1 unless launched across nodes).
    pub fn nnodes(&self) -> u32 {
        self.wire.as_ref().map_or(1, |w| w.nnodes)
    }
    /// The inter-node backend and why it was chosen (`None` on one node).
    pub fn transport(&self) -> Option<&mkernel_proxy::backend::BackendChoice> {
        self.wire.as_ref().map(|w| w.node.transport())
    }
    /// This rank in the whole job.
    pub fn global_rank(&self) -> u32 {
        self.boot.info().rank() as u32
    }
    /// The bootstrap (store) this communicator was built on.
    pub fn bootstrap(&self) -> &Bootstrap {
        &self.boot
    }
    /// The GPU.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Reserves `bytes` (rounded to 256) of the heap on every rank. Collective in the sense
    /// that every rank must make the same sequence of calls (offsets are computed locally).
    pub fn alloc(&mut self, bytes: u64) -> Result<SymBuffer> {
        let bytes = bytes.div_ceil(256) * 256;
        if self.next_free + bytes > self.heap.bytes() {
            return Err(Error::Shape {
                op: "symmetric heap",
                reason: format!(
                    "{bytes} more bytes do not fit ({} of {} used)",
                    self.next_free,
                    self.heap.bytes()
                ),
            });
        }
        let b = SymBuffer {
            offset: self.next_free,
            bytes,
        };
        self.next_free += bytes;
        Ok(b)
    }
    /// This rank's device address of `b`.
    pub fn ptr(&self, b: &SymBuffer) -> u64 {
        self.heap.local_base() + b.offset
    }
    /// Local rank `r`'s buffer `b` as mapped in this process (NVLink).
    pub fn peer_ptr(&self, r: u32, b: &SymBuffer) -> u64 {
        self.heap.base(r as usize) + b.offset
    }
    /// Device address of the descriptor the kernels read.
    pub fn desc_ptr(&self) -> u64 {
        self.desc_addr
    }

    /// The kernel and its launch over `ctas` CTAs, raised to `STAGED_CTAS` (the LL and staged
    /// paths need CTAs `0..STAGED_CTAS` in every launch to keep their epochs in lockstep).
    fn prepare(&self, spec: &'static KernelSpec, ctas: u32) -> Result<(CudaFunction, LaunchConfig)> {
        if ctas == 0 || ctas >= MAX_COMM_CTAS {
            return Err(Error::Shape {
                op: spec.name,
                reason: format!("{ctas} CTAs; 1..{MAX_COMM_CTAS} allowed"),
            });
        }
        Ok((
            self.device.function(spec)?,
            Device::launch_config(spec, ctas.max(STAGED_CTAS)),
        ))
    }

    /// AllGather of `bytes` per rank: `src` (any local device address) goes to
    /// `dst[rank * bytes ..]` on every rank. `bytes` must be a multiple of 16.
    pub fn all_gather(&self, stream: &Arc<CudaStream>, src: u64, dst: &SymBuffer, bytes: u64, ctas: u32) -> Result<()> {
        let op = "all_gather";
        check_multiple(op, "bytes per rank", bytes, 16)?;
        check_aligned(op, "src", src)?;
        if let Some(w) = &self.wire {
            check_fits(op, dst, bytes * (self.world * w.nnodes) as u64)?;
            if bytes > w.max_bytes {
                return Err(Error::Shape { op, reason: format!("{bytes} bytes per rank exceed the inter-node stage of {} (CommConfig::internode_scratch_bytes)", w.max_bytes) });
            }
            // The proxy reads the source from the heap: stage it there.
            // SAFETY: both ranges are device memory of at least `bytes`.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(self.ptr(&w.stage), src, bytes as usize, stream.cu_stream())?
            };
            let (desc, src_off, dst_off) = (self.desc_ptr(), w.stage.offset, dst.offset);
            let (f, cfg) = self.prepare(&kernels::ALLGATHER_INTERNODE, ctas)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&desc).arg(&src_off).arg(&dst_off).arg(&bytes);
            // SAFETY: mk_allgather_internode(desc, src_off, dst_off, bytes).
            unsafe { b.launch(cfg) }?;
            return Ok(());
        }
        check_fits(op, dst, bytes * self.world as u64)?;
        let (desc, dst_off) = (self.desc_ptr(), dst.offset);
        let (f, cfg) = self.prepare(&kernels::ALLGATHER, ctas)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&desc).arg(&src).arg(&dst_off).arg(&bytes);
        // SAFETY: mk_allgather(desc, src, dst_off, bytes).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// ReduceScatter: `dst` (local, `count` elements) = sum over ranks of elements
    /// `[rank * count, (rank + 1) * count)` of `src`. `count * size` must be a multiple of 16.
    pub fn reduce_scatter(
        &self,
        stream: &Arc<CudaStream>,
        src: &SymBuffer,
        dst: u64,
        count: u64,
        dtype: ReduceDtype,
        ctas: u32,
    ) -> Result<()> {
        let op = "reduce_scatter";
        if self.wire.is_some() {
            return Err(Error::Unsupported(
                "reduce_scatter across nodes is not implemented yet (all_gather and all_reduce are)".into(),
            ));
        }
        check_multiple(op, "bytes per rank", count * dtype.size(), 16)?;
        check_fits(op, src, count * dtype.size() * self.world as u64)?;
        check_aligned(op, "dst", dst)?;
        let (desc, src_off, code) = (self.desc_ptr(), src.offset, dtype.code());
        let (f, cfg) = self.prepare(&kernels::REDUCE_SCATTER, ctas)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&desc).arg(&src_off).arg(&dst).arg(&count).arg(&code);
        // SAFETY: mk_reduce_scatter(desc, src_off, dst, count, dtype).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// AllReduce of `count` elements from `src` into `dst` (both in the heap; may be the same
    /// buffer). `count * size` must be a multiple of 16.
    pub fn all_reduce(
        &self,
        stream: &Arc<CudaStream>,
        src: &SymBuffer,
        dst: &SymBuffer,
        count: u64,
        dtype: ReduceDtype,
        ctas: u32,
    ) -> Result<()> {
        let op = "all_reduce";
        check_multiple(op, "bytes", count * dtype.size(), 16)?;
        check_fits(op, src, count * dtype.size())?;
        check_fits(op, dst, count * dtype.size())?;
        if let Some(w) = &self.wire {
            let bytes = count * dtype.size();
            if bytes > w.max_bytes {
                return Err(Error::Shape {
                    op,
                    reason: format!(
                        "{bytes} bytes exceed the inter-node stage of {} (CommConfig::internode_scratch_bytes)",
                        w.max_bytes
                    ),
                });
            }
            // 1. Sum inside the node (NVLink) into the node-sum buffer; 2. exchange node sums
            //    with the rail peers through the proxy and add them up in node order.
            let (desc, code) = (self.desc_ptr(), dtype.code());
            let (src_off, sum_off, recv_off, dst_off) = (src.offset, w.node_sum.offset, w.recv.offset, dst.offset);
            let (f, cfg) = self.prepare(&kernels::ALLREDUCE, ctas)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&desc).arg(&src_off).arg(&sum_off).arg(&count).arg(&code);
            // SAFETY: mk_allreduce(desc, src_off, dst_off, count, dtype).
            unsafe { b.launch(cfg) }?;
            let (f, cfg) = self.prepare(&kernels::ALLREDUCE_INTERNODE, ctas)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&desc)
                .arg(&sum_off)
                .arg(&recv_off)
                .arg(&dst_off)
                .arg(&count)
                .arg(&code);
            // SAFETY: mk_allreduce_internode(desc, src_off, scratch_off, dst_off, count, dtype).
            unsafe { b.launch(cfg) }?;
            return Ok(());
        }
        let (desc, src_off, dst_off, code) = (self.desc_ptr(), src.offset, dst.offset, dtype.code());
        let (f, cfg) = self.prepare(&kernels::ALLREDUCE, ctas)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&desc).arg(&src_off).arg(&dst_off).arg(&count).arg(&code);
        // SAFETY: mk_allreduce(desc, src_off, dst_off, count, dtype).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Round trips of `iters` put-and-answer probes of `bytes` between this rank and `peer` (a
    /// rank on another node) over the proxy, in nanoseconds, measured on the GPU from before the
    /// post to the arrival of the answer's flag. Both ranks call it (`initiator` on exactly one).
    pub fn proxy_pingpong(
        &self,
        stream: &Arc<CudaStream>,
        peer: u32,
        bytes: u64,
        iters: u32,
        initiator: bool,
    ) -> Result<Vec<u64>> {
        let op = "proxy_pingpong";
        let w = self
            .wire
            .as_ref()
            .ok_or_else(|| Error::Unsupported("proxy probes need a job of several nodes".into()))?;
        if bytes > w.max_bytes || iters == 0 || iters >= 4096 {
            return Err(Error::Shape {
                op,
                reason: format!("bytes {bytes} (max {}), iters {iters} (1..4096)", w.max_bytes),
            });
        }
        let out = stream.alloc_zeros::<u64>(iters as usize)?;
        let out_ptr = out.device_ptr(stream).0;
        let (desc, src_off, dst_off, init) = (self.desc_ptr(), w.stage.offset, w.recv.offset, initiator as u32);
        let f = self.device.function(&kernels::PROXY_PINGPONG)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&desc)
            .arg(&peer)
            .arg(&src_off)
            .arg(&dst_off)
            .arg(&bytes)
            .arg(&iters)
            .arg(&init)
            .arg(&out_ptr);
        // SAFETY: mk_proxy_pingpong(desc, peer, src_off, dst_off, bytes, iters, initiator, out).
        unsafe { b.launch(Device::launch_config(&kernels::PROXY_PINGPONG, 1)) }?;
        stream.synchronize()?;
        self.check()?;
        Ok(stream.clone_dtoh(&out)?)
    }

    /// Reads the device error record (after the stream's work finished). A timeout becomes
    /// [`Error::CommTimeout`] naming the rank that stalled and the peer it waited for.
    pub fn check(&self) -> Result<()> {
        if let Some(w) = &self.wire {
            w.node.check()?;
        }
        let mut rec = ErrorRecord::default();
        // SAFETY: reads the record from this rank's own heap into a repr(C) struct.
        unsafe {
            let bytes = std::slice::from_raw_parts_mut(
                &mut rec as *mut ErrorRecord as *mut u8,
                std::mem::size_of::<ErrorRecord>(),
            );
            cudarc::driver::result::memcpy_dtoh_sync(bytes, self.heap.local_base() + ERROR_RECORD_OFFSET)?;
        }
        if rec.code == 0 {
            return Ok(());
        }
        Err(Error::CommTimeout {
            rank: rec.rank,
            role: Role::name(rec.role),
            flag: wait_name(rec.slot),
            peer: rec.peer,
            cta: rec.cta,
            expected: rec.expected,
            seen: rec.seen,
            waited_ms: rec.waited_ns / 1_000_000,
        })
    }

    /// Raises this rank's abort word: every wait of the rank gives up at once.
    pub fn abort(&self) -> Result<()> {
        // SAFETY: writes the abort word of this rank's own heap.
        unsafe {
            cudarc::driver::result::memcpy_htod_sync(self.heap.local_base() + ABORT_OFFSET, &1u32.to_ne_bytes())?
        };
        Ok(())
    }
}

/// What the error record's `slot` says was awaited (`mkernel_config::comm::wait_code`).
fn wait_name(code: u32) -> String {
    use mkernel_config::comm::wait_code as w;
    match code {
        w::REMOTE_READY => "inter-node Ready flag (epoch)".into(),
        w::REMOTE_DATA => "inter-node Data flag (epoch)".into(),
        w::FIFO_SPACE => "proxy FIFO space".into(),
        w::FIFO_DONE => "proxy completion (done)".into(),
        c => match FlagSlot::from_u32(c) {
            // Counters count tiles; every other slot holds epochs.
            Some(s @ (FlagSlot::Tile1 | FlagSlot::Tile2 | FlagSlot::NodeSum | FlagSlot::Outbox)) => {
                format!("{s:?} tile counter")
            }
            // Ring attention's flags hold step values (e - 1) W + t + 1.
            Some(s @ (FlagSlot::RingData | FlagSlot::RingFree)) => format!("{s:?} flag (ring step)"),
            Some(s) => format!("{s:?} flag (epoch)"),
            None => format!("wait code {c}"),
        },
    }
}

fn check_multiple(op: &'static str, what: &str, v: u64, m: u64) -> Result<()> {
    if v == 0 || v % m != 0 {
        return Err(Error::Shape {
            op,
            reason: format!("{what} = {v} must be a positive multiple of {m}"),
        });
    }
    Ok(())
}
fn check_fits(op: &'static str, b: &SymBuffer, need: u64) -> Result<()> {
    if need > b.bytes {
        return Err(Error::Shape {
            op,
            reason: format!(
                "heap buffer of {} bytes is smaller than the {need} bytes needed",
                b.bytes
            ),
        });
    }
    Ok(())
}
fn check_aligned(op: &'static str, what: &'static str, ptr: u64) -> Result<()> {
    if ptr % 16 != 0 {
        return Err(Error::Alignment {
            op,
            what,
            ptr,
            align: 16,
        });
    }
    Ok(())
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Peers may still be writing into our heap: wait until every local rank is done
        // before the mappings go away (best effort; errors are already reported elsewhere).
        let _ = self.device.context().synchronize();
        let _ = self
            .boot
            .store()
            .barrier("mkernel/communicator/drop", Duration::from_secs(30));
    }
}
