//! Persistent collectives over NVLink peer mappings: AllGather, ReduceScatter, AllReduce.
//!
//! Every CTA `b` of `g` owns slice `b` of every chunk and has its own flags and epoch, so CTAs
//! never wait for each other. Three paths, chosen by message size (docs/protocol.md):
//!
//! - **LL** (at most `LL_MSG_MAX` to one peer): like staged, but every 4 data bytes carry the
//!   epoch in the same atomic 8-byte word, so the receiver polls the data itself: no fence, no
//!   Staged flag.
//! - **staged** (what a rank sends one peer is at most `SMALL_MSG_MAX`): one hop, no handshake.
//!   Check the credit (the peer finished epoch e - 2, so the staging slot of parity e % 2 is
//!   free: its Done flag), write into the peer's staging slot, raise Staged; wait for every
//!   peer's Staged, consume the staged data locally, raise Done.
//! - **direct** (large): Ready handshake (peers' inputs are final and their outputs may be
//!   overwritten) -> loads/stores straight between the users' heap buffers -> barrier -> Done
//!   handshake (all writes into my buffers landed; nobody reads my inputs any more).
//!
//! Both paths end with Done = epoch at every peer, which is what the staged credit reads.
//! Launch with the block size of `mkernel_config::kernels::COLLECTIVE`.
use crate::arch::{convert::pack_bf16x2, ids, memory, sync};
use crate::comm::move_data::{copy, reduce, Dtype};
use crate::comm::wait::{signal_all_peers, wait_all_peers, wait_staging_credit};
use crate::comm::{ll, CommCtx};
use mkernel_config::comm::{CommDesc, FlagSlot, Role, LL_MSG_MAX, SMALL_MSG_MAX, STAGED_CTAS};

/// This CTA's part `[lo, hi)` of `n` units.
#[inline(always)]
pub(crate) fn slice(n: u64) -> (u64, u64) {
    let (b, g) = (ids::block_idx() as u64, ids::grid_dim() as u64);
    (n * b / g, n * (b + 1) / g)
}

/// This CTA's part of `n` units on the LL and staged paths, which only CTAs
/// `0..STAGED_CTAS` carry (`(0, 0)` for the others: they only advance their epochs).
#[inline(always)]
fn staged_slice(n: u64) -> (u64, u64) {
    let (b, g) = (ids::block_idx() as u64, (ids::grid_dim().min(STAGED_CTAS)) as u64);
    if b >= g {
        (0, 0)
    } else {
        (n * b / g, n * (b + 1) / g)
    }
}

/// This CTA's part of `bytes / 16` 16-byte units per peer: [`staged_slice`] on the LL and staged paths
/// (`bytes <= SMALL_MSG_MAX`), [`slice`] on the direct path.
#[inline(always)]
fn path_slice(bytes: u64) -> (u64, u64) {
    if bytes <= SMALL_MSG_MAX {
        staged_slice(bytes / 16)
    } else {
        slice(bytes / 16)
    }
}

/// CTAs beyond `STAGED_CTAS` on the LL and staged paths: nothing to move, keep the epoch.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`; called by every thread of the CTA (it may end in a CTA barrier
/// and the epoch advance).
#[inline(always)]
unsafe fn idle(c: &CommCtx) -> bool {
    if c.cta >= STAGED_CTAS {
        sync::sync_threads();
        unsafe { c.finish() };
        return true;
    }
    false
}

#[inline(always)]
pub(crate) fn dtype(code: u32) -> Dtype {
    if code == 1 {
        Dtype::F32
    } else {
        Dtype::Bf16
    }
}

#[inline(always)]
pub(crate) fn esize(dt: Dtype) -> u64 {
    if dt == Dtype::F32 {
        4
    } else {
        2
    }
}

/// Direct path: Ready handshake, `body`, barrier, Done handshake, epoch advance. Returns early
/// (leaving the error record) when a wait gives up.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`; called by every thread of the CTA, once per launch; `body` only
/// moves data the Ready handshake makes safe to touch (peers' inputs final, their outputs free).
#[inline(always)]
pub(crate) unsafe fn direct(c: &CommCtx, body: impl FnOnce()) {
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

/// LL path (tiny messages): credit, `send` (LL words into peers' staging slots: data and epoch
/// flag in one atomic 8-byte word), `recv` (every thread polls its words; false if a wait gave
/// up), barrier, Done signal, epoch advance. One NVLink hop and no fence.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`; called by every thread of the CTA, once per launch; `send` writes
/// only this rank's LL slots at its peers for this epoch, and `recv` reads only what they sent.
#[inline(always)]
unsafe fn ll_path(c: &CommCtx, send: impl FnOnce(), recv: impl FnOnce() -> bool) {
    unsafe {
        if idle(c) || !wait_staging_credit(c) {
            return;
        }
        send();
        let ok = recv();
        if sync::sync_threads_or(!ok) {
            return;
        }
        signal_all_peers(c, FlagSlot::Done);
        c.finish();
    }
}

/// LL send side: this CTA's 8-byte units `lo..hi`, from `src(p)` (the address of unit `lo` of what goes to peer `p`),
/// into every peer `p`'s LL slot for this rank.
///
/// # Safety
///
/// As [`ll::send`] for each peer: called by every thread of the CTA inside [`ll_path`]'s `send`; `src(p)` is readable
/// for `hi - lo` units.
#[inline(always)]
unsafe fn ll_send_to_peers(c: &CommCtx, lo: u64, hi: u64, src: impl Fn(u32) -> *const u8) {
    for k in 1..c.world {
        let p = (c.rank + k) % c.world;
        unsafe { ll::send(c, (c.ll_slot(p, c.rank) + lo * 16) as *mut u8, src(p), hi - lo) };
    }
}

/// Staged send side: this CTA's 16-byte units `lo..hi`, from `src(p)` (the address of unit `lo` of what goes to peer
/// `p`), into every peer `p`'s staging slot for this rank.
///
/// # Safety
///
/// As [`copy`] for each peer: called by every thread of the CTA inside [`staged`]'s `send`; `src(p)` is readable for
/// `hi - lo` units.
#[inline(always)]
unsafe fn stage_to_peers(c: &CommCtx, lo: u64, hi: u64, src: impl Fn(u32) -> *const u8) {
    for k in 1..c.world {
        let p = (c.rank + k) % c.world;
        unsafe { copy((c.staging(p, c.rank) + lo * 16) as *mut u8, src(p), hi - lo) };
    }
}

/// The reduction sources of the staged path's consume side, in rank order: `$own` (this rank's unit `lo`, evaluated
/// only for this rank) for this rank, every peer's staging slot for this rank at unit `$lo` for the others. A macro,
/// not a function: as an `#[inline(always)]` fn it changed the PTX of `mk_allreduce` and `mk_reduce_scatter`.
macro_rules! staged_srcs {
    ($c:expr, $own:expr, $lo:expr) => {{
        let mut srcs = [0u64; 8];
        for r in 0..8 {
            if r < $c.world {
                srcs[r as usize] = if r == $c.rank {
                    $own
                } else {
                    $c.staging($c.rank, r) + $lo * 16
                };
            }
        }
        srcs
    }};
}

/// Adds one 8-byte unit (4 bf16 or 2 f32) into `acc`.
#[inline(always)]
fn add_unit(acc: &mut [f32; 4], v: [u32; 2], dt: Dtype) {
    if dt == Dtype::F32 {
        acc[0] += f32::from_bits(v[0]);
        acc[1] += f32::from_bits(v[1]);
    } else {
        acc[0] += f32::from_bits(v[0] << 16);
        acc[1] += f32::from_bits(v[0] & 0xffff_0000);
        acc[2] += f32::from_bits(v[1] << 16);
        acc[3] += f32::from_bits(v[1] & 0xffff_0000);
    }
}

#[inline(always)]
fn pack_unit(acc: &[f32; 4], dt: Dtype) -> [u32; 2] {
    if dt == Dtype::F32 {
        [acc[0].to_bits(), acc[1].to_bits()]
    } else {
        [pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3])]
    }
}

/// LL receive side of a reduction: `out[i] = sum over ranks in rank order` of unit `i` of
/// `own` (this rank's input, local) and of every peer's LL slot, for this CTA's units.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`; `own` is the address of this rank's input and `out` of its
/// output, each 8-byte aligned with `hi` units of 8 bytes of `dt` elements; the peers send their units `lo..hi` with
/// [`ll::send`] in this epoch.
#[inline(always)]
unsafe fn ll_reduce(c: &CommCtx, own: u64, out: u64, lo: u64, hi: u64, dt: Dtype) -> bool {
    let nt = ids::block_dim() as u64;
    let mut i = lo + ids::thread_idx() as u64;
    while i < hi {
        let mut acc = [0f32; 4];
        for r in 0..8u32 {
            if r < c.world {
                let v = if r == c.rank {
                    unsafe { memory::ld_v2((own + i * 8) as *const u8) }
                } else {
                    match unsafe { ll::recv(c, c.ll_slot(c.rank, r) as *const u8, i, r) } {
                        Some(v) => v,
                        None => return false,
                    }
                };
                add_unit(&mut acc, v, dt);
            }
        }
        unsafe { memory::st_v2((out + i * 8) as *mut u8, pack_unit(&acc, dt)) };
        i += nt;
    }
    true
}

/// Staged path: credit, `send` (writes into peers' staging slots), barrier, Staged signal,
/// wait for every peer's data, `consume`, barrier, Done signal, epoch advance.
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for `c`; called by every thread of the CTA, once per launch; `send` writes
/// only this rank's staging slots at its peers for this epoch's parity, and `consume` reads only staged data and this
/// rank's own buffers.
#[inline(always)]
unsafe fn staged(c: &CommCtx, send: impl FnOnce(), consume: impl FnOnce()) {
    unsafe {
        if idle(c) || !wait_staging_credit(c) {
            return;
        }
        send();
        sync::sync_threads();
        signal_all_peers(c, FlagSlot::Staged);
        if !wait_all_peers(c, FlagSlot::Staged) {
            return;
        }
        consume();
        sync::sync_threads();
        signal_all_peers(c, FlagSlot::Done);
        c.finish();
    }
}

/// AllGather: every rank's `bytes` at `src` (local) go to offset `dst_off + rank * bytes` of
/// every rank's heap.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel; `bytes` is a multiple of 16, the same on every
/// rank; `src` is a 16-byte aligned device address of `bytes` readable bytes; `dst_off` is 16-byte aligned and
/// `dst_off + world * bytes` lies inside every rank's heap past `mkernel_config::comm::HEAP_RESERVED_BYTES` (the user
/// buffers).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_allgather(desc: *const CommDesc, src: *const u8, dst_off: u64, bytes: u64) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::IntraComm) };
    let (lo, hi) = path_slice(bytes);
    let mine = unsafe { src.add((lo * 16) as usize) };
    let out = |r: u32| (c.heap(c.rank) + dst_off + r as u64 * bytes + lo * 16) as *mut u8;
    unsafe {
        if bytes <= LL_MSG_MAX {
            let (lo8, hi8) = staged_slice(bytes / 8);
            let out8 = |r: u32| c.heap(c.rank) + dst_off + r as u64 * bytes;
            ll_path(
                &c,
                #[inline(always)]
                || ll_send_to_peers(&c, lo8, hi8, |_| src.add((lo8 * 8) as usize)),
                #[inline(always)]
                || {
                    let nt = ids::block_dim() as u64;
                    let mut i = lo8 + ids::thread_idx() as u64;
                    while i < hi8 {
                        memory::st_v2(
                            (out8(c.rank) + i * 8) as *mut u8,
                            memory::ld_v2(src.add((i * 8) as usize)),
                        );
                        for k in 1..c.world {
                            let q = (c.rank + k) % c.world;
                            match ll::recv(&c, c.ll_slot(c.rank, q) as *const u8, i, q) {
                                Some(v) => memory::st_v2((out8(q) + i * 8) as *mut u8, v),
                                None => return false,
                            }
                        }
                        i += nt;
                    }
                    true
                },
            )
        } else if bytes <= SMALL_MSG_MAX {
            staged(
                &c,
                #[inline(always)]
                || {
                    stage_to_peers(&c, lo, hi, |_| mine);
                    copy(out(c.rank), mine, hi - lo);
                },
                #[inline(always)]
                || {
                    for k in 1..c.world {
                        let q = (c.rank + k) % c.world;
                        copy(out(q), (c.staging(c.rank, q) + lo * 16) as *const u8, hi - lo);
                    }
                },
            )
        } else {
            // Push: each rank stores its own chunk into every peer (NVLink writes).
            direct(
                &c,
                #[inline(always)]
                || {
                    for k in 0..c.world {
                        let p = (c.rank + k) % c.world;
                        copy(
                            (c.heap(p) + dst_off + c.rank as u64 * bytes + lo * 16) as *mut u8,
                            mine,
                            hi - lo,
                        );
                    }
                },
            )
        }
    }
}

/// ReduceScatter: rank r's `dst` (local) gets the sum over ranks of elements
/// `[r * count, (r + 1) * count)` of the buffer at `src_off` in every heap, f32 accumulation.
/// `dtype`: 0 bf16, 1 f32.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel; `dtype_code` is 0 (bf16) or 1 (f32) and `count`
/// elements of it are a multiple of 16 bytes; `src_off` is 16-byte aligned with `src_off + world * count` elements
/// inside every rank's heap; `dst` is a 16-byte aligned device address of `count` writable elements.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_reduce_scatter(
    desc: *const CommDesc,
    src_off: u64,
    dst: *mut u8,
    count: u64,
    dtype_code: u32,
) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::IntraComm) };
    let dt = dtype(dtype_code);
    let chunk = count * esize(dt);
    let (lo, hi) = path_slice(chunk);
    let input = |r: u32, chunk_of: u32| c.heap(r) + src_off + chunk_of as u64 * chunk + lo * 16;
    let mut dsts = [0u64; 8];
    dsts[0] = dst as u64 + lo * 16;
    unsafe {
        if chunk <= LL_MSG_MAX {
            let (lo8, hi8) = staged_slice(chunk / 8);
            let chunk_of = |p: u32| c.heap(c.rank) + src_off + p as u64 * chunk;
            ll_path(
                &c,
                #[inline(always)]
                || ll_send_to_peers(&c, lo8, hi8, |p| (chunk_of(p) + lo8 * 8) as *const u8),
                #[inline(always)]
                || ll_reduce(&c, chunk_of(c.rank), dst as u64, lo8, hi8, dt),
            )
        } else if chunk <= SMALL_MSG_MAX {
            staged(
                &c,
                #[inline(always)]
                // My contribution to peer p's chunk goes to p's staging slot for me.
                || stage_to_peers(&c, lo, hi, |p| input(c.rank, p) as *const u8),
                #[inline(always)]
                || {
                    reduce(
                        dsts,
                        1,
                        staged_srcs!(c, input(c.rank, c.rank), lo),
                        c.world,
                        hi - lo,
                        dt,
                    )
                },
            )
        } else {
            // Pull: read my chunk from every peer (NVLink loads) and sum.
            direct(
                &c,
                #[inline(always)]
                || {
                    let mut srcs = [0u64; 8];
                    for r in 0..8 {
                        if r < c.world {
                            srcs[r as usize] = input(r, c.rank);
                        }
                    }
                    reduce(dsts, 1, srcs, c.world, hi - lo, dt);
                },
            )
        }
    }
}

/// AllReduce of the buffer of `count` elements at `src_off` in every heap into `dst_off` of
/// every heap. Staged (one-shot): every rank stages its whole buffer at every peer and sums all
/// of them locally in rank order. Direct (two-shot): rank r reduces 16-byte chunk r (pull) and
/// stores the sum into every rank's destination (push). In place (`src_off == dst_off`) is safe
/// on both paths: the staged path reads only staging slots and its own input before writing its
/// own output; on the direct path chunk r is read and written by rank r alone.
///
/// # Safety
///
/// The launch contract (`crate::kernels`) for a communicating kernel; `dtype_code` is 0 (bf16) or 1 (f32) and `count`
/// elements of it are a multiple of 16 bytes; `src_off` and `dst_off` are 16-byte aligned offsets whose `count`
/// elements lie inside every rank's heap (they may be equal: in place).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_allreduce(
    desc: *const CommDesc,
    src_off: u64,
    dst_off: u64,
    count: u64,
    dtype_code: u32,
) {
    let c = unsafe { CommCtx::new(desc, ids::block_idx(), Role::IntraComm) };
    let dt = dtype(dtype_code);
    let bytes = count * esize(dt);
    let n16 = bytes / 16;
    unsafe {
        if bytes <= LL_MSG_MAX {
            let (lo8, hi8) = staged_slice(bytes / 8);
            let (mine, out) = (c.heap(c.rank) + src_off, c.heap(c.rank) + dst_off);
            ll_path(
                &c,
                #[inline(always)]
                || ll_send_to_peers(&c, lo8, hi8, |_| (mine + lo8 * 8) as *const u8),
                #[inline(always)]
                || ll_reduce(&c, mine, out, lo8, hi8, dt),
            )
        } else if bytes <= SMALL_MSG_MAX {
            let (lo, hi) = staged_slice(n16);
            let mine = c.heap(c.rank) + src_off + lo * 16;
            staged(
                &c,
                #[inline(always)]
                || stage_to_peers(&c, lo, hi, |_| mine as *const u8),
                #[inline(always)]
                || {
                    let srcs = staged_srcs!(c, mine, lo);
                    let mut dsts = [0u64; 8];
                    dsts[0] = c.heap(c.rank) + dst_off + lo * 16;
                    reduce(dsts, 1, srcs, c.world, hi - lo, dt);
                },
            )
        } else {
            let per_rank = n16.div_ceil(c.world as u64);
            let first = (c.rank as u64 * per_rank).min(n16);
            let mine = (first + per_rank).min(n16) - first;
            let (lo, hi) = slice(mine);
            let off = (first + lo) * 16;
            direct(
                &c,
                #[inline(always)]
                || {
                    let (mut srcs, mut dsts) = ([0u64; 8], [0u64; 8]);
                    for r in 0..8 {
                        if r < c.world {
                            srcs[r as usize] = c.heap(r) + src_off + off;
                            dsts[r as usize] = c.heap(r) + dst_off + off;
                        }
                    }
                    reduce(dsts, c.world, srcs, c.world, hi - lo, dt);
                },
            )
        }
    }
}
