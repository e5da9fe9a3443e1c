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
        thread::spawn(move || {
            Store::connect(&addr, 1, 3, &JobKey::new("a wrong key of 16+ bytes").unwrap(), T).unwrap_err()
        })
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

// ---- Hostile and oversized input -------------------------------------------------------------

use std::io::Read;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::auth::{Handshake, Tag};
use crate::store::protocol::MAX_HANDSHAKE_FRAME;
use crate::store::Limits;

fn server_with(world: usize, limits: Limits) -> (StoreServer, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let s = StoreServer::serve_with(l, world, key(), limits).unwrap();
    let addr = s.local_addr().to_string();
    (s, addr)
}

/// A raw connection that got the store's greeting, and the store's nonce.
fn raw(addr: &str) -> (TcpStream, Tag) {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    match protocol::read_msg(&s, MAX_HANDSHAKE_FRAME).unwrap() {
        Msg::Hello { nonce, .. } => (s, nonce),
        other => panic!("greeting {other:?}"),
    }
}

/// A length-prefixed frame around `body`.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// The `Auth` message of `rank` of 2 answering `server_nonce` under `key`.
fn auth(server_nonce: Tag, rank: u32, key: &JobKey) -> Msg {
    let client_nonce = crate::auth::nonce().unwrap();
    let hs = Handshake {
        server_nonce,
        client_nonce,
        rank,
        world_size: 2,
    };
    Msg::Auth {
        rank,
        world_size: 2,
        nonce: client_nonce,
        proof: hs.client_proof(key),
    }
}

/// The store's verdict; then the store must close the connection at once (its thread ended).
fn refusal(s: &TcpStream) -> Refusal {
    let verdict = match protocol::read_msg(s, MAX_HANDSHAKE_FRAME) {
        Ok(Msg::Refused(r)) => r,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let _ = s.shutdown(Shutdown::Write);
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut b = [0u8; 1];
    assert!(
        matches!((&*s).read(&mut b), Ok(0)),
        "the store kept the connection open after refusing it ({verdict})"
    );
    verdict
}

#[test]
fn bad_handshakes_are_refused_by_name() {
    let (srv, addr) = server(2);
    // A frame cut short: its length says 77 bytes, 10 arrive, then the sender stops writing.
    let (s, _) = raw(&addr);
    let mut f = framed(&[2u8; 77]);
    f.truncate(14);
    (&s).write_all(&f).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    assert_eq!(refusal(&s), Refusal::Truncated);
    // A whole frame whose fields run past its end.
    let (s, _) = raw(&addr);
    (&s).write_all(&framed(&[2, 1, 0])).unwrap();
    assert_eq!(refusal(&s), Refusal::Truncated);
    // A length over the handshake limit (and an HTTP request, whose "GET " reads as one).
    let (s, _) = raw(&addr);
    (&s).write_all(&(64u32 << 20).to_le_bytes()).unwrap();
    assert_eq!(
        refusal(&s),
        Refusal::FrameTooLarge {
            len: 64 << 20,
            max: MAX_HANDSHAKE_FRAME
        }
    );
    let (s, _) = raw(&addr);
    (&s).write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(matches!(refusal(&s), Refusal::FrameTooLarge { .. }));
    // Not an Auth message.
    let (s, _) = raw(&addr);
    protocol::write_msg(&s, &Msg::Done).unwrap();
    assert_eq!(refusal(&s), Refusal::Malformed);
    let (s, _) = raw(&addr);
    (&s).write_all(&framed(&[99, 0, 0])).unwrap();
    assert_eq!(refusal(&s), Refusal::Malformed);
    // A wrong key.
    let (s, n) = raw(&addr);
    let wrong = JobKey::new("not this job's key!").unwrap();
    protocol::write_msg(&s, &auth(n, 1, &wrong)).unwrap();
    assert_eq!(refusal(&s), Refusal::WrongKey);
    // A replay: rank 1's recorded Auth, sent again on a new connection.
    let (s1, n) = raw(&addr);
    let recorded = auth(n, 1, &key());
    protocol::write_msg(&s1, &recorded).unwrap();
    assert!(matches!(
        protocol::read_msg(&s1, MAX_HANDSHAKE_FRAME).unwrap(),
        Msg::Welcome { .. }
    ));
    let (s, _) = raw(&addr);
    protocol::write_msg(&s, &recorded).unwrap();
    assert_eq!(refusal(&s), Refusal::Replayed);
    // Also after rank 1 left.
    drop(s1);
    thread::sleep(Duration::from_millis(50));
    let (s, _) = raw(&addr);
    protocol::write_msg(&s, &recorded).unwrap();
    assert_eq!(refusal(&s), Refusal::Replayed);
    assert_eq!(srv.refused_clients(), 9);
    // The job itself is unaffected (rank 1 reconnects first: the store saw it leave).
    let one = Store::connect(&addr, 1, 2, &key(), T).unwrap();
    let one = thread::spawn(move || one.barrier("b", T));
    Store::host(srv, T).unwrap().barrier("b", T).unwrap();
    one.join().unwrap().unwrap();
}

#[test]
fn the_handshake_deadline_is_absolute() {
    let limits = Limits {
        handshake: Duration::from_millis(400),
        ..Limits::default()
    };
    let (_srv, addr) = server_with(2, limits);
    let (s, _) = raw(&addr);
    // One byte every 50 ms: every read completes long before any per-read timeout would fire.
    let start = Instant::now();
    let trickler = {
        let s = s.try_clone().unwrap();
        thread::spawn(move || {
            let mut f = framed(&[2u8; 77]).into_iter();
            while start.elapsed() < Duration::from_secs(3) {
                match f.next() {
                    Some(b) if (&s).write_all(&[b]).is_ok() => thread::sleep(Duration::from_millis(50)),
                    _ => break,
                }
            }
        })
    };
    let r = refusal(&s);
    let took = start.elapsed();
    assert_eq!(
        r,
        Refusal::HandshakeTimeout {
            after: Duration::from_millis(400)
        }
    );
    assert!(
        took >= Duration::from_millis(350) && took < Duration::from_secs(2),
        "{took:?}"
    );
    trickler.join().unwrap();
}

#[test]
fn a_slowloris_crowd_does_not_keep_ranks_out() {
    const CROWD: usize = 140;
    let (srv, addr) = server(3);
    // 140 connections that each trickle one byte every 200 ms and never finish, and more that
    // keep arriving while the ranks join.
    let mut crowd: Vec<TcpStream> = (0..CROWD).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    for s in &crowd {
        s.set_nonblocking(true).unwrap();
        let _ = (&*s).write_all(&77u32.to_le_bytes()[..1]);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = {
        let (stop, addr) = (stop.clone(), addr.clone());
        thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                if n < 200 {
                    if let Ok(s) = TcpStream::connect(&addr) {
                        s.set_nonblocking(true).unwrap();
                        crowd.push(s);
                        n += 1;
                    }
                }
                for s in &crowd {
                    let _ = (&*s).write_all(&[0]);
                }
                thread::sleep(Duration::from_millis(if n < 200 { 5 } else { 200 }));
            }
            crowd.len()
        })
    };
    thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let ranks: Vec<_> = (1..3)
        .map(|r| {
            let addr = addr.clone();
            thread::spawn(move || {
                let s = Store::connect(&addr, r, 3, &key(), T)?;
                s.barrier("joined", T)?;
                Ok::<_, Error>(s)
            })
        })
        .collect();
    let root = Store::host(srv, T).unwrap();
    root.barrier("joined", T).unwrap();
    let _others: Vec<Store> = ranks.into_iter().map(|t| t.join().unwrap().unwrap()).collect();
    let took = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    let sockets = attacker.join().unwrap();
    let evicted = root.server().unwrap().evicted_clients();
    assert!(
        took < Duration::from_secs(5),
        "3 ranks took {took:?} to join past {sockets} stalled sockets"
    );
    assert!(
        evicted >= sockets - 64,
        "{evicted} of {sockets} stalled sockets evicted"
    );
    println!("3 ranks joined in {took:?} past {sockets} stalled sockets ({evicted} evicted)");
}

#[test]
fn oversized_requests_and_replies_are_named_errors() {
    let limits = Limits {
        max_frame: 4096,
        ..Limits::default()
    };
    let (srv, addr) = server_with(2, limits);
    let one = thread::spawn({
        let addr = addr.clone();
        move || {
            let s = Store::connect(&addr, 1, 2, &key(), T).unwrap();
            let start = Instant::now();
            let e = s.all_gather("big", &[1; 3000], T).unwrap_err();
            (s, e, start.elapsed())
        }
    });
    let root = Store::host(srv, T).unwrap();
    let start = Instant::now();
    let e = root.all_gather("big", &[0; 3000], T).unwrap_err();
    let (one, e1, took1) = one.join().unwrap();
    for (e, took) in [(e, start.elapsed()), (e1, took1)] {
        // The store answers at once: no wait for "no answer from the store".
        assert!(took < Duration::from_secs(2), "{took:?}");
        assert!(
            matches!(e, Error::TooLarge { reply: true, max: 4096, bytes, .. } if bytes > 6000),
            "{e:?}"
        );
        assert!(e.to_string().contains("all_gather 'big': the reply of"), "{e}");
    }
    // Both connections still serve.
    let t = thread::spawn(move || {
        one.barrier("after", T).unwrap();
        one
    });
    root.barrier("after", T).unwrap();
    let one = t.join().unwrap();
    // A request over the client's limit is refused before anything is sent.
    one.set_max_frame(1024);
    let e = one.set("k", &[7; 2000]).unwrap_err();
    assert!(
        matches!(e, Error::TooLarge { reply: false, max: 1024, bytes, .. } if bytes > 2000),
        "{e:?}"
    );
    one.set("k", b"small").unwrap();
    assert_eq!(root.get("k", T).unwrap(), b"small");
}

/// `Duration::MAX` (a deadline past the clock's end) is an error naming the operation, for
/// connecting and for every waiting request; the connection stays usable after it.
#[test]
fn an_endless_timeout_is_an_error() {
    let (srv, addr) = server(1);
    let e = Store::connect(&addr, 0, 1, &key(), Duration::MAX).unwrap_err();
    assert!(matches!(e, Error::TimeoutTooLong { .. }), "{e}");
    let s = Store::host(srv, T).unwrap();
    for e in [
        s.get("k", Duration::MAX).unwrap_err(),
        s.barrier("b", Duration::MAX).unwrap_err(),
        s.all_gather("g", b"x", Duration::MAX).unwrap_err(),
    ] {
        assert!(matches!(e, Error::TimeoutTooLong { .. }), "{e}");
    }
    s.set("k", b"v").unwrap();
    assert_eq!(s.get("k", T).unwrap(), b"v");
}

/// `MASTER_ADDR` that is not an address of this host (192.0.2.1, TEST-NET-1): an error naming
/// `MKERNEL_STORE_BIND_ALL` unless that option asks for every interface.
#[test]
fn binding_every_interface_needs_the_option() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let info = RankInfo::new(0, 1, 1, "192.0.2.1", port, key()).unwrap();
    let e = bind_store(&info).unwrap_err().to_string();
    assert!(e.contains("MKERNEL_STORE_BIND_ALL=1") && e.contains("192.0.2.1"), "{e}");
    let l = bind_store(&info.with_store_bind_all(true)).unwrap();
    assert!(l.local_addr().unwrap().ip().is_unspecified());
}
