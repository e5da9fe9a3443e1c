//! `mkernel-proxy`: the host side of GPU-initiated inter-node transport.
//!
//! A GPU kernel writes 64-byte commands ([`protocol::Command`]) into a FIFO in host-mapped
//! memory; one proxy thread per GPU ([`Proxy`]) reads them in order, checks each against the
//! registered memory ([`Validator`]), batches them per destination and hands them to a
//! [`Transport`]:
//!
//! * [`emulated`]: ranks of one host play nodes; a [`emulated::CopyEngine`] moves the bytes,
//!   paced like a 400 Gb/s NIC.
//! * [`tcp`]: any network; host staging buffers, several sockets per peer, frames carried
//!   out in message order by the receiving proxy.
//! * [`ibverbs`]: RDMA write of the data, then an inline RDMA write of the flag on the same RC
//!   queue pair (RC keeps the order). Untried: never run on a NIC.
//! * [`efa`]: SRD is unordered, so data goes as RDMA write-with-immediate and the receiving
//!   proxy raises the flag once every write before it has arrived. Untried: never run on a NIC.
//!
//! [`backend::choose_with`] picks one: `MKERNEL_TRANSPORT`, else the program's choice, else
//! emulated or TCP; the untried RDMA backends only when named. `docs/internode.md` describes the protocol and how to run on
//! two nodes. Everything here builds and tests without a GPU or a NIC; libibverbs and libefa
//! are opened at run time (`dlopen`), so binaries also start on hosts without rdma-core.
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

mod abort;
pub mod backend;
mod batch;
mod completion;
pub mod efa;
pub mod emulated;
mod error;
mod fifo;
pub mod ibverbs;
mod mem;
mod producer;
pub mod protocol;
mod proxy;
pub mod tcp;
mod topology;
mod transport;
mod validate;

pub use abort::{AbortLink, AbortState};
pub use batch::Batcher;
pub use completion::CompletionTracker;
pub use error::{ErrorCode, ProxyError, TransportError, Violation};
pub use fifo::FifoConsumer;
pub use mem::{Fifo, FifoMemory, HeapFifo, RawFifo};
pub use producer::FifoProducer;
pub use proxy::{run_proxy, Backoff, Proxy, ProxyConfig, ProxyStats};
pub use topology::{PeerPolicy, Route, Topology};
pub use transport::{Op, Transport};
pub use validate::{Checked, PeerRegions, Regions, Span, Validator};
