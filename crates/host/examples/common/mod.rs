//! What the examples share: one-line errors, this rank's GPU and bootstrap from the torchrun
//! variables, test data, copies in and out of the symmetric heap, the CPU check.
#![allow(dead_code)] // each example uses a part

use half::bf16;
use mkernel::bootstrap::Bootstrap;
use mkernel::cudarc::driver::{result, CudaStream, DeviceRepr, ValidAsZeroBits};
use mkernel::{Communicator, Device, SymBuffer};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

pub type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// Steps of every example's loop: new inputs, the same plan.
pub const STEPS: u64 = 3;

/// Runs an example: an error (no GPU, a mismatch) is one line `name: error: ...` and exit
/// status 1.
pub fn run(name: &str, body: impl FnOnce() -> Result) -> ExitCode {
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// This rank's GPU and bootstrap from the variables `cargo xtask launch` (or torchrun with
/// `MKERNEL_JOB_KEY` added) sets: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
/// MASTER_PORT, MKERNEL_JOB_KEY, MKERNEL_DEVICE (default LOCAL_RANK).
pub fn rank() -> Result<(Device, Bootstrap)> {
    mkernel::runtime::device_count()?; // no driver: say so before anything else
    if std::env::var_os("RANK").is_none() {
        let me = std::env::args().next().unwrap_or_default();
        return Err(format!(
            "not started as ranks: run `cargo xtask launch -n 2 -- {me}` (add --share-gpu on a one-GPU host)"
        )
        .into());
    }
    // Connects to rank 0's store (MASTER_ADDR:MASTER_PORT), proves the job key, waits for every rank.
    let boot = Bootstrap::from_env(Duration::from_secs(60))?;
    let dev = Device::new(boot.info().device())?;
    Ok((dev, boot))
}

/// `len` bf16 values uniform in `[-scale, scale)`, the same for the same seed on every rank.
pub fn random_bf16(len: usize, seed: u64, scale: f32) -> Vec<bf16> {
    random_f32(len, seed, scale).into_iter().map(bf16::from_f32).collect()
}

/// `len` f32 values uniform in `[-scale, scale)` (xorshift64*).
pub fn random_f32(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            u * scale
        })
        .collect()
}

/// `C = A B^T` in f64: A is `m x k`, B is `n x k` (the `nn.Linear` layout), both row-major.
pub fn matmul_nt(a: &[bf16], b: &[bf16], m: usize, n: usize, k: usize) -> Vec<f64> {
    let a: Vec<f64> = a.iter().map(|x| x.to_f64()).collect();
    let b: Vec<f64> = b.iter().map(|x| x.to_f64()).collect();
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[j * k + p]).sum();
        }
    }
    c
}

/// Compares `got` with the CPU reference `want`: fails when an element is off by more than
/// `rel` x the largest |want| (room for bf16 roundings of the results on the way), prints
/// `name: max abs err E vs CPU reference: ok` otherwise.
pub fn check(name: &str, got: impl IntoIterator<Item = f64>, want: &[f64], rel: f64) -> Result {
    let tol = rel * want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let mut n = 0;
    let mut err = 0.0f64;
    for (g, w) in got.into_iter().zip(want) {
        err = err.max(if g.is_nan() { f64::INFINITY } else { (g - w).abs() });
        n += 1;
    }
    if n != want.len() {
        return Err(format!("{name}: {n} values, the reference has {}", want.len()).into());
    }
    if err > tol {
        return Err(format!("{name}: max abs err {err:.1e} vs CPU reference exceeds {tol:.1e}: MISMATCH").into());
    }
    println!("{name}: max abs err {err:.1e} vs CPU reference: ok");
    Ok(())
}

/// Copies `data` into this rank's part of heap buffer `b`, after `stream`'s work.
///
/// The heap has no cudarc handle (`SymBuffer` is an offset): copies go through its raw address.
pub fn write_heap<T: DeviceRepr>(comm: &Communicator, stream: &Arc<CudaStream>, b: &SymBuffer, data: &[T]) -> Result {
    if std::mem::size_of_val(data) as u64 > b.bytes() {
        return Err(format!(
            "{} bytes do not fit a heap buffer of {}",
            std::mem::size_of_val(data),
            b.bytes()
        )
        .into());
    }
    stream.synchronize()?;
    // SAFETY: `comm.ptr` is this rank's address of `b`, which holds `data` (checked above); no
    // kernel runs (synchronized).
    unsafe { result::memcpy_htod_sync(comm.ptr(b)?, data)? };
    Ok(())
}

/// The first `len` elements of this rank's part of heap buffer `b`, after `stream`'s work.
pub fn read_heap<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    b: &SymBuffer,
    len: usize,
) -> Result<Vec<T>> {
    if (len * std::mem::size_of::<T>()) as u64 > b.bytes() {
        return Err(format!("{len} elements exceed a heap buffer of {} bytes", b.bytes()).into());
    }
    stream.synchronize()?;
    let mut v = vec![T::default(); len];
    // SAFETY: as in `write_heap`, reading.
    unsafe { result::memcpy_dtoh_sync(&mut v, comm.ptr(b)?)? };
    Ok(v)
}
