//! The command FIFO between a GPU (producer) and its CPU proxy (consumer).
//!
//! The wire format (header and slot layout, opcodes, flag bits, epochs, the ordering rules of
//! both sides) is defined once, in the no_std config crate that the device producer
//! (`crates/device/src/comm/proxy.rs`) compiles too: [`mkernel_config::fifo`], re-exported
//! here. This module adds what only the host needs.
pub use mkernel_config::fifo::*;

/// Most commands the proxy hands to the transport as one batch per destination.
pub const MAX_BATCH: usize = 8;

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
        assert_eq!(offsets::CMD_EPOCH, 56);
        assert_eq!(std::mem::size_of::<CommandBody>(), 56);
    }

    #[test]
    fn a_command_is_its_bytes() {
        // The POD view the proxy and the tests use: the bytes at the documented offsets.
        let c = Command {
            header: 8,
            body: CommandBody::put(3, 16, 32, 64, 40, 7, (1 << 32) + 5).in_sequence(EPOCH_SEQ_FUSED),
        };
        let b = bytemuck::bytes_of(&c);
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        assert_eq!(u64_at(offsets::CMD_HEADER), 8);
        assert_eq!(u16::from_le_bytes([b[8], b[9]]), OP_PUT);
        assert_eq!(epoch_seq_of(u16::from_le_bytes([b[10], b[11]])), EPOCH_SEQ_FUSED);
        assert_eq!(u64_at(offsets::CMD_EPOCH), (1 << 32) + 5);
        assert_eq!(*bytemuck::from_bytes::<Command>(b), c);
    }
}
