//! Thin safe wrappers over the few system calls std does not offer.
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Fills `buf` from the kernel's random source.
pub(crate) fn random_bytes(buf: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is a valid writable buffer of `rest.len()` bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("reading random bytes (getrandom)", e));
        }
        filled += n as usize;
    }
    Ok(())
}

/// This process's effective uid.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The uid of the process at the other end of a connected Unix socket (`SO_PEERCRED`).
pub(crate) fn peer_uid(socket: BorrowedFd<'_>) -> io::Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` holds the size of `cred`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Waits until one of `fds` is readable (or closed), or `deadline` passes (`None`: forever).
/// Returns the index of a ready descriptor, `None` on timeout.
pub(crate) fn wait_readable(fds: &[BorrowedFd<'_>], deadline: Option<Instant>) -> io::Result<Option<usize>> {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        let timeout_ms: libc::c_int = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                // Round up so that a wait never ends before the deadline.
                let ms = left.as_micros().div_ceil(1000);
                ms.min(i32::MAX as u128) as libc::c_int
            }
        };
        // SAFETY: `polls` is a valid array of `polls.len()` pollfd structures.
        let rc = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, timeout_ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if let Some(i) = polls.iter().position(|p| p.revents != 0) {
            return Ok(Some(i));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

/// `now + timeout`, or [`Error::TimeoutTooLong`] naming `op` when that overflows the clock.
pub(crate) fn deadline(op: &str, timeout: Duration) -> Result<Instant> {
    Instant::now()
        .checked_add(timeout)
        .ok_or_else(|| Error::TimeoutTooLong {
            op: op.to_string(),
            timeout,
        })
}

/// Time left until `deadline`, at least one millisecond (a zero socket timeout means "none").
pub(crate) fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}
