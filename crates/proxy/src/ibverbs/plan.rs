//! Turning operations for one peer into RC work requests, as plain data (no NIC needed):
//! lane (queue pair) striping by command, chunking, selective signalling, fences, and the
//! bookkeeping that maps completions back to command sequence numbers.
//!
//! Rules:
//! * A command (a PUT with its flag, or a PUT without flag) goes on lane `k % lanes`, `k`
//!   counting this peer's data-carrying commands; its data chunks and its flag write are
//!   consecutive on that lane, so RC's in-order execution puts the flag after its data.
//! * A SIGNAL goes on the lane of the last PUT. If another lane still has work requests that
//!   have not completed, a [`Step::Fence`] comes first (the executor waits for that lane's
//!   completions, after a signalled zero-length probe if the lane's last request was
//!   unsignalled), so the flag is written after every earlier put to the peer.
//! * Work request `i` of a lane is signalled when `(i + 1) % signal_every == 0`; probes always.
//!   A completion of request `i` completes every request `<= i` of that lane.
use super::blob::RemoteMem;
use crate::error::TransportError;
use crate::transport::Op;
use std::collections::VecDeque;

/// A local registered region: where puts read from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalMem {
    /// Address of the first byte (the registration's address / IOVA).
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Local key.
    pub lkey: u32,
}

/// A put of `bytes` from `src_offset` of `local` to `dst_offset` of `data` stays inside both
/// regions (a [`TransportError::Config`] naming both ranges otherwise).
pub(crate) fn check_put(
    local: LocalMem,
    data: RemoteMem,
    src_offset: u64,
    dst_offset: u64,
    bytes: u64,
) -> Result<(), TransportError> {
    let src_ok = src_offset.checked_add(bytes).is_some_and(|e| e <= local.len);
    let dst_ok = dst_offset.checked_add(bytes).is_some_and(|e| e <= data.len);
    if !src_ok || !dst_ok {
        return Err(TransportError::Config(format!(
            "put [{src_offset}, +{bytes}) -> [{dst_offset}, +{bytes}) outside {} / {} bytes",
            local.len, data.len
        )));
    }
    Ok(())
}

/// What a work request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload {
    /// One scatter-gather entry of registered memory.
    Sge {
        /// Address.
        addr: u64,
        /// Length (at most `max_msg`).
        length: u32,
        /// Local key.
        lkey: u32,
    },
    /// An 8-byte value sent inline (the flag): copied at post time, no registration needed.
    Inline(u64),
    /// Zero bytes (a completion probe).
    Empty,
}

/// One RDMA-write work request, before it becomes an `ibv_send_wr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrDesc {
    /// [`wr_id`] of (peer slot, lane, index).
    pub wr_id: u64,
    /// Source.
    pub payload: Payload,
    /// Destination address.
    pub remote_addr: u64,
    /// Destination key.
    pub rkey: u32,
    /// Request a completion.
    pub signaled: bool,
}

/// One step for the executor, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Post these requests on `lane` as one chain.
    Post {
        /// Lane (queue pair index of the peer).
        lane: usize,
        /// Requests, in order.
        wrs: Vec<WrDesc>,
    },
    /// Wait until `lane` has completed `until` requests.
    Fence {
        /// Lane.
        lane: usize,
        /// Completed-request count to reach.
        until: u64,
    },
}

/// The plan for one batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Steps in order.
    pub steps: Vec<Step>,
    /// Operations that need no work request (zero-byte puts): complete at once.
    pub instant: Vec<u64>,
}

const INDEX_BITS: u32 = 40;
const LANE_BITS: u32 = 8;

/// Encodes a work request id: peer slot (16 bits) | lane (8 bits) | index (40 bits).
pub fn wr_id(peer_slot: u16, lane: u8, index: u64) -> u64 {
    (u64::from(peer_slot) << (INDEX_BITS + LANE_BITS))
        | (u64::from(lane) << INDEX_BITS)
        | (index & ((1 << INDEX_BITS) - 1))
}

/// Decodes a [`wr_id`] into (peer slot, lane, index).
pub fn split_wr_id(id: u64) -> (u16, u8, u64) {
    (
        (id >> (INDEX_BITS + LANE_BITS)) as u16,
        (id >> INDEX_BITS) as u8,
        id & ((1 << INDEX_BITS) - 1),
    )
}

#[derive(Clone, Debug, Default)]
struct Lane {
    /// Requests created (indices `0..next`).
    next: u64,
    /// Requests known complete (indices `0..completed`).
    completed: u64,
    /// Index of the last signalled request, if any.
    last_signaled: Option<u64>,
    /// (index, seq) of requests whose completion completes an operation.
    cookies: VecDeque<(u64, u64)>,
}

/// Work-request planning for one peer.
#[derive(Clone, Debug)]
pub struct PeerPlanner {
    slot: u16,
    lanes: Vec<Lane>,
    signal_every: u64,
    max_msg: u64,
    commands: u64,
    last_put_lane: usize,
}

impl PeerPlanner {
    /// A planner for the peer in `slot` with `lanes` queue pairs (1..=256).
    pub fn new(slot: u16, lanes: usize, signal_every: u32, max_msg: u64) -> Result<Self, TransportError> {
        if !(1..=256).contains(&lanes) || signal_every == 0 || max_msg == 0 || max_msg > u64::from(u32::MAX) {
            return Err(TransportError::Config(format!(
                "lanes {lanes}, signal_every {signal_every}, max_msg {max_msg}"
            )));
        }
        Ok(PeerPlanner {
            slot,
            lanes: vec![Lane::default(); lanes],
            signal_every: u64::from(signal_every),
            max_msg,
            commands: 0,
            last_put_lane: 0,
        })
    }

    /// Number of lanes.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Requests created on `lane`.
    pub fn created(&self, lane: usize) -> u64 {
        self.lanes.get(lane).map_or(0, |l| l.next)
    }

    /// Requests of `lane` known complete.
    pub fn completed(&self, lane: usize) -> u64 {
        self.lanes.get(lane).map_or(0, |l| l.completed)
    }

    fn make(
        &mut self,
        lane: usize,
        payload: Payload,
        remote_addr: u64,
        rkey: u32,
        seq: Option<u64>,
        force_signal: bool,
    ) -> WrDesc {
        let l = &mut self.lanes[lane];
        let index = l.next;
        l.next += 1;
        let signaled = force_signal || index % self.signal_every == self.signal_every - 1;
        if signaled {
            l.last_signaled = Some(index);
        }
        if let Some(s) = seq {
            l.cookies.push_back((index, s));
        }
        WrDesc {
            wr_id: wr_id(self.slot, lane as u8, index),
            payload,
            remote_addr,
            rkey,
            signaled,
        }
    }

    fn flush(pending: &mut [Vec<WrDesc>], steps: &mut Vec<Step>) {
        for (lane, wrs) in pending.iter_mut().enumerate() {
            if !wrs.is_empty() {
                steps.push(Step::Post {
                    lane,
                    wrs: std::mem::take(wrs),
                });
            }
        }
    }

    /// Plans `ops` (the operations of whole commands, in FIFO order) for this peer.
    /// Puts read `local` and write `data`; flags write `flags`. Offsets were validated by the
    /// proxy; they are checked again here (an error, never a stray write).
    pub fn plan(
        &mut self,
        ops: &[Op],
        local: LocalMem,
        data: RemoteMem,
        flags: RemoteMem,
    ) -> Result<Plan, TransportError> {
        let mut plan = Plan::default();
        let mut pending: Vec<Vec<WrDesc>> = vec![Vec::new(); self.lanes.len()];
        let mut i = 0;
        while i < ops.len() {
            let seq = ops[i].seq();
            let end = i + ops[i..].iter().take_while(|o| o.seq() == seq).count();
            let cmd = &ops[i..end];
            i = end;
            let lane = if cmd.iter().any(|o| matches!(o, Op::Put { .. })) {
                let lane = (self.commands % self.lanes.len() as u64) as usize;
                self.commands += 1;
                self.last_put_lane = lane;
                lane
            } else {
                let lane = self.last_put_lane;
                let behind: Vec<usize> = (0..self.lanes.len())
                    .filter(|&l| l != lane && self.lanes[l].next > self.lanes[l].completed)
                    .collect();
                if !behind.is_empty() {
                    Self::flush(&mut pending, &mut plan.steps);
                    for l in behind {
                        if self.lanes[l].last_signaled != Some(self.lanes[l].next - 1) {
                            let probe = self.make(l, Payload::Empty, flags.addr, flags.rkey, None, true);
                            plan.steps.push(Step::Post {
                                lane: l,
                                wrs: vec![probe],
                            });
                        }
                        plan.steps.push(Step::Fence {
                            lane: l,
                            until: self.lanes[l].next,
                        });
                    }
                }
                lane
            };
            for op in cmd {
                match *op {
                    Op::Put {
                        seq,
                        src_offset,
                        dst_offset,
                        bytes,
                    } => {
                        check_put(local, data, src_offset, dst_offset, bytes)?;
                        if bytes == 0 {
                            plan.instant.push(seq);
                        }
                        let mut off = 0;
                        while off < bytes {
                            let n = (bytes - off).min(self.max_msg);
                            let last = off + n == bytes;
                            let payload = Payload::Sge {
                                addr: local.addr + src_offset + off,
                                length: n as u32,
                                lkey: local.lkey,
                            };
                            let wr = self.make(
                                lane,
                                payload,
                                data.addr + dst_offset + off,
                                data.rkey,
                                last.then_some(seq),
                                false,
                            );
                            pending[lane].push(wr);
                            off += n;
                        }
                    }
                    Op::Signal {
                        seq,
                        flag_offset,
                        value,
                    } => {
                        if flag_offset.checked_add(8).is_none_or(|e| e > flags.len) {
                            return Err(TransportError::Config(format!(
                                "flag offset {flag_offset} outside {} bytes",
                                flags.len
                            )));
                        }
                        let wr = self.make(
                            lane,
                            Payload::Inline(value),
                            flags.addr + flag_offset,
                            flags.rkey,
                            Some(seq),
                            false,
                        );
                        pending[lane].push(wr);
                    }
                }
            }
        }
        Self::flush(&mut pending, &mut plan.steps);
        Ok(plan)
    }

    /// A completion arrived for request `index` of `lane`: every request `<= index` of that
    /// lane is complete. Appends the seqs of the operations this completes.
    pub fn complete(&mut self, lane: usize, index: u64, completed: &mut Vec<u64>) {
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        l.completed = l.completed.max(index + 1);
        while l.cookies.front().is_some_and(|&(i, _)| i <= index) {
            if let Some((_, s)) = l.cookies.pop_front() {
                completed.push(s);
            }
        }
    }

    /// Probes for lanes whose last request is unsignalled (so their tail would never report
    /// completion while no more traffic comes). Call when idle.
    pub fn idle_probes(&mut self, flags: RemoteMem) -> Vec<Step> {
        let mut steps = vec![];
        for lane in 0..self.lanes.len() {
            let l = &self.lanes[lane];
            if l.next > l.completed && l.last_signaled != Some(l.next - 1) {
                let probe = self.make(lane, Payload::Empty, flags.addr, flags.rkey, None, true);
                steps.push(Step::Post { lane, wrs: vec![probe] });
            }
        }
        steps
    }

    /// Requests created but not known complete, over all lanes.
    pub fn outstanding(&self) -> u64 {
        self.lanes.iter().map(|l| l.next - l.completed).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: LocalMem = LocalMem {
        addr: 0x1000,
        len: 1 << 20,
        lkey: 11,
    };
    const DATA: RemoteMem = RemoteMem {
        addr: 0x9000_0000,
        len: 1 << 20,
        rkey: 22,
    };
    const FLAGS: RemoteMem = RemoteMem {
        addr: 0x7000_0000,
        len: 4096,
        rkey: 33,
    };

    fn put(seq: u64, src: u64, dst: u64, bytes: u64) -> Op {
        Op::Put {
            seq,
            src_offset: src,
            dst_offset: dst,
            bytes,
        }
    }
    fn sig(seq: u64, off: u64, v: u64) -> Op {
        Op::Signal {
            seq,
            flag_offset: off,
            value: v,
        }
    }
    fn posts(p: &Plan) -> Vec<(usize, Vec<WrDesc>)> {
        p.steps
            .iter()
            .filter_map(|s| {
                if let Step::Post { lane, wrs } = s {
                    Some((*lane, wrs.clone()))
                } else {
                    None
                }
            })
            .collect()
    }

    #[test]
    fn wr_ids_round_trip() {
        assert_eq!(split_wr_id(wr_id(513, 7, 123_456_789)), (513, 7, 123_456_789));
        assert_eq!(
            split_wr_id(wr_id(u16::MAX, 255, (1 << 40) - 1)),
            (u16::MAX, 255, (1 << 40) - 1)
        );
    }

    #[test]
    fn data_then_inline_flag_on_one_lane() {
        let mut p = PeerPlanner::new(2, 1, 4, 1 << 30).unwrap();
        let plan = p
            .plan(&[put(5, 64, 128, 1000), sig(5, 16, 9)], LOCAL, DATA, FLAGS)
            .unwrap();
        let posts = posts(&plan);
        assert_eq!(posts.len(), 1);
        let (lane, wrs) = &posts[0];
        assert_eq!(*lane, 0);
        assert_eq!(
            wrs[0],
            WrDesc {
                wr_id: wr_id(2, 0, 0),
                payload: Payload::Sge {
                    addr: 0x1000 + 64,
                    length: 1000,
                    lkey: 11
                },
                remote_addr: 0x9000_0000 + 128,
                rkey: 22,
                signaled: false
            }
        );
        assert_eq!(
            wrs[1],
            WrDesc {
                wr_id: wr_id(2, 0, 1),
                payload: Payload::Inline(9),
                remote_addr: 0x7000_0000 + 16,
                rkey: 33,
                signaled: false
            }
        );
    }

    #[test]
    fn large_puts_are_chunked_and_every_nth_is_signalled() {
        let mut p = PeerPlanner::new(0, 1, 2, 300).unwrap();
        let plan = p.plan(&[put(1, 0, 0, 700), sig(1, 0, 1)], LOCAL, DATA, FLAGS).unwrap();
        let wrs = &posts(&plan)[0].1;
        let lens: Vec<u32> = wrs
            .iter()
            .filter_map(|w| {
                if let Payload::Sge { length, .. } = w.payload {
                    Some(length)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(lens, [300, 300, 100]);
        assert_eq!(wrs[2].remote_addr, DATA.addr + 600);
        assert_eq!(
            wrs.iter().map(|w| w.signaled).collect::<Vec<_>>(),
            [false, true, false, true]
        );
        // Completing index 1 completes nothing reportable (chunks carry no cookie); index 3 completes both ops.
        let mut done = vec![];
        p.complete(0, 1, &mut done);
        assert!(done.is_empty());
        p.complete(0, 3, &mut done);
        assert_eq!(done, [1, 1]);
        assert_eq!(p.outstanding(), 0);
    }

    #[test]
    fn commands_stripe_over_lanes_and_signals_fence() {
        let mut p = PeerPlanner::new(1, 2, 16, 1 << 30).unwrap();
        let ops = [
            put(0, 0, 0, 8),
            sig(0, 0, 1),
            put(1, 8, 8, 8),
            sig(1, 8, 1),
            put(2, 16, 16, 8),
            sig(3, 24, 7),
        ];
        let plan = p.plan(&ops, LOCAL, DATA, FLAGS).unwrap();
        // put 0 -> lane 0, put 1 -> lane 1, put 2 -> lane 0; the SIGNAL (seq 3) follows put 2 on
        // lane 0 and must first wait for lane 1 (probe, since its last request is unsignalled).
        assert_eq!(plan.steps.len(), 5, "{:#?}", plan.steps);
        assert!(matches!(&plan.steps[0], Step::Post { lane: 0, wrs } if wrs.len() == 3));
        assert!(matches!(&plan.steps[1], Step::Post { lane: 1, wrs } if wrs.len() == 2));
        assert!(
            matches!(&plan.steps[2], Step::Post { lane: 1, wrs } if wrs.len() == 1 && wrs[0].payload == Payload::Empty && wrs[0].signaled)
        );
        assert_eq!(plan.steps[3], Step::Fence { lane: 1, until: 3 });
        assert!(
            matches!(&plan.steps[4], Step::Post { lane: 0, wrs } if wrs.len() == 1 && wrs[0].payload == Payload::Inline(7))
        );
        // Once lane 1 has completed, a later signal needs no fence.
        let mut done = vec![];
        p.complete(1, 2, &mut done);
        assert_eq!(done, [1, 1]);
        let plan = p.plan(&[sig(4, 0, 2)], LOCAL, DATA, FLAGS).unwrap();
        assert_eq!(plan.steps.len(), 1);
    }

    #[test]
    fn idle_probes_cover_unsignalled_tails_once() {
        let mut p = PeerPlanner::new(0, 1, 16, 1 << 30).unwrap();
        p.plan(&[put(0, 0, 0, 8)], LOCAL, DATA, FLAGS).unwrap();
        let probes = p.idle_probes(FLAGS);
        assert_eq!(probes.len(), 1);
        assert!(p.idle_probes(FLAGS).is_empty(), "the probe is the signalled tail now");
        let mut done = vec![];
        p.complete(0, 1, &mut done);
        assert_eq!(done, [0]);
        assert!(p.idle_probes(FLAGS).is_empty());
    }

    #[test]
    fn zero_byte_puts_complete_at_once_and_bad_offsets_are_errors() {
        let mut p = PeerPlanner::new(0, 1, 1, 1 << 30).unwrap();
        let plan = p.plan(&[put(0, 0, 0, 0), sig(0, 0, 1)], LOCAL, DATA, FLAGS).unwrap();
        assert_eq!(plan.instant, [0]);
        assert_eq!(posts(&plan)[0].1.len(), 1);
        assert!(p.plan(&[put(1, 1 << 20, 0, 1)], LOCAL, DATA, FLAGS).is_err());
        assert!(p.plan(&[sig(2, 4096, 1)], LOCAL, DATA, FLAGS).is_err());
        assert!(PeerPlanner::new(0, 0, 1, 1).is_err());
    }
}
