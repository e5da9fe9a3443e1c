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
//! A [`FlashAttentionPlan`] encodes the TMA descriptors and the argument block once; `launch` is
//! one kernel launch (CUDA-graph capturable).
use crate::error::{Error, Result};
use crate::runtime::Device;
use crate::tensor_map::{encode_bf16_sw128_3d, Tensor3d, TensorMap};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg, SyncOnDrop};
use half::bf16;
use mkernel_config::ops::attention::{AttentionArgs, AttentionTile, BOX_COLS, FLASH_ATTN_FWD_D128, FLASH_ATTN_FWD_D64};
use mkernel_config::KernelSpec;
use std::marker::PhantomData;
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
#[derive(Clone, Copy, Debug)]
pub enum Sequences<'a> {
    /// `batch` sequences of `seqlen_q` queries and `seqlen_k` keys each.
    Batched {
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
    },
    /// Packed sequences: `cu_seqlens_*` hold `batch + 1` non-decreasing i32 row offsets starting
    /// at 0 (flash-attn's `cu_seqlens`). The plan reads them back once to check them and to size
    /// the grid; later changes to the buffers are not seen by the check.
    Varlen {
        cu_seqlens_q: &'a CudaSlice<i32>,
        cu_seqlens_k: &'a CudaSlice<i32>,
    },
}

/// What the plan worked out from the sequences.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SequenceInfo {
    pub batch: usize,
    /// Longest query sequence.
    pub max_seqlen_q: usize,
    pub total_q: usize,
    pub total_k: usize,
    /// Attention FLOPs (4 x rows x keys x head_dim summed over sequences and heads, only the
    /// visible (query, key) pairs when causal).
    pub flops: f64,
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

/// Visible (query, key) pairs of one sequence.
pub(crate) fn pairs(q: usize, k: usize, causal: bool) -> f64 {
    if !causal {
        return q as f64 * k as f64;
    }
    // Row i sees min(k, max(0, i + k - q + 1)) keys.
    (0..q)
        .map(|i| (i as i64 + k as i64 - q as i64 + 1).clamp(0, k as i64) as f64)
        .sum()
}

/// A FlashAttention forward ready to launch; borrows its buffers for `'a`.
pub struct FlashAttentionPlan<'a> {
    func: CudaFunction,
    spec: &'static KernelSpec,
    /// Tensor maps (3 x 128 bytes) then the argument block.
    block: CudaSlice<u64>,
    /// `block`'s address (launches inside a graph capture use it directly).
    block_addr: u64,
    grid: u32,
    info: SequenceInfo,
    _buffers: PhantomData<&'a ()>,
}

/// Words of the uploaded block: three tensor maps, then [`AttentionArgs`].
pub(super) const MAP_WORDS: usize = 16;
const ARGS_WORDS: usize = std::mem::size_of::<AttentionArgs>() / 8;

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

impl<'a> FlashAttentionPlan<'a> {
    /// Plans `o = attention(q, k, v)` and `lse` on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device: &Device,
        stream: &Arc<CudaStream>,
        q: &'a CudaSlice<bf16>,
        k: &'a CudaSlice<bf16>,
        v: &'a CudaSlice<bf16>,
        o: &'a mut CudaSlice<bf16>,
        lse: &'a mut CudaSlice<f32>,
        seqs: Sequences<'a>,
        heads: AttentionHeads,
    ) -> Result<Self> {
        heads.validate()?;
        let bad = |reason: String| Err(Error::Shape { op: OP, reason });
        let (hq, hkv, d) = (heads.heads_q, heads.heads_kv, heads.head_dim);
        let (info, cu) = match seqs {
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
                let info = SequenceInfo {
                    batch,
                    max_seqlen_q: seqlen_q,
                    total_q: batch * seqlen_q,
                    total_k: batch * seqlen_k,
                    flops: 4.0 * (batch * hq * d) as f64 * pairs(seqlen_q, seqlen_k, heads.causal),
                };
                (info, None)
            }
            Sequences::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
            } => {
                let (hcq, hck) = (stream.clone_dtoh(cu_seqlens_q)?, stream.clone_dtoh(cu_seqlens_k)?);
                stream.synchronize()?;
                let (batch, max_q, total_q, total_k) = check_cu_seqlens(&hcq, &hck)?;
                if total_q == 0 || total_k == 0 {
                    return bad(format!("empty problem: {total_q} query rows, {total_k} key rows"));
                }
                let flops = (0..batch)
                    .map(|b| {
                        let (lq, lk) = ((hcq[b + 1] - hcq[b]) as usize, (hck[b + 1] - hck[b]) as usize);
                        4.0 * (hq * d) as f64 * pairs(lq, lk, heads.causal)
                    })
                    .sum();
                let info = SequenceInfo {
                    batch,
                    max_seqlen_q: max_q,
                    total_q,
                    total_k,
                    flops,
                };
                let (pq, _r1) = cu_seqlens_q.device_ptr(stream);
                let (pk, _r2) = cu_seqlens_k.device_ptr(stream);
                (info, Some((pq, pk)))
            }
        };
        if info.total_q >= 1 << 31 || info.total_k >= 1 << 31 {
            return bad(format!(
                "{} query / {} key rows: at most 2^31 - 1",
                info.total_q, info.total_k
            ));
        }
        let lse_len = hq * info.total_q;
        crate::check::lens(
            OP,
            &[
                ("Q", q.len(), info.total_q * hq * d),
                ("K", k.len(), info.total_k * hkv * d),
                ("V", v.len(), info.total_k * hkv * d),
                ("O", o.len(), info.total_q * hq * d),
                ("LSE", lse.len(), lse_len),
            ],
        )?;
        let (pq, _r1) = q.device_ptr(stream);
        let (pk, _r2) = k.device_ptr(stream);
        let (pv, _r3) = v.device_ptr(stream);
        let (po, _r4) = o.device_ptr_mut(stream);
        let (pl, _r5) = lse.device_ptr_mut(stream);
        let (spec, tile) = match d {
            64 => (&FLASH_ATTN_FWD_D64, AttentionTile::D64),
            _ => (&FLASH_ATTN_FWD_D128, AttentionTile::D128),
        };
        let map = |ptr: u64, heads: usize, rows: usize, box_rows: u32| head_map(ptr, d, heads, rows, box_rows);
        let maps = [
            map(pq, hq, info.total_q, tile.block_m)?,
            map(pk, hkv, info.total_k, tile.block_n)?,
            map(pv, hkv, info.total_k, tile.block_n)?,
        ];
        let mut block = stream.alloc_zeros::<u64>(3 * MAP_WORDS + ARGS_WORDS)?;
        let base = block.device_ptr(stream).0;
        let m_blocks = info.max_seqlen_q.div_ceil(tile.block_m as usize);
        let (seqlen_q, seqlen_k) = match seqs {
            Sequences::Batched { seqlen_q, seqlen_k, .. } => (seqlen_q, seqlen_k),
            Sequences::Varlen { .. } => (info.max_seqlen_q, 0),
        };
        let args = AttentionArgs {
            map_q: base,
            map_k: base + 128,
            map_v: base + 256,
            o: po,
            lse: pl,
            cu_seqlens_q: cu.map_or(0, |c| c.0),
            cu_seqlens_k: cu.map_or(0, |c| c.1),
            batch: info.batch as u32,
            heads_q: hq as u32,
            heads_kv: hkv as u32,
            seqlen_q: seqlen_q as u32,
            seqlen_k: seqlen_k as u32,
            total_q: info.total_q as u32,
            m_blocks: m_blocks as u32,
            causal: heads.causal as u32,
            scale_log2: heads.scale() * std::f32::consts::LOG2_E,
            _pad: 0,
        };
        let words = block_words(&maps, &bytemuck::cast::<_, [u64; ARGS_WORDS]>(args));
        stream.memcpy_htod(&words, &mut block)?;
        // Launches may be captured on other streams: the upload must be complete.
        stream.synchronize()?;
        let tiles = info.batch * hq * m_blocks;
        let grid = tiles.clamp(1, device.sm_count() as usize) as u32;
        Ok(FlashAttentionPlan {
            func: device.function(spec)?,
            spec,
            block,
            block_addr: base,
            grid,
            info,
            _buffers: PhantomData,
        })
    }

    /// Enqueues the kernel on `stream`; inside a CUDA graph capture too.
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let (base, _r) = launch_block_addr(stream, &self.block, self.block_addr)?;
        let args = base + 8 * (3 * MAP_WORDS) as u64;
        let mut b = stream.launch_builder(&self.func);
        b.arg(&args);
        // SAFETY: the kernel takes the address of an AttentionArgs block, uploaded with the
        // tensor maps it points to; the buffers it names are borrowed for 'a.
        unsafe { b.launch(Device::launch_config(self.spec, self.grid)) }?;
        Ok(())
    }

    /// CTAs launched (persistent).
    pub fn grid(&self) -> u32 {
        self.grid
    }
    /// Batch, lengths and FLOPs of the planned problem.
    pub fn info(&self) -> SequenceInfo {
        self.info
    }
}

/// One-shot attention forward (plans, then launches; keep a [`FlashAttentionPlan`] to launch
/// repeatedly or inside a CUDA graph).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    device: &Device,
    stream: &Arc<CudaStream>,
    q: &CudaSlice<bf16>,
    k: &CudaSlice<bf16>,
    v: &CudaSlice<bf16>,
    o: &mut CudaSlice<bf16>,
    lse: &mut CudaSlice<f32>,
    seqs: Sequences<'_>,
    heads: AttentionHeads,
) -> Result<()> {
    FlashAttentionPlan::new(device, stream, q, k, v, o, lse, seqs, heads)?.launch(stream)
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
    fn causal_pairs_are_bottom_right() {
        assert_eq!(pairs(4, 4, true), 10.0);
        assert_eq!(pairs(2, 4, true), 3.0 + 4.0);
        assert_eq!(pairs(4, 2, true), 0.0 + 0.0 + 1.0 + 2.0);
        assert_eq!(pairs(3, 5, false), 15.0);
    }
}
