//! Rank 0's store server: an accept thread and one thread per connection, all stopped and
//! joined when the [`StoreServer`] is dropped.
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::auth::{self, Handshake, JobKey};
use crate::error::{Error, Refusal, Result};
use crate::store::protocol::{self, Msg, MAX_FRAME, MAX_HANDSHAKE_FRAME, VERSION};
use crate::store::state::Shared;
use crate::sys;

/// How long a new connection may take to complete the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections beyond one per rank that may be open at once (handshakes in progress).
const SPARE_CONNECTIONS: usize = 128;
/// How long writing one reply may take before the client is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The store server of rank 0. Serves until dropped; dropping it lets replies already decided
/// go out (e.g. the last barrier's), then closes every connection and joins its threads.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    key: JobKey,
    refused: Arc<AtomicUsize>,
    /// Writing to (or closing) this wakes the accept thread to stop.
    stop: Option<UnixStream>,
    accept_thread: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on the first address of `bind` that works and serves a job of `world_size`
    /// ranks whose clients prove knowledge of `key`. Port 0 picks a free port
    /// ([`StoreServer::local_addr`] tells which).
    pub fn start(bind: impl ToSocketAddrs, world_size: usize, key: JobKey) -> Result<Self> {
        if world_size == 0 || world_size > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!("a store for {world_size} ranks")));
        }
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
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the store's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("setting up the store's listener", e))?;
        let (stop, stop_rx) = UnixStream::pair().map_err(|e| Error::io("creating the store's stop channel", e))?;
        let shared = Arc::new(Shared::new(world_size));
        let refused = Arc::new(AtomicUsize::new(0));
        let acceptor = Acceptor {
            listener,
            stop: stop_rx,
            shared: shared.clone(),
            key: key.clone(),
            refused: refused.clone(),
        };
        let accept_thread = std::thread::Builder::new()
            .name("mkernel-store".into())
            .spawn(move || acceptor.run())
            .map_err(|e| Error::io("starting the store's thread", e))?;
        Ok(StoreServer {
            addr,
            shared,
            key,
            refused,
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

    /// How many clients the store has refused (wrong key, duplicate or out-of-range rank).
    pub fn refused_clients(&self) -> usize {
        self.refused.load(Ordering::Relaxed)
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

/// The accept thread's state.
struct Acceptor {
    listener: TcpListener,
    stop: UnixStream,
    shared: Arc<Shared>,
    key: JobKey,
    refused: Arc<AtomicUsize>,
}

/// A connection thread, and a handle on its socket to close it at shutdown.
struct Connection {
    socket: TcpStream,
    thread: JoinHandle<()>,
}

impl Acceptor {
    fn run(self) {
        let mut connections: Vec<Connection> = Vec::new();
        loop {
            match sys::wait_readable(&[self.listener.as_fd(), self.stop.as_fd()], None) {
                Ok(Some(0)) => {}
                Ok(_) => break, // stop requested
                Err(e) => {
                    eprintln!("[mkernel-bootstrap] store: waiting for connections failed: {e}; stopping");
                    break;
                }
            }
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => continue,
                // Per-connection failures (the peer reset, too many files): keep serving.
                Err(e) => {
                    eprintln!("[mkernel-bootstrap] store: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            connections.retain(|c| !c.thread.is_finished());
            // Strangers stalling in the handshake must not exhaust threads; a rank turned
            // away here retries.
            if connections.len() >= self.shared.world_size() + SPARE_CONNECTIONS {
                continue;
            }
            let Ok(socket) = stream.try_clone() else {
                continue;
            };
            let (shared, key, refused) = (self.shared.clone(), self.key.clone(), self.refused.clone());
            let spawned = std::thread::Builder::new()
                .name("mkernel-store-conn".into())
                .spawn(move || serve_connection(stream, &shared, &key, &refused));
            match spawned {
                Ok(thread) => connections.push(Connection { socket, thread }),
                Err(e) => {
                    eprintln!("[mkernel-bootstrap] store: cannot start a connection thread: {e}")
                }
            }
        }
        // Waiters whose operation completed still answer; the others fail with "shutting down".
        self.shared.close();
        for c in &connections {
            // Unblocks a thread waiting for its next request; pending replies still go out.
            let _ = c.socket.shutdown(Shutdown::Read);
        }
        for c in connections {
            let _ = c.thread.join();
        }
    }
}

/// Why a handshake did not admit the client.
enum Rejected {
    /// A refusal to tell the client about.
    Refused(Refusal),
    /// The connection failed or spoke nonsense (a port scanner, a client that gave up).
    Broken,
}

fn serve_connection(stream: TcpStream, shared: &Shared, key: &JobKey, refused: &AtomicUsize) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    match handshake(&stream, shared, key) {
        Ok(rank) => {
            serve_requests(&stream, shared, rank);
            shared.unregister(rank);
        }
        Err(Rejected::Refused(reason)) => {
            // Counted and logged before the client hears of it.
            refused.fetch_add(1, Ordering::Relaxed);
            eprintln!("[mkernel-bootstrap] store: refused a client from {peer}: {reason}");
            // Best effort: the client learns why; its connection closes either way.
            let _ = protocol::write_msg(&stream, &Msg::Refused(reason));
        }
        Err(Rejected::Broken) => {}
    }
}

/// Challenges the client; on success the rank is registered and returned. A refusal is
/// returned for the caller to send.
fn handshake(stream: &TcpStream, shared: &Shared, key: &JobKey) -> Result<usize, Rejected> {
    let setup = || -> io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))
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
    let Ok(Msg::Auth {
        rank,
        world_size,
        nonce: client_nonce,
        proof,
    }) = protocol::read_msg(stream, MAX_HANDSHAKE_FRAME)
    else {
        return Err(Rejected::Broken);
    };
    let hs = Handshake {
        server_nonce,
        client_nonce,
        rank,
        world_size,
    };
    let refuse = Rejected::Refused;
    if !hs.client_proof_ok(key, &proof) {
        return Err(refuse(Refusal::WrongKey));
    }
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
    shared.register(rank).map_err(refuse)?;
    let welcomed = protocol::write_msg(
        stream,
        &Msg::Welcome {
            proof: hs.server_proof(key),
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
fn serve_requests(stream: &TcpStream, shared: &Shared, rank: usize) {
    // A read error (EOF, reset, shutdown) ends the connection.
    while let Ok(request) = protocol::read_msg(stream, MAX_FRAME) {
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
        if protocol::write_msg(stream, &reply).is_err() {
            return;
        }
    }
}
