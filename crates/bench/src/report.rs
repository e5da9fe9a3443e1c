//! Results as JSON (one object per case) beside the printed table.
use anyhow::Result;
use serde_json::{json, Value};
use std::path::Path;

/// Ranks sharing this process's GPU through MPS (`xtask launch --share-gpu` sets
/// `MKERNEL_SHARED_GPU`), when there are several.
pub fn shared_gpu() -> Option<usize> {
    std::env::var("MKERNEL_SHARED_GPU")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 1)
}

/// The banner of a run whose ranks share GPUs: its timings measure MPS time slicing of one GPU,
/// not NVLink or a whole GPU per rank.
pub fn shared_gpu_banner() {
    if let Some(n) = shared_gpu() {
        println!(
            "NOTE: {n} ranks share this GPU through MPS (each with part of its SMs): the timings below are a \
             correctness smoke test, not NVLink timings or one GPU's speed"
        );
    }
}

/// Writes `{ "op": ..., "order": ..., "shared_gpu": ..., "rows": [...] }` (`order`: how the
/// interleaved competitors were ordered in each timed round, `shuffled` or `fixed`;
/// `shared_gpu`: whether ranks shared a GPU, so the timings are not NVLink timings).
pub fn write_json(path: &Path, op: &str, order: &str, rows: &[Value]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let doc = json!({ "op": op, "order": order, "shared_gpu": shared_gpu().is_some(), "rows": rows });
    std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    Ok(())
}
