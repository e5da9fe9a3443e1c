//! The InfiniBand / RoCE backend: reliable-connected queue pairs through libibverbs.
//!
//! **Untried**: written, compiled and unit-tested without a NIC; it has never run on an RDMA
//! NIC (none was available). [`crate::backend`] uses it only when asked for
//! (`MKERNEL_TRANSPORT=ibverbs` or the program's `CommConfig::transport`), never by detection.
//!
//! Per put: an RDMA write of the data from the registered local region, then an 8-byte inline
//! RDMA write of the flag into the peer's flag array, on the same queue pair, so RC's in-order
//! execution makes the flag visible after the data. Up to 8 commands per peer go out as one
//! chained `ibv_post_send`; only every Nth request asks for a completion.
//!
//! Layers: [`sysfs`] (which NIC), [`blob`] (what peers exchange), [`plan`] (work requests as
//! plain data), [`wr`] (`ibv_send_wr` chains), [`dl`] (libibverbs loaded at run time),
//! [`device`] (owned verbs objects), [`rc`] (endpoint and transport). Everything up to `wr`
//! is tested without a NIC.
//!
//! `dl`, `device`, `wr` and `rc` need the `rdma` cargo feature (rdma-sys's bindgen'd types);
//! NIC choice, blobs and planning build and test without it.
pub mod blob;
pub mod config;
#[cfg(feature = "rdma")]
pub mod device;
#[cfg(feature = "rdma")]
pub mod dl;
pub mod plan;
#[cfg(feature = "rdma")]
pub mod rc;
pub mod sysfs;
#[cfg(feature = "rdma")]
pub mod wr;

pub use blob::{BlobKind, ConnBlob, QpAddr, RemoteMem};
pub use config::RcConfig;
#[cfg(feature = "rdma")]
pub use device::MemSource;
#[cfg(feature = "rdma")]
pub use rc::{NetSetup, RcEndpoint, RcTransport};
pub use sysfs::{choose_nic, list_nics, NicChoice, NicInfo, NicKind};
