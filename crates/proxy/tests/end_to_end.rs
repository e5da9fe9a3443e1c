//! Proxies of 2-4 in-process ranks exchanging data over the emulated CPU wire.
mod common;
use common::{Job, WAIT};
use mkernel_proxy::emulated::WireModel;
use mkernel_proxy::protocol::CommandBody;
use std::time::{Duration, Instant};

const BLOCK: u64 = 4096;

fn pattern(from: usize, to: usize, epoch: u64, j: u64) -> u8 {
    (from as u64 * 31 + to as u64 * 7 + epoch * 13 + j) as u8
}

/// Every rank sends a block to every remote rank each epoch and waits for theirs. Receive
/// blocks and flags are double-buffered by epoch parity (a sender is at most one epoch ahead of
/// a receiver, since it waits for the receiver's blocks of the previous epoch); flags carry the
/// epoch and are never reset. Region: [parity 0 blocks | parity 1 blocks | send blocks].
fn all_to_all(nnodes: usize, local: usize, epochs: u64) {
    let world = nnodes * local;
    let mut job = Job::new(
        nnodes,
        local,
        16,
        (3 * world as u64 * BLOCK) as usize,
        2 * world,
        WireModel {
            bytes_per_sec: 1e9,
            latency: Duration::from_micros(10),
        },
    );
    let t0 = Instant::now();
    let devices: Vec<_> = (0..world)
        .map(|r| {
            let (p, f, topo) = (job.producer(r), job.fabric.clone(), job.ranks[r].topo.clone());
            std::thread::spawn(move || {
                let peers = topo.proxy_peers();
                let mut last = None;
                for e in 1..=epochs {
                    if let Some(s) = last {
                        p.wait_done(s + 1).unwrap(); // previous epoch's sources were read
                    }
                    let parity = e % 2;
                    for &d in &peers {
                        let block: Vec<u8> = (0..BLOCK).map(|j| pattern(r, d, e, j)).collect();
                        let src = (2 * world + d) as u64 * BLOCK; // sources after the two receive halves
                        f.write(r, src, &block).unwrap();
                        let dst = (parity * world as u64 + r as u64) * BLOCK;
                        let flag = (parity * world as u64 + r as u64) * 8;
                        last = Some(
                            p.push(&CommandBody::put(d as u32, src, dst, BLOCK, flag, e, e))
                                .unwrap(),
                        );
                    }
                    for &s in &peers {
                        let flag = (parity * world as u64 + s as u64) * 8;
                        assert!(f.wait_flag(r, flag, e, WAIT), "rank {r} epoch {e}: no flag from {s}");
                        let got = f
                            .read(r, (parity * world as u64 + s as u64) * BLOCK, BLOCK as usize)
                            .unwrap();
                        assert!(
                            got.iter().enumerate().all(|(j, &b)| b == pattern(s, r, e, j as u64)),
                            "rank {r} epoch {e}: bad data from {s}"
                        );
                    }
                }
                p.push(&CommandBody::quit(epochs)).unwrap();
                peers.len() as u64
            })
        })
        .collect();
    let npeers: Vec<u64> = devices.into_iter().map(|d| d.join().unwrap()).collect();
    let elapsed = t0.elapsed();
    let mut total_bytes = 0;
    for (r, n) in npeers.iter().enumerate() {
        let stats = job.take_proxy(r).join().unwrap();
        assert_eq!(
            (stats.puts, stats.signals, stats.bytes),
            (epochs * n, epochs * n, epochs * n * BLOCK),
            "rank {r}"
        );
        assert_eq!(stats.done, epochs * n + 1);
        total_bytes += stats.bytes;
    }
    println!("all-to-all {nnodes} nodes x {local} GPUs: {epochs} epochs, {total_bytes} bytes in {elapsed:?}");
}

#[test]
fn two_ranks_on_two_nodes() {
    all_to_all(2, 1, 30);
}

#[test]
fn four_ranks_on_two_nodes() {
    all_to_all(2, 2, 20);
}

#[test]
fn four_ranks_on_four_nodes() {
    all_to_all(4, 1, 10);
}

/// A SIGNAL after several flagless puts raises its flag only after all of them landed.
#[test]
fn signal_after_flagless_puts() {
    let mut job = Job::new(
        2,
        1,
        8,
        64 * 1024,
        2,
        WireModel {
            bytes_per_sec: 2e8,
            latency: Duration::from_micros(50),
        },
    );
    let p = job.producer(0);
    job.fabric.write(0, 0, &vec![3u8; 64 * 1024]).unwrap();
    for i in 0..16u64 {
        p.push(&CommandBody::put_no_flag(1, i * 4096, i * 4096, 4096, 1))
            .unwrap();
    }
    p.push(&CommandBody::signal(1, 8, 1, 1)).unwrap();
    let t0 = Instant::now();
    let mut seen_early = false;
    while job.fabric.flag(1, 8) == 0 {
        assert!(t0.elapsed() < WAIT);
        std::thread::yield_now();
    }
    let data = job.fabric.read(1, 0, 64 * 1024).unwrap();
    if data.iter().any(|&b| b != 3) {
        seen_early = true;
    }
    assert!(!seen_early, "the SIGNAL's flag was visible before all puts landed");
    p.push(&CommandBody::quit(1)).unwrap();
    job.take_proxy(0).join().unwrap();
}

/// The bandwidth cap paces puts; the printout is the achieved rate (not asserted tightly).
#[test]
fn bandwidth_cap_paces_the_wire() {
    let bw = 2e8; // 200 MB/s
    let mut job = Job::new(
        2,
        1,
        32,
        1 << 20,
        1,
        WireModel {
            bytes_per_sec: bw,
            latency: Duration::from_micros(20),
        },
    );
    let p = job.producer(0);
    let t0 = Instant::now();
    for i in 0..16u64 {
        p.push(&CommandBody::put_no_flag(1, i << 16, i << 16, 1 << 16, 1))
            .unwrap();
    }
    p.push(&CommandBody::signal(1, 0, 1, 1)).unwrap();
    assert!(job.fabric.wait_flag(1, 0, 1, WAIT));
    let dt = t0.elapsed();
    let expect = Duration::from_secs_f64((1 << 20) as f64 / bw);
    println!(
        "[bandwidth] 1 MiB at a {:.0} MB/s cap: {dt:?} ({:.0} MB/s achieved; ideal {expect:?})",
        bw / 1e6,
        (1 << 20) as f64 / dt.as_secs_f64() / 1e6
    );
    assert!(dt >= expect, "faster than the cap: {dt:?} < {expect:?}");
    p.push(&CommandBody::quit(1)).unwrap();
    job.take_proxy(0).join().unwrap();
}

/// `stop()` and drop end a proxy that never gets QUIT.
#[test]
fn stop_and_drop_end_the_thread() {
    let mut job = Job::new(2, 1, 8, 64, 1, WireModel::unlimited());
    job.producer(0).push(&CommandBody::put(1, 0, 0, 8, 0, 1, 0)).unwrap();
    assert!(job.fabric.wait_flag(1, 0, 1, WAIT));
    let stats = job.take_proxy(0).stop().unwrap();
    assert_eq!(stats.commands, 1);
    let t0 = Instant::now();
    drop(job); // rank 1's proxy: dropped while idle
    assert!(t0.elapsed() < Duration::from_secs(5));
}
