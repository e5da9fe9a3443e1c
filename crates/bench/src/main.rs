//! `mkernel-bench --op <op>`: ours beside the vendor baseline, one run, medians, JSON.
//! Usually started as `cargo xtask bench --op gemm` (or `bundle/xtask bench --op gemm` on a GPU
//! host with no Rust).
mod attention;
mod collectives;
mod fused;
mod gemm;
mod gemm_decode;
mod moe;
mod moe_ep;
mod nccl;
mod proxy;
mod report;
mod ring_attention;
mod timing;
mod trace;

use anyhow::Result;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Op {
    /// bf16 GEMM, ours vs cuBLAS.
    Gemm,
    /// AllGather vs NCCL (one process per GPU: run under `xtask launch`).
    Allgather,
    /// ReduceScatter (bf16 sum) vs NCCL.
    Reducescatter,
    /// AllReduce (bf16 sum) vs NCCL.
    Allreduce,
    /// Latency and bandwidth of the GPU -> proxy -> emulated wire path (2 emulated nodes).
    Proxy,
    /// Fused AllGather + GEMM vs NCCL AllGather + cuBLAS in sequence.
    AgGemm,
    /// Fused GEMM + ReduceScatter vs cuBLAS + NCCL ReduceScatter in sequence.
    GemmRs,
    /// Fused GEMM + AllReduce vs cuBLAS + NCCL AllReduce in sequence.
    GemmAr,
    /// MoE expert FFN on one GPU vs a per-expert cuBLAS loop and torch._grouped_mm; with
    /// `--nproc W` the expert-parallel layer vs NCCL all-to-all + grouped GEMM + all-to-all.
    Moe,
    /// FlashAttention forward vs PyTorch SDPA (cuDNN and FlashAttention-2 backends, via python3).
    Attention,
    /// Ring attention forward across ranks vs NCCL send/recv of K/V + our local kernel in sequence.
    RingAttention,
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
    /// Order of the interleaved competitors in each timed round: `shuffled` (a permutation per
    /// round, the same on every rank) or `fixed` (as listed; each always follows the same one).
    #[arg(long, default_value = "shuffled")]
    order: String,
    /// Where to write the JSON results.
    #[arg(long, default_value = "results/bench.json")]
    json: std::path::PathBuf,
    /// Only cases whose label contains this text (fused ops: `MxKxN`, so `8192x` also matches
    /// every `...x8192x8192`; `--ms` selects by M exactly).
    #[arg(long)]
    filter: Option<String>,
    /// Fused ops: only these M (global), e.g. `--ms 4096,8192`.
    #[arg(long, value_delimiter = ',')]
    ms: Vec<usize>,
    /// Fused benchmarks: every shape with this global K instead of its own (a diagnostic:
    /// e.g. one rank at the K per rank of two).
    #[arg(long)]
    k: Option<usize>,
    /// GEMM only: B layout (nk = N x K weights, kn = K x N; with --decode also `both`).
    #[arg(long, default_value = "nk")]
    b_layout: String,
    /// GEMM only: the decode sweep (M = 1..256 over the weight shapes of Llama-class layers,
    /// weights from HBM), with time, ratio to cuBLAS and fraction of the HBM bandwidth.
    #[arg(long)]
    decode: bool,
    /// Collectives: smallest size in bytes.
    #[arg(long, default_value_t = 1024)]
    min_bytes: u64,
    /// Collectives: largest size in bytes.
    #[arg(long, default_value_t = 1 << 30)]
    max_bytes: u64,
    /// Collectives: CTAs of our kernels (default: by size).
    #[arg(long)]
    ctas: Option<u32>,
    /// AllReduce: also time these forced paths beside the policy's choice at every size (`ll`,
    /// `oneshot`, `twoshot`, `bandwidth`, or `all`; a path that cannot carry a size prints `-`).
    #[arg(long, value_delimiter = ',')]
    ar_paths: Vec<String>,
    /// Fused ops and ring attention: append the best SM split (ring attention: comm CTA count) per
    /// shape to this tune cache (`cargo xtask tune`).
    #[arg(long)]
    tune_out: Option<std::path::PathBuf>,
    /// GEMM+RS/AR: also record one launch's per-tile timeline per shape, print its summary and
    /// write the raw words next to the JSON (`<json>.trace-<op>-<M>-r<rank>.bin`).
    #[arg(long)]
    trace: bool,
    /// AllGather+GEMM: comm CTA counts swept (one plan per count and shape).
    #[arg(long, value_delimiter = ',', default_values_t = [2u32, 4, 8, 16])]
    ag_splits: Vec<u32>,
    /// GEMM+RS/AR: parts per row chunk swept (those that divide a chunk's row tiles).
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 2])]
    parts: Vec<u32>,
    /// GEMM+RS/AR: peer-partial paths swept: a number of comm CTAs (0: the compute CTAs store
    /// to the peers themselves) or `pull`.
    #[arg(long, value_delimiter = ',', default_values_t = ["0".to_string(), "4".into(), "8".into(), "pull".into()])]
    paths: Vec<String>,
    /// GEMM+RS/AR: rasterization groups (`group_m`) swept (clamped to a part's row tiles).
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 8, 16])]
    groups: Vec<u32>,
    /// GEMM+RS/AR: stager threads swept (`on`: where they can run - one node of 2 ranks,
    /// pushed without comm CTAs - the consumers' epilogue I/O goes through them; `off`: never).
    #[arg(long, value_delimiter = ',', default_values_t = ["on".to_string(), "off".into()])]
    stagers: Vec<String>,
    /// GEMM+RS/AR stream-K tail (where the stagers run): `on`, `off`, or `ab` (on, and the
    /// chosen plan's twin without it timed beside it in the same interleaved runs).
    #[arg(long, default_value = "on")]
    stream_k: String,
    /// GEMM+RS/AR diagnostic: also time ours right after each other competitor (and back to
    /// back), to see what the preceding kernel costs it.
    #[arg(long)]
    contexts: bool,
    /// MoE (`--nproc`), ring attention and the collectives: leave the NCCL baseline out (ours alone; e.g. where
    /// NCCL cannot be loaded or hangs).
    #[arg(long)]
    no_nccl: bool,
}

/// Runs the benchmark; a failure is one line, `mkernel-bench: error: ...` (no backtrace), and
/// exit status 1.
fn main() -> std::process::ExitCode {
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mkernel-bench: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    timing::set_shuffled(match args.order.as_str() {
        "shuffled" => true,
        "fixed" => false,
        other => anyhow::bail!("--order: `{other}` is neither `shuffled` nor `fixed`"),
    });
    report::shared_gpu_banner();
    if let (Some(path), Some(n)) = (&args.tune_out, report::shared_gpu()) {
        anyhow::bail!(
            "refusing to write the tune cache {}: {n} ranks share this GPU (MPS), so the sweep would pick splits \
             for a fraction of a GPU, not for NVLink peers",
            path.display()
        );
    }
    let rows = match args.op {
        Op::Gemm => gemm::run(&mkernel::Device::new(0)?, &args)?,
        Op::Allgather => collectives::run(&args, collectives::Coll::AllGather)?,
        Op::Reducescatter => collectives::run(&args, collectives::Coll::ReduceScatter)?,
        Op::Allreduce => collectives::run(&args, collectives::Coll::AllReduce)?,
        Op::Proxy => proxy::run(&args)?,
        Op::AgGemm => fused::run(&args)?,
        Op::GemmRs => fused::run_rs(&args)?,
        Op::GemmAr => fused::run_ar(&args)?,
        // Under `xtask launch` (`bench --op moe --nproc W`): expert parallelism over the ranks.
        Op::Moe if std::env::var("RANK").is_ok() => moe_ep::run(&args)?,
        Op::Moe => moe::run(&mkernel::Device::new(0)?, &args)?,
        Op::Attention => attention::run(&mkernel::Device::new(0)?, &args)?,
        Op::RingAttention => ring_attention::run(&args)?,
    };
    // Under launch, rank 0 writes the JSON.
    if std::env::var("RANK").map_or(true, |r| r == "0") {
        report::write_json(&args.json, &format!("{:?}", args.op).to_lowercase(), &args.order, &rows)?;
        println!("wrote {}", args.json.display());
        report::shared_gpu_banner();
    }
    Ok(())
}
