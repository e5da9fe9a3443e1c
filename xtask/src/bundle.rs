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
        std::fs::copy(root.join("target/release").join(bin), dir.join(bin))
            .with_context(|| format!("copying {bin}"))?;
    }
    // The PyTorch baseline of `bench --op moe` (found next to mkernel-bench).
    std::fs::copy(root.join("crates/bench/python/moe_torch.py"), dir.join("moe_torch.py"))?;
    let mut child = util::cargo()
        .current_dir(&root)
        .args(["test", "--release", "--workspace", "--no-run", "--message-format=json"])
        .args(exclude.iter().flat_map(|e| ["--exclude", e.as_str()]))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut copied = 0;
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
            std::fs::copy(exe, dir.join("tests").join(&name))?;
            copied += 1;
        }
    }
    anyhow::ensure!(child.wait()?.success(), "building test binaries failed");
    std::fs::copy(root.join("crates/host/ptx/mkernel.ptx"), dir.join("mkernel.ptx"))?;
    let script = dir.join("run-tests.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n# Runs every mkernel test binary with GPU tests on; multi-rank tests (collective*, fused*)\n\
         # run under `xtask launch -n <GPUs>` (fused* and internode* also across 2 emulated nodes). Usage: bundle/run-tests.sh [test-binary args]\n\
         cd \"$(dirname \"$0\")\" || exit 1\nexport MKERNEL_GPU_TESTS=1 NCCL_NVLS_ENABLE=0\n\
         export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}\n\
         NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')\nfail=0\n\
         for t in tests/*; do\n  echo \"== $t\"\n  case \"$t\" in\n\
         *collective*) if [ \"$NGPU\" -ge 2 ]; then ./xtask launch -n \"$NGPU\" --timeout-s 600 -- \"$t\" --include-ignored --test-threads=1 --nocapture \"$@\" || { echo \"FAILED: $t\"; fail=1; }; \\\n\
         else \"$t\" --nocapture || fail=1; fi ;;\n\
         *fused*) if [ \"$NGPU\" -ge 2 ]; then ./xtask launch -n \"$NGPU\" --timeout-s 600 -- \"$t\" --include-ignored --test-threads=1 --nocapture \"$@\" || { echo \"FAILED: $t\"; fail=1; }; \\\n\
         ./xtask launch -n \"$NGPU\" --nodes 2 --timeout-s 600 -- \"$t\" --include-ignored --test-threads=1 --nocapture \"$@\" || { echo \"FAILED: $t (2 nodes)\"; fail=1; }; \\\n\
         else \"$t\" --nocapture || fail=1; fi ;;\n\
         *internode*) if [ \"$NGPU\" -ge 2 ]; then ./xtask launch -n \"$NGPU\" --nodes 2 --timeout-s 600 -- \"$t\" --include-ignored --test-threads=1 --nocapture \"$@\" || { echo \"FAILED: $t\"; fail=1; }; \\\n\
         else \"$t\" --nocapture || fail=1; fi ;;\n\
         *) \"$t\" --include-ignored --test-threads=1 \"$@\" || { echo \"FAILED: $t\"; fail=1; } ;;\n  esac\ndone\n\
         [ $fail = 0 ] && echo 'ALL TEST BINARIES PASSED'\nexit $fail\n",
    )?;
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
        std::fs::copy(root.join("target/release").join(bin), dir.join(bin))
            .with_context(|| format!("copying {bin}"))?;
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
