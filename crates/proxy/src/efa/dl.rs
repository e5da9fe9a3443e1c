//! The few efadv functions the SRD backend needs, declared here (rdma-sys has no efadv
//! bindings) and resolved at run time from `libefa.so.1` with `libloading`.
use crate::error::TransportError;
use crate::ibverbs::dl::{open_library, table};
use libc::c_int;
use rdma_sys::{ibv_context, ibv_qp, ibv_qp_init_attr_ex};
use std::sync::OnceLock;

/// `EFADV_QP_DRIVER_TYPE_SRD`.
pub const EFADV_QP_DRIVER_TYPE_SRD: u32 = 0;
/// `EFADV_DEVICE_ATTR_CAPS_RNR_RETRY`.
pub const EFADV_CAPS_RNR_RETRY: u32 = 1 << 1;
/// `EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE` (rdma-core 45+; absent from older efadv.h).
pub const EFADV_CAPS_RDMA_WRITE: u32 = 1 << 3;

/// `struct efadv_device_attr` (efadv.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EfadvDeviceAttr {
    /// Extension mask.
    pub comp_mask: u64,
    /// Send queue depth limit.
    pub max_sq_wr: u32,
    /// Receive queue depth limit.
    pub max_rq_wr: u32,
    /// SGEs per send.
    pub max_sq_sge: u16,
    /// SGEs per receive.
    pub max_rq_sge: u16,
    /// Inline bytes.
    pub inline_buf_size: u16,
    /// Reserved.
    pub reserved: [u8; 2],
    /// `EFADV_DEVICE_ATTR_CAPS_*`.
    pub device_caps: u32,
    /// Largest RDMA transfer.
    pub max_rdma_size: u32,
}

/// `struct efadv_qp_init_attr` (efadv.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EfadvQpInitAttr {
    /// Extension mask.
    pub comp_mask: u64,
    /// `EFADV_QP_DRIVER_TYPE_*`.
    pub driver_qp_type: u32,
    /// Reserved (newer headers: flags, sl).
    pub reserved: [u8; 4],
}

const _: () = assert!(std::mem::size_of::<EfadvDeviceAttr>() == 32 && std::mem::size_of::<EfadvQpInitAttr>() == 16);

table! {
    /// libefa entry points.
    pub struct Efadv {
        efadv_query_device: fn(*mut ibv_context, *mut EfadvDeviceAttr, u32) -> c_int;
        efadv_create_qp_ex: fn(*mut ibv_context, *mut ibv_qp_init_attr_ex, *mut EfadvQpInitAttr, u32) -> *mut ibv_qp;
    }
    optional {}
}

// SAFETY: function pointers into a library that is never unloaded.
unsafe impl Send for Efadv {}
// SAFETY: as above.
unsafe impl Sync for Efadv {}

static EFADV: OnceLock<Result<Efadv, String>> = OnceLock::new();

/// The loaded libefa, or why not.
pub fn efadv() -> Result<&'static Efadv, TransportError> {
    EFADV
        .get_or_init(|| {
            let lib = open_library(&["libefa.so.1", "libefa.so"])?;
            // SAFETY: `lib` is libefa; the table keeps it loaded.
            unsafe { Efadv::resolve(lib) }
        })
        .as_ref()
        .map_err(|e| TransportError::NoDevice(format!("libefa is not usable ({e})")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libefa_loads_or_says_why() {
        match efadv() {
            Ok(_) => println!("libefa loaded (no EFA device is needed for that)"),
            Err(e) => {
                println!("{e}");
                assert!(e.to_string().contains("libefa"));
            }
        }
    }
}
