//! The CUDA context and mkernel's loaded module.
use crate::error::{Error, Result};
use crate::ptx::MKERNEL_PTX;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use mkernel_config::KernelSpec;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The names under which the CUDA driver library is looked for (Linux).
const DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Whether the CUDA driver library can be loaded on this machine.
///
/// Works whichever way cudarc binds libcuda: loaded at run time (`fallback-dynamic-loading`,
/// mkernel's own choice, or `dynamic-loading`), where a call into a missing library would panic,
/// or linked (`dynamic-linking`, candle's and mistral.rs's choice), where the loader already
/// mapped it and this finds it. The library stays loaded (cudarc opens the same one).
pub fn driver_present() -> bool {
    DRIVER_LIBRARIES.iter().any(|name| {
        let name = std::ffi::CString::new(*name).expect("no NUL in a library name");
        // SAFETY: dlopen with a valid NUL-terminated name; libcuda's initializers are what any
        // CUDA program runs. The handle is deliberately not closed.
        !unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null()
    })
}

/// Percentage (1-100) of the SMs this process sees that persistent grids use.
///
/// Ranks sharing a GPU through MPS need the sum of their persistent grids resident at once, and
/// a rank whose grid fills its whole MPS share leaves no SM for its own other work (the emulated
/// wire's copies between ranks of one GPU) until that grid ends. `xtask launch --share-gpu` sets
/// it (docs/testing.md, "Co-residency"); unset, grids use every SM the driver reports.
pub const PERSISTENT_SM_PERCENT_VAR: &str = "MKERNEL_PERSISTENT_SM_PERCENT";

/// The persistent-grid SM count from the driver's count and [`PERSISTENT_SM_PERCENT_VAR`].
fn persistent_sms(reported: u32, percent: Option<&str>) -> Result<u32> {
    let Some(p) = percent else { return Ok(reported) };
    match p.trim().parse::<u32>() {
        Ok(p @ 1..=100) => Ok((reported * p / 100).max(1)),
        _ => Err(Error::Environment {
            var: PERSISTENT_SM_PERCENT_VAR,
            reason: format!("{p:?} is not a whole percentage from 1 to 100"),
        }),
    }
}

/// Number of CUDA devices, or [`Error::NoDriver`].
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    Ok(CudaContext::device_count()? as usize)
}

/// A GPU with mkernel's PTX module loaded. Cheap to clone (`Arc`).
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    sm_count: u32,
    reported_sm_count: u32,
    /// A stream of the context that never captures: where launches inside a capture take their
    /// buffers' addresses (so no wait on an event recorded outside the capture enters it).
    side: OnceLock<Arc<CudaStream>>,
}

/// The devices made so far, one per CUDA context, so that every [`Device`] of a context shares
/// one loaded module: `Device::new` and `Device::from_context` of a context that already has a
/// live `Device` return a clone of it instead of loading the 3.6 MB PTX again.
static LOADED: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

impl Device {
    /// Opens GPU `ordinal` (its primary context, the one cudarc's `CudaContext::new` and candle's
    /// `CudaDevice::new` retain) and loads the embedded PTX, once per context.
    ///
    /// Errors (never panics) when no driver is installed, the device does not exist, or it is
    /// not a Hopper (sm_90) GPU.
    pub fn new(ordinal: usize) -> Result<Device> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        Device::from_context(CudaContext::new(ordinal)?)
    }

    /// The device of a context the caller already holds (candle's `CudaDevice::cuda_stream()
    /// .context()`, mistral.rs's), so that mkernel launches on the caller's streams and buffers.
    /// The PTX module is loaded into a context once: later calls for the same context return a
    /// `Device` sharing it while one is alive. Plans refuse streams and buffers of other
    /// contexts ([`Error::ForeignContext`]).
    ///
    /// Errors when the context's GPU is not a Hopper (sm_90) GPU or the module cannot be loaded.
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Device> {
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        loaded.retain(|w| w.strong_count() > 0);
        if let Some(inner) = loaded
            .iter()
            .filter_map(Weak::upgrade)
            .find(|i| i.ctx.cu_ctx() == ctx.cu_ctx())
        {
            return Ok(Device { inner });
        }
        let ordinal = ctx.ordinal();
        let major = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        if major != 9 {
            return Err(Error::UnsupportedDevice { ordinal, major, minor });
        }
        let reported = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let sm_count = persistent_sms(reported, std::env::var(PERSISTENT_SM_PERCENT_VAR).ok().as_deref())?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(MKERNEL_PTX))?;
        let inner = Arc::new(Inner {
            ordinal,
            ctx,
            module,
            functions: Mutex::new(HashMap::new()),
            sm_count,
            reported_sm_count: reported,
            side: OnceLock::new(),
        });
        loaded.push(Arc::downgrade(&inner));
        Ok(Device { inner })
    }

    /// A stream of this context used by no graph capture (created on first use).
    pub(crate) fn side_stream(&self) -> Result<&Arc<CudaStream>> {
        if let Some(s) = self.inner.side.get() {
            return Ok(s);
        }
        let s = self.inner.ctx.new_stream()?;
        Ok(self.inner.side.get_or_init(|| s))
    }

    /// Whether `self` and `other` share one loaded module (they are `Device`s of one context).
    pub fn shares_module_with(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }
    /// The cudarc context (share it with candle / mistral.rs buffers and streams).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }
    /// The context's default stream.
    pub fn default_stream(&self) -> Arc<CudaStream> {
        self.inner.ctx.default_stream()
    }
    /// Streaming multiprocessors that persistent grids size themselves to: the SMs the driver
    /// reports for this context (under MPS, the client's share), scaled by
    /// `MKERNEL_PERSISTENT_SM_PERCENT` when it is set ([`PERSISTENT_SM_PERCENT_VAR`]).
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }
    /// SMs the driver reports for this context (under MPS: this client's share).
    pub fn reported_sm_count(&self) -> u32 {
        self.inner.reported_sm_count
    }

    /// The loaded kernel for `spec`, with its dynamic shared memory limit raised to what the
    /// spec launches with.
    pub fn function(&self, spec: &'static KernelSpec) -> Result<CudaFunction> {
        let mut map = self.inner.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = map.get(spec.name) {
            return Ok(f.clone());
        }
        let f = self
            .inner
            .module
            .load_function(spec.name)
            .map_err(|_| Error::MissingKernel(spec.name))?;
        if spec.dynamic_smem > 48 * 1024 {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                spec.dynamic_smem as i32,
            )?;
        }
        map.insert(spec.name, f.clone());
        Ok(f)
    }

    /// Launch configuration of `spec` over `grid` CTAs: block and shared memory from the table.
    pub fn launch_config(spec: &KernelSpec, grid: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (spec.max_threads, 1, 1),
            shared_mem_bytes: spec.dynamic_smem,
        }
    }

    /// Fills `out[i] = i + offset` with the `mk_iota_u32` kernel: a smoke test of the whole
    /// Rust -> PTX -> launch path.
    pub fn iota(&self, stream: &Arc<CudaStream>, out: &mut cudarc::driver::CudaSlice<u32>, offset: u32) -> Result<()> {
        crate::check::stream_on("iota", self, stream)?;
        crate::check::buffer_on("iota", "out", self, out)?;
        let spec = &mkernel_config::kernels::IOTA;
        let f = self.function(spec)?;
        let len = u32::try_from(out.len()).map_err(|_| Error::Shape {
            op: "iota",
            reason: "more than 2^32 elements".into(),
        })?;
        let grid = len.div_ceil(spec.max_threads).max(1);
        let mut b = stream.launch_builder(&f);
        b.arg(out).arg(&len).arg(&offset);
        // SAFETY: argument list matches mk_iota_u32(out: *mut u32, len: u32, offset: u32).
        unsafe { b.launch(Self::launch_config(spec, grid)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn persistent_sm_percent_scales_the_reported_count() {
        assert_eq!(persistent_sms(33, None).unwrap(), 33);
        assert_eq!(persistent_sms(33, Some("80")).unwrap(), 26);
        assert_eq!(persistent_sms(132, Some("100")).unwrap(), 132);
        assert_eq!(persistent_sms(1, Some("1")).unwrap(), 1);
        for bad in ["0", "101", "x", "-5", ""] {
            assert!(persistent_sms(132, Some(bad)).is_err(), "{bad}");
        }
    }
}
