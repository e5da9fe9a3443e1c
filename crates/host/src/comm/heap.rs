//! The symmetric heap: one `cuMemCreate` allocation per rank, exported as a POSIX file
//! descriptor, passed to the local peers over the job's Unix socket (SCM_RIGHTS), imported and
//! mapped by every local rank (`cuMemMap` + `cuMemSetAccess`). A kernel then sees every local
//! peer's heap at an address of its own process: unicast NVLink loads and stores, no multicast.
use crate::error::{Error, Result};
use cudarc::driver::sys;
use mkernel_bootstrap::Bootstrap;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// One mapping of one rank's allocation into this process; unmapped and released on drop.
pub struct Mapping {
    pub va: u64,
    handle: sys::CUmemGenericAllocationHandle,
    bytes: u64,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: made by `map` with `self.bytes`; kernels using it have completed (owners
        // synchronize before dropping).
        unsafe {
            sys::cuMemUnmap(self.va, self.bytes as usize);
            sys::cuMemAddressFree(self.va, self.bytes as usize);
            sys::cuMemRelease(self.handle);
        }
    }
}

/// Imports an allocation exported by a peer (`cuMemImportFromShareableHandle`) and maps it
/// read-write for `device`.
pub fn import_and_map(fd: &OwnedFd, bytes: u64, device: i32) -> Result<Mapping> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: fd is a descriptor exported by cuMemExportToShareableHandle.
    unsafe {
        use std::os::fd::AsRawFd;
        sys::cuMemImportFromShareableHandle(
            &mut h,
            fd.as_raw_fd() as isize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        .result()?
    };
    let va = map(h, bytes, 1 << 21, device).inspect_err(|_| {
        // SAFETY: the imported handle is not mapped.
        unsafe { sys::cuMemRelease(h) };
    })?;
    Ok(Mapping { va, handle: h, bytes })
}

/// Every local rank's heap, mapped here. Index = local rank.
pub struct SymmetricHeap {
    bytes: u64,
    mappings: Vec<Mapping>,
    local_rank: usize,
    /// The exported handle of our own allocation (re-sent to the emulated wire's peers).
    own_fd: OwnedFd,
}

fn prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: plain C struct; zero is a valid start for every field.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    };
    // The RDMA backends register the heap with the NIC (dma-buf or nvidia-peermem), which a
    // cuMem allocation allows only when created GPUDirect-RDMA capable (NCCL sets the same flag
    // whenever the device supports it).
    if cfg!(feature = "rdma") {
        let mut ok = 0;
        // SAFETY: out-pointer to an int; `device` is an ordinal the caller opened.
        let r = unsafe {
            sys::cuDeviceGetAttribute(
                &mut ok,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                device,
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS && ok != 0 {
            p.allocFlags.gpuDirectRDMACapable = 1;
        }
    }
    p
}

impl SymmetricHeap {
    /// Allocates `bytes` (rounded up to the allocation granularity) on `device`, exchanges
    /// handles with the local ranks and maps all of them read-write for `device`.
    /// The caller's CUDA context must be current on this thread.
    pub fn new(device: i32, bytes: u64, boot: &mut Bootstrap, timeout: Duration) -> Result<SymmetricHeap> {
        let p = prop(device);
        let mut gran = 0usize;
        // SAFETY: out-pointer to a usize; valid prop.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
            .result()?
        };
        let gran = gran.max(1 << 21) as u64;
        let bytes = bytes.checked_next_multiple_of(gran).ok_or_else(|| Error::Shape {
            op: "symmetric heap",
            reason: format!("{bytes} bytes overflow 64 bits when rounded up to the granularity {gran}"),
        })?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer; valid prop.
        unsafe { sys::cuMemCreate(&mut handle, bytes as usize, &p, 0).result()? };
        let mut raw_fd: i32 = -1;
        // SAFETY: for POSIX fd handles the shareable handle is an int.
        let exported = unsafe {
            sys::cuMemExportToShareableHandle(
                &mut raw_fd as *mut i32 as *mut std::ffi::c_void,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
            .result()
        };
        if let Err(e) = exported {
            // SAFETY: the handle was created above and is not mapped.
            unsafe { sys::cuMemRelease(handle) };
            return Err(e.into());
        }
        // SAFETY: the driver returned a fresh descriptor that we now own.
        let own_fd = unsafe { OwnedFd::from_raw_fd(raw_fd) };
        let info = boot.info().clone();
        let local_rank = info.local_rank();
        // Until our own allocation is mapped (and then owned by its `Mapping`), release it on
        // every error path.
        let mut own_unmapped = Some(handle);
        let result = (|| {
            let fds = boot.exchange_fds(&[own_fd.as_fd()], timeout)?;
            let mut mappings = Vec::with_capacity(fds.len());
            for (peer, peer_fds) in fds.into_iter().enumerate() {
                if peer == local_rank {
                    let va = map(handle, bytes, gran, device)?;
                    own_unmapped = None;
                    mappings.push(Mapping { va, handle, bytes });
                } else {
                    let fd = peer_fds.into_iter().next().ok_or_else(|| Error::Shape {
                        op: "symmetric heap",
                        reason: format!("local rank {peer} sent no memory handle"),
                    })?;
                    mappings.push(import_and_map(&fd, bytes, device)?);
                }
            }
            Ok(mappings)
        })();
        match result {
            Ok(mappings) => Ok(SymmetricHeap {
                bytes,
                mappings,
                local_rank,
                own_fd,
            }),
            Err(e) => {
                if let Some(h) = own_unmapped {
                    // SAFETY: created above, never mapped; mapped peers were dropped with `result`.
                    unsafe { sys::cuMemRelease(h) };
                }
                Err(e)
            }
        }
    }

    /// Bytes of each rank's heap.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// Address of local rank `r`'s heap in this process (`None` outside `0..ranks()`).
    pub fn base(&self, r: usize) -> Option<u64> {
        self.mappings.get(r).map(|m| m.va)
    }
    /// Address of this rank's own heap (`new` mapped every local rank, this one included).
    pub fn local_base(&self) -> u64 {
        self.mappings[self.local_rank].va
    }
    /// Local ranks mapped.
    pub fn ranks(&self) -> usize {
        self.mappings.len()
    }
    /// The exported handle of this rank's allocation.
    pub fn own_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.own_fd.as_fd()
    }
}

fn map(h: sys::CUmemGenericAllocationHandle, bytes: u64, align: u64, device: i32) -> Result<u64> {
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: reserves address space only.
    unsafe { sys::cuMemAddressReserve(&mut va, bytes as usize, align as usize, 0, 0).result()? };
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: va was reserved for `bytes`; h is a live allocation of `bytes`.
    let mapped = unsafe {
        sys::cuMemMap(va, bytes as usize, 0, h, 0)
            .result()
            .and_then(|_| sys::cuMemSetAccess(va, bytes as usize, &access, 1).result())
    };
    if let Err(e) = mapped {
        // SAFETY: undo the reservation (and the mapping if it happened).
        unsafe {
            sys::cuMemUnmap(va, bytes as usize);
            sys::cuMemAddressFree(va, bytes as usize);
        }
        return Err(e.into());
    }
    Ok(va)
}
