//! Receive-side bookkeeping for SRD: count data arrivals per sender, hold signals until the
//! data before them has arrived, then raise their flags (never lowering one).
use super::imm::{Imm, ImmKind, SignalRecord};
use crate::error::TransportError;
use crate::protocol::FLAG_BYTES;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Raises a flag in this rank's flag array (where the local GPU waits).
///
/// Implementations store `max(current, value)`. Before the first store after data arrived,
/// a GPU implementation must make the NIC's writes visible to the GPU
/// (`cuFlushGPUDirectRDMAWrites`), since the data came from another PCIe writer.
pub trait FlagSink: Send {
    /// Raises the flag at `flag_offset` to at least `value`.
    fn raise(&mut self, flag_offset: u64, value: u64) -> Result<(), TransportError>;
}

/// A flag array in ordinary memory (tests, and hosts that keep flags in host-mapped memory).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VecFlags(pub Vec<u64>);

impl FlagSink for VecFlags {
    fn raise(&mut self, flag_offset: u64, value: u64) -> Result<(), TransportError> {
        let w = self
            .0
            .get_mut((flag_offset / FLAG_BYTES) as usize)
            .ok_or_else(|| TransportError::Config(format!("flag offset {flag_offset} outside the flag array")))?;
        *w = (*w).max(value);
        Ok(())
    }
}

#[derive(Default)]
struct Sender {
    arrived: u64,
    /// (needed, arrival order, flag offset, value), smallest `needed` first.
    waiting: BinaryHeap<Reverse<(u64, u64, u64, u64)>>,
}

/// Per-sender arrival counts and waiting signals.
pub struct RecvTracker {
    senders: Vec<Option<Sender>>,
    flag_bytes: u64,
    order: u64,
}

impl RecvTracker {
    /// Tracks the senders marked in `peers` (indexed by rank); flags are checked against
    /// `flag_bytes`.
    pub fn new(peers: &[bool], flag_bytes: u64) -> RecvTracker {
        RecvTracker {
            senders: peers.iter().map(|&p| p.then(Sender::default)).collect(),
            flag_bytes,
            order: 0,
        }
    }

    fn sender(&mut self, rank: u16) -> Result<&mut Sender, TransportError> {
        self.senders
            .get_mut(rank as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| TransportError::Completion {
                peer: format!("rank {rank}"),
                detail: "message from a rank that is not a proxy peer".into(),
            })
    }

    /// Handles one receive completion: its immediate (host order, already decoded) and, for a
    /// signal, the record bytes. Raises every flag that became ready.
    pub fn on_completion(&mut self, imm: Imm, payload: &[u8], sink: &mut dyn FlagSink) -> Result<(), TransportError> {
        match imm.kind {
            ImmKind::Data => self.on_data(imm.sender, sink),
            ImmKind::Signal => {
                let r = SignalRecord::from_bytes(payload)?;
                if r.sender != u32::from(imm.sender) {
                    return Err(TransportError::Completion {
                        peer: format!("rank {}", imm.sender),
                        detail: format!("signal record names sender {}", r.sender),
                    });
                }
                self.on_signal(imm.sender, r.needed, r.flag_offset, r.value, sink)
            }
        }
    }

    /// One data message from `sender` arrived.
    pub fn on_data(&mut self, sender: u16, sink: &mut dyn FlagSink) -> Result<(), TransportError> {
        let s = self.sender(sender)?;
        s.arrived += 1;
        Self::release(s, sink)
    }

    /// A signal from `sender` arrived: raise `flag_offset` to `value` once `needed` data
    /// messages from `sender` have arrived.
    pub fn on_signal(
        &mut self,
        sender: u16,
        needed: u64,
        flag_offset: u64,
        value: u64,
        sink: &mut dyn FlagSink,
    ) -> Result<(), TransportError> {
        if flag_offset & (FLAG_BYTES - 1) != 0
            || flag_offset.checked_add(FLAG_BYTES).is_none_or(|e| e > self.flag_bytes)
        {
            return Err(TransportError::Completion {
                peer: format!("rank {sender}"),
                detail: format!("signal for flag offset {flag_offset} outside {} bytes", self.flag_bytes),
            });
        }
        self.order += 1;
        let order = self.order;
        let s = self.sender(sender)?;
        s.waiting.push(Reverse((needed, order, flag_offset, value)));
        Self::release(s, sink)
    }

    fn release(s: &mut Sender, sink: &mut dyn FlagSink) -> Result<(), TransportError> {
        while let Some(Reverse((needed, _, off, value))) = s.waiting.peek().copied() {
            if needed > s.arrived {
                break;
            }
            s.waiting.pop();
            sink.raise(off, value)?;
        }
        Ok(())
    }

    /// Signals still waiting for data, over all senders.
    pub fn waiting(&self) -> usize {
        self.senders.iter().flatten().map(|s| s.waiting.len()).sum()
    }

    /// Data messages counted from `sender`.
    pub fn arrived(&self, sender: usize) -> u64 {
        self.senders
            .get(sender)
            .and_then(Option::as_ref)
            .map_or(0, |s| s.arrived)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> (RecvTracker, VecFlags) {
        (RecvTracker::new(&[false, true, true], 64), VecFlags(vec![0; 8]))
    }

    #[test]
    fn a_signal_waits_for_the_data_before_it() {
        let (mut t, mut f) = tracker();
        // Sender 1 sent 2 data messages then a signal; the signal overtakes them.
        t.on_signal(1, 2, 8, 5, &mut f).unwrap();
        assert_eq!(f.0[1], 0);
        t.on_data(1, &mut f).unwrap();
        assert_eq!(f.0[1], 0);
        // Data from another sender does not count for sender 1.
        t.on_data(2, &mut f).unwrap();
        assert_eq!(f.0[1], 0);
        t.on_data(1, &mut f).unwrap();
        assert_eq!(f.0[1], 5);
        assert_eq!(t.waiting(), 0);
        assert_eq!((t.arrived(1), t.arrived(2)), (2, 1));
    }

    #[test]
    fn reordered_signals_never_lower_a_flag() {
        let (mut t, mut f) = tracker();
        // Epoch 2's signal (needed 2) arrives before epoch 1's (needed 1), and after all data.
        t.on_data(2, &mut f).unwrap();
        t.on_data(2, &mut f).unwrap();
        t.on_signal(2, 2, 0, 2, &mut f).unwrap();
        t.on_signal(2, 1, 0, 1, &mut f).unwrap();
        assert_eq!(f.0[0], 2);
        // Several signals released by one arrival go in order of `needed`.
        t.on_signal(2, 4, 16, 9, &mut f).unwrap();
        t.on_signal(2, 3, 16, 8, &mut f).unwrap();
        t.on_data(2, &mut f).unwrap();
        assert_eq!(f.0[2], 8);
        t.on_data(2, &mut f).unwrap();
        assert_eq!(f.0[2], 9);
    }

    #[test]
    fn completions_decode_and_bad_ones_are_errors() {
        let (mut t, mut f) = tracker();
        let rec = SignalRecord {
            magic: SignalRecord::MAGIC,
            sender: 1,
            needed: 1,
            flag_offset: 24,
            value: 3,
        };
        t.on_completion(Imm::signal(1), &rec.to_bytes(), &mut f).unwrap();
        t.on_completion(Imm::data(1), &[], &mut f).unwrap();
        assert_eq!(f.0[3], 3);
        assert!(
            t.on_completion(Imm::signal(2), &rec.to_bytes(), &mut f).is_err(),
            "sender mismatch"
        );
        assert!(t.on_data(0, &mut f).is_err(), "not a peer");
        assert!(t.on_data(9, &mut f).is_err(), "out of range");
        assert!(t.on_signal(1, 0, 64, 1, &mut f).is_err());
        assert!(t.on_signal(1, 0, 4, 1, &mut f).is_err());
    }
}
