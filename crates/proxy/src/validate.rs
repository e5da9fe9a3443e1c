//! Checking every command against the registered regions and peers before anything is written.
//!
//! The proxy trusts nothing it reads from the FIFO: a command that fails any check becomes a
//! [`Violation`] (and an error record), never a write.
use crate::error::{ErrorCode, Violation};
use crate::protocol::{
    CommandBody, CMD_EPOCH_SEQ_MASK, CMD_EPOCH_SEQ_SHIFT, CMD_KNOWN_FLAGS, CMD_NO_FLAG, EPOCH_SEQS, FLAG_BYTES, OP_NOP,
    OP_PUT, OP_QUIT, OP_SIGNAL,
};
use crate::topology::{Route, Topology};

/// Registered sizes of one peer's memory, as that peer announced them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerRegions {
    /// Bytes of the peer's data region (the target of puts).
    pub data_bytes: u64,
    /// Bytes of the peer's flag array.
    pub flag_bytes: u64,
}

/// What the proxy may touch: its local data region and, per proxy peer, the peer's regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regions {
    rank: usize,
    local_data_bytes: u64,
    /// Indexed by rank; `None` for ranks that are not proxy peers.
    peers: Vec<Option<PeerRegions>>,
}

impl Regions {
    /// Every proxy peer of `topology` has the same sizes as this rank (symmetric allocation).
    pub fn symmetric(topology: &Topology, data_bytes: u64, flag_bytes: u64) -> Regions {
        let peers = (0..topology.world_size())
            .map(|r| {
                topology
                    .is_proxy_peer(r)
                    .then_some(PeerRegions { data_bytes, flag_bytes })
            })
            .collect();
        Regions {
            rank: topology.rank(),
            local_data_bytes: data_bytes,
            peers,
        }
    }

    /// Explicit sizes: `peers[r]` for every rank `r` of the world (`None` = not a proxy peer).
    /// Ranks that `topology` does not route through the proxy are forced to `None`.
    pub fn new(topology: &Topology, local_data_bytes: u64, mut peers: Vec<Option<PeerRegions>>) -> Regions {
        peers.resize(topology.world_size(), None);
        for (r, p) in peers.iter_mut().enumerate() {
            if topology.route(r) != Some(Route::Proxy) {
                *p = None;
            }
        }
        Regions {
            rank: topology.rank(),
            local_data_bytes,
            peers,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// World size.
    pub fn world_size(&self) -> usize {
        self.peers.len()
    }
    /// Bytes of the local data region.
    pub fn local_data_bytes(&self) -> u64 {
        self.local_data_bytes
    }
    /// The regions of proxy peer `rank`.
    pub fn peer(&self, rank: usize) -> Option<PeerRegions> {
        self.peers.get(rank).copied().flatten()
    }
}

/// A command that passed validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checked {
    /// Nothing to do.
    Nop,
    /// Stop the proxy after draining.
    Quit,
    /// Write data, then (if `flag` is set) the flag.
    Put {
        /// Receiver.
        dst: usize,
        /// Offset in the local data region.
        src_offset: u64,
        /// Offset in the receiver's data region.
        dst_offset: u64,
        /// Length.
        bytes: u64,
        /// `(flag_offset, flag_value)` to raise after the data.
        flag: Option<(u64, u64)>,
    },
    /// Raise a flag after earlier puts to `dst`.
    Signal {
        /// Receiver.
        dst: usize,
        /// Offset in the receiver's flag array.
        flag_offset: u64,
        /// Value to store.
        value: u64,
    },
}

/// Validates commands in FIFO order; remembers the last epoch of each epoch sequence
/// ([`CMD_EPOCH_SEQ_MASK`]) so it can refuse regressions.
#[derive(Clone, Debug)]
pub struct Validator {
    regions: Regions,
    last_epoch: [u32; EPOCH_SEQS],
}

fn range_ok(offset: u64, bytes: u64, limit: u64) -> bool {
    offset.checked_add(bytes).is_some_and(|end| end <= limit)
}

impl Validator {
    /// A validator over `regions`, starting at epoch 0.
    pub fn new(regions: Regions) -> Validator {
        Validator {
            regions,
            last_epoch: [0; EPOCH_SEQS],
        }
    }

    /// The regions checked against.
    pub fn regions(&self) -> &Regions {
        &self.regions
    }

    /// The largest epoch seen so far in sequence 0 (the collectives').
    pub fn last_epoch(&self) -> u32 {
        self.last_epoch[0]
    }

    /// The largest epoch seen so far in epoch sequence `seq`.
    pub fn last_epoch_of(&self, seq: usize) -> u32 {
        self.last_epoch[seq]
    }

    fn peer(&self, dst_rank: u32) -> Result<(usize, PeerRegions), Violation> {
        let dst = dst_rank as usize;
        if dst >= self.regions.world_size() {
            return Err(Violation::new(
                ErrorCode::RankOutOfRange,
                format!("dst_rank {dst_rank} >= world size {}", self.regions.world_size()),
            ));
        }
        match self.regions.peer(dst) {
            Some(p) => Ok((dst, p)),
            None if dst == self.regions.rank => Err(Violation::new(
                ErrorCode::NotRemotePeer,
                format!("dst_rank {dst_rank} is this rank"),
            )),
            None => Err(Violation::new(
                ErrorCode::NotRemotePeer,
                format!("dst_rank {dst_rank} is not a proxy peer (same node: use NVLink)"),
            )),
        }
    }

    fn flag(&self, dst_rank: u32, peer: PeerRegions, offset: u64, value: u64) -> Result<(), Violation> {
        if offset & (FLAG_BYTES - 1) != 0 || !range_ok(offset, FLAG_BYTES, peer.flag_bytes) {
            return Err(Violation::new(
                ErrorCode::BadFlagOffset,
                format!(
                    "flag_offset {offset} not 8-aligned or outside rank {dst_rank}'s {} flag bytes",
                    peer.flag_bytes
                ),
            ));
        }
        if value == 0 {
            return Err(Violation::new(
                ErrorCode::ZeroFlagValue,
                format!("flag_value 0 at flag_offset {offset}"),
            ));
        }
        Ok(())
    }

    /// Checks `c`; on success the epoch is remembered.
    pub fn check(&mut self, c: &CommandBody) -> Result<Checked, Violation> {
        if c.flags & !CMD_KNOWN_FLAGS != 0 {
            return Err(Violation::new(
                ErrorCode::BadFields,
                format!("unknown flag bits {:#x}", c.flags & !CMD_KNOWN_FLAGS),
            ));
        }
        if !matches!(c.opcode, OP_NOP | OP_PUT | OP_SIGNAL | OP_QUIT) {
            return Err(Violation::new(ErrorCode::BadOpcode, format!("opcode {}", c.opcode)));
        }
        let seq = ((c.flags & CMD_EPOCH_SEQ_MASK) >> CMD_EPOCH_SEQ_SHIFT) as usize;
        if seq >= EPOCH_SEQS {
            return Err(Violation::new(ErrorCode::BadFields, format!("epoch sequence {seq}")));
        }
        if c.epoch < self.last_epoch[seq] {
            return Err(Violation::new(
                ErrorCode::EpochRegressed,
                format!(
                    "epoch {} after epoch {} (sequence {seq})",
                    c.epoch, self.last_epoch[seq]
                ),
            ));
        }
        let checked = match c.opcode {
            OP_PUT => {
                let (dst, peer) = self.peer(c.dst_rank)?;
                if !range_ok(c.src_offset, c.bytes, self.regions.local_data_bytes) {
                    return Err(Violation::new(
                        ErrorCode::SrcOutOfRange,
                        format!(
                            "src_offset {} + bytes {} outside the local {} bytes",
                            c.src_offset, c.bytes, self.regions.local_data_bytes
                        ),
                    ));
                }
                if !range_ok(c.dst_offset, c.bytes, peer.data_bytes) {
                    return Err(Violation::new(
                        ErrorCode::DstOutOfRange,
                        format!(
                            "dst_offset {} + bytes {} outside rank {}'s {} bytes",
                            c.dst_offset, c.bytes, dst, peer.data_bytes
                        ),
                    ));
                }
                let flag = if c.flags & CMD_NO_FLAG != 0 {
                    if c.flag_offset != 0 || c.flag_value != 0 {
                        return Err(Violation::new(
                            ErrorCode::BadFields,
                            "PUT with CMD_NO_FLAG has a nonzero flag_offset or flag_value",
                        ));
                    }
                    None
                } else {
                    self.flag(c.dst_rank, peer, c.flag_offset, c.flag_value)?;
                    Some((c.flag_offset, c.flag_value))
                };
                Checked::Put {
                    dst,
                    src_offset: c.src_offset,
                    dst_offset: c.dst_offset,
                    bytes: c.bytes,
                    flag,
                }
            }
            OP_SIGNAL => {
                if c.flags & CMD_NO_FLAG != 0 || c.src_offset != 0 || c.dst_offset != 0 || c.bytes != 0 {
                    return Err(Violation::new(
                        ErrorCode::BadFields,
                        "SIGNAL with CMD_NO_FLAG or nonzero src_offset, dst_offset or bytes",
                    ));
                }
                let (dst, peer) = self.peer(c.dst_rank)?;
                self.flag(c.dst_rank, peer, c.flag_offset, c.flag_value)?;
                Checked::Signal {
                    dst,
                    flag_offset: c.flag_offset,
                    value: c.flag_value,
                }
            }
            _ => {
                let zero = CommandBody {
                    opcode: c.opcode,
                    epoch: c.epoch,
                    ..Default::default()
                };
                if *c != zero {
                    return Err(Violation::new(
                        ErrorCode::BadFields,
                        format!(
                            "{} with nonzero fields",
                            if c.opcode == OP_NOP { "NOP" } else { "QUIT" }
                        ),
                    ));
                }
                if c.opcode == OP_NOP {
                    Checked::Nop
                } else {
                    Checked::Quit
                }
            }
        };
        self.last_epoch[seq] = c.epoch;
        Ok(checked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validator() -> Validator {
        // 2 nodes x 2 GPUs, seen from rank 0: proxy peers 2 and 3.
        let t = Topology::new(2, 2, 0).unwrap();
        Validator::new(Regions::symmetric(&t, 1024, 64))
    }

    fn code(v: &mut Validator, c: CommandBody) -> ErrorCode {
        v.check(&c).unwrap_err().code
    }

    #[test]
    fn good_commands_pass() {
        let mut v = validator();
        assert_eq!(
            v.check(&CommandBody::put(2, 0, 1000, 24, 56, 1, 1)).unwrap(),
            Checked::Put {
                dst: 2,
                src_offset: 0,
                dst_offset: 1000,
                bytes: 24,
                flag: Some((56, 1))
            }
        );
        assert_eq!(
            v.check(&CommandBody::put_no_flag(3, 1024, 0, 0, 1)).unwrap(),
            Checked::Put {
                dst: 3,
                src_offset: 1024,
                dst_offset: 0,
                bytes: 0,
                flag: None
            }
        );
        assert_eq!(
            v.check(&CommandBody::signal(3, 0, 2, 2)).unwrap(),
            Checked::Signal {
                dst: 3,
                flag_offset: 0,
                value: 2
            }
        );
        assert_eq!(v.check(&CommandBody::nop(2)).unwrap(), Checked::Nop);
        assert_eq!(v.check(&CommandBody::quit(5)).unwrap(), Checked::Quit);
        assert_eq!(v.last_epoch(), 5);
    }

    #[test]
    fn each_bad_kind_has_its_code() {
        let mut v = validator();
        assert_eq!(
            code(
                &mut v,
                CommandBody {
                    opcode: 9,
                    ..CommandBody::nop(0)
                }
            ),
            ErrorCode::BadOpcode
        );
        assert_eq!(
            code(&mut v, CommandBody::put(4, 0, 0, 8, 0, 1, 0)),
            ErrorCode::RankOutOfRange
        );
        assert_eq!(
            code(&mut v, CommandBody::put(0, 0, 0, 8, 0, 1, 0)),
            ErrorCode::NotRemotePeer
        );
        assert_eq!(
            code(&mut v, CommandBody::put(1, 0, 0, 8, 0, 1, 0)),
            ErrorCode::NotRemotePeer
        );
        assert_eq!(
            code(&mut v, CommandBody::put(2, 1020, 0, 8, 0, 1, 0)),
            ErrorCode::SrcOutOfRange
        );
        assert_eq!(
            code(&mut v, CommandBody::put(2, u64::MAX, 0, 8, 0, 1, 0)),
            ErrorCode::SrcOutOfRange
        );
        assert_eq!(
            code(&mut v, CommandBody::put(2, 0, 1017, 8, 0, 1, 0)),
            ErrorCode::DstOutOfRange
        );
        assert_eq!(
            code(&mut v, CommandBody::put(2, 0, 8, u64::MAX - 4, 0, 1, 0)),
            ErrorCode::SrcOutOfRange
        );
        assert_eq!(
            code(&mut v, CommandBody::put(2, 0, 0, 8, 4, 1, 0)),
            ErrorCode::BadFlagOffset
        );
        assert_eq!(
            code(&mut v, CommandBody::put(2, 0, 0, 8, 64, 1, 0)),
            ErrorCode::BadFlagOffset
        );
        assert_eq!(
            code(&mut v, CommandBody::signal(2, u64::MAX - 7, 1, 0)),
            ErrorCode::BadFlagOffset
        );
        assert_eq!(code(&mut v, CommandBody::signal(2, 0, 0, 0)), ErrorCode::ZeroFlagValue);
        assert_eq!(
            code(
                &mut v,
                CommandBody {
                    flags: 1 << 3,
                    ..CommandBody::put(2, 0, 0, 8, 0, 1, 0)
                }
            ),
            ErrorCode::BadFields
        );
        assert_eq!(
            code(
                &mut v,
                CommandBody {
                    bytes: 8,
                    ..CommandBody::signal(2, 0, 1, 0)
                }
            ),
            ErrorCode::BadFields
        );
        assert_eq!(
            code(
                &mut v,
                CommandBody {
                    flag_value: 3,
                    ..CommandBody::put_no_flag(2, 0, 0, 8, 0)
                }
            ),
            ErrorCode::BadFields
        );
        assert_eq!(
            code(
                &mut v,
                CommandBody {
                    dst_rank: 2,
                    ..CommandBody::quit(0)
                }
            ),
            ErrorCode::BadFields
        );
        v.check(&CommandBody::nop(7)).unwrap();
        assert_eq!(code(&mut v, CommandBody::nop(6)), ErrorCode::EpochRegressed);
        assert_eq!(v.last_epoch(), 7, "a rejected command does not move the epoch");
    }

    #[test]
    fn explicit_regions_drop_non_proxy_ranks() {
        let t = Topology::new(2, 2, 0).unwrap();
        let p = Some(PeerRegions {
            data_bytes: 16,
            flag_bytes: 8,
        });
        let r = Regions::new(&t, 32, vec![p, p, p]);
        assert_eq!((r.peer(0), r.peer(1), r.peer(2), r.peer(3)), (None, None, p, None));
        assert_eq!(r.world_size(), 4);
    }

    #[test]
    fn epochs_only_need_to_increase_within_their_sequence() {
        let mut v = validator();
        let signal = |epoch: u32, seq: u32| CommandBody {
            opcode: OP_SIGNAL,
            dst_rank: 2,
            src_offset: 0,
            dst_offset: 0,
            bytes: 0,
            flag_offset: 8,
            flag_value: 1,
            epoch,
            flags: seq << CMD_EPOCH_SEQ_SHIFT,
        };
        assert!(v.check(&signal(40, 0)).is_ok(), "collectives at epoch 40");
        assert!(v.check(&signal(3, 1)).is_ok(), "fused kernels count their own launches");
        assert!(v.check(&signal(41, 0)).is_ok());
        assert!(v.check(&signal(4, 1)).is_ok());
        assert_eq!((v.last_epoch(), v.last_epoch_of(1)), (41, 4));
        assert_eq!(
            v.check(&signal(2, 1)).unwrap_err().code,
            ErrorCode::EpochRegressed,
            "a regression inside a sequence is refused"
        );
        assert_eq!(
            v.check(&signal(50, 3)).unwrap_err().code,
            ErrorCode::BadFields,
            "sequence 3 does not exist"
        );
    }
}
