//! The connection blob: what one rank tells a peer so the peer can reach it, as bytes for the
//! bootstrap store.
//!
//! Layout (little-endian, [`ConnBlob::HEADER_BYTES`] + 12 bytes per queue pair):
//!
//! | offset | field          | type     |
//! |-------:|----------------|----------|
//! | 0      | magic "MKCB"   | u32      |
//! | 4      | version        | u16      |
//! | 6      | kind           | u8 (1 = RC, 2 = SRD) |
//! | 7      | mtu            | u8 (`ibv_mtu`: 1 = 256 .. 5 = 4096) |
//! | 8      | rank (sender)  | u32      |
//! | 12     | peer (for)     | u32      |
//! | 16     | lid            | u16      |
//! | 18     | queue pairs n  | u16      |
//! | 20     | gid            | [u8; 16] |
//! | 36     | data.addr      | u64      |
//! | 44     | data.len       | u64      |
//! | 52     | data.rkey      | u32      |
//! | 56     | flags.addr     | u64      |
//! | 64     | flags.len      | u64      |
//! | 72     | flags.rkey     | u32      |
//! | 76 + 12 i | `qp[i]`: qpn, psn, qkey | 3 x u32 |
use crate::error::TransportError;

/// Which transport a blob is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlobKind {
    /// InfiniBand / RoCE reliable connection.
    Rc = 1,
    /// EFA scalable reliable datagram.
    Srd = 2,
}

/// A registered memory region as a peer addresses it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteMem {
    /// Virtual address (or IOVA) of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

/// One queue pair's address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpAddr {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Q_Key (SRD; 0 for RC).
    pub qkey: u32,
}

/// Everything a peer needs to connect to this rank and write into its memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnBlob {
    /// Transport.
    pub kind: BlobKind,
    /// Sender of the blob.
    pub rank: u32,
    /// The peer it is meant for (queue pairs are per pair of ranks).
    pub peer: u32,
    /// Port LID (InfiniBand; 0 on RoCE and EFA).
    pub lid: u16,
    /// Port GID (RoCE, EFA, and routed InfiniBand).
    pub gid: [u8; 16],
    /// Active MTU as an `ibv_mtu` value.
    pub mtu: u8,
    /// The data region.
    pub data: RemoteMem,
    /// The flag array (RC writes flags remotely; SRD leaves it zero).
    pub flags: RemoteMem,
    /// The queue pairs, lane by lane.
    pub qps: Vec<QpAddr>,
}

const MAGIC: u32 = u32::from_le_bytes(*b"MKCB");
const VERSION: u16 = 1;
/// Most queue pairs per peer a blob may carry.
pub const MAX_QPS_PER_PEER: usize = 16;

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], TransportError> {
        let s = self
            .b
            .get(self.at..self.at + N)
            .ok_or_else(|| TransportError::Blob(format!("truncated at byte {}", self.at)))?;
        self.at += N;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, TransportError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, TransportError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, TransportError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, TransportError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn mem(&mut self) -> Result<RemoteMem, TransportError> {
        Ok(RemoteMem {
            addr: self.u64()?,
            len: self.u64()?,
            rkey: self.u32()?,
        })
    }
}

impl ConnBlob {
    /// Bytes before the queue pair list.
    pub const HEADER_BYTES: usize = 76;
    /// Bytes per queue pair.
    pub const QP_BYTES: usize = 12;

    /// Serializes the blob.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::HEADER_BYTES + Self::QP_BYTES * self.qps.len());
        v.extend_from_slice(&MAGIC.to_le_bytes());
        v.extend_from_slice(&VERSION.to_le_bytes());
        v.push(self.kind as u8);
        v.push(self.mtu);
        v.extend_from_slice(&self.rank.to_le_bytes());
        v.extend_from_slice(&self.peer.to_le_bytes());
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&(self.qps.len() as u16).to_le_bytes());
        v.extend_from_slice(&self.gid);
        for m in [self.data, self.flags] {
            v.extend_from_slice(&m.addr.to_le_bytes());
            v.extend_from_slice(&m.len.to_le_bytes());
            v.extend_from_slice(&m.rkey.to_le_bytes());
        }
        for q in &self.qps {
            v.extend_from_slice(&q.qpn.to_le_bytes());
            v.extend_from_slice(&q.psn.to_le_bytes());
            v.extend_from_slice(&q.qkey.to_le_bytes());
        }
        v
    }

    /// Parses and checks a blob (magic, version, kind, MTU, sizes, 24-bit QPN/PSN).
    pub fn from_bytes(b: &[u8]) -> Result<ConnBlob, TransportError> {
        let mut r = Reader { b, at: 0 };
        let magic = r.u32()?;
        if magic != MAGIC {
            return Err(TransportError::Blob(format!(
                "magic {magic:#010x}, expected {MAGIC:#010x}"
            )));
        }
        let version = r.u16()?;
        if version != VERSION {
            return Err(TransportError::Blob(format!("version {version}, expected {VERSION}")));
        }
        let kind = match r.u8()? {
            1 => BlobKind::Rc,
            2 => BlobKind::Srd,
            k => return Err(TransportError::Blob(format!("unknown transport kind {k}"))),
        };
        let mtu = r.u8()?;
        if !(1..=5).contains(&mtu) {
            return Err(TransportError::Blob(format!("mtu code {mtu} not in 1..=5")));
        }
        let (rank, peer, lid) = (r.u32()?, r.u32()?, r.u16()?);
        let n = r.u16()? as usize;
        if n == 0 || n > MAX_QPS_PER_PEER {
            return Err(TransportError::Blob(format!(
                "{n} queue pairs, expected 1..={MAX_QPS_PER_PEER}"
            )));
        }
        if b.len() != Self::HEADER_BYTES + n * Self::QP_BYTES {
            return Err(TransportError::Blob(format!(
                "{} bytes, expected {} for {n} queue pairs",
                b.len(),
                Self::HEADER_BYTES + n * Self::QP_BYTES
            )));
        }
        let gid = r.take::<16>()?;
        let (data, flags) = (r.mem()?, r.mem()?);
        let mut qps = Vec::with_capacity(n);
        for _ in 0..n {
            let q = QpAddr {
                qpn: r.u32()?,
                psn: r.u32()?,
                qkey: r.u32()?,
            };
            if q.qpn >= 1 << 24 || q.psn >= 1 << 24 {
                return Err(TransportError::Blob(format!(
                    "qpn {:#x} or psn {:#x} exceeds 24 bits",
                    q.qpn, q.psn
                )));
            }
            qps.push(q);
        }
        Ok(ConnBlob {
            kind,
            rank,
            peer,
            lid,
            gid,
            mtu,
            data,
            flags,
            qps,
        })
    }

    /// The bootstrap-store key under which `rank` publishes its blob for `peer`.
    pub fn store_key(kind: BlobKind, rank: usize, peer: usize) -> String {
        let k = match kind {
            BlobKind::Rc => "rc",
            BlobKind::Srd => "srd",
        };
        format!("mkernel/proxy/{k}/{rank}->{peer}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ConnBlob {
        ConnBlob {
            kind: BlobKind::Rc,
            rank: 3,
            peer: 9,
            lid: 0x1234,
            gid: core::array::from_fn(|i| i as u8 * 7),
            mtu: 5,
            data: RemoteMem {
                addr: 0x7f00_dead_beef,
                len: 1 << 30,
                rkey: 0xabcd,
            },
            flags: RemoteMem {
                addr: 0x7f00_0000_1000,
                len: 4096,
                rkey: 0x1111,
            },
            qps: vec![
                QpAddr {
                    qpn: 0x12,
                    psn: 0xfff_fff,
                    qkey: 0,
                },
                QpAddr {
                    qpn: 0x13,
                    psn: 7,
                    qkey: 0,
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let b = sample();
        let bytes = b.to_bytes();
        assert_eq!(bytes.len(), ConnBlob::HEADER_BYTES + 2 * ConnBlob::QP_BYTES);
        assert_eq!(&bytes[..4], b"MKCB");
        assert_eq!(u64::from_le_bytes(bytes[36..44].try_into().unwrap()), 0x7f00_dead_beef);
        assert_eq!(ConnBlob::from_bytes(&bytes).unwrap(), b);
        let srd = ConnBlob {
            kind: BlobKind::Srd,
            qps: vec![QpAddr {
                qpn: 5,
                psn: 0,
                qkey: 0x1234_5678,
            }],
            ..b
        };
        assert_eq!(ConnBlob::from_bytes(&srd.to_bytes()).unwrap(), srd);
        assert_eq!(ConnBlob::store_key(BlobKind::Rc, 3, 9), "mkernel/proxy/rc/3->9");
    }

    #[test]
    fn corrupt_blobs_are_refused() {
        let good = sample().to_bytes();
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut v = good.clone();
            f(&mut v);
            ConnBlob::from_bytes(&v).unwrap_err()
        };
        bad(&|v| v[0] = b'X');
        bad(&|v| v[4] = 9);
        bad(&|v| v[6] = 7);
        bad(&|v| v[7] = 0);
        bad(&|v| v.truncate(80));
        bad(&|v| v.push(0));
        bad(&|v| v[18] = 0);
        bad(&|v| v[79] = 1); // qpn >= 2^24
        assert!(ConnBlob::from_bytes(&[]).is_err());
    }
}
