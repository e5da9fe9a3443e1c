//! The SM-split cache of the fused operations and ring attention.
//!
//! `cargo xtask tune --op ag-gemm|gemm-rs|gemm-ar|ring-attention` runs the benchmark's split sweep
//! and writes the best split per shape to a plain-text file, one entry per line:
//! `<op> <world> <m> <n> <k> <split>` (`#` starts a comment). Plans given a split of 0 look their
//! shape up here (file: `$MKERNEL_TUNE_FILE`, else `mkernel-tune.txt` in the working directory)
//! and fall back to the op's default ([`default_split`]). Ring attention's entries are keyed by
//! `mkernel::ops::ring_attention::tune_key` (op `ring-attention-d<D>-kv<Hkv>[-causal]`, m = batch,
//! n = rows per rank, k = query heads) and hold the comm CTA count; its plans look them up when
//! `RingOptions::comm_ctas` is `None` and otherwise use `ring_roles`' default.

use std::path::PathBuf;

/// AllGather+GEMM's split when the cache has no entry for a shape: 4 comm CTAs (the sweep's
/// choice on 2 GPUs; 4 GPUs choose more, docs/fused.md).
pub const DEFAULT_SPLIT: u32 = 4;
/// GEMM+ReduceScatter/AllReduce's `parts` when the cache has no entry: 1, valid for every shape
/// and the best on 2 x H200.
pub const DEFAULT_PARTS: u32 = 1;

/// The split a plan of `op` uses when given 0 and the cache has no entry.
pub fn default_split(op: &str) -> u32 {
    if op == "ag-gemm" {
        DEFAULT_SPLIT
    } else {
        DEFAULT_PARTS
    }
}

/// One cache entry's key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TuneKey {
    pub op: String,
    pub world: u32,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Where the cache lives.
pub fn tune_file() -> PathBuf {
    std::env::var_os("MKERNEL_TUNE_FILE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("mkernel-tune.txt"))
}

/// Parses cache text; malformed lines are skipped (the cache is advisory).
pub fn parse(text: &str) -> Vec<(TuneKey, u32)> {
    text.lines()
        .filter_map(|line| {
            let line = line.split('#').next()?.trim();
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() != 6 {
                return None;
            }
            let key = TuneKey {
                op: f[0].to_string(),
                world: f[1].parse().ok()?,
                m: f[2].parse().ok()?,
                n: f[3].parse().ok()?,
                k: f[4].parse().ok()?,
            };
            Some((key, f[5].parse().ok()?))
        })
        .collect()
}

/// Renders entries back to cache text (later entries for the same key win when read).
pub fn render(entries: &[(TuneKey, u32)]) -> String {
    let mut s = String::from("# op world m n k split   (written by `cargo xtask tune`)\n");
    for (k, v) in entries {
        s.push_str(&format!("{} {} {} {} {} {}\n", k.op, k.world, k.m, k.n, k.k, v));
    }
    s
}

/// The cached split for `key`, if any (the last matching line wins).
pub fn lookup(key: &TuneKey) -> Option<u32> {
    let text = std::fs::read_to_string(tune_file()).ok()?;
    parse(&text).into_iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// `requested` if nonzero, else the cached split for the shape, else the op's default.
pub fn split_for(requested: u32, key: &TuneKey) -> u32 {
    if requested != 0 {
        return requested;
    }
    lookup(key).unwrap_or_else(|| default_split(&key.op))
}

#[cfg(test)]
mod tests {
    use super::*;
    fn key(m: usize) -> TuneKey {
        TuneKey {
            op: "ag-gemm".into(),
            world: 2,
            m,
            n: 4096,
            k: 8192,
        }
    }
    #[test]
    fn round_trip_and_last_entry_wins() {
        let text = render(&[(key(4096), 8), (key(8192), 4)]) + "ag-gemm 2 4096 4096 8192 2\n# comment\nbroken line\n";
        let e = parse(&text);
        assert_eq!(e.len(), 3);
        assert_eq!(
            e.into_iter().rev().find(|(k, _)| *k == key(4096)).map(|(_, v)| v),
            Some(2)
        );
    }
    #[test]
    fn explicit_split_wins_and_missing_cache_falls_back() {
        assert_eq!(split_for(16, &key(1)), 16);
        // SAFETY of the test: points the cache at a file that does not exist.
        std::env::set_var("MKERNEL_TUNE_FILE", "/nonexistent/mkernel-tune.txt");
        assert_eq!(split_for(0, &key(1)), DEFAULT_SPLIT);
        let rs = TuneKey {
            op: "gemm-rs".into(),
            ..key(1)
        };
        assert_eq!(
            split_for(0, &rs),
            DEFAULT_PARTS,
            "GEMM+RS falls back to 1 part, valid for every shape"
        );
    }
}
