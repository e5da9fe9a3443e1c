//! `mkernel-ptx-linker`: the linker rustc invokes for `nvptx64-nvidia-cuda` (flavor "llbc").
//!
//! rustc calls it as
//! `--export-symbol K1 ... <crate bitcode .o> libcore-*.rlib ... -L <sysroot>/lib/rustlib/nvptx64-nvidia-cuda/lib/self-contained
//!  --target nvptx64-nvidia-cuda --target-cpu sm_90a [--target-feature=...] -o out.ptx -O3`.
//! It does what upstream's llvm-bitcode-linker does, with the LLVM tools of the rustup
//! `llvm-tools` component of the same toolchain:
//! 1. `llvm-link --ignore-non-bitcode` every input into one module;
//! 2. `opt` internalizes everything but the exported kernels, drops dead code, optimizes (O3);
//! 3. `llc` lowers to PTX for the target cpu;
//!
//! then it patches `.maxntid` / `.minnctapersm` into each `.entry` from `mkernel_config::KERNELS`
//! (Rust has no launch-bounds attribute) and fails when the PTX still calls an unresolved
//! `.extern .func` or when the kernel table and the PTX disagree.

mod patch;

/// The lowest PTX ISA the kernels need (`red.global.add.v4.f32`), as an `llc` feature; a
/// `+ptxNN` target feature below it is raised to it.
const MIN_PTX_ISA: &str = "+ptx81";
use std::path::PathBuf;
use std::process::{Command, ExitCode};

struct Args {
    exports: Vec<String>,
    inputs: Vec<PathBuf>,
    lib_dirs: Vec<PathBuf>,
    cpu: String,
    features: Vec<String>,
    output: PathBuf,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        exports: vec![],
        inputs: vec![],
        lib_dirs: vec![],
        cpu: "sm_90a".into(),
        features: vec![],
        output: PathBuf::new(),
    };
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--export-symbol" => a.exports.push(value(&arg)?),
            "-o" => a.output = PathBuf::from(value(&arg)?),
            "-L" => a.lib_dirs.push(PathBuf::from(value(&arg)?)),
            "--target" => drop(value(&arg)?),
            "--target-cpu" => a.cpu = value(&arg)?,
            "--target-feature" => a.features.push(value(&arg)?),
            s if s.starts_with("--target-feature=") => a.features.push(s["--target-feature=".len()..].to_string()),
            s if s.starts_with("-L") => a.lib_dirs.push(PathBuf::from(&s[2..])),
            s if s.starts_with('-') => {} // -O3, --debug and anything rustc adds later: no effect on PTX
            _ => a.inputs.push(PathBuf::from(arg)),
        }
    }
    if a.output.as_os_str().is_empty() {
        return Err("no -o <output> given".into());
    }
    Ok(a)
}

/// The LLVM tools of the toolchain that invoked us: `<sysroot>/lib/rustlib/<host>/bin`.
fn llvm_bin(a: &Args) -> Result<PathBuf, String> {
    if let Ok(dir) = std::env::var("MKERNEL_LLVM_BIN") {
        return Ok(PathBuf::from(dir));
    }
    // -L <sysroot>/lib/rustlib/nvptx64-nvidia-cuda/lib/self-contained
    for dir in &a.lib_dirs {
        let rustlib = dir.ancestors().find(|p| p.file_name().is_some_and(|n| n == "rustlib"));
        if let Some(rustlib) = rustlib {
            let bin = rustlib.join(host_triple()).join("bin");
            if bin.join("llvm-link").exists() {
                return Ok(bin);
            }
        }
    }
    let out = Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()
        .map_err(|e| format!("rustc --print sysroot: {e}"))?;
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        .join("lib/rustlib")
        .join(host_triple())
        .join("bin");
    if bin.join("llvm-link").exists() {
        Ok(bin)
    } else {
        Err(format!(
            "LLVM tools not found at {}: run `rustup component add llvm-tools` for the device toolchain",
            bin.display()
        ))
    }
}

fn host_triple() -> &'static str {
    "x86_64-unknown-linux-gnu"
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let status = cmd.status().map_err(|e| format!("{shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed with {status}"))
    }
}

fn link(a: &Args) -> Result<(), String> {
    let bin = llvm_bin(a)?;
    let work = a.output.with_extension("link");
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let linked = work.join("linked.bc");
    let optimized = work.join("optimized.bc");
    let raw_ptx = work.join("raw.ptx");
    let api = work.join("exports.txt");
    std::fs::write(&api, a.exports.join("\n")).map_err(|e| e.to_string())?;

    run(Command::new(bin.join("llvm-link"))
        .arg("--ignore-non-bitcode")
        .args(&a.inputs)
        .arg("-o")
        .arg(&linked))?;
    run(Command::new(bin.join("opt"))
        .arg(format!("--internalize-public-api-file={}", api.display()))
        .arg("--passes=internalize,globaldce,default<O3>,globaldce")
        .arg(&linked)
        .arg("-o")
        .arg(&optimized))?;
    let mut llc = Command::new(bin.join("llc"));
    llc.arg(format!("--mcpu={}", a.cpu));
    let mut feats: Vec<&str> = a
        .features
        .iter()
        .flat_map(|f| f.split(','))
        .filter(|f| !f.is_empty())
        .collect();
    // The kernels need PTX ISA 8.1 (`red.global.add.v4.f32`); LLVM's default for sm_90a is
    // 8.0. Set here rather than as a rustc target feature, which rustc warns is unstable.
    let isa = |f: &str| f.strip_prefix("+ptx").and_then(|v| v.parse::<u32>().ok());
    let min = isa(MIN_PTX_ISA).expect("MIN_PTX_ISA is +ptxNN");
    if !feats.iter().any(|f| isa(f).is_some_and(|v| v >= min)) {
        feats.retain(|f| isa(f).is_none());
        feats.push(MIN_PTX_ISA);
    }
    if !feats.is_empty() {
        llc.arg(format!("--mattr={}", feats.join(",")));
    }
    run(llc.arg(&optimized).arg("-o").arg(&raw_ptx))?;

    let ptx = std::fs::read_to_string(&raw_ptx).map_err(|e| e.to_string())?;
    let patched = patch::finish_ptx(&ptx, mkernel_config::KERNELS)?;
    std::fs::write(&a.output, patched).map_err(|e| e.to_string())?;
    Ok(())
}

fn main() -> ExitCode {
    let result = parse(std::env::args().skip(1)).and_then(|a| link(&a));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mkernel-ptx-linker: {e}");
            ExitCode::FAILURE
        }
    }
}
