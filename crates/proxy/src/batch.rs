//! Grouping consecutive commands per destination into batches of at most `MAX_BATCH` commands.
//!
//! Commands keep their FIFO order within a destination; batches of different destinations are
//! independent (they travel on different connections anyway).
use crate::transport::Op;

#[derive(Default)]
struct Pending {
    ops: Vec<Op>,
    commands: usize,
}

/// Per-destination accumulation of operations.
pub struct Batcher {
    max_commands: usize,
    pending: Vec<Pending>,
    /// Destinations with pending operations, in the order they first got one.
    order: Vec<usize>,
}

impl Batcher {
    /// A batcher for `world` destinations, closing a batch at `max_commands` commands (>= 1).
    pub fn new(world: usize, max_commands: usize) -> Batcher {
        Batcher {
            max_commands: max_commands.max(1),
            pending: (0..world).map(|_| Pending::default()).collect(),
            order: Vec::new(),
        }
    }

    /// Adds the operations of one command for `dst`. Returns `Some(batch)` when this command
    /// filled `dst`'s batch (post it now), else `None`. `dst` must be below the world size
    /// (validated commands always are); others are returned at once as their own batch.
    pub fn push(&mut self, dst: usize, ops: &[Op]) -> Option<Vec<Op>> {
        let Some(p) = self.pending.get_mut(dst) else {
            return Some(ops.to_vec());
        };
        if p.commands == 0 {
            self.order.push(dst);
        }
        p.ops.extend_from_slice(ops);
        p.commands += 1;
        if p.commands >= self.max_commands {
            self.order.retain(|&d| d != dst);
            p.commands = 0;
            return Some(std::mem::take(&mut p.ops));
        }
        None
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Takes every pending batch, in the order their destinations first got a command.
    pub fn drain(&mut self) -> Vec<(usize, Vec<Op>)> {
        let order = std::mem::take(&mut self.order);
        let mut out = Vec::with_capacity(order.len());
        for dst in order {
            if let Some(p) = self.pending.get_mut(dst) {
                p.commands = 0;
                out.push((dst, std::mem::take(&mut p.ops)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(seq: u64) -> Op {
        Op::Signal {
            seq,
            flag_offset: 0,
            value: 1,
        }
    }

    #[test]
    fn full_batches_close_at_max_and_order_is_kept() {
        let mut b = Batcher::new(4, 3);
        assert_eq!(b.push(1, &[sig(0)]), None);
        assert_eq!(b.push(2, &[sig(1)]), None);
        assert_eq!(b.push(1, &[sig(2), sig(2)]), None);
        assert_eq!(b.push(1, &[sig(3)]), Some(vec![sig(0), sig(2), sig(2), sig(3)]));
        assert_eq!(b.push(3, &[sig(4)]), None);
        assert_eq!(b.drain(), vec![(2, vec![sig(1)]), (3, vec![sig(4)])]);
        assert!(b.is_empty());
        assert_eq!(b.push(9, &[sig(5)]), Some(vec![sig(5)]));
    }
}
