//! Intra-node communication: the symmetric heap, the communicator and its collectives.
//!
//! ```text
//! Bootstrap (ranks, keyed TCP store, fd passing)  ->  SymmetricHeap (cuMem VMM, peer mappings)
//!   -> Communicator (CommDesc on the device, epochs, error record)
//!   -> all_gather / reduce_scatter / all_reduce  (mk_* kernels, NVLink loads and stores;
//!      all_reduce's paths and their policy: [`allreduce`])
//! ```
//! Buffers that peers read or write live in the heap ([`SymBuffer`], same offset on every rank).
//! Every launch advances per-CTA epochs on the device, so calls need no reset and can be
//! captured in CUDA graphs. Every device-side wait has a timeout; [`Communicator::check`] turns
//! the device error record into [`Error::CommTimeout`] naming the rank, role and flag that stalled.
//!
//! # Soundness
//! - [`SymBuffer`]s are made only by [`Communicator::alloc`] and every use checks them against
//!   the heap's data region `[HEAP_RESERVED_BYTES, heap bytes)`: the control area (flags,
//!   epochs, error record, abort word) cannot be named.
//! - Collectives over local buffers take cudarc slices or views ([`Communicator::all_gather`],
//!   [`Communicator::reduce_scatter`]); the raw-address forms are `unsafe`.
//! - Launches on one communicator are serialized by an internal lock (see
//!   [`Communicator`]'s "Launch order") and ordered on the device across streams.
//! - Streams and buffers of another CUDA context are refused ([`Error::ForeignContext`]).
pub mod abort;
pub mod agree;
pub mod allreduce;
mod arena;
pub mod diag;
pub mod heap;
mod host_word;
pub mod internode;
#[cfg(feature = "rdma")]
mod rdma;
mod residency;

use crate::check;
use crate::error::{Error, Result};
use crate::runtime::Device;
pub use abort::AbortHandle;
use agree::{Agreed, PlanDesc};
pub use allreduce::{AllReduceMsg, AllReducePath, AllReducePolicy, Overlap};
use arena::HeapAllocator;
use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use heap::SymmetricHeap;
use internode::{InterNode, FIFO_CAPACITY};
use mkernel_bootstrap::Bootstrap;
use mkernel_config::comm::{
    CommDesc, FlagSlot, HEAP_RESERVED_BYTES, HEAP_ZEROED_BYTES, MAX_COMM_CTAS, MAX_LOCAL_RANKS, STAGED_CTAS,
};
use mkernel_config::{kernels, KernelSpec};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
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

/// Element types the reductions take: `half::bf16` and `f32`. Sealed: `DTYPE` decides how many
/// bytes per element the kernels write, so it must match the type's size:
/// ```compile_fail,E0277
/// #[derive(Clone, Copy)]
/// struct Byte(u8);
/// // SAFETY: plain data.
/// unsafe impl mkernel::cudarc::driver::DeviceRepr for Byte {}
/// impl mkernel::ReduceElem for Byte {
///     const DTYPE: mkernel::ReduceDtype = mkernel::ReduceDtype::F32;
/// }
/// ```
pub trait ReduceElem: DeviceRepr + sealed::Sealed {
    /// The kernels' element selector.
    const DTYPE: ReduceDtype;
}
impl ReduceElem for half::bf16 {
    const DTYPE: ReduceDtype = ReduceDtype::Bf16;
}
impl ReduceElem for f32 {
    const DTYPE: ReduceDtype = ReduceDtype::F32;
}

pub(crate) mod sealed {
    /// Implemented by the element types whose size the kernels know (bf16, f32).
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// A region of the symmetric heap: the same offset and size on every rank.
///
/// Only [`Communicator::alloc`] makes one (the fields are private), and every operation that
/// takes one checks it against the data region of the communicator it is given to
/// ([`Error::OutOfRange`] otherwise), so safe code cannot name the control area or memory past
/// the heap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SymBuffer {
    offset: u64,
    bytes: u64,
}

impl SymBuffer {
    /// Byte offset from the start of every rank's heap.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Size in bytes (a multiple of 256).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// `b` lies in the data region `[HEAP_RESERVED_BYTES, heap_bytes)` of a heap of `heap_bytes`.
fn check_region(op: &'static str, b: &SymBuffer, heap_bytes: u64) -> Result<()> {
    let inside = b.offset >= HEAP_RESERVED_BYTES && b.offset.checked_add(b.bytes).is_some_and(|end| end <= heap_bytes);
    if !inside {
        return Err(Error::OutOfRange {
            op,
            reason: format!(
                "heap buffer at offset {} of {} bytes is outside the data region [{HEAP_RESERVED_BYTES}, {heap_bytes})",
                b.offset, b.bytes
            ),
        });
    }
    Ok(())
}

/// Settings of a communicator.
#[derive(Clone, Copy, Debug)]
pub struct CommConfig {
    /// Bytes of heap data per rank (the control area is added).
    pub heap_bytes: u64,
    /// Timeout of every device-side wait (nanoseconds on the device, saturating at `u64::MAX`).
    pub timeout: Duration,
    /// Timeout of host-side bootstrap steps.
    pub bootstrap_timeout: Duration,
    /// Jobs of several nodes: heap bytes reserved for inter-node staging (split into a
    /// source stage, a node-sum buffer and one receive slot per node).
    pub internode_scratch_bytes: u64,
    /// Jobs of several nodes: the inter-node backend. `MKERNEL_TRANSPORT`, when set, overrides
    /// it; `None` with the variable unset means the emulated wire for emulated nodes, else TCP.
    /// ibverbs RC and EFA SRD are used only when named here or in the variable: neither has run
    /// on a NIC yet (docs/internode.md, "Which backend").
    pub transport: Option<mkernel_proxy::backend::BackendKind>,
    /// Which AllReduce path [`Communicator::all_reduce`] takes at which size (provisional
    /// thresholds: [`AllReducePolicy::PROVISIONAL`]).
    pub all_reduce_policy: AllReducePolicy,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            heap_bytes: 256 << 20,
            timeout: Duration::from_secs(10),
            bootstrap_timeout: Duration::from_secs(60),
            internode_scratch_bytes: 256 << 20,
            transport: None,
            all_reduce_policy: AllReducePolicy::PROVISIONAL,
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

/// What the communicator's last direct launch went to (see [`Communicator`]'s "Launch order").
enum Last {
    /// A cudarc stream (kept alive here: the next launch on another stream records an event on
    /// it).
    Stream(Arc<CudaStream>),
    /// A raw `CUstream` ([`Communicator`]'s raw-stream launches), whose lifetime is the caller's:
    /// an event recorded right after the launch stands for it.
    Recorded(CudaEvent),
}

/// Orders the launches of one owner (a communicator, a plan with scratch buffers) on the device
/// across streams: held under the owner's lock, [`LaunchOrder::follow`] before each launch.
#[derive(Default)]
pub(crate) struct LaunchOrder {
    last: Option<Last>,
}

/// Whether `s` is capturing a CUDA graph (the legacy default stream never is).
fn capturing(s: &CudaStream) -> Result<bool> {
    // SAFETY: `s` is a live cudarc stream.
    unsafe { capturing_raw(s.cu_stream()) }
}

/// [`capturing`] for a raw stream.
///
/// # Safety
/// `s` must be a live stream (or null, the legacy default stream).
unsafe fn capturing_raw(s: CUstream) -> Result<bool> {
    if s.is_null() {
        return Ok(false);
    }
    // SAFETY: `s` is live (caller's contract).
    let status = unsafe { cudarc::driver::result::stream::is_capturing(s)? };
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl LaunchOrder {
    /// Orders the next launch, on `stream`, after every launch so far: when the stream changed,
    /// `stream` waits for an event recorded on the previous one. Launches into a graph capture
    /// are left out (an event recorded outside a capture cannot order a captured node).
    pub(crate) fn follow(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if matches!(&self.last, Some(Last::Stream(l)) if l.cu_stream() == stream.cu_stream()) {
            return Ok(());
        }
        if capturing(stream)? {
            return Ok(());
        }
        // SAFETY: `stream` is a live cudarc stream.
        unsafe { self.wait_previous(stream.cu_stream())? };
        self.last = Some(Last::Stream(stream.clone()));
        Ok(())
    }

    /// [`LaunchOrder::follow`] for a raw stream; `Ok(false)` when it is capturing (then
    /// [`LaunchOrder::recorded`] is skipped too).
    ///
    /// # Safety
    /// `stream` must be a live stream of the communicator's context.
    unsafe fn follow_raw(&mut self, stream: CUstream) -> Result<bool> {
        // SAFETY: caller's contract.
        if unsafe { capturing_raw(stream)? } {
            return Ok(false);
        }
        // SAFETY: caller's contract.
        unsafe { self.wait_previous(stream)? };
        Ok(true)
    }

    /// After a launch on a raw stream: an event recorded there stands for it.
    ///
    /// # Safety
    /// `stream` must be a live stream of `ctx`.
    unsafe fn recorded(&mut self, ctx: &Arc<cudarc::driver::CudaContext>, stream: CUstream) -> Result<()> {
        let ev = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        // SAFETY: `ev` is live; `stream` by the caller's contract.
        unsafe { cudarc::driver::result::event::record(ev.cu_event(), stream)? };
        self.last = Some(Last::Recorded(ev));
        Ok(())
    }

    /// Makes `stream` wait for the last launch (if it was not on a capturing stream).
    ///
    /// # Safety
    /// `stream` must be a live stream of the communicator's context.
    unsafe fn wait_previous(&mut self, stream: CUstream) -> Result<()> {
        let ev = match self.last.take() {
            None => return Ok(()),
            Some(Last::Stream(l)) if capturing(&l)? => return Ok(()),
            Some(Last::Stream(l)) => l.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
            Some(Last::Recorded(ev)) => ev,
        };
        // SAFETY: `ev` is live; `stream` by the caller's contract.
        unsafe {
            cudarc::driver::result::stream::wait_event(
                stream,
                ev.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )?
        };
        Ok(())
    }
}

/// The NVLink communicator of one rank: its heap, its peers' heaps, its device descriptor.
///
/// # Launch order
/// Every kernel of a communicator advances the same per-CTA epochs on every rank, so its
/// launches must run one after another on the device and in the same order on every rank.
/// Methods take `&self` and serialize their launches through an internal lock (a leaf: no
/// other lock of mkernel is taken while it is held; kernels are looked up before), rather than
/// taking `&mut self`: plans borrow the communicator for
/// their lifetime ([`crate::ops`]), several plans and the collectives stay usable side by side,
/// and a server can share one communicator between threads (`Communicator: Send + Sync`).
/// The lock orders the enqueues; on the device, a launch on another stream than the previous
/// one first waits for an event recorded on that stream (after a launch on a raw `CUstream`,
/// e.g. [`crate::ops::AgGemmPlan::launch_raw`], an event recorded right after it), so kernels
/// of one communicator never overlap whatever streams they are given. Launches captured into a CUDA graph are not
/// ordered this way: replay such a graph on the stream of the direct launches, or synchronize
/// between them. Which order the ranks launch in is the caller's contract (a different order
/// on two ranks ends in a [`Error::CommTimeout`], not in a hang).
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
    /// The heap's data region allocator (the same on every rank).
    allocator: Mutex<HeapAllocator>,
    /// The next plan agreement's sequence number ([`Communicator::agree`]).
    agree_seq: AtomicU64,
    /// `CommConfig::bootstrap_timeout`: every store exchange after construction waits this long.
    boot_timeout: Duration,
    order: Mutex<LaunchOrder>,
    /// The abort words this rank raises, and the reset count ([`abort`]).
    aborter: Arc<abort::Aborter>,
    /// [`CommConfig::all_reduce_policy`].
    policy: AllReducePolicy,
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
        let heap_bytes = HEAP_RESERVED_BYTES
            .checked_add(cfg.heap_bytes)
            .and_then(|b| b.checked_add(wire_bytes))
            .ok_or_else(|| Error::Shape {
                op: "communicator",
                reason: format!(
                    "heap of {} + {} + {wire_bytes} bytes overflows 64 bits",
                    HEAP_RESERVED_BYTES, cfg.heap_bytes
                ),
            })?;
        let heap = SymmetricHeap::new(device.ordinal() as i32, heap_bytes, &mut boot, cfg.bootstrap_timeout)?;
        let stream = device.default_stream();
        // Zero the control and LL areas (flags, epochs, error record, LL words) before anyone signals into them.
        let zeros = vec![0u8; HEAP_ZEROED_BYTES as usize];
        // SAFETY: the first HEAP_ZEROED_BYTES of our heap are ours and mapped.
        unsafe { cudarc::driver::result::memcpy_htod_sync(heap.local_base(), &zeros)? };
        // The host abort words of the node's ranks (collective, like the heap's exchange); the
        // proxy stores other nodes' aborts into them.
        let host_words = Arc::new(abort::HostWords::exchange(
            device.context(),
            &mut boot,
            cfg.bootstrap_timeout,
        )?);
        let link = (nnodes > 1).then(|| host_words.proxy_link());
        let node = match &link {
            Some(link) => Some(InterNode::new(
                device.context(),
                &boot,
                heap.own_fd(),
                heap.local_base(),
                heap.bytes(),
                cfg.transport,
                link.clone(),
                cfg.bootstrap_timeout,
            )?),
            None => None,
        };
        let mut d = CommDesc {
            rank,
            world,
            timeout_ns: check::saturating_nanos(cfg.timeout),
            heaps: [0; MAX_LOCAL_RANKS as usize],
            global_rank: info.rank() as u32,
            global_world: info.world_size() as u32,
            fifo: node.as_ref().map_or(0, |n| n.fifo_device_ptr()),
            fifo_capacity: FIFO_CAPACITY,
            _pad: 0,
            host_abort: host_words.device_addr(),
        };
        for (r, slot) in d.heaps.iter_mut().enumerate().take(world as usize) {
            *slot = heap.base(r).ok_or_else(|| Error::Shape {
                op: "communicator",
                reason: format!("local rank {r}'s heap is not mapped"),
            })?;
        }
        let bytes = bytemuck::bytes_of(&d);
        let desc = stream.clone_htod(bytes)?;
        stream.synchronize()?;
        // Nobody may signal into a heap before its owner zeroed it.
        boot.store()
            .barrier("mkernel/communicator/zeroed", cfg.bootstrap_timeout)?;
        let desc_addr = desc.device_ptr(&stream).0;
        // The abort reaches every local rank through its host abort word; on emulated nodes,
        // every rank of the other nodes through the wire's mappings of their heaps; otherwise
        // through the proxies.
        let remote_bases: Vec<u64> = match &node {
            Some(n) => n
                .heap_bases()
                .into_iter()
                .enumerate()
                .filter(|(g, _)| !info.node_ranks().contains(g))
                .map(|(_, b)| b)
                .collect(),
            None => Vec::new(),
        };
        let emulated = node
            .as_ref()
            .is_some_and(|n| n.transport().kind == mkernel_proxy::backend::BackendKind::Emulated);
        let aborter = abort::Aborter::new(
            device.context(),
            host_words,
            if emulated { None } else { link },
            &remote_bases,
            info.rank() as u32,
            cfg.bootstrap_timeout,
        )?;
        let heap_bytes_mapped = heap.bytes();
        let mut comm = Communicator {
            wire: None,
            device: device.clone(),
            boot,
            heap,
            _desc: desc,
            desc_addr,
            rank,
            world,
            allocator: Mutex::new(HeapAllocator::new(HEAP_RESERVED_BYTES, heap_bytes_mapped)),
            agree_seq: AtomicU64::new(0),
            boot_timeout: cfg.bootstrap_timeout,
            order: Mutex::new(LaunchOrder::default()),
            aborter,
            policy: cfg.all_reduce_policy,
        };
        if let Some(node) = node {
            let max_bytes = wire_bytes / (nnodes as u64 + 2) / 256 * 256;
            let stage = comm.alloc(max_bytes)?;
            let node_sum = comm.alloc(max_bytes)?;
            let recv = comm.alloc(check::product(
                "communicator",
                "stage bytes x nodes",
                &[max_bytes, nnodes as u64],
            )?)?;
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
    /// Ranks of the whole job (local ranks x nodes).
    pub fn global_world(&self) -> u32 {
        self.boot.info().world_size() as u32
    }
    /// The bootstrap (store) this communicator was built on.
    pub fn bootstrap(&self) -> &Bootstrap {
        &self.boot
    }
    /// The GPU.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Reserves `bytes` (rounded up to 256) of the heap on every rank, for the communicator's
    /// lifetime. Collective in the sense that every rank must make the same sequence of calls
    /// (offsets are computed locally, first fit: the same on every rank whose live buffers are
    /// the same). [`Communicator::alloc_region`] gives the bytes back when dropped.
    pub fn alloc(&self, bytes: u64) -> Result<SymBuffer> {
        self.allocator().alloc(bytes)
    }
    /// As [`Communicator::alloc`], given back to the heap when the region drops (after this
    /// rank's context synchronized: no kernel of this rank still uses it). Plans hold their heap
    /// buffers this way. A region dropped on one rank and not yet on another leaves the two
    /// heaps out of step until it drops there too: the next plan's agreement compares offsets
    /// and fails on every rank ([`Error::PlanMismatch`]) rather than let them differ.
    pub fn alloc_region(&self, bytes: u64) -> Result<HeapRegion<'_>> {
        Ok(HeapRegion {
            comm: self,
            buf: self.alloc(bytes)?,
        })
    }
    /// Bytes of the heap's data region in use, and live buffers (tests, servers sizing heaps).
    pub fn heap_usage(&self) -> (u64, usize) {
        let a = self.allocator();
        (a.used(), a.live())
    }
    /// Bytes of the heap's data region (`CommConfig::heap_bytes` and the inter-node stages,
    /// rounded up to the allocation granularity).
    pub fn heap_data_bytes(&self) -> u64 {
        self.heap.bytes() - HEAP_RESERVED_BYTES
    }
    fn allocator(&self) -> std::sync::MutexGuard<'_, HeapAllocator> {
        self.allocator.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Agrees on a collective plan with every rank of the job ([`agree`]): exchanges `desc`
    /// and this rank's outcome so far (`local`: the error its own checks gave, if any) through
    /// the store, within `CommConfig::bootstrap_timeout`. Every rank returns the same result:
    /// `Ok` with the agreed minima, [`Error::PlanFailed`] naming the ranks whose checks failed
    /// and why, [`Error::PlanMismatch`] naming the field that differs, or the store's timeout
    /// naming the ranks that did not come. Every plan constructor calls it exactly once on
    /// every path, so the sequence stays in step across ranks.
    pub fn agree(&self, desc: &PlanDesc, local: Option<&Error>) -> Result<Agreed> {
        let seq = self.agree_seq.fetch_add(1, Ordering::Relaxed);
        agree::exchange(self.boot.store(), seq, desc, local, self.boot_timeout)
    }
    /// [`Communicator::agree`] of a plan whose own checks gave `local`: `Ok(v)` only when
    /// every rank's checks passed and the descriptions agree (`desc` builds the description
    /// from the checked values, or a bare one naming `op` when this rank failed).
    pub(crate) fn agree_on<T>(
        &self,
        op: &'static str,
        local: Result<T>,
        desc: impl FnOnce(&T) -> PlanDesc,
    ) -> Result<(T, Agreed)> {
        match local {
            Ok(v) => {
                let d = desc(&v);
                let agreed = self.agree(&d, None)?;
                Ok((v, agreed))
            }
            Err(e) => Err(self.agree(&PlanDesc::new(op), Some(&e)).err().unwrap_or(e)),
        }
    }
    /// The store timeout of exchanges after construction (`CommConfig::bootstrap_timeout`).
    pub fn bootstrap_timeout(&self) -> Duration {
        self.boot_timeout
    }
    /// This rank's device address of `b` ([`Error::OutOfRange`] when `b` is not in this
    /// heap's data region).
    pub fn ptr(&self, b: &SymBuffer) -> Result<u64> {
        check_region("symmetric heap", b, self.heap.bytes())?;
        Ok(self.heap.local_base() + b.offset)
    }
    /// Local rank `r`'s buffer `b` as mapped in this process (NVLink); [`Error::OutOfRange`]
    /// for a rank outside `0..world` or a buffer outside the data region.
    pub fn peer_ptr(&self, r: u32, b: &SymBuffer) -> Result<u64> {
        check_region("symmetric heap", b, self.heap.bytes())?;
        let base = self.heap.base(r as usize).ok_or_else(|| Error::OutOfRange {
            op: "symmetric heap",
            reason: format!("local rank {r} of {}", self.world),
        })?;
        Ok(base + b.offset)
    }
    /// Device address of the descriptor the kernels read.
    pub fn desc_ptr(&self) -> u64 {
        self.desc_addr
    }

    /// Runs `enqueue` (which launches this communicator's kernels on `stream`) under the launch
    /// lock, after ordering `stream` behind the previous launch ([`Communicator`]'s "Launch
    /// order"). Refuses a stream of another context.
    pub(crate) fn enqueue<R>(
        &self,
        op: &'static str,
        stream: &Arc<CudaStream>,
        enqueue: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        check::stream_on(op, &self.device, stream)?;
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        order.follow(stream)?;
        enqueue()
    }

    /// [`Communicator::enqueue`] on a raw stream: refuses a stream of another context, orders
    /// it behind the previous launch, runs `enqueue`, and records an event after it that the
    /// next launch waits for (so the communicator keeps no handle to `stream`).
    ///
    /// # Safety
    /// `stream` must be a live stream (or null, the legacy default stream) that stays valid
    /// until the launches `enqueue` makes have completed.
    pub(crate) unsafe fn enqueue_raw<R>(
        &self,
        op: &'static str,
        stream: CUstream,
        enqueue: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let ctx = self.device.context();
        ctx.bind_to_thread()?;
        let mut stream_ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `stream` is live (caller's contract); out-pointer to a CUcontext.
        unsafe { sys::cuStreamGetCtx(stream, &mut stream_ctx).result()? };
        if stream_ctx != ctx.cu_ctx() {
            return Err(Error::ForeignContext { op, what: "stream" });
        }
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `stream` is a live stream of this context (checked above).
        let ordered = unsafe { order.follow_raw(stream)? };
        let r = enqueue()?;
        if ordered {
            // SAFETY: as above.
            unsafe { order.recorded(ctx, stream)? };
        }
        Ok(r)
    }

    /// Checks `b` against this heap's data region.
    pub(crate) fn check_region(&self, op: &'static str, b: &SymBuffer) -> Result<()> {
        check_region(op, b, self.heap.bytes())
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

    /// AllGather of `src` (a cudarc slice or view on this device; its size in bytes, a
    /// multiple of 16, per rank): every rank's `src` goes to `dst[rank * bytes ..]` on every
    /// rank (rank: global across nodes).
    pub fn all_gather<T>(
        &self,
        stream: &Arc<CudaStream>,
        src: &impl DevicePtr<T>,
        dst: &SymBuffer,
        ctas: u32,
    ) -> Result<()> {
        check::buffer_on("all_gather", "src", &self.device, src)?;
        let bytes = check::product(
            "all_gather",
            "src elements x size",
            &[src.len() as u64, std::mem::size_of::<T>() as u64],
        )?;
        let (ptr, _read) = src.device_ptr(stream);
        // SAFETY: `src` is a live buffer of `bytes` bytes in this context, borrowed until the
        // launch is enqueued (cudarc orders its later free or reuse after the read).
        unsafe { self.all_gather_raw(stream, ptr, dst, bytes, ctas) }
    }

    /// [`Communicator::all_gather`] from a raw device address: `bytes` per rank (a multiple
    /// of 16) from `src` (16-byte aligned).
    ///
    /// # Safety
    /// `src` must be a device address of this communicator's context with `bytes` readable
    /// bytes that stay allocated, and are not written, until the launch has completed on
    /// `stream`.
    pub unsafe fn all_gather_raw(
        &self,
        stream: &Arc<CudaStream>,
        src: u64,
        dst: &SymBuffer,
        bytes: u64,
        ctas: u32,
    ) -> Result<()> {
        let op = "all_gather";
        check_multiple(op, "bytes per rank", bytes, 16)?;
        check::aligned16(op, &[("src", src)])?;
        self.check_region(op, dst)?;
        let ranks = self.world as u64 * self.nnodes() as u64;
        check_fits(op, dst, check::product(op, "bytes x ranks", &[bytes, ranks])?)?;
        if let Some(w) = &self.wire {
            if bytes > w.max_bytes {
                return Err(Error::Shape {
                    op,
                    reason: format!(
                        "{bytes} bytes per rank exceed the inter-node stage of {} (CommConfig::internode_scratch_bytes)",
                        w.max_bytes
                    ),
                });
            }
            let stage = self.ptr(&w.stage)?;
            let (desc, src_off, dst_off) = (self.desc_ptr(), w.stage.offset, dst.offset);
            let (f, cfg) = self.prepare(&kernels::ALLGATHER_INTERNODE, ctas)?;
            return self.enqueue(op, stream, || {
                // The proxy reads the source from the heap: stage it there.
                // SAFETY: both ranges are device memory of at least `bytes` (caller's contract
                // for `src`; the stage holds `max_bytes` >= `bytes`).
                unsafe { cudarc::driver::result::memcpy_dtod_async(stage, src, bytes as usize, stream.cu_stream())? };
                let mut b = stream.launch_builder(&f);
                b.arg(&desc).arg(&src_off).arg(&dst_off).arg(&bytes);
                // SAFETY: mk_allgather_internode(desc, src_off, dst_off, bytes); dst checked above.
                unsafe { b.launch(cfg) }?;
                Ok(())
            });
        }
        let (desc, dst_off) = (self.desc_ptr(), dst.offset);
        let (f, cfg) = self.prepare(&kernels::ALLGATHER, ctas)?;
        self.enqueue(op, stream, || {
            let mut b = stream.launch_builder(&f);
            b.arg(&desc).arg(&src).arg(&dst_off).arg(&bytes);
            // SAFETY: mk_allgather(desc, src, dst_off, bytes); `src` by the caller's contract,
            // `dst` checked above.
            unsafe { b.launch(cfg) }?;
            Ok(())
        })
    }

    /// ReduceScatter into `dst` (a cudarc slice or view of `count` bf16 or f32 elements on
    /// this device): `dst` = the sum over ranks of elements `[rank * count, (rank + 1) *
    /// count)` of `src` (in the heap). `count * size` must be a multiple of 16.
    pub fn reduce_scatter<T: ReduceElem>(
        &self,
        stream: &Arc<CudaStream>,
        src: &SymBuffer,
        dst: &mut impl DevicePtrMut<T>,
        ctas: u32,
    ) -> Result<()> {
        check::buffer_on("reduce_scatter", "dst", &self.device, &*dst)?;
        let count = dst.len() as u64;
        let (ptr, _write) = dst.device_ptr_mut(stream);
        // SAFETY: `dst` is a live buffer of `count` elements of `T` in this context, borrowed
        // mutably until the launch is enqueued (cudarc orders later uses after the write).
        unsafe { self.reduce_scatter_raw(stream, src, ptr, count, T::DTYPE, ctas) }
    }

    /// [`Communicator::reduce_scatter`] into a raw device address (16-byte aligned) of
    /// `count` elements of `dtype`.
    ///
    /// # Safety
    /// `dst` must be a device address of this communicator's context with `count * dtype.size()`
    /// writable bytes that stay allocated, and are not otherwise accessed, until the launch has
    /// completed on `stream`.
    pub unsafe fn reduce_scatter_raw(
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
        let bytes = check::product(op, "count x size", &[count, dtype.size()])?;
        check_multiple(op, "bytes per rank", bytes, 16)?;
        self.check_region(op, src)?;
        check_fits(
            op,
            src,
            check::product(op, "count x size x world", &[bytes, self.world as u64])?,
        )?;
        check::aligned16(op, &[("dst", dst)])?;
        let (desc, src_off, code) = (self.desc_ptr(), src.offset, dtype.code());
        let (f, cfg) = self.prepare(&kernels::REDUCE_SCATTER, ctas)?;
        self.enqueue(op, stream, || {
            let mut b = stream.launch_builder(&f);
            b.arg(&desc).arg(&src_off).arg(&dst).arg(&count).arg(&code);
            // SAFETY: mk_reduce_scatter(desc, src_off, dst, count, dtype); `dst` by the caller's
            // contract, `src` checked above.
            unsafe { b.launch(cfg) }?;
            Ok(())
        })
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
        // A peer the proxy would refuse (out of range, this rank, or on this node) would abort
        // the proxy and with it this communicator's inter-node path: refuse it here instead.
        let topology =
            mkernel_proxy::Topology::new(w.nnodes as usize, self.world as usize, self.global_rank() as usize)
                .map_err(|e| Error::Proxy(e.to_string()))?;
        if !topology.is_proxy_peer(peer as usize) {
            return Err(Error::OutOfRange {
                op,
                reason: format!(
                    "peer {peer} is not a rank on another node (global rank {} of {}, {} ranks per node)",
                    self.global_rank(),
                    topology.world_size(),
                    self.world
                ),
            });
        }
        let out = stream.alloc_zeros::<u64>(iters as usize)?;
        let out_ptr = out.device_ptr(stream).0;
        let (desc, src_off, dst_off, init) = (self.desc_ptr(), w.stage.offset, w.recv.offset, initiator as u32);
        let f = self.device.function(&kernels::PROXY_PINGPONG)?;
        self.enqueue(op, stream, || {
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
            Ok(())
        })?;
        stream.synchronize()?;
        self.check()?;
        Ok(stream.clone_dtoh(&out)?)
    }

    /// Reads the device error record (after the stream's work finished). A timeout becomes
    /// [`Error::CommTimeout`] naming the rank that stalled and the peer it waited for; an abort
    /// ([`Communicator::abort`], by this rank or a peer) becomes [`Error::Aborted`] naming the
    /// rank that aborted - also when no wait saw it, for as long as the communicator stays
    /// aborted (until [`Communicator::reset`]).
    pub fn check(&self) -> Result<()> {
        if let Some(w) = &self.wire {
            w.node.check()?;
        }
        abort::status(self.heap.local_base(), self.global_rank(), self.aborter.host_word())
    }
}

/// What the error record's `slot` says was awaited (`mkernel_config::comm::wait_code`).
pub(crate) fn wait_name(code: u32) -> String {
    use mkernel_config::comm::wait_code as w;
    match code {
        w::REMOTE_READY => "inter-node Ready flag (epoch)".into(),
        w::REMOTE_DATA => "inter-node Data flag (epoch)".into(),
        w::FIFO_SPACE => "proxy FIFO space".into(),
        w::FIFO_DONE => "proxy completion (done)".into(),
        w::RING_FULL => "GEMM ring slot (full mbarrier, loads landed)".into(),
        w::RING_EMPTY => "GEMM ring slot (empty mbarrier, consumers released)".into(),
        w::STAGING => "epilogue staging (aux mbarrier)".into(),
        w::RING_TICK => "consumers' ring progress (tick count)".into(),
        w::NODE_SUMS => "other nodes' sums (aux mbarrier)".into(),
        w::REMOTE_RING_DATA => "inter-node RingData flag (ring step)".into(),
        w::REMOTE_RING_FREE => "inter-node RingFree flag (ring step)".into(),
        c if (w::MOE_EP..w::MOE_EP + 4).contains(&c) => {
            let names = ["Ready", "Counts", "Rows", "Out"];
            format!("MoE {} flag (epoch)", names[(c - w::MOE_EP) as usize])
        }
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

/// A buffer of the symmetric heap given back when dropped ([`Communicator::alloc_region`]).
/// Derefs to its [`SymBuffer`] (a plan borrowing `&SymBuffer` from it keeps it alive).
pub struct HeapRegion<'c> {
    comm: &'c Communicator,
    buf: SymBuffer,
}

impl HeapRegion<'_> {
    /// The buffer.
    pub fn buffer(&self) -> SymBuffer {
        self.buf
    }
}

impl std::ops::Deref for HeapRegion<'_> {
    type Target = SymBuffer;
    fn deref(&self) -> &SymBuffer {
        &self.buf
    }
}

impl std::fmt::Debug for HeapRegion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.buf.fmt(f)
    }
}

impl Drop for HeapRegion<'_> {
    fn drop(&mut self) {
        // This rank's kernels that may use the region are done before it can be handed out
        // again (best effort: an error here is a broken context, reported by its next call).
        // Peers' kernels: a later plan takes these bytes only after an agreement, which every
        // rank reaches after dropping its own copy of the region, i.e. after synchronizing.
        let _ = self.comm.device.context().synchronize();
        let _ = self.comm.allocator().free(self.buf);
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // No abort handle writes into the mappings from here on.
        self.aborter.close();
        // Peers may still be writing into our heap: wait until every local rank is done
        // before the mappings go away (best effort; errors are already reported elsewhere).
        let _ = self.device.context().synchronize();
        let _ = self
            .boot
            .store()
            .barrier("mkernel/communicator/drop", self.boot_timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server may share the communicator and its plans between threads.
    #[test]
    fn communicator_and_plans_are_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Communicator>();
        send_sync::<crate::ops::AgGemmPlan<'static>>();
        send_sync::<crate::ops::GemmRsPlan<'static>>();
        send_sync::<crate::GemmPlan>();
    }

    const HEAP: u64 = HEAP_RESERVED_BYTES + (1 << 20);

    #[test]
    fn buffers_outside_the_data_region_are_refused() {
        let ok = HeapAllocator::new(HEAP_RESERVED_BYTES, HEAP).alloc(4096).unwrap();
        assert!(check_region("t", &ok, HEAP).is_ok());
        let last = SymBuffer {
            offset: HEAP - 256,
            bytes: 256,
        };
        assert!(check_region("t", &last, HEAP).is_ok());
        for forged in [
            // The control area (flags, epochs, error record, abort word).
            SymBuffer { offset: 0, bytes: 256 },
            SymBuffer {
                offset: HEAP_RESERVED_BYTES - 256,
                bytes: 512,
            },
            // Past the end, and an end that wraps around.
            SymBuffer {
                offset: HEAP - 256,
                bytes: 512,
            },
            SymBuffer {
                offset: HEAP_RESERVED_BYTES,
                bytes: u64::MAX,
            },
            SymBuffer {
                offset: u64::MAX - 255,
                bytes: 256,
            },
        ] {
            assert!(
                matches!(check_region("t", &forged, HEAP), Err(Error::OutOfRange { .. })),
                "{forged:?}"
            );
        }
    }
}
