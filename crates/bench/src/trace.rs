//! `--trace`: the per-tile timeline of one fused GEMM+ReduceScatter/AllReduce launch
//! ([`mkernel_config::trace`]), summarized: where a compute CTA's time goes.
use mkernel_config::trace::{tile_kind, End, Mark, TILES_PER_CTA, WORDS_PER_TILE};
use serde_json::{json, Value};

/// One recorded tile.
struct TileRec {
    w: [u64; WORDS_PER_TILE as usize],
}

impl TileRec {
    fn at(&self, m: Mark) -> u64 {
        self.w[m as usize]
    }
    fn kind(&self) -> u32 {
        (self.at(Mark::Tile) & 3) as u32
    }
    /// Nanoseconds from `a` to `b` (0 when either was not stamped).
    fn span(&self, a: Mark, b: Mark) -> f64 {
        let (x, y) = (self.at(a), self.at(b));
        if x == 0 || y < x {
            0.0
        } else {
            (y - x) as f64
        }
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Summary of a trace buffer of `ctas` CTAs (times in microseconds from the earliest stamp):
/// mean phase durations of peer and own tiles, and when the CTAs started, ended their tile
/// loop and ended the launch. Prints it under `label`.
pub fn summarize(label: &str, words: &[u64], ctas: usize) -> Value {
    let per_cta = (TILES_PER_CTA + 1) as usize * WORDS_PER_TILE as usize;
    let mut tiles: Vec<Vec<TileRec>> = vec![];
    let mut ends = vec![];
    for c in 0..ctas {
        let base = &words[c * per_cta..(c + 1) * per_cta];
        let recs: Vec<TileRec> = base
            .chunks(WORDS_PER_TILE as usize)
            .take(TILES_PER_CTA as usize)
            .map(|w| TileRec {
                w: w.try_into().expect("record length"),
            })
            .take_while(|r| r.at(Mark::Begin) != 0)
            .collect();
        let end = &base[TILES_PER_CTA as usize * WORDS_PER_TILE as usize..];
        ends.push([
            end[End::LoopDone as usize],
            end[End::Drained as usize],
            end[End::Done as usize],
            end[End::Entry as usize],
            end[End::Setup as usize],
            end[End::Stager0Done as usize].max(end[End::Stager1Done as usize]),
            end[End::RelayDone as usize],
            end[End::Exit as usize],
        ]);
        tiles.push(recs);
    }
    let t0 = tiles
        .iter()
        .filter_map(|r| r.first().map(|t| t.at(Mark::Begin)))
        .min()
        .unwrap_or(0);
    let us = |t: u64| if t == 0 { f64::NAN } else { (t - t0) as f64 / 1e3 };
    let phases = [
        ("prologue", Mark::Begin, Mark::Mainloop),
        ("mainloop", Mark::Mainloop, Mark::MainloopDone),
        ("publish", Mark::MainloopDone, Mark::Published),
        ("wait", Mark::Published, Mark::Waited),
        ("add", Mark::Waited, Mark::Added),
    ];
    let mut out = serde_json::Map::new();
    println!("# trace {label}: {ctas} CTAs, mean us per tile (peer / own tiles)");
    for (kind, name) in [
        (tile_kind::PEER, "peer"),
        (tile_kind::OWN, "own"),
        (tile_kind::PIECE, "piece"),
    ] {
        let own = kind == tile_kind::OWN;
        let sel: Vec<&TileRec> = tiles.iter().flatten().filter(|t| t.kind() == kind).collect();
        if sel.is_empty() && kind == tile_kind::PIECE {
            continue;
        }
        let mut line = format!("#   {name:>5} tiles {:>5}:", sel.len());
        let mut obj = serde_json::Map::new();
        for (name, a, b) in phases {
            let v = mean(&sel.iter().map(|t| t.span(a, b) / 1e3).collect::<Vec<_>>());
            line += &format!(" {name} {v:.2}");
            obj.insert(name.into(), json!(v));
        }
        // The store: from the last stamp before it to the tile's end.
        let store = mean(
            &sel.iter()
                .map(|t| t.span(if own { Mark::Added } else { Mark::Waited }, Mark::Stored) / 1e3)
                .collect::<Vec<_>>(),
        );
        let total = mean(
            &sel.iter()
                .map(|t| t.span(Mark::Begin, Mark::Stored) / 1e3)
                .collect::<Vec<_>>(),
        );
        // The SM clock during the mainloops: their cycles over their nanoseconds.
        let (cyc, ns) = sel
            .iter()
            .filter(|t| t.at(Mark::MainloopClock) != 0 && t.at(Mark::MainloopDoneClock) > t.at(Mark::MainloopClock))
            .fold((0f64, 0f64), |(c, n), t| {
                (
                    c + (t.at(Mark::MainloopDoneClock) - t.at(Mark::MainloopClock)) as f64,
                    n + t.span(Mark::Mainloop, Mark::MainloopDone),
                )
            });
        let mhz = if ns > 0.0 { cyc / ns * 1e3 } else { 0.0 };
        let kcycles = if sel.is_empty() {
            0.0
        } else {
            cyc / sel.len() as f64 / 1e3
        };
        line += &format!(" store {store:.2} | tile {total:.2} | mainloop {kcycles:.1} kcycles at {mhz:.0} MHz");
        obj.insert("mainloop_mhz".into(), json!(mhz));
        obj.insert("mainloop_kcycles".into(), json!(kcycles));
        obj.insert("store".into(), json!(store));
        obj.insert("tile".into(), json!(total));
        println!("{line}");
        out.insert(name.into(), Value::Object(obj));
    }
    // Per round (the i-th tile of every CTA): when it began, its mainloops' cycles and clock,
    // and the longest wait at its epilogue - where a launch loses time round by round.
    let rounds = tiles.iter().map(|r| r.len()).max().unwrap_or(0);
    let mut per_round = vec![];
    for i in 0..rounds {
        let sel: Vec<&TileRec> = tiles.iter().filter_map(|r| r.get(i)).collect();
        let timed: Vec<&&TileRec> = sel
            .iter()
            .filter(|t| t.at(Mark::MainloopDoneClock) > t.at(Mark::MainloopClock) && t.at(Mark::MainloopClock) != 0)
            .collect();
        let cyc: f64 = timed
            .iter()
            .map(|t| (t.at(Mark::MainloopDoneClock) - t.at(Mark::MainloopClock)) as f64)
            .sum();
        let ns: f64 = timed.iter().map(|t| t.span(Mark::Mainloop, Mark::MainloopDone)).sum();
        let begin = sel.iter().map(|t| us(t.at(Mark::Begin))).fold(f64::NAN, f64::min);
        let wait = sel
            .iter()
            .map(|t| t.span(Mark::Published, Mark::Waited) / 1e3)
            .fold(0.0, f64::max);
        let kcycles = if timed.is_empty() {
            0.0
        } else {
            cyc / timed.len() as f64 / 1e3
        };
        let mhz = if ns > 0.0 { cyc / ns * 1e3 } else { 0.0 };
        per_round.push(json!({ "tiles": sel.len(), "begin_us": begin, "mainloop_kcycles": kcycles, "mainloop_mhz": mhz, "max_wait_us": wait }));
    }
    println!(
        "#   per round (begin us / mainloop k cycles @ MHz / longest epilogue wait us): {}",
        per_round
            .iter()
            .map(|r| format!(
                "{:.0}/{:.1}@{:.0}/{:.1}",
                r["begin_us"].as_f64().unwrap_or(0.0),
                r["mainloop_kcycles"].as_f64().unwrap_or(0.0),
                r["mainloop_mhz"].as_f64().unwrap_or(0.0),
                r["max_wait_us"].as_f64().unwrap_or(0.0)
            ))
            .collect::<Vec<_>>()
            .join(" ")
    );
    out.insert("rounds".into(), json!(per_round));
    // Gaps between a tile's end and the next tile's begin (should be ~0).
    let gaps: Vec<f64> = tiles
        .iter()
        .flat_map(|r| {
            r.windows(2)
                .map(|p| p[1].at(Mark::Begin).saturating_sub(p[0].at(Mark::Stored)) as f64 / 1e3)
        })
        .collect();
    let starts: Vec<f64> = tiles
        .iter()
        .filter_map(|r| r.first().map(|t| us(t.at(Mark::Begin))))
        .collect();
    let loop_done: Vec<f64> = ends.iter().map(|e| us(e[0])).collect();
    let done: Vec<f64> = ends.iter().map(|e| us(e[2])).collect();
    let counts: Vec<f64> = tiles.iter().map(|r| r.len() as f64).collect();
    // Before the first tile: kernel entry and the end of the CTAs' setup (negative: before t0).
    let rel = |t: u64| if t == 0 { f64::NAN } else { (t as f64 - t0 as f64) / 1e3 };
    let entry: Vec<f64> = ends.iter().map(|e| rel(e[3])).collect();
    let setup: Vec<f64> = ends.iter().map(|e| rel(e[4])).collect();
    let mx = |v: &[f64]| v.iter().cloned().fold(f64::NAN, f64::max);
    let mn = |v: &[f64]| v.iter().cloned().fold(f64::NAN, f64::min);
    println!("#   tiles per CTA {}-{}; gap between tiles mean {:.2}; CTA start max {:.1}; loop end min/median/max {:.1}/{:.1}/{:.1}; launch end min/median/max {:.1}/{:.1}/{:.1}",
        mn(&counts), mx(&counts), mean(&gaps), mx(&starts), mn(&loop_done), median(loop_done.clone()), mx(&loop_done), mn(&done), median(done.clone()), mx(&done));
    println!(
        "#   CTA entry min/max {:.1}/{:.1}, setup done min/max {:.1}/{:.1} (us from the first tile)",
        mn(&entry),
        mx(&entry),
        mn(&setup),
        mx(&setup)
    );
    // Where stagers and relays run: when their last stores completed and their last flag rose.
    let stager_done: Vec<f64> = ends.iter().filter(|e| e[5] != 0).map(|e| us(e[5])).collect();
    let relay_done: Vec<f64> = ends.iter().filter(|e| e[6] != 0).map(|e| us(e[6])).collect();
    // The launch's last warp (its end-of-launch work done), from the first CTA's entry.
    if let Some(exit) = ends.iter().map(|e| e[7]).filter(|&t| t != 0).max() {
        let first_entry = ends.iter().map(|e| e[3]).filter(|&t| t != 0).min().unwrap_or(exit);
        let span = exit.saturating_sub(first_entry) as f64 / 1e3;
        println!(
            "#   the launch's last warp finished {:.1} us after the first CTA's entry",
            span
        );
        out.insert("stamped_span_us".into(), json!(span));
    }
    if !stager_done.is_empty() || !relay_done.is_empty() {
        println!(
            "#   stagers' last stores done min/median/max {:.1}/{:.1}/{:.1}; relays' last flag max {:.1}",
            mn(&stager_done),
            median(stager_done.clone()),
            mx(&stager_done),
            mx(&relay_done)
        );
        out.insert(
            "stager_done_us".into(),
            json!([mn(&stager_done), median(stager_done.clone()), mx(&stager_done)]),
        );
        out.insert("relay_done_us".into(), json!(mx(&relay_done)));
    }
    out.insert("entry_us".into(), json!([mn(&entry), mx(&entry)]));
    out.insert("setup_us".into(), json!([mn(&setup), mx(&setup)]));
    out.insert("gap_mean_us".into(), json!(mean(&gaps)));
    out.insert(
        "loop_end_us".into(),
        json!([mn(&loop_done), median(loop_done.clone()), mx(&loop_done)]),
    );
    out.insert(
        "launch_end_us".into(),
        json!([mn(&done), median(done.clone()), mx(&done)]),
    );
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two CTAs of two tiles each, 50 us apart, mainloops of 40 us at 1.5 GHz: the summary's
    /// per-round entries and the launch end come out of the raw words.
    #[test]
    fn summary_reads_rounds_and_ends() {
        let ctas = 2;
        let per_cta = (TILES_PER_CTA + 1) as usize * WORDS_PER_TILE as usize;
        let mut w = vec![0u64; ctas * per_cta];
        let base = 1_000_000u64;
        for c in 0..ctas {
            for i in 0..2u64 {
                let t = base + i * 50_000 + c as u64 * 100;
                let rec = &mut w[c * per_cta + i as usize * WORDS_PER_TILE as usize..][..WORDS_PER_TILE as usize];
                rec[Mark::Begin as usize] = t;
                rec[Mark::Mainloop as usize] = t + 500;
                rec[Mark::MainloopDone as usize] = t + 40_500;
                rec[Mark::Published as usize] = t + 40_600;
                rec[Mark::Waited as usize] = t + 41_600 + i * 1_000;
                rec[Mark::Added as usize] = t + 41_700 + i * 1_000;
                rec[Mark::Stored as usize] = t + 43_000 + i * 1_000;
                rec[Mark::Tile as usize] = tile_kind::OWN as u64;
                rec[Mark::MainloopClock as usize] = 1_000;
                rec[Mark::MainloopDoneClock as usize] = 1_000 + 60_000;
            }
            let end =
                &mut w[c * per_cta + TILES_PER_CTA as usize * WORDS_PER_TILE as usize..][..WORDS_PER_TILE as usize];
            end[End::LoopDone as usize] = base + 95_000;
            end[End::Done as usize] = base + 96_000 + c as u64 * 1_000;
        }
        let s = summarize("test", &w, ctas);
        let rounds = s["rounds"].as_array().expect("per-round entries");
        assert_eq!(rounds.len(), 2);
        assert!((rounds[1]["begin_us"].as_f64().unwrap() - 50.0).abs() < 1e-9);
        assert!((rounds[0]["mainloop_kcycles"].as_f64().unwrap() - 60.0).abs() < 1e-9);
        assert!((rounds[0]["mainloop_mhz"].as_f64().unwrap() - 1500.0).abs() < 1e-6);
        assert!((rounds[1]["max_wait_us"].as_f64().unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(s["launch_end_us"][2].as_f64().unwrap(), 97.0);
    }
}
