//! `cargo xtask <task>`: every build, test, benchmark and launch step of mkernel in one place.
//! Run with no arguments for help. Flags are declared once here (clap derive); the first line
//! of the help names the tasks from the same declarations. A failing task prints one line,
//! `error: ...` (the anyhow chain, no backtrace), and exits with status 1.
mod bundle;
mod gpu_tests;
mod gpus;
mod launch;
mod mps;
mod ptx;
mod sanitize;
mod util;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "cargo xtask", arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build crates/device to PTX (nightly + rustc's nvptx64 backend), store it in
    /// crates/host/ptx/mkernel.ptx and print every kernel's registers, spills and shared memory
    /// from `ptxas -v`.
    Ptx {
        /// Do not write: fail if the committed PTX differs from a fresh build, or any kernel spills.
        #[arg(long)]
        check: bool,
    },
    /// Run the tests: CPU tests always; GPU tests with --gpu (a CPU run reports them as ignored),
    /// then the multi-rank binaries under `launch` (sharing GPUs where they are fewer than ranks).
    /// Also checks the committed PTX against the kernels' source when the device toolchain is installed.
    Test {
        /// Also run the GPU tests (needs a Hopper GPU and its driver).
        #[arg(long)]
        gpu: bool,
    },
    /// Build release test binaries, the benchmark and xtask into bundle/, which runs on a GPU
    /// host with no Rust installed (`bundle/run-tests.sh`, `bundle/xtask bench --op gemm`).
    Bundle {
        /// Leave these workspace packages' tests out (e.g. one that is mid-change).
        #[arg(long)]
        exclude: Vec<String>,
        /// Build only the benchmark and xtask, on kernels compiled with
        /// `--cfg mk_variant="NAME"`, into bundle/NAME/ (the rest of bundle/ stays), for an A/B
        /// run beside the plain build: `bundle/NAME/xtask bench ...`.
        #[arg(long, value_name = "NAME")]
        variant: Option<String>,
    },
    /// Run a benchmark: ours beside cuBLAS/NCCL in the same run; prints a table, writes JSON.
    Bench {
        /// gemm | allgather | reducescatter | allreduce | proxy | ag-gemm | gemm-rs | gemm-ar | moe | attention |
        /// ring-attention
        #[arg(long)]
        op: String,
        /// Collectives: processes (GPUs) to launch (default: every GPU nvidia-smi lists).
        #[arg(long)]
        nproc: Option<usize>,
        /// Let the ranks share GPUs through MPS (automatic when --nproc exceeds the GPUs): a
        /// correctness smoke run, marked `"shared_gpu": true`, not an NVLink timing.
        #[arg(long)]
        share_gpu: bool,
        /// Multi-rank benchmarks: stop every rank after this many seconds and name the ones still
        /// running (NCCL's waits have no bound of their own).
        #[arg(long)]
        timeout_s: Option<u64>,
        /// Extra arguments for mkernel-bench (e.g. `-- --iters 50 --b-layout kn`).
        #[arg(last = true)]
        rest: Vec<String>,
    },
    /// Search the SM split of a fused op or ring attention per shape (the benchmark's sweep) and
    /// store the best in the tune cache the library reads (`$MKERNEL_TUNE_FILE`, else
    /// `mkernel-tune.txt`).
    Tune {
        /// ag-gemm | gemm-rs | gemm-ar | ring-attention
        #[arg(long)]
        op: String,
        /// Processes (GPUs) to launch (default: every GPU nvidia-smi lists).
        #[arg(long)]
        nproc: Option<usize>,
        /// Extra arguments for mkernel-bench (e.g. `-- --filter 16384`).
        #[arg(last = true)]
        rest: Vec<String>,
    },
    /// The GPU suite over built test binaries (what `bundle/run-tests.sh` runs): single-process
    /// binaries once, multi-rank ones under `launch` at 2 and 4 ranks and as emulated nodes,
    /// sharing GPUs through MPS where the host has fewer GPUs than ranks.
    GpuTests {
        /// Folder of test binaries (a bundle's `tests/`).
        #[arg(long, default_value = "tests")]
        dir: std::path::PathBuf,
        /// Only binaries whose name contains this (repeatable).
        #[arg(long)]
        only: Vec<String>,
        /// Multi-rank binaries only at these rank counts (e.g. `--ranks 2,4`).
        #[arg(long, value_delimiter = ',')]
        ranks: Vec<usize>,
        /// Multi-rank binaries only in layouts of these emulated node counts (e.g. `--nodes 2`
        /// with `--transport tcp`: only the runs that cross nodes).
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<usize>,
        /// Limit of each multi-rank launch.
        #[arg(long, default_value_t = 300)]
        timeout_s: u64,
        /// Runs of several emulated nodes (internode*, fused* at 2 x 2) once per transport listed
        /// here, with MKERNEL_TRANSPORT set to it: `default` (the variable left as is: the
        /// emulated wire), `emulated`, `tcp` (e.g. `--transport default,tcp`).
        #[arg(long, value_delimiter = ',')]
        transport: Vec<String>,
        /// Arguments for every test binary.
        #[arg(last = true)]
        rest: Vec<String>,
    },
    /// compute-sanitizer (memcheck, racecheck, synccheck) over the single-GPU kernel test
    /// binaries of a bundle (GPU host): every run must end with `ERROR SUMMARY: 0 errors`.
    Sanitize {
        /// Folder of test binaries (a bundle's `tests/`).
        #[arg(long, default_value = "tests")]
        dir: std::path::PathBuf,
        /// Tools to run.
        #[arg(long, value_delimiter = ',', default_values_t = sanitize::TOOLS.map(String::from))]
        tools: Vec<String>,
    },
    /// Start one process per GPU with torchrun-style variables (RANK, LOCAL_RANK, WORLD_SIZE,
    /// LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT, MKERNEL_JOB_KEY), after checking
    /// for the NVIDIA driver and enough GPUs (`--share-gpu` when they are fewer than ranks,
    /// `--cpu-only` for programs that need none).
    Launch(launch::LaunchArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::from_arg_matches(&command().get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    match run(cli.task) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The command line: the derived one, its first help line naming every task, and (for help)
/// where the workspace and its build output are.
fn command() -> clap::Command {
    let cmd = Cli::command().bin_name("cargo xtask");
    let tasks: Vec<String> = cmd
        .get_subcommands()
        .map(|t| t.get_name().to_string())
        .filter(|t| t != "help")
        .collect();
    let cmd = cmd.about(format!("mkernel's tasks: {}", tasks.join(", ")));
    let args: Vec<String> = std::env::args().skip(1).collect();
    let wants_help = args.is_empty() || args.iter().any(|a| a == "-h" || a == "--help" || a == "help");
    if !wants_help {
        return cmd;
    }
    let target = match util::target_dir() {
        Ok(t) => t.display().to_string(),
        Err(e) => format!("unknown ({e:#})"),
    };
    cmd.after_help(format!(
        "Workspace: {}\nTarget directory: {target} (`cargo metadata`: CARGO_TARGET_DIR, build.target-dir or target/)",
        util::root().display()
    ))
}

fn run(task: Task) -> Result<()> {
    match task {
        Task::Ptx { check } => ptx::run(check),
        Task::Test { gpu } => test(gpu),
        Task::Bundle { exclude, variant: None } => bundle::run(&exclude),
        Task::Bundle {
            variant: Some(name), ..
        } => bundle::variant(&name),
        Task::Bench {
            op,
            nproc,
            share_gpu,
            timeout_s,
            rest,
        } => bench(&op, nproc, share_gpu, timeout_s, &rest),
        Task::Launch(args) => launch::run(args),
        Task::Sanitize { dir, tools } => sanitize::run(&dir, &tools),
        Task::GpuTests {
            dir,
            only,
            ranks,
            nodes,
            timeout_s,
            transport,
            rest,
        } => {
            let suite = gpu_tests::Suite {
                binaries: gpu_tests::binaries_in(&dir)?,
                only,
                ranks,
                nodes,
                timeout_s,
                test_args: rest,
                transports: transport,
            };
            anyhow::ensure!(gpu_tests::run(&suite)?, "GPU tests failed (summary above)");
            Ok(())
        }
        Task::Tune { op, nproc, rest } => {
            anyhow::ensure!(
                matches!(op.as_str(), "ag-gemm" | "gemm-rs" | "gemm-ar" | "ring-attention"),
                "tune --op must be ag-gemm, gemm-rs, gemm-ar or ring-attention"
            );
            let file = std::env::var("MKERNEL_TUNE_FILE").unwrap_or_else(|_| "mkernel-tune.txt".into());
            let file = std::path::absolute(&file)?.display().to_string();
            let mut rest = rest;
            rest.extend(["--tune-out".to_string(), file]);
            bench(&op, nproc, false, None, &rest)
        }
    }
}

fn test(gpu: bool) -> Result<()> {
    let root = util::root();
    if ptx::device_toolchain_installed() {
        ptx::run(true)?;
    } else {
        println!(
            "SKIPPED: PTX freshness check (device toolchain {} not installed; .ci/run installs it)",
            ptx::DEVICE_TOOLCHAIN
        );
    }
    let mut cmd = util::cargo();
    // --nocapture: the GPU tests' measured lines (and a multi-rank test's SKIPPED when it was
    // not launched as ranks) are visible.
    cmd.current_dir(&root)
        .args(["test", "--workspace", "--release", "--", "--nocapture"]);
    if gpu {
        // GPU tests are `#[ignore = "needs a Hopper GPU"]`, so that a CPU run reports them as ignored.
        cmd.arg("--include-ignored");
        cmd.env("MKERNEL_GPU_TESTS", "1");
        util::add_cuda_libs(&mut cmd);
    }
    util::run(&mut cmd)?;
    if gpu {
        // The multi-rank binaries printed SKIPPED above (not launched as ranks): now under launch.
        let binaries: Vec<_> = bundle::test_binaries(&[])?
            .into_iter()
            .filter(|(name, _)| !gpu_tests::layouts(name).is_empty())
            .map(|(_, path)| path)
            .collect();
        std::env::set_var("MKERNEL_GPU_TESTS", "1");
        std::env::set_var("LD_LIBRARY_PATH", util::cuda_lib_path());
        let suite = gpu_tests::Suite {
            binaries,
            only: vec![],
            ranks: vec![],
            nodes: vec![],
            timeout_s: 300,
            test_args: vec![],
            // The layouts of several emulated nodes over both wires a single host can run.
            transports: vec!["default".into(), "tcp".into()],
        };
        anyhow::ensure!(gpu_tests::run(&suite)?, "multi-rank GPU tests failed (summary above)");
    }
    if !gpu {
        println!("NOTE: GPU tests are ignored in a CPU-only run; on a Hopper GPU host run `cargo xtask test --gpu` or `bundle/run-tests.sh`");
    }
    Ok(())
}

fn bench(op: &str, nproc: Option<usize>, share_gpu: bool, timeout_s: Option<u64>, rest: &[String]) -> Result<()> {
    // Every benchmark needs a GPU: say what is missing before building anything.
    let found = gpus::probe().map_err(|e| anyhow::anyhow!("bench: {e:#}"))?;
    println!("bench: {}", found.summary());
    // Inside a bundle, the benchmark binary sits next to this executable.
    let here = std::env::current_exe()?;
    let sibling = here.with_file_name("mkernel-bench");
    let bin = if sibling.exists() {
        sibling
    } else {
        util::run(util::cargo().current_dir(util::root()).args([
            "build",
            "--quiet",
            "--release",
            "-p",
            "mkernel-bench",
        ]))?;
        util::release_dir()?.join("mkernel-bench")
    };
    let mut argv: Vec<String> = vec![bin.display().to_string(), "--op".into(), op.into()];
    if !rest.iter().any(|a| a == "--json") {
        argv.extend(["--json".into(), format!("results/{op}.json")]);
    }
    argv.extend(rest.iter().cloned());
    // MoE runs on one GPU (grouped expert FFN) unless --nproc asks for ranks.
    let multi_rank = matches!(
        op,
        "allgather" | "reducescatter" | "allreduce" | "proxy" | "ag-gemm" | "gemm-rs" | "gemm-ar" | "ring-attention"
    ) || (op == "moe" && nproc.is_some());
    if multi_rank && std::env::var("RANK").is_err() {
        let n = match nproc {
            Some(n) => n,
            None => util::gpu_count()?,
        };
        std::env::set_var("LD_LIBRARY_PATH", util::cuda_lib_path());
        let mut launch_args = launch::LaunchArgs::single_host(n, argv);
        launch_args.timeout_s = timeout_s;
        let gpus = util::gpu_count().unwrap_or(0);
        if share_gpu || n > gpus {
            if !share_gpu {
                println!("bench: {n} ranks on {gpus} GPU(s): the ranks share the GPUs through MPS");
            }
            launch_args.share_gpu = true;
            launch_args.gpus = Some(gpus.max(1));
        }
        if op == "proxy" {
            launch_args.nodes = 2; // emulated nodes: the inter-node path
        }
        return launch::run(launch_args);
    }
    let mut cmd = std::process::Command::new(&argv[0]);
    cmd.args(&argv[1..]);
    util::add_cuda_libs(&mut cmd);
    util::run(&mut cmd)
}
