//! `C = A * B` on the persistent warp-specialized TMA + wgmma kernel (bf16 in, f32 accumulate,
//! bf16 or f32 out).
//!
//! A is M x K row-major. B is K x N row-major ([`BLayout::KxN`]) or N x K row-major
//! ([`BLayout::NxK`], the `nn.Linear` weight layout). C is M x N row-major. Any M and N; K a
//! multiple of 8 (TMA needs 16-byte row strides), N a multiple of 8 when B is K x N.
//!
//! A [`GemmPlan`] is made from what does not change between steps ([`GemmConfig`]: N, K, the
//! B layout, C's element type, the largest M); each [`GemmPlan::launch`] takes the step's
//! buffers and its M (`1..=max_m`), encodes their tensor maps on the host and passes them by
//! value with the arguments ([`crate::params`]): one kernel launch, no allocation, no upload,
//! no host synchronization. Every buffer's cudarc guard is held until the launch is enqueued,
//! so a free or another stream's use of the buffer waits for the kernel. A safe launch refuses
//! a stream that is capturing a CUDA graph; [`GemmPlan::launch_captured`] is the `unsafe` capture.
//!
//! Policy ([`GemmKernel::Auto`]): M <= 256 (decode) runs the bandwidth-bound kernels
//! (`mk_gemm_decode_*`: the weights streamed once over every SM, stream-K with an in-kernel,
//! deterministic reduction of f32 partials); larger M the persistent 128 x 256 tile kernel. The
//! choice is made per launch from that launch's M. A plan that can run the decode kernels owns
//! their workspace (partials and per-tile counters), sized at plan time for its largest M.
use crate::check;
use crate::error::{Error, Result};
use crate::params::ParamBlock;
use crate::runtime::Device;
use crate::tensor_map::encode_bf16_sw128_packed;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use mkernel_config::ops::gemm::{GemmArgs, GemmParams};
use mkernel_config::ops::gemm_decode::{self, DecodeArgs, DecodeParams, DecodeSplit};
use mkernel_config::{kernels, GemmTile, KernelSpec};
use std::sync::Arc;

const OP: &str = "gemm";

/// Storage order of B.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BLayout {
    /// B is K x N row-major (N contiguous).
    KxN,
    /// B is N x K row-major (K contiguous), as `nn.Linear` stores weights: C = A * B^T.
    #[default]
    NxK,
}

/// Element type of C.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutDtype {
    #[default]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmKernel {
    /// The policy, per launch: [`GemmKernel::Decode`] for M <= 256, else [`GemmKernel::Tiled`].
    #[default]
    Auto,
    /// The persistent warp-specialized kernel, 128 x 256 tiles (`mk_gemm_bf16_{nk,kn}`).
    Tiled,
    /// The decode kernels (M <= 256 only): C^T = B^T A^T with wgmma N = M rounded up to 8, 16,
    /// ..., 256, stream-K over the SMs (`mk_gemm_decode_*`).
    Decode,
}

impl GemmKernel {
    /// What `Auto` runs for `m` rows.
    pub fn for_m(m: usize) -> GemmKernel {
        if m as u64 <= gemm_decode::DECODE_MAX_M as u64 {
            GemmKernel::Decode
        } else {
            GemmKernel::Tiled
        }
    }
    /// What `Auto` runs for `shape`.
    pub fn for_shape(shape: &GemmShape) -> GemmKernel {
        Self::for_m(shape.m)
    }
}

/// Problem size and B layout of one product.
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

/// What a [`GemmPlan`] is made for: everything but the buffers and the rows of each launch.
///
/// ```
/// # use mkernel::gemm::{GemmConfig, BLayout};
/// let config = GemmConfig { max_m: 4096, n: 4096, k: 4096, ..GemmConfig::default() };
/// assert_eq!(config.b_layout, BLayout::NxK);
/// assert!(config.validate().is_ok());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmConfig {
    /// Largest M a launch may take (launches take any M in `1..=max_m`). Sizes the decode
    /// workspace: see [`GemmConfig::workspace_bytes`].
    pub max_m: usize,
    /// Columns of C (rows of B when it is N x K).
    pub n: usize,
    /// The reduction dimension: a multiple of 8.
    pub k: usize,
    /// Default [`BLayout::NxK`] (`nn.Linear` weights).
    pub b_layout: BLayout,
    /// C's element type; a launch's C must have it. Default bf16.
    pub out: OutDtype,
    /// Most CTAs a launch uses; `None` (the default): every SM. Changes the decode kernels'
    /// split and so their rounding (results are bitwise equal across launches of one plan).
    pub sms: Option<u32>,
    /// Default [`GemmKernel::Auto`] (chosen per launch from M).
    pub kernel: GemmKernel,
}

impl Default for GemmConfig {
    /// No shape (`max_m`, `n` and `k` are 0, which [`GemmConfig::validate`] refuses: set them),
    /// B as N x K, bf16 C, every SM, the `Auto` policy.
    fn default() -> Self {
        GemmConfig {
            max_m: 0,
            n: 0,
            k: 0,
            b_layout: BLayout::NxK,
            out: OutDtype::Bf16,
            sms: None,
            kernel: GemmKernel::Auto,
        }
    }
}

impl GemmConfig {
    /// The configuration of a single product (`max_m` = the shape's M).
    pub fn for_shape(shape: GemmShape, out: OutDtype) -> GemmConfig {
        GemmConfig {
            max_m: shape.m,
            n: shape.n,
            k: shape.k,
            b_layout: shape.b_layout,
            out,
            ..GemmConfig::default()
        }
    }
    /// The shape of a launch of `m` rows.
    pub fn shape(&self, m: usize) -> GemmShape {
        GemmShape {
            m,
            n: self.n,
            k: self.k,
            b_layout: self.b_layout,
        }
    }
    /// Checks the shape (at `max_m`) and that the kernel can run it.
    pub fn validate(&self) -> Result<()> {
        self.shape(self.max_m).validate()?;
        if self.kernel == GemmKernel::Decode && self.max_m > gemm_decode::DECODE_MAX_M as usize {
            return Err(Error::Shape {
                op: OP,
                reason: format!(
                    "max_m={} is above the decode kernels' {} rows (GemmKernel::Decode)",
                    self.max_m,
                    gemm_decode::DECODE_MAX_M
                ),
            });
        }
        if self.sms == Some(0) {
            return Err(Error::Shape {
                op: OP,
                reason: "sms = Some(0): a launch needs at least one CTA".into(),
            });
        }
        Ok(())
    }
    /// The largest decode bucket a plan of this configuration launches (None: no decode path).
    fn decode_tok(&self) -> Option<u32> {
        let decode_m = match self.kernel {
            GemmKernel::Tiled => return None,
            GemmKernel::Decode | GemmKernel::Auto => self.max_m.min(gemm_decode::DECODE_MAX_M as usize),
        };
        gemm_decode::tok_for(decode_m as u32)
    }
    /// Whether a plan of this configuration has the tiled path (`Tiled`, or `Auto` above 256 rows).
    fn has_tiled(&self) -> bool {
        match self.kernel {
            GemmKernel::Tiled => true,
            GemmKernel::Decode => false,
            GemmKernel::Auto => self.max_m > gemm_decode::DECODE_MAX_M as usize,
        }
    }
    /// CTAs a launch may use on a GPU of `sm_count` SMs.
    fn cta_cap(&self, sm_count: u32) -> u32 {
        self.sms.unwrap_or(sm_count).clamp(1, sm_count.max(1))
    }
    /// The decode kernels' split on a GPU of `sm_count` SMs.
    fn decode_split(&self, sm_count: u32) -> DecodeSplit {
        DecodeSplit::new(self.n as u32, self.k as u32, self.cta_cap(sm_count))
    }
    /// Device memory a plan of this (valid) configuration allocates on a GPU of `sm_count` SMs:
    /// the decode workspace (two f32 slots of 128 x TOK per CTA for the largest bucket TOK of
    /// `max_m`, 16 bytes at least, and one u32 counter per 128 rows of N), or 0 with no decode
    /// path. E.g. 34.6 MB at `max_m` >= 129 on 132 SMs with N >= 128 x 132.
    pub fn workspace_bytes(&self, sm_count: u32) -> u64 {
        match self.decode_tok() {
            None => 0,
            Some(tok) => {
                let split = self.decode_split(sm_count);
                split.workspace_bytes(tok).max(16) + 4 * split.tiles as u64
            }
        }
    }
}

/// The buffers of one GEMM launch: any cudarc slice or view of the plan's context, row-major and
/// contiguous (A: at least M x K elements, B: K x N, C: M x N of the plan's output type).
pub struct GemmTensors<'b, C: GemmOutput> {
    pub a: &'b dyn DevicePtr<bf16>,
    pub b: &'b dyn DevicePtr<bf16>,
    pub c: &'b mut dyn DevicePtrMut<C>,
}

/// What one launch ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmLaunch {
    /// [`GemmKernel::Tiled`] or [`GemmKernel::Decode`].
    pub kernel: GemmKernel,
    /// CTAs launched.
    pub grid: u32,
    /// Decode: the token bucket (the wgmma N, M rounded up to 8, 16, ..., 256).
    pub tok: Option<u32>,
}

/// The tiled kernel of a plan.
struct Tiled {
    spec: &'static KernelSpec,
    func: CudaFunction,
    /// bf16 C with 16-byte rows is written by TMA from shared memory; otherwise direct stores.
    tma_store: bool,
    /// The fused-ring diagnostic's timeline buffer (0: none).
    trace: u64,
}

/// The decode kernels of a plan: their split and workspace.
struct Decode {
    split: DecodeSplit,
    /// The kernel of each bucket up to the plan's largest, in `TOK_BUCKETS` order.
    funcs: Vec<(u32, &'static KernelSpec, CudaFunction)>,
    /// Two f32 partial slots per CTA, sized for the largest bucket.
    ws: CudaSlice<u8>,
    /// One counter per tile, zero between launches (the reducing CTA resets it).
    counters: CudaSlice<u32>,
}

/// A GEMM for fixed N, K, B layout and C type: launch it on each step's buffers and M.
///
/// A launch holds cudarc's guards of every buffer until it is enqueued, so dropping a buffer
/// (or the plan) right after a launch on another stream is safe: the free waits for the kernel.
/// `launch` takes `&mut self` because a decode launch writes the plan's workspace: two launches
/// of one plan can then never overlap in safe code, and on two streams the second waits for the
/// first (the workspace's cudarc write guard), with no rule left to the caller.
pub struct GemmPlan {
    device: Device,
    config: GemmConfig,
    /// CTAs a launch may use.
    cta_cap: u32,
    tiled: Option<Tiled>,
    decode: Option<Decode>,
}

impl GemmPlan {
    /// A plan for `config` on `device`: checks the configuration and loads the kernels it can
    /// run; takes no buffer and no stream of the caller's. A plan that can run the decode
    /// kernels (`Auto` or `Decode`) allocates their workspace
    /// ([`GemmConfig::workspace_bytes`]) on the device's internal side stream and waits for its
    /// zeroing there: a one-time host wait (it also waits for the last launch of a dropped plan
    /// whose workspace the side stream frees). Build plans once, not per step.
    pub fn new(device: &Device, config: GemmConfig) -> Result<Self> {
        let side = device.side_stream()?.clone();
        let plan = Self::build(device, config, &side)?;
        if plan.decode.is_some() {
            side.synchronize()?;
        }
        Ok(plan)
    }

    /// The plan, with the decode workspace (if any) allocated and zeroed on `ws_stream` (not
    /// waited for: launches on other streams wait for it through cudarc's events).
    fn build(device: &Device, config: GemmConfig, ws_stream: &Arc<CudaStream>) -> Result<Self> {
        config.validate()?;
        check::stream_on(OP, device, ws_stream)?;
        let sm_count = device.sm_count();
        let tiled = if config.has_tiled() {
            let spec = match config.b_layout {
                BLayout::NxK => &kernels::GEMM_BF16_NK,
                BLayout::KxN => &kernels::GEMM_BF16_KN,
            };
            Some(Tiled {
                spec,
                func: device.function(spec)?,
                tma_store: config.out == OutDtype::Bf16 && config.n % 8 == 0,
                trace: 0,
            })
        } else {
            None
        };
        let decode = match config.decode_tok() {
            None => None,
            Some(max_tok) => {
                let split = config.decode_split(sm_count);
                let kn = config.b_layout == BLayout::KxN;
                let mut funcs = vec![];
                for tok in gemm_decode::TOK_BUCKETS.into_iter().filter(|&t| t <= max_tok) {
                    let spec = gemm_decode::kernel(tok, kn);
                    funcs.push((tok, spec, device.function(spec)?));
                }
                let ws_bytes = split.workspace_bytes(max_tok).max(16) as usize;
                // SAFETY: no launch reads a partial slot before a launch has written it (a
                // tile's summing CTA reads only the slots of contributors that counted), so
                // the slots need no zeroing; u8 has no invalid values.
                let ws = unsafe { ws_stream.alloc::<u8>(ws_bytes) }?;
                let counters = ws_stream.alloc_zeros::<u32>(split.tiles as usize)?;
                Some(Decode {
                    split,
                    funcs,
                    ws,
                    counters,
                })
            }
        };
        Ok(GemmPlan {
            device: device.clone(),
            config,
            cta_cap: config.cta_cap(sm_count),
            tiled,
            decode,
        })
    }

    /// Diagnostic: the same plan on GEMM+ReduceScatter's ring (`ops::gemm_rs::TILE`: 3 stages,
    /// whole-tile epilogue staging, the fused kernels' register split), to measure what that
    /// ring costs the GEMM alone. A `Tiled` plan with N x K B and TMA-stored bf16 C only.
    pub fn on_fused_ring(mut self) -> Result<Self> {
        let ok = self.decode.is_none()
            && self
                .tiled
                .as_ref()
                .is_some_and(|t| t.spec == &kernels::GEMM_BF16_NK && t.tma_store);
        let Some(t) = self.tiled.as_mut().filter(|_| ok) else {
            return Err(Error::Unsupported(format!(
                "{OP}: the fused-ring diagnostic needs GemmKernel::Tiled, B as N x K and a TMA-stored bf16 C"
            )));
        };
        t.spec = &kernels::GEMM_BF16_NK_FUSED_RING;
        t.func = self.device.function(t.spec)?;
        Ok(self)
    }

    /// Diagnostic (a plan [`GemmPlan::on_fused_ring`] only): later launches record the fused
    /// kernels' per-tile timeline (`mkernel_config::trace`, one record set per CTA of the
    /// launch's grid) into the device buffer at `buf`; `None` stops it.
    ///
    /// # Safety
    /// `buf` must hold `mkernel_config::trace::words(grid)` u64 words for the grid of every such
    /// launch ([`GemmPlan::launch_info`]) while they run.
    pub unsafe fn set_trace(&mut self, buf: Option<u64>) -> Result<()> {
        match self.tiled.as_mut() {
            Some(t) if t.spec == &kernels::GEMM_BF16_NK_FUSED_RING => {
                t.trace = buf.unwrap_or(0);
                Ok(())
            }
            _ => Err(Error::Unsupported(format!(
                "{OP}: only the fused-ring diagnostic records a timeline"
            ))),
        }
    }

    /// What a launch of `m` rows runs: the kernel, its grid and (decode) its token bucket.
    pub fn launch_info(&self, m: usize) -> Result<GemmLaunch> {
        if m == 0 || m > self.config.max_m {
            return Err(Error::Shape {
                op: OP,
                reason: format!("m={m} must be in 1..={} (the plan's max_m)", self.config.max_m),
            });
        }
        match &self.decode {
            Some(d) if m <= gemm_decode::DECODE_MAX_M as usize => Ok(GemmLaunch {
                kernel: GemmKernel::Decode,
                grid: d.split.grid,
                tok: gemm_decode::tok_for(m as u32),
            }),
            _ => {
                let t = GemmTile::DEFAULT;
                let tiles = m.div_ceil(t.block_m as usize) * self.config.n.div_ceil(t.block_n as usize);
                Ok(GemmLaunch {
                    kernel: GemmKernel::Tiled,
                    grid: tiles.min(self.cta_cap as usize) as u32,
                    tok: None,
                })
            }
        }
    }

    /// Enqueues `c[..m x n] = a[..m x k] * b` on `stream`: one kernel, its tensor maps and
    /// arguments passed by value. `m` is this launch's rows (`1..=max_m`). Refuses a stream that
    /// is capturing a CUDA graph ([`Error::Capturing`]): capture with
    /// [`GemmPlan::launch_captured`].
    pub fn launch<C: GemmOutput>(
        &mut self,
        stream: &Arc<CudaStream>,
        t: GemmTensors<'_, C>,
        m: usize,
    ) -> Result<GemmLaunch> {
        check::not_capturing(OP, stream, "GemmPlan::launch_captured")?;
        self.enqueue(stream, None, t, m)
    }

    /// As [`GemmPlan::launch`], into the CUDA graph `stream` is capturing (it also launches on
    /// a stream that is not capturing). The graph keeps the buffers' addresses and a copy of
    /// the launch's parameters; a decode launch (M <= 256 unless the plan is `Tiled`) also
    /// keeps the plan's workspace address. The addresses are taken without cudarc's
    /// stream-ordering waits (a wait on an event recorded outside the capture would invalidate
    /// it).
    ///
    /// # Safety
    /// While the graph (or any graph instantiated from it) can be replayed, every buffer in `t`
    /// stays allocated, and the caller orders the replays with other work on those buffers
    /// (replays run in the order of the stream they are launched on). For a decode launch, the
    /// plan also stays alive, and its replays never run at the same time as another launch of
    /// the plan or a replay of another graph captured from it.
    pub unsafe fn launch_captured<C: GemmOutput>(
        &mut self,
        stream: &Arc<CudaStream>,
        t: GemmTensors<'_, C>,
        m: usize,
    ) -> Result<GemmLaunch> {
        let side = self.device.side_stream()?.clone();
        self.enqueue(stream, Some(&side), t, m)
    }

    /// The launch on `stream`, with the buffers' addresses (and cudarc's guards) taken on
    /// `ptrs` (`stream` itself when `None`).
    fn enqueue<C: GemmOutput>(
        &mut self,
        stream: &Arc<CudaStream>,
        ptrs: Option<&Arc<CudaStream>>,
        t: GemmTensors<'_, C>,
        m: usize,
    ) -> Result<GemmLaunch> {
        check::stream_on(OP, &self.device, stream)?;
        let info = self.launch_info(m)?;
        if C::DTYPE != self.config.out {
            return Err(Error::Shape {
                op: OP,
                reason: format!(
                    "C holds {:?} elements; the plan was made for {:?} C (GemmConfig::out)",
                    C::DTYPE,
                    self.config.out
                ),
            });
        }
        check::buffer_on(OP, "A", &self.device, t.a)?;
        check::buffer_on(OP, "B", &self.device, t.b)?;
        check::buffer_on(OP, "C", &self.device, &*t.c)?;
        let shape = self.config.shape(m);
        let (la, lb, lc) = shape.lens();
        check::lens(OP, &[("A", t.a.len(), la), ("B", t.b.len(), lb), ("C", t.c.len(), lc)])?;
        let ptrs = ptrs.unwrap_or(stream);
        // Guards: held until the launch is enqueued (dropped at the end of this function).
        let (pa, _ga) = t.a.device_ptr(ptrs);
        let (pb, _gb) = t.b.device_ptr(ptrs);
        let (pc, _gc) = t.c.device_ptr_mut(ptrs);
        check::aligned16(OP, &[("A", pa), ("B", pb), ("C", pc)])?;
        let (m, n, k) = (m as u64, self.config.n as u64, self.config.k as u64);
        let f32_out = (self.config.out == OutDtype::F32) as u32;
        match (info.kernel, &mut self.decode, &self.tiled) {
            (GemmKernel::Decode, Some(d), _) => {
                let tok = info.tok.expect("a decode launch has a bucket");
                let (_, spec, func) = d
                    .funcs
                    .iter()
                    .find(|f| f.0 == tok)
                    .expect("the plan loaded every bucket up to its max_m");
                let map_w = match self.config.b_layout {
                    BLayout::NxK => encode_bf16_sw128_packed(pb, k, n, gemm_decode::BLOCK_K, gemm_decode::W_ROWS)?,
                    BLayout::KxN => encode_bf16_sw128_packed(pb, n, k, 64, gemm_decode::BLOCK_K)?,
                };
                let map_x = encode_bf16_sw128_packed(pa, k, m, gemm_decode::BLOCK_K, tok)?;
                let (ws, _gw) = d.ws.device_ptr_mut(ptrs);
                let (counters, _gn) = d.counters.device_ptr_mut(ptrs);
                let block = ParamBlock::new(DecodeParams {
                    map_w: map_w.opaque,
                    map_x: map_x.opaque,
                    args: DecodeArgs {
                        ws,
                        counters,
                        m: m as u32,
                        n: n as u32,
                        k: k as u32,
                        ldc: n as u32,
                        f32_out,
                        _pad: 0,
                    },
                });
                let mut b = stream.launch_builder(func);
                b.arg(&block).arg(&pc);
                // SAFETY: the kernel takes one DecodeParams block by value and C's address; the
                // maps and addresses describe the borrowed buffers (lengths checked, guards held
                // until enqueued) and the plan's workspace, sized for the largest bucket with
                // counters left zero by every launch; `&mut self` keeps launches of the plan
                // from overlapping (its write guards order them across streams).
                unsafe { b.launch(Device::launch_config(spec, info.grid)) }?;
            }
            (_, _, Some(tl)) => {
                let tile = GemmTile::DEFAULT;
                let map_a = encode_bf16_sw128_packed(pa, k, m, tile.block_k, tile.block_m)?;
                let map_b = match self.config.b_layout {
                    BLayout::NxK => encode_bf16_sw128_packed(pb, k, n, tile.block_k, tile.block_n)?,
                    BLayout::KxN => encode_bf16_sw128_packed(pb, n, k, 64, tile.block_k)?,
                };
                let map_c = if tl.tma_store {
                    encode_bf16_sw128_packed(pc, n, m, GemmTile::EPILOGUE_BOX_COLS, GemmTile::EPILOGUE_BOX_ROWS)?.opaque
                } else {
                    [0; 16]
                };
                let block = ParamBlock::new(GemmParams {
                    map_a: map_a.opaque,
                    map_b: map_b.opaque,
                    map_c,
                    args: GemmArgs {
                        trace: tl.trace,
                        m: m as u32,
                        n: n as u32,
                        k: k as u32,
                        ldc: n as u32,
                        tma_store: tl.tma_store as u32,
                        f32_out,
                    },
                });
                let mut b = stream.launch_builder(&tl.func);
                b.arg(&block).arg(&pc);
                // SAFETY: the kernel (mk_gemm_bf16_{nk,kn} or the fused-ring diagnostic) takes one
                // GemmParams block by value and C's address; the maps and addresses describe the
                // borrowed buffers, whose lengths were checked and whose guards are held until
                // this launch is enqueued; a trace buffer is the caller's (`set_trace`).
                unsafe { b.launch(Device::launch_config(tl.spec, info.grid)) }?;
            }
            _ => unreachable!("launch_info picks a path the plan has"),
        }
        Ok(info)
    }

    /// The configuration the plan was made for.
    pub fn config(&self) -> GemmConfig {
        self.config
    }
    /// Bytes of device memory the plan owns (its decode workspace; 0 without one).
    pub fn workspace_bytes(&self) -> u64 {
        self.decode
            .as_ref()
            .map_or(0, |d| d.ws.len() as u64 + 4 * d.counters.len() as u64)
    }
    /// Decode plans: the weight tiles of 128 rows and the K blocks of each (the stream-K split's
    /// units are their product, spread over [`GemmLaunch::grid`] CTAs).
    pub fn decode_split(&self) -> Option<(u32, u32)> {
        self.decode.as_ref().map(|d| (d.split.tiles, d.split.k_blocks))
    }
    /// Whether the tiled kernel writes C through shared memory and TMA (bf16 C, N a multiple of
    /// 8); the decode kernels store C directly.
    pub fn tma_store(&self) -> bool {
        self.tiled.as_ref().is_some_and(|t| t.tma_store)
    }
    /// The tiled kernel's configuration (a decode launch's: [`GemmPlan::launch_info`]).
    pub fn tile(&self) -> GemmTile {
        GemmTile::DEFAULT
    }
}

/// One-shot `c = a * b` with bf16 or f32 C (plans, then launches on `stream`; keep a
/// [`GemmPlan`] to launch every step or inside a CUDA graph). For M <= 256 the decode workspace
/// is allocated on `stream` and freed after the launch (stream-ordered, no host wait). Refuses
/// a capturing stream ([`Error::Capturing`]).
pub fn gemm_bf16<C: GemmOutput>(
    device: &Device,
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    c: &mut impl DevicePtrMut<C>,
    shape: GemmShape,
) -> Result<GemmLaunch> {
    check::not_capturing(OP, stream, "GemmPlan::launch_captured")?;
    let mut plan = GemmPlan::build(device, GemmConfig::for_shape(shape, C::DTYPE), stream)?;
    plan.launch(stream, GemmTensors { a, b, c }, shape.m)
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
    #[test]
    fn configs_are_validated() {
        let c = GemmConfig {
            max_m: 64,
            n: 64,
            k: 64,
            ..GemmConfig::default()
        };
        assert!(c.validate().is_ok());
        assert!(GemmConfig::default().validate().is_err(), "no shape");
        let e = GemmConfig {
            max_m: 257,
            kernel: GemmKernel::Decode,
            ..c
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("max_m=257"), "{e}");
        assert!(GemmConfig { sms: Some(0), ..c }.validate().is_err());
        assert!(GemmConfig { k: 100, ..c }.validate().is_err());
        assert_eq!(GemmKernel::for_m(256), GemmKernel::Decode);
        assert_eq!(GemmKernel::for_m(257), GemmKernel::Tiled);
    }
    #[test]
    fn paths_and_workspace_follow_the_config() {
        let c = GemmConfig {
            max_m: 4096,
            n: 4096,
            k: 4096,
            ..GemmConfig::default()
        };
        assert!(c.has_tiled() && c.decode_tok() == Some(256));
        // 32 tiles x 64 K blocks over 132 SMs: 132 CTAs, two 128 x 256 f32 slots each, 32 counters.
        assert_eq!(c.workspace_bytes(132), 132 * 2 * 128 * 256 * 4 + 32 * 4);
        let small = GemmConfig { max_m: 7, ..c };
        assert!(!small.has_tiled() && small.decode_tok() == Some(8));
        assert_eq!(small.workspace_bytes(132), 132 * 2 * 128 * 8 * 4 + 32 * 4);
        let tiled = GemmConfig {
            kernel: GemmKernel::Tiled,
            ..small
        };
        assert!(tiled.has_tiled() && tiled.decode_tok().is_none());
        assert_eq!(tiled.workspace_bytes(132), 0);
        // A grid cap changes the split: 7 CTAs.
        assert_eq!(
            GemmConfig { sms: Some(7), ..small }.workspace_bytes(132),
            7 * 2 * 128 * 8 * 4 + 32 * 4
        );
        // Invalid configurations size to something without panicking.
        let _ = GemmConfig::default().workspace_bytes(132);
    }
}
