//! Reduction inputs as values and as the bytes uploaded, and raw-address copies: shared by
//! collectives.rs and internode.rs.
use half::bf16;
use mkernel::ReduceDtype;
use mkernel_tests::data::{random_bf16, random_f32};

/// `len` random elements of `dtype` from `seed`: as f64 (for the reference) and as the bytes to
/// upload.
pub fn values(len: usize, dtype: ReduceDtype, seed: u64) -> (Vec<f64>, Vec<u8>) {
    match dtype {
        ReduceDtype::Bf16 => {
            let v = random_bf16(len, seed);
            (
                v.iter().map(|x| x.to_f64()).collect(),
                v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            )
        }
        ReduceDtype::F32 => {
            let v = random_f32(len, seed);
            (
                v.iter().map(|&x| x as f64).collect(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        }
    }
}

/// Downloaded bytes of `dtype` elements as f64.
pub fn decode(bytes: &[u8], dtype: ReduceDtype) -> Vec<f64> {
    match dtype {
        ReduceDtype::Bf16 => bytes
            .chunks(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
            .collect(),
        ReduceDtype::F32 => bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
    }
}

pub fn htod(addr: u64, bytes: &[u8]) {
    // SAFETY: addr is a device buffer of at least bytes.len() bytes owned by the test.
    unsafe { mkernel::cudarc::driver::result::memcpy_htod_sync(addr, bytes) }.unwrap();
    // From pageable memory cuMemcpyHtoD may return before the DMA lands, and the kernels run on
    // non-blocking streams (and peers read this buffer as soon as our kernel signals Ready):
    // wait for the copy.
    // (The calling thread's current context is the test's device context.)
    mkernel::cudarc::driver::result::ctx::synchronize().unwrap();
}

pub fn dtoh(addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: addr is a device buffer of at least len bytes.
    unsafe { mkernel::cudarc::driver::result::memcpy_dtoh_sync(&mut v, addr) }.unwrap();
    v
}
