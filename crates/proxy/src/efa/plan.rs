//! Sender-side SRD planning as plain data: puts become RDMA writes with a data immediate,
//! flags become sends of a [`SignalRecord`] naming how many data messages precede them.
use super::imm::{Imm, SignalRecord};
use crate::error::TransportError;
use crate::ibverbs::blob::RemoteMem;
use crate::ibverbs::plan::{check_put, LocalMem};
use crate::transport::Op;
use std::collections::HashMap;

/// One SRD work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SrdWr {
    /// RDMA write-with-immediate of registered local memory.
    WriteImm {
        /// Work request id.
        wr_id: u64,
        /// Queue pair index.
        lane: usize,
        /// Source address.
        addr: u64,
        /// Length.
        length: u32,
        /// Local key.
        lkey: u32,
        /// Destination address.
        remote_addr: u64,
        /// Destination key.
        rkey: u32,
        /// Immediate (host order).
        imm: u32,
    },
    /// Send-with-immediate of a signal record (inline).
    SendImm {
        /// Work request id.
        wr_id: u64,
        /// Queue pair index.
        lane: usize,
        /// Payload.
        record: SignalRecord,
        /// Immediate (host order).
        imm: u32,
    },
}

impl SrdWr {
    /// The work request id.
    pub fn wr_id(&self) -> u64 {
        match *self {
            SrdWr::WriteImm { wr_id, .. } | SrdWr::SendImm { wr_id, .. } => wr_id,
        }
    }
}

/// Plans SRD work requests for all peers of one sender; every request is signalled (SRD may
/// complete them in any order), and each completion is matched by id.
pub struct SrdPlanner {
    me: u16,
    lanes: usize,
    max_msg: u64,
    commands: u64,
    data_sent: Vec<u64>,
    next_id: u64,
    outstanding: HashMap<u64, Option<u64>>,
}

impl SrdPlanner {
    /// A planner for sender `me` in a world of `world` ranks, with `lanes` queue pairs and
    /// writes of at most `max_msg` bytes.
    pub fn new(me: usize, world: usize, lanes: usize, max_msg: u64) -> Result<SrdPlanner, TransportError> {
        let me = u16::try_from(me).map_err(|_| {
            TransportError::Config(format!(
                "rank {me} does not fit the 16-bit sender field of the EFA immediate"
            ))
        })?;
        if world > 1 << 16 || lanes == 0 || max_msg == 0 || max_msg > u64::from(u32::MAX) {
            return Err(TransportError::Config(format!(
                "world {world} (<= 65536), lanes {lanes} (>= 1), max_msg {max_msg}"
            )));
        }
        Ok(SrdPlanner {
            me,
            lanes,
            max_msg,
            commands: 0,
            data_sent: vec![0; world],
            next_id: 0,
            outstanding: HashMap::new(),
        })
    }

    fn id(&mut self, seq: Option<u64>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.outstanding.insert(id, seq);
        id
    }

    /// Plans `ops` (whole commands, FIFO order) to `dst`. Returns the requests and the seqs of
    /// operations that need none (zero-byte puts).
    pub fn plan(
        &mut self,
        dst: usize,
        ops: &[Op],
        local: LocalMem,
        data: RemoteMem,
    ) -> Result<(Vec<SrdWr>, Vec<u64>), TransportError> {
        if dst >= self.data_sent.len() {
            return Err(TransportError::Peer {
                peer: dst,
                detail: "out of range".into(),
            });
        }
        let (mut wrs, mut instant) = (vec![], vec![]);
        let mut last_seq = None;
        let mut lane = 0;
        for op in ops {
            if last_seq != Some(op.seq()) {
                last_seq = Some(op.seq());
                lane = (self.commands % self.lanes as u64) as usize;
                self.commands += 1;
            }
            match *op {
                Op::Put {
                    seq,
                    src_offset,
                    dst_offset,
                    bytes,
                } => {
                    check_put(local, data, src_offset, dst_offset, bytes)?;
                    if bytes == 0 {
                        instant.push(seq);
                    }
                    let mut off = 0;
                    while off < bytes {
                        let n = (bytes - off).min(self.max_msg);
                        let last = off + n == bytes;
                        let wr_id = self.id(last.then_some(seq));
                        wrs.push(SrdWr::WriteImm {
                            wr_id,
                            lane,
                            addr: local.addr + src_offset + off,
                            length: n as u32,
                            lkey: local.lkey,
                            remote_addr: data.addr + dst_offset + off,
                            rkey: data.rkey,
                            imm: Imm::data(self.me).encode(),
                        });
                        self.data_sent[dst] += 1;
                        off += n;
                    }
                }
                Op::Signal {
                    seq,
                    flag_offset,
                    value,
                } => {
                    let record = SignalRecord {
                        magic: SignalRecord::MAGIC,
                        sender: u32::from(self.me),
                        needed: self.data_sent[dst],
                        flag_offset,
                        value,
                    };
                    let wr_id = self.id(Some(seq));
                    wrs.push(SrdWr::SendImm {
                        wr_id,
                        lane,
                        record,
                        imm: Imm::signal(self.me).encode(),
                    });
                }
            }
        }
        Ok((wrs, instant))
    }

    /// Request `wr_id` completed: `Some(Some(seq))` if it completes an operation,
    /// `Some(None)` for an intermediate chunk, `None` for an unknown id.
    pub fn complete(&mut self, wr_id: u64) -> Option<Option<u64>> {
        self.outstanding.remove(&wr_id)
    }

    /// Requests not yet completed.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::efa::imm::ImmKind;
    use crate::efa::recv::{RecvTracker, VecFlags};

    const LOCAL: LocalMem = LocalMem {
        addr: 0x1000,
        len: 1 << 20,
        lkey: 1,
    };
    const DATA: RemoteMem = RemoteMem {
        addr: 0x8000,
        len: 1 << 20,
        rkey: 2,
    };

    #[test]
    fn puts_count_data_messages_and_signals_carry_the_count() {
        let mut p = SrdPlanner::new(3, 4, 2, 256).unwrap();
        let ops = [
            Op::Put {
                seq: 0,
                src_offset: 0,
                dst_offset: 64,
                bytes: 600,
            },
            Op::Signal {
                seq: 0,
                flag_offset: 8,
                value: 1,
            },
            Op::Signal {
                seq: 1,
                flag_offset: 16,
                value: 1,
            },
        ];
        let (wrs, instant) = p.plan(1, &ops, LOCAL, DATA).unwrap();
        assert!(instant.is_empty());
        assert_eq!(wrs.len(), 5);
        let lens: Vec<u32> = wrs
            .iter()
            .filter_map(|w| {
                if let SrdWr::WriteImm { length, .. } = w {
                    Some(*length)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(lens, [256, 256, 88]);
        if let SrdWr::WriteImm {
            remote_addr,
            addr,
            imm,
            lane,
            ..
        } = wrs[2]
        {
            assert_eq!((remote_addr, addr, lane), (0x8000 + 64 + 512, 0x1000 + 512, 0));
            assert_eq!(Imm::decode(imm).unwrap(), Imm::data(3));
        }
        match wrs[3] {
            SrdWr::SendImm { record, imm, lane, .. } => {
                assert_eq!(
                    (record.needed, record.flag_offset, record.value, record.sender, lane),
                    (3, 8, 1, 3, 0)
                );
                assert_eq!(Imm::decode(imm).unwrap().kind, ImmKind::Signal);
            }
            w => panic!("{w:?}"),
        }
        assert!(matches!(
            wrs[4],
            SrdWr::SendImm {
                lane: 1,
                record: SignalRecord { needed: 3, .. },
                ..
            }
        ));
        // Counts are per destination.
        let (wrs, _) = p
            .plan(
                2,
                &[Op::Signal {
                    seq: 2,
                    flag_offset: 0,
                    value: 1,
                }],
                LOCAL,
                DATA,
            )
            .unwrap();
        assert!(matches!(
            wrs[0],
            SrdWr::SendImm {
                record: SignalRecord { needed: 0, .. },
                ..
            }
        ));
        // Completion matching: chunks complete nothing, the last chunk and the send complete seq 0.
        assert_eq!(p.complete(0), Some(None));
        assert_eq!(p.complete(2), Some(Some(0)));
        assert_eq!(p.complete(3), Some(Some(0)));
        assert_eq!(p.complete(3), None);
        assert_eq!(p.outstanding(), 3);
    }

    #[test]
    fn any_arrival_order_raises_flags_only_after_their_data() {
        // Sender 1 -> receiver: puts with flags and a final signal; deliver in every rotation
        // and in reverse, and check each flag is raised only when its data count is reached.
        let mut p = SrdPlanner::new(1, 2, 3, 100).unwrap();
        let ops = [
            Op::Put {
                seq: 0,
                src_offset: 0,
                dst_offset: 0,
                bytes: 250,
            },
            Op::Signal {
                seq: 0,
                flag_offset: 0,
                value: 1,
            },
            Op::Put {
                seq: 1,
                src_offset: 0,
                dst_offset: 256,
                bytes: 100,
            },
            Op::Signal {
                seq: 1,
                flag_offset: 8,
                value: 1,
            },
            Op::Signal {
                seq: 2,
                flag_offset: 16,
                value: 1,
            },
        ];
        let (wrs, _) = p.plan(0, &ops, LOCAL, DATA).unwrap();
        let n = wrs.len();
        let mut orders: Vec<Vec<usize>> = (0..n).map(|r| (0..n).map(|i| (i + r) % n).collect()).collect();
        orders.push((0..n).rev().collect());
        for order in orders {
            let mut t = RecvTracker::new(&[false, true], 24);
            let mut f = VecFlags(vec![0; 3]);
            let mut data_seen = 0;
            for &i in &order {
                match wrs[i] {
                    SrdWr::WriteImm { imm, .. } => {
                        data_seen += 1;
                        t.on_completion(Imm::decode(imm).unwrap(), &[], &mut f).unwrap();
                    }
                    SrdWr::SendImm { imm, record, .. } => t
                        .on_completion(Imm::decode(imm).unwrap(), &record.to_bytes(), &mut f)
                        .unwrap(),
                }
                // Flag 0 needs 3 data messages, flags 1 and 2 need 4.
                if f.0[0] == 1 {
                    assert!(data_seen >= 3, "{order:?}");
                }
                if f.0[1] == 1 || f.0[2] == 1 {
                    assert!(data_seen >= 4, "{order:?}");
                }
            }
            assert_eq!(f.0, [1, 1, 1], "{order:?}");
            assert_eq!(t.waiting(), 0);
        }
    }
}
