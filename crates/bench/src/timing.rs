//! Timing with CUDA events: each iteration between its own pair of events, median reported.
use anyhow::Result;
use cudarc::driver::{sys::CUevent_flags, CudaStream};
use std::sync::Arc;

/// Median milliseconds of `iters` runs of `f` on `stream` after `warmup` untimed runs.
pub fn median_ms(stream: &Arc<CudaStream>, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let ctx = stream.context();
    let mut pairs = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(stream)?;
        f()?;
        end.record(stream)?;
        pairs.push((start, end));
    }
    stream.synchronize()?;
    let mut ms: Vec<f64> = pairs.iter().map(|(s, e)| s.elapsed_ms(e).map(|x| x as f64)).collect::<Result<_, _>>()?;
    Ok(median(&mut ms))
}

/// Median of a non-empty sample.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) }
}
