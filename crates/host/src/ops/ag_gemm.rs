//! AllGather + GEMM for tensor parallelism: each rank holds `m / world` rows of A (`a_shard`,
//! local) and its own B (`n` x `k`, `nn.Linear` layout); every rank gets
//! `C = gather_rows(A) * B^T` (`m` x `n`, bf16) from one persistent kernel whose first `n_comm`
//! CTAs move A over NVLink chunk by chunk while the others run the GEMM on chunks as they land
//! (docs/fused.md). `world` is every rank of every node: across nodes A is sharded by global
//! rank, NVLink pushes inside the node, one proxy PUT of the whole shard to every rank of the
//! other nodes.
use crate::check;
use crate::comm::agree::PlanDesc;
use crate::comm::{Communicator, HeapRegion, SymBuffer};
use crate::error::{Error, Result};
use crate::runtime::Device;
use crate::tensor_map::encode_bf16_sw128_packed;
use crate::tune;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use mkernel_config::ops::ag_gemm::AgGemmArgs;
use mkernel_config::{kernels, GemmTile};
use std::marker::PhantomData;
use std::sync::Arc;

const OP: &str = "ag_gemm";
/// The tune cache's name of the operation.
pub const TUNE_OP: &str = "ag-gemm";

/// What [`policy`] chose for one AllGather+GEMM plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgGemmPolicy {
    /// CTAs moving A.
    pub n_comm: u32,
    /// CTAs in total (one per SM).
    pub grid: u32,
    /// Bytes of the gathered A in the heap (`m` x `k` bf16).
    pub gathered_bytes: u64,
}

/// The split of AllGather+GEMM `m` x `n` x `k` over `world` ranks (every rank of every node) on
/// a GPU of `sms` SMs: `requested` comm CTAs, or (0) the tune cache's `cached` split, or
/// [`tune::DEFAULT_SPLIT`]. Checks the shape: `m` a positive multiple of `world x 128` with at
/// most `MAX_COMM_CTAS` chunks of 128 rows per shard, `k` and `n` positive multiples of 8
/// (16-byte TMA rows), every dimension below 2^31, and at least one compute CTA left.
pub fn policy(
    m: usize,
    n: usize,
    k: usize,
    world: usize,
    sms: u32,
    requested: u32,
    cached: Option<u32>,
) -> Result<AgGemmPolicy> {
    let block_m = GemmTile::DEFAULT.block_m as usize;
    let bad = |reason: String| Err(Error::Shape { op: OP, reason });
    if world == 0 {
        return bad("world = 0".into());
    }
    for (what, v) in [("m", m), ("n", n), ("k", k)] {
        if v > i32::MAX as usize {
            return bad(format!("{what} = {v} must be below 2^31"));
        }
    }
    let rows_per_round = check::product_usize(OP, "world x 128", &[world, block_m])?;
    if m == 0 || m % rows_per_round != 0 {
        return bad(format!(
            "m = {m} must be a positive multiple of world x {block_m} = {rows_per_round}"
        ));
    }
    if k == 0 || k % 8 != 0 || n == 0 || n % 8 != 0 {
        return bad(format!(
            "k = {k} and n = {n} must be positive multiples of 8 (16-byte TMA rows)"
        ));
    }
    let chunks = m / world / block_m;
    if chunks > mkernel_config::comm::MAX_COMM_CTAS as usize {
        return bad(format!(
            "{chunks} chunks of {block_m} rows per shard; at most {} (flags per chunk)",
            mkernel_config::comm::MAX_COMM_CTAS
        ));
    }
    let n_comm = match requested {
        0 => cached.unwrap_or(tune::DEFAULT_SPLIT),
        r => r,
    };
    if n_comm == 0 || n_comm.saturating_add(1) >= sms {
        return bad(format!(
            "n_comm = {n_comm}: between 1 and {} (the GPU has {sms} SMs)",
            sms.saturating_sub(2)
        ));
    }
    Ok(AgGemmPolicy {
        n_comm,
        grid: sms,
        gathered_bytes: check::product(OP, "m x k x 2", &[m as u64, k as u64, 2])?,
    })
}

/// A planned AllGather + GEMM: descriptors and arguments uploaded, gathered-A buffer reserved.
/// Borrows its communicator and its buffers for `'a` (see [`crate::ops`]).
pub struct AgGemmPlan<'a> {
    comm: &'a Communicator,
    func: CudaFunction,
    _maps: CudaSlice<u64>,
    _args: CudaSlice<u8>,
    args_addr: u64,
    policy: AgGemmPolicy,
    gathered: SymBuffer,
    /// The gathered A's heap buffer, given back when the plan drops.
    _heap: HeapRegion<'a>,
    _buffers: PhantomData<&'a ()>,
}

impl<'a> AgGemmPlan<'a> {
    /// Plans `c = gather_rows(a_shard) * b^T` on cudarc slices or views of this communicator's
    /// device: `a_shard` holds `m / world` x `k` (rows of global rank order), `b` holds `n` x
    /// `k`, `c` holds `m` x `n` (lengths checked). `n_comm` CTAs move A, the rest of the GPU's
    /// SMs compute; 0 takes the split from the tune cache ([`crate::tune`]). Collective: every
    /// local rank plans the same shape, in the same order relative to its other heap
    /// allocations.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        a_shard: &'a impl DevicePtr<bf16>,
        b: &'a impl DevicePtr<bf16>,
        c: &'a mut impl DevicePtrMut<bf16>,
        m: usize,
        n: usize,
        k: usize,
        n_comm: u32,
    ) -> Result<Self> {
        let device = comm.device();
        let world = (comm.world() * comm.nnodes()) as usize;
        let checked = (|| {
            check::stream_on(OP, device, stream)?;
            check::buffer_on(OP, "A shard", device, a_shard)?;
            check::buffer_on(OP, "B", device, b)?;
            check::buffer_on(OP, "C", device, &*c)?;
            check::len_of(OP, "A shard", a_shard.len(), "m / world x k", &[m / world.max(1), k])?;
            check::len_of(OP, "B", b.len(), "n x k", &[n, k])?;
            check::len_of(OP, "C", c.len(), "m x n", &[m, n])
        })();
        // Addresses only of buffers that passed the checks (the guards live until the plan is built).
        let mut _guards = None;
        let pre = checked.map(|()| {
            let (pa, ra) = a_shard.device_ptr(stream);
            let (pb, rb) = b.device_ptr(stream);
            let (pc, wc) = c.device_ptr_mut(stream);
            _guards = Some((ra, rb, wc));
            (pa, pb, pc)
        });
        // SAFETY: the buffers hold the shape's elements (checked above; a failed check fails
        // the plan), are on this device, and are borrowed for 'a, as long as the plan.
        unsafe { Self::build(comm, stream, pre, m, n, k, n_comm) }
    }

    /// Heap bytes a plan of this shape takes on every rank, before it is built (`world`: every
    /// rank of every node): the gathered A, `m x k` bf16 rounded up to 256 bytes. Checks the
    /// shape as [`policy`] does.
    pub fn heap_bytes(m: usize, n: usize, k: usize, world: usize) -> Result<u64> {
        // Any SM count with room for one comm and one compute CTA: the bytes do not depend on it.
        let p = policy(m, n, k, world, u32::MAX, 1, None)?;
        p.gathered_bytes
            .checked_next_multiple_of(256)
            .ok_or_else(|| Error::Shape {
                op: OP,
                reason: format!("{} bytes overflow 64 bits rounded up to 256", p.gathered_bytes),
            })
    }

    /// [`AgGemmPlan::new`] on raw device addresses (16-byte aligned).
    ///
    /// # Safety
    /// `a_shard`, `b` and `c` must be device addresses of the communicator's context holding
    /// `m / world` x `k`, `n` x `k` and `m` x `n` bf16, and stay allocated while the plan's
    /// launches run; `c` is written by them, and nothing else may access it meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new_raw(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        a_shard: u64,
        b: u64,
        c: u64,
        m: usize,
        n: usize,
        k: usize,
        n_comm: u32,
    ) -> Result<Self> {
        // SAFETY: the caller's contract.
        unsafe { Self::build(comm, stream, Ok((a_shard, b, c)), m, n, k, n_comm) }
    }

    /// Validate (`pre`: the safe constructor's checks, or the raw addresses), take the heap,
    /// agree with every rank, encode and upload.
    ///
    /// # Safety
    /// As [`AgGemmPlan::new_raw`] for the addresses in `pre`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn build(
        comm: &'a Communicator,
        stream: &Arc<CudaStream>,
        pre: Result<(u64, u64, u64)>,
        m: usize,
        n: usize,
        k: usize,
        n_comm: u32,
    ) -> Result<Self> {
        let device: &Device = comm.device();
        // Shards are by global rank (world = every rank of every node).
        let world = (comm.world() * comm.nnodes()) as usize;
        let cached = || {
            tune::lookup(&tune::TuneKey {
                op: TUNE_OP.into(),
                world: world as u32,
                m,
                n,
                k,
            })
        };
        let checked = pre.and_then(|(a_shard, b, c)| {
            check::stream_on(OP, device, stream)?;
            let policy = policy(
                m,
                n,
                k,
                world,
                device.sm_count(),
                n_comm,
                if n_comm == 0 { cached() } else { None },
            )?;
            check::aligned16(OP, &[("A shard", a_shard), ("B", b), ("C", c)])?;
            let heap = comm.alloc_region(policy.gathered_bytes)?;
            Ok((a_shard, b, c, policy, heap))
        });
        let ((a_shard, b, c, policy, heap), _) = comm.agree_on(OP, checked, |(_, _, _, p, heap)| {
            PlanDesc::new(OP)
                .field("m", m)
                .field("n", n)
                .field("k", k)
                .field("dtype", "bf16")
                .field("world", world)
                .field("n_comm", p.n_comm)
                .field("grid", p.grid)
                .field(
                    "gathered (offset, bytes)",
                    format!("({}, {})", heap.offset(), heap.bytes()),
                )
        })?;
        let t = GemmTile::DEFAULT;
        let gathered = heap.buffer();
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        let map_a = encode_bf16_sw128_packed(comm.ptr(&gathered)?, k64, m64, t.block_k, t.block_m)?;
        let map_a_local = encode_bf16_sw128_packed(a_shard, k64, (m / world) as u64, t.block_k, t.block_m)?;
        let map_b = encode_bf16_sw128_packed(b, k64, n64, t.block_k, t.block_n)?;
        let map_c = encode_bf16_sw128_packed(c, n64, m64, GemmTile::EPILOGUE_BOX_COLS, GemmTile::EPILOGUE_BOX_ROWS)?;
        let mut words = [0u64; 64];
        words[..16].copy_from_slice(&map_a.opaque);
        words[16..32].copy_from_slice(&map_b.opaque);
        words[32..48].copy_from_slice(&map_c.opaque);
        words[48..].copy_from_slice(&map_a_local.opaque);
        let maps = stream.clone_htod(&words)?;
        let maps_addr = maps.device_ptr(stream).0;
        let a = AgGemmArgs {
            desc: comm.desc_ptr(),
            a_shard,
            a_gathered_off: gathered.offset(),
            map_a: maps_addr,
            map_a_local: maps_addr + 384,
            map_b: maps_addr + 128,
            map_c: maps_addr + 256,
            m: m as u32,
            n: n as u32,
            k: k as u32,
            n_comm: policy.n_comm,
        };
        let (args, args_addr) = super::upload_args(stream, &a)?;
        // Launches may come on other streams: the uploads are complete before the plan exists.
        stream.synchronize()?;
        Ok(AgGemmPlan {
            comm,
            func: device.function(&kernels::AG_GEMM_NK)?,
            _maps: maps,
            _args: args,
            args_addr,
            policy,
            gathered,
            _heap: heap,
            _buffers: PhantomData,
        })
    }

    /// Enqueues the fused kernel (under the communicator's launch lock).
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.comm.enqueue(OP, stream, || {
            let mut b = stream.launch_builder(&self.func);
            b.arg(&self.args_addr);
            // SAFETY: mk_ag_gemm_bf16_nk(args); the buffers and the communicator are borrowed
            // for the plan's lifetime (or kept alive by new_raw's caller).
            unsafe { b.launch(Device::launch_config(&kernels::AG_GEMM_NK, self.policy.grid)) }?;
            Ok(())
        })
    }
    /// [`AgGemmPlan::launch`] on a raw `CUstream` (a stream a server got from elsewhere, e.g.
    /// PyTorch's): refused unless it belongs to the communicator's context; ordered after the
    /// communicator's previous launch, and the next one after it, through events.
    ///
    /// # Safety
    /// `stream` must be a live stream (or null, the legacy default stream) that stays valid
    /// until the launch has completed.
    pub unsafe fn launch_raw(&self, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        // SAFETY: caller's contract for `stream`.
        unsafe {
            self.comm.enqueue_raw(OP, stream, || {
                let cfg = Device::launch_config(&kernels::AG_GEMM_NK, self.policy.grid);
                let mut params = [&self.args_addr as *const u64 as *mut std::ffi::c_void];
                // SAFETY: mk_ag_gemm_bf16_nk(args), its one parameter; the plan's buffers and
                // communicator outlive the launch as in `launch`.
                cudarc::driver::result::launch_kernel(
                    self.func.cu_function(),
                    cfg.grid_dim,
                    cfg.block_dim,
                    cfg.shared_mem_bytes,
                    stream,
                    &mut params,
                )?;
                Ok(())
            })
        }
    }
    /// CTAs moving A, and in total.
    pub fn split(&self) -> (u32, u32) {
        (self.policy.n_comm, self.policy.grid)
    }
    /// The policy's choices.
    pub fn policy(&self) -> AgGemmPolicy {
        self.policy
    }
    /// The gathered-A buffer in the heap: the peers' shards (and, across nodes, this rank's own,
    /// staged for the proxy). On one node this rank's own rows are never written there: the
    /// kernel reads them in place from `a_shard`.
    pub fn gathered(&self) -> SymBuffer {
        self.gathered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(r: Result<AgGemmPolicy>) -> String {
        match r {
            Err(Error::Shape { reason, .. }) => reason,
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn shapes_are_checked_before_planning() {
        assert!(policy(4096, 8192, 8192, 4, 132, 8, None).is_ok());
        assert!(reason(policy(4096 + 128, 8192, 8192, 4, 132, 8, None)).contains("multiple of world x 128 = 512"));
        assert!(reason(policy(0, 8192, 8192, 2, 132, 8, None)).contains("positive multiple"));
        assert!(reason(policy(4096, 8192, 100, 2, 132, 8, None)).contains("multiples of 8"));
        assert!(reason(policy(2 * 128 * 257, 256, 256, 2, 132, 8, None)).contains("257 chunks"));
        assert!(reason(policy(4096, 8192, 8192, 0, 132, 8, None)).contains("world = 0"));
        assert!(reason(policy(4096, 1 << 31, 8192, 2, 132, 8, None)).contains("below 2^31"));
        // world x 128 itself overflowing is a shape error, not a wrap.
        assert!(policy(4096, 8192, 8192, usize::MAX / 64, 132, 8, None).is_err());
    }

    /// Every combination of edge values: never a panic, and an accepted plan keeps its
    /// invariants.
    #[test]
    fn edge_values_never_panic_and_accepted_plans_hold() {
        let dims = [
            0usize,
            1,
            8,
            127,
            128,
            256,
            4096,
            i32::MAX as usize,
            1 << 31,
            usize::MAX,
        ];
        let mut accepted = 0;
        for &m in &dims {
            for &n in &dims {
                for &k in &[0usize, 8, 100, 8192, usize::MAX] {
                    for &world in &[0usize, 1, 2, 3, 8, usize::MAX] {
                        for &sms in &[0u32, 1, 2, 132, u32::MAX] {
                            for &req in &[0u32, 1, 4, 131, u32::MAX] {
                                for cached in [None, Some(0), Some(8), Some(u32::MAX)] {
                                    let Ok(p) = policy(m, n, k, world, sms, req, cached) else {
                                        continue;
                                    };
                                    accepted += 1;
                                    assert!(p.n_comm >= 1 && p.n_comm + 1 < sms);
                                    assert_eq!(p.grid, sms);
                                    assert_eq!(p.gathered_bytes, m as u64 * k as u64 * 2);
                                    assert_eq!(m % (world * 128), 0);
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(accepted > 0);
    }

    #[test]
    fn the_split_comes_from_the_request_the_cache_or_the_default() {
        let p = |req, cached| policy(4096, 8192, 8192, 2, 132, req, cached);
        assert_eq!(p(16, Some(8)).unwrap().n_comm, 16, "an explicit split wins");
        assert_eq!(p(0, Some(8)).unwrap().n_comm, 8, "then the tune cache");
        assert_eq!(p(0, None).unwrap().n_comm, tune::DEFAULT_SPLIT, "then the default");
        let q = p(0, None).unwrap();
        assert_eq!((q.grid, q.gathered_bytes), (132, 4096 * 8192 * 2));
        assert!(reason(p(131, None)).contains("between 1 and 130"));
        assert!(reason(p(0, Some(0))).contains("n_comm = 0"));
        assert!(reason(policy(4096, 8192, 8192, 2, 1, 0, None)).contains("the GPU has 1 SMs"));
    }
}
