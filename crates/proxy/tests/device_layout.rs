//! The device side writes the FIFO from the constants in `mkernel_config::comm::fifo` (no_std,
//! shared with the kernels); they must equal this crate's protocol layout.
use mkernel_config::comm::fifo as dev;
use mkernel_proxy::protocol::{self as p, offsets};

#[test]
fn device_fifo_constants_match_the_protocol() {
    assert_eq!(dev::HEADER_BYTES, p::FIFO_HEADER_BYTES as u64);
    assert_eq!(dev::SLOT_BYTES, p::SLOT_BYTES as u64);
    assert_eq!(dev::TAIL, offsets::TAIL as u64);
    assert_eq!(dev::DONE, offsets::DONE as u64);
    assert_eq!(dev::ABORT, offsets::ABORT as u64);
    assert_eq!(dev::CMD_HEADER, offsets::CMD_HEADER as u64);
    assert_eq!(dev::OP_PUT, p::OP_PUT);
    assert_eq!(dev::OP_SIGNAL, p::OP_SIGNAL);
    let body = offsets::CMD_BODY as u64;
    assert_eq!(
        dev::CMD_OPCODE,
        body + std::mem::offset_of!(p::CommandBody, opcode) as u64
    );
    assert_eq!(
        dev::CMD_DST_RANK,
        body + std::mem::offset_of!(p::CommandBody, dst_rank) as u64
    );
    assert_eq!(
        dev::CMD_SRC_OFFSET,
        body + std::mem::offset_of!(p::CommandBody, src_offset) as u64
    );
    assert_eq!(
        dev::CMD_DST_OFFSET,
        body + std::mem::offset_of!(p::CommandBody, dst_offset) as u64
    );
    assert_eq!(
        dev::CMD_BYTES,
        body + std::mem::offset_of!(p::CommandBody, bytes) as u64
    );
    assert_eq!(
        dev::CMD_FLAG_OFFSET,
        body + std::mem::offset_of!(p::CommandBody, flag_offset) as u64
    );
    assert_eq!(
        dev::CMD_FLAG_VALUE,
        body + std::mem::offset_of!(p::CommandBody, flag_value) as u64
    );
    assert_eq!(
        dev::CMD_EPOCH,
        body + std::mem::offset_of!(p::CommandBody, epoch) as u64
    );
    assert_eq!(
        dev::CMD_FLAGS,
        body + std::mem::offset_of!(p::CommandBody, flags) as u64
    );
    assert_eq!(dev::CMD_EPOCH_SEQ_SHIFT, p::CMD_EPOCH_SEQ_SHIFT);
    assert!((dev::EPOCH_SEQ_PROBES as usize) < p::EPOCH_SEQS && dev::EPOCH_SEQ_FUSED != dev::EPOCH_SEQ_COLLECTIVES);
}
