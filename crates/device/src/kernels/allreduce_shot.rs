//! Latency-oriented AllReduce over NVLink peer mappings, for any element count (no 16-byte
//! multiple needed): the one-shot and two-shot forms that the host's AllReduce policy picks
//! between the LL path and the bandwidth path of `mk_allreduce` (docs/protocol.md, "One-shot
//! and two-shot AllReduce").
//!
//! - **one-shot** (`mk_allreduce_oneshot`): every rank pulls the whole buffer from every rank's
//!   heap (NVLink loads), sums in rank order (f32) and stores the sum into its own destination
//!   only. One data hop; `(world - 1) x bytes` read per rank. Not in place: a rank's own store
//!   would race with its peers' loads of the same words.
//! - **two-shot** (`mk_allreduce_twoshot`): reduce-scatter by pull (rank r sums chunk r of
//!   every rank's source), then all-gather by push (rank r stores that sum into every rank's
//!   destination). Two hops, `2 (world - 1) / world x bytes` moved per rank. In place is safe:
//!   chunk r is read and written by rank r alone.
//!
//! Both run inside [`direct`]'s handshake with epoch flags: Ready (every peer entered this
//! epoch: its source is final and its destination free) -> data -> CTA barrier -> Done (every
//! peer finished with my buffers) -> epoch advance. Every wait is a `BoundedWait` (error record
//! naming rank, role, flag and peer); nothing is reset between launches, so both forms replay
//! from a CUDA graph. The 16-byte vectors are split over the CTAs as in `mk_allreduce`; the
//! elements past the last whole vector (the tail, fewer than 16 bytes) go to the grid's last
//! CTA (one-shot: on every rank; two-shot: on the last rank, which pushes them to every rank).
//! Launch with the block size of `mkernel_config::kernels::COLLECTIVE`.
use super::collectives::{direct, dtype, esize, slice};
use crate::arch::{convert, ids};
use crate::comm::move_data::{reduce, Dtype};
use crate::comm::CommCtx;
use mkernel_config::comm::{CommDesc, Role};

/// The tail: elements `first..count` (fewer than 16 bytes of them), one per thread, summed over
/// every rank's source at `src_off` in rank order (f32, as `reduce`), the sum stored at `dst_off`
/// of every rank (`push`) or of this rank only.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`, inside [`direct`]'s body (peers' sources final, destinations
/// free); `src_off` and `dst_off` are element-aligned heap offsets of `count` elements of `dt` on every rank.
#[inline(always)]
unsafe fn reduce_tail(c: &CommCtx, src_off: u64, dst_off: u64, first: u64, count: u64, dt: Dtype, push: bool) {
    let e = first + ids::thread_idx() as u64;
    if e >= count {
        return;
    }
    let at = e * esize(dt);
    let mut acc = 0f32;
    for r in 0..8u32 {
        if r < c.world {
            let p = c.heap(r) + src_off + at;
            acc += if dt == Dtype::F32 {
                f32::from_bits(unsafe { (p as *const u32).read_volatile() })
            } else {
                convert::bf16_to_f32(unsafe { (p as *const u16).read_volatile() })
            };
        }
    }
    for r in 0..8u32 {
        if r < c.world && (push || r == c.rank) {
            let p = c.heap(r) + dst_off + at;
            if dt == Dtype::F32 {
                unsafe { (p as *mut u32).write_volatile(acc.to_bits()) };
            } else {
                unsafe { (p as *mut u16).write_volatile(convert::pack_bf16x2(acc, 0.0) as u16) };
            }
        }
    }
}

/// The one-shot and two-shot forms (`TWO`), as the entries below describe.
///
/// # Safety
///
/// As [`mk_allreduce_oneshot`] (`TWO` false) or [`mk_allreduce_twoshot`] (`TWO` true).
#[inline(always)]
unsafe fn shot<const TWO: bool>(desc: *const CommDesc, src_off: u64, dst_off: u64, count: u64, dtype_code: u32) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::IntraComm) };
    let dt = dtype(dtype_code);
    let n16 = count * esize(dt) / 16;
    let first_tail = n16 * 16 / esize(dt);
    let last_cta = ids::block_idx() + 1 == ids::grid_dim();
    // The 16-byte vectors this rank reduces: all of them (one-shot) or its chunk (two-shot).
    let (first, mine) = if TWO {
        let per_rank = n16.div_ceil(c.world as u64);
        let first = (c.rank as u64 * per_rank).min(n16);
        (first, (first + per_rank).min(n16) - first)
    } else {
        (0, n16)
    };
    let (lo, hi) = slice(mine);
    let off = (first + lo) * 16;
    unsafe {
        direct(
            &c,
            #[inline(always)]
            || {
                let (mut srcs, mut dsts) = ([0u64; 8], [0u64; 8]);
                for r in 0..8 {
                    if r < c.world {
                        srcs[r as usize] = c.heap(r) + src_off + off;
                        if TWO {
                            dsts[r as usize] = c.heap(r) + dst_off + off;
                        }
                    }
                }
                if TWO {
                    reduce(dsts, c.world, srcs, c.world, hi - lo, dt);
                } else {
                    let own = [c.heap(c.rank) + dst_off + off, 0, 0, 0, 0, 0, 0, 0];
                    reduce(own, 1, srcs, c.world, hi - lo, dt);
                }
                if last_cta && (!TWO || c.rank + 1 == c.world) {
                    reduce_tail(&c, src_off, dst_off, first_tail, count, dt, TWO);
                }
            },
        )
    }
}

/// One-shot AllReduce of `count` elements at `src_off` of every heap into `dst_off` of this
/// rank's heap (every rank does the same, so every rank ends with the sum). `dtype_code`: 0 bf16,
/// 1 f32.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel; `dtype_code` is 0 (bf16) or 1 (f32); `src_off`
/// and `dst_off` are 16-byte aligned offsets whose `count` elements lie inside every rank's heap past
/// `mkernel_config::comm::HEAP_RESERVED_BYTES`, and the two ranges do not overlap.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_allreduce_oneshot(
    desc: *const CommDesc,
    src_off: u64,
    dst_off: u64,
    count: u64,
    dtype_code: u32,
) {
    unsafe { shot::<false>(desc, src_off, dst_off, count, dtype_code) }
}

/// Two-shot AllReduce of `count` elements at `src_off` of every heap into `dst_off` of every
/// heap. `dtype_code`: 0 bf16, 1 f32.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel; `dtype_code` is 0 (bf16) or 1 (f32); `src_off`
/// and `dst_off` are 16-byte aligned offsets whose `count` elements lie inside every rank's heap past
/// `mkernel_config::comm::HEAP_RESERVED_BYTES`, and the two ranges are either the same (in place) or do not overlap.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_allreduce_twoshot(
    desc: *const CommDesc,
    src_off: u64,
    dst_off: u64,
    count: u64,
    dtype_code: u32,
) {
    unsafe { shot::<true>(desc, src_off, dst_off, count, dtype_code) }
}
