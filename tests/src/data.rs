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

/// `len` sparse ternary bf16 values: each entry is 0 with probability 3/4, otherwise +1 or -1
/// with equal probability. Every product of two such values is 0 or ±1, so every dot product
/// and every partial sum of one is an integer, exact in f32 below 2^24 and in bf16 below 2^8
/// whatever the summation order: GPU results over this data can be compared bit for bit.
pub fn ternary_bf16(len: usize, seed: u64) -> Vec<bf16> {
    let mut r = Rng::new(seed);
    (0..len)
        .map(|_| {
            let x = r.next_u64();
            match x >> 61 {
                0 => bf16::ONE,
                1 => bf16::NEG_ONE,
                _ => bf16::ZERO,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ternary_bf16_is_sparse_signed_ones() {
        let n = 1 << 20;
        let v = ternary_bf16(n, 3);
        let count = |x: bf16| v.iter().filter(|&&y| y.to_bits() == x.to_bits()).count();
        let (pos, neg, zero) = (count(bf16::ONE), count(bf16::NEG_ONE), count(bf16::ZERO));
        assert_eq!(pos + neg + zero, n, "only +1, -1 and +0 (no -0, no other values)");
        // Density 1/4 and balanced signs, within ~6 standard deviations.
        let density = (pos + neg) as f64 / n as f64;
        assert!((density - 0.25).abs() < 0.003, "density {density}");
        assert!(
            (pos as f64 - neg as f64).abs() < 6.0 * ((pos + neg) as f64).sqrt(),
            "+1: {pos}, -1: {neg}"
        );
        // Deterministic per seed, different across seeds.
        assert_eq!(v, ternary_bf16(n, 3));
        assert_ne!(v[..1024], ternary_bf16(1024, 4)[..]);
        // A K = 8192 dot product of two such rows (K / 16 nonzero terms expected) stays far
        // below 256 in magnitude, where bf16 stops holding every integer.
        let (a, b) = (ternary_bf16(64 * 8192, 5), ternary_bf16(8192, 6));
        let max = a
            .chunks(8192)
            .map(|row| {
                row.iter()
                    .zip(&b)
                    .map(|(x, y)| x.to_f32() * y.to_f32())
                    .sum::<f32>()
                    .abs()
            })
            .fold(0.0f32, f32::max);
        assert!(max < 128.0, "max |dot| {max}");
    }
}
