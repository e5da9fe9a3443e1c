//! The device communication layer: peer heaps, epoch flags with bounded waits, and wide copies
//! and reductions over NVLink. The protocol is in docs/protocol.md; the layouts it shares with
//! the host are in `mkernel_config::comm`.
//!
//! Conventions: every flag is written by its source rank into the destination's heap with
//! `fence.acq_rel.sys` + `st.release.sys` after a CTA barrier that follows the data stores,
//! and read only by the destination with `ld.acquire.sys`; waits poll local memory only.
//!
//! # Safety
//!
//! The `unsafe fn`s of this layer share one contract, which their `# Safety` sections refer to
//! as "the communicator contract":
//! - `desc` (or the descriptor behind a [`CommCtx`]) points to the launch's `CommDesc` in global
//!   memory, as the host filled it: `heaps[..world]` are this rank's heap and its peers' heaps,
//!   mapped into this process (peers over NVLink) for the whole launch, each laid out as
//!   `mkernel_config::comm` says, and `fifo` is the host-mapped proxy FIFO (or 0 on one node).
//! - A [`CommCtx`] was built by [`CommCtx::new`] / [`CommCtx::with_epoch`] for this launch, so
//!   its epoch is the one every rank of the job uses for this launch; `cta` indexes a flag and
//!   epoch-counter slot that no other CTA of this launch uses.
//! - Ranks and peers passed in are `< world`; heap offsets and lengths stay inside the heap.

pub mod bulk;
pub mod ctx;
pub mod launch;
pub mod ll;
pub mod move_data;
pub mod proxy;
pub mod wait;

pub use ctx::CommCtx;
