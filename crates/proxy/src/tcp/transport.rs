//! The TCP [`Transport`]: staging through host buffers, several sockets per peer, and a
//! receiver that carries frames out in message order (data, then the flag).
use super::frame::{
    Header, Limits, HEADER_BYTES, KIND_ABORT, KIND_BYE, KIND_DATA, KIND_SIGNAL, KIND_USER_ABORT, KIND_USER_ABORT_ACK,
    NO_RANK,
};
use super::mac::{FrameKey, TAG_BYTES};
use super::setup::TcpLinks;
use super::staging::DeviceStaging;
use crate::error::TransportError;
use crate::transport::{Op, Transport};
use crate::validate::{PeerRegions, Span};
use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const TOK_TX: u64 = 1 << 62;
const TOK_RX: u64 = 2 << 62;
const TOK_FLAG: u64 = 3 << 62;
const TOK_KIND: u64 = 3 << 62;
/// Frames one socket may hold received but not yet carried out, beyond its data buffers.
const EXTRA_PENDING: usize = 64;
/// How long closing a socket may spend finishing its frame in progress and sending BYE or ABORT.
const CLOSE_BOUND: Duration = Duration::from_millis(200);

/// A message waiting for a staging buffer (in FIFO order per peer).
enum Backlog {
    Data {
        fifo_seq: u64,
        src_offset: u64,
        dst_offset: u64,
        len: usize,
    },
    Signal {
        flag_offset: u64,
        value: u64,
    },
}

struct TxMsg {
    hdr: [u8; HEADER_BYTES],
    /// Staging buffer and payload length.
    payload: Option<(usize, usize)>,
    /// The frame's tag, sent after the payload (with per-frame authentication; set once the
    /// payload is staged).
    tag: Option<[u8; TAG_BYTES]>,
    ready: bool,
    written: usize,
}

impl TxMsg {
    /// A frame without payload, ready, tagged with `key` if there is one.
    fn bare(hdr: Header, key: Option<&FrameKey>) -> TxMsg {
        let hdr = hdr.to_bytes();
        TxMsg {
            tag: key.map(|k| k.tag(&hdr, &[])),
            hdr,
            payload: None,
            ready: true,
            written: 0,
        }
    }

    /// The bytes after the payload: the tag, or nothing.
    fn trailer(&self) -> &[u8] {
        self.tag.as_ref().map_or(&[], |t| &t[..])
    }
}

struct TxLane {
    sock: TcpStream,
    queue: VecDeque<TxMsg>,
    /// Key of this socket's frame tags (`None`: frames go untagged).
    key: Option<FrameKey>,
}

impl TxLane {
    /// Queues a control frame (USER_ABORT, its ack) right after the frame in progress, ahead
    /// of everything else queued: it carries no message number, so it may pass data.
    fn push_control(&mut self, hdr: Header) {
        let at = usize::from(self.queue.front().is_some_and(|m| m.written > 0));
        let m = TxMsg::bare(hdr, self.key.as_ref());
        self.queue.insert(at, m);
    }
}

/// A control frame received on a socket, for [`TcpTransport::poll_aborts`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Notice {
    /// The peer called abort().
    Abort,
    /// The peer stored this rank's abort.
    Ack,
}

struct TxPeer {
    rank: usize,
    lanes: Vec<TxLane>,
    next_seq: u64,
    backlog: VecDeque<Backlog>,
    rr: usize,
    last_lane: usize,
    chunk: usize,
}

enum RxMsg {
    Data { buf: usize, dst_offset: u64, len: usize },
    Signal { flag_offset: u64, value: u64 },
}

enum ReadState {
    Header {
        got: usize,
        bytes: [u8; HEADER_BYTES],
    },
    Payload {
        hdr: Header,
        buf: Option<usize>,
        got: usize,
    },
    /// The frame's tag (with per-frame authentication), after its header and payload.
    Tag {
        hdr: Header,
        /// The receive buffer holding a DATA frame's payload.
        buf: Option<usize>,
        got: usize,
        tag: [u8; TAG_BYTES],
    },
}

struct RxLane {
    sock: TcpStream,
    /// Key of this socket's frame tags (`None`: frames come untagged).
    key: Option<FrameKey>,
    state: ReadState,
    pending: VecDeque<(u64, RxMsg)>,
    free: Vec<usize>,
    buffers: usize,
    /// Smallest acceptable next message number on this socket.
    expect: u64,
    /// The BYE's message number once received.
    bye: Option<u64>,
    /// The rank an ABORT received here named as the link that broke first.
    abort_origin: Option<u64>,
    /// USER_ABORT and USER_ABORT_ACK frames read and not yet taken by `read`.
    notices: Vec<Notice>,
    closed: bool,
}

struct RxPeer {
    rank: usize,
    lanes: Vec<RxLane>,
    next: u64,
}

/// Counters of a TCP transport.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Data frames sent.
    pub frames_sent: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Data frames received and landed.
    pub frames_received: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Flags stored for peers.
    pub flags_written: u64,
}

/// The TCP [`Transport`] over a [`DeviceStaging`] (see [`crate::tcp`]).
pub struct TcpTransport<E: DeviceStaging> {
    me: usize,
    engine: E,
    slot_of: Vec<Option<usize>>,
    tx: Vec<TxPeer>,
    rx: Vec<RxPeer>,
    tx_free: Vec<usize>,
    /// Per staging buffer: (peer slot, lane, FIFO seq) while it is in use.
    tx_owner: Vec<Option<(usize, usize, u64)>>,
    /// Per receive buffer: (peer slot, lane).
    rx_owner: Vec<(usize, usize)>,
    /// FIFO seq -> chunks of its put not yet staged.
    op_chunks: HashMap<u64, u32>,
    done: Vec<u64>,
    tokens: Vec<u64>,
    limits: Limits,
    /// Where peers' frames may write in this rank's memory.
    regions: PeerRegions,
    pollfds: Vec<libc::pollfd>,
    poll_of: Vec<(usize, usize)>,
    timeout: Duration,
    /// The last `flush` emptied everything and nothing was posted since: close with BYE.
    clean: bool,
    /// This transport returned an error: the rank whose link failed first ([`NO_RANK`] when
    /// the error named none). Closing then sends ABORT naming it.
    failed: Option<u64>,
    /// `send_abort` was called.
    abort_sent: bool,
    /// Per peer slot: it acknowledged this rank's abort.
    abort_acked: Vec<bool>,
    /// Per peer slot: its abort arrived (`Some`), and was handed to the host and acknowledged
    /// (`Some(true)`).
    peer_aborted: Vec<Option<bool>>,
    stats: TcpStats,
}

fn lost(peer: usize, what: String) -> TransportError {
    TransportError::Peer { peer, detail: what }
}

impl<E: DeviceStaging> TcpTransport<E> {
    /// The transport over `links`, landing received data in this rank's data region of
    /// `data_bytes` and flags in its flag array of `flag_bytes` through `engine` (separate
    /// arrays from offset 0, any flag word writable by any peer: the CPU fabric of the tests).
    pub fn new(links: TcpLinks, engine: E, data_bytes: u64, flag_bytes: u64) -> Result<Self, TransportError> {
        let regions = PeerRegions {
            data: Span::upto(data_bytes),
            flags: Span::upto(flag_bytes),
            flag_columns: None,
        };
        Self::with_regions(links, engine, regions)
    }

    /// The transport over `links`, where peers' frames may write only inside `regions` of this
    /// rank's memory (data into `regions.data`, flags into the sender's own words of
    /// `regions.flags`), checked as the sender's validator checks the commands
    /// ([`PeerRegions::check_put`], [`PeerRegions::check_flag`]): mkernel's heap passes
    /// `PeerRegions::heap(heap_bytes)`. Offsets are `engine`'s.
    pub fn with_regions(links: TcpLinks, mut engine: E, regions: PeerRegions) -> Result<Self, TransportError> {
        let (data_bytes, flag_bytes) = (regions.data.end, regions.flags.end);
        let cfg = links.config.clone();
        let lanes = links.lanes;
        let nrx = links.peers.len() * lanes * cfg.rx_buffers;
        engine.alloc_buffers(cfg.tx_buffers + nrx, cfg.chunk)?;
        let mut slot_of = vec![None; links.world];
        for (s, &p) in links.peers.iter().enumerate() {
            slot_of[p] = Some(s);
        }
        let tx = links
            .tx
            .into_iter()
            .zip(links.tx_keys)
            .zip(links.peers.iter().zip(&links.peer_payload))
            .map(|((socks, keys), (&rank, &chunk))| TxPeer {
                rank,
                lanes: socks
                    .into_iter()
                    .zip(keys)
                    .map(|(sock, key)| TxLane {
                        sock,
                        queue: VecDeque::new(),
                        key,
                    })
                    .collect(),
                next_seq: 0,
                backlog: VecDeque::new(),
                rr: 0,
                last_lane: 0,
                chunk: chunk.min(cfg.chunk),
            })
            .collect();
        let mut rx_owner = Vec::with_capacity(nrx);
        let mut next_buf = cfg.tx_buffers;
        let mut rx = Vec::with_capacity(links.peers.len());
        let mut pollfds = vec![];
        let mut poll_of = vec![];
        let rx_sockets = links.rx.into_iter().zip(links.rx_keys);
        for (slot, ((socks, keys), &rank)) in rx_sockets.zip(links.peers.iter()).enumerate() {
            let mut ls = Vec::with_capacity(lanes);
            for (lane, (sock, key)) in socks.into_iter().zip(keys).enumerate() {
                let free: Vec<usize> = (next_buf..next_buf + cfg.rx_buffers).collect();
                next_buf += cfg.rx_buffers;
                rx_owner.extend(std::iter::repeat_n((slot, lane), cfg.rx_buffers));
                pollfds.push(libc::pollfd {
                    fd: sock.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
                poll_of.push((slot, lane));
                ls.push(RxLane {
                    sock,
                    key,
                    state: ReadState::Header {
                        got: 0,
                        bytes: [0; HEADER_BYTES],
                    },
                    pending: VecDeque::new(),
                    free,
                    buffers: cfg.rx_buffers,
                    expect: 0,
                    bye: None,
                    abort_origin: None,
                    notices: Vec::new(),
                    closed: false,
                });
            }
            rx.push(RxPeer {
                rank,
                lanes: ls,
                next: 0,
            });
        }
        Ok(TcpTransport {
            me: links.me,
            engine,
            slot_of,
            tx,
            rx,
            tx_free: (0..cfg.tx_buffers).rev().collect(),
            tx_owner: vec![None; cfg.tx_buffers],
            rx_owner,
            op_chunks: HashMap::new(),
            done: Vec::new(),
            tokens: Vec::new(),
            limits: Limits {
                data_bytes,
                flag_bytes,
                max_payload: cfg.chunk as u64,
            },
            regions,
            pollfds,
            poll_of,
            timeout: cfg.timeout,
            clean: false,
            failed: None,
            abort_sent: false,
            abort_acked: vec![false; links.peers.len()],
            peer_aborted: vec![None; links.peers.len()],
            stats: TcpStats::default(),
        })
    }

    /// Counters so far.
    pub fn stats(&self) -> TcpStats {
        self.stats
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.me
    }

    fn engine_completions(&mut self) -> Result<(), TransportError> {
        self.engine.poll(&mut self.tokens)?;
        for t in std::mem::take(&mut self.tokens) {
            let i = (t & !TOK_KIND) as usize;
            match t & TOK_KIND {
                TOK_TX => {
                    let Some((slot, lane, fifo_seq)) = self.tx_owner.get(i).copied().flatten() else {
                        return Err(TransportError::Copy(format!("staging completion for idle buffer {i}")));
                    };
                    let l = &mut self.tx[slot].lanes[lane];
                    if let Some(m) = l.queue.iter_mut().find(|m| m.payload.map(|p| p.0) == Some(i)) {
                        // Staged: the payload is in the buffer, so the tag can cover it.
                        if let (Some(k), Some((b, len))) = (&l.key, m.payload) {
                            m.tag = Some(k.tag(&m.hdr, &self.engine.buffer(b)[..len]));
                        }
                        m.ready = true;
                    }
                    if let Some(n) = self.op_chunks.get_mut(&fifo_seq) {
                        *n -= 1;
                        if *n == 0 {
                            self.op_chunks.remove(&fifo_seq);
                            self.done.push(fifo_seq);
                        }
                    }
                }
                TOK_RX => {
                    let (slot, lane) = self.rx_owner[i - self.tx_owner.len()];
                    self.rx[slot].lanes[lane].free.push(i);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Moves backlogged messages into socket queues while staging buffers are free.
    fn stage(&mut self) -> Result<(), TransportError> {
        for slot in 0..self.tx.len() {
            let p = &mut self.tx[slot];
            while let Some(front) = p.backlog.front() {
                let nl = p.lanes.len();
                match *front {
                    Backlog::Data {
                        fifo_seq,
                        src_offset,
                        dst_offset,
                        len,
                    } => {
                        let Some(buf) = self.tx_free.pop() else {
                            return Ok(());
                        };
                        let lane = p.rr % nl;
                        p.rr = p.rr.wrapping_add(1);
                        self.engine.to_host(TOK_TX | buf as u64, src_offset, buf, len)?;
                        self.tx_owner[buf] = Some((slot, lane, fifo_seq));
                        p.lanes[lane].queue.push_back(TxMsg {
                            hdr: Header::data(p.next_seq, dst_offset, len as u64).to_bytes(),
                            payload: Some((buf, len)),
                            tag: None,
                            ready: false,
                            written: 0,
                        });
                        p.last_lane = lane;
                    }
                    Backlog::Signal { flag_offset, value } => {
                        // On the socket of the last data frame: it follows that frame at once.
                        let l = &mut p.lanes[p.last_lane];
                        let m = TxMsg::bare(Header::signal(p.next_seq, flag_offset, value), l.key.as_ref());
                        l.queue.push_back(m);
                    }
                }
                p.next_seq = p.next_seq.checked_add(1).ok_or_else(|| {
                    lost(
                        p.rank,
                        "message numbers to this peer are used up (2^64 - 1 frames)".into(),
                    )
                })?;
                p.backlog.pop_front();
            }
        }
        Ok(())
    }

    /// Writes what is ready on every outgoing socket without blocking.
    fn write(&mut self) -> Result<(), TransportError> {
        for p in &mut self.tx {
            for (li, lane) in p.lanes.iter_mut().enumerate() {
                while let Some(m) = lane.queue.front_mut() {
                    if !m.ready {
                        break;
                    }
                    let plen = m.payload.map_or(0, |(_, l)| l);
                    let total = HEADER_BYTES + plen + m.trailer().len();
                    let payload: &[u8] = match m.payload {
                        Some((b, l)) => &self.engine.buffer(b)[..l],
                        None => &[],
                    };
                    let n = send_parts(&lane.sock, [&m.hdr, payload, m.trailer()], m.written)
                        .map_err(|e| lost(p.rank, format!("connection lost while sending on socket {li}: {e}")))?;
                    let Some(n) = n else { break };
                    m.written += n;
                    if m.written < total {
                        break;
                    }
                    if let Some((b, l)) = m.payload {
                        self.tx_owner[b] = None;
                        self.tx_free.push(b);
                        self.stats.frames_sent += 1;
                        self.stats.bytes_sent += l as u64;
                    }
                    lane.queue.pop_front();
                }
            }
        }
        Ok(())
    }

    /// Reads every socket that has something, then carries out frames in message order.
    fn read(&mut self) -> Result<(), TransportError> {
        if self.pollfds.is_empty() {
            return Ok(());
        }
        // SAFETY: `pollfds` holds valid descriptors owned by `self.rx`.
        let n = unsafe { libc::poll(self.pollfds.as_mut_ptr(), self.pollfds.len() as libc::nfds_t, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(TransportError::Config(format!("poll: {e}")));
        }
        for i in 0..self.pollfds.len() {
            if self.pollfds[i].revents == 0 {
                continue;
            }
            let (slot, lane) = self.poll_of[i];
            let peer = &mut self.rx[slot];
            let rank = peer.rank;
            let r = read_lane(
                rank,
                lane,
                &mut peer.lanes[lane],
                &mut self.engine,
                &self.limits,
                (&self.regions, self.me),
            );
            for n in peer.lanes[lane].notices.drain(..) {
                match n {
                    Notice::Abort => {
                        self.peer_aborted[slot].get_or_insert(false);
                    }
                    Notice::Ack if !self.abort_sent => {
                        return Err(lost(
                            rank,
                            format!(
                                "bad message on socket {lane}: an acknowledgement of an abort this rank never sent"
                            ),
                        ));
                    }
                    Notice::Ack => self.abort_acked[slot] = true,
                }
            }
            if let Err(e) = r {
                // A peer's ABORT: the root cause is the link it names, not the peer (so a chain
                // of failing proxies keeps naming the first broken link).
                if let Some(o) = peer.lanes[lane].abort_origin.filter(|&o| o != NO_RANK) {
                    self.failed.get_or_insert(o);
                }
                return Err(e);
            }
            if peer.lanes[lane].closed {
                self.pollfds[i].fd = -1; // poll ignores negative descriptors
            }
        }
        for slot in 0..self.rx.len() {
            self.deliver(slot)?;
        }
        Ok(())
    }

    fn deliver(&mut self, slot: usize) -> Result<(), TransportError> {
        let base = self.tx_owner.len();
        let peer = &mut self.rx[slot];
        loop {
            let next = peer.next;
            let Some(lane) = peer
                .lanes
                .iter()
                .position(|l| l.pending.front().is_some_and(|(s, _)| *s == next))
            else {
                break;
            };
            let (_, msg) = peer.lanes[lane].pending.pop_front().expect("front checked");
            match msg {
                RxMsg::Data { buf, dst_offset, len } => {
                    debug_assert!(buf >= base);
                    self.engine.to_device(TOK_RX | buf as u64, buf, dst_offset, len)?;
                    self.stats.frames_received += 1;
                    self.stats.bytes_received += len as u64;
                }
                RxMsg::Signal { flag_offset, value } => {
                    self.engine.write_flag(TOK_FLAG, flag_offset, value)?;
                    self.stats.flags_written += 1;
                }
            }
            // Below every received number, which `Limits::check` keeps under `u64::MAX`.
            peer.next = peer.next.saturating_add(1);
        }
        // A message that can no longer arrive: every socket has moved past it or said goodbye.
        let next = peer.next;
        let stuck = peer
            .lanes
            .iter()
            .all(|l| l.pending.front().is_some_and(|(s, _)| *s > next) || (l.bye.is_some() && l.pending.is_empty()));
        if stuck && peer.lanes.iter().any(|l| l.bye.is_none_or(|b| b > next)) {
            return Err(lost(
                peer.rank,
                format!("bad message stream: message {next} never arrived (a socket skipped it)"),
            ));
        }
        Ok(())
    }

    fn progress(&mut self) -> Result<(), TransportError> {
        self.engine_completions()?;
        self.stage()?;
        self.write()?;
        self.read()?;
        self.engine_completions()?;
        self.write()
    }

    fn idle(&self) -> bool {
        self.op_chunks.is_empty()
            && self
                .tx
                .iter()
                .all(|p| p.backlog.is_empty() && p.lanes.iter().all(|l| l.queue.is_empty()))
    }

    /// Remembers the first error this transport returns (see `failed`).
    fn note<T>(&mut self, r: Result<T, TransportError>) -> Result<T, TransportError> {
        if let Err(e) = &r {
            if self.failed.is_none() {
                self.failed = Some(match e {
                    TransportError::Peer { peer, .. } => *peer as u64,
                    _ => NO_RANK,
                });
            }
        }
        r
    }

    /// Closes every outgoing socket with `closing(next message number)` (BYE or ABORT), first
    /// finishing the frame in progress on it so that the closing frame starts on a frame
    /// boundary; bounded by [`CLOSE_BOUND`] per socket, best effort (a dead peer's socket just
    /// fails).
    fn close_lanes(&mut self, closing: impl Fn(u64) -> Header) {
        let engine = &mut self.engine;
        for p in &mut self.tx {
            for lane in &mut p.lanes {
                let t0 = Instant::now();
                let mut on_boundary = true;
                if let Some(m) = lane.queue.front_mut().filter(|m| m.written > 0) {
                    // Started, so ready: its payload is in the staging buffer.
                    let payload: &[u8] = match m.payload {
                        Some((b, l)) => &engine.buffer(b)[..l],
                        None => &[],
                    };
                    on_boundary = send_bounded(&lane.sock, [&m.hdr, payload, m.trailer()], m.written, t0);
                }
                if on_boundary {
                    let m = TxMsg::bare(closing(p.next_seq), lane.key.as_ref());
                    send_bounded(&lane.sock, [&m.hdr, &[], m.trailer()], 0, t0);
                }
                let _ = lane.sock.shutdown(Shutdown::Write);
            }
        }
    }
}

/// Sends `parts` (header, payload, trailer) from byte `skip` on, retrying a full socket until
/// [`CLOSE_BOUND`] after `t0`; whether it all went out.
fn send_bounded(sock: &TcpStream, parts: [&[u8]; 3], mut skip: usize, t0: Instant) -> bool {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    while skip < total {
        if t0.elapsed() > CLOSE_BOUND {
            return false;
        }
        match send_parts(sock, parts, skip) {
            Ok(Some(n)) => skip += n,
            Ok(None) => std::thread::sleep(Duration::from_micros(50)),
            Err(_) => return false,
        }
    }
    true
}

/// Reads one socket as far as it goes without blocking. A frame takes effect only once it is
/// complete (with per-frame authentication: once its tag is verified).
fn read_lane<E: DeviceStaging>(
    rank: usize,
    li: usize,
    lane: &mut RxLane,
    engine: &mut E,
    limits: &Limits,
    (regions, me): (&PeerRegions, usize),
) -> Result<(), TransportError> {
    let bad = |why: String| lost(rank, format!("bad message on socket {li}: {why}"));
    loop {
        if lane.closed || lane.pending.len() >= lane.buffers + EXTRA_PENDING {
            return Ok(());
        }
        let r = match &mut lane.state {
            ReadState::Header { got, bytes } => match (&lane.sock).read(&mut bytes[*got..]) {
                Ok(0) => Err(None),
                Ok(n) => {
                    *got += n;
                    if *got < HEADER_BYTES {
                        continue;
                    }
                    let h = Header::from_bytes(bytes);
                    if lane.bye.is_some() {
                        return Err(bad("a frame after goodbye".into()));
                    }
                    limits.check(&h, lane.expect).map_err(bad)?;
                    // The sender's validator checked its command against this rank's regions;
                    // the same rules here, so a peer running other code cannot write outside.
                    match h.kind {
                        KIND_DATA => regions.check_put(me, h.a, h.b),
                        KIND_SIGNAL => regions.check_flag(me, rank, h.a, h.b),
                        _ => Ok(()),
                    }
                    .map_err(|v| bad(v.reason))?;
                    if h.kind == KIND_DATA {
                        lane.state = ReadState::Payload {
                            hdr: h,
                            buf: lane.free.pop(),
                            got: 0,
                        };
                    } else if lane.key.is_some() {
                        lane.state = ReadState::Tag {
                            hdr: h,
                            buf: None,
                            got: 0,
                            tag: [0; TAG_BYTES],
                        };
                    } else {
                        finish_frame(rank, li, me, lane, h, None)?;
                    }
                    Ok(())
                }
                Err(e) => Err(Some(e)),
            },
            ReadState::Payload { hdr, buf, got } => {
                if buf.is_none() {
                    *buf = lane.free.pop();
                }
                let Some(b) = *buf else {
                    return Ok(()); // every buffer of this socket is landing: read later
                };
                let len = hdr.b as usize;
                match (&lane.sock).read(&mut engine.buffer(b)[*got..len]) {
                    Ok(0) => Err(None),
                    Ok(n) => {
                        *got += n;
                        if *got == len {
                            let h = *hdr;
                            if lane.key.is_some() {
                                lane.state = ReadState::Tag {
                                    hdr: h,
                                    buf: Some(b),
                                    got: 0,
                                    tag: [0; TAG_BYTES],
                                };
                            } else {
                                finish_frame(rank, li, me, lane, h, Some(b))?;
                            }
                        }
                        Ok(())
                    }
                    Err(e) => Err(Some(e)),
                }
            }
            ReadState::Tag { hdr, buf, got, tag } => match (&lane.sock).read(&mut tag[*got..]) {
                Ok(0) => Err(None),
                Ok(n) => {
                    *got += n;
                    if *got == TAG_BYTES {
                        let (h, b, t) = (*hdr, *buf, *tag);
                        let payload: &[u8] = match b {
                            Some(b) => &engine.buffer(b)[..h.b as usize],
                            None => &[],
                        };
                        let key = lane.key.as_ref().expect("Tag state only with a key");
                        if !key.verify(&h.to_bytes(), payload, &t) {
                            return Err(bad(format!(
                                "the tag of a frame (kind {}, message {}) does not match: altered on the way, or \
                                 not sent by rank {rank} (another MKERNEL_JOB_KEY?)",
                                h.kind, h.seq
                            )));
                        }
                        finish_frame(rank, li, me, lane, h, b)?;
                    }
                    Ok(())
                }
                Err(e) => Err(Some(e)),
            },
        };
        match r {
            Ok(()) => {}
            Err(Some(e)) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(Some(e)) if e.kind() == ErrorKind::Interrupted => {}
            Err(Some(e)) => {
                return Err(lost(rank, format!("connection lost on socket {li}: {e}")));
            }
            Err(None) => {
                lane.closed = true;
                let mid_frame = !matches!(lane.state, ReadState::Header { got: 0, .. });
                if lane.bye.is_none() || mid_frame {
                    return Err(lost(
                        rank,
                        format!("connection lost: socket {li} closed without goodbye (peer process died?)"),
                    ));
                }
                return Ok(());
            }
        }
    }
}

/// Acts on a complete (and, with tags, verified) frame `h` read from socket `li` of `rank`;
/// `buf` holds a DATA frame's payload. The socket then waits for the next header.
fn finish_frame(
    rank: usize,
    li: usize,
    me: usize,
    lane: &mut RxLane,
    h: Header,
    buf: Option<usize>,
) -> Result<(), TransportError> {
    lane.state = ReadState::Header {
        got: 0,
        bytes: [0; HEADER_BYTES],
    };
    // `Limits::check` refused `u64::MAX`, so the successor exists.
    let next = h.seq.saturating_add(1);
    match (h.kind, buf) {
        (KIND_DATA, Some(b)) => {
            lane.pending.push_back((
                h.seq,
                RxMsg::Data {
                    buf: b,
                    dst_offset: h.a,
                    len: h.b as usize,
                },
            ));
            lane.expect = next;
        }
        (KIND_SIGNAL, _) => {
            lane.pending.push_back((
                h.seq,
                RxMsg::Signal {
                    flag_offset: h.a,
                    value: h.b,
                },
            ));
            lane.expect = next;
        }
        (KIND_ABORT, _) => {
            lane.abort_origin = Some(h.a);
            let why = if h.a == NO_RANK {
                format!(
                    "its proxy failed on its own (a CUDA error, its process exiting, a bad command \
                     or an abort: rank {rank}'s error record says which)"
                )
            } else {
                format!("its proxy failed on its link with rank {}", h.a)
            };
            return Err(lost(rank, why));
        }
        (KIND_USER_ABORT | KIND_USER_ABORT_ACK, _) => {
            // Only the socket's authenticated peer may abort, and only its own rank; an ack
            // names this rank.
            let (notice, want) = if h.kind == KIND_USER_ABORT {
                (Notice::Abort, rank)
            } else {
                (Notice::Ack, me)
            };
            if h.a != want as u64 {
                return Err(lost(
                    rank,
                    format!(
                        "bad message on socket {li}: a user abort frame naming rank {} (must be {want})",
                        h.a
                    ),
                ));
            }
            lane.notices.push(notice);
        }
        (KIND_BYE, _) => lane.bye = Some(h.seq),
        (k, _) => {
            return Err(lost(
                rank,
                format!("bad message on socket {li}: frame kind {k} without its payload"),
            ))
        }
    }
    Ok(())
}

/// `sendmsg` of the concatenated `parts` (header, payload, trailer) from byte `skip` on,
/// without blocking and without SIGPIPE. `Ok(None)`: the socket is full.
fn send_parts(sock: &TcpStream, parts: [&[u8]; 3], mut skip: usize) -> std::io::Result<Option<usize>> {
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; 3];
    let mut n_iov = 0;
    for p in parts {
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        let rest = &p[skip..];
        skip = 0;
        iov[n_iov] = libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        };
        n_iov += 1;
    }
    if n_iov == 0 {
        return Ok(Some(0));
    }
    // SAFETY: plain struct; zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = n_iov as _;
    loop {
        // SAFETY: valid socket; the first `n_iov` iovecs point into live slices.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            ErrorKind::WouldBlock => return Ok(None),
            ErrorKind::Interrupted => continue,
            _ => return Err(e),
        }
    }
}

impl<E: DeviceStaging> Transport for TcpTransport<E> {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn post(&mut self, dst: usize, ops: &[Op]) -> Result<(), TransportError> {
        let r = self.post_ops(dst, ops);
        self.note(r)
    }

    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        let r = self.progress();
        completed.append(&mut self.done);
        self.note(r)
    }

    fn flush(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        let r = self.flush_all(completed);
        self.note(r)
    }

    fn send_abort(&mut self) -> Result<(), TransportError> {
        if !self.abort_sent {
            self.abort_sent = true;
            let me = self.me as u64;
            for p in &mut self.tx {
                for lane in &mut p.lanes {
                    lane.push_control(Header::user_abort(me));
                }
            }
        }
        let r = self.write();
        self.note(r)
    }

    fn poll_aborts(&mut self, on_peer_abort: &mut dyn FnMut(usize)) -> Result<bool, TransportError> {
        let r = self.take_notices(on_peer_abort);
        self.note(r)
    }
}

impl<E: DeviceStaging> TcpTransport<E> {
    fn take_notices(&mut self, on_peer_abort: &mut dyn FnMut(usize)) -> Result<bool, TransportError> {
        let mut ack = false;
        for slot in 0..self.peer_aborted.len() {
            if self.peer_aborted[slot] == Some(false) {
                self.peer_aborted[slot] = Some(true);
                let rank = self.rx[slot].rank;
                on_peer_abort(rank);
                // After the host's stores: the ack means "stored".
                for lane in &mut self.tx[slot].lanes {
                    lane.push_control(Header::user_abort_ack(rank as u64));
                }
                ack = true;
            }
        }
        if ack {
            self.write()?;
        }
        Ok(self.abort_sent && self.abort_acked.iter().all(|&a| a))
    }

    fn post_ops(&mut self, dst: usize, ops: &[Op]) -> Result<(), TransportError> {
        let slot = self
            .slot_of
            .get(dst)
            .copied()
            .flatten()
            .ok_or_else(|| lost(dst, "not a peer of this TCP transport".into()))?;
        self.clean = false;
        let p = &mut self.tx[slot];
        for op in ops {
            match *op {
                Op::Put {
                    seq,
                    src_offset,
                    dst_offset,
                    bytes,
                } => {
                    if bytes == 0 {
                        self.done.push(seq);
                        continue;
                    }
                    let chunk = p.chunk as u64;
                    let n = bytes.div_ceil(chunk);
                    let n32 =
                        u32::try_from(n).map_err(|_| lost(dst, format!("a put of {bytes} bytes is too large")))?;
                    *self.op_chunks.entry(seq).or_insert(0) += n32;
                    for i in 0..n {
                        let off = i * chunk;
                        p.backlog.push_back(Backlog::Data {
                            fifo_seq: seq,
                            src_offset: src_offset + off,
                            dst_offset: dst_offset + off,
                            len: (bytes - off).min(chunk) as usize,
                        });
                    }
                }
                Op::Signal {
                    seq,
                    flag_offset,
                    value,
                } => {
                    p.backlog.push_back(Backlog::Signal { flag_offset, value });
                    self.done.push(seq);
                }
            }
        }
        self.engine_completions()?;
        self.stage()?;
        self.write()
    }

    fn flush_all(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        let t0 = Instant::now();
        loop {
            self.progress()?;
            completed.append(&mut self.done);
            if self.idle() {
                self.clean = true;
                return Ok(());
            }
            if t0.elapsed() > self.timeout {
                let stuck: Vec<usize> = self
                    .tx
                    .iter()
                    .filter(|p| !p.backlog.is_empty() || p.lanes.iter().any(|l| !l.queue.is_empty()))
                    .map(|p| p.rank)
                    .collect();
                return Err(lost(
                    stuck.first().copied().unwrap_or(self.me),
                    format!(
                        "flush timed out after {:?}: data for ranks {stuck:?} still unsent",
                        self.timeout
                    ),
                ));
            }
            std::thread::yield_now();
        }
    }
}

impl<E: DeviceStaging> Drop for TcpTransport<E> {
    fn drop(&mut self) {
        // A clean stop says goodbye; a stop after an error (this transport's, or the proxy's:
        // a bad command, a host abort, a stop without flush) says ABORT, so the peers fail
        // naming this rank and the link that failed first. Only a process that dies closes its
        // sockets with neither, which the peers report as a lost connection.
        if self.clean {
            self.close_lanes(Header::bye);
        } else {
            let origin = self.failed.unwrap_or(NO_RANK);
            self.close_lanes(|next| Header::abort(next, origin));
        }
    }
}
