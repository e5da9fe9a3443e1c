//! The AWS EFA backend: scalable reliable datagrams (SRD) through efadv.
//!
//! **Untried**: written, compiled and unit-tested without a NIC; it has never run on an EFA
//! device (none was available). [`crate::backend`] uses it only when asked for
//! (`MKERNEL_TRANSPORT=efa` or the program's `CommConfig::transport`), never by detection.
//!
//! SRD delivers reliably but in any order, so "flag after data" cannot come from the wire.
//! Instead:
//! * every data chunk is an RDMA write-with-immediate whose immediate names the sender
//!   ([`imm`]); the receiver counts data arrivals per sender;
//! * every flag is a send-with-immediate carrying a [`SignalRecord`]: flag offset, value, and
//!   the number of data messages the sender had sent to this receiver before it;
//! * the RECEIVING proxy raises the flag (through a [`FlagSink`]) once that many data
//!   messages from that sender have arrived ([`recv`]), never lowering a flag.
//!
//! So a flag guarantees that the data of every earlier put from the same sender to this
//! receiver has landed, the same guarantee RC gives on one queue pair.
//!
//! libefa is opened at run time like libibverbs (no link-time dependency); `dl` and `srd` need
//! the `rdma` cargo feature. On a host without libefa or without an EFA device, opening
//! returns "no RDMA device found: ...". EFA's RDMA write (needed for write-with-immediate)
//! requires rdma-core 45+ and a device reporting `EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE`.
#[cfg(feature = "rdma")]
pub mod dl;
pub mod imm;
pub mod plan;
pub mod recv;
#[cfg(feature = "rdma")]
pub mod srd;

pub use imm::{Imm, ImmKind, SignalRecord};
pub use plan::{SrdPlanner, SrdWr};
pub use recv::{FlagSink, RecvTracker, VecFlags};
#[cfg(feature = "rdma")]
pub use srd::{SrdConfig, SrdEndpoint, SrdTransport};
