//! What the store holds and how its blocking operations wait: keys, collectives in progress,
//! and which ranks are connected. Independent of sockets; the server's connection threads
//! call in here.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::Refusal;
use crate::store::protocol::{GatherKind, Msg};

/// The store's state, shared by its connection threads.
pub(crate) struct Shared {
    world_size: usize,
    state: Mutex<State>,
    /// Signalled on every change; waiters re-check their condition.
    changed: Condvar,
}

#[derive(Default)]
struct State {
    kv: HashMap<String, Vec<u8>>,
    gathers: HashMap<(GatherKind, String), Gather>,
    /// Ranks with an open connection.
    connected: BTreeSet<usize>,
    /// Ranks that completed the handshake at some point.
    ever_connected: BTreeSet<usize>,
    closing: bool,
}

/// One named barrier or all-gather. Reusable: each completion starts a new generation.
#[derive(Default)]
struct Gather {
    generation: u64,
    /// Contributions to the current generation, by rank.
    arrived: BTreeMap<usize, Vec<u8>>,
    /// The last completed generation's result, until every rank has taken it.
    completed: Option<Completed>,
}

struct Completed {
    generation: u64,
    all: Arc<Vec<Vec<u8>>>,
    readers_left: usize,
}

impl Shared {
    /// Empty state for a job of `world_size` ranks.
    pub fn new(world_size: usize) -> Self {
        Shared {
            world_size,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        }
    }

    /// The job's world size.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Takes the lock. A panic elsewhere cannot leave the state half-updated (no code panics
    /// while holding it), so a poisoned lock is still usable.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a change until `deadline` (`None`: forever).
    fn wait<'a>(&self, guard: MutexGuard<'a, State>, deadline: Option<Instant>) -> MutexGuard<'a, State> {
        match deadline {
            None => self.changed.wait(guard).unwrap_or_else(PoisonError::into_inner),
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                self.changed
                    .wait_timeout(guard, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
        }
    }

    /// Records that `rank` connected; refuses a rank that already is.
    pub fn register(&self, rank: usize) -> Result<(), Refusal> {
        let mut st = self.lock();
        if !st.connected.insert(rank) {
            return Err(Refusal::DuplicateRank { rank });
        }
        st.ever_connected.insert(rank);
        drop(st);
        self.changed.notify_all();
        Ok(())
    }

    /// Records that `rank`'s connection closed; operations waiting for it fail.
    pub fn unregister(&self, rank: usize) {
        self.lock().connected.remove(&rank);
        self.changed.notify_all();
    }

    /// Makes every waiting operation that cannot complete fail ("shutting down").
    pub fn close(&self) {
        self.lock().closing = true;
        self.changed.notify_all();
    }

    /// Sets `key` and wakes its getters.
    pub fn set(&self, key: String, value: Vec<u8>) -> Msg {
        self.lock().kv.insert(key, value);
        self.changed.notify_all();
        Msg::Done
    }

    /// `key`'s value once set: [`Msg::Value`], or [`Msg::TimedOut`] after `timeout`.
    pub fn get(&self, key: &str, timeout: Duration) -> Msg {
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.lock();
        loop {
            if let Some(v) = st.kv.get(key) {
                return Msg::Value(v.clone());
            }
            if st.closing {
                return shutting_down();
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Msg::TimedOut {
                    missing: vec![],
                    never_connected: vec![],
                };
            }
            st = self.wait(st, deadline);
        }
    }

    /// `rank` joins collective `(kind, name)` with `data` and waits for every rank:
    /// [`Msg::Done`] (barrier) or [`Msg::Gathered`] (all-gather, indexed by rank); or
    /// [`Msg::TimedOut`] naming the ranks that did not arrive, [`Msg::RanksLeft`] when one of
    /// them disconnected, [`Msg::Failed`] when the store shuts down.
    pub fn gather(&self, rank: usize, kind: GatherKind, name: String, data: Vec<u8>, timeout: Duration) -> Msg {
        let deadline = Instant::now().checked_add(timeout);
        let world = self.world_size;
        let key = (kind, name);
        let mut st = self.lock();
        let g = st.gathers.entry(key.clone()).or_default();
        let my_gen = g.generation;
        // A rank that arrives again in the same round (a retry after a timeout) rejoins it.
        g.arrived.insert(rank, data);
        if g.arrived.len() == world {
            let all: Vec<Vec<u8>> = std::mem::take(&mut g.arrived).into_values().collect();
            g.completed = Some(Completed {
                generation: my_gen,
                all: Arc::new(all),
                readers_left: world,
            });
            g.generation += 1;
            self.changed.notify_all();
        }
        loop {
            let State {
                gathers,
                connected,
                ever_connected,
                closing,
                ..
            } = &mut *st;
            let Some(g) = gathers.get_mut(&key) else {
                return Msg::Failed(format!("{} '{}' vanished from the store", kind.as_str(), key.1));
            };
            if g.generation > my_gen {
                return take_result(g, my_gen, kind);
            }
            let missing: Vec<u32> = (0..world)
                .filter(|r| !g.arrived.contains_key(r))
                .map(|r| r as u32)
                .collect();
            let left: Vec<u32> = missing
                .iter()
                .copied()
                .filter(|&r| ever_connected.contains(&(r as usize)) && !connected.contains(&(r as usize)))
                .collect();
            // A rank that gives up stays counted as arrived, so that every rank's error names
            // the ranks that never came rather than each other.
            if *closing {
                return shutting_down();
            }
            if !left.is_empty() {
                return Msg::RanksLeft(left);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let never_connected = missing
                    .iter()
                    .copied()
                    .filter(|&r| !ever_connected.contains(&(r as usize)))
                    .collect();
                return Msg::TimedOut {
                    missing,
                    never_connected,
                };
            }
            st = self.wait(st, deadline);
        }
    }
}

/// The result of completed generation `generation` for one reader; frees it after the last.
fn take_result(g: &mut Gather, generation: u64, kind: GatherKind) -> Msg {
    let Some(done) = g.completed.as_mut().filter(|c| c.generation == generation) else {
        return Msg::Failed(format!(
            "the result of {} generation {generation} is gone",
            kind.as_str()
        ));
    };
    done.readers_left -= 1;
    let all = done.all.clone();
    if done.readers_left == 0 {
        g.completed = None;
    }
    match kind {
        GatherKind::Barrier => Msg::Done,
        GatherKind::AllGather => Msg::Gathered(all.as_ref().clone()),
    }
}

fn shutting_down() -> Msg {
    Msg::Failed("the store is shutting down (rank 0 dropped its Store)".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn all_gather_completes_and_is_reusable() {
        let s = Arc::new(Shared::new(3));
        for round in 0..3u8 {
            let threads: Vec<_> = (0..3)
                .map(|r| {
                    let s = s.clone();
                    thread::spawn(move || s.gather(r, GatherKind::AllGather, "x".into(), vec![r as u8, round], LONG))
                })
                .collect();
            for t in threads {
                assert_eq!(
                    t.join().unwrap(),
                    Msg::Gathered(vec![vec![0, round], vec![1, round], vec![2, round]])
                );
            }
        }
        // Every reader took the result, so nothing is kept.
        assert!(s.lock().gathers.values().all(|g| g.completed.is_none()));
    }

    #[test]
    fn timeout_names_missing_and_never_connected_ranks() {
        let s = Arc::new(Shared::new(3));
        s.register(0).unwrap();
        s.register(1).unwrap();
        let m = s.gather(0, GatherKind::Barrier, "b".into(), vec![], Duration::from_millis(20));
        assert_eq!(
            m,
            Msg::TimedOut {
                missing: vec![1, 2],
                never_connected: vec![2]
            }
        );
        // Rank 1 gives up too: it still counts as arrived, so it names only rank 2.
        let m = s.gather(1, GatherKind::Barrier, "b".into(), vec![], Duration::from_millis(20));
        assert_eq!(
            m,
            Msg::TimedOut {
                missing: vec![2],
                never_connected: vec![2]
            }
        );
        // A retry rejoins the same round, which completes when rank 2 comes.
        let retry = {
            let s = s.clone();
            thread::spawn(move || s.gather(0, GatherKind::Barrier, "b".into(), vec![], LONG))
        };
        thread::sleep(Duration::from_millis(10));
        assert_eq!(s.gather(2, GatherKind::Barrier, "b".into(), vec![], LONG), Msg::Done);
        assert_eq!(retry.join().unwrap(), Msg::Done);
    }

    #[test]
    fn a_departed_rank_fails_the_wait_early() {
        let s = Arc::new(Shared::new(2));
        s.register(0).unwrap();
        s.register(1).unwrap();
        assert_eq!(s.register(1), Err(Refusal::DuplicateRank { rank: 1 }));
        let waiter = {
            let s = s.clone();
            thread::spawn(move || s.gather(0, GatherKind::Barrier, "b".into(), vec![], LONG))
        };
        thread::sleep(Duration::from_millis(20));
        s.unregister(1);
        assert_eq!(waiter.join().unwrap(), Msg::RanksLeft(vec![1]));
    }

    #[test]
    fn get_waits_for_set() {
        let s = Arc::new(Shared::new(1));
        let getter = {
            let s = s.clone();
            thread::spawn(move || s.get("k", LONG))
        };
        thread::sleep(Duration::from_millis(10));
        s.set("k".into(), b"v".to_vec());
        assert_eq!(getter.join().unwrap(), Msg::Value(b"v".to_vec()));
        assert_eq!(
            s.get("nope", Duration::from_millis(5)),
            Msg::TimedOut {
                missing: vec![],
                never_connected: vec![]
            }
        );
    }
}
