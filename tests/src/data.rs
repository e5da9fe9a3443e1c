//! Deterministic test data.
use half::bf16;

/// xorshift64* stream: reproducible without a rand dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// `len` bf16 values uniform in [-1, 1).
pub fn random_bf16(len: usize, seed: u64) -> Vec<bf16> {
    let mut r = Rng::new(seed);
    (0..len).map(|_| bf16::from_f32(r.uniform())).collect()
}

/// `len` f32 values uniform in [-1, 1).
pub fn random_f32(len: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..len).map(|_| r.uniform()).collect()
}
