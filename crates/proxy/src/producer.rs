//! The producer side on the CPU: what a GPU thread does, written with std atomics.
//!
//! Tests use it to play the device; it is also the reference the device code mirrors
//! (claim, wait for room, write the body, commit with a release store of `seq + 1`).
use crate::error::ProxyError;
use crate::mem::{Fifo, FifoMemory};
use crate::protocol::CommandBody;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Pushes commands into a FIFO from any number of CPU threads.
pub struct FifoProducer<M: FifoMemory> {
    fifo: Fifo<M>,
}

impl<M: FifoMemory> Clone for FifoProducer<M> {
    fn clone(&self) -> Self {
        FifoProducer {
            fifo: self.fifo.clone(),
        }
    }
}

impl<M: FifoMemory> FifoProducer<M> {
    /// A producer on `fifo`.
    pub fn new(fifo: Fifo<M>) -> Self {
        FifoProducer { fifo }
    }

    /// The FIFO handle.
    pub fn fifo(&self) -> &Fifo<M> {
        &self.fifo
    }

    fn aborted(&self) -> ProxyError {
        let rec = self.fifo.error_record().unwrap_or_default();
        ProxyError::Aborted {
            rank: self.fifo.rank(),
            code: self.fifo.abort_code(),
            seq: rec.seq,
            message: rec.message().to_string(),
        }
    }

    fn commit(&self, seq: u64, body: &CommandBody) {
        // SAFETY: `seq` was claimed by this thread and the slot is free (seq - tail < capacity).
        unsafe { self.fifo.write_body(seq, body) };
        self.fifo.slot_header(seq).store(seq + 1, Ordering::Release);
    }

    /// Claims a sequence number, waits until its slot is free (backpressure), writes `body` and
    /// commits it. Returns the sequence number, or an error once `abort` is raised (checked
    /// before claiming and while waiting; a device does the same).
    pub fn push(&self, body: &CommandBody) -> Result<u64, ProxyError> {
        if self.fifo.abort_code() != 0 {
            return Err(self.aborted());
        }
        let seq = self.fifo.head().fetch_add(1, Ordering::Relaxed);
        let cap = u64::from(self.fifo.capacity());
        let mut spins = 0u32;
        while seq.wrapping_sub(self.fifo.tail().load(Ordering::Acquire)) >= cap {
            if self.fifo.abort_code() != 0 {
                return Err(self.aborted());
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 1024 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        self.commit(seq, body);
        Ok(seq)
    }

    /// Pushes `body` only if a slot is free now; `Ok(None)` when the FIFO is full.
    pub fn try_push(&self, body: &CommandBody) -> Result<Option<u64>, ProxyError> {
        if self.fifo.abort_code() != 0 {
            return Err(self.aborted());
        }
        let cap = u64::from(self.fifo.capacity());
        let head = self.fifo.head();
        let mut seq = head.load(Ordering::Relaxed);
        loop {
            if seq.wrapping_sub(self.fifo.tail().load(Ordering::Acquire)) >= cap {
                return Ok(None);
            }
            match head.compare_exchange_weak(seq, seq + 1, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => seq = now,
            }
        }
        self.commit(seq, body);
        Ok(Some(seq))
    }

    /// Waits until every command `< seq_end` completed locally (`done >= seq_end`), i.e. their
    /// source bytes may be overwritten. Errors once `abort` is raised.
    pub fn wait_done(&self, seq_end: u64) -> Result<(), ProxyError> {
        let mut spins = 0u32;
        while self.fifo.done().load(Ordering::Acquire) < seq_end {
            if self.fifo.abort_code() != 0 {
                return Err(self.aborted());
            }
            spins = spins.saturating_add(1);
            if spins < 1024 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(())
    }
}
