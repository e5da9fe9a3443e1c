//! The copy engine that does the emulated wire's data movement, and its CPU implementation.
use crate::error::TransportError;
use crate::protocol::FLAG_BYTES;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Moves bytes between the registered memories of ranks of one host, and stores flags.
///
/// Contract: `write_flag` becomes visible only after every `copy` issued earlier to the same
/// `dst_rank` is visible; each call's `token` is reported exactly once by `poll` when the call
/// has completed (for `copy`: the source bytes were read). A GPU implementation (peer copies on
/// a stream followed by a stream-ordered flag write) plugs in here.
pub trait CopyEngine: Send {
    /// Copies `bytes` from `src_rank`'s data region at `src_offset` to `dst_rank`'s data region
    /// at `dst_offset`. May complete later.
    fn copy(
        &mut self,
        token: u64,
        src_rank: usize,
        src_offset: u64,
        dst_rank: usize,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), TransportError>;
    /// Stores `value` into `dst_rank`'s flag word at `flag_offset`, after earlier copies to `dst_rank`.
    fn write_flag(&mut self, token: u64, dst_rank: usize, flag_offset: u64, value: u64) -> Result<(), TransportError>;
    /// Appends the tokens of calls that completed since the last poll.
    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError>;
}

/// The registered memory of one rank in a [`CpuFabric`].
pub struct CpuRankMemory {
    data: Box<[AtomicU8]>,
    flags: Box<[AtomicU64]>,
}

/// Data regions and flag arrays of every rank of an in-process job, in ordinary memory.
///
/// Data bytes are accessed with relaxed byte atomics and flags with release/acquire, which is
/// exactly the ordering the protocol promises (data visible before its flag), with no data race.
pub struct CpuFabric {
    ranks: Vec<CpuRankMemory>,
}

fn range(
    what: &str,
    rank: usize,
    offset: u64,
    bytes: u64,
    limit: usize,
) -> Result<std::ops::Range<usize>, TransportError> {
    match offset.checked_add(bytes) {
        Some(end) if end <= limit as u64 => Ok(offset as usize..end as usize),
        _ => Err(TransportError::Peer {
            peer: rank,
            detail: format!("{what} [{offset}, +{bytes}) outside {limit} bytes"),
        }),
    }
}

impl CpuFabric {
    /// `world` ranks, each with `data_bytes` of data and `flag_words` flags, all zero.
    pub fn new(world: usize, data_bytes: usize, flag_words: usize) -> Arc<CpuFabric> {
        let ranks = (0..world)
            .map(|_| CpuRankMemory {
                data: (0..data_bytes).map(|_| AtomicU8::new(0)).collect(),
                flags: (0..flag_words).map(|_| AtomicU64::new(0)).collect(),
            })
            .collect();
        Arc::new(CpuFabric { ranks })
    }

    fn rank(&self, rank: usize) -> Result<&CpuRankMemory, TransportError> {
        self.ranks.get(rank).ok_or_else(|| TransportError::Peer {
            peer: rank,
            detail: format!("not in the fabric of {} ranks", self.ranks.len()),
        })
    }

    /// Ranks in the fabric.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Bytes of each data region.
    pub fn data_bytes(&self) -> u64 {
        self.ranks.first().map_or(0, |r| r.data.len() as u64)
    }

    /// Bytes of each flag array.
    pub fn flag_bytes(&self) -> u64 {
        self.ranks.first().map_or(0, |r| r.flags.len() as u64 * FLAG_BYTES)
    }

    /// Writes `bytes` into `rank`'s data region at `offset` (the local GPU writing its buffer).
    pub fn write(&self, rank: usize, offset: u64, bytes: &[u8]) -> Result<(), TransportError> {
        let m = self.rank(rank)?;
        let r = range("write", rank, offset, bytes.len() as u64, m.data.len())?;
        for (d, s) in m.data[r].iter().zip(bytes) {
            d.store(*s, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Reads `len` bytes of `rank`'s data region at `offset`.
    pub fn read(&self, rank: usize, offset: u64, len: usize) -> Result<Vec<u8>, TransportError> {
        let m = self.rank(rank)?;
        let r = range("read", rank, offset, len as u64, m.data.len())?;
        Ok(m.data[r].iter().map(|b| b.load(Ordering::Relaxed)).collect())
    }

    /// Copies between data regions (what the wire does).
    pub fn copy(
        &self,
        src_rank: usize,
        src_offset: u64,
        dst_rank: usize,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), TransportError> {
        let (s, d) = (self.rank(src_rank)?, self.rank(dst_rank)?);
        let sr = range("copy source", src_rank, src_offset, bytes, s.data.len())?;
        let dr = range("copy destination", dst_rank, dst_offset, bytes, d.data.len())?;
        for (d, s) in d.data[dr].iter().zip(&s.data[sr]) {
            d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        Ok(())
    }

    fn flag_word(&self, rank: usize, flag_offset: u64) -> Result<&AtomicU64, TransportError> {
        let m = self.rank(rank)?;
        if flag_offset & (FLAG_BYTES - 1) != 0 {
            return Err(TransportError::Peer {
                peer: rank,
                detail: format!("flag offset {flag_offset} is not 8-byte aligned"),
            });
        }
        m.flags
            .get((flag_offset / FLAG_BYTES) as usize)
            .ok_or_else(|| TransportError::Peer {
                peer: rank,
                detail: format!("flag offset {flag_offset} outside the flag array"),
            })
    }

    /// Stores a flag with release ordering (after the data stores that precede it).
    pub fn store_flag(&self, rank: usize, flag_offset: u64, value: u64) -> Result<(), TransportError> {
        self.flag_word(rank, flag_offset)?.store(value, Ordering::Release);
        Ok(())
    }

    /// Loads a flag with acquire ordering (0 for an invalid offset).
    pub fn flag(&self, rank: usize, flag_offset: u64) -> u64 {
        self.flag_word(rank, flag_offset)
            .map_or(0, |f| f.load(Ordering::Acquire))
    }

    /// Waits until `rank`'s flag at `flag_offset` is at least `at_least` (what a device wait
    /// does); false on timeout.
    pub fn wait_flag(&self, rank: usize, flag_offset: u64, at_least: u64, timeout: Duration) -> bool {
        let t0 = Instant::now();
        let mut n = 0u32;
        while self.flag(rank, flag_offset) < at_least {
            if t0.elapsed() > timeout {
                return false;
            }
            n = n.saturating_add(1);
            if n < 256 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        true
    }
}

/// A [`CopyEngine`] over a [`CpuFabric`]: synchronous copies by the calling thread.
pub struct CpuCopyEngine {
    fabric: Arc<CpuFabric>,
    completed: Vec<u64>,
}

impl CpuCopyEngine {
    /// An engine on `fabric`.
    pub fn new(fabric: Arc<CpuFabric>) -> CpuCopyEngine {
        CpuCopyEngine {
            fabric,
            completed: Vec::new(),
        }
    }
}

impl CopyEngine for CpuCopyEngine {
    fn copy(
        &mut self,
        token: u64,
        src_rank: usize,
        src_offset: u64,
        dst_rank: usize,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), TransportError> {
        self.fabric.copy(src_rank, src_offset, dst_rank, dst_offset, bytes)?;
        self.completed.push(token);
        Ok(())
    }

    fn write_flag(&mut self, token: u64, dst_rank: usize, flag_offset: u64, value: u64) -> Result<(), TransportError> {
        self.fabric.store_flag(dst_rank, flag_offset, value)?;
        self.completed.push(token);
        Ok(())
    }

    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        completed.append(&mut self.completed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_and_flags_are_bounds_checked() {
        let f = CpuFabric::new(2, 16, 2);
        f.write(0, 4, &[1, 2, 3]).unwrap();
        f.copy(0, 4, 1, 10, 3).unwrap();
        assert_eq!(f.read(1, 10, 3).unwrap(), vec![1, 2, 3]);
        assert!(f.copy(0, 14, 1, 0, 3).is_err());
        assert!(f.copy(0, 0, 1, u64::MAX, 3).is_err());
        assert!(f.copy(0, 0, 2, 0, 1).is_err());
        assert!(f.store_flag(1, 4, 1).is_err());
        assert!(f.store_flag(1, 16, 1).is_err());
        f.store_flag(1, 8, 7).unwrap();
        assert_eq!(f.flag(1, 8), 7);
        assert!(f.wait_flag(1, 8, 7, Duration::ZERO));
        assert!(!f.wait_flag(1, 0, 1, Duration::from_millis(1)));
        assert_eq!((f.data_bytes(), f.flag_bytes(), f.world_size()), (16, 16, 2));
    }
}
