//! `cargo xtask bundle`: everything a GPU host without Rust needs, in one ignored folder.
//!
//! bundle/
//!   xtask, mkernel-bench       (`./xtask bench --op gemm`, `./xtask launch -n 2 -- ...`)
//!   tests/<crate>-<target>     every test binary of the workspace (release)
//!   moe_torch.py               the PyTorch baseline of `./xtask bench --op moe`
//!   mkernel.ptx                the PTX the binaries embed (for ptxas/ncu inspection)
//!   run-tests.sh               runs every test binary with GPU tests on
//!   examples/<name>            the examples of crates/host/examples (release)
//!   run-examples.sh            runs every example as the README says
use crate::util::{self, root};
use anyhow::{Context, Result};
use std::io::BufRead;
use std::process::{Command, Stdio};

/// `bundle/run-tests.sh`: the GPU suite (`crate::gpu_tests`) over the bundled test binaries.
const RUN_TESTS_SH: &str = r#"#!/bin/sh
# Runs every bundled mkernel test binary with its GPU tests on. Multi-rank binaries run under
# `xtask launch` at 2 and 4 ranks (fused*, ring_*, moe_ep*, agree* and internode* also as 2 emulated nodes x 1 and x 2), sharing
# the GPUs through MPS when the host has fewer GPUs than ranks; the summary names each run's mode.
# `--transport default,tcp` runs every layout of several nodes over the emulated wire and over TCP.
# Usage: bundle/run-tests.sh [--only NAME]... [--ranks 2,4] [--transport default,tcp] [--timeout-s S]
#        [-- test-binary args]
cd "$(dirname "$0")" || exit 1
export MKERNEL_GPU_TESTS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
exec ./xtask gpu-tests --dir tests "$@"
"#;

/// The examples of `crates/host/examples` and the ranks each runs with (1: one process on one
/// GPU; more: under `xtask launch`). A test checks that it lists every example file.
pub const EXAMPLES: [(&str, usize); 8] = [
    ("gemm", 1),
    ("collectives", 2),
    ("ag_gemm", 2),
    ("gemm_rs", 2),
    ("flash_attention", 1),
    ("ring_attention", 2),
    ("moe", 1),
    ("moe_ep", 2),
];

/// `bundle/run-examples.sh`: every example of [`EXAMPLES`], multi-rank ones under `xtask launch`
/// (sharing the GPUs through MPS where the host has fewer than ranks), and a summary.
fn run_examples_sh() -> String {
    let mut s = String::from(
        r#"#!/bin/sh
# Runs every bundled example (crates/host/examples, README "From a Rust server on N GPUs"): single-GPU
# ones as they are, multi-rank ones under `xtask launch` (with --share-gpu where the host has fewer GPUs
# than ranks). Each prints its check against the CPU reference; the summary names failures; exit 1 if any.
cd "$(dirname "$0")" || exit 1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
summary=""
failed=0
run() {
  name=$1; shift
  echo "== $name: $*"
  if "$@"; then
    summary="$summary
PASS  $name"
  else
    summary="$summary
FAIL  $name"
    failed=$((failed + 1))
    sleep 5 # an MPS server tears stopped ranks down before the next launch
  fi
}
"#,
    );
    for (name, ranks) in EXAMPLES {
        if ranks == 1 {
            s += &format!("run {name} examples/{name}\n");
        } else {
            s += &format!("share=\"\"; [ \"$gpus\" -lt {ranks} ] && share=\"--share-gpu\"\n");
            s += &format!("run {name} ./xtask launch -n {ranks} $share --timeout-s 300 -- examples/{name}\n");
        }
    }
    s += "printf '\\n== summary (%s GPU(s))%s\\n%s failed\\n' \"$gpus\" \"$summary\" \"$failed\"\n";
    s += "[ \"$failed\" -eq 0 ]\n";
    s
}

/// The examples of crates/host (release), built: `(name, path)`.
fn example_binaries() -> Result<Vec<(String, std::path::PathBuf)>> {
    let out = util::cargo()
        .current_dir(root())
        .args([
            "build",
            "--release",
            "-p",
            "mkernel",
            "--examples",
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()?;
    anyhow::ensure!(out.status.success(), "building the examples failed");
    let mut bins = vec![];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let example = v["target"]["kind"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "example"));
        if let (true, Some(name), Some(exe)) = (example, v["target"]["name"].as_str(), v["executable"].as_str()) {
            bins.push((name.to_string(), exe.into()));
        }
    }
    Ok(bins)
}

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
    std::fs::create_dir_all(dir.join("examples"))?;
    let examples = example_binaries()?;
    for (name, exe) in &examples {
        std::fs::copy(exe, dir.join("examples").join(name)).with_context(|| format!("copying example {name}"))?;
    }
    let script = dir.join("run-examples.sh");
    std::fs::write(&script, run_examples_sh())?;
    Command::new("chmod").arg("+x").arg(&script).status()?;
    // Symbols are half of each binary's size; the device tool carries 64 MiB per call.
    strip_all(&dir)?;
    std::fs::copy(root.join("crates/host/ptx/mkernel.ptx"), dir.join("mkernel.ptx"))?;
    let script = dir.join("run-tests.sh");
    std::fs::write(&script, RUN_TESTS_SH)?;
    Command::new("chmod").arg("+x").arg(&script).status()?;
    let size: u64 = walk_size(&dir)?;
    println!(
        "bundle/: {copied} test binaries, {} examples, mkernel-bench and xtask, {:.1} MiB (the device tool carries up to 64 MiB)",
        examples.len(),
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

#[cfg(test)]
#[test]
fn the_example_table_lists_every_example_and_how_it_starts() {
    let dir = root().join("crates/host/examples");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".rs").map(String::from))
        .collect();
    files.sort();
    let mut listed: Vec<String> = EXAMPLES.iter().map(|(n, _)| n.to_string()).collect();
    listed.sort();
    assert_eq!(files, listed, "bundle::EXAMPLES against {}", dir.display());
    for (name, ranks) in EXAMPLES {
        let src = std::fs::read_to_string(dir.join(format!("{name}.rs"))).unwrap();
        let launched = src.contains(&format!(
            "cargo xtask launch -n {ranks} -- target/release/examples/{name}"
        ));
        assert_eq!(
            launched,
            ranks > 1,
            "{name}.rs: its `Run:` line and its ranks ({ranks}) disagree"
        );
    }
    let sh = run_examples_sh();
    assert!(sh.contains("run gemm examples/gemm\n"), "{sh}");
    assert!(
        sh.contains("run moe_ep ./xtask launch -n 2 $share --timeout-s 300 -- examples/moe_ep\n"),
        "{sh}"
    );
    let path = std::env::temp_dir().join(format!("mkernel-run-examples-{}.sh", std::process::id()));
    std::fs::write(&path, &sh).unwrap();
    let syntax = Command::new("sh").arg("-n").arg(&path).output().unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        syntax.status.success(),
        "{}\n{sh}",
        String::from_utf8_lossy(&syntax.stderr)
    );
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
    for d in [dir.to_path_buf(), dir.join("tests"), dir.join("examples")] {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_file() && p.extension().is_none() {
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
