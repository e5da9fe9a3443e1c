//! Bounded waits on epoch flags and on shared-memory conditions of a communicating CTA, and
//! the error record they leave when they give up (docs/protocol.md, "Every device wait").
use super::CommCtx;
use crate::arch::{ids, mbarrier, memory, memory::Scope, smem::SmemAddr, sync, time};
use mkernel_config::comm::{
    abort_word, fifo, CommDesc, ErrorCode, ErrorRecord, FlagSlot, Role, ABORT_OFFSET, ERROR_RECORD_OFFSET,
    HOST_ABORT_POLLS, STAGED_CTAS,
};

/// Polls between clock and abort checks.
pub const POLLS_PER_CHECK: u32 = 64;

/// What a wait that gives up names in the rank's error record ([`report_give_up`]): the wait
/// code (a `FlagSlot` as `u32`, or `mkernel_config::comm::wait_code`), the peer it waited for
/// as a global rank - computed from the context only when the wait gives up, so that no
/// register keeps it across the polling loop - and the value it expected.
#[derive(Clone, Copy)]
pub struct Waiting<P> {
    pub code: u32,
    pub peer: P,
    pub expected: u64,
}

/// The one polling loop behind every bounded wait of a communicating thread on a word that
/// other ranks, the proxy or this rank's other CTAs write (docs/protocol.md, "Every device
/// wait"): it polls, and every [`POLLS_PER_CHECK`] polls reads the clock and the abort words
/// (the heap's; the host's at the first check and every [`HOST_ABORT_POLLS`] polls; the
/// proxy's with [`BoundedWait::with_proxy_abort`]); past the timeout or once the rank is
/// aborting it writes the error record ([`report_give_up`]) and gives up. Built with
/// [`BoundedWait::new`] and the options below, run with [`BoundedWait::at_least`] (a `u64`
/// word reaching the expected value), [`BoundedWait::until_at_least`] or
/// [`BoundedWait::until`] (any condition). Everything is inlined, so the options, constants at
/// the call sites, cost nothing in the loop.
#[derive(Clone, Copy)]
pub struct BoundedWait<'c, P> {
    c: &'c CommCtx,
    what: Waiting<P>,
    timeout_ns: u64,
    sleep_ns: u32,
    proxy: bool,
}

impl<'c, P: Fn(&CommCtx) -> u32 + Copy> BoundedWait<'c, P> {
    /// A wait of `c`'s thread for `what`, bounded by the communicator's timeout
    /// (`c.timeout_ns`), spinning, and reading the rank's heap and host abort words.
    #[inline(always)]
    pub fn new(c: &'c CommCtx, what: Waiting<P>) -> Self {
        BoundedWait {
            c,
            what,
            timeout_ns: c.timeout_ns,
            sleep_ns: 0,
            proxy: false,
        }
    }

    /// Gives up after `timeout_ns` instead of the communicator's timeout (e.g. twice it for a
    /// wait that depends only on this rank's own progress, so the wait naming the stalled peer
    /// reports first).
    #[inline(always)]
    pub fn timeout_ns(mut self, timeout_ns: u64) -> Self {
        self.timeout_ns = timeout_ns;
        self
    }

    /// Sleeps about `ns` (0..=1_000_000) after each poll that found the condition false: for a
    /// waiter that shares its SM with tensor-core work and need not react within a microsecond.
    #[inline(always)]
    pub fn sleeping(mut self, ns: u32) -> Self {
        self.sleep_ns = ns;
        self
    }

    /// Also reads the proxy's abort word (in the host-mapped FIFO, `c.fifo`, nonzero) every
    /// [`HOST_ABORT_POLLS`] polls: for waits on what the proxy does. Once up, the rank's heap
    /// abort word is raised to [`abort_word::PROXY_FAILED`] (unless it is up already), so that
    /// the rank's other waits stop too.
    #[inline(always)]
    pub fn with_proxy_abort(mut self) -> Self {
        self.proxy = true;
        self
    }

    /// Waits until the `u64` at `word` (`ld.acquire.sys`: this GPU's memory, or a peer's over
    /// NVLink) reaches the expected value. The heap abort word's load is in flight beside the
    /// word's first: an aborted rank's waits give up at once, also where the word is there (a
    /// launch queued behind the abort stops at its first wait). False when the wait gave up
    /// (the record is written if it was the rank's first).
    ///
    /// # Safety
    ///
    /// The communicator contract (`crate::comm`) for the context; `word` an 8-byte aligned
    /// address of this GPU's memory or of a peer's heap.
    #[inline(always)]
    pub unsafe fn at_least(self, word: *const u64) -> bool {
        let expected = self.what.expected;
        let abort = self.abort_word();
        let up = unsafe { memory::ld_relaxed_u32(Scope::Gpu, abort) };
        let seen = unsafe { memory::ld_acquire_u64(Scope::Sys, word) };
        if up == 0 && seen >= expected {
            return true;
        }
        if up != 0 {
            unsafe { self.give_up(seen, 0) };
            return false;
        }
        unsafe {
            self.poll(abort, || {
                let seen = memory::ld_acquire_u64(Scope::Sys, word);
                if seen >= expected {
                    Ok(())
                } else {
                    Err(seen)
                }
            })
        }
        .is_some()
    }

    /// As [`Self::at_least`], the first poll without the abort word ([`Self::until`]): for a
    /// caller short of registers.
    ///
    /// # Safety
    ///
    /// As [`Self::at_least`].
    #[inline(always)]
    pub unsafe fn until_at_least(self, word: *const u64) -> bool {
        let expected = self.what.expected;
        unsafe {
            self.until(|| {
                let seen = memory::ld_acquire_u64(Scope::Sys, word);
                if seen >= expected {
                    Ok(())
                } else {
                    Err(seen)
                }
            })
        }
        .is_some()
    }

    /// Waits until `poll` answers `Ok` (what the wait got), `Err(seen)` (the value to record)
    /// meanwhile; the first poll reads no abort word (a hot path that finds its condition
    /// true costs `poll` alone). `None` when the wait gave up (the record is written if it
    /// was the rank's first).
    ///
    /// # Safety
    ///
    /// The communicator contract (`crate::comm`) for the context (with [`Self::with_proxy_abort`]:
    /// `c.fifo` the proxy FIFO of this node); `poll` is safe to call repeatedly.
    #[inline(always)]
    pub unsafe fn until<T>(self, mut poll: impl FnMut() -> Result<T, u64>) -> Option<T> {
        if let Ok(v) = poll() {
            return Some(v);
        }
        unsafe { self.poll(self.abort_word(), poll) }
    }

    /// The rank's heap abort word.
    #[inline(always)]
    fn abort_word(&self) -> *const u32 {
        (self.c.heap(self.c.rank) + ABORT_OFFSET) as *const u32
    }

    /// The loop: polls; every [`POLLS_PER_CHECK`] polls the clock and [`Self::aborting`].
    // `is_multiple_of` here changes the emitted PTX of the polling loop (checked with `cargo xtask ptx`).
    #[allow(clippy::manual_is_multiple_of)]
    #[inline(always)]
    unsafe fn poll<T>(self, abort: *const u32, mut poll: impl FnMut() -> Result<T, u64>) -> Option<T> {
        let start = time::globaltimer_ns();
        let mut polls = 0u32;
        loop {
            let seen = match poll() {
                Ok(v) => return Some(v),
                Err(seen) => seen,
            };
            if self.sleep_ns > 0 {
                time::nanosleep(self.sleep_ns);
            }
            polls += 1;
            if polls % POLLS_PER_CHECK == 0 {
                let aborting = unsafe { self.aborting(abort, polls) };
                let waited = time::globaltimer_ns().wrapping_sub(start);
                if aborting || waited > self.timeout_ns {
                    unsafe { self.give_up(seen, waited) };
                    return None;
                }
            }
        }
    }

    /// Whether the rank is aborting, at the clock check after `polls` polls (a multiple of
    /// [`POLLS_PER_CHECK`]): the heap's abort word `abort` (GPU memory) at every check; the
    /// host abort word at the first check and every [`HOST_ABORT_POLLS`] polls
    /// ([`host_abort_seen`]); with [`Self::with_proxy_abort`] the proxy's abort word every
    /// [`HOST_ABORT_POLLS`] polls (host memory too: many pollers reading across PCIe would slow
    /// the host's own traffic to this GPU).
    // `is_multiple_of` here changes the emitted PTX of the polling loop (checked with `cargo xtask ptx`).
    #[allow(clippy::manual_is_multiple_of)]
    #[inline(always)]
    unsafe fn aborting(&self, abort: *const u32, polls: u32) -> bool {
        let c = self.c;
        if unsafe { memory::ld_relaxed_u32(Scope::Gpu, abort) } != 0 {
            return true;
        }
        let host_check = polls % HOST_ABORT_POLLS == 0;
        if (polls == POLLS_PER_CHECK || host_check) && unsafe { host_abort_seen(c.desc_addr()) } {
            return true;
        }
        let fifo_abort = (c.fifo + fifo::offsets::ABORT as u64) as *const u32;
        if self.proxy && host_check && unsafe { memory::ld_relaxed_u32(Scope::Sys, fifo_abort) } != 0 {
            // The proxy failed (its own error record says why): stop this rank's other waits
            // too (a host's abort, if one came first, keeps its word).
            let _ = unsafe { memory::atom_acq_rel_cas_u32(Scope::Gpu, abort as *mut u32, 0, abort_word::PROXY_FAILED) };
            return true;
        }
        false
    }

    /// Writes the error record (if the rank's first) of this wait, having seen `seen` after
    /// `waited` ns.
    #[inline(always)]
    unsafe fn give_up(&self, seen: u64, waited: u64) {
        let w = &self.what;
        unsafe { report_give_up(self.c, w.code, (w.peer)(self.c), w.expected, seen, waited) };
    }
}

/// Reads the rank's host abort word (`CommDesc::host_abort`: host memory the CPU stores into,
/// `Communicator::abort`; one load across PCIe); when it is up, copies it into the heap's abort
/// word (unless that is up already), where every wait and every later launch of the rank sees
/// it at GPU-memory cost, and returns true.
///
/// # Safety
///
/// `desc` is the launch's `CommDesc` (the communicator contract, `crate::comm`); its
/// `host_abort` is 0 or the device address of the rank's mapped host abort word.
#[inline(always)]
pub unsafe fn host_abort_seen(desc: u64) -> bool {
    let d = desc as *const CommDesc;
    let host = unsafe { (&raw const (*d).host_abort).read_volatile() };
    if host == 0 {
        return false;
    }
    let word = unsafe { memory::ld_relaxed_u32(Scope::Sys, host as *const u32) };
    if word == 0 {
        return false;
    }
    unsafe {
        let rank = (&raw const (*d).rank).read_volatile();
        let heap = *(*d).heaps.as_ptr().add(rank as usize);
        // A word raised meanwhile (a timeout, or the same abort) keeps its value.
        let _ = memory::atom_acq_rel_cas_u32(Scope::Gpu, (heap + ABORT_OFFSET) as *mut u32, 0, word);
    }
    true
}

/// At the end of a launch, one thread: every [`mkernel_config::comm::HOST_ABORT_LAUNCHES`]
/// launches (by `epoch`), [`host_abort_seen`], so that an abort reaches the rank's later
/// launches also when none of its waits stalls long enough to read the host word.
///
/// # Safety
///
/// As [`host_abort_seen`].
#[inline(always)]
pub unsafe fn host_abort_at_launch_end(desc: u64, epoch: u64) {
    if epoch.is_multiple_of(mkernel_config::comm::HOST_ABORT_LAUNCHES) {
        let _ = unsafe { host_abort_seen(desc) };
    }
}

/// Waits until this rank's flag `(slot, src)` of this CTA reaches `target`. Returns false
/// (after writing the error record if it is the first to fail) on timeout or when the rank is
/// aborting.
///
/// # Safety
///
/// The communicator contract (`crate::comm`); `src < world`.
#[inline(always)]
pub unsafe fn wait_flag(c: &CommCtx, slot: FlagSlot, src: u32, target: u64) -> bool {
    unsafe { wait_flag_of_cta(c, slot, src, c.cta, target) }
}

/// As [`wait_flag`] for the flag of CTA `cta`.
///
/// # Safety
///
/// The communicator contract (`crate::comm`); `src < world` and `cta` a flag index that the source rank signals.
#[inline(always)]
pub unsafe fn wait_flag_of_cta(c: &CommCtx, slot: FlagSlot, src: u32, cta: u32, target: u64) -> bool {
    unsafe { wait_flag_of_cta_sleeping::<0>(c, slot, src, cta, target) }
}

/// As [`wait_flag_of_cta`], sleeping about `SLEEP_NS` between polls that found the flag short
/// (0: spin): for a waiter that shares its SM with tensor-core work and need not react within
/// a microsecond.
///
/// # Safety
///
/// As [`wait_flag_of_cta`].
#[inline(always)]
pub unsafe fn wait_flag_of_cta_sleeping<const SLEEP_NS: u32>(
    c: &CommCtx,
    slot: FlagSlot,
    src: u32,
    cta: u32,
    target: u64,
) -> bool {
    unsafe { wait_flag_of_cta_from::<SLEEP_NS>(c, slot, move |_| src, cta, target) }
}

/// As [`wait_flag_of_cta_sleeping`], the source derived from the context where it is used
/// (the flag's address, the error record): e.g. `|c| c.rank ^ 1`, the other rank of two,
/// which a caller short of registers need not keep beside the context across the wait.
/// A [`BoundedWait::at_least`] on the flag.
///
/// # Safety
///
/// As [`wait_flag_of_cta`], with `src(c) < world`.
#[inline(always)]
pub unsafe fn wait_flag_of_cta_from<const SLEEP_NS: u32>(
    c: &CommCtx,
    slot: FlagSlot,
    src: impl Fn(&CommCtx) -> u32 + Copy,
    cta: u32,
    target: u64,
) -> bool {
    let flag = c.flag_of_cta(c.rank, slot, src(c), cta);
    let what = Waiting {
        code: slot as u32,
        peer: move |c: &CommCtx| src(c) + (c.global_rank_now() - c.rank),
        expected: target,
    };
    unsafe { BoundedWait::new(c, what).sleeping(SLEEP_NS).at_least(flag) }
}

/// Threads `0..world` (except the own rank) each wait for one source's flag to reach this
/// epoch; then the whole CTA learns whether all arrived. Call from every thread of the CTA.
///
/// # Safety
///
/// The communicator contract (`crate::comm`); called by every thread of the CTA (it ends in a CTA barrier).
#[inline(always)]
pub unsafe fn wait_all_peers(c: &CommCtx, slot: FlagSlot) -> bool {
    unsafe { wait_all_peers_at(c, slot, c.epoch) }
}

/// As [`wait_all_peers`] for an explicit `target` (e.g. the staging credit, epoch - 2).
///
/// # Safety
///
/// As [`wait_all_peers`].
#[inline(always)]
pub unsafe fn wait_all_peers_at(c: &CommCtx, slot: FlagSlot, target: u64) -> bool {
    let t = ids::thread_idx();
    let failed = t < c.world && t != c.rank && !unsafe { wait_flag(c, slot, t, target) };
    !sync::sync_threads_or(failed)
}

/// The staging credit: every peer finished epoch `epoch - 2` in every staged CTA
/// (`0..STAGED_CTAS`), so the slots of this epoch's parity are free. Thread `t` waits for
/// peer `t / STAGED_CTAS`, CTA `t % STAGED_CTAS`. Call from every thread of the CTA.
///
/// # Safety
///
/// As [`wait_all_peers`]; the CTA has at least `world * STAGED_CTAS` threads.
#[inline(always)]
pub unsafe fn wait_staging_credit(c: &CommCtx) -> bool {
    let t = ids::thread_idx();
    let (peer, cta) = (t / STAGED_CTAS, t % STAGED_CTAS);
    let target = c.epoch.saturating_sub(2);
    let failed = peer < c.world && peer != c.rank && !unsafe { wait_flag_of_cta(c, FlagSlot::Done, peer, cta, target) };
    !sync::sync_threads_or(failed)
}

/// Threads `0..world` (except the own rank) each raise `slot` at one peer. Call from every
/// thread of the CTA after a barrier that follows the data.
///
/// # Safety
///
/// The communicator contract (`crate::comm`); called by every thread of the CTA (threads `0..world` signal) after a CTA
/// barrier that follows the data the flags publish.
#[inline(always)]
pub unsafe fn signal_all_peers(c: &CommCtx, slot: FlagSlot) {
    let t = ids::thread_idx();
    if t < c.world && t != c.rank {
        unsafe { c.signal(t, slot) };
    }
}

/// The record of a wait that gives up, with a raw wait code (flag slots, or
/// `mkernel_config::comm::wait_code`) and `src` a global rank; the record names this rank by its
/// global rank. It reads the rank's abort word: raised, the wait gave up because the rank is
/// aborting ([`ErrorCode::Aborted`], the word kept in the record); else it timed out
/// ([`ErrorCode::Timeout`]) and raises the abort word ([`abort_word::TIMED_OUT`]) so the rank's
/// other waits stop at once - after claiming the record, so a wait stopped by that word cannot
/// claim it first. The first record of the rank wins (compare-and-swap on `code`).
/// (The word is read here, not passed: one more value live at every wait's call site cost the
/// GEMM+ReduceScatter consumers spills.)
///
/// # Safety
///
/// The communicator contract (`crate::comm`) for the rank and heap of `c`; `c` may carry a placeholder epoch (the
/// record only names it).
pub(crate) unsafe fn report_give_up(c: &CommCtx, code_of_wait: u32, src: u32, target: u64, seen: u64, waited: u64) {
    let local = c.heap(c.rank);
    let rec = (local + ERROR_RECORD_OFFSET) as *mut ErrorRecord;
    let code = rec as *mut u32;
    let abort = (local + ABORT_OFFSET) as *mut u32;
    unsafe {
        let word = memory::ld_acquire_u32(Scope::Gpu, abort);
        if memory::atom_acq_rel_cas_u32(Scope::Gpu, code, 0, u32::MAX) == 0 {
            (*rec).rank = c.global_rank_now();
            (*rec).role = c.role as u32;
            (*rec).slot = code_of_wait;
            (*rec).peer = src;
            (*rec).cta = c.cta;
            (*rec).expected = target;
            (*rec).seen = seen;
            (*rec).waited_ns = waited;
            (*rec).abort_word = word;
            let what = if word != 0 {
                ErrorCode::Aborted
            } else {
                ErrorCode::Timeout
            };
            memory::st_release_u32(Scope::Gpu, code, what as u32);
        }
        if word == 0 {
            // Raised unless it went up meanwhile (a host's abort keeps its value).
            let _ = memory::atom_acq_rel_cas_u32(Scope::Gpu, abort, 0, abort_word::TIMED_OUT);
        }
    }
}

/// How long a fused kernel's wait on a shared-memory condition (a GEMM ring slot, a stager's
/// handshake) may stall: past every communication wait it can be behind (a relayed wait takes
/// twice the timeout), plus [`mbarrier::HUNG_NS`].
///
/// # Safety
///
/// `desc` is the address of the launch's `CommDesc` in global memory (the communicator contract, `crate::comm`).
#[inline(always)]
pub unsafe fn hung_ns(desc: u64) -> u64 {
    unsafe { (*(desc as *const CommDesc)).timeout_ns }
        .saturating_mul(4)
        .saturating_add(mbarrier::HUNG_NS)
}

/// The rank's abort word as loaded now (0: running; `mkernel_config::comm::abort_word`).
///
/// # Safety
///
/// `desc` is the address of the launch's `CommDesc`, whose own heap is mapped (the communicator contract,
/// `crate::comm`).
#[inline(always)]
pub unsafe fn abort_word_of(desc: u64) -> u32 {
    let d = unsafe { &*(desc as *const CommDesc) };
    let heap = unsafe { *d.heaps.as_ptr().add(d.rank as usize) };
    unsafe { memory::ld_relaxed_u32(Scope::Gpu, (heap + ABORT_OFFSET) as *const u32) }
}

/// As [`abort_word_of`], also reading the host abort word when the heap's is down
/// ([`host_abort_seen`]): for the rare stall checks of the shared-memory waits.
///
/// # Safety
///
/// As [`abort_word_of`].
#[inline(always)]
pub unsafe fn abort_word_or_host(desc: u64) -> u32 {
    let word = unsafe { abort_word_of(desc) };
    if word == 0 && unsafe { host_abort_seen(desc) } {
        unsafe { abort_word_of(desc) }
    } else {
        word
    }
}

/// `index` of [`local_stall`]: record the waiting thread's warpgroup.
pub const THIS_WARPGROUP: u32 = u32::MAX;

/// Stall callback (for [`mbarrier::wait_parity_or`], [`time::poll_until`]) of a wait on a
/// condition other threads of this CTA complete (wait `code` of `mkernel_config::comm::wait_code`,
/// `index`: the mbarrier, or [`THIS_WARPGROUP`]): gives up (true) once stalled past [`hung_ns`] - a Timeout
/// record naming `role`, `code` and `index`, the abort word raised - and, with `ON_ABORT`, as
/// soon as the rank's abort word is up (an Aborted record). Without `ON_ABORT` the wait keeps
/// waiting through an abort: for waits whose other side runs to the end after an abort (the
/// GEMM ring: a producer keeps filling, consumers keep freeing), where giving up early would
/// put the two sides' mbarrier phases out of step. Everything but the clock check is cold.
#[inline(always)]
pub fn local_stall<const ON_ABORT: bool>(desc: u64, role: Role, code: u32, index: u32) -> impl Fn(u64) -> bool + Copy {
    move |stalled| {
        let word = if ON_ABORT {
            unsafe { abort_word_or_host(desc) }
        } else {
            0
        };
        if word == 0 && stalled <= unsafe { hung_ns(desc) } {
            return false;
        }
        unsafe {
            let c = CommCtx::with_epoch(desc as *const CommDesc, ids::block_idx(), role, 0);
            let index = if index == THIS_WARPGROUP {
                ids::warpgroup_idx()
            } else {
                index
            };
            report_give_up(&c, code, index, 0, 0, stalled);
        }
        true
    }
}

/// As [`local_stall`] with `ON_ABORT`, recording nothing: for a role short of registers (the
/// 56-register stagers), whose give-up is recorded by the threads that then wait for
/// them (an inlined record cost the stagers spills).
#[inline(always)]
pub fn stall_or_abort(desc: u64) -> impl Fn(u64) -> bool + Copy {
    move |stalled| unsafe { abort_word_or_host(desc) != 0 || stalled > hung_ns(desc) }
}

/// Waits (bounded, [`local_stall`]) until the phase with `parity` of `bar` completed: false
/// when the wait gave up (the record is written). Waits through an abort (`ON_ABORT` false):
/// for an mbarrier that a TMA transfer or another role completes whatever happens.
///
/// # Safety
///
/// `bar` is the shared-memory address of an initialised mbarrier of this CTA, and `desc` the address of the launch's
/// `CommDesc` (the communicator contract, `crate::comm`).
#[inline(always)]
pub unsafe fn wait_mbarrier(bar: SmemAddr, parity: u32, desc: u64, role: Role, code: u32, index: u32) -> bool {
    unsafe { mbarrier::wait_parity_or(bar, parity, local_stall::<false>(desc, role, code, index)) }
}
