//! Persistent collectives over NVLink peer mappings: AllGather, ReduceScatter, AllReduce.
//!
//! Every CTA `b` of `g` owns slice `b` of every chunk and has its own flags and epoch, so CTAs
//! never wait for each other. Each kernel is: Ready handshake (peers' inputs are final and their
//! outputs may be overwritten) -> data movement -> barrier -> Done handshake (everything written
//! into my buffers has landed and nobody reads my inputs any more) -> advance the epoch.
//! Launch with the block size of `mkernel_config::kernels::COLLECTIVE`.
use crate::arch::{ids, sync};
use crate::comm::move_data::{copy, reduce, Dtype};
use crate::comm::wait::{signal_all_peers, wait_all_peers};
use crate::comm::CommCtx;
use mkernel_config::comm::{CommDesc, FlagSlot, Role};

/// This CTA's part `[lo, hi)` of `n` units.
#[inline(always)]
fn slice(n: u64) -> (u64, u64) {
    let (b, g) = (ids::block_idx() as u64, ids::grid_dim() as u64);
    (n * b / g, n * (b + 1) / g)
}

#[inline(always)]
fn dtype(code: u32) -> Dtype {
    if code == 1 { Dtype::F32 } else { Dtype::Bf16 }
}

/// Ready handshake, `body`, barrier, Done handshake, epoch advance. Returns early (leaving the
/// error record) when a wait gives up.
#[inline(always)]
unsafe fn exchange(c: &CommCtx, body: impl FnOnce()) {
    unsafe {
        signal_all_peers(c, FlagSlot::Ready);
        if !wait_all_peers(c, FlagSlot::Ready) {
            return;
        }
        body();
        sync::sync_threads();
        signal_all_peers(c, FlagSlot::Done);
        if !wait_all_peers(c, FlagSlot::Done) {
            return;
        }
        c.finish();
    }
}

/// AllGather: every rank's `bytes` at `src` (local) go to offset `dst_off + rank * bytes` of
/// every rank's heap. Pushes: each rank stores its own chunk into every peer (NVLink writes).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_allgather(desc: *const CommDesc, src: *const u8, dst_off: u64, bytes: u64) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::IntraComm) };
    let (lo, hi) = slice(bytes / 16);
    unsafe {
        exchange(&c, || {
            for k in 0..c.world {
                let p = (c.rank + k) % c.world;
                let dst = (c.heap(p) + dst_off + c.rank as u64 * bytes + lo * 16) as *mut u8;
                copy(dst, src.add((lo * 16) as usize), hi - lo);
            }
        })
    }
}

/// ReduceScatter: rank r's `dst` (local) gets the sum over ranks of elements
/// `[r * count, (r + 1) * count)` of the buffer at `src_off` in every heap. Pulls: each rank
/// reads its chunk from every peer (NVLink loads) and sums in f32. `dtype`: 0 bf16, 1 f32.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_reduce_scatter(desc: *const CommDesc, src_off: u64, dst: *mut u8, count: u64, dtype_code: u32) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::IntraComm) };
    let dt = dtype(dtype_code);
    let chunk_bytes = count * if dt == Dtype::F32 { 4 } else { 2 };
    let (lo, hi) = slice(chunk_bytes / 16);
    unsafe {
        exchange(&c, || {
            let mut srcs = [0u64; 8];
            for r in 0..8 {
                if r < c.world {
                    srcs[r as usize] = c.heap(r) + src_off + c.rank as u64 * chunk_bytes + lo * 16;
                }
            }
            let mut dsts = [0u64; 8];
            dsts[0] = dst as u64 + lo * 16;
            reduce(&dsts, 1, &srcs, c.world, hi - lo, dt);
        })
    }
}

/// AllReduce (two-shot): the buffer of `count` elements at `src_off` in every heap is summed
/// into `dst_off` of every heap. Rank r reduces 16-byte chunk r of the buffer (pull) and stores
/// the sum into every rank's destination (push). In place (`src_off == dst_off`) is safe: chunk
/// r is read and written by rank r alone.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_allreduce(desc: *const CommDesc, src_off: u64, dst_off: u64, count: u64, dtype_code: u32) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::IntraComm) };
    let dt = dtype(dtype_code);
    let n16 = count * if dt == Dtype::F32 { 4 } else { 2 } / 16;
    let per_rank = n16.div_ceil(c.world as u64);
    let first = (c.rank as u64 * per_rank).min(n16);
    let mine = (first + per_rank).min(n16) - first;
    let (lo, hi) = slice(mine);
    let off = (first + lo) * 16;
    unsafe {
        exchange(&c, || {
            let (mut srcs, mut dsts) = ([0u64; 8], [0u64; 8]);
            for r in 0..8 {
                if r < c.world {
                    srcs[r as usize] = c.heap(r) + src_off + off;
                    dsts[r as usize] = c.heap(r) + dst_off + off;
                }
            }
            reduce(&dsts, c.world, &srcs, c.world, hi - lo, dt);
        })
    }
}
