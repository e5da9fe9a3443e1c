//! Inter-node transport of a communicator: the host-mapped command FIFO the kernels post to,
//! the proxy thread that drains it (crates/proxy), and the backend that carries its puts:
//!
//! * `emulated`: ranks of one host play nodes; GPU copies into the peers' heaps (mapped here
//!   over the host-wide fd exchange), the flag written after the data on the same stream;
//! * `tcp`: any network; the proxy stages heap bytes through pinned host buffers
//!   ([`GpuStaging`]), sockets carry them, the receiving proxy copies them into its heap and
//!   then writes the flag;
//! * `ibverbs` (RC) and `efa` (SRD), with the `rdma` cargo feature: the heap registered with the
//!   NIC through dma-buf (`cuMemGetHandleForAddressRange`), queue pairs exchanged through the
//!   store. Untried: written and compiled, never run (no RDMA NIC was available), so used only
//!   when asked for (`MKERNEL_TRANSPORT=ibverbs|efa` or `CommConfig::transport`).
//!
//! [`mkernel_proxy::backend::choose_with`] picks one (`MKERNEL_TRANSPORT`, else
//! `CommConfig::transport`, else the emulated wire for emulated nodes, else TCP); the choice is
//! logged and [`InterNode::transport`] reports it.
use super::heap::{import_and_map, Mapping};
#[cfg(feature = "rdma")]
use super::rdma;
use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use mkernel_bootstrap::{Bootstrap, JobDir, LocalPeers};
use mkernel_proxy::backend::{choose_from_env, BackendChoice, BackendKind, HostCaps};
use mkernel_proxy::emulated::{CopyEngine, EmulatedTransport, WireModel};
use mkernel_proxy::tcp::{DeviceStaging, Exchange, TcpConfig, TcpLinks, TcpTransport};
use mkernel_proxy::{
    AbortLink, Fifo, FifoConsumer, PeerRegions, Proxy, ProxyConfig, RawFifo, Regions, Topology, Transport,
    TransportError, Validator,
};
use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

/// Slots of each rank's FIFO.
pub const FIFO_CAPACITY: u32 = 1024;

/// Pinned, device-mapped host memory holding the FIFO.
struct PinnedFifo {
    host: *mut u8,
    device: u64,
}

impl Drop for PinnedFifo {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc; the proxy thread has been joined.
        unsafe { sys::cuMemFreeHost(self.host as *mut std::ffi::c_void) };
    }
}

/// The inter-node half of a communicator.
pub struct InterNode {
    // Field order: the proxy stops before the mappings and the FIFO go away.
    proxy: Option<Proxy>,
    fifo: PinnedFifo,
    /// Every rank's heap (index = global rank), mapped for the emulated wire.
    _mappings: Vec<Mapping>,
    choice: BackendChoice,
}

// SAFETY: the raw FIFO pointer is only shared with the proxy thread through `RawFifo`.
unsafe impl Send for InterNode {}
// SAFETY: as above; `&InterNode` only reads the FIFO through atomics.
unsafe impl Sync for InterNode {}

impl InterNode {
    /// Chooses the backend (`MKERNEL_TRANSPORT` overrides `transport`, the program's choice;
    /// without either, TCP or the emulated wire: [`mkernel_proxy::backend`]), sets up the FIFO and the
    /// backend's connections, and starts the proxy. Collective over all ranks of the job. The
    /// proxy carries user aborts through `abort` (`Transport::send_abort`), except on the
    /// emulated wire, where `Communicator::abort` writes into the other nodes' heaps itself.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &Arc<CudaContext>,
        boot: &Bootstrap,
        heap_fd: BorrowedFd<'_>,
        heap_base: u64,
        heap_bytes: u64,
        transport: Option<BackendKind>,
        abort: Arc<AbortLink>,
        timeout: Duration,
    ) -> Result<InterNode> {
        let info = boot.info().clone();
        let (rank, world) = (info.rank(), info.world_size());
        let topology = Topology::new(info.nnodes(), info.local_world_size(), rank).map_err(proxy_err)?;
        let dmabuf = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            .unwrap_or(0)
            != 0;
        let bus_id = pci_bus_id(ctx);
        let choice = choose_from_env(&topology, bus_id.as_deref(), &HostCaps::detect(dmabuf), transport)
            .map_err(transport_err)?;
        tracing::info!(rank, transport = %choice.kind, reason = %choice.reason, "mkernel inter-node transport");
        // Every rank must agree: a job whose ranks picked different backends cannot talk.
        let kinds = boot
            .store()
            .all_gather("mkernel/transport", choice.kind.name().as_bytes(), timeout)?;
        if let Some((r, k)) = kinds
            .iter()
            .enumerate()
            .find(|(_, k)| k.as_slice() != choice.kind.name().as_bytes())
        {
            return Err(Error::Proxy(format!(
                "rank {rank} chose the {} transport ({}), rank {r} chose {}: set MKERNEL_TRANSPORT the same on every node",
                choice.kind,
                choice.reason,
                String::from_utf8_lossy(k)
            )));
        }

        // The FIFO in pinned host memory the GPU writes over PCIe.
        let bytes = mkernel_proxy::protocol::fifo_bytes(FIFO_CAPACITY);
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: out-pointer; flags request a device mapping.
        unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
            .result()?
        };
        let mut device_ptr: sys::CUdeviceptr = 0;
        // SAFETY: host was returned by cuMemHostAlloc with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, host, 0).result()? };
        let fifo = PinnedFifo {
            host: host as *mut u8,
            device: device_ptr,
        };
        // SAFETY: `bytes` of 64-byte aligned (page aligned) memory owned by `fifo`.
        unsafe { RawFifo::init(fifo.host, FIFO_CAPACITY, rank as u32) }.map_err(proxy_err)?;
        // SAFETY: as above; the view lives in the proxy thread, which stops before `fifo` drops.
        let raw = unsafe { RawFifo::from_raw(fifo.host, FIFO_CAPACITY) }.map_err(proxy_err)?;
        // Puts confined to the data region, flags to this rank's column of the inter-node flags.
        let regions = Regions::heap(&topology, heap_bytes);
        let consumer =
            FifoConsumer::new(Fifo::new(raw).map_err(proxy_err)?, Validator::new(regions)).map_err(proxy_err)?;

        let mut mappings = Vec::new();
        let transport: Box<dyn Transport> = match choice.kind {
            BackendKind::Emulated => {
                mappings = map_every_heap(ctx, boot, &info, heap_fd, heap_bytes, world, timeout)?;
                let bases: Vec<u64> = mappings.iter().map(|m| m.va).collect();
                let engine = GpuCopyEngine::new(ctx.clone(), bases)?;
                let model = WireModel::from_env().map_err(transport_err)?;
                Box::new(EmulatedTransport::new(rank, engine, model))
            }
            BackendKind::Tcp => {
                let cfg = TcpConfig::from_env().map_err(transport_err)?;
                let links =
                    TcpLinks::establish(&topology, &cfg, &StoreExchange(boot), Some(&info.store_addr()), timeout)
                        .map_err(transport_err)?;
                tracing::info!(rank, addr = %links.local_addr(), why = %links.address_reason(), sockets = cfg.sockets, "tcp transport connected");
                let engine = GpuStaging::new(ctx.clone(), heap_base, heap_bytes)?;
                // Frames from peers may only write where their validators let them: the data
                // region and the sender's column of the inter-node flags.
                Box::new(
                    TcpTransport::with_regions(links, engine, PeerRegions::heap(heap_bytes)).map_err(transport_err)?,
                )
            }
            #[cfg(feature = "rdma")]
            BackendKind::IbverbsRc | BackendKind::EfaSrd => rdma::connect(
                ctx,
                boot,
                &choice,
                topology.clone(),
                heap_base,
                heap_bytes,
                bus_id,
                timeout,
            )?,
            #[cfg(not(feature = "rdma"))]
            BackendKind::IbverbsRc | BackendKind::EfaSrd => {
                return Err(Error::Unsupported(format!(
                    "the {} transport needs mkernel built with the `rdma` feature",
                    choice.kind
                )))
            }
        };
        let config = ProxyConfig {
            abort: (choice.kind != BackendKind::Emulated).then_some(abort),
            ..ProxyConfig::default()
        };
        let proxy = Proxy::spawn(consumer, transport, config).map_err(proxy_err)?;
        boot.store().barrier("mkernel/proxies-up", timeout)?;
        Ok(InterNode {
            proxy: Some(proxy),
            fifo,
            _mappings: mappings,
            choice,
        })
    }

    /// The backend carrying this rank's inter-node traffic, and why it was chosen.
    pub fn transport(&self) -> &BackendChoice {
        &self.choice
    }

    /// Device address of the FIFO (for `CommDesc::fifo`).
    pub fn fifo_device_ptr(&self) -> u64 {
        self.fifo.device
    }

    /// Every rank's heap base as mapped here (index = global rank; `Communicator::abort`
    /// reaches them all through these).
    pub(crate) fn heap_bases(&self) -> Vec<u64> {
        self._mappings.iter().map(|m| m.va).collect()
    }

    /// The proxy's error record, if it failed.
    pub fn check(&self) -> Result<()> {
        // SAFETY: the FIFO stays allocated while `self` lives.
        let view = unsafe { RawFifo::from_raw(self.fifo.host, FIFO_CAPACITY) }.map_err(proxy_err)?;
        let fifo = Fifo::new(view).map_err(proxy_err)?;
        match fifo.error_record() {
            None => Ok(()),
            Some(rec) => Err(Error::Proxy(format!(
                "the {} proxy of rank {} stopped (error code {}, command {}): {}",
                self.choice.kind,
                rec.rank,
                rec.code,
                if rec.seq == mkernel_proxy::protocol::NO_SEQ {
                    "none".to_string()
                } else {
                    rec.seq.to_string()
                },
                rec.message()
            ))),
        }
    }
}

impl Drop for InterNode {
    fn drop(&mut self) {
        if let Some(p) = self.proxy.take() {
            let _ = p.stop();
        }
    }
}

fn proxy_err(e: mkernel_proxy::ProxyError) -> Error {
    Error::Proxy(e.to_string())
}

/// Stores the 64-bit flag `value` at device address `dst` on `stream`, as two 32-bit memsets,
/// low word first. Flags only grow, so a reader that sees the low word alone sees (old high,
/// new low) <= the new value: never more than the value whose data is already in place (stream
/// order), at worst a smaller one it keeps waiting past. Flag values pass 2^32: the probes' are
/// `epoch << 12 | i`, and epochs are 64-bit.
///
/// # Safety
/// `dst` must be an 8-byte aligned device address of a flag word that stays mapped until the
/// stream's work completes.
unsafe fn store_flag(dst: u64, value: u64, stream: &CudaStream) -> Result<(), TransportError> {
    for (word, half) in [(0u64, value as u32), (4, (value >> 32) as u32)] {
        // SAFETY: `dst + word` is a 4-byte word of the flag (the caller's guarantee).
        unsafe { sys::cuMemsetD32Async(dst + word, half, 1, stream.cu_stream()).result() }.map_err(cuda)?;
    }
    Ok(())
}

fn transport_err(e: TransportError) -> Error {
    Error::Proxy(e.to_string())
}

/// `cuDeviceGetPCIBusId` of the context's device (for NIC locality).
fn pci_bus_id(ctx: &CudaContext) -> Option<String> {
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer holds 32 bytes, NUL-terminated by the driver.
    unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, ctx.cu_device()).result() }.ok()?;
    // SAFETY: NUL-terminated by the driver.
    Some(
        unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Host-wide fd exchange: every rank of this host imports and maps every other's heap (the
/// emulated wire's domain is the host).
fn map_every_heap(
    ctx: &Arc<CudaContext>,
    boot: &Bootstrap,
    info: &mkernel_bootstrap::RankInfo,
    heap_fd: BorrowedFd<'_>,
    heap_bytes: u64,
    world: usize,
    timeout: Duration,
) -> Result<Vec<Mapping>> {
    let rank = info.rank();
    let dir = if rank == 0 {
        let path = JobDir::for_rank(info)?.path().with_extension("wire");
        let dir = JobDir::open(&path)?;
        boot.store()
            .set("mkernel/wire-dir", path.to_string_lossy().as_bytes())?;
        dir
    } else {
        let path = String::from_utf8_lossy(&boot.store().get("mkernel/wire-dir", timeout)?).to_string();
        JobDir::open(path)?
    };
    let mut peers = LocalPeers::bind_in(dir, rank, world)?;
    boot.store().barrier("mkernel/wire-bound", timeout)?;
    let fds = peers.exchange_fds(&[heap_fd], timeout)?;
    let device = ctx.ordinal() as i32;
    let mut mappings = Vec::with_capacity(world);
    for (r, mut v) in fds.into_iter().enumerate() {
        let fd = v.pop().ok_or_else(|| Error::Shape {
            op: "inter-node wire",
            reason: format!("rank {r} sent no heap handle"),
        })?;
        mappings.push(import_and_map(&fd, heap_bytes, device)?);
    }
    Ok(mappings)
}

/// The bootstrap store as the TCP transport's address exchange.
struct StoreExchange<'a>(&'a Bootstrap);

impl Exchange for StoreExchange<'_> {
    fn publish(&self, key: &str, value: &[u8]) -> std::result::Result<(), String> {
        self.0.store().set(key, value).map_err(|e| e.to_string())
    }
    fn lookup(&self, key: &str, timeout: Duration) -> std::result::Result<Vec<u8>, String> {
        self.0.store().get(key, timeout).map_err(|e| e.to_string())
    }
    /// Derived from the job key, which every rank has and no stranger does.
    fn frame_secret(&self) -> Option<[u8; 32]> {
        Some(self.0.info().job_key().derive_secret("tcp-frames"))
    }
}

/// Pinned host memory from `cuMemHostAlloc`.
struct PinnedHost {
    ptr: *mut u8,
    bytes: usize,
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by cuMemHostAlloc; no copy uses it any more (the proxy thread,
            // which owns the engine, synchronizes its streams before dropping it).
            unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}

/// The TCP transport's GPU side: `cuMemcpyDtoHAsync` from this rank's heap into pinned staging
/// buffers on one stream, `cuMemcpyHtoDAsync` into the heap and the flag as a 4-byte
/// `cuMemsetD32Async` after them on another (stream order puts the flag after the data; flags
/// are epochs below 2^32 whose high word stays 0, as on the emulated wire). One event per call.
pub struct GpuStaging {
    ctx: Arc<CudaContext>,
    out: Arc<CudaStream>,
    inn: Arc<CudaStream>,
    heap: u64,
    /// Bytes of the heap mapping at `heap`: every copy and flag store is checked against it
    /// here too, so a bad range is a transport error naming it, never a copy-engine fault
    /// (a sticky `CUDA_ERROR_ILLEGAL_ADDRESS` that MPS reports to every client of the GPU).
    heap_bytes: u64,
    host: PinnedHost,
    chunk: usize,
    count: usize,
    out_pending: VecDeque<(u64, CudaEvent)>,
    in_pending: VecDeque<(u64, CudaEvent)>,
    /// Completed events, recorded again (creating one per call costs a driver round trip).
    spare: Vec<CudaEvent>,
    bound: bool,
}

// SAFETY: used by the proxy thread alone, which binds the context first; the pinned memory is
// owned by the value.
unsafe impl Send for GpuStaging {}

impl GpuStaging {
    fn new(ctx: Arc<CudaContext>, heap: u64, heap_bytes: u64) -> Result<GpuStaging> {
        Ok(GpuStaging {
            out: ctx.new_stream()?,
            inn: ctx.new_stream()?,
            ctx,
            heap,
            heap_bytes,
            host: PinnedHost {
                ptr: std::ptr::null_mut(),
                bytes: 0,
            },
            chunk: 0,
            count: 0,
            out_pending: VecDeque::new(),
            in_pending: VecDeque::new(),
            spare: Vec::new(),
            bound: false,
        })
    }
    fn bind(&mut self) -> Result<(), TransportError> {
        bind_once(&self.ctx, &mut self.bound)
    }
    /// Records an event on the outgoing (`out`) or incoming stream for `token`.
    fn track(&mut self, out: bool, token: u64) -> Result<(), TransportError> {
        let ev = match self.spare.pop() {
            Some(e) => e,
            None => self.ctx.new_event(None).map_err(cuda)?,
        };
        let (stream, q) = if out {
            (&self.out, &mut self.out_pending)
        } else {
            (&self.inn, &mut self.in_pending)
        };
        ev.record(stream).map_err(cuda)?;
        q.push_back((token, ev));
        Ok(())
    }
    /// Device address of `[offset, offset + len)` of the heap, if inside it.
    fn heap_range(&self, what: &str, offset: u64, len: u64) -> Result<u64, TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.heap_bytes => Ok(self.heap + offset),
            _ => Err(TransportError::Copy(format!(
                "{what} [{offset}, +{len}) outside the {}-byte heap",
                self.heap_bytes
            ))),
        }
    }
    fn host_ptr(&self, buf: usize, len: usize) -> Result<*mut u8, TransportError> {
        if buf >= self.count || len > self.chunk {
            return Err(TransportError::Copy(format!(
                "staging buffer {buf} of {} cannot hold {len} bytes",
                self.count
            )));
        }
        // SAFETY: in bounds of the allocation.
        Ok(unsafe { self.host.ptr.add(buf * self.chunk) })
    }
}

impl DeviceStaging for GpuStaging {
    fn alloc_buffers(&mut self, count: usize, bytes: usize) -> Result<(), TransportError> {
        // Called on the thread that builds the transport, not the proxy thread: bind here
        // without marking the proxy thread bound.
        self.ctx.bind_to_thread().map_err(cuda)?;
        let total = count
            .checked_mul(bytes)
            .ok_or_else(|| TransportError::Config(format!("{count} x {bytes} staging bytes overflow")))?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: out-pointer; portable pinned memory.
        unsafe { sys::cuMemHostAlloc(&mut p, total.max(1), sys::CU_MEMHOSTALLOC_PORTABLE).result() }.map_err(cuda)?;
        self.host = PinnedHost {
            ptr: p.cast(),
            bytes: total,
        };
        self.chunk = bytes;
        self.count = count;
        Ok(())
    }
    fn buffer(&mut self, i: usize) -> &mut [u8] {
        assert!(i < self.count && self.host.bytes >= (i + 1) * self.chunk);
        // SAFETY: in bounds; the transport touches a buffer only while no copy uses it.
        unsafe { std::slice::from_raw_parts_mut(self.host.ptr.add(i * self.chunk), self.chunk) }
    }
    fn to_host(&mut self, token: u64, src_offset: u64, buf: usize, len: usize) -> Result<(), TransportError> {
        self.bind()?;
        let dst = self.host_ptr(buf, len)?;
        let src = self.heap_range("staging source", src_offset, len as u64)?;
        // SAFETY: `src` holds `len` bytes of the heap (checked above, and by the validator);
        // `dst` holds `len` bytes of pinned memory.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.out.cu_stream()).result() }.map_err(cuda)?;
        self.track(true, token)
    }
    fn to_device(&mut self, token: u64, buf: usize, dst_offset: u64, len: usize) -> Result<(), TransportError> {
        self.bind()?;
        let src = self.host_ptr(buf, len)?;
        let dst = self.heap_range("received data", dst_offset, len as u64)?;
        // SAFETY: `dst` holds `len` bytes of the heap (checked above, and the frame against this
        // rank's data region); `src` holds `len` bytes of pinned memory.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.inn.cu_stream()).result() }.map_err(cuda)?;
        self.track(false, token)
    }
    fn write_flag(&mut self, token: u64, flag_offset: u64, value: u64) -> Result<(), TransportError> {
        self.bind()?;
        let dst = self.heap_range("flag", flag_offset, 8)?;
        if dst % 8 != 0 {
            return Err(TransportError::Copy(format!(
                "flag offset {flag_offset} is not 8-byte aligned"
            )));
        }
        // SAFETY: an aligned flag word of the heap (checked above, and the frame's flag offset
        // against the control area); stream order puts the store after every earlier copy into
        // the heap.
        unsafe { store_flag(dst, value, &self.inn) }?;
        self.track(false, token)
    }
    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        for q in [&mut self.out_pending, &mut self.in_pending] {
            while let Some((token, ev)) = q.front() {
                match ev.try_is_complete() {
                    Ok(true) => {
                        completed.push(*token);
                        if let Some((_, ev)) = q.pop_front() {
                            self.spare.push(ev);
                        }
                    }
                    Ok(false) => break,
                    Err(e) => return Err(cuda(e)),
                }
            }
        }
        Ok(())
    }
}

impl Drop for GpuStaging {
    fn drop(&mut self) {
        // Copies may still read or write the pinned buffers: wait for them before freeing.
        let _ = self.out.synchronize();
        let _ = self.inn.synchronize();
    }
}

/// The emulated wire's copy engine: `cuMemcpyDtoDAsync` from this rank's heap into the
/// destination's heap (mapped in this process), and the flag as a 4-byte `cuMemsetD32Async` on
/// the same stream after the data (flags are epochs below 2^32 whose high word stays 0).
/// Completion is tracked with one event per call.
pub struct GpuCopyEngine {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    bases: Vec<u64>,
    pending: VecDeque<(u64, CudaEvent)>,
    bound: bool,
}

// SAFETY: the engine is used by the proxy thread alone; it binds the context there.
unsafe impl Send for GpuCopyEngine {}

impl GpuCopyEngine {
    fn new(ctx: Arc<CudaContext>, bases: Vec<u64>) -> Result<GpuCopyEngine> {
        let stream = ctx.new_stream()?;
        Ok(GpuCopyEngine {
            ctx,
            stream,
            bases,
            pending: VecDeque::new(),
            bound: false,
        })
    }
    fn bind(&mut self) -> Result<(), TransportError> {
        bind_once(&self.ctx, &mut self.bound)
    }
    fn base(&self, rank: usize) -> Result<u64, TransportError> {
        self.bases
            .get(rank)
            .copied()
            .ok_or_else(|| TransportError::Copy(format!("rank {rank} has no mapped heap")))
    }
    fn track(&mut self, token: u64) -> Result<(), TransportError> {
        let ev = self.ctx.new_event(None).map_err(cuda)?;
        ev.record(&self.stream).map_err(cuda)?;
        self.pending.push_back((token, ev));
        Ok(())
    }
}

fn cuda(e: cudarc::driver::DriverError) -> TransportError {
    TransportError::Copy(e.to_string())
}

/// Binds `ctx` to the calling thread (the proxy's) on the first call; `bound` remembers it.
fn bind_once(ctx: &CudaContext, bound: &mut bool) -> Result<(), TransportError> {
    if !*bound {
        ctx.bind_to_thread().map_err(cuda)?;
        *bound = true;
    }
    Ok(())
}

impl CopyEngine for GpuCopyEngine {
    fn copy(
        &mut self,
        token: u64,
        src_rank: usize,
        src_offset: u64,
        dst_rank: usize,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), TransportError> {
        self.bind()?;
        let (src, dst) = (self.base(src_rank)? + src_offset, self.base(dst_rank)? + dst_offset);
        // SAFETY: the proxy validated both ranges against the heaps' sizes.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes as usize, self.stream.cu_stream()) }
            .map_err(cuda)?;
        self.track(token)
    }
    fn write_flag(&mut self, token: u64, dst_rank: usize, flag_offset: u64, value: u64) -> Result<(), TransportError> {
        self.bind()?;
        let dst = self.base(dst_rank)? + flag_offset;
        // SAFETY: the proxy validated the flag offset (8-aligned, inside the inter-node flag
        // region of the destination's heap); stream order puts it after the data copies issued
        // before it.
        unsafe { store_flag(dst, value, &self.stream) }?;
        self.track(token)
    }
    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        while let Some((token, ev)) = self.pending.front() {
            match ev.try_is_complete() {
                Ok(true) => {
                    completed.push(*token);
                    self.pending.pop_front();
                }
                Ok(false) => break,
                Err(e) => return Err(cuda(e)),
            }
        }
        Ok(())
    }
}
