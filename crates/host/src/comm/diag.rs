//! Diagnostics of a stalled fused launch: a snapshot of a local rank's GEMM+ReduceScatter /
//! AllReduce state, read through this process's mapping of that rank's heap.
//!
//! Meant for a rank whose wait timed out naming a local peer that says nothing (its kernel
//! still waits, or never got its CTAs onto SMs), or for a watchdog thread of a launch that does
//! not end: it reads the rank's fused launch epoch and exit count, the per-CTA entry and exit marks
//! (`FUSED_CTA_MARKS_OFFSET`: which of the peer's CTAs started the running launch, on which SM,
//! and which left it), and the counters the protocol turns on (docs/protocol.md): the peer's
//! `FusedReady` flags from every rank, its incoming `Tile1` counters and its local `Outbox`
//! counters (its own compute's progress, which its relays wait for).
use super::Communicator;
use crate::error::{Error, Result};
use mkernel_config::comm::{
    cta_mark_parts, flag_offset, FlagSlot, ABORT_OFFSET, ERROR_RECORD_OFFSET, FUSED_CTA_MARKS_OFFSET,
    FUSED_EPOCH_OFFSET, FUSED_EXITS_OFFSET, HEAP_CONTROL_BYTES, MAX_COMM_CTAS, MAX_LOCAL_RANKS,
};
use std::fmt;

/// A local rank's fused-launch state at one moment ([`Communicator::fused_snapshot`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedSnapshot {
    /// The local rank read.
    pub rank: u32,
    /// Its fused launch epoch: the last launch that ended (the running one is `epoch + 1`).
    pub epoch: u64,
    /// CTAs of the running launch that have exited (the exit count).
    pub exited: u32,
    /// Its abort word (0: running).
    pub abort_word: u32,
    /// Its error record's code (0: no record).
    pub record_code: u32,
    /// Per CTA `0..ctas`: `(epoch, SM)` of its last entry mark (epoch 0: never started).
    pub entered: Vec<(u64, u32)>,
    /// Per CTA `0..ctas`: `(epoch, SM)` of its last exit mark.
    pub left: Vec<(u64, u32)>,
    /// `(FusedReady, src, 0)` at this rank for every local `src`.
    pub fused_ready: Vec<u64>,
    /// `(Tile1, src, mt)` at this rank: `[src][mt]`.
    pub tile1: Vec<Vec<u64>>,
    /// `(Outbox, dest, mt)` at this rank: `[dest][mt]`.
    pub outbox: Vec<Vec<u64>>,
}

impl FusedSnapshot {
    /// Decodes a copy of a heap's control area (`HEAP_CONTROL_BYTES` bytes from the heap's base).
    pub fn from_control_area(area: &[u8], rank: u32, world: u32, ctas: u32, row_tiles: u32) -> Result<FusedSnapshot> {
        if area.len() < HEAP_CONTROL_BYTES as usize
            || ctas > MAX_COMM_CTAS
            || row_tiles > MAX_COMM_CTAS
            || world > MAX_LOCAL_RANKS
            || rank >= world
        {
            return Err(Error::Unsupported(format!(
                "fused snapshot: {} bytes of control area (want {HEAP_CONTROL_BYTES}), {ctas} CTAs and {row_tiles} row \
                 tiles (at most {MAX_COMM_CTAS}), local rank {rank} of {world} (at most {MAX_LOCAL_RANKS})",
                area.len()
            )));
        }
        let u64_at = |off: u64| u64::from_le_bytes(area[off as usize..off as usize + 8].try_into().unwrap());
        let u32_at = |off: u64| u32::from_le_bytes(area[off as usize..off as usize + 4].try_into().unwrap());
        let marks = |first: u32| {
            (0..ctas)
                .map(|b| cta_mark_parts(u64_at(FUSED_CTA_MARKS_OFFSET + 8 * (first + b) as u64)))
                .collect()
        };
        let row = |slot: FlagSlot, src: u32| (0..row_tiles).map(|mt| u64_at(flag_offset(slot, src, mt))).collect();
        Ok(FusedSnapshot {
            rank,
            epoch: u64_at(FUSED_EPOCH_OFFSET),
            exited: u32_at(FUSED_EXITS_OFFSET),
            abort_word: u32_at(ABORT_OFFSET),
            record_code: u32_at(ERROR_RECORD_OFFSET),
            entered: marks(0),
            left: marks(MAX_COMM_CTAS),
            fused_ready: (0..world)
                .map(|s| u64_at(flag_offset(FlagSlot::FusedReady, s, 0)))
                .collect(),
            tile1: (0..world).map(|s| row(FlagSlot::Tile1, s)).collect(),
            outbox: (0..world).map(|d| row(FlagSlot::Outbox, d)).collect(),
        })
    }
}

/// CTA indices as ranges (`0-3 7 9-12`).
fn ranges(v: &[u32]) -> String {
    let mut out = vec![];
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(" ")
    }
}

impl fmt::Display for FusedSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let running = self.epoch + 1;
        // CTAs past the last one ever marked are beyond every grid this heap ran (since its
        // creation or last reset, which zero the marks): left out.
        let grid = self.entered.iter().rposition(|m| m.0 != 0).map_or(0, |b| b + 1);
        let cta_list = |pred: &dyn Fn(usize) -> bool| {
            ranges(&(0..grid).filter(|&b| pred(b)).map(|b| b as u32).collect::<Vec<_>>())
        };
        writeln!(
            f,
            "local rank {}: fused epoch {} (launch {running} running unless the queue ran out), {} CTAs exited it, abort word {:#x}, record code {}",
            self.rank, self.epoch, self.exited, self.abort_word, self.record_code
        )?;
        let started = |b: usize| self.entered[b].0 == running;
        let left = |b: usize| self.left[b].0 == running;
        writeln!(f, "  CTAs that entered launch {running}: {}", cta_list(&|b| started(b)))?;
        writeln!(
            f,
            "  ... and are still inside it: {}",
            cta_list(&|b| started(b) && !left(b))
        )?;
        writeln!(f, "  CTAs that did not enter it: {}", cta_list(&|b| !started(b)))?;
        let sms: Vec<String> = self
            .entered
            .iter()
            .enumerate()
            .filter(|(_, &(e, _))| e != 0)
            .map(|(b, &(e, sm))| format!("{b}:{sm}@{e}"))
            .collect();
        writeln!(f, "  entry marks (CTA:SM@epoch): {}", sms.join(" "))?;
        writeln!(f, "  FusedReady from each rank: {:?}", self.fused_ready)?;
        for (s, row) in self.tile1.iter().enumerate() {
            writeln!(f, "  Tile1 from rank {s}: {row:?}")?;
        }
        for (d, row) in self.outbox.iter().enumerate() {
            writeln!(f, "  Outbox for rank {d}: {row:?}")?;
        }
        Ok(())
    }
}

impl Communicator {
    /// A snapshot of local rank `rank`'s GEMM+ReduceScatter/AllReduce state (module docs), for
    /// a launch of up to `ctas` CTAs (CTAs never marked are left out of the summary) over
    /// `row_tiles` row tiles per rank chunk (`m / world / 128`), read through this process's
    /// mapping of its heap. Callable from any thread, also while kernels of this process run
    /// (a watchdog's view of a stalled launch): the copy goes through a stream of its own created
    /// `CU_STREAM_NON_BLOCKING`, which waits for nothing else, after binding the context to the
    /// calling thread. The values are a moment's, not a consistent cut.
    pub fn fused_snapshot(&self, rank: u32, ctas: u32, row_tiles: u32) -> Result<FusedSnapshot> {
        let base = self
            .heap
            .base(rank as usize)
            .ok_or_else(|| Error::Unsupported(format!("fused snapshot: local rank {rank} of {}", self.world)))?;
        self.device.context().bind_to_thread()?;
        let mut area = vec![0u8; HEAP_CONTROL_BYTES as usize];
        // (A raw stream: cudarc's `new_stream` may synchronize the context first, which would
        // wait for the very launch under study.)
        let stream = cudarc::driver::result::stream::create(cudarc::driver::result::stream::StreamKind::NonBlocking)?;
        // SAFETY: `base` is local rank `rank`'s heap as mapped in this context, at least
        // `HEAP_RESERVED_BYTES` (> `HEAP_CONTROL_BYTES`) long; `area` holds that many bytes and
        // outlives the copy (the stream is synchronized before `area` is read or dropped); the
        // stream is this function's own.
        let copied = unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut area, base, stream)
                .and_then(|()| cudarc::driver::result::stream::synchronize(stream))
        };
        // SAFETY: created above, used by nothing else; its work is finished (or failed).
        let _ = unsafe { cudarc::driver::result::stream::destroy(stream) };
        copied?;
        FusedSnapshot::from_control_area(&area, rank, self.world, ctas, row_tiles)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mkernel_config::comm::cta_mark;

    #[test]
    fn a_snapshot_names_the_ctas_that_never_started() {
        let mut area = vec![0u8; HEAP_CONTROL_BYTES as usize];
        let mut put = |off: u64, v: u64| area[off as usize..off as usize + 8].copy_from_slice(&v.to_le_bytes());
        put(FUSED_EPOCH_OFFSET, 41);
        // Launch 42: CTAs 0-2 started (CTA 1 also left), CTA 3 still holds launch 41's mark.
        for (b, e) in [(0u32, 42u64), (1, 42), (2, 42), (3, 41)] {
            put(FUSED_CTA_MARKS_OFFSET + 8 * b as u64, cta_mark(e, 10 + b));
        }
        put(
            FUSED_CTA_MARKS_OFFSET + 8 * (MAX_COMM_CTAS + 1) as u64,
            cta_mark(42, 11),
        );
        // CTA 5 started launch 42 after a reset: CTA 4 below it, never marked, did not enter.
        put(FUSED_CTA_MARKS_OFFSET + 8 * 5, cta_mark(42, 15));
        put(flag_offset(FlagSlot::FusedReady, 1, 0), 42);
        put(flag_offset(FlagSlot::Outbox, 1, 2), 16);
        // (CTA 6 was never marked: beyond the grid.)
        let s = FusedSnapshot::from_control_area(&area, 0, 2, 7, 4).unwrap();
        assert_eq!(s.epoch, 41);
        assert_eq!(s.entered[3], (41, 13));
        assert_eq!(s.fused_ready, vec![0, 42]);
        assert_eq!(s.outbox[1], vec![0, 0, 16, 0]);
        let text = s.to_string();
        assert!(text.contains("CTAs that entered launch 42: 0-2 5"), "{text}");
        assert!(text.contains("still inside it: 0 2 5"), "{text}");
        assert!(text.contains("did not enter it: 3-4\n"), "{text}");
        assert!(!text.contains(" 6:"), "{text}");
        assert!(FusedSnapshot::from_control_area(&area[..8], 0, 2, 4, 4).is_err());
        // More local ranks than the flag layout has columns for, a rank outside the world,
        // too many CTAs: errors, not out-of-range reads.
        for (rank, world, ctas) in [
            (0, MAX_LOCAL_RANKS + 1, 4),
            (0, u32::MAX, 4),
            (2, 2, 4),
            (0, 2, MAX_COMM_CTAS + 1),
        ] {
            let e = FusedSnapshot::from_control_area(&area, rank, world, ctas, 4).unwrap_err();
            assert!(e.to_string().contains("at most"), "{e}");
        }
    }
}
