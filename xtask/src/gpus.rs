//! What this host offers GPU programs: the NVIDIA driver and its GPUs (from `nvidia-smi`), and
//! the check `launch` makes before it starts any rank.
use anyhow::{bail, Result};
use std::process::Command;

/// The driver and the GPUs `nvidia-smi` lists.
#[derive(Debug, PartialEq, Eq)]
pub struct Gpus {
    pub driver: String,
    /// Names, by ordinal.
    pub names: Vec<String>,
}

impl Gpus {
    /// `NVIDIA driver 580.159, 2 GPUs: 2 x NVIDIA H100 80GB HBM3`.
    pub fn summary(&self) -> String {
        let n = self.names.len();
        let plural = if n == 1 { "" } else { "s" };
        let names = if n > 1 && self.names.iter().all(|x| x == &self.names[0]) {
            format!("{n} x {}", self.names[0])
        } else {
            self.names.join(", ")
        };
        format!("NVIDIA driver {}, {n} GPU{plural}: {names}", self.driver)
    }
}

/// Parses `nvidia-smi --query-gpu=driver_version,name --format=csv,noheader` (one GPU a line).
pub fn parse(text: &str) -> Result<Gpus> {
    let mut driver = String::new();
    let mut names = vec![];
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let Some((d, name)) = line.split_once(',') else {
            bail!("unexpected nvidia-smi line {line:?}");
        };
        driver = d.trim().to_string();
        names.push(name.trim().to_string());
    }
    if names.is_empty() {
        bail!("the NVIDIA driver is loaded but lists no GPU");
    }
    Ok(Gpus { driver, names })
}

/// The driver and GPUs of this host, or a one-line reason why there are none.
pub fn probe() -> Result<Gpus> {
    let out = match Command::new("nvidia-smi")
        .args(["--query-gpu=driver_version,name", "--format=csv,noheader"])
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("no NVIDIA driver found (nvidia-smi is not on PATH)")
        }
        Err(e) => bail!("running nvidia-smi: {e}"),
    };
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("no message");
        bail!("no usable NVIDIA driver: nvidia-smi failed ({}): {first}", out.status);
    }
    parse(&String::from_utf8_lossy(&out.stdout))
}

/// GPUs a CUDA program of this process sees: `found`, or fewer when `CUDA_VISIBLE_DEVICES`
/// (`visible`) names fewer.
pub fn visible(found: usize, visible: Option<&str>) -> usize {
    match visible {
        None => found,
        Some(v) => v.split(',').filter(|x| !x.trim().is_empty()).count().min(found),
    }
}

/// The check `launch` makes before it starts ranks: a driver and enough GPUs for `nproc` ranks
/// (one each, or shared through MPS with `share_gpu` over `gpus` of them). Prints what it
/// found; returns the GPUs the ranks can use.
pub fn check_launch(nproc: usize, share_gpu: bool, gpus: Option<usize>) -> Result<usize> {
    let hint = "(pass --cpu-only to start a program that needs no GPU)";
    let found = match probe() {
        Ok(g) => g,
        Err(e) => bail!("launch: {e:#}; the ranks were not started {hint}"),
    };
    let cvd = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let n = visible(found.names.len(), cvd.as_deref());
    let shown = match &cvd {
        Some(v) => format!(" ({n} visible through CUDA_VISIBLE_DEVICES={v})"),
        None => String::new(),
    };
    println!("launch: {}{shown}", found.summary());
    if n == 0 {
        bail!("launch: CUDA_VISIBLE_DEVICES hides every GPU; the ranks were not started {hint}");
    }
    match (share_gpu, gpus) {
        (true, Some(g)) if g > n => bail!("launch: --gpus {g}, but this host shows {n} GPU(s)"),
        (false, _) if nproc > n => bail!(
            "launch: {nproc} ranks need {nproc} GPUs (one each) and this host shows {n}: add --share-gpu to let \
             the ranks share the GPUs through NVIDIA MPS"
        ),
        _ => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses_nvidia_smi() {
        let g = parse("580.159, NVIDIA H100 80GB HBM3\n580.159, NVIDIA H100 80GB HBM3\n").unwrap();
        assert_eq!(g.names.len(), 2);
        assert_eq!(g.summary(), "NVIDIA driver 580.159, 2 GPUs: 2 x NVIDIA H100 80GB HBM3");
        let g = parse("580.159, NVIDIA H200\n").unwrap();
        assert_eq!(g.summary(), "NVIDIA driver 580.159, 1 GPU: NVIDIA H200");
        assert!(parse("").unwrap_err().to_string().contains("lists no GPU"));
        assert!(parse("garbage").is_err());
    }
    #[test]
    fn cuda_visible_devices_narrows_the_count() {
        assert_eq!(visible(4, None), 4);
        assert_eq!(visible(4, Some("0,2")), 2);
        assert_eq!(visible(1, Some("0,1,2")), 1);
        assert_eq!(visible(4, Some("")), 0);
    }
}
