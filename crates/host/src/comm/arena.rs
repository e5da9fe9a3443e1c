//! The symmetric heap's allocator: first fit over the data region, with free.
//!
//! Every rank runs the same allocator on the same sequence of requests, so offsets agree
//! without an exchange (the plans' agreement, [`super::agree`], still compares them). The
//! offset a request gets depends only on the set of live buffers, never on the order in which
//! earlier ones were freed: the free space is the complement of the live set, and the first
//! gap (lowest offset) that fits is taken. So plans made and dropped leave the allocator as it
//! was, and ranks that freed the same buffers in different orders still agree.
use super::SymBuffer;
use crate::error::{Error, Result};
use std::collections::BTreeMap;

const OP: &str = "symmetric heap";
/// Every buffer starts and ends on this boundary.
pub const ALIGN: u64 = 256;

/// First-fit allocator of `[start, end)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HeapAllocator {
    start: u64,
    end: u64,
    /// Live buffers: offset -> bytes (rounded), disjoint.
    live: BTreeMap<u64, u64>,
}

impl HeapAllocator {
    /// An allocator of `[start, end)` (`start` a multiple of [`ALIGN`]).
    pub(crate) fn new(start: u64, end: u64) -> HeapAllocator {
        HeapAllocator {
            start,
            end,
            live: BTreeMap::new(),
        }
    }

    /// `bytes` rounded up to [`ALIGN`] at the lowest offset where they fit.
    pub(crate) fn alloc(&mut self, bytes: u64) -> Result<SymBuffer> {
        let b = self.peek(bytes)?;
        self.live.insert(b.offset, b.bytes);
        Ok(b)
    }

    /// Where [`HeapAllocator::alloc`] would put `bytes`, without taking them.
    pub(crate) fn peek(&self, bytes: u64) -> Result<SymBuffer> {
        let rounded = bytes
            .max(1)
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(|| Error::Shape {
                op: OP,
                reason: format!("{bytes} bytes overflow 64 bits when rounded up to {ALIGN}"),
            })?;
        let mut at = self.start;
        for (&off, &len) in &self.live {
            if off.checked_sub(at).is_some_and(|gap| gap >= rounded) {
                return Ok(SymBuffer {
                    offset: at,
                    bytes: rounded,
                });
            }
            at = off + len;
        }
        match at.checked_add(rounded) {
            Some(e) if e <= self.end => Ok(SymBuffer {
                offset: at,
                bytes: rounded,
            }),
            _ => Err(Error::Shape {
                op: OP,
                reason: format!(
                    "{rounded} more bytes do not fit ({} of {} data bytes in use, largest free gap {})",
                    self.used(),
                    self.end - self.start,
                    self.largest_gap()
                ),
            }),
        }
    }

    /// Gives `b` back; [`Error::OutOfRange`] when it is not a live buffer of this allocator.
    pub(crate) fn free(&mut self, b: SymBuffer) -> Result<()> {
        match self.live.get(&b.offset) {
            Some(&len) if len == b.bytes => {
                self.live.remove(&b.offset);
                Ok(())
            }
            _ => Err(Error::OutOfRange {
                op: OP,
                reason: format!("no live buffer at offset {} of {} bytes to free", b.offset, b.bytes),
            }),
        }
    }

    /// Bytes of live buffers.
    pub(crate) fn used(&self) -> u64 {
        self.live.values().sum()
    }

    /// Live buffers.
    pub(crate) fn live(&self) -> usize {
        self.live.len()
    }

    fn largest_gap(&self) -> u64 {
        let mut at = self.start;
        let mut best = 0;
        for (&off, &len) in &self.live {
            best = best.max(off - at);
            at = off + len;
        }
        best.max(self.end - at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: u64 = 1 << 16;
    const END: u64 = START + (1 << 20);

    #[test]
    fn rounds_and_refuses_overflow() {
        let mut h = HeapAllocator::new(START, END);
        let a = h.alloc(1).unwrap();
        assert_eq!((a.offset(), a.bytes()), (START, 256));
        let b = h.alloc(257).unwrap();
        assert_eq!((b.offset(), b.bytes()), (START + 256, 512));
        assert!(matches!(h.alloc(1 << 20), Err(Error::Shape { .. })));
        let mut fresh = HeapAllocator::new(START, END);
        assert!(fresh.alloc(1 << 20).is_ok());
        for bytes in [u64::MAX, u64::MAX - 255, u64::MAX - START] {
            assert!(matches!(h.alloc(bytes), Err(Error::Shape { .. })), "{bytes}");
        }
    }

    #[test]
    fn freed_space_is_reused_first_fit_and_the_heap_returns_to_its_state() {
        let mut h = HeapAllocator::new(START, END);
        let keep = h.alloc(1000).unwrap();
        let before = h.clone();
        for i in 0..1000u64 {
            let a = h.alloc(4096 + i).unwrap();
            let b = h.alloc(300).unwrap();
            assert_eq!(a.offset(), keep.offset() + keep.bytes(), "plan {i}");
            h.free(a).unwrap();
            h.free(b).unwrap();
        }
        assert_eq!(h, before);
        // A hole left by a freed buffer takes the next request that fits.
        let a = h.alloc(512).unwrap();
        let b = h.alloc(512).unwrap();
        h.free(a).unwrap();
        assert_eq!(h.alloc(256).unwrap().offset(), a.offset());
        assert_eq!(h.alloc(512).unwrap().offset(), b.offset() + 512);
    }

    #[test]
    fn the_order_of_frees_does_not_change_later_offsets() {
        let mut x = HeapAllocator::new(START, END);
        let bufs: Vec<SymBuffer> = (1..6).map(|i| x.alloc(i * 1000).unwrap()).collect();
        let mut y = x.clone();
        for i in [1, 3, 0] {
            x.free(bufs[i]).unwrap();
        }
        for i in [0, 3, 1] {
            y.free(bufs[i]).unwrap();
        }
        assert_eq!(x, y);
        for bytes in [700, 5000, 20_000] {
            assert_eq!(x.alloc(bytes).unwrap(), y.alloc(bytes).unwrap());
        }
    }

    #[test]
    fn freeing_what_is_not_live_is_refused() {
        let mut h = HeapAllocator::new(START, END);
        let a = h.alloc(256).unwrap();
        let forged = SymBuffer {
            offset: a.offset(),
            bytes: 512,
        };
        assert!(matches!(h.free(forged), Err(Error::OutOfRange { .. })));
        h.free(a).unwrap();
        assert!(matches!(h.free(a), Err(Error::OutOfRange { .. })));
        assert_eq!((h.used(), h.live()), (0, 0));
    }
}
