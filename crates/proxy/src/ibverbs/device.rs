//! Owned verbs objects (device context, protection domain, memory region, completion queue,
//! queue pair) that release themselves on drop, children before parents.
use super::dl::{errno, verbs, Verbs};
use crate::error::TransportError;
use libc::c_int;
use rdma_sys::{
    ibv_access_flags, ibv_context, ibv_cq, ibv_gid, ibv_mr, ibv_pd, ibv_port_attr, ibv_port_state, ibv_qp, ibv_qp_attr,
    ibv_qp_init_attr,
};
use std::sync::Arc;

/// `IBV_LINK_LAYER_ETHERNET` (RoCE) from verbs.h (an anonymous enum that bindgen skips).
pub const LINK_LAYER_ETHERNET: u8 = 2;

/// An open device and the port used on it.
pub struct Context {
    pub(crate) v: &'static Verbs,
    pub(crate) ctx: *mut ibv_context,
    /// Device name.
    pub name: String,
    /// Port number.
    pub port: u8,
    /// Port LID (0 on RoCE / EFA).
    pub lid: u16,
    /// Active MTU as an `ibv_mtu` value.
    pub active_mtu: u8,
    /// `IBV_LINK_LAYER_*`.
    pub link_layer: u8,
    /// GID used for addressing.
    pub gid: [u8; 16],
    /// Its index.
    pub gid_index: u32,
}

// SAFETY: verbs objects may be used from any thread (libibverbs is thread-safe); this crate
// uses each from one thread at a time.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Opens device `name`, checks that `port` is ACTIVE, reads LID, MTU, link layer and the GID
    /// at `gid_index`.
    pub fn open(name: &str, port: u8, gid_index: u32) -> Result<Arc<Context>, TransportError> {
        let v = verbs()?;
        let ctx = v.open(name)?;
        // SAFETY: ibv_port_attr is plain data; zero is a valid start.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        let mut c = Context {
            v,
            ctx,
            name: name.to_string(),
            port,
            lid: 0,
            active_mtu: 0,
            link_layer: 0,
            gid: [0; 16],
            gid_index,
        };
        // SAFETY: live context; the compat struct is a prefix of ibv_port_attr.
        if unsafe { (v.ibv_query_port)(ctx, port, (&mut attr as *mut ibv_port_attr).cast()) } != 0 {
            return Err(TransportError::Verbs {
                call: "ibv_query_port",
                detail: format!("{name} port {port}: {}", errno()),
            });
        }
        if attr.state != ibv_port_state::IBV_PORT_ACTIVE {
            return Err(TransportError::NoDevice(format!(
                "{name} port {port} is not ACTIVE (state {})",
                attr.state
            )));
        }
        c.lid = attr.lid;
        c.active_mtu = attr.active_mtu as u8;
        c.link_layer = attr.link_layer;
        // SAFETY: ibv_gid is 16 plain bytes.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        if unsafe { (v.ibv_query_gid)(ctx, port, gid_index as c_int, &mut gid) } != 0 {
            return Err(TransportError::Verbs {
                call: "ibv_query_gid",
                detail: format!("{name} port {port} index {gid_index}: {}", errno()),
            });
        }
        // SAFETY: every bit pattern is a valid `raw`.
        c.gid = unsafe { gid.raw };
        Ok(Arc::new(c))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened in `open`; children hold Arcs, so they are gone.
        unsafe { (self.v.ibv_close_device)(self.ctx) };
    }
}

/// A protection domain.
pub struct Pd {
    pub(crate) ctx: Arc<Context>,
    pub(crate) pd: *mut ibv_pd,
}
// SAFETY: see Context.
unsafe impl Send for Pd {}
// SAFETY: see Context.
unsafe impl Sync for Pd {}

impl Pd {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Pd>, TransportError> {
        // SAFETY: live context.
        let pd = unsafe { (ctx.v.ibv_alloc_pd)(ctx.ctx) };
        if pd.is_null() {
            return Err(TransportError::Verbs {
                call: "ibv_alloc_pd",
                detail: errno(),
            });
        }
        Ok(Arc::new(Pd { ctx: ctx.clone(), pd }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`; dependents hold Arcs.
        unsafe { (self.ctx.v.ibv_dealloc_pd)(self.pd) };
    }
}

/// Memory to register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemSource {
    /// Memory at a virtual address (host memory; GPU memory only with nvidia-peermem).
    Addr {
        /// Address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// GPU memory exported as a dma-buf (`cuMemGetHandleForAddressRange`), registered with
    /// `ibv_reg_dmabuf_mr`; if that is unavailable or fails, registration by address is tried.
    DmaBuf {
        /// The dma-buf file descriptor (owned by the caller, may be closed after registration).
        fd: i32,
        /// Offset of the region in the dma-buf.
        offset: u64,
        /// Length.
        len: u64,
        /// The region's device virtual address (used as IOVA, so remote addresses are the
        /// same as with address registration).
        addr: u64,
    },
}

impl MemSource {
    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        match *self {
            MemSource::Addr { addr, .. } | MemSource::DmaBuf { addr, .. } => addr,
        }
    }
    /// Length.
    pub fn len(&self) -> u64 {
        match *self {
            MemSource::Addr { len, .. } | MemSource::DmaBuf { len, .. } => len,
        }
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How a region ended up registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegMethod {
    /// `ibv_reg_dmabuf_mr`.
    DmaBuf,
    /// `ibv_reg_mr`.
    Addr,
}

/// A registered memory region.
pub struct Mr {
    _pd: Arc<Pd>,
    pub(crate) mr: *mut ibv_mr,
    /// Address (IOVA) of the first byte.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
    /// How it was registered.
    pub method: RegMethod,
}
// SAFETY: see Context.
unsafe impl Send for Mr {}
// SAFETY: see Context.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `src` for local write and remote write/read.
    pub fn register(pd: &Arc<Pd>, src: MemSource) -> Result<Mr, TransportError> {
        let v = pd.ctx.v;
        let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0) as c_int;
        let len =
            usize::try_from(src.len()).map_err(|_| TransportError::Config("region length overflows usize".into()))?;
        let mut dmabuf_error = None;
        if let (MemSource::DmaBuf { fd, offset, addr, .. }, Some(reg)) = (src, v.ibv_reg_dmabuf_mr) {
            // SAFETY: live PD; the caller owns `fd`.
            let mr = unsafe { reg(pd.pd, offset, len, addr, fd, access) };
            if !mr.is_null() {
                return Ok(Self::wrap(pd, mr, src, RegMethod::DmaBuf));
            }
            dmabuf_error = Some(errno());
        }
        // SAFETY: live PD; the memory is owned by the caller for the MR's lifetime.
        let mr = unsafe { (v.ibv_reg_mr)(pd.pd, src.addr() as *mut libc::c_void, len, access) };
        if mr.is_null() {
            let mut detail = format!("{} bytes at {:#x}: {}", src.len(), src.addr(), errno());
            if let Some(e) = dmabuf_error {
                detail.push_str(&format!(" (ibv_reg_dmabuf_mr failed first: {e})"));
            }
            return Err(TransportError::Verbs {
                call: "ibv_reg_mr",
                detail,
            });
        }
        Ok(Self::wrap(pd, mr, src, RegMethod::Addr))
    }

    fn wrap(pd: &Arc<Pd>, mr: *mut ibv_mr, src: MemSource, method: RegMethod) -> Mr {
        // SAFETY: a non-null MR returned by libibverbs.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Mr {
            _pd: pd.clone(),
            mr,
            addr: src.addr(),
            len: src.len(),
            lkey,
            rkey,
            method,
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`.
        unsafe { (self._pd.ctx.v.ibv_dereg_mr)(self.mr) };
    }
}

/// A completion queue.
pub struct Cq {
    pub(crate) ctx: Arc<Context>,
    pub(crate) cq: *mut ibv_cq,
}
// SAFETY: see Context.
unsafe impl Send for Cq {}
// SAFETY: see Context.
unsafe impl Sync for Cq {}

impl Cq {
    /// A completion queue of at least `depth` entries.
    pub fn new(ctx: &Arc<Context>, depth: u32) -> Result<Arc<Cq>, TransportError> {
        // SAFETY: live context; no channel.
        let cq = unsafe {
            (ctx.v.ibv_create_cq)(
                ctx.ctx,
                depth.min(i32::MAX as u32) as c_int,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(TransportError::Verbs {
                call: "ibv_create_cq",
                detail: format!("depth {depth}: {}", errno()),
            });
        }
        Ok(Arc::new(Cq { ctx: ctx.clone(), cq }))
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created in `new`; QPs using it hold Arcs.
        unsafe { (self.ctx.v.ibv_destroy_cq)(self.cq) };
    }
}

/// A queue pair.
pub struct Qp {
    pub(crate) pd: Arc<Pd>,
    _cq: Arc<Cq>,
    pub(crate) qp: *mut ibv_qp,
}
// SAFETY: see Context.
unsafe impl Send for Qp {}
// SAFETY: see Context.
unsafe impl Sync for Qp {}

impl Qp {
    /// Creates a queue pair from `attr` (its CQ pointers are set to `cq`).
    pub fn new(pd: &Arc<Pd>, cq: &Arc<Cq>, mut attr: ibv_qp_init_attr) -> Result<Qp, TransportError> {
        attr.send_cq = cq.cq;
        attr.recv_cq = cq.cq;
        // SAFETY: live PD and CQ; valid attributes.
        let qp = unsafe { (pd.ctx.v.ibv_create_qp)(pd.pd, &mut attr) };
        if qp.is_null() {
            return Err(TransportError::Verbs {
                call: "ibv_create_qp",
                detail: errno(),
            });
        }
        Ok(Qp {
            pd: pd.clone(),
            _cq: cq.clone(),
            qp,
        })
    }

    /// Wraps a queue pair created elsewhere (e.g. by `efadv_create_qp_ex`).
    ///
    /// # Safety
    /// `qp` must be a live queue pair created on `pd` with `cq`, owned by nobody else.
    pub unsafe fn from_raw(pd: &Arc<Pd>, cq: &Arc<Cq>, qp: *mut ibv_qp) -> Qp {
        Qp {
            pd: pd.clone(),
            _cq: cq.clone(),
            qp,
        }
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.qp).qp_num }
    }

    /// `ibv_modify_qp` with `attr` and `mask`.
    pub fn modify(&self, attr: &mut ibv_qp_attr, mask: u32, what: &str) -> Result<(), TransportError> {
        // SAFETY: live QP, valid attributes.
        let rc = unsafe { (self.pd.ctx.v.ibv_modify_qp)(self.qp, attr, mask as c_int) };
        if rc != 0 {
            return Err(TransportError::Verbs {
                call: "ibv_modify_qp",
                detail: format!("{what}: {}", std::io::Error::from_raw_os_error(rc)),
            });
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `new`.
        unsafe { (self.pd.ctx.v.ibv_destroy_qp)(self.qp) };
    }
}
