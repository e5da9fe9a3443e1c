//! The crate's error type. Every message names what to look at: the variable, the ranks that
//! did not arrive, the path with the wrong permissions.
use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::env::EnvError;

/// Result of this crate's operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why the store refused a client during the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The client's proof did not match the store's `MKERNEL_JOB_KEY`.
    WrongKey,
    /// Another connection already holds this rank.
    DuplicateRank {
        /// The rank the client claimed.
        rank: usize,
    },
    /// The rank is not below the store's world size.
    RankOutOfRange {
        /// The rank the client claimed.
        rank: usize,
        /// The store's world size.
        world_size: usize,
    },
    /// The client's `WORLD_SIZE` differs from the store's.
    WorldSizeMismatch {
        /// The client's world size.
        client: usize,
        /// The store's world size.
        store: usize,
    },
    /// The handshake frame ended before its length prefix or its fields said it would.
    Truncated,
    /// The handshake frame was not an `Auth` message of this protocol.
    Malformed,
    /// The handshake frame's length prefix exceeds what a handshake may send.
    FrameTooLarge {
        /// The announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The handshake did not complete within its deadline (however steadily bytes arrived).
    HandshakeTimeout {
        /// The deadline, from the connection's accept.
        after: Duration,
    },
    /// The `Auth` message repeats the nonce of an earlier successful handshake: a replay.
    Replayed,
}

impl Refusal {
    /// Whether a client should try again: the store was busy or slow, not wrong about it.
    pub fn is_transient(&self) -> bool {
        matches!(self, Refusal::HandshakeTimeout { .. })
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Refusal::WrongKey => write!(f, "wrong MKERNEL_JOB_KEY"),
            Refusal::DuplicateRank { rank } => {
                write!(
                    f,
                    "rank {rank} is already connected (two processes with the same RANK?)"
                )
            }
            Refusal::RankOutOfRange { rank, world_size } => {
                write!(f, "RANK {rank} is out of range for WORLD_SIZE {world_size}")
            }
            Refusal::WorldSizeMismatch { client, store } => {
                write!(f, "this client's WORLD_SIZE {client} differs from the store's {store}")
            }
            Refusal::Truncated => write!(f, "the handshake frame was truncated"),
            Refusal::Malformed => write!(f, "the handshake frame is not a bootstrap store Auth message"),
            Refusal::FrameTooLarge { len, max } => {
                write!(f, "a handshake frame of {len} bytes exceeds the {max}-byte limit")
            }
            Refusal::HandshakeTimeout { after } => {
                write!(f, "the handshake did not complete within {}", secs(after))
            }
            Refusal::Replayed => write!(
                f,
                "replayed handshake (its nonce was already used by an earlier connection)"
            ),
        }
    }
}

/// Errors of the bootstrap.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A rank variable is missing, unparsable or inconsistent.
    #[error(transparent)]
    Env(#[from] EnvError),

    /// Rank 0 could not listen on the store's address.
    #[error("could not host the bootstrap store on {addr}: {source}")]
    StoreBind {
        /// The address (`MASTER_ADDR:MASTER_PORT`).
        addr: String,
        /// What the system said.
        source: io::Error,
    },

    /// No store answered at the address before the deadline.
    #[error(
        "could not reach the bootstrap store at {addr} within {}: {last_error} \
         (is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?)",
        secs(*waited)
    )]
    StoreUnreachable {
        /// The address tried.
        addr: String,
        /// How long the client kept trying.
        waited: Duration,
        /// The last failure.
        last_error: String,
    },

    /// The store refused this client during the handshake.
    #[error("bootstrap store refused this client: {reason}")]
    Refused {
        /// Why.
        reason: Refusal,
    },

    /// The server at the address did not prove knowledge of the job key.
    #[error(
        "the server at {addr} is not this job's bootstrap store: it could not prove it knows \
         MKERNEL_JOB_KEY (another job's store on the same port, or a different service?)"
    )]
    StoreNotAuthentic {
        /// The address connected to.
        addr: String,
    },

    /// A collective operation, a get or an fd exchange did not complete in time.
    #[error("{}", timeout_message(op, *after, missing, never_connected))]
    Timeout {
        /// The operation, e.g. `barrier 'init'` or `fd exchange #2`.
        op: String,
        /// The timeout that expired.
        after: Duration,
        /// The ranks that did not arrive; empty for a `get` whose key was never set.
        missing: Vec<usize>,
        /// Of the missing ranks, those that never connected to the store.
        never_connected: Vec<usize>,
    },

    /// Ranks that an operation waited for closed their connection to the store.
    #[error("{op} failed: ranks {ranks:?} left the job (their connection to the store closed)")]
    RanksLeft {
        /// The operation.
        op: String,
        /// The ranks that left.
        ranks: Vec<usize>,
    },

    /// The connection to the store broke or the store shut down.
    #[error("lost the bootstrap store during {op}: {detail}")]
    StoreLost {
        /// The operation.
        op: String,
        /// What happened.
        detail: String,
    },

    /// The peer spoke something other than this crate's protocol.
    #[error("bootstrap protocol error: {0}")]
    Protocol(String),

    /// A request, or the store's reply to it, would not fit in one frame of the protocol.
    #[error(
        "{op}: the {} of {bytes} bytes exceeds the store's {max}-byte frame limit \
         (the store is for small records: exchange less per call, or split it over several keys)",
        if *reply { "reply" } else { "request" }
    )]
    TooLarge {
        /// The operation.
        op: String,
        /// `false`: the request (refused before sending); `true`: the store's reply (e.g. an
        /// all-gather of every rank's data), refused by the store, which still serves.
        reply: bool,
        /// The size of the frame's body.
        bytes: usize,
        /// The limit.
        max: usize,
    },

    /// The job directory is missing, not ours or readable by others.
    #[error("job directory {}: {problem}", path.display())]
    JobDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },

    /// A local peer's process runs as another user.
    #[error(
        "local peer on {} runs as uid {peer_uid}, not as this process's uid {own_uid}; refusing it",
        path.display()
    )]
    ForeignPeer {
        /// The socket.
        path: PathBuf,
        /// The peer's uid (`SO_PEERCRED`).
        peer_uid: u32,
        /// Our effective uid.
        own_uid: u32,
    },

    /// A timeout so long that the deadline it gives is past what the clock can hold
    /// (`Duration::MAX`): every wait here is bounded, so it is refused, never saturated.
    #[error("{op}: a timeout of {timeout:?} is too long (its deadline overflows the clock); give a finite one")]
    TimeoutTooLong {
        /// The operation.
        op: String,
        /// The timeout given.
        timeout: Duration,
    },

    /// An argument was outside what the operation accepts.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Any other system call failure, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// What the system said.
        source: io::Error,
    },
}

impl Error {
    /// An [`Error::Io`] with `context`.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// An [`Error::JobDir`].
    pub(crate) fn job_dir(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Error::JobDir {
            path: path.into(),
            problem: problem.into(),
        }
    }
}

/// `5 s`, `0.25 s`.
pub(crate) fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

fn timeout_message(op: &str, after: Duration, missing: &[usize], never_connected: &[usize]) -> String {
    let mut m = format!("{op} timed out after {}: ", secs(after));
    if missing.is_empty() {
        m.push_str("the key was never set");
    } else {
        m.push_str(&format!("ranks {missing:?} did not arrive"));
    }
    if !never_connected.is_empty() {
        m.push_str(&format!(" (never connected to the store: {never_connected:?})"));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_names_the_missing_ranks() {
        let e = Error::Timeout {
            op: "barrier 'init'".into(),
            after: Duration::from_secs(5),
            missing: vec![3],
            never_connected: vec![],
        };
        assert_eq!(
            e.to_string(),
            "barrier 'init' timed out after 5 s: ranks [3] did not arrive"
        );
        let e = Error::Refused {
            reason: Refusal::WrongKey,
        };
        assert_eq!(
            e.to_string(),
            "bootstrap store refused this client: wrong MKERNEL_JOB_KEY"
        );
    }
}
