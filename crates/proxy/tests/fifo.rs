//! FIFO behaviour through a running proxy: wraparound, backpressure, ordering, epochs.
mod common;
use common::{u64_at, Job, WAIT};
use mkernel_proxy::emulated::WireModel;
use mkernel_proxy::protocol::CommandBody;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const SLOTS: u64 = 64; // data/flag slots per destination
const W: u64 = 16; // bytes per data slot

/// `v` spread over 16 bytes so that every byte grows with `v` and the bytes sum to `v`
/// (byte k = (v + k) / 16). A read that races with a later put mixes bytes of two values, each
/// byte between the old and the new one, so the sum of what it read is never below the old
/// value: the check below stays exact even when it tears.
fn encode(v: u64) -> Vec<u8> {
    (0..W).map(|k| ((v + k) / W) as u8).collect()
}

fn decode(b: &[u8]) -> u64 {
    b.iter().map(|&x| u64::from(x)).sum()
}

/// Rank 0 (node 0) sends `per_thread` puts from each of `threads` producer threads to every
/// remote rank, through a FIFO of 8 slots (far fewer than the commands). Put `i` of a
/// destination writes `encode(i + 1)` into data slot `s = i % SLOTS` and then raises flag `s`
/// to `i + 1`. Observers on the receivers check, for every flag value they see, that the data
/// of its slot decodes to at least that value (the data landed before its flag).
#[test]
fn wraparound_and_flag_after_data_per_destination() {
    let (threads, per_thread) = (2u64, 1500u64);
    let job = Job::new(
        2,
        2,
        8,
        (SLOTS * W) as usize * 2,
        SLOTS as usize,
        WireModel::unlimited(),
    );
    let dsts = [2usize, 3];
    let stop = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicUsize::new(0));
    let observed = Arc::new(AtomicUsize::new(0));
    let observers: Vec<_> = dsts
        .iter()
        .map(|&d| {
            let (f, stop, bad, seen) = (job.fabric.clone(), stop.clone(), violations.clone(), observed.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    for s in 0..SLOTS {
                        let flag = f.flag(d, s * 8);
                        if flag > 0 {
                            seen.fetch_add(1, Ordering::Relaxed);
                            if decode(&f.read(d, s * W, W as usize).unwrap()) < flag {
                                bad.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    std::thread::yield_now();
                }
            })
        })
        .collect();
    let producers: Vec<_> = (0..threads)
        .map(|t| {
            let (p, f) = (job.producer(0), job.fabric.clone());
            std::thread::spawn(move || {
                // Thread t owns slots s with s % threads == t; each destination has its own source half.
                let mut last_seq = vec![None::<u64>; (SLOTS * 2) as usize];
                for k in 0..per_thread {
                    for (di, &d) in dsts.iter().enumerate() {
                        let i = k * threads + t; // command index for this destination
                        let s = i % SLOTS;
                        let src = (di as u64 * SLOTS + s) * W;
                        if let Some(seq) = last_seq[(di as u64 * SLOTS + s) as usize] {
                            p.wait_done(seq + 1).unwrap(); // the old source bytes were read
                        }
                        f.write(0, src, &encode(i + 1)).unwrap();
                        let seq = p
                            .push(&CommandBody::put(d as u32, src, s * W, W, s * 8, i + 1, 0))
                            .unwrap();
                        last_seq[(di as u64 * SLOTS + s) as usize] = Some(seq);
                    }
                }
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    let total = threads * per_thread;
    for &d in &dsts {
        for s in 0..SLOTS {
            // The last command for slot s carries the largest i with i % SLOTS == s.
            let last = (0..total).filter(|i| i % SLOTS == s).max().unwrap() + 1;
            assert!(
                job.fabric.wait_flag(d, s * 8, last, WAIT),
                "rank {d} flag {s} stuck at {}",
                job.fabric.flag(d, s * 8)
            );
            assert_eq!(job.fabric.read(d, s * W, W as usize).unwrap(), encode(last));
        }
    }
    stop.store(true, Ordering::Release);
    for o in observers {
        o.join().unwrap();
    }
    let mut job = job;
    let commands = 2 * total;
    let seq = job.producer(0).push(&CommandBody::quit(0)).unwrap();
    assert_eq!(seq, commands);
    let stats = job.take_proxy(0).join().unwrap();
    println!("wraparound: {commands} puts through an 8-slot FIFO; {} batches, largest {} ops; {} flag observations, {} violations", stats.batches, stats.largest_batch, observed.load(Ordering::Relaxed), violations.load(Ordering::Relaxed));
    assert_eq!(
        violations.load(Ordering::Relaxed),
        0,
        "a flag was visible before its data"
    );
    assert_eq!(
        (stats.commands, stats.puts, stats.signals, stats.bytes),
        (commands + 1, commands, commands, commands * W)
    );
    assert_eq!(stats.done, commands + 1);
    assert!(stats.largest_batch <= 16);
    let fifo = &job.ranks[0].fifo;
    assert_eq!(fifo.tail().load(Ordering::Acquire), commands + 1);
    assert_eq!(fifo.done().load(Ordering::Acquire), commands + 1);
    assert_eq!(fifo.abort_code(), 0);
}

/// With no proxy, a producer fills the 4 slots and blocks on the 5th; once a proxy runs it
/// finishes.
#[test]
fn backpressure_blocks_until_the_proxy_advances() {
    let mut job = Job::idle(2, 1, 4, 1024, 8, WireModel::unlimited());
    let pushed = Arc::new(AtomicUsize::new(0));
    let (p, n) = (job.producer(0), pushed.clone());
    let producer = std::thread::spawn(move || {
        for i in 0..10u64 {
            p.push(&CommandBody::put(1, i * 8, i * 8, 8, 0, i + 1, 0)).unwrap();
            n.fetch_add(1, Ordering::Release);
        }
        p.push(&CommandBody::quit(0)).unwrap();
    });
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        pushed.load(Ordering::Acquire),
        4,
        "the producer must block when the FIFO is full"
    );
    assert_eq!(
        job.ranks[0].fifo.head().load(Ordering::Acquire),
        5,
        "it claimed the 5th sequence number and waits for its slot"
    );
    assert_eq!(job.ranks[0].fifo.tail().load(Ordering::Acquire), 0);
    job.start_proxy(0);
    producer.join().unwrap();
    assert_eq!(pushed.load(Ordering::Acquire), 10);
    let stats = job.take_proxy(0).join().unwrap();
    assert_eq!(stats.commands, 11);
    assert_eq!(job.fabric.flag(1, 0), 10);
}

/// Three "launches" of a kernel reuse the FIFO and the flags without resetting anything: launch
/// e raises flags to e and the receiver waits for `flag >= e`. The proxy is restarted between
/// launches 2 and 3 (a new proxy resumes at the FIFO's tail).
#[test]
fn epochs_across_launches_need_no_reset() {
    let mut job = Job::new(2, 1, 16, 4096, 8, WireModel::unlimited());
    for epoch in 1..=3u64 {
        if epoch == 3 {
            let stats = job.take_proxy(0).stop().unwrap();
            assert_eq!(stats.commands, 2 * 41);
            job.start_proxy(0);
        }
        let p = job.producer(0);
        for i in 0..40u64 {
            let v = epoch * 1000 + i;
            job.fabric.write(0, i * 8, &v.to_le_bytes()).unwrap();
            p.push(&CommandBody::put_no_flag(1, i * 8, i * 8, 8, epoch)).unwrap();
        }
        let last = p.push(&CommandBody::signal(1, (epoch % 8) * 8, epoch, epoch)).unwrap();
        assert!(job.fabric.wait_flag(1, (epoch % 8) * 8, epoch, WAIT));
        for i in 0..40u64 {
            assert_eq!(
                u64_at(&job.fabric, 1, i * 8),
                epoch * 1000 + i,
                "data of launch {epoch} visible after its SIGNAL"
            );
        }
        p.wait_done(last + 1).unwrap();
    }
    let p = job.producer(0);
    p.push(&CommandBody::quit(3)).unwrap();
    let stats = job.take_proxy(0).join().unwrap();
    assert_eq!(stats.commands, 41 + 1);
    assert_eq!(job.ranks[0].fifo.tail().load(Ordering::Acquire), 3 * 41 + 1);
    // Flags of earlier launches were never reset.
    assert_eq!(
        (job.fabric.flag(1, 8), job.fabric.flag(1, 16), job.fabric.flag(1, 24)),
        (1, 2, 3)
    );
}
