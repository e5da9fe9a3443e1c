//! Rank 0's store server: an accept thread and one thread per connection, all stopped and
//! joined when the [`StoreServer`] is dropped.
//!
//! Limits that keep strangers from starving the job's ranks (see `docs/bootstrap.md`):
//! - every handshake has an absolute deadline ([`Limits::handshake`]) from its accept, however
//!   steadily its bytes trickle in;
//! - at most [`Limits::max_pending`] connections may be in their handshake at once; a new one
//!   beyond that closes the oldest of them, so a crowd of stalled sockets cannot keep a rank's
//!   fresh connection out (and the rank retries if it was itself the oldest);
//! - authenticated connections do not count against that cap: their slots (one per rank) are
//!   reserved;
//! - a connection's socket is shut down when its thread ends, so a refused client sees the
//!   end of the stream at once, not when the accept thread next tidies up.
use std::collections::HashSet;
use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::auth::{self, Handshake, JobKey, Tag};
use crate::error::{Error, Refusal, Result};
use crate::store::protocol::{self, DeadlineReader, FrameError, Msg, MAX_FRAME, MAX_HANDSHAKE_FRAME, VERSION};
use crate::store::state::Shared;
use crate::sys;

/// How long writing one reply may take before the client is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a refused client gets to read why before its connection closes.
const LINGER: Duration = Duration::from_secs(1);
/// How often the accept thread wakes to reap finished connection threads.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// The server's limits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Deadline of a whole handshake, from the accept.
    pub handshake: Duration,
    /// Connections in their handshake at once; beyond it the oldest is closed.
    pub max_pending: usize,
    /// Largest frame body the server reads or writes after the handshake.
    pub max_frame: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake: Duration::from_secs(10),
            max_pending: 64,
            max_frame: MAX_FRAME,
        }
    }
}

/// What the server counts (for tests and diagnostics).
#[derive(Default)]
struct Counters {
    refused: AtomicUsize,
    evicted: AtomicUsize,
}

/// The store server of rank 0. Serves until dropped; dropping it lets replies already decided
/// go out (e.g. the last barrier's), then closes every connection and joins its threads.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    key: JobKey,
    counters: Arc<Counters>,
    /// Writing to (or closing) this wakes the accept thread to stop.
    stop: Option<UnixStream>,
    accept_thread: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on the first address of `bind` that works and serves a job of `world_size`
    /// ranks whose clients prove knowledge of `key`. Port 0 picks a free port
    /// ([`StoreServer::local_addr`] tells which).
    pub fn start(bind: impl ToSocketAddrs, world_size: usize, key: JobKey) -> Result<Self> {
        let addrs: Vec<SocketAddr> = bind
            .to_socket_addrs()
            .map_err(|e| Error::StoreBind {
                addr: "(unresolved)".into(),
                source: e,
            })?
            .collect();
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to bind");
        let listener = addrs
            .iter()
            .find_map(|a| TcpListener::bind(a).map_err(|e| last = e).ok());
        let listener = listener.ok_or_else(|| Error::StoreBind {
            addr: format!("{addrs:?}"),
            source: last,
        })?;
        Self::serve(listener, world_size, key)
    }

    /// Serves on an already bound `listener`.
    pub fn serve(listener: TcpListener, world_size: usize, key: JobKey) -> Result<Self> {
        Self::serve_with(listener, world_size, key, Limits::default())
    }

    /// Serves on `listener` with `limits`.
    pub(crate) fn serve_with(listener: TcpListener, world_size: usize, key: JobKey, limits: Limits) -> Result<Self> {
        if world_size == 0 || world_size > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!("a store for {world_size} ranks")));
        }
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the store's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("setting up the store's listener", e))?;
        let (stop, stop_rx) = UnixStream::pair().map_err(|e| Error::io("creating the store's stop channel", e))?;
        let shared = Arc::new(Shared::new(world_size));
        let counters = Arc::new(Counters::default());
        let acceptor = Acceptor {
            listener,
            stop: stop_rx,
            gate: Arc::new(Gate {
                shared: shared.clone(),
                key: key.clone(),
                limits,
                counters: counters.clone(),
                used_nonces: Mutex::new(HashSet::new()),
            }),
        };
        let accept_thread = std::thread::Builder::new()
            .name("mkernel-store".into())
            .spawn(move || acceptor.run())
            .map_err(|e| Error::io("starting the store's thread", e))?;
        Ok(StoreServer {
            addr,
            shared,
            key,
            counters,
            stop: Some(stop),
            accept_thread: Some(accept_thread),
        })
    }

    /// The address the store listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The job's world size.
    pub fn world_size(&self) -> usize {
        self.shared.world_size()
    }

    /// How many clients the store has refused (wrong key, duplicate or out-of-range rank,
    /// truncated, malformed, oversized, slow or replayed handshake).
    pub fn refused_clients(&self) -> usize {
        self.counters.refused.load(Ordering::Relaxed)
    }

    /// How many connections the store closed in their handshake to make room for newer ones.
    pub fn evicted_clients(&self) -> usize {
        self.counters.evicted.load(Ordering::Relaxed)
    }

    /// The job key (for rank 0's own client).
    pub(crate) fn key(&self) -> &JobKey {
        &self.key
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        // Closing our end of the pair makes it readable (EOF) for the accept thread.
        drop(self.stop.take());
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("world_size", &self.world_size())
            .finish()
    }
}

/// What every connection thread needs.
struct Gate {
    shared: Arc<Shared>,
    key: JobKey,
    limits: Limits,
    counters: Arc<Counters>,
    /// Client nonces of successful handshakes (one per admitted connection; only clients that
    /// know the key add to it).
    used_nonces: Mutex<HashSet<Tag>>,
}

/// The accept thread's state.
struct Acceptor {
    listener: TcpListener,
    stop: UnixStream,
    gate: Arc<Gate>,
}

/// Where a connection is: in its handshake, admitted, or closed by the accept thread.
const PENDING: u8 = 0;
const ADMITTED: u8 = 1;
const EVICTED: u8 = 2;

/// A connection thread, and a handle on its socket to close it (eviction, shutdown).
struct Connection {
    socket: TcpStream,
    state: Arc<AtomicU8>,
    accepted: Instant,
    thread: JoinHandle<()>,
}

impl Acceptor {
    fn run(self) {
        let mut connections: Vec<Connection> = Vec::new();
        loop {
            let wake = Instant::now() + REAP_EVERY;
            match sys::wait_readable(&[self.listener.as_fd(), self.stop.as_fd()], Some(wake)) {
                Ok(Some(0)) => {}
                Ok(None) => {
                    connections.retain(|c| !c.thread.is_finished());
                    continue;
                }
                Ok(_) => break, // stop requested
                Err(e) => {
                    tracing::error!("store: waiting for connections failed: {e}; stopping");
                    break;
                }
            }
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => continue,
                // Per-connection failures (the peer reset, too many files): keep serving.
                Err(e) => {
                    tracing::warn!("store: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            connections.retain(|c| !c.thread.is_finished());
            self.make_room(&connections);
            let Ok(socket) = stream.try_clone() else {
                continue;
            };
            let state = Arc::new(AtomicU8::new(PENDING));
            let accepted = Instant::now();
            let (gate, st) = (self.gate.clone(), state.clone());
            let spawned = std::thread::Builder::new()
                .name("mkernel-store-conn".into())
                .spawn(move || serve_connection(stream, accepted, &gate, &st));
            match spawned {
                Ok(thread) => connections.push(Connection {
                    socket,
                    state,
                    accepted,
                    thread,
                }),
                Err(e) => tracing::warn!("store: cannot start a connection thread: {e}"),
            }
        }
        // Waiters whose operation completed still answer; the others fail with "shutting down".
        self.gate.shared.close();
        for c in &connections {
            // Unblocks a thread waiting for its next request; pending replies still go out.
            let _ = c.socket.shutdown(Shutdown::Read);
        }
        for c in connections {
            let _ = c.thread.join();
        }
    }

    /// Closes the oldest connections still in their handshake until a new one fits under
    /// [`Limits::max_pending`].
    fn make_room(&self, connections: &[Connection]) {
        let mut pending: Vec<&Connection> = connections
            .iter()
            .filter(|c| c.state.load(Ordering::Acquire) == PENDING)
            .collect();
        if pending.len() < self.gate.limits.max_pending.max(1) {
            return;
        }
        pending.sort_by_key(|c| c.accepted);
        let excess = pending.len() + 1 - self.gate.limits.max_pending.max(1);
        let mut closed = 0;
        for c in pending {
            if closed == excess {
                break;
            }
            // A connection that just finished its handshake keeps its (reserved) slot.
            if c.state
                .compare_exchange(PENDING, EVICTED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                let _ = c.socket.shutdown(Shutdown::Both);
                self.gate.counters.evicted.fetch_add(1, Ordering::Relaxed);
                closed += 1;
            }
        }
        if closed > 0 {
            tracing::debug!("store: closed {closed} stalled handshake(s) to make room");
        }
    }
}

/// Why a handshake did not admit the client.
enum Rejected {
    /// A refusal to tell the client about.
    Refused(Refusal),
    /// The connection failed, was evicted, or closed before saying anything.
    Broken,
}

fn serve_connection(stream: TcpStream, accepted: Instant, gate: &Gate, state: &AtomicU8) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    match handshake(&stream, accepted, gate, state) {
        Ok(rank) => {
            serve_requests(&stream, &gate.shared, gate.limits.max_frame, rank);
            gate.shared.unregister(rank);
        }
        Err(Rejected::Refused(reason)) => {
            // Counted and logged before the client hears of it.
            gate.counters.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("store: refused a client from {peer}: {reason}");
            refuse(&stream, reason);
        }
        Err(Rejected::Broken) => {}
    }
    // The accept thread still holds a duplicate of the socket (to close it at shutdown): shut
    // it down here, so the client sees the end of the stream now.
    let _ = stream.shutdown(Shutdown::Both);
}

/// Tells a refused client why (best effort), then lets it read that before the close.
fn refuse(stream: &TcpStream, reason: Refusal) {
    let told = stream
        .set_write_timeout(Some(LINGER))
        .and_then(|()| protocol::write_msg(stream, &Msg::Refused(reason)))
        .and_then(|()| stream.shutdown(Shutdown::Write));
    if told.is_err() {
        return;
    }
    // Closing with unread input would reset the connection and could discard the refusal
    // before the client reads it: drain (bounded) until the client closes.
    let mut r = DeadlineReader::new(stream, Instant::now() + LINGER);
    let mut sink = [0u8; 4096];
    while r.read < 1 << 20 && matches!(r.read(&mut sink), Ok(n) if n > 0) {}
}

/// Challenges the client; on success the rank is registered and returned. A refusal is
/// returned for the caller to send.
fn handshake(stream: &TcpStream, accepted: Instant, gate: &Gate, state: &AtomicU8) -> Result<usize, Rejected> {
    let deadline = accepted + gate.limits.handshake;
    let evicted = || state.load(Ordering::Acquire) == EVICTED;
    let setup = || -> io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(gate.limits.handshake))
    };
    setup().map_err(|_| Rejected::Broken)?;
    let server_nonce = auth::nonce().map_err(|_| Rejected::Broken)?;
    protocol::write_msg(
        stream,
        &Msg::Hello {
            version: VERSION,
            nonce: server_nonce,
        },
    )
    .map_err(|_| Rejected::Broken)?;
    let mut reader = DeadlineReader::new(stream, deadline);
    let msg = protocol::read_msg(&mut reader, MAX_HANDSHAKE_FRAME);
    let refuse = Rejected::Refused;
    let (rank, world_size, client_nonce, proof) = match msg {
        Ok(Msg::Auth {
            rank,
            world_size,
            nonce,
            proof,
        }) => (rank, world_size, nonce, proof),
        Ok(_) => return Err(refuse(Refusal::Malformed)),
        Err(_) if evicted() => return Err(Rejected::Broken),
        Err(e) => {
            return Err(match (e.kind(), protocol::frame_error(&e)) {
                (_, Some(FrameError::TooLarge { len, max })) => refuse(Refusal::FrameTooLarge { len: *len, max: *max }),
                (_, Some(FrameError::Truncated)) => refuse(Refusal::Truncated),
                (_, Some(FrameError::Malformed(_))) => refuse(Refusal::Malformed),
                (io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock, _) => refuse(Refusal::HandshakeTimeout {
                    after: gate.limits.handshake,
                }),
                // The stream ended inside a frame.
                (io::ErrorKind::UnexpectedEof, _) if reader.read > 0 => refuse(Refusal::Truncated),
                _ => Rejected::Broken,
            });
        }
    };
    // A recorded `Auth` sent again: its proof is for another store nonce, so it would fail
    // below anyway; the nonce says what it is.
    let used = |n: &Tag| {
        gate.used_nonces
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(n)
    };
    if used(&client_nonce) {
        return Err(refuse(Refusal::Replayed));
    }
    let hs = Handshake {
        server_nonce,
        client_nonce,
        rank,
        world_size,
    };
    if !hs.client_proof_ok(&gate.key, &proof) {
        return Err(refuse(Refusal::WrongKey));
    }
    let shared = &gate.shared;
    let (rank, client_world) = (rank as usize, world_size as usize);
    if client_world != shared.world_size() {
        return Err(refuse(Refusal::WorldSizeMismatch {
            client: client_world,
            store: shared.world_size(),
        }));
    }
    if rank >= shared.world_size() {
        return Err(refuse(Refusal::RankOutOfRange {
            rank,
            world_size: shared.world_size(),
        }));
    }
    // From here the connection holds a rank's reserved slot, unless it was just evicted.
    if state
        .compare_exchange(PENDING, ADMITTED, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Err(Rejected::Broken);
    }
    if !gate
        .used_nonces
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(client_nonce)
    {
        return Err(refuse(Refusal::Replayed));
    }
    shared.register(rank).map_err(refuse)?;
    let welcomed = protocol::write_msg(
        stream,
        &Msg::Welcome {
            proof: hs.server_proof(&gate.key),
        },
    )
    .and_then(|()| stream.set_read_timeout(None))
    .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)));
    if welcomed.is_err() {
        shared.unregister(rank);
        return Err(Rejected::Broken);
    }
    Ok(rank)
}

/// Answers `rank`'s requests until its connection closes.
fn serve_requests(stream: &TcpStream, shared: &Shared, max_frame: usize, rank: usize) {
    // A read error (EOF, reset, shutdown, a frame over the limit) ends the connection.
    while let Ok(request) = protocol::read_msg(stream, max_frame) {
        let reply = match request {
            Msg::Set { key, value } => shared.set(key, value),
            Msg::Get { key, timeout_ms } => shared.get(&key, Duration::from_millis(timeout_ms)),
            Msg::Gather {
                kind,
                name,
                timeout_ms,
                data,
            } => shared.gather(rank, kind, name, data, Duration::from_millis(timeout_ms)),
            other => {
                let _ = protocol::write_msg(stream, &Msg::Failed(format!("unexpected request {other:?}")));
                return;
            }
        };
        let mut sent = protocol::write_msg_max(stream, &reply, max_frame);
        let too_large = match sent.as_ref().map_err(protocol::frame_error) {
            Err(Some(&FrameError::TooLarge { len, max })) => Some((len, max)),
            _ => None,
        };
        if let Some((len, max)) = too_large {
            // Nothing was written: say so in a frame that fits, and keep serving.
            tracing::warn!("store: a reply to rank {rank} of {len} bytes exceeds the {max}-byte frame limit");
            let m = Msg::TooLarge {
                bytes: len as u64,
                max: max as u64,
            };
            sent = protocol::write_msg(stream, &m);
        }
        if sent.is_err() {
            return;
        }
    }
}
