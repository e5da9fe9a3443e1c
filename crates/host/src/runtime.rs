//! The CUDA context and mkernel's loaded module.
use crate::error::{Error, Result};
use crate::ptx::MKERNEL_PTX;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use mkernel_config::KernelSpec;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { cudarc::driver::sys::is_culib_present() }
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
}

impl Device {
    /// Opens GPU `ordinal` (primary context) and loads the embedded PTX.
    ///
    /// Errors (never panics) when no driver is installed, the device does not exist, or it is
    /// not a Hopper (sm_90) GPU.
    pub fn new(ordinal: usize) -> Result<Device> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let major = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        if major != 9 {
            return Err(Error::UnsupportedDevice { ordinal, major, minor });
        }
        let reported = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let sm_count = persistent_sms(reported, std::env::var(PERSISTENT_SM_PERCENT_VAR).ok().as_deref())?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(MKERNEL_PTX))?;
        Ok(Device {
            inner: Arc::new(Inner {
                ordinal,
                ctx,
                module,
                functions: Mutex::new(HashMap::new()),
                sm_count,
                reported_sm_count: reported,
            }),
        })
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
