//! The emulated wire: ranks of one host play separate nodes. A [`CopyEngine`] moves the bytes;
//! a [`Link`] paces them like a NIC (bandwidth cap, then latency); flags are written only after
//! the data before them has landed.
//!
//! Used when no RDMA device exists or when emulated nodes are requested
//! (`MKERNEL_EMULATED_NODES`, set by `cargo xtask launch --nodes N`).
mod copy;
mod wire;

pub use copy::{CopyEngine, CpuCopyEngine, CpuFabric, CpuRankMemory};
pub use wire::{Link, WireModel};

use crate::error::TransportError;
use crate::transport::{Op, Transport};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

struct InFlight {
    arrives: Instant,
    dst: usize,
    op: Op,
}

/// A [`Transport`] over a [`CopyEngine`], paced by a [`WireModel`].
///
/// Operations leave in posting order over one egress link (one NIC per GPU) and are executed
/// by the engine in that order when their modeled arrival time has passed; so a flag is always
/// executed after the data posted before it to the same destination, and the engine's own
/// contract keeps it visible after that data.
pub struct EmulatedTransport<E: CopyEngine> {
    rank: usize,
    engine: E,
    link: Link,
    queue: VecDeque<InFlight>,
    at_engine: u64,
    flush_timeout: Duration,
}

impl<E: CopyEngine> EmulatedTransport<E> {
    /// The transport of `rank`, moving bytes with `engine`, paced by `model`.
    pub fn new(rank: usize, engine: E, model: WireModel) -> Self {
        EmulatedTransport {
            rank,
            engine,
            link: Link::new(model),
            queue: VecDeque::new(),
            at_engine: 0,
            flush_timeout: Duration::from_secs(30),
        }
    }

    /// `flush` gives up after `timeout` (default 30 s).
    pub fn with_flush_timeout(mut self, timeout: Duration) -> Self {
        self.flush_timeout = timeout;
        self
    }

    /// Operations posted but not yet completed.
    pub fn in_flight(&self) -> u64 {
        self.queue.len() as u64 + self.at_engine
    }

    fn deliver_due(&mut self, now: Instant) -> Result<(), TransportError> {
        while self.queue.front().is_some_and(|f| f.arrives <= now) {
            let Some(f) = self.queue.pop_front() else {
                break;
            };
            match f.op {
                Op::Put {
                    seq,
                    src_offset,
                    dst_offset,
                    bytes,
                } => self.engine.copy(seq, self.rank, src_offset, f.dst, dst_offset, bytes)?,
                Op::Signal {
                    seq,
                    flag_offset,
                    value,
                } => self.engine.write_flag(seq, f.dst, flag_offset, value)?,
            }
            self.at_engine += 1;
        }
        Ok(())
    }
}

impl<E: CopyEngine> Transport for EmulatedTransport<E> {
    fn name(&self) -> &'static str {
        "emulated"
    }

    fn post(&mut self, dst: usize, ops: &[Op]) -> Result<(), TransportError> {
        if dst == self.rank {
            return Err(TransportError::Peer {
                peer: dst,
                detail: "the emulated wire does not loop back".into(),
            });
        }
        let now = Instant::now();
        for op in ops {
            let bytes = match *op {
                Op::Put { bytes, .. } => bytes,
                Op::Signal { .. } => crate::protocol::FLAG_BYTES,
            };
            let arrives = self.link.schedule(now, bytes);
            self.queue.push_back(InFlight { arrives, dst, op: *op });
        }
        Ok(())
    }

    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        self.deliver_due(Instant::now())?;
        let before = completed.len();
        self.engine.poll(completed)?;
        self.at_engine = self.at_engine.saturating_sub((completed.len() - before) as u64);
        Ok(())
    }

    fn flush(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        let deadline = Instant::now().checked_add(self.flush_timeout).ok_or_else(|| {
            TransportError::Config(format!(
                "a flush timeout of {:?} is too long (its deadline overflows the clock)",
                self.flush_timeout
            ))
        })?;
        loop {
            self.poll(completed)?;
            if self.in_flight() == 0 {
                return Ok(());
            }
            let now = Instant::now();
            if now > deadline {
                return Err(TransportError::Copy(format!(
                    "flush timed out after {:?} with {} operations in flight",
                    self.flush_timeout,
                    self.in_flight()
                )));
            }
            match self.queue.front() {
                Some(f) if f.arrives > now + Duration::from_micros(200) => {
                    std::thread::sleep(f.arrives - now - Duration::from_micros(100))
                }
                _ => std::thread::yield_now(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_lands_after_data_and_pacing_holds() {
        let fabric = CpuFabric::new(2, 1 << 16, 4);
        fabric.write(0, 0, &[7u8; 1 << 16]).unwrap();
        // 16 MB/s: 64 KiB take about 4 ms on the wire.
        let mut t = EmulatedTransport::new(
            0,
            CpuCopyEngine::new(fabric.clone()),
            WireModel {
                bytes_per_sec: 16e6,
                latency: Duration::from_micros(100),
            },
        );
        let t0 = Instant::now();
        t.post(
            1,
            &[
                Op::Put {
                    seq: 0,
                    src_offset: 0,
                    dst_offset: 0,
                    bytes: 1 << 16,
                },
                Op::Signal {
                    seq: 0,
                    flag_offset: 8,
                    value: 3,
                },
            ],
        )
        .unwrap();
        let mut done = vec![];
        t.poll(&mut done).unwrap();
        assert_eq!(fabric.flag(1, 8), 0, "nothing arrives before its time");
        t.flush(&mut done).unwrap();
        assert!(t0.elapsed() >= Duration::from_micros(4096 + 100), "{:?}", t0.elapsed());
        assert_eq!(fabric.flag(1, 8), 3);
        assert!(fabric.read(1, 0, 1 << 16).unwrap().iter().all(|&b| b == 7));
        assert_eq!(done, vec![0, 0]);
        assert!(t.post(0, &[]).is_err());
    }
}
