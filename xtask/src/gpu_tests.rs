//! The GPU test suite: every test binary with its GPU tests on, multi-rank binaries under
//! `launch` at 2 and 4 ranks (and as 2 emulated nodes), sharing the GPUs through MPS where the
//! host has fewer GPUs than ranks. `bundle/run-tests.sh` and `cargo xtask test --gpu` run it.
use crate::launch::{self, LaunchArgs};
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Pause after a failed launch of ranks sharing a GPU through MPS, before the next one.
const MPS_SETTLE: std::time::Duration = std::time::Duration::from_secs(5);

/// One way to run a multi-rank test binary: `ranks` processes in `nodes` emulated nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub ranks: usize,
    pub nodes: usize,
}

const fn l(ranks: usize, nodes: usize) -> Layout {
    Layout { ranks, nodes }
}

/// The layouts a test binary runs in; empty for single-process binaries.
///
/// Multi-rank binaries are recognised by name: `collective*`, `fused*`, `abort*`, `ring_*`,
/// `moe_ep*`, `agree*` (every one at 2 and 4 ranks, `collectives_oneshot` also at 3; `fused*`,
/// `ring_*`, `moe_ep*` and `agree*` also as 2 nodes x 1 and 2 nodes x 2) and `internode*` (2 nodes
/// x 1 and 2 nodes x 2). `*_order` binaries are CPU model checks and run once.
pub fn layouts(binary: &str) -> Vec<Layout> {
    let name = binary.rsplit('/').next().unwrap_or(binary);
    let name = name.strip_prefix("mkernel-tests-").unwrap_or(name);
    if name.ends_with("_order") {
        return vec![];
    }
    if name.starts_with("internode") {
        return vec![l(2, 2), l(4, 2)];
    }
    // Across nodes with one rank per node every hop goes through the proxy (the ring's, the
    // fused ops' and MoE's inter-node traffic); with two, the hops between the nodes.
    if ["fused", "ring_", "moe_ep", "agree"]
        .iter()
        .any(|p| name.starts_with(p))
    {
        return vec![l(2, 1), l(4, 1), l(2, 2), l(4, 2)];
    }
    // The AllReduce paths' suite also runs at an odd rank count (uneven chunks and tails).
    if name.starts_with("collectives_oneshot") {
        return vec![l(2, 1), l(3, 1), l(4, 1)];
    }
    if ["collective", "abort"].iter().any(|p| name.starts_with(p)) {
        return vec![l(2, 1), l(4, 1)];
    }
    vec![]
}

/// What the suite runs: which binaries, how long each launch may take, extra test arguments.
pub struct Suite {
    pub binaries: Vec<PathBuf>,
    /// Run only binaries whose file name contains one of these (all when empty).
    pub only: Vec<String>,
    /// Run multi-rank binaries only at these rank counts (all when empty).
    pub ranks: Vec<usize>,
    /// Run multi-rank binaries only in layouts of these node counts (all when empty).
    pub nodes: Vec<usize>,
    pub timeout_s: u64,
    pub test_args: Vec<String>,
    /// Inter-node transports for the layouts of several emulated nodes: each such layout runs
    /// once per entry, with `MKERNEL_TRANSPORT` set to it (`default`: left as the caller's
    /// environment has it, which on one host picks the emulated wire). Empty = `[default]`.
    pub transports: Vec<String>,
}

/// The `MKERNEL_TRANSPORT` values a `--transport` list may hold (`default`: not set).
pub const TRANSPORTS: [&str; 3] = ["default", "emulated", "tcp"];

/// The runs of one layout: `(label suffix, extra variables)`, one per transport for layouts of
/// several nodes, one plain run otherwise.
pub fn transport_runs(lay: Layout, transports: &[String]) -> Vec<(String, Vec<(String, String)>)> {
    if lay.nodes < 2 || transports.is_empty() {
        return vec![(String::new(), vec![])];
    }
    transports
        .iter()
        .map(|t| match t.as_str() {
            "default" => (String::new(), vec![]),
            t => (
                format!(" over {t}"),
                vec![("MKERNEL_TRANSPORT".to_string(), t.to_string())],
            ),
        })
        .collect()
}

/// Runs the suite; prints one line per run with its mode and result; `Ok(false)` if any failed.
pub fn run(suite: &Suite) -> Result<bool> {
    if let Some(bad) = suite.transports.iter().find(|t| !TRANSPORTS.contains(&t.as_str())) {
        anyhow::bail!("--transport {bad}: one of {TRANSPORTS:?} (the RDMA ones need a NIC and two hosts)");
    }
    let gpus = crate::util::gpu_count().unwrap_or(0);
    let mut results: Vec<(String, bool, f64)> = vec![];
    for bin in &suite.binaries {
        let name = bin
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !suite.only.is_empty() && !suite.only.iter().any(|o| name.contains(o.as_str())) {
            continue;
        }
        let layouts = layouts(&name);
        if layouts.is_empty() {
            let label = format!("{name}: one process");
            println!("== {label}");
            let t = Instant::now();
            let mut cmd = Command::new(bin);
            cmd.args(["--include-ignored", "--test-threads=1"])
                .args(&suite.test_args);
            let ok = cmd.status().map(|s| s.success()).unwrap_or(false);
            results.push((label, ok, t.elapsed().as_secs_f64()));
            continue;
        }
        for lay in layouts {
            if !suite.ranks.is_empty() && !suite.ranks.contains(&lay.ranks) {
                continue;
            }
            if !suite.nodes.is_empty() && !suite.nodes.contains(&lay.nodes) {
                continue;
            }
            let nodes = if lay.nodes > 1 {
                format!(" in {} emulated nodes", lay.nodes)
            } else {
                String::new()
            };
            if gpus == 0 {
                let label = format!("{name}: {} ranks{nodes}: SKIPPED (no GPU)", lay.ranks);
                println!("== {label}");
                results.push((label, true, 0.0));
                continue;
            }
            let share = gpus < lay.ranks;
            let mode = if share {
                format!("sharing {gpus} GPU(s) through MPS")
            } else {
                format!("one GPU each ({} of {gpus})", lay.ranks)
            };
            for (over, env) in transport_runs(lay, &suite.transports) {
                let label = format!("{name}: {} ranks{nodes}{over}, {mode}", lay.ranks);
                println!("== {label}");
                let mut cmd = vec![
                    bin.display().to_string(),
                    "--include-ignored".into(),
                    "--test-threads=1".into(),
                ];
                cmd.extend(["--nocapture".to_string()]);
                cmd.extend(suite.test_args.iter().cloned());
                let mut args = LaunchArgs::single_host(lay.ranks, cmd);
                args.nodes = lay.nodes;
                args.timeout_s = Some(suite.timeout_s);
                args.share_gpu = share;
                args.gpus = share.then_some(gpus);
                args.env = env;
                let t = Instant::now();
                let ok = match launch::run(args) {
                    Ok(()) => true,
                    Err(e) => {
                        println!("FAILED: {label}: {e:#}");
                        if share {
                            // The launch stopped ranks whose kernels may still run: the MPS
                            // server then handles a fatal GPU error, and clients that start
                            // meanwhile fail at once (CUDA_ERROR_LAUNCH_FAILED or UNKNOWN when
                            // creating their context: seen twice on one H100, 2026-11-26).
                            println!("(waiting {MPS_SETTLE:?} for the MPS server to tear the stopped ranks down)");
                            std::thread::sleep(MPS_SETTLE);
                        }
                        false
                    }
                };
                results.push((label, ok, t.elapsed().as_secs_f64()));
            }
        }
    }
    println!("\n== summary ({gpus} GPU(s) on this host)");
    for (label, ok, secs) in &results {
        println!("{}  {label}  ({secs:.1} s)", if *ok { "PASS" } else { "FAIL" });
    }
    let failed = results.iter().filter(|r| !r.1).count();
    println!("{} passed, {} failed", results.len() - failed, failed);
    Ok(failed == 0)
}

/// The test binaries in `dir` (a bundle's `tests/`), sorted.
pub fn binaries_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn multi_rank_binaries_run_at_two_and_four_ranks() {
        assert_eq!(layouts("tests/mkernel-tests-collectives"), [l(2, 1), l(4, 1)]);
        assert_eq!(layouts("mkernel-tests-collective_timeout"), [l(2, 1), l(4, 1)]);
        assert_eq!(
            layouts("mkernel-tests-collectives_oneshot"),
            [l(2, 1), l(3, 1), l(4, 1)]
        );
        assert_eq!(
            layouts("mkernel-tests-fused_timeout_gemm_rs"),
            [l(2, 1), l(4, 1), l(2, 2), l(4, 2)]
        );
        assert_eq!(layouts("mkernel-tests-internode"), [l(2, 2), l(4, 2)]);
        assert_eq!(layouts("mkernel-tests-moe_ep"), [l(2, 1), l(4, 1), l(2, 2), l(4, 2)]);
        assert_eq!(
            layouts("mkernel-tests-moe_ep_fused"),
            [l(2, 1), l(4, 1), l(2, 2), l(4, 2)]
        );
        assert_eq!(
            layouts("mkernel-tests-ring_attention_timeout"),
            [l(2, 1), l(4, 1), l(2, 2), l(4, 2)]
        );
        assert_eq!(layouts("mkernel-tests-agree"), [l(2, 1), l(4, 1), l(2, 2), l(4, 2)]);
        assert!(layouts("mkernel-tests-ar_internode_order").is_empty());
        assert!(layouts("mkernel-tests-scheduler_order").is_empty());
        assert!(layouts("mkernel-tests-gemm").is_empty());
        assert!(layouts("xtask").is_empty());
    }

    #[test]
    fn transports_multiply_only_the_runs_of_several_nodes() {
        let both = ["default".to_string(), "tcp".to_string()];
        assert_eq!(transport_runs(l(2, 1), &both), vec![(String::new(), vec![])]);
        assert_eq!(transport_runs(l(4, 2), &[]), vec![(String::new(), vec![])]);
        let runs = transport_runs(l(4, 2), &both);
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0], (String::new(), vec![]));
        assert_eq!(
            runs[1],
            (
                " over tcp".to_string(),
                vec![("MKERNEL_TRANSPORT".to_string(), "tcp".to_string())]
            )
        );
    }
}
