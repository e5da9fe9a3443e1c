//! What travels with each SRD message: the 32-bit immediate, and the signal record.
//!
//! Immediate (host order; verbs carries it big-endian, see [`Imm::to_wire`]):
//!
//! | bits   | field                                                          |
//! |--------|----------------------------------------------------------------|
//! | 31..28 | kind: 1 = data (RDMA write-with-imm), 2 = signal (send-with-imm) |
//! | 27..12 | sender rank (16 bits)                                          |
//! | 11..0  | zero (reserved)                                                |
//!
//! A signal's payload is a [`SignalRecord`] (32 bytes, sent inline): which flag, which value,
//! and how many data messages the sender had sent to this receiver before it (`needed`). The
//! receiver raises the flag once it has counted that many data arrivals from that sender.
use crate::error::TransportError;

/// Kind of an SRD message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImmKind {
    /// A chunk of put data (RDMA write-with-immediate).
    Data = 1,
    /// A flag to raise (send-with-immediate carrying a [`SignalRecord`]).
    Signal = 2,
}

/// A decoded immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Imm {
    /// Kind.
    pub kind: ImmKind,
    /// Sender rank.
    pub sender: u16,
}

impl Imm {
    /// Data from `sender`.
    pub fn data(sender: u16) -> Imm {
        Imm {
            kind: ImmKind::Data,
            sender,
        }
    }
    /// A signal from `sender`.
    pub fn signal(sender: u16) -> Imm {
        Imm {
            kind: ImmKind::Signal,
            sender,
        }
    }
    /// The 32-bit value in host order.
    pub fn encode(self) -> u32 {
        ((self.kind as u32) << 28) | (u32::from(self.sender) << 12)
    }
    /// Decodes and checks a host-order value.
    pub fn decode(v: u32) -> Result<Imm, TransportError> {
        if v & 0xfff != 0 {
            return Err(TransportError::Completion {
                peer: "efa".into(),
                detail: format!("immediate {v:#010x} has reserved bits set"),
            });
        }
        let kind = match v >> 28 {
            1 => ImmKind::Data,
            2 => ImmKind::Signal,
            k => {
                return Err(TransportError::Completion {
                    peer: "efa".into(),
                    detail: format!("immediate {v:#010x} has unknown kind {k}"),
                })
            }
        };
        Ok(Imm {
            kind,
            sender: ((v >> 12) & 0xffff) as u16,
        })
    }
    /// The value for `ibv_wr_*_imm` (network byte order, as `__be32`).
    pub fn to_wire(self) -> u32 {
        self.encode().to_be()
    }
    /// Decodes `ibv_wc.imm_data` (network byte order).
    pub fn from_wire(be: u32) -> Result<Imm, TransportError> {
        Imm::decode(u32::from_be(be))
    }
}

/// The payload of a signal message.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SignalRecord {
    /// [`SignalRecord::MAGIC`].
    pub magic: u32,
    /// Sender rank (must match the immediate's).
    pub sender: u32,
    /// Data messages the sender sent to this receiver before this signal.
    pub needed: u64,
    /// Offset in the receiver's flag array.
    pub flag_offset: u64,
    /// Value to raise the flag to.
    pub value: u64,
}

const _: () = assert!(std::mem::size_of::<SignalRecord>() == SignalRecord::BYTES);
// The wire is little endian and the record is sent as its memory image.
#[cfg(not(target_endian = "little"))]
compile_error!("the EFA signal record is sent as its memory image, which assumes a little-endian host");

// SAFETY: all-zero is a valid record (integers only).
unsafe impl bytemuck::Zeroable for SignalRecord {}
// SAFETY: `repr(C)`, integers only, no padding (32 bytes = 4 + 4 + 8 + 8 + 8, asserted above), `Copy`.
unsafe impl bytemuck::Pod for SignalRecord {}

impl SignalRecord {
    /// "MKSR".
    pub const MAGIC: u32 = u32::from_le_bytes(*b"MKSR");
    /// Size on the wire.
    pub const BYTES: usize = 32;

    /// Its bytes on the wire: the `repr(C)` fields in little-endian order (this crate builds
    /// for little-endian hosts only, see below).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        bytemuck::cast(*self)
    }

    /// Parses and checks the magic.
    pub fn from_bytes(b: &[u8]) -> Result<SignalRecord, TransportError> {
        let bad = |d: String| TransportError::Completion {
            peer: "efa".into(),
            detail: d,
        };
        if b.len() != Self::BYTES {
            return Err(bad(format!(
                "signal record of {} bytes, expected {}",
                b.len(),
                Self::BYTES
            )));
        }
        let r: SignalRecord = bytemuck::pod_read_unaligned(b);
        if r.magic != Self::MAGIC {
            return Err(bad(format!("signal record magic {:#010x}", r.magic)));
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediates_round_trip() {
        for sender in [0u16, 1, 255, 4097, u16::MAX] {
            for imm in [Imm::data(sender), Imm::signal(sender)] {
                assert_eq!(Imm::decode(imm.encode()).unwrap(), imm);
                assert_eq!(Imm::from_wire(imm.to_wire()).unwrap(), imm);
            }
        }
        assert_eq!(Imm::data(3).encode(), 0x1000_3000);
        assert_eq!(Imm::signal(0xabcd).encode(), 0x2abc_d000);
        assert_eq!(Imm::data(3).to_wire(), 0x1000_3000u32.to_be());
        assert!(Imm::decode(0x1000_3001).is_err());
        assert!(Imm::decode(0x3000_0000).is_err());
        assert!(Imm::decode(0).is_err());
    }

    #[test]
    fn records_round_trip() {
        let r = SignalRecord {
            magic: SignalRecord::MAGIC,
            sender: 7,
            needed: 1 << 40,
            flag_offset: 4088,
            value: u64::MAX - 1,
        };
        let b = r.to_bytes();
        assert_eq!(&b[0..4], b"MKSR");
        assert_eq!(SignalRecord::from_bytes(&b).unwrap(), r);
        assert!(SignalRecord::from_bytes(&b[..31]).is_err());
        let mut bad = b;
        bad[0] = 0;
        assert!(SignalRecord::from_bytes(&bad).is_err());
    }
}
