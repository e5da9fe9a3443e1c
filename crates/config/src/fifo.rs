//! The proxy command FIFO between a GPU (producer) and its CPU proxy (consumer): the wire
//! format, defined once. The device producer (`crates/device/src/comm/proxy.rs`) writes slots
//! at the offsets below; the proxy (`crates/proxy`, `protocol.rs` re-exports this module)
//! reads them through the same `#[repr(C)]` types. The compile-time assertions at the bottom
//! pin every offset.
//!
//! # Memory
//!
//! One contiguous buffer of [`fifo_bytes`]`(capacity)` bytes in host-mapped pinned memory
//! (`cuMemHostAlloc(DEVICEMAP | PORTABLE)`), 64-byte aligned:
//!
//! ```text
//! offset 0                     FifoHeader (320 bytes, five 64-byte lines)
//! offset FIFO_HEADER_BYTES     slot[0] .. slot[capacity - 1], 64 bytes each (Command)
//! ```
//!
//! `FifoHeader`:
//!
//! | offset | field            | type      | written by | when / how                                      |
//! |-------:|------------------|-----------|------------|-------------------------------------------------|
//! | 0      | `head`           | u64       | GPU        | claim counter: `seq = atom.add(head, 1)`        |
//! | 64     | `tail`           | u64       | proxy      | release store after consuming slot `tail`       |
//! | 72     | `done`           | u64       | proxy      | release store: commands `< done` completed locally |
//! | 128    | `magic`          | u32       | host, init | [`FIFO_MAGIC`]                                  |
//! | 132    | `version`        | u32       | host, init | [`PROTOCOL_VERSION`]                            |
//! | 136    | `capacity`       | u32       | host, init | slots, a power of two                           |
//! | 140    | `rank`           | u32       | host, init | global rank owning this FIFO                    |
//! | 144    | `abort`          | u32       | proxy/host | 0 = running, else an error code (release)       |
//! | 148    | `error_claim`    | u32       | proxy/host | host-internal lock of the error record          |
//! | 192    | `error.code`     | u32       | proxy      | before `abort`                                  |
//! | 196    | `error.rank`     | u32       | proxy      | before `abort`                                  |
//! | 200    | `error.seq`      | u64       | proxy      | before `abort` ([`NO_SEQ`] if none)             |
//! | 208    | `error.msg_len`  | u32       | proxy      | before `abort`                                  |
//! | 216    | `error.msg`      | [u8; 104] | proxy      | before `abort`, UTF-8, not NUL-terminated       |
//!
//! `Command` (one slot, 64 bytes, 64-byte aligned):
//!
//! | offset | field         | type | meaning                                                        |
//! |-------:|---------------|------|----------------------------------------------------------------|
//! | 0      | `header`      | u64  | `seq + 1` once committed, 0 when free; written LAST by the GPU |
//! | 8      | `opcode`      | u16  | [`OP_NOP`], [`OP_PUT`], [`OP_SIGNAL`], [`OP_QUIT`]             |
//! | 10     | `flags`       | u16  | [`CMD_NO_FLAG`], epoch sequence (bits 1-2); others must be 0   |
//! | 12     | `dst_rank`    | u32  | global rank of the receiver (must be a proxy peer)             |
//! | 16     | `src_offset`  | u64  | byte offset into the sender's heap (its data region)           |
//! | 24     | `dst_offset`  | u64  | byte offset into the receiver's heap (its data region)         |
//! | 32     | `bytes`       | u64  | length of the put (0 allowed)                                  |
//! | 40     | `flag_offset` | u64  | byte offset of the flag word in the receiver's heap, 8-aligned |
//! | 48     | `flag_value`  | u64  | value stored into the flag (an epoch tag), nonzero             |
//! | 56     | `epoch`       | u64  | launch epoch; never decreases within its epoch sequence        |
//!
//! # Epochs are 64-bit
//!
//! The proxy refuses a command whose epoch is below the last one of its sequence
//! (`EpochRegressed`). Version 1 of this layout carried the low 32 bits of the device's
//! 64-bit launch counter, so the 2^32-th launch of a sequence (reached after 2^20 launches of
//! the latency probe, whose flag values are `epoch << 12 | i`, and after 2^32 collectives)
//! looked like a regression and aborted the proxy. Version 2 carries the whole counter, the
//! same `u64` that the device compares flags against, and the proxy compares epochs as plain
//! integers. We chose this over serial-number arithmetic (RFC 1982) on 32 bits because that
//! order is only defined for two values less than 2^31 apart: a sequence that launches 2^31
//! times without posting (e.g. collectives that stayed on NVLink) would be refused as a
//! regression, and a real regression by 2^31 or more would pass. A 64-bit counter advanced
//! once per launch does not wrap (2^64 launches at one per microsecond take 584,000 years).
//! The room came from `opcode` and `flags`, which were `u32` and now are `u16` each (four
//! opcodes, three flag bits in use).
//!
//! # Ordering (who writes which word, with which ordering)
//!
//! Producer (a GPU thread), for one command:
//! 1. `seq = atom.add(head, 1)` — any ordering; `head` may instead live in device memory, the
//!    proxy never relies on it (it only reads it for diagnostics).
//! 2. Backpressure: spin until `seq - ld.acquire.sys(tail) < capacity`; while spinning, give up
//!    if `abort != 0`.
//! 3. Write the body (offsets 8..64) of `slot[seq % capacity]` with ordinary stores.
//! 4. `st.release.sys.u64 slot.header = seq + 1` — the commit. The release at system scope makes
//!    the body visible to the CPU before the header.
//!
//! Consumer (the proxy thread), for `seq = tail`:
//! 1. Poll `slot[seq % capacity].header` with an acquire load until it equals `seq + 1`. Any other
//!    nonzero value is a protocol violation (the producer overran the ring) and aborts.
//! 2. Copy the body out, validate it, hand it to the transport.
//! 3. Store 0 into the header (so a stale command is never taken for a new one after the ring
//!    wraps), then `tail = seq + 1` with a release store (several slots may be released by one
//!    tail store). Only after that may the producer write the slot again.
//! 4. When the transport reports that every operation of commands `< n` completed locally (the
//!    source bytes were read), store `done = n` with release: the GPU may then overwrite the
//!    source bytes of those commands.
//!
//! On error the proxy writes `error.*` first and then `abort` (release); a reader that sees
//! `abort != 0` with an acquire load sees the whole record. Device-side waits (backpressure,
//! flag waits) poll `abort` and stop when it is nonzero.
//!
//! # Flags
//!
//! * A PUT without [`CMD_NO_FLAG`] stores `flag_value` into the receiver's word at
//!   `flag_offset` once the data of this PUT is visible in the receiver's memory.
//! * A SIGNAL stores its flag once the data of every earlier PUT of this FIFO to the same
//!   receiver is visible. It moves no data.
//!
//! Flag values are epoch tags: they only grow, so flags need no reset between launches and a
//! waiter tests `flag >= expected` with an acquire load at system scope. Flags start at 0, so
//! a flag value of 0 is refused. Which words of the heap a PUT may write and which a flag may
//! raise is the proxy's business (`crates/proxy/src/validate.rs`, docs/protocol.md).
use core::mem::{align_of, offset_of, size_of};

/// `FifoHeader::magic`: ASCII "MKPF" little-endian.
pub const FIFO_MAGIC: u32 = u32::from_le_bytes(*b"MKPF");
/// Version of this layout; bumped on any change the device must follow (2: 64-bit epochs,
/// 16-bit opcode and flags).
pub const PROTOCOL_VERSION: u32 = 2;
/// Bytes of one command slot.
pub const SLOT_BYTES: usize = 64;
/// Bytes of the FIFO header; the slots start at this offset.
pub const FIFO_HEADER_BYTES: usize = 320;
/// Smallest allowed capacity (slots).
pub const MIN_CAPACITY: u32 = 2;
/// Largest allowed capacity (slots): 1 Mi slots = 64 MiB.
pub const MAX_CAPACITY: u32 = 1 << 20;
/// Bytes of one flag word.
pub const FLAG_BYTES: u64 = 8;
/// Capacity of the error message in [`ErrorRecord::msg`].
pub const ERROR_MSG_BYTES: usize = 104;
/// [`ErrorRecord::seq`] when the error is not tied to a slot.
pub const NO_SEQ: u64 = u64::MAX;

/// Opcode: consumed and ignored (the producer may use it to fill a claimed slot it no longer needs).
pub const OP_NOP: u16 = 0;
/// Opcode: write `bytes` from the local heap at `src_offset` to `dst_rank`'s heap at
/// `dst_offset`, then store `flag_value` into `dst_rank`'s flag word at `flag_offset` (unless
/// [`CMD_NO_FLAG`]).
pub const OP_PUT: u16 = 1;
/// Opcode: store `flag_value` into `dst_rank`'s flag word at `flag_offset`, ordered after every
/// earlier PUT of this FIFO to `dst_rank`. `src_offset`, `dst_offset` and `bytes` must be 0.
pub const OP_SIGNAL: u16 = 2;
/// Opcode: the proxy drains what it has, stops, and `join()` returns `Ok`. Other fields must be 0.
pub const OP_QUIT: u16 = 3;

/// Command flag: a PUT that raises no flag (`flag_offset` and `flag_value` must then be 0);
/// follow such puts with a SIGNAL.
pub const CMD_NO_FLAG: u16 = 1;
/// Command flag bits 1-2: which epoch sequence `epoch` belongs to. Kernels of different kinds
/// count launches separately (collectives, fused kernels, latency probes), so epochs only
/// increase within a sequence; the proxy checks each sequence on its own.
pub const CMD_EPOCH_SEQ_SHIFT: u32 = 1;
/// Mask of the epoch-sequence bits.
pub const CMD_EPOCH_SEQ_MASK: u16 = 0b11 << CMD_EPOCH_SEQ_SHIFT;
/// Every defined command flag bit.
pub const CMD_KNOWN_FLAGS: u16 = CMD_NO_FLAG | CMD_EPOCH_SEQ_MASK;
/// Epoch sequence of the collectives (CTA 0's epoch counter).
pub const EPOCH_SEQ_COLLECTIVES: u32 = 0;
/// Epoch sequence of the fused kernels' launch epoch.
pub const EPOCH_SEQ_FUSED: u32 = 1;
/// Epoch sequence of the latency probes' counter.
pub const EPOCH_SEQ_PROBES: u32 = 2;
/// Number of epoch sequences.
pub const EPOCH_SEQS: usize = 3;

/// The `flags` word of a command of epoch sequence `seq` (`EPOCH_SEQ_*`), plus `extra` bits.
pub const fn cmd_flags(seq: u32, extra: u16) -> u16 {
    (((seq << CMD_EPOCH_SEQ_SHIFT) as u16) & CMD_EPOCH_SEQ_MASK) | extra
}

/// The epoch sequence of a `flags` word.
pub const fn epoch_seq_of(flags: u16) -> u32 {
    ((flags & CMD_EPOCH_SEQ_MASK) >> CMD_EPOCH_SEQ_SHIFT) as u32
}

/// Bytes of a FIFO with `capacity` slots (header plus slots).
pub const fn fifo_bytes(capacity: u32) -> usize {
    FIFO_HEADER_BYTES + capacity as usize * SLOT_BYTES
}

/// The body of a command: everything after the commit word. Written by the producer before the
/// header; read by the proxy after it has seen the header with an acquire load.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommandBody {
    /// One of `OP_*`.
    pub opcode: u16,
    /// `CMD_*` bits.
    pub flags: u16,
    /// Global rank of the receiver.
    pub dst_rank: u32,
    /// Byte offset into the sender's heap.
    pub src_offset: u64,
    /// Byte offset into the receiver's heap.
    pub dst_offset: u64,
    /// Bytes to write.
    pub bytes: u64,
    /// Byte offset of the flag word in the receiver's heap (multiple of 8).
    pub flag_offset: u64,
    /// Value stored into the flag (nonzero epoch tag).
    pub flag_value: u64,
    /// Launch epoch; nondecreasing within its epoch sequence along one FIFO.
    pub epoch: u64,
}

impl CommandBody {
    /// A PUT of `bytes` from `src_offset` to `dst_rank`'s `dst_offset`, raising the flag.
    pub const fn put(
        dst_rank: u32,
        src_offset: u64,
        dst_offset: u64,
        bytes: u64,
        flag_offset: u64,
        flag_value: u64,
        epoch: u64,
    ) -> Self {
        CommandBody {
            opcode: OP_PUT,
            flags: 0,
            dst_rank,
            src_offset,
            dst_offset,
            bytes,
            flag_offset,
            flag_value,
            epoch,
        }
    }
    /// A PUT that raises no flag.
    pub const fn put_no_flag(dst_rank: u32, src_offset: u64, dst_offset: u64, bytes: u64, epoch: u64) -> Self {
        CommandBody {
            opcode: OP_PUT,
            flags: CMD_NO_FLAG,
            dst_rank,
            src_offset,
            dst_offset,
            bytes,
            flag_offset: 0,
            flag_value: 0,
            epoch,
        }
    }
    /// A SIGNAL: the flag only, after earlier puts to `dst_rank`.
    pub const fn signal(dst_rank: u32, flag_offset: u64, flag_value: u64, epoch: u64) -> Self {
        CommandBody {
            opcode: OP_SIGNAL,
            flags: 0,
            dst_rank,
            src_offset: 0,
            dst_offset: 0,
            bytes: 0,
            flag_offset,
            flag_value,
            epoch,
        }
    }
    /// A NOP.
    pub const fn nop(epoch: u64) -> Self {
        Self::bare(OP_NOP, epoch)
    }
    /// A QUIT.
    pub const fn quit(epoch: u64) -> Self {
        Self::bare(OP_QUIT, epoch)
    }
    const fn bare(opcode: u16, epoch: u64) -> Self {
        CommandBody {
            opcode,
            flags: 0,
            dst_rank: 0,
            src_offset: 0,
            dst_offset: 0,
            bytes: 0,
            flag_offset: 0,
            flag_value: 0,
            epoch,
        }
    }
    /// The same command in epoch sequence `seq` (`EPOCH_SEQ_*`).
    pub const fn in_sequence(mut self, seq: u32) -> Self {
        self.flags = (self.flags & !CMD_EPOCH_SEQ_MASK) | cmd_flags(seq, 0);
        self
    }
}

/// One FIFO slot.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Command {
    /// `seq + 1` when committed, 0 when free. Written last by the producer (release, system
    /// scope); cleared to 0 by the proxy before it advances `tail`.
    pub header: u64,
    /// The command proper.
    pub body: CommandBody,
}

/// Why the proxy stopped, as written by the proxy into the FIFO header before it raises `abort`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorRecord {
    /// An error code of the proxy (`mkernel_proxy::ErrorCode`; never 0 once written).
    pub code: u32,
    /// Rank of the proxy that found the error.
    pub rank: u32,
    /// Slot sequence number of the offending command, or [`NO_SEQ`].
    pub seq: u64,
    /// Valid bytes in `msg`.
    pub msg_len: u32,
    /// Zero.
    pub reserved: u32,
    /// Human-readable reason, UTF-8, truncated to [`ERROR_MSG_BYTES`].
    pub msg: [u8; ERROR_MSG_BYTES],
}

impl Default for ErrorRecord {
    fn default() -> Self {
        ErrorRecord {
            code: 0,
            rank: 0,
            seq: 0,
            msg_len: 0,
            reserved: 0,
            msg: [0; ERROR_MSG_BYTES],
        }
    }
}

impl ErrorRecord {
    /// The valid bytes of the message.
    pub fn message_bytes(&self) -> &[u8] {
        let n = (self.msg_len as usize).min(ERROR_MSG_BYTES);
        &self.msg[..n]
    }

    /// The message as text: its longest valid UTF-8 prefix (the proxy writes UTF-8 cut at a
    /// character boundary, so normally all of it).
    pub fn message(&self) -> &str {
        let b = self.message_bytes();
        match core::str::from_utf8(b) {
            Ok(s) => s,
            // The prefix up to the first invalid byte is valid UTF-8.
            Err(e) => core::str::from_utf8(&b[..e.valid_up_to()]).unwrap_or(""),
        }
    }
}

/// The FIFO header (see the module documentation for who writes which field).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FifoHeader {
    /// GPU-owned claim counter (line 0).
    pub head: u64,
    /// Padding to the next 64-byte line.
    pub pad0: [u64; 7],
    /// Proxy-owned: next sequence number to consume (line 1).
    pub tail: u64,
    /// Proxy-owned: commands `< done` completed locally (their source bytes were read).
    pub done: u64,
    /// Padding to the next 64-byte line.
    pub pad1: [u64; 6],
    /// [`FIFO_MAGIC`] (line 2, written once by the host before any launch).
    pub magic: u32,
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// Number of slots, a power of two.
    pub capacity: u32,
    /// Global rank owning this FIFO.
    pub rank: u32,
    /// 0 while running; an error code once the proxy (or the host) aborted.
    pub abort: u32,
    /// Host-internal: whoever swaps this from 0 to 1 writes the error record (the device ignores it).
    pub error_claim: u32,
    /// Padding to the next 64-byte line.
    pub pad2: [u32; 10],
    /// Why the proxy stopped (lines 3-4).
    pub error: ErrorRecord,
}

impl FifoHeader {
    /// A fresh header for a FIFO of `capacity` slots owned by `rank`.
    pub const fn new(capacity: u32, rank: u32) -> Self {
        FifoHeader {
            head: 0,
            pad0: [0; 7],
            tail: 0,
            done: 0,
            pad1: [0; 6],
            magic: FIFO_MAGIC,
            version: PROTOCOL_VERSION,
            capacity,
            rank,
            abort: 0,
            error_claim: 0,
            pad2: [0; 10],
            error: ErrorRecord {
                code: 0,
                rank: 0,
                seq: 0,
                msg_len: 0,
                reserved: 0,
                msg: [0; ERROR_MSG_BYTES],
            },
        }
    }
}

/// Byte offsets of the header fields and of the fields within a slot (what the device writes
/// and reads through raw pointers).
pub mod offsets {
    use super::*;
    /// `FifoHeader::head`.
    pub const HEAD: usize = offset_of!(FifoHeader, head);
    /// `FifoHeader::tail`.
    pub const TAIL: usize = offset_of!(FifoHeader, tail);
    /// `FifoHeader::done`.
    pub const DONE: usize = offset_of!(FifoHeader, done);
    /// `FifoHeader::magic`.
    pub const MAGIC: usize = offset_of!(FifoHeader, magic);
    /// `FifoHeader::version`.
    pub const VERSION: usize = offset_of!(FifoHeader, version);
    /// `FifoHeader::capacity`.
    pub const CAPACITY: usize = offset_of!(FifoHeader, capacity);
    /// `FifoHeader::rank`.
    pub const RANK: usize = offset_of!(FifoHeader, rank);
    /// `FifoHeader::abort`.
    pub const ABORT: usize = offset_of!(FifoHeader, abort);
    /// `FifoHeader::error_claim`.
    pub const ERROR_CLAIM: usize = offset_of!(FifoHeader, error_claim);
    /// `FifoHeader::error`.
    pub const ERROR: usize = offset_of!(FifoHeader, error);
    /// `Command::header` (the commit word).
    pub const CMD_HEADER: usize = offset_of!(Command, header);
    /// `Command::body`.
    pub const CMD_BODY: usize = offset_of!(Command, body);
    /// `CommandBody::opcode` within a slot.
    pub const CMD_OPCODE: usize = CMD_BODY + offset_of!(CommandBody, opcode);
    /// `CommandBody::flags` within a slot.
    pub const CMD_FLAGS: usize = CMD_BODY + offset_of!(CommandBody, flags);
    /// `CommandBody::dst_rank` within a slot.
    pub const CMD_DST_RANK: usize = CMD_BODY + offset_of!(CommandBody, dst_rank);
    /// `CommandBody::src_offset` within a slot.
    pub const CMD_SRC_OFFSET: usize = CMD_BODY + offset_of!(CommandBody, src_offset);
    /// `CommandBody::dst_offset` within a slot.
    pub const CMD_DST_OFFSET: usize = CMD_BODY + offset_of!(CommandBody, dst_offset);
    /// `CommandBody::bytes` within a slot.
    pub const CMD_BYTES: usize = CMD_BODY + offset_of!(CommandBody, bytes);
    /// `CommandBody::flag_offset` within a slot.
    pub const CMD_FLAG_OFFSET: usize = CMD_BODY + offset_of!(CommandBody, flag_offset);
    /// `CommandBody::flag_value` within a slot.
    pub const CMD_FLAG_VALUE: usize = CMD_BODY + offset_of!(CommandBody, flag_value);
    /// `CommandBody::epoch` within a slot.
    pub const CMD_EPOCH: usize = CMD_BODY + offset_of!(CommandBody, epoch);
}

// The documented layout. Every type is free of implicit padding (the sizes equal the sums of
// the fields), which the `bytemuck` impls below rely on.
const _: () = {
    assert!(size_of::<Command>() == SLOT_BYTES && align_of::<Command>() == 64);
    assert!(size_of::<CommandBody>() == 56 && align_of::<CommandBody>() == 8);
    assert!(offsets::CMD_HEADER == 0 && offsets::CMD_BODY == 8);
    assert!(offsets::CMD_OPCODE == 8 && offsets::CMD_FLAGS == 10 && offsets::CMD_DST_RANK == 12);
    assert!(offsets::CMD_SRC_OFFSET == 16 && offsets::CMD_DST_OFFSET == 24 && offsets::CMD_BYTES == 32);
    assert!(offsets::CMD_FLAG_OFFSET == 40 && offsets::CMD_FLAG_VALUE == 48 && offsets::CMD_EPOCH == 56);
    assert!(size_of::<ErrorRecord>() == 128);
    assert!(offset_of!(ErrorRecord, code) == 0 && offset_of!(ErrorRecord, rank) == 4);
    assert!(offset_of!(ErrorRecord, seq) == 8 && offset_of!(ErrorRecord, msg_len) == 16);
    assert!(offset_of!(ErrorRecord, msg) == 24);
    assert!(size_of::<FifoHeader>() == FIFO_HEADER_BYTES && align_of::<FifoHeader>() == 64);
    assert!(offsets::HEAD == 0 && offsets::TAIL == 64 && offsets::DONE == 72);
    assert!(offsets::MAGIC == 128 && offsets::VERSION == 132);
    assert!(offsets::CAPACITY == 136 && offsets::RANK == 140);
    assert!(offsets::ABORT == 144 && offsets::ERROR_CLAIM == 148);
    assert!(offsets::ERROR == 192);
    assert!(FIFO_HEADER_BYTES & (SLOT_BYTES - 1) == 0 && SLOT_BYTES.is_power_of_two());
    assert!(EPOCH_SEQ_PROBES < EPOCH_SEQS as u32 && epoch_seq_of(cmd_flags(EPOCH_SEQ_PROBES, 0)) == EPOCH_SEQ_PROBES);
};

// Every bit pattern of these `#[repr(C)]` structs of integers and integer arrays is valid, and
// they have no implicit padding (sizes asserted above), so they hold no uninitialized bytes.
#[cfg(feature = "bytemuck")]
mod pod {
    use super::*;
    // SAFETY: all-zero is a valid `CommandBody` (integers only).
    unsafe impl bytemuck::Zeroable for CommandBody {}
    // SAFETY: integers only, no padding (56 bytes = the fields' sum), `Copy`, `repr(C)`.
    unsafe impl bytemuck::Pod for CommandBody {}
    // SAFETY: all-zero is a valid `Command`.
    unsafe impl bytemuck::Zeroable for Command {}
    // SAFETY: a u64 and a `CommandBody`, no padding (64 bytes), `Copy`, `repr(C)`.
    unsafe impl bytemuck::Pod for Command {}
    // SAFETY: all-zero is a valid `ErrorRecord`.
    unsafe impl bytemuck::Zeroable for ErrorRecord {}
    // SAFETY: integers and a byte array, no padding (128 bytes), `Copy`, `repr(C)`.
    unsafe impl bytemuck::Pod for ErrorRecord {}
    // SAFETY: all-zero is a valid `FifoHeader`.
    unsafe impl bytemuck::Zeroable for FifoHeader {}
    // SAFETY: integers, explicit padding arrays and an `ErrorRecord`, no implicit padding
    // (320 bytes), `Copy`, `repr(C)`.
    unsafe impl bytemuck::Pod for FifoHeader {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_fill_the_right_fields() {
        let p = CommandBody::put(3, 16, 32, 64, 8, 7, 2);
        assert_eq!(
            (
                p.opcode,
                p.dst_rank,
                p.src_offset,
                p.dst_offset,
                p.bytes,
                p.flag_offset,
                p.flag_value,
                p.epoch,
                p.flags
            ),
            (OP_PUT, 3, 16, 32, 64, 8, 7, 2, 0)
        );
        let s = CommandBody::signal(1, 24, 9, 1 << 40);
        assert_eq!(
            (s.opcode, s.bytes, s.flag_offset, s.flag_value, s.epoch),
            (OP_SIGNAL, 0, 24, 9, 1 << 40)
        );
        let n = CommandBody::put_no_flag(1, 0, 0, 8, 0).in_sequence(EPOCH_SEQ_PROBES);
        assert_eq!(
            n.flags,
            CMD_NO_FLAG | ((EPOCH_SEQ_PROBES as u16) << CMD_EPOCH_SEQ_SHIFT)
        );
        assert_eq!(epoch_seq_of(n.flags), EPOCH_SEQ_PROBES);
        assert_eq!(CommandBody::quit(5).opcode, OP_QUIT);
        assert_eq!(fifo_bytes(4), 320 + 256);
        assert_eq!(&FIFO_MAGIC.to_le_bytes(), b"MKPF");
    }
}
