//! One rank's connection to the store: connect with retries, prove the key, then one request
//! at a time.
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::auth::{self, Handshake, JobKey};
use crate::error::{secs, Error, Result};
use crate::store::protocol::{self, DeadlineReader, FrameError, Msg, MAX_FRAME, MAX_HANDSHAKE_FRAME, VERSION};
use crate::sys;

/// Longest single connect or handshake attempt; attempts repeat until the caller's deadline.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// How much longer than the operation's own timeout a client waits for the store's answer
/// (the store answers a timeout itself, naming the missing ranks).
const REPLY_GRACE: Duration = Duration::from_secs(10);

/// An authenticated connection to the store.
pub(crate) struct Client {
    stream: TcpStream,
    addr: String,
    /// Largest frame body sent or accepted ([`MAX_FRAME`]; tests lower it).
    max_frame: usize,
    /// Set after a failed request: the stream's state is unknown, so it is not used again.
    broken: Option<String>,
}

/// The outcome of one connection attempt.
enum Attempt {
    /// Worth retrying until the deadline (nothing listens yet, the connection dropped).
    Retry(String),
    /// Retrying would not help (refused, not a store, not our job's store).
    Fatal(Error),
}

impl Client {
    /// Connects to the store at `addr` (`host:port`) as `rank` of `world_size`, retrying until
    /// `timeout` while nothing answers there.
    pub fn connect(addr: &str, rank: usize, world_size: usize, key: &JobKey, timeout: Duration) -> Result<Self> {
        let (rank, world_size) = match (u32::try_from(rank), u32::try_from(world_size)) {
            (Ok(r), Ok(w)) => (r, w),
            _ => return Err(Error::InvalidArgument(format!("rank {rank} of {world_size}"))),
        };
        let deadline = sys::deadline(&format!("connecting to the store at {addr}"), timeout)?;
        let mut pause = Duration::from_millis(10);
        loop {
            let last_error = match attempt(addr, rank, world_size, key, deadline) {
                Ok(stream) => {
                    return Ok(Client {
                        stream,
                        addr: addr.to_string(),
                        max_frame: MAX_FRAME,
                        broken: None,
                    })
                }
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(why)) => why,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::StoreUnreachable {
                    addr: addr.to_string(),
                    waited: timeout,
                    last_error,
                });
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Lowers the frame limit (tests of the oversize paths without 256 MiB buffers).
    #[cfg(test)]
    pub fn set_max_frame(&mut self, max: usize) {
        self.max_frame = max;
    }

    /// Sends `request` and returns the store's reply, allowing `wait` (the operation's own
    /// timeout) plus a grace period for it. `op` names the operation in errors.
    pub fn request(&mut self, op: &str, request: &Msg, wait: Duration) -> Result<Msg> {
        if let Some(why) = &self.broken {
            return Err(Error::StoreLost {
                op: op.to_string(),
                detail: format!("the connection failed earlier: {why}"),
            });
        }
        let read_timeout = wait
            .checked_add(REPLY_GRACE)
            .filter(|t| Instant::now().checked_add(*t).is_some())
            .ok_or_else(|| Error::TimeoutTooLong {
                op: op.to_string(),
                timeout: wait,
            })?;
        // Too large to send: refused here, before anything is written (the connection stays usable).
        let sent = protocol::write_msg_max(&self.stream, request, self.max_frame);
        if let Err(Some(&FrameError::TooLarge { len, max })) = sent.as_ref().map_err(protocol::frame_error) {
            return Err(Error::TooLarge {
                op: op.to_string(),
                reply: false,
                bytes: len,
                max,
            });
        }
        let result = sent
            .and_then(|()| self.stream.set_read_timeout(Some(read_timeout)))
            .and_then(|()| protocol::read_msg(&self.stream, self.max_frame));
        if let Ok(Msg::TooLarge { bytes, max }) = result {
            return Err(Error::TooLarge {
                op: op.to_string(),
                reply: true,
                bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
                max: usize::try_from(max).unwrap_or(usize::MAX),
            });
        }
        result.map_err(|e| {
            let detail = match e.kind() {
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                    format!(
                        "the store at {} closed the connection (rank 0 exited or dropped its Store?)",
                        self.addr
                    )
                }
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                    "no answer from the store at {} within {}",
                    self.addr,
                    secs(read_timeout)
                ),
                io::ErrorKind::InvalidData => format!("malformed reply: {e}"),
                _ => e.to_string(),
            };
            self.broken = Some(detail.clone());
            Error::StoreLost {
                op: op.to_string(),
                detail,
            }
        })
    }
}

/// One attempt: resolve, connect, handshake.
fn attempt(addr: &str, rank: u32, world_size: u32, key: &JobKey, deadline: Instant) -> Result<TcpStream, Attempt> {
    let targets: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| Attempt::Retry(format!("cannot resolve {addr}: {e}")))?
        .collect();
    let mut last = format!("{addr} resolved to no address");
    for target in targets {
        let budget = sys::remaining(deadline).min(ATTEMPT_TIMEOUT);
        match TcpStream::connect_timeout(&target, budget) {
            Ok(stream) => return handshake(stream, addr, rank, world_size, key, deadline),
            Err(e) => last = format!("connecting to {target}: {e}"),
        }
    }
    Err(Attempt::Retry(last))
}

/// Answers the store's challenge and checks the store's proof.
fn handshake(
    stream: TcpStream,
    addr: &str,
    rank: u32,
    world_size: u32,
    key: &JobKey,
    deadline: Instant,
) -> Result<TcpStream, Attempt> {
    let io_retry = |what: &str, e: io::Error| match e.kind() {
        io::ErrorKind::InvalidData => Attempt::Fatal(Error::Protocol(format!(
            "the server at {addr} is not an mkernel bootstrap store: {e}"
        ))),
        _ => Attempt::Retry(format!("{what} {addr}: {e}")),
    };
    // One absolute deadline for the whole handshake: a server that trickles bytes cannot
    // stretch it.
    let hs_deadline = Instant::now() + sys::remaining(deadline).min(ATTEMPT_TIMEOUT);
    stream
        .set_nodelay(true)
        .and_then(|()| stream.set_write_timeout(Some(ATTEMPT_TIMEOUT)))
        .map_err(|e| io_retry("setting up the connection to", e))?;
    let mut reader = DeadlineReader::new(&stream, hs_deadline);
    let hello =
        protocol::read_msg(&mut reader, MAX_HANDSHAKE_FRAME).map_err(|e| io_retry("waiting for the greeting of", e))?;
    let Msg::Hello {
        version,
        nonce: server_nonce,
    } = hello
    else {
        return Err(Attempt::Fatal(Error::Protocol(format!(
            "the server at {addr} did not greet like a bootstrap store"
        ))));
    };
    if version != VERSION {
        return Err(Attempt::Fatal(Error::Protocol(format!(
            "the store at {addr} speaks protocol version {version}, this build speaks {VERSION}"
        ))));
    }
    let client_nonce = auth::nonce().map_err(Attempt::Fatal)?;
    let hs = Handshake {
        server_nonce,
        client_nonce,
        rank,
        world_size,
    };
    let auth = Msg::Auth {
        rank,
        world_size,
        nonce: client_nonce,
        proof: hs.client_proof(key),
    };
    protocol::write_msg(&stream, &auth).map_err(|e| io_retry("authenticating to", e))?;
    match protocol::read_msg(&mut reader, MAX_HANDSHAKE_FRAME) {
        Ok(Msg::Welcome { proof }) if hs.server_proof_ok(key, &proof) => Ok(stream),
        Ok(Msg::Welcome { .. }) => Err(Attempt::Fatal(Error::StoreNotAuthentic { addr: addr.to_string() })),
        Ok(Msg::Refused(reason)) if reason.is_transient() => Err(Attempt::Retry(format!("{addr} refused: {reason}"))),
        Ok(Msg::Refused(reason)) => Err(Attempt::Fatal(Error::Refused { reason })),
        Ok(other) => Err(Attempt::Fatal(Error::Protocol(format!(
            "unexpected handshake reply {other:?} from {addr}"
        )))),
        Err(e) => Err(io_retry("waiting for the verdict of", e)),
    }
}
