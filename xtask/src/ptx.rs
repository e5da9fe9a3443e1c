//! `cargo xtask ptx`: Rust kernels -> PTX -> ptxas report.
//!
//! 1. builds crates/ptx-linker (stable) — the link step rustc's nvptx target calls;
//! 2. builds crates/device with its pinned nightly (`-Zbuild-std=core`), from an environment
//!    cleared of the outer cargo's variables so crates/device/rust-toolchain.toml applies;
//! 3. stores the PTX in crates/host/ptx/mkernel.ptx (or, with --check, compares);
//! 4. assembles it with `ptxas -arch=sm_90a -v` and prints registers, spills and shared memory
//!    per kernel; spills or ptxas performance warnings fail --check.
use crate::util::{self, root};
use anyhow::{bail, Context, Result};
use mkernel_config::KERNELS;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The nightly that builds crates/device (also pinned in crates/device/rust-toolchain.toml).
pub const DEVICE_TOOLCHAIN: &str = "nightly-2026-05-20";
/// The PyPI wheel that carries ptxas of the GPU hosts' CUDA version.
const PTXAS_WHEEL: &str = "nvidia-cuda-nvcc==13.0.88";

const COMMITTED: &str = "crates/host/ptx/mkernel.ptx";
const BUILT: &str = "crates/device/target/nvptx64-nvidia-cuda/release/mkernel_device.ptx";

/// Whether the device toolchain with rust-src and llvm-tools is installed.
pub fn device_toolchain_installed() -> bool {
    let Ok(out) = Command::new("rustup")
        .args(["run", DEVICE_TOOLCHAIN, "rustc", "--print", "sysroot"])
        .output()
    else {
        return false;
    };
    if !out.status.success() {
        return false;
    }
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    sysroot.join("lib/rustlib/src/rust/library/core").exists()
        && sysroot
            .join("lib/rustlib/x86_64-unknown-linux-gnu/bin/llvm-link")
            .exists()
}

pub fn run(check: bool) -> Result<()> {
    let root = root();
    build_device(&root)?;
    let fresh = std::fs::read_to_string(root.join(BUILT)).with_context(|| format!("reading {BUILT}"))?;
    let committed_path = root.join(COMMITTED);
    if check {
        let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
        if committed != fresh {
            bail!("{COMMITTED} does not match the kernels' source: run `cargo xtask ptx` and commit the result");
        }
        println!("{COMMITTED} matches a fresh build of crates/device");
    } else {
        std::fs::write(&committed_path, &fresh)?;
        println!("wrote {COMMITTED} ({} bytes)", fresh.len());
    }
    let report = ptxas_report(&root, &committed_path)?;
    let problems = print_report(&report);
    if check && !problems.is_empty() {
        bail!("ptxas: {}", problems.join("; "));
    }
    Ok(())
}

/// A variant of the kernels for an A/B run (`cargo xtask bundle --variant NAME`): crates/device
/// built with `--cfg mk_variant="NAME"` (device code may switch on `cfg!(mk_variant = "NAME")`),
/// its ptxas report printed. Returns the PTX; the committed one is not touched.
pub fn variant_ptx(name: &str) -> Result<String> {
    let root = root();
    build_device_with(&root, Some(name))?;
    let ptx = std::fs::read_to_string(root.join(BUILT)).with_context(|| format!("reading {BUILT}"))?;
    let path = util::target_dir()?.join("ptxas").join(format!("mkernel-{name}.ptx"));
    std::fs::create_dir_all(path.parent().unwrap())?;
    std::fs::write(&path, &ptx)?;
    let problems = print_report(&ptxas_report(&root, &path)?);
    if !problems.is_empty() {
        println!("variant {name}: {}", problems.join("; "));
    }
    Ok(ptx)
}

/// The PTX the host crate embeds (`crates/host/ptx/mkernel.ptx`).
pub fn committed_path() -> PathBuf {
    root().join(COMMITTED)
}

fn build_device(root: &Path) -> Result<()> {
    build_device_with(root, None)
}

fn build_device_with(root: &Path, variant: Option<&str>) -> Result<()> {
    if !device_toolchain_installed() {
        bail!("the device toolchain is missing: `rustup toolchain install {DEVICE_TOOLCHAIN} --profile minimal --component rust-src,llvm-tools`");
    }
    util::run(
        util::cargo()
            .current_dir(root)
            .args(["build", "--quiet", "--release", "-p", "mkernel-ptx-linker"]),
    )?;
    let mut cmd = Command::new("rustup");
    cmd.current_dir(root.join("crates/device"));
    match variant {
        // `cargo rustc`: the flag reaches the device crate alone (not core, not mkernel-config).
        Some(name) => cmd
            .args([
                "run",
                DEVICE_TOOLCHAIN,
                "cargo",
                "rustc",
                "--quiet",
                "--release",
                "--",
                "--cfg",
            ])
            .arg(format!("mk_variant=\"{name}\"")),
        None => cmd.args(["run", DEVICE_TOOLCHAIN, "cargo", "build", "--quiet", "--release"]),
    };
    for (k, _) in std::env::vars() {
        let outer = k.starts_with("CARGO")
            || k.starts_with("RUSTC")
            || k.starts_with("RUSTUP_TOOLCHAIN")
            || matches!(
                k.as_str(),
                "RUSTFLAGS" | "RUSTDOCFLAGS" | "TARGET" | "HOST" | "OPT_LEVEL" | "PROFILE" | "DEBUG" | "OUT_DIR"
            );
        if outer && k != "CARGO_HOME" {
            cmd.env_remove(&k);
        }
    }
    // The linker was built into the workspace's target directory, wherever that is (the device
    // crate's .cargo/config.toml names the default one).
    cmd.env(
        "CARGO_TARGET_NVPTX64_NVIDIA_CUDA_LINKER",
        util::release_dir()?.join("mkernel-ptx-linker"),
    );
    util::run(&mut cmd).context("building crates/device to PTX")
}

/// ptxas from $PTXAS, the project's .tools folder (installed on first use), or PATH.
pub fn ptxas(root: &Path) -> Result<PathBuf> {
    if let Ok(p) = std::env::var("PTXAS") {
        return Ok(PathBuf::from(p));
    }
    let local = root.join(".tools/nvcc/nvidia/cu13/bin/ptxas");
    if !local.exists() {
        println!("installing ptxas ({PTXAS_WHEEL}) into .tools/nvcc");
        util::run(
            Command::new("python3")
                .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
                .arg(root.join(".tools/nvcc"))
                .arg(PTXAS_WHEEL),
        )?;
    }
    Ok(local)
}

/// What ptxas said about one entry.
#[derive(Default, Debug)]
pub struct EntryReport {
    pub name: String,
    pub registers: u32,
    pub stack: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub static_smem: u32,
}

pub struct Report {
    pub entries: Vec<EntryReport>,
    pub warnings: Vec<String>,
}

fn ptxas_report(root: &Path, ptx: &Path) -> Result<Report> {
    let out_dir = util::target_dir()?.join("ptxas");
    std::fs::create_dir_all(&out_dir)?;
    let out = Command::new(ptxas(root)?)
        .args(["-arch=sm_90a", "-v"])
        .arg(ptx)
        .arg("-o")
        .arg(out_dir.join("mkernel.cubin"))
        .output()
        .context("running ptxas")?;
    let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("ptxas rejected the PTX:\n{text}");
    }
    Ok(parse_ptxas(&text))
}

/// Parses `ptxas -v` output.
pub fn parse_ptxas(text: &str) -> Report {
    let num_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|p| p.contains(unit))
            .and_then(|p| p.split_whitespace().find_map(|w| w.parse().ok()))
            .unwrap_or(0)
    };
    let mut entries: Vec<EntryReport> = vec![];
    let mut warnings = vec![];
    // Whose "Function properties" the next "stack frame" line gives: the entry's own, or a
    // called (non-inlined) function's, printed after the entry's (its spills count for the entry).
    let mut props_of = String::new();
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            entries.push(EntryReport {
                name: rest.split('\'').next().unwrap_or("").to_string(),
                ..Default::default()
            });
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            props_of = rest.trim().to_string();
        } else if let Some(e) = entries.last_mut() {
            if line.contains("bytes stack frame") {
                if props_of == e.name {
                    e.stack = num_before(line, "stack frame");
                    e.spill_stores = num_before(line, "spill stores");
                    e.spill_loads = num_before(line, "spill loads");
                } else {
                    e.spill_stores += num_before(line, "spill stores");
                    e.spill_loads += num_before(line, "spill loads");
                }
            } else if line.contains("Used") && line.contains("registers") {
                e.registers = line
                    .split("Used ")
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                e.static_smem = num_before(line, "bytes smem");
            }
        }
        if line.contains("Potential Performance Loss") || line.contains("warning") {
            warnings.push(line.trim().to_string());
        }
    }
    Report { entries, warnings }
}

/// Prints the table; returns what should fail a check.
fn print_report(r: &Report) -> Vec<String> {
    println!(
        "{:<20} {:>7} {:>5} {:>6} {:>12} {:>11} {:>11} {:>12}",
        "kernel", "threads", "regs", "stack", "spill st/ld", "static smem", "dyn smem", "min CTAs/SM"
    );
    let mut problems = vec![];
    for e in &r.entries {
        let spec = KERNELS.iter().find(|k| k.name == e.name);
        let (threads, dyn_smem, min) = spec
            .map(|s| (s.max_threads, s.dynamic_smem, s.min_blocks_per_sm))
            .unwrap_or((0, 0, 0));
        println!(
            "{:<20} {:>7} {:>5} {:>6} {:>5}/{:<6} {:>11} {:>11} {:>12}",
            e.name, threads, e.registers, e.stack, e.spill_stores, e.spill_loads, e.static_smem, dyn_smem, min
        );
        if e.spill_stores + e.spill_loads > 0 {
            problems.push(format!(
                "{} spills {} / {} bytes",
                e.name, e.spill_stores, e.spill_loads
            ));
        }
    }
    for w in &r.warnings {
        println!("ptxas: {w}");
        problems.push(w.clone());
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses_ptxas_verbose_output() {
        let text = "ptxas info    : Compiling entry function 'mk_gemm_bf16_nk' for 'sm_90a'\n\
            ptxas info    : Function properties for mk_gemm_bf16_nk\n    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
            ptxas info    : Used 168 registers, used 1 barriers, 16 bytes smem\n\
            ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored\n";
        let r = parse_ptxas(text);
        assert_eq!(r.entries.len(), 1);
        let e = &r.entries[0];
        assert_eq!(
            (e.registers, e.spill_stores, e.spill_loads, e.static_smem),
            (168, 8, 4, 16)
        );
        assert_eq!(r.warnings.len(), 1);
    }
    #[test]
    fn a_called_functions_properties_do_not_replace_the_entrys() {
        // ptxas prints a non-inlined function's properties after the entry's.
        let text = "ptxas info    : Compiling entry function 'mk_gemm_rs_bf16_nk' for 'sm_90a'\n\
            ptxas info    : Function properties for mk_gemm_rs_bf16_nk\n    144 bytes stack frame, 16 bytes spill stores, 152 bytes spill loads\n\
            ptxas info    : Used 168 registers, used 16 barriers, 144 bytes cumulative stack size\n\
            ptxas info    : Function properties for mk_internal_func_0\n    0 bytes stack frame, 0 bytes spill stores, 8 bytes spill loads\n";
        let r = parse_ptxas(text);
        let e = &r.entries[0];
        assert_eq!((e.stack, e.spill_stores, e.spill_loads), (144, 16, 160));
    }
}
