//! The NCCL baseline through cudarc's raw bindings (bf16 reductions need `ncclBfloat16`, which
//! cudarc's safe layer does not expose). NVLink SHARP stays off: NCCL_NVLS_ENABLE=0 (set by
//! `xtask launch` for every rank, and by [`Nccl::new`] where a rank was started without it).
use anyhow::{bail, Result};
use cudarc::driver::{CudaStream, DevicePtr};
use cudarc::nccl::sys;
use mkernel::bootstrap::Bootstrap;
use std::time::Duration;

/// One NCCL communicator over the same ranks as ours.
pub struct Nccl {
    comm: sys::ncclComm_t,
}

fn ok(r: sys::ncclResult_t, what: &str) -> Result<()> {
    if r != sys::ncclResult_t::ncclSuccess {
        bail!("NCCL {what}: {r:?}");
    }
    Ok(())
}

impl Nccl {
    /// Rank 0 makes the unique id, the store carries it to the others.
    pub fn new(boot: &Bootstrap, rank: usize, world: usize) -> Result<Nccl> {
        // NCCL reads it at its first call (this one): a rank started by something other than
        // `xtask launch` (torchrun, a shell loop) gets NVLink SHARP off too. An explicit value wins.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        // SAFETY: plain C struct.
        let mut id: sys::ncclUniqueId = unsafe { std::mem::zeroed() };
        if rank == 0 {
            // SAFETY: out-pointer.
            ok(unsafe { sys::ncclGetUniqueId(&mut id) }, "get unique id")?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            boot.store().set("bench/nccl-id", &bytes)?;
        } else {
            let bytes = boot.store().get("bench/nccl-id", Duration::from_secs(60))?;
            for (d, s) in id.internal.iter_mut().zip(bytes) {
                *d = s as _;
            }
        }
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: out-pointer; id shared by all ranks.
        ok(
            unsafe { sys::ncclCommInitRank(&mut comm, world as i32, id, rank as i32) },
            "comm init",
        )?;
        Ok(Nccl { comm })
    }
    /// Point-to-point in one NCCL group (an all-to-all with any counts): every
    /// `(peer, device address, bytes)` of `sends` and `recvs` (zero-byte entries skipped).
    pub fn send_recv(
        &self,
        stream: &CudaStream,
        sends: &[(usize, u64, usize)],
        recvs: &[(usize, u64, usize)],
    ) -> Result<()> {
        // SAFETY: grouped calls on device buffers of the given sizes; the group is closed below.
        unsafe {
            ok(sys::ncclGroupStart(), "group start")?;
            for &(peer, ptr, bytes) in sends.iter().filter(|s| s.2 > 0) {
                let r = sys::ncclSend(
                    ptr as _,
                    bytes,
                    sys::ncclDataType_t::ncclUint8,
                    peer as i32,
                    self.comm,
                    stream.cu_stream() as _,
                );
                ok(r, "send")?;
            }
            for &(peer, ptr, bytes) in recvs.iter().filter(|s| s.2 > 0) {
                let r = sys::ncclRecv(
                    ptr as _,
                    bytes,
                    sys::ncclDataType_t::ncclUint8,
                    peer as i32,
                    self.comm,
                    stream.cu_stream() as _,
                );
                ok(r, "recv")?;
            }
            ok(sys::ncclGroupEnd(), "group end")
        }
    }
    /// One 16-byte exchange with each of `peers` (itself allowed), then a synchronize: NCCL
    /// connects a peer's point-to-point channels at the first send/recv to it (allocations, handle
    /// exchanges, its kernels' first launch). Called before any of our kernels runs, so that this
    /// happens while nothing of ours waits for a peer (or, across emulated nodes, for the proxy's
    /// CUDA calls in this context), not inside a timed baseline.
    pub fn connect_p2p(&self, stream: &std::sync::Arc<CudaStream>, peers: &[usize]) -> Result<()> {
        let buf = stream.alloc_zeros::<u8>(32 * peers.len().max(1))?;
        let p = buf.device_ptr(stream).0;
        let sends: Vec<_> = peers
            .iter()
            .enumerate()
            .map(|(i, &r)| (r, p + 32 * i as u64, 16))
            .collect();
        let recvs: Vec<_> = sends.iter().map(|&(r, a, n)| (r, a + 16, n)).collect();
        self.send_recv(stream, &sends, &recvs)?;
        stream.synchronize()?;
        Ok(())
    }
    pub fn all_gather(&self, stream: &CudaStream, src: u64, dst: u64, bytes_per_rank: usize) -> Result<()> {
        // SAFETY: device buffers of the given sizes.
        ok(
            unsafe {
                sys::ncclAllGather(
                    src as _,
                    dst as _,
                    bytes_per_rank,
                    sys::ncclDataType_t::ncclUint8,
                    self.comm,
                    stream.cu_stream() as _,
                )
            },
            "all_gather",
        )
    }
    pub fn reduce_scatter(&self, stream: &CudaStream, src: u64, dst: u64, count_per_rank: usize) -> Result<()> {
        self.bf16_sum(
            sys::ncclReduceScatter,
            "reduce_scatter",
            stream,
            src,
            dst,
            count_per_rank,
        )
    }
    pub fn all_reduce(&self, stream: &CudaStream, src: u64, dst: u64, count: usize) -> Result<()> {
        self.bf16_sum(sys::ncclAllReduce, "all_reduce", stream, src, dst, count)
    }
    /// A bf16 sum collective `f` (`count` elements: per rank for ReduceScatter, in all for
    /// AllReduce).
    fn bf16_sum(&self, f: Bf16Sum, what: &str, stream: &CudaStream, src: u64, dst: u64, count: usize) -> Result<()> {
        // SAFETY: device buffers of the given sizes.
        ok(
            unsafe {
                f(
                    src as _,
                    dst as _,
                    count,
                    sys::ncclDataType_t::ncclBfloat16,
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    stream.cu_stream() as _,
                )
            },
            what,
        )
    }
}

/// The signature `ncclAllReduce` and `ncclReduceScatter` share.
type Bf16Sum = unsafe fn(
    *const std::ffi::c_void,
    *mut std::ffi::c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclRedOp_t,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> sys::ncclResult_t;

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommInitRank.
        unsafe { sys::ncclCommDestroy(self.comm) };
    }
}
