//! The TCP backend: any network, no RDMA hardware.
//!
//! Sender: a PUT's data is split into chunks of at most one staging buffer (default 512 KiB);
//! each chunk is copied from the GPU heap into a pinned host buffer by the copy engine
//! ([`DeviceStaging::to_host`]), then written to one of the peer's sockets (round robin over
//! `MKERNEL_TCP_SOCKETS`, default 2) as a DATA frame. A flag goes as a SIGNAL frame on the socket
//! of the last data frame. Every frame from one sender to one receiver carries a message number.
//!
//! Receiver: the same proxy thread reads its incoming sockets without blocking, each into its
//! own receive buffers, checks every header against its own regions ([`frame::Limits`]; a bad
//! frame is an error naming the peer, nothing is written), and carries frames out strictly in
//! message-number order: DATA by a copy into its GPU heap ([`DeviceStaging::to_device`]),
//! SIGNAL by a flag store ordered after those copies ([`DeviceStaging::write_flag`]). So the
//! wire keeps the FIFO's order, exactly as the emulated wire: a flag is visible only after
//! every earlier put to that receiver.
//!
//! Setup ([`TcpLinks::establish`]): each rank listens on the address chosen by
//! [`choose_address`] (`MKERNEL_SOCKET_ADDR`, `MKERNEL_SOCKET_IFNAME`, else the route to
//! `MASTER_ADDR`), publishes `"<ip:port> <secret>"` in the job's store, reads its peers'
//! records, and opens `sockets` sockets to every proxy peer. The first 64 bytes on a socket
//! carry the receiver's secret; connections without it are refused (and logged).
//!
//! Failure: no reconnection. A socket that closes without a BYE frame (the peer process
//! died), a send or receive error, or a peer silent past `MKERNEL_TCP_TIMEOUT_S` (keepalive and
//! `TCP_USER_TIMEOUT`) is a [`TransportError::Peer`](crate::TransportError) naming the peer; the
//! proxy turns it into the FIFO's error record and raises `abort`. A transport dropped after a
//! successful `flush` (the proxy's clean stop) sends BYE on every socket first.
//!
//! User abort ([`Transport::send_abort`](crate::Transport::send_abort)): a USER_ABORT frame on
//! every socket to every peer, queued right after the frame in progress (ahead of queued data);
//! the receiver hands the sender's rank to its host at once (through
//! [`Transport::poll_aborts`](crate::Transport::poll_aborts)) and answers USER_ABORT_ACK the
//! same way. The connections stay up.
pub mod frame;
pub mod mac;
mod setup;
mod staging;
mod transport;

pub use setup::{
    choose_address, interface_addresses, store_key, Exchange, TcpConfig, TcpLinks, HELLO_BOUND, MAX_PENDING,
};
pub use staging::{CpuStaging, DeviceStaging};
pub use transport::{TcpStats, TcpTransport};
