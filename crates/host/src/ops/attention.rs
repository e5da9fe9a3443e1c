//! FlashAttention forward on one GPU: `O = softmax(scale * Q K^T + mask) V` and the per-row
//! log-sum-exp, bf16 in and out, f32 softmax.
//!
//! Layouts (row-major, contiguous):
//! - batched: Q and O `[batch][seqlen_q][heads_q][head_dim]`, K and V
//!   `[batch][seqlen_k][heads_kv][head_dim]`, LSE (f32) `[batch][heads_q][seqlen_q]`;
//! - packed variable-length ([`Sequences::Varlen`]): Q and O `[total_q][heads_q][head_dim]`,
//!   K and V `[total_k][heads_kv][head_dim]`, sequence `b` at rows `cu_seqlens[b]..cu_seqlens[b+1]`,
//!   LSE `[heads_q][total_q]`.
//!
//! Head dim 64 or 128; GQA/MQA (`heads_kv` divides `heads_q`; query head `h` reads key/value head
//! `h / (heads_q / heads_kv)`); causal masks are aligned to the bottom right as in flash-attn
//! (query `i` of a sequence sees keys `j <= i + seqlen_k - seqlen_q`). A row that sees no key
//! gets O = 0 and LSE = -inf.
//!
//! A [`FlashAttentionPlan`] is made from the shapes that do not change between steps (heads,
//! head dim, mask, scale); each [`FlashAttentionPlan::launch`] takes the step's buffers and
//! sequence lengths, encodes their tensor maps on the host and passes them by value with the
//! arguments ([`crate::params`]): one kernel launch, no allocation, no upload, no host
//! synchronization, capturable in a CUDA graph. Every buffer's cudarc guard is held until the
//! launch is enqueued, so a free or another stream's use of the buffer waits for the kernel.
use crate::check;
use crate::error::{Error, Result};
use crate::params::ParamBlock;
use crate::runtime::Device;
use crate::tensor_map::{encode_bf16_sw128_3d, Tensor3d, TensorMap};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg, SyncOnDrop};
use half::bf16;
use mkernel_config::ops::attention::{
    AttentionArgs, AttentionParams, AttentionTile, BOX_COLS, FLASH_ATTN_FWD_D128, FLASH_ATTN_FWD_D64,
};
use mkernel_config::KernelSpec;
use std::sync::Arc;

const OP: &str = "flash attention";

/// Heads, head dimension, mask and scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionHeads {
    pub heads_q: usize,
    pub heads_kv: usize,
    /// 64 or 128.
    pub head_dim: usize,
    /// Causal mask, bottom-right aligned.
    pub causal: bool,
    /// Softmax scale; `None`: `1 / sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
}

impl AttentionHeads {
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::Shape { op: OP, reason });
        if self.head_dim != 64 && self.head_dim != 128 {
            return bad(format!("head_dim {} is not supported (64 or 128)", self.head_dim));
        }
        if self.heads_q == 0 || self.heads_kv == 0 {
            return bad(format!(
                "heads_q = {} and heads_kv = {} must be positive",
                self.heads_q, self.heads_kv
            ));
        }
        if self.heads_q % self.heads_kv != 0 {
            return bad(format!(
                "heads_q = {} is not a multiple of heads_kv = {} (GQA needs whole groups)",
                self.heads_q, self.heads_kv
            ));
        }
        if self.heads_q > 1 << 15 {
            return bad(format!("heads_q = {} is above 32768", self.heads_q));
        }
        if let Some(s) = self.softmax_scale {
            // Masked scores are -inf before scaling: a scale <= 0 would turn them into +inf or NaN.
            if !(s.is_finite() && s > 0.0) {
                return bad(format!("softmax_scale {s} must be finite and positive"));
            }
        }
        Ok(())
    }
    /// The scale the kernel applies.
    pub fn scale(&self) -> f32 {
        self.softmax_scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }
}

/// How the rows of Q, K and V form sequences.
#[derive(Clone, Copy)]
pub enum Sequences<'a> {
    /// `batch` sequences of `seqlen_q` queries and `seqlen_k` keys each.
    Batched {
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
    },
    /// Packed sequences: `cu_seqlens_*` hold `batch + 1` non-decreasing i32 row offsets starting
    /// at 0 (flash-attn's `cu_seqlens`), on the device; as in flash-attn, the caller states the
    /// longest query sequence and the total rows, so nothing is read back. The kernel clamps
    /// each sequence into `total_q` / `total_k` rows (bad offsets give wrong rows, never
    /// writes outside O and the LSE); query rows past `max_seqlen_q` in a sequence are not
    /// computed.
    Varlen {
        cu_seqlens_q: &'a dyn DevicePtr<i32>,
        cu_seqlens_k: &'a dyn DevicePtr<i32>,
        batch: usize,
        max_seqlen_q: usize,
        total_q: usize,
        total_k: usize,
    },
}

impl std::fmt::Debug for Sequences<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Sequences::Batched {
                batch,
                seqlen_q,
                seqlen_k,
            } => write!(
                f,
                "Batched {{ batch: {batch}, seqlen_q: {seqlen_q}, seqlen_k: {seqlen_k} }}"
            ),
            Sequences::Varlen {
                batch,
                max_seqlen_q,
                total_q,
                total_k,
                ..
            } => write!(
                f,
                "Varlen {{ batch: {batch}, max_seqlen_q: {max_seqlen_q}, total_q: {total_q}, total_k: {total_k} }}"
            ),
        }
    }
}

/// What a launch worked out from the sequences.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SequenceInfo {
    pub batch: usize,
    /// Longest query sequence.
    pub max_seqlen_q: usize,
    pub total_q: usize,
    pub total_k: usize,
    /// CTAs launched (persistent).
    pub grid: u32,
}

/// The buffers of one attention launch: any cudarc slice or view of the plan's context.
/// Layouts as in the module doc; `lse: None` writes no log-sum-exp.
pub struct AttentionTensors<'b> {
    pub q: &'b dyn DevicePtr<bf16>,
    pub k: &'b dyn DevicePtr<bf16>,
    pub v: &'b dyn DevicePtr<bf16>,
    pub o: &'b mut dyn DevicePtrMut<bf16>,
    pub lse: Option<&'b mut dyn DevicePtrMut<f32>>,
}

/// Checks `cu_seqlens` (host copies) and returns (batch, max_q, total_q, total_k).
pub fn check_cu_seqlens(cu_q: &[i32], cu_k: &[i32]) -> Result<(usize, usize, usize, usize)> {
    let bad = |reason: String| Err(Error::Shape { op: OP, reason });
    if cu_q.len() < 2 || cu_q.len() != cu_k.len() {
        return bad(format!(
            "cu_seqlens_q ({} entries) and cu_seqlens_k ({} entries) must both hold batch + 1 >= 2 offsets",
            cu_q.len(),
            cu_k.len()
        ));
    }
    let mut max_q = 0;
    for (name, cu) in [("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)] {
        if cu[0] != 0 {
            return bad(format!("{name}[0] = {} (must be 0)", cu[0]));
        }
        for b in 0..cu.len() - 1 {
            if cu[b + 1] < cu[b] {
                return bad(format!("{name} decreases at {}: {} -> {}", b + 1, cu[b], cu[b + 1]));
            }
            if name == "cu_seqlens_q" {
                max_q = max_q.max((cu[b + 1] - cu[b]) as usize);
            }
        }
    }
    Ok((
        cu_q.len() - 1,
        max_q,
        *cu_q.last().unwrap() as usize,
        *cu_k.last().unwrap() as usize,
    ))
}

/// Visible (query, key) pairs of one sequence of `q` queries and `k` keys, in closed form:
/// with a bottom-right causal mask row `i` sees `clamp(i + k - q + 1, 0, k)` keys.
pub fn pairs(q: usize, k: usize, causal: bool) -> f64 {
    if !causal {
        return q as f64 * k as f64;
    }
    let (q, k) = (q as i128, k as i128);
    let o = k - q + 1; // row i sees clamp(i + o, 0, k)
    let lo = (1 - o).clamp(0, q); // first row that sees a key
    let hi = (k - o).clamp(lo, q); // first row that sees every key
    let ramp = (hi - lo) * o + (lo + hi - 1) * (hi - lo) / 2;
    (ramp + (q - hi) * k) as f64
}

/// Attention FLOPs (4 x visible pairs x head_dim x query heads) of batched sequences.
pub fn batched_flops(heads: &AttentionHeads, batch: usize, seqlen_q: usize, seqlen_k: usize) -> f64 {
    4.0 * (batch * heads.heads_q * heads.head_dim) as f64 * pairs(seqlen_q, seqlen_k, heads.causal)
}

/// Attention FLOPs of packed sequences, from host copies of `cu_seqlens` (checked).
pub fn varlen_flops(heads: &AttentionHeads, cu_q: &[i32], cu_k: &[i32]) -> Result<f64> {
    check_cu_seqlens(cu_q, cu_k)?;
    Ok((0..cu_q.len() - 1)
        .map(|b| {
            let (lq, lk) = ((cu_q[b + 1] - cu_q[b]) as usize, (cu_k[b + 1] - cu_k[b]) as usize);
            4.0 * (heads.heads_q * heads.head_dim) as f64 * pairs(lq, lk, heads.causal)
        })
        .sum())
}

/// A FlashAttention forward for fixed heads: launch it on each step's buffers.
///
/// A launch holds cudarc's guards of every buffer until it is enqueued, so dropping a buffer
/// (or the plan) right after a launch on another stream is safe: the free waits for the kernel.
pub struct FlashAttentionPlan {
    device: Device,
    func: CudaFunction,
    spec: &'static KernelSpec,
    tile: AttentionTile,
    heads: AttentionHeads,
}

/// Words of one tensor map in ring attention's uploaded block.
pub(super) const MAP_WORDS: usize = 16;

/// The TMA map of a packed `[rows][heads][head_dim]` bf16 tensor, in boxes of `box_rows` rows of
/// one head.
pub(super) fn head_map(ptr: u64, head_dim: usize, heads: usize, rows: usize, box_rows: u32) -> Result<TensorMap> {
    encode_bf16_sw128_3d(
        Tensor3d {
            ptr,
            cols: head_dim as u64,
            heads: heads as u64,
            rows: rows as u64,
        },
        BOX_COLS,
        box_rows,
    )
}

/// The words of an attention plan's device block: the tensor maps, `MAP_WORDS` each, then the
/// argument block.
pub(super) fn block_words(maps: &[TensorMap], args: &[u64]) -> Vec<u64> {
    let mut words = vec![0u64; maps.len() * MAP_WORDS + args.len()];
    for (i, m) in maps.iter().enumerate() {
        words[i * MAP_WORDS..(i + 1) * MAP_WORDS].copy_from_slice(&m.opaque);
    }
    words[maps.len() * MAP_WORDS..].copy_from_slice(args);
    words
}

/// The address of a plan's uploaded block (`block`, at `block_addr`) for a launch on `stream`,
/// with the guard to hold until the launch is enqueued. Outside a capture the block is read
/// through cudarc's tracking (a free of the plan waits for the launch). During one, a wait on
/// the upload's event (recorded outside the capture) would be an isolation error; the plans
/// synchronize after the upload, so it finished before any capture.
pub(super) fn launch_block_addr<'s>(
    stream: &'s Arc<CudaStream>,
    block: &'s CudaSlice<u64>,
    block_addr: u64,
) -> Result<(u64, Option<SyncOnDrop<'s>>)> {
    use cudarc::driver::sys::CUstreamCaptureStatus;
    if stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok((block_addr, None));
    }
    let (p, r) = block.device_ptr(stream);
    Ok((p, Some(r)))
}

impl FlashAttentionPlan {
    /// A plan for `heads` on `device`: checks the heads and loads the kernel; allocates nothing
    /// and touches no stream.
    pub fn new(device: &Device, heads: AttentionHeads) -> Result<Self> {
        heads.validate()?;
        let (spec, tile) = match heads.head_dim {
            64 => (&FLASH_ATTN_FWD_D64, AttentionTile::D64),
            _ => (&FLASH_ATTN_FWD_D128, AttentionTile::D128),
        };
        Ok(FlashAttentionPlan {
            device: device.clone(),
            func: device.function(spec)?,
            spec,
            tile,
            heads,
        })
    }

    /// The heads the plan was made for.
    pub fn heads(&self) -> AttentionHeads {
        self.heads
    }

    /// Checks a launch's sequences and buffer lengths; returns what the launch covers.
    fn info(&self, seqs: &Sequences<'_>, t: &AttentionTensors<'_>) -> Result<SequenceInfo> {
        let bad = |reason: String| Err(Error::Shape { op: OP, reason });
        let (hq, hkv, d) = (self.heads.heads_q, self.heads.heads_kv, self.heads.head_dim);
        let (batch, max_seqlen_q, total_q, total_k) = match *seqs {
            Sequences::Batched {
                batch,
                seqlen_q,
                seqlen_k,
            } => {
                if batch == 0 || seqlen_q == 0 || seqlen_k == 0 {
                    return bad(format!(
                        "empty problem: batch = {batch}, seqlen_q = {seqlen_q}, seqlen_k = {seqlen_k}"
                    ));
                }
                let total = |s: usize| {
                    batch.checked_mul(s).ok_or_else(|| Error::Shape {
                        op: OP,
                        reason: format!("batch {batch} x sequence {s} overflows"),
                    })
                };
                (batch, seqlen_q, total(seqlen_q)?, total(seqlen_k)?)
            }
            Sequences::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
                batch,
                max_seqlen_q,
                total_q,
                total_k,
            } => {
                if batch == 0 || max_seqlen_q == 0 || total_q == 0 || total_k == 0 {
                    return bad(format!(
                        "empty problem: batch = {batch}, max_seqlen_q = {max_seqlen_q}, {total_q} query rows, {total_k} key rows"
                    ));
                }
                if max_seqlen_q > total_q {
                    return bad(format!("max_seqlen_q = {max_seqlen_q} is above total_q = {total_q}"));
                }
                check::buffer_on(OP, "cu_seqlens_q", &self.device, cu_seqlens_q)?;
                check::buffer_on(OP, "cu_seqlens_k", &self.device, cu_seqlens_k)?;
                let entries = batch.saturating_add(1);
                check::lens(
                    OP,
                    &[
                        ("cu_seqlens_q", cu_seqlens_q.len(), entries),
                        ("cu_seqlens_k", cu_seqlens_k.len(), entries),
                    ],
                )?;
                (batch, max_seqlen_q, total_q, total_k)
            }
        };
        if total_q >= 1 << 31 || total_k >= 1 << 31 {
            return bad(format!("{total_q} query / {total_k} key rows: at most 2^31 - 1"));
        }
        let m_blocks = max_seqlen_q.div_ceil(self.tile.block_m as usize);
        // The kernel numbers tiles in u32: batch x heads x query blocks must fit.
        let tiles = check::product_usize(OP, "batch x heads_q x query blocks", &[batch, hq, m_blocks])?;
        if tiles > u32::MAX as usize {
            return bad(format!(
                "batch {batch} x {hq} heads x {m_blocks} query blocks = {tiles} tiles: at most 2^32 - 1"
            ));
        }
        for (what, buf) in [("Q", t.q), ("K", t.k), ("V", t.v)] {
            check::buffer_on(OP, what, &self.device, buf)?;
        }
        check::buffer_on(OP, "O", &self.device, &*t.o)?;
        let mut lens = vec![
            ("Q", t.q.len(), check::product_usize(OP, "Q", &[total_q, hq, d])?),
            ("K", t.k.len(), check::product_usize(OP, "K", &[total_k, hkv, d])?),
            ("V", t.v.len(), check::product_usize(OP, "V", &[total_k, hkv, d])?),
            ("O", t.o.len(), check::product_usize(OP, "O", &[total_q, hq, d])?),
        ];
        if let Some(lse) = t.lse.as_deref() {
            check::buffer_on(OP, "LSE", &self.device, lse)?;
            lens.push(("LSE", lse.len(), check::product_usize(OP, "LSE", &[hq, total_q])?));
        }
        check::lens(OP, &lens)?;
        let grid = tiles.clamp(1, self.device.sm_count() as usize) as u32;
        Ok(SequenceInfo {
            batch,
            max_seqlen_q,
            total_q,
            total_k,
            grid,
        })
    }

    /// Enqueues `o = attention(q, k, v)` (and the LSE when given) on `stream`: one kernel, its
    /// tensor maps and arguments passed by value. Refuses a stream that is capturing a CUDA
    /// graph ([`Error::Capturing`]): capture with [`FlashAttentionPlan::launch_captured`].
    pub fn launch(
        &self,
        stream: &Arc<CudaStream>,
        t: AttentionTensors<'_>,
        seqs: Sequences<'_>,
    ) -> Result<SequenceInfo> {
        check::not_capturing(OP, stream, "FlashAttentionPlan::launch_captured")?;
        self.enqueue(stream, stream, t, seqs)
    }

    /// As [`FlashAttentionPlan::launch`], into the CUDA graph `stream` is capturing (it also
    /// launches on a stream that is not capturing). The graph keeps the buffers' addresses and
    /// a copy of the launch's parameters, not the plan: the plan may be dropped after the
    /// capture. The buffers' addresses are taken without cudarc's stream-ordering waits (a
    /// wait on an event recorded outside the capture would invalidate it).
    ///
    /// # Safety
    /// While the graph (or any graph instantiated from it) can be replayed, every buffer in `t`
    /// and `seqs` stays allocated, and the caller orders the replays with other work on those
    /// buffers (replays run in the order of the stream they are launched on).
    pub unsafe fn launch_captured(
        &self,
        stream: &Arc<CudaStream>,
        t: AttentionTensors<'_>,
        seqs: Sequences<'_>,
    ) -> Result<SequenceInfo> {
        self.enqueue(stream, self.device.side_stream()?, t, seqs)
    }

    /// The launch on `stream`, with the buffers' addresses (and cudarc's guards) taken on
    /// `ptrs` (`stream` itself outside a capture).
    fn enqueue(
        &self,
        stream: &Arc<CudaStream>,
        ptrs: &Arc<CudaStream>,
        t: AttentionTensors<'_>,
        seqs: Sequences<'_>,
    ) -> Result<SequenceInfo> {
        check::stream_on(OP, &self.device, stream)?;
        let info = self.info(&seqs, &t)?;
        let (hq, hkv, d) = (self.heads.heads_q, self.heads.heads_kv, self.heads.head_dim);
        // Guards: held until the launch is enqueued (dropped at the end of this function).
        let (pq, _gq) = t.q.device_ptr(ptrs);
        let (pk, _gk) = t.k.device_ptr(ptrs);
        let (pv, _gv) = t.v.device_ptr(ptrs);
        let (po, _go) = t.o.device_ptr_mut(ptrs);
        let (pl, _gl) = match t.lse {
            Some(lse) => {
                let (p, g) = lse.device_ptr_mut(ptrs);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (cu_q, cu_k, _gcu) = match seqs {
            Sequences::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
                ..
            } => {
                let (a, ga) = cu_seqlens_q.device_ptr(ptrs);
                let (b, gb) = cu_seqlens_k.device_ptr(ptrs);
                (a, b, Some((ga, gb)))
            }
            Sequences::Batched { .. } => (0, 0, None),
        };
        check::aligned16(OP, &[("Q", pq), ("K", pk), ("V", pv), ("O", po)])?;
        let tile = self.tile;
        let map = |ptr: u64, heads: usize, rows: usize, box_rows: u32| head_map(ptr, d, heads, rows, box_rows);
        let (seqlen_q, seqlen_k) = match seqs {
            Sequences::Batched { seqlen_q, seqlen_k, .. } => (seqlen_q, seqlen_k),
            // With varlen the kernel reads the key rows of the tensor from `seqlen_k`.
            Sequences::Varlen {
                max_seqlen_q, total_k, ..
            } => (max_seqlen_q, total_k),
        };
        let params = AttentionParams {
            map_q: map(pq, hq, info.total_q, tile.block_m)?.opaque,
            map_k: map(pk, hkv, info.total_k, tile.block_n)?.opaque,
            map_v: map(pv, hkv, info.total_k, tile.block_n)?.opaque,
            args: AttentionArgs {
                map_q: 0,
                map_k: 0,
                map_v: 0,
                o: po,
                lse: pl,
                cu_seqlens_q: cu_q,
                cu_seqlens_k: cu_k,
                batch: info.batch as u32,
                heads_q: hq as u32,
                heads_kv: hkv as u32,
                seqlen_q: seqlen_q as u32,
                seqlen_k: seqlen_k as u32,
                total_q: info.total_q as u32,
                m_blocks: info.max_seqlen_q.div_ceil(tile.block_m as usize) as u32,
                causal: self.heads.causal as u32,
                scale_log2: self.heads.scale() * std::f32::consts::LOG2_E,
                _pad: 0,
            },
        };
        let block = ParamBlock::new(params);
        let mut b = stream.launch_builder(&self.func);
        b.arg(&block);
        // SAFETY: the kernel takes one AttentionParams block by value; its tensor maps and
        // addresses describe the borrowed buffers, whose lengths were checked and whose guards
        // are held until this launch is enqueued.
        unsafe { b.launch(Device::launch_config(self.spec, info.grid)) }?;
        Ok(info)
    }
}

/// One-shot attention forward (plans, then launches; keep a [`FlashAttentionPlan`] to launch
/// every step).
pub fn flash_attention(
    device: &Device,
    stream: &Arc<CudaStream>,
    heads: AttentionHeads,
    t: AttentionTensors<'_>,
    seqs: Sequences<'_>,
) -> Result<SequenceInfo> {
    FlashAttentionPlan::new(device, heads)?.launch(stream, t, seqs)
}

#[cfg(test)]
mod tests {
    use super::*;
    fn heads(hq: usize, hkv: usize, d: usize) -> AttentionHeads {
        AttentionHeads {
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            causal: false,
            softmax_scale: None,
        }
    }
    #[test]
    fn heads_are_validated() {
        assert!(heads(32, 8, 128).validate().is_ok());
        assert!(heads(4, 4, 64).validate().is_ok());
        let e = heads(8, 8, 96).validate().unwrap_err().to_string();
        assert!(e.contains("head_dim 96"), "{e}");
        let e = heads(12, 8, 128).validate().unwrap_err().to_string();
        assert!(e.contains("not a multiple of heads_kv"), "{e}");
        assert!(heads(0, 1, 64).validate().is_err());
        let e = AttentionHeads {
            softmax_scale: Some(-0.1),
            ..heads(4, 4, 64)
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("positive"), "{e}");
    }
    #[test]
    fn cu_seqlens_are_checked() {
        assert_eq!(
            check_cu_seqlens(&[0, 5, 5, 300], &[0, 7, 9, 9]).unwrap(),
            (3, 295, 300, 9)
        );
        let e = check_cu_seqlens(&[1, 5], &[0, 5]).unwrap_err().to_string();
        assert!(e.contains("cu_seqlens_q[0] = 1"), "{e}");
        let e = check_cu_seqlens(&[0, 5, 4], &[0, 5, 6]).unwrap_err().to_string();
        assert!(e.contains("decreases"), "{e}");
        assert!(check_cu_seqlens(&[0, 5], &[0, 5, 6]).is_err());
        assert!(check_cu_seqlens(&[0], &[0]).is_err());
    }
    #[test]
    fn causal_pairs_in_closed_form_match_the_row_sum() {
        let rows = |q: usize, k: usize| -> f64 {
            (0..q)
                .map(|i| (i as i64 + k as i64 - q as i64 + 1).clamp(0, k as i64) as f64)
                .sum()
        };
        for q in 0..40 {
            for k in 0..40 {
                assert_eq!(pairs(q, k, true), rows(q, k), "q = {q}, k = {k}");
            }
        }
        // Huge sizes take no time (the row loop would run 2^40 times).
        let big = pairs(1 << 40, 1 << 40, true);
        assert_eq!(big, ((1u128 << 40) * ((1u128 << 40) + 1) / 2) as f64);
    }
    #[test]
    fn causal_pairs_are_bottom_right() {
        assert_eq!(pairs(4, 4, true), 10.0);
        assert_eq!(pairs(2, 4, true), 3.0 + 4.0);
        assert_eq!(pairs(4, 2, true), 0.0 + 0.0 + 1.0 + 2.0);
        assert_eq!(pairs(3, 5, false), 15.0);
    }
}
