//! The SRD backend on an EFA device: SRD queue pairs (efadv), one address handle per peer,
//! data as RDMA write-with-immediate, flags as inline sends of a signal record, and the
//! receive side that raises flags through a [`FlagSink`].
use super::dl::{
    efadv, EfadvDeviceAttr, EfadvQpInitAttr, EFADV_CAPS_RDMA_WRITE, EFADV_CAPS_RNR_RETRY, EFADV_QP_DRIVER_TYPE_SRD,
};
use super::imm::{Imm, SignalRecord};
use super::plan::{SrdPlanner, SrdWr};
use super::recv::{FlagSink, RecvTracker};
use crate::error::TransportError;
use crate::ibverbs::blob::{BlobKind, ConnBlob, QpAddr, RemoteMem};
use crate::ibverbs::device::{Context, Cq, MemSource, Mr, Pd, Qp};
use crate::ibverbs::dl::{errno, poll_cq, post_recv};
use crate::ibverbs::plan::LocalMem;
use crate::ibverbs::rc::{initial_psn, NetSetup};
use crate::ibverbs::sysfs::{NicChoice, NicKind};
use crate::transport::{Op, Transport};
use rdma_sys::{
    ibv_ah, ibv_ah_attr, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_create_send_ops_flags, ibv_qp_ex, ibv_qp_init_attr_ex,
    ibv_qp_init_attr_mask, ibv_qp_state, ibv_qp_type, ibv_recv_wr, ibv_send_flags, ibv_sge, ibv_wc, ibv_wc_flags,
    ibv_wc_opcode, ibv_wc_status,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// SRD settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SrdConfig {
    /// SRD queue pairs (shared by all peers); commands are striped over them (`MKERNEL_EFA_QPS`, 2).
    pub lanes: usize,
    /// Send queue depth per queue pair (256, capped by the device).
    pub sq_depth: u32,
    /// Receive buffers per queue pair (`MKERNEL_EFA_RECV_DEPTH`, 1024).
    pub recv_depth: u32,
    /// Q_Key shared by the job.
    pub qkey: u32,
    /// GID index (0).
    pub gid_index: u32,
    /// Give up waiting for completions after this long (30 s).
    pub wait_timeout: Duration,
}

impl Default for SrdConfig {
    fn default() -> Self {
        SrdConfig {
            lanes: 2,
            sq_depth: 256,
            recv_depth: 1024,
            qkey: u32::from_le_bytes(*b"MKEQ") & 0x7fff_ffff,
            gid_index: 0,
            wait_timeout: Duration::from_secs(30),
        }
    }
}

impl SrdConfig {
    /// Defaults changed by `MKERNEL_EFA_QPS` and `MKERNEL_EFA_RECV_DEPTH`.
    pub fn from_env() -> Result<SrdConfig, TransportError> {
        let mut c = SrdConfig::default();
        let num = |k: &str| -> Result<Option<u32>, TransportError> {
            std::env::var(k)
                .ok()
                .map(|v| {
                    v.trim()
                        .parse::<u32>()
                        .map_err(|_| TransportError::Config(format!("{k}={v:?} is not a number")))
                })
                .transpose()
        };
        if let Some(v) = num("MKERNEL_EFA_QPS")? {
            c.lanes = v as usize;
        }
        if let Some(v) = num("MKERNEL_EFA_RECV_DEPTH")? {
            c.recv_depth = v;
        }
        if c.lanes == 0 || c.lanes > crate::ibverbs::blob::MAX_QPS_PER_PEER || c.recv_depth == 0 || c.sq_depth == 0 {
            return Err(TransportError::Config(format!(
                "EFA lanes {} (1..=16), recv_depth {} and sq_depth {} (>= 1)",
                c.lanes, c.recv_depth, c.sq_depth
            )));
        }
        Ok(c)
    }
}

struct Ah {
    v_destroy: unsafe extern "C" fn(*mut ibv_ah) -> libc::c_int,
    ah: *mut ibv_ah,
}
impl Drop for Ah {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_ah.
        unsafe { (self.v_destroy)(self.ah) };
    }
}

struct Peer {
    ah: Ah,
    qps: Vec<QpAddr>,
    data: RemoteMem,
}

/// An SRD endpoint being connected.
pub struct SrdEndpoint {
    me: usize,
    world: usize,
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    qps: Vec<Qp>,
    psns: Vec<u32>,
    data: Mr,
    recv_buf: Vec<[u8; SignalRecord::BYTES]>,
    recv_mr: Mr,
    peers: Vec<Option<Peer>>,
    is_peer: Vec<bool>,
    flag_bytes: u64,
    max_msg: u64,
    config: SrdConfig,
    nic: NicChoice,
}

// SAFETY: verbs objects are used by one thread at a time.
unsafe impl Send for SrdEndpoint {}

impl SrdEndpoint {
    /// Opens the EFA device chosen for this GPU, checks RDMA-write support, registers the data
    /// region and the receive buffers, creates the SRD queue pairs and posts receives.
    pub fn open(setup: &NetSetup, config: SrdConfig) -> Result<SrdEndpoint, TransportError> {
        let nic = setup.choose_nic()?;
        if nic.nic.kind != NicKind::Efa {
            return Err(TransportError::Config(format!(
                "{} is not an EFA device: use the ibverbs backend",
                nic.nic.name
            )));
        }
        let dv = efadv()?;
        let ctx = Context::open(&nic.nic.name, nic.port, config.gid_index)?;
        let mut attr = EfadvDeviceAttr::default();
        // SAFETY: live context, valid out-pointer and size.
        if unsafe { (dv.efadv_query_device)(ctx.ctx, &mut attr, std::mem::size_of::<EfadvDeviceAttr>() as u32) } != 0 {
            return Err(TransportError::Verbs {
                call: "efadv_query_device",
                detail: errno(),
            });
        }
        if attr.device_caps & EFADV_CAPS_RDMA_WRITE == 0 {
            return Err(TransportError::NoDevice(format!("{} has no RDMA write (EFA device caps {:#x}); write-with-immediate needs a newer EFA generation and driver", nic.nic.name, attr.device_caps)));
        }
        if usize::from(attr.inline_buf_size) < SignalRecord::BYTES {
            return Err(TransportError::NoDevice(format!(
                "{} inlines only {} bytes; signal records need {}",
                nic.nic.name,
                attr.inline_buf_size,
                SignalRecord::BYTES
            )));
        }
        let sq_depth = config.sq_depth.min(attr.max_sq_wr.max(1));
        let recv_depth = config.recv_depth.min(attr.max_rq_wr.max(1));
        let pd = Pd::new(&ctx)?;
        let cq = Cq::new(&ctx, (sq_depth + recv_depth) * config.lanes as u32)?;
        let mut qps = Vec::with_capacity(config.lanes);
        let mut psns = Vec::with_capacity(config.lanes);
        for lane in 0..config.lanes {
            // SAFETY: plain data; zero is valid.
            let mut a: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
            a.send_cq = cq.cq;
            a.recv_cq = cq.cq;
            a.cap.max_send_wr = sq_depth;
            a.cap.max_recv_wr = recv_depth;
            a.cap.max_send_sge = 1;
            a.cap.max_recv_sge = 1;
            a.cap.max_inline_data = SignalRecord::BYTES as u32;
            a.qp_type = ibv_qp_type::IBV_QPT_DRIVER;
            a.comp_mask =
                ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0;
            a.pd = pd.pd;
            a.send_ops_flags = u64::from(
                ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0
                    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM.0
                    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND.0
                    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND_WITH_IMM.0,
            );
            let mut e = EfadvQpInitAttr {
                driver_qp_type: EFADV_QP_DRIVER_TYPE_SRD,
                ..Default::default()
            };
            // SAFETY: live context, valid attributes.
            let raw = unsafe {
                (dv.efadv_create_qp_ex)(ctx.ctx, &mut a, &mut e, std::mem::size_of::<EfadvQpInitAttr>() as u32)
            };
            if raw.is_null() {
                return Err(TransportError::Verbs {
                    call: "efadv_create_qp_ex",
                    detail: errno(),
                });
            }
            // SAFETY: created just now on `pd` with `cq`.
            let qp = unsafe { Qp::from_raw(&pd, &cq, raw) };
            let psn = initial_psn(setup.topology.rank(), 0, lane);
            // SAFETY: plain data; zero is valid.
            let mut s: ibv_qp_attr = unsafe { std::mem::zeroed() };
            s.qp_state = ibv_qp_state::IBV_QPS_INIT;
            s.port_num = nic.port;
            s.qkey = config.qkey;
            qp.modify(
                &mut s,
                ibv_qp_attr_mask::IBV_QP_STATE.0
                    | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
                    | ibv_qp_attr_mask::IBV_QP_PORT.0
                    | ibv_qp_attr_mask::IBV_QP_QKEY.0,
                "SRD RESET->INIT",
            )?;
            s.qp_state = ibv_qp_state::IBV_QPS_RTR;
            qp.modify(&mut s, ibv_qp_attr_mask::IBV_QP_STATE.0, "SRD INIT->RTR")?;
            s.qp_state = ibv_qp_state::IBV_QPS_RTS;
            s.sq_psn = psn;
            let mut m = ibv_qp_attr_mask::IBV_QP_STATE.0 | ibv_qp_attr_mask::IBV_QP_SQ_PSN.0;
            if attr.device_caps & EFADV_CAPS_RNR_RETRY != 0 {
                s.rnr_retry = 7;
                m |= ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0;
            }
            qp.modify(&mut s, m, "SRD RTR->RTS")?;
            qps.push(qp);
            psns.push(psn);
        }
        let data = Mr::register(&pd, setup.data)?;
        let mut recv_buf = vec![[0u8; SignalRecord::BYTES]; recv_depth as usize * config.lanes];
        let recv_mr = Mr::register(
            &pd,
            MemSource::Addr {
                addr: recv_buf.as_mut_ptr() as u64,
                len: (recv_buf.len() * SignalRecord::BYTES) as u64,
            },
        )?;
        let world = setup.topology.world_size();
        let is_peer = (0..world).map(|r| setup.topology.is_proxy_peer(r)).collect();
        let max_msg = if attr.max_rdma_size > 0 {
            u64::from(attr.max_rdma_size)
        } else {
            1 << 30
        };
        let mut ep = SrdEndpoint {
            me: setup.topology.rank(),
            world,
            ctx,
            pd,
            cq,
            qps,
            psns,
            data,
            recv_buf,
            recv_mr,
            peers: (0..world).map(|_| None).collect(),
            is_peer,
            flag_bytes: setup.flags.len(),
            max_msg,
            config: SrdConfig {
                sq_depth,
                recv_depth,
                ..config
            },
            nic,
        };
        for lane in 0..ep.qps.len() {
            for i in 0..recv_depth as usize {
                ep.post_recv(lane, lane * recv_depth as usize + i)?;
            }
        }
        Ok(ep)
    }

    fn post_recv(&mut self, lane: usize, buf: usize) -> Result<(), TransportError> {
        let addr = self
            .recv_buf
            .get_mut(buf)
            .map(|b| b.as_mut_ptr() as u64)
            .ok_or_else(|| TransportError::Config(format!("receive buffer {buf} out of range")))?;
        let mut sge = ibv_sge {
            addr,
            length: SignalRecord::BYTES as u32,
            lkey: self.recv_mr.lkey,
        };
        let mut wr = ibv_recv_wr {
            wr_id: buf as u64,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        let qp = self
            .qps
            .get(lane)
            .ok_or_else(|| TransportError::Config(format!("no lane {lane}")))?;
        // SAFETY: live QP; the request and its SGE live across the call; the buffer is registered.
        let rc = unsafe { post_recv(qp.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(TransportError::Verbs {
                call: "ibv_post_recv",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    /// The NIC in use.
    pub fn nic(&self) -> &NicChoice {
        &self.nic
    }

    /// The blob to publish under [`ConnBlob::store_key`]`(Srd, me, peer)` (the same for every
    /// peer: SRD queue pairs are not per peer).
    pub fn local_blob(&self, peer: usize) -> Result<Vec<u8>, TransportError> {
        if !self.is_peer.get(peer).copied().unwrap_or(false) {
            return Err(TransportError::Peer {
                peer,
                detail: "not a proxy peer of this rank".into(),
            });
        }
        Ok(ConnBlob {
            kind: BlobKind::Srd,
            rank: self.me as u32,
            peer: peer as u32,
            lid: 0,
            gid: self.ctx.gid,
            mtu: self.ctx.active_mtu.clamp(1, 5),
            data: RemoteMem {
                addr: self.data.addr,
                len: self.data.len,
                rkey: self.data.rkey,
            },
            flags: RemoteMem::default(),
            qps: self
                .qps
                .iter()
                .zip(&self.psns)
                .map(|(q, &psn)| QpAddr {
                    qpn: q.qpn(),
                    psn,
                    qkey: self.config.qkey,
                })
                .collect(),
        }
        .to_bytes())
    }

    /// Records `peer`'s blob and creates its address handle.
    pub fn connect(&mut self, peer: usize, remote_blob: &[u8]) -> Result<(), TransportError> {
        let b = ConnBlob::from_bytes(remote_blob)?;
        if !self.is_peer.get(peer).copied().unwrap_or(false)
            || b.kind != BlobKind::Srd
            || b.rank as usize != peer
            || b.peer as usize != self.me
            || b.qps.len() != self.qps.len()
        {
            return Err(TransportError::Blob(format!(
                "blob {:?} from {} for {} with {} QPs does not fit peer {peer} of rank {} ({} QPs)",
                b.kind,
                b.rank,
                b.peer,
                b.qps.len(),
                self.me,
                self.qps.len()
            )));
        }
        // SAFETY: plain data; zero is valid.
        let mut a: ibv_ah_attr = unsafe { std::mem::zeroed() };
        a.is_global = 1;
        a.grh.dgid.raw = b.gid;
        a.grh.sgid_index = self.ctx.gid_index as u8;
        a.port_num = self.ctx.port;
        // SAFETY: live PD, valid attributes.
        let ah = unsafe { (self.ctx.v.ibv_create_ah)(self.pd.pd, &mut a) };
        if ah.is_null() {
            return Err(TransportError::Verbs {
                call: "ibv_create_ah",
                detail: format!("peer {peer}: {}", errno()),
            });
        }
        if let Some(slot) = self.peers.get_mut(peer) {
            *slot = Some(Peer {
                ah: Ah {
                    v_destroy: self.ctx.v.ibv_destroy_ah,
                    ah,
                },
                qps: b.qps,
                data: b.data,
            });
        }
        Ok(())
    }

    /// The transport, once every peer is connected; flags from peers are raised through `sink`.
    pub fn into_transport(self, sink: Box<dyn FlagSink>) -> Result<SrdTransport, TransportError> {
        if let Some(p) = (0..self.world).find(|&r| self.is_peer[r] && self.peers[r].is_none()) {
            return Err(TransportError::Peer {
                peer: p,
                detail: "not connected (call connect with its blob)".into(),
            });
        }
        let qpx = self
            .qps
            .iter()
            .map(|q| {
                let to_ex = self.ctx.v.ibv_qp_to_qp_ex.ok_or_else(|| TransportError::Verbs {
                    call: "ibv_qp_to_qp_ex",
                    detail: "missing from libibverbs (rdma-core too old)".into(),
                })?;
                // SAFETY: live QP created with send_ops_flags.
                let x = unsafe { to_ex(q.qp) };
                if x.is_null() {
                    Err(TransportError::Verbs {
                        call: "ibv_qp_to_qp_ex",
                        detail: errno(),
                    })
                } else {
                    Ok(x)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let planner = SrdPlanner::new(self.me, self.world, self.qps.len(), self.max_msg)?;
        let tracker = RecvTracker::new(&self.is_peer, self.flag_bytes);
        let local = LocalMem {
            addr: self.data.addr,
            len: self.data.len,
            lkey: self.data.lkey,
        };
        // SAFETY: ibv_wc is plain data; zero is valid.
        let wc = (0..32).map(|_| unsafe { std::mem::zeroed::<ibv_wc>() }).collect();
        let lanes = self.qps.len();
        Ok(SrdTransport {
            ep: self,
            qpx,
            planner,
            tracker,
            sink,
            local,
            done: Vec::new(),
            wc,
            in_flight: vec![0; lanes],
        })
    }
}

/// The SRD [`Transport`].
pub struct SrdTransport {
    ep: SrdEndpoint,
    qpx: Vec<*mut ibv_qp_ex>,
    planner: SrdPlanner,
    tracker: RecvTracker,
    sink: Box<dyn FlagSink>,
    local: LocalMem,
    done: Vec<u64>,
    wc: Vec<ibv_wc>,
    in_flight: Vec<u32>,
}

// SAFETY: verbs objects are used by one thread at a time.
unsafe impl Send for SrdTransport {}

impl SrdTransport {
    fn poll_cq(&mut self) -> Result<usize, TransportError> {
        // SAFETY: live CQ; `wc` has 32 entries.
        let n = unsafe { poll_cq(self.ep.cq.cq, self.wc.len() as i32, self.wc.as_mut_ptr()) };
        if n < 0 {
            return Err(TransportError::Verbs {
                call: "ibv_poll_cq",
                detail: std::io::Error::from_raw_os_error(-n).to_string(),
            });
        }
        for i in 0..n as usize {
            let w = &self.wc[i];
            let (id, status, opcode, flags, qp_num) = (w.wr_id, w.status, w.opcode, w.wc_flags, w.qp_num);
            // SAFETY: the union holds imm_data when IBV_WC_WITH_IMM is set (checked below).
            let imm = unsafe { w.imm_data_invalidated_rkey_union.imm_data };
            if status != ibv_wc_status::IBV_WC_SUCCESS {
                return Err(TransportError::Completion {
                    peer: format!("qp {qp_num}"),
                    detail: format!(
                        "{} (vendor error {:#x})",
                        self.ep.ctx.v.status_str(status),
                        w.vendor_err
                    ),
                });
            }
            if opcode & ibv_wc_opcode::IBV_WC_RECV != 0 {
                if flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 == 0 {
                    return Err(TransportError::Completion {
                        peer: format!("qp {qp_num}"),
                        detail: "receive without immediate".into(),
                    });
                }
                let decoded = Imm::from_wire(imm)?;
                let buf = id as usize;
                let payload = if opcode == ibv_wc_opcode::IBV_WC_RECV {
                    self.ep.recv_buf.get(buf).copied()
                } else {
                    None
                };
                self.tracker.on_completion(
                    decoded,
                    payload.as_ref().map_or(&[][..], |p| &p[..]),
                    self.sink.as_mut(),
                )?;
                let lane = self
                    .ep
                    .qps
                    .iter()
                    .position(|q| q.qpn() == qp_num)
                    .unwrap_or(buf / self.ep.config.recv_depth.max(1) as usize);
                self.ep.post_recv(lane, buf)?;
            } else {
                match self.planner.complete(id) {
                    Some(Some(seq)) => self.done.push(seq),
                    Some(None) => {}
                    None => {
                        return Err(TransportError::Completion {
                            peer: format!("qp {qp_num}"),
                            detail: format!("unknown wr_id {id}"),
                        })
                    }
                }
                if let Some(lane) = self.ep.qps.iter().position(|q| q.qpn() == qp_num) {
                    self.in_flight[lane] = self.in_flight[lane].saturating_sub(1);
                }
            }
        }
        Ok(n as usize)
    }

    fn post_one(&mut self, dst: usize, wr: &SrdWr) -> Result<(), TransportError> {
        let lane = match *wr {
            SrdWr::WriteImm { lane, .. } | SrdWr::SendImm { lane, .. } => lane,
        };
        let t0 = Instant::now();
        while self.in_flight.get(lane).copied().unwrap_or(0) >= self.ep.config.sq_depth {
            if self.poll_cq()? == 0 && t0.elapsed() > self.ep.config.wait_timeout {
                return Err(TransportError::Completion {
                    peer: format!("lane {lane}"),
                    detail: "send queue stayed full".into(),
                });
            }
        }
        let peer = self
            .ep
            .peers
            .get(dst)
            .and_then(Option::as_ref)
            .ok_or_else(|| TransportError::not_connected(dst))?;
        let (&qpx, remote) = self
            .qpx
            .get(lane)
            .zip(peer.qps.get(lane))
            .ok_or_else(|| TransportError::Peer {
                peer: dst,
                detail: format!("no lane {lane}"),
            })?;
        // SAFETY: `qpx` is the extended view of a live SRD QP; the ops were enabled at creation;
        // the inline record is copied during the call.
        unsafe {
            let x = &mut *qpx;
            let (Some(start), Some(complete), Some(set_ud)) = (x.wr_start, x.wr_complete, x.wr_set_ud_addr) else {
                return Err(TransportError::Verbs {
                    call: "ibv_wr_start",
                    detail: "extended QP ops missing".into(),
                });
            };
            start(x);
            x.wr_id = wr.wr_id();
            x.wr_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            match *wr {
                SrdWr::WriteImm {
                    addr,
                    length,
                    lkey,
                    remote_addr,
                    rkey,
                    imm,
                    ..
                } => {
                    let (Some(op), Some(sge)) = (x.wr_rdma_write_imm, x.wr_set_sge) else {
                        return Err(TransportError::Verbs {
                            call: "ibv_wr_rdma_write_imm",
                            detail: "not supported by this QP".into(),
                        });
                    };
                    op(x, rkey, remote_addr, Imm::decode(imm)?.to_wire());
                    set_ud(x, peer.ah.ah, remote.qpn, remote.qkey);
                    sge(x, lkey, addr, length);
                }
                SrdWr::SendImm { record, imm, .. } => {
                    let (Some(op), Some(inline)) = (x.wr_send_imm, x.wr_set_inline_data) else {
                        return Err(TransportError::Verbs {
                            call: "ibv_wr_send_imm",
                            detail: "not supported by this QP".into(),
                        });
                    };
                    x.wr_flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                    op(x, Imm::decode(imm)?.to_wire());
                    set_ud(x, peer.ah.ah, remote.qpn, remote.qkey);
                    let mut bytes = record.to_bytes();
                    inline(x, bytes.as_mut_ptr().cast(), bytes.len());
                }
            }
            let rc = complete(x);
            if rc != 0 {
                return Err(TransportError::Verbs {
                    call: "ibv_wr_complete",
                    detail: format!("peer {dst} lane {lane}: {}", std::io::Error::from_raw_os_error(rc)),
                });
            }
        }
        if let Some(f) = self.in_flight.get_mut(lane) {
            *f += 1;
        }
        Ok(())
    }
}

impl Transport for SrdTransport {
    fn name(&self) -> &'static str {
        "efa-srd"
    }

    fn post(&mut self, dst: usize, ops: &[Op]) -> Result<(), TransportError> {
        let data = self
            .ep
            .peers
            .get(dst)
            .and_then(Option::as_ref)
            .map(|p| p.data)
            .ok_or_else(|| TransportError::not_connected(dst))?;
        let (wrs, instant) = self.planner.plan(dst, ops, self.local, data)?;
        self.done.extend(instant);
        for wr in &wrs {
            self.post_one(dst, wr)?;
        }
        Ok(())
    }

    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        self.poll_cq()?;
        completed.append(&mut self.done);
        Ok(())
    }

    fn flush(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        let t0 = Instant::now();
        loop {
            self.poll(completed)?;
            if self.planner.outstanding() == 0 {
                return Ok(());
            }
            if t0.elapsed() > self.ep.config.wait_timeout {
                return Err(TransportError::Completion {
                    peer: "flush".into(),
                    detail: format!(
                        "{} requests outstanding after {:?}",
                        self.planner.outstanding(),
                        self.ep.config.wait_timeout
                    ),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ibverbs::sysfs::tests::TempDir;
    use crate::topology::Topology;

    #[test]
    fn opening_without_an_efa_device_is_a_clear_error() {
        let t = TempDir::new("srd-open");
        let mut setup = NetSetup::new(
            Topology::new(2, 1, 1).unwrap(),
            MemSource::Addr { addr: 0x1000, len: 64 },
            MemSource::Addr { addr: 0x2000, len: 64 },
            None,
        );
        setup.sysfs_root = t.0.clone();
        setup.force_device = None;
        let e = SrdEndpoint::open(&setup, SrdConfig::default()).err().unwrap();
        assert!(e.to_string().starts_with("no RDMA device found"), "{e}");
    }
}
