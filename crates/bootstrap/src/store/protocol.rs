//! The store's wire format: length-prefixed binary frames over TCP.
//!
//! A frame is a `u32` little-endian body length, then the body: a one-byte message type and
//! its fields. Integers are little endian; byte strings and strings are a `u32` length and the
//! bytes; rank lists are a `u32` count and `u32` ranks.
//!
//! ```text
//! handshake  store -> client  Hello    { "MKBS", version u16, store nonce [32] }
//!            client -> store  Auth     { rank u32, world u32, client nonce [32], proof [32] }
//!            store -> client  Welcome  { proof [32] }  or  Refused { reason }
//! requests   Set    { key, value }                 -> Done
//!            Get    { key, timeout_ms }            -> Value | TimedOut | Failed | TooLarge
//!            Gather { kind, name, timeout_ms, data } -> Gathered | TimedOut | RanksLeft | Failed | TooLarge
//! ```
//! One request is in flight per connection; the store answers each before reading the next.
//! A reply that would exceed the frame limit is replaced by `TooLarge { bytes, max }`.
use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::auth::{Tag, TAG_LEN};
use crate::error::Refusal;

/// Bytes that open a store's `Hello`.
const MAGIC: [u8; 4] = *b"MKBS";
/// The protocol version; both ends must speak the same (2: handshake refusals for truncated,
/// malformed, oversized, slow and replayed handshakes; the `TooLarge` reply).
pub(crate) const VERSION: u16 = 2;
/// Largest frame before the handshake completes (keeps strangers from making us allocate).
pub(crate) const MAX_HANDSHAKE_FRAME: usize = 1024;
/// Largest frame after it.
pub(crate) const MAX_FRAME: usize = 256 << 20;

/// Which collective a [`Msg::Gather`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum GatherKind {
    /// Waits for every rank; no data.
    Barrier,
    /// Waits for every rank and returns everyone's data.
    AllGather,
}

impl GatherKind {
    /// `barrier` or `all_gather`, for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            GatherKind::Barrier => "barrier",
            GatherKind::AllGather => "all_gather",
        }
    }
}

/// One protocol message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Msg {
    Hello {
        version: u16,
        nonce: Tag,
    },
    Auth {
        rank: u32,
        world_size: u32,
        nonce: Tag,
        proof: Tag,
    },
    Welcome {
        proof: Tag,
    },
    Refused(Refusal),
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout_ms: u64,
    },
    Gather {
        kind: GatherKind,
        name: String,
        timeout_ms: u64,
        data: Vec<u8>,
    },
    Done,
    Value(Vec<u8>),
    Gathered(Vec<Vec<u8>>),
    TimedOut {
        missing: Vec<u32>,
        never_connected: Vec<u32>,
    },
    RanksLeft(Vec<u32>),
    Failed(String),
    /// The reply would have been a frame body of `bytes` bytes, over the `max` limit.
    TooLarge {
        bytes: u64,
        max: u64,
    },
}

mod tag {
    pub const HELLO: u8 = 1;
    pub const AUTH: u8 = 2;
    pub const WELCOME: u8 = 3;
    pub const REFUSED: u8 = 4;
    pub const SET: u8 = 10;
    pub const GET: u8 = 11;
    pub const GATHER: u8 = 12;
    pub const DONE: u8 = 20;
    pub const VALUE: u8 = 21;
    pub const GATHERED: u8 = 22;
    pub const TIMED_OUT: u8 = 23;
    pub const RANKS_LEFT: u8 = 24;
    pub const FAILED: u8 = 25;
    pub const TOO_LARGE: u8 = 26;
}

/// Why a frame could not be read or written, carried inside an [`io::Error`] (see
/// [`frame_error`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// The length prefix (or the encoded message) exceeds the limit.
    TooLarge { len: usize, max: usize },
    /// The body ended before its fields did.
    Truncated,
    /// Anything else that is not a message of this protocol.
    Malformed(String),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::TooLarge { len, max } => write!(f, "frame of {len} bytes exceeds the {max}-byte limit"),
            FrameError::Truncated => write!(f, "truncated message"),
            FrameError::Malformed(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for FrameError {}

/// The [`FrameError`] inside `e`, if it is one.
pub(crate) fn frame_error(e: &io::Error) -> Option<&FrameError> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<FrameError>())
}

fn frame(kind: io::ErrorKind, e: FrameError) -> io::Error {
    io::Error::new(kind, e)
}

/// Writes `msg` as one frame of at most `max` body bytes; a larger message is an
/// `InvalidInput` error carrying [`FrameError::TooLarge`], and nothing is written.
pub(crate) fn write_msg_max(mut w: impl Write, msg: &Msg, max: usize) -> io::Result<()> {
    let body = encode(msg);
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l as usize <= max)
        .ok_or_else(|| {
            frame(
                io::ErrorKind::InvalidInput,
                FrameError::TooLarge { len: body.len(), max },
            )
        })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()
}

/// Writes `msg` as one frame (at most [`MAX_FRAME`] body bytes).
pub(crate) fn write_msg(w: impl Write, msg: &Msg) -> io::Result<()> {
    write_msg_max(w, msg, MAX_FRAME)
}

/// Reads one frame of at most `max` bytes. A malformed or oversized frame is an `InvalidData`
/// error carrying a [`FrameError`]; a frame cut short by the end of the stream is
/// `UnexpectedEof`.
pub(crate) fn read_msg(mut r: impl Read, max: usize) -> io::Result<Msg> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(frame(io::ErrorKind::InvalidData, FrameError::TooLarge { len, max }));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    decode(&body)
}

/// Reads from a socket with an absolute deadline: each `read` waits at most until `deadline`,
/// so a peer that trickles one byte at a time cannot stretch a handshake beyond it.
pub(crate) struct DeadlineReader<'a> {
    pub stream: &'a TcpStream,
    pub deadline: Instant,
    /// Bytes read so far.
    pub read: usize,
}

impl<'a> DeadlineReader<'a> {
    /// A reader of `stream` that gives up at `deadline`.
    pub fn new(stream: &'a TcpStream, deadline: Instant) -> Self {
        DeadlineReader {
            stream,
            deadline,
            read: 0,
        }
    }
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        // A zero timeout would mean "block forever".
        self.stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        let n = (&mut &*self.stream).read(buf)?;
        self.read += n;
        Ok(n)
    }
}

fn invalid(msg: impl Into<String>) -> io::Error {
    frame(io::ErrorKind::InvalidData, FrameError::Malformed(msg.into()))
}

fn truncated() -> io::Error {
    frame(io::ErrorKind::InvalidData, FrameError::Truncated)
}

fn encode(msg: &Msg) -> Vec<u8> {
    let mut e = Enc(Vec::new());
    match msg {
        Msg::Hello { version, nonce } => {
            e.u8(tag::HELLO);
            e.0.extend_from_slice(&MAGIC);
            e.u16(*version);
            e.tag(nonce);
        }
        Msg::Auth {
            rank,
            world_size,
            nonce,
            proof,
        } => {
            e.u8(tag::AUTH);
            e.u32(*rank);
            e.u32(*world_size);
            e.tag(nonce);
            e.tag(proof);
        }
        Msg::Welcome { proof } => {
            e.u8(tag::WELCOME);
            e.tag(proof);
        }
        Msg::Refused(reason) => {
            e.u8(tag::REFUSED);
            let (code, a, b) = match *reason {
                Refusal::WrongKey => (0u8, 0, 0),
                Refusal::DuplicateRank { rank } => (1, rank, 0),
                Refusal::RankOutOfRange { rank, world_size } => (2, rank, world_size),
                Refusal::WorldSizeMismatch { client, store } => (3, client, store),
                Refusal::Truncated => (4, 0, 0),
                Refusal::Malformed => (5, 0, 0),
                Refusal::FrameTooLarge { len, max } => (6, len, max),
                Refusal::HandshakeTimeout { after } => (7, usize::try_from(after.as_millis()).unwrap_or(usize::MAX), 0),
                Refusal::Replayed => (8, 0, 0),
            };
            e.u8(code);
            e.u64(a as u64);
            e.u64(b as u64);
        }
        Msg::Set { key, value } => {
            e.u8(tag::SET);
            e.bytes(key.as_bytes());
            e.bytes(value);
        }
        Msg::Get { key, timeout_ms } => {
            e.u8(tag::GET);
            e.bytes(key.as_bytes());
            e.u64(*timeout_ms);
        }
        Msg::Gather {
            kind,
            name,
            timeout_ms,
            data,
        } => {
            e.u8(tag::GATHER);
            e.u8(match kind {
                GatherKind::Barrier => 0,
                GatherKind::AllGather => 1,
            });
            e.bytes(name.as_bytes());
            e.u64(*timeout_ms);
            e.bytes(data);
        }
        Msg::Done => e.u8(tag::DONE),
        Msg::Value(v) => {
            e.u8(tag::VALUE);
            e.bytes(v);
        }
        Msg::Gathered(all) => {
            e.u8(tag::GATHERED);
            e.u32(all.len() as u32);
            for v in all {
                e.bytes(v);
            }
        }
        Msg::TimedOut {
            missing,
            never_connected,
        } => {
            e.u8(tag::TIMED_OUT);
            e.ranks(missing);
            e.ranks(never_connected);
        }
        Msg::RanksLeft(ranks) => {
            e.u8(tag::RANKS_LEFT);
            e.ranks(ranks);
        }
        Msg::Failed(why) => {
            e.u8(tag::FAILED);
            e.bytes(why.as_bytes());
        }
        Msg::TooLarge { bytes, max } => {
            e.u8(tag::TOO_LARGE);
            e.u64(*bytes);
            e.u64(*max);
        }
    }
    e.0
}

fn decode(body: &[u8]) -> io::Result<Msg> {
    let mut d = Dec { buf: body, pos: 0 };
    let msg = match d.u8()? {
        tag::HELLO => {
            if d.take(4)? != MAGIC {
                return Err(invalid("not an mkernel bootstrap store (bad magic)"));
            }
            Msg::Hello {
                version: d.u16()?,
                nonce: d.tag()?,
            }
        }
        tag::AUTH => Msg::Auth {
            rank: d.u32()?,
            world_size: d.u32()?,
            nonce: d.tag()?,
            proof: d.tag()?,
        },
        tag::WELCOME => Msg::Welcome { proof: d.tag()? },
        tag::REFUSED => {
            let code = d.u8()?;
            let a = d.u64()? as usize;
            let b = d.u64()? as usize;
            Msg::Refused(match code {
                0 => Refusal::WrongKey,
                1 => Refusal::DuplicateRank { rank: a },
                2 => Refusal::RankOutOfRange { rank: a, world_size: b },
                3 => Refusal::WorldSizeMismatch { client: a, store: b },
                4 => Refusal::Truncated,
                5 => Refusal::Malformed,
                6 => Refusal::FrameTooLarge { len: a, max: b },
                7 => Refusal::HandshakeTimeout {
                    after: Duration::from_millis(a as u64),
                },
                8 => Refusal::Replayed,
                c => return Err(invalid(format!("unknown refusal code {c}"))),
            })
        }
        tag::SET => Msg::Set {
            key: d.string()?,
            value: d.bytes()?,
        },
        tag::GET => Msg::Get {
            key: d.string()?,
            timeout_ms: d.u64()?,
        },
        tag::GATHER => {
            let kind = match d.u8()? {
                0 => GatherKind::Barrier,
                1 => GatherKind::AllGather,
                k => return Err(invalid(format!("unknown gather kind {k}"))),
            };
            Msg::Gather {
                kind,
                name: d.string()?,
                timeout_ms: d.u64()?,
                data: d.bytes()?,
            }
        }
        tag::DONE => Msg::Done,
        tag::VALUE => Msg::Value(d.bytes()?),
        tag::GATHERED => {
            let n = d.u32()?;
            // Each entry takes at least its 4-byte length: bound the allocation by the frame.
            if n as usize > body.len() / 4 {
                return Err(truncated());
            }
            let mut all = Vec::with_capacity(n as usize);
            for _ in 0..n {
                all.push(d.bytes()?);
            }
            Msg::Gathered(all)
        }
        tag::TIMED_OUT => Msg::TimedOut {
            missing: d.ranks()?,
            never_connected: d.ranks()?,
        },
        tag::RANKS_LEFT => Msg::RanksLeft(d.ranks()?),
        tag::FAILED => Msg::Failed(d.string()?),
        tag::TOO_LARGE => Msg::TooLarge {
            bytes: d.u64()?,
            max: d.u64()?,
        },
        t => return Err(invalid(format!("unknown message type {t}"))),
    };
    if d.pos != body.len() {
        return Err(invalid(format!(
            "{} trailing bytes after a message",
            body.len() - d.pos
        )));
    }
    Ok(msg)
}

struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn tag(&mut self, t: &Tag) {
        self.0.extend_from_slice(t);
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
    fn ranks(&mut self, ranks: &[u32]) {
        self.u32(ranks.len() as u32);
        for &r in ranks {
            self.u32(r);
        }
    }
}

struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(truncated)?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> io::Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn tag(&mut self) -> io::Result<Tag> {
        self.array::<TAG_LEN>()
    }
    fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> io::Result<String> {
        String::from_utf8(self.bytes()?).map_err(|_| invalid("a string is not UTF-8"))
    }
    fn ranks(&mut self) -> io::Result<Vec<u32>> {
        let n = self.u32()? as usize;
        // Bound the allocation by what the frame can hold.
        if n > self.buf.len() / 4 {
            return Err(truncated());
        }
        (0..n).map(|_| self.u32()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(m: Msg) {
        let mut buf = Vec::new();
        write_msg(&mut buf, &m).unwrap();
        assert_eq!(read_msg(buf.as_slice(), MAX_FRAME).unwrap(), m);
    }

    #[test]
    fn every_message_round_trips() {
        for m in [
            Msg::Hello {
                version: VERSION,
                nonce: [7; 32],
            },
            Msg::Auth {
                rank: 3,
                world_size: 4,
                nonce: [1; 32],
                proof: [2; 32],
            },
            Msg::Welcome { proof: [9; 32] },
            Msg::Refused(Refusal::WrongKey),
            Msg::Refused(Refusal::DuplicateRank { rank: 2 }),
            Msg::Refused(Refusal::RankOutOfRange { rank: 9, world_size: 4 }),
            Msg::Refused(Refusal::WorldSizeMismatch { client: 8, store: 4 }),
            Msg::Set {
                key: "k".into(),
                value: vec![1, 2, 3],
            },
            Msg::Get {
                key: "k".into(),
                timeout_ms: 5,
            },
            Msg::Gather {
                kind: GatherKind::AllGather,
                name: "n".into(),
                timeout_ms: 1,
                data: vec![4],
            },
            Msg::Gather {
                kind: GatherKind::Barrier,
                name: "b".into(),
                timeout_ms: 1,
                data: vec![],
            },
            Msg::Done,
            Msg::Value(vec![]),
            Msg::Gathered(vec![vec![1], vec![], vec![2, 3]]),
            Msg::TimedOut {
                missing: vec![3],
                never_connected: vec![],
            },
            Msg::RanksLeft(vec![1, 2]),
            Msg::Failed("why".into()),
            Msg::TooLarge { bytes: 9, max: 8 },
            Msg::Refused(Refusal::Truncated),
            Msg::Refused(Refusal::Malformed),
            Msg::Refused(Refusal::FrameTooLarge {
                len: 1 << 31,
                max: 1024,
            }),
            Msg::Refused(Refusal::HandshakeTimeout {
                after: Duration::from_millis(1500),
            }),
            Msg::Refused(Refusal::Replayed),
        ] {
            round_trip(m);
        }
    }

    #[test]
    fn malformed_frames_are_rejected() {
        let frame = |body: &[u8]| {
            let mut f = (body.len() as u32).to_le_bytes().to_vec();
            f.extend_from_slice(body);
            f
        };
        for body in [
            &[99u8][..],
            &[tag::SET, 5, 0, 0, 0, b'a'],
            &[tag::DONE, 0],
            &[tag::HELLO, b'H', b'T', b'T', b'P'],
        ] {
            let e = read_msg(frame(body).as_slice(), MAX_FRAME).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{body:?}: {e}");
        }
        // An oversized length is refused before allocating.
        let e = read_msg(&u32::MAX.to_le_bytes()[..], MAX_HANDSHAKE_FRAME).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert_eq!(
            frame_error(&e),
            Some(&FrameError::TooLarge {
                len: u32::MAX as usize,
                max: MAX_HANDSHAKE_FRAME
            })
        );
        // Fields that run past the body, and a frame cut short by the stream's end.
        let e = read_msg(frame(&[tag::AUTH, 1, 0]).as_slice(), MAX_FRAME).unwrap_err();
        assert_eq!(frame_error(&e), Some(&FrameError::Truncated));
        let mut short = frame(&[tag::SET, 1, 0, 0, 0, b'k', 0, 0, 0, 0]);
        short.truncate(7);
        assert_eq!(
            read_msg(short.as_slice(), MAX_FRAME).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        // A message over the limit is not written at all.
        let mut out = Vec::new();
        let e = write_msg_max(&mut out, &Msg::Value(vec![0; 100]), 64).unwrap_err();
        assert_eq!(frame_error(&e), Some(&FrameError::TooLarge { len: 105, max: 64 }));
        assert!(out.is_empty());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 4000, ..Default::default() })]

        /// Any bytes: a message or an error, never a panic or an allocation beyond the frame.
        #[test]
        fn random_frames_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..96), tag in 0u8..30) {
            let mut body = vec![tag];
            body.extend_from_slice(&bytes);
            let mut f = (body.len() as u32).to_le_bytes().to_vec();
            f.extend_from_slice(&body);
            if let Ok(m) = read_msg(f.as_slice(), MAX_HANDSHAKE_FRAME) {
                // What decodes re-encodes to the same bytes.
                let mut again = Vec::new();
                write_msg(&mut again, &m).unwrap();
                proptest::prop_assert_eq!(again, f);
            }
            let _ = read_msg(bytes.as_slice(), MAX_HANDSHAKE_FRAME);
        }
    }
}
