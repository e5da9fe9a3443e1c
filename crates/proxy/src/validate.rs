//! Checking every command against the registered regions and peers before anything is written.
//!
//! The proxy trusts nothing it reads from the FIFO: a command that fails any check becomes a
//! [`Violation`] (and an error record), never a write. Besides bounds, the checks confine each
//! kind of write to its region of the receiver's heap (docs/protocol.md, "Heap layout"):
//!
//! * a PUT reads only the sender's data region and writes only the receiver's data region
//!   `[HEAP_RESERVED_BYTES, heap)`, never its control area (flags, epoch counters, error
//!   record, abort word), LL or staging areas ([`ErrorCode::SrcOutOfRange`],
//!   [`ErrorCode::DstOutOfRange`]);
//! * a flag (a SIGNAL's, or a PUT's) lands only in the receiver's inter-node flag region
//!   `[REMOTE_FLAGS_OFFSET, REMOTE_FLAGS_OFFSET + REMOTE_SLOTS * MAX_RANKS * 8)`
//!   ([`ErrorCode::BadFlagOffset`]), and only in the sender's own column of it: flag
//!   `(slot, src)` says "rank `src` did this", so rank `r` may raise `(slot, r)` alone
//!   ([`ErrorCode::FlagNotOwned`]);
//! * epochs never decrease within their sequence ([`ErrorCode::EpochRegressed`]; 64-bit, see
//!   `mkernel_config::fifo`).
use crate::error::{ErrorCode, Violation};
use crate::protocol::{
    epoch_seq_of, CommandBody, CMD_KNOWN_FLAGS, CMD_NO_FLAG, EPOCH_SEQS, FLAG_BYTES, OP_NOP, OP_PUT, OP_QUIT, OP_SIGNAL,
};
use crate::topology::{Route, Topology};
use mkernel_config::comm::{HEAP_RESERVED_BYTES, MAX_RANKS, REMOTE_FLAGS_OFFSET, REMOTE_SLOTS};

/// A half-open byte range `[start, end)` of a rank's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

impl Span {
    /// `[start, end)`.
    pub const fn new(start: u64, end: u64) -> Span {
        Span { start, end }
    }

    /// `[0, end)`.
    pub const fn upto(end: u64) -> Span {
        Span { start: 0, end }
    }

    /// Whether `[offset, offset + bytes)` lies inside (an empty range may sit at either end).
    pub fn contains(&self, offset: u64, bytes: u64) -> bool {
        offset >= self.start && offset.checked_add(bytes).is_some_and(|end| end <= self.end)
    }
}

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {})", self.start, self.end)
    }
}

/// Where the proxy may write in one peer's memory, as that peer announced it. The checks are
/// methods, so that a receiving side (a transport that applies other ranks' writes to this
/// rank's memory) can apply the same rules to what arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerRegions {
    /// The target of puts.
    pub data: Span,
    /// The flag words that flags may raise.
    pub flags: Span,
    /// `Some(n)`: the flag region is a matrix `[slot][source rank]` of `n` words per slot, and
    /// a sender may only raise the words of its own column.
    pub flag_columns: Option<u64>,
}

impl PeerRegions {
    /// mkernel's symmetric heap of `heap_bytes` bytes (layout in `mkernel_config::comm`): data
    /// `[HEAP_RESERVED_BYTES, heap_bytes)`, flags the inter-node flag region
    /// `[REMOTE_FLAGS_OFFSET, + REMOTE_SLOTS * MAX_RANKS * 8)`, one column per source rank.
    pub const fn heap(heap_bytes: u64) -> PeerRegions {
        let end = if heap_bytes > HEAP_RESERVED_BYTES {
            heap_bytes
        } else {
            HEAP_RESERVED_BYTES
        };
        PeerRegions {
            data: Span::new(HEAP_RESERVED_BYTES, end),
            flags: Span::new(
                REMOTE_FLAGS_OFFSET,
                REMOTE_FLAGS_OFFSET + REMOTE_SLOTS as u64 * MAX_RANKS as u64 * FLAG_BYTES,
            ),
            flag_columns: Some(MAX_RANKS as u64),
        }
    }

    /// Checks a write of `bytes` at `offset` into this (rank `owner`'s) data region.
    pub fn check_put(&self, owner: usize, offset: u64, bytes: u64) -> Result<(), Violation> {
        if self.data.contains(offset, bytes) {
            return Ok(());
        }
        Err(Violation::new(
            ErrorCode::DstOutOfRange,
            format!(
                "dst_offset {offset} + bytes {bytes} outside rank {owner}'s data region {}",
                self.data
            ),
        ))
    }

    /// Checks that `sender` may raise the flag word at `offset` of rank `owner` to `value`.
    pub fn check_flag(&self, owner: usize, sender: usize, offset: u64, value: u64) -> Result<(), Violation> {
        let flags = self.flags;
        if offset & (FLAG_BYTES - 1) != 0 || !flags.contains(offset, FLAG_BYTES) {
            return Err(Violation::new(
                ErrorCode::BadFlagOffset,
                format!("flag_offset {offset} not 8-aligned or outside rank {owner}'s flag region {flags}"),
            ));
        }
        if let Some(n) = self.flag_columns.filter(|&n| n > 0) {
            let column = (offset - flags.start) / FLAG_BYTES % n;
            if column != sender as u64 {
                return Err(Violation::new(
                    ErrorCode::FlagNotOwned,
                    format!(
                        "flag_offset {offset} is rank {column}'s flag at rank {owner}; rank {sender} may only raise its own"
                    ),
                ));
            }
        }
        if value == 0 {
            return Err(Violation::new(
                ErrorCode::ZeroFlagValue,
                format!("flag_value 0 at flag_offset {offset}"),
            ));
        }
        Ok(())
    }
}

/// What the proxy may touch: its local data region and, per proxy peer, the peer's regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regions {
    rank: usize,
    local_data: Span,
    /// Indexed by rank; `None` for ranks that are not proxy peers.
    peers: Vec<Option<PeerRegions>>,
}

impl Regions {
    /// The symmetric heap of mkernel's communicator: every rank's heap has `heap_bytes` bytes
    /// laid out as in `mkernel_config::comm`; puts read and write `[HEAP_RESERVED_BYTES,
    /// heap_bytes)`, flags go to this rank's column of the inter-node flag region.
    pub fn heap(topology: &Topology, heap_bytes: u64) -> Regions {
        let peer = PeerRegions::heap(heap_bytes);
        Regions::with_spans(topology, peer.data, peer)
    }

    /// Every proxy peer of `topology` has the same sizes as this rank (symmetric allocation):
    /// data `[0, data_bytes)`, flags `[0, flag_bytes)` (separate arrays, as in the CPU fabric
    /// of the tests), any flag word writable.
    pub fn symmetric(topology: &Topology, data_bytes: u64, flag_bytes: u64) -> Regions {
        Regions::with_spans(
            topology,
            Span::upto(data_bytes),
            PeerRegions {
                data: Span::upto(data_bytes),
                flags: Span::upto(flag_bytes),
                flag_columns: None,
            },
        )
    }

    /// The same `peer` regions for every proxy peer of `topology`, `local_data` for this rank.
    pub fn with_spans(topology: &Topology, local_data: Span, peer: PeerRegions) -> Regions {
        Regions::new(topology, local_data, vec![Some(peer); topology.world_size()])
    }

    /// Explicit regions: `peers[r]` for every rank `r` of the world (`None` = not a proxy peer).
    /// Ranks that `topology` does not route through the proxy are forced to `None`.
    pub fn new(topology: &Topology, local_data: Span, mut peers: Vec<Option<PeerRegions>>) -> Regions {
        peers.resize(topology.world_size(), None);
        for (r, p) in peers.iter_mut().enumerate() {
            if topology.route(r) != Some(Route::Proxy) {
                *p = None;
            }
        }
        Regions {
            rank: topology.rank(),
            local_data,
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
    /// The local data region (the sources of puts).
    pub fn local_data(&self) -> Span {
        self.local_data
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
        /// Offset of the flag word.
        flag_offset: u64,
        /// Value to store.
        value: u64,
    },
}

/// Validates commands in FIFO order; remembers the last epoch of each epoch sequence
/// (`CMD_EPOCH_SEQ_MASK`) so it can refuse regressions.
#[derive(Clone, Debug)]
pub struct Validator {
    regions: Regions,
    last_epoch: [u64; EPOCH_SEQS],
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
    pub fn last_epoch(&self) -> u64 {
        self.last_epoch[0]
    }

    /// The largest epoch seen so far in epoch sequence `seq` (`None` past the last sequence).
    pub fn last_epoch_of(&self, seq: usize) -> Option<u64> {
        self.last_epoch.get(seq).copied()
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

    fn flag(&self, dst: usize, peer: PeerRegions, offset: u64, value: u64) -> Result<(), Violation> {
        peer.check_flag(dst, self.regions.rank, offset, value)
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
        let seq = epoch_seq_of(c.flags) as usize;
        let Some(&last) = self.last_epoch.get(seq) else {
            return Err(Violation::new(ErrorCode::BadFields, format!("epoch sequence {seq}")));
        };
        // Plain integer order: epochs are the device's 64-bit launch counters, which do not
        // wrap (see `mkernel_config::fifo`, "Epochs are 64-bit").
        if c.epoch < last {
            return Err(Violation::new(
                ErrorCode::EpochRegressed,
                format!("epoch {} after epoch {last} (sequence {seq})", c.epoch),
            ));
        }
        let checked = match c.opcode {
            OP_PUT => {
                let (dst, peer) = self.peer(c.dst_rank)?;
                let local = self.regions.local_data;
                if !local.contains(c.src_offset, c.bytes) {
                    return Err(Violation::new(
                        ErrorCode::SrcOutOfRange,
                        format!(
                            "src_offset {} + bytes {} outside the local data region {local}",
                            c.src_offset, c.bytes
                        ),
                    ));
                }
                peer.check_put(dst, c.dst_offset, c.bytes)?;
                let flag = if c.flags & CMD_NO_FLAG != 0 {
                    if c.flag_offset != 0 || c.flag_value != 0 {
                        return Err(Violation::new(
                            ErrorCode::BadFields,
                            "PUT with CMD_NO_FLAG has a nonzero flag_offset or flag_value",
                        ));
                    }
                    None
                } else {
                    self.flag(dst, peer, c.flag_offset, c.flag_value)?;
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
                self.flag(dst, peer, c.flag_offset, c.flag_value)?;
                Checked::Signal {
                    dst,
                    flag_offset: c.flag_offset,
                    value: c.flag_value,
                }
            }
            _ => {
                let zero = CommandBody {
                    opcode: c.opcode,
                    flags: c.flags,
                    epoch: c.epoch,
                    ..Default::default()
                };
                if *c != zero || c.flags & CMD_NO_FLAG != 0 {
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
        // In order: the validator keeps state (the epoch) across commands.
        for (body, want) in [
            (
                CommandBody {
                    opcode: 9,
                    ..CommandBody::nop(0)
                },
                ErrorCode::BadOpcode,
            ),
            (CommandBody::put(4, 0, 0, 8, 0, 1, 0), ErrorCode::RankOutOfRange),
            (CommandBody::put(0, 0, 0, 8, 0, 1, 0), ErrorCode::NotRemotePeer),
            (CommandBody::put(1, 0, 0, 8, 0, 1, 0), ErrorCode::NotRemotePeer),
            (CommandBody::put(2, 1020, 0, 8, 0, 1, 0), ErrorCode::SrcOutOfRange),
            (CommandBody::put(2, u64::MAX, 0, 8, 0, 1, 0), ErrorCode::SrcOutOfRange),
            (CommandBody::put(2, 0, 1017, 8, 0, 1, 0), ErrorCode::DstOutOfRange),
            (
                CommandBody::put(2, 0, 8, u64::MAX - 4, 0, 1, 0),
                ErrorCode::SrcOutOfRange,
            ),
            (CommandBody::put(2, 0, 0, 8, 4, 1, 0), ErrorCode::BadFlagOffset),
            (CommandBody::put(2, 0, 0, 8, 64, 1, 0), ErrorCode::BadFlagOffset),
            (CommandBody::signal(2, u64::MAX - 7, 1, 0), ErrorCode::BadFlagOffset),
            (CommandBody::signal(2, 0, 0, 0), ErrorCode::ZeroFlagValue),
            (
                CommandBody {
                    flags: 1 << 3,
                    ..CommandBody::put(2, 0, 0, 8, 0, 1, 0)
                },
                ErrorCode::BadFields,
            ),
            (
                CommandBody {
                    bytes: 8,
                    ..CommandBody::signal(2, 0, 1, 0)
                },
                ErrorCode::BadFields,
            ),
            (
                CommandBody {
                    flag_value: 3,
                    ..CommandBody::put_no_flag(2, 0, 0, 8, 0)
                },
                ErrorCode::BadFields,
            ),
            (
                CommandBody {
                    dst_rank: 2,
                    ..CommandBody::quit(0)
                },
                ErrorCode::BadFields,
            ),
        ] {
            assert_eq!(code(&mut v, body), want, "{body:?}");
        }
        v.check(&CommandBody::nop(7)).unwrap();
        assert_eq!(code(&mut v, CommandBody::nop(6)), ErrorCode::EpochRegressed);
        assert_eq!(v.last_epoch(), 7, "a rejected command does not move the epoch");
    }

    #[test]
    fn explicit_regions_drop_non_proxy_ranks() {
        let t = Topology::new(2, 2, 0).unwrap();
        let p = Some(PeerRegions {
            data: Span::upto(16),
            flags: Span::upto(8),
            flag_columns: None,
        });
        let r = Regions::new(&t, Span::upto(32), vec![p, p, p]);
        assert_eq!((r.peer(0), r.peer(1), r.peer(2), r.peer(3)), (None, None, p, None));
        assert_eq!(r.world_size(), 4);
    }

    #[test]
    fn epochs_only_need_to_increase_within_their_sequence() {
        let mut v = validator();
        let signal = |epoch: u64, seq: u32| CommandBody::signal(2, 8, 1, epoch).in_sequence(seq);
        assert!(v.check(&signal(40, 0)).is_ok(), "collectives at epoch 40");
        assert!(v.check(&signal(3, 1)).is_ok(), "fused kernels count their own launches");
        assert!(v.check(&signal(41, 0)).is_ok());
        assert!(v.check(&signal(4, 1)).is_ok());
        assert_eq!((v.last_epoch(), v.last_epoch_of(1)), (41, Some(4)));
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

    /// 2 nodes x 2 GPUs on mkernel's heap layout, seen from rank 1: proxy peers 2 and 3.
    fn heap_validator() -> Validator {
        let t = Topology::new(2, 2, 1).unwrap();
        Validator::new(Regions::heap(&t, HEAP_RESERVED_BYTES + (1 << 20)))
    }

    const DATA: u64 = HEAP_RESERVED_BYTES;
    /// Rank 1's own `Data` flag at the receiver.
    fn own_flag() -> u64 {
        mkernel_config::comm::remote_flag_offset(mkernel_config::comm::RemoteSlot::Data, 1)
    }

    #[test]
    fn heap_commands_of_the_kernels_pass() {
        use mkernel_config::comm::{remote_flag_offset, RemoteSlot};
        let mut v = heap_validator();
        for slot in [RemoteSlot::Ready, RemoteSlot::Probe, RemoteSlot::FusedOut] {
            v.check(&CommandBody::signal(2, remote_flag_offset(slot, 1), 1, 1))
                .unwrap();
        }
        v.check(&CommandBody::put(3, DATA, DATA + 4096, 4096, own_flag(), 1, 1))
            .unwrap();
        // The last byte of the heap.
        v.check(&CommandBody::put(3, DATA, DATA + (1 << 20) - 1, 1, own_flag(), 1, 1))
            .unwrap();
    }

    #[test]
    fn a_put_into_the_control_area_is_refused() {
        use mkernel_config::comm::{ABORT_OFFSET, ERROR_RECORD_OFFSET, LL_OFFSET, STAGING_OFFSET};
        let mut v = heap_validator();
        for dst in [
            0,
            ERROR_RECORD_OFFSET,
            ABORT_OFFSET,
            REMOTE_FLAGS_OFFSET,
            LL_OFFSET,
            STAGING_OFFSET,
        ] {
            let e = v
                .check(&CommandBody::put(2, DATA, dst, 8, own_flag(), 1, 1))
                .unwrap_err();
            assert_eq!(e.code, ErrorCode::DstOutOfRange, "dst_offset {dst}: {e}");
            assert!(e.reason.contains("data region"), "{e}");
        }
        // Straddling the start of the data region, or running past the heap.
        let e = v.check(&CommandBody::put(2, DATA, DATA - 8, 16, own_flag(), 1, 1));
        assert_eq!(e.unwrap_err().code, ErrorCode::DstOutOfRange);
        let e = v.check(&CommandBody::put(2, DATA, DATA + (1 << 20) - 8, 16, own_flag(), 1, 1));
        assert_eq!(e.unwrap_err().code, ErrorCode::DstOutOfRange);
        // Nor may a PUT read the sender's own control area.
        let e = v.check(&CommandBody::put(2, ERROR_RECORD_OFFSET, DATA, 8, own_flag(), 1, 1));
        assert_eq!(e.unwrap_err().code, ErrorCode::SrcOutOfRange);
    }

    #[test]
    fn a_signal_outside_the_remote_flags_is_refused() {
        use mkernel_config::comm::{
            flag_offset, FlagSlot, ABORT_OFFSET, EPOCH_COUNTERS_OFFSET, ERROR_RECORD_OFFSET, FIFO_HEAD_OFFSET,
            FUSED_EPOCH_OFFSET,
        };
        let mut v = heap_validator();
        for (what, off) in [
            ("the error record", ERROR_RECORD_OFFSET),
            ("the abort word", ABORT_OFFSET),
            ("the epoch counters", EPOCH_COUNTERS_OFFSET),
            ("the last epoch counter", ERROR_RECORD_OFFSET - 8),
            ("an NVLink flag", flag_offset(FlagSlot::Ready, 1, 0)),
            ("the FIFO head", FIFO_HEAD_OFFSET),
            ("the fused epoch", FUSED_EPOCH_OFFSET),
            ("the data region", DATA),
        ] {
            let e = v.check(&CommandBody::signal(2, off, 1, 1)).unwrap_err();
            assert_eq!(e.code, ErrorCode::BadFlagOffset, "{what} ({off}): {e}");
            // A PUT's flag obeys the same rule.
            let e = v.check(&CommandBody::put(2, DATA, DATA, 8, off, 1, 1)).unwrap_err();
            assert_eq!(e.code, ErrorCode::BadFlagOffset, "PUT flag into {what}: {e}");
        }
    }

    #[test]
    fn a_flag_of_another_sender_is_refused() {
        use mkernel_config::comm::{remote_flag_offset, RemoteSlot};
        let mut v = heap_validator();
        // Rank 1 may not raise rank 0's (or 2's) Ready flag at rank 2: that would speak for them.
        for src in [0, 2, MAX_RANKS - 1] {
            let e = v
                .check(&CommandBody::signal(
                    2,
                    remote_flag_offset(RemoteSlot::Ready, src),
                    1,
                    1,
                ))
                .unwrap_err();
            assert_eq!(e.code, ErrorCode::FlagNotOwned, "{e}");
        }
        let e = v.check(&CommandBody::put(
            2,
            DATA,
            DATA,
            8,
            remote_flag_offset(RemoteSlot::Data, 3),
            1,
            1,
        ));
        assert_eq!(e.unwrap_err().code, ErrorCode::FlagNotOwned);
    }

    #[test]
    fn epochs_cross_the_32_bit_wrap() {
        let mut v = heap_validator();
        let sig = |epoch: u64| CommandBody::signal(2, own_flag(), epoch, epoch);
        let wrap = 1u64 << 32;
        for e in [wrap - 2, wrap - 1, wrap, wrap, wrap + 1, 5 * wrap + 7] {
            v.check(&sig(e)).unwrap_or_else(|x| panic!("epoch {e}: {x}"));
        }
        assert_eq!(v.last_epoch(), 5 * wrap + 7);
        // A real regression is still one, however large: the low 32 bits alone would look newer.
        let e = v.check(&sig(4 * wrap + 8)).unwrap_err();
        assert_eq!(e.code, ErrorCode::EpochRegressed, "{e}");
        let e = v.check(&sig(7)).unwrap_err();
        assert_eq!(e.code, ErrorCode::EpochRegressed, "{e}");
        // Each sequence on its own, also past 2^32.
        v.check(&sig(1).in_sequence(crate::protocol::EPOCH_SEQ_PROBES)).unwrap();
        v.check(&sig(wrap << 12 | 1).in_sequence(crate::protocol::EPOCH_SEQ_PROBES))
            .unwrap();
        assert_eq!(v.last_epoch_of(2), Some(wrap << 12 | 1));
    }

    #[test]
    fn a_receiver_applies_the_same_rules() {
        use mkernel_config::comm::{remote_flag_offset, RemoteSlot, ABORT_OFFSET};
        let me = PeerRegions::heap(HEAP_RESERVED_BYTES + 4096);
        assert!(me.check_put(0, HEAP_RESERVED_BYTES, 4096).is_ok());
        assert_eq!(me.check_put(0, 0, 8).unwrap_err().code, ErrorCode::DstOutOfRange);
        let from_3 = remote_flag_offset(RemoteSlot::Data, 3);
        assert!(me.check_flag(0, 3, from_3, 9).is_ok());
        assert_eq!(
            me.check_flag(0, 2, from_3, 9).unwrap_err().code,
            ErrorCode::FlagNotOwned
        );
        assert_eq!(
            me.check_flag(0, 3, ABORT_OFFSET, 9).unwrap_err().code,
            ErrorCode::BadFlagOffset
        );
        assert_eq!(
            me.check_flag(0, 3, from_3, 0).unwrap_err().code,
            ErrorCode::ZeroFlagValue
        );
    }
}
