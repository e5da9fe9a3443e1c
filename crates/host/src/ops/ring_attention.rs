//! Ring attention forward across every rank of a [`Communicator`] (all nodes): each of the W
//! ranks holds `seqlen_local` rows of every sequence (Q, K, V shards), rank `r` being the
//! communicator's global rank; one persistent kernel per call passes the K/V shards around the
//! ring in global rank order (NVLink stores into the right neighbour's receive slots inside a
//! node, one proxy PUT per step from a node's last rank to the next node's first; two slots per
//! rank) while the compute CTAs attend the local queries to the shard that arrived, and merges
//! the partials in f32 through their log-sum-exp. Outputs: the local rows of O (bf16) and LSE
//! (f32), equal to attention over the whole sequence.
//!
//! Layout per rank (batched only): Q and O `[batch][seqlen_local][heads_q][head_dim]`, K and V
//! `[batch][seqlen_local][heads_kv][head_dim]`, LSE `[batch][heads_q][seqlen_local]`.
//! - non-causal: rank `r` holds rows `r * seqlen_local ..` of each sequence (any split works,
//!   the result does not depend on the order of the keys);
//! - causal: zigzag sharding, sequence of `S = W * seqlen_local` rows cut into `2W` chunks of
//!   `S / 2W` rows; rank `r` holds chunks `r` then `2W - 1 - r` (`seqlen_local` even). The mask
//!   is causal over the global positions.
//!
//! Memory per rank: the workspace (two receive slots of K and V, [`RingAttentionPlan::workspace_bytes`],
//! in the symmetric heap) and, for W > 1, an f32 running O and LSE owned by the plan.
//! docs/attention.md ("Ring attention") has the protocol.
use super::attention::{block_words, head_map, launch_block_addr, AttentionHeads, MAP_WORDS};
use crate::check;
use crate::comm::agree::PlanDesc;
use crate::comm::{Communicator, SymBuffer};
use crate::error::{Error, Result};
use crate::runtime::Device;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use mkernel_config::comm::MAX_COMM_CTAS;
use mkernel_config::ops::attention::{AttentionArgs, AttentionTile, RingArgs, RING_ATTN_FWD_D128, RING_ATTN_FWD_D64};
use mkernel_config::KernelSpec;
use std::marker::PhantomData;
use std::sync::Arc;

const OP: &str = "ring attention";

/// How the grid is split between compute CTAs (FlashAttention tiles) and comm CTAs (K/V copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingRoles {
    pub compute: u32,
    pub comm: u32,
}

/// The role split: `comm` comm CTAs (default `sm_count / 16` clamped to 1..=8: 8 on 132 SMs, 4
/// on a 66-SM share; none for W = 1), the rest of the SMs compute, at most one per tile. Every
/// CTA must be resident at once (they wait for each other), so the total is at most `sm_count`.
pub fn ring_roles(sm_count: u32, world: u32, tiles: usize, comm: Option<u32>) -> Result<RingRoles> {
    let bad = |reason: String| Err(Error::Shape { op: OP, reason });
    let comm = if world == 1 {
        0
    } else {
        comm.unwrap_or((sm_count / 16).clamp(1, 8))
    };
    if world > 1 && comm == 0 {
        return bad("a ring of several ranks needs at least one comm CTA".into());
    }
    if comm >= sm_count {
        return bad(format!("{comm} comm CTAs leave no SM to compute (sm_count {sm_count})"));
    }
    let compute = (tiles.max(1) as u32).min(sm_count - comm).min(MAX_COMM_CTAS - 1 - comm);
    Ok(RingRoles { compute, comm })
}

/// The comm CTA counts `cargo xtask tune --op ring-attention` times for a shape: powers of two
/// from 1 to `sm_count / 4` (at most 32) and [`ring_roles`]' default, each one that gives a
/// valid split (at least one compute CTA, the grid within the flag area), ascending. Empty for
/// `world == 1` (no comm CTAs).
pub fn comm_cta_candidates(sm_count: u32, world: u32, tiles: usize) -> Vec<u32> {
    if world < 2 {
        return vec![];
    }
    let mut v: Vec<u32> = (0..6)
        .map(|i| 1u32 << i)
        .filter(|&c| c <= (sm_count / 4).max(1))
        .chain([(sm_count / 16).clamp(1, 8)])
        .filter(|&c| ring_roles(sm_count, world, tiles, Some(c)).is_ok_and(|r| r.compute > 0))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The tune cache key of a ring-attention shape (`mkernel::tune`): op
/// `ring-attention-d{head_dim}-kv{heads_kv}` (`-causal` appended when causal), `world` the ranks of
/// the ring, `m` the batch, `n` the rows per rank and sequence (`seqlen_local`), `k` `heads_q`;
/// the value is the comm CTA count.
pub fn tune_key(world: u32, batch: usize, seqlen_local: usize, heads: &AttentionHeads) -> crate::tune::TuneKey {
    crate::tune::TuneKey {
        op: format!(
            "ring-attention-d{}-kv{}{}",
            heads.head_dim,
            heads.heads_kv,
            if heads.causal { "-causal" } else { "" }
        ),
        world,
        m: batch,
        n: seqlen_local,
        k: heads.heads_q,
    }
}

/// Options of a ring-attention plan.
#[derive(Clone, Copy, Debug, Default)]
pub struct RingOptions {
    /// Comm CTAs; `None`: the tune cache's entry for the shape ([`tune_key`], written by `cargo
    /// xtask tune --op ring-attention`; ignored where it does not give a valid split), else
    /// [`ring_roles`]' default.
    pub comm_ctas: Option<u32>,
}

/// Words of the uploaded block: seven tensor maps (Q, K, V, K/V of both slots), then [`RingArgs`].
const MAPS: usize = 7;
const ARGS_WORDS: usize = std::mem::size_of::<RingArgs>() / 8;

/// A ring-attention forward ready to launch; borrows its communicator and buffers for `'a`.
pub struct RingAttentionPlan<'a> {
    comm: &'a Communicator,
    func: CudaFunction,
    spec: &'static KernelSpec,
    block: CudaSlice<u64>,
    block_addr: u64,
    roles: RingRoles,
    _acc: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    flops: f64,
    _buffers: PhantomData<&'a ()>,
}

impl<'a> RingAttentionPlan<'a> {
    /// Heap bytes of the workspace (`Communicator::alloc`): two receive slots of one K and one V
    /// shard each ([`Error::Shape`] when the product overflows 64 bits).
    pub fn workspace_bytes(batch: usize, seqlen_local: usize, heads: &AttentionHeads) -> Result<u64> {
        check::product(
            OP,
            "4 x batch x seqlen_local x heads_kv x head_dim x 2",
            &[
                4,
                batch as u64,
                seqlen_local as u64,
                heads.heads_kv as u64,
                heads.head_dim as u64,
                2,
            ],
        )
    }

    /// Heap bytes a plan of this shape needs, before it is built: the caller's workspace
    /// ([`RingAttentionPlan::workspace_bytes`], rounded up to the heap's 256 bytes); the plan
    /// takes nothing else from the heap.
    pub fn heap_bytes(batch: usize, seqlen_local: usize, heads: &AttentionHeads) -> Result<u64> {
        let b = Self::workspace_bytes(batch, seqlen_local, heads)?;
        b.checked_next_multiple_of(256).ok_or_else(|| Error::Shape {
            op: OP,
            reason: format!("workspace of {b} bytes overflows 64 bits rounded up to 256"),
        })
    }

    /// The plan's own checks (pure, no exchange): shapes, buffer lengths and contexts, the
    /// workspace; the number of local rows.
    #[allow(clippy::too_many_arguments)]
    fn validate(
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        bufs: [(&'static str, &dyn cudarc::driver::DeviceSlice<bf16>); 4],
        lse: &CudaSlice<f32>,
        workspace: &SymBuffer,
        batch: usize,
        seqlen_local: usize,
        heads: &AttentionHeads,
    ) -> Result<usize> {
        heads.validate()?;
        let bad = |reason: String| Err(Error::Shape { op: OP, reason });
        let device = comm.device();
        let w = comm.global_world() as usize;
        let (hq, hkv, d) = (heads.heads_q, heads.heads_kv, heads.head_dim);
        check::stream_on(OP, device, stream)?;
        for (what, b) in bufs {
            check::buffer_on(OP, what, device, b)?;
        }
        check::buffer_on(OP, "LSE", device, lse)?;
        if batch == 0 || seqlen_local == 0 {
            return bad(format!("empty problem: batch = {batch}, seqlen_local = {seqlen_local}"));
        }
        if heads.causal && seqlen_local % 2 != 0 {
            return bad(format!(
                "a causal sequence of {} rows over {w} ranks cannot be zigzag-split: each rank holds 2 chunks of \
                 S / 2W rows, so seqlen_local = {seqlen_local} must be even",
                w.saturating_mul(seqlen_local)
            ));
        }
        let rows = check::product_usize(OP, "batch x seqlen_local", &[batch, seqlen_local])?;
        if rows >= 1 << 31 {
            return bad(format!("{rows} local rows: at most 2^31 - 1"));
        }
        let q_len = check::product_usize(OP, "rows x heads_q x head_dim", &[rows, hq, d])?;
        let kv_len = check::product_usize(OP, "rows x heads_kv x head_dim", &[rows, hkv, d])?;
        let [(_, q), (_, k), (_, v), (_, o)] = bufs;
        check::lens(
            OP,
            &[
                ("Q", q.len(), q_len),
                ("K", k.len(), kv_len),
                ("V", v.len(), kv_len),
                ("O", o.len(), q_len),
                ("LSE", lse.len(), rows * hq),
            ],
        )?;
        comm.check_region(OP, workspace)?;
        let need = Self::workspace_bytes(batch, seqlen_local, heads)?;
        if workspace.bytes() < need {
            return Err(Error::BufferTooSmall {
                op: OP,
                what: "workspace (symmetric heap)",
                have: workspace.bytes() as usize,
                need: need as usize,
            });
        }
        Ok(rows)
    }

    /// Plans the local rows of `o`, `lse` = attention of the local `q` over every rank's `k`, `v`.
    /// Collective: every rank of the job calls it with the same shapes (checked through the
    /// store); the shard of global rank `r` is rows `r * seqlen_local ..` (non-causal) or zigzag
    /// chunks `r` and `2W - 1 - r` (causal).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        q: &'a CudaSlice<bf16>,
        k: &'a CudaSlice<bf16>,
        v: &'a CudaSlice<bf16>,
        o: &'a mut CudaSlice<bf16>,
        lse: &'a mut CudaSlice<f32>,
        workspace: &'a SymBuffer,
        batch: usize,
        seqlen_local: usize,
        heads: AttentionHeads,
        opts: RingOptions,
    ) -> Result<Self> {
        let device: &Device = comm.device();
        // The ring runs over every rank of the job, in global rank order.
        let w = comm.global_world() as usize;
        let (hq, hkv, d) = (heads.heads_q, heads.heads_kv, heads.head_dim);
        // A tuned split, looked up before the agreement: ranks whose caches differ fail it.
        let tuned = match opts.comm_ctas {
            Some(_) => None,
            None => crate::tune::lookup(&tune_key(w as u32, batch, seqlen_local, &heads)),
        };
        let checked = Self::validate(
            comm,
            stream,
            [("Q", q), ("K", k), ("V", v), ("O", &*o)],
            lse,
            workspace,
            batch,
            seqlen_local,
            &heads,
        );
        // Every rank must agree on the shapes, the scale, the workspace and the grid (the comm
        // CTAs wait for every CTA of their neighbour); the grid is cut from the smallest SM count.
        let (rows, agreed) = comm.agree_on(OP, checked, |_| {
            PlanDesc::new(OP)
                .field("batch", batch)
                .field("seqlen_local", seqlen_local)
                .field("heads_q", hq)
                .field("heads_kv", hkv)
                .field("head_dim", d)
                .field("causal", heads.causal)
                .field("softmax_scale", heads.scale())
                .field("dtype", "bf16")
                .field("comm_ctas", format!("{:?}", opts.comm_ctas.or(tuned)))
                .field("workspace offset", workspace.offset())
                .field("workspace bytes", workspace.bytes())
                .min_field("sm_count", device.sm_count() as u64)
        })?;
        let sm_count = agreed.min("sm_count").map_or(device.sm_count(), |m| m as u32);
        let kv_bytes = (rows * hkv * d * 2) as u64;
        let (spec, tile) = match d {
            64 => (&RING_ATTN_FWD_D64, AttentionTile::D64),
            _ => (&RING_ATTN_FWD_D128, AttentionTile::D128),
        };
        let m_blocks = seqlen_local.div_ceil(tile.block_m as usize);
        let tiles = batch * hq * m_blocks;
        let roles = match (opts.comm_ctas, tuned) {
            (Some(c), _) => ring_roles(sm_count, w as u32, tiles, Some(c))?,
            // A cached count that does not fit this grid (another GPU, a stale entry): the default.
            (None, Some(c)) => ring_roles(sm_count, w as u32, tiles, Some(c))
                .or_else(|_| ring_roles(sm_count, w as u32, tiles, None))?,
            (None, None) => ring_roles(sm_count, w as u32, tiles, None)?,
        };
        let acc = if w > 1 {
            Some((
                stream.alloc_zeros::<f32>(rows * hq * d)?,
                stream.alloc_zeros::<f32>(rows * hq)?,
            ))
        } else {
            None
        };
        let (pq, _r1) = q.device_ptr(stream);
        let (pk, _r2) = k.device_ptr(stream);
        let (pv, _r3) = v.device_ptr(stream);
        let (po, _r4) = o.device_ptr_mut(stream);
        let (pl, _r5) = lse.device_ptr_mut(stream);
        let map = |ptr: u64, heads: usize, box_rows: u32| head_map(ptr, d, heads, rows, box_rows);
        let slot = comm.ptr(workspace)?;
        let maps = [
            map(pq, hq, tile.block_m)?,
            map(pk, hkv, tile.block_n)?,
            map(pv, hkv, tile.block_n)?,
            map(slot, hkv, tile.block_n)?,
            map(slot + 2 * kv_bytes, hkv, tile.block_n)?,
            map(slot + kv_bytes, hkv, tile.block_n)?,
            map(slot + 3 * kv_bytes, hkv, tile.block_n)?,
        ];
        let mut block = stream.alloc_zeros::<u64>(MAPS * MAP_WORDS + ARGS_WORDS)?;
        let base = block.device_ptr(stream).0;
        let map_at = |i: usize| base + (i * MAP_WORDS * 8) as u64;
        let (o_acc, lse_acc) = match &acc {
            Some((a, l)) => (a.device_ptr(stream).0, l.device_ptr(stream).0),
            None => (0, 0),
        };
        let args = RingArgs {
            attn: AttentionArgs {
                map_q: map_at(0),
                map_k: map_at(1),
                map_v: map_at(2),
                o: po,
                lse: pl,
                cu_seqlens_q: 0,
                cu_seqlens_k: 0,
                batch: batch as u32,
                heads_q: hq as u32,
                heads_kv: hkv as u32,
                seqlen_q: seqlen_local as u32,
                seqlen_k: seqlen_local as u32,
                total_q: rows as u32,
                m_blocks: m_blocks as u32,
                causal: heads.causal as u32,
                scale_log2: heads.scale() * std::f32::consts::LOG2_E,
                _pad: 0,
            },
            map_k_slot: [map_at(3), map_at(4)],
            map_v_slot: [map_at(5), map_at(6)],
            desc: comm.desc_ptr(),
            o_acc,
            lse_acc,
            k_local: pk,
            v_local: pv,
            slots: workspace.offset(),
            kv_bytes,
            compute_ctas: roles.compute,
            comm_ctas: roles.comm,
            chunk: (seqlen_local / 2) as u32,
            _pad: 0,
        };
        let words = block_words(&maps, &bytemuck::cast::<_, [u64; ARGS_WORDS]>(args));
        stream.memcpy_htod(&words, &mut block)?;
        stream.synchronize()?;
        let pairs = if heads.causal {
            // Causal over the whole sequence of W * seqlen_local rows; this rank's share of it.
            let s = (w * seqlen_local) as f64;
            s * (s + 1.0) / 2.0 / w as f64
        } else {
            (seqlen_local * w * seqlen_local) as f64
        };
        Ok(RingAttentionPlan {
            comm,
            func: device.function(spec)?,
            spec,
            block,
            block_addr: base,
            roles,
            _acc: acc,
            flops: 4.0 * (batch * hq * d) as f64 * pairs,
            _buffers: PhantomData,
        })
    }

    /// Enqueues the kernel on `stream` (inside a CUDA graph capture too). Every rank
    /// launches the same sequence of plans; [`Communicator::check`] after the stream
    /// synchronized reports a rank that never came ([`Error::CommTimeout`]).
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let (base, _r) = launch_block_addr(stream, &self.block, self.block_addr)?;
        let args = base + 8 * (MAPS * MAP_WORDS) as u64;
        // Under the communicator's launch lock, ordered behind its previous launch.
        self.comm.enqueue(OP, stream, || {
            let mut b = stream.launch_builder(&self.func);
            b.arg(&args);
            // SAFETY: the kernel takes the address of a RingArgs block, uploaded with the tensor
            // maps it points to; the buffers it names are borrowed for 'a, the heap by the
            // communicator.
            unsafe { b.launch(Device::launch_config(self.spec, self.roles.compute + self.roles.comm)) }?;
            Ok(())
        })
    }

    /// The role split the plan launches with.
    pub fn roles(&self) -> RingRoles {
        self.roles
    }
    /// Attention FLOPs of this rank per call (the visible pairs of its queries).
    pub fn flops(&self) -> f64 {
        self.flops
    }
    /// The communicator.
    pub fn communicator(&self) -> &Communicator {
        self.comm
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    proptest::proptest! {
        /// The workspace size is exact or an error, never a wrapped product.
        #[test]
        fn workspace_bytes_are_exact_or_refused(
            batch in proptest::num::usize::ANY, seqlen in proptest::num::usize::ANY,
            hkv in 1usize..1024, small in proptest::bool::ANY,
        ) {
            let (batch, seqlen) = if small { (batch % 64, seqlen % 100_000) } else { (batch, seqlen) };
            let heads = AttentionHeads { heads_q: hkv, heads_kv: hkv, head_dim: 128, causal: false, softmax_scale: None };
            // u128, and `u128::MAX` where even that overflows.
            let want = [batch as u128, seqlen as u128, hkv as u128, 128, 2]
                .iter()
                .try_fold(4u128, |a, &x| a.checked_mul(x))
                .unwrap_or(u128::MAX);
            match RingAttentionPlan::workspace_bytes(batch, seqlen, &heads) {
                Ok(b) => proptest::prop_assert_eq!(b as u128, want),
                Err(_) => proptest::prop_assert!(want > u64::MAX as u128),
            }
            match RingAttentionPlan::heap_bytes(batch, seqlen, &heads) {
                Ok(b) => proptest::prop_assert_eq!(b as u128, want.div_ceil(256) * 256),
                Err(_) => proptest::prop_assert!(want > (u64::MAX - 255) as u128),
            }
        }
    }

    #[test]
    fn roles_fit_the_sms() {
        assert_eq!(
            ring_roles(132, 4, 4096, None).unwrap(),
            RingRoles { compute: 124, comm: 8 }
        );
        assert_eq!(
            ring_roles(66, 2, 4096, None).unwrap(),
            RingRoles { compute: 62, comm: 4 }
        );
        assert_eq!(
            ring_roles(33, 4, 4096, None).unwrap(),
            RingRoles { compute: 31, comm: 2 }
        );
        assert_eq!(
            ring_roles(132, 1, 4096, None).unwrap(),
            RingRoles { compute: 132, comm: 0 }
        );
        assert_eq!(
            ring_roles(132, 2, 10, Some(3)).unwrap(),
            RingRoles { compute: 10, comm: 3 }
        );
        assert!(ring_roles(8, 2, 10, Some(8)).is_err());
        assert!(ring_roles(8, 2, 10, Some(0)).is_err());
    }

    #[test]
    fn tune_candidates_are_valid_splits() {
        // A whole H100 and a quarter of one (4 ranks sharing it through MPS, 80% of 33 SMs).
        assert_eq!(comm_cta_candidates(132, 8, 4096), [1, 2, 4, 8, 16, 32]);
        assert_eq!(comm_cta_candidates(26, 4, 4096), [1, 2, 4]);
        // The default is always among them, even where sm_count / 4 is below it.
        assert!(comm_cta_candidates(66, 2, 4096).contains(&4));
        assert_eq!(comm_cta_candidates(4, 2, 1), [1]);
        // One rank has no comm CTAs to tune; a single SM cannot split.
        assert!(comm_cta_candidates(132, 1, 4096).is_empty());
        assert!(comm_cta_candidates(1, 2, 4096).is_empty());
        for (sm, w, tiles) in [(132, 2, 10), (132, 4, 100_000), (20, 2, 7), (33, 4, 4096)] {
            let c = comm_cta_candidates(sm, w, tiles);
            assert!(!c.is_empty());
            assert!(c.windows(2).all(|p| p[0] < p[1]), "{c:?}");
            for n in c {
                let r = ring_roles(sm, w, tiles, Some(n)).unwrap();
                assert_eq!(r.comm, n);
                assert!(r.compute >= 1 && r.compute + r.comm <= sm);
            }
        }
    }

    #[test]
    fn tune_keys_tell_shapes_apart() {
        let h = |hq, hkv, d, causal| AttentionHeads {
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            causal,
            softmax_scale: None,
        };
        let a = tune_key(4, 1, 4096, &h(32, 8, 128, true));
        assert_eq!(
            (a.op.as_str(), a.world, a.m, a.n, a.k),
            ("ring-attention-d128-kv8-causal", 4, 1, 4096, 32)
        );
        assert_eq!(
            tune_key(4, 1, 4096, &h(32, 8, 128, false)).op,
            "ring-attention-d128-kv8"
        );
        let keys = [
            tune_key(4, 1, 4096, &h(32, 32, 128, false)),
            tune_key(4, 1, 4096, &h(32, 32, 64, false)),
            tune_key(4, 1, 4096, &h(32, 8, 128, false)),
            tune_key(4, 2, 2048, &h(32, 32, 128, false)),
            tune_key(2, 1, 4096, &h(32, 32, 128, false)),
        ];
        for (i, x) in keys.iter().enumerate() {
            for y in &keys[i + 1..] {
                assert_ne!(x, y);
            }
        }
        // The cache's text format carries it (no whitespace in the op).
        let text = crate::tune::render(&[(a.clone(), 4)]);
        assert_eq!(crate::tune::parse(&text), [(a, 4)]);
    }
}
