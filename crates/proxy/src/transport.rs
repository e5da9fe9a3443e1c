//! What a backend must do for the proxy: post operations per destination, report completions.
use crate::error::TransportError;

/// One operation for one destination. `seq` is the FIFO sequence number of the command it came
/// from; a PUT command becomes a `Put` followed by a `Signal` with the same `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Write `bytes` from the local data region at `src_offset` to the destination's data
    /// region at `dst_offset`.
    Put {
        /// Command sequence number.
        seq: u64,
        /// Offset in the local data region.
        src_offset: u64,
        /// Offset in the destination's data region.
        dst_offset: u64,
        /// Length.
        bytes: u64,
    },
    /// Store `value` into the destination's flag word at `flag_offset`, visible only after
    /// every earlier `Put` to the same destination is visible there.
    Signal {
        /// Command sequence number.
        seq: u64,
        /// Offset in the destination's flag array.
        flag_offset: u64,
        /// Value to store.
        value: u64,
    },
}

impl Op {
    /// The command sequence number.
    pub fn seq(&self) -> u64 {
        match *self {
            Op::Put { seq, .. } | Op::Signal { seq, .. } => seq,
        }
    }
}

/// A backend that moves data between ranks on behalf of the proxy.
///
/// Contract:
/// * The `Signal` of a PUT command (same `seq` as the `Put` before it) is visible only after
///   that put's data is visible at the destination.
/// * The `Signal` of a SIGNAL command (a `seq` of its own) is visible only after the data of
///   every earlier `Put` posted to that destination on this transport is visible.
/// * Every posted operation is reported exactly once through `completed` (its `seq`) by `poll`
///   or `flush`, once its source bytes have been read (they may then be overwritten).
/// * Errors are final: the proxy aborts the FIFO and stops.
pub trait Transport: Send {
    /// Short name for logs ("emulated", "ibverbs-rc", "efa-srd").
    fn name(&self) -> &'static str;

    /// Posts `ops` (at most a few dozen; the proxy sends at most [`MAX_BATCH`](crate::protocol::MAX_BATCH)
    /// commands at once) to `dst`, in order, as one batch. Does not wait for completion.
    fn post(&mut self, dst: usize, ops: &[Op]) -> Result<(), TransportError>;

    /// Makes progress without blocking; appends the `seq` of every operation that completed.
    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError>;

    /// Blocks until every posted operation completed (or the backend's timeout passed);
    /// appends their `seq`s.
    fn flush(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError>;

    /// Tells every peer's proxy that this rank called `abort()`, ahead of any data still queued
    /// for it (a control message outside the FIFO's order). Does not block: it queues the
    /// notice and sends what it can; [`Transport::poll`] sends the rest. A receiving proxy
    /// reports it through [`Transport::poll_aborts`], hands it to its host (which stores the
    /// rank into its node's abort words) and acknowledges it; this side's `poll_aborts` returns
    /// true once every peer did. The connections stay up: data and flags keep flowing.
    ///
    /// A backend without a control path returns [`TransportError::Unsupported`] (the default;
    /// the proxy then reports the abort as undeliverable and goes on); any other error is a
    /// transport failure like those of `post`.
    fn send_abort(&mut self) -> Result<(), TransportError> {
        Err(TransportError::Unsupported(format!(
            "the {} transport does not carry aborts to other nodes",
            self.name()
        )))
    }

    /// Hands every peer abort received since the last call to `on_peer_abort(peer rank)` (once
    /// per aborting peer), then acknowledges each to its sender (so the acknowledgement
    /// follows the host's stores); returns whether every peer acknowledged this rank's
    /// [`Transport::send_abort`]. Never blocks. Default: nothing received, never delivered.
    fn poll_aborts(&mut self, on_peer_abort: &mut dyn FnMut(usize)) -> Result<bool, TransportError> {
        let _ = on_peer_abort;
        Ok(false)
    }

    /// Posts one put.
    fn put(
        &mut self,
        dst: usize,
        src_offset: u64,
        dst_offset: u64,
        bytes: u64,
        seq: u64,
    ) -> Result<(), TransportError> {
        self.post(
            dst,
            &[Op::Put {
                seq,
                src_offset,
                dst_offset,
                bytes,
            }],
        )
    }

    /// Posts one flag store, ordered after earlier puts to `dst`.
    fn signal(&mut self, dst: usize, flag_offset: u64, value: u64, seq: u64) -> Result<(), TransportError> {
        self.post(
            dst,
            &[Op::Signal {
                seq,
                flag_offset,
                value,
            }],
        )
    }
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn post(&mut self, dst: usize, ops: &[Op]) -> Result<(), TransportError> {
        (**self).post(dst, ops)
    }
    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        (**self).poll(completed)
    }
    fn flush(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        (**self).flush(completed)
    }
    fn send_abort(&mut self) -> Result<(), TransportError> {
        (**self).send_abort()
    }
    fn poll_aborts(&mut self, on_peer_abort: &mut dyn FnMut(usize)) -> Result<bool, TransportError> {
        (**self).poll_aborts(on_peer_abort)
    }
}
