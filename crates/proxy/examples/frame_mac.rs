//! CPU cost of the TCP transport's per-frame tags (`mkernel_proxy::tcp::mac`): bytes per second
//! of one thread tagging a 32-byte header plus a payload, for payloads of the sizes a frame
//! carries, beside HMAC-SHA256 (the bootstrap store's MAC) and a plain copy of the same bytes
//! (what staging does once per frame anyway).
//!
//! `cargo run --release -p mkernel-proxy --example frame_mac`
use hmac::{KeyInit, Mac};
use mkernel_proxy::tcp::frame::HEADER_BYTES;
use mkernel_proxy::tcp::mac::FrameKey;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Bytes per second of `f` over `bytes`-byte inputs, best of 5 runs of about 0.2 s each.
fn rate(bytes: usize, mut f: impl FnMut()) -> f64 {
    let mut best = 0f64;
    for _ in 0..5 {
        let (t0, mut n) = (Instant::now(), 0u64);
        while t0.elapsed() < Duration::from_millis(200) {
            f();
            n += 1;
        }
        best = best.max(n as f64 * bytes as f64 / t0.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let key = FrameKey::derive(&[7; 32], 0, 1, 0, &[9; 32]);
    let hdr = [3u8; HEADER_BYTES];
    println!("payload_bytes  blake3_tag_GB/s  hmac_sha256_GB/s  memcpy_GB/s  tag_us_per_frame");
    for size in [4 << 10, 64 << 10, 512 << 10] {
        let payload: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let mut dst = vec![0u8; size];
        let total = HEADER_BYTES + size;
        let b3 = rate(total, || {
            black_box(key.tag(black_box(&hdr), black_box(&payload)));
        });
        let hs = rate(total, || {
            let mut m = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(&[7; 32]).expect("any key length");
            m.update(black_box(&hdr));
            m.update(black_box(&payload));
            black_box(m.finalize());
        });
        let cp = rate(size, || {
            dst.copy_from_slice(black_box(&payload));
            black_box(&dst);
        });
        println!(
            "{size:>13}  {:>15.2}  {:>16.2}  {:>11.2}  {:>16.1}",
            b3 / 1e9,
            hs / 1e9,
            cp / 1e9,
            total as f64 / b3 * 1e6
        );
    }
}
