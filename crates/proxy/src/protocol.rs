//! The command FIFO between a GPU (producer) and its CPU proxy (consumer): exact memory layout.
//!
//! The device side (Rust PTX in `crates/device`) mirrors these types field by field; the
//! compile-time assertions at the bottom of this file pin every offset, so a change here that
//! the device does not follow fails to build.
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
//! | 144    | `abort`          | u32       | proxy/host | 0 = running, else an [`ErrorCode`] (release)   |
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
//! | 8      | `opcode`      | u32  | [`OP_NOP`], [`OP_PUT`], [`OP_SIGNAL`], [`OP_QUIT`]             |
//! | 12     | `dst_rank`    | u32  | global rank of the receiver (must be a proxy peer)             |
//! | 16     | `src_offset`  | u64  | byte offset into the sender's registered data region          |
//! | 24     | `dst_offset`  | u64  | byte offset into the receiver's registered data region        |
//! | 32     | `bytes`       | u64  | length of the put (0 allowed)                                  |
//! | 40     | `flag_offset` | u64  | byte offset into the receiver's flag array, 8-byte aligned     |
//! | 48     | `flag_value`  | u64  | value stored into the flag (an epoch tag), nonzero             |
//! | 56     | `epoch`       | u32  | launch epoch; never decreases along one FIFO                   |
//! | 60     | `flags`       | u32  | [`CMD_NO_FLAG`], epoch sequence (bits 1-2); others must be 0   |
//!
//! # Ordering (who writes which word, with which ordering)
//!
//! Producer (a GPU thread), for one command:
//! 1. `seq = atom.add(head, 1)` — any ordering; `head` may instead live in device memory, the
//!    proxy never relies on it (it only reads it for diagnostics).
//! 2. Backpressure: spin until `seq - ld.acquire.sys(tail) < capacity`; while spinning, give up
//!    if `ld.volatile(abort) != 0`.
//! 3. Write the body (offsets 8..64) of `slot[seq % capacity]` with ordinary stores.
//! 4. `st.release.sys.u64 slot.header = seq + 1` — the commit. The release at system scope makes
//!    the body visible to the CPU before the header.
//!
//! Consumer (the proxy thread), for `seq = tail`:
//! 1. Poll `slot[seq % capacity].header` with an acquire load until it equals `seq + 1`. Any other
//!    nonzero value is a protocol violation (the producer overran the ring) and aborts.
//! 2. Copy the body out, validate it (see `validate.rs`), hand it to the transport.
//! 3. Store 0 into the header (so a stale command is never taken for a new one after the ring
//!    wraps), then `tail = seq + 1` with a release store (several slots may be released by one
//!    tail store). Only after that may the producer write the slot again.
//! 4. When the transport reports that every operation of commands `< n` completed locally (the
//!    source bytes were read), store `done = n` with release: the GPU may then overwrite the
//!    source bytes of those commands.
//!
//! On error the proxy writes `error.*` first and then `abort` (release); a reader that sees
//! `abort != 0` with an acquire load sees the whole record. Device-side waits (backpressure,
//! flag waits) should poll `abort` and stop when it is nonzero.
//!
//! # Flags and epochs
//!
//! Each rank has a flag array of `u64` words.
//! * A PUT without [`CMD_NO_FLAG`] stores `flag_value` into the receiver's word at
//!   `flag_offset` once the data of this PUT is visible in the receiver's memory.
//! * A SIGNAL stores its flag once the data of every earlier PUT of this FIFO to the same
//!   receiver is visible. It moves no data.
//!
//! (With one queue pair per peer, the default, and on the emulated and EFA backends, a PUT's
//! flag also covers every earlier PUT to that receiver; with several RC queue pairs per peer it
//! does not, so the device must use a SIGNAL when it needs the cumulative guarantee.)
//!
//! Flag values are epoch tags (for example `epoch * steps + step`): they only grow, so flags
//! need no reset between launches and a waiter tests `flag >= expected` with an acquire load
//! at system scope. Flags start at 0, so a flag value of 0 is refused.
//!
//! [`ErrorCode`]: crate::ErrorCode
use std::mem::{align_of, offset_of, size_of};

/// `FifoHeader::magic`: ASCII "MKPF" little-endian.
pub const FIFO_MAGIC: u32 = u32::from_le_bytes(*b"MKPF");
/// Version of this layout; bump on any change the device must follow.
pub const PROTOCOL_VERSION: u32 = 1;
/// Bytes of one command slot.
pub const SLOT_BYTES: usize = 64;
/// Bytes of the FIFO header; the slots start at this offset.
pub const FIFO_HEADER_BYTES: usize = 320;
/// Smallest allowed capacity (slots).
pub const MIN_CAPACITY: u32 = 2;
/// Largest allowed capacity (slots): 1 Mi slots = 64 MiB.
pub const MAX_CAPACITY: u32 = 1 << 20;
/// Most commands the proxy hands to the transport as one batch per destination.
pub const MAX_BATCH: usize = 8;
/// Bytes of one flag word.
pub const FLAG_BYTES: u64 = 8;
/// Capacity of the error message in [`ErrorRecord::msg`].
pub const ERROR_MSG_BYTES: usize = 104;
/// [`ErrorRecord::seq`] when the error is not tied to a slot.
pub const NO_SEQ: u64 = u64::MAX;

/// Opcode: consumed and ignored (the producer may use it to fill a claimed slot it no longer needs).
pub const OP_NOP: u32 = 0;
/// Opcode: write `bytes` from the local data region at `src_offset` to `dst_rank`'s data region
/// at `dst_offset`, then store `flag_value` into `dst_rank`'s flag word at `flag_offset`
/// (unless [`CMD_NO_FLAG`]).
pub const OP_PUT: u32 = 1;
/// Opcode: store `flag_value` into `dst_rank`'s flag word at `flag_offset`, ordered after every
/// earlier PUT of this FIFO to `dst_rank`. `src_offset`, `dst_offset` and `bytes` must be 0.
pub const OP_SIGNAL: u32 = 2;
/// Opcode: the proxy drains what it has, stops, and `join()` returns `Ok`. Other fields must be 0.
pub const OP_QUIT: u32 = 3;

/// Command flag: a PUT that raises no flag (`flag_offset` and `flag_value` must then be 0);
/// follow such puts with a SIGNAL.
pub const CMD_NO_FLAG: u32 = 1;
/// Command flag bits 1-2: which epoch sequence `epoch` belongs to. Kernels of different kinds
/// count launches separately (collectives, fused kernels, latency probes), so epochs only
/// increase within a sequence; the validator checks each sequence on its own.
pub const CMD_EPOCH_SEQ_SHIFT: u32 = 1;
/// Mask of the epoch-sequence bits.
pub const CMD_EPOCH_SEQ_MASK: u32 = 0b11 << CMD_EPOCH_SEQ_SHIFT;
/// Number of epoch sequences (0 collectives, 1 fused kernels, 2 probes).
pub const EPOCH_SEQS: usize = 3;
/// Every defined command flag bit.
pub const CMD_KNOWN_FLAGS: u32 = CMD_NO_FLAG | CMD_EPOCH_SEQ_MASK;

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
    pub opcode: u32,
    /// Global rank of the receiver.
    pub dst_rank: u32,
    /// Byte offset into the sender's data region.
    pub src_offset: u64,
    /// Byte offset into the receiver's data region.
    pub dst_offset: u64,
    /// Bytes to write.
    pub bytes: u64,
    /// Byte offset of the flag word in the receiver's flag array (multiple of 8).
    pub flag_offset: u64,
    /// Value stored into the flag (nonzero epoch tag).
    pub flag_value: u64,
    /// Launch epoch; nondecreasing along one FIFO.
    pub epoch: u32,
    /// `CMD_*` bits.
    pub flags: u32,
}

impl CommandBody {
    /// A PUT of `bytes` from `src_offset` to `dst_rank`'s `dst_offset`, raising the flag.
    pub fn put(
        dst_rank: u32,
        src_offset: u64,
        dst_offset: u64,
        bytes: u64,
        flag_offset: u64,
        flag_value: u64,
        epoch: u32,
    ) -> Self {
        CommandBody {
            opcode: OP_PUT,
            dst_rank,
            src_offset,
            dst_offset,
            bytes,
            flag_offset,
            flag_value,
            epoch,
            flags: 0,
        }
    }
    /// A PUT that raises no flag.
    pub fn put_no_flag(dst_rank: u32, src_offset: u64, dst_offset: u64, bytes: u64, epoch: u32) -> Self {
        CommandBody {
            opcode: OP_PUT,
            dst_rank,
            src_offset,
            dst_offset,
            bytes,
            flag_offset: 0,
            flag_value: 0,
            epoch,
            flags: CMD_NO_FLAG,
        }
    }
    /// A SIGNAL: the flag only, after earlier puts to `dst_rank`.
    pub fn signal(dst_rank: u32, flag_offset: u64, flag_value: u64, epoch: u32) -> Self {
        CommandBody {
            opcode: OP_SIGNAL,
            dst_rank,
            flag_offset,
            flag_value,
            epoch,
            ..Default::default()
        }
    }
    /// A NOP.
    pub fn nop(epoch: u32) -> Self {
        CommandBody {
            opcode: OP_NOP,
            epoch,
            ..Default::default()
        }
    }
    /// A QUIT.
    pub fn quit(epoch: u32) -> Self {
        CommandBody {
            opcode: OP_QUIT,
            epoch,
            ..Default::default()
        }
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
    /// An [`ErrorCode`](crate::ErrorCode) value (never 0 once written).
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
    /// The message as text (lossy if the bytes are not UTF-8).
    pub fn message(&self) -> String {
        let n = (self.msg_len as usize).min(ERROR_MSG_BYTES);
        String::from_utf8_lossy(&self.msg[..n]).into_owned()
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
    /// 0 while running; an `ErrorCode` once the proxy (or the host) aborted.
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
    pub fn new(capacity: u32, rank: u32) -> Self {
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
            error: ErrorRecord::default(),
        }
    }
}

/// Byte offsets of every header field, for the device side and the documentation.
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
    /// `FifoHeader::capacity`.
    pub const CAPACITY: usize = offset_of!(FifoHeader, capacity);
    /// `FifoHeader::abort`.
    pub const ABORT: usize = offset_of!(FifoHeader, abort);
    /// `FifoHeader::error_claim`.
    pub const ERROR_CLAIM: usize = offset_of!(FifoHeader, error_claim);
    /// `FifoHeader::version`.
    pub const VERSION: usize = offset_of!(FifoHeader, version);
    /// `FifoHeader::rank`.
    pub const RANK: usize = offset_of!(FifoHeader, rank);
    /// `FifoHeader::error`.
    pub const ERROR: usize = offset_of!(FifoHeader, error);
    /// `Command::header`.
    pub const CMD_HEADER: usize = offset_of!(Command, header);
    /// `Command::body`.
    pub const CMD_BODY: usize = offset_of!(Command, body);
}

// The layout the device mirrors; any change here must change crates/device too.
const _: () = {
    assert!(size_of::<Command>() == SLOT_BYTES && align_of::<Command>() == 64);
    assert!(size_of::<CommandBody>() == 56 && align_of::<CommandBody>() == 8);
    assert!(offset_of!(Command, header) == 0 && offset_of!(Command, body) == 8);
    assert!(offset_of!(CommandBody, opcode) == 0); // slot offset 8
    assert!(offset_of!(CommandBody, dst_rank) == 4); // 12
    assert!(offset_of!(CommandBody, src_offset) == 8); // 16
    assert!(offset_of!(CommandBody, dst_offset) == 16); // 24
    assert!(offset_of!(CommandBody, bytes) == 24); // 32
    assert!(offset_of!(CommandBody, flag_offset) == 32); // 40
    assert!(offset_of!(CommandBody, flag_value) == 40); // 48
    assert!(offset_of!(CommandBody, epoch) == 48); // 56
    assert!(offset_of!(CommandBody, flags) == 52); // 60
    assert!(size_of::<ErrorRecord>() == 128);
    assert!(offset_of!(ErrorRecord, code) == 0 && offset_of!(ErrorRecord, rank) == 4);
    assert!(offset_of!(ErrorRecord, seq) == 8 && offset_of!(ErrorRecord, msg_len) == 16);
    assert!(offset_of!(ErrorRecord, msg) == 24);
    assert!(size_of::<FifoHeader>() == FIFO_HEADER_BYTES && align_of::<FifoHeader>() == 64);
    assert!(offset_of!(FifoHeader, head) == 0);
    assert!(offset_of!(FifoHeader, tail) == 64 && offset_of!(FifoHeader, done) == 72);
    assert!(offset_of!(FifoHeader, magic) == 128 && offset_of!(FifoHeader, version) == 132);
    assert!(offset_of!(FifoHeader, capacity) == 136 && offset_of!(FifoHeader, rank) == 140);
    assert!(offset_of!(FifoHeader, abort) == 144 && offset_of!(FifoHeader, error_claim) == 148);
    assert!(offset_of!(FifoHeader, error) == 192);
    assert!(FIFO_HEADER_BYTES & (SLOT_BYTES - 1) == 0 && SLOT_BYTES.is_power_of_two());
    assert!(MAX_BATCH == 8);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_documented_offsets() {
        assert_eq!(offsets::HEAD, 0);
        assert_eq!(offsets::TAIL, 64);
        assert_eq!(offsets::DONE, 72);
        assert_eq!(offsets::MAGIC, 128);
        assert_eq!(offsets::CAPACITY, 136);
        assert_eq!(offsets::ABORT, 144);
        assert_eq!(offsets::ERROR, 192);
        assert_eq!(offsets::CMD_BODY, 8);
        assert_eq!(fifo_bytes(4), 320 + 256);
        assert_eq!(&FIFO_MAGIC.to_le_bytes(), b"MKPF");
    }

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
        let s = CommandBody::signal(1, 24, 9, 4);
        assert_eq!((s.opcode, s.bytes, s.flag_offset, s.flag_value), (OP_SIGNAL, 0, 24, 9));
        assert_eq!(CommandBody::put_no_flag(1, 0, 0, 8, 0).flags, CMD_NO_FLAG);
    }
}
