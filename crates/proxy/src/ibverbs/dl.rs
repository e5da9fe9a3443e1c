//! libibverbs functions resolved at run time from `libibverbs.so.1` with `libloading`.
//!
//! Types come from `rdma-sys` (bindgen'd from the installed headers); the functions are looked
//! up here rather than linked, like NCCL does, so a binary that contains this crate starts on
//! hosts without rdma-core and reports "no RDMA device found" there. The inline verbs
//! (`ibv_post_send`, `ibv_poll_cq`, `ibv_post_recv`) go through the context's ops table.
use crate::error::TransportError;
use libc::{c_char, c_int, c_void};
use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use rdma_sys::{
    _compat_ibv_port_attr, ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_device, ibv_gid, ibv_mr,
    ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_ex, ibv_qp_init_attr, ibv_recv_wr, ibv_send_wr, ibv_wc, ibv_wc_status,
};
use std::ffi::CStr;
use std::sync::OnceLock;

/// Loads the first of `names` that loads (`RTLD_NOW | RTLD_LOCAL`); the error names what was tried.
pub(crate) fn open_library(names: &[&str]) -> Result<Library, String> {
    let mut tried = vec![];
    for n in names {
        // SAFETY: loading runs the library's initializers; rdma-core's libraries have no
        // initializers with preconditions on the caller.
        match unsafe { Library::open(Some(*n), RTLD_NOW | RTLD_LOCAL) } {
            Ok(l) => return Ok(l),
            Err(e) => tried.push(format!("{n}: {e}")),
        }
    }
    Err(tried.join("; "))
}

/// Declares a table of C functions resolved from a [`Library`] the table keeps loaded.
macro_rules! table {
    ($(#[$m:meta])* $vis:vis struct $T:ident { $($name:ident : fn($($arg:ty),*) -> $ret:ty;)* } optional { $($oname:ident : fn($($oarg:ty),*) -> $oret:ty;)* }) => {
        $(#[$m])*
        $vis struct $T {
            _lib: libloading::os::unix::Library,
            $(pub(crate) $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
            $(pub(crate) $oname: Option<unsafe extern "C" fn($($oarg),*) -> $oret>,)*
        }
        impl $T {
            /// # Safety
            /// `lib` must be the library whose C prototypes these are.
            unsafe fn resolve(lib: libloading::os::unix::Library) -> Result<Self, String> {
                Ok($T {
                    $($name: {
                        // SAFETY: the symbol has this C prototype (see the library's header).
                        let f = unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!(stringify!($name), "\0").as_bytes()) }
                            .map_err(|e| format!("symbol {}: {e}", stringify!($name)))?;
                        *f
                    },)*
                    $($oname: {
                        // SAFETY: as above.
                        unsafe { lib.get::<unsafe extern "C" fn($($oarg),*) -> $oret>(concat!(stringify!($oname), "\0").as_bytes()) }
                            .ok()
                            .map(|f| *f)
                    },)*
                    _lib: lib,
                })
            }
        }
    };
}
pub(crate) use table;

table! {
    /// The libibverbs entry points this crate uses.
    pub struct Verbs {
        ibv_get_device_list: fn(*mut c_int) -> *mut *mut ibv_device;
        ibv_free_device_list: fn(*mut *mut ibv_device) -> ();
        ibv_get_device_name: fn(*mut ibv_device) -> *const c_char;
        ibv_open_device: fn(*mut ibv_device) -> *mut ibv_context;
        ibv_close_device: fn(*mut ibv_context) -> c_int;
        ibv_query_port: fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int;
        ibv_query_gid: fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
        ibv_alloc_pd: fn(*mut ibv_context) -> *mut ibv_pd;
        ibv_dealloc_pd: fn(*mut ibv_pd) -> c_int;
        ibv_reg_mr: fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
        ibv_dereg_mr: fn(*mut ibv_mr) -> c_int;
        ibv_create_cq: fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
        ibv_destroy_cq: fn(*mut ibv_cq) -> c_int;
        ibv_create_qp: fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
        ibv_modify_qp: fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
        ibv_destroy_qp: fn(*mut ibv_qp) -> c_int;
        ibv_create_ah: fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah;
        ibv_destroy_ah: fn(*mut ibv_ah) -> c_int;
        ibv_wc_status_str: fn(ibv_wc_status::Type) -> *const c_char;
    }
    optional {
        ibv_reg_dmabuf_mr: fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
        ibv_qp_to_qp_ex: fn(*mut ibv_qp) -> *mut ibv_qp_ex;
    }
}

// SAFETY: function pointers into a library the table keeps loaded; libibverbs is thread-safe.
unsafe impl Send for Verbs {}
// SAFETY: as above.
unsafe impl Sync for Verbs {}

static VERBS: OnceLock<Result<Verbs, String>> = OnceLock::new();

/// The loaded libibverbs, or why it could not be loaded.
pub fn verbs() -> Result<&'static Verbs, TransportError> {
    VERBS
        .get_or_init(|| {
            let lib = open_library(&["libibverbs.so.1", "libibverbs.so"])?;
            // SAFETY: `lib` is libibverbs; the table keeps it loaded for the process's life.
            unsafe { Verbs::resolve(lib) }
        })
        .as_ref()
        .map_err(|e| TransportError::NoDevice(format!("libibverbs is not usable ({e})")))
}

/// The last OS error as text.
pub(crate) fn errno() -> String {
    std::io::Error::last_os_error().to_string()
}

impl Verbs {
    /// Names of the devices libibverbs sees.
    pub fn device_names(&self) -> Vec<String> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer; the list is freed below.
        let list = unsafe { (self.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            return vec![];
        }
        let names = (0..n.max(0) as usize)
            .filter_map(|i| {
                // SAFETY: the list has `n` entries.
                let d = unsafe { *list.add(i) };
                // SAFETY: libibverbs returns a NUL-terminated name for a listed device.
                (!d.is_null()).then(|| {
                    // SAFETY: as above.
                    unsafe { CStr::from_ptr((self.ibv_get_device_name)(d)) }
                        .to_string_lossy()
                        .into_owned()
                })
            })
            .collect();
        // SAFETY: obtained from ibv_get_device_list.
        unsafe { (self.ibv_free_device_list)(list) };
        names
    }

    /// Opens the device called `name`.
    pub fn open(&self, name: &str) -> Result<*mut ibv_context, TransportError> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        let list = unsafe { (self.ibv_get_device_list)(&mut n) };
        if list.is_null() || n <= 0 {
            if !list.is_null() {
                // SAFETY: obtained from ibv_get_device_list.
                unsafe { (self.ibv_free_device_list)(list) };
            }
            return Err(TransportError::NoDevice("libibverbs lists no devices".into()));
        }
        let mut ctx = std::ptr::null_mut();
        let mut seen = vec![];
        for i in 0..n as usize {
            // SAFETY: the list has `n` entries; names are NUL-terminated.
            let d = unsafe { *list.add(i) };
            // SAFETY: as above.
            let dn = unsafe { CStr::from_ptr((self.ibv_get_device_name)(d)) }
                .to_string_lossy()
                .into_owned();
            if dn == name {
                // SAFETY: `d` is a listed device.
                ctx = unsafe { (self.ibv_open_device)(d) };
                if ctx.is_null() {
                    let e = errno();
                    // SAFETY: obtained from ibv_get_device_list.
                    unsafe { (self.ibv_free_device_list)(list) };
                    return Err(TransportError::Verbs {
                        call: "ibv_open_device",
                        detail: format!("{name}: {e}"),
                    });
                }
                break;
            }
            seen.push(dn);
        }
        // SAFETY: obtained from ibv_get_device_list; opened contexts stay valid.
        unsafe { (self.ibv_free_device_list)(list) };
        if ctx.is_null() {
            return Err(TransportError::NoDevice(format!("{name} is not among {seen:?}")));
        }
        Ok(ctx)
    }

    /// Text of a work-completion status.
    pub fn status_str(&self, s: ibv_wc_status::Type) -> String {
        // SAFETY: returns a static string for any value.
        let p = unsafe { (self.ibv_wc_status_str)(s) };
        if p.is_null() {
            format!("status {s}")
        } else {
            // SAFETY: static NUL-terminated string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }
}

/// `ibv_post_send` (an inline function in verbs.h: through the context's ops).
///
/// # Safety
/// `qp` must be a live queue pair and `wr` a valid chain that outlives the call.
pub unsafe fn post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
    // SAFETY: guaranteed by the caller.
    match unsafe { (*(*qp).context).ops.post_send } {
        // SAFETY: the provider's implementation of the verb, with the caller's arguments.
        Some(f) => unsafe { f(qp, wr, bad) },
        None => libc::ENOSYS,
    }
}

/// `ibv_post_recv` through the context's ops.
///
/// # Safety
/// As [`post_send`].
pub unsafe fn post_recv(qp: *mut ibv_qp, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    // SAFETY: guaranteed by the caller.
    match unsafe { (*(*qp).context).ops.post_recv } {
        // SAFETY: the provider's implementation of the verb, with the caller's arguments.
        Some(f) => unsafe { f(qp, wr, bad) },
        None => libc::ENOSYS,
    }
}

/// `ibv_poll_cq` through the context's ops; returns completions written or a negative error.
///
/// # Safety
/// `cq` must be a live completion queue and `wc` valid for `n` entries.
pub unsafe fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: guaranteed by the caller.
    match unsafe { (*(*cq).context).ops.poll_cq } {
        // SAFETY: as above.
        Some(f) => unsafe { f(cq, n, wc) },
        None => -libc::ENOSYS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loading_reports_a_clear_result() {
        // On the build host libibverbs may or may not be installed; either way no device exists.
        match verbs() {
            Ok(v) => {
                let names = v.device_names();
                println!("libibverbs loaded; devices: {names:?}");
                if names.is_empty() {
                    assert!(matches!(v.open("mlx5_0"), Err(TransportError::NoDevice(_))));
                }
            }
            Err(e) => {
                println!("{e}");
                assert!(e.to_string().starts_with("no RDMA device found"));
            }
        }
        assert!(open_library(&["libdefinitely-not-here.so.9"])
            .err()
            .unwrap()
            .contains("libdefinitely-not-here"));
    }
}
