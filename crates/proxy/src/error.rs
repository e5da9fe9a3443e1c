//! Error types: the codes written into the FIFO's error record, and the Rust errors.
use thiserror::Error;

/// Why the proxy aborted, as the `u32` written into `FifoHeader::abort` and `ErrorRecord::code`.
/// The device side may print these numbers; keep them stable.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// `opcode` is not one of `OP_*`.
    BadOpcode = 1,
    /// `dst_rank` is not below the world size.
    RankOutOfRange = 2,
    /// `dst_rank` is this rank, or a peer reached over NVLink rather than through the proxy.
    NotRemotePeer = 3,
    /// `[src_offset, src_offset + bytes)` overflows or leaves the local data region.
    SrcOutOfRange = 4,
    /// `[dst_offset, dst_offset + bytes)` overflows or leaves the receiver's data region (on
    /// mkernel's heap: it would touch the control, LL or staging area).
    DstOutOfRange = 5,
    /// `flag_offset` is not 8-byte aligned or outside the receiver's flag region (on mkernel's
    /// heap: the inter-node flags, not the error record, abort word or epoch counters).
    BadFlagOffset = 6,
    /// `epoch` is smaller than the epoch of an earlier command of this FIFO.
    EpochRegressed = 7,
    /// Unknown `flags` bits, or fields that must be zero for this opcode are not.
    BadFields = 8,
    /// A flag would be raised with value 0 (indistinguishable from "not yet").
    ZeroFlagValue = 9,
    /// A slot header held neither 0 nor the expected `seq + 1`: the producer overran the ring.
    SlotOverrun = 10,
    /// The flag is another sender's (flag `(slot, src)` may only be raised by rank `src`).
    FlagNotOwned = 11,
    /// The transport (NIC, copy engine) failed.
    Transport = 16,
    /// The host raised `abort` (for example because another rank failed).
    HostAbort = 17,
}

impl ErrorCode {
    /// The code for a raw value read from the FIFO, if it is a known one.
    pub fn from_u32(v: u32) -> Option<ErrorCode> {
        use ErrorCode::*;
        Some(match v {
            1 => BadOpcode,
            2 => RankOutOfRange,
            3 => NotRemotePeer,
            4 => SrcOutOfRange,
            5 => DstOutOfRange,
            6 => BadFlagOffset,
            7 => EpochRegressed,
            8 => BadFields,
            9 => ZeroFlagValue,
            10 => SlotOverrun,
            11 => FlagNotOwned,
            16 => Transport,
            17 => HostAbort,
            _ => return None,
        })
    }
}

/// A command that failed validation: what was wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{code:?}: {reason}")]
pub struct Violation {
    /// The error-record code.
    pub code: ErrorCode,
    /// What exactly was wrong (names the offending values).
    pub reason: String,
}

impl Violation {
    /// A violation with `code` and `reason`.
    pub fn new(code: ErrorCode, reason: impl Into<String>) -> Self {
        Violation {
            code,
            reason: reason.into(),
        }
    }
}

/// Errors of a transport backend (NIC, emulated wire, copy engine).
#[derive(Debug, Error)]
pub enum TransportError {
    /// No RDMA device is present or usable; the message says what was looked at.
    #[error("no RDMA device found: {0}")]
    NoDevice(String),
    /// A verbs (or efadv) call failed.
    #[error("{call} failed: {detail}")]
    Verbs {
        /// The failing function.
        call: &'static str,
        /// errno text or status.
        detail: String,
    },
    /// A work completion came back with an error status.
    #[error("work completion error on {peer}: {detail}")]
    Completion {
        /// Which peer / lane.
        peer: String,
        /// Status text.
        detail: String,
    },
    /// The copy engine of the emulated wire failed.
    #[error("copy engine: {0}")]
    Copy(String),
    /// A peer is not connected, or an operation does not fit its registered memory.
    #[error("peer {peer}: {detail}")]
    Peer {
        /// The peer rank.
        peer: usize,
        /// What is wrong.
        detail: String,
    },
    /// Bad configuration (sizes, counts, environment).
    #[error("configuration: {0}")]
    Config(String),
    /// A connection blob could not be parsed.
    #[error("connection blob: {0}")]
    Blob(String),
    /// Reading sysfs failed.
    #[error("sysfs {path}: {source}")]
    Sysfs {
        /// The path read.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Waiting for completions was abandoned because the FIFO was aborted.
    #[error("aborted while waiting for completions")]
    Aborted,
    /// The backend does not do this (the message says what and why).
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl TransportError {
    /// [`TransportError::Peer`] for a peer the backend has no connection to.
    pub fn not_connected(peer: usize) -> Self {
        TransportError::Peer {
            peer,
            detail: "not connected".into(),
        }
    }
}

/// Errors of the FIFO and the proxy thread; what `Proxy::join` returns.
#[derive(Debug, Error)]
pub enum ProxyError {
    /// A command failed validation; nothing was written for it.
    #[error("rank {rank}: command seq {seq} rejected: {violation}")]
    BadCommand {
        /// The proxy's rank.
        rank: u32,
        /// The slot sequence number.
        seq: u64,
        /// What was wrong.
        violation: Violation,
    },
    /// The transport failed while carrying out command `seq` (or between commands).
    #[error("rank {rank}: transport failed (seq {seq:?}): {source}")]
    Transport {
        /// The proxy's rank.
        rank: u32,
        /// The command being carried out, if known.
        seq: Option<u64>,
        /// The backend's error.
        #[source]
        source: TransportError,
    },
    /// `abort` was raised by someone else (the host); the record they wrote is included.
    #[error("rank {rank}: FIFO aborted with code {code} (seq {seq}): {message}")]
    Aborted {
        /// The proxy's rank.
        rank: u32,
        /// The raw abort code.
        code: u32,
        /// Sequence number from the error record.
        seq: u64,
        /// Message from the error record.
        message: String,
    },
    /// The FIFO memory is not a valid FIFO (bad magic, version, capacity, alignment).
    #[error("invalid FIFO: {0}")]
    InvalidFifo(String),
    /// Bad proxy configuration.
    #[error("proxy configuration: {0}")]
    Config(String),
    /// The proxy thread could not be started.
    #[error("cannot start the proxy thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The proxy thread panicked (a bug).
    #[error("the proxy thread of rank {0} panicked")]
    Panicked(u32),
}

impl ProxyError {
    /// The error-record code this error is reported with.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProxyError::BadCommand { violation, .. } => violation.code,
            ProxyError::Transport { .. } | ProxyError::Panicked(_) | ProxyError::Spawn(_) => ErrorCode::Transport,
            ProxyError::Aborted { code, .. } => ErrorCode::from_u32(*code).unwrap_or(ErrorCode::HostAbort),
            ProxyError::InvalidFifo(_) | ProxyError::Config(_) => ErrorCode::BadFields,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for v in 0..32 {
            if let Some(c) = ErrorCode::from_u32(v) {
                assert_eq!(c as u32, v);
            }
        }
        assert_eq!(ErrorCode::from_u32(0), None);
    }
}
