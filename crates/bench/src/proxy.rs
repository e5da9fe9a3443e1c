//! `--op proxy`: latency and bandwidth of the GPU-initiated inter-node path: GPU posts a PUT
//! into the host-mapped FIFO -> the proxy thread drains it -> the transport moves the data and
//! then raises the flag -> the peer's GPU sees the flag. Measured on the GPU (`%globaltimer`) as
//! put-and-answer round trips; one-way = round trip / 2.
//!
//! Between emulated nodes (`xtask launch -n 2 --nodes 2`, what `xtask bench --op proxy` does)
//! it measures the emulated wire and then the TCP transport (over loopback) in the same run,
//! each on a communicator of its own (the second bootstraps on `MASTER_PORT + 1`). On real
//! nodes, or with `MKERNEL_TRANSPORT` set, it measures the one transport the job uses.
use crate::Args;
use anyhow::{bail, Result};
use mkernel::bootstrap::{Bootstrap, RankInfo};
use mkernel::proxy::backend::BackendKind;
use mkernel::{CommConfig, Communicator, Device};
use serde_json::{json, Value};
use std::time::Duration;

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64
}

pub fn run(args: &Args) -> Result<Vec<Value>> {
    let info = RankInfo::from_env()?;
    if info.nnodes() < 2 {
        bail!("--op proxy needs two (emulated) nodes: `xtask bench --op proxy` launches them, or `xtask launch -n 2 --nodes 2 -- mkernel-bench --op proxy`");
    }
    let forced = std::env::var("MKERNEL_TRANSPORT").is_ok_and(|v| !v.trim().is_empty());
    let transports = if info.emulated_nodes().is_some() && !forced {
        vec![Some(BackendKind::Emulated), Some(BackendKind::Tcp)]
    } else {
        vec![None]
    };
    let dev = Device::new(info.device())?;
    let mut rows = vec![];
    for (i, t) in transports.into_iter().enumerate() {
        let port = info.master_port().checked_add(i as u16).unwrap_or(info.master_port());
        let info_i = RankInfo::from_lookup(|k| {
            if k == "MASTER_PORT" {
                Some(port.to_string())
            } else {
                std::env::var(k).ok()
            }
        })?;
        rows.extend(measure(args, &dev, info_i, t)?);
    }
    Ok(rows)
}

fn measure(args: &Args, dev: &Device, info: RankInfo, transport: Option<BackendKind>) -> Result<Vec<Value>> {
    let boot = Bootstrap::new(info.clone(), Duration::from_secs(60))?;
    let comm = Communicator::new(
        dev,
        boot,
        CommConfig {
            heap_bytes: 16 << 20,
            transport,
            ..Default::default()
        },
    )?;
    let choice = comm.transport().cloned();
    let name = choice.as_ref().map_or("none", |c| c.kind.name());
    let stream = dev.default_stream();
    let (g, local, world) = (
        info.rank() as u32,
        info.local_world_size() as u32,
        info.world_size() as u32,
    );
    let node = g / local;
    let initiator = node % 2 == 0;
    let peer = if initiator {
        (g + local) % world
    } else {
        (g + world - local) % world
    };
    if g == 0 {
        let model = if name == "emulated" {
            std::env::var("MKERNEL_EMU_GBPS")
                .map(|v| format!(", {v} Gb/s"))
                .unwrap_or_else(|_| ", 400 Gb/s + 2 us model".into())
        } else {
            String::new()
        };
        println!(
            "# proxy path over the {name} transport{model} ({}), rank {g} <-> rank {peer}; one-way = GPU-timed round trip / 2",
            choice.as_ref().map_or("", |c| c.reason.as_str())
        );
        println!(
            "{:>9} {:>10} {:>6} | {:>12} {:>12} {:>12} | {:>10}",
            "transport", "bytes", "iters", "p50 (us)", "p99 (us)", "min (us)", "GB/s (p50)"
        );
    }
    let mut rows = vec![];
    let mut bytes = 8u64;
    while bytes <= args.max_bytes.min(64 << 20) {
        let iters = if bytes <= 1 << 20 { 200 } else { 20 };
        let rtt = comm.proxy_pingpong(&stream, peer, bytes, iters, initiator)?;
        if initiator {
            let mut one_way: Vec<u64> = rtt.iter().map(|r| r / 2).collect();
            one_way.sort_unstable();
            let (p50, p99, min) = (
                percentile(&one_way, 0.5) / 1e3,
                percentile(&one_way, 0.99) / 1e3,
                one_way[0] as f64 / 1e3,
            );
            let gbps = bytes as f64 / (p50 * 1e-6) / 1e9;
            if g == 0 {
                println!("{name:>9} {bytes:>10} {iters:>6} | {p50:>12.2} {p99:>12.2} {min:>12.2} | {gbps:>10.2}");
            }
            rows.push(json!({ "transport": name, "bytes": bytes, "iters": iters, "one_way_p50_us": p50, "one_way_p99_us": p99, "one_way_min_us": min, "gbytes_per_s": gbps, "rank": g, "peer": peer }));
        }
        bytes *= 8;
    }
    Ok(rows)
}
