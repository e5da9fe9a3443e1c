//! Small helpers shared by the tasks.
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

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

/// The workspace's target directory as `cargo metadata` reports it: `CARGO_TARGET_DIR`,
/// `build.target-dir` or `<root>/target`. Asked once per process.
pub fn target_dir() -> Result<PathBuf> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    if let Some(d) = DIR.get() {
        return Ok(d.clone());
    }
    let out = cargo()
        .current_dir(root())
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .context("running `cargo metadata` (for the target directory)")?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        bail!(
            "`cargo metadata` failed: {}",
            why.lines().find(|l| !l.trim().is_empty()).unwrap_or("no message")
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing `cargo metadata` output")?;
    let dir = v["target_directory"]
        .as_str()
        .context("`cargo metadata` reported no target_directory")?;
    Ok(DIR.get_or_init(|| PathBuf::from(dir)).clone())
}

/// Where `cargo build --release` puts binaries: `<target dir>/release`.
pub fn release_dir() -> Result<PathBuf> {
    Ok(target_dir()?.join("release"))
}

/// `cmd`'s program and arguments, for messages (no environment or folder).
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd`, failing with its command line when it fails (the program printed its own
/// error above).
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting `{}`", describe(cmd)))?;
    if !status.success() {
        bail!("`{}` failed ({status})", describe(cmd));
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

/// GPUs a CUDA program started from here sees (`nvidia-smi`, narrowed by
/// `CUDA_VISIBLE_DEVICES`).
pub fn gpu_count() -> Result<usize> {
    let found = crate::gpus::probe()?;
    let n = crate::gpus::visible(found.names.len(), std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref());
    if n == 0 {
        bail!("CUDA_VISIBLE_DEVICES hides every GPU");
    }
    Ok(n)
}
