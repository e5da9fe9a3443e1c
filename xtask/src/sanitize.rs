//! `xtask sanitize`: compute-sanitizer's memcheck, racecheck and synccheck over the single-GPU
//! kernel tests (GEMM, and each new kernel's tests as they land), on a GPU host.
//!
//! Each (tool, test binary) pair runs `compute-sanitizer --tool T --error-exitcode 1` on the
//! binary with its GPU tests on; the summary line of each run (`ERROR SUMMARY: N errors`) is
//! printed, and any error fails the command.
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The tools run by default.
pub const TOOLS: [&str; 3] = ["memcheck", "racecheck", "synccheck"];

/// Single-GPU kernel test binaries (bundle names). The 200-shape GEMM sweep is left out: its
/// kernels are the listed GEMM tests', and it would take hours under the sanitizer.
pub const TARGETS: [&str; 5] = [
    "mkernel-tests-gemm",
    "mkernel-tests-runtime",
    "mkernel-tests-attention",
    "mkernel-tests-attention_backward",
    "mkernel-tests-moe",
];

/// `compute-sanitizer` on PATH or in the CUDA toolkit.
fn sanitizer() -> Result<PathBuf> {
    if let Some(p) = crate::mps::find_on_path("compute-sanitizer") {
        return Ok(p);
    }
    let p = PathBuf::from("/usr/local/cuda/bin/compute-sanitizer");
    if p.is_file() {
        return Ok(p);
    }
    bail!("compute-sanitizer not found on PATH or in /usr/local/cuda/bin (it ships with the CUDA toolkit)")
}

/// The summary line of a sanitizer run's output: `ERROR SUMMARY: N errors` (memcheck,
/// synccheck) or `RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)` (racecheck, which
/// prints no ERROR SUMMARY line).
pub fn error_summary(output: &str) -> Option<&str> {
    output
        .lines()
        .rev()
        .find(|l| l.contains("ERROR SUMMARY:") || l.contains("RACECHECK SUMMARY:"))
        .map(str::trim)
}

/// Whether a summary line reports zero errors.
pub fn no_errors(summary: &str) -> bool {
    summary.contains("ERROR SUMMARY: 0 errors") || summary.contains("(0 errors")
}

/// Runs every tool over every target binary present in `dir`; fails if any reported an error.
pub fn run(dir: &Path, tools: &[String]) -> Result<()> {
    let san = sanitizer()?;
    let mut lines = vec![];
    let mut failed = 0;
    for bin in TARGETS {
        let path = dir.join(bin);
        if !path.is_file() {
            lines.push(format!("-     {bin}: not built (absent from {})", dir.display()));
            continue;
        }
        for tool in tools {
            println!("== compute-sanitizer --tool {tool} {bin}");
            let mut cmd = Command::new(&san);
            cmd.args(["--tool", tool, "--error-exitcode", "1"]);
            if tool == "racecheck" {
                cmd.args(["--racecheck-report", "all"]);
            }
            cmd.arg(&path).args(["--include-ignored", "--test-threads=1"]);
            cmd.env("MKERNEL_GPU_TESTS", "1");
            crate::util::add_cuda_libs(&mut cmd);
            let out = cmd.output().with_context(|| format!("running {}", san.display()))?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            print!("{text}");
            let summary = error_summary(&text).unwrap_or("no ERROR SUMMARY line").to_string();
            let ok = out.status.success() && no_errors(&summary);
            if !ok {
                failed += 1;
            }
            lines.push(format!(
                "{}  {tool:9} {bin}: {summary}",
                if ok { "PASS" } else { "FAIL" }
            ));
        }
    }
    println!("\n== sanitizer summary");
    for l in &lines {
        println!("{l}");
    }
    if failed > 0 {
        bail!("{failed} sanitizer run(s) reported errors");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn finds_the_error_summary() {
        let out = "========= COMPUTE-SANITIZER\nrunning 3 tests\n========= ERROR SUMMARY: 0 errors\n";
        assert_eq!(super::error_summary(out), Some("========= ERROR SUMMARY: 0 errors"));
        assert_eq!(super::error_summary("nothing"), None);
        assert!(super::no_errors("========= ERROR SUMMARY: 0 errors"));
        assert!(!super::no_errors("========= ERROR SUMMARY: 10 errors"));
    }

    #[test]
    fn finds_the_racecheck_summary() {
        let out = "test result: ok.\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n";
        let s = super::error_summary(out).unwrap();
        assert!(s.starts_with("========= RACECHECK SUMMARY"));
        assert!(super::no_errors(s));
        assert!(!super::no_errors(
            "========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warnings)"
        ));
    }
}
