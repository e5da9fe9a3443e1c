//! The RDMA backends wired into the communicator (`rdma` cargo feature): the heap registered
//! with the NIC, connection blobs exchanged through the bootstrap store.
//!
//! Written and compiled, never run: no machine with an RDMA NIC and a GPU was available
//! (docs/internode.md, "What has run where").
use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext, CudaStream};
use mkernel_bootstrap::Bootstrap;
use mkernel_config::comm::HEAP_CONTROL_BYTES;
use mkernel_proxy::backend::{BackendChoice, BackendKind};
use mkernel_proxy::efa::{FlagSink, SrdConfig, SrdEndpoint};
use mkernel_proxy::ibverbs::{BlobKind, ConnBlob, MemSource, NetSetup, RcConfig, RcEndpoint};
use mkernel_proxy::{Topology, Transport, TransportError};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

fn terr(e: TransportError) -> Error {
    Error::Proxy(e.to_string())
}

/// The heap as a dma-buf (`cuMemGetHandleForAddressRange`), or `None` where the driver cannot
/// export it (registration by address then needs nvidia-peermem).
fn heap_dmabuf(base: u64, bytes: u64) -> Option<OwnedFd> {
    let mut fd: i32 = -1;
    // SAFETY: out-pointer to an int; the range is this rank's own mapped heap.
    let r = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            base,
            bytes as usize,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS || fd < 0 {
        tracing::warn!(
            ?r,
            "cuMemGetHandleForAddressRange(DMA_BUF_FD) failed; registering the heap by address"
        );
        return None;
    }
    // SAFETY: a fresh descriptor owned by us.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens the chosen NIC, registers the heap (data: all of it; flags: its control area),
/// exchanges blobs with every proxy peer through the store and returns the transport.
#[allow(clippy::too_many_arguments)]
pub(super) fn connect(
    ctx: &Arc<CudaContext>,
    boot: &Bootstrap,
    choice: &BackendChoice,
    topology: Topology,
    heap_base: u64,
    heap_bytes: u64,
    bus_id: Option<String>,
    timeout: Duration,
) -> Result<Box<dyn Transport>> {
    use std::os::fd::AsRawFd;
    let fd = heap_dmabuf(heap_base, heap_bytes);
    let src = |len: u64| match &fd {
        Some(f) => MemSource::DmaBuf {
            fd: f.as_raw_fd(),
            offset: 0,
            len,
            addr: heap_base,
        },
        None => MemSource::Addr { addr: heap_base, len },
    };
    let rank = topology.rank();
    let mut setup = NetSetup::new(topology, src(heap_bytes), src(HEAP_CONTROL_BYTES), bus_id);
    if let Some(n) = &choice.nic {
        // The NIC the choice named (the same search, done once).
        setup.force_device = Some(format!("{}:{}", n.nic.name, n.port));
    }
    let store = boot.store();
    match choice.kind {
        BackendKind::IbverbsRc => {
            let mut ep = RcEndpoint::open(&setup, RcConfig::from_env().map_err(terr)?).map_err(terr)?;
            for p in ep.peers() {
                store.set(
                    &ConnBlob::store_key(BlobKind::Rc, rank, p),
                    &ep.local_blob(p).map_err(terr)?,
                )?;
            }
            for p in ep.peers() {
                let blob = store.get(&ConnBlob::store_key(BlobKind::Rc, p, rank), timeout)?;
                ep.connect(p, &blob).map_err(terr)?;
            }
            // Registration holds its own reference; the fd is not needed any more.
            drop(fd);
            Ok(Box::new(ep.into_transport().map_err(terr)?))
        }
        BackendKind::EfaSrd => {
            let mut ep = SrdEndpoint::open(&setup, SrdConfig::from_env().map_err(terr)?).map_err(terr)?;
            let peers = setup.topology.proxy_peers();
            for &p in &peers {
                store.set(
                    &ConnBlob::store_key(BlobKind::Srd, rank, p),
                    &ep.local_blob(p).map_err(terr)?,
                )?;
            }
            for &p in &peers {
                let blob = store.get(&ConnBlob::store_key(BlobKind::Srd, p, rank), timeout)?;
                ep.connect(p, &blob).map_err(terr)?;
            }
            drop(fd);
            let sink = GpuFlagSink::new(ctx.clone(), heap_base)?;
            Ok(Box::new(ep.into_transport(Box::new(sink)).map_err(terr)?))
        }
        k => Err(Error::Proxy(format!("{k} is not an RDMA backend"))),
    }
}

/// EFA's receiving side raises flags in this rank's heap: make the NIC's earlier writes visible
/// to the GPU (`cuFlushGPUDirectRDMAWrites`), then a 4-byte store, synchronously. Flags of one
/// word have one sender, whose signals the receive tracker raises in order, so a plain store
/// never lowers a flag.
struct GpuFlagSink {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    heap: u64,
    bound: bool,
}

// SAFETY: used by the proxy thread alone, which binds the context first.
unsafe impl Send for GpuFlagSink {}

impl GpuFlagSink {
    fn new(ctx: Arc<CudaContext>, heap: u64) -> Result<GpuFlagSink> {
        Ok(GpuFlagSink {
            stream: ctx.new_stream()?,
            ctx,
            heap,
            bound: false,
        })
    }
}

impl FlagSink for GpuFlagSink {
    fn raise(&mut self, flag_offset: u64, value: u64) -> Result<(), TransportError> {
        let cu = |e: cudarc::driver::DriverError| TransportError::Copy(e.to_string());
        if !self.bound {
            self.ctx.bind_to_thread().map_err(cu)?;
            self.bound = true;
        }
        if value >> 32 != 0 || flag_offset + 8 > HEAP_CONTROL_BYTES {
            return Err(TransportError::Copy(format!(
                "flag {flag_offset} = {value}: outside the control area or above 2^32"
            )));
        }
        // SAFETY: plain driver calls on this rank's own heap, checked above.
        unsafe {
            sys::cuFlushGPUDirectRDMAWrites(
                sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            )
            .result()
            .map_err(cu)?;
            sys::cuMemsetD32Async(self.heap + flag_offset, value as u32, 1, self.stream.cu_stream())
                .result()
                .map_err(cu)?;
        }
        self.stream.synchronize().map_err(cu)
    }
}
