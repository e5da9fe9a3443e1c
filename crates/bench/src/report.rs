//! Results as JSON (one object per case) beside the printed table.
use anyhow::Result;
use serde_json::{json, Value};
use std::path::Path;

/// Writes `{ "op": ..., "order": ..., "rows": [...] }` (`order`: how the interleaved
/// competitors were ordered in each timed round, `shuffled` or `fixed`).
pub fn write_json(path: &Path, op: &str, order: &str, rows: &[Value]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let doc = json!({ "op": op, "order": order, "rows": rows });
    std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    Ok(())
}
