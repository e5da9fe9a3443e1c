//! The RC backend: open the NIC nearest the GPU, register the data region and flag array,
//! create queue pairs per peer, exchange blobs, then post planned work requests.
use super::blob::{BlobKind, ConnBlob, QpAddr, RemoteMem};
use super::config::RcConfig;
use super::device::{Context, Cq, MemSource, Mr, Pd, Qp, LINK_LAYER_ETHERNET};
use super::dl::{poll_cq, post_send};
use super::plan::{split_wr_id, LocalMem, PeerPlanner, Step, WrDesc};
use super::sysfs::{choose_gid_index, choose_nic, gpu_location, list_nics, NicChoice, NicKind};
use super::wr::SendChain;
use crate::error::TransportError;
use crate::topology::Topology;
use crate::transport::{Op, Transport};
use rdma_sys::{
    ibv_access_flags, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_wc, ibv_wc_status,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Where the NIC search looks and what it registers.
#[derive(Clone, Debug)]
pub struct NetSetup {
    /// Job shape and this rank.
    pub topology: Topology,
    /// The data region (source of puts, target of peers' puts).
    pub data: MemSource,
    /// The flag array peers write into.
    pub flags: MemSource,
    /// The GPU's PCI bus id (`cuDeviceGetPCIBusId`), for NIC locality.
    pub gpu_bus_id: Option<String>,
    /// sysfs root (`/sys`).
    pub sysfs_root: PathBuf,
    /// Device name to use regardless of locality (`MKERNEL_NET_DEVICE`, `name[:port]`).
    pub force_device: Option<String>,
}

impl NetSetup {
    /// A setup with `/sys` and `MKERNEL_NET_DEVICE` from the environment.
    pub fn new(topology: Topology, data: MemSource, flags: MemSource, gpu_bus_id: Option<String>) -> NetSetup {
        NetSetup {
            topology,
            data,
            flags,
            gpu_bus_id,
            sysfs_root: PathBuf::from("/sys"),
            force_device: std::env::var("MKERNEL_NET_DEVICE").ok(),
        }
    }

    /// Chooses the NIC for this rank from sysfs.
    pub fn choose_nic(&self) -> Result<NicChoice, TransportError> {
        let nics = list_nics(&self.sysfs_root)?;
        if nics.is_empty() {
            return Err(TransportError::NoDevice(format!(
                "nothing under {}/class/infiniband",
                self.sysfs_root.display()
            )));
        }
        let gpu = self
            .gpu_bus_id
            .as_deref()
            .and_then(|b| gpu_location(&self.sysfs_root, b).ok());
        choose_nic(
            &nics,
            gpu.as_ref(),
            self.topology.local_rank(),
            self.force_device.as_deref(),
        )
    }
}

/// A 24-bit initial packet sequence number, different per (rank, peer, lane) and run.
pub(crate) fn initial_psn(rank: usize, peer: usize, lane: usize) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    let x = (rank as u64).wrapping_mul(0x9e37_79b9)
        ^ (peer as u64).wrapping_mul(0x85eb_ca6b)
        ^ (lane as u64).wrapping_mul(0xc2b2_ae35)
        ^ t;
    (x ^ (x >> 24) ^ (x >> 48)) as u32 & 0xff_ffff
}

struct Conn {
    rank: usize,
    qps: Vec<Qp>,
    psns: Vec<u32>,
    planner: PeerPlanner,
    remote: Option<(RemoteMem, RemoteMem)>,
}

/// An RC endpoint being connected: resources exist, queue pairs wait for peers' blobs.
pub struct RcEndpoint {
    me: usize,
    ctx: Arc<Context>,
    cq: Arc<Cq>,
    data: Mr,
    flags: Mr,
    conns: Vec<Conn>,
    slot_of: Vec<Option<usize>>,
    config: RcConfig,
    nic: NicChoice,
}

impl RcEndpoint {
    /// Opens the NIC chosen for this GPU, registers memory, creates and initializes queue
    /// pairs for every proxy peer of the topology.
    pub fn open(setup: &NetSetup, config: RcConfig) -> Result<RcEndpoint, TransportError> {
        config.check()?;
        let nic = setup.choose_nic()?;
        if nic.nic.kind == NicKind::Efa {
            return Err(TransportError::Config(format!(
                "{} is an EFA device: use the efa backend",
                nic.nic.name
            )));
        }
        let roce = nic
            .nic
            .ports
            .iter()
            .find(|p| p.num == nic.port)
            .is_some_and(|p| p.link_layer == "Ethernet");
        let gid_index = config.gid_index.unwrap_or_else(|| {
            if roce {
                choose_gid_index(&setup.sysfs_root, &nic.nic.name, nic.port)
            } else {
                0
            }
        });
        let ctx = Context::open(&nic.nic.name, nic.port, gid_index)?;
        let pd = Pd::new(&ctx)?;
        let peers = setup.topology.proxy_peers();
        if peers.len() > usize::from(u16::MAX) {
            return Err(TransportError::Config(format!(
                "{} peers exceed the 16-bit peer slot",
                peers.len()
            )));
        }
        let signalled_per_qp = config.sq_depth / config.signal_every + 4;
        let cq = Cq::new(&ctx, (peers.len() * config.qps_per_peer) as u32 * signalled_per_qp + 64)?;
        let data = Mr::register(&pd, setup.data)?;
        let flags = Mr::register(&pd, setup.flags)?;
        let me = setup.topology.rank();
        let mut slot_of = vec![None; setup.topology.world_size()];
        let mut conns = Vec::with_capacity(peers.len());
        for (slot, &peer) in peers.iter().enumerate() {
            let mut qps = Vec::with_capacity(config.qps_per_peer);
            let mut psns = Vec::with_capacity(config.qps_per_peer);
            for lane in 0..config.qps_per_peer {
                // SAFETY: plain data; zero is valid.
                let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
                a.qp_type = ibv_qp_type::IBV_QPT_RC;
                a.sq_sig_all = 0;
                a.cap.max_send_wr = config.sq_depth;
                a.cap.max_recv_wr = 1;
                a.cap.max_send_sge = 1;
                a.cap.max_recv_sge = 1;
                a.cap.max_inline_data = 64;
                let qp = Qp::new(&pd, &cq, a)?;
                // SAFETY: plain data; zero is valid.
                let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
                attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
                attr.pkey_index = 0;
                attr.port_num = nic.port;
                attr.qp_access_flags = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
                    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                    | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
                let m = ibv_qp_attr_mask::IBV_QP_STATE.0
                    | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
                    | ibv_qp_attr_mask::IBV_QP_PORT.0
                    | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
                qp.modify(&mut attr, m, "RESET->INIT")?;
                qps.push(qp);
                psns.push(initial_psn(me, peer, lane));
            }
            slot_of[peer] = Some(slot);
            conns.push(Conn {
                rank: peer,
                qps,
                psns,
                planner: PeerPlanner::new(slot as u16, config.qps_per_peer, config.signal_every, config.max_msg)?,
                remote: None,
            });
        }
        Ok(RcEndpoint {
            me,
            ctx,
            cq,
            data,
            flags,
            conns,
            slot_of,
            config,
            nic,
        })
    }

    /// The NIC in use and why it was chosen.
    pub fn nic(&self) -> &NicChoice {
        &self.nic
    }

    /// Ranks this endpoint connects to.
    pub fn peers(&self) -> Vec<usize> {
        self.conns.iter().map(|c| c.rank).collect()
    }

    fn conn(&self, peer: usize) -> Result<&Conn, TransportError> {
        self.slot_of
            .get(peer)
            .copied()
            .flatten()
            .and_then(|s| self.conns.get(s))
            .ok_or_else(|| TransportError::Peer {
                peer,
                detail: "not a proxy peer of this rank".into(),
            })
    }

    /// The blob to publish under [`ConnBlob::store_key`]`(Rc, me, peer)`.
    pub fn local_blob(&self, peer: usize) -> Result<Vec<u8>, TransportError> {
        let c = self.conn(peer)?;
        let blob = ConnBlob {
            kind: BlobKind::Rc,
            rank: self.me as u32,
            peer: peer as u32,
            lid: self.ctx.lid,
            gid: self.ctx.gid,
            mtu: self.ctx.active_mtu,
            data: RemoteMem {
                addr: self.data.addr,
                len: self.data.len,
                rkey: self.data.rkey,
            },
            flags: RemoteMem {
                addr: self.flags.addr,
                len: self.flags.len,
                rkey: self.flags.rkey,
            },
            qps: c
                .qps
                .iter()
                .zip(&c.psns)
                .map(|(q, &psn)| QpAddr {
                    qpn: q.qpn(),
                    psn,
                    qkey: 0,
                })
                .collect(),
        };
        Ok(blob.to_bytes())
    }

    /// Connects to `peer` with the blob it published for this rank (INIT -> RTR -> RTS).
    pub fn connect(&mut self, peer: usize, remote_blob: &[u8]) -> Result<(), TransportError> {
        let b = ConnBlob::from_bytes(remote_blob)?;
        let slot = self
            .slot_of
            .get(peer)
            .copied()
            .flatten()
            .ok_or_else(|| TransportError::Peer {
                peer,
                detail: "not a proxy peer of this rank".into(),
            })?;
        if b.kind != BlobKind::Rc || b.rank as usize != peer || b.peer as usize != self.me {
            return Err(TransportError::Blob(format!(
                "blob is {:?} from {} for {}, expected Rc from {peer} for {}",
                b.kind, b.rank, b.peer, self.me
            )));
        }
        let c = &self.conns[slot];
        if b.qps.len() != c.qps.len() {
            return Err(TransportError::Blob(format!(
                "peer {peer} has {} queue pairs, this rank {}",
                b.qps.len(),
                c.qps.len()
            )));
        }
        let global = self.ctx.link_layer == LINK_LAYER_ETHERNET || b.lid == 0;
        for (lane, (qp, r)) in c.qps.iter().zip(&b.qps).enumerate() {
            // SAFETY: plain data; zero is valid.
            let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
            a.qp_state = ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = u32::from(self.ctx.active_mtu.min(b.mtu));
            a.dest_qp_num = r.qpn;
            a.rq_psn = r.psn;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = 12;
            a.ah_attr.dlid = b.lid;
            a.ah_attr.sl = self.config.service_level;
            a.ah_attr.port_num = self.ctx.port;
            if global {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = b.gid;
                a.ah_attr.grh.sgid_index = self.ctx.gid_index as u8;
                a.ah_attr.grh.hop_limit = 255;
                a.ah_attr.grh.traffic_class = self.config.traffic_class;
            }
            let m = ibv_qp_attr_mask::IBV_QP_STATE.0
                | ibv_qp_attr_mask::IBV_QP_AV.0
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU.0
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN.0
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN.0
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0;
            qp.modify(&mut a, m, &format!("peer {peer} lane {lane} INIT->RTR"))?;
            // SAFETY: plain data; zero is valid.
            let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
            a.qp_state = ibv_qp_state::IBV_QPS_RTS;
            a.sq_psn = c.psns[lane];
            a.timeout = self.config.ack_timeout;
            a.retry_cnt = self.config.retry_cnt;
            a.rnr_retry = 7;
            a.max_rd_atomic = 1;
            let m = ibv_qp_attr_mask::IBV_QP_STATE.0
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT.0
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN.0
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0;
            qp.modify(&mut a, m, &format!("peer {peer} lane {lane} RTR->RTS"))?;
        }
        self.conns[slot].remote = Some((b.data, b.flags));
        Ok(())
    }

    /// The transport, once every peer is connected.
    pub fn into_transport(self) -> Result<RcTransport, TransportError> {
        if let Some(c) = self.conns.iter().find(|c| c.remote.is_none()) {
            return Err(TransportError::Peer {
                peer: c.rank,
                detail: "not connected (call connect with its blob)".into(),
            });
        }
        let local = LocalMem {
            addr: self.data.addr,
            len: self.data.len,
            lkey: self.data.lkey,
        };
        // SAFETY: ibv_wc is plain data; zero is valid.
        let wc = (0..32).map(|_| unsafe { std::mem::zeroed::<ibv_wc>() }).collect();
        Ok(RcTransport {
            ep: self,
            local,
            done: Vec::new(),
            wc,
            last_post: Instant::now(),
        })
    }
}

/// The RC [`Transport`]: RDMA write of the data, then an inline RDMA write of the flag on the
/// same queue pair.
pub struct RcTransport {
    ep: RcEndpoint,
    local: LocalMem,
    done: Vec<u64>,
    wc: Vec<ibv_wc>,
    last_post: Instant,
}

// SAFETY: all verbs objects are owned and used by one thread at a time.
unsafe impl Send for RcTransport {}

impl RcTransport {
    /// The NIC in use.
    pub fn nic(&self) -> &NicChoice {
        &self.ep.nic
    }

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
            let (id, status, vendor) = (self.wc[i].wr_id, self.wc[i].status, self.wc[i].vendor_err);
            let (slot, lane, index) = split_wr_id(id);
            let Some(c) = self.ep.conns.get_mut(slot as usize) else {
                return Err(TransportError::Completion {
                    peer: format!("slot {slot}"),
                    detail: format!("unknown wr_id {id:#x}"),
                });
            };
            if status != ibv_wc_status::IBV_WC_SUCCESS {
                return Err(TransportError::Completion {
                    peer: format!("rank {} lane {lane}", c.rank),
                    detail: format!("{} (vendor error {vendor:#x})", self.ep.ctx.v.status_str(status)),
                });
            }
            c.planner.complete(lane as usize, index, &mut self.done);
        }
        Ok(n as usize)
    }

    fn wait(&mut self, slot: usize, lane: usize, until: u64) -> Result<(), TransportError> {
        let t0 = Instant::now();
        while self.ep.conns[slot].planner.completed(lane) < until {
            if self.poll_cq()? == 0 {
                if t0.elapsed() > self.ep.config.wait_timeout {
                    return Err(TransportError::Completion {
                        peer: format!("rank {} lane {lane}", self.ep.conns[slot].rank),
                        detail: format!("no completion within {:?}", self.ep.config.wait_timeout),
                    });
                }
                std::hint::spin_loop();
            }
        }
        Ok(())
    }

    fn post_wrs(&mut self, slot: usize, lane: usize, wrs: &[WrDesc]) -> Result<(), TransportError> {
        let max = self.ep.config.max_chain().max(1);
        for piece in wrs.chunks(max) {
            let Some(last) = piece.last() else { continue };
            let end = split_wr_id(last.wr_id).2 + 1;
            self.wait(slot, lane, end.saturating_sub(u64::from(self.ep.config.sq_depth)))?;
            let mut chain = SendChain::new(piece);
            let c = &self.ep.conns[slot];
            let qp = c.qps.get(lane).ok_or_else(|| TransportError::Peer {
                peer: c.rank,
                detail: format!("no lane {lane}"),
            })?;
            let mut bad = std::ptr::null_mut();
            // SAFETY: live RC QP in RTS; the chain outlives the call.
            let rc = unsafe { post_send(qp.qp, chain.head(), &mut bad) };
            if rc != 0 {
                return Err(TransportError::Verbs {
                    call: "ibv_post_send",
                    detail: format!(
                        "rank {} lane {lane}: {} (request {:?} of {})",
                        c.rank,
                        std::io::Error::from_raw_os_error(rc),
                        chain.index_of(bad),
                        piece.len()
                    ),
                });
            }
        }
        Ok(())
    }

    fn probe_idle_lanes(&mut self) -> Result<(), TransportError> {
        for slot in 0..self.ep.conns.len() {
            let c = &mut self.ep.conns[slot];
            let Some((_, flags)) = c.remote else { continue };
            let probes = c.planner.idle_probes(flags);
            self.run(slot, probes)?;
        }
        Ok(())
    }

    fn run(&mut self, slot: usize, steps: Vec<Step>) -> Result<(), TransportError> {
        for s in steps {
            match s {
                Step::Post { lane, wrs } => self.post_wrs(slot, lane, &wrs)?,
                Step::Fence { lane, until } => self.wait(slot, lane, until)?,
            }
        }
        Ok(())
    }
}

impl Transport for RcTransport {
    fn name(&self) -> &'static str {
        "ibverbs-rc"
    }

    fn post(&mut self, dst: usize, ops: &[Op]) -> Result<(), TransportError> {
        let slot = self
            .ep
            .slot_of
            .get(dst)
            .copied()
            .flatten()
            .ok_or_else(|| TransportError::not_connected(dst))?;
        let local = self.local;
        let c = &mut self.ep.conns[slot];
        let (data, flags) = c.remote.ok_or_else(|| TransportError::not_connected(dst))?;
        let plan = c.planner.plan(ops, local, data, flags)?;
        self.done.extend(plan.instant);
        self.last_post = Instant::now();
        self.run(slot, plan.steps)
    }

    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        if self.poll_cq()? == 0 && self.last_post.elapsed() >= self.ep.config.idle_probe_after {
            self.probe_idle_lanes()?;
        }
        completed.append(&mut self.done);
        Ok(())
    }

    fn flush(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        let t0 = Instant::now();
        self.probe_idle_lanes()?;
        loop {
            self.poll(completed)?;
            if self.ep.conns.iter().all(|c| c.planner.outstanding() == 0) {
                return Ok(());
            }
            if t0.elapsed() > self.ep.config.wait_timeout {
                return Err(TransportError::Completion {
                    peer: "flush".into(),
                    detail: format!(
                        "work requests still outstanding after {:?}",
                        self.ep.config.wait_timeout
                    ),
                });
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ibverbs::sysfs::tests::TempDir;

    #[test]
    fn psns_are_24_bit() {
        for r in 0..8 {
            assert!(initial_psn(r, 7, 1) < 1 << 24);
        }
    }

    #[test]
    fn opening_without_a_nic_is_a_clear_error() {
        let t = TempDir::new("rc-open");
        let topo = Topology::new(2, 1, 0).unwrap();
        let mut setup = NetSetup::new(
            topo,
            MemSource::Addr { addr: 0x1000, len: 64 },
            MemSource::Addr { addr: 0x2000, len: 64 },
            None,
        );
        setup.sysfs_root = t.0.clone();
        setup.force_device = None;
        let e = RcEndpoint::open(&setup, RcConfig::default()).err().unwrap();
        assert!(e.to_string().starts_with("no RDMA device found"), "{e}");
        println!("{e}");
    }
}
