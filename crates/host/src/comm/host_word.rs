//! The host abort words: one page of host memory per local rank, shared by the node's processes
//! (a `memfd`, its descriptor passed like the heaps' over the job's Unix sockets), holding that
//! rank's abort word at offset 0. The owner registers its page for its GPU
//! (`cuMemHostRegister`, device-mapped), so its kernels read the word across PCIe
//! (`CommDesc::host_abort`); every local process maps every rank's page, so an abort is a plain
//! CPU store into each word: no stream, no GPU queue, no context needed (docs/protocol.md,
//! "Abort and reset").
//!
//! The memfd is sealed at its page size (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) before it
//! is shared, and a peer's descriptor is mapped only with those seals: no process holding it
//! can shrink the file under another's mapping (a store past the end raises SIGBUS).
use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

fn os(what: &'static str) -> Error {
    Error::Os {
        what,
        source: std::io::Error::last_os_error(),
    }
}

fn page_bytes() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// The seals of an abort word's memfd: its size is fixed, and so are the seals.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// One page of shared host memory, mapped read-write in this process.
pub(crate) struct SharedPage {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the page is only accessed through atomics (`word`).
unsafe impl Send for SharedPage {}
// SAFETY: as above.
unsafe impl Sync for SharedPage {}

impl SharedPage {
    /// A new zeroed page, and the descriptor that shares it (sealed at one page).
    pub(crate) fn create() -> Result<(SharedPage, OwnedFd)> {
        // SAFETY: a NUL-terminated name; the flags are valid.
        let fd = unsafe {
            libc::memfd_create(
                c"mkernel-abort-word".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(os("memfd_create for the host abort word"));
        }
        // SAFETY: a descriptor just returned to us, owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = page_bytes();
        // SAFETY: a valid descriptor; a new memfd reads as zeros.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os("ftruncate of the host abort word's page"));
        }
        // SAFETY: a valid memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(os("sealing the host abort word's memfd (F_ADD_SEALS)"));
        }
        let page = SharedPage::map(std::os::fd::AsFd::as_fd(&fd))?;
        Ok((page, fd))
    }

    /// Maps the page of `fd` (a peer's [`SharedPage::create`]); refuses a file without the
    /// seals [`SEALS`] or shorter than a page (a store past its end would raise SIGBUS).
    pub(crate) fn map(fd: BorrowedFd<'_>) -> Result<SharedPage> {
        let len = page_bytes();
        // SAFETY: a valid descriptor; F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS != SEALS {
            return Err(Error::Os {
                what: "a peer's host abort word page",
                source: std::io::Error::other(format!(
                    "not a memfd sealed against shrinking and growing (seals {seals:#x}, want {SEALS:#x})"
                )),
            });
        }
        // SAFETY: `st` is an out-parameter of the right type.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a stat buffer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os("fstat of a host abort word's page"));
        }
        if (st.st_size as u64) < len as u64 {
            return Err(Error::Os {
                what: "a peer's host abort word page",
                source: std::io::Error::other(format!("{} bytes, expected {len}", st.st_size)),
            });
        }
        // SAFETY: maps `len` bytes of the file, shared, at an address the kernel chooses.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os("mmap of a host abort word's page"));
        }
        Ok(SharedPage {
            ptr: NonNull::new(p as *mut u8).ok_or_else(|| os("mmap returned null"))?,
            len,
        })
    }

    /// The abort word (offset 0 of the page).
    pub(crate) fn word(&self) -> &AtomicU32 {
        // SAFETY: page aligned, mapped while `self` lives, only ever accessed atomically (the
        // GPU's accesses are single-copy atomic 4-byte loads).
        unsafe { &*(self.ptr.as_ptr() as *const AtomicU32) }
    }
}

impl Drop for SharedPage {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, not used past this point.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// This rank's own page, registered with the driver and mapped for the GPU.
pub(crate) struct RegisteredPage {
    page: SharedPage,
    device: u64,
    ctx: Arc<CudaContext>,
}

impl RegisteredPage {
    pub(crate) fn new(ctx: &Arc<CudaContext>, page: SharedPage) -> Result<RegisteredPage> {
        ctx.bind_to_thread()?;
        // SAFETY: a page-aligned mapping of whole pages that lives as long as the registration
        // (unregistered in drop, before the unmapping).
        unsafe {
            sys::cuMemHostRegister_v2(
                page.ptr.as_ptr() as *mut std::ffi::c_void,
                page.len,
                sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
            .result()?
        };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: registered with DEVICEMAP just above.
        let got = unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, page.ptr.as_ptr() as *mut std::ffi::c_void, 0).result()
        };
        if let Err(e) = got {
            // SAFETY: registered above.
            unsafe { sys::cuMemHostUnregister(page.ptr.as_ptr() as *mut std::ffi::c_void) };
            return Err(e.into());
        }
        Ok(RegisteredPage {
            page,
            device,
            ctx: ctx.clone(),
        })
    }

    /// The word's device address (`CommDesc::host_abort`).
    pub(crate) fn device_addr(&self) -> u64 {
        self.device
    }

    pub(crate) fn word(&self) -> &AtomicU32 {
        self.page.word()
    }
}

impl Drop for RegisteredPage {
    fn drop(&mut self) {
        // Best effort: the kernels that read the word ended (the communicator's drop
        // synchronized the context before its aborter can go).
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered in `new`.
        unsafe { sys::cuMemHostUnregister(self.page.ptr.as_ptr() as *mut std::ffi::c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_store_through_one_mapping_is_seen_through_another() {
        let (a, fd) = SharedPage::create().unwrap();
        let b = SharedPage::map(std::os::fd::AsFd::as_fd(&fd)).unwrap();
        assert_eq!(b.word().load(Ordering::Acquire), 0);
        a.word().store(0x8000_0003, Ordering::Release);
        assert_eq!(b.word().load(Ordering::Acquire), 0x8000_0003);
    }

    #[test]
    fn a_short_or_unsealed_file_is_refused() {
        // SAFETY: as in `create`.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(c"short".as_ptr(), libc::MFD_CLOEXEC)) };
        assert!(matches!(
            SharedPage::map(std::os::fd::AsFd::as_fd(&fd)),
            Err(Error::Os { .. })
        ));
        // SAFETY: as in `create`.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC)) };
        // SAFETY: a valid descriptor.
        let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), page_bytes() as libc::off_t) };
        assert_eq!(rc, 0);
        let e = SharedPage::map(std::os::fd::AsFd::as_fd(&fd))
            .err()
            .expect("mapped an unsealed memfd");
        assert!(e.to_string().contains("sealed"), "{e}");
    }

    /// The page cannot be shrunk (nor grown) by anyone holding its descriptor.
    #[test]
    fn the_page_is_sealed_at_its_size() {
        let (_page, fd) = SharedPage::create().unwrap();
        // SAFETY: a valid descriptor.
        let shrink = unsafe { libc::ftruncate(fd.as_raw_fd(), 0) };
        assert_ne!(shrink, 0, "the memfd shrank");
        // SAFETY: a valid descriptor.
        let grow = unsafe { libc::ftruncate(fd.as_raw_fd(), 2 * page_bytes() as libc::off_t) };
        assert_ne!(grow, 0, "the memfd grew");
        // SAFETY: a valid descriptor; F_SEAL_SEAL refuses any further seal.
        let more = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert_ne!(more, 0, "a seal was added");
    }
}
