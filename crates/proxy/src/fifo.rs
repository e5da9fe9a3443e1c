//! The consumer side of the FIFO: poll the slot at `tail`, validate, release, publish `tail`.
use crate::error::{ErrorCode, ProxyError, Violation};
use crate::mem::{Fifo, FifoMemory};
use crate::protocol::NO_SEQ;
use crate::validate::{Checked, Validator};
use std::sync::atomic::Ordering;

/// Reads commands from a FIFO in order. One per FIFO; owned by the proxy thread.
pub struct FifoConsumer<M: FifoMemory> {
    fifo: Fifo<M>,
    validator: Validator,
    tail: u64,
    published: u64,
    rank: u32,
}

impl<M: FifoMemory> FifoConsumer<M> {
    /// A consumer of `fifo` checking commands with `validator`. Resumes at the header's `tail`,
    /// so a new proxy can take over a FIFO that an earlier one left in a clean state.
    pub fn new(fifo: Fifo<M>, validator: Validator) -> Result<Self, ProxyError> {
        let rank = fifo.rank();
        if rank as usize != validator.regions().rank() {
            return Err(ProxyError::Config(format!(
                "FIFO belongs to rank {rank}, regions to rank {}",
                validator.regions().rank()
            )));
        }
        let tail = fifo.tail().load(Ordering::Acquire);
        Ok(FifoConsumer {
            fifo,
            validator,
            tail,
            published: tail,
            rank,
        })
    }

    /// The FIFO handle.
    pub fn fifo(&self) -> &Fifo<M> {
        &self.fifo
    }

    /// The rank of this FIFO.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// World size of the regions commands are checked against.
    pub fn world_size(&self) -> usize {
        self.validator.regions().world_size()
    }

    /// Next sequence number to consume (may be ahead of the published `tail`).
    pub fn next_seq(&self) -> u64 {
        self.tail
    }

    /// Takes the command at `tail` if it is committed.
    ///
    /// `Ok(None)`: nothing committed yet. `Ok(Some((seq, cmd)))`: a valid command; its slot is
    /// already cleared (call [`publish`](Self::publish) to hand the slots back to the producer).
    /// `Err`: the slot was overrun or the command is invalid; the error record is written,
    /// `abort` is raised, and nothing was handed out.
    pub fn poll(&mut self) -> Result<Option<(u64, Checked)>, ProxyError> {
        let seq = self.tail;
        let slot = self.fifo.slot_header(seq);
        let header = slot.load(Ordering::Acquire);
        if header == 0 {
            return Ok(None);
        }
        if header != seq.wrapping_add(1) {
            let v = Violation::new(
                ErrorCode::SlotOverrun,
                format!(
                    "slot header {header}, expected {} (producer overran the ring?)",
                    seq + 1
                ),
            );
            return Err(self.reject(seq, v));
        }
        // SAFETY: the header was observed with acquire; the producer does not touch the slot
        // until `tail` moves past it.
        let body = unsafe { self.fifo.read_body(seq) };
        slot.store(0, Ordering::Relaxed); // ordered before the tail release in `publish`
        self.tail = seq + 1;
        match self.validator.check(&body) {
            Ok(c) => Ok(Some((seq, c))),
            Err(v) => {
                self.publish();
                Err(self.reject(seq, v))
            }
        }
    }

    /// Publishes `tail` (release) if commands were consumed since the last call.
    pub fn publish(&mut self) {
        if self.published != self.tail {
            self.fifo.tail().store(self.tail, Ordering::Release);
            self.published = self.tail;
        }
    }

    fn reject(&self, seq: u64, violation: Violation) -> ProxyError {
        self.fifo.raise_abort(violation.code, self.rank, seq, &violation.reason);
        ProxyError::BadCommand {
            rank: self.rank,
            seq,
            violation,
        }
    }

    /// Writes the error record for `err` (if nobody did yet) and raises `abort`.
    pub fn fail(&self, err: &ProxyError) {
        let seq = match err {
            ProxyError::BadCommand { seq, .. } => *seq,
            ProxyError::Transport { seq: Some(s), .. } => *s,
            _ => NO_SEQ,
        };
        self.fifo.raise_abort(err.code(), self.rank, seq, &err.to_string());
    }

    /// `Some(error)` if `abort` was raised (by anyone); built from the error record.
    pub fn aborted(&self) -> Option<ProxyError> {
        let code = self.fifo.abort_code();
        if code == 0 {
            return None;
        }
        let rec = self.fifo.error_record().unwrap_or_default();
        Some(ProxyError::Aborted {
            rank: self.rank,
            code,
            seq: rec.seq,
            message: rec.message().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::HeapFifo;
    use crate::producer::FifoProducer;
    use crate::protocol::CommandBody;
    use crate::topology::Topology;
    use crate::validate::Regions;

    fn setup(cap: u32) -> (FifoConsumer<HeapFifo>, FifoProducer<HeapFifo>) {
        let t = Topology::new(2, 1, 0).unwrap();
        let fifo = Fifo::new(HeapFifo::new(cap, 0).unwrap()).unwrap();
        (
            FifoConsumer::new(fifo.clone(), Validator::new(Regions::symmetric(&t, 4096, 64))).unwrap(),
            FifoProducer::new(fifo),
        )
    }

    #[test]
    fn single_thread_wraparound() {
        let (mut c, p) = setup(4);
        for round in 0..10u64 {
            for i in 0..4u64 {
                assert_eq!(
                    p.try_push(&CommandBody::put(1, i, 0, 8, 0, round + 1, round)).unwrap(),
                    Some(round * 4 + i)
                );
            }
            assert_eq!(p.try_push(&CommandBody::nop(round)).unwrap(), None, "full");
            for i in 0..4u64 {
                let (seq, cmd) = c.poll().unwrap().unwrap();
                assert_eq!(seq, round * 4 + i);
                assert!(matches!(cmd, Checked::Put { src_offset, .. } if src_offset == i));
            }
            assert!(c.poll().unwrap().is_none());
            c.publish();
        }
        assert_eq!(c.fifo().tail().load(Ordering::Relaxed), 40);
    }

    #[test]
    fn overrun_is_detected() {
        let (mut c, p) = setup(4);
        p.try_push(&CommandBody::nop(0)).unwrap();
        // A rogue producer writes a commit word for a sequence number from the next lap.
        c.fifo().slot_header(0).store(5, Ordering::Release);
        let e = c.poll().unwrap_err();
        assert!(
            matches!(e, ProxyError::BadCommand { seq: 0, ref violation, .. } if violation.code == ErrorCode::SlotOverrun),
            "{e}"
        );
        assert_eq!(c.fifo().abort_code(), ErrorCode::SlotOverrun as u32);
    }
}
