//! The TCP transport with CPU threads playing the GPUs (as `end_to_end.rs` does for the emulated
//! wire): ranks as threads over loopback, ranks as processes over loopback and over a veth pair
//! between two network namespaces this test creates, a killed peer, bad peer messages.
//!
//! The namespace test needs root (or CAP_NET_ADMIN) and `ip` (iproute2); without them it prints
//! `SKIPPED` and passes. Addresses: 127.0.0.1 and 10.231.x.{1,2} inside the test's own namespaces.
use mkernel_bootstrap::{Bootstrap, JobKey, Store, StoreServer};
use mkernel_proxy::emulated::CpuFabric;
use mkernel_proxy::protocol::CommandBody;
use mkernel_proxy::tcp::{frame, store_key, CpuStaging, Exchange, TcpConfig, TcpLinks, TcpTransport, MAX_PENDING};
use mkernel_proxy::Span;
use mkernel_proxy::{
    AbortLink, AbortState, Backoff, ErrorCode, Fifo, FifoConsumer, FifoProducer, HeapFifo, PeerRegions, Proxy,
    ProxyConfig, ProxyError, Regions, Topology, Validator,
};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);
const HEADER: usize = frame::HEADER_BYTES;
/// A dead peer must be reported within this long (the socket closes at once when a process dies).
const DEAD_PEER_BOUND: Duration = Duration::from_secs(5);

/// The job's store inside one process.
type Table = (Mutex<HashMap<String, Vec<u8>>>, Condvar);

#[derive(Clone, Default)]
struct MemStore(Arc<Table>);

impl Exchange for MemStore {
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), String> {
        self.0 .0.lock().unwrap().insert(key.into(), value.to_vec());
        self.0 .1.notify_all();
        Ok(())
    }
    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, String> {
        let t0 = Instant::now();
        let mut m = self.0 .0.lock().unwrap();
        loop {
            if let Some(v) = m.get(key) {
                return Ok(v.clone());
            }
            let left = timeout.checked_sub(t0.elapsed()).ok_or("timed out")?;
            m = self.0 .1.wait_timeout(m, left).unwrap().0;
        }
    }
    fn frame_secret(&self) -> Option<[u8; 32]> {
        Some([0x5a; 32])
    }
}

/// The bootstrap store (its own TCP server on rank 0) as the transport's exchange, with the
/// frame secret derived from the job key as the host derives it.
struct BootStore<'a>(&'a Store, [u8; 32]);

impl Exchange for BootStore<'_> {
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), String> {
        self.0.set(key, value).map_err(|e| e.to_string())
    }
    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, String> {
        self.0.get(key, timeout).map_err(|e| e.to_string())
    }
    fn frame_secret(&self) -> Option<[u8; 32]> {
        Some(self.1)
    }
}

fn config(sockets: usize, chunk: usize) -> TcpConfig {
    TcpConfig {
        sockets,
        chunk,
        rx_buffers: 2,
        tx_buffers: 4,
        ..TcpConfig::default()
    }
}

/// One rank: its FIFO, the producer playing its GPU, its proxy over TCP.
struct RankSide {
    topo: Topology,
    fifo: Fifo<HeapFifo>,
    producer: FifoProducer<HeapFifo>,
    proxy: Option<Proxy>,
}

fn start_rank(topo: Topology, fabric: &Arc<CpuFabric>, links: TcpLinks) -> RankSide {
    start_rank_in(topo, fabric, links, None)
}

/// [`start_rank`] whose transport lets peers write only inside `own` (default: all of it).
fn start_rank_in(topo: Topology, fabric: &Arc<CpuFabric>, links: TcpLinks, own: Option<PeerRegions>) -> RankSide {
    start_rank_with(topo, fabric, links, own, None)
}

/// [`start_rank_in`] whose proxy carries user aborts through `abort`.
fn start_rank_with(
    topo: Topology,
    fabric: &Arc<CpuFabric>,
    links: TcpLinks,
    own: Option<PeerRegions>,
    abort: Option<Arc<AbortLink>>,
) -> RankSide {
    let r = topo.rank();
    let fifo = Fifo::new(HeapFifo::new(16, r as u32).unwrap()).unwrap();
    let regions = Regions::symmetric(&topo, fabric.data_bytes(), fabric.flag_bytes());
    let consumer = FifoConsumer::new(fifo.clone(), Validator::new(regions)).unwrap();
    let staging = CpuStaging::new(fabric.clone(), r);
    let transport = match own {
        Some(own) => TcpTransport::with_regions(links, staging, own),
        None => TcpTransport::new(links, staging, fabric.data_bytes(), fabric.flag_bytes()),
    }
    .unwrap();
    let proxy = Proxy::spawn(
        consumer,
        transport,
        ProxyConfig {
            backoff: Backoff::gentle(),
            abort,
            ..ProxyConfig::default()
        },
    )
    .unwrap();
    RankSide {
        topo,
        producer: FifoProducer::new(fifo.clone()),
        fifo,
        proxy: Some(proxy),
    }
}

fn pattern(from: usize, to: usize, epoch: u64, j: u64) -> u8 {
    (from as u64 * 31 + to as u64 * 7 + epoch * 13 + j * 5 + (j >> 9)) as u8
}

/// Every rank puts a block of `block` bytes to every remote rank each epoch and checks theirs
/// (double-buffered by epoch parity as in end_to_end.rs); one put per epoch also goes as
/// flagless pieces followed by a SIGNAL. Region: [parity 0 | parity 1 | sources], each
/// `world` blocks.
fn all_to_all(side: &RankSide, fabric: &CpuFabric, world: usize, block: u64, epochs: u64) {
    let r = side.topo.rank();
    let p = &side.producer;
    let peers = side.topo.proxy_peers();
    let mut last = None;
    for e in 1..=epochs {
        if let Some(s) = last {
            p.wait_done(s + 1).unwrap();
        }
        let parity = e % 2;
        for &d in &peers {
            let data: Vec<u8> = (0..block).map(|j| pattern(r, d, e, j)).collect();
            let src = (2 * world + d) as u64 * block;
            fabric.write(r, src, &data).unwrap();
            let dst = (parity * world as u64 + r as u64) * block;
            let flag = (parity * world as u64 + r as u64) * 8;
            if e % 3 == 0 {
                // Flagless halves, then a SIGNAL: the flag must cover both.
                let h = block / 2;
                p.push(&CommandBody::put_no_flag(d as u32, src, dst, h, e)).unwrap();
                p.push(&CommandBody::put_no_flag(d as u32, src + h, dst + h, block - h, e))
                    .unwrap();
                last = Some(p.push(&CommandBody::signal(d as u32, flag, e, e)).unwrap());
            } else {
                last = Some(
                    p.push(&CommandBody::put(d as u32, src, dst, block, flag, e, e))
                        .unwrap(),
                );
            }
        }
        for &s in &peers {
            let flag = (parity * world as u64 + s as u64) * 8;
            assert!(
                fabric.wait_flag(r, flag, e, WAIT),
                "rank {r} epoch {e}: no flag from {s}"
            );
            let got = fabric
                .read(r, (parity * world as u64 + s as u64) * block, block as usize)
                .unwrap();
            if let Some(j) = got
                .iter()
                .enumerate()
                .position(|(j, &b)| b != pattern(s, r, e, j as u64))
            {
                panic!("rank {r} epoch {e}: byte {j} from rank {s} is wrong");
            }
        }
    }
}

fn establish_all(world: usize, local: usize, cfg: &TcpConfig, ex: &MemStore) -> Vec<TcpLinks> {
    let nnodes = world / local;
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let (cfg, ex) = (cfg.clone(), ex.clone());
            std::thread::spawn(move || {
                let t = Topology::new(nnodes, local, r).unwrap();
                TcpLinks::establish(&t, &cfg, &ex, Some("127.0.0.1:1"), WAIT).unwrap()
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn threads_job(nnodes: usize, local: usize, sockets: usize, chunk: usize, block: u64, epochs: u64) {
    threads_job_with(nnodes, local, &config(sockets, chunk), block, epochs);
}

fn threads_job_with(nnodes: usize, local: usize, cfg: &TcpConfig, block: u64, epochs: u64) {
    let (sockets, mac) = (cfg.sockets, cfg.mac);
    let world = nnodes * local;
    let fabric = CpuFabric::new(world, (3 * world as u64 * block) as usize, 2 * world);
    let links = establish_all(world, local, cfg, &MemStore::default());
    let sides: Vec<RankSide> = links
        .into_iter()
        .enumerate()
        .map(|(r, l)| start_rank(Topology::new(nnodes, local, r).unwrap(), &fabric, l))
        .collect();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for side in &sides {
            let f = &fabric;
            s.spawn(move || all_to_all(side, f, world, block, epochs));
        }
    });
    println!(
        "tcp {nnodes} nodes x {local}: {epochs} epochs of {block}-byte blocks over {sockets} sockets (frame tags: {mac}) in {:?}",
        t0.elapsed()
    );
    for mut side in sides {
        side.producer.push(&CommandBody::quit(epochs)).unwrap();
        let st = side.proxy.take().unwrap().join().unwrap();
        let n = side.topo.proxy_peers().len() as u64;
        assert_eq!(st.bytes, epochs * n * block, "rank {}", side.topo.rank());
    }
}

#[test]
fn threads_over_loopback_two_nodes() {
    // 3 sockets and 16 KiB chunks: a 100 000-byte block is 7 frames spread over the sockets.
    threads_job(2, 1, 3, 16 << 10, 100_000, 12);
}

#[test]
fn threads_over_loopback_two_by_two() {
    threads_job(2, 2, 2, 8 << 10, 20_000, 8);
}

/// The same traffic with per-frame authentication off (`MKERNEL_TCP_MAC=0`): untagged frames.
#[test]
fn threads_over_loopback_without_frame_tags() {
    let cfg = TcpConfig {
        mac: false,
        ..config(2, 8 << 10)
    };
    threads_job_with(2, 2, &cfg, 20_000, 8);
}

/// An exchange without the job's frame secret.
struct NoSecret(MemStore);

impl Exchange for NoSecret {
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), String> {
        self.0.publish(key, value)
    }
    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, String> {
        self.0.lookup(key, timeout)
    }
}

/// Ranks that disagree about frame tags fail at setup naming `MKERNEL_TCP_MAC`, and tags
/// without a secret to key them are refused before anything is published.
#[test]
fn every_rank_must_agree_on_frame_tags() {
    let ex = MemStore::default();
    let c1 = TcpConfig {
        mac: false,
        ..config(1, 4096)
    };
    let (e0, c0) = (ex.clone(), config(1, 4096));
    let h0 = std::thread::spawn(move || TcpLinks::establish(&Topology::new(2, 1, 0).unwrap(), &c0, &e0, None, WAIT));
    let e1 = TcpLinks::establish(&Topology::new(2, 1, 1).unwrap(), &c1, &ex, None, WAIT)
        .err()
        .expect("setup with different MKERNEL_TCP_MAC succeeded")
        .to_string();
    let e0 = h0
        .join()
        .unwrap()
        .err()
        .expect("setup with different MKERNEL_TCP_MAC succeeded")
        .to_string();
    for e in [e0, e1] {
        assert!(e.contains("MKERNEL_TCP_MAC"), "{e}");
    }
    let ns = NoSecret(MemStore::default());
    let e = TcpLinks::establish(&Topology::new(2, 1, 0).unwrap(), &config(1, 4096), &ns, None, WAIT)
        .err()
        .expect("tags without a secret")
        .to_string();
    assert!(e.contains("MKERNEL_TCP_MAC=1"), "{e}");
    assert!(ns.0.lookup(&store_key(0), Duration::ZERO).is_err(), "published anyway");
}

// ---------------------------------------------------------------------------------------------
// Two processes playing two nodes.

/// What a child process does, from its environment (`MKTCP_*`).
#[test]
fn tcp_child_process() {
    let Ok(mode) = std::env::var("MKTCP_MODE") else {
        return; // only as a child of the tests below
    };
    // "launched": started by `cargo xtask launch` (RANK, WORLD_SIZE, ... from the launcher).
    let boot;
    let own;
    let (store, topo, store_addr, secret): (&Store, Topology, String, [u8; 32]) = if mode == "launched" {
        boot = Bootstrap::from_env(WAIT).unwrap();
        let i = boot.info();
        let t = Topology::new(i.nnodes(), i.local_world_size(), i.rank()).unwrap();
        (boot.store(), t, i.store_addr(), i.job_key().derive_secret("tcp-frames"))
    } else {
        let rank: usize = std::env::var("MKTCP_RANK").unwrap().parse().unwrap();
        let store_addr = std::env::var("MKTCP_STORE").unwrap();
        let key = JobKey::new(std::env::var("MKTCP_KEY").unwrap().into_bytes()).unwrap();
        let secret = key.derive_secret("tcp-frames");
        own = if rank == 0 {
            Store::host(StoreServer::start(&store_addr, 2, key).unwrap(), WAIT).unwrap()
        } else {
            Store::connect(&store_addr, rank, 2, &key, WAIT).unwrap()
        };
        (&own, Topology::new(2, 1, rank).unwrap(), store_addr, secret)
    };
    let (rank, world) = (topo.rank(), topo.world_size());
    let ex = BootStore(store, secret);
    let mut cfg = config(2, 32 << 10);
    cfg.ifname = std::env::var("MKTCP_IFNAME").ok();
    let links = TcpLinks::establish(&topo, &cfg, &ex, Some(&store_addr), WAIT).unwrap();
    println!(
        "rank {rank}: listening on {} ({})",
        links.local_addr(),
        links.address_reason()
    );
    let block = 150_000u64;
    let fabric = CpuFabric::new(world, 3 * world * block as usize, 2 * world);
    let npeers = topo.proxy_peers().len() as u64;
    let mut side = start_rank(topo, &fabric, links);
    all_to_all(&side, &fabric, world, block, 10);
    println!("rank {rank}: traffic ok");
    match mode.as_str() {
        "traffic" | "launched" => {
            ex.0.barrier("traffic-done", WAIT).unwrap();
            side.producer.push(&CommandBody::quit(10)).unwrap();
            let st = side.proxy.take().unwrap().join().unwrap();
            assert_eq!(st.bytes, 10 * block * npeers);
            ex.0.barrier("proxies-stopped", WAIT).unwrap();
            println!("rank {rank}: DONE");
        }
        "die" => {
            ex.0.barrier("traffic-done", WAIT).unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(60)); // killed by the parent
                panic!("rank 1 was not killed");
            }
            let t0 = Instant::now();
            let proxy = side.proxy.take().unwrap();
            while !proxy.is_finished() {
                assert!(
                    t0.elapsed() < DEAD_PEER_BOUND + Duration::from_secs(5),
                    "the dead peer was never noticed"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let e = proxy.join().unwrap_err();
            let rec = side.fifo.error_record().expect("error record written");
            println!("rank 0: DETECTED after {:?}: {e}", t0.elapsed());
            assert!(matches!(e, ProxyError::Transport { .. }), "{e}");
            assert!(e.to_string().contains("peer 1: connection lost"), "{e}");
            assert_eq!(rec.code, ErrorCode::Transport as u32);
            assert!(rec.message().contains("peer 1"), "{}", rec.message());
            println!("rank 0: DONE");
        }
        m => panic!("unknown MKTCP_MODE {m}"),
    }
}

struct Children {
    kids: Vec<(usize, Child)>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.kids {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts rank 0 and rank 1 of `mode`, each under `prefix` (e.g. `ip netns exec NS`), and
/// returns once both exited; panics with their output on failure. In mode "die", kills rank 1
/// when both printed READY and checks that rank 0 noticed within the bound.
fn two_processes(mode: &str, store: &str, prefixes: [&[String]; 2], ifnames: [Option<&str>; 2]) {
    let exe = std::env::current_exe().unwrap();
    let key: String = format!("tcp-test-key-{}", std::process::id());
    let mut ch = Children { kids: vec![] };
    let (tx, rx) = std::sync::mpsc::channel::<(usize, String)>();
    for rank in 0..2 {
        let pre = prefixes[rank];
        let mut cmd = if pre.is_empty() {
            Command::new(&exe)
        } else {
            let mut c = Command::new(&pre[0]);
            c.args(&pre[1..]).arg(&exe);
            c
        };
        cmd.args(["--exact", "tcp_child_process", "--nocapture", "--test-threads=1"])
            .env("MKTCP_MODE", mode)
            .env("MKTCP_RANK", rank.to_string())
            .env("MKTCP_STORE", store)
            .env("MKTCP_KEY", &key)
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(i) = ifnames[rank] {
            cmd.env("MKTCP_IFNAME", i);
        }
        let mut c = cmd.spawn().unwrap();
        for s in [
            Box::new(c.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(c.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(s).lines().map_while(Result::ok) {
                    let _ = tx.send((rank, line));
                }
            });
        }
        ch.kids.push((rank, c));
    }
    drop(tx);
    let t0 = Instant::now();
    let mut log = String::new();
    let mut ready = 0;
    let mut killed_at = None;
    loop {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok((r, line)) => {
                log.push_str(&format!("[rank {r}] {line}\n"));
                if line == "READY" {
                    ready += 1;
                    if ready == 2 {
                        ch.kids[1].1.kill().unwrap(); // SIGKILL: no goodbye, sockets closed by the kernel
                        killed_at = Some(Instant::now());
                    }
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(_) => {}
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "children hang:\n{log}");
    }
    let status0 = ch.kids[0].1.wait().unwrap();
    let status1 = ch.kids[1].1.wait().unwrap();
    print!("{log}");
    assert!(status0.success(), "rank 0 failed ({status0}):\n{log}");
    assert!(log.contains("[rank 0] rank 0: DONE"), "{log}");
    if mode == "die" {
        let k = killed_at.expect("both ranks got READY");
        assert!(k.elapsed() < DEAD_PEER_BOUND + Duration::from_secs(2), "{log}");
        assert!(log.contains("DETECTED"), "{log}");
    } else {
        assert!(status1.success(), "rank 1 failed ({status1}):\n{log}");
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn processes_over_loopback() {
    let store = format!("127.0.0.1:{}", free_port());
    two_processes("traffic", &store, [&[], &[]], [None, None]);
}

#[test]
fn killed_peer_is_named_within_the_bound() {
    let store = format!("127.0.0.1:{}", free_port());
    two_processes("die", &store, [&[], &[]], [Some("lo"), None]);
}

/// 2 nodes x 2 ranks as threads; rank 3 dies (its sockets close without goodbye, as when its
/// process is killed). Ranks 0 and 1 lose their link to it; their proxies then close with ABORT
/// frames, so rank 2 (rank 3's node, linked to ranks 0 and 1 only) fails naming a peer's
/// failed proxy and rank 3 as the link that broke first, not a peer that "died".
#[test]
fn a_failed_proxy_tells_its_peers_which_link_broke() {
    let (world, local) = (4, 2);
    let fabric = CpuFabric::new(world, 4096, 8);
    let mut links = establish_all(world, local, &config(2, 1024), &MemStore::default());
    drop(links.pop()); // rank 3 "dies"
    let mut sides: Vec<RankSide> = links
        .into_iter()
        .enumerate()
        .map(|(r, l)| start_rank(Topology::new(2, local, r).unwrap(), &fabric, l))
        .collect();
    let t0 = Instant::now();
    let mut errors = vec![];
    for side in &mut sides {
        let r = side.topo.rank();
        let proxy = side.proxy.take().unwrap();
        while !proxy.is_finished() {
            assert!(
                t0.elapsed() < DEAD_PEER_BOUND,
                "rank {r}: no error within {DEAD_PEER_BOUND:?}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let e = proxy.join().expect_err("the proxy must fail").to_string();
        let record = side.fifo.error_record().expect("an error record").message().to_string();
        println!("rank {r} after {:?}: {e}", t0.elapsed());
        errors.push((r, e, record));
    }
    for (r, e, record) in &errors[..2] {
        // Its own link to rank 3 broke; or rank 2's ABORT came first, naming rank 3 as well
        // (a chain of failing proxies keeps naming the first broken link, not the previous
        // proxy in the chain).
        assert!(
            (e.contains("peer 3") && e.contains("without goodbye"))
                || e.contains("its proxy failed on its link with rank 3"),
            "rank {r}: {e}"
        );
        assert!(record.contains("3"), "rank {r}: {record}");
    }
    let (_, e, record) = &errors[2];
    assert!(
        (e.contains("peer 0") || e.contains("peer 1")) && e.contains("its proxy failed on its link with rank 3"),
        "rank 2: {e}"
    );
    assert!(!e.contains("without goodbye"), "rank 2: {e}");
    assert!(record.contains("rank 3"), "rank 2: {record}");
}

/// Two network namespaces joined by a veth pair; removed on drop (with the veth).
struct Netns {
    names: [String; 2],
}

impl Netns {
    fn create() -> Result<(Netns, [String; 2], [String; 2]), String> {
        let id = std::process::id();
        let names = [format!("mktcp{id}a"), format!("mktcp{id}b")];
        let veth = [format!("mkv{}a", id % 100_000), format!("mkv{}b", id % 100_000)];
        let net = format!("10.231.{}", id % 250);
        let ns = Netns { names: names.clone() };
        let ip = |args: &[&str]| -> Result<(), String> {
            let o = Command::new("ip")
                .args(args)
                .output()
                .map_err(|e| format!("`ip` not runnable ({e}); install iproute2"))?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&o.stderr).trim()
                ))
            }
        };
        ip(&["netns", "add", &names[0]])?;
        ip(&["netns", "add", &names[1]])?;
        ip(&[
            "link", "add", &veth[0], "netns", &names[0], "type", "veth", "peer", "name", &veth[1], "netns", &names[1],
        ])?;
        for i in 0..2 {
            let addr = format!("{net}.{}/24", i + 1);
            ip(&["-n", &names[i], "addr", "add", &addr, "dev", &veth[i]])?;
            ip(&["-n", &names[i], "link", "set", &veth[i], "up"])?;
            ip(&["-n", &names[i], "link", "set", "lo", "up"])?;
        }
        Ok((ns, veth, [format!("{net}.1"), format!("{net}.2")]))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

#[test]
fn processes_over_a_veth_pair_between_namespaces() {
    let (ns, veth, addrs) = match Netns::create() {
        Ok(x) => x,
        Err(why) => {
            println!("SKIPPED processes_over_a_veth_pair_between_namespaces: cannot create network namespaces: {why}");
            return;
        }
    };
    let store = format!("{}:29511", addrs[0]);
    let pre = |n: &str| vec!["ip".to_string(), "netns".into(), "exec".into(), n.to_string()];
    let (p0, p1) = (pre(&ns.names[0]), pre(&ns.names[1]));
    // Rank 0 picks its interface by name, rank 1 by the route to the store.
    two_processes("traffic", &store, [&p0, &p1], [Some(&veth[0]), None]);
    two_processes("die", &format!("{}:29512", addrs[0]), [&p0, &p1], [None, None]);
    drop(ns);
}

// ---------------------------------------------------------------------------------------------
// A misbehaving peer, played by the test on rank 1's real sockets.

struct Victim {
    side: RankSide,
    fabric: Arc<CpuFabric>,
    bad: TcpLinks,
}

/// Rank 0 runs a real proxy; rank 1's sockets are handed to the test. A stranger connects to
/// rank 0 during setup with a wrong secret and must be refused without ending the setup.
fn victim() -> Victim {
    victim_in(None)
}

/// [`victim`] whose transport takes frames only inside `own`.
fn victim_in(own: Option<PeerRegions>) -> Victim {
    let ex = MemStore::default();
    let cfg = config(2, 4096);
    let (e0, c0) = (ex.clone(), cfg.clone());
    let h0 = std::thread::spawn(move || {
        TcpLinks::establish(&Topology::new(2, 1, 0).unwrap(), &c0, &e0, None, WAIT).unwrap()
    });
    let rec = String::from_utf8(ex.lookup(&store_key(0), WAIT).unwrap()).unwrap();
    let addr = rec.split_once(' ').unwrap().0.to_string();
    let mut stranger = std::net::TcpStream::connect(&addr).unwrap();
    let fake = frame::Hello {
        from: 1,
        to: 0,
        lane: 0,
        lanes: 2,
        max_payload: 4096,
        status: 0,
        token: [0x55; 32],
    };
    stranger.write_all(&fake.to_bytes()).unwrap();
    let bad = TcpLinks::establish(&Topology::new(2, 1, 1).unwrap(), &cfg, &ex, None, WAIT).unwrap();
    let good = h0.join().unwrap();
    assert_eq!(good.refused(), 1, "the stranger was not refused");
    let fabric = CpuFabric::new(2, 8192, 16);
    let side = start_rank_in(Topology::new(2, 1, 0).unwrap(), &fabric, good, own);
    Victim { side, fabric, bad }
}

fn expect_refusal(mut v: Victim, send: impl FnOnce(&mut TcpLinks), reason: &str) {
    send(&mut v.bad);
    let proxy = v.side.proxy.take().unwrap();
    let t0 = Instant::now();
    while !proxy.is_finished() {
        assert!(t0.elapsed() < DEAD_PEER_BOUND, "no error for: {reason}");
        std::thread::sleep(Duration::from_millis(2));
    }
    let e = proxy.join().unwrap_err().to_string();
    println!("{e}");
    assert!(e.contains("peer 1") && e.contains(reason), "{e}");
    assert!(v.side.fifo.error_record().unwrap().message().contains("peer 1"));
    assert!(
        v.fabric.read(0, 0, 8192).unwrap().iter().all(|&b| b == 0),
        "bytes were written"
    );
    assert!((0..16).all(|i| v.fabric.flag(0, i * 8) == 0), "a flag was written");
}

/// Sends the frame `hdr` with `payload` on socket `lane`, tagged as the transport tags it
/// (with per-frame authentication on): a peer running other code, but with the job's key.
fn put_frame(links: &mut TcpLinks, lane: usize, hdr: frame::Header, payload: &[u8]) {
    let h = hdr.to_bytes();
    let mut m = h.to_vec();
    m.extend(payload);
    if let Some(k) = links.tx_key(0, lane) {
        m.extend(k.tag(&h, payload));
    }
    raw(links, lane, &m);
}

fn raw(links: &mut TcpLinks, lane: usize, bytes: &[u8]) {
    let s = links.tx_socket(0, lane).unwrap();
    s.set_nonblocking(false).unwrap();
    s.write_all(bytes).unwrap();
}

/// Ranks 1 (node 0) and 2 (node 1) of 2 nodes x 2 call abort() at once, after some traffic:
/// every proxy peer of each (the ranks of the other node) hands the aborting rank to its host
/// within [`ABORT_BOUND`], each once, and nobody else; both aborts are acknowledged by every
/// peer; the connections stay up (every proxy then stops cleanly).
#[test]
fn a_user_abort_reaches_the_other_nodes_proxies() {
    /// Loopback, proxies sleeping 50 us when idle: a few milliseconds are typical.
    const ABORT_BOUND: Duration = Duration::from_secs(2);
    let (nnodes, local, block, epochs) = (2, 2, 20_000u64, 3);
    let world = nnodes * local;
    let fabric = CpuFabric::new(world, (3 * world as u64 * block) as usize, 2 * world);
    let links = establish_all(world, local, &config(2, 8 << 10), &MemStore::default());
    type Seen = Arc<Mutex<Vec<(usize, Instant)>>>;
    let seen: Vec<Seen> = (0..world).map(|_| Seen::default()).collect();
    let aborts: Vec<Arc<AbortLink>> = seen
        .iter()
        .map(|s| {
            let s = s.clone();
            Arc::new(AbortLink::new(move |r| s.lock().unwrap().push((r, Instant::now()))))
        })
        .collect();
    let sides: Vec<RankSide> = links
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let t = Topology::new(nnodes, local, r).unwrap();
            start_rank_with(t, &fabric, l, None, Some(aborts[r].clone()))
        })
        .collect();
    std::thread::scope(|s| {
        for side in &sides {
            let f = &fabric;
            s.spawn(move || all_to_all(side, f, world, block, epochs));
        }
    });
    let t0 = Instant::now();
    aborts[1].request();
    aborts[2].request();
    for r in [1, 2] {
        let st = aborts[r].wait(ABORT_BOUND);
        assert_eq!(st, AbortState::Delivered, "rank {r}'s abort after {:?}", t0.elapsed());
    }
    let delivered = t0.elapsed();
    for (r, s) in seen.iter().enumerate() {
        let got = s.lock().unwrap().clone();
        let ranks: Vec<usize> = got.iter().map(|g| g.0).collect();
        // Node 0 (ranks 0, 1) hears rank 2; node 1 (ranks 2, 3) hears rank 1.
        let want = if r < local { vec![2] } else { vec![1] };
        assert_eq!(ranks, want, "rank {r} saw aborts of {ranks:?}");
        let after = got[0].1 - t0;
        assert!(after < ABORT_BOUND, "rank {r} saw the abort after {after:?}");
        println!("rank {r}: rank {} aborted, seen after {after:?}", got[0].0);
    }
    println!("both aborts acknowledged by every peer after {delivered:?}");
    for r in [0, 3] {
        assert_eq!(aborts[r].state(), AbortState::Idle);
    }
    for mut side in sides {
        side.producer.push(&CommandBody::quit(epochs)).unwrap();
        let r = side.topo.rank();
        side.proxy
            .take()
            .unwrap()
            .join()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(aborts[r].proxy_stopped());
    }
}

#[test]
fn bad_user_abort_frames_are_refused() {
    expect_refusal(
        victim(),
        |l| put_frame(l, 1, frame::Header::user_abort(0), &[]),
        "a user abort frame naming rank 0 (must be 1)",
    );
    expect_refusal(
        victim(),
        |l| put_frame(l, 0, frame::Header::user_abort_ack(0), &[]),
        "an acknowledgement of an abort this rank never sent",
    );
    expect_refusal(
        victim(),
        |l| {
            let mut h = frame::Header::user_abort(1);
            h.seq = 3;
            put_frame(l, 0, h, &[])
        },
        "user abort frame with a message number",
    );
}

/// A frame with the last message number (`u64::MAX`, which has no successor) is refused; in a
/// debug build the receiver's `seq + 1` used to panic the proxy thread.
#[test]
fn a_frame_with_the_last_message_number_is_refused() {
    expect_refusal(
        victim(),
        |l| put_frame(l, 0, frame::Header::signal(u64::MAX, 0, 1), &[]),
        "message number 18446744073709551615 has no successor",
    );
}

#[test]
fn bad_peer_messages_are_refused() {
    expect_refusal(
        victim(),
        |l| put_frame(l, 0, frame::Header::data(0, 8000, 1000), &[1u8; 1000]),
        "outside the 8192-byte data region",
    );
    expect_refusal(
        victim(),
        |l| {
            let mut h = frame::Header::signal(0, 0, 1);
            h.kind = 7;
            put_frame(l, 1, h, &[])
        },
        "unknown frame kind 7",
    );
    expect_refusal(
        victim(),
        |l| put_frame(l, 0, frame::Header::signal(0, 8, 0), &[]),
        "flag value 0",
    );
    expect_refusal(
        victim(),
        |l| {
            // A second frame with the message number of the first: a replay.
            put_frame(l, 0, frame::Header::signal(1, 0, 1), &[]);
            put_frame(l, 0, frame::Header::signal(1, 0, 2), &[]);
        },
        "replayed",
    );
    expect_refusal(
        victim(),
        |l| {
            // Message 0 skipped: both sockets move past it, then say goodbye.
            put_frame(l, 0, frame::Header::signal(1, 0, 1), &[]);
            put_frame(l, 1, frame::Header::bye(2), &[]);
        },
        "message 0 never arrived",
    );
    expect_refusal(
        victim(),
        |l| {
            // Half a frame, then the sockets close without goodbye (a crash).
            raw(l, 0, &frame::Header::data(0, 0, 64).to_bytes()[..20]);
            let TcpLinks { .. } = std::mem::replace(l, dummy());
        },
        "connection lost",
    );
}

/// With per-frame authentication (the default), a frame whose payload changed on the way,
/// one tagged for another socket (moved between sockets), and untagged frames are refused before
/// anything is written.
#[test]
fn altered_moved_or_untagged_frames_are_refused() {
    expect_refusal(
        victim(),
        |l| {
            let h = frame::Header::data(0, 0, 64);
            let payload = [3u8; 64];
            let mut m = h.to_bytes().to_vec();
            m.extend(payload);
            m.extend(
                l.tx_key(0, 0)
                    .expect("tags are on by default")
                    .tag(&h.to_bytes(), &payload),
            );
            m[HEADER + 10] ^= 0x40; // one bit of the payload, after tagging
            raw(l, 0, &m)
        },
        "does not match",
    );
    expect_refusal(
        victim(),
        |l| {
            let h = frame::Header::signal(0, 8, 1).to_bytes();
            let mut m = h.to_vec();
            m.extend(l.tx_key(0, 1).unwrap().tag(&h, &[]));
            raw(l, 0, &m)
        },
        "does not match",
    );
    expect_refusal(
        victim(),
        |l| {
            // Two untagged frames: the second one's header is read as the first one's tag.
            raw(l, 0, &frame::Header::signal(0, 8, 1).to_bytes());
            raw(l, 0, &frame::Header::signal(1, 8, 2).to_bytes());
        },
        "does not match",
    );
}

/// Frames that the sender's validator would have refused, checked on the receiving side against
/// a heap-like layout: data only in `[4096, 8192)`, flags only in `[64, 128)` as 2 columns (one
/// per rank), rank 1 only in its own.
#[test]
fn frames_outside_the_receivers_regions_are_refused() {
    let own = || {
        Some(PeerRegions {
            data: Span::new(4096, 8192),
            flags: Span::new(64, 128),
            flag_columns: Some(2),
        })
    };
    expect_refusal(
        victim_in(own()),
        |l| put_frame(l, 0, frame::Header::data(0, 0, 64), &[1u8; 64]),
        "outside rank 0's data region [4096, 8192)",
    );
    expect_refusal(
        victim_in(own()),
        |l| put_frame(l, 0, frame::Header::signal(0, 8, 1), &[]),
        "outside rank 0's flag region [64, 128)",
    );
    expect_refusal(
        victim_in(own()),
        |l| put_frame(l, 1, frame::Header::signal(0, 64, 1), &[]),
        "rank 1 may only raise its own",
    );
    // Its own column is accepted: data, then the flag.
    let v = victim_in(own());
    let mut v = v;
    put_frame(&mut v.bad, 0, frame::Header::data(0, 4096, 64), &[7u8; 64]);
    put_frame(&mut v.bad, 0, frame::Header::signal(1, 72, 5), &[]);
    assert!(v.fabric.wait_flag(0, 72, 5, WAIT), "the legal flag never arrived");
    assert!(v.fabric.read(0, 4096, 64).unwrap().iter().all(|&b| b == 7));
}

/// Strangers that reach a rank's port during setup: sockets that connect and stay silent, and
/// sockets that send a byte every 100 ms (each would have held the old one-at-a-time accept
/// for up to 5 s). They must not delay the ranks' own connections; more than
/// [`MAX_PENDING`] silent ones evict the oldest.
#[test]
fn idle_and_trickling_sockets_do_not_delay_setup() {
    const SETUP: Duration = Duration::from_secs(6);
    /// The ranks' own setup over loopback takes milliseconds.
    const BOUND: Duration = Duration::from_secs(2);
    let ex = MemStore::default();
    let cfg = config(2, 4096);
    let (e0, c0) = (ex.clone(), cfg.clone());
    let h0 = std::thread::spawn(move || TcpLinks::establish(&Topology::new(2, 1, 0).unwrap(), &c0, &e0, None, SETUP));
    let rec = String::from_utf8(ex.lookup(&store_key(0), WAIT).unwrap()).unwrap();
    let addr = rec.split_once(' ').unwrap().0.to_string();
    let extra = 8;
    let idle: Vec<std::net::TcpStream> = (0..MAX_PENDING + extra)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tricklers: Vec<_> = (0..2)
        .map(|_| {
            let (addr, stop) = (addr.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut s = std::net::TcpStream::connect(&addr).unwrap();
                let hello = frame::Hello {
                    from: 1,
                    to: 0,
                    lane: 0,
                    lanes: 2,
                    max_payload: 4096,
                    status: 0,
                    token: [0; 32],
                }
                .to_bytes();
                for b in hello {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        })
        .collect();
    // The strangers are in rank 0's backlog before rank 1 starts.
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let l1 = TcpLinks::establish(&Topology::new(2, 1, 1).unwrap(), &cfg, &ex, None, SETUP).unwrap();
    let l0 = h0.join().unwrap().unwrap();
    let took = t0.elapsed();
    println!(
        "setup with {} idle and 2 trickling sockets: {took:?}; rank 0 refused {}",
        idle.len(),
        l0.refused()
    );
    assert!(took < BOUND, "setup took {took:?}");
    assert!(l0.refused() >= extra, "only {} connections evicted", l0.refused());
    assert_eq!(l1.refused(), 0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tricklers {
        t.join().unwrap();
    }
}

/// A socket that trickles a byte every 100 ms cannot hold the setup past its deadline: the
/// rank whose peer never comes fails at its timeout, naming the peer.
#[test]
fn a_trickling_socket_cannot_hold_setup_past_its_deadline() {
    const SETUP: Duration = Duration::from_millis(1500);
    let ex = MemStore::default();
    let (e0, c0) = (ex.clone(), config(1, 4096));
    let t0 = Instant::now();
    let h0 = std::thread::spawn(move || TcpLinks::establish(&Topology::new(2, 1, 0).unwrap(), &c0, &e0, None, SETUP));
    // Rank 1 publishes a record (so rank 0 reaches its accept loop) but never connects.
    ex.publish(
        &store_key(1),
        b"127.0.0.1:1 0000000000000000000000000000000000000000000000000000000000000000 mac=1",
    )
    .unwrap();
    let rec = String::from_utf8(ex.lookup(&store_key(0), WAIT).unwrap()).unwrap();
    match std::net::TcpStream::connect(rec.split_once(' ').unwrap().0) {
        Ok(mut s) => {
            s.set_write_timeout(Some(Duration::from_millis(100))).unwrap();
            while !h0.is_finished() && t0.elapsed() < Duration::from_secs(20) {
                let _ = s.write_all(b"M");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        // On a loaded machine this thread may reach the listener only after setup gave up and
        // closed it: then there is nothing to trickle into, and the deadline is checked below.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            println!("setup ended before the trickling socket connected ({e})")
        }
        Err(e) => panic!("connecting to rank 0: {e}"),
    }
    let took = t0.elapsed();
    let e = h0
        .join()
        .unwrap()
        .err()
        .expect("setup without rank 1 succeeded")
        .to_string();
    println!("{e} after {took:?}");
    assert!(
        took < SETUP + Duration::from_millis(700),
        "setup ended after {took:?}: {e}"
    );
    assert!(e.contains("peer 1"), "{e}");
}

/// `Duration::MAX` as the setup timeout is an error, not a panic.
#[test]
fn an_endless_setup_timeout_is_an_error() {
    let e = TcpLinks::establish(
        &Topology::new(1, 1, 0).unwrap(),
        &config(1, 4096),
        &MemStore::default(),
        None,
        Duration::MAX,
    )
    .err()
    .expect("accepted Duration::MAX")
    .to_string();
    assert!(e.contains("too long"), "{e}");
}

/// A placeholder that takes the place of a dropped `TcpLinks` (its sockets are then closed).
fn dummy() -> TcpLinks {
    let ex = MemStore::default();
    TcpLinks::establish(&Topology::new(1, 1, 0).unwrap(), &config(1, 4096), &ex, None, WAIT).unwrap()
}

// ---------------------------------------------------------------------------------------------
// A large transfer through few staging buffers (backpressure on both sides), with the CPU loop's
// latency and rate printed. The numbers describe this test's setup (gentle backoff: proxies sleep
// 50 us when idle; byte-atomic CPU "GPU" memory), not the transport on a GPU host.

#[test]
fn loopback_latency_and_bandwidth() {
    // With frame tags (the default) and without (MKERNEL_TCP_MAC=0): what the tags cost here.
    for mac in [true, false] {
        loopback_with(mac);
    }
}

fn loopback_with(mac: bool) {
    let big: u64 = 16 << 20;
    let fabric = CpuFabric::new(2, 2 * big as usize, 4);
    let cfg = TcpConfig {
        sockets: 2,
        chunk: 256 << 10,
        rx_buffers: 2,
        tx_buffers: 4,
        mac,
        ..TcpConfig::default()
    };
    let links = establish_all(2, 1, &cfg, &MemStore::default());
    let mut sides: Vec<RankSide> = links
        .into_iter()
        .enumerate()
        .map(|(r, l)| start_rank(Topology::new(2, 1, r).unwrap(), &fabric, l))
        .collect();
    // Latency: 8-byte PUTs from rank 0, each waited for at rank 1.
    let p = sides[0].producer.clone();
    let mut lat = vec![];
    for i in 1..=300u64 {
        let t0 = Instant::now();
        p.push(&CommandBody::put(1, 0, 0, 8, 0, i, 0)).unwrap();
        assert!(fabric.wait_flag(1, 0, i, WAIT));
        if i > 50 {
            lat.push(t0.elapsed());
        }
    }
    lat.sort();
    // Bandwidth: 16 MiB in 8 puts of 2 MiB (64 frames through 4 staging buffers), one flag.
    let pattern: Vec<u8> = (0..big).map(|j| (j * 7 + (j >> 12)) as u8).collect();
    fabric.write(0, big, &pattern).unwrap();
    let t0 = Instant::now();
    for k in 0..8u64 {
        let piece = big / 8;
        p.push(&CommandBody::put_no_flag(1, big + k * piece, k * piece, piece, 1))
            .unwrap();
    }
    p.push(&CommandBody::signal(1, 8, 1, 1)).unwrap();
    assert!(fabric.wait_flag(1, 8, 1, WAIT));
    let dt = t0.elapsed();
    assert!(
        fabric.read(1, 0, big as usize).unwrap() == pattern,
        "16 MiB arrived corrupted"
    );
    println!(
        "[tcp loopback, CPU staging, frame tags {}] 8-byte put one-way p50 {:?} p99 {:?}; 16 MiB in {dt:?} = {:.2} GB/s",
        if mac { "on" } else { "off" },
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100],
        big as f64 / dt.as_secs_f64() / 1e9
    );
    for (r, side) in sides.iter_mut().enumerate() {
        side.producer.push(&CommandBody::quit(1)).unwrap();
        side.proxy
            .take()
            .unwrap()
            .join()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous staging: copies that complete later, as on a GPU's streams.

/// A [`DeviceStaging`] whose calls complete some polls later, in call order per direction (as
/// the GPU engine's two streams do), and whose copies happen at completion: a transport that
/// refills a buffer before the copy using it completed sends or lands the wrong bytes. Every
/// breach of the trait's contract (a buffer touched while a copy uses it, a range outside the
/// rank's memory) panics, which fails the proxy and the test.
struct DelayedStaging {
    fabric: Arc<CpuFabric>,
    rank: usize,
    buffers: Vec<Vec<u8>>,
    busy: Vec<bool>,
    out: std::collections::VecDeque<(u64, u32, DelayedOp)>,
    inn: std::collections::VecDeque<(u64, u32, DelayedOp)>,
    rng: u64,
}

enum DelayedOp {
    ToHost { src: u64, buf: usize, len: usize },
    ToDevice { buf: usize, dst: u64, len: usize },
    Flag { offset: u64, value: u64 },
}

impl DelayedStaging {
    fn new(fabric: Arc<CpuFabric>, rank: usize) -> DelayedStaging {
        DelayedStaging {
            fabric,
            rank,
            buffers: vec![],
            busy: vec![],
            out: Default::default(),
            inn: Default::default(),
            rng: 0x9e37_79b9_7f4a_7c15 ^ rank as u64,
        }
    }
    /// Polls until the call completes: 0..8.
    fn delay(&mut self) -> u32 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % 8) as u32
    }
    fn claim(&mut self, buf: usize, len: usize) {
        assert!(
            buf < self.buffers.len() && len <= self.buffers[buf].len(),
            "rank {}: buffer {buf} cannot hold {len} bytes",
            self.rank
        );
        assert!(
            !self.busy[buf],
            "rank {}: buffer {buf} reused before its copy completed",
            self.rank
        );
        self.busy[buf] = true;
    }
    fn run(&mut self, op: DelayedOp) {
        match op {
            DelayedOp::ToHost { src, buf, len } => {
                let b = self
                    .fabric
                    .read(self.rank, src, len)
                    .expect("to_host inside the data region");
                self.buffers[buf][..len].copy_from_slice(&b);
                self.busy[buf] = false;
            }
            DelayedOp::ToDevice { buf, dst, len } => {
                self.fabric
                    .write(self.rank, dst, &self.buffers[buf][..len])
                    .expect("to_device inside the data region");
                self.busy[buf] = false;
            }
            DelayedOp::Flag { offset, value } => {
                self.fabric
                    .store_flag(self.rank, offset, value)
                    .expect("flag inside the flag array");
            }
        }
    }
}

impl mkernel_proxy::tcp::DeviceStaging for DelayedStaging {
    fn alloc_buffers(&mut self, count: usize, bytes: usize) -> Result<(), mkernel_proxy::TransportError> {
        self.buffers = vec![vec![0; bytes]; count];
        self.busy = vec![false; count];
        Ok(())
    }
    fn buffer(&mut self, i: usize) -> &mut [u8] {
        assert!(
            !self.busy[i],
            "rank {}: buffer {i} touched while a copy uses it",
            self.rank
        );
        &mut self.buffers[i]
    }
    fn to_host(&mut self, token: u64, src: u64, buf: usize, len: usize) -> Result<(), mkernel_proxy::TransportError> {
        self.claim(buf, len);
        let d = self.delay();
        self.out.push_back((token, d, DelayedOp::ToHost { src, buf, len }));
        Ok(())
    }
    fn to_device(&mut self, token: u64, buf: usize, dst: u64, len: usize) -> Result<(), mkernel_proxy::TransportError> {
        self.claim(buf, len);
        let d = self.delay();
        self.inn.push_back((token, d, DelayedOp::ToDevice { buf, dst, len }));
        Ok(())
    }
    fn write_flag(&mut self, token: u64, offset: u64, value: u64) -> Result<(), mkernel_proxy::TransportError> {
        let d = self.delay();
        self.inn.push_back((token, d, DelayedOp::Flag { offset, value }));
        Ok(())
    }
    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), mkernel_proxy::TransportError> {
        for out in [true, false] {
            loop {
                let q = if out { &mut self.out } else { &mut self.inn };
                let Some(front) = q.front_mut() else { break };
                if front.1 > 0 {
                    front.1 -= 1;
                    break;
                }
                let (token, _, op) = q.pop_front().expect("front checked");
                self.run(op);
                completed.push(token);
            }
        }
        Ok(())
    }
}

/// Sources of rank `r`: `puts` blocks of `block` bytes per peer slot, distinct patterns.
fn burst_byte(from: usize, to: usize, k: u64, j: u64) -> u8 {
    (from as u64 * 131 + to as u64 * 29 + k * 17 + j * 3 + (j >> 8)) as u8 ^ 0x5a
}

/// Every rank posts `puts` PUTs of odd sizes (1 to 3 chunks) to every remote rank back to back,
/// with a FIFO of 16 slots (backpressure) and without waiting between them: `puts - same`
/// land in distinct blocks, the last `same` all land in one block (the last must win), each
/// raising the sender's flag to its number. Then every byte of every receiving region is
/// checked, and the bytes around them must still be zero.
fn burst_job(nnodes: usize, local: usize, chunk: usize, puts: u64, same: u64) {
    let world = nnodes * local;
    let block = (2 * chunk + 777) as u64;
    let stride = block + 64; // 64 guard bytes after each block
                             // Region of rank r: [receive area: world x puts blocks | source area: world x puts blocks].
    let area = world as u64 * puts * stride;
    let fabric = CpuFabric::new(world, (2 * area) as usize, world);
    let links = establish_all(world, local, &config(2, chunk), &MemStore::default());
    let len = |k: u64| block - (k * 97) % chunk as u64; // 1 to 3 chunks
    let sides: Vec<(Topology, FifoProducer<HeapFifo>, Proxy)> = links
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let topo = Topology::new(nnodes, local, r).unwrap();
            let fifo = Fifo::new(HeapFifo::new(16, r as u32).unwrap()).unwrap();
            let regions = Regions::symmetric(&topo, fabric.data_bytes(), fabric.flag_bytes());
            let consumer = FifoConsumer::new(fifo.clone(), Validator::new(regions)).unwrap();
            let t = TcpTransport::new(
                l,
                DelayedStaging::new(fabric.clone(), r),
                fabric.data_bytes(),
                fabric.flag_bytes(),
            )
            .unwrap();
            let proxy = Proxy::spawn(consumer, t, ProxyConfig::default()).unwrap();
            (topo, FifoProducer::new(fifo), proxy)
        })
        .collect();
    // Sources, written before any put.
    for (topo, _, _) in &sides {
        let r = topo.rank();
        for d in topo.proxy_peers() {
            for k in 0..puts {
                let data: Vec<u8> = (0..len(k)).map(|j| burst_byte(r, d, k, j)).collect();
                fabric.write(r, area + (d as u64 * puts + k) * stride, &data).unwrap();
            }
        }
    }
    std::thread::scope(|s| {
        for (topo, producer, _) in &sides {
            let fabric = &fabric;
            s.spawn(move || {
                let r = topo.rank();
                let peers = topo.proxy_peers();
                for k in 0..puts {
                    for &d in &peers {
                        let src = area + (d as u64 * puts + k) * stride;
                        let slot = if k < puts - same { k } else { puts - same };
                        let dst = (r as u64 * puts + slot) * stride;
                        producer
                            .push(&CommandBody::put(d as u32, src, dst, len(k), r as u64 * 8, k + 1, 1))
                            .unwrap();
                    }
                }
                for &q in &peers {
                    assert!(
                        fabric.wait_flag(r, q as u64 * 8, puts, WAIT),
                        "rank {r}: the last flag of rank {q} never came"
                    );
                }
                for &q in &peers {
                    for slot in 0..=puts - same {
                        let k = if slot < puts - same { slot } else { puts - 1 };
                        let at = (q as u64 * puts + slot) * stride;
                        let got = fabric.read(r, at, stride as usize).unwrap();
                        for (j, &b) in got.iter().enumerate() {
                            let j = j as u64;
                            let want = if j < len(k) {
                                burst_byte(q, r, k, j)
                            } else if slot == puts - same && j < block {
                                // Earlier, longer puts to the same block may leave their tail.
                                b
                            } else {
                                0
                            };
                            assert_eq!(b, want, "rank {r}: byte {j} of block {slot} from rank {q}");
                        }
                    }
                    // Blocks nobody writes stay zero.
                    let untouched = fabric
                        .read(
                            r,
                            (q as u64 * puts + puts - same + 1) * stride,
                            ((same - 1) * stride) as usize,
                        )
                        .unwrap();
                    assert!(
                        untouched.iter().all(|&b| b == 0),
                        "rank {r}: a put from {q} landed outside its block"
                    );
                }
            });
        }
    });
    for (topo, producer, proxy) in sides {
        producer.push(&CommandBody::quit(1)).unwrap();
        let st = proxy.join().unwrap();
        let bytes: u64 = (0..puts).map(len).sum::<u64>() * topo.proxy_peers().len() as u64;
        assert_eq!(st.bytes, bytes, "rank {}", topo.rank());
    }
}

#[test]
fn back_to_back_puts_with_delayed_copies_two_by_two() {
    burst_job(2, 2, 8 << 10, 96, 8);
}

#[test]
fn back_to_back_puts_with_delayed_copies_two_nodes() {
    burst_job(2, 1, 4 << 10, 160, 16);
}
