//! The proxy thread: drain the FIFO, batch per destination, drive the transport, publish
//! `tail` and `done`, stop on QUIT, on abort, or when asked (drop).
use crate::abort::AbortLink;
use crate::batch::Batcher;
use crate::completion::CompletionTracker;
use crate::error::{ProxyError, TransportError};
use crate::fifo::FifoConsumer;
use crate::mem::FifoMemory;
use crate::protocol::MAX_BATCH;
use crate::transport::{Op, Transport};
use crate::validate::Checked;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the proxy does while polls find no work: spin, then yield, then sleep, by how long
/// it has been idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Idle time during which the loop only spins (`spin_loop` hint).
    pub spin_for: Duration,
    /// Further idle time during which it calls `yield_now` between polls.
    pub yield_for: Duration,
    /// After that, sleep this long between polls.
    pub sleep: Duration,
}

impl Backoff {
    /// Busy polling (lowest latency; give the proxy thread a core of its own): always spin.
    pub const fn busy() -> Backoff {
        Backoff {
            spin_for: Duration::MAX,
            yield_for: Duration::ZERO,
            sleep: Duration::ZERO,
        }
    }
    /// For shared cores (tests, emulated nodes on small hosts): spin 20 us, yield until 1 ms,
    /// then sleep 50 us between polls.
    pub const fn gentle() -> Backoff {
        Backoff {
            spin_for: Duration::from_micros(20),
            yield_for: Duration::from_micros(980),
            sleep: Duration::from_micros(50),
        }
    }
    fn idle(&self, idle_for: Duration) {
        if idle_for < self.spin_for {
            std::hint::spin_loop();
        } else if idle_for - self.spin_for < self.yield_for || self.sleep.is_zero() {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.sleep);
        }
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::busy()
    }
}

/// Proxy settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Commands per destination in one batch, 1..=[`MAX_BATCH`].
    pub max_batch: usize,
    /// Commands consumed per loop iteration before pending batches are posted.
    pub poll_window: usize,
    /// Idle behaviour.
    pub backoff: Backoff,
    /// Thread name (default `mkernel-proxy-<rank>`).
    pub thread_name: Option<String>,
    /// User aborts across nodes ([`AbortLink`]): the loop polls it every iteration, sends this
    /// rank's abort through [`Transport::send_abort`] once requested, and hands peers' aborts
    /// to it. `None`: the proxy carries no aborts.
    pub abort: Option<Arc<AbortLink>>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            max_batch: MAX_BATCH,
            poll_window: 64,
            backoff: Backoff::busy(),
            thread_name: None,
            abort: None,
        }
    }
}

/// Counters of one proxy run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Commands consumed (all opcodes).
    pub commands: u64,
    /// PUT commands.
    pub puts: u64,
    /// Flag stores (PUTs with a flag plus SIGNALs).
    pub signals: u64,
    /// Bytes put.
    pub bytes: u64,
    /// Batches posted.
    pub batches: u64,
    /// Largest batch posted, in operations.
    pub largest_batch: usize,
    /// `done` at exit.
    pub done: u64,
}

struct Loop<'a, M: FifoMemory, T: Transport> {
    consumer: FifoConsumer<M>,
    transport: T,
    batcher: Batcher,
    tracker: CompletionTracker,
    completed: Vec<u64>,
    stats: ProxyStats,
    config: &'a ProxyConfig,
}

impl<M: FifoMemory, T: Transport> Loop<'_, M, T> {
    fn transport_error(&self, seq: Option<u64>, source: TransportError) -> ProxyError {
        let e = ProxyError::Transport {
            rank: self.consumer.rank(),
            seq,
            source,
        };
        self.consumer.fail(&e);
        e
    }

    fn post(&mut self, dst: usize, ops: Vec<Op>) -> Result<(), ProxyError> {
        if ops.is_empty() {
            return Ok(());
        }
        self.stats.batches += 1;
        self.stats.largest_batch = self.stats.largest_batch.max(ops.len());
        let first = ops.first().map(Op::seq);
        self.transport
            .post(dst, &ops)
            .map_err(|e| self.transport_error(first, e))
    }

    fn reap(&mut self, flush: bool) -> Result<(), ProxyError> {
        let r = if flush {
            self.transport.flush(&mut self.completed)
        } else {
            self.transport.poll(&mut self.completed)
        };
        for seq in self.completed.drain(..) {
            self.tracker.complete(seq);
        }
        r.map_err(|e| self.transport_error(None, e))?;
        let done = self.tracker.watermark();
        if done != self.stats.done {
            self.consumer.fifo().done().store(done, Ordering::Release);
            self.stats.done = done;
        }
        Ok(())
    }

    fn take(&mut self, seq: u64, cmd: Checked) -> Result<bool, ProxyError> {
        self.stats.commands += 1;
        let mut ops = [Op::Signal {
            seq,
            flag_offset: 0,
            value: 0,
        }; 2];
        let (dst, n) = match cmd {
            Checked::Nop => (None, 0),
            Checked::Quit => {
                self.tracker.issue(seq, 0);
                return Ok(true);
            }
            Checked::Put {
                dst,
                src_offset,
                dst_offset,
                bytes,
                flag,
            } => {
                self.stats.puts += 1;
                self.stats.bytes += bytes;
                ops[0] = Op::Put {
                    seq,
                    src_offset,
                    dst_offset,
                    bytes,
                };
                match flag {
                    Some((flag_offset, value)) => {
                        self.stats.signals += 1;
                        ops[1] = Op::Signal {
                            seq,
                            flag_offset,
                            value,
                        };
                        (Some(dst), 2)
                    }
                    None => (Some(dst), 1),
                }
            }
            Checked::Signal {
                dst,
                flag_offset,
                value,
            } => {
                self.stats.signals += 1;
                ops[0] = Op::Signal {
                    seq,
                    flag_offset,
                    value,
                };
                (Some(dst), 1)
            }
        };
        self.tracker.issue(seq, n as u32);
        if let Some(dst) = dst {
            if let Some(full) = self.batcher.push(dst, &ops[..n]) {
                self.post(dst, full)?;
            }
        }
        Ok(false)
    }

    fn post_pending(&mut self) -> Result<(), ProxyError> {
        for (dst, ops) in self.batcher.drain() {
            self.post(dst, ops)?;
        }
        Ok(())
    }

    /// Sends this rank's abort once the host asked; hands peers' aborts to the host.
    fn aborts(&mut self, link: &AbortLink) -> Result<(), ProxyError> {
        if link.take_request() {
            match self.transport.send_abort() {
                Ok(()) => {}
                Err(TransportError::Unsupported(why)) => {
                    tracing::warn!("rank {}: the abort reaches this node only: {why}", self.consumer.rank());
                    link.unsupported(why);
                }
                Err(e) => return Err(self.transport_error(None, e)),
            }
        }
        let me = self.consumer.rank();
        let delivered = self
            .transport
            .poll_aborts(&mut |peer| {
                tracing::warn!("rank {me}: rank {peer} aborted (through its proxy)");
                link.peer_aborted(peer)
            })
            .map_err(|e| self.transport_error(None, e))?;
        if delivered {
            link.delivered();
        }
        Ok(())
    }

    fn run(&mut self, stop: &AtomicBool) -> Result<(), ProxyError> {
        let mut idle_since: Option<Instant> = None;
        let link = self.config.abort.clone();
        loop {
            if stop.load(Ordering::Acquire) {
                return Ok(());
            }
            if let Some(link) = &link {
                self.aborts(link)?;
            }
            if let Some(e) = self.consumer.aborted() {
                return Err(e);
            }
            let mut progressed = false;
            let mut quit = false;
            for _ in 0..self.config.poll_window.max(1) {
                match self.consumer.poll()? {
                    None => break,
                    Some((seq, cmd)) => {
                        progressed = true;
                        if self.take(seq, cmd)? {
                            quit = true;
                            break;
                        }
                    }
                }
            }
            self.post_pending()?;
            self.consumer.publish();
            let before = self.stats.done;
            self.reap(false)?;
            if quit {
                return Ok(());
            }
            if progressed || self.stats.done != before {
                idle_since = None;
            } else {
                let since = *idle_since.get_or_insert_with(Instant::now);
                self.config.backoff.idle(since.elapsed());
            }
        }
    }
}

/// Runs the proxy loop on the calling thread until QUIT (`Ok`), `stop` (`Ok`, after posting
/// and flushing what was consumed), or an error (the error record is written and `abort`
/// raised before this returns).
pub fn run_proxy<M: FifoMemory, T: Transport>(
    consumer: FifoConsumer<M>,
    transport: T,
    config: &ProxyConfig,
    stop: &AtomicBool,
) -> Result<ProxyStats, ProxyError> {
    /// Tells the abort link that the loop ended, however it ended.
    struct Closed<'a>(Option<&'a AbortLink>);
    impl Drop for Closed<'_> {
        fn drop(&mut self) {
            if let Some(l) = self.0 {
                l.close();
            }
        }
    }
    let _closed = Closed(config.abort.as_deref());
    if !(1..=MAX_BATCH).contains(&config.max_batch) {
        return Err(ProxyError::Config(format!(
            "max_batch {} not in 1..={MAX_BATCH}",
            config.max_batch
        )));
    }
    let first = consumer.next_seq();
    let world = consumer.world_size();
    let mut l = Loop {
        consumer,
        transport,
        batcher: Batcher::new(world, config.max_batch),
        tracker: CompletionTracker::new(first),
        completed: Vec::new(),
        stats: ProxyStats::default(),
        config,
    };
    l.stats.done = first;
    l.run(stop)?;
    l.post_pending()?;
    l.consumer.publish();
    l.reap(true)?;
    Ok(l.stats)
}

/// A proxy thread. Dropping it asks the thread to stop and waits for it.
pub struct Proxy {
    rank: u32,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Result<ProxyStats, ProxyError>>>,
}

impl Proxy {
    /// Starts the proxy loop of `consumer` over `transport` on a new thread.
    pub fn spawn<M: FifoMemory, T: Transport + 'static>(
        consumer: FifoConsumer<M>,
        transport: T,
        config: ProxyConfig,
    ) -> Result<Proxy, ProxyError> {
        let rank = consumer.rank();
        let stop = Arc::new(AtomicBool::new(false));
        let name = config
            .thread_name
            .clone()
            .unwrap_or_else(|| format!("mkernel-proxy-{rank}"));
        let s = stop.clone();
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let r = run_proxy(consumer, transport, &config, &s);
                match &r {
                    // The error record in the FIFO says the same to the device and the host.
                    Err(e) => tracing::error!("proxy of rank {rank} stopped: {e}"),
                    Ok(stats) => tracing::debug!("proxy of rank {rank} finished: {stats:?}"),
                }
                r
            })
            .map_err(ProxyError::Spawn)?;
        Ok(Proxy {
            rank,
            stop,
            handle: Some(handle),
        })
    }

    /// Asks the thread to stop (it posts and flushes what it already consumed).
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Whether the thread has exited.
    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Waits for the thread (without asking it to stop) and returns its result.
    pub fn join(mut self) -> Result<ProxyStats, ProxyError> {
        match self.handle.take() {
            Some(h) => h.join().unwrap_or(Err(ProxyError::Panicked(self.rank))),
            None => Err(ProxyError::Panicked(self.rank)),
        }
    }

    /// Asks the thread to stop, then waits for it.
    pub fn stop(self) -> Result<ProxyStats, ProxyError> {
        self.request_stop();
        self.join()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.request_stop();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
