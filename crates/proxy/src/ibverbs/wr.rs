//! [`WrDesc`]s as a linked chain of `ibv_send_wr` ready for one `ibv_post_send`.
use super::plan::{Payload, WrDesc};
use rdma_sys::{ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode, rdma_t};

/// Owns the `ibv_send_wr`s, their scatter-gather entries and inline values of one chain.
/// The pointers inside point into this value's heap buffers, which never move after `new`.
pub struct SendChain {
    wrs: Vec<ibv_send_wr>,
    sges: Vec<ibv_sge>,
    /// Sources of the inline SGEs: only read through the pointers in `sges`.
    #[allow(dead_code)]
    inline: Vec<u64>,
}

// SAFETY: the raw pointers only point into the chain's own buffers.
unsafe impl Send for SendChain {}

impl SendChain {
    /// Builds the chain for `descs` (RDMA writes; flags inline; probes with no SGE).
    pub fn new(descs: &[WrDesc]) -> SendChain {
        let inline: Vec<u64> = descs
            .iter()
            .map(|d| if let Payload::Inline(v) = d.payload { v } else { 0 })
            .collect();
        let inline_base = inline.as_ptr();
        let mut sge_of = Vec::with_capacity(descs.len());
        let mut sges = Vec::with_capacity(descs.len());
        for (i, d) in descs.iter().enumerate() {
            let sge = match d.payload {
                Payload::Sge { addr, length, lkey } => Some(ibv_sge { addr, length, lkey }),
                Payload::Inline(_) => Some(ibv_sge {
                    addr: inline_base.wrapping_add(i) as u64,
                    length: 8,
                    lkey: 0,
                }),
                Payload::Empty => None,
            };
            sge_of.push(sge.map(|s| {
                sges.push(s);
                sges.len() - 1
            }));
        }
        let mut c = SendChain {
            wrs: Vec::with_capacity(descs.len()),
            sges,
            inline,
        };
        let sge_base = c.sges.as_mut_ptr();
        for (d, sge) in descs.iter().zip(sge_of) {
            let mut flags = 0;
            if d.signaled {
                flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if matches!(d.payload, Payload::Inline(_)) {
                flags |= ibv_send_flags::IBV_SEND_INLINE.0;
            }
            // SAFETY: ibv_send_wr is plain data (integers, pointers, unions of those); all-zero is valid.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = d.wr_id;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.send_flags = flags;
            wr.wr.rdma = rdma_t {
                remote_addr: d.remote_addr,
                rkey: d.rkey,
            };
            if let Some(k) = sge {
                wr.num_sge = 1;
                wr.sg_list = sge_base.wrapping_add(k);
            }
            c.wrs.push(wr);
        }
        // Link with raw pointers only (no references into the buffer after taking `base`).
        let n = c.wrs.len();
        let base = c.wrs.as_mut_ptr();
        for i in 0..n {
            let next = if i + 1 < n {
                base.wrapping_add(i + 1)
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: i < n, inside the buffer.
            unsafe { (*base.add(i)).next = next };
        }
        c
    }

    /// The first request (null for an empty chain), for `ibv_post_send`.
    pub fn head(&mut self) -> *mut ibv_send_wr {
        if self.wrs.is_empty() {
            std::ptr::null_mut()
        } else {
            self.wrs.as_mut_ptr()
        }
    }

    /// The requests, in chain order.
    pub fn wrs(&self) -> &[ibv_send_wr] {
        &self.wrs
    }

    /// Index in the chain of the request `bad` points to (after a failed post).
    pub fn index_of(&self, bad: *const ibv_send_wr) -> Option<usize> {
        self.wrs.iter().position(|w| std::ptr::eq(w, bad))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_fields() {
        let descs = [
            WrDesc {
                wr_id: 1,
                payload: Payload::Sge {
                    addr: 0x1000,
                    length: 4096,
                    lkey: 5,
                },
                remote_addr: 0x9000,
                rkey: 6,
                signaled: false,
            },
            WrDesc {
                wr_id: 2,
                payload: Payload::Inline(0xfeed),
                remote_addr: 0x7008,
                rkey: 7,
                signaled: true,
            },
            WrDesc {
                wr_id: 3,
                payload: Payload::Empty,
                remote_addr: 0x7000,
                rkey: 7,
                signaled: true,
            },
        ];
        let mut c = SendChain::new(&descs);
        let head = c.head();
        let w = c.wrs();
        assert_eq!(w.len(), 3);
        assert!(std::ptr::eq(head, &w[0]));
        assert!(std::ptr::eq(w[0].next, &w[1]) && std::ptr::eq(w[1].next, &w[2]) && w[2].next.is_null());
        assert_eq!(
            (w[0].wr_id, w[0].opcode, w[0].send_flags, w[0].num_sge),
            (1, ibv_wr_opcode::IBV_WR_RDMA_WRITE, 0, 1)
        );
        // SAFETY: the pointers point into the chain, which is alive; unions hold `rdma`.
        unsafe {
            assert_eq!(
                ((*w[0].sg_list).addr, (*w[0].sg_list).length, (*w[0].sg_list).lkey),
                (0x1000, 4096, 5)
            );
            assert_eq!((w[0].wr.rdma.remote_addr, w[0].wr.rdma.rkey), (0x9000, 6));
            assert_eq!(
                w[1].send_flags,
                ibv_send_flags::IBV_SEND_SIGNALED.0 | ibv_send_flags::IBV_SEND_INLINE.0
            );
            let s = *w[1].sg_list;
            assert_eq!((s.length, s.lkey), (8, 0));
            assert_eq!(*(s.addr as *const u64), 0xfeed, "inline source holds the flag value");
            assert_eq!(w[1].wr.rdma.remote_addr, 0x7008);
        }
        assert_eq!(
            (w[2].num_sge, w[2].send_flags),
            (0, ibv_send_flags::IBV_SEND_SIGNALED.0)
        );
        assert!(w[2].sg_list.is_null());
        assert_eq!(c.index_of(&c.wrs()[2]), Some(2));
        assert!(SendChain::new(&[]).head().is_null());
    }
}
