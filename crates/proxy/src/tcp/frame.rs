//! What travels on the TCP transport's sockets: a 64-byte hello when a socket is set up, then
//! 32-byte frame headers (a data frame is followed by its payload; with per-frame
//! authentication, the default, every frame then ends with a 16-byte tag over header and payload:
//! [`super::mac`]). Little-endian throughout.
//!
//! Hello (both directions, once per socket):
//!
//! | offset | field | type | meaning |
//! |---:|---|---|---|
//! | 0 | `magic` | [u8; 4] | `"MKTH"` |
//! | 4 | `version` | u32 | [`WIRE_VERSION`] |
//! | 8 | `from` | u32 | sender's global rank |
//! | 12 | `to` | u32 | receiver's global rank |
//! | 16 | `lane` | u32 | socket index of this pair, `0..lanes` |
//! | 20 | `lanes` | u32 | sockets per (sender, receiver) pair |
//! | 24 | `max_payload` | u32 | largest data payload the sender of this hello accepts |
//! | 28 | `status` | u32 | 0; in the answer, a [`Refused`] code |
//! | 32 | `token` | [u8; 32] | the *receiver's* secret as published in the store |
//!
//! Frame header:
//!
//! | offset | field | type | DATA (1) | SIGNAL (2) | BYE (3) | ABORT (4) | USER_ABORT (5) | USER_ABORT_ACK (6) |
//! |---:|---|---|---|---|---|---|---|---|
//! | 0 | `kind` | u32 | 1 | 2 | 3 | 4 | 5 | 6 |
//! | 4 | `reserved` | u32 | 0 | 0 | 0 | 0 | 0 | 0 |
//! | 8 | `seq` | u64 | message number | message number | next message number | next message number | 0 | 0 |
//! | 16 | `a` | u64 | destination offset in the data region | flag offset | 0 | rank whose link failed first, or [`NO_RANK`] | the sender's rank | the receiver's rank |
//! | 24 | `b` | u64 | payload bytes (1..=max_payload) | flag value (nonzero) | 0 | 0 | 0 | 0 |
//!
//! Message numbers count every DATA and SIGNAL frame from one sender to one receiver over all
//! of its sockets, from 0; on each socket they increase. The receiver carries frames out in
//! message-number order, so the wire keeps the order of the FIFO as the emulated wire does.
//!
//! BYE closes a socket after a clean stop. ABORT closes it after the sender's proxy failed (a
//! lost peer, a bad frame or command, a host abort): the receiver then fails too, naming the
//! sender and, in `a`, the rank whose link failed first, instead of reporting a socket that
//! closed without goodbye (which is what a process that died leaves).
//!
//! USER_ABORT says "the sender's rank called `Communicator::abort()`"; the connection stays up.
//! It is a control frame outside the message order (no message number; `a` must be the rank
//! the socket's hello authenticated): the sender puts it on every socket to the receiver right
//! after the frame in progress, ahead of queued data, and the receiver acts on it as soon as
//! it reads it (its host stores the rank into its node's abort words), then answers once per
//! sender with USER_ABORT_ACK (`a` = the rank that aborted, i.e. the ack's receiver), sent the
//! same way. An acknowledgement of an abort the receiver never sent is a bad frame.
use crate::error::TransportError;

/// `Hello::magic`.
pub const HELLO_MAGIC: [u8; 4] = *b"MKTH";
/// Version of this wire format.
/// (2: ABORT frames; 3: USER_ABORT and USER_ABORT_ACK frames; 4: frame tags.)
pub const WIRE_VERSION: u32 = 4;
/// Bytes of a hello.
pub const HELLO_BYTES: usize = 64;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 32;
/// Bytes of the per-rank secret.
pub const TOKEN_BYTES: usize = 32;

/// Frame kind: data follows.
pub const KIND_DATA: u32 = 1;
/// Frame kind: store a flag after every earlier message.
pub const KIND_SIGNAL: u32 = 2;
/// Frame kind: the sender closes this socket cleanly; nothing follows.
pub const KIND_BYE: u32 = 3;
/// Frame kind: the sender's proxy failed and closes this socket; nothing follows.
pub const KIND_ABORT: u32 = 4;
/// Frame kind: the sender's rank called abort(); out of message order, nothing follows.
pub const KIND_USER_ABORT: u32 = 5;
/// Frame kind: the sender stored the receiver's USER_ABORT into its node's abort words.
pub const KIND_USER_ABORT_ACK: u32 = 6;
/// `a` of an ABORT whose sender did not fail on a link (a bad command, a host abort).
pub const NO_RANK: u64 = u64::MAX;

/// Why an acceptor refused a socket (`Hello::status` of its answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Refused {
    /// Accepted.
    Ok = 0,
    /// The sockets-per-peer counts differ.
    LaneCount = 1,
    /// This (sender, lane) is already connected.
    Duplicate = 2,
    /// The sender is not a proxy peer of the acceptor.
    NotPeer = 3,
}

/// The first 64 bytes on every socket, in both directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Sender's rank.
    pub from: u32,
    /// Receiver's rank.
    pub to: u32,
    /// Socket index.
    pub lane: u32,
    /// Sockets per pair.
    pub lanes: u32,
    /// Largest payload the sender of this hello accepts.
    pub max_payload: u32,
    /// 0, or a [`Refused`] code in an answer.
    pub status: u32,
    /// The receiver's secret.
    pub token: [u8; TOKEN_BYTES],
}

impl Hello {
    /// The 64 bytes.
    pub fn to_bytes(&self) -> [u8; HELLO_BYTES] {
        let mut b = [0u8; HELLO_BYTES];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..8].copy_from_slice(&WIRE_VERSION.to_le_bytes());
        for (i, v) in [self.from, self.to, self.lane, self.lanes, self.max_payload, self.status]
            .iter()
            .enumerate()
        {
            b[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        b[32..64].copy_from_slice(&self.token);
        b
    }

    /// Parses and checks magic and version.
    pub fn from_bytes(b: &[u8; HELLO_BYTES]) -> Result<Hello, TransportError> {
        if b[0..4] != HELLO_MAGIC {
            return Err(TransportError::Blob(format!(
                "not an mkernel TCP hello (magic {:02x?})",
                &b[0..4]
            )));
        }
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u(4) != WIRE_VERSION {
            return Err(TransportError::Blob(format!(
                "TCP wire version {}, this build speaks {WIRE_VERSION}",
                u(4)
            )));
        }
        let mut token = [0u8; TOKEN_BYTES];
        token.copy_from_slice(&b[32..64]);
        Ok(Hello {
            from: u(8),
            to: u(12),
            lane: u(16),
            lanes: u(20),
            max_payload: u(24),
            status: u(28),
            token,
        })
    }
}

/// A frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// `KIND_*`.
    pub kind: u32,
    /// Must be 0.
    pub reserved: u32,
    /// Message number.
    pub seq: u64,
    /// Destination offset (DATA) or flag offset (SIGNAL).
    pub a: u64,
    /// Payload bytes (DATA) or flag value (SIGNAL).
    pub b: u64,
}

impl Header {
    /// A DATA header.
    pub fn data(seq: u64, dst_offset: u64, bytes: u64) -> Header {
        Header {
            kind: KIND_DATA,
            reserved: 0,
            seq,
            a: dst_offset,
            b: bytes,
        }
    }
    /// A SIGNAL header.
    pub fn signal(seq: u64, flag_offset: u64, value: u64) -> Header {
        Header {
            kind: KIND_SIGNAL,
            reserved: 0,
            seq,
            a: flag_offset,
            b: value,
        }
    }
    /// A BYE header.
    pub fn bye(next_seq: u64) -> Header {
        Header {
            kind: KIND_BYE,
            reserved: 0,
            seq: next_seq,
            a: 0,
            b: 0,
        }
    }

    /// An ABORT header: the sender failed, first on its link with `origin` (or [`NO_RANK`]).
    pub fn abort(next_seq: u64, origin: u64) -> Header {
        Header {
            kind: KIND_ABORT,
            reserved: 0,
            seq: next_seq,
            a: origin,
            b: 0,
        }
    }

    /// A USER_ABORT header: rank `from` (the sender) called abort().
    pub fn user_abort(from: u64) -> Header {
        Header {
            kind: KIND_USER_ABORT,
            reserved: 0,
            seq: 0,
            a: from,
            b: 0,
        }
    }

    /// A USER_ABORT_ACK header: the sender stored the abort of rank `aborter` (the receiver).
    pub fn user_abort_ack(aborter: u64) -> Header {
        Header {
            kind: KIND_USER_ABORT_ACK,
            reserved: 0,
            seq: 0,
            a: aborter,
            b: 0,
        }
    }

    /// The 32 bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&self.kind.to_le_bytes());
        out[4..8].copy_from_slice(&self.reserved.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.a.to_le_bytes());
        out[24..32].copy_from_slice(&self.b.to_le_bytes());
        out
    }

    /// Parses (no checks; see [`Limits::check`]).
    pub fn from_bytes(x: &[u8; HEADER_BYTES]) -> Header {
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&x[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Header {
            kind: u32::from_le_bytes([x[0], x[1], x[2], x[3]]),
            reserved: u32::from_le_bytes([x[4], x[5], x[6], x[7]]),
            seq: u64_at(8),
            a: u64_at(16),
            b: u64_at(24),
        }
    }
}

/// What a receiver accepts: its own region sizes and its payload limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of this rank's data region.
    pub data_bytes: u64,
    /// Bytes of this rank's flag array.
    pub flag_bytes: u64,
    /// Largest payload of one DATA frame.
    pub max_payload: u64,
}

impl Limits {
    /// Checks a header received on a socket whose next message number is `expect_at_least`
    /// (message numbers on one socket increase, up to `u64::MAX - 1`; USER_ABORT and its ack
    /// carry none). Returns
    /// the reason for refusing it. (Who may send a USER_ABORT or its ack is the transport's
    /// check: `a` against the socket's peer.)
    pub fn check(&self, h: &Header, expect_at_least: u64) -> Result<(), String> {
        if h.reserved != 0 {
            return Err(format!("reserved field {:#x} is not 0", h.reserved));
        }
        if matches!(h.kind, KIND_USER_ABORT | KIND_USER_ABORT_ACK) {
            if h.seq != 0 || h.b != 0 {
                return Err("user abort frame with a message number or a length".into());
            }
            return Ok(());
        }
        // The receiver's next expected number is `seq + 1`: the last number has none.
        if h.seq == u64::MAX {
            return Err(format!("message number {} has no successor", h.seq));
        }
        if h.seq < expect_at_least {
            return Err(format!(
                "message number {} is below {expect_at_least} (replayed or reordered)",
                h.seq
            ));
        }
        match h.kind {
            KIND_DATA => {
                if h.b == 0 || h.b > self.max_payload {
                    return Err(format!(
                        "data frame of {} bytes (1..={} allowed)",
                        h.b, self.max_payload
                    ));
                }
                match h.a.checked_add(h.b) {
                    Some(end) if end <= self.data_bytes => Ok(()),
                    _ => Err(format!(
                        "data [{}, +{}) outside the {}-byte data region",
                        h.a, h.b, self.data_bytes
                    )),
                }
            }
            KIND_SIGNAL => {
                if h.a % crate::protocol::FLAG_BYTES != 0
                    || h.a
                        .checked_add(crate::protocol::FLAG_BYTES)
                        .is_none_or(|e| e > self.flag_bytes)
                {
                    return Err(format!(
                        "flag offset {} is unaligned or outside the {}-byte flag array",
                        h.a, self.flag_bytes
                    ));
                }
                if h.b == 0 {
                    return Err("flag value 0".into());
                }
                Ok(())
            }
            KIND_BYE => {
                if h.a != 0 || h.b != 0 {
                    return Err("goodbye frame with nonzero fields".into());
                }
                Ok(())
            }
            KIND_ABORT => {
                if h.b != 0 {
                    return Err("abort frame with nonzero length".into());
                }
                Ok(())
            }
            k => Err(format!("unknown frame kind {k}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_and_header_round_trip() {
        let h = Hello {
            from: 3,
            to: 9,
            lane: 1,
            lanes: 2,
            max_payload: 1 << 19,
            status: 0,
            token: [7; 32],
        };
        assert_eq!(Hello::from_bytes(&h.to_bytes()).unwrap(), h);
        let mut bad = h.to_bytes();
        bad[0] = b'X';
        assert!(Hello::from_bytes(&bad).is_err());
        let mut old = h.to_bytes();
        old[4] = 9;
        assert!(Hello::from_bytes(&old).unwrap_err().to_string().contains("version 9"));
        let d = Header::data(5, 64, 128);
        assert_eq!(Header::from_bytes(&d.to_bytes()), d);
    }

    #[test]
    fn limits_refuse_every_bad_field() {
        let l = Limits {
            data_bytes: 1024,
            flag_bytes: 64,
            max_payload: 512,
        };
        assert!(l.check(&Header::data(4, 0, 512), 4).is_ok());
        assert!(l.check(&Header::data(3, 0, 8), 4).unwrap_err().contains("below"));
        assert!(l.check(&Header::data(4, 0, 513), 4).is_err());
        assert!(l.check(&Header::data(4, 0, 0), 4).is_err());
        assert!(l.check(&Header::data(4, 1000, 64), 4).unwrap_err().contains("outside"));
        assert!(l.check(&Header::data(4, u64::MAX, 2), 4).is_err());
        assert!(l.check(&Header::signal(4, 56, 1), 4).is_ok());
        assert!(l.check(&Header::signal(4, 64, 1), 4).is_err());
        assert!(l.check(&Header::signal(4, 4, 1), 4).is_err());
        assert!(l.check(&Header::signal(4, 0, 0), 4).is_err());
        assert!(l.check(&Header::bye(4), 4).is_ok());
        assert!(l.check(&Header::abort(4, 3), 4).is_ok());
        assert!(l.check(&Header::abort(4, NO_RANK), 4).is_ok());
        let mut a = Header::abort(4, 3);
        a.b = 1;
        assert!(l.check(&a, 4).unwrap_err().contains("abort"));
        assert!(l.check(&Header::user_abort(1), 4).is_ok());
        assert!(l.check(&Header::user_abort_ack(0), 4).is_ok());
        let mut u = Header::user_abort(1);
        u.seq = 4;
        assert!(l.check(&u, 4).unwrap_err().contains("user abort"));
        let mut u = Header::user_abort_ack(1);
        u.b = 1;
        assert!(l.check(&u, 4).unwrap_err().contains("user abort"));
        for h in [
            Header::data(u64::MAX, 0, 8),
            Header::signal(u64::MAX, 0, 1),
            Header::bye(u64::MAX),
            Header::abort(u64::MAX, 3),
        ] {
            assert!(l.check(&h, 4).unwrap_err().contains("no successor"), "{h:?}");
        }
        assert!(l.check(&Header::signal(u64::MAX - 1, 0, 1), 4).is_ok());
        let mut k = Header::bye(4);
        k.kind = 9;
        assert!(l.check(&k, 0).unwrap_err().contains("kind 9"));
        let mut r = Header::signal(4, 0, 1);
        r.reserved = 1;
        assert!(l.check(&r, 0).is_err());
    }
}
