//! The job's key-value store over TCP: rank 0 hosts it at `MASTER_ADDR:MASTER_PORT`, every
//! rank (rank 0 included) talks to it through a [`Store`].
//!
//! Operations: [`Store::set`], [`Store::get`] (waits until set), [`Store::barrier`] and
//! [`Store::all_gather`]. Every waiting operation takes a timeout; its error names the ranks
//! that did not arrive, and fails early when one of them disconnects.
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::auth::JobKey;
use crate::env::RankInfo;
use crate::error::{Error, Result};

mod client;
pub(crate) mod protocol;
mod server;
mod state;

#[cfg(test)]
pub(crate) use server::Limits;

use client::Client;
use protocol::{GatherKind, Msg};
pub use server::StoreServer;

/// One rank's handle on the store. On rank 0 it also owns the [`StoreServer`], which stops
/// when the handle is dropped: let rank 0 drop it last (e.g. after a final barrier).
///
/// Methods take `&self` and may be called from several threads; requests go one at a time.
pub struct Store {
    // Dropped first: rank 0's own connection closes before its server stops.
    client: Mutex<Client>,
    rank: usize,
    world_size: usize,
    server: Option<StoreServer>,
}

impl Store {
    /// The store of `info`'s job: rank 0 starts the server on `MASTER_ADDR:MASTER_PORT` and
    /// connects to it; the other ranks connect, retrying until `timeout` while rank 0 is not
    /// up yet.
    pub fn for_rank(info: &RankInfo, timeout: Duration) -> Result<Self> {
        if info.hosts_store() {
            let listener = bind_store(info)?;
            let server = StoreServer::serve(listener, info.world_size(), info.job_key().clone())?;
            Self::host(server, timeout)
        } else {
            Self::connect(
                &info.store_addr(),
                info.rank(),
                info.world_size(),
                info.job_key(),
                timeout,
            )
        }
    }

    /// Connects to the store at `addr` (`host:port`) as `rank` of `world_size`, proving
    /// knowledge of `key`; retries until `timeout` while nothing answers at `addr`.
    pub fn connect(addr: &str, rank: usize, world_size: usize, key: &JobKey, timeout: Duration) -> Result<Self> {
        let client = Client::connect(addr, rank, world_size, key, timeout)?;
        Ok(Store {
            client: Mutex::new(client),
            rank,
            world_size,
            server: None,
        })
    }

    /// Rank 0's handle: connects to `server` as rank 0 and keeps the server alive as long as
    /// the handle.
    pub fn host(server: StoreServer, timeout: Duration) -> Result<Self> {
        let addr = loopback_if_unspecified(server.local_addr());
        let world_size = server.world_size();
        let client = Client::connect(&addr.to_string(), 0, world_size, server.key(), timeout)?;
        Ok(Store {
            client: Mutex::new(client),
            rank: 0,
            world_size,
            server: Some(server),
        })
    }

    /// This handle's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The job's world size.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The server, on rank 0.
    pub fn server(&self) -> Option<&StoreServer> {
        self.server.as_ref()
    }

    /// Sets `key` to `value` (replacing any earlier value) and wakes its getters.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let op = format!("set '{key}'");
        let reply = self.client().request(
            &op,
            &Msg::Set {
                key: key.into(),
                value: value.to_vec(),
            },
            Duration::ZERO,
        )?;
        expect_done(op, Duration::ZERO, reply)
    }

    /// `key`'s value, waiting up to `timeout` for some rank to set it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let op = format!("get '{key}'");
        let request = Msg::Get {
            key: key.into(),
            timeout_ms: millis(timeout),
        };
        match self.client().request(&op, &request, timeout)? {
            Msg::Value(v) => Ok(v),
            other => Err(failure(op, timeout, other)),
        }
    }

    /// Waits until every rank has called `barrier` with this `name`, at most `timeout`. Names
    /// are reusable: each completion starts the next round.
    pub fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        let op = format!("barrier '{name}'");
        let reply = self.gather(&op, GatherKind::Barrier, name, &[], timeout)?;
        expect_done(op, timeout, reply)
    }

    /// Every rank's `mine` for this `name`, indexed by rank, once all have called it (at most
    /// `timeout`). Names are reusable like barrier names.
    pub fn all_gather(&self, name: &str, mine: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let op = format!("all_gather '{name}'");
        match self.gather(&op, GatherKind::AllGather, name, mine, timeout)? {
            Msg::Gathered(all) if all.len() == self.world_size => Ok(all),
            Msg::Gathered(all) => Err(Error::Protocol(format!(
                "{op}: the store returned {} entries for {} ranks",
                all.len(),
                self.world_size
            ))),
            other => Err(failure(op, timeout, other)),
        }
    }

    fn gather(&self, op: &str, kind: GatherKind, name: &str, data: &[u8], timeout: Duration) -> Result<Msg> {
        let request = Msg::Gather {
            kind,
            name: name.into(),
            timeout_ms: millis(timeout),
            data: data.to_vec(),
        };
        self.client().request(op, &request, timeout)
    }

    /// Lowers the client's frame limit (tests of the oversize paths).
    #[cfg(test)]
    pub(crate) fn set_max_frame(&self, max: usize) {
        self.client().set_max_frame(max);
    }

    fn client(&self) -> MutexGuard<'_, Client> {
        // A panic while holding the lock leaves the client usable or marked broken.
        self.client.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

/// Binds `MASTER_ADDR:MASTER_PORT`. When that address is not one of this host's (behind NAT,
/// a name that resolves elsewhere), binds every interface on the port if
/// `MKERNEL_STORE_BIND_ALL=1` ([`RankInfo::store_bind_all`]) asks for it, else fails naming
/// that option: a store reachable from every network is a choice, not a fallback.
fn bind_store(info: &RankInfo) -> Result<TcpListener> {
    let addr = info.store_addr();
    let bind_err = |source: io::Error| Error::StoreBind {
        addr: addr.clone(),
        source,
    };
    let targets: Vec<SocketAddr> = addr.to_socket_addrs().map_err(bind_err)?.collect();
    let mut last = io::Error::new(io::ErrorKind::AddrNotAvailable, "no address");
    for target in &targets {
        match TcpListener::bind(target) {
            Ok(l) => return Ok(l),
            Err(e) => last = e,
        }
    }
    if last.kind() == io::ErrorKind::AddrNotAvailable && !info.store_bind_all() {
        return Err(bind_err(io::Error::new(
            io::ErrorKind::AddrNotAvailable,
            format!(
                "{} is not an address of this host; set {}=1 to listen on every interface \
                 (port {}) instead, or set MASTER_ADDR to this host's address",
                info.master_addr(),
                crate::vars::MKERNEL_STORE_BIND_ALL,
                info.master_port()
            ),
        )));
    }
    if last.kind() == io::ErrorKind::AddrNotAvailable {
        let any = match targets.first() {
            Some(SocketAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        };
        return TcpListener::bind((any, info.master_port())).map_err(bind_err);
    }
    Err(bind_err(last))
}

/// `127.0.0.1` (or `::1`) for a server bound to every interface.
fn loopback_if_unspecified(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port()),
        _ => addr,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn expect_done(op: String, timeout: Duration, reply: Msg) -> Result<()> {
    match reply {
        Msg::Done => Ok(()),
        other => Err(failure(op, timeout, other)),
    }
}

/// The error for a reply that is not the operation's success.
fn failure(op: String, timeout: Duration, reply: Msg) -> Error {
    match reply {
        Msg::TimedOut {
            missing,
            never_connected,
        } => Error::Timeout {
            op,
            after: timeout,
            missing: missing.into_iter().map(|r| r as usize).collect(),
            never_connected: never_connected.into_iter().map(|r| r as usize).collect(),
        },
        Msg::RanksLeft(ranks) => Error::RanksLeft {
            op,
            ranks: ranks.into_iter().map(|r| r as usize).collect(),
        },
        Msg::Failed(detail) => Error::StoreLost { op, detail },
        other => Error::Protocol(format!("{op}: unexpected reply {other:?}")),
    }
}

#[cfg(test)]
mod tests;
