//! Multi-process bootstrap for mkernel: how the processes of one job (one per GPU, started by
//! `cargo xtask launch` or torchrun) find each other before any GPU memory is shared.
//!
//! The GPU runtime (`crates/host`) uses it to
//! - learn who it is from the environment ([`RankInfo::from_env`]),
//! - exchange small records with every rank through a TCP store hosted by rank 0 ([`Store`]:
//!   set/get, barrier, all-gather; e.g. proxy addresses, RDMA queue pair numbers),
//! - hand the file descriptors of its `cuMemCreate` allocations (exported as POSIX fds) to the
//!   other ranks of its node ([`LocalPeers::exchange_fds`]), which import them to map the
//!   symmetric memory over NVLink.
//!
//! [`Bootstrap`] does all three in the right order. The crate is CPU-only: no CUDA, no async
//! runtime; threads and blocking sockets with timeouts. See `docs/bootstrap.md`.
//!
//! # Security model
//!
//! The job is a set of processes sharing a secret, `MKERNEL_JOB_KEY`.
//! - **Store.** Only processes that know the key get in: the store sends a fresh random
//!   nonce and the client answers with HMAC-SHA256 of it under the key (the key never crosses
//!   the wire); the store checks in constant time and answers with its own proof over the
//!   client's nonce, so a client also knows it reached its own job's store and not another
//!   job's (or a squatter's) on the same port. Duplicate and out-of-range ranks are refused.
//!   After the handshake the traffic is neither encrypted nor authenticated per message: the
//!   store keeps other jobs and strangers out, it does not defend against an attacker on the
//!   network path. Use a random key (the launcher makes one); a guessable key can be brute
//!   forced from a recorded handshake.
//! - **Local fds.** Descriptors of GPU memory give access to that memory, so they only travel
//!   between processes of the same user: the sockets live in a job directory that is checked
//!   to be owned by us and closed to group and others (mode 0700), and both ends of every
//!   connection check the peer's uid with `SO_PEERCRED`.
//!
//! Every waiting operation takes a timeout, and its error names the ranks that did not
//! arrive (e.g. `barrier 'init' timed out after 5 s: ranks [3] did not arrive`).
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

mod auth;
mod bootstrap;
mod env;
mod error;
mod fdpass;
mod jobdir;
mod local;
mod store;
mod sys;
#[cfg(test)]
mod testutil;

pub use auth::JobKey;
pub use bootstrap::{Bootstrap, INIT_BARRIER};
pub use env::{vars, EnvError, RankInfo};
pub use error::{Error, Refusal, Result};
pub use fdpass::{MAX_FDS, MAX_PAYLOAD};
pub use jobdir::{check_private_dir, JobDir};
pub use local::{FdMessage, LocalPeers};
pub use store::{Store, StoreServer};
