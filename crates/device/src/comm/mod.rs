//! The device communication layer: peer heaps, epoch flags with bounded waits, and wide copies
//! and reductions over NVLink. The protocol is in docs/protocol.md; the layouts it shares with
//! the host are in `mkernel_config::comm`.
//!
//! Conventions: every flag is written by its source rank into the destination's heap with
//! `fence.acq_rel.sys` + `st.release.sys` after a CTA barrier that follows the data stores,
//! and read only by the destination with `ld.acquire.sys`; waits poll local memory only.

pub mod bulk;
pub mod ctx;
pub mod launch;
pub mod ll;
pub mod move_data;
pub mod proxy;
pub mod wait;

pub use ctx::CommCtx;
