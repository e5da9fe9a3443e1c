//! The local ranks of one node, reachable through Unix sockets in the job directory: each rank
//! listens on `local<LOCAL_RANK>.sock` and sends descriptors to a peer by connecting to the
//! peer's socket (one connection per message, see [`crate::fdpass`]).
//!
//! Both ends check the other's uid with `SO_PEERCRED`: a sender only hands descriptors to a
//! process of its own user, a receiver only takes them from one.
use std::collections::VecDeque;
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::env::RankInfo;
use crate::error::{Error, Result};
use crate::fdpass::{self, Kind};
use crate::jobdir::JobDir;
use crate::sys;

/// Descriptors and a payload received from a local peer.
#[derive(Debug)]
pub struct FdMessage {
    /// The sender's local rank.
    pub from: usize,
    /// The sender's bytes (e.g. the size of the allocation behind the descriptors).
    pub payload: Vec<u8>,
    /// The descriptors, now owned by this process (close-on-exec).
    pub fds: Vec<OwnedFd>,
}

/// A message that arrived before it was asked for.
struct Early {
    kind: Kind,
    message: FdMessage,
}

/// This rank's endpoint among the local ranks of its node. Removes its socket on drop.
pub struct LocalPeers {
    dir: JobDir,
    listener: UnixListener,
    socket: PathBuf,
    local_rank: usize,
    local_world_size: usize,
    /// Global rank of local rank 0, to name ranks in errors.
    first_rank: usize,
    /// Rounds of [`LocalPeers::exchange`] done so far.
    round: u64,
    early: VecDeque<Early>,
}

impl LocalPeers {
    /// Listens on this rank's socket in the job directory of `info` ([`JobDir::for_rank`]).
    pub fn bind(info: &RankInfo) -> Result<Self> {
        let dir = JobDir::for_rank(info)?;
        let mut peers = Self::bind_in(dir, info.local_rank(), info.local_world_size())?;
        peers.first_rank = info.node_rank() * info.local_world_size();
        Ok(peers)
    }

    /// Listens on `dir.socket_path(local_rank)` as local rank `local_rank` of
    /// `local_world_size`. A stale socket left by a dead process is replaced; a live one is an
    /// error (two processes with the same `LOCAL_RANK`).
    pub fn bind_in(dir: JobDir, local_rank: usize, local_world_size: usize) -> Result<Self> {
        if local_rank >= local_world_size {
            return Err(Error::InvalidArgument(format!(
                "local rank {local_rank} is not below the local world size {local_world_size}"
            )));
        }
        let socket = dir.socket_path(local_rank);
        let listener = listen(&dir, &socket)?;
        Ok(LocalPeers {
            dir,
            listener,
            socket,
            local_rank,
            local_world_size,
            first_rank: 0,
            round: 0,
            early: VecDeque::new(),
        })
    }

    /// This rank's local rank.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of local ranks.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// This rank's socket.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// Sends `payload` and `fds` to local rank `to`, waiting up to `timeout` for its socket to
    /// appear. The peer gets its own copies of the descriptors; `fds` stay open here.
    pub fn send(&self, to: usize, payload: &[u8], fds: &[BorrowedFd<'_>], timeout: Duration) -> Result<()> {
        let deadline = sys::deadline(&format!("sending fds to local rank {to}"), timeout)?;
        self.send_kind(to, Kind::Direct, payload, fds, deadline, timeout)
    }

    /// Receives the next message that a peer sent with [`LocalPeers::send`], waiting up to
    /// `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> Result<FdMessage> {
        if let Some(i) = self.early.iter().position(|e| e.kind == Kind::Direct) {
            if let Some(early) = self.early.remove(i) {
                return Ok(early.message);
            }
        }
        let deadline = sys::deadline(&format!("receiving fds on local rank {}", self.local_rank), timeout)?;
        loop {
            match self.accept_one(deadline)? {
                None => {
                    return Err(Error::Timeout {
                        op: format!("receiving fds on local rank {}", self.local_rank),
                        after: timeout,
                        missing: vec![],
                        never_connected: vec![],
                    })
                }
                Some(Early {
                    kind: Kind::Direct,
                    message,
                }) => return Ok(message),
                Some(other) => self.early.push_back(other),
            }
        }
    }

    /// All-to-all among the local ranks: sends `payload` and `fds` to every local peer and
    /// returns what each sent, indexed by local rank (this rank's entry holds a copy of
    /// `payload` and duplicates of `fds`). Every local rank must call it, the same number of
    /// times; the timeout error names the ranks that did not send.
    pub fn exchange(&mut self, payload: &[u8], fds: &[BorrowedFd<'_>], timeout: Duration) -> Result<Vec<FdMessage>> {
        let deadline = sys::deadline(&format!("fd exchange #{}", self.round + 1), timeout)?;
        self.round += 1;
        let round = self.round;
        let kind = Kind::Exchange(round);
        let n = self.local_world_size;
        // Send first: a peer's socket takes the message before the peer accepts it, so no rank
        // waits on another's progress (only on its socket existing).
        for step in 1..n {
            let to = (self.local_rank + step) % n;
            self.send_kind(to, kind, payload, fds, deadline, timeout)?;
        }
        let mut got: Vec<Option<FdMessage>> = (0..n).map(|_| None).collect();
        let own = fds
            .iter()
            .map(|fd| fd.try_clone_to_owned())
            .collect::<io::Result<Vec<_>>>()
            .map_err(|e| Error::io("duplicating this rank's fds", e))?;
        got[self.local_rank] = Some(FdMessage {
            from: self.local_rank,
            payload: payload.to_vec(),
            fds: own,
        });
        // Messages of this round that arrived during an earlier call.
        let mut i = 0;
        while i < self.early.len() {
            if self.early[i].kind == kind {
                if let Some(e) = self.early.remove(i) {
                    self.place(&mut got, e.message, round)?;
                }
            } else {
                i += 1;
            }
        }
        while got.iter().any(Option::is_none) {
            match self.accept_one(deadline)? {
                None => {
                    let missing =
                        (0..n).filter(|&r| got[r].is_none()).map(|r| self.first_rank + r).collect();
                    return Err(Error::Timeout {
                        op: format!("fd exchange #{round}"),
                        after: timeout,
                        missing,
                        never_connected: vec![],
                    });
                }
                Some(Early { kind: k, message }) if k == kind => self.place(&mut got, message, round)?,
                Some(Early { kind: Kind::Exchange(r), message }) if r < round => {
                    return Err(Error::Protocol(format!(
                        "local rank {} sent for fd exchange #{r} during #{round} (ranks called exchange a different number of times?)",
                        message.from
                    )))
                }
                Some(other) => self.early.push_back(other),
            }
        }
        Ok(got.into_iter().flatten().collect())
    }

    /// [`LocalPeers::exchange`] of descriptors alone: every local rank exports its allocation
    /// as fds and gets every peer's, indexed by local rank.
    pub fn exchange_fds(&mut self, my_fds: &[BorrowedFd<'_>], timeout: Duration) -> Result<Vec<Vec<OwnedFd>>> {
        Ok(self
            .exchange(&[], my_fds, timeout)?
            .into_iter()
            .map(|m| m.fds)
            .collect())
    }

    fn place(&self, got: &mut [Option<FdMessage>], message: FdMessage, round: u64) -> Result<()> {
        let slot = &mut got[message.from];
        if slot.is_some() {
            return Err(Error::Protocol(format!(
                "local rank {} sent twice in fd exchange #{round} (two processes with the same LOCAL_RANK?)",
                message.from
            )));
        }
        *slot = Some(message);
        Ok(())
    }

    fn send_kind(
        &self,
        to: usize,
        kind: Kind,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<()> {
        if to >= self.local_world_size || to == self.local_rank {
            return Err(Error::InvalidArgument(format!(
                "cannot send to local rank {to} from local rank {} of {}",
                self.local_rank, self.local_world_size
            )));
        }
        let path = self.dir.socket_path(to);
        let stream = connect(&path, deadline).map_err(|e| match e {
            ConnectError::Timeout => Error::Timeout {
                op: format!("connecting to local rank {to} at {}", path.display()),
                after: timeout,
                missing: vec![self.first_rank + to],
                never_connected: vec![],
            },
            ConnectError::Io(e) => Error::io(format!("connecting to local rank {to} at {}", path.display()), e),
        })?;
        check_peer(&stream, &path)?;
        stream
            .set_write_timeout(Some(sys::remaining(deadline)))
            .and_then(|()| fdpass::send(&stream, kind, self.local_rank as u32, payload, fds))
            .map_err(|e| Error::io(format!("sending fds to local rank {to} at {}", path.display()), e))
    }

    /// Accepts one connection and reads its message; `None` when `deadline` passes first.
    /// Connections that close without a message are skipped.
    fn accept_one(&self, deadline: Instant) -> Result<Option<Early>> {
        loop {
            let ready = sys::wait_readable(&[self.listener.as_fd()], Some(deadline))
                .map_err(|e| Error::io(format!("waiting on {}", self.socket.display()), e))?;
            if ready.is_none() {
                return Ok(None);
            }
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => continue,
                Err(e) => return Err(Error::io(format!("accepting on {}", self.socket.display()), e)),
            };
            check_peer(&stream, &self.socket)?;
            let received = stream
                .set_nonblocking(false)
                .and_then(|()| stream.set_read_timeout(Some(sys::remaining(deadline))))
                .and_then(|()| fdpass::recv(&stream))
                .map_err(|e| Error::io(format!("receiving fds on {}", self.socket.display()), e))?;
            let Some((header, payload, fds)) = received else {
                continue;
            };
            let from = header.from as usize;
            if from >= self.local_world_size || from == self.local_rank {
                return Err(Error::Protocol(format!(
                    "fd message from local rank {from} on local rank {} of {}",
                    self.local_rank, self.local_world_size
                )));
            }
            return Ok(Some(Early {
                kind: header.kind,
                message: FdMessage { from, payload, fds },
            }));
        }
    }
}

impl std::fmt::Debug for LocalPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPeers")
            .field("socket", &self.socket)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("round", &self.round)
            .finish()
    }
}

impl Drop for LocalPeers {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.socket);
        // Succeeds only once every local rank has removed its socket.
        let _ = fs::remove_dir(self.dir.path());
    }
}

/// Binds `socket` in `dir`, replacing a stale socket file and re-creating the directory if a
/// peer's clean-up removed it meanwhile.
fn listen(dir: &JobDir, socket: &Path) -> Result<UnixListener> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        dir.ensure()?;
        remove_stale(socket)?;
        match UnixListener::bind(socket) {
            Ok(listener) => {
                fs::set_permissions(socket, fs::Permissions::from_mode(0o600))
                    .and_then(|()| listener.set_nonblocking(true))
                    .map_err(|e| Error::io(format!("setting up {}", socket.display()), e))?;
                return Ok(listener);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && attempts < 3 => continue,
            Err(e) => return Err(Error::io(format!("listening on {}", socket.display()), e)),
        }
    }
}

/// Removes `socket` if no live process listens on it.
fn remove_stale(socket: &Path) -> Result<()> {
    let meta = match fs::symlink_metadata(socket) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(format!("inspecting {}", socket.display()), e)),
    };
    if !meta.file_type().is_socket() {
        return Err(Error::job_dir(
            socket,
            "exists and is not a socket; refusing to replace it",
        ));
    }
    if UnixStream::connect(socket).is_ok() {
        return Err(Error::job_dir(
            socket,
            "a live process listens on it (two processes with the same LOCAL_RANK on this node?)",
        ));
    }
    match fs::remove_file(socket) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("removing the stale socket {}", socket.display()), e)),
    }
}

enum ConnectError {
    Timeout,
    Io(io::Error),
}

/// Connects to `path`, retrying while the peer has not bound it yet.
fn connect(path: &Path, deadline: Instant) -> Result<UnixStream, ConnectError> {
    let mut pause = Duration::from_millis(2);
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(ConnectError::Timeout);
                }
                std::thread::sleep(pause.min(deadline - now));
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) => return Err(ConnectError::Io(e)),
        }
    }
}

/// Refuses a peer that runs as another user.
fn check_peer(stream: &UnixStream, path: &Path) -> Result<()> {
    let peer_uid =
        sys::peer_uid(stream.as_fd()).map_err(|e| Error::io("reading the peer's credentials (SO_PEERCRED)", e))?;
    let own_uid = sys::euid();
    if peer_uid != own_uid {
        return Err(Error::ForeignPeer {
            path: path.to_path_buf(),
            peer_uid,
            own_uid,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{pipe, TempDir};
    use std::io::{Read, Write};
    use std::sync::{Arc, Barrier};

    const T: Duration = Duration::from_secs(10);

    /// Three local ranks (threads) each export the write end of a pipe; every rank writes
    /// through each received descriptor and the owner reads it back through its read end.
    #[test]
    fn three_local_ranks_exchange_pipes() {
        let tmp = TempDir::new("exchange");
        let dir = JobDir::open(tmp.path().join("job")).unwrap();
        let n = 3;
        let done = Arc::new(Barrier::new(n));
        let threads: Vec<_> = (0..n)
            .map(|r| {
                let dir = dir.clone();
                let done = done.clone();
                std::thread::spawn(move || {
                    let mut peers = LocalPeers::bind_in(dir, r, n).unwrap();
                    let (read_end, write_end) = pipe();
                    let all = peers.exchange_fds(&[write_end.as_fd()], T).unwrap();
                    assert_eq!(all.len(), n);
                    for (owner, fds) in all.into_iter().enumerate() {
                        assert_eq!(fds.len(), 1);
                        let msg = format!("{r}->{owner};");
                        std::fs::File::from(fds.into_iter().next().unwrap())
                            .write_all(msg.as_bytes())
                            .unwrap();
                    }
                    drop(write_end);
                    // Every rank has written and closed its copies.
                    done.wait();
                    let mut got = String::new();
                    std::fs::File::from(read_end).read_to_string(&mut got).unwrap();
                    let mut parts: Vec<&str> = got.split_terminator(';').collect();
                    parts.sort();
                    let want: Vec<String> = (0..n).map(|w| format!("{w}->{r}")).collect();
                    assert_eq!(parts, want);
                    // A second round with a payload, to check rounds do not mix.
                    let (_, w) = pipe();
                    let msgs = peers.exchange(format!("size{r}").as_bytes(), &[w.as_fd()], T).unwrap();
                    for (i, m) in msgs.iter().enumerate() {
                        assert_eq!(
                            (m.from, m.payload.clone(), m.fds.len()),
                            (i, format!("size{i}").into_bytes(), 1)
                        );
                    }
                    peers.socket_path().to_path_buf()
                })
            })
            .collect();
        for t in threads {
            let socket = t.join().unwrap();
            assert!(!socket.exists(), "socket removed on drop");
        }
    }

    /// `Duration::MAX` cannot be a deadline: an error naming the operation, not a panic.
    #[test]
    fn an_endless_timeout_is_an_error() {
        let tmp = TempDir::new("endless");
        let dir = JobDir::open(tmp.path().join("job")).unwrap();
        let mut a = LocalPeers::bind_in(dir.clone(), 0, 2).unwrap();
        let b = LocalPeers::bind_in(dir, 1, 2).unwrap();
        for e in [
            a.recv(Duration::MAX).unwrap_err(),
            b.send(0, b"", &[], Duration::MAX).unwrap_err(),
            a.exchange_fds(&[], Duration::MAX).unwrap_err(),
        ] {
            assert!(matches!(e, Error::TimeoutTooLong { .. }), "{e}");
            assert!(e.to_string().contains("too long"), "{e}");
        }
    }

    #[test]
    fn point_to_point_send_and_recv() {
        let tmp = TempDir::new("p2p");
        let dir = JobDir::open(tmp.path().join("job")).unwrap();
        let mut a = LocalPeers::bind_in(dir.clone(), 0, 2).unwrap();
        let b = LocalPeers::bind_in(dir, 1, 2).unwrap();
        let (r, w) = pipe();
        b.send(0, b"hi", &[r.as_fd()], T).unwrap();
        let m = a.recv(T).unwrap();
        assert_eq!((m.from, m.payload.as_slice(), m.fds.len()), (1, &b"hi"[..], 1));
        drop(w);
        assert!(b.send(1, b"", &[], T).is_err(), "sending to self is refused");
        let e = a.recv(Duration::from_millis(50)).unwrap_err().to_string();
        assert!(e.contains("timed out"), "{e}");
    }

    #[test]
    fn exchange_timeout_names_the_missing_rank() {
        let tmp = TempDir::new("missing");
        let dir = JobDir::open(tmp.path().join("job")).unwrap();
        let mut a = LocalPeers::bind_in(dir.clone(), 0, 3).unwrap();
        let _b = LocalPeers::bind_in(dir.clone(), 1, 3).unwrap();
        // Rank 2 never binds: sending to it times out and names it.
        let e = a.exchange_fds(&[], Duration::from_millis(200)).unwrap_err();
        assert!(matches!(&e, Error::Timeout { missing, .. } if missing == &[2]), "{e}");
        // With rank 2 bound but silent, the receive side names it (rank 1 did not call either).
        let _c = LocalPeers::bind_in(dir, 2, 3).unwrap();
        let e = a.exchange_fds(&[], Duration::from_millis(200)).unwrap_err();
        assert!(
            matches!(&e, Error::Timeout { missing, .. } if missing == &[1, 2]),
            "{e}"
        );
        assert!(e.to_string().contains("ranks [1, 2] did not arrive"), "{e}");
    }

    #[test]
    fn a_live_socket_is_not_taken_over_but_a_stale_one_is() {
        let tmp = TempDir::new("stale");
        let dir = JobDir::open(tmp.path().join("job")).unwrap();
        let a = LocalPeers::bind_in(dir.clone(), 0, 2).unwrap();
        // Keeps the directory (the last rank to leave removes it).
        let _b = LocalPeers::bind_in(dir.clone(), 1, 2).unwrap();
        let e = LocalPeers::bind_in(dir.clone(), 0, 2).err().unwrap().to_string();
        assert!(e.contains("same LOCAL_RANK"), "{e}");
        // A socket file without a listener (a crashed process) is replaced.
        let path = a.socket_path().to_path_buf();
        drop(a);
        let stale = UnixListener::bind(&path).unwrap();
        drop(stale);
        assert!(path.exists());
        LocalPeers::bind_in(dir, 0, 2).unwrap();
    }
}
