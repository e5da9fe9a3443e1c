//! `cargo xtask launch`: one process per GPU with torchrun-style variables.
//!
//! One host: `launch -n 4 -- prog`; emulated nodes on one host: `launch -n 4 --nodes 2 -- prog`
//! (ranks 0,1 form node 0 and ranks 2,3 node 1; their traffic between nodes goes through the
//! proxy over the emulated wire). Real nodes: run `launch -n 8 --nnodes 2 --node-rank R
//! --master-addr HOST0 --job-key-file PATH -- prog` on each node, PATH holding the same key
//! (or MKERNEL_JOB_KEY set; never a key on the command line, where `ps` shows it), with the
//! TCP transport unless MKERNEL_TRANSPORT asks for another (docs/internode.md).
//!
//! Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, NNODES,
//! MASTER_ADDR, MASTER_PORT, MKERNEL_JOB_KEY (the bootstrap store refuses other keys),
//! MKERNEL_DEVICE (the GPU ordinal to open) and MKERNEL_EMULATED_NODES when nodes are emulated.
//! Output lines are prefixed with `[rank R]`. When a process fails, times out, or the launcher is
//! interrupted (SIGINT/SIGTERM), the others are stopped and the failing rank is named.
//!
//! Ranks sharing GPUs: `launch -n 4 --share-gpu [--gpus G] -- prog` spreads the ranks round-robin
//! over G GPUs (default: the visible ones) and runs them under NVIDIA MPS (`crate::mps`), each with
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` of its GPU and `MKERNEL_SHARED_GPU` = ranks on that GPU
//! (benchmarks mark their results as not NVLink timings). Works with `--nodes K`.
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Processes (GPUs) on this host.
    #[arg(short = 'n', long = "nproc")]
    pub nproc: usize,
    /// Split this host's processes into this many emulated nodes.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Real multi-node: number of nodes (run the same command on each).
    #[arg(long)]
    pub nnodes: Option<usize>,
    /// Real multi-node: this node's index.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0's bootstrap store.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the bootstrap store (default: a free port on one host, 29500 across nodes).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// File holding the job's shared secret on its first line (default: MKERNEL_JOB_KEY, else
    /// random on one host). Never the key itself: arguments are visible to every user in `ps`.
    #[arg(long)]
    pub job_key_file: Option<std::path::PathBuf>,
    /// Stop every process after this many seconds.
    #[arg(long)]
    pub timeout_s: Option<u64>,
    /// Let several ranks share a GPU through NVIDIA MPS (ranks spread round-robin over the GPUs).
    #[arg(long)]
    pub share_gpu: bool,
    /// With --share-gpu: GPUs to spread the ranks over (default: every GPU nvidia-smi lists).
    #[arg(long, requires = "share_gpu")]
    pub gpus: Option<usize>,
    /// With --share-gpu: MPS share of each rank in percent of its GPU's SMs (default: 50 for 2
    /// ranks on a GPU, whose grids use 80% of it; no cap (100) for 3 or more, whose grids use
    /// 80 / ranks - 1 percent of the GPU; docs/testing.md "Co-residency").
    #[arg(long, requires = "share_gpu", value_parser = clap::value_parser!(u32).range(1..=100))]
    pub mps_percent: Option<u32>,
    /// The program needs no GPU: start the ranks without the check for the NVIDIA driver and
    /// enough GPUs that is made otherwise (MKERNEL_DEVICE is set all the same).
    #[arg(long, conflicts_with = "share_gpu")]
    pub cpu_only: bool,
    /// The command to run in each process.
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
    /// Extra variables of every process (set by callers such as the GPU suite, not a flag).
    #[arg(skip)]
    pub env: Vec<(String, String)>,
}

impl LaunchArgs {
    /// `n` processes on this host running `cmd`.
    pub fn single_host(n: usize, cmd: Vec<String>) -> LaunchArgs {
        LaunchArgs {
            nproc: n,
            nodes: 1,
            nnodes: None,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            job_key_file: None,
            timeout_s: None,
            share_gpu: false,
            gpus: None,
            mps_percent: None,
            cpu_only: false,
            cmd,
            env: vec![],
        }
    }
}

/// The variables of one process.
#[derive(Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    pub node_rank: usize,
    pub nnodes: usize,
    pub device: usize,
}

/// Rank layout for `args`: emulated nodes split this host's GPUs; real nodes stack hosts.
/// `shared_gpus`: with `--share-gpu`, the GPUs this host's processes are spread over
/// round-robin (process i on GPU i % G); without it, process i opens GPU i.
pub fn layout(args: &LaunchArgs, shared_gpus: Option<usize>) -> Result<Vec<RankEnv>> {
    if args.nproc == 0 {
        bail!("-n must be at least 1");
    }
    if shared_gpus == Some(0) {
        bail!("--gpus must be at least 1");
    }
    let device = |i: usize| shared_gpus.map_or(i, |g| i % g);
    if let Some(nnodes) = args.nnodes {
        if args.nodes != 1 {
            bail!("--nodes (emulated) and --nnodes (real) cannot be combined");
        }
        if args.node_rank >= nnodes {
            bail!("--node-rank {} must be below --nnodes {}", args.node_rank, nnodes);
        }
        let Some(world_size) = nnodes.checked_mul(args.nproc).filter(|&w| w <= u32::MAX as usize) else {
            bail!(
                "--nnodes {nnodes} x -n {} ranks is more than a job can have",
                args.nproc
            );
        };
        return Ok((0..args.nproc)
            .map(|i| RankEnv {
                rank: args.node_rank * args.nproc + i, // < world_size, checked above
                local_rank: i,
                world_size,
                local_world_size: args.nproc,
                node_rank: args.node_rank,
                nnodes,
                device: device(i),
            })
            .collect());
    }
    if args.nodes == 0 || !args.nproc.is_multiple_of(args.nodes) {
        bail!(
            "-n {} does not split into --nodes {} equal nodes",
            args.nproc,
            args.nodes
        );
    }
    let local = args.nproc / args.nodes;
    Ok((0..args.nproc)
        .map(|r| RankEnv {
            rank: r,
            local_rank: r % local,
            world_size: args.nproc,
            local_world_size: local,
            node_rank: r / local,
            nnodes: args.nodes,
            device: device(r),
        })
        .collect())
}

/// The first line of the key file `path`.
fn read_key_file(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the job key file {}", path.display()))?;
    Ok(text.lines().next().unwrap_or("").to_string())
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Set by SIGINT/SIGTERM: the launch stops its ranks (and the MPS daemon it started) and fails.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

pub fn run(args: LaunchArgs) -> Result<()> {
    // Before any rank starts: the driver and enough GPUs (or --cpu-only), said out loud.
    let found = match args.cpu_only {
        true => None,
        false => Some(crate::gpus::check_launch(args.nproc, args.share_gpu, args.gpus)?),
    };
    let shared_gpus = match (args.share_gpu, args.gpus) {
        (false, _) => None,
        (true, Some(g)) => Some(g),
        (true, None) => Some(found.unwrap_or(1)),
    };
    let ranks = layout(&args, shared_gpus)?;
    // The handler can be installed once per process; a second launch in the same process (the
    // launcher's own tests) keeps the first.
    let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
    // Started before any rank, stopped after every rank is gone (also on errors: `Drop`).
    let mps = match shared_gpus {
        Some(_) => Some(crate::mps::Mps::start()?),
        None => None,
    };
    let per_gpu = |d: usize| ranks.iter().filter(|r| r.device == d).count();
    if let Some(g) = shared_gpus {
        let busiest = (0..g).map(per_gpu).max().unwrap_or(1);
        let pct = args
            .mps_percent
            .unwrap_or_else(|| crate::mps::default_sm_percent(busiest));
        println!(
            "launch: {} ranks sharing {} GPU(s) through MPS, up to {busiest} per GPU at {pct}% of its SMs each, \
             persistent grids on {}% of that (correctness runs: timings are not NVLink timings)",
            ranks.len(),
            g.min(ranks.len()),
            std::env::var("MKERNEL_PERSISTENT_SM_PERCENT")
                .unwrap_or_else(|_| crate::mps::persistent_sm_percent(busiest).to_string())
        );
    }
    let port = match (args.master_port, args.nnodes) {
        (Some(p), _) => p,
        (None, Some(_)) => 29500,
        (None, None) => free_port()?,
    };
    let key = match (&args.job_key_file, std::env::var("MKERNEL_JOB_KEY")) {
        (Some(path), _) => read_key_file(path)?,
        (None, Ok(k)) => k,
        (None, Err(_)) if args.nnodes.is_some() => {
            bail!("multi-node launch needs --job-key-file PATH or MKERNEL_JOB_KEY (the same key on every node)")
        }
        (None, Err(_)) => crate::mps::random_hex(16)?,
    };
    // Killed on every way out of this function, an error while starting a later rank included.
    let mut children = Ranks(vec![]);
    let mut printers = vec![];
    for r in &ranks {
        let mut cmd = Command::new(&args.cmd[0]);
        cmd.args(&args.cmd[1..])
            .env("RANK", r.rank.to_string())
            .env("LOCAL_RANK", r.local_rank.to_string())
            .env("WORLD_SIZE", r.world_size.to_string())
            .env("LOCAL_WORLD_SIZE", r.local_world_size.to_string())
            .env("NODE_RANK", r.node_rank.to_string())
            .env("NNODES", r.nnodes.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("MKERNEL_JOB_KEY", &key)
            .env("MKERNEL_DEVICE", r.device.to_string())
            .env("NCCL_NVLS_ENABLE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Own process group, so stopping a rank also stops what it started.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        if let Some(mps) = &mps {
            mps.configure(&mut cmd);
            let persistent = std::env::var("MKERNEL_PERSISTENT_SM_PERCENT").ok();
            for (k, v) in shared_rank_env(per_gpu(r.device), args.mps_percent, persistent.as_deref()) {
                cmd.env(k, v);
            }
        }
        if args.nodes > 1 {
            cmd.env("MKERNEL_EMULATED_NODES", args.nodes.to_string());
        }
        cmd.envs(args.env.iter().map(|(k, v)| (k, v)));
        if args.nodes > 1 || args.nnodes.is_some_and(|n| n > 1) {
            // The proxy thread (emulated wire, TCP) moves data with CUDA calls in the rank's context.
            // A lazily loaded module (the first cuBLAS call at a new shape) synchronizes that
            // context, which waits for a running fused kernel that waits for the proxy: every
            // module is loaded at start instead (docs/internode.md, "CUDA calls during a fused
            // launch").
            if std::env::var_os("CUDA_MODULE_LOADING").is_none() {
                cmd.env("CUDA_MODULE_LOADING", "EAGER");
            }
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting rank {}: {:?}", r.rank, args.cmd))?;
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let rank = r.rank;
            printers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    println!("[rank {rank}] {line}");
                }
            }));
        }
        children.0.push((r.rank, child));
    }
    let start = Instant::now();
    let mut failed: Option<String> = None;
    let mut running: Vec<bool> = vec![true; children.0.len()];
    while running.iter().any(|&r| r) && failed.is_none() {
        for (i, (rank, child)) in children.0.iter_mut().enumerate() {
            if running[i] {
                if let Some(status) = child.try_wait()? {
                    running[i] = false;
                    if !status.success() {
                        failed = Some(format!("rank {rank} exited with {status}"));
                    }
                }
            }
        }
        if failed.is_none() && INTERRUPTED.load(Ordering::SeqCst) {
            failed = Some("interrupted (SIGINT/SIGTERM)".to_string());
        }
        if let Some(t) = args.timeout_s {
            if failed.is_none() && start.elapsed() > Duration::from_secs(t) {
                let stuck: Vec<usize> = children
                    .0
                    .iter()
                    .zip(&running)
                    .filter(|(_, r)| **r)
                    .map(|((rank, _), _)| *rank)
                    .collect();
                failed = Some(format!("timeout after {t} s; ranks still running: {stuck:?}"));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children.stop_all();
    for p in printers {
        let _ = p.join();
    }
    // Every rank is gone: now the daemon can go too.
    drop(mps);
    match failed {
        Some(why) => bail!("launch failed: {why}; the other ranks were stopped"),
        None => {
            println!("launch: all {} ranks exited successfully", children.0.len());
            Ok(())
        }
    }
}

/// The variables of a rank that shares its GPU with `sharing` ranks (itself included):
/// its MPS share, how many share, and the part of its share its persistent grids use (an
/// explicit `MKERNEL_PERSISTENT_SM_PERCENT` in the launcher's environment wins).
fn shared_rank_env(sharing: usize, mps_percent: Option<u32>, persistent: Option<&str>) -> Vec<(&'static str, String)> {
    let share = mps_percent.unwrap_or_else(|| crate::mps::default_sm_percent(sharing));
    let persistent = persistent.map_or_else(
        || crate::mps::persistent_sm_percent(sharing).to_string(),
        str::to_string,
    );
    vec![
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", share.to_string()),
        ("MKERNEL_SHARED_GPU", sharing.to_string()),
        ("MKERNEL_PERSISTENT_SM_PERCENT", persistent),
    ]
}

/// The rank processes of one launch; those still running are killed (their whole process
/// group) when it is stopped or dropped.
struct Ranks(Vec<(usize, Child)>);

impl Ranks {
    fn stop_all(&mut self) {
        for (_, child) in self.0.iter_mut() {
            if let Ok(None) = child.try_wait() {
                // `kill -s KILL -- -PGID`: procps-ng parses `kill -KILL -PGID` differently (it returned 0
                // without signalling the group, and took down unrelated processes).
                let _ = Command::new("kill")
                    .args(["-s", "KILL", "--", &format!("-{}", child.id())])
                    .status();
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.stop_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn args(n: usize, nodes: usize, nnodes: Option<usize>, node_rank: usize) -> LaunchArgs {
        LaunchArgs {
            nproc: n,
            nodes,
            nnodes,
            node_rank,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            job_key_file: None,
            timeout_s: None,
            share_gpu: false,
            gpus: None,
            mps_percent: None,
            cpu_only: true,
            cmd: vec!["true".into()],
            env: vec![],
        }
    }
    #[test]
    fn shared_ranks_get_their_share_and_grid_size() {
        let env = shared_rank_env(4, None, None);
        assert!(env.contains(&("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100".into())));
        assert!(env.contains(&("MKERNEL_SHARED_GPU", "4".into())));
        assert!(env.contains(&("MKERNEL_PERSISTENT_SM_PERCENT", "19".into())));
        let env = shared_rank_env(2, None, None);
        assert!(env.contains(&("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50".into())));
        assert!(env.contains(&("MKERNEL_PERSISTENT_SM_PERCENT", "80".into())));
        let env = shared_rank_env(2, Some(40), Some("50"));
        assert!(env.contains(&("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40".into())));
        assert!(env.contains(&("MKERNEL_PERSISTENT_SM_PERCENT", "50".into())));
    }
    #[test]
    fn shared_ranks_spread_round_robin() {
        let l = layout(&args(4, 1, None, 0), Some(1)).unwrap();
        assert!(l.iter().all(|r| r.device == 0));
        let l = layout(&args(4, 2, None, 0), Some(2)).unwrap();
        assert_eq!(l.iter().map(|r| r.device).collect::<Vec<_>>(), [0, 1, 0, 1]);
        assert_eq!(l[3].node_rank, 1);
        let l = layout(&args(3, 1, Some(2), 1), Some(2)).unwrap();
        assert_eq!(
            l.iter().map(|r| (r.rank, r.device)).collect::<Vec<_>>(),
            [(3, 0), (4, 1), (5, 0)]
        );
        assert!(layout(&args(2, 1, None, 0), Some(0)).is_err());
    }
    #[test]
    fn a_timed_out_launch_stops_every_rank() {
        let dir = std::env::temp_dir().join(format!("mkernel-launch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut a = args(2, 1, None, 0);
        a.timeout_s = Some(1);
        a.cmd = vec![
            "sh".into(),
            "-c".into(),
            format!("echo $$ > {}/$RANK; exec sleep 60", dir.display()),
        ];
        let e = run(a).unwrap_err().to_string();
        assert!(e.contains("timeout") && e.contains("[0, 1]"), "{e}");
        for r in 0..2 {
            let pid = std::fs::read_to_string(dir.join(r.to_string())).unwrap();
            assert!(
                !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists(),
                "rank {r} (pid {pid}) still runs"
            );
        }
        let _ = std::fs::remove_dir_all(dir);
    }
    #[test]
    fn emulated_nodes_split_one_host() {
        let l = layout(&args(4, 2, None, 0), None).unwrap();
        assert_eq!(
            l[3],
            RankEnv {
                rank: 3,
                local_rank: 1,
                world_size: 4,
                local_world_size: 2,
                node_rank: 1,
                nnodes: 2,
                device: 3
            }
        );
        assert!(layout(&args(3, 2, None, 0), None).is_err());
    }
    #[test]
    fn real_nodes_stack_hosts() {
        let l = layout(&args(8, 1, Some(2), 1), None).unwrap();
        assert_eq!(l[0].rank, 8);
        assert_eq!(l[0].world_size, 16);
        assert_eq!(l[7].local_rank, 7);
        assert!(layout(&args(8, 1, Some(2), 2), None).is_err());
        assert!(layout(&args(usize::MAX / 2, 1, Some(3), 0), None).is_err());
    }
    #[test]
    fn a_failing_rank_is_named_and_others_stopped() {
        let mut a = args(2, 1, None, 0);
        a.cmd = vec![
            "sh".into(),
            "-c".into(),
            "if [ $RANK = 1 ]; then exit 3; fi; sleep 30".into(),
        ];
        let e = run(a).unwrap_err().to_string();
        assert!(e.contains("rank 1"), "{e}");
    }
    #[test]
    fn the_job_key_comes_from_a_file() {
        let path = std::env::temp_dir().join(format!("mkernel-launch-key-{}", crate::mps::random_hex(8).unwrap()));
        std::fs::write(&path, "key-from-a-file-0123456789\nignored\n").unwrap();
        let mut a = args(2, 1, None, 0);
        a.job_key_file = Some(path.clone());
        a.cmd = vec![
            "sh".into(),
            "-c".into(),
            "test \"$MKERNEL_JOB_KEY\" = key-from-a-file-0123456789".into(),
        ];
        run(a).unwrap();
        std::fs::remove_file(&path).unwrap();
        let mut a = args(1, 1, None, 0);
        a.job_key_file = Some(path);
        assert!(run(a).unwrap_err().to_string().contains("job key file"));
    }
    #[test]
    fn extra_variables_reach_every_rank() {
        let mut a = args(2, 2, None, 0);
        a.env = vec![("MKERNEL_TRANSPORT".into(), "tcp".into())];
        a.cmd = vec!["sh".into(), "-c".into(), "test \"$MKERNEL_TRANSPORT\" = tcp".into()];
        run(a).unwrap();
        let mut a = args(2, 2, None, 0);
        a.cmd = vec!["sh".into(), "-c".into(), "test \"$MKERNEL_TRANSPORT\" = tcp".into()];
        std::env::remove_var("MKERNEL_TRANSPORT");
        assert!(run(a).is_err());
    }
}
