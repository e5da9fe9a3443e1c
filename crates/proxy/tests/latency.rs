//! Latency of the loop: producer commit -> proxy poll -> emulated wire -> remote flag visible.
//! Printed, not asserted tightly (the build host has 2 shared cores).
mod common;
use common::Job;
use mkernel_proxy::emulated::WireModel;
use mkernel_proxy::protocol::CommandBody;
use mkernel_proxy::Backoff;
use std::time::{Duration, Instant};

fn measure(label: &str, model: WireModel, n: u64) {
    let mut job = Job::idle(2, 1, 64, 4096, 1, model);
    job.backoff = Backoff::busy();
    job.start_proxy(0);
    let p = job.producer(0);
    let mut samples = Vec::with_capacity(n as usize);
    for i in 0..n + 100 {
        let t0 = Instant::now();
        p.push(&CommandBody::put(1, 0, 0, 64, 0, i + 1, 0)).unwrap();
        let mut spins = 0u32;
        while job.fabric.flag(1, 0) < i + 1 {
            spins += 1;
            if spins & 63 == 0 {
                std::thread::yield_now();
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no flag");
        }
        if i >= 100 {
            samples.push(t0.elapsed());
        }
    }
    p.push(&CommandBody::quit(0)).unwrap();
    job.take_proxy(0).join().unwrap();
    samples.sort();
    let pct = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    println!(
        "[latency] {label}: 64-byte put + flag, {} samples: p50 {:?}  p90 {:?}  p99 {:?}  mean {mean:?}",
        samples.len(),
        pct(0.5),
        pct(0.9),
        pct(0.99)
    );
    assert!(
        pct(0.5) < Duration::from_millis(100),
        "median latency {:?} is absurd",
        pct(0.5)
    );
}

#[test]
fn loop_latency() {
    measure("unlimited wire", WireModel::unlimited(), 2000);
    measure("400 Gb/s model, 2 us", WireModel::nic_400g(), 2000);
}
