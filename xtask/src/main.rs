//! `cargo xtask <task>`: every build, test, benchmark and launch step of mkernel in one place.
//! Run with no arguments for help. Flags are declared once here (clap derive).
mod bundle;
mod launch;
mod ptx;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "mkernel tasks: ptx, test, bundle, bench, launch", arg_required_else_help = true)]
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
    /// Run the tests: CPU tests always; GPU tests with --gpu (they print SKIPPED otherwise).
    /// Also checks the committed PTX against the kernels' source when the device toolchain is installed.
    Test {
        /// Also run the GPU tests (needs a Hopper GPU and its driver).
        #[arg(long)]
        gpu: bool,
    },
    /// Build release test binaries, the benchmark and xtask into bundle/, which runs on a GPU
    /// host with no Rust installed (`bundle/run-tests.sh`, `bundle/xtask bench --op gemm`).
    Bundle,
    /// Run a benchmark: ours beside cuBLAS/NCCL in the same run; prints a table, writes JSON.
    Bench {
        /// gemm (more ops come with their issues).
        #[arg(long)]
        op: String,
        /// Extra arguments for mkernel-bench (e.g. `-- --iters 50 --b-layout kn`).
        #[arg(last = true)]
        rest: Vec<String>,
    },
    /// Start one process per GPU with torchrun-style variables (RANK, LOCAL_RANK, WORLD_SIZE,
    /// LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT, MKERNEL_JOB_KEY).
    Launch(launch::LaunchArgs),
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Ptx { check } => ptx::run(check),
        Task::Test { gpu } => test(gpu),
        Task::Bundle => bundle::run(),
        Task::Bench { op, rest } => bench(&op, &rest),
        Task::Launch(args) => launch::run(args),
    }
}

fn test(gpu: bool) -> Result<()> {
    let root = util::root();
    if ptx::device_toolchain_installed() {
        ptx::run(true)?;
    } else {
        println!("SKIPPED: PTX freshness check (device toolchain {} not installed; .ci/run installs it)", ptx::DEVICE_TOOLCHAIN);
    }
    let mut cmd = util::cargo();
    // --nocapture: GPU tests print SKIPPED (or their measured lines) visibly.
    cmd.current_dir(&root).args(["test", "--workspace", "--release", "--", "--nocapture"]);
    if gpu {
        cmd.env("MKERNEL_GPU_TESTS", "1");
        util::add_cuda_libs(&mut cmd);
    }
    util::run(&mut cmd)?;
    if !gpu {
        println!("NOTE: GPU tests were SKIPPED (CPU-only run); on a Hopper GPU host run `cargo xtask test --gpu` or `bundle/run-tests.sh`");
    }
    Ok(())
}

fn bench(op: &str, rest: &[String]) -> Result<()> {
    // Inside a bundle, the benchmark binary sits next to this executable.
    let here = std::env::current_exe()?;
    let sibling = here.with_file_name("mkernel-bench");
    let mut cmd = if sibling.exists() {
        std::process::Command::new(sibling)
    } else {
        let mut c = util::cargo();
        c.current_dir(util::root()).args(["run", "--quiet", "--release", "-p", "mkernel-bench", "--"]);
        c
    };
    cmd.args(["--op", op]);
    if !rest.iter().any(|a| a == "--json") {
        cmd.args(["--json", &format!("results/{op}.json")]);
    }
    cmd.args(rest);
    util::add_cuda_libs(&mut cmd);
    util::run(&mut cmd)
}
