//! `C = A * B` on the persistent warp-specialized TMA + wgmma kernel (bf16 in, f32 accumulate,
//! bf16 or f32 out).
//!
//! A is M x K row-major. B is K x N row-major ([`BLayout::KxN`]) or N x K row-major
//! ([`BLayout::NxK`], the `nn.Linear` weight layout). C is M x N row-major. Any M and N; K a
//! multiple of 8 (TMA needs 16-byte row strides), N a multiple of 8 when B is K x N.
//!
//! A [`GemmPlan`] encodes the TMA descriptors once and uploads them; `launch` is then a single
//! kernel launch that can be captured in a CUDA graph.
//!
//! Policy ([`GemmKernel::Auto`]): M <= 256 (decode) runs the bandwidth-bound kernels
//! (`mk_gemm_decode_*`: the weights streamed once over every SM, stream-K with an in-kernel,
//! deterministic reduction of f32 partials); larger M the persistent 128 x 256 tile kernel. A decode
//! plan owns a small workspace (partials and per-tile counters), so its launches must not overlap
//! each other (one stream, or ordered); for a given grid its result does not depend on timing.
use crate::check;
use crate::error::{Error, Result};
use crate::runtime::Device;
use crate::tensor_map::encode_bf16_sw128_packed;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use mkernel_config::ops::gemm_decode::{self, DecodeSplit};
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

/// Which kernel a [`GemmPlan`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKernel {
    /// The policy: [`GemmKernel::Decode`] for M <= 256, else [`GemmKernel::Tiled`].
    Auto,
    /// The persistent warp-specialized kernel, 128 x 256 tiles (`mk_gemm_bf16_{nk,kn}`).
    Tiled,
    /// The decode kernels (M <= 256 only): C^T = B^T A^T with wgmma N = M rounded up to 8, 16,
    /// ..., 256, stream-K over the SMs (`mk_gemm_decode_*`).
    Decode,
}

impl GemmKernel {
    /// What `Auto` picks for `shape`.
    pub fn for_shape(shape: &GemmShape) -> GemmKernel {
        if shape.m as u64 <= gemm_decode::DECODE_MAX_M as u64 {
            GemmKernel::Decode
        } else {
            GemmKernel::Tiled
        }
    }
}

/// A decode plan's own pieces: the token bucket, the split and its workspace.
struct DecodeState {
    tok: u32,
    split: DecodeSplit,
    /// Two f32 partial slots per CTA.
    ws: CudaSlice<u8>,
    /// One counter per tile, zero between launches (the reducing CTA resets it).
    counters: CudaSlice<u32>,
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
    /// Set when the plan runs a decode kernel.
    decode: Option<DecodeState>,
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
        // SAFETY: as this function's.
        unsafe { Self::new_raw_on(device, stream, a, b, c, shape, out, sms, GemmKernel::Auto) }
    }

    /// As [`GemmPlan::new_raw`] on a chosen kernel (`GemmKernel::Decode` needs M <= 256).
    ///
    /// # Safety
    /// As [`GemmPlan::new_raw`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new_raw_on(
        device: &Device,
        stream: &Arc<CudaStream>,
        a: u64,
        b: u64,
        c: u64,
        shape: GemmShape,
        out: OutDtype,
        sms: Option<u32>,
        kernel: GemmKernel,
    ) -> Result<Self> {
        shape.validate()?;
        check::stream_on(OP, device, stream)?;
        check::aligned16(OP, &[("A", a), ("B", b), ("C", c)])?;
        let kernel = match kernel {
            GemmKernel::Auto => GemmKernel::for_shape(&shape),
            k => k,
        };
        if kernel == GemmKernel::Decode {
            return Self::new_decode(device, stream, a, b, c, shape, out, sms);
        }
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
            decode: None,
            _buffers: PhantomData,
        })
    }

    /// The decode plan: tensor maps of the weights (128 rows x 64 K per stage, or two 64 x 64
    /// boxes of K x N) and of the tokens (64 K x the bucket's rows), the stream-K split over
    /// `sms` CTAs and its workspace.
    #[allow(clippy::too_many_arguments)]
    fn new_decode(
        device: &Device,
        stream: &Arc<CudaStream>,
        a: u64,
        b: u64,
        c: u64,
        shape: GemmShape,
        out: OutDtype,
        sms: Option<u32>,
    ) -> Result<Self> {
        let tok = u32::try_from(shape.m)
            .ok()
            .and_then(gemm_decode::tok_for)
            .ok_or_else(|| Error::Shape {
                op: OP,
                reason: format!(
                    "m={} is above the decode kernels' {} rows",
                    shape.m,
                    gemm_decode::DECODE_MAX_M
                ),
            })?;
        let (m, n, k) = (shape.m as u64, shape.n as u64, shape.k as u64);
        let (kn, map_w) = match shape.b_layout {
            BLayout::NxK => (
                false,
                encode_bf16_sw128_packed(b, k, n, gemm_decode::BLOCK_K, gemm_decode::W_ROWS)?,
            ),
            BLayout::KxN => (true, encode_bf16_sw128_packed(b, n, k, 64, gemm_decode::BLOCK_K)?),
        };
        let map_x = encode_bf16_sw128_packed(a, k, m, gemm_decode::BLOCK_K, tok)?;
        let mut words = [0u64; 32];
        words[..16].copy_from_slice(&map_w.opaque);
        words[16..].copy_from_slice(&map_x.opaque);
        let maps = stream.clone_htod(&words)?;
        let sms = sms.unwrap_or(device.sm_count()).clamp(1, device.sm_count());
        let split = DecodeSplit::new(shape.n as u32, shape.k as u32, sms);
        let ws_bytes = split.workspace_bytes(tok).max(16) as usize;
        // SAFETY: no launch reads a partial slot before a launch has written it (a tile's summing
        // CTA reads only the slots of contributors that counted), so the slots need no zeroing; u8
        // has no invalid values.
        let ws = unsafe { stream.alloc::<u8>(ws_bytes) }?;
        let counters = stream.alloc_zeros::<u32>(split.tiles as usize)?;
        let spec = gemm_decode::kernel(tok, kn);
        Ok(GemmPlan {
            device: device.clone(),
            func: device.function(spec)?,
            spec,
            maps,
            c,
            shape,
            out,
            grid: split.grid,
            tma_store: false,
            trace: 0,
            decode: Some(DecodeState {
                tok,
                split,
                ws,
                counters,
            }),
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
        if let Some(d) = &self.decode {
            return self.launch_decode(stream, d);
        }
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

    fn launch_decode(&self, stream: &Arc<CudaStream>, d: &DecodeState) -> Result<()> {
        let (maps, _r) = self.maps.device_ptr(stream);
        let (ws, _rw) = d.ws.device_ptr(stream);
        let (counters, _rc) = d.counters.device_ptr(stream);
        let (map_w, map_x) = (maps, maps + 128);
        let (m, n, k) = (self.shape.m as u32, self.shape.n as u32, self.shape.k as u32);
        let ldc = n;
        let f32_out = (self.out == OutDtype::F32) as u32;
        let mut b = stream.launch_builder(&self.func);
        b.arg(&map_w)
            .arg(&map_x)
            .arg(&self.c)
            .arg(&ws)
            .arg(&counters)
            .arg(&m)
            .arg(&n)
            .arg(&k)
            .arg(&ldc)
            .arg(&f32_out);
        // SAFETY: arguments match mk_gemm_decode_*; the workspace holds the split's slots and
        // zeroed counters, and the plan's buffers are borrowed for 'a.
        unsafe { b.launch(Device::launch_config(self.spec, self.grid)) }?;
        Ok(())
    }

    /// The kernel the plan runs (`Tiled` or `Decode`).
    pub fn kernel(&self) -> GemmKernel {
        if self.decode.is_some() {
            GemmKernel::Decode
        } else {
            GemmKernel::Tiled
        }
    }
    /// Decode plans: the token bucket (the wgmma N), the weight tiles of 128 rows and the K
    /// blocks of each.
    pub fn decode_split(&self) -> Option<(u32, u32, u32)> {
        self.decode.as_ref().map(|d| (d.tok, d.split.tiles, d.split.k_blocks))
    }

    /// CTAs launched (persistent: each loops over tiles).
    pub fn grid(&self) -> u32 {
        self.grid
    }
    /// Whether the epilogue writes C through shared memory and TMA (bf16 C, N a multiple of 8).
    pub fn tma_store(&self) -> bool {
        self.tma_store
    }
    /// The tiled kernel's configuration (a decode plan's tiles: [`GemmPlan::decode_split`]).
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
