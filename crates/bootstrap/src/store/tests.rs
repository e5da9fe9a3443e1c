//! The store end to end: ranks are threads on 127.0.0.1.
use std::io::Write;
use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use super::*;
use crate::error::Refusal;

const T: Duration = Duration::from_secs(10);

fn key() -> JobKey {
    JobKey::new("the right key, 16+ bytes").unwrap()
}

/// A server for `world` ranks on a free port, and its address.
fn server(world: usize) -> (StoreServer, String) {
    let s = StoreServer::start("127.0.0.1:0", world, key()).unwrap();
    let addr = s.local_addr().to_string();
    (s, addr)
}

/// Runs `f(store)` for ranks 1..world on threads and for rank 0 (hosting) on this thread;
/// returns every rank's result, indexed by rank.
fn run_ranks<R: Send + 'static>(world: usize, f: impl Fn(&Store) -> R + Send + Sync + Clone + 'static) -> Vec<R> {
    let (srv, addr) = server(world);
    let threads: Vec<_> = (1..world)
        .map(|r| {
            let (addr, f) = (addr.clone(), f.clone());
            thread::spawn(move || f(&Store::connect(&addr, r, world, &key(), T).unwrap()))
        })
        .collect();
    let root = Store::host(srv, T).unwrap();
    let mut results = vec![f(&root)];
    results.extend(threads.into_iter().map(|t| t.join().unwrap()));
    results
}

#[test]
fn set_get_barrier_and_all_gather_with_four_ranks() {
    let results = run_ranks(4, |s| {
        let r = s.rank();
        s.set(&format!("addr/{r}"), format!("host{r}").as_bytes()).unwrap();
        s.barrier("init", T).unwrap();
        // After the barrier every key is set.
        for peer in 0..4 {
            assert_eq!(
                s.get(&format!("addr/{peer}"), T).unwrap(),
                format!("host{peer}").into_bytes()
            );
        }
        // get waits for a key set later.
        if r == 3 {
            thread::sleep(Duration::from_millis(50));
            s.set("late", b"here").unwrap();
        }
        assert_eq!(s.get("late", T).unwrap(), b"here");
        // Reused names start new rounds.
        let mut rounds = vec![];
        for round in 0..3u8 {
            rounds.push(s.all_gather("gather", &[r as u8, round], T).unwrap());
            s.barrier("step", T).unwrap();
        }
        s.barrier("done", T).unwrap();
        rounds
    });
    for rounds in results {
        for (round, all) in rounds.into_iter().enumerate() {
            assert_eq!(all, (0..4u8).map(|r| vec![r, round as u8]).collect::<Vec<_>>());
        }
    }
}

#[test]
fn barrier_timeout_names_the_missing_rank() {
    let (srv, addr) = server(4);
    let threads: Vec<_> = (1..3)
        .map(|r| {
            let addr = addr.clone();
            thread::spawn(move || {
                let s = Store::connect(&addr, r, 4, &key(), T).unwrap();
                let e = s.barrier("init", Duration::from_millis(300)).unwrap_err();
                (s, e)
            })
        })
        .collect();
    let root = Store::host(srv, T).unwrap();
    let start = Instant::now();
    let e = root.barrier("init", Duration::from_millis(300)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    let (_others, errors): (Vec<Store>, Vec<Error>) = threads.into_iter().map(|t| t.join().unwrap()).unzip();
    for e in errors.into_iter().chain([e]) {
        assert!(matches!(&e, Error::Timeout { missing, .. } if missing == &[3]), "{e:?}");
        let m = e.to_string();
        assert!(
            m.starts_with("barrier 'init' timed out after 0.3 s: ranks [3] did not arrive"),
            "{m}"
        );
        assert!(m.contains("never connected to the store: [3]"), "{m}");
    }
    // A connected rank that does not call is named too, without the "never connected" note.
    let _late = Store::connect(&addr, 3, 4, &key(), T).unwrap();
    let e = root
        .all_gather("x", b"", Duration::from_millis(100))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "all_gather 'x' timed out after 0.1 s: ranks [1, 2, 3] did not arrive"
    );
}

#[test]
fn get_timeout_says_the_key_was_never_set() {
    let (srv, _) = server(1);
    let root = Store::host(srv, T).unwrap();
    let e = root.get("nope", Duration::from_millis(50)).unwrap_err().to_string();
    assert_eq!(e, "get 'nope' timed out after 0.05 s: the key was never set");
}

#[test]
fn a_wrong_key_is_refused_while_the_right_ones_proceed() {
    let (srv, addr) = server(3);
    let intruder = {
        let addr = addr.clone();
        thread::spawn(move || Store::connect(&addr, 1, 3, &JobKey::new("a wrong key of 16+ bytes").unwrap(), T).unwrap_err())
    };
    let e = intruder.join().unwrap();
    assert!(
        matches!(
            e,
            Error::Refused {
                reason: Refusal::WrongKey
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "bootstrap store refused this client: wrong MKERNEL_JOB_KEY"
    );
    // The intruder claimed rank 1; the real rank 1 still gets in and the job proceeds.
    let threads: Vec<_> = (1..3)
        .map(|r| {
            let addr = addr.clone();
            thread::spawn(move || {
                Store::connect(&addr, r, 3, &key(), T)
                    .unwrap()
                    .all_gather("g", &[r as u8], T)
                    .unwrap()
            })
        })
        .collect();
    let root = Store::host(srv, T).unwrap();
    assert_eq!(root.all_gather("g", &[0], T).unwrap(), vec![vec![0], vec![1], vec![2]]);
    for t in threads {
        assert_eq!(t.join().unwrap(), vec![vec![0], vec![1], vec![2]]);
    }
    assert_eq!(root.server().unwrap().refused_clients(), 1);
}

#[test]
fn duplicate_out_of_range_and_mismatched_ranks_are_refused() {
    let (srv, addr) = server(2);
    let _one = Store::connect(&addr, 1, 2, &key(), T).unwrap();
    let refusal = |rank, world| match Store::connect(&addr, rank, world, &key(), T) {
        Err(Error::Refused { reason }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert_eq!(refusal(1, 2), Refusal::DuplicateRank { rank: 1 });
    assert_eq!(refusal(2, 2), Refusal::RankOutOfRange { rank: 2, world_size: 2 });
    assert_eq!(refusal(0, 3), Refusal::WorldSizeMismatch { client: 3, store: 2 });
    assert_eq!(srv.refused_clients(), 3);
    // Rank 0 is still free.
    let root = Store::host(srv, T).unwrap();
    root.set("k", b"v").unwrap();
}

#[test]
fn a_rank_that_leaves_fails_the_others_early() {
    let (srv, addr) = server(3);
    let root = Store::host(srv, T).unwrap();
    let one = Store::connect(&addr, 1, 3, &key(), T).unwrap();
    let _two = Store::connect(&addr, 2, 3, &key(), T).unwrap();
    let waiter = thread::spawn(move || one.barrier("b", T).unwrap_err());
    thread::sleep(Duration::from_millis(50));
    drop(_two);
    let start = Instant::now();
    let e = root.barrier("b", T).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5), "failed early");
    assert_eq!(
        e.to_string(),
        "barrier 'b' failed: ranks [2] left the job (their connection to the store closed)"
    );
    assert!(matches!(waiter.join().unwrap(), Error::RanksLeft { ranks, .. } if ranks == [2]));
}

#[test]
fn clients_wait_for_a_late_store_and_rank0_can_leave_after_the_last_barrier() {
    // A free port, then the ranks start before rank 0 listens on it.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let infos: Vec<RankInfo> = (0..3)
        .map(|r| RankInfo::new(r, 3, 3, "127.0.0.1", port, key()).unwrap())
        .collect();
    let threads: Vec<_> = infos[1..]
        .iter()
        .cloned()
        .map(|info| {
            thread::spawn(move || {
                let s = Store::for_rank(&info, T).unwrap();
                s.barrier("end", T).unwrap();
                s
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(100));
    let root = Store::for_rank(&infos[0], T).unwrap();
    assert!(root.server().is_some());
    root.barrier("end", T).unwrap();
    // Rank 0 leaves at once; the others still got their barrier reply.
    drop(root);
    for t in threads {
        let s = t.join().unwrap();
        let e = s.get("anything", T).unwrap_err();
        assert!(matches!(e, Error::StoreLost { .. }), "{e:?}");
    }
}

#[test]
fn unreachable_store_and_non_stores_are_reported() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let e = Store::connect(&addr, 1, 2, &key(), Duration::from_millis(200)).unwrap_err();
    assert!(matches!(e, Error::StoreUnreachable { .. }), "{e:?}");
    assert!(e.to_string().contains("is rank 0 running"), "{e}");

    // Something else listens on the port.
    let http = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = http.local_addr().unwrap().to_string();
    let t = thread::spawn(move || {
        let (mut c, _) = http.accept().unwrap();
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
    });
    let e = Store::connect(&addr, 1, 2, &key(), T).unwrap_err();
    assert!(e.to_string().contains("not an mkernel bootstrap store"), "{e}");
    t.join().unwrap();
}

#[test]
fn a_store_that_cannot_prove_the_key_is_not_trusted() {
    // An impostor that speaks the protocol but does not know the key.
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap().to_string();
    let t = thread::spawn(move || {
        let (c, _) = fake.accept().unwrap();
        protocol::write_msg(
            &c,
            &Msg::Hello {
                version: protocol::VERSION,
                nonce: [5; 32],
            },
        )
        .unwrap();
        let _ = protocol::read_msg(&c, protocol::MAX_HANDSHAKE_FRAME).unwrap();
        protocol::write_msg(&c, &Msg::Welcome { proof: [0; 32] }).unwrap();
    });
    let e = Store::connect(&addr, 1, 2, &key(), T).unwrap_err();
    assert!(matches!(e, Error::StoreNotAuthentic { .. }), "{e:?}");
    t.join().unwrap();
}
