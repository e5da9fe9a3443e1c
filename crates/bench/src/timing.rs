//! Timing with CUDA events: each run between its own pair of events, median reported.
use anyhow::Result;
use cudarc::driver::{sys::CUevent_flags, CudaStream};
use std::sync::Arc;

/// Median milliseconds of each of several competitors, timed interleaved (A B A B ...) so
/// that clocks and temperature drift affect them alike.
pub fn median_ms_interleaved(stream: &Arc<CudaStream>, warmup: usize, iters: usize, fs: &mut [&mut dyn FnMut() -> Result<()>]) -> Result<Vec<f64>> {
    median_ms_aligned(stream, warmup, iters, &mut || Ok(()), fs)
}

/// As [`median_ms_interleaved`], with `align` enqueued before each timed run, outside its
/// events: for multi-rank competitors, a tiny collective that lines the ranks up, so no run
/// is charged for the time its peers still spent on the previous, local one (every rank runs
/// the same sequence, but GPUs differ by a few percent).
pub fn median_ms_aligned(stream: &Arc<CudaStream>, warmup: usize, iters: usize, align: &mut dyn FnMut() -> Result<()>, fs: &mut [&mut dyn FnMut() -> Result<()>]) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        for f in fs.iter_mut() {
            align()?;
            f()?;
        }
    }
    let ctx = stream.context();
    let mut events: Vec<Vec<_>> = (0..fs.len()).map(|_| Vec::with_capacity(iters)).collect();
    for _ in 0..iters {
        for (i, f) in fs.iter_mut().enumerate() {
            align()?;
            let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            start.record(stream)?;
            f()?;
            end.record(stream)?;
            events[i].push((start, end));
        }
    }
    stream.synchronize()?;
    events
        .iter()
        .map(|pairs| {
            let mut ms: Vec<f64> = pairs.iter().map(|(s, e)| s.elapsed_ms(e).map(|x| x as f64)).collect::<Result<_, _>>()?;
            Ok(median(&mut ms))
        })
        .collect()
}

/// Median of a non-empty sample.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) }
}
