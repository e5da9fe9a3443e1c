//! A user abort across nodes: the host hands "this rank called abort()" to its proxy thread,
//! the proxy's transport carries it to every peer's proxy ([`Transport::send_abort`]), and a
//! receiving proxy hands "peer R aborted" back to its host ([`AbortLink::new`]'s sink), which
//! stores R into the abort words of its node's ranks.
//!
//! The host side never blocks on the proxy thread: [`AbortLink::request`] is one atomic store
//! that the proxy loop polls at every iteration; [`AbortLink::wait`] then waits (bounded) until
//! every peer acknowledged, the transport said it cannot, or the proxy stopped.
//!
//! [`Transport::send_abort`]: crate::Transport::send_abort
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where this rank's outgoing abort stands ([`AbortLink::state`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AbortState {
    /// Not requested.
    Idle,
    /// Requested; the proxy thread has not handed it to the transport yet.
    Requested,
    /// Sent to every peer; not every peer acknowledged yet.
    Sent,
    /// Every peer's proxy acknowledged: each stored it into its node's abort words.
    Delivered,
    /// The transport cannot carry aborts (the reason).
    Unsupported(String),
    /// The proxy stopped (failed, or the communicator is being dropped) before delivery.
    ProxyStopped,
}

const IDLE: u32 = 0;
const REQUESTED: u32 = 1;
const SENT: u32 = 2;
const DELIVERED: u32 = 3;
const UNSUPPORTED: u32 = 4;

/// The host's and the proxy thread's shared view of user aborts (one per proxy; put it in
/// [`ProxyConfig::abort`](crate::ProxyConfig::abort)).
pub struct AbortLink {
    state: AtomicU32,
    /// The proxy thread has exited.
    closed: AtomicBool,
    unsupported: Mutex<String>,
    on_peer_abort: Box<dyn Fn(usize) + Send + Sync>,
}

impl std::fmt::Debug for AbortLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortLink").field("state", &self.state()).finish()
    }
}

impl AbortLink {
    /// A link whose proxy calls `on_peer_abort(rank)` (on the proxy thread) when the proxy of
    /// `rank` reports that `rank` called abort(), before acknowledging it. Called once per
    /// aborting peer; it must not block (mkernel stores the rank into the host abort words of
    /// the node's ranks).
    pub fn new(on_peer_abort: impl Fn(usize) + Send + Sync + 'static) -> AbortLink {
        AbortLink {
            state: AtomicU32::new(IDLE),
            closed: AtomicBool::new(false),
            unsupported: Mutex::new(String::new()),
            on_peer_abort: Box::new(on_peer_abort),
        }
    }

    /// Asks the proxy to tell every peer that this rank aborted (from any thread; one atomic
    /// store, the proxy loop picks it up). Later calls do nothing: one abort per link.
    pub fn request(&self) {
        let _ = self
            .state
            .compare_exchange(IDLE, REQUESTED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Where the outgoing abort stands now.
    pub fn state(&self) -> AbortState {
        match self.state.load(Ordering::Acquire) {
            DELIVERED => AbortState::Delivered,
            UNSUPPORTED => AbortState::Unsupported(self.unsupported.lock().unwrap_or_else(|e| e.into_inner()).clone()),
            _ if self.closed.load(Ordering::Acquire) => AbortState::ProxyStopped,
            IDLE => AbortState::Idle,
            REQUESTED => AbortState::Requested,
            _ => AbortState::Sent,
        }
    }

    /// Waits until the outgoing abort is [`AbortState::Delivered`], unsupported, or the proxy
    /// stopped, or `timeout` passed; returns the state then (sleeps 50 us between looks).
    pub fn wait(&self, timeout: Duration) -> AbortState {
        let t0 = Instant::now();
        loop {
            let s = self.state();
            match s {
                AbortState::Requested | AbortState::Sent if t0.elapsed() < timeout => {
                    std::thread::sleep(Duration::from_micros(50))
                }
                _ => return s,
            }
        }
    }

    /// Whether the proxy thread has exited.
    pub fn proxy_stopped(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    // The proxy thread's side.

    /// The request, once: true if the host asked and the proxy has not taken it yet.
    pub(crate) fn take_request(&self) -> bool {
        self.state.load(Ordering::Acquire) == REQUESTED
            && self
                .state
                .compare_exchange(REQUESTED, SENT, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    pub(crate) fn delivered(&self) {
        let _ = self
            .state
            .compare_exchange(SENT, DELIVERED, Ordering::AcqRel, Ordering::Acquire);
    }

    pub(crate) fn unsupported(&self, why: String) {
        *self.unsupported.lock().unwrap_or_else(|e| e.into_inner()) = why;
        self.state.store(UNSUPPORTED, Ordering::Release);
    }

    pub(crate) fn peer_aborted(&self, rank: usize) {
        (self.on_peer_abort)(rank)
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn states_in_order() {
        let got = Arc::new(AtomicUsize::new(usize::MAX));
        let g = got.clone();
        let l = AbortLink::new(move |r| g.store(r, Ordering::Release));
        assert_eq!(l.state(), AbortState::Idle);
        assert!(!l.take_request());
        l.request();
        l.request();
        assert_eq!(l.state(), AbortState::Requested);
        assert!(l.take_request());
        assert!(!l.take_request());
        assert_eq!(l.wait(Duration::from_millis(1)), AbortState::Sent);
        l.delivered();
        assert_eq!(l.wait(Duration::from_secs(5)), AbortState::Delivered);
        l.peer_aborted(3);
        assert_eq!(got.load(Ordering::Acquire), 3);
        let u = AbortLink::new(|_| {});
        u.request();
        assert!(u.take_request());
        u.unsupported("no control path".into());
        assert_eq!(u.state(), AbortState::Unsupported("no control path".into()));
        let c = AbortLink::new(|_| {});
        c.request();
        c.close();
        assert_eq!(c.wait(Duration::from_secs(5)), AbortState::ProxyStopped);
    }
}
