//! Inter-node transport of a communicator: the host-mapped command FIFO the kernels post to,
//! the proxy thread that drains it (crates/proxy), and the emulated wire that carries its puts
//! between emulated nodes on one host (GPU copies into peers' heaps, the flag written after
//! the data on the same stream).
//!
//! Real NICs (ibverbs RC, EFA SRD) are implemented in crates/proxy but not wired here yet:
//! a job spanning real nodes gets [`Error::Unsupported`] from [`InterNode::new`].
use super::heap::{import_and_map, Mapping};
use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use mkernel_bootstrap::{Bootstrap, JobDir, LocalPeers};
use mkernel_config::comm::HEAP_CONTROL_BYTES;
use mkernel_proxy::emulated::{CopyEngine, EmulatedTransport, WireModel};
use mkernel_proxy::{Fifo, FifoConsumer, Proxy, ProxyConfig, RawFifo, Regions, Topology, TransportError, Validator};
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
}

// SAFETY: the raw FIFO pointer is only shared with the proxy thread through `RawFifo`.
unsafe impl Send for InterNode {}
unsafe impl Sync for InterNode {}

impl InterNode {
    /// Sets up the FIFO, maps every rank's heap over the host-wide fd exchange (emulated nodes
    /// only), and starts the proxy. Collective over all ranks of the job.
    pub fn new(
        ctx: &Arc<CudaContext>,
        boot: &Bootstrap,
        heap_fd: BorrowedFd<'_>,
        heap_bytes: u64,
        timeout: Duration,
    ) -> Result<InterNode> {
        let info = boot.info().clone();
        if info.emulated_nodes().is_none() {
            return Err(Error::Unsupported(
                "this job spans real nodes; the ibverbs RC / EFA SRD transports are implemented in mkernel-proxy but not wired into the communicator yet (emulated nodes only: `xtask launch --nodes K`)".into(),
            ));
        }
        let (rank, world) = (info.rank(), info.world_size());
        // 1. Host-wide fd exchange: all ranks of this host are one domain for the wire.
        let dir = if rank == 0 {
            let path = JobDir::for_rank(&info)?.path().with_extension("wire");
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
        let bases: Vec<u64> = mappings.iter().map(|m| m.va).collect();

        // 2. The FIFO in pinned host memory the GPU writes over PCIe.
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

        // 3. The proxy: validate against the heap, move data with GPU copies.
        let nnodes = info.nnodes();
        let topology = Topology::new(nnodes, info.local_world_size(), rank).map_err(proxy_err)?;
        let regions = Regions::symmetric(&topology, heap_bytes, HEAP_CONTROL_BYTES);
        let consumer =
            FifoConsumer::new(Fifo::new(raw).map_err(proxy_err)?, Validator::new(regions)).map_err(proxy_err)?;
        let engine = GpuCopyEngine::new(ctx.clone(), bases)?;
        let model = WireModel::from_env().map_err(|e| Error::Proxy(e.to_string()))?;
        let transport = EmulatedTransport::new(rank, engine, model);
        let proxy = Proxy::spawn(consumer, transport, ProxyConfig::default()).map_err(proxy_err)?;
        boot.store().barrier("mkernel/proxies-up", timeout)?;
        Ok(InterNode {
            proxy: Some(proxy),
            fifo,
            _mappings: mappings,
        })
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
            Some(rec) => Err(Error::Proxy(format!("{rec:?}"))),
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
        if !self.bound {
            self.ctx.bind_to_thread().map_err(cuda)?;
            self.bound = true;
        }
        Ok(())
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
        if value >> 32 != 0 {
            return Err(TransportError::Copy(format!(
                "flag value {value} does not fit the 4-byte store of the emulated wire"
            )));
        }
        let dst = self.base(dst_rank)? + flag_offset;
        // SAFETY: validated flag offset inside the destination's control area; stream order puts
        // it after the data copies issued before it.
        unsafe { sys::cuMemsetD32Async(dst, value as u32, 1, self.stream.cu_stream()).result() }.map_err(cuda)?;
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
