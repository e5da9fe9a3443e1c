//! Connection setup of the TCP transport: which address to listen on, the exchange of
//! addresses and secrets through the job's store, and the authenticated hello on every socket.
use super::frame::{Hello, Refused, HELLO_BYTES, TOKEN_BYTES};
use super::mac::FrameKey;
use crate::error::TransportError;
use crate::topology::Topology;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Settings of the TCP transport (environment: [`TcpConfig::from_env`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Sockets per (sender, receiver) pair, 1..=16 (`MKERNEL_TCP_SOCKETS`, default 2).
    pub sockets: usize,
    /// Bytes of one staging buffer = largest frame payload (`MKERNEL_TCP_CHUNK_KIB`, default 512 KiB).
    pub chunk: usize,
    /// Receive buffers per socket (`MKERNEL_TCP_RX_BUFFERS`, default 4).
    pub rx_buffers: usize,
    /// Send staging buffers shared by all peers (`MKERNEL_TCP_TX_BUFFERS`, default 16).
    pub tx_buffers: usize,
    /// Listen on this interface's address (`MKERNEL_SOCKET_IFNAME`, e.g. `eth0`).
    pub ifname: Option<String>,
    /// Listen on this address (`MKERNEL_SOCKET_ADDR`; wins over the interface).
    pub addr: Option<IpAddr>,
    /// A peer that stays silent (unacknowledged data, failed keepalives) this long is dead;
    /// also the bound of `flush` (`MKERNEL_TCP_TIMEOUT_S`, default 30).
    pub timeout: Duration,
    /// Authenticate every frame with a tag keyed from the job key ([`super::mac`];
    /// `MKERNEL_TCP_MAC`, default on; every rank must use the same setting).
    pub mac: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            sockets: 2,
            chunk: 512 << 10,
            rx_buffers: 4,
            tx_buffers: 16,
            ifname: None,
            addr: None,
            timeout: Duration::from_secs(30),
            mac: true,
        }
    }
}

impl TcpConfig {
    /// Defaults changed by the `MKERNEL_TCP_*` / `MKERNEL_SOCKET_*` variables.
    pub fn from_env() -> Result<TcpConfig, TransportError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`from_env`](Self::from_env) with the variables given by `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<TcpConfig, TransportError> {
        let mut c = TcpConfig::default();
        let num = |k: &str, lo: u64, hi: u64| -> Result<Option<u64>, TransportError> {
            match get(k).filter(|v| !v.trim().is_empty()) {
                None => Ok(None),
                Some(v) => match v.trim().parse::<u64>() {
                    Ok(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                    _ => Err(TransportError::Config(format!(
                        "{k}={v:?}: expected a number in {lo}..={hi}"
                    ))),
                },
            }
        };
        if let Some(n) = num("MKERNEL_TCP_SOCKETS", 1, 16)? {
            c.sockets = n as usize;
        }
        if let Some(n) = num("MKERNEL_TCP_CHUNK_KIB", 4, 64 << 10)? {
            c.chunk = (n as usize) << 10;
        }
        if let Some(n) = num("MKERNEL_TCP_RX_BUFFERS", 1, 1024)? {
            c.rx_buffers = n as usize;
        }
        if let Some(n) = num("MKERNEL_TCP_TX_BUFFERS", 1, 4096)? {
            c.tx_buffers = n as usize;
        }
        if let Some(n) = num("MKERNEL_TCP_TIMEOUT_S", 1, 86_400)? {
            c.timeout = Duration::from_secs(n);
        }
        if let Some(n) = num("MKERNEL_TCP_MAC", 0, 1)? {
            c.mac = n == 1;
        }
        c.ifname = get("MKERNEL_SOCKET_IFNAME").filter(|v| !v.trim().is_empty());
        if let Some(a) = get("MKERNEL_SOCKET_ADDR").filter(|v| !v.trim().is_empty()) {
            c.addr = Some(
                a.trim()
                    .parse()
                    .map_err(|_| TransportError::Config(format!("MKERNEL_SOCKET_ADDR={a:?} is not an IP address")))?,
            );
        }
        Ok(c)
    }
}

/// The job's key-value store as the transport sees it (the host implements it for the
/// bootstrap store; the store itself is authenticated with the job key).
pub trait Exchange {
    /// Sets `key` to `value`.
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), String>;
    /// `key`'s value, waiting up to `timeout` for it to be set.
    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, String>;
    /// The secret that keys the frames' tags ([`TcpConfig::mac`]): the same on every rank of
    /// the job, known to nobody else, never sent (the host derives it from the job key).
    /// `None`: this exchange has none, and a transport with `mac` on refuses to start.
    fn frame_secret(&self) -> Option<[u8; 32]> {
        None
    }
}

/// Every IPv4 and global IPv6 address of every interface, as `(interface, address)`.
pub fn interface_addresses() -> Result<Vec<(String, IpAddr)>, TransportError> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: out-pointer; freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(TransportError::Config(format!(
            "getifaddrs: {}",
            std::io::Error::last_os_error()
        )));
    }
    let mut out = vec![];
    let mut p = head;
    while !p.is_null() {
        // SAFETY: a node of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: NUL-terminated interface name.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr points to a sockaddr of the family it names.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: family AF_INET means sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())
            }
            libc::AF_INET6 => {
                // SAFETY: family AF_INET6 means sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                if (ip.segments()[0] & 0xffc0) == 0xfe80 {
                    continue; // link-local needs a scope id; not published
                }
                IpAddr::V6(ip)
            }
            _ => continue,
        };
        out.push((name, ip));
    }
    // SAFETY: from getifaddrs.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The address to listen on and why: `MKERNEL_SOCKET_ADDR`, else the first address of
/// `MKERNEL_SOCKET_IFNAME` (IPv4 first), else the local address of the route to the store
/// (`MASTER_ADDR:MASTER_PORT`), else loopback.
pub fn choose_address(cfg: &TcpConfig, master: Option<&str>) -> Result<(IpAddr, String), TransportError> {
    if let Some(a) = cfg.addr {
        return Ok((a, format!("MKERNEL_SOCKET_ADDR={a}")));
    }
    if let Some(name) = &cfg.ifname {
        let all = interface_addresses()?;
        let mine: Vec<IpAddr> = all.iter().filter(|(n, _)| n == name).map(|(_, a)| *a).collect();
        return match mine.iter().find(|a| a.is_ipv4()).or(mine.first()) {
            Some(a) => Ok((*a, format!("MKERNEL_SOCKET_IFNAME={name}: {a}"))),
            None => {
                let mut names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
                names.dedup();
                Err(TransportError::Config(format!(
                    "MKERNEL_SOCKET_IFNAME={name}: no such interface with an address (have {names:?})"
                )))
            }
        };
    }
    if let Some(m) = master {
        let target = m
            .to_socket_addrs()
            .map_err(|e| TransportError::Config(format!("cannot resolve the store address {m}: {e}")))?
            .next()
            .ok_or_else(|| TransportError::Config(format!("the store address {m} resolves to nothing")))?;
        let bind: SocketAddr = if target.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        // A connected UDP socket sends nothing; its local address is the kernel's route choice.
        let s = UdpSocket::bind(bind).and_then(|s| s.connect(target).map(|_| s));
        let local = s.and_then(|s| s.local_addr()).map_err(|e| {
            TransportError::Config(format!(
                "no route to the store {m} to pick an interface ({e}); set MKERNEL_SOCKET_IFNAME"
            ))
        })?;
        return Ok((local.ip(), format!("the route to the store {m}: {}", local.ip())));
    }
    Ok((Ipv4Addr::LOCALHOST.into(), "no store address known: loopback".into()))
}

/// Sets `TCP_NODELAY`, keepalive and `TCP_USER_TIMEOUT` (a dead host becomes an error after
/// about `timeout` instead of a hang).
pub(crate) fn tune(s: &TcpStream, timeout: Duration) -> Result<(), TransportError> {
    s.set_nodelay(true).map_err(|e| io_err("TCP_NODELAY", e))?;
    let fd = s.as_raw_fd();
    let secs = timeout.as_secs().clamp(1, i32::MAX as u64 / 1000) as i32;
    let idle = (secs / 3).max(1);
    let opts: [(i32, i32, i32, &str); 5] = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1, "SO_KEEPALIVE"),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle, "TCP_KEEPIDLE"),
        (
            libc::IPPROTO_TCP,
            libc::TCP_KEEPINTVL,
            idle.clamp(1, 5),
            "TCP_KEEPINTVL",
        ),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3, "TCP_KEEPCNT"),
        (
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            secs * 1000,
            "TCP_USER_TIMEOUT",
        ),
    ];
    for (level, name, value, what) in opts {
        // SAFETY: valid socket, pointer to an int of the given size.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io_err(what, std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

fn io_err(what: &str, e: std::io::Error) -> TransportError {
    TransportError::Config(format!("{what}: {e}"))
}

fn random_token() -> Result<[u8; TOKEN_BYTES], TransportError> {
    let mut t = [0u8; TOKEN_BYTES];
    let mut got = 0;
    while got < t.len() {
        // SAFETY: writes at most the remaining bytes of `t`.
        let n = unsafe { libc::getrandom(t[got..].as_mut_ptr().cast(), t.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io_err("getrandom", e));
        }
        got += n as usize;
    }
    Ok(t)
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Store key under which `rank` publishes `"<ip:port> <hex token> mac=<0|1>"`.
pub fn store_key(rank: usize) -> String {
    format!("mkernel/proxy/tcp/{rank}")
}

/// A peer's published record.
#[derive(Clone, Debug)]
struct PeerRecord {
    addr: SocketAddr,
    token: [u8; TOKEN_BYTES],
    mac: bool,
}

fn parse_record(rank: usize, v: &[u8]) -> Result<PeerRecord, TransportError> {
    let bad = |why: &str| TransportError::Peer {
        peer: rank,
        detail: format!("bad TCP address record in the store ({why})"),
    };
    let s = std::str::from_utf8(v).map_err(|_| bad("not UTF-8"))?;
    let mut parts = s.split(' ');
    let (a, t, m) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(a), Some(t), Some(m), None) => (a, t, m),
        _ => return Err(bad("expected \"<address> <token> mac=<0|1>\"")),
    };
    let mac = match m {
        "mac=1" => true,
        "mac=0" => false,
        _ => return Err(bad("mac setting")),
    };
    let addr: SocketAddr = a.parse().map_err(|_| bad("address"))?;
    let t = unhex(t)
        .filter(|t| t.len() == TOKEN_BYTES)
        .ok_or_else(|| bad("token"))?;
    let mut token = [0u8; TOKEN_BYTES];
    token.copy_from_slice(&t);
    Ok(PeerRecord { addr, token, mac })
}

/// The sockets of one rank's TCP transport: `lanes` outgoing and `lanes` incoming sockets per
/// proxy peer, each authenticated by a hello carrying the receiver's secret.
pub struct TcpLinks {
    pub(crate) me: usize,
    pub(crate) world: usize,
    pub(crate) peers: Vec<usize>,
    pub(crate) lanes: usize,
    /// `tx[slot][lane]`: this rank writes.
    pub(crate) tx: Vec<Vec<TcpStream>>,
    /// `rx[slot][lane]`: this rank reads.
    pub(crate) rx: Vec<Vec<TcpStream>>,
    /// Largest payload each peer accepts.
    pub(crate) peer_payload: Vec<usize>,
    /// `tx_keys[slot][lane]`: the key of the frames this rank sends (`None`: no tags).
    pub(crate) tx_keys: Vec<Vec<Option<FrameKey>>>,
    /// `rx_keys[slot][lane]`: the key of the frames this rank receives.
    pub(crate) rx_keys: Vec<Vec<Option<FrameKey>>>,
    pub(crate) config: TcpConfig,
    local: SocketAddr,
    reason: String,
    refused: usize,
}

impl TcpLinks {
    /// Listens, publishes `"<addr> <token>"` under [`store_key`]`(rank)`, reads every proxy
    /// peer's record, then connects `sockets` sockets to each peer while accepting theirs.
    /// Connections whose hello does not carry this rank's secret, or that send no complete
    /// hello within [`HELLO_BOUND`] of their accept, are refused and logged (they neither end
    /// nor delay the setup: connections are served at once, at most [`MAX_PENDING`] waiting);
    /// everything else that goes wrong is an error naming the peer. Collective over the proxy
    /// peers; the whole setup ends by `timeout` (one that overflows the clock is an error).
    pub fn establish(
        topology: &Topology,
        config: &TcpConfig,
        exchange: &dyn Exchange,
        master: Option<&str>,
        timeout: Duration,
    ) -> Result<TcpLinks, TransportError> {
        if config.sockets == 0 || config.chunk == 0 || config.rx_buffers == 0 || config.tx_buffers == 0 {
            return Err(TransportError::Config(format!("{config:?}: counts must be positive")));
        }
        let deadline = Instant::now().checked_add(timeout).ok_or_else(|| {
            TransportError::Config(format!(
                "a TCP setup timeout of {timeout:?} is too long (its deadline overflows the clock)"
            ))
        })?;
        let me = topology.rank();
        let peers = topology.proxy_peers();
        let (ip, reason) = choose_address(config, master)?;
        let listener = TcpListener::bind((ip, 0)).map_err(|e| io_err(&format!("listening on {ip}"), e))?;
        let local = listener.local_addr().map_err(|e| io_err("local_addr", e))?;
        let token = random_token()?;
        let secret = match (config.mac, exchange.frame_secret()) {
            (false, _) => None,
            (true, Some(s)) => Some(s),
            (true, None) => {
                return Err(TransportError::Config(
                    "MKERNEL_TCP_MAC=1 (the default): per-frame tags need the job's frame secret, which this \
                     exchange does not give (Exchange::frame_secret); MKERNEL_TCP_MAC=0 on every rank runs \
                     without them"
                        .into(),
                ))
            }
        };
        let record = format!("{local} {} mac={}", hex(&token), u8::from(config.mac));
        exchange
            .publish(&store_key(me), record.as_bytes())
            .map_err(|e| TransportError::Config(format!("publishing the TCP address: {e}")))?;
        tracing::info!(rank = me, %local, %reason, sockets = config.sockets, "tcp transport listening");
        let mut records = Vec::with_capacity(peers.len());
        for &p in &peers {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = exchange.lookup(&store_key(p), left).map_err(|e| TransportError::Peer {
                peer: p,
                detail: format!("its TCP address never reached the store: {e}"),
            })?;
            let r = parse_record(p, &v)?;
            if r.mac != config.mac {
                return Err(TransportError::Peer {
                    peer: p,
                    detail: format!(
                        "it runs with MKERNEL_TCP_MAC={}, this rank {} with {}: set it the same on every rank",
                        u8::from(r.mac),
                        me,
                        u8::from(config.mac)
                    ),
                });
            }
            records.push(r);
        }
        let mut slot_of = vec![None; topology.world_size()];
        for (s, &p) in peers.iter().enumerate() {
            slot_of[p] = Some(s);
        }
        let lanes = config.sockets;
        let (accepted, connected) = std::thread::scope(|sc| {
            let acc = sc.spawn(|| accept_all(&listener, me, &slot_of, &peers, &token, config, deadline));
            let con = connect_all(me, &peers, &records, &token, config, deadline);
            (acc.join(), con)
        });
        let (rx, refused) = accepted.map_err(|_| TransportError::Config("the accept thread panicked".into()))??;
        let (tx, peer_payload) = connected?;
        let keys = |f: &dyn Fn(&[u8; 32], usize, usize) -> FrameKey| -> Vec<Vec<Option<FrameKey>>> {
            (0..peers.len())
                .map(|slot| {
                    (0..lanes)
                        .map(|lane| secret.as_ref().map(|s| f(s, slot, lane)))
                        .collect()
                })
                .collect()
        };
        let tx_keys = keys(&|s, slot, lane| FrameKey::derive(s, me, peers[slot], lane, &records[slot].token));
        let rx_keys = keys(&|s, slot, lane| FrameKey::derive(s, peers[slot], me, lane, &token));
        for s in tx.iter().chain(rx.iter()).flatten() {
            tune(s, config.timeout)?;
            s.set_nonblocking(true).map_err(|e| io_err("O_NONBLOCK", e))?;
        }
        Ok(TcpLinks {
            me,
            world: topology.world_size(),
            peers,
            lanes,
            tx,
            rx,
            peer_payload,
            tx_keys,
            rx_keys,
            config: config.clone(),
            local,
            reason,
            refused,
        })
    }

    /// The address this rank listened on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
    /// Why that address.
    pub fn address_reason(&self) -> &str {
        &self.reason
    }
    /// Connections closed during setup without being admitted: a bad hello or secret, no
    /// complete hello within [`HELLO_BOUND`], evicted past [`MAX_PENDING`], closed early.
    pub fn refused(&self) -> usize {
        self.refused
    }
    /// The proxy peers, in slot order.
    pub fn peers(&self) -> &[usize] {
        &self.peers
    }
    /// The key that tags this rank's frames on socket `lane` to `peer`, with per-frame
    /// authentication on (tests use it to play a misbehaving peer that has the job key).
    pub fn tx_key(&self, peer: usize, lane: usize) -> Option<&FrameKey> {
        let s = self.peers.iter().position(|&p| p == peer)?;
        self.tx_keys.get(s)?.get(lane)?.as_ref()
    }
    /// The outgoing socket `lane` to `peer` (tests use it to play a misbehaving peer).
    pub fn tx_socket(&mut self, peer: usize, lane: usize) -> Option<&mut TcpStream> {
        let s = self.peers.iter().position(|&p| p == peer)?;
        self.tx.get_mut(s)?.get_mut(lane)
    }
}

type Accepted = (Vec<Vec<TcpStream>>, usize);

/// Longest time from a connection's accept to its complete hello. One absolute deadline per
/// connection, set at the accept: a peer that sends a byte at a time cannot extend it. (A
/// rank sends its hello right after connecting; a few milliseconds are typical.)
pub const HELLO_BOUND: Duration = Duration::from_secs(5);
/// Accepted connections whose hello is not complete yet; when one more arrives the oldest is
/// closed, as the bootstrap store does with its handshakes. Ranks send their hello at once, so
/// only connections that stay silent are evicted.
pub const MAX_PENDING: usize = 64;

/// An accepted connection whose hello is still arriving.
struct Pending {
    sock: TcpStream,
    from: SocketAddr,
    /// Accept time + [`HELLO_BOUND`], or the setup's deadline if sooner.
    deadline: Instant,
    hello: [u8; HELLO_BYTES],
    got: usize,
}

/// Accepts every proxy peer's `lanes` sockets by `deadline`. All connections are served at
/// once without blocking: each must complete its hello by its own absolute deadline
/// ([`HELLO_BOUND`]), at most [`MAX_PENDING`] wait at a time (the oldest is evicted), and
/// connections without this rank's secret are refused and logged. Neither idle nor trickling
/// sockets delay the peers' connections.
fn accept_all(
    listener: &TcpListener,
    me: usize,
    slot_of: &[Option<usize>],
    peers: &[usize],
    token: &[u8; TOKEN_BYTES],
    cfg: &TcpConfig,
    deadline: Instant,
) -> Result<Accepted, TransportError> {
    let lanes = cfg.sockets;
    let mut rx: Vec<Vec<Option<TcpStream>>> = peers.iter().map(|_| (0..lanes).map(|_| None).collect()).collect();
    let mut missing = peers.len() * lanes;
    let mut refused = 0;
    let mut pending: std::collections::VecDeque<Pending> = std::collections::VecDeque::new();
    listener.set_nonblocking(true).map_err(|e| io_err("O_NONBLOCK", e))?;
    let refuse = |refused: &mut usize, from: SocketAddr, why: &str| {
        *refused += 1;
        tracing::warn!(rank = me, %from, %why, "tcp transport refused a connection");
    };
    while missing > 0 {
        let now = Instant::now();
        if now >= deadline {
            let absent: Vec<usize> = peers
                .iter()
                .zip(&rx)
                .filter(|(_, l)| l.iter().any(Option::is_none))
                .map(|(p, _)| *p)
                .collect();
            return Err(TransportError::Peer {
                peer: absent.first().copied().unwrap_or(usize::MAX),
                detail: format!("TCP setup timed out: ranks {absent:?} did not connect to rank {me}"),
            });
        }
        // Every connection waiting in the backlog.
        loop {
            match listener.accept() {
                Ok((s, from)) => {
                    if let Err(e) = s.set_nonblocking(true) {
                        refuse(&mut refused, from, &format!("O_NONBLOCK: {e}"));
                        continue;
                    }
                    if pending.len() >= MAX_PENDING {
                        if let Some(old) = pending.pop_front() {
                            refuse(&mut refused, old.from, "no hello yet; evicted for a newer connection");
                        }
                    }
                    pending.push_back(Pending {
                        sock: s,
                        from,
                        deadline: now.checked_add(HELLO_BOUND).map_or(deadline, |d| d.min(deadline)),
                        hello: [0; HELLO_BYTES],
                        got: 0,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // The connection went away before it was accepted, or a signal: go on.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted
                            | std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                    ) => {}
                Err(e) => return Err(io_err("accept", e)),
            }
        }
        // Whatever arrived on the pending connections; complete hellos are answered.
        let mut i = 0;
        while i < pending.len() {
            let p = &mut pending[i];
            let r = (&p.sock).read(&mut p.hello[p.got..]);
            let closed = match r {
                Ok(0) => Some("closed before its hello".to_string()),
                Ok(n) => {
                    p.got += n;
                    None
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    None
                }
                Err(e) => Some(e.to_string()),
            };
            if let Some(why) = closed {
                let p = pending.remove(i).expect("index in range");
                refuse(&mut refused, p.from, &why);
                continue;
            }
            if p.got == HELLO_BYTES {
                let p = pending.remove(i).expect("index in range");
                let Some((h, s)) = check_hello(p, me, token, &mut refused, &refuse) else {
                    continue;
                };
                let from_rank = h.from as usize;
                let slot = slot_of.get(from_rank).copied().flatten();
                let status = match slot {
                    None => Refused::NotPeer,
                    Some(_) if h.lanes as usize != lanes || h.lane as usize >= lanes => Refused::LaneCount,
                    Some(sl) if rx[sl][h.lane as usize].is_some() => Refused::Duplicate,
                    Some(_) => Refused::Ok,
                };
                let answer = Hello {
                    from: me as u32,
                    to: h.from,
                    lane: h.lane,
                    lanes: lanes as u32,
                    max_payload: cfg.chunk.min(u32::MAX as usize) as u32,
                    status: status as u32,
                    token: [0; TOKEN_BYTES],
                };
                // The answer proves nothing by itself: the connector checks that this socket is
                // the one it opened to the address it read from the store. 64 bytes into a new
                // socket's empty send buffer; bounded anyway.
                let _ = s
                    .set_nonblocking(false)
                    .and_then(|()| s.set_write_timeout(Some(HELLO_BOUND)))
                    .and_then(|()| (&s).write_all(&answer.to_bytes()));
                match (status, slot) {
                    (Refused::Ok, Some(sl)) => {
                        s.set_write_timeout(None).map_err(|e| io_err("SO_SNDTIMEO", e))?;
                        rx[sl][h.lane as usize] = Some(s);
                        missing -= 1;
                    }
                    _ => {
                        return Err(TransportError::Peer {
                            peer: from_rank,
                            detail: format!(
                                "refused its socket {} of {}: {status:?} (this rank uses {lanes} sockets per peer)",
                                h.lane, h.lanes
                            ),
                        })
                    }
                }
                continue;
            }
            if now >= p.deadline {
                let p = pending.remove(i).expect("index in range");
                let why = format!(
                    "no complete hello within {HELLO_BOUND:?} ({} of {HELLO_BYTES} bytes)",
                    p.got
                );
                refuse(&mut refused, p.from, &why);
                continue;
            }
            i += 1;
        }
        if missing > 0 {
            wait_readable(listener, &pending, deadline)?;
        }
    }
    let rx = rx
        .into_iter()
        .map(|l| l.into_iter().flatten().collect::<Vec<_>>())
        .collect::<Vec<_>>();
    if rx.iter().any(|l| l.len() != lanes) {
        return Err(TransportError::Config("TCP setup lost an accepted socket".into()));
    }
    Ok((rx, refused))
}

/// Parses a complete hello and checks that it is for this rank with its secret; on failure
/// counts and logs the refusal and closes the connection.
fn check_hello(
    p: Pending,
    me: usize,
    token: &[u8; TOKEN_BYTES],
    refused: &mut usize,
    refuse: &impl Fn(&mut usize, SocketAddr, &str),
) -> Option<(Hello, TcpStream)> {
    let h = match Hello::from_bytes(&p.hello) {
        Ok(h) => h,
        Err(e) => {
            refuse(refused, p.from, &e.to_string());
            return None;
        }
    };
    if h.to as usize != me || !ct_eq(&h.token, token) {
        let why = format!(
            "hello from rank {} for rank {} without this rank's secret",
            h.from, h.to
        );
        refuse(refused, p.from, &why);
        return None;
    }
    Some((h, p.sock))
}

/// Sleeps until the listener or a pending connection is readable, the nearest per-connection
/// deadline passes, or 50 ms (whichever is first; `deadline` bounds it too).
fn wait_readable(
    listener: &TcpListener,
    pending: &std::collections::VecDeque<Pending>,
    deadline: Instant,
) -> Result<(), TransportError> {
    let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
        .chain(pending.iter().map(|p| p.sock.as_raw_fd()))
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let wake = pending.iter().map(|p| p.deadline).fold(deadline, Instant::min);
    let ms = wake
        .saturating_duration_since(Instant::now())
        .min(Duration::from_millis(50))
        .as_micros()
        .div_ceil(1000) as libc::c_int;
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures of open descriptors.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(io_err("poll", e));
        }
    }
    Ok(())
}

/// `read_exact` that ends by `deadline` however the bytes trickle in (each read waits only for
/// what is left of it).
fn read_exact_by(s: &TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match (&*s).read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

type Connected = (Vec<Vec<TcpStream>>, Vec<usize>);

fn connect_all(
    me: usize,
    peers: &[usize],
    records: &[PeerRecord],
    _my_token: &[u8; TOKEN_BYTES],
    cfg: &TcpConfig,
    deadline: Instant,
) -> Result<Connected, TransportError> {
    let mut tx = Vec::with_capacity(peers.len());
    let mut payload = Vec::with_capacity(peers.len());
    for (&p, rec) in peers.iter().zip(records) {
        let mut lanes = Vec::with_capacity(cfg.sockets);
        let mut max_payload = cfg.chunk;
        for lane in 0..cfg.sockets {
            let peer_err = |detail: String| TransportError::Peer { peer: p, detail };
            let mut s = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match TcpStream::connect_timeout(
                    &rec.addr,
                    left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
                ) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => return Err(peer_err(format!("cannot connect socket {lane} to {}: {e}", rec.addr))),
                }
            };
            let hello = Hello {
                from: me as u32,
                to: p as u32,
                lane: lane as u32,
                lanes: cfg.sockets as u32,
                max_payload: 0,
                status: 0,
                token: rec.token,
            };
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            s.set_write_timeout(Some(left)).map_err(|e| io_err("SO_SNDTIMEO", e))?;
            s.write_all(&hello.to_bytes())
                .map_err(|e| peer_err(format!("sending the hello on socket {lane}: {e}")))?;
            let mut b = [0u8; HELLO_BYTES];
            read_exact_by(&s, &mut b, deadline.max(Instant::now() + Duration::from_millis(10))).map_err(|e| {
                peer_err(format!(
                    "no answer to the hello on socket {lane} ({e}): wrong address or secret?"
                ))
            })?;
            let a = Hello::from_bytes(&b).map_err(|e| peer_err(format!("answer on socket {lane}: {e}")))?;
            if a.from as usize != p || a.to as usize != me || a.lane as usize != lane {
                return Err(peer_err(format!(
                    "answer on socket {lane} is from rank {} for rank {} socket {}",
                    a.from, a.to, a.lane
                )));
            }
            if a.status != Refused::Ok as u32 {
                return Err(peer_err(format!(
                    "refused socket {lane} (status {}; it uses {} sockets per peer, this rank {})",
                    a.status, a.lanes, cfg.sockets
                )));
            }
            if a.max_payload == 0 {
                return Err(peer_err("accepts no payload".into()));
            }
            max_payload = max_payload.min(a.max_payload as usize);
            s.set_read_timeout(None)
                .and_then(|()| s.set_write_timeout(None))
                .map_err(|e| io_err("SO_RCVTIMEO", e))?;
            lanes.push(s);
        }
        tx.push(lanes);
        payload.push(max_payload);
    }
    Ok((tx, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn config_from_variables() {
        let m: HashMap<&str, &str> = [
            ("MKERNEL_TCP_SOCKETS", "4"),
            ("MKERNEL_TCP_CHUNK_KIB", "64"),
            ("MKERNEL_SOCKET_ADDR", "10.1.2.3"),
        ]
        .into();
        let c = TcpConfig::from_vars(|k| m.get(k).map(|s| s.to_string())).unwrap();
        assert_eq!(
            (c.sockets, c.chunk, c.addr),
            (4, 64 << 10, Some("10.1.2.3".parse().unwrap()))
        );
        assert!(TcpConfig::from_vars(|k| (k == "MKERNEL_TCP_SOCKETS").then(|| "0".into())).is_err());
        assert!(TcpConfig::from_vars(|k| (k == "MKERNEL_SOCKET_ADDR").then(|| "eth0".into())).is_err());
        assert!(
            !TcpConfig::from_vars(|k| (k == "MKERNEL_TCP_MAC").then(|| "0".into()))
                .unwrap()
                .mac
        );
        assert!(TcpConfig::from_vars(|k| (k == "MKERNEL_TCP_MAC").then(|| "on".into())).is_err());
        assert_eq!(TcpConfig::from_vars(|_| None).unwrap(), TcpConfig::default());
    }

    #[test]
    fn address_choice() {
        let c = TcpConfig::default();
        let (a, why) = choose_address(&c, Some("127.0.0.1:29500")).unwrap();
        assert_eq!(a, IpAddr::from([127, 0, 0, 1]), "{why}");
        let lo = TcpConfig {
            ifname: Some("lo".into()),
            ..TcpConfig::default()
        };
        assert_eq!(choose_address(&lo, None).unwrap().0, IpAddr::from([127, 0, 0, 1]));
        let none = TcpConfig {
            ifname: Some("nosuchif0".into()),
            ..TcpConfig::default()
        };
        let e = choose_address(&none, None).unwrap_err().to_string();
        assert!(e.contains("nosuchif0") && e.contains("lo"), "{e}");
    }

    #[test]
    fn records_round_trip_and_refuse_garbage() {
        let t = [9u8; 32];
        let r = parse_record(1, format!("127.0.0.1:5 {} mac=1", hex(&t)).as_bytes()).unwrap();
        assert_eq!((r.addr.port(), r.token, r.mac), (5, t, true));
        let r = parse_record(1, format!("127.0.0.1:5 {} mac=0", hex(&t)).as_bytes()).unwrap();
        assert!(!r.mac);
        assert!(parse_record(1, format!("127.0.0.1:5 {}", hex(&t)).as_bytes()).is_err());
        assert!(parse_record(1, format!("127.0.0.1:5 {} mac=2", hex(&t)).as_bytes()).is_err());
        assert!(parse_record(1, b"127.0.0.1:5").is_err());
        assert!(parse_record(1, b"127.0.0.1:5 abc mac=1").is_err());
        assert!(parse_record(1, b"x 00 mac=1")
            .unwrap_err()
            .to_string()
            .contains("peer 1"));
    }
}
