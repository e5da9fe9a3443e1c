//! Stopping a communicator's kernels from any thread ([`AbortHandle`]), reading back why they
//! stopped ([`status`]), and making the communicator usable again ([`Communicator::reset`]).
//!
//! Every rank has two abort words: its **host abort word**, in a page of host memory shared by
//! the node's processes and mapped for its GPU ([`super::host_word`]), and the abort word in its
//! heap's control area (`ABORT_OFFSET`, GPU memory). An abort stores
//! `abort_word::by_host(global rank)` with a plain CPU atomic into the host word of this rank and
//! of every other local rank: no stream, no GPU queue, so it lands at once also while every
//! engine of the GPU is busy or stalled (ranks sharing a GPU through MPS). The kernels read the
//! host word at their polling waits' first clock check and every `HOST_ABORT_POLLS` polls, and
//! one thread every `HOST_ABORT_LAUNCHES` launches at a launch's end; whoever sees it up copies
//! it into the heap word, which every wait reads at every clock check and at its first poll
//! (docs/protocol.md, "Abort and reset"). On emulated nodes, the ranks of the other nodes get
//! the heap word written through the wire's mappings, with `cuStreamWriteValue32` on a stream of
//! its own (`CU_STREAM_NON_BLOCKING`).
use super::host_word::{RegisteredPage, SharedPage};
use super::Communicator;
use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext, CudaStream};
use mkernel_bootstrap::Bootstrap;
use mkernel_config::comm::{
    abort_word, ErrorCode, ErrorRecord, FlagSlot, Role, ABORT_OFFSET, EPOCH_COUNTERS_OFFSET, ERROR_RECORD_OFFSET,
    FLAG_SLOTS, FUSED_EPOCH_OFFSET, HEAP_ZEROED_BYTES, MAX_COMM_CTAS, MAX_LOCAL_RANKS,
};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long [`AbortHandle::abort`] waits for its writes into other nodes' heaps (emulated
/// nodes) to land before it reports [`Error::AbortUndelivered`].
pub const ABORT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// Aborts a communicator's running and later operations, from any thread, also while a kernel
/// runs ([`Communicator::abort_handle`]). Cheap to clone; `Send + Sync`; it does not borrow the
/// communicator (a watchdog thread may hold it while plans borrow the communicator). Once the
/// communicator is dropped, [`AbortHandle::abort`] does nothing.
#[derive(Clone)]
pub struct AbortHandle {
    inner: Arc<Aborter>,
}

/// The host abort words of this node's ranks: this rank's (registered for its GPU) and the
/// other local ranks' (mapped here). Made by [`HostWords::exchange`], collective over the local
/// ranks.
pub(crate) struct HostWords {
    own: RegisteredPage,
    peers: Vec<SharedPage>,
}

impl HostWords {
    /// Creates this rank's page, passes its descriptor to every local rank and maps theirs
    /// (collective: every local rank calls it at the same point of `Communicator::new`).
    pub(crate) fn exchange(ctx: &Arc<CudaContext>, boot: &mut Bootstrap, timeout: Duration) -> Result<HostWords> {
        let (page, fd) = SharedPage::create()?;
        let fds = boot.exchange_fds(&[fd.as_fd()], timeout)?;
        let local_rank = boot.info().local_rank();
        let mut peers = Vec::with_capacity(fds.len());
        for (peer, peer_fds) in fds.into_iter().enumerate() {
            if peer == local_rank {
                continue;
            }
            let fd = peer_fds.into_iter().next().ok_or_else(|| Error::Shape {
                op: "communicator",
                reason: format!("local rank {peer} sent no host abort word"),
            })?;
            peers.push(SharedPage::map(fd.as_fd())?);
        }
        Ok(HostWords {
            own: RegisteredPage::new(ctx, page)?,
            peers,
        })
    }

    /// The device address of this rank's word (`CommDesc::host_abort`).
    pub(crate) fn device_addr(&self) -> u64 {
        self.own.device_addr()
    }

    fn own(&self) -> &AtomicU32 {
        self.own.word()
    }
}

pub(crate) struct Aborter {
    ctx: Arc<CudaContext>,
    host: HostWords,
    /// A `CU_STREAM_NON_BLOCKING` stream of the writes into other nodes' heaps alone (none on
    /// one node).
    stream: Option<Arc<CudaStream>>,
    /// Device addresses (as the wire maps them here) of the heap abort words of the ranks on
    /// other nodes (emulated nodes only).
    remote: Vec<u64>,
    /// `abort_word::by_host(global rank)`.
    value: u32,
    /// False once the communicator is being dropped: the remote words' mappings are about to
    /// go away. Held across the writes, so a drop waits for an abort in progress.
    alive: Mutex<bool>,
    /// Resets so far (names the store keys of the next one).
    resets: AtomicU32,
    /// Timeout of the reset's store barriers (`CommConfig::bootstrap_timeout`).
    reset_timeout: Duration,
}

impl Aborter {
    /// `remote_bases`: heap bases (as mapped in this process) of the ranks on other nodes the
    /// abort reaches.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        host: HostWords,
        remote_bases: &[u64],
        global_rank: u32,
        reset_timeout: Duration,
    ) -> Result<Arc<Aborter>> {
        Ok(Arc::new(Aborter {
            ctx: ctx.clone(),
            host,
            // cudarc's new_stream creates CU_STREAM_NON_BLOCKING streams.
            stream: if remote_bases.is_empty() {
                None
            } else {
                Some(ctx.new_stream()?)
            },
            remote: remote_bases.iter().map(|b| b + ABORT_OFFSET).collect(),
            value: abort_word::by_host(global_rank),
            alive: Mutex::new(true),
            resets: AtomicU32::new(0),
            reset_timeout,
        }))
    }

    /// Called first when the communicator drops: later aborts do nothing; one in progress
    /// finishes first.
    pub(crate) fn close(&self) {
        let mut alive = self.alive.lock().unwrap_or_else(|e| e.into_inner());
        *alive = false;
    }

    /// This rank's host abort word as it is now.
    pub(crate) fn host_word(&self) -> u32 {
        self.host.own().load(Ordering::Acquire)
    }

    fn abort(&self) -> Result<()> {
        let alive = self.alive.lock().unwrap_or_else(|e| e.into_inner());
        if !*alive {
            return Ok(());
        }
        // The node's ranks, this one first: plain stores (a first abort keeps its value).
        for w in std::iter::once(self.host.own()).chain(self.host.peers.iter().map(SharedPage::word)) {
            let _ = w.compare_exchange(0, self.value, Ordering::AcqRel, Ordering::Acquire);
        }
        let Some(stream) = &self.stream else {
            return Ok(());
        };
        // Other nodes (emulated): the wire's mappings of their heaps. Any thread: the context
        // is made current here.
        self.ctx.bind_to_thread()?;
        let stream = stream.cu_stream();
        for &w in &self.remote {
            // SAFETY: `w` is the abort word (4 bytes, aligned) of a heap mapped in this process
            // while `alive` holds (the communicator's drop waits for this lock).
            let r = unsafe {
                sys::cuStreamWriteValue32_v2(
                    stream,
                    w,
                    self.value,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                // Stream memory operations unsupported here: a copy engine write instead (a
                // pageable source: the driver stages it before returning).
                // SAFETY: as above.
                unsafe { cudarc::driver::result::memcpy_htod_async(w, &[self.value], stream)? };
            }
        }
        // Bounded: the writes depend on nothing else (a stream of their own).
        let start = Instant::now();
        loop {
            // SAFETY: a stream of this context.
            match unsafe { sys::cuStreamQuery(stream) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => e.result()?,
            }
            if start.elapsed() > ABORT_DELIVERY_TIMEOUT {
                return Err(Error::AbortUndelivered {
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl AbortHandle {
    pub(crate) fn new(inner: Arc<Aborter>) -> AbortHandle {
        AbortHandle { inner }
    }

    /// Raises the host abort word of this rank and of every other local rank (plain CPU
    /// stores, landed when it returns) and, on emulated nodes, the heap abort word of every
    /// rank of the other nodes (returns once those writes landed, else
    /// [`Error::AbortUndelivered`] after 5 s). Every device wait of those ranks then gives up
    /// within about `HOST_ABORT_POLLS` polls (its CTA exits; a fused kernel runs out its GEMM
    /// ring without computing) and writes an `Aborted` error record; every later launch of
    /// theirs gives up at its first wait, until [`Communicator::reset`].
    /// [`Communicator::check`] then returns [`Error::Aborted`] naming this rank.
    pub fn abort(&self) -> Result<()> {
        self.inner.abort()
    }
}

/// The rank's status as its heap and host abort word hold it (call after the stream's work
/// finished): the error record, else the heap's abort word, else the host word (`host`).
pub(crate) fn status(local_base: u64, global_rank: u32, host: u32) -> Result<()> {
    // The record and the abort word that follows it, in one read.
    let mut raw = [0u8; (ABORT_OFFSET - ERROR_RECORD_OFFSET) as usize + 4];
    // SAFETY: reads this rank's own control area into a byte buffer of its size.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut raw, local_base + ERROR_RECORD_OFFSET)? };
    // SAFETY: ErrorRecord is repr(C) plain data, no larger than the bytes before the word.
    let rec: ErrorRecord = unsafe { std::ptr::read_unaligned(raw.as_ptr() as *const ErrorRecord) };
    let word = u32::from_ne_bytes(raw[raw.len() - 4..].try_into().expect("4 bytes"));
    decode(&rec, if word != 0 { word } else { host }, global_rank)
}

/// [`status`] from the record and the abort word as read (the heap's, else the host's).
fn decode(rec: &ErrorRecord, word: u32, global_rank: u32) -> Result<()> {
    let by_rank = |w: u32| abort_word::host_rank(w).unwrap_or(global_rank);
    match rec.code {
        0 if word == 0 => Ok(()),
        // Aborted, but no wait saw it (the kernels had finished, or stopped at a barrier that
        // reads the word): the results of the launches since are not to be trusted either.
        0 => Err(Error::Aborted {
            rank: global_rank,
            by_rank: by_rank(word),
            during: None,
        }),
        c if c == ErrorCode::Timeout as u32 => Err(Error::CommTimeout {
            rank: rec.rank,
            role: Role::name(rec.role),
            flag: super::wait_name(rec.slot),
            peer: rec.peer,
            cta: rec.cta,
            expected: rec.expected,
            seen: rec.seen,
            waited_ms: rec.waited_ns / 1_000_000,
        }),
        _ => Err(Error::Aborted {
            rank: rec.rank,
            by_rank: by_rank(rec.abort_word),
            during: Some(format!(
                "{} CTA {} waited for rank {}'s {}",
                Role::name(rec.role),
                rec.cta,
                rec.peer,
                super::wait_name(rec.slot)
            )),
        }),
    }
}

/// Whether flag slot `s` holds epochs (else tile counters, zero at a launch's start).
fn holds_epochs(s: FlagSlot) -> bool {
    match s {
        FlagSlot::Ready | FlagSlot::Done | FlagSlot::Staged | FlagSlot::Tile0 | FlagSlot::FusedReady => true,
        FlagSlot::StreamK => true,
        FlagSlot::Tile1 | FlagSlot::Tile2 | FlagSlot::NodeSum | FlagSlot::Outbox => false,
        // Ring attention's step values follow its own launch epoch (`RING_EPOCH_OFFSET`), which
        // the image zeroes with them: the next ring launch starts as on a fresh heap.
        FlagSlot::RingData | FlagSlot::RingFree => false,
    }
}

/// The control and LL areas (`HEAP_ZEROED_BYTES`) after a reset to epoch `e`: every epoch flag
/// and every epoch counter at `e` (the staging credit of the next two launches, which needs
/// `Done` at two epochs back, holds at once; every other wait of epoch `e + 1` needs a flag of
/// that launch), tile counters, error record, abort word, inter-node flags and LL words zero.
fn reset_image(e: u64) -> Vec<u8> {
    let mut image = vec![0u8; HEAP_ZEROED_BYTES as usize];
    let mut put = |off: u64, v: u64| image[off as usize..off as usize + 8].copy_from_slice(&v.to_ne_bytes());
    for slot in (0..FLAG_SLOTS)
        .filter_map(FlagSlot::from_u32)
        .filter(|s| holds_epochs(*s))
    {
        for src in 0..MAX_LOCAL_RANKS {
            for cta in 0..MAX_COMM_CTAS {
                put(mkernel_config::comm::flag_offset(slot, src, cta), e);
            }
        }
    }
    for cta in 0..MAX_COMM_CTAS as u64 {
        put(EPOCH_COUNTERS_OFFSET + 8 * cta, e);
    }
    put(FUSED_EPOCH_OFFSET, e);
    image
}

impl Communicator {
    /// A handle that aborts this communicator from any thread ([`AbortHandle::abort`]).
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle::new(self.aborter.clone())
    }

    /// Raises the abort word of this rank and of every peer it reaches: see
    /// [`AbortHandle::abort`] (the same, through a borrow of the communicator).
    pub fn abort(&self) -> Result<()> {
        self.aborter.abort()
    }

    /// Makes the communicator usable again after an abort or a timeout. Collective: every
    /// local rank calls it, after its streams' work on this communicator has ended (it waits
    /// for the whole context), and no abort may be in progress; it holds the launch lock (no
    /// launch of this process interleaves), and plans made before stay valid. It waits until every rank's
    /// kernels ended (store barrier), then puts every rank's epochs in step: all per-CTA epoch
    /// counters, the fused launch epoch and every epoch flag at `e` = (the largest epoch any
    /// rank reached) + 1, tile counters, error record and heap abort word at zero, LL words
    /// cleared ([`reset_image`]), and its host abort word at zero; a second barrier ends it. Jobs across nodes are refused
    /// ([`Error::Unsupported`]): an aborted kernel may have claimed a proxy FIFO slot it never
    /// filled, which the proxy waits for forever - across nodes an aborted communicator is
    /// dead: drop it and build a new one.
    pub fn reset(&self) -> Result<()> {
        if self.wire.is_some() {
            return Err(Error::Unsupported(
                "reset across nodes: an aborted kernel may leave a claimed but unwritten proxy FIFO slot; drop the communicator and build a new one".into(),
            ));
        }
        let _launches = self.order.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let timeout = self.aborter.reset_timeout;
        let n = self.aborter.resets.fetch_add(1, Ordering::Relaxed);
        let ctx = self.device.context();
        ctx.bind_to_thread()?;
        ctx.synchronize()?;
        let store = self.boot.store();
        // Nobody's kernels run any more: nothing writes into any heap.
        store.barrier(&format!("mkernel/communicator/reset/{n}/quiet"), timeout)?;
        let base = self.heap.local_base();
        let mut counters = vec![0u64; MAX_COMM_CTAS as usize];
        let mut fused = [0u64; 1];
        // SAFETY: reads this rank's own control area.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_sync(&mut counters, base + EPOCH_COUNTERS_OFFSET)?;
            cudarc::driver::result::memcpy_dtoh_sync(&mut fused, base + FUSED_EPOCH_OFFSET)?;
        }
        let mine = counters.iter().copied().chain(fused).max().unwrap_or(0);
        let all = store.all_gather(
            &format!("mkernel/communicator/reset/{n}/epochs"),
            &mine.to_le_bytes(),
            timeout,
        )?;
        let mut top = mine;
        for v in &all {
            let bytes: [u8; 8] = v.as_slice().try_into().map_err(|_| Error::Shape {
                op: "reset",
                reason: format!("a rank sent {} bytes for its epoch", v.len()),
            })?;
            top = top.max(u64::from_le_bytes(bytes));
        }
        // (A CTA that stopped mid-launch may have raised flags of epoch counter + 1.)
        let image = reset_image(top + 1);
        // SAFETY: the first HEAP_ZEROED_BYTES of this rank's heap are its own and mapped; no
        // kernel of any rank runs.
        unsafe { cudarc::driver::result::memcpy_htod_sync(base, &image)? };
        // Each rank clears its own host word (no kernel reads it, no abort is in progress).
        self.aborter.host.own().store(0, Ordering::Release);
        store.barrier(&format!("mkernel/communicator/reset/{n}/done"), timeout)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mkernel_config::comm::{flag_offset, ABORT_OFFSET};

    fn at(image: &[u8], off: u64) -> u64 {
        u64::from_ne_bytes(image[off as usize..off as usize + 8].try_into().unwrap())
    }

    #[test]
    fn reset_image_puts_epochs_in_step_and_clears_the_rest() {
        let img = reset_image(41);
        assert_eq!(at(&img, flag_offset(FlagSlot::Done, 7, 255)), 41);
        assert_eq!(at(&img, flag_offset(FlagSlot::Ready, 0, 0)), 41);
        assert_eq!(at(&img, flag_offset(FlagSlot::StreamK, 1, 3)), 41);
        assert_eq!(at(&img, flag_offset(FlagSlot::Tile1, 1, 3)), 0);
        assert_eq!(at(&img, flag_offset(FlagSlot::Outbox, 7, 255)), 0);
        assert_eq!(at(&img, EPOCH_COUNTERS_OFFSET + 8 * 255), 41);
        assert_eq!(at(&img, FUSED_EPOCH_OFFSET), 41);
        assert_eq!(at(&img, ERROR_RECORD_OFFSET), 0);
        assert_eq!(at(&img, ABORT_OFFSET), 0);
        assert!(img[FUSED_EPOCH_OFFSET as usize + 8..].iter().all(|b| *b == 0));
    }

    #[test]
    fn status_names_the_aborting_rank_or_the_timeout() {
        assert!(decode(&ErrorRecord::default(), 0, 3).is_ok());
        // Aborted, no wait saw it.
        match decode(&ErrorRecord::default(), abort_word::by_host(5), 3) {
            Err(Error::Aborted {
                rank: 3,
                by_rank: 5,
                during: None,
            }) => {}
            other => panic!("{other:?}"),
        }
        // A wait saw it.
        let rec = ErrorRecord {
            code: ErrorCode::Aborted as u32,
            rank: 3,
            role: Role::IntraComm as u32,
            slot: FlagSlot::Ready as u32,
            peer: 4,
            cta: 2,
            abort_word: abort_word::by_host(5),
            ..Default::default()
        };
        let err = decode(&rec, abort_word::by_host(5), 3).unwrap_err();
        assert_eq!(
            err.to_string(),
            "rank 3: aborted by rank 5 (intra-node comm CTA 2 waited for rank 4's Ready flag (epoch))"
        );
        // A timeout's record wins over the word it raised.
        let rec = ErrorRecord {
            code: ErrorCode::Timeout as u32,
            rank: 3,
            slot: FlagSlot::Done as u32,
            peer: 1,
            waited_ns: 2_000_000_000,
            ..Default::default()
        };
        assert!(matches!(
            decode(&rec, abort_word::TIMED_OUT, 3),
            Err(Error::CommTimeout {
                peer: 1,
                waited_ms: 2000,
                ..
            })
        ));
    }

    #[test]
    fn the_handle_goes_to_other_threads() {
        fn send_sync<T: Send + Sync + 'static>() {}
        send_sync::<AbortHandle>();
    }

    #[test]
    fn abort_words_name_the_rank() {
        assert_eq!(abort_word::host_rank(abort_word::by_host(13)), Some(13));
        assert_eq!(abort_word::host_rank(abort_word::TIMED_OUT), None);
        assert_eq!(abort_word::host_rank(abort_word::PROXY_FAILED), None);
    }
}
