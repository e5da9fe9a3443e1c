//! Timing with CUDA events: each run between its own pair of events, median reported.
use anyhow::Result;
use cudarc::driver::{sys::CUevent_flags, CudaStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Median milliseconds of each of several competitors, timed interleaved (A B A B ...) so
/// that clocks and temperature drift affect them alike.
pub fn median_ms_interleaved(
    stream: &Arc<CudaStream>,
    warmup: usize,
    iters: usize,
    fs: &mut [&mut dyn FnMut() -> Result<()>],
) -> Result<Vec<f64>> {
    median_ms_aligned(stream, warmup, iters, &mut || Ok(()), fs)
}

/// Whether [`median_ms_aligned`] shuffles the competitors' order in each round (the default;
/// `mkernel-bench --order fixed` turns it off).
static SHUFFLED: AtomicBool = AtomicBool::new(true);

/// Sets the interleaving order of every later timing: shuffled per round, or fixed.
pub fn set_shuffled(on: bool) {
    SHUFFLED.store(on, Ordering::Relaxed);
}

/// The order of `n` competitors in round `round`: a permutation drawn from the round number
/// alone (every rank draws the same: multi-rank competitors run together), or `0..n`.
fn round_order(round: usize, n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if SHUFFLED.load(Ordering::Relaxed) {
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ round as u64;
        for i in (1..n).rev() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, ((x >> 33) % (i as u64 + 1)) as usize);
        }
    }
    order
}

/// As [`median_ms_interleaved`], with `align` enqueued before each timed run, outside its
/// events: for multi-rank competitors, a tiny collective that lines the ranks up, so no run
/// is charged for the time its peers still spent on the previous, local one (every rank runs
/// the same sequence, but GPUs differ by a few percent). Each round runs the competitors in a
/// shuffled order ([`set_shuffled`]): in a fixed order each one always follows the same
/// kernel, and what runs before a kernel changes its time (a GEMM right before another leaves
/// the GPU at its power limit and slows it; `mkernel-bench --contexts` measures this), so a
/// fixed order favors whoever follows the lightest predecessor.
pub fn median_ms_aligned(
    stream: &Arc<CudaStream>,
    warmup: usize,
    iters: usize,
    align: &mut dyn FnMut() -> Result<()>,
    fs: &mut [&mut dyn FnMut() -> Result<()>],
) -> Result<Vec<f64>> {
    for round in 0..warmup {
        for i in round_order(round, fs.len()) {
            align()?;
            fs[i]()?;
        }
    }
    let ctx = stream.context();
    let mut events: Vec<Vec<_>> = (0..fs.len()).map(|_| Vec::with_capacity(iters)).collect();
    for round in 0..iters {
        for i in round_order(warmup + round, fs.len()) {
            let f = &mut fs[i];
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
            let mut ms: Vec<f64> = pairs
                .iter()
                .map(|(s, e)| s.elapsed_ms(e).map(|x| x as f64))
                .collect::<Result<_, _>>()?;
            Ok(median(&mut ms))
        })
        .collect()
}

/// Median of a non-empty sample.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::round_order;

    #[test]
    fn every_round_is_a_permutation_and_predecessors_vary() {
        let mut after = [[0usize; 5]; 5];
        let mut last = None;
        for round in 0..200 {
            let o = round_order(round, 5);
            let mut seen = o.clone();
            seen.sort();
            assert_eq!(seen, (0..5).collect::<Vec<_>>());
            assert_eq!(o, round_order(round, 5), "a round's order depends on the round alone");
            for &i in &o {
                if let Some(p) = last {
                    after[i][p] += 1;
                }
                last = Some(i);
            }
        }
        // Over many rounds each competitor follows each other one about equally often (and
        // itself across a round's boundary now and then).
        for (i, row) in after.iter().enumerate() {
            for (p, &n) in row.iter().enumerate() {
                assert!(if i == p { n > 0 } else { n > 25 }, "{after:?}");
            }
        }
    }
}
