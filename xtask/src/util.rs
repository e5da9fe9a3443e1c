//! Small helpers shared by the tasks.
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;

/// The workspace root (xtask's manifest is one level down). In a bundle: the bundle folder.
pub fn root() -> PathBuf {
    match option_env!("CARGO_MANIFEST_DIR") {
        Some(dir) if PathBuf::from(dir).exists() => PathBuf::from(dir).parent().unwrap().to_path_buf(),
        _ => std::env::current_dir().unwrap(),
    }
}

/// `cargo` of the invoking toolchain.
pub fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Runs `cmd`, failing with its command line when it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

/// Puts the CUDA toolkit's libraries (cuBLAS) on the loader path when they exist: the GPU
/// hosts keep them in /usr/local/cuda/lib64, off the default LD_LIBRARY_PATH.
pub fn add_cuda_libs(cmd: &mut Command) {
    cmd.env("LD_LIBRARY_PATH", cuda_lib_path());
}

/// LD_LIBRARY_PATH with the CUDA toolkit's library folders in front.
pub fn cuda_lib_path() -> String {
    let mut paths: Vec<String> = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
        .iter()
        .filter(|p| std::path::Path::new(p).exists())
        .map(|s| s.to_string())
        .collect();
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
        paths.push(old);
    }
    paths.join(":")
}

/// GPUs on this host, from `nvidia-smi -L`.
pub fn gpu_count() -> Result<usize> {
    let out = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .context("running nvidia-smi -L (pass --nproc on hosts without it)")?;
    let n = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("GPU "))
        .count();
    if n == 0 {
        bail!("nvidia-smi lists no GPU");
    }
    Ok(n)
}
