//! `cargo xtask bundle`: everything a GPU host without Rust needs, in one ignored folder.
//!
//! bundle/
//!   xtask, mkernel-bench       (`./xtask bench --op gemm`, `./xtask launch -n 2 -- ...`)
//!   tests/<crate>-<target>     every test binary of the workspace (release)
//!   moe_torch.py               the PyTorch baseline of `./xtask bench --op moe`
//!   mkernel.ptx                the PTX the binaries embed (for ptxas/ncu inspection)
//!   run-tests.sh               runs every test binary with GPU tests on
use crate::util::{self, root};
use anyhow::{Context, Result};
use std::io::BufRead;
use std::process::{Command, Stdio};

/// `bundle/run-tests.sh`: the GPU suite (`crate::gpu_tests`) over the bundled test binaries.
const RUN_TESTS_SH: &str = r#"#!/bin/sh
# Runs every bundled mkernel test binary with its GPU tests on. Multi-rank binaries run under
# `xtask launch` at 2 and 4 ranks (fused* and internode* also as 2 emulated nodes x 1 and x 2), sharing
# the GPUs through MPS when the host has fewer GPUs than ranks; the summary names each run's mode.
# `--transport default,tcp` runs every layout of several nodes over the emulated wire and over TCP.
# Usage: bundle/run-tests.sh [--only NAME]... [--ranks 2,4] [--transport default,tcp] [--timeout-s S]
#        [-- test-binary args]
cd "$(dirname "$0")" || exit 1
export MKERNEL_GPU_TESTS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
exec ./xtask gpu-tests --dir tests "$@"
"#;

/// Every test binary of the workspace (release), built: `(bundle name, path)`.
pub fn test_binaries(exclude: &[String]) -> Result<Vec<(String, std::path::PathBuf)>> {
    let mut child = util::cargo()
        .current_dir(root())
        .args(["test", "--release", "--workspace", "--no-run", "--message-format=json"])
        .args(exclude.iter().flat_map(|e| ["--exclude", e.as_str()]))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut out = vec![];
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let v: serde_json::Value = match serde_json::from_str(&line?) {
            Ok(v) => v,
            Err(_) => continue,
        };
        let is_test = v["profile"]["test"].as_bool() == Some(true);
        if let (true, Some(exe)) = (is_test, v["executable"].as_str()) {
            let krate = v["package_id"].as_str().and_then(crate_name).unwrap_or("crate");
            let target = v["target"]["name"].as_str().unwrap_or("t");
            let name = if target.replace('-', "_") == krate.replace('-', "_") {
                krate.to_string()
            } else {
                format!("{krate}-{target}")
            };
            out.push((name, exe.into()));
        }
    }
    anyhow::ensure!(child.wait()?.success(), "building test binaries failed");
    Ok(out)
}

pub fn run(exclude: &[String]) -> Result<()> {
    let root = root();
    let dir = root.join("bundle");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("tests"))?;
    util::run(util::cargo().current_dir(&root).args([
        "build",
        "--quiet",
        "--release",
        "-p",
        "mkernel-bench",
        "-p",
        "xtask",
    ]))?;
    for bin in ["mkernel-bench", "xtask"] {
        std::fs::copy(util::release_dir()?.join(bin), dir.join(bin)).with_context(|| format!("copying {bin}"))?;
    }
    // The PyTorch baseline of `bench --op moe` (found next to mkernel-bench).
    std::fs::copy(root.join("crates/bench/python/moe_torch.py"), dir.join("moe_torch.py"))?;
    let bins = test_binaries(exclude)?;
    for (name, exe) in &bins {
        std::fs::copy(exe, dir.join("tests").join(name))?;
    }
    let copied = bins.len();
    // Symbols are half of each binary's size; the device tool carries 64 MiB per call.
    strip_all(&dir)?;
    std::fs::copy(root.join("crates/host/ptx/mkernel.ptx"), dir.join("mkernel.ptx"))?;
    let script = dir.join("run-tests.sh");
    std::fs::write(&script, RUN_TESTS_SH)?;
    Command::new("chmod").arg("+x").arg(&script).status()?;
    let size: u64 = walk_size(&dir)?;
    println!(
        "bundle/: {copied} test binaries + mkernel-bench + xtask, {:.1} MiB (the device tool carries up to 64 MiB)",
        size as f64 / (1 << 20) as f64
    );
    Ok(())
}

/// `cargo xtask bundle --variant NAME`: the benchmark and xtask on the kernels built with
/// `--cfg mk_variant="NAME"` ([`crate::ptx::variant_ptx`]) into bundle/NAME/. The variant's PTX
/// stands in for the committed one only while the two binaries build; the committed file is
/// restored (also when the build fails), so the next plain build embeds it again.
pub fn variant(name: &str) -> Result<()> {
    anyhow::ensure!(
        variant_name_ok(name),
        "--variant {name:?}: a name of letters, digits, '-' and '_' (it names a folder and a cfg value)"
    );
    let root = root();
    let ptx = crate::ptx::variant_ptx(name)?;
    let committed = crate::ptx::committed_path();
    let keep = std::fs::read_to_string(&committed).context("reading the committed PTX")?;
    std::fs::write(&committed, &ptx)?;
    let built = util::run(util::cargo().current_dir(&root).args([
        "build",
        "--quiet",
        "--release",
        "-p",
        "mkernel-bench",
        "-p",
        "xtask",
    ]));
    std::fs::write(&committed, &keep).context("restoring the committed PTX")?;
    built?;
    let dir = root.join("bundle").join(name);
    std::fs::create_dir_all(&dir)?;
    for bin in ["mkernel-bench", "xtask"] {
        std::fs::copy(util::release_dir()?.join(bin), dir.join(bin)).with_context(|| format!("copying {bin}"))?;
    }
    // The PyTorch baseline of `bench --op moe` (found next to mkernel-bench).
    std::fs::copy(root.join("crates/bench/python/moe_torch.py"), dir.join("moe_torch.py"))?;
    let same = ptx == keep;
    println!(
        "bundle/{name}/: mkernel-bench + xtask on kernels built with --cfg mk_variant=\"{name}\"{}",
        if same {
            " (PTX identical to the committed one: nothing switches on this variant)"
        } else {
            ""
        }
    );
    Ok(())
}

/// A variant's name becomes a folder of bundle/ and a `cfg` string: letters, digits, `-`, `_`.
fn variant_name_ok(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

#[cfg(test)]
#[test]
fn variant_names_are_plain() {
    assert!(variant_name_ok("evict-first_2"));
    for bad in ["", "../x", "a b", "a\"b", "x/y"] {
        assert!(!variant_name_ok(bad), "{bad:?}");
    }
}

/// `path+file:///.../tests#mkernel-tests@0.1.0` -> `mkernel-tests`;
/// `path+file:///.../xtask#0.1.0` (name = folder) -> `xtask`.
fn crate_name(id: &str) -> Option<&str> {
    let (path, tail) = id.rsplit_once('#')?;
    match tail.split_once('@') {
        Some((name, _)) => Some(name),
        None => path.rsplit('/').next(),
    }
}

#[cfg(test)]
#[test]
fn crate_names_from_package_ids() {
    assert_eq!(
        crate_name("path+file:///w/tests#mkernel-tests@0.1.0"),
        Some("mkernel-tests")
    );
    assert_eq!(crate_name("path+file:///w/xtask#0.1.0"), Some("xtask"));
}

/// `strip` every file in `dir` and `dir/tests` (where `strip` exists; the PTX and script fail it
/// harmlessly and are left as they are).
fn strip_all(dir: &std::path::Path) -> Result<()> {
    if crate::mps::find_on_path("strip").is_none() {
        return Ok(());
    }
    for d in [dir.to_path_buf(), dir.join("tests")] {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_file() && p.extension().is_none() && !p.ends_with("run-tests.sh") {
                let _ = Command::new("strip").arg(&p).stderr(Stdio::null()).status();
            }
        }
    }
    Ok(())
}

fn walk_size(dir: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        total += if e.file_type()?.is_dir() {
            walk_size(&e.path())?
        } else {
            e.metadata()?.len()
        };
    }
    Ok(total)
}
