//! `C = A * B` on the persistent warp-specialized TMA + wgmma kernel (bf16 in, f32 accumulate,
//! bf16 or f32 out).
//!
//! A is M x K row-major. B is K x N row-major ([`BLayout::KxN`]) or N x K row-major
//! ([`BLayout::NxK`], the `nn.Linear` weight layout). C is M x N row-major. Any M and N; K a
//! multiple of 8 (TMA needs 16-byte row strides), N a multiple of 8 when B is K x N.
//!
//! A [`GemmPlan`] encodes the TMA descriptors once and uploads them; `launch` is then a single
//! kernel launch that can be captured in a CUDA graph.
use crate::check;
use crate::error::{Error, Result};
use crate::runtime::Device;
use crate::tensor_map::encode_bf16_sw128_packed;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use mkernel_config::{kernels, GemmTile, KernelSpec};
use std::marker::PhantomData;
use std::sync::Arc;

const OP: &str = "gemm";

/// Storage order of B.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BLayout {
    /// B is K x N row-major (N contiguous).
    KxN,
    /// B is N x K row-major (K contiguous), as `nn.Linear` stores weights: C = A * B^T.
    NxK,
}

/// Element type of C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDtype {
    Bf16,
    F32,
}

impl OutDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            OutDtype::Bf16 => 2,
            OutDtype::F32 => 4,
        }
    }
}

/// Element types C may have: `half::bf16` or `f32`. Sealed: `DTYPE` decides how many bytes per
/// element the kernel writes, so it must match the type's size.
pub trait GemmOutput: cudarc::driver::DeviceRepr + crate::comm::sealed::Sealed {
    /// The kernel's output selector.
    const DTYPE: OutDtype;
}
impl GemmOutput for bf16 {
    const DTYPE: OutDtype = OutDtype::Bf16;
}
impl GemmOutput for f32 {
    const DTYPE: OutDtype = OutDtype::F32;
}

/// Problem size and B layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub b_layout: BLayout,
}

impl GemmShape {
    /// Checks the shape against what the kernel supports, with the reason when it does not.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::Shape { op: OP, reason });
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return bad(format!("empty problem m={} n={} k={}", self.m, self.n, self.k));
        }
        if self.m > i32::MAX as usize || self.n > i32::MAX as usize || self.k > i32::MAX as usize {
            return bad("dimensions must be below 2^31".into());
        }
        if self.k % 8 != 0 {
            return bad(format!("k={} must be a multiple of 8 (16-byte rows for TMA)", self.k));
        }
        if self.b_layout == BLayout::KxN && self.n % 8 != 0 {
            return bad(format!(
                "n={} must be a multiple of 8 when B is K x N (16-byte rows for TMA)",
                self.n
            ));
        }
        Ok(())
    }
    /// Floating-point operations of the product (2 M N K).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
    /// Elements of A, B and C (saturating at `usize::MAX`, which no buffer holds: a shape whose
    /// products overflow fails the length checks instead of wrapping).
    pub fn lens(&self) -> (usize, usize, usize) {
        (
            self.m.saturating_mul(self.k),
            self.k.saturating_mul(self.n),
            self.m.saturating_mul(self.n),
        )
    }
}

/// A GEMM ready to launch: descriptors encoded and uploaded, grid chosen.
/// Borrows the buffers it was made from for `'a`:
/// ```compile_fail,E0505
/// # use mkernel::{GemmPlan, GemmShape, BLayout};
/// # fn f(dev: &mkernel::Device, s: &std::sync::Arc<mkernel::cudarc::driver::CudaStream>) -> mkernel::Result<()> {
/// let shape = GemmShape { m: 128, n: 128, k: 64, b_layout: BLayout::NxK };
/// let a = s.alloc_zeros::<half::bf16>(128 * 64)?;
/// let b = s.alloc_zeros::<half::bf16>(128 * 64)?;
/// let mut c = s.alloc_zeros::<half::bf16>(128 * 128)?;
/// let plan = GemmPlan::new(dev, s, &a, &b, &mut c, shape, None)?;
/// drop(c);
/// plan.launch(s)?;
/// # Ok(()) }
/// ```
pub struct GemmPlan<'a> {
    device: Device,
    func: CudaFunction,
    spec: &'static KernelSpec,
    maps: CudaSlice<u64>,
    c: u64,
    shape: GemmShape,
    out: OutDtype,
    grid: u32,
    tma_store: bool,
    /// The fused-ring diagnostic's timeline buffer (0: none).
    trace: u64,
    _buffers: PhantomData<&'a ()>,
}

impl<'a> GemmPlan<'a> {
    /// Plans `c = a * b` on cudarc buffers; C is bf16 or f32. `sms` caps the CTAs (default:
    /// every SM).
    pub fn new<C: GemmOutput>(
        device: &Device,
        stream: &Arc<CudaStream>,
        a: &'a impl DevicePtr<bf16>,
        b: &'a impl DevicePtr<bf16>,
        c: &'a mut impl DevicePtrMut<C>,
        shape: GemmShape,
        sms: Option<u32>,
    ) -> Result<Self> {
        shape.validate()?;
        check::buffer_on(OP, "A", device, a)?;
        check::buffer_on(OP, "B", device, b)?;
        check::buffer_on(OP, "C", device, c)?;
        let (la, lb, lc) = shape.lens();
        crate::check::lens(OP, &[("A", a.len(), la), ("B", b.len(), lb), ("C", c.len(), lc)])?;
        let (pa, _ra) = a.device_ptr(stream);
        let (pb, _rb) = b.device_ptr(stream);
        let (pc, _rc) = c.device_ptr_mut(stream);
        // SAFETY: the three buffers are borrowed for 'a and hold the shape's elements.
        unsafe { Self::new_raw(device, stream, pa, pb, pc, shape, C::DTYPE, sms) }
    }

    /// Plans on raw device pointers (16-byte aligned; C of `out` elements).
    ///
    /// # Safety
    /// `a`, `b`, `c` must point to at least M*K, K*N and M*N elements on `device`, and stay
    /// valid while the plan is launched.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new_raw(
        device: &Device,
        stream: &Arc<CudaStream>,
        a: u64,
        b: u64,
        c: u64,
        shape: GemmShape,
        out: OutDtype,
        sms: Option<u32>,
    ) -> Result<Self> {
        shape.validate()?;
        check::stream_on(OP, device, stream)?;
        check::aligned16(OP, &[("A", a), ("B", b), ("C", c)])?;
        let t = GemmTile::DEFAULT;
        let (m, n, k) = (shape.m as u64, shape.n as u64, shape.k as u64);
        let map_a = encode_bf16_sw128_packed(a, k, m, t.block_k, t.block_m)?;
        let (spec, map_b) = match shape.b_layout {
            BLayout::NxK => (
                &kernels::GEMM_BF16_NK,
                encode_bf16_sw128_packed(b, k, n, t.block_k, t.block_n)?,
            ),
            BLayout::KxN => (
                &kernels::GEMM_BF16_KN,
                encode_bf16_sw128_packed(b, n, k, 64, t.block_k)?,
            ),
        };
        // bf16 C with 16-byte rows is written by TMA from shared memory; otherwise direct stores.
        let tma_store = out == OutDtype::Bf16 && shape.n % 8 == 0;
        let mut words = [0u64; 48];
        words[..16].copy_from_slice(&map_a.opaque);
        words[16..32].copy_from_slice(&map_b.opaque);
        if tma_store {
            let box_rows = GemmTile::EPILOGUE_BOX_ROWS;
            let map_c = encode_bf16_sw128_packed(c, n, m, GemmTile::EPILOGUE_BOX_COLS, box_rows)?;
            words[32..].copy_from_slice(&map_c.opaque);
        }
        let maps = stream.clone_htod(&words)?;
        let tiles = shape.m.div_ceil(t.block_m as usize) * shape.n.div_ceil(t.block_n as usize);
        let sms = sms.unwrap_or(device.sm_count()).clamp(1, device.sm_count());
        let grid = (tiles.min(sms as usize)) as u32;
        Ok(GemmPlan {
            device: device.clone(),
            func: device.function(spec)?,
            spec,
            maps,
            c,
            shape,
            out,
            grid,
            tma_store,
            trace: 0,
            _buffers: PhantomData,
        })
    }

    /// Diagnostic: the same plan on GEMM+ReduceScatter's ring (`ops::gemm_rs::TILE`: 3 stages,
    /// whole-tile epilogue staging, the fused kernels' register split), to measure what that
    /// ring costs the GEMM alone. N x K B and TMA-stored bf16 C only.
    pub fn on_fused_ring(mut self, device: &Device) -> Result<Self> {
        if self.spec != &kernels::GEMM_BF16_NK || !self.tma_store {
            return Err(Error::Unsupported(format!(
                "{OP}: the fused-ring diagnostic needs B as N x K and a TMA-stored bf16 C"
            )));
        }
        self.spec = &kernels::GEMM_BF16_NK_FUSED_RING;
        self.func = device.function(self.spec)?;
        Ok(self)
    }

    /// Diagnostic (a plan [`GemmPlan::on_fused_ring`] only): later launches record the fused
    /// kernels' per-tile timeline (`mkernel_config::trace`, `grid` CTAs) into the device buffer
    /// at `buf`; `None` stops it.
    ///
    /// # Safety
    /// `buf` must hold `mkernel_config::trace::words(grid)` u64 words while such launches run.
    pub unsafe fn set_trace(&mut self, buf: Option<u64>) -> Result<()> {
        if self.spec != &kernels::GEMM_BF16_NK_FUSED_RING {
            return Err(Error::Unsupported(format!(
                "{OP}: only the fused-ring diagnostic records a timeline"
            )));
        }
        self.trace = buf.unwrap_or(0);
        Ok(())
    }

    /// Enqueues the kernel on `stream`.
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        check::stream_on(OP, &self.device, stream)?;
        let (maps, _r) = self.maps.device_ptr(stream);
        let (map_a, map_b) = (maps, maps + 128);
        let map_c = if self.tma_store { maps + 256 } else { 0 };
        let (m, n, k) = (self.shape.m as u32, self.shape.n as u32, self.shape.k as u32);
        let ldc = n;
        let f32_out = (self.out == OutDtype::F32) as u32;
        let mut b = stream.launch_builder(&self.func);
        b.arg(&map_a)
            .arg(&map_b)
            .arg(&map_c)
            .arg(&self.c)
            .arg(&m)
            .arg(&n)
            .arg(&k)
            .arg(&ldc)
            .arg(&f32_out);
        if self.spec == &kernels::GEMM_BF16_NK_FUSED_RING {
            b.arg(&self.trace);
        }
        // SAFETY: arguments match mk_gemm_bf16_{nk,kn} (and the fused-ring diagnostic's trace
        // buffer); the plan's buffers are borrowed for 'a.
        unsafe { b.launch(Device::launch_config(self.spec, self.grid)) }?;
        Ok(())
    }

    /// CTAs launched (persistent: each loops over tiles).
    pub fn grid(&self) -> u32 {
        self.grid
    }
    /// Whether the epilogue writes C through shared memory and TMA (bf16 C, N a multiple of 8).
    pub fn tma_store(&self) -> bool {
        self.tma_store
    }
    /// The tile configuration the kernel is compiled with.
    pub fn tile(&self) -> GemmTile {
        GemmTile::DEFAULT
    }
    /// The planned shape.
    pub fn shape(&self) -> GemmShape {
        self.shape
    }
}

/// One-shot `c = a * b` with bf16 or f32 C (plans, then launches; keep a [`GemmPlan`] to launch
/// repeatedly or inside a CUDA graph).
pub fn gemm_bf16<C: GemmOutput>(
    device: &Device,
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    c: &mut impl DevicePtrMut<C>,
    shape: GemmShape,
) -> Result<()> {
    GemmPlan::new(device, stream, a, b, c, shape, None)?.launch(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    fn shape(m: usize, n: usize, k: usize, b_layout: BLayout) -> GemmShape {
        GemmShape { m, n, k, b_layout }
    }
    #[test]
    fn shapes_are_validated() {
        assert!(shape(1, 1, 8, BLayout::NxK).validate().is_ok());
        assert!(shape(129, 257, 72, BLayout::NxK).validate().is_ok());
        assert!(shape(129, 264, 72, BLayout::KxN).validate().is_ok());
        let e = shape(128, 256, 100, BLayout::NxK).validate().unwrap_err().to_string();
        assert!(e.contains("multiple of 8"), "{e}");
        let e = shape(128, 257, 64, BLayout::KxN).validate().unwrap_err().to_string();
        assert!(e.contains("n=257"), "{e}");
        assert!(shape(0, 256, 64, BLayout::NxK).validate().is_err());
    }
}
