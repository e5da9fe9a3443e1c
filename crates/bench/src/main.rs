//! `mkernel-bench --op <op>`: ours beside the vendor baseline, one run, medians, JSON.
//! Usually started as `cargo xtask bench --op gemm` (or `bundle/xtask bench --op gemm` on a GPU
//! host with no Rust).
mod gemm;
mod report;
mod timing;

use anyhow::Result;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Op {
    /// bf16 GEMM, ours vs cuBLAS.
    Gemm,
}

#[derive(Parser, Debug)]
#[command(about = "mkernel benchmarks: ours beside cuBLAS/NCCL from the same run")]
struct Args {
    /// Operation to benchmark.
    #[arg(long, value_enum)]
    op: Op,
    /// Timed iterations per case (the median is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed warm-up iterations per case.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Where to write the JSON results.
    #[arg(long, default_value = "results/bench.json")]
    json: std::path::PathBuf,
    /// Only cases whose label contains this text.
    #[arg(long)]
    filter: Option<String>,
    /// GEMM only: B layout (nk = N x K weights, kn = K x N).
    #[arg(long, default_value = "nk")]
    b_layout: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = mkernel::Device::new(0)?;
    let rows = match args.op {
        Op::Gemm => gemm::run(&dev, &args)?,
    };
    report::write_json(&args.json, &format!("{:?}", args.op).to_lowercase(), &rows)?;
    println!("wrote {}", args.json.display());
    Ok(())
}
