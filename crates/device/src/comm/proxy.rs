//! The device side of GPU-initiated inter-node traffic: commands posted into the proxy's
//! host-mapped FIFO (wire format in `mkernel_config::fifo`, protocol in docs/internode.md),
//! and bounded waits on the flags the proxy raises.
//!
//! Posting: claim `seq` with `atom.add` on the device-side head; wait (bounded) until
//! `seq - tail < capacity`; write the body with plain stores; commit with
//! `st.release.sys header = seq + 1` (the proxy acquires the header, then reads the body).
use super::wait::{BoundedWait, Waiting};
use super::CommCtx;
use crate::arch::{memory, memory::Scope};
use mkernel_config::comm::{remote_flag_offset, RemoteSlot, FIFO_HEAD_OFFSET};
use mkernel_config::fifo::{self, offsets as at};

use mkernel_config::comm::wait_code::{
    FIFO_DONE as WAIT_FIFO_DONE, FIFO_SPACE as WAIT_FIFO_SPACE, REMOTE_DATA as WAIT_REMOTE_DATA,
    REMOTE_READY as WAIT_REMOTE_READY, REMOTE_RING_DATA as WAIT_REMOTE_RING_DATA,
    REMOTE_RING_FREE as WAIT_REMOTE_RING_FREE,
};

/// One command (the fields of `mkernel_config::fifo::CommandBody` that vary; `epoch` and
/// `flags` come from the context).
#[derive(Clone, Copy)]
pub struct Command {
    pub opcode: u16,
    pub dst_rank: u32,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub bytes: u64,
    pub flag_offset: u64,
    pub flag_value: u64,
}

/// Polls `read` until `done` holds for what it read ([`BoundedWait::until`] with the proxy's
/// abort word); false on timeout (error record: `code`, `peer` - a global rank -, `target`,
/// last value) or when this rank or its proxy aborted.
///
/// # Safety
///
/// The communicator contract (`crate::comm`), with `c.fifo` the proxy FIFO of this node: the wait reads
/// this rank's abort words and the proxy's abort word in the FIFO.
#[inline(always)]
unsafe fn wait_until(
    c: &CommCtx,
    code: u32,
    peer: u32,
    target: u64,
    mut read: impl FnMut() -> u64,
    done: impl Fn(u64) -> bool,
) -> bool {
    let what = Waiting {
        code,
        peer: move |_: &CommCtx| peer,
        expected: target,
    };
    unsafe {
        BoundedWait::new(c, what).with_proxy_abort().until(|| {
            let seen = read();
            if done(seen) {
                Ok(())
            } else {
                Err(seen)
            }
        })
    }
    .is_some()
}

/// Posts `cmd`; returns its sequence number, or `None` when the FIFO stayed full past the
/// timeout or the proxy aborted.
///
/// # Safety
///
/// The communicator contract (`crate::comm`), with `c.fifo` the proxy FIFO of this node (nonzero); `cmd.dst_rank` is a
/// global rank of the job and the offsets and length lie inside the source and destination heaps. The command's source
/// bytes must not change until [`wait_done`] covers the returned sequence number.
#[inline(always)]
pub unsafe fn post(c: &CommCtx, cmd: Command) -> Option<u64> {
    unsafe { post_flags(c, cmd, 0) }
}

/// As [`post`], with `extra` command flag bits (`mkernel_config::fifo::CMD_NO_FLAG`).
///
/// # Safety
///
/// As [`post`]; with `CMD_NO_FLAG`, `cmd` is a `PUT` whose `flag_offset` and `flag_value` are 0.
#[inline(always)]
pub unsafe fn post_flags(c: &CommCtx, cmd: Command, extra: u16) -> Option<u64> {
    let head = (c.heap(c.rank) + FIFO_HEAD_OFFSET) as *mut u64;
    let seq = unsafe { memory::atom_relaxed_add_u64(Scope::Gpu, head, 1) };
    let tail = (c.fifo + at::TAIL as u64) as *const u64;
    let cap = c.fifo_capacity as u64;
    if !unsafe {
        wait_until(
            c,
            WAIT_FIFO_SPACE,
            cmd.dst_rank,
            seq,
            || memory::ld_acquire_u64(Scope::Sys, tail),
            |t| seq - t < cap,
        )
    } {
        return None;
    }
    let slot = c.fifo + fifo::FIFO_HEADER_BYTES as u64 + (seq % cap) * fifo::SLOT_BYTES as u64;
    let field = |off: usize| slot + off as u64;
    unsafe {
        (field(at::CMD_OPCODE) as *mut u16).write_volatile(cmd.opcode);
        (field(at::CMD_FLAGS) as *mut u16).write_volatile(fifo::cmd_flags(c.epoch_seq, extra));
        (field(at::CMD_DST_RANK) as *mut u32).write_volatile(cmd.dst_rank);
        (field(at::CMD_SRC_OFFSET) as *mut u64).write_volatile(cmd.src_offset);
        (field(at::CMD_DST_OFFSET) as *mut u64).write_volatile(cmd.dst_offset);
        (field(at::CMD_BYTES) as *mut u64).write_volatile(cmd.bytes);
        (field(at::CMD_FLAG_OFFSET) as *mut u64).write_volatile(cmd.flag_offset);
        (field(at::CMD_FLAG_VALUE) as *mut u64).write_volatile(cmd.flag_value);
        // The whole 64-bit launch counter: the proxy's "epochs never decrease" check then holds
        // across 2^32 launches (wire format version 2, see `mkernel_config::fifo`).
        (field(at::CMD_EPOCH) as *mut u64).write_volatile(c.epoch);
        memory::st_release_u64(Scope::Sys, field(at::CMD_HEADER) as *mut u64, seq + 1);
    }
    Some(seq)
}

/// `SIGNAL`: raise `slot` of this rank at `dst` to this epoch (ordered after earlier puts to `dst`).
///
/// # Safety
///
/// As [`post`], with `dst` a global rank of the job.
#[inline(always)]
pub unsafe fn signal(c: &CommCtx, dst: u32, slot: RemoteSlot) -> Option<u64> {
    unsafe {
        post(
            c,
            Command {
                opcode: fifo::OP_SIGNAL,
                dst_rank: dst,
                src_offset: 0,
                dst_offset: 0,
                bytes: 0,
                flag_offset: remote_flag_offset(slot, c.global_rank),
                flag_value: c.epoch,
            },
        )
    }
}

/// The `PUT` command of `bytes` from offset `src_off` of this rank's heap to offset `dst_off` of `dst`'s heap that
/// raises the flag at offset `flag_offset` of `dst`'s heap to `flag_value` (none with `CMD_NO_FLAG`).
#[inline(always)]
fn put_command(dst: u32, src_off: u64, dst_off: u64, bytes: u64, flag_offset: u64, flag_value: u64) -> Command {
    Command {
        opcode: fifo::OP_PUT,
        dst_rank: dst,
        src_offset: src_off,
        dst_offset: dst_off,
        bytes,
        flag_offset,
        flag_value,
    }
}

/// `PUT`: `bytes` from offset `src_off` of this rank's heap to offset `dst_off` of `dst`'s heap,
/// then raise this rank's `Data` flag at `dst` to this epoch.
///
/// # Safety
///
/// As [`post`]: `dst` a global rank, `src_off..src_off + bytes` inside this rank's heap and `dst_off..dst_off + bytes`
/// inside `dst`'s heap; the source bytes stay unchanged until [`wait_done`] covers the returned sequence number.
#[inline(always)]
pub unsafe fn put(c: &CommCtx, dst: u32, src_off: u64, dst_off: u64, bytes: u64) -> Option<u64> {
    unsafe {
        post(
            c,
            put_command(
                dst,
                src_off,
                dst_off,
                bytes,
                remote_flag_offset(RemoteSlot::Data, c.global_rank),
                c.epoch,
            ),
        )
    }
}

/// `PUT` raising this rank's `slot` flag at `dst` to `value` (latency probes).
///
/// # Safety
///
/// As [`put`].
#[inline(always)]
pub unsafe fn put_value(
    c: &CommCtx,
    dst: u32,
    src_off: u64,
    dst_off: u64,
    bytes: u64,
    slot: RemoteSlot,
    value: u64,
) -> Option<u64> {
    unsafe {
        post(
            c,
            put_command(
                dst,
                src_off,
                dst_off,
                bytes,
                remote_flag_offset(slot, c.global_rank),
                value,
            ),
        )
    }
}

/// `PUT` that raises no flag (`CMD_NO_FLAG`): a [`signal`] to `dst` posted after it raises a
/// flag once its data (and every earlier PUT's to `dst`) is visible there.
///
/// # Safety
///
/// As [`put`].
#[inline(always)]
pub unsafe fn put_no_flag(c: &CommCtx, dst: u32, src_off: u64, dst_off: u64, bytes: u64) -> Option<u64> {
    unsafe { post_flags(c, put_command(dst, src_off, dst_off, bytes, 0, 0), fifo::CMD_NO_FLAG) }
}

/// As [`wait_remote`], with the error record's wait code `code` (an operation's own name for
/// the flag, e.g. `wait_code::MOE_EP + ...`) instead of the generic remote ready/data codes.
///
/// # Safety
///
/// As [`wait_remote`].
#[inline(always)]
pub unsafe fn wait_remote_as(c: &CommCtx, slot: RemoteSlot, src: u32, code: u32) -> bool {
    unsafe { wait_remote_flag(c, slot, src, code, c.epoch) }
}

/// Waits until the inter-node flag (`slot`, `src`) in this rank's heap reaches this epoch.
///
/// # Safety
///
/// The communicator contract (`crate::comm`); `src` is a global rank of the job.
#[inline(always)]
pub unsafe fn wait_remote(c: &CommCtx, slot: RemoteSlot, src: u32) -> bool {
    unsafe { wait_remote_value(c, slot, src, c.epoch) }
}

/// Waits until the inter-node flag (`slot`, `src`) in this rank's heap reaches `target`.
///
/// # Safety
///
/// As [`wait_remote`].
#[inline(always)]
pub unsafe fn wait_remote_value(c: &CommCtx, slot: RemoteSlot, src: u32, target: u64) -> bool {
    let code = match slot {
        RemoteSlot::Ready | RemoteSlot::FusedReady => WAIT_REMOTE_READY,
        RemoteSlot::RingData => WAIT_REMOTE_RING_DATA,
        RemoteSlot::RingFree => WAIT_REMOTE_RING_FREE,
        _ => WAIT_REMOTE_DATA,
    };
    unsafe { wait_remote_flag(c, slot, src, code, target) }
}

/// Waits until the inter-node flag (`slot`, `src`) in this rank's heap reaches `target`, reporting a timeout under
/// the error record's wait code `code`.
///
/// # Safety
///
/// As [`wait_remote`].
#[inline(always)]
unsafe fn wait_remote_flag(c: &CommCtx, slot: RemoteSlot, src: u32, code: u32, target: u64) -> bool {
    let flag = (c.heap(c.rank) + remote_flag_offset(slot, src)) as *const u64;
    unsafe {
        wait_until(
            c,
            code,
            src,
            target,
            || memory::ld_acquire_u64(Scope::Sys, flag),
            |v| v >= target,
        )
    }
}

/// Waits until the proxy completed every command up to `seq` (their sources may be reused).
///
/// # Safety
///
/// The communicator contract (`crate::comm`), with `c.fifo` the proxy FIFO of this node; `seq` a sequence number
/// returned by [`post`] during this launch.
#[inline(always)]
pub unsafe fn wait_done(c: &CommCtx, seq: u64) -> bool {
    let done = (c.fifo + at::DONE as u64) as *const u64;
    unsafe {
        wait_until(
            c,
            WAIT_FIFO_DONE,
            c.global_rank,
            seq + 1,
            || memory::ld_acquire_u64(Scope::Sys, done),
            |d| d > seq,
        )
    }
}
