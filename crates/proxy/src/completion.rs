//! The local-completion watermark: the first command whose operations are not all complete.
use std::collections::VecDeque;

/// Tracks how many operations of each consumed command are still in flight.
///
/// Commands are issued in sequence order (as the consumer reads them); operations complete in
/// any order. [`watermark`](Self::watermark) is what the proxy publishes as `FifoHeader::done`.
pub struct CompletionTracker {
    base: u64,
    remaining: VecDeque<u32>,
}

impl CompletionTracker {
    /// A tracker whose first command will be `first_seq`.
    pub fn new(first_seq: u64) -> Self {
        CompletionTracker {
            base: first_seq,
            remaining: VecDeque::new(),
        }
    }

    /// Registers command `seq` with `ops` operations. Returns false (and ignores it) if `seq` is
    /// not the next sequence number.
    pub fn issue(&mut self, seq: u64, ops: u32) -> bool {
        if seq != self.base + self.remaining.len() as u64 {
            return false;
        }
        self.remaining.push_back(ops);
        self.advance();
        true
    }

    /// One operation of command `seq` completed. Returns false for an unknown or finished `seq`.
    pub fn complete(&mut self, seq: u64) -> bool {
        let Some(idx) = seq.checked_sub(self.base) else {
            return false;
        };
        let ok = match self.remaining.get_mut(idx as usize) {
            Some(r) if *r > 0 => {
                *r -= 1;
                true
            }
            _ => false,
        };
        self.advance();
        ok
    }

    fn advance(&mut self) {
        while self.remaining.front() == Some(&0) {
            self.remaining.pop_front();
            self.base += 1;
        }
    }

    /// Every command below this has completed.
    pub fn watermark(&self) -> u64 {
        self.base
    }

    /// Operations still in flight.
    pub fn in_flight(&self) -> u64 {
        self.remaining.iter().map(|&r| u64::from(r)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_order_completions() {
        let mut t = CompletionTracker::new(10);
        assert!(t.issue(10, 2) && t.issue(11, 0) && t.issue(12, 1));
        assert!(!t.issue(14, 1));
        assert_eq!(t.watermark(), 10);
        assert!(t.complete(12));
        assert!(t.complete(10));
        assert_eq!(t.watermark(), 10);
        assert!(t.complete(10));
        assert_eq!(t.watermark(), 13);
        assert!(!t.complete(10) && !t.complete(3) && !t.complete(99));
        assert_eq!(t.in_flight(), 0);
        assert!(t.issue(13, 0));
        assert_eq!(t.watermark(), 14);
    }
}
