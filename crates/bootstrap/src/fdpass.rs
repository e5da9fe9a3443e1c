//! File descriptors over a Unix stream socket (`SCM_RIGHTS`), with a small byte payload.
//!
//! One message per connection: a 32-byte header, then the payload. The descriptors ride on the
//! header's bytes, so the receiver's first `recvmsg` collects them all.
//!
//! ```text
//! header: magic "MKFD" | version u16 | kind u16 | from u32 | nfds u32 | round u64 | payload_len u32 | 0u32
//! ```
//! (little endian). Received descriptors are close-on-exec and owned by the caller.
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Most descriptors in one message (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;

/// Largest payload of one message.
pub const MAX_PAYLOAD: usize = 1 << 20;

const MAGIC: [u8; 4] = *b"MKFD";
const VERSION: u16 = 1;
const HEADER_LEN: usize = 32;

/// What a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A point-to-point message (`LocalPeers::send`).
    Direct,
    /// Round `n` of the all-to-all exchange.
    Exchange(u64),
}

/// The header of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    /// The sender's local rank.
    pub from: u32,
    pub nfds: u32,
    pub payload_len: u32,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let (kind, round) = match self.kind {
            Kind::Direct => (0u16, 0u64),
            Kind::Exchange(r) => (1, r),
        };
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&kind.to_le_bytes());
        h[8..12].copy_from_slice(&self.from.to_le_bytes());
        h[12..16].copy_from_slice(&self.nfds.to_le_bytes());
        h[16..24].copy_from_slice(&round.to_le_bytes());
        h[24..28].copy_from_slice(&self.payload_len.to_le_bytes());
        h
    }

    fn decode(h: &[u8; HEADER_LEN]) -> Result<Self, String> {
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        if h[0..4] != MAGIC {
            return Err("not an mkernel fd message (bad magic)".into());
        }
        if u16_at(4) != VERSION {
            return Err(format!(
                "fd message version {} (this build speaks {VERSION})",
                u16_at(4)
            ));
        }
        let round = u64::from(u32_at(16)) | (u64::from(u32_at(20)) << 32);
        let kind = match u16_at(6) {
            0 => Kind::Direct,
            1 => Kind::Exchange(round),
            k => return Err(format!("unknown fd message kind {k}")),
        };
        let header = Header {
            kind,
            from: u32_at(8),
            nfds: u32_at(12),
            payload_len: u32_at(24),
        };
        if header.nfds as usize > MAX_FDS || header.payload_len as usize > MAX_PAYLOAD {
            return Err(format!(
                "fd message too large ({} fds, {} bytes)",
                header.nfds, header.payload_len
            ));
        }
        Ok(header)
    }
}

/// Sends `header`, `payload` and `fds` on `stream` (blocking, under the stream's write timeout).
pub(crate) fn send(
    stream: &UnixStream,
    kind: Kind,
    from: u32,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    if fds.len() > MAX_FDS || payload.len() > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("at most {MAX_FDS} fds and {MAX_PAYLOAD} payload bytes per message"),
        ));
    }
    let header = Header {
        kind,
        from,
        nfds: fds.len() as u32,
        payload_len: payload.len() as u32,
    }
    .encode();
    let mut message = Vec::with_capacity(HEADER_LEN + payload.len());
    message.extend_from_slice(&header);
    message.extend_from_slice(payload);
    let sent = sendmsg_with_fds(stream.as_fd(), &message, fds)?;
    // A short send leaves the rest for plain writes; the descriptors went with the first bytes.
    let mut rest: &UnixStream = stream;
    rest.write_all(&message[sent..])
}

/// A received message: its header, payload and descriptors.
pub(crate) type Received = (Header, Vec<u8>, Vec<OwnedFd>);

/// Receives one message from `stream` (blocking, under the stream's read timeout).
/// `Ok(None)`: the peer closed the connection without sending anything.
pub(crate) fn recv(stream: &UnixStream) -> io::Result<Option<Received>> {
    let mut h = [0u8; HEADER_LEN];
    let (n, fds) = recvmsg_with_fds(stream.as_fd(), &mut h)?;
    if n == 0 {
        return Ok(None);
    }
    let mut reader: &UnixStream = stream;
    reader.read_exact(&mut h[n..])?;
    let header = Header::decode(&h).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    if fds.len() != header.nfds as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("fd message announced {} fds but carried {}", header.nfds, fds.len()),
        ));
    }
    let mut payload = vec![0u8; header.payload_len as usize];
    reader.read_exact(&mut payload)?;
    Ok(Some((header, payload, fds)))
}

/// Control buffer large enough for [`MAX_FDS`] descriptors, aligned for `cmsghdr`.
fn control_buffer() -> Vec<u64> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    vec![0u64; space.div_ceil(std::mem::size_of::<u64>())]
}

/// One `sendmsg` of `data` with `fds` attached; returns the bytes sent.
fn sendmsg_with_fds(socket: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut control = control_buffer();
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let fd_bytes = std::mem::size_of_val(fds);
        // SAFETY: CMSG_SPACE only computes a size; it fits `control` (sized for MAX_FDS).
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as _;
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: msg_control points at a zeroed, aligned buffer of at least msg_controllen
        // bytes, so CMSG_FIRSTHDR is non-null and its data area holds `fds.len()` descriptors.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: msg describes valid buffers that outlive the call.
        let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One `recvmsg` into `buf`; returns the bytes received and the descriptors that came with them.
fn recvmsg_with_fds(socket: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = control_buffer();
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = (control.len() * std::mem::size_of::<u64>()) as _;
    let n = loop {
        // SAFETY: msg describes valid buffers that outlive the call.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // Take ownership of every descriptor first, so that they are closed on any error below.
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of well-formed cmsgs;
    // CMSG_FIRSTHDR/CMSG_NXTHDR walk them within those bounds. Each SCM_RIGHTS descriptor is
    // new in this process and owned by nobody else.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let header = libc::CMSG_LEN(0) as usize;
                let count = ((*cmsg).cmsg_len as usize).saturating_sub(header) / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("more than {MAX_FDS} fds in one message"),
        ));
    }
    Ok((n, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::pipe;

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header {
            kind: Kind::Exchange(1 << 40 | 7),
            from: 3,
            nfds: 2,
            payload_len: 9,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Header::decode(&bad).is_err());
        let big = Header {
            nfds: MAX_FDS as u32 + 1,
            ..h
        };
        assert!(Header::decode(&big.encode()).is_err());
    }

    #[test]
    fn descriptors_and_payload_arrive() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r1, w1) = pipe();
        let (r2, w2) = pipe();
        send(&a, Kind::Direct, 4, b"hello", &[w1.as_fd(), w2.as_fd()]).unwrap();
        // Only the received copies of the write ends remain.
        drop((w1, w2));
        let (header, payload, fds) = recv(&b).unwrap().unwrap();
        assert_eq!(
            (header.kind, header.from, payload.as_slice()),
            (Kind::Direct, 4, &b"hello"[..])
        );
        assert_eq!(fds.len(), 2);
        for (i, (fd, read_end)) in fds.into_iter().zip([r1, r2]).enumerate() {
            std::fs::File::from(fd)
                .write_all(format!("via fd {i}").as_bytes())
                .unwrap();
            let mut got = String::new();
            std::fs::File::from(read_end).read_to_string(&mut got).unwrap();
            assert_eq!(got, format!("via fd {i}"));
        }
        drop(a);
        assert!(recv(&b).unwrap().is_none());
    }

    #[test]
    fn too_many_descriptors_are_refused_before_sending() {
        let (a, _b) = UnixStream::pair().unwrap();
        let (_r, w) = pipe();
        let fds = vec![w.as_fd(); MAX_FDS + 1];
        assert_eq!(
            send(&a, Kind::Direct, 0, b"", &fds).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
