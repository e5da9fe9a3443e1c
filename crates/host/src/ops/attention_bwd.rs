//! FlashAttention backward on one GPU: dQ, dK, dV of `O = softmax(scale * Q K^T + mask) V` from
//! Q, K, V, O, dO and the forward's log-sum-exp (layouts as [`super::attention`]; GQA/MQA dK, dV
//! summed over each group; causal bottom-right; batched or packed varlen).
//!
//! A [`FlashAttentionBackwardPlan`] is made from shapes only ([`BackwardShape`]): no buffer, no
//! stream, no device allocation. [`FlashAttentionBackwardPlan::launch`] takes the buffers
//! ([`BackwardBuffers`]) and a workspace of [`FlashAttentionBackwardPlan::workspace_bytes`]
//! bytes, holds cudarc's read / write guards of every buffer until its three kernels are
//! enqueued, and passes every address as a kernel parameter: nothing is uploaded.
//! [`FlashAttentionBackwardPlan::launch_raw`] takes the addresses instead (no cudarc event
//! touched): that is the call to capture in a CUDA graph, on any stream.
//!
//! Kernels, in stream order: the preprocess (`delta = rowsum(dO * O)`, the LSE in log2 units,
//! the f32 dQ accumulator zeroed), the main kernel (dK, dV; dQ into the accumulator with
//! `red.global.add`), the dQ convert (`dQ = bf16(scale * acc)`). docs/attention.md, "Backward".
use super::attention::{check_cu_seqlens, pairs, AttentionHeads};

/// What a backward plan worked out from its sequences.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SequenceInfo {
    pub batch: usize,
    /// Longest query sequence.
    pub max_seqlen_q: usize,
    pub total_q: usize,
    pub total_k: usize,
    /// Backward FLOPs: 2.5 x the forward's (10 x visible pairs x head_dim x query heads).
    pub flops: f64,
}
use crate::error::{Error, Result};
use crate::runtime::Device;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg};
use half::bf16;
use mkernel_config::ops::attention_bwd::{
    AttentionBwdArgs, AttentionBwdTile, BWD_ELEMENTWISE_THREADS, FLASH_ATTN_BWD_D128, FLASH_ATTN_BWD_D64,
    FLASH_ATTN_BWD_DQ, FLASH_ATTN_BWD_PREP,
};
use mkernel_config::KernelSpec;
use std::sync::Arc;

const OP: &str = "flash attention backward";

/// The argument block as a by-value kernel parameter (plain data).
#[repr(transparent)]
#[derive(Clone, Copy)]
struct Param(AttentionBwdArgs);
// SAFETY: `AttentionBwdArgs` is `#[repr(C)]` plain data (`Pod`), the kernels' parameter type.
unsafe impl DeviceRepr for Param {}

/// How the rows form sequences, as host values (the plan's shape).
#[derive(Clone, Debug, PartialEq)]
pub enum BackwardSequences {
    /// `batch` sequences of `seqlen_q` queries and `seqlen_k` keys each.
    Batched {
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
    },
    /// Packed sequences: `batch + 1` non-decreasing i32 offsets starting at 0 (flash-attn's
    /// `cu_seqlens`). The device copies passed at launch must hold the same values.
    Varlen {
        cu_seqlens_q: Vec<i32>,
        cu_seqlens_k: Vec<i32>,
    },
}

/// The shape a backward plan is made for.
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardShape {
    pub seqs: BackwardSequences,
    pub heads: AttentionHeads,
}

/// The buffers of one backward launch (layouts as the forward's; `o` and `lse` are the
/// forward's outputs for these Q, K, V).
pub struct BackwardBuffers<'b> {
    pub q: &'b CudaSlice<bf16>,
    pub k: &'b CudaSlice<bf16>,
    pub v: &'b CudaSlice<bf16>,
    pub o: &'b CudaSlice<bf16>,
    pub d_o: &'b CudaSlice<bf16>,
    pub lse: &'b CudaSlice<f32>,
    pub dq: &'b mut CudaSlice<bf16>,
    pub dk: &'b mut CudaSlice<bf16>,
    pub dv: &'b mut CudaSlice<bf16>,
    /// The device `cu_seqlens_q`, `cu_seqlens_k` of a [`BackwardSequences::Varlen`] shape.
    pub cu_seqlens: Option<(&'b CudaSlice<i32>, &'b CudaSlice<i32>)>,
}

/// Device addresses of one backward launch ([`FlashAttentionBackwardPlan::launch_raw`]):
/// the buffers of [`BackwardBuffers`] and the workspace; `cu_seqlens_*` 0 for a batched shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackwardPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub d_o: u64,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub workspace: u64,
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
}

/// Byte offsets of the workspace's parts (each 256-byte aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WorkspaceLayout {
    /// f32 dQ accumulator `[total_q][heads_q][head_dim]`.
    dq_acc: u64,
    /// f32 LSE in log2 units `[heads_q][total_q]`.
    lse2: u64,
    /// f32 `rowsum(dO * O)` `[heads_q][total_q]`.
    delta: u64,
    bytes: u64,
}

fn workspace_layout(total_q: usize, heads: &AttentionHeads) -> WorkspaceLayout {
    let up = |x: u64| x.div_ceil(256) * 256;
    let acc = up((total_q * heads.heads_q * heads.head_dim * 4) as u64);
    let row = up((total_q * heads.heads_q * 4) as u64);
    WorkspaceLayout {
        dq_acc: 0,
        lse2: acc,
        delta: acc + row,
        bytes: acc + 2 * row,
    }
}

/// A FlashAttention backward for one shape; buffers come at launch.
pub struct FlashAttentionBackwardPlan {
    prep: CudaFunction,
    main: CudaFunction,
    convert: CudaFunction,
    spec: &'static KernelSpec,
    /// The argument block without addresses.
    args: AttentionBwdArgs,
    shape: BackwardShape,
    info: SequenceInfo,
    total_k: usize,
    /// CTAs of the main kernel (0: no key rows at all).
    grid: u32,
    /// CTAs of the preprocess and the convert.
    prep_grid: u32,
    convert_grid: u32,
    workspace: WorkspaceLayout,
}

/// Checks the shape; returns what the plan needs of it.
fn shape_info(shape: &BackwardShape) -> Result<(SequenceInfo, usize)> {
    shape.heads.validate()?;
    let bad = |reason: String| Err(Error::Shape { op: OP, reason });
    let (hq, d) = (shape.heads.heads_q, shape.heads.head_dim);
    let causal = shape.heads.causal;
    let (info, max_k) = match &shape.seqs {
        BackwardSequences::Batched {
            batch,
            seqlen_q,
            seqlen_k,
        } => {
            let (batch, sq, sk) = (*batch, *seqlen_q, *seqlen_k);
            if batch == 0 || sq == 0 || sk == 0 {
                return bad(format!(
                    "empty problem: batch = {batch}, seqlen_q = {sq}, seqlen_k = {sk}"
                ));
            }
            let info = SequenceInfo {
                batch,
                max_seqlen_q: sq,
                total_q: batch.saturating_mul(sq),
                total_k: batch.saturating_mul(sk),
                flops: 10.0 * (batch * hq * d) as f64 * pairs(sq, sk, causal),
            };
            (info, sk)
        }
        BackwardSequences::Varlen {
            cu_seqlens_q,
            cu_seqlens_k,
        } => {
            let (batch, max_q, total_q, total_k) = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)?;
            let lens = |cu: &[i32], b: usize| (cu[b + 1] - cu[b]) as usize;
            let max_k = (0..batch).map(|b| lens(cu_seqlens_k, b)).max().unwrap_or(0);
            let flops = (0..batch)
                .map(|b| 10.0 * (hq * d) as f64 * pairs(lens(cu_seqlens_q, b), lens(cu_seqlens_k, b), causal))
                .sum();
            let info = SequenceInfo {
                batch,
                max_seqlen_q: max_q,
                total_q,
                total_k,
                flops,
            };
            (info, max_k)
        }
    };
    // The kernels index rows x heads in 32 bits.
    let limit = 1usize << 31;
    if info.total_q.saturating_mul(hq) >= limit || info.total_k.saturating_mul(shape.heads.heads_kv) >= limit {
        return bad(format!(
            "{} query rows x {hq} heads or {} key rows x {} heads: at most 2^31 - 1",
            info.total_q, info.total_k, shape.heads.heads_kv
        ));
    }
    Ok((info, max_k))
}

impl FlashAttentionBackwardPlan {
    /// Bytes of workspace a launch of `shape` needs (the f32 dQ accumulator, the LSE in log2
    /// units and `delta`): `4 total_q heads_q (head_dim + 2)`, each part rounded up to 256.
    pub fn workspace_bytes(shape: &BackwardShape) -> Result<u64> {
        let (info, _) = shape_info(shape)?;
        Ok(workspace_layout(info.total_q, &shape.heads).bytes)
    }

    /// Plans the backward of `shape` on `device` (loads the kernels; no allocation, no stream).
    pub fn new(device: &Device, shape: BackwardShape) -> Result<Self> {
        let (info, max_k) = shape_info(&shape)?;
        let h = shape.heads;
        let (spec, tile) = match h.head_dim {
            64 => (&FLASH_ATTN_BWD_D64, AttentionBwdTile::D64),
            _ => (&FLASH_ATTN_BWD_D128, AttentionBwdTile::D128),
        };
        let (seqlen_q, seqlen_k) = match shape.seqs {
            BackwardSequences::Batched { seqlen_q, seqlen_k, .. } => (seqlen_q, seqlen_k),
            BackwardSequences::Varlen { .. } => (0, 0),
        };
        let args = AttentionBwdArgs {
            batch: info.batch as u32,
            heads_q: h.heads_q as u32,
            heads_kv: h.heads_kv as u32,
            seqlen_q: seqlen_q as u32,
            seqlen_k: seqlen_k as u32,
            total_q: info.total_q as u32,
            causal: h.causal as u32,
            scale_log2: h.scale() * std::f32::consts::LOG2_E,
            scale: h.scale(),
            ..AttentionBwdArgs::default()
        };
        let grid_of = |n: usize| -> Result<u32> {
            u32::try_from(n).map_err(|_| Error::Shape {
                op: OP,
                reason: format!("{n} CTAs exceed the grid limit"),
            })
        };
        let grid = grid_of(max_k.div_ceil(tile.block_n as usize) * info.batch * h.heads_kv)?;
        let cap = 8 * device.sm_count() as usize;
        let warps = (BWD_ELEMENTWISE_THREADS / 32) as usize;
        let prep_grid = (info.total_q * h.heads_q).div_ceil(warps).clamp(1, cap) as u32;
        let convert_grid = (info.total_q * h.heads_q * h.head_dim)
            .div_ceil(8 * BWD_ELEMENTWISE_THREADS as usize)
            .clamp(1, cap) as u32;
        Ok(FlashAttentionBackwardPlan {
            prep: device.function(&FLASH_ATTN_BWD_PREP)?,
            main: device.function(spec)?,
            convert: device.function(&FLASH_ATTN_BWD_DQ)?,
            spec,
            args,
            workspace: workspace_layout(info.total_q, &h),
            total_k: info.total_k,
            shape,
            info,
            grid,
            prep_grid,
            convert_grid,
        })
    }

    /// Enqueues the backward on `stream`: reads `b.q, k, v, o, d_o, lse` (and `cu_seqlens`),
    /// writes `b.dq, dk, dv` and `workspace` (at least [`Self::workspace_bytes`] bytes). Every
    /// address is a kernel parameter, so the launch can be captured in a CUDA graph.
    pub fn launch(
        &self,
        stream: &Arc<CudaStream>,
        b: BackwardBuffers<'_>,
        workspace: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let h = &self.shape.heads;
        let (tq, tk) = (self.info.total_q, self.total_k);
        let (q_elems, kv_elems) = (tq * h.heads_q * h.head_dim, tk * h.heads_kv * h.head_dim);
        crate::check::lens(
            OP,
            &[
                ("Q", b.q.len(), q_elems),
                ("K", b.k.len(), kv_elems),
                ("V", b.v.len(), kv_elems),
                ("O", b.o.len(), q_elems),
                ("dO", b.d_o.len(), q_elems),
                ("LSE", b.lse.len(), tq * h.heads_q),
                ("dQ", b.dq.len(), q_elems),
                ("dK", b.dk.len(), kv_elems),
                ("dV", b.dv.len(), kv_elems),
                ("workspace", workspace.len(), self.workspace.bytes as usize),
            ],
        )?;
        let cu = match (&self.shape.seqs, b.cu_seqlens) {
            (BackwardSequences::Batched { .. }, None) => None,
            (BackwardSequences::Varlen { cu_seqlens_q, .. }, Some((cq, ck))) => {
                let n = cu_seqlens_q.len();
                crate::check::exact_lens(OP, &[("cu_seqlens_q", cq.len(), n), ("cu_seqlens_k", ck.len(), n)])?;
                Some((cq, ck))
            }
            (BackwardSequences::Batched { .. }, Some(_)) => {
                return Err(Error::Shape {
                    op: OP,
                    reason: "cu_seqlens given for a batched plan".into(),
                })
            }
            (BackwardSequences::Varlen { .. }, None) => {
                return Err(Error::Shape {
                    op: OP,
                    reason: "a varlen plan needs the device cu_seqlens at launch".into(),
                })
            }
        };
        let capturing =
            stream.capture_status()? != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if capturing && stream.context().is_managing_stream_synchronization() {
            return Err(Error::OutOfRange {
                op: OP,
                reason:
                    "launch inside a CUDA graph capture would wait on cudarc's events of the buffers, recorded outside \
                         the capture; take the addresses before the capture and capture launch_raw"
                        .into(),
            });
        }
        // The guards record the reads and writes on `stream` when dropped, after the launches.
        let (q, _gq) = b.q.device_ptr(stream);
        let (k, _gk) = b.k.device_ptr(stream);
        let (v, _gv) = b.v.device_ptr(stream);
        let (o, _go) = b.o.device_ptr(stream);
        let (d_o, _gdo) = b.d_o.device_ptr(stream);
        let (lse, _glse) = b.lse.device_ptr(stream);
        let (dq, _gdq) = b.dq.device_ptr_mut(stream);
        let (dk, _gdk) = b.dk.device_ptr_mut(stream);
        let (dv, _gdv) = b.dv.device_ptr_mut(stream);
        let (ws, _gws) = workspace.device_ptr_mut(stream);
        let (cu_seqlens_q, _gcq) = match cu {
            Some((cq, _)) => {
                let (p, g) = cq.device_ptr(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (cu_seqlens_k, _gck) = match cu {
            Some((_, ck)) => {
                let (p, g) = ck.device_ptr(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        let ptrs = BackwardPtrs {
            q,
            k,
            v,
            o,
            d_o,
            lse,
            dq,
            dk,
            dv,
            workspace: ws,
            cu_seqlens_q,
            cu_seqlens_k,
        };
        // SAFETY: the addresses are of the buffers checked above, guarded until the launches
        // are enqueued.
        unsafe { self.launch_raw(stream, &ptrs) }
    }

    /// Enqueues the backward on `stream` from raw device addresses (the layer under
    /// [`Self::launch`], and the one to capture in a CUDA graph: it touches no cudarc event).
    ///
    /// # Safety
    /// Every address is a device allocation of `stream`'s context holding what
    /// [`Self::launch`] checks (`q, k, v, o, d_o` bf16 and `lse` f32 of the shape, `dq, dk, dv`
    /// bf16 writable, `workspace` [`Self::workspace_bytes`] writable bytes, `cu_seqlens_*` the
    /// plan's offsets as i32 for a varlen shape), alive and not accessed by other work until the
    /// launches complete (or, captured, until every replay of the graph completes).
    pub unsafe fn launch_raw(&self, stream: &CudaStream, p: &BackwardPtrs) -> Result<()> {
        let h = &self.shape.heads;
        let varlen = matches!(self.shape.seqs, BackwardSequences::Varlen { .. });
        if varlen != (p.cu_seqlens_q != 0 && p.cu_seqlens_k != 0) {
            return Err(Error::Shape {
                op: OP,
                reason: "cu_seqlens addresses are needed by (and only by) a varlen plan".into(),
            });
        }
        crate::check::aligned16(
            OP,
            &[
                ("Q", p.q),
                ("K", p.k),
                ("V", p.v),
                ("dO", p.d_o),
                ("dQ", p.dq),
                ("workspace", p.workspace),
            ],
        )?;
        let w = self.workspace;
        let args = Param(AttentionBwdArgs {
            q: p.q,
            k: p.k,
            v: p.v,
            o: p.o,
            d_o: p.d_o,
            lse: p.lse,
            dq: p.dq,
            dk: p.dk,
            dv: p.dv,
            dq_acc: p.workspace + w.dq_acc,
            lse2: p.workspace + w.lse2,
            delta: p.workspace + w.delta,
            cu_seqlens_q: p.cu_seqlens_q,
            cu_seqlens_k: p.cu_seqlens_k,
            ..self.args
        });
        let head_dim = h.head_dim as u32;
        let n = (self.info.total_q * h.heads_q * h.head_dim) as u64;
        // SAFETY: each kernel takes the `AttentionBwdArgs` block by value (plus the head dim or
        // the element count); the caller guarantees the addresses; the workspace parts are
        // disjoint.
        unsafe {
            stream
                .launch_builder(&self.prep)
                .arg(&args)
                .arg(&head_dim)
                .launch(Device::launch_config(&FLASH_ATTN_BWD_PREP, self.prep_grid))?;
            if self.grid > 0 {
                stream
                    .launch_builder(&self.main)
                    .arg(&args)
                    .launch(Device::launch_config(self.spec, self.grid))?;
            }
            stream
                .launch_builder(&self.convert)
                .arg(&args)
                .arg(&n)
                .launch(Device::launch_config(&FLASH_ATTN_BWD_DQ, self.convert_grid))?;
        }
        Ok(())
    }

    /// CTAs of the main kernel (one per key block, sequence and key/value head).
    pub fn grid(&self) -> u32 {
        self.grid
    }
    /// Batch, lengths and FLOPs (backward: 2.5 x the forward's, i.e. 10 x rows x keys x head_dim
    /// over the visible pairs) of the planned problem.
    pub fn info(&self) -> SequenceInfo {
        self.info
    }
    /// The shape the plan was made for.
    pub fn shape(&self) -> &BackwardShape {
        &self.shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn shape(seqs: BackwardSequences) -> BackwardShape {
        BackwardShape {
            seqs,
            heads: AttentionHeads {
                heads_q: 4,
                heads_kv: 2,
                head_dim: 128,
                causal: true,
                softmax_scale: None,
            },
        }
    }
    #[test]
    fn workspace_is_known_from_the_shape() {
        let s = shape(BackwardSequences::Batched {
            batch: 2,
            seqlen_q: 100,
            seqlen_k: 300,
        });
        // acc 200 x 4 x 128 x 4 = 409600 (256-aligned), two rows of 200 x 4 x 4 = 3200 -> 3328.
        assert_eq!(
            FlashAttentionBackwardPlan::workspace_bytes(&s).unwrap(),
            409600 + 2 * 3328
        );
        let v = shape(BackwardSequences::Varlen {
            cu_seqlens_q: vec![0, 1, 1, 5],
            cu_seqlens_k: vec![0, 0, 7, 9],
        });
        // acc 5 x 4 x 128 x 4 = 10240, rows 5 x 4 x 4 = 80 -> 256.
        assert_eq!(
            FlashAttentionBackwardPlan::workspace_bytes(&v).unwrap(),
            10240 + 2 * 256
        );
        let bad = shape(BackwardSequences::Varlen {
            cu_seqlens_q: vec![0, 5, 4],
            cu_seqlens_k: vec![0, 5, 6],
        });
        assert!(FlashAttentionBackwardPlan::workspace_bytes(&bad).is_err());
        let mut d96 = s.clone();
        d96.heads.head_dim = 96;
        assert!(FlashAttentionBackwardPlan::workspace_bytes(&d96).is_err());
    }
}
